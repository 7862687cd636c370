//! Weights whose blocks of 32 values pair with Q8_0 activations: Q8_0 (f16 scale + 32 i8), Q5_0
//! and Q4_0 (f16 scale + 32 five- or four-bit values, see `q5_0`): one f32 accumulator per
//! (row, column), taking each block's exact integer dot product `Σ w_i a_i` (32 values) by one
//! fused multiply-add, `acc = fma(dw·da, Σ w a, acc)`, blocks in order. (Until issue 11 this
//! kernel kept ggml's order, eight f32 lanes per row and `hsum_float_8`, which took eight
//! conversions and multiply-adds per block where this takes one: batched matmuls ran about 1.4x
//! slower.)
//!
//! The weight is interleaved at load: sixteen rows per group, each block stored as the sixteen
//! f16 scales, then the quants in the format's own packing ([`Format`]), which the kernels
//! unpack into eight steps of sixteen rows × four quants, made unsigned (`w + 128`). One step
//! multiplies four quants of every row of a register by the same four activation values, so
//! each row's integer sum ends in its own lane, with no horizontal adds: AVX-512 VNNI takes
//! sixteen rows per instruction, from a starting value that takes `128 Σ a` back out; AVX2
//! eight, through ggml's sign trick (batches of 16 rows or more widen each slice to 16-bit
//! pairs instead, see `q8_0_pairs`; Q5_0 and Q4_0 batches to bytes `w + 16`, [`FiveBitBytes`];
//! against pair-bound activations the stored bytes serve as they are, [`Q8_0PairBound`]). The
//! integer sum of a block is exact whatever the order of its steps, so every path gives the
//! scalar reference's bits, and a Q5_0 or Q4_0 weight gives the bits its values would give as
//! Q8_0.

use std::marker::PhantomData;

use half::f16;
use rayon::prelude::*;

use super::activations::{quantize_gradient, quantize_q8_0, quantize_q8_0_pair_bound, Q8_0Block};
#[cfg(target_arch = "x86_64")]
use super::with_act_rows;
use super::{q8_0_pairs, Isa, Kernel, TileOut};
use q8_0_pairs::Q8_0Pairs;

pub(crate) const BLOCK_ELEMS: usize = 32;
/// GGUF Q8_0 block: f16 scale, 32 quants; the interleaved layout keeps 34 bytes per row and block.
pub(crate) const BLOCK_BYTES: usize = 34;
const GROUP: usize = 16;
/// Bytes of the sixteen f16 scales that open every group block.
const SCALES: usize = 2 * GROUP;

/// A weight format these kernels read: how its GGUF blocks are interleaved, sixteen rows per
/// group block (the scales first, then the quants), and how the kernels get the quants back.
pub(crate) trait Format: Send + Sync + 'static {
    /// Bytes of one GGUF block, which the interleaved layout keeps per row and block.
    const BLOCK_BYTES: usize;
    /// The kernel batches run on where [`Format::widens`] (see [`Kernel::Batched`]).
    type Batched: Kernel;
    /// Fewest activation rows for which a batch runs on `Batched` (see
    /// [`Kernel::WIDEN_MIN_ROWS`]).
    const WIDEN_MIN_ROWS: usize = super::ACT_TILE + 1;
    /// Whether batches run on `Batched` with instruction set `isa`.
    fn widens(_isa: Isa) -> bool {
        false
    }
    /// A slice of whole groups in `Batched`'s layout (see [`Kernel::widen`]).
    fn widen(_isa: Isa, _w: &[u8], _nb: usize, _out: &mut Vec<u8>) {
        unreachable!("a format that widens defines `widen`")
    }
    /// Whether every quant is five-bit and [`Format::unsigned_steps`] gives `w + 16` (0..=31)
    /// instead of `w + 128`: small enough that AVX2 adds four steps' products in i16.
    const FIVE_BIT: bool = false;
    /// Whether the activations are quantized pair-bound (`quantize_q8_0_pair_bound`), so that
    /// AVX2 multiplies the stored `w + 128` by them as they are (see [`Q8_0PairBound`]).
    const PAIR_BOUND: bool = false;
    /// What [`Format::avx2_unsigned_step`] adds to the quants: 16 for five-bit quants (the
    /// products of four steps add up in i16), 128 for Q8_0's stored bytes (of one step).
    const AVX2_UNSIGNED_OFFSET: i32;
    /// Bytes of one group block: sixteen rows' blocks.
    const GROUP_BLOCK: usize = GROUP * Self::BLOCK_BYTES;
    /// Quant `i` (of 32) of a GGUF block.
    fn gguf_quant(block: &[u8], i: usize) -> i8;
    /// Stores quant `i` of row `j` into a group block whose quant bytes start zeroed.
    fn put_quant(gb: &mut [u8], j: usize, i: usize, q: i8);
    /// Quant `i` of row `j` of a group block.
    fn quant(gb: &[u8], j: usize, i: usize) -> i8;
    /// Step `s` of half `h` (rows `8h..8h + 8`) of the group block at `p`: four quants of each
    /// row, signed (the unsigned step less its offset).
    ///
    /// # Safety
    /// `p` points to a whole group block; the CPU has AVX2.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn signed_step(p: *const u8, s: usize, h: usize) -> std::arch::x86_64::__m256i {
        use std::arch::x86_64::*;
        // SAFETY: passed on.
        let unsigned = unsafe { Self::avx2_unsigned_step(p, s, h) };
        _mm256_sub_epi8(unsigned, _mm256_set1_epi8(Self::AVX2_UNSIGNED_OFFSET as i8))
    }
    /// Step `s` of half `h` of the group block at `p`, every quant plus
    /// [`Format::AVX2_UNSIGNED_OFFSET`]: by default the stored bytes.
    ///
    /// # Safety
    /// `p` points to a whole group block; the CPU has AVX2.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn avx2_unsigned_step(p: *const u8, s: usize, h: usize) -> std::arch::x86_64::__m256i {
        use std::arch::x86_64::*;
        // SAFETY: step `s` of half `h` is 32 bytes inside the group block.
        unsafe { _mm256_loadu_si256(p.add(SCALES + 64 * s + 32 * h) as *const __m256i) }
    }
    /// Whether [`Format::unsigned_steps`] only loads the stored steps (no unpacking), so that a
    /// kernel can take one step where it uses it (see `avx512_two_groups`).
    const STEPS_STORED: bool = true;
    /// The group block's eight steps, every row's four quants made unsigned (`w + 128`, or
    /// `w + 16` where [`Format::FIVE_BIT`]).
    ///
    /// # Safety
    /// `p` points to a whole group block; the CPU has AVX-512 (F, BW).
    #[cfg(target_arch = "x86_64")]
    unsafe fn unsigned_steps(p: *const u8) -> [std::arch::x86_64::__m512i; 8];
}

/// Q8_0: after the scales, eight steps of sixteen rows × four quants, stored unsigned; with
/// `PAIR_BOUND`, against pair-bound activations ([`Q8_0PairBound`]).
pub(crate) struct Q8_0<const PAIR_BOUND: bool = false>;

/// Q8_0 weights against pair-bound activations (`quantize_q8_0_pair_bound`): the stored bytes
/// `w + 128` are `maddubs`'s unsigned operand as they are, so AVX2 takes 32 products by one
/// `maddubs` and one `madd` straight from the stored layout, where Q8_0 takes the sign trick or
/// slices widened to 16-bit pairs (`tile_throughput`, x86-64-v3 build, one host: 1.36x the sign
/// trick's speed, 1.10x the widened pairs' before their widening; the 32-client AVX2 LM head
/// ~10% faster in the server), both halves of a row group per pass (`avx2_rows_both_halves`).
/// AVX-512 runs as for Q8_0. The loader gives it the LM head (see
/// `Linear::with_pair_bound_activations`).
pub(crate) type Q8_0PairBound = Q8_0<true>;

impl<const PAIR_BOUND: bool> Format for Q8_0<PAIR_BOUND> {
    const BLOCK_BYTES: usize = BLOCK_BYTES;
    /// (Pair-bound activations never widen.)
    type Batched = Q8_0Pairs;
    const PAIR_BOUND: bool = PAIR_BOUND;
    const AVX2_UNSIGNED_OFFSET: i32 = 128;
    /// From 16 rows the widened slices win (`kernel_throughput`, x86-64-v3 build, alternated
    /// 3x): 16 rows of the LM head 9% faster, 16 rows of 640 x 32,768 the same.
    const WIDEN_MIN_ROWS: usize = 16;

    /// AVX2 has no signed-by-signed byte dot product: its batches take 16-bit pairs (see
    /// `q8_0_pairs`), but against pair-bound activations, which `maddubs` multiplies by the
    /// stored unsigned bytes. VNNI reads the bytes as stored.
    fn widens(isa: Isa) -> bool {
        !PAIR_BOUND && isa == Isa::Avx2
    }

    fn widen(isa: Isa, w: &[u8], nb: usize, out: &mut Vec<u8>) {
        q8_0_pairs::widen(isa, w, nb, out);
    }

    fn gguf_quant(block: &[u8], i: usize) -> i8 {
        block[2 + i] as i8
    }

    fn put_quant(gb: &mut [u8], j: usize, i: usize, q: i8) {
        gb[q8_0_at(j, i)] = q as u8 ^ 0x80;
    }

    fn quant(gb: &[u8], j: usize, i: usize) -> i8 {
        (gb[q8_0_at(j, i)] ^ 0x80) as i8
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn unsigned_steps(p: *const u8) -> [std::arch::x86_64::__m512i; 8] {
        use std::arch::x86_64::*;
        // SAFETY: eight steps of 64 bytes follow the scales.
        std::array::from_fn(|s| unsafe {
            _mm512_loadu_si512(p.add(SCALES + 64 * s) as *const __m512i)
        })
    }
}

/// Five-bit quants (Q5_0's or Q4_0's, widened for batches) stored one per byte as `w + 16`, in
/// Q8_0's layout: four steps' products `(w + 16)·a` add up in i16 (`4 · 2 · 31 · 127 < 2^15`)
/// before one widening to i32, where Q8_0's bytes take ggml's sign trick and a widening every
/// step.
pub(crate) struct FiveBitBytes;

impl Format for FiveBitBytes {
    const BLOCK_BYTES: usize = BLOCK_BYTES;
    type Batched = WithQ8_0Acts<FiveBitBytes>;
    const FIVE_BIT: bool = true;
    const AVX2_UNSIGNED_OFFSET: i32 = 16;

    fn gguf_quant(_block: &[u8], _i: usize) -> i8 {
        unreachable!("five-bit bytes are widened into, never loaded from GGUF")
    }

    fn put_quant(gb: &mut [u8], j: usize, i: usize, q: i8) {
        debug_assert!((-16..16).contains(&q));
        gb[q8_0_at(j, i)] = (q + 16) as u8;
    }

    fn quant(gb: &[u8], j: usize, i: usize) -> i8 {
        gb[q8_0_at(j, i)] as i8 - 16
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn unsigned_steps(p: *const u8) -> [std::arch::x86_64::__m512i; 8] {
        use std::arch::x86_64::*;
        // SAFETY: eight steps of 64 bytes follow the scales.
        std::array::from_fn(|s| unsafe {
            _mm512_loadu_si512(p.add(SCALES + 64 * s) as *const __m512i)
        })
    }
}

/// Where quant `i` of row `j` sits in a Q8_0 group block.
fn q8_0_at(j: usize, i: usize) -> usize {
    SCALES + (i / 4) * 4 * GROUP + 4 * j + i % 4
}

/// The kernel of a [`Format`] against Q8_0 activations.
pub(crate) struct WithQ8_0Acts<F>(PhantomData<F>);

impl<F: Format> Kernel for WithQ8_0Acts<F> {
    type Act = Q8_0Block;
    const BLOCK_ELEMS: usize = BLOCK_ELEMS;
    const BLOCK_BYTES: usize = F::BLOCK_BYTES;
    const ROW_GROUP: usize = GROUP;
    type Batched = F::Batched;
    const WIDEN_MIN_ROWS: usize = F::WIDEN_MIN_ROWS;

    fn widens(isa: Isa) -> bool {
        F::widens(isa)
    }

    fn widen(isa: Isa, w: &[u8], nb: usize, out: &mut Vec<u8>) {
        F::widen(isa, w, nb, out);
    }

    fn quantize(isa: Isa, x: &[f32], out: &mut [Q8_0Block]) {
        if F::PAIR_BOUND {
            quantize_q8_0_pair_bound(isa, x, out);
        } else {
            quantize_q8_0(isa, x, out);
        }
    }

    fn scalar(w: &[u8], acts: &[Self::Act], nb: usize, out: TileOut<'_>) {
        scalar::<F>(w, acts, nb, out);
    }

    fn pairs_groups(isa: Isa) -> bool {
        isa == Isa::Avx512 && F::STEPS_STORED
    }

    #[cfg(target_arch = "x86_64")]
    unsafe fn simd(isa: Isa, w: &[u8], acts: &[Self::Act], nb: usize, out: TileOut<'_>) {
        let na = acts.len() / nb;
        // SAFETY: the caller's guarantees, passed on.
        unsafe {
            match isa {
                Isa::Avx512 => with_act_rows!(na, x86::avx512_rows[F](w, acts, nb, out)),
                // `maddubs` takes the stored quants as its unsigned operand, no sign trick:
                // Q8_0's `w + 128` against pair-bound activations (only `Q8_0PairBound` is
                // pair-bound), five-bit quants' `w + 16` against any; other Q8_0 would
                // overflow i16.
                _ if F::PAIR_BOUND => x86::avx2_two_rows_at_a_time::<
                    Q8_0PairBound,
                    { x86::PAIR_BOUND_ACTS },
                >(w, acts, nb, out),
                _ if F::AVX2_UNSIGNED_OFFSET == 16 => {
                    with_act_rows!(na, x86::avx2_rows_unsigned[F](w, acts, nb, out))
                }
                _ => with_act_rows!(na, x86::avx2_rows[F](w, acts, nb, out)),
            }
        }
    }
}

/// [`Q8_0PairBound`] weights against a gradient's rows as `quantize_gradient` makes them
/// (quad-bound: see there), signed or, with `NON_NEG`, with no negative value (the LM head's
/// softmax numerators, see `Linear::backward_input_non_negative`). AVX2 adds the products of
/// two steps in i16 before one `madd` (`255 · 128 < 2^15`): three multiplies per 64 products
/// where pair-bound activations take four. Non-negative activations are `maddubs`'s unsigned
/// operand against the weights made signed: a quad's products are then at most `128 · 128`, so
/// four steps add in i16 (`2 · 128 · 128 <= 2^15`, reached only at -2^15), five multiplies per
/// 128 products. The integer sums are the same, so are the bits; other instruction sets run as
/// [`Q8_0PairBound`].
pub(crate) struct WithGradActs<const NON_NEG: bool>;

impl<const NON_NEG: bool> Kernel for WithGradActs<NON_NEG> {
    type Act = Q8_0Block;
    const BLOCK_ELEMS: usize = BLOCK_ELEMS;
    const BLOCK_BYTES: usize = Q8_0PairBound::BLOCK_BYTES;
    const ROW_GROUP: usize = GROUP;
    type Batched = Self;

    fn quantize(isa: Isa, x: &[f32], out: &mut [Q8_0Block]) {
        debug_assert!(!NON_NEG || x.iter().all(|&v| v >= 0.0));
        quantize_gradient(isa, x, out);
    }

    fn scalar(w: &[u8], acts: &[Self::Act], nb: usize, out: TileOut<'_>) {
        scalar::<Q8_0PairBound>(w, acts, nb, out);
    }

    fn pairs_groups(isa: Isa) -> bool {
        WithQ8_0Acts::<Q8_0PairBound>::pairs_groups(isa)
    }

    #[cfg(target_arch = "x86_64")]
    unsafe fn simd(isa: Isa, w: &[u8], acts: &[Self::Act], nb: usize, out: TileOut<'_>) {
        use x86::{avx2_two_rows_at_a_time, GRADIENT, NON_NEG_GRADIENT};
        // SAFETY: the caller's guarantees, passed on.
        unsafe {
            match isa {
                Isa::Avx2 if NON_NEG => {
                    avx2_two_rows_at_a_time::<Q8_0PairBound, NON_NEG_GRADIENT>(w, acts, nb, out)
                }
                Isa::Avx2 => avx2_two_rows_at_a_time::<Q8_0PairBound, GRADIENT>(w, acts, nb, out),
                _ => WithQ8_0Acts::<Q8_0PairBound>::simd(isa, w, acts, nb, out),
            }
        }
    }
}

/// Whole group blocks of `F` into [`FiveBitBytes`] (`F`'s quants all five-bit).
pub(crate) fn widen_to_five_bit_bytes<F: Format>(isa: Isa, w: &[u8], out: &mut Vec<u8>) {
    out.resize(w.len() / F::GROUP_BLOCK * FiveBitBytes::GROUP_BLOCK, 0);
    for (src, dst) in w
        .chunks_exact(F::GROUP_BLOCK)
        .zip(out.chunks_exact_mut(FiveBitBytes::GROUP_BLOCK))
    {
        dst[..SCALES].copy_from_slice(&src[..SCALES]);
        match isa {
            // SAFETY: whole group blocks; the CPU has the instruction set `isa` names.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => unsafe { x86::widen_avx512::<F>(src, dst) },
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => unsafe { x86::widen_avx2::<F>(src, dst) },
            _ => {
                for j in 0..GROUP {
                    for i in 0..BLOCK_ELEMS {
                        FiveBitBytes::put_quant(dst, j, i, F::quant(src, j, i));
                    }
                }
            }
        }
    }
}

/// GGUF rows (`out_dim` of them) in the interleaved layout, padded with zero rows to a whole
/// group.
pub(crate) fn interleave<F: Format>(gguf: &[u8], out_dim: usize) -> Vec<u8> {
    let nb = gguf.len() / (out_dim * F::BLOCK_BYTES);
    let row_bytes = nb * F::BLOCK_BYTES;
    let mut packed = vec![0u8; out_dim.div_ceil(GROUP) * nb * F::GROUP_BLOCK];
    for (rows, dst) in gguf
        .chunks(GROUP * row_bytes)
        .zip(packed.chunks_exact_mut(nb * F::GROUP_BLOCK))
    {
        interleave_group::<F>(rows, nb, dst);
    }
    packed
}

/// [`interleave`] in the GGUF bytes' own memory when the rows fill whole groups (a group takes
/// the bytes its rows took), so loading the 170 MB LM head never holds two copies of it.
pub(crate) fn interleave_owned<F: Format>(mut gguf: Vec<u8>, out_dim: usize) -> Vec<u8> {
    if out_dim == 0 || !out_dim.is_multiple_of(GROUP) {
        return interleave::<F>(&gguf, out_dim);
    }
    let nb = gguf.len() / (out_dim * F::BLOCK_BYTES);
    let mut rows = vec![0u8; nb * F::GROUP_BLOCK];
    for group in gguf.chunks_exact_mut(nb * F::GROUP_BLOCK) {
        rows.copy_from_slice(group);
        interleave_group::<F>(&rows, nb, group);
    }
    gguf
}

/// Up to `GROUP` GGUF rows of `nb` blocks into one interleaved group (`dst`, `nb` group blocks);
/// missing rows are zero rows.
fn interleave_group<F: Format>(rows: &[u8], nb: usize, dst: &mut [u8]) {
    let row_bytes = nb * F::BLOCK_BYTES;
    dst.fill(0);
    for (b, dst) in dst.chunks_exact_mut(F::GROUP_BLOCK).enumerate() {
        for j in 0..GROUP {
            let Some(row) = rows.get(j * row_bytes..(j + 1) * row_bytes) else {
                for i in 0..BLOCK_ELEMS {
                    F::put_quant(dst, j, i, 0);
                }
                continue;
            };
            let src = &row[b * F::BLOCK_BYTES..(b + 1) * F::BLOCK_BYTES];
            dst[2 * j..2 * j + 2].copy_from_slice(&src[..2]);
            for i in 0..BLOCK_ELEMS {
                F::put_quant(dst, j, i, F::gguf_quant(src, i));
            }
        }
    }
}

/// A quantized block (`quantize_q8_0`'s, its scale already an f16 value) as GGUF's 34 bytes.
pub(crate) fn store_block(block: &Q8_0Block, out: &mut [u8]) {
    out[..2].copy_from_slice(&f16::from_f32(block.d).to_le_bytes());
    for (o, &q) in out[2..BLOCK_BYTES].iter_mut().zip(&block.qs) {
        *o = q as u8;
    }
}

/// Rows of the interleaved weight in f32: `d * q` per value, as GGUF dequantization does.
pub(crate) fn dequantize_rows<F: Format>(w: &[u8], in_dim: usize, rows: &[usize]) -> Vec<f32> {
    let nb = in_dim / BLOCK_ELEMS;
    let mut out = vec![0f32; rows.len() * in_dim];
    // The whole LM head (training's backward) is 168M values: split it across threads.
    out.par_chunks_mut(in_dim)
        .zip(rows.par_iter())
        .with_min_len(64)
        .for_each(|(dst, &row)| {
            let (g, j) = (row / GROUP, row % GROUP);
            let group = &w[g * nb * F::GROUP_BLOCK..(g + 1) * nb * F::GROUP_BLOCK];
            for (gb, dst) in group
                .chunks_exact(F::GROUP_BLOCK)
                .zip(dst.chunks_exact_mut(BLOCK_ELEMS))
            {
                let d = f16::from_le_bytes([gb[2 * j], gb[2 * j + 1]]).to_f32();
                for (i, v) in dst.iter_mut().enumerate() {
                    *v = F::quant(gb, j, i) as f32 * d;
                }
            }
        });
    out
}

/// The reference: per row and column, each block's integer dot product into one f32 by a fused
/// multiply-add.
fn scalar<F: Format>(w: &[u8], acts: &[Q8_0Block], nb: usize, out: TileOut<'_>) {
    for (g, group) in w.chunks_exact(nb * F::GROUP_BLOCK).enumerate() {
        for (a, arow) in acts.chunks_exact(nb).enumerate() {
            for j in 0..GROUP {
                let mut acc = 0f32;
                for (wb, ab) in group.chunks_exact(F::GROUP_BLOCK).zip(arow) {
                    let d = f16::from_le_bytes([wb[2 * j], wb[2 * j + 1]]).to_f32() * ab.d;
                    let isum: i32 = (0..BLOCK_ELEMS)
                        .map(|i| F::quant(wb, j, i) as i32 * ab.qs[i] as i32)
                        .sum();
                    acc = d.mul_add(isum as f32, acc);
                }
                out.set(a, g * GROUP + j, acc);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::super::activations::VNNI_BIAS;
    use super::{FiveBitBytes, Format, Q8_0Block, TileOut, GROUP, SCALES};

    /// Group blocks between the one computed and the one prefetched (into L2).
    const PREFETCH_AHEAD: usize = 32;
    /// Activation rows whose accumulators stay in registers together (AVX-512).
    const AVX512_ROWS: usize = 4;

    /// Asks for the group block [`PREFETCH_AHEAD`] after the one at `p` into L2: one row of
    /// activations streams the weight from memory (the LM head), and the hardware prefetcher
    /// alone keeps it ~40% slower (eight ahead into L1 was slower still). On AVX2 too: Gemma-3-1B's
    /// Q5_0 gate (1,152 -> 6,912, streamed from memory) took 174-214 µs without and 103-134 µs
    /// with 8-32 KB ahead (`kernel_throughput` with `KERNEL_STREAM`).
    #[inline(always)]
    fn prefetch_ahead<F: Format>(p: *const u8) {
        for line in 0..F::GROUP_BLOCK.div_ceil(64) {
            let ahead = p.wrapping_add(PREFETCH_AHEAD * F::GROUP_BLOCK + 64 * line);
            // SAFETY: a prefetch reads nothing and faults on no address.
            unsafe { _mm_prefetch::<_MM_HINT_T1>(ahead as *const i8) };
        }
    }

    /// Four activation values as one i32, broadcast.
    #[inline(always)]
    fn four(ab: &Q8_0Block, step: usize) -> i32 {
        super::super::four_values(&ab.qs, 4 * step)
    }

    /// A group block's quants as [`FiveBitBytes`] stores them, `w + 16` (after the scales,
    /// copied by the caller).
    #[target_feature(enable = "avx512f,avx512bw,avx2")]
    pub(super) unsafe fn widen_avx512<F: Format>(src: &[u8], dst: &mut [u8]) {
        assert!(src.len() == F::GROUP_BLOCK && dst.len() == FiveBitBytes::GROUP_BLOCK);
        // `unsigned_steps` give `w + 128`; the bytes are `w + 16`.
        assert!(!F::FIVE_BIT);
        let shift = _mm512_set1_epi8(-112);
        // SAFETY: whole group blocks (checked above).
        unsafe {
            for (s, step) in F::unsigned_steps(src.as_ptr()).into_iter().enumerate() {
                let q = _mm512_add_epi8(step, shift);
                _mm512_storeu_si512(dst.as_mut_ptr().add(SCALES + 64 * s) as *mut __m512i, q);
            }
        }
    }

    /// [`widen_avx512`] with AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn widen_avx2<F: Format>(src: &[u8], dst: &mut [u8]) {
        assert!(src.len() == F::GROUP_BLOCK && dst.len() == FiveBitBytes::GROUP_BLOCK);
        // The unsigned steps are `w + 16`, the bytes as stored.
        assert_eq!(F::AVX2_UNSIGNED_OFFSET, 16);
        for s in 0..8 {
            for h in 0..2 {
                // SAFETY: whole group blocks (checked above).
                unsafe {
                    let q = F::avx2_unsigned_step(src.as_ptr(), s, h);
                    let at = dst.as_mut_ptr().add(SCALES + 64 * s + 32 * h);
                    _mm256_storeu_si256(at as *mut __m256i, q);
                }
            }
        }
    }

    /// A block's integer sums of half `h` of the group block at `p` into the accumulators: one
    /// conversion and one fused multiply-add per activation row. Sums that started from
    /// `VNNI_BIAS` (`BIASED`) convert by one subtraction: their bits less those of `1.5 · 2^23`
    /// as f32 are the sums, exactly (see `VNNI_BIAS`).
    ///
    /// # Safety
    /// `p` points to a whole group block; the CPU has AVX2, FMA and F16C.
    #[inline(always)]
    unsafe fn take_block<const NA: usize, const BIASED: bool>(
        p: *const u8,
        h: usize,
        ab: &[&Q8_0Block; NA],
        isum: &[__m256i; NA],
        acc: &mut [__m256; NA],
    ) {
        // SAFETY: the sixteen scales are the group block's first 32 bytes.
        let dw = _mm256_cvtph_ps(unsafe { _mm_loadu_si128(p.add(16 * h) as *const __m128i) });
        for a in 0..NA {
            let d = _mm256_mul_ps(dw, _mm256_set1_ps(ab[a].d));
            let sum = match BIASED {
                true => _mm256_sub_ps(
                    _mm256_castsi256_ps(isum[a]),
                    _mm256_castsi256_ps(_mm256_set1_epi32(VNNI_BIAS)),
                ),
                false => _mm256_cvtepi32_ps(isum[a]),
            };
            acc[a] = _mm256_fmadd_ps(d, sum, acc[a]);
        }
    }

    /// No VNNI: half a group (eight rows) per register, the products through ggml's sign trick
    /// (`|w|` unsigned times `a` with `w`'s sign, exact in i16 pairs), each step's weight
    /// register made once for all `NA` activation rows; a block's integer sums go into the
    /// accumulators by [`take_block`].
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn avx2_rows<const NA: usize, F: Format>(
        w: &[u8],
        acts: &[Q8_0Block],
        nb: usize,
        out: TileOut<'_>,
    ) {
        let ones = _mm256_set1_epi16(1);
        // (One activation row has no weights to share: unrolled, it has nothing to spill.)
        let steps = if NA == 1 {
            8
        } else {
            std::hint::black_box(8usize)
        };
        for (g, group) in w.chunks_exact(nb * F::GROUP_BLOCK).enumerate() {
            for h in 0..2 {
                let mut acc = [_mm256_setzero_ps(); NA];
                for (b, wb) in group.chunks_exact(F::GROUP_BLOCK).enumerate() {
                    let p = wb.as_ptr();
                    // The second half finds the group in L1.
                    if h == 0 {
                        prefetch_ahead::<F>(p);
                    }
                    let ab: [&Q8_0Block; NA] = std::array::from_fn(|a| &acts[a * nb + b]);
                    let mut isum = [_mm256_setzero_si256(); NA];
                    // A loop LLVM does not unroll: unrolled, it hoists every step's weights
                    // ahead of their uses and spills them.
                    for s in 0..steps {
                        let s = s & 7;
                        // SAFETY: `p` is a whole group block.
                        let q = unsafe { F::signed_step(p, s, h) };
                        let qa = _mm256_abs_epi8(q);
                        for (isum, ab) in isum.iter_mut().zip(ab) {
                            let x = _mm256_set1_epi32(four(ab, s));
                            let dot = _mm256_maddubs_epi16(qa, _mm256_sign_epi8(x, q));
                            *isum = _mm256_add_epi32(*isum, _mm256_madd_epi16(dot, ones));
                        }
                    }
                    // SAFETY: `p` is a whole group block.
                    unsafe { take_block::<NA, false>(p, h, &ab, &isum, &mut acc) };
                }
                for (a, acc) in acc.iter().enumerate() {
                    _mm256_storeu_ps(out.at(a, g * GROUP + 8 * h), *acc);
                }
            }
        }
    }

    /// `Σ a` of an activation block: its `vnni_init` is `VNNI_BIAS - 128 Σ a`.
    #[inline(always)]
    fn act_sum(ab: &Q8_0Block) -> i32 {
        (VNNI_BIAS - ab.vnni_init) >> 7
    }

    /// The VNNI starting value for `F`'s unsigned quants: `VNNI_BIAS` minus the offset times
    /// `Σ a`.
    #[inline(always)]
    fn vnni_init<F: Format>(ab: &Q8_0Block) -> i32 {
        if F::FIVE_BIT {
            VNNI_BIAS - 16 * act_sum(ab)
        } else {
            ab.vnni_init
        }
    }

    /// The activations [`avx2_rows_both_halves`] takes: pair-bound rows
    /// (`quantize_q8_0_pair_bound`, a forward's), or a gradient's quad-bound rows
    /// (`quantize_gradient`), signed or with no negative value.
    pub(super) const PAIR_BOUND_ACTS: u8 = 0;
    pub(super) const GRADIENT: u8 = 1;
    pub(super) const NON_NEG_GRADIENT: u8 = 2;

    /// [`avx2_rows`] for five-bit quants as `maddubs`'s unsigned operand (`w + 16`: Q5_0 and
    /// Q4_0, or [`super::FiveBitBytes`]). No sign trick; the products of a run of four steps
    /// add up in i16 (`4 · 2 · 31 · 127 < 2^15`) before one `madd` into i32, from `-16 Σ a`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn avx2_rows_unsigned<const NA: usize, F: Format>(
        w: &[u8],
        acts: &[Q8_0Block],
        nb: usize,
        out: TileOut<'_>,
    ) {
        // Five-bit formats only: the dispatch instantiates it for Q8_0 too, never calling it.
        assert_eq!(F::AVX2_UNSIGNED_OFFSET, 16, "five-bit quants");
        const RUN: usize = 4;
        let ones = _mm256_set1_epi16(1);
        // A loop LLVM keeps rolled, as in `avx2_rows`, so it does not spill the weights.
        let runs = if NA == 1 {
            8 / RUN
        } else {
            std::hint::black_box(8 / RUN)
        };
        for (g, group) in w.chunks_exact(nb * F::GROUP_BLOCK).enumerate() {
            for h in 0..2 {
                let mut acc = [_mm256_setzero_ps(); NA];
                for (b, wb) in group.chunks_exact(F::GROUP_BLOCK).enumerate() {
                    let p = wb.as_ptr();
                    // The second half finds the group in L1.
                    if h == 0 {
                        prefetch_ahead::<F>(p);
                    }
                    let ab: [&Q8_0Block; NA] = std::array::from_fn(|a| &acts[a * nb + b]);
                    let mut isum: [__m256i; NA] =
                        std::array::from_fn(|a| _mm256_set1_epi32(-16 * act_sum(ab[a])));
                    // Each activation row's run by pointer (indices took bounds checks).
                    let mut xp: [*const i8; NA] = std::array::from_fn(|a| ab[a].qs.as_ptr());
                    for r in 0..runs {
                        let mut sum16 = [_mm256_setzero_si256(); NA];
                        for k in 0..RUN {
                            // SAFETY: `p` is a whole group block (step `RUN · r + k` below 8).
                            let q = unsafe { F::avx2_unsigned_step(p, RUN * r + k, h) };
                            for (sum16, x) in sum16.iter_mut().zip(&xp) {
                                // SAFETY: `runs · RUN` is 8: each step lies in its block.
                                let x = unsafe { (x.add(4 * k) as *const i32).read_unaligned() };
                                let x = _mm256_set1_epi32(x);
                                *sum16 = _mm256_add_epi16(*sum16, _mm256_maddubs_epi16(q, x));
                            }
                        }
                        for (isum, sum16) in isum.iter_mut().zip(sum16) {
                            *isum = _mm256_add_epi32(*isum, _mm256_madd_epi16(sum16, ones));
                        }
                        xp = xp.map(|x| x.wrapping_add(4 * RUN));
                    }
                    // SAFETY: `p` is a whole group block.
                    unsafe { take_block::<NA, false>(p, h, &ab, &isum, &mut acc) };
                }
                for (a, acc) in acc.iter().enumerate() {
                    _mm256_storeu_ps(out.at(a, g * GROUP + 8 * h), *acc);
                }
            }
        }
    }

    /// Q8_0's stored `w + 128` as `maddubs`'s unsigned operand against pair-bound activations
    /// ([`super::Q8_0PairBound`]) or a gradient's quad-bound rows ([`super::WithGradActs`]),
    /// both halves of a row group in one pass. The products of a run of steps add in i16 before
    /// one `madd`: runs of one for pair-bound activations (`255 · 128 < 2^15`), of two for a
    /// signed gradient (the same bound over a quad); of four for a non-negative one (`ACTS`
    /// `NON_NEG_GRADIENT`), taken as the unsigned operand against the weights made signed, from
    /// 0 (`2 · 128 · 128 <= 2^15`, reached only at -2^15). Each broadcast of four activation
    /// values serves sixteen rows: on Zen 3 the broadcasts and the adds take the same four
    /// vector pipes as the multiplies (`llvm-mca -mcpu=znver3`). Up to two activation rows a
    /// pass ([`avx2_two_rows_at_a_time`]), whose sixteen rows' sums fill the registers. Around
    /// the products, as few instructions as a block allows: the rolled step loop walks pointers
    /// (indices took masks and bounds checks; unrolled, LLVM spills), signed sums start from
    /// `vnni_init`, and only the first pass over the weight asks for it ahead (`prefetch`; the
    /// next find it in cache). `tile_throughput` on Zen 3, against each step's offsets computed
    /// and every pass prefetched: pair-bound 76-77 GMAC/s against 66-68 (the one-half kernel
    /// it replaced), signed gradients 89-91 against 79-81, non-negative 90-92 against 82-84.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn avx2_rows_both_halves<const NA: usize, F: Format, const ACTS: u8>(
        w: &[u8],
        acts: &[Q8_0Block],
        nb: usize,
        out: TileOut<'_>,
        prefetch: bool,
    ) {
        // Q8_0's stored steps, `w + 128` in 64 bytes each (walked by pointer below): signed
        // activations' sums start from `vnni_init`.
        const { assert!(F::AVX2_UNSIGNED_OFFSET == 128 && F::STEPS_STORED) };
        let non_neg = ACTS == NON_NEG_GRADIENT;
        let run = match ACTS {
            PAIR_BOUND_ACTS => 1,
            GRADIENT => 2,
            _ => 4,
        };
        let to_signed = _mm256_set1_epi8(-128);
        let ones = _mm256_set1_epi16(1);
        // A loop LLVM keeps rolled: unrolled, it spills (as `avx2_rows`).
        let runs = std::hint::black_box(8 / run);
        for (g, group) in w.chunks_exact(nb * F::GROUP_BLOCK).enumerate() {
            let mut acc = [[_mm256_setzero_ps(); NA]; 2];
            for (b, wb) in group.chunks_exact(F::GROUP_BLOCK).enumerate() {
                let p = wb.as_ptr();
                if prefetch {
                    prefetch_ahead::<F>(p);
                }
                let ab: [&Q8_0Block; NA] = std::array::from_fn(|a| &acts[a * nb + b]);
                // Signed (pair-bound or a gradient): from `vnni_init`, `VNNI_BIAS - 128 Σ a`,
                // one broadcast (the offset taken out, the bias converted away by `take_block`).
                let init: [__m256i; NA] = std::array::from_fn(|a| match non_neg {
                    true => _mm256_setzero_si256(),
                    false => _mm256_set1_epi32(ab[a].vnni_init),
                });
                let mut isum = [init; 2];
                // The run's first step of the weight and of each activation row, by pointer:
                // indices would take masks and bounds checks in the rolled loop.
                let mut wp = p;
                let mut xp: [*const i8; NA] = std::array::from_fn(|a| ab[a].qs.as_ptr());
                for _ in 0..runs {
                    let mut sum16 = [[_mm256_setzero_si256(); NA]; 2];
                    for s in 0..run {
                        // SAFETY: `runs · run` is 8: every step lies in the activation block.
                        let x: [__m256i; NA] = std::array::from_fn(|a| unsafe {
                            _mm256_set1_epi32((xp[a].add(4 * s) as *const i32).read_unaligned())
                        });
                        for (h, sum16) in sum16.iter_mut().enumerate() {
                            // SAFETY: `wp` is the group block `p` moved on by whole steps
                            // (`s` below 8 in all).
                            let q = unsafe { F::avx2_unsigned_step(wp, s, h) };
                            let q = match non_neg {
                                true => _mm256_xor_si256(q, to_signed),
                                false => q,
                            };
                            for (sum16, x) in sum16.iter_mut().zip(&x) {
                                let pairs = match non_neg {
                                    true => _mm256_maddubs_epi16(*x, q),
                                    false => _mm256_maddubs_epi16(q, *x),
                                };
                                *sum16 = _mm256_add_epi16(*sum16, pairs);
                            }
                        }
                    }
                    for (isum, sum16) in isum.iter_mut().zip(&sum16) {
                        for (isum, sum16) in isum.iter_mut().zip(sum16) {
                            *isum = _mm256_add_epi32(*isum, _mm256_madd_epi16(*sum16, ones));
                        }
                    }
                    wp = wp.wrapping_add(64 * run);
                    xp = xp.map(|x| x.wrapping_add(4 * run));
                }
                for (h, (isum, acc)) in isum.iter().zip(acc.iter_mut()).enumerate() {
                    // SAFETY: `p` is a whole group block.
                    unsafe {
                        match non_neg {
                            true => take_block::<NA, false>(p, h, &ab, isum, acc),
                            false => take_block::<NA, true>(p, h, &ab, isum, acc),
                        }
                    };
                }
            }
            for (h, acc) in acc.iter().enumerate() {
                for (a, acc) in acc.iter().enumerate() {
                    _mm256_storeu_ps(out.at(a, g * GROUP + 8 * h), *acc);
                }
            }
        }
    }

    /// [`avx2_rows_both_halves`] over the activation rows two at a time.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn avx2_two_rows_at_a_time<F: Format, const ACTS: u8>(
        w: &[u8],
        acts: &[Q8_0Block],
        nb: usize,
        out: TileOut<'_>,
    ) {
        let na = acts.len() / nb;
        for a0 in (0..na).step_by(2) {
            let (part, out) = (&acts[a0 * nb..(a0 + 2).min(na) * nb], out.shifted(a0, 0));
            // SAFETY: the caller's guarantees, for these rows.
            unsafe {
                match na - a0 {
                    1 => avx2_rows_both_halves::<1, F, ACTS>(w, part, nb, out, a0 == 0),
                    _ => avx2_rows_both_halves::<2, F, ACTS>(w, part, nb, out, a0 == 0),
                }
            }
        }
    }

    /// A whole group per register; a block's eight steps in two VNNI chains per activation row
    /// (the even steps from the activation's `vnni_init`, the odd ones from zero), added as
    /// integers. Batches take two groups at a time ([`avx512_two_groups`]).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(super) unsafe fn avx512_rows<const NA: usize, F: Format>(
        w: &[u8],
        acts: &[Q8_0Block],
        nb: usize,
        out: TileOut<'_>,
    ) {
        let group_bytes = nb * F::GROUP_BLOCK;
        let groups = w.len() / group_bytes;
        let mut g = 0;
        while g < groups {
            // Two groups where there are two, for a batch of stored steps; one row (a decode
            // step) one group at a time, its two chains as above, as do packed formats (their
            // sixteen unpacked steps would not stay in registers).
            let two = NA > 1 && F::STEPS_STORED && g + 1 < groups;
            let taken = if two { 2 } else { 1 };
            let group = &w[g * group_bytes..(g + taken) * group_bytes];
            for a0 in (0..NA).step_by(AVX512_ROWS) {
                let out = out.shifted(a0, g * GROUP);
                let acts = &acts[a0 * nb..];
                macro_rules! pass {
                    ($($n:literal)*) => {
                        match ((NA - a0).min(AVX512_ROWS), a0 == 0, two) {
                            $(
                                // SAFETY: passed on; `$n` rows from `a0`.
                                ($n, true, false) => unsafe {
                                    avx512_group::<$n, true, F>(group, acts, nb, out)
                                },
                                ($n, false, false) => unsafe {
                                    avx512_group::<$n, false, F>(group, acts, nb, out)
                                },
                                ($n, true, true) => unsafe {
                                    avx512_two_groups::<$n, true, F>(group, acts, nb, out)
                                },
                                ($n, false, true) => unsafe {
                                    avx512_two_groups::<$n, false, F>(group, acts, nb, out)
                                },
                            )*
                            _ => unreachable!(),
                        }
                    };
                }
                pass!(1 2 3 4);
            }
            g += taken;
        }
    }

    /// [`avx512_group`] over two consecutive groups (`groups`, 32 rows; `out` at the first
    /// group's first column): each broadcast of four activation values feeds both groups' VNNI
    /// chains, and each block's conversion of an activation row's sum is done once per group
    /// for two groups' worth of products, where one group at a time spends as many
    /// instructions beside its eight `vpdpbusd` as it has of them. One chain per group and
    /// activation row (the two groups' chains are independent). The same integer sums and the
    /// same multiply-add per block: the same bits.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn avx512_two_groups<const NA: usize, const PREFETCH: bool, F: Format>(
        groups: &[u8],
        acts: &[Q8_0Block],
        nb: usize,
        out: TileOut<'_>,
    ) {
        let bias = _mm512_set1_ps(f32::from_bits(VNNI_BIAS as u32));
        let (first, second) = groups.split_at(nb * F::GROUP_BLOCK);
        let mut acc = [[_mm512_setzero_ps(); 2]; NA];
        let blocks = first
            .chunks_exact(F::GROUP_BLOCK)
            .zip(second.chunks_exact(F::GROUP_BLOCK));
        for (b, (w0, w1)) in blocks.enumerate() {
            let p = [w0.as_ptr(), w1.as_ptr()];
            if PREFETCH {
                prefetch_ahead::<F>(p[0]);
                prefetch_ahead::<F>(p[1]);
            }
            let ab: [&Q8_0Block; NA] = std::array::from_fn(|a| &acts[a * nb + b]);
            let mut isum: [[__m512i; 2]; NA] =
                std::array::from_fn(|a| [_mm512_set1_epi32(vnni_init::<F>(ab[a])); 2]);
            // Step by step, so that only a step's two weight registers are live beside the
            // 2·NA chains (all sixteen at once spilled).
            for s in 0..8 {
                // SAFETY: each `p` is a whole group block.
                let q = p.map(|p| unsafe { F::unsigned_steps(p)[s] });
                for (isum, ab) in isum.iter_mut().zip(ab) {
                    let x = _mm512_set1_epi32(four(ab, s));
                    isum[0] = _mm512_dpbusd_epi32(isum[0], q[0], x);
                    isum[1] = _mm512_dpbusd_epi32(isum[1], q[1], x);
                }
            }
            // SAFETY: each `p` is a whole group block, its first 32 bytes the scales.
            let dw = p.map(|p| unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i)) });
            for ((acc, isum), ab) in acc.iter_mut().zip(isum).zip(ab) {
                let da = _mm512_set1_ps(ab.d);
                for ((acc, isum), dw) in acc.iter_mut().zip(isum).zip(dw) {
                    // The bits of 1.5·2^23 + Σ w·a: minus 1.5·2^23 is Σ w·a as f32, exactly.
                    let isum = _mm512_sub_ps(_mm512_castsi512_ps(isum), bias);
                    *acc = _mm512_fmadd_ps(_mm512_mul_ps(dw, da), isum, *acc);
                }
            }
        }
        for (a, acc) in acc.iter().enumerate() {
            for (g, acc) in acc.iter().enumerate() {
                _mm512_storeu_ps(out.at(a, g * GROUP), *acc);
            }
        }
    }

    /// One group's sixteen rows for `NA` activation rows (`out` at the group's first column),
    /// prefetching the weight ahead on the first pass over the group.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn avx512_group<const NA: usize, const PREFETCH: bool, F: Format>(
        group: &[u8],
        acts: &[Q8_0Block],
        nb: usize,
        out: TileOut<'_>,
    ) {
        let bias = _mm512_set1_ps(f32::from_bits(VNNI_BIAS as u32));
        let mut acc = [_mm512_setzero_ps(); NA];
        for (b, wb) in group.chunks_exact(F::GROUP_BLOCK).enumerate() {
            let p = wb.as_ptr();
            // Later passes find the slice in L1.
            if PREFETCH {
                prefetch_ahead::<F>(p);
            }
            // SAFETY: `p` is a whole group block, its first 32 bytes the scales.
            let (dw, q) = unsafe {
                (
                    _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i)),
                    F::unsigned_steps(p),
                )
            };
            for (a, acc) in acc.iter_mut().enumerate() {
                let ab = &acts[a * nb + b];
                let mut even = _mm512_set1_epi32(vnni_init::<F>(ab));
                let mut odd = _mm512_setzero_si512();
                for s in (0..8).step_by(2) {
                    even = _mm512_dpbusd_epi32(even, q[s], _mm512_set1_epi32(four(ab, s)));
                    odd = _mm512_dpbusd_epi32(odd, q[s + 1], _mm512_set1_epi32(four(ab, s + 1)));
                }
                // The bits of 1.5·2^23 + Σ w·a: minus 1.5·2^23 is Σ w·a as f32, exactly.
                let isum = _mm512_castsi512_ps(_mm512_add_epi32(even, odd));
                let isum = _mm512_sub_ps(isum, bias);
                let d = _mm512_mul_ps(dw, _mm512_set1_ps(ab.d));
                *acc = _mm512_fmadd_ps(d, isum, *acc);
            }
        }
        for (a, acc) in acc.iter().enumerate() {
            _mm512_storeu_ps(out.at(a, 0), *acc);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_util::{check_paths_agree, Rng};
    use super::super::{matmul, prepare, WeightFormat};
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
        for format in [WeightFormat::Q8_0, WeightFormat::Q8_0PairBound] {
            for (rows, nb) in [(1, 1), (5, 3), (16, 20), (37, 2), (70, 3)] {
                let w = random_weights(&mut rng, rows, nb);
                check_paths_agree(format, &w, nb * BLOCK_ELEMS, rows, &mut rng);
            }
        }
    }

    /// Pair-bound activations at their bound against the extreme weights: each pair of
    /// products is `±255 · 128` in `maddubs`'s i16 (Q8_0's 127 and -128 stored as 255 and 0),
    /// exact on every path.
    #[test]
    fn pair_bound_products_at_the_bound_stay_exact() {
        let (rows, nb) = (32, 4);
        let mut w = Vec::new();
        for r in 0..rows * nb {
            w.extend_from_slice(&f16::from_f32(0.01).to_le_bytes());
            w.extend((0..32).map(|i| if (r + i / 2) % 3 == 0 { 0x80 } else { 0x7f }));
        }
        // Equal magnitudes: every pair of quants is (±64, ±64), the sign pattern varying.
        let x: Vec<f32> = (0..20 * nb * BLOCK_ELEMS)
            .map(|i| if i % 5 == 0 { -1.5 } else { 1.5 })
            .collect();
        let mut acts = vec![Q8_0Block::default(); x.len() / BLOCK_ELEMS];
        quantize_q8_0_pair_bound(Isa::Scalar, &x, &mut acts);
        assert!(acts.iter().all(|b| b.qs.iter().all(|q| q.abs() == 64)));
        let packed = prepare(WeightFormat::Q8_0PairBound, w.clone(), rows);
        let in_dim = nb * BLOCK_ELEMS;
        let reference = matmul(
            WeightFormat::Q8_0PairBound,
            Isa::Scalar,
            &packed,
            in_dim,
            rows,
            &x,
        );
        for (a, arow) in acts.chunks_exact(nb).enumerate() {
            for (r, wrow) in w.chunks_exact(nb * BLOCK_BYTES).enumerate() {
                let want = straightforward(wrow, arow);
                assert_eq!(reference[a * rows + r].to_bits(), want.to_bits());
            }
        }
        for isa in Isa::available() {
            let got = matmul(WeightFormat::Q8_0PairBound, isa, &packed, in_dim, rows, &x);
            assert_eq!(got, reference, "{isa:?}");
        }
    }

    /// Gradients (`quantize_gradient`'s quad-bound blocks) against the extreme weights (127 and
    /// -128), at their bound: signed, every quant ±32, so two steps' four products reach
    /// `±255 · 128` in i16 (rows whose quads are all 127 against all-positive or all-negative
    /// values); non-negative, so four steps reach `2 · 128 · -128 = -32768`. And random ones
    /// against random weights. Both kernels give the formula's bits on every path.
    #[test]
    fn gradient_kernels_give_the_formulas_bits() {
        use super::super::{matmul_q8_0_blocks, Threads};
        let mut rng = Rng::new(17);
        let nb = 4;
        let in_dim = nb * BLOCK_ELEMS;
        let extreme = || -> Vec<u8> {
            (0..32 * nb)
                .flat_map(|r| {
                    let quants =
                        (0..32).map(move |i| if (r + i / 2) % 3 == 0 { 0x80 } else { 0x7f });
                    f16::from_f32(0.01).to_le_bytes().into_iter().chain(quants)
                })
                .collect()
        };
        let signs = |pattern: fn(usize) -> bool| -> Vec<f32> {
            (0..3 * in_dim)
                .map(|i| if pattern(i) { -1.5 } else { 1.5 })
                .collect()
        };
        let mut at_bound = signs(|_| false);
        at_bound.extend(signs(|_| true));
        at_bound.extend(signs(|i| i % 5 == 0));
        let non_neg_at_bound: Vec<f32> = (0..9 * in_dim).map(|_| 1.5).collect();
        let random: Vec<f32> = (0..70 * in_dim).map(|_| rng.uniform()).collect();
        let random_non_neg: Vec<f32> = random.iter().map(|v| v.abs()).collect();
        for (w, rows, x, bound) in [
            (extreme(), 32, at_bound, true),
            (extreme(), 32, non_neg_at_bound, true),
            (random_weights(&mut rng, 37, nb), 37, random, false),
            (random_weights(&mut rng, 37, nb), 37, random_non_neg, false),
        ] {
            let mut acts = vec![Q8_0Block::default(); x.len() / BLOCK_ELEMS];
            quantize_gradient(Isa::Scalar, &x, &mut acts);
            let non_negative = x.iter().all(|&v| v >= 0.0);
            if bound {
                assert!(acts.iter().all(|b| b.qs.iter().all(|q| q.abs() == 32)));
            }
            let packed = prepare(WeightFormat::Q8_0PairBound, w.clone(), rows);
            for isa in Isa::available() {
                for kernel_non_negative in [false, non_negative] {
                    let dims = (in_dim, rows);
                    let got = matmul_q8_0_blocks(
                        isa,
                        &packed,
                        dims,
                        &acts,
                        Threads::Pool,
                        kernel_non_negative,
                    );
                    for (a, arow) in acts.chunks_exact(nb).enumerate() {
                        for (r, wrow) in w.chunks_exact(nb * BLOCK_BYTES).enumerate() {
                            let value = straightforward(wrow, arow);
                            let at = a * rows + r;
                            assert_eq!(got[at].to_bits(), value.to_bits(), "{isa:?} {a} {r}");
                        }
                    }
                }
            }
        }
    }

    /// The kernel's formula written directly on GGUF blocks and activation quants.
    fn straightforward(wrow: &[u8], arow: &[Q8_0Block]) -> f32 {
        let mut acc = 0f32;
        for (wb, ab) in wrow.chunks_exact(BLOCK_BYTES).zip(arow) {
            let d = f16::from_le_bytes([wb[0], wb[1]]).to_f32() * ab.d;
            let isum: i32 = (0..32)
                .map(|i| wb[2 + i] as i8 as i32 * ab.qs[i] as i32)
                .sum();
            acc = d.mul_add(isum as f32, acc);
        }
        acc
    }

    #[test]
    fn scalar_reference_is_one_fma_per_block() {
        let mut rng = Rng::new(13);
        let (rows, nb, na) = (21, 5, 3);
        let w = random_weights(&mut rng, rows, nb);
        let x: Vec<f32> = (0..na * nb * BLOCK_ELEMS)
            .map(|i| rng.uniform() * (1 + i % 5) as f32)
            .collect();
        let mut acts = vec![Q8_0Block::default(); na * nb];
        quantize_q8_0(Isa::Scalar, &x, &mut acts);
        let packed = interleave::<Q8_0>(&w, rows);
        let stride = packed.len() / (nb * BLOCK_BYTES);
        let mut out = vec![0f32; na * stride];
        scalar::<Q8_0>(&packed, &acts, nb, TileOut::buffer(&mut out, na, stride));
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
        let packed = interleave::<Q8_0>(&w, rows);
        let picked = [20, 0, 5, 16, 5];
        let ours = dequantize_rows::<Q8_0>(&packed, nb * BLOCK_ELEMS, &picked);
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
        let packed = interleave::<Q8_0>(&w, rows);
        assert_eq!(packed.len(), 2 * GROUP * nb * BLOCK_BYTES);
        // Whole groups are interleaved in the bytes' own memory, to the same layout.
        let whole = &w[..GROUP * nb * BLOCK_BYTES];
        assert_eq!(
            interleave_owned::<Q8_0>(whole.to_vec(), GROUP),
            &packed[..GROUP * nb * BLOCK_BYTES]
        );
        for row in 0..2 * GROUP {
            for b in 0..nb {
                let gb = &packed[((row / GROUP) * nb + b) * <Q8_0>::GROUP_BLOCK..]
                    [..<Q8_0>::GROUP_BLOCK];
                let j = row % GROUP;
                let q: Vec<u8> = (0..32).map(|i| gb[q8_0_at(j, i)] ^ 0x80).collect();
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
