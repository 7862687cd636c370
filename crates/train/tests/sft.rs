//! SFT on the tiny model (through the real loader) and the shipped Gemma 3 template: which
//! tokens are trained, the schedule, validation, and that the trained answer's likelihood rises.

use std::sync::atomic::AtomicBool;

use serde_json::{json, Value};
use temper_model::{LoraAdapter, LoraConfig, PackedSequence};
use temper_text::ChatMessage;
use temper_train::{
    run_sft_job, tokenize_sft_job, SftRequest, TrainError, TrainEvent, TrainerConfig,
};

mod common;

use common::{tiny, Tiny};

fn request(body: Value) -> SftRequest {
    serde_json::from_value(body).unwrap()
}

fn user(text: &str) -> Value {
    json!({"role": "user", "content": text})
}

fn assistant(text: &str) -> Value {
    json!({"role": "assistant", "content": text})
}

#[test]
fn assistant_turns_are_trained_as_the_template_renders_them() {
    let t = tiny(11);
    let tok = &t.tokenizer;
    // ART's SFT line shape (`messages`) and a Trajectory object (`messages_and_choices`, with a
    // Choice) tokenize alike; the user message after the last answer is dropped.
    let line = json!({"messages": [
        {"role": "system", "content": "be brief"}, user("the cat"), assistant("  Hello world "),
        user("more"), assistant("Bye"), user("ignored")
    ]});
    let object = json!({"messages_and_choices": [
        {"role": "system", "content": "be brief"}, user("the cat"), assistant("  Hello world "),
        user("more"),
        {"message": {"role": "assistant", "content": "Bye"}, "finish_reason": "stop", "index": 0},
        user("ignored")
    ], "reward": 0.5, "metrics": {"x": 1}});
    let job = tokenize_sft_job(
        &request(json!({"trajectories": [line, object]})),
        tok,
        &t.template,
    )
    .unwrap();
    assert_eq!(job.sequences.len(), 2);
    assert_eq!(job.sequences[0].tokens, job.sequences[1].tokens);
    assert_eq!(job.sequences[0].mask, job.sequences[1].mask);
    let seq = &job.sequences[0];
    assert_eq!(seq.source, "trajectories[0].messages");

    // The context before the first answer is the served prompt, generation prompt included.
    let served = common::served_prompt(
        &t,
        &[
            ChatMessage::text("system", "be brief"),
            ChatMessage::text("user", "the cat"),
        ],
    );
    assert_eq!(&seq.tokens[..served.len()], &served[..]);
    assert!(seq.mask[..served.len()].iter().all(|m| !m));
    // Trained: each answer as rendered (the template trims it) with its end of turn.
    let trained: Vec<u32> = seq.trained_ids().collect();
    let mut want = tok.encode("Hello world<end_of_turn>\n", true);
    want.extend(tok.encode("Bye<end_of_turn>\n", true));
    assert_eq!(trained, want);
    let eot = tok.token_id("<end_of_turn>").unwrap();
    assert_eq!(trained.iter().filter(|&&t| t == eot).count(), 2);
    // Defaults: batches of 2, one epoch, learning rate 5e-5.
    assert_eq!(job.schedule.batch_size, 2);
    assert_eq!(job.schedule.learning_rates, vec![5e-5]);
}

#[test]
fn invalid_sft_requests_name_the_field() {
    let t = tiny(11);
    let good = json!({"messages": [user("q"), assistant("a")]});
    let param = |body: Value| match tokenize_sft_job(&request(body), &t.tokenizer, &t.template) {
        Err(TrainError::Invalid { param, .. }) => param,
        other => panic!("expected an invalid request, got {other:?}"),
    };
    assert_eq!(param(json!({"trajectories": []})), "trajectories");
    assert_eq!(
        param(json!({"trajectories": [good, {"messages": [user("q")]}]})),
        "trajectories[1].messages"
    );
    assert_eq!(
        param(json!({"trajectories": [{"messages": [assistant("a"), user("q")]}]})),
        "trajectories[0].messages[0]"
    );
    assert_eq!(
        param(json!({"trajectories": [{"messages": [user("q"), user("q"), assistant("a")]}]})),
        "trajectories[0].messages"
    );
    let with = |config: Value| json!({"trajectories": [good, good, good], "config": config});
    assert_eq!(param(with(json!({"batch_size": 0}))), "config.batch_size");
    assert_eq!(param(with(json!({"epochs": 0}))), "config.epochs");
    assert_eq!(
        param(with(json!({"learning_rate": 0}))),
        "config.learning_rate"
    );
    // 3 trajectories in batches of 2 over 2 epochs: 4 steps, so 4 rates.
    assert_eq!(
        param(with(json!({"learning_rate": [1e-4, 1e-4], "epochs": 2}))),
        "config.learning_rate"
    );
    assert_eq!(
        param(with(
            json!({"learning_rate": [1e-4, -1.0, 1e-4, 1e-4], "epochs": 2})
        )),
        "config.learning_rate[1]"
    );
    let job = tokenize_sft_job(
        &request(with(
            json!({"learning_rate": [4e-4, 3e-4, 2e-4, 1e-4], "epochs": 2, "batch_size": null}),
        )),
        &t.tokenizer,
        &t.template,
    )
    .unwrap();
    assert_eq!(job.schedule.learning_rates, vec![4e-4, 3e-4, 2e-4, 1e-4]);
    assert!(serde_json::from_value::<SftRequest>(with(json!({"warmup": 1}))).is_err());
}

/// Mean log p(answer turn | prompt) under `adapter`.
fn answer_logprob(t: &Tiny, tokens: &[u32], mask: &[bool], adapter: &LoraAdapter) -> f32 {
    let seq = PackedSequence {
        tokens,
        segment_lens: &[tokens.len()],
        scored: mask,
    };
    let lps = t.model.score(&seq, Some(adapter)).unwrap().logprobs;
    lps.iter().sum::<f32>() / lps.len() as f32
}

#[test]
fn sft_raises_the_likelihood_of_the_answers() {
    let t = tiny(11);
    let conversation = |q: &str, a: &str| json!({"messages": [user(q), assistant(a)]});
    let req = request(json!({
        "trajectories": [conversation("pick one", "a"), conversation("pick two", "b b"),
                         conversation("pick three", "c")],
        "config": {"learning_rate": 1e-2, "epochs": 2}
    }));
    let job = tokenize_sft_job(&req, &t.tokenizer, &t.template).unwrap();
    let start = LoraAdapter::new(t.model.config(), LoraConfig::default(), 3);
    let before: Vec<f32> = job
        .sequences
        .iter()
        .map(|s| answer_logprob(&t, &s.tokens, &s.mask, &start))
        .collect();
    // Room for one sequence per pack: a batch of two is two packs whose gradients add up.
    let cfg = TrainerConfig {
        lora: LoraConfig::default(),
        max_seq_len: job.sequences.iter().map(|s| s.tokens.len()).max().unwrap(),
    };
    let mut events = Vec::new();
    let trained = run_sft_job(
        &t.model,
        &start,
        &job,
        &cfg,
        &AtomicBool::new(false),
        &mut |e| events.push(e),
    )
    .unwrap();
    // 3 trajectories in batches of 2, twice: 4 steps.
    assert_eq!(events[0], TrainEvent::Started { num_sequences: 4 });
    let steps: Vec<_> = events[1..5]
        .iter()
        .map(|e| match e {
            TrainEvent::SftStep(m) => m.clone(),
            e => panic!("expected an SFT step, got {e:?}"),
        })
        .collect();
    assert_eq!(
        steps
            .iter()
            .map(|m| (m.step, m.num_trajectories, m.epoch))
            .collect::<Vec<_>>(),
        vec![(1, 2, 1), (2, 1, 1), (3, 2, 2), (4, 1, 2)]
    );
    for (m, batch) in steps.iter().zip([0..2, 2..3, 0..2, 2..3]) {
        let tokens: usize = job.sequences[batch]
            .iter()
            .map(|s| s.trainable_tokens())
            .sum();
        assert_eq!(m.num_trainable_tokens, tokens);
        assert!(
            m.loss > 0.0 && m.grad_norm > 0.0 && m.learning_rate == 1e-2,
            "{m:?}"
        );
    }
    // The second epoch's loss on the first batch is lower than the first's.
    assert!(steps[2].loss < steps[0].loss, "{steps:?}");
    assert_eq!(
        events.last(),
        Some(&TrainEvent::Ended {
            step: 4,
            message: None
        })
    );
    for (s, before) in job.sequences.iter().zip(before) {
        let after = answer_logprob(&t, &s.tokens, &s.mask, &trained);
        eprintln!("{}: mean logprob {before} -> {after}", s.source);
        assert!(after > before + 0.05, "{}: {before} -> {after}", s.source);
    }
}

#[test]
fn a_cancelled_sft_job_stops() {
    let t = tiny(11);
    let req = request(json!({"trajectories": [{"messages": [user("q"), assistant("a")]}]}));
    let job = tokenize_sft_job(&req, &t.tokenizer, &t.template).unwrap();
    let start = LoraAdapter::new(t.model.config(), LoraConfig::default(), 3);
    let result = run_sft_job(
        &t.model,
        &start,
        &job,
        &TrainerConfig::default(),
        &AtomicBool::new(true),
        &mut |_| {},
    );
    assert!(matches!(result, Err(TrainError::Cancelled)), "{result:?}");
}
