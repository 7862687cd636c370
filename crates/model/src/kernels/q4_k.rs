//! Q4_K weights (256 per block: f16 d and dmin, twelve bytes of 6-bit scales and mins, 4-bit
//! quants) against Q8_K activations: ggml's `ggml_vec_dot_q4_K_q8_K` AVX2 arithmetic. Lane `k`
//! of eight gathers `scale * q * a` over bytes `4k..4k+3` of every 32-value sub-block in i32,
//! then `fma(d, sum, acc_k)` per block; the mins go through four lanes
//! `fma(dmin, mins · subblock_sums, accm)`.

use half::f16;

use super::activations::{quantize_q8_k, Q8KBlock};
#[cfg(target_arch = "x86_64")]
use super::with_act_rows;
use super::{hsum8, Isa, Kernel};

pub(crate) const BLOCK_ELEMS: usize = 256;
pub(crate) const BLOCK_BYTES: usize = 144;

pub(crate) struct Q4K;

impl Kernel for Q4K {
    type Act = Q8KBlock;
    const BLOCK_ELEMS: usize = BLOCK_ELEMS;
    const BLOCK_BYTES: usize = BLOCK_BYTES;
    const ROW_GROUP: usize = 1;

    fn quantize(_isa: Isa, x: &[f32], out: &mut [Q8KBlock]) {
        quantize_q8_k(x, out);
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
                _ => with_act_rows!(na, x86::rows(w, acts, nb, out, stride)),
            }
        }
    }
}

/// The block's 6-bit scales (bytes 0..8) and mins (8..16), unpacked as ggml's `utmp`.
fn scales_and_mins(b: &[u8]) -> [u8; 16] {
    const KMASK1: u32 = 0x3f3f_3f3f;
    const KMASK2: u32 = 0x0f0f_0f0f;
    const KMASK3: u32 = 0x0303_0303;
    let word =
        |i: usize| u32::from_le_bytes([b[4 + 4 * i], b[5 + 4 * i], b[6 + 4 * i], b[7 + 4 * i]]);
    let (u0, u1, u2) = (word(0), word(1), word(2));
    let utmp = [
        u0 & KMASK1,
        (u2 & KMASK2) | (((u0 >> 6) & KMASK3) << 4),
        u1 & KMASK1,
        ((u2 >> 4) & KMASK2) | (((u1 >> 6) & KMASK3) << 4),
    ];
    let mut out = [0u8; 16];
    for (o, u) in out.chunks_exact_mut(4).zip(utmp) {
        o.copy_from_slice(&u.to_le_bytes());
    }
    out
}

fn scales(b: &[u8]) -> (f32, f32) {
    (
        f16::from_le_bytes([b[0], b[1]]).to_f32(),
        f16::from_le_bytes([b[2], b[3]]).to_f32(),
    )
}

/// `(q8s[2m], q8s[2m+1])` pairs: the Q8_K sums per 32 values, as ggml's `_mm_hadd_epi16`.
fn subblock_sums(a: &Q8KBlock) -> [i16; 8] {
    std::array::from_fn(|k| a.bsums[2 * k].wrapping_add(a.bsums[2 * k + 1]))
}

/// The reference: ggml's AVX2 lanes in scalar code.
fn scalar(w: &[u8], acts: &[Q8KBlock], nb: usize, out: &mut [f32], stride: usize) {
    for (r, wrow) in w.chunks_exact(nb * BLOCK_BYTES).enumerate() {
        for (a, arow) in acts.chunks_exact(nb).enumerate() {
            let mut acc = [0f32; 8];
            let mut accm = [0f32; 4];
            for (wb, ab) in wrow.chunks_exact(BLOCK_BYTES).zip(arow) {
                let (dx, dminx) = scales(wb);
                let d = ab.d * dx;
                let dmin = -ab.d * dminx;
                let sm = scales_and_mins(wb);
                let q8s = subblock_sums(ab);
                for (m, accm) in accm.iter_mut().enumerate() {
                    let prod = sm[8 + 2 * m] as i32 * q8s[2 * m] as i32
                        + sm[9 + 2 * m] as i32 * q8s[2 * m + 1] as i32;
                    *accm = dmin.mul_add(prod as f32, *accm);
                }
                let qs = &wb[16..];
                let mut sumi = [0i32; 8];
                for j in 0..4 {
                    for (k, s) in sumi.iter_mut().enumerate() {
                        for b in 4 * k..4 * k + 4 {
                            let q = qs[32 * j + b];
                            *s += sm[2 * j] as i32 * (q & 0xf) as i32 * ab.qs[64 * j + b] as i32;
                            *s += sm[2 * j + 1] as i32
                                * (q >> 4) as i32
                                * ab.qs[64 * j + 32 + b] as i32;
                        }
                    }
                }
                for (acc, s) in acc.iter_mut().zip(sumi) {
                    *acc = d.mul_add(s as f32, *acc);
                }
            }
            out[a * stride + r] = hsum8(&acc) + ((accm[0] + accm[2]) + (accm[1] + accm[3]));
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::super::row_pairs;
    use super::super::x86::{half, hsum8, pair, pair_ps};
    use super::{scales, scales_and_mins, Q8KBlock, BLOCK_BYTES};

    /// The activation's sums per 32 values (ggml's `_mm_hadd_epi16` of the sums of 16).
    #[target_feature(enable = "avx2")]
    fn subblock_sums_x86(ab: &Q8KBlock) -> __m128i {
        // SAFETY: `bsums` is 32 bytes.
        let bsums = unsafe { _mm256_loadu_si256(ab.bsums.as_ptr() as *const __m256i) };
        _mm_hadd_epi16(
            _mm256_castsi256_si128(bsums),
            _mm256_extracti128_si256::<1>(bsums),
        )
    }

    /// The AVX2 arithmetic with two weight rows per register (row `r` in the low eight lanes,
    /// `r + 1` in the high eight), sharing each activation load.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub(super) unsafe fn avx512_rows<const NA: usize>(
        w: &[u8],
        acts: &[Q8KBlock],
        nb: usize,
        out: &mut [f32],
        stride: usize,
    ) {
        let m4 = _mm512_set1_epi8(0xf);
        let rows = w.len() / (nb * BLOCK_BYTES);
        for (r, w0, w1) in row_pairs(w, nb * BLOCK_BYTES) {
            let mut acc = [_mm512_setzero_ps(); NA];
            let mut accm = [_mm256_setzero_ps(); NA];
            for b in 0..nb {
                let wb = [
                    &w0[b * BLOCK_BYTES..(b + 1) * BLOCK_BYTES],
                    &w1[b * BLOCK_BYTES..(b + 1) * BLOCK_BYTES],
                ];
                let ((d0, dmin0), (d1, dmin1)) = (scales(wb[0]), scales(wb[1]));
                let sm = [scales_and_mins(wb[0]), scales_and_mins(wb[1])];
                // SAFETY: each `sm` is 16 bytes, the mins its last 8.
                let mins = unsafe {
                    let m = |i: usize| {
                        _mm_cvtepu8_epi16(_mm_loadl_epi64(sm[i].as_ptr().add(8) as *const __m128i))
                    };
                    _mm256_set_m128i(m(1), m(0))
                };
                let mut sumi = [_mm512_setzero_si512(); NA];
                for j in 0..4 {
                    let scale = |k: usize| {
                        pair(
                            _mm256_set1_epi16(sm[0][k] as i16),
                            _mm256_set1_epi16(sm[1][k] as i16),
                        )
                    };
                    let (scale_l, scale_h) = (scale(2 * j), scale(2 * j + 1));
                    // SAFETY: the quants are the last 128 bytes of each block.
                    let q4 = unsafe {
                        let q = |i: usize| {
                            _mm256_loadu_si256(wb[i].as_ptr().add(16 + 32 * j) as *const __m256i)
                        };
                        pair(q(0), q(1))
                    };
                    let q4l = _mm512_and_si512(q4, m4);
                    let q4h = _mm512_and_si512(_mm512_srli_epi16::<4>(q4), m4);
                    for (a, sumi) in sumi.iter_mut().enumerate() {
                        let q8 = acts[a * nb + b].qs.as_ptr();
                        // SAFETY: `qs` is 256 bytes.
                        let (q8l, q8h) = unsafe {
                            (
                                _mm512_broadcast_i64x4(_mm256_loadu_si256(
                                    q8.add(64 * j) as *const __m256i
                                )),
                                _mm512_broadcast_i64x4(_mm256_loadu_si256(
                                    q8.add(64 * j + 32) as *const __m256i
                                )),
                            )
                        };
                        let pl = _mm512_madd_epi16(scale_l, _mm512_maddubs_epi16(q4l, q8l));
                        let ph = _mm512_madd_epi16(scale_h, _mm512_maddubs_epi16(q4h, q8h));
                        *sumi = _mm512_add_epi32(*sumi, _mm512_add_epi32(pl, ph));
                    }
                }
                for a in 0..NA {
                    let ab = &acts[a * nb + b];
                    let q8s = subblock_sums_x86(ab);
                    let prod = _mm256_madd_epi16(mins, _mm256_broadcastsi128_si256(q8s));
                    let dmin =
                        _mm256_set_m128(_mm_set1_ps(-ab.d * dmin1), _mm_set1_ps(-ab.d * dmin0));
                    accm[a] = _mm256_fmadd_ps(dmin, _mm256_cvtepi32_ps(prod), accm[a]);
                    let d = pair_ps(ab.d * d0, ab.d * d1);
                    acc[a] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(sumi[a]), acc[a]);
                }
            }
            for a in 0..NA {
                for h in 0..2 {
                    if r + h < rows {
                        let m = if h == 0 {
                            _mm256_castps256_ps128(accm[a])
                        } else {
                            _mm256_extractf128_ps::<1>(accm[a])
                        };
                        let m = _mm_add_ps(m, _mm_movehl_ps(m, m));
                        let m = _mm_add_ss(m, _mm_movehdup_ps(m));
                        out[a * stride + r + h] = hsum8(half(acc[a], h)) + _mm_cvtss_f32(m);
                    }
                }
            }
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn rows<const NA: usize>(
        w: &[u8],
        acts: &[Q8KBlock],
        nb: usize,
        out: &mut [f32],
        stride: usize,
    ) {
        let m4 = _mm256_set1_epi8(0xf);
        for (r, wrow) in w.chunks_exact(nb * BLOCK_BYTES).enumerate() {
            let mut acc = [_mm256_setzero_ps(); NA];
            let mut accm = [_mm_setzero_ps(); NA];
            for b in 0..nb {
                let wb = &wrow[b * BLOCK_BYTES..(b + 1) * BLOCK_BYTES];
                let (dx, dminx) = scales(wb);
                let sm = scales_and_mins(wb);
                // SAFETY: `sm` is 16 bytes, the mins its last 8.
                let mins = _mm_cvtepu8_epi16(unsafe {
                    _mm_loadl_epi64(sm.as_ptr().add(8) as *const __m128i)
                });
                let mut sumi = [_mm256_setzero_si256(); NA];
                for j in 0..4 {
                    let scale_l = _mm256_set1_epi16(sm[2 * j] as i16);
                    let scale_h = _mm256_set1_epi16(sm[2 * j + 1] as i16);
                    // SAFETY: the quants are the last 128 bytes of the block.
                    let q4 = unsafe {
                        _mm256_loadu_si256(wb.as_ptr().add(16 + 32 * j) as *const __m256i)
                    };
                    let q4l = _mm256_and_si256(q4, m4);
                    let q4h = _mm256_and_si256(_mm256_srli_epi16::<4>(q4), m4);
                    for (a, sumi) in sumi.iter_mut().enumerate() {
                        let q8 = acts[a * nb + b].qs.as_ptr();
                        // SAFETY: `qs` is 256 bytes.
                        let (q8l, q8h) = unsafe {
                            (
                                _mm256_loadu_si256(q8.add(64 * j) as *const __m256i),
                                _mm256_loadu_si256(q8.add(64 * j + 32) as *const __m256i),
                            )
                        };
                        let pl = _mm256_madd_epi16(scale_l, _mm256_maddubs_epi16(q4l, q8l));
                        let ph = _mm256_madd_epi16(scale_h, _mm256_maddubs_epi16(q4h, q8h));
                        *sumi = _mm256_add_epi32(*sumi, _mm256_add_epi32(pl, ph));
                    }
                }
                for a in 0..NA {
                    let ab = &acts[a * nb + b];
                    let q8s = subblock_sums_x86(ab);
                    let prod = _mm_madd_epi16(mins, q8s);
                    accm[a] =
                        _mm_fmadd_ps(_mm_set1_ps(-ab.d * dminx), _mm_cvtepi32_ps(prod), accm[a]);
                    acc[a] = _mm256_fmadd_ps(
                        _mm256_set1_ps(ab.d * dx),
                        _mm256_cvtepi32_ps(sumi[a]),
                        acc[a],
                    );
                }
            }
            for a in 0..NA {
                let m = _mm_add_ps(accm[a], _mm_movehl_ps(accm[a], accm[a]));
                let m = _mm_add_ss(m, _mm_movehdup_ps(m));
                out[a * stride + r] = hsum8(acc[a]) + _mm_cvtss_f32(m);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_util::{check_paths_agree, Rng};
    use super::super::WeightFormat;
    use super::*;

    #[test]
    fn simd_paths_equal_scalar_reference_bit_for_bit() {
        let mut rng = Rng::new(4);
        for (rows, nb) in [(1, 1), (5, 3), (9, 2)] {
            let mut w = Vec::with_capacity(rows * nb * BLOCK_BYTES);
            for _ in 0..rows * nb {
                w.extend_from_slice(&f16::from_f32(rng.uniform() * 0.01).to_le_bytes());
                w.extend_from_slice(&f16::from_f32(rng.uniform() * 0.01).to_le_bytes());
                // Every bit pattern of scales and quants is a valid block.
                w.extend((0..140).map(|_| rng.next() as u8));
            }
            check_paths_agree(WeightFormat::Q4K, &w, nb * BLOCK_ELEMS, rows, &mut rng);
        }
    }
}
