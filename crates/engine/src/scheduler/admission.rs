//! The waiting queue and admission: requests wait in rank order (arrival, or priority), are
//! admitted while sequences and KV blocks allow, and under priority scheduling preempt worse
//! ones.

use super::*;

impl Scheduler {
    pub(super) fn enqueue(&mut self, s: Submission) {
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
        let timer = RequestTimer::new(self.stats.requests.clone(), s.submitted, s.req.n);
        self.requeue(Group {
            id: self.arrivals,
            timer,
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

    pub(super) fn requeue(&mut self, g: Group) {
        let at = self.waiting.partition_point(|w| w.rank < g.rank);
        self.waiting.insert(at, g);
    }

    pub(super) fn publish_counts(&self) {
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
    pub(super) fn drop_cancelled(&mut self) {
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
    pub(super) fn admit(&mut self) {
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
    pub(super) fn pop_waiting(&mut self) -> Option<Group> {
        let mut g = self.waiting.pop_front()?;
        if std::mem::take(&mut g.queued) {
            self.stats.leave_queue();
        }
        Some(g)
    }

    /// Whether `n` more sequences may run beside `running` ones.
    pub(super) fn fits(&self, running: usize, n: usize) -> bool {
        running == 0 || running + n <= self.config.max_running
    }

    /// Whether a request of `n` sequences ranked `rank` would fit once every running request
    /// ranked behind it is preempted.
    pub(super) fn preemption_makes_room(&self, rank: (i64, u64), n: usize) -> bool {
        let kept = self
            .groups
            .iter()
            .filter(|g| g.rank < rank)
            .map(Group::running)
            .sum();
        self.fits(kept, n)
    }

    /// Sends the worst-ranked running request ranked behind `rank` back to the queue.
    pub(super) fn preempt_behind(&mut self, rank: (i64, u64)) -> bool {
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
    pub(super) fn preempt_group(&mut self, i: usize) {
        let mut g = self.groups.remove(i);
        debug!(request_id = %g.req.request_id, "preempted");
        self.stats.preemptions.fetch_add(1, Ordering::Relaxed);
        g.preempt(&self.model);
        self.requeue(g);
    }
}
