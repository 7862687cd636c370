//! KV blocks: what a request takes from the prefix cache at admission, and room in the pool for
//! each step (preempting by recompute, or failing a request that cannot fit).

use super::*;

impl Group {
    /// On admission: takes the published blocks that hold a prefix of what each empty cache
    /// must compute (the prompt; after a preemption, prompt and output). Prompt logprobs need
    /// every prompt row computed, so such a request takes none.
    pub(super) fn reuse_prefixes(&mut self) {
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
    pub(super) fn blocks_to_start(&self) -> usize {
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
}

impl Scheduler {
    /// Makes sure the KV pool holds this step's decode rows: while it does not, the
    /// worst-ranked running request goes back to the queue (preemption by recompute); a request
    /// alone that still does not fit fails. Draft tokens get what blocks are left (`fit_drafts`).
    /// Returns the blocks left for prompt chunks.
    pub(super) fn make_kv_room(&mut self) -> usize {
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

    /// Frees KV blocks when the running requests cannot go on: preempts the worst-ranked one,
    /// or fails the only one with `message`.
    pub(super) fn relieve_kv(&mut self, message: &str) {
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
}
