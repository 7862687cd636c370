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
    let mut total = 0.0f64;
    for c in logits.chunks(CHUNK) {
        let mut lanes = [0.0f32; LANES];
        let mut it = c.chunks_exact(LANES);
        for v in &mut it {
            for (acc, &l) in lanes.iter_mut().zip(v) {
                let x = l - max;
                *acc += if x <= 0.0 { exp_neg(x) } else { 0.0 };
            }
        }
        let mut s: f64 = lanes.iter().map(|&v| v as f64).sum();
        for &l in it.remainder() {
            let x = l - max;
            if x <= 0.0 {
                s += exp_neg(x) as f64;
            }
        }
        total += s;
    }
    total
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
