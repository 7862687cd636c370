//! The trainer learns in the rewarded direction on the tiny model (through the real loader):
//! after a job that rewards one answer over another, the rewarded answer's logprob rises and the
//! other's falls; packing, metrics, options, equal rewards, missing sampler logprobs, cancel.

use std::sync::atomic::AtomicBool;

use serde_json::{json, Value};
use temper_model::{Decoder, LoraAdapter, LoraConfig, PackedSequence};
use temper_text::ChatMessage;
use temper_train::{
    run_job, tokenize_job, StepMetrics, TokenizedJob, TrainEvent, TrainerConfig, TrainingRequest,
};

mod common;

use common::{tiny, Tiny};

/// The served prompt's tokens for one user message.
fn prompt(t: &Tiny, question: &str) -> Vec<u32> {
    common::served_prompt(t, &[ChatMessage::text("user", question)])
}

/// log p(answer | prompt) under `adapter`.
fn answer_logprob(t: &Tiny, prompt: &[u32], answer: u32, adapter: &LoraAdapter) -> f32 {
    let mut tokens = prompt.to_vec();
    tokens.push(answer);
    let mut scored = vec![false; prompt.len()];
    scored.push(true);
    let seq = PackedSequence {
        tokens: &tokens,
        segment_lens: &[tokens.len()],
        scored: &scored,
    };
    t.model.score(&seq, Some(adapter)).expect("score").logprobs[0]
}

/// Runs `job` from `start` with the default trainer settings: the new adapter and the steps.
fn train(
    model: &Decoder,
    start: &LoraAdapter,
    job: &TokenizedJob,
) -> (LoraAdapter, Vec<StepMetrics>) {
    let mut steps = Vec::new();
    let trained = run_job(
        model,
        start,
        job,
        &TrainerConfig::default(),
        &AtomicBool::new(false),
        &mut |e| {
            if let TrainEvent::GradientStep(m) = e {
                steps.push(m)
            }
        },
    )
    .expect("run_job")
    .expect("something to learn");
    (trained, steps)
}

fn trajectory(question: &str, answer: u32, logprob: f32, reward: f64) -> Value {
    json!({
        "messages_and_choices": [
            {"role": "user", "content": question},
            {"message": {"role": "assistant", "content": "x"}, "finish_reason": "length", "index": 0,
             "logprobs": {"content": [{"token": format!("token_id:{answer}"), "logprob": logprob}]}}
        ],
        "reward": reward
    })
}

#[test]
fn each_packed_sequence_is_one_step_and_learns() {
    let t = tiny(11);
    let question = "pick one";
    let p = prompt(&t, question);
    let (good, bad) = (
        t.tokenizer.encode("a", false)[0],
        t.tokenizer.encode("b", false)[0],
    );
    assert_ne!(good, bad);
    let start = LoraAdapter::new(t.model.config(), LoraConfig::default(), 3);
    let before = (
        answer_logprob(&t, &p, good, &start),
        answer_logprob(&t, &p, bad, &start),
    );
    // Two groups of four rollouts each (on-policy logprobs), the good answer rewarded.
    let group = |seed: usize| {
        let trajectories: Vec<Value> = (0..4)
            .map(|i| {
                let (answer, lp, reward) = if (i + seed).is_multiple_of(2) {
                    (good, before.0, 1.0)
                } else {
                    (bad, before.1, 0.0)
                };
                trajectory(question, answer, lp, reward)
            })
            .collect();
        json!({"trajectories": trajectories})
    };
    let req: TrainingRequest = serde_json::from_value(json!({
        "trajectory_groups": [group(0), group(1)],
        "experimental_config": {"learning_rate": 1e-2}
    }))
    .expect("request");
    let job = tokenize_job(&req, &t.tokenizer, &t.template).expect("tokenize");
    // One trajectory per packed sequence (they are all one length): several optimizer steps.
    let cfg = TrainerConfig {
        lora: LoraConfig::default(),
        max_seq_len: job.sequences[0].tokens.len(),
    };
    let mut events = Vec::new();
    let trained = run_job(
        &t.model,
        &start,
        &job,
        &cfg,
        &AtomicBool::new(false),
        &mut |e| events.push(e),
    )
    .expect("run_job")
    .expect("something to learn");
    assert_eq!(
        events.first(),
        Some(&TrainEvent::Started { num_sequences: 8 })
    );
    assert_eq!(
        events.last(),
        Some(&TrainEvent::Ended {
            step: 8,
            message: None
        })
    );
    for e in &events[1..events.len() - 1] {
        let TrainEvent::GradientStep(m) = e else {
            panic!("expected a gradient step, got {e:?}");
        };
        assert!(
            m.loss.is_finite() && m.grad_norm > 0.0 && m.entropy > 0.0,
            "{m:?}"
        );
        assert_eq!((m.num_trajectories, m.num_trainable_tokens), (8, 1));
        assert_eq!((m.num_groups_submitted, m.num_groups_trainable), (2, 2));
        assert!((m.reward - 0.5).abs() < 1e-12 && (m.reward_std_dev - 0.5).abs() < 1e-12);
    }
    let after = (
        answer_logprob(&t, &p, good, &trained),
        answer_logprob(&t, &p, bad, &trained),
    );
    eprintln!(
        "logprob good {} -> {}, bad {} -> {}",
        before.0, after.0, before.1, after.1
    );
    assert!(after.0 > before.0 + 0.05, "good: {before:?} -> {after:?}");
    assert!(after.1 < before.1 - 0.05, "bad: {before:?} -> {after:?}");
}

#[test]
fn equal_rewards_learn_nothing_and_say_why() {
    let t = tiny(11);
    let p = prompt(&t, "q");
    let good = t.tokenizer.encode("a", false)[0];
    let start = LoraAdapter::new(t.model.config(), LoraConfig::default(), 3);
    let lp = answer_logprob(&t, &p, good, &start);
    let req: TrainingRequest = serde_json::from_value(json!({"trajectory_groups": [
        {"trajectories": [trajectory("q", good, lp, 1.0), trajectory("q", good, lp, 1.0)]}]}))
    .expect("request");
    let job = tokenize_job(&req, &t.tokenizer, &t.template).expect("tokenize");
    let mut events = Vec::new();
    let out = run_job(
        &t.model,
        &start,
        &job,
        &TrainerConfig::default(),
        &AtomicBool::new(false),
        &mut |e| events.push(e),
    )
    .expect("run_job");
    assert!(out.is_none());
    let [TrainEvent::Ended {
        step: 0,
        message: Some(why),
    }] = events.as_slice()
    else {
        panic!("expected one Ended event, got {events:?}");
    };
    assert!(why.contains("equal rewards"), "{why}");
}

/// A sequence longer than the trainer's max_seq_len (a job accepted before a restart with a
/// smaller limit) fails the job naming it instead of training on a cut trajectory.
#[test]
fn a_sequence_over_max_seq_len_fails_the_job() {
    let t = tiny(11);
    let (good, bad) = (
        t.tokenizer.encode("a", false)[0],
        t.tokenizer.encode("b", false)[0],
    );
    let start = LoraAdapter::new(t.model.config(), LoraConfig::default(), 3);
    let mut long = trajectory("q", bad, -1.0, 0.0);
    long["messages_and_choices"][1]["logprobs"]["content"] = json!(vec![
        json!({"token": format!("token_id:{bad}"), "logprob": -1.0});
        8
    ]);
    let req: TrainingRequest = serde_json::from_value(json!({"trajectory_groups": [
        {"trajectories": [trajectory("q", good, -1.0, 1.0), long]}]}))
    .expect("request");
    let job = tokenize_job(&req, &t.tokenizer, &t.template).expect("tokenize");
    let lens: Vec<usize> = job.sequences.iter().map(|s| s.tokens.len()).collect();
    // The short trajectory fits exactly; the long one is 7 tokens over.
    let cfg = TrainerConfig {
        max_seq_len: lens[0],
        ..TrainerConfig::default()
    };
    assert_eq!(lens[1], lens[0] + 7, "{lens:?}");
    assert!(job.check_lengths(lens[1]).is_ok());
    let mut events = Vec::new();
    let err = run_job(
        &t.model,
        &start,
        &job,
        &cfg,
        &AtomicBool::new(false),
        &mut |e| events.push(e),
    )
    .expect_err("trained a cut trajectory");
    let temper_train::TrainError::Invalid { param, message } = err else {
        panic!("{err:?}");
    };
    assert_eq!(
        param,
        "trajectory_groups[0].trajectories[1].messages_and_choices"
    );
    assert!(message.contains(&lens[1].to_string()), "{message}");
    assert!(events.is_empty(), "{events:?}");
}

/// Without the sampler's logprobs, lp_old is the trainer's own (rho = 1): the job still learns,
/// and `probs_corr` has nothing to correlate.
#[test]
fn missing_sampler_logprobs_train_on_policy() {
    let t = tiny(11);
    let p = prompt(&t, "q");
    let (good, bad) = (
        t.tokenizer.encode("a", false)[0],
        t.tokenizer.encode("b", false)[0],
    );
    let start = LoraAdapter::new(t.model.config(), LoraConfig::default(), 3);
    let mut group = vec![
        trajectory("q", good, 0.0, 1.0),
        trajectory("q", bad, 0.0, 0.0),
    ];
    for traj in &mut group {
        traj["messages_and_choices"][1]["logprobs"]["content"][0]["logprob"] = Value::Null;
    }
    let req: TrainingRequest = serde_json::from_value(json!({
        "trajectory_groups": [{"trajectories": group}],
        "experimental_config": {"learning_rate": 1e-2}}))
    .expect("request");
    let job = tokenize_job(&req, &t.tokenizer, &t.template).expect("tokenize");
    for s in &job.sequences {
        let sampled: Vec<f32> = (0..s.tokens.len())
            .filter(|&i| s.mask[i])
            .map(|i| s.old_logprobs[i])
            .collect();
        assert!(sampled.len() == 1 && sampled[0].is_nan(), "{sampled:?}");
    }
    let (trained, steps) = train(&t.model, &start, &job);
    assert_eq!(steps.len(), 1);
    assert!(
        steps[0].loss.is_finite() && steps[0].probs_corr.is_none(),
        "{:?}",
        steps[0]
    );
    assert!(answer_logprob(&t, &p, good, &trained) > answer_logprob(&t, &p, good, &start));
}

#[test]
fn rewarded_tokens_gain_probability() {
    let Tiny {
        model,
        tokenizer: tok,
        template,
    } = tiny(7);
    let good = tok.encode("yes", false);
    let bad = tok.encode("no", false);
    let choice = |ids: &[u32]| {
        let content: Vec<_> = ids
            .iter()
            .map(|id| json!({"token": format!("token_id:{id}"), "logprob": -2.0}))
            .collect();
        json!({"message": {"role": "assistant", "content": ""}, "finish_reason": "stop",
            "index": 0, "logprobs": {"content": content}})
    };
    let trajectory = |ids: &[u32], reward: f64| {
        json!({"messages_and_choices": [{"role": "user", "content": "question"}, choice(ids)],
            "reward": reward})
    };
    let req: TrainingRequest = serde_json::from_value(json!({
        "trajectory_groups": [{"trajectories": [trajectory(&good, 1.0), trajectory(&bad, 0.0)]}],
        "experimental_config": {"learning_rate": 0.02}
    }))
    .unwrap();
    let job = tokenize_job(&req, &tok, &template).unwrap();
    let score = |adapter: &LoraAdapter, seq: usize| -> f32 {
        let s = &job.sequences[seq];
        let scores = model
            .score(
                &PackedSequence {
                    tokens: &s.tokens,
                    segment_lens: &[s.tokens.len()],
                    scored: &s.mask,
                },
                Some(adapter),
            )
            .unwrap();
        scores.logprobs.iter().sum()
    };
    let cfg = TrainerConfig::default();
    let mut adapter = LoraAdapter::new(model.config(), cfg.lora, 1);
    let (good0, bad0) = (score(&adapter, 0), score(&adapter, 1));
    let mut events = Vec::new();
    for _ in 0..3 {
        adapter = run_job(
            &model,
            &adapter,
            &job,
            &cfg,
            &AtomicBool::new(false),
            &mut |e| events.push(e),
        )
        .unwrap()
        .expect("a job with different rewards learns");
    }
    let (good1, bad1) = (score(&adapter, 0), score(&adapter, 1));
    assert!(good1 > good0, "rewarded answer: {good0} -> {good1}");
    assert!(bad1 < bad0, "unrewarded answer: {bad0} -> {bad1}");
    assert!(matches!(
        events[0],
        TrainEvent::Started { num_sequences: 1 }
    ));
    let TrainEvent::GradientStep(m) = &events[1] else {
        panic!("{:?}", events[1]);
    };
    assert_eq!(m.num_trajectories, 2);
    assert_eq!(m.num_trainable_tokens, good.len() + bad.len());
    assert_eq!((m.num_groups_submitted, m.num_groups_trainable), (1, 1));
    assert!(m.grad_norm > 0.0 && m.loss.is_finite() && m.entropy > 0.0);
    assert!(matches!(
        events[2],
        TrainEvent::Ended {
            step: 1,
            message: None
        }
    ));

    // precalculate_logprobs: old logprobs recomputed with the current weights (ratio 1), the
    // sampler's kept for probs_corr; ppo runs the clipped objective.
    for config in [json!({"precalculate_logprobs": true}), json!({"ppo": true})] {
        let mut req = req.clone();
        req.experimental_config = Some(serde_json::from_value(config).unwrap());
        let (_, steps) = train(
            &model,
            &adapter,
            &tokenize_job(&req, &tok, &template).unwrap(),
        );
        assert!(
            steps[0].loss.is_finite() && steps[0].grad_norm > 0.0,
            "{steps:?}"
        );
    }

    // precalculate_logprobs takes the current weights' logprobs as the old ones: the same step,
    // bit for bit, as a request whose sampler logprobs are exactly those.
    let current = |seq: usize| -> Vec<f32> {
        let s = &job.sequences[seq];
        let packed = PackedSequence {
            tokens: &s.tokens,
            segment_lens: &[s.tokens.len()],
            scored: &s.mask,
        };
        model.score(&packed, Some(&adapter)).unwrap().logprobs
    };
    let choice_with = |ids: &[u32], logprobs: &[f32]| {
        let content: Vec<_> = ids
            .iter()
            .zip(logprobs)
            .map(|(id, lp)| json!({"token": format!("token_id:{id}"), "logprob": lp}))
            .collect();
        json!({"message": {"role": "assistant", "content": ""}, "finish_reason": "stop",
            "index": 0, "logprobs": {"content": content}})
    };
    let with_sampler = |ids: &[u32], seq: usize, reward: f64| {
        json!({"messages_and_choices": [{"role": "user", "content": "question"},
            choice_with(ids, &current(seq))], "reward": reward})
    };
    let given: TrainingRequest = serde_json::from_value(json!({
        "trajectory_groups": [{"trajectories": [with_sampler(&good, 0, 1.0),
            with_sampler(&bad, 1, 0.0)]}],
        "experimental_config": {"learning_rate": 0.02}
    }))
    .unwrap();
    let mut precalculated = req.clone();
    precalculated.experimental_config = Some(
        serde_json::from_value(json!({"learning_rate": 0.02, "precalculate_logprobs": true}))
            .unwrap(),
    );
    let trained = [given, precalculated].map(|req| {
        let (out, steps) = train(
            &model,
            &adapter,
            &tokenize_job(&req, &tok, &template).unwrap(),
        );
        let losses: Vec<u64> = steps.iter().map(|m| m.loss.to_bits()).collect();
        let bits: Vec<u32> = out
            .params()
            .iter()
            .flat_map(|p| p.iter().map(|x| x.to_bits()))
            .collect();
        (losses, bits)
    });
    assert_eq!(trained[0].0, trained[1].0, "the step's loss");
    assert!(trained[0].1 == trained[1].1, "the trained adapter");

    // Cancelled before its first step: no adapter.
    let cancelled = run_job(
        &model,
        &adapter,
        &job,
        &cfg,
        &AtomicBool::new(true),
        &mut |_| {},
    );
    assert!(matches!(
        cancelled,
        Err(temper_train::TrainError::Cancelled)
    ));
}

/// Every importance sampling level through `run_job`: one packed sequence holding two
/// trajectories' answers and one's additional history, each its own sequence for the
/// sequence-level mean; the step's loss is `sequence_loss` on each sequence scored alone,
/// weighted and normalised as training.md says.
#[test]
fn importance_sampling_levels_take_each_sequences_mean() {
    let t = tiny(11);
    let answer = |text: &str, old: &[f32]| {
        let ids = t.tokenizer.encode(text, false);
        let content: Vec<Value> = ids
            .iter()
            .zip(old.iter().cycle())
            .map(|(id, lp)| json!({"token": format!("token_id:{id}"), "logprob": lp}))
            .collect();
        json!({"message": {"role": "assistant", "content": text}, "finish_reason": "stop",
            "index": 0, "logprobs": {"content": content}})
    };
    let conversation =
        |question: &str, choice: Value| json!([{"role": "user", "content": question}, choice]);
    let rewarded = json!({
        "messages_and_choices": conversation("q", answer("yes the cat", &[-1.5, -3.0, -2.2])),
        "additional_histories": [
            {"messages_and_choices": conversation("r", answer("the dog", &[-4.0, -0.5]))}
        ],
        "reward": 1.0
    });
    let other = json!({
        "messages_and_choices": conversation("q", answer("no", &[-2.5])),
        "reward": 0.0
    });
    let start = LoraAdapter::new(t.model.config(), LoraConfig::default(), 3);
    let mut losses = Vec::new();
    for level in ["token", "sequence", "average", "geometric_average"] {
        let req: TrainingRequest = serde_json::from_value(json!({
            "trajectory_groups": [{"trajectories": [rewarded, other]}],
            "experimental_config": {"ppo": true, "importance_sampling_level": level}
        }))
        .expect("request");
        let job = tokenize_job(&req, &t.tokenizer, &t.template).expect("tokenize");
        assert_eq!(job.sequences.len(), 3);
        let (_, steps) = train(&t.model, &start, &job);
        assert_eq!(steps.len(), 1, "one packed sequence");
        // Rewards 1 and 0: A = +1 and -1 once normalised; each trajectory's tokens weigh
        // (total / 2) / (its tokens).
        let trainable: Vec<usize> = job.sequences.iter().map(|s| s.trainable_tokens()).collect();
        let total: usize = trainable.iter().sum();
        let per_trajectory = [trainable[0] + trainable[1], trainable[2]];
        let mut want = 0.0;
        for (s, seq) in job.sequences.iter().enumerate() {
            let scores = t
                .model
                .score(
                    &PackedSequence {
                        tokens: &seq.tokens,
                        segment_lens: &[seq.tokens.len()],
                        scored: &seq.mask,
                    },
                    Some(&start),
                )
                .expect("score");
            let lp_new: Vec<f64> = scores.logprobs.iter().map(|&x| f64::from(x)).collect();
            let lp_old: Vec<f64> = (0..seq.tokens.len())
                .filter(|&i| seq.mask[i])
                .map(|i| f64::from(seq.old_logprobs[i]))
                .collect();
            let a = if seq.trajectory == 0 { 1.0 } else { -1.0 };
            let weight = total as f64 / 2.0 / per_trajectory[seq.trajectory] as f64;
            let sum: f64 = temper_train::sequence_loss(&lp_new, &lp_old, a, &job.loss)
                .iter()
                .map(|(l, _)| l)
                .sum();
            want += sum * weight / (total as f64 + 1e-6);
            assert_eq!(seq.trajectory, usize::from(s == 2));
        }
        let got = steps[0].loss;
        assert!(
            (got - want).abs() < 1e-4 * (1.0 + want.abs()),
            "{level}: loss {got} vs {want}"
        );
        losses.push(got);
    }
    eprintln!("losses by level: {losses:?}");
    for (i, a) in losses.iter().enumerate() {
        for b in &losses[i + 1..] {
            assert!((a - b).abs() > 1e-4, "{losses:?}");
        }
    }
}
