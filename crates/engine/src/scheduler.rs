//! The scheduler thread: continuous batching over one `Gemma3::forward` call per step.
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
use crate::mask_workers::{MaskDone, MaskGate, MaskKey, MaskOutcome, MaskWorkers};
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
}

/// Counters shared with `Engine::stats` callers.
#[derive(Default)]
pub(crate) struct Stats {
    steps: AtomicU64,
    rows: AtomicU64,
    tokens: AtomicU64,
    max_rows_in_step: AtomicUsize,
    running: AtomicUsize,
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

/// One choice being generated.
struct Seq {
    choice: usize,
    cache: SeqCache,
    /// The last sampled token: the input of this sequence's next decode row.
    next: u32,
    rng: Rng,
    decode: DecodeStream,
    matcher: StopMatcher,
    generated: usize,
    history: History,
    finished: bool,
    /// Structured output: where this choice is in its grammar.
    grammar: Option<SeqGrammar>,
    /// This step's logits, kept until the mask they need comes back from a worker (the choice
    /// sits out of the batch meanwhile; nobody else waits).
    waiting_row: Option<Vec<f32>>,
    /// After a preemption: the tokens this step feeds to rebuild the cache.
    replay: Vec<u32>,
    /// When this step speculates: its input, `next` then the draft tokens; empty otherwise.
    spec: Vec<u32>,
    /// Beam search: this beam's score so far.
    beam: Option<BeamPath>,
}

impl Seq {
    /// A choice with nothing generated yet, continuing what `cache` holds.
    fn new(
        choice: usize,
        cache: SeqCache,
        rng: Rng,
        opts: DecodeOptions,
        req: &GenerationRequest,
    ) -> Self {
        Seq {
            choice,
            cache,
            next: 0,
            rng,
            decode: DecodeStream::new(opts),
            matcher: StopMatcher::new(&req.stopping.stop, req.stopping.include_stop_str_in_output),
            generated: 0,
            history: History::default(),
            finished: false,
            // Every choice starts from the compiled grammar's first mask.
            grammar: req.constraint.as_ref().map(|gr| SeqGrammar {
                matcher: Some(gr.matcher()),
                mask: Some(gr.first_mask().clone()),
            }),
            waiting_row: None,
            replay: Vec::new(),
            spec: Vec::new(),
            beam: None,
        }
    }

    /// Prompt + output tokens the cache must hold before `next` is fed: the cache is behind
    /// this only after a preemption.
    fn replay_len(&self, prompt: &[u32]) -> usize {
        prompt.len() + self.history.output.len() - 1
    }
}

/// Where a live beam stands.
#[derive(Clone, Copy, Default)]
struct BeamPath {
    /// Sum of the raw logprobs of its tokens.
    cum_logprob: f64,
    /// Its newest entry in `BeamState::trail` (when logprobs are asked for).
    trail: Option<usize>,
}

/// A beam-search request's results so far.
#[derive(Default)]
struct BeamState {
    /// Hypotheses ended by an end token, best first, at most n (no other can make the result).
    finished: Vec<Hypothesis>,
    /// Token logprobs of every beam kept so far: each entry links to its parent beam's newest,
    /// so beams share their common prefix.
    trail: Vec<(Option<usize>, TokenLogprob)>,
}

/// A candidate result of beam search.
struct Hypothesis {
    /// Output tokens; an end token only with `include_stop_str_in_output`.
    tokens: Vec<u32>,
    score: f64,
    /// `Some(token)`: ended by this end token; `None`: still live when the search stopped.
    ended_by: Option<u32>,
    trail: Option<usize>,
}

impl BeamState {
    /// Keeps the n best finished hypotheses; among equal scores the earlier one ranks first.
    fn finish(&mut self, h: Hypothesis, n: usize) {
        let at = self.finished.partition_point(|f| f.score >= h.score);
        if at < n {
            self.finished.insert(at, h);
            self.finished.truncate(n);
        }
    }

    /// The logprobs along a trail, oldest first.
    fn logprobs(&self, mut at: Option<usize>) -> Vec<TokenLogprob> {
        let mut out = Vec::new();
        while let Some(i) = at {
            let (parent, lp) = &self.trail[i];
            out.push(lp.clone());
            at = *parent;
        }
        out.reverse();
        out
    }
}

/// vLLM's beam score: `len` counts the prompt and the output without a final end token.
fn beam_score(cum_logprob: f64, len: usize, length_penalty: f32) -> f64 {
    cum_logprob / (len as f64).powf(length_penalty as f64)
}

/// A choice's grammar state: the matcher and the mask of its next token. Both are `None` while
/// a worker computes that mask.
struct SeqGrammar {
    matcher: Option<GrammarMatcher>,
    mask: Option<TokenMask>,
}

enum Phase {
    /// The prompt is being fed; `done` tokens are in the cache.
    Prefill {
        cache: SeqCache,
        done: usize,
    },
    Decode {
        seqs: Vec<Seq>,
    },
}

/// A request, waiting or admitted.
struct Group {
    /// Stable while the group lives (indices shift as groups finish): mask results find their
    /// choice by it.
    id: u64,
    req: GenerationRequest,
    procs: Processors,
    tx: UnboundedSender<GenerationEvent>,
    phase: Phase,
    /// The client went away, or its events can no longer be delivered.
    dropped: bool,
    /// Queue position key: lower runs first.
    rank: (i64, u64),
    /// Prompt logprobs computed so far (positions 1..=len): kept through a preemption, so a
    /// replayed prefill does not compute them again.
    prompt_logprobs: Vec<PromptLogprob>,
    /// Beam search: finished hypotheses and logprobs; `None` when sampling.
    beams: Option<BeamState>,
    /// What this request's KV blocks are shared under (its adapter and `cache_salt`).
    prefix_key: PrefixKey,
    /// Prompt tokens found in the prefix cache at the first admission (`None` before it).
    cached_tokens: Option<usize>,
    /// Counted in `Stats::queued`: submitted, never admitted yet.
    queued: bool,
}

impl Group {
    /// Sequences this request occupies (its reservation while prefilling).
    fn running(&self) -> usize {
        match &self.phase {
            Phase::Prefill { .. } => self.req.n,
            Phase::Decode { seqs } => seqs.len(),
        }
    }

    /// The first prompt position whose logprobs are still to compute; `None` when none are.
    fn prompt_logprobs_from(&self) -> Option<usize> {
        let from = self.prompt_logprobs.len();
        (self.req.prompt_logprobs.is_some() && from + 1 < self.req.prompt.len()).then_some(from)
    }

    /// Sends `ev`; a `Finished` gets the request's prefix-cache hit.
    fn send(&mut self, mut ev: GenerationEvent) {
        if let GenerationEvent::Finished { cached_tokens, .. } = &mut ev {
            *cached_tokens = self.cached_tokens.unwrap_or(0);
        }
        if self.tx.send(ev).is_err() {
            self.dropped = true;
        }
    }

    /// Frees every cache; what was generated stays, to be replayed on readmission (its full
    /// blocks stay published, so the replay mostly finds them again).
    fn preempt(&mut self, model: &Gemma3) {
        match &mut self.phase {
            Phase::Prefill { cache, done } => {
                *cache = model.new_shared_cache(self.prefix_key);
                *done = 0;
            }
            Phase::Decode { seqs } => {
                for s in seqs {
                    s.cache = model.new_shared_cache(self.prefix_key);
                    // The replay computes this row again.
                    s.waiting_row = None;
                    s.spec.clear();
                }
            }
        }
    }

    /// On admission: takes the published blocks that hold a prefix of what each empty cache
    /// must compute (the prompt; after a preemption, prompt and output). Prompt logprobs need
    /// every prompt row computed, so such a request takes none.
    fn reuse_prefixes(&mut self) {
        if self.req.prompt_logprobs.is_some() {
            self.cached_tokens.get_or_insert(0);
            return;
        }
        match &mut self.phase {
            Phase::Prefill { cache, done } => {
                if *done == 0 {
                    *done = cache.reuse_prefix(&self.req.prompt);
                }
                self.cached_tokens.get_or_insert(*done);
            }
            Phase::Decode { seqs } => {
                let mut tokens = Vec::new();
                for s in seqs.iter_mut().filter(|s| s.cache.is_empty()) {
                    tokens.clear();
                    tokens.extend_from_slice(&self.req.prompt);
                    tokens.extend_from_slice(&s.history.output);
                    s.cache.reuse_prefix(&tokens);
                }
            }
        }
    }

    /// KV blocks this request may need to get going: its prompt's (what the prefix cache
    /// holds is not known before admission) and one per choice.
    fn blocks_to_start(&self) -> usize {
        let len = self.req.prompt.len()
            + match &self.phase {
                Phase::Prefill { .. } => 0,
                Phase::Decode { seqs } => seqs
                    .iter()
                    .map(|s| s.history.output.len())
                    .max()
                    .unwrap_or(0),
            };
        len.div_ceil(temper_model::BLOCK_TOKENS) + self.req.n
    }

    fn fail(&mut self, message: &str) {
        error!(request_id = %self.req.request_id, "generation failed: {message}");
        self.send(GenerationEvent::Error {
            message: message.to_string(),
        });
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
    sampler: Sampler,
    /// Reused buffer for the processed logits row.
    processed: Vec<f32>,
    masks: MaskWorkers,
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
            sampler: Sampler::default(),
            processed: Vec::new(),
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
        self.arrivals += 1;
        let beams = s.req.beam_search.map(|_| BeamState::default());
        let prefix_key = PrefixKey::new(
            s.req.adapter.as_ref().map(|a| a.id()),
            s.req.cache_salt.as_deref(),
        );
        self.requeue(Group {
            id: self.arrivals,
            phase: Phase::Prefill {
                cache: self.model.new_shared_cache(prefix_key),
                done: 0,
            },
            prefix_key,
            cached_tokens: None,
            queued: true,
            req: s.req,
            procs: s.procs,
            tx: s.tx,
            dropped: false,
            rank: (priority, self.arrivals),
            prompt_logprobs: Vec::new(),
            beams,
        });
    }

    fn requeue(&mut self, g: Group) {
        let at = self.waiting.partition_point(|w| w.rank < g.rank);
        self.waiting.insert(at, g);
    }

    fn publish_counts(&self) {
        let running = self.groups.iter().map(Group::running).sum();
        self.stats.running.store(running, Ordering::Relaxed);
        self.stats
            .waiting
            .store(self.waiting.len(), Ordering::Relaxed);
    }

    /// Removes requests whose receiver is gone, freeing their caches now.
    fn drop_cancelled(&mut self) {
        let stats = &self.stats;
        self.waiting.retain(|g| {
            let closed = g.dropped || g.tx.is_closed();
            if closed {
                debug!(request_id = %g.req.request_id, "cancelled while waiting");
                if g.queued {
                    stats.leave_queue();
                }
            }
            !closed
        });
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
        let kv = self.model.kv_pool().stats();
        let capacity = kv.capacity_blocks;
        let mut kv_free = kv.available_blocks().saturating_sub(running);
        while let Some(front) = self.waiting.front() {
            let n = front.running();
            let blocks = front.blocks_to_start();
            if blocks > capacity {
                let mut g = self.pop_waiting().expect("the front");
                let block_mb = self.model.kv_pool().block_bytes() as f64 / (1 << 20) as f64;
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
            let Some(mut g) = self.pop_waiting() else {
                break;
            };
            g.reuse_prefixes();
            debug!(request_id = %g.req.request_id, cached_tokens = ?g.cached_tokens, "admitted");
            running += n;
            kv_free = kv_free.saturating_sub(blocks);
            self.groups.push(g);
        }
    }

    /// The head of the queue, out of the bounded count (`Stats::queued`) if it was in it.
    fn pop_waiting(&mut self) -> Option<Group> {
        let mut g = self.waiting.pop_front()?;
        if std::mem::take(&mut g.queued) {
            self.stats.leave_queue();
        }
        Some(g)
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
        g.preempt(&self.model);
        self.requeue(g);
    }

    /// Makes sure the KV pool holds this step's decode rows: while it does not, the
    /// worst-ranked running request goes back to the queue (preemption by recompute); a request
    /// alone that still does not fit fails. Draft tokens get what blocks are left (`fit_drafts`).
    /// Returns the blocks left for prompt chunks.
    fn make_kv_room(&mut self) -> usize {
        loop {
            let needed: usize = self
                .groups
                .iter()
                .map(|g| match &g.phase {
                    Phase::Decode { seqs } => seqs
                        .iter()
                        .filter(|s| s.waiting_row.is_none())
                        .filter(|s| s.cache.len() == s.replay_len(&g.req.prompt))
                        .map(|s| s.cache.blocks_needed(1))
                        .sum(),
                    Phase::Prefill { .. } => 0,
                })
                .sum();
            let stats = self.model.kv_pool().stats();
            let available = stats.available_blocks();
            if needed <= available {
                return self.fit_drafts(available - needed);
            }
            self.relieve_kv(&format!(
                "the KV cache is full: {needed} blocks needed, {available} of {} available; \
                 raise --kv-cache-mb",
                stats.capacity_blocks
            ));
        }
    }

    /// Cuts this step's drafts down to what `spare` KV blocks hold beyond the decode rows' own
    /// (earlier requests first); returns the blocks left.
    fn fit_drafts(&mut self, mut spare: usize) -> usize {
        for g in &mut self.groups {
            let Phase::Decode { seqs } = &mut g.phase else {
                continue;
            };
            for s in seqs.iter_mut().filter(|s| !s.spec.is_empty()) {
                let own = s.cache.blocks_needed(1);
                let fits = s.cache.room_in(own + spare).max(1);
                s.spec.truncate(fits);
                if s.spec.len() == 1 {
                    s.spec.clear();
                }
                spare -= s.cache.blocks_needed(s.spec.len().max(1)) - own;
            }
        }
        spare
    }

    /// Proposes this step's draft tokens (`lookup::propose`) for the decoding choices that may
    /// speculate: not beams, structured outputs or replays; at most one token fewer than the
    /// choice has left to generate; and, over the step, what `max_batch_tokens` leaves beside
    /// one row per decoding choice (earlier requests first).
    fn propose_drafts(&mut self) {
        let k = self.config.prompt_lookup_tokens;
        let decode_rows: usize = self
            .groups
            .iter()
            .map(|g| match &g.phase {
                Phase::Decode { seqs } => seqs.len(),
                Phase::Prefill { .. } => 0,
            })
            .sum();
        let mut budget = self.config.max_batch_tokens.saturating_sub(decode_rows);
        for g in &mut self.groups {
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
                    || s.cache.len() != s.replay_len(&g.req.prompt)
                {
                    continue;
                }
                let left = g.req.stopping.max_tokens.saturating_sub(s.generated);
                let most = k.min(left.saturating_sub(1)).min(budget);
                if most == 0 {
                    continue;
                }
                // The cache holds prompt + output but `next`.
                s.spec.push(s.next);
                lookup::propose(s.cache.tokens(), &mut s.spec, most);
                if s.spec.len() == 1 {
                    s.spec.clear();
                } else {
                    budget -= s.spec.len() - 1;
                }
            }
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
        for (row, out) in rows.iter().zip(logits) {
            match *row {
                Row::Decode { group, seq } => self.decode_row(group, seq, out),
                Row::Draft { group, seq } => self.verify_drafts(group, seq, &out),
                Row::Prefill { group, start, end } => self.prefill_row(group, start, end, &out),
                Row::Replay { .. } => {}
            }
        }
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

    fn decode_row(&mut self, gi: usize, si: usize, out: Logits) {
        let Some(row) = into_last_row(out) else {
            self.groups[gi].fail("model returned an empty logits row");
            self.groups[gi].dropped = true;
            return;
        };
        self.sample_seq(gi, si, Cow::Owned(row));
    }

    /// Samples choice `si` of group `gi` from the rows of its speculative input (`next`, then
    /// the drafts d1..dk): row i gives a token the normal way (`emit_token`); when it equals
    /// d(i+1) and generation goes on, row i+1 gives the next one. Every sampled token is sent;
    /// the cache then forgets the drafts after the last accepted one. The logits, processors'
    /// history and random draws of each token are those of one decode step at its position, so
    /// the output is the one without drafts (see the module's note).
    fn verify_drafts(&mut self, gi: usize, si: usize, out: &Logits) {
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
            match emit_token(
                seq,
                &g.req,
                &g.procs,
                out.row(i),
                &mut self.sampler,
                &mut self.processed,
                &self.tokenizer,
                &self.end_tokens,
            ) {
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
            if seq.finished {
                break;
            }
        }
        // The cache holds every input position; the accepted drafts' stay.
        let keep = seq.cache.len() - (drafted - accepted);
        seq.cache.truncate(keep);
        // Keeps the buffer for the next step.
        seq.spec = input;
        seq.spec.clear();
        trace!(request_id = %g.req.request_id, choice = seq.choice, drafted, accepted, "drafts verified");
        self.stats
            .drafted_tokens
            .fetch_add(drafted as u64, Ordering::Relaxed);
        self.stats
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
        // A beam waits for its siblings' rows, then `expand_beams` takes them all; a
        // constrained choice waits for its mask.
        if seq.beam.is_some() || seq.grammar.as_ref().is_some_and(|gr| gr.mask.is_none()) {
            seq.waiting_row = Some(row.into_owned());
            return;
        }
        let emitted = emit_token(
            seq,
            &g.req,
            &g.procs,
            &row,
            &mut self.sampler,
            &mut self.processed,
            &self.tokenizer,
            &self.end_tokens,
        );
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

impl Scheduler {
    /// One beam-search step for group `gi`, whose live beams all hold their row: each proposes
    /// its 2n most likely tokens; end tokens finish hypotheses, the n best other candidates
    /// become the live beams (ties keep beam, then rank order, as vLLM's stable sort). After
    /// `max_tokens` steps, or with no candidate left, the search ends.
    fn expand_beams(&mut self, gi: usize) {
        let g = &mut self.groups[gi];
        let (Phase::Decode { seqs }, Some(state), Some(search)) =
            (&mut g.phase, &mut g.beams, g.req.beam_search)
        else {
            return;
        };
        let req = &g.req;
        let width = req.n;
        let mut parents = std::mem::take(seqs);
        // Logprobs for the response may want more alternatives than the search needs.
        let k = (2 * width).max(req.logprobs.unwrap_or(0));
        struct Candidate {
            parent: usize,
            token: u32,
            logprob: f32,
            score: f64,
        }
        let mut candidates = Vec::with_capacity(2 * width * parents.len());
        let mut tops = Vec::with_capacity(parents.len());
        for (pi, p) in parents.iter_mut().enumerate() {
            let (Some(row), Some(path)) = (p.waiting_row.take(), p.beam) else {
                tops.push(Vec::new());
                continue;
            };
            let top = sampler::logprobs(&row, 0, k).top;
            let len = req.prompt.len() + p.history.output.len();
            for &(token, logprob) in top.iter().take(2 * width) {
                let cum = path.cum_logprob + logprob as f64;
                if !req.stopping.ignore_eos && self.end_tokens.contains(token) {
                    let trail = push_trail(state, req, path.trail, logprob, &top);
                    let mut tokens = p.history.output.clone();
                    if req.stopping.include_stop_str_in_output {
                        tokens.push(token);
                    }
                    let h = Hypothesis {
                        tokens,
                        score: beam_score(cum, len, search.length_penalty),
                        ended_by: Some(token),
                        trail,
                    };
                    state.finish(h, width);
                } else {
                    candidates.push(Candidate {
                        parent: pi,
                        token,
                        logprob,
                        score: beam_score(cum, len + 1, search.length_penalty),
                    });
                }
            }
            tops.push(top);
        }
        candidates.sort_by(|a, b| b.score.total_cmp(&a.score));
        candidates.truncate(width);

        // A parent's last child takes its cache; the others copy it.
        let mut children_left = vec![0usize; parents.len()];
        for c in &candidates {
            children_left[c.parent] += 1;
        }
        let opts = decode_options(req);
        let mut beams = Vec::with_capacity(candidates.len());
        for (choice, c) in candidates.iter().enumerate() {
            let parent = &mut parents[c.parent];
            children_left[c.parent] -= 1;
            let cache = if children_left[c.parent] == 0 {
                std::mem::replace(&mut parent.cache, self.model.new_cache())
            } else {
                parent.cache.clone()
            };
            let path = parent.beam.unwrap_or_default();
            let trail = push_trail(state, req, path.trail, c.logprob, &tops[c.parent]);
            let mut beam = Seq::new(choice, cache, Rng::new(0), opts, req);
            beam.next = c.token;
            beam.history = parent.history.clone();
            beam.history.push(c.token);
            beam.generated = beam.history.output.len();
            beam.beam = Some(BeamPath {
                cum_logprob: path.cum_logprob + c.logprob as f64,
                trail,
            });
            beams.push(beam);
        }
        drop(parents);
        let done = beams
            .first()
            .is_none_or(|b| b.generated >= req.stopping.max_tokens);
        if !done {
            *seqs = beams;
            return;
        }
        let events = beam_search_results(state, beams, req, search, &self.tokenizer);
        debug!(request_id = %req.request_id, "beam search finished");
        for ev in events {
            g.send(ev);
        }
        // No live beam left: the group leaves after this step.
    }
}

/// The events of a search that ended with `live` beams: the n best hypotheses, finished or
/// live, best first. Finished ones rank first among equal scores (vLLM appends the live ones
/// after them before its stable sort).
fn beam_search_results(
    state: &mut BeamState,
    live: Vec<Seq>,
    req: &GenerationRequest,
    search: BeamSearch,
    tokenizer: &Tokenizer,
) -> Vec<GenerationEvent> {
    let mut results = std::mem::take(&mut state.finished);
    results.extend(live.into_iter().map(|b| {
        let path = b.beam.unwrap_or_default();
        let len = req.prompt.len() + b.history.output.len();
        Hypothesis {
            score: beam_score(path.cum_logprob, len, search.length_penalty),
            tokens: b.history.output,
            ended_by: None,
            trail: path.trail,
        }
    }));
    results.sort_by(|a, b| b.score.total_cmp(&a.score));
    results.truncate(req.n);
    let opts = decode_options(req);
    let mut events = Vec::new();
    for (choice, h) in results.into_iter().enumerate() {
        let logprobs = req.logprobs.map(|_| state.logprobs(h.trail));
        events.extend(hypothesis_events(choice, h, logprobs, req, opts, tokenizer));
    }
    events
}

/// Records a beam's new token logprob (when the request wants logprobs); returns its index.
fn push_trail(
    state: &mut BeamState,
    req: &GenerationRequest,
    parent: Option<usize>,
    logprob: f32,
    top: &[(u32, f32)],
) -> Option<usize> {
    let k = req.logprobs?;
    state.trail.push((
        parent,
        TokenLogprob {
            logprob,
            top: top[..k.min(top.len())].to_vec(),
        },
    ));
    Some(state.trail.len() - 1)
}

/// A beam-search result's events: its tokens with their text (an end token adds none), then
/// Finished. vLLM reports the end token as the stop reason of a hypothesis it ended.
fn hypothesis_events(
    choice: usize,
    h: Hypothesis,
    logprobs: Option<Vec<TokenLogprob>>,
    req: &GenerationRequest,
    opts: DecodeOptions,
    tokenizer: &Tokenizer,
) -> Vec<GenerationEvent> {
    let mut decode = DecodeStream::new(opts);
    let mut logprobs = logprobs.map(Vec::into_iter);
    let mut events = Vec::with_capacity(h.tokens.len() + 1);
    for &token_id in &h.tokens {
        let text = if h.ended_by == Some(token_id) {
            String::new()
        } else {
            decode.step(tokenizer, token_id)
        };
        events.push(GenerationEvent::Token {
            choice,
            token_id,
            text,
            logprob: logprobs.as_mut().and_then(Iterator::next),
        });
    }
    let (reason, stop_reason) = match h.ended_by {
        Some(token) => (FinishReason::Stop, Some(StopReason::Token(token))),
        None => (FinishReason::Length, None),
    };
    events.push(GenerationEvent::Finished {
        choice,
        reason,
        stop_reason,
        text: decode.flush(),
        prompt_tokens: req.prompt.len(),
        // `Group::send` fills it in.
        cached_tokens: 0,
        completion_tokens: h.tokens.len(),
    });
    events
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
    sampler: &mut Sampler,
    processed: &mut Vec<f32>,
    tokenizer: &Tokenizer,
    end_tokens: &EndTokens,
) -> Result<Vec<GenerationEvent>, String> {
    let stopping = &req.stopping;
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
