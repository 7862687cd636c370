#!/usr/bin/env python3
"""PyTorch + PEFT reference for temper's trainer (issue 13; README, Benchmarks).

Loads the GGUF into transformers (dequantized to f32), wraps it with a PEFT LoRA of temper's
rank, alpha and targets (read from the adapter file temper wrote), then:

- check: on temper's agreement batch (`batch.json`, `adapter.safetensors`, `temper.safetensors`
  written by `cargo test -p temper-train --test pytorch_reference -- --ignored write_check_inputs`),
  computes the per-token logprobs, training.md's loss and every LoRA gradient, prints how far
  temper's are from them and, with --write-fixture, writes the fixture the Rust test compares
  against;
- bench: one step (forward + backward, no optimizer, as `temper bench --train-shapes`) of each
  SEQUENCESxTOKENS shape, best of --repeat, with seconds, trainable tok/s and peak RSS, next to
  temper's figures parsed from its bench output, and the `train-compare:` summary line.

Run by scripts/bench-train-compare.sh inside its venv.
"""

import argparse
import json
import os
import re
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
CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16")
# Layers whose gradients go into the committed fixture (well under 2 MB): the first, the first
# global, a middle local one and the last; the check here compares every layer.
FIXTURE_LAYERS = (0, 5, 7, 17)
GIB = float(1 << 30)


def host_cpu():
    """(model name, {flag: present}) of this host."""
    name, flags = "unknown", set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key.strip() == "model name" and name == "unknown":
                name = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    return name, {flag: flag in flags for flag in CPU_FLAGS}


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
    # temper's Gemma 3 arithmetic (crates/model/src/config.rs): local layers' RoPE base 1e4,
    # global 1e6, a 512-token window, every sixth layer global, 1/sqrt(head_dim) attention scale,
    # no logit soft-capping.
    rope = cfg.rope_parameters
    assert rope["sliding_attention"]["rope_theta"] == 10_000.0, rope
    assert rope["full_attention"]["rope_theta"] == 1_000_000.0, rope
    assert cfg.sliding_window == 512, cfg.sliding_window
    assert cfg.layer_types[5] == "full_attention" and cfg.layer_types[4] == "sliding_attention"
    assert cfg.query_pre_attn_scalar == cfg.head_dim
    assert cfg.final_logit_softcapping is None and cfg.attn_logit_softcapping is None
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


def set_adapter(model, tensors, num_layers):
    params = dict(model.named_parameters())
    with torch.no_grad():
        for layer in range(num_layers):
            for target in TARGETS:
                for matrix in ("a", "b"):
                    dst = params[peft_name(layer, target, matrix)]
                    src = tensors[temper_name(layer, target, matrix)]
                    assert dst.shape == src.shape, (layer, target, matrix, dst.shape, src.shape)
                    dst.copy_(src)


def token_logprobs(model, ids):
    """log p(ids[:, t] | ids[:, :t]) for t >= 1, over the full vocabulary: [batch, len - 1]."""
    logits = model(input_ids=ids, use_cache=False).logits[:, :-1]
    return torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def cosine(a, b):
    a, b = a.double().flatten(), b.double().flatten()
    return float(a @ b / (a.norm() * b.norm()))


@dataclass
class Values:
    """Per-token logprobs, the loss and every LoRA gradient (by temper's tensor names)."""

    logprobs: torch.Tensor
    loss: float
    grads: dict


def reference_values(model, batch):
    model.zero_grad(set_to_none=True)
    # training.md's loss, not-PPO (CISPO) defaults: rho = exp(lp_new - lp_old), detached and
    # clipped to [1 - eps, 1 + eps_high]; L = -clip(rho) * A * lp_new; loss = sum(L * w) over the
    # trained tokens / (their count + 1e-6). Each segment runs alone (positions from 0).
    lo, hi = 1.0 - batch["epsilon"], 1.0 + batch["epsilon_high"]
    count = sum(len(s["tokens"]) - 1 for s in batch["segments"])
    loss = torch.zeros((), dtype=torch.float64)
    logprobs = []
    for seg in batch["segments"]:
        lp = token_logprobs(model, torch.tensor([seg["tokens"]]))[0]
        rho = torch.exp(lp.detach() - torch.tensor(seg["old_logprobs"])).clamp(lo, hi)
        loss = loss + (-rho * seg["advantage"] * lp * seg["weight"]).double().sum()
        logprobs.append(lp.detach())
    loss = loss / (count + 1e-6)
    loss.backward()
    params = dict(model.named_parameters())
    grads = {
        temper_name(layer, target, matrix): params[peft_name(layer, target, matrix)].grad.detach()
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

    def line(self):
        worst = min(self.cosines, key=self.cosines.get)
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


def check(model, inputs_dir, fixture):
    """The agreement figures of issue 13 item 2; returns their summary line."""
    with open(os.path.join(inputs_dir, "batch.json")) as f:
        batch_text = f.read()
    batch = json.loads(batch_text)
    temper_file = load_file(os.path.join(inputs_dir, "temper.safetensors"))
    temper = Values(
        temper_file.pop("logprobs"), float(temper_file.pop("loss")[0]), temper_file
    )
    reference = reference_values(model, batch)
    # The yardstick: how far the reference itself moves when its activations are rounded as
    # temper's (f32 weights otherwise): forward noise that a correct backward carries too.
    handles = quantize_activations(model)
    rounded = reference_values(model, batch)
    for handle in handles:
        handle.remove()

    ours = agreement(temper, reference)
    count = len(reference.logprobs)
    print(
        f"check batch: {len(batch['segments'])} segments, {count} trained tokens; "
        f"loss reference {reference.loss:.6f}, temper {temper.loss:.6f}"
    )
    print(f"temper vs reference: {ours.line()}")
    print(f"reference with temper's activation rounding vs reference: {agreement(rounded, reference).line()}")
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
        for layer in FIXTURE_LAYERS:
            for target in TARGETS:
                for matrix in ("a", "b"):
                    name = temper_name(layer, target, matrix)
                    # bf16 keeps f32's range (single gradient entries are ~1e-7) with ~3
                    # digits, far below the disagreement the test allows.
                    tensors[name] = reference.grads[name].to(torch.bfloat16).contiguous()
        save_file(
            tensors,
            fixture,
            metadata={
                # Verbatim: the test compares it with the batch it builds.
                "batch": batch_text,
                "made_by": f"scripts/train_reference.py: torch {torch.__version__}, "
                + f"transformers {sys.modules['transformers'].__version__}, "
                + f"peft {sys.modules['peft'].__version__}; GGUF dequantized to f32",
            },
        )
        print(f"wrote {fixture} ({os.path.getsize(fixture) / 1e6:.2f} MB)")
    return f"agreement with the reference: {ours.line()}"


@dataclass
class Step:
    seconds: float
    # CPU time of the process over the step (all threads): what the step costs when other work
    # shares the cores and the wall time stretches.
    cpu_seconds: float
    trainable: int
    peak_rss: int

    @property
    def tok_s(self):
        return self.trainable / self.seconds


def reference_step(model, ids):
    """One step as temper's bench takes it: every token but each sequence's first scored,
    loss = -mean logprob (training.md's loss with rho = 1, A = 1, w = 1), forward + backward."""
    model.zero_grad(set_to_none=True)
    reset_peak_rss()
    started, cpu_started = time.perf_counter(), time.process_time()
    lp = token_logprobs(model, ids)
    loss = -lp.sum() / lp.numel()
    loss.backward()
    seconds = time.perf_counter() - started
    return Step(seconds, time.process_time() - cpu_started, lp.numel(), peak_rss_bytes())


def parse_shape(shape):
    m = re.fullmatch(r"(\d+)x(\d+)", shape)
    if not m:
        sys.exit(f"bad shape {shape!r}: expected SEQUENCESxTOKENS, e.g. 8x128")
    return int(m[1]), int(m[2])


def parse_temper_bench(path):
    """{shape: Step} from the trainer rows of `temper bench`'s table."""
    row = re.compile(
        r"trainer step \(forward \+ backward\), (\d+x\d+) tokens packed \((\d+) trainable\): "
        r"([\d.]+) s \(forward [\d.]+ s; ([\d.]+) CPU-s\), peak RSS ([\d.]+) GiB"
    )
    steps = {}
    with open(path) as f:
        for line in f:
            m = row.search(line)
            if m:
                steps[m[1]] = Step(float(m[3]), float(m[4]), int(m[2]), int(float(m[5]) * GIB))
    return steps


def bench(model, shapes, repeat, temper_steps, token_ids):
    rows = []
    for shape in shapes:
        seqs, length = parse_shape(shape)
        # Every sequence the same tokens, as temper packs `seqs` copies of one prompt; the cost
        # does not depend on which tokens. A batch of separate sequences is the reference's
        # natural packing (no cross-sequence attention, as temper's segments).
        unit = (token_ids * (length // len(token_ids) + 1))[:length]
        ids = torch.tensor([unit] * seqs)
        best = min((reference_step(model, ids) for _ in range(repeat)), key=lambda s: s.seconds)
        ours = temper_steps.get(shape)
        if ours is None:
            sys.exit(f"temper's bench output has no trainer row for {shape}")
        if ours.trainable != best.trainable:
            sys.exit(f"{shape}: temper trained {ours.trainable} tokens, the reference {best.trainable}")
        rows.append((shape, ours, best))
    return rows


def print_table(rows):
    print()
    print(
        "| shape | trainable tokens | temper s/step (CPU-s) | reference s/step (CPU-s) | "
        "temper tok/s | reference tok/s | tok/s temper / reference | temper peak RSS | "
        "reference peak RSS | RSS temper / reference |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for shape, ours, ref in rows:
        print(
            f"| {shape} | {ours.trainable} | {ours.seconds:.2f} ({ours.cpu_seconds:.1f}) | "
            f"{ref.seconds:.2f} ({ref.cpu_seconds:.1f}) | "
            f"{ours.tok_s:.0f} | {ref.tok_s:.0f} | {ours.tok_s / ref.tok_s:.2f}x | "
            f"{ours.peak_rss / GIB:.2f} GiB | {ref.peak_rss / GIB:.2f} GiB | "
            f"{ours.peak_rss / ref.peak_rss:.2f}x |"
        )


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--check-dir", required=True, help="where temper wrote the check batch")
    ap.add_argument("--write-fixture", metavar="PATH", help="write the Rust test's fixture here")
    ap.add_argument("--temper-bench", metavar="FILE", help="temper bench's output to compare with")
    ap.add_argument("--shapes", default="8x128,1x1024,16x30")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    name, flags = host_cpu()
    print(f"host: {name}; " + ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in flags.items()))
    print(
        f"reference: torch {torch.__version__}, transformers "
        f"{sys.modules['transformers'].__version__}, peft {sys.modules['peft'].__version__}, "
        f"f32, {torch.get_num_threads()} threads"
    )
    adapter, rank, alpha = read_adapter(os.path.join(args.check_dir, "adapter.safetensors"))
    started = time.perf_counter()
    model = load_model(args.gguf, rank, alpha)
    print(
        f"loaded {args.gguf} with a LoRA of rank {rank}, alpha {alpha:g} on "
        f"{'/'.join(TARGETS)} in {time.perf_counter() - started:.1f} s; attention: "
        f"{model.config._attn_implementation}"
    )
    set_adapter(model, adapter, model.config.num_hidden_layers)
    summary = check(model, args.check_dir, args.write_fixture)
    if not args.temper_bench:
        return
    with open(os.path.join(args.check_dir, "batch.json")) as f:
        token_ids = json.load(f)["segments"][0]["tokens"]
    rows = bench(
        model,
        args.shapes.split(","),
        max(args.repeat, 1),
        parse_temper_bench(args.temper_bench),
        token_ids,
    )
    print(
        f"one step = forward + backward (no optimizer) on both sides, best of {args.repeat}; "
        "peak RSS = the process's VmHWM from the step's start (the summary's rss: the largest "
        "of each side's shapes)"
    )
    print_table(rows)
    print(summary)
    ratio = {shape: ours.tok_s / ref.tok_s for shape, ours, ref in rows}
    rss = max(ours.peak_rss for _, ours, _ in rows) / max(ref.peak_rss for _, _, ref in rows)
    print(
        f"train-compare: 8x128={ratio.get('8x128', float('nan')):.2f}x "
        f"1x1024={ratio.get('1x1024', float('nan')):.2f}x rss={rss:.2f}x"
    )


if __name__ == "__main__":
    main()
