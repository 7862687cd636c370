//! Q6_K weights (256 per block: 4 low bits, 2 high bits, sixteen i8 scales, f16 d) against Q8_K
//! activations: ggml's `ggml_vec_dot_q6_K_q8_K` AVX2 arithmetic. Lane `k` of eight gathers
//! `scale * q * a` (q unsigned, 0..63) over bytes `4k..4k+3` of every 32-value run in i32 and
//! takes back the offset of 32 through the activation sums of values `32k..32k+31`
//! (`32 * (bsum[2k]·scale[2k] + bsum[2k+1]·scale[2k+1])`), then `fma(d, sum, acc_k)` per block
//! (`d = da·dw`); the row's result is `hsum_float_8` of the eight lanes. Every row is computed
//! this way, whatever the number of rows.

use half::f16;

use super::activations::{quantize_q8_k, Q8KBlock};
#[cfg(target_arch = "x86_64")]
use super::with_act_rows;
use super::{hsum8, Isa, Kernel};

pub(crate) const BLOCK_ELEMS: usize = 256;
pub(crate) const BLOCK_BYTES: usize = 210;
const QH: usize = 128;
const SCALES: usize = 192;
const D: usize = 208;

/// Q6_K rows with the arithmetic of ggml's AVX2 `ggml_vec_dot_q6_K_q8_K`.
pub(crate) struct Q6K;

impl Kernel for Q6K {
    type Batched = Self;
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
                Isa::Avx512 => {
                    with_act_rows!(na, x86::avx512_rows(w, acts, nb, out, stride))
                }
                _ => with_act_rows!(na, x86::rows(w, acts, nb, out, stride)),
            }
        }
    }
}

fn scale(b: &[u8]) -> f32 {
    f16::from_le_bytes([b[D], b[D + 1]]).to_f32()
}

/// The 6-bit quant at byte `b` (0..32) of run `c` (0..4) in half `j` (0..2) of the block, as
/// ggml's AVX2 code assembles it.
fn quant(wb: &[u8], j: usize, c: usize, b: usize) -> i32 {
    let ql = wb[64 * j + 32 * (c % 2) + b];
    let low = if c < 2 { ql & 0xf } else { ql >> 4 };
    let high = (wb[QH + 32 * j + b] >> (2 * c)) & 3;
    (low | high << 4) as i32
}

/// The reference: ggml's AVX2 lanes in scalar code.
fn scalar(w: &[u8], acts: &[Q8KBlock], nb: usize, out: &mut [f32], stride: usize) {
    for (r, wrow) in w.chunks_exact(nb * BLOCK_BYTES).enumerate() {
        for (a, arow) in acts.chunks_exact(nb).enumerate() {
            let mut acc = [0f32; 8];
            for (wb, ab) in wrow.chunks_exact(BLOCK_BYTES).zip(arow) {
                let d = ab.d * scale(wb);
                let mut sumi = [0i32; 8];
                for j in 0..2 {
                    for c in 0..4 {
                        for (k, s) in sumi.iter_mut().enumerate() {
                            let sc = wb[SCALES + 8 * j + 2 * c + k / 4] as i8 as i32;
                            let run: i32 = (4 * k..4 * k + 4)
                                .map(|b| quant(wb, j, c, b) * ab.qs[128 * j + 32 * c + b] as i32)
                                .sum();
                            *s += sc * run;
                        }
                    }
                }
                for (k, s) in sumi.iter_mut().enumerate() {
                    let sc = |i: usize| wb[SCALES + i] as i8 as i32;
                    let offset = ab.bsums[2 * k] as i32 * sc(2 * k)
                        + ab.bsums[2 * k + 1] as i32 * sc(2 * k + 1);
                    *s -= 32 * offset;
                }
                for (acc, s) in acc.iter_mut().zip(sumi) {
                    *acc = d.mul_add(s as f32, *acc);
                }
            }
            out[a * stride + r] = hsum8(&acc);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::super::row_pairs;
    use super::super::x86::{half, hsum8, pair, pair_ps};
    use super::{scale, Q8KBlock, BLOCK_BYTES, QH, SCALES};

    /// Run `c`'s two scales of half `j` (one per 16 values) as sixteen i16 lanes.
    #[target_feature(enable = "avx2")]
    fn run_scales(sc: __m128i, c: usize) -> __m256i {
        let (lo, hi) = (2 * c as i8, 2 * c as i8 + 1);
        let pick = _mm_set_epi8(
            hi, hi, hi, hi, hi, hi, hi, hi, lo, lo, lo, lo, lo, lo, lo, lo,
        );
        _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sc, pick))
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
        let m2 = _mm512_set1_epi8(3);
        let rows = w.len() / (nb * BLOCK_BYTES);
        for (r, w0, w1) in row_pairs(w, nb * BLOCK_BYTES) {
            let mut acc = [_mm512_setzero_ps(); NA];
            for b in 0..nb {
                let p = [
                    w0[b * BLOCK_BYTES..].as_ptr(),
                    w1[b * BLOCK_BYTES..].as_ptr(),
                ];
                let dx = (scale(&w0[b * BLOCK_BYTES..]), scale(&w1[b * BLOCK_BYTES..]));
                let mut sumi = [_mm512_setzero_si512(); NA];
                for j in 0..2 {
                    // SAFETY: each block is 210 bytes: ql 0..128, qh 128..192, scales 192..208.
                    let (ql1, ql2, qh, sc) = unsafe {
                        let load = |off: usize| {
                            pair(
                                _mm256_loadu_si256(p[0].add(off) as *const __m256i),
                                _mm256_loadu_si256(p[1].add(off) as *const __m256i),
                            )
                        };
                        let sc =
                            |i: usize| _mm_loadl_epi64(p[i].add(SCALES + 8 * j) as *const __m128i);
                        (
                            load(64 * j),
                            load(64 * j + 32),
                            load(QH + 32 * j),
                            [sc(0), sc(1)],
                        )
                    };
                    let high = |h: __m512i| _mm512_slli_epi16::<4>(_mm512_and_si512(h, m2));
                    let q = [
                        _mm512_or_si512(_mm512_and_si512(ql1, m4), high(qh)),
                        _mm512_or_si512(
                            _mm512_and_si512(ql2, m4),
                            high(_mm512_srli_epi16::<2>(qh)),
                        ),
                        _mm512_or_si512(
                            _mm512_and_si512(_mm512_srli_epi16::<4>(ql1), m4),
                            high(_mm512_srli_epi16::<4>(qh)),
                        ),
                        _mm512_or_si512(
                            _mm512_and_si512(_mm512_srli_epi16::<4>(ql2), m4),
                            high(_mm512_srli_epi16::<6>(qh)),
                        ),
                    ];
                    let scales: [__m512i; 4] =
                        std::array::from_fn(|c| pair(run_scales(sc[0], c), run_scales(sc[1], c)));
                    for (a, sumi) in sumi.iter_mut().enumerate() {
                        let q8 = acts[a * nb + b].qs.as_ptr();
                        for c in 0..4 {
                            // SAFETY: `qs` is 256 bytes.
                            let q8c = _mm512_broadcast_i64x4(unsafe {
                                _mm256_loadu_si256(q8.add(128 * j + 32 * c) as *const __m256i)
                            });
                            let p16 = _mm512_maddubs_epi16(q[c], q8c);
                            *sumi = _mm512_add_epi32(*sumi, _mm512_madd_epi16(scales[c], p16));
                        }
                    }
                }
                // SAFETY: each block's sixteen scales at 192..208.
                let all_scales = unsafe {
                    pair(
                        _mm256_cvtepi8_epi16(_mm_loadu_si128(p[0].add(SCALES) as *const __m128i)),
                        _mm256_cvtepi8_epi16(_mm_loadu_si128(p[1].add(SCALES) as *const __m128i)),
                    )
                };
                for (a, sumi) in sumi.iter_mut().enumerate() {
                    // SAFETY: `bsums` is 32 bytes.
                    let bsums = _mm512_broadcast_i64x4(unsafe {
                        _mm256_loadu_si256(acts[a * nb + b].bsums.as_ptr() as *const __m256i)
                    });
                    let offset = _mm512_slli_epi32::<5>(_mm512_madd_epi16(bsums, all_scales));
                    *sumi = _mm512_sub_epi32(*sumi, offset);
                }
                for a in 0..NA {
                    let ad = acts[a * nb + b].d;
                    let d = pair_ps(ad * dx.0, ad * dx.1);
                    acc[a] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(sumi[a]), acc[a]);
                }
            }
            for (a, acc) in acc.iter().enumerate() {
                for h in 0..2 {
                    if r + h < rows {
                        out[a * stride + r + h] = hsum8(half(*acc, h));
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
        let m2 = _mm256_set1_epi8(3);
        // A loop LLVM does not unroll for several rows: unrolled, it hoists both halves' quants
        // ahead of their uses and spills them.
        let halves = if NA == 1 {
            2
        } else {
            std::hint::black_box(2usize)
        };
        for (r, wrow) in w.chunks_exact(nb * BLOCK_BYTES).enumerate() {
            let mut acc = [_mm256_setzero_ps(); NA];
            for b in 0..nb {
                let wb = &wrow[b * BLOCK_BYTES..(b + 1) * BLOCK_BYTES];
                let dx = scale(wb);
                let p = wb.as_ptr();
                let mut sumi = [_mm256_setzero_si256(); NA];
                for j in 0..halves {
                    let j = j & 1;
                    // SAFETY: the block is 210 bytes: ql 0..128, qh 128..192, scales 192..208.
                    let (ql1, ql2, qh, sc) = unsafe {
                        (
                            _mm256_loadu_si256(p.add(64 * j) as *const __m256i),
                            _mm256_loadu_si256(p.add(64 * j + 32) as *const __m256i),
                            _mm256_loadu_si256(p.add(QH + 32 * j) as *const __m256i),
                            _mm_loadl_epi64(p.add(SCALES + 8 * j) as *const __m128i),
                        )
                    };
                    let high = |shift: i32| {
                        let h = match shift {
                            0 => qh,
                            2 => _mm256_srli_epi16::<2>(qh),
                            4 => _mm256_srli_epi16::<4>(qh),
                            _ => _mm256_srli_epi16::<6>(qh),
                        };
                        _mm256_slli_epi16::<4>(_mm256_and_si256(h, m2))
                    };
                    let q = [
                        _mm256_or_si256(_mm256_and_si256(ql1, m4), high(0)),
                        _mm256_or_si256(_mm256_and_si256(ql2, m4), high(2)),
                        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(ql1), m4), high(4)),
                        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(ql2), m4), high(6)),
                    ];
                    let scales: [__m256i; 4] = std::array::from_fn(|c| run_scales(sc, c));
                    for (a, sumi) in sumi.iter_mut().enumerate() {
                        let q8 = acts[a * nb + b].qs.as_ptr();
                        for c in 0..4 {
                            // SAFETY: `qs` is 256 bytes.
                            let q8c = unsafe {
                                _mm256_loadu_si256(q8.add(128 * j + 32 * c) as *const __m256i)
                            };
                            let p16 = _mm256_maddubs_epi16(q[c], q8c);
                            *sumi = _mm256_add_epi32(*sumi, _mm256_madd_epi16(scales[c], p16));
                        }
                    }
                }
                // SAFETY: the block's sixteen scales at 192..208.
                let all_scales = _mm256_cvtepi8_epi16(unsafe {
                    _mm_loadu_si128(p.add(SCALES) as *const __m128i)
                });
                for (a, sumi) in sumi.iter_mut().enumerate() {
                    // SAFETY: `bsums` is 32 bytes.
                    let bsums = unsafe {
                        _mm256_loadu_si256(acts[a * nb + b].bsums.as_ptr() as *const __m256i)
                    };
                    let offset = _mm256_slli_epi32::<5>(_mm256_madd_epi16(bsums, all_scales));
                    *sumi = _mm256_sub_epi32(*sumi, offset);
                }
                for a in 0..NA {
                    let ad = acts[a * nb + b].d;
                    let d = _mm256_set1_ps(ad * dx);
                    acc[a] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(sumi[a]), acc[a]);
                }
            }
            for (a, acc) in acc.iter().enumerate() {
                out[a * stride + r] = hsum8(*acc);
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
        let mut rng = Rng::new(5);
        for (rows, nb) in [(1, 1), (5, 3), (9, 2)] {
            let mut w = Vec::with_capacity(rows * nb * BLOCK_BYTES);
            for _ in 0..rows * nb {
                // Every bit pattern of quants and scales is a valid block (scales -128..127).
                w.extend((0..D).map(|_| rng.next() as u8));
                w.extend_from_slice(&f16::from_f32(rng.uniform() * 0.01).to_le_bytes());
            }
            check_paths_agree(WeightFormat::Q6K, &w, nb * BLOCK_ELEMS, rows, &mut rng);
        }
    }
}
