//! `POST /v1/completions`, vLLM's legacy text completions: resolve the model → validate →
//! tokenize each prompt → one engine request per prompt (`best_of` choices each), then one JSON
//! response or an SSE stream of `text_completion` chunks. Choice `index` runs over the prompts'
//! choices in turn: prompt `i`'s choice `j` is `i × n + j`, as in vLLM.

use std::collections::VecDeque;
use std::sync::Arc;
use std::task::Poll;

use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use temper_engine::{EngineError, FinishReason, GenerationEvent, PromptLogprob, TokenLogprob};
use temper_text::Tokenizer;
use tokio::sync::mpsc::UnboundedReceiver;

use crate::auth::RequestContext;
use crate::chat::{
    admit, bad_choice, end_stream, engine_gone, finish_json, sse_body, sse_data, sse_error,
    stop_json, Admitted, AdmittedParams, SseStream, SSE_DONE, SYSTEM_FINGERPRINT,
};
use crate::error::ApiError;
use crate::extract::ValidJson;
use crate::meter::{unix_now, ChatUsage};
use crate::prompt::{
    completion_request, finite, prepare_completion, prompt_logprobs_at, token_text,
    CompletionPrompt,
};
use crate::protocol::{
    CompletionChoice, CompletionChunk, CompletionLogprobs, CompletionRequest, CompletionResponse,
    FinishReasonJson, PromptLogprobsAt, StopReasonJson, TopLogprobsAt,
};
use crate::state::{AppState, RequestHook};
use crate::structured::RequestedConstraint;
use crate::team_limits::TeamRequestSlot;
use crate::validation::{validate_completion, CompletionParams, StreamOptions};

impl AdmittedParams for CompletionParams {
    fn take_constraint(&mut self) -> Option<RequestedConstraint> {
        self.constraint.take()
    }
    fn request_id(&self) -> Option<&str> {
        self.request_id.as_deref()
    }
    fn check(&self, hook: &dyn RequestHook) -> Result<(), ApiError> {
        hook.on_completion(self)
    }
}

pub async fn completions(
    State(state): State<AppState>,
    Extension(ctx): Extension<RequestContext>,
    ValidJson(req): ValidJson<CompletionRequest>,
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
        validate_completion(req, limits)
    })
    .await?;
    let model = resolved.base.clone();
    // Tokenizing prompts of up to the body limit takes a while: on a blocking thread (see
    // chat.rs). Every prompt is tokenized before any is submitted; a refused submission drops
    // the receivers of those before it, which cancels them.
    let blocking_model = model.clone();
    let name = resolved.name.clone();
    let (params, prompts, receivers) = tokio::task::spawn_blocking(move || {
        let model = blocking_model;
        let many = params.prompts.len() > 1;
        let param = |i: usize| {
            if many {
                format!("prompt[{i}]")
            } else {
                "prompt".to_owned()
            }
        };
        let prompts = params
            .prompts
            .iter()
            .enumerate()
            .map(|(i, p)| prepare_completion(&model, &params, p, &param(i)))
            .collect::<Result<Vec<_>, _>>()?;
        tracing::info!(
            completion_id = %request_id,
            model = %name,
            prompts = prompts.len(),
            prompt_tokens = prompts.iter().map(|p| p.ids.len()).sum::<usize>(),
            max_tokens = params.stopping.max_tokens,
            n = params.n,
            best_of = params.best_of,
            echo = params.echo,
            stream = params.stream.is_some(),
            user = params.user.as_deref(),
            "completion"
        );
        let receivers = prompts
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let generation = completion_request(
                    &model,
                    &params,
                    format!("{request_id}-{i}"),
                    p.ids.clone(),
                    constraint.clone(),
                    adapter.clone(),
                );
                model
                    .engine
                    .submit(generation)
                    .map_err(|e| engine_error(e, &param(i)))
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok::<_, ApiError>((params, prompts, receivers))
    })
    .await
    .map_err(|e| ApiError::Internal(format!("the prompt task failed: {e}")))??;
    // Counted from here: the engine has the requests.
    let lens: Vec<usize> = prompts.iter().map(|p| p.ids.len()).collect();
    let usage = ChatUsage::prompts(&lens, params.best_of, usage_sink);
    let c = TextCompletion {
        id: format!(
            "cmpl-{}",
            params.request_id.as_deref().unwrap_or(&ctx.request_id)
        ),
        created: unix_now(),
        model: resolved.name,
        tokenizer: model.tokenizer.clone(),
        prompts,
        n: params.n,
        best_of: params.best_of,
        echo: params.echo,
        echo_only: params.echo_only,
        logprobs: params.logprobs,
        prompt_logprobs: params.prompt_logprobs,
        return_token_ids: params.return_token_ids,
        as_ids: params.return_tokens_as_token_ids,
    };
    let events = Merged::new(receivers);
    match params.stream {
        Some(opts) => Ok(sse_response(events, c, opts, team_slot, usage)),
        None => Ok(Json(collect(events, &c, usage).await?).into_response()),
    }
}

/// The engine's refusals, with a completion's field names (chat's name `messages` and
/// `max_completion_tokens`).
fn engine_error(e: EngineError, prompt_param: &str) -> ApiError {
    match e {
        EngineError::PromptTooLong {
            prompt_tokens,
            max_model_len,
        } => ApiError::bad(
            prompt_param,
            format!(
                "This model's maximum context length is {max_model_len} tokens. However, your \
                 request has {prompt_tokens} input tokens. Please reduce the length of the \
                 prompt."
            ),
        ),
        EngineError::EmptyPrompt => ApiError::bad(prompt_param, "A prompt must not be empty."),
        EngineError::TooLong { .. } => ApiError::bad("max_tokens", e.to_string()),
        e => e.into(),
    }
}

/// What rendering the output needs to know about the request.
struct TextCompletion {
    id: String,
    created: u64,
    model: String,
    tokenizer: Arc<Tokenizer>,
    prompts: Vec<CompletionPrompt>,
    /// Choices returned per prompt.
    n: usize,
    /// Choices generated per prompt (the engine's `n`).
    best_of: usize,
    echo: bool,
    /// `max_tokens: 0` with `echo`: the generated token is dropped.
    echo_only: bool,
    logprobs: Option<usize>,
    prompt_logprobs: Option<usize>,
    return_token_ids: bool,
    /// `return_tokens_as_token_ids`.
    as_ids: bool,
}

impl TextCompletion {
    fn token_string(&self, id: u32) -> String {
        if self.as_ids {
            format!("token_id:{id}")
        } else {
            token_text(&self.tokenizer, id).0
        }
    }

    /// One position's `{token: logprob}`: its own token first, then up to `k` of `top` (best
    /// first) without it; a token text already there is not repeated.
    fn top_at(&self, id: u32, logprob: f32, top: &[(u32, f32)], k: usize) -> TopLogprobsAt {
        let mut entries = vec![(self.token_string(id), finite(logprob))];
        for &(alt, lp) in top.iter().filter(|&&(alt, _)| alt != id).take(k) {
            let token = self.token_string(alt);
            if entries.iter().all(|(t, _)| *t != token) {
                entries.push((token, finite(lp)));
            }
        }
        TopLogprobsAt(entries)
    }

    /// Appends one token to `out`: its string, its offset (`offset` counts the characters of
    /// the token strings so far, as vLLM's `text_offset`), and its logprob and alternatives
    /// (`None` for a prompt's first token, which nothing predicts).
    fn push(
        &self,
        out: &mut CompletionLogprobs,
        offset: &mut usize,
        id: u32,
        logprob: Option<(f32, &[(u32, f32)])>,
        k: usize,
    ) {
        let token = self.token_string(id);
        out.text_offset.push(*offset);
        *offset += token.chars().count();
        out.tokens.push(token);
        match logprob {
            None => {
                out.token_logprobs.push(None);
                out.top_logprobs.push(None);
            }
            Some((lp, top)) => {
                out.token_logprobs.push(Some(finite(lp)));
                out.top_logprobs.push(Some(self.top_at(id, lp, top, k)));
            }
        }
    }

    /// The echoed prompt's tokens with their logprobs (`entries`, from the second token on).
    fn push_prompt(
        &self,
        out: &mut CompletionLogprobs,
        offset: &mut usize,
        prompt: usize,
        entries: &[PromptLogprob],
        k: usize,
    ) {
        let ids = &self.prompts[prompt].ids;
        for (i, &id) in ids.iter().enumerate() {
            let lp = i
                .checked_sub(1)
                .and_then(|j| entries.get(j))
                .map(|e| (e.logprob, e.top.as_slice()));
            self.push(out, offset, id, lp, k);
        }
    }

    /// A choice's `prompt_logprobs`: null first, then each position's entry with the `k` most
    /// likely tokens (the engine computed `max(k, logprobs)` when `echo` asked for them too).
    fn prompt_logprobs_of(
        &self,
        entries: &[PromptLogprob],
    ) -> Option<Vec<Option<PromptLogprobsAt>>> {
        let k = self.prompt_logprobs?;
        Some(
            std::iter::once(None)
                .chain(entries.iter().map(|e| {
                    let top = e.top[..k.min(e.top.len())].to_vec();
                    Some(prompt_logprobs_at(
                        &self.tokenizer,
                        &PromptLogprob { top, ..e.clone() },
                    ))
                }))
                .collect(),
        )
    }
}

/// The prompts' receivers as one stream of `(prompt, event)`; `(prompt, None)` once when a
/// prompt's receiver closes. Dropping it drops the receivers, which cancels the requests.
struct Merged {
    rxs: Vec<Option<UnboundedReceiver<GenerationEvent>>>,
    /// Where the next poll starts, so that a busy prompt does not starve the others.
    next: usize,
}

impl Merged {
    fn new(rxs: Vec<UnboundedReceiver<GenerationEvent>>) -> Merged {
        Merged {
            rxs: rxs.into_iter().map(Some).collect(),
            next: 0,
        }
    }

    /// `None` once every receiver has closed.
    async fn recv(&mut self) -> Option<(usize, Option<GenerationEvent>)> {
        std::future::poll_fn(|cx| {
            let len = self.rxs.len();
            let mut open = false;
            for k in 0..len {
                let i = (self.next + k) % len;
                let Some(rx) = &mut self.rxs[i] else {
                    continue;
                };
                open = true;
                match rx.poll_recv(cx) {
                    Poll::Ready(Some(event)) => {
                        self.next = (i + 1) % len;
                        return Poll::Ready(Some((i, Some(event))));
                    }
                    Poll::Ready(None) => {
                        self.rxs[i] = None;
                        return Poll::Ready(Some((i, None)));
                    }
                    Poll::Pending => {}
                }
            }
            if open {
                Poll::Pending
            } else {
                Poll::Ready(None)
            }
        })
        .await
    }
}

#[derive(Default)]
struct ChoiceAcc {
    text: String,
    token_ids: Vec<u32>,
    logprobs: Vec<TokenLogprob>,
    /// The sum of the sampled tokens' logprobs (`best_of`'s ranking).
    cumulative: f64,
    finish: Option<(FinishReasonJson, Option<StopReasonJson>)>,
}

/// The finish a choice reports: an echo without a completion has generated nothing it shows,
/// and ends by its length of 0.
fn finish_of(
    c: &TextCompletion,
    reason: FinishReason,
    stop_reason: Option<temper_engine::StopReason>,
) -> (FinishReasonJson, Option<StopReasonJson>) {
    if c.echo_only {
        (FinishReasonJson::Length, None)
    } else {
        (finish_json(reason), stop_json(stop_reason))
    }
}

/// Non-streaming: waits for every choice of every prompt. If the client goes away, axum drops
/// this future and the receivers with it, which cancels the requests; `usage` records what was
/// generated however it ends.
async fn collect(
    mut events: Merged,
    c: &TextCompletion,
    mut usage: ChatUsage,
) -> Result<CompletionResponse, ApiError> {
    let total = c.prompts.len() * c.best_of;
    let mut accs: Vec<ChoiceAcc> = (0..total).map(|_| ChoiceAcc::default()).collect();
    let mut prompt_logprobs: Vec<Vec<PromptLogprob>> = vec![Vec::new(); c.prompts.len()];
    let mut finished = 0;
    while finished < total {
        let (prompt, event) = events.recv().await.ok_or_else(engine_gone)?;
        let global = |choice: usize| {
            (choice < c.best_of)
                .then_some(prompt * c.best_of + choice)
                .ok_or_else(|| bad_choice(choice))
        };
        match event {
            None => {
                let range = prompt * c.best_of..(prompt + 1) * c.best_of;
                if accs[range].iter().any(|a| a.finish.is_none()) {
                    return Err(engine_gone());
                }
            }
            Some(GenerationEvent::PromptLogprobs { entries }) => prompt_logprobs[prompt] = entries,
            Some(GenerationEvent::Token {
                choice,
                token_id,
                text,
                logprob,
            }) => {
                let g = global(choice)?;
                if !c.echo_only {
                    usage.token(g);
                }
                let acc = &mut accs[g];
                acc.text.push_str(&text);
                acc.token_ids.push(token_id);
                if let Some(lp) = logprob {
                    acc.cumulative += f64::from(lp.logprob);
                    acc.logprobs.push(lp);
                }
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
                let g = global(choice)?;
                let acc = &mut accs[g];
                acc.text.push_str(&text);
                if acc.finish.is_none() {
                    finished += 1;
                }
                acc.finish = Some(finish_of(c, reason, stop_reason));
                let shown = if c.echo_only { 0 } else { completion_tokens };
                usage.finished(g, shown, cached_tokens);
            }
            Some(GenerationEvent::Error { message }) => return Err(ApiError::Generation(message)),
        }
    }
    usage.record();

    let mut choices = Vec::with_capacity(c.prompts.len() * c.n);
    for (p, prompt) in c.prompts.iter().enumerate() {
        let mut order: Vec<usize> = (0..c.best_of).collect();
        if c.best_of > c.n {
            // vLLM's best_of: the n of highest cumulative logprob, best first.
            order.sort_by(|&a, &b| {
                let (a, b) = (&accs[p * c.best_of + a], &accs[p * c.best_of + b]);
                b.cumulative.total_cmp(&a.cumulative)
            });
            order.truncate(c.n);
        }
        let prompt_lps = c.prompt_logprobs_of(&prompt_logprobs[p]);
        for (rank, choice) in order.into_iter().enumerate() {
            let acc = std::mem::take(&mut accs[p * c.best_of + choice]);
            let (finish_reason, stop_reason) =
                acc.finish.unwrap_or((FinishReasonJson::Abort, None));
            let shown = !c.echo_only;
            let logprobs = c.logprobs.map(|k| {
                let mut out = CompletionLogprobs::default();
                let mut offset = 0;
                if c.echo {
                    c.push_prompt(&mut out, &mut offset, p, &prompt_logprobs[p], k);
                }
                if shown {
                    for (&id, lp) in acc.token_ids.iter().zip(&acc.logprobs) {
                        c.push(&mut out, &mut offset, id, Some((lp.logprob, &lp.top)), k);
                    }
                }
                out
            });
            let mut text = if c.echo {
                prompt.echo.clone()
            } else {
                String::new()
            };
            if shown {
                text.push_str(&acc.text);
            }
            choices.push(CompletionChoice {
                index: p * c.n + rank,
                text,
                logprobs,
                finish_reason: Some(finish_reason),
                stop_reason,
                prompt_logprobs: prompt_lps.clone(),
                prompt_token_ids: c.return_token_ids.then(|| prompt.ids.clone()),
                token_ids: c
                    .return_token_ids
                    .then(|| if shown { acc.token_ids } else { Vec::new() }),
            });
        }
    }
    Ok(CompletionResponse {
        id: c.id.clone(),
        object: "text_completion",
        created: c.created,
        model: c.model.clone(),
        choices,
        usage: usage.usage(),
        system_fingerprint: SYSTEM_FINGERPRINT,
    })
}

/// The streaming state machine (`best_of` = `n` here, so engine choice `i × n + j` is output
/// choice `i × n + j`). It owns the receivers: when the client disconnects, hyper drops the
/// body stream, this state and the receivers with it, and the engine cancels.
struct CompletionSse {
    events: Merged,
    c: TextCompletion,
    opts: StreamOptions,
    pending: VecDeque<Bytes>,
    /// Recorded as the stream ends, or when its client goes away.
    usage: ChatUsage,
    prompt_logprobs: Vec<Vec<PromptLogprob>>,
    /// Per choice: its first chunk (with the echoed prompt and the prompt's ids) has gone.
    opened: Vec<bool>,
    finished: Vec<bool>,
    /// Per choice: the characters of its token strings so far (`text_offset`).
    offsets: Vec<usize>,
    done: bool,
}

impl SseStream for CompletionSse {
    type Event = Option<(usize, Option<GenerationEvent>)>;

    fn pending(&mut self) -> &mut VecDeque<Bytes> {
        &mut self.pending
    }

    fn done(&self) -> bool {
        self.done
    }

    fn next_event(&mut self) -> impl std::future::Future<Output = Self::Event> + Send {
        self.events.recv()
    }

    fn on_event(&mut self, event: Self::Event) {
        self.fold_event(event);
    }
}

impl CompletionSse {
    fn new(events: Merged, c: TextCompletion, opts: StreamOptions, usage: ChatUsage) -> Self {
        let total = c.prompts.len() * c.n;
        CompletionSse {
            events,
            prompt_logprobs: vec![Vec::new(); c.prompts.len()],
            c,
            opts,
            pending: VecDeque::new(),
            usage,
            opened: vec![false; total],
            finished: vec![false; total],
            offsets: vec![0; total],
            done: false,
        }
    }

    fn chunk(&self, choice: CompletionChoice) -> Bytes {
        sse_data(&CompletionChunk {
            id: &self.c.id,
            object: "text_completion",
            created: self.c.created,
            model: &self.c.model,
            choices: vec![choice],
            usage: self.opts.continuous_usage_stats.then(|| self.usage.usage()),
        })
    }

    fn fail(&mut self, e: ApiError) {
        tracing::error!(error = %e, "stream failed");
        self.usage.record();
        self.pending.push_back(sse_error(&e));
        self.pending.push_back(Bytes::from_static(SSE_DONE));
        self.done = true;
    }

    /// A choice's chunk, opened with the echoed prompt (text, logprobs) and the prompt's ids
    /// when it is the choice's first; `None` when there is nothing to say.
    fn choice_chunk(
        &mut self,
        prompt: usize,
        g: usize,
        token: Option<(u32, &str, Option<&TokenLogprob>)>,
        tail: &str,
        finish: Option<(FinishReasonJson, Option<StopReasonJson>)>,
    ) -> Option<CompletionChoice> {
        let c = &self.c;
        let mut text = String::new();
        let mut logprobs = c.logprobs.map(|_| CompletionLogprobs::default());
        let mut prompt_token_ids = None;
        let opening = !self.opened[g];
        if opening {
            self.opened[g] = true;
            if c.echo {
                text.push_str(&c.prompts[prompt].echo);
                if let (Some(out), Some(k)) = (logprobs.as_mut(), c.logprobs) {
                    c.push_prompt(
                        out,
                        &mut self.offsets[g],
                        prompt,
                        &self.prompt_logprobs[prompt],
                        k,
                    );
                }
            }
            if c.return_token_ids {
                prompt_token_ids = Some(c.prompts[prompt].ids.clone());
            }
        }
        let mut token_ids = Vec::new();
        if let (Some((id, piece, lp)), false) = (token, c.echo_only) {
            text.push_str(piece);
            token_ids.push(id);
            if let (Some(out), Some(k), Some(lp)) = (logprobs.as_mut(), c.logprobs, lp) {
                c.push(
                    out,
                    &mut self.offsets[g],
                    id,
                    Some((lp.logprob, &lp.top)),
                    k,
                );
            }
        }
        if !c.echo_only {
            text.push_str(tail);
        }
        let logprobs = logprobs.filter(|l| !l.tokens.is_empty());
        let ids_to_show =
            c.return_token_ids && (!token_ids.is_empty() || prompt_token_ids.is_some());
        if finish.is_none() && text.is_empty() && logprobs.is_none() && !ids_to_show {
            return None;
        }
        let (finish_reason, stop_reason) = match finish {
            Some((f, s)) => (Some(f), s),
            None => (None, None),
        };
        Some(CompletionChoice {
            index: g,
            text,
            logprobs,
            finish_reason,
            stop_reason,
            prompt_logprobs: None,
            prompt_token_ids,
            token_ids: c.return_token_ids.then_some(token_ids),
        })
    }

    fn fold_event(&mut self, event: Option<(usize, Option<GenerationEvent>)>) {
        let Some((prompt, event)) = event else {
            return self.fail(engine_gone());
        };
        let n = self.c.n;
        let global = |choice: usize| (choice < n).then_some(prompt * n + choice);
        match event {
            None => {
                if self.finished[prompt * n..(prompt + 1) * n]
                    .iter()
                    .any(|&f| !f)
                {
                    self.fail(engine_gone());
                }
            }
            Some(GenerationEvent::Error { message }) => self.fail(ApiError::Generation(message)),
            Some(GenerationEvent::PromptLogprobs { entries }) => {
                self.prompt_logprobs[prompt] = entries;
            }
            Some(GenerationEvent::Token {
                choice,
                token_id,
                text,
                logprob,
            }) => {
                let Some(g) = global(choice) else {
                    return self.fail(bad_choice(choice));
                };
                if !self.c.echo_only {
                    self.usage.token(g);
                }
                let token = Some((token_id, text.as_str(), logprob.as_ref()));
                if let Some(choice) = self.choice_chunk(prompt, g, token, "", None) {
                    let chunk = self.chunk(choice);
                    self.pending.push_back(chunk);
                }
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
                let Some(g) = global(choice) else {
                    return self.fail(bad_choice(choice));
                };
                if std::mem::replace(&mut self.finished[g], true) {
                    // A second Finished for one choice would break "one finish chunk each".
                    return;
                }
                let shown = if self.c.echo_only {
                    0
                } else {
                    completion_tokens
                };
                self.usage.finished(g, shown, cached_tokens);
                let finish = finish_of(&self.c, reason, stop_reason);
                if let Some(choice) = self.choice_chunk(prompt, g, None, &text, Some(finish)) {
                    let chunk = self.chunk(choice);
                    self.pending.push_back(chunk);
                }
                if self.finished.iter().all(|&f| f) {
                    let usage_chunk = self.opts.include_usage.then(|| {
                        sse_data(&CompletionChunk {
                            id: &self.c.id,
                            object: "text_completion",
                            created: self.c.created,
                            model: &self.c.model,
                            choices: Vec::new(),
                            usage: Some(self.usage.usage()),
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
    events: Merged,
    c: TextCompletion,
    opts: StreamOptions,
    team_slot: TeamRequestSlot,
    usage: ChatUsage,
) -> Response {
    sse_body(CompletionSse::new(events, c, opts, usage), team_slot)
}
