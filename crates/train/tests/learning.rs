//! The trainer learns in the rewarded direction on the tiny model: after a job that rewards one
//! answer over another, the rewarded answer's logprob rises and the other's falls.

use std::sync::atomic::AtomicBool;

use serde_json::json;
use temper_model::{LoraAdapter, PackedSequence};
use temper_text::ChatTemplate;
use temper_train::{run_job, tokenize_job, TrainEvent, TrainerConfig, TrainingRequest};

#[test]
fn rewarded_tokens_gain_probability() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny.gguf");
    temper_model::tiny::write_tiny_gguf(&path, 7).unwrap();
    let loaded = temper_model::load_gguf(&path).unwrap();
    let tok = temper_text::load_tokenizer(&loaded.metadata, &path).unwrap();
    let template = ChatTemplate::new(
        ChatTemplate::GEMMA3,
        tok.bos_token().map(str::to_owned),
        tok.eos_token().map(str::to_owned),
    )
    .unwrap();
    let model = loaded.model;
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
        let job = tokenize_job(&req, &tok, &template).unwrap();
        let mut steps = Vec::new();
        let out = run_job(
            &model,
            &adapter,
            &job,
            &cfg,
            &AtomicBool::new(false),
            &mut |e| {
                if let TrainEvent::GradientStep(m) = e {
                    steps.push(m)
                }
            },
        )
        .unwrap();
        assert!(out.is_some());
        assert!(
            steps[0].loss.is_finite() && steps[0].grad_norm > 0.0,
            "{steps:?}"
        );
    }

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
