//! The state of a request and of each of its choices.

use super::*;

/// One choice being generated.
pub(super) struct Seq {
    pub(super) choice: usize,
    pub(super) cache: SeqCache,
    /// The last sampled token: the input of this sequence's next decode row.
    pub(super) next: u32,
    pub(super) rng: Rng,
    pub(super) decode: DecodeStream,
    pub(super) matcher: StopMatcher,
    pub(super) generated: usize,
    pub(super) history: History,
    pub(super) finished: bool,
    /// Structured output: where this choice is in its grammar.
    pub(super) grammar: Option<SeqGrammar>,
    /// This step's logits, kept until the mask they need comes back from a worker (the choice
    /// sits out of the batch meanwhile; nobody else waits).
    pub(super) waiting_row: Option<Vec<f32>>,
    /// After a preemption: the tokens this step feeds to rebuild the cache.
    pub(super) replay: Vec<u32>,
    /// When this step speculates: its input, `next` then the draft tokens; empty otherwise.
    pub(super) spec: Vec<u32>,
    /// Beam search: this beam's score so far.
    pub(super) beam: Option<BeamPath>,
}

impl Seq {
    /// Whether this choice keeps its row instead of sampling from it now: a beam waits for its
    /// siblings' rows (`expand_beams` takes them all), a constrained choice for its mask.
    pub(super) fn keeps_row(&self) -> bool {
        self.beam.is_some() || self.grammar.as_ref().is_some_and(|gr| gr.mask.is_none())
    }

    /// A choice with nothing generated yet, continuing what `cache` holds.
    pub(super) fn new(
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
    pub(super) fn replay_len(&self, prompt: &[u32]) -> usize {
        prompt.len() + self.history.output.len() - 1
    }
}

/// A choice's grammar state: the matcher and the mask of its next token. Both are `None` while
/// a worker computes that mask.
pub(super) struct SeqGrammar {
    pub(super) matcher: Option<GrammarMatcher>,
    pub(super) mask: Option<TokenMask>,
}

pub(super) enum Phase {
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
pub(super) struct Group {
    /// Stable while the group lives (indices shift as groups finish): mask results find their
    /// choice by it.
    pub(super) id: u64,
    pub(super) req: GenerationRequest,
    pub(super) procs: Processors,
    pub(super) tx: UnboundedSender<GenerationEvent>,
    pub(super) phase: Phase,
    /// The client went away, or its events can no longer be delivered.
    pub(super) dropped: bool,
    /// Queue position key: lower runs first.
    pub(super) rank: (i64, u64),
    /// Prompt logprobs computed so far (positions 1..=len): kept through a preemption, so a
    /// replayed prefill does not compute them again.
    pub(super) prompt_logprobs: Vec<PromptLogprob>,
    /// Beam search: finished hypotheses and logprobs; `None` when sampling.
    pub(super) beams: Option<BeamState>,
    /// What this request's KV blocks are shared under (its adapter and `cache_salt`).
    pub(super) prefix_key: PrefixKey,
    /// Prompt tokens found in the prefix cache at the first admission (`None` before it).
    pub(super) cached_tokens: Option<usize>,
    /// Counted in `Stats::queued`: submitted, never admitted yet.
    pub(super) queued: bool,
    /// Its latency and tokens, for `Engine::request_metrics`.
    pub(super) timer: RequestTimer,
}

impl Group {
    /// Sequences this request occupies (its reservation while prefilling).
    pub(super) fn running(&self) -> usize {
        match &self.phase {
            Phase::Prefill { .. } => self.req.n,
            Phase::Decode { seqs } => seqs.len(),
        }
    }

    /// The first prompt position whose logprobs are still to compute; `None` when none are.
    pub(super) fn prompt_logprobs_from(&self) -> Option<usize> {
        let from = self.prompt_logprobs.len();
        (self.req.prompt_logprobs.is_some() && from + 1 < self.req.prompt.len()).then_some(from)
    }

    /// Sends `ev`; a `Finished` gets the request's prefix-cache hit.
    pub(super) fn send(&mut self, mut ev: GenerationEvent) {
        if let GenerationEvent::Finished { cached_tokens, .. } = &mut ev {
            *cached_tokens = self.cached_tokens.unwrap_or(0);
        }
        self.timer.observe(&ev);
        if self.tx.send(ev).is_err() {
            self.dropped = true;
        }
    }

    /// Frees every cache; what was generated stays, to be replayed on readmission (its full
    /// blocks stay published, so the replay mostly finds them again).
    pub(super) fn preempt(&mut self, model: &Gemma3) {
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

    pub(super) fn fail(&mut self, message: &str) {
        error!(request_id = %self.req.request_id, "generation failed: {message}");
        self.send(GenerationEvent::Error {
            message: message.to_string(),
        });
    }
}
