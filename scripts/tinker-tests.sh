#!/usr/bin/env bash
# The tinker SDK suite (tests/python/test_tinker.py) against the built `temper serve` on the default
# model: the Tinker training API (issue 33) driven by the unchanged SDK. The SDK and its pinned
# companions live in a virtual environment outside the checkout (like the model: installed once,
# reused by later clones and CI runs while the pins are the same).
set -euo pipefail
cd "$(dirname "$0")/.."
python=$(scripts/pinned-venv.sh tests/python/requirements-tinker.txt tinker-venv)
# torch for `forward_backward_custom` (the client differentiates the user's loss): the PyTorch
# reference's venv, which make test installs anyway, rather than a second 6 GB copy.
torch_python=$(scripts/train-ref-venv.sh)
TEMPER_TORCH_SITE=$("$torch_python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
export TEMPER_TORCH_SITE
exec "$python" tests/python/test_tinker.py
