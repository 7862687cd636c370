#!/usr/bin/env python3
"""Soak test: N clients for M minutes against one `temper serve`, Python standard library only.

Starts the server (its own data directory under a temporary directory, one API key) unless
`--url` is given, then runs `--clients` threads that send, back to back, a mix of:

  stream      streaming completion, 16-64 tokens, sampled
  n4          non-streaming, n=4 with logprobs (an RL rollout)
  json        non-streaming, `response_format` json_schema (structured outputs)
  cancel      streaming, the client hangs up after a few chunks
  agent       a long shared system prompt + a new question (prefix cache)

and one trainer thread that, in a loop, rolls out (n=4, logprobs), scores, posts a training job,
waits for it and samples from the new checkpoint by name; one more thread times `GET /health`
every half second. Every `--report-every` seconds it
prints a row: requests finished, 2xx / 429 / other 4xx / 5xx / connection errors, p50 and p99
latency of the window, and the server's VmRSS (now, and the peak so far). It ends with one line

  soak: clients=.. minutes=.. requests=.. 5xx=.. errors=.. p99=..s rss_first=..MB rss_last=..MB
        rss_peak=..MB jobs=succeeded/posted

and exits 1 if any request got a 5xx or failed to connect, or a job did not succeed.
`make soak ARGS="--clients 64 --minutes 10"`.
"""

import argparse
import http.client
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from load_client import RssSampler, pct, prose  # noqa: E402

KEY = "soak-key"
KINDS = [("stream", 40), ("n4", 15), ("json", 15), ("cancel", 15), ("agent", 15)]
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "year": {"type": "integer"}},
    "required": ["city", "year"],
}
AGENT_SYSTEM = "You are a careful research assistant. Notes so far: " + prose(600)


class Http:
    def __init__(self, url, timeout):
        u = urllib.parse.urlparse(url)
        self.host, self.port, self.timeout = u.hostname, u.port, timeout

    def conn(self):
        return http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)

    def send(self, method, path, body=None):
        """Returns (connection, response) with the headers read; the caller reads the body."""
        c = self.conn()
        headers = {"Authorization": f"Bearer {KEY}"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        c.request(method, path, body=data, headers=headers)
        return c, c.getresponse()

    def call(self, method, path, body=None):
        c, r = self.send(method, path, body)
        try:
            raw = r.read()
        finally:
            c.close()
        try:
            return r.status, json.loads(raw) if raw else None
        except ValueError:
            return r.status, raw[:300]


class Tally:
    """Outcomes and latencies, per report window and in total; thread safe."""

    def __init__(self):
        self.lock = threading.Lock()
        self.window = self.fresh()
        self.total = self.fresh()
        self.failures = []

    @staticmethod
    def fresh():
        return {"n": 0, "2xx": 0, "429": 0, "4xx": 0, "5xx": 0, "errors": 0, "lat": []}

    def add(self, kind, status, latency, detail=None):
        """`latency` None: not a chat request (job posts), counted but not in the latencies."""
        key = (
            "errors" if status is None
            else "2xx" if status < 300
            else "429" if status == 429
            else "4xx" if status < 500
            else "5xx"
        )
        with self.lock:
            for t in (self.window, self.total):
                t["n"] += 1
                t[key] += 1
                if status is not None and status < 300 and latency is not None:
                    t["lat"].append(latency)
            if key in ("5xx", "errors", "4xx") and len(self.failures) < 20:
                self.failures.append(f"{kind}: {status} {detail}")

    def take_window(self):
        with self.lock:
            w, self.window = self.window, self.fresh()
        return w


def chat_body(model, rng, kind):
    question = prose(rng.randint(20, 120), offset=rng.randint(0, 500))
    body = {
        "model": model,
        "messages": [{"role": "user", "content": f"Summarize: {question}"}],
        "max_tokens": rng.randint(16, 64),
        "temperature": 0.8,
        "seed": rng.randint(0, 1 << 30),
    }
    if kind in ("stream", "cancel"):
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    elif kind == "n4":
        body.update(n=4, logprobs=True, max_tokens=16)
    elif kind == "json":
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "fact", "schema": SCHEMA},
        }
        body["max_tokens"] = 48
    elif kind == "agent":
        body["messages"] = [
            {"role": "system", "content": AGENT_SYSTEM},
            {"role": "user", "content": f"Question {rng.randint(0, 1 << 20)}: which year?"},
        ]
        body["max_tokens"] = 16
    return body


def one_request(api, model, rng, tally):
    kind = rng.choices([k for k, _ in KINDS], weights=[w for _, w in KINDS])[0]
    body = chat_body(model, rng, kind)
    t0 = time.perf_counter()
    try:
        c, r = api.send("POST", "/v1/chat/completions", body)
        try:
            if r.status != 200:
                detail = r.read()[:300]
            elif kind == "cancel":
                # Hang up after a few chunks: the server must cancel and free the sequence.
                for _ in range(rng.randint(1, 4)):
                    r.readline()
                detail = None
            else:
                raw = r.read()
                detail = None
                if not body.get("stream"):
                    choices = json.loads(raw)["choices"]
                    assert len(choices) == body.get("n", 1), raw[:300]
                elif b"[DONE]" not in raw:
                    detail, r.status = "stream ended without [DONE]", 599
        finally:
            c.close()
        tally.add(kind, r.status, time.perf_counter() - t0, detail)
    except (OSError, http.client.HTTPException, ValueError, AssertionError) as e:
        tally.add(kind, None, time.perf_counter() - t0, repr(e))


def client_loop(api, model, seed, deadline, tally):
    rng = random.Random(seed)
    while time.monotonic() < deadline:
        one_request(api, model, rng, tally)


def trainer_loop(api, model, deadline, tally, jobs):
    """Rollout → rewards → job → wait → sample from the checkpoint, until the deadline."""
    status, created = api.call(
        "POST",
        "/v1/preview/models",
        {"project": "soak", "name": f"agent-{os.getpid()}", "base_model": model},
    )
    if status != 200:
        tally.add("train", status, None, created)
        return
    model_id, name = created["id"], None
    rng = random.Random(7)
    while time.monotonic() < deadline - 30:
        prompt = [{"role": "user", "content": f"Say a word about {prose(3, rng.randint(0, 99))}"}]
        t0 = time.perf_counter()
        status, out = api.call(
            "POST",
            "/v1/chat/completions",
            {"model": name or model, "messages": prompt, "n": 4, "max_tokens": 12,
             "temperature": 1.0, "logprobs": True, "seed": rng.randint(0, 1 << 30)},
        )
        tally.add("rollout", status, time.perf_counter() - t0, out if status != 200 else None)
        if status != 200:
            time.sleep(1)
            continue
        trajectories = [
            {"messages_and_choices": prompt + [ch],
             "reward": len(ch["message"]["content"] or "") % 7 + rng.random() * 1e-3}
            for ch in out["choices"]
        ]
        status, job = api.call(
            "POST",
            "/v1/preview/training-jobs",
            {"model_id": model_id, "trajectory_groups": [{"trajectories": trajectories}]},
        )
        tally.add("job", status, None, job if status != 200 else None)
        if status != 200:
            time.sleep(1)
            continue
        jobs["posted"] += 1
        while True:
            status, j = api.call("GET", f"/v1/preview/training-jobs/{job['id']}")
            if status == 200 and j["status"] in ("succeeded", "failed", "cancelled"):
                break
            time.sleep(0.5)
        if j["status"] == "succeeded":
            jobs["succeeded"] += 1
            # Roll out from the newest checkpoint next, by its inference name.
            name = f"{created['entity']}/{created['project']}/{created['name']}"
        else:
            tally.add("job", 500, None, j)


def health_loop(api, deadline, probes):
    """`GET /health` every half second: how long the server takes to answer it under the load."""
    while time.monotonic() < deadline:
        t0 = time.perf_counter()
        try:
            status, _ = api.call("GET", "/health")
        except (OSError, http.client.HTTPException):
            status = None
        probes.append((status, time.perf_counter() - t0))
        time.sleep(0.5)


def start_server(args, workdir):
    cmd = [args.temper, "serve", "--port", "0", "--api-key", KEY,
           "--data-dir", os.path.join(workdir, "data")]
    if args.model:
        cmd += ["--model", args.model]
    cmd += args.serve_args.split()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=open(
        os.path.join(workdir, "server.log"), "wb"), text=True)
    first = proc.stdout.readline()
    url = next((w for w in first.split() if w.startswith("http://")), None)
    if not url:
        proc.kill()
        sys.exit(f"soak: the server did not start: {first!r} (log: {workdir}/server.log)")
    threading.Thread(target=proc.stdout.read, daemon=True).start()
    return proc, url[: -len("/v1")] if url.endswith("/v1") else url


def mb(kb):
    return f"{kb / 1024:.0f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--minutes", type=float, default=10)
    ap.add_argument("--report-every", type=float, default=60, help="seconds per row")
    ap.add_argument("--temper", default="target/release/temper")
    ap.add_argument("--model", help="NAME=PATH for temper serve (default: its default model)")
    ap.add_argument("--url", help="soak a running server (API key soak-key) instead")
    ap.add_argument("--pid", type=int, help="with --url: the server's pid, for its RSS")
    ap.add_argument("--no-train", action="store_true", help="no training jobs")
    ap.add_argument("--serve-args", default="",
                    help="more `temper serve` flags, e.g. '--kv-cache-mb 512'")
    args = ap.parse_args()

    workdir = tempfile.mkdtemp(prefix="temper-soak-")
    proc = None
    if args.url:
        url, pid = args.url.rstrip("/"), args.pid
    else:
        proc, url = start_server(args, workdir)
        pid = proc.pid
    api = Http(url, timeout=600)
    status, models = api.call("GET", "/v1/models")
    if status != 200:
        sys.exit(f"soak: GET /v1/models: {status} {models}")
    model = models["data"][0]["id"]
    print(f"soak: {args.clients} clients for {args.minutes} min against {url} (model {model}, "
          f"server pid {pid}, log {workdir}/server.log)", flush=True)

    tally, jobs = Tally(), {"posted": 0, "succeeded": 0}
    rss = RssSampler(pid, period=1.0).start()
    start = time.monotonic()
    deadline = start + args.minutes * 60
    threads = [threading.Thread(target=client_loop, args=(api, model, i, deadline, tally),
                                daemon=True) for i in range(args.clients)]
    probes = []
    threads.append(threading.Thread(target=health_loop, args=(api, deadline, probes), daemon=True))
    if not args.no_train:
        threads.append(threading.Thread(target=trainer_loop,
                                        args=(api, model, deadline, tally, jobs), daemon=True))
    for t in threads:
        t.start()

    print("| minute | requests | 2xx | 429 | other 4xx | 5xx | conn errors | p50 s | p99 s "
          "| RSS MB | peak RSS MB | jobs ok/posted |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    rss_rows = []
    next_row = start + args.report_every
    while True:
        alive = any(t.is_alive() for t in threads)
        if alive and time.monotonic() < next_row:
            time.sleep(0.2)
            continue
        next_row += args.report_every
        w = tally.take_window()
        now_kb = rss.read().get("VmRSS", 0)
        rss_rows.append(now_kb)
        p50, p99 = pct(w["lat"], 50), pct(w["lat"], 99)
        print(f"| {(time.monotonic() - start) / 60:.1f} | {w['n']} | {w['2xx']} | {w['429']} | "
              f"{w['4xx']} | {w['5xx']} | {w['errors']} | "
              f"{p50 or 0:.2f} | {p99 or 0:.2f} | {mb(now_kb)} | {mb(rss.max_rss_kb)} | "
              f"{jobs['succeeded']}/{jobs['posted']} |", flush=True)
        if not alive:
            break
    peak = rss.stop() or {}
    if proc:
        proc.terminate()
        proc.wait(timeout=60)
    t = tally.total
    print(f"soak: clients={args.clients} minutes={args.minutes} requests={t['n']} "
          f"5xx={t['5xx']} errors={t['errors']} 429={t['429']} other_4xx={t['4xx']} "
          f"p99={pct(t['lat'], 99) or 0:.2f}s rss_first={mb(rss_rows[0] if rss_rows else 0)}MB "
          f"rss_last={mb(rss_rows[-1] if rss_rows else 0)}MB "
          f"rss_peak={mb(peak.get('max_vmrss_kb') or 0)}MB "
          f"jobs={jobs['succeeded']}/{jobs['posted']}")
    health = [t for status, t in probes if status == 200]
    print(f"health: {len(health)} of {len(probes)} probes answered 200, p99 "
          f"{(pct(health, 99) or 0) * 1000:.0f} ms, max {max(health, default=0) * 1000:.0f} ms")
    for f in tally.failures:
        print(f"  failure: {f}")
    bad = (t["5xx"] or t["errors"] or t["4xx"] or jobs["succeeded"] != jobs["posted"]
           or len(health) != len(probes))
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
