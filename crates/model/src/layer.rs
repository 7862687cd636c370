//! The decoder layer's forward, module by module (attention, MLP): one code path for serving and
//! training. Serving runs it over a batch whose keys and values go to each sequence's paged
//! cache; the trainer runs it over packed segments whose keys and values stay with the forward,
//! and asks it to record what the backward (`train.rs`, the same modules) needs. The arithmetic
//! is the same code, so served and trained logprobs cannot drift apart.

use half::f16;
use half::slice::HalfFloatSliceExt;

use crate::attention::{self, KvElem};
use crate::cache::KvView;
use crate::kernels::Isa;
use crate::linear::Linear;
use crate::lora::LoraTarget;
use crate::model::{add_assign, norm_if, AdapterSpan, Decoder, Mlp, RmsNorm, SeqInput};
use crate::ops::{self, RopeTable};
use crate::team;
use crate::{ModelConfig, ModelError};

/// Where each token of the concatenated batch belongs: its sequence (or packed segment) and its
/// position in it.
pub(crate) struct BatchLayout {
    pub(crate) seq: Vec<usize>,
    pub(crate) pos: Vec<usize>,
}

/// Rotary tables of the batch's positions, for the global layers and (in a family that has
/// them) the local ones. As llama.cpp, linear scaling and YaRN apply to the global layers only.
pub(crate) struct Ropes {
    local: Option<RopeTable>,
    global: RopeTable,
}

impl Ropes {
    pub(crate) fn new(pos: &[usize], cfg: &ModelConfig) -> Self {
        let factors = cfg.rope_freq_factors.as_deref();
        let table = |base, scale, yarn| {
            RopeTable::new(
                pos,
                cfg.head_dim,
                base,
                (scale, factors, yarn),
                cfg.rope_layout,
            )
        };
        Ropes {
            local: (cfg.global_every > 1).then(|| table(cfg.rope_base_local, 1.0, None)),
            global: table(cfg.rope_base_global, cfg.rope_freq_scale, cfg.rope_yarn),
        }
    }

    /// `layer`'s table: the local or the global one, or none for a layer without RoPE.
    pub(crate) fn get(&self, cfg: &ModelConfig, layer: usize) -> Option<&RopeTable> {
        if !cfg.uses_rope(layer) {
            return None;
        }
        match &self.local {
            Some(local) if !cfg.is_global(layer) => Some(local),
            _ => Some(&self.global),
        }
    }
}

/// One layer's activations, each `[tokens, width]`, kept by a training forward; the inputs of
/// norms a layer lacks stay empty.
pub(crate) struct LayerTape {
    pub(crate) attn: AttentionTape,
    pub(crate) mlp: MlpTape,
}

pub(crate) struct AttentionTape {
    pub(crate) x_in: Vec<f32>,
    pub(crate) normed: Vec<f32>,
    pub(crate) q_pre: Vec<f32>,
    pub(crate) k_pre: Vec<f32>,
    /// After norm and rope.
    pub(crate) q: Vec<f32>,
    pub(crate) k: Vec<f32>,
    pub(crate) v: Vec<f32>,
    pub(crate) attn: Vec<f32>,
    pub(crate) o: Vec<f32>,
}

pub(crate) struct MlpTape {
    pub(crate) x_in: Vec<f32>,
    pub(crate) normed: Vec<f32>,
    pub(crate) gate: Vec<f32>,
    pub(crate) up: Vec<f32>,
    pub(crate) act: Vec<f32>,
    pub(crate) down: Vec<f32>,
}

/// What the modules of one layer's forward share: the layer's index (its adapters' pairs),
/// the adapter spans of the batch's rows, and whether to record a tape.
pub(crate) struct Step<'a, 'b> {
    pub(crate) layer: usize,
    pub(crate) spans: &'a [AdapterSpan<'b>],
    pub(crate) eps: f32,
    pub(crate) record: bool,
}

impl Step<'_, '_> {
    /// A pair of (the value kept for the backward, the value the forward goes on with).
    fn keep(&self, v: Vec<f32>) -> (Vec<f32>, Vec<f32>) {
        if self.record {
            (v.clone(), v)
        } else {
            (Vec::new(), v)
        }
    }

    /// [`Step::keep`] for a norm's input, kept only where the layer has that norm.
    fn keep_for(&self, norm: &Option<RmsNorm>, v: Vec<f32>) -> (Vec<f32>, Vec<f32>) {
        match norm {
            Some(_) => self.keep(v),
            None => (Vec::new(), v),
        }
    }

    /// `linear`, projection `target` of this layer, over all rows of `x` (one batched base
    /// matmul and its bias, a frozen part of the base), plus each span's adapter term on its
    /// own rows.
    fn project(
        &self,
        linear: &Linear,
        bias: &Option<Vec<f32>>,
        target: LoraTarget,
        x: &[f32],
    ) -> Result<Vec<f32>, ModelError> {
        let mut y = linear.forward(x)?;
        if let Some(bias) = bias {
            for row in y.chunks_exact_mut(bias.len()) {
                add_assign(row, bias);
            }
        }
        let (din, dout) = (linear.in_dim(), linear.out_dim());
        for s in self.spans {
            s.adapter.apply(
                self.layer,
                target,
                &x[s.rows.start * din..s.rows.end * din],
                &mut y[s.rows.start * dout..s.rows.end * dout],
            );
        }
        Ok(y)
    }
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
    /// Decoder block `li` over the batch rows `x`: its attention, then its MLP. With `record`,
    /// also returns every intermediate the backward needs.
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
        let step = Step {
            layer: li,
            spans,
            eps: self.cfg.rms_eps,
            record,
        };
        let (x_mid, attn) = self.attention_forward(&step, x, layout, ropes, kv)?;
        let (out, mlp) = self.layers[li].mlp.forward(&step, x_mid, !self.smooth)?;
        Ok((
            out,
            attn.zip(mlp).map(|(attn, mlp)| LayerTape { attn, mlp }),
        ))
    }

    /// The attention block of layer `step.layer`: norm, q/k/v (with their biases and each
    /// span's adapter), q/k norms, rope, attention through `kv`, o, post-norm, residual; the
    /// family's switches leave out what it lacks.
    fn attention_forward(
        &self,
        step: &Step<'_, '_>,
        x: &[f32],
        layout: &BatchLayout,
        ropes: &Ropes,
        kv: &mut dyn LayerKv,
    ) -> Result<(Vec<f32>, Option<AttentionTape>), ModelError> {
        let cfg = &self.cfg;
        let a = &self.layers[step.layer].attn;
        let eps = step.eps;
        let mut normed = x.to_vec();
        a.norm.forward(&mut normed, eps);
        // Projections of one input run side by side: while one's last tasks finish, the other
        // threads take the next one's instead of waiting at its join.
        let ((q, k), v) = team::join(
            || {
                team::join(
                    || step.project(&a.q, &a.q_bias, LoraTarget::Q, &normed),
                    || step.project(&a.k, &a.k_bias, LoraTarget::K, &normed),
                )
            },
            || step.project(&a.v, &a.v_bias, LoraTarget::V, &normed),
        );
        let (q_pre, mut q) = step.keep_for(&a.q_norm, q?);
        let (k_pre, mut k) = step.keep_for(&a.k_norm, k?);
        let v = v?;
        norm_if(&a.q_norm, &mut q, eps);
        norm_if(&a.k_norm, &mut k, eps);
        if let Some(rope) = ropes.get(cfg, step.layer) {
            rope.apply(&mut q, cfg.num_heads);
            rope.apply(&mut k, cfg.num_kv_heads);
        }
        let attn = kv.store_and_attend(self, step.layer, &q, &k, &v, layout);

        let o = step.project(&a.o, &None, LoraTarget::O, &attn)?;
        let (o, mut o_normed) = step.keep_for(&a.post_norm, o);
        norm_if(&a.post_norm, &mut o_normed, eps);
        let mut out = x.to_vec();
        add_assign(&mut out, &o_normed);
        let tape = step.record.then(|| AttentionTape {
            x_in: x.to_vec(),
            normed,
            q_pre,
            k_pre,
            q,
            k,
            v,
            attn,
            o,
        });
        Ok((out, tape))
    }

    /// Causal attention of every query row against its own sequence's keys and values
    /// (`views[layout.seq[t]]`, which already hold the batch's new rows). Local layers see the
    /// last `sliding_window` positions, self included. The query heads sharing a key/value head
    /// are computed together, and in a prefill tiles of consecutive tokens too
    /// (`attention::attend_rows`).
    pub(crate) fn attend<T: KvElem + 'static>(
        &self,
        layer: usize,
        q: &[f32],
        views: &[KvView<'_, T>],
        layout: &BatchLayout,
    ) -> Vec<f32> {
        let cfg = &self.cfg;
        let shape = attention::Shape {
            heads: cfg.num_heads,
            kv_heads: cfg.num_kv_heads,
            d: cfg.head_dim,
            window: (!cfg.is_global(layer)).then_some(cfg.sliding_window),
            scale: cfg.attention_scale,
        };
        attention::attend_rows(
            Isa::detect(),
            q,
            views,
            (&layout.seq, &layout.pos),
            shape,
            attention::TILE_TOKENS,
        )
    }
}

impl Mlp {
    /// Norm, gate and up (with each span's adapter), the activation (GELU from its f16 table
    /// with `table`), down, post-norm, residual.
    fn forward(
        &self,
        step: &Step<'_, '_>,
        x: Vec<f32>,
        table: bool,
    ) -> Result<(Vec<f32>, Option<MlpTape>), ModelError> {
        let mut normed = x.clone();
        self.norm.forward(&mut normed, step.eps);
        let (gate, up) = team::join(
            || step.project(&self.gate, &None, LoraTarget::Gate, &normed),
            || step.project(&self.up, &None, LoraTarget::Up, &normed),
        );
        let (gate, mut act) = step.keep(gate?);
        let up = up?;
        ops::act_mul(self.activation, &mut act, &up, table);
        let down = step.project(&self.down, &None, LoraTarget::Down, &act)?;
        let (down, mut down_normed) = step.keep_for(&self.post_norm, down);
        norm_if(&self.post_norm, &mut down_normed, step.eps);
        let (x_in, mut out) = step.keep(x);
        add_assign(&mut out, &down_normed);
        let tape = step.record.then_some(MlpTape {
            x_in,
            normed,
            gate,
            up,
            act,
            down,
        });
        Ok((out, tape))
    }
}
