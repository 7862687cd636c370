#!/usr/bin/env python3
"""Writes the chat-template parity fixtures of crates/text/tests/template_parity.rs.

For each family's chat template (as llama.cpp ships them, copied from the Hugging Face
repositories) and a set of conversations (tools, tool calls and results, multi-turn, no
generation prompt, a continued final message), the text transformers' `apply_chat_template`
renders (its `render_jinja_template`, which `apply_chat_template` calls). The Rust test renders
the same inputs with temper's `ChatTemplate` and must get the same text.

Run with the reference venv (transformers): scripts/template-parity.py LLAMA_CPP_DIR
(LLAMA_CPP_DIR: a llama.cpp source tree, for models/templates/).
"""

import json
import pathlib
import shutil
import sys

from transformers.utils.chat_template_utils import render_jinja_template

OUT = pathlib.Path(__file__).resolve().parent.parent / "crates/text/tests/fixtures/templates"

# name -> (llama.cpp template file, bos_token, eos_token)
TEMPLATES = {
    "qwen2.5": ("Qwen-Qwen2.5-7B-Instruct.jinja", None, "<|im_end|>"),
    "qwen3": ("Qwen-Qwen3-0.6B.jinja", None, "<|im_end|>"),
    "llama3.1": ("meta-llama-Llama-3.1-8B-Instruct.jinja", "<|begin_of_text|>", "<|eot_id|>"),
    "llama3.2": ("meta-llama-Llama-3.2-3B-Instruct.jinja", "<|begin_of_text|>", "<|eot_id|>"),
    "smollm3": ("HuggingFaceTB-SmolLM3-3B.jinja", None, "<|im_end|>"),
    "mistral-nemo": ("mistralai-Mistral-Nemo-Instruct-2407.jinja", "<s>", "</s>"),
}

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "City name"}},
            "required": ["city"],
        },
    },
}

CALL = {
    "id": "call9abc1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}

# Messages as the OpenAI API carries them (arguments as JSON text); kwargs as
# chat_template_kwargs. A fixed date keeps Llama 3.x's system header stable.
KWARGS = {"date_string": "26 Jul 2024"}
CASES = [
    {
        "name": "system_and_user",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is 2+2?"},
        ],
    },
    {
        "name": "multi_turn",
        "messages": [
            {"role": "user", "content": "Hi!"},
            {"role": "assistant", "content": "Hello. How can I help?"},
            {"role": "user", "content": "Name a colour.\nJust one."},
        ],
    },
    {
        "name": "no_generation_prompt",
        "add_generation_prompt": False,
        "messages": [
            {"role": "user", "content": "Hi!"},
            {"role": "assistant", "content": "Hello."},
        ],
    },
    {
        "name": "tools_offered",
        "tools": [WEATHER],
        "messages": [
            {"role": "system", "content": "You help with travel."},
            {"role": "user", "content": "Weather in Paris?"},
        ],
    },
    {
        "name": "tool_round",
        "tools": [WEATHER],
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "call9abc1", "content": "18 C, sunny"},
        ],
    },
    {
        "name": "tool_round_empty_content",
        "tools": [WEATHER],
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "call9abc1", "content": "18 C, sunny"},
        ],
    },
    {
        "name": "continue_final_message",
        "add_generation_prompt": False,
        "continue_final_message": True,
        "messages": [
            {"role": "user", "content": "Count to five."},
            {"role": "assistant", "content": "One, two,"},
        ],
    },
    {
        "name": "thinking_off",
        "kwargs": {"enable_thinking": False},
        "messages": [{"role": "user", "content": "Quick: capital of France?"}],
    },
]


def template_view(messages):
    """Messages as temper (and vLLM) hand them to templates: tool-call arguments parsed into
    dicts, and a tool-call message's null content an empty string."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            if m.get("content") is None:
                m["content"] = ""
            calls = []
            for c in m["tool_calls"]:
                c = json.loads(json.dumps(c))
                c["function"]["arguments"] = json.loads(c["function"]["arguments"])
                calls.append(c)
            m["tool_calls"] = calls
        out.append(m)
    return out


def main():
    templates_dir = pathlib.Path(sys.argv[1]) / "models" / "templates"
    OUT.mkdir(parents=True, exist_ok=True)
    fixtures = []
    for name, (file, bos, eos) in TEMPLATES.items():
        source = (templates_dir / file).read_text()
        shutil.copy(templates_dir / file, OUT / f"{name}.jinja")
        for case in CASES:
            kwargs = dict(KWARGS, **case.get("kwargs", {}))
            add_generation_prompt = case.get("add_generation_prompt", True)
            continue_final_message = case.get("continue_final_message", False)
            try:
                expected = render_jinja_template(
                    conversations=[template_view(case["messages"])],
                    tools=case.get("tools"),
                    chat_template=source,
                    add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final_message,
                    bos_token=bos,
                    eos_token=eos,
                    **kwargs,
                )[0][0]
                error = None
            except Exception as e:  # the template refuses the case (raise_exception)
                expected, error = None, str(e)
            fixtures.append(
                {
                    "template": name,
                    "bos_token": bos,
                    "eos_token": eos,
                    "case": case["name"],
                    "messages": case["messages"],
                    "tools": case.get("tools"),
                    "kwargs": kwargs,
                    "add_generation_prompt": add_generation_prompt,
                    "continue_final_message": continue_final_message,
                    "expected": expected,
                    "error": error,
                }
            )
    (OUT / "cases.json").write_text(json.dumps(fixtures, indent=1, ensure_ascii=False) + "\n")
    rendered = sum(f["expected"] is not None for f in fixtures)
    print(f"{len(fixtures)} cases ({rendered} rendered, {len(fixtures) - rendered} refused) in {OUT}")


if __name__ == "__main__":
    main()
