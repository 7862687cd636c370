//! The engine over the tiny random Gemma-3-shaped model, through the real loader and tokenizer.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use candle_core::quantized::gguf_file;
use temper_engine::{
    BeamSearch, Engine, EngineConfig, EngineError, EngineStats, FinishReason, GenerationEvent,
    GenerationRequest, GrammarError, JsonOptions, OutputConstraint, PromptLogprob,
    RepetitionDetection, SamplingParams, Scheduling, StopParams, StopReason, TokenLogprob,
};
use temper_model::{Decoder, LoraAdapter, LoraConfig};
use temper_text::{DecodeOptions, Tokenizer};
use tokio::sync::mpsc::UnboundedReceiver;

struct Tiny {
    metadata: HashMap<String, gguf_file::Value>,
    model: Arc<Decoder>,
    tokenizer: Arc<Tokenizer>,
}

fn tiny() -> &'static Tiny {
    static TINY: OnceLock<Tiny> = OnceLock::new();
    TINY.get_or_init(|| {
        let dir: PathBuf = std::env::temp_dir().join(format!(
            "temper-engine-test-{}-{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .expect("clock")
                .as_nanos()
        ));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join("tiny.gguf");
        temper_model::tiny::write_tiny_gguf(&path, 7).expect("write tiny model");
        let loaded = temper_model::load_gguf(&path).expect("load tiny model");
        let tokenizer = Tokenizer::from_gguf_metadata(&loaded.metadata).expect("tokenizer");
        let _ = std::fs::remove_dir_all(&dir);
        Tiny {
            metadata: loaded.metadata,
            model: Arc::new(loaded.model),
            tokenizer: Arc::new(tokenizer),
        }
    })
}

fn engine(config: EngineConfig) -> Engine {
    let t = tiny();
    Engine::start(t.model.clone(), t.tokenizer.clone(), config)
}

fn default_engine() -> Engine {
    engine(EngineConfig {
        max_batch_tokens: 256,
        max_running: 16,
        max_model_len: 2048,
        ..EngineConfig::default()
    })
}

/// `default_engine` without speculative decoding, for tests that count steps or rows: drafts
/// change how many steps a request takes (never its output).
fn engine_without_drafts() -> Engine {
    engine(EngineConfig {
        max_batch_tokens: 256,
        max_running: 16,
        max_model_len: 2048,
        prompt_lookup_tokens: 0,
        ..EngineConfig::default()
    })
}

fn prompt(text: &str) -> Vec<u32> {
    let t = tiny();
    let mut ids = vec![t.tokenizer.bos_id().expect("bos")];
    ids.extend(t.tokenizer.encode(text, false));
    ids
}

fn request(text: &str, max_tokens: usize, sampling: SamplingParams) -> GenerationRequest {
    GenerationRequest {
        request_id: format!("test-{text}"),
        prompt: prompt(text),
        n: 1,
        sampling,
        stopping: StopParams {
            max_tokens: Some(max_tokens),
            ignore_eos: true,
            ..StopParams::default()
        },
        logprobs: None,
        adapter: None,
        constraint: None,
        priority: 0,
        prompt_logprobs: None,
        beam_search: None,
        cache_salt: None,
    }
}

fn greedy() -> SamplingParams {
    SamplingParams {
        temperature: 0.0,
        ..SamplingParams::default()
    }
}

fn seeded(seed: u64) -> SamplingParams {
    SamplingParams {
        temperature: 1.0,
        seed: Some(seed),
        ..SamplingParams::default()
    }
}

#[derive(Debug, Default, Clone)]
struct Choice {
    ids: Vec<u32>,
    /// Token texts concatenated.
    streamed: String,
    /// Streamed text + the Finished text.
    text: String,
    reason: Option<FinishReason>,
    stop_reason: Option<StopReason>,
    completion_tokens: usize,
    prompt_tokens: usize,
    cached_tokens: usize,
    logprobs: Vec<TokenLogprob>,
    token_texts: Vec<String>,
}

/// Reads events until the engine closes the stream; checks the per-choice event protocol.
fn collect(rx: UnboundedReceiver<GenerationEvent>, n: usize) -> Vec<Choice> {
    let (prompt_logprobs, choices) = collect_with_prompt_logprobs(rx, n);
    assert!(
        prompt_logprobs.is_none(),
        "prompt logprobs nobody asked for"
    );
    choices
}

/// `collect`, plus the prompt logprobs, which must come once and before any token.
fn collect_with_prompt_logprobs(
    mut rx: UnboundedReceiver<GenerationEvent>,
    n: usize,
) -> (Option<Vec<PromptLogprob>>, Vec<Choice>) {
    let mut out = vec![Choice::default(); n];
    let mut prompt_logprobs = None;
    while let Some(ev) = rx.blocking_recv() {
        match ev {
            GenerationEvent::PromptLogprobs { entries } => {
                assert!(prompt_logprobs.is_none(), "prompt logprobs sent twice");
                assert!(
                    out.iter().all(|c| c.ids.is_empty()),
                    "prompt logprobs after a token"
                );
                prompt_logprobs = Some(entries);
            }
            GenerationEvent::Token {
                choice,
                token_id,
                text,
                logprob,
            } => {
                let c = &mut out[choice];
                assert!(c.reason.is_none(), "token after Finished");
                c.ids.push(token_id);
                c.streamed.push_str(&text);
                c.token_texts.push(text);
                c.logprobs.extend(logprob);
            }
            GenerationEvent::Finished {
                choice,
                reason,
                stop_reason,
                text,
                prompt_tokens,
                cached_tokens,
                completion_tokens,
            } => {
                let c = &mut out[choice];
                assert!(c.reason.is_none(), "two Finished events");
                c.text = c.streamed.clone() + &text;
                c.reason = Some(reason);
                c.stop_reason = stop_reason;
                c.prompt_tokens = prompt_tokens;
                c.cached_tokens = cached_tokens;
                c.completion_tokens = completion_tokens;
            }
            GenerationEvent::Error { message } => panic!("engine error: {message}"),
        }
    }
    for c in &out {
        assert!(c.reason.is_some(), "stream closed without Finished");
        assert_eq!(c.completion_tokens, c.ids.len());
    }
    (prompt_logprobs, out)
}

/// The scheduler publishes its counts just after the step that sent the last events.
fn wait_idle(e: &Engine) -> EngineStats {
    let t0 = Instant::now();
    loop {
        let s = e.stats();
        if s.running == 0 && s.waiting == 0 {
            return s;
        }
        assert!(t0.elapsed() < Duration::from_secs(5), "not idle: {s:?}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn run(engine: &Engine, req: GenerationRequest) -> Vec<Choice> {
    let n = req.n;
    collect(engine.submit(req).expect("submit"), n)
}

/// Runs `req` while three other requests generate in the same engine.
fn run_in_busy_batch(engine: &Engine, req: GenerationRequest) -> Vec<Choice> {
    let others: Vec<_> = [
        "the dog sat",
        "what is the capital of France",
        "yes no good day",
    ]
    .iter()
    .enumerate()
    .map(|(i, p)| {
        let r = request(p, 40, seeded(100 + i as u64));
        engine.submit(r).expect("submit other")
    })
    .collect();
    let n = req.n;
    let rx = engine.submit(req).expect("submit");
    let mine = collect(rx, n);
    for rx in others {
        collect(rx, 1);
    }
    mine
}

#[test]
fn greedy_alone_equals_greedy_in_a_busy_batch() {
    let e = default_engine();
    let req = request("Hello world the cat sat on the mat", 24, greedy());
    let alone = run(&e, req.clone());
    let busy = run_in_busy_batch(&e, req);
    assert_eq!(alone[0].ids.len(), 24);
    assert_eq!(alone[0].ids, busy[0].ids);
    assert_eq!(alone[0].text, busy[0].text);
    assert!(e.stats().max_rows_in_step >= 2);
}

/// Greedy decoding by calling the model directly: the ids and each one's logprob.
fn greedy_loop(
    prompt: &[u32],
    steps: usize,
    adapter: Option<&LoraAdapter>,
) -> (Vec<u32>, Vec<f32>) {
    let t = tiny();
    let mut cache = t.model.new_cache();
    let mut input = prompt.to_vec();
    let mut ids = Vec::new();
    let mut best = Vec::new();
    for _ in 0..steps {
        let logits = t
            .model
            .forward(&mut [temper_model::SeqInput {
                tokens: &input,
                cache: &mut cache,
                all_logits: false,
                adapter,
            }])
            .expect("forward");
        let row = logits[0].row(0);
        let (id, l) = row
            .iter()
            .enumerate()
            .fold((0, f32::NEG_INFINITY), |acc, (i, &v)| {
                if v > acc.1 {
                    (i as u32, v)
                } else {
                    acc
                }
            });
        let lse = row
            .iter()
            .map(|&v| ((v - l) as f64).exp())
            .sum::<f64>()
            .ln()
            + l as f64;
        ids.push(id);
        best.push((l as f64 - lse) as f32);
        input = vec![id];
    }
    (ids, best)
}

/// An adapter with nonzero B (as after training), so it changes what the model says.
fn changed_adapter(seed: u64) -> LoraAdapter {
    changed_adapter_of(seed, LoraConfig::default())
}

/// [`changed_adapter`] of `config` (with an LM-head pair where it says so).
fn changed_adapter_of(seed: u64, config: LoraConfig) -> LoraAdapter {
    let mut a = LoraAdapter::new(tiny().model.config(), config, seed);
    for (i, p) in a
        .params_mut()
        .into_iter()
        .enumerate()
        .filter(|(i, _)| i % 2 == 1)
    {
        for (j, v) in p.iter_mut().enumerate() {
            *v = 0.08 * (((i * 7919 + j * 104_729) % 1000) as f32 / 500.0 - 1.0);
        }
    }
    a
}

#[test]
fn adapters_apply_per_request_in_a_shared_batch() {
    let e = default_engine();
    let text = "Hello world the cat sat on the mat";
    let (base_ids, _) = greedy_loop(&prompt(text), 20, None);
    // Layers only, and with an LM-head pair (Tinker's `train_unembed`) on the logits too.
    for unembed in [false, true] {
        let config = LoraConfig {
            unembed,
            ..LoraConfig::default()
        };
        let adapter = Arc::new(changed_adapter_of(1, config));
        let (want, _) = greedy_loop(&prompt(text), 20, Some(&adapter));
        assert_ne!(base_ids, want, "the adapter should change greedy output");

        let mut req = request(text, 20, greedy());
        req.adapter = Some(adapter.clone());
        assert_eq!(run(&e, req.clone())[0].ids, want);
        // Next to base-model requests in the same steps.
        assert_eq!(run_in_busy_batch(&e, req.clone())[0].ids, want);
        // n = 2 forks share the adapter.
        req.n = 2;
        let forks = run(&e, req);
        assert_eq!(forks[0].ids, want);
        assert_eq!(forks[1].ids, want);
    }
    // A fresh adapter (B = 0) is the base model.
    let mut req = request(text, 20, greedy());
    req.adapter = Some(Arc::new(LoraAdapter::new(
        tiny().model.config(),
        LoraConfig::default(),
        9,
    )));
    assert_eq!(run(&e, req)[0].ids, base_ids);

    // An adapter for another model shape is refused at submit, not inside a shared step.
    let mut other = tiny().model.config().clone();
    other.num_layers += 1;
    let mut req = request(text, 4, greedy());
    req.adapter = Some(Arc::new(LoraAdapter::new(&other, LoraConfig::default(), 1)));
    assert!(matches!(e.submit(req), Err(EngineError::AdapterMismatch)));
}

/// Issue 4 item 6: the logprobs the engine returns for sampled tokens are the trainer's
/// (`Decoder::score`) for the same tokens and adapter.
#[test]
fn sampled_logprobs_equal_the_trainers_scores() {
    let e = default_engine();
    let adapter = Arc::new(changed_adapter(3));
    let head = LoraConfig {
        unembed: true,
        ..LoraConfig::default()
    };
    let with_head = Arc::new(changed_adapter_of(3, head));
    for a in [None, Some(adapter), Some(with_head)] {
        let mut req = request("the cat sat on the mat and", 24, seeded(5));
        req.logprobs = Some(0);
        req.adapter = a.clone();
        let c = run(&e, req.clone()).remove(0);
        let tokens: Vec<u32> = req.prompt.iter().chain(&c.ids).copied().collect();
        let scored: Vec<bool> = (0..tokens.len()).map(|i| i >= req.prompt.len()).collect();
        let scores = tiny()
            .model
            .score(
                &temper_model::PackedSequence {
                    tokens: &tokens,
                    segment_lens: &[tokens.len()],
                    scored: &scored,
                },
                a.as_deref(),
            )
            .expect("score");
        assert_eq!(scores.logprobs.len(), c.logprobs.len());
        let mean = scores
            .logprobs
            .iter()
            .zip(&c.logprobs)
            .map(|(s, l)| (s - l.logprob).abs() as f64)
            .sum::<f64>()
            / c.logprobs.len() as f64;
        assert!(mean < 1e-5, "mean |engine - trainer| = {mean}");
    }
}

#[test]
fn greedy_equals_a_plain_loop_over_the_model() {
    let e = default_engine();
    let mut req = request("what is the answer to the question", 16, greedy());
    req.logprobs = Some(2);
    let c = run(&e, req.clone());

    let (ids, best) = greedy_loop(&req.prompt, 16, None);
    assert_eq!(c[0].ids, ids);
    for (lp, want) in c[0].logprobs.iter().zip(&best) {
        assert!((lp.logprob - want).abs() < 1e-4, "{} vs {want}", lp.logprob);
    }
}

#[test]
fn seeded_sampling_is_the_same_alone_and_in_a_busy_batch() {
    let e = default_engine();
    let req = request("how is the model of the world", 24, seeded(42));
    let alone = run(&e, req.clone());
    let again = run(&e, req.clone());
    let busy = run_in_busy_batch(&e, req);
    assert_eq!(alone[0].ids, again[0].ids);
    assert_eq!(alone[0].ids, busy[0].ids);
    // A different seed gives a different continuation (the tiny model is far from greedy-sharp).
    let other = run(&e, request("how is the model of the world", 24, seeded(43)));
    assert_ne!(alone[0].ids, other[0].ids);
}

#[test]
fn n_choices_fork_the_prompt_and_follow_the_seed_plus_i_rule() {
    let e = default_engine();
    let mut req = request("the cat and the dog", 16, seeded(1000));
    req.n = 3;
    let a = run(&e, req.clone());
    // The prompt was fed once, then each choice its 15 sampled tokens but the last.
    assert_eq!(e.stats().tokens as usize, req.prompt.len() + 3 * 15);
    let b = run(&e, req.clone());
    assert_eq!(a.len(), 3);
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(x.ids, y.ids);
        assert_eq!(x.reason, Some(FinishReason::Length));
        assert_eq!(x.prompt_tokens, req.prompt.len());
    }
    assert!(a[0].ids != a[1].ids || a[1].ids != a[2].ids);
    // Choice i is what a single-choice request seeded with seed + i gives.
    for (i, choice) in a.iter().enumerate() {
        let single = run(
            &e,
            request("the cat and the dog", 16, seeded(1000 + i as u64)),
        );
        assert_eq!(choice.ids, single[0].ids, "choice {i}");
    }
}

#[test]
fn concurrent_requests_share_steps() {
    let e = default_engine();
    let rxs: Vec<_> = (0..4)
        .map(|i| {
            e.submit(request(&format!("the {i} cat"), 30, seeded(i)))
                .expect("submit")
        })
        .collect();
    for rx in rxs {
        let c = collect(rx, 1);
        assert_eq!(c[0].ids.len(), 30);
    }
    let s = wait_idle(&e);
    assert!(s.max_rows_in_step >= 4, "{s:?}");
    // Four requests of 30 tokens alone would take >= 120 steps.
    assert!(s.steps < 100, "{s:?}");
    assert_eq!(s.running, 0);
    assert_eq!(s.waiting, 0);
}

#[test]
fn max_running_caps_the_batch_and_queues_the_rest() {
    let e = engine(EngineConfig {
        max_batch_tokens: 256,
        max_running: 2,
        max_model_len: 2048,
        ..EngineConfig::default()
    });
    let rxs: Vec<_> = (0..5)
        .map(|i| {
            e.submit(request(&format!("a {i} b"), 10, greedy()))
                .expect("submit")
        })
        .collect();
    for rx in rxs {
        assert_eq!(collect(rx, 1)[0].ids.len(), 10);
    }
    let s = e.stats();
    assert!(s.max_rows_in_step <= 2, "{s:?}");
    assert_eq!(s.max_rows_in_step, 2, "{s:?}");
}

#[test]
fn chunked_prefill_gives_the_same_output() {
    let text =
        "the cat sat on the mat and the dog sat on the cat and what is the answer to the question";
    let wide = run(&default_engine(), request(text, 12, greedy()));
    // Without drafts, which would save decode steps and count their tokens.
    let narrow_engine = engine(EngineConfig {
        max_batch_tokens: 5,
        max_running: 4,
        max_model_len: 2048,
        prompt_lookup_tokens: 0,
        ..EngineConfig::default()
    });
    // Salted: no block the wide run cached may serve the narrow run's prompt.
    let mut salted = request(text, 12, greedy());
    salted.cache_salt = Some("narrow".into());
    let narrow = run(&narrow_engine, salted);
    assert_eq!(narrow[0].cached_tokens, 0);
    assert_eq!(wide[0].ids, narrow[0].ids);
    let s = narrow_engine.stats();
    // Each step fed at most five tokens, so the prompt took several steps.
    assert!(s.tokens <= 5 * s.steps, "{s:?}");
    assert!(s.steps as usize >= prompt(text).len() / 5 + 11, "{s:?}");
}

#[test]
fn a_repeated_prompt_is_served_from_the_prefix_cache_with_the_same_output() {
    let e = default_engine();
    let text = "a conversation long enough to fill a few blocks of the cache with its tokens, \
                and then some more words so that two whole blocks are certainly there";
    let mut first = request(text, 8, greedy());
    first.cache_salt = Some("prefix-test".into());
    let second = first.clone();
    let a = run(&e, first);
    let b = run(&e, second);
    let len = prompt(text).len();
    assert!(len > 2 * temper_model::BLOCK_TOKENS, "{len} prompt tokens");
    // Every whole block before the last prompt token came from the cache.
    assert_eq!(a[0].cached_tokens, 0);
    assert_eq!(
        b[0].cached_tokens,
        (len - 1) / temper_model::BLOCK_TOKENS * temper_model::BLOCK_TOKENS
    );
    assert_eq!(a[0].ids, b[0].ids);
    assert_eq!(a[0].logprobs, b[0].logprobs);
}

/// An engine over its own copy of the tiny model whose KV pool holds `blocks` blocks.
fn engine_with_kv_blocks(blocks: usize, config: EngineConfig) -> Engine {
    let dir =
        std::env::temp_dir().join(format!("temper-engine-kv-{}-{blocks}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join("tiny.gguf");
    temper_model::tiny::write_tiny_gguf(&path, 7).expect("write tiny model");
    let model = temper_model::load_gguf(&path).expect("load").model;
    let _ = std::fs::remove_dir_all(&dir);
    let block_bytes = temper_model::KvArena::new(model.config()).block_bytes();
    let config = EngineConfig {
        kv_cache_bytes: blocks * block_bytes,
        ..config
    };
    Engine::start(Arc::new(model), tiny().tokenizer.clone(), config)
}

#[test]
fn a_request_too_big_for_the_kv_pool_fails_clearly_and_others_still_run() {
    let e = engine_with_kv_blocks(6, EngineConfig::default());
    let long = "one two three four five six seven eight nine ten ".repeat(12);
    let mut rx = e.submit(request(&long, 4, greedy())).expect("submit");
    let message = loop {
        match rx.blocking_recv() {
            Some(GenerationEvent::Error { message }) => break message,
            Some(_) => continue,
            None => panic!("no error event"),
        }
    };
    assert!(
        message.contains("KV cache") && message.contains("--kv-cache-mb"),
        "{message}"
    );
    // The engine is still up.
    assert_eq!(run(&e, request("a b c", 5, greedy()))[0].ids.len(), 5);
}

#[test]
fn requests_beyond_the_kv_pool_wait_or_are_preempted_and_all_finish_unchanged() {
    // Seven blocks: each request needs three at its longest (a prompt in one block, shared by
    // its two choices until the first writes, then 16 tokens more each), so the three cannot
    // all run at once.
    let e = engine_with_kv_blocks(7, EngineConfig::default());
    let texts = [
        "the cat sat on the mat and the dog",
        "what is the answer to the question",
        "yes no good day to you my friend",
    ];
    let reqs: Vec<GenerationRequest> = texts
        .iter()
        .map(|t| GenerationRequest {
            n: 2,
            ..request(t, 16, seeded(5))
        })
        .collect();
    let rxs: Vec<_> = reqs
        .iter()
        .map(|r| e.submit(r.clone()).expect("submit"))
        .collect();
    let crowded: Vec<Vec<Choice>> = rxs.into_iter().map(|rx| collect(rx, 2)).collect();
    for (r, got) in reqs.into_iter().zip(&crowded) {
        let alone = run(
            &default_engine(),
            GenerationRequest {
                cache_salt: Some("alone".into()),
                ..r
            },
        );
        for (a, b) in alone.iter().zip(got) {
            assert_eq!(a.ids, b.ids, "a crowded pool changed the output");
        }
    }
    assert!(e.stats().max_rows_in_step < 6, "{:?}", e.stats());
}

#[test]
fn the_kv_pool_is_sized_by_the_config_and_keeps_a_finished_prompt_for_reuse() {
    let e = engine_with_kv_blocks(7, EngineConfig::default());
    let before = e.kv_cache_stats();
    assert_eq!((before.capacity_blocks, before.live_blocks), (7, 0));
    let text = "the cat sat on the mat and the dog sat on the cat and what is the answer";
    assert!(prompt(text).len() > temper_model::BLOCK_TOKENS);
    run(&e, request(text, 4, greedy()));
    // Finished sequences leave the batch after the step that sent their last event.
    while e.stats().running_requests > 0 {
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    let after = e.kv_cache_stats();
    assert!(after.idle_cached_blocks > 0, "{after:?}");
    assert_eq!(after.live_blocks, after.idle_cached_blocks, "{after:?}");
    assert_eq!(after.available_blocks(), 7);
}

#[test]
fn past_max_waiting_new_requests_are_refused_and_the_accepted_ones_finish() {
    let e = engine(EngineConfig {
        max_running: 1,
        max_waiting: 3,
        ..EngineConfig::default()
    });
    let results: Vec<_> = (0..10)
        .map(|i| {
            let mut r = request(&format!("a {i} b"), 200, greedy());
            r.stopping.ignore_eos = true;
            e.submit(r)
        })
        .collect();
    let refused = results
        .iter()
        .filter(|r| matches!(r, Err(EngineError::QueueFull { max_waiting: 3 })))
        .count();
    // Ten submissions in a row: at most one admitted meanwhile, three waiting.
    assert!(refused >= 6, "{refused} refused");
    for rx in results.into_iter().flatten() {
        assert_eq!(collect(rx, 1)[0].ids.len(), 200);
    }
    // Once the queue drained, requests are taken again.
    assert_eq!(run(&e, request("c d", 3, greedy()))[0].ids.len(), 3);
}

#[test]
fn a_long_prompt_does_not_stall_running_decodes() {
    let e = engine(EngineConfig {
        max_batch_tokens: 8,
        max_running: 4,
        max_model_len: 2048,
        ..EngineConfig::default()
    });
    let short = e.submit(request("the cat", 40, greedy())).expect("submit");
    let long_text = "the dog and the cat ".repeat(20);
    let long = e.submit(request(&long_text, 4, greedy())).expect("submit");
    let short_out = collect(short, 1);
    collect(long, 1);
    assert_eq!(short_out[0].ids.len(), 40);
    // The short request decoded while the long prompt was chunked in beside it.
    let s = e.stats();
    assert!(s.max_rows_in_step >= 2, "{s:?}");
}

#[test]
fn dropping_the_receiver_cancels() {
    let e = default_engine();
    let mut rx = e
        .submit(request("the cat", 1500, greedy()))
        .expect("submit");
    // Wait until it is generating.
    for _ in 0..3 {
        assert!(matches!(
            rx.blocking_recv(),
            Some(GenerationEvent::Token { .. })
        ));
    }
    drop(rx);
    wait_idle(&e);
    // No further steps once it is gone.
    let steps = e.stats().steps;
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(e.stats().steps, steps);
    assert!(steps < 1000);
}

#[test]
fn max_tokens_finishes_with_length() {
    let e = default_engine();
    let c = run(&e, request("hello", 7, greedy()));
    assert_eq!(c[0].reason, Some(FinishReason::Length));
    assert_eq!(c[0].stop_reason, None);
    assert_eq!(c[0].completion_tokens, 7);
    let one = run(&e, request("hello", 1, greedy()));
    assert_eq!(one[0].ids.len(), 1);
    assert_eq!(one[0].ids[0], c[0].ids[0]);
}

#[test]
fn stop_token_ids_stop_with_the_token_as_reason() {
    let e = default_engine();
    let base = run(&e, request("the model answer", 20, greedy()));
    let ids = &base[0].ids;
    let stop_id = ids[5];
    let first = ids.iter().position(|&t| t == stop_id).expect("present");
    let mut req = request("the model answer", 20, greedy());
    req.stopping.stop_token_ids = vec![stop_id];
    let c = run(&e, req);
    assert_eq!(c[0].reason, Some(FinishReason::Stop));
    assert_eq!(c[0].stop_reason, Some(StopReason::Token(stop_id)));
    assert_eq!(c[0].ids, ids[..=first].to_vec());
    // The stop token itself adds no text.
    assert_eq!(c[0].token_texts.last().map(String::as_str), Some(""));
    let opts = DecodeOptions::default();
    assert_eq!(c[0].text, tiny().tokenizer.decode(&ids[..first], opts));
}

#[test]
fn eos_stops_without_text_unless_ignored() {
    let t = tiny();
    let base = run(&default_engine(), request("the cat sat", 12, greedy()));
    let ids = &base[0].ids;
    // Declare the 4th greedy token the EOS, so greedy output must hit it.
    let eos = ids[3];
    let first = ids.iter().position(|&x| x == eos).expect("present");
    let tokenizer = Tokenizer::from_gguf_metadata(&t.metadata)
        .expect("tokenizer")
        .with_bos_eos(t.tokenizer.bos_id(), Some(eos));
    let e = Engine::start(
        t.model.clone(),
        Arc::new(tokenizer),
        EngineConfig {
            max_batch_tokens: 256,
            max_running: 4,
            max_model_len: 2048,
            ..EngineConfig::default()
        },
    );
    let mut req = request("the cat sat", 12, greedy());
    req.stopping.ignore_eos = false;
    req.logprobs = Some(0);
    let c = run(&e, req);
    assert_eq!(c[0].ids, ids[..=first].to_vec());
    assert_eq!(c[0].reason, Some(FinishReason::Stop));
    assert_eq!(c[0].stop_reason, None);
    // EOS counts as a completion token with a logprob but adds no text.
    assert_eq!(c[0].completion_tokens, first + 1);
    assert_eq!(c[0].logprobs.len(), first + 1);
    assert_eq!(c[0].token_texts.last().map(String::as_str), Some(""));
    assert_eq!(
        c[0].text,
        t.tokenizer.decode(&ids[..first], DecodeOptions::default())
    );
    // ignore_eos generates through it.
    let c = run(&e, request("the cat sat", 12, greedy()));
    assert_eq!(&c[0].ids, ids);
    assert_eq!(c[0].reason, Some(FinishReason::Length));
}

#[test]
fn stop_strings_cut_the_output() {
    let t = tiny();
    let e = default_engine();
    let base = run(&e, request("the cat sat on", 30, greedy()));
    let text = &base[0].text;
    // A stop string from the middle of the greedy text: 3 characters starting at the 8th.
    let start = text.char_indices().nth(8).expect("long enough").0;
    let end = text[start..]
        .char_indices()
        .nth(3)
        .map(|(i, _)| start + i)
        .expect("long enough");
    let stop = text[start..end].to_string();
    let pos = text.find(&stop).expect("present");

    for include in [false, true] {
        let mut req = request("the cat sat on", 30, greedy());
        req.stopping.stop = vec!["zzzz-never".into(), stop.clone()];
        req.stopping.include_stop_str_in_output = include;
        let c = run(&e, req);
        let expect = if include {
            &text[..pos + stop.len()]
        } else {
            &text[..pos]
        };
        assert_eq!(c[0].text, expect, "include={include}");
        assert_eq!(c[0].reason, Some(FinishReason::Stop));
        assert_eq!(c[0].stop_reason, Some(StopReason::Text(stop.clone())));
        // Generation ended at the token that completed the match.
        assert!(c[0].ids.len() < 30);
        assert_eq!(c[0].ids, base[0].ids[..c[0].ids.len()].to_vec());
        let decoded = t.tokenizer.decode(&c[0].ids, DecodeOptions::default());
        assert!(decoded.starts_with(expect) && decoded.contains(&stop));
        // No streamed prefix ever went past the final text.
        let mut acc = String::new();
        for piece in &c[0].token_texts {
            acc.push_str(piece);
            assert!(expect.starts_with(&acc));
        }
    }
}

#[test]
fn streamed_text_equals_the_decoded_ids() {
    let t = tiny();
    let e = default_engine();
    for (skip, spaces) in [(true, true), (false, true), (false, false)] {
        for seed in 0..4 {
            let mut req = request("hello world", 40, seeded(seed));
            req.stopping.skip_special_tokens = skip;
            req.stopping.spaces_between_special_tokens = spaces;
            let c = run(&e, req);
            let opts = DecodeOptions {
                skip_special_tokens: skip,
                spaces_between_special_tokens: spaces,
            };
            assert_eq!(c[0].text, t.tokenizer.decode(&c[0].ids, opts));
        }
    }
    // With a stop list that never matches, hold-back changes the chunking, not the text.
    for seed in 0..4 {
        let mut req = request("hello world", 40, seeded(seed));
        req.stopping.stop = vec!["the cat and the dog and".into(), "e".repeat(9)];
        let c = run(&e, req);
        assert_eq!(
            c[0].text,
            t.tokenizer.decode(&c[0].ids, DecodeOptions::default())
        );
    }
}

#[test]
fn logprobs_are_reported_per_token() {
    let e = default_engine();
    let mut req = request("the answer is", 8, greedy());
    req.logprobs = Some(3);
    let c = run(&e, req);
    assert_eq!(c[0].logprobs.len(), 8);
    for (lp, &id) in c[0].logprobs.iter().zip(&c[0].ids) {
        assert_eq!(lp.top.len(), 3);
        // Greedy picks the most likely token.
        assert_eq!(lp.top[0].0, id);
        assert!((lp.top[0].1 - lp.logprob).abs() < 1e-6);
        assert!(lp.logprob <= 0.0);
        assert!(lp.top.windows(2).all(|w| w[0].1 >= w[1].1));
    }
    let mut req = request("the answer is", 3, seeded(3));
    req.logprobs = Some(0);
    let c = run(&e, req);
    assert_eq!(c[0].logprobs.len(), 3);
    assert!(c[0].logprobs.iter().all(|l| l.top.is_empty()));
}

#[test]
fn impossible_requests_are_rejected() {
    let e = engine(EngineConfig {
        max_batch_tokens: 64,
        max_running: 4,
        max_model_len: 100,
        ..EngineConfig::default()
    });
    let mut r = request("hello", 5, greedy());
    r.prompt.clear();
    assert_eq!(e.submit(r).err(), Some(EngineError::EmptyPrompt));
    let mut r = request("hello", 5, greedy());
    r.n = 0;
    assert_eq!(e.submit(r).err(), Some(EngineError::NoChoices));
    let r = request("hello", 0, greedy());
    assert_eq!(e.submit(r).err(), Some(EngineError::NoTokens));
    let r = request("hello", 99, greedy());
    assert!(matches!(e.submit(r), Err(EngineError::TooLong { .. })));
    let mut r = request("hello", 5, greedy());
    r.prompt.push(1_000_000);
    assert!(matches!(
        e.submit(r),
        Err(EngineError::TokenOutOfRange { .. })
    ));
    // The model's context (2048) caps the configured length.
    let big = engine(EngineConfig {
        max_batch_tokens: 64,
        max_running: 4,
        max_model_len: 1 << 20,
        ..EngineConfig::default()
    });
    assert_eq!(big.max_model_len(), 2048);
    // A valid request still works after the rejections.
    assert_eq!(run(&e, request("hello", 5, greedy()))[0].ids.len(), 5);
}

fn contains_seq(hay: &[u32], needle: &[u32]) -> bool {
    !needle.is_empty() && hay.windows(needle.len()).any(|w| w == needle)
}

/// A token from the greedy output that is plain text (so it can serve as a word).
fn plain_token(ids: &[u32], skip: usize) -> u32 {
    let t = tiny();
    *ids.iter()
        .skip(skip)
        .find(|&&id| {
            !t.tokenizer.is_special(id)
                && t.tokenizer
                    .piece(id)
                    .is_some_and(|p| p.chars().any(char::is_alphanumeric))
        })
        .expect("a plain token")
}

#[test]
fn logit_bias_forces_a_token_and_logprobs_stay_raw() {
    let e = default_engine();
    let base = run(&e, request("the cat sat", 10, greedy()));
    // A token greedy never picks here.
    let forced = (5u32..)
        .find(|id| !base[0].ids.contains(id) && !tiny().tokenizer.is_special(*id))
        .expect("id");
    for sampling in [greedy(), seeded(4)] {
        let mut req = request("the cat sat", 10, sampling);
        req.sampling.logit_bias = vec![(forced, 100.0)];
        req.logprobs = Some(1);
        let c = run(&e, req);
        assert_eq!(c[0].ids, vec![forced; 10]);
        // The reported logprob is the model's own, not the biased one.
        assert!(c[0].logprobs.iter().all(|lp| lp.logprob < -0.01));
        assert!(c[0].logprobs.iter().all(|lp| lp.top[0].0 != forced));
    }
    // A negative bias bans the greedy choice.
    let mut req = request("the cat sat", 10, greedy());
    req.sampling.logit_bias = vec![(base[0].ids[0], -100.0)];
    let c = run(&e, req);
    assert_ne!(c[0].ids[0], base[0].ids[0]);
}

#[test]
fn allowed_token_ids_restrict_every_token() {
    let e = default_engine();
    let allowed = vec![40u32, 41, 77, 130];
    for seed in 0..3 {
        let mut req = request("hello world", 24, seeded(seed));
        req.sampling.allowed_token_ids = Some(allowed.clone());
        let c = run(&e, req);
        assert!(
            c[0].ids.iter().all(|t| allowed.contains(t)),
            "{:?}",
            c[0].ids
        );
    }
    let base = run(&e, request("hello world", 24, seeded(0)));
    assert!(base[0].ids.iter().any(|t| !allowed.contains(t)));
}

#[test]
fn bad_words_never_appear() {
    let t = tiny();
    let e = default_engine();
    let base = run(&e, request("the cat sat on", 40, greedy()));
    let ids = &base[0].ids;
    let spellings = |word: &str| -> Vec<Vec<u32>> {
        [
            word.trim_start().to_string(),
            format!(" {}", word.trim_start()),
        ]
        .iter()
        .map(|w| t.tokenizer.encode(w, true))
        .collect()
    };
    // A one-token and a two-token word of the greedy output that tokenize back to its ids.
    let word_of_len = |len: usize| -> String {
        (0..ids.len() + 1 - len)
            .map(|i| {
                t.tokenizer
                    .decode(&ids[i..i + len], DecodeOptions::default())
            })
            .find(|w| {
                !w.contains('\u{FFFD}')
                    && w.chars().any(char::is_alphanumeric)
                    && spellings(w)
                        .iter()
                        .any(|s| s.len() == len && contains_seq(ids, s))
            })
            .expect("a word in the greedy output")
    };
    for word in [word_of_len(1), word_of_len(2)] {
        let mut req = request("the cat sat on", 40, greedy());
        req.sampling.bad_words = vec![word.clone()];
        let c = run(&e, req);
        for s in spellings(&word) {
            assert!(
                !contains_seq(&c[0].ids, &s),
                "{word:?} generated: {:?}",
                c[0].ids
            );
        }
        assert_ne!(&c[0].ids, ids);
    }
}

#[test]
fn min_tokens_delays_eos_stop_tokens_and_stop_strings() {
    let t = tiny();
    let base = run(&default_engine(), request("the cat sat", 16, greedy()));
    let ids = &base[0].ids;
    // The EOS trick: declare the 2nd greedy token the EOS.
    let eos = ids[1];
    let first = ids.iter().position(|&x| x == eos).expect("present");
    let tokenizer = Tokenizer::from_gguf_metadata(&t.metadata)
        .expect("tokenizer")
        .with_bos_eos(t.tokenizer.bos_id(), Some(eos));
    let e = Engine::start(
        t.model.clone(),
        Arc::new(tokenizer),
        EngineConfig {
            max_batch_tokens: 256,
            max_running: 4,
            max_model_len: 2048,
            ..EngineConfig::default()
        },
    );
    let mut req = request("the cat sat", 16, greedy());
    req.stopping.ignore_eos = false;
    let c = run(&e, req.clone());
    assert_eq!(
        c[0].ids.len(),
        first + 1,
        "EOS stops at once without min_tokens"
    );
    req.stopping.min_tokens = 8;
    let c = run(&e, req.clone());
    assert!(c[0].ids.len() >= 8, "{:?}", c[0].ids);
    assert!(!c[0].ids[..8].contains(&eos));
    if c[0].ids.len() < 16 {
        assert_eq!(c[0].ids.last(), Some(&eos));
        assert_eq!(c[0].reason, Some(FinishReason::Stop));
    }
    // min_tokens == max_tokens: never stopped early.
    req.stopping.min_tokens = 16;
    let c = run(&e, req);
    assert_eq!(c[0].ids.len(), 16);
    assert!(!c[0].ids.contains(&eos));
    assert_eq!(c[0].reason, Some(FinishReason::Length));

    // Stop token ids are masked the same way.
    let e = default_engine();
    let stop_id = ids[2];
    let first = ids.iter().position(|&x| x == stop_id).expect("present");
    let mut req = request("the cat sat", 16, greedy());
    req.stopping.stop_token_ids = vec![stop_id];
    assert_eq!(run(&e, req.clone())[0].ids.len(), first + 1);
    req.stopping.min_tokens = 10;
    let c = run(&e, req);
    assert!(c[0].ids.len() >= 10 && !c[0].ids[..10].contains(&stop_id));

    // Stop strings are not matched before min_tokens.
    let first = t.tokenizer.decode(&ids[..1], DecodeOptions::default());
    assert!(!first.is_empty());
    let mut req = request("the cat sat", 16, greedy());
    req.stopping.stop = vec![first.clone()];
    let early = run(&e, req.clone())[0].ids.len();
    assert!(early <= 3, "the stop string ends the first tokens");
    req.stopping.min_tokens = early + 5;
    let c = run(&e, req);
    assert!(c[0].ids.len() >= early + 5, "{:?}", c[0].ids);
    assert!(c[0].text.starts_with(&first));
}

#[test]
fn penalties_change_greedy_output() {
    let e = default_engine();
    let base = run(&e, request("the dog and the cat", 40, greedy()));
    type Set = fn(&mut SamplingParams);
    let cases: [(&str, Set); 4] = [
        ("repetition", |s| s.repetition_penalty = 1.8),
        ("frequency", |s| s.frequency_penalty = 2.0),
        ("presence", |s| s.presence_penalty = 2.0),
        ("negative presence", |s| s.presence_penalty = -2.0),
    ];
    for (name, set) in cases {
        let mut req = request("the dog and the cat", 40, greedy());
        set(&mut req.sampling);
        let c = run(&e, req);
        assert_ne!(c[0].ids, base[0].ids, "{name} had no effect");
    }
    // A strong frequency penalty thins out repeats.
    let distinct = |ids: &[u32]| {
        let mut v = ids.to_vec();
        v.sort_unstable();
        v.dedup();
        v.len()
    };
    let mut req = request("the dog and the cat", 40, greedy());
    req.sampling.frequency_penalty = 2.0;
    let c = run(&e, req);
    assert!(distinct(&c[0].ids) > distinct(&base[0].ids));
}

#[test]
fn repetition_detection_stops_a_loop() {
    let e = default_engine();
    let loop_token = plain_token(&run(&e, request("hello", 8, greedy()))[0].ids, 0);
    // One allowed token makes greedy output loop on it.
    let looping = |rd: Option<RepetitionDetection>| {
        let mut req = request("hello", 20, greedy());
        req.sampling.allowed_token_ids = Some(vec![loop_token]);
        req.stopping.repetition_detection = rd;
        run(&e, req).remove(0)
    };
    let c = looping(None);
    assert_eq!(c.ids.len(), 20);
    assert_eq!(c.reason, Some(FinishReason::Length));
    let c = looping(Some(RepetitionDetection {
        min_pattern_size: 1,
        max_pattern_size: 1,
        min_count: 4,
    }));
    assert_eq!(c.ids, vec![loop_token; 4]);
    assert_eq!(c.reason, Some(FinishReason::Repetition));
    assert_eq!(c.stop_reason, Some(StopReason::Repetition));
    // Patterns of 2..3 tokens, twice: "x x" "x x" after 4 tokens.
    let c = looping(Some(RepetitionDetection {
        min_pattern_size: 2,
        max_pattern_size: 3,
        min_count: 2,
    }));
    assert_eq!(c.ids.len(), 4);
    assert_eq!(c.reason, Some(FinishReason::Repetition));
    // Natural text with a pattern that never repeats that often runs to the end.
    let mut req = request("hello", 20, seeded(1));
    req.stopping.repetition_detection = Some(RepetitionDetection {
        min_pattern_size: 1,
        max_pattern_size: 4,
        min_count: 15,
    });
    assert_eq!(run(&e, req)[0].reason, Some(FinishReason::Length));
}

// Structured outputs: each choice samples under its own grammar matcher's mask.

fn constrained(
    engine: &Engine,
    text: &str,
    max_tokens: usize,
    sampling: SamplingParams,
    constraint: OutputConstraint,
) -> GenerationRequest {
    let grammar = engine
        .grammar_compiler()
        .expect("compiler")
        .compile(&constraint)
        .expect("compile");
    let mut req = request(text, max_tokens, sampling);
    req.stopping.ignore_eos = false;
    req.constraint = Some(grammar);
    req
}

/// `(cat|dog) [0-9]{1,3}!` without a regex engine.
fn matches_pet_number(s: &str) -> bool {
    let Some(rest) = s.strip_prefix("cat ").or_else(|| s.strip_prefix("dog ")) else {
        return false;
    };
    let Some(digits) = rest.strip_suffix('!') else {
        return false;
    };
    (1..=3).contains(&digits.len()) && digits.bytes().all(|b| b.is_ascii_digit())
}

#[test]
fn regex_constraint_holds_over_20_samples_at_temperature_1() {
    let e = default_engine();
    let rxs: Vec<_> = (0..20)
        .map(|i| {
            let req = constrained(
                &e,
                "the",
                30,
                seeded(1000 + i),
                OutputConstraint::Regex("(cat|dog) [0-9]{1,3}!".into()),
            );
            e.submit(req).expect("submit")
        })
        .collect();
    let mut distinct = std::collections::HashSet::new();
    for rx in rxs {
        let c = collect(rx, 1).remove(0);
        assert!(matches_pet_number(&c.text), "{:?}", c.text);
        // The grammar is complete after "!": the choice stops there, without EOS.
        assert_eq!(c.reason, Some(FinishReason::Stop), "{:?}", c.text);
        assert_eq!(c.stop_reason, None);
        distinct.insert(c.text);
    }
    // Temperature 1 really sampled.
    assert!(distinct.len() > 3, "{distinct:?}");
}

#[test]
fn choice_constraint_gives_each_of_n_choices_its_own_matcher() {
    let e = default_engine();
    let options = ["yes", "no", "the dog sat", "Paris"];
    let mut req = constrained(
        &e,
        "question",
        20,
        seeded(5),
        OutputConstraint::Choice(options.iter().map(|s| s.to_string()).collect()),
    );
    req.n = 8;
    let choices = run(&e, req);
    for c in &choices {
        assert!(options.contains(&c.text.as_str()), "{:?}", c.text);
        assert_eq!(c.reason, Some(FinishReason::Stop));
    }
    let distinct: std::collections::HashSet<_> = choices.iter().map(|c| &c.text).collect();
    assert!(distinct.len() > 1, "{distinct:?}");
}

#[test]
fn json_schema_output_parses_and_validates() {
    let e = default_engine();
    let schema = serde_json::json!({
        "type": "object",
        "properties": {
            "count": {"type": "integer", "minimum": 0, "maximum": 999},
            "pet": {"enum": ["cat", "dog"]},
            "ok": {"type": "boolean"}
        },
        "required": ["count", "pet", "ok"],
        "additionalProperties": false
    });
    for (i, temperature) in [(0u64, 0.0f32), (1, 1.0), (2, 1.0), (3, 1.0)] {
        let sampling = SamplingParams {
            temperature,
            seed: Some(i),
            ..SamplingParams::default()
        };
        let req = constrained(
            &e,
            "the cat",
            80,
            sampling,
            OutputConstraint::Json {
                schema: schema.clone(),
                options: JsonOptions {
                    disable_any_whitespace: true,
                    ..JsonOptions::default()
                },
            },
        );
        let c = run(&e, req).remove(0);
        let v: serde_json::Value = serde_json::from_str(&c.text)
            .unwrap_or_else(|err| panic!("{:?} does not parse: {err}", c.text));
        let count = v["count"].as_u64().expect("count");
        assert!(count <= 999);
        assert!(v["pet"] == "cat" || v["pet"] == "dog", "{v}");
        assert!(v["ok"].is_boolean(), "{v}");
        assert_eq!(v.as_object().map(|o| o.len()), Some(3), "{v}");
        // disable_any_whitespace: compact JSON.
        assert!(!c.text.contains(' '), "{:?}", c.text);
        assert_eq!(c.reason, Some(FinishReason::Stop));
    }
}

/// `tool_choice` "required": a random model's output is always calls that parse, of the given
/// functions, with arguments matching their schemas; one call unless parallel; in each format.
#[test]
fn tool_call_constraint_gives_calls_that_parse_and_match_their_schemas() {
    use temper_text::tool_calls::{FunctionSchema, ToolCallFormat, ToolCallParser};
    let e = default_engine();
    let functions = vec![
        FunctionSchema {
            name: "get_weather".into(),
            parameters: serde_json::json!({"type": "object",
                "properties": {"city": {"type": "string", "maxLength": 8},
                               "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                "required": ["city", "days"], "additionalProperties": false}),
        },
        FunctionSchema {
            name: "get_time".into(),
            parameters: serde_json::json!({"type": "object", "properties": {},
                "additionalProperties": false}),
        },
    ];
    let names: Vec<String> = functions.iter().map(|f| f.name.clone()).collect();
    let mut seen = std::collections::HashSet::new();
    let mut parallel_calls = 0;
    let formats = [ToolCallFormat::Hermes, ToolCallFormat::Llama3Json];
    for (format, parallel) in formats.into_iter().flat_map(|f| [(f, false), (f, true)]) {
        for seed in 0..8 {
            let req = constrained(
                &e,
                "the cat",
                300,
                seeded(seed),
                OutputConstraint::ToolCalls {
                    format,
                    functions: functions.clone(),
                    parallel,
                },
            );
            let c = run(&e, req).remove(0);
            let max_calls = if parallel { usize::MAX } else { 1 };
            let (content, calls) =
                ToolCallParser::new(format, names.clone(), max_calls).split(&c.text);
            if !parallel {
                assert_eq!(c.reason, Some(FinishReason::Stop), "{:?}", c.text);
            }
            if c.reason == Some(FinishReason::Stop) {
                assert_eq!(content, None, "{:?}", c.text);
                assert!(!calls.is_empty(), "{:?}", c.text);
            }
            if !parallel {
                assert_eq!(calls.len(), 1, "{:?}", c.text);
            } else {
                parallel_calls += calls.len();
            }
            for call in calls {
                let args: serde_json::Value = serde_json::from_str(&call.arguments).unwrap();
                let args = args.as_object().expect("an object");
                if call.name == "get_weather" {
                    assert_eq!(args.len(), 2, "{args:?}");
                    assert!(args["city"].as_str().unwrap().chars().count() <= 8);
                    assert!((1..=7).contains(&args["days"].as_u64().unwrap()));
                } else {
                    assert!(args.is_empty(), "{args:?}");
                }
                seen.insert(call.name);
            }
        }
    }
    assert_eq!(seen.len(), 2, "both functions get called: {seen:?}");
    assert!(parallel_calls >= 8, "{parallel_calls}");
}

#[test]
fn lark_grammar_constraint() {
    let e = default_engine();
    let grammar = "start: \"the \" ANIMAL \" sat on the \" THING\nANIMAL: \"cat\" | \"dog\"\nTHING: \"mat\" | \"day\"\n";
    for seed in 0..5 {
        let req = constrained(
            &e,
            "hello",
            30,
            seeded(seed),
            OutputConstraint::Grammar(grammar.into()),
        );
        let c = run(&e, req).remove(0);
        let ok = ["cat", "dog"].iter().any(|a| {
            ["mat", "day"]
                .iter()
                .any(|t| c.text == format!("the {a} sat on the {t}"))
        });
        assert!(ok, "{:?}", c.text);
    }
}

#[test]
fn constrained_and_unconstrained_requests_share_a_batch() {
    // Drafts could finish the free request before the constrained one gets its rows.
    let e = engine_without_drafts();
    let free = || request("what is the capital of France", 40, seeded(77));
    let pets = || {
        constrained(
            &e,
            "the",
            30,
            seeded(3),
            OutputConstraint::Regex("(cat|dog) [0-9]{1,3}!".into()),
        )
    };
    let free_alone = run(&e, free()).remove(0);
    let pets_alone = run(&e, pets()).remove(0);
    let rx_pets = e.submit(pets()).expect("submit");
    let rx_free = e.submit(free()).expect("submit");
    let pets_batched = collect(rx_pets, 1).remove(0);
    let free_batched = collect(rx_free, 1).remove(0);
    assert_eq!(free_batched.ids, free_alone.ids);
    assert_eq!(free_batched.reason, Some(FinishReason::Length));
    assert_eq!(pets_batched.ids, pets_alone.ids);
    assert!(matches_pet_number(&pets_batched.text));
    let s = wait_idle(&e);
    assert!(s.max_rows_in_step >= 2, "{s:?}");
}

#[test]
fn a_grammar_the_other_processors_rule_out_fails_the_request() {
    let e = default_engine();
    let t = tiny();
    let dog = t.tokenizer.encode("dog", false)[0];
    let mut req = constrained(
        &e,
        "the",
        10,
        seeded(1),
        OutputConstraint::Regex("cat".into()),
    );
    req.sampling.allowed_token_ids = Some(vec![dog]);
    let mut rx = e.submit(req).expect("submit");
    let mut failed = false;
    while let Some(ev) = rx.blocking_recv() {
        if let GenerationEvent::Error { message } = ev {
            assert!(message.contains("structured output"), "{message}");
            failed = true;
        }
    }
    assert!(failed);
    // The engine carries on.
    assert_eq!(run(&e, request("the", 3, greedy()))[0].ids.len(), 3);
}

#[test]
fn sampling_constraints_that_leave_no_token_fail_the_request() {
    let e = default_engine();
    // The only allowed token is a stop token, which min_tokens keeps out of the first one.
    let mut req = request("the", 4, seeded(1));
    req.sampling.allowed_token_ids = Some(vec![40]);
    req.stopping.stop_token_ids = vec![40];
    req.stopping.min_tokens = 1;
    let mut rx = e.submit(req).expect("submit");
    let (mut failed, mut tokens) = (false, 0);
    while let Some(ev) = rx.blocking_recv() {
        match ev {
            GenerationEvent::Error { message } => {
                assert!(message.contains("no token is left"), "{message}");
                failed = true;
            }
            GenerationEvent::Token { .. } => tokens += 1,
            _ => {}
        }
    }
    assert!(failed && tokens == 0, "failed {failed}, {tokens} tokens");
    // The engine carries on.
    assert_eq!(run(&e, request("the", 3, greedy()))[0].ids.len(), 3);
}

#[test]
fn invalid_constraints_are_compile_errors() {
    let e = default_engine();
    let c = e.grammar_compiler().expect("compiler");
    for bad in [
        OutputConstraint::Regex("(unclosed".into()),
        OutputConstraint::Grammar("start: undefined_rule\n".into()),
        OutputConstraint::Json {
            schema: serde_json::json!({"type": "no-such-type"}),
            options: JsonOptions::default(),
        },
        OutputConstraint::Choice(vec![]),
    ] {
        assert!(
            matches!(c.compile(&bad), Err(GrammarError::Invalid(_))),
            "{bad:?}"
        );
    }
}

/// Polls the engine's counters until `done` holds (the scheduler runs on its own thread).
fn wait_stats(e: &Engine, done: impl Fn(&EngineStats) -> bool) -> EngineStats {
    let t0 = Instant::now();
    loop {
        let s = e.stats();
        if done(&s) {
            return s;
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "still {s:?}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn pets(e: &Engine, seed: u64) -> GenerationRequest {
    constrained(
        e,
        "the",
        30,
        seeded(seed),
        OutputConstraint::Regex("(cat|dog) [0-9]{1,3}!".into()),
    )
}

#[test]
fn a_pending_mask_never_stalls_the_batch() {
    let e = engine_without_drafts();
    let hold = Arc::new(std::sync::Mutex::new(Some(e.hold_masks())));
    // If the batch did wait for the held mask, this releases it so the test fails instead of
    // hanging.
    let watchdog = {
        let hold = hold.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_secs(120));
            hold.lock().unwrap().take().is_some()
        })
    };
    let mut constrained_rx = e.submit(pets(&e, 4)).expect("submit");
    // The first token samples under the compiled grammar's first mask; the second needs a
    // mask from a worker, which is held.
    let Some(GenerationEvent::Token {
        text: mut pets_text,
        ..
    }) = constrained_rx.blocking_recv()
    else {
        panic!("no first token");
    };
    // Prefill (sampling token 1) and the decode row whose logits wait for the held mask.
    let before = wait_stats(&e, |s| s.steps >= 2);
    assert_eq!(before.steps, 2, "{before:?}");

    let free = collect(
        e.submit(request("the dog sat", 20, greedy()))
            .expect("submit"),
        1,
    );
    assert_eq!(free[0].ids.len(), 20);
    let after = e.stats();
    assert!(
        hold.lock().unwrap().is_some(),
        "the batch waited for the held mask"
    );
    // The unconstrained request got a token on every step it ran (prefill + 19 decode rows),
    // one row each, while the constrained choice sat out.
    assert_eq!(after.steps - before.steps, 20, "{after:?}");
    assert_eq!(after.rows - before.rows, 20, "{after:?}");
    assert_eq!(after.masks, 0);
    assert!(
        constrained_rx.try_recv().is_err(),
        "the held choice went on"
    );

    drop(hold.lock().unwrap().take());
    while let Some(ev) = constrained_rx.blocking_recv() {
        match ev {
            GenerationEvent::Token { text, .. } | GenerationEvent::Finished { text, .. } => {
                pets_text.push_str(&text)
            }
            GenerationEvent::Error { message } => panic!("{message}"),
            GenerationEvent::PromptLogprobs { .. } => panic!("prompt logprobs not asked for"),
        }
    }
    assert!(matches_pet_number(&pets_text), "{pets_text:?}");
    assert!(e.stats().masks > 0);
    drop(watchdog);
}

#[test]
fn a_cancelled_request_skips_its_pending_masks() {
    let e = default_engine();
    let hold = e.hold_masks();
    let mut req = pets(&e, 9);
    req.n = 4;
    let mut rx = e.submit(req).expect("submit");
    // Each choice's first token is out, so its next mask is queued behind the hold.
    for _ in 0..4 {
        assert!(matches!(
            rx.blocking_recv(),
            Some(GenerationEvent::Token { .. })
        ));
    }
    drop(rx);
    wait_idle(&e);
    drop(hold);
    let s = wait_stats(&e, |s| s.masks_abandoned == 4);
    assert_eq!(s.masks, 0, "{s:?}");
    // The engine carries on.
    assert_eq!(run(&e, request("the", 3, greedy()))[0].ids.len(), 3);
}

/// Under priority scheduling a waiting request preempts running ones only when that makes room
/// for it. Constrained requests whose masks are held stay running for as long as the test
/// needs, so every admission decision below happens at a known point.
#[test]
fn priority_preempts_only_when_that_makes_room() {
    let e = engine(EngineConfig {
        max_batch_tokens: 256,
        max_running: 4,
        max_model_len: 2048,
        scheduling: Scheduling::Priority,
        ..EngineConfig::default()
    });
    let hold = e.hold_masks();
    // A constrained request whose first tokens are out: its next masks are held. Returns its
    // receiver and each choice's text so far.
    let held = |n: usize, priority: i64| {
        let mut r = pets(&e, 20 + priority as u64);
        r.n = n;
        r.priority = priority;
        let mut rx = e.submit(r).expect("submit");
        let mut texts = vec![String::new(); n];
        for _ in 0..n {
            match rx.blocking_recv() {
                Some(GenerationEvent::Token { choice, text, .. }) => texts[choice] += &text,
                other => panic!("expected a token, got {other:?}"),
            }
        }
        (rx, texts)
    };
    let free = |n: usize, priority: i64| {
        let mut r = request("the dog sat", 4, greedy());
        r.n = n;
        r.priority = priority;
        e.submit(r).expect("submit")
    };
    // Four sequences run: three of priority 0, one of priority 5.
    let best = held(3, 0);
    let worst = held(1, 5);
    assert_eq!(e.stats().running, 4);

    // Two sequences of priority 1: preempting the priority-5 request would free one, not
    // enough, so it keeps running and the pair waits.
    let pair = free(2, 1);
    let s = wait_stats(&e, |s| s.waiting > 0);
    assert_eq!((s.preemptions, s.waiting, s.running), (0, 1, 4), "{s:?}");

    // One sequence of priority 1: preempting the priority-5 request makes room.
    drop(pair);
    let one = free(1, 1);
    assert_eq!(collect(one, 1)[0].ids.len(), 4);
    assert_eq!(e.stats().preemptions, 1);

    drop(hold);
    for (mut rx, mut texts) in [best, worst] {
        while let Some(ev) = rx.blocking_recv() {
            match ev {
                GenerationEvent::Token { choice, text, .. }
                | GenerationEvent::Finished { choice, text, .. } => texts[choice] += &text,
                GenerationEvent::Error { message } => panic!("{message}"),
                GenerationEvent::PromptLogprobs { .. } => panic!("prompt logprobs not asked for"),
            }
        }
        for t in &texts {
            assert!(matches_pet_number(t), "{t:?}");
        }
    }
    assert_eq!(wait_idle(&e).preemptions, 1);
}

/// Log-softmax of each row of the model's logits for `tokens` (all rows, one plain forward).
fn direct_log_softmax(tokens: &[u32]) -> Vec<Vec<f64>> {
    let t = tiny();
    let mut cache = t.model.new_cache();
    let logits = t
        .model
        .forward(&mut [temper_model::SeqInput {
            tokens,
            cache: &mut cache,
            all_logits: true,
            adapter: None,
        }])
        .expect("forward");
    (0..tokens.len())
        .map(|i| {
            let row = logits[0].row(i);
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
            let lse = max
                + row
                    .iter()
                    .map(|&v| (v as f64 - max).exp())
                    .sum::<f64>()
                    .ln();
            row.iter().map(|&v| v as f64 - lse).collect()
        })
        .collect()
}

/// Checks prompt logprobs against a direct log-softmax: the prompt token's logprob and rank
/// (how many tokens are at least as likely), and the k best tokens in order.
fn assert_prompt_logprobs(prompt: &[u32], k: usize, got: &[PromptLogprob]) {
    let want = direct_log_softmax(prompt);
    assert_eq!(got.len(), prompt.len() - 1);
    let mut outside_top = 0;
    for (i, p) in got.iter().enumerate() {
        let lsm = &want[i];
        let token = prompt[i + 1];
        assert_eq!(p.token, token);
        let own = lsm[token as usize];
        assert!(
            (p.logprob as f64 - own).abs() < 1e-4,
            "position {}: {} vs {own}",
            i + 1,
            p.logprob
        );
        let mut order: Vec<u32> = (0..lsm.len() as u32).collect();
        order.sort_by(|&a, &b| lsm[b as usize].total_cmp(&lsm[a as usize]).then(a.cmp(&b)));
        let top: Vec<u32> = p.top.iter().map(|t| t.0).collect();
        assert_eq!(top, order[..k], "position {}", i + 1);
        for &(id, l) in &p.top {
            assert!((l as f64 - lsm[id as usize]).abs() < 1e-4);
        }
        let rank = lsm.iter().filter(|&&l| l >= own).count();
        assert_eq!(p.rank, rank, "position {}", i + 1);
        if !top.contains(&token) {
            outside_top += 1;
        }
    }
    // The case where the actual token is not among the top k was seen.
    assert!(outside_top > 0);
}

#[test]
fn prompt_logprobs_equal_a_direct_log_softmax() {
    // Small batches chunk the prompt across steps; the large one caps its chunks for the
    // logits rows; both share steps with other requests.
    for max_batch_tokens in [7, 256] {
        let e = engine(EngineConfig {
            max_batch_tokens,
            max_running: 16,
            max_model_len: 2048,
            ..EngineConfig::default()
        });
        let text = "the cat sat on the mat and then the dog came over to see what was going on \
                    there, and the cat was not happy about it at all, so it ran away "
            .repeat(2);
        let mut req = request(&text, 5, seeded(1));
        req.n = 2;
        req.prompt_logprobs = Some(3);
        let other = e
            .submit(request("yes no good day", 30, seeded(2)))
            .expect("submit");
        let (lps, choices) =
            collect_with_prompt_logprobs(e.submit(req.clone()).expect("submit"), 2);
        collect(other, 1);
        assert!(
            req.prompt.len() > 64,
            "the prompt spans more than one logprob chunk"
        );
        assert_prompt_logprobs(&req.prompt, 3, &lps.expect("prompt logprobs"));
        assert_eq!(choices.len(), 2);
        assert_eq!(wait_idle(&e).prompt_logprobs, req.prompt.len() as u64 - 1);
    }
    // k = 0: only the prompt token; a one-token prompt has nothing to predict.
    let e = default_engine();
    let mut req = request("hello there", 2, greedy());
    req.prompt_logprobs = Some(0);
    let (lps, _) = collect_with_prompt_logprobs(e.submit(req.clone()).expect("submit"), 1);
    let lps = lps.expect("prompt logprobs");
    assert!(lps.iter().all(|p| p.top.is_empty()) && lps.len() == req.prompt.len() - 1);
    req.prompt.truncate(1);
    let (lps, _) = collect_with_prompt_logprobs(e.submit(req).expect("submit"), 1);
    assert_eq!(lps, Some(Vec::new()));
}

/// Runs `low` (priority > 0) on a fresh priority engine and, once `started` holds, `urgent`
/// (priority 0), which preempts it. Whether it comes before `low` is done is up to timing: this
/// tries until a preemption happens. Returns `low`'s events and the engine's counters.
fn run_preempted(
    config: EngineConfig,
    low: &GenerationRequest,
    started: impl Fn(&EngineStats) -> bool,
    urgent: &GenerationRequest,
) -> (Option<Vec<PromptLogprob>>, Vec<Choice>, EngineStats) {
    for _ in 0..20 {
        let e = engine(EngineConfig {
            scheduling: Scheduling::Priority,
            ..config.clone()
        });
        let rx = e.submit(low.clone()).expect("submit");
        wait_stats(&e, &started);
        collect(e.submit(urgent.clone()).expect("submit"), urgent.n);
        let (prompt_logprobs, choices) = collect_with_prompt_logprobs(rx, low.n);
        let stats = wait_idle(&e);
        if stats.preemptions > 0 {
            return (prompt_logprobs, choices, stats);
        }
    }
    panic!("the urgent request never arrived in time to preempt");
}

/// A request preempted while its prompt is being prefilled replays the prefill but does not
/// compute the prompt logprobs it already has again.
#[test]
fn preempted_prefill_keeps_its_prompt_logprobs() {
    let text = "one two three four five six seven eight nine ten ".repeat(12);
    let mut low = request(&text, 1, greedy());
    low.prompt_logprobs = Some(2);
    low.priority = 5;
    let urgent = request("the dog sat", 3, greedy());
    // max_tokens 1 finishes in the step that ends the prefill: any preemption was in it.
    let config = EngineConfig {
        max_batch_tokens: 1,
        max_running: 1,
        max_model_len: 2048,
        ..EngineConfig::default()
    };
    let (lps, _, s) = run_preempted(config, &low, |s| s.tokens > 2, &urgent);
    // The urgent request feeds its prompt and 2 decode rows; at least 3 prompt tokens of the
    // preempted prefill were fed twice.
    let once = low.prompt.len() + urgent.prompt.len() + 2;
    assert!(
        s.tokens >= once as u64 + 3,
        "the prefill was replayed: {s:?}"
    );
    assert_eq!(s.prompt_logprobs, low.prompt.len() as u64 - 1);
    assert_prompt_logprobs(&low.prompt, 2, &lps.expect("prompt logprobs"));
}

fn beam_request(text: &str, n: usize, max_tokens: usize, length_penalty: f32) -> GenerationRequest {
    let mut r = request(text, max_tokens, greedy());
    r.n = n;
    r.beam_search = Some(BeamSearch { length_penalty });
    r
}

/// A beam result's score recomputed from a scoring forward over prompt + output (+ the end
/// token that ended it, which counts in the logprob but not in the length), as vLLM scores.
fn rescored(prompt: &[u32], c: &Choice, length_penalty: f32) -> f64 {
    let mut tokens: Vec<u32> = prompt.iter().chain(&c.ids).copied().collect();
    let len = tokens.len();
    if let Some(StopReason::Token(end)) = c.stop_reason {
        tokens.push(end);
    }
    let lsm = direct_log_softmax(&tokens);
    let cum: f64 = (prompt.len()..tokens.len())
        .map(|i| lsm[i - 1][tokens[i] as usize])
        .sum();
    cum / (len as f64).powf(length_penalty as f64)
}

#[test]
fn beam_search_of_width_one_is_greedy() {
    let e = default_engine();
    let mut greedy_req = request("the cat sat on the mat and", 12, greedy());
    greedy_req.logprobs = Some(2);
    let want = run(&e, greedy_req).remove(0);
    let mut req = beam_request("the cat sat on the mat and", 1, 12, 1.0);
    req.logprobs = Some(2);
    let got = run(&e, req).remove(0);
    assert_eq!(got.ids, want.ids);
    assert_eq!(got.text, want.text);
    assert_eq!(got.reason, Some(FinishReason::Length));
    for (a, b) in got.logprobs.iter().zip(&want.logprobs) {
        assert!((a.logprob - b.logprob).abs() < 1e-5);
        assert_eq!(
            a.top.iter().map(|t| t.0).collect::<Vec<_>>(),
            b.top.iter().map(|t| t.0).collect::<Vec<_>>()
        );
    }
}

#[test]
fn wider_beams_are_distinct_ranked_and_no_worse_than_greedy() {
    let e = default_engine();
    let text = "what is the answer to the question";
    let req = beam_request(text, 4, 10, 1.0);
    let alone = run(&e, req.clone());
    assert!(
        e.stats().max_rows_in_step >= 4,
        "the beams share forward calls"
    );
    // Beams are rows of the shared batch: other requests do not change the result.
    let busy = run_in_busy_batch(&e, req.clone());
    assert_eq!(
        alone.iter().map(|c| &c.ids).collect::<Vec<_>>(),
        busy.iter().map(|c| &c.ids).collect::<Vec<_>>()
    );
    let scores: Vec<f64> = alone
        .iter()
        .map(|c| rescored(&req.prompt, c, 1.0))
        .collect();
    for w in scores.windows(2) {
        assert!(w[0] >= w[1] - 1e-5, "not best first: {scores:?}");
    }
    for (i, a) in alone.iter().enumerate() {
        assert_eq!(a.ids.len(), 10);
        assert_eq!(a.completion_tokens, 10);
        assert!(
            alone[..i].iter().all(|b| b.ids != a.ids),
            "beams {i} repeats one"
        );
    }
    let greedy_choice = run(&e, request(text, 10, greedy())).remove(0);
    let greedy_score = rescored(&req.prompt, &greedy_choice, 1.0);
    assert!(
        scores[0] >= greedy_score - 1e-5,
        "{} < greedy {greedy_score}",
        scores[0]
    );
}

/// With end tokens allowed, hypotheses end at different lengths: a length penalty of 0 ranks
/// by the plain sum of logprobs, which favours a short one on this prompt; a large penalty
/// divides by len^4 and puts a long one first.
#[test]
fn length_penalty_changes_the_ranking() {
    let e = default_engine();
    let mut best = Vec::new();
    for penalty in [0.0f32, 4.0] {
        let mut req = beam_request("yes no good day", 3, 8, penalty);
        req.stopping.ignore_eos = false;
        let out = run(&e, req.clone());
        let scores: Vec<f64> = out
            .iter()
            .map(|c| rescored(&req.prompt, c, penalty))
            .collect();
        for w in scores.windows(2) {
            assert!(w[0] >= w[1] - 1e-5, "penalty {penalty}: {scores:?}");
        }
        for c in &out {
            match c.reason {
                Some(FinishReason::Stop) => {
                    assert!(matches!(c.stop_reason, Some(StopReason::Token(_))))
                }
                _ => assert_eq!(c.ids.len(), 8),
            }
        }
        best.push(out.into_iter().next().expect("a result"));
    }
    assert_eq!(best[0].reason, Some(FinishReason::Stop));
    assert!(best[0].ids.len() < 8, "{:?}", best[0].ids);
    assert_eq!(best[1].ids.len(), 8, "{:?}", best[1].ids);
}

#[test]
fn dropping_a_beam_search_receiver_cancels_it() {
    let e = default_engine();
    let rx = e
        .submit(beam_request("the cat", 4, 1500, 1.0))
        .expect("submit");
    wait_stats(&e, |s| s.steps > 5);
    drop(rx);
    wait_idle(&e);
    let steps = e.stats().steps;
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(e.stats().steps, steps);
    assert!(steps < 1000);
}

/// A beam search preempted by a better-ranked request replays every live beam's cache and ends
/// with the same beams as alone.
#[test]
fn preempted_beam_search_gives_the_same_beams() {
    let mut req = beam_request("the dog sat on the", 3, 300, 1.0);
    req.priority = 5;
    let alone = run(&default_engine(), req.clone());
    let config = EngineConfig {
        max_batch_tokens: 256,
        max_running: 3,
        max_model_len: 2048,
        ..EngineConfig::default()
    };
    let urgent = request("hello there", 3, greedy());
    let (_, preempted, _) = run_preempted(config, &req, |s| s.steps > 3, &urgent);
    for (a, b) in alone.iter().zip(&preempted) {
        assert_eq!(a.ids, b.ids);
        assert_eq!(a.reason, b.reason);
    }
}

// Speculative decoding by prompt lookup: drafts change the number of steps, never the output.

/// An engine drafting up to `k` tokens per step by prompt lookup (0 = off).
fn engine_with_drafts(k: usize) -> Engine {
    engine(EngineConfig {
        max_batch_tokens: 256,
        max_running: 16,
        max_model_len: 2048,
        prompt_lookup_tokens: k,
        ..EngineConfig::default()
    })
}

/// A prompt asking to echo a repetitive text: greedy output of the tiny random model loops
/// over the prompt's patterns, which prompt lookup drafts.
const ECHO: &str =
    "repeat: the cat sat on the mat. the cat sat on the mat. the cat sat on the mat. \
    the cat sat on the mat. the cat sat on the mat.";

/// Runs `req` on an engine drafting up to 5 tokens and on one without drafts; returns both
/// outputs and the drafting engine's counters.
fn with_and_without_drafts(req: &GenerationRequest) -> (Vec<Choice>, Vec<Choice>, EngineStats) {
    let on = engine_with_drafts(5);
    let with = run(&on, req.clone());
    let stats = wait_idle(&on);
    let without = run(&engine_with_drafts(0), req.clone());
    (with, without, stats)
}

/// Everything a client sees of a choice, but the prefix-cache hit (the engines share the
/// model's pool).
fn assert_same_output(with: &[Choice], without: &[Choice]) {
    assert_eq!(with.len(), without.len());
    for (i, (a, b)) in with.iter().zip(without).enumerate() {
        assert_eq!(a.ids, b.ids, "choice {i}: ids");
        assert_eq!(a.token_texts, b.token_texts, "choice {i}: streamed pieces");
        assert_eq!(a.text, b.text, "choice {i}: text");
        assert_eq!(a.reason, b.reason, "choice {i}: finish reason");
        assert_eq!(a.stop_reason, b.stop_reason, "choice {i}: stop reason");
        assert_eq!(a.completion_tokens, b.completion_tokens, "choice {i}");
        assert_eq!(a.logprobs, b.logprobs, "choice {i}: logprobs");
    }
}

#[test]
fn drafts_leave_greedy_output_unchanged_and_save_steps() {
    let req = request(ECHO, 64, greedy());
    let (with, without, s) = with_and_without_drafts(&req);
    eprintln!("{s:?}");
    assert_same_output(&with, &without);
    assert_eq!(with[0].ids.len(), 64);
    // The same as calling the model one token at a time.
    assert_eq!(with[0].ids, greedy_loop(&req.prompt, 64, None).0);
    assert!(s.accepted_tokens > 0, "{s:?}");
    assert!(s.accepted_tokens <= s.drafted_tokens, "{s:?}");
    // One prefill step, then fewer decode steps than tokens: each accepted draft saved one.
    assert_eq!(s.steps, 1 + 63 - s.accepted_tokens, "{s:?}");
    let prefilled = req.prompt.len() - with[0].cached_tokens;
    // Each decode step fed its input token and its drafts.
    assert_eq!(
        s.tokens,
        (prefilled + 63) as u64 - s.accepted_tokens + s.drafted_tokens,
        "{s:?}"
    );
}

#[test]
fn drafts_leave_seeded_sampling_unchanged() {
    let mut accepted = 0;
    for (seed, temperature) in [(1, 0.3), (2, 0.6), (3, 1.0)] {
        let req = request(
            ECHO,
            48,
            SamplingParams {
                temperature,
                seed: Some(seed),
                ..SamplingParams::default()
            },
        );
        let (with, without, s) = with_and_without_drafts(&req);
        eprintln!("seed {seed} temperature {temperature}: {s:?}");
        assert_same_output(&with, &without);
        accepted += s.accepted_tokens;
    }
    assert!(accepted > 0);
}

#[test]
fn drafts_leave_n_choices_stop_strings_and_logprobs_unchanged() {
    let mut req = GenerationRequest {
        n: 2,
        logprobs: Some(3),
        ..request(
            ECHO,
            40,
            SamplingParams {
                temperature: 0.4,
                seed: Some(9),
                ..SamplingParams::default()
            },
        )
    };
    // A stop string first found in the second half of choice 1's text.
    let base = run(&engine_with_drafts(0), req.clone());
    let text = &base[1].text;
    let stop = (text.len() / 2..text.len())
        .filter(|&i| text.is_char_boundary(i))
        .find_map(|i| {
            let w: String = text[i..].chars().take(3).collect();
            let plain = w.chars().all(|c| c.is_ascii_alphanumeric() || c == ' ');
            (plain && w.len() == 3 && text.find(&w) == Some(i)).then_some(w)
        })
        .expect("a stop string");
    for include in [false, true] {
        req.stopping.stop = vec![stop.clone()];
        req.stopping.include_stop_str_in_output = include;
        let (with, without, s) = with_and_without_drafts(&req);
        eprintln!(
            "{s:?} {:?}",
            with.iter().map(|c| &c.reason).collect::<Vec<_>>()
        );
        assert_same_output(&with, &without);
        assert_eq!(with[1].stop_reason, Some(StopReason::Text(stop.clone())));
        assert!(with.iter().all(|c| c.logprobs.len() == c.ids.len()));
        assert!(s.accepted_tokens > 0, "{s:?}");
    }
}

#[test]
fn drafts_never_exceed_max_tokens() {
    let e = engine_with_drafts(8);
    let off = engine_with_drafts(0);
    for max_tokens in 1..=10 {
        let req = request(ECHO, max_tokens, greedy());
        let with = run(&e, req.clone());
        assert_eq!(with[0].ids.len(), max_tokens);
        assert_eq!(with[0].reason, Some(FinishReason::Length));
        assert_same_output(&with, &run(&off, req));
    }
    let s = wait_idle(&e);
    assert!(s.accepted_tokens > 0, "{s:?}");
}

#[test]
fn drafts_leave_min_tokens_stop_tokens_eos_and_repetition_detection_unchanged() {
    let base = run(&engine_with_drafts(0), request(ECHO, 40, greedy())).remove(0);
    // The token greedy output loops on: it is drafted, masked by min_tokens (so those drafts
    // are rejected), then stops generation.
    let stop_id = *base.ids.last().expect("tokens");
    let mut req = request(ECHO, 40, greedy());
    req.stopping.stop_token_ids = vec![stop_id];
    req.stopping.min_tokens = 12;
    req.stopping.ignore_eos = false;
    let (with, without, s) = with_and_without_drafts(&req);
    assert_same_output(&with, &without);
    assert!(with[0].ids.len() > 12);
    assert!(s.drafted_tokens > 0, "{s:?}");

    // A stop token first generated late, after drafts were accepted.
    let sampled = |stop: Vec<u32>| {
        let mut req = request(
            ECHO,
            48,
            SamplingParams {
                temperature: 0.3,
                seed: Some(1),
                ..SamplingParams::default()
            },
        );
        req.stopping.stop_token_ids = stop;
        req.stopping.ignore_eos = false;
        req
    };
    let base = run(&engine_with_drafts(0), sampled(vec![])).remove(0);
    let (first, &late) = base
        .ids
        .iter()
        .enumerate()
        .rfind(|&(i, t)| base.ids.iter().position(|x| x == t) == Some(i))
        .expect("tokens");
    let (with, without, s) = with_and_without_drafts(&sampled(vec![late]));
    assert_same_output(&with, &without);
    assert_eq!(with[0].ids, base.ids[..=first].to_vec());
    assert_eq!(with[0].stop_reason, Some(StopReason::Token(late)));
    assert!(s.accepted_tokens > 0, "{s:?}");

    let mut req = request(ECHO, 40, greedy());
    req.stopping.repetition_detection = Some(RepetitionDetection {
        min_pattern_size: 2,
        max_pattern_size: 8,
        min_count: 3,
    });
    let (with, without, s) = with_and_without_drafts(&req);
    eprintln!("repetition: {s:?} {:?}", with[0].reason);
    assert_same_output(&with, &without);
}

#[test]
fn drafts_fit_the_step_token_budget() {
    let e = engine(EngineConfig {
        max_batch_tokens: 3,
        max_running: 4,
        max_model_len: 2048,
        prompt_lookup_tokens: 5,
        ..EngineConfig::default()
    });
    let req = request(ECHO, 40, greedy());
    let with = run(&e, req.clone());
    let s = wait_idle(&e);
    assert_same_output(&with, &run(&engine_with_drafts(0), req));
    assert!(s.accepted_tokens > 0, "{s:?}");
    assert!(s.tokens <= 3 * s.steps, "{s:?}");
}

#[test]
fn drafts_in_a_tight_kv_pool_leave_output_unchanged() {
    let texts = [
        ECHO,
        "again: one two three one two three one two three one two three",
    ];
    let reqs: Vec<GenerationRequest> = texts.iter().map(|t| request(t, 40, greedy())).collect();
    let off = engine_with_drafts(0);
    let want: Vec<Vec<Choice>> = reqs.iter().map(|r| run(&off, r.clone())).collect();
    // Blocks each request holds at its longest: all of them, one fewer (one request waits or is
    // preempted), a few more (drafts get what is spare).
    let blocks: usize = reqs
        .iter()
        .map(|r| (r.prompt.len() + 40 - 1).div_ceil(temper_model::BLOCK_TOKENS))
        .sum();
    for pool in [blocks - 1, blocks, blocks + 2] {
        let e = engine_with_kv_blocks(
            pool,
            EngineConfig {
                prompt_lookup_tokens: 5,
                ..EngineConfig::default()
            },
        );
        let rxs: Vec<_> = reqs
            .iter()
            .map(|r| e.submit(r.clone()).expect("submit"))
            .collect();
        for (rx, want) in rxs.into_iter().zip(&want) {
            assert_same_output(&collect(rx, 1), want);
        }
        let s = wait_idle(&e);
        eprintln!("pool {pool}: {s:?}");
        assert!(s.accepted_tokens > 0, "{s:?}");
    }
}
