#!/usr/bin/env bash
# Usage: scripts/adapter-export-tests.sh. Exported adapters in their real consumers
# (scripts/test_adapter_export.py): PEFT on the tiny model of every family (q/k row order
# included; its inputs written by an ignored test of crates/model/tests/adapter_files.rs), then
# on the default model PEFT's logprobs, llama.cpp's convert_lora_to_gguf.py and llama-server
# --lora, the merged GGUF served by temper and llama-server, the PEFT export imported back,
# through a fresh `temper serve` (target/release/temper, built by the caller). Needs the pinned venv of scripts/train-ref-venv.sh and the pinned llama.cpp of
# scripts/build-llama-cpp.sh (both installed or built on first use, outside the checkout). Ends
# with one `test result:` line like cargo's. About a minute on 2 cores once those exist.
set -euo pipefail
cd "$(dirname "$0")/.."
python=$(scripts/train-ref-venv.sh)
model=$(scripts/fetch-model.sh)
bin=$(scripts/build-llama-cpp.sh)
src=$(echo "$(dirname "$bin")"/src/*/vendor/llama.cpp)
work=$(mktemp -d "${TMPDIR:-/tmp}/adapter-families.XXXXXX")
trap 'rm -rf "$work"' EXIT
families=$work/families
if ! TEMPER_CHECK_DIR=$families cargo test --release -p temper-model --test adapter_files -- \
    --ignored --exact write_peft_family_check_inputs >"$work/cargo.log" 2>&1; then
    cat "$work/cargo.log" >&2
    exit 1
fi
"$python" -W ignore scripts/test_adapter_export.py --temper target/release/temper \
    --model "$model" --llama-server "$bin/llama-server" --llama-cpp-src "$src" \
    --families-dir "$families"
