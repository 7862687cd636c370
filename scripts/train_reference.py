#!/usr/bin/env python3
"""PyTorch + PEFT reference for temper's trainer (issues 13 and 28; docs/benchmarks.md).

Loads the GGUF into transformers (dequantized to f32), wraps it with a PEFT LoRA of temper's
rank, alpha and targets (read from the adapter file temper wrote), then:

- check: on temper's agreement batch (`batch.json`, `adapter.safetensors`, `temper.safetensors`
  written by `cargo test -p temper-train --test pytorch_reference -- --ignored write_check_inputs`),
  computes the per-token logprobs, training.md's loss and every LoRA gradient with the f32
  reference (`f32+sdpa`: f32 weights and activations, transformers' default SDPA attention, a full
  [tokens x vocabulary] f32 log-softmax, as before issue 28), prints how far temper's are from
  them and, with --write-fixture, writes the fixture the Rust test compares against (always from
  that f32 reference). Then computes the same values with every other reference variant (below)
  and gates it: a variant is correct when it is as close to the f32 reference as temper's own
  values must be (`agrees_with_the_pytorch_reference`'s bounds, GATE below);
- bench: one whole training step of each SEQUENCESxTOKENS shape with every variant, as a job
  takes it: forward, backward, gradient clipping to norm 0.1 and torch.optim.AdamW over the LoRA
  parameters (temper's betas, eps and weight decay), step and zero_grad, all inside the timed
  region, as `temper bench --train-shapes` times temper's `train_forward` + `backward` +
  `apply_gradients`. Best of --repeat, with seconds, trainable tok/s and peak RSS, next to
  temper's figures; per shape the ratio against the fastest correct variant that makes sense on
  this host, and the `train-compare:` summary line naming it. The two sides take turns shape by
  shape: temper's steps of a shape (`temper bench` run for that shape alone, from --temper),
  then each variant's, then the next shape, so that a host whose speed drifts over minutes
  moves both sides of a ratio alike.

Reference variants (--variants; names are PRECISION[+chunked]+ATTENTION):
  PRECISION  f32: the f32 model as loaded, no autocast. bf16-autocast: the forward inside
             torch.autocast("cpu", dtype=torch.bfloat16) (oneDNN runs the matmuls in BF16, with
             AVX-512 BF16 / AMX where the CPU has them; weights stay f32, LoRA gradients f32),
             the backward outside it, logits upcast to f32 before the log-softmax.
  +chunked   the logprobs of the target tokens without a [tokens x vocabulary] logits tensor:
             ChunkedTokenLogprobs computes the LM head CHUNK_ROWS rows at a time from the final
             hidden states (logits, logsumexp in f32, the target's logit), keeps only each row's
             logsumexp, and its backward recomputes each chunk's logits (a custom autograd
             function, as fused linear + cross-entropy kernels do).
  ATTENTION  sdpa (torch's scaled_dot_product_attention, transformers' default) or eager.
  auto (the default) is f32+sdpa, f32+eager, f32+chunked+sdpa, bf16-autocast+sdpa,
  bf16-autocast+eager and bf16-autocast+chunked+sdpa where the CPU has avx512_bf16 or amx_bf16;
  elsewhere BF16 is emulated (slow, not what an expert would run), so auto keeps the f32 ones and
  bf16-autocast+chunked+sdpa alone, to show what emulation costs, and no bf16 variant can be the
  one temper is compared against. f32+sdpa, the reference of the check, always runs.

Run by scripts/bench-train-compare.sh inside its venv.
"""

import argparse
import contextlib
import ctypes
import gc
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass

import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

# temper's LoRA targets (LoraTarget::ALL) and the matching module of a transformers layer.
TARGETS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Printed for the host, with every amx* flag it has ("amx no" when none).
CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16")
# Layers whose gradients go into the committed fixture (well under 2 MB): the first, the first
# global, a middle local one and the last; the check here compares every layer.
FIXTURE_LAYERS = (0, 5, 7, 17)
GIB = float(1 << 30)
# temper's optimizer (crates/train/src/trainer.rs: BETAS, WEIGHT_DECAY, ADAM_EPS, MAX_GRAD_NORM;
# the learning rate is training.md's default, crates/train/src/request.rs).
BETAS = (0.9, 0.99)
WEIGHT_DECAY = 0.1
ADAM_EPS = 1e-8
MAX_GRAD_NORM = 0.1
LEARNING_RATE = 5e-6
# Rows of the LM head computed at once by the chunked variants: 128 x 262k f32 logits = 134 MB.
CHUNK_ROWS = 128
# A variant is correct when its values on the check batch are as close to the f32 reference's
# as temper's own must be (crates/train/tests/pytorch_reference.rs,
# agrees_with_the_pytorch_reference): bounds above the rounding noise of 8-bit (or bf16)
# activations, which this model amplifies (docs/benchmarks.md), and far below what a wrong
# backward gives (a minimum cosine of 0.66 there).
GATE = {
    "max |logprob diff|": ("max_lp_diff", "<", 1.5),
    "mean |logprob diff|": ("mean_lp_diff", "<", 0.25),
    "relative loss diff": ("loss_rel", "<", 0.1),
    "min gradient cosine": ("min_cosine", ">", 0.9),
    "mean gradient cosine": ("mean_cosine", ">", 0.97),
    "max |norm ratio - 1|": ("worst_norm", "<", 0.3),
}


def host_cpu():
    """(model name, {flag: present}) of this host: CPU_FLAGS and every amx* flag."""
    name, flags = "unknown", set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key.strip() == "model name" and name == "unknown":
                name = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    shown = {flag: flag in flags for flag in CPU_FLAGS}
    amx = sorted(flag for flag in flags if flag.startswith("amx"))
    shown.update({flag: True for flag in amx} if amx else {"amx": False})
    return name, shown


def return_freed_memory():
    # glibc's malloc_trim: the heap's free pages back to the system, so a variant's peak RSS
    # (from its step's start) holds none of what the shapes and variants before it freed and the
    # allocator kept (as temper's bench does before each shape).
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def reset_peak_rss():
    # Linux: writing 5 resets VmHWM to the current RSS (as temper's bench does per step).
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_rss_bytes():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def peft_name(layer, target, matrix):
    module = TARGETS[target]
    return f"base_model.model.model.layers.{layer}.{module}.lora_{matrix.upper()}.default.weight"


def temper_name(layer, target, matrix):
    # LoraAdapter::save's names.
    return f"blk.{layer}.{target}.lora_{matrix}"


def load_model(gguf, rank, alpha):
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gguf), gguf_file=os.path.basename(gguf), dtype=torch.float32
    )
    cfg = model.config
    if cfg.model_type == "gemma3_text":
        # temper's Gemma 3 arithmetic (crates/model/src/config.rs): local layers' RoPE base 1e4,
        # global 1e6, a 512-token window, every sixth layer global, 1/sqrt(head_dim) attention
        # scale, no logit soft-capping.
        rope = cfg.rope_parameters
        assert rope["sliding_attention"]["rope_theta"] == 10_000.0, rope
        assert rope["full_attention"]["rope_theta"] == 1_000_000.0, rope
        assert cfg.sliding_window == 512, cfg.sliding_window
        assert cfg.layer_types[5] == "full_attention" and cfg.layer_types[4] == "sliding_attention"
        assert cfg.query_pre_attn_scalar == cfg.head_dim
        assert cfg.final_logit_softcapping is None and cfg.attn_logit_softcapping is None
    else:
        # Qwen3 (the bench model of its shape): every layer global, no soft-capping; the check
        # batch gates the rest.
        assert cfg.model_type == "qwen3", f"no reference set up for {cfg.model_type}"
        assert not getattr(cfg, "use_sliding_window", False), cfg
    lora = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        lora_dropout=0.0,
        target_modules=[m.split(".")[1] for m in TARGETS.values()],
        bias="none",
    )
    return get_peft_model(model, lora)


def read_adapter(path):
    """(tensors, rank, alpha) of a temper adapter file."""
    tensors = load_file(path)
    alpha = float(tensors.pop("lora_alpha")[0])
    rank = tensors[temper_name(0, "attn_q", "a")].shape[0]
    return tensors, rank, alpha


class RowOrder:
    """Where the GGUF's rows of a projection sit in the transformers model's: llama.cpp's
    converter permutes the rows of Llama's q and k weights for ggml's interleaved rope, so
    temper's B of those projections (`[out, rank]`, in the GGUF's row order) is transformers' B
    with its rows permuted the same way, and so is its gradient. `perms[(layer, target)]`:
    GGUF row i is transformers' row perms[...][i]; absent: the same order."""

    def __init__(self, perms=None):
        self.perms = perms or {}

    def to_peft(self, layer, target, matrix, tensor):
        perm = self.perms.get((layer, target))
        if perm is None or matrix != "b":
            return tensor
        out = torch.empty_like(tensor)
        out[perm] = tensor
        return out

    def to_temper(self, layer, target, matrix, tensor):
        perm = self.perms.get((layer, target))
        if perm is None or matrix != "b":
            return tensor
        return tensor[perm]


def set_adapter(model, tensors, num_layers, rows=RowOrder()):
    params = dict(model.named_parameters())
    with torch.no_grad():
        for layer in range(num_layers):
            for target in TARGETS:
                for matrix in ("a", "b"):
                    dst = params[peft_name(layer, target, matrix)]
                    src = tensors[temper_name(layer, target, matrix)]
                    assert dst.shape == src.shape, (layer, target, matrix, dst.shape, src.shape)
                    dst.copy_(rows.to_peft(layer, target, matrix, src))


def tiny_families_module():
    """scripts/make-tiny-families.py, imported (its name is not a module name)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "make-tiny-families.py")
    spec = importlib.util.spec_from_file_location("make_tiny_families", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_family(family, gguf_path, rank, alpha):
    """A tiny family's fixture (crates/model/tests/fixtures/tiny-FAMILY.gguf) in transformers:
    rebuilt by make-tiny-families.py from its seed (transformers reads neither the fixture's
    placeholder vocabulary nor Llama 3's or YaRN's rope scaling from a GGUF), checked to be the
    same weights: its logits on the fixture's tokens equal the `.json`'s to f32 rounding (within
    1e-5 of the largest: another CPU's kernels add in another order, ~1e-6 on an AVX2 host
    against fixtures made with AVX-512; other weights move them by orders more), and every
    matrix of the GGUF equals the transformers tensor llama.cpp's name map gives, up to a
    permutation of rows (recorded for the LoRA targets: see RowOrder). Returns the PEFT model
    (a LoRA of temper's targets, as load_model) and its RowOrder."""
    import gguf

    model = tiny_families_module().build(family)
    with open(os.path.splitext(gguf_path)[0] + ".json") as f:
        fixture = json.load(f)
    with torch.no_grad():
        logits = model(torch.tensor([fixture["tokens"]])).logits[0]
    expected = torch.tensor(fixture["logits"])
    worst = (logits - expected).abs().max().item()
    assert worst <= 1e-5 * expected.abs().max().item(), (
        f"{family}: the rebuilt model's logits are {worst:.3g} from the fixture's; rerun "
        "scripts/make-tiny-families.py"
    )

    reader = gguf.GGUFReader(gguf_path)
    arch = reader.fields["general.architecture"].contents()
    arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)
    layers = model.config.num_hidden_layers
    names = gguf.get_tensor_name_map(arch, layers)
    hf = {}
    for name, tensor in model.state_dict().items():
        mapped = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if mapped is not None:
            hf.setdefault(mapped, tensor)
    perms, checked = {}, 0
    for t in reader.tensors:
        data = torch.from_numpy(t.data.copy())
        if data.dim() != 2:
            continue
        assert t.name in hf, f"{family}: {t.name} has no transformers tensor"
        want = hf[t.name]
        assert data.dtype == torch.float32 and data.shape == want.shape, (t.name, data.shape)
        rows = {row.numpy().tobytes(): i for i, row in enumerate(want)}
        perm = torch.tensor([rows.get(row.numpy().tobytes(), -1) for row in data])
        assert (perm >= 0).all(), f"{family}: {t.name} is not transformers' tensor"
        checked += 1
        layer, target = (t.name.split(".") + [""])[1:3]
        if target in TARGETS and not torch.equal(perm, torch.arange(len(perm))):
            perms[(int(layer), target)] = perm
    print(
        f"{family}: rebuilt by make-tiny-families.py; logits within f32 rounding of the "
        f"fixture's (max diff {worst:.2g}), {checked} matrices equal the GGUF's ({len(perms)} "
        f"with permuted rows: "
        f"{', '.join(sorted({t for _, t in perms})) or 'none'})"
    )
    lora = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        lora_dropout=0.0,
        target_modules=[m.split(".")[1] for m in TARGETS.values()],
        bias="none",
    )
    return get_peft_model(model, lora), RowOrder(perms)


@dataclass(frozen=True)
class Variant:
    """How the reference runs a step (the module docstring's PRECISION[+chunked]+ATTENTION)."""

    precision: str
    chunked: bool
    attention: str

    @property
    def name(self):
        return f"{self.precision}{'+chunked' if self.chunked else ''}+{self.attention}"

    @property
    def bf16(self):
        return self.precision == "bf16-autocast"

    def autocast(self):
        if self.bf16:
            return torch.autocast("cpu", dtype=torch.bfloat16)
        return contextlib.nullcontext()


# The reference of the check and the fixture: f32, transformers' default attention (SDPA), full
# log-softmax, exactly as before issue 28.
REFERENCE = Variant("f32", False, "sdpa")
AUTO_NATIVE_BF16 = (
    "f32+sdpa,f32+eager,f32+chunked+sdpa,bf16-autocast+sdpa,bf16-autocast+eager,"
    "bf16-autocast+chunked+sdpa"
)
AUTO_EMULATED_BF16 = "f32+sdpa,f32+eager,f32+chunked+sdpa,bf16-autocast+chunked+sdpa"


def parse_variants(spec, native_bf16):
    """The variants of --variants (`auto` or a comma-separated list), REFERENCE first."""
    if spec == "auto":
        spec = AUTO_NATIVE_BF16 if native_bf16 else AUTO_EMULATED_BF16
    variants = [REFERENCE]
    for name in spec.split(","):
        m = re.fullmatch(r"(f32|bf16-autocast)(\+chunked)?\+(sdpa|eager)", name.strip())
        if not m:
            sys.exit(
                f"bad variant {name!r}: expected PRECISION[+chunked]+ATTENTION, PRECISION f32 or "
                "bf16-autocast, ATTENTION sdpa or eager (e.g. bf16-autocast+chunked+sdpa)"
            )
        variant = Variant(m[1], bool(m[2]), m[3])
        if variant not in variants:
            variants.append(variant)
    return variants


def use_attention(model, variant):
    causal_lm = model.base_model.model
    if causal_lm.config._attn_implementation != variant.attention:
        causal_lm.set_attn_implementation(variant.attention)


def token_logprobs(model, ids):
    """log p(ids[:, t] | ids[:, :t]) for t >= 1, over the full vocabulary: [batch, len - 1]."""
    logits = model(input_ids=ids, use_cache=False).logits[:, :-1]
    # f32 logits (a no-op for the f32 model; under autocast the LM head's are bf16), as
    # transformers' own loss upcasts them.
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)


class ChunkedTokenLogprobs(torch.autograd.Function):
    """log_softmax(hidden @ weight.T)[row, target] for every row, CHUNK_ROWS rows of logits at a
    time: the matmul in `dtype` (bf16 under autocast, as autocast's LM head), the logsumexp and
    the target's logit in f32. Keeps the hidden states and one logsumexp per row; the backward
    recomputes each chunk's logits, grad_hidden = (onehot(target) - softmax) * grad @ weight.
    The weight (the frozen, tied LM head) gets no gradient."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, dtype):
        with torch.autocast("cpu", enabled=False):
            w = weight.to(dtype)
            lse = torch.empty(len(hidden), dtype=torch.float32)
            lp = torch.empty_like(lse)
            for start in range(0, len(hidden), CHUNK_ROWS):
                rows = slice(start, start + CHUNK_ROWS)
                logits = (hidden[rows].to(dtype) @ w.T).float()
                lse[rows] = torch.logsumexp(logits, dim=-1)
                lp[rows] = logits.gather(-1, targets[rows, None]).squeeze(-1) - lse[rows]
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.dtype = dtype
        return lp

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, targets, lse = ctx.saved_tensors
        assert not ctx.needs_input_grad[1], "the LM head is frozen"
        with torch.autocast("cpu", enabled=False):
            w = weight.to(ctx.dtype)
            grad = grad.float()
            grad_hidden = torch.empty_like(hidden)
            for start in range(0, len(hidden), CHUNK_ROWS):
                rows = slice(start, start + CHUNK_ROWS)
                logits = (hidden[rows].to(ctx.dtype) @ w.T).float()
                # d lp / d logits = onehot(target) - softmax(logits), times the incoming grad.
                g = logits.sub_(lse[rows, None]).exp_().mul_(-grad[rows, None])
                g.scatter_add_(-1, targets[rows, None], grad[rows, None])
                grad_hidden[rows] = g.to(ctx.dtype) @ w
        return grad_hidden, None, None, None


def chunked_token_logprobs(model, ids):
    """token_logprobs without the [tokens x vocabulary] logits: the final (normed) hidden states
    of the transformer, then ChunkedTokenLogprobs over the LM head (Gemma 3 has no soft-capping,
    asserted in load_model)."""
    causal_lm = model.base_model.model
    hidden = causal_lm.model(input_ids=ids, use_cache=False).last_hidden_state[:, :-1]
    targets = ids[:, 1:]
    dtype = (
        torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else torch.float32
    )
    lp = ChunkedTokenLogprobs.apply(
        hidden.reshape(-1, hidden.shape[-1]),
        causal_lm.lm_head.weight,
        targets.reshape(-1),
        dtype,
    )
    return lp.view(targets.shape)


def variant_logprobs(model, ids, variant):
    """token_logprobs as `variant` computes them (its attention set by use_attention)."""
    with variant.autocast():
        if variant.chunked:
            return chunked_token_logprobs(model, ids)
        return token_logprobs(model, ids)


def cosine(a, b):
    a, b = a.double().flatten(), b.double().flatten()
    return float(a @ b / (a.norm() * b.norm()))


@dataclass
class Values:
    """Per-token logprobs, the loss and every LoRA gradient (by temper's tensor names)."""

    logprobs: torch.Tensor
    loss: float
    grads: dict


def reference_values(model, batch, variant=REFERENCE, rows=RowOrder()):
    use_attention(model, variant)
    model.zero_grad(set_to_none=True)
    # training.md's loss, not-PPO (CISPO) defaults: rho = exp(lp_new - lp_old), detached and
    # clipped to [1 - eps, 1 + eps_high]; L = -clip(rho) * A * lp_new; loss = sum(L * w) over the
    # trained tokens / (their count + 1e-6). Each segment runs alone (positions from 0).
    lo, hi = 1.0 - batch["epsilon"], 1.0 + batch["epsilon_high"]
    count = sum(len(s["tokens"]) - 1 for s in batch["segments"])
    loss = torch.zeros((), dtype=torch.float64)
    logprobs = []
    for seg in batch["segments"]:
        lp = variant_logprobs(model, torch.tensor([seg["tokens"]]), variant)[0]
        rho = torch.exp(lp.detach() - torch.tensor(seg["old_logprobs"])).clamp(lo, hi)
        loss = loss + (-rho * seg["advantage"] * lp * seg["weight"]).double().sum()
        logprobs.append(lp.detach())
    loss = loss / (count + 1e-6)
    loss.backward()
    params = dict(model.named_parameters())
    grads = {
        temper_name(layer, target, matrix): rows.to_temper(
            layer, target, matrix, params[peft_name(layer, target, matrix)].grad.detach()
        )
        for layer in range(model.config.num_hidden_layers)
        for target in TARGETS
        for matrix in ("a", "b")
    }
    model.zero_grad(set_to_none=True)
    return Values(torch.cat(logprobs), float(loss.detach()), grads)


@dataclass
class Agreement:
    max_lp_diff: float
    mean_lp_diff: float
    loss_rel: float
    cosines: dict
    norm_ratios: dict

    @property
    def min_cosine(self):
        return min(self.cosines.values())

    @property
    def mean_cosine(self):
        return sum(self.cosines.values()) / len(self.cosines)

    @property
    def worst_norm(self):
        return max(abs(r - 1.0) for r in self.norm_ratios.values())

    def failures(self):
        """The GATE bounds these figures break (none: correct)."""
        broken = []
        for label, (field, op, bound) in GATE.items():
            value = getattr(self, field)
            if not (value < bound if op == "<" else value > bound):
                broken.append(f"{label} {value:.3g}")
        return broken

    def line(self, precise=False):
        worst = min(self.cosines, key=self.cosines.get)
        if precise:
            # The tiny f32 families: differences in exponent form, 1 - cosine.
            return (
                f"max |logprob diff| {self.max_lp_diff:.2e} nats (mean {self.mean_lp_diff:.2e}), "
                f"relative loss diff {self.loss_rel:.2e}, gradient 1 - cosine max "
                f"{1 - self.cosines[worst]:.2e} ({worst}) mean {1 - self.mean_cosine:.2e}, "
                f"|norm ratio - 1| max {self.worst_norm:.2e}"
            )
        return (
            f"max |logprob diff| {self.max_lp_diff:.3f} nats (mean {self.mean_lp_diff:.3f}), "
            f"relative loss diff {self.loss_rel:.1e}, gradient cosine min "
            f"{self.cosines[worst]:.4f} ({worst}) mean "
            f"{sum(self.cosines.values()) / len(self.cosines):.4f}, norm ratio "
            f"{min(self.norm_ratios.values()):.3f}-{max(self.norm_ratios.values()):.3f}"
        )


def agreement(values, reference):
    """How far `values` are from `reference`'s."""
    lp_diff = (values.logprobs - reference.logprobs).abs()
    return Agreement(
        float(lp_diff.max()),
        float(lp_diff.mean()),
        abs(values.loss - reference.loss) / abs(reference.loss),
        {n: cosine(values.grads[n], g) for n, g in reference.grads.items()},
        {n: float(values.grads[n].norm() / g.norm()) for n, g in reference.grads.items()},
    )


def quantize_q8_0(x):
    """temper's (ggml's) Q8_0 activation rounding, blocks of 32 with an f16 scale."""
    blocks = x.reshape(-1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    scale = (amax / 127).half().float()
    inverse = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return (torch.round(blocks * inverse) * scale).reshape(x.shape)


def quantize_q8_k(x):
    """temper's (ggml's) Q8_K activation rounding, blocks of 256 scaled by the signed maximum."""
    blocks = x.reshape(-1, 256)
    signed_max = blocks.gather(-1, blocks.abs().argmax(-1, keepdim=True))
    inverse = -127.0 / signed_max
    return (torch.round(blocks * inverse).clamp(max=127) / inverse).reshape(x.shape)


def quantize_activations(model):
    """Rounds the input of every frozen matmul as temper's kernels do (Q8_K before the Q4_K/Q6_K
    o and down projections, Q8_0 before the rest and the LM head), straight-through in the
    backward as temper's; returns the hooks' handles."""

    def hook(quantize):
        def pre(_module, args):
            x = args[0]
            return (x + (quantize(x.detach()) - x.detach()),)

        return pre

    handles = [model.base_model.model.lm_head.register_forward_pre_hook(hook(quantize_q8_0))]
    for name, module in model.named_modules():
        if name.endswith(".base_layer"):
            k_quant = name.split(".")[-2] in ("o_proj", "down_proj")
            handles.append(
                module.register_forward_pre_hook(hook(quantize_q8_k if k_quant else quantize_q8_0))
            )
    return handles


def check(model, inputs_dir, fixture, family=None, rows=RowOrder()):
    """The agreement figures of issue 13 item 2; returns (their summary line, the batch, the f32
    reference's values, temper's agreement with them). `family`: a tiny family's fixture (issue
    30; load_family, `rows` its RowOrder), whose f32 weights temper multiplies without rounding
    the activations: no rounding yardstick, and the fixture keeps every layer's gradients in
    f32."""
    with open(os.path.join(inputs_dir, "batch.json")) as f:
        batch_text = f.read()
    batch = json.loads(batch_text)
    temper_file = load_file(os.path.join(inputs_dir, "temper.safetensors"))
    temper = Values(
        temper_file.pop("logprobs"), float(temper_file.pop("loss")[0]), temper_file
    )
    reference = reference_values(model, batch, rows=rows)
    ours = agreement(temper, reference)
    count = len(reference.logprobs)
    if family:
        print(
            f"{family} check batch: {len(batch['segments'])} segments, {count} trained tokens; "
            f"loss reference ({REFERENCE.name}) {reference.loss:.8f}, temper {temper.loss:.8f}"
        )
        print(f"{family}: temper vs reference: {ours.line(precise=True)}")
    else:
        rounded = rounded_reference(model, batch)
        print(
            f"check batch: {len(batch['segments'])} segments, {count} trained tokens; "
            f"loss reference ({REFERENCE.name}) {reference.loss:.6f}, temper {temper.loss:.6f}"
        )
        print(f"temper vs reference: {ours.line()}")
        print(
            "reference with temper's activation rounding vs reference: "
            f"{agreement(rounded, reference).line()}"
        )
        # The cosine of every gradient tensor with the reference's, a line per layer.
        print("  gradient cosine per tensor (lora_a/lora_b): " + ", ".join(TARGETS))
        for layer in range(model.config.num_hidden_layers):
            print(
                f"  layer {layer:2}: "
                + "  ".join(
                    "/".join(f"{ours.cosines[temper_name(layer, t, m)]:.3f}" for m in ("a", "b"))
                    for t in TARGETS
                )
            )

    if fixture:
        tensors = {
            "logprobs": reference.logprobs.float(),
            "loss": torch.tensor([reference.loss], dtype=torch.float32),
        }
        layers = range(model.config.num_hidden_layers) if family else FIXTURE_LAYERS
        for layer in layers:
            for target in TARGETS:
                for matrix in ("a", "b"):
                    name = temper_name(layer, target, matrix)
                    # bf16 keeps f32's range (single gradient entries are ~1e-7) with ~3
                    # digits, far below the disagreement the default model's test allows; the
                    # tiny families' tests hold temper to far more digits.
                    dtype = torch.float32 if family else torch.bfloat16
                    tensors[name] = reference.grads[name].to(dtype).contiguous()
        weights = (
            f"tiny {family} rebuilt by scripts/make-tiny-families.py"
            if family
            else "GGUF dequantized to f32"
        )
        save_file(
            tensors,
            fixture,
            metadata={
                # Verbatim: the test compares it with the batch it builds.
                "batch": batch_text,
                "made_by": f"scripts/train_reference.py: torch {torch.__version__}, "
                + f"transformers {sys.modules['transformers'].__version__}, "
                + f"peft {sys.modules['peft'].__version__}; {weights}",
            },
        )
        print(f"wrote {fixture} ({os.path.getsize(fixture) / 1e6:.2f} MB)")
    return f"agreement with the reference: {ours.line()}", batch, reference, ours


def rounded_reference(model, batch):
    """The yardstick: how far the reference itself moves when its activations are rounded as
    temper's (f32 weights otherwise): forward noise that a correct backward carries too."""
    handles = quantize_activations(model)
    rounded = reference_values(model, batch)
    for handle in handles:
        handle.remove()
    return rounded


@dataclass
class Gate:
    agreement: Agreement
    # The GATE bounds it breaks; empty: correct.
    failures: list
    # False for bf16 variants where the CPU has no BF16 instructions (emulated; no expert's
    # choice there): never the variant temper is compared against.
    sensible: bool

    @property
    def eligible(self):
        return not self.failures and self.sensible


def gate_variants(model, batch, reference, temper, variants, native_bf16):
    """Each variant's values on the check batch against the f32 reference's; prints a table with
    temper's own row for scale and returns {variant: Gate}."""
    bounds = ", ".join(f"{label} {op} {bound:g}" for label, (_, op, bound) in GATE.items())
    print()
    print(
        f"reference variants on the check batch against the f32 reference ({REFERENCE.name}); "
        f"correct = within the bounds temper's own values are held to "
        f"(crates/train/tests/pytorch_reference.rs): {bounds}"
    )
    print(
        "| variant | max / mean abs logprob diff | relative loss diff | gradient cosine min "
        "(tensor) / mean | norm ratio | correct | comparable |"
    )
    print("|---|---|---|---|---|---|---|")

    def row(name, a, verdict, comparable):
        worst = min(a.cosines, key=a.cosines.get)
        print(
            f"| {name} | {a.max_lp_diff:.3g} / {a.mean_lp_diff:.3g} | {a.loss_rel:.2g} | "
            f"{a.min_cosine:.5f} ({worst}) / {a.mean_cosine:.5f} | "
            f"{min(a.norm_ratios.values()):.3f}-{max(a.norm_ratios.values()):.3f} | {verdict} | "
            f"{comparable} |"
        )

    gates = {}
    for variant in variants:
        values = reference if variant == REFERENCE else reference_values(model, batch, variant)
        a = agreement(values, reference)
        gate = Gate(a, a.failures(), native_bf16 or not variant.bf16)
        gates[variant] = gate
        verdict = "yes" if not gate.failures else "NO: " + ", ".join(gate.failures)
        if variant == REFERENCE:
            verdict = "yes (the reference)"
        comparable = "yes" if gate.sensible else "no: BF16 emulated on this CPU"
        row(f"PyTorch {variant.name}", a, verdict, comparable)
    broken = temper.failures()
    row("temper", temper, "yes" if not broken else "NO: " + ", ".join(broken), "-")
    return gates


@dataclass
class Step:
    seconds: float
    # Of `seconds`: the forward (logprobs and loss) and the optimizer (clipping and AdamW).
    forward: float
    optimizer: float
    # CPU time of the process over the step (all threads): what the step costs when other work
    # shares the cores and the wall time stretches.
    cpu_seconds: float
    trainable: int
    peak_rss: int

    @property
    def tok_s(self):
        return self.trainable / self.seconds


def reference_step(model, ids, variant, optimizer, params):
    """One whole step as temper's bench takes it: every token but each sequence's first scored,
    loss = -mean logprob (training.md's loss with rho = 1, A = 1, w = 1), forward + backward,
    then temper's clipping (global norm 0.1) and AdamW step and zero_grad."""
    reset_peak_rss()
    started, cpu_started = time.perf_counter(), time.process_time()
    lp = variant_logprobs(model, ids, variant)
    loss = -lp.sum() / lp.numel()
    forward_done = time.perf_counter()
    loss.backward()
    backward_done = time.perf_counter()
    torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    done = time.perf_counter()
    return Step(
        done - started,
        forward_done - started,
        done - backward_done,
        time.process_time() - cpu_started,
        lp.numel(),
        peak_rss_bytes(),
    )


def parse_shape(shape):
    m = re.fullmatch(r"(\d+)x(\d+)", shape)
    if not m:
        sys.exit(f"bad shape {shape!r}: expected SEQUENCESxTOKENS, e.g. 8x128")
    return int(m[1]), int(m[2])


def parse_temper_bench(output):
    """{shape: Step} from the trainer rows of `temper bench`'s table."""
    row = re.compile(
        r"trainer step \(forward \+ backward \+ AdamW\), (\d+x\d+) tokens packed \((\d+) "
        r"trainable\): ([\d.]+) s \(forward ([\d.]+) s, AdamW ([\d.]+) s; ([\d.]+) CPU-s\), "
        r"peak RSS ([\d.]+) GiB"
    )
    steps = {}
    for line in output.splitlines():
        m = row.search(line)
        if m:
            steps[m[1]] = Step(
                float(m[3]),
                float(m[4]),
                float(m[5]),
                float(m[6]),
                int(m[2]),
                int(float(m[7]) * GIB),
            )
    return steps


def temper_step(temper, gguf, shape, repeat, threads):
    """Temper's best step of `shape`: `temper bench --train-only` for that shape alone (its
    table echoed to stderr), in a process of its own while this one waits."""
    command = [temper, "bench", "--model", gguf, "--train-only", "--train-shapes", shape]
    command += ["--train-jobs", "", "--repeat", str(repeat)]
    env = dict(os.environ, RAYON_NUM_THREADS=str(threads))
    run = subprocess.run(command, env=env, stdout=subprocess.PIPE, text=True)
    print(run.stdout, end="", file=sys.stderr)
    if run.returncode != 0:
        sys.exit(f"{' '.join(command)} failed (exit {run.returncode})")
    step = parse_temper_bench(run.stdout).get(shape)
    if step is None:
        sys.exit(f"temper's bench output has no trainer row for {shape}")
    return step


def bench(model, adapter, shapes, repeat, temper, token_ids, variants):
    """[(shape, temper's Step, {variant: best Step})]; per shape temper's steps (`temper(shape)`)
    and then every variant's, each variant from the check's adapter with a fresh AdamW (load
    that drifts on a shared host hits the steps of a shape alike)."""
    params = [p for p in model.parameters() if p.requires_grad]
    rows = []
    for shape in shapes:
        seqs, length = parse_shape(shape)
        # Every sequence the same tokens, as temper packs `seqs` copies of one prompt; the cost
        # does not depend on which tokens. A batch of separate sequences is the reference's
        # natural packing (no cross-sequence attention, as temper's segments).
        unit = (token_ids * (length // len(token_ids) + 1))[:length]
        ids = torch.tensor([unit] * seqs)
        ours = temper(shape)
        steps = {}
        for variant in variants:
            set_adapter(model, adapter, model.config.num_hidden_layers)
            use_attention(model, variant)
            return_freed_memory()
            optimizer = torch.optim.AdamW(
                params, lr=LEARNING_RATE, betas=BETAS, eps=ADAM_EPS, weight_decay=WEIGHT_DECAY
            )
            best = min(
                (reference_step(model, ids, variant, optimizer, params) for _ in range(repeat)),
                key=lambda s: s.seconds,
            )
            del optimizer
            if ours.trainable != best.trainable:
                sys.exit(
                    f"{shape}: temper trained {ours.trainable} tokens, the reference "
                    f"{best.trainable}"
                )
            steps[variant] = best
            print(
                f"  {shape} {variant.name}: {best.seconds:.2f} s, peak RSS "
                f"{best.peak_rss / GIB:.2f} GiB",
                file=sys.stderr,
            )
        rows.append((shape, ours, steps))
    return rows


def fastest(steps, gates):
    """The fastest variant of `steps` that is correct and makes sense on this host."""
    eligible = [v for v in steps if gates[v].eligible]
    return min(eligible, key=lambda v: steps[v].seconds)


def print_tables(rows, gates):
    print()
    print(
        "| shape | trainable tokens | trainer | s/step (forward / AdamW; CPU-s) | trainable tok/s "
        "| temper tok/s / this | peak RSS | RSS temper / this |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for shape, ours, steps in rows:
        best = fastest(steps, gates)
        for name, step in [("temper", ours)] + [(v, s) for v, s in steps.items()]:
            if name == "temper":
                label, ratio, rss = "temper", "-", "-"
            else:
                notes = []
                if name == best:
                    notes.append("fastest correct")
                if gates[name].failures:
                    notes.append("incorrect")
                if not gates[name].sensible:
                    notes.append("BF16 emulated")
                label = f"PyTorch {name.name}" + (f" ({', '.join(notes)})" if notes else "")
                ratio = f"{ours.tok_s / step.tok_s:.2f}x"
                rss = f"{ours.peak_rss / step.peak_rss:.2f}x"
            print(
                f"| {shape} | {step.trainable} | {label} | {step.seconds:.2f} "
                f"({step.forward:.2f} / {step.optimizer:.3f}; {step.cpu_seconds:.1f}) | "
                f"{step.tok_s:.0f} | {ratio} | {step.peak_rss / GIB:.2f} GiB | {rss} |"
            )
    print()
    print(
        f"| shape | temper s/step | fastest correct PyTorch variant | its s/step | temper / it "
        f"(tok/s) | peak RSS temper / it | temper / {REFERENCE.name} (tok/s) | peak RSS temper / "
        f"{REFERENCE.name} |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for shape, ours, steps in rows:
        best = fastest(steps, gates)
        it, f32 = steps[best], steps[REFERENCE]
        print(
            f"| {shape} | {ours.seconds:.2f} | {best.name} | {it.seconds:.2f} | "
            f"{ours.tok_s / it.tok_s:.2f}x | {ours.peak_rss / GIB:.2f} / {it.peak_rss / GIB:.2f} "
            f"GiB = {ours.peak_rss / it.peak_rss:.2f}x | {ours.tok_s / f32.tok_s:.2f}x | "
            f"{ours.peak_rss / GIB:.2f} / {f32.peak_rss / GIB:.2f} GiB = "
            f"{ours.peak_rss / f32.peak_rss:.2f}x |"
        )


def summary_line(rows, gates):
    """`train-compare: temper vs PyTorch V (fastest correct): Rx at SHAPE, ...; rss Rx; vs
    f32+sdpa: SHAPE=Rx ... rss=Rx`: temper's trainable tok/s over the reference's per shape, rss
    the largest peak of temper's steps over the largest of the compared variant's."""
    best = {shape: fastest(steps, gates) for shape, _, steps in rows}
    temper_rss = max(ours.peak_rss for _, ours, _ in rows)
    names = {v.name for v in best.values()}
    if len(names) == 1:
        against = f"PyTorch {names.pop()} (fastest correct)"
        ratios = ", ".join(
            f"{ours.tok_s / steps[best[shape]].tok_s:.2f}x at {shape}"
            for shape, ours, steps in rows
        )
    else:
        against = "PyTorch's fastest correct variant per shape"
        ratios = ", ".join(
            f"{ours.tok_s / steps[best[shape]].tok_s:.2f}x at {shape} ({best[shape].name})"
            for shape, ours, steps in rows
        )
    best_rss = max(steps[best[shape]].peak_rss for shape, _, steps in rows)
    f32 = " ".join(
        f"{shape}={ours.tok_s / steps[REFERENCE].tok_s:.2f}x" for shape, ours, steps in rows
    )
    f32_rss = max(steps[REFERENCE].peak_rss for _, _, steps in rows)
    return (
        f"train-compare: temper vs {against}: {ratios}; rss {temper_rss / best_rss:.2f}x; "
        f"vs {REFERENCE.name}: {f32} rss={temper_rss / f32_rss:.2f}x"
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", required=True)
    ap.add_argument(
        "--family",
        help="the GGUF is this tiny family's fixture (make-tiny-families.py): rebuild it in "
        "transformers and run the check alone",
    )
    ap.add_argument("--check-dir", required=True, help="where temper wrote the check batch")
    ap.add_argument("--write-fixture", metavar="PATH", help="write the Rust test's fixture here")
    ap.add_argument(
        "--temper",
        metavar="BINARY",
        help="the temper binary whose trainer steps to time beside the reference's, shape by shape",
    )
    ap.add_argument("--shapes", default="8x128,1x1024,16x30")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--isa",
        choices=("native", "avx2"),
        default="native",
        help="avx2: as on a host with AVX2 alone (bench-train-compare --isa avx2 also limits "
        "torch and oneDNN to AVX2 through ATEN_CPU_CAPABILITY and ONEDNN_MAX_CPU_ISA): the "
        "AVX-512 and AMX flags count as absent, so BF16 is emulated and auto keeps the f32 "
        "variants",
    )
    ap.add_argument(
        "--variants",
        default="auto",
        help="reference variants, comma-separated PRECISION[+chunked]+ATTENTION, or auto "
        "(see the module docstring); f32+sdpa always runs",
    )
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    name, flags = host_cpu()
    if args.isa == "avx2":
        flags = {k: v and not k.startswith(("avx512", "amx")) for k, v in flags.items()}
        name += " (limited to AVX2)"
    native_bf16 = flags.get("avx512_bf16", False) or flags.get("amx_bf16", False)
    print(
        f"host: {name}; "
        + ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in flags.items())
        + f"; torch CPU capability {torch.backends.cpu.get_cpu_capability()}, BF16 "
        + (
            "native (avx512_bf16/amx_bf16)"
            if native_bf16
            else "emulated (no avx512_bf16 or amx_bf16)"
        )
    )
    variants = parse_variants(args.variants, native_bf16)
    print(
        f"reference: torch {torch.__version__}, transformers "
        f"{sys.modules['transformers'].__version__}, peft {sys.modules['peft'].__version__}, "
        f"{torch.get_num_threads()} threads; variants: {', '.join(v.name for v in variants)}"
    )
    adapter, rank, alpha = read_adapter(os.path.join(args.check_dir, "adapter.safetensors"))
    if args.family:
        model, rows = load_family(args.family, args.gguf, rank, alpha)
        set_adapter(model, adapter, model.config.num_hidden_layers, rows)
        check(model, args.check_dir, args.write_fixture, args.family, rows)
        return
    started = time.perf_counter()
    model = load_model(args.gguf, rank, alpha)
    print(
        f"loaded {args.gguf} (dequantized to f32) with a LoRA of rank {rank}, alpha {alpha:g} on "
        f"{'/'.join(TARGETS)} in {time.perf_counter() - started:.1f} s; default attention: "
        f"{model.config._attn_implementation}"
    )
    set_adapter(model, adapter, model.config.num_hidden_layers)
    summary, batch, reference, temper = check(model, args.check_dir, args.write_fixture)
    gates = gate_variants(model, batch, reference, temper, variants, native_bf16)
    if not args.temper:
        return
    with open(os.path.join(args.check_dir, "batch.json")) as f:
        token_ids = json.load(f)["segments"][0]["tokens"]
    rows = bench(
        model,
        adapter,
        args.shapes.split(","),
        max(args.repeat, 1),
        lambda shape: temper_step(args.temper, args.gguf, shape, max(args.repeat, 1), args.threads),
        token_ids,
        variants,
    )
    print()
    print(
        f"one step = forward + backward + gradient clipping and AdamW on both sides (PyTorch: "
        f"torch.optim.AdamW over the LoRA parameters, step and zero_grad; temper: the trainer's "
        f"apply_gradients), best of {args.repeat}, shape by shape (temper's steps, then each "
        f"variant's); peak RSS = the process's VmHWM from the step's "
        "start (the summary's rss: the largest of each side's shapes); comparable = correct on "
        "the check batch and not BF16 emulated"
    )
    print_tables(rows, gates)
    print(summary)
    print(summary_line(rows, gates))


if __name__ == "__main__":
    main()
