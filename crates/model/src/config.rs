use std::collections::HashMap;

use candle_core::quantized::gguf_file::Value;

use crate::ModelError;

/// Hyper-parameters of a Gemma 3 model.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rope_base_global: f32,
    pub rope_base_local: f32,
    /// A token on a local layer sees the last `sliding_window` positions, itself included.
    pub sliding_window: usize,
    /// Layer `i` is global when `i % global_every == global_every - 1`.
    pub global_every: usize,
    pub rms_eps: f32,
    pub context_length: usize,
}

impl ModelConfig {
    pub fn is_global(&self, layer: usize) -> bool {
        layer % self.global_every == self.global_every - 1
    }

    /// Reads the `gemma3.*` keys; `vocab_size` comes from the embedding tensor, not from here.
    pub(crate) fn from_metadata(
        md: &HashMap<String, Value>,
        vocab_size: usize,
    ) -> Result<Self, ModelError> {
        let arch = md
            .get("general.architecture")
            .and_then(|v| v.to_string().ok())
            .cloned()
            .unwrap_or_default();
        if arch != "gemma3" {
            return Err(ModelError::Architecture(arch));
        }
        let hidden_size = get_usize(md, "gemma3.embedding_length")?;
        let num_heads = get_usize(md, "gemma3.attention.head_count")?;
        let num_kv_heads = get_usize(md, "gemma3.attention.head_count_kv")?;
        let head_dim = if md.contains_key("gemma3.attention.key_length") {
            get_usize(md, "gemma3.attention.key_length")?
        } else {
            hidden_size / num_heads.max(1)
        };
        if md.contains_key("gemma3.attention.value_length") {
            let v = get_usize(md, "gemma3.attention.value_length")?;
            if v != head_dim {
                return Err(meta_err(
                    "gemma3.attention.value_length",
                    format!("{v} differs from the key length {head_dim}"),
                ));
            }
        }
        // llama.cpp hard-codes the pattern 6 for Gemma 3; the key lets smaller models (the tiny
        // test model) have a global layer.
        let global_every = if md.contains_key("gemma3.attention.sliding_window_pattern") {
            get_usize(md, "gemma3.attention.sliding_window_pattern")?
        } else {
            6
        };
        let cfg = ModelConfig {
            vocab_size,
            hidden_size,
            intermediate_size: get_usize(md, "gemma3.feed_forward_length")?,
            num_layers: get_usize(md, "gemma3.block_count")?,
            num_heads,
            num_kv_heads,
            head_dim,
            rope_base_global: get_f32_or(md, "gemma3.rope.freq_base", 1_000_000.0)?,
            // Not stored in the file: Gemma 3 uses 10k on its sliding-window layers.
            rope_base_local: 10_000.0,
            sliding_window: get_usize(md, "gemma3.attention.sliding_window")?,
            global_every,
            rms_eps: get_f32_or(md, "gemma3.attention.layer_norm_rms_epsilon", 1e-6)?,
            context_length: get_usize(md, "gemma3.context_length")?,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    fn validate(&self) -> Result<(), ModelError> {
        let checks = [
            (self.hidden_size > 0, "embedding_length must be positive"),
            (self.num_layers > 0, "block_count must be positive"),
            (self.num_heads > 0, "head_count must be positive"),
            (
                self.num_kv_heads > 0 && self.num_heads.is_multiple_of(self.num_kv_heads),
                "head_count_kv must divide head_count",
            ),
            (
                self.head_dim > 0 && self.head_dim.is_multiple_of(2),
                "key_length must be even",
            ),
            (self.sliding_window > 0, "sliding_window must be positive"),
            (
                self.global_every > 0,
                "sliding_window_pattern must be positive",
            ),
            (self.context_length > 0, "context_length must be positive"),
            // Shapes are products of these: a corrupt file must not wrap them around.
            (
                self.num_heads
                    .checked_mul(self.head_dim)
                    .and_then(|n| n.checked_mul(self.hidden_size))
                    .is_some_and(|n| n <= 1 << 40),
                "head_count * key_length * embedding_length is implausibly large",
            ),
        ];
        match checks.iter().find(|(ok, _)| !ok) {
            Some((_, reason)) => Err(meta_err("gemma3", (*reason).to_string())),
            None => Ok(()),
        }
    }
}

fn meta_err(key: &str, reason: String) -> ModelError {
    ModelError::Metadata {
        key: key.to_string(),
        reason,
    }
}

fn get_usize(md: &HashMap<String, Value>, key: &str) -> Result<usize, ModelError> {
    let v = md
        .get(key)
        .ok_or_else(|| meta_err(key, "missing".to_string()))?;
    let n: i128 = match v {
        Value::U8(x) => (*x).into(),
        Value::I8(x) => (*x).into(),
        Value::U16(x) => (*x).into(),
        Value::I16(x) => (*x).into(),
        Value::U32(x) => (*x).into(),
        Value::I32(x) => (*x).into(),
        Value::U64(x) => (*x).into(),
        Value::I64(x) => (*x).into(),
        other => return Err(meta_err(key, format!("expected an integer, got {other:?}"))),
    };
    usize::try_from(n).map_err(|_| meta_err(key, format!("{n} is out of range")))
}

fn get_f32_or(md: &HashMap<String, Value>, key: &str, default: f32) -> Result<f32, ModelError> {
    match md.get(key) {
        None => Ok(default),
        Some(Value::F32(x)) => Ok(*x),
        Some(Value::F64(x)) => Ok(*x as f32),
        Some(other) => Err(meta_err(key, format!("expected a float, got {other:?}"))),
    }
}
