#!/usr/bin/env bash
# The openai-SDK client suite (tests/python) against the built `temper serve` on the default model,
# or with `--family F` (llama3, qwen3, qwen2.5, gemma3) on the tiny model of that family with its
# real tokenizer and template (scripts/tiny-served.sh makes them; $TEMPER_TINY_SERVED, when set, is
# its directory).
# The virtual environment lives in target/pyenv (untracked, reused between runs).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=target/pyenv
if ! "$venv/bin/python" -c 'import openai' 2>/dev/null; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check openai
fi
if [ "${1:-}" = --family ]; then
    export TEMPER_SUITE_FAMILY=$2
    export TEMPER_SUITE_MODEL="tiny-$2=${TEMPER_TINY_SERVED:-$(scripts/tiny-served.sh)}/$2.gguf"
fi
exec "$venv/bin/python" tests/python/test_openai_sdk.py
