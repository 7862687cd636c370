//! Validation of the logits-processing and stopping controls (logit_bias, allowed_token_ids,
//! bad_words, penalties, min_tokens, repetition_detection) and return_tokens_as_token_ids:
//! part of the one validation step in `validation`, kept here because there are many of them.

use temper_engine::RepetitionDetection;

use crate::error::ApiError;
use crate::protocol::{ChatCompletionRequest, JsonObject};
use crate::validation::token_ids;

/// The controls after range checks, in the engine's terms.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingControls {
    /// Sorted by token id; biases clamped to [-100, 100].
    pub logit_bias: Vec<(u32, f32)>,
    pub allowed_token_ids: Option<Vec<u32>>,
    pub bad_words: Vec<String>,
    pub repetition_penalty: f32,
    pub frequency_penalty: f32,
    pub presence_penalty: f32,
    pub min_tokens: usize,
    /// `None` when off (absent, or `max_pattern_size` 0).
    pub repetition_detection: Option<RepetitionDetection>,
    /// Logprob `token`s become `"token_id:<id>"`.
    pub return_tokens_as_token_ids: bool,
}

/// `max_tokens` is the explicit completion budget, if any (`min_tokens` may not exceed it; the
/// implicit budget is checked once the prompt length is known).
pub fn sampling_controls(
    req: &ChatCompletionRequest,
    vocab_size: usize,
    max_tokens: Option<usize>,
) -> Result<SamplingControls, ApiError> {
    let penalty = |param: &str, value: Option<f64>| -> Result<f32, ApiError> {
        let v = value.unwrap_or(0.0);
        if !(-2.0..=2.0).contains(&v) {
            return Err(ApiError::bad(
                param,
                format!("`{param}` must be in [-2, 2], got {v}."),
            ));
        }
        Ok(v as f32)
    };
    let frequency_penalty = penalty("frequency_penalty", req.frequency_penalty)?;
    let presence_penalty = penalty("presence_penalty", req.presence_penalty)?;
    let repetition_penalty = req.repetition_penalty.unwrap_or(1.0);
    if !(repetition_penalty > 0.0 && repetition_penalty.is_finite()) {
        return Err(ApiError::bad(
            "repetition_penalty",
            format!("`repetition_penalty` must be > 0, got {repetition_penalty}."),
        ));
    }

    let mut logit_bias = Vec::new();
    for (key, &bias) in req.logit_bias.iter().flatten() {
        let id = key.trim().parse::<i64>().map_err(|_| {
            ApiError::bad(
                "logit_bias",
                format!("`logit_bias` keys must be token ids (integers), got {key:?}."),
            )
        })?;
        let id = token_ids("logit_bias", vec![id], vocab_size)?[0];
        logit_bias.push((id, bias.clamp(-100.0, 100.0) as f32));
    }
    logit_bias.sort_by_key(|&(id, _)| id);
    // "5" and "05" name the same token; which bias was meant is ambiguous (JSON objects have
    // no order we keep), so that is an error rather than a silent pick.
    if let Some(w) = logit_bias.windows(2).find(|w| w[0].0 == w[1].0) {
        return Err(ApiError::bad(
            "logit_bias",
            format!("`logit_bias` names token {} more than once.", w[0].0),
        ));
    }

    let allowed_token_ids = match &req.allowed_token_ids {
        None => None,
        Some(ids) if ids.is_empty() => {
            return Err(ApiError::bad(
                "allowed_token_ids",
                "`allowed_token_ids` must not be empty.",
            ))
        }
        Some(ids) => Some(token_ids("allowed_token_ids", ids.clone(), vocab_size)?),
    };

    let min_tokens = match req.min_tokens.unwrap_or(0) {
        m if m < 0 => {
            return Err(ApiError::bad(
                "min_tokens",
                format!("`min_tokens` must be >= 0, got {m}."),
            ))
        }
        m => usize::try_from(m).unwrap_or(usize::MAX),
    };
    if let Some(max) = max_tokens {
        check_min_tokens(min_tokens, max)?;
    }

    let repetition_detection = match &req.repetition_detection {
        None => None,
        Some(obj) => repetition_detection(obj)?,
    };

    let bad_words = req.bad_words.clone().unwrap_or_default();
    // An empty word bans nothing (it has no tokens): accepting it would be a field without effect.
    if let Some(i) = bad_words.iter().position(String::is_empty) {
        return Err(ApiError::bad(
            format!("bad_words[{i}]"),
            "A bad word must not be empty.".to_owned(),
        ));
    }

    Ok(SamplingControls {
        logit_bias,
        allowed_token_ids,
        bad_words,
        repetition_penalty: repetition_penalty as f32,
        frequency_penalty,
        presence_penalty,
        min_tokens,
        repetition_detection,
        return_tokens_as_token_ids: req.return_tokens_as_token_ids.unwrap_or(false),
    })
}

pub fn check_min_tokens(min_tokens: usize, max_tokens: usize) -> Result<(), ApiError> {
    if min_tokens > max_tokens {
        return Err(ApiError::bad(
            "min_tokens",
            format!("`min_tokens` ({min_tokens}) must not exceed the max tokens ({max_tokens})."),
        ));
    }
    Ok(())
}

/// `{max_pattern_size, min_pattern_size, min_count}`, each a non-negative integer (default 0);
/// a `max_pattern_size` of 0 turns detection off.
fn repetition_detection(obj: &JsonObject) -> Result<Option<RepetitionDetection>, ApiError> {
    let field = |name: &str| -> Result<usize, ApiError> {
        let param = format!("repetition_detection.{name}");
        match obj.get(name) {
            None | Some(serde_json::Value::Null) => Ok(0),
            Some(v) => v
                .as_u64()
                .and_then(|n| usize::try_from(n).ok())
                .ok_or_else(|| {
                    ApiError::bad(
                        &param,
                        format!("`{param}` must be an integer >= 0, got {v}."),
                    )
                }),
        }
    };
    let max_pattern_size = field("max_pattern_size")?;
    let min_pattern_size = field("min_pattern_size")?;
    let min_count = field("min_count")?;
    if min_pattern_size > max_pattern_size {
        return Err(ApiError::bad(
            "repetition_detection.min_pattern_size",
            format!(
                "`repetition_detection.min_pattern_size` ({min_pattern_size}) must not exceed \
                 `max_pattern_size` ({max_pattern_size})."
            ),
        ));
    }
    if max_pattern_size == 0 {
        return Ok(None);
    }
    if min_count < 2 {
        return Err(ApiError::bad(
            "repetition_detection.min_count",
            format!(
                "`repetition_detection.min_count` must be >= 2 when `max_pattern_size` > 0, got \
                 {min_count}."
            ),
        ));
    }
    Ok(Some(RepetitionDetection {
        min_pattern_size,
        max_pattern_size,
        min_count,
    }))
}
