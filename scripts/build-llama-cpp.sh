#!/usr/bin/env bash
# Builds (or reuses) llama.cpp's `llama-bench` and `llama-server` at the commit pinned for
# comparisons (0c1e570, as vendored by the llama-cpp-python 0.3.36 source package), for
# `make bench-compare`. Everything lives outside the checkout:
#   $TEMPER_HOME/bench-venv            a venv with cmake and ninja (pip)
#   $TEMPER_HOME/llama.cpp-0.3.36/     the source package, the build, and bin/ with the binaries
# Release build, no curl/openssl, tests and examples off. LLAMA_ISA picks the CPU code paths:
#   native (default)  for this host's CPU (GGML_NATIVE), in build/ and bin/
#   avx2              AVX2 only (GGML_NATIVE=OFF; AVX, AVX2, FMA, F16C, BMI2 on; every AVX512*,
#                     AVX_VNNI and AMX option off), in build-avx2/ and bin-avx2/, for
#                     `scripts/bench-compare.sh --isa avx2` on an AVX-512 host
# Prints the bin directory on stdout; progress goes to stderr. Reused when that bin directory is
# complete (delete it to rebuild, e.g. after moving to another host kind).
set -euo pipefail

VERSION=0.3.36
COMMIT=0c1e570
HOME_DIR=${TEMPER_HOME:-$HOME/.cache/temper}
VENV=$HOME_DIR/bench-venv
ROOT=$HOME_DIR/llama.cpp-$VERSION
JOBS=${LLAMA_BUILD_JOBS:-2}
ISA=${LLAMA_ISA:-native}

log() { echo "build-llama-cpp: $*" >&2; }

case $ISA in
    native)
        BUILD=$ROOT/build
        BIN=$ROOT/bin
        ISA_DESC="native CPU"
        ISA_ARGS=(-DGGML_NATIVE=ON)
        ;;
    avx2)
        BUILD=$ROOT/build-avx2
        BIN=$ROOT/bin-avx2
        ISA_DESC="AVX2 only"
        ISA_ARGS=(-DGGML_NATIVE=OFF
            -DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
            -DGGML_AVX_VNNI=OFF -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF
            -DGGML_AVX512_BF16=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
        ;;
    *)
        echo "build-llama-cpp: LLAMA_ISA must be native or avx2, not $ISA" >&2
        exit 2
        ;;
esac

if [[ -x $BIN/llama-bench && -x $BIN/llama-server && -f $BIN/COMMIT ]]; then
    echo "$BIN"
    exit 0
fi

mkdir -p "$ROOT/src"
if [[ ! -x $VENV/bin/cmake || ! -x $VENV/bin/ninja ]]; then
    log "creating $VENV with cmake and ninja"
    python3 -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check cmake ninja >&2
fi

SRC=$ROOT/src/llama_cpp_python-$VERSION
if [[ ! -f $SRC/vendor/llama.cpp/CMakeLists.txt ]]; then
    sdist=$ROOT/src/llama_cpp_python-$VERSION.tar.gz
    if [[ ! -f $sdist ]]; then
        log "downloading the llama-cpp-python==$VERSION source package"
        # Only this package as source: `--no-binary :all:` would also build its build
        # dependencies (cmake itself) from source just to read the package's metadata.
        "$VENV/bin/python" -m pip download -q --disable-pip-version-check \
            --no-binary llama-cpp-python --no-deps "llama-cpp-python==$VERSION" \
            -d "$ROOT/src" >&2
    fi
    tar -xzf "$sdist" -C "$ROOT/src"
fi
LLAMA=$SRC/vendor/llama.cpp
# The source package carries the submodule's git metadata: check the pin when it is there.
head_file=$SRC/.git/modules/vendor/llama.cpp/HEAD
if [[ -f $head_file ]]; then
    head=$(cut -c1-${#COMMIT} "$head_file")
    if [[ $head != "$COMMIT" ]]; then
        echo "build-llama-cpp: vendored llama.cpp is at $head, expected $COMMIT" >&2
        exit 1
    fi
fi

log "building llama-bench and llama-server ($COMMIT, Release, $ISA_DESC, -j$JOBS); this takes a while"
export PATH=$VENV/bin:$PATH
cmake -S "$LLAMA" -B "$BUILD" -G Ninja \
    -DCMAKE_BUILD_TYPE=Release \
    "${ISA_ARGS[@]}" \
    -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_BUILD_COMMIT="$COMMIT" >&2
cmake --build "$BUILD" --config Release -j "$JOBS" --target llama-bench llama-server >&2

mkdir -p "$BIN"
for b in llama-bench llama-server; do
    cp "$BUILD/bin/$b" "$BIN/$b"
done
echo "$COMMIT" >"$BIN/COMMIT"
log "built into $BIN"
echo "$BIN"
