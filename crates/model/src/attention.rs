//! Causal attention of one token's query heads over its own sequence's cached keys and values.
//!
//! Per query head: every score `scale · q·k` in f32 (a fixed order of eight-lane partial sums),
//! a plain softmax over the visible keys (maximum, `exp`, sum, in key order), and the output as
//! the probability-weighted sum of the values in key order. A row's result depends only on its
//! own query and keys, never on the batch, on how the cache is split into blocks or on how many
//! tokens a forward computes: the arithmetic the whole engine relies on (batch and chunk
//! invariance, a cached prefix equal to a recomputed one, serving equal to training).
//!
//! The query heads that share a key/value head are computed together, so each key and value is
//! read once per group. The scalar reference and the AVX2 path compute the same bits (tested on
//! random data).

use half::f16;

use crate::cache::KvView;
use crate::kernels::Isa;

/// Values per step of a dot product: four accumulators of eight lanes.
const STEP: usize = 32;
const LANES: usize = 8;

/// An element of a key or value row: f16 in the serving cache, f32 in the trainer's smooth
/// mode (`Gemma3::set_exact_kv`).
pub(crate) trait KvElem: Copy + Send + Sync {
    fn get(self) -> f32;
}

impl KvElem for f16 {
    #[inline(always)]
    fn get(self) -> f32 {
        self.to_f32()
    }
}

impl KvElem for f32 {
    #[inline(always)]
    fn get(self) -> f32 {
        self
    }
}

/// Where one key/value head lies in the cache's rows: `d` values from column `col` of rows
/// `stride` wide.
#[derive(Clone, Copy)]
pub(crate) struct HeadColumns {
    pub(crate) col: usize,
    pub(crate) d: usize,
    pub(crate) stride: usize,
}

/// One token's attention: `queries` holds the group's heads (`heads x d`), the keys and values
/// of positions `lo..hi` come from `view` at `head`'s columns. Writes `heads x d` outputs to
/// `out`; `scores` is scratch space.
#[allow(clippy::too_many_arguments)]
pub(crate) fn attend_group<T: KvElem + 'static>(
    isa: Isa,
    queries: &[f32],
    scale: f32,
    view: &KvView<'_, T>,
    (lo, hi): (usize, usize),
    head: HeadColumns,
    out: &mut [f32],
    scores: &mut Vec<f32>,
) {
    let HeadColumns { col, d, stride } = head;
    let heads = queries.len() / d;
    let n = hi - lo;
    assert!(n > 0 && out.len() == queries.len() && heads * d == queries.len());
    scores.clear();
    scores.resize(heads * n, 0.0);
    let ops = Ops::<T>::new(isa);

    // Scores, head-major: scores[h * n + j].
    let mut j = 0;
    for (keys, _, rows) in view.spans(lo, hi, stride) {
        for r in 0..rows {
            let key = &keys[r * stride + col..][..d];
            for h in 0..heads {
                scores[h * n + j] = (ops.dot)(key, &queries[h * d..(h + 1) * d]) * scale;
            }
            j += 1;
        }
    }
    // Softmax weights (unnormalised) and their sums.
    let mut inv = [0f32; 8];
    let mut inv_heap = Vec::new();
    let inv: &mut [f32] = if heads <= inv.len() {
        &mut inv[..heads]
    } else {
        inv_heap.resize(heads, 0.0);
        &mut inv_heap
    };
    for (h, row) in scores.chunks_exact_mut(n).enumerate() {
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0f32;
        for s in row.iter_mut() {
            *s = (*s - max).exp();
            sum += *s;
        }
        inv[h] = 1.0 / sum;
    }
    // Weighted values, in key order.
    out.fill(0.0);
    let mut j = 0;
    for (_, values, rows) in view.spans(lo, hi, stride) {
        for r in 0..rows {
            let value = &values[r * stride + col..][..d];
            for h in 0..heads {
                (ops.axpy)(scores[h * n + j], value, &mut out[h * d..(h + 1) * d]);
            }
            j += 1;
        }
    }
    for (h, o) in out.chunks_exact_mut(d).enumerate() {
        for x in o.iter_mut() {
            *x *= inv[h];
        }
    }
}

/// The dot product and weighted add of one instruction set, for element type `T`.
struct Ops<T> {
    dot: fn(&[T], &[f32]) -> f32,
    axpy: fn(f32, &[T], &mut [f32]),
}

impl<T: KvElem + 'static> Ops<T> {
    fn new(isa: Isa) -> Self {
        #[cfg(target_arch = "x86_64")]
        if isa != Isa::Scalar {
            if let Some(ops) = x86::ops::<T>() {
                return ops;
            }
        }
        let _ = isa;
        Ops {
            dot: dot_scalar::<T>,
            axpy: axpy_scalar::<T>,
        }
    }
}

/// `Σ key[i]·q[i]`: lane `l` of accumulator `a` takes values `i ≡ a·8 + l (mod 32)` by fused
/// multiply-adds, the four accumulators fold as `(a0+a1)+(a2+a3)`, the lanes as ggml's
/// `hsum_float_8`; values past the last whole step are added one by one after.
fn dot_scalar<T: KvElem>(key: &[T], q: &[f32]) -> f32 {
    let whole = q.len() / STEP * STEP;
    let mut acc = [[0f32; LANES]; 4];
    for i in (0..whole).step_by(STEP) {
        for (a, acc) in acc.iter_mut().enumerate() {
            for (l, x) in acc.iter_mut().enumerate() {
                let at = i + a * LANES + l;
                *x = key[at].get().mul_add(q[at], *x);
            }
        }
    }
    let folded: [f32; LANES] =
        std::array::from_fn(|l| (acc[0][l] + acc[1][l]) + (acc[2][l] + acc[3][l]));
    let mut sum = crate::kernels::hsum8(&folded);
    for at in whole..q.len() {
        sum = key[at].get().mul_add(q[at], sum);
    }
    sum
}

/// `out += w · value`, one fused multiply-add per element.
fn axpy_scalar<T: KvElem>(w: f32, value: &[T], out: &mut [f32]) {
    for (o, v) in out.iter_mut().zip(value) {
        *o = v.get().mul_add(w, *o);
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::any::TypeId;
    use std::arch::x86_64::*;

    use half::f16;

    use super::{KvElem, Ops, LANES, STEP};

    /// The AVX2 operations for f16 rows (the serving cache); `None` for other element types.
    pub(super) fn ops<T: KvElem + 'static>() -> Option<Ops<T>> {
        if TypeId::of::<T>() != TypeId::of::<f16>() {
            return None;
        }
        // SAFETY: `T` is `f16` (checked above), so the function pointers' types are equal.
        Some(unsafe {
            Ops {
                dot: std::mem::transmute::<fn(&[f16], &[f32]) -> f32, fn(&[T], &[f32]) -> f32>(dot),
                axpy: std::mem::transmute::<fn(f32, &[f16], &mut [f32]), fn(f32, &[T], &mut [f32])>(
                    axpy,
                ),
            }
        })
    }

    #[inline(always)]
    unsafe fn load8(p: *const f16) -> __m256 {
        // SAFETY: the caller guarantees eight readable values.
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)) }
    }

    fn dot(key: &[f16], q: &[f32]) -> f32 {
        assert!(key.len() >= q.len());
        // SAFETY: `Isa::detect` named AVX2 (with FMA and F16C) before these ops were chosen.
        unsafe { dot_avx2(key, q) }
    }

    fn axpy(w: f32, value: &[f16], out: &mut [f32]) {
        assert!(value.len() >= out.len());
        // SAFETY: as for `dot`.
        unsafe { axpy_avx2(w, value, out) }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot_avx2(key: &[f16], q: &[f32]) -> f32 {
        let whole = q.len() / STEP * STEP;
        let mut acc = [_mm256_setzero_ps(); 4];
        let (kp, qp) = (key.as_ptr(), q.as_ptr());
        for i in (0..whole).step_by(STEP) {
            for (a, x) in acc.iter_mut().enumerate() {
                let at = i + a * LANES;
                // SAFETY: `at + 8 <= whole <= len` for both slices.
                unsafe { *x = _mm256_fmadd_ps(load8(kp.add(at)), _mm256_loadu_ps(qp.add(at)), *x) };
            }
        }
        let folded = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
        let mut lanes = [0f32; LANES];
        // SAFETY: eight floats.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), folded) };
        let mut sum = crate::kernels::hsum8(&lanes);
        for at in whole..q.len() {
            sum = key[at].to_f32().mul_add(q[at], sum);
        }
        sum
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn axpy_avx2(w: f32, value: &[f16], out: &mut [f32]) {
        let d = out.len();
        let wv = _mm256_set1_ps(w);
        let mut i = 0;
        while i + 8 <= d {
            // SAFETY: eight values of `out` and `value` from `i`.
            unsafe {
                let o = _mm256_loadu_ps(out.as_ptr().add(i));
                let v = load8(value.as_ptr().add(i));
                _mm256_storeu_ps(out.as_mut_ptr().add(i), _mm256_fmadd_ps(v, wv, o));
            }
            i += 8;
        }
        super::axpy_scalar(w, &value[i..], &mut out[i..]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// xorshift, uniform in [-scale, scale).
    fn random(seed: &mut u64, n: usize, scale: f32) -> Vec<f32> {
        (0..n)
            .map(|_| {
                *seed ^= *seed << 13;
                *seed ^= *seed >> 7;
                *seed ^= *seed << 17;
                ((*seed >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) as f32 * scale
            })
            .collect()
    }

    fn half(x: &[f32]) -> Vec<f16> {
        x.iter().map(|&v| f16::from_f32(v)).collect()
    }

    /// Runs `attend_group` over rows split into chunks of `chunk` positions.
    #[allow(clippy::too_many_arguments)]
    fn run(
        isa: Isa,
        q: &[f32],
        keys: &[f16],
        values: &[f16],
        chunk: usize,
        range: (usize, usize),
        head: HeadColumns,
        out: &mut [f32],
    ) {
        let rows = chunk * head.stride;
        let chunks: Vec<(&[f16], &[f16])> = keys.chunks(rows).zip(values.chunks(rows)).collect();
        let view = KvView::chunked(chunks, chunk);
        attend_group(isa, q, 0.7, &view, range, head, out, &mut Vec::new());
    }

    #[test]
    fn simd_equals_scalar_and_chunking_changes_nothing() {
        let mut seed = 0x1234_5678_9abc_def1u64;
        // Head sizes with and without a tail past the 32-value steps; strides wider than a head
        // (several kv heads, reading the second); groups of 1 to 4 heads; windows.
        for (d, kv_heads, heads, n, lo) in [
            (256, 1, 4, 1, 0),
            (256, 2, 4, 37, 3),
            (64, 1, 2, 300, 0),
            (80, 2, 1, 19, 7),
            (8, 1, 4, 5, 0),
        ] {
            let head = HeadColumns {
                col: (kv_heads - 1) * d,
                d,
                stride: kv_heads * d,
            };
            let stride = head.stride;
            let q = random(&mut seed, heads * d, 3.0);
            let keys = half(&random(&mut seed, n * stride, 3.0));
            let values = half(&random(&mut seed, n * stride, 2.0));
            let mut reference = vec![0f32; heads * d];
            run(
                Isa::Scalar,
                &q,
                &keys,
                &values,
                n,
                (lo, n),
                head,
                &mut reference,
            );
            for isa in Isa::available() {
                for chunk in [1, 16, n] {
                    let mut out = vec![1f32; heads * d];
                    run(isa, &q, &keys, &values, chunk, (lo, n), head, &mut out);
                    let same = out
                        .iter()
                        .zip(&reference)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "{isa:?} d={d} n={n} chunk={chunk}");
                }
            }
        }
    }

    #[test]
    fn matches_an_exact_softmax_closely() {
        let mut seed = 42u64;
        let (d, n) = (128, 50);
        let q = random(&mut seed, d, 0.5);
        let keys = half(&random(&mut seed, n * d, 1.0));
        let values = half(&random(&mut seed, n * d, 1.0));
        let mut out = vec![0f32; d];
        let head = HeadColumns {
            col: 0,
            d,
            stride: d,
        };
        run(
            Isa::detect(),
            &q,
            &keys,
            &values,
            16,
            (0, n),
            head,
            &mut out,
        );
        let scores: Vec<f64> = (0..n)
            .map(|j| {
                (0..d)
                    .map(|i| q[i] as f64 * keys[j * d + i].to_f64())
                    .sum::<f64>()
                    * 0.7
            })
            .collect();
        let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let w: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
        let total: f64 = w.iter().sum();
        for i in 0..d {
            let exact: f64 = (0..n)
                .map(|j| w[j] * values[j * d + i].to_f64())
                .sum::<f64>()
                / total;
            assert!(
                (out[i] as f64 - exact).abs() < 1e-5,
                "{i}: {} vs {exact}",
                out[i]
            );
        }
    }
}
