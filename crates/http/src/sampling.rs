//! The sampling and stopping fields of a chat or completion request, validated into the
//! engine's own `SamplingParams` and `StopParams`: part of the one validation step in
//! `validation`, kept here because there are many of them. Both routes read them through one
//! view, [`SamplingFields`], so they are checked by the same code.

use temper_engine::{RepetitionDetection, SamplingParams, StopParams};

use crate::error::ApiError;
use crate::protocol::{JsonObject, SamplingFields, StopField};

/// Temperature, nucleus, top-k, min-p, seed, and the logits processors (logit_bias,
/// allowed_token_ids, bad_words, penalties), with their defaults and range checks.
pub fn sampling_params(
    req: &SamplingFields<'_>,
    vocab_size: usize,
) -> Result<SamplingParams, ApiError> {
    let temperature = req.temperature.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(ApiError::bad(
            "temperature",
            format!("`temperature` must be in [0, 2], got {temperature}."),
        ));
    }
    let top_p = req.top_p.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(ApiError::bad(
            "top_p",
            format!("`top_p` must be in (0, 1], got {top_p}."),
        ));
    }
    let top_k = match req.top_k.unwrap_or(0) {
        -1 | 0 => 0,
        k if k >= 1 => usize::try_from(k).unwrap_or(usize::MAX),
        k => {
            return Err(ApiError::bad(
                "top_k",
                format!("`top_k` must be -1, 0 (off) or at least 1, got {k}."),
            ))
        }
    };
    let min_p = req.min_p.unwrap_or(0.0);
    if !(0.0..=1.0).contains(&min_p) {
        return Err(ApiError::bad(
            "min_p",
            format!("`min_p` must be in [0, 1], got {min_p}."),
        ));
    }
    // int64 range is enforced by parsing; -1 is vLLM's "unseeded". Other negative seeds are
    // valid int64 values and keep their bits.
    let seed = match req.seed {
        None | Some(-1) => None,
        Some(s) => Some(s as u64),
    };

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
    for (key, &bias) in req.logit_bias.into_iter().flatten() {
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

    let allowed_token_ids = match req.allowed_token_ids {
        None => None,
        Some(ids) if ids.is_empty() => {
            return Err(ApiError::bad(
                "allowed_token_ids",
                "`allowed_token_ids` must not be empty.",
            ))
        }
        Some(ids) => Some(token_ids("allowed_token_ids", ids.clone(), vocab_size)?),
    };

    let bad_words = req.bad_words.cloned().unwrap_or_default();
    // An empty word bans nothing (it has no tokens): accepting it would be a field without effect.
    if let Some(i) = bad_words.iter().position(String::is_empty) {
        return Err(ApiError::bad(
            format!("bad_words[{i}]"),
            "A bad word must not be empty.".to_owned(),
        ));
    }

    Ok(SamplingParams {
        temperature: temperature as f32,
        top_p: top_p as f32,
        top_k,
        min_p: min_p as f32,
        seed,
        logit_bias,
        allowed_token_ids,
        bad_words,
        repetition_penalty: repetition_penalty as f32,
        frequency_penalty,
        presence_penalty,
    })
}

/// Stop strings and tokens, EOS handling, min_tokens and repetition detection. `max_tokens` is
/// the explicit completion budget, if any: the engine checks it, and `min_tokens`, against the
/// context once the prompt is known.
pub fn stop_params(
    req: &SamplingFields<'_>,
    vocab_size: usize,
    max_tokens: Option<usize>,
) -> Result<StopParams, ApiError> {
    let min_tokens = match req.min_tokens.unwrap_or(0) {
        m if m < 0 => {
            return Err(ApiError::bad(
                "min_tokens",
                format!("`min_tokens` must be >= 0, got {m}."),
            ))
        }
        m => usize::try_from(m).unwrap_or(usize::MAX),
    };
    let repetition_detection = match req.repetition_detection {
        None => None,
        Some(obj) => repetition_detection(obj)?,
    };

    let stop = match req.stop {
        None => Vec::new(),
        Some(StopField::One(s)) => vec![s.clone()],
        Some(StopField::Many(v)) => v.clone(),
    };
    if stop.iter().any(String::is_empty) {
        return Err(ApiError::bad("stop", "Stop strings must not be empty."));
    }
    let stop_token_ids = token_ids(
        "stop_token_ids",
        req.stop_token_ids.cloned().unwrap_or_default(),
        vocab_size,
    )?;
    Ok(StopParams {
        max_tokens,
        stop,
        stop_token_ids,
        ignore_eos: req.ignore_eos.unwrap_or(false),
        include_stop_str_in_output: req.include_stop_str_in_output.unwrap_or(false),
        skip_special_tokens: req.skip_special_tokens.unwrap_or(true),
        spaces_between_special_tokens: req.spaces_between_special_tokens.unwrap_or(true),
        min_tokens,
        repetition_detection,
    })
}

pub(crate) fn token_ids(
    param: &str,
    ids: Vec<i64>,
    vocab_size: usize,
) -> Result<Vec<u32>, ApiError> {
    ids.into_iter()
        .map(|id| {
            u32::try_from(id)
                .ok()
                .filter(|&t| (t as usize) < vocab_size)
                .ok_or_else(|| {
                    ApiError::bad(
                        param,
                        format!("Token id {id} is outside the vocabulary (size {vocab_size})."),
                    )
                })
        })
        .collect()
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
