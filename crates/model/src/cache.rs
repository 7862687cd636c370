use half::f16;
use half::slice::HalfFloatSliceExt;

use crate::kernels::LlamaCall;

/// Rows per llama.cpp `llama_decode` of a prompt (its default `n_ubatch`).
pub(crate) const LLAMA_UBATCH: usize = 512;

/// Keys and values of one sequence, per layer, row-major `[len, kv_heads * head_dim]` (keys
/// already normed and rotated), in f16 as llama.cpp keeps them. `Clone` forks a prefilled
/// prompt.
#[derive(Debug, Clone)]
pub struct SeqCache {
    len: usize,
    kv_width: usize,
    layers: Vec<LayerKv>,
    /// The request's prompt length, when known (see `Gemma3::new_prompt_cache`).
    prompt_len: Option<usize>,
}

#[derive(Debug, Clone, Default)]
pub(crate) struct LayerKv {
    pub(crate) k: Vec<f16>,
    pub(crate) v: Vec<f16>,
}

impl SeqCache {
    pub(crate) fn new(num_layers: usize, kv_width: usize) -> Self {
        Self {
            len: 0,
            kv_width,
            layers: vec![LayerKv::default(); num_layers],
            prompt_len: None,
        }
    }

    pub(crate) fn set_prompt_len(&mut self, n: usize) {
        self.prompt_len = Some(n);
    }

    /// The llama.cpp calls that compute the positions `start..start + n` of this sequence
    /// (batch rows from `row`): with a known prompt, the prompt in calls of `LLAMA_UBATCH`
    /// rows and every later token alone (a decode step), however the tokens are chunked;
    /// otherwise the positions as one call.
    pub(crate) fn llama_calls(&self, row: usize, n: usize) -> Vec<LlamaCall> {
        let start = self.len;
        let Some(prompt) = self.prompt_len else {
            return vec![LlamaCall {
                rows: row..row + n,
                first: 0,
                len: n,
            }];
        };
        let mut calls = Vec::new();
        let mut p = start;
        while p < start + n {
            let (call_start, call_len) = if p < prompt {
                let u = p / LLAMA_UBATCH * LLAMA_UBATCH;
                (u, (prompt - u).min(LLAMA_UBATCH))
            } else {
                (p, 1)
            };
            let end = (call_start + call_len).min(start + n);
            calls.push(LlamaCall {
                rows: row + (p - start)..row + (end - start),
                first: p - call_start,
                len: call_len,
            });
            p = end;
        }
        calls
    }

    /// Number of tokens cached (the position the next token takes).
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub(crate) fn fits(&self, num_layers: usize, kv_width: usize) -> bool {
        self.layers.len() == num_layers && self.kv_width == kv_width
    }

    /// Appends rows to one layer, rounded to f16; `Vec`'s doubling keeps growth amortised O(1)
    /// per token.
    pub(crate) fn append(&mut self, layer: usize, k: &[f32], v: &[f32]) {
        let l = &mut self.layers[layer];
        extend_f16(&mut l.k, k);
        extend_f16(&mut l.v, v);
    }

    pub(crate) fn layer(&self, layer: usize) -> &LayerKv {
        &self.layers[layer]
    }

    /// Commits `n` tokens appended to every layer.
    pub(crate) fn advance(&mut self, n: usize) {
        self.len += n;
    }

    /// Drops rows appended past `len` (a forward that failed half way).
    pub(crate) fn rollback(&mut self) {
        let keep = self.len * self.kv_width;
        for l in &mut self.layers {
            l.k.truncate(keep);
            l.v.truncate(keep);
        }
    }
}

/// Appends `x` rounded to f16 (round to nearest even, as ggml's f32 -> f16 copy).
pub(crate) fn extend_f16(dst: &mut Vec<f16>, x: &[f32]) {
    let start = dst.len();
    dst.resize(start + x.len(), f16::ZERO);
    dst[start..].convert_from_f32_slice(x);
}
