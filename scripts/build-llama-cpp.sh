#!/usr/bin/env bash
# Builds (or reuses) llama.cpp's `llama-bench` and `llama-server` at the commit pinned for
# comparisons (0c1e570, as vendored by the llama-cpp-python 0.3.36 source package), for
# `make bench-compare`. Everything lives outside the checkout:
#   $TEMPER_HOME/bench-venv            a venv with cmake and ninja (pip)
#   $TEMPER_HOME/llama.cpp-0.3.36/     the source package, the build, and bin/ with the binaries
# Release build for this host's CPU (GGML_NATIVE), no curl/openssl, tests and examples off.
# Prints the bin/ directory on stdout; progress goes to stderr. Reused when bin/ is complete
# (delete the directory to rebuild, e.g. after moving to another host kind).
set -euo pipefail

VERSION=0.3.36
COMMIT=0c1e570
HOME_DIR=${TEMPER_HOME:-$HOME/.cache/temper}
VENV=$HOME_DIR/bench-venv
ROOT=$HOME_DIR/llama.cpp-$VERSION
BIN=$ROOT/bin
JOBS=${LLAMA_BUILD_JOBS:-2}

log() { echo "build-llama-cpp: $*" >&2; }

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

log "building llama-bench and llama-server ($COMMIT, Release, native CPU, -j$JOBS); this takes a while"
export PATH=$VENV/bin:$PATH
cmake -S "$LLAMA" -B "$ROOT/build" -G Ninja \
    -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=ON \
    -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_BUILD_COMMIT="$COMMIT" >&2
cmake --build "$ROOT/build" --config Release -j "$JOBS" --target llama-bench llama-server >&2

mkdir -p "$BIN"
for b in llama-bench llama-server; do
    cp "$ROOT/build/bin/$b" "$BIN/$b"
done
echo "$COMMIT" >"$BIN/COMMIT"
log "built into $BIN"
echo "$BIN"
