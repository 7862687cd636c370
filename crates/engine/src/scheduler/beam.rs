//! Beam search: each request's live beams, their expansion once every beam has its row, and
//! the results.

use super::*;

/// Where a live beam stands.
#[derive(Clone, Copy, Default)]
pub(super) struct BeamPath {
    /// Sum of the raw logprobs of its tokens.
    pub(super) cum_logprob: f64,
    /// Its newest entry in `BeamState::trail` (when logprobs are asked for).
    pub(super) trail: Option<usize>,
}

/// A beam-search request's results so far.
#[derive(Default)]
pub(super) struct BeamState {
    /// Hypotheses ended by an end token, best first, at most n (no other can make the result).
    pub(super) finished: Vec<Hypothesis>,
    /// Token logprobs of every beam kept so far: each entry links to its parent beam's newest,
    /// so beams share their common prefix.
    pub(super) trail: Vec<(Option<usize>, TokenLogprob)>,
}

/// A candidate result of beam search.
pub(super) struct Hypothesis {
    /// Output tokens; an end token only with `include_stop_str_in_output`.
    pub(super) tokens: Vec<u32>,
    pub(super) score: f64,
    /// `Some(token)`: ended by this end token; `None`: still live when the search stopped.
    pub(super) ended_by: Option<u32>,
    pub(super) trail: Option<usize>,
}

impl BeamState {
    /// Keeps the n best finished hypotheses; among equal scores the earlier one ranks first.
    pub(super) fn finish(&mut self, h: Hypothesis, n: usize) {
        let at = self.finished.partition_point(|f| f.score >= h.score);
        if at < n {
            self.finished.insert(at, h);
            self.finished.truncate(n);
        }
    }

    /// The logprobs along a trail, oldest first.
    pub(super) fn logprobs(&self, mut at: Option<usize>) -> Vec<TokenLogprob> {
        let mut out = Vec::new();
        while let Some(i) = at {
            let (parent, lp) = &self.trail[i];
            out.push(lp.clone());
            at = *parent;
        }
        out.reverse();
        out
    }
}

/// vLLM's beam score: `len` counts the prompt and the output without a final end token.
pub(super) fn beam_score(cum_logprob: f64, len: usize, length_penalty: f32) -> f64 {
    cum_logprob / (len as f64).powf(length_penalty as f64)
}

impl Scheduler {
    /// One beam-search step for group `gi`, whose live beams all hold their row: each proposes
    /// its 2n most likely tokens; end tokens finish hypotheses, the n best other candidates
    /// become the live beams (ties keep beam, then rank order, as vLLM's stable sort). After
    /// `max_tokens` steps, or with no candidate left, the search ends.
    pub(super) fn expand_beams(&mut self, gi: usize) {
        let g = &mut self.groups[gi];
        let (Phase::Decode { seqs }, Some(state), Some(search)) =
            (&mut g.phase, &mut g.beams, g.req.beam_search)
        else {
            return;
        };
        let req = &g.req;
        let width = req.n;
        let mut parents = std::mem::take(seqs);
        // Logprobs for the response may want more alternatives than the search needs.
        let k = (2 * width).max(req.logprobs.unwrap_or(0));
        struct Candidate {
            parent: usize,
            token: u32,
            logprob: f32,
            score: f64,
        }
        let mut candidates = Vec::with_capacity(2 * width * parents.len());
        let mut tops = Vec::with_capacity(parents.len());
        for (pi, p) in parents.iter_mut().enumerate() {
            let (Some(row), Some(path)) = (p.waiting_row.take(), p.beam) else {
                tops.push(Vec::new());
                continue;
            };
            let top = sampler::logprobs(&row, 0, k).top;
            let len = req.prompt.len() + p.history.output.len();
            for &(token, logprob) in top.iter().take(2 * width) {
                let cum = path.cum_logprob + logprob as f64;
                if !req.stopping.ignore_eos && self.end_tokens.contains(token) {
                    let trail = push_trail(state, req, path.trail, logprob, &top);
                    let mut tokens = p.history.output.clone();
                    if req.stopping.include_stop_str_in_output {
                        tokens.push(token);
                    }
                    let h = Hypothesis {
                        tokens,
                        score: beam_score(cum, len, search.length_penalty),
                        ended_by: Some(token),
                        trail,
                    };
                    state.finish(h, width);
                } else {
                    candidates.push(Candidate {
                        parent: pi,
                        token,
                        logprob,
                        score: beam_score(cum, len + 1, search.length_penalty),
                    });
                }
            }
            tops.push(top);
        }
        candidates.sort_by(|a, b| b.score.total_cmp(&a.score));
        candidates.truncate(width);

        // A parent's last child takes its cache; the others copy it.
        let mut children_left = vec![0usize; parents.len()];
        for c in &candidates {
            children_left[c.parent] += 1;
        }
        let opts = decode_options(req);
        let mut beams = Vec::with_capacity(candidates.len());
        for (choice, c) in candidates.iter().enumerate() {
            let parent = &mut parents[c.parent];
            children_left[c.parent] -= 1;
            let cache = if children_left[c.parent] == 0 {
                std::mem::replace(&mut parent.cache, self.model.new_cache())
            } else {
                parent.cache.clone()
            };
            let path = parent.beam.unwrap_or_default();
            let trail = push_trail(state, req, path.trail, c.logprob, &tops[c.parent]);
            let mut beam = Seq::new(choice, cache, Rng::new(0), opts, req);
            beam.next = c.token;
            beam.history = parent.history.clone();
            beam.history.push(c.token);
            beam.generated = beam.history.output.len();
            beam.beam = Some(BeamPath {
                cum_logprob: path.cum_logprob + c.logprob as f64,
                trail,
            });
            beams.push(beam);
        }
        drop(parents);
        let done = beams
            .first()
            .is_none_or(|b| b.generated >= req.stopping.max_tokens);
        if !done {
            *seqs = beams;
            return;
        }
        let events = beam_search_results(state, beams, req, search, &self.tokenizer);
        debug!(request_id = %req.request_id, "beam search finished");
        for ev in events {
            g.send(ev);
        }
        // No live beam left: the group leaves after this step.
    }
}

/// The events of a search that ended with `live` beams: the n best hypotheses, finished or
/// live, best first. Finished ones rank first among equal scores (vLLM appends the live ones
/// after them before its stable sort).
pub(super) fn beam_search_results(
    state: &mut BeamState,
    live: Vec<Seq>,
    req: &GenerationRequest,
    search: BeamSearch,
    tokenizer: &Tokenizer,
) -> Vec<GenerationEvent> {
    let mut results = std::mem::take(&mut state.finished);
    results.extend(live.into_iter().map(|b| {
        let path = b.beam.unwrap_or_default();
        let len = req.prompt.len() + b.history.output.len();
        Hypothesis {
            score: beam_score(path.cum_logprob, len, search.length_penalty),
            tokens: b.history.output,
            ended_by: None,
            trail: path.trail,
        }
    }));
    results.sort_by(|a, b| b.score.total_cmp(&a.score));
    results.truncate(req.n);
    let opts = decode_options(req);
    let mut events = Vec::new();
    for (choice, h) in results.into_iter().enumerate() {
        let logprobs = req.logprobs.map(|_| state.logprobs(h.trail));
        events.extend(hypothesis_events(choice, h, logprobs, req, opts, tokenizer));
    }
    events
}

/// Records a beam's new token logprob (when the request wants logprobs); returns its index.
pub(super) fn push_trail(
    state: &mut BeamState,
    req: &GenerationRequest,
    parent: Option<usize>,
    logprob: f32,
    top: &[(u32, f32)],
) -> Option<usize> {
    let k = req.logprobs?;
    state.trail.push((
        parent,
        TokenLogprob {
            logprob,
            top: top[..k.min(top.len())].to_vec(),
        },
    ));
    Some(state.trail.len() - 1)
}

/// A beam-search result's events: its tokens with their text (an end token adds none), then
/// Finished. vLLM reports the end token as the stop reason of a hypothesis it ended.
pub(super) fn hypothesis_events(
    choice: usize,
    h: Hypothesis,
    logprobs: Option<Vec<TokenLogprob>>,
    req: &GenerationRequest,
    opts: DecodeOptions,
    tokenizer: &Tokenizer,
) -> Vec<GenerationEvent> {
    let mut decode = DecodeStream::new(opts);
    let mut logprobs = logprobs.map(Vec::into_iter);
    let mut events = Vec::with_capacity(h.tokens.len() + 1);
    for &token_id in &h.tokens {
        let text = if h.ended_by == Some(token_id) {
            String::new()
        } else {
            decode.step(tokenizer, token_id)
        };
        events.push(GenerationEvent::Token {
            choice,
            token_id,
            text,
            logprob: logprobs.as_mut().and_then(Iterator::next),
        });
    }
    let (reason, stop_reason) = match h.ended_by {
        Some(token) => (FinishReason::Stop, Some(StopReason::Token(token))),
        None => (FinishReason::Length, None),
    };
    events.push(GenerationEvent::Finished {
        choice,
        reason,
        stop_reason,
        text: decode.flush(),
        prompt_tokens: req.prompt.len(),
        // `Group::send` fills it in.
        cached_tokens: 0,
        completion_tokens: h.tokens.len(),
    });
    events
}
