"""RL learning demo through temper's HTTP API, as a user runs it (`make demo-rl`; docs/benchmarks.md, RL demo).

Starts `temper serve` on a fresh data directory and a free port, registers a trainable model,
then each round: samples a group of answers to one question with chat completions against the
model's latest checkpoint by name (`logprobs`, `return_tokens_as_token_ids`, as the
openpipe-art client does), rewards 1 the answers that begin with a chosen word, posts the group
as a training job and follows its events to the end. p(word first) of every checkpoint is read
exactly from `prompt_logprobs` of the word continuing the answer; p(any case) sums the 20 most
likely first tokens that begin with the word in any case. Prints a table per job and draws the
learning curve to a PNG. The first job's fresh LoRA is seeded by the model's name and the rollouts
by `--seed`, so a run repeats on one host.
"""

import argparse
import math
import os
import sys
import time

import httpx
import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402
from openai import OpenAI  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "python"))
from test_openai_sdk import KEY, MODEL, Server  # noqa: E402

QUESTION = "Name one fruit. Answer with a single word."
END_EVENTS = ("training_ended", "training_failed")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--word", default="You", help="the rewarded first word of an answer")
    p.add_argument("--jobs", type=int, default=8, help="rounds of rollouts and one training job")
    p.add_argument("--group", type=int, default=32, help="rollouts per round (one request)")
    p.add_argument("--lr", type=float, default=2e-4, help="learning rate of every job")
    p.add_argument("--seed", type=int, default=1, help="sampling seeds derive from it")
    p.add_argument("--png", default="docs/rl-demo.png", help="where the plot is written")
    args = p.parse_args()
    if not args.word.strip():
        p.error("--word must not be blank")
    if args.jobs < 1 or args.group < 2:
        p.error("--jobs must be at least 1 and --group at least 2 (a group learns from differences)")
    if not (math.isfinite(args.lr) and args.lr > 0):
        p.error("--lr must be a positive number")
    return args


class Demo:
    def __init__(self, server, args):
        self.args = args
        self.chat = OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=600)
        root = server.base_url.removesuffix("/v1")
        self.http = httpx.Client(base_url=root, headers={"Authorization": f"Bearer {KEY}"}, timeout=600)
        self.user = {"role": "user", "content": QUESTION}
        model = self.call("POST", "/v1/preview/models", json={
            "entity": None, "project": "demo-rl", "name": "agent", "base_model": MODEL})
        self.model_id = model["id"]
        self.name = f"{model['entity']}/{model['project']}/{model['name']}"
        # The prompt's tokens up to the answer: the word's first token comes right after them.
        self.prompt = self.call("POST", "/tokenize", json={
            "model": MODEL, "messages": [self.user], "add_generation_prompt": True})["tokens"]

    def call(self, method, path, **kwargs):
        r = self.http.request(method, path, **kwargs)
        if r.status_code != 200:
            raise RuntimeError(f"{method} {path}: {r.status_code} {r.text}")
        return r.json()

    def word_probability(self, step):
        """p(the word's first token | the question) at a checkpoint: the prompt logprob of the
        word placed as the start of the answer."""
        r = self.chat.chat.completions.create(
            model=f"{self.name}:step{step}", max_tokens=1, temperature=0,
            messages=[self.user, {"role": "assistant", "content": self.args.word}],
            extra_body={"add_generation_prompt": False, "continue_final_message": True,
                        "prompt_logprobs": 0, "return_token_ids": True})
        body = r.model_dump()
        ids, at = body["prompt_token_ids"], len(self.prompt)
        if ids[:at] != self.prompt or len(ids) == at:
            raise RuntimeError(f"the answer {self.args.word!r} does not extend the prompt's tokens")
        return math.exp(body["prompt_logprobs"][at][str(ids[at])]["logprob"])

    def any_case_probability(self, step):
        """p(the first answer token alone earns the reward: it begins with the word, in any case,
        e.g. "you" or "Your"), summed over the 20 most likely first tokens (a lower bound)."""
        r = self.chat.chat.completions.create(
            model=f"{self.name}:step{step}", messages=[self.user], max_tokens=1, temperature=0,
            logprobs=True, top_logprobs=20)
        word = self.args.word.lower()
        return sum(math.exp(t.logprob) for t in r.choices[0].logprobs.content[0].top_logprobs
                   if t.token.strip().lower().startswith(word))

    def rollouts(self, step, seed):
        """The group's choices: Gemma's recommended sampling, sampled tokens as `token_id:<id>`."""
        r = self.chat.chat.completions.create(
            model=f"{self.name}:step{step}", messages=[self.user], n=self.args.group, max_tokens=8,
            temperature=1.0, top_p=0.95, seed=seed, logprobs=True,
            extra_body={"top_k": 64, "return_tokens_as_token_ids": True})
        return r.choices

    def rewarded(self, choice):
        return (choice.message.content or "").strip().lower().startswith(self.args.word.lower())

    def train(self, choices, rewards):
        """Posts one job and follows its events: (its gradient steps' metrics, the step of the
        checkpoint it ended with, the ending message, seconds from the post to the end)."""
        posted = time.monotonic()
        job = self.call("POST", "/v1/preview/training-jobs", json={
            "model_id": self.model_id,
            "trajectory_groups": [{"trajectories": [
                {"messages_and_choices": [self.user, c.model_dump(exclude_none=True)], "reward": r}
                for c, r in zip(choices, rewards)]}],
            "experimental_config": {"learning_rate": self.args.lr}})
        steps, after = [], 0
        while True:
            page = self.call("GET", f"/v1/preview/training-jobs/{job['id']}/events",
                             params={"after": after, "limit": 100})
            for event in page["data"]:
                after = event["id"]
                if event["type"] == "gradient_step":
                    steps.append(event["data"])
                elif event["type"] == "training_failed":
                    raise RuntimeError(f"training job {job['id']} failed: {event['data']}")
                elif event["type"] == "training_ended":
                    data = event["data"]
                    return steps, data["step"], data.get("message"), time.monotonic() - posted
            if not page["has_more"]:
                time.sleep(0.25)


def plot(path, word, probabilities, any_case, rewarded_fractions, group):
    fig, ax = plt.subplots(figsize=(7, 5), dpi=110)
    jobs = range(len(probabilities))
    ax.plot(jobs, probabilities, marker="o", label=f'p("{word}" as the first answer token)')
    ax.plot(jobs, any_case, marker="^",
            label=f'p(first answer token begins with "{word.lower()}", any case; top 20)')
    ax.plot(jobs, rewarded_fractions, marker="s",
            label=f'rewarded fraction of the {group} rollouts (answer begins with "{word}")')
    ax.set_title(f'temper RL demo: rewarding answers that begin with "{word}"\n'
                 f'Gemma 3 270M, LoRA, one training job per round through the HTTP API',
                 fontsize=10)
    ax.set_xlabel("training jobs completed (the checkpoint rolled out)")
    ax.set_ylabel("probability / fraction")
    ax.set_ylim(-0.02, 1.02)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    # Below the axes: the curves fill the plot's corners.
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.15), fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main():
    args = parse_args()
    started = time.monotonic()
    server = Server("--max-n", str(args.group))  # one request per group
    try:
        demo = Demo(server, args)
        print(f"question: {QUESTION!r}; reward 1 for answers beginning with {args.word!r}; "
              f"model {demo.name}, {args.group} rollouts per job, learning rate {args.lr:g}")
        print("| job | checkpoint | p(word first) | p(any case) | rewarded rollouts | loss | grad_norm | "
              "trainable tokens | job s |")
        print("|---|---|---|---|---|---|---|---|---|")
        probabilities, any_case, fractions, train_seconds = [], [], [], []
        step = 0
        for job in range(args.jobs + 1):
            p, p_any = demo.word_probability(step), demo.any_case_probability(step)
            choices = demo.rollouts(step, args.seed * 1000 + job)
            rewards = [1.0 if demo.rewarded(c) else 0.0 for c in choices]
            probabilities.append(p)
            any_case.append(p_any)
            fractions.append(sum(rewards) / len(rewards))
            if job == 0:
                print(f"first rollouts: {[c.message.content.strip() for c in choices]}", file=sys.stderr)
            row = f"| {job} | step {step} | {p:.4f} | {p_any:.4f} | {int(sum(rewards))}/{len(rewards)} |"
            if job == args.jobs:
                print(f"{row} (after the last job) | | | |")
                break
            steps, step, message, seconds = demo.train(choices, rewards)
            if steps:
                last = steps[-1]
                tokens = sum(s["num_trainable_tokens"] for s in steps)
                train_seconds.append(seconds)
                print(f"{row} {last['loss']:.4f} | {last['grad_norm']:.3f} | {tokens} | {seconds:.1f} |")
            else:
                print(f"{row} {message or 'no gradient step'} | | | {seconds:.1f} |")
        os.makedirs(os.path.dirname(os.path.abspath(args.png)), exist_ok=True)
        plot(args.png, args.word, probabilities, any_case, fractions, args.group)
        trained = len(train_seconds)
        print(f"training: {trained} jobs with a gradient step, {sum(train_seconds):.1f} s "
              f"({sum(train_seconds) / max(trained, 1):.1f} s per job, post to training_ended); "
              f"whole demo {time.monotonic() - started:.0f} s")
        print(f"plot: {args.png}")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
