//! The output processor (vLLM's output processor with its detokenizer and stop checker): turns
//! each token sampled for a choice into the events its client gets. It owns the stop conditions
//! (end tokens, stop token ids, stop strings, `max_tokens`, `min_tokens`, repetition),
//! incremental detokenizing with stop strings held back, and the `Finished` event; and the
//! events of beam search's results, which come all at once.

use std::sync::Arc;

use temper_text::{DecodeOptions, DecodeStream, Tokenizer};
use tracing::debug;

use crate::logits;
use crate::stop::StopMatcher;
use crate::{FinishReason, GenerationEvent, GenerationRequest, StopReason, TokenLogprob};

/// Tokens that end generation like EOS does (unless `ignore_eos`).
pub(crate) struct EndTokens {
    eos: Option<u32>,
    /// The family's end-of-turn tokens (`<end_of_turn>`, `<|im_end|>`, `<|eot_id|>`…).
    end_of_turn: Vec<u32>,
}

impl EndTokens {
    pub(crate) fn of(tokenizer: &Tokenizer) -> Self {
        EndTokens {
            eos: tokenizer.eos_id(),
            end_of_turn: tokenizer.end_of_turn_ids().to_vec(),
        }
    }

    pub(crate) fn contains(&self, id: u32) -> bool {
        self.eos == Some(id) || self.end_of_turn.contains(&id)
    }

    pub(crate) fn ids(&self) -> Vec<u32> {
        let mut ids: Vec<u32> = self.eos.into_iter().collect();
        ids.extend(self.end_of_turn.iter().filter(|&&id| Some(id) != self.eos));
        ids
    }
}

/// A token the sampler chose for a choice.
pub(crate) struct Sampled {
    pub(crate) token: u32,
    /// Its logprobs, when the request asks for them.
    pub(crate) logprob: Option<TokenLogprob>,
    /// The choice's grammar cannot be extended past it.
    pub(crate) grammar_done: bool,
}

/// One choice's output so far: its detokenizer and stop-string matcher.
pub(crate) struct ChoiceOutput {
    decode: DecodeStream,
    stop: StopMatcher,
    finished: bool,
}

impl ChoiceOutput {
    pub(crate) fn new(req: &GenerationRequest) -> Self {
        ChoiceOutput {
            decode: DecodeStream::new(decode_options(req)),
            stop: StopMatcher::new(&req.stopping.stop, req.stopping.include_stop_str_in_output),
            finished: false,
        }
    }

    /// Whether generation has ended (its Finished event was made).
    pub(crate) fn is_finished(&self) -> bool {
        self.finished
    }
}

fn decode_options(req: &GenerationRequest) -> DecodeOptions {
    DecodeOptions {
        skip_special_tokens: req.stopping.skip_special_tokens,
        spaces_between_special_tokens: req.stopping.spaces_between_special_tokens,
    }
}

/// One per engine: what every choice's output needs.
pub(crate) struct OutputProcessor {
    tokenizer: Arc<Tokenizer>,
    end_tokens: EndTokens,
}

impl OutputProcessor {
    pub(crate) fn new(tokenizer: Arc<Tokenizer>) -> Self {
        let end_tokens = EndTokens::of(&tokenizer);
        OutputProcessor {
            tokenizer,
            end_tokens,
        }
    }

    pub(crate) fn end_tokens(&self) -> &EndTokens {
        &self.end_tokens
    }

    /// The events of `sampled`, the newest token of choice `choice`, whose output so far is
    /// `output` (`sampled.token` last): a Token, and a Finished when generation ends.
    pub(crate) fn push(
        &self,
        out: &mut ChoiceOutput,
        choice: usize,
        req: &GenerationRequest,
        sampled: Sampled,
        output: &[u32],
    ) -> Vec<GenerationEvent> {
        let stopping = &req.stopping;
        let Sampled {
            token,
            logprob,
            grammar_done,
        } = sampled;
        let generated = output.len();
        // The first min_tokens tokens never stop generation (min_tokens masking keeps stop
        // tokens out of them; this also covers a request whose every other token is masked).
        let may_stop = generated > stopping.min_tokens;
        let end_of_generation = may_stop && !stopping.ignore_eos && self.end_tokens.contains(token);
        let stop_token = may_stop && stopping.stop_token_ids.contains(&token);
        let (text, finish) = if end_of_generation || stop_token {
            // The stop token itself adds no text; what was held back comes out with Finished.
            let reason = if end_of_generation {
                None
            } else {
                Some(StopReason::Token(token))
            };
            (String::new(), Some((FinishReason::Stop, reason)))
        } else {
            let delta = out.decode.step(&self.tokenizer, token);
            let (mut text, matched) = out.stop.push(&delta, may_stop);
            if let Some(s) = matched {
                (text, Some((FinishReason::Stop, Some(StopReason::Text(s)))))
            } else if grammar_done {
                (text, Some((FinishReason::Stop, None)))
            } else if generated >= stopping.budget() {
                // A stop string may still complete in the detokenizer's held-back bytes.
                let (tail, matched) = out.stop.push(&out.decode.flush(), may_stop);
                text.push_str(&tail);
                match matched {
                    Some(s) => (text, Some((FinishReason::Stop, Some(StopReason::Text(s))))),
                    None => (text, Some((FinishReason::Length, None))),
                }
            } else if generated >= stopping.min_tokens
                && stopping
                    .repetition_detection
                    .is_some_and(|rd| logits::repeats(output, &rd))
            {
                (
                    text,
                    Some((FinishReason::Repetition, Some(StopReason::Repetition))),
                )
            } else {
                (text, None)
            }
        };
        let mut events = vec![GenerationEvent::Token {
            choice,
            token_id: token,
            text,
            logprob,
        }];
        if let Some((reason, stop_reason)) = finish {
            let mut rest = String::new();
            if reason != FinishReason::Length && !matches!(stop_reason, Some(StopReason::Text(_))) {
                // Ended by a token or by repetition: release the detokenizer's incomplete bytes
                // too.
                let (tail, _) = out.stop.push(&out.decode.flush(), false);
                rest.push_str(&tail);
            }
            rest.push_str(&out.stop.finish());
            out.finished = true;
            debug!(
                request_id = %req.request_id,
                choice,
                ?reason,
                ?stop_reason,
                completion_tokens = generated,
                "finished"
            );
            events.push(GenerationEvent::Finished {
                choice,
                reason,
                stop_reason,
                text: rest,
                prompt_tokens: req.prompt.len(),
                // `Group::send` fills it in.
                cached_tokens: 0,
                completion_tokens: generated,
            });
        }
        events
    }

    /// The events of a beam-search result: its `tokens` with their text (an end token adds
    /// none), then Finished. vLLM reports the end token as the stop reason of a hypothesis it
    /// ended; one still live when the search stopped ends by length.
    pub(crate) fn hypothesis_events(
        &self,
        choice: usize,
        tokens: &[u32],
        ended_by: Option<u32>,
        logprobs: Option<Vec<TokenLogprob>>,
        req: &GenerationRequest,
    ) -> Vec<GenerationEvent> {
        let mut decode = DecodeStream::new(decode_options(req));
        let mut logprobs = logprobs.map(Vec::into_iter);
        let mut events = Vec::with_capacity(tokens.len() + 1);
        for &token_id in tokens {
            let text = if ended_by == Some(token_id) {
                String::new()
            } else {
                decode.step(&self.tokenizer, token_id)
            };
            events.push(GenerationEvent::Token {
                choice,
                token_id,
                text,
                logprob: logprobs.as_mut().and_then(Iterator::next),
            });
        }
        let (reason, stop_reason) = match ended_by {
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
            completion_tokens: tokens.len(),
        });
        events
    }
}
