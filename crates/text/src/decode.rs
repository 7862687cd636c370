//! Detokenization. `Tokenizer::decode` is this stream run over all ids, so streamed text always
//! concatenates to exactly the decoded text.

use crate::tokenizer::Tokenizer;

/// Detokenization options (OpenAI/vLLM request fields).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeOptions {
    /// Drop control, unknown and unused tokens.
    pub skip_special_tokens: bool,
    /// When special tokens are kept: join the text runs between them and the special tokens'
    /// texts with single spaces, as vLLM / Hugging Face slow tokenizers do
    /// (`" ".join(sub_texts)`).
    pub spaces_between_special_tokens: bool,
}

impl Default for DecodeOptions {
    /// vLLM's defaults: both true.
    fn default() -> Self {
        DecodeOptions {
            skip_special_tokens: true,
            spaces_between_special_tokens: true,
        }
    }
}

/// Incremental detokenizer: each `step` returns only text made of complete UTF-8 characters,
/// holding back a partial multi-byte sequence (from `<0xNN>` byte tokens or byte-level pieces)
/// until it completes.
#[derive(Debug, Clone)]
pub struct DecodeStream {
    opts: DecodeOptions,
    /// Bytes of an incomplete UTF-8 sequence at the end of the current text run.
    pending: Vec<u8>,
    /// Number of finished parts (text runs and special tokens) in the `" ".join` sense.
    parts: usize,
    /// A text run is open (at least one non-special token since the last special one).
    run_open: bool,
    /// No token has been seen yet (for dropping the space-prefix of the first token).
    first: bool,
}

impl DecodeStream {
    pub fn new(opts: DecodeOptions) -> Self {
        DecodeStream {
            opts,
            pending: Vec::new(),
            parts: 0,
            run_open: false,
            first: true,
        }
    }

    /// Feeds one token id and returns the newly completed text (possibly empty). Ids outside
    /// the vocabulary produce nothing.
    pub fn step(&mut self, tok: &Tokenizer, id: u32) -> String {
        let Some(bytes) = tok.token_bytes(id) else {
            return String::new();
        };
        let first = std::mem::replace(&mut self.first, false);
        let special = tok.is_special(id);
        if special && self.opts.skip_special_tokens {
            return String::new();
        }
        let mut bytes: &[u8] = &bytes;
        if first && tok.strips_prefix_space() {
            bytes = bytes.strip_prefix(b" ").unwrap_or(bytes);
        }
        let spaced = self.opts.spaces_between_special_tokens;
        let mut out = String::new();
        if special {
            // A special token ends the current text run; its text is a part of its own.
            if self.run_open {
                out.push_str(&self.flush());
                self.run_open = false;
                self.parts += 1;
            }
            if spaced && self.parts > 0 {
                out.push(' ');
            }
            out.push_str(&String::from_utf8_lossy(bytes));
            self.parts += 1;
            return out;
        }
        if !self.run_open {
            self.run_open = true;
            if spaced && self.parts > 0 {
                out.push(' ');
            }
        }
        self.pending.extend_from_slice(bytes);
        take_complete(&mut self.pending, &mut out);
        out
    }

    /// Returns what is still held back; an incomplete UTF-8 sequence becomes U+FFFD.
    pub fn flush(&mut self) -> String {
        let out = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        out
    }
}

/// Moves the longest prefix of `buf` that cannot change with more bytes into `out`: valid
/// characters, and U+FFFD for each invalid sequence, keeping only an incomplete tail.
fn take_complete(buf: &mut Vec<u8>, out: &mut String) {
    let mut start = 0;
    loop {
        match std::str::from_utf8(&buf[start..]) {
            Ok(s) => {
                out.push_str(s);
                buf.clear();
                return;
            }
            Err(e) => {
                let valid = start + e.valid_up_to();
                // `valid_up_to` bytes were just validated, so this cannot fail.
                out.push_str(std::str::from_utf8(&buf[start..valid]).unwrap_or_default());
                match e.error_len() {
                    Some(n) => {
                        out.push(char::REPLACEMENT_CHARACTER);
                        start = valid + n;
                    }
                    None => {
                        buf.drain(..valid);
                        return;
                    }
                }
            }
        }
    }
}
