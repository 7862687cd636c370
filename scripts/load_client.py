#!/usr/bin/env python3
"""Streaming load client for OpenAI-compatible `/v1/chat/completions` servers (temper and
llama-server), Python standard library only. Used by `scripts/bench-compare.sh`.

Subcommands:
  run    N concurrent clients, each sending R streaming requests back to back; prints JSON with
         per-request TTFT and output tok/s, and the aggregate output tok/s of the whole run.
  agent  multi-turn agent case: a long conversation sent cold (unique prefix), then its next turn
         (same prefix + the answer + a new user message); prints JSON with both TTFTs.
  table  reads the JSON results written by bench-compare.sh and prints the markdown table.

Every request asks for a fixed number of output tokens: `max_tokens`, `temperature: 0` and
`ignore_eos: true` (both servers accept it); llama-server also gets `cache_prompt: true` (its
per-slot prompt cache, the default anyway). Tokens are counted from the final usage chunk
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
        if self.server == "llama":
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


def cmd_table(args):
    d = args.results
    meta = load(d, "meta.json") or {}
    rows = []

    def row(label, better, llama, temper, fmt):
        if isinstance(temper, str) or temper is None or llama is None:
            ratio = "-"
        else:
            ratio = f"{temper / llama:.2f}x"
        show = lambda v: v if isinstance(v, str) else ("-" if v is None else fmt(v))  # noqa: E731
        rows.append((label, better, show(llama), show(temper), ratio))

    tok_s = lambda v: f"{v:.1f} tok/s"  # noqa: E731
    secs = lambda v: f"{v:.2f} s" if v >= 0.1 else f"{v * 1000:.0f} ms"  # noqa: E731
    mib = lambda v: f"{v / 1024:.0f} MiB"  # noqa: E731
    mt = meta.get("max_tokens", "?")

    row(
        f"decode tok/s, 1 client, {mt} output tokens (per-request median)",
        "higher",
        get(d, "llama-c1.json", "decode_tok_s_p50"),
        get(d, "temper-c1.json", "decode_tok_s_p50"),
        tok_s,
    )
    for c in (16, 32):
        row(
            f"aggregate output tok/s, {c} clients x {mt} tokens",
            "higher",
            get(d, f"llama-c{c}.json", "aggregate_tok_s"),
            get(d, f"temper-c{c}.json", "aggregate_tok_s"),
            tok_s,
        )
    for c in (1, 8, 16):
        row(
            f"TTFT p50, {c} client{'s' if c > 1 else ''} (short prompt)",
            "lower",
            get(d, f"llama-c{c}.json", "ttft_p50_s"),
            get(d, f"temper-c{c}.json", "ttft_p50_s"),
            secs,
        )
    row(
        "prefill, 512 tokens in-process (llama-bench pp512 / temper bench prompt 512)",
        "higher",
        get(d, "llama-pp512.json", "tok_s"),
        get(d, "temper-pp512.json", "tok_s"),
        tok_s,
    )
    pl = get(d, "llama-p512.json", "prompt_tokens") or get(d, "temper-p512.json", "prompt_tokens")
    row(
        f"TTFT of a {pl or '~512'}-token prompt over HTTP, 1 client, cold (p50)",
        "lower",
        get(d, "llama-p512.json", "ttft_p50_s"),
        get(d, "temper-p512.json", "ttft_p50_s"),
        secs,
    )
    ct = get(d, "llama-agent.json", "cold_prompt_tokens") or get(
        d, "temper-agent.json", "cold_prompt_tokens"
    )
    nt = get(d, "llama-agent.json", "next_prompt_tokens") or get(
        d, "temper-agent.json", "next_prompt_tokens"
    )
    row(
        f"agent: TTFT of a {ct or '~2k'}-token conversation, cold",
        "lower",
        get(d, "llama-agent.json", "cold_ttft_s"),
        get(d, "temper-agent.json", "cold_ttft_s"),
        secs,
    )
    row(
        f"agent: TTFT of its next turn ({nt or '?'} tokens, prefix cached)",
        "lower",
        get(d, "llama-agent.json", "next_ttft_s"),
        get(d, "temper-agent.json", "next_ttft_s"),
        secs,
    )
    et = meta.get("echo_tokens", "?")
    llama_echo = get(d, "llama-echo.json", "decode_tok_s_p50")
    off = get(d, "temper-echo.json", "decode_tok_s_p50")
    row(
        f"echo-heavy decode tok/s, 1 client, {et} tokens (temper: prompt lookup off)",
        "higher",
        llama_echo,
        off,
        tok_s,
    )
    on = get(d, "temper-echo-spec.json", "decode_tok_s_p50")
    spec = meta.get("spec_flag")
    if on is None:
        on = meta.get("spec_na") or "n/a (no flag)"
        label = "echo-heavy decode tok/s, temper prompt lookup on"
    else:
        label = f"echo-heavy decode tok/s, temper with `{spec}`" + (
            f" (on/off {on / off:.2f}x)" if off else ""
        )
    row(label, "higher", llama_echo, on, tok_s)
    row(
        "peak RSS of the server process during the 16-client run (VmHWM)",
        "lower",
        get(d, "llama-c16.json", "memory", "vmhwm_kb"),
        get(d, "temper-c16.json", "memory", "vmhwm_kb"),
        mib,
    )

    print(f"host: {meta.get('cpu', '?')}; {meta.get('cores', '?')} cores; "
          f"flags: {meta.get('flags') or 'none of avx2/avx512*/amx'}; "
          f"ISA: {meta.get('isa', 'native')}")
    print(f"llama.cpp {meta.get('llama_commit', '?')} (`-t 2`, llama-server `-np 8 -c "
          f"{meta.get('llama_ctx', '?')}`); temper {meta.get('temper_commit', '?')} "
          f"(`temper serve`, RAYON_NUM_THREADS=2); mode: {meta.get('mode', '?')}; "
          f"one server at a time, same model, same load client")
    print()
    print("| figure | better | llama.cpp | temper | temper / llama.cpp |")
    print("|---|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(r) + " |")
    print()
    # Summary: geometric mean of the speed ratios, each oriented so that > 1 means temper is ahead.
    oriented = []
    for label, better, _l, _t, ratio in rows:
        if ratio == "-" or label.startswith("peak RSS"):
            continue
        v = float(ratio[:-1])
        if v > 0:
            oriented.append(v if better == "higher" else 1 / v)
    if oriented:
        g = math.exp(sum(math.log(v) for v in oriented) / len(oriented))
        ahead = sum(1 for v in oriented if v > 1)
        print(
            f"summary: temper is ahead of llama.cpp on {ahead} of {len(oriented)} speed figures; "
            f"geometric mean of the speed ratios (> 1 = temper faster) {g:.2f}x"
        )
    else:
        print("summary: no figure was measured on both servers")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)

    def common(sp):
        sp.add_argument("--url", required=True, help="base URL, e.g. http://127.0.0.1:8000")
        sp.add_argument("--server", choices=["temper", "llama"], required=True,
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

    args = p.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
