"""The dashboard (GET /dashboard) in headless Chromium against the real `temper serve` binary on
the default model, with trained checkpoints. Run by scripts/dashboard-test.sh (`make
test-dashboard`, part of `make test`); Python's standard library only. Prints a cargo-style
`test result:` line the Makefile sums.

A fresh data directory gets a team key (`temper keys create`); the server is started on it; one
model is registered and trained by three RL jobs on sampled rollouts (rewarded by answer length)
with `/log` of a `val` split before, between and after them; a fourth, long job is cancelled after
the page was loaded while it was queued or running (it must show it so, and poll). Then
Chromium loads the page with the key and its DOM (after the script ran) must show the model, every
checkpoint, every job with its status and events, and the reward and loss curves with a point per
checkpoint / gradient step; a metric name with markup must show as text; a wrong or missing key
must show the server's 401 message. Last, a screenshot (`--screenshot PATH`, default
target/dashboard.png; the one in docs/api.md is docs/dashboard.png).
"""

import argparse
import html
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BINARY = os.environ.get("TEMPER_BIN", os.path.join(ROOT, "target/release/temper"))
MODEL = "gemma-3-270m"
TEAM = "dash-team"
# RL jobs, each on a fresh group of rollouts from the latest checkpoint.
ROUNDS = 3
QUESTION = "Name one fruit and say why you like it."
# A user-chosen metric name with markup: the page must show it as text.
MARKUP_METRIC = "<b>bold</b>"
CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--hide-scrollbars", "--force-device-scale-factor=1",
]


class Server:
    """`temper serve` on a free port over `data_dir`; the request log is kept for failures."""

    def __init__(self, data_dir):
        env = dict(os.environ, RUST_LOG="info")
        env.pop("TEMPER_CONFIG", None)
        # Short packed sequences: each job's group trains in several gradient steps.
        self.proc = subprocess.Popen(
            [BINARY, "serve", "--port", "0", "--data-dir", data_dir, "--max-train-seq-len", "64"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        self.log = []
        threading.Thread(target=lambda: self.log.extend(self.proc.stderr), daemon=True).start()
        first = self.proc.stdout.readline()
        urls = [w for w in first.split() if w.startswith("http://")]
        if not urls:
            self.stop()
            raise RuntimeError(f"temper serve printed no URL: {first!r}\n{''.join(self.log)}")
        self.base = urls[0].removesuffix("/v1")
        threading.Thread(target=self.proc.stdout.read, daemon=True).start()

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class Client:
    def __init__(self, base, key):
        self.base, self.key = base, key

    def call(self, method, path, body=None):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base + path, data=data, method=method, headers={
            "Authorization": f"Bearer {self.key}", "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=600) as resp:
                return json.load(resp)
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"{method} {path}: {e.code} {e.read().decode(errors='replace')}") from None


def rollouts(client, name, seed):
    """Eight sampled answers to the question from the model's latest checkpoint, as the
    training API takes them (sampled tokens as `token_id:<id>`), rewarded by their length."""
    user = {"role": "user", "content": QUESTION}
    r = client.call("POST", "/v1/chat/completions", {
        "model": name, "messages": [user], "n": 8, "max_tokens": 8, "temperature": 1.0,
        "seed": seed, "logprobs": True, "return_tokens_as_token_ids": True})
    return [{"messages_and_choices": [user, choice],
             "reward": len(choice["message"]["content"] or "") / 40}
            for choice in r["choices"]]


def wait_finished(client, job_id, within=600):
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        job = client.call("GET", f"/v1/preview/training-jobs/{job_id}")
        if job["status"] not in ("queued", "running"):
            return job
        time.sleep(0.5)
    raise RuntimeError(f"job {job_id} did not finish within {within} s")


def events(client, job_id):
    out, after = [], None
    while True:
        page = client.call("GET", f"/v1/preview/training-jobs/{job_id}/events?limit=100"
                           + (f"&after={after}" if after is not None else ""))
        out += page["data"]
        if not page["has_more"]:
            return out
        after = out[-1]["id"]


def train(client, while_live):
    """Registers the model and trains it; what the page must then show. `while_live(job_id)` is
    called while a long job is queued or running (then it is cancelled); its result is kept as
    `live`."""
    model = client.call("POST", "/v1/preview/models", {
        "entity": None, "project": "dashboard-test", "name": "agent", "base_model": MODEL})
    name = f"{model['entity']}/{model['project']}/{model['name']}"

    def log(groups):
        client.call("POST", f"/v1/preview/models/{model['id']}/log", {
            "model_id": model["id"], "split": "val", "trajectory_groups": groups})

    jobs, trajectories = [], []
    for round_ in range(ROUNDS):
        groups = [{"trajectories": rollouts(client, name, 100 + round_)}]
        trajectories += groups[0]["trajectories"]
        if round_ == 0:
            # Logged once (as `val/<b>bold</b>` of step 0), not trained on.
            log([{"trajectories": [dict(t, metrics={MARKUP_METRIC: 1.0}) for t in groups[0]["trajectories"]]}])
        else:
            log(groups)
        job = client.call("POST", "/v1/preview/training-jobs", {
            "model_id": model["id"], "trajectory_groups": groups,
            "experimental_config": {"learning_rate": 1e-4}})
        job = wait_finished(client, job["id"])
        assert job["status"] == "succeeded", job
        jobs.append(job)
    last = rollouts(client, name, 200)
    log([{"trajectories": last}])
    # Every rollout in one group: 16 gradient steps (tens of seconds), long enough for the page
    # to be loaded while the job is queued or running; then it is cancelled.
    live = client.call("POST", "/v1/preview/training-jobs", {
        "model_id": model["id"], "trajectory_groups": [{"trajectories": trajectories + last}],
        "experimental_config": {"learning_rate": 1e-4}})
    seen_live = while_live(live["id"])
    jobs.append(client.call("POST", f"/v1/preview/training-jobs/{live['id']}/cancel"))
    assert jobs[-1]["status"] == "cancelled", jobs[-1]
    wait_finished(client, live["id"])
    for job in jobs:
        job["events"] = events(client, job["id"])
    checkpoints = client.call("GET", f"/v1/preview/models/{model['id']}/checkpoints?limit=100")["data"]
    return {"model": model, "name": name, "jobs": jobs, "checkpoints": checkpoints,
            "live": (live["id"], seen_live)}


def chromium(binary, url, *extra, budget_ms=15000):
    """Loads `url` in a fresh headless Chromium profile, lets the page's script run for up to
    `budget_ms` of virtual time (network waits pause it), and returns stdout."""
    with tempfile.TemporaryDirectory(prefix="temper-chromium-") as profile:
        r = subprocess.run(
            [binary, *CHROMIUM_FLAGS, f"--user-data-dir={profile}",
             f"--virtual-time-budget={budget_ms}", *extra, url],
            capture_output=True, text=True, timeout=180)
    if r.returncode != 0:
        raise RuntimeError(f"chromium exited {r.returncode}: {r.stderr[-2000:]}")
    return r.stdout


def dump_dom(binary, url):
    dom = chromium(binary, url, "--dump-dom")
    assert "<html" in dom, f"no DOM dumped: {dom[:500]!r}"
    return dom


def attr(dom, tag, name, value):
    """Whether an element `<tag … name="value" …>` is in the DOM."""
    return re.search(rf'<{tag}\b[^>]*\b{name}="{re.escape(html.escape(value))}"', dom) is not None


def series_path(dom, series):
    """The `d` and `data-points` of the chart path of `series`."""
    for tag in re.findall(r"<path\b[^>]*>", dom):
        if f'data-series="{series}"' in tag:
            d = re.search(r'\bd="([^"]*)"', tag).group(1)
            return d, int(re.search(r'data-points="(\d+)"', tag).group(1))
    raise AssertionError(f"no chart path for {series!r}")


def check_page(dom, trained):
    """The model, its checkpoints, jobs, events and both curves."""
    assert re.search(rf"<h2>{re.escape(trained['name'])}</h2>", dom), "model name"
    assert attr(dom, "section", "data-model-id", trained["model"]["id"]), "model section"
    steps = [c["step"] for c in trained["checkpoints"]]
    assert steps == list(range(ROUNDS + 1)), f"checkpoints of {ROUNDS} trained jobs: {steps}"
    for step in steps:
        assert attr(dom, "tr", "data-step", str(step)), f"checkpoint row of step {step}"
    for job in trained["jobs"]:
        row = re.search(rf'<tr\b[^>]*data-job-id="{job["id"]}"[^>]*data-status="([a-z]+)"', dom)
        assert row, f"job row {job['id']}"
        assert row.group(1) == job["status"], f"job {job['id']}: {row.group(1)} != {job['status']}"
        assert re.search(rf'class="badge {job["status"]}">{job["status"]}<', dom), job["status"]
    types = {e["type"] for job in trained["jobs"] for e in job["events"]}
    assert {"training_started", "gradient_step", "training_ended"} <= types, types
    for t in types:
        assert attr(dom, "tr", "data-event-type", t), f"event rows of type {t}"
    shown = len(re.findall(r'<tr data-event-type="', dom))
    total = sum(len(job["events"]) for job in trained["jobs"])
    assert shown == total, f"{shown} event rows for {total} events"


def check_curves(dom, trained):
    """Loss: one point per gradient step of every job. Reward: the training steps' mean per
    trained checkpoint, and the `val` split's `/log` at every checkpoint."""
    gradient_steps = [e for job in trained["jobs"] for e in job["events"] if e["type"] == "gradient_step"]
    assert len(gradient_steps) >= 2, gradient_steps
    for series, points in [("loss", len(gradient_steps)), ("reward", ROUNDS), ("val/reward", ROUNDS + 1)]:
        d, n = series_path(dom, series)
        assert n == points, f"{series}: {n} points, want {points}"
        coords = re.findall(r"[ML]([\d.]+) ([\d.]+)", d)
        assert len(coords) == points and d.startswith("M"), f"{series}: path {d!r}"
        assert len({y for _, y in coords}) > 1 or points == 1, f"{series}: a flat line {d!r}"
    assert attr(dom, "svg", "data-chart", "reward") and attr(dom, "svg", "data-chart", "loss")
    for label in ["checkpoint step", "gradient step (all jobs)", "val/reward (/log)"]:
        assert f">{label}</text>" in dom, f"axis label or legend {label!r}"


def check_live(_dom, trained):
    """Loaded while a job was queued or running: that job is shown so, and the page polls."""
    job_id, dom = trained["live"]
    row = re.search(rf'<tr\b[^>]*data-job-id="{job_id}"[^>]*data-status="([a-z]+)"', dom)
    assert row and row.group(1) in ("queued", "running"), row and row.group(0)
    assert '<span class="live">live: polling every 3 s</span>' in dom, "no live status"


def check_escaping(dom, _trained):
    """The metric `<b>bold</b>` (from /log, as `val/<b>bold</b>`) is text, not markup."""
    assert "val/" + html.escape(MARKUP_METRIC, quote=False) in dom, "the metric name as text"
    assert MARKUP_METRIC not in dom, "the metric name became markup"


def check_key_errors(binary, base):
    for key, message in [("wrong-key", "401: Invalid API key."),
                         (None, "401: Missing API key: send `Authorization: Bearer &lt;key&gt;`.")]:
        url = f"{base}/dashboard" + (f"#key={key}" if key else "")
        dom = dump_dom(binary, url)
        error = re.search(r'<div id="error"[^>]*>(.*?)</div>', dom, re.S)
        assert error and message in error.group(1) and "hidden" not in error.group(0), \
            f"key {key!r}: {error.group(0) if error else dom[:2000]}"
        assert 'class="model"' not in dom, f"key {key!r}: models shown"


def check_screenshot(binary, url, path):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if os.path.exists(path):
        os.remove(path)
    chromium(binary, url, f"--screenshot={os.path.abspath(path)}", "--window-size=1280,1460")
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    assert struct.unpack(">II", head[16:24]) == (1280, 1460), struct.unpack(">II", head[16:24])


def run_checks(server, key, args):
    """(passed, failed): training and loading the page are one check, then each check of it."""
    started = time.monotonic()
    try:
        page = f"{server.base}/dashboard#key={urllib.parse.quote(key)}"
        trained = train(Client(server.base, key), lambda _job: dump_dom(args.chromium, page))
        print(f"trained {trained['name']}: checkpoints {[c['step'] for c in trained['checkpoints']]}, "
              f"jobs {[j['status'] for j in trained['jobs']]} in {time.monotonic() - started:.0f} s")
        succeeded = [j["id"] for j in trained["jobs"] if j["status"] == "succeeded"]
        url = f"{page}&open={succeeded[-1]}"
        dom = dump_dom(args.chromium, url)
    except Exception as e:  # noqa: BLE001 - reported as the failed test it is
        print(f"test dashboard_train_and_load ... FAILED: {e}")
        return 0, 1
    checks = [
        ("dashboard_shows_models_checkpoints_jobs_and_events", lambda: check_page(dom, trained)),
        ("dashboard_draws_reward_and_loss_curves", lambda: check_curves(dom, trained)),
        ("dashboard_follows_a_live_job", lambda: check_live(dom, trained)),
        ("dashboard_escapes_user_strings", lambda: check_escaping(dom, trained)),
        ("dashboard_shows_a_wrong_or_missing_key", lambda: check_key_errors(args.chromium, server.base)),
        ("dashboard_screenshot", lambda: check_screenshot(args.chromium, url, args.screenshot)),
    ]
    passed, failed = 0, 0
    for name, check in checks:
        try:
            check()
            print(f"test {name} ... ok")
            passed += 1
        except Exception as e:  # noqa: BLE001 - every failure is reported, then counted
            print(f"test {name} ... FAILED: {e}")
            failed += 1
    if failed:
        with open(os.path.join(ROOT, "target/dashboard-dom.html"), "w") as f:
            f.write(dom)
        print("the page's DOM: target/dashboard-dom.html")
    return passed, failed


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chromium", default=shutil.which("chromium") or "chromium")
    p.add_argument("--screenshot", default=os.path.join(ROOT, "target/dashboard.png"))
    args = p.parse_args()
    data_dir = tempfile.TemporaryDirectory(prefix="temper-dashboard-")
    key = subprocess.run([BINARY, "keys", "create", "--team", TEAM, "--data-dir", data_dir.name],
                         capture_output=True, text=True, check=True).stdout.strip()
    server = Server(data_dir.name)
    try:
        passed, failed = run_checks(server, key, args)
    finally:
        server.stop()
        data_dir.cleanup()
    if failed:
        print("".join(server.log[-40:]), file=sys.stderr)
    print(f"screenshot: {args.screenshot}")
    status = "ok" if not failed else "FAILED"
    print(f"test result: {status}. {passed} passed; {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
