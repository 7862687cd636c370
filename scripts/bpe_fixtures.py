#!/usr/bin/env python3
"""Regenerates crates/text/tests/fixtures/bpe/: small byte-level BPE tokenizers, one per
pre-tokenizer family, each as a Hugging Face tokenizer.json and as a GGUF carrying the same
vocabulary in llama.cpp's keys (no tensors), plus the ids Hugging Face `tokenizers` gives for a
corpus of tricky strings (the expected ids of crates/text/tests/bpe.rs).

Run with the train-ref venv (tokenizers, gguf):
    ~/.cache/temper/train-ref-venv/bin/python scripts/bpe_fixtures.py
"""

import json
import os
import sys

import gguf
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
from tokenizers import pre_tokenizers, processors, trainers

OUT = os.path.join(os.path.dirname(__file__), "..", "crates", "text", "tests", "fixtures", "bpe")

# The Split patterns of the real tokenizer.json files (llama.cpp's llama-vocab.cpp quotes them).
LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Training text: English with numbers and code, some accented words, CJK and emoji (so that
# some multi-byte characters merge and others stay split into byte tokens).
CORPUS = [
    "The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs away.",
    "I'm sure they've said we'll go, but you'd think it's what I'd do. Don't! Won't? Can't.",
    "In 2024 the price rose from 1,234.56 to 7,890.12 dollars: 42% more than in 1999.",
    "def main():\n    for i in range(10):\n        print(i * 2)\n    return None\n",
    "if (x == 1) { y = x + 2; } else { y = [a, b, c]; }  // comment\n",
    "Hello, world! Hello there. How are you today? Fine, thanks; and you?",
    "naïve café résumé über straße façade jalapeño coöperate",
    "日本語のテキストです。中文文本。한국어 텍스트.",
    "Emoji: 😀 😃 👍 🎉 — quotes “like this” and ‘this’ … done.",
    "Tabs\tand\tnewlines\n\nand  double  spaces   and trailing   \n",
    "numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000 10000 123456789",
    "the the the and and of of to to in in is is that that for for with with",
]


def trained(pre, special_first, ignore_merges=False, normalizer=None):
    tok = Tokenizer(models.BPE(ignore_merges=ignore_merges))
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=256 + len(special_first) + 400,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=special_first,
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 3, trainer)
    return tok


def split_pre(pattern):
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )


def llama_bpe():
    tok = trained(split_pre(LLAMA3), [], ignore_merges=True)
    tok.add_special_tokens(
        [
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eom_id|>",
            "<|eot_id|>",
        ]
    )
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bos)]
    )
    keys = {
        "pre": "llama-bpe",
        "bos": "<|begin_of_text|>",
        "eos": "<|eot_id|>",
        "eot": "<|eot_id|>",
        "eom": "<|eom_id|>",
        "add_bos": True,
    }
    return tok, keys


def qwen2():
    tok = trained(split_pre(QWEN2), [], normalizer=normalizers.NFC())
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t in ["<tool_call>", "</tool_call>", "<think>", "</think>"]]
    )
    keys = {
        "pre": "qwen2",
        "bos": "<|endoftext|>",
        "eos": "<|im_end|>",
        "pad": "<|endoftext|>",
        "add_bos": False,
    }
    return tok, keys


def smollm():
    pre = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )
    tok = trained(pre, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    keys = {
        "pre": "smollm",
        "bos": "<|im_start|>",
        "eos": "<|im_end|>",
        "pad": "<|im_end|>",
        "add_bos": False,
    }
    return tok, keys


def gpt2():
    pre = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    tok = trained(pre, ["<|endoftext|>"])
    keys = {"pre": "gpt-2", "bos": "<|endoftext|>", "eos": "<|endoftext|>"}
    return tok, keys


# Strings to tokenize: each with parse_special true and false.
CASES = [
    "",
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    " leading space and trailing space ",
    "   three leading spaces",
    "a  b   c    d\t\te",
    "line one\nline two\n\nline four\r\nwindows\r\n",
    "\n\n\n",
    "trailing newline spaces  \n  ",
    "I'm don't WE'LL they've you'D it's SHE'S",
    "1 12 123 1234 12345 123456789 3.14159 -42 1,000,000",
    "x=1+2*3; y = [a, b]; // done!!! ???",
    "naïve café résumé über",
    "décomposé: e\u0301 a\u0300",
    "日本語のテキストです。中文文本。",
    "한국어 텍스트",
    "emoji 😀👍🎉 and family 👨\u200d👩\u200d👧 and flags 🇫🇷",
    "mixed 中文and English123中文",
    "nbsp\u00a0and ideographic\u3000space",
    "<|im_start|>user\nHi there!<|im_end|>\n<|im_start|>assistant\n",
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHello<|eot_id|>",
    "<|endoftext|>text after eos<|endoftext|>",
    "a partial <|im_start and <|eot_id| marker",
    "<tool_call>{\"name\": \"f\"}</tool_call> <think>hmm</think>",
    "def f(x):\n    return x * 2\n\n\nprint(f(21))\n",
    "    indented\n        more\n\tTab",
    "ÿþ\u0000\u0001 control \u007f bytes",
]


def write_gguf(path, tok, keys):
    data = json.loads(tok.to_str())
    vocab = tok.get_vocab(with_added_tokens=True)
    n = max(vocab.values()) + 1
    tokens = [""] * n
    for piece, i in vocab.items():
        tokens[i] = piece
    added = {t["id"]: t for t in data["added_tokens"]}
    types = []
    for i in range(n):
        if i in added:
            types.append(gguf.TokenType.CONTROL if added[i]["special"] else gguf.TokenType.USER_DEFINED)
        else:
            types.append(gguf.TokenType.NORMAL)
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    w = gguf.GGUFWriter(path, "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(keys["pre"])
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(vocab[keys["bos"]])
    w.add_eos_token_id(vocab[keys["eos"]])
    if "eot" in keys:
        w.add_eot_token_id(vocab[keys["eot"]])
    if "eom" in keys:
        w.add_eom_token_id(vocab[keys["eom"]])
    if "pad" in keys:
        w.add_pad_token_id(vocab[keys["pad"]])
    if "add_bos" in keys:
        w.add_add_bos_token(keys["add_bos"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def expected(tok):
    lines = []
    for parse_special in (True, False):
        tok.encode_special_tokens = not parse_special
        for text in CASES:
            ids = tok.encode(text, add_special_tokens=False).ids
            decoded = tok.decode(ids, skip_special_tokens=False)
            lines.append(
                json.dumps(
                    {"text": text, "parse_special": parse_special, "ids": ids, "decoded": decoded},
                    ensure_ascii=False,
                )
            )
    tok.encode_special_tokens = False
    return "\n".join(lines) + "\n"


def main():
    os.makedirs(OUT, exist_ok=True)
    for name, build in [("llama-bpe", llama_bpe), ("qwen2", qwen2), ("smollm", smollm), ("gpt-2", gpt2)]:
        tok, keys = build()
        tok.save(os.path.join(OUT, f"{name}.tokenizer.json"), pretty=False)
        write_gguf(os.path.join(OUT, f"{name}.gguf"), tok, keys)
        with open(os.path.join(OUT, f"{name}.expected.jsonl"), "w", encoding="utf-8") as f:
            f.write(expected(tok))
        print(f"{name}: {tok.get_vocab_size(with_added_tokens=True)} tokens", file=sys.stderr)


if __name__ == "__main__":
    main()
