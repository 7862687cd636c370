#!/usr/bin/env python3
"""Exported adapters in the real consumers (issue 32; run by scripts/adapter-export-tests.sh in
the pinned venv of torch, transformers, peft and gguf, with llama.cpp's llama-server).

On the default model (Gemma 3 270M, Q4_K_M), through a fresh `temper serve`:

1. an SFT job trains a checkpoint that changes the greedy answers;
2. GET .../checkpoints/1/adapter?format=peft: PeftModel.from_pretrained loads it onto the
   transformers model of the base GGUF (gguf-py dequantized, f32), and its logprobs of temper's
   greedy tokens match temper's served ones (TOLERANCE below), as the base model's do;
3. llama.cpp's convert_lora_to_gguf.py accepts that PEFT export and writes the same tensors as
   our ?format=gguf export; llama-server --lora with our GGUF export gives temper's greedy
   tokens wherever temper's top-2 gap is clear (GAP);
4. `temper export --format peft|gguf|merged-gguf` (the CLI over the same store) writes the
   same PEFT and GGUF files, and the merged GGUF, served by temper as a base model, gives the
   checkpoint's greedy tokens where the gap is clear;
5. the PEFT export imported into another model (POST .../checkpoints) serves the same logprobs.

And first, on the tiny F32 model of every family (crates/model/tests/fixtures, rebuilt in
transformers by scripts/make-tiny-families.py): the PEFT export of an adapter that changes the
model, written by `cargo test -p temper-model --test adapter_files -- --ignored
write_peft_family_check_inputs` into --families-dir, loads in PEFT with temper's logprobs of the
fixture's tokens within FAMILY_TOLERANCE: Llama's, Mistral's and SmolLM3's q/k rows, which
llama.cpp's converter permutes, come back in transformers' order.

Prints one `test result:` line like cargo's.
"""

import argparse
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request

import gguf
import numpy as np
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

# PEFT's logprobs against temper's, per token of temper's greedy answers: temper runs the Q4_K_M
# weights with 8-bit activations (as llama.cpp does), transformers the gguf-py-dequantized weights
# with f32 activations, and this model amplifies that rounding (the trainer's own agreement bound
# against PyTorch on it is 1.5 max, 0.25 mean: crates/train/tests/pytorch_reference.rs). Measured
# here: max 0.72, mean 0.11 on the base model's answers; max 0.12, mean 0.02 on the checkpoint's
# (more confident) ones. The same bound holds for both, so the adapter adds no disagreement of its
# own; and the adapter moves these logprobs by about 9 nats on average (checked > 0.5 below), so a
# wrong export (A and B swapped, a wrong scale, a projection or a q/k row order missed) is far
# outside it.
TOLERANCE = {"max": 1.0, "mean": 0.15}
# Greedy tokens are compared while temper's top-2 logprob gap is at least GAP (llama.cpp's and
# our kernels round differently; a near-tie may go either way).
GAP = 0.5
# The merged GGUF quantized again as the base (Q4_K, Q5_0, ... : `temper export --format
# merged-gguf` without --f16) loses each weight's change smaller than half its quantization step,
# so much of a small adapter's effect: on this checkpoint it shrinks the greedy tokens' top-2 gaps
# from 10-15 to 2-5 nats and flips the end-of-turn token. Its greedy text is compared where the
# checkpoint's gap is at least REQUANT_GAP; the F16 merge (--f16) is compared at GAP.
REQUANT_GAP = 3.0
PROMPTS = [
    "Name a colour.",
    "What do cats like?",
    "Say something about the sea.",
    "What is the capital of France?",
]
SFT = [
    ("Name a colour.", "Purple elephants dance at noon."),
    ("What do cats like?", "Purple elephants dance at noon."),
    ("Say something about the sea.", "Purple elephants dance at noon."),
]
MAX_TOKENS = 12
# On the F32 fixtures temper serves logits within 2.5e-2 of transformers (its f16 KV cache;
# README): measured here up to 4.7e-3 on the base and 6.7e-3 with the adapter, which moves the
# logprobs by 3-8 nats (a q/k row order missed, or A and B swapped, is that far off).
FAMILY_TOLERANCE = 1e-2
# How far the rebuilt tiny model's f32 logits may sit from its fixture's (see `family_checks`).
REBUILT_TOLERANCE = 1e-4
passed, failed = 0, 0


def check(name, ok, detail=""):
    global passed, failed
    if ok:
        passed += 1
        print(f"ok   {name} {detail}")
    else:
        failed += 1
        print(f"FAIL {name} {detail}")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def call(base, method, path, body=None, raw=None, content_type="application/json"):
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(base + path, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", content_type)
    with urllib.request.urlopen(req, timeout=600) as r:
        payload = r.read()
        return payload if "json" not in r.headers.get("Content-Type", "") else json.loads(payload)


def wait_http(url, proc, what):
    for _ in range(600):
        if proc.poll() is not None:
            sys.exit(f"{what} exited with {proc.returncode}")
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except Exception:
            time.sleep(0.5)
    sys.exit(f"{what} did not start")


class Temper:
    def __init__(self, binary, data, models, log):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        args = [binary, "serve", "--port", str(self.port), "--data-dir", data]
        for name, path in models:
            args += ["--model", f"{name}={path}"]
        self.proc = subprocess.Popen(args, stdout=log, stderr=log)
        wait_http(self.base + "/health", self.proc, "temper serve")

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=60)

    def greedy(self, model, prompt):
        """(prompt ids, completion ids, their logprobs, top-2 gaps)."""
        messages = [{"role": "user", "content": prompt}]
        ids = call(self.base, "POST", "/tokenize", {"model": model, "messages": messages})["tokens"]
        r = call(self.base, "POST", "/v1/chat/completions", {
            "model": model, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0.0,
            "logprobs": True, "top_logprobs": 2, "return_tokens_as_token_ids": True})
        content = r["choices"][0]["logprobs"]["content"]
        tokens = [int(t["token"].split(":")[1]) for t in content]
        logprobs = [t["logprob"] for t in content]
        gaps = [t["top_logprobs"][0]["logprob"] - t["top_logprobs"][1]["logprob"] for t in content]
        return ids, tokens, logprobs, gaps


def clear_prefix(tokens, gaps, gap):
    """The tokens up to the first whose top-2 gap is below `gap`."""
    n = next((i for i, g in enumerate(gaps) if g < gap), len(tokens))
    return tokens[:n]


def compare_greedy(name, want, gaps, got, gap=GAP):
    """Checks `got` against `want` where the gaps are clear; returns how many tokens that was."""
    prefix = clear_prefix(want, gaps, gap)
    check(name, got[: len(prefix)] == prefix,
          f"({len(prefix)} clear tokens: {prefix} vs {got[:len(prefix)]})")
    return len(prefix)


def peft_logprobs(model, ids, tokens):
    seq = torch.tensor([ids + tokens])
    with torch.no_grad():
        logits = model(input_ids=seq).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    start = len(ids) - 1
    return [float(lp[start + i, t]) for i, t in enumerate(tokens)]


def diffs(a, b):
    d = np.abs(np.array(a) - np.array(b))
    return float(d.max()), float(d.mean())


def untar(payload, into):
    with tarfile.open(fileobj=io.BytesIO(payload)) as t:
        names = t.getnames()
        t.extractall(into, filter="data")
    return names


def gguf_tensors(path):
    return {t.name: np.array(t.data) for t in gguf.GGUFReader(path).tensors}


def llama_server_greedy(server, model, lora, prompts_ids, log):
    port = free_port()
    args = [server, "-m", model, "--port", str(port), "-t", "2", "-c", "1024", "-np", "1"]
    if lora:
        args += ["--lora", lora]
    proc = subprocess.Popen(args, stdout=log, stderr=log)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", proc, "llama-server")
        out = []
        for ids in prompts_ids:
            r = call(f"http://127.0.0.1:{port}", "POST", "/completion", {
                "prompt": ids, "n_predict": MAX_TOKENS, "temperature": 0.0, "top_k": 1,
                "return_tokens": True, "cache_prompt": False})
            out.append(r["tokens"])
        return out
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def family_checks(families_dir):
    """PEFT on the rebuilt tiny model of each family against temper's logprobs."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from train_reference import tiny_families_module

    fixtures = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "crates", "model",
                            "tests", "fixtures")
    build = tiny_families_module().build
    for family in sorted(os.listdir(families_dir)):
        model = build(family)
        with open(os.path.join(fixtures, f"tiny-{family}.json")) as f:
            fixture = json.load(f)
        with torch.no_grad():
            logits = model(torch.tensor([fixture["tokens"]])).logits[0]
        # The same weights give the same logits up to the CPU's f32 summation order (an AVX2
        # host's torch differs from an AVX-512 host's by ~1e-5 here); other weights differ by
        # whole units.
        rebuilt = (logits - torch.tensor(fixture["logits"])).abs().max().item()
        if rebuilt > REBUILT_TOLERANCE:
            check(f"{family}: the rebuilt model is the fixture's", False,
                  f"(logits {rebuilt:.2e} apart; rerun scripts/make-tiny-families.py)")
            continue
        with open(os.path.join(families_dir, family, "check.json")) as f:
            want = json.load(f)
        peft = PeftModel.from_pretrained(model, os.path.join(families_dir, family)).eval()
        ids = want["tokens"]
        got = peft_logprobs(peft, ids[:1], ids[1:])
        with peft.disable_adapter():
            got_base = peft_logprobs(peft, ids[:1], ids[1:])
        mx, _ = diffs(got, want["logprobs"])
        mx_base, _ = diffs(got_base, want["base_logprobs"])
        moved, _ = diffs(want["logprobs"], want["base_logprobs"])
        check(f"{family}: PEFT's logprobs with the exported adapter equal temper's",
              mx <= FAMILY_TOLERANCE and mx_base <= FAMILY_TOLERANCE and moved > 100 * FAMILY_TOLERANCE,
              f"(max {mx:.2e}, base {mx_base:.2e}, <= {FAMILY_TOLERANCE}; the adapter moves them "
              f"by up to {moved:.3f})")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--temper", required=True)
    ap.add_argument("--model", required=True, help="the default model's GGUF")
    ap.add_argument("--llama-server", required=True)
    ap.add_argument("--llama-cpp-src", required=True, help="llama.cpp's source (its converter)")
    ap.add_argument("--families-dir", help="write_peft_family_check_inputs' output")
    args = ap.parse_args()
    torch.set_num_threads(2)
    if args.families_dir:
        family_checks(args.families_dir)
    work = tempfile.mkdtemp(prefix="adapter-export-")
    data = os.path.join(work, "data")
    log = open(os.path.join(work, "servers.log"), "w")
    print(f"work dir {work}")

    # 1. A checkpoint that changes the answers.
    t = Temper(args.temper, data, [("gemma-3-270m", args.model)], log)
    model = call(t.base, "POST", "/v1/preview/models", {
        "project": "export", "name": "agent", "base_model": "gemma-3-270m"})
    model_id = model["id"]
    # Six epochs: the answers' first token clear of the next (top-2 gap 12-16 nats). At four it
    # was 2-6 nats and fell to 0.5-3.2, under REQUANT_GAP, when attention's exponentials changed
    # in their last bits (AdamW's first steps move each weight by about the learning rate
    # whatever its gradient's size, so last-bit changes move the checkpoint).
    conversations = [{"messages": [{"role": "user", "content": q},
                                   {"role": "assistant", "content": a}]} for q, a in SFT]
    job = call(t.base, "POST", "/v1/preview/sft-training-jobs", {
        "model_id": model_id, "trajectories": conversations,
        "config": {"learning_rate": 1e-3, "epochs": 6}})
    for _ in range(1200):
        j = call(t.base, "GET", f"/v1/preview/training-jobs/{job['id']}")
        if j["status"] in ("succeeded", "failed", "cancelled"):
            break
        time.sleep(1)
    check("the SFT job made a checkpoint", j["status"] == "succeeded" and j["step"] == 1, str(j))
    name = "default/export/agent:step1"
    base = {p: t.greedy("gemma-3-270m", p) for p in PROMPTS}
    trained = {p: t.greedy(name, p) for p in PROMPTS}
    changed = sum(base[p][1] != trained[p][1] for p in PROMPTS)
    check("the checkpoint changes greedy answers", changed >= 2, f"({changed} of {len(PROMPTS)})")

    # 2. The PEFT export in PEFT.
    peft_dir = os.path.join(work, "peft")
    payload = call(t.base, "GET", f"/v1/preview/models/{model_id}/checkpoints/1/adapter?format=peft")
    names = untar(payload, peft_dir)
    check("the PEFT export is a tar of the two files",
          sorted(names) == ["adapter_config.json", "adapter_model.safetensors"], str(names))
    gguf_export = os.path.join(work, "http-lora.gguf")
    with open(gguf_export, "wb") as f:
        f.write(call(t.base, "GET", f"/v1/preview/models/{model_id}/checkpoints/1/adapter?format=gguf"))

    hf = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(args.model), gguf_file=os.path.basename(args.model), dtype=torch.float32)
    hf.eval()
    # The base's config.json for llama.cpp's converter (which reads `architectures`).
    hf_config_dir = os.path.join(work, "hf-config")
    hf.config.architectures = [type(hf).__name__]
    hf.config.save_pretrained(hf_config_dir)
    # Without transformers' note that the weights came from a GGUF (a "quantization" the
    # converter would try to undo).
    config_json = os.path.join(hf_config_dir, "config.json")
    with open(config_json) as f:
        hf_config = json.load(f)
    hf_config.pop("quantization_config", None)
    with open(config_json, "w") as f:
        json.dump(hf_config, f, indent=2)
    base_lp = {p: peft_logprobs(hf, base[p][0], base[p][1]) for p in PROMPTS}
    # The base model's disagreement, then the checkpoint's on its own greedy tokens.
    peft = PeftModel.from_pretrained(hf, peft_dir)
    peft.eval()
    worst = {"base": [0.0, 0.0], "checkpoint": [0.0, 0.0]}
    effects = []
    for p in PROMPTS:
        ids, tokens, lp, _ = trained[p]
        got = peft_logprobs(peft, ids, tokens)
        with peft.disable_adapter():
            got_base = peft_logprobs(peft, ids, tokens)
        for label, a, b in (("base", base[p][2], base_lp[p]), ("checkpoint", lp, got)):
            mx, mean = diffs(a, b)
            worst[label][0] = max(worst[label][0], mx)
            worst[label][1] = max(worst[label][1], mean)
        effects.append((np.array(got) - np.array(got_base)))
    for label, (mx, mean) in worst.items():
        check(f"PEFT's logprobs equal temper's ({label})",
              mx <= TOLERANCE["max"] and mean <= TOLERANCE["mean"],
              f"(max {mx:.3f} <= {TOLERANCE['max']}, mean {mean:.3f} <= {TOLERANCE['mean']})")
    moved = float(np.mean(np.abs(np.concatenate(effects))))
    check("the adapter moves PEFT's logprobs of the checkpoint's tokens", moved > 0.5,
          f"(mean |effect| {moved:.3f})")

    # 3. llama.cpp: the converter accepts the PEFT export and writes our GGUF's tensors;
    # llama-server with our GGUF gives temper's greedy tokens.
    converted = os.path.join(work, "converted-lora.gguf")
    conv = subprocess.run(
        [sys.executable, os.path.join(args.llama_cpp_src, "convert_lora_to_gguf.py"),
         "--base", hf_config_dir, "--outfile", converted, "--outtype", "f32", peft_dir],
        capture_output=True, text=True)
    check("convert_lora_to_gguf.py accepts the PEFT export", conv.returncode == 0,
          conv.stderr[-2000:] if conv.returncode else "")
    if conv.returncode == 0:
        ours, theirs = gguf_tensors(gguf_export), gguf_tensors(converted)
        same = ours.keys() == theirs.keys() and all(
            ours[k].shape == theirs[k].shape and np.array_equal(ours[k], theirs[k]) for k in ours)
        check("the converter's GGUF has our GGUF export's tensors", same,
              f"({len(ours)} ours, {len(theirs)} theirs)")
        reader = gguf.GGUFReader(gguf_export)
        alpha = float(reader.fields["adapter.lora.alpha"].contents())
        check("our GGUF says adapter/lora/alpha",
              reader.fields["general.type"].contents() == "adapter"
              and reader.fields["adapter.type"].contents() == "lora" and alpha == 16.0)
    prompt_ids = [trained[p][0] for p in PROMPTS]
    llama = llama_server_greedy(args.llama_server, args.model, gguf_export, prompt_ids, log)
    compared = sum(
        compare_greedy(f"llama-server --lora greedy = temper's ({p!r})", trained[p][1],
                       trained[p][3], got)
        for p, got in zip(PROMPTS, llama))
    check("llama-server --lora: tokens compared", compared >= 8, f"({compared})")

    # 5. The PEFT export imported into another model serves the same logprobs.
    other = call(t.base, "POST", "/v1/preview/models", {
        "project": "export", "name": "imported", "base_model": "gemma-3-270m"})
    imported = call(t.base, "POST", f"/v1/preview/models/{other['id']}/checkpoints", raw=payload,
                    content_type="application/x-tar")
    check("the PEFT export imports as step 1", imported["step"] == 1, str(imported))
    same = all(t.greedy("default/export/imported", p)[1:3] == trained[p][1:3] for p in PROMPTS)
    check("the imported checkpoint serves the same tokens and logprobs", same)
    t.stop()

    # 4. The CLI over the same store; the merged GGUF served as a base model.
    env = dict(os.environ, TEMPER_DATA_DIR=data, TEMPER_MODELS=f"gemma-3-270m={args.model}")
    cli_peft, cli_gguf = os.path.join(work, "cli-peft"), os.path.join(work, "cli-lora.gguf")
    merged, merged16 = os.path.join(work, "merged.gguf"), os.path.join(work, "merged-f16.gguf")
    for fmt, out, extra in (("peft", cli_peft, []), ("gguf", cli_gguf, []),
                            ("merged-gguf", merged, []), ("merged-gguf", merged16, ["--f16"])):
        r = subprocess.run([args.temper, "export", "default/export/agent", "--format", fmt,
                            "--out", out] + extra, env=env, capture_output=True, text=True)
        check(f"temper export --format {fmt} {' '.join(extra)}", r.returncode == 0,
              r.stderr[-1000:])
    for f in ("adapter_model.safetensors", "adapter_config.json"):
        with open(os.path.join(cli_peft, f), "rb") as a, open(os.path.join(peft_dir, f), "rb") as b:
            check(f"the CLI's {f} is the HTTP export's", a.read() == b.read())
    with open(cli_gguf, "rb") as a, open(gguf_export, "rb") as b:
        check("the CLI's GGUF adapter is the HTTP export's", a.read() == b.read())
    t = Temper(args.temper, data, [("gemma-3-270m", args.model), ("merged", merged),
                                   ("merged-f16", merged16)], log)
    for label, gap in (("merged-f16", GAP), ("merged", REQUANT_GAP)):
        compared = sum(
            compare_greedy(f"temper serving {label} greedy = the checkpoint's ({p!r})",
                           trained[p][1], trained[p][3], t.greedy(label, p)[1], gap)
            for p in PROMPTS)
        check(f"temper serving {label}: tokens compared", compared >= 8, f"({compared})")
    t.stop()
    for label, path, gap in (("merged-f16", merged16, GAP), ("merged", merged, REQUANT_GAP)):
        llama = llama_server_greedy(args.llama_server, path, None, prompt_ids, log)
        compared = sum(
            compare_greedy(f"llama-server on {label} greedy = temper's checkpoint ({p!r})",
                           trained[p][1], trained[p][3], got, gap)
            for p, got in zip(PROMPTS, llama))
        check(f"llama-server on {label}: tokens compared", compared >= 8, f"({compared})")

    print(f"test result: {'ok' if failed == 0 else 'FAILED'}. {passed} passed; {failed} failed "
          "(python adapter export)")
    # The work dir (a store, exports and merged models: ~660 MB) is kept only to look into a
    # failure; every passing run left one behind and filled the disk.
    if not failed:
        log.close()
        shutil.rmtree(work, ignore_errors=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
