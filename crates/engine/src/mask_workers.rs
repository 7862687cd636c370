//! Structured-output masks computed off the scheduler thread. The mask for a choice's next
//! token depends only on the tokens it has sampled so far, so the scheduler hands the choice's
//! matcher to a worker right after sampling and runs the next forward pass meanwhile; the
//! matcher and its mask come back on a channel.

use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tracing::warn;

use crate::structured::{GrammarError, GrammarMatcher, TokenMask};

/// Which choice a job belongs to: the scheduler's group id and the choice index.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct MaskKey {
    pub(crate) group: u64,
    pub(crate) choice: usize,
}

pub(crate) struct MaskDone {
    pub(crate) key: MaskKey,
    /// The matcher back, with the mask of the choice's next token.
    pub(crate) result: Result<(GrammarMatcher, TokenMask), GrammarError>,
}

struct MaskJob {
    key: MaskKey,
    matcher: GrammarMatcher,
}

pub(crate) struct MaskWorkers {
    jobs: Option<Sender<MaskJob>>,
    done: Receiver<MaskDone>,
    done_tx: Sender<MaskDone>,
    /// Jobs sent and not yet received back.
    in_flight: usize,
}

impl MaskWorkers {
    /// Starts `threads` workers; they exit when this is dropped.
    pub(crate) fn start(threads: usize) -> Self {
        let (jobs_tx, jobs_rx) = channel::<MaskJob>();
        let (done_tx, done) = channel();
        let jobs_rx = Arc::new(Mutex::new(jobs_rx));
        let mut started = 0;
        for i in 0..threads.max(1) {
            let jobs = jobs_rx.clone();
            let done = done_tx.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("temper-mask-{i}"))
                .spawn(move || work(&jobs, &done));
            match spawned {
                Ok(_) => started += 1,
                Err(e) => warn!("could not start a structured-output mask worker: {e}"),
            }
        }
        MaskWorkers {
            // Without any worker, jobs run on the scheduler thread (see `submit`).
            jobs: (started > 0).then_some(jobs_tx),
            done,
            done_tx,
            in_flight: 0,
        }
    }

    pub(crate) fn submit(&mut self, key: MaskKey, matcher: GrammarMatcher) {
        self.in_flight += 1;
        let job = MaskJob { key, matcher };
        let unsent = match &self.jobs {
            Some(tx) => tx.send(job).err().map(|e| e.0),
            None => Some(job),
        };
        if let Some(job) = unsent {
            let _ = self.done_tx.send(run(job));
        }
    }

    /// A finished job, if any; with `wait`, blocks until one finishes (or a while passes, so
    /// the caller can look at new requests).
    pub(crate) fn next_done(&mut self, wait: bool) -> Option<MaskDone> {
        let got = if wait && self.in_flight > 0 {
            match self.done.recv_timeout(Duration::from_millis(50)) {
                Ok(d) => Some(d),
                Err(RecvTimeoutError::Timeout | RecvTimeoutError::Disconnected) => None,
            }
        } else {
            self.done.try_recv().ok()
        };
        if got.is_some() {
            self.in_flight -= 1;
        }
        got
    }
}

fn run(job: MaskJob) -> MaskDone {
    let MaskJob { key, mut matcher } = job;
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        matcher.compute_mask().map(|mask| (matcher, mask))
    }))
    .unwrap_or_else(|_| Err(GrammarError::Matcher("mask computation panicked".into())));
    MaskDone { key, result }
}

fn work(jobs: &Mutex<Receiver<MaskJob>>, done: &Sender<MaskDone>) {
    loop {
        // The lock is held only while waiting for a job, never while computing one.
        let job = match jobs.lock() {
            Ok(rx) => rx.recv(),
            Err(_) => return,
        };
        let Ok(job) = job else { return };
        if done.send(run(job)).is_err() {
            return;
        }
    }
}
