#!/usr/bin/env bash
# Usage: scripts/bench-models.sh [NAME,...]. Writes (once) and lists the random-weight benchmark
# models at real sizes, ${TEMPER_HOME:-$HOME/.cache/temper}/bench-models/NAME-q4_k_m.gguf
# (scripts/make-bench-models.py: Qwen3-0.6B, Qwen3-1.7B, Llama-3.2-1B and Gemma-3-1B shapes;
# gemma-3-270m, the default model's, when named),
# with their tokenizers from the default model (Gemma 3) and `make real-tokenizers` (Llama 3,
# Qwen), and llama.cpp's llama-quantize (scripts/build-llama-cpp.sh). About a minute each.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
home="${TEMPER_HOME:-$HOME/.cache/temper}"
only=${1:-qwen3-0.6b,qwen3-1.7b,llama-3.2-1b,gemma-3-1b}
tokenizers=$("$root/scripts/real-tokenizers.sh")
default_model=$("$root/scripts/fetch-model.sh" | tail -1)
bin=$("$root/scripts/build-llama-cpp.sh")
python=$("$root/scripts/pinned-venv.sh" "$root/scripts/requirements-real-tokenizers.txt" real-tokenizers-venv)
"$python" "$root/scripts/make-bench-models.py" --out "$home/bench-models" --only "$only" \
    --quantize "$bin/llama-quantize" \
    --tokenizer "gemma=$default_model" \
    --tokenizer "llama3=$tokenizers/llama3.gguf" \
    --tokenizer "qwen=$tokenizers/qwen.gguf"
