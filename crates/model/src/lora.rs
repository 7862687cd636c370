//! LoRA adapters over every layer's q/k/v/o/gate/up/down projections, and optionally the LM
//! head (the unembedding, Tinker's `train_unembed`): `y = x·Wᵀ + s·(x·Aᵀ)·Bᵀ` with
//! `s = alpha / rank`, f32, trainable while the quantized base weights stay frozen.

use std::collections::HashMap;
use std::path::Path;
use std::sync::OnceLock;

use candle_core::{Device, Tensor};

use crate::tiny::SplitMix64;
use crate::{ModelConfig, ModelError};

/// The projections an adapter can change, in this order everywhere (params, files, grads).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LoraTarget {
    Q,
    K,
    V,
    O,
    Gate,
    Up,
    Down,
}

impl LoraTarget {
    pub const ALL: [LoraTarget; 7] = [
        LoraTarget::Q,
        LoraTarget::K,
        LoraTarget::V,
        LoraTarget::O,
        LoraTarget::Gate,
        LoraTarget::Up,
        LoraTarget::Down,
    ];

    /// The GGUF name of the projection this targets (`blk.N.<name>.weight`).
    pub fn name(self) -> &'static str {
        match self {
            LoraTarget::Q => "attn_q",
            LoraTarget::K => "attn_k",
            LoraTarget::V => "attn_v",
            LoraTarget::O => "attn_output",
            LoraTarget::Gate => "ffn_gate",
            LoraTarget::Up => "ffn_up",
            LoraTarget::Down => "ffn_down",
        }
    }

    /// `(out, in)` of the projection in `model`.
    pub fn dims(self, model: &ModelConfig) -> (usize, usize) {
        let hidden = model.hidden_size;
        let q = model.num_heads * model.head_dim;
        let kv = model.num_kv_heads * model.head_dim;
        let ffn = model.intermediate_size;
        match self {
            LoraTarget::Q => (q, hidden),
            LoraTarget::K | LoraTarget::V => (kv, hidden),
            LoraTarget::O => (hidden, q),
            LoraTarget::Gate | LoraTarget::Up => (ffn, hidden),
            LoraTarget::Down => (hidden, ffn),
        }
    }

    pub(crate) fn index(self) -> usize {
        self as usize
    }

    /// q, k, v or o (Tinker's `train_attn`), not the MLP's (`train_mlp`).
    pub fn is_attention(self) -> bool {
        matches!(
            self,
            LoraTarget::Q | LoraTarget::K | LoraTarget::V | LoraTarget::O
        )
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LoraConfig {
    pub rank: usize,
    pub alpha: f32,
    /// A pair on the LM head too (`[rank, hidden]` and `[vocab, rank]`): the logits of every
    /// token, served and trained, get its term. With a tied embedding the input side stays the
    /// base table (PEFT's `lm_head` target does the same).
    pub unembed: bool,
}

impl Default for LoraConfig {
    fn default() -> Self {
        LoraConfig {
            rank: 8,
            alpha: 16.0,
            unembed: false,
        }
    }
}

/// One projection's pair: `a` is `[rank, in]`, `b` is `[out, rank]`, row-major.
#[derive(Clone, Debug)]
pub(crate) struct LoraPair {
    pub(crate) a: Vec<f32>,
    pub(crate) b: Vec<f32>,
    pub(crate) in_dim: usize,
    pub(crate) out_dim: usize,
    /// `Bᵀ` (`[rank, out]`), made on first use after the weights change (`params_mut` clears
    /// it): the up-projection as rank rows added across the outputs, vectorized, where dots of
    /// `rank` values per output (8 by default) ran scalar.
    b_rows: OnceLock<Vec<f32>>,
}

/// A LoRA adapter for one model shape. `Send + Sync`; shared between requests behind an `Arc`.
pub struct LoraAdapter {
    /// Unique to these weights in this process (`LoraAdapter::id`).
    id: u64,
    cfg: LoraConfig,
    /// `layers[l][target.index()]`.
    layers: Vec<[LoraPair; 7]>,
    /// The LM head's pair, where `cfg.unembed`.
    head: Option<LoraPair>,
}

/// Requests are logged with `{:?}`: the shape, not millions of weights.
impl std::fmt::Debug for LoraAdapter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoraAdapter")
            .field("rank", &self.cfg.rank)
            .field("alpha", &self.cfg.alpha)
            .field("layers", &self.layers.len())
            .field("unembed", &self.cfg.unembed)
            .finish()
    }
}

const ALPHA_KEY: &str = "lora_alpha";

fn tensor_name(layer: usize, target: LoraTarget, matrix: &str) -> String {
    format!("blk.{layer}.{}.lora_{matrix}", target.name())
}

fn head_tensor_name(matrix: &str) -> String {
    format!("output.lora_{matrix}")
}

/// A fresh adapter identity.
fn next_id() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// A copy is other weights as soon as either changes: it gets its own identity.
impl Clone for LoraAdapter {
    fn clone(&self) -> Self {
        LoraAdapter {
            id: next_id(),
            cfg: self.cfg,
            layers: self.layers.clone(),
            head: self.head.clone(),
        }
    }
}

impl LoraAdapter {
    /// An identity no other adapter of this process has, kept while the weights stay the same
    /// (`params_mut` takes a new one): what the prefix cache keys served blocks by.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// A seeded small random (uniform with bound 1/sqrt(in), as PEFT's default Kaiming init),
    /// B = 0: a fresh adapter changes nothing (step 0 == base weights).
    /// `cfg.rank` must be at least 1 (the server's configuration checks it).
    pub fn new(model: &ModelConfig, cfg: LoraConfig, seed: u64) -> Self {
        let mut rng = SplitMix64(seed ^ 0x4c6f_5241_2d41_4441);
        let mut fresh = |(out_dim, in_dim): (usize, usize)| {
            let bound = 1.0 / (in_dim as f32).sqrt();
            LoraPair::new(
                (0..cfg.rank * in_dim)
                    .map(|_| bound * rng.uniform())
                    .collect(),
                vec![0.0; out_dim * cfg.rank],
                in_dim,
                out_dim,
            )
        };
        let layers = (0..model.num_layers)
            .map(|_| LoraTarget::ALL.map(|t| fresh(t.dims(model))))
            .collect();
        // After the layers', so a seed's layer pairs do not depend on `unembed`.
        let head = cfg.unembed.then(|| fresh(head_dims(model)));
        LoraAdapter {
            id: next_id(),
            cfg,
            layers,
            head,
        }
    }

    pub fn config(&self) -> LoraConfig {
        self.cfg
    }

    /// `alpha / rank`.
    pub fn scale(&self) -> f32 {
        self.cfg.alpha / self.cfg.rank as f32
    }

    pub(crate) fn pair(&self, layer: usize, target: LoraTarget) -> &LoraPair {
        &self.layers[layer][target.index()]
    }

    /// The LM head's pair, where the adapter has one.
    pub(crate) fn head(&self) -> Option<&LoraPair> {
        self.head.as_ref()
    }

    /// Replaces (or adds) the LM head's pair; the adapter adapts the head from now on.
    pub(crate) fn set_head(&mut self, pair: LoraPair) {
        debug_assert_eq!(pair.a.len(), self.cfg.rank * pair.in_dim);
        self.id = next_id();
        self.cfg.unembed = true;
        self.head = Some(pair);
    }

    /// The projection whose A or B is [`LoraAdapter::params`]`[index]`; `None` for the LM
    /// head's pair.
    pub fn param_target(&self, index: usize) -> Option<LoraTarget> {
        (index < self.head_param_index())
            .then(|| LoraTarget::ALL[index / 2 % LoraTarget::ALL.len()])
    }

    /// The index in [`LoraAdapter::params`] of the LM head's A (its B follows).
    pub(crate) fn head_param_index(&self) -> usize {
        self.layers.len() * LoraTarget::ALL.len() * 2
    }

    /// Replaces one projection's pair (of this adapter's rank and the projection's shape).
    pub(crate) fn set_pair(&mut self, layer: usize, target: LoraTarget, pair: LoraPair) {
        debug_assert_eq!(pair.a.len(), self.cfg.rank * pair.in_dim);
        debug_assert_eq!(pair.b.len(), pair.out_dim * self.cfg.rank);
        self.id = next_id();
        self.layers[layer][target.index()] = pair;
    }

    /// True when this adapter was made for a model of `model`'s shape.
    pub fn fits(&self, model: &ModelConfig) -> bool {
        self.layers.len() == model.num_layers
            && self.layers.iter().all(|l| {
                LoraTarget::ALL.iter().all(|&t| {
                    let p = &l[t.index()];
                    (p.out_dim, p.in_dim) == t.dims(model)
                })
            })
            && self
                .head
                .as_ref()
                .is_none_or(|p| (p.out_dim, p.in_dim) == head_dims(model))
    }

    /// The adapter as a safetensors file's bytes (what [`LoraAdapter::from_bytes`] reads).
    pub fn to_bytes(&self) -> Result<Vec<u8>, ModelError> {
        let mut tensors = HashMap::new();
        for (l, layer) in self.layers.iter().enumerate() {
            for t in LoraTarget::ALL {
                let p = &layer[t.index()];
                let a = Tensor::from_slice(&p.a, (self.cfg.rank, p.in_dim), &Device::Cpu)?;
                let b = Tensor::from_slice(&p.b, (p.out_dim, self.cfg.rank), &Device::Cpu)?;
                tensors.insert(tensor_name(l, t, "a"), a);
                tensors.insert(tensor_name(l, t, "b"), b);
            }
        }
        if let Some(p) = &self.head {
            let a = Tensor::from_slice(&p.a, (self.cfg.rank, p.in_dim), &Device::Cpu)?;
            let b = Tensor::from_slice(&p.b, (p.out_dim, self.cfg.rank), &Device::Cpu)?;
            tensors.insert(head_tensor_name("a"), a);
            tensors.insert(head_tensor_name("b"), b);
        }
        tensors.insert(
            ALPHA_KEY.to_string(),
            Tensor::from_slice(&[self.cfg.alpha], 1, &Device::Cpu)?,
        );
        safetensors::tensor::serialize(&tensors, None)
            .map_err(|e| ModelError::Candle(candle_core::Error::from(e)))
    }

    /// Safetensors, written to a temporary file beside `path` then renamed over it, so a reader
    /// never sees a half-written adapter.
    pub fn save(&self, path: &Path) -> Result<(), ModelError> {
        let bytes = self.to_bytes()?;
        let io_err = |source| ModelError::Io {
            path: path.display().to_string(),
            source,
        };
        let mut tmp = path.as_os_str().to_owned();
        tmp.push(format!(".tmp{}", std::process::id()));
        let tmp = std::path::PathBuf::from(tmp);
        std::fs::write(&tmp, bytes).map_err(io_err)?;
        std::fs::rename(&tmp, path).map_err(io_err)
    }

    /// Loads an adapter saved by [`LoraAdapter::save`]; every tensor's shape is checked against
    /// `model`.
    pub fn load(path: &Path, model: &ModelConfig) -> Result<Self, ModelError> {
        let bytes = std::fs::read(path).map_err(|source| ModelError::Io {
            path: path.display().to_string(),
            source,
        })?;
        Self::from_bytes(&bytes, &path.display().to_string(), model)
    }

    /// Reads an adapter from the bytes of [`LoraAdapter::to_bytes`] (a safetensors file);
    /// every tensor's shape is checked against `model`. `origin` (where the bytes came from)
    /// names the adapter in errors.
    pub fn from_bytes(bytes: &[u8], origin: &str, model: &ModelConfig) -> Result<Self, ModelError> {
        let adapter_err = |reason: String| ModelError::Adapter {
            path: origin.to_owned(),
            reason,
        };
        let mut tensors = candle_core::safetensors::load_buffer(bytes, &Device::Cpu)
            .map_err(|e| adapter_err(format!("not a safetensors file: {e}")))?;
        let alpha = tensors
            .remove(ALPHA_KEY)
            .ok_or_else(|| adapter_err(format!("tensor {ALPHA_KEY} is missing")))?
            .flatten_all()?
            .to_vec1::<f32>()
            .map_err(|e| adapter_err(format!("{ALPHA_KEY}: {e}")))?;
        let [alpha] = alpha[..] else {
            return Err(adapter_err(format!("{ALPHA_KEY} must hold one value")));
        };
        let first = tensor_name(0, LoraTarget::Q, "a");
        let has_head = tensors.contains_key(&head_tensor_name("a"));
        let rank = match tensors.get(&first).map(|t| t.dims()) {
            Some(&[r, _]) if r > 0 => r,
            Some(dims) => return Err(adapter_err(format!("{first} has shape {dims:?}"))),
            None => return Err(adapter_err(format!("tensor {first} is missing"))),
        };
        let mut read = |name: String, shape: [usize; 2]| -> Result<Vec<f32>, ModelError> {
            let tensor = tensors
                .remove(&name)
                .ok_or_else(|| adapter_err(format!("tensor {name} is missing")))?;
            if tensor.dims() != shape {
                return Err(ModelError::TensorShape {
                    name,
                    expected: shape.to_vec(),
                    got: tensor.dims().to_vec(),
                });
            }
            tensor
                .flatten_all()?
                .to_vec1::<f32>()
                .map_err(|e| adapter_err(format!("{name}: {e}")))
        };
        let mut read_pair = |(out_dim, in_dim): (usize, usize),
                             name: &dyn Fn(&str) -> String|
         -> Result<LoraPair, ModelError> {
            let a = read(name("a"), [rank, in_dim])?;
            let b = read(name("b"), [out_dim, rank])?;
            Ok(LoraPair::new(a, b, in_dim, out_dim))
        };
        let mut layers = Vec::with_capacity(model.num_layers);
        for l in 0..model.num_layers {
            let mut pairs = Vec::with_capacity(7);
            for t in LoraTarget::ALL {
                pairs.push(read_pair(t.dims(model), &|m| tensor_name(l, t, m))?);
            }
            let pairs: [LoraPair; 7] = pairs
                .try_into()
                .map_err(|_| adapter_err("wrong number of targets".to_owned()))?;
            layers.push(pairs);
        }
        let unembed = has_head;
        let head = unembed
            .then(|| read_pair(head_dims(model), &head_tensor_name))
            .transpose()?;
        if let Some(extra) = tensors.keys().next() {
            return Err(adapter_err(format!(
                "unexpected tensor {extra} (an adapter for a model with more layers?)"
            )));
        }
        Ok(LoraAdapter {
            id: next_id(),
            cfg: LoraConfig {
                rank,
                alpha,
                unembed,
            },
            layers,
            head,
        })
    }

    pub fn num_params(&self) -> usize {
        self.params().iter().map(|p| p.len()).sum()
    }

    pub fn memory_bytes(&self) -> usize {
        self.num_params() * std::mem::size_of::<f32>()
    }

    /// Every trainable tensor as one flat slice, fixed order (per layer, per target in
    /// [`LoraTarget::ALL`] order: A then B; then the LM head's A and B where it has a pair);
    /// optimizer state and [`LoraGrads`] are parallel to it.
    pub fn params(&self) -> Vec<&[f32]> {
        self.layers
            .iter()
            .flat_map(|l| l.iter())
            .chain(&self.head)
            .flat_map(|p| [p.a.as_slice(), p.b.as_slice()])
            .collect()
    }

    pub fn params_mut(&mut self) -> Vec<&mut [f32]> {
        self.id = next_id();
        self.layers
            .iter_mut()
            .flat_map(|l| l.iter_mut())
            .chain(&mut self.head)
            .flat_map(|p| {
                p.b_rows = OnceLock::new();
                [p.a.as_mut_slice(), p.b.as_mut_slice()]
            })
            .collect()
    }

    /// Adds this adapter's term for `target` of `layer` to `y` (rows of the projection's output)
    /// from `x` (the same rows of its input). Row by row, so a row's numbers never depend on the
    /// other rows (serving and training agree bit for bit).
    pub(crate) fn apply(&self, layer: usize, target: LoraTarget, x: &[f32], y: &mut [f32]) {
        use rayon::prelude::*;
        let p = self.pair(layer, target);
        let scale = self.scale();
        let rank = self.cfg.rank;
        let b_rows = p.b_rows();
        let row = |t: &mut Vec<f32>, (xr, yr): (&[f32], &mut [f32])| {
            p.down_project(xr, t);
            add_up_projection(t, b_rows, p.out_dim, 0, scale, yr);
        };
        let scratch = || vec![0f32; rank];
        let rows = x.chunks_exact(p.in_dim).zip(y.chunks_exact_mut(p.out_dim));
        // A decode step's few rows stay on the calling thread (handing them over costs more).
        if rows.len() < 2 * crate::ops::ROWS_PER_TASK || crate::team::leads() {
            let mut scratch = scratch();
            rows.for_each(|r| row(&mut scratch, r));
        } else {
            x.par_chunks_exact(p.in_dim)
                .zip(y.par_chunks_exact_mut(p.out_dim))
                .with_min_len(crate::ops::ROWS_PER_TASK)
                .for_each_init(scratch, row);
        }
    }

    /// Adds the LM head's term, where the adapter has one, to rows of logits `y` from the same
    /// rows `x` of the normed hidden state. In parallel over parts of the outputs, each part
    /// taking every row in turn, so that its part of `Bᵀ` is read from memory once per call, not
    /// once per row (8 MB per row on Gemma 3). A row's numbers are [`LoraAdapter::apply`]'s
    /// arithmetic whatever the rows beside it, so served and trained logits agree.
    pub(crate) fn apply_head(&self, x: &[f32], y: &mut [f32]) {
        let Some(p) = &self.head else {
            return;
        };
        let scale = self.scale();
        let rank = self.cfg.rank;
        let b_rows = p.b_rows();
        let mut t = vec![0f32; x.len() / p.in_dim * rank];
        for (xr, tr) in x.chunks_exact(p.in_dim).zip(t.chunks_exact_mut(rank)) {
            p.down_project(xr, tr);
        }
        let mut parts: Vec<Vec<&mut [f32]>> = (0..p.out_dim.div_ceil(HEAD_OUTPUTS_PER_TASK))
            .map(|_| Vec::new())
            .collect();
        for row in y.chunks_exact_mut(p.out_dim) {
            for (part, rows) in row.chunks_mut(HEAD_OUTPUTS_PER_TASK).zip(&mut parts) {
                rows.push(part);
            }
        }
        crate::team::for_each_chunk(&mut parts, 1, &|i, rows| {
            let start = i * HEAD_OUTPUTS_PER_TASK;
            for (part, tr) in rows[0].iter_mut().zip(t.chunks_exact(rank)) {
                add_up_projection(tr, b_rows, p.out_dim, start, scale, part);
            }
        });
    }
}

/// Outputs per task in [`LoraAdapter::apply_head`]: their part of `Bᵀ` (256 KB at rank 8) stays
/// in L2 across the rows.
const HEAD_OUTPUTS_PER_TASK: usize = 8192;

/// `y += scale · t·Bᵀ` over outputs `start..start + y.len()` of one row, `b_rows` being `Bᵀ`
/// (`[rank, out_dim]`). Each output's sum over the rank runs in rank order from 0 (the same bits
/// as a dot of fewer than `ops::dot`'s lanes), for `UP_BLOCK` outputs at a time in registers
/// (a pass over a scratch row per rank step loaded and stored it each time).
fn add_up_projection(
    t: &[f32],
    b_rows: &[f32],
    out_dim: usize,
    start: usize,
    scale: f32,
    y: &mut [f32],
) {
    let whole = y.len() / UP_BLOCK * UP_BLOCK;
    let mut blocks = y.chunks_exact_mut(UP_BLOCK);
    for (c, yc) in (&mut blocks).enumerate() {
        let o0 = start + c * UP_BLOCK;
        let mut u = [0f32; UP_BLOCK];
        for (&tk, b_row) in t.iter().zip(b_rows.chunks_exact(out_dim)) {
            let b: &[f32; UP_BLOCK] = b_row[o0..o0 + UP_BLOCK].try_into().expect("a block");
            for (u, &b) in u.iter_mut().zip(b) {
                *u += tk * b;
            }
        }
        for (yo, &u) in yc.iter_mut().zip(&u) {
            *yo += scale * u;
        }
    }
    let tail = blocks.into_remainder();
    let o0 = start + whole;
    let mut u = [0f32; UP_BLOCK];
    let u = &mut u[..tail.len()];
    for (&tk, b_row) in t.iter().zip(b_rows.chunks_exact(out_dim)) {
        for (u, &b) in u.iter_mut().zip(&b_row[o0..o0 + tail.len()]) {
            *u += tk * b;
        }
    }
    for (yo, &u) in tail.iter_mut().zip(u.iter()) {
        *yo += scale * u;
    }
}

/// Outputs [`add_up_projection`] keeps in registers together (four AVX2 registers).
const UP_BLOCK: usize = 32;

/// `(out, in)` of the LM head's pair: `[vocab, hidden]`.
fn head_dims(model: &ModelConfig) -> (usize, usize) {
    (model.vocab_size, model.hidden_size)
}

impl LoraPair {
    pub(crate) fn new(a: Vec<f32>, b: Vec<f32>, in_dim: usize, out_dim: usize) -> Self {
        LoraPair {
            a,
            b,
            in_dim,
            out_dim,
            b_rows: OnceLock::new(),
        }
    }

    /// `Bᵀ`, `[rank, out]` (see the field).
    fn b_rows(&self) -> &[f32] {
        self.b_rows.get_or_init(|| {
            let rank = self.b.len() / self.out_dim.max(1);
            (0..rank)
                .flat_map(|k| self.b.chunks_exact(rank).map(move |b| b[k]))
                .collect()
        })
    }

    /// `t = x·Aᵀ` for one row.
    pub(crate) fn down_project(&self, x: &[f32], t: &mut [f32]) {
        for (tr, arow) in t.iter_mut().zip(self.a.chunks_exact(self.in_dim)) {
            *tr = crate::ops::dot(x, arow);
        }
    }
}

/// Gradients parallel to [`LoraAdapter::params`].
#[derive(Clone, Debug)]
pub struct LoraGrads {
    pub grads: Vec<Vec<f32>>,
}

impl LoraGrads {
    /// The grads of one pair: A's at `index`, B's after it.
    pub(crate) fn pair_mut(&mut self, index: usize) -> (&mut [f32], &mut [f32]) {
        let (a, b) = self.grads[index..index + 2].split_at_mut(1);
        (&mut a[0], &mut b[0])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// In blocks or not, every output is its rank-order sum from 0, scaled and added: the bits
    /// of the one-output formula, a part of the outputs (`start`) and a tail short of a block
    /// included.
    #[test]
    fn up_projection_in_blocks_is_each_outputs_own_sum() {
        let mut state = 11u64;
        let mut rand = || {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        };
        let (rank, out_dim) = (8, 3 * UP_BLOCK + 5);
        let t: Vec<f32> = (0..rank).map(|_| rand()).collect();
        let b_rows: Vec<f32> = (0..rank * out_dim).map(|_| rand()).collect();
        for (start, len) in [(0, out_dim), (UP_BLOCK, 2 * UP_BLOCK + 5), (7, 3), (0, 0)] {
            let y0: Vec<f32> = (0..len).map(|_| rand()).collect();
            let mut y = y0.clone();
            add_up_projection(&t, &b_rows, out_dim, start, 0.75, &mut y);
            for (o, (&got, &before)) in y.iter().zip(&y0).enumerate() {
                let mut u = 0f32;
                for (k, &tk) in t.iter().enumerate() {
                    u += tk * b_rows[k * out_dim + start + o];
                }
                assert_eq!(got.to_bits(), (before + 0.75 * u).to_bits(), "{start} {o}");
            }
        }
    }
}
