#!/usr/bin/env python3
"""Writes the tiny random Llama, Qwen2 and Qwen3 fixtures of crates/model/tests/families.rs.

Per family: a small random model from transformers' own config and model classes, saved with
save_pretrained, converted to GGUF (F32) by llama.cpp's convert_hf_to_gguf.py, and the logits of
transformers' f32 forward (eager attention) on fixed token ids. Only the converter's vocabulary
step is replaced: a random model has no tokenizer, and the converter refuses to write a file
without one; every tensor name, tensor permutation (Llama's q/k rows for ggml's interleaved
rope) and hyper-parameter key is the converter's own.

Weights are drawn wider than transformers' init (std 0.02 would leave attention uniform and
logits flat), and the norms and biases, which transformers initialises to ones and zeros, are
drawn too, so every part of the forward weighs in the logits.

    ~/.cache/temper/train-ref-venv/bin/python scripts/make-tiny-families.py \\
        [--llama-cpp DIR] [--out crates/model/tests/fixtures]
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

HOME = Path.home() / ".cache/temper"
LLAMA_CPP = HOME / "llama.cpp-0.3.36/src/llama_cpp_python-0.3.36/vendor/llama.cpp"
REPO = Path(__file__).resolve().parent.parent

# Fixed ids (vocabulary 128): 24 positions, past Llama 3's original context of 16 below, so
# the smoothed low frequencies matter.
TOKENS = [(i * 37 + 11) % 128 for i in range(24)]

COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def families():
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    return {
        # Interleaved rope (the converter permutes q/k), grouped-query attention, Llama 3's
        # rope scaling (the rope_freqs tensor), a separate output head.
        "llama": LlamaConfig(
            **COMMON,
            head_dim=16,
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
            **COMMON,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            rope_parameters=dict(rope_type="linear", rope_theta=1000000.0, factor=2.0),
        ),
        # q/k norms, a head size apart from hidden / heads (4 x 32 = 128 > 64), a tied head,
        # YaRN (factor 4 from 64 positions: pairs 0-4 on its ramp, the others scaled).
        "qwen3": Qwen3Config(
            **COMMON,
            head_dim=32,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=10000.0,
                factor=4.0,
                original_max_position_embeddings=64,
            ),
        ),
    }


def randomize(model, seed):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * noise)
            elif name.endswith(".bias"):
                p.copy_(0.5 * noise)
            elif "embed_tokens" in name or "lm_head" in name:
                p.copy_(0.5 * noise)
            else:
                p.copy_(noise / p.shape[-1] ** 0.5)


def build(family):
    """The f32 transformers model (eager attention) of `family`: the same weights on every run,
    those the fixture's GGUF was converted from (scripts/train_reference.py --family rebuilds it
    here for the PEFT reference of the trainer)."""
    from transformers import AutoModelForCausalLM

    configs = families()
    seed = list(configs).index(family)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(
        configs[family], dtype=torch.float32, attn_implementation="eager"
    ).eval()
    randomize(model, 1000 + seed)
    return model


def tiny_vocab(self):
    """The converter's vocabulary step for a model without a tokenizer: placeholder pieces."""
    import gguf

    n = self.hparams["vocab_size"]
    self.gguf_writer.add_tokenizer_model("gpt2")
    self.gguf_writer.add_tokenizer_pre("default")
    self.gguf_writer.add_token_list([f"<t{i}>" for i in range(n)])
    self.gguf_writer.add_token_types([gguf.TokenType.NORMAL] * n)
    self.gguf_writer.add_token_merges([])


def convert(hf_dir, out_file):
    sys.path.insert(0, str(LLAMA_CPP))
    sys.path.insert(0, str(LLAMA_CPP / "gguf-py"))
    import convert_hf_to_gguf as conv

    get_class = conv.get_model_class

    def patched(*args, **kwargs):
        cls = get_class(*args, **kwargs)
        cls.set_vocab = tiny_vocab
        return cls

    conv.get_model_class = patched
    argv = sys.argv
    sys.argv = ["convert_hf_to_gguf.py", str(hf_dir), "--outfile", str(out_file), "--outtype", "f32"]
    try:
        conv.main()
    finally:
        sys.argv = argv


def main():
    global LLAMA_CPP
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-cpp", type=Path, default=LLAMA_CPP)
    ap.add_argument("--out", type=Path, default=REPO / "crates/model/tests/fixtures")
    args = ap.parse_args()
    LLAMA_CPP = args.llama_cpp

    for family in families():
        model = build(family)
        with tempfile.TemporaryDirectory() as tmp:
            model.save_pretrained(tmp)
            convert(tmp, args.out / f"tiny-{family}.gguf")
        with torch.no_grad():
            logits = model(torch.tensor([TOKENS])).logits[0].float()
        ref = {"tokens": TOKENS, "logits": logits.tolist()}
        (args.out / f"tiny-{family}.json").write_text(json.dumps(ref) + "\n")
        print(f"{family}: logits spread {logits.std().item():.3f}")


if __name__ == "__main__":
    main()
