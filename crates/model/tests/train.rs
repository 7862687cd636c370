//! Scoring and the training forward/backward over packed sequences.

mod common;

use common::{
    check_finite_differences, check_finite_differences_with_step, compare_with_serving, diffs,
    scored_all, tiny_model, tiny_model_f32, tokens, trained_adapter, trained_adapter_of,
};
use temper_model::{LoraConfig, ModelError, PackedSequence};

/// An adapter configuration with a pair on the LM head too (Tinker's `train_unembed`).
const WITH_HEAD: LoraConfig = LoraConfig {
    rank: 8,
    alpha: 16.0,
    unembed: true,
};

#[test]
fn score_equals_the_serving_log_softmax() {
    let model = tiny_model("train-score");
    let adapter = trained_adapter(&model, 4, 0.05);
    let with_head = trained_adapter_of(&model, WITH_HEAD, 4, 0.05);
    // Longer than the sliding window (8), so local layers drop early keys.
    let segs = [tokens(19, 1), tokens(12, 2)];
    for a in [None, Some(&adapter), Some(&with_head)] {
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
    for adapter in [&adapter, &with_head] {
        let (scores, _) = model
            .train_forward(&packed, adapter)
            .expect("train_forward");
        assert_eq!(scores, model.score(&packed, Some(adapter)).expect("score"));
    }
    // The LM-head pair changes the logprobs (it is not silently skipped).
    let plain = model.score(&packed, Some(&adapter)).expect("score");
    let headed = model.score(&packed, Some(&with_head)).expect("score");
    let (moved, _) = diffs(&plain.logprobs, &headed.logprobs);
    assert!(
        moved > 1e-2,
        "the LM-head pair moved logprobs by only {moved}"
    );
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

/// Central finite differences of `loss = Σ c_t · logprob_t` against the backward, on entries of
/// A and B of every target in every layer (layers 0 and 2 local, 1 and 3 global) over two packed
/// segments longer than the sliding window. The model has F32 weights and computes in f32: the
/// quantized model's activation quantization makes its loss a step function at the scale of a
/// finite difference.
/// Gradients of layer 0 pass through every later layer's norms, rope, attention, gelu and
/// residuals and the chunked LM head, so a wrong backward of any op shows up here.
#[test]
fn backward_matches_finite_differences() {
    check_finite_differences(tiny_model_f32("train-gradcheck"), &[13, 11], 0, 3);
}

/// With a pair on the (tied) LM head: its grads, and the gradient reaching the hidden states
/// through it, made in the backward from the chunks' logits computed again.
#[test]
fn backward_with_an_lm_head_pair_matches_finite_differences() {
    let model = tiny_model_f32("train-gradcheck-head");
    assert!(model.config().tied_embeddings);
    check_finite_differences_with_step(model, WITH_HEAD, &[13, 11], 0, 3, 1e-2);
}

/// With an LM-head pair and the loss's gradient given to the forward (the Tinker step's path),
/// the head's backward runs in the forward: the same grads, bit for bit, as computing the
/// chunks' logits again in the backward; other gradients than the forward's are refused.
#[test]
fn a_pointwise_loss_gives_the_recomputed_head_backward_bit_for_bit() {
    let model = tiny_model("train-pointwise");
    let adapter = trained_adapter_of(&model, WITH_HEAD, 6, 0.05);
    // Longer than one LM-head chunk (64 rows).
    let lens = [70, 13];
    let toks: Vec<u32> = [tokens(70, 1), tokens(13, 2)].concat();
    let scored = scored_all(&lens);
    let packed = PackedSequence {
        tokens: &toks,
        segment_lens: &lens,
        scored: &scored,
    };
    let dlogp = |i: usize, lp: f32| (i % 5) as f32 * 0.1 - 0.2 + lp.exp();
    let (scores, tape) = model.train_forward(&packed, &adapter).expect("forward");
    let dlogprobs: Vec<f32> = scores
        .logprobs
        .iter()
        .enumerate()
        .map(|(i, &lp)| dlogp(i, lp))
        .collect();
    let want = model
        .backward(tape, &adapter, &dlogprobs)
        .expect("backward");
    let (same, tape) = model
        .train_forward_pointwise(&packed, &adapter, &dlogp)
        .expect("pointwise forward");
    assert_eq!(same, scores);
    let got = model
        .backward(tape, &adapter, &dlogprobs)
        .expect("backward");
    assert_eq!(got.grads, want.grads);
    let head = adapter.params().len() - 1;
    assert!(got.grads[head].iter().any(|&g| g != 0.0));

    let (_, tape) = model
        .train_forward_pointwise(&packed, &adapter, &dlogp)
        .expect("pointwise forward");
    let mut other = dlogprobs.clone();
    other[3] += 1.0;
    assert!(matches!(
        model.backward(tape, &adapter, &other),
        Err(ModelError::Packing(_))
    ));
}

/// The same check over a segment longer than the attention backward's query tile (256 rows:
/// 128 tokens of the tiny model's two query heads per key/value head): only the last 20 tokens
/// weigh in the loss (so its f32 noise stays that of the short check), and their gradients
/// reach keys and values of the first tile through the global layers and of the tile's own
/// window start through the local ones.
#[test]
fn backward_matches_finite_differences_across_query_tiles() {
    check_finite_differences(tiny_model_f32("train-gradcheck-long"), &[300, 7], 287, 1);
}
