use std::sync::Arc;

use candle_core::quantized::QTensor;
use candle_core::{Device, Tensor};

use crate::cache::{KvArena, SeqCache};
use crate::layer::{BatchLayout, CacheKv, Ropes};
use crate::linear::Linear;
use crate::lora::{LoraAdapter, LoraTarget};
use crate::ops;
use crate::{Activation, ModelConfig, ModelError};

/// One sequence of a batched forward: `tokens` are appended at positions `cache.len()..`.
pub struct SeqInput<'a> {
    pub tokens: &'a [u32],
    pub cache: &'a mut SeqCache,
    /// Logits for every token (scoring, training) instead of only the last one (generation).
    pub all_logits: bool,
    /// This sequence's LoRA adapter; `None` = the base weights.
    pub adapter: Option<&'a LoraAdapter>,
}

/// Row-major logits, `rows` x `vocab`.
#[derive(Debug, Clone, PartialEq)]
pub struct Logits {
    pub rows: usize,
    pub vocab: usize,
    pub data: Vec<f32>,
}

impl Logits {
    pub fn row(&self, i: usize) -> &[f32] {
        &self.data[i * self.vocab..(i + 1) * self.vocab]
    }
}

/// An RMSNorm's weight (GGUF stores Gemma's `1 + w` already).
pub(crate) struct RmsNorm(pub(crate) Vec<f32>);

impl RmsNorm {
    pub(crate) fn forward(&self, x: &mut [f32], eps: f32) {
        ops::rms_norm(x, &self.0, eps);
    }

    /// The gradient of the input rows `x` from that of the output, `dy`.
    pub(crate) fn backward(&self, x: &[f32], eps: f32, dy: &[f32]) -> Vec<f32> {
        ops::rms_norm_backward(x, &self.0, eps, dy)
    }
}

/// A norm some families have: the identity where the layer lacks it.
pub(crate) fn norm_if(norm: &Option<RmsNorm>, x: &mut [f32], eps: f32) {
    if let Some(norm) = norm {
        norm.forward(x, eps);
    }
}

/// Backward of [`norm_if`] at input `x`.
pub(crate) fn norm_if_backward(
    norm: &Option<RmsNorm>,
    x: &[f32],
    eps: f32,
    dy: &[f32],
) -> Vec<f32> {
    match norm {
        Some(norm) => norm.backward(x, eps, dy),
        None => dy.to_vec(),
    }
}

/// The attention block: `x + post_norm(o(attend(rope(q_norm(q)), rope(k_norm(k)), v)))` over
/// `norm(x)`; the optional parts are the family's (`ModelConfig`'s switches).
pub(crate) struct Attention {
    pub(crate) norm: RmsNorm,
    pub(crate) q: Linear,
    pub(crate) k: Linear,
    pub(crate) v: Linear,
    pub(crate) q_bias: Option<Vec<f32>>,
    pub(crate) k_bias: Option<Vec<f32>>,
    pub(crate) v_bias: Option<Vec<f32>>,
    pub(crate) q_norm: Option<RmsNorm>,
    pub(crate) k_norm: Option<RmsNorm>,
    pub(crate) o: Linear,
    pub(crate) post_norm: Option<RmsNorm>,
}

/// The gated MLP block: `x + post_norm(down(act(gate(norm(x))) * up(norm(x))))`.
pub(crate) struct Mlp {
    pub(crate) norm: RmsNorm,
    pub(crate) gate: Linear,
    pub(crate) up: Linear,
    pub(crate) down: Linear,
    pub(crate) activation: Activation,
    pub(crate) post_norm: Option<RmsNorm>,
}

/// One decoder block.
pub(crate) struct Layer {
    pub(crate) attn: Attention,
    pub(crate) mlp: Mlp,
}

/// Rows of a concatenated batch that apply one adapter.
pub(crate) struct AdapterSpan<'a> {
    pub(crate) rows: std::ops::Range<usize>,
    pub(crate) adapter: &'a LoraAdapter,
}

impl Layer {
    pub(crate) fn linear(&self, target: LoraTarget) -> &Linear {
        match target {
            LoraTarget::Q => &self.attn.q,
            LoraTarget::K => &self.attn.k,
            LoraTarget::V => &self.attn.v,
            LoraTarget::O => &self.attn.o,
            LoraTarget::Gate => &self.mlp.gate,
            LoraTarget::Up => &self.mlp.up,
            LoraTarget::Down => &self.mlp.down,
        }
    }
}

/// The token embedding table.
pub(crate) enum Embedding {
    /// The LM head's weight (a file without `output.weight` ties them): one copy, read through
    /// `Linear::rows`.
    Tied,
    /// A separate table (a file with its own `output.weight`).
    Table(Arc<QTensor>),
}

/// A decoder-only transformer (the architectures `ModelConfig` reads) over quantized GGUF weights.
pub struct Decoder {
    pub(crate) cfg: ModelConfig,
    pub(crate) embed: Embedding,
    pub(crate) lm_head: Linear,
    pub(crate) layers: Vec<Layer>,
    pub(crate) final_norm: RmsNorm,
    /// See [`Decoder::set_smooth`].
    pub(crate) smooth: bool,
    /// Every product of a forward runs on our kernels (none on candle's, which parallelize on
    /// rayon alone): a forward over a few rows may then lead the thread team.
    pub(crate) on_kernels: bool,
}

impl Decoder {
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// Off (the default), the training forward attends over keys and values rounded to f16, as
    /// the serving cache stores them, and takes GELU from its f16 table, so served and trained
    /// logprobs are the same bits. On, both stay in f32: the loss is then a smooth function of
    /// the adapter, as finite-difference gradient checks need. Never for serving.
    #[doc(hidden)]
    pub fn set_smooth(&mut self, on: bool) {
        self.smooth = on;
    }

    /// Bytes of weights one decode step reads: every layer's projections and the LM head (the
    /// embedding row it looks up is noise beside them); what bounds decode speed by memory
    /// bandwidth.
    pub fn decode_weight_bytes(&self) -> usize {
        self.lm_head.weight_bytes()
            + self
                .layers
                .iter()
                .flat_map(|l| LoraTarget::ALL.map(|t| l.linear(t).weight_bytes()))
                .sum::<usize>()
    }

    /// An empty cache of its own, growing as `forward` appends to it (the engine's caches come
    /// from its block manager instead).
    pub fn new_cache(&self) -> SeqCache {
        SeqCache::new(KvArena::new(&self.cfg))
    }

    pub(crate) fn kv_width(&self) -> usize {
        self.cfg.num_kv_heads * self.cfg.head_dim
    }

    /// One batched forward over a ragged batch: every sequence appends `tokens` at positions
    /// `cache.len()..` and its cache grows by `tokens.len()`. Returns one `Logits` per input, in
    /// order. On error no cache changes but for dropping blocks reserved past its end
    /// (`ModelError::KvNotReserved` when a managed cache lacks room for the new positions).
    pub fn forward(&self, batch: &mut [SeqInput<'_>]) -> Result<Vec<Logits>, ModelError> {
        if batch.is_empty() {
            return self.validate(batch).map(|()| Vec::new());
        }
        // Leading the thread team (a few rows) or on one of the pool's threads: called from
        // outside the pool (the engine's scheduler thread), each of the step's ~300 parallel
        // loops would be handed to the pool and waited for across threads (two wake-ups each,
        // milliseconds per decode step).
        let rows = batch.iter().map(|s| s.tokens.len()).sum();
        // candle's products (weights our kernels do not cover) parallelize on rayon alone.
        let rows = if self.on_kernels { rows } else { usize::MAX };
        let result = self
            .validate(batch)
            .and_then(|()| Self::ensure_room(batch))
            .and_then(|()| crate::team::lead(rows, || self.forward_reserved(batch)));
        let ok = result.is_ok();
        for s in batch.iter_mut() {
            if ok {
                s.cache.commit(s.tokens);
            } else {
                s.cache.release_unused();
            }
        }
        result
    }

    fn ensure_room(batch: &mut [SeqInput<'_>]) -> Result<(), ModelError> {
        for (index, s) in batch.iter_mut().enumerate() {
            if !s.cache.ensure_room(s.tokens.len()) {
                return Err(ModelError::KvNotReserved { index });
            }
        }
        Ok(())
    }

    fn validate(&self, batch: &[SeqInput<'_>]) -> Result<(), ModelError> {
        for (index, s) in batch.iter().enumerate() {
            if s.tokens.is_empty() {
                return Err(ModelError::EmptyInput { index });
            }
            if !s.cache.fits(&self.cfg) {
                return Err(ModelError::CacheMismatch);
            }
            if s.adapter.is_some_and(|a| !a.fits(&self.cfg)) {
                return Err(ModelError::AdapterMismatch { index });
            }
            let len = s.cache.len() + s.tokens.len();
            if len > self.cfg.context_length {
                return Err(ModelError::ContextOverflow {
                    len,
                    max: self.cfg.context_length,
                });
            }
            self.check_tokens(s.tokens)?;
        }
        Ok(())
    }

    pub(crate) fn check_tokens(&self, tokens: &[u32]) -> Result<(), ModelError> {
        match tokens.iter().find(|&&t| t as usize >= self.cfg.vocab_size) {
            Some(&token) => Err(ModelError::TokenOutOfRange {
                token,
                vocab: self.cfg.vocab_size,
            }),
            None => Ok(()),
        }
    }

    fn forward_reserved(&self, batch: &mut [SeqInput<'_>]) -> Result<Vec<Logits>, ModelError> {
        let hidden = self.cfg.hidden_size;
        let tokens: Vec<u32> = batch
            .iter()
            .flat_map(|s| s.tokens.iter().copied())
            .collect();
        let mut layout = BatchLayout {
            seq: Vec::with_capacity(tokens.len()),
            pos: Vec::with_capacity(tokens.len()),
        };
        let mut spans = Vec::new();
        for (i, s) in batch.iter().enumerate() {
            let start = s.cache.len();
            if let Some(adapter) = s.adapter {
                spans.push(AdapterSpan {
                    rows: layout.pos.len()..layout.pos.len() + s.tokens.len(),
                    adapter,
                });
            }
            layout.seq.extend(std::iter::repeat_n(i, s.tokens.len()));
            layout.pos.extend(start..start + s.tokens.len());
        }
        let ropes = Ropes::new(&layout.pos, &self.cfg);
        let mut kv = CacheKv { batch };
        let mut x = self.embed_tokens(&tokens)?;
        for li in 0..self.layers.len() {
            x = self
                .layer_forward(li, &x, &layout, &ropes, &spans, &mut kv, false)?
                .0;
        }
        let batch = kv.batch;

        // Only the rows someone asked for go through the (vocabulary-sized) LM head.
        let mut rows = Vec::new();
        let mut off = 0;
        for s in batch.iter() {
            let n = s.tokens.len();
            let first = if s.all_logits { off } else { off + n - 1 };
            rows.extend_from_slice(&x[first * hidden..(off + n) * hidden]);
            off += n;
        }
        self.final_norm.forward(&mut rows, self.cfg.rms_eps);
        // Each sequence's logits are written in place: copied out of one product they took a
        // serial ~2% of a 32-row step.
        let counts: Vec<usize> = batch
            .iter()
            .map(|s| if s.all_logits { s.tokens.len() } else { 1 })
            .collect();
        let vocab = self.lm_head.out_dim();
        let mut parts = self.lm_head.forward_split(&rows, &counts)?;
        let mut at = 0;
        for ((s, part), &n) in batch.iter().zip(&mut parts).zip(&counts) {
            if let Some(adapter) = s.adapter {
                adapter.apply_head(&rows[at * hidden..(at + n) * hidden], part);
            }
            at += n;
        }
        Ok(parts
            .into_iter()
            .zip(counts)
            .map(|(data, rows)| Logits { rows, vocab, data })
            .collect())
    }

    /// Embedding rows (dequantized one row at a time), times sqrt(hidden) as an f32 where the
    /// family scales them (Gemma).
    pub(crate) fn embed_tokens(&self, tokens: &[u32]) -> Result<Vec<f32>, ModelError> {
        let mut x = match &self.embed {
            Embedding::Tied => {
                let rows: Vec<usize> = tokens.iter().map(|&t| t as usize).collect();
                self.lm_head.rows(&rows)?
            }
            Embedding::Table(table) => {
                let ids = Tensor::from_slice(tokens, tokens.len(), &Device::Cpu)?;
                table.embedding(&ids)?.flatten_all()?.to_vec1::<f32>()?
            }
        };
        if self.cfg.scale_embeddings {
            let scale = (self.cfg.hidden_size as f32).sqrt();
            for v in x.iter_mut() {
                *v *= scale;
            }
        }
        Ok(x)
    }
}

pub(crate) fn add_assign(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}
