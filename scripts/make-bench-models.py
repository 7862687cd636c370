#!/usr/bin/env python3
"""Writes the benchmark models of `make bench-compare MODEL=...` at real sizes: GGUF files in the
exact shapes of Qwen3-0.6B, Qwen3-1.7B, Llama-3.2-1B and Gemma-3-1B (their published configs)
with random weights, written as F16 and quantized to Q4_K_M by llama.cpp's own `llama-quantize`.
On request (`--only gemma-3-270m`) also the default model's own shape: llama-quantize gives it the
default model's mix of quant types tensor for tensor (Q8_0 embedding, Q5_0 where a row of 640
does not fill Q4_K's 256-wide blocks), so it stands in for the default model where only its
tokenizer can travel.

Speed does not depend on the weights' values (the benchmarks run with `ignore_eos`), so no
checkpoint is needed; the metadata keys and tensor names are the ones llama.cpp's converter writes
for each architecture (compare crates/model/tests/fixtures/tiny-*.gguf, which the converter
wrote). The tokenizer metadata (vocabulary, merges, special ids, chat template) is copied from a
donor GGUF with the real vocabulary: Gemma 3's from the default model, Llama 3's and Qwen's from
the files `scripts/real_tokenizers.py` builds from their tiktoken vocabularies.

`make bench-models` (scripts/bench-models.sh) runs it with the pinned venv of
scripts/requirements-real-tokenizers.txt (numpy and gguf are all it needs):

    python scripts/make-bench-models.py --out ~/.cache/temper/bench-models \\
        [--only qwen3-0.6b,...] [--quantize PATH/llama-quantize] \\
        --tokenizer gemma=PATH --tokenizer llama3=PATH --tokenizer qwen=PATH
"""

import argparse
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

HOME = Path(os.environ.get("TEMPER_HOME", Path.home() / ".cache/temper"))
QUANTIZE = HOME / "llama.cpp-0.3.36/bin/llama-quantize"

# The published config.json of each model, in GGUF's terms.
# on_request: made only when named in --only.
SHAPES = {
    "qwen3-0.6b": dict(
        arch="qwen3", tokenizer="qwen", vocab=151936, width=1024, ffn=3072, layers=28,
        heads=16, kv_heads=8, head_dim=128, context=40960, rope_base=1e6, eps=1e-6,
        tied=True,
    ),
    "qwen3-1.7b": dict(
        arch="qwen3", tokenizer="qwen", vocab=151936, width=2048, ffn=6144, layers=28,
        heads=16, kv_heads=8, head_dim=128, context=40960, rope_base=1e6, eps=1e-6,
        tied=True,
    ),
    "llama-3.2-1b": dict(
        arch="llama", tokenizer="llama3", vocab=128256, width=2048, ffn=8192, layers=16,
        heads=32, kv_heads=8, head_dim=64, context=131072, rope_base=500000.0, eps=1e-5,
        tied=True,
        # rope_scaling: {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
        # "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        llama3_rope=dict(factor=32.0, low=1.0, high=4.0, original=8192),
    ),
    "gemma-3-270m": dict(
        arch="gemma3", tokenizer="gemma", vocab=262144, width=640, ffn=2048, layers=18,
        heads=4, kv_heads=1, head_dim=256, context=32768, rope_base=1e6, eps=1e-6,
        tied=True, sliding_window=512, on_request=True,
    ),
    "gemma-3-1b": dict(
        arch="gemma3", tokenizer="gemma", vocab=262144, width=1152, ffn=6912, layers=26,
        heads=4, kv_heads=1, head_dim=256, context=32768, rope_base=1e6, eps=1e-6,
        tied=True, sliding_window=512,
    ),
}

# Tokenizer keys a donor's metadata may hold; everything else comes from the shape.
TOKENIZER_PREFIX = "tokenizer."


def llama3_rope_factors(head_dim, base, factor, low, high, original):
    """The converter's `rope_freqs` tensor for Llama 3's rope scaling (LlamaModel's
    generate_extra_tensors)."""
    freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    low_wavelen = original / low
    high_wavelen = original / high
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def copy_tokenizer(writer, donor_path):
    import gguf

    reader = gguf.GGUFReader(donor_path)
    for name, field in reader.fields.items():
        if not name.startswith(TOKENIZER_PREFIX):
            continue
        kind = field.types[0]
        value = field.contents()
        if kind == gguf.GGUFValueType.ARRAY:
            writer.add_array(name, value)
        elif kind == gguf.GGUFValueType.STRING:
            writer.add_string(name, value)
        elif kind == gguf.GGUFValueType.BOOL:
            writer.add_bool(name, value)
        elif kind == gguf.GGUFValueType.UINT32:
            writer.add_uint32(name, value)
        elif kind == gguf.GGUFValueType.INT32:
            writer.add_int32(name, value)
        elif kind == gguf.GGUFValueType.FLOAT32:
            writer.add_float32(name, value)
        else:
            raise SystemExit(f"{donor_path}: {name} has type {kind.name}, not copied here")


def tensors(shape, rng):
    """(name, array) in the converter's names; weights F16 N(0, 0.02), norms F32 ones."""
    w, f, hd = shape["width"], shape["ffn"], shape["head_dim"]
    q, kv = shape["heads"] * hd, shape["kv_heads"] * hd

    def weight(rows, cols):
        return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float16)

    def ones(n):
        return np.ones(n, dtype=np.float32)

    yield "token_embd.weight", weight(shape["vocab"], w)
    if not shape["tied"]:
        yield "output.weight", weight(shape["vocab"], w)
    yield "output_norm.weight", ones(w)
    if "llama3_rope" in shape:
        yield "rope_freqs.weight", llama3_rope_factors(hd, shape["rope_base"], **shape["llama3_rope"])
    for i in range(shape["layers"]):
        b = f"blk.{i}."
        yield b + "attn_norm.weight", ones(w)
        yield b + "attn_q.weight", weight(q, w)
        yield b + "attn_k.weight", weight(kv, w)
        yield b + "attn_v.weight", weight(kv, w)
        yield b + "attn_output.weight", weight(w, q)
        if shape["arch"] in ("qwen3", "gemma3"):
            yield b + "attn_q_norm.weight", ones(hd)
            yield b + "attn_k_norm.weight", ones(hd)
        yield b + "ffn_norm.weight", ones(w)
        yield b + "ffn_gate.weight", weight(f, w)
        yield b + "ffn_up.weight", weight(f, w)
        yield b + "ffn_down.weight", weight(w, f)
        if shape["arch"] == "gemma3":
            yield b + "post_attention_norm.weight", ones(w)
            yield b + "post_ffw_norm.weight", ones(w)


def write_f16(name, shape, donor, path):
    import gguf

    arch = shape["arch"]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_type("model")
    writer.add_name(f"{name} (random weights, benchmark shape)")
    writer.add_context_length(shape["context"])
    writer.add_embedding_length(shape["width"])
    writer.add_block_count(shape["layers"])
    writer.add_feed_forward_length(shape["ffn"])
    writer.add_head_count(shape["heads"])
    writer.add_head_count_kv(shape["kv_heads"])
    writer.add_rope_freq_base(shape["rope_base"])
    writer.add_layer_norm_rms_eps(shape["eps"])
    writer.add_key_length(shape["head_dim"])
    writer.add_value_length(shape["head_dim"])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    if arch == "llama":
        writer.add_vocab_size(shape["vocab"])
        writer.add_rope_dimension_count(shape["head_dim"])
    if "sliding_window" in shape:
        writer.add_sliding_window(shape["sliding_window"])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    copy_tokenizer(writer, donor)
    rng = np.random.default_rng(0)
    for tensor_name, data in tensors(shape, rng):
        writer.add_tensor(tensor_name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=HOME / "bench-models")
    ap.add_argument(
        "--only", default=",".join(n for n, s in SHAPES.items() if not s.get("on_request"))
    )
    ap.add_argument("--tokenizer", action="append", default=[], metavar="KIND=GGUF")
    ap.add_argument("--quantize", type=Path, default=QUANTIZE)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    args = ap.parse_args()
    donors = dict(t.split("=", 1) for t in args.tokenizer)
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.only.split(","):
        shape = SHAPES[name]
        out = args.out / f"{name}-q4_k_m.gguf"
        if out.exists():
            print(out)
            continue
        donor = donors.get(shape["tokenizer"])
        if donor is None:
            sys.exit(f"{name}: give --tokenizer {shape['tokenizer']}=GGUF (a file with its vocabulary)")
        f16 = args.out / f"{name}-f16.gguf"
        print(f"writing {f16}", file=sys.stderr)
        write_f16(name, shape, donor, f16)
        print(f"quantizing to {out}", file=sys.stderr)
        tmp = out.with_suffix(".tmp")
        subprocess.run(
            [str(args.quantize), str(f16), str(tmp), "Q4_K_M", str(args.threads)],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        tmp.rename(out)
        f16.unlink()
        print(out)


if __name__ == "__main__":
    main()
