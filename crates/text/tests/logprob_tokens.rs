//! Every token a chat completion's logprobs show (`Tokenizer::logprob_token`) maps back to the
//! id sampled (`Tokenizer::id_of_logprob_token`), over whole vocabularies: the tiny random
//! model's and, when present, the real default model's.

use std::collections::HashMap;

use temper_text::{load_tokenizer, TokenKind, Tokenizer};

/// What the round trip found over the vocabulary.
struct RoundTrip {
    /// Ids that share their entry with another id, with the id they map back to.
    ambiguous: Vec<(u32, u32)>,
    /// Ids whose `token` is not their bytes (a partial UTF-8 character shown as U+FFFD).
    lossy: Vec<u32>,
}

/// Emits every id as the server does and maps the entry back, with its bytes and without.
/// Ids sharing their bytes must map to the documented choice: the lowest id that is not a
/// byte-fallback piece, else the lowest id; every other id to itself.
impl RoundTrip {
    /// The ambiguous ids answered by another id (all byte-fallback pieces, checked).
    fn remapped(&self) -> Vec<u32> {
        self.ambiguous
            .iter()
            .filter(|(id, want)| id != want)
            .map(|(id, _)| *id)
            .collect()
    }
}

fn round_trip(tok: &Tokenizer) -> RoundTrip {
    let n = tok.vocab_size() as u32;
    let mut by_bytes: HashMap<Vec<u8>, Vec<u32>> = HashMap::new();
    for id in 0..n {
        let (_, bytes) = tok.logprob_token(id).unwrap();
        by_bytes.entry(bytes).or_default().push(id);
    }
    let mut out = RoundTrip {
        ambiguous: Vec::new(),
        lossy: Vec::new(),
    };
    for id in 0..n {
        let (token, bytes) = tok.logprob_token(id).unwrap();
        let same = &by_bytes[&bytes];
        let want = same
            .iter()
            .copied()
            .find(|&i| tok.kind(i) != Some(TokenKind::Byte))
            .unwrap_or(same[0]);
        let piece = tok.piece(id).unwrap();
        assert_eq!(
            tok.id_of_logprob_token(&token, Some(&bytes)),
            Some(want),
            "id {id} {piece:?}: token {token:?} bytes {bytes:?}"
        );
        if same.len() > 1 {
            out.ambiguous.push((id, want));
            if want != id {
                assert_eq!(tok.kind(id), Some(TokenKind::Byte), "id {id} {piece:?}");
            }
        }
        if token.as_bytes() == bytes {
            // Without bytes the string alone decides, the same way.
            assert_eq!(
                tok.id_of_logprob_token(&token, None),
                Some(want),
                "id {id} {piece:?} without bytes"
            );
        } else {
            out.lossy.push(id);
            assert!(token.contains('\u{FFFD}'), "id {id} {piece:?}: {token:?}");
            // The string alone is U+FFFD itself, never this id; a token that disagrees
            // with the bytes is refused.
            assert_ne!(tok.id_of_logprob_token(&token, None), Some(id));
            assert_eq!(tok.id_of_logprob_token("x", Some(&bytes)), None);
        }
    }
    out
}

fn tiny() -> Tokenizer {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny.gguf");
    temper_model::tiny::write_tiny_gguf(&path, 7).unwrap();
    let loaded = temper_model::load_gguf(&path).unwrap();
    load_tokenizer(&loaded.metadata, &path).unwrap()
}

#[test]
fn every_tiny_model_token_round_trips() {
    let tok = tiny();
    let found = round_trip(&tok);
    let id = |piece: &str| tok.token_id(piece).unwrap();
    // The byte-fallback pieces of `\n`, space and the 73 single characters the vocabulary also
    // has as pieces, with those pieces.
    println!(
        "ambiguous ids: {}, byte-fallback pieces answered by another piece: {}",
        found.ambiguous.len(),
        found.remapped().len()
    );
    assert_eq!(found.ambiguous.len(), 2 * 75);
    assert_eq!(found.remapped().len(), 75);
    for (byte, piece) in [("<0x0A>", "\n"), ("<0x20>", "\u{2581}"), ("<0x61>", "a")] {
        assert!(found.ambiguous.contains(&(id(byte), id(piece))));
        assert!(found.ambiguous.contains(&(id(piece), id(piece))));
    }
    // The byte-fallback pieces 0x80..=0xFF.
    assert_eq!(found.lossy.len(), 128);
    // `\r` and the rest of the control characters are byte-fallback pieces alone.
    assert_eq!(
        tok.id_of_logprob_token("\r", Some(b"\r")),
        Some(id("<0x0D>"))
    );
    assert_eq!(tok.id_of_logprob_token("\r", None), Some(id("<0x0D>")));
    let eot = id("<end_of_turn>");
    assert_eq!(
        tok.logprob_token(eot),
        Some(("<end_of_turn>".to_owned(), b"<end_of_turn>".to_vec()))
    );
    assert_eq!(
        tok.id_of_logprob_token(" the", None),
        Some(id("\u{2581}the"))
    );
    // A vocabulary piece as written is still understood without bytes.
    assert_eq!(
        tok.id_of_logprob_token("\u{2581}the", None),
        Some(id("\u{2581}the"))
    );
    assert_eq!(tok.id_of_logprob_token("<0x0D>", None), Some(id("<0x0D>")));
    assert_eq!(tok.id_of_logprob_token("no-such-token", None), None);
    assert_eq!(tok.logprob_token(tok.vocab_size() as u32), None);
}

#[test]
fn every_default_model_token_round_trips() {
    let Some(path) = temper_model::paths::real_model_for_tests() else {
        return;
    };
    let mut file = std::fs::File::open(&path).unwrap();
    let content = candle_core::quantized::gguf_file::Content::read(&mut file).unwrap();
    let tok = load_tokenizer(&content.metadata, &path).unwrap();
    let found = round_trip(&tok);
    // 110 byte-fallback pieces whose byte is also a piece of its own, and those pieces; the
    // 128 of bytes 0x80..=0xFF show U+FFFD.
    println!(
        "ambiguous ids: {}, byte-fallback pieces answered by another piece: {}",
        found.ambiguous.len(),
        found.remapped().len()
    );
    assert_eq!(found.ambiguous.len(), 220);
    assert_eq!(found.remapped().len(), 110);
    assert_eq!(found.lossy.len(), 128);
    let id = |piece: &str| tok.token_id(piece).unwrap();
    assert_eq!(
        tok.id_of_logprob_token("\r", Some(b"\r")),
        Some(id("<0x0D>"))
    );
    assert_eq!(tok.id_of_logprob_token("\n", Some(b"\n")), Some(id("\n")));
    assert_eq!(
        tok.id_of_logprob_token("<end_of_turn>", Some(b"<end_of_turn>")),
        Some(id("<end_of_turn>"))
    );
}
