//! Splitting input text around special pieces (user-defined always, control only with
//! `parse_special`) before BPE, with exactly llama.cpp's outcome (`tokenizer_st_partition`):
//! pieces are applied longest first, each one's leftmost non-overlapping occurrences inside the
//! text not yet claimed by a longer piece. A byte trie finds every candidate occurrence in one
//! pass instead of llama.cpp's one substring search per special piece.

use std::hash::Hasher;

/// A small, fast, non-cryptographic hasher (rustc's FxHash) for the vocabulary maps, which are
/// hit once per character pair during BPE. Keys are model data, not attacker-chosen per request
/// in a way that could cause collisions worth defending against with SipHash.
#[derive(Default, Clone, Copy)]
pub(crate) struct FxHasher {
    hash: u64,
}

const FX_SEED: u64 = 0x51_7c_c1_b7_27_22_0a_95;

impl FxHasher {
    #[inline]
    fn add(&mut self, word: u64) {
        self.hash = (self.hash.rotate_left(5) ^ word).wrapping_mul(FX_SEED);
    }
}

impl Hasher for FxHasher {
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            let mut w = [0u8; 8];
            w.copy_from_slice(c);
            self.add(u64::from_le_bytes(w));
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut w = [0u8; 8];
            w[..rest.len()].copy_from_slice(rest);
            self.add(u64::from_le_bytes(w) ^ ((rest.len() as u64) << 59));
        }
    }
    #[inline]
    fn write_u8(&mut self, i: u8) {
        self.add(u64::from(i));
    }
    #[inline]
    fn write_u32(&mut self, i: u32) {
        self.add(u64::from(i));
    }
    #[inline]
    fn write_u64(&mut self, i: u64) {
        self.add(i);
    }
    #[inline]
    fn write_usize(&mut self, i: usize) {
        self.add(i as u64);
    }
    #[inline]
    fn finish(&self) -> u64 {
        self.hash
    }
}

/// One special piece that is matched whole.
#[derive(Clone, Copy)]
pub(crate) struct SpecialPiece {
    pub id: u32,
    /// Matched only when the caller asks for special-token parsing (control/unknown pieces).
    pub needs_parse_special: bool,
    /// Strip ASCII whitespace to the left / right of a match (Hugging Face `lstrip`/`rstrip`).
    pub lstrip: bool,
    pub rstrip: bool,
}

#[derive(Default)]
struct Node {
    children: Vec<(u8, u32)>,
    /// Index into `SpecialPieces::pieces`.
    piece: Option<u32>,
}

/// Trie over the special pieces' bytes, and their application order.
pub(crate) struct SpecialPieces {
    nodes: Vec<Node>,
    pieces: Vec<SpecialPiece>,
    /// Byte length of each piece.
    lens: Vec<usize>,
    /// Application order of each piece: longer first, then lower id.
    rank: Vec<u32>,
}

/// A fragment of the input after partitioning.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fragment {
    /// Byte range of text to run through BPE.
    Text(usize, usize),
    Special(u32),
}

impl SpecialPieces {
    /// `pieces` are (text, piece); empty texts are ignored. A text that appears twice keeps the
    /// later piece, as llama.cpp's text-to-id map does.
    pub fn new<'a>(entries: impl IntoIterator<Item = (&'a str, SpecialPiece)>) -> Self {
        let mut this = SpecialPieces {
            nodes: vec![Node::default()],
            pieces: Vec::new(),
            lens: Vec::new(),
            rank: Vec::new(),
        };
        for (text, piece) in entries {
            if text.is_empty() {
                continue;
            }
            let mut node = 0usize;
            for &b in text.as_bytes() {
                node = match this.nodes[node].children.iter().find(|(c, _)| *c == b) {
                    Some(&(_, child)) => child as usize,
                    None => {
                        let child = this.nodes.len();
                        this.nodes.push(Node::default());
                        this.nodes[node].children.push((b, child as u32));
                        child
                    }
                };
            }
            match this.nodes[node].piece {
                Some(existing) => this.pieces[existing as usize] = piece,
                None => {
                    this.nodes[node].piece = Some(this.pieces.len() as u32);
                    this.pieces.push(piece);
                    this.lens.push(text.len());
                }
            }
        }
        let mut order: Vec<u32> = (0..this.pieces.len() as u32).collect();
        order.sort_by_key(|&i| {
            (
                std::cmp::Reverse(this.lens[i as usize]),
                this.pieces[i as usize].id,
            )
        });
        this.rank = vec![0; order.len()];
        for (r, &i) in order.iter().enumerate() {
            this.rank[i as usize] = r as u32;
        }
        this
    }

    /// Splits `text` into BPE text ranges and special pieces, in order.
    pub fn partition(&self, text: &str, parse_special: bool) -> Vec<Fragment> {
        let bytes = text.as_bytes();
        // Every occurrence of every usable piece: (rank, start, piece index).
        let mut candidates: Vec<(u32, usize, u32)> = Vec::new();
        for start in 0..bytes.len() {
            let mut node = 0usize;
            for &b in &bytes[start..] {
                match self.nodes[node].children.iter().find(|(c, _)| *c == b) {
                    Some(&(_, child)) => node = child as usize,
                    None => break,
                }
                if let Some(p) = self.nodes[node].piece {
                    if parse_special || !self.pieces[p as usize].needs_parse_special {
                        candidates.push((self.rank[p as usize], start, p));
                    }
                }
            }
        }
        if candidates.is_empty() {
            return if text.is_empty() {
                Vec::new()
            } else {
                vec![Fragment::Text(0, text.len())]
            };
        }
        candidates.sort_unstable();
        // Bytes taken by an accepted piece (or stripped beside one).
        let mut claimed = vec![false; bytes.len()];
        // Accepted pieces by start byte.
        let mut accepted: Vec<(usize, usize, u32)> = Vec::new();
        for &(_, start, p) in &candidates {
            let end = start + self.lens[p as usize];
            // Pieces are applied longest first, so anything already claimed inside this range
            // reaches one of its ends: checking both ends is enough.
            if claimed[start] || claimed[end - 1] {
                continue;
            }
            claimed[start..end].fill(true);
            let piece = self.pieces[p as usize];
            accepted.push((start, end, piece.id));
            if piece.lstrip {
                let mut i = start;
                while i > 0 && !claimed[i - 1] && is_c_space(bytes[i - 1]) {
                    i -= 1;
                    claimed[i] = true;
                }
            }
            if piece.rstrip {
                let mut i = end;
                while i < bytes.len() && !claimed[i] && is_c_space(bytes[i]) {
                    claimed[i] = true;
                    i += 1;
                }
            }
        }
        accepted.sort_unstable();
        let mut out = Vec::with_capacity(2 * accepted.len() + 1);
        let mut pos = 0;
        let push_text = |out: &mut Vec<Fragment>, from: usize, to: usize| {
            // Skip bytes that were stripped beside a piece.
            let mut i = from;
            while i < to {
                if claimed[i] {
                    i += 1;
                    continue;
                }
                let s = i;
                while i < to && !claimed[i] {
                    i += 1;
                }
                out.push(Fragment::Text(s, i));
            }
        };
        for &(start, end, id) in &accepted {
            push_text(&mut out, pos, start);
            out.push(Fragment::Special(id));
            pos = end;
        }
        push_text(&mut out, pos, bytes.len());
        out
    }
}

/// C `isspace` in the "C" locale, as llama.cpp uses for lstrip/rstrip.
fn is_c_space(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | 0x0b | 0x0c | b'\r')
}

#[cfg(test)]
mod tests {
    use super::*;

    fn piece(id: u32, ctl: bool) -> SpecialPiece {
        SpecialPiece {
            id,
            needs_parse_special: ctl,
            lstrip: false,
            rstrip: false,
        }
    }

    #[test]
    fn longest_piece_wins_even_when_not_leftmost() {
        let sp = SpecialPieces::new([("ab", piece(1, false)), ("bcd", piece(2, false))]);
        assert_eq!(
            sp.partition("abcd", false),
            vec![Fragment::Text(0, 1), Fragment::Special(2)]
        );
    }

    #[test]
    fn control_needs_parse_special_and_runs_split_longest_first() {
        let sp = SpecialPieces::new([
            ("  ", piece(10, false)),
            ("   ", piece(11, false)),
            ("<c>", piece(5, true)),
        ]);
        assert_eq!(
            sp.partition("a<c>     b", false),
            vec![
                Fragment::Text(0, 4),
                Fragment::Special(11),
                Fragment::Special(10),
                Fragment::Text(9, 10)
            ]
        );
        assert_eq!(
            sp.partition("<c><c>", true),
            vec![Fragment::Special(5), Fragment::Special(5)]
        );
    }

    #[test]
    fn strip_flags_drop_whitespace_beside_a_piece() {
        let mut p = piece(7, true);
        p.lstrip = true;
        p.rstrip = true;
        let sp = SpecialPieces::new([("<m>", p)]);
        assert_eq!(
            sp.partition("a  <m> b", true),
            vec![
                Fragment::Text(0, 1),
                Fragment::Special(7),
                Fragment::Text(7, 8)
            ]
        );
    }
}
