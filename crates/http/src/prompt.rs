//! Messages → prompt token ids (chat completions and `/tokenize` share it), and token ids → the
//! strings and bytes the logprobs output shows.

use temper_engine::{PromptLogprob, TokenLogprob};
use temper_text::{
    ChatTemplate, DecodeOptions, ReasoningParser, TemplateInput, Tokenizer, THINK_START,
};

use crate::error::ApiError;
use crate::extras::ReasoningEffort;
use crate::protocol::{LogprobEntry, PromptLogprobsAt, PromptTokenLogprob, TopLogprob};
use crate::state::ServedModel;
use crate::validation::PromptParams;

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

/// `add_special_tokens`: BOS in front, as Hugging Face tokenizers of these models add it.
pub fn prepend_bos(tok: &Tokenizer, ids: &mut Vec<u32>) {
    if let Some(bos) = tok.bos_id() {
        ids.insert(0, bos);
    }
}

/// The text and raw bytes a token stands for ([`Tokenizer::logprob_token`], whose inverse the
/// trainer uses on trajectories posted back); empty for an id outside the vocabulary.
pub fn token_text(tok: &Tokenizer, id: u32) -> (String, Vec<u8>) {
    tok.logprob_token(id).unwrap_or_default()
}

/// JSON has no -inf; vLLM reports such logprobs as -9999.
fn finite(lp: f32) -> f32 {
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
