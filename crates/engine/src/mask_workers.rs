//! Structured-output masks computed off the scheduler thread. The mask for a choice's next
//! token depends only on the tokens it has sampled so far, so the scheduler hands the choice's
//! matcher to a worker right after sampling and runs the next forward pass meanwhile; the
//! matcher and its mask come back on a channel. A job whose request is gone by the time a
//! worker takes it is skipped: a client that disconnects stops its queued masks at once (one
//! already running ends within llguidance's per-token fuel limit).

use std::sync::atomic::Ordering;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use tokio::sync::mpsc::UnboundedSender;
use tracing::warn;

use crate::stats::Stats;
use crate::structured::{GrammarError, GrammarMatcher, TokenMask};
use crate::GenerationEvent;

/// Which choice a job belongs to: the scheduler's group id and the choice index.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct MaskKey {
    pub(crate) group: u64,
    pub(crate) choice: usize,
}

pub(crate) struct MaskDone {
    pub(crate) key: MaskKey,
    pub(crate) outcome: MaskOutcome,
}

pub(crate) enum MaskOutcome {
    /// The matcher back, with the mask of the choice's next token.
    Ready(Box<GrammarMatcher>, TokenMask),
    Failed(GrammarError),
    /// Not computed: the request's client had gone away.
    Abandoned,
}

struct MaskJob {
    key: MaskKey,
    matcher: GrammarMatcher,
    /// The request's event channel: closed once its client has gone away.
    client: UnboundedSender<GenerationEvent>,
}

/// Lets a test hold every mask computation back (see `Engine::hold_masks`): workers wait at
/// the gate before each job while any hold is alive.
#[derive(Clone, Default)]
pub(crate) struct MaskGate(Arc<GateState>);

#[derive(Default)]
struct GateState {
    holds: Mutex<usize>,
    released: Condvar,
}

/// While alive, no structured-output mask is computed.
#[must_use = "masks are held only while this lives"]
pub struct MaskHold(MaskGate);

impl MaskGate {
    pub(crate) fn hold(&self) -> MaskHold {
        *self.holds() += 1;
        MaskHold(self.clone())
    }

    fn holds(&self) -> std::sync::MutexGuard<'_, usize> {
        self.0.holds.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn wait_open(&self) {
        let mut holds = self.holds();
        while *holds > 0 {
            holds = self
                .0
                .released
                .wait(holds)
                .unwrap_or_else(|e| e.into_inner());
        }
    }
}

impl Drop for MaskHold {
    fn drop(&mut self) {
        *self.0.holds() -= 1;
        self.0 .0.released.notify_all();
    }
}

pub(crate) struct MaskWorkers {
    jobs: Option<Sender<MaskJob>>,
    done: Receiver<MaskDone>,
    done_tx: Sender<MaskDone>,
    gate: MaskGate,
    stats: Arc<Stats>,
    /// Jobs sent and not yet received back.
    in_flight: usize,
}

impl MaskWorkers {
    /// Starts `threads` workers; they exit when this is dropped.
    pub(crate) fn start(threads: usize, gate: MaskGate, stats: Arc<Stats>) -> Self {
        let (jobs_tx, jobs_rx) = channel::<MaskJob>();
        let (done_tx, done) = channel();
        let jobs_rx = Arc::new(Mutex::new(jobs_rx));
        let mut started = 0;
        for i in 0..threads.max(1) {
            let jobs = jobs_rx.clone();
            let done = done_tx.clone();
            let gate = gate.clone();
            let stats = stats.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("temper-mask-{i}"))
                .spawn(move || work(&jobs, &done, &gate, &stats));
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
            gate,
            stats,
            in_flight: 0,
        }
    }

    pub(crate) fn submit(
        &mut self,
        key: MaskKey,
        matcher: GrammarMatcher,
        client: UnboundedSender<GenerationEvent>,
    ) {
        self.in_flight += 1;
        let job = MaskJob {
            key,
            matcher,
            client,
        };
        let unsent = match &self.jobs {
            Some(tx) => tx.send(job).err().map(|e| e.0),
            None => Some(job),
        };
        if let Some(job) = unsent {
            let _ = self.done_tx.send(run(job, &self.gate, &self.stats));
        }
    }

    /// A finished job, if any; with `wait`, blocks until one finishes (or a while passes, so
    /// the caller can look at new requests).
    pub(crate) fn next_done(&mut self, wait: bool) -> Option<MaskDone> {
        let got = if wait && self.in_flight > 0 {
            self.done.recv_timeout(Duration::from_millis(50)).ok()
        } else {
            self.done.try_recv().ok()
        };
        if got.is_some() {
            self.in_flight -= 1;
        }
        got
    }
}

fn run(job: MaskJob, gate: &MaskGate, stats: &Stats) -> MaskDone {
    let MaskJob {
        key,
        mut matcher,
        client,
    } = job;
    gate.wait_open();
    if client.is_closed() {
        stats.masks_abandoned.fetch_add(1, Ordering::Relaxed);
        return MaskDone {
            key,
            outcome: MaskOutcome::Abandoned,
        };
    }
    stats.masks.fetch_add(1, Ordering::Relaxed);
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        matcher.compute_mask().map(|mask| (matcher, mask))
    }));
    let outcome = match outcome {
        Ok(Ok((matcher, mask))) => MaskOutcome::Ready(Box::new(matcher), mask),
        Ok(Err(e)) => MaskOutcome::Failed(e),
        Err(_) => MaskOutcome::Failed(GrammarError::Matcher("mask computation panicked".into())),
    };
    MaskDone { key, outcome }
}

fn work(jobs: &Mutex<Receiver<MaskJob>>, done: &Sender<MaskDone>, gate: &MaskGate, stats: &Stats) {
    loop {
        // The lock is held only while waiting for a job, never while computing one.
        let job = match jobs.lock() {
            Ok(rx) => rx.recv(),
            Err(_) => return,
        };
        let Ok(job) = job else { return };
        if done.send(run(job, gate, stats)).is_err() {
            return;
        }
    }
}
