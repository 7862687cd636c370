//! The exponentials of a logits row as the server's sampler and logprobs take them and the
//! trainer's log-softmax takes them too, so a served logprob and a trained one are the same bits
//! when the logits are: a vectorizable `e^x` for `x <= 0` and the row's sum in one fixed order.

/// Rows are processed in chunks (L1-sized) with LANES independent accumulators, so the
/// compiler vectorizes the loops.
pub const CHUNK: usize = 1024;
pub const LANES: usize = 16;

/// e^x for x <= 0 (NaN is the caller's to mask): range reduction to 2^n · 2^f with |f| <= 1/2
/// and a degree-7 Taylor polynomial (relative error ~1e-7). Branch-free, so loops over it
/// vectorize, unlike `f32::exp`.
#[inline(always)]
pub fn exp_neg(x: f32) -> f32 {
    let (n, p) = exp_neg_parts(x);
    // n is in [-126, 0]: a normal power of two, 2^n, whose exponent bits `n + 127` are the low
    // bits of `n + 2^23 + 127` (exact in f32). Not `n as i32`: its saturating conversion kept
    // loops over this function from vectorizing (about 4x slower).
    f32::from_bits((n + EXPONENT_MAGIC).to_bits() << 23) * p
}

/// [`exp_neg`]'s range reduction: `x` (clamped) as `n·ln 2 + g`, returned as the integer `n`
/// (an f32) and the polynomial `p ≈ e^g`.
#[inline(always)]
fn exp_neg_parts(x: f32) -> (f32, f32) {
    let x = x.max(-87.0);
    let t = x * std::f32::consts::LOG2_E;
    let n = (t + 0.5).floor();
    let g = (t - n) * std::f32::consts::LN_2;
    let p = 1.0
        + g * (1.0
            + g * (1.0 / 2.0
                + g * (1.0 / 6.0
                    + g * (1.0 / 24.0
                        + g * (1.0 / 120.0 + g * (1.0 / 720.0 + g * (1.0 / 5040.0)))))));
    (n, p)
}

/// `2^23 + 127`: a float whose low mantissa bits are an integer added to it, plus the exponent
/// bias.
const EXPONENT_MAGIC: f32 = 8_388_735.0;

/// Largest logit, NaN ignored (-inf when there is none).
pub fn max_logit(logits: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let mut it = logits.chunks_exact(LANES);
    for c in &mut it {
        for (m, &v) in lanes.iter_mut().zip(c) {
            // `v > m` is false for NaN, so NaN never wins.
            *m = if v > *m { v } else { *m };
        }
    }
    let mut m = lanes.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    for &v in it.remainder() {
        if v > m {
            m = v;
        }
    }
    m
}

/// Sum of exp(x - max) over the row, NaN counted as 0.
pub fn sum_exp(logits: &[f32], max: f32) -> f64 {
    logits.chunks(CHUNK).map(|c| chunk_sum_exp(c, max)).sum()
}

/// [`sum_exp`] that leaves `e^(x - max)` in place of each logit (0 for NaN) and also returns
/// `Σ e^(x - max)·(x - max)` (`x - max` at least -87, as [`exp_neg`] takes it). The sum is
/// [`sum_exp`]'s, bit for bit (the same chunks, lanes and order). One pass over the row: the
/// trainer takes this for every scored token over the whole vocabulary.
pub fn exp_in_place(logits: &mut [f32], max: f32) -> (f64, f64) {
    let (mut total, mut weighted) = (0f64, 0f64);
    let mut exps = [0f32; CHUNK];
    for c in logits.chunks_mut(CHUNK) {
        let exps = &mut exps[..c.len()];
        total += chunk_exps(c, max, exps, &mut weighted);
        c.copy_from_slice(exps);
    }
    (total, weighted)
}

/// [`exp_in_place`]'s values and sums, the logits left as they are: each chunk of `CHUNK`
/// exponentials is made in a buffer in L1 and handed on from there (`then(first index,
/// chunk)`). Where only the chunks are wanted (the trainer quantizes them for the LM head's
/// backward), this saves writing the row back: a row of Gemma 3's vocabulary is 1 MB, more
/// than L2.
pub fn exp_then(logits: &[f32], max: f32, mut then: impl FnMut(usize, &[f32])) -> (f64, f64) {
    let (mut total, mut weighted) = (0f64, 0f64);
    let mut exps = [0f32; CHUNK];
    for (i, c) in logits.chunks(CHUNK).enumerate() {
        let exps = &mut exps[..c.len()];
        total += chunk_exps(c, max, exps, &mut weighted);
        then(i * CHUNK, exps);
    }
    (total, weighted)
}

/// One chunk's exponentials `e^(x - max)` into `exps` and their sum (as [`chunk_sum_exp`]),
/// adding `Σ e·(x - max)` to `weighted`.
#[inline(always)]
fn chunk_exps(c: &[f32], max: f32, exps: &mut [f32], weighted: &mut f64) -> f64 {
    let mut sums = [0f32; LANES];
    let mut weights = [0f32; LANES];
    let mut it = c.chunks_exact(LANES).zip(exps.chunks_exact_mut(LANES));
    for (v, out) in &mut it {
        for (((&l, e_out), sum), weight) in v.iter().zip(out).zip(&mut sums).zip(&mut weights) {
            let x = l - max;
            let e = exp_or_zero(x);
            *sum += e;
            // Unconditional, so the loop has no masked store (`vmaskmovps`, slow on AMD): where
            // `e` is 0 (NaN, or a logit above `max`), the product is ±0, which adds nothing.
            *weight += e * x.max(-87.0);
            *e_out = e;
        }
    }
    let mut chunk_total: f64 = sums.iter().map(|&v| v as f64).sum();
    *weighted += weights.iter().map(|&v| v as f64).sum::<f64>();
    let whole = c.len() / LANES * LANES;
    for (&l, e_out) in c[whole..].iter().zip(&mut exps[whole..]) {
        let x = l - max;
        let e = exp_or_zero(x);
        chunk_total += e as f64;
        if e > 0.0 {
            *weighted += (e * x.max(-87.0)) as f64;
        }
        *e_out = e;
    }
    chunk_total
}

/// One chunk's `Σ e^(x - max)` (NaN counted as 0) in `LANES` f32 lanes, summed in f64.
#[inline(always)]
fn chunk_sum_exp(c: &[f32], max: f32) -> f64 {
    let mut lanes = [0.0f32; LANES];
    let mut it = c.chunks_exact(LANES);
    for v in &mut it {
        for (acc, &l) in lanes.iter_mut().zip(v) {
            *acc += exp_or_zero(l - max);
        }
    }
    let mut s: f64 = lanes.iter().map(|&v| v as f64).sum();
    for &l in it.remainder() {
        s += exp_or_zero(l - max) as f64;
    }
    s
}

/// `e^x` of a logit less the row's max (`x <= 0`), 0 for NaN.
#[inline(always)]
fn exp_or_zero(x: f32) -> f32 {
    if x <= 0.0 {
        exp_neg(x)
    } else {
        0.0
    }
}

/// `ln Σ exp(z)` over the row (NaN counted as 0): the normalizer of every logprob served and
/// trained.
pub fn log_sum_exp(logits: &[f32]) -> f64 {
    let max = max_logit(logits);
    max as f64 + sum_exp(logits, max).ln()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_in_place_sums_as_sum_exp_does() {
        let mut state = 3u64;
        for len in [1, 15, 16, 1000, 1024, 3000, 262_144] {
            let row: Vec<f32> = (0..len)
                .map(|i| {
                    state = state
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    match i % 97 {
                        5 => f32::NAN,
                        6 => f32::NEG_INFINITY,
                        _ => ((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 40.0,
                    }
                })
                .collect();
            let max = max_logit(&row);
            let mut exps = row.clone();
            let (total, weighted) = exp_in_place(&mut exps, max);
            assert_eq!(total.to_bits(), sum_exp(&row, max).to_bits(), "{len}");
            // Handed on chunk by chunk without writing the row: the same values and sums.
            let mut handed = vec![f32::NAN; len];
            let sums = exp_then(&row, max, |at, c| {
                handed[at..at + c.len()].copy_from_slice(c)
            });
            assert_eq!(sums, (total, weighted), "{len}");
            assert!(handed
                .iter()
                .zip(&exps)
                .all(|(a, b)| a.to_bits() == b.to_bits()));
            let mut want = 0f64;
            for (&z, &e) in row.iter().zip(&exps) {
                if z.is_nan() {
                    assert_eq!(e, 0.0);
                } else {
                    assert_eq!(e, exp_neg(z - max));
                    want += e as f64 * (z - max).max(-87.0) as f64;
                }
            }
            assert!(
                (weighted - want).abs() <= 1e-5 * want.abs().max(1.0),
                "{len}"
            );
        }
    }

    /// Where `exp_or_zero` gives 0, the weighted sum's term `e · max(x, -87)` is a zero too, so
    /// `chunk_exps` adds it unmasked: the sum keeps its bits, from +0 or from any other value.
    /// (`x` is a logit less the row's maximum: NaN, or finite and above 0 had the maximum been
    /// another's; never +inf, since an infinite logit makes the maximum +inf and `x` NaN.)
    #[test]
    fn a_zero_exponential_adds_nothing_to_the_weighted_sum() {
        let xs = [f32::NAN, -f32::NAN, 0.5, 3e38, 1e-45];
        for x in xs {
            let e = exp_or_zero(x);
            assert_eq!(e.to_bits(), 0, "x = {x}");
            for acc in [0.0f32, -3.25, 1e-30, 7.0] {
                assert_eq!((acc + e * x.max(-87.0)).to_bits(), acc.to_bits(), "x = {x}");
            }
        }
    }

    #[test]
    fn exp_neg_is_accurate() {
        let mut x = 0.0f32;
        while x > -87.0 {
            let want = (x as f64).exp();
            let got = exp_neg(x) as f64;
            // f32 inputs carry ~1.2e-7·|x| relative error of their own.
            let tol = 1e-6 + 2e-7 * x.abs() as f64;
            assert!(
                ((got - want) / want).abs() < tol,
                "exp({x}) = {got}, want {want}"
            );
            x -= 0.0137;
        }
        assert_eq!(exp_neg(0.0), 1.0);
    }

    /// `exp_neg` gives the bits of the formula it had with an integer exponent (`n as i32`)
    /// wherever it is defined, and where callers' masked lanes land (NaN, -inf, -0).
    #[test]
    fn exp_neg_gives_the_bits_of_an_integer_exponent() {
        let by_cast = |x: f32| {
            let (n, p) = exp_neg_parts(x);
            f32::from_bits(((n as i32 + 127) as u32) << 23) * p
        };
        let specials = [f32::NAN, f32::NEG_INFINITY, -0.0, 0.0, -87.0, -87.5, -1e30];
        let sweep = (0..2_000_000).map(|i| -(i as f32) * 4.5e-5);
        for x in specials.into_iter().chain(sweep) {
            assert_eq!(exp_neg(x).to_bits(), by_cast(x).to_bits(), "x = {x}");
        }
    }
}
