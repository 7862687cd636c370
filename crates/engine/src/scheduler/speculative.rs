//! Speculative decoding by prompt lookup: drafts proposed from earlier n-gram matches
//! (`crate::lookup`), fitted to the step's budgets, verified row by row through the normal
//! sampling path.

use std::sync::atomic::Ordering;

use tracing::trace;

use temper_model::Logits;

use crate::lookup;
use crate::output::OutputProcessor;
use crate::stats::Stats;

use super::sequence::{Group, Phase, SampleScratch};

/// Proposes this step's draft tokens (`lookup::propose`, at most `k` per choice) for the
/// decoding choices that may speculate: not beams, structured outputs or replays; at most one
/// token fewer than the choice has left to generate; and, over the step, what
/// `max_batch_tokens` leaves beside one row per decoding choice (earlier requests first).
pub(super) fn propose(groups: &mut [Group], k: usize, max_batch_tokens: usize) {
    let decode_rows: usize = groups
        .iter()
        .map(|g| match &g.phase {
            Phase::Decode { seqs } => seqs.len(),
            Phase::Prefill { .. } => 0,
        })
        .sum();
    let mut budget = max_batch_tokens.saturating_sub(decode_rows);
    for g in groups {
        let Phase::Decode { seqs } = &mut g.phase else {
            continue;
        };
        let may = k > 0 && g.beams.is_none() && !g.dropped;
        for s in seqs {
            s.spec.clear();
            if !may
                || s.grammar.is_some()
                || s.beam.is_some()
                || s.waiting_row.is_some()
                || s.kv.len() != s.replay_len(&g.req.prompt)
            {
                continue;
            }
            let left = g.req.stopping.budget().saturating_sub(s.generated());
            let most = k.min(left.saturating_sub(1)).min(budget);
            if most == 0 {
                continue;
            }
            // The cache holds prompt + output but `next`.
            s.spec.push(s.next);
            lookup::propose(s.kv.tokens(), &mut s.spec, most);
            if s.spec.len() == 1 {
                s.spec.clear();
            } else {
                budget -= s.spec.len() - 1;
            }
        }
    }
}

/// Cuts this step's drafts down to what `spare` KV blocks hold beyond the decode rows' own
/// (earlier requests first); returns the blocks left.
pub(super) fn fit(groups: &mut [Group], mut spare: usize) -> usize {
    for g in groups {
        let Phase::Decode { seqs } = &mut g.phase else {
            continue;
        };
        for s in seqs.iter_mut().filter(|s| !s.spec.is_empty()) {
            let own = s.kv.blocks_needed(1);
            let fits = s.kv.room_in(own + spare).max(1);
            s.spec.truncate(fits);
            if s.spec.len() == 1 {
                s.spec.clear();
            }
            spare -= s.kv.blocks_needed(s.spec.len().max(1)) - own;
        }
    }
    spare
}

/// Samples choice `si` of `g` from the rows of its speculative input (`next`, then the drafts
/// d1..dk): row i gives a token the normal way (`Seq::take_token`); when it equals d(i+1) and
/// generation goes on, row i+1 gives the next one. Every sampled token is sent; the cache then
/// forgets the drafts after the last accepted one. The logits, processors' history and random
/// draws of each token are those of one decode step at its position, so the output is the one
/// without drafts (see the scheduler's note).
pub(super) fn verify(
    g: &mut Group,
    si: usize,
    out: &Logits,
    scratch: &mut SampleScratch,
    output: &OutputProcessor,
    stats: &Stats,
) {
    let Some((seq, req, procs)) = g.live_choice(si) else {
        return;
    };
    let input = std::mem::take(&mut seq.spec);
    if input.len() < 2 || out.rows != input.len() || out.data.len() < out.rows * out.vocab {
        g.fail("model returned the wrong number of logits rows for a speculative row");
        g.dropped = true;
        return;
    }
    let drafted = input.len() - 1;
    let mut accepted = 0;
    let mut events = Vec::new();
    let mut failed = None;
    for i in 0..input.len() {
        match seq.take_token(req, procs, out.row(i), scratch, output) {
            Ok(ev) => events.extend(ev),
            Err(message) => {
                failed = Some(message);
                break;
            }
        }
        if input.get(i + 1) != Some(&seq.next) {
            break;
        }
        accepted += 1;
        if seq.finished() {
            break;
        }
    }
    // The cache holds every input position; the accepted drafts' stay.
    let keep = seq.kv.len() - (drafted - accepted);
    seq.kv.truncate(keep);
    // Keeps the buffer for the next step.
    seq.spec = input;
    seq.spec.clear();
    trace!(request_id = %req.request_id, choice = seq.choice, drafted, accepted, "drafts verified");
    stats
        .drafted_tokens
        .fetch_add(drafted as u64, Ordering::Relaxed);
    stats
        .accepted_tokens
        .fetch_add(accepted as u64, Ordering::Relaxed);
    for ev in events {
        g.send(ev);
    }
    if let Some(message) = failed {
        g.fail(&message);
        g.dropped = true;
    }
}
