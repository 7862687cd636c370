//! Usage metering: every chat completion's tokens are added to its team's counters per
//! project, model and UTC hour in the store, written in batches (trained tokens are counted by
//! the store itself, as the worker appends each `gradient_step`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use temper_store::{usage_bucket, Store, TokenCounts, UsageKey};

use crate::protocol::Usage;

/// The project of a request without an `OpenAI-Project` header.
pub const DEFAULT_PROJECT: &str = "default";

/// Usage waiting to be written, merged per row. One task writes at a time, taking everything
/// added meanwhile, so a burst of requests costs one transaction (a group commit) and no
/// request waits for the store.
pub struct UsageMeter {
    store: Store,
    pending: Mutex<Pending>,
    /// Held while a batch is written, so that [`UsageMeter::flush`] also waits for a write
    /// already under way.
    writing: tokio::sync::Mutex<()>,
}

#[derive(Default)]
struct Pending {
    counts: HashMap<UsageKey, TokenCounts>,
    /// A write task has been started and has not yet taken `counts`.
    scheduled: bool,
}

impl UsageMeter {
    pub fn new(store: Store) -> Arc<UsageMeter> {
        Arc::new(UsageMeter {
            store,
            pending: Mutex::new(Pending::default()),
            writing: tokio::sync::Mutex::new(()),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Pending> {
        // Every update leaves the map consistent, so a panic elsewhere cannot corrupt it.
        self.pending.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Adds `counts` to `key`'s row soon (see [`UsageMeter::flush`]).
    pub fn add(self: &Arc<Self>, key: UsageKey, counts: TokenCounts) {
        let mut pending = self.lock();
        *pending.counts.entry(key).or_default() += counts;
        if pending.scheduled {
            return;
        }
        // Outside a runtime (never while serving) the next flush writes it.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            pending.scheduled = true;
            let meter = self.clone();
            runtime.spawn(async move {
                if let Err(e) = meter.flush().await {
                    tracing::error!(error = %e, "writing usage; kept for the next write");
                }
            });
        }
    }

    /// Writes everything added so far, after any write under way. Counts a failed write could
    /// not store stay pending for the next one.
    pub async fn flush(&self) -> Result<(), temper_store::Error> {
        let _writing = self.writing.lock().await;
        let batch: Vec<(UsageKey, TokenCounts)> = {
            let mut pending = self.lock();
            pending.scheduled = false;
            pending.counts.drain().collect()
        };
        if batch.is_empty() {
            return Ok(());
        }
        self.store.add_usage(&batch).await.inspect_err(|_| {
            let mut pending = self.lock();
            for (key, counts) in batch {
                *pending.counts.entry(key).or_default() += counts;
            }
        })
    }
}

/// Where a chat completion's usage goes.
pub struct UsageSink {
    pub meter: Arc<UsageMeter>,
    pub team: String,
    pub project: String,
    /// The served name (see [`temper_store::UsageKey::model`]).
    pub model: String,
}

/// One chat completion's (or completion's) token counts as its output arrives. What it holds
/// when it is recorded, at the request's end or when dropped before (the client went away, the
/// engine failed), is added to the team's usage, once: what was actually generated.
pub struct ChatUsage {
    prompt_tokens: usize,
    /// Per prompt (a completion request may have several).
    cached_tokens: Vec<usize>,
    /// Per choice, the prompts' choices in turn.
    completion_tokens: Vec<usize>,
    /// Choices per prompt.
    n: usize,
    /// `None`: not recorded (no store), or recorded already.
    sink: Option<UsageSink>,
}

impl ChatUsage {
    /// A request for `n` choices over `prompt_tokens`, recorded to `sink`.
    pub fn new(prompt_tokens: usize, n: usize, sink: Option<UsageSink>) -> ChatUsage {
        ChatUsage::prompts(&[prompt_tokens], n, sink)
    }

    /// A request of several prompts (their token counts), `n` choices each: choice `i` is
    /// choice `i % n` of prompt `i / n`.
    pub fn prompts(prompt_tokens: &[usize], n: usize, sink: Option<UsageSink>) -> ChatUsage {
        ChatUsage {
            prompt_tokens: prompt_tokens.iter().sum(),
            cached_tokens: vec![0; prompt_tokens.len()],
            completion_tokens: vec![0; prompt_tokens.len() * n],
            n: n.max(1),
            sink,
        }
    }

    /// One more generated token of `choice`; false for a choice the request does not have.
    pub fn token(&mut self, choice: usize) -> bool {
        match self.completion_tokens.get_mut(choice) {
            Some(count) => {
                *count += 1;
                true
            }
            None => false,
        }
    }

    /// The engine's own counts at a choice's end; `cached_tokens` are its prompt's.
    pub fn finished(&mut self, choice: usize, completion_tokens: usize, cached_tokens: usize) {
        if let Some(cached) = self.cached_tokens.get_mut(choice / self.n) {
            *cached = cached_tokens;
        }
        if let Some(count) = self.completion_tokens.get_mut(choice) {
            *count = completion_tokens;
        }
    }

    /// As the response reports it.
    pub fn usage(&self) -> Usage {
        Usage::new(
            self.prompt_tokens,
            self.cached_tokens.iter().sum(),
            self.completion_tokens.iter().sum(),
        )
    }

    /// Adds the counts so far to the team's usage; later calls do nothing.
    pub fn record(&mut self) {
        let Some(sink) = self.sink.take() else {
            return;
        };
        let usage = self.usage();
        let key = UsageKey {
            team: sink.team,
            project: sink.project,
            model: sink.model,
            bucket_start: usage_bucket(unix_now() as i64),
        };
        let counts = TokenCounts {
            input_tokens: usage.prompt_tokens as u64,
            cached_input_tokens: usage.prompt_tokens_details.cached_tokens as u64,
            output_tokens: usage.completion_tokens as u64,
            num_model_requests: 1,
            ..TokenCounts::default()
        };
        sink.meter.add(key, counts);
    }
}

impl Drop for ChatUsage {
    fn drop(&mut self) {
        self.record();
    }
}

/// Seconds since the Unix epoch (usage buckets, responses' `created`).
pub fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}
