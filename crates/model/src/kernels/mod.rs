//! Our quantized matmul `y = x · Wᵀ` over GGUF weight blocks (Q8_0, Q5_0, Q4_0, Q4_K and Q5_K
//! interleaved at load; Q6_K as stored).
//!
//! Activation rows are quantized as ggml does on x86 (Q8_0 blocks of 32 for Q8_0 weights, Q8_K
//! blocks of 256 for K-quants), but for the LM head's, whose Q8_0 blocks are pair-bound (see
//! `q8_0::Q8_0PairBound`); dot products are exact integers per block, and each format has one
//! order of its f32 steps, whatever the number of rows:
//!
//! - Q8_0, Q5_0 and Q4_0: one f32 accumulator per row and column, each block's integer dot
//!   product taken in by one fused multiply-add with `dw·da` (see `q8_0`; a Q5_0 or Q4_0 weight
//!   gives the bits of its values stored as Q8_0);
//! - Q4_K and Q5_K: ggml's repacked `q4_K_8x8` gemv, an integer per row for the scaled quants
//!   and one for the mins, each into its own f32 accumulator once per block (see `q4_k`);
//! - Q6_K: one f32 accumulator per row and column, each block's exact integer (its sixteen runs
//!   times their scales) taken in by one fused multiply-add (see `q6_k`).
//!
//! Each scalar reference computes exactly what its SIMD paths compute, so all paths give the same
//! bits, and a row's result never depends on the other rows or on how the work is tiled (batch
//! invariance): a row computed in a prompt of 500 tokens, in a decode step or in a training
//! batch is the same number.
//!
//! Threads split the weight rows; within a thread, a cache-sized slice of weight rows is reused
//! by groups of up to four activation rows, so a batch reads each weight block once. Within a
//! group the AVX2 kernels unpack each weight step once for all its activation rows, and run
//! their step loops as loops (`black_box` trip counts): fully unrolled, LLVM hoists every
//! step's weights ahead of their uses and spills them.

mod activations;
mod q4_k;
mod q5_0;
mod q6_k;
mod q8_0;
mod q8_0_pairs;
#[cfg(test)]
pub(crate) mod test_util;

use std::sync::OnceLock;

use rayon::prelude::*;

pub(crate) use activations::{quantize_gradient, Q8_0Block};

/// The instruction set a kernel runs with, ordered from least to best.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Isa {
    /// Lane-emulating reference (any CPU).
    Scalar,
    /// AVX2 + FMA + F16C: eight rows per register, the same arithmetic.
    Avx2,
    /// AVX-512 (F, BW, VL, VNNI): sixteen rows per register (two for Q6_K), same arithmetic.
    Avx512,
}

impl Isa {
    /// The instruction set the kernels run with (decided once): the best this CPU has, or a
    /// lesser one named by `TEMPER_ISA` (see [`selected_isa`]).
    pub(crate) fn detect() -> Isa {
        static ISA: OnceLock<Isa> = OnceLock::new();
        *ISA.get_or_init(|| {
            let best = Isa::best();
            Isa::from_env(best).unwrap_or(best)
        })
    }

    /// `TEMPER_ISA` (`scalar`, `avx2` or `avx512`), when set: an error when it names an
    /// instruction set this CPU lacks or none at all.
    fn from_env(best: Isa) -> Result<Isa, String> {
        let Ok(name) = std::env::var("TEMPER_ISA") else {
            return Ok(best);
        };
        let isa = match name.as_str() {
            "scalar" => Isa::Scalar,
            "avx2" => Isa::Avx2,
            "avx512" => Isa::Avx512,
            _ => {
                return Err(format!(
                    "TEMPER_ISA={name}: expected scalar, avx2 or avx512"
                ))
            }
        };
        if isa > best {
            return Err(format!(
                "TEMPER_ISA={name}: this CPU's best instruction set is {}",
                best.name()
            ));
        }
        Ok(isa)
    }

    pub(crate) fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
        }
    }

    /// The best instruction set this CPU has.
    fn best() -> Isa {
        {
            #[cfg(target_arch = "x86_64")]
            {
                let base = is_x86_feature_detected!("avx2")
                    && is_x86_feature_detected!("fma")
                    && is_x86_feature_detected!("f16c");
                let avx512 = is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vl")
                    && is_x86_feature_detected!("avx512vnni");
                if base && avx512 {
                    return Isa::Avx512;
                }
                if base {
                    return Isa::Avx2;
                }
            }
            Isa::Scalar
        }
    }

    /// The instruction sets usable here, for tests comparing them.
    #[cfg(test)]
    pub(crate) fn available() -> Vec<Isa> {
        match Isa::best() {
            Isa::Avx512 => vec![Isa::Scalar, Isa::Avx2, Isa::Avx512],
            Isa::Avx2 => vec![Isa::Scalar, Isa::Avx2],
            Isa::Scalar => vec![Isa::Scalar],
        }
    }
}

/// The instruction set the kernels run with (`scalar`, `avx2` or `avx512`): the best this CPU
/// has, or the lesser one `TEMPER_ISA` names (to measure the AVX2 path on an AVX-512 host). An
/// error when `TEMPER_ISA` names none or one this CPU lacks: the commands check it at start.
pub fn selected_isa() -> Result<&'static str, String> {
    Isa::from_env(Isa::best())?;
    Ok(Isa::detect().name())
}

/// The weight block formats our kernels compute on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum WeightFormat {
    Q8_0,
    /// Q8_0 weights against pair-bound activations (see `q8_0::Q8_0PairBound`).
    Q8_0PairBound,
    Q5_0,
    Q4_0,
    Q4K,
    Q5K,
    Q6K,
}

impl WeightFormat {
    /// Elements per weight block.
    pub(crate) fn block_elems(self) -> usize {
        match self {
            WeightFormat::Q8_0
            | WeightFormat::Q8_0PairBound
            | WeightFormat::Q5_0
            | WeightFormat::Q4_0 => q8_0::BLOCK_ELEMS,
            WeightFormat::Q4K | WeightFormat::Q5K => q4_k::BLOCK_ELEMS,
            WeightFormat::Q6K => q6_k::BLOCK_ELEMS,
        }
    }
}

/// One weight format's kernel: the activation block it pairs with and the tile it computes.
pub(crate) trait Kernel {
    type Act: Copy + Default + Send + Sync;
    const BLOCK_ELEMS: usize;
    /// Weight bytes per block of one row.
    const BLOCK_BYTES: usize;
    /// Rows stored together (interleaved); the weight is padded to a whole number of groups.
    const ROW_GROUP: usize;
    /// The kernel a batch of at least `WIDEN_MIN_ROWS` activation rows runs on where
    /// [`Kernel::widens`], over slices of the weight that [`Kernel::widen`] copies into its
    /// layout (it quantizes the activations its own way).
    type Batched: Kernel;
    /// Whether batches run on `Batched` with instruction set `isa`. A packing that takes work to
    /// unpack is unpacked once per slice instead of once per tile of activation rows.
    fn widens(_isa: Isa) -> bool {
        false
    }
    /// Copies a slice of whole row groups (`nb` blocks per row) into `Batched`'s layout
    /// (`out`; a last group of `Batched` short of rows is padded with rows of zeros). Called
    /// only where [`Kernel::widens`].
    fn widen(_isa: Isa, _w: &[u8], _nb: usize, _out: &mut Vec<u8>) {
        unreachable!("a kernel that widens defines `widen`")
    }
    /// Fewest activation rows for which a batch runs on the widened weight: below it, widening
    /// a slice costs more than the tiles it would speed up.
    const WIDEN_MIN_ROWS: usize = ACT_TILE + 1;
    /// Quantizes one activation row (`x.len()` a multiple of `BLOCK_ELEMS`).
    fn quantize(isa: Isa, x: &[f32], out: &mut [Self::Act]);
    /// `out(a, r) = dot(acts row a, w row r)` for the (at most four) activation rows of `acts`
    /// (`nb` blocks each) and every weight row `r` of `w` (`nb` blocks each): the reference.
    fn scalar(w: &[u8], acts: &[Self::Act], nb: usize, out: TileOut<'_>);
    /// Whether the kernel takes a batch's row groups two at a time with instruction set `isa`
    /// (slices then hold whole pairs).
    fn pairs_groups(_isa: Isa) -> bool {
        false
    }
    /// The same with `isa`'s instructions.
    ///
    /// # Safety
    /// The CPU must have `isa`'s features, and the slices must pass `check_tile`.
    #[cfg(target_arch = "x86_64")]
    unsafe fn simd(isa: Isa, w: &[u8], acts: &[Self::Act], nb: usize, out: TileOut<'_>);
}

/// Where a tile's results go: for each of its activation rows, the place of its value for the
/// tile's first weight row, with room for `cols` values. The rows need not be evenly spaced:
/// a matmul's kernels write each sequence's logits in place (see `matmul_slices`).
#[derive(Clone, Copy)]
pub(crate) struct TileOut<'a> {
    rows: [*mut f32; ACT_TILE],
    na: usize,
    cols: usize,
    _rows: std::marker::PhantomData<&'a mut [f32]>,
}

impl<'a> TileOut<'a> {
    /// `na` rows of `buf`, `stride` values apart, `stride` values each.
    pub(crate) fn buffer(buf: &'a mut [f32], na: usize, stride: usize) -> Self {
        assert!(na <= ACT_TILE && buf.len() >= na * stride);
        // SAFETY: row `a < na` has `stride` values of `buf` from `a * stride` (checked above),
        // and the rows do not overlap.
        unsafe {
            Self::from_rows(
                std::array::from_fn(|a| buf.as_mut_ptr().wrapping_add(a * stride)),
                na,
                stride,
            )
        }
    }

    /// # Safety
    /// Each of the first `na` pointers (at most `ACT_TILE`) has `cols` writable values from it,
    /// which no one else reads or writes while `'a` lasts, and the rows do not overlap.
    unsafe fn from_rows(rows: [*mut f32; ACT_TILE], na: usize, cols: usize) -> Self {
        TileOut {
            rows,
            na,
            cols,
            _rows: std::marker::PhantomData,
        }
    }

    /// Stores the value of activation row `a` and weight row `c`.
    pub(crate) fn set(self, a: usize, c: usize, value: f32) {
        assert!(a < self.na && c < self.cols);
        // SAFETY: in bounds (checked above).
        unsafe { *self.rows[a].add(c) = value };
    }

    /// The place of activation row `a`'s value for weight row `c` (for SIMD stores).
    ///
    /// # Safety
    /// `a` is below the tile's row count, and a store of `n` values there needs `c + n <= cols`.
    #[cfg(target_arch = "x86_64")]
    pub(crate) unsafe fn at(self, a: usize, c: usize) -> *mut f32 {
        // SAFETY: within the row (the caller's guarantee).
        unsafe { self.rows.get_unchecked(a).add(c) }
    }

    /// The activation rows from `a0` on, from weight row `c0` on.
    #[cfg(target_arch = "x86_64")]
    pub(crate) fn shifted(self, a0: usize, c0: usize) -> Self {
        assert!(a0 <= self.na && c0 <= self.cols);
        TileOut {
            rows: std::array::from_fn(|a| {
                self.rows
                    .get(a0 + a)
                    .map_or(std::ptr::null_mut(), |r| r.wrapping_add(c0))
            }),
            na: self.na - a0,
            cols: self.cols - c0,
            _rows: std::marker::PhantomData,
        }
    }
}

/// One tile (see `Kernel::scalar`) with the given instruction set.
fn tile<K: Kernel>(isa: Isa, w: &[u8], acts: &[K::Act], nb: usize, out: TileOut<'_>) {
    check_tile(w, K::BLOCK_BYTES, acts.len(), nb, out);
    match isa {
        Isa::Scalar => K::scalar(w, acts, nb, out),
        // SAFETY: `Isa::detect` (and `Isa::available`) name an x86 level only when the CPU has
        // its features; the bounds were checked above.
        #[cfg(target_arch = "x86_64")]
        isa => unsafe { K::simd(isa, w, acts, nb, out) },
        #[cfg(not(target_arch = "x86_64"))]
        _ => K::scalar(w, acts, nb, out),
    }
}

/// The bounds every tile relies on: whole weight rows, at most `ACT_TILE` whole activation
/// rows, and a place in `out` for each activation row's value of every weight row.
fn check_tile(w: &[u8], block_bytes: usize, act_blocks: usize, nb: usize, out: TileOut<'_>) {
    let rows = w.len() / (nb * block_bytes);
    let na = act_blocks / nb;
    assert!(w.len() == rows * nb * block_bytes && act_blocks == na * nb && na <= ACT_TILE);
    assert!(na == out.na && rows <= out.cols);
}

/// Most activation rows one tile computes (a weight block in registers serves them all).
const ACT_TILE: usize = 4;
/// Weight bytes kept hot while the activation groups go over them (about L1).
const WEIGHT_SLICE_BYTES: usize = 32 * 1024;
/// The same on AVX2 for a weight long enough to give every task many of them (the LM head):
/// slices the size of L2 stream the weight in longer runs. Two threads, 8 / 16 / 32 rows of
/// the LM head 8-12% faster than with L1 slices (`kernel_throughput`, x86-64-v3 build,
/// alternated with 32 KB slices on one host: AMD EPYC, avx2 avx512f avx512_vnni avx512_bf16;
/// 128 KB to 512 KB alike); on the layers' ~1 MB weights they left threads
/// idle at the end. AVX-512 prefetches each slice into L2 itself and reads it again from L1:
/// there long slices were 0-5% slower.
const LONG_WEIGHT_SLICE_BYTES: usize = 256 * 1024;
/// Long slices per task a weight must give to be cut into them.
const LONG_SLICES_PER_TASK: usize = 8;
/// Activation bytes a block of rows takes in a batch's pass over a task's weight slices (see
/// `product_slices`), and the most weight bytes a task may have for its rows to go in blocks:
/// together they fit a core's L2 (512 KB on the hosts measured).
const ACT_BLOCK_BYTES: usize = 64 * 1024;
const TASK_WEIGHT_L2_BYTES: usize = 384 * 1024;

/// Rows of a weight taken two at a time (the second repeats the last row when the count is
/// odd; its result is not stored).
#[cfg(target_arch = "x86_64")]
fn row_pairs(w: &[u8], row_bytes: usize) -> impl Iterator<Item = (usize, &[u8], &[u8])> {
    let rows = w.len() / row_bytes;
    (0..rows).step_by(2).map(move |r| {
        let r1 = (r + 1).min(rows - 1);
        (
            r,
            &w[r * row_bytes..(r + 1) * row_bytes],
            &w[r1 * row_bytes..(r1 + 1) * row_bytes],
        )
    })
}

/// `y = x · Wᵀ` for `W` `[out_dim, in_dim]` in `format` (as `prepare` lays it out) and `x`
/// holding `x.len() / in_dim` rows. `in_dim` must be a multiple of the block size. Each row's
/// result is the same bits whatever the other rows are.
#[cfg(test)]
pub(crate) fn matmul(
    format: WeightFormat,
    isa: Isa,
    w: &[u8],
    in_dim: usize,
    out_dim: usize,
    x: &[f32],
) -> Vec<f32> {
    matmul_on(format, isa, (w, None), (in_dim, out_dim), x, Threads::Pool)
}

/// `y = x · Wᵀ` (see `matmul`) on `threads` (the same bits either way): `Threads::Caller` for
/// a caller that runs several products in parallel itself.
pub(crate) fn matmul_on(
    format: WeightFormat,
    isa: Isa,
    w: Prepared<'_>,
    dims: (usize, usize),
    x: &[f32],
    threads: Threads,
) -> Vec<f32> {
    let rows = x.len() / dims.0.max(1);
    let mut parts = matmul_split(format, isa, w, dims, x, &[rows], threads);
    parts.pop().unwrap_or_default()
}

/// A prepared weight (`prepare`) and, where one was made, its copy in the layout its batches
/// run on (`widened`).
pub(crate) type Prepared<'a> = (&'a [u8], Option<&'a [u8]>);

/// The whole of a prepared weight `w` (`[out_dim, in_dim]`) in the layout `format`'s batches
/// run on with `isa` (see [`Kernel::widen`]), or none where they read it as stored. A product
/// given it ([`matmul_split`], [`matmul_into`]) skips widening each slice on every call: the
/// same bytes, so the same bits. Training keeps one (its batches of a few hundred rows widened
/// Qwen3-0.6B's Q6_K LM head once per 32-row chunk, ~4% of a step).
pub(crate) fn widened(format: WeightFormat, isa: Isa, w: &[u8], in_dim: usize) -> Option<Vec<u8>> {
    fn whole<K: Kernel>(isa: Isa, w: &[u8], in_dim: usize) -> Option<Vec<u8>> {
        K::widens(isa).then(|| {
            let mut out = Vec::new();
            K::widen(isa, w, in_dim / K::BLOCK_ELEMS, &mut out);
            out
        })
    }
    use q8_0::WithQ8_0Acts;
    match format {
        WeightFormat::Q8_0 => whole::<WithQ8_0Acts<q8_0::Q8_0>>(isa, w, in_dim),
        WeightFormat::Q8_0PairBound => whole::<WithQ8_0Acts<q8_0::Q8_0PairBound>>(isa, w, in_dim),
        WeightFormat::Q5_0 => whole::<WithQ8_0Acts<q5_0::Q5_0>>(isa, w, in_dim),
        WeightFormat::Q4_0 => whole::<WithQ8_0Acts<q5_0::Q4_0>>(isa, w, in_dim),
        WeightFormat::Q4K => whole::<q4_k::Q4K>(isa, w, in_dim),
        WeightFormat::Q5K => whole::<q4_k::Q5K>(isa, w, in_dim),
        WeightFormat::Q6K => whole::<q6_k::Q6K>(isa, w, in_dim),
    }
}

/// Where a product's tasks run: rayon's pool, or one after another on the calling thread.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Threads {
    Pool,
    Caller,
}

/// [`matmul`], its rows returned in consecutive parts of `counts[i]` rows each (summing to the
/// rows of `x`): the kernels write each part in place, so a caller that hands each part on
/// (the LM head's logits, one part per sequence) copies nothing. On
/// `threads`.
pub(crate) fn matmul_split(
    format: WeightFormat,
    isa: Isa,
    w: Prepared<'_>,
    dims: (usize, usize),
    x: &[f32],
    counts: &[usize],
    threads: Threads,
) -> Vec<Vec<f32>> {
    let (in_dim, out_dim) = dims;
    let rows = x.len() / in_dim.max(1);
    assert_eq!(
        counts.iter().sum::<usize>(),
        rows,
        "parts of the output's rows"
    );
    // Not zeroed: the kernels write every value (zeroing took ~5% of a prefill step).
    let mut parts: Vec<Vec<f32>> = counts
        .iter()
        .map(|&n| Vec::with_capacity(n * out_dim))
        .collect();
    let out = OutRows {
        rows: parts
            .iter_mut()
            .zip(counts)
            // SAFETY: row `i` of a part of `n` rows starts within its capacity.
            .flat_map(|(part, &n)| (0..n).map(|i| unsafe { part.as_mut_ptr().add(i * out_dim) }))
            .collect(),
        width: out_dim,
    };
    dispatch(format, isa, w, dims, x, &out, threads);
    for (part, &n) in parts.iter_mut().zip(counts) {
        // SAFETY: the kernels wrote all `n * out_dim` values of every row (within the capacity).
        unsafe { part.set_len(n * out_dim) };
    }
    parts
}

/// [`matmul`] into `out` (the product's rows, row-major; its length exactly that): a caller
/// that keeps one buffer for many products writes into memory it has touched before. Fresh
/// pages for each product of the LM head (33 MB for 32 rows of Gemma 3's) made 32 rows ~1.7x
/// slower than into a kept buffer (`kernel_throughput`: 20 ms against 11.5 ms).
pub(crate) fn matmul_into(
    format: WeightFormat,
    isa: Isa,
    w: Prepared<'_>,
    dims: (usize, usize),
    x: &[f32],
    out: &mut [f32],
) {
    let (in_dim, out_dim) = dims;
    let rows = x.len() / in_dim.max(1);
    assert_eq!(out.len(), rows * out_dim, "the product's rows");
    let out = OutRows {
        // SAFETY: row `r` starts inside `out` and has `out_dim` values there (checked above).
        rows: (0..rows)
            .map(|r| unsafe { out.as_mut_ptr().add(r * out_dim) })
            .collect(),
        width: out_dim,
    };
    dispatch(format, isa, w, dims, x, &out, Threads::Pool);
}

/// The product into `out`'s rows on `format`'s kernel.
fn dispatch(
    format: WeightFormat,
    isa: Isa,
    w: Prepared<'_>,
    dims: (usize, usize),
    x: &[f32],
    out: &OutRows,
    threads: Threads,
) {
    use q8_0::WithQ8_0Acts;
    let (d, t) = (dims, threads);
    match format {
        WeightFormat::Q8_0 => matmul_with::<WithQ8_0Acts<q8_0::Q8_0>>(isa, w, d, x, out, t),
        WeightFormat::Q8_0PairBound => {
            matmul_with::<WithQ8_0Acts<q8_0::Q8_0PairBound>>(isa, w, d, x, out, t)
        }
        WeightFormat::Q5_0 => matmul_with::<WithQ8_0Acts<q5_0::Q5_0>>(isa, w, d, x, out, t),
        WeightFormat::Q4_0 => matmul_with::<WithQ8_0Acts<q5_0::Q4_0>>(isa, w, d, x, out, t),
        WeightFormat::Q4K => matmul_with::<q4_k::Q4K>(isa, w, d, x, out, t),
        WeightFormat::Q5K => matmul_with::<q4_k::Q5K>(isa, w, d, x, out, t),
        WeightFormat::Q6K => matmul_with::<q6_k::Q6K>(isa, w, d, x, out, t),
    }
}

/// The weight bytes the kernels read, from GGUF blocks (`[out_dim, in_dim]`, row-major), in
/// huge pages where the host gives them (streamed once a step, see `pages`).
pub(crate) fn prepare(format: WeightFormat, gguf: Vec<u8>, out_dim: usize) -> Vec<u8> {
    let prepared = match format {
        WeightFormat::Q8_0 | WeightFormat::Q8_0PairBound => {
            q8_0::interleave_owned::<q8_0::Q8_0>(gguf, out_dim)
        }
        WeightFormat::Q5_0 => q8_0::interleave_owned::<q5_0::Q5_0>(gguf, out_dim),
        WeightFormat::Q4_0 => q8_0::interleave_owned::<q5_0::Q4_0>(gguf, out_dim),
        WeightFormat::Q4K => q4_k::Q4K::interleave(&gguf, out_dim),
        WeightFormat::Q5K => q4_k::Q5K::interleave(&gguf, out_dim),
        WeightFormat::Q6K => gguf,
    };
    crate::pages::collapse_into_huge_pages(&prepared);
    prepared
}

/// Rows `rows` of a prepared weight `[out_dim, in_dim]` (dims `(in_dim, out_dim)`) in f32, each
/// value `d * q` as GGUF dequantization computes it.
pub(crate) fn dequantize_rows(
    format: WeightFormat,
    w: &[u8],
    dims: (usize, usize),
    rows: &[usize],
) -> Result<Vec<f32>, candle_core::Error> {
    let (in_dim, out_dim) = dims;
    if let Some(&bad) = rows.iter().find(|&&r| r >= out_dim) {
        candle_core::bail!("row {bad} of a weight with {out_dim} rows");
    }
    match format {
        WeightFormat::Q8_0 | WeightFormat::Q8_0PairBound => {
            Ok(q8_0::dequantize_rows::<q8_0::Q8_0>(w, in_dim, rows))
        }
        WeightFormat::Q5_0 => Ok(q8_0::dequantize_rows::<q5_0::Q5_0>(w, in_dim, rows)),
        WeightFormat::Q4_0 => Ok(q8_0::dequantize_rows::<q5_0::Q4_0>(w, in_dim, rows)),
        WeightFormat::Q4K | WeightFormat::Q5K | WeightFormat::Q6K => {
            // GGUF blocks (the K-quants' taken back out of the interleaved layout): candle reads
            // them.
            let (dtype, bytes) = match format {
                WeightFormat::Q4K => (
                    candle_core::quantized::GgmlDType::Q4K,
                    q4_k::Q4K::gguf_rows(w, in_dim, rows),
                ),
                WeightFormat::Q5K => (
                    candle_core::quantized::GgmlDType::Q5K,
                    q4_k::Q5K::gguf_rows(w, in_dim, rows),
                ),
                _ => {
                    let row_bytes = in_dim / format.block_elems() * q6_k::BLOCK_BYTES;
                    let bytes = rows
                        .iter()
                        .flat_map(|&r| &w[r * row_bytes..(r + 1) * row_bytes])
                        .copied()
                        .collect();
                    (candle_core::quantized::GgmlDType::Q6K, bytes)
                }
            };
            let storage = candle_core::quantized::QStorage::from_data(
                std::borrow::Cow::Owned(bytes),
                &candle_core::Device::Cpu,
                dtype,
            )?;
            candle_core::quantized::QTensor::new(storage, (rows.len(), in_dim))?
                .dequantize(&candle_core::Device::Cpu)?
                .flatten_all()?
                .to_vec1()
        }
    }
}

/// Wᵀ of rows `rows` of a prepared weight `[out_dim, in_dim]` (dims `(in_dim, out_dim)`), as a
/// prepared Q8_0 weight `[in_dim, rows.len()]`: each block of 32 frozen values down a column
/// requantized as ggml's `quantize_row_q8_0` does. Training's `dx = dy · W` then runs through
/// `matmul` as int8 dot products instead of f32 products over a dequantized copy (4x the
/// bytes). `rows` must be whole blocks of 32.
pub(crate) fn transposed_q8_0(
    format: WeightFormat,
    w: &[u8],
    dims: (usize, usize),
    rows: std::ops::Range<usize>,
) -> Result<Vec<u8>, candle_core::Error> {
    let (in_dim, out_dim) = dims;
    let (bb, be) = (q8_0::BLOCK_BYTES, q8_0::BLOCK_ELEMS);
    if !rows.start.is_multiple_of(be) || !rows.len().is_multiple_of(be) || rows.end > out_dim {
        candle_core::bail!("transposing rows {rows:?} of [{out_dim}, {in_dim}]: not whole blocks");
    }
    let blocks_per_row = rows.len() / be;
    let mut gguf = vec![0u8; in_dim * blocks_per_row * bb];
    // A few block rows at a time: each is dequantized once (32 weight rows) and cut into its
    // columns' blocks; the batch bounds what is held besides the result.
    const BATCH: usize = 64;
    for b0 in (0..blocks_per_row).step_by(BATCH) {
        let b1 = (b0 + BATCH).min(blocks_per_row);
        let batch: Vec<Vec<u8>> = (b0..b1)
            .into_par_iter()
            .map(|b| {
                let first = rows.start + b * be;
                let values = dequantize_rows(format, w, dims, &Vec::from_iter(first..first + be))?;
                // The block row's columns side by side, quantized in one call on the SIMD
                // quantizer (the scalar one's bits).
                let mut columns = vec![0f32; in_dim * be];
                for (j, row) in values.chunks_exact(in_dim).enumerate() {
                    for (c, &v) in row.iter().enumerate() {
                        columns[c * be + j] = v;
                    }
                }
                let mut quantized = vec![Q8_0Block::default(); in_dim];
                activations::quantize_q8_0(Isa::detect(), &columns, &mut quantized);
                let mut blocks = vec![0u8; in_dim * bb];
                for (block, q) in blocks.chunks_exact_mut(bb).zip(&quantized) {
                    q8_0::store_block(q, block);
                }
                Ok(blocks)
            })
            .collect::<Result<_, candle_core::Error>>()?;
        for (b, blocks) in (b0..).zip(&batch) {
            for (c, block) in blocks.chunks_exact(bb).enumerate() {
                let at = (c * blocks_per_row + b) * bb;
                gguf[at..at + bb].copy_from_slice(block);
            }
        }
    }
    let transposed = q8_0::interleave_owned::<q8_0::Q8_0>(gguf, in_dim);
    crate::pages::collapse_into_huge_pages(&transposed);
    Ok(transposed)
}

fn matmul_with<K: Kernel>(
    isa: Isa,
    (w, widened): Prepared<'_>,
    dims: (usize, usize),
    x: &[f32],
    out: &OutRows,
    threads: Threads,
) {
    let (in_dim, out_dim) = dims;
    assert!(in_dim > 0 && in_dim.is_multiple_of(K::BLOCK_ELEMS));
    let nb = in_dim / K::BLOCK_ELEMS;
    let row_bytes = nb * K::BLOCK_BYTES;
    let padded_rows = out_dim.next_multiple_of(K::ROW_GROUP);
    assert_eq!(
        w.len(),
        row_bytes * padded_rows,
        "weight bytes for [{out_dim}, {in_dim}]"
    );
    let stored = Stored {
        w,
        row_bytes,
        group: K::ROW_GROUP,
    };
    if x.len() / in_dim >= K::WIDEN_MIN_ROWS && K::widens(isa) {
        assert_eq!(K::Batched::BLOCK_ELEMS, K::BLOCK_ELEMS);
        if let Some(wide) = widened {
            let group = K::Batched::ROW_GROUP;
            let row_bytes = nb * K::Batched::BLOCK_BYTES;
            assert_eq!(wide.len(), row_bytes * out_dim.next_multiple_of(group));
            let wide = Stored {
                w: wide,
                row_bytes,
                group,
            };
            return matmul_slices::<K::Batched>(isa, wide, None, dims, x, out, threads);
        }
        // A widening batch spans several tiles (its slices are prefetched tile by tile).
        const { assert!(K::WIDEN_MIN_ROWS > ACT_TILE) };
        let widen = |ws: &[u8], out: &mut Vec<u8>| K::widen(isa, ws, nb, out);
        matmul_slices::<K::Batched>(isa, stored, Some(&widen), dims, x, out, threads)
    } else {
        matmul_slices::<K>(isa, stored, None, dims, x, out, threads)
    }
}

/// A weight as stored: its bytes, bytes per row, and rows per interleaved group.
#[derive(Clone, Copy)]
struct Stored<'a> {
    w: &'a [u8],
    row_bytes: usize,
    group: usize,
}

/// Copies a slice of the stored weight into `K`'s layout (see [`Kernel::widen`]).
type Widen<'a> = &'a (dyn Fn(&[u8], &mut Vec<u8>) + Sync);

/// `matmul_with` on kernel `K`, reading the weight as stored (`widen` none) or slices of it
/// widened into `K`'s layout.
fn matmul_slices<K: Kernel>(
    isa: Isa,
    stored: Stored,
    widen: Option<Widen>,
    dims: (usize, usize),
    x: &[f32],
    out: &OutRows,
    threads: Threads,
) {
    let (in_dim, out_dim) = dims;
    let nb = in_dim / K::BLOCK_ELEMS;
    let rows = x.len() / in_dim;
    if rows == 0 || out_dim == 0 {
        return;
    }
    let mut acts = vec![K::Act::default(); rows * nb];
    let quantize = |(a, xr): (&mut [K::Act], &[f32])| K::quantize(isa, xr, a);
    match threads {
        Threads::Pool => acts
            .par_chunks_mut(nb)
            .zip(x.par_chunks(in_dim))
            .with_min_len(16)
            .for_each(quantize),
        Threads::Caller => acts.chunks_mut(nb).zip(x.chunks(in_dim)).for_each(quantize),
    }
    product_slices::<K>(isa, stored, widen, dims, &acts, out, threads);
}

/// `y = x · Wᵀ` for a Q8_0 weight `[out_dim, in_dim]` (as `prepare` lays it out) and a
/// gradient's rows as `quantize_gradient` makes them (`acts`, `in_dim / 32` blocks a row), on
/// `threads`: `q8_0::WithGradActs`, which AVX2 runs without the sign trick, two steps' products
/// added in i16 per `madd`, or four where the gradient has no negative value (`non_negative`);
/// the same bits either way.
pub(crate) fn matmul_q8_0_blocks(
    isa: Isa,
    w: &[u8],
    dims: (usize, usize),
    acts: &[Q8_0Block],
    threads: Threads,
    non_negative: bool,
) -> Vec<f32> {
    type K = q8_0::WithGradActs<false>;
    debug_assert!(!non_negative || acts.iter().all(|b| b.qs.iter().all(|&q| q >= 0)));
    let (in_dim, out_dim) = dims;
    let nb = in_dim / K::BLOCK_ELEMS;
    assert!(in_dim > 0 && in_dim.is_multiple_of(K::BLOCK_ELEMS) && acts.len().is_multiple_of(nb));
    let row_bytes = nb * K::BLOCK_BYTES;
    assert_eq!(w.len(), row_bytes * out_dim.next_multiple_of(K::ROW_GROUP));
    let rows = acts.len() / nb;
    let mut y: Vec<f32> = Vec::with_capacity(rows * out_dim);
    let out = OutRows {
        // SAFETY: row `r` starts within `y`'s capacity of `rows * out_dim` values.
        rows: (0..rows)
            .map(|r| unsafe { y.as_mut_ptr().add(r * out_dim) })
            .collect(),
        width: out_dim,
    };
    let stored = Stored {
        w,
        row_bytes,
        group: K::ROW_GROUP,
    };
    match non_negative {
        true => {
            product_slices::<q8_0::WithGradActs<true>>(isa, stored, None, dims, acts, &out, threads)
        }
        false => product_slices::<K>(isa, stored, None, dims, acts, &out, threads),
    }
    // SAFETY: the kernels wrote every value of every row.
    unsafe { y.set_len(rows * out_dim) };
    y
}

/// [`matmul_slices`] after the quantization: the product of activation rows `acts` (`nb`
/// blocks each) with the weight.
fn product_slices<K: Kernel>(
    isa: Isa,
    stored: Stored,
    widen: Option<Widen>,
    dims: (usize, usize),
    acts: &[K::Act],
    out: &OutRows,
    threads: Threads,
) {
    let (in_dim, out_dim) = dims;
    let nb = in_dim / K::BLOCK_ELEMS;
    let rows = acts.len() / nb;
    assert!(
        out.rows.len() == rows && out.width == out_dim,
        "the output's rows"
    );
    if rows == 0 || out_dim == 0 {
        return;
    }

    // Slices of weight rows small enough to stay in L1 (L2 for long weights) while every
    // activation group passes (whole row groups); tasks of whole slices, a few per thread so
    // uneven progress evens out.
    let widened_row_bytes = (nb * K::BLOCK_BYTES).max(stored.row_bytes);
    let group = stored.group.max(K::ROW_GROUP).max(4);
    let max_tasks = rayon::current_num_threads() * 4;
    let long =
        out_dim * widened_row_bytes >= max_tasks * LONG_SLICES_PER_TASK * LONG_WEIGHT_SLICE_BYTES;
    let slice_bytes = if long && isa == Isa::Avx2 {
        LONG_WEIGHT_SLICE_BYTES
    } else {
        WEIGHT_SLICE_BYTES
    };
    // Whole pairs of groups where the kernel takes a batch's groups two at a time.
    let group = match rows > 1 && K::pairs_groups(isa) {
        true => 2 * group,
        false => group,
    };
    let slice_rows = (slice_bytes / widened_row_bytes / group).max(1) * group;
    let slices = out_dim.div_ceil(slice_rows);
    // Led by the team (a decode step): a task per thread, one contiguous share of the weight
    // each (four a thread measured 2-9% slower at one stream on AVX2, alternated runs).
    let tasks = match crate::team::leads() {
        true => rayon::current_num_threads(),
        false => max_tasks,
    }
    .min(slices);
    let task_rows = slices.div_ceil(tasks) * slice_rows;

    // Rows `s0..s1` of the stored weight, padded to its whole groups.
    let stored_rows = |s0: usize, s1: usize| {
        let held = (s1 - s0).next_multiple_of(stored.group);
        &stored.w[s0 * stored.row_bytes..(s0 + held) * stored.row_bytes]
    };
    let tiles = rows.div_ceil(ACT_TILE);
    // Activation rows one pass over a task's slices takes: where the task's share of the
    // weight stays in L2 (a layer's, read as stored), a block of rows stays there beside it
    // while the slices go past, instead of every slice streaming all the rows from L3. A
    // batch that widens, or a task's share too long for L2 (the LM head), takes all the rows
    // per slice: each slice is widened, and read from memory, once.
    let act_row_bytes = nb * std::mem::size_of::<K::Act>();
    let block_rows = match widen {
        None if task_rows * widened_row_bytes <= TASK_WEIGHT_L2_BYTES => {
            (ACT_BLOCK_BYTES / act_row_bytes / ACT_TILE).max(1) * ACT_TILE
        }
        _ => rows,
    };
    let task = |t: usize| {
        let mut buf = Vec::new();
        let mut wide = Vec::new();
        let end = ((t + 1) * task_rows).min(out_dim);
        for r0 in (0..rows).step_by(block_rows) {
            let r1 = (r0 + block_rows).min(rows);
            for s0 in (t * task_rows..end).step_by(slice_rows) {
                let s1 = (s0 + slice_rows).min(end);
                let mut ws = stored_rows(s0, s1);
                if let Some(widen) = widen {
                    widen(ws, &mut wide);
                    ws = &wide;
                }
                // Rows a tile computes (and `buf`'s stride): whole groups of `K`'s layout.
                let stride = (s1 - s0).next_multiple_of(K::ROW_GROUP);
                // The task's next slice, a share of it before each tile of a widening batch (see
                // `prefetch_share`; a batch widens from more than one tile of rows).
                let next = (widen.is_some() && s1 < end)
                    .then(|| stored_rows(s1, end.min(s1 + slice_rows)));
                for (t, a0) in (r0..r1).step_by(ACT_TILE).enumerate() {
                    let a1 = (a0 + ACT_TILE).min(r1);
                    if let Some(next) = next {
                        prefetch_share(next, t, tiles);
                    }
                    let acts = &acts[a0 * nb..a1 * nb];
                    if stride == s1 - s0 {
                        // SAFETY: this task alone writes columns `s0..s1` (its slices).
                        tile::<K>(isa, ws, acts, nb, unsafe { out.tile(a0..a1, s0, stride) });
                        continue;
                    }
                    // A slice short of whole groups: the kernel's padding rows go to `buf`.
                    buf.resize(ACT_TILE * stride, 0.0);
                    tile::<K>(
                        isa,
                        ws,
                        acts,
                        nb,
                        TileOut::buffer(&mut buf, a1 - a0, stride),
                    );
                    for a in a0..a1 {
                        let at = (a - a0) * stride;
                        out.write(a, s0, &buf[at..at + s1 - s0]);
                    }
                }
            }
        }
    };
    let tasks = out_dim.div_ceil(task_rows);
    match threads {
        Threads::Pool => crate::team::for_each(tasks, &task),
        Threads::Caller => (0..tasks).for_each(task),
    }
}

/// Asks for share `t` of `tiles` of `bytes` to be brought into L2: memory a loop reads next,
/// asked for a share per step of the loop before it (here the next weight slice; attention's
/// next cache block).
///
/// A batch that widens reads each slice in one go (`widen`) and waited for it to come from
/// memory, then computes for long on the widened copy (one tile of activation rows after
/// another). Asking for the next slice a share per tile overlaps that wait with the compute:
/// 16 and 32 rows of the LM head 5-10% faster on AVX2 (`kernel_throughput`, alternated; one or
/// two slices ahead, into L1 or L2, measured alike). Batches that read the stored weight
/// stream it tile by tile, which the hardware prefetcher follows: there the same prefetches
/// made 5-12 rows of the LM head 12-17% slower.
pub(crate) fn prefetch_share(bytes: &[u8], t: usize, tiles: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
        let lines = bytes.len().div_ceil(64);
        let (from, to) = (lines * t / tiles, lines * (t + 1) / tiles);
        for line in from..to {
            // SAFETY: a prefetch never faults, and the address lies inside `bytes`.
            unsafe { _mm_prefetch::<_MM_HINT_T1>(bytes.as_ptr().add(64 * line).cast()) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (bytes, t, tiles);
}

/// The output rows shared by the tasks (allocated, not yet initialized; `width` values each);
/// each task writes only its own columns.
struct OutRows {
    rows: Vec<*mut f32>,
    width: usize,
}

// SAFETY: tasks write disjoint column ranges of the rows (`write` checks the bounds), and the
// rows outlive the parallel loop that uses them.
unsafe impl Sync for OutRows {}

impl OutRows {
    /// Rows `rows` (at most `ACT_TILE`) from column `col` on, `cols` values each, for a tile to
    /// write in place.
    ///
    /// # Safety
    /// No other task writes or reads these columns of these rows while the tile lives.
    unsafe fn tile(&self, rows: std::ops::Range<usize>, col: usize, cols: usize) -> TileOut<'_> {
        assert!(rows.len() <= ACT_TILE && col + cols <= self.width);
        let ptrs = std::array::from_fn(|i| {
            self.rows
                .get(rows.start + i)
                .filter(|_| i < rows.len())
                .map_or(std::ptr::null_mut(), |r| r.wrapping_add(col))
        });
        // SAFETY: each row has `width` values of capacity (so `cols` from `col`), rows of the
        // output do not overlap, and the caller gives these columns to this tile alone.
        unsafe { TileOut::from_rows(ptrs, rows.len(), cols) }
    }

    fn write(&self, row: usize, col: usize, values: &[f32]) {
        assert!(col + values.len() <= self.width);
        // SAFETY: in bounds (checked above: `rows[row]` has `width` values of capacity); no
        // other task writes these columns.
        unsafe {
            std::ptr::copy_nonoverlapping(values.as_ptr(), self.rows[row].add(col), values.len());
        }
    }
}

/// Calls `$f::<NA>(args)` with `NA`, the number of activation rows (1 to 4), as a constant.
#[cfg(target_arch = "x86_64")]
macro_rules! with_act_rows {
    ($na:expr, $($f:ident)::+($($arg:expr),*)) => {
        with_act_rows!($na, $($f)::+[]($($arg),*))
    };
    // `[C, ...]`: further const generic arguments after the row count.
    ($na:expr, $($f:ident)::+[$($c:tt),*]($($arg:expr),*)) => {
        match $na {
            1 => $($f)::+::<1 $(, $c)*>($($arg),*),
            2 => $($f)::+::<2 $(, $c)*>($($arg),*),
            3 => $($f)::+::<3 $(, $c)*>($($arg),*),
            _ => $($f)::+::<4 $(, $c)*>($($arg),*),
        }
    };
}
#[cfg(target_arch = "x86_64")]
use with_act_rows;

/// Four i8 values from `at` as one little-endian i32 (for a broadcast): one load, where four
/// byte reads at an offset not known at compile time are four loads, shifts and ors.
#[inline(always)]
pub(crate) fn four_values(qs: &[i8], at: usize) -> i32 {
    let four: &[i8; 4] = qs[at..at + 4].try_into().expect("four values");
    i32::from_le_bytes(four.map(|v| v as u8))
}

/// ggml's `hsum_float_8`: `((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7))`.
pub(crate) fn hsum8(l: &[f32; 8]) -> f32 {
    ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]))
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// Row `r0`'s eight lanes low, row `r1`'s high.
    #[target_feature(enable = "avx512f")]
    pub(super) fn pair(r0: __m256i, r1: __m256i) -> __m512i {
        _mm512_inserti64x4::<1>(_mm512_castsi256_si512(r0), r1)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::test_util::{cpu_seconds, random_gguf, Rng};
    use super::*;

    #[test]
    fn products_on_the_callers_thread_and_into_a_buffer_are_the_same_bits() {
        let mut rng = Rng::new(6);
        for (format, in_dim, out_dim) in [
            (WeightFormat::Q8_0, 64, 48),
            (WeightFormat::Q8_0, 640, 300),
            (WeightFormat::Q4K, 256, 40),
        ] {
            let blocks = in_dim / format.block_elems() * out_dim;
            let w = prepare(format, random_gguf(format, blocks, &mut rng), out_dim);
            let x: Vec<f32> = (0..9 * in_dim).map(|_| rng.uniform()).collect();
            for isa in Isa::available() {
                let whole = matmul(format, isa, &w, in_dim, out_dim, &x);
                let serial = matmul_on(
                    format,
                    isa,
                    (&w, None),
                    (in_dim, out_dim),
                    &x,
                    Threads::Caller,
                );
                assert_eq!(bits(&serial), bits(&whole), "{format:?} {isa:?}");
                let mut into = vec![7.5f32; 9 * out_dim];
                matmul_into(format, isa, (&w, None), (in_dim, out_dim), &x, &mut into);
                assert_eq!(bits(&into), bits(&whole), "{format:?} {isa:?}");
            }
        }

        fn bits(v: &[f32]) -> Vec<u32> {
            v.iter().map(|x| x.to_bits()).collect()
        }
    }

    /// A product given the weight widened whole (`widened`) is the bits of one that widens
    /// each slice, for every format that widens, rows short of a whole group included.
    #[test]
    fn a_weight_widened_once_gives_the_bits_of_one_widened_per_slice() {
        let mut rng = Rng::new(8);
        let mut checked = 0;
        for isa in Isa::available() {
            for (format, in_dim, out_dim) in [
                (WeightFormat::Q6K, 512, 40),
                (WeightFormat::Q8_0, 640, 300),
                (WeightFormat::Q5_0, 128, 37),
                (WeightFormat::Q4_0, 128, 48),
                (WeightFormat::Q4K, 256, 40),
            ] {
                let blocks = in_dim / format.block_elems() * out_dim;
                let w = prepare(format, random_gguf(format, blocks, &mut rng), out_dim);
                let Some(wide) = widened(format, isa, &w, in_dim) else {
                    continue;
                };
                for rows in [1, 5, 16, 37] {
                    let x: Vec<f32> = (0..rows * in_dim).map(|_| rng.uniform() - 0.5).collect();
                    let dims = (in_dim, out_dim);
                    let per_slice = matmul_on(format, isa, (&w, None), dims, &x, Threads::Pool);
                    let once = matmul_on(format, isa, (&w, Some(&wide)), dims, &x, Threads::Pool);
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(
                        bits(&once),
                        bits(&per_slice),
                        "{format:?} {isa:?} {rows} rows"
                    );
                }
                checked += 1;
            }
        }
        // Q6_K widens on every instruction set.
        assert!(checked >= Isa::available().len());
    }

    #[test]
    fn split_parts_are_the_rows_of_the_whole_product() {
        let mut rng = Rng::new(4);
        let (in_dim, out_dim) = (64, 48);
        let w = prepare(
            WeightFormat::Q8_0,
            random_gguf(WeightFormat::Q8_0, in_dim / 32 * out_dim, &mut rng),
            out_dim,
        );
        let x: Vec<f32> = (0..5 * in_dim).map(|_| rng.uniform()).collect();
        for isa in Isa::available() {
            let whole = matmul(WeightFormat::Q8_0, isa, &w, in_dim, out_dim, &x);
            let parts = matmul_split(
                WeightFormat::Q8_0,
                isa,
                (&w, None),
                (in_dim, out_dim),
                &x,
                &[2, 0, 3],
                Threads::Pool,
            );
            assert_eq!(parts.len(), 3);
            assert_eq!(parts[0], whole[..2 * out_dim], "{isa:?}");
            assert!(parts[1].is_empty());
            assert_eq!(parts[2], whole[2 * out_dim..], "{isa:?}");
        }
    }

    /// A batch of more rows than one block of `ACT_BLOCK_BYTES` (on a weight whose tasks fit
    /// L2, rows short of a whole group): each row's values are the bits of that row alone.
    #[test]
    fn rows_in_blocks_are_the_bits_of_each_row_alone() {
        let mut rng = Rng::new(11);
        let (in_dim, out_dim, rows) = (1024, 300, 150);
        for format in [
            WeightFormat::Q8_0PairBound,
            WeightFormat::Q4K,
            WeightFormat::Q8_0,
        ] {
            let blocks = in_dim / format.block_elems() * out_dim;
            let w = prepare(format, random_gguf(format, blocks, &mut rng), out_dim);
            let x: Vec<f32> = (0..rows * in_dim).map(|_| rng.uniform() - 0.5).collect();
            for isa in Isa::available() {
                let dims = (in_dim, out_dim);
                let batch = matmul_on(format, isa, (&w, None), dims, &x, Threads::Pool);
                for (r, row) in x.chunks(in_dim).enumerate() {
                    let alone = matmul_on(format, isa, (&w, None), dims, row, Threads::Caller);
                    let got = &batch[r * out_dim..(r + 1) * out_dim];
                    assert!(got == alone, "{format:?} {isa:?} row {r}");
                }
            }
        }
    }

    /// A weight long enough to be cut into long slices (on AVX2; one thread, so four tasks),
    /// its rows short of a whole group (the last slice's tile goes through a buffer, the others
    /// write in place): every path gives the scalar reference's bits, in every part.
    #[test]
    fn long_weights_give_the_reference_bits_in_every_part() {
        let mut rng = Rng::new(5);
        let (in_dim, format) = (640, WeightFormat::Q8_0PairBound);
        let row_bytes = in_dim / 32 * q8_0::BLOCK_BYTES;
        let out_dim = (4 * LONG_SLICES_PER_TASK * LONG_WEIGHT_SLICE_BYTES).div_ceil(row_bytes) + 9;
        assert_ne!(out_dim % 16, 0);
        let w = prepare(
            format,
            random_gguf(format, in_dim / 32 * out_dim, &mut rng),
            out_dim,
        );
        let x: Vec<f32> = (0..6 * in_dim).map(|_| rng.uniform() - 0.5).collect();
        let counts = [2, 0, 3, 1];
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .unwrap();
        let reference = matmul_split(
            format,
            Isa::Scalar,
            (&w, None),
            (in_dim, out_dim),
            &x,
            &counts,
            Threads::Pool,
        );
        for isa in Isa::available() {
            let parts = pool.install(|| {
                matmul_split(
                    format,
                    isa,
                    (&w, None),
                    (in_dim, out_dim),
                    &x,
                    &counts,
                    Threads::Pool,
                )
            });
            assert!(parts == reference, "{isa:?}");
        }
    }

    /// One tile (four activation rows) of the LM head's shape over one 32 KB weight slice,
    /// repeated while the slice stays in L1, on one thread: the kernels' own speed, without
    /// memory, threads or the output's copies (`cargo test --release -p temper-model --lib --
    /// --ignored --nocapture tile_throughput`; `TEMPER_ISA=avx2` for the AVX2 kernels).
    #[test]
    #[ignore]
    fn tile_throughput() {
        fn run<K: Kernel>(name: &str, isa: Isa, w: &[u8], x: &[f32], nb: usize, rows: usize) {
            let in_dim = nb * K::BLOCK_ELEMS;
            let mut acts = vec![K::Act::default(); ACT_TILE * nb];
            for (a, xr) in acts.chunks_mut(nb).zip(x.chunks(in_dim)) {
                K::quantize(isa, xr, a);
            }
            let mut buf = vec![0f32; ACT_TILE * rows];
            let mut best = f64::INFINITY;
            for _ in 0..20 {
                let t = Instant::now();
                for _ in 0..2000 {
                    tile::<K>(isa, w, &acts, nb, TileOut::buffer(&mut buf, ACT_TILE, rows));
                }
                best = best.min(t.elapsed().as_secs_f64() / 2000.0);
            }
            let macs = (ACT_TILE * rows * in_dim) as f64;
            println!(
                "{name} {isa:?}: {:.0} ns a tile, {:.1} GMAC/s",
                best * 1e9,
                macs / best / 1e9
            );
        }
        let isa = Isa::detect();
        let mut rng = Rng::new(3);
        // 48 rows of 640: the 32 KB slice `matmul_slices` cuts from the LM head.
        let (nb, rows) = (20, 48);
        let w = prepare(
            WeightFormat::Q8_0,
            random_gguf(WeightFormat::Q8_0, nb * rows, &mut rng),
            rows,
        );
        let x: Vec<f32> = (0..ACT_TILE * nb * 32).map(|_| rng.uniform()).collect();
        run::<q8_0::WithQ8_0Acts<q8_0::Q8_0>>("Q8_0", isa, &w, &x, nb, rows);
        run::<q8_0::WithQ8_0Acts<q8_0::Q8_0PairBound>>("Q8_0PairBound", isa, &w, &x, nb, rows);
        run::<q8_0::WithGradActs<false>>("Q8_0PairBound, gradient", isa, &w, &x, nb, rows);
        let non_neg: Vec<f32> = x.iter().map(|v| v.abs()).collect();
        run::<q8_0::WithGradActs<true>>(
            "Q8_0PairBound, non-negative gradient",
            isa,
            &w,
            &non_neg,
            nb,
            rows,
        );
        // Q4_K as stored and Q6_K widened (their batches' kernels) at Qwen3-0.6B's width:
        // 48 rows of 1,024 (Q4_K's 27 KB slice), four-row tiles of Q8_K activations.
        let (nb_k, rows_k) = (4, 48);
        let x_k: Vec<f32> = (0..ACT_TILE * nb_k * 256).map(|_| rng.uniform()).collect();
        let q4k = random_gguf(WeightFormat::Q4K, nb_k * rows_k, &mut rng);
        let q4k = prepare(WeightFormat::Q4K, q4k, rows_k);
        run::<q4_k::Q4K>("Q4_K", isa, &q4k, &x_k, nb_k, rows_k);
        let q6k = random_gguf(WeightFormat::Q6K, nb_k * rows_k, &mut rng);
        let mut q6k_wide = Vec::new();
        q6_k::Q6K::widen(
            isa,
            &prepare(WeightFormat::Q6K, q6k, rows_k),
            nb_k,
            &mut q6k_wide,
        );
        run::<q6_k::Q6KWide>("Q6_K widened", isa, &q6k_wide, &x_k, nb_k, rows_k);
        if isa == Isa::Avx2 {
            let mut wide = Vec::new();
            q8_0_pairs::widen(isa, &w, nb, &mut wide);
            run::<q8_0_pairs::Q8_0Pairs>("Q8_0 widened to pairs", isa, &wide, &x, nb, rows);
        }
    }

    /// Time per call of the model's matmul shapes with the best instruction set here, the best
    /// of many short trials (other work on the machine only slows some of them down):
    /// `cargo test --release -p temper-model --lib -- --ignored --nocapture kernel_throughput`
    /// (`KERNEL_BENCH=Q8_0` keeps the shapes whose line contains that text). The second figure
    /// is the throughput the threads' CPU time gives, as if each had a core to itself.
    #[test]
    #[ignore]
    fn kernel_throughput() {
        let isa = Isa::detect();
        let mut rng = Rng::new(9);
        for (format, in_dim, out_dim, rows, reps) in [
            (WeightFormat::Q8_0, 640, 262_144, 1, 4),
            (WeightFormat::Q8_0PairBound, 640, 262_144, 1, 4),
            (WeightFormat::Q8_0, 640, 2048, 1, 400),
            (WeightFormat::Q8_0, 640, 2048, 128, 10),
            (WeightFormat::Q8_0, 640, 2048, 32, 40),
            (WeightFormat::Q8_0, 2048, 640, 1, 400),
            (WeightFormat::Q8_0, 2048, 640, 128, 10),
            (WeightFormat::Q8_0, 640, 262_144, 32, 1),
            (WeightFormat::Q8_0, 640, 262_144, 16, 1),
            (WeightFormat::Q8_0PairBound, 640, 262_144, 32, 1),
            (WeightFormat::Q8_0PairBound, 640, 262_144, 16, 1),
            (WeightFormat::Q8_0PairBound, 640, 262_144, 8, 1),
            (WeightFormat::Q8_0, 640, 32_768, 16, 4),
            (WeightFormat::Q8_0, 640, 32_768, 32, 2),
            (WeightFormat::Q5_0, 640, 2048, 1, 400),
            (WeightFormat::Q5_0, 640, 2048, 128, 10),
            (WeightFormat::Q4_0, 640, 2048, 1, 400),
            (WeightFormat::Q4_0, 640, 2048, 128, 10),
            (WeightFormat::Q4_0, 1024, 3072, 1, 400),
            (WeightFormat::Q4_0, 1024, 3072, 16, 40),
            (WeightFormat::Q4K, 2048, 640, 1, 400),
            (WeightFormat::Q4K, 2048, 640, 128, 10),
            (WeightFormat::Q4K, 1024, 3072, 1, 400),
            (WeightFormat::Q4K, 1024, 3072, 16, 40),
            (WeightFormat::Q5K, 2048, 640, 1, 400),
            (WeightFormat::Q5K, 2048, 640, 128, 10),
            (WeightFormat::Q5K, 1024, 3072, 1, 400),
            (WeightFormat::Q5K, 1024, 3072, 16, 40),
            (WeightFormat::Q6K, 2048, 640, 1, 400),
            (WeightFormat::Q6K, 2048, 640, 128, 10),
            // Qwen3-0.6B's tied LM head (Q6_K in Q4_K_M files) and its Q4_K layers' widths.
            (WeightFormat::Q6K, 1024, 151_936, 1, 4),
            (WeightFormat::Q4K, 1024, 151_936, 1, 4),
            (WeightFormat::Q6K, 3072, 1024, 1, 400),
            (WeightFormat::Q4K, 3072, 1024, 1, 400),
            // Gemma-3-1B's widths (1152 is no multiple of 256: Q4_K_M files fall back to Q5_0
            // and Q8_0 there) and its Q8_0 LM head.
            (WeightFormat::Q5_0, 1152, 6912, 1, 100),
            (WeightFormat::Q5_0, 1152, 1024, 1, 400),
            (WeightFormat::Q8_0, 1152, 256, 1, 400),
            (WeightFormat::Q6K, 6912, 1152, 1, 100),
            (WeightFormat::Q8_0, 1152, 262_144, 1, 4),
            (WeightFormat::Q8_0PairBound, 1152, 262_144, 1, 4),
            (WeightFormat::Q5_0, 1152, 6912, 128, 4),
            // Qwen3-1.7B's layers (Q4_K_M: Q6_K for half the down projections).
            (WeightFormat::Q4K, 2048, 6144, 1, 100),
            (WeightFormat::Q6K, 6144, 2048, 1, 100),
            (WeightFormat::Q4K, 6144, 2048, 1, 100),
            (WeightFormat::Q4K, 1024, 3072, 128, 10),
            (WeightFormat::Q4K, 2048, 8192, 128, 2),
            // A training step's 1,016 rows at Qwen3-0.6B's widths: the pair-bound forward kernel
            // over the transposed weights' shapes (the input gradients themselves run on
            // quantized gradients: `linear::tests::input_grad_throughput`), and the forward.
            (WeightFormat::Q8_0PairBound, 2048, 1024, 1016, 2),
            (WeightFormat::Q8_0PairBound, 1024, 2048, 1016, 2),
            (WeightFormat::Q4K, 1024, 3072, 1016, 2),
            (WeightFormat::Q4K, 2048, 1024, 1016, 2),
        ] {
            let label = format!("{format:?} {isa:?} {rows} x {in_dim} -> {out_dim}");
            if !label.contains(&std::env::var("KERNEL_BENCH").unwrap_or_default()) {
                continue;
            }
            let blocks = in_dim / format.block_elems() * out_dim;
            let w = prepare(format, random_gguf(format, blocks, &mut rng), out_dim);
            // `KERNEL_STREAM=1`: copies of the weight filling 512 MB, a call on each in turn,
            // so each call reads its weight from memory, as a decode step reads a layer's.
            let copies = match std::env::var_os("KERNEL_STREAM") {
                Some(_) => (512usize << 20).div_ceil(w.len()),
                None => 1,
            };
            let ws: Vec<Vec<u8>> = (0..copies).map(|_| w.clone()).collect();
            let x: Vec<f32> = (0..rows * in_dim).map(|_| rng.uniform()).collect();
            // One part per row, as the LM head's logits (a part per sequence): the parts come
            // back to the allocator between calls, where one 33 MB product would be mapped
            // afresh (page faults) every call.
            let counts = vec![1; rows];
            let (mut best, mut best_cpu) = (f64::INFINITY, f64::INFINITY);
            for _ in 0..15 {
                let (t, cpu) = (Instant::now(), cpu_seconds());
                for rep in 0..reps {
                    std::hint::black_box(matmul_split(
                        format,
                        isa,
                        (&ws[rep % copies], None),
                        (in_dim, out_dim),
                        &x,
                        &counts,
                        Threads::Pool,
                    ));
                }
                best = best.min(t.elapsed().as_secs_f64() / reps as f64);
                best_cpu = best_cpu.min((cpu_seconds() - cpu) / reps as f64);
            }
            let gops = 2.0 * (rows * in_dim * out_dim) as f64 / best / 1e9;
            let threads = rayon::current_num_threads() as f64;
            let cpu_gops = 2.0 * (rows * in_dim * out_dim) as f64 / best_cpu / 1e9 * threads;
            println!(
                "{label}: {:.1} µs ({gops:.1} GOP/s; from CPU time, {cpu_gops:.1})",
                best * 1e6
            );
        }
    }
}
