//! Token sampling over one raw logits row, following vLLM's order: greedy when the temperature
//! is ~0, else temperature → min_p → top_k → top_p → draw. A 262k-wide row is never fully
//! sorted: top_k keeps a k-sized heap in one pass over the raw logits, top_p finds its nucleus
//! with a histogram of log-weights and sorts only the tokens near it. Scratch buffers live
//! across calls, so sampling allocates nothing per token.

use std::cmp::{Ordering, Reverse};
use std::collections::BinaryHeap;

use temper_model::softmax::{exp_neg, log_sum_exp, max_logit, CHUNK, LANES};

use crate::rng::Rng;
use crate::{PromptLogprob, SamplingParams, TokenLogprob};

/// Below this temperature sampling is greedy (vLLM's epsilon).
const GREEDY_EPS: f32 = 1e-5;

/// Tokens whose weight relative to the best one is below exp(-CUTOFF) are dropped: the whole
/// vocabulary of them weighs < 1e-11 of the total.
const CUTOFF: f32 = 40.0;

/// Histogram resolution for top_p, in buckets per unit of log-weight.
const BUCKETS_PER_UNIT: f32 = 32.0;
const BUCKETS: usize = (CUTOFF * BUCKETS_PER_UNIT) as usize + 1;

#[derive(Default)]
pub(crate) struct Sampler {
    /// exp((logit - max) / T) per token, 0 for dropped tokens (used without top_k).
    weights: Vec<f32>,
    /// Sum of `weights` per CHUNK, to find a draw's chunk without walking the whole row.
    chunk_sums: Vec<f64>,
    /// top_p histogram: weight mass per log-weight bucket.
    hist: Vec<f64>,
    /// (token, weight) candidates for top_k / top_p.
    cand: Vec<(u32, f32)>,
    heap: BinaryHeap<Reverse<Ranked>>,
}

/// A token ranked by logit, lower id first on ties (so `Reverse` makes a min-heap of the best).
#[derive(Clone, Copy, PartialEq)]
struct Ranked {
    logit: f32,
    id: u32,
}

impl Eq for Ranked {}

impl Ord for Ranked {
    fn cmp(&self, other: &Self) -> Ordering {
        self.logit
            .total_cmp(&other.logit)
            .then(other.id.cmp(&self.id))
    }
}

impl PartialOrd for Ranked {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

/// Argmax, lowest id on ties; NaN logits never win.
pub(crate) fn argmax(logits: &[f32]) -> u32 {
    let m = max_logit(logits);
    logits
        .iter()
        .position(|&v| v == m)
        .or_else(|| logits.iter().position(|v| !v.is_nan()))
        .unwrap_or(0) as u32
}

/// Orders candidates by descending weight, then ascending id: a total order, so results do
/// not depend on the sort algorithm.
fn by_weight(a: &(u32, f32), b: &(u32, f32)) -> Ordering {
    b.1.total_cmp(&a.1).then(a.0.cmp(&b.0))
}

/// Keeps the smallest head of `cand` (sorted by `by_weight`) whose mass reaches `target`.
fn cut_nucleus(cand: &mut Vec<(u32, f32)>, target: f64) {
    let mut cum = 0.0f64;
    for j in 0..cand.len() {
        cum += cand[j].1 as f64;
        if cum >= target {
            cand.truncate(j + 1);
            return;
        }
    }
}

/// The top_p target mass; a non-positive (or NaN) top_p keeps only the best token.
fn nucleus_target(top_p: f32, total: f64) -> f64 {
    if top_p > 0.0 {
        top_p as f64 * total
    } else {
        0.0
    }
}

impl Sampler {
    pub(crate) fn sample(&mut self, logits: &[f32], p: &SamplingParams, rng: &mut Rng) -> u32 {
        if p.temperature.is_nan() || p.temperature < GREEDY_EPS || logits.is_empty() {
            return argmax(logits);
        }
        let inv_t = 1.0 / p.temperature;
        // min_p compares prob / max prob, which is the weight (the best token weighs 1).
        let min_w = if p.min_p > 0.0 { p.min_p.min(1.0) } else { 0.0 };
        // A NaN top_p is treated as on (and keeps only the best token).
        let top_p_on = p.top_p.is_nan() || p.top_p < 1.0;
        let drawn = if p.top_k > 0 && p.top_k < logits.len() {
            self.sample_top_k(
                logits,
                p.top_k,
                inv_t,
                min_w,
                top_p_on.then_some(p.top_p),
                rng,
            )
        } else {
            self.sample_full(logits, inv_t, min_w, top_p_on.then_some(p.top_p), rng)
        };
        drawn.unwrap_or_else(|| argmax(logits))
    }

    /// top_k: one pass over the raw logits with a k-sized min-heap, then everything else on
    /// the k candidates only.
    fn sample_top_k(
        &mut self,
        logits: &[f32],
        k: usize,
        inv_t: f32,
        min_w: f32,
        top_p: Option<f32>,
        rng: &mut Rng,
    ) -> Option<u32> {
        let heap = &mut self.heap;
        heap.clear();
        // Below the current k-th best nothing can enter; whole LANES-wide blocks under it are
        // skipped with one vectorized max.
        let mut threshold = f32::NEG_INFINITY;
        for (b, block) in logits.chunks(LANES).enumerate() {
            if heap.len() == k && max_logit(block) <= threshold {
                continue;
            }
            for (j, &logit) in block.iter().enumerate() {
                if logit.is_nan() {
                    continue;
                }
                let r = Ranked {
                    logit,
                    id: (b * LANES + j) as u32,
                };
                if heap.len() < k {
                    heap.push(Reverse(r));
                } else if logit > threshold {
                    // Later ids lose ties, so only a strictly larger logit gets in.
                    if let Some(mut worst) = heap.peek_mut() {
                        *worst = Reverse(r);
                    }
                } else {
                    continue;
                }
                if heap.len() == k {
                    threshold = heap.peek().map_or(f32::NEG_INFINITY, |w| w.0.logit);
                }
            }
        }
        let max = heap
            .iter()
            .map(|r| r.0.logit)
            .fold(f32::NEG_INFINITY, f32::max);
        if !max.is_finite() {
            return None;
        }
        let cand = &mut self.cand;
        cand.clear();
        for Reverse(r) in heap.drain() {
            let x = (r.logit - max) * inv_t;
            let w = if x >= -CUTOFF { exp_neg(x) } else { 0.0 };
            if w > 0.0 && w >= min_w {
                cand.push((r.id, w));
            }
        }
        cand.sort_unstable_by(by_weight);
        if let Some(top_p) = top_p {
            let total: f64 = cand.iter().map(|c| c.1 as f64).sum();
            cut_nucleus(cand, nucleus_target(top_p, total));
        }
        draw(cand, rng)
    }

    /// No top_k: weights for the whole row; top_p through the log-weight histogram.
    fn sample_full(
        &mut self,
        logits: &[f32],
        inv_t: f32,
        min_w: f32,
        top_p: Option<f32>,
        rng: &mut Rng,
    ) -> Option<u32> {
        let max = max_logit(logits);
        if !max.is_finite() {
            return None;
        }
        let total = self.fill_weights(logits, max, inv_t, min_w);
        if total.is_nan() || total <= 0.0 {
            return None;
        }
        let Some(top_p) = top_p else {
            return self.draw_weights(total, rng);
        };
        let target = nucleus_target(top_p, total);
        // Bucket b holds log-weights in (-(b+1), -b] / BUCKETS_PER_UNIT: find the bucket where
        // the mass, heaviest first, reaches the target; only tokens up to it can be in the
        // nucleus.
        let bucket = |l: f32| (((max - l) * inv_t * BUCKETS_PER_UNIT) as usize).min(BUCKETS - 1);
        self.hist.clear();
        self.hist.resize(BUCKETS, 0.0);
        for (&l, &w) in logits.iter().zip(&self.weights) {
            if w > 0.0 {
                self.hist[bucket(l)] += w as f64;
            }
        }
        let mut cum = 0.0;
        let mut last = BUCKETS - 1;
        for (b, &m) in self.hist.iter().enumerate() {
            cum += m;
            if cum >= target {
                last = b;
                break;
            }
        }
        self.cand.clear();
        for (i, (&l, &w)) in logits.iter().zip(&self.weights).enumerate() {
            if w > 0.0 && bucket(l) <= last {
                self.cand.push((i as u32, w));
            }
        }
        self.cand.sort_unstable_by(by_weight);
        cut_nucleus(&mut self.cand, target);
        draw(&self.cand, rng)
    }

    /// Fills `weights` (and per-chunk sums) and returns their total.
    fn fill_weights(&mut self, logits: &[f32], max: f32, inv_t: f32, min_w: f32) -> f64 {
        self.weights.resize(logits.len(), 0.0);
        self.chunk_sums.clear();
        let mut total = 0.0f64;
        for (src, dst) in logits.chunks(CHUNK).zip(self.weights.chunks_mut(CHUNK)) {
            for (w, &l) in dst.iter_mut().zip(src) {
                let x = (l - max) * inv_t;
                // NaN fails the comparison and weighs 0.
                let e = if x >= -CUTOFF { exp_neg(x) } else { 0.0 };
                *w = if e >= min_w { e } else { 0.0 };
            }
            let mut lanes = [0.0f32; LANES];
            let mut it = dst.chunks_exact(LANES);
            for v in &mut it {
                for (acc, &w) in lanes.iter_mut().zip(v) {
                    *acc += w;
                }
            }
            let s: f64 = lanes.iter().chain(it.remainder()).map(|&v| v as f64).sum();
            self.chunk_sums.push(s);
            total += s;
        }
        total
    }

    /// Draws from the whole weight row: find the chunk, then the token inside it.
    fn draw_weights(&self, total: f64, rng: &mut Rng) -> Option<u32> {
        let mut u = rng.next_f64() * total;
        let n_chunks = self.chunk_sums.len();
        for (c, &s) in self.chunk_sums.iter().enumerate() {
            if u >= s && c + 1 < n_chunks {
                u -= s;
                continue;
            }
            let base = c * CHUNK;
            let end = (base + CHUNK).min(self.weights.len());
            let mut last = None;
            for (i, &w) in self.weights[base..end].iter().enumerate() {
                if w > 0.0 {
                    last = Some((base + i) as u32);
                    u -= w as f64;
                    if u < 0.0 {
                        return last;
                    }
                }
            }
            // Rounding left a sliver past this chunk's tokens: its last token takes it.
            if last.is_some() {
                return last;
            }
        }
        None
    }
}

/// Draws from (token, weight) candidates in their order.
fn draw(cand: &[(u32, f32)], rng: &mut Rng) -> Option<u32> {
    let total: f64 = cand.iter().map(|c| c.1 as f64).sum();
    if total.is_nan() || total <= 0.0 {
        return None;
    }
    let mut u = rng.next_f64() * total;
    for &(id, w) in cand {
        u -= w as f64;
        if u < 0.0 {
            return Some(id);
        }
    }
    // Rounding left a sliver of mass: the last candidate takes it.
    cand.last().map(|c| c.0)
}

/// Raw log-softmax of `token` and the `k` most likely tokens (descending, lowest id first on
/// ties), before any sampling transform.
pub(crate) fn logprobs(logits: &[f32], token: u32, k: usize) -> TokenLogprob {
    let lse = log_sum_exp(logits);
    let lp = |l: f32| (l as f64 - lse) as f32;
    let logprob = logits
        .get(token as usize)
        .map(|&l| lp(l))
        .unwrap_or(f32::NEG_INFINITY);
    let k = k.min(logits.len());
    // One pass with a small sorted buffer: k is small (OpenAI caps it at 20), the row is huge.
    let mut top: Vec<(u32, f32)> = Vec::with_capacity(k + 1);
    if k > 0 {
        for (b, block) in logits.chunks(LANES).enumerate() {
            if top.len() == k && max_logit(block) <= top[k - 1].1 {
                continue;
            }
            for (j, &l) in block.iter().enumerate() {
                if l.is_nan() || (top.len() == k && l <= top[k - 1].1) {
                    continue;
                }
                // Insert after every entry >= l, so earlier (lower) ids win ties.
                let pos = top.partition_point(|&(_, v)| v >= l);
                top.insert(pos, ((b * LANES + j) as u32, l));
                top.truncate(k);
            }
        }
    }
    TokenLogprob {
        logprob,
        top: top.into_iter().map(|(i, l)| (i, lp(l))).collect(),
    }
}

/// What `logits` (the row before prompt position i) says of the prompt's token `token` at i:
/// its raw log-softmax, its rank and the `k` most likely tokens.
pub(crate) fn prompt_logprob(logits: &[f32], token: u32, k: usize) -> PromptLogprob {
    let TokenLogprob { logprob, top } = logprobs(logits, token, k);
    let rank = match top.iter().position(|&(id, _)| id == token) {
        Some(i) => i + 1,
        // vLLM's rank: how many tokens are at least as likely (ties share the worse rank).
        None => {
            let own = logits.get(token as usize).copied().unwrap_or(f32::NAN);
            logits.iter().filter(|&&l| l >= own).count().max(1)
        }
    };
    PromptLogprob {
        token,
        logprob,
        rank,
        top,
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
            ..SamplingParams::default()
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
    fn large_rows_match_the_reference_distribution() {
        // A wide row with a few peaks over a long tail: every path (full draw, histogram
        // nucleus, top_k heap) must agree with the plain definitions.
        let mut lrng = Rng::new(11);
        let v = 5000;
        let mut row: Vec<f32> = (0..v).map(|_| lrng.next_f64() as f32 * 6.0 - 3.0).collect();
        row[17] = 6.0;
        row[4000] = 5.5;
        row[123] = 5.5;
        for (t, top_p, top_k) in [
            (1.0f32, 1.0f32, 0usize),
            (0.8, 0.7, 0),
            (1.0, 1.0, 40),
            (1.2, 0.5, 300),
        ] {
            // Reference nucleus by full sort.
            let w: Vec<f64> = row
                .iter()
                .map(|&l| ((l - 6.0) as f64 / t as f64).exp())
                .collect();
            let mut order: Vec<usize> = (0..v).collect();
            order.sort_by(|&a, &b| w[b].partial_cmp(&w[a]).unwrap().then(a.cmp(&b)));
            if top_k > 0 {
                order.truncate(top_k);
            }
            let total: f64 = order.iter().map(|&i| w[i]).sum();
            let mut keep = Vec::new();
            let mut cum = 0.0;
            for &i in &order {
                keep.push(i);
                cum += w[i];
                if cum >= top_p as f64 * total {
                    break;
                }
            }
            let kept_mass: f64 = keep.iter().map(|&i| w[i]).sum();
            let mut s = Sampler::default();
            let mut rng = Rng::new(77);
            let n = 50_000;
            let mut counts = vec![0usize; v];
            for _ in 0..n {
                counts[s.sample(&row, &params(t, top_p, top_k, 0.0), &mut rng) as usize] += 1;
            }
            let outside: usize = (0..v)
                .filter(|i| !keep.contains(i))
                .map(|i| counts[i])
                .sum();
            assert_eq!(outside, 0, "t={t} p={top_p} k={top_k}");
            for &i in keep.iter().take(3) {
                let expect = w[i] / kept_mass;
                let got = counts[i] as f64 / n as f64;
                let tol = 4.0 * (expect * (1.0 - expect) / n as f64).sqrt() + 1e-4;
                assert!((got - expect).abs() < tol, "token {i}: {got} vs {expect}");
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

    #[test]
    fn prompt_logprob_ranks_in_the_vocabulary() {
        let logits = [1.0f32, 3.0, 2.0, 3.0, 0.5];
        // Outside the top 1: tokens 1, 3 and 2 are at least as likely as 2 itself.
        let p = prompt_logprob(&logits, 2, 1);
        assert_eq!((p.rank, p.top.len(), p.top[0].0), (3, 1, 1));
        assert_eq!(prompt_logprob(&logits, 4, 0).rank, 5);
        // Inside the top k: its place there.
        assert_eq!(prompt_logprob(&logits, 3, 2).rank, 2);
        assert_eq!(
            prompt_logprob(&logits, 0, 2).logprob,
            logprobs(&logits, 0, 0).logprob
        );
    }
}
