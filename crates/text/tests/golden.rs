//! The tokenizer built from the real default model's GGUF metadata against llama.cpp's ids
//! (tests/fixtures, copied from the golden set), and the Gemma 3 template against the prompts
//! llama.cpp was given.

use std::collections::HashMap;
use std::path::PathBuf;

use candle_core::quantized::gguf_file;
use serde::Deserialize;
use temper_text::{
    gguf_chat_template, ChatMessage, ChatTemplate, DecodeOptions, DecodeStream, TemplateInput,
    Tokenizer,
};

/// The GGUF metadata of the default model, or `None` (skip) when the file is absent and
/// `TEMPER_REQUIRE_MODEL=1` is not set.
fn metadata() -> Option<HashMap<String, gguf_file::Value>> {
    let path = temper_model::paths::real_model_for_tests()?;
    let mut file =
        std::fs::File::open(&path).unwrap_or_else(|e| panic!("opening {}: {e}", path.display()));
    let content = gguf_file::Content::read(&mut file)
        .unwrap_or_else(|e| panic!("reading GGUF metadata of {}: {e}", path.display()));
    Some(content.metadata)
}

fn fixture(name: &str) -> String {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

#[derive(Deserialize)]
struct TokenizeCase {
    text: String,
    parse_special: bool,
    ids: Vec<u32>,
}

#[derive(Deserialize)]
struct GreedyCase {
    message: String,
    prompt_ids: Vec<u32>,
    ids: Vec<u32>,
    text: String,
}

#[test]
fn tokenize_matches_llama_cpp_on_every_golden_line() {
    let Some(md) = metadata() else { return };
    let tok = Tokenizer::from_gguf_metadata(&md).expect("tokenizer from GGUF metadata");
    assert_eq!(tok.vocab_size(), 262_144);
    assert_eq!(tok.bos_token(), Some("<bos>"));
    assert_eq!(tok.eos_token(), Some("<eos>"));
    // This GGUF carries no chat template; the shipped GEMMA3 one is used instead.
    assert_eq!(gguf_chat_template(&md), None);

    let keep = DecodeOptions {
        skip_special_tokens: false,
        spaces_between_special_tokens: false,
    };
    let mut lines = 0;
    let mut failures = Vec::new();
    for (n, line) in fixture("tokenize.jsonl").lines().enumerate() {
        let case: TokenizeCase = serde_json::from_str(line).expect("golden line is JSON");
        lines += 1;
        let ids = tok.encode(&case.text, case.parse_special);
        if ids != case.ids {
            failures.push(format!(
                "line {}: {:?} (parse_special {}): got {:?}, llama.cpp {:?}",
                n + 1,
                case.text,
                case.parse_special,
                ids,
                case.ids
            ));
            continue;
        }
        // Decoding gives the text back (Gemma has no space prefix to strip); a literal `▁` in
        // the input decodes to a plain space, the one place pieces do not round-trip.
        let text = tok.decode(&ids, keep);
        if text != case.text.replace('\u{2581}', " ") {
            failures.push(format!(
                "line {}: decode {:?} != {:?}",
                n + 1,
                text,
                case.text
            ));
        }
        // Streaming one token at a time gives the same text.
        let mut stream = DecodeStream::new(keep);
        let mut streamed: String = ids.iter().map(|&id| stream.step(&tok, id)).collect();
        streamed.push_str(&stream.flush());
        if streamed != text {
            failures.push(format!(
                "line {}: streamed {:?} != {:?}",
                n + 1,
                streamed,
                text
            ));
        }
    }
    assert_eq!(lines, 385, "golden file should have 385 lines");
    assert!(
        failures.is_empty(),
        "{} of {lines} golden lines differ:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn gemma3_template_prompt_and_decode_match_llama_cpp() {
    let Some(md) = metadata() else { return };
    let tok = Tokenizer::from_gguf_metadata(&md).expect("tokenizer from GGUF metadata");
    let template = ChatTemplate::new(
        ChatTemplate::GEMMA3,
        tok.bos_token().map(str::to_string),
        tok.eos_token().map(str::to_string),
    )
    .expect("GEMMA3 compiles");
    let kwargs = serde_json::Map::new();
    let mut count = 0;
    for line in fixture("greedy-sample.jsonl").lines() {
        let case: GreedyCase = serde_json::from_str(line).expect("golden line is JSON");
        count += 1;
        let messages = [ChatMessage::text("user", case.message.clone())];
        let prompt = template
            .render(&TemplateInput {
                messages: &messages,
                tools: None,
                documents: None,
                add_generation_prompt: true,
                continue_final_message: false,
                reasoning_effort: None,
                kwargs: &kwargs,
            })
            .expect("render");
        assert_eq!(
            prompt,
            format!(
                "<bos><start_of_turn>user\n{}<end_of_turn>\n<start_of_turn>model\n",
                case.message
            )
        );
        assert_eq!(tok.encode(&prompt, true), case.prompt_ids, "prompt ids");
        assert_eq!(
            tok.decode(&case.ids, DecodeOptions::default()),
            case.text,
            "decoded continuation"
        );
    }
    assert_eq!(count, 5);
}

#[test]
fn decode_stream_handles_byte_fallback_emoji() {
    let Some(md) = metadata() else { return };
    let tok = Tokenizer::from_gguf_metadata(&md).expect("tokenizer from GGUF metadata");
    // U+1FAE9 is not a piece: it encodes as four byte tokens.
    let text = "a \u{1FAE9} b";
    let ids = tok.encode(text, false);
    let bytes: Vec<u32> = ["<0xF0>", "<0x9F>", "<0xAB>", "<0xA9>"]
        .iter()
        .map(|p| tok.token_id(p).expect("byte piece"))
        .collect();
    assert!(
        ids.windows(4).any(|w| w == bytes.as_slice()),
        "{ids:?} should hold the byte tokens {bytes:?}"
    );
    let mut stream = DecodeStream::new(DecodeOptions::default());
    let steps: Vec<String> = ids.iter().map(|&id| stream.step(&tok, id)).collect();
    assert_eq!(stream.flush(), "");
    // No step splits the emoji: three byte tokens yield nothing, the fourth the whole char.
    assert!(steps.iter().all(|s| !s.contains('\u{FFFD}')));
    assert!(
        steps.contains(&"\u{1FAE9}".to_string()) || steps.iter().any(|s| s.ends_with('\u{1FAE9}'))
    );
    assert_eq!(steps.concat(), text);
}

/// The byte floor a server checks before tokenizing holds on every golden text: no encoding
/// has fewer tokens than its bytes over `max_text_bytes_per_token`.
#[test]
fn token_count_floor_from_bytes_holds_on_the_golden_texts() {
    let Some(md) = metadata() else { return };
    let tok = Tokenizer::from_gguf_metadata(&md).expect("tokenizer from GGUF metadata");
    let per_token = tok.max_text_bytes_per_token();
    println!("Gemma 3: at most {per_token} bytes of text per token");
    assert!((8..=256).contains(&per_token), "{per_token}");
    for line in fixture("tokenize.jsonl").lines() {
        let case: TokenizeCase = serde_json::from_str(line).expect("golden line is JSON");
        let ids = tok.encode(&case.text, case.parse_special);
        assert!(ids.len() >= case.text.len() / per_token, "{:?}", case.text);
    }
    let spaces = " ".repeat(10_000);
    assert!(tok.encode(&spaces, false).len() >= spaces.len() / per_token);
}

/// The Hugging Face export (`Tokenizer::to_hf_files`: scores become ranked merges) read back as a
/// `tokenizer.json` gives llama.cpp's ids on every golden line.
#[test]
fn the_hugging_face_export_gives_the_same_ids() {
    let Some(md) = metadata() else { return };
    let tok = Tokenizer::from_gguf_metadata(&md).expect("tokenizer from GGUF metadata");
    let files = tok.to_hf_files(Some(ChatTemplate::GEMMA3)).expect("export");
    let back = Tokenizer::from_tokenizer_json(&files.tokenizer_json).expect("read back");
    let config: serde_json::Value = serde_json::from_str(&files.tokenizer_config_json).unwrap();
    assert_eq!(config["chat_template"], ChatTemplate::GEMMA3);
    assert_eq!(config["bos_token"], "<bos>");
    for line in fixture("tokenize.jsonl").lines() {
        let case: TokenizeCase = serde_json::from_str(line).expect("golden line is JSON");
        assert_eq!(
            back.encode(&case.text, case.parse_special),
            case.ids,
            "{:?} (parse_special {})",
            case.text,
            case.parse_special
        );
    }
}
