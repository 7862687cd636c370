//! Byte-level BPE (GPT-2 style: `tokenizer.ggml.model = gpt2`, as Llama 3, Qwen 2/3 and SmolLM
//! have): each word the pre-tokenizer regex splits off is written as one character per UTF-8
//! byte (the GPT-2 byte↔unicode map) and merged by rank. Pre-tokenization and merging are the
//! `tokenizers` crate's own (candle-core already builds it, with `fancy-regex` for the
//! look-ahead in these patterns); special pieces are split off before, as for SentencePiece.

use std::sync::OnceLock;

use tokenizers::models::bpe::{Merges, Vocab, BPE};
use tokenizers::normalizers::NFC;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{
    Model, NormalizedString, Normalizer, NormalizerWrapper, OffsetReferential, OffsetType,
    PreTokenizedString, PreTokenizer, PreTokenizerWrapper, SplitDelimiterBehavior,
};

use crate::TextError;

/// GPT-2's word pattern (Hugging Face `ByteLevel` with `use_regex`).
const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
/// Llama 3's, as in its tokenizer.json (llama.cpp spells the `(?i:…)` out for std::regex).
const LLAMA3: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen 2's: Llama 3's with single digits.
const QWEN2: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen 3.5's: Qwen 2's with combining marks kept in words.
const QWEN35: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// How one `tokenizer.ggml.pre` family splits text, from llama.cpp's `llm_tokenizer_bpe`.
struct PreFamily {
    names: &'static [&'static str],
    /// Applied in turn, each splitting the pieces of the previous one (matches and the text
    /// between them both become pieces).
    regexes: &'static [&'static str],
    /// A word that is itself a token is not merged (Hugging Face `ignore_merges`).
    ignore_merges: bool,
    /// The family's default for `tokenizer.ggml.add_bos_token`.
    add_bos: bool,
    /// The family's tokenizer.json composes text (Qwen's NFC normalizer); llama.cpp skips it.
    nfc: bool,
}

const FAMILIES: &[PreFamily] = &[
    PreFamily {
        names: &[
            "llama-bpe",
            "llama3",
            "llama-v3",
            "falcon3",
            "falcon-h1",
            "pixtral",
            "midm-2.0",
            "lfm2",
        ],
        regexes: &[LLAMA3],
        ignore_merges: true,
        add_bos: true,
        nfc: false,
    },
    PreFamily {
        names: &["dbrx", "smaug-bpe"],
        regexes: &[LLAMA3],
        ignore_merges: false,
        add_bos: false,
        nfc: false,
    },
    PreFamily {
        names: &["qwen2", "deepseek-r1-qwen"],
        regexes: &[QWEN2],
        ignore_merges: false,
        add_bos: false,
        nfc: true,
    },
    PreFamily {
        names: &["stablelm2", "megrez"],
        regexes: &[QWEN2],
        ignore_merges: false,
        add_bos: false,
        nfc: false,
    },
    PreFamily {
        names: &["qwen35"],
        regexes: &[QWEN35],
        ignore_merges: false,
        add_bos: false,
        nfc: true,
    },
    PreFamily {
        names: &[
            "smollm",
            "starcoder",
            "refact",
            "command-r",
            "codeshell",
            "exaone",
            "minerva-7b",
        ],
        regexes: &[r"\p{N}", GPT2],
        ignore_merges: false,
        add_bos: false,
        nfc: false,
    },
    PreFamily {
        names: &[
            "gpt-2",
            "phi-2",
            "mpt",
            "olmo",
            "jais",
            "jina-es",
            "jina-de",
            "jina-v2-es",
            "jina-v2-de",
            "gigachat",
            "a.x-4.0",
            "mellum",
            "modern-bert",
            "trillion",
            "granite-docling",
            "exaone4",
        ],
        regexes: &[GPT2],
        ignore_merges: false,
        add_bos: false,
        nfc: false,
    },
    PreFamily {
        // llama.cpp's fallback when a file names none.
        names: &["default"],
        regexes: &[r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", "[0-9][0-9][0-9]"],
        ignore_merges: false,
        add_bos: false,
        nfc: false,
    },
];

/// The byte-level half of a tokenizer: text in, token ids out.
pub(crate) struct ByteLevelBpe {
    normalizer: Option<NormalizerWrapper>,
    pre: PreTokenizerWrapper,
    bpe: BPE,
}

/// A GGUF byte-level vocabulary's encoder and its family's BOS default.
pub(crate) struct FromGguf {
    pub bpe: ByteLevelBpe,
    pub add_bos: bool,
}

fn tk_err(what: &str, e: impl std::fmt::Display) -> TextError {
    TextError::Metadata(format!("{what}: {e}"))
}

impl ByteLevelBpe {
    /// From GGUF `tokenizer.ggml.tokens` and `tokenizer.ggml.merges` (`"left right"`) with the
    /// pre-tokenizer named by `tokenizer.ggml.pre` (absent: llama.cpp's `default`).
    pub fn from_gguf(
        pre: Option<&str>,
        pieces: &[String],
        merges: &[String],
    ) -> Result<FromGguf, TextError> {
        let name = pre.unwrap_or("default");
        let family = FAMILIES
            .iter()
            .find(|f| f.names.contains(&name))
            .ok_or_else(|| {
                let known: Vec<&str> = FAMILIES.iter().flat_map(|f| f.names).copied().collect();
                TextError::Unsupported(format!(
                    "tokenizer.ggml.pre {name:?} (supported: {})",
                    known.join(", ")
                ))
            })?;
        let mut steps = family
            .regexes
            .iter()
            .map(|r| {
                Split::new(
                    SplitPattern::Regex((*r).to_string()),
                    SplitDelimiterBehavior::Isolated,
                    false,
                )
                .map(PreTokenizerWrapper::Split)
                .map_err(|e| tk_err("pre-tokenizer regex", e))
            })
            .collect::<Result<Vec<_>, _>>()?;
        steps.push(PreTokenizerWrapper::ByteLevel(ByteLevel::new(
            false, false, false,
        )));
        let vocab: Vocab = pieces
            .iter()
            .enumerate()
            .map(|(i, p)| (p.clone(), i as u32))
            .collect();
        let merges = merges
            .iter()
            .map(|m| {
                // As llama.cpp: the separator is the first space after the first character.
                let at = m
                    .char_indices()
                    .skip(1)
                    .find(|&(_, c)| c == ' ')
                    .map(|(i, _)| i)
                    .ok_or_else(|| {
                        TextError::Metadata(format!("tokenizer.ggml.merges entry {m:?}"))
                    })?;
                Ok((m[..at].to_string(), m[at + 1..].to_string()))
            })
            .collect::<Result<Merges, TextError>>()?;
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .ignore_merges(family.ignore_merges)
            .build()
            .map_err(|e| tk_err("tokenizer.ggml.merges", e))?;
        Ok(FromGguf {
            bpe: ByteLevelBpe {
                normalizer: family.nfc.then_some(NormalizerWrapper::NFC(NFC)),
                pre: PreTokenizerWrapper::Sequence(Sequence::new(steps)),
                bpe,
            },
            add_bos: family.add_bos,
        })
    }

    /// From a tokenizer.json's `normalizer`, `pre_tokenizer` and BPE `model`, as they are.
    pub fn from_json(
        normalizer: Option<&serde_json::Value>,
        pre: &serde_json::Value,
        model: &serde_json::Value,
    ) -> Result<Self, TextError> {
        fn parse<T: serde::de::DeserializeOwned>(
            what: &str,
            v: &serde_json::Value,
        ) -> Result<T, TextError> {
            // From text: `tokenizers`' BPE deserializer borrows strings, which a Value cannot
            // lend.
            serde_json::from_str(&v.to_string())
                .map_err(|e| TextError::TokenizerJson(format!("{what}: {e}")))
        }
        Ok(ByteLevelBpe {
            normalizer: match normalizer {
                Some(n) if !n.is_null() => Some(parse("normalizer", n)?),
                _ => None,
            },
            pre: parse("pre_tokenizer", pre)?,
            bpe: parse("model", model)?,
        })
    }

    /// The `tokenizers` normalizer, pre-tokenizer and model as `tokenizer.json` writes them.
    pub(crate) fn hf_parts(
        &self,
    ) -> Result<(serde_json::Value, serde_json::Value, serde_json::Value), TextError> {
        let err = |e: serde_json::Error| tk_err("exporting the tokenizer", e);
        Ok((
            serde_json::to_value(&self.normalizer).map_err(err)?,
            serde_json::to_value(&self.pre).map_err(err)?,
            serde_json::to_value(&self.bpe).map_err(err)?,
        ))
    }

    /// Appends the ids of `text` (a fragment with no special pieces) to `out`.
    pub fn encode(&self, text: &str, out: &mut Vec<u32>) {
        let mut normalized = NormalizedString::from(text);
        if let Some(n) = &self.normalizer {
            // Unicode normalizers cannot fail.
            let _ = n.normalize(&mut normalized);
        }
        let mut words = PreTokenizedString::from(normalized);
        // Splitting by regex and byte mapping cannot fail: a regex that hits fancy-regex's
        // backtracking limit ends its matches there and leaves the rest one word.
        let _ = self.pre.pre_tokenize(&mut words);
        for (word, _, _) in words.get_splits(OffsetReferential::Original, OffsetType::None) {
            // BPE without dropout has no error path (a character missing from a malformed
            // vocabulary is skipped, as in Hugging Face).
            if let Ok(tokens) = self.bpe.tokenize(word) {
                out.extend(tokens.iter().map(|t| t.id));
            }
        }
    }
}

/// Bytes GPT-2's byte↔unicode map leaves as themselves (printable Latin-1).
fn printable(b: u8) -> bool {
    matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF)
}

/// The other bytes, in order: GPT-2 writes the n-th of them as U+0100 + n.
fn shifted_bytes() -> &'static [u8] {
    static BYTES: OnceLock<Vec<u8>> = OnceLock::new();
    BYTES.get_or_init(|| (0..=255u8).filter(|&b| !printable(b)).collect())
}

/// The bytes a byte-level piece stands for. A character outside the map (not from a
/// byte-level vocabulary) stands for its own UTF-8.
pub(crate) fn piece_bytes(piece: &str) -> Vec<u8> {
    let shifted = shifted_bytes();
    let mut out = Vec::with_capacity(piece.len());
    for ch in piece.chars() {
        let byte = match u32::from(ch) {
            c @ 0..=0xFF if printable(c as u8) => Some(c as u8),
            c @ 0x100.. => shifted.get((c - 0x100) as usize).copied(),
            _ => None,
        };
        match byte {
            Some(b) => out.push(b),
            None => out.extend_from_slice(ch.encode_utf8(&mut [0; 4]).as_bytes()),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_map_is_gpt2s() {
        assert_eq!(shifted_bytes().len(), 68);
        for (piece, bytes) in [
            ("Ā", &[0x00u8][..]),
            ("ĉ", b"\t"),
            ("Ċ", b"\n"),
            ("Ġ", b" "),
            ("ġ", &[0x7F]),
            ("ł", &[0xA0]),
            ("Ń", &[0xAD]),
            ("a~¡ÿ", &[b'a', b'~', 0xA1, 0xFF]),
            ("ĠhelloĊ", b" hello\n"),
            ("ń", "ń".as_bytes()),
        ] {
            assert_eq!(piece_bytes(piece), bytes, "{piece}");
        }
    }
}
