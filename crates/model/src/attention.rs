//! Attention of one query row over a sequence's f16 keys and values, computed as llama.cpp's CPU
//! flash attention computes it (ggml's `flash_attn_ext_f16_one_chunk` on an AVX-512 build
//! without AVX512-FP16), so that our logits match the reference build bit for bit:
//!
//! - the query, multiplied by the attention scale, is rounded to f16;
//! - a score is `ggml_vec_dot_f16`: four accumulators of sixteen f32 lanes, one fused
//!   multiply-add per value over whole steps of 64 values, folded `a0+a2`, `a1+a3`, then
//!   `a0+a1`, then the sixteen lanes as GCC's `_mm512_reduce_add_ps` (halves, quarters, then
//!   `(l0+l2)+(l1+l3)`); values past the last whole step are added in f64;
//! - online softmax over the keys in order: a new maximum rescales the output accumulator by
//!   `exp(old max - new max)`, otherwise the value is weighted by `exp(score - max)`; the
//!   accumulator is kept in f16 (every update rounds), the running sum in f32
//!   (`sum = fma(sum, rescale, weight)`);
//! - the output is the accumulator times `1 / sum`;
//! - a decode step whose KV view reaches 512 cells takes ggml's split-KV path: the keys split
//!   between its two threads, each part's online softmax as above, the two combined as
//!   `ggml_flash_attn_ext_reduce_partials` does (`attend_row`'s `split`).
//!
//! The scalar reference and the SIMD paths compute the same bits (tested on random data).

use half::f16;

use crate::kernels::Isa;
use crate::ops;

/// Values per step of the dot product (four registers of sixteen lanes).
const STEP: usize = 64;
const LANES: usize = 16;

/// One query against `n` key/value rows: row `j`'s key is `keys[j * stride..][..d]`, its value
/// `values[j * stride..][..d]`. Writes the `d` outputs to `out`.
pub(crate) struct Rows<'a> {
    pub(crate) keys: &'a [f16],
    pub(crate) values: &'a [f16],
    pub(crate) stride: usize,
    pub(crate) n: usize,
}

/// `out = softmax((scale·q) · Kᵀ) · V` for one query row `q`, llama.cpp's arithmetic (it
/// scales Q, then rounds it to f16).
/// `split`: the row where ggml divides the keys between its two threads for a decode step with
/// a long cache (`flash_attn_ext`'s split-KV path): each part's online softmax separately, then
/// the two combined in order.
pub(crate) fn attend_row(
    isa: Isa,
    q: &[f32],
    scale: f32,
    rows: &Rows<'_>,
    split: Option<usize>,
    out: &mut [f32],
) {
    let d = q.len();
    assert!(out.len() == d && rows.n > 0);
    assert!(rows.keys.len() >= (rows.n - 1) * rows.stride + d);
    assert!(rows.values.len() >= (rows.n - 1) * rows.stride + d);
    let q: Vec<f32> = q.iter().map(|&x| round_f16(x * scale)).collect();
    let Some(split) = split.filter(|&s| s > 0 && s < rows.n) else {
        let (_, sum) = partial(isa, &q, rows, out);
        let inv = if sum == 0.0 { 0.0 } else { 1.0 / sum };
        for o in out.iter_mut() {
            *o *= inv;
        }
        return;
    };
    // ggml_flash_attn_ext_reduce_partials, with the FMAs GCC makes of its two products.
    let (mut max, mut sum) = (f32::NEG_INFINITY, 0f32);
    out.fill(0.0);
    let mut acc = vec![0f32; d];
    for part in [0..split, split..rows.n] {
        let sub = Rows {
            keys: &rows.keys[part.start * rows.stride..],
            values: &rows.values[part.start * rows.stride..],
            stride: rows.stride,
            n: part.len(),
        };
        let (m, s) = partial(isa, &q, &sub, &mut acc);
        if s == 0.0 {
            continue;
        }
        let new_max = max.max(m);
        let (scale_old, scale_new) = ((max - new_max).exp(), (m - new_max).exp());
        for (o, a) in out.iter_mut().zip(&acc) {
            *o = o.mul_add(scale_old, a * scale_new);
        }
        sum = sum.mul_add(scale_old, s * scale_new);
        max = new_max;
    }
    if sum != 0.0 {
        let inv = 1.0 / sum;
        for o in out.iter_mut() {
            *o *= inv;
        }
    }
}

/// One part's online softmax with `isa`'s instructions (see `partial_scalar`).
fn partial(isa: Isa, q: &[f32], rows: &Rows<'_>, acc: &mut [f32]) -> (f32, f32) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Isa::Avx512` is only detected on CPUs with AVX-512 F and F16C; the slices
        // were checked by `attend_row`.
        Isa::Avx512 => unsafe { x86::partial_avx512(q, rows, acc) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above, for AVX2, FMA and F16C.
        Isa::Avx2 => unsafe { x86::partial_avx2(q, rows, acc) },
        _ => online_softmax(q, rows, acc, dot_scalar, update_scalar),
    }
}

/// The same attention without llama.cpp's f16 roundings (f32 keys, values and sums, plain
/// softmax): a smooth function, for gradient checks.
pub(crate) fn attend_row_f32(
    q: &[f32],
    scale: f32,
    keys: &[f32],
    values: &[f32],
    stride: usize,
    n: usize,
    out: &mut [f32],
) {
    let d = q.len();
    let mut scores: Vec<f32> = (0..n)
        .map(|j| ops::dot(q, &keys[j * stride..][..d]) * scale)
        .collect();
    ops::softmax(&mut scores);
    out.fill(0.0);
    for (j, &p) in scores.iter().enumerate() {
        ops::axpy(p, &values[j * stride..][..d], out);
    }
}

fn round_f16(x: f32) -> f32 {
    f16::from_f32(x).to_f32()
}

/// The sixteen lanes folded as GCC's `_mm512_reduce_add_ps`.
fn reduce_lanes(a: &[f32; LANES]) -> f32 {
    let h: [f32; 8] = std::array::from_fn(|i| a[i + 8] + a[i]);
    let q: [f32; 4] = std::array::from_fn(|i| h[i + 4] + h[i]);
    (q[0] + q[2]) + (q[1] + q[3])
}

/// `ggml_vec_dot_f16(key, query)` with the query already in f32 (rounded to f16 values).
fn dot_scalar(key: &[f16], q: &[f32]) -> f32 {
    let whole = q.len() / STEP * STEP;
    let mut acc = [[0f32; LANES]; 4];
    for i in (0..whole).step_by(STEP) {
        for (r, acc) in acc.iter_mut().enumerate() {
            for (l, a) in acc.iter_mut().enumerate() {
                let at = i + r * LANES + l;
                *a = key[at].to_f32().mul_add(q[at], *a);
            }
        }
    }
    let folded: [f32; LANES] =
        std::array::from_fn(|l| (acc[0][l] + acc[2][l]) + (acc[1][l] + acc[3][l]));
    let mut sum = reduce_lanes(&folded) as f64;
    for at in whole..q.len() {
        sum += (key[at].to_f32() * q[at]) as f64;
    }
    sum as f32
}

/// The online-softmax bookkeeping shared by every path: returns `(rescale, weight)` for a key
/// with `score`, updating the running maximum and sum.
#[inline(always)]
fn online_step(score: f32, max: &mut f32, sum: &mut f32) -> (f32, f32) {
    let (rescale, weight) = if score > *max {
        let old = *max;
        *max = score;
        ((old - score).exp(), 1.0)
    } else {
        (1.0, (score - *max).exp())
    };
    *sum = sum.mul_add(rescale, weight);
    (rescale, weight)
}

/// The online softmax over `rows` for the (f16-valued) query `q` with a path's dot product and
/// accumulator update: leaves the unnormalised output in `acc` and returns the maximum and the
/// sum. Inlined into each path, so its kernels inline too.
#[inline(always)]
fn online_softmax(
    q: &[f32],
    rows: &Rows<'_>,
    acc: &mut [f32],
    dot: impl Fn(&[f16], &[f32]) -> f32,
    update: impl Fn(&mut [f32], &[f16], f32, f32),
) -> (f32, f32) {
    let d = q.len();
    let (mut max, mut sum) = (f32::NEG_INFINITY, 0f32);
    acc.fill(0.0);
    for j in 0..rows.n {
        let key = &rows.keys[j * rows.stride..][..d];
        let value = &rows.values[j * rows.stride..][..d];
        let (rescale, weight) = online_step(dot(key, q), &mut max, &mut sum);
        update(acc, value, rescale, weight);
    }
    (max, sum)
}

/// `acc = round_f16(fma(v, weight, round_f16(acc * rescale)))` element-wise (ggml's
/// `ggml_vec_scale_f16` on a new maximum, then `ggml_vec_mad_f16`).
fn update_scalar(acc: &mut [f32], value: &[f16], rescale: f32, weight: f32) {
    for (o, v) in acc.iter_mut().zip(value) {
        if rescale != 1.0 {
            *o = round_f16(*o * rescale);
        }
        *o = round_f16(v.to_f32().mul_add(weight, *o));
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use half::f16;

    use super::{online_softmax, reduce_lanes, Rows, LANES, STEP};

    /// Rounds eight f32 to f16 and back (round to nearest even, as F16C does for ggml).
    #[inline(always)]
    unsafe fn round8(x: __m256) -> __m256 {
        _mm256_cvtph_ps(_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(x))
    }

    #[inline(always)]
    unsafe fn load8_f16(p: *const f16) -> __m256 {
        // SAFETY: the caller guarantees eight readable values.
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)) }
    }

    /// The scalar tail of every SIMD path (values past the last whole register).
    fn dot_tail(key: &[f16], q: &[f32], from: usize) -> f64 {
        (from..q.len())
            .map(|at| (key[at].to_f32() * q[at]) as f64)
            .sum()
    }

    /// `out = round_f16(fma(v, weight, round_f16(out * rescale)))` element-wise; eight at a
    /// time, then scalar.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn update_avx2(out: &mut [f32], value: &[f16], rescale: f32, weight: f32) {
        let d = out.len();
        let (r, w) = (_mm256_set1_ps(rescale), _mm256_set1_ps(weight));
        let mut i = 0;
        while i + 8 <= d {
            // SAFETY: eight values of `out` and `value` from `i`.
            unsafe {
                let mut o = _mm256_loadu_ps(out.as_ptr().add(i));
                if rescale != 1.0 {
                    o = round8(_mm256_mul_ps(o, r));
                }
                let v = load8_f16(value.as_ptr().add(i));
                o = round8(_mm256_fmadd_ps(v, w, o));
                _mm256_storeu_ps(out.as_mut_ptr().add(i), o);
            }
            i += 8;
        }
        super::update_scalar(&mut out[i..], &value[i..], rescale, weight);
    }

    /// Each sixteen-lane accumulator as two eight-lane registers (low lanes, high lanes).
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot_avx2(key: &[f16], q: &[f32]) -> f32 {
        let whole = q.len() / STEP * STEP;
        let mut acc = [[_mm256_setzero_ps(); 2]; 4];
        let (kp, qp) = (key.as_ptr(), q.as_ptr());
        for i in (0..whole).step_by(STEP) {
            for (r, acc) in acc.iter_mut().enumerate() {
                for (h, a) in acc.iter_mut().enumerate() {
                    let at = i + r * LANES + 8 * h;
                    // SAFETY: `at + 8 <= whole <= len` for both slices.
                    unsafe {
                        *a =
                            _mm256_fmadd_ps(load8_f16(kp.add(at)), _mm256_loadu_ps(qp.add(at)), *a);
                    }
                }
            }
        }
        let mut lanes = [0f32; LANES];
        for (h, half) in lanes.chunks_exact_mut(8).enumerate() {
            let a02 = _mm256_add_ps(acc[0][h], acc[2][h]);
            let a13 = _mm256_add_ps(acc[1][h], acc[3][h]);
            // SAFETY: eight floats.
            unsafe { _mm256_storeu_ps(half.as_mut_ptr(), _mm256_add_ps(a02, a13)) };
        }
        (reduce_lanes(&lanes) as f64 + dot_tail(key, q, whole)) as f32
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn partial_avx2(q: &[f32], rows: &Rows<'_>, acc: &mut [f32]) -> (f32, f32) {
        // SAFETY (both closures): this function's features; the slices are `d` long.
        online_softmax(
            q,
            rows,
            acc,
            |k, q| unsafe { dot_avx2(k, q) },
            |o, v, r, w| unsafe { update_avx2(o, v, r, w) },
        )
    }

    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    unsafe fn dot_avx512(key: &[f16], q: &[f32]) -> f32 {
        let whole = q.len() / STEP * STEP;
        let mut acc = [_mm512_setzero_ps(); 4];
        let (kp, qp) = (key.as_ptr(), q.as_ptr());
        for i in (0..whole).step_by(STEP) {
            for (r, a) in acc.iter_mut().enumerate() {
                let at = i + r * LANES;
                // SAFETY: `at + 16 <= whole <= len` for both slices.
                unsafe {
                    let k = _mm512_cvtph_ps(_mm256_loadu_si256(kp.add(at) as *const __m256i));
                    *a = _mm512_fmadd_ps(k, _mm512_loadu_ps(qp.add(at)), *a);
                }
            }
        }
        let folded = _mm512_add_ps(_mm512_add_ps(acc[0], acc[2]), _mm512_add_ps(acc[1], acc[3]));
        let mut lanes = [0f32; LANES];
        // SAFETY: sixteen floats.
        unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), folded) };
        (reduce_lanes(&lanes) as f64 + dot_tail(key, q, whole)) as f32
    }

    /// `update_avx2` sixteen at a time.
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    unsafe fn update_avx512(out: &mut [f32], value: &[f16], rescale: f32, weight: f32) {
        let d = out.len();
        let (r, w) = (_mm512_set1_ps(rescale), _mm512_set1_ps(weight));
        let round16 = |x: __m512| _mm512_cvtph_ps(_mm512_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(x));
        let mut i = 0;
        while i + 16 <= d {
            // SAFETY: sixteen values of `out` and `value` from `i`.
            unsafe {
                let mut o = _mm512_loadu_ps(out.as_ptr().add(i));
                if rescale != 1.0 {
                    o = round16(_mm512_mul_ps(o, r));
                }
                let v =
                    _mm512_cvtph_ps(_mm256_loadu_si256(value.as_ptr().add(i) as *const __m256i));
                o = round16(_mm512_fmadd_ps(v, w, o));
                _mm512_storeu_ps(out.as_mut_ptr().add(i), o);
            }
            i += 16;
        }
        // SAFETY: this function's features include AVX2's.
        unsafe { update_avx2(&mut out[i..], &value[i..], rescale, weight) };
    }

    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    pub(super) unsafe fn partial_avx512(q: &[f32], rows: &Rows<'_>, acc: &mut [f32]) -> (f32, f32) {
        // SAFETY (both closures): this function's features; the slices are `d` long.
        online_softmax(
            q,
            rows,
            acc,
            |k, q| unsafe { dot_avx512(k, q) },
            |o, v, r, w| unsafe { update_avx512(o, v, r, w) },
        )
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

    fn isas() -> Vec<Isa> {
        match Isa::detect() {
            Isa::Avx512 => vec![Isa::Avx2, Isa::Avx512],
            Isa::Avx2 => vec![Isa::Avx2],
            Isa::Scalar => vec![],
        }
    }

    #[test]
    fn simd_paths_equal_scalar_reference_bit_for_bit() {
        let mut seed = 0x1234_5678_9abc_def1u64;
        // Head sizes with and without a tail past the 64-value steps; strides wider than a head
        // (several kv heads); up to a few hundred keys, scores large enough to move the maximum.
        for (d, stride, n, qscale) in [
            (256, 256, 1, 1.0),
            (256, 512, 37, 4.0),
            (64, 64, 300, 8.0),
            (80, 96, 19, 2.0),
            (8, 8, 5, 1.0),
        ] {
            let q = random(&mut seed, d, qscale);
            let keys: Vec<f16> = random(&mut seed, (n - 1) * stride + d, 3.0)
                .into_iter()
                .map(f16::from_f32)
                .collect();
            let values: Vec<f16> = random(&mut seed, (n - 1) * stride + d, 2.0)
                .into_iter()
                .map(f16::from_f32)
                .collect();
            let rows = Rows {
                keys: &keys,
                values: &values,
                stride,
                n,
            };
            for split in [None, Some(n / 2)] {
                let mut reference = vec![0f32; d];
                attend_row(Isa::Scalar, &q, 1.0, &rows, split, &mut reference);
                for isa in isas() {
                    let mut out = vec![1f32; d];
                    attend_row(isa, &q, 1.0, &rows, split, &mut out);
                    let same = out
                        .iter()
                        .zip(&reference)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(
                        same,
                        "{isa:?} d={d} n={n} {split:?}: {out:?} vs {reference:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn matches_an_exact_softmax_closely() {
        // The f16 roundings cost about three decimal digits, never more.
        let mut seed = 42u64;
        let (d, n) = (128, 50);
        let q = random(&mut seed, d, 0.5);
        let kf = random(&mut seed, n * d, 1.0);
        let vf = random(&mut seed, n * d, 1.0);
        let keys: Vec<f16> = kf.iter().map(|&x| f16::from_f32(x)).collect();
        let values: Vec<f16> = vf.iter().map(|&x| f16::from_f32(x)).collect();
        let rows = Rows {
            keys: &keys,
            values: &values,
            stride: d,
            n,
        };
        let mut out = vec![0f32; d];
        attend_row(Isa::detect(), &q, 1.0, &rows, None, &mut out);
        let mut split = vec![0f32; d];
        attend_row(Isa::detect(), &q, 1.0, &rows, Some(n / 3), &mut split);
        let scores: Vec<f64> = (0..n)
            .map(|j| (0..d).map(|i| q[i] as f64 * kf[j * d + i] as f64).sum())
            .collect();
        let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let w: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
        let total: f64 = w.iter().sum();
        for i in 0..d {
            let exact: f64 = (0..n).map(|j| w[j] * vf[j * d + i] as f64).sum::<f64>() / total;
            for got in [out[i], split[i]] {
                assert!((got as f64 - exact).abs() < 2e-3, "{i}: {got} vs {exact}");
            }
        }
    }
}
