//! Q6_K weights (256 per block: 4 low bits, 2 high bits, sixteen i8 scales, f16 d) against Q8_K
//! activations. A block's exact integer `Σ_j sc_j (Σ_{i∈j} q_i a_i - 32 bsum_j)` (sixteen runs
//! of sixteen, `q` unsigned 0..63, the offset of 32 taken back through the activation sums)
//! goes into one f32 accumulator per (row, column) by one fused multiply-add,
//! `acc = fma(da·dw, sum as f32, acc)`, blocks in order. (Until the batched kernel below, this
//! was ggml's AVX2 `ggml_vec_dot_q6_K_q8_K` order: eight f32 lanes per row and `hsum_float_8`,
//! which only a row at a time computes cheaply.)
//!
//! Rows are stored as GGUF has them and computed one or two per register ([`Q6K`]); a batch
//! of many activation rows runs on slices widened to [`Q6KWide`]: sixteen rows per group, the
//! quants as bytes in steps of sixteen rows × four values, so one VNNI instruction (or AVX2's
//! `maddubs`) multiplies four quants of every row by the same four activation values and each
//! row's sum ends in its own lane. The integer sum of a block is exact in any order, so every
//! path gives the scalar reference's bits.

use half::f16;

use super::activations::{quantize_q8_k, Q8KBlock};
#[cfg(target_arch = "x86_64")]
use super::with_act_rows;
use super::{Isa, Kernel, TileOut};

pub(crate) const BLOCK_ELEMS: usize = 256;
pub(crate) const BLOCK_BYTES: usize = 210;
const QH: usize = 128;
const SCALES: usize = 192;
const D: usize = 208;
/// Runs of sixteen values per block, each with its own scale.
const RUNS: usize = 16;

/// Q6_K rows as GGUF stores them.
pub(crate) struct Q6K;

impl Kernel for Q6K {
    type Batched = Q6KWide;
    type Act = Q8KBlock;
    const BLOCK_ELEMS: usize = BLOCK_ELEMS;
    const BLOCK_BYTES: usize = BLOCK_BYTES;
    const ROW_GROUP: usize = 1;
    /// Widening unpacks and transposes every quant: worth it once a slice serves four tiles.
    const WIDEN_MIN_ROWS: usize = 16;

    fn widens(_isa: Isa) -> bool {
        true
    }

    fn widen(_isa: Isa, w: &[u8], nb: usize, out: &mut Vec<u8>) {
        let rows = w.len() / (nb * BLOCK_BYTES);
        let groups = rows.div_ceil(WIDE_GROUP);
        out.clear();
        out.resize(groups * nb * WIDE_GROUP_BLOCK, 0);
        let mut quants = [[0u8; BLOCK_ELEMS]; WIDE_GROUP];
        for (g, dst) in out.chunks_exact_mut(nb * WIDE_GROUP_BLOCK).enumerate() {
            let group_rows = (g * WIDE_GROUP..rows.min((g + 1) * WIDE_GROUP)).enumerate();
            for (b, gb) in dst.chunks_exact_mut(WIDE_GROUP_BLOCK).enumerate() {
                for (j, r) in group_rows.clone() {
                    let wb = &w[(r * nb + b) * BLOCK_BYTES..][..BLOCK_BYTES];
                    gb[WIDE_D + 4 * j..][..4].copy_from_slice(&scale(wb).to_le_bytes());
                    for run in 0..RUNS {
                        gb[WIDE_SCALES + WIDE_GROUP * run + j] = wb[SCALES + run];
                    }
                    unpack_quants(wb, &mut quants[j]);
                }
                // Step `s` holds values 4s..4s+4 of every row, row after row.
                for (step, dst) in gb[WIDE_QUANTS..]
                    .chunks_exact_mut(4 * WIDE_GROUP)
                    .enumerate()
                {
                    for (d, q) in dst.chunks_exact_mut(4).zip(&quants) {
                        d.copy_from_slice(&q[4 * step..4 * step + 4]);
                    }
                }
            }
        }
    }

    fn quantize(_isa: Isa, x: &[f32], out: &mut [Q8KBlock]) {
        quantize_q8_k(x, out);
    }

    fn scalar(w: &[u8], acts: &[Self::Act], nb: usize, out: TileOut<'_>) {
        for (r, wrow) in w.chunks_exact(nb * BLOCK_BYTES).enumerate() {
            for (a, arow) in acts.chunks_exact(nb).enumerate() {
                let mut acc = 0f32;
                for (wb, ab) in wrow.chunks_exact(BLOCK_BYTES).zip(arow) {
                    let mut q = [0u8; BLOCK_ELEMS];
                    unpack_quants(wb, &mut q);
                    let sum = block_sum(|i| q[i], |run| wb[SCALES + run] as i8, ab);
                    acc = (ab.d * scale(wb)).mul_add(sum as f32, acc);
                }
                out.set(a, r, acc);
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    unsafe fn simd(isa: Isa, w: &[u8], acts: &[Self::Act], nb: usize, out: TileOut<'_>) {
        let na = acts.len() / nb;
        // SAFETY: the caller's guarantees, passed on.
        unsafe {
            match isa {
                Isa::Avx512 => {
                    with_act_rows!(na, x86::avx512_rows(w, acts, nb, out))
                }
                _ => with_act_rows!(na, x86::rows(w, acts, nb, out)),
            }
        }
    }
}

/// Rows per group of the widened layout.
const WIDE_GROUP: usize = 16;
/// A group block of the widened layout: the sixteen rows' f32 scales `dw`, their run scales
/// (run after run, sixteen rows each), then 64 steps of sixteen rows × four quants (0..63).
const WIDE_D: usize = 0;
const WIDE_SCALES: usize = WIDE_D + 4 * WIDE_GROUP;
const WIDE_QUANTS: usize = WIDE_SCALES + RUNS * WIDE_GROUP;
const WIDE_GROUP_BLOCK: usize = WIDE_QUANTS + BLOCK_ELEMS * WIDE_GROUP;

/// Q6_K widened for batches: sixteen rows per group, quants one per byte (see `Q6K::widen`).
pub(crate) struct Q6KWide;

impl Kernel for Q6KWide {
    type Batched = Self;
    type Act = Q8KBlock;
    const BLOCK_ELEMS: usize = BLOCK_ELEMS;
    const BLOCK_BYTES: usize = WIDE_GROUP_BLOCK / WIDE_GROUP;
    const ROW_GROUP: usize = WIDE_GROUP;

    fn quantize(_isa: Isa, x: &[f32], out: &mut [Q8KBlock]) {
        quantize_q8_k(x, out);
    }

    fn scalar(w: &[u8], acts: &[Self::Act], nb: usize, out: TileOut<'_>) {
        for (g, group) in w.chunks_exact(nb * WIDE_GROUP_BLOCK).enumerate() {
            for (a, arow) in acts.chunks_exact(nb).enumerate() {
                for j in 0..WIDE_GROUP {
                    let mut acc = 0f32;
                    for (gb, ab) in group.chunks_exact(WIDE_GROUP_BLOCK).zip(arow) {
                        let quant =
                            |i: usize| gb[WIDE_QUANTS + (i / 4) * 4 * WIDE_GROUP + 4 * j + i % 4];
                        let run_scale = |run: usize| gb[WIDE_SCALES + WIDE_GROUP * run + j] as i8;
                        let sum = block_sum(quant, run_scale, ab);
                        let dw = f32::from_le_bytes(gb[WIDE_D + 4 * j..][..4].try_into().unwrap());
                        acc = (ab.d * dw).mul_add(sum as f32, acc);
                    }
                    out.set(a, g * WIDE_GROUP + j, acc);
                }
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    unsafe fn simd(isa: Isa, w: &[u8], acts: &[Self::Act], nb: usize, out: TileOut<'_>) {
        let na = acts.len() / nb;
        // SAFETY: the caller's guarantees, passed on.
        unsafe {
            match isa {
                Isa::Avx512 => with_act_rows!(na, x86::wide_avx512(w, acts, nb, out)),
                _ => with_act_rows!(na, x86::wide_avx2(w, acts, nb, out)),
            }
        }
    }
}

fn scale(b: &[u8]) -> f32 {
    f16::from_le_bytes([b[D], b[D + 1]]).to_f32()
}

/// A block's 256 quants (0..63) in order: value `128j + 32c + b` has the low four bits of
/// `ql[64j + 32(c % 2) + b]` (the low nibble for `c < 2`) and bits `2c..2c+2` of `qh[32j + b]`.
fn unpack_quants(wb: &[u8], out: &mut [u8; BLOCK_ELEMS]) {
    for j in 0..2 {
        let qh = &wb[QH + 32 * j..][..32];
        for c in 0..4 {
            let ql = &wb[64 * j + 32 * (c % 2)..][..32];
            let run = &mut out[128 * j + 32 * c..][..32];
            for ((q, &l), &h) in run.iter_mut().zip(ql).zip(qh) {
                let low = if c < 2 { l & 0xf } else { l >> 4 };
                *q = low | ((h >> (2 * c)) & 3) << 4;
            }
        }
    }
}

/// A block's exact integer `Σ_run sc_run (Σ_{i∈run} q_i a_i - 32 bsum_run)` (at most
/// `16 · 128 · (16 · 63 · 127 + 32 · 16 · 127) < 2^31`).
fn block_sum(quant: impl Fn(usize) -> u8, run_scale: impl Fn(usize) -> i8, ab: &Q8KBlock) -> i32 {
    (0..RUNS)
        .map(|run| {
            let dot: i32 = (16 * run..16 * run + 16)
                .map(|i| quant(i) as i32 * ab.qs[i] as i32)
                .sum();
            run_scale(run) as i32 * (dot - 32 * ab.bsums[run] as i32)
        })
        .sum()
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::super::row_pairs;

    /// Rows between the one computed and the one prefetched (into L2). The rows as stored are
    /// read one or two at a time with much work per byte, and from memory the hardware
    /// prefetcher did not keep up: Qwen3-0.6B's LM head (151,936 rows of 1,024) took 6.7 ms a
    /// token without it and 3.0 ms with it (`kernel_throughput`, AVX-512, alternated; two rows
    /// ahead 3.4 ms, eight 3.8 ms).
    const PREFETCH_ROWS_AHEAD: usize = 4;

    /// Asks for the block of the row `PREFETCH_ROWS_AHEAD` rows after the one at `p` (a block
    /// of the row being computed) to be brought into L2.
    #[inline(always)]
    fn prefetch_ahead(p: *const u8, row_bytes: usize) {
        let ahead = p.wrapping_add(PREFETCH_ROWS_AHEAD * row_bytes);
        for line in 0..BLOCK_BYTES.div_ceil(64) {
            // SAFETY: a prefetch never faults, whatever the address.
            unsafe { _mm_prefetch::<_MM_HINT_T1>(ahead.wrapping_add(64 * line) as *const i8) };
        }
    }
    use super::super::x86::pair;
    use super::{
        scale, Q8KBlock, TileOut, BLOCK_BYTES, QH, RUNS, SCALES, WIDE_D, WIDE_GROUP,
        WIDE_GROUP_BLOCK, WIDE_QUANTS, WIDE_SCALES,
    };

    /// Run `c`'s two scales of half `j` (one per 16 values) as sixteen i16 lanes.
    #[target_feature(enable = "avx2")]
    fn run_scales(sc: __m128i, c: usize) -> __m256i {
        let (lo, hi) = (2 * c as i8, 2 * c as i8 + 1);
        let pick = _mm_set_epi8(
            hi, hi, hi, hi, hi, hi, hi, hi, lo, lo, lo, lo, lo, lo, lo, lo,
        );
        _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sc, pick))
    }

    /// The sum of the eight i32 lanes of `lo` and of `hi`, in lanes 0 and 1 (2 and 3 repeat
    /// them).
    #[target_feature(enable = "avx2")]
    fn lane_sums(lo: __m256i, hi: __m256i) -> __m128i {
        let t = _mm256_hadd_epi32(lo, hi);
        let t = _mm256_hadd_epi32(t, t);
        _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256::<1>(t))
    }

    /// Four activation values (from byte `at`) as one i32, broadcast.
    #[inline(always)]
    fn four(ab: &Q8KBlock, at: usize) -> i32 {
        super::super::four_values(&ab.qs, at)
    }

    /// Two weight rows per register (row `r` in the low eight lanes, `r + 1` in the high
    /// eight), sharing each activation load; each row's eight lane sums of a block are added
    /// into its integer before the multiply-add.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub(super) unsafe fn avx512_rows<const NA: usize>(
        w: &[u8],
        acts: &[Q8KBlock],
        nb: usize,
        out: TileOut<'_>,
    ) {
        let m4 = _mm512_set1_epi8(0xf);
        let m2 = _mm512_set1_epi8(3);
        let rows = w.len() / (nb * BLOCK_BYTES);
        for (r, w0, w1) in row_pairs(w, nb * BLOCK_BYTES) {
            // Lane 0: row r, lane 1: row r + 1.
            let mut acc = [_mm_setzero_ps(); NA];
            for b in 0..nb {
                let p = [
                    w0[b * BLOCK_BYTES..].as_ptr(),
                    w1[b * BLOCK_BYTES..].as_ptr(),
                ];
                prefetch_ahead(p[0], nb * BLOCK_BYTES);
                prefetch_ahead(p[1], nb * BLOCK_BYTES);
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
                for a in 0..NA {
                    let ab = &acts[a * nb + b];
                    // SAFETY: `bsums` is 32 bytes.
                    let bsums = _mm512_broadcast_i64x4(unsafe {
                        _mm256_loadu_si256(ab.bsums.as_ptr() as *const __m256i)
                    });
                    let offset = _mm512_slli_epi32::<5>(_mm512_madd_epi16(bsums, all_scales));
                    let sumi = _mm512_sub_epi32(sumi[a], offset);
                    let sums = lane_sums(
                        _mm512_castsi512_si256(sumi),
                        _mm512_extracti64x4_epi64::<1>(sumi),
                    );
                    let d = _mm_setr_ps(ab.d * dx.0, ab.d * dx.1, 0.0, 0.0);
                    acc[a] = _mm_fmadd_ps(d, _mm_cvtepi32_ps(sums), acc[a]);
                }
            }
            for (a, acc) in acc.iter().enumerate() {
                let mut lanes = [0f32; 4];
                _mm_storeu_ps(lanes.as_mut_ptr(), *acc);
                for (h, &value) in lanes[..2].iter().enumerate() {
                    if r + h < rows {
                        out.set(a, r + h, value);
                    }
                }
            }
        }
    }

    /// One row per register (AVX2); each block's eight lane sums added into its integer
    /// before the multiply-add.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn rows<const NA: usize>(
        w: &[u8],
        acts: &[Q8KBlock],
        nb: usize,
        out: TileOut<'_>,
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
            let mut acc = [0f32; NA];
            for b in 0..nb {
                let wb = &wrow[b * BLOCK_BYTES..(b + 1) * BLOCK_BYTES];
                let dx = scale(wb);
                let p = wb.as_ptr();
                prefetch_ahead(p, nb * BLOCK_BYTES);
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
                for a in 0..NA {
                    let ab = &acts[a * nb + b];
                    // SAFETY: `bsums` is 32 bytes.
                    let bsums = unsafe { _mm256_loadu_si256(ab.bsums.as_ptr() as *const __m256i) };
                    let offset = _mm256_slli_epi32::<5>(_mm256_madd_epi16(bsums, all_scales));
                    let sumi = _mm256_sub_epi32(sumi[a], offset);
                    let sum = _mm_cvtsi128_si32(lane_sums(sumi, _mm256_setzero_si256()));
                    acc[a] = (ab.d * dx).mul_add(sum as f32, acc[a]);
                }
            }
            for (a, acc) in acc.iter().enumerate() {
                out.set(a, r, *acc);
            }
        }
    }

    /// The widened layout, a group's sixteen rows per register: each run's four steps in one
    /// VNNI chain per activation row, from `-32 bsum`, times the run's scales (one i32
    /// multiply), added into the block's integers.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
    pub(super) unsafe fn wide_avx512<const NA: usize>(
        w: &[u8],
        acts: &[Q8KBlock],
        nb: usize,
        out: TileOut<'_>,
    ) {
        for (g, group) in w.chunks_exact(nb * WIDE_GROUP_BLOCK).enumerate() {
            let mut acc = [_mm512_setzero_ps(); NA];
            for (b, gb) in group.chunks_exact(WIDE_GROUP_BLOCK).enumerate() {
                let p = gb.as_ptr();
                let ab: [&Q8KBlock; NA] = std::array::from_fn(|a| &acts[a * nb + b]);
                let mut sums = [_mm512_setzero_si512(); NA];
                for run in 0..RUNS {
                    // SAFETY: the group block holds the run's scales and its four steps.
                    let (sc, q) = unsafe {
                        let sc = _mm_loadu_si128(
                            p.add(WIDE_SCALES + WIDE_GROUP * run) as *const __m128i
                        );
                        let q: [__m512i; 4] = std::array::from_fn(|s| {
                            _mm512_loadu_si512(
                                p.add(WIDE_QUANTS + 64 * (4 * run + s)) as *const __m512i
                            )
                        });
                        (_mm512_cvtepi8_epi32(sc), q)
                    };
                    for (sum, ab) in sums.iter_mut().zip(ab) {
                        let mut dot = _mm512_set1_epi32(-32 * ab.bsums[run] as i32);
                        for (s, q) in q.iter().enumerate() {
                            let x = _mm512_set1_epi32(four(ab, 16 * run + 4 * s));
                            dot = _mm512_dpbusd_epi32(dot, *q, x);
                        }
                        *sum = _mm512_add_epi32(*sum, _mm512_mullo_epi32(dot, sc));
                    }
                }
                // SAFETY: the sixteen f32 scales open the group block.
                let dw = unsafe { _mm512_loadu_ps(p.add(WIDE_D) as *const f32) };
                for a in 0..NA {
                    let d = _mm512_mul_ps(_mm512_set1_ps(ab[a].d), dw);
                    acc[a] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(sums[a]), acc[a]);
                }
            }
            for (a, acc) in acc.iter().enumerate() {
                _mm512_storeu_ps(out.at(a, g * WIDE_GROUP), *acc);
            }
        }
    }

    /// [`wide_avx512`] with AVX2: half a group (eight rows) per register, the products
    /// through `maddubs` (quants unsigned, at most `2 · 63 · 127` per i16 pair). Two steps'
    /// products add up in i16 (`2 · 2 · 63 · 127 < 2^15`) before one `madd` by the run's
    /// scales (twice per row lane) into the block's integers, and the offset, `-32 Σ_run
    /// sc·bsum`, is taken once per block by `madd`s of two runs' scales and sums: a multiply
    /// per 16 products where a `madd` every step and an i32 multiply every run took 2.5.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn wide_avx2<const NA: usize>(
        w: &[u8],
        acts: &[Q8KBlock],
        nb: usize,
        out: TileOut<'_>,
    ) {
        for (g, group) in w.chunks_exact(nb * WIDE_GROUP_BLOCK).enumerate() {
            for h in 0..2 {
                let mut acc = [_mm256_setzero_ps(); NA];
                for (b, gb) in group.chunks_exact(WIDE_GROUP_BLOCK).enumerate() {
                    let p = gb.as_ptr();
                    let ab: [&Q8KBlock; NA] = std::array::from_fn(|a| &acts[a * nb + b]);
                    // SAFETY: run `run`'s eight scales of rows 8h.. inside the group block.
                    let scales = |run: usize| unsafe {
                        _mm_loadl_epi64(
                            p.add(WIDE_SCALES + WIDE_GROUP * run + 8 * h) as *const __m128i
                        )
                    };
                    let mut sums = [_mm256_setzero_si256(); NA];
                    for pair in 0..RUNS / 2 {
                        // Runs 2·pair and 2·pair + 1's scales side by side in each row's lane.
                        let sc = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(
                            scales(2 * pair),
                            scales(2 * pair + 1),
                        ));
                        for (sum, ab) in sums.iter_mut().zip(ab) {
                            let bsums = (ab.bsums[2 * pair] as u16 as u32)
                                | (ab.bsums[2 * pair + 1] as u16 as u32) << 16;
                            let dot = _mm256_madd_epi16(sc, _mm256_set1_epi32(bsums as i32));
                            *sum = _mm256_sub_epi32(*sum, _mm256_slli_epi32::<5>(dot));
                        }
                    }
                    for run in 0..RUNS {
                        // Each row's scale in both i16 halves of its lane.
                        let sc8 = scales(run);
                        let sc = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(sc8, sc8));
                        // SAFETY: the run's four steps of rows 8h.. inside the group block.
                        let q: [__m256i; 4] = std::array::from_fn(|s| unsafe {
                            _mm256_loadu_si256(
                                p.add(WIDE_QUANTS + 64 * (4 * run + s) + 32 * h) as *const __m256i
                            )
                        });
                        for (sum, ab) in sums.iter_mut().zip(ab) {
                            let x: [__m256i; 4] = std::array::from_fn(|s| {
                                _mm256_set1_epi32(four(ab, 16 * run + 4 * s))
                            });
                            for k in 0..2 {
                                let pairs = _mm256_add_epi16(
                                    _mm256_maddubs_epi16(q[2 * k], x[2 * k]),
                                    _mm256_maddubs_epi16(q[2 * k + 1], x[2 * k + 1]),
                                );
                                *sum = _mm256_add_epi32(*sum, _mm256_madd_epi16(pairs, sc));
                            }
                        }
                    }
                    // SAFETY: the sixteen f32 scales open the group block.
                    let dw = unsafe { _mm256_loadu_ps(p.add(WIDE_D + 32 * h) as *const f32) };
                    for a in 0..NA {
                        let d = _mm256_mul_ps(_mm256_set1_ps(ab[a].d), dw);
                        acc[a] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(sums[a]), acc[a]);
                    }
                }
                for (a, acc) in acc.iter().enumerate() {
                    _mm256_storeu_ps(out.at(a, g * WIDE_GROUP + 8 * h), *acc);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_util::{check_paths_agree, Rng};
    use super::super::{matmul, prepare, Isa, WeightFormat};
    use super::*;

    /// Quants at 63 or 0 (±32 from the offset), scales at -128 or 127, against activations
    /// all ±127, one row and a batch that runs widened: the i16 sums of products at their
    /// bound stay exact on every path.
    #[test]
    fn extreme_values_stay_exact() {
        let (rows, nb) = (16, 2);
        let in_dim = nb * BLOCK_ELEMS;
        for (quants, scale) in [(0xffu8, 0x80u8), (0xff, 0x7f), (0x00, 0x80), (0x00, 0x7f)] {
            let mut w = Vec::new();
            for _ in 0..rows * nb {
                w.extend(std::iter::repeat_n(quants, SCALES));
                w.extend(std::iter::repeat_n(scale, D - SCALES));
                w.extend_from_slice(&f16::from_f32(0.01).to_le_bytes());
            }
            let w = prepare(WeightFormat::Q6K, w, rows);
            for (sign, acts) in [(1.0f32, 1), (-1.0, 1), (1.0, 17), (-1.0, 17)] {
                let x = vec![sign; acts * in_dim];
                let reference = matmul(WeightFormat::Q6K, Isa::Scalar, &w, in_dim, rows, &x);
                assert!(reference.iter().all(|&v| v == reference[0] && v != 0.0));
                for isa in Isa::available() {
                    let got = matmul(WeightFormat::Q6K, isa, &w, in_dim, rows, &x);
                    assert_eq!(
                        got, reference,
                        "{isa:?} {quants:#x} {scale:#x} {sign} {acts}"
                    );
                }
            }
        }
    }

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
