//! temper-engine: one scheduler thread per served model doing continuous batching over
//! `Decoder::forward`, beside its roles: the KV block manager (`kv_manager`: the pool, prefix
//! cache and allocation), the sampler and logits processors, and the output processor
//! (`output`: stop handling and detokenizing).
//!
//! The HTTP layer validates requests; the engine only rejects requests it cannot possibly serve
//! (`EngineError`). Events for a request arrive on the receiver `Engine::submit` returns;
//! dropping that receiver cancels the request.

mod kv_manager;
mod logits;
mod lookup;
mod mask_workers;
mod metrics;
mod output;
mod rng;
mod sampler;
mod scheduler;
mod stats;
mod stop;
mod structured;

use std::sync::{Arc, OnceLock};

pub use kv_manager::KvCacheStats;
pub use mask_workers::MaskHold;
pub use metrics::{HistogramSnapshot, RequestMetrics};

pub use structured::{
    Grammar, GrammarCompiler, GrammarError, GrammarMatcher, JsonOptions, OutputConstraint,
    TagStructure, TokenMask,
};

use temper_model::{Decoder, LoraAdapter, ModelConfig};
use temper_text::Tokenizer;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

/// Scheduler limits.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Most tokens (decode rows + prefill chunks) fed to one forward call. Decode rows always
    /// run; prompts are chunked into what is left.
    pub max_batch_tokens: usize,
    /// Most sequences (choices) running at once; further requests wait in `scheduling` order.
    pub max_running: usize,
    /// Longest prompt + completion a request may ask for.
    pub max_model_len: usize,
    pub scheduling: Scheduling,
    /// Most new requests waiting for admission; past it `submit` refuses with
    /// `EngineError::QueueFull` (a 429), so overload is an answer, not a growing queue.
    pub max_waiting: usize,
    /// Speculative decoding by prompt lookup: most draft tokens a decoding sequence proposes
    /// per step, copied from what followed the latest earlier occurrence of its last tokens in
    /// its prompt and output, and verified in the same forward. 0 = off. Output is unchanged
    /// by it (greedy and seeded bit for bit, unseeded in distribution): only the number of
    /// steps changes.
    pub prompt_lookup_tokens: usize,
    /// The budget of the model's KV block pool (`--kv-cache-mb`); at least one block.
    pub kv_cache_bytes: usize,
}

/// The default `max_batch_tokens`: 64 per thread of the compute pool (128 on two cores, within
/// 128..=2048), a step of about 0.1 s of prompt work on a CPU core pair. Prefill per token is
/// no faster in bigger steps, and smaller ones serve a burst of short prompts in turns: on two
/// cores eight simultaneous ~50-token prompts got their first token at a median 0.23 s instead
/// of 0.30 s with 512, and decoding streams wait at most one such step when a prompt arrives.
pub fn default_max_batch_tokens() -> usize {
    (64 * rayon::current_num_threads()).clamp(128, 2048)
}

/// Order of the waiting queue (vLLM's `--scheduling-policy`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Scheduling {
    /// First come, first served; `GenerationRequest::priority` is not looked at.
    #[default]
    Fcfs,
    /// Lower `priority` first (ties by arrival). A waiting request that does not fit preempts
    /// running ones of worse priority: they go back to the queue with their output so far and
    /// later recompute their cache, without losing or repeating a token.
    Priority,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            max_batch_tokens: default_max_batch_tokens(),
            max_running: 32,
            max_model_len: 32768,
            scheduling: Scheduling::Fcfs,
            max_waiting: 256,
            prompt_lookup_tokens: 4,
            kv_cache_bytes: 1 << 30,
        }
    }
}

/// One generation request: `n` choices continuing `prompt`.
#[derive(Clone, Debug)]
pub struct GenerationRequest {
    /// Used in logs only.
    pub request_id: String,
    pub prompt: Vec<u32>,
    pub n: usize,
    pub sampling: SamplingParams,
    pub stopping: StopParams,
    /// Logprobs of each sampled token plus this many top alternatives; `Some(0)` = the sampled
    /// token's only; `None` = no logprobs.
    pub logprobs: Option<usize>,
    /// LoRA adapter every choice applies (n > 1 forks share it); `None` = the base weights.
    pub adapter: Option<Arc<LoraAdapter>>,
    /// Structured output: every choice's output matches this grammar (compiled by
    /// `Engine::grammar_compiler`); `None` = free text.
    pub constraint: Option<Grammar>,
    /// Lower runs first under `Scheduling::Priority`; ignored under `Fcfs`.
    pub priority: i64,
    /// Log-probabilities of the prompt's tokens, each with this many top alternatives, sent
    /// once as `GenerationEvent::PromptLogprobs` before any token; `None` = not computed.
    pub prompt_logprobs: Option<usize>,
    /// Beam search of width `n` instead of sampling: the `n` best beams come back as the
    /// choices, best first, each choice's events all at once when the search ends. Beams are
    /// ranked by the model's raw log-probabilities: `sampling` and the stop strings and stop
    /// token ids do not apply (the HTTP layer refuses them), nor may `constraint` be set.
    pub beam_search: Option<BeamSearch>,
    /// Requests share cached prompt blocks only with requests of the same salt (and adapter);
    /// `None` shares with every other unsalted request.
    pub cache_salt: Option<String>,
}

/// vLLM's beam search: every step, each live beam proposes its 2n most likely next tokens;
/// those ending generation (EOS / `<end_of_turn>`, unless `ignore_eos`) finish a hypothesis,
/// the n best others are the next beams. It runs `max_tokens` steps (or until no beam is
/// left); the n best hypotheses, finished or live, are the result. A hypothesis scores
/// `cum_logprob / len ^ length_penalty`, `len` counting the prompt and the generated tokens
/// but not a final end token.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BeamSearch {
    pub length_penalty: f32,
}

#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// Below 1e-5: greedy.
    pub temperature: f32,
    pub top_p: f32,
    /// 0 = off.
    pub top_k: usize,
    pub min_p: f32,
    /// Choice i draws from a generator seeded with `seed + i`; `None` = a fresh random seed.
    pub seed: Option<u64>,
    /// Added to the token's logit (clamped to [-100, 100]).
    pub logit_bias: Vec<(u32, f32)>,
    /// Only these tokens can be sampled; `None` = any.
    pub allowed_token_ids: Option<Vec<u32>>,
    /// Words never generated; the engine tokenizes each with and without a leading space.
    pub bad_words: Vec<String>,
    /// 1 = off. For tokens in the prompt or output: positive logits divided, negative multiplied.
    pub repetition_penalty: f32,
    /// `logit -= frequency_penalty * count_in_output`.
    pub frequency_penalty: f32,
    /// `logit -= presence_penalty` for tokens in the output.
    pub presence_penalty: f32,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            seed: None,
            logit_bias: Vec::new(),
            allowed_token_ids: None,
            bad_words: Vec::new(),
            repetition_penalty: 1.0,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct StopParams {
    /// Most tokens to generate; `None`: as many as the context leaves after the prompt.
    /// [`Engine::submit`] checks it against the context and sets the number it runs with.
    pub max_tokens: Option<usize>,
    pub stop: Vec<String>,
    pub stop_token_ids: Vec<u32>,
    /// Keep generating past EOS and `<end_of_turn>`.
    pub ignore_eos: bool,
    pub include_stop_str_in_output: bool,
    pub skip_special_tokens: bool,
    pub spaces_between_special_tokens: bool,
    /// Until this many tokens are generated, EOS / end of turn and stop tokens are masked and
    /// stop strings are not matched.
    pub min_tokens: usize,
    /// End generation (finish reason `Repetition`) when the output loops.
    pub repetition_detection: Option<RepetitionDetection>,
}

impl StopParams {
    /// The completion budget the scheduler runs with: set by [`Engine::submit`] on every
    /// request it accepts.
    pub(crate) fn budget(&self) -> usize {
        debug_assert!(
            self.max_tokens.is_some(),
            "a request the engine did not accept"
        );
        self.max_tokens.unwrap_or(0)
    }
}

/// Generation ends when the output's tail is one pattern of `min_pattern_size` to
/// `max_pattern_size` tokens repeated `min_count` times (vLLM's rule; a max of 0 disables it,
/// a min of 0 counts as 1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RepetitionDetection {
    pub min_pattern_size: usize,
    pub max_pattern_size: usize,
    pub min_count: usize,
}

impl Default for StopParams {
    fn default() -> Self {
        StopParams {
            max_tokens: Some(16),
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            include_stop_str_in_output: false,
            skip_special_tokens: true,
            spaces_between_special_tokens: true,
            min_tokens: 0,
            repetition_detection: None,
        }
    }
}

/// What a request's receiver gets. Per choice: Token events, then exactly one Finished. The
/// concatenation of a choice's Token texts and its Finished text is its output.
#[derive(Clone, Debug, PartialEq)]
pub enum GenerationEvent {
    Token {
        choice: usize,
        token_id: u32,
        /// New text, held back while it could still be the start of a stop string. Empty for
        /// EOS / stop tokens.
        text: String,
        logprob: Option<TokenLogprob>,
    },
    Finished {
        choice: usize,
        reason: FinishReason,
        stop_reason: Option<StopReason>,
        /// Text still held back at the end.
        text: String,
        prompt_tokens: usize,
        /// Prompt tokens whose keys and values came from the prefix cache.
        cached_tokens: usize,
        completion_tokens: usize,
    },
    /// The request failed (e.g. a model error); no further events follow.
    Error { message: String },
    /// Sent once, before any Token, when `prompt_logprobs` was asked: one entry per prompt
    /// position from the second on (nothing predicts the first token).
    PromptLogprobs { entries: Vec<PromptLogprob> },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    Stop,
    Length,
    /// Repetition detection fired.
    Repetition,
    Abort,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StopReason {
    Text(String),
    Token(u32),
    /// Repetition detection fired (vLLM's `"repetition_detected"`).
    Repetition,
}

#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprob {
    /// Raw log-softmax of the sampled token.
    pub logprob: f32,
    /// The most likely tokens with their raw log-softmax, best first.
    pub top: Vec<(u32, f32)>,
}

/// What the model predicted at one prompt position, from the raw log-softmax of the logits
/// of the tokens before it.
#[derive(Clone, Debug, PartialEq)]
pub struct PromptLogprob {
    /// The prompt's token at this position.
    pub token: u32,
    pub logprob: f32,
    /// 1-based rank of `token` in the vocabulary (tokens at least as likely, itself included;
    /// its place in `top` when it is there).
    pub rank: usize,
    /// The most likely tokens with their log-softmax, best first.
    pub top: Vec<(u32, f32)>,
}

#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum EngineError {
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("n must be at least 1")]
    NoChoices,
    #[error("max_tokens must be at least 1")]
    NoTokens,
    /// The prompt alone fills the context.
    #[error(
        "This model's maximum context length is {max_model_len} tokens. However, your request \
         has {prompt_tokens} input tokens. Please reduce the length of the input messages."
    )]
    PromptTooLong {
        prompt_tokens: usize,
        max_model_len: usize,
    },
    /// The prompt fits, but not with the requested `max_tokens` after it.
    #[error(
        "'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's \
         maximum context length is {max_model_len} tokens and your request has {prompt_tokens} \
         input tokens ({max_tokens} > {max_model_len} - {prompt_tokens})."
    )]
    TooLong {
        prompt_tokens: usize,
        max_tokens: usize,
        max_model_len: usize,
    },
    #[error("`min_tokens` ({min_tokens}) must not exceed the max tokens ({max_tokens}).")]
    MinTokensOverBudget {
        min_tokens: usize,
        max_tokens: usize,
    },
    #[error("prompt token id {token} is outside the vocabulary (size {vocab_size})")]
    TokenOutOfRange { token: u32, vocab_size: usize },
    #[error("the engine is not running")]
    Stopped,
    #[error("the LoRA adapter was made for a model of another shape")]
    AdapterMismatch,
    #[error("beam search cannot follow a structured-output constraint")]
    BeamSearchConstraint,
    #[error("beam width {n} needs a vocabulary of at least {} tokens", 2 * n)]
    BeamTooWide { n: usize },
    #[error("{max_waiting} requests are already waiting for this model")]
    QueueFull { max_waiting: usize },
}

/// A snapshot of the scheduler's counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EngineStats {
    /// Forward calls made.
    pub steps: u64,
    /// Sequence rows summed over all steps.
    pub rows: u64,
    /// Tokens fed to the model summed over all steps.
    pub tokens: u64,
    /// Most rows in one step.
    pub max_rows_in_step: usize,
    /// Sequences admitted and not finished (a request reserves n).
    pub running: usize,
    /// Requests admitted and not finished.
    pub running_requests: usize,
    /// Requests queued and not yet admitted.
    pub waiting: usize,
    /// Running requests sent back to the queue for a better-ranked one (priority scheduling).
    pub preemptions: u64,
    /// Structured-output masks computed by the mask workers (first masks are computed when
    /// the constraint is compiled).
    pub masks: u64,
    /// Mask jobs skipped because the request's client had gone away.
    pub masks_abandoned: u64,
    /// Prompt positions whose prompt logprobs were computed.
    pub prompt_logprobs: u64,
    /// Draft tokens proposed by prompt lookup and fed to the model for verification.
    pub drafted_tokens: u64,
    /// Draft tokens equal to the token sampled at their position (each saves a step).
    pub accepted_tokens: u64,
}

/// Handle to a model's scheduler thread; cheap to clone, shareable across threads.
#[derive(Clone)]
pub struct Engine {
    tx: std::sync::mpsc::Sender<scheduler::Submission>,
    stats: Arc<stats::Stats>,
    kv: kv_manager::KvManager,
    max_model_len: usize,
    max_waiting: usize,
    vocab_size: usize,
    model_config: ModelConfig,
    tokenizer: Arc<Tokenizer>,
    /// Built on first use: it walks the whole vocabulary.
    grammar_compiler: Arc<OnceLock<Result<GrammarCompiler, GrammarError>>>,
    mask_gate: mask_workers::MaskGate,
}

impl Engine {
    /// Spawns the scheduler thread for `model`. It runs until every handle is dropped and its
    /// work is done.
    pub fn start(model: Arc<Decoder>, tokenizer: Arc<Tokenizer>, config: EngineConfig) -> Engine {
        let model_config = model.config().clone();
        let model_cfg = &model_config;
        let vocab_size = model_cfg.vocab_size;
        // Limits that could never be met are raised to the smallest workable values; requests
        // cannot outgrow the model's context.
        let config = EngineConfig {
            max_batch_tokens: config.max_batch_tokens.max(1),
            max_running: config.max_running.max(1),
            max_model_len: config.max_model_len.min(model_cfg.context_length),
            max_waiting: config.max_waiting.max(1),
            ..config
        };
        let max_waiting = config.max_waiting;
        let max_model_len = config.max_model_len;
        let stats = Arc::new(stats::Stats::default());
        let (tx, rx) = std::sync::mpsc::channel();
        let mask_gate = mask_workers::MaskGate::default();
        let kv = kv_manager::KvManager::new(&model, config.kv_cache_bytes);
        let sched = scheduler::Scheduler::new(
            model,
            kv.clone(),
            tokenizer.clone(),
            config,
            stats.clone(),
            rx,
            mask_gate.clone(),
        );
        if let Err(e) = std::thread::Builder::new()
            .name("temper-engine".into())
            .spawn(move || sched.run())
        {
            scheduler::spawn_failed(&e);
        }
        Engine {
            tx,
            stats,
            kv,
            max_model_len,
            max_waiting,
            vocab_size,
            model_config,
            tokenizer,
            grammar_compiler: Arc::new(OnceLock::new()),
            mask_gate,
        }
    }

    /// Compiles structured-output constraints for this model's vocabulary. The first call
    /// builds the compiler (a pass over the vocabulary; ~1 s for 262k tokens), later ones share it.
    pub fn grammar_compiler(&self) -> Result<&GrammarCompiler, GrammarError> {
        self.grammar_compiler
            .get_or_init(|| {
                let end_tokens = output::EndTokens::of(&self.tokenizer).ids();
                GrammarCompiler::new(self.tokenizer.clone(), &end_tokens)
            })
            .as_ref()
            .map_err(Clone::clone)
    }

    /// Builds the compiler if needed and compiles `constraint`. Both can take long (the first
    /// build ~1.4 s on a 262k vocabulary; a large schema tens of milliseconds): async callers
    /// run this on a blocking thread.
    pub fn compile_grammar(&self, constraint: &OutputConstraint) -> Result<Grammar, GrammarError> {
        self.grammar_compiler()?.compile(constraint)
    }

    /// For tests: while the returned hold lives, the mask workers compute no structured-output
    /// mask, so a test can show what waits for one and what does not.
    #[doc(hidden)]
    pub fn hold_masks(&self) -> MaskHold {
        self.mask_gate.hold()
    }

    /// Queues a request; events arrive on the receiver. Dropping the receiver cancels the
    /// request.
    pub fn submit(
        &self,
        mut req: GenerationRequest,
    ) -> Result<UnboundedReceiver<GenerationEvent>, EngineError> {
        if req.prompt.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        if req.n == 0 {
            return Err(EngineError::NoChoices);
        }
        let budget = completion_budget(req.prompt.len(), &req.stopping, self.max_model_len)?;
        req.stopping.max_tokens = Some(budget);
        // Refused here: inside a step it would fail every row of the batch.
        if req
            .adapter
            .as_ref()
            .is_some_and(|a| !a.fits(&self.model_config))
        {
            return Err(EngineError::AdapterMismatch);
        }
        if req.beam_search.is_some() {
            if req.constraint.is_some() {
                return Err(EngineError::BeamSearchConstraint);
            }
            // Each step needs 2n candidates per beam.
            if req.n.saturating_mul(2) > self.vocab_size {
                return Err(EngineError::BeamTooWide { n: req.n });
            }
        }
        let s = &req.sampling;
        let out_of_range = req
            .prompt
            .iter()
            .chain(s.logit_bias.iter().map(|(t, _)| t))
            .chain(s.allowed_token_ids.iter().flatten())
            .find(|&&t| t as usize >= self.vocab_size);
        if let Some(&token) = out_of_range {
            return Err(EngineError::TokenOutOfRange {
                token,
                vocab_size: self.vocab_size,
            });
        }
        // Tokenizing bad words and sorting the prompt happen here, off the scheduler thread.
        let end_tokens = output::EndTokens::of(&self.tokenizer);
        let procs = logits::Processors::new(
            &req.sampling,
            &req.stopping,
            &req.prompt,
            &self.tokenizer,
            &end_tokens.ids(),
        );
        if !self.stats.enter_queue(self.max_waiting) {
            return Err(EngineError::QueueFull {
                max_waiting: self.max_waiting,
            });
        }
        let (tx, rx) = unbounded_channel();
        if self
            .tx
            .send(scheduler::Submission {
                req,
                procs,
                tx,
                submitted: std::time::Instant::now(),
            })
            .is_err()
        {
            self.stats.leave_queue();
            return Err(EngineError::Stopped);
        }
        Ok(rx)
    }

    /// The scheduler's counters, as of its last step.
    pub fn stats(&self) -> EngineStats {
        self.stats.snapshot()
    }

    /// The model's KV block pool: its budget, usage and prefix cache.
    pub fn kv_cache_stats(&self) -> KvCacheStats {
        self.kv.stats()
    }

    /// Latency histograms and token counts of this engine's requests since it started.
    pub fn request_metrics(&self) -> RequestMetrics {
        self.stats.requests.snapshot()
    }

    /// The effective maximum of prompt + max_tokens (the configured one, capped by the model's
    /// context length).
    pub fn max_model_len(&self) -> usize {
        self.max_model_len
    }

    /// How many requests may wait for admission (`EngineConfig::max_waiting`): more are refused
    /// with [`EngineError::QueueFull`].
    pub fn max_waiting(&self) -> usize {
        self.max_waiting
    }
}

/// The context rules (the one place they are checked): the prompt must leave room, and the
/// completion budget is `max_tokens` (at least 1, at most that room) or the whole room; at
/// least `min_tokens`.
fn completion_budget(
    prompt_tokens: usize,
    stopping: &StopParams,
    max_model_len: usize,
) -> Result<usize, EngineError> {
    let room = max_model_len.saturating_sub(prompt_tokens);
    if room == 0 {
        return Err(EngineError::PromptTooLong {
            prompt_tokens,
            max_model_len,
        });
    }
    let max_tokens = match stopping.max_tokens {
        None => room,
        Some(0) => return Err(EngineError::NoTokens),
        Some(m) if m > room => {
            return Err(EngineError::TooLong {
                prompt_tokens,
                max_tokens: m,
                max_model_len,
            })
        }
        Some(m) => m,
    };
    let min_tokens = stopping.min_tokens;
    if min_tokens > max_tokens {
        return Err(EngineError::MinTokensOverBudget {
            min_tokens,
            max_tokens,
        });
    }
    Ok(max_tokens)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_and_events_cross_threads() {
        fn send_sync<T: Send + Sync>() {}
        send_sync::<Engine>();
        send_sync::<GenerationEvent>();
        send_sync::<GenerationRequest>();
    }

    #[test]
    fn context_rules() {
        let stop = |max_tokens, min_tokens| StopParams {
            max_tokens,
            min_tokens,
            ..StopParams::default()
        };
        assert_eq!(
            completion_budget(100, &stop(None, 0), 100),
            Err(EngineError::PromptTooLong {
                prompt_tokens: 100,
                max_model_len: 100
            })
        );
        assert_eq!(
            completion_budget(90, &stop(Some(11), 0), 100),
            Err(EngineError::TooLong {
                prompt_tokens: 90,
                max_tokens: 11,
                max_model_len: 100
            })
        );
        assert_eq!(completion_budget(90, &stop(Some(10), 0), 100), Ok(10));
        assert_eq!(completion_budget(90, &stop(None, 0), 100), Ok(10));
        assert_eq!(
            completion_budget(90, &stop(Some(0), 0), 100),
            Err(EngineError::NoTokens)
        );
        assert_eq!(
            completion_budget(90, &stop(None, 11), 100),
            Err(EngineError::MinTokensOverBudget {
                min_tokens: 11,
                max_tokens: 10
            })
        );
    }
}
