//! The decoder layer: one function for serving and training. Serving runs it over a batch whose
//! keys and values go to each sequence's paged cache; the trainer runs it over packed segments
//! whose keys and values stay with the forward, and asks it to record what the backward needs.
//! The arithmetic is the same code, so served and trained logprobs cannot drift apart.

use half::f16;
use half::slice::HalfFloatSliceExt;
use rayon::prelude::*;

use crate::attention::{self, HeadColumns, KvElem};
use crate::cache::KvView;
use crate::kernels::Isa;
use crate::lora::LoraTarget;
use crate::model::{add_assign, AdapterSpan, Decoder, SeqInput};
use crate::ops::{self, RopeTable};
use crate::{ModelConfig, ModelError};

/// Where each token of the concatenated batch belongs: its sequence (or packed segment) and its
/// position in it.
pub(crate) struct BatchLayout {
    pub(crate) seq: Vec<usize>,
    pub(crate) pos: Vec<usize>,
}

/// Rotary tables of the batch's positions, for the local and the global layers.
pub(crate) struct Ropes {
    local: RopeTable,
    global: RopeTable,
}

impl Ropes {
    pub(crate) fn new(pos: &[usize], cfg: &ModelConfig) -> Self {
        Ropes {
            local: RopeTable::new(pos, cfg.head_dim, cfg.rope_base_local),
            global: RopeTable::new(pos, cfg.head_dim, cfg.rope_base_global),
        }
    }

    pub(crate) fn get(&self, global: bool) -> &RopeTable {
        if global {
            &self.global
        } else {
            &self.local
        }
    }
}

/// One layer's activations, each `[tokens, width]`, kept by a training forward.
pub(crate) struct LayerTape {
    pub(crate) x_in: Vec<f32>,
    pub(crate) attn_normed: Vec<f32>,
    pub(crate) q_pre: Vec<f32>,
    pub(crate) k_pre: Vec<f32>,
    /// After norm and rope.
    pub(crate) q: Vec<f32>,
    pub(crate) k: Vec<f32>,
    pub(crate) v: Vec<f32>,
    pub(crate) attn: Vec<f32>,
    pub(crate) o: Vec<f32>,
    pub(crate) x_mid: Vec<f32>,
    pub(crate) ffn_normed: Vec<f32>,
    pub(crate) gate: Vec<f32>,
    pub(crate) up: Vec<f32>,
    pub(crate) act: Vec<f32>,
    pub(crate) down: Vec<f32>,
}

/// Where a layer's keys and values go, and what its attention reads.
pub(crate) trait LayerKv {
    /// Keeps this layer's new key and value rows (batch order) and returns the attention of
    /// every query row over its own sequence.
    fn store_and_attend(
        &mut self,
        model: &Decoder,
        layer: usize,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        layout: &BatchLayout,
    ) -> Vec<f32>;
}

/// Serving: each sequence's paged cache (blocks reserved by `Decoder::forward`).
pub(crate) struct CacheKv<'a, 'b> {
    pub(crate) batch: &'a mut [SeqInput<'b>],
}

impl LayerKv for CacheKv<'_, '_> {
    fn store_and_attend(
        &mut self,
        model: &Decoder,
        layer: usize,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        layout: &BatchLayout,
    ) -> Vec<f32> {
        let width = model.kv_width();
        let mut off = 0;
        for s in self.batch.iter_mut() {
            let n = s.tokens.len() * width;
            let start = s.cache.len();
            s.cache
                .write(layer, start, &k[off..off + n], &v[off..off + n]);
            off += n;
        }
        let views: Vec<KvView<'_>> = self.batch.iter().map(|s| s.cache.view(layer)).collect();
        model.attend(layer, q, &views, layout)
    }
}

/// Training: the packed segments' keys and values, rounded to f16 as the serving cache stores
/// them (or kept in f32, `Decoder::set_smooth`).
pub(crate) struct PackedKv<'a> {
    pub(crate) segments: &'a [std::ops::Range<usize>],
}

impl LayerKv for PackedKv<'_> {
    fn store_and_attend(
        &mut self,
        model: &Decoder,
        layer: usize,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        layout: &BatchLayout,
    ) -> Vec<f32> {
        let width = model.kv_width();
        if model.smooth {
            return model.attend(layer, q, &segment_views(self.segments, width, k, v), layout);
        }
        let (mut k16, mut v16) = (vec![f16::ZERO; k.len()], vec![f16::ZERO; v.len()]);
        k16.convert_from_f32_slice(k);
        v16.convert_from_f32_slice(v);
        let views = segment_views(self.segments, width, &k16, &v16);
        model.attend(layer, q, &views, layout)
    }
}

/// Each packed segment's rows as one chunk.
fn segment_views<'a, T>(
    segments: &[std::ops::Range<usize>],
    width: usize,
    k: &'a [T],
    v: &'a [T],
) -> Vec<KvView<'a, T>> {
    segments
        .iter()
        .map(|s| {
            let rows = s.start * width..s.end * width;
            KvView::contiguous(&k[rows.clone()], &v[rows], s.len())
        })
        .collect()
}

impl Decoder {
    /// Decoder layer `li` over the batch rows `x`: attention (norm, q/k/v with each span's
    /// adapter, q/k norms, rope, attention through `kv`, o, post-norm, residual), then the
    /// feed-forward (norm, gate and up, GELU, down, post-norm, residual). With `record`, also
    /// returns every intermediate the backward needs.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn layer_forward(
        &self,
        li: usize,
        x: &[f32],
        layout: &BatchLayout,
        ropes: &Ropes,
        spans: &[AdapterSpan<'_>],
        kv: &mut dyn LayerKv,
        record: bool,
    ) -> Result<(Vec<f32>, Option<LayerTape>), ModelError> {
        let cfg = &self.cfg;
        let layer = &self.layers[li];
        let eps = cfg.rms_eps;
        let global = cfg.is_global(li);
        // A pair of (the value kept for the backward, the value the forward goes on with).
        let keep = |v: Vec<f32>| {
            if record {
                (v.clone(), v)
            } else {
                (Vec::new(), v)
            }
        };

        let mut attn_normed = x.to_vec();
        ops::rms_norm(&mut attn_normed, &layer.attn_norm, eps);
        // Projections of one input run side by side: while one's last tasks finish, the other
        // threads take the next one's instead of waiting at its join.
        let project = |target| layer.project(li, target, &attn_normed, spans);
        let ((q, k), v) = rayon::join(
            || rayon::join(|| project(LoraTarget::Q), || project(LoraTarget::K)),
            || project(LoraTarget::V),
        );
        let (q_pre, mut q) = keep(q?);
        let (k_pre, mut k) = keep(k?);
        let v = v?;
        ops::rms_norm(&mut q, &layer.q_norm, eps);
        ops::rms_norm(&mut k, &layer.k_norm, eps);
        let rope = ropes.get(global);
        rope.apply(&mut q, cfg.num_heads);
        rope.apply(&mut k, cfg.num_kv_heads);
        let attn = kv.store_and_attend(self, li, &q, &k, &v, layout);

        let (o, mut o_normed) = keep(layer.project(li, LoraTarget::O, &attn, spans)?);
        ops::rms_norm(&mut o_normed, &layer.post_attn_norm, eps);
        let mut x_mid = x.to_vec();
        add_assign(&mut x_mid, &o_normed);

        let mut ffn_normed = x_mid.clone();
        ops::rms_norm(&mut ffn_normed, &layer.ffn_norm, eps);
        let project = |target| layer.project(li, target, &ffn_normed, spans);
        let (gate, up) = rayon::join(|| project(LoraTarget::Gate), || project(LoraTarget::Up));
        let (gate, mut act) = keep(gate?);
        let up = up?;
        ops::gelu_mul(&mut act, &up, !self.smooth);
        let (down, mut down_normed) = keep(layer.project(li, LoraTarget::Down, &act, spans)?);
        ops::rms_norm(&mut down_normed, &layer.post_ffn_norm, eps);
        let (x_mid, mut output) = keep(x_mid);
        add_assign(&mut output, &down_normed);

        let tape = record.then(|| LayerTape {
            x_in: x.to_vec(),
            attn_normed,
            q_pre,
            k_pre,
            q,
            k,
            v,
            attn,
            o,
            x_mid,
            ffn_normed,
            gate,
            up,
            act,
            down,
        });
        Ok((output, tape))
    }

    /// Causal attention of every query row against its own sequence's keys and values
    /// (`views[layout.seq[t]]`, which already hold the batch's new rows). Local layers see the
    /// last `sliding_window` positions, self included. The query heads sharing a key/value head
    /// are computed together (`attention::attend_group`).
    pub(crate) fn attend<T: KvElem + 'static>(
        &self,
        layer: usize,
        q: &[f32],
        views: &[KvView<'_, T>],
        layout: &BatchLayout,
    ) -> Vec<f32> {
        let cfg = &self.cfg;
        let (h, hkv, d) = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim);
        let group = h / hkv;
        let window = (!cfg.is_global(layer)).then_some(cfg.sliding_window);
        let scale = 1.0 / (d as f32).sqrt();
        let isa = Isa::detect();
        // A task per token and key/value head; with fewer tokens than threads (a decode step)
        // the group's query heads are split between tasks too, so every thread works. Each
        // head's arithmetic is the same either way.
        let threads = rayon::current_num_threads();
        let tokens = layout.pos.len();
        let split = if tokens * hkv >= threads {
            1
        } else {
            (1..=group.min(threads))
                .rev()
                .find(|k| group.is_multiple_of(*k))
                .unwrap_or(1)
        };
        let heads_per_task = group / split;
        let mut out = vec![0f32; q.len()];
        out.par_chunks_mut(heads_per_task * d)
            .enumerate()
            .for_each_init(Vec::new, |scores, (idx, o)| {
                let first_head = idx * heads_per_task;
                let (t, g) = (first_head / h, first_head % h / group);
                let pos = layout.pos[t];
                let lo = window.map_or(0, |w| (pos + 1).saturating_sub(w));
                let head = HeadColumns {
                    col: g * d,
                    d,
                    stride: hkv * d,
                };
                let queries = &q[first_head * d..(first_head + heads_per_task) * d];
                let view = &views[layout.seq[t]];
                attention::attend_group(isa, queries, scale, view, (lo, pos + 1), head, o, scores);
            });
        out
    }
}
