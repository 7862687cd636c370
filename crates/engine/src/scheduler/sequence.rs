//! The state of a request (`Group`) and of each of its choices (`Seq`), and how a choice takes
//! a token from its logits row.

use rayon::prelude::*;
use tokio::sync::mpsc::UnboundedSender;
use tracing::error;

use temper_model::Logits;

use crate::kv_manager::{KvManager, SeqKv};
use crate::logits::{History, Processors};
use crate::metrics::RequestTimer;
use crate::output::{ChoiceOutput, OutputProcessor, Sampled};
use crate::rng::Rng;
use crate::sampler::{self, Sampler};
use crate::structured::{GrammarMatcher, TokenMask};
use crate::{GenerationEvent, GenerationRequest, PromptLogprob};

use super::beam::{BeamParent, BeamPath, BeamState};

/// What sampling a row reuses from one row to the next (one per thread that samples).
#[derive(Default)]
pub(super) struct SampleScratch {
    sampler: Sampler,
    /// The processed logits row.
    processed: Vec<f32>,
}

/// One choice being generated.
pub(super) struct Seq {
    pub(super) choice: usize,
    pub(super) kv: SeqKv,
    /// The last sampled token: the input of this sequence's next decode row.
    pub(super) next: u32,
    pub(super) rng: Rng,
    pub(super) output: ChoiceOutput,
    pub(super) history: History,
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
    /// A choice with nothing generated yet, continuing what `kv` holds.
    pub(super) fn new(choice: usize, kv: SeqKv, rng: Rng, req: &GenerationRequest) -> Self {
        Seq {
            choice,
            kv,
            next: 0,
            rng,
            output: ChoiceOutput::new(req),
            history: History::default(),
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

    /// Tokens generated so far.
    pub(super) fn generated(&self) -> usize {
        self.history.output.len()
    }

    pub(super) fn finished(&self) -> bool {
        self.output.is_finished()
    }

    /// Whether this choice keeps its row instead of sampling from it now: a beam waits for its
    /// siblings' rows (`Group::expand_beams` takes them all), a constrained choice for its mask.
    pub(super) fn keeps_row(&self) -> bool {
        self.beam.is_some() || self.grammar.as_ref().is_some_and(|gr| gr.mask.is_none())
    }

    /// Prompt + output tokens the cache must hold before `next` is fed: the cache is behind
    /// this only after a preemption.
    pub(super) fn replay_len(&self, prompt: &[u32]) -> usize {
        prompt.len() + self.history.output.len() - 1
    }

    /// Samples the next token from `row` and returns the events it produces (a Token, and a
    /// Finished when generation ends). A constrained choice samples under its grammar's mask,
    /// which this consumes, and advances its matcher; `Err` fails the request.
    pub(super) fn take_token(
        &mut self,
        req: &GenerationRequest,
        procs: &Processors,
        row: &[f32],
        scratch: &mut SampleScratch,
        output: &OutputProcessor,
    ) -> Result<Vec<GenerationEvent>, String> {
        let sampled = self.sample(req, procs, row, scratch)?;
        self.next = sampled.token;
        self.history.push(sampled.token);
        Ok(output.push(
            &mut self.output,
            self.choice,
            req,
            sampled,
            &self.history.output,
        ))
    }

    fn sample(
        &mut self,
        req: &GenerationRequest,
        procs: &Processors,
        row: &[f32],
        scratch: &mut SampleScratch,
    ) -> Result<Sampled, String> {
        let SampleScratch { sampler, processed } = scratch;
        let mask = self.grammar.as_mut().and_then(|g| g.mask.take());
        let token = if procs.apply(row, &self.history, mask.as_ref(), processed) {
            // With every token masked the sampler would fall back to id 0: a wrong answer, not
            // an answer. The request fails instead, saying why.
            if !processed.iter().any(|&l| l > f32::NEG_INFINITY) {
                return Err(if mask.is_some() {
                    "structured output: no token satisfies both the grammar and the other \
                     sampling constraints"
                } else {
                    "no token is left to sample: allowed_token_ids, bad_words, min_tokens and \
                     logit_bias together exclude every token"
                }
                .into());
            }
            sampler.sample(processed, &req.sampling, &mut self.rng)
        } else {
            sampler.sample(row, &req.sampling, &mut self.rng)
        };
        // The grammar ends the choice when it cannot be extended further.
        let mut grammar_done = false;
        if let (Some(g), Some(_)) = (&mut self.grammar, &mask) {
            let matcher = g
                .matcher
                .as_mut()
                .ok_or("structured output: the matcher is missing")?;
            matcher.consume(token).map_err(|e| e.to_string())?;
            grammar_done = matcher.is_stopped();
        }
        Ok(Sampled {
            token,
            // Logprobs stay the model's raw distribution, before any processor.
            logprob: req.logprobs.map(|k| sampler::logprobs(row, token, k)),
            grammar_done,
        })
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
        cache: SeqKv,
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
    /// Prompt tokens found in the prefix cache at the first admission (`None` before it).
    pub(super) cached_tokens: Option<usize>,
    /// Counted in `Stats::queued`: submitted, never admitted yet.
    pub(super) queued: bool,
    /// Its latency and tokens, for `Engine::request_metrics`.
    pub(super) timer: RequestTimer,
}

impl Group {
    /// A request just submitted, ranked `rank`, whose events go to `tx` and whose prompt goes
    /// into `cache`.
    pub(super) fn new(
        id: u64,
        rank: (i64, u64),
        req: GenerationRequest,
        procs: Processors,
        tx: UnboundedSender<GenerationEvent>,
        cache: SeqKv,
        timer: RequestTimer,
    ) -> Self {
        Group {
            id,
            beams: req.beam_search.map(|_| BeamState::default()),
            req,
            procs,
            tx,
            phase: Phase::Prefill { cache, done: 0 },
            dropped: false,
            rank,
            prompt_logprobs: Vec::new(),
            cached_tokens: None,
            queued: true,
            timer,
        }
    }

    /// Choice `si` of this request while it decodes and is not dropped, with the request and
    /// its processors.
    pub(super) fn live_choice(
        &mut self,
        si: usize,
    ) -> Option<(&mut Seq, &GenerationRequest, &Processors)> {
        if self.dropped {
            return None;
        }
        let Phase::Decode { seqs } = &mut self.phase else {
            return None;
        };
        Some((seqs.get_mut(si)?, &self.req, &self.procs))
    }

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

    /// Appends the prompt logprobs that the rows of a chunk starting at prompt position `start`
    /// give: row j predicts position start + j + 1. Rows are taken in parallel. Returns how many
    /// were added.
    pub(super) fn add_prompt_logprobs(&mut self, start: usize, out: &Logits) -> usize {
        let (Some(from), Some(k)) = (self.prompt_logprobs_from(), self.req.prompt_logprobs) else {
            return 0;
        };
        let prompt = &self.req.prompt;
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
        self.prompt_logprobs.extend(entries);
        added
    }

    /// On admission: takes the published blocks that hold a prefix of what each empty cache
    /// must compute (the prompt; after a preemption, prompt and output). Prompt logprobs need
    /// every prompt row computed, so such a request takes none.
    pub(super) fn reuse_prefixes(&mut self, kv: &KvManager) {
        if self.req.prompt_logprobs.is_some() {
            self.cached_tokens.get_or_insert(0);
            return;
        }
        match &mut self.phase {
            Phase::Prefill { cache, done } => {
                if *done == 0 {
                    *done = kv.reuse_prefix(cache, &self.req.prompt);
                }
                self.cached_tokens.get_or_insert(*done);
            }
            Phase::Decode { seqs } => {
                let mut tokens = Vec::new();
                for s in seqs.iter_mut().filter(|s| s.kv.is_empty()) {
                    tokens.clear();
                    tokens.extend_from_slice(&self.req.prompt);
                    tokens.extend_from_slice(&s.history.output);
                    kv.reuse_prefix(&mut s.kv, &tokens);
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

    /// One beam-search step, once every live beam holds its row: the candidates
    /// `BeamState::select` keeps become the live beams, a parent's last child taking its cache
    /// and the others copying it. After `max_tokens` steps, or with no candidate left, the
    /// search ends: no live beam is left and the results' events are returned.
    pub(super) fn expand_beams(
        &mut self,
        output: &OutputProcessor,
    ) -> Option<Vec<GenerationEvent>> {
        let (Phase::Decode { seqs }, Some(state), Some(search)) =
            (&mut self.phase, &mut self.beams, self.req.beam_search)
        else {
            return None;
        };
        let req = &self.req;
        let mut parents = std::mem::take(seqs);
        let rows: Vec<BeamParent<'_>> = parents
            .iter_mut()
            .map(|p| BeamParent {
                row: p.waiting_row.take(),
                path: p.beam,
                output: &p.history.output,
            })
            .collect();
        let children = state.select(&rows, req, search, output.end_tokens());
        drop(rows);

        let mut children_left = vec![0usize; parents.len()];
        for c in &children {
            children_left[c.parent] += 1;
        }
        let mut beams = Vec::with_capacity(children.len());
        for (choice, c) in children.into_iter().enumerate() {
            let parent = &mut parents[c.parent];
            children_left[c.parent] -= 1;
            let kv = if children_left[c.parent] == 0 {
                parent.kv.take()
            } else {
                parent.kv.clone()
            };
            let mut beam = Seq::new(choice, kv, Rng::new(0), req);
            beam.next = c.token;
            beam.history = parent.history.clone();
            beam.history.push(c.token);
            beam.beam = Some(c.path);
            beams.push(beam);
        }
        drop(parents);
        let done = beams
            .first()
            .is_none_or(|b| b.generated() >= req.stopping.budget());
        if !done {
            *seqs = beams;
            return None;
        }
        let live = beams
            .into_iter()
            .map(|b| (b.beam.unwrap_or_default(), b.history.output))
            .collect();
        Some(state.results(live, req, search, output))
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
    pub(super) fn preempt(&mut self) {
        match &mut self.phase {
            Phase::Prefill { cache, done } => {
                cache.free();
                *done = 0;
            }
            Phase::Decode { seqs } => {
                for s in seqs {
                    s.kv.free();
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
