use std::sync::Arc;

use candle_core::quantized::QTensor;
use candle_core::{Device, Tensor};

use crate::cache::{KvArena, SeqCache};
use crate::layer::{BatchLayout, CacheKv, Ropes};
use crate::linear::Linear;
use crate::lora::{LoraAdapter, LoraTarget};
use crate::ops;
use crate::{ModelConfig, ModelError};

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

pub(crate) struct Layer {
    pub(crate) attn_norm: Vec<f32>,
    pub(crate) q: Linear,
    pub(crate) k: Linear,
    pub(crate) v: Linear,
    pub(crate) q_norm: Vec<f32>,
    pub(crate) k_norm: Vec<f32>,
    pub(crate) o: Linear,
    pub(crate) post_attn_norm: Vec<f32>,
    pub(crate) ffn_norm: Vec<f32>,
    pub(crate) gate: Linear,
    pub(crate) up: Linear,
    pub(crate) down: Linear,
    pub(crate) post_ffn_norm: Vec<f32>,
}

/// Rows of a concatenated batch that apply one adapter.
pub(crate) struct AdapterSpan<'a> {
    pub(crate) rows: std::ops::Range<usize>,
    pub(crate) adapter: &'a LoraAdapter,
}

impl Layer {
    pub(crate) fn linear(&self, target: LoraTarget) -> &Linear {
        match target {
            LoraTarget::Q => &self.q,
            LoraTarget::K => &self.k,
            LoraTarget::V => &self.v,
            LoraTarget::O => &self.o,
            LoraTarget::Gate => &self.gate,
            LoraTarget::Up => &self.up,
            LoraTarget::Down => &self.down,
        }
    }

    /// One projection of layer `index` over all rows of `x` (one batched base matmul), plus
    /// each span's adapter term on its own rows.
    pub(crate) fn project(
        &self,
        index: usize,
        target: LoraTarget,
        x: &[f32],
        spans: &[AdapterSpan<'_>],
    ) -> Result<Vec<f32>, ModelError> {
        let linear = self.linear(target);
        let mut y = linear.forward(x)?;
        let (din, dout) = (linear.in_dim(), linear.out_dim());
        for s in spans {
            s.adapter.apply(
                index,
                target,
                &x[s.rows.start * din..s.rows.end * din],
                &mut y[s.rows.start * dout..s.rows.end * dout],
            );
        }
        Ok(y)
    }
}

/// The token embedding table.
pub(crate) enum Embedding {
    /// The LM head's weight (Gemma ties them): one copy, read through `Linear::rows`.
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
    pub(crate) final_norm: Vec<f32>,
    /// See [`Decoder::set_smooth`].
    pub(crate) smooth: bool,
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
        // On one of the pool's threads: called from outside the pool (the engine's scheduler
        // thread), each of the step's ~300 parallel loops would be handed to the pool and
        // waited for across threads (two wake-ups each, milliseconds per decode step); inside
        // it, they are split among threads that are already awake.
        let result = self
            .validate(batch)
            .and_then(|()| Self::ensure_room(batch))
            .and_then(|()| rayon::scope(|_| self.forward_reserved(batch)));
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
        ops::rms_norm(&mut rows, &self.final_norm, self.cfg.rms_eps);
        // Each sequence's logits are written in place: copied out of one product they took a
        // serial ~2% of a 32-row step.
        let counts: Vec<usize> = batch
            .iter()
            .map(|s| if s.all_logits { s.tokens.len() } else { 1 })
            .collect();
        let vocab = self.lm_head.out_dim();
        let parts = self.lm_head.forward_split(&rows, &counts)?;
        Ok(parts
            .into_iter()
            .zip(counts)
            .map(|(data, rows)| Logits { rows, vocab, data })
            .collect())
    }

    /// Embedding rows (dequantized one row at a time) times sqrt(hidden), an f32 scale.
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
        let scale = (self.cfg.hidden_size as f32).sqrt();
        for v in x.iter_mut() {
            *v *= scale;
        }
        Ok(x)
    }
}

pub(crate) fn add_assign(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}
