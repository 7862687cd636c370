//! The scheduler thread: continuous batching over one `Decoder::forward` call per step.
//!
//! This file is the scheduler itself: the loop, admission and preemption, and each step as a
//! plan (which rows run, how many tokens each feeds, their KV blocks reserved through the
//! `KvManager`) that is then executed (the forward, sampling, and the output processor's
//! events). Its parts are their own types: `queue` (the waiting queue), `sequence` (a
//! request's and its choices' state, and taking a token from a row), `plan` (a step's rows),
//! `beam` (beam search), `speculative` (prompt-lookup drafts).
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
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering;
use std::sync::mpsc::Receiver;
use std::sync::Arc;

use rayon::prelude::*;
use tracing::{debug, trace, warn};

use temper_model::{Decoder, Logits};
use temper_text::Tokenizer;

use crate::kv_manager::{KvManager, PrefixKey, SeqKv};
use crate::logits::Processors;
use crate::mask_workers::{MaskDone, MaskGate, MaskKey, MaskOutcome, MaskWorkers};
use crate::metrics::RequestTimer;
use crate::output::OutputProcessor;
use crate::rng::{random_seed, Rng};
use crate::stats::Stats;
use crate::{EngineConfig, GenerationEvent, GenerationRequest, Scheduling};

mod beam;
mod plan;
mod queue;
mod sequence;
mod speculative;

use beam::BeamPath;
use plan::{ChoiceFeed, Row, StepPlan};
use queue::WaitingQueue;
use sequence::{Group, Phase, SampleScratch, Seq};

pub(crate) use queue::Submission;

/// Most prompt tokens per prefill chunk while prompt logprobs are computed: each needs its
/// whole logits row (a megabyte on a 262k vocabulary) until its top-k is taken.
const PROMPT_LOGPROB_ROWS: usize = 64;

/// Threads computing structured-output masks while the model runs.
const MASK_THREADS: usize = 2;

pub(crate) struct Scheduler {
    model: Arc<Decoder>,
    kv: KvManager,
    output: OutputProcessor,
    config: EngineConfig,
    stats: Arc<Stats>,
    rx: Receiver<Submission>,
    waiting: WaitingQueue,
    groups: Vec<Group>,
    /// One per pool thread: the step's decode rows are sampled in parallel (the first also
    /// serves the rows sampled one at a time).
    scratch: Vec<SampleScratch>,
    masks: MaskWorkers,
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

impl Scheduler {
    pub(crate) fn new(
        model: Arc<Decoder>,
        kv: KvManager,
        tokenizer: Arc<Tokenizer>,
        config: EngineConfig,
        stats: Arc<Stats>,
        rx: Receiver<Submission>,
        mask_gate: MaskGate,
    ) -> Self {
        let masks = MaskWorkers::start(MASK_THREADS, mask_gate, stats.clone());
        Scheduler {
            model,
            kv,
            output: OutputProcessor::new(tokenizer),
            config,
            stats,
            rx,
            waiting: WaitingQueue::default(),
            groups: Vec::new(),
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

    fn enqueue(&mut self, s: Submission) {
        debug!(request_id = %s.req.request_id, prompt_tokens = s.req.prompt.len(), n = s.req.n, "queued");
        let priority = match self.config.scheduling {
            Scheduling::Fcfs => 0,
            Scheduling::Priority => s.req.priority,
        };
        let id = self.waiting.arrive();
        let prefix_key = PrefixKey::new(
            s.req.adapter.as_ref().map(|a| a.id()),
            s.req.cache_salt.as_deref(),
        );
        let timer = RequestTimer::new(self.stats.requests.clone(), s.submitted, s.req.n);
        let cache = self.kv.new_seq(Some(prefix_key));
        let rank = (priority, id);
        let group = Group::new(id, rank, s.req, s.procs, s.tx, cache, timer);
        self.waiting.push(group);
    }

    fn publish_counts(&self) {
        let running = self.groups.iter().map(Group::running).sum();
        self.stats.running.store(running, Ordering::Relaxed);
        self.stats
            .running_requests
            .store(self.groups.len(), Ordering::Relaxed);
        self.stats
            .waiting
            .store(self.waiting.len(), Ordering::Relaxed);
    }

    /// Removes requests whose receiver is gone, freeing their caches now.
    fn drop_cancelled(&mut self) {
        self.waiting.drop_cancelled(&self.stats);
        self.groups.retain(|g| {
            let gone = g.dropped || g.tx.is_closed();
            if gone {
                debug!(request_id = %g.req.request_id, "cancelled");
            }
            !gone
        });
    }

    /// In queue order while the running sequences fit `max_running`; a request wider than the
    /// cap runs alone rather than never. Under priority scheduling a request that does not fit
    /// preempts running requests ranked behind it, worst first, until it fits; only when
    /// preempting all of them would make room, so none is preempted for nothing.
    /// A request also waits while the KV pool lacks the blocks it needs to start beside the
    /// running ones; one that could never fit in the whole pool fails, saying so.
    fn admit(&mut self) {
        let mut running: usize = self.groups.iter().map(Group::running).sum();
        let kv = self.kv.stats();
        let capacity = kv.capacity_blocks;
        let mut kv_free = kv.available_blocks().saturating_sub(running);
        while let Some(front) = self.waiting.front() {
            let n = front.running();
            let blocks = front.blocks_to_start();
            if blocks > capacity {
                let mut g = self.waiting.pop(&self.stats).expect("the front");
                let block_mb = self.kv.block_bytes() as f64 / (1 << 20) as f64;
                g.fail(&format!(
                    "the KV cache is too small for this request: it needs {blocks} blocks \
                     ({:.0} MB) and the pool has {capacity} ({:.0} MB); raise --kv-cache-mb",
                    blocks as f64 * block_mb,
                    capacity as f64 * block_mb
                ));
                continue;
            }
            if running > 0 && blocks > kv_free {
                break;
            }
            if !self.fits(running, n) {
                if self.config.scheduling == Scheduling::Priority
                    && self.preemption_makes_room(front.rank, n)
                    && self.preempt_behind(front.rank)
                {
                    running = self.groups.iter().map(Group::running).sum();
                    continue;
                }
                break;
            }
            let Some(mut g) = self.waiting.pop(&self.stats) else {
                break;
            };
            g.reuse_prefixes(&self.kv);
            debug!(request_id = %g.req.request_id, cached_tokens = ?g.cached_tokens, "admitted");
            running += n;
            kv_free = kv_free.saturating_sub(blocks);
            self.groups.push(g);
        }
    }

    /// Whether `n` more sequences may run beside `running` ones.
    fn fits(&self, running: usize, n: usize) -> bool {
        running == 0 || running + n <= self.config.max_running
    }

    /// Whether a request of `n` sequences ranked `rank` would fit once every running request
    /// ranked behind it is preempted.
    fn preemption_makes_room(&self, rank: (i64, u64), n: usize) -> bool {
        let kept = self
            .groups
            .iter()
            .filter(|g| g.rank < rank)
            .map(Group::running)
            .sum();
        self.fits(kept, n)
    }

    /// Sends the worst-ranked running request ranked behind `rank` back to the queue.
    fn preempt_behind(&mut self, rank: (i64, u64)) -> bool {
        let victim = (0..self.groups.len())
            .filter(|&i| self.groups[i].rank > rank)
            .max_by_key(|&i| self.groups[i].rank);
        let Some(i) = victim else {
            return false;
        };
        self.preempt_group(i);
        true
    }

    /// Sends running request `i` back to the queue, freeing its caches.
    fn preempt_group(&mut self, i: usize) {
        let mut g = self.groups.remove(i);
        debug!(request_id = %g.req.request_id, "preempted");
        self.stats.preemptions.fetch_add(1, Ordering::Relaxed);
        g.preempt();
        self.waiting.push(g);
    }

    /// Makes sure the KV pool holds this step's decode rows: while it does not, the
    /// worst-ranked running request goes back to the queue (preemption by recompute); a request
    /// alone that still does not fit fails. Draft tokens get what blocks are left
    /// (`speculative::fit`). Returns the blocks left for prompt chunks.
    fn make_kv_room(&mut self) -> usize {
        loop {
            let needed: usize = self
                .groups
                .iter()
                .map(|g| match &g.phase {
                    Phase::Decode { seqs } => seqs
                        .iter()
                        .filter(|s| s.waiting_row.is_none())
                        .filter(|s| s.kv.len() == s.replay_len(&g.req.prompt))
                        .map(|s| s.kv.blocks_needed(1))
                        .sum(),
                    Phase::Prefill { .. } => 0,
                })
                .sum();
            let stats = self.kv.stats();
            let available = stats.available_blocks();
            if needed <= available {
                return speculative::fit(&mut self.groups, available - needed);
            }
            self.relieve_kv(&format!(
                "the KV cache is full: {needed} blocks needed, {available} of {} available; \
                 raise --kv-cache-mb",
                stats.capacity_blocks
            ));
        }
    }

    /// Frees KV blocks when the running requests cannot go on: preempts the worst-ranked one,
    /// or fails the only one with `message`.
    fn relieve_kv(&mut self, message: &str) {
        let worst = (0..self.groups.len()).max_by_key(|&i| self.groups[i].rank);
        match worst {
            Some(i) if self.groups.len() > 1 => self.preempt_group(i),
            Some(i) => {
                let mut g = self.groups.remove(i);
                g.fail(message);
            }
            None => {}
        }
    }

    /// One forward call over every active sequence, then sampling and stop handling.
    fn step(&mut self) {
        if let Some(plan) = self.plan() {
            self.execute(plan);
        }
    }

    /// Decides this step's rows and reserves their KV blocks. Each decoding choice feeds one
    /// token (with its drafts); prompts and replays share what is left of `max_batch_tokens`
    /// and of the pool, earlier requests first. `None`: no row could be given its blocks, and
    /// a request was preempted (or failed) to make room.
    fn plan(&mut self) -> Option<StepPlan> {
        speculative::propose(
            &mut self.groups,
            self.config.prompt_lookup_tokens,
            self.config.max_batch_tokens,
        );
        // KV blocks left for prompt and replay chunks once the decode rows (and drafts) have
        // theirs.
        let mut kv_budget = self.make_kv_room();
        let decode_tokens: usize = self
            .groups
            .iter()
            .map(|g| match &g.phase {
                Phase::Decode { seqs } => seqs
                    .iter()
                    .filter(|s| s.kv.len() == s.replay_len(&g.req.prompt))
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
        let mut reserved = true;
        'groups: for (gi, g) in self.groups.iter_mut().enumerate() {
            let logprobs_from = g.prompt_logprobs_from();
            let Group { req, phase, .. } = g;
            match phase {
                Phase::Decode { seqs } => {
                    for (si, s) in seqs.iter_mut().enumerate() {
                        if s.waiting_row.is_some() {
                            continue;
                        }
                        let cached = s.kv.len();
                        let replay_len = s.replay_len(&req.prompt);
                        let (tokens, feed) = if cached == replay_len && !s.spec.is_empty() {
                            (s.spec.len(), ChoiceFeed::Drafts)
                        } else if cached == replay_len {
                            (1, ChoiceFeed::Next)
                        } else {
                            // Replaying after a preemption: prompt + output, `next` last,
                            // chunked like a prompt; the chunk that feeds `next` samples as a
                            // decode row.
                            let room = s.kv.room_in(kv_budget);
                            if budget == 0 || room == 0 {
                                continue;
                            }
                            let end = (cached + budget.min(room)).min(replay_len + 1);
                            budget -= end - cached;
                            kv_budget -= s.kv.blocks_needed(end - cached);
                            s.replay.clear();
                            s.replay.extend(
                                req.prompt
                                    .iter()
                                    .chain(&s.history.output)
                                    .skip(cached)
                                    .take(end - cached),
                            );
                            let ends = end == replay_len + 1;
                            (end - cached, ChoiceFeed::Replay { ends })
                        };
                        if self.kv.allocate(&mut s.kv, tokens).is_none() {
                            reserved = false;
                            break 'groups;
                        }
                        rows.push(Row::Choice {
                            group: gi,
                            seq: si,
                            feed,
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
                    if self.kv.allocate(cache, end - *done).is_none() {
                        reserved = false;
                        break 'groups;
                    }
                    rows.push(Row::Prompt {
                        group: gi,
                        start: *done,
                        end,
                        all_logits,
                    });
                }
            }
        }
        if !reserved {
            // The budget above keeps within the pool; should an allocation still fail, the
            // step gives way like one whose rows do not fit.
            self.relieve_kv("the KV cache is full; raise --kv-cache-mb");
            return None;
        }
        if rows.is_empty() {
            // Every prompt waits for KV blocks that running prompts hold: one must give way.
            self.relieve_kv(
                "the KV cache is too small to hold this request's prompt; raise --kv-cache-mb",
            );
            return None;
        }
        Some(StepPlan { rows })
    }

    /// Runs the forward over `plan`'s rows, publishes the KV blocks it filled, and hands each
    /// row's logits on: decode rows are sampled, drafts verified, prompt rows prefilled. Then
    /// beams expand and finished sequences leave.
    fn execute(&mut self, plan: StepPlan) {
        let mut inputs = plan.inputs(&mut self.groups);
        let n_tokens: usize = inputs.iter().map(|i| i.tokens.len()).sum();
        let rows = &plan.rows;
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
                    rows,
                    &format!("model returned {} outputs for {} rows", l.len(), rows.len()),
                );
                return;
            }
            Ok(Err(e)) => {
                self.fail_rows(rows, &format!("model error: {e}"));
                return;
            }
            Err(_) => {
                self.fail_rows(rows, "model panicked");
                return;
            }
        };
        for row in rows {
            if let Some(kv) = row.kv_mut(&mut self.groups) {
                self.kv.publish(kv);
            }
        }

        // Masks that came back during the forward pass serve this step's rows.
        self.take_masks(false);
        let mut decode_rows = Vec::new();
        for (row, out) in rows.iter().zip(logits) {
            match *row {
                Row::Choice {
                    group,
                    seq,
                    feed: ChoiceFeed::Next | ChoiceFeed::Replay { ends: true },
                } => decode_rows.push((group, seq, out)),
                Row::Choice {
                    group,
                    seq,
                    feed: ChoiceFeed::Drafts,
                } => speculative::verify(
                    &mut self.groups[group],
                    seq,
                    &out,
                    &mut self.scratch[0],
                    &self.output,
                    &self.stats,
                ),
                Row::Prompt {
                    group, start, end, ..
                } => self.prefill_row(group, start, end, &out),
                Row::Choice {
                    feed: ChoiceFeed::Replay { ends: false },
                    ..
                } => {}
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
                seqs.retain(|s| !s.finished());
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
            hit[r.group()] = true;
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
        let output = &self.output;
        let sample = |jobs: &mut [SampleJob<'_>], scratch: &mut SampleScratch| {
            jobs.iter_mut()
                .map(|j| {
                    let emitted = j.seq.take_token(j.req, j.procs, &j.row, scratch, output);
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
        let Some((seq, req, procs)) = self.groups[gi].live_choice(si) else {
            return;
        };
        if seq.keeps_row() {
            seq.waiting_row = Some(row.into_owned());
            return;
        }
        let emitted = seq.take_token(req, procs, &row, &mut self.scratch[0], &self.output);
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
        if !seq.finished() {
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
                if let Some(g) = self.waiting.find_mut(key.group) {
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
            let added = g.add_prompt_logprobs(start, out);
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
        let Some(row) = last_row(out) else {
            g.fail("model returned an empty logits row");
            g.dropped = true;
            return;
        };
        let n = g.req.n;
        let Phase::Prefill {
            cache: prompt_cache,
            ..
        } = std::mem::replace(&mut g.phase, Phase::Decode { seqs: Vec::new() })
        else {
            return;
        };
        if g.beams.is_some() {
            // One root beam holding the prompt; the step's expansion forks it.
            let mut root = Seq::new(0, prompt_cache, Rng::new(0), &g.req);
            root.waiting_row = Some(row.to_vec());
            root.beam = Some(BeamPath::default());
            g.phase = Phase::Decode { seqs: vec![root] };
            return;
        }
        // The prompt is in the cache: fork it into the n choices.
        // n - 1 copies plus the original: n == 1 costs no copy.
        let mut caches: Vec<SeqKv> = (1..n).map(|_| prompt_cache.clone()).collect();
        caches.push(prompt_cache);
        let mut seqs = Vec::with_capacity(n);
        for (choice, cache) in caches.into_iter().enumerate() {
            let seed = match g.req.sampling.seed {
                // vLLM's rule: choice i draws from seed + i.
                Some(s) => s.wrapping_add(choice as u64),
                None => random_seed(),
            };
            seqs.push(Seq::new(choice, cache, Rng::new(seed), &g.req));
        }
        debug!(request_id = %g.req.request_id, prompt_tokens = end, "prefilled");
        g.phase = Phase::Decode { seqs };
        for si in 0..n {
            self.sample_seq(gi, si, Cow::Borrowed(row));
        }
    }

    /// A beam-search step for group `gi`, whose live beams all hold their row
    /// (`Group::expand_beams`); when the search ends, its results are sent.
    fn expand_beams(&mut self, gi: usize) {
        let g = &mut self.groups[gi];
        let Some(events) = g.expand_beams(&self.output) else {
            return;
        };
        debug!(request_id = %g.req.request_id, "beam search finished");
        for ev in events {
            g.send(ev);
        }
        // No live beam left: the group leaves after this step.
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

/// Logs a scheduler thread that could not be started; `submit` then reports `Stopped`.
pub(crate) fn spawn_failed(e: &std::io::Error) {
    warn!("could not start the engine scheduler thread: {e}");
}
