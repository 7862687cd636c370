//! Messages → prompt token ids (chat completions and `/tokenize` share it), the one `prepare`
//! step from a validated chat request to the engine's request (`prepare_completion` for a
//! completion's prompts), and token ids → the strings and bytes the logprobs output shows.

use std::sync::Arc;

use temper_engine::{GenerationRequest, Grammar, PromptLogprob, TokenLogprob};
use temper_model::LoraAdapter;
use temper_text::{
    ChatTemplate, DecodeOptions, ReasoningParser, TemplateInput, Tokenizer, THINK_START,
};

use crate::error::ApiError;
use crate::extras::ReasoningEffort;
use crate::protocol::{LogprobEntry, PromptLogprobsAt, PromptTokenLogprob, TopLogprob};
use crate::state::ServedModel;
use crate::validation::{
    ChatParams, CompletionParams, PromptInput, PromptParams, DEFAULT_COMPLETION_MAX_TOKENS,
};

/// Renders the chat template and tokenizes the result with special-token parsing (the template
/// writes control tokens such as `<start_of_turn>` as text).
pub fn chat_prompt(model: &ServedModel, p: &PromptParams) -> Result<Vec<u32>, ApiError> {
    let text = render_prompt(model, p)?;
    Ok(encode_prompt(model, p, &text))
}

/// The prompt's text: the messages through the request's template or the model's.
pub fn render_prompt(model: &ServedModel, p: &PromptParams) -> Result<String, ApiError> {
    let tok = &model.tokenizer;
    let request_template;
    let template: &ChatTemplate = match (&p.chat_template, &model.chat_template) {
        (Some(src), _) => {
            request_template = ChatTemplate::new(
                src,
                tok.bos_token().map(str::to_owned),
                tok.eos_token().map(str::to_owned),
            )
            .map_err(|e| ApiError::bad("chat_template", format!("Invalid chat template: {e}")))?;
            &request_template
        }
        (None, Some(t)) => t.as_ref(),
        (None, None) => {
            return Err(ApiError::bad(
                "chat_template",
                format!(
                    "Model `{}` has no chat template: send `chat_template` or serve the model \
                     with --chat-template.",
                    model.name
                ),
            ))
        }
    };
    template
        .render(&TemplateInput {
            messages: &p.messages,
            tools: p.tools.as_deref(),
            documents: p.documents.as_deref(),
            add_generation_prompt: p.add_generation_prompt,
            continue_final_message: p.continue_final_message,
            reasoning_effort: p.reasoning_effort.map(ReasoningEffort::as_str),
            kwargs: &p.chat_template_kwargs,
        })
        .map_err(|e| ApiError::bad("messages", e.to_string()))
}

/// The rendered prompt's token ids (the template's control tokens parsed as such).
pub fn encode_prompt(model: &ServedModel, p: &PromptParams, text: &str) -> Vec<u32> {
    let mut ids = model.tokenizer.encode(text, true);
    if p.add_special_tokens {
        prepend_bos(&model.tokenizer, &mut ids);
    }
    ids
}

/// The engine's request for a validated chat request: renders the prompt, refuses a text that
/// cannot fit the context before tokenizing it, encodes and truncates it. The engine checks the
/// context rules on the tokens (`Engine::submit`).
/// `constraint` is the request's constraint compiled, `adapter` its checkpoint's.
pub fn prepare(
    model: &ServedModel,
    params: &ChatParams,
    request_id: String,
    constraint: Option<Grammar>,
    adapter: Option<Arc<LoraAdapter>>,
) -> Result<GenerationRequest, ApiError> {
    let text = render_prompt(model, &params.prompt)?;
    if params.truncate_prompt_tokens.is_none() {
        check_prompt_bytes(
            "messages",
            text.len(),
            model.max_text_bytes_per_token,
            model.max_model_len,
        )?;
    }
    let mut prompt = encode_prompt(model, &params.prompt, &text);
    if let Some(keep) = params.truncate_prompt_tokens {
        prompt.drain(..prompt.len().saturating_sub(keep));
    }
    let mut request = engine_request(params, request_id, prompt, constraint);
    request.adapter = adapter;
    Ok(request)
}

/// The engine's request over the prompt's tokens.
fn engine_request(
    params: &ChatParams,
    request_id: String,
    prompt: Vec<u32>,
    constraint: Option<Grammar>,
) -> GenerationRequest {
    GenerationRequest {
        cache_salt: params.extras.cache_salt.clone(),
        request_id,
        prompt,
        n: params.n,
        sampling: params.sampling.clone(),
        stopping: params.stopping.clone(),
        logprobs: params.logprobs,
        adapter: None,
        constraint,
        priority: params.priority,
        prompt_logprobs: params.prompt_logprobs,
        beam_search: params.beam_search,
    }
}

/// The context rule checked on the rendered prompt's bytes, before tokenizing it: a text of
/// `text_bytes` has at least `text_bytes / max_bytes_per_token` tokens, so a prompt far past
/// the context is refused without the seconds its tokenization would take.
fn check_prompt_bytes(
    param: &str,
    text_bytes: usize,
    max_bytes_per_token: usize,
    max_model_len: usize,
) -> Result<(), ApiError> {
    let at_least = text_bytes / max_bytes_per_token.max(1);
    if at_least >= max_model_len {
        return Err(ApiError::bad(
            param,
            format!(
                "This model's maximum context length is {max_model_len} tokens. However, your \
                 request has at least {at_least} input tokens ({text_bytes} bytes of prompt \
                 text). Please reduce the length of the input {}.",
                if param == "messages" {
                    "messages"
                } else {
                    "prompt"
                }
            ),
        ));
    }
    Ok(())
}

/// One prompt of a completion request, ready for the engine.
#[derive(Debug, Clone, PartialEq)]
pub struct CompletionPrompt {
    pub ids: Vec<u32>,
    /// What `echo` puts in front of the choices' text (empty without `echo`): a text prompt
    /// as sent, a token-id (or truncated) prompt's kept tokens decoded with special tokens
    /// kept.
    pub echo: String,
}

/// A completion's prompt → its token ids: text tokenized as `/tokenize` does (special tokens in
/// the text recognised, BOS in front with `add_special_tokens` where the model wants it; a text
/// far past the context is refused by its byte count first), token ids taken as given; then
/// truncated to `truncate_prompt_tokens`. `param` names the prompt in errors.
pub fn prepare_completion(
    model: &ServedModel,
    params: &CompletionParams,
    prompt: &PromptInput,
    param: &str,
) -> Result<CompletionPrompt, ApiError> {
    let tok = &model.tokenizer;
    let mut ids = match prompt {
        PromptInput::Text(text) => {
            if params.truncate_prompt_tokens.is_none() {
                check_prompt_bytes(
                    param,
                    text.len(),
                    model.max_text_bytes_per_token,
                    model.max_model_len,
                )?;
            }
            let mut ids = tok.encode(text, true);
            if params.add_special_tokens {
                prepend_bos(tok, &mut ids);
            }
            ids
        }
        PromptInput::Tokens(ids) => ids.clone(),
    };
    let mut truncated = false;
    if let Some(keep) = params.truncate_prompt_tokens {
        truncated = ids.len() > keep;
        ids.drain(..ids.len().saturating_sub(keep));
    }
    let echo = match prompt {
        _ if !params.echo => String::new(),
        PromptInput::Text(text) if !truncated => text.clone(),
        _ => tok.decode(
            &ids,
            DecodeOptions {
                skip_special_tokens: false,
                spaces_between_special_tokens: params.stopping.spaces_between_special_tokens,
            },
        ),
    };
    Ok(CompletionPrompt { ids, echo })
}

/// The engine's request for one prompt of a completion: `best_of` choices; no explicit
/// `max_tokens` is 16 or what the context leaves, when less; `echo` with `logprobs` asks for
/// the prompt's logprobs too, and `best_of` above `n` for the sampled tokens' logprobs (the
/// choices are ranked by their sum).
pub fn completion_request(
    model: &ServedModel,
    params: &CompletionParams,
    request_id: String,
    prompt: Vec<u32>,
    constraint: Option<Grammar>,
    adapter: Option<Arc<LoraAdapter>>,
) -> GenerationRequest {
    let mut stopping = params.stopping.clone();
    if stopping.max_tokens.is_none() {
        let room = model.max_model_len.saturating_sub(prompt.len());
        // A prompt with no room left is refused by the engine, whatever this says.
        stopping.max_tokens = Some(DEFAULT_COMPLETION_MAX_TOKENS.min(room).max(1));
    }
    let echo_logprobs = params.logprobs.filter(|_| params.echo);
    let prompt_logprobs = match (params.prompt_logprobs, echo_logprobs) {
        (Some(a), Some(b)) => Some(a.max(b)),
        (a, b) => a.or(b),
    };
    let ranked = params.best_of > params.n;
    GenerationRequest {
        cache_salt: params.extras.cache_salt.clone(),
        request_id,
        prompt,
        n: params.best_of,
        sampling: params.sampling.clone(),
        stopping,
        logprobs: params.logprobs.or(ranked.then_some(0)),
        adapter,
        constraint,
        priority: params.priority,
        prompt_logprobs,
        beam_search: params.beam_search,
    }
}

/// The reasoning parser for this request's output, when the template it renders with writes
/// `<think>` (the rule docs/api.md documents). It starts inside the reasoning when the prompt
/// itself ends with `<think>` (templates that open the thinking in the generation prompt).
pub fn reasoning_parser(
    model: &ServedModel,
    p: &PromptParams,
    prompt_ids: &[u32],
) -> Option<ReasoningParser> {
    let marks = match &p.chat_template {
        Some(src) => src.contains(THINK_START),
        None => model
            .chat_template
            .as_ref()
            .is_some_and(|t| t.marks_thinking()),
    };
    if !marks {
        return None;
    }
    // `<think>` is a few tokens at most; decoding a short tail is enough to see it.
    let tail = &prompt_ids[prompt_ids.len().saturating_sub(16)..];
    let text = model.tokenizer.decode(
        tail,
        DecodeOptions {
            skip_special_tokens: false,
            spaces_between_special_tokens: false,
        },
    );
    Some(ReasoningParser::new(text.trim_end().ends_with(THINK_START)))
}

/// `add_special_tokens`: BOS in front where the model wants it ([`Tokenizer::add_bos`]), as
/// Hugging Face tokenizers of these models add it (Qwen's never do).
pub fn prepend_bos(tok: &Tokenizer, ids: &mut Vec<u32>) {
    if let Some(bos) = tok.bos_id().filter(|_| tok.add_bos()) {
        ids.insert(0, bos);
    }
}

/// The text and raw bytes a token stands for ([`Tokenizer::logprob_token`], whose inverse the
/// trainer uses on trajectories posted back); empty for an id outside the vocabulary.
pub fn token_text(tok: &Tokenizer, id: u32) -> (String, Vec<u8>) {
    tok.logprob_token(id).unwrap_or_default()
}

/// JSON has no -inf; vLLM reports such logprobs as -9999.
pub(crate) fn finite(lp: f32) -> f32 {
    if lp.is_finite() {
        lp
    } else {
        -9999.0
    }
}

/// A prompt position's entry of `prompt_logprobs`: the prompt's token with its rank, then
/// the top tokens (ranked by place) without repeating it.
pub fn prompt_logprobs_at(tok: &Tokenizer, p: &PromptLogprob) -> PromptLogprobsAt {
    let entry = |id: u32, logprob: f32, rank: usize| {
        (
            id,
            PromptTokenLogprob {
                logprob: finite(logprob),
                rank,
                decoded_token: token_text(tok, id).0,
            },
        )
    };
    let top = p
        .top
        .iter()
        .enumerate()
        .filter(|(_, &(id, _))| id != p.token)
        .map(|(i, &(id, l))| entry(id, l, i + 1));
    PromptLogprobsAt(
        std::iter::once(entry(p.token, p.logprob, p.rank))
            .chain(top)
            .collect(),
    )
}

/// `as_ids` (`return_tokens_as_token_ids`): every `token` is `"token_id:<id>"`, so that clients
/// get ids back even for tokens whose text is ambiguous; `bytes` stay the token's exact bytes.
pub fn logprob_entry(tok: &Tokenizer, id: u32, lp: &TokenLogprob, as_ids: bool) -> LogprobEntry {
    let text = |id: u32| {
        let (token, bytes) = token_text(tok, id);
        if as_ids {
            (format!("token_id:{id}"), bytes)
        } else {
            (token, bytes)
        }
    };
    let (token, bytes) = text(id);
    LogprobEntry {
        token,
        logprob: finite(lp.logprob),
        bytes,
        top_logprobs: lp
            .top
            .iter()
            .map(|&(alt, l)| {
                let (token, bytes) = text(alt);
                TopLogprob {
                    token,
                    logprob: finite(l),
                    bytes,
                }
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use temper_engine::BeamSearch;

    use super::*;
    use crate::validation::tests::ok;

    #[test]
    fn generation_request_carries_everything() {
        let p = ok(
            json!({"n": 2, "temperature": 0.7, "top_k": 3, "seed": 9, "max_completion_tokens": 5,
            "stop": ["x"], "stop_token_ids": [7], "ignore_eos": true, "logprobs": true, "top_logprobs": 2}),
        );
        let g = engine_request(&p, "r1".into(), vec![1, 2, 3], None);
        assert_eq!(g.request_id, "r1");
        assert_eq!(g.prompt, vec![1, 2, 3]);
        assert_eq!(g.n, 2);
        assert_eq!(g.sampling.temperature, 0.7);
        assert_eq!(g.sampling.top_k, 3);
        assert_eq!(g.sampling.seed, Some(9));
        assert_eq!(g.stopping.max_tokens, Some(5));
        assert_eq!(g.stopping.stop, vec!["x"]);
        assert_eq!(g.stopping.stop_token_ids, vec![7]);
        assert!(g.stopping.ignore_eos);
        assert_eq!(g.logprobs, Some(2));
        let g = engine_request(&ok(json!({})), "r".into(), vec![1; 40], None);
        assert_eq!(g.stopping.max_tokens, None);
        let g = engine_request(
            &ok(json!({"prompt_logprobs": 3})),
            "r".into(),
            vec![1, 2],
            None,
        );
        assert_eq!(g.prompt_logprobs, Some(3));
        let p =
            ok(json!({"use_beam_search": true, "n": 3, "temperature": 0, "length_penalty": 0.5}));
        let g = engine_request(&p, "r".into(), vec![1, 2], None);
        assert_eq!(
            (g.n, g.beam_search),
            (
                3,
                Some(BeamSearch {
                    length_penalty: 0.5
                })
            )
        );
    }
}
