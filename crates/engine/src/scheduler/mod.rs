//! The scheduler thread: continuous batching over one `Gemma3::forward` call per step.
//!
//! Split by concern: `admission` (the waiting queue, admission, priority preemption), `blocks`
//! (KV blocks: prefix-cache reuse at admission, room in the pool for each step), `sequence` (a
//! request's and its choices' state), `beam` (beam search), `speculative` (prompt-lookup
//! drafts); this file runs the loop and the step, and samples.
//!
//! Each step feeds one token for every decoding sequence and spends what is left of
//! `max_batch_tokens` on prompt chunks of admitted requests, oldest first. A request whose
//! prompt is fully prefilled forks its cache into `n` choices. Finished and cancelled sequences
//! leave the batch (and free their caches) before the next step. Under priority scheduling a
//! preempted request keeps its choices' state but not their caches; back in the batch, each
//! choice replays prompt + output in prompt-sized chunks before it samples again.
//!
//! With `prompt_lookup_tokens` on, a decoding choice whose last tokens occurred earlier in its
//! prompt or output feeds `next` plus the tokens that followed them (`lookup::propose`) as one
//! row, all with logits. Its tokens are then sampled from those rows in order, exactly as from
//! one row per step: each row's logits are bit for bit those a one-token decode at that position
//! gives (the model's arithmetic does not depend on the rows beside it), the processors see the
//! history with the tokens sampled so far, the sampler draws from the choice's own generator
//! once per token, and stop handling, logprobs and max_tokens run per token. Sampling goes on
//! to the next row while the token sampled equals the draft that row was fed after, and
//! generation has not ended; the cache then forgets the positions of the rejected drafts. So
//! greedy and seeded outputs are identical with speculation on and off, and unseeded output
//! keeps its distribution (a token drawn from p and kept when it equals a fixed draft is still
//! a draw from p); only the number of steps changes. Beams, structured outputs (their masks
//! come per token from worker threads) and replays after a preemption do not speculate.
//!
//! A beam-search request's sequences are its live beams: each is a row of the shared batch with
//! its own cache. Once every live beam has its row, the request expands them into the next
//! beams, forking the caches of the parents that more than one child continues.

use std::borrow::Cow;
use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::Receiver;
use std::sync::Arc;

use rayon::prelude::*;

use temper_model::{Gemma3, Logits, PrefixKey, SeqCache, SeqInput};
use temper_text::{DecodeOptions, DecodeStream, Tokenizer};
use tokio::sync::mpsc::UnboundedSender;
use tracing::{debug, error, trace, warn};

use crate::logits::{self, History, Processors};
use crate::lookup;
mod admission;
mod beam;
mod blocks;
mod sequence;
mod speculative;

use beam::*;
use sequence::*;

use crate::mask_workers::{MaskDone, MaskGate, MaskKey, MaskOutcome, MaskWorkers};
use crate::metrics::{RequestCounters, RequestTimer};
use crate::rng::{random_seed, Rng};
use crate::sampler::{self, Sampler};
use crate::stop::StopMatcher;
use crate::structured::{GrammarMatcher, TokenMask};
use crate::{
    BeamSearch, EngineConfig, EngineStats, FinishReason, GenerationEvent, GenerationRequest,
    PromptLogprob, Scheduling, StopReason, TokenLogprob,
};

/// Most prompt tokens per prefill chunk while prompt logprobs are computed: each needs its
/// whole logits row (a megabyte on a 262k vocabulary) until its top-k is taken.
const PROMPT_LOGPROB_ROWS: usize = 64;

/// A request on its way to the scheduler.
pub(crate) struct Submission {
    pub(crate) req: GenerationRequest,
    pub(crate) procs: Processors,
    pub(crate) tx: UnboundedSender<GenerationEvent>,
    pub(crate) submitted: std::time::Instant,
}

/// Counters shared with `Engine::stats` callers.
#[derive(Default)]
pub(crate) struct Stats {
    steps: AtomicU64,
    rows: AtomicU64,
    tokens: AtomicU64,
    max_rows_in_step: AtomicUsize,
    running: AtomicUsize,
    running_requests: AtomicUsize,
    waiting: AtomicUsize,
    /// New requests submitted and not yet admitted (nor cancelled): what `max_waiting` bounds.
    queued: AtomicUsize,
    preemptions: AtomicU64,
    /// Counted by the mask workers.
    pub(crate) masks: AtomicU64,
    pub(crate) masks_abandoned: AtomicU64,
    prompt_logprobs: AtomicU64,
    drafted_tokens: AtomicU64,
    accepted_tokens: AtomicU64,
    pub(crate) requests: Arc<RequestCounters>,
}

impl Stats {
    /// Counts a new request in, unless `max` are already queued.
    pub(crate) fn enter_queue(&self, max: usize) -> bool {
        self.queued
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |q| {
                (q < max).then_some(q + 1)
            })
            .is_ok()
    }

    pub(crate) fn leave_queue(&self) {
        self.queued.fetch_sub(1, Ordering::AcqRel);
    }

    pub(crate) fn snapshot(&self) -> EngineStats {
        EngineStats {
            steps: self.steps.load(Ordering::Relaxed),
            rows: self.rows.load(Ordering::Relaxed),
            tokens: self.tokens.load(Ordering::Relaxed),
            max_rows_in_step: self.max_rows_in_step.load(Ordering::Relaxed),
            running: self.running.load(Ordering::Relaxed),
            running_requests: self.running_requests.load(Ordering::Relaxed),
            waiting: self.waiting.load(Ordering::Relaxed),
            preemptions: self.preemptions.load(Ordering::Relaxed),
            masks: self.masks.load(Ordering::Relaxed),
            masks_abandoned: self.masks_abandoned.load(Ordering::Relaxed),
            prompt_logprobs: self.prompt_logprobs.load(Ordering::Relaxed),
            drafted_tokens: self.drafted_tokens.load(Ordering::Relaxed),
            accepted_tokens: self.accepted_tokens.load(Ordering::Relaxed),
        }
    }
}

/// Tokens that end generation like EOS does (unless `ignore_eos`).
pub(crate) struct EndTokens {
    eos: Option<u32>,
    end_of_turn: Option<u32>,
}

impl EndTokens {
    pub(crate) fn of(tokenizer: &Tokenizer) -> Self {
        EndTokens {
            eos: tokenizer.eos_id(),
            end_of_turn: tokenizer.token_id("<end_of_turn>"),
        }
    }

    fn contains(&self, id: u32) -> bool {
        self.eos == Some(id) || self.end_of_turn == Some(id)
    }

    pub(crate) fn ids(&self) -> Vec<u32> {
        self.eos.into_iter().chain(self.end_of_turn).collect()
    }
}

/// Who a row of the batch belongs to.
enum Row {
    Decode {
        group: usize,
        seq: usize,
    },
    /// A decode row with draft tokens: the sequence's `spec`, a logits row for each.
    Draft {
        group: usize,
        seq: usize,
    },
    /// Prompt tokens `start..end`.
    Prefill {
        group: usize,
        start: usize,
        end: usize,
    },
    /// A chunk of a preempted choice's replay that does not reach its end: nothing to sample.
    Replay {
        group: usize,
    },
}

pub(crate) struct Scheduler {
    model: Arc<Gemma3>,
    tokenizer: Arc<Tokenizer>,
    config: EngineConfig,
    stats: Arc<Stats>,
    rx: Receiver<Submission>,
    /// Sorted by `Group::rank`.
    waiting: VecDeque<Group>,
    /// Arrivals so far: the tie-breaker of `Group::rank`.
    arrivals: u64,
    groups: Vec<Group>,
    end_tokens: EndTokens,
    /// One per pool thread: the step's decode rows are sampled in parallel (the first also
    /// serves the rows sampled one at a time).
    scratch: Vec<SampleScratch>,
    masks: MaskWorkers,
}

/// What sampling a row reuses from one row to the next.
#[derive(Default)]
pub(super) struct SampleScratch {
    sampler: Sampler,
    /// The processed logits row.
    processed: Vec<f32>,
}

/// A decode row to sample: its group and choice (borrowed out of the group), the group's
/// request and processors, and the row.
struct SampleJob<'a> {
    group: usize,
    seq_index: usize,
    seq: &'a mut Seq,
    req: &'a GenerationRequest,
    procs: &'a Processors,
    row: Vec<f32>,
}

/// Threads computing structured-output masks while the model runs.
const MASK_THREADS: usize = 2;

impl Scheduler {
    pub(crate) fn new(
        model: Arc<Gemma3>,
        tokenizer: Arc<Tokenizer>,
        config: EngineConfig,
        stats: Arc<Stats>,
        rx: Receiver<Submission>,
        mask_gate: MaskGate,
    ) -> Self {
        let end_tokens = EndTokens::of(&tokenizer);
        let masks = MaskWorkers::start(MASK_THREADS, mask_gate, stats.clone());
        Scheduler {
            model,
            tokenizer,
            config,
            stats,
            rx,
            waiting: VecDeque::new(),
            arrivals: 0,
            groups: Vec::new(),
            end_tokens,
            scratch: (0..rayon::current_num_threads().max(1))
                .map(|_| SampleScratch::default())
                .collect(),
            masks,
        }
    }

    /// Serves until every `Engine` handle is gone and no work is left.
    pub(crate) fn run(mut self) {
        loop {
            if self.groups.is_empty() && self.waiting.is_empty() {
                // Idle: block instead of spinning.
                match self.rx.recv() {
                    Ok(s) => self.enqueue(s),
                    Err(_) => return,
                }
            }
            // A disconnected channel still lets the admitted work finish.
            while let Ok(s) = self.rx.try_recv() {
                self.enqueue(s);
            }
            self.drop_cancelled();
            self.admit();
            self.publish_counts();
            self.take_masks(false);
            if self.groups.is_empty() {
                continue;
            }
            if !self.has_rows_to_feed() {
                // Every running choice waits for its mask: block until one arrives.
                self.take_masks(true);
                continue;
            }
            // A bug in a step must not take the thread (and every later request) down.
            if catch_unwind(AssertUnwindSafe(|| self.step())).is_err() {
                for g in &mut self.groups {
                    g.fail("internal error in the engine step");
                }
                self.groups.clear();
            }
            self.drop_cancelled();
            self.publish_counts();
        }
    }

    /// One forward call over every active sequence, then sampling and stop handling.
    fn step(&mut self) {
        self.propose_drafts();
        // KV blocks left for prompt and replay chunks once the decode rows (and drafts) have
        // theirs.
        let mut kv_budget = self.make_kv_room();
        let decode_tokens: usize = self
            .groups
            .iter()
            .map(|g| match &g.phase {
                Phase::Decode { seqs } => seqs
                    .iter()
                    .filter(|s| s.cache.len() == s.replay_len(&g.req.prompt))
                    .map(|s| s.spec.len().max(1))
                    .sum(),
                Phase::Prefill { .. } => 0,
            })
            .sum();
        // Decode rows (with their drafts) always run; prompts share what is left. At least one
        // prompt token per step keeps prefill from starving behind a full decode batch.
        let mut budget = self
            .config
            .max_batch_tokens
            .saturating_sub(decode_tokens)
            .max(1);

        let mut rows: Vec<Row> = Vec::new();
        let mut inputs: Vec<SeqInput<'_>> = Vec::new();
        for (gi, g) in self.groups.iter_mut().enumerate() {
            let logprobs_from = g.prompt_logprobs_from();
            let Group { req, phase, .. } = g;
            match phase {
                Phase::Decode { seqs } => {
                    for (si, s) in seqs.iter_mut().enumerate() {
                        if s.waiting_row.is_some() {
                            continue;
                        }
                        let cached = s.cache.len();
                        let replay_len = s.replay_len(&req.prompt);
                        if cached == replay_len && !s.spec.is_empty() {
                            inputs.push(SeqInput {
                                tokens: &s.spec,
                                cache: &mut s.cache,
                                all_logits: true,
                                adapter: req.adapter.as_deref(),
                            });
                            rows.push(Row::Draft { group: gi, seq: si });
                            continue;
                        }
                        if cached == replay_len {
                            inputs.push(SeqInput {
                                tokens: std::slice::from_ref(&s.next),
                                cache: &mut s.cache,
                                all_logits: false,
                                adapter: req.adapter.as_deref(),
                            });
                            rows.push(Row::Decode { group: gi, seq: si });
                            continue;
                        }
                        // Replaying after a preemption: prompt + output, `next` last, chunked
                        // like a prompt; the chunk that feeds `next` samples as a decode row.
                        let room = s.cache.room_in(kv_budget);
                        if budget == 0 || room == 0 {
                            continue;
                        }
                        let end = (cached + budget.min(room)).min(replay_len + 1);
                        budget -= end - cached;
                        kv_budget -= s.cache.blocks_needed(end - cached);
                        s.replay.clear();
                        s.replay.extend(
                            req.prompt
                                .iter()
                                .chain(&s.history.output)
                                .skip(cached)
                                .take(end - cached),
                        );
                        inputs.push(SeqInput {
                            tokens: &s.replay,
                            cache: &mut s.cache,
                            all_logits: false,
                            adapter: req.adapter.as_deref(),
                        });
                        rows.push(if end == replay_len + 1 {
                            Row::Decode { group: gi, seq: si }
                        } else {
                            Row::Replay { group: gi }
                        });
                    }
                }
                Phase::Prefill { cache, done } => {
                    let room = cache.room_in(kv_budget);
                    if budget == 0 || room == 0 {
                        continue;
                    }
                    let mut end = (*done + budget.min(room)).min(req.prompt.len());
                    // Prompt logprobs need every row of the chunks they fall in; those chunks
                    // stay small. After a preemption the rows already done are skipped.
                    let mut all_logits = false;
                    if let Some(from) = logprobs_from {
                        if *done < from {
                            end = end.min(from);
                        } else {
                            end = end.min(*done + PROMPT_LOGPROB_ROWS);
                            all_logits = true;
                        }
                    }
                    budget -= end - *done;
                    kv_budget -= cache.blocks_needed(end - *done);
                    inputs.push(SeqInput {
                        tokens: &req.prompt[*done..end],
                        cache,
                        all_logits,
                        adapter: req.adapter.as_deref(),
                    });
                    rows.push(Row::Prefill {
                        group: gi,
                        start: *done,
                        end,
                    });
                }
            }
        }
        let n_tokens: usize = inputs.iter().map(|i| i.tokens.len()).sum();
        if rows.is_empty() {
            // Every prompt waits for KV blocks that running prompts hold: one must give way.
            drop(inputs);
            self.relieve_kv(
                "the KV cache is too small to hold this request's prompt; raise --kv-cache-mb",
            );
            return;
        }
        trace!(rows = rows.len(), tokens = n_tokens, "step");
        let result = catch_unwind(AssertUnwindSafe(|| self.model.forward(&mut inputs)));
        drop(inputs);

        self.stats.steps.fetch_add(1, Ordering::Relaxed);
        self.stats
            .rows
            .fetch_add(rows.len() as u64, Ordering::Relaxed);
        self.stats
            .tokens
            .fetch_add(n_tokens as u64, Ordering::Relaxed);
        self.stats
            .max_rows_in_step
            .fetch_max(rows.len(), Ordering::Relaxed);

        let logits = match result {
            Ok(Ok(l)) if l.len() == rows.len() => l,
            Ok(Ok(l)) => {
                self.fail_rows(
                    &rows,
                    &format!("model returned {} outputs for {} rows", l.len(), rows.len()),
                );
                return;
            }
            Ok(Err(e)) => {
                self.fail_rows(&rows, &format!("model error: {e}"));
                return;
            }
            Err(_) => {
                self.fail_rows(&rows, "model panicked");
                return;
            }
        };

        // Masks that came back during the forward pass serve this step's rows.
        self.take_masks(false);
        let mut decode_rows = Vec::new();
        for (row, out) in rows.iter().zip(logits) {
            match *row {
                Row::Decode { group, seq } => decode_rows.push((group, seq, out)),
                Row::Draft { group, seq } => self.verify_drafts(group, seq, &out),
                Row::Prefill { group, start, end } => self.prefill_row(group, start, end, &out),
                Row::Replay { .. } => {}
            }
        }
        self.sample_decode_rows(decode_rows);
        // Beams expand once all of a request's live beams have their row (a replay after a
        // preemption can bring them in over several steps).
        for gi in 0..self.groups.len() {
            let g = &self.groups[gi];
            if let (Some(_), Phase::Decode { seqs }) = (&g.beams, &g.phase) {
                if !seqs.is_empty() && seqs.iter().all(|s| s.waiting_row.is_some()) {
                    self.expand_beams(gi);
                }
            }
        }
        // Finished sequences leave now, dropping their caches.
        for g in &mut self.groups {
            if let Phase::Decode { seqs } = &mut g.phase {
                seqs.retain(|s| !s.finished);
            }
        }
        self.groups.retain(|g| match &g.phase {
            Phase::Decode { seqs } => !seqs.is_empty() && !g.dropped,
            Phase::Prefill { .. } => !g.dropped,
        });
    }

    /// Fails every request that had a row in a failed step; the others carry on.
    fn fail_rows(&mut self, rows: &[Row], message: &str) {
        let mut hit = vec![false; self.groups.len()];
        for r in rows {
            let (Row::Decode { group, .. }
            | Row::Draft { group, .. }
            | Row::Prefill { group, .. }
            | Row::Replay { group }) = *r;
            hit[group] = true;
        }
        for (g, &h) in self.groups.iter_mut().zip(&hit) {
            if h {
                g.fail(message);
                g.dropped = true;
            }
        }
    }

    /// Samples the step's decode rows (group, choice, logits). The rows whose choice takes a
    /// token now are sampled in parallel, a share per pool thread: each is a pass or more over
    /// the vocabulary, and one after another they kept one core busy for ~3 ms of a 32-row
    /// step while the other waited. Their events are sent afterwards, in row order. The others
    /// (beams, constrained choices whose mask is not back) go through `sample_seq`.
    fn sample_decode_rows(&mut self, rows: Vec<(usize, usize, Logits)>) {
        let mut ready = Vec::with_capacity(rows.len());
        for (gi, si, out) in rows {
            let Some(row) = into_last_row(out) else {
                self.groups[gi].fail("model returned an empty logits row");
                self.groups[gi].dropped = true;
                continue;
            };
            if self.samples_now(gi, si) {
                ready.push((gi, si, row));
            } else {
                self.sample_seq(gi, si, Cow::Owned(row));
            }
        }
        ready.sort_unstable_by_key(|&(gi, si, _)| (gi, si));
        let mut ready = ready.into_iter().peekable();
        let mut jobs = Vec::with_capacity(ready.len());
        for (gi, g) in self.groups.iter_mut().enumerate() {
            let Group {
                req, procs, phase, ..
            } = g;
            let Phase::Decode { seqs } = phase else {
                continue;
            };
            for (si, seq) in seqs.iter_mut().enumerate() {
                if let Some((_, _, row)) = ready.next_if(|r| (r.0, r.1) == (gi, si)) {
                    jobs.push(SampleJob {
                        group: gi,
                        seq_index: si,
                        seq,
                        req,
                        procs,
                        row,
                    });
                }
            }
        }
        let (tokenizer, end_tokens) = (&self.tokenizer, &self.end_tokens);
        let sample = |jobs: &mut [SampleJob<'_>], scratch: &mut SampleScratch| {
            jobs.iter_mut()
                .map(|j| {
                    let emitted = emit_token(
                        j.seq, j.req, j.procs, &j.row, scratch, tokenizer, end_tokens,
                    );
                    (j.group, j.seq_index, emitted)
                })
                .collect::<Vec<_>>()
        };
        let sampled = if jobs.len() > 1 {
            let per_thread = jobs.len().div_ceil(self.scratch.len());
            jobs.par_chunks_mut(per_thread)
                .zip(self.scratch.par_iter_mut())
                .flat_map_iter(|(jobs, scratch)| sample(jobs, scratch))
                .collect()
        } else {
            // One row: not worth handing to the pool.
            sample(&mut jobs, &mut self.scratch[0])
        };
        for (gi, si, emitted) in sampled {
            self.after_token(gi, si, emitted);
        }
    }

    /// Whether choice `si` of group `gi` takes a token from its row now (a live group's choice
    /// that does not keep its row, see `Seq::keeps_row`).
    fn samples_now(&self, gi: usize, si: usize) -> bool {
        let g = &self.groups[gi];
        let Phase::Decode { seqs } = &g.phase else {
            return false;
        };
        !g.dropped && seqs.get(si).is_some_and(|seq| !seq.keeps_row())
    }

    /// Samples choice `si` of group `gi` from `row` and sends its events; a beam, or a
    /// constrained choice whose mask is not back yet, keeps the row for later instead (an owned
    /// row moves there without a copy).
    fn sample_seq(&mut self, gi: usize, si: usize, row: Cow<'_, [f32]>) {
        let g = &mut self.groups[gi];
        if g.dropped {
            return;
        }
        let Phase::Decode { seqs } = &mut g.phase else {
            return;
        };
        let Some(seq) = seqs.get_mut(si) else {
            return;
        };
        if seq.keeps_row() {
            seq.waiting_row = Some(row.into_owned());
            return;
        }
        let emitted = emit_token(
            seq,
            &g.req,
            &g.procs,
            &row,
            &mut self.scratch[0],
            &self.tokenizer,
            &self.end_tokens,
        );
        self.after_token(gi, si, emitted);
    }

    /// After choice `si` of group `gi` took a token: starts its next mask, and sends the
    /// events (or fails the request).
    fn after_token(&mut self, gi: usize, si: usize, emitted: Result<Vec<GenerationEvent>, String>) {
        let g = &mut self.groups[gi];
        let Phase::Decode { seqs } = &mut g.phase else {
            return;
        };
        let Some(seq) = seqs.get_mut(si) else {
            return;
        };
        // The next mask depends only on the tokens sampled so far: start it now, while the
        // next forward pass runs.
        if !seq.finished {
            if let Some(matcher) = seq.grammar.as_mut().and_then(|gr| gr.matcher.take()) {
                let key = MaskKey {
                    group: g.id,
                    choice: seq.choice,
                };
                self.masks.submit(key, matcher, g.tx.clone());
            }
        }
        match emitted {
            Ok(events) => {
                for ev in events {
                    g.send(ev);
                }
            }
            Err(message) => {
                g.fail(&message);
                g.dropped = true;
            }
        }
    }

    /// Hands finished masks back to their choices, sampling the ones that were waiting. With
    /// `wait`, blocks for the first one.
    fn take_masks(&mut self, wait: bool) {
        let mut wait = wait;
        while let Some(MaskDone { key, outcome }) = self.masks.next_done(wait) {
            wait = false;
            let Some(gi) = self.groups.iter().position(|g| g.id == key.group) else {
                // A preempted request keeps its matcher for when it runs again (its replay
                // recomputes the row); a cancelled or failed one drops the result.
                if let Some(g) = self.waiting.iter_mut().find(|g| g.id == key.group) {
                    if let (Phase::Decode { seqs }, MaskOutcome::Ready(matcher, mask)) =
                        (&mut g.phase, outcome)
                    {
                        if let Some(gr) = seqs
                            .iter_mut()
                            .find(|s| s.choice == key.choice)
                            .and_then(|s| s.grammar.as_mut())
                        {
                            gr.matcher = Some(*matcher);
                            gr.mask = Some(mask);
                        }
                    }
                }
                continue;
            };
            let g = &mut self.groups[gi];
            let Phase::Decode { seqs } = &mut g.phase else {
                continue;
            };
            let Some(si) = seqs.iter().position(|s| s.choice == key.choice) else {
                continue;
            };
            let (matcher, mask) = match outcome {
                MaskOutcome::Ready(matcher, mask) => (*matcher, mask),
                MaskOutcome::Failed(e) => {
                    g.fail(&e.to_string());
                    g.dropped = true;
                    continue;
                }
                // Its client is gone: `drop_cancelled` removes the request.
                MaskOutcome::Abandoned => continue,
            };
            let seq = &mut seqs[si];
            if let Some(gr) = &mut seq.grammar {
                gr.matcher = Some(matcher);
                gr.mask = Some(mask);
            }
            if let Some(row) = seq.waiting_row.take() {
                self.sample_seq(gi, si, Cow::Owned(row));
            }
        }
    }

    /// Whether the next step has any row: a prompt to prefill or a choice not waiting for
    /// its mask.
    fn has_rows_to_feed(&self) -> bool {
        self.groups.iter().any(|g| match &g.phase {
            Phase::Prefill { .. } => true,
            Phase::Decode { seqs } => seqs.iter().any(|s| s.waiting_row.is_none()),
        })
    }

    fn prefill_row(&mut self, gi: usize, start: usize, end: usize, out: &Logits) {
        let g = &mut self.groups[gi];
        if out.rows == end - start {
            let added = add_prompt_logprobs(g, start, out);
            self.stats
                .prompt_logprobs
                .fetch_add(added as u64, Ordering::Relaxed);
        }
        let Phase::Prefill { done, .. } = &mut g.phase else {
            return;
        };
        *done = end;
        if end < g.req.prompt.len() {
            return;
        }
        if g.req.prompt_logprobs.is_some() {
            let entries = std::mem::take(&mut g.prompt_logprobs);
            g.send(GenerationEvent::PromptLogprobs { entries });
        }
        let Phase::Prefill { cache, .. } = &mut g.phase else {
            return;
        };
        let Some(row) = last_row(out) else {
            g.fail("model returned an empty logits row");
            g.dropped = true;
            return;
        };
        let n = g.req.n;
        let prompt_cache = std::mem::replace(cache, self.model.new_cache());
        let opts = decode_options(&g.req);
        if g.beams.is_some() {
            // One root beam holding the prompt; the step's expansion forks it.
            let mut root = Seq::new(0, prompt_cache, Rng::new(0), opts, &g.req);
            root.waiting_row = Some(row.to_vec());
            root.beam = Some(BeamPath::default());
            g.phase = Phase::Decode { seqs: vec![root] };
            return;
        }
        // The prompt is in the cache: fork it into the n choices.
        // n - 1 copies plus the original: n == 1 costs no copy.
        let mut caches: Vec<SeqCache> = (1..n).map(|_| prompt_cache.clone()).collect();
        caches.push(prompt_cache);
        let mut seqs = Vec::with_capacity(n);
        for (choice, cache) in caches.into_iter().enumerate() {
            let seed = match g.req.sampling.seed {
                // vLLM's rule: choice i draws from seed + i.
                Some(s) => s.wrapping_add(choice as u64),
                None => random_seed(),
            };
            seqs.push(Seq::new(choice, cache, Rng::new(seed), opts, &g.req));
        }
        debug!(request_id = %g.req.request_id, prompt_tokens = end, "prefilled");
        g.phase = Phase::Decode { seqs };
        for si in 0..n {
            self.sample_seq(gi, si, Cow::Borrowed(row));
        }
    }
}

/// Appends the prompt logprobs that the rows of a chunk starting at prompt position `start`
/// give: row j predicts position start + j + 1. Rows are taken in parallel. Returns how many
/// were added.
fn add_prompt_logprobs(g: &mut Group, start: usize, out: &Logits) -> usize {
    let (Some(from), Some(k)) = (g.prompt_logprobs_from(), g.req.prompt_logprobs) else {
        return 0;
    };
    let prompt = &g.req.prompt;
    // Rows before `from` were done before a preemption; the last prompt row predicts the
    // first generated token, not a prompt token.
    let rows = from.max(start)..(start + out.rows).min(prompt.len() - 1);
    if rows.start != from {
        return 0;
    }
    let entries: Vec<PromptLogprob> = rows
        .into_par_iter()
        .map(|q| sampler::prompt_logprob(out.row(q - start), prompt[q + 1], k))
        .collect();
    let added = entries.len();
    g.prompt_logprobs.extend(entries);
    added
}

fn decode_options(req: &GenerationRequest) -> DecodeOptions {
    DecodeOptions {
        skip_special_tokens: req.stopping.skip_special_tokens,
        spaces_between_special_tokens: req.stopping.spaces_between_special_tokens,
    }
}

fn last_row(out: &Logits) -> Option<&[f32]> {
    if out.rows == 0 || out.vocab == 0 || out.data.len() < out.rows * out.vocab {
        return None;
    }
    Some(&out.data[(out.rows - 1) * out.vocab..out.rows * out.vocab])
}

/// [`last_row`], owned: a decode row's logits are one row, which moves without a copy.
fn into_last_row(out: Logits) -> Option<Vec<f32>> {
    last_row(&out)?;
    let mut data = out.data;
    data.drain(..(out.rows - 1) * out.vocab);
    data.truncate(out.vocab);
    Some(data)
}

/// Samples the next token of `seq` from `row` and returns the events it produces (a Token, and
/// a Finished when generation ends). A constrained choice samples under its grammar's mask,
/// which this consumes, and advances its matcher; `Err` fails the request.
#[allow(clippy::too_many_arguments)]
fn emit_token(
    seq: &mut Seq,
    req: &GenerationRequest,
    procs: &Processors,
    row: &[f32],
    scratch: &mut SampleScratch,
    tokenizer: &Tokenizer,
    end_tokens: &EndTokens,
) -> Result<Vec<GenerationEvent>, String> {
    let stopping = &req.stopping;
    let SampleScratch { sampler, processed } = scratch;
    let mask = seq.grammar.as_mut().and_then(|g| g.mask.take());
    let token = if procs.apply(row, &seq.history, mask.as_ref(), processed) {
        // With every token masked the sampler would fall back to id 0: a wrong answer, not an
        // answer. The request fails instead, saying why.
        if !processed.iter().any(|&l| l > f32::NEG_INFINITY) {
            return Err(if mask.is_some() {
                "structured output: no token satisfies both the grammar and the other sampling \
                 constraints"
            } else {
                "no token is left to sample: allowed_token_ids, bad_words, min_tokens and \
                 logit_bias together exclude every token"
            }
            .into());
        }
        sampler.sample(processed, &req.sampling, &mut seq.rng)
    } else {
        sampler.sample(row, &req.sampling, &mut seq.rng)
    };
    // The grammar ends the choice when it cannot be extended further.
    let mut grammar_done = false;
    if let (Some(g), Some(_)) = (&mut seq.grammar, &mask) {
        let matcher = g
            .matcher
            .as_mut()
            .ok_or("structured output: the matcher is missing")?;
        matcher.consume(token).map_err(|e| e.to_string())?;
        grammar_done = matcher.is_stopped();
    }
    // Logprobs stay the model's raw distribution, before any processor.
    let logprob = req.logprobs.map(|k| sampler::logprobs(row, token, k));
    seq.generated += 1;
    seq.next = token;
    seq.history.push(token);

    // The first min_tokens tokens never stop generation (min_tokens masking keeps stop tokens
    // out of them; this also covers a request whose every other token is masked).
    let may_stop = seq.generated > stopping.min_tokens;
    let end_of_generation = may_stop && !stopping.ignore_eos && end_tokens.contains(token);
    let stop_token = may_stop && stopping.stop_token_ids.contains(&token);
    let (text, finish) = if end_of_generation || stop_token {
        // The stop token itself adds no text; what was held back comes out with Finished.
        let reason = if end_of_generation {
            None
        } else {
            Some(StopReason::Token(token))
        };
        (String::new(), Some((FinishReason::Stop, reason)))
    } else {
        let delta = seq.decode.step(tokenizer, token);
        let (mut text, matched) = seq.matcher.push(&delta, may_stop);
        if let Some(s) = matched {
            (text, Some((FinishReason::Stop, Some(StopReason::Text(s)))))
        } else if grammar_done {
            (text, Some((FinishReason::Stop, None)))
        } else if seq.generated >= stopping.max_tokens {
            // A stop string may still complete in the detokenizer's held-back bytes.
            let (tail, matched) = seq.matcher.push(&seq.decode.flush(), may_stop);
            text.push_str(&tail);
            match matched {
                Some(s) => (text, Some((FinishReason::Stop, Some(StopReason::Text(s))))),
                None => (text, Some((FinishReason::Length, None))),
            }
        } else if seq.generated >= stopping.min_tokens
            && stopping
                .repetition_detection
                .is_some_and(|rd| logits::repeats(&seq.history.output, &rd))
        {
            (
                text,
                Some((FinishReason::Repetition, Some(StopReason::Repetition))),
            )
        } else {
            (text, None)
        }
    };
    let mut events = vec![GenerationEvent::Token {
        choice: seq.choice,
        token_id: token,
        text,
        logprob,
    }];
    if let Some((reason, stop_reason)) = finish {
        let mut rest = String::new();
        if reason != FinishReason::Length && !matches!(stop_reason, Some(StopReason::Text(_))) {
            // Ended by a token or by repetition: release the detokenizer's incomplete bytes too.
            let (tail, _) = seq.matcher.push(&seq.decode.flush(), false);
            rest.push_str(&tail);
        }
        rest.push_str(&seq.matcher.finish());
        seq.finished = true;
        debug!(
            request_id = %req.request_id,
            choice = seq.choice,
            ?reason,
            ?stop_reason,
            completion_tokens = seq.generated,
            "finished"
        );
        events.push(GenerationEvent::Finished {
            choice: seq.choice,
            reason,
            stop_reason,
            text: rest,
            prompt_tokens: req.prompt.len(),
            // `Group::send` fills it in.
            cached_tokens: 0,
            completion_tokens: seq.generated,
        });
    }
    Ok(events)
}

/// Logs a scheduler thread that could not be started; `submit` then reports `Stopped`.
pub(crate) fn spawn_failed(e: &std::io::Error) {
    warn!("could not start the engine scheduler thread: {e}");
}
