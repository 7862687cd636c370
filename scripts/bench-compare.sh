#!/usr/bin/env bash
# `make bench-compare`: temper next to llama.cpp (pinned 0c1e570), measured in one run on this
# host with the same model, 2 threads each, one server at a time, the same load client
# (scripts/load_client.py). Prints a markdown table (README, Benchmarks).
#
# Usage: scripts/bench-compare.sh [--quick] [--no-build] [--isa native|avx2]
#   --quick      fewer requests and tokens (a validation run of a few minutes)
#   --no-build   use the binaries already built (target/release/temper or target/avx2/...,
#                the llama.cpp cache)
#   --isa avx2   both on their AVX2 code paths (`make bench-compare-avx2`), e.g. on an AVX-512
#                host: llama.cpp from its AVX2-only build (LLAMA_ISA=avx2
#                scripts/build-llama-cpp.sh, bin-avx2/), temper built for an AVX2-only CPU
#                (`-C target-cpu=x86-64-v3` into target/avx2/: the compiler may not use
#                AVX-512 or VNNI encodings anywhere, as on a host without them) and run with
#                TEMPER_ISA=avx2. Default native: each with the best code path for this CPU
#                (TEMPER_ISA is unset, temper from target/release/).
# Environment (optional): TEMPER_HOME (caches; default ~/.cache/temper), BENCH_MODEL (GGUF path;
# default: scripts/fetch-model.sh), BENCH_MAX_TOKENS, BENCH_REPS, BENCH_ECHO_TOKENS,
# BENCH_AGENT_WORDS, BENCH_THREADS (default 2), TEMPER_SPEC_ARGS (temper serve arguments that
# turn prompt-lookup speculative decoding on; default: detected from `temper serve --help`),
# BENCH_KEEP_RESULTS (a directory to keep the JSON results in).
set -euo pipefail

cd "$(dirname "$0")/.."
ROOT=$PWD

QUICK=0
BUILD=1
ISA=native
while [[ $# -gt 0 ]]; do
    case $1 in
        --quick) QUICK=1 ;;
        --no-build) BUILD=0 ;;
        --isa) [[ $# -gt 1 ]] || { echo "bench-compare: --isa needs native or avx2" >&2; exit 2; }
            ISA=$2; shift ;;
        --isa=*) ISA=${1#--isa=} ;;
        -h | --help) sed -n '2,20p' "$0"; exit 0 ;;
        *) echo "bench-compare: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done
case $ISA in
    native)
        unset TEMPER_ISA
        LLAMA_BIN_DIR=bin
        TEMPER_TARGET=$ROOT/target
        TEMPER_RUSTFLAGS=
        ISA_DESC="native"
        ;;
    avx2)
        export TEMPER_ISA=avx2
        LLAMA_BIN_DIR=bin-avx2
        # target-cpu=native on an AVX-512 host lets the compiler use AVX-512/VNNI encodings
        # inside the AVX2 kernels (it fuses madd + add into vpdpwssd): not the AVX2 path.
        TEMPER_TARGET=$ROOT/target/avx2
        TEMPER_RUSTFLAGS="-C target-cpu=x86-64-v3"
        ISA_DESC="avx2 (forced: temper built for x86-64-v3 and run with TEMPER_ISA=avx2, llama.cpp built with GGML_NATIVE=OFF, AVX2 only)"
        ;;
    *) echo "bench-compare: --isa takes native or avx2, not '$ISA'" >&2; exit 2 ;;
esac

THREADS=${BENCH_THREADS:-2}
SLOTS=8
SLOT_CTX=2560
if [[ $QUICK == 1 ]]; then
    MAX_TOKENS=${BENCH_MAX_TOKENS:-64}
    REPS=${BENCH_REPS:-2}
    ECHO_TOKENS=${BENCH_ECHO_TOKENS:-64}
    AGENT_REPS=1
    PP_REPS=2
    MODE="quick ($MAX_TOKENS output tokens per request, $REPS sequential requests at 1 client)"
else
    MAX_TOKENS=${BENCH_MAX_TOKENS:-128}
    REPS=${BENCH_REPS:-3}
    ECHO_TOKENS=${BENCH_ECHO_TOKENS:-128}
    AGENT_REPS=3
    PP_REPS=5
    MODE="full ($MAX_TOKENS output tokens per request, $REPS sequential requests at 1 client)"
fi
# ~1,550 words of the client's prose make a ~2.1k-token conversation with Gemma's template.
AGENT_WORDS=${BENCH_AGENT_WORDS:-1550}

log() { echo "bench-compare: $*" >&2; }
die() { echo "bench-compare: error: $*" >&2; exit 1; }

TMP=$(mktemp -d "${TMPDIR:-/tmp}/bench-compare.XXXXXX")
RES=$TMP/results
mkdir -p "$RES"
SERVER_PID=

stop_server() {
    if [[ -n $SERVER_PID ]] && kill -0 "$SERVER_PID" 2>/dev/null; then
        kill "$SERVER_PID" 2>/dev/null || true
        for _ in $(seq 50); do
            kill -0 "$SERVER_PID" 2>/dev/null || break
            sleep 0.2
        done
        kill -9 "$SERVER_PID" 2>/dev/null || true
        wait "$SERVER_PID" 2>/dev/null || true
    fi
    SERVER_PID=
}
cleanup() {
    stop_server
    if [[ -n ${BENCH_KEEP_RESULTS:-} ]]; then
        mkdir -p "$BENCH_KEEP_RESULTS" && cp -r "$RES"/. "$BENCH_KEEP_RESULTS"/ 2>/dev/null || true
    fi
    rm -rf "$TMP"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()'
}

# wait_health NAME PORT LOG: polls GET /health until 200 (llama-server answers 503 while loading).
wait_health() {
    local name=$1 port=$2 logf=$3
    for _ in $(seq 600); do
        if ! kill -0 "$SERVER_PID" 2>/dev/null; then
            tail -20 "$logf" >&2
            die "$name exited before it was ready (log above)"
        fi
        if python3 - "$port" <<'EOF' 2>/dev/null; then
import http.client, sys
c = http.client.HTTPConnection("127.0.0.1", int(sys.argv[1]), timeout=2)
c.request("GET", "/health")
sys.exit(0 if c.getresponse().status == 200 else 1)
EOF
            return 0
        fi
        sleep 0.5
    done
    tail -20 "$logf" >&2
    die "$name did not answer /health within 300 s"
}

client() { python3 "$ROOT/scripts/load_client.py" "$@"; }

# measure NAME PORT: every HTTP figure against the running server, results in $RES/NAME-*.json.
measure() {
    local name=$1 port=$2 url="http://127.0.0.1:$2"
    log "$name: warm-up"
    client run --url "$url" --server "$name" --max-tokens 8 >/dev/null
    log "$name: 1 client, $REPS x $MAX_TOKENS tokens"
    client run --url "$url" --server "$name" --clients 1 --requests "$REPS" \
        --max-tokens "$MAX_TOKENS" --out "$RES/$name-c1.json" >/dev/null
    for c in 8 16 32; do
        log "$name: $c clients x $MAX_TOKENS tokens"
        client run --url "$url" --server "$name" --clients "$c" --requests 1 \
            --max-tokens "$MAX_TOKENS" --pid "$SERVER_PID" --out "$RES/$name-c$c.json" >/dev/null
    done
    log "$name: ~512-token prompts, 1 output token"
    client run --url "$url" --server "$name" --clients 1 --requests "$REPS" --unique \
        --prompt-words 392 --max-tokens 1 --out "$RES/$name-p512.json" >/dev/null
    log "$name: agent conversation, cold and next turn"
    client agent --url "$url" --server "$name" --context-words "$AGENT_WORDS" \
        --reps "$AGENT_REPS" --max-tokens 32 --out "$RES/$name-agent.json" >/dev/null
    log "$name: echo-heavy, $ECHO_TOKENS tokens"
    client run --url "$url" --server "$name" --clients 1 --requests "$REPS" --echo \
        --max-tokens "$ECHO_TOKENS" --out "$RES/$name-echo.json" >/dev/null
}

# --- host, binaries, model -------------------------------------------------------------------
CPU=$(grep -m1 '^model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')
FLAGS=$(grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' \
    | { grep -E '^(avx2|avx512f|avx512_vnni|avx512_bf16|amx_[a-z0-9]+)$' || true; } | tr '\n' ' ' \
    | sed 's/ $//')
CORES=$(nproc)
log "host: $CPU, $CORES cores, flags: ${FLAGS:-none}; ISA: $ISA_DESC"

if [[ $BUILD == 1 ]]; then
    LLAMA_BIN=$(LLAMA_ISA=$ISA scripts/build-llama-cpp.sh) || die "building llama.cpp failed"
    log "building temper (release, into $TEMPER_TARGET)"
    build_env=(CARGO_TARGET_DIR="$TEMPER_TARGET")
    [[ -n $TEMPER_RUSTFLAGS ]] && build_env+=(RUSTFLAGS="$TEMPER_RUSTFLAGS")
    env "${build_env[@]}" cargo build --release -p temper >&2 || die "building temper failed"
else
    LLAMA_BIN=${TEMPER_HOME:-$HOME/.cache/temper}/llama.cpp-0.3.36/$LLAMA_BIN_DIR
fi
TEMPER=$TEMPER_TARGET/release/temper
[[ -x $LLAMA_BIN/llama-bench && -x $LLAMA_BIN/llama-server ]] \
    || die "no llama.cpp binaries in $LLAMA_BIN (run LLAMA_ISA=$ISA scripts/build-llama-cpp.sh)"
[[ -x $TEMPER ]] || die "no $TEMPER (run without --no-build to build it)"
MODEL=${BENCH_MODEL:-$(scripts/fetch-model.sh | tail -1)}
[[ -f $MODEL ]] || die "model $MODEL not found"

# temper's main run has prompt lookup off (llama-server has no speculation), its echo row is run
# again with it on.
SPEC_FLAG=
SPEC_NA=
OFF_ARGS=()
help=$("$TEMPER" serve --help 2>&1 || true)
if grep -q -- '--prompt-lookup-tokens' <<<"$help"; then
    OFF_ARGS=(--prompt-lookup-tokens 0)
    SPEC_FLAG=${TEMPER_SPEC_ARGS:---prompt-lookup-tokens 4}
elif [[ -n ${TEMPER_SPEC_ARGS:-} ]]; then
    SPEC_FLAG=$TEMPER_SPEC_ARGS
else
    SPEC_NA="n/a (no flag)"
fi

python3 - "$RES/meta.json" <<EOF
import json, sys
json.dump({
    "cpu": """$CPU""", "cores": $CORES, "flags": "$FLAGS", "mode": """$MODE""",
    "max_tokens": $MAX_TOKENS, "echo_tokens": $ECHO_TOKENS,
    "llama_commit": "$(cat "$LLAMA_BIN/COMMIT" 2>/dev/null || echo 0c1e570)",
    "llama_ctx": $((SLOTS * SLOT_CTX)),
    "temper_commit": "$(git rev-parse --short HEAD 2>/dev/null || echo unknown)",
    "spec_flag": "$SPEC_FLAG", "spec_na": "$SPEC_NA", "isa": "$ISA_DESC",
}, open(sys.argv[1], "w"))
EOF

# --- llama.cpp -------------------------------------------------------------------------------
log "llama.cpp: llama-bench pp512 (-t $THREADS, $PP_REPS repetitions)"
"$LLAMA_BIN/llama-bench" -m "$MODEL" -p 512 -n 0 -t "$THREADS" -r "$PP_REPS" -o json \
    >"$TMP/llama-bench.json" 2>"$TMP/llama-bench.log" \
    || { tail -20 "$TMP/llama-bench.log" >&2; die "llama-bench failed"; }
python3 - "$TMP/llama-bench.json" "$RES/llama-pp512.json" <<'EOF'
import json, sys
runs = [r for r in json.load(open(sys.argv[1])) if r.get("n_prompt") == 512 and r.get("n_gen") == 0]
json.dump({"tok_s": runs[0]["avg_ts"]}, open(sys.argv[2], "w"))
EOF

PORT=$(free_port)
log "llama.cpp: llama-server on port $PORT (-t $THREADS -np $SLOTS -c $((SLOTS * SLOT_CTX)))"
"$LLAMA_BIN/llama-server" -m "$MODEL" --host 127.0.0.1 --port "$PORT" -t "$THREADS" \
    -np "$SLOTS" -c $((SLOTS * SLOT_CTX)) --no-jinja --chat-template gemma >"$TMP/llama-server.log" 2>&1 &
SERVER_PID=$!
wait_health llama-server "$PORT" "$TMP/llama-server.log"
measure llama "$PORT"
stop_server

# --- temper ----------------------------------------------------------------------------------
log "temper: prefill of a 512-token prompt (temper bench, best of $PP_REPS)"
RAYON_NUM_THREADS=$THREADS "$TEMPER" bench --model "$MODEL" --prompt-lens 512 --decode-tokens 4 \
    --concurrency 1 --train-shapes '' --train-jobs '' --repeat "$PP_REPS" \
    >"$TMP/temper-bench.txt" 2>"$TMP/temper-bench.log" \
    || { tail -20 "$TMP/temper-bench.log" >&2; die "temper bench failed"; }
pp=$(grep -E '^\| prompt processing, 512 tokens' "$TMP/temper-bench.txt" | cut -d'|' -f3 \
    | grep -oE '[0-9.]+' | head -1 || true)
[[ -n $pp ]] || { cat "$TMP/temper-bench.txt" >&2; die "no 512-token prefill row in temper bench's table"; }
if [[ $ISA == avx2 ]] && ! head -1 "$TMP/temper-bench.txt" | grep -q ', avx2 kernels;'; then
    head -1 "$TMP/temper-bench.txt" >&2
    die "temper bench did not run its avx2 kernels with TEMPER_ISA=avx2 (first line above)"
fi
echo "{\"tok_s\": $pp}" >"$RES/temper-pp512.json"

start_temper() {
    PORT=$(free_port)
    local data=$TMP/temper-data-$PORT
    mkdir -p "$data"
    log "temper: serve on port $PORT $*"
    RAYON_NUM_THREADS=$THREADS "$TEMPER" serve --model "gemma-3-270m=$MODEL" --host 127.0.0.1 \
        --port "$PORT" --data-dir "$data" "$@" >"$TMP/temper-serve.log" 2>&1 &
    SERVER_PID=$!
    wait_health "temper serve" "$PORT" "$TMP/temper-serve.log"
}
start_temper "${OFF_ARGS[@]}"
measure temper "$PORT"
stop_server

if [[ -n $SPEC_FLAG ]]; then
    # shellcheck disable=SC2086 # TEMPER_SPEC_ARGS may hold several words
    start_temper $SPEC_FLAG
    url="http://127.0.0.1:$PORT"
    client run --url "$url" --server temper --max-tokens 8 >/dev/null
    log "temper ($SPEC_FLAG): echo-heavy, $ECHO_TOKENS tokens"
    client run --url "$url" --server temper --clients 1 --requests "$REPS" --echo \
        --max-tokens "$ECHO_TOKENS" --out "$RES/temper-echo-spec.json" >/dev/null
    stop_server
fi

echo
client table --results "$RES"
