#!/usr/bin/env bash
# Usage: scripts/real-tokenizers.sh. Makes (once per pin set) and prints the directory of the real
# Llama 3 and Qwen tokenizers: ${TEMPER_HOME:-$HOME/.cache/temper}/real-tokenizers, written by
# scripts/real_tokenizers.py (see there) with the pinned venv of
# scripts/requirements-real-tokenizers.txt and llama.cpp's converter (scripts/build-llama-cpp.sh's
# source). Reused while the script, the pins and the converter are the same.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
home="${TEMPER_HOME:-$HOME/.cache/temper}"
out="$home/real-tokenizers"
python=$("$root/scripts/pinned-venv.sh" "$root/scripts/requirements-real-tokenizers.txt" real-tokenizers-venv)
llama_cpp="$home/llama.cpp-0.3.36/src/llama_cpp_python-0.3.36/vendor/llama.cpp"
# The converter: llama.cpp as vendored by the llama-cpp-python 0.3.36 source package, where
# scripts/build-llama-cpp.sh unpacks it (only the source is needed here, nothing is built).
if [ ! -f "$llama_cpp/convert_hf_to_gguf.py" ]; then
    src="$home/llama.cpp-0.3.36/src"
    mkdir -p "$src"
    [ -f "$src/llama_cpp_python-0.3.36.tar.gz" ] ||
        "$python" -m pip download -q --disable-pip-version-check --no-binary llama-cpp-python \
            --no-deps llama-cpp-python==0.3.36 -d "$src" >&2
    tar -xzf "$src/llama_cpp_python-0.3.36.tar.gz" -C "$src"
fi
want=$(cat "$root/scripts/real_tokenizers.py" "$root/scripts/requirements-real-tokenizers.txt" \
    "$llama_cpp/convert_hf_to_gguf.py" | sha256sum | cut -d' ' -f1)
# The stamp is written after a complete run only.
if [ "$(cat "$out/stamp" 2>/dev/null)" != "$want" ]; then
    rm -f "$out/stamp"
    "$python" "$root/scripts/real_tokenizers.py" --out "$out" --llama-cpp "$llama_cpp" >&2
    echo "$want" >"$out/stamp"
fi
echo "$out"
