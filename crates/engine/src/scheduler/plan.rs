//! A step's plan: which rows the forward runs, what each feeds, and what its logits are for.
//! The scheduler decides it (and reserves its KV blocks) before the step executes it.

use temper_model::SeqInput;

use crate::kv_manager::SeqKv;

use super::sequence::{Group, Phase, Seq};

/// The rows of one step, in batch order (groups in order, a group's choices in order).
pub(super) struct StepPlan {
    pub(super) rows: Vec<Row>,
}

/// One row of the batch.
#[derive(Clone, Copy)]
pub(super) enum Row {
    /// Choice `seq` of decoding request `group`.
    Choice {
        group: usize,
        seq: usize,
        feed: ChoiceFeed,
    },
    /// Prompt tokens `start..end` of prefilling request `group`; `all_logits` for prompt
    /// logprobs.
    Prompt {
        group: usize,
        start: usize,
        end: usize,
        all_logits: bool,
    },
}

/// What a choice's row feeds.
#[derive(Clone, Copy)]
pub(super) enum ChoiceFeed {
    /// Its `next` token; the logits give the token after it.
    Next,
    /// `next` then the draft tokens (`Seq::spec`), a logits row for each.
    Drafts,
    /// A chunk of a preempted choice's replay (`Seq::replay`); one that `ends` with `next`
    /// gives the next token as `Next` does, the others nothing to sample.
    Replay { ends: bool },
}

impl Row {
    pub(super) fn group(&self) -> usize {
        match *self {
            Row::Choice { group, .. } | Row::Prompt { group, .. } => group,
        }
    }

    /// The KV of the sequence this row appends to.
    pub(super) fn kv_mut<'a>(&self, groups: &'a mut [Group]) -> Option<&'a mut SeqKv> {
        match (*self, &mut groups.get_mut(self.group())?.phase) {
            (Row::Prompt { .. }, Phase::Prefill { cache, .. }) => Some(cache),
            (Row::Choice { seq, .. }, Phase::Decode { seqs }) => Some(&mut seqs.get_mut(seq)?.kv),
            _ => None,
        }
    }
}

impl StepPlan {
    /// The forward's inputs, one per row in order.
    pub(super) fn inputs<'a>(&self, groups: &'a mut [Group]) -> Vec<SeqInput<'a>> {
        let mut rows = self.rows.iter().peekable();
        let mut inputs = Vec::with_capacity(self.rows.len());
        for (gi, g) in groups.iter_mut().enumerate() {
            let Group { req, phase, .. } = g;
            let adapter = req.adapter.as_deref();
            match phase {
                Phase::Prefill { cache, .. } => {
                    if let Some(&Row::Prompt {
                        start,
                        end,
                        all_logits,
                        ..
                    }) = rows.next_if(|r| r.group() == gi)
                    {
                        inputs.push(SeqInput {
                            tokens: &req.prompt[start..end],
                            cache: cache.cache_mut(),
                            all_logits,
                            adapter,
                        });
                    }
                }
                Phase::Decode { seqs } => {
                    for (si, s) in seqs.iter_mut().enumerate() {
                        let Some(&Row::Choice { feed, .. }) = rows.next_if(|r| {
                            matches!(**r, Row::Choice { group, seq, .. } if (group, seq) == (gi, si))
                        }) else {
                            continue;
                        };
                        let Seq {
                            next,
                            spec,
                            replay,
                            kv,
                            ..
                        } = s;
                        let (tokens, all_logits): (&[u32], bool) = match feed {
                            ChoiceFeed::Next => (std::slice::from_ref(next), false),
                            ChoiceFeed::Drafts => (spec, true),
                            ChoiceFeed::Replay { .. } => (replay, false),
                        };
                        inputs.push(SeqInput {
                            tokens,
                            cache: kv.cache_mut(),
                            all_logits,
                            adapter,
                        });
                    }
                }
            }
        }
        inputs
    }
}
