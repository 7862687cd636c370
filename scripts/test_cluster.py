#!/usr/bin/env python3
"""Cluster test (issue 14): 2 API nodes and 2 workers on one machine, sharing one PostgreSQL store
and one S3-compatible object store, on the default model. Standard library only.

Run by `make test-cluster` inside scripts/with-postgres.sh and scripts/with-s3.sh, which start a
throwaway PostgreSQL server and a moto S3 server and export TEMPER_TEST_POSTGRES_URL and
TEMPER_TEST_S3_URL (plus the AWS_* settings). Checks, each an assertion:

  1. jobs posted to either API node each run once, on one worker: one `training_started` per
     job, checkpoints 1..N per model with no gaps or repeats, and both workers ran jobs;
  2. killing (SIGKILL) the worker that runs a job re-queues it when its lease expires (a
     `training_requeued` event) and the other worker finishes it;
  3. a checkpoint trained by a worker is served by both API nodes (loaded from the object
     store), with the same logprobs on each.

Prints one line per check and `test result: ok. N passed; 0 failed` in cargo's shape (make test
sums them); exits 1 on the first failure, with the nodes' log tails.
"""

import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import uuid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BINARY = os.path.join(ROOT, "target", "release", "temper")
KEY = "cluster-key"
LEASE_SECS = 6
BASE = "gemma-3-270m"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Node:
    """One `temper serve` process of the cluster."""

    def __init__(self, name, role, store, artifacts, work):
        self.name, self.role = name, role
        self.port = free_port()
        self.data = os.path.join(work, name)
        self.log_path = os.path.join(work, f"{name}.log")
        args = [
            BINARY, "serve", "--role", role, "--port", str(self.port),
            "--data-dir", self.data, "--store", store, "--artifacts", artifacts,
            "--api-key", KEY, "--job-lease-secs", str(LEASE_SECS),
            "--worker-id", name,
        ]
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_healthy(self, within=120):
        deadline = time.time() + within
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.name} exited with {self.proc.returncode}")
            try:
                status, _ = self.call("GET", "/health")
                if status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.3)
        raise AssertionError(f"{self.name} not healthy within {within} s")

    def call(self, method, path, body=None, timeout=120):
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        headers = {"Authorization": f"Bearer {KEY}"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        try:
            c.request(method, path, body=data, headers=headers)
            r = c.getresponse()
            raw = r.read()
        finally:
            c.close()
        return r.status, (json.loads(raw) if raw else None)

    def ok(self, method, path, body=None):
        status, answer = self.call(method, path, body)
        assert status == 200, f"{self.name} {method} {path}: {status} {answer}"
        return answer

    def kill(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()
        self.log.close()

    def tail(self, n=25):
        with open(self.log_path) as f:
            return "".join(f.readlines()[-n:])


def sft_body(model_id, trajectories, epochs):
    """An SFT job; its length is set by the number of trajectories and epochs."""
    convs = []
    for i in range(trajectories):
        convs.append({"messages": [
            {"role": "user", "content": f"Name the colour number {i}."},
            {"role": "assistant", "content": f"Colour {i} is a shade of blue, number {i}."},
        ]})
    return {
        "model_id": model_id,
        "trajectories": convs,
        "config": {"learning_rate": 1e-4, "batch_size": 2, "epochs": epochs},
    }


def events(node, job_id):
    out, after = [], None
    while True:
        q = f"?limit=100" + (f"&after={after}" if after is not None else "")
        page = node.ok("GET", f"/v1/preview/training-jobs/{job_id}/events{q}")
        out += page["data"]
        if not page["has_more"]:
            return out
        after = page["data"][-1]["id"]


def wait_job(node, job_id, within=600, until=("succeeded", "failed", "cancelled")):
    deadline = time.time() + within
    while time.time() < deadline:
        job = node.ok("GET", f"/v1/preview/training-jobs/{job_id}")
        if job["status"] in until:
            return job
        time.sleep(0.5)
    raise AssertionError(f"job {job_id} not {until} within {within} s")


def started_by(node, job_id):
    """The workers that started the job, in order (from its training_started events)."""
    return [e["data"].get("worker") for e in events(node, job_id) if e["type"] == "training_started"]


def sample_logprobs(node, model):
    answer = node.ok("POST", "/v1/chat/completions", {
        "model": model,
        "messages": [{"role": "user", "content": "Name the colour number 3."}],
        "max_tokens": 8, "temperature": 0, "logprobs": True,
    })
    return [t["logprob"] for t in answer["choices"][0]["logprobs"]["content"]]


def main():
    store = os.environ.get("TEMPER_TEST_POSTGRES_URL")
    s3 = os.environ.get("TEMPER_TEST_S3_URL")
    if not store or not s3:
        print("test-cluster needs TEMPER_TEST_POSTGRES_URL and TEMPER_TEST_S3_URL "
              "(run it as `make test-cluster`)", file=sys.stderr)
        return 1
    artifacts = f"{s3.rstrip('/')}/cluster-{uuid.uuid4().hex[:8]}"
    work = tempfile.mkdtemp(prefix="temper-cluster-")
    nodes = []
    passed = 0
    try:
        api = [Node(f"api{i}", "api", store, artifacts, work) for i in (1, 2)]
        workers = [Node(f"worker{i}", "worker", store, artifacts, work) for i in (1, 2)]
        nodes = api + workers
        for n in nodes:
            n.wait_healthy()
        print(f"cluster up: {', '.join(f'{n.name}:{n.port}' for n in nodes)}")

        # 1. Jobs posted to either API node run once, on one worker.
        models = [
            api[i % 2].ok("POST", "/v1/preview/models", {
                "project": "cluster", "name": f"m{i}", "base_model": BASE})
            for i in range(2)
        ]
        jobs = []
        for round_ in range(2):
            for i, m in enumerate(models):
                node = api[(round_ + i) % 2]
                jobs.append((m["id"], node.ok(
                    "POST", "/v1/preview/sft-training-jobs", sft_body(m["id"], 4, 1))["id"]))
        ran_on = set()
        for model_id, job_id in jobs:
            job = wait_job(api[0], job_id)
            assert job["status"] == "succeeded", f"job {job_id}: {job}"
            starts = started_by(api[1], job_id)
            assert len(starts) == 1 and starts[0], f"job {job_id} started {starts}"
            ran_on.add(starts[0])
        for m in models:
            steps = [c["step"] for c in api[1].ok(
                "GET", f"/v1/preview/models/{m['id']}/checkpoints?limit=100")["data"]]
            assert sorted(steps) == [0, 1, 2], f"{m['name']}: {steps}"
        assert ran_on == {"worker1", "worker2"}, f"jobs ran on {ran_on}"
        passed += 1
        print(f"ok: {len(jobs)} jobs from both API nodes ran once each, on {sorted(ran_on)}")

        # 2. A worker killed mid-job: the lease expires, the job is re-queued and finishes on
        # the other worker.
        m = models[0]
        job_id = api[1].ok("POST", "/v1/preview/sft-training-jobs",
                           sft_body(m["id"], 16, 4))["id"]
        deadline = time.time() + 300
        while not started_by(api[0], job_id):
            assert time.time() < deadline, "the long job never started"
            time.sleep(0.2)
        first = started_by(api[0], job_id)[0]
        victim = next(w for w in workers if w.name == first)
        time.sleep(1.0)
        victim.kill()
        killed_at = time.time()
        job = wait_job(api[0], job_id)
        assert job["status"] == "succeeded", f"re-queued job: {job}"
        kinds = [e["type"] for e in events(api[0], job_id)]
        assert "training_requeued" in kinds, kinds
        starts = started_by(api[0], job_id)
        assert starts[0] == first and starts[-1] != first, starts
        passed += 1
        print(f"ok: killed {first} mid-job; re-queued after its lease, finished on {starts[-1]} "
              f"{time.time() - killed_at:.0f} s after the kill")

        # 3. A checkpoint trained by a worker is served by both API nodes, from the object
        # store, with the same numbers.
        name = f"default/cluster/{m['name']}:step{job['step']}"
        a = sample_logprobs(api[0], name)
        b = sample_logprobs(api[1], name)
        assert a == b, f"api1 {a} != api2 {b}"
        base = sample_logprobs(api[0], BASE)
        assert a != base, "the trained checkpoint gives the base model's numbers"
        passed += 1
        print(f"ok: {name} served by both API nodes with identical logprobs")
    except AssertionError as e:
        print(f"FAILED: {e}", file=sys.stderr)
        for n in nodes:
            n.stop()
            print(f"--- {n.name} log tail ---\n{n.tail()}", file=sys.stderr)
        print(f"test result: FAILED. {passed} passed; 1 failed")
        return 1
    for n in nodes:
        n.stop()
    # The nodes' homes and logs are kept only for a failure to be read (each run left its dir
    # in /tmp).
    shutil.rmtree(work, ignore_errors=True)
    print(f"test result: ok. {passed} passed; 0 failed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
