//! Beam search: each request's live beams, their expansion once every beam has its row, and
//! the results.

use crate::output::{EndTokens, OutputProcessor};
use crate::sampler;
use crate::{BeamSearch, GenerationEvent, GenerationRequest, TokenLogprob};

/// Where a live beam stands.
#[derive(Clone, Copy, Default)]
pub(super) struct BeamPath {
    /// Sum of the raw logprobs of its tokens.
    cum_logprob: f64,
    /// Its newest entry in `BeamState::trail` (when logprobs are asked for).
    trail: Option<usize>,
}

/// A live beam at an expansion: its logits row, where it stands, and its output so far.
pub(super) struct BeamParent<'a> {
    pub(super) row: Option<Vec<f32>>,
    pub(super) path: Option<BeamPath>,
    pub(super) output: &'a [u32],
}

/// A next live beam: the parent it continues, its new token, and where it then stands.
pub(super) struct BeamChild {
    pub(super) parent: usize,
    pub(super) token: u32,
    pub(super) path: BeamPath,
}

/// A beam-search request's results so far.
#[derive(Default)]
pub(super) struct BeamState {
    /// Hypotheses ended by an end token, best first, at most n (no other can make the result).
    finished: Vec<Hypothesis>,
    /// Token logprobs of every beam kept so far: each entry links to its parent beam's newest,
    /// so beams share their common prefix.
    trail: Vec<(Option<usize>, TokenLogprob)>,
}

/// A candidate result of beam search.
struct Hypothesis {
    /// Output tokens; an end token only with `include_stop_str_in_output`.
    tokens: Vec<u32>,
    score: f64,
    /// `Some(token)`: ended by this end token; `None`: still live when the search stopped.
    ended_by: Option<u32>,
    trail: Option<usize>,
}

/// vLLM's beam score: `len` counts the prompt and the output without a final end token.
fn beam_score(cum_logprob: f64, len: usize, length_penalty: f32) -> f64 {
    cum_logprob / (len as f64).powf(length_penalty as f64)
}

impl BeamState {
    /// Keeps the n best finished hypotheses; among equal scores the earlier one ranks first.
    fn finish(&mut self, h: Hypothesis, n: usize) {
        let at = self.finished.partition_point(|f| f.score >= h.score);
        if at < n {
            self.finished.insert(at, h);
            self.finished.truncate(n);
        }
    }

    /// The logprobs along a trail, oldest first.
    fn logprobs(&self, mut at: Option<usize>) -> Vec<TokenLogprob> {
        let mut out = Vec::new();
        while let Some(i) = at {
            let (parent, lp) = &self.trail[i];
            out.push(lp.clone());
            at = *parent;
        }
        out.reverse();
        out
    }

    /// One beam-search step over the live beams `parents`: each proposes its 2n most likely
    /// tokens; end tokens finish hypotheses, the n best other candidates are returned as the
    /// next live beams (ties keep beam, then rank order, as vLLM's stable sort).
    pub(super) fn select(
        &mut self,
        parents: &[BeamParent<'_>],
        req: &GenerationRequest,
        search: BeamSearch,
        end_tokens: &EndTokens,
    ) -> Vec<BeamChild> {
        let width = req.n;
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
        for (pi, p) in parents.iter().enumerate() {
            let (Some(row), Some(path)) = (&p.row, p.path) else {
                tops.push(Vec::new());
                continue;
            };
            let top = sampler::logprobs(row, 0, k).top;
            let len = req.prompt.len() + p.output.len();
            for &(token, logprob) in top.iter().take(2 * width) {
                let cum = path.cum_logprob + logprob as f64;
                if !req.stopping.ignore_eos && end_tokens.contains(token) {
                    let trail = self.push_trail(req, path.trail, logprob, &top);
                    let mut tokens = p.output.to_vec();
                    if req.stopping.include_stop_str_in_output {
                        tokens.push(token);
                    }
                    let h = Hypothesis {
                        tokens,
                        score: beam_score(cum, len, search.length_penalty),
                        ended_by: Some(token),
                        trail,
                    };
                    self.finish(h, width);
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
        candidates
            .into_iter()
            .map(|c| {
                let path = parents[c.parent].path.unwrap_or_default();
                let trail = self.push_trail(req, path.trail, c.logprob, &tops[c.parent]);
                BeamChild {
                    parent: c.parent,
                    token: c.token,
                    path: BeamPath {
                        cum_logprob: path.cum_logprob + c.logprob as f64,
                        trail,
                    },
                }
            })
            .collect()
    }

    /// The events of a search that ended with `live` beams (where each stands, its output):
    /// the n best hypotheses, finished or live, best first. Finished ones rank first among
    /// equal scores (vLLM appends the live ones after them before its stable sort).
    pub(super) fn results(
        &mut self,
        live: Vec<(BeamPath, Vec<u32>)>,
        req: &GenerationRequest,
        search: BeamSearch,
        output: &OutputProcessor,
    ) -> Vec<GenerationEvent> {
        let mut results = std::mem::take(&mut self.finished);
        results.extend(live.into_iter().map(|(path, tokens)| {
            let len = req.prompt.len() + tokens.len();
            Hypothesis {
                score: beam_score(path.cum_logprob, len, search.length_penalty),
                tokens,
                ended_by: None,
                trail: path.trail,
            }
        }));
        results.sort_by(|a, b| b.score.total_cmp(&a.score));
        results.truncate(req.n);
        let mut events = Vec::new();
        for (choice, h) in results.into_iter().enumerate() {
            let logprobs = req.logprobs.map(|_| self.logprobs(h.trail));
            events.extend(output.hypothesis_events(choice, &h.tokens, h.ended_by, logprobs, req));
        }
        events
    }

    /// Records a beam's new token logprob (when the request wants logprobs); returns its index.
    fn push_trail(
        &mut self,
        req: &GenerationRequest,
        parent: Option<usize>,
        logprob: f32,
        top: &[(u32, f32)],
    ) -> Option<usize> {
        let k = req.logprobs?;
        self.trail.push((
            parent,
            TokenLogprob {
                logprob,
                top: top[..k.min(top.len())].to_vec(),
            },
        ));
        Some(self.trail.len() - 1)
    }
}
