//! `temper bench`: prompt and decode throughput of one model on this machine, structured-output
//! costs, and the LoRA trainer's step (AdamW included) and whole jobs, printed as a table of
//! temper's own figures. Speed lives here, never in tests. Hosts of one machine kind differ 2-3x
//! in speed, so figures from another host mean nothing next to these: `make bench-compare`
//! measures llama.cpp side by side in the same run.

use std::num::NonZeroUsize;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Args;
use temper_catalog::BaseModel;
use temper_engine::{
    Engine, EngineConfig, EngineStats, GenerationEvent, GenerationRequest, Grammar, GrammarMatcher,
    JsonOptions, OutputConstraint, SamplingParams, StopParams,
};
use temper_model::{Decoder, LoraAdapter, LoraConfig, PackedSequence, SeqInput};
use temper_text::{ChatTemplate, DecodeOptions, Tokenizer};
use temper_train::{
    AdamW, ExperimentalConfig, TrainEvent, TrainerConfig, TrainerPool, TrainerThreads,
    TrainingRequest,
};

#[derive(Debug, Args)]
pub struct BenchArgs {
    /// GGUF file to measure [default: the cached default model].
    #[arg(long, value_name = "PATH")]
    pub model: Option<PathBuf>,
    /// Prompt lengths measured as one prefill each.
    #[arg(long, value_delimiter = ',', default_values_t = [128, 512])]
    pub prompt_lens: Vec<usize>,
    /// Tokens generated per request in the decode measurements.
    #[arg(long, default_value_t = 128)]
    pub decode_tokens: usize,
    /// Concurrent requests in the batching measurement (compared with one alone).
    #[arg(long, default_value_t = 8)]
    pub concurrency: usize,
    /// Trainer steps measured (forward, backward and the AdamW update a job applies), as
    /// SEQUENCESxTOKENS (sequences packed into one); an empty list (`--train-shapes ''`) skips
    /// them.
    #[arg(long, value_delimiter = ',', default_values_t = ["1x1024".to_string(), "8x128".to_string()])]
    pub train_shapes: Vec<String>,
    /// Whole training jobs measured, as TRAJECTORIESxANSWER_TOKENS: one group of that many
    /// trajectories (a user question and an assistant answer of that many sampled tokens,
    /// rewards alternating 0 and 1), run like the server's job worker: tokenize_job, run_job
    /// (forward, backward, AdamW) and the checkpoint write. An empty list skips them.
    #[arg(long, value_delimiter = ',', default_values_t = ["16x30".to_string(), "8x128".to_string()])]
    pub train_jobs: Vec<String>,
    /// The training job run beside one decoding stream, as TRAJECTORIESxANSWER_TOKENS (as
    /// `--train-jobs`): decode tok/s with and without it; empty skips it.
    #[arg(long, default_value = "16x30")]
    pub decode_beside_job: String,
    /// Threads of the trainer's pool beside decoding, as `temper serve --train-threads`
    /// [default: one per core].
    #[arg(long, value_name = "N")]
    pub train_threads: Option<NonZeroUsize>,
    /// The trainer threads' nice increment beside decoding, as `temper serve --train-nice`.
    #[arg(long, value_name = "N", default_value_t = temper_train::DEFAULT_TRAIN_NICE,
          value_parser = clap::value_parser!(u8).range(0..=19))]
    pub train_nice: u8,
    /// Only the trainer rows (`--train-shapes`, `--train-jobs`), none of the serving ones: what
    /// `make bench-train-compare` runs next to PyTorch + PEFT.
    #[arg(long)]
    pub train_only: bool,
    /// Repetitions of each measurement; the best is reported.
    #[arg(long, default_value_t = 2)]
    pub repeat: usize,
}

struct Row {
    what: String,
    ours: String,
}

pub fn run(args: BenchArgs, default_model: PathBuf) -> Result<(), String> {
    let path = args.model.clone().unwrap_or(default_model);
    let started = Instant::now();
    // The server's loading path: the same template rules as `temper serve`.
    let base = BaseModel::load("bench", &path, None).map_err(|e| e.to_string())?;
    let load_time = started.elapsed();
    let template = base
        .chat_template
        .clone()
        .ok_or_else(|| format!("{} has no chat template", path.display()))?;
    let BaseModel {
        model, tokenizer, ..
    } = base;
    let repeat = args.repeat.max(1);
    let mut rows = Vec::new();

    let engine_stats = if args.train_only {
        None
    } else {
        Some(serving_rows(
            &args, &model, &tokenizer, &template, repeat, &mut rows,
        )?)
    };

    for shape in args.train_shapes.iter().filter(|s| !s.is_empty()) {
        let (seqs, len) = parse_shape(shape)?;
        let prompt = prompt_tokens(&tokenizer, len);
        return_freed_memory();
        let step = best_of(repeat, || train_step(&model, &prompt, seqs))?;
        let tok_s = step.trainable as f64 / step.wall.as_secs_f64();
        rows.push(Row {
            what: format!(
                "trainer step (forward + backward + AdamW), {seqs}x{len} tokens packed ({} \
                 trainable): {:.2} s (forward {:.2} s, AdamW {:.3} s; {:.1} CPU-s), peak RSS \
                 {:.2} GiB",
                step.trainable,
                step.wall.as_secs_f64(),
                step.forward.as_secs_f64(),
                step.optimizer.as_secs_f64(),
                step.cpu.as_secs_f64(),
                step.peak_rss_bytes as f64 / (1u64 << 30) as f64,
            ),
            ours: format!("{tok_s:.0} trainable tok/s"),
        });
    }

    for shape in args.train_jobs.iter().filter(|s| !s.is_empty()) {
        rows.push(train_job_row(&model, &tokenizer, &template, shape, repeat)?);
    }

    println!(
        "model: {} ({} layers, width {}), loaded in {:.2} s; {} thread(s), {} kernels; best of \
         {repeat}",
        path.display(),
        model.config().num_layers,
        model.config().hidden_size,
        load_time.as_secs_f64(),
        rayon::current_num_threads(),
        temper_model::selected_isa()?,
    );
    if let Some(stats) = engine_stats {
        println!(
            "engine: {} steps, most rows in one step {}",
            stats.steps, stats.max_rows_in_step
        );
    }
    println!(
        "temper's own figures on this host; `make bench-compare` measures llama.cpp next to \
         temper in one run (hosts of one machine kind differ 2-3x)"
    );
    println!();
    println!("| measurement | temper |");
    println!("|---|---|");
    for r in rows {
        println!("| {} | {} |", r.what, r.ours);
    }
    Ok(())
}

/// The prefill, decode, batching, decode-beside-training, structured-output and prompt-lookup
/// rows; returns the engine's counters.
fn serving_rows(
    args: &BenchArgs,
    model: &Arc<Decoder>,
    tokenizer: &Arc<Tokenizer>,
    template: &ChatTemplate,
    repeat: usize,
    rows: &mut Vec<Row>,
) -> Result<EngineStats, String> {
    for &len in &args.prompt_lens {
        let prompt = prompt_tokens(tokenizer, len);
        let best = best_of(repeat, || prefill(model, &prompt))?;
        let tok_s = len as f64 / best.as_secs_f64();
        rows.push(Row {
            what: format!("prompt processing, {len} tokens (one forward)"),
            ours: format!("{tok_s:.0} tok/s"),
        });
    }

    // Prompts are prefilled in one step so the decode timings below measure decoding only.
    let engine = Engine::start(
        model.clone(),
        tokenizer.clone(),
        EngineConfig {
            max_batch_tokens: 4096,
            max_running: args.concurrency.max(1),
            max_model_len: model.config().context_length,
            // Plain decoding, as llama.cpp's figures; the echo row measures drafts.
            prompt_lookup_tokens: 0,
            ..EngineConfig::default()
        },
    );
    let prompt = prompt_tokens(tokenizer, 16);
    let single = best_of(repeat, || {
        generate(&engine, &prompt, 1, exactly(args.decode_tokens), None)
    })?;
    let decode_tok_s = (args.decode_tokens - 1) as f64 / single.decode.as_secs_f64();
    rows.push(Row {
        what: format!("decode, 1 stream, {} tokens", args.decode_tokens),
        ours: format!("{decode_tok_s:.1} tok/s"),
    });
    // Batch-1 decode reads every weight once per token: its ceiling is bandwidth / bytes.
    let bytes_per_token = model.decode_weight_bytes() as f64;
    let bandwidth = crate::bandwidth::read_bytes_per_s();
    rows.push(Row {
        what: format!(
            "decode memory traffic: {:.0} MB of weights per token, host read bandwidth {:.1} GB/s",
            bytes_per_token / 1e6,
            bandwidth / 1e9
        ),
        ours: format!(
            "{:.1} GB/s ({:.0}% of the bandwidth)",
            decode_tok_s * bytes_per_token / 1e9,
            100.0 * decode_tok_s * bytes_per_token / bandwidth
        ),
    });
    let n = args.concurrency.max(1);
    let batched = best_of(repeat, || {
        generate(&engine, &prompt, n, exactly(args.decode_tokens), None)
    })?;
    let total = (n * args.decode_tokens) as f64;
    rows.push(Row {
        what: format!(
            "{n} concurrent requests x {} tokens, wall time (1 request: {:.2} s)",
            args.decode_tokens,
            single.wall.as_secs_f64()
        ),
        ours: format!(
            "{:.2} s ({:.1} tok/s total, {:.2}x the time of 1)",
            batched.wall.as_secs_f64(),
            total / batched.wall.as_secs_f64(),
            batched.wall.as_secs_f64() / single.wall.as_secs_f64()
        ),
    });
    if !args.decode_beside_job.is_empty() {
        let trainer = TrainerThreads {
            threads: args
                .train_threads
                .unwrap_or(TrainerThreads::default().threads),
            nice: args.train_nice,
        };
        rows.push(decode_beside_training_row(
            &engine,
            &prompt,
            args.decode_tokens,
            repeat,
            &TrainingBeside {
                model,
                tokenizer,
                template,
                shape: &args.decode_beside_job,
                trainer,
            },
        )?);
    }
    rows.extend(structured_output_rows(
        &engine,
        tokenizer,
        &prompt,
        args.decode_tokens,
        repeat,
        decode_tok_s,
    )?);
    let stats = engine.stats();
    drop(engine);
    let echo = format!(
        "<start_of_turn>user\nRepeat the following paragraph word for word, with no \
         comment:\n\n{ECHO_PARAGRAPH}<end_of_turn>\n<start_of_turn>model\n"
    );
    // As many tokens as the paragraph has: the echo itself.
    let echo_tokens = tokenizer.encode(ECHO_PARAGRAPH, false).len();
    rows.push(prompt_lookup_row(
        model,
        tokenizer,
        repeat,
        "greedy echo of a paragraph in a chat turn",
        &echo,
        echo_tokens,
    )?);
    rows.push(prompt_lookup_row(
        model,
        tokenizer,
        repeat,
        "greedy continuation of a story opening (little to echo)",
        STORY,
        echo_tokens,
    )?);
    Ok(stats)
}

/// A prompt of exactly `len` tokens cut from ordinary English text.
fn prompt_tokens(tokenizer: &Tokenizer, len: usize) -> Vec<u32> {
    const TEXT: &str = "The history of the city begins with a small settlement on the river, \
        where traders met to exchange grain, salt and cloth. Over the centuries the market grew \
        into a town with walls, a cathedral and a university, and its people learned to build \
        ships, print books and govern themselves through elected councils. ";
    let unit = tokenizer.encode(TEXT, false);
    unit.iter().copied().cycle().take(len).collect()
}

fn best_of<T: Timed>(repeat: usize, mut f: impl FnMut() -> Result<T, String>) -> Result<T, String> {
    let mut best: Option<T> = None;
    for _ in 0..repeat {
        let t = f()?;
        if best.as_ref().is_none_or(|b| t.key() < b.key()) {
            best = Some(t);
        }
    }
    best.ok_or_else(|| "nothing measured".to_string())
}

trait Timed {
    fn key(&self) -> Duration;
}

impl Timed for Duration {
    fn key(&self) -> Duration {
        *self
    }
}

struct Generation {
    wall: Duration,
    /// From the first token of the single stream to its last: decoding without the prefill.
    decode: Duration,
    /// Tokens received.
    tokens: usize,
}

impl Timed for Generation {
    fn key(&self) -> Duration {
        self.wall
    }
}

fn prefill(model: &Decoder, prompt: &[u32]) -> Result<Duration, String> {
    let mut cache = model.new_cache();
    let started = Instant::now();
    model
        .forward(&mut [SeqInput {
            tokens: prompt,
            cache: &mut cache,
            all_logits: false,
            adapter: None,
        }])
        .map_err(|e| format!("forward: {e}"))?;
    Ok(started.elapsed())
}

/// Exactly `tokens` tokens (an end token does not stop them).
fn exactly(tokens: usize) -> StopParams {
    StopParams {
        max_tokens: Some(tokens),
        ignore_eos: true,
        ..StopParams::default()
    }
}

/// `n` greedy requests submitted at once, each generating until `stopping` (or until the
/// grammar of `constraint` is complete).
fn generate(
    engine: &Engine,
    prompt: &[u32],
    n: usize,
    stopping: StopParams,
    constraint: Option<&Grammar>,
) -> Result<Generation, String> {
    let started = Instant::now();
    let mut receivers = Vec::with_capacity(n);
    for i in 0..n {
        let request = GenerationRequest {
            request_id: format!("bench-{i}"),
            prompt: prompt.to_vec(),
            n: 1,
            sampling: SamplingParams {
                temperature: 0.0,
                ..SamplingParams::default()
            },
            stopping: stopping.clone(),
            logprobs: None,
            adapter: None,
            constraint: constraint.cloned(),
            priority: 0,
            prompt_logprobs: None,
            beam_search: None,
            cache_salt: None,
        };
        receivers.push(engine.submit(request).map_err(|e| e.to_string())?);
    }
    let mut first_token = None;
    let mut last_token = started;
    let mut generated = 0;
    for rx in &mut receivers {
        loop {
            match rx.blocking_recv() {
                Some(GenerationEvent::Token { .. }) => {
                    generated += 1;
                    let now = Instant::now();
                    first_token.get_or_insert(now);
                    last_token = now;
                }
                Some(GenerationEvent::Finished { .. }) => break,
                Some(GenerationEvent::Error { message }) => return Err(message),
                Some(GenerationEvent::PromptLogprobs { .. }) => {}
                None => return Err("the engine stopped".into()),
            }
        }
    }
    let wall = started.elapsed();
    let decode = last_token.duration_since(first_token.unwrap_or(started));
    Ok(Generation {
        wall,
        decode,
        tokens: generated,
    })
}

/// A paragraph the echo measurement asks the model to repeat.
const ECHO_PARAGRAPH: &str = "The committee met on Tuesday to review the budget for the coming \
    year. After a long discussion, the members agreed to increase funding for the public library, \
    to repair the roads on the north side of the town, and to hire two new teachers for the \
    primary school. The proposal to build a new sports hall was postponed until the spring, when \
    more information about the costs will be available.";

/// A prompt whose continuation has little to copy from it: what drafts cost where they rarely
/// help.
const STORY: &str = "Once upon a time, in a small fishing village at the edge of a cold grey sea, \
    there lived an old lighthouse keeper named";

/// Single-stream greedy decode of `text` (special tokens parsed; the echo: a chat turn asking to
/// repeat a paragraph, which the model echoes) for `max_tokens` tokens or until the end of
/// turn, with speculative decoding by prompt lookup on (the engine's default number of drafts)
/// and off: tok/s of each, their ratio and the share of drafts accepted. The output is the same
/// both ways.
fn prompt_lookup_row(
    model: &Arc<Decoder>,
    tokenizer: &Arc<Tokenizer>,
    repeat: usize,
    what: &str,
    text: &str,
    max_tokens: usize,
) -> Result<Row, String> {
    // BOS in front where the model's vocabulary adds it (not for Qwen's).
    let mut prompt: Vec<u32> = tokenizer
        .bos_id()
        .filter(|_| tokenizer.add_bos())
        .into_iter()
        .collect();
    prompt.extend(tokenizer.encode(text, true));
    let k = EngineConfig::default().prompt_lookup_tokens;
    let mut measured = Vec::new();
    for drafts in [k, 0] {
        let engine = Engine::start(
            model.clone(),
            tokenizer.clone(),
            EngineConfig {
                max_batch_tokens: 4096,
                max_running: 1,
                max_model_len: model.config().context_length,
                prompt_lookup_tokens: drafts,
                ..EngineConfig::default()
            },
        );
        // Greedy until the end of the turn (or `max_tokens`).
        let until_end = StopParams {
            max_tokens: Some(max_tokens),
            ..StopParams::default()
        };
        let run = best_of(repeat, || {
            generate(&engine, &prompt, 1, until_end.clone(), None)
        })?;
        measured.push((run, engine.stats()));
    }
    let tok_s = |g: &Generation| g.tokens.saturating_sub(1) as f64 / g.decode.as_secs_f64();
    let (on, off) = (tok_s(&measured[0].0), tok_s(&measured[1].0));
    let stats = measured[0].1;
    Ok(Row {
        what: format!(
            "decode, 1 stream, {what} ({} tokens; {} steps with drafts, {} without), prompt \
             lookup of {k} tokens on vs off",
            measured[0].0.tokens,
            stats.steps / repeat as u64,
            measured[1].1.steps / repeat as u64,
        ),
        ours: format!(
            "{on:.1} vs {off:.1} tok/s ({:.2}x); {:.0}% of drafts accepted ({} of {})",
            on / off,
            100.0 * stats.accepted_tokens as f64 / stats.drafted_tokens.max(1) as f64,
            stats.accepted_tokens,
            stats.drafted_tokens
        ),
    })
}

/// The JSON schema of the structured-output measurements: an object with a bounded string, an
/// integer and an array of enums (the shape of a typical extraction schema).
fn bench_schema() -> serde_json::Value {
    serde_json::json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 40},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "city": {"type": "string"},
            "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}},
            "notes": {"type": "array", "items": {"type": "string"}, "minItems": 64}
        },
        "required": ["name", "age", "city", "tags", "notes"],
        "additionalProperties": false
    })
}

/// Per-token mask cost on the model's vocabulary and single-stream decode under a JSON schema.
fn structured_output_rows(
    engine: &Engine,
    tokenizer: &Tokenizer,
    prompt: &[u32],
    decode_tokens: usize,
    repeat: usize,
    free_tok_s: f64,
) -> Result<Vec<Row>, String> {
    let started = Instant::now();
    let compiler = engine.grammar_compiler().map_err(|e| e.to_string())?;
    let compiler_time = started.elapsed();
    let constraint = OutputConstraint::Json {
        schema: bench_schema(),
        options: JsonOptions::default(),
    };
    let started = Instant::now();
    let grammar = compiler.compile(&constraint).map_err(|e| e.to_string())?;
    let compile_time = started.elapsed();
    let notes: Vec<String> = (1..=64).map(|i| format!("note number {i}")).collect();
    let instance = serde_json::json!({"name": "Ada Lovelace", "age": 36, "city": "London",
        "tags": ["red", "blue"], "notes": notes})
    .to_string();
    let costs = best_of(repeat, || {
        mask_costs(grammar.matcher(), tokenizer, &instance)
    })?;
    let mut sorted = costs.per_token.clone();
    sorted.sort();
    let mean = costs.total / costs.per_token.len().max(1) as u32;
    let p99 = sorted[(sorted.len() * 99 / 100).min(sorted.len() - 1)];
    let constrained = best_of(repeat, || {
        generate(engine, prompt, 1, exactly(decode_tokens), Some(&grammar))
    })?;
    let tok_s = constrained.tokens.saturating_sub(1) as f64 / constrained.decode.as_secs_f64();
    Ok(vec![
        Row {
            what: format!(
                "structured-output mask, JSON schema, {}-token vocabulary ({} tokens; compiler built in {:.2} s, schema compiled in {:.1} ms)",
                tokenizer.vocab_size(),
                sorted.len(),
                compiler_time.as_secs_f64(),
                compile_time.as_secs_f64() * 1e3
            ),
            ours: format!(
                "{:.0} µs/token mean, {:.0} µs p99, {:.0} µs max",
                mean.as_secs_f64() * 1e6,
                p99.as_secs_f64() * 1e6,
                sorted.last().map_or(0.0, |d| d.as_secs_f64() * 1e6)
            ),
        },
        Row {
            what: format!(
                "decode, 1 stream, JSON schema ({} tokens; masks on worker threads during the forward)",
                constrained.tokens
            ),
            ours: format!(
                "{tok_s:.1} tok/s ({:.2}x unconstrained)",
                tok_s / free_tok_s
            ),
        },
    ])
}

struct MaskCosts {
    total: Duration,
    per_token: Vec<Duration>,
}

impl Timed for MaskCosts {
    fn key(&self) -> Duration {
        self.total
    }
}

/// Walks the grammar along `target`: at each step computes the mask (timed), then consumes
/// the allowed token covering the most of what is left of `target`.
fn mask_costs(
    mut matcher: GrammarMatcher,
    tokenizer: &Tokenizer,
    target: &str,
) -> Result<MaskCosts, String> {
    let mut rest = target.as_bytes();
    let mut per_token = Vec::new();
    while !rest.is_empty() && !matcher.is_stopped() {
        let started = Instant::now();
        let mask = matcher.compute_mask().map_err(|e| e.to_string())?;
        per_token.push(started.elapsed());
        let best = (0..tokenizer.vocab_size() as u32)
            .filter(|&t| mask.is_allowed(t))
            .filter_map(|t| {
                let bytes = tokenizer.token_bytes(t)?;
                (!bytes.is_empty() && rest.starts_with(&bytes)).then_some((bytes.len(), t))
            })
            .max();
        let Some((len, token)) = best else {
            return Err(format!(
                "the bench schema does not accept {:?}",
                String::from_utf8_lossy(rest)
            ));
        };
        matcher.consume(token).map_err(|e| e.to_string())?;
        rest = &rest[len..];
    }
    Ok(MaskCosts {
        total: per_token.iter().sum(),
        per_token,
    })
}

fn parse_shape(shape: &str) -> Result<(usize, usize), String> {
    let bad = || format!("train shape {shape:?}: expected SEQUENCESxTOKENS, e.g. 8x128");
    let (a, b) = shape.split_once('x').ok_or_else(bad)?;
    let (seqs, len) = (a.parse().map_err(|_| bad())?, b.parse().map_err(|_| bad())?);
    if seqs == 0 || len < 2 {
        return Err(bad());
    }
    Ok((seqs, len))
}

struct TrainStep {
    wall: Duration,
    forward: Duration,
    /// The gradient clipping and AdamW update at the step's end.
    optimizer: Duration,
    /// CPU time of the process over the step (all threads): the cost when the machine is shared.
    cpu: Duration,
    /// Scored tokens: all but each sequence's first.
    trainable: usize,
    peak_rss_bytes: u64,
}

impl Timed for TrainStep {
    fn key(&self) -> Duration {
        self.wall
    }
}

/// One training step of `seqs` copies of `prompt` packed into one sequence, every token but each
/// copy's first scored, as a job takes it: forward, backward, then the trainer's gradient
/// clipping and AdamW update of the adapter (`temper_train::apply_gradients`, the code `run_job`
/// runs). The optimizer's state is made before the clock starts, as a job makes it once; the
/// peak RSS is measured from the step's start.
fn train_step(model: &Decoder, prompt: &[u32], seqs: usize) -> Result<TrainStep, String> {
    let tokens: Vec<u32> = prompt.repeat(seqs);
    let lens = vec![prompt.len(); seqs];
    let scored: Vec<bool> = (0..tokens.len()).map(|i| i % prompt.len() != 0).collect();
    let packed = PackedSequence {
        tokens: &tokens,
        segment_lens: &lens,
        scored: &scored,
    };
    let mut adapter = LoraAdapter::new(model.config(), LoraConfig::default(), 1);
    let mut optimizer = AdamW::new(&adapter);
    let learning_rate = ExperimentalConfig::default()
        .resolve()
        .map_err(|e| format!("the default loss settings: {e}"))?
        .learning_rate;
    // Linux: writing 5 resets the peak RSS to the current RSS.
    let _ = std::fs::write("/proc/self/clear_refs", "5");
    let started = Instant::now();
    let cpu_start = process_cpu_time();
    let (scores, tape) = model
        .train_forward(&packed, &adapter)
        .map_err(|e| format!("train_forward: {e}"))?;
    let forward = started.elapsed();
    // loss = -mean logprob: training.md's loss with rho = 1, A = 1 and w = 1 (as the PyTorch
    // reference of `make bench-train-compare`).
    let dlogprobs = vec![-1.0 / scores.logprobs.len() as f32; scores.logprobs.len()];
    let grads = model
        .backward(tape, &adapter, &dlogprobs)
        .map_err(|e| format!("backward: {e}"))?;
    let backward_done = Instant::now();
    temper_train::apply_gradients(&mut optimizer, &mut adapter, &grads.grads, learning_rate, 1)
        .map_err(|e| format!("AdamW: {e}"))?;
    Ok(TrainStep {
        wall: started.elapsed(),
        forward,
        optimizer: backward_done.elapsed(),
        cpu: process_cpu_time().saturating_sub(cpu_start),
        trainable: scores.logprobs.len(),
        peak_rss_bytes: peak_rss_bytes(),
    })
}

struct TrainJob {
    wall: Duration,
    cpu: Duration,
    /// Tokens the loss was taken over (the answers' sampled tokens).
    trainable: usize,
    /// Tokens fed to the model (questions, template and answers).
    tokens: usize,
    steps: usize,
    peak_rss_bytes: u64,
}

impl Timed for TrainJob {
    fn key(&self) -> Duration {
        self.wall
    }
}

/// One `temper bench --train-jobs` row: a whole job of `shape` (TRAJECTORIESxANSWER_TOKENS).
fn train_job_row(
    model: &Decoder,
    tokenizer: &Tokenizer,
    template: &ChatTemplate,
    shape: &str,
    repeat: usize,
) -> Result<Row, String> {
    let (trajectories, answer_len) = parse_shape(shape)?;
    let request = train_job_request(tokenizer, trajectories, answer_len)?;
    let job = with_checkpoint_path(|checkpoint| {
        best_of(repeat, || {
            train_job(
                model,
                tokenizer,
                template,
                &request,
                checkpoint,
                &AtomicBool::new(false),
                &mut || {},
            )
        })
    })?;
    let secs = job.wall.as_secs_f64();
    let tok_s = job.trainable as f64 / secs;
    Ok(Row {
        what: format!(
            "training job, {trajectories} trajectories x {answer_len} answer tokens ({} tokens, \
             {} step(s)): {secs:.1} s per job = {:.1} jobs/min, {:.1} CPU-s, peak RSS {:.1} GiB",
            job.tokens,
            job.steps,
            60.0 / secs,
            job.cpu.as_secs_f64(),
            job.peak_rss_bytes as f64 / (1u64 << 30) as f64,
        ),
        ours: format!("{tok_s:.0} trainable tok/s"),
    })
}

/// The body a client would post for one group of `trajectories` answers of `answer_len` sampled
/// tokens each (cut from English text at different offsets), rewards alternating 0 and 1. The
/// sampler's logprobs are left out: the trainer then uses its own (training.md).
fn train_job_request(
    tokenizer: &Tokenizer,
    trajectories: usize,
    answer_len: usize,
) -> Result<TrainingRequest, String> {
    let text = prompt_tokens(tokenizer, answer_len + 7 * trajectories);
    let trajectories: Vec<serde_json::Value> = (0..trajectories)
        .map(|i| {
            let ids = &text[7 * i..7 * i + answer_len];
            let content: Vec<serde_json::Value> = ids
                .iter()
                .map(|id| serde_json::json!({"token": format!("token_id:{id}"), "logprob": null}))
                .collect();
            serde_json::json!({
                "messages_and_choices": [
                    {"role": "user", "content": "Tell me about the history of the city."},
                    {"message": {"role": "assistant",
                                 "content": tokenizer.decode(ids, DecodeOptions::default())},
                     "finish_reason": "length", "index": 0, "logprobs": {"content": content}}
                ],
                "reward": (i % 2) as f64
            })
        })
        .collect();
    serde_json::from_value(serde_json::json!({
        "trajectory_groups": [{"trajectories": trajectories}]
    }))
    .map_err(|e| format!("training request: {e}"))
}

/// Runs `f` with the path of a checkpoint file in a fresh directory, removed after it.
fn with_checkpoint_path<T>(
    f: impl FnOnce(&std::path::Path) -> Result<T, String>,
) -> Result<T, String> {
    let dir = std::env::temp_dir().join(format!("temper-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let result = f(&dir.join("adapter.safetensors"));
    let _ = std::fs::remove_dir_all(&dir);
    result
}

/// Runs `request` as the job worker does: tokenize_job, a fresh adapter, run_job (stopped before
/// its next step once `cancel` is set; `on_start` is called when its first step begins), the
/// checkpoint written to `checkpoint`. The peak RSS is measured from the job's start.
fn train_job(
    model: &Decoder,
    tokenizer: &Tokenizer,
    template: &ChatTemplate,
    request: &TrainingRequest,
    checkpoint: &std::path::Path,
    cancel: &AtomicBool,
    on_start: &mut dyn FnMut(),
) -> Result<TrainJob, String> {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
    let started = Instant::now();
    let cpu_start = process_cpu_time();
    let job = temper_train::tokenize_job(request, tokenizer, template)
        .map_err(|e| format!("tokenize_job: {e}"))?;
    let config = TrainerConfig::default();
    let start = LoraAdapter::new(model.config(), config.lora, 1);
    let (mut trainable, mut steps) = (0, 0);
    let trained = temper_train::run_job(model, &start, &job, &config, cancel, &mut |e| match e {
        TrainEvent::Started { .. } => on_start(),
        TrainEvent::GradientStep(m) => {
            trainable += m.num_trainable_tokens;
            steps += 1;
        }
        TrainEvent::SftStep(_) | TrainEvent::Ended { .. } => {}
    })
    .map_err(|e| format!("run_job: {e}"))?
    .ok_or("run_job learned nothing")?;
    trained
        .save(checkpoint)
        .map_err(|e| format!("saving the checkpoint: {e}"))?;
    Ok(TrainJob {
        wall: started.elapsed(),
        cpu: process_cpu_time().saturating_sub(cpu_start),
        trainable,
        tokens: job.sequences.iter().map(|s| s.tokens.len()).sum(),
        steps,
        peak_rss_bytes: peak_rss_bytes(),
    })
}

/// The training that runs beside the decoding stream of [`decode_beside_training_row`].
struct TrainingBeside<'a> {
    model: &'a Decoder,
    tokenizer: &'a Tokenizer,
    template: &'a ChatTemplate,
    /// TRAJECTORIESxANSWER_TOKENS, as `--train-jobs`.
    shape: &'a str,
    trainer: TrainerThreads,
}

/// Single-stream decode with nothing else running, then while jobs of `beside.shape` train one
/// after another on a trainer pool as the server's worker runs them (from the first job's step
/// on). The two are measured back to back: on a shared host the load of other processes drifts.
fn decode_beside_training_row(
    engine: &Engine,
    prompt: &[u32],
    decode_tokens: usize,
    repeat: usize,
    beside: &TrainingBeside,
) -> Result<Row, String> {
    let decode = || generate(engine, prompt, 1, exactly(decode_tokens), None);
    let alone = best_of(repeat, decode)?;
    let (trajectories, answer_len) = parse_shape(beside.shape)?;
    let request = train_job_request(beside.tokenizer, trajectories, answer_len)?;
    let pool = TrainerPool::new(beside.trainer)?;
    let (stop, pool, request) = (&AtomicBool::new(false), &pool, &request);
    let decode = with_checkpoint_path(|checkpoint| {
        std::thread::scope(|scope| {
            let (started_tx, started_rx) = std::sync::mpsc::channel();
            // Owns the sender: a job failing before its step ends the wait below.
            let training = scope.spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    let job = pool.install(|| {
                        train_job(
                            beside.model,
                            beside.tokenizer,
                            beside.template,
                            request,
                            checkpoint,
                            stop,
                            &mut || {
                                let _ = started_tx.send(());
                            },
                        )
                    });
                    // Cancelled once the decoding is measured.
                    if let (Err(e), false) = (job, stop.load(Ordering::Relaxed)) {
                        return Err(e);
                    }
                }
                Ok(())
            });
            let decode = started_rx
                .recv()
                .map_err(|_| "the training job beside decoding never started".to_owned())
                .and_then(|()| best_of(repeat, decode));
            stop.store(true, Ordering::Relaxed);
            training
                .join()
                .map_err(|_| "the training job beside decoding panicked".to_owned())??;
            decode
        })
    })?;
    let tok_s = |g: &Generation| (decode_tokens - 1) as f64 / g.decode.as_secs_f64();
    let (beside_tok_s, alone_tok_s) = (tok_s(&decode), tok_s(&alone));
    Ok(Row {
        what: format!(
            "decode, 1 stream, {decode_tokens} tokens, while {} training jobs run (trainer: {} \
             threads at nice {}) vs nothing else running",
            beside.shape,
            pool.threads(),
            pool.nice()
        ),
        ours: format!(
            "{beside_tok_s:.1} vs {alone_tok_s:.1} tok/s ({:.2}x)",
            beside_tok_s / alone_tok_s
        ),
    })
}

/// Hands the heap's free pages back to the system (glibc's `malloc_trim`), so that a shape's
/// peak RSS, measured from its step's start, holds none of what a larger shape before it freed
/// and the allocator kept: 3.91 GiB for Qwen3-0.6B's 16x30 step after its 8x128 one, 2.6 GiB
/// alone. The PyTorch reference does the same before each variant of a shape.
fn return_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only releases free memory; every live allocation stays as it is.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// VmHWM of this process (0 where /proc is absent).
fn peak_rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmHWM:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

/// User + system time of this process so far (zero where /proc is absent).
fn process_cpu_time() -> Duration {
    // Fields 14 and 15 of /proc/self/stat (after the parenthesised name), in clock ticks.
    const TICKS_PER_S: f64 = 100.0;
    let ticks = std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|s| {
            let rest = s.rsplit_once(')')?.1;
            let f: Vec<&str> = rest.split_whitespace().collect();
            Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
        })
        .unwrap_or(0);
    Duration::from_secs_f64(ticks as f64 / TICKS_PER_S)
}
