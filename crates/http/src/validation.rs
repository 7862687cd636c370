//! One validation step: a parsed `ChatCompletionRequest` becomes typed `ChatParams`, a parsed
//! `CompletionRequest` typed `CompletionParams` (the engine's own `SamplingParams` and
//! `StopParams` among them, from the same functions for both), or a 400 naming the field.
//! Nothing downstream re-checks or sees the raw JSON.

use temper_engine::{BeamSearch, SamplingParams, StopParams};
use temper_text::tool_calls::{ToolCallFormat, ToolCallParser};
use temper_text::{ChatMessage, ContentPart, FunctionCall, MessageContent, ToolCall, ToolDef};

use crate::error::ApiError;
use crate::extras::{self, ReasoningEffort, RequestExtras};
use crate::protocol::{
    ChatCompletionRequest, CompletionRequest, JsonObject, MessageContentField, PromptField,
    PromptItem, RequestMessage, StreamOptionsField,
};
use crate::sampling::{sampling_params, stop_params};
use crate::structured::{requested_constraint, RequestedConstraint};

/// Temperatures below this sample greedily (vLLM's threshold).
const GREEDY_EPSILON: f64 = 1e-5;

/// Longest `request_id` accepted.
const MAX_REQUEST_ID_CHARS: usize = 256;

/// What validation needs to know about the server and the served model.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub vocab_size: usize,
    /// Most `top_logprobs` a request may ask for; `None` = the whole vocabulary is allowed.
    pub max_logprobs: Option<usize>,
    pub max_n: usize,
    pub trust_request_chat_template: bool,
    pub max_model_len: usize,
    /// The model is served with `--scheduling priority`: `priority` may be non-zero.
    pub priority_scheduling: bool,
    /// `--enable-tool-calls`: `tool_choice` may be other than "none", and calls are found and
    /// constrained in this format (the model template's; a request template decides its own).
    pub tool_calls: Option<ToolCallFormat>,
    /// Most prompts a completion request may hold (each waits in the engine's queue: the
    /// model's `--max-waiting`).
    pub max_prompts: usize,
}

/// A validated chat completion request.
#[derive(Debug, Clone)]
pub struct ChatParams {
    pub prompt: PromptParams,
    pub n: usize,
    pub sampling: SamplingParams,
    /// Its `max_tokens` is the explicit completion budget; `None` = whatever context is left
    /// after the prompt (the engine checks both against the context).
    pub stopping: StopParams,
    /// `Some(k)`: logprobs of each sampled token plus `k` alternatives.
    pub logprobs: Option<usize>,
    /// `Some(k)`: logprobs of each prompt token plus `k` alternatives.
    pub prompt_logprobs: Option<usize>,
    /// `use_beam_search` (width `n`) with its `length_penalty`.
    pub beam_search: Option<BeamSearch>,
    pub return_token_ids: bool,
    /// Logprob `token`s become `"token_id:<id>"`.
    pub return_tokens_as_token_ids: bool,
    /// `Some` when streaming.
    pub stream: Option<StreamOptions>,
    pub request_id: Option<String>,
    pub user: Option<String>,
    /// Keep only this many last prompt tokens.
    pub truncate_prompt_tokens: Option<usize>,
    /// Text put in front of every choice's content (`echo` of a continued assistant message).
    pub echo: Option<String>,
    /// `false` drops the reasoning parser's `reasoning` from the response.
    pub include_reasoning: bool,
    pub extras: RequestExtras,
    /// `response_format` / `structured_outputs`, or the calls a `tool_choice` of "required" or
    /// a named function demands; compiled for the served model by
    /// `crate::structured::compile_constraint`.
    pub constraint: Option<RequestedConstraint>,
    /// Finds tool calls in each choice's output (`tool_choice` other than "none"), in its start
    /// state.
    pub tool_parser: Option<ToolCallParser>,
    /// Lower runs first (priority scheduling only; always 0 otherwise).
    pub priority: i64,
}

/// Everything that turns messages into prompt tokens (shared with `/tokenize`).
#[derive(Debug, Clone)]
pub struct PromptParams {
    pub messages: Vec<ChatMessage>,
    pub add_generation_prompt: bool,
    pub continue_final_message: bool,
    /// A request-supplied template; only present when the server trusts them.
    pub chat_template: Option<String>,
    pub chat_template_kwargs: JsonObject,
    /// Prepend BOS on top of whatever the template adds.
    pub add_special_tokens: bool,
    pub tools: Option<Vec<ToolDef>>,
    pub documents: Option<Vec<JsonObject>>,
    pub reasoning_effort: Option<ReasoningEffort>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StreamOptions {
    pub include_usage: bool,
    /// Usage on every chunk; only with `include_usage`.
    pub continuous_usage_stats: bool,
}

pub fn validate_chat(req: ChatCompletionRequest, limits: &Limits) -> Result<ChatParams, ApiError> {
    let priority = priority(req.priority, limits)?;
    let stream_options = stream_options(req.stream, req.stream_options.as_ref())?;
    let stream = stream_options.is_some();
    let n = choice_count("n", req.n, limits)?;

    let fields = req.sampling_fields();
    let sampling = sampling_params(&fields, limits.vocab_size)?;
    let beam_search = beam_search(req.use_beam_search, req.length_penalty)?;
    greedy_choices("n", n, &sampling, beam_search.is_some())?;

    // `max_completion_tokens` wins over the deprecated `max_tokens`.
    let max_tokens = match (req.max_completion_tokens, req.max_tokens) {
        (Some(m), _) => Some(positive_tokens("max_completion_tokens", m)?),
        (None, Some(m)) => Some(positive_tokens("max_tokens", m)?),
        (None, None) => None,
    };
    let mut stopping = stop_params(&fields, limits.vocab_size, max_tokens)?;

    let logprobs_on = req.logprobs.unwrap_or(false);
    let top_logprobs = match req.top_logprobs {
        None | Some(0) => 0,
        Some(_) if !logprobs_on => {
            return Err(ApiError::bad(
                "top_logprobs",
                "`top_logprobs` needs `logprobs: true`.",
            ))
        }
        Some(k) => logprob_count("top_logprobs", k, limits)?,
    };
    let logprobs = logprobs_on.then_some(top_logprobs);
    let prompt_logprobs = prompt_logprobs(req.prompt_logprobs, stream, limits)?;

    let add_generation_prompt = req.add_generation_prompt.unwrap_or(true);
    let continue_final_message = req.continue_final_message.unwrap_or(false);
    if add_generation_prompt && continue_final_message {
        return Err(ApiError::bad(
            "continue_final_message",
            "`continue_final_message` needs `add_generation_prompt: false`.",
        ));
    }
    let chat_template = request_template(req.chat_template, limits)?;
    let messages = convert_messages(&req.messages)?;
    if continue_final_message && messages.last().map(|m| m.role.as_str()) != Some("assistant") {
        return Err(ApiError::bad(
            "continue_final_message",
            "`continue_final_message` needs a final assistant message to continue.",
        ));
    }

    let tools = extras::tools(req.tools)?;
    let documents = extras::documents(req.documents)?;
    let reasoning_effort = extras::reasoning_effort(req.reasoning_effort)?;
    let truncate_prompt_tokens =
        extras::truncate_prompt_tokens(req.truncate_prompt_tokens, limits.max_model_len)?;
    extras::mm_processor_kwargs(req.mm_processor_kwargs.as_ref())?;
    let echo = extras::echo(req.echo, &messages);
    let request_extras = RequestExtras {
        cache_salt: extras::cache_salt(req.cache_salt)?,
        kv_transfer_params: req.kv_transfer_params,
        engine_xargs: extras::engine_xargs(req.engine_xargs)?,
        service_tier: extras::service_tier(req.service_tier)?,
        parallel_tool_calls: req.parallel_tool_calls.unwrap_or(true),
    };
    let tool_calling = extras::tool_choice(
        req.tool_choice,
        tools.as_deref(),
        request_extras.parallel_tool_calls,
        limits.tool_calls.map(|model_format| {
            chat_template
                .as_deref()
                .map_or(model_format, ToolCallFormat::of_template)
        }),
    )?;

    // Mistral's `[TOOL_CALLS]` is a control token of its vocabularies: the parser must see it
    // in the text (vLLM keeps special tokens for Mistral's tool calls too), unless asked not to.
    let mistral_calls = tool_calling
        .parser
        .as_ref()
        .is_some_and(|p| p.format() == ToolCallFormat::MistralJson);
    if mistral_calls && req.skip_special_tokens.is_none() {
        stopping.skip_special_tokens = false;
    }

    let constraint = match (
        requested_constraint(req.response_format, req.structured_outputs)?,
        tool_calling.constraint,
    ) {
        (Some(output), Some(_)) => {
            return Err(ApiError::bad(
                "tool_choice",
                format!(
                    "`tool_choice` \"required\" or a named function constrains the output to \
                     tool calls: it cannot be combined with `{}`.",
                    output.param
                ),
            ))
        }
        (output, calls) => output.or(calls),
    };
    if beam_search.is_some() {
        beam_search_conflicts(&sampling, &stopping, constraint.as_ref())?;
    }
    request_id(req.request_id.as_deref())?;

    Ok(ChatParams {
        prompt: PromptParams {
            messages,
            add_generation_prompt,
            continue_final_message,
            chat_template,
            chat_template_kwargs: req.chat_template_kwargs.unwrap_or_default(),
            add_special_tokens: req.add_special_tokens.unwrap_or(false),
            tools,
            documents,
            reasoning_effort,
        },
        n,
        sampling,
        stopping,
        logprobs,
        prompt_logprobs,
        beam_search,
        return_token_ids: req.return_token_ids.unwrap_or(false),
        return_tokens_as_token_ids: req.return_tokens_as_token_ids.unwrap_or(false),
        stream: stream_options,
        request_id: req.request_id,
        user: req.user,
        truncate_prompt_tokens,
        echo,
        include_reasoning: req.include_reasoning.unwrap_or(true),
        extras: request_extras,
        constraint,
        tool_parser: tool_calling.parser,
        priority,
    })
}

/// `POST /v1/completions`'s default `max_tokens` (OpenAI's and vLLM's).
pub const DEFAULT_COMPLETION_MAX_TOKENS: usize = 16;

/// A validated `POST /v1/completions` request. Its sampling, stopping, logprob, stream and
/// extension fields are validated by the same functions as a chat request's.
#[derive(Debug, Clone)]
pub struct CompletionParams {
    /// Each prompt is its own request to the engine, with its own `n` choices.
    pub prompts: Vec<PromptInput>,
    /// BOS in front of text prompts where the model wants it (token-id prompts are used as
    /// given).
    pub add_special_tokens: bool,
    /// Keep only this many last prompt tokens.
    pub truncate_prompt_tokens: Option<usize>,
    /// Choices returned per prompt.
    pub n: usize,
    /// Choices generated per prompt (`best_of`, else `n`); when above `n`, the `n` of highest
    /// cumulative logprob are returned.
    pub best_of: usize,
    pub sampling: SamplingParams,
    /// Its `max_tokens` is the explicit completion budget (`None`: the default, 16 or the
    /// context left after the prompt when that is less); 1 when `echo_only`.
    pub stopping: StopParams,
    /// `max_tokens: 0` with `echo`: only the prompt comes back (with its logprobs); the one
    /// token the engine generates to get there is dropped.
    pub echo_only: bool,
    /// The prompt's text (and, with `logprobs`, its tokens' logprobs) in front of each choice.
    pub echo: bool,
    /// `Some(k)`: logprobs of each token plus its `k` most likely alternatives.
    pub logprobs: Option<usize>,
    /// `Some(k)`: each choice's `prompt_logprobs`, each prompt token plus `k` alternatives.
    pub prompt_logprobs: Option<usize>,
    pub beam_search: Option<BeamSearch>,
    pub return_token_ids: bool,
    pub return_tokens_as_token_ids: bool,
    /// `Some` when streaming.
    pub stream: Option<StreamOptions>,
    pub request_id: Option<String>,
    pub user: Option<String>,
    /// `cache_salt`, `kv_transfer_params`, `engine_xargs`; the chat-only `service_tier` and
    /// `parallel_tool_calls` stay at their defaults.
    pub extras: RequestExtras,
    /// `response_format` / `structured_outputs`.
    pub constraint: Option<RequestedConstraint>,
    pub priority: i64,
}

/// One prompt of a completion request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PromptInput {
    /// Tokenized as `/tokenize` does (special tokens in the text recognised).
    Text(String),
    /// Used exactly as given (inside the vocabulary).
    Tokens(Vec<u32>),
}

pub fn validate_completion(
    mut req: CompletionRequest,
    limits: &Limits,
) -> Result<CompletionParams, ApiError> {
    if req.suffix.is_some() {
        return Err(ApiError::bad(
            "suffix",
            "`suffix` is not supported: the served models have no fill-in-the-middle mode.",
        ));
    }
    if req.prompt_embeds.as_ref().is_some_and(|v| !v.is_null()) {
        return Err(ApiError::bad(
            "prompt_embeds",
            "`prompt_embeds` is not supported: send `prompt` as text or token ids.",
        ));
    }
    let prompts = prompts(
        std::mem::replace(&mut req.prompt, PromptField::List(Vec::new())),
        limits,
    )?;
    let priority = priority(req.priority, limits)?;
    let stream_options = stream_options(req.stream, req.stream_options.as_ref())?;
    let stream = stream_options.is_some();
    let n = choice_count("n", req.n, limits)?;
    let best_of = match req.best_of {
        None => n,
        Some(b) => {
            let b = choice_count("best_of", Some(b), limits)?;
            if b < n {
                return Err(ApiError::bad(
                    "best_of",
                    format!("`best_of` ({b}) must be at least `n` ({n})."),
                ));
            }
            if b > n && stream {
                return Err(ApiError::bad(
                    "best_of",
                    "`best_of` above `n` cannot be streamed: the best choices are only known \
                     once all have finished.",
                ));
            }
            b
        }
    };

    let fields = req.sampling_fields();
    let sampling = sampling_params(&fields, limits.vocab_size)?;
    let beam_search = beam_search(req.use_beam_search, req.length_penalty)?;
    if beam_search.is_some() && best_of > n {
        return Err(ApiError::bad(
            "best_of",
            "`best_of` cannot be combined with `use_beam_search`: the beam width is `n`.",
        ));
    }
    let param = if best_of > n { "best_of" } else { "n" };
    greedy_choices(param, best_of, &sampling, beam_search.is_some())?;

    let echo = req.echo.unwrap_or(false);
    let (max_tokens, echo_only) = match req.max_tokens {
        None => (None, false),
        Some(0) if echo => (Some(1), true),
        Some(0) => {
            return Err(ApiError::bad(
                "max_tokens",
                "`max_tokens` must be at least 1 (0 only with `echo`, to get the prompt back \
                 without a completion).",
            ))
        }
        Some(m) => (Some(positive_tokens("max_tokens", m)?), false),
    };
    let stopping = stop_params(&fields, limits.vocab_size, max_tokens)?;
    if echo_only && stopping.min_tokens > 0 {
        return Err(ApiError::bad(
            "min_tokens",
            "`min_tokens` must be 0 with `max_tokens: 0`.",
        ));
    }

    let logprobs = match req.logprobs {
        None => None,
        Some(k) if k < 0 => {
            return Err(ApiError::bad(
                "logprobs",
                format!("`logprobs` must be >= 0, got {k}."),
            ))
        }
        Some(k) => Some(logprob_count("logprobs", k, limits)?),
    };
    let prompt_logprobs = prompt_logprobs(req.prompt_logprobs, stream, limits)?;
    let truncate_prompt_tokens =
        extras::truncate_prompt_tokens(req.truncate_prompt_tokens, limits.max_model_len)?;
    let extras = RequestExtras {
        cache_salt: extras::cache_salt(req.cache_salt)?,
        kv_transfer_params: req.kv_transfer_params,
        engine_xargs: extras::engine_xargs(req.engine_xargs)?,
        service_tier: None,
        parallel_tool_calls: true,
    };
    let constraint = requested_constraint(req.response_format, req.structured_outputs)?;
    if beam_search.is_some() {
        beam_search_conflicts(&sampling, &stopping, constraint.as_ref())?;
    }
    request_id(req.request_id.as_deref())?;

    Ok(CompletionParams {
        prompts,
        add_special_tokens: req.add_special_tokens.unwrap_or(true),
        truncate_prompt_tokens,
        n,
        best_of,
        sampling,
        stopping,
        echo_only,
        echo,
        logprobs,
        prompt_logprobs,
        beam_search,
        return_token_ids: req.return_token_ids.unwrap_or(false),
        return_tokens_as_token_ids: req.return_tokens_as_token_ids.unwrap_or(false),
        stream: stream_options,
        request_id: req.request_id,
        user: req.user,
        extras,
        constraint,
        priority,
    })
}

/// A completion's prompts: one string, or a list of strings, of token ids (one prompt) or of
/// lists of token ids, never mixed, none empty, every id inside the vocabulary, at most
/// `limits.max_prompts` of them.
fn prompts(prompt: PromptField, limits: &Limits) -> Result<Vec<PromptInput>, ApiError> {
    let empty = |param: String| ApiError::bad(param, "A prompt must not be empty.");
    let items = match prompt {
        PromptField::Text(text) if text.is_empty() => return Err(empty("prompt".to_owned())),
        PromptField::Text(text) => return Ok(vec![PromptInput::Text(text)]),
        PromptField::List(items) if items.is_empty() => {
            return Err(ApiError::bad(
                "prompt",
                "`prompt` must not be an empty list.",
            ))
        }
        PromptField::List(items) => items,
    };
    let kind = |item: &PromptItem| match item {
        PromptItem::Text(_) => "strings",
        PromptItem::Id(_) => "token ids",
        PromptItem::Ids(_) => "lists of token ids",
    };
    if let Some(i) = items.iter().position(|it| kind(it) != kind(&items[0])) {
        return Err(ApiError::bad(
            format!("prompt[{i}]"),
            format!(
                "`prompt` mixes {} and {}: send a string, a list of strings, a list of token ids \
                 or a list of lists of token ids.",
                kind(&items[0]),
                kind(&items[i])
            ),
        ));
    }
    let in_vocab = |param: String, id: i64| {
        u32::try_from(id)
            .ok()
            .filter(|&t| (t as usize) < limits.vocab_size)
            .ok_or_else(|| {
                ApiError::bad(
                    param,
                    format!(
                        "Token id {id} is outside the vocabulary (size {}).",
                        limits.vocab_size
                    ),
                )
            })
    };
    let prompts: Vec<PromptInput> = if matches!(items[0], PromptItem::Id(_)) {
        let ids = items
            .iter()
            .enumerate()
            .map(|(i, item)| match item {
                PromptItem::Id(id) => in_vocab(format!("prompt[{i}]"), *id),
                _ => unreachable!("checked above: all token ids"),
            })
            .collect::<Result<_, _>>()?;
        vec![PromptInput::Tokens(ids)]
    } else {
        items
            .into_iter()
            .enumerate()
            .map(|(i, item)| match item {
                PromptItem::Text(text) if text.is_empty() => Err(empty(format!("prompt[{i}]"))),
                PromptItem::Text(text) => Ok(PromptInput::Text(text)),
                PromptItem::Ids(ids) if ids.is_empty() => Err(empty(format!("prompt[{i}]"))),
                PromptItem::Ids(ids) => ids
                    .iter()
                    .enumerate()
                    .map(|(j, &id)| in_vocab(format!("prompt[{i}][{j}]"), id))
                    .collect::<Result<_, _>>()
                    .map(PromptInput::Tokens),
                PromptItem::Id(_) => unreachable!("checked above: no token ids"),
            })
            .collect::<Result<_, _>>()?
    };
    if prompts.len() > limits.max_prompts {
        return Err(ApiError::bad(
            "prompt",
            format!(
                "At most {} prompts per request on this server (its `--max-waiting`), got {}.",
                limits.max_prompts,
                prompts.len()
            ),
        ));
    }
    Ok(prompts)
}

/// `priority` other than 0 only under priority scheduling.
fn priority(priority: Option<i64>, limits: &Limits) -> Result<i64, ApiError> {
    let priority = priority.unwrap_or(0);
    if priority != 0 && !limits.priority_scheduling {
        return Err(ApiError::bad(
            "priority",
            "`priority` other than 0 needs priority scheduling (`temper serve --scheduling priority`), which this model is not served with.",
        ));
    }
    Ok(priority)
}

/// `Some` when streaming; `stream_options` only with `stream: true`.
fn stream_options(
    stream: Option<bool>,
    options: Option<&StreamOptionsField>,
) -> Result<Option<StreamOptions>, ApiError> {
    match (options, stream.unwrap_or(false)) {
        (Some(_), false) => Err(ApiError::bad(
            "stream_options",
            "`stream_options` can only be set when `stream` is true.",
        )),
        (Some(o), true) => {
            let include_usage = o.include_usage.unwrap_or(false);
            Ok(Some(StreamOptions {
                include_usage,
                continuous_usage_stats: include_usage && o.continuous_usage_stats.unwrap_or(false),
            }))
        }
        (None, true) => Ok(Some(StreamOptions::default())),
        (None, false) => Ok(None),
    }
}

/// `n` (or `best_of`): 1 to the server's `--max-n`.
fn choice_count(param: &str, n: Option<i64>, limits: &Limits) -> Result<usize, ApiError> {
    match n {
        None => Ok(1),
        Some(n) if n < 1 => Err(ApiError::bad(
            param,
            format!("`{param}` must be at least 1."),
        )),
        Some(n) if n as u64 > limits.max_n as u64 => Err(ApiError::bad(
            param,
            format!("`{param}` must be at most {} on this server.", limits.max_n),
        )),
        Some(n) => Ok(n as usize),
    }
}

/// `use_beam_search` with its `length_penalty`, which means nothing without it.
fn beam_search(
    use_beam_search: Option<bool>,
    length_penalty: Option<f64>,
) -> Result<Option<BeamSearch>, ApiError> {
    let use_beam_search = use_beam_search.unwrap_or(false);
    let length_penalty = length_penalty.unwrap_or(1.0);
    if !length_penalty.is_finite() {
        return Err(ApiError::bad(
            "length_penalty",
            "`length_penalty` must be a finite number.",
        ));
    }
    if length_penalty != 1.0 && !use_beam_search {
        return Err(ApiError::bad(
            "length_penalty",
            "`length_penalty` only applies to beam search (`use_beam_search: true`).",
        ));
    }
    Ok(use_beam_search.then_some(BeamSearch {
        length_penalty: length_penalty as f32,
    }))
}

/// More than one choice of a prompt needs sampling: greedy choices would all be the same.
fn greedy_choices(
    param: &str,
    choices: usize,
    sampling: &SamplingParams,
    beam_search: bool,
) -> Result<(), ApiError> {
    if choices > 1 && f64::from(sampling.temperature) < GREEDY_EPSILON && !beam_search {
        return Err(ApiError::bad(
            param,
            format!(
                "`{param}` > 1 needs temperature > 0 (or `use_beam_search`): greedy sampling \
                 would return identical choices."
            ),
        ));
    }
    Ok(())
}

/// Beam search ranks beams by the model's raw log-probabilities: none of these could have an
/// effect, so they are refused rather than ignored. Temperature 0 (deterministic) and 1
/// (unscaled) both describe what it does; any other would promise a rescaling.
fn beam_search_conflicts(
    s: &SamplingParams,
    t: &StopParams,
    constraint: Option<&RequestedConstraint>,
) -> Result<(), ApiError> {
    let conflicts = [
        ("temperature", s.temperature != 0.0 && s.temperature != 1.0),
        ("top_p", s.top_p != 1.0),
        ("top_k", s.top_k != 0),
        ("min_p", s.min_p != 0.0),
        ("seed", s.seed.is_some()),
        ("logit_bias", !s.logit_bias.is_empty()),
        ("allowed_token_ids", s.allowed_token_ids.is_some()),
        ("bad_words", !s.bad_words.is_empty()),
        ("repetition_penalty", s.repetition_penalty != 1.0),
        ("frequency_penalty", s.frequency_penalty != 0.0),
        ("presence_penalty", s.presence_penalty != 0.0),
        ("min_tokens", t.min_tokens != 0),
        ("repetition_detection", t.repetition_detection.is_some()),
        ("stop", !t.stop.is_empty()),
        ("stop_token_ids", !t.stop_token_ids.is_empty()),
    ];
    let conflict = conflicts
        .iter()
        .find(|(_, set)| *set)
        .map(|(param, _)| *param)
        .or(constraint.map(|c| c.param));
    match conflict {
        Some(param) => Err(ApiError::bad(
            param,
            format!(
                "`{param}` cannot be combined with `use_beam_search`: beam search ranks beams \
                 by the model's raw log-probabilities."
            ),
        )),
        None => Ok(()),
    }
}

/// `prompt_logprobs`: the same bounds as the generated tokens' alternatives; not streamed.
fn prompt_logprobs(
    k: Option<i64>,
    stream: bool,
    limits: &Limits,
) -> Result<Option<usize>, ApiError> {
    let prompt_logprobs = k
        .map(|k| logprob_count("prompt_logprobs", k, limits))
        .transpose()?;
    if prompt_logprobs.is_some() && stream {
        return Err(ApiError::bad(
            "prompt_logprobs",
            "`prompt_logprobs` is not available when streaming.",
        ));
    }
    Ok(prompt_logprobs)
}

/// It goes into log lines and the completion id: control characters (a newline forging a log
/// line) and unbounded lengths are refused.
fn request_id(id: Option<&str>) -> Result<(), ApiError> {
    match id {
        Some(id)
            if id.is_empty()
                || id.chars().count() > MAX_REQUEST_ID_CHARS
                || id.chars().any(char::is_control) =>
        {
            Err(ApiError::bad(
                "request_id",
                format!(
                    "`request_id` must be 1 to {MAX_REQUEST_ID_CHARS} characters without control \
                     characters."
                ),
            ))
        }
        _ => Ok(()),
    }
}

/// How many top alternatives `param` asks for: -1 is the whole vocabulary; at most the
/// server's max either way.
fn logprob_count(param: &str, k: i64, limits: &Limits) -> Result<usize, ApiError> {
    let count = match k {
        -1 => limits.vocab_size,
        k if k < 0 => {
            return Err(ApiError::bad(
                param,
                format!("`{param}` must be -1 (whole vocabulary) or >= 0, got {k}."),
            ))
        }
        k => usize::try_from(k).unwrap_or(usize::MAX),
    };
    match limits.max_logprobs {
        Some(max) if count > max => Err(ApiError::bad(
            param,
            format!("`{param}` must be at most {max} on this server."),
        )),
        _ => Ok(count.min(limits.vocab_size)),
    }
}

fn positive_tokens(param: &str, value: i64) -> Result<usize, ApiError> {
    if value < 1 {
        return Err(ApiError::bad(
            param,
            format!("`{param}` must be at least 1, got {value}."),
        ));
    }
    Ok(usize::try_from(value).unwrap_or(usize::MAX))
}

/// A request template is honoured only when the operator allowed it: templates run code-like
/// logic over the prompt, so an untrusted one could change what the model is told.
pub fn request_template(
    template: Option<String>,
    limits: &Limits,
) -> Result<Option<String>, ApiError> {
    match template {
        Some(_) if !limits.trust_request_chat_template => Err(ApiError::bad(
            "chat_template",
            "This server does not accept request chat templates (start it with \
             --trust-request-chat-template).",
        )),
        other => Ok(other),
    }
}

/// Request messages → template messages. Only text content is accepted: the served models are
/// text-only.
pub fn convert_messages(messages: &[RequestMessage]) -> Result<Vec<ChatMessage>, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::bad("messages", "`messages` must not be empty."));
    }
    messages
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let content = match &m.content {
                None => None,
                Some(MessageContentField::Text(t)) => Some(MessageContent::Text(t.clone())),
                Some(MessageContentField::Parts(parts)) => {
                    let parts = parts
                        .iter()
                        .enumerate()
                        .map(|(j, p)| match (p.r#type.as_str(), &p.text) {
                            ("text", Some(text)) => Ok(ContentPart::Text { text: text.clone() }),
                            ("text", None) => Err(ApiError::bad(
                                format!("messages[{i}].content[{j}].text"),
                                "A text content part needs `text`.",
                            )),
                            (other, _) => Err(ApiError::bad(
                                format!("messages[{i}].content[{j}].type"),
                                format!(
                                    "Content parts of type `{other}` are not supported: the \
                                     model is text-only."
                                ),
                            )),
                        })
                        .collect::<Result<Vec<_>, _>>()?;
                    Some(MessageContent::Parts(parts))
                }
            };
            Ok(ChatMessage {
                role: m.role.clone(),
                content,
                name: m.name.clone(),
                tool_calls: m.tool_calls.as_ref().map(|calls| {
                    calls
                        .iter()
                        .map(|c| ToolCall {
                            id: c.id.clone(),
                            r#type: c.r#type.clone(),
                            function: FunctionCall {
                                name: c.function.name.clone(),
                                arguments: c.function.arguments.clone(),
                            },
                        })
                        .collect()
                }),
                tool_call_id: m.tool_call_id.clone(),
                reasoning: m.reasoning.clone(),
            })
        })
        .collect()
}

#[cfg(test)]
pub(crate) mod tests {
    use serde_json::{json, Value};

    use super::*;

    const LIMITS: Limits = Limits {
        vocab_size: 1000,
        max_logprobs: Some(20),
        max_n: 8,
        trust_request_chat_template: false,
        max_model_len: 100,
        priority_scheduling: false,
        tool_calls: None,
        max_prompts: 4,
    };

    fn request(extra: Value) -> ChatCompletionRequest {
        let mut body = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        serde_json::from_value(body).unwrap()
    }

    /// A chat request of one user message with `extra`'s fields, validated.
    pub(crate) fn ok(extra: Value) -> ChatParams {
        validate_chat(request(extra), &LIMITS).unwrap()
    }

    fn rejected(extra: Value, param: &str) {
        rejected_with(extra, &LIMITS, param)
    }

    fn rejected_with(extra: Value, limits: &Limits, param: &str) {
        match validate_chat(request(extra.clone()), limits) {
            Ok(_) => panic!("{extra} was accepted"),
            Err(e) => {
                assert_eq!(e.status().as_u16(), 400, "{extra}");
                let v = serde_json::to_value(e.envelope()).unwrap();
                assert_eq!(v["error"]["param"], param, "{extra}: {v}");
            }
        }
    }

    #[test]
    fn empty_bad_words_are_refused_by_index() {
        rejected(json!({"bad_words": [""]}), "bad_words[0]");
        rejected(json!({"bad_words": ["x", ""]}), "bad_words[1]");
        ok(json!({"bad_words": ["x", " y"]}));
    }

    #[test]
    fn defaults() {
        let p = ok(json!({}));
        assert_eq!(p.n, 1);
        // temperature 1, top_p 1, top_k 0 (off), min_p 0, no seed, no logits processors.
        assert_eq!(p.sampling, SamplingParams::default());
        assert_eq!(p.stopping.max_tokens, None);
        assert_eq!(p.logprobs, None);
        assert!(p.stream.is_none());
        assert!(p.prompt.add_generation_prompt);
        assert!(!p.prompt.continue_final_message);
        assert!(p.stopping.skip_special_tokens && p.stopping.spaces_between_special_tokens);
        assert!(!p.stopping.ignore_eos && !p.stopping.include_stop_str_in_output);
    }

    #[test]
    fn stream_options_need_stream() {
        rejected(
            json!({"stream_options": {"include_usage": true}}),
            "stream_options",
        );
        rejected(
            json!({"stream": false, "stream_options": {"include_usage": true}}),
            "stream_options",
        );
        let p = ok(
            json!({"stream": true, "stream_options": {"include_usage": true, "continuous_usage_stats": true}}),
        );
        assert_eq!(
            p.stream,
            Some(StreamOptions {
                include_usage: true,
                continuous_usage_stats: true
            })
        );
        // continuous_usage_stats only counts together with include_usage.
        let p = ok(json!({"stream": true, "stream_options": {"continuous_usage_stats": true}}));
        assert_eq!(p.stream, Some(StreamOptions::default()));
    }

    #[test]
    fn logprobs_rules() {
        rejected(json!({"top_logprobs": 3}), "top_logprobs");
        rejected(
            json!({"logprobs": false, "top_logprobs": 3}),
            "top_logprobs",
        );
        rejected(
            json!({"logprobs": true, "top_logprobs": 21}),
            "top_logprobs",
        );
        rejected(
            json!({"logprobs": true, "top_logprobs": -2}),
            "top_logprobs",
        );
        // -1 = whole vocabulary: above the default server max of 20.
        rejected(
            json!({"logprobs": true, "top_logprobs": -1}),
            "top_logprobs",
        );
        let unlimited = Limits {
            max_logprobs: None,
            ..LIMITS
        };
        let p = validate_chat(
            request(json!({"logprobs": true, "top_logprobs": -1})),
            &unlimited,
        )
        .unwrap();
        assert_eq!(p.logprobs, Some(1000));
        assert_eq!(ok(json!({"logprobs": true})).logprobs, Some(0));
        assert_eq!(
            ok(json!({"logprobs": true, "top_logprobs": 5})).logprobs,
            Some(5)
        );
        assert_eq!(ok(json!({"top_logprobs": 0})).logprobs, None);
    }

    #[test]
    fn prompt_logprobs_rules() {
        rejected(json!({"prompt_logprobs": -2}), "prompt_logprobs");
        rejected(json!({"prompt_logprobs": 21}), "prompt_logprobs");
        // -1 = whole vocabulary: above the default server max of 20.
        rejected(json!({"prompt_logprobs": -1}), "prompt_logprobs");
        rejected(
            json!({"prompt_logprobs": 1, "stream": true}),
            "prompt_logprobs",
        );
        let unlimited = Limits {
            max_logprobs: None,
            ..LIMITS
        };
        let p = validate_chat(request(json!({"prompt_logprobs": -1})), &unlimited).unwrap();
        assert_eq!(p.prompt_logprobs, Some(1000));
        assert_eq!(ok(json!({"prompt_logprobs": 0})).prompt_logprobs, Some(0));
        assert_eq!(ok(json!({"prompt_logprobs": 20})).prompt_logprobs, Some(20));
        assert_eq!(ok(json!({})).prompt_logprobs, None);
    }

    #[test]
    fn prompt_flags() {
        let assistant_last =
            json!([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]);
        rejected(
            json!({"messages": assistant_last, "continue_final_message": true}),
            "continue_final_message",
        );
        rejected(
            json!({"continue_final_message": true, "add_generation_prompt": false}),
            "continue_final_message",
        );
        let p = ok(
            json!({"messages": assistant_last, "continue_final_message": true, "add_generation_prompt": false}),
        );
        assert!(p.prompt.continue_final_message && !p.prompt.add_generation_prompt);
        rejected(json!({"chat_template": "{{ 'x' }}"}), "chat_template");
        let trusted = Limits {
            trust_request_chat_template: true,
            ..LIMITS
        };
        let p = validate_chat(request(json!({"chat_template": "{{ 'x' }}"})), &trusted).unwrap();
        assert_eq!(p.prompt.chat_template.as_deref(), Some("{{ 'x' }}"));
        let p = ok(json!({"chat_template_kwargs": {"a": 1}, "add_special_tokens": true}));
        assert_eq!(p.prompt.chat_template_kwargs["a"], 1);
        assert!(p.prompt.add_special_tokens);
    }

    #[test]
    fn messages() {
        rejected(json!({"messages": []}), "messages");
        rejected(
            json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}),
            "messages[0].content[0].type",
        );
        rejected(
            json!({"messages": [{"role": "user", "content": [{"type": "text"}]}]}),
            "messages[0].content[0].text",
        );
        let p = ok(json!({"messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        ]}));
        assert_eq!(p.prompt.messages.len(), 3);
        assert!(matches!(
            &p.prompt.messages[1].content,
            Some(MessageContent::Parts(parts)) if parts.len() == 2
        ));
        assert_eq!(
            p.prompt.messages[2].tool_calls.as_ref().unwrap()[0]
                .function
                .name,
            "f"
        );
    }

    #[test]
    fn priority_needs_priority_scheduling() {
        rejected(json!({"priority": 1}), "priority");
        ok(json!({"priority": 0}));
        let priority = Limits {
            priority_scheduling: true,
            ..LIMITS
        };
        let p = validate_chat(request(json!({"priority": -3})), &priority).unwrap();
        assert_eq!(p.priority, -3);
    }

    const TOOLS: Limits = Limits {
        tool_calls: Some(ToolCallFormat::Hermes),
        ..LIMITS
    };

    fn weather_tools() -> Value {
        json!([
            {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
                "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
            {"type": "function", "function": {"name": "get_time"}},
        ])
    }

    fn with_tools(extra: Value) -> Value {
        let mut body = json!({"tools": weather_tools()});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        body
    }

    fn tool_params(extra: Value) -> ChatParams {
        validate_chat(request(with_tools(extra)), &TOOLS).unwrap()
    }

    fn called_functions(p: &ChatParams) -> (Vec<String>, bool) {
        match &p.constraint {
            Some(RequestedConstraint {
                param: "tools",
                constraint:
                    temper_engine::OutputConstraint::ToolCalls {
                        functions,
                        parallel,
                        ..
                    },
            }) => (
                functions.iter().map(|f| f.name.clone()).collect(),
                *parallel,
            ),
            other => panic!("not a tool-call constraint: {other:?}"),
        }
    }

    #[test]
    fn tool_choice_without_the_flag_is_none_only() {
        for choice in [
            json!("auto"),
            json!("required"),
            json!({"type": "function", "function": {"name": "get_weather"}}),
        ] {
            let body = with_tools(json!({"tool_choice": choice}));
            match validate_chat(request(body), &LIMITS) {
                Err(e) => {
                    let v = serde_json::to_value(e.envelope()).unwrap();
                    assert_eq!(v["error"]["param"], "tool_choice");
                    assert!(v["error"]["message"]
                        .as_str()
                        .unwrap()
                        .contains("--enable-tool-calls"));
                }
                Ok(_) => panic!("{choice} accepted without the flag"),
            }
        }
        for extra in [json!({"tool_choice": "none"}), json!({})] {
            let p = validate_chat(request(with_tools(extra)), &LIMITS).unwrap();
            assert!(p.tool_parser.is_none() && p.constraint.is_none());
            // The tools still reach the template.
            assert_eq!(p.prompt.tools.unwrap().len(), 2);
        }
    }

    #[test]
    fn tool_choice_forms_with_the_flag() {
        // "none": tools in the prompt, output left alone.
        let p = tool_params(json!({"tool_choice": "none"}));
        assert!(p.tool_parser.is_none() && p.constraint.is_none());
        // "auto" (also the default with tools): parsed, not constrained.
        for extra in [
            json!({"tool_choice": "auto"}),
            json!({}),
            json!({"tool_choice": null}),
        ] {
            let p = tool_params(extra);
            assert!(p.tool_parser.is_some() && p.constraint.is_none());
        }
        // Without tools nothing is parsed by default.
        let p = validate_chat(request(json!({})), &TOOLS).unwrap();
        assert!(p.tool_parser.is_none());
        // "required": calls of every tool, parallel unless turned off.
        let p = tool_params(json!({"tool_choice": "required"}));
        assert!(p.tool_parser.is_some());
        assert_eq!(
            called_functions(&p),
            (vec!["get_weather".to_owned(), "get_time".to_owned()], true)
        );
        let p = tool_params(json!({"tool_choice": "required", "parallel_tool_calls": false}));
        assert!(!called_functions(&p).1);
        // A named function: only that one.
        let p = tool_params(
            json!({"tool_choice": {"type": "function", "function": {"name": "get_time"}}}),
        );
        assert_eq!(called_functions(&p), (vec!["get_time".to_owned()], true));
        // A function without `parameters` takes no arguments.
        let Some(RequestedConstraint {
            constraint: temper_engine::OutputConstraint::ToolCalls { functions, .. },
            ..
        }) = &p.constraint
        else {
            unreachable!()
        };
        assert_eq!(
            functions[0].parameters,
            json!({"type": "object", "properties": {}, "additionalProperties": false})
        );
    }

    #[test]
    fn bad_tool_choices_name_the_field() {
        let bad = |extra: Value, param: &str| rejected_with(with_tools(extra), &TOOLS, param);
        bad(json!({"tool_choice": "any"}), "tool_choice");
        bad(json!({"tool_choice": 3}), "tool_choice");
        bad(
            json!({"tool_choice": {"type": "function", "function": {"name": "nope"}}}),
            "tool_choice",
        );
        bad(
            json!({"tool_choice": {"type": "retrieval", "function": {"name": "get_time"}}}),
            "tool_choice",
        );
        bad(json!({"tool_choice": {"type": "function"}}), "tool_choice");
        // Calls cannot also be JSON of another schema.
        bad(
            json!({"tool_choice": "required", "response_format": {"type": "json_object"}}),
            "tool_choice",
        );
        // Nor ranked by beam search.
        bad(
            json!({"tool_choice": "required", "use_beam_search": true, "n": 2, "temperature": 0}),
            "tools",
        );
        // Choices other than "none" need tools; bad tool schemas are the tools' fault.
        rejected_with(json!({"tool_choice": "required"}), &TOOLS, "tool_choice");
        rejected_with(
            json!({"tool_choice": "required", "tools": [{"type": "function",
                "function": {"name": "f", "parameters": "object"}}]}),
            &TOOLS,
            "tools[0].function.parameters",
        );
        // "auto" with response_format is allowed: the output is parsed, not constrained twice.
        let p =
            tool_params(json!({"tool_choice": "auto", "response_format": {"type": "json_object"}}));
        assert!(p.tool_parser.is_some() && p.constraint.is_some());
    }

    #[test]
    fn sampling_ranges() {
        rejected(json!({"n": 0}), "n");
        rejected(json!({"n": 9}), "n");
        rejected(json!({"n": 2, "temperature": 0}), "n");
        assert_eq!(ok(json!({"n": 3})).n, 3);
        rejected(json!({"temperature": -0.1}), "temperature");
        rejected(json!({"temperature": 2.01}), "temperature");
        rejected(json!({"top_p": 0}), "top_p");
        rejected(json!({"top_p": 1.5}), "top_p");
        rejected(json!({"top_k": -2}), "top_k");
        assert_eq!(ok(json!({"top_k": -1})).sampling.top_k, 0);
        assert_eq!(ok(json!({"top_k": 7})).sampling.top_k, 7);
        rejected(json!({"min_p": -0.5}), "min_p");
        rejected(json!({"min_p": 1.5}), "min_p");
        let p = ok(json!({"temperature": 0, "top_p": 0.5, "min_p": 0.1}));
        assert_eq!(p.sampling.temperature, 0.0);
        assert_eq!(p.sampling.top_p, 0.5);
        assert_eq!(p.sampling.min_p, 0.1);
    }

    #[test]
    fn seed() {
        assert_eq!(ok(json!({"seed": -1})).sampling.seed, None);
        assert_eq!(ok(json!({"seed": 42})).sampling.seed, Some(42));
        assert_eq!(ok(json!({"seed": -5})).sampling.seed, Some((-5i64) as u64));
    }

    #[test]
    fn max_tokens() {
        rejected(json!({"max_tokens": 0}), "max_tokens");
        rejected(json!({"max_completion_tokens": 0}), "max_completion_tokens");
        rejected(
            json!({"max_completion_tokens": -3, "max_tokens": 5}),
            "max_completion_tokens",
        );
        assert_eq!(ok(json!({"max_tokens": 7})).stopping.max_tokens, Some(7));
        assert_eq!(
            ok(json!({"max_tokens": 7, "max_completion_tokens": 3}))
                .stopping
                .max_tokens,
            Some(3)
        );
    }

    #[test]
    fn stops() {
        rejected(json!({"stop": ""}), "stop");
        rejected(json!({"stop": ["a", ""]}), "stop");
        assert_eq!(ok(json!({"stop": "x"})).stopping.stop, vec!["x"]);
        assert_eq!(
            ok(json!({"stop": ["x", "yz"]})).stopping.stop,
            vec!["x", "yz"]
        );
        rejected(json!({"stop_token_ids": [1000]}), "stop_token_ids");
        rejected(json!({"stop_token_ids": [-1]}), "stop_token_ids");
        assert_eq!(
            ok(json!({"stop_token_ids": [1, 999]}))
                .stopping
                .stop_token_ids,
            vec![1, 999]
        );
        let p = ok(
            json!({"ignore_eos": true, "include_stop_str_in_output": true, "skip_special_tokens": false, "spaces_between_special_tokens": false}),
        );
        assert!(p.stopping.ignore_eos && p.stopping.include_stop_str_in_output);
        assert!(!p.stopping.skip_special_tokens && !p.stopping.spaces_between_special_tokens);
    }

    #[test]
    fn request_id() {
        rejected(json!({"request_id": ""}), "request_id");
        rejected(json!({"request_id": "a\nINFO forged line"}), "request_id");
        rejected(json!({"request_id": "x".repeat(257)}), "request_id");
        ok(json!({"request_id": "x".repeat(256)}));
        assert_eq!(
            ok(json!({"request_id": "abc"})).request_id.as_deref(),
            Some("abc")
        );
    }

    #[test]
    fn beam_search_rules() {
        let p =
            ok(json!({"use_beam_search": true, "n": 3, "temperature": 0, "length_penalty": 0.5}));
        assert_eq!(p.n, 3);
        assert_eq!(
            p.beam_search,
            Some(BeamSearch {
                length_penalty: 0.5
            })
        );
        assert_eq!(ok(json!({})).beam_search, None);
        // length_penalty means nothing without beam search; its default is fine.
        rejected(json!({"length_penalty": 0.5}), "length_penalty");
        ok(json!({"length_penalty": 1, "use_beam_search": false}));
        // Fields beam search cannot honour are refused, each by name.
        for (extra, param) in [
            (json!({"temperature": 0.7}), "temperature"),
            (json!({"top_p": 0.5}), "top_p"),
            (json!({"top_k": 5}), "top_k"),
            (json!({"min_p": 0.1}), "min_p"),
            (json!({"seed": 1}), "seed"),
            (json!({"logit_bias": {"5": 1}}), "logit_bias"),
            (json!({"allowed_token_ids": [5]}), "allowed_token_ids"),
            (json!({"bad_words": ["x"]}), "bad_words"),
            (json!({"repetition_penalty": 1.2}), "repetition_penalty"),
            (json!({"frequency_penalty": 0.5}), "frequency_penalty"),
            (json!({"presence_penalty": 0.5}), "presence_penalty"),
            (json!({"min_tokens": 2}), "min_tokens"),
            (json!({"stop": "x"}), "stop"),
            (json!({"stop_token_ids": [5]}), "stop_token_ids"),
            (
                json!({"structured_outputs": {"regex": "a+"}}),
                "structured_outputs.regex",
            ),
        ] {
            let mut extra = extra;
            extra["use_beam_search"] = json!(true);
            rejected(extra, param);
        }
        // What it does combine with.
        ok(
            json!({"use_beam_search": true, "n": 2, "temperature": 1, "max_tokens": 5,
                  "ignore_eos": true, "include_stop_str_in_output": true, "logprobs": true,
                  "top_logprobs": 2, "prompt_logprobs": 1, "stream": false}),
        );
    }

    /// The extension and prompt fields of `extras`, through the one validation step.
    mod extras_fields {
        use super::*;
        use crate::protocol::ServiceTier;

        fn validate(extra: Value) -> Result<ChatParams, ApiError> {
            validate_chat(request(extra), &LIMITS)
        }

        fn param(extra: Value) -> String {
            let e = validate(extra.clone()).expect_err(&extra.to_string());
            serde_json::to_value(e.envelope()).unwrap()["error"]["param"]
                .as_str()
                .unwrap()
                .to_owned()
        }

        #[test]
        fn prompt_fields_become_typed() {
            let p = validate(json!({
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
                "documents": [{"title": "t", "text": "x"}],
                "reasoning_effort": "medium",
            }))
            .unwrap();
            assert_eq!(p.prompt.tools.as_ref().unwrap()[0].function.name, "f");
            assert_eq!(p.prompt.documents.as_ref().unwrap()[0]["text"], "x");
            assert_eq!(p.prompt.reasoning_effort, Some(ReasoningEffort::Medium));
            let p = validate(json!({})).unwrap();
            assert!(p.prompt.tools.is_none() && p.prompt.documents.is_none());
            assert_eq!(p.prompt.reasoning_effort, None);
            assert_eq!(param(json!({"tools": []})), "tools");
            assert_eq!(
                param(json!({"reasoning_effort": "none"})),
                "reasoning_effort"
            );
            assert_eq!(
                param(json!({"documents": [{"text": ["x"]}]})),
                "documents[0].text"
            );
        }

        #[test]
        fn truncation_and_echo() {
            assert_eq!(validate(json!({})).unwrap().truncate_prompt_tokens, None);
            let p = validate(json!({"truncate_prompt_tokens": -1})).unwrap();
            assert_eq!(p.truncate_prompt_tokens, Some(100));
            let p = validate(json!({"truncate_prompt_tokens": 100})).unwrap();
            assert_eq!(p.truncate_prompt_tokens, Some(100));
            for k in [101, 0, -2] {
                assert_eq!(
                    param(json!({"truncate_prompt_tokens": k})),
                    "truncate_prompt_tokens"
                );
            }
            let prefill = json!([{"role": "user", "content": "hi"}, {"role": "assistant", "content": [{"type": "text", "text": "He"}, {"type": "text", "text": "l"}]}]);
            let p = validate(json!({"messages": prefill, "echo": true,
                "continue_final_message": true, "add_generation_prompt": false}))
            .unwrap();
            assert_eq!(p.echo.as_deref(), Some("Hel"));
            assert_eq!(
                validate(json!({"messages": prefill, "add_generation_prompt": false}))
                    .unwrap()
                    .echo,
                None
            );
            assert_eq!(validate(json!({"echo": true})).unwrap().echo, None);
        }

        #[test]
        fn extension_fields() {
            let p = validate(json!({
                "cache_salt": "s", "kv_transfer_params": {"a": {"b": 1}},
                "engine_xargs": {"s": "x", "n": 1.5, "l": ["a", 2]},
                "service_tier": "priority", "parallel_tool_calls": false,
                "mm_processor_kwargs": {}, "include_reasoning": false,
            }))
            .unwrap();
            assert_eq!(p.extras.cache_salt.as_deref(), Some("s"));
            assert_eq!(p.extras.kv_transfer_params.unwrap()["a"]["b"], 1);
            assert_eq!(p.extras.engine_xargs["l"], json!(["a", 2]));
            assert_eq!(p.extras.service_tier, Some(ServiceTier::Priority));
            assert!(!p.extras.parallel_tool_calls && !p.include_reasoning);
            let d = validate(json!({})).unwrap();
            assert_eq!(
                d.extras,
                RequestExtras {
                    parallel_tool_calls: true,
                    ..RequestExtras::default()
                }
            );
            assert!(d.include_reasoning);
            assert_eq!(param(json!({"cache_salt": ""})), "cache_salt");
            assert_eq!(
                param(json!({"engine_xargs": {"x": null}})),
                "engine_xargs.x"
            );
            assert_eq!(
                param(json!({"engine_xargs": {"x": [[1]]}})),
                "engine_xargs.x"
            );
            assert_eq!(
                param(json!({"engine_xargs": {"x": false}})),
                "engine_xargs.x"
            );
            assert_eq!(
                param(json!({"mm_processor_kwargs": {"a": 1}})),
                "mm_processor_kwargs"
            );
            assert_eq!(param(json!({"service_tier": "fast"})), "service_tier");
        }
    }

    /// `validate_completion`: the prompt forms, the completion-only fields, and the fields it
    /// shares with chat refused by the same functions.
    mod completion {
        use super::*;
        use crate::extract::parse_json;

        fn body(extra: Value) -> Value {
            let mut body = json!({"prompt": "hi"});
            for (k, v) in extra.as_object().unwrap() {
                body[k] = v.clone();
            }
            body
        }

        fn validate(extra: Value) -> Result<CompletionParams, ApiError> {
            let req: CompletionRequest = parse_json(body(extra).to_string().as_bytes())?;
            validate_completion(req, &LIMITS)
        }

        fn ok(extra: Value) -> CompletionParams {
            validate(extra.clone()).unwrap_or_else(|e| panic!("{extra}: {e}"))
        }

        fn param(extra: Value) -> String {
            let e = validate(extra.clone())
                .err()
                .unwrap_or_else(|| panic!("{extra} was accepted"));
            assert_eq!(e.status().as_u16(), 400, "{extra}");
            serde_json::to_value(e.envelope()).unwrap()["error"]["param"]
                .as_str()
                .unwrap_or("")
                .to_owned()
        }

        #[test]
        fn defaults() {
            let p = ok(json!({}));
            assert_eq!(p.prompts, vec![PromptInput::Text("hi".into())]);
            assert!(p.add_special_tokens);
            assert_eq!((p.n, p.best_of), (1, 1));
            assert_eq!(p.sampling, SamplingParams::default());
            // None: the default of 16 (or less, when the context has less room), per prompt.
            assert_eq!(p.stopping.max_tokens, None);
            assert!(!p.echo && !p.echo_only);
            assert_eq!((p.logprobs, p.prompt_logprobs), (None, None));
            assert!(p.stream.is_none() && p.beam_search.is_none() && p.constraint.is_none());
            assert!(!p.return_token_ids && !p.return_tokens_as_token_ids);
        }

        #[test]
        fn prompt_forms() {
            let text = |t: &str| PromptInput::Text(t.into());
            assert_eq!(
                ok(json!({"prompt": ["a", "b"]})).prompts,
                [text("a"), text("b")]
            );
            assert_eq!(
                ok(json!({"prompt": [5, 6, 999]})).prompts,
                [PromptInput::Tokens(vec![5, 6, 999])]
            );
            assert_eq!(
                ok(json!({"prompt": [[5], [6, 7]]})).prompts,
                [
                    PromptInput::Tokens(vec![5]),
                    PromptInput::Tokens(vec![6, 7])
                ]
            );
            assert_eq!(param(json!({"prompt": ""})), "prompt");
            assert_eq!(param(json!({"prompt": []})), "prompt");
            assert_eq!(param(json!({"prompt": ["a", ""]})), "prompt[1]");
            assert_eq!(param(json!({"prompt": [[5], []]})), "prompt[1]");
            // Never mixed: the first item of another kind is named.
            assert_eq!(param(json!({"prompt": ["a", "b", 5]})), "prompt[2]");
            assert_eq!(param(json!({"prompt": [5, [6]]})), "prompt[1]");
            assert_eq!(param(json!({"prompt": [[5], "a"]})), "prompt[1]");
            // Inside the vocabulary (1000 tokens here).
            assert_eq!(param(json!({"prompt": [5, 1000]})), "prompt[1]");
            assert_eq!(param(json!({"prompt": [-1]})), "prompt[0]");
            assert_eq!(param(json!({"prompt": [[5], [6, 1000]]})), "prompt[1][1]");
            // Not a prompt at all: a parse error naming it, saying what a prompt is.
            for bad in [
                json!(true),
                json!([1.5]),
                json!(null),
                json!({"a": 1}),
                json!([[["a"]]]),
            ] {
                let e = validate(json!({"prompt": bad})).err().unwrap();
                let v = serde_json::to_value(e.envelope()).unwrap();
                assert_eq!(v["error"]["param"], "prompt", "{bad}: {v}");
                assert!(
                    v["error"]["message"]
                        .as_str()
                        .unwrap()
                        .contains("list of token ids"),
                    "{bad}: {v}"
                );
            }
            let missing: Result<CompletionRequest, _> = parse_json(b"{}");
            let v = serde_json::to_value(missing.err().unwrap().envelope()).unwrap();
            assert_eq!(v["error"]["param"], "prompt");
            // At most `max_prompts` (4 here).
            ok(json!({"prompt": vec!["a"; 4]}));
            assert_eq!(param(json!({"prompt": vec!["a"; 5]})), "prompt");
            // A list of ids is one prompt, however long.
            ok(json!({"prompt": vec![5; 50]}));
        }

        #[test]
        fn completion_only_fields() {
            assert_eq!(param(json!({"suffix": "x"})), "suffix");
            assert_eq!(param(json!({"suffix": ""})), "suffix");
            ok(json!({"suffix": null, "prompt_embeds": null}));
            assert_eq!(param(json!({"prompt_embeds": "AAAA"})), "prompt_embeds");
            assert!(!ok(json!({"add_special_tokens": false})).add_special_tokens);
            // logprobs: 0 to the server's max.
            assert_eq!(ok(json!({"logprobs": 0})).logprobs, Some(0));
            assert_eq!(ok(json!({"logprobs": 20})).logprobs, Some(20));
            for k in [21, -1] {
                assert_eq!(param(json!({"logprobs": k})), "logprobs");
            }
            assert_eq!(param(json!({"logprobs": true})), "logprobs");
            // max_tokens: 0 only with echo.
            assert_eq!(ok(json!({"max_tokens": 5})).stopping.max_tokens, Some(5));
            assert_eq!(param(json!({"max_tokens": 0})), "max_tokens");
            assert_eq!(param(json!({"max_tokens": -1})), "max_tokens");
            let p = ok(json!({"max_tokens": 0, "echo": true}));
            assert!(p.echo && p.echo_only);
            assert_eq!(p.stopping.max_tokens, Some(1));
            assert_eq!(
                param(json!({"max_tokens": 0, "echo": true, "min_tokens": 1})),
                "min_tokens"
            );
        }

        #[test]
        fn n_and_best_of() {
            let p = ok(json!({"n": 2, "best_of": 5}));
            assert_eq!((p.n, p.best_of), (2, 5));
            assert_eq!(ok(json!({"n": 3})).best_of, 3);
            assert_eq!(param(json!({"n": 3, "best_of": 2})), "best_of");
            assert_eq!(param(json!({"best_of": 9})), "best_of");
            assert_eq!(param(json!({"best_of": 0})), "best_of");
            assert_eq!(param(json!({"n": 9})), "n");
            // Above n: not streamed, not with beam search, not greedy.
            assert_eq!(param(json!({"best_of": 2, "stream": true})), "best_of");
            ok(json!({"n": 2, "best_of": 2, "stream": true}));
            assert_eq!(
                param(json!({"best_of": 2, "use_beam_search": true, "temperature": 0})),
                "best_of"
            );
            assert_eq!(param(json!({"best_of": 2, "temperature": 0})), "best_of");
            assert_eq!(param(json!({"n": 2, "temperature": 0})), "n");
            let p = ok(json!({"n": 2, "use_beam_search": true, "temperature": 0}));
            assert!(p.beam_search.is_some());
        }

        /// The shared fields are validated by the same functions as chat's: the same values
        /// are refused naming the same fields.
        #[test]
        fn shared_fields_are_refused_as_in_chat() {
            for extra in [
                json!({"temperature": 2.5}),
                json!({"top_p": 0}),
                json!({"top_k": -2}),
                json!({"min_p": 2}),
                json!({"frequency_penalty": 3}),
                json!({"repetition_penalty": 0}),
                json!({"logit_bias": {"x": 1}}),
                json!({"logit_bias": {"1000": 1}}),
                json!({"allowed_token_ids": []}),
                json!({"bad_words": ["a", ""]}),
                json!({"stop": ""}),
                json!({"stop_token_ids": [1000]}),
                json!({"min_tokens": -1}),
                json!({"repetition_detection": {"max_pattern_size": 2, "min_count": 1}}),
                json!({"stream_options": {"include_usage": true}}),
                json!({"prompt_logprobs": 21}),
                json!({"prompt_logprobs": 1, "stream": true}),
                json!({"priority": 1}),
                json!({"request_id": ""}),
                json!({"cache_salt": ""}),
                json!({"engine_xargs": {"x": null}}),
                json!({"truncate_prompt_tokens": 101}),
                json!({"length_penalty": 0.5}),
                json!({"use_beam_search": true, "temperature": 0, "seed": 1}),
                json!({"structured_outputs": {"regex": "a", "choice": ["b"]}}),
                json!({"response_format": {"type": "json_schema"}}),
            ] {
                let mut chat = json!({"messages": [{"role": "user", "content": "hi"}]});
                for (k, v) in extra.as_object().unwrap() {
                    chat[k] = v.clone();
                }
                let chat: ChatCompletionRequest = serde_json::from_value(chat).unwrap();
                let chat_param = serde_json::to_value(
                    validate_chat(chat, &LIMITS)
                        .err()
                        .unwrap_or_else(|| panic!("chat accepted {extra}"))
                        .envelope(),
                )
                .unwrap()["error"]["param"]
                    .clone();
                assert_eq!(json!(param(extra.clone())), chat_param, "{extra}");
            }
            // And accepted values become the same engine parameters.
            let extra = json!({"temperature": 0.5, "top_p": 0.9, "top_k": 7, "min_p": 0.1,
                "seed": 3, "logit_bias": {"5": 2}, "allowed_token_ids": [5, 6],
                "bad_words": ["x"], "repetition_penalty": 1.1, "frequency_penalty": 0.2,
                "presence_penalty": -0.3, "stop": ["s"], "stop_token_ids": [9],
                "ignore_eos": true, "include_stop_str_in_output": true,
                "skip_special_tokens": false, "spaces_between_special_tokens": false,
                "min_tokens": 2, "max_tokens": 6,
                "repetition_detection": {"max_pattern_size": 3, "min_count": 2}});
            let p = ok(extra.clone());
            let c = super::ok(extra);
            assert_eq!(p.sampling, c.sampling);
            assert_eq!(p.stopping, c.stopping);
        }

        #[test]
        fn extension_fields() {
            let p = ok(json!({"cache_salt": "s", "kv_transfer_params": {"a": 1},
                "engine_xargs": {"k": "v"}, "priority": 0, "request_id": "r", "user": "u",
                "return_token_ids": true, "return_tokens_as_token_ids": true,
                "truncate_prompt_tokens": -1, "prompt_logprobs": 2,
                "structured_outputs": {"regex": "a+"}}));
            assert_eq!(p.extras.cache_salt.as_deref(), Some("s"));
            assert_eq!(p.extras.kv_transfer_params.unwrap()["a"], 1);
            assert_eq!(p.extras.engine_xargs["k"], "v");
            assert_eq!(p.request_id.as_deref(), Some("r"));
            assert_eq!(p.user.as_deref(), Some("u"));
            assert!(p.return_token_ids && p.return_tokens_as_token_ids);
            assert_eq!(p.truncate_prompt_tokens, Some(100));
            assert_eq!(p.prompt_logprobs, Some(2));
            assert_eq!(p.constraint.unwrap().param, "structured_outputs.regex");
        }
    }
}
