//! A tokenizer as a Hugging Face tokenizer directory (`tokenizer.json`, `tokenizer_config.json`):
//! what transformers' `AutoTokenizer.from_pretrained` loads, with the same ids as [`Tokenizer`].
//!
//! A byte-level vocabulary is written as it runs (its `tokenizers` normalizer, pre-tokenizer and
//! BPE model). A SentencePiece-style vocabulary with scores (GGUF) becomes a BPE model whose merges
//! are every split of a piece into two pieces, ranked by the merged piece's score: pair merging by
//! score (llama.cpp's, ours) then picks the same pairs in the same order.

use serde_json::{json, Map, Value};
use tokenizers::models::bpe::{Vocab, BPE};

use crate::merge::MergeRule;
use crate::tokenizer::{Model, PrefixMode, SpmModel};
use crate::{TextError, TokenKind, Tokenizer};

/// The two files of a Hugging Face tokenizer directory.
#[derive(Debug, Clone)]
pub struct HfTokenizerFiles {
    pub tokenizer_json: String,
    pub tokenizer_config_json: String,
}

fn tk_err(e: impl std::fmt::Display) -> TextError {
    TextError::Unsupported(format!("exporting the tokenizer: {e}"))
}

impl Tokenizer {
    /// The Hugging Face files of this tokenizer, `chat_template` in the config.
    pub fn to_hf_files(&self, chat_template: Option<&str>) -> Result<HfTokenizerFiles, TextError> {
        let (normalizer, pre_tokenizer, model, decoder) = match &self.model {
            Model::ByteLevel(b) => {
                let (normalizer, pre, model) = b.hf_parts()?;
                let decoder = json!({"type": "ByteLevel", "add_prefix_space": true,
                    "trim_offsets": true, "use_regex": true});
                (normalizer, pre, model, decoder)
            }
            Model::Spm(m) => self.spm_parts(m)?,
        };
        let added: Vec<Value> = self
            .kinds
            .iter()
            .enumerate()
            .filter(|(_, k)| {
                matches!(
                    k,
                    TokenKind::Control | TokenKind::Unknown | TokenKind::UserDefined
                )
            })
            .filter(|(i, _)| self.ids.get(&self.pieces[*i]) == Some(&(*i as u32)))
            .map(|(i, k)| {
                json!({"id": i, "content": self.pieces[i], "single_word": false, "lstrip": false,
                    "rstrip": false, "normalized": false,
                    "special": *k != TokenKind::UserDefined})
            })
            .collect();
        let piece = |id: Option<u32>| id.and_then(|i| self.pieces.get(i as usize)).cloned();
        let bos = piece(self.bos_id);
        let post_processor = match (&bos, self.add_bos) {
            (Some(bos), true) => {
                let special =
                    |type_id: u32| json!({"SpecialToken": {"id": bos, "type_id": type_id}});
                let seq =
                    |id: &str, type_id: u32| json!({"Sequence": {"id": id, "type_id": type_id}});
                json!({
                    "type": "TemplateProcessing",
                    "single": [special(0), seq("A", 0)],
                    "pair": [special(0), seq("A", 0), special(1), seq("B", 1)],
                    "special_tokens": {bos: {"id": bos, "ids": [self.bos_id], "tokens": [bos]}},
                })
            }
            _ => Value::Null,
        };
        let tokenizer = json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": added,
            "normalizer": normalizer,
            "pre_tokenizer": pre_tokenizer,
            "post_processor": post_processor,
            "decoder": decoder,
            "model": model,
        });
        let mut config = Map::new();
        config.insert("tokenizer_class".into(), json!("PreTrainedTokenizerFast"));
        for (key, id) in [
            ("bos_token", self.bos_id),
            ("eos_token", self.eos_id),
            ("unk_token", self.unk_id),
        ] {
            if let Some(p) = piece(id) {
                config.insert(key.into(), json!(p));
            }
        }
        config.insert("add_bos_token".into(), json!(self.add_bos));
        config.insert("add_eos_token".into(), json!(false));
        config.insert("clean_up_tokenization_spaces".into(), json!(false));
        if let Some(t) = chat_template {
            config.insert("chat_template".into(), json!(t));
        }
        Ok(HfTokenizerFiles {
            tokenizer_json: tokenizer.to_string(),
            tokenizer_config_json: serde_json::to_string_pretty(&Value::Object(config))
                .map_err(tk_err)?,
        })
    }

    /// Normalizer, pre-tokenizer, BPE model and decoder of a SentencePiece-style vocabulary.
    fn spm_parts(&self, m: &SpmModel) -> Result<(Value, Value, Value, Value), TextError> {
        let t = &m.text;
        if !t.splits.is_empty() || t.ignore_merges || t.fuse_unk {
            return Err(tk_err(
                "word splits, ignore_merges and fuse_unk are not exported",
            ));
        }
        let Some(space) = &t.space else {
            return Err(tk_err("a SentencePiece vocabulary without space escaping"));
        };
        let replace = json!({"type": "Replace", "pattern": {"String": " "}, "content": space});
        let normalizer = match t.prefix {
            PrefixMode::Never => replace,
            PrefixMode::Always => json!({"type": "Sequence", "normalizers": [
                {"type": "Prepend", "prepend": space}, replace]}),
            _ => return Err(tk_err("a conditional space prefix is not exported")),
        };
        let mut decoders = vec![
            json!({"type": "Replace", "pattern": {"String": space}, "content": " "}),
            json!({"type": "ByteFallback"}),
            json!({"type": "Fuse"}),
        ];
        if t.prefix == PrefixMode::Always {
            decoders.push(json!({"type": "Strip", "content": " ", "start": 1, "stop": 0}));
        }
        // Each piece once, at the id encoding gives it (a later duplicate wins).
        let own = |i: usize| self.ids.get(&self.pieces[i]) == Some(&(i as u32));
        let vocab: Vocab = (0..self.pieces.len())
            .filter(|&i| own(i))
            .map(|i| (self.pieces[i].clone(), i as u32))
            .collect();
        let merges: Vec<(String, String)> = match &m.rule {
            MergeRule::Scores => {
                let mut merges: Vec<(f32, u32, &str, &str)> = Vec::new();
                for (i, piece) in self.pieces.iter().enumerate().filter(|(i, _)| own(*i)) {
                    for (at, _) in piece.char_indices().skip(1) {
                        let (a, b) = piece.split_at(at);
                        if self.ids.contains_key(a) && self.ids.contains_key(b) {
                            merges.push((m.scores[i], i as u32, a, b));
                        }
                    }
                }
                // The highest score first; equal scores by id.
                merges.sort_by(|x, y| y.0.total_cmp(&x.0).then(x.1.cmp(&y.1)));
                merges
                    .into_iter()
                    .map(|(_, _, a, b)| (a.to_owned(), b.to_owned()))
                    .collect()
            }
            MergeRule::Ranks(ranks) => {
                let mut by_rank: Vec<(u32, u32, u32)> = ranks
                    .iter()
                    .map(|(&(a, b), &(rank, _))| (rank, a, b))
                    .collect();
                by_rank.sort_unstable();
                by_rank
                    .into_iter()
                    .map(|(_, a, b)| {
                        (
                            self.pieces[a as usize].clone(),
                            self.pieces[b as usize].clone(),
                        )
                    })
                    .collect()
            }
        };
        let mut builder = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .byte_fallback(t.byte_fallback);
        if let Some(unk) = self.unk_id.and_then(|i| self.pieces.get(i as usize)) {
            builder = builder.unk_token(unk.clone());
        }
        let bpe = builder.build().map_err(tk_err)?;
        let model = serde_json::to_value(&bpe).map_err(tk_err)?;
        Ok((
            normalizer,
            Value::Null,
            model,
            json!({"type": "Sequence", "decoders": decoders}),
        ))
    }
}
