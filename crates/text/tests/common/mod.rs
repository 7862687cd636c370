//! Helpers shared by the tokenizer tests that compare ids with a reference's.
#![allow(dead_code)] // each test binary uses its own subset

use std::path::Path;

use serde::de::DeserializeOwned;
use temper_text::{DecodeOptions, DecodeStream, Tokenizer};

/// The cases of an `expected.jsonl` file, one JSON object per line.
pub fn jsonl_cases<T: DeserializeOwned>(path: &Path) -> Vec<T> {
    std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .lines()
        .map(|l| serde_json::from_str(l).expect("expected.jsonl line"))
        .collect()
}

/// `ids` decoded a token at a time, as a stream is.
pub fn streamed(tok: &Tokenizer, ids: &[u32], opts: DecodeOptions) -> String {
    let mut stream = DecodeStream::new(opts);
    let mut text: String = ids.iter().map(|&id| stream.step(tok, id)).collect();
    text.push_str(&stream.flush());
    text
}
