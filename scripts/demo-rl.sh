#!/usr/bin/env bash
# The RL learning demo (scripts/demo_rl.py) against the built `temper serve` on the default model;
# its Python dependencies (the openai SDK, matplotlib) in a pinned environment outside the checkout.
set -euo pipefail
cd "$(dirname "$0")/.."
python=$(scripts/pinned-venv.sh scripts/requirements-demo-rl.txt demo-rl-venv)
exec "$python" scripts/demo_rl.py "$@"
