#!/usr/bin/env bash
# The openpipe-art suite (tests/python/test_art.py) against the built `temper serve` on the default
# model. The library and its pinned companions live in a virtual environment outside the checkout
# (like the model: installed once, reused by later clones and CI runs while the pins are the same).
set -euo pipefail
cd "$(dirname "$0")/.."
python=$(scripts/pinned-venv.sh tests/python/requirements-art.txt art-venv)
exec "$python" tests/python/test_art.py
