#!/usr/bin/env bash
# The tinker SDK suite (tests/python/test_tinker.py) against the built `temper serve` on the default
# model: the Tinker training API (issue 33) driven by the unchanged SDK. The SDK and its pinned
# companions live in a virtual environment outside the checkout (like the model: installed once,
# reused by later clones and CI runs while the pins are the same).
set -euo pipefail
cd "$(dirname "$0")/.."
python=$(scripts/pinned-venv.sh tests/python/requirements-tinker.txt tinker-venv)
exec "$python" tests/python/test_tinker.py
