//! `temper bench`: prompt and decode throughput of one model on this machine, printed as a
//! table next to llama.cpp's figures for the default model (design.md). Speed lives here, never
//! in tests.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Args;
use temper_engine::{
    Engine, EngineConfig, GenerationEvent, GenerationRequest, SamplingParams, StopParams,
};
use temper_model::{Gemma3, SeqInput};
use temper_text::Tokenizer;

/// llama.cpp (commit 0c1e570, `-t 2`) on the default model, this machine kind (design.md).
const LLAMA_CPP_PROMPT_TOK_S: f64 = 1000.0;
const LLAMA_CPP_DECODE_TOK_S: f64 = 103.0;

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
    /// Repetitions of each measurement; the best is reported.
    #[arg(long, default_value_t = 2)]
    pub repeat: usize,
}

struct Row {
    what: String,
    ours: String,
    llama_cpp: String,
    ratio: String,
}

pub fn run(args: BenchArgs, default_model: PathBuf) -> Result<(), String> {
    let path = args.model.unwrap_or(default_model);
    let started = Instant::now();
    let loaded =
        temper_model::load_gguf(&path).map_err(|e| format!("loading {}: {e}", path.display()))?;
    let tokenizer = temper_text::load_tokenizer(&loaded.metadata, &path)
        .map_err(|e| format!("tokenizer of {}: {e}", path.display()))?;
    let load_time = started.elapsed();
    let model = Arc::new(loaded.model);
    let tokenizer = Arc::new(tokenizer);
    let repeat = args.repeat.max(1);
    let mut rows = Vec::new();

    for &len in &args.prompt_lens {
        let prompt = prompt_tokens(&tokenizer, len);
        let best = best_of(repeat, || prefill(&model, &prompt))?;
        let tok_s = len as f64 / best.as_secs_f64();
        rows.push(Row {
            what: format!("prompt processing, {len} tokens (one forward)"),
            ours: format!("{tok_s:.0} tok/s"),
            llama_cpp: format!("~{LLAMA_CPP_PROMPT_TOK_S:.0} tok/s"),
            ratio: format!("{:.2}x", tok_s / LLAMA_CPP_PROMPT_TOK_S),
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
        },
    );
    let prompt = prompt_tokens(&tokenizer, 16);
    let single = best_of(repeat, || generate(&engine, &prompt, 1, args.decode_tokens))?;
    let decode_tok_s = (args.decode_tokens - 1) as f64 / single.decode.as_secs_f64();
    rows.push(Row {
        what: format!("decode, 1 stream, {} tokens", args.decode_tokens),
        ours: format!("{decode_tok_s:.1} tok/s"),
        llama_cpp: format!("{LLAMA_CPP_DECODE_TOK_S:.0} tok/s"),
        ratio: format!("{:.2}x", decode_tok_s / LLAMA_CPP_DECODE_TOK_S),
    });
    let n = args.concurrency.max(1);
    let batched = best_of(repeat, || generate(&engine, &prompt, n, args.decode_tokens))?;
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
        llama_cpp: "-".into(),
        ratio: "-".into(),
    });
    let stats = engine.stats();

    println!(
        "model: {} ({} layers, width {}), loaded in {:.2} s; {} thread(s); best of {repeat}",
        path.display(),
        model.config().num_layers,
        model.config().hidden_size,
        load_time.as_secs_f64(),
        rayon::current_num_threads(),
    );
    println!(
        "engine: {} steps, most rows in one step {}",
        stats.steps, stats.max_rows_in_step
    );
    println!();
    println!("| measurement | temper | llama.cpp | temper / llama.cpp |");
    println!("|---|---|---|---|");
    for r in rows {
        println!(
            "| {} | {} | {} | {} |",
            r.what, r.ours, r.llama_cpp, r.ratio
        );
    }
    Ok(())
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
}

impl Timed for Generation {
    fn key(&self) -> Duration {
        self.wall
    }
}

fn prefill(model: &Gemma3, prompt: &[u32]) -> Result<Duration, String> {
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

/// `n` greedy requests submitted at once, each generating exactly `tokens` tokens.
fn generate(
    engine: &Engine,
    prompt: &[u32],
    n: usize,
    tokens: usize,
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
            stopping: StopParams {
                max_tokens: tokens,
                ignore_eos: true,
                ..StopParams::default()
            },
            logprobs: None,
            adapter: None,
        };
        receivers.push(engine.submit(request).map_err(|e| e.to_string())?);
    }
    let mut first_token = None;
    let mut last_token = started;
    for rx in &mut receivers {
        loop {
            match rx.blocking_recv() {
                Some(GenerationEvent::Token { .. }) => {
                    let now = Instant::now();
                    first_token.get_or_insert(now);
                    last_token = now;
                }
                Some(GenerationEvent::Finished { .. }) => break,
                Some(GenerationEvent::Error { message }) => return Err(message),
                None => return Err("the engine stopped".into()),
            }
        }
    }
    let wall = started.elapsed();
    let decode = last_token.duration_since(first_token.unwrap_or(started));
    Ok(Generation { wall, decode })
}
