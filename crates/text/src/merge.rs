//! The pair-merging loop shared by SentencePiece-BPE (GGUF scores) and Hugging Face BPE
//! (merge ranks). It mirrors llama.cpp's `llm_tokenizer_spm_session`: symbols start as single
//! characters, a max-heap holds every adjacent pair that may merge, stale entries are skipped
//! when popped, so a word of n characters costs O(n log n).

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};
use std::hash::BuildHasherDefault;

use crate::partition::FxHasher;

pub(crate) type FxMap<K, V> = HashMap<K, V, BuildHasherDefault<FxHasher>>;

/// Hugging Face BPE merges: `(left id, right id) -> (rank, merged id)`.
pub(crate) type RankMerges = FxMap<(u32, u32), (u32, u32)>;

/// Where the priority of merging two adjacent symbols comes from.
pub(crate) enum MergeRule {
    /// SentencePiece: the joined piece must be in the vocabulary; its score decides (higher first).
    Scores,
    /// Hugging Face BPE merges; lower rank first.
    Ranks(RankMerges),
}

/// The vocabulary view the merge loop needs.
pub(crate) struct MergeVocab<'a> {
    pub ids: &'a FxMap<String, u32>,
    pub scores: &'a [f32],
    pub rule: &'a MergeRule,
}

#[derive(Clone, Copy)]
struct Symbol {
    start: usize,
    /// Byte length; 0 once merged into its left neighbour.
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
    id: Option<u32>,
}

struct Candidate {
    priority: f64,
    left: usize,
    right: usize,
    size: usize,
    merged: u32,
}

impl PartialEq for Candidate {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Candidate {}
impl PartialOrd for Candidate {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Candidate {
    /// Highest priority first; among equal priorities the leftmost pair.
    fn cmp(&self, other: &Self) -> Ordering {
        self.priority
            .total_cmp(&other.priority)
            .then_with(|| other.left.cmp(&self.left))
    }
}

impl MergeVocab<'_> {
    fn pair(&self, text: &str, l: &Symbol, r: &Symbol) -> Option<(f64, u32)> {
        match self.rule {
            MergeRule::Scores => {
                let id = *self.ids.get(&text[l.start..r.start + r.len])?;
                let score = *self.scores.get(id as usize)?;
                Some((f64::from(score), id))
            }
            MergeRule::Ranks(merges) => {
                let &(rank, merged) = merges.get(&(l.id?, r.id?))?;
                Some((-f64::from(rank), merged))
            }
        }
    }

    /// Merges `text` into pieces. Each final piece is reported as `Ok(id)` when it is in the
    /// vocabulary, else as `Err(byte range)` for the caller's byte fallback.
    pub fn merge(&self, text: &str, mut emit: impl FnMut(Result<u32, (usize, usize)>)) {
        // Merge ranks are keyed by symbol ids; scores only look up joined text, so there the id
        // of a symbol that never merges is looked up once, when it is emitted.
        let lookup = |s: usize, e: usize| self.ids.get(&text[s..e]).copied();
        let ranks = matches!(self.rule, MergeRule::Ranks(_));
        let mut symbols: Vec<Symbol> = Vec::with_capacity(text.len());
        for (start, ch) in text.char_indices() {
            let len = ch.len_utf8();
            let i = symbols.len();
            symbols.push(Symbol {
                start,
                len,
                prev: i.checked_sub(1),
                next: (start + len < text.len()).then_some(i + 1),
                id: if ranks {
                    lookup(start, start + len)
                } else {
                    None
                },
            });
        }
        let mut heap = BinaryHeap::with_capacity(symbols.len());
        let push = |heap: &mut BinaryHeap<Candidate>, symbols: &[Symbol], l: usize, r: usize| {
            let (ls, rs) = (&symbols[l], &symbols[r]);
            if let Some((priority, merged)) = self.pair(text, ls, rs) {
                heap.push(Candidate {
                    priority,
                    left: l,
                    right: r,
                    size: ls.len + rs.len,
                    merged,
                });
            }
        };
        for i in 1..symbols.len() {
            push(&mut heap, &symbols, i - 1, i);
        }
        while let Some(c) = heap.pop() {
            let (l, r) = (symbols[c.left], symbols[c.right]);
            // Stale entry: one side was merged away or grew since this pair was queued.
            if l.len == 0 || r.len == 0 || l.len + r.len != c.size || l.next != Some(c.right) {
                continue;
            }
            symbols[c.left].len = c.size;
            symbols[c.left].next = r.next;
            symbols[c.left].id = Some(c.merged);
            symbols[c.right].len = 0;
            if let Some(n) = r.next {
                symbols[n].prev = Some(c.left);
            }
            if let Some(p) = l.prev {
                push(&mut heap, &symbols, p, c.left);
            }
            if let Some(n) = r.next {
                push(&mut heap, &symbols, c.left, n);
            }
        }
        let mut cur = (!symbols.is_empty()).then_some(0);
        while let Some(i) = cur {
            let s = symbols[i];
            let end = s.start + s.len;
            emit(s.id.or_else(|| lookup(s.start, end)).ok_or((s.start, end)));
            cur = s.next;
        }
    }
}
