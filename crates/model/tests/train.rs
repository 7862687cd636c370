//! Scoring and the training forward/backward over packed sequences.

mod common;

use common::{tiny_model, tiny_model_f32, tokens, trained_adapter};
use temper_model::{Decoder, LoraAdapter, ModelError, PackedSequence, SeqInput, TokenScores};

/// Scored flags: every token but each segment's first.
fn scored_all(segment_lens: &[usize]) -> Vec<bool> {
    segment_lens
        .iter()
        .flat_map(|&n| std::iter::once(false).chain(std::iter::repeat_n(true, n - 1)))
        .collect()
}

/// The serving forward's log-softmax (and entropy, in f64) of each next token of `toks`, one
/// segment alone, computed from its full logits: the first token a prompt, every later one a sampled
/// token (as `scored_all` marks them), so each row is computed as its decode step was.
fn serving_scores(model: &Decoder, toks: &[u32], adapter: Option<&LoraAdapter>) -> TokenScores {
    let mut cache = model.new_cache();
    let logits = model
        .forward(&mut [SeqInput {
            tokens: toks,
            cache: &mut cache,
            all_logits: true,
            adapter,
        }])
        .expect("forward")
        .remove(0);
    let mut out = TokenScores {
        logprobs: Vec::new(),
        entropies: Vec::new(),
    };
    for t in 1..toks.len() {
        let row = logits.row(t - 1);
        // The server's normalizer (its sampler's logprobs use this function).
        let lse = temper_model::softmax::log_sum_exp(row);
        let entropy: f64 = row
            .iter()
            .map(|&z| {
                let lp = z as f64 - lse;
                -lp.exp() * lp
            })
            .sum();
        out.logprobs
            .push((row[toks[t] as usize] as f64 - lse) as f32);
        out.entropies.push(entropy as f32);
    }
    out
}

/// Max and mean |a - b|.
fn diffs(a: &[f32], b: &[f32]) -> (f32, f64) {
    assert_eq!(a.len(), b.len());
    let max = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    let mean = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs() as f64)
        .sum::<f64>()
        / a.len() as f64;
    (max, mean)
}

/// Scores two segments packed together and compares them with each segment served alone.
/// Returns the (max, mean) |logprob diff|.
fn compare_with_serving(
    model: &Decoder,
    segs: &[Vec<u32>],
    adapter: Option<&LoraAdapter>,
) -> (f32, f64) {
    let toks: Vec<u32> = segs.concat();
    let lens: Vec<usize> = segs.iter().map(Vec::len).collect();
    let scored = scored_all(&lens);
    let packed = PackedSequence {
        tokens: &toks,
        segment_lens: &lens,
        scored: &scored,
    };
    let got = model.score(&packed, adapter).expect("score");
    let mut want = TokenScores {
        logprobs: Vec::new(),
        entropies: Vec::new(),
    };
    for s in segs {
        let w = serving_scores(model, s, adapter);
        want.logprobs.extend(w.logprobs);
        want.entropies.extend(w.entropies);
    }
    let (_, entropy_mean) = diffs(&got.entropies, &want.entropies);
    assert!(entropy_mean < 1e-4, "entropy mean diff {entropy_mean}");
    diffs(&got.logprobs, &want.logprobs)
}

#[test]
fn score_equals_the_serving_log_softmax() {
    let model = tiny_model("train-score");
    let adapter = trained_adapter(&model, 4, 0.05);
    // Longer than the sliding window (8), so local layers drop early keys.
    let segs = [tokens(19, 1), tokens(12, 2)];
    for a in [None, Some(&adapter)] {
        let (max, mean) = compare_with_serving(&model, &segs, a);
        eprintln!(
            "tiny model, adapter {}: max |diff| {max:e}, mean {mean:e}",
            a.is_some()
        );
        assert_eq!(
            max, 0.0,
            "the training forward should reproduce serving bit for bit"
        );
    }
    // The training forward scores the same.
    let toks = segs.concat();
    let lens = [19, 12];
    let scored = scored_all(&lens);
    let packed = PackedSequence {
        tokens: &toks,
        segment_lens: &lens,
        scored: &scored,
    };
    let (scores, _) = model
        .train_forward(&packed, &adapter)
        .expect("train_forward");
    assert_eq!(scores, model.score(&packed, Some(&adapter)).expect("score"));
}

#[test]
fn score_equals_serving_on_the_default_model() {
    let Some(path) = temper_model::paths::real_model_for_tests() else {
        return;
    };
    let model = temper_model::load_gguf(&path).expect("load").model;
    let adapter = trained_adapter(&model, 4, 0.01);
    let segs = [
        vec![
            2, 105, 2364, 107, 3689, 563, 506, 92900, 10565, 580, 106, 107, 105, 4368, 107,
        ],
        vec![
            2, 105, 2364, 107, 818, 3823, 8864, 37423, 38167, 1024, 506, 31770, 4799,
        ],
    ];
    for a in [None, Some(&adapter)] {
        let (max, mean) = compare_with_serving(&model, &segs, a);
        eprintln!(
            "default model, adapter {}: max |diff| {max:e}, mean {mean:e}",
            a.is_some()
        );
        assert!(mean < 1e-3, "mean |diff| {mean}");
    }
}

#[test]
fn packed_segments_do_not_see_each_other() {
    let model = tiny_model("train-packing");
    let adapter = trained_adapter(&model, 6, 0.05);
    let (a, b, c) = (tokens(11, 1), tokens(14, 2), tokens(9, 3));
    let score = |segs: &[&Vec<u32>]| {
        let toks: Vec<u32> = segs.iter().flat_map(|s| s.iter().copied()).collect();
        let lens: Vec<usize> = segs.iter().map(|s| s.len()).collect();
        let scored = scored_all(&lens);
        model
            .score(
                &PackedSequence {
                    tokens: &toks,
                    segment_lens: &lens,
                    scored: &scored,
                },
                Some(&adapter),
            )
            .expect("score")
    };
    let alone = score(&[&b]);
    let after_a = score(&[&a, &b]);
    let after_c = score(&[&c, &b]);
    assert_eq!(&after_a.logprobs[10..], &alone.logprobs[..]);
    assert_eq!(&after_c.logprobs[8..], &alone.logprobs[..]);
    // And the neighbour really is different context: unpacked, b's scores change.
    let joined: Vec<u32> = [a.clone(), b.clone()].concat();
    let one = score(&[&joined]);
    assert_ne!(&one.logprobs[11..], &alone.logprobs[..]);
}

#[test]
fn bad_packing_is_an_error() {
    let model = tiny_model("train-bad");
    let adapter = trained_adapter(&model, 1, 0.05);
    let toks = tokens(6, 1);
    let check = |lens: &[usize], scored: &[bool]| {
        let r = model.score(
            &PackedSequence {
                tokens: &toks,
                segment_lens: lens,
                scored,
            },
            None,
        );
        assert!(
            matches!(r, Err(ModelError::Packing(_))),
            "{lens:?} {scored:?}: {r:?}"
        );
    };
    check(&[3, 2], &scored_all(&[3, 3]));
    check(&[3, 3], &scored_all(&[3, 2]));
    check(&[3, 0, 3], &scored_all(&[3, 3]));
    check(&[2, 4], &scored_all(&[3, 3]));
    let scored = scored_all(&[6]);
    let packed = PackedSequence {
        tokens: &toks,
        segment_lens: &[6],
        scored: &scored,
    };
    let (_, tape) = model.train_forward(&packed, &adapter).expect("forward");
    assert!(matches!(
        model.backward(tape, &adapter, &[1.0; 4]),
        Err(ModelError::Packing(_))
    ));
    let bad_token = [1u32, 100_000];
    let r = model.score(
        &PackedSequence {
            tokens: &bad_token,
            segment_lens: &[2],
            scored: &[false, true],
        },
        None,
    );
    assert!(
        matches!(r, Err(ModelError::TokenOutOfRange { .. })),
        "{r:?}"
    );
}

/// Deterministic values in [-1, 1).
fn pseudo_random(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

/// Central finite differences of `loss = Σ c_t · logprob_t` against the backward, on entries of
/// A and B of every target in every layer (layers 0 and 2 local, 1 and 3 global) over two packed
/// segments longer than the sliding window. The model has F32 weights and computes in f32: the
/// quantized model's activation quantization makes its loss a step function at the scale of a
/// finite difference.
/// Gradients of layer 0 pass through every later layer's norms, rope, attention, gelu and
/// residuals and the chunked LM head, so a wrong backward of any op shows up here.
#[test]
fn backward_matches_finite_differences() {
    check_finite_differences("train-gradcheck", &[13, 11], 0, 3);
}

/// The same check over a segment longer than the attention backward's query tile (256): only
/// the last 20 tokens weigh in the loss (so its f32 noise stays that of the short check), and
/// their gradients reach keys and values of the first tile through the global layers and of
/// the tile's own window start through the local ones.
#[test]
fn backward_matches_finite_differences_across_query_tiles() {
    check_finite_differences("train-gradcheck-long", &[300, 7], 287, 1);
}

/// Central differences of `Σ c_t · logprob_t` against the backward, for `samples` entries of
/// every adapter tensor, with `c_t` zero for the first `unweighted` scored tokens.
fn check_finite_differences(name: &str, lens: &[usize], unweighted: usize, samples: usize) {
    let mut model = tiny_model_f32(name);
    // The f16 keys, values and GELU table would make the loss a step function at this scale too.
    model.set_smooth(true);
    let mut adapter = trained_adapter(&model, 11, 0.1);
    let toks: Vec<u32> = lens
        .iter()
        .enumerate()
        .flat_map(|(i, &n)| tokens(n, 5 + i as u32))
        .collect();
    let scored = scored_all(lens);
    let packed = PackedSequence {
        tokens: &toks,
        segment_lens: lens,
        scored: &scored,
    };
    let mut coef = pseudo_random(scored.iter().filter(|&&s| s).count(), 3);
    coef[..unweighted].fill(0.0);
    let loss = |adapter: &LoraAdapter| -> f64 {
        let s = model.score(&packed, Some(adapter)).expect("score");
        s.logprobs
            .iter()
            .zip(&coef)
            .map(|(&l, &c)| l as f64 * c as f64)
            .sum()
    };
    let (_, tape) = model.train_forward(&packed, &adapter).expect("forward");
    let grads = model.backward(tape, &adapter, &coef).expect("backward");

    const EPS: f32 = 1e-2;
    let num_params = adapter.params().len();
    let mut worst = 0f64;
    let (mut err2, mut norm2) = (0f64, 0f64);
    for p in 0..num_params {
        let len = adapter.params()[p].len();
        for (k, r) in pseudo_random(samples, p as u64 + 100)
            .into_iter()
            .enumerate()
        {
            let i = (((r + 1.0) / 2.0) * len as f32) as usize % len;
            let orig = adapter.params()[p][i];
            adapter.params_mut()[p][i] = orig + EPS;
            let up = loss(&adapter);
            adapter.params_mut()[p][i] = orig - EPS;
            let down = loss(&adapter);
            adapter.params_mut()[p][i] = orig;
            let fd = (up - down) / (2.0 * EPS as f64);
            let an = grads.grads[p][i] as f64;
            // Measured f32 noise of the differences is ~2e-4 (the loss sums 22 f32 logprobs of
            // ~6 nats; its rounding divided by 2·EPS); 1e-3 absolute covers it, and 2% relative
            // is far below what a wrong op gives (a factor, a sign, a missing term).
            let excess = (fd - an).abs() / (0.02 * an.abs() + 1e-3);
            if excess > worst {
                worst = excess;
                eprintln!("param {p} entry {i} (sample {k}): fd {fd:.6} backward {an:.6}");
            }
            err2 += (fd - an).powi(2);
            norm2 += an.powi(2);
        }
    }
    let rel = (err2 / norm2).sqrt();
    eprintln!("worst entry at {worst:.2} of its bound, overall relative error {rel:.2e}");
    assert!(norm2.sqrt() > 1e-2, "gradients are suspiciously small");
    assert!(rel < 1e-2, "overall relative error {rel}");
    assert!(worst < 1.0, "an entry is off by {worst:.2} times its bound");
}
