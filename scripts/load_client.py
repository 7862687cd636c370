#!/usr/bin/env python3
"""Streaming load client for OpenAI-compatible `/v1/chat/completions` servers (temper, and the
llama-server of llama.cpp and of ik_llama.cpp), Python standard library only. Used by
`scripts/bench-compare.sh`.

Subcommands:
  run      N concurrent clients, each sending R streaming requests back to back; prints JSON
           with per-request TTFT and output tok/s, and the aggregate output tok/s of the run.
  agent    multi-turn agent case: a long conversation sent cold (unique prefix), then its next
           turn (same prefix + the answer + a new user message); prints JSON with both TTFTs.
  table    reads the JSON results written by bench-compare.sh and prints the markdown table.
  best-np  prints the -np (and its KV size) that bench-compare.sh runs temper's equal-KV rows
           against.

`--server` is temper, llama (mainline llama-server) or ik (ik_llama.cpp's llama-server). Every
request asks for a fixed number of output tokens: `max_tokens`, `temperature: 0` and
`ignore_eos: true` (all three servers accept it); both llama-servers also get `cache_prompt:
true` (their per-slot prompt cache, the default anyway). Tokens are counted from the final usage chunk
(`stream_options.include_usage`) when the server sends one, else one per content chunk. TTFT is
the time from sending the request to the first chunk carrying generated text.
"""

import argparse
import http.client
import json
import math
import os
import statistics
import sys
import threading
import time
import urllib.parse

# Ordinary English prose the prompts are cut from (word by word, cycled, numbered per sentence so
# that long prompts are not one repeated sentence).
TEXT = (
    "The history of the city begins with a small settlement on the river, where traders met to "
    "exchange grain, salt and cloth. Over the centuries the market grew into a town with walls, a "
    "cathedral and a university, and its people learned to build ships, print books and govern "
    "themselves through elected councils. In the winter the river froze and the merchants crossed "
    "it on sledges, carrying furs from the northern forests and amber from the coast. A bridge of "
    "stone replaced the old ferry, and the toll it raised paid for a hospital, a library and the "
    "first paved streets. When the railway arrived the old walls were pulled down to make room for "
    "factories, and the population doubled within a generation."
)
WORDS = TEXT.split()

# What the echo-heavy case asks the model to repeat: a paragraph the default model does quote
# word for word (with the prose above, Gemma 3 270M writes its own story instead, so its answer
# would not be echo-heavy). `temper bench` echoes the same paragraph.
ECHO_PARAGRAPH = (
    "The committee met on Tuesday to review the budget for the coming year. After a long "
    "discussion, the members agreed to increase funding for the public library, to repair the "
    "roads on the north side of the town, and to hire two new teachers for the primary school. "
    "The proposal to build a new sports hall was postponed until the spring, when more "
    "information about the costs will be available."
)


def prose(n_words, offset=0):
    """`n_words` words of TEXT, cycled from word `offset`, with a sentence number every 40 words."""
    out = []
    for i in range(n_words):
        if i % 40 == 0:
            out.append(f"({(offset + i) // 40 + 1})")
        out.append(WORDS[(offset + i) % len(WORDS)])
    return " ".join(out)


class Client:
    def __init__(self, url, server, model, timeout):
        u = urllib.parse.urlparse(url)
        self.host = u.hostname or "127.0.0.1"
        self.port = u.port or 80
        self.server = server
        self.model = model
        self.timeout = timeout

    def body(self, messages, max_tokens):
        b = {
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.model:
            b["model"] = self.model
        if self.server in ("llama", "ik"):
            b["cache_prompt"] = True
        return b

    def chat(self, messages, max_tokens):
        """One streaming request. Returns a dict: ttft, total, tokens, prompt_tokens, text,
        decode_tok_s (output tokens after the first / time after the first)."""
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        payload = json.dumps(self.body(messages, max_tokens)).encode()
        t0 = time.perf_counter()
        try:
            conn.request(
                "POST",
                "/v1/chat/completions",
                body=payload,
                headers={"Content-Type": "application/json", "Accept": "text/event-stream"},
            )
            resp = conn.getresponse()
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:500].decode(errors='replace')}")
            # Each event line is only timestamped while the stream runs and parsed after it
            # ends: on a 2-core host the client shares the cores with the server, and parsing
            # JSON per token would take them from the server being measured.
            lines = []
            while True:
                line = resp.readline()
                if not line:
                    break
                lines.append((time.perf_counter(), line))
                if line.startswith(b"data: [DONE]"):
                    break
            first = None
            last = None
            finished = None
            chunks = 0
            usage = None
            text = []
            for now, line in lines:
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                ev = json.loads(data)
                if ev.get("error"):
                    raise RuntimeError(f"stream error: {ev['error']}")
                if ev.get("usage"):
                    usage = ev["usage"]
                for ch in ev.get("choices") or []:
                    if ch.get("finish_reason") and finished is None:
                        finished = now
                    delta = ch.get("delta") or {}
                    piece = delta.get("content") or delta.get("reasoning_content") or ""
                    if piece:
                        if first is None:
                            first = now
                        last = now
                        chunks += 1
                        text.append(piece)
            t_end = time.perf_counter()
        finally:
            conn.close()
        if first is None and finished is not None and (usage or {}).get("completion_tokens"):
            # Tokens that decode to no text by themselves (a random-weight model's byte pieces,
            # a lone special token): the answer's time is that of the chunk that ends it.
            first = last = finished
            chunks = 1
        if first is None:
            raise RuntimeError("the stream carried no generated text")
        tokens = chunks
        prompt_tokens = None
        if usage:
            tokens = usage.get("completion_tokens") or chunks
            prompt_tokens = usage.get("prompt_tokens")
        decode_time = last - first
        return {
            "ttft": first - t0,
            "total": t_end - t0,
            "tokens": tokens,
            "prompt_tokens": prompt_tokens,
            "decode_tok_s": (tokens - 1) / decode_time if tokens > 1 and decode_time > 0 else None,
            "text": "".join(text),
        }


class RssSampler:
    """Samples VmRSS of a process every `period` seconds; `peak()` also reads VmHWM."""

    def __init__(self, pid, period=0.1):
        self.pid = pid
        self.period = period
        self.max_rss_kb = 0
        self.stop_ev = threading.Event()
        self.thread = None

    def read(self):
        out = {}
        try:
            with open(f"/proc/{self.pid}/status") as f:
                for line in f:
                    if line.startswith(("VmRSS:", "VmHWM:")):
                        k, v = line.split(":", 1)
                        out[k] = int(v.split()[0])
        except OSError:
            pass
        return out

    def _loop(self):
        while not self.stop_ev.is_set():
            self.max_rss_kb = max(self.max_rss_kb, self.read().get("VmRSS", 0))
            self.stop_ev.wait(self.period)

    def start(self):
        if self.pid:
            self.thread = threading.Thread(target=self._loop, daemon=True)
            self.thread.start()
        return self

    def stop(self):
        if self.thread:
            self.stop_ev.set()
            self.thread.join()
            st = self.read()
            return {"max_vmrss_kb": self.max_rss_kb, "vmhwm_kb": st.get("VmHWM")}
        return None


def pct(values, p):
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * p / 100
    lo, hi = math.floor(k), math.ceil(k)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def user_prompt(args, client_idx, req_idx):
    if args.echo:
        return "Repeat the following paragraph word for word, with no comment:\n\n" + ECHO_PARAGRAPH
    words = prose(args.prompt_words, offset=client_idx * 7 + req_idx * 13)
    if args.unique:
        # A distinct first line, so that no prompt prefix is cached from an earlier request.
        words = f"Request {time.time_ns()}-{client_idx}-{req_idx}. " + words
    return "Continue this story:\n\n" + words


def cmd_run(args):
    client = Client(args.url, args.server, args.model, args.timeout)
    results = []
    errors = []
    lock = threading.Lock()
    barrier = threading.Barrier(args.clients)

    def worker(ci):
        barrier.wait()
        for ri in range(args.requests):
            msgs = [{"role": "user", "content": user_prompt(args, ci, ri)}]
            try:
                r = client.chat(msgs, args.max_tokens)
                r.pop("text")
                with lock:
                    results.append(r)
            except Exception as e:  # noqa: BLE001 - reported, and the run fails
                with lock:
                    errors.append(f"client {ci} request {ri}: {e}")

    rss = RssSampler(args.pid).start()
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(args.clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    mem = rss.stop()
    if errors:
        for e in errors[:5]:
            print(f"load_client: {e}", file=sys.stderr)
        sys.exit(f"load_client: {len(errors)} of {args.clients * args.requests} requests failed")
    ttfts = [r["ttft"] for r in results]
    dec = [r["decode_tok_s"] for r in results if r["decode_tok_s"]]
    total_tokens = sum(r["tokens"] for r in results)
    out = {
        "server": args.server,
        "clients": args.clients,
        "requests": len(results),
        "max_tokens": args.max_tokens,
        "prompt_tokens": results[0]["prompt_tokens"],
        "output_tokens": total_tokens,
        "wall_s": wall,
        "aggregate_tok_s": total_tokens / wall,
        "ttft_p50_s": pct(ttfts, 50),
        "ttft_p90_s": pct(ttfts, 90),
        "decode_tok_s_p50": pct(dec, 50),
        "decode_tok_s_mean": statistics.mean(dec) if dec else None,
        "memory": mem,
    }
    emit(args, out)


def cmd_agent(args):
    """Cold TTFT of a long conversation, then the TTFT of its next turn."""
    client = Client(args.url, args.server, args.model, args.timeout)
    reps = []
    for rep in range(args.reps):
        nonce = f"Session {time.time_ns()}-{rep}."
        # A conversation of several turns (the agent's history), about --context-words words.
        turns = max(1, args.turns)
        per = args.context_words // (2 * turns)
        msgs = [
            {
                "role": "system",
                "content": f"{nonce} You are a careful assistant that answers questions about "
                "a city's history from the notes in the conversation.",
            }
        ]
        for t in range(turns):
            msgs.append(
                {"role": "user", "content": f"Notes part {t + 1}:\n" + prose(per, offset=t * per)}
            )
            msgs.append(
                {"role": "assistant", "content": "Noted. " + prose(per, offset=t * per + 5)}
            )
        msgs.append({"role": "user", "content": "Summarise the notes so far in one sentence."})
        cold = client.chat(msgs, args.max_tokens)
        msgs.append({"role": "assistant", "content": cold["text"]})
        msgs.append({"role": "user", "content": "Now say what happened when the railway arrived."})
        warm = client.chat(msgs, args.max_tokens)
        reps.append(
            {
                "cold_ttft_s": cold["ttft"],
                "cold_prompt_tokens": cold["prompt_tokens"],
                "next_ttft_s": warm["ttft"],
                "next_prompt_tokens": warm["prompt_tokens"],
            }
        )
    out = {
        "server": args.server,
        "reps": reps,
        "cold_ttft_s": statistics.median(r["cold_ttft_s"] for r in reps),
        "next_ttft_s": statistics.median(r["next_ttft_s"] for r in reps),
        "cold_prompt_tokens": reps[0]["cold_prompt_tokens"],
        "next_prompt_tokens": reps[0]["next_prompt_tokens"],
    }
    emit(args, out)


def emit(args, out):
    s = json.dumps(out, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(s + "\n")
    print(s)


# ---------------------------------------------------------------------------------------------
# The comparison table.
#
# Results layout (scripts/bench-compare.sh): meta.json; per round rN/: temper-<row>.json,
# temper-kv.json, temper-pp512.json, and per anchor A (llama, ik) A-pp512.json and, for each -np
# of the sweep, A-np<NP>-<row>.json and A-np<NP>-kv.json; eqkv/: A.json ({np, kv_mib,
# kv_cache_mb}) and temper-A-c<C>-r<K>.json (temper at --kv-cache-mb = A's KV size).

ANCHOR_NAMES = {"llama": "llama.cpp", "ik": "ik_llama.cpp"}


def load(d, name):
    try:
        with open(os.path.join(d, name)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def get(d, name, *keys):
    v = load(d, name)
    for k in keys:
        if v is None:
            return None
        v = v.get(k) if isinstance(v, dict) else None
    return v


def round_dirs(d):
    """The rounds' directories, in order."""
    rs = []
    for name in os.listdir(d):
        if name.startswith("r") and name[1:].isdigit() and os.path.isdir(os.path.join(d, name)):
            rs.append((int(name[1:]), os.path.join(d, name)))
    return [p for _, p in sorted(rs)]


def anchors_of(meta):
    return [a for a in ("llama", "ik") if a in (meta.get("anchors") or {})]


def best_np(rdir, anchor, nps, src, keys, better):
    """(value, np) of the anchor's best -np in one round for one figure, or (None, None)."""
    best = (None, None)
    for np_ in nps:
        v = get(rdir, f"{anchor}-np{np_}-{src}.json", *keys)
        if v is None:
            continue
        if best[0] is None or (v > best[0] if better == "higher" else v < best[0]):
            best = (v, np_)
    return best


def agg16_np(rdir, anchor, nps):
    """The -np of the anchor's best 16-client aggregate in one round (its memory rows use it)."""
    return best_np(rdir, anchor, nps, "c16", ("aggregate_tok_s",), "higher")[1]


def stats(values):
    values = [v for v in values if v is not None]
    if not values:
        return None
    return statistics.median(values), min(values), max(values), len(values)


def cmd_best_np(args):
    """Prints `NP KV_MIB` for the anchor's equal-KV row: the -np that gave its best 16-client
    aggregate in most rounds (ties: the larger), and the KV size it logged there."""
    meta = load(args.results, "meta.json") or {}
    nps = meta.get("np") or []
    picks = [agg16_np(r, args.anchor, nps) for r in round_dirs(args.results)]
    picks = [p for p in picks if p is not None]
    if not picks:
        print("none none")
        return
    np_ = max(set(picks), key=lambda p: (picks.count(p), p))
    kv = stats([get(r, f"{args.anchor}-np{np_}-kv.json", "kv_mib")
                for r in round_dirs(args.results)])
    print(np_, "none" if kv is None else f"{kv[0]:.2f}")


class Unit:
    """Formats a figure: number text and unit, the unit picked from the median."""

    def __init__(self, kind):
        self.kind = kind

    def unit(self, med):
        if self.kind == "secs":
            return ("s", 1.0) if med >= 0.1 else ("ms", 1000.0)
        return {"tok_s": ("tok/s", 1.0), "kib": ("MiB", 1 / 1024), "mib": ("MiB", 1.0)}[self.kind]

    def num(self, v, scale):
        x = v * scale
        if self.kind == "tok_s":
            return f"{x:.1f}"
        if self.kind == "secs":
            return f"{x:.2f}" if scale == 1.0 else f"{x:.0f}"
        return f"{x:.0f}"

    def cell(self, st, setting=None):
        if st is None:
            return "-"
        med, lo, hi, n = st
        unit, scale = self.unit(med)
        s = f"{self.num(med, scale)} {unit}"
        if n > 1:
            s += f" [{self.num(lo, scale)}-{self.num(hi, scale)}]"
        if setting:
            s += f" ({setting})"
        return s


def np_setting(nps_by_round):
    nps_by_round = [n for n in nps_by_round if n is not None]
    if not nps_by_round:
        return None
    if len(set(nps_by_round)) == 1:
        return f"-np {nps_by_round[0]}"
    return "-np " + "/".join(str(n) for n in nps_by_round)


def cmd_table(args):
    d = args.results
    meta = load(d, "meta.json") or {}
    anchors = anchors_of(meta)
    rounds = round_dirs(d)
    nps = meta.get("np") or []
    mt = meta.get("max_tokens", "?")
    tok_s, secs, kib, mib = Unit("tok_s"), Unit("secs"), Unit("kib"), Unit("mib")
    rows = []  # (label, better, temper cell, [anchor cells], ratio text, ratio value or None, summary key)
    ratios_by_anchor = {}  # summary key -> {anchor: oriented ratio}

    def add(label, better, unit, t_vals, a_stats, key=None):
        """a_stats: {anchor: (stats, setting)}; the ratio is temper's median over the faster
        anchor's median (none when `better` is "-": a row shown, not compared). key: the row's
        short name when it counts in the summary."""
        t = stats(t_vals)
        cells = [unit.cell(*a_stats[a]) if a in a_stats else "-" for a in anchors]
        meds = {a: s[0][0] for a, s in a_stats.items() if s[0] is not None}
        ratio_txt, ratio = "-", None
        if t is not None and meds and better != "-":
            pick = max if better == "higher" else min
            fa = pick(meds, key=meds.get)
            ratio = t[0] / meds[fa] if meds[fa] else None
            if ratio is not None:
                ratio_txt = f"{ratio:.2f}x" + (f" vs {ANCHOR_NAMES[fa]}" if len(anchors) > 1 else "")
            if key:
                ratios_by_anchor[key] = {
                    a: (t[0] / m if better == "higher" else m / t[0])
                    for a, m in meds.items() if m and t[0]
                }
        rows.append((label, better, unit.cell(t), cells, ratio_txt, key if ratio is not None else None))

    def temper_vals(src, *keys):
        return [get(r, f"temper-{src}.json", *keys) for r in rounds]

    def anchor_best(src, keys, better):
        """Per anchor: stats of its per-round best over the sweep, and the -np that gave it."""
        out = {}
        for a in anchors:
            picks = [best_np(r, a, nps, src, keys, better) for r in rounds]
            out[a] = (stats([v for v, _ in picks]), np_setting([n for _, n in picks]))
        return out

    def anchor_at_agg16(src, keys):
        out = {}
        for a in anchors:
            picks = [(get(r, f"{a}-np{n}-{src}.json", *keys), n)
                     for r in rounds for n in [agg16_np(r, a, nps)] if n is not None]
            out[a] = (stats([v for v, _ in picks]), np_setting([n for _, n in picks]))
        return out

    def speed(label, better, unit, src, keys, key):
        add(label, better, unit, temper_vals(src, *keys), anchor_best(src, keys, better), key)

    speed(f"decode tok/s, 1 client, {mt} output tokens (per-request median)", "higher", tok_s,
          "c1", ("decode_tok_s_p50",), "decode 1c")
    for c in (8, 16, 32):
        speed(f"aggregate output tok/s, {c} clients x {mt} tokens", "higher", tok_s,
              f"c{c}", ("aggregate_tok_s",), f"agg {c}c")
    for c in (1, 8, 16):
        for p in (50, 90):
            speed(f"TTFT p{p}, {c} client{'s' if c > 1 else ''} (short prompt)", "lower", secs,
                  f"c{c}", (f"ttft_p{p}_s",), f"TTFT p{p} {c}c")
    pp_reps = meta.get("pp_reps", "N")
    add(f"prefill, 512 tokens in-process, best of {pp_reps} (llama-bench pp512 / temper bench "
        "prompt 512)", "higher", tok_s, temper_vals("pp512", "tok_s"),
        {a: (stats([get(r, f"{a}-pp512.json", "tok_s") for r in rounds]), None) for a in anchors},
        "prefill 512")

    def first(src, key):
        for r in rounds:
            for name in [f"temper-{src}.json"] + [f"{a}-np{n}-{src}.json" for a in anchors for n in nps]:
                v = get(r, name, key)
                if v:
                    return v
        return None

    pl = first("p512", "prompt_tokens")
    speed(f"TTFT of a {pl or '~512'}-token prompt over HTTP, 1 client, cold (p50)", "lower", secs,
          "p512", ("ttft_p50_s",), "TTFT 512")
    ct, nt = first("agent", "cold_prompt_tokens"), first("agent", "next_prompt_tokens")
    speed(f"agent: TTFT of a {ct or '~2k'}-token conversation, cold", "lower", secs, "agent",
          ("cold_ttft_s",), "agent cold")
    speed(f"agent: TTFT of its next turn ({nt or '?'} tokens, prefix cached)", "lower", secs,
          "agent", ("next_ttft_s",), "agent next")
    et = meta.get("echo_tokens", "?")
    echo_anchor = anchor_best("echo", ("decode_tok_s_p50",), "higher")
    speed(f"echo-heavy decode tok/s, 1 client, {et} tokens (temper: prompt lookup off)", "higher",
          tok_s, "echo", ("decode_tok_s_p50",), "echo")
    on = temper_vals("echo-spec", "decode_tok_s_p50")
    spec = meta.get("spec_flag")
    if stats(on) is None:
        add(f"echo-heavy decode tok/s, temper prompt lookup on (not in the summary): "
            f"{meta.get('spec_na') or 'n/a (no flag)'}", "higher", tok_s, [], echo_anchor)
    else:
        off = stats(temper_vals("echo", "decode_tok_s_p50"))
        onoff = f"; on/off {stats(on)[0] / off[0]:.2f}x" if off and off[0] else ""
        add(f"echo-heavy decode tok/s, temper with `{spec}` (not in the summary{onoff})", "higher",
            tok_s, on, echo_anchor)
    add("peak RSS of the server process during the 16-client run (VmHWM; anchors at the -np of "
        "their best 16-client aggregate)", "lower", kib, temper_vals("c16", "memory", "vmhwm_kb"),
        anchor_at_agg16("c16", ("memory", "vmhwm_kb")))
    add("KV cache size (temper: the --kv-cache-mb budget its blocks come from, touched only as "
        "used, so not compared: see the RSS rows and the equal-KV rows; anchors: the KV buffers "
        "they allocate at start, at that -np)", "-", mib, temper_vals("kv", "kv_mib"),
        anchor_at_agg16("kv", ("kv_mib",)))

    # Equal KV capacity: temper with --kv-cache-mb = the anchor's KV size at one -np.
    eq = os.path.join(d, "eqkv")
    for a in anchors:
        info = load(eq, f"{a}.json")
        if not info:
            continue
        n, kv, mb = info["np"], info["kv_mib"], info["kv_cache_mb"]
        k = len(rounds)
        tag = f"equal KV ({ANCHOR_NAMES[a]} -np {n}: {kv:.0f} MiB; temper --kv-cache-mb {mb})"
        for c in (16, 32):
            add(f"{tag}: aggregate output tok/s, {c} clients", "higher", tok_s,
                [get(eq, f"temper-{a}-c{c}-r{i}.json", "aggregate_tok_s") for i in range(1, k + 1)],
                {a: (stats([get(r, f"{a}-np{n}-c{c}.json", "aggregate_tok_s") for r in rounds]),
                     f"-np {n}")})
        add(f"{tag}: peak RSS through the 32-client run (VmHWM)", "lower", kib,
            [get(eq, f"temper-{a}-c32-r{i}.json", "memory", "vmhwm_kb") for i in range(1, k + 1)],
            {a: (stats([get(r, f"{a}-np{n}-c32.json", "memory", "vmhwm_kb") for r in rounds]),
                 f"-np {n}")})

    # --- header ---
    flags = meta.get("flags") or "none of avx2/avx512*/amx"
    amx_note = ""
    for a in anchors:
        if "the CPU lists AMX" in (meta["anchors"][a].get("build") or ""):
            amx_note = (f"; {ANCHOR_NAMES[a]} built without GGML_NATIVE and with AMX off (the CPU "
                        "lists AMX; its AMX kernels die with SIGILL where the VM does not grant "
                        "the AMX tile state)")
    print(f"host: {meta.get('cpu', '?')}; {meta.get('cores', '?')} cores; flags: {flags}; "
          f"ISA: {meta.get('isa', 'native')}{amx_note}")
    th = meta.get("threads", 2)
    descs = []
    for a in anchors:
        m = meta["anchors"][a]
        desc = (f"{ANCHOR_NAMES[a]} {m.get('commit', '?')} ({m.get('build', '?')}; llama-server "
                f"`{m.get('server_args', '')}`")
        if m.get("bench_args"):
            desc += f", llama-bench `{m['bench_args']}`"
        descs.append(desc + ")")
    np_txt = "{" + ", ".join(str(n) for n in nps) + "}"
    print(f"anchors: {'; '.join(descs)}; each `-t {th}`, llama-server at `-np` in {np_txt} with "
          f"`-c` = np x {meta.get('slot_ctx', '?')}, each row at the anchor's best `-np` "
          "(a/b: the best `-np` of each round, in order)")
    nr = len(rounds)
    print(f"temper {meta.get('temper_commit', '?')} (`temper serve`, RAYON_NUM_THREADS={th}); "
          f"mode: {meta.get('mode', '?')}; {nr} round{'s' if nr != 1 else ''}, the servers in "
          "alternating order (temper first in odd rounds, last in even ones); cells: median "
          "[min-max] over the rounds; one server at a time, same model, same load client")
    print()
    names = [ANCHOR_NAMES[a] for a in anchors]
    ratio_head = "temper / best anchor of the row" if len(anchors) > 1 else f"temper / {names[0]}"
    print(f"| figure | better | temper | {' | '.join(names)} | {ratio_head} |")
    print("|---|---|---|" + "---|" * len(anchors) + "---|")
    for label, better, t, cells, ratio, _key in rows:
        print(f"| {label} | {better} | {t} | {' | '.join(cells)} | {ratio} |")
    print()

    # --- summary: geometric mean of the like-for-like speed rows, > 1 = temper faster ---
    keys = [key for *_, key in rows if key and key in ratios_by_anchor]

    def gmean(vs):
        return math.exp(sum(math.log(v) for v in vs) / len(vs)) if vs else None

    best = []  # per row: the ratio against the faster anchor (the smallest oriented ratio)
    for key in keys:
        vs = ratios_by_anchor[key]
        if vs:
            best.append(min(vs.values()))
    if best:
        g = gmean(best)
        ahead = sum(1 for v in best if v > 1)
        per = []
        if len(anchors) > 1:
            for a in anchors:
                vs = [ratios_by_anchor[k][a] for k in keys if a in ratios_by_anchor[k]]
                if vs:
                    per.append(f"vs {ANCHOR_NAMES[a]} alone {gmean(vs):.2f}x over {len(vs)} rows")
        print(f"summary: temper is ahead of the faster anchor on {ahead} of {len(best)} "
              f"like-for-like speed rows; geometric mean of the ratios (> 1 = temper faster) "
              f"{g:.2f}x" + (f" ({'; '.join(per)})" if per else "") + ".")
        print(f"summary rows: {', '.join(keys)}. Not in it: the prompt-lookup row (temper "
              "speculates there, the anchors do not), the memory rows, and the equal-KV rows "
              "(the 16/32-client rows again at another temper setting).")
    else:
        print("summary: no figure was measured on temper and an anchor")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)

    def common(sp):
        sp.add_argument("--url", required=True, help="base URL, e.g. http://127.0.0.1:8000")
        sp.add_argument("--server", choices=["temper", "llama", "ik"], required=True,
                        help="which server (decides the per-server request fields)")
        sp.add_argument("--model", default=None, help="`model` field to send (default: none)")
        sp.add_argument("--max-tokens", type=int, default=128)
        sp.add_argument("--timeout", type=float, default=600)
        sp.add_argument("--out", default=None, help="also write the JSON result here")

    r = sub.add_parser("run", help="concurrent streaming clients")
    common(r)
    r.add_argument("--clients", type=int, default=1)
    r.add_argument("--requests", type=int, default=1, help="requests per client, back to back")
    r.add_argument("--prompt-words", type=int, default=24)
    r.add_argument("--unique", action="store_true", help="a distinct first line per request")
    r.add_argument("--echo", action="store_true",
                   help="ask the model to repeat ECHO_PARAGRAPH (--prompt-words unused)")
    r.add_argument("--pid", type=int, default=None, help="server pid whose RSS to sample")
    r.set_defaults(func=cmd_run)

    a = sub.add_parser("agent", help="multi-turn: cold TTFT, then the next turn's TTFT")
    common(a)
    a.add_argument("--context-words", type=int, default=1500)
    a.add_argument("--turns", type=int, default=4)
    a.add_argument("--reps", type=int, default=2)
    a.set_defaults(func=cmd_agent)

    t = sub.add_parser("table", help="print the comparison table from a results directory")
    t.add_argument("--results", required=True)
    t.set_defaults(func=cmd_table)

    b = sub.add_parser("best-np", help="print `NP KV_MIB` for an anchor's equal-KV row")
    b.add_argument("--results", required=True)
    b.add_argument("--anchor", choices=["llama", "ik"], required=True)
    b.set_defaults(func=cmd_best_np)

    args = p.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
