//! `POST /v1/chat/completions`: resolve the model → validate → prepare the engine's request →
//! submit, then either one JSON response or an SSE stream of chunks.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use serde::Serialize;
use temper_engine::{FinishReason, GenerationEvent, Grammar, StopReason};
use temper_model::LoraAdapter;
use temper_text::tool_calls::{ParsedCall, ToolCallFormat, ToolCallParser, MISTRAL_ID_LEN};
use temper_text::{ReasoningParser, Tokenizer};
use tokio::sync::mpsc::UnboundedReceiver;
use tracing::Instrument;

use crate::auth::RequestContext;
use crate::error::ApiError;
use crate::extract::ValidJson;
use crate::meter::{unix_now, ChatUsage, UsageSink};
use crate::prompt::{logprob_entry, prepare, prompt_logprobs_at, reasoning_parser};
use crate::protocol::ServiceTier;
use crate::protocol::{
    ChatChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse, ChoiceLogprobs,
    ChunkChoice, Delta, DeltaToolCall, FinishReasonJson, LogprobEntry, ResponseFunctionCall,
    ResponseMessage, ResponseToolCall, StopReasonJson,
};
use crate::state::{AppState, RequestHook, ResolvedModel};
use crate::structured::{compile_constraint, RequestedConstraint};
use crate::team_limits::TeamRequestSlot;
use crate::usage::check_quota;
use crate::validation::{validate_chat, ChatParams, Limits, StreamOptions};
use temper_catalog::names;

pub const SYSTEM_FINGERPRINT: &str = concat!("temper-", env!("CARGO_PKG_VERSION"));

/// What rendering the output needs to know about the request.
pub struct Completion {
    pub id: String,
    pub created: u64,
    pub model: String,
    pub tokenizer: Arc<Tokenizer>,
    pub prompt_ids: Vec<u32>,
    pub n: usize,
    pub logprobs: bool,
    pub return_token_ids: bool,
    /// Logprob tokens as `"token_id:<id>"`.
    pub return_tokens_as_token_ids: bool,
    /// Put in front of every choice's content (`echo`).
    pub echo: Option<String>,
    /// Splits `<think>…</think>` output into `reasoning` (the template marks thinking); cloned
    /// per choice.
    pub reasoning_parser: Option<ReasoningParser>,
    /// `include_reasoning`: when false, the split-off reasoning is dropped.
    pub include_reasoning: bool,
    /// Finds tool calls in the content (`tool_choice` other than "none"); cloned per choice.
    pub tool_parser: Option<ToolCallParser>,
    pub service_tier: Option<ServiceTier>,
}

pub async fn chat_completions(
    State(state): State<AppState>,
    Extension(ctx): Extension<RequestContext>,
    ValidJson(req): ValidJson<ChatCompletionRequest>,
) -> Result<Response, ApiError> {
    let model_name = req.model.clone();
    let Admitted {
        team_slot,
        resolved,
        params,
        constraint,
        request_id,
        adapter,
        usage_sink,
    } = admit(&state, &ctx, model_name.as_deref(), |limits| {
        validate_chat(req, limits)
    })
    .await?;
    let model = resolved.base.clone();
    // Rendering and tokenizing a prompt of up to the body limit, and preparing the logits
    // processors (in `submit`), take milliseconds to seconds: on a blocking thread, so the async
    // workers keep answering `/health`, authentication and every stream meanwhile.
    let blocking_model = model.clone();
    let name = resolved.name.clone();
    let (params, prompt_ids, rx) = tokio::task::spawn_blocking(move || {
        let model = blocking_model;
        let generation = prepare(&model, &params, request_id.clone(), constraint, adapter)?;
        tracing::info!(
            completion_id = %request_id,
            model = %name,
            prompt_tokens = generation.prompt.len(),
            max_tokens = generation.stopping.max_tokens,
            n = params.n,
            stream = params.stream.is_some(),
            user = params.user.as_deref(),
            parallel_tool_calls = params.extras.parallel_tool_calls,
            service_tier = ?params.extras.service_tier,
            "chat completion"
        );
        let prompt_ids = generation.prompt.clone();
        let rx = model.engine.submit(generation)?;
        Ok::<_, ApiError>((params, prompt_ids, rx))
    })
    .await
    .map_err(|e| ApiError::Internal(format!("the prompt task failed: {e}")))??;
    // Counted from here: the engine has the request.
    let usage = ChatUsage::new(prompt_ids.len(), params.n, usage_sink);
    let reasoning_parser = reasoning_parser(&model, &params.prompt, &prompt_ids);
    let completion = Completion {
        id: format!(
            "chatcmpl-{}",
            params.request_id.as_deref().unwrap_or(&ctx.request_id)
        ),
        created: unix_now(),
        model: resolved.name,
        tokenizer: model.tokenizer.clone(),
        prompt_ids,
        n: params.n,
        logprobs: params.logprobs.is_some(),
        return_token_ids: params.return_token_ids,
        return_tokens_as_token_ids: params.return_tokens_as_token_ids,
        reasoning_parser,
        include_reasoning: params.include_reasoning,
        tool_parser: params.tool_parser,
        service_tier: params.extras.service_tier,
        echo: params.echo,
    };
    match params.stream {
        Some(opts) => Ok(sse_response(rx, completion, opts, team_slot, usage)),
        None => Ok(Json(collect(rx, &completion, usage).await?).into_response()),
    }
}

/// Validated parameters as [`admit`] takes them: the requested output constraint, the
/// caller's request id, and the deployment's hook for them.
pub(crate) trait AdmittedParams {
    fn take_constraint(&mut self) -> Option<RequestedConstraint>;
    fn request_id(&self) -> Option<&str>;
    fn check(&self, hook: &dyn RequestHook) -> Result<(), ApiError>;
}

impl AdmittedParams for ChatParams {
    fn take_constraint(&mut self) -> Option<RequestedConstraint> {
        self.constraint.take()
    }
    fn request_id(&self) -> Option<&str> {
        self.request_id.as_deref()
    }
    fn check(&self, hook: &dyn RequestHook) -> Result<(), ApiError> {
        hook.on_request(self)
    }
}

/// A generation request let in, ready to submit.
pub(crate) struct Admitted<P> {
    /// The team's place, held until the response's last byte.
    pub team_slot: TeamRequestSlot,
    pub resolved: ResolvedModel,
    pub params: P,
    pub constraint: Option<Grammar>,
    /// The caller's, or the one the server gave the request.
    pub request_id: String,
    /// The checkpoint's adapter (none for a base model or step 0).
    pub adapter: Option<Arc<LoraAdapter>>,
    /// Where its usage is metered (none without a meter).
    pub usage_sink: Option<UsageSink>,
}

/// What every generation route does before submitting, in order: takes the team's place,
/// resolves the model (a checkpoint name included), validates the body against its limits,
/// checks the quota, compiles the output constraint, runs the hook, and loads the adapter.
pub(crate) async fn admit<P: AdmittedParams>(
    state: &AppState,
    ctx: &RequestContext,
    model: Option<&str>,
    validate: impl FnOnce(&Limits) -> Result<P, ApiError>,
) -> Result<Admitted<P>, ApiError> {
    let team_slot = state.team_requests().enter(&ctx.team)?;
    let resolved = state.resolve(model, &ctx.team).await?;
    let mut params = validate(&state.limits(&resolved.base))?;
    check_quota(state, &ctx.team).await?;
    let constraint = compile_constraint(&resolved.base.engine, params.take_constraint()).await?;
    let request_id = params
        .request_id()
        .map_or_else(|| ctx.request_id.clone(), str::to_owned);
    params.check(state.options().request_hook.as_ref())?;
    let adapter = match &resolved.checkpoint {
        Some(checkpoint) => state.catalog().adapter(&resolved.base, checkpoint).await?,
        None => None,
    };
    let usage_sink = state.usage_meter().map(|meter| UsageSink {
        meter: meter.clone(),
        team: ctx.team.clone(),
        project: ctx.usage_project().to_owned(),
        model: usage_model(&resolved, &ctx.team),
    });
    Ok(Admitted {
        team_slot,
        resolved,
        params,
        constraint,
        request_id,
        adapter,
        usage_sink,
    })
}

/// The model a request's usage counts under: a base model's name, or the checkpoint it used as
/// `<team>/<project>/<name>:step<N>` (however the request spelled it).
pub(crate) fn usage_model(resolved: &ResolvedModel, team: &str) -> String {
    match (&resolved.checkpoint, names::parse(&resolved.name)) {
        (Some(checkpoint), Some(name)) => {
            names::checkpoint_name(team, name.project, name.name, checkpoint.step)
        }
        _ => resolved.name.clone(),
    }
}

pub(crate) fn finish_json(reason: FinishReason) -> FinishReasonJson {
    match reason {
        FinishReason::Stop => FinishReasonJson::Stop,
        FinishReason::Length => FinishReasonJson::Length,
        FinishReason::Repetition => FinishReasonJson::Repetition,
        FinishReason::Abort => FinishReasonJson::Abort,
    }
}

pub(crate) fn stop_json(reason: Option<StopReason>) -> Option<StopReasonJson> {
    reason.map(|r| match r {
        StopReason::Text(s) => StopReasonJson::Text(s),
        StopReason::Token(t) => StopReasonJson::Token(t),
        StopReason::Repetition => StopReasonJson::Text("repetition_detected".to_owned()),
    })
}

/// A parsed call as the response shows it, with a fresh id in the form the model's template
/// takes back: nine alphanumeric characters for Mistral's (as vLLM makes them), vLLM's
/// `chatcmpl-tool-…` else.
fn response_call(call: ParsedCall, format: ToolCallFormat) -> ResponseToolCall {
    let uuid = uuid::Uuid::new_v4().simple().to_string();
    ResponseToolCall {
        id: match format {
            ToolCallFormat::MistralJson => uuid[..MISTRAL_ID_LEN].to_owned(),
            _ => format!("chatcmpl-tool-{uuid}"),
        },
        r#type: "function",
        function: ResponseFunctionCall {
            name: call.name,
            arguments: call.arguments,
        },
    }
}

/// A choice that called tools finishes with `tool_calls` (vLLM's rule), whatever ended it.
fn finish_with_calls(reason: FinishReasonJson, called: bool) -> FinishReasonJson {
    if called {
        FinishReasonJson::ToolCalls
    } else {
        reason
    }
}

pub(crate) fn engine_gone() -> ApiError {
    ApiError::Internal("The engine stopped before the request finished.".to_owned())
}

pub(crate) fn bad_choice(choice: usize) -> ApiError {
    ApiError::Internal(format!("The engine reported an unknown choice {choice}."))
}

#[derive(Default)]
struct ChoiceAcc {
    text: String,
    token_ids: Vec<u32>,
    logprobs: Vec<LogprobEntry>,
    finish: Option<(FinishReasonJson, Option<StopReasonJson>)>,
}

/// Non-streaming: waits for every choice to finish. If the client goes away, axum drops this
/// future and with it the receiver, which cancels the request in the engine; `usage` records
/// what was generated however it ends.
pub async fn collect(
    mut rx: UnboundedReceiver<GenerationEvent>,
    c: &Completion,
    mut usage: ChatUsage,
) -> Result<ChatCompletionResponse, ApiError> {
    let mut choices: Vec<ChoiceAcc> = (0..c.n).map(|_| ChoiceAcc::default()).collect();
    let mut finished = 0;
    let mut prompt_logprobs = None;
    while finished < c.n {
        match rx.recv().await.ok_or_else(engine_gone)? {
            GenerationEvent::PromptLogprobs { entries } => prompt_logprobs = Some(entries),
            GenerationEvent::Token {
                choice,
                token_id,
                text,
                logprob,
            } => {
                let acc = choices.get_mut(choice).ok_or_else(|| bad_choice(choice))?;
                usage.token(choice);
                acc.text.push_str(&text);
                acc.token_ids.push(token_id);
                if let Some(lp) = logprob {
                    acc.logprobs.push(logprob_entry(
                        &c.tokenizer,
                        token_id,
                        &lp,
                        c.return_tokens_as_token_ids,
                    ));
                }
            }
            GenerationEvent::Finished {
                choice,
                reason,
                stop_reason,
                text,
                completion_tokens,
                cached_tokens,
                ..
            } => {
                let acc = choices.get_mut(choice).ok_or_else(|| bad_choice(choice))?;
                acc.text.push_str(&text);
                if acc.finish.is_none() {
                    finished += 1;
                }
                acc.finish = Some((finish_json(reason), stop_json(stop_reason)));
                usage.finished(choice, completion_tokens, cached_tokens);
            }
            GenerationEvent::Error { message } => return Err(ApiError::Generation(message)),
        }
    }
    usage.record();
    // The first prompt token has nothing before it to be predicted from.
    let prompt_logprobs = prompt_logprobs.map(|entries| {
        std::iter::once(None)
            .chain(
                entries
                    .iter()
                    .map(|p| Some(prompt_logprobs_at(&c.tokenizer, p))),
            )
            .collect()
    });
    Ok(ChatCompletionResponse {
        id: c.id.clone(),
        object: "chat.completion",
        created: c.created,
        model: c.model.clone(),
        choices: choices
            .into_iter()
            .enumerate()
            .map(|(index, acc)| {
                let (finish_reason, stop_reason) =
                    acc.finish.unwrap_or((FinishReasonJson::Abort, None));
                let (reasoning, content) = match &c.reasoning_parser {
                    Some(parser) => parser.clone().split(&acc.text),
                    None => (None, acc.text),
                };
                let (content, calls) = match &c.tool_parser {
                    Some(parser) => {
                        let (content, calls) = parser.clone().split(&content);
                        let format = parser.format();
                        let calls = calls.into_iter().map(|call| response_call(call, format));
                        (content, calls.collect())
                    }
                    None => (Some(content), Vec::new()),
                };
                let finish_reason = finish_with_calls(finish_reason, !calls.is_empty());
                ChatChoice {
                    index,
                    message: ResponseMessage {
                        role: "assistant",
                        content: match &c.echo {
                            Some(echo) => Some(format!("{echo}{}", content.unwrap_or_default())),
                            None => content,
                        },
                        reasoning: reasoning.filter(|_| c.include_reasoning),
                        tool_calls: calls,
                    },
                    logprobs: c.logprobs.then_some(ChoiceLogprobs {
                        content: acc.logprobs,
                    }),
                    finish_reason,
                    stop_reason,
                    token_ids: c.return_token_ids.then_some(acc.token_ids),
                }
            })
            .collect(),
        usage: usage.usage(),
        system_fingerprint: SYSTEM_FINGERPRINT,
        service_tier: c.service_tier,
        prompt_token_ids: c.return_token_ids.then(|| c.prompt_ids.clone()),
        prompt_logprobs,
    })
}

/// `data: <json>\n\n`
pub fn sse_data<T: Serialize>(value: &T) -> Bytes {
    match serde_json::to_string(value) {
        Ok(json) => Bytes::from(format!("data: {json}\n\n")),
        Err(e) => sse_error(&ApiError::Internal(format!("serializing a chunk: {e}"))),
    }
}

pub fn sse_error(e: &ApiError) -> Bytes {
    let json = serde_json::to_string(&e.envelope()).unwrap_or_else(|_| {
        r#"{"error":{"message":"internal error","type":"InternalServerError","param":null,"code":500}}"#
            .to_owned()
    });
    Bytes::from(format!("data: {json}\n\n"))
}

pub const SSE_DONE: &[u8] = b"data: [DONE]\n\n";

/// What one piece of a choice's output turned into.
struct ChoiceDelta {
    reasoning: String,
    content: String,
    calls: Vec<DeltaToolCall>,
}

/// The streaming state machine. It owns the engine receiver: when the client disconnects, hyper
/// drops the body stream, this state and the receiver with it, and the engine cancels.
struct SseState {
    rx: UnboundedReceiver<GenerationEvent>,
    c: Completion,
    opts: StreamOptions,
    pending: VecDeque<Bytes>,
    /// Recorded as the stream ends, or when its client goes away.
    usage: ChatUsage,
    finished: Vec<bool>,
    /// One per choice when the reasoning parser is on, else empty.
    parsers: Vec<ReasoningParser>,
    /// One per choice when the output is parsed for tool calls, else empty.
    tool_parsers: Vec<ToolCallParser>,
    /// Calls streamed so far per choice (the next call's `index`).
    calls: Vec<usize>,
    done: bool,
}

impl SseStream for SseState {
    type Event = Option<GenerationEvent>;

    fn pending(&mut self) -> &mut VecDeque<Bytes> {
        &mut self.pending
    }

    fn done(&self) -> bool {
        self.done
    }

    fn next_event(&mut self) -> impl std::future::Future<Output = Self::Event> + Send {
        self.rx.recv()
    }

    fn on_event(&mut self, event: Self::Event) {
        self.fold_event(event);
    }
}

impl SseState {
    fn new(
        rx: UnboundedReceiver<GenerationEvent>,
        c: Completion,
        opts: StreamOptions,
        usage: ChatUsage,
    ) -> Self {
        let n = c.n;
        let parsers = c
            .reasoning_parser
            .as_ref()
            .map(|p| vec![p.clone(); n])
            .unwrap_or_default();
        let tool_parsers = c
            .tool_parser
            .as_ref()
            .map(|p| vec![p.clone(); n])
            .unwrap_or_default();
        let mut s = SseState {
            rx,
            c,
            opts,
            pending: VecDeque::new(),
            usage,
            finished: vec![false; n],
            parsers,
            tool_parsers,
            calls: vec![0; n],
            done: false,
        };
        // vLLM opens every choice with a role chunk before any content.
        for index in 0..n {
            let chunk = s.chunk(
                ChunkChoice {
                    index,
                    delta: Delta {
                        role: Some("assistant"),
                        content: Some(String::new()),
                        ..Delta::default()
                    },
                    logprobs: None,
                    finish_reason: None,
                    stop_reason: None,
                    token_ids: None,
                },
                index == 0 && s.c.return_token_ids,
            );
            s.pending.push_back(chunk);
        }
        // As vLLM: the echoed prefill is each choice's first content chunk, after the role chunks.
        if let Some(echo) = s.c.echo.clone().filter(|e| !e.is_empty()) {
            for index in 0..n {
                let chunk = s.chunk(
                    ChunkChoice {
                        index,
                        delta: Delta {
                            role: None,
                            content: Some(echo.clone()),
                            ..Delta::default()
                        },
                        logprobs: None,
                        finish_reason: None,
                        stop_reason: None,
                        token_ids: None,
                    },
                    false,
                );
                s.pending.push_back(chunk);
            }
        }
        s
    }

    /// A choice's new text through its reasoning parser, then its content through its tool-call
    /// parser (each when on); `end` flushes what the parsers held back. Reasoning is dropped
    /// when the request does not want it.
    fn split(&mut self, choice: usize, text: &str, end: bool) -> ChoiceDelta {
        let (mut reasoning, mut content) = match self.parsers.get_mut(choice) {
            Some(p) => {
                let mut d = p.push(text);
                if end {
                    let tail = p.finish();
                    d.reasoning.push_str(&tail.reasoning);
                    d.content.push_str(&tail.content);
                }
                (d.reasoning, d.content)
            }
            None => (String::new(), text.to_owned()),
        };
        if !self.c.include_reasoning {
            reasoning.clear();
        }
        let mut calls = Vec::new();
        if let Some(p) = self.tool_parsers.get_mut(choice) {
            let mut d = p.push(&content);
            if end {
                // Llama 3.x's and Mistral's calls are only known here, at the end of the output.
                let tail = p.finish();
                d.content.push_str(&tail.content);
                d.calls.extend(tail.calls);
            }
            content = d.content;
            let first = self.calls[choice];
            self.calls[choice] += d.calls.len();
            calls = d
                .calls
                .into_iter()
                .enumerate()
                .map(|(i, call)| DeltaToolCall {
                    index: first + i,
                    call: response_call(call, p.format()),
                })
                .collect();
        }
        ChoiceDelta {
            reasoning,
            content,
            calls,
        }
    }

    fn chunk(&self, choice: ChunkChoice, with_prompt_ids: bool) -> Bytes {
        sse_data(&ChatCompletionChunk {
            id: &self.c.id,
            object: "chat.completion.chunk",
            created: self.c.created,
            model: &self.c.model,
            choices: vec![choice],
            usage: self.opts.continuous_usage_stats.then(|| self.usage.usage()),
            prompt_token_ids: with_prompt_ids.then_some(self.c.prompt_ids.as_slice()),
        })
    }

    fn fail(&mut self, e: ApiError) {
        tracing::error!(error = %e, "stream failed");
        self.usage.record();
        self.pending.push_back(sse_error(&e));
        self.pending.push_back(Bytes::from_static(SSE_DONE));
        self.done = true;
    }

    fn fold_event(&mut self, event: Option<GenerationEvent>) {
        match event {
            None => self.fail(engine_gone()),
            Some(GenerationEvent::Error { message }) => self.fail(ApiError::Generation(message)),
            // Validation keeps `prompt_logprobs` out of streams.
            Some(GenerationEvent::PromptLogprobs { .. }) => {}
            Some(GenerationEvent::Token {
                choice,
                token_id,
                text,
                logprob,
            }) => {
                if !self.usage.token(choice) {
                    return self.fail(bad_choice(choice));
                }
                let d = self.split(choice, &text, false);
                if d.content.is_empty()
                    && d.reasoning.is_empty()
                    && d.calls.is_empty()
                    && logprob.is_none()
                    && !self.c.return_token_ids
                {
                    return;
                }
                let logprobs = logprob.map(|lp| ChoiceLogprobs {
                    content: vec![logprob_entry(
                        &self.c.tokenizer,
                        token_id,
                        &lp,
                        self.c.return_tokens_as_token_ids,
                    )],
                });
                let chunk = self.chunk(
                    ChunkChoice {
                        index: choice,
                        delta: Delta {
                            role: None,
                            // Content stays present (maybe empty) unless the chunk is reasoning
                            // or calls.
                            content: (!d.content.is_empty()
                                || (d.reasoning.is_empty() && d.calls.is_empty()))
                            .then_some(d.content),
                            reasoning: (!d.reasoning.is_empty()).then_some(d.reasoning),
                            tool_calls: (!d.calls.is_empty()).then_some(d.calls),
                        },
                        logprobs,
                        finish_reason: None,
                        stop_reason: None,
                        token_ids: self.c.return_token_ids.then(|| vec![token_id]),
                    },
                    false,
                );
                self.pending.push_back(chunk);
            }
            Some(GenerationEvent::Finished {
                choice,
                reason,
                stop_reason,
                text,
                completion_tokens,
                cached_tokens,
                ..
            }) => {
                match self.finished.get_mut(choice) {
                    Some(f) if !*f => *f = true,
                    // A second Finished for one choice would break "exactly one finish chunk".
                    Some(_) => return,
                    None => return self.fail(bad_choice(choice)),
                }
                self.usage
                    .finished(choice, completion_tokens, cached_tokens);
                let d = self.split(choice, &text, true);
                let finish_reason = finish_with_calls(finish_json(reason), self.calls[choice] > 0);
                let chunk = self.chunk(
                    ChunkChoice {
                        index: choice,
                        delta: Delta {
                            role: None,
                            content: (!d.content.is_empty()).then_some(d.content),
                            reasoning: (!d.reasoning.is_empty()).then_some(d.reasoning),
                            tool_calls: (!d.calls.is_empty()).then_some(d.calls),
                        },
                        logprobs: None,
                        finish_reason: Some(finish_reason),
                        stop_reason: stop_json(stop_reason),
                        token_ids: self.c.return_token_ids.then(Vec::new),
                    },
                    false,
                );
                self.pending.push_back(chunk);
                if self.finished.iter().all(|&f| f) {
                    let usage_chunk = self.opts.include_usage.then(|| {
                        sse_data(&ChatCompletionChunk {
                            id: &self.c.id,
                            object: "chat.completion.chunk",
                            created: self.c.created,
                            model: &self.c.model,
                            choices: Vec::new(),
                            usage: Some(self.usage.usage()),
                            prompt_token_ids: None,
                        })
                    });
                    end_stream(&mut self.pending, &mut self.usage, usage_chunk);
                    self.done = true;
                }
            }
        }
    }
}

fn sse_response(
    rx: UnboundedReceiver<GenerationEvent>,
    c: Completion,
    opts: StreamOptions,
    team_slot: TeamRequestSlot,
    usage: ChatUsage,
) -> Response {
    sse_body(SseState::new(rx, c, opts, usage), team_slot)
}

/// A streamed answer's state as [`sse_body`] drives it: chunks ready to send, whether the
/// stream has ended, and the next engine event, folded into chunks by `on_event`.
pub(crate) trait SseStream: Send + 'static {
    type Event: Send;
    fn pending(&mut self) -> &mut VecDeque<Bytes>;
    fn done(&self) -> bool;
    fn next_event(&mut self) -> impl std::future::Future<Output = Self::Event> + Send;
    fn on_event(&mut self, event: Self::Event);
}

/// The end of a stream whose every choice has finished: the usage recorded (before the client
/// can read the end), the usage chunk when the request asked for one, then `[DONE]`.
pub(crate) fn end_stream(
    pending: &mut VecDeque<Bytes>,
    usage: &mut ChatUsage,
    usage_chunk: Option<Bytes>,
) {
    usage.record();
    pending.extend(usage_chunk);
    pending.push_back(Bytes::from_static(SSE_DONE));
    tracing::info!(
        completion_tokens = usage.usage().completion_tokens,
        "stream finished"
    );
}

/// A stream's state inside its response body: dropped before it is done, the client went away.
struct SseBody<S: SseStream> {
    state: S,
    span: tracing::Span,
}

impl<S: SseStream> Drop for SseBody<S> {
    fn drop(&mut self) {
        if !self.state.done() {
            let _span = self.span.enter();
            tracing::info!("client went away mid-stream; request cancelled");
        }
    }
}

/// The `text/event-stream` response of a stream's state, sending its chunks as they come; the
/// team's place is given back when the body is dropped (finished or disconnected).
pub(crate) fn sse_body<S: SseStream>(state: S, team_slot: TeamRequestSlot) -> Response {
    let span = tracing::Span::current();
    let body = SseBody {
        state,
        span: span.clone(),
    };
    let stream = futures_util::stream::unfold(body, move |mut b| {
        let _ = &team_slot;
        async move {
            let s = &mut b.state;
            loop {
                if let Some(bytes) = s.pending().pop_front() {
                    return Some((Ok::<_, Infallible>(bytes), b));
                }
                if s.done() {
                    return None;
                }
                let event = s.next_event().await;
                s.on_event(event);
            }
        }
        .instrument(span.clone())
    });
    (
        [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        Body::from_stream(stream),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use serde_json::{json, Value};
    use temper_engine::TokenLogprob;
    use temper_text::tool_calls::ToolCallFormat;
    use tokio::sync::mpsc::unbounded_channel;

    use super::*;

    fn tokenizer() -> Arc<Tokenizer> {
        static TOK: std::sync::OnceLock<Arc<Tokenizer>> = std::sync::OnceLock::new();
        TOK.get_or_init(|| {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("tiny.gguf");
            temper_model::tiny::write_tiny_gguf(&path, 1).unwrap();
            let loaded = temper_model::load_gguf(&path).unwrap();
            Arc::new(temper_text::load_tokenizer(&loaded.metadata, &path).unwrap())
        })
        .clone()
    }

    fn completion(n: usize, logprobs: bool, return_token_ids: bool) -> Completion {
        Completion {
            id: "chatcmpl-x".into(),
            created: 1,
            model: "m".into(),
            tokenizer: tokenizer(),
            prompt_ids: vec![2, 5, 6],
            n,
            logprobs,
            return_token_ids,
            return_tokens_as_token_ids: false,
            echo: None,
            reasoning_parser: None,
            include_reasoning: true,
            tool_parser: None,
            service_tier: None,
        }
    }

    fn token(choice: usize, id: u32, text: &str) -> GenerationEvent {
        GenerationEvent::Token {
            choice,
            token_id: id,
            text: text.into(),
            logprob: None,
        }
    }

    fn finished(
        choice: usize,
        reason: FinishReason,
        stop: Option<StopReason>,
        n: usize,
    ) -> GenerationEvent {
        GenerationEvent::Finished {
            choice,
            reason,
            stop_reason: stop,
            text: String::new(),
            prompt_tokens: 3,
            cached_tokens: 0,
            completion_tokens: n,
        }
    }

    /// Runs events through the state machine; returns the payloads (`[DONE]` as a string).
    fn run(c: Completion, opts: StreamOptions, events: Vec<Option<GenerationEvent>>) -> Vec<Value> {
        let (_tx, rx) = unbounded_channel();
        let usage = ChatUsage::new(c.prompt_ids.len(), c.n, None);
        let mut s = SseState::new(rx, c, opts, usage);
        for e in events {
            s.on_event(e);
        }
        assert!(s.done);
        s.pending
            .iter()
            .map(|b| {
                let text = std::str::from_utf8(b).unwrap();
                let data = text
                    .strip_prefix("data: ")
                    .unwrap()
                    .strip_suffix("\n\n")
                    .unwrap();
                serde_json::from_str(data).unwrap_or_else(|_| Value::String(data.to_owned()))
            })
            .collect()
    }

    #[test]
    fn chunk_sequence_with_usage() {
        let opts = StreamOptions {
            include_usage: true,
            continuous_usage_stats: false,
        };
        let out = run(
            completion(1, false, true),
            opts,
            vec![
                Some(token(0, 10, "Hel")),
                Some(token(0, 11, "lo")),
                Some(token(0, 1, "")),
                Some(finished(
                    0,
                    FinishReason::Stop,
                    Some(StopReason::Token(1)),
                    3,
                )),
            ],
        );
        assert_eq!(out.len(), 7, "{out:?}");
        assert_eq!(out[0]["object"], "chat.completion.chunk");
        assert_eq!(out[0]["id"], "chatcmpl-x");
        assert_eq!(out[0]["prompt_token_ids"], json!([2, 5, 6]));
        assert_eq!(
            out[0]["choices"][0],
            json!({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null,
                   "finish_reason": null, "stop_reason": null})
        );
        assert_eq!(out[1]["choices"][0]["delta"], json!({"content": "Hel"}));
        assert_eq!(out[1]["choices"][0]["token_ids"], json!([10]));
        assert!(out[1].get("prompt_token_ids").is_none());
        assert!(out[1].get("usage").is_none());
        // The EOS token still gets its chunk for its id.
        assert_eq!(out[3]["choices"][0]["token_ids"], json!([1]));
        assert_eq!(out[4]["choices"][0]["finish_reason"], "stop");
        assert_eq!(out[4]["choices"][0]["stop_reason"], 1);
        assert_eq!(out[4]["choices"][0]["delta"], json!({}));
        assert_eq!(out[5]["choices"], json!([]));
        assert_eq!(
            out[5]["usage"],
            json!({"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6,
                   "prompt_tokens_details": {"cached_tokens": 0}})
        );
        assert_eq!(out[6], "[DONE]");
    }

    #[test]
    fn n_choices_each_open_and_finish_once_with_continuous_usage() {
        let opts = StreamOptions {
            include_usage: true,
            continuous_usage_stats: true,
        };
        let out = run(
            completion(2, false, false),
            opts,
            vec![
                Some(token(1, 10, "b")),
                Some(token(0, 11, "a")),
                // EOS text is empty and nobody asked for ids: no chunk.
                Some(token(0, 1, "")),
                Some(finished(0, FinishReason::Stop, None, 2)),
                Some(token(1, 12, "c")),
                Some(finished(1, FinishReason::Length, None, 2)),
            ],
        );
        let roles: Vec<_> = out[..2].iter().map(|e| &e["choices"][0]["index"]).collect();
        assert_eq!(roles, [0, 1]);
        let finishes: Vec<_> = out
            .iter()
            .filter(|e| {
                !e["choices"][0]["finish_reason"].is_null()
                    && e["choices"].as_array().is_some_and(|c| !c.is_empty())
            })
            .map(|e| {
                (
                    e["choices"][0]["index"].clone(),
                    e["choices"][0]["finish_reason"].clone(),
                )
            })
            .collect();
        assert_eq!(
            finishes,
            [(json!(0), json!("stop")), (json!(1), json!("length"))]
        );
        // Usage on every chunk, counting as tokens arrive.
        let counts: Vec<u64> = out[..out.len() - 1]
            .iter()
            .map(|e| e["usage"]["completion_tokens"].as_u64().unwrap())
            .collect();
        assert_eq!(counts, [0, 0, 1, 2, 3, 4, 4, 4]);
        assert_eq!(out.last().unwrap(), "[DONE]");
    }

    #[test]
    fn error_after_start_is_an_error_event_then_done() {
        let out = run(
            completion(1, false, false),
            StreamOptions::default(),
            vec![
                Some(token(0, 10, "x")),
                Some(GenerationEvent::Error {
                    message: "model exploded".into(),
                }),
            ],
        );
        assert_eq!(out.len(), 4);
        assert_eq!(
            out[2],
            json!({"error": {"message": "model exploded", "type": "InternalServerError", "param": null, "code": 500}})
        );
        assert_eq!(out[3], "[DONE]");
        // The engine going away mid-stream reads the same.
        let out = run(
            completion(1, false, false),
            StreamOptions::default(),
            vec![None],
        );
        assert_eq!(out[1]["error"]["type"], "InternalServerError");
        assert_eq!(out[2], "[DONE]");
    }

    #[test]
    fn logprobs_chunk_shape() {
        let c = completion(1, true, false);
        let tok = c.tokenizer.clone();
        let (_tx, rx) = unbounded_channel();
        let usage = ChatUsage::new(c.prompt_ids.len(), c.n, None);
        let mut s = SseState::new(rx, c, StreamOptions::default(), usage);
        s.on_event(Some(GenerationEvent::Token {
            choice: 0,
            token_id: 10,
            text: "x".into(),
            logprob: Some(TokenLogprob {
                logprob: -0.5,
                top: vec![(10, -0.5), (11, f32::NEG_INFINITY)],
            }),
        }));
        let text = std::str::from_utf8(&s.pending[1]).unwrap();
        let v: Value = serde_json::from_str(text.trim_start_matches("data: ").trim_end()).unwrap();
        let entry = &v["choices"][0]["logprobs"]["content"][0];
        let bytes = tok.token_bytes(10).unwrap().into_owned();
        assert_eq!(entry["token"], String::from_utf8_lossy(&bytes).as_ref());
        assert_eq!(entry["bytes"], json!(bytes));
        assert_eq!(entry["logprob"], -0.5);
        assert_eq!(entry["top_logprobs"][1]["logprob"], -9999.0);
        assert_eq!(entry["top_logprobs"].as_array().unwrap().len(), 2);
    }

    #[test]
    fn calls_stream_as_whole_tool_call_deltas_and_finish_with_tool_calls() {
        let c = Completion {
            tool_parser: Some(ToolCallParser::new(
                ToolCallFormat::Hermes,
                vec!["f".into()],
                usize::MAX,
            )),
            ..completion(1, false, false)
        };
        let out = run(
            c,
            StreamOptions::default(),
            vec![
                Some(token(0, 10, "Sure.\n<tool_")),
                Some(token(0, 11, "call>\n{\"name\": \"f\", ")),
                Some(token(
                    0,
                    12,
                    "\"arguments\": {\"a\": 1}}\n</tool_call>\n<tool_call>",
                )),
                Some(token(
                    0,
                    13,
                    "{\"name\": \"f\", \"arguments\": {}}</tool_call>",
                )),
                Some(finished(0, FinishReason::Stop, None, 4)),
            ],
        );
        let deltas: Vec<Value> = out[1..out.len() - 1]
            .iter()
            .map(|e| {
                let mut d = e["choices"][0]["delta"].clone();
                let calls = d.get_mut("tool_calls").and_then(Value::as_array_mut);
                for call in calls.into_iter().flatten() {
                    let id = call["id"].as_str().unwrap();
                    assert!(id.starts_with("chatcmpl-tool-"), "{id}");
                    call["id"] = json!("ID");
                }
                d
            })
            .collect();
        let call = |index: usize, arguments: &str| {
            json!({"tool_calls": [{"index": index, "id": "ID", "type": "function",
                "function": {"name": "f", "arguments": arguments}}]})
        };
        assert_eq!(
            deltas,
            [
                // "\n<tool_" is held back: whitespace before a call and a partial tag.
                json!({"content": "Sure."}),
                call(0, "{\"a\": 1}"),
                call(1, "{}"),
                json!({}),
            ]
        );
        assert_eq!(out[4]["choices"][0]["finish_reason"], "tool_calls");
    }

    #[test]
    fn llama3_calls_stream_in_the_finish_chunk() {
        // Llama 3.x's answer is only known to be calls at its end: they arrive with the finish.
        let c = Completion {
            tool_parser: Some(ToolCallParser::new(
                ToolCallFormat::Llama3Json,
                vec!["f".into()],
                1,
            )),
            ..completion(1, false, false)
        };
        let out = run(
            c,
            StreamOptions::default(),
            vec![
                Some(token(0, 10, "{\"name\": \"f\", ")),
                Some(token(0, 11, "\"parameters\": {\"a\": 1}}")),
                Some(finished(0, FinishReason::Stop, None, 2)),
            ],
        );
        let last = &out[out.len() - 2]["choices"][0];
        assert_eq!(last["finish_reason"], "tool_calls");
        let calls = last["delta"]["tool_calls"].as_array().unwrap();
        assert_eq!(calls.len(), 1);
        assert_eq!(calls[0]["index"], 0);
        assert_eq!(
            calls[0]["function"],
            json!({"name": "f", "arguments": "{\"a\": 1}"})
        );
        // Nothing before the finish chunk but the role chunk.
        assert_eq!(out.len(), 3);
    }

    #[test]
    fn stream_splits_reasoning_and_echoes_after_the_role_chunks() {
        let c = Completion {
            echo: Some("Pre".into()),
            reasoning_parser: Some(ReasoningParser::default()),
            ..completion(2, false, false)
        };
        let out = run(
            c,
            StreamOptions::default(),
            vec![
                Some(token(0, 10, "<th")),
                Some(token(0, 11, "ink>a</thi")),
                Some(token(0, 12, "nk>b")),
                Some(finished(0, FinishReason::Stop, None, 3)),
                Some(token(1, 13, "plain")),
                Some(finished(1, FinishReason::Length, None, 1)),
            ],
        );
        let deltas: Vec<(u64, Value)> = out[..out.len() - 1]
            .iter()
            .map(|e| {
                (
                    e["choices"][0]["index"].as_u64().unwrap(),
                    e["choices"][0]["delta"].clone(),
                )
            })
            .collect();
        assert_eq!(
            deltas,
            [
                (0, json!({"role": "assistant", "content": ""})),
                (1, json!({"role": "assistant", "content": ""})),
                (0, json!({"content": "Pre"})),
                (1, json!({"content": "Pre"})),
                // "<th" is held back: only "<think>" or not can decide; the chunk is skipped.
                (0, json!({"reasoning": "a"})),
                (0, json!({"content": "b"})),
                (0, json!({})),
                (1, json!({"content": "plain"})),
                (1, json!({})),
            ]
        );
    }
}
