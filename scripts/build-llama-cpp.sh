#!/usr/bin/env bash
# Builds (or reuses) `llama-bench` and `llama-server` of a pinned llama.cpp for the comparisons of
# `make bench-compare` (and, for mainline, `llama-quantize`, which writes the benchmark models of
# scripts/make-bench-models.py): mainline llama.cpp or its CPU-speed fork ik_llama.cpp, each from the
# source that a Python binding's source package vendors. Everything lives outside the checkout:
#   $TEMPER_HOME/bench-venv                a venv with cmake and ninja (pip)
#   $TEMPER_HOME/llama.cpp-0.3.36/         LLAMA_FORK=llama (default): llama.cpp 0c1e570, as
#                                          vendored by the llama-cpp-python 0.3.36 source package
#   $TEMPER_HOME/ik_llama.cpp-0.1.5/       LLAMA_FORK=ik (scripts/build-ik-llama-cpp.sh):
#                                          ik_llama.cpp as vendored by the ik-llama-cpp-python
#                                          0.1.5 source package (it carries no git metadata: the
#                                          package's sha256 is pinned instead), built with
#                                          GGML_IQK_FA_ALL_QUANTS=OFF (its default, ON, compiles
#                                          flash-attention kernels for every KV quant: hours here),
#                                          and with upstream's later fix of its CPU flash attention
#                                          for parallel slots re-applied (see below)
# each with the source package, build directories and bin directories of binaries. Release build,
# static, no curl/openssl, tests off, only the two targets. LLAMA_ISA picks the CPU code paths:
#   native (default)  for this host's CPU (GGML_NATIVE=ON), in build/ and bin/. Except for mainline
#                     on a host whose CPU flags list AMX (amx_tile, ...): VMs often do not grant
#                     the AMX tile state, and mainline's native build then dies with SIGILL in its
#                     AMX kernels. There `native` means `native-noamx`. (ik_llama.cpp has no AMX
#                     kernels: its native build is used everywhere.)
#   native-noamx      GGML_NATIVE=OFF with every ISA option this CPU lists turned on (AVX, AVX2,
#                     FMA, F16C, BMI2, AVX_VNNI, AVX512 when avx512f/bw/cd/dq/vl are all listed,
#                     AVX512_VBMI, AVX512_VNNI, AVX512_BF16) and every AMX option off, in
#                     build-native-noamx/ and bin-native-noamx/ (mainline only)
#   avx2              AVX2 only (GGML_NATIVE=OFF; AVX, AVX2, FMA, F16C, BMI2 on; every AVX512*,
#                     AVX_VNNI and AMX option off), in build-avx2/ and bin-avx2/, for
#                     `scripts/bench-compare.sh --isa avx2` on an AVX-512 host
# Prints the bin directory on stdout; progress goes to stderr. `--print-bin` only prints the bin
# directory this host and these settings use, building nothing; `--dry-run` prints the bin
# directory, the build settings and the cmake ISA options, building nothing. The bin directory
# holds COMMIT (the pin) and BUILD (one line: the build settings, for the benchmark's table); it
# is reused when complete and its BUILD line matches (delete it to rebuild, e.g. after moving to
# another host kind).
#
# The ik fix: the ik_llama.cpp that ik-llama-cpp-python 0.1.5 vendors aborts with
# `GGML_ASSERT(S > 0)` in its CPU flash attention (iqk_fa_templates.h) as soon as llama-server
# puts two sequences in one batch (-np > 1; ik_llama.cpp issues #809, #1910, #1961): its
# early-termination scan reads only the last query row's mask, and with several slots another
# row's keys lie beyond it. Upstream fixed that after this snapshot (#1880, then #1935 turned the
# scan off, #1961 made a fully masked row give zeros). This script makes the same two changes with
# sed: the four scans are turned off (all key blocks are visited, as upstream does now) and the
# assertion becomes "a fully masked row is zero". Without them ik_llama.cpp's llama-server could
# only serve concurrent clients with flash attention off, not its default. (The source package
# also lacks common/cmake/build-info-gen-cpp.cmake, which the build needs: a minimal one is
# written.)
# Environment: LLAMA_FORK (llama | ik), LLAMA_ISA, LLAMA_BUILD_JOBS (default 2), TEMPER_HOME,
# LLAMA_CPU_FLAGS (the CPU flags to decide by, instead of /proc/cpuinfo's: to check the AMX logic
# with --dry-run on a host without AMX).
set -euo pipefail

HOME_DIR=${TEMPER_HOME:-$HOME/.cache/temper}
VENV=$HOME_DIR/bench-venv
JOBS=${LLAMA_BUILD_JOBS:-2}
ISA=${LLAMA_ISA:-native}
FORK=${LLAMA_FORK:-llama}
PRINT_ONLY=0
DRY_RUN=0
case ${1:-} in
    --print-bin) PRINT_ONLY=1 ;;
    --dry-run) DRY_RUN=1 ;;
    "") ;;
    *) echo "build-llama-cpp: unknown argument $1 (--print-bin or --dry-run)" >&2; exit 2 ;;
esac

log() { echo "build-llama-cpp: $*" >&2; }

case $FORK in
    llama)
        NAME=llama.cpp
        PKG=llama-cpp-python
        VERSION=0.3.36
        COMMIT=0c1e570
        SDIST_SHA256=
        ROOT=$HOME_DIR/llama.cpp-$VERSION
        SRC=$ROOT/src/llama_cpp_python-$VERSION
        LLAMA=$SRC/vendor/llama.cpp
        ;;
    ik)
        NAME=ik_llama.cpp
        PKG=ik-llama-cpp-python
        VERSION=0.1.5
        COMMIT="ik-llama-cpp-python-$VERSION"
        SDIST_SHA256=33c67eb99e4dcab5e611050433243815709b8b3067753f9ce18375013cf002ad
        ROOT=$HOME_DIR/ik_llama.cpp-$VERSION
        SRC=$ROOT/src/ik_llama_cpp_python-$VERSION
        LLAMA=$SRC/vendor/ik_llama.cpp
        ;;
    *)
        echo "build-llama-cpp: LLAMA_FORK must be llama or ik, not $FORK" >&2
        exit 2
        ;;
esac

CPU_FLAGS=" ${LLAMA_CPU_FLAGS:-$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | cut -d: -f2-)} "
has() { [[ $CPU_FLAGS == *" $1 "* ]]; }

if [[ $ISA == native && $FORK == llama ]] && grep -qE ' amx_[a-z0-9]+ ' <<<"$CPU_FLAGS"; then
    ISA=native-noamx
    log "this CPU lists AMX: building mainline without GGML_NATIVE and with AMX off (native-noamx)"
fi

AMX_OFF=(-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
case $ISA in
    native)
        BUILD=$ROOT/build
        BIN=$ROOT/bin
        ISA_DESC="GGML_NATIVE=ON"
        ISA_ARGS=(-DGGML_NATIVE=ON)
        ;;
    native-noamx)
        [[ $FORK == llama ]] || { echo "build-llama-cpp: native-noamx is for mainline (LLAMA_FORK=llama)" >&2; exit 2; }
        BUILD=$ROOT/build-native-noamx
        BIN=$ROOT/bin-native-noamx
        on=(AVX AVX2 FMA F16C)
        ISA_ARGS=(-DGGML_NATIVE=OFF -DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON
            -DGGML_F16C=ON)
        opt() { # opt OPTION CPU-FLAG...: OPTION on when the CPU lists every flag, else off
            local o=$1 f
            shift
            for f in "$@"; do
                has "$f" || { ISA_ARGS+=("-DGGML_$o=OFF"); return; }
            done
            ISA_ARGS+=("-DGGML_$o=ON")
            on+=("$o")
        }
        opt BMI2 bmi2
        opt AVX_VNNI avx_vnni
        opt AVX512 avx512f avx512bw avx512cd avx512dq avx512vl
        opt AVX512_VBMI avx512f avx512vbmi
        opt AVX512_VNNI avx512f avx512_vnni
        opt AVX512_BF16 avx512f avx512_bf16
        ISA_ARGS+=("${AMX_OFF[@]}")
        ISA_DESC="GGML_NATIVE=OFF, $(IFS=,; echo "${on[*]}") on, AMX off"
        if grep -qE ' amx_[a-z0-9]+ ' <<<"$CPU_FLAGS"; then ISA_DESC+=" (the CPU lists AMX)"; fi
        ;;
    avx2)
        BUILD=$ROOT/build-avx2
        BIN=$ROOT/bin-avx2
        ISA_DESC="GGML_NATIVE=OFF, AVX2 only"
        ISA_ARGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
            -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF)
        if [[ $FORK == llama ]]; then
            ISA_ARGS+=(-DGGML_SSE42=ON -DGGML_BMI2=ON -DGGML_AVX_VNNI=OFF "${AMX_OFF[@]}")
        fi
        ;;
    *)
        echo "build-llama-cpp: LLAMA_ISA must be native, native-noamx or avx2, not $ISA" >&2
        exit 2
        ;;
esac

case $FORK in
    llama) FORK_DESC= ;;
    ik) FORK_DESC=", GGML_IQK_FA_ALL_QUANTS=OFF, + upstream's multi-slot CPU FA fix (ik #1880/#1935/#1961)" ;;
esac
if [[ $PRINT_ONLY == 1 ]]; then
    echo "$BIN"
    exit 0
fi
if [[ $DRY_RUN == 1 ]]; then
    echo "$BIN"
    echo "$ISA_DESC$FORK_DESC"
    echo "${ISA_ARGS[*]}"
    exit 0
fi
case $FORK in
    llama) TARGETS=(llama-bench llama-server llama-quantize) ;;
    ik) TARGETS=(llama-bench llama-server) ;;
esac
complete=1
for b in "${TARGETS[@]}"; do
    [[ -x $BIN/$b ]] || complete=0
done
if [[ $complete == 1 && -f $BIN/COMMIT ]]; then
    # (a mainline bin directory from before BUILD existed was built with these same settings)
    [[ -f $BIN/BUILD || $FORK != llama ]] || echo "$ISA_DESC" >"$BIN/BUILD"
    if [[ $(cat "$BIN/BUILD" 2>/dev/null) == "$ISA_DESC$FORK_DESC" ]]; then
        echo "$BIN"
        exit 0
    fi
    log "$BIN was built with other settings ($(cat "$BIN/BUILD" 2>/dev/null || echo unknown)): rebuilding"
fi

mkdir -p "$ROOT/src"
if [[ ! -x $VENV/bin/cmake || ! -x $VENV/bin/ninja ]]; then
    log "creating $VENV with cmake and ninja"
    python3 -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check cmake ninja >&2
fi

if [[ ! -f $LLAMA/CMakeLists.txt ]]; then
    sdist=$ROOT/src/$(basename "$SRC").tar.gz
    if [[ ! -f $sdist ]]; then
        log "downloading the $PKG==$VERSION source package"
        # Only this package as source: `--no-binary :all:` would also build its build
        # dependencies (cmake itself) from source just to read the package's metadata.
        "$VENV/bin/python" -m pip download -q --disable-pip-version-check \
            --no-binary "$PKG" --no-deps "$PKG==$VERSION" -d "$ROOT/src" >&2
    fi
    if [[ -n $SDIST_SHA256 ]]; then
        got=$(sha256sum "$sdist" | cut -d' ' -f1)
        if [[ $got != "$SDIST_SHA256" ]]; then
            echo "build-llama-cpp: $sdist has sha256 $got, expected $SDIST_SHA256" >&2
            exit 1
        fi
    fi
    tar -xzf "$sdist" -C "$ROOT/src"
fi
# The mainline source package carries the submodule's git metadata: check the pin when it is there.
head_file=$SRC/.git/modules/vendor/llama.cpp/HEAD
if [[ $FORK == llama && -f $head_file ]]; then
    head=$(cut -c1-${#COMMIT} "$head_file")
    if [[ $head != "$COMMIT" ]]; then
        echo "build-llama-cpp: vendored llama.cpp is at $head, expected $COMMIT" >&2
        exit 1
    fi
fi

# ik-llama-cpp-python's source package leaves out common/cmake/build-info-gen-cpp.cmake, the
# script that ik_llama.cpp's build runs to write common/build-info.cpp: put a minimal one there
# (the build info names the source package, as there is no git metadata to read).
gen=$LLAMA/common/cmake/build-info-gen-cpp.cmake
if [[ $FORK == ik && ! -f $gen ]]; then
    mkdir -p "$(dirname "$gen")"
    cat >"$gen" <<CMAKE
# Written by temper's scripts/build-llama-cpp.sh: the source package lacks this file.
include(\${CMAKE_CURRENT_SOURCE_DIR}/cmake/build-info.cmake)
set(BUILD_COMMIT "$COMMIT")
configure_file(\${CMAKE_CURRENT_SOURCE_DIR}/common/build-info.cpp.in
    \${CMAKE_CURRENT_SOURCE_DIR}/common/build-info.cpp)
CMAKE
fi

# The ik fix (see the header): idempotent, each change checked.
fa=$LLAMA/ggml/src/iqk/fa/iqk_fa_templates.h
if [[ $FORK == ik ]] && ! grep -q 'temper: no early termination' "$fa"; then
    log "re-applying upstream's CPU flash-attention fix for parallel slots to $fa"
    n_scan=$(grep -c 'for (; ik >=0 && Mc\[ik\] != 0; ik -= k_step);' "$fa" || true)
    n_assert=$(grep -c 'GGML_ASSERT(S > 0);' "$fa" || true)
    if [[ $n_scan != 4 || $n_assert != 1 ]]; then
        echo "build-llama-cpp: $fa is not the expected source ($n_scan scans, $n_assert asserts)" >&2
        exit 1
    fi
    sed -i \
        -e 's|for (; ik >=0 \&\& Mc\[ik\] != 0; ik -= k_step);|(void)Mc; /* temper: no early termination (upstream ik_llama.cpp #1880, #1935) */|' \
        -e 's|GGML_ASSERT(S > 0);|if (!(S > 0)) { /* temper: a fully masked row is zero (upstream ik_llama.cpp #1961) */ for (int i = 0; i < D/F16::block_size; ++i) F16::store(qkv + F16::block_size*i, F16::zero()); return; }|' \
        "$fa"
fi

case $FORK in
    llama)
        FORK_ARGS=(-DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_EXAMPLES=OFF
            -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_COMMIT="$COMMIT")
        ;;
    ik)
        # llama-bench is one of ik's examples; the rest of them are not built (only the targets).
        FORK_ARGS=(-DLLAMA_BUILD_EXAMPLES=ON -DGGML_IQK_FA_ALL_QUANTS=OFF)
        ;;
esac

log "building $NAME's llama-bench and llama-server ($COMMIT, Release, $ISA_DESC$FORK_DESC, -j$JOBS); this takes a while"
export PATH=$VENV/bin:$PATH
cmake -S "$LLAMA" -B "$BUILD" -G Ninja \
    -DCMAKE_BUILD_TYPE=Release \
    "${ISA_ARGS[@]}" \
    -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=ON \
    "${FORK_ARGS[@]}" >&2
cmake --build "$BUILD" --config Release -j "$JOBS" --target "${TARGETS[@]}" >&2

mkdir -p "$BIN"
for b in "${TARGETS[@]}"; do
    cp "$BUILD/bin/$b" "$BIN/$b"
done
echo "$ISA_DESC$FORK_DESC" >"$BIN/BUILD"
echo "$COMMIT" >"$BIN/COMMIT"
log "built into $BIN"
echo "$BIN"
