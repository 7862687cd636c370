//! Token sampling over one raw logits row, following vLLM's order: greedy when the temperature
//! is ~0, else temperature → min_p → top_k → top_p → draw. Scratch buffers are kept across calls
//! so a 262k-wide row costs no allocation per token.

use std::cmp::Ordering;

use crate::rng::Rng;
use crate::{SamplingParams, TokenLogprob};

/// Below this temperature sampling is greedy (vLLM's epsilon).
const GREEDY_EPS: f32 = 1e-5;

/// Relative weights below exp(-CUTOFF) of the best token are treated as zero: together the
/// whole vocabulary of them weighs < 1e-11 of the total, and skipping them skips the exp().
const CUTOFF: f32 = 40.0;

#[derive(Default)]
pub(crate) struct Sampler {
    /// exp((logit - max) / T) per token; 0 for filtered tokens.
    weights: Vec<f32>,
    /// Candidate token ids when top_k / top_p need an ordering.
    cand: Vec<u32>,
}

/// Argmax, lowest id on ties; NaN logits never win.
pub(crate) fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0usize;
    let mut best_v = f32::NEG_INFINITY;
    let mut found = false;
    for (i, &v) in logits.iter().enumerate() {
        if v > best_v || (!found && !v.is_nan()) {
            best = i;
            best_v = v;
            found = true;
        }
    }
    best as u32
}

impl Sampler {
    pub(crate) fn sample(&mut self, logits: &[f32], p: &SamplingParams, rng: &mut Rng) -> u32 {
        // `!(t >= eps)` also routes NaN temperatures to greedy.
        if !(p.temperature >= GREEDY_EPS) || logits.is_empty() {
            return argmax(logits);
        }
        let max = logits
            .iter()
            .copied()
            .filter(|v| !v.is_nan())
            .fold(f32::NEG_INFINITY, f32::max);
        if !max.is_finite() {
            return argmax(logits);
        }
        let inv_t = 1.0 / p.temperature;
        // min_p compares prob / max prob = weight (the best token has weight 1).
        let min_w = if p.min_p > 0.0 { p.min_p.min(1.0) } else { 0.0 };
        let floor = max - CUTOFF * p.temperature;
        self.weights.clear();
        self.weights.extend(logits.iter().map(|&l| {
            if l >= floor {
                let w = ((l - max) * inv_t).exp();
                if w >= min_w {
                    w
                } else {
                    0.0
                }
            } else {
                0.0
            }
        }));

        let vocab = logits.len();
        let top_k_on = p.top_k > 0 && p.top_k < vocab;
        // `!(top_p >= 1)` also treats NaN as "on"; a non-positive top_p keeps only the best.
        let top_p_on = !(p.top_p >= 1.0);
        if !top_k_on && !top_p_on {
            return self.draw_all(rng).unwrap_or_else(|| argmax(logits));
        }

        let weights = &self.weights;
        let cand = &mut self.cand;
        cand.clear();
        cand.extend((0..vocab as u32).filter(|&i| weights[i as usize] > 0.0));
        // Descending weight, ascending id: a total order, so the result does not depend on the
        // selection algorithm's internal choices.
        let order = |a: &u32, b: &u32| -> Ordering {
            weights[*b as usize]
                .partial_cmp(&weights[*a as usize])
                .unwrap_or(Ordering::Equal)
                .then(a.cmp(b))
        };
        if top_k_on && cand.len() > p.top_k {
            cand.select_nth_unstable_by(p.top_k - 1, order);
            cand.truncate(p.top_k);
        }
        if top_p_on {
            let total: f64 = cand.iter().map(|&i| weights[i as usize] as f64).sum();
            let target = if p.top_p > 0.0 {
                p.top_p as f64 * total
            } else {
                0.0
            };
            // Sort only as much of the head as the nucleus needs: chunks that grow 4x, each
            // brought to the front with a linear-time selection.
            let mut sorted = 0usize;
            let mut chunk = 64usize;
            let mut cum = 0.0f64;
            'outer: while sorted < cand.len() {
                let end = (sorted + chunk).min(cand.len());
                if end < cand.len() {
                    cand[sorted..].select_nth_unstable_by(end - sorted - 1, order);
                }
                cand[sorted..end].sort_unstable_by(order);
                for j in sorted..end {
                    cum += weights[cand[j] as usize] as f64;
                    if cum >= target {
                        cand.truncate(j + 1);
                        break 'outer;
                    }
                }
                sorted = end;
                chunk = chunk.saturating_mul(4);
            }
        }
        let total: f64 = cand.iter().map(|&i| weights[i as usize] as f64).sum();
        if !(total > 0.0) {
            return argmax(logits);
        }
        let mut u = rng.next_f64() * total;
        for &i in cand.iter() {
            u -= weights[i as usize] as f64;
            if u < 0.0 {
                return i;
            }
        }
        // Rounding left a sliver of mass: the last candidate takes it.
        cand.last().copied().unwrap_or_else(|| argmax(logits))
    }

    fn draw_all(&self, rng: &mut Rng) -> Option<u32> {
        let total: f64 = self.weights.iter().map(|&w| w as f64).sum();
        if !(total > 0.0) {
            return None;
        }
        let mut u = rng.next_f64() * total;
        let mut last = None;
        for (i, &w) in self.weights.iter().enumerate() {
            if w > 0.0 {
                u -= w as f64;
                last = Some(i as u32);
                if u < 0.0 {
                    return last;
                }
            }
        }
        last
    }
}

/// Raw log-softmax of `token` and the `k` most likely tokens (descending, lowest id first on
/// ties), before any sampling transform.
pub(crate) fn logprobs(logits: &[f32], token: u32, k: usize) -> TokenLogprob {
    let max = logits
        .iter()
        .copied()
        .filter(|v| !v.is_nan())
        .fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits
        .iter()
        .filter(|v| !v.is_nan())
        .map(|&l| ((l - max) as f64).exp())
        .sum();
    let lse = max as f64 + sum.ln();
    let lp = |l: f32| (l as f64 - lse) as f32;
    let logprob = logits
        .get(token as usize)
        .map(|&l| lp(l))
        .unwrap_or(f32::NEG_INFINITY);
    let k = k.min(logits.len());
    // One pass with a small sorted buffer: k is small (OpenAI caps it at 20), the row is huge.
    let mut top: Vec<(u32, f32)> = Vec::with_capacity(k + 1);
    if k > 0 {
        for (i, &l) in logits.iter().enumerate() {
            if l.is_nan() || (top.len() == k && l <= top[k - 1].1) {
                continue;
            }
            // Insert after every entry >= l, so earlier (lower) ids win ties.
            let pos = top.partition_point(|&(_, v)| v >= l);
            top.insert(pos, (i as u32, l));
            top.truncate(k);
        }
    }
    TokenLogprob {
        logprob,
        top: top.into_iter().map(|(i, l)| (i, lp(l))).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32, top_p: f32, top_k: usize, min_p: f32) -> SamplingParams {
        SamplingParams {
            temperature,
            top_p,
            top_k,
            min_p,
            seed: None,
        }
    }

    fn ln_probs(ps: &[f32]) -> Vec<f32> {
        ps.iter().map(|p| p.ln()).collect()
    }

    /// Which tokens a configuration can ever produce, found by drawing many times.
    fn support(logits: &[f32], p: &SamplingParams, draws: usize) -> Vec<u32> {
        let mut s = Sampler::default();
        let mut rng = Rng::new(1);
        let mut seen = vec![false; logits.len()];
        for _ in 0..draws {
            seen[s.sample(logits, p, &mut rng) as usize] = true;
        }
        (0..logits.len() as u32)
            .filter(|&i| seen[i as usize])
            .collect()
    }

    #[test]
    fn greedy_is_argmax_lowest_id_on_ties() {
        let mut s = Sampler::default();
        let mut rng = Rng::new(0);
        let row = [0.1, 3.0, -1.0, 3.0, 2.9];
        assert_eq!(s.sample(&row, &params(0.0, 1.0, 0, 0.0), &mut rng), 1);
        assert_eq!(s.sample(&row, &params(1e-6, 0.5, 3, 0.0), &mut rng), 1);
        assert_eq!(argmax(&[f32::NAN, 1.0, 2.0, f32::NAN]), 2);
        assert_eq!(argmax(&[f32::NEG_INFINITY, f32::NEG_INFINITY]), 0);
    }

    #[test]
    fn top_k_one_equals_greedy() {
        let mut s = Sampler::default();
        let mut rng = Rng::new(3);
        let mut lrng = Rng::new(99);
        for _ in 0..50 {
            let row: Vec<f32> = (0..1000).map(|_| lrng.next_f64() as f32 * 10.0).collect();
            let g = argmax(&row);
            for _ in 0..5 {
                assert_eq!(s.sample(&row, &params(1.5, 1.0, 1, 0.0), &mut rng), g);
            }
        }
    }

    #[test]
    fn top_k_keeps_exactly_the_k_best() {
        let row = ln_probs(&[0.05, 0.3, 0.1, 0.25, 0.3]);
        assert_eq!(
            support(&row, &params(1.0, 1.0, 3, 0.0), 2000),
            vec![1, 3, 4]
        );
    }

    #[test]
    fn min_p_cuts_relative_to_the_best() {
        // Max prob 0.4: min_p 0.5 keeps tokens with prob >= 0.2.
        let row = ln_probs(&[0.4, 0.22, 0.17, 0.21]);
        assert_eq!(
            support(&row, &params(1.0, 1.0, 0, 0.5), 4000),
            vec![0, 1, 3]
        );
    }

    #[test]
    fn top_p_keeps_the_smallest_nucleus() {
        let row = ln_probs(&[0.1, 0.5, 0.25, 0.15]);
        // 0.5 alone < 0.6, 0.5+0.25 >= 0.6: keep {1, 2}.
        assert_eq!(support(&row, &params(1.0, 0.6, 0, 0.0), 4000), vec![1, 2]);
        // The best token alone covers the mass.
        assert_eq!(support(&row, &params(1.0, 0.45, 0, 0.0), 4000), vec![1]);
        assert_eq!(
            support(&row, &params(1.0, 0.95, 0, 0.0), 4000),
            vec![0, 1, 2, 3]
        );
    }

    #[test]
    fn top_p_on_a_wide_flat_row_spans_several_chunks() {
        // 1000 equal tokens: top_p 0.5 keeps the 500 lowest ids (ties broken by id).
        let row = vec![0.0f32; 1000];
        let sup = support(&row, &params(1.0, 0.5, 0, 0.0), 50_000);
        assert_eq!(sup.len(), 500);
        assert_eq!(*sup.last().unwrap(), 499);
    }

    #[test]
    fn filters_compose_in_vllm_order() {
        // min_p 0.3 of 0.4 → keeps >= 0.12: {0:0.4, 1:0.3, 2:0.15, 3:0.13}; top_k 3 → {0,1,2}
        // renormalised 0.4/0.85, 0.3/0.85 = 0.82 cumulative < 0.9 → top_p 0.9 keeps all three.
        let row = ln_probs(&[0.4, 0.3, 0.15, 0.13, 0.02]);
        assert_eq!(
            support(&row, &params(1.0, 0.9, 3, 0.3), 4000),
            vec![0, 1, 2]
        );
        // top_p 0.8 stops at {0, 1} (0.82 >= 0.8).
        assert_eq!(support(&row, &params(1.0, 0.8, 3, 0.3), 4000), vec![0, 1]);
    }

    #[test]
    fn same_seed_same_draws() {
        let mut lrng = Rng::new(5);
        let row: Vec<f32> = (0..5000).map(|_| lrng.next_f64() as f32 * 4.0).collect();
        for p in [
            params(1.0, 1.0, 0, 0.0),
            params(0.7, 0.9, 50, 0.05),
            params(1.3, 0.8, 0, 0.0),
        ] {
            let mut a = Sampler::default();
            let mut b = Sampler::default();
            let mut ra = Rng::new(1234);
            let mut rb = Rng::new(1234);
            let xs: Vec<u32> = (0..200).map(|_| a.sample(&row, &p, &mut ra)).collect();
            let ys: Vec<u32> = (0..200).map(|_| b.sample(&row, &p, &mut rb)).collect();
            assert_eq!(xs, ys);
            let mut rc = Rng::new(1235);
            let zs: Vec<u32> = (0..200).map(|_| a.sample(&row, &p, &mut rc)).collect();
            assert_ne!(xs, zs);
        }
    }

    #[test]
    fn draws_follow_the_tempered_softmax() {
        let logits = [1.0f32, 2.0, 0.5, 3.0, -1.0];
        for t in [1.0f32, 0.5, 2.0] {
            let mut s = Sampler::default();
            let mut rng = Rng::new(2024);
            let n = 200_000;
            let mut counts = [0usize; 5];
            for _ in 0..n {
                counts[s.sample(&logits, &params(t, 1.0, 0, 0.0), &mut rng) as usize] += 1;
            }
            let z: f64 = logits.iter().map(|&l| (l as f64 / t as f64).exp()).sum();
            for (i, &c) in counts.iter().enumerate() {
                let expect = (logits[i] as f64 / t as f64).exp() / z;
                let got = c as f64 / n as f64;
                // ~4 standard deviations of a binomial proportion.
                let tol = 4.0 * (expect * (1.0 - expect) / n as f64).sqrt() + 1e-4;
                assert!(
                    (got - expect).abs() < tol,
                    "t={t} token {i}: {got} vs {expect}"
                );
            }
        }
    }

    #[test]
    fn logprobs_are_raw_log_softmax_with_top_k() {
        let logits = [1.0f32, 3.0, 2.0, 3.0];
        let z: f64 = logits.iter().map(|&l| (l as f64).exp()).sum();
        let lp = |i: usize| (logits[i] as f64 - z.ln()) as f32;
        let out = logprobs(&logits, 2, 3);
        assert!((out.logprob - lp(2)).abs() < 1e-6);
        assert_eq!(
            out.top.iter().map(|t| t.0).collect::<Vec<_>>(),
            vec![1, 3, 2]
        );
        for (id, l) in &out.top {
            assert!((l - lp(*id as usize)).abs() < 1e-6);
        }
        assert!(logprobs(&logits, 0, 0).top.is_empty());
        assert_eq!(logprobs(&logits, 0, 10).top.len(), 4);
    }
}
