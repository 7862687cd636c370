#!/usr/bin/env bash
# The openpipe-art suite (tests/python/test_art.py) against the built `temper serve` on the default
# model, or with `--family F` (llama3, qwen3, qwen2.5, gemma3) on the tiny model of that family with
# its real tokenizer and template (scripts/tiny-served.sh makes them; $TEMPER_TINY_SERVED, when set,
# is its directory). The library and its pinned
# companions live in a virtual environment outside the checkout (like the model: installed once,
# reused by later clones and CI runs while the pins are the same).
set -euo pipefail
cd "$(dirname "$0")/.."
python=$(scripts/pinned-venv.sh tests/python/requirements-art.txt art-venv)
if [ "${1:-}" = --family ]; then
    export TEMPER_SUITE_FAMILY=$2
    export TEMPER_SUITE_MODEL="tiny-$2=${TEMPER_TINY_SERVED:-$(scripts/tiny-served.sh)}/$2.gguf"
fi
exec "$python" tests/python/test_art.py
