#!/usr/bin/env bash
# Usage: scripts/adapter-export-tests.sh. Exported adapters in their real consumers
# (scripts/test_adapter_export.py): PEFT's logprobs, llama.cpp's convert_lora_to_gguf.py and
# llama-server --lora, the merged GGUF served by temper and llama-server, the PEFT export imported
# back; on the default model through a fresh `temper serve` (target/release/temper, built by the
# caller). Needs the pinned venv of scripts/train-ref-venv.sh and the pinned llama.cpp of
# scripts/build-llama-cpp.sh (both installed or built on first use, outside the checkout). Ends
# with one `test result:` line like cargo's. About 2-3 minutes on 2 cores once those exist.
set -euo pipefail
cd "$(dirname "$0")/.."
python=$(scripts/train-ref-venv.sh)
model=$(scripts/fetch-model.sh)
bin=$(scripts/build-llama-cpp.sh)
src=$(echo "$(dirname "$bin")"/src/*/vendor/llama.cpp)
exec "$python" -W ignore scripts/test_adapter_export.py --temper target/release/temper \
    --model "$model" --llama-server "$bin/llama-server" --llama-cpp-src "$src"
