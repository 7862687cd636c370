#!/usr/bin/env bash
# Usage: scripts/pinned-venv.sh REQUIREMENTS NAME. Prints the python of a virtual environment with
# the pinned REQUIREMENTS installed, kept outside the checkout in ${TEMPER_HOME:-$HOME/.cache/temper}/NAME
# (like the model: installed once, reused by later clones and CI runs while the pins are the same).
set -euo pipefail
requirements=$1
venv="${TEMPER_HOME:-$HOME/.cache/temper}/$2"
stamp="$venv/requirements.sha256"
want=$(sha256sum "$requirements" | cut -d' ' -f1)
# The stamp is written after a complete install only.
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ] || [ ! -x "$venv/bin/python" ]; then
    rm -rf "$venv"
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check -r "$requirements" >&2
    echo "$want" > "$stamp"
fi
echo "$venv/bin/python"
