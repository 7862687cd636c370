//! Q8_0 weights for AVX2 batches: each slice widened to 16-bit quants, multiplied with 16-bit
//! activations by `madd` (sixteen products per instruction, summed in i32 pairs).
//!
//! AVX2 has no byte dot product of two signed operands: the Q8_0 kernel's sign trick takes
//! three instructions on the two multiply ports (`sign`, `maddubs`, `madd`) per 32 products,
//! where two `madd`s do them here: 32 rows of the LM head's shape 13% faster, 32 rows of
//! 640 x 32,768 21%, 16 rows of the LM head's shape 9% (`kernel_throughput`, both kernels
//! alternated on one host); widening a slice costs what fewer rows would gain, hence
//! `Q8_0::WIDEN_MIN_ROWS`. (The LM head itself now runs on `q8_0::Q8_0PairBound`, which needs
//! no widening.)
//! The integer sum of a block is the same exact number, so the results are the Q8_0 kernel's
//! bits.
//!
//! Group block (sixteen rows, 1,056 bytes): the sixteen f16 scales, then sixteen pair steps of
//! 64 bytes, step `k = 2s + p` (`p` 0 or 1) holding values `4s + p` and `4s + p + 2` of rows
//! 0-7 (32 bytes, a row's two i16 side by side), then of rows 8-15. That order is what two
//! 16-bit shifts make of a Q8_0 step (a row's four bytes `4s..4s + 4`): each 16-bit word's low
//! byte sign-extended, then its high byte; the activations are stored in the same order.

use half::f16;

use super::activations::{quantize_q8_0, Q8_0Block};
use super::q8_0::{Format, Q8_0};
#[cfg(target_arch = "x86_64")]
use super::with_act_rows;
use super::{Isa, Kernel, TileOut};

const BLOCK_ELEMS: usize = 32;
/// One row's block: f16 scale and 32 i16.
const BLOCK_BYTES: usize = 2 + 2 * BLOCK_ELEMS;
const GROUP: usize = 16;
const GROUP_BLOCK: usize = GROUP * BLOCK_BYTES;
/// Bytes of the sixteen f16 scales that open every group block.
const SCALES: usize = 2 * GROUP;
/// A Q8_0 group block (the layout this one is widened from).
const Q8_0_GROUP_BLOCK: usize = GROUP * super::q8_0::BLOCK_BYTES;

/// The pair step of value `i` (`2s + p`, see the module's note) and its place in the pair.
fn pair_of(i: usize) -> (usize, usize) {
    let (s, q) = (i / 4, i % 4);
    (2 * s + q % 2, q / 2)
}

/// Where value `i` of row `j` sits in a group block.
fn at(j: usize, i: usize) -> usize {
    let (k, slot) = pair_of(i);
    SCALES + 64 * k + 32 * (j / 8) + 4 * (j % 8) + 2 * slot
}

/// Where value `i` of an activation block sits in its `qs`.
fn act_at(i: usize) -> usize {
    let (k, slot) = pair_of(i);
    2 * k + slot
}

/// A Q8_0 activation block with its quants as i16 in pair-step order (value `i` at
/// [`act_at`]), for `madd`.
#[derive(Clone, Copy, Debug, Default)]
#[repr(C)]
pub(crate) struct PairsBlock {
    d: f32,
    qs: [i16; BLOCK_ELEMS],
}

/// The kernel on the widened layout (see the module's note).
pub(crate) struct Q8_0Pairs;

impl Kernel for Q8_0Pairs {
    type Act = PairsBlock;
    const BLOCK_ELEMS: usize = BLOCK_ELEMS;
    const BLOCK_BYTES: usize = BLOCK_BYTES;
    const ROW_GROUP: usize = GROUP;
    type Batched = Self;

    fn quantize(isa: Isa, x: &[f32], out: &mut [PairsBlock]) {
        let mut blocks = [Q8_0Block::default(); 8];
        for (x, out) in x.chunks(8 * BLOCK_ELEMS).zip(out.chunks_mut(8)) {
            let blocks = &mut blocks[..out.len()];
            quantize_q8_0(isa, x, blocks);
            for (o, b) in out.iter_mut().zip(blocks.iter()) {
                o.d = b.d;
                for (i, &q) in b.qs.iter().enumerate() {
                    o.qs[act_at(i)] = i16::from(q);
                }
            }
        }
    }

    fn scalar(w: &[u8], acts: &[PairsBlock], nb: usize, out: TileOut<'_>) {
        for (g, group) in w.chunks_exact(nb * GROUP_BLOCK).enumerate() {
            for (a, arow) in acts.chunks_exact(nb).enumerate() {
                for j in 0..GROUP {
                    let mut acc = 0f32;
                    for (wb, ab) in group.chunks_exact(GROUP_BLOCK).zip(arow) {
                        let d = f16::from_le_bytes([wb[2 * j], wb[2 * j + 1]]).to_f32() * ab.d;
                        let isum: i32 = (0..BLOCK_ELEMS)
                            .map(|i| quant(wb, j, i) as i32 * ab.qs[act_at(i)] as i32)
                            .sum();
                        acc = d.mul_add(isum as f32, acc);
                    }
                    out.set(a, g * GROUP + j, acc);
                }
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    unsafe fn simd(_isa: Isa, w: &[u8], acts: &[PairsBlock], nb: usize, out: TileOut<'_>) {
        let na = acts.len() / nb;
        // SAFETY: the caller's guarantees, passed on (AVX-512 CPUs have AVX2).
        unsafe { with_act_rows!(na, x86::rows(w, acts, nb, out)) }
    }
}

/// Quant `i` of row `j` of a group block.
fn quant(gb: &[u8], j: usize, i: usize) -> i16 {
    i16::from_le_bytes([gb[at(j, i)], gb[at(j, i) + 1]])
}

/// Whole Q8_0 group blocks (`w`, as `q8_0` interleaves them: bytes `w + 128`) in this layout.
pub(crate) fn widen(isa: Isa, w: &[u8], nb: usize, out: &mut Vec<u8>) {
    debug_assert!(w.len().is_multiple_of(nb * Q8_0_GROUP_BLOCK));
    out.resize(w.len() / Q8_0_GROUP_BLOCK * GROUP_BLOCK, 0);
    for (src, dst) in w
        .chunks_exact(Q8_0_GROUP_BLOCK)
        .zip(out.chunks_exact_mut(GROUP_BLOCK))
    {
        dst[..SCALES].copy_from_slice(&src[..SCALES]);
        match isa {
            // SAFETY: whole group blocks; an x86 ISA other than scalar means AVX2.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 | Isa::Avx512 => unsafe { x86::widen(src, dst) },
            _ => {
                for j in 0..GROUP {
                    for i in 0..BLOCK_ELEMS {
                        let q = <Q8_0 as Format>::quant(src, j, i) as i16;
                        dst[at(j, i)..at(j, i) + 2].copy_from_slice(&q.to_le_bytes());
                    }
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{PairsBlock, TileOut, GROUP, GROUP_BLOCK, Q8_0_GROUP_BLOCK, SCALES};

    /// One Q8_0 group block widened: each step's 32 bytes (eight rows × four values) become
    /// two pair steps of those eight rows, by shifts within 16-bit words (no shuffles).
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn widen(src: &[u8], dst: &mut [u8]) {
        assert!(src.len() == Q8_0_GROUP_BLOCK && dst.len() == GROUP_BLOCK);
        for s in 0..8 {
            for h in 0..2 {
                // SAFETY: whole group blocks (checked above).
                unsafe {
                    let q = _mm256_loadu_si256(src.as_ptr().add(SCALES + 64 * s + 32 * h).cast());
                    let q = _mm256_xor_si256(q, _mm256_set1_epi8(-128));
                    // Each word's low byte sign-extended (values 4s, 4s + 2), then its high
                    // byte (4s + 1, 4s + 3).
                    let first = _mm256_srai_epi16::<8>(_mm256_slli_epi16::<8>(q));
                    let second = _mm256_srai_epi16::<8>(q);
                    let p = dst.as_mut_ptr().add(SCALES + 32 * h);
                    _mm256_storeu_si256(p.add(128 * s).cast(), first);
                    _mm256_storeu_si256(p.add(128 * s + 64).cast(), second);
                }
            }
        }
    }

    /// A whole group per pass: each pair step's two registers (rows 0-7, 8-15) taken by every
    /// activation row's broadcast pair; a block's integer sums into the accumulators by one
    /// conversion and one fused multiply-add per register.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn rows<const NA: usize>(
        w: &[u8],
        acts: &[PairsBlock],
        nb: usize,
        out: TileOut<'_>,
    ) {
        // A loop LLVM does not unroll (see `q8_0::x86::avx2_rows`).
        let steps = std::hint::black_box(16usize);
        for (g, group) in w.chunks_exact(nb * GROUP_BLOCK).enumerate() {
            let mut acc = [[_mm256_setzero_ps(); 2]; NA];
            for (b, wb) in group.chunks_exact(GROUP_BLOCK).enumerate() {
                let p = wb.as_ptr();
                let pairs: [*const i32; NA] =
                    std::array::from_fn(|a| acts[a * nb + b].qs.as_ptr().cast());
                let mut isum = [[_mm256_setzero_si256(); 2]; NA];
                for k in 0..steps {
                    let k = k & 15;
                    // SAFETY: pair step `k` is 64 bytes inside the group block; an activation
                    // block has sixteen pairs.
                    unsafe {
                        let q0 = _mm256_loadu_si256(p.add(SCALES + 64 * k).cast());
                        let q1 = _mm256_loadu_si256(p.add(SCALES + 64 * k + 32).cast());
                        for (isum, pair) in isum.iter_mut().zip(pairs) {
                            let x = _mm256_set1_epi32(pair.add(k).read_unaligned());
                            isum[0] = _mm256_add_epi32(isum[0], _mm256_madd_epi16(q0, x));
                            isum[1] = _mm256_add_epi32(isum[1], _mm256_madd_epi16(q1, x));
                        }
                    }
                }
                // SAFETY: the sixteen scales are the group block's first 32 bytes.
                let dw = unsafe {
                    [
                        _mm256_cvtph_ps(_mm_loadu_si128(p.cast())),
                        _mm256_cvtph_ps(_mm_loadu_si128(p.add(16).cast())),
                    ]
                };
                for a in 0..NA {
                    let da = _mm256_set1_ps(acts[a * nb + b].d);
                    for h in 0..2 {
                        let d = _mm256_mul_ps(dw[h], da);
                        acc[a][h] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(isum[a][h]), acc[a][h]);
                    }
                }
            }
            for (a, acc) in acc.iter().enumerate() {
                for (h, acc) in acc.iter().enumerate() {
                    _mm256_storeu_ps(out.at(a, g * GROUP + 8 * h), *acc);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::q8_0::interleave;
    use super::super::test_util::{random_gguf, Rng};
    use super::super::WeightFormat;
    use super::*;

    #[test]
    fn widening_keeps_every_quant_and_scale() {
        let mut rng = Rng::new(21);
        let (rows, nb) = (32, 3);
        let w = random_gguf(WeightFormat::Q8_0, rows * nb, &mut rng);
        let packed = interleave::<Q8_0>(&w, rows);
        for isa in Isa::available() {
            let mut wide = Vec::new();
            widen(isa, &packed, nb, &mut wide);
            assert_eq!(wide.len(), 2 * nb * GROUP_BLOCK, "{isa:?}");
            for row in 0..rows {
                for b in 0..nb {
                    let src = &w[(row * nb + b) * 34..][..34];
                    let gb = &wide[((row / GROUP) * nb + b) * GROUP_BLOCK..][..GROUP_BLOCK];
                    let j = row % GROUP;
                    assert_eq!(&gb[2 * j..2 * j + 2], &src[..2], "{isa:?}");
                    for i in 0..BLOCK_ELEMS {
                        assert_eq!(
                            quant(gb, j, i),
                            src[2 + i] as i8 as i16,
                            "{isa:?} {row} {i}"
                        );
                    }
                }
            }
        }
    }
}
