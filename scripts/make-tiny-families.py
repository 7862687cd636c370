#!/usr/bin/env python3
"""Writes the tiny random model fixtures of crates/model/tests/families.rs.

Per family (Llama, Qwen2, Qwen3, Gemma 3, Mistral, SmolLM3): a small random model from transformers' own
config and model classes, saved with save_pretrained, converted to GGUF by llama.cpp's
convert_hf_to_gguf.py (F32, and with --outtype f16 and q8_0), and the logits of transformers'
f32 forward (eager attention) on fixed token ids. Only the converter's vocabulary step is
replaced: a random model has no tokenizer, and the converter refuses to write a file without
one; every tensor name, tensor permutation (Llama's q/k rows for ggml's interleaved rope) and
hyper-parameter key is the converter's own.

Per family also a wider one-layer model (width 256: llama.cpp's K-quants pack 256 columns per
block, narrower rows fall back to other types), converted to F32 and quantized by llama.cpp's
llama-quantize to Q4_K_M, Q5_K_M and Q4_0; only the quantized files are kept.

For every quantized or half-precision file, its weights dequantized by gguf-py
(`gguf.quants.dequantize`) are loaded back into the transformers model (the matrices only: the
norms and biases stay F32 in every file), which gives the logits of the dequantized model on the
same ids and a greedy continuation with the gap between its two best logits at each step.

Weights are drawn wider than transformers' init (std 0.02 would leave attention uniform and
logits flat), and the norms and biases, which transformers initialises to ones and zeros, are
drawn too, so every part of the forward weighs in the logits.

    ~/.cache/temper/train-ref-venv/bin/python scripts/make-tiny-families.py \\
        [--llama-cpp DIR] [--quantize BIN] [--out crates/model/tests/fixtures] [--family NAME]...
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

HOME = Path.home() / ".cache/temper"
LLAMA_CPP = HOME / "llama.cpp-0.3.36/src/llama_cpp_python-0.3.36/vendor/llama.cpp"
QUANTIZE = HOME / "llama.cpp-0.3.36/build/bin/llama-quantize"
REPO = Path(__file__).resolve().parent.parent

# Fixed ids (vocabulary 128): 24 positions, past Llama 3's original context of 16 below, so
# the smoothed low frequencies matter, and three times Gemma 3's sliding window of 8.
TOKENS = [(i * 37 + 11) % 128 for i in range(24)]
# The greedy continuations: from the first 8 ids, 16 steps.
PROMPT = TOKENS[:8]
STEPS = 16

SMALL = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
# One layer, every matrix 256 columns wide (attention 4 x 64, one key/value head).
WIDE = dict(
    vocab_size=128,
    hidden_size=256,
    intermediate_size=256,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=1,
    max_position_embeddings=256,
)
# The converter's own types for the small models; llama-quantize's for the wide ones.
SMALL_TYPES = ["f16", "q8_0"]
WIDE_TYPES = ["q4_k_m", "q5_k_m", "q4_0"]


def families(common, head_dim):
    from transformers import (
        Gemma3TextConfig,
        LlamaConfig,
        MistralConfig,
        Qwen2Config,
        Qwen3Config,
        SmolLM3Config,
    )

    # Head sizes apart from hidden / heads where the family allows it.
    wide = common["hidden_size"] > 64
    return {
        # Interleaved rope (the converter permutes q/k), grouped-query attention, Llama 3's
        # rope scaling (the rope_freqs tensor), a separate output head.
        "llama": LlamaConfig(
            **common,
            head_dim=head_dim,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=10000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=16,
            ),
        ),
        # q/k/v biases, linear rope scaling, a tied head.
        "qwen2": Qwen2Config(
            **common,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            rope_parameters=dict(rope_type="linear", rope_theta=1000000.0, factor=2.0),
        ),
        # q/k norms, a head size apart from hidden / heads (4 x 32 = 128 > 64), a tied head,
        # YaRN (factor 4 from 64 positions: pairs 0-4 on its ramp, the others scaled).
        "qwen3": Qwen3Config(
            **common,
            head_dim=head_dim if wide else 32,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=10000.0,
                factor=4.0,
                original_max_position_embeddings=64,
            ),
        ),
        # Sliding-window layers (window 8 < 24 ids) and every sixth layer global: the converter
        # writes no pattern, llama.cpp (and temper) take Gemma 3's 6, so the small model has 6
        # layers (5 local, 1 global; the wide one's single layer is local). Local layers' rope
        # base 10k unscaled, the global one's 1M with linear scaling (as Gemma 3 4B+). q/k norms,
        # the post-attention and post-MLP norms, norms stored minus one (the converter adds it
        # back), GELU (tanh), embeddings scaled by sqrt(width), a tied head.
        # `query_pre_attn_scalar` is the head size: llama.cpp's GGUF has no key for it and
        # scales by 1/sqrt(head size) on every Gemma 3 but the 27B (`hparams.f_attention_scale`).
        "gemma3": Gemma3TextConfig(
            # (MLP 64 wide in the small model, which has three times the others' layers.)
            **{**common, "num_hidden_layers": 1, "intermediate_size": 256}
            if wide
            else {**common, "num_hidden_layers": 6, "intermediate_size": 64},
            head_dim=head_dim,
            query_pre_attn_scalar=head_dim,
            sliding_window=8,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            rope_parameters={
                "sliding_attention": dict(rope_type="default", rope_theta=10000.0),
                "full_attention": dict(rope_type="linear", rope_theta=1000000.0, factor=8.0),
            },
        ),
        # Mistral converts as the `llama` architecture. Its sliding window (4096 in Mistral 7B
        # v0.1, none in later versions) is not written by the converter for `llama`, and
        # llama.cpp's llama graph has no window: at 24 ids it does not matter. Rope base 1M, no
        # scaling, 4 query heads per key/value head, a separate output head.
        "mistral": MistralConfig(
            **{**common, "num_key_value_heads": 1},
            head_dim=head_dim,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            sliding_window=4096,
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
        ),
        # Llama with no rope on every fourth layer (transformers' `no_rope_layer_interval` 4,
        # which llama.cpp hard-codes: the converter writes no key for it), so the small model has
        # 4 layers, the last without rope (the wide one's single layer has rope). The converter
        # permutes q/k as Llama's (interleaved rope); a tied head, rope base 5M as SmolLM3-3B's.
        "smollm3": SmolLM3Config(
            **{**common, "num_hidden_layers": 1 if wide else 4},
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            no_rope_layer_interval=4,
            # (Its default pad, bos and eos ids are the real vocabulary's.)
            pad_token_id=None,
            bos_token_id=None,
            eos_token_id=None,
            rope_parameters=dict(rope_type="default", rope_theta=5000000.0),
        ),
    }


def randomize(model, seed):
    gen = torch.Generator().manual_seed(seed)
    # Embedding rows of squared norm 16 at every width (a tied head's logit of the input token
    # is that norm: wider, it would leave the wide models repeating their input).
    embed_std = 0.5 * (64 / model.config.hidden_size) ** 0.5
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("norm.weight"):
                # Gemma's norms multiply by 1 + weight: the same spread about one.
                shift = 0.0 if "Gemma" in type(model).__name__ else 1.0
                p.copy_(shift + 0.2 * noise)
            elif name.endswith(".bias"):
                p.copy_(0.5 * noise)
            elif "embed_tokens" in name or "lm_head" in name:
                p.copy_(embed_std * noise)
            else:
                p.copy_(noise / p.shape[-1] ** 0.5)


def tiny_vocab(self):
    """The converter's vocabulary step for a model without a tokenizer: placeholder pieces."""
    import gguf

    n = self.hparams["vocab_size"]
    self.gguf_writer.add_tokenizer_model("gpt2")
    self.gguf_writer.add_tokenizer_pre("default")
    self.gguf_writer.add_token_list([f"<t{i}>" for i in range(n)])
    self.gguf_writer.add_token_types([gguf.TokenType.NORMAL] * n)
    self.gguf_writer.add_token_merges([])


def patch_converter():
    sys.path.insert(0, str(LLAMA_CPP))
    sys.path.insert(0, str(LLAMA_CPP / "gguf-py"))
    import convert_hf_to_gguf as conv

    get_class = conv.get_model_class

    def patched(*args, **kwargs):
        cls = get_class(*args, **kwargs)
        cls.set_vocab = tiny_vocab
        return cls

    conv.get_model_class = patched
    return conv


def convert(conv, hf_dir, out_file, outtype):
    # Gemma 3's converter cuts the embedding to the tokenizer's size: a placeholder
    # tokenizer.json of the full vocabulary keeps every row.
    n = json.loads((Path(hf_dir) / "config.json").read_text())["vocab_size"]
    vocab = {f"<t{i}>": i for i in range(n)}
    (Path(hf_dir) / "tokenizer.json").write_text(
        json.dumps({"model": {"vocab": vocab}, "added_tokens": []})
    )
    argv = sys.argv
    sys.argv = ["convert_hf_to_gguf.py", str(hf_dir), "--outfile", str(out_file), "--outtype", outtype]
    try:
        conv.main()
    finally:
        sys.argv = argv


HF_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def unpermute(w, n_head):
    """The inverse of the converter's LlamaModel.permute (q/k rows for interleaved rope)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_matrices(path, config, llama_layout):
    """The file's matrices dequantized by gguf-py, under their transformers names."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    out = {}
    for t in GGUFReader(path).tensors:
        if len(t.shape) != 2:
            continue
        shape = [int(d) for d in reversed(t.shape)]
        w = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape))
        if t.name == "token_embd.weight":
            out["model.embed_tokens.weight"] = w
            continue
        if t.name == "output.weight":
            out["lm_head.weight"] = w
            continue
        _, bid, kind, _ = t.name.split(".")
        if llama_layout and kind == "attn_q":
            w = unpermute(w, config.num_attention_heads)
        if llama_layout and kind == "attn_k":
            w = unpermute(w, config.num_key_value_heads)
        out[f"model.layers.{bid}.{HF_NAMES[kind]}.weight"] = w
    return out


def load_matrices(model, path, llama_layout):
    state = model.state_dict()
    got = gguf_matrices(path, model.config, llama_layout)
    tied = model.config.tie_word_embeddings
    want = {n for n, p in state.items() if p.dim() == 2 and not (tied and n == "lm_head.weight")}
    assert set(got) == want, (set(got) ^ want)
    model.load_state_dict(got, strict=False)
    if tied:
        model.tie_weights()


def logits_of(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def greedy(model):
    ids, gaps = list(PROMPT), []
    for _ in range(STEPS):
        row = logits_of(model, ids)[-1]
        top = torch.topk(row, 2)
        gaps.append(round((top.values[0] - top.values[1]).item(), 5))
        ids.append(int(top.indices[0]))
    return ids[len(PROMPT):], gaps


def rounded(logits):
    """To 1e-4: far below every bound the tests state on these logits."""
    return [[round(x, 4) for x in row] for row in logits.tolist()]


def variant_reference(model, path, llama_layout, original):
    """Transformers on the dequantized weights of `path`, then the original weights back."""
    load_matrices(model, path, llama_layout)
    logits = logits_of(model, TOKENS)
    ids, gaps = greedy(model)
    model.load_state_dict(original)
    return {
        "prompt": PROMPT,
        "greedy": ids,
        "gaps": gaps,
        "logits": rounded(logits),
    }


def build(family, small=True):
    """The f32 transformers model (eager attention) of `family`: the same weights on every run,
    those its fixture was converted from (scripts/train_reference.py --family rebuilds the small
    ones here for the PEFT reference of the trainer). The seed is the family's position in
    `families`, plus 100 for the wide models: add a family at the end."""
    from transformers import AutoModelForCausalLM

    configs = families(SMALL, 16) if small else families(WIDE, 64)
    seed = list(configs).index(family) + (0 if small else 100)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(
        configs[family], dtype=torch.float32, attn_implementation="eager"
    ).eval()
    randomize(model, 1000 + seed)
    return model


def make(conv, family, out, stem, small):
    model = build(family, small)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    llama_layout = family in ("llama", "mistral", "smollm3")
    logits = logits_of(model, TOKENS)
    # The small models' F32 logits bit for bit (the F32 file is compared at 1e-4 in logprobs).
    ref = {"tokens": TOKENS, "logits": logits.tolist() if small else rounded(logits), "variants": {}}
    with tempfile.TemporaryDirectory() as tmp:
        # The directory's name is the file's general.name.
        tmp = Path(tmp) / stem
        model.save_pretrained(tmp)
        f32 = Path(tmp) / "f32.gguf"
        convert(conv, tmp, f32 if not small else out / f"{stem}.gguf", "f32")
        if small:
            f32 = out / f"{stem}.gguf"
        # The mapping back is exact on the F32 file.
        load_matrices(model, f32, llama_layout)
        for n, p in model.state_dict().items():
            assert torch.equal(p, original[n]), n
        files = {}
        if small:
            for t in SMALL_TYPES:
                files[t] = out / f"{stem}-{t}.gguf"
                convert(conv, tmp, files[t], t)
        else:
            for t in WIDE_TYPES:
                files[t] = out / f"{stem}-{t}.gguf"
                subprocess.run(
                    [str(QUANTIZE), str(f32), str(files[t]), t.upper()],
                    check=True,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
        for t, path in files.items():
            ref["variants"][t] = variant_reference(model, path, llama_layout, original)
    (out / f"{stem}.json").write_text(json.dumps(ref) + "\n")
    print(f"{stem}: logits spread {logits.std().item():.3f}")
    for t, v in ref["variants"].items():
        d = (torch.tensor(v["logits"]) - logits).abs().max().item()
        print(f"  {t}: dequantized vs original max |diff| {d:.4f}, greedy {v['greedy']} gaps {v['gaps']}")


def main():
    global LLAMA_CPP, QUANTIZE
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-cpp", type=Path, default=LLAMA_CPP)
    ap.add_argument("--quantize", type=Path, default=QUANTIZE)
    ap.add_argument("--out", type=Path, default=REPO / "crates/model/tests/fixtures")
    ap.add_argument(
        "--family",
        action="append",
        help="only this family (repeatable; default every one): the others' files stay as they are",
    )
    args = ap.parse_args()
    LLAMA_CPP, QUANTIZE = args.llama_cpp, args.quantize
    conv = patch_converter()

    chosen = args.family or list(families(SMALL, 16))
    for family in chosen:
        make(conv, family, args.out, f"tiny-{family}", small=True)
    for family in chosen:
        make(conv, family, args.out, f"tiny-{family}-wide", small=False)


if __name__ == "__main__":
    main()
