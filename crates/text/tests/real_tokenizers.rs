//! The real Llama 3 and Qwen vocabularies against tiktoken's ids. scripts/real-tokenizers.sh
//! (run by `make test`) writes them into `$TEMPER_HOME/real-tokenizers` from the vocabularies
//! that llama-models and dashscope ship: per family a GGUF whose tokenizer metadata llama.cpp's
//! convert_hf_to_gguf.py wrote, the Hugging Face directory it was made from, and tiktoken's ids
//! for a corpus and for chat-template prompts (scripts/real_tokenizers.py). Each family is loaded
//! through `load_tokenizer` twice: from the GGUF metadata alone, and with the directory's
//! tokenizer.json and tokenizer_config.json beside the model.
//!
//! Without those files the tests skip with a notice, or fail under `TEMPER_REQUIRE_MODEL=1`
//! (as `make test` sets). `TEMPER_REAL_TOKENIZERS` points them at another directory.

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file;
use common::{jsonl_cases, streamed};
use serde::Deserialize;
use temper_text::{gguf_chat_template, DecodeOptions, TokenKind, Tokenizer};

const FAMILIES: &[&str] = &["llama3", "qwen"];

const KEEP: DecodeOptions = DecodeOptions {
    skip_special_tokens: false,
    spaces_between_special_tokens: false,
};

/// The generated directory, or `None` (skip) when it is incomplete and `TEMPER_REQUIRE_MODEL=1`
/// is not set.
fn dir() -> Option<PathBuf> {
    let dir = std::env::var_os("TEMPER_REAL_TOKENIZERS")
        .map(PathBuf::from)
        .unwrap_or_else(|| temper_model::paths::temper_home().join("real-tokenizers"));
    let missing: Vec<PathBuf> = FAMILIES
        .iter()
        .flat_map(|f| {
            [
                format!("{f}.gguf"),
                format!("{f}.expected.jsonl"),
                format!("{f}/tokenizer.json"),
                format!("{f}/tokenizer_config.json"),
            ]
        })
        .map(|name| dir.join(name))
        .filter(|p| !p.is_file())
        .collect();
    if missing.is_empty() {
        return Some(dir);
    }
    assert!(
        std::env::var("TEMPER_REQUIRE_MODEL").as_deref() != Ok("1"),
        "TEMPER_REQUIRE_MODEL=1 but the real tokenizers are missing: {missing:?} (run scripts/real-tokenizers.sh)"
    );
    eprintln!(
        "skipping: the real tokenizers are missing: {missing:?} (run scripts/real-tokenizers.sh)"
    );
    None
}

fn metadata(path: &Path) -> HashMap<String, gguf_file::Value> {
    let mut file = std::fs::File::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    gguf_file::Content::read(&mut file)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .metadata
}

/// The family's tokenizer as temper loads it for a model file: from the GGUF metadata
/// (`"gguf"`), and with the Hugging Face directory's files beside the model (`"json"`).
fn loaded(dir: &Path, family: &str) -> [(&'static str, Tokenizer); 2] {
    let gguf = dir.join(format!("{family}.gguf"));
    let md = metadata(&gguf);
    let load = |model: &Path| {
        temper_text::load_tokenizer(&md, model)
            .unwrap_or_else(|e| panic!("{family} {}: {e}", model.display()))
    };
    [
        ("gguf", load(&gguf)),
        ("json", load(&dir.join(family).join("model.gguf"))),
    ]
}

/// The Hugging Face export of the GGUF-loaded tokenizer, read back as a `tokenizer.json`, gives
/// tiktoken's ids.
#[test]
fn the_hugging_face_export_gives_the_same_ids() {
    let Some(dir) = dir() else { return };
    for family in FAMILIES {
        let [(_, tok), _] = loaded(&dir, family);
        let files = tok.to_hf_files(None).expect("export");
        let back = Tokenizer::from_tokenizer_json(&files.tokenizer_json).expect("read back");
        for case in cases(&dir, family) {
            assert_eq!(
                back.encode(&case.text, case.parse_special),
                case.ids,
                "{family} {:?}",
                case.text
            );
        }
    }
}

#[derive(Deserialize)]
struct Case {
    text: String,
    parse_special: bool,
    /// A prompt that the family's chat template rendered.
    chat: bool,
    ids: Vec<u32>,
    /// tiktoken's decoding of `ids` (Qwen's: the text NFC-composed).
    decoded: String,
}

fn cases(dir: &Path, family: &str) -> Vec<Case> {
    jsonl_cases(&dir.join(format!("{family}.expected.jsonl")))
}

#[test]
fn ids_and_decoding_match_tiktoken() {
    let Some(dir) = dir() else { return };
    for family in FAMILIES {
        let cases = cases(&dir, family);
        assert!(cases.len() > 50, "{family}: {} cases", cases.len());
        for (source, tok) in loaded(&dir, family) {
            for case in &cases {
                let what = format!("{family} {source} {:?} ({})", case.text, case.parse_special);
                assert_eq!(
                    tok.encode(&case.text, case.parse_special),
                    case.ids,
                    "ids of {what}"
                );
                let decoded = tok.decode(&case.ids, KEEP);
                assert_eq!(decoded, case.decoded, "decoding of {what}");
                assert_eq!(streamed(&tok, &case.ids, KEEP), decoded, "stream of {what}");
                let bytes: Vec<u8> = case
                    .ids
                    .iter()
                    .flat_map(|&id| tok.token_bytes(id).expect("id in vocabulary").into_owned())
                    .collect();
                assert_eq!(bytes, case.decoded.as_bytes(), "token bytes of {what}");
                // Re-encoding the decoded text gives the same ids.
                assert_eq!(
                    tok.encode(&decoded, case.parse_special),
                    case.ids,
                    "round trip of {what}"
                );
            }
        }
    }
}

#[test]
fn chat_prompts_parse_their_special_tokens_as_single_ids() {
    let Some(dir) = dir() else { return };
    for family in FAMILIES {
        let cases = cases(&dir, family);
        let prompts: Vec<&Case> = cases.iter().filter(|c| c.chat && c.parse_special).collect();
        assert_eq!(prompts.len(), 3, "{family}");
        for (source, tok) in loaded(&dir, family) {
            let markers: &[&str] = match *family {
                "llama3" => &[
                    "<|begin_of_text|>",
                    "<|start_header_id|>",
                    "<|end_header_id|>",
                    "<|eot_id|>",
                ],
                _ => &["<|im_start|>", "<|im_end|>"],
            };
            for case in &prompts {
                for marker in markers {
                    let id = tok.token_id(marker).unwrap_or_else(|| panic!("{marker}"));
                    assert_eq!(
                        tok.kind(id),
                        Some(TokenKind::Control),
                        "{family} {source} {marker}"
                    );
                    assert_eq!(
                        case.ids.iter().filter(|&&i| i == id).count(),
                        case.text.matches(marker).count(),
                        "{family} {source} {marker} in {:?}",
                        case.text
                    );
                }
                // Special tokens dropped from the text, the rest of the prompt decodes as is.
                let mut plain = case.text.clone();
                for marker in markers {
                    plain = plain.replace(marker, "");
                }
                assert_eq!(tok.decode(&case.ids, DecodeOptions::default()), plain);
            }
            // The tool prompt of Qwen's template carries <tools>, a plain-text tag.
            if *family == "qwen" {
                let tools = prompts.last().expect("tool prompt");
                assert!(tools.text.contains("<tools>"), "{:?}", tools.text);
            }
        }
    }
}

#[test]
fn special_tokens_bos_eos_and_templates_are_the_real_ones() {
    let Some(dir) = dir() else { return };
    let id = |tok: &Tokenizer, t: &str| tok.token_id(t).unwrap_or_else(|| panic!("{t}"));

    for (source, llama) in loaded(&dir, "llama3") {
        assert_eq!(llama.vocab_size(), 128_256, "{source}");
        assert_eq!(llama.bos_id(), Some(128_000), "{source}");
        assert_eq!(llama.bos_token(), Some("<|begin_of_text|>"), "{source}");
        assert_eq!(llama.eos_token(), Some("<|eot_id|>"), "{source}");
        assert!(llama.add_bos(), "{source}");
        assert_eq!(id(&llama, "<|eot_id|>"), 128_009);
        assert_eq!(id(&llama, "<|python_tag|>"), 128_010);
        assert_eq!(id(&llama, "<|reserved_special_token_245|>"), 128_255);
        // <|eom_id|> and <|eot_id|> end a turn, as in llama.cpp.
        assert_eq!(llama.end_of_turn_ids(), [128_008, 128_009], "{source}");
        for special in 128_000..128_256 {
            assert_eq!(
                llama.kind(special),
                Some(TokenKind::Control),
                "{source} {special}"
            );
            assert_eq!(llama.decode(&[special], DecodeOptions::default()), "");
        }
        // Without parse_special a special token's text is plain text.
        assert_eq!(
            llama.encode("<|eot_id|>", false),
            [27, 91, 68, 354, 851, 91, 29],
            "{source}"
        );
    }

    for (source, qwen) in loaded(&dir, "qwen") {
        assert_eq!(id(&qwen, "<|endoftext|>"), 151_643);
        assert_eq!(id(&qwen, "<|im_start|>"), 151_644);
        assert_eq!(id(&qwen, "<|im_end|>"), 151_645);
        assert_eq!(id(&qwen, "</think>"), 151_668);
        assert_eq!(qwen.eos_token(), Some("<|im_end|>"), "{source}");
        assert!(!qwen.add_bos(), "{source}");
        assert_eq!(qwen.end_of_turn_ids(), [151_645], "{source}");
        assert_eq!(qwen.kind(151_644), Some(TokenKind::Control), "{source}");
        assert!(qwen.encode("<|im_start|>", false).len() > 1, "{source}");
        // Qwen 3's non-special added tokens: matched without parse_special, kept in decoding.
        for (text, want) in [
            ("<think>", 151_667),
            ("<tool_call>", 151_657),
            ("<tool_response>", 151_665),
        ] {
            assert_eq!(
                qwen.kind(want),
                Some(TokenKind::UserDefined),
                "{source} {text}"
            );
            assert_eq!(qwen.encode(text, false), [want], "{source} {text}");
            assert_eq!(qwen.decode(&[want], DecodeOptions::default()), text);
        }
    }
    // The GGUF-only load: the converter's BOS for Qwen, the padded vocabulary.
    let [(_, qwen), _] = loaded(&dir, "qwen");
    assert_eq!(qwen.vocab_size(), 151_936);
    assert_eq!(qwen.bos_token(), Some("<|endoftext|>"));

    // The chat templates the converter copied are the directories' (and so llama.cpp's
    // models/templates copies).
    for family in FAMILIES {
        let md = metadata(&dir.join(format!("{family}.gguf")));
        let config: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(dir.join(family).join("tokenizer_config.json")).unwrap(),
        )
        .unwrap();
        let template = gguf_chat_template(&md).expect("chat template in the GGUF");
        assert_eq!(
            Some(template.as_str()),
            config["chat_template"].as_str(),
            "{family}"
        );
    }
}
