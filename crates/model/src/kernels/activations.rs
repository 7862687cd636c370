//! Activation rows quantized as ggml does on x86: `quantize_row_q8_0` (AVX2 path: scale
//! `127 / amax`, round to nearest with ties to even, f16 block scale) and `quantize_row_q8_K_ref`
//! (scale `-127 / max`, `nearest_int`, f32 block scale, sums of 16).

use half::f16;

use super::Isa;

/// A Q8_0 activation block: 32 values, scale already rounded through f16 as ggml stores it.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
#[repr(C)]
pub(crate) struct Q8_0Block {
    pub(crate) d: f32,
    pub(crate) qs: [i8; 32],
    /// The AVX-512 Q8_0 kernel's VNNI starting value for the block, `VNNI_BIAS - 128 Σ qs`. It
    /// takes out the +128 that makes the weights unsigned; see `VNNI_BIAS` for the rest.
    pub(crate) vnni_init: i32,
}

/// The bits of the f32 `1.5 · 2^23`: an i32 `s` with `|s| < 2^22` added to them are the bits of
/// the f32 `1.5 · 2^23 + s`, exactly, so `s as f32` is one float subtraction away (a block's
/// sum is at most `32 · 128 · 127 < 2^19`).
pub(crate) const VNNI_BIAS: i32 = 0x4B40_0000;

/// A Q8_K activation block: 256 values, f32 scale, the sum of every 16 values.
#[derive(Clone, Copy, Debug, PartialEq)]
#[repr(C)]
pub(crate) struct Q8KBlock {
    pub(crate) d: f32,
    pub(crate) qs: [i8; 256],
    pub(crate) bsums: [i16; 16],
    /// The sum of every 32 values, `bsums[2j] + bsums[2j + 1]` in i16 (ggml's `q8s`, made with
    /// `_mm_hadd_epi16`), for Q4_K's mins.
    pub(crate) sums32: [i16; 8],
}

impl Default for Q8KBlock {
    fn default() -> Self {
        Self {
            d: 0.0,
            qs: [0; 256],
            bsums: [0; 16],
            sums32: [0; 8],
        }
    }
}

pub(crate) fn quantize_q8_0(isa: Isa, x: &[f32], out: &mut [Q8_0Block]) {
    quantize_q8_0_scaled::<1, true>(isa, x, out);
}

/// A gradient's rows as the input-gradient products multiply them (`dx = dy · W` on the
/// transposed weight, see `Linear::backward_input`): Q8_0 blocks with every quad bounded,
/// `|q[8k + j]| + |q[8k + j + 1]| + |q[8k + j + 4]| + |q[8k + j + 5]| <= 128` (`j` 0 or 2), the
/// quants that AVX2's `maddubs` multiplies into the same i16 lanes in two consecutive steps of
/// four: against unsigned weight bytes (`w + 128`, at most 255) two steps' products add in i16
/// before one `madd` (`255 · 128 < 2^15`), three multiplies per 64 products where pair-bound
/// activations take four (see `q8_0::WithGradActs`). Each block's scale is kept in f32, not
/// rounded through f16: a gradient's blocks span many orders of magnitude within a row (the
/// LM head's softmax) and across rows (a loss averaged over many tokens reaches 1e-11), which
/// f16 scales (normal from 6.1e-5, at most 65,504) would flush or overflow. The kernels take a
/// block's scale as an f32 either way.
pub(crate) fn quantize_gradient(isa: Isa, x: &[f32], out: &mut [Q8_0Block]) {
    quantize_q8_0_scaled::<4, false>(isa, x, out);
}

/// Q8_0 activations with every pair of neighbours bounded: `|q[2i]| + |q[2i + 1]| <= 128`.
///
/// The block's scale comes from its largest pair, `max (|x[2i]| + |x[2i + 1]|) / 127`, instead
/// of its largest value (each pair's scaled magnitudes sum to at most 127; rounding adds at most
/// one). Against unsigned weight bytes (`w + 128`, at most 255) AVX2's `maddubs` then sums
/// each pair of products exactly in i16 (`255 · 128 < 2^15`): one instruction where full 8-bit
/// activations need ggml's sign trick or 16-bit weights (see `q8_0::Q8_0PairBound`). It costs
/// the quants less than a bit: on the default model's LM head the logits' rms error against f32
/// activations went from 0.040 to 0.046 (8-bit: 0.040; 7-bit, `max |x| / 63`: 0.079).
pub(crate) fn quantize_q8_0_pair_bound(isa: Isa, x: &[f32], out: &mut [Q8_0Block]) {
    quantize_q8_0_scaled::<2, true>(isa, x, out);
}

/// The largest magnitude a block's scale maps to: that of its values (`BOUND` 1), pairs (2,
/// [`quantize_q8_0_pair_bound`]) or quads (4, [`quantize_gradient`]); 127, less one for the
/// quads (their four roundings add at most two), so a bounded group's quants stay within 128.
const fn scaled_max(bound: usize) -> f32 {
    if bound == 4 {
        126.0
    } else {
        127.0
    }
}

/// [`quantize_q8_0`] (`BOUND` 1, f16 scale), [`quantize_q8_0_pair_bound`] (2, f16 scale) or
/// [`quantize_gradient`] (4, f32 scale).
fn quantize_q8_0_scaled<const BOUND: usize, const F16_SCALE: bool>(
    isa: Isa,
    x: &[f32],
    out: &mut [Q8_0Block],
) {
    match isa {
        Isa::Scalar => quantize_q8_0_scalar::<BOUND, F16_SCALE>(x, out),
        // SAFETY: x86 levels are only named when the CPU has AVX2 (and F16C).
        #[cfg(target_arch = "x86_64")]
        _ => unsafe { x86::quantize_q8_0::<BOUND, F16_SCALE>(x, out) },
        #[cfg(not(target_arch = "x86_64"))]
        _ => quantize_q8_0_scalar::<BOUND, F16_SCALE>(x, out),
    }
}

/// The largest magnitude of `xb`'s bounded groups (see [`scaled_max`]), each summed as the
/// SIMD path sums it: pairs first, then a quad's two pairs.
fn bounded_max<const BOUND: usize>(xb: &[f32]) -> f32 {
    let pair = |i: usize| xb[i].abs() + xb[i + 1].abs();
    (0..xb.len())
        .filter(|i| match BOUND {
            1 => true,
            2 => i % 2 == 0,
            // A quad's first pair starts at 0 or 2 in each run of eight.
            _ => i % 8 == 0 || i % 8 == 2,
        })
        .map(|i| match BOUND {
            1 => xb[i].abs(),
            2 => pair(i),
            _ => pair(i) + pair(i + 4),
        })
        .fold(0f32, f32::max)
}

fn quantize_q8_0_scalar<const BOUND: usize, const F16_SCALE: bool>(
    x: &[f32],
    out: &mut [Q8_0Block],
) {
    let top = scaled_max(BOUND);
    for (xb, o) in x.chunks_exact(32).zip(out.iter_mut()) {
        let amax = bounded_max::<BOUND>(xb);
        let id = if amax != 0.0 { top / amax } else { 0.0 };
        o.d = if F16_SCALE {
            f16::from_f32(amax / top).to_f32()
        } else {
            amax / top
        };
        for (q, &v) in o.qs.iter_mut().zip(xb) {
            // Saturating like `_mm256_packs_epi32`; in range anyway (|v * id| <= 127).
            *q = (v * id).round_ties_even() as i8;
        }
        o.vnni_init = VNNI_BIAS - 128 * o.qs.iter().map(|&q| q as i32).sum::<i32>();
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{scaled_max, Q8_0Block, VNNI_BIAS};

    /// ggml's AVX2 `quantize_row_q8_0`, plus the VNNI starting values; with `BOUND` 2 or 4,
    /// the scale from the largest pair or quad (see `scaled_max`); without `F16_SCALE`, the
    /// scale kept in f32 (see `quantize_gradient`).
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn quantize_q8_0<const BOUND: usize, const F16_SCALE: bool>(
        x: &[f32],
        out: &mut [Q8_0Block],
    ) {
        let sign = _mm256_set1_ps(-0.0);
        let top = scaled_max(BOUND);
        // |v|; or each lane's |v| plus its pair neighbour's (the same sum in both lanes); or
        // that pair's sum plus the pair's four lanes on (a quad: both halves of eight values).
        let magnitude = |v: __m256| {
            let a = _mm256_andnot_ps(sign, v);
            if BOUND == 1 {
                return a;
            }
            let pairs = _mm256_add_ps(a, _mm256_permute_ps::<0b10_11_00_01>(a));
            if BOUND == 2 {
                return pairs;
            }
            _mm256_add_ps(pairs, _mm256_permute2f128_ps::<1>(pairs, pairs))
        };
        for (xb, o) in x.chunks_exact(32).zip(out.iter_mut()) {
            // SAFETY: `xb` is 32 floats.
            let v: [__m256; 4] =
                std::array::from_fn(|i| unsafe { _mm256_loadu_ps(xb.as_ptr().add(8 * i)) });
            let mut max = magnitude(v[0]);
            for v in &v[1..] {
                max = _mm256_max_ps(max, magnitude(*v));
            }
            let max4 = _mm_max_ps(_mm256_extractf128_ps::<1>(max), _mm256_castps256_ps128(max));
            let max4 = _mm_max_ps(max4, _mm_movehl_ps(max4, max4));
            let max1 = _mm_max_ss(max4, _mm_movehdup_ps(max4));
            let amax = _mm_cvtss_f32(max1);
            o.d = if F16_SCALE {
                // f32 -> f16 -> f32 with round to nearest even, as ggml's F16C conversion.
                let d16 = _mm_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm_set_ss(amax / top));
                _mm_cvtss_f32(_mm_cvtph_ps(d16))
            } else {
                amax / top
            };
            let mul = _mm256_set1_ps(if amax != 0.0 { top / amax } else { 0.0 });
            let i: [__m256i; 4] = std::array::from_fn(|k| {
                _mm256_cvtps_epi32(_mm256_round_ps::<
                    { _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC },
                >(_mm256_mul_ps(v[k], mul)))
            });
            // The block's sum (saturation aside, the quants are these integers: |v| <= 127).
            let sums = _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3]));
            let sums = _mm_add_epi32(
                _mm256_extracti128_si256::<1>(sums),
                _mm256_castsi256_si128(sums),
            );
            let sums = _mm_add_epi32(sums, _mm_unpackhi_epi64(sums, sums));
            let sum = _mm_cvtsi128_si32(_mm_add_epi32(sums, _mm_srli_si128::<4>(sums)));
            o.vnni_init = VNNI_BIAS - 128 * sum;
            let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
            let packed = _mm256_packs_epi16(
                _mm256_packs_epi32(i[0], i[1]),
                _mm256_packs_epi32(i[2], i[3]),
            );
            let ordered = _mm256_permutevar8x32_epi32(packed, order);
            // SAFETY: `qs` is 32 bytes.
            unsafe { _mm256_storeu_si256(o.qs.as_mut_ptr() as *mut __m256i, ordered) };
        }
    }
}

/// ggml's `nearest_int`: round to nearest, ties to even, through the float mantissa.
fn nearest_int(v: f32) -> i32 {
    let biased = v + 12_582_912.0;
    (biased.to_bits() & 0x007f_ffff) as i32 - 0x0040_0000
}

/// The first value of the largest magnitude, as ggml's scan (`|v| > amax` keeps the earlier of
/// equal magnitudes; NaN never wins), and that magnitude. Each of sixteen lanes keeps its own
/// largest magnitude first: a scan that updates one running maximum does not vectorize.
fn first_of_largest_magnitude(x: &[f32]) -> (f32, f32) {
    let mut lanes = [0f32; 16];
    for chunk in x.chunks_exact(16) {
        for (lane, v) in lanes.iter_mut().zip(chunk) {
            let a = v.abs();
            if a > *lane {
                *lane = a;
            }
        }
    }
    let amax = lanes.iter().fold(0f32, |m, &a| if a > m { a } else { m });
    let max = x.iter().copied().find(|v| v.abs() == amax).unwrap_or(0.0);
    (amax, max)
}

pub(crate) fn quantize_q8_k(x: &[f32], out: &mut [Q8KBlock]) {
    for (xb, o) in x.chunks_exact(256).zip(out.iter_mut()) {
        let (amax, max) = first_of_largest_magnitude(xb);
        if amax == 0.0 {
            *o = Q8KBlock::default();
            continue;
        }
        let iscale = -127.0 / max;
        for (q, &v) in o.qs.iter_mut().zip(xb) {
            *q = nearest_int(iscale * v).min(127) as i8;
        }
        for (s, q) in o.bsums.iter_mut().zip(o.qs.chunks_exact(16)) {
            *s = q.iter().map(|&v| v as i16).sum();
        }
        for (s, b) in o.sums32.iter_mut().zip(o.bsums.chunks_exact(2)) {
            *s = b[0].wrapping_add(b[1]);
        }
        o.d = 1.0 / iscale;
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_util::Rng;
    use super::*;

    #[test]
    fn largest_magnitude_is_the_first_as_a_running_scan_finds_it() {
        let mut rng = Rng::new(5);
        for case in 0..200 {
            // Few distinct magnitudes, both signs: ties are the rule, not the exception.
            let x: Vec<f32> = (0..256)
                .map(|_| {
                    let v = (rng.uniform() * 2.5).round();
                    if case % 7 == 0 {
                        0.0
                    } else {
                        v
                    }
                })
                .collect();
            let (mut amax, mut max) = (0f32, 0f32);
            for &v in &x {
                if v.abs() > amax {
                    amax = v.abs();
                    max = v;
                }
            }
            let got = first_of_largest_magnitude(&x);
            assert_eq!(
                (got.0.to_bits(), got.1.to_bits()),
                (amax.to_bits(), max.to_bits())
            );
        }
    }

    #[test]
    fn nearest_int_rounds_ties_to_even() {
        assert_eq!(nearest_int(2.5), 2);
        assert_eq!(nearest_int(3.5), 4);
        assert_eq!(nearest_int(-2.5), -2);
        assert_eq!(nearest_int(-126.6), -127);
        assert_eq!(nearest_int(0.49), 0);
    }

    #[test]
    fn q8_0_block_scale_and_ties() {
        // amax 127 → scale 1, values pass through with ties to even.
        let mut x = [0f32; 32];
        x[0] = 127.0;
        x[1] = 2.5;
        x[2] = -3.5;
        x[3] = 0.5;
        let mut out = [Q8_0Block::default()];
        quantize_q8_0(Isa::Scalar, &x, &mut out);
        assert_eq!(out[0].d, 1.0);
        assert_eq!(&out[0].qs[..4], &[127, 2, -4, 0]);
    }

    #[test]
    fn q8_0_simd_equals_scalar() {
        let mut rng = Rng::new(6);
        let mut x: Vec<f32> = (0..32 * 40)
            .map(|i| rng.uniform() * (1 + i % 7) as f32)
            .collect();
        x[..32].fill(0.0);
        // Exact ties after scaling: amax 127 makes the scale 1.
        x[32] = 127.0;
        x[33] = 2.5;
        x[34] = -0.5;
        // Blocks far below f16's normal range: the exact scale keeps them.
        x[64..96].iter_mut().for_each(|v| *v *= 1e-9);
        for quantize in [quantize_q8_0, quantize_q8_0_pair_bound, quantize_gradient] {
            let mut reference = vec![Q8_0Block::default(); 40];
            quantize(Isa::Scalar, &x, &mut reference);
            for isa in Isa::available() {
                let mut got = vec![Q8_0Block::default(); 40];
                quantize(isa, &x, &mut got);
                assert_eq!(got, reference, "{isa:?}");
            }
        }
        // A gradient's scale is kept in f32: the largest quad's magnitude over 126.
        let mut exact = [Q8_0Block::default()];
        quantize_gradient(Isa::Scalar, &x[64..96], &mut exact);
        let quad_max = x[64..96].chunks_exact(8).fold(0f32, |m, v| {
            let pair = |i: usize| v[i].abs() + v[i + 1].abs();
            m.max(pair(0) + pair(4)).max(pair(2) + pair(6))
        });
        assert_eq!(exact[0].d, quad_max / 126.0);
        assert!(exact[0].qs.iter().any(|&q| q != 0));
    }

    #[test]
    fn bounded_quants_keep_every_pair_or_quad_within_128() {
        let mut rng = Rng::new(7);
        // Random blocks, and blocks of equal magnitudes: every pair (quad) sits at the bound,
        // where the roundings up could pass 128 if the scale were off.
        let mut x: Vec<f32> = (0..32 * 60)
            .map(|i| rng.uniform() * (1 + i % 7) as f32)
            .collect();
        for (b, block) in x.chunks_exact_mut(32).take(20).enumerate() {
            let v = 0.37 + b as f32 * 1.13;
            for (i, x) in block.iter_mut().enumerate() {
                *x = if i % 3 == 0 { -v } else { v };
            }
        }
        x[20 * 32..21 * 32].fill(0.0);
        check_bounded(&x, quantize_q8_0_pair_bound, &[&[0, 1]]);
        check_bounded(&x, quantize_gradient, &[&[0, 1, 4, 5], &[2, 3, 6, 7]]);
    }

    /// `quantize`'s blocks of `x` keep every group within 128 (`groups`: each group's offsets
    /// within every run of values as long as the largest offset plus one), each quant the
    /// nearest to its value, on every path.
    fn check_bounded(x: &[f32], quantize: fn(Isa, &[f32], &mut [Q8_0Block]), groups: &[&[usize]]) {
        let blocks = x.len() / 32;
        let run = groups
            .iter()
            .flat_map(|g| g.iter())
            .max()
            .map_or(1, |m| m + 1);
        let mut reference = vec![Q8_0Block::default(); blocks];
        quantize(Isa::Scalar, x, &mut reference);
        for (b, (block, xb)) in reference.iter().zip(x.chunks_exact(32)).enumerate() {
            for (k, values) in block.qs.chunks_exact(run).enumerate() {
                for group in groups {
                    let sum: i32 = group.iter().map(|&i| (values[i] as i32).abs()).sum();
                    assert!(sum <= 128, "block {b} run {k} group {group:?}: {values:?}");
                }
            }
            // Quants to nearest, give or take the f16 rounding of the stored scale.
            for (&q, &v) in block.qs.iter().zip(xb) {
                assert!(
                    (q as f32 * block.d - v).abs() <= block.d * 0.6 + 1e-6,
                    "block {b}"
                );
            }
            let sum: i32 = block.qs.iter().map(|&q| q as i32).sum();
            assert_eq!(block.vnni_init, VNNI_BIAS - 128 * sum);
        }
        for isa in Isa::available() {
            let mut got = vec![Q8_0Block::default(); blocks];
            quantize(isa, x, &mut got);
            assert_eq!(got, reference, "{isa:?}");
        }
    }

    #[test]
    fn q8_k_block_keeps_sums_and_sign_of_max() {
        let x: Vec<f32> = (0..256).map(|i| (i as f32 - 100.0) / 10.0).collect();
        let mut out = [Q8KBlock::default()];
        quantize_q8_k(&x, &mut out);
        let b = &out[0];
        // max |x| is 15.5 (i = 255): it maps to -127 * sign, d carries the sign back.
        assert_eq!(b.qs[255], -127);
        assert!(b.d < 0.0);
        for (j, s) in b.bsums.iter().enumerate() {
            let sum: i16 = b.qs[j * 16..j * 16 + 16].iter().map(|&v| v as i16).sum();
            assert_eq!(*s, sum);
        }
        for (j, s) in b.sums32.iter().enumerate() {
            let sum: i16 = b.qs[j * 32..j * 32 + 32].iter().map(|&v| v as i16).sum();
            assert_eq!(*s, sum);
        }
        for (i, &v) in x.iter().enumerate() {
            assert!((b.qs[i] as f32 * b.d - v).abs() <= b.d.abs() / 2.0 + 1e-6);
        }
    }
}
