//! Q8_0 weights (f16 scale + 32 i8 per block; Q5_0 arrives converted to it) against Q8_0
//! activations, in the order of ggml's AVX2 `ggml_vec_dot_q8_0_q8_0` (and `_q5_0_q8_0`) and of
//! llamafile's tinyBLAS, which llama.cpp's x86 build runs for decode and prefill: eight f32 lanes
//! per row, lane `k` taking `fma(dw·da, Σ_{i=4k..4k+3} w_i a_i, lane_k)` per block, and at the
//! end ggml's `hsum_float_8`, `((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))`.
//!
//! The weight is interleaved at load: sixteen rows per group, each block stored as the sixteen
//! f16 scales, then eight steps of sixteen rows × four quants, made unsigned (`w + 128`). Step
//! `s` is lane `s`: one VNNI instruction multiplies four quants of all sixteen rows by the same
//! four activation values, from a starting value that takes `128 Σ a` of those four back out,
//! so each row's lane sum ends in its own lane, exact, and goes into accumulator `s`; the eight
//! accumulators are summed as `hsum_float_8` element by element at the end. Per block and
//! activation row that is eight float conversions and eight fused multiply-adds per sixteen
//! rows, where one f32 per row would need one of each: batched Q8_0 matmuls take about 1.4x the
//! time they took with one accumulator per row; the one-row LM head streams from memory and is
//! not slower (it prefetches further ahead, into L2).

use half::f16;
use rayon::prelude::*;

use super::activations::{quantize_q8_0, Q8_0Block};
#[cfg(target_arch = "x86_64")]
use super::with_act_rows;
use super::{hsum8, Isa, Kernel};

pub(crate) const BLOCK_ELEMS: usize = 32;
/// GGUF block: f16 scale, 32 quants; the interleaved layout keeps 34 bytes per row and block.
pub(crate) const BLOCK_BYTES: usize = 34;
const GROUP: usize = 16;
const GROUP_BLOCK: usize = GROUP * BLOCK_BYTES;
const QUANTS: usize = 2 * GROUP;

pub(crate) struct Q8_0;

impl Kernel for Q8_0 {
    type Act = Q8_0Block;
    const BLOCK_ELEMS: usize = BLOCK_ELEMS;
    const BLOCK_BYTES: usize = BLOCK_BYTES;
    const ROW_GROUP: usize = GROUP;

    fn quantize(isa: Isa, x: &[f32], out: &mut [Q8_0Block]) {
        quantize_q8_0(isa, x, out);
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

/// GGUF Q8_0 rows (`out_dim` of them) in the interleaved layout, padded with zero rows to a
/// whole group.
pub(crate) fn interleave(gguf: &[u8], out_dim: usize) -> Vec<u8> {
    let nb = gguf.len() / (out_dim * BLOCK_BYTES);
    let groups = out_dim.div_ceil(GROUP);
    let mut packed = vec![0u8; groups * nb * GROUP_BLOCK];
    for (gb, dst) in packed.chunks_exact_mut(GROUP_BLOCK).enumerate() {
        let (g, b) = (gb / nb, gb % nb);
        for j in 0..GROUP {
            let row = g * GROUP + j;
            let src = if row < out_dim {
                &gguf[(row * nb + b) * BLOCK_BYTES..(row * nb + b + 1) * BLOCK_BYTES]
            } else {
                &[0u8; BLOCK_BYTES][..]
            };
            dst[2 * j..2 * j + 2].copy_from_slice(&src[..2]);
            for (i, &q) in src[2..].iter().enumerate() {
                dst[QUANTS + (i / 4) * 4 * GROUP + 4 * j + i % 4] = q ^ 0x80;
            }
        }
    }
    packed
}

/// Rows of the interleaved weight in f32: `d * q` per value, as GGUF dequantization does.
pub(crate) fn dequantize_rows(w: &[u8], in_dim: usize, rows: &[usize]) -> Vec<f32> {
    let nb = in_dim / BLOCK_ELEMS;
    let mut out = vec![0f32; rows.len() * in_dim];
    // The whole LM head (training's backward) is 168M values: split it across threads.
    out.par_chunks_mut(in_dim)
        .zip(rows.par_iter())
        .with_min_len(64)
        .for_each(|(dst, &row)| {
            let (g, j) = (row / GROUP, row % GROUP);
            let group = &w[g * nb * GROUP_BLOCK..(g + 1) * nb * GROUP_BLOCK];
            for (gb, dst) in group
                .chunks_exact(GROUP_BLOCK)
                .zip(dst.chunks_exact_mut(32))
            {
                let d = f16::from_le_bytes([gb[2 * j], gb[2 * j + 1]]).to_f32();
                for (step, dst) in dst.chunks_exact_mut(4).enumerate() {
                    let q = &gb[QUANTS + step * 4 * GROUP + 4 * j..][..4];
                    for (v, &q) in dst.iter_mut().zip(q) {
                        *v = (q ^ 0x80) as i8 as f32 * d;
                    }
                }
            }
        });
    out
}

/// The reference, lane for lane what the SIMD paths compute: ggml's eight lanes per row.
fn scalar(w: &[u8], acts: &[Q8_0Block], nb: usize, out: &mut [f32], stride: usize) {
    for (g, group) in w.chunks_exact(nb * GROUP_BLOCK).enumerate() {
        for (a, arow) in acts.chunks_exact(nb).enumerate() {
            for j in 0..GROUP {
                let mut lanes = [0f32; 8];
                for (wb, ab) in group.chunks_exact(GROUP_BLOCK).zip(arow) {
                    let d = f16::from_le_bytes([wb[2 * j], wb[2 * j + 1]]).to_f32() * ab.d;
                    for (step, lane) in lanes.iter_mut().enumerate() {
                        let q = &wb[QUANTS + step * 4 * GROUP + 4 * j..][..4];
                        let isum: i32 = q
                            .iter()
                            .zip(&ab.qs[4 * step..4 * step + 4])
                            .map(|(&q, &x)| (q ^ 0x80) as i8 as i32 * x as i32)
                            .sum();
                        *lane = d.mul_add(isum as f32, *lane);
                    }
                }
                out[a * stride + g * GROUP + j] = hsum8(&lanes);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::super::activations::VNNI_BIAS;
    use super::{Q8_0Block, GROUP, GROUP_BLOCK, QUANTS};

    /// Group blocks between the one computed and the one prefetched (into L2).
    const PREFETCH_AHEAD: usize = 32;
    /// Activation rows whose accumulators (eight registers each) stay in registers together.
    const AVX512_ROWS: usize = 2;

    /// Four activation values as one i32, broadcast.
    #[inline(always)]
    fn four(ab: &Q8_0Block, step: usize) -> i32 {
        i32::from_le_bytes([
            ab.qs[4 * step] as u8,
            ab.qs[4 * step + 1] as u8,
            ab.qs[4 * step + 2] as u8,
            ab.qs[4 * step + 3] as u8,
        ])
    }

    /// No VNNI: half a group (eight rows) per register, the products through ggml's
    /// sign trick (`|w|` unsigned times `a` with `w`'s sign), exact in i16 pairs; step `s` of
    /// a block goes to accumulator `s`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn avx2_rows<const NA: usize>(
        w: &[u8],
        acts: &[Q8_0Block],
        nb: usize,
        out: &mut [f32],
        stride: usize,
    ) {
        let ones = _mm256_set1_epi16(1);
        let flip = _mm256_set1_epi8(-128);
        for (g, group) in w.chunks_exact(nb * GROUP_BLOCK).enumerate() {
            for h in 0..2 {
                for (a, arow) in acts.chunks_exact(nb).enumerate() {
                    let mut acc = [_mm256_setzero_ps(); 8];
                    for (wb, ab) in group.chunks_exact(GROUP_BLOCK).zip(arow) {
                        let p = wb.as_ptr();
                        // SAFETY: the sixteen scales are the group block's first 32 bytes.
                        let dw = _mm256_cvtph_ps(unsafe {
                            _mm_loadu_si128(p.add(16 * h) as *const __m128i)
                        });
                        let d = _mm256_mul_ps(dw, _mm256_set1_ps(ab.d));
                        for (s, acc) in acc.iter_mut().enumerate() {
                            // SAFETY: step `s` of half `h` is 32 bytes inside the group block.
                            let q = unsafe {
                                _mm256_loadu_si256(p.add(QUANTS + 64 * s + 32 * h) as *const __m256i)
                            };
                            let q = _mm256_xor_si256(q, flip);
                            let x = _mm256_set1_epi32(four(ab, s));
                            let dot =
                                _mm256_maddubs_epi16(_mm256_abs_epi8(q), _mm256_sign_epi8(x, q));
                            let isum = _mm256_madd_epi16(dot, ones);
                            *acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(isum), *acc);
                        }
                    }
                    let at = a * stride + g * GROUP + 8 * h;
                    _mm256_storeu_ps(out[at..at + 8].as_mut_ptr(), hsum8_lanes(acc));
                }
            }
        }
    }

    /// ggml's `hsum_float_8` across eight registers, element by element.
    #[target_feature(enable = "avx")]
    fn hsum8_lanes(acc: [__m256; 8]) -> __m256 {
        let r: [__m256; 4] = std::array::from_fn(|i| _mm256_add_ps(acc[i + 4], acc[i]));
        _mm256_add_ps(_mm256_add_ps(r[0], r[2]), _mm256_add_ps(r[1], r[3]))
    }

    /// A whole group per register; step `s` of every block goes to accumulator `s`, each step's
    /// VNNI sum starting from the activation's `vnni_init` (no dependency chains in integers).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(super) unsafe fn avx512_rows<const NA: usize>(
        w: &[u8],
        acts: &[Q8_0Block],
        nb: usize,
        out: &mut [f32],
        stride: usize,
    ) {
        for (g, group) in w.chunks_exact(nb * GROUP_BLOCK).enumerate() {
            for a0 in (0..NA).step_by(AVX512_ROWS) {
                let out = &mut out[a0 * stride + g * GROUP..];
                let acts = &acts[a0 * nb..];
                // SAFETY: passed on; at most `AVX512_ROWS` rows from `a0`.
                unsafe {
                    match (NA - a0, a0 == 0) {
                        (1, true) => avx512_group::<1, true>(group, acts, nb, out, stride),
                        (1, false) => avx512_group::<1, false>(group, acts, nb, out, stride),
                        (_, true) => {
                            avx512_group::<AVX512_ROWS, true>(group, acts, nb, out, stride)
                        }
                        (_, false) => {
                            avx512_group::<AVX512_ROWS, false>(group, acts, nb, out, stride)
                        }
                    }
                }
            }
        }
    }

    /// One group's sixteen rows for `NA` activation rows (`out` at the group's first column),
    /// prefetching the weight ahead on the first pass over the group.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn avx512_group<const NA: usize, const PREFETCH: bool>(
        group: &[u8],
        acts: &[Q8_0Block],
        nb: usize,
        out: &mut [f32],
        stride: usize,
    ) {
        let bias = _mm512_set1_ps(f32::from_bits(VNNI_BIAS as u32));
        let mut acc = [[_mm512_setzero_ps(); 8]; NA];
        for (b, wb) in group.chunks_exact(GROUP_BLOCK).enumerate() {
            let p = wb.as_ptr();
            // One row of activations streams the weight from memory (the LM head): ask for
            // the group block 32 ahead into L2 (~40% faster than the hardware prefetcher
            // alone; eight ahead into L1 was slower). Later passes find the slice in L1.
            if PREFETCH {
                for line in 0..GROUP_BLOCK.div_ceil(64) {
                    let ahead = p.wrapping_add(PREFETCH_AHEAD * GROUP_BLOCK + 64 * line);
                    _mm_prefetch::<_MM_HINT_T1>(ahead as *const i8);
                }
            }
            // SAFETY: the group block is 544 bytes: 32 of scales, then eight steps of 64.
            let (dw, q) = unsafe {
                (
                    _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i)),
                    std::array::from_fn::<_, 8, _>(|s| {
                        _mm512_loadu_si512(p.add(QUANTS + 64 * s) as *const __m512i)
                    }),
                )
            };
            for (a, acc) in acc.iter_mut().enumerate() {
                let ab = &acts[a * nb + b];
                let d = _mm512_mul_ps(dw, _mm512_set1_ps(ab.d));
                for (s, acc) in acc.iter_mut().enumerate() {
                    let isum = _mm512_dpbusd_epi32(
                        _mm512_set1_epi32(ab.vnni_init[s]),
                        q[s],
                        _mm512_set1_epi32(four(ab, s)),
                    );
                    // The bits of 1.5·2^23 + Σ w·a: minus 1.5·2^23 is Σ w·a as f32, exactly.
                    let isum = _mm512_sub_ps(_mm512_castsi512_ps(isum), bias);
                    *acc = _mm512_fmadd_ps(d, isum, *acc);
                }
            }
        }
        for (a, acc) in acc.iter().enumerate() {
            let r: [__m512; 4] = std::array::from_fn(|i| _mm512_add_ps(acc[i + 4], acc[i]));
            let sum = _mm512_add_ps(_mm512_add_ps(r[0], r[2]), _mm512_add_ps(r[1], r[3]));
            _mm512_storeu_ps(out[a * stride..a * stride + GROUP].as_mut_ptr(), sum);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_util::{check_paths_agree, Rng};
    use super::super::WeightFormat;
    use super::*;

    fn random_weights(rng: &mut Rng, rows: usize, nb: usize) -> Vec<u8> {
        let mut w = Vec::with_capacity(rows * nb * BLOCK_BYTES);
        for _ in 0..rows * nb {
            w.extend_from_slice(&f16::from_f32(rng.uniform() * 0.02).to_le_bytes());
            // The full i8 range, -128 included: the unsigned shift must stay exact there.
            w.extend((0..32).map(|_| rng.next() as u8));
        }
        w
    }

    #[test]
    fn simd_paths_equal_scalar_reference_bit_for_bit() {
        let mut rng = Rng::new(1);
        for (rows, nb) in [(1, 1), (5, 3), (16, 20), (37, 2)] {
            let w = random_weights(&mut rng, rows, nb);
            check_paths_agree(WeightFormat::Q8_0, &w, nb * BLOCK_ELEMS, rows, &mut rng);
        }
    }

    /// The kernel's formula written directly on GGUF blocks and activation quants.
    fn straightforward(wrow: &[u8], arow: &[Q8_0Block]) -> f32 {
        let mut lane = [0f32; 8];
        for (wb, ab) in wrow.chunks_exact(BLOCK_BYTES).zip(arow) {
            let d = f16::from_le_bytes([wb[0], wb[1]]).to_f32() * ab.d;
            for (k, lane) in lane.iter_mut().enumerate() {
                let mut isum = 0i32;
                for i in 4 * k..4 * k + 4 {
                    isum += wb[2 + i] as i8 as i32 * ab.qs[i] as i32;
                }
                *lane = d.mul_add(isum as f32, *lane);
            }
        }
        let r: [f32; 4] = std::array::from_fn(|i| lane[i + 4] + lane[i]);
        (r[0] + r[2]) + (r[1] + r[3])
    }

    #[test]
    fn scalar_reference_is_ggmls_eight_lane_formula() {
        let mut rng = Rng::new(13);
        let (rows, nb, na) = (21, 5, 3);
        let w = random_weights(&mut rng, rows, nb);
        let x: Vec<f32> = (0..na * nb * BLOCK_ELEMS)
            .map(|i| rng.uniform() * (1 + i % 5) as f32)
            .collect();
        let mut acts = vec![Q8_0Block::default(); na * nb];
        quantize_q8_0(Isa::Scalar, &x, &mut acts);
        let packed = interleave(&w, rows);
        let stride = packed.len() / (nb * BLOCK_BYTES);
        let mut out = vec![0f32; na * stride];
        scalar(&packed, &acts, nb, &mut out, stride);
        for (a, arow) in acts.chunks_exact(nb).enumerate() {
            for (r, wrow) in w.chunks_exact(nb * BLOCK_BYTES).enumerate() {
                let want = straightforward(wrow, arow);
                assert_eq!(
                    out[a * stride + r].to_bits(),
                    want.to_bits(),
                    "act {a} row {r}"
                );
            }
        }
    }

    #[test]
    fn dequantized_rows_equal_candles_dequantization() {
        use candle_core::quantized::{GgmlDType, QStorage, QTensor};
        use candle_core::Device;
        let mut rng = Rng::new(3);
        let (rows, nb) = (21, 2);
        let w = random_weights(&mut rng, rows, nb);
        let storage = QStorage::from_data(
            std::borrow::Cow::Borrowed(&w[..]),
            &Device::Cpu,
            GgmlDType::Q8_0,
        )
        .expect("storage");
        let candle = QTensor::new(storage, (rows, nb * BLOCK_ELEMS))
            .expect("tensor")
            .dequantize(&Device::Cpu)
            .expect("dequantize")
            .to_vec2::<f32>()
            .expect("rows");
        let packed = interleave(&w, rows);
        let picked = [20, 0, 5, 16, 5];
        let ours = dequantize_rows(&packed, nb * BLOCK_ELEMS, &picked);
        for (i, &r) in picked.iter().enumerate() {
            assert_eq!(
                ours[i * nb * BLOCK_ELEMS..(i + 1) * nb * BLOCK_ELEMS],
                candle[r][..]
            );
        }
    }

    #[test]
    fn interleaving_keeps_every_row() {
        let mut rng = Rng::new(2);
        let (rows, nb) = (19, 3);
        let w = random_weights(&mut rng, rows, nb);
        let packed = interleave(&w, rows);
        assert_eq!(packed.len(), 2 * GROUP * nb * BLOCK_BYTES);
        for row in 0..2 * GROUP {
            for b in 0..nb {
                let gb = &packed[((row / GROUP) * nb + b) * GROUP_BLOCK..][..GROUP_BLOCK];
                let j = row % GROUP;
                let q: Vec<u8> = (0..32)
                    .map(|i| gb[QUANTS + (i / 4) * 4 * GROUP + 4 * j + i % 4] ^ 0x80)
                    .collect();
                let (scale, quants) = if row < rows {
                    let src = &w[(row * nb + b) * BLOCK_BYTES..][..BLOCK_BYTES];
                    (src[..2].to_vec(), src[2..].to_vec())
                } else {
                    (vec![0, 0], vec![0; 32])
                };
                assert_eq!(&gb[2 * j..2 * j + 2], &scale[..]);
                assert_eq!(q, quants);
            }
        }
    }
}
