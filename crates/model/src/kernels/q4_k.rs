//! Q4_K and Q5_K weights (256 per block: f16 d and dmin, twelve bytes of 6-bit scales and mins,
//! 4-bit quants, and for Q5_K a fifth bit per value) against Q8_K activations, with the
//! arithmetic of ggml's repacked Q4_K gemv, `ggml_gemv_q4_K_8x8_q8_K` (what llama.cpp's x86 CPU
//! backend runs for Q4_K weights on a single activation row), for every row whatever the number
//! of rows. A row's dot product is made of exact integers per block, `Σ_j scale_j Σ q·a` and
//! `Σ_j min_j q8s_j` (`q8s_j` the activation's sum over sub-block `j`), each taken into its own
//! f32 accumulator by one fused multiply-add per block (256 values) with `d·da` and `dmin·da`;
//! the row's result is the first minus the second. Q5_K's quants (0..31) are a Q4_K quant plus
//! 16 times its fifth bit, so it runs the same kernels with the same order of steps, its fifth
//! bits or'ed into each step's nibbles as they are unpacked.
//!
//! The weight is interleaved at load, sixteen rows per group (as Q8_0): per block the sixteen d,
//! the sixteen dmin, the scales and mins unpacked to bytes, then 32 steps of sixteen rows × four
//! quant bytes (and for Q5_K eight registers of sixteen rows × four bytes of fifth bits). One
//! VNNI instruction multiplies four quants of all sixteen rows (low nibbles: sub-block `2c`; high
//! nibbles: `2c + 1`) by the same four activation values, so every integer ends in its row's
//! lane with no horizontal adds.

use half::f16;

use super::activations::{quantize_q8_k, Q8KBlock};
#[cfg(target_arch = "x86_64")]
use super::with_act_rows;
use super::{Isa, Kernel, TileOut};

pub(crate) const BLOCK_ELEMS: usize = 256;
const GROUP: usize = 16;
/// Offsets in a group block: sixteen f16 d, sixteen f16 dmin, scale `j` of row `r` at
/// `SCALES + 16 j + r`, mins `2m, 2m + 1` of row `r` at `MINS + 32 m + 2 r`, step `t` (quant
/// bytes `4t..4t + 4` of every row) at `QS + 64 t`, and for Q5_K the fifth bits: GGUF `qh`
/// bytes `4t..4t + 4` of every row at `QH + 64 t` (bit `j` of `qh[i]` is value `i` of sub-block
/// `j`'s).
const D: usize = 0;
const DMIN: usize = 2 * GROUP;
const SCALES: usize = 4 * GROUP;
const MINS: usize = SCALES + 8 * GROUP;
const QS: usize = MINS + 8 * GROUP;
const QH: usize = QS + 128 * GROUP;

/// Q4_K (`FIFTH_BIT` false) or Q5_K rows in the order of ggml's `ggml_gemv_q4_K_8x8_q8_K`.
pub(crate) struct KQuant<const FIFTH_BIT: bool>;
pub(crate) type Q4K = KQuant<false>;
pub(crate) type Q5K = KQuant<true>;

impl<const FIFTH_BIT: bool> KQuant<FIFTH_BIT> {
    /// A GGUF block.
    pub(crate) const GGUF_BLOCK_BYTES: usize = if FIFTH_BIT { 176 } else { 144 };
    /// Where a GGUF block's nibbles start (after Q5_K's 32 bytes of fifth bits, `qh`).
    const GGUF_QS: usize = if FIFTH_BIT { 48 } else { 16 };
    /// Where a Q5_K GGUF block's fifth bits start.
    const GGUF_QH: usize = 16;
    /// Bytes per row and block in the interleaved layout (the scales and mins take a byte
    /// each).
    pub(crate) const BLOCK_BYTES: usize = Self::GGUF_BLOCK_BYTES + 4;
    const GROUP_BLOCK: usize = GROUP * Self::BLOCK_BYTES;
}

impl<const FIFTH_BIT: bool> Kernel for KQuant<FIFTH_BIT> {
    type Batched = Self;
    type Act = Q8KBlock;
    const BLOCK_ELEMS: usize = BLOCK_ELEMS;
    const BLOCK_BYTES: usize = Self::BLOCK_BYTES;
    const ROW_GROUP: usize = GROUP;

    fn quantize(_isa: Isa, x: &[f32], out: &mut [Q8KBlock]) {
        quantize_q8_k(x, out);
    }

    fn scalar(w: &[u8], acts: &[Self::Act], nb: usize, out: TileOut<'_>) {
        scalar::<FIFTH_BIT>(w, acts, nb, out);
    }

    #[cfg(target_arch = "x86_64")]
    unsafe fn simd(isa: Isa, w: &[u8], acts: &[Self::Act], nb: usize, out: TileOut<'_>) {
        let na = acts.len() / nb;
        // SAFETY: the caller's guarantees, passed on.
        unsafe {
            match isa {
                Isa::Avx512 => {
                    with_act_rows!(na, x86::avx512_rows[FIFTH_BIT](w, acts, nb, out))
                }
                _ => with_act_rows!(na, x86::avx2_rows[FIFTH_BIT](w, acts, nb, out)),
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

/// The twelve GGUF bytes holding these scales (0..8) and mins (8..16): `scales_and_mins`
/// undone.
fn pack_scales_and_mins(sm: &[u8]) -> [u8; 12] {
    let (sc, mn) = (&sm[..8], &sm[8..]);
    let mut q = [0u8; 12];
    for j in 0..4 {
        q[j] = sc[j] | (sc[j + 4] >> 4) << 6;
        q[j + 4] = mn[j] | (mn[j + 4] >> 4) << 6;
        q[j + 8] = (sc[j + 4] & 0xf) | (mn[j + 4] & 0xf) << 4;
    }
    q
}

impl<const FIFTH_BIT: bool> KQuant<FIFTH_BIT> {
    /// GGUF rows (`out_dim` of them) in the interleaved layout, padded with zero rows to a
    /// whole group.
    pub(crate) fn interleave(gguf: &[u8], out_dim: usize) -> Vec<u8> {
        let nb = gguf.len() / (out_dim * Self::GGUF_BLOCK_BYTES);
        let groups = out_dim.div_ceil(GROUP);
        let mut packed = vec![0u8; groups * nb * Self::GROUP_BLOCK];
        for (gb, dst) in packed.chunks_exact_mut(Self::GROUP_BLOCK).enumerate() {
            let (g, b) = (gb / nb, gb % nb);
            for r in 0..GROUP {
                let row = g * GROUP + r;
                if row >= out_dim {
                    continue;
                }
                let src =
                    &gguf[(row * nb + b) * Self::GGUF_BLOCK_BYTES..][..Self::GGUF_BLOCK_BYTES];
                dst[D + 2 * r..D + 2 * r + 2].copy_from_slice(&src[0..2]);
                dst[DMIN + 2 * r..DMIN + 2 * r + 2].copy_from_slice(&src[2..4]);
                let sm = scales_and_mins(src);
                for j in 0..8 {
                    dst[SCALES + GROUP * j + r] = sm[j];
                    dst[MINS + 32 * (j / 2) + 2 * r + j % 2] = sm[8 + j];
                }
                for (i, &q) in src[Self::GGUF_QS..].iter().enumerate() {
                    dst[QS + 64 * (i / 4) + 4 * r + i % 4] = q;
                }
                if FIFTH_BIT {
                    for (i, &h) in src[Self::GGUF_QH..Self::GGUF_QS].iter().enumerate() {
                        dst[QH + 64 * (i / 4) + 4 * r + i % 4] = h;
                    }
                }
            }
        }
        packed
    }

    /// Rows `rows` of an interleaved weight (`in_dim` wide) as GGUF blocks.
    pub(crate) fn gguf_rows(w: &[u8], in_dim: usize, rows: &[usize]) -> Vec<u8> {
        let nb = in_dim / BLOCK_ELEMS;
        let (block, group_block) = (Self::GGUF_BLOCK_BYTES, Self::GROUP_BLOCK);
        let mut out = vec![0u8; rows.len() * nb * block];
        for (dst, &row) in out.chunks_exact_mut(nb * block).zip(rows) {
            let (g, r) = (row / GROUP, row % GROUP);
            let group = &w[g * nb * group_block..(g + 1) * nb * group_block];
            for (gb, dst) in group
                .chunks_exact(group_block)
                .zip(dst.chunks_exact_mut(block))
            {
                dst[0..2].copy_from_slice(&gb[D + 2 * r..D + 2 * r + 2]);
                dst[2..4].copy_from_slice(&gb[DMIN + 2 * r..DMIN + 2 * r + 2]);
                let sm: [u8; 16] = std::array::from_fn(|k| {
                    if k < 8 {
                        gb[SCALES + GROUP * k + r]
                    } else {
                        gb[MINS + 32 * ((k - 8) / 2) + 2 * r + k % 2]
                    }
                });
                dst[4..16].copy_from_slice(&pack_scales_and_mins(&sm));
                for (i, q) in dst[Self::GGUF_QS..].iter_mut().enumerate() {
                    *q = gb[QS + 64 * (i / 4) + 4 * r + i % 4];
                }
                if FIFTH_BIT {
                    for (i, h) in dst[Self::GGUF_QH..Self::GGUF_QS].iter_mut().enumerate() {
                        *h = gb[QH + 64 * (i / 4) + 4 * r + i % 4];
                    }
                }
            }
        }
        out
    }
}

fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// Value `i` (0..32) of sub-block `j` of row `r` of a group block: its nibble, and for Q5_K its
/// fifth bit.
fn quant<const FIFTH_BIT: bool>(gb: &[u8], r: usize, j: usize, i: usize) -> i32 {
    let byte = 32 * (j / 2) + i;
    let q = gb[QS + 64 * (byte / 4) + 4 * r + byte % 4];
    let low = if j.is_multiple_of(2) { q & 0xf } else { q >> 4 };
    let fifth = if FIFTH_BIT {
        gb[QH + 64 * (i / 4) + 4 * r + i % 4] >> j & 1
    } else {
        0
    };
    (low | fifth << 4) as i32
}

/// The reference: ggml's repacked Q4_K gemv arithmetic, row by row.
fn scalar<const FIFTH_BIT: bool>(w: &[u8], acts: &[Q8KBlock], nb: usize, out: TileOut<'_>) {
    let group_block = KQuant::<FIFTH_BIT>::GROUP_BLOCK;
    for (g, group) in w.chunks_exact(nb * group_block).enumerate() {
        for (a, arow) in acts.chunks_exact(nb).enumerate() {
            for r in 0..GROUP {
                let (mut acc, mut acc_min) = (0f32, 0f32);
                for (gb, ab) in group.chunks_exact(group_block).zip(arow) {
                    let d = f16_at(gb, D + 2 * r) * ab.d;
                    let dmin = f16_at(gb, DMIN + 2 * r) * ab.d;
                    let (mut isum, mut msum) = (0i32, 0i32);
                    for j in 0..8 {
                        let sub: i32 = (0..32)
                            .map(|i| quant::<FIFTH_BIT>(gb, r, j, i) * ab.qs[32 * j + i] as i32)
                            .sum();
                        isum += gb[SCALES + GROUP * j + r] as i32 * sub;
                        let min = gb[MINS + 32 * (j / 2) + 2 * r + j % 2];
                        msum += min as i32 * ab.sums32[j] as i32;
                    }
                    acc = (isum as f32).mul_add(d, acc);
                    acc_min = (msum as f32).mul_add(dmin, acc_min);
                }
                out.set(a, g * GROUP + r, acc - acc_min);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{KQuant, Q8KBlock, TileOut, D, DMIN, GROUP, MINS, QH, QS, SCALES};

    /// Step `step` of half `h` (rows `8h..8h + 8`) of the group block at `p`: four quant bytes
    /// of each row as the values of sub-block `2c` (low nibbles) and `2c + 1` (high nibbles),
    /// `c = step / 8`, with Q5_K's fifth bits.
    ///
    /// # Safety
    /// `p` points to a whole group block.
    #[target_feature(enable = "avx2")]
    #[inline]
    unsafe fn step_avx2<const FIFTH_BIT: bool>(
        p: *const u8,
        step: usize,
        h: usize,
    ) -> (__m256i, __m256i) {
        let m4 = _mm256_set1_epi8(0xf);
        // SAFETY: step `step` of half `h` is 32 bytes inside the block.
        let q = unsafe { _mm256_loadu_si256(p.add(QS + 64 * step + 32 * h) as *const __m256i) };
        let lo = _mm256_and_si256(q, m4);
        let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(q), m4);
        if !FIFTH_BIT {
            return (lo, hi);
        }
        // SAFETY: the fifth bits of the step's values, half `h`, are 32 bytes inside the block.
        let qh =
            unsafe { _mm256_loadu_si256(p.add(QH + 64 * (step % 8) + 32 * h) as *const __m256i) };
        // Bits 2c and 2c + 1 of every byte down to bits 0 and 1 (a 16-bit shift by at most 6
        // brings no bit of the other byte below bit 2).
        let bits = _mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * (step / 8) as i32));
        let fifth_lo = _mm256_slli_epi16::<4>(_mm256_and_si256(bits, _mm256_set1_epi8(1)));
        let fifth_hi = _mm256_slli_epi16::<3>(_mm256_and_si256(bits, _mm256_set1_epi8(2)));
        (_mm256_or_si256(lo, fifth_lo), _mm256_or_si256(hi, fifth_hi))
    }

    /// [`step_avx2`] for all sixteen rows.
    ///
    /// # Safety
    /// `p` points to a whole group block.
    #[target_feature(enable = "avx512f,avx512bw")]
    #[inline]
    unsafe fn step_avx512<const FIFTH_BIT: bool>(p: *const u8, step: usize) -> (__m512i, __m512i) {
        let m4 = _mm512_set1_epi8(0xf);
        // SAFETY: step `step` is 64 bytes inside the group block.
        let q = unsafe { _mm512_loadu_si512(p.add(QS + 64 * step) as *const __m512i) };
        let lo = _mm512_and_si512(q, m4);
        let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(q), m4);
        if !FIFTH_BIT {
            return (lo, hi);
        }
        // SAFETY: the fifth bits of the step's values are 64 bytes inside the group block.
        let qh = unsafe { _mm512_loadu_si512(p.add(QH + 64 * (step % 8)) as *const __m512i) };
        let bit = 1u8 << (2 * (step / 8));
        let (on_lo, on_hi) = (
            _mm512_test_epi8_mask(qh, _mm512_set1_epi8(bit as i8)),
            _mm512_test_epi8_mask(qh, _mm512_set1_epi8((bit << 1) as i8)),
        );
        let sixteen = _mm512_set1_epi8(16);
        (
            _mm512_mask_add_epi8(lo, on_lo, lo, sixteen),
            _mm512_mask_add_epi8(hi, on_hi, hi, sixteen),
        )
    }

    /// Four activation values (from byte `at`) as one i32, broadcast.
    #[inline(always)]
    fn four(ab: &Q8KBlock, at: usize) -> i32 {
        super::super::four_values(&ab.qs, at)
    }

    /// The activation's sums of sub-blocks `2m` and `2m + 1` as one i32 (two i16), broadcast.
    #[inline(always)]
    fn sums_pair(ab: &Q8KBlock, m: usize) -> i32 {
        let (lo, hi) = (ab.sums32[2 * m] as u16, ab.sums32[2 * m + 1] as u16);
        (lo as u32 | (hi as u32) << 16) as i32
    }

    /// No VNNI: half a group (eight rows) per register; four quants times four activation
    /// values through `maddubs` (unsigned 4-bit times signed, exact in i16) and `madd`.
    /// `acc += (sums.0 as f32) * (dw·da)`, `acc_min += (sums.1 as f32) * (dmin·da)`, each one
    /// FMA, for eight rows: one step of the repacked kernels' two accumulators.
    #[target_feature(enable = "avx2,fma")]
    fn fold8(
        acc: &mut __m256,
        acc_min: &mut __m256,
        sums: (__m256i, __m256i),
        scales: (__m256, __m256),
        da: f32,
    ) {
        let da = _mm256_set1_ps(da);
        let (i, m) = (_mm256_cvtepi32_ps(sums.0), _mm256_cvtepi32_ps(sums.1));
        *acc = _mm256_fmadd_ps(i, _mm256_mul_ps(scales.0, da), *acc);
        *acc_min = _mm256_fmadd_ps(m, _mm256_mul_ps(scales.1, da), *acc_min);
    }

    /// `fold8` for sixteen rows.
    #[target_feature(enable = "avx512f")]
    fn fold16(
        acc: &mut __m512,
        acc_min: &mut __m512,
        sums: (__m512i, __m512i),
        scales: (__m512, __m512),
        da: f32,
    ) {
        let da = _mm512_set1_ps(da);
        let (i, m) = (_mm512_cvtepi32_ps(sums.0), _mm512_cvtepi32_ps(sums.1));
        *acc = _mm512_fmadd_ps(i, _mm512_mul_ps(scales.0, da), *acc);
        *acc_min = _mm512_fmadd_ps(m, _mm512_mul_ps(scales.1, da), *acc_min);
    }

    /// A run of steps from `first` (of sub-blocks `2c` and `2c + 1`, `c = first / 8`) into
    /// the rows' integer sums: the products of the low and of the high nibbles add up in i16,
    /// then one `madd` each by the sub-block's scale.
    ///
    /// # Safety
    /// `p` points to a whole group block.
    #[target_feature(enable = "avx2")]
    #[inline]
    unsafe fn run_sums<const NA: usize, const FIFTH_BIT: bool>(
        p: *const u8,
        h: usize,
        steps: std::ops::Range<usize>,
        ab: &[&Q8KBlock; NA],
        sc: &[__m256i; 2],
        isum: &mut [__m256i; NA],
    ) {
        let c = steps.start / 8;
        let mut sum16 = [[_mm256_setzero_si256(); 2]; NA];
        for step in steps {
            let t = step % 8;
            // SAFETY: `p` is a whole group block.
            let (lo, hi) = unsafe { step_avx2::<FIFTH_BIT>(p, step, h) };
            for (sum16, ab) in sum16.iter_mut().zip(ab) {
                let x = _mm256_set1_epi32(four(ab, 64 * c + 4 * t));
                sum16[0] = _mm256_add_epi16(sum16[0], _mm256_maddubs_epi16(lo, x));
                let x = _mm256_set1_epi32(four(ab, 64 * c + 32 + 4 * t));
                sum16[1] = _mm256_add_epi16(sum16[1], _mm256_maddubs_epi16(hi, x));
            }
        }
        for (isum, sum16) in isum.iter_mut().zip(sum16) {
            let lo = _mm256_madd_epi16(sum16[0], sc[0]);
            let hi = _mm256_madd_epi16(sum16[1], sc[1]);
            *isum = _mm256_add_epi32(*isum, _mm256_add_epi32(lo, hi));
        }
    }

    /// Eight rows (half a group) per register; each step's quants (four bytes of every row:
    /// low nibbles of sub-block `2c`, high of `2c + 1`) made once for all `NA` activation rows,
    /// multiplied by four activation values through `maddubs` (unsigned quant times signed,
    /// exact in i16). A sub-block's products add up in i16 (a run of eight steps for Q4_K,
    /// `8 · 2 · 15 · 127 < 2^15`; of four for Q5_K, `4 · 2 · 31 · 127 < 2^15`) before one
    /// `madd` by the sub-block's scale (twice per row lane) into the row's integer sum: a
    /// multiply per 32 products where a `madd` every step took two.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn avx2_rows<const NA: usize, const FIFTH_BIT: bool>(
        w: &[u8],
        acts: &[Q8KBlock],
        nb: usize,
        out: TileOut<'_>,
    ) {
        let group_block = KQuant::<FIFTH_BIT>::GROUP_BLOCK;
        let run = if FIFTH_BIT { 4 } else { 8 };
        // A loop LLVM does not unroll for several activation rows: unrolled, it hoists the
        // steps' quants ahead of their uses and spills them.
        let runs = if NA == 1 {
            8 / run
        } else {
            std::hint::black_box(8 / run)
        };
        for (g, group) in w.chunks_exact(nb * group_block).enumerate() {
            for h in 0..2 {
                let mut acc = [_mm256_setzero_ps(); NA];
                let mut acc_min = [_mm256_setzero_ps(); NA];
                for (b, gb) in group.chunks_exact(group_block).enumerate() {
                    let p = gb.as_ptr();
                    let ab: [&Q8KBlock; NA] = std::array::from_fn(|a| &acts[a * nb + b]);
                    let mut isum = [_mm256_setzero_si256(); NA];
                    for c in 0..4 {
                        // Sub-block `2c + k`'s scale of rows 8h.., in both i16 halves of the
                        // row's lane.
                        let sc = [0, 1].map(|k| {
                            // SAFETY: eight scale bytes of sub-block `2c + k` inside the block.
                            let v = _mm256_cvtepu8_epi32(unsafe {
                                _mm_loadl_epi64(
                                    p.add(SCALES + GROUP * (2 * c + k) + 8 * h) as *const __m128i
                                )
                            });
                            _mm256_or_si256(v, _mm256_slli_epi32::<16>(v))
                        });
                        for r in 0..runs {
                            let first = 8 * c + run * (r % (8 / run));
                            // SAFETY: `p` is a whole group block.
                            unsafe {
                                run_sums::<NA, FIFTH_BIT>(
                                    p,
                                    h,
                                    first..first + run,
                                    &ab,
                                    &sc,
                                    &mut isum,
                                )
                            };
                        }
                    }
                    // SAFETY: d and dmin of rows 8h.. are inside the block.
                    let (dw, dminw) = unsafe {
                        (
                            _mm256_cvtph_ps(_mm_loadu_si128(p.add(D + 16 * h) as *const __m128i)),
                            _mm256_cvtph_ps(
                                _mm_loadu_si128(p.add(DMIN + 16 * h) as *const __m128i),
                            ),
                        )
                    };
                    for a in 0..NA {
                        let mut msum = _mm256_setzero_si256();
                        for c in 0..4 {
                            // SAFETY: mins of sub-blocks 2c and 2c + 1, rows 8h...
                            let mins = _mm256_cvtepu8_epi16(unsafe {
                                _mm_loadu_si128(p.add(MINS + 32 * c + 16 * h) as *const __m128i)
                            });
                            let pair = _mm256_set1_epi32(sums_pair(ab[a], c));
                            msum = _mm256_add_epi32(msum, _mm256_madd_epi16(mins, pair));
                        }
                        let (acc, acc_min) = (&mut acc[a], &mut acc_min[a]);
                        fold8(acc, acc_min, (isum[a], msum), (dw, dminw), ab[a].d);
                    }
                }
                for a in 0..NA {
                    let y = _mm256_sub_ps(acc[a], acc_min[a]);
                    _mm256_storeu_ps(out.at(a, g * GROUP + 8 * h), y);
                }
            }
        }
    }

    /// A whole group per register. Few activation rows get more partial sums per sub-block, so
    /// the VNNI chains stay short enough to overlap.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(super) unsafe fn avx512_rows<const NA: usize, const FIFTH_BIT: bool>(
        w: &[u8],
        acts: &[Q8KBlock],
        nb: usize,
        out: TileOut<'_>,
    ) {
        let group_block = KQuant::<FIFTH_BIT>::GROUP_BLOCK;
        // Partial sums per sub-block and activation row: at least eight VNNI chains.
        let chains = match NA {
            1 => 4,
            2 => 2,
            _ => 1,
        };
        for (g, group) in w.chunks_exact(nb * group_block).enumerate() {
            let mut acc = [_mm512_setzero_ps(); NA];
            let mut acc_min = [_mm512_setzero_ps(); NA];
            for (b, gb) in group.chunks_exact(group_block).enumerate() {
                let p = gb.as_ptr();
                // SAFETY: d and dmin are inside the group block.
                let (dw, dminw) = unsafe {
                    (
                        _mm512_cvtph_ps(_mm256_loadu_si256(p.add(D) as *const __m256i)),
                        _mm512_cvtph_ps(_mm256_loadu_si256(p.add(DMIN) as *const __m256i)),
                    )
                };
                let mut isum = [_mm512_setzero_si512(); NA];
                let mut msum = [_mm512_setzero_si512(); NA];
                for c in 0..4 {
                    let mut sub = [[[_mm512_setzero_si512(); 4]; 2]; NA];
                    // Step `t` into partial sum `chain` (constants, so the sums stay in
                    // registers).
                    macro_rules! step {
                        ($t:expr, $chain:expr) => {{
                            let t = $t;
                            // SAFETY: `p` is a whole group block.
                            let (lo, hi) = unsafe { step_avx512::<FIFTH_BIT>(p, 8 * c + t) };
                            for (a, sub) in sub.iter_mut().enumerate() {
                                let ab = &acts[a * nb + b];
                                let x = _mm512_set1_epi32(four(ab, 64 * c + 4 * t));
                                sub[0][$chain] = _mm512_dpbusd_epi32(sub[0][$chain], lo, x);
                                let x = _mm512_set1_epi32(four(ab, 64 * c + 32 + 4 * t));
                                sub[1][$chain] = _mm512_dpbusd_epi32(sub[1][$chain], hi, x);
                            }
                        }};
                    }
                    step!(0, 0);
                    step!(1, 1 % chains);
                    step!(2, 2 % chains);
                    step!(3, 3 % chains);
                    step!(4, 0);
                    step!(5, 1 % chains);
                    step!(6, 2 % chains);
                    step!(7, 3 % chains);
                    // SAFETY: the sixteen scales of sub-blocks 2c and 2c + 1, and their mins.
                    let (sc, mins) = unsafe {
                        (
                            [0, 1].map(|k| {
                                _mm512_cvtepu8_epi32(_mm_loadu_si128(
                                    p.add(SCALES + GROUP * (2 * c + k)) as *const __m128i,
                                ))
                            }),
                            _mm512_cvtepu8_epi16(_mm256_loadu_si256(
                                p.add(MINS + 32 * c) as *const __m256i
                            )),
                        )
                    };
                    for (a, sub) in sub.iter().enumerate() {
                        let ab = &acts[a * nb + b];
                        let mut isum_c = _mm512_setzero_si512();
                        for (sub, sc) in sub.iter().zip(sc) {
                            let s = _mm512_add_epi32(
                                _mm512_add_epi32(sub[0], sub[1]),
                                _mm512_add_epi32(sub[2], sub[3]),
                            );
                            isum_c = _mm512_add_epi32(isum_c, _mm512_mullo_epi32(s, sc));
                        }
                        let pair = _mm512_set1_epi32(sums_pair(ab, c));
                        let msum_c = _mm512_madd_epi16(mins, pair);
                        isum[a] = _mm512_add_epi32(isum[a], isum_c);
                        msum[a] = _mm512_add_epi32(msum[a], msum_c);
                    }
                }
                for a in 0..NA {
                    let (acc, acc_min) = (&mut acc[a], &mut acc_min[a]);
                    let da = acts[a * nb + b].d;
                    fold16(acc, acc_min, (isum[a], msum[a]), (dw, dminw), da);
                }
            }
            for a in 0..NA {
                let y = _mm512_sub_ps(acc[a], acc_min[a]);
                _mm512_storeu_ps(out.at(a, g * GROUP), y);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_util::{
        check_dequantized_as_candle, check_paths_agree, random_gguf, Rng,
    };
    use super::super::{matmul, prepare, WeightFormat};
    use super::*;

    /// Random GGUF blocks of Q4_K (`FIFTH_BIT` false) or Q5_K.
    fn random_weights<const FIFTH_BIT: bool>(rng: &mut Rng, rows: usize, nb: usize) -> Vec<u8> {
        let format = if FIFTH_BIT {
            WeightFormat::Q5K
        } else {
            WeightFormat::Q4K
        };
        random_gguf(format, rows * nb, rng)
    }

    #[test]
    fn simd_paths_equal_scalar_reference_bit_for_bit() {
        let mut rng = Rng::new(4);
        for format in [WeightFormat::Q4K, WeightFormat::Q5K] {
            for (rows, nb) in [(1, 1), (5, 3), (16, 2), (37, 2)] {
                let w = random_gguf(format, rows * nb, &mut rng);
                check_paths_agree(format, &w, nb * BLOCK_ELEMS, rows, &mut rng);
            }
        }
    }

    /// The largest Q5_K products (every quant 31, every scale 63, activations ±127) stay exact
    /// on every path, in i16 pairs as in the blocks' i32 sums.
    #[test]
    fn extreme_values_stay_exact() {
        let (rows, nb) = (16, 2);
        // Every quant, scale and min at its largest (Q4_K 15, Q5_K 31; 63), against
        // activations all ±127: the i16 runs of products at their bound.
        for (format, bytes) in [(WeightFormat::Q4K, 140), (WeightFormat::Q5K, 172)] {
            let mut w = Vec::new();
            for _ in 0..rows * nb {
                w.extend_from_slice(&f16::from_f32(0.01).to_le_bytes());
                w.extend_from_slice(&f16::from_f32(0.02).to_le_bytes());
                w.extend(std::iter::repeat_n(0xff, bytes));
            }
            let w = prepare(format, w, rows);
            let in_dim = nb * BLOCK_ELEMS;
            for sign in [1.0f32, -1.0] {
                let x = vec![sign; 9 * in_dim];
                let reference = matmul(format, Isa::Scalar, &w, in_dim, rows, &x);
                // Every row and column the same value, of `sign`'s sign.
                assert!(reference
                    .iter()
                    .all(|&v| v == reference[0] && v * sign > 0.0));
                for isa in Isa::available() {
                    let got = matmul(format, isa, &w, in_dim, rows, &x);
                    assert_eq!(got, reference, "{format:?} {isa:?} {sign}");
                }
            }
        }
    }

    /// ggml's `get_scale_min_k4`: scale and min of sub-block `j` from the twelve packed bytes.
    fn scale_min_k4(j: usize, q: &[u8]) -> (i32, i32) {
        if j < 4 {
            ((q[j] & 63) as i32, (q[j + 4] & 63) as i32)
        } else {
            (
                ((q[j + 4] & 0xf) | ((q[j - 4] >> 6) << 4)) as i32,
                ((q[j + 4] >> 4) | ((q[j] >> 6) << 4)) as i32,
            )
        }
    }

    /// The kernel's formula written directly on GGUF blocks and activation quants: one
    /// multiply-add per block for the scaled quants and one for the mins.
    fn straightforward<const FIFTH_BIT: bool>(wrow: &[u8], arow: &[Q8KBlock]) -> f32 {
        let (mut acc, mut acc_min) = (0f32, 0f32);
        let block = KQuant::<FIFTH_BIT>::GGUF_BLOCK_BYTES;
        for (wb, ab) in wrow.chunks_exact(block).zip(arow) {
            let d = f16::from_le_bytes([wb[0], wb[1]]).to_f32();
            let dmin = f16::from_le_bytes([wb[2], wb[3]]).to_f32();
            let (mut isum, mut msum) = (0i32, 0i32);
            for j in 0..8 {
                let (scale, min) = scale_min_k4(j, &wb[4..16]);
                let mut dot = 0i32;
                for i in 0..32 {
                    // Value 32j + i: byte 32 (j / 2) + i of the nibbles, low nibble for even j;
                    // Q5_K's fifth bit is bit j of qh[i] (ggml's `dequantize_row_q5_K`).
                    let byte = wb[KQuant::<FIFTH_BIT>::GGUF_QS + 32 * (j / 2) + i];
                    let mut q = if j % 2 == 0 { byte & 0xf } else { byte >> 4 };
                    if FIFTH_BIT {
                        q |= (wb[16 + i] >> j & 1) << 4;
                    }
                    dot += q as i32 * ab.qs[32 * j + i] as i32;
                }
                isum += scale * dot;
                let q8s: i32 = ab.qs[32 * j..32 * j + 32].iter().map(|&v| v as i32).sum();
                msum += min * q8s;
            }
            acc = (isum as f32).mul_add(d * ab.d, acc);
            acc_min = (msum as f32).mul_add(dmin * ab.d, acc_min);
        }
        acc - acc_min
    }

    fn check_scalar_reference<const FIFTH_BIT: bool>(seed: u64) {
        let mut rng = Rng::new(seed);
        let (rows, nb, na) = (21, 3, 3);
        let w = random_weights::<FIFTH_BIT>(&mut rng, rows, nb);
        let x: Vec<f32> = (0..na * nb * BLOCK_ELEMS)
            .map(|i| rng.uniform() * (1 + i % 5) as f32)
            .collect();
        let mut acts = vec![Q8KBlock::default(); na * nb];
        quantize_q8_k(&x, &mut acts);
        let packed = KQuant::<FIFTH_BIT>::interleave(&w, rows);
        let stride = packed.len() / (nb * KQuant::<FIFTH_BIT>::BLOCK_BYTES);
        let mut out = vec![0f32; na * stride];
        scalar::<FIFTH_BIT>(&packed, &acts, nb, TileOut::buffer(&mut out, na, stride));
        let block = KQuant::<FIFTH_BIT>::GGUF_BLOCK_BYTES;
        for (a, arow) in acts.chunks_exact(nb).enumerate() {
            for (r, wrow) in w.chunks_exact(nb * block).enumerate() {
                let want = straightforward::<FIFTH_BIT>(wrow, arow);
                assert_eq!(
                    out[a * stride + r].to_bits(),
                    want.to_bits(),
                    "act {a} row {r}"
                );
            }
        }
    }

    #[test]
    fn scalar_reference_is_the_repacked_ggml_formula() {
        check_scalar_reference::<false>(14);
        check_scalar_reference::<true>(16);
    }

    fn check_interleaving<const FIFTH_BIT: bool>(seed: u64) {
        let mut rng = Rng::new(seed);
        let (rows, nb) = (19, 2);
        let w = random_weights::<FIFTH_BIT>(&mut rng, rows, nb);
        let packed = KQuant::<FIFTH_BIT>::interleave(&w, rows);
        assert_eq!(
            packed.len(),
            2 * GROUP * nb * KQuant::<FIFTH_BIT>::BLOCK_BYTES
        );
        let picked = [18, 0, 7, 16, 7];
        let back = KQuant::<FIFTH_BIT>::gguf_rows(&packed, nb * BLOCK_ELEMS, &picked);
        let row = nb * KQuant::<FIFTH_BIT>::GGUF_BLOCK_BYTES;
        for (i, &r) in picked.iter().enumerate() {
            assert_eq!(back[i * row..(i + 1) * row], w[r * row..(r + 1) * row]);
        }
        // Padding rows are zero blocks.
        let pad = KQuant::<FIFTH_BIT>::gguf_rows(&packed, nb * BLOCK_ELEMS, &[31]);
        assert!(pad.iter().all(|&b| b == 0));
    }

    #[test]
    fn interleaving_keeps_every_row() {
        check_interleaving::<false>(15);
        check_interleaving::<true>(17);
    }

    #[test]
    fn reads_gguf_blocks_as_candle_does() {
        check_dequantized_as_candle(WeightFormat::Q4K, &mut Rng::new(18));
        check_dequantized_as_candle(WeightFormat::Q5K, &mut Rng::new(19));
    }
}
