//! The tokenizer proper: vocabulary, encoding (special-piece partition, then SentencePiece-style
//! whitespace escaping, pair merging and byte fallback, or byte-level BPE) and the per-token bytes
//! decoding builds on.

use std::borrow::Cow;
use std::sync::OnceLock;

use crate::bytelevel::{piece_bytes, ByteLevelBpe};
use crate::decode::{DecodeOptions, DecodeStream};
use crate::merge::{FxMap, MergeRule, MergeVocab};
use crate::partition::{Fragment, SpecialPieces};

/// Token types as SentencePiece / GGUF define them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TokenKind {
    Normal,
    Unknown,
    Control,
    UserDefined,
    Unused,
    Byte,
}

/// When to put the space replacement in front of a text fragment before merging.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PrefixMode {
    Never,
    /// Every fragment, unconditionally (llama.cpp's `add_space_prefix`, where each fragment
    /// starts the text or follows a special piece; Hugging Face `Prepend` normalizer).
    Always,
    /// Every fragment not already starting with a space (Metaspace `prepend_scheme: always`).
    UnlessPresent,
    /// Only the fragment that starts the input, if not already starting with a space
    /// (Metaspace `prepend_scheme: first`).
    First,
}

/// Hugging Face `Split` pre-tokenizer behaviours for a delimiter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SplitBehavior {
    Removed,
    Isolated,
    MergedWithPrevious,
    MergedWithNext,
    Contiguous,
}

/// Splits the words `words` (byte ranges of `text`) at each occurrence of `delim`.
fn split_words(
    text: &str,
    words: &[(usize, usize)],
    delim: &str,
    how: SplitBehavior,
) -> Vec<(usize, usize)> {
    let mut out = Vec::with_capacity(words.len());
    for &(ws, we) in words {
        // Alternating runs: (start, end, is_delimiter).
        let mut runs: Vec<(usize, usize, bool)> = Vec::new();
        let mut pos = ws;
        for (i, _) in text[ws..we].match_indices(delim) {
            let (ds, de) = (ws + i, ws + i + delim.len());
            if ds > pos {
                runs.push((pos, ds, false));
            }
            match runs.last_mut() {
                Some(last) if how == SplitBehavior::Contiguous && last.2 && last.1 == ds => {
                    last.1 = de
                }
                _ => runs.push((ds, de, true)),
            }
            pos = de;
        }
        if pos < we {
            runs.push((pos, we, false));
        }
        let mut pending: Option<(usize, usize)> = None;
        for (s, e, delim_run) in runs {
            match how {
                SplitBehavior::Removed if delim_run => {}
                SplitBehavior::Removed | SplitBehavior::Isolated | SplitBehavior::Contiguous => {
                    out.push((s, e))
                }
                SplitBehavior::MergedWithPrevious => {
                    if delim_run {
                        let start = pending.take().map_or(s, |p| p.0);
                        out.push((start, e));
                    } else {
                        if let Some(p) = pending.take() {
                            out.push(p);
                        }
                        pending = Some((s, e));
                    }
                }
                SplitBehavior::MergedWithNext => {
                    if delim_run {
                        if let Some(p) = pending.take() {
                            out.push(p);
                        }
                        pending = Some((s, e));
                    } else {
                        let start = pending.take().map_or(s, |p| p.0);
                        out.push((start, e));
                    }
                }
            }
        }
        out.extend(pending);
    }
    out
}

/// Escapes spaces and adds the prefix a SentencePiece-style model wants.
fn normalize_into(rules: &TextRules, raw: &str, at_start: bool, buf: &mut String) {
    match &rules.space {
        Some(rep) => {
            let present = raw.starts_with(' ') || raw.starts_with(rep.as_str());
            let prefix = match rules.prefix {
                PrefixMode::Never => false,
                PrefixMode::Always => true,
                PrefixMode::UnlessPresent => !present,
                PrefixMode::First => at_start && !present,
            };
            if prefix {
                buf.push_str(rep);
            }
            for ch in raw.chars() {
                if ch == ' ' {
                    buf.push_str(rep);
                } else {
                    buf.push(ch);
                }
            }
        }
        None => buf.push_str(raw),
    }
}

/// How raw text becomes merge input.
pub(crate) struct TextRules {
    /// What a space becomes (`▁`); `None` leaves spaces alone.
    pub space: Option<String>,
    pub prefix: PrefixMode,
    /// Word splits applied after normalization (Metaspace `split: true`, `Split` with a string
    /// pattern); each word is merged separately.
    pub splits: Vec<(String, SplitBehavior)>,
    /// Hugging Face `ignore_merges`: a word that is itself in the vocabulary is not merged.
    pub ignore_merges: bool,
    /// Unknown pieces become `<0xNN>` byte tokens (else the unknown token).
    pub byte_fallback: bool,
    /// Hugging Face `fuse_unk`: consecutive unknown tokens collapse into one.
    pub fuse_unk: bool,
}

/// SentencePiece-style BPE: spaces escaped (`▁`), pairs merged by score (GGUF) or rank
/// (tokenizer.json), pieces without a token as `<0xNN>` byte tokens.
pub(crate) struct SpmModel {
    pub scores: Vec<f32>,
    pub byte_ids: [Option<u32>; 256],
    pub rule: MergeRule,
    pub text: TextRules,
}

/// How the text between special pieces becomes ids.
pub(crate) enum Model {
    // Boxed: both are large, and the tokenizer is built once.
    Spm(Box<SpmModel>),
    ByteLevel(Box<ByteLevelBpe>),
}

/// A BPE tokenizer, SentencePiece-style or byte-level. Immutable once built; share it as
/// `Arc<Tokenizer>`.
pub struct Tokenizer {
    pub(crate) pieces: Vec<String>,
    pub(crate) kinds: Vec<TokenKind>,
    pub(crate) ids: FxMap<String, u32>,
    pub(crate) unk_id: Option<u32>,
    pub(crate) bos_id: Option<u32>,
    pub(crate) eos_id: Option<u32>,
    pub(crate) add_bos: bool,
    /// Sorted, without duplicates.
    pub(crate) end_of_turn: Vec<u32>,
    pub(crate) model: Model,
    pub(crate) specials: SpecialPieces,
    /// Bytes → the id [`Tokenizer::id_of_logprob_token`] answers; built on first use.
    pub(crate) logprob_ids: OnceLock<FxMap<Vec<u8>, u32>>,
}

/// The byte a `<0xNN>` piece stands for.
pub(crate) fn byte_piece_value(piece: &str) -> Option<u8> {
    let hex = piece.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

impl Tokenizer {
    /// Encodes `text` into token ids. Never adds BOS. With `parse_special`, texts of control
    /// tokens (`<start_of_turn>`, `<bos>`…) become those tokens; user-defined pieces (`\n`,
    /// space runs, HTML tags…) are always matched whole.
    pub fn encode(&self, text: &str, parse_special: bool) -> Vec<u32> {
        let mut out = Vec::with_capacity(text.len() / 3 + 1);
        let mut buf = String::new();
        for fragment in self.specials.partition(text, parse_special) {
            match fragment {
                Fragment::Special(id) => out.push(id),
                Fragment::Text(start, end) => {
                    let raw = &text[start..end];
                    match &self.model {
                        Model::Spm(m) => {
                            buf.clear();
                            normalize_into(&m.text, raw, start == 0, &mut buf);
                            self.encode_words(m, &buf, &mut out);
                        }
                        Model::ByteLevel(b) => b.encode(raw, &mut out),
                    }
                }
            }
        }
        out
    }

    fn encode_words(&self, m: &SpmModel, text: &str, out: &mut Vec<u32>) {
        if m.text.splits.is_empty() {
            return self.encode_word(m, text, out);
        }
        let mut words = vec![(0, text.len())];
        for (delim, how) in &m.text.splits {
            words = split_words(text, &words, delim, *how);
        }
        for (s, e) in words {
            self.encode_word(m, &text[s..e], out);
        }
    }

    fn encode_word(&self, m: &SpmModel, word: &str, out: &mut Vec<u32>) {
        if word.is_empty() {
            return;
        }
        if m.text.ignore_merges {
            if let Some(&id) = self.ids.get(word) {
                out.push(id);
                return;
            }
        }
        let vocab = MergeVocab {
            ids: &self.ids,
            scores: &m.scores,
            rule: &m.rule,
        };
        vocab.merge(word, |piece| match piece {
            Ok(id) => out.push(id),
            Err((start, end)) => {
                for &b in &word.as_bytes()[start..end] {
                    let id = if m.text.byte_fallback {
                        m.byte_ids[b as usize].or(self.unk_id)
                    } else {
                        self.unk_id
                    };
                    if let Some(id) = id {
                        let fused =
                            m.text.fuse_unk && Some(id) == self.unk_id && out.last() == Some(&id);
                        if !fused {
                            out.push(id);
                        }
                    }
                    if !m.text.byte_fallback {
                        // Without byte fallback the whole unknown piece is one unknown token.
                        break;
                    }
                }
            }
        });
    }

    /// Decodes ids to text. Bytes of `<0xNN>` and byte-level tokens are joined before UTF-8
    /// decoding; only truly invalid sequences become U+FFFD. Ids outside the vocabulary are
    /// ignored.
    pub fn decode(&self, ids: &[u32], opts: DecodeOptions) -> String {
        let mut stream = DecodeStream::new(opts);
        let mut text = String::new();
        for &id in ids {
            text.push_str(&stream.step(self, id));
        }
        text.push_str(&stream.flush());
        text
    }

    /// The raw bytes a token stands for: `▁` becomes a space, `<0xNN>` that byte, a byte-level
    /// piece the bytes its characters map back to; control and user-defined tokens their text.
    pub fn token_bytes(&self, id: u32) -> Option<Cow<'_, [u8]>> {
        let piece = self.pieces.get(id as usize)?;
        let kind = self.kinds[id as usize];
        Some(match kind {
            TokenKind::Byte => match byte_piece_value(piece) {
                Some(b) => Cow::Owned(vec![b]),
                None => Cow::Borrowed(piece.as_bytes()),
            },
            TokenKind::Normal => match &self.model {
                Model::Spm(m) => match &m.text.space {
                    Some(rep) if piece.contains(rep.as_str()) => {
                        Cow::Owned(piece.replace(rep.as_str(), " ").into_bytes())
                    }
                    _ => Cow::Borrowed(piece.as_bytes()),
                },
                Model::ByteLevel(_) => Cow::Owned(piece_bytes(piece)),
            },
            _ => Cow::Borrowed(piece.as_bytes()),
        })
    }

    /// The `token` and `bytes` of a chat completion's logprobs entry for `id` (and of its
    /// `top_logprobs`): the token's raw bytes ([`Tokenizer::token_bytes`]) and, as `token`,
    /// those bytes read as UTF-8, each invalid sequence U+FFFD (a byte-fallback piece of a
    /// multi-byte character alone). `None` for ids outside the vocabulary.
    pub fn logprob_token(&self, id: u32) -> Option<(String, Vec<u8>)> {
        let bytes = self.token_bytes(id)?.into_owned();
        Some((String::from_utf8_lossy(&bytes).into_owned(), bytes))
    }

    /// The id a logprobs entry posted back stands for: the inverse of
    /// [`Tokenizer::logprob_token`].
    ///
    /// - With `bytes`, the bytes decide, and `token` must be what `logprob_token` makes of
    ///   them (else `None`).
    /// - Without, `token`'s UTF-8 are the bytes; failing that, `token` may be a vocabulary
    ///   piece as written (`▁the`, `<0x0D>`). A U+FFFD in `token` then stands for itself, so a
    ///   byte-fallback piece of a partial character is found only through its `bytes`.
    /// - Ids with the same bytes (a byte-fallback piece `<0x0A>` and the piece `\n`; any
    ///   pieces whose text is the same once `▁` is a space) emit the same entry. The answer is
    ///   then the lowest such id that is not a byte-fallback piece, else the lowest id: the
    ///   piece the tokenizer's own encoding of that text gives, as sampling almost always does.
    pub fn id_of_logprob_token(&self, token: &str, bytes: Option<&[u8]>) -> Option<u32> {
        let ids = self.logprob_ids.get_or_init(|| {
            let mut ids = FxMap::default();
            for id in 0..self.pieces.len() as u32 {
                let Some(bytes) = self.token_bytes(id) else {
                    continue;
                };
                let chosen = ids.entry(bytes.into_owned()).or_insert(id);
                if self.kinds[*chosen as usize] == TokenKind::Byte
                    && self.kinds[id as usize] != TokenKind::Byte
                {
                    *chosen = id;
                }
            }
            ids
        });
        match bytes {
            Some(bytes) => {
                let id = *ids.get(bytes)?;
                (String::from_utf8_lossy(bytes) == token).then_some(id)
            }
            None => ids
                .get(token.as_bytes())
                .copied()
                .or_else(|| self.token_id(token)),
        }
    }

    /// Whether decoding should drop one leading space from the first token: the encoder put a
    /// space replacement in front of the text.
    pub(crate) fn strips_prefix_space(&self) -> bool {
        match &self.model {
            Model::Spm(m) => m.text.space.is_some() && m.text.prefix != PrefixMode::Never,
            Model::ByteLevel(_) => false,
        }
    }

    pub fn piece(&self, id: u32) -> Option<&str> {
        self.pieces.get(id as usize).map(String::as_str)
    }

    pub fn token_id(&self, piece: &str) -> Option<u32> {
        self.ids.get(piece).copied()
    }

    pub fn kind(&self, id: u32) -> Option<TokenKind> {
        self.kinds.get(id as usize).copied()
    }

    /// Control, unknown and unused tokens: the ones `skip_special_tokens` drops.
    pub fn is_special(&self, id: u32) -> bool {
        matches!(
            self.kind(id),
            Some(TokenKind::Control | TokenKind::Unknown | TokenKind::Unused)
        )
    }

    /// The most bytes of input text one token can stand for, so that a text of `b` bytes
    /// encodes to at least `b / max_text_bytes_per_token()` tokens: what lets a server refuse
    /// a prompt far past the context without tokenizing it. A space-replacement character
    /// counts as the one space it replaces, a `<0xNN>` piece as one byte, a byte-level
    /// character as the byte it stands for.
    pub fn max_text_bytes_per_token(&self) -> usize {
        let m = match &self.model {
            Model::Spm(m) => m,
            Model::ByteLevel(_) => {
                return (0..self.pieces.len() as u32)
                    .filter_map(|id| self.token_bytes(id).map(|b| b.len()))
                    .max()
                    .unwrap_or(1)
                    .max(1)
            }
        };
        let space_extra = m
            .text
            .space
            .as_ref()
            .map_or(0, |rep| rep.len().saturating_sub(1));
        self.pieces
            .iter()
            .map(|piece| match byte_piece_value(piece) {
                Some(_) => 1,
                None if space_extra > 0 => {
                    let rep = m.text.space.as_deref().unwrap_or_default();
                    piece.len() - piece.matches(rep).count() * space_extra
                }
                None => piece.len(),
            })
            .max()
            .unwrap_or(1)
            .max(1)
    }

    pub fn vocab_size(&self) -> usize {
        self.pieces.len()
    }

    pub fn bos_id(&self) -> Option<u32> {
        self.bos_id
    }

    pub fn eos_id(&self) -> Option<u32> {
        self.eos_id
    }

    pub fn unk_id(&self) -> Option<u32> {
        self.unk_id
    }

    /// Whether the model expects BOS in front of a prompt (`tokenizer.ggml.add_bos_token`, else
    /// the vocabulary type's and pre-tokenizer's default, as llama.cpp: SentencePiece and
    /// Llama 3 yes, Qwen 2, SmolLM and GPT-2 no).
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }

    /// Tokens that end an assistant turn besides EOS: the GGUF's `eot_token_id` and
    /// `eom_token_id`, and the family markers in the vocabulary (`<end_of_turn>`,
    /// `<|eot_id|>`, `<|eom_id|>`, `<|im_end|>`, `<|end|>`). Sorted.
    pub fn end_of_turn_ids(&self) -> &[u32] {
        &self.end_of_turn
    }

    pub fn bos_token(&self) -> Option<&str> {
        self.bos_id.and_then(|id| self.piece(id))
    }

    pub fn eos_token(&self) -> Option<&str> {
        self.eos_id.and_then(|id| self.piece(id))
    }

    /// Replaces the BOS / EOS ids (e.g. from a `tokenizer_config.json`); ids outside the
    /// vocabulary are dropped.
    pub fn with_bos_eos(mut self, bos: Option<u32>, eos: Option<u32>) -> Self {
        let n = self.pieces.len();
        self.bos_id = bos.filter(|&id| (id as usize) < n);
        self.eos_id = eos.filter(|&id| (id as usize) < n);
        self
    }
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.pieces.len())
            .field("bos", &self.bos_token())
            .field("eos", &self.eos_token())
            .finish_non_exhaustive()
    }
}
