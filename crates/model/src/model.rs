use std::sync::Arc;

use candle_core::quantized::QTensor;
use candle_core::{Device, Tensor};
use half::f16;
use rayon::prelude::*;

use crate::attention::{self, Rows};
use crate::cache::{LayerKv, SeqCache};
use crate::kernels::{Isa, LlamaCall};
use crate::linear::Linear;
use crate::lora::{LoraAdapter, LoraTarget};
use crate::ops::{self, RopeTable};
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

/// What the projections of a batch need to know about its rows.
pub(crate) struct BatchRows<'a> {
    pub(crate) adapters: &'a [AdapterSpan<'a>],
    /// The llama.cpp call each row belongs to (`Linear::forward_split`).
    pub(crate) calls: &'a [LlamaCall],
    /// Per row: a one-row call (a decode step), for the attention (`Gemma3::attend`).
    pub(crate) decode: Vec<bool>,
}

impl<'a> BatchRows<'a> {
    /// A batch of `rows` rows in `calls`.
    pub(crate) fn new(
        adapters: &'a [AdapterSpan<'a>],
        calls: &'a [LlamaCall],
        rows: usize,
    ) -> Self {
        let mut decode = vec![false; rows];
        for c in calls.iter().filter(|c| c.len == 1) {
            decode[c.rows.clone()].fill(true);
        }
        Self {
            adapters,
            calls,
            decode,
        }
    }
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

    /// One projection of layer `index` over all rows of `x` (batched base matmuls, each
    /// sequence's rows as llama.cpp computes them, see `Linear::forward_split`), plus each
    /// span's adapter term on its own rows.
    pub(crate) fn project(
        &self,
        index: usize,
        target: LoraTarget,
        x: &[f32],
        rows: &BatchRows<'_>,
    ) -> Result<Vec<f32>, ModelError> {
        let linear = self.linear(target);
        let mut y = linear.forward_split(x, rows.calls)?;
        let spans = rows.adapters;
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

/// Gemma 3 text model over quantized GGUF weights.
pub struct Gemma3 {
    pub(crate) cfg: ModelConfig,
    pub(crate) embed: Embedding,
    pub(crate) lm_head: Linear,
    pub(crate) layers: Vec<Layer>,
    pub(crate) final_norm: Vec<f32>,
    /// See [`Gemma3::set_llama_cpp_rounding`].
    pub(crate) llama_cpp_rounding: bool,
}

/// Where each token of the concatenated batch belongs: its sequence (or packed segment) and its
/// position in it.
pub(crate) struct BatchLayout {
    pub(crate) seq: Vec<usize>,
    pub(crate) pos: Vec<usize>,
}

/// One sequence's keys and values for a layer, `[len, kv_heads * head_dim]`: f16 as llama.cpp
/// keeps them, or f32 when its roundings are off.
#[derive(Clone, Copy)]
pub(crate) enum KvRef<'a> {
    F16 { k: &'a [f16], v: &'a [f16] },
    F32 { k: &'a [f32], v: &'a [f32] },
}

impl Gemma3 {
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// On (the default), the forward rounds where llama.cpp's CPU build rounds (the query,
    /// keys and values to f16, the attention output accumulated in f16, GELU through its f16
    /// table), so logits match llama.cpp's bit for bit. Off, those steps stay in f32: the
    /// function is then smooth, as finite-difference gradient checks need; the KV cache still
    /// stores f16, so turn it off only for scoring and training.
    #[doc(hidden)]
    pub fn set_llama_cpp_rounding(&mut self, on: bool) {
        self.llama_cpp_rounding = on;
    }

    pub fn new_cache(&self) -> SeqCache {
        SeqCache::new(self.cfg.num_layers, self.kv_width())
    }

    /// A cache for a request whose prompt has `prompt_len` tokens: the forward computes the
    /// prompt as llama.cpp prefills it (calls of 512 rows) and every later token as one of its
    /// decode steps, however the engine chunks them, so a replay after a preemption and a
    /// prompt chunked under load give the same numbers. A plain `new_cache` computes each
    /// forward's tokens as one call.
    pub fn new_prompt_cache(&self, prompt_len: usize) -> SeqCache {
        let mut cache = self.new_cache();
        cache.set_prompt_len(prompt_len);
        cache
    }

    fn kv_width(&self) -> usize {
        self.cfg.num_kv_heads * self.cfg.head_dim
    }

    /// One batched forward over a ragged batch: every sequence appends `tokens` at positions
    /// `cache.len()..` and its cache grows by `tokens.len()`. Returns one `Logits` per input, in
    /// order. On error no cache changes.
    pub fn forward(&self, batch: &mut [SeqInput<'_>]) -> Result<Vec<Logits>, ModelError> {
        self.validate(batch)?;
        if batch.is_empty() {
            return Ok(Vec::new());
        }
        match self.forward_inner(batch) {
            Ok(logits) => {
                for s in batch.iter_mut() {
                    s.cache.advance(s.tokens.len());
                }
                Ok(logits)
            }
            Err(e) => {
                for s in batch.iter_mut() {
                    s.cache.rollback();
                }
                Err(e)
            }
        }
    }

    fn validate(&self, batch: &[SeqInput<'_>]) -> Result<(), ModelError> {
        for (index, s) in batch.iter().enumerate() {
            if s.tokens.is_empty() {
                return Err(ModelError::EmptyInput { index });
            }
            if !s.cache.fits(self.cfg.num_layers, self.kv_width()) {
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
            if let Some(&token) = s
                .tokens
                .iter()
                .find(|&&t| t as usize >= self.cfg.vocab_size)
            {
                return Err(ModelError::TokenOutOfRange {
                    token,
                    vocab: self.cfg.vocab_size,
                });
            }
        }
        Ok(())
    }

    fn forward_inner(&self, batch: &mut [SeqInput<'_>]) -> Result<Vec<Logits>, ModelError> {
        let cfg = &self.cfg;
        let hidden = cfg.hidden_size;
        let (h, hkv, d) = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim);
        let kv_width = hkv * d;

        let tokens: Vec<u32> = batch
            .iter()
            .flat_map(|s| s.tokens.iter().copied())
            .collect();
        let mut layout = BatchLayout {
            seq: Vec::with_capacity(tokens.len()),
            pos: Vec::with_capacity(tokens.len()),
        };
        for (i, s) in batch.iter().enumerate() {
            let start = s.cache.len();
            layout.seq.extend(std::iter::repeat_n(i, s.tokens.len()));
            layout.pos.extend(start..start + s.tokens.len());
        }

        let mut spans = Vec::new();
        let mut calls = Vec::new();
        let mut off = 0;
        for s in batch.iter() {
            if let Some(adapter) = s.adapter {
                spans.push(AdapterSpan {
                    rows: off..off + s.tokens.len(),
                    adapter,
                });
            }
            calls.extend(s.cache.llama_calls(off, s.tokens.len()));
            off += s.tokens.len();
        }
        let rows = BatchRows::new(&spans, &calls, tokens.len());

        let mut x = self.embed_tokens(&tokens)?;
        let rope_local = RopeTable::new(&layout.pos, d, cfg.rope_base_local);
        let rope_global = RopeTable::new(&layout.pos, d, cfg.rope_base_global);

        for (li, layer) in self.layers.iter().enumerate() {
            let global = cfg.is_global(li);
            let mut hs = x.clone();
            ops::rms_norm(&mut hs, &layer.attn_norm, cfg.rms_eps);
            let mut q = layer.project(li, LoraTarget::Q, &hs, &rows)?;
            let mut k = layer.project(li, LoraTarget::K, &hs, &rows)?;
            let v = layer.project(li, LoraTarget::V, &hs, &rows)?;
            ops::rms_norm(&mut q, &layer.q_norm, cfg.rms_eps);
            ops::rms_norm(&mut k, &layer.k_norm, cfg.rms_eps);
            let rope = if global { &rope_global } else { &rope_local };
            rope.apply(&mut q, h);
            rope.apply(&mut k, hkv);

            let mut off = 0;
            for s in batch.iter_mut() {
                let n = s.tokens.len() * kv_width;
                s.cache.append(li, &k[off..off + n], &v[off..off + n]);
                off += n;
            }
            let kvs: Vec<KvRef> = batch
                .iter()
                .map(|s| {
                    let kv: &LayerKv = s.cache.layer(li);
                    KvRef::F16 { k: &kv.k, v: &kv.v }
                })
                .collect();
            let window = (!global).then_some(cfg.sliding_window);
            let attn = self.attend(&q, &kvs, &layout, window, &rows.decode);

            let mut o = layer.project(li, LoraTarget::O, &attn, &rows)?;
            ops::rms_norm(&mut o, &layer.post_attn_norm, cfg.rms_eps);
            add_assign(&mut x, &o);

            let mut hs = x.clone();
            ops::rms_norm(&mut hs, &layer.ffn_norm, cfg.rms_eps);
            let mut gate = layer.project(li, LoraTarget::Gate, &hs, &rows)?;
            let up = layer.project(li, LoraTarget::Up, &hs, &rows)?;
            ops::gelu_mul(&mut gate, &up, self.llama_cpp_rounding);
            let mut down = layer.project(li, LoraTarget::Down, &gate, &rows)?;
            ops::rms_norm(&mut down, &layer.post_ffn_norm, cfg.rms_eps);
            add_assign(&mut x, &down);
        }

        // Only the rows someone asked for go through the (vocabulary-sized) LM head.
        let mut rows = Vec::new();
        let mut off = 0;
        for s in batch.iter() {
            let n = s.tokens.len();
            let first = if s.all_logits { off } else { off + n - 1 };
            rows.extend_from_slice(&x[first * hidden..(off + n) * hidden]);
            off += n;
        }
        ops::rms_norm(&mut rows, &self.final_norm, cfg.rms_eps);
        let logits = self.lm_head.forward(&rows)?;
        let vocab = self.lm_head.out_dim();
        let mut out = Vec::with_capacity(batch.len());
        let mut off = 0;
        for s in batch.iter() {
            let n = if s.all_logits { s.tokens.len() } else { 1 };
            out.push(Logits {
                rows: n,
                vocab,
                data: logits[off * vocab..(off + n) * vocab].to_vec(),
            });
            off += n;
        }
        Ok(out)
    }

    /// Embedding rows (dequantized one row at a time) times sqrt(hidden), as llama.cpp does
    /// (an f32 scale, not rounded to bf16).
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

    /// Causal attention of every (token, head) against its own sequence's cache, which already
    /// holds the batch's new keys. Local layers see the last `window` positions, self included.
    /// The query is scaled by `1/sqrt(head_dim)` first (llama.cpp scales Q, not the scores),
    /// then `attention::attend_row` computes llama.cpp's flash attention.
    /// `decode[t]`: token `t` is a llama.cpp call of one row (a decode step), whose attention
    /// ggml splits across its threads once its KV view reaches 512 cells (`llama_kv_split`).
    pub(crate) fn attend(
        &self,
        q: &[f32],
        kvs: &[KvRef<'_>],
        layout: &BatchLayout,
        window: Option<usize>,
        decode: &[bool],
    ) -> Vec<f32> {
        let (h, hkv, d) = (self.cfg.num_heads, self.cfg.num_kv_heads, self.cfg.head_dim);
        let group = h / hkv;
        let kv_width = hkv * d;
        let scale = 1.0 / (d as f32).sqrt();
        let isa = Isa::detect();
        let mut out = vec![0f32; q.len()];
        out.par_chunks_mut(d).enumerate().for_each(|(idx, o)| {
            let (t, head) = (idx / h, idx % h);
            let g = head / group;
            let pos = layout.pos[t];
            let lo = window.map_or(0, |w| (pos + 1).saturating_sub(w));
            let qrow = &q[idx * d..(idx + 1) * d];
            let first = lo * kv_width + g * d;
            let n = pos + 1 - lo;
            match kvs[layout.seq[t]] {
                KvRef::F16 { k, v } => {
                    let rows = Rows {
                        keys: &k[first..],
                        values: &v[first..],
                        stride: kv_width,
                        n,
                    };
                    let split = decode[t]
                        .then(|| llama_kv_split(pos + 1))
                        .flatten()
                        .map(|cell| cell.saturating_sub(lo));
                    attention::attend_row(isa, qrow, scale, &rows, split, o);
                }
                KvRef::F32 { k, v } => {
                    attention::attend_row_f32(qrow, scale, &k[first..], &v[first..], kv_width, n, o)
                }
            }
        });
        out
    }
}

/// llama.cpp pads its KV view to 256 cells, and from 512 on ggml splits a decode step's
/// attention across its threads (two, in the reference build) at half the view: the cell (= the
/// position, cells filling in order) where the second part starts, for a cache of `len`.
fn llama_kv_split(len: usize) -> Option<usize> {
    const PAD: usize = 256;
    const THREADS: usize = 2;
    let view = len.next_multiple_of(PAD).max(PAD);
    (view >= 2 * PAD).then(|| view.div_ceil(THREADS))
}

pub(crate) fn add_assign(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}
