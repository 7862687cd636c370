#!/usr/bin/env bash
# Builds (or reuses) ik_llama.cpp's `llama-bench` and `llama-server` for `make bench-compare`:
# scripts/build-llama-cpp.sh with LLAMA_FORK=ik (see there: the source is the one vendored by the
# ik-llama-cpp-python 0.1.5 source package, built with GGML_NATIVE=ON and
# GGML_IQK_FA_ALL_QUANTS=OFF into $TEMPER_HOME/ik_llama.cpp-0.1.5/bin/, or AVX2-only with
# LLAMA_ISA=avx2 into bin-avx2/). Prints the bin directory; `--print-bin` builds nothing.
set -euo pipefail
LLAMA_FORK=ik exec "$(dirname "$0")/build-llama-cpp.sh" "$@"
