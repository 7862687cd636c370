#!/usr/bin/env bash
# `make bench-compare`: temper next to two llama.cpp anchors, measured in one run on this host with
# the same model, 2 threads each, one server at a time, the same load client
# (scripts/load_client.py). Prints a markdown table (docs/benchmarks.md).
#   anchors: mainline llama.cpp (pinned 0c1e570, scripts/build-llama-cpp.sh) and its CPU-speed fork
#            ik_llama.cpp (as vendored by ik-llama-cpp-python 0.1.5 with upstream's later fix of
#            its CPU flash attention for parallel slots, scripts/build-ik-llama-cpp.sh), run with
#            -rtr (run-time repacking) by llama-server and llama-bench; flash attention is on by
#            default there, and auto (on, for the CPU) in mainline.
#   fairness: each anchor's llama-server runs at every -np of the sweep (-c = np x 2560, the
#            context of a slot covers every prompt + output here) and each row shows its best
#            setting; the servers run in alternating order (temper first in odd rounds, last in
#            even ones) over several rounds, and each row shows the median and [min-max] over the
#            rounds (an anchor: per round its best over the sweep). Prefill is best-of-N on both.
#            The ratio is temper against the faster anchor of that row. Memory: peak RSS and KV
#            cache size of each server, and temper again with --kv-cache-mb set to each anchor's
#            KV size (at the -np of that anchor's best 16-client run) for the 16- and 32-client
#            rows at equal KV capacity.
#
# Usage: scripts/bench-compare.sh [--quick] [--no-build] [--isa native|avx2] [--rounds N]
#                                 [--anchor llama|ik|both] [--np "4 8 16 32"]
#   --quick      a validation run: fewer requests and tokens, and unless --rounds / --np say
#                otherwise one round and -np 4 and 16 only (its figures are not results)
#   --no-build   use the binaries already built (target/release/temper or target/avx2/...,
#                the llama.cpp and ik_llama.cpp caches)
#   --isa avx2   all on their AVX2 code paths (`make bench-compare-avx2`), e.g. on an AVX-512
#                host: llama.cpp and ik_llama.cpp from their AVX2-only builds (LLAMA_ISA=avx2
#                scripts/build-llama-cpp.sh / build-ik-llama-cpp.sh, bin-avx2/), temper built for
#                an AVX2-only CPU (`-C target-cpu=x86-64-v3` into target/avx2/: the compiler may
#                not use AVX-512 or VNNI encodings anywhere, as on a host without them) and run
#                with TEMPER_ISA=avx2. Default native: each with the best code path for this CPU
#                (TEMPER_ISA is unset, temper from target/release/; on a CPU that lists AMX,
#                mainline llama.cpp is built without GGML_NATIVE and with AMX off, see
#                build-llama-cpp.sh, and the table's header says so).
#   --rounds N   rounds of the whole measurement (default 2, with --quick 1)
#   --anchor A   llama (mainline only), ik (ik_llama.cpp only) or both (default)
#   --np LIST    the anchors' llama-server -np sweep (default "4 8 16 32", with --quick "4 16";
#                env BENCH_NP); a shorter one only to validate the script
# Environment (optional): TEMPER_HOME (caches; default ~/.cache/temper), BENCH_MODEL (GGUF path,
# or the name of one of `make bench-models`' files; default: scripts/fetch-model.sh),
# BENCH_MAX_TOKENS, BENCH_REPS, BENCH_ECHO_TOKENS, BENCH_AGENT_WORDS, BENCH_THREADS (default 2), BENCH_NP, TEMPER_SPEC_ARGS (temper serve
# arguments that turn prompt-lookup speculative decoding on; default: detected from
# `temper serve --help`), BENCH_KEEP_RESULTS (a directory to keep the JSON results and the
# servers' logs in).
set -euo pipefail

cd "$(dirname "$0")/.."
ROOT=$PWD

QUICK=0
BUILD=1
ISA=native
ROUNDS=
ANCHOR=both
NP_LIST=${BENCH_NP:-}
need() { [[ $2 -gt 1 ]] || { echo "bench-compare: $1 needs a value (see --help)" >&2; exit 2; }; }
while [[ $# -gt 0 ]]; do
    case $1 in
        --quick) QUICK=1 ;;
        --no-build) BUILD=0 ;;
        --isa) need "$1" $#; ISA=$2; shift ;;
        --isa=*) ISA=${1#--isa=} ;;
        --rounds) need "$1" $#; ROUNDS=$2; shift ;;
        --rounds=*) ROUNDS=${1#--rounds=} ;;
        --anchor) need "$1" $#; ANCHOR=$2; shift ;;
        --anchor=*) ANCHOR=${1#--anchor=} ;;
        --np) need "$1" $#; NP_LIST=$2; shift ;;
        --np=*) NP_LIST=${1#--np=} ;;
        -h | --help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
            exit 0 ;;
        *) echo "bench-compare: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done
# --quick validates: one round and two -np settings unless told otherwise.
if [[ $QUICK == 1 ]]; then
    ROUNDS=${ROUNDS:-1}
    NP_LIST=${NP_LIST:-4 16}
fi
ROUNDS=${ROUNDS:-2}
NP_LIST=${NP_LIST:-4 8 16 32}
[[ $ROUNDS =~ ^[1-9][0-9]*$ ]] || { echo "bench-compare: --rounds takes a positive number" >&2; exit 2; }
read -r -a NPS <<<"$NP_LIST"
[[ ${#NPS[@]} -gt 0 ]] || { echo "bench-compare: --np needs at least one value" >&2; exit 2; }
for np in "${NPS[@]}"; do
    [[ $np =~ ^[1-9][0-9]*$ ]] || { echo "bench-compare: --np takes positive numbers, not '$np'" >&2; exit 2; }
done
case $ANCHOR in
    llama) ANCHORS=(llama) ;;
    ik) ANCHORS=(ik) ;;
    both) ANCHORS=(llama ik) ;;
    *) echo "bench-compare: --anchor takes llama, ik or both, not '$ANCHOR'" >&2; exit 2 ;;
esac
case $ISA in
    native)
        unset TEMPER_ISA
        TEMPER_TARGET=$ROOT/target
        TEMPER_RUSTFLAGS=
        ISA_DESC="native"
        ;;
    avx2)
        export TEMPER_ISA=avx2
        # target-cpu=native on an AVX-512 host lets the compiler use AVX-512/VNNI encodings
        # inside the AVX2 kernels (it fuses madd + add into vpdpwssd): not the AVX2 path.
        TEMPER_TARGET=$ROOT/target/avx2
        TEMPER_RUSTFLAGS="-C target-cpu=x86-64-v3"
        ISA_DESC="avx2 (forced: temper built for x86-64-v3 and run with TEMPER_ISA=avx2, the anchors built with GGML_NATIVE=OFF, AVX2 only)"
        ;;
    *) echo "bench-compare: --isa takes native or avx2, not '$ISA'" >&2; exit 2 ;;
esac

THREADS=${BENCH_THREADS:-2}
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
LOGS=$RES/logs
mkdir -p "$LOGS"
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

# Phase timings (seconds), printed at the end and kept in the results (phases.txt).
PHASE_NAME=
PHASE_T0=0
phase() {
    local now=$SECONDS
    if [[ -n $PHASE_NAME ]]; then
        echo "$PHASE_NAME: $((now - PHASE_T0)) s" >>"$RES/phases.txt"
    fi
    PHASE_NAME=$1
    PHASE_T0=$now
}

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

# measure SERVER PORT PREFIX: every HTTP figure against the running server, results in
# PREFIX-*.json (SERVER: temper, llama or ik, for the per-server request fields).
measure() {
    local name=$1 port=$2 out=$3 url="http://127.0.0.1:$2" tag
    tag=$(basename "$out")
    log "$tag: warm-up"
    client run --url "$url" --server "$name" --max-tokens 8 >/dev/null
    log "$tag: 1 client, $REPS x $MAX_TOKENS tokens"
    client run --url "$url" --server "$name" --clients 1 --requests "$REPS" \
        --max-tokens "$MAX_TOKENS" --out "$out-c1.json" >/dev/null
    for c in 8 16 32; do
        log "$tag: $c clients x $MAX_TOKENS tokens"
        client run --url "$url" --server "$name" --clients "$c" --requests 1 \
            --max-tokens "$MAX_TOKENS" --pid "$SERVER_PID" --out "$out-c$c.json" >/dev/null
    done
    log "$tag: ~512-token prompts, 1 output token"
    client run --url "$url" --server "$name" --clients 1 --requests "$REPS" --unique \
        --prompt-words 392 --max-tokens 1 --out "$out-p512.json" >/dev/null
    log "$tag: agent conversation, cold and next turn"
    client agent --url "$url" --server "$name" --context-words "$AGENT_WORDS" \
        --reps "$AGENT_REPS" --max-tokens 32 --out "$out-agent.json" >/dev/null
    log "$tag: echo-heavy, $ECHO_TOKENS tokens"
    client run --url "$url" --server "$name" --clients 1 --requests "$REPS" --echo \
        --max-tokens "$ECHO_TOKENS" --out "$out-echo.json" >/dev/null
}

# kv_json LOG OUT: the KV cache size a server logged at start, as {"kv_mib": X} (null if none).
# llama.cpp and ik_llama.cpp print one "<buffer> KV buffer size = X MiB" line per cache (two
# with mainline's sliding-window cache for Gemma 3); temper logs kv_cache_mb=N when loaded.
kv_json() {
    python3 - "$1" "$2" <<'EOF'
import json, re, sys
text = re.sub(r"\x1b\[[0-9;]*m", "", open(sys.argv[1], errors="replace").read())
kv = [float(x) for x in re.findall(r"KV buffer size\s*=\s*([0-9.]+)\s*MiB", text)]
if kv:
    mib = sum(kv)
else:
    m = re.findall(r"kv_cache_mb=([0-9]+)", text)
    mib = float(m[-1]) if m else None
json.dump({"kv_mib": mib}, open(sys.argv[2], "w"))
EOF
}

# --- host, binaries, model -------------------------------------------------------------------
phase "build"
CPU=$(grep -m1 '^model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')
FLAGS=$(grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' \
    | { grep -E '^(avx2|avx_vnni|avx512f|avx512bw|avx512vbmi|avx512_vnni|avx512_bf16|amx_[a-z0-9]+)$' || true; } \
    | tr '\n' ' ' | sed 's/ $//')
CORES=$(nproc)
log "host: $CPU, $CORES cores, flags: ${FLAGS:-none}; ISA: $ISA_DESC"

declare -A ABIN
for a in "${ANCHORS[@]}"; do
    if [[ $BUILD == 1 ]]; then
        ABIN[$a]=$(LLAMA_FORK=$a LLAMA_ISA=$ISA scripts/build-llama-cpp.sh) \
            || die "building the $a anchor failed"
    else
        ABIN[$a]=$(LLAMA_FORK=$a LLAMA_ISA=$ISA scripts/build-llama-cpp.sh --print-bin)
        want=$(LLAMA_FORK=$a LLAMA_ISA=$ISA scripts/build-llama-cpp.sh --dry-run 2>/dev/null | sed -n 2p)
        have=$(cat "${ABIN[$a]}/BUILD" 2>/dev/null || echo unknown)
        [[ $have == "$want" || ! -e ${ABIN[$a]}/llama-server ]] \
            || log "warning: ${ABIN[$a]} was built with '$have', not '$want' (run without --no-build to rebuild it)"
    fi
    [[ -x ${ABIN[$a]}/llama-bench && -x ${ABIN[$a]}/llama-server ]] \
        || die "no $a binaries in ${ABIN[$a]} (run LLAMA_FORK=$a LLAMA_ISA=$ISA scripts/build-llama-cpp.sh)"
done
if [[ $BUILD == 1 ]]; then
    log "building temper (release, into $TEMPER_TARGET)"
    build_env=(CARGO_TARGET_DIR="$TEMPER_TARGET")
    [[ -n $TEMPER_RUSTFLAGS ]] && build_env+=(RUSTFLAGS="$TEMPER_RUSTFLAGS")
    env "${build_env[@]}" cargo build --release -p temper >&2 || die "building temper failed"
fi
TEMPER=$TEMPER_TARGET/release/temper
[[ -x $TEMPER ]] || die "no $TEMPER (run without --no-build to build it)"
MODEL=${BENCH_MODEL:-$(scripts/fetch-model.sh | tail -1)}
# A bare name is one of `make bench-models`' files (scripts/make-bench-models.py).
if [[ $MODEL != */* && ! -f $MODEL ]]; then
    MODEL=${TEMPER_HOME:-$HOME/.cache/temper}/bench-models/$MODEL-q4_k_m.gguf
    [[ -f $MODEL ]] || die "model $MODEL not found (make bench-models writes it)"
fi
[[ -f $MODEL ]] || die "model $MODEL not found"
MODEL=$(realpath "$MODEL")
# The anchors run in a scratch directory: ik_llama.cpp's programs write llama.log into theirs.
RUN_DIR=$TMP/run
mkdir -p "$RUN_DIR"

# Per anchor: llama-server's and llama-bench's extra arguments, and llama-server's logging ones
# (mainline logs its KV buffers only from verbosity 4 on: a few lines at start and per request).
declare -A SERVER_ARGS BENCH_ARGS LOG_ARGS
# The chat template: the file's own through jinja where it has one, else (the Gemma 3 files, whose
# metadata carries none) the built-in gemma one, as temper falls back to.
# (grep -c reads to the end: grep -q would stop head early, which pipefail takes as a failure.)
if head -c 64M "$MODEL" | grep -ac tokenizer.chat_template >/dev/null; then
    TEMPLATE_ARGS="--jinja"
else
    TEMPLATE_ARGS="--no-jinja --chat-template gemma"
fi
SERVER_ARGS[llama]="$TEMPLATE_ARGS"
BENCH_ARGS[llama]=""
LOG_ARGS[llama]="-lv 4"
LOG_ARGS[ik]=""
# ik_llama.cpp: jinja is off unless --jinja; -rtr repacks the weights at load (and turns mmap
# off); flash attention is on by default in both its server and llama-bench.
SERVER_ARGS[ik]="${TEMPLATE_ARGS#--no-jinja } -rtr"
BENCH_ARGS[ik]="-rtr 1"

# temper's main run has prompt lookup off (the anchors' servers do not speculate here), its echo
# row is run again with it on.
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

anchor_meta() { # anchor_meta A: {"commit": ..., "build": ..., "server_args": ..., "bench_args": ...}
    python3 - "$(cat "${ABIN[$1]}/COMMIT" 2>/dev/null || echo '?')" \
        "$(cat "${ABIN[$1]}/BUILD" 2>/dev/null || echo '?')" "${SERVER_ARGS[$1]}" "${BENCH_ARGS[$1]}" <<'EOF'
import json, sys
print(json.dumps(dict(zip(["commit", "build", "server_args", "bench_args"], sys.argv[1:]))))
EOF
}
anchors_json="{"
for a in "${ANCHORS[@]}"; do
    anchors_json+="\"$a\": $(anchor_meta "$a"),"
done
anchors_json="${anchors_json%,}}"
python3 - "$RES/meta.json" <<EOF
import json, sys
json.dump({
    "cpu": """$CPU""", "cores": $CORES, "flags": "$FLAGS", "mode": """$MODE""",
    "max_tokens": $MAX_TOKENS, "echo_tokens": $ECHO_TOKENS, "threads": $THREADS,
    "rounds": $ROUNDS, "np": [$(IFS=,; echo "${NPS[*]}")], "slot_ctx": $SLOT_CTX, "pp_reps": $PP_REPS,
    "anchors": $anchors_json,
    "temper_commit": "$(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD 2>/dev/null || echo '+dirty')",
    "spec_flag": "$SPEC_FLAG", "spec_na": "$SPEC_NA", "isa": "$ISA_DESC",
}, open(sys.argv[1], "w"))
EOF

# --- one round of one server -----------------------------------------------------------------
# run_anchor A DIR: llama-bench pp512, then llama-server at every -np of the sweep.
run_anchor() {
    local a=$1 dir=$2 bin=${ABIN[$1]} np ctx logf r
    r=$(basename "$dir")
    log "$a: llama-bench pp512 (-t $THREADS, -r $PP_REPS ${BENCH_ARGS[$a]})"
    # shellcheck disable=SC2086 # BENCH_ARGS holds several words
    (cd "$RUN_DIR" && "$bin/llama-bench" -m "$MODEL" -p 512 -n 0 -t "$THREADS" -r "$PP_REPS" \
        ${BENCH_ARGS[$a]} -o json) >"$dir/$a-llama-bench.json" 2>"$LOGS/$r-$a-llama-bench.log" \
        || { tail -20 "$LOGS/$r-$a-llama-bench.log" >&2; die "$a llama-bench failed"; }
    python3 - "$dir/$a-llama-bench.json" "$dir/$a-pp512.json" <<'EOF'
import json, sys
runs = [r for r in json.load(open(sys.argv[1])) if r.get("n_prompt") == 512 and r.get("n_gen") == 0]
r = runs[0]
# Best of the repetitions, as temper bench reports (avg_ts is their mean).
json.dump({"tok_s": max(r.get("samples_ts") or [r["avg_ts"]]), "mean_tok_s": r["avg_ts"]},
          open(sys.argv[2], "w"))
EOF
    for np in "${NPS[@]}"; do
        ctx=$((np * SLOT_CTX))
        PORT=$(free_port)
        logf=$LOGS/$r-$a-np$np-server.log
        log "$a: llama-server on port $PORT (-t $THREADS -np $np -c $ctx ${SERVER_ARGS[$a]})"
        # shellcheck disable=SC2086 # SERVER_ARGS holds several words
        (cd "$RUN_DIR" && exec "$bin/llama-server" -m "$MODEL" --host 127.0.0.1 --port "$PORT" \
            -t "$THREADS" -np "$np" -c "$ctx" ${SERVER_ARGS[$a]} ${LOG_ARGS[$a]}) >"$logf" 2>&1 &
        SERVER_PID=$!
        wait_health "$a llama-server" "$PORT" "$logf"
        kv_json "$logf" "$dir/$a-np$np-kv.json"
        measure "$a" "$PORT" "$dir/$a-np$np"
        stop_server
    done
}

start_temper() { # start_temper LOG ARGS...
    local logf=$1
    shift
    PORT=$(free_port)
    local data=$TMP/temper-data-$PORT
    mkdir -p "$data"
    log "temper: serve on port $PORT $*"
    RAYON_NUM_THREADS=$THREADS "$TEMPER" serve --model "$(basename "$MODEL" .gguf)=$MODEL" --host 127.0.0.1 \
        --port "$PORT" --data-dir "$data" "$@" >"$logf" 2>&1 &
    SERVER_PID=$!
    wait_health "temper serve" "$PORT" "$logf"
}

# run_temper DIR: temper bench's 512-token prefill, then temper serve (prompt lookup off), then
# the echo row with prompt lookup on.
run_temper() {
    local dir=$1 r pp
    r=$(basename "$dir")
    log "temper: prefill of a 512-token prompt (temper bench, best of $PP_REPS)"
    RAYON_NUM_THREADS=$THREADS "$TEMPER" bench --model "$MODEL" --prompt-lens 512 --decode-tokens 4 \
        --concurrency 1 --train-shapes '' --train-jobs '' --repeat "$PP_REPS" \
        >"$LOGS/$r-temper-bench.txt" 2>"$LOGS/$r-temper-bench.log" \
        || { tail -20 "$LOGS/$r-temper-bench.log" >&2; die "temper bench failed"; }
    pp=$(grep -E '^\| prompt processing, 512 tokens' "$LOGS/$r-temper-bench.txt" | cut -d'|' -f3 \
        | grep -oE '[0-9.]+' | head -1 || true)
    [[ -n $pp ]] || { cat "$LOGS/$r-temper-bench.txt" >&2; die "no 512-token prefill row in temper bench's table"; }
    if [[ $ISA == avx2 ]] && ! head -1 "$LOGS/$r-temper-bench.txt" | grep -q ', avx2 kernels;'; then
        head -1 "$LOGS/$r-temper-bench.txt" >&2
        die "temper bench did not run its avx2 kernels with TEMPER_ISA=avx2 (first line above)"
    fi
    echo "{\"tok_s\": $pp}" >"$dir/temper-pp512.json"

    start_temper "$LOGS/$r-temper-serve.log" "${OFF_ARGS[@]}"
    kv_json "$LOGS/$r-temper-serve.log" "$dir/temper-kv.json"
    measure temper "$PORT" "$dir/temper"
    stop_server

    if [[ -n $SPEC_FLAG ]]; then
        # shellcheck disable=SC2086 # TEMPER_SPEC_ARGS may hold several words
        start_temper "$LOGS/$r-temper-serve-spec.log" $SPEC_FLAG
        local url="http://127.0.0.1:$PORT"
        client run --url "$url" --server temper --max-tokens 8 >/dev/null
        log "temper ($SPEC_FLAG): echo-heavy, $ECHO_TOKENS tokens"
        client run --url "$url" --server temper --clients 1 --requests "$REPS" --echo \
            --max-tokens "$ECHO_TOKENS" --out "$dir/temper-echo-spec.json" >/dev/null
        stop_server
    fi
}

# --- the rounds: temper first in odd rounds, last in even ones --------------------------------
for ((r = 1; r <= ROUNDS; r++)); do
    dir=$RES/r$r
    mkdir -p "$dir"
    if ((r % 2 == 1)); then
        order=(temper "${ANCHORS[@]}")
    else
        order=()
        for ((i = ${#ANCHORS[@]} - 1; i >= 0; i--)); do order+=("${ANCHORS[i]}"); done
        order+=(temper)
    fi
    log "round $r of $ROUNDS: ${order[*]}"
    for s in "${order[@]}"; do
        phase "round $r: $s"
        if [[ $s == temper ]]; then run_temper "$dir"; else run_anchor "$s" "$dir"; fi
    done
done

# --- equal KV capacity: temper with --kv-cache-mb = each anchor's KV size ----------------------
mkdir -p "$RES/eqkv"
for a in "${ANCHORS[@]}"; do
    phase "equal KV: temper at $a's KV size"
    read -r np kv < <(client best-np --results "$RES" --anchor "$a") || true
    [[ -n ${kv:-} ]] || die "could not pick $a's best -np for the equal-KV row"
    if [[ $kv == none ]]; then
        log "no KV size in $a's log: no equal-KV row for it"
        continue
    fi
    mb=$(python3 -c "import math, sys; print(max(1, math.ceil(float(sys.argv[1]))))" "$kv")
    echo "{\"np\": $np, \"kv_mib\": $kv, \"kv_cache_mb\": $mb}" >"$RES/eqkv/$a.json"
    start_temper "$LOGS/eqkv-$a-temper-serve.log" "${OFF_ARGS[@]}" --kv-cache-mb "$mb"
    kv_json "$LOGS/eqkv-$a-temper-serve.log" "$RES/eqkv/temper-$a-kv.json"
    url="http://127.0.0.1:$PORT"
    client run --url "$url" --server temper --max-tokens 8 >/dev/null
    for ((k = 1; k <= ROUNDS; k++)); do
        for c in 16 32; do
            log "temper --kv-cache-mb $mb (= $a -np $np, $kv MiB), run $k of $ROUNDS: $c clients x $MAX_TOKENS tokens"
            client run --url "$url" --server temper --clients "$c" --requests 1 \
                --max-tokens "$MAX_TOKENS" --pid "$SERVER_PID" \
                --out "$RES/eqkv/temper-$a-c$c-r$k.json" >/dev/null
        done
    done
    stop_server
done
phase ""

echo
client table --results "$RES"
echo
log "phase timings:"
sed 's/^/bench-compare:   /' "$RES/phases.txt" >&2
