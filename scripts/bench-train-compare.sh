#!/usr/bin/env bash
# `make bench-train-compare`: temper's trainer next to PyTorch + PEFT on this host, same model,
# same LoRA, same packed shapes and loss, 2 threads each (docs/benchmarks.md), after checking
# that both compute the same logprobs, loss and LoRA gradients on one small batch.
#
# One step on both sides is the whole step a training job takes: forward, backward, gradient
# clipping and the AdamW update of the LoRA adapter (temper: `temper bench --train-shapes`, which
# calls the trainer's apply_gradients; PyTorch: torch.optim.AdamW over the LoRA parameters, step
# and zero_grad, all inside the timed region). The sides take turns shape by shape (temper's
# steps of a shape, then every variant's, then the next shape), so a host whose speed drifts
# over the run moves both sides of a ratio alike. The reference runs as several variants an expert
# might choose (scripts/train_reference.py's docstring): f32+sdpa (f32, transformers' default
# SDPA attention, a full f32 [tokens x 262k] log-softmax: the reference of the check and of the
# fixture, always run), f32+eager, f32+chunked+sdpa (the LM head's log-softmax a chunk of rows at
# a time, no full logits tensor), bf16-autocast+sdpa, bf16-autocast+eager and
# bf16-autocast+chunked+sdpa (torch.autocast to BF16: oneDNN's AVX-512 BF16 / AMX kernels). Each
# variant's logprobs, loss and LoRA gradients on the check batch are gated against the f32
# reference with the bounds temper's own are held to (agrees_with_the_pytorch_reference); temper
# is compared with the fastest variant that passes and makes sense on the host (no BF16 variant
# where the CPU lacks avx512_bf16 and amx_bf16: there BF16 is emulated, and only
# bf16-autocast+chunked+sdpa runs, to show it). Printed: the host's CPU and flags (avx2, avx512f,
# avx512_vnni, avx512_bf16, amx*), the check, the gate per variant, a table per shape (temper and
# every variant: s/step, tok/s, peak RSS, temper's ratios), a summary table against the fastest
# correct variant and against f32+sdpa, and last the line
# `train-compare: temper vs PyTorch <variant> (fastest correct): <r>x at 8x128, ...; rss <r>x;
# vs f32+sdpa: 8x128=<r>x 1x1024=<r>x 16x30=<r>x rss=<r>x` (temper's trainable tok/s over the
# reference's; rss: the largest peak RSS of temper's steps over the compared variant's).
#
# Usage: scripts/bench-train-compare.sh [--write-fixture] [--no-build] [--check-only]
#                                       [--tiny-families] [--isa avx2]
#   --write-fixture  also rewrite crates/train/tests/fixtures/pytorch-reference.safetensors from
#                    the f32+sdpa reference, the values `cargo test -p temper-train --test
#                    pytorch_reference` compares temper with
#   --no-build       use target/release/temper (with --isa avx2, target/avx2/release/temper) as built
#   --check-only     the agreement check and the variants' gate alone, no timed steps
#   --isa avx2       both sides as on a host with AVX2 alone: temper built for an AVX2-only CPU
#                    (`-C target-cpu=x86-64-v3` into target/avx2/, as bench-compare's --isa avx2, so
#                    no loop the compiler vectorizes uses AVX-512) and run with TEMPER_ISA=avx2, torch
#                    with ATEN_CPU_CAPABILITY=avx2 and oneDNN with ONEDNN_MAX_CPU_ISA=AVX2, the
#                    reference's auto variants those of a host without BF16 (f32; the emulated
#                    bf16-autocast+chunked+sdpa shown, never compared)
#   --tiny-families  instead, the check alone on each tiny random family of the model crate's
#                    fixtures (crates/model/tests/fixtures/tiny-FAMILY.gguf, the families of
#                    pytorch_reference.rs's tiny_families!), rebuilt in transformers by
#                    scripts/make-tiny-families.py; with --write-fixture, rewrites
#                    crates/train/tests/fixtures/pytorch-reference-tiny-FAMILY.safetensors
#                    (needs neither the default model nor the temper binary)
# Environment (optional): TEMPER_HOME (caches; default ~/.cache/temper; the venv with torch,
# transformers, peft and gguf is $TEMPER_HOME/train-ref-venv, ~6 GB with the CUDA libraries
# PyPI's torch wheel depends on, reused while its pinned versions stay the same), BENCH_MODEL
# (GGUF path; default: scripts/fetch-model.sh), BENCH_SHAPES (default 8x128,1x1024,16x30),
# BENCH_REPEAT (best of; default 3: each side's first step of a shape faults its pages in
# again, PyTorch's after handing its heap back, temper's in a fresh process that also builds its
# input-gradient weights then), BENCH_THREADS (default 2), BENCH_JOBS (temper's whole RL
# jobs, TRAJECTORIESxANSWER_TOKENS, printed beside the steps in jobs/min; default
# 16x200,32x300; set and empty, none), BENCH_VARIANTS (reference
# variants, comma-separated PRECISION[+chunked]+ATTENTION with PRECISION f32 or bf16-autocast and
# ATTENTION sdpa or eager, e.g. f32+chunked+sdpa,bf16-autocast+chunked+sdpa; default auto, the
# list above; f32+sdpa always runs).
set -euo pipefail

cd "$(dirname "$0")/.."

WRITE_FIXTURE=0
BUILD=1
CHECK_ONLY=0
TINY=0
ISA=native
for a in "$@"; do
    if [[ ${expect_isa:-0} == 1 ]]; then
        ISA=$a
        expect_isa=0
        continue
    fi
    case $a in
        --isa) expect_isa=1 ;;
        --write-fixture) WRITE_FIXTURE=1 ;;
        --no-build) BUILD=0 ;;
        --check-only) CHECK_ONLY=1 ;;
        --tiny-families) TINY=1 ;;
        -h | --help) sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0"; exit 0 ;;
        *) echo "bench-train-compare: unknown argument $a (see --help)" >&2; exit 2 ;;
    esac
done

TEMPER_TARGET=target
TEMPER_RUSTFLAGS=
case $ISA in
    native) ;;
    avx2)
        export TEMPER_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
        TEMPER_TARGET=target/avx2
        TEMPER_RUSTFLAGS="-C target-cpu=x86-64-v3"
        ;;
    *) echo "bench-train-compare: --isa takes avx2, got '$ISA'" >&2; exit 2 ;;
esac

SHAPES=${BENCH_SHAPES:-8x128,1x1024,16x30}
REPEAT=${BENCH_REPEAT:-3}
THREADS=${BENCH_THREADS:-2}
VARIANTS=${BENCH_VARIANTS:-auto}
JOBS=${BENCH_JOBS-16x200,32x300}
FIXTURE=crates/train/tests/fixtures/pytorch-reference.safetensors
# The pinned venv (scripts/train-ref-venv.sh), installed on first use.
PYTHON=$(scripts/train-ref-venv.sh)

log() { echo "bench-train-compare: $*" >&2; }

WORK=$(mktemp -d "${TMPDIR:-/tmp}/bench-train-compare.XXXXXX")
trap 'rm -rf "$WORK"' EXIT

if [[ $TINY == 1 ]]; then
    log "temper's logprobs, loss and gradients on each tiny family's check batch"
    if ! TEMPER_CHECK_DIR=$WORK RAYON_NUM_THREADS=$THREADS cargo test --release -p temper-train \
        --test pytorch_reference -- --ignored --exact write_tiny_family_check_inputs \
        >"$WORK/write-check-inputs.log" 2>&1; then
        cat "$WORK/write-check-inputs.log" >&2
        exit 1
    fi
    for dir in "$WORK"/*/; do
        family=$(basename "$dir")
        args=(--family "$family" --gguf "crates/model/tests/fixtures/tiny-$family.gguf"
            --check-dir "$dir" --threads "$THREADS")
        if [[ $WRITE_FIXTURE == 1 ]]; then
            args+=(--write-fixture
                "crates/train/tests/fixtures/pytorch-reference-tiny-$family.safetensors")
        fi
        log "the PyTorch + PEFT reference on tiny $family"
        "$PYTHON" -W ignore scripts/train_reference.py "${args[@]}"
    done
    exit 0
fi

MODEL=${BENCH_MODEL:-$(scripts/fetch-model.sh)}
if [[ $BUILD == 1 ]]; then
    # As bench-compare builds it; RUSTFLAGS only when set, or it would drop the config's.
    build_env=(CARGO_TARGET_DIR="$TEMPER_TARGET")
    [[ -n $TEMPER_RUSTFLAGS ]] && build_env+=(RUSTFLAGS="$TEMPER_RUSTFLAGS")
    env "${build_env[@]}" cargo build --release -p temper >&2
fi

# temper's side of the check: the batch, the adapter and temper's values on them.
log "temper's logprobs, loss and gradients on the check batch"
if ! TEMPER_MODEL_PATH=$MODEL TEMPER_CHECK_DIR=$WORK RAYON_NUM_THREADS=$THREADS \
    cargo test --release -p temper-train --test pytorch_reference -- --ignored --exact \
    write_check_inputs >"$WORK/write-check-inputs.log" 2>&1; then
    cat "$WORK/write-check-inputs.log" >&2
    exit 1
fi

REFERENCE_ARGS=(--gguf "$MODEL" --check-dir "$WORK" --threads "$THREADS" --variants "$VARIANTS"
    --isa "$ISA")
if [[ $WRITE_FIXTURE == 1 ]]; then
    REFERENCE_ARGS+=(--write-fixture "$FIXTURE")
fi
if [[ $CHECK_ONLY == 0 ]]; then
    # The reference runs `temper bench` for each shape before that shape's variants: the two
    # sides take turns, so the host's drift over a run moves both sides of a ratio alike.
    REFERENCE_ARGS+=(--temper "./$TEMPER_TARGET/release/temper" --shapes "$SHAPES"
        --repeat "$REPEAT")
fi
log "the PyTorch + PEFT reference (variants: $VARIANTS), shape by shape after temper's steps"
"$PYTHON" -W ignore scripts/train_reference.py "${REFERENCE_ARGS[@]}"
if [[ $CHECK_ONLY == 0 && -n $JOBS ]]; then
    # Whole jobs as the worker runs them (tokenize, pack, every step, the checkpoint written).
    log "temper bench --train-only --train-jobs $JOBS (best of $REPEAT, $THREADS threads)"
    RAYON_NUM_THREADS=$THREADS "./$TEMPER_TARGET/release/temper" bench --model "$MODEL" --train-only \
        --train-shapes '' --train-jobs "$JOBS" --repeat "$REPEAT" >"$WORK/temper-jobs.txt"
    echo
    echo "temper's whole RL jobs (one group each, through the trainer's job path):"
    grep -o 'training job, [^|]*' "$WORK/temper-jobs.txt" | sed 's/ *$//; s/^/- /'
fi
