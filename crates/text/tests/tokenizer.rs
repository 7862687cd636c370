//! Tokenizer behaviour on small vocabularies built by the tests themselves: GGUF metadata with
//! chosen scores, and a Hugging Face tokenizer.json with chosen merges.

use std::collections::HashMap;

use candle_core::quantized::gguf_file::Value as G;
use temper_text::{load_tokenizer, DecodeOptions, DecodeStream, TokenKind, Tokenizer};

const KEEP: DecodeOptions = DecodeOptions {
    skip_special_tokens: false,
    spaces_between_special_tokens: false,
};

/// (piece, score, GGUF token type)
fn gguf_vocab() -> Vec<(String, f32, i32)> {
    let mut v: Vec<(String, f32, i32)> = [
        ("<pad>", 0.0, 3),
        ("<eos>", 0.0, 3),
        ("<bos>", 0.0, 3),
        ("<unk>", 0.0, 2),
        ("<start_of_turn>", 0.0, 3),
        ("\n", 0.0, 4),
        ("</s>", 0.0, 4),
        ("  ", 0.0, 4),
        ("   ", 0.0, 4),
    ]
    .iter()
    .map(|&(p, s, t)| (p.to_string(), s, t))
    .collect();
    v.extend((0..=255u8).map(|b| (format!("<0x{b:02X}>"), 0.0, 6)));
    v.extend(
        [
            ("a", -10.0),
            ("b", -10.0),
            ("c", -10.0),
            ("<", -10.0),
            (">", -10.0),
            ("s", -10.0),
            ("/", -10.0),
            ("\u{2581}", -10.0),
            ("ab", -5.0),
            ("bc", -1.0),
            ("aa", -2.0),
            ("\u{2581}a", -3.0),
            ("é", -10.0),
        ]
        .iter()
        .map(|&(p, s)| (p.to_string(), s, 1)),
    );
    v
}

fn gguf_metadata(add_space_prefix: Option<bool>) -> HashMap<String, G> {
    let vocab = gguf_vocab();
    let mut md = HashMap::new();
    md.insert("tokenizer.ggml.model".into(), G::String("llama".into()));
    md.insert(
        "tokenizer.ggml.tokens".into(),
        G::Array(vocab.iter().map(|v| G::String(v.0.clone())).collect()),
    );
    md.insert(
        "tokenizer.ggml.scores".into(),
        G::Array(vocab.iter().map(|v| G::F32(v.1)).collect()),
    );
    md.insert(
        "tokenizer.ggml.token_type".into(),
        G::Array(vocab.iter().map(|v| G::I32(v.2)).collect()),
    );
    md.insert("tokenizer.ggml.bos_token_id".into(), G::U32(2));
    md.insert("tokenizer.ggml.eos_token_id".into(), G::U32(1));
    md.insert("tokenizer.ggml.unknown_token_id".into(), G::U32(3));
    if let Some(b) = add_space_prefix {
        md.insert("tokenizer.ggml.add_space_prefix".into(), G::Bool(b));
    }
    md
}

fn gguf_tokenizer() -> Tokenizer {
    Tokenizer::from_gguf_metadata(&gguf_metadata(Some(false))).expect("synthetic GGUF tokenizer")
}

fn pieces(tok: &Tokenizer, ids: &[u32]) -> Vec<String> {
    ids.iter()
        .map(|&id| tok.piece(id).unwrap_or("?").to_string())
        .collect()
}

#[test]
fn highest_score_pair_merges_first_and_ties_go_leftmost() {
    let tok = gguf_tokenizer();
    // "bc" (-1) beats "ab" (-5), so "abc" is a + bc, not ab + c.
    assert_eq!(pieces(&tok, &tok.encode("abc", false)), ["a", "bc"]);
    // Two equal "aa" pairs: the leftmost merges.
    assert_eq!(pieces(&tok, &tok.encode("aaa", false)), ["aa", "a"]);
    // Spaces become ▁ and merge like any character.
    assert_eq!(pieces(&tok, &tok.encode("b a", false)), ["b", "\u{2581}a"]);
}

#[test]
fn user_defined_always_control_only_with_parse_special() {
    let tok = gguf_tokenizer();
    let sot = tok.token_id("<start_of_turn>").expect("sot");
    let nl = tok.token_id("\n").expect("newline");
    assert_eq!(
        tok.encode("a\n<start_of_turn>", true),
        [tok.token_id("a").unwrap(), nl, sot]
    );
    let plain = tok.encode("a\n<start_of_turn>", false);
    assert!(!plain.contains(&sot));
    assert_eq!(plain[1], nl);
    // Space runs are user-defined: the longest run is taken first.
    assert_eq!(
        pieces(&tok, &tok.encode("a     b", false)),
        ["a", "   ", "  ", "b"]
    );
    // `</s>` is user-defined in the GGUF but treated as control, as llama.cpp does.
    let eos_s = tok.token_id("</s>").expect("</s>");
    assert_eq!(tok.kind(eos_s), Some(TokenKind::Control));
    assert_eq!(tok.encode("</s>", true), [eos_s]);
    assert!(!tok.encode("</s>", false).contains(&eos_s));
    assert_eq!(tok.decode(&tok.encode("</s>", false), KEEP), "</s>");
}

#[test]
fn characters_without_a_piece_fall_back_to_bytes() {
    let tok = gguf_tokenizer();
    let ids = tok.encode("a😀é", false);
    assert_eq!(
        pieces(&tok, &ids),
        ["a", "<0xF0>", "<0x9F>", "<0x98>", "<0x80>", "é"]
    );
    assert_eq!(tok.decode(&ids, KEEP), "a😀é");
    assert_eq!(tok.kind(ids[1]), Some(TokenKind::Byte));
    assert_eq!(tok.token_bytes(ids[1]).as_deref(), Some(&[0xF0u8][..]));
    assert_eq!(tok.encode("", true), Vec::<u32>::new());
}

#[test]
fn space_prefix_is_added_by_default_and_stripped_on_decode() {
    let tok = Tokenizer::from_gguf_metadata(&gguf_metadata(None)).expect("tokenizer");
    let ids = tok.encode("a", false);
    assert_eq!(pieces(&tok, &ids), ["\u{2581}a"]);
    assert_eq!(tok.decode(&ids, KEEP), "a");
    // Gemma says false: no prefix.
    let tok = gguf_tokenizer();
    assert_eq!(pieces(&tok, &tok.encode("a", false)), ["a"]);
}

#[test]
fn gguf_errors_are_reported() {
    let mut md = gguf_metadata(Some(false));
    md.insert("tokenizer.ggml.model".into(), G::String("gpt2".into()));
    assert!(Tokenizer::from_gguf_metadata(&md).is_err());
    let mut md = gguf_metadata(Some(false));
    md.remove("tokenizer.ggml.tokens");
    assert!(Tokenizer::from_gguf_metadata(&md).is_err());
    let mut md = gguf_metadata(Some(false));
    md.insert("tokenizer.ggml.scores".into(), G::Array(vec![G::F32(0.0)]));
    assert!(Tokenizer::from_gguf_metadata(&md).is_err());
}

#[test]
fn decode_options_skip_and_space_special_tokens() {
    let tok = gguf_tokenizer();
    let mut ids = vec![tok.token_id("<start_of_turn>").unwrap()];
    ids.extend(tok.encode("ab b", false));
    ids.push(tok.eos_id().unwrap());
    let opts = |skip, spaces| DecodeOptions {
        skip_special_tokens: skip,
        spaces_between_special_tokens: spaces,
    };
    assert_eq!(tok.decode(&ids, opts(true, true)), "ab b");
    assert_eq!(tok.decode(&ids, opts(true, false)), "ab b");
    assert_eq!(
        tok.decode(&ids, opts(false, false)),
        "<start_of_turn>ab b<eos>"
    );
    assert_eq!(
        tok.decode(&ids, opts(false, true)),
        "<start_of_turn> ab b <eos>"
    );
    // Adjacent special tokens are spaced too, like vLLM's " ".join(sub_texts).
    let two = [tok.bos_id().unwrap(), tok.eos_id().unwrap()];
    assert_eq!(tok.decode(&two, opts(false, true)), "<bos> <eos>");
    assert!(tok.is_special(two[0]));
    assert!(!tok.is_special(tok.token_id("\n").unwrap()));
}

#[test]
fn decode_stream_never_splits_a_character() {
    let tok = gguf_tokenizer();
    let ids = tok.encode("a😀é", false);
    let mut stream = DecodeStream::new(KEEP);
    let steps: Vec<String> = ids.iter().map(|&id| stream.step(&tok, id)).collect();
    assert_eq!(steps, ["a", "", "", "", "😀", "é"]);
    assert_eq!(stream.flush(), "");

    // A truncated sequence is held back, then flushed as U+FFFD.
    let f0 = tok.token_id("<0xF0>").unwrap();
    let mut stream = DecodeStream::new(KEEP);
    assert_eq!(stream.step(&tok, f0), "");
    assert_eq!(stream.flush(), "\u{FFFD}");

    // An invalid sequence is replaced as soon as it is known to be invalid.
    let a = tok.token_id("a").unwrap();
    let mut stream = DecodeStream::new(KEEP);
    assert_eq!(stream.step(&tok, f0), "");
    assert_eq!(stream.step(&tok, a), "\u{FFFD}a");
    assert_eq!(tok.decode(&[f0, a], KEEP), "\u{FFFD}a");

    // A special token ends the text run: held-back bytes are flushed before it.
    let sot = tok.token_id("<start_of_turn>").unwrap();
    let ids = [f0, sot, a];
    let spaced = DecodeOptions {
        skip_special_tokens: false,
        spaces_between_special_tokens: true,
    };
    let mut stream = DecodeStream::new(spaced);
    let mut text: String = ids.iter().map(|&id| stream.step(&tok, id)).collect();
    text.push_str(&stream.flush());
    assert_eq!(text, tok.decode(&ids, spaced));
    assert_eq!(text, "\u{FFFD} <start_of_turn> a");
    // Ids outside the vocabulary produce nothing.
    assert_eq!(tok.decode(&[a, 999_999], KEEP), "a");
}

/// A small Llama/Gemma-style tokenizer.json: BPE with merges, byte fallback, added tokens.
fn tokenizer_json(normalizer: serde_json::Value, pre_tokenizer: serde_json::Value) -> String {
    let mut vocab = serde_json::Map::new();
    let mut next = 0u32;
    let mut add = |p: &str, vocab: &mut serde_json::Map<String, serde_json::Value>| {
        vocab.insert(p.to_string(), next.into());
        next += 1;
    };
    for p in ["<unk>", "<s>", "</s>"] {
        add(p, &mut vocab);
    }
    for b in 0..=255u8 {
        add(&format!("<0x{b:02X}>"), &mut vocab);
    }
    for p in [
        "\u{2581}",
        "h",
        "e",
        "l",
        "o",
        "w",
        "r",
        "d",
        "ll",
        "he",
        "hell",
        "hello",
        "\u{2581}w",
        "or",
        "\u{2581}wor",
        "ld",
        "\u{2581}world",
        "\u{2581}h",
        "\u{2581}hello",
    ] {
        add(p, &mut vocab);
    }
    let n = next;
    serde_json::json!({
        "version": "1.0",
        "added_tokens": [
            {"id": 0, "content": "<unk>", "special": true, "lstrip": false, "rstrip": false, "normalized": false, "single_word": false},
            {"id": 1, "content": "<s>", "special": true, "lstrip": false, "rstrip": false, "normalized": false, "single_word": false},
            {"id": 2, "content": "</s>", "special": true, "lstrip": false, "rstrip": false, "normalized": false, "single_word": false},
            {"id": n, "content": "<start_of_turn>", "special": true, "lstrip": false, "rstrip": false, "normalized": false, "single_word": false},
            {"id": n + 1, "content": "<br>", "special": false, "lstrip": false, "rstrip": false, "normalized": false, "single_word": false}
        ],
        "normalizer": normalizer,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": {"type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [], "special_tokens": {}},
        "decoder": null,
        "model": {
            "type": "BPE", "dropout": null, "unk_token": "<unk>",
            "continuing_subword_prefix": null, "end_of_word_suffix": null,
            "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
            "vocab": vocab,
            "merges": ["l l", "h e", "he ll", "hell o", "\u{2581} w", "o r", "\u{2581}w or", "l d", "\u{2581}wor ld", ["\u{2581}", "h"], "\u{2581} hello"]
        }
    })
    .to_string()
}

fn gemma_style_json() -> String {
    tokenizer_json(
        serde_json::json!({"type": "Replace", "pattern": {"String": " "}, "content": "\u{2581}"}),
        serde_json::Value::Null,
    )
}

#[test]
fn tokenizer_json_merges_by_rank_with_added_tokens_and_byte_fallback() {
    let tok = Tokenizer::from_tokenizer_json(&gemma_style_json()).expect("tokenizer.json");
    assert_eq!(tok.bos_token(), Some("<s>"));
    assert_eq!(tok.eos_token(), Some("</s>"));
    assert_eq!(tok.kind(0), Some(TokenKind::Unknown));
    let ids = tok.encode("hello world", false);
    assert_eq!(pieces(&tok, &ids), ["hello", "\u{2581}world"]);
    assert_eq!(tok.decode(&ids, KEEP), "hello world");

    let sot = tok.token_id("<start_of_turn>").unwrap();
    let br = tok.token_id("<br>").unwrap();
    assert_eq!(tok.kind(sot), Some(TokenKind::Control));
    assert_eq!(tok.kind(br), Some(TokenKind::UserDefined));
    let ids = tok.encode("<start_of_turn>hello<br>😀", true);
    assert_eq!(
        pieces(&tok, &ids),
        [
            "<start_of_turn>",
            "hello",
            "<br>",
            "<0xF0>",
            "<0x9F>",
            "<0x98>",
            "<0x80>"
        ]
    );
    // Without special parsing the control text is ordinary text (here: bytes), `<br>` stays.
    let plain = tok.encode("<start_of_turn><br>", false);
    assert!(!plain.contains(&sot));
    assert_eq!(plain.last(), Some(&br));
    assert_eq!(tok.decode(&plain, KEEP), "<start_of_turn><br>");
}

#[test]
fn tokenizer_json_llama_style_prefix_is_added_and_stripped() {
    let json = tokenizer_json(
        serde_json::json!({"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "\u{2581}"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "\u{2581}"}
        ]}),
        serde_json::Value::Null,
    );
    let tok = Tokenizer::from_tokenizer_json(&json).expect("tokenizer.json");
    let ids = tok.encode("hello world", false);
    assert_eq!(pieces(&tok, &ids), ["\u{2581}hello", "\u{2581}world"]);
    assert_eq!(tok.decode(&ids, KEEP), "hello world");

    // Metaspace with split: each word is merged on its own.
    let json = tokenizer_json(
        serde_json::Value::Null,
        serde_json::json!({"type": "Metaspace", "replacement": "\u{2581}", "prepend_scheme": "first", "split": true}),
    );
    let tok = Tokenizer::from_tokenizer_json(&json).expect("tokenizer.json");
    assert_eq!(
        pieces(&tok, &tok.encode("hello world", false)),
        ["\u{2581}hello", "\u{2581}world"]
    );
}

#[test]
fn tokenizer_json_rejects_what_it_cannot_do() {
    let regex = tokenizer_json(
        serde_json::Value::Null,
        serde_json::json!({"type": "Split", "pattern": {"Regex": "\\s+"}, "behavior": "Isolated", "invert": false}),
    );
    assert!(Tokenizer::from_tokenizer_json(&regex).is_err());
    assert!(Tokenizer::from_tokenizer_json("{}").is_err());
    assert!(Tokenizer::from_tokenizer_json("not json").is_err());
    let wordpiece = r#"{"model": {"type": "WordPiece", "vocab": {"a": 0}}}"#;
    assert!(Tokenizer::from_tokenizer_json(wordpiece).is_err());
}

#[test]
fn tokenizer_json_beside_the_model_wins() {
    let dir = std::env::temp_dir().join(format!("temper-text-load-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let model = dir.join("model.gguf");
    let md = gguf_metadata(Some(false));

    // Without tokenizer.json: the GGUF vocabulary.
    let _ = std::fs::remove_file(dir.join("tokenizer.json"));
    let tok = load_tokenizer(&md, &model).expect("from GGUF");
    assert_eq!(tok.vocab_size(), gguf_vocab().len());

    // With it: the JSON vocabulary; BOS/EOS from tokenizer_config.json.
    std::fs::write(dir.join("tokenizer.json"), gemma_style_json()).expect("write json");
    std::fs::write(
        dir.join("tokenizer_config.json"),
        r#"{"bos_token": {"content": "<s>"}, "eos_token": "<start_of_turn>"}"#,
    )
    .expect("write config");
    let tok = load_tokenizer(&md, &model).expect("from tokenizer.json");
    assert!(tok.token_id("\u{2581}world").is_some());
    assert_eq!(tok.bos_token(), Some("<s>"));
    assert_eq!(tok.eos_token(), Some("<start_of_turn>"));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn tokenizer_and_template_are_shareable_across_threads() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Tokenizer>();
    assert_send_sync::<temper_text::ChatTemplate>();
    assert_send_sync::<DecodeStream>();
}
