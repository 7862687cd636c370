#!/usr/bin/env bash
# Usage: scripts/train-ref-venv.sh. Prints the python of $TEMPER_HOME/train-ref-venv: torch,
# transformers, peft, gguf (pinned, so that the PyTorch reference, its committed fixture and the
# adapter export tests stay reproducible), installed once (~6 GB with the CUDA libraries PyPI's
# torch wheel depends on) and reused while the pins are the same. Used by
# scripts/bench-train-compare.sh and scripts/adapter-export-tests.sh.
set -euo pipefail
VENV="${TEMPER_HOME:-$HOME/.cache/temper}/train-ref-venv"
REQUIREMENTS="torch==2.15.0 transformers==5.23.0 peft==0.21.2 gguf==0.19.0 numpy==2.4.6 safetensors==0.8.0"
if [[ ! -x $VENV/bin/python || "$(cat "$VENV/requirements.txt" 2>/dev/null)" != "$REQUIREMENTS" ]]; then
    echo "train-ref-venv: installing $REQUIREMENTS into $VENV (a few minutes, once)" >&2
    python3 -m venv "$VENV"
    # shellcheck disable=SC2086 # one word per requirement
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check $REQUIREMENTS >&2
    echo "$REQUIREMENTS" >"$VENV/requirements.txt"
fi
echo "$VENV/bin/python"
