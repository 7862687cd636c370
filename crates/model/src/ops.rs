//! Element-wise and attention kernels over row-major f32 slices.

use std::mem::MaybeUninit;
use std::sync::OnceLock;

use rayon::prelude::*;

use half::f16;

use crate::kernels::Isa;
use crate::softmax::exp_neg;
use crate::{Activation, RopeLayout, Yarn};

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

/// RMS-normalises every row of width `weight.len()` in place and multiplies by `weight`
/// (GGUF norm weights already include Gemma's +1). As ggml: the squares (f32) summed in order
/// in f64, the mean rounded to f32, then `x * scale * w`.
pub(crate) fn rms_norm(x: &mut [f32], weight: &[f32], eps: f32) {
    let n = weight.len();
    for_each_row(x, n, |_, row| {
        let sum: f64 = row.iter().map(|&v| (v * v) as f64).sum();
        let mean = (sum / n as f64) as f32;
        let scale = 1.0 / (mean + eps).sqrt();
        for (v, w) in row.iter_mut().zip(weight) {
            *v = *v * scale * w;
        }
    });
}

/// `f(i, row i)` for every row of `x` (`width` values each): in parallel, tasks of at least
/// [`ROWS_PER_TASK`] rows, where there are many (a prefill's or a training step's rows: the
/// norms and rotations of a 1,024-token step left the second core idle); a decode step's few
/// rows on the calling thread. A row's arithmetic is the same either way.
pub(crate) fn for_each_row(x: &mut [f32], width: usize, f: impl Fn(usize, &mut [f32]) + Sync) {
    if x.len() / width < 2 * ROWS_PER_TASK || crate::team::leads() {
        x.chunks_exact_mut(width)
            .enumerate()
            .for_each(|(i, row)| f(i, row));
    } else {
        x.par_chunks_exact_mut(width)
            .enumerate()
            .with_min_len(ROWS_PER_TASK)
            .for_each(|(i, row)| f(i, row));
    }
}

/// Backward of [`rms_norm`]: `x` the rows it normalised, `dy` the gradient of its output;
/// returns the gradient of `x`. With `r = 1/sqrt(mean(x²) + eps)`, `y = x·r·w`:
/// `dx = r·w·dy - x·r³/n · Σ(dy·w·x)`.
pub(crate) fn rms_norm_backward(x: &[f32], weight: &[f32], eps: f32, dy: &[f32]) -> Vec<f32> {
    let n = weight.len();
    assert!(
        x.len() == dy.len() && x.len().is_multiple_of(n),
        "whole rows of {n}"
    );
    // SAFETY: every chunk is a whole row of `n` values (asserted), each written below.
    unsafe {
        written_in_parallel(x.len(), n, ROWS_PER_TASK, |i, dxr| {
            let (xr, dyr) = (&x[i * n..][..n], &dy[i * n..][..n]);
            let mean = dot(xr, xr) / n as f32;
            let r = 1.0 / (mean + eps).sqrt();
            let mut s = 0f32;
            for ((xi, di), wi) in xr.iter().zip(dyr).zip(weight) {
                s += di * wi * xi;
            }
            let c = s * r * r * r / n as f32;
            for (((d, xi), di), wi) in dxr.iter_mut().zip(xr).zip(dyr).zip(weight) {
                d.write(r * wi * di - xi * c);
            }
        })
    }
}

/// A vector of `len` values that `fill` writes in parallel, given each chunk of `chunk` values
/// (the last one shorter where `len` is not a multiple) with its index, in tasks of at least
/// `min_chunks` chunks. Not zeroed first: zeroing a fresh vector of a step's rows ran on the
/// calling thread while the pool waited (~1-2% of a training step's samples in all).
///
/// # Safety
/// `fill` writes every value of every chunk it is given.
pub(crate) unsafe fn written_in_parallel(
    len: usize,
    chunk: usize,
    min_chunks: usize,
    fill: impl Fn(usize, &mut [MaybeUninit<f32>]) + Sync,
) -> Vec<f32> {
    let mut out = Vec::with_capacity(len);
    out.spare_capacity_mut()[..len]
        .par_chunks_mut(chunk)
        .with_min_len(min_chunks)
        .enumerate()
        .for_each(|(i, values)| fill(i, values));
    // SAFETY: the chunks cover `len` values, all written (the caller's promise).
    unsafe { out.set_len(len) };
    out
}

/// The element-wise sum of equally long `parts`, each value summed in the parts' order (the
/// first, plus the second, ...), pieces of the values in parallel: a step's partial input
/// gradients (the LM head's dozens of spans) summed on the calling thread left the pool
/// waiting. Empty for no parts.
pub(crate) fn sum_in_order(parts: Vec<Vec<f32>>) -> Vec<f32> {
    const VALUES_PER_TASK: usize = 16 * 1024;
    let mut parts = parts.into_iter();
    let mut sum = parts.next().unwrap_or_default();
    let rest: Vec<Vec<f32>> = parts.collect();
    assert!(
        rest.iter().all(|p| p.len() == sum.len()),
        "parts of one length"
    );
    sum.par_chunks_mut(VALUES_PER_TASK)
        .enumerate()
        .for_each(|(i, piece)| {
            for part in &rest {
                crate::model::add_assign(piece, &part[i * VALUES_PER_TASK..]);
            }
        });
    sum
}

/// Cos/sin tables, one row of `head_dim / 2` per position. Built like ggml's rope cache (the
/// angle advanced by repeated f32 multiplication) so angles match llama.cpp's bit for bit.
pub(crate) struct RopeTable {
    half: usize,
    layout: RopeLayout,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl RopeTable {
    /// As ggml's rope: pair `i`'s angle is `freq_scale · (θ_i / factors[i])` (linear scaling,
    /// Llama 3's per-frequency divisors), or with `yarn` that angle blended with the unscaled
    /// one along YaRN's ramp and cos and sin scaled; a scale of 1, no factors and no YaRN leave
    /// the plain angle's bits.
    pub(crate) fn new(
        positions: &[usize],
        head_dim: usize,
        base: f32,
        (freq_scale, factors, yarn): (f32, Option<&[f32]>, Option<Yarn>),
        layout: RopeLayout,
    ) -> Self {
        let half = head_dim / 2;
        let theta_scale = base.powf(-2.0 / head_dim as f32);
        let mut cos = Vec::with_capacity(positions.len() * half);
        let mut sin = Vec::with_capacity(positions.len() * half);
        for &p in positions {
            let mut theta = p as f32;
            for i in 0..half {
                let extrap = theta / factors.map_or(1.0, |f| f[i]);
                let interp = freq_scale * extrap;
                match yarn {
                    None => {
                        cos.push(interp.cos());
                        sin.push(interp.sin());
                    }
                    Some(y) => {
                        let ramp = (i as f32 - y.low) / (y.high - y.low).max(0.001);
                        let mix = 1.0 - ramp.clamp(0.0, 1.0);
                        let angle = interp * (1.0 - mix) + extrap * mix;
                        cos.push(angle.cos() * y.mscale);
                        sin.push(angle.sin() * y.mscale);
                    }
                }
                theta *= theta_scale;
            }
        }
        Self {
            half,
            layout,
            cos,
            sin,
        }
    }

    /// Rotates `x` = `[tokens, heads, head_dim]` in place, token `t` at the table's `t`-th
    /// position.
    pub(crate) fn apply(&self, x: &mut [f32], heads: usize) {
        // GCC contracts ggml's `x0*cos - x1*sin` and `x0*sin + x1*cos` this way.
        self.rotate(x, heads, |x0, x1, cos, sin| {
            (x0.mul_add(cos, -(x1 * sin)), x0.mul_add(sin, x1 * cos))
        });
    }

    /// Backward of [`RopeTable::apply`]: the rotation is orthogonal, so its gradient is the
    /// inverse rotation.
    pub(crate) fn apply_inverse(&self, x: &mut [f32], heads: usize) {
        self.rotate(x, heads, |y0, y1, cos, sin| {
            (y0 * cos + y1 * sin, -y0 * sin + y1 * cos)
        });
    }

    /// `f(x0, x1, cos, sin)` on every rotated pair of every head, in place.
    fn rotate(
        &self,
        x: &mut [f32],
        heads: usize,
        f: impl Fn(f32, f32, f32, f32) -> (f32, f32) + Sync,
    ) {
        let (half, d) = (self.half, 2 * self.half);
        for_each_row(x, heads * d, |t, tok| {
            let cos = &self.cos[t * half..(t + 1) * half];
            let sin = &self.sin[t * half..(t + 1) * half];
            for head in tok.chunks_exact_mut(d) {
                for i in 0..half {
                    let (a, b) = match self.layout {
                        RopeLayout::Interleaved => (2 * i, 2 * i + 1),
                        RopeLayout::HalfSplit => (i, i + half),
                    };
                    (head[a], head[b]) = f(head[a], head[b], cos[i], sin[i]);
                }
            }
        });
    }
}

const SQRT_2_OVER_PI: f32 = 0.797_884_6;
const COEF_A: f32 = 0.044_715;

/// `gate <- act(gate) * up`: the MLP's gated activation.
pub(crate) fn act_mul(act: Activation, gate: &mut [f32], up: &[f32], f16_table: bool) {
    match act {
        Activation::Gelu => gelu_mul(gate, up, f16_table),
        // In f32, element by element: a row's values depend on nothing else.
        Activation::Silu => elementwise(gate, up, |gate, up| {
            for (g, u) in gate.iter_mut().zip(up) {
                *g = silu_and_slope(*g).0 * u;
            }
        }),
    }
}

/// `gate <- gelu_tanh(gate) * up`. With `f16_table` (serving and training), through a table of
/// every f16 value (ggml's): the gate rounded to f16, its GELU looked up (computed once in f32
/// and rounded to f16); 0 below -10 and the identity above 10; much cheaper than a `tanh` per
/// value. Without, in f32: smooth, for gradient checks.
fn gelu_mul(gate: &mut [f32], up: &[f32], f16_table: bool) {
    let isa = Isa::detect();
    elementwise(gate, up, |gate, up| {
        if !f16_table {
            for (g, u) in gate.iter_mut().zip(up) {
                *g = gelu(*g) * u;
            }
        } else {
            gelu_mul_table(isa, gate, up);
        }
    });
}

/// `piece` over `gate` and `up` in pieces of `ELEMS_PER_TASK`, in parallel when there are
/// several.
fn elementwise(gate: &mut [f32], up: &[f32], piece: impl Fn(&mut [f32], &[f32]) + Sync) {
    if gate.len() <= ELEMS_PER_TASK {
        piece(gate, up);
    } else if crate::team::leads() {
        crate::team::for_each_chunk(gate, ELEMS_PER_TASK, &|i, gate| {
            piece(gate, &up[i * ELEMS_PER_TASK..][..gate.len()])
        });
    } else {
        gate.par_chunks_mut(ELEMS_PER_TASK)
            .zip(up.par_chunks(ELEMS_PER_TASK))
            .for_each(|(gate, up)| piece(gate, up));
    }
}

/// Element-wise work split across threads in pieces of this many values; less stays on the
/// calling thread (a decode step's 2,048-wide row: handing it to the pool costs more).
const ELEMS_PER_TASK: usize = 16 * 1024;
/// Row-wise work (norms, the adapters' terms) split in tasks of at least this many rows.
pub(crate) const ROWS_PER_TASK: usize = 8;

/// The table path of [`gelu_mul`] with `isa`'s instructions (eight values at a time: F16C
/// rounds them to f16, AVX2 gathers their table entries); the same bits as the scalar loop.
fn gelu_mul_table(isa: Isa, gate: &mut [f32], up: &[f32]) {
    let table = gelu_table();
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if isa != Isa::Scalar {
        // SAFETY: x86 levels are only named when the CPU has AVX2, FMA and F16C.
        done = unsafe { x86::gelu_mul_table(gate, up, table) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = isa;
    for (g, u) in gate[done..].iter_mut().zip(&up[done..]) {
        let x = *g;
        *g = if x <= -10.0 {
            0.0
        } else if x >= 10.0 {
            x * u
        } else {
            table[f16::from_f32(x).to_bits() as usize] * u
        };
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// The whole groups of eight of `gate`; returns how many values it did.
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn gelu_mul_table(gate: &mut [f32], up: &[f32], table: &[f32]) -> usize {
        assert!(up.len() >= gate.len() && table.len() == 1 << 16);
        let (lo, hi) = (_mm256_set1_ps(-10.0), _mm256_set1_ps(10.0));
        let n = gate.len() / 8 * 8;
        for i in (0..n).step_by(8) {
            // SAFETY: `i + 8 <= n <= gate.len() <= up.len()`; every index is a u16, inside the
            // table of 65,536 entries.
            unsafe {
                let x = _mm256_loadu_ps(gate.as_ptr().add(i));
                let u = _mm256_loadu_ps(up.as_ptr().add(i));
                let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(x);
                let g = _mm256_i32gather_ps::<4>(table.as_ptr(), _mm256_cvtepu16_epi32(h));
                let y = _mm256_mul_ps(g, u);
                let y =
                    _mm256_blendv_ps(y, _mm256_mul_ps(x, u), _mm256_cmp_ps::<_CMP_GE_OQ>(x, hi));
                let y = _mm256_andnot_ps(_mm256_cmp_ps::<_CMP_LE_OQ>(x, lo), y);
                _mm256_storeu_ps(gate.as_mut_ptr().add(i), y);
            }
        }
        n
    }
}

fn gelu(x: f32) -> f32 {
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * x * (COEF_A * x).mul_add(x, 1.0)).tanh())
}

/// GELU of every f16 value, rounded to f16 (ggml's `ggml_table_gelu_f16`, with the fused
/// multiply-add GCC makes of `1 + a·x·x`).
fn gelu_table() -> &'static [f32] {
    static TABLE: OnceLock<Vec<f32>> = OnceLock::new();
    TABLE.get_or_init(|| {
        (0..=u16::MAX)
            .map(|bits| f16::from_f32(gelu(f16::from_bits(bits).to_f32())).to_f32())
            .collect()
    })
}

/// Backward of [`act_mul`] at inputs `gate`, `up` for output gradient `dy`: returns
/// (d gate, d up).
pub(crate) fn act_mul_backward(
    act: Activation,
    gate: &[f32],
    up: &[f32],
    dy: &[f32],
) -> (Vec<f32>, Vec<f32>) {
    match act {
        Activation::Gelu => act_mul_backward_with(gelu_and_slope, gate, up, dy),
        Activation::Silu => act_mul_backward_with(silu_and_slope, gate, up, dy),
    }
}

/// [`act_mul_backward`] for one activation's `(value, slope)`: generic, so it inlines into the
/// loop and the loop vectorizes (through a function pointer it would be a call per value).
fn act_mul_backward_with(
    grad: impl Fn(f32) -> (f32, f32) + Sync,
    gate: &[f32],
    up: &[f32],
    dy: &[f32],
) -> (Vec<f32>, Vec<f32>) {
    let len = gate.len();
    assert!(
        up.len() == len && dy.len() == len,
        "gate, up and dy of one length"
    );
    // Written into the vectors' capacity, not zeroed first (see `written_in_parallel`).
    let (mut dg, mut du) = (Vec::with_capacity(len), Vec::with_capacity(len));
    dg.spare_capacity_mut()[..len]
        .par_chunks_mut(ELEMS_PER_TASK)
        .zip(du.spare_capacity_mut()[..len].par_chunks_mut(ELEMS_PER_TASK))
        .enumerate()
        .for_each(|(i, (dg, du))| {
            let at = i * ELEMS_PER_TASK;
            let inputs = gate[at..].iter().zip(&up[at..]).zip(&dy[at..]);
            for ((dg, du), ((&x, &u), &d)) in dg.iter_mut().zip(du.iter_mut()).zip(inputs) {
                let (value, slope) = grad(x);
                dg.write(d * u * slope);
                du.write(d * value);
            }
        });
    // SAFETY: the chunks cover `len` values of each, every one written above (the inputs are
    // as long, asserted).
    unsafe {
        dg.set_len(len);
        du.set_len(len);
    }
    (dg, du)
}

/// GELU (tanh approximation) and its derivative at `x`, with `t = tanh(y)`:
/// `gelu = x·(1 + t)/2`, `slope = (1 + t)/2 + x·(1 - t²)/2·y'`. Branch-free from
/// `e = e^(-2|y|)` ([`exp_neg`]), so the backward's loop vectorizes where `f32::tanh` is a libm
/// call per value; `1 + t`, `1 - t²` come from `e` directly, so the far negative tail keeps
/// its small values where `1 + tanh(y)` would cancel to 0.
#[inline(always)]
fn gelu_and_slope(x: f32) -> (f32, f32) {
    let y = SQRT_2_OVER_PI * x * (1.0 + COEF_A * x * x);
    let e = exp_neg(-2.0 * y.abs());
    let r = 1.0 / (1.0 + e);
    let one_plus_t = 2.0 * r * if y >= 0.0 { 1.0 } else { e };
    let one_minus_t2 = 4.0 * e * r * r;
    let gelu = 0.5 * x * one_plus_t;
    let slope =
        0.5 * one_plus_t + 0.5 * x * one_minus_t2 * SQRT_2_OVER_PI * (1.0 + 3.0 * COEF_A * x * x);
    (gelu, slope)
}

/// SiLU `x·σ(x)` and its derivative `σ(x)·(1 + x·(1 - σ(x)))` at `x`, branch-free from
/// `e = e^(-|x|)` ([`exp_neg`]): `σ(x)` and `1 - σ(x) = σ(-x)` are `1/(1 + e)` and
/// `e/(1 + e)`, one each way, so neither cancels.
#[inline(always)]
fn silu_and_slope(x: f32) -> (f32, f32) {
    let e = exp_neg(-x.abs());
    let r = 1.0 / (1.0 + e);
    let (s, one_minus_s) = if x >= 0.0 { (r, e * r) } else { (e * r, r) };
    (x * s, s * (1.0 + x * one_minus_s))
}

/// A `rows x cols` f32 matrix over a slice, element `(r, c)` at `r·row_stride + c·col_stride`:
/// a transpose or a block of rows is a view, not a copy.
#[derive(Clone, Copy)]
pub(crate) struct MatRef<'a> {
    data: &'a [f32],
    rows: usize,
    cols: usize,
    row_stride: isize,
    col_stride: isize,
}

impl<'a> MatRef<'a> {
    /// Row-major `rows x cols`; panics unless `data` holds exactly that.
    pub(crate) fn new(data: &'a [f32], rows: usize, cols: usize) -> Self {
        assert_eq!(data.len(), rows * cols, "a {rows}x{cols} matrix");
        MatRef {
            data,
            rows,
            cols,
            row_stride: cols as isize,
            col_stride: 1,
        }
    }

    pub(crate) fn t(self) -> Self {
        MatRef {
            rows: self.cols,
            cols: self.rows,
            row_stride: self.col_stride,
            col_stride: self.row_stride,
            ..self
        }
    }
}

/// Below this many multiply-adds a product runs on the calling thread.
const PARALLEL_MULS: usize = 1 << 18;

/// `out = scale·a·b`, or `out += scale·a·b` with `accumulate`; `out` row-major
/// `a.rows x b.cols`. Panics on disagreeing shapes.
pub(crate) fn matmul_f32(
    out: &mut [f32],
    a: MatRef<'_>,
    b: MatRef<'_>,
    scale: f32,
    accumulate: bool,
) {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    assert_eq!(b.rows, k, "inner dimensions");
    assert_eq!(out.len(), m * n, "a {m}x{n} product");
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            out.fill(0.0);
        }
        return;
    }
    let parallelism = if m * n * k >= PARALLEL_MULS {
        gemm::Parallelism::Rayon(0)
    } else {
        gemm::Parallelism::None
    };
    // SAFETY: every element (r, c) of `a` (r < m, c < k), of `b` (r < k, c < n) and of `out`
    // (m x n, row-major) is inside its slice: the views were built over whole matrices.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            out.as_mut_ptr(),
            1,
            n as isize,
            accumulate,
            a.data.as_ptr(),
            a.col_stride,
            a.row_stride,
            b.data.as_ptr(),
            b.col_stride,
            b.row_stride,
            1.0,
            scale,
            false,
            false,
            false,
            parallelism,
        )
    }
}

/// Softmax over `x` in place.
pub(crate) fn softmax(x: &mut [f32]) {
    // The maximum, the exponentials and the sum in lanes: every loop vectorizes.
    let max = crate::softmax::max_logit(x);
    for v in x.iter_mut() {
        *v = exp_neg(*v - max);
    }
    let mut lanes = [0f32; LANES];
    let chunks = x.chunks_exact(LANES);
    let tail: f32 = chunks.remainder().iter().sum();
    for c in chunks {
        for (l, &v) in lanes.iter_mut().zip(c) {
            *l += v;
        }
    }
    let sum = lanes.iter().sum::<f32>() + tail;
    let inv = 1.0 / sum;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sum_in_order_matches_the_serial_sum_bit_for_bit() {
        let mut rng = crate::kernels::test_util::Rng::new(7);
        // Magnitudes from 1e-4 to 1e4, so that the order of the additions shows in the bits.
        let mut next = || rng.uniform() * 10f32.powi((rng.next() % 9) as i32 - 4);
        for (parts, len) in [(0, 0), (1, 5), (3, 100_003), (75, 40_000)] {
            let parts: Vec<Vec<f32>> = (0..parts)
                .map(|_| (0..len).map(|_| next()).collect())
                .collect();
            let mut want = parts.first().cloned().unwrap_or_default();
            for part in &parts[1.min(parts.len())..] {
                crate::model::add_assign(&mut want, part);
            }
            let got = sum_in_order(parts);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&want), "{len} values");
        }
    }

    #[test]
    fn branch_free_activation_slopes_match_f64() {
        let (c, a) = (SQRT_2_OVER_PI as f64, COEF_A as f64);
        let gelu = |x: f64| {
            let t = (c * x * (1.0 + a * x * x)).tanh();
            let slope = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * c * (1.0 + 3.0 * a * x * x);
            (0.5 * x * (1.0 + t), slope)
        };
        let silu = |x: f64| {
            let s = 1.0 / (1.0 + (-x).exp());
            (x * s, s * (1.0 + x * (1.0 - s)))
        };
        for i in -40_000..=40_000 {
            let x = i as f32 * 1e-3;
            for (name, got, want) in [
                ("gelu", gelu_and_slope(x), gelu(x as f64)),
                ("silu", silu_and_slope(x), silu(x as f64)),
            ] {
                let close = |a: f32, b: f64| (a as f64 - b).abs() <= 3e-7 * (1.0 + b.abs());
                assert!(
                    close(got.0, want.0) && close(got.1, want.1),
                    "{name}({x}): {got:?} against {want:?}"
                );
            }
        }
        for x in [50f32, -50.0, 1e-30, -1e-30] {
            let (g, s) = (gelu(x as f64), silu(x as f64));
            // Below e^-87 the exponential stays at e^-87.
            let (gx, sx) = (gelu_and_slope(x), silu_and_slope(x));
            assert!((gx.0 as f64 - g.0).abs() < 1e-30, "gelu({x})");
            assert!((gx.1 as f64 - g.1).abs() < 1e-30, "gelu slope ({x})");
            assert!((sx.1 as f64 - s.1).abs() < 1e-7, "silu slope ({x})");
        }
        assert!(gelu_and_slope(f32::NAN).0.is_nan() && silu_and_slope(f32::NAN).0.is_nan());
    }

    #[test]
    fn matmul_f32_on_views_equals_the_loop() {
        let mut rng = crate::kernels::test_util::Rng::new(7);
        let mut next = move || rng.uniform();
        for (m, k, n) in [(1, 1, 1), (3, 5, 7), (70, 33, 65), (128, 64, 96)] {
            let a: Vec<f32> = (0..m * k).map(|_| next()).collect();
            // b stored transposed (n x k), read through a view.
            let bt: Vec<f32> = (0..n * k).map(|_| next()).collect();
            let start: Vec<f32> = (0..m * n).map(|_| next()).collect();
            for accumulate in [false, true] {
                let mut out = start.clone();
                matmul_f32(
                    &mut out,
                    MatRef::new(&a, m, k),
                    MatRef::new(&bt, n, k).t(),
                    0.5,
                    accumulate,
                );
                for r in 0..m {
                    for c in 0..n {
                        let dot: f64 = (0..k)
                            .map(|i| a[r * k + i] as f64 * bt[c * k + i] as f64)
                            .sum();
                        let want = 0.5 * dot
                            + if accumulate {
                                start[r * n + c] as f64
                            } else {
                                0.0
                            };
                        let got = out[r * n + c] as f64;
                        assert!(
                            (got - want).abs() < 1e-5,
                            "{m}x{k}x{n} ({r}, {c}): {got} against {want}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn gelu_table_paths_equal_the_scalar_loop() {
        // Every range: below -10, the table, above 10, around the bounds; a ragged tail.
        let mut state = 1u64;
        let mut uniform = move || {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (state >> 40) as f32 / (1u64 << 24) as f32
        };
        let gate: Vec<f32> = (0..1003)
            .map(|i| match i % 5 {
                0 => -10.0,
                1 => 10.0,
                _ => (uniform() - 0.5) * 30.0,
            })
            .collect();
        let up: Vec<f32> = (0..1003).map(|_| uniform() * 4.0 - 2.0).collect();
        let mut reference = gate.clone();
        gelu_mul_table(Isa::Scalar, &mut reference, &up);
        for isa in Isa::available() {
            let mut got = gate.clone();
            gelu_mul_table(isa, &mut got, &up);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&reference), "{isa:?}");
        }
    }
}
