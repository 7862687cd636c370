//! vLLM's `POST /tokenize` and `POST /detokenize`.

use axum::extract::State;
use axum::{Extension, Json};
use temper_text::DecodeOptions;

use crate::auth::RequestContext;
use crate::error::ApiError;
use crate::extract::ValidJson;
use crate::prompt::{chat_prompt, prepend_bos, token_text};
use crate::protocol::{DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse};
use crate::sampling::token_ids;
use crate::state::AppState;
use crate::validation::{convert_messages, request_template, PromptParams};

/// `{model, prompt, add_special_tokens=true}` or `{model, messages, add_generation_prompt=true,
/// continue_final_message, add_special_tokens=false, chat_template, chat_template_kwargs, tools}`.
pub async fn tokenize(
    State(state): State<AppState>,
    Extension(ctx): Extension<RequestContext>,
    ValidJson(req): ValidJson<TokenizeRequest>,
) -> Result<Json<TokenizeResponse>, ApiError> {
    // A trained model's name tokenizes as its base model.
    let model = state.resolve(req.model.as_deref(), &ctx.team).await?.base;
    let limits = state.limits(&model);
    // Tokenizing up to the body limit takes a while: on a blocking thread (see chat.rs).
    tokio::task::spawn_blocking(move || {
        let tok = &model.tokenizer;
        let tokens = match (req.prompt, req.messages) {
            (Some(prompt), None) => {
                let mut ids = tok.encode(&prompt, true);
                if req.add_special_tokens.unwrap_or(true) {
                    prepend_bos(tok, &mut ids);
                }
                ids
            }
            (None, Some(messages)) => {
                let add_generation_prompt = req.add_generation_prompt.unwrap_or(true);
                let continue_final_message = req.continue_final_message.unwrap_or(false);
                if add_generation_prompt && continue_final_message {
                    return Err(ApiError::bad(
                        "continue_final_message",
                        "`continue_final_message` needs `add_generation_prompt: false`.",
                    ));
                }
                let params = PromptParams {
                    messages: convert_messages(&messages)?,
                    add_generation_prompt,
                    continue_final_message,
                    chat_template: request_template(req.chat_template, &limits)?,
                    chat_template_kwargs: req.chat_template_kwargs.unwrap_or_default(),
                    add_special_tokens: req.add_special_tokens.unwrap_or(false),
                    tools: crate::extras::tools(req.tools)?,
                    // vLLM's chat tokenize request has no `documents` or `reasoning_effort`.
                    documents: None,
                    reasoning_effort: None,
                };
                chat_prompt(&model, &params)?
            }
            _ => {
                return Err(ApiError::bad_body(
                    "Send either `prompt` or `messages` (exactly one).",
                ))
            }
        };
        let token_strs = req
            .return_token_strs
            .unwrap_or(false)
            .then(|| tokens.iter().map(|&t| token_text(tok, t).0).collect());
        Ok(Json(TokenizeResponse {
            count: tokens.len(),
            max_model_len: model.max_model_len,
            tokens,
            token_strs,
        }))
    })
    .await
    .map_err(|e| ApiError::Internal(format!("the tokenize task failed: {e}")))?
}

pub async fn detokenize(
    State(state): State<AppState>,
    Extension(ctx): Extension<RequestContext>,
    ValidJson(req): ValidJson<DetokenizeRequest>,
) -> Result<Json<DetokenizeResponse>, ApiError> {
    let model = state.resolve(req.model.as_deref(), &ctx.team).await?.base;
    let ids = token_ids("tokens", req.tokens, model.tokenizer.vocab_size())?;
    // vLLM decodes with special tokens kept, so a round trip of /tokenize output is exact.
    let prompt = model.tokenizer.decode(
        &ids,
        DecodeOptions {
            skip_special_tokens: false,
            spaces_between_special_tokens: true,
        },
    );
    Ok(Json(DetokenizeResponse { prompt }))
}
