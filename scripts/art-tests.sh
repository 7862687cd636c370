#!/usr/bin/env bash
# The openpipe-art suite (tests/python/test_art.py) against the built `temper serve` on the default
# model. The library and its pinned companions live in a virtual environment outside the checkout
# (like the model: fetched once, reused by later clones and CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${TEMPER_HOME:-$HOME/.cache/temper}/art-venv-0.5.18"
if ! "$venv/bin/python" -c 'import art, openai, wandb' 2>/dev/null; then
    rm -rf "$venv"
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check -r tests/python/requirements-art.txt
fi
exec "$venv/bin/python" tests/python/test_art.py
