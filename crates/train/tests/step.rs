//! The caller-driven step (the Tinker API's `forward_backward` + `optim_step`) against the job
//! trainer on the tiny model: one `importance_sampling` step whose advantages carry the job's
//! token weights is the step a one-group training job takes with its default (CISPO) loss, whose
//! gradient is the same `-ratio · A` while the ratio is inside its clip range; and the forward's
//! logprobs are the scorer's.

use std::sync::atomic::AtomicBool;

use temper_model::{LoraAdapter, LoraConfig, PackedSequence};
use temper_train::{
    adam_step, forward_backward, run_job, AdamParams, AdamW, ExperimentalConfig, StepDatum,
    StepLoss, TokenizedJob, TokenizedSequence, TrainerConfig,
};

mod common;

/// Logprobs of `tokens[1..]` under `adapter`, by the scorer.
fn scored(t: &common::Tiny, tokens: &[u32], adapter: &LoraAdapter) -> Vec<f32> {
    let mut scored = vec![true; tokens.len()];
    scored[0] = false;
    let seq = PackedSequence {
        tokens,
        segment_lens: &[tokens.len()],
        scored: &scored,
    };
    t.model.score(&seq, Some(adapter)).unwrap().logprobs
}

#[test]
fn one_importance_sampling_step_is_a_one_group_job() {
    let t = common::tiny(5);
    let start = LoraAdapter::new(t.model.config(), LoraConfig::default(), 9);
    let prompt = common::served_prompt(&t, &[temper_text::ChatMessage::text("user", "hi")]);
    // Two sampled answers of different lengths, rewarded 1 and 0.
    let answers: [Vec<u32>; 2] = [vec![40, 41, 42], vec![50, 51]];
    let rewards = [1.0, 0.0];
    let mut sequences = Vec::new();
    let mut sampler = Vec::new();
    for (i, answer) in answers.iter().enumerate() {
        let tokens: Vec<u32> = prompt.iter().chain(answer).copied().collect();
        let lps = scored(&t, &tokens, &start);
        // The sampler's logprobs, a little off the trainer's: ratios inside CISPO's [0, 5].
        let old: Vec<f32> = lps.iter().map(|lp| lp - 0.05 * (i as f32 + 1.0)).collect();
        let mask: Vec<bool> = (0..tokens.len()).map(|j| j >= prompt.len()).collect();
        let old_logprobs: Vec<f32> = (0..tokens.len())
            .map(|j| if mask[j] { old[j - 1] } else { 0.0 })
            .collect();
        sampler.push(old);
        sequences.push(TokenizedSequence {
            tokens,
            mask,
            old_logprobs,
            group: 0,
            trajectory: i,
            source: format!("trajectory_groups[0].trajectories[{i}]"),
        });
    }
    let mut loss = serde_json::from_value::<ExperimentalConfig>(serde_json::json!({}))
        .unwrap()
        .resolve()
        .unwrap();
    loss.learning_rate = 1e-3;
    let job = TokenizedJob {
        sequences: sequences.clone(),
        rewards: vec![rewards.to_vec()],
        loss,
    };
    let by_job = run_job(
        &t.model,
        &start,
        &job,
        &TrainerConfig::default(),
        &AtomicBool::new(false),
        &mut |_| {},
    )
    .unwrap()
    .unwrap();

    // The same step through the caller-driven API. The job's advantages (training.md): group
    // centred and scaled, A = ±1 after dividing by mean |A|·w; each trajectory's tokens weigh
    // (total / trajectories) / its tokens; the loss is the mean over the trained tokens.
    let trainable: Vec<usize> = answers.iter().map(Vec::len).collect();
    let total = trainable.iter().sum::<usize>() as f64;
    let norm = 1.0 / (total + 1e-6);
    let mean = 0.5;
    let std = 0.5;
    let centred: Vec<f64> = rewards.iter().map(|r| (r - mean) / (std + 1e-6)).collect();
    let abs_mean = centred.iter().map(|a| a.abs()).sum::<f64>() / 2.0;
    let data: Vec<StepDatum> = sequences
        .iter()
        .zip(&sampler)
        .enumerate()
        .map(|(i, (s, old))| {
            let weight = (total / 2.0) / trainable[i] as f64;
            let advantage = (centred[i] / abs_mean * weight * norm) as f32;
            let n = s.tokens.len() - 1;
            // Position j predicts token j + 1: the answer's positions carry the advantage.
            let on = |j: usize| s.mask[j + 1];
            StepDatum {
                tokens: s.tokens[..n].to_vec(),
                last_target: s.tokens[n],
                weights: Vec::new(),
                old_logprobs: (0..n).map(|j| if on(j) { old[j] } else { 0.0 }).collect(),
                advantages: (0..n)
                    .map(|j| if on(j) { advantage } else { 0.0 })
                    .collect(),
            }
        })
        .collect();
    let out = forward_backward(
        &t.model,
        &start,
        &data,
        StepLoss::ImportanceSampling,
        true,
        2048,
    )
    .unwrap();
    // The forward's logprobs are the scorer's, bit for bit.
    for (s, lps) in sequences.iter().zip(&out.logprobs) {
        assert_eq!(lps, &scored(&t, &s.tokens, &start));
    }
    let mut by_step = start.clone();
    let mut optimizer = AdamW::new(&by_step);
    adam_step(
        &mut optimizer,
        &mut by_step,
        &out.grads.unwrap(),
        &AdamParams::job(1e-3),
        1,
    )
    .unwrap();

    let mut max_diff = 0f32;
    let mut max_change = 0f32;
    for ((a, b), s) in by_job
        .params()
        .iter()
        .zip(by_step.params())
        .zip(start.params())
    {
        for ((x, y), z) in a.iter().zip(b.iter()).zip(s.iter()) {
            max_diff = max_diff.max((x - y).abs());
            max_change = max_change.max((x - z).abs());
        }
    }
    // Adam moves each weight by about the learning rate; the two steps are the same bit for bit
    // (here: the f32 advantages happen to round to the job's per-token factors).
    assert!(max_change > 1e-4, "the step changed nothing: {max_change}");
    assert_eq!(max_diff, 0.0, "the steps differ (change {max_change})");
}

/// A tensor whose gradient is empty is frozen: an AdamW step (weight decay on) leaves it and
/// its moments as they are, and the gradient's norm leaves it out (Tinker's `train_mlp=False`
/// empties the MLP pairs' gradients; `train_unembed` adds an LM-head pair that trains).
#[test]
fn an_empty_gradient_freezes_its_tensor() {
    let t = common::tiny(6);
    let config = LoraConfig {
        unembed: true,
        ..LoraConfig::default()
    };
    let start = LoraAdapter::new(t.model.config(), config, 4);
    let data = [StepDatum {
        tokens: vec![3, 40, 41, 42, 43],
        last_target: 44,
        weights: vec![1.0; 5],
        old_logprobs: Vec::new(),
        advantages: Vec::new(),
    }];
    let grads = forward_backward(&t.model, &start, &data, StepLoss::CrossEntropy, true, 2048)
        .unwrap()
        .grads
        .unwrap();
    let params = AdamParams {
        weight_decay: 0.1,
        ..AdamParams::job(1e-2)
    };
    let mut all = start.clone();
    let full_norm = adam_step(&mut AdamW::new(&all), &mut all, &grads, &params, 1).unwrap();
    let frozen = |i: usize| start.param_target(i).is_some_and(|t| !t.is_attention());
    let mut attention_only = grads.clone();
    for (i, g) in attention_only.iter_mut().enumerate() {
        if frozen(i) {
            *g = Vec::new();
        }
    }
    let mut stepped = start.clone();
    let mut optimizer = AdamW::new(&stepped);
    let norm = adam_step(&mut optimizer, &mut stepped, &attention_only, &params, 1).unwrap();
    assert!(0.0 < norm && norm < full_norm, "{norm} of {full_norm}");
    let head = start.params().len() - 1;
    assert!(start.param_target(head).is_none());
    for (i, (after, before)) in stepped.params().iter().zip(start.params()).enumerate() {
        if frozen(i) {
            assert_eq!(after, &before, "param {i} is frozen");
        } else if i % 2 == 1 {
            // B starts at 0: a trained one moves.
            assert_ne!(after, &before, "param {i} trains");
        }
    }
    // A second step: the frozen tensors' moments stayed zero, so they stay put again.
    let mut again = stepped.clone();
    adam_step(&mut optimizer, &mut again, &attention_only, &params, 2).unwrap();
    for (i, (after, before)) in again.params().iter().zip(start.params()).enumerate() {
        if frozen(i) {
            assert_eq!(after, &before, "param {i} is frozen");
        }
    }
}
