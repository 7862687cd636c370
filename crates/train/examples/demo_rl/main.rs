//! RL learning demo on the default model (`make demo-rl`): rollouts sampled by the serving
//! engine with the current adapter, a reward of 1 for answers that begin with a chosen word,
//! one training job per round through `tokenize_job` + `run_job`, and the word's probability as
//! the first answer token (scored exactly) after every job. Prints a table and writes a PNG plot.
//!
//! Usage: demo_rl [--word You] [--jobs 6] [--group 16] [--lr 2e-4] [--seed 1] [--png docs/rl-demo.png]

mod png;

use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Instant;

use serde_json::{json, Value};
use temper_engine::{
    Engine, EngineConfig, GenerationEvent, GenerationRequest, SamplingParams, StopParams,
};
use temper_model::{Gemma3, LoraAdapter, PackedSequence};
use temper_text::{ChatMessage, ChatTemplate, TemplateInput, Tokenizer};
use temper_train::{run_job, tokenize_job, TrainEvent, TrainerConfig, TrainingRequest};

const QUESTION: &str = "Name one fruit. Answer with a single word.";

struct Args {
    word: String,
    jobs: usize,
    group: usize,
    lr: f64,
    seed: u64,
    png: PathBuf,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        word: "You".to_owned(),
        jobs: 6,
        group: 16,
        lr: 2e-4,
        seed: 1,
        png: PathBuf::from("docs/rl-demo.png"),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().ok_or(format!("{flag} needs a value"))?;
        let bad = |e: &dyn std::fmt::Display| format!("{flag} {value}: {e}");
        match flag.as_str() {
            "--word" => args.word = value,
            "--jobs" => args.jobs = value.parse().map_err(|e| bad(&e))?,
            "--group" => args.group = value.parse().map_err(|e| bad(&e))?,
            "--lr" => args.lr = value.parse().map_err(|e| bad(&e))?,
            "--seed" => args.seed = value.parse().map_err(|e| bad(&e))?,
            "--png" => args.png = PathBuf::from(value),
            _ => return Err(format!("unknown flag {flag}")),
        }
    }
    Ok(args)
}

/// One sampled answer: its tokens and the sampler's logprobs, and its text.
struct Rollout {
    ids: Vec<u32>,
    logprobs: Vec<f32>,
    text: String,
}

fn rollouts(
    engine: &Engine,
    prompt: &[u32],
    n: usize,
    seed: u64,
    adapter: &Arc<LoraAdapter>,
) -> Result<Vec<Rollout>, String> {
    let mut rx = engine
        .submit(GenerationRequest {
            request_id: format!("demo-rl-{seed}"),
            prompt: prompt.to_vec(),
            n,
            sampling: SamplingParams {
                seed: Some(seed),
                // Gemma's recommended sampling; the trainer's logprobs are the unfiltered ones.
                top_k: 64,
                top_p: 0.95,
                ..SamplingParams::default()
            },
            stopping: StopParams {
                max_tokens: 8,
                ..StopParams::default()
            },
            logprobs: Some(0),
            adapter: Some(adapter.clone()),
            constraint: None,
            priority: 0,
            prompt_logprobs: None,
            beam_search: None,
            cache_salt: None,
        })
        .map_err(|e| e.to_string())?;
    let mut out: Vec<Rollout> = (0..n)
        .map(|_| Rollout {
            ids: Vec::new(),
            logprobs: Vec::new(),
            text: String::new(),
        })
        .collect();
    while let Some(event) = rx.blocking_recv() {
        match event {
            GenerationEvent::Token {
                choice,
                token_id,
                text,
                logprob,
            } => {
                let r = &mut out[choice];
                r.ids.push(token_id);
                r.logprobs
                    .push(logprob.ok_or("the engine sent no logprob")?.logprob);
                r.text.push_str(&text);
            }
            GenerationEvent::Finished { choice, text, .. } => out[choice].text.push_str(&text),
            GenerationEvent::Error { message } => return Err(message),
            GenerationEvent::PromptLogprobs { .. } => return Err("unasked prompt logprobs".into()),
        }
    }
    Ok(out)
}

/// The training request a client would post for one group of rollouts.
fn request(rollouts: &[Rollout], rewards: &[f64], lr: f64) -> Result<TrainingRequest, String> {
    let trajectories: Vec<Value> = rollouts
        .iter()
        .zip(rewards)
        .map(|(r, reward)| {
            let content: Vec<Value> = r
                .ids
                .iter()
                .zip(&r.logprobs)
                .map(|(id, lp)| json!({"token": format!("token_id:{id}"), "logprob": lp}))
                .collect();
            json!({
                "messages_and_choices": [
                    {"role": "user", "content": QUESTION},
                    {"message": {"role": "assistant", "content": r.text}, "finish_reason": "stop",
                     "index": 0, "logprobs": {"content": content}}
                ],
                "reward": reward
            })
        })
        .collect();
    serde_json::from_value(json!({
        "trajectory_groups": [{"trajectories": trajectories}],
        "experimental_config": {"learning_rate": lr}
    }))
    .map_err(|e| e.to_string())
}

/// p(first token of the word | prompt) under the adapter, from the trainer's exact scores.
fn word_probability(model: &Gemma3, prompt: &[u32], word: u32, adapter: &LoraAdapter) -> f64 {
    let mut tokens = prompt.to_vec();
    tokens.push(word);
    let mut scored = vec![false; prompt.len()];
    scored.push(true);
    let seq = PackedSequence {
        tokens: &tokens,
        segment_lens: &[tokens.len()],
        scored: &scored,
    };
    model
        .score(&seq, Some(adapter))
        .map(|s| f64::from(s.logprobs[0]).exp())
        .unwrap_or(f64::NAN)
}

/// The reward: the answer begins with the word (case-insensitive).
fn rewarded(text: &str, word_lowercase: &str) -> bool {
    text.trim_start().to_lowercase().starts_with(word_lowercase)
}

fn main() -> Result<(), String> {
    let args = parse_args()?;
    let path = std::env::var_os("TEMPER_MODEL_PATH")
        .map(PathBuf::from)
        .unwrap_or_else(temper_model::paths::default_model_path);
    let loaded = temper_model::load_gguf(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    let tokenizer: Tokenizer =
        temper_text::load_tokenizer(&loaded.metadata, &path).map_err(|e| e.to_string())?;
    let template = ChatTemplate::new(
        ChatTemplate::GEMMA3,
        tokenizer.bos_token().map(str::to_owned),
        tokenizer.eos_token().map(str::to_owned),
    )
    .map_err(|e| e.to_string())?;
    let model = Arc::new(loaded.model);
    let tokenizer = Arc::new(tokenizer);
    let engine = Engine::start(model.clone(), tokenizer.clone(), EngineConfig::default());
    let prompt_text = template
        .render(&TemplateInput {
            messages: &[ChatMessage::text("user", QUESTION)],
            tools: None,
            documents: None,
            add_generation_prompt: true,
            continue_final_message: false,
            reasoning_effort: None,
            kwargs: &serde_json::Map::new(),
        })
        .map_err(|e| e.to_string())?;
    let prompt = tokenizer.encode(&prompt_text, true);
    let word_token = *tokenizer
        .encode(&args.word, false)
        .first()
        .ok_or("empty --word")?;
    let cfg = TrainerConfig::default();
    let mut adapter = Arc::new(LoraAdapter::new(model.config(), cfg.lora, args.seed));
    let lower = args.word.to_lowercase();

    println!(
        "question: {QUESTION:?}; reward 1 for answers beginning with {:?}",
        args.word
    );
    println!("| job | p(word first) before | rewarded rollouts | loss | grad_norm | train s | trainable tok/s |");
    println!("|---|---|---|---|---|---|---|");
    let mut probabilities = Vec::new();
    let mut rewarded_fraction = Vec::new();
    let (mut train_seconds, mut train_tokens, mut trained_jobs) = (0.0, 0usize, 0usize);
    for job in 0..args.jobs {
        let p = word_probability(&model, &prompt, word_token, &adapter);
        probabilities.push(p);
        let sampled = rollouts(
            &engine,
            &prompt,
            args.group,
            args.seed * 1000 + job as u64,
            &adapter,
        )?;
        let rewards: Vec<f64> = sampled
            .iter()
            .map(|r| f64::from(u8::from(rewarded(&r.text, &lower))))
            .collect();
        if job == 0 {
            let texts: Vec<&str> = sampled.iter().map(|r| r.text.trim()).collect();
            eprintln!("first rollouts: {texts:?}");
        }
        let hits = rewards.iter().sum::<f64>();
        rewarded_fraction.push(hits / args.group as f64);
        let req = request(&sampled, &rewards, args.lr)?;
        let tokenized = tokenize_job(&req, &tokenizer, &template).map_err(|e| e.to_string())?;
        let mut steps = Vec::new();
        let mut note = None;
        let t0 = Instant::now();
        let new = run_job(
            &model,
            &adapter,
            &tokenized,
            &cfg,
            &AtomicBool::new(false),
            &mut |e| match e {
                TrainEvent::GradientStep(m) => steps.push(m),
                TrainEvent::Ended { message, .. } => note = message,
                TrainEvent::Started { .. } | TrainEvent::SftStep(_) => {}
            },
        )
        .map_err(|e| e.to_string())?;
        let secs = t0.elapsed().as_secs_f64();
        let tokens: usize = steps.iter().map(|m| m.num_trainable_tokens).sum();
        if let Some(new) = new {
            adapter = Arc::new(new);
            train_seconds += secs;
            train_tokens += tokens;
            trained_jobs += 1;
        }
        let step = match (steps.last(), note) {
            (Some(m), _) => format!(
                "{:.4} | {:.4} | {secs:.1} | {:.1} |",
                m.loss,
                m.grad_norm,
                tokens as f64 / secs
            ),
            (None, note) => format!("- | - | - | - | {}", note.unwrap_or_default()),
        };
        println!("| {job} | {p:.4} | {hits}/{} | {step}", args.group);
    }
    let p = word_probability(&model, &prompt, word_token, &adapter);
    probabilities.push(p);
    let last = rollouts(
        &engine,
        &prompt,
        args.group,
        args.seed * 1000 + args.jobs as u64,
        &adapter,
    )?;
    let hits = last.iter().filter(|r| rewarded(&r.text, &lower)).count();
    rewarded_fraction.push(hits as f64 / args.group as f64);
    println!("| {} | {p:.4} | {hits}/{} | | | | |", args.jobs, args.group);
    println!(
        "training: {trained_jobs} jobs, {train_tokens} trainable tokens in {train_seconds:.1} s = \
         {:.1} trainable tok/s, {:.1} s per job",
        train_tokens as f64 / train_seconds,
        train_seconds / trained_jobs as f64
    );
    png::plot(
        &args.png,
        &[
            (&probabilities, [31, 119, 180]),
            (&rewarded_fraction, [255, 127, 14]),
        ],
    )
    .map_err(|e| format!("{}: {e}", args.png.display()))?;
    println!(
        "plot: {} (blue: p(word first) per job, orange: rewarded fraction of rollouts)",
        args.png.display()
    );
    Ok(())
}
