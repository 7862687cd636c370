#!/usr/bin/env bash
# `make bench-train-compare`: temper's trainer next to PyTorch + PEFT on this host, same model,
# same LoRA, same packed shapes and loss, 2 threads each (README, Benchmarks), after checking
# that both compute the same logprobs, loss and LoRA gradients on one small batch.
#
# Usage: scripts/bench-train-compare.sh [--write-fixture] [--no-build] [--check-only]
#   --write-fixture  also rewrite crates/train/tests/fixtures/pytorch-reference.safetensors,
#                    the reference values `cargo test -p temper-train --test pytorch_reference`
#                    compares temper with
#   --no-build       use target/release/temper as built
#   --check-only     the agreement check alone, no timed steps
# Environment (optional): TEMPER_HOME (caches; default ~/.cache/temper; the venv with torch,
# transformers, peft and gguf is $TEMPER_HOME/train-ref-venv, ~6 GB with the CUDA libraries
# PyPI's torch wheel depends on, reused while its pinned versions stay the same), BENCH_MODEL
# (GGUF path; default: scripts/fetch-model.sh), BENCH_SHAPES (default 8x128,1x1024,16x30),
# BENCH_REPEAT (best of; default 2), BENCH_THREADS (default 2).
set -euo pipefail

cd "$(dirname "$0")/.."

WRITE_FIXTURE=0
BUILD=1
CHECK_ONLY=0
for a in "$@"; do
    case $a in
        --write-fixture) WRITE_FIXTURE=1 ;;
        --no-build) BUILD=0 ;;
        --check-only) CHECK_ONLY=1 ;;
        -h | --help) sed -n '2,16p' "$0"; exit 0 ;;
        *) echo "bench-train-compare: unknown argument $a (see --help)" >&2; exit 2 ;;
    esac
done

SHAPES=${BENCH_SHAPES:-8x128,1x1024,16x30}
REPEAT=${BENCH_REPEAT:-2}
THREADS=${BENCH_THREADS:-2}
FIXTURE=crates/train/tests/fixtures/pytorch-reference.safetensors
HOME_DIR="${TEMPER_HOME:-$HOME/.cache/temper}"
VENV=$HOME_DIR/train-ref-venv
# Pinned so that the reference (and the committed fixture) stay reproducible.
REQUIREMENTS="torch==2.15.0 transformers==5.23.0 peft==0.21.2 gguf==0.19.0 numpy==2.4.6 safetensors==0.8.0"

log() { echo "bench-train-compare: $*" >&2; }

if [[ ! -x $VENV/bin/python || "$(cat "$VENV/requirements.txt" 2>/dev/null)" != "$REQUIREMENTS" ]]; then
    log "installing $REQUIREMENTS into $VENV (a few minutes, once)"
    python3 -m venv "$VENV"
    # shellcheck disable=SC2086 # one word per requirement
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check $REQUIREMENTS >&2
    echo "$REQUIREMENTS" >"$VENV/requirements.txt"
fi

MODEL=${BENCH_MODEL:-$(scripts/fetch-model.sh)}
if [[ $BUILD == 1 ]]; then
    cargo build --release -p temper >&2
fi

WORK=$(mktemp -d "${TMPDIR:-/tmp}/bench-train-compare.XXXXXX")
trap 'rm -rf "$WORK"' EXIT

# temper's side of the check: the batch, the adapter and temper's values on them.
log "temper's logprobs, loss and gradients on the check batch"
if ! TEMPER_MODEL_PATH=$MODEL TEMPER_CHECK_DIR=$WORK RAYON_NUM_THREADS=$THREADS \
    cargo test --release -p temper-train --test pytorch_reference -- --ignored --exact \
    write_check_inputs >"$WORK/write-check-inputs.log" 2>&1; then
    cat "$WORK/write-check-inputs.log" >&2
    exit 1
fi

REFERENCE_ARGS=(--gguf "$MODEL" --check-dir "$WORK" --threads "$THREADS")
if [[ $WRITE_FIXTURE == 1 ]]; then
    REFERENCE_ARGS+=(--write-fixture "$FIXTURE")
fi
if [[ $CHECK_ONLY == 0 ]]; then
    log "temper bench --train-only --train-shapes $SHAPES (best of $REPEAT, $THREADS threads)"
    RAYON_NUM_THREADS=$THREADS ./target/release/temper bench --model "$MODEL" --train-only \
        --train-shapes "$SHAPES" --train-jobs '' --repeat "$REPEAT" | tee "$WORK/temper-bench.txt" >&2
    REFERENCE_ARGS+=(--temper-bench "$WORK/temper-bench.txt" --shapes "$SHAPES" --repeat "$REPEAT")
fi
log "the PyTorch + PEFT reference"
"$VENV/bin/python" -W ignore scripts/train_reference.py "${REFERENCE_ARGS[@]}"
