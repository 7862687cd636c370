#!/usr/bin/env python3
"""Writes crates/http/tests/fixtures/tiny-qwen2-bpe.gguf: a Qwen2-shaped random model served end
to end by crates/http/tests/families.rs; with --families DIR, the tiny served models of every
family with the real tokenizers instead (below).

The weights are the tiny Qwen2 of crates/model/tests/fixtures (converted by llama.cpp from a
transformers model), its embedding widened to the byte-level BPE vocabulary of
crates/text/tests/fixtures/bpe/qwen2.* (600 tokens, Qwen's pre-tokenizer and special tokens),
with Qwen 2.5's chat template (as the GGUF files of Qwen 2.5 carry it). Beside it, the prompt a
conversation with tools renders to through transformers and its token ids through the Hugging
Face tokenizer, which temper's /tokenize must reproduce.

    ~/.cache/temper/train-ref-venv/bin/python scripts/make-tiny-served.py

--families DIR (scripts/tiny-served.sh runs it into $TEMPER_HOME/tiny-served, for the client
suites of `make test` on every family): the same widening of the tiny models of
crates/model/tests/fixtures (width 64) to a real vocabulary, with its real chat template, one
file per family:

    llama3.gguf   tiny-llama (llama), the Llama 3 vocabulary (128256) and Llama 3.2's template
                  (scripts/real-tokenizers.sh's llama3.gguf)
    qwen3.gguf    tiny-qwen3 (qwen3), the Qwen vocabulary (151936) and Qwen3's template, thinking
                  included (its qwen.gguf)
    qwen2.5.gguf  tiny-qwen2 (qwen2), the same vocabulary (Qwen3's added tokens, a superset of
                  Qwen 2.5's) and Qwen 2.5's template
    gemma3.gguf   tiny-gemma3 (gemma3), the default model's tokenizer (262144 pieces) and, like
                  that file, no template (temper serves the shipped Gemma 3 one)
    mistral.gguf  tiny-mistral (llama, as llama.cpp converts Mistral), the Llama 3 vocabulary
                  with reserved special tokens renamed to Mistral's control tokens (<s>, </s>,
                  [INST], [/INST], [TOOL_CALLS], [AVAILABLE_TOOLS], ...; BOS <s>, EOS </s>, as
                  Mistral Nemo's tiktoken-style vocabulary has them) and Mistral Nemo's template
    smollm3.gguf  tiny-smollm3 (smollm3), the Llama 3 vocabulary SmolLM3's is built on, reserved
                  special tokens renamed to <|im_start|>, <|im_end|>, <think>, </think> (EOS
                  <|im_end|>, no BOS) and SmolLM3's template (Unsloth's, as its GGUFs carry it)

No hub is reachable here: Mistral's and SmolLM3's own vocabularies are not on the package
index, so those two stand on the Llama 3 one (the same tiktoken-style BPE family) with their
control tokens where the real files have them as control tokens too.

The added embedding rows (and output rows of an untied head) are F16, which halves the files
(16-34 MB each).
"""

import argparse
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


def write_served(model_path, vocab_path, template, out_path, context_length, seed=7, dtype=np.float32,
                 specials=None):
    """The tiny model of `model_path` with the tokenizer of `vocab_path` and `template` (None: no
    template): its embedding (and an untied output head) widened to the vocabulary with random
    rows of the same spread. `specials` (a Specials) renames reserved tokens to control tokens
    and sets BOS/EOS. Returns the vocabulary size."""
    model = gguf.GGUFReader(model_path)
    vocab = gguf.GGUFReader(vocab_path)
    tokens = field(vocab, "tokenizer.ggml.tokens")
    n_vocab = len(tokens)
    overrides = specials.overrides(vocab) if specials else {}
    arch = field(model, "general.architecture")

    writer = gguf.GGUFWriter(out_path, arch)
    for key, f in model.fields.items():
        if key.startswith(("GGUF.", "tokenizer.", "general.architecture")):
            continue
        value = f.contents()
        vtype = f.types[0]
        if key == f"{arch}.context_length":
            value = context_length  # room for a prompt with tools (rope has no learned positions)
        if key == f"{arch}.vocab_size":
            value = n_vocab
        if vtype == gguf.GGUFValueType.ARRAY:
            writer.add_array(key, value)
        else:
            writer.add_key_value(key, value, vtype)
    for key, f in vocab.fields.items():
        if key.startswith("tokenizer.") and key != "tokenizer.chat_template":
            vtype = f.types[0]
            value = overrides.get(key, f.contents())
            if vtype == gguf.GGUFValueType.ARRAY:
                writer.add_array(key, value)
            else:
                writer.add_key_value(key, value, vtype)
    if template is not None:
        writer.add_chat_template(template)

    rng = np.random.default_rng(seed)
    for t in model.tensors:
        data = np.array(t.data, dtype=np.float32).reshape([int(d) for d in reversed(t.shape)])
        if t.name in ("token_embd.weight", "output.weight"):
            extra = rng.normal(0.0, float(data.std()), (n_vocab - data.shape[0], data.shape[1]))
            data = np.concatenate([data, extra.astype(np.float32)]).astype(dtype)
        writer.add_tensor(t.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return n_vocab


class Specials:
    """Control tokens in place of the Llama 3 vocabulary's reserved ones (from
    <|reserved_special_token_10|> on, in order), and which of them are BOS (None: none added)
    and EOS."""

    def __init__(self, names, bos, eos):
        self.names, self.bos, self.eos = names, bos, eos

    def overrides(self, vocab):
        tokens = list(field(vocab, "tokenizer.ggml.tokens"))
        types = list(field(vocab, "tokenizer.ggml.token_type"))
        ids = {}
        for k, name in enumerate(self.names):
            i = tokens.index(f"<|reserved_special_token_{10 + k}|>")
            tokens[i], types[i], ids[name] = name, gguf.TokenType.CONTROL, i
        out = {"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
               "tokenizer.ggml.eos_token_id": ids[self.eos],
               "tokenizer.ggml.add_bos_token": self.bos is not None}
        if self.bos is not None:
            out["tokenizer.ggml.bos_token_id"] = ids[self.bos]
        return out


MISTRAL = Specials(["<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
                    "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"], "<s>", "</s>")
SMOLLM3 = Specials(["<|im_start|>", "<|im_end|>", "<think>", "</think>"], None, "<|im_end|>")


def families(out, real_tokenizers, default_model):
    """The --families files (see the module's doc)."""
    out.mkdir(parents=True, exist_ok=True)
    fixtures = REPO / "crates/model/tests/fixtures"
    templates = REPO / "crates/text/tests/fixtures/templates"
    qwen = real_tokenizers / "qwen.gguf"
    llama3 = real_tokenizers / "llama3.gguf"
    made = [
        ("llama3", "tiny-llama", llama3, None, None),
        ("qwen3", "tiny-qwen3", qwen, None, None),
        ("qwen2.5", "tiny-qwen2", qwen, (templates / "qwen2.5.jinja").read_text(), None),
        ("gemma3", "tiny-gemma3", default_model, None, None),
        ("mistral", "tiny-mistral", llama3, (templates / "mistral-nemo.jinja").read_text(), MISTRAL),
        ("smollm3", "tiny-smollm3", llama3, (templates / "smollm3.jinja").read_text(), SMOLLM3),
    ]
    for i, (name, tiny, vocab, template, specials) in enumerate(made):
        if template is None and name != "gemma3":
            template = field(gguf.GGUFReader(vocab), "tokenizer.chat_template")
        path = out / f"{name}.gguf"
        tmp = path.with_suffix(".tmp")
        n = write_served(fixtures / f"{tiny}.gguf", vocab, template, tmp, 4096, seed=7 + i,
                         dtype=np.float16, specials=specials)
        tmp.rename(path)
        print(f"{path}: {tiny} with a vocabulary of {n}, {path.stat().st_size >> 20} MB")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--families", type=Path, help="write the real-tokenizer family models here")
    ap.add_argument("--real-tokenizers", type=Path, default=Path.home() / ".cache/temper/real-tokenizers")
    ap.add_argument("--default-model", type=Path,
                    default=Path.home() / ".cache/temper/models/gemma-3-270m-q4_k_m.gguf")
    args = ap.parse_args()
    if args.families:
        families(args.families, args.real_tokenizers, args.default_model)
        return

    template = TEMPLATE.read_text()
    n_vocab = write_served(MODEL, VOCAB, template, OUT / "tiny-qwen2-bpe.gguf", 2048)

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
