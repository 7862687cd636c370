//! Per-request latency and token counts of one engine, the figures vLLM's Prometheus metrics
//! expose (`vllm:time_to_first_token_seconds`, `vllm:e2e_request_latency_seconds`,
//! `vllm:prompt_tokens_total`, `vllm:generation_tokens_total`). Times run from the request's
//! submission to the engine (after its prompt is tokenized) to its first token and to its last
//! choice's end.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use crate::{FinishReason, GenerationEvent};

/// vLLM's bucket bounds for time to first token, in seconds.
const TTFT_BOUNDS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
/// vLLM's bucket bounds for end-to-end request latency, in seconds.
const E2E_BOUNDS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];

/// A Prometheus histogram: a count per bucket (not cumulative) and the sum in microseconds.
struct Histogram {
    bounds: &'static [f64],
    /// One per bound, then the `+Inf` bucket.
    counts: Vec<AtomicU64>,
    sum_micros: AtomicU64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Histogram {
            bounds,
            counts: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            sum_micros: AtomicU64::new(0),
        }
    }

    fn observe(&self, seconds: f64) {
        let bucket = self.bounds.partition_point(|&b| b < seconds);
        self.counts[bucket].fetch_add(1, Ordering::Relaxed);
        self.sum_micros
            .fetch_add((seconds * 1e6) as u64, Ordering::Relaxed);
    }

    fn snapshot(&self) -> HistogramSnapshot {
        let mut total = 0;
        let cumulative = self
            .counts
            .iter()
            .map(|c| {
                total += c.load(Ordering::Relaxed);
                total
            })
            .collect();
        HistogramSnapshot {
            bounds: self.bounds,
            cumulative,
            sum_seconds: self.sum_micros.load(Ordering::Relaxed) as f64 * 1e-6,
        }
    }
}

/// A histogram as Prometheus exposes it.
#[derive(Clone, Debug, PartialEq)]
pub struct HistogramSnapshot {
    /// Upper bounds of the finite buckets, in seconds.
    pub bounds: &'static [f64],
    /// Observations at or below each bound, then the total (the `+Inf` bucket).
    pub cumulative: Vec<u64>,
    pub sum_seconds: f64,
}

impl HistogramSnapshot {
    pub fn count(&self) -> u64 {
        self.cumulative.last().copied().unwrap_or(0)
    }
}

/// Finished requests and their figures since the engine started.
#[derive(Clone, Debug, PartialEq)]
pub struct RequestMetrics {
    pub time_to_first_token: HistogramSnapshot,
    pub e2e_latency: HistogramSnapshot,
    /// Prompt tokens of finished requests (once per request, whatever its `n`).
    pub prompt_tokens: u64,
    /// Tokens generated, all choices (of finished and unfinished requests).
    pub generation_tokens: u64,
    /// Finished choices by reason: `stop`, `length`, `repetition`, `abort` (vLLM's
    /// `finished_reason`).
    pub finished: Vec<(&'static str, u64)>,
}

const REASONS: [&str; 4] = ["stop", "length", "repetition", "abort"];

fn reason_index(reason: FinishReason) -> usize {
    match reason {
        FinishReason::Stop => 0,
        FinishReason::Length => 1,
        FinishReason::Repetition => 2,
        FinishReason::Abort => 3,
    }
}

/// The engine's counters behind [`RequestMetrics`].
pub(crate) struct RequestCounters {
    ttft: Histogram,
    e2e: Histogram,
    prompt_tokens: AtomicU64,
    generation_tokens: AtomicU64,
    finished: [AtomicU64; 4],
}

impl Default for RequestCounters {
    fn default() -> Self {
        RequestCounters {
            ttft: Histogram::new(TTFT_BOUNDS),
            e2e: Histogram::new(E2E_BOUNDS),
            prompt_tokens: AtomicU64::new(0),
            generation_tokens: AtomicU64::new(0),
            finished: Default::default(),
        }
    }
}

impl RequestCounters {
    pub(crate) fn snapshot(&self) -> RequestMetrics {
        RequestMetrics {
            time_to_first_token: self.ttft.snapshot(),
            e2e_latency: self.e2e.snapshot(),
            prompt_tokens: self.prompt_tokens.load(Ordering::Relaxed),
            generation_tokens: self.generation_tokens.load(Ordering::Relaxed),
            finished: REASONS
                .iter()
                .zip(&self.finished)
                .map(|(&r, c)| (r, c.load(Ordering::Relaxed)))
                .collect(),
        }
    }
}

/// One request's clock: observes its events as the scheduler sends them.
pub(crate) struct RequestTimer {
    counters: Arc<RequestCounters>,
    submitted: Instant,
    first_token_seen: bool,
    /// Choices not finished yet.
    open_choices: usize,
}

impl RequestTimer {
    pub(crate) fn new(counters: Arc<RequestCounters>, submitted: Instant, choices: usize) -> Self {
        RequestTimer {
            counters,
            submitted,
            first_token_seen: false,
            open_choices: choices,
        }
    }

    pub(crate) fn observe(&mut self, event: &GenerationEvent) {
        let c = &self.counters;
        match event {
            GenerationEvent::Token { .. } => {
                c.generation_tokens.fetch_add(1, Ordering::Relaxed);
                if !self.first_token_seen {
                    self.first_token_seen = true;
                    c.ttft.observe(self.submitted.elapsed().as_secs_f64());
                }
            }
            GenerationEvent::Finished {
                reason,
                prompt_tokens,
                ..
            } => {
                c.finished[reason_index(*reason)].fetch_add(1, Ordering::Relaxed);
                self.open_choices = self.open_choices.saturating_sub(1);
                if self.open_choices == 0 {
                    c.prompt_tokens
                        .fetch_add(*prompt_tokens as u64, Ordering::Relaxed);
                    c.e2e.observe(self.submitted.elapsed().as_secs_f64());
                }
            }
            GenerationEvent::Error { .. } | GenerationEvent::PromptLogprobs { .. } => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative_with_bounds_inclusive() {
        let h = Histogram::new(&[0.1, 1.0]);
        for s in [0.05, 0.1, 0.5, 3.0] {
            h.observe(s);
        }
        let snap = h.snapshot();
        assert_eq!(snap.cumulative, vec![2, 3, 4]);
        assert_eq!(snap.count(), 4);
        assert!((snap.sum_seconds - 3.65).abs() < 1e-6);
    }
}
