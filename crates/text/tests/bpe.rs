//! Byte-level BPE tokenizers (`tokenizer.ggml.model = gpt2`) against Hugging Face `tokenizers`:
//! tests/fixtures/bpe holds, per pre-tokenizer family, a small trained vocabulary as a
//! tokenizer.json and as a GGUF in llama.cpp's keys, and the ids Hugging Face gives for a corpus
//! of tricky strings (scripts/bpe_fixtures.py writes them all).

mod common;

use std::collections::HashMap;
use std::path::PathBuf;

use candle_core::quantized::gguf_file;
use common::{jsonl_cases, streamed};
use serde::Deserialize;
use temper_text::{DecodeOptions, DecodeStream, TokenKind, Tokenizer};

const FAMILIES: &[&str] = &["llama-bpe", "qwen2", "smollm", "gpt-2"];

const KEEP: DecodeOptions = DecodeOptions {
    skip_special_tokens: false,
    spaces_between_special_tokens: false,
};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/bpe")
        .join(name)
}

fn metadata(family: &str) -> HashMap<String, gguf_file::Value> {
    let path = fixture(&format!("{family}.gguf"));
    let mut file = std::fs::File::open(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    gguf_file::Content::read(&mut file)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .metadata
}

fn from_gguf(family: &str) -> Tokenizer {
    Tokenizer::from_gguf_metadata(&metadata(family))
        .unwrap_or_else(|e| panic!("{family}.gguf: {e}"))
}

fn from_json(family: &str) -> Tokenizer {
    let path = fixture(&format!("{family}.tokenizer.json"));
    let json = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    Tokenizer::from_tokenizer_json(&json).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[derive(Deserialize)]
struct Case {
    text: String,
    parse_special: bool,
    ids: Vec<u32>,
    /// Hugging Face's decoding of `ids` with special tokens kept: the text, NFC-composed where
    /// the tokenizer normalizes.
    decoded: String,
}

fn cases(family: &str) -> Vec<Case> {
    jsonl_cases(&fixture(&format!("{family}.expected.jsonl")))
}

#[test]
fn ids_and_decoding_match_hugging_face() {
    for family in FAMILIES {
        for (source, tok) in [("gguf", from_gguf(family)), ("json", from_json(family))] {
            for case in cases(family) {
                let what = format!("{family} {source} {:?} ({})", case.text, case.parse_special);
                assert_eq!(
                    tok.encode(&case.text, case.parse_special),
                    case.ids,
                    "ids of {what}"
                );
                let decoded = tok.decode(&case.ids, KEEP);
                assert_eq!(decoded, case.decoded, "decoding of {what}");
                assert_eq!(streamed(&tok, &case.ids, KEEP), decoded, "stream of {what}");
                let opts = DecodeOptions::default();
                assert_eq!(
                    streamed(&tok, &case.ids, opts),
                    tok.decode(&case.ids, opts),
                    "default stream of {what}"
                );
                let bytes: Vec<u8> = case
                    .ids
                    .iter()
                    .flat_map(|&id| tok.token_bytes(id).expect("id in vocabulary").into_owned())
                    .collect();
                assert_eq!(bytes, case.decoded.as_bytes(), "token bytes of {what}");
            }
        }
    }
}

#[test]
fn a_character_split_across_tokens_is_held_back_until_complete() {
    let tok = from_gguf("qwen2");
    // The fixture vocabulary never merges this emoji's bytes.
    let ids = tok.encode("🇫🇷", false);
    assert!(ids.len() > 1, "{ids:?}");
    assert!(std::str::from_utf8(&tok.token_bytes(ids[0]).unwrap()).is_err());
    let mut stream = DecodeStream::new(KEEP);
    assert_eq!(stream.step(&tok, ids[0]), "");
    let rest: String = ids[1..].iter().map(|&id| stream.step(&tok, id)).collect();
    assert_eq!(rest, "🇫🇷");
    assert_eq!(stream.flush(), "");
    // Alone, the partial character is U+FFFD, in logprobs too; its bytes find it back.
    let (text, bytes) = tok.logprob_token(ids[0]).unwrap();
    assert!(text.contains('\u{FFFD}'));
    assert_eq!(tok.id_of_logprob_token(&text, Some(&bytes)), Some(ids[0]));
}

#[test]
fn special_tokens_bos_eos_and_end_of_turn_follow_the_file() {
    let id = |tok: &Tokenizer, t: &str| tok.token_id(t).unwrap_or_else(|| panic!("{t}"));

    let llama = from_gguf("llama-bpe");
    assert_eq!(llama.bos_token(), Some("<|begin_of_text|>"));
    assert_eq!(llama.eos_token(), Some("<|eot_id|>"));
    assert!(llama.add_bos());
    let mut eot = vec![id(&llama, "<|eom_id|>"), id(&llama, "<|eot_id|>")];
    eot.sort_unstable();
    assert_eq!(llama.end_of_turn_ids(), eot);
    let header = id(&llama, "<|start_header_id|>");
    assert_eq!(llama.kind(header), Some(TokenKind::Control));
    assert!(llama.is_special(header));
    assert_eq!(llama.decode(&[header], DecodeOptions::default()), "");
    let json = from_json("llama-bpe");
    assert_eq!(json.bos_token(), Some("<|begin_of_text|>"));
    assert!(json.add_bos());

    let qwen = from_gguf("qwen2");
    assert_eq!(qwen.bos_token(), Some("<|endoftext|>"));
    assert_eq!(qwen.eos_token(), Some("<|im_end|>"));
    assert!(!qwen.add_bos());
    assert_eq!(qwen.end_of_turn_ids(), [id(&qwen, "<|im_end|>")]);
    // Non-special added tokens are user-defined: matched whole even without parse_special,
    // kept by skip_special_tokens.
    let call = id(&qwen, "<tool_call>");
    assert_eq!(qwen.kind(call), Some(TokenKind::UserDefined));
    assert_eq!(qwen.encode("<tool_call>", false), [call]);
    assert_eq!(
        qwen.decode(&[call], DecodeOptions::default()),
        "<tool_call>"
    );
    assert!(!from_json("qwen2").add_bos());

    let smol = from_gguf("smollm");
    assert_eq!(smol.token_id("<|endoftext|>"), Some(0));
    assert_eq!(smol.end_of_turn_ids(), [2]);
    assert!(!smol.add_bos());

    // No add_bos_token key: GPT-2's default.
    let gpt2 = from_gguf("gpt-2");
    assert!(!gpt2.add_bos());
    assert_eq!(gpt2.eos_token(), Some("<|endoftext|>"));
    assert!(gpt2.end_of_turn_ids().is_empty());
}

#[test]
fn every_token_round_trips_through_its_logprob_entry_and_bounds_text_bytes() {
    for family in FAMILIES {
        let tok = from_gguf(family);
        let mut longest = 0;
        for id in 0..tok.vocab_size() as u32 {
            let (text, bytes) = tok.logprob_token(id).unwrap();
            assert_eq!(
                tok.id_of_logprob_token(&text, Some(&bytes)),
                Some(id),
                "{family} {id} {text:?}"
            );
            longest = longest.max(bytes.len());
        }
        assert_eq!(tok.max_text_bytes_per_token(), longest, "{family}");
    }
}

#[test]
fn unknown_pre_tokenizers_and_missing_merges_are_load_errors() {
    let mut md = metadata("qwen2");
    md.insert(
        "tokenizer.ggml.pre".into(),
        gguf_file::Value::String("no-such-pre".into()),
    );
    let err = Tokenizer::from_gguf_metadata(&md).unwrap_err().to_string();
    assert!(err.contains("no-such-pre"), "{err}");
    for name in ["llama-bpe", "qwen2", "smollm", "gpt-2", "default"] {
        assert!(err.contains(name), "{err}");
    }
    let mut md = metadata("qwen2");
    md.remove("tokenizer.ggml.merges");
    assert!(Tokenizer::from_gguf_metadata(&md).is_err());
    // No pre-tokenizer named: llama.cpp's default.
    let mut md = metadata("gpt-2");
    md.remove("tokenizer.ggml.pre");
    let tok = Tokenizer::from_gguf_metadata(&md).expect("default pre-tokenizer");
    assert_eq!(
        tok.decode(&tok.encode("Hello, world! 12345", false), KEEP),
        "Hello, world! 12345"
    );
}

#[test]
fn a_byte_level_tokenizer_json_beside_the_model_is_used() {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::copy(
        fixture("qwen2.tokenizer.json"),
        dir.path().join("tokenizer.json"),
    )
    .expect("copy tokenizer.json");
    std::fs::write(
        dir.path().join("tokenizer_config.json"),
        r#"{"bos_token": null, "eos_token": "<|im_end|>"}"#,
    )
    .expect("write tokenizer_config.json");
    let tok = temper_text::load_tokenizer(&metadata("qwen2"), &dir.path().join("model.gguf"))
        .expect("tokenizer beside the model");
    assert_eq!(tok.eos_token(), Some("<|im_end|>"));
    // The config names no BOS: the GGUF's.
    assert_eq!(tok.bos_token(), Some("<|endoftext|>"));
    assert!(!tok.add_bos());
    let case = cases("qwen2")
        .into_iter()
        .find(|c| c.parse_special && c.text.starts_with("<|im_start|>"))
        .expect("a chat case");
    assert_eq!(tok.encode(&case.text, case.parse_special), case.ids);
}
