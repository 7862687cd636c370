//! Element-wise and attention kernels over row-major f32 slices.

/// Independent accumulators so the reduction vectorises (f32 addition is not associative, so
/// the compiler will not reorder a single running sum).
const LANES: usize = 16;

#[inline]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    let ca = a.chunks_exact(LANES);
    let cb = b.chunks_exact(LANES);
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for l in 0..LANES {
            acc[l] += x[l] * y[l];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}

/// `y += a * x`
#[inline]
pub(crate) fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi += a * xi;
    }
}

/// RMS-normalises every row of width `weight.len()` in place and multiplies by `weight`
/// (GGUF norm weights already include Gemma's +1).
pub(crate) fn rms_norm(x: &mut [f32], weight: &[f32], eps: f32) {
    let n = weight.len();
    for row in x.chunks_exact_mut(n) {
        let mean = dot(row, row) / n as f32;
        let scale = 1.0 / (mean + eps).sqrt();
        for (v, w) in row.iter_mut().zip(weight) {
            *v = *v * scale * w;
        }
    }
}

/// Cos/sin tables, one row of `head_dim / 2` per position. Built like ggml's rope cache (the
/// angle advanced by repeated f32 multiplication) so angles match llama.cpp's bit for bit.
pub(crate) struct RopeTable {
    half: usize,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl RopeTable {
    pub(crate) fn new(positions: &[usize], head_dim: usize, base: f32) -> Self {
        let half = head_dim / 2;
        let theta_scale = base.powf(-2.0 / head_dim as f32);
        let mut cos = Vec::with_capacity(positions.len() * half);
        let mut sin = Vec::with_capacity(positions.len() * half);
        for &p in positions {
            let mut theta = p as f32;
            for _ in 0..half {
                cos.push(theta.cos());
                sin.push(theta.sin());
                theta *= theta_scale;
            }
        }
        Self { half, cos, sin }
    }

    /// Rotates `x` = `[tokens, heads, head_dim]` in place, NEOX style (pairs `i`, `i + half`),
    /// token `t` at the table's `t`-th position.
    pub(crate) fn apply(&self, x: &mut [f32], heads: usize) {
        let d = 2 * self.half;
        for (t, tok) in x.chunks_exact_mut(heads * d).enumerate() {
            let cos = &self.cos[t * self.half..(t + 1) * self.half];
            let sin = &self.sin[t * self.half..(t + 1) * self.half];
            for head in tok.chunks_exact_mut(d) {
                let (lo, hi) = head.split_at_mut(self.half);
                for i in 0..self.half {
                    let (x0, x1) = (lo[i], hi[i]);
                    lo[i] = x0 * cos[i] - x1 * sin[i];
                    hi[i] = x0 * sin[i] + x1 * cos[i];
                }
            }
        }
    }
}

/// `gate <- gelu_tanh(gate) * up`
pub(crate) fn gelu_mul(gate: &mut [f32], up: &[f32]) {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    const COEF_A: f32 = 0.044_715;
    for (g, u) in gate.iter_mut().zip(up) {
        let x = *g;
        let y = 0.5 * x * (1.0 + (SQRT_2_OVER_PI * x * (1.0 + COEF_A * x * x)).tanh());
        *g = y * u;
    }
}

/// Softmax over `x` in place.
pub(crate) fn softmax(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0f32;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    for v in x.iter_mut() {
        *v *= inv;
    }
}
