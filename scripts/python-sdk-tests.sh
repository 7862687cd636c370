#!/usr/bin/env bash
# The openai-SDK client suite (tests/python) against the built `temper serve` on the default model.
# The virtual environment lives in target/pyenv (untracked, reused between runs).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=target/pyenv
if ! "$venv/bin/python" -c 'import openai' 2>/dev/null; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check openai
fi
exec "$venv/bin/python" tests/python/test_openai_sdk.py
