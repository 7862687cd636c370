//! The waiting queue: requests on their way to the scheduler, and those waiting for admission
//! in rank order (arrival, or priority then arrival).

use std::collections::VecDeque;

use tokio::sync::mpsc::UnboundedSender;
use tracing::debug;

use crate::logits::Processors;
use crate::stats::Stats;
use crate::{GenerationEvent, GenerationRequest};

use super::sequence::Group;

/// A request on its way to the scheduler.
pub(crate) struct Submission {
    pub(crate) req: GenerationRequest,
    pub(crate) procs: Processors,
    pub(crate) tx: UnboundedSender<GenerationEvent>,
    pub(crate) submitted: std::time::Instant,
}

/// Requests waiting for admission, new or preempted, sorted by `Group::rank`.
#[derive(Default)]
pub(super) struct WaitingQueue {
    groups: VecDeque<Group>,
    /// Arrivals so far: the tie-breaker of `Group::rank`.
    arrivals: u64,
}

impl WaitingQueue {
    /// Numbers a new arrival (its id and its place among equal priorities).
    pub(super) fn arrive(&mut self) -> u64 {
        self.arrivals += 1;
        self.arrivals
    }

    /// Queues `g` behind every request ranked before it.
    pub(super) fn push(&mut self, g: Group) {
        let at = self.groups.partition_point(|w| w.rank < g.rank);
        self.groups.insert(at, g);
    }

    pub(super) fn front(&self) -> Option<&Group> {
        self.groups.front()
    }

    /// The head of the queue, out of the bounded count (`Stats::queued`) if it was in it.
    pub(super) fn pop(&mut self, stats: &Stats) -> Option<Group> {
        let mut g = self.groups.pop_front()?;
        if std::mem::take(&mut g.queued) {
            stats.leave_queue();
        }
        Some(g)
    }

    /// The waiting request `id`.
    pub(super) fn find_mut(&mut self, id: u64) -> Option<&mut Group> {
        self.groups.iter_mut().find(|g| g.id == id)
    }

    /// Removes requests whose receiver is gone.
    pub(super) fn drop_cancelled(&mut self, stats: &Stats) {
        self.groups.retain(|g| {
            let closed = g.dropped || g.tx.is_closed();
            if closed {
                debug!(request_id = %g.req.request_id, "cancelled while waiting");
                if g.queued {
                    stats.leave_queue();
                }
            }
            !closed
        });
    }

    pub(super) fn len(&self) -> usize {
        self.groups.len()
    }

    pub(super) fn is_empty(&self) -> bool {
        self.groups.is_empty()
    }
}
