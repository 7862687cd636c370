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
    // n is in [-126, 0]: a normal power of two.
    f32::from_bits(((n as i32 + 127) as u32) << 23) * p
}

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
    let mut exps = [0f32; CHUNK];
    logits
        .chunks(CHUNK)
        .map(|c| chunk_sum_exp(c, max, &mut exps))
        .sum()
}

/// [`sum_exp`] that leaves `e^(x - max)` in place of each logit (0 for NaN) and also returns
/// `Σ e^(x - max)·(x - max)` (`x - max` at least -87, as [`exp_neg`] takes it). The sum is [`sum_exp`]'s, bit for bit (the same chunks, lanes and
/// order).
pub fn exp_in_place(logits: &mut [f32], max: f32) -> (f64, f64) {
    let mut exps = [0f32; CHUNK];
    let (mut total, mut weighted) = (0f64, 0f64);
    for c in logits.chunks_mut(CHUNK) {
        total += chunk_sum_exp(c, max, &mut exps);
        let mut lanes = [0f32; LANES];
        let mut it = c.chunks_exact(LANES).zip(exps.chunks_exact(LANES));
        for (v, e) in &mut it {
            for ((acc, &l), &e) in lanes.iter_mut().zip(v).zip(e) {
                *acc += if e > 0.0 {
                    e * (l - max).max(-87.0)
                } else {
                    0.0
                };
            }
        }
        weighted += lanes.iter().map(|&v| v as f64).sum::<f64>();
        let tail = c.len() - c.len() % LANES;
        for (&l, &e) in c[tail..].iter().zip(&exps[tail..]) {
            if e > 0.0 {
                weighted += (e * (l - max).max(-87.0)) as f64;
            }
        }
        c.copy_from_slice(&exps[..c.len()]);
    }
    (total, weighted)
}

/// One chunk's `Σ e^(x - max)` in `LANES` f32 lanes, summed in f64, each `e^(x - max)` (0 for
/// NaN) left in `exps`.
#[inline(always)]
fn chunk_sum_exp(c: &[f32], max: f32, exps: &mut [f32; CHUNK]) -> f64 {
    let mut lanes = [0.0f32; LANES];
    let mut it = c.chunks_exact(LANES).zip(exps.chunks_exact_mut(LANES));
    for (v, e) in &mut it {
        for ((acc, &l), e) in lanes.iter_mut().zip(v).zip(e) {
            let x = l - max;
            *e = if x <= 0.0 { exp_neg(x) } else { 0.0 };
            *acc += *e;
        }
    }
    let mut s: f64 = lanes.iter().map(|&v| v as f64).sum();
    let tail = c.len() - c.len() % LANES;
    for (&l, e) in c[tail..].iter().zip(&mut exps[tail..]) {
        let x = l - max;
        *e = if x <= 0.0 { exp_neg(x) } else { 0.0 };
        s += *e as f64;
    }
    s
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
}
