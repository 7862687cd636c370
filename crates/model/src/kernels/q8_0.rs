//! Q8_0 weights (f16 scale + 32 i8 per block; Q5_0 arrives converted to it) against Q8_0
//! activations: ggml's `ggml_vec_dot_q8_0_q8_0` arithmetic. Per block, lane `l` of eight gets
//! `fma(dw * da, (Σ_{j=4l}^{4l+3} w_j a_j) as f32, acc_l)`; the lanes are summed by `hsum8`.

use half::f16;

use super::activations::{quantize_q8_0, Q8_0Block};
#[cfg(target_arch = "x86_64")]
use super::with_act_rows;
use super::{hsum8, Isa, Kernel};

pub(crate) const BLOCK_ELEMS: usize = 32;
pub(crate) const BLOCK_BYTES: usize = 34;

pub(crate) struct Q8_0;

impl Kernel for Q8_0 {
    type Act = Q8_0Block;
    const BLOCK_ELEMS: usize = BLOCK_ELEMS;
    const BLOCK_BYTES: usize = BLOCK_BYTES;

    fn quantize(x: &[f32], out: &mut [Q8_0Block]) {
        quantize_q8_0(x, out);
    }

    fn scalar(w: &[u8], acts: &[Self::Act], nb: usize, out: &mut [f32], stride: usize) {
        scalar(w, acts, nb, out, stride);
    }

    #[cfg(target_arch = "x86_64")]
    unsafe fn simd(
        isa: Isa,
        w: &[u8],
        acts: &[Self::Act],
        nb: usize,
        out: &mut [f32],
        stride: usize,
    ) {
        let na = acts.len() / nb;
        // SAFETY: the caller's guarantees, passed on.
        unsafe {
            match isa {
                Isa::Avx512 => with_act_rows!(na, x86::avx512_rows(w, acts, nb, out, stride)),
                _ => with_act_rows!(na, x86::avx2_rows(w, acts, nb, out, stride)),
            }
        }
    }
}

fn block_scale(b: &[u8]) -> f32 {
    f16::from_le_bytes([b[0], b[1]]).to_f32()
}

/// The reference: ggml's AVX2 lanes in scalar code.
fn scalar(w: &[u8], acts: &[Q8_0Block], nb: usize, out: &mut [f32], stride: usize) {
    for (r, wrow) in w.chunks_exact(nb * BLOCK_BYTES).enumerate() {
        for (a, arow) in acts.chunks_exact(nb).enumerate() {
            let mut lanes = [0f32; 8];
            for (wb, ab) in wrow.chunks_exact(BLOCK_BYTES).zip(arow) {
                let d = block_scale(wb) * ab.d;
                for (l, lane) in lanes.iter_mut().enumerate() {
                    let isum: i32 = (4 * l..4 * l + 4)
                        .map(|j| wb[2 + j] as i8 as i32 * ab.qs[j] as i32)
                        .sum();
                    *lane = d.mul_add(isum as f32, *lane);
                }
            }
            out[a * stride + r] = hsum8(&lanes);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::super::x86::hsum8;
    use super::{Q8_0Block, BLOCK_BYTES};

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn avx2_rows<const NA: usize>(
        w: &[u8],
        acts: &[Q8_0Block],
        nb: usize,
        out: &mut [f32],
        stride: usize,
    ) {
        let ones = _mm256_set1_epi16(1);
        for (r, wrow) in w.chunks_exact(nb * BLOCK_BYTES).enumerate() {
            let mut acc = [_mm256_setzero_ps(); NA];
            for b in 0..nb {
                let wb = &wrow[b * BLOCK_BYTES..(b + 1) * BLOCK_BYTES];
                let dw = super::block_scale(wb);
                // SAFETY: `wb` holds 34 bytes, the quants are its last 32.
                let qw = unsafe { _mm256_loadu_si256(wb.as_ptr().add(2) as *const __m256i) };
                let aw = _mm256_sign_epi8(qw, qw);
                for (a, acc) in acc.iter_mut().enumerate() {
                    let ab = &acts[a * nb + b];
                    // SAFETY: `qs` is 32 bytes.
                    let qa = unsafe { _mm256_loadu_si256(ab.qs.as_ptr() as *const __m256i) };
                    let dot =
                        _mm256_madd_epi16(ones, _mm256_maddubs_epi16(aw, _mm256_sign_epi8(qa, qw)));
                    let d = _mm256_set1_ps(dw * ab.d);
                    *acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(dot), *acc);
                }
            }
            for (a, acc) in acc.iter().enumerate() {
                out[a * stride + r] = hsum8(*acc);
            }
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(super) unsafe fn avx512_rows<const NA: usize>(
        w: &[u8],
        acts: &[Q8_0Block],
        nb: usize,
        out: &mut [f32],
        stride: usize,
    ) {
        let row_bytes = nb * BLOCK_BYTES;
        let rows = w.len() / row_bytes;
        let zero = _mm512_setzero_si512();
        let bias = _mm512_set1_epi8(-128);
        // Spread the four row scales: pair 0 takes scales 0 and 1, pair 1 scales 2 and 3.
        let spread = [
            _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
            _mm512_setr_epi32(2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3),
        ];
        for r0 in (0..rows).step_by(4) {
            // Rows past the end repeat the last one; their results are not stored.
            let wrow: [*const u8; 4] =
                std::array::from_fn(|i| w[(r0 + i).min(rows - 1) * row_bytes..].as_ptr());
            let mut acc = [[_mm512_setzero_ps(); NA]; 2];
            for b in 0..nb {
                let off = b * BLOCK_BYTES;
                // SAFETY: each row pointer starts a full row of `nb` blocks; block `b` is
                // 34 bytes at `off` (f16 scale, then 32 quants).
                let (qw, dw) = unsafe {
                    let h = |i: usize| std::ptr::read_unaligned(wrow[i].add(off) as *const i16);
                    let d4 = _mm512_castps128_ps512(_mm_cvtph_ps(_mm_setr_epi16(
                        h(0),
                        h(1),
                        h(2),
                        h(3),
                        0,
                        0,
                        0,
                        0,
                    )));
                    let q = |i: usize| _mm256_loadu_si256(wrow[i].add(off + 2) as *const __m256i);
                    (
                        [
                            _mm512_inserti64x4::<1>(_mm512_castsi256_si512(q(0)), q(1)),
                            _mm512_inserti64x4::<1>(_mm512_castsi256_si512(q(2)), q(3)),
                        ],
                        [
                            _mm512_permutexvar_ps(spread[0], d4),
                            _mm512_permutexvar_ps(spread[1], d4),
                        ],
                    )
                };
                let neg_bias = [
                    _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(zero, bias, qw[0])),
                    _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(zero, bias, qw[1])),
                ];
                for a in 0..NA {
                    let ab = &acts[a * nb + b];
                    // SAFETY: `qs` is 32 bytes.
                    let qa = unsafe { _mm256_loadu_si256(ab.qs.as_ptr() as *const __m256i) };
                    let ua = _mm512_xor_si512(_mm512_broadcast_i64x4(qa), bias);
                    let da = _mm512_set1_ps(ab.d);
                    for p in 0..2 {
                        let dot = _mm512_dpbusd_epi32(neg_bias[p], ua, qw[p]);
                        let d = _mm512_mul_ps(dw[p], da);
                        acc[p][a] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(dot), acc[p][a]);
                    }
                }
            }
            for (p, acc) in acc.iter().enumerate() {
                for (a, acc) in acc.iter().enumerate() {
                    let halves = [
                        _mm512_castps512_ps256(*acc),
                        _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(*acc))),
                    ];
                    for (h, half) in halves.into_iter().enumerate() {
                        let r = r0 + 2 * p + h;
                        if r < rows {
                            out[a * stride + r] = hsum8(half);
                        }
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_util::{check_paths_agree, Rng};
    use super::super::WeightFormat;
    use super::*;

    pub(crate) fn random_weights(rng: &mut Rng, rows: usize, nb: usize) -> Vec<u8> {
        let mut w = Vec::with_capacity(rows * nb * BLOCK_BYTES);
        for _ in 0..rows * nb {
            w.extend_from_slice(&f16::from_f32(rng.uniform() * 0.02).to_le_bytes());
            // The full i8 range, -128 included: the VNNI bias trick must stay exact there.
            w.extend((0..32).map(|_| rng.next() as u8));
        }
        w
    }

    #[test]
    fn simd_paths_equal_scalar_reference_bit_for_bit() {
        let mut rng = Rng::new(1);
        for (rows, nb) in [(1, 1), (5, 3), (8, 20), (13, 2)] {
            let w = random_weights(&mut rng, rows, nb);
            check_paths_agree(WeightFormat::Q8_0, &w, nb * BLOCK_ELEMS, rows, &mut rng);
        }
    }

    #[test]
    fn reference_matches_dequantized_dot() {
        let mut rng = Rng::new(2);
        let nb = 4;
        let w = random_weights(&mut rng, 3, nb);
        let mut acts = vec![Q8_0Block::default(); nb];
        let x: Vec<f32> = (0..nb * 32).map(|_| rng.uniform()).collect();
        quantize_q8_0(&x, &mut acts);
        let mut out = vec![0f32; 3];
        scalar(&w, &acts, nb, &mut out, 3);
        for (r, wrow) in w.chunks_exact(nb * BLOCK_BYTES).enumerate() {
            let mut exact = 0f64;
            for (wb, ab) in wrow.chunks_exact(BLOCK_BYTES).zip(&acts) {
                for j in 0..32 {
                    exact += block_scale(wb) as f64
                        * (wb[2 + j] as i8) as f64
                        * ab.d as f64
                        * ab.qs[j] as f64;
                }
            }
            assert!(
                (out[r] as f64 - exact).abs() < 1e-5 * (1.0 + exact.abs()),
                "{} vs {exact}",
                out[r]
            );
        }
    }
}
