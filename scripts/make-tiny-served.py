#!/usr/bin/env python3
"""Writes crates/http/tests/fixtures/tiny-qwen2-bpe.gguf: a Qwen2-shaped random model served end
to end by crates/http/tests/families.rs.

The weights are the tiny Qwen2 of crates/model/tests/fixtures (converted by llama.cpp from a
transformers model), its embedding widened to the byte-level BPE vocabulary of
crates/text/tests/fixtures/bpe/qwen2.* (600 tokens, Qwen's pre-tokenizer and special tokens),
with Qwen 2.5's chat template (as the GGUF files of Qwen 2.5 carry it). Beside it, the prompt a
conversation with tools renders to through transformers and its token ids through the Hugging
Face tokenizer, which temper's /tokenize must reproduce.

    ~/.cache/temper/train-ref-venv/bin/python scripts/make-tiny-served.py
"""

import json
from pathlib import Path

import gguf
import numpy as np
from tokenizers import Tokenizer
from transformers.utils.chat_template_utils import render_jinja_template

REPO = Path(__file__).resolve().parent.parent
MODEL = REPO / "crates/model/tests/fixtures/tiny-qwen2.gguf"
VOCAB = REPO / "crates/text/tests/fixtures/bpe/qwen2.gguf"
VOCAB_JSON = REPO / "crates/text/tests/fixtures/bpe/qwen2.tokenizer.json"
TEMPLATE = REPO / "crates/text/tests/fixtures/templates/qwen2.5.jinja"
OUT = REPO / "crates/http/tests/fixtures"

CONVERSATION = {
    "messages": [
        {"role": "system", "content": "You answer about the weather."},
        {"role": "user", "content": "Weather in Paris, 2 days? Answer briefly."},
    ],
    "tools": [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "The weather of a city.",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "city": {"type": "string", "maxLength": 12},
                        "days": {"type": "integer", "minimum": 1, "maximum": 7},
                    },
                    "required": ["city", "days"],
                    "additionalProperties": False,
                },
            },
        }
    ],
}


def field(reader, key):
    return reader.fields[key].contents()


def main():
    model = gguf.GGUFReader(MODEL)
    vocab = gguf.GGUFReader(VOCAB)
    tokens = field(vocab, "tokenizer.ggml.tokens")
    n_vocab = len(tokens)
    template = TEMPLATE.read_text()

    writer = gguf.GGUFWriter(OUT / "tiny-qwen2-bpe.gguf", "qwen2")
    for key, f in model.fields.items():
        if key.startswith(("GGUF.", "tokenizer.", "general.architecture")):
            continue
        value = f.contents()
        vtype = f.types[0]
        if key == "qwen2.context_length":
            value = 2048  # room for a prompt with tools (rope has no learned positions)
        if vtype == gguf.GGUFValueType.ARRAY:
            writer.add_array(key, value)
        else:
            writer.add_key_value(key, value, vtype)
    for key, f in vocab.fields.items():
        if key.startswith("tokenizer."):
            vtype = f.types[0]
            if vtype == gguf.GGUFValueType.ARRAY:
                writer.add_array(key, f.contents())
            else:
                writer.add_key_value(key, f.contents(), vtype)
    writer.add_chat_template(template)

    rng = np.random.default_rng(7)
    for t in model.tensors:
        data = np.array(t.data, dtype=np.float32).reshape([int(d) for d in reversed(t.shape)])
        if t.name == "token_embd.weight":
            extra = rng.normal(0.0, float(data.std()), (n_vocab - data.shape[0], data.shape[1]))
            data = np.concatenate([data, extra.astype(np.float32)])
        writer.add_tensor(t.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    prompt = render_jinja_template(
        conversations=[CONVERSATION["messages"]],
        tools=CONVERSATION["tools"],
        chat_template=template,
        add_generation_prompt=True,
        eos_token="<|im_end|>",
    )[0][0]
    ids = Tokenizer.from_file(str(VOCAB_JSON)).encode(prompt, add_special_tokens=False).ids
    expected = dict(CONVERSATION, prompt=prompt, prompt_ids=ids)
    (OUT / "tiny-qwen2-bpe.json").write_text(json.dumps(expected, indent=1) + "\n")
    print(f"{OUT}/tiny-qwen2-bpe.gguf: vocabulary {n_vocab}; prompt of {len(ids)} tokens")


if __name__ == "__main__":
    main()
