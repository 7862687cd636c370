#!/usr/bin/env bash
# Usage: scripts/tiny-served.sh. Makes (once per input set) and prints the directory of the tiny
# served models of every family with the real tokenizers and chat templates:
# ${TEMPER_HOME:-$HOME/.cache/temper}/tiny-served/{llama3,qwen3,qwen2.5,gemma3,mistral,smollm3}.gguf, written by
# `scripts/make-tiny-served.py --families` (see there) with the venv of scripts/real-tokenizers.sh
# from its real tokenizers, the default model's tokenizer and the tiny models of
# crates/model/tests/fixtures. Reused while those and the script are the same.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
home="${TEMPER_HOME:-$HOME/.cache/temper}"
out="$home/tiny-served"
real=$("$root/scripts/real-tokenizers.sh")
default_model=$("$root/scripts/fetch-model.sh")
python=$("$root/scripts/pinned-venv.sh" "$root/scripts/requirements-real-tokenizers.txt" real-tokenizers-venv)
fixtures="$root/crates/model/tests/fixtures"
want=$(cat "$root/scripts/make-tiny-served.py" "$real/stamp" \
    "$fixtures"/tiny-{llama,qwen3,qwen2,gemma3,mistral,smollm3}.gguf \
    "$root"/crates/text/tests/fixtures/templates/{qwen2.5,mistral-nemo,smollm3}.jinja | sha256sum | cut -d' ' -f1)
want="$want $(basename "$default_model")"
# The stamp is written after a complete run only.
if [ "$(cat "$out/stamp" 2>/dev/null)" != "$want" ]; then
    rm -f "$out/stamp"
    "$python" "$root/scripts/make-tiny-served.py" --families "$out" --real-tokenizers "$real" \
        --default-model "$default_model" >&2
    echo "$want" >"$out/stamp"
fi
echo "$out"
