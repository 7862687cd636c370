use std::collections::HashMap;

use candle_core::quantized::gguf_file::Value;

use crate::ModelError;

/// The model families the decoder runs: each is a setting of the switches in [`ModelConfig`],
/// not code of its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    /// Llama 2 and 3.x, SmolLM2, Mistral-style models without a sliding window.
    Llama,
    /// Qwen 2 and 2.5.
    Qwen2,
    Qwen3,
    Gemma3,
    /// SmolLM3: Llama's layers, but every fourth one without RoPE.
    Smollm3,
}

impl Arch {
    pub const ALL: [Arch; 5] = [
        Arch::Llama,
        Arch::Qwen2,
        Arch::Qwen3,
        Arch::Gemma3,
        Arch::Smollm3,
    ];

    /// The GGUF `general.architecture` (and the prefix of its other keys).
    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
            Arch::Gemma3 => "gemma3",
            Arch::Smollm3 => "smollm3",
        }
    }

    /// Every supported name, for the error that refuses another.
    pub fn names() -> String {
        Arch::ALL.map(Arch::name).join(", ")
    }
}

/// Which dimensions of a head RoPE rotates together. llama.cpp's converter permutes Llama's
/// q/k rows so that GGUF `llama` pairs neighbours (ggml's "normal" rope); the other families
/// keep Hugging Face's halves (NEOX).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeLayout {
    /// Dimensions `2i` and `2i + 1`.
    Interleaved,
    /// Dimensions `i` and `i + head_dim / 2`.
    HalfSplit,
}

/// The gated MLP's `act(gate) * up`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// Tanh-approximated GELU (Gemma).
    Gelu,
    /// SiLU (SwiGLU: Llama, Qwen).
    Silu,
}

/// YaRN's blend of scaled and original RoPE frequencies (ggml's `rope_yarn`, ramp factor 1).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Yarn {
    /// Pairs below `low` keep their original angle, pairs above `high` take the scaled one, and
    /// a linear ramp blends those between.
    pub low: f32,
    pub high: f32,
    /// The scale of cos and sin: `attn_factor · (1 + 0.1 ln(factor))`.
    pub mscale: f32,
}

/// Hyper-parameters of a model, and which of the family's optional parts it has.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub arch: Arch,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rope_base_global: f32,
    pub rope_base_local: f32,
    /// Linear RoPE scaling of the global layers' angles: `1 / rope.scaling.factor`, 1 for none.
    pub rope_freq_scale: f32,
    /// Divisors of each frequency's angle, `head_dim / 2` of them (the `rope_freqs` tensor:
    /// Llama 3's frequency smoothing).
    pub rope_freq_factors: Option<Vec<f32>>,
    /// YaRN on the global layers, where the file's scaling type says so.
    pub rope_yarn: Option<Yarn>,
    pub rope_layout: RopeLayout,
    /// A token on a local layer sees the last `sliding_window` positions, itself included.
    pub sliding_window: usize,
    /// Layer `i` is global when `i % global_every == global_every - 1`; 1 (every layer global)
    /// for the families without local layers.
    pub global_every: usize,
    /// Layer `i` rotates neither queries nor keys when `(i + 1) % n == 0` for `Some(n)`
    /// (SmolLM3's 4, which llama.cpp hard-codes as `n_no_rope_layer_step` and the converter
    /// writes no key for); `None`: every layer has RoPE.
    pub no_rope_every: Option<usize>,
    pub rms_eps: f32,
    pub context_length: usize,
    pub activation: Activation,
    /// Embedding rows times `sqrt(hidden_size)` (Gemma).
    pub scale_embeddings: bool,
    /// RMSNorms of each head's queries and keys before RoPE (Qwen3, Gemma 3).
    pub qk_norm: bool,
    /// Biases on the q, k and v projections (Qwen2).
    pub qkv_bias: bool,
    /// RMSNorms of the attention's and the MLP's outputs before their residual adds (Gemma).
    pub post_norms: bool,
    /// The attention scores' scale: 1/sqrt(head_dim), but for Gemma 3 27B 1/sqrt(hidden / heads)
    /// (its `query_pre_attn_scalar` 168, not the head size 128; GGUF has no key for it, and
    /// llama.cpp tells the 27B by its 62 layers, as here).
    pub attention_scale: f32,
    /// The LM head is the embedding table (the file has no `output.weight`): set by the loader,
    /// which sees the tensors; false from the metadata alone.
    pub tied_embeddings: bool,
}

/// Gemma 3 27B's layer count, by which llama.cpp tells its attention scale.
const GEMMA3_27B_LAYERS: usize = 62;

/// SmolLM3's layers without RoPE: every fourth (transformers' `no_rope_layer_interval`, which
/// llama.cpp hard-codes: GGUF has no key for it).
const SMOLLM3_NO_ROPE_EVERY: usize = 4;

impl ModelConfig {
    pub fn is_global(&self, layer: usize) -> bool {
        layer % self.global_every == self.global_every - 1
    }

    /// Whether `layer` applies RoPE to its queries and keys (see `no_rope_every`).
    pub fn uses_rope(&self, layer: usize) -> bool {
        self.no_rope_every
            .is_none_or(|n| !(layer + 1).is_multiple_of(n))
    }

    /// Reads the `{arch}.*` keys; `vocab_size` comes from the embedding tensor, not from here,
    /// and `rope_freq_factors` from the `rope_freqs` tensor (the loader's).
    pub(crate) fn from_metadata(
        md: &HashMap<String, Value>,
        vocab_size: usize,
    ) -> Result<Self, ModelError> {
        let name = md
            .get("general.architecture")
            .and_then(|v| v.to_string().ok())
            .cloned()
            .unwrap_or_default();
        let arch = Arch::ALL
            .into_iter()
            .find(|a| a.name() == name)
            .ok_or(ModelError::Architecture(name))?;
        let gemma = arch == Arch::Gemma3;
        let key = |k: &str| format!("{}.{k}", arch.name());
        let hidden_size = get_usize(md, &key("embedding_length"))?;
        let num_heads = get_usize(md, &key("attention.head_count"))?;
        let num_kv_heads = opt_usize(md, &key("attention.head_count_kv"))?.unwrap_or(num_heads);
        let head_dim =
            opt_usize(md, &key("attention.key_length"))?.unwrap_or(hidden_size / num_heads.max(1));
        let same_as_head = |k: &str, what: &str| -> Result<(), ModelError> {
            match opt_usize(md, &key(k))? {
                Some(v) if v != head_dim => Err(meta_err(
                    &key(k),
                    format!("{v} differs from the key length {head_dim} ({what})"),
                )),
                _ => Ok(()),
            }
        };
        same_as_head("attention.value_length", "not supported")?;
        same_as_head(
            "rope.dimension_count",
            "partial rotary embeddings are not supported",
        )?;
        for k in ["final_logit_softcapping", "attn_logit_softcapping"] {
            if get_f32_or(md, &key(k), 0.0)? != 0.0 {
                return Err(meta_err(&key(k), "soft-capping is not supported".into()));
            }
        }
        let context_length = get_usize(md, &key("context_length"))?;
        let (sliding_window, global_every) = if gemma {
            // llama.cpp hard-codes the pattern 6 for Gemma 3; the key lets smaller models (the
            // tiny test model) have a global layer.
            let every = opt_usize(md, &key("attention.sliding_window_pattern"))?.unwrap_or(6);
            (get_usize(md, &key("attention.sliding_window"))?, every)
        } else {
            if opt_usize(md, &key("attention.sliding_window"))?.is_some_and(|w| w > 0) {
                return Err(meta_err(
                    &key("attention.sliding_window"),
                    format!(
                        "sliding-window attention is not supported on {}",
                        arch.name()
                    ),
                ));
            }
            (context_length, 1)
        };
        let rope_base_global = get_f32_or(
            md,
            &key("rope.freq_base"),
            if gemma { 1_000_000.0 } else { 10_000.0 },
        )?;
        let (rope_freq_scale, yarn) = rope_freq_scale(md, &key)?;
        let rope_yarn = yarn
            .then(|| {
                let dims = (head_dim, rope_base_global, rope_freq_scale);
                read_yarn(md, &key, dims, context_length)
            })
            .transpose()?;
        let num_layers = get_usize(md, &key("block_count"))?;
        let cfg = ModelConfig {
            arch,
            vocab_size,
            hidden_size,
            intermediate_size: get_usize(md, &key("feed_forward_length"))?,
            num_layers,
            num_heads,
            num_kv_heads,
            head_dim,
            rope_base_global,
            // Gemma 3 uses 10k on its sliding-window layers (newer files say so).
            rope_base_local: if gemma {
                get_f32_or(md, &key("rope.freq_base_swa"), 10_000.0)?
            } else {
                rope_base_global
            },
            rope_freq_scale,
            rope_freq_factors: None,
            rope_yarn,
            rope_layout: match arch {
                // The converter permutes SmolLM3's q/k rows as Llama's.
                Arch::Llama | Arch::Smollm3 => RopeLayout::Interleaved,
                Arch::Qwen2 | Arch::Qwen3 | Arch::Gemma3 => RopeLayout::HalfSplit,
            },
            sliding_window,
            global_every,
            no_rope_every: (arch == Arch::Smollm3).then_some(SMOLLM3_NO_ROPE_EVERY),
            rms_eps: if gemma {
                get_f32_or(md, &key("attention.layer_norm_rms_epsilon"), 1e-6)?
            } else {
                get_f32(md, &key("attention.layer_norm_rms_epsilon"))?
            },
            context_length,
            activation: if gemma {
                Activation::Gelu
            } else {
                Activation::Silu
            },
            scale_embeddings: gemma,
            qk_norm: matches!(arch, Arch::Qwen3 | Arch::Gemma3),
            qkv_bias: arch == Arch::Qwen2,
            post_norms: gemma,
            attention_scale: if gemma && num_layers == GEMMA3_27B_LAYERS {
                1.0 / ((hidden_size / num_heads.max(1)) as f32).sqrt()
            } else {
                1.0 / (head_dim as f32).sqrt()
            },
            tied_embeddings: false,
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
            Some((_, reason)) => Err(meta_err(self.arch.name(), (*reason).to_string())),
            None => Ok(()),
        }
    }
}

/// The global layers' angle scale and whether it is YaRN's, read as llama.cpp does: the scaling
/// type defaults to linear and the factor to none; the old `rope.scale_linear` key stands in for
/// a missing factor.
fn rope_freq_scale(
    md: &HashMap<String, Value>,
    key: &dyn Fn(&str) -> String,
) -> Result<(f32, bool), ModelError> {
    let type_key = key("rope.scaling.type");
    let kind = match md.get(&type_key) {
        None => "linear",
        Some(v) => v
            .to_string()
            .map_err(|_| meta_err(&type_key, format!("expected a string, got {v:?}")))?,
    };
    let factor_key = key("rope.scaling.factor");
    let factor = if md.contains_key(&factor_key) {
        get_f32(md, &factor_key)?
    } else {
        get_f32_or(md, &key("rope.scale_linear"), 0.0)?
    };
    let yarn = match kind {
        "none" => return Ok((1.0, false)),
        "linear" => false,
        "yarn" => true,
        other => {
            return Err(meta_err(
                &type_key,
                format!(
                    "RoPE scaling {other:?} is not supported (none, linear and yarn are, and \
                     Llama 3's rope_freqs tensor)"
                ),
            ))
        }
    };
    let valid = factor.is_finite() && if yarn { factor >= 1.0 } else { factor > 0.0 };
    if factor == 0.0 && !yarn {
        Ok((1.0, false))
    } else if valid {
        Ok((1.0 / factor, yarn))
    } else {
        Err(meta_err(&factor_key, format!("{factor} is not a scale")))
    }
}

/// YaRN's ramp and scale as llama.cpp sets them for these families (`ggml_rope_yarn_corr_dims`,
/// and `attn_factor` after `llama_context` cancels its own `get_mscale`): `dims` are the head
/// size, the RoPE base and the frequency scale.
fn read_yarn(
    md: &HashMap<String, Value>,
    key: &dyn Fn(&str) -> String,
    (head_dim, base, freq_scale): (usize, f32, f32),
    context_length: usize,
) -> Result<Yarn, ModelError> {
    for k in [
        "rope.scaling.yarn_log_multiplier",
        "rope.scaling.yarn_ext_factor",
    ] {
        if md.contains_key(&key(k)) {
            return Err(meta_err(&key(k), "not supported".into()));
        }
    }
    let orig = opt_usize(md, &key("rope.scaling.original_context_length"))?
        .unwrap_or(context_length) as f32;
    let beta_fast = get_f32_or(md, &key("rope.scaling.yarn_beta_fast"), 32.0)?;
    let beta_slow = get_f32_or(md, &key("rope.scaling.yarn_beta_slow"), 1.0)?;
    let n = head_dim as f32;
    let corr_dim =
        |beta: f32| n * (orig / (beta * 2.0 * std::f32::consts::PI)).ln() / (2.0 * base.ln());
    let attn_factor = get_f32_or(md, &key("rope.scaling.attn_factor"), 1.0)?;
    Ok(Yarn {
        low: corr_dim(beta_fast).floor().max(0.0),
        high: corr_dim(beta_slow).ceil().min(n - 1.0),
        mscale: attn_factor * (1.0 + 0.1 * (1.0 / freq_scale).ln()),
    })
}

fn meta_err(key: &str, reason: String) -> ModelError {
    ModelError::Metadata {
        key: key.to_string(),
        reason,
    }
}

fn get_usize(md: &HashMap<String, Value>, key: &str) -> Result<usize, ModelError> {
    opt_usize(md, key)?.ok_or_else(|| meta_err(key, "missing".to_string()))
}

fn opt_usize(md: &HashMap<String, Value>, key: &str) -> Result<Option<usize>, ModelError> {
    let Some(v) = md.get(key) else {
        return Ok(None);
    };
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
    usize::try_from(n)
        .map(Some)
        .map_err(|_| meta_err(key, format!("{n} is out of range")))
}

fn get_f32(md: &HashMap<String, Value>, key: &str) -> Result<f32, ModelError> {
    match md.get(key) {
        None => Err(meta_err(key, "missing".to_string())),
        Some(_) => get_f32_or(md, key, 0.0),
    }
}

fn get_f32_or(md: &HashMap<String, Value>, key: &str, default: f32) -> Result<f32, ModelError> {
    match md.get(key) {
        None => Ok(default),
        Some(Value::F32(x)) => Ok(*x),
        Some(Value::F64(x)) => Ok(*x as f32),
        Some(other) => Err(meta_err(key, format!("expected a float, got {other:?}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Gemma 3's shapes from its metadata: 27B (62 layers, width 5376, 32 heads of 128) scales
    /// by 1/sqrt(168) as its `query_pre_attn_scalar`, the others by 1/sqrt(head size).
    fn gemma3(layers: u32, width: u32, heads: u32) -> ModelConfig {
        let md: HashMap<String, Value> = [
            ("general.architecture", Value::String("gemma3".into())),
            ("gemma3.embedding_length", Value::U32(width)),
            ("gemma3.block_count", Value::U32(layers)),
            ("gemma3.feed_forward_length", Value::U32(4 * width)),
            ("gemma3.attention.head_count", Value::U32(heads)),
            ("gemma3.attention.head_count_kv", Value::U32(heads / 2)),
            ("gemma3.attention.key_length", Value::U32(128)),
            ("gemma3.attention.value_length", Value::U32(128)),
            ("gemma3.attention.sliding_window", Value::U32(1024)),
            ("gemma3.context_length", Value::U32(131_072)),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        ModelConfig::from_metadata(&md, 262_208).expect("config")
    }

    #[test]
    fn gemma3_27b_scales_attention_by_its_query_pre_attn_scalar() {
        assert_eq!(gemma3(62, 5376, 32).attention_scale, 1.0 / 168f32.sqrt());
        // 12B: 48 layers, width 3840, 16 heads of 256 (here 128: what the scale reads).
        assert_eq!(gemma3(48, 3840, 16).attention_scale, 1.0 / 128f32.sqrt());
    }
}
