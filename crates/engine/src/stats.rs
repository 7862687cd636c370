//! The scheduler's counters, shared with the mask workers and `Engine::stats` callers.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use crate::metrics::RequestCounters;
use crate::EngineStats;

/// Counters shared with `Engine::stats` callers.
#[derive(Default)]
pub(crate) struct Stats {
    pub(crate) steps: AtomicU64,
    pub(crate) rows: AtomicU64,
    pub(crate) tokens: AtomicU64,
    pub(crate) max_rows_in_step: AtomicUsize,
    pub(crate) running: AtomicUsize,
    pub(crate) running_requests: AtomicUsize,
    pub(crate) waiting: AtomicUsize,
    /// New requests submitted and not yet admitted (nor cancelled): what `max_waiting` bounds.
    queued: AtomicUsize,
    pub(crate) preemptions: AtomicU64,
    /// Counted by the mask workers.
    pub(crate) masks: AtomicU64,
    pub(crate) masks_abandoned: AtomicU64,
    pub(crate) prompt_logprobs: AtomicU64,
    pub(crate) drafted_tokens: AtomicU64,
    pub(crate) accepted_tokens: AtomicU64,
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
