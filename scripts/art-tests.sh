#!/usr/bin/env bash
# The openpipe-art suite (tests/python/test_art.py) against the built `temper serve` on the default
# model. The library and its pinned companions live in a virtual environment outside the checkout
# (like the model: installed once, reused by later clones and CI runs while the pins are the same).
set -euo pipefail
cd "$(dirname "$0")/.."
requirements=tests/python/requirements-art.txt
venv="${TEMPER_HOME:-$HOME/.cache/temper}/art-venv"
stamp="$venv/requirements.sha256"
want=$(sha256sum "$requirements" | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ] || ! "$venv/bin/python" -c 'import art' 2>/dev/null; then
    rm -rf "$venv"
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check -r "$requirements"
    echo "$want" > "$stamp"
fi
exec "$venv/bin/python" tests/python/test_art.py
