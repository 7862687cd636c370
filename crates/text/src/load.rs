//! Building a `Tokenizer` from GGUF metadata or a Hugging Face `tokenizer.json`.

use std::collections::HashMap;
use std::path::Path;
use std::sync::OnceLock;

use candle_core::quantized::gguf_file::Value as GgufValue;
use serde_json::Value as Json;

use crate::bytelevel::{ByteLevelBpe, FromGguf};
use crate::merge::{FxMap, MergeRule, RankMerges};
use crate::partition::{SpecialPiece, SpecialPieces};
use crate::tokenizer::{
    byte_piece_value, Model, PrefixMode, SplitBehavior, SpmModel, TextRules, TokenKind, Tokenizer,
};
use crate::TextError;

/// Texts llama.cpp treats as end-of-generation and therefore forces to control type even when
/// the GGUF says otherwise (Gemma's `</s>` is user-defined there). Control pieces are only
/// matched with `parse_special` and are dropped by `skip_special_tokens`.
const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "<|end_of_text|>",
    "<end_of_utterance>",
];

/// Texts of the tokens that end an assistant turn in the families we know.
const END_OF_TURN_TEXTS: &[&str] = &[
    "<end_of_turn>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|im_end|>",
    "<|end|>",
];

/// `explicit` (ids the file names) and the vocabulary's [`END_OF_TURN_TEXTS`], sorted.
fn end_of_turn(explicit: impl IntoIterator<Item = u32>, ids: &FxMap<String, u32>) -> Vec<u32> {
    let mut out: Vec<u32> = explicit
        .into_iter()
        .chain(
            END_OF_TURN_TEXTS
                .iter()
                .filter_map(|t| ids.get(*t).copied()),
        )
        .collect();
    out.sort_unstable();
    out.dedup();
    out
}

fn md_err(msg: impl Into<String>) -> TextError {
    TextError::Metadata(msg.into())
}

fn gguf_u32(v: &GgufValue) -> Option<u32> {
    match *v {
        GgufValue::U8(x) => Some(u32::from(x)),
        GgufValue::U16(x) => Some(u32::from(x)),
        GgufValue::U32(x) => Some(x),
        GgufValue::I8(x) => u32::try_from(x).ok(),
        GgufValue::I16(x) => u32::try_from(x).ok(),
        GgufValue::I32(x) => u32::try_from(x).ok(),
        GgufValue::U64(x) => u32::try_from(x).ok(),
        GgufValue::I64(x) => u32::try_from(x).ok(),
        _ => None,
    }
}

fn gguf_i64(v: &GgufValue) -> Option<i64> {
    match *v {
        GgufValue::U8(x) => Some(i64::from(x)),
        GgufValue::U16(x) => Some(i64::from(x)),
        GgufValue::U32(x) => Some(i64::from(x)),
        GgufValue::I8(x) => Some(i64::from(x)),
        GgufValue::I16(x) => Some(i64::from(x)),
        GgufValue::I32(x) => Some(i64::from(x)),
        GgufValue::U64(x) => i64::try_from(x).ok(),
        GgufValue::I64(x) => Some(x),
        _ => None,
    }
}

fn gguf_f32(v: &GgufValue) -> Option<f32> {
    match *v {
        GgufValue::F32(x) => Some(x),
        GgufValue::F64(x) => Some(x as f32),
        _ => gguf_i64(v).map(|x| x as f32),
    }
}

fn gguf_array<'a>(
    md: &'a HashMap<String, GgufValue>,
    key: &str,
) -> Result<Option<&'a Vec<GgufValue>>, TextError> {
    match md.get(key) {
        None => Ok(None),
        Some(GgufValue::Array(a)) => Ok(Some(a)),
        Some(_) => Err(md_err(format!("{key} is not an array"))),
    }
}

fn gguf_strings(md: &HashMap<String, GgufValue>, key: &str) -> Result<Vec<String>, TextError> {
    gguf_array(md, key)?
        .ok_or_else(|| md_err(format!("{key} is missing")))?
        .iter()
        .map(|t| match t {
            GgufValue::String(s) => Ok(s.clone()),
            _ => Err(md_err(format!("{key} holds a non-string"))),
        })
        .collect()
}

fn gguf_bool(md: &HashMap<String, GgufValue>, key: &str) -> Result<Option<bool>, TextError> {
    match md.get(key) {
        None => Ok(None),
        Some(GgufValue::Bool(b)) => Ok(Some(*b)),
        Some(_) => Err(md_err(format!("{key} is not a bool"))),
    }
}

fn gguf_id(md: &HashMap<String, GgufValue>, key: &str, n: usize) -> Option<u32> {
    md.get(key)
        .and_then(gguf_u32)
        .filter(|&id| (id as usize) < n)
}

/// `tokenizer.chat_template` from the GGUF metadata, if any.
pub fn gguf_chat_template(gguf_metadata: &HashMap<String, GgufValue>) -> Option<String> {
    match gguf_metadata.get("tokenizer.chat_template") {
        Some(GgufValue::String(s)) => Some(s.clone()),
        _ => None,
    }
}

fn byte_ids(ids: &FxMap<String, u32>) -> [Option<u32>; 256] {
    let mut out = [None; 256];
    for (b, slot) in out.iter_mut().enumerate() {
        // As llama.cpp's byte_to_token: the `<0xNN>` piece, else the byte itself as a piece.
        *slot = ids.get(&format!("<0x{b:02X}>")).copied().or_else(|| {
            char::from_u32(b as u32)
                .filter(|c| c.is_ascii())
                .and_then(|c| ids.get(c.encode_utf8(&mut [0; 4]) as &str).copied())
        });
    }
    out
}

fn id_map(pieces: &[String]) -> FxMap<String, u32> {
    let mut ids = FxMap::default();
    ids.reserve(pieces.len());
    for (i, p) in pieces.iter().enumerate() {
        // Later duplicates win, like llama.cpp's token_to_id.
        ids.insert(p.clone(), i as u32);
    }
    ids
}

/// The SentencePiece-style half of a `llama` GGUF vocabulary: scores and add_space_prefix.
fn gguf_spm(
    md: &HashMap<String, GgufValue>,
    ids: &FxMap<String, u32>,
    n: usize,
) -> Result<SpmModel, TextError> {
    let scores = match gguf_array(md, "tokenizer.ggml.scores")? {
        Some(a) if a.len() == n => a
            .iter()
            .map(|v| gguf_f32(v).ok_or_else(|| md_err("tokenizer.ggml.scores holds a non-number")))
            .collect::<Result<Vec<_>, _>>()?,
        Some(_) => return Err(md_err("tokenizer.ggml.scores length differs from tokens")),
        None => vec![0.0; n],
    };
    // llama.cpp's default for SentencePiece vocabularies.
    let add_space_prefix = gguf_bool(md, "tokenizer.ggml.add_space_prefix")?.unwrap_or(true);
    Ok(SpmModel {
        scores,
        byte_ids: byte_ids(ids),
        rule: MergeRule::Scores,
        text: TextRules {
            space: Some("\u{2581}".to_string()),
            prefix: if add_space_prefix {
                PrefixMode::Always
            } else {
                PrefixMode::Never
            },
            splits: Vec::new(),
            ignore_merges: false,
            byte_fallback: true,
            fuse_unk: false,
        },
    })
}

impl Tokenizer {
    /// From GGUF metadata: tokens, token_type, bos/eos/eot/eom/unknown ids, add_bos_token, and
    /// for `tokenizer.ggml.model == "llama"` (SentencePiece-style) scores and add_space_prefix,
    /// for `"gpt2"` (byte-level BPE) merges and the pre-tokenizer `tokenizer.ggml.pre`.
    pub fn from_gguf_metadata(md: &HashMap<String, GgufValue>) -> Result<Self, TextError> {
        let byte_level = match md.get("tokenizer.ggml.model") {
            Some(GgufValue::String(m)) if m == "llama" => false,
            Some(GgufValue::String(m)) if m == "gpt2" => true,
            Some(GgufValue::String(m)) => {
                return Err(TextError::Unsupported(format!(
                    "tokenizer.ggml.model {m:?} (\"llama\" SentencePiece-style and \"gpt2\" \
                     byte-level BPE are implemented)"
                )))
            }
            _ => return Err(md_err("tokenizer.ggml.model is missing")),
        };
        let pieces = gguf_strings(md, "tokenizer.ggml.tokens")?;
        let n = pieces.len();
        if n == 0 {
            return Err(md_err("tokenizer.ggml.tokens is empty"));
        }
        let mut kinds = match gguf_array(md, "tokenizer.ggml.token_type")? {
            Some(a) if a.len() == n => a
                .iter()
                .map(|v| match gguf_i64(v) {
                    Some(2) => Ok(TokenKind::Unknown),
                    Some(3) => Ok(TokenKind::Control),
                    Some(4) => Ok(TokenKind::UserDefined),
                    Some(5) => Ok(TokenKind::Unused),
                    Some(6) => Ok(TokenKind::Byte),
                    Some(_) => Ok(TokenKind::Normal),
                    None => Err(md_err("tokenizer.ggml.token_type holds a non-integer")),
                })
                .collect::<Result<Vec<_>, _>>()?,
            Some(_) => {
                return Err(md_err(
                    "tokenizer.ggml.token_type length differs from tokens",
                ))
            }
            None => vec![TokenKind::Normal; n],
        };
        for (kind, piece) in kinds.iter_mut().zip(&pieces) {
            if EOG_TEXTS.contains(&piece.as_str()) {
                *kind = TokenKind::Control;
            }
        }
        let ids = id_map(&pieces);
        let (model, add_bos) = if byte_level {
            let merges = gguf_strings(md, "tokenizer.ggml.merges")?;
            let pre = match md.get("tokenizer.ggml.pre") {
                Some(GgufValue::String(p)) => Some(p.as_str()),
                Some(_) => return Err(md_err("tokenizer.ggml.pre is not a string")),
                None => None,
            };
            let FromGguf { bpe, add_bos } = ByteLevelBpe::from_gguf(pre, &pieces, &merges)?;
            (Model::ByteLevel(Box::new(bpe)), add_bos)
        } else {
            (Model::Spm(Box::new(gguf_spm(md, &ids, n)?)), true)
        };
        let specials = SpecialPieces::new(pieces.iter().zip(&kinds).enumerate().filter_map(
            |(i, (p, k))| {
                let needs_parse_special = match k {
                    TokenKind::Control | TokenKind::Unknown => true,
                    TokenKind::UserDefined => false,
                    _ => return None,
                };
                Some((
                    p.as_str(),
                    SpecialPiece {
                        id: i as u32,
                        needs_parse_special,
                        lstrip: false,
                        rstrip: false,
                    },
                ))
            },
        ));
        let explicit_end = ["tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"]
            .iter()
            .filter_map(|k| gguf_id(md, k, n));
        Ok(Tokenizer {
            unk_id: gguf_id(md, "tokenizer.ggml.unknown_token_id", n),
            bos_id: gguf_id(md, "tokenizer.ggml.bos_token_id", n),
            eos_id: gguf_id(md, "tokenizer.ggml.eos_token_id", n),
            add_bos: gguf_bool(md, "tokenizer.ggml.add_bos_token")?.unwrap_or(add_bos),
            end_of_turn: end_of_turn(explicit_end, &ids),
            model,
            specials,
            logprob_ids: OnceLock::new(),
            pieces,
            kinds,
            ids,
        })
    }

    /// From a Hugging Face `tokenizer.json` with a BPE model (vocab + merges, byte fallback,
    /// added tokens) and either the SentencePiece-style space handling (`Replace`/`Prepend`
    /// normalizers, `Metaspace`/`Split` pre-tokenizers) or a `ByteLevel` pre-tokenizer, which
    /// makes it byte-level BPE run with the file's own normalizer and pre-tokenizers.
    pub fn from_tokenizer_json(json: &str) -> Result<Self, TextError> {
        let root: Json = serde_json::from_str(json)?;
        let bad = |msg: &str| TextError::TokenizerJson(msg.to_string());
        let model = root.get("model").ok_or_else(|| bad("no model"))?;
        match model.get("type").and_then(Json::as_str) {
            Some("BPE") | None => {}
            Some(other) => {
                return Err(TextError::Unsupported(format!(
                    "tokenizer.json model type {other}"
                )))
            }
        }
        for key in ["continuing_subword_prefix", "end_of_word_suffix"] {
            if model
                .get(key)
                .and_then(Json::as_str)
                .is_some_and(|s| !s.is_empty())
            {
                return Err(TextError::Unsupported(format!("BPE {key}")));
            }
        }
        let vocab = model
            .get("vocab")
            .and_then(Json::as_object)
            .ok_or_else(|| bad("model.vocab is not an object"))?;
        let mut entries: Vec<(u32, String)> = Vec::with_capacity(vocab.len());
        for (piece, id) in vocab {
            let id = id
                .as_u64()
                .and_then(|i| u32::try_from(i).ok())
                .ok_or_else(|| bad("model.vocab id is not a u32"))?;
            entries.push((id, piece.clone()));
        }
        struct Added {
            id: u32,
            content: String,
            special: bool,
            lstrip: bool,
            rstrip: bool,
        }
        let mut added = Vec::new();
        if let Some(list) = root.get("added_tokens").and_then(Json::as_array) {
            for t in list {
                let flag = |k: &str| t.get(k).and_then(Json::as_bool).unwrap_or(false);
                let id = t
                    .get("id")
                    .and_then(Json::as_u64)
                    .and_then(|i| u32::try_from(i).ok())
                    .ok_or_else(|| bad("added_tokens id is not a u32"))?;
                let content = t
                    .get("content")
                    .and_then(Json::as_str)
                    .ok_or_else(|| bad("added_tokens content is not a string"))?;
                added.push(Added {
                    id,
                    content: content.to_string(),
                    special: flag("special"),
                    lstrip: flag("lstrip"),
                    rstrip: flag("rstrip"),
                });
            }
        }
        let n = entries
            .iter()
            .map(|e| e.0)
            .chain(added.iter().map(|a| a.id))
            .max()
            .map_or(0, |m| m as usize + 1);
        if n == 0 {
            return Err(bad("empty vocabulary"));
        }
        // Ids no entry names stay as empty unused pieces.
        let mut pieces = vec![String::new(); n];
        let mut kinds = vec![TokenKind::Unused; n];
        let byte_fallback = model
            .get("byte_fallback")
            .and_then(Json::as_bool)
            .unwrap_or(false);
        for (id, piece) in entries {
            kinds[id as usize] = if byte_fallback && byte_piece_value(&piece).is_some() {
                TokenKind::Byte
            } else {
                TokenKind::Normal
            };
            pieces[id as usize] = piece;
        }
        let unk_id = match model.get("unk_token").and_then(Json::as_str) {
            Some(unk) => {
                let id = pieces.iter().position(|p| p == unk).or_else(|| {
                    added
                        .iter()
                        .find(|a| a.content == unk)
                        .map(|a| a.id as usize)
                });
                if let Some(id) = id {
                    kinds[id] = TokenKind::Unknown;
                }
                id.map(|i| i as u32)
            }
            None => None,
        };
        for a in &added {
            pieces[a.id as usize] = a.content.clone();
            kinds[a.id as usize] = if Some(a.id) == unk_id {
                TokenKind::Unknown
            } else if a.special {
                TokenKind::Control
            } else {
                TokenKind::UserDefined
            };
        }
        let ids = id_map(&pieces);
        let mut pre = Vec::new();
        if let Some(p) = root.get("pre_tokenizer") {
            flatten(p, "pretokenizers", &mut pre);
        }
        let byte_level = pre
            .iter()
            .any(|p| p.get("type").and_then(Json::as_str) == Some("ByteLevel"));
        let post_bos = json_post_bos(&root, &ids);
        let (model, add_bos) = if byte_level {
            let pre = root.get("pre_tokenizer").unwrap_or(&Json::Null);
            let bpe = ByteLevelBpe::from_json(root.get("normalizer"), pre, model)?;
            (Model::ByteLevel(Box::new(bpe)), post_bos.is_some())
        } else {
            let spm = SpmModel {
                scores: vec![0.0; n],
                byte_ids: byte_ids(&ids),
                rule: MergeRule::Ranks(json_rank_merges(model, &ids)?),
                text: json_text_rules(&root, model, byte_fallback)?,
            };
            // SentencePiece-style models (Gemma, Llama 2) want BOS.
            (Model::Spm(Box::new(spm)), true)
        };
        let specials = SpecialPieces::new(added.iter().map(|a| {
            (
                a.content.as_str(),
                SpecialPiece {
                    id: a.id,
                    needs_parse_special: a.special,
                    lstrip: a.lstrip,
                    rstrip: a.rstrip,
                },
            )
        }));
        let bos_id = post_bos.or_else(|| {
            ["<bos>", "<s>", "<|begin_of_text|>"]
                .iter()
                .find_map(|t| ids.get(*t).copied())
        });
        let eos_id = ["<eos>", "</s>", "<|end_of_text|>", "<|endoftext|>"]
            .iter()
            .find_map(|t| ids.get(*t).copied());
        Ok(Tokenizer {
            unk_id,
            bos_id,
            eos_id,
            add_bos,
            end_of_turn: end_of_turn([], &ids),
            model,
            specials,
            logprob_ids: OnceLock::new(),
            pieces,
            kinds,
            ids,
        })
    }
}

/// BOS: the special token the post-processor puts before the text.
fn json_post_bos(root: &Json, ids: &FxMap<String, u32>) -> Option<u32> {
    let single = root.get("post_processor").and_then(|p| {
        p.get("single").or_else(|| {
            p.get("processors")?
                .as_array()?
                .iter()
                .find_map(|q| q.get("single"))
        })
    });
    if let Some(items) = single.and_then(Json::as_array) {
        for item in items {
            if item.get("Sequence").is_some() {
                break;
            }
            if let Some(id) = item
                .get("SpecialToken")
                .and_then(|s| s.get("id"))
                .and_then(Json::as_str)
                .and_then(|s| ids.get(s))
            {
                return Some(*id);
            }
        }
    }
    None
}

/// A tokenizer.json BPE's merges: `(left id, right id) -> (rank, merged id)`.
fn json_rank_merges(model: &Json, ids: &FxMap<String, u32>) -> Result<RankMerges, TextError> {
    let bad = |msg: &str| TextError::TokenizerJson(msg.to_string());
    let mut merges = FxMap::default();
    if let Some(list) = model.get("merges").and_then(Json::as_array) {
        merges.reserve(list.len());
        for (rank, m) in list.iter().enumerate() {
            let (l, r) = match m {
                Json::String(s) => s
                    .split_once(' ')
                    .ok_or_else(|| bad("merge without a space"))?,
                Json::Array(pair) => match pair.as_slice() {
                    [Json::String(l), Json::String(r)] => (l.as_str(), r.as_str()),
                    _ => return Err(bad("merge is not a pair of strings")),
                },
                _ => return Err(bad("merge is neither a string nor a pair")),
            };
            let id = |p: &str| {
                ids.get(p)
                    .copied()
                    .ok_or_else(|| bad(&format!("merge names {p:?}, not in the vocab")))
            };
            let merged = id(&format!("{l}{r}"))?;
            // The first (lowest-rank) occurrence of a pair counts.
            merges
                .entry((id(l)?, id(r)?))
                .or_insert((rank as u32, merged));
        }
    }
    Ok(merges)
}

/// Flattens `Sequence` components into their parts.
fn flatten<'a>(v: &'a Json, list_key: &str, out: &mut Vec<&'a Json>) {
    if v.is_null() {
        return;
    }
    if v.get("type").and_then(Json::as_str) == Some("Sequence") {
        if let Some(items) = v.get(list_key).and_then(Json::as_array) {
            for item in items {
                flatten(item, list_key, out);
            }
        }
    } else {
        out.push(v);
    }
}

fn string_pattern(v: &Json) -> Result<&str, TextError> {
    v.get("pattern")
        .and_then(|p| p.get("String"))
        .and_then(Json::as_str)
        .ok_or_else(|| TextError::Unsupported("regex patterns in tokenizer.json".to_string()))
}

fn json_text_rules(root: &Json, model: &Json, byte_fallback: bool) -> Result<TextRules, TextError> {
    let flag = |k: &str| model.get(k).and_then(Json::as_bool).unwrap_or(false);
    let mut rules = TextRules {
        space: None,
        prefix: PrefixMode::Never,
        splits: Vec::new(),
        ignore_merges: flag("ignore_merges"),
        byte_fallback,
        fuse_unk: flag("fuse_unk"),
    };
    let unsupported = |what: &str, t: Option<&str>| {
        Err(TextError::Unsupported(format!(
            "tokenizer.json {what} {}",
            t.unwrap_or("?")
        )))
    };
    let mut normalizers = Vec::new();
    if let Some(n) = root.get("normalizer") {
        flatten(n, "normalizers", &mut normalizers);
    }
    for n in normalizers {
        let t = n.get("type").and_then(Json::as_str);
        match t {
            Some("Prepend") => {
                let p = n.get("prepend").and_then(Json::as_str).unwrap_or("");
                if p.is_empty() {
                    continue;
                }
                // Spaces are escaped after prepending, so a prepended space counts as the
                // replacement too.
                rules
                    .space
                    .get_or_insert_with(|| p.replace(' ', "\u{2581}"));
                rules.prefix = PrefixMode::Always;
            }
            Some("Replace") => {
                let from = string_pattern(n)?;
                let to = n.get("content").and_then(Json::as_str).unwrap_or("");
                if from != " " {
                    return unsupported("Replace of", Some(from));
                }
                rules.space = Some(to.to_string());
            }
            _ => return unsupported("normalizer", t),
        }
    }
    let mut pre = Vec::new();
    if let Some(p) = root.get("pre_tokenizer") {
        flatten(p, "pretokenizers", &mut pre);
    }
    for p in pre {
        let t = p.get("type").and_then(Json::as_str);
        match t {
            Some("Metaspace") => {
                let rep = p
                    .get("replacement")
                    .and_then(Json::as_str)
                    .unwrap_or("\u{2581}");
                rules.space = Some(rep.to_string());
                let scheme = match p.get("prepend_scheme").and_then(Json::as_str) {
                    Some(s) => s.to_string(),
                    None => match p.get("add_prefix_space").and_then(Json::as_bool) {
                        Some(false) => "never".to_string(),
                        _ => "always".to_string(),
                    },
                };
                rules.prefix = match scheme.as_str() {
                    "never" => PrefixMode::Never,
                    "first" => PrefixMode::First,
                    _ => PrefixMode::UnlessPresent,
                };
                if p.get("split").and_then(Json::as_bool).unwrap_or(true) {
                    rules
                        .splits
                        .push((rep.to_string(), SplitBehavior::MergedWithNext));
                }
            }
            Some("Split") => {
                let pattern = string_pattern(p)?;
                if p.get("invert").and_then(Json::as_bool).unwrap_or(false) {
                    return unsupported("Split", Some("invert"));
                }
                let how = match p.get("behavior").and_then(Json::as_str) {
                    Some("Removed") => SplitBehavior::Removed,
                    Some("Isolated") => SplitBehavior::Isolated,
                    Some("MergedWithPrevious") => SplitBehavior::MergedWithPrevious,
                    Some("MergedWithNext") => SplitBehavior::MergedWithNext,
                    Some("Contiguous") => SplitBehavior::Contiguous,
                    other => return unsupported("Split behavior", other),
                };
                // Spaces are already escaped by the time pre-tokenizers run.
                let pattern = match &rules.space {
                    Some(rep) => pattern.replace(' ', rep),
                    None => pattern.to_string(),
                };
                if !pattern.is_empty() {
                    rules.splits.push((pattern, how));
                }
            }
            _ => return unsupported("pre_tokenizer", t),
        }
    }
    Ok(rules)
}

/// Reads the BOS/EOS token texts from a `tokenizer_config.json` (`"<bos>"` or
/// `{"content": "<bos>"}`).
fn config_token(config: &Json, key: &str) -> Option<String> {
    match config.get(key)? {
        Json::String(s) => Some(s.clone()),
        v => v.get("content")?.as_str().map(str::to_string),
    }
}

/// The tokenizer for a model file: `tokenizer.json` beside the model wins over the GGUF
/// metadata. Its BOS/EOS come from `tokenizer_config.json` beside it when present, else from
/// the GGUF's BOS/EOS texts, else from well-known names.
pub fn load_tokenizer(
    gguf_metadata: &HashMap<String, GgufValue>,
    model_path: &Path,
) -> Result<Tokenizer, TextError> {
    let dir = model_path.parent().unwrap_or(Path::new("."));
    let json_path = dir.join("tokenizer.json");
    if !json_path.is_file() {
        return Tokenizer::from_gguf_metadata(gguf_metadata);
    }
    let read = |p: &Path| {
        std::fs::read_to_string(p).map_err(|source| TextError::Io {
            path: p.to_path_buf(),
            source,
        })
    };
    let tok = Tokenizer::from_tokenizer_json(&read(&json_path)?)?;
    let config_path = dir.join("tokenizer_config.json");
    let config: Option<Json> = if config_path.is_file() {
        Some(serde_json::from_str(&read(&config_path)?)?)
    } else {
        None
    };
    let gguf_text = |key: &str| -> Option<String> {
        let id = gguf_metadata.get(key).and_then(gguf_u32)? as usize;
        match gguf_metadata.get("tokenizer.ggml.tokens") {
            Some(GgufValue::Array(a)) => match a.get(id)? {
                GgufValue::String(s) => Some(s.clone()),
                _ => None,
            },
            _ => None,
        }
    };
    let pick = |config_key: &str, gguf_key: &str, current: Option<u32>| {
        config
            .as_ref()
            .and_then(|c| config_token(c, config_key))
            .or_else(|| gguf_text(gguf_key))
            .and_then(|t| tok.token_id(&t))
            .or(current)
    };
    let bos = pick("bos_token", "tokenizer.ggml.bos_token_id", tok.bos_id());
    let eos = pick("eos_token", "tokenizer.ggml.eos_token_id", tok.eos_id());
    Ok(tok.with_bos_eos(bos, eos))
}
