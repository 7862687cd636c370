"""Client suite with the official `openai` package against the real `temper serve` binary on the
default model (started once, on an ephemeral port, with an API key). Run by scripts/python-sdk-tests.sh
(which `make test` calls); it prints a cargo-style `test result:` line the Makefile sums.

With TEMPER_SUITE_MODEL=NAME=PATH and TEMPER_SUITE_FAMILY=FAMILY it runs against that model
instead: scripts/python-sdk-tests.sh --family FAMILY runs it on the tiny random model of that
family with the real tokenizer and chat template (scripts/tiny-served.sh). No assertion depends on
what the model knows; the family decides the tool-call format the template asks for (checked in
the raw output and in the rendered prompt) and whether Qwen3's `<think>` reasoning is tested."""

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import unittest
import urllib.request

import openai
from openai import OpenAI

KEY = "sdk-suite-key"
# The served model: the default one, or TEMPER_SUITE_MODEL=NAME=PATH (one of the tiny models of
# every family that scripts/tiny-served.sh writes, with TEMPER_SUITE_FAMILY naming its family).
SUITE_MODEL = os.environ.get("TEMPER_SUITE_MODEL")
MODEL = SUITE_MODEL.split("=", 1)[0] if SUITE_MODEL else "gemma-3-270m"
FAMILY = os.environ.get("TEMPER_SUITE_FAMILY", "default")
# How each family's template writes a call of get_weather(city="Paris", days=1) (the shipped Gemma 3
# template and Qwen's: Hermes tags; Llama 3.2's: the bare JSON answer with "parameters").
HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}\n</tool_call>'
# None: the family's template writes no calls back (SmolLM3's drops them; its content stays).
CALLS_RENDERED = {
    "default": HERMES_CALL, "gemma3": HERMES_CALL, "qwen2.5": HERMES_CALL, "qwen3": HERMES_CALL,
    "llama3": '{"name": "get_weather", "parameters": {"city": "Paris", "days": 1}}',
    # The id padded to the nine characters Mistral's template takes.
    "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}, "id": "000call_1"}]',
    "smollm3": None,
}
# The start of a generated call of get_weather in the family's format.
CALL_OPENERS = {
    "default": '<tool_call>\n{"name": "get_weather", "arguments": ',
    "llama3": '{"name": "get_weather", "parameters": ',
    "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": ',
}
THINKS = FAMILY == "qwen3"
BINARY = os.environ.get("TEMPER_BIN", os.path.join(os.path.dirname(__file__), "../../target/release/temper"))


class Server:
    """`temper serve` as a child process; stderr (the request log) is kept for the project test."""

    def __init__(self, *extra_args):
        self.data_dir = tempfile.TemporaryDirectory()
        env = dict(os.environ, RUST_LOG="info")
        env.pop("TEMPER_CONFIG", None)
        self.proc = subprocess.Popen(
            [BINARY, "serve", "--port", "0", "--api-key", KEY, "--data-dir", self.data_dir.name,
             *(["--model", SUITE_MODEL] if SUITE_MODEL else []), *extra_args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        self.log = []
        self._log_lock = threading.Lock()
        self._readers = [threading.Thread(target=self._drain_stderr, daemon=True)]
        self._readers[0].start()
        # First stdout line: "temper serving NAME at http://127.0.0.1:PORT/v1".
        first = self.proc.stdout.readline()
        urls = [w for w in first.split() if w.startswith("http://")]
        if not urls:
            self.proc.kill()
            raise RuntimeError(f"temper serve printed no URL: {first!r}")
        self.base_url = urls[0]
        self._readers.append(threading.Thread(target=lambda: self.proc.stdout.read(), daemon=True))
        self._readers[1].start()

    def _drain_stderr(self):
        for line in self.proc.stderr:
            with self._log_lock:
                self.log.append(line)

    def log_text(self):
        with self._log_lock:
            return "".join(self.log)

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        # The readers end at EOF once the process is gone; then the pipes are ours to close.
        for reader in self._readers:
            reader.join(timeout=10)
        self.proc.stdout.close()
        self.proc.stderr.close()
        self.data_dir.cleanup()


SERVER = None


def setUpModule():
    global SERVER
    SERVER = Server()


def tearDownModule():
    SERVER.stop()


def client(server=None, **kwargs):
    return OpenAI(base_url=(server or SERVER).base_url, api_key=kwargs.pop("api_key", KEY), max_retries=0,
                  timeout=120, **kwargs)


def ask(text):
    return [{"role": "user", "content": text}]


def post(server, path, body):
    """POST to one of the server's own (not /v1) routes: /tokenize, /detokenize."""
    root = server.base_url.removesuffix("/v1")
    req = urllib.request.Request(root + path, data=json.dumps(body).encode(), method="POST", headers={
        "Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def prompt_ids(server, messages, **kwargs):
    """The token ids `messages` render and tokenize to (/tokenize)."""
    return post(server, "/tokenize", {"model": MODEL, "messages": messages, **kwargs})["tokens"]


def text_ids(server, text):
    """The token ids of `text` alone, special and added tokens recognised (/tokenize)."""
    return post(server, "/tokenize", {"model": MODEL, "prompt": text, "add_special_tokens": False})["tokens"]


def renders_to(server, messages, expected, at_end=False, **kwargs):
    """Whether the prompt of `messages` holds `expected` (at its end with `at_end`), compared
    in token ids: /detokenize joins special tokens with spaces (as vLLM's slow-tokenizer
    decoding), so the text would not compare. Each `expected` here starts and ends at an added
    token or a line break, where the pre-tokenizer splits anyway."""
    ids, want = prompt_ids(server, messages, **kwargs), text_ids(server, expected)
    if at_end:
        return ids[-len(want):] == want
    return any(ids[i:i + len(want)] == want for i in range(len(ids) - len(want) + 1))


class Chat(unittest.TestCase):
    def test_chat_completion(self):
        r = client().chat.completions.create(model=MODEL, messages=ask("Say hello."), max_tokens=8,
                                             temperature=0)
        self.assertEqual(r.object, "chat.completion")
        self.assertEqual(len(r.choices), 1)
        choice = r.choices[0]
        self.assertEqual(choice.message.role, "assistant")
        self.assertTrue(choice.message.content)
        self.assertIn(choice.finish_reason, ("stop", "length"))
        self.assertGreater(r.usage.prompt_tokens, 0)
        self.assertTrue(1 <= r.usage.completion_tokens <= 8)
        self.assertEqual(r.usage.total_tokens, r.usage.prompt_tokens + r.usage.completion_tokens)

    def test_stream_with_usage_equals_the_whole_answer(self):
        c = client()
        whole = c.chat.completions.create(model=MODEL, messages=ask("Count to five."), max_tokens=12,
                                          temperature=0)
        chunks = list(c.chat.completions.create(
            model=MODEL, messages=ask("Count to five."), max_tokens=12, temperature=0, stream=True,
            stream_options={"include_usage": True}))
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        self.assertEqual(text, whole.choices[0].message.content)
        finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
        self.assertEqual(finishes, [whole.choices[0].finish_reason])
        # include_usage: the last chunk carries usage and no choices; the others carry none.
        self.assertEqual(chunks[-1].choices, [])
        self.assertEqual(chunks[-1].usage.completion_tokens, whole.usage.completion_tokens)
        self.assertEqual(chunks[-1].usage.prompt_tokens, whole.usage.prompt_tokens)
        self.assertTrue(all(ch.usage is None for ch in chunks[:-1]))
        self.assertEqual({ch.id for ch in chunks}, {chunks[0].id})

    def test_n_choices(self):
        r = client().chat.completions.create(model=MODEL, messages=ask("Name a colour."), n=3,
                                             max_tokens=6, temperature=1.0, seed=7, logprobs=True)
        self.assertEqual([c.index for c in r.choices], [0, 1, 2])
        self.assertTrue(all(c.message.content is not None for c in r.choices))
        # Usage counts every choice's tokens.
        self.assertEqual(r.usage.completion_tokens, sum(len(c.logprobs.content) for c in r.choices))

    def test_logprobs_and_top_logprobs(self):
        r = client().chat.completions.create(model=MODEL, messages=ask("Say hello."), max_tokens=6,
                                             temperature=0, logprobs=True, top_logprobs=3)
        content = r.choices[0].logprobs.content
        self.assertEqual(len(content), r.usage.completion_tokens)
        self.assertEqual("".join(t.token for t in content), r.choices[0].message.content)
        for t in content:
            self.assertLessEqual(t.logprob, 0.0)
            self.assertEqual(len(t.top_logprobs), 3)
            tops = [x.logprob for x in t.top_logprobs]
            self.assertEqual(tops, sorted(tops, reverse=True))
            # Greedy: the chosen token is the most likely one.
            self.assertAlmostEqual(t.logprob, tops[0], places=5)
            self.assertEqual(t.token, t.top_logprobs[0].token)


class Completions(unittest.TestCase):
    """The legacy `client.completions.create` (`POST /v1/completions`), in vLLM's shape."""

    PROMPT = "The river runs"

    def _check(self, r, choices=1):
        self.assertEqual(r.object, "text_completion")
        self.assertTrue(r.id.startswith("cmpl-"))
        self.assertEqual(r.model, MODEL)
        self.assertEqual([c.index for c in r.choices], list(range(choices)))
        for c in r.choices:
            self.assertIsInstance(c.text, str)
            self.assertIn(c.finish_reason, ("stop", "length"))
        self.assertEqual(r.usage.total_tokens, r.usage.prompt_tokens + r.usage.completion_tokens)

    def test_string_prompt(self):
        r = client().completions.create(model=MODEL, prompt=self.PROMPT, max_tokens=8, temperature=0)
        self._check(r)
        self.assertIsNone(r.choices[0].logprobs)
        self.assertTrue(1 <= r.usage.completion_tokens <= 8)
        # The prompt's tokens are /tokenize's (special tokens added, as vLLM does by default).
        ids = post(SERVER, "/tokenize", {"model": MODEL, "prompt": self.PROMPT})["tokens"]
        self.assertEqual(r.usage.prompt_tokens, len(ids))

    def test_token_ids_prompt_equals_its_text(self):
        c = client()
        ids = post(SERVER, "/tokenize", {"model": MODEL, "prompt": self.PROMPT})["tokens"]
        text = c.completions.create(model=MODEL, prompt=self.PROMPT, max_tokens=6, temperature=0,
                                    extra_body={"return_token_ids": True})
        tokens = c.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0,
                                      extra_body={"return_token_ids": True})
        self._check(tokens)
        self.assertEqual(tokens.choices[0].text, text.choices[0].text)
        for r in (text, tokens):
            choice = r.choices[0].model_dump()
            self.assertEqual(choice["prompt_token_ids"], ids)
            self.assertEqual(len(choice["token_ids"]), r.usage.completion_tokens)
        # A list of token lists: one choice set per prompt.
        both = c.completions.create(model=MODEL, prompt=[ids, ids[:-1]], max_tokens=3, temperature=0)
        self._check(both, choices=2)
        self.assertEqual(both.usage.prompt_tokens, 2 * len(ids) - 1)

    def test_echo_with_logprobs(self):
        r = client().completions.create(model=MODEL, prompt=self.PROMPT, max_tokens=4, temperature=0,
                                        echo=True, logprobs=2)
        self._check(r)
        choice = r.choices[0]
        self.assertTrue(choice.text.startswith(self.PROMPT), choice.text)
        lp = choice.logprobs
        n = r.usage.prompt_tokens + r.usage.completion_tokens
        self.assertEqual([len(lp.tokens), len(lp.token_logprobs), len(lp.top_logprobs),
                          len(lp.text_offset)], [n] * 4)
        # The prompt's first token has nothing to be predicted from.
        self.assertIsNone(lp.token_logprobs[0])
        self.assertIsNone(lp.top_logprobs[0])
        for token, logprob, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
            self.assertLessEqual(logprob, 0.0)
            # {token: logprob}: the position's own token, plus up to 2 alternatives.
            self.assertIn(token, top)
            self.assertEqual(top[token], logprob)
            self.assertLessEqual(len(top), 3)
        self.assertEqual(lp.text_offset, sorted(lp.text_offset))
        # max_tokens 0 with echo: the prompt scored, nothing generated.
        scored = client().completions.create(model=MODEL, prompt=self.PROMPT, max_tokens=0, echo=True,
                                             logprobs=0)
        self.assertEqual(scored.choices[0].text, self.PROMPT)
        self.assertEqual(scored.usage.completion_tokens, 0)
        self.assertEqual(scored.choices[0].logprobs.token_logprobs,
                         lp.token_logprobs[:r.usage.prompt_tokens])

    def test_stream_equals_the_whole_answer(self):
        c = client()
        kwargs = dict(model=MODEL, prompt=[self.PROMPT, "Once upon"], n=2, max_tokens=6,
                      temperature=1.0, seed=9, logprobs=1)
        whole = c.completions.create(**kwargs)
        self._check(whole, choices=4)
        chunks = list(c.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
        self.assertTrue(all(ch.object == "text_completion" for ch in chunks))
        self.assertEqual({ch.id for ch in chunks}, {chunks[0].id})
        texts, tokens, finishes = ["" for _ in range(4)], [[] for _ in range(4)], [[] for _ in range(4)]
        for ch in chunks[:-1]:
            self.assertEqual(len(ch.choices), 1)
            choice = ch.choices[0]
            texts[choice.index] += choice.text
            if choice.logprobs:
                tokens[choice.index] += choice.logprobs.tokens
            if choice.finish_reason:
                finishes[choice.index].append(choice.finish_reason)
        for i, choice in enumerate(whole.choices):
            self.assertEqual(texts[i], choice.text)
            self.assertEqual(tokens[i], choice.logprobs.tokens)
            self.assertEqual(finishes[i], [choice.finish_reason])
        self.assertEqual(chunks[-1].choices, [])
        self.assertEqual(chunks[-1].usage.completion_tokens, whole.usage.completion_tokens)
        self.assertEqual(chunks[-1].usage.prompt_tokens, whole.usage.prompt_tokens)

    def test_n_and_best_of(self):
        r = client().completions.create(model=MODEL, prompt=self.PROMPT, n=3, max_tokens=5,
                                        temperature=1.0, seed=3)
        self._check(r, choices=3)
        best = client().completions.create(model=MODEL, prompt=self.PROMPT, n=2, best_of=3, max_tokens=5,
                                           temperature=1.0, seed=3, logprobs=0)
        self._check(best, choices=2)
        # The best 2 of the same 3 samples (choice i is seeded with seed + i), best first.
        sums = [sum(c.logprobs.token_logprobs) for c in best.choices]
        self.assertGreaterEqual(sums[0], sums[1])
        self.assertTrue({c.text for c in best.choices} <= {c.text for c in r.choices})
        # Every generated sample counts.
        self.assertEqual(best.usage.completion_tokens, r.usage.completion_tokens)

    def test_refused_fields_are_bad_requests_naming_them(self):
        for kwargs, param in [({"suffix": "end"}, "suffix"), ({"logprobs": 21}, "logprobs"),
                              ({"best_of": 1, "n": 2, "temperature": 1.0}, "best_of"),
                              ({"prompt": ""}, "prompt")]:
            args = {"model": MODEL, "prompt": self.PROMPT, "max_tokens": 2, **kwargs}
            with self.assertRaises(openai.BadRequestError) as e:
                client().completions.create(**args)
            self.assertEqual(e.exception.body.get("param"), param, kwargs)


class Errors(unittest.TestCase):
    def test_wrong_key_is_authentication_error(self):
        with self.assertRaises(openai.AuthenticationError) as e:
            client(api_key="not-the-key").chat.completions.create(model=MODEL, messages=ask("hi"), max_tokens=1)
        self.assertEqual(e.exception.status_code, 401)

    def test_bad_parameter_is_bad_request_naming_it(self):
        with self.assertRaises(openai.BadRequestError) as e:
            client().chat.completions.create(model=MODEL, messages=ask("hi"), max_tokens=1, temperature=-1)
        self.assertEqual(e.exception.status_code, 400)
        self.assertEqual(e.exception.body.get("param"), "temperature")

    def test_unknown_model_is_not_found(self):
        with self.assertRaises(openai.NotFoundError) as e:
            client().chat.completions.create(model="no-such-model", messages=ask("hi"), max_tokens=1)
        self.assertEqual(e.exception.status_code, 404)


class Project(unittest.TestCase):
    def test_malformed_project_reaches_the_server_as_a_400(self):
        with self.assertRaises(openai.BadRequestError) as e:
            client(project="no slash here").chat.completions.create(model=MODEL, messages=ask("hi"), max_tokens=1)
        self.assertEqual(e.exception.body.get("param"), "OpenAI-Project")

    def test_another_teams_project_is_a_400(self):
        # The suite's key is the command line's, of team `default`.
        with self.assertRaises(openai.BadRequestError) as e:
            client(project="research/agents").chat.completions.create(model=MODEL, messages=ask("hi"), max_tokens=1)
        self.assertEqual(e.exception.body.get("param"), "OpenAI-Project")

    def test_project_appears_in_the_request_log_and_its_usage(self):
        name = f"sdkproj{os.getpid()}"
        r = client(project=f"default/{name}").chat.completions.create(model=MODEL, messages=ask("hi"), max_tokens=1)
        deadline = time.time() + 10
        while name not in SERVER.log_text() and time.time() < deadline:
            time.sleep(0.1)
        self.assertIn(name, SERVER.log_text())
        # GET /v1/usage through the SDK's raw request method.
        page = client().get(f"/usage?start={int(time.time()) - 3600}&bucket_width=1h&group_by=project",
                            cast_to=object)
        mine = [res for b in page["data"] for res in b["results"] if res["project_id"] == name]
        self.assertEqual(len(mine), 1, page)
        self.assertEqual((mine[0]["input_tokens"], mine[0]["output_tokens"], mine[0]["num_model_requests"]),
                         (r.usage.prompt_tokens, r.usage.completion_tokens, 1))


class ExtraBody(unittest.TestCase):
    def test_return_token_ids(self):
        r = client().chat.completions.create(model=MODEL, messages=ask("Say hello."), max_tokens=5,
                                             temperature=0, logprobs=True,
                                             extra_body={"return_token_ids": True})
        body = r.model_dump()
        self.assertEqual(len(body["prompt_token_ids"]), r.usage.prompt_tokens)
        ids = body["choices"][0]["token_ids"]
        self.assertEqual(len(ids), r.usage.completion_tokens)
        self.assertTrue(all(isinstance(i, int) for i in ids))

    def test_prompt_logprobs(self):
        r = client().chat.completions.create(model=MODEL, messages=ask("Say hello."), max_tokens=2,
                                             temperature=0,
                                             extra_body={"prompt_logprobs": 2, "return_token_ids": True})
        body = r.model_dump()
        prompt, entries = body["prompt_token_ids"], body["prompt_logprobs"]
        self.assertEqual(len(entries), r.usage.prompt_tokens)
        self.assertIsNone(entries[0])
        for token, entry in zip(prompt[1:], entries[1:]):
            keys = list(entry)
            # The prompt's own token leads; then the top 2 without it.
            self.assertEqual(keys[0], str(token))
            self.assertIn(len(keys), (2, 3))
            top = [entry[k] for k in keys[1:]]
            self.assertEqual([t["rank"] for t in top], sorted(t["rank"] for t in top))
            self.assertTrue(all(t["logprob"] <= 0 and t["rank"] >= 1 for t in entry.values()))
        self._refused({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs")

    def test_use_beam_search(self):
        r = client().chat.completions.create(model=MODEL, messages=ask("Name a colour."), max_tokens=6,
                                             n=2, temperature=0, logprobs=True,
                                             extra_body={"use_beam_search": True, "return_token_ids": True,
                                                         "include_stop_str_in_output": True})
        self.assertEqual([c.index for c in r.choices], [0, 1])
        ids = [c.model_dump()["token_ids"] for c in r.choices]
        self.assertNotEqual(ids[0], ids[1])
        self.assertEqual(r.usage.completion_tokens, len(ids[0]) + len(ids[1]))

        def score(c):
            # vLLM's length_penalty 1: the prompt counts in the length, a final end token
            # (returned here with include_stop_str_in_output) only in the logprob sum.
            n = len(c.model_dump()["token_ids"]) - (c.finish_reason == "stop")
            return sum(t.logprob for t in c.logprobs.content) / (r.usage.prompt_tokens + n)

        self.assertGreaterEqual(score(r.choices[0]), score(r.choices[1]) - 1e-5)
        self._refused({"use_beam_search": True, "n": 2, "temperature": 0, "top_p": 0.5}, "top_p")
        self._refused({"use_beam_search": True, "n": 2, "temperature": 0.5}, "temperature")

    def test_priority_needs_priority_scheduling(self):
        # The suite's server runs the default `--scheduling fcfs`.
        self._refused({"priority": 2}, "priority")
        r = client().chat.completions.create(model=MODEL, messages=ask("hi"), max_tokens=1,
                                             extra_body={"priority": 0})
        self.assertEqual(len(r.choices), 1)

    def _refused(self, extra, param):
        with self.assertRaises(openai.BadRequestError) as e:
            client().chat.completions.create(model=MODEL, messages=ask("hi"), max_tokens=2, extra_body=extra)
        self.assertEqual(e.exception.body.get("param"), param)


class PriorityScheduling(unittest.TestCase):
    """A second server, started with `--scheduling priority`, takes a non-zero priority."""

    def test_priority_is_accepted(self):
        server = Server("--scheduling", "priority", "--max-running", "1")
        try:
            r = client(server).chat.completions.create(model=MODEL, messages=ask("hi"), max_tokens=2,
                                                       extra_body={"priority": -5})
            self.assertEqual(len(r.choices), 1)
        finally:
            server.stop()


class StructuredOutputs(unittest.TestCase):
    SCHEMA = {"type": "object",
              "properties": {"name": {"type": "string", "maxLength": 20},
                             "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}

    def test_response_format_json_schema(self):
        r = client().chat.completions.create(
            model=MODEL, messages=ask("Describe a person as JSON."), max_tokens=80, temperature=1.0,
            seed=3, n=2,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "person", "schema": self.SCHEMA, "strict": True}})
        for choice in r.choices:
            self.assertEqual(choice.finish_reason, "stop")
            person = json.loads(choice.message.content)
            self.assertEqual(sorted(person), ["age", "name"])
            self.assertTrue(0 <= person["age"] <= 120)

    def test_structured_outputs_choice_through_extra_body(self):
        r = client().chat.completions.create(
            model=MODEL, messages=ask("Is the sky blue?"), max_tokens=5, temperature=1.0, n=3,
            extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
        for choice in r.choices:
            self.assertIn(choice.message.content, ("yes", "no"))

    def test_invalid_regex_is_bad_request_naming_it(self):
        with self.assertRaises(openai.BadRequestError) as e:
            client().chat.completions.create(model=MODEL, messages=ask("hi"), max_tokens=2,
                                             extra_body={"structured_outputs": {"regex": "(unclosed"}})
        self.assertEqual(e.exception.body.get("param"), "structured_outputs.regex")


WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city.",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "maxLength": 20},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}]


class ToolCalls(unittest.TestCase):
    """A second server, started with `--enable-tool-calls`, serves tool_choice other than "none"."""

    @classmethod
    def setUpClass(cls):
        cls.server = Server("--enable-tool-calls")

    @classmethod
    def tearDownClass(cls):
        cls.server.stop()

    def _check(self, call):
        if FAMILY == "mistral":  # the nine alphanumeric characters Mistral's template takes back
            self.assertRegex(call.id, r"^[0-9a-zA-Z]{9}$")
        else:
            self.assertTrue(call.id.startswith("chatcmpl-tool-"))
        self.assertEqual(call.type, "function")
        self.assertEqual(call.function.name, "get_weather")
        args = json.loads(call.function.arguments)
        self.assertEqual(sorted(args), ["city", "days"])
        self.assertTrue(1 <= args["days"] <= 7)
        return call.function.name, call.function.arguments

    def test_required_tool_call(self):
        r = client(self.server).chat.completions.create(
            model=MODEL, messages=ask("What is the weather in Paris?"), max_tokens=100, temperature=0,
            tools=WEATHER, tool_choice="required", parallel_tool_calls=False)
        choice = r.choices[0]
        self.assertEqual(choice.finish_reason, "tool_calls")
        self.assertIsNone(choice.message.content)
        self.assertEqual(len(choice.message.tool_calls), 1)
        self._check(choice.message.tool_calls[0])

    def test_named_function_streamed_equals_whole(self):
        kwargs = dict(model=MODEL, messages=ask("Weather in Rome for three days?"), max_tokens=100,
                      temperature=1.0, seed=4, tools=WEATHER, parallel_tool_calls=False,
                      tool_choice={"type": "function", "function": {"name": "get_weather"}})
        whole = client(self.server).chat.completions.create(**kwargs)
        calls = [self._check(c) for c in whole.choices[0].message.tool_calls]
        self.assertEqual(len(calls), 1)
        # Accumulate the deltas as OpenAI's own streaming helpers do.
        streamed, finish = {}, None
        for chunk in client(self.server).chat.completions.create(stream=True, **kwargs):
            for choice in chunk.choices:
                for d in choice.delta.tool_calls or []:
                    if d.index not in streamed:
                        streamed[d.index] = [d.function.name, ""]
                    streamed[d.index][1] += d.function.arguments or ""
                finish = choice.finish_reason or finish
        self.assertEqual([tuple(v) for _, v in sorted(streamed.items())], calls)
        self.assertEqual(finish, "tool_calls")

    def test_conversation_with_a_tool_result(self):
        messages = ask("Weather in Paris?") + [
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 24 C."}]
        r = client(self.server).chat.completions.create(model=MODEL, messages=messages, max_tokens=20,
                                                        temperature=0, tools=WEATHER, tool_choice="auto")
        self.assertIn(r.choices[0].finish_reason, ("stop", "length", "tool_calls"))

    def test_calls_are_written_in_the_family_format(self):
        # The raw output of a required call (its token ids, detokenized) is the template's format.
        r = client(self.server).chat.completions.create(
            model=MODEL, messages=ask("What is the weather in Paris?"), max_tokens=100, temperature=0,
            tools=WEATHER, tool_choice="required", parallel_tool_calls=False,
            extra_body={"return_token_ids": True})
        self._check(r.choices[0].message.tool_calls[0])
        ids = r.choices[0].model_dump()["token_ids"]
        raw = post(self.server, "/detokenize", {"model": MODEL, "tokens": ids})["prompt"]
        opener = CALL_OPENERS.get(FAMILY, CALL_OPENERS["default"])
        self.assertTrue(raw.startswith(opener), raw)

    @unittest.skipIf(CALLS_RENDERED.get(FAMILY, HERMES_CALL) is None,
                     "the family's template writes no calls back")
    def test_a_call_in_the_history_renders_in_the_family_format(self):
        messages = ask("Weather in Paris?") + [
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 24 C."}]
        self.assertTrue(renders_to(self.server, messages, CALLS_RENDERED[FAMILY], tools=WEATHER))

    def test_unknown_function_is_bad_request(self):
        with self.assertRaises(openai.BadRequestError) as e:
            client(self.server).chat.completions.create(
                model=MODEL, messages=ask("hi"), max_tokens=2, tools=WEATHER,
                tool_choice={"type": "function", "function": {"name": "nope"}})
        self.assertEqual(e.exception.body.get("param"), "tool_choice")

    def test_without_the_flag_only_none_is_served(self):
        with self.assertRaises(openai.BadRequestError) as e:
            client().chat.completions.create(model=MODEL, messages=ask("hi"), max_tokens=2,
                                             tools=WEATHER, tool_choice="required")
        self.assertEqual(e.exception.body.get("param"), "tool_choice")
        self.assertIn("--enable-tool-calls", e.exception.body.get("message"))


@unittest.skipUnless(THINKS, "only Qwen3's template writes <think> reasoning")
class Reasoning(unittest.TestCase):
    """Qwen3's template marks thinking: output opening with <think> is split into `reasoning`."""

    # A random model thinks only when made to: the regex makes the output a think block, then text.
    FORCED = {"structured_outputs": {"regex": "<think>\n[a-z]{3,8}\n</think>\n\n[a-z]{3,8}"}}

    def test_reasoning_is_split_from_the_content(self):
        r = client().chat.completions.create(model=MODEL, messages=ask("Think, then answer."),
                                             max_tokens=40, temperature=1.0, seed=5,
                                             extra_body=self.FORCED)
        message = r.choices[0].message
        self.assertEqual(r.choices[0].finish_reason, "stop")
        reasoning = message.model_extra.get("reasoning")
        self.assertRegex(reasoning or "", r"^\n?[a-z]{3,8}\n?$")
        # What follows </think> is content as generated (vLLM's Qwen3 parser strips nothing).
        self.assertRegex(message.content, r"^\n\n[a-z]{3,8}$")

    def test_streamed_reasoning_equals_the_whole(self):
        kwargs = dict(model=MODEL, messages=ask("Think, then answer."), max_tokens=40,
                      temperature=1.0, seed=6, extra_body=self.FORCED)
        whole = client().chat.completions.create(**kwargs).choices[0].message
        reasoning, content = "", ""
        for chunk in client().chat.completions.create(stream=True, **kwargs):
            for choice in chunk.choices:
                reasoning += (choice.delta.model_extra or {}).get("reasoning") or ""
                content += choice.delta.content or ""
        self.assertEqual((reasoning, content), (whole.model_extra["reasoning"], whole.content))

    def test_include_reasoning_false_drops_it(self):
        r = client().chat.completions.create(model=MODEL, messages=ask("Think, then answer."),
                                             max_tokens=40, temperature=1.0, seed=5,
                                             extra_body={**self.FORCED, "include_reasoning": False})
        self.assertIsNone(r.choices[0].message.model_extra.get("reasoning"))
        self.assertRegex(r.choices[0].message.content, r"^\n\n[a-z]{3,8}$")

    def test_enable_thinking_false_closes_the_think_block_in_the_prompt(self):
        closed = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
        self.assertTrue(renders_to(SERVER, ask("hi"), "<|im_start|>assistant\n", at_end=True))
        self.assertFalse(renders_to(SERVER, ask("hi"), closed, at_end=True))
        self.assertTrue(renders_to(SERVER, ask("hi"), closed, at_end=True,
                                   chat_template_kwargs={"enable_thinking": False}))
        # Output after a closed think block is all content.
        r = client().chat.completions.create(model=MODEL, messages=ask("hi"), max_tokens=4,
                                             extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        self.assertIsNone(r.choices[0].message.model_extra.get("reasoning"))

    def test_reasoning_sent_back_renders_in_the_prompt(self):
        # An agent sends the assistant turn back as it got it (`reasoning`; older clients call it
        # `reasoning_content`): Qwen3's template renders it in the turn after the last user message.
        for field in ("reasoning", "reasoning_content"):
            messages = ask("Weather in Paris?") + [
                {"role": "assistant", "content": None, field: "I should call the tool.", "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "Sunny."}]
            self.assertTrue(renders_to(
                SERVER, messages, "<|im_start|>assistant\n<think>\nI should call the tool.\n</think>\n\n",
                tools=WEATHER), field)


if __name__ == "__main__":
    result = unittest.main(exit=False, verbosity=2).result
    failed = len(result.failures) + len(result.errors)
    passed = result.testsRun - failed - len(result.skipped)
    status = "ok" if failed == 0 else "FAILED"
    # Same shape as cargo's line, so the Makefile's summary sums it.
    print(f"test result: {status}. {passed} passed; {failed} failed; {len(result.skipped)} ignored (python openai SDK{'' if FAMILY == 'default' else ', ' + FAMILY})")
    sys.exit(0 if failed == 0 else 1)
