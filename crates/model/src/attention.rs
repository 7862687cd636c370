//! Causal attention of one token's query heads over its own sequence's cached keys and values.
//!
//! Per query head: every score `scale · q·k` in f32 (a fixed order of eight-lane partial sums),
//! a plain softmax over the visible keys (maximum, `exp`, sum, in key order), and the output as
//! the probability-weighted sum of the values in key order. A row's result depends only on its
//! own query and keys, never on the batch, on how the cache is split into blocks or on how many
//! tokens a forward computes: the arithmetic the whole engine relies on (batch and chunk
//! invariance, a cached prefix equal to a recomputed one, serving equal to training).
//!
//! The query heads that share a key/value head are computed together, so each key and value is
//! read once per group; in a prefill, a tile of consecutive tokens of one sequence is computed
//! together too (`attend_tile`), so each key and value is read and converted once per tile
//! rather than once per token. The scalar reference and the AVX2 path, per token or in tiles,
//! compute the same bits (tested on random data).

use half::f16;
use rayon::prelude::*;

use crate::cache::KvView;
use crate::kernels::Isa;

/// Values per step of a dot product: four accumulators of eight lanes.
const STEP: usize = 32;
const LANES: usize = 8;

/// An element of a key or value row: f16 in the serving cache, f32 in the trainer's smooth
/// mode (`Decoder::set_smooth`).
pub(crate) trait KvElem: Copy + Send + Sync {
    fn get(self) -> f32;
}

impl KvElem for f16 {
    #[inline(always)]
    fn get(self) -> f32 {
        self.to_f32()
    }
}

impl KvElem for f32 {
    #[inline(always)]
    fn get(self) -> f32 {
        self
    }
}

/// Where one key/value head lies in the cache's rows: `d` values from column `col` of rows
/// `stride` wide.
#[derive(Clone, Copy)]
pub(crate) struct HeadColumns {
    pub(crate) col: usize,
    pub(crate) d: usize,
    pub(crate) stride: usize,
}

/// One token's attention: `queries` holds the group's heads (`heads x d`), the keys and values
/// of positions `lo..hi` come from `view` at `head`'s columns. Writes `heads x d` outputs to
/// `out`; `scores` is scratch space.
#[allow(clippy::too_many_arguments)]
pub(crate) fn attend_group<T: KvElem + 'static>(
    isa: Isa,
    queries: &[f32],
    scale: f32,
    view: &KvView<'_, T>,
    (lo, hi): (usize, usize),
    head: HeadColumns,
    out: &mut [f32],
    scores: &mut Vec<f32>,
) {
    let HeadColumns { col, d, stride } = head;
    let heads = queries.len() / d;
    let n = hi - lo;
    assert!(n > 0 && out.len() == queries.len() && heads * d == queries.len());
    scores.clear();
    scores.resize(heads * n, 0.0);
    let ops = Ops::<T>::new(isa);

    // Scores, head-major: scores[h * n + j]. The cache's blocks come from memory, one block
    // apart: while a span's keys are scored, the next span's keys and this span's values (for
    // the weighted sums below) are asked for, a share per key.
    let mut j = 0;
    let mut spans = view.spans(lo, hi, stride).peekable();
    while let Some((keys, values, rows)) = spans.next() {
        let next_keys = spans.peek().map_or(&[][..], |next| next.0);
        for r in 0..rows {
            prefetch_head(next_keys, head, r, rows);
            prefetch_head(values, head, r, rows);
            (ops.dots)(&keys[r * stride + col..][..d], queries, scores, j, n);
            j += 1;
        }
    }
    // Softmax weights (unnormalised) and their sums, the scores scaled on the way.
    let mut inv = [0f32; 8];
    let mut inv_heap = Vec::new();
    let inv: &mut [f32] = if heads <= inv.len() {
        &mut inv[..heads]
    } else {
        inv_heap.resize(heads, 0.0);
        &mut inv_heap
    };
    for (h, row) in scores.chunks_exact_mut(n).enumerate() {
        inv[h] = softmax(row, scale);
    }
    // Weighted values, in key order.
    out.fill(0.0);
    let mut j = 0;
    for (_, values, rows) in view.spans(lo, hi, stride) {
        let span = ValueRows {
            values,
            rows,
            stride,
            col,
        };
        (ops.weighted)(span, scores, j, n, out);
        j += rows;
    }
    for (h, o) in out.chunks_exact_mut(d).enumerate() {
        for x in o.iter_mut() {
            *x *= inv[h];
        }
    }
}

/// A layer's attention heads: `heads` query heads, `kv_heads` key/value heads (each shared by
/// `heads / kv_heads` query heads), `d` values each; local layers see the last `window`
/// positions, self included.
#[derive(Clone, Copy)]
pub(crate) struct Shape {
    pub(crate) heads: usize,
    pub(crate) kv_heads: usize,
    pub(crate) d: usize,
    pub(crate) window: Option<usize>,
    pub(crate) scale: f32,
}

/// Causal attention of every query row `q` (`heads x d` each) against its own sequence's keys
/// and values (`views[seq[t]]`, which already hold the rows' own keys and values; row `t` at
/// position `pos[t]`). Consecutive rows of one sequence at consecutive positions are computed
/// `tile` at a time per key/value head ([`attend_tile`]); each row's bits are the same whatever
/// `tile` and the batch are.
pub(crate) fn attend_rows<T: KvElem + 'static>(
    isa: Isa,
    q: &[f32],
    views: &[KvView<'_, T>],
    (seq, pos): (&[usize], &[usize]),
    shape: Shape,
    tile: usize,
) -> Vec<f32> {
    let Shape {
        heads: h,
        kv_heads: hkv,
        d,
        window,
        scale,
    } = shape;
    let group = h / hkv;
    let range = |t: usize| {
        let p = pos[t];
        (window.map_or(0, |w| (p + 1).saturating_sub(w)), p + 1)
    };
    let head = |g: usize| HeadColumns {
        col: g * d,
        d,
        stride: hkv * d,
    };
    let threads = rayon::current_num_threads();
    let tokens = pos.len();
    let mut out = vec![0f32; q.len()];
    // Tiles of consecutive rows of one sequence at consecutive positions.
    let mut tiles: Vec<std::ops::Range<usize>> = Vec::new();
    for t in 0..tokens {
        match tiles.last_mut() {
            Some(last) if last.len() < tile && seq[t] == seq[t - 1] && pos[t] == pos[t - 1] + 1 => {
                last.end = t + 1
            }
            _ => tiles.push(t..t + 1),
        }
    }
    if tiles.len() == tokens || tiles.len() * hkv < threads {
        // A task per token and key/value head; with fewer tokens than threads (a decode step)
        // the group's query heads are split between tasks too, so every thread works. Each
        // head's arithmetic is the same either way.
        let split = if tokens * hkv >= threads {
            1
        } else {
            (1..=group.min(threads))
                .rev()
                .find(|k| group.is_multiple_of(*k))
                .unwrap_or(1)
        };
        let heads_per_task = group / split;
        let task = |scores: &mut Vec<f32>, (idx, o): (usize, &mut [f32])| {
            let first_head = idx * heads_per_task;
            let (t, g) = (first_head / h, first_head % h / group);
            let queries = &q[first_head * d..(first_head + heads_per_task) * d];
            attend_group(
                isa,
                queries,
                scale,
                &views[seq[t]],
                range(t),
                head(g),
                o,
                scores,
            );
        };
        if crate::team::leads() {
            crate::team::for_each_chunk(&mut out, heads_per_task * d, &|idx, o| {
                task(&mut Vec::new(), (idx, o))
            });
        } else {
            out.par_chunks_mut(heads_per_task * d)
                .enumerate()
                .for_each_init(Vec::new, task);
        }
        return out;
    }
    // A task per tile and key/value head, each given its tokens' outputs of that head; a key/
    // value head's tiles one after another, so that a thread's next task reads the columns of
    // the cache its last one brought in.
    let mut slots: Vec<Option<&mut [f32]>> = out.chunks_mut(group * d).map(Some).collect();
    type Task<'a> = (std::ops::Range<usize>, usize, Vec<&'a mut [f32]>);
    let tasks: Vec<Task<'_>> = (0..hkv)
        .flat_map(|g| tiles.iter().map(move |tile| (tile.clone(), g)))
        .map(|(tile, g)| {
            let outs = tile
                .clone()
                .map(|t| slots[t * hkv + g].take().expect("each output once"))
                .collect();
            (tile, g, outs)
        })
        .collect();
    let task = |scratch: &mut TileScratch, (tile, g, mut outs): Task<'_>| {
        let view = &views[seq[tile.start]];
        let ranges: Vec<(usize, usize)> = tile.clone().map(range).collect();
        scratch.queries.clear();
        for t in tile {
            let at = t * h * d + g * group * d;
            scratch.queries.extend_from_slice(&q[at..at + group * d]);
        }
        attend_tile(isa, scale, view, &ranges, head(g), &mut outs, scratch);
    };
    if crate::team::leads() {
        // A short prefill led by the thread team (see `team`).
        let mut tasks: Vec<Option<Task<'_>>> = tasks.into_iter().map(Some).collect();
        crate::team::for_each_chunk(&mut tasks, 1, &|_, t| {
            task(
                &mut TileScratch::default(),
                t[0].take().expect("each tile once"),
            )
        });
    } else {
        tasks
            .into_par_iter()
            .for_each_init(TileScratch::default, task);
    }
    out
}

/// Scales `row`'s scores, replaces each by its unnormalised softmax weight `exp(s - max)` and
/// returns `1 / Σ weights`. The exponentials are [`crate::softmax::exp_neg`]'s, as the
/// sampler's, the LM head's and the trainer's attention backward's are (branch-free, so the
/// loop vectorizes: `f32::exp` was a call per score, most of a long prefill's softmax), a NaN
/// score kept NaN; the sum in eight lanes from the row's first key, folded by
/// [`crate::kernels::hsum8`], the rest one by one after.
#[inline(always)]
fn softmax(row: &mut [f32], scale: f32) -> f32 {
    // The maximum in eight lanes (a chain of `max` one score at a time waits on each): the
    // same value whatever the order, but for the sign of a zero maximum, which `s - max`
    // cannot tell from the other zero's before `exp` (`exp(±0) = 1`, and `s - ±0 = s`
    // otherwise). A NaN score makes the sum NaN.
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let mut chunks = row.chunks_exact_mut(LANES);
    for chunk in &mut chunks {
        for (m, s) in lanes.iter_mut().zip(chunk) {
            *s *= scale;
            *m = m.max(*s);
        }
    }
    for s in chunks.into_remainder() {
        *s *= scale;
        lanes[0] = lanes[0].max(*s);
    }
    let max = lanes.iter().fold(f32::NEG_INFINITY, |m, &l| m.max(l));
    // Two loops the compiler vectorizes: the exponentials (every lane computed, NaN selected
    // after), then the sum.
    for s in row.iter_mut() {
        let x = *s - max;
        let e = crate::softmax::exp_neg(x);
        *s = if x.is_nan() { x } else { e };
    }
    let mut sums = [0f32; LANES];
    let mut chunks = row.chunks_exact(LANES);
    for chunk in &mut chunks {
        for (sum, &e) in sums.iter_mut().zip(chunk) {
            *sum += e;
        }
    }
    let mut sum = crate::kernels::hsum8(&sums);
    for &e in chunks.remainder() {
        sum += e;
    }
    1.0 / sum
}

/// Query tokens a prefill computes together per key/value head ([`attend_tile`]).
pub(crate) const TILE_TOKENS: usize = 8;

/// Scratch space of [`attend_tile`], kept by a thread between tiles.
#[derive(Default)]
pub(crate) struct TileScratch {
    pub(crate) queries: Vec<f32>,
    scores: Vec<f32>,
    out: Vec<f32>,
    inv: Vec<f32>,
}

/// [`attend_group`] for a tile of tokens of one sequence at once: token `i` has the group's
/// heads at `scratch.queries[i * heads * d..]` (`heads x d`), sees positions `ranges[i]`, and
/// its result goes to `outs[i]`. Each key of the tiles' ranges is scored for every query of the
/// tile in one go (read and converted once), and the values the tokens all see are weighted
/// for all of them together; the other values (the ragged causal ends, a window's moving
/// start) are weighted token by token, in key order. Every token's bits are those
/// [`attend_group`] gives it alone: each score is the same dot product, each softmax the same
/// arithmetic over the token's own keys, and each output value takes the token's keys one
/// fused multiply-add at a time in key order.
pub(crate) fn attend_tile<T: KvElem + 'static>(
    isa: Isa,
    scale: f32,
    view: &KvView<'_, T>,
    ranges: &[(usize, usize)],
    head: HeadColumns,
    outs: &mut [&mut [f32]],
    scratch: &mut TileScratch,
) {
    let HeadColumns { col, d, stride } = head;
    let tokens = ranges.len();
    let TileScratch {
        queries,
        scores,
        out,
        inv,
    } = scratch;
    let rows = queries.len() / d;
    let heads = rows / tokens;
    assert!(tokens > 0 && outs.len() == tokens && heads * tokens * d == queries.len());
    assert!(ranges.iter().all(|&(lo, hi)| lo < hi));
    assert!(outs.iter().all(|o| o.len() == heads * d));
    let first = ranges.iter().map(|r| r.0).min().unwrap_or(0);
    let end = ranges.iter().map(|r| r.1).max().unwrap_or(0);
    // Positions every token sees: `shared_lo..shared_hi` (empty when the ranges do not overlap).
    let shared_lo = ranges.iter().map(|r| r.0).max().unwrap_or(0);
    let shared_hi = ranges.iter().map(|r| r.1).min().unwrap_or(0).max(shared_lo);
    let n = end - first;
    scores.clear();
    scores.resize(rows * n, 0.0);
    let ops = Ops::<T>::new(isa);

    // Scores of every query of the tile for every key of the tiles' ranges, as in
    // `attend_group` (a key outside a token's range is scored but never used).
    // The keys of a span (at most `PIECE` rows of a span of the cache) in one call, a tile's
    // queries taking long over each: the next span's keys and this span's values are asked for
    // first.
    const PIECE: usize = crate::cache::BLOCK_TOKENS;
    let mut j = 0;
    let mut spans = view
        .spans(first, end, stride)
        .flat_map(|(keys, values, rows)| {
            (0..rows).step_by(PIECE).map(move |r| {
                let take = PIECE.min(rows - r);
                let at = r * stride..(r + take) * stride;
                (&keys[at.clone()], &values[at], take)
            })
        })
        .peekable();
    while let Some((keys, values, span_rows)) = spans.next() {
        let next_keys = spans.peek().map_or(&[][..], |next| next.0);
        prefetch_head(next_keys, head, 0, 1);
        prefetch_head(values, head, 0, 1);
        let span = ValueRows {
            values: keys,
            rows: span_rows,
            stride,
            col,
        };
        (ops.dot_rows)(span, queries, scores, j, n);
        j += span_rows;
    }
    // Each token's softmax over its own keys.
    inv.clear();
    inv.resize(rows, 0.0);
    for (i, &(lo, hi)) in ranges.iter().enumerate() {
        for h in 0..heads {
            let m = i * heads + h;
            inv[m] = softmax(&mut scores[m * n + lo - first..m * n + hi - first], scale);
        }
    }
    // Weighted values: per token the keys before the shared ones, the shared ones for the whole
    // tile, per token the keys after them.
    out.clear();
    out.resize(rows * d, 0.0);
    let weigh = |(a, b): (usize, usize), scores: &[f32], out: &mut [f32]| {
        let mut j = a - first;
        for (_, values, span_rows) in view.spans(a, b, stride) {
            let span = ValueRows {
                values,
                rows: span_rows,
                stride,
                col,
            };
            (ops.weighted)(span, scores, j, n, out);
            j += span_rows;
        }
    };
    let per_token = heads * n;
    for (i, &(lo, hi)) in ranges.iter().enumerate() {
        let before = (lo, shared_lo.min(hi));
        if before.0 < before.1 {
            let o = &mut out[i * heads * d..(i + 1) * heads * d];
            weigh(before, &scores[i * per_token..(i + 1) * per_token], o);
        }
    }
    if shared_lo < shared_hi {
        weigh((shared_lo, shared_hi), scores, out);
    }
    for (i, &(lo, hi)) in ranges.iter().enumerate() {
        let after = (shared_hi.max(lo), hi);
        if after.0 < after.1 {
            let o = &mut out[i * heads * d..(i + 1) * heads * d];
            weigh(after, &scores[i * per_token..(i + 1) * per_token], o);
        }
    }
    for (m, o) in out.chunks_exact_mut(d).enumerate() {
        for x in o.iter_mut() {
            *x *= inv[m];
        }
    }
    for (i, dst) in outs.iter_mut().enumerate() {
        dst.copy_from_slice(&out[i * heads * d..(i + 1) * heads * d]);
    }
}

/// Asks for share `t` of `tiles` of `span`'s rows (`head.stride` values each) to be brought
/// into L2, only `head`'s columns of each: a row of the cache holds every key/value head, and
/// the other heads' columns are other tasks' (whole rows are eight times the bytes at
/// Qwen3-0.6B's eight key/value heads).
fn prefetch_head<T: KvElem>(span: &[T], head: HeadColumns, t: usize, tiles: usize) {
    let HeadColumns { col, d, stride } = head;
    let rows = span.len() / stride;
    for r in rows * t / tiles..rows * (t + 1) / tiles {
        let columns = &span[r * stride + col..][..d];
        // SAFETY: `KvElem`s (f16, f32) are plain values: every byte of them is initialized.
        let bytes = unsafe {
            std::slice::from_raw_parts(columns.as_ptr().cast(), std::mem::size_of_val(columns))
        };
        crate::kernels::prefetch_share(bytes, 0, 1);
    }
}

/// Consecutive key or value rows of one span of the cache: `rows` rows `stride` apart, the
/// head's values from column `col`.
#[derive(Clone, Copy)]
struct ValueRows<'a, T> {
    values: &'a [T],
    rows: usize,
    stride: usize,
    col: usize,
}

/// The scores and weighted sums of one instruction set, for element type `T`. Each score is
/// one head's [`dot_scalar`]; each output value takes the span's rows one fused multiply-add
/// at a time, in row order: the bits of the scalar reference whatever the instruction set.
struct Ops<T> {
    /// `scores[h * n + j] = key · queries[h * d..]` for every head `h` of `queries`
    /// (`d = key.len()`): one token's scores, a key at a time (`attend_group`).
    dots: fn(&[T], &[f32], &mut [f32], usize, usize),
    /// `scores[h * n + j + r] = key_r · queries[h * d..]` for each key row `r` of the span
    /// and every query `h` of `queries` (`scores.len() / n` of them, `d` values each): a
    /// tile's scores (`attend_tile`).
    dot_rows: fn(ValueRows<'_, T>, &[f32], &mut [f32], usize, usize),
    /// For each row `r` of the span, in order, and each head `h`: `out[h * d..] += scores[h * n
    /// + j + r] · value_r` (`d = out.len() / heads`, the heads `scores.len() / n`).
    weighted: fn(ValueRows<'_, T>, &[f32], usize, usize, &mut [f32]),
}

impl<T: KvElem + 'static> Ops<T> {
    fn new(isa: Isa) -> Self {
        #[cfg(target_arch = "x86_64")]
        if isa != Isa::Scalar {
            if let Some(ops) = x86::ops::<T>() {
                return ops;
            }
        }
        let _ = isa;
        Ops {
            dots: dots_scalar::<T>,
            dot_rows: dot_rows_scalar::<T>,
            weighted: weighted_scalar::<T>,
        }
    }
}

fn dots_scalar<T: KvElem>(key: &[T], queries: &[f32], scores: &mut [f32], j: usize, n: usize) {
    for (h, q) in queries.chunks_exact(key.len()).enumerate() {
        scores[h * n + j] = dot_scalar(key, q);
    }
}

fn dot_rows_scalar<T: KvElem>(
    span: ValueRows<'_, T>,
    queries: &[f32],
    scores: &mut [f32],
    j: usize,
    n: usize,
) {
    let d = queries.len() / (scores.len() / n);
    for r in 0..span.rows {
        let key = &span.values[r * span.stride + span.col..][..d];
        for (h, q) in queries.chunks_exact(d).enumerate() {
            scores[h * n + j + r] = dot_scalar(key, q);
        }
    }
}

fn weighted_scalar<T: KvElem>(
    span: ValueRows<'_, T>,
    scores: &[f32],
    j: usize,
    n: usize,
    out: &mut [f32],
) {
    let d = out.len() / (scores.len() / n);
    for r in 0..span.rows {
        let value = &span.values[r * span.stride + span.col..][..d];
        for (h, o) in out.chunks_exact_mut(d).enumerate() {
            for (o, v) in o.iter_mut().zip(value) {
                *o = v.get().mul_add(scores[h * n + j + r], *o);
            }
        }
    }
}

/// `Σ key[i]·q[i]`: lane `l` of accumulator `a` takes values `i ≡ a·8 + l (mod 32)` by fused
/// multiply-adds, the four accumulators fold as `(a0+a1)+(a2+a3)`, the lanes as ggml's
/// `hsum_float_8`; values past the last whole step are added one by one after.
fn dot_scalar<T: KvElem>(key: &[T], q: &[f32]) -> f32 {
    let whole = q.len() / STEP * STEP;
    let mut acc = [[0f32; LANES]; 4];
    for i in (0..whole).step_by(STEP) {
        for (a, acc) in acc.iter_mut().enumerate() {
            for (l, x) in acc.iter_mut().enumerate() {
                let at = i + a * LANES + l;
                *x = key[at].get().mul_add(q[at], *x);
            }
        }
    }
    let folded: [f32; LANES] =
        std::array::from_fn(|l| (acc[0][l] + acc[1][l]) + (acc[2][l] + acc[3][l]));
    let mut sum = crate::kernels::hsum8(&folded);
    for at in whole..q.len() {
        sum = key[at].get().mul_add(q[at], sum);
    }
    sum
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::any::TypeId;
    use std::arch::x86_64::*;

    use half::f16;

    use super::{Ops, ValueRows, LANES, STEP};

    /// Heads a call of the AVX2 weighted sums takes together (their accumulators stay in
    /// registers: two each).
    const HEADS: usize = 4;
    /// Queries a call of the AVX2 dot products takes together (`FOLD_HEADS` at a time, their
    /// lanes summed together): a tile of tokens scores each key for eight queries at a time.
    const DOT_HEADS: usize = 8;

    /// The AVX2 operations for f16 rows (the serving cache); `None` for other element types.
    pub(super) fn ops<T: 'static>() -> Option<Ops<T>> {
        if TypeId::of::<T>() != TypeId::of::<f16>() {
            return None;
        }
        // SAFETY: `T` is `f16` (checked above), so the function pointers' types are equal.
        Some(unsafe {
            Ops {
                dots: std::mem::transmute::<
                    fn(&[f16], &[f32], &mut [f32], usize, usize),
                    fn(&[T], &[f32], &mut [f32], usize, usize),
                >(dots),
                dot_rows: std::mem::transmute::<
                    fn(ValueRows<'_, f16>, &[f32], &mut [f32], usize, usize),
                    fn(ValueRows<'_, T>, &[f32], &mut [f32], usize, usize),
                >(dot_rows),
                weighted: std::mem::transmute::<
                    fn(ValueRows<'_, f16>, &[f32], usize, usize, &mut [f32]),
                    fn(ValueRows<'_, T>, &[f32], usize, usize, &mut [f32]),
                >(weighted),
            }
        })
    }

    #[inline(always)]
    unsafe fn load8(p: *const f16) -> __m256 {
        // SAFETY: the caller guarantees eight readable values.
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)) }
    }

    /// Calls `$f::<H>(args)` with `H`, the heads of a call (1 to `HEADS`), as a constant.
    macro_rules! with_heads {
        ($h:expr, $f:ident($($arg:expr),*)) => {
            match $h {
                1 => $f::<1>($($arg),*),
                2 => $f::<2>($($arg),*),
                3 => $f::<3>($($arg),*),
                _ => $f::<4>($($arg),*),
            }
        };
    }

    /// [`with_heads`] up to `DOT_HEADS`, as `$f::<A, B>` with `A + B` heads, `A` at most
    /// `FOLD_HEADS`.
    macro_rules! with_dot_heads {
        ($h:expr, $f:ident($($arg:expr),*)) => {
            match $h {
                1 => $f::<1, 0>($($arg),*),
                2 => $f::<2, 0>($($arg),*),
                3 => $f::<3, 0>($($arg),*),
                4 => $f::<4, 0>($($arg),*),
                5 => $f::<4, 1>($($arg),*),
                6 => $f::<4, 2>($($arg),*),
                7 => $f::<4, 3>($($arg),*),
                _ => $f::<4, 4>($($arg),*),
            }
        };
    }

    fn dots(key: &[f16], queries: &[f32], scores: &mut [f32], j: usize, n: usize) {
        let d = key.len();
        let heads = queries.len() / d;
        assert!(d > 0 && heads * d == queries.len() && j < n && scores.len() >= heads * n);
        for h0 in (0..heads).step_by(HEADS) {
            let q = &queries[h0 * d..];
            let sums = &mut scores[h0 * n + j..];
            // SAFETY: `Isa::detect` named AVX2 (with FMA and F16C) before these ops were chosen;
            // `q` holds the call's heads (`d` values each), `sums` has them `n` apart (above).
            unsafe { with_heads!(heads - h0, dots_avx2(key, q, sums, n)) }
        }
    }

    /// [`super::dot_scalar`] for `H` heads at once: the key is read and converted once. Each
    /// accumulator `a` takes the same fused multiply-adds in the same order as there, so the
    /// bits are the reference's.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dots_avx2<const H: usize>(key: &[f16], q: &[f32], sums: &mut [f32], n: usize) {
        let d = key.len();
        let qp: [*const f32; H] = std::array::from_fn(|h| q[h * d..(h + 1) * d].as_ptr());
        // SAFETY: the caller's guarantees, passed on.
        unsafe { dot_key(key, (&qp, &[]), q, sums, n) }
    }

    /// One key's scores for `A + B` heads (`qa` and then `qb` their queries in `q`; `B` only
    /// where `A` is `FOLD_HEADS`), into `sums[h * n]`: the arithmetic of [`dots_avx2`], shared
    /// with the tiles' [`dot_rows_avx2`].
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn dot_key<const A: usize, const B: usize>(
        key: &[f16],
        (qa, qb): (&[*const f32; A], &[*const f32; B]),
        q: &[f32],
        sums: &mut [f32],
        n: usize,
    ) {
        let d = key.len();
        let whole = d / STEP * STEP;
        let kp = key.as_ptr();
        let mut folded = [_mm256_setzero_ps(); DOT_HEADS];
        // SAFETY: the caller's guarantees, passed on.
        unsafe {
            folded[..A].copy_from_slice(&fold_heads(kp, qa, whole));
            folded[A..A + B].copy_from_slice(&fold_heads(kp, qb, whole));
        }
        let mut heads_sums = [0f32; DOT_HEADS];
        if A + B > 2 {
            // SAFETY: eight floats.
            unsafe { _mm256_storeu_ps(heads_sums.as_mut_ptr(), hsum8_each(&folded)) };
        } else {
            // A decode step's one or two heads: eight at once would sum six or seven zeros.
            for (sum, f) in heads_sums.iter_mut().zip(&folded[..A + B]) {
                let mut lanes = [0f32; LANES];
                // SAFETY: eight floats.
                unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), *f) };
                *sum = crate::kernels::hsum8(&lanes);
            }
        }
        for (h, mut sum) in heads_sums.into_iter().take(A + B).enumerate() {
            let qh = &q[h * d..(h + 1) * d];
            for at in whole..d {
                sum = key[at].to_f32().mul_add(qh[at], sum);
            }
            sums[h * n] = sum;
        }
    }

    /// Heads [`dot_key`] folds at a time: their accumulators of two passes and the first two
    /// passes' sums stay in registers (14 of the 16).
    const FOLD_HEADS: usize = 4;

    /// [`super::dot_scalar`]'s four accumulators of each of `G` (at most `FOLD_HEADS`) heads,
    /// folded as there (`(a0 + a1) + (a2 + a3)`), over the key's first `whole` values (a multiple
    /// of 32). Accumulators 0 and 1 run together, then 2 and 3, each taking its values in the
    /// reference's order.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn fold_heads<const G: usize>(
        kp: *const f16,
        qp: &[*const f32; G],
        whole: usize,
    ) -> [__m256; G] {
        const { assert!(G <= FOLD_HEADS) };
        let mut folded = [_mm256_setzero_ps(); G];
        for a in [0, 2] {
            let (mut first, mut second) = ([_mm256_setzero_ps(); G], [_mm256_setzero_ps(); G]);
            for i in (a * LANES..whole).step_by(STEP) {
                // SAFETY: `i + 16 <= whole <= d` for the key and each head's query (`whole` a
                // multiple of 32, `a * 8 + 16 <= 32`).
                unsafe {
                    let (k0, k1) = (load8(kp.add(i)), load8(kp.add(i + LANES)));
                    for h in 0..G {
                        first[h] = _mm256_fmadd_ps(k0, _mm256_loadu_ps(qp[h].add(i)), first[h]);
                        let q1 = _mm256_loadu_ps(qp[h].add(i + LANES));
                        second[h] = _mm256_fmadd_ps(k1, q1, second[h]);
                    }
                }
            }
            for h in 0..G {
                let pair = _mm256_add_ps(first[h], second[h]);
                folded[h] = if a == 0 {
                    pair
                } else {
                    _mm256_add_ps(folded[h], pair)
                };
            }
        }
        folded
    }

    /// [`crate::kernels::hsum8`] of each of eight vectors, lane `i` of the result vector `i`'s:
    /// the same additions, for the eight at once (a transpose as it adds: 21 shuffles and
    /// additions for eight scores, where one vector at a time took six a score beside the
    /// score's 16 multiply-adds at a 128-value head).
    #[target_feature(enable = "avx2")]
    #[inline]
    pub(super) fn hsum8_each(v: &[__m256; 8]) -> __m256 {
        // Lanes l + l+4 of vector i (hsum8's first additions), vector i in the low half and
        // vector i + 4 in the high half of `halves[i]`.
        let halves: [__m256; 4] = std::array::from_fn(|i| {
            _mm256_add_ps(
                _mm256_permute2f128_ps::<0x20>(v[i], v[i + 4]),
                _mm256_permute2f128_ps::<0x31>(v[i], v[i + 4]),
            )
        });
        // (l0+l4) + (l2+l6) and (l1+l5) + (l3+l7): per half [a's two, b's two] of the pair.
        let pairs = |a: __m256, b: __m256| {
            _mm256_add_ps(
                _mm256_shuffle_ps::<0b01_00_01_00>(a, b),
                _mm256_shuffle_ps::<0b11_10_11_10>(a, b),
            )
        };
        let (low, high) = (pairs(halves[0], halves[1]), pairs(halves[2], halves[3]));
        // The two sums added: vectors 0-3 in the low half, 4-7 in the high half, in order.
        _mm256_add_ps(
            _mm256_shuffle_ps::<0b10_00_10_00>(low, high),
            _mm256_shuffle_ps::<0b11_01_11_01>(low, high),
        )
    }

    fn dot_rows(span: ValueRows<'_, f16>, queries: &[f32], scores: &mut [f32], j: usize, n: usize) {
        let heads = scores.len() / n;
        let d = queries.len() / heads.max(1);
        let ValueRows {
            values: keys,
            rows,
            stride,
            col,
        } = span;
        assert!(d > 0 && heads * d == queries.len() && j + rows <= n);
        assert!(rows == 0 || keys.len() >= (rows - 1) * stride + col + d);
        let keys = &keys[col..];
        for h0 in (0..heads).step_by(DOT_HEADS) {
            let q = &queries[h0 * d..];
            let sums = &mut scores[h0 * n + j..];
            // SAFETY: `Isa::detect` named AVX2 (with FMA and F16C) before these ops were chosen;
            // `q` holds the call's heads (`d` values each), `sums` has them `n` apart and room
            // for `rows` scores each (above), the keys' rows lie in `keys` (above).
            unsafe {
                with_dot_heads!(
                    heads - h0,
                    dot_rows_avx2(keys, (rows, stride, d), q, sums, n)
                )
            }
        }
    }

    /// [`dots_avx2`] for each of `rows` keys (`stride` apart), `A + B` heads at once (a tile's
    /// queries; `B` only where `A` is `FOLD_HEADS`): the query pointers are set up once per call.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot_rows_avx2<const A: usize, const B: usize>(
        keys: &[f16],
        (rows, stride, d): (usize, usize, usize),
        q: &[f32],
        sums: &mut [f32],
        n: usize,
    ) {
        let qa: [*const f32; A] = std::array::from_fn(|h| q[h * d..(h + 1) * d].as_ptr());
        let qb: [*const f32; B] = std::array::from_fn(|h| q[(A + h) * d..(A + h + 1) * d].as_ptr());
        for r in 0..rows {
            // SAFETY: the caller's guarantees, passed on; row `r`'s scores at `sums[h * n + r]`.
            unsafe { dot_key(&keys[r * stride..][..d], (&qa, &qb), q, &mut sums[r..], n) }
        }
    }

    fn weighted(span: ValueRows<'_, f16>, scores: &[f32], j: usize, n: usize, out: &mut [f32]) {
        let heads = scores.len() / n;
        let d = out.len() / heads;
        let ValueRows {
            values,
            rows,
            stride,
            col,
        } = span;
        assert!(heads * d == out.len() && j + rows <= n && scores.len() == heads * n);
        assert!(rows == 0 || values.len() >= (rows - 1) * stride + col + d);
        for h0 in (0..heads).step_by(HEADS) {
            let w = &scores[h0 * n + j..];
            let o = &mut out[h0 * d..];
            // SAFETY: as for `dots`; the rows' values lie in `values` (checked above), `w` and
            // `o` hold the call's heads `n` and `d` apart.
            unsafe {
                with_heads!(
                    heads - h0,
                    weighted_avx2(values[col..].as_ptr(), rows, stride, d, w, n, o)
                )
            }
        }
    }

    /// The weighted sum for `H` heads, eight or sixteen output values at a time: their
    /// accumulators stay in registers while the span's rows go by in order (one fused
    /// multiply-add per value and row, as in the reference), each value converted once.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn weighted_avx2<const H: usize>(
        values: *const f16,
        rows: usize,
        stride: usize,
        d: usize,
        w: &[f32],
        n: usize,
        out: &mut [f32],
    ) {
        assert!(w.len() > (H - 1) * n + rows.saturating_sub(1) && out.len() >= H * d);
        let wp: [*const f32; H] = std::array::from_fn(|h| w[h * n..].as_ptr());
        let op: [*mut f32; H] = std::array::from_fn(|h| out[h * d..].as_mut_ptr());
        let mut c = 0;
        while c + 16 <= d {
            // SAFETY: columns `c..c + 16` of each head's output and of every row (the caller's
            // bounds); weights `0..rows` of each head.
            unsafe {
                let mut acc: [[__m256; 2]; H] = std::array::from_fn(|h| {
                    [
                        _mm256_loadu_ps(op[h].add(c)),
                        _mm256_loadu_ps(op[h].add(c + 8)),
                    ]
                });
                for r in 0..rows {
                    let v = values.add(r * stride + c);
                    let (v0, v1) = (load8(v), load8(v.add(8)));
                    for (acc, wp) in acc.iter_mut().zip(wp) {
                        let wv = _mm256_broadcast_ss(&*wp.add(r));
                        acc[0] = _mm256_fmadd_ps(v0, wv, acc[0]);
                        acc[1] = _mm256_fmadd_ps(v1, wv, acc[1]);
                    }
                }
                for (acc, op) in acc.iter().zip(op) {
                    _mm256_storeu_ps(op.add(c), acc[0]);
                    _mm256_storeu_ps(op.add(c + 8), acc[1]);
                }
            }
            c += 16;
        }
        // The last columns (`d` not a multiple of 16) one at a time, in the same order.
        for c in c..d {
            for r in 0..rows {
                // SAFETY: as above, column `c < d`.
                unsafe {
                    let v = (*values.add(r * stride + c)).to_f32();
                    for (wp, op) in wp.iter().zip(op) {
                        *op.add(c) = v.mul_add(*wp.add(r), *op.add(c));
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// xorshift, uniform in [-scale, scale).
    fn random(seed: &mut u64, n: usize, scale: f32) -> Vec<f32> {
        (0..n)
            .map(|_| {
                *seed ^= *seed << 13;
                *seed ^= *seed >> 7;
                *seed ^= *seed << 17;
                ((*seed >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) as f32 * scale
            })
            .collect()
    }

    fn half(x: &[f32]) -> Vec<f16> {
        x.iter().map(|&v| f16::from_f32(v)).collect()
    }

    /// Runs `attend_group` over rows split into chunks of `chunk` positions.
    #[allow(clippy::too_many_arguments)]
    fn run(
        isa: Isa,
        q: &[f32],
        keys: &[f16],
        values: &[f16],
        chunk: usize,
        range: (usize, usize),
        head: HeadColumns,
        out: &mut [f32],
    ) {
        let rows = chunk * head.stride;
        let chunks: Vec<(&[f16], &[f16])> = keys.chunks(rows).zip(values.chunks(rows)).collect();
        let view = KvView::chunked(chunks, chunk);
        attend_group(isa, q, 0.7, &view, range, head, out, &mut Vec::new());
    }

    #[test]
    fn simd_equals_scalar_and_chunking_changes_nothing() {
        let mut seed = 0x1234_5678_9abc_def1u64;
        // Head sizes with and without a tail past the 32-value steps (and the 16 values the
        // weighted sums take at a time); strides wider than a head (several kv heads, reading
        // the second); groups of 1 to 6 heads (more than the AVX2 loops take at once); windows.
        for (d, kv_heads, heads, n, lo) in [
            (256, 1, 4, 1, 0),
            (256, 2, 4, 37, 3),
            (64, 1, 2, 300, 0),
            (80, 2, 1, 19, 7),
            (8, 1, 4, 5, 0),
            (40, 1, 6, 23, 2),
        ] {
            let head = HeadColumns {
                col: (kv_heads - 1) * d,
                d,
                stride: kv_heads * d,
            };
            let stride = head.stride;
            let q = random(&mut seed, heads * d, 3.0);
            let keys = half(&random(&mut seed, n * stride, 3.0));
            let values = half(&random(&mut seed, n * stride, 2.0));
            let mut reference = vec![0f32; heads * d];
            run(
                Isa::Scalar,
                &q,
                &keys,
                &values,
                n,
                (lo, n),
                head,
                &mut reference,
            );
            for isa in Isa::available() {
                for chunk in [1, 16, n] {
                    let mut out = vec![1f32; heads * d];
                    run(isa, &q, &keys, &values, chunk, (lo, n), head, &mut out);
                    let same = out
                        .iter()
                        .zip(&reference)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "{isa:?} d={d} n={n} chunk={chunk}");
                }
            }
        }
    }

    /// Keys and values of one sequence, `n` rows of `stride` in chunks of `chunk` rows.
    fn chunked<'a, T>(
        keys: &'a [T],
        values: &'a [T],
        stride: usize,
        chunk: usize,
    ) -> KvView<'a, T> {
        let rows = chunk * stride;
        KvView::chunked(keys.chunks(rows).zip(values.chunks(rows)).collect(), chunk)
    }

    /// Tiles of tokens (`attend_tile`, through `attend_rows`) give each token the bits the
    /// scalar reference gives it alone (`attend_group`), on every instruction set: ragged causal
    /// ends, sliding windows (narrower and wider than a tile), groups of 1, 2 and 4 heads, head
    /// sizes 64, 128 and 256 (and one with a tail), f16 and f32 keys and values, several
    /// sequences in one batch, the cache in chunks.
    fn tiles_equal_tokens_alone<T: KvElem + 'static>(convert: fn(&[f32]) -> Vec<T>) {
        let mut seed = 0x05ee_d0f7_11e5_u64;
        for (d, kv_heads, group, window, chunk) in [
            (128, 2, 2, None, 16),
            (128, 1, 1, Some(5), 7),
            (64, 2, 4, None, 300),
            (256, 1, 4, Some(20), 16),
            (64, 3, 2, Some(3), 1),
            (40, 1, 2, None, 16),
        ] {
            let h = kv_heads * group;
            let stride = kv_heads * d;
            // Sequences: (cached positions before the batch, new rows).
            let seqs = [(0usize, 29usize), (13, 1), (5, 17)];
            let keys: Vec<Vec<T>> = seqs
                .iter()
                .map(|&(c, n)| convert(&random(&mut seed, (c + n) * stride, 3.0)))
                .collect();
            let values: Vec<Vec<T>> = seqs
                .iter()
                .map(|&(c, n)| convert(&random(&mut seed, (c + n) * stride, 2.0)))
                .collect();
            let views: Vec<KvView<'_, T>> = keys
                .iter()
                .zip(&values)
                .map(|(k, v)| chunked(k, v, stride, chunk))
                .collect();
            let (mut seq, mut pos) = (Vec::new(), Vec::new());
            for (s, &(c, n)) in seqs.iter().enumerate() {
                seq.extend(std::iter::repeat_n(s, n));
                pos.extend(c..c + n);
            }
            let q = random(&mut seed, pos.len() * h * d, 3.0);
            let shape = Shape {
                heads: h,
                kv_heads,
                d,
                window,
                scale: 0.3,
            };
            let mut reference = vec![0f32; q.len()];
            for (t, o) in reference.chunks_exact_mut(group * d).enumerate() {
                let (t, g) = (t / kv_heads, t % kv_heads);
                let lo = window.map_or(0, |w| (pos[t] + 1).saturating_sub(w));
                let head = HeadColumns {
                    col: g * d,
                    d,
                    stride,
                };
                let at = t * h * d + g * group * d;
                let queries = &q[at..at + group * d];
                let range = (lo, pos[t] + 1);
                let view = &views[seq[t]];
                attend_group(
                    Isa::Scalar,
                    queries,
                    0.3,
                    view,
                    range,
                    head,
                    o,
                    &mut Vec::new(),
                );
            }
            for isa in Isa::available() {
                for tile in [1, 2, 3, 8] {
                    let out = attend_rows(isa, &q, &views, (&seq, &pos), shape, tile);
                    let same = out
                        .iter()
                        .zip(&reference)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "{isa:?} d={d} group={group} {window:?} tile={tile}");
                }
            }
        }
    }

    /// The eight lane sums at once are [`crate::kernels::hsum8`]'s, bit for bit (values of
    /// many magnitudes, so that the order of the additions shows).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn eight_lane_sums_at_once_are_hsum8s() {
        use std::arch::x86_64::{__m256, _mm256_loadu_ps, _mm256_storeu_ps};
        if !std::arch::is_x86_feature_detected!("avx2") {
            return;
        }
        let mut seed = 0x5eed_u64;
        for _ in 0..1000 {
            let values = random(&mut seed, 64, 1.0);
            let scales = random(&mut seed, 64, 30.0);
            let values: Vec<f32> = values
                .iter()
                .zip(&scales)
                .map(|(v, s)| v * s.exp2())
                .collect();
            let mut sums = [0f32; 8];
            // SAFETY: AVX2 is present (checked above); 64 values, eight for each vector.
            unsafe {
                let v: [__m256; 8] = std::array::from_fn(|i| _mm256_loadu_ps(&values[i * 8]));
                _mm256_storeu_ps(sums.as_mut_ptr(), x86::hsum8_each(&v));
            }
            for (i, sum) in sums.iter().enumerate() {
                let lanes: &[f32; 8] = values[i * 8..][..8].try_into().unwrap();
                assert_eq!(sum.to_bits(), crate::kernels::hsum8(lanes).to_bits(), "{i}");
            }
        }
    }

    #[test]
    fn tiles_equal_tokens_alone_f16() {
        tiles_equal_tokens_alone::<f16>(half);
    }

    #[test]
    fn tiles_equal_tokens_alone_f32() {
        tiles_equal_tokens_alone::<f32>(|x| x.to_vec());
    }

    /// Time of one layer's prefill attention (one sequence of N new tokens, the cache in
    /// blocks of `BLOCK_TOKENS` rows) per token at a time (tile 1, the decode path) and in
    /// tiles, with the best instruction set here (`TEMPER_ISA=avx2` for the AVX2 kernels), the
    /// best of several trials: `cargo test --release -p temper-model --lib -- --ignored
    /// --nocapture prefill_attention_throughput` (`ATTN_TILES=1,4,8` picks the tiles, `ATTN_BENCH=Gemma` the shapes whose line contains
    /// that text).
    #[test]
    #[ignore]
    fn prefill_attention_throughput() {
        let isa = Isa::detect();
        let block = crate::cache::BLOCK_TOKENS;
        let tiles: Vec<usize> = std::env::var("ATTN_TILES")
            .map(|v| v.split(',').map(|t| t.parse().unwrap()).collect())
            .unwrap_or(vec![1, TILE_TOKENS]);
        let mut seed = 7u64;
        for (name, h, hkv, d) in [("Qwen3-0.6B", 16, 8, 128), ("Gemma 3 270M", 4, 1, 256)] {
            for n in [512, 2048] {
                let label = format!("{name} N={n}");
                if !label.contains(&std::env::var("ATTN_BENCH").unwrap_or_default()) {
                    continue;
                }
                let stride = hkv * d;
                let blocks: Vec<(Vec<f16>, Vec<f16>)> = (0..n / block)
                    .map(|_| {
                        let k = half(&random(&mut seed, block * stride, 3.0));
                        (k, half(&random(&mut seed, block * stride, 2.0)))
                    })
                    .collect();
                let chunks = blocks.iter().map(|(k, v)| (&k[..], &v[..])).collect();
                let views = [KvView::chunked(chunks, block)];
                let q = random(&mut seed, n * h * d, 1.0);
                let (seq, pos) = (vec![0; n], (0..n).collect::<Vec<_>>());
                let shape = Shape {
                    heads: h,
                    kv_heads: hkv,
                    d,
                    window: None,
                    scale: 0.1,
                };
                for &tile in &tiles {
                    let trials = if n > 1000 { 5 } else { 15 };
                    let (mut best, mut best_cpu) = (f64::INFINITY, f64::INFINITY);
                    for _ in 0..trials {
                        let (t, cpu) = (
                            std::time::Instant::now(),
                            crate::kernels::test_util::cpu_seconds(),
                        );
                        let rows = (&seq[..], &pos[..]);
                        std::hint::black_box(attend_rows(isa, &q, &views, rows, shape, tile));
                        best = best.min(t.elapsed().as_secs_f64());
                        best_cpu = best_cpu.min(crate::kernels::test_util::cpu_seconds() - cpu);
                    }
                    println!(
                        "{name} ({h} heads, {hkv} kv, d {d}) {isa:?} N={n} tile {tile}: {:.0} µs \
                         (CPU time of all threads {:.0} µs)",
                        best * 1e6,
                        best_cpu * 1e6
                    );
                }
            }
        }
    }

    #[test]
    fn matches_an_exact_softmax_closely() {
        let mut seed = 42u64;
        let (d, n) = (128, 50);
        let q = random(&mut seed, d, 0.5);
        let keys = half(&random(&mut seed, n * d, 1.0));
        let values = half(&random(&mut seed, n * d, 1.0));
        let mut out = vec![0f32; d];
        let head = HeadColumns {
            col: 0,
            d,
            stride: d,
        };
        run(
            Isa::detect(),
            &q,
            &keys,
            &values,
            16,
            (0, n),
            head,
            &mut out,
        );
        let scores: Vec<f64> = (0..n)
            .map(|j| {
                (0..d)
                    .map(|i| q[i] as f64 * keys[j * d + i].to_f64())
                    .sum::<f64>()
                    * 0.7
            })
            .collect();
        let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let w: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
        let total: f64 = w.iter().sum();
        for i in 0..d {
            let exact: f64 = (0..n)
                .map(|j| w[j] * values[j * d + i].to_f64())
                .sum::<f64>()
                / total;
            assert!(
                (out[i] as f64 - exact).abs() < 1e-5,
                "{i}: {} vs {exact}",
                out[i]
            );
        }
    }
}
