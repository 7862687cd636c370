//! `temper serve` configuration: flags, `TEMPER_*` environment variables and an optional TOML
//! file, resolved into one `Config` (flags > env > file > defaults).

use std::num::NonZeroUsize;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::{Args, ValueEnum};
use serde::Deserialize;
use temper_engine::Scheduling;
use temper_store::ArtifactsLocation;
use temper_store::StoreLocation;
use temper_train::TrainerThreads;

pub const DEFAULT_MODEL_NAME: &str = "gemma-3-270m";
pub use temper_model::paths::DEFAULT_MODEL_FILE;

/// Flags of `temper serve`. clap fills each from its flag, else its env variable; `None` / empty
/// means "not given", so the file and the defaults can fill in.
#[derive(Debug, Default, Args)]
pub struct ServeArgs {
    /// TOML file with the same settings (keys as the flags, with `_`; `models` and `api_keys`
    /// are lists). Flags and env variables override it.
    #[arg(long, env = "TEMPER_CONFIG", value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Address to bind [default: 127.0.0.1].
    #[arg(long, env = "TEMPER_HOST")]
    pub host: Option<String>,
    /// Port to bind [default: 8000].
    #[arg(long, env = "TEMPER_PORT")]
    pub port: Option<u16>,
    /// A model to serve, as NAME=PATH to a GGUF file (repeatable; the first answers requests
    /// without `model`) [default: gemma-3-270m=$TEMPER_HOME/models/gemma-3-270m-q4_k_m.gguf].
    #[arg(
        long = "model",
        value_name = "NAME=PATH",
        env = "TEMPER_MODELS",
        value_delimiter = ','
    )]
    pub models: Vec<String>,
    /// Accepted bearer key (repeatable; env: comma-separated). Without any key the server only
    /// binds loopback addresses.
    #[arg(
        long = "api-key",
        value_name = "KEY",
        env = "TEMPER_API_KEYS",
        value_delimiter = ',',
        hide_env_values = true
    )]
    pub api_keys: Vec<String>,
    /// Directory for server state [default: $TEMPER_HOME/data].
    #[arg(long, env = "TEMPER_DATA_DIR", value_name = "DIR")]
    pub data_dir: Option<PathBuf>,
    /// Where trained checkpoints' LoRA adapters are stored: `s3://BUCKET[/PREFIX]`, read with
    /// the AWS_* environment variables (credentials, AWS_REGION, AWS_ENDPOINT_URL, ...), shared by
    /// every server on the same store [default: DATA_DIR/adapters].
    #[arg(long, env = "TEMPER_ARTIFACTS", value_name = "URL")]
    pub artifacts: Option<String>,
    /// The store (keys, models, checkpoints, jobs) in a PostgreSQL database that several servers
    /// share, as a postgres:// URL, instead of the SQLite file in the data directory (adapters
    /// are stored where --artifacts says) [default: DIR/temper.db].
    #[arg(long, env = "TEMPER_STORE", value_name = "URL", hide_env_values = true)]
    pub store: Option<String>,
    /// Jinja chat template file for every served model, instead of the model's own.
    #[arg(long, env = "TEMPER_CHAT_TEMPLATE", value_name = "PATH")]
    pub chat_template: Option<PathBuf>,
    /// Honour a request's `chat_template` (otherwise such a request is a 400).
    #[arg(long, env = "TEMPER_TRUST_REQUEST_CHAT_TEMPLATE", num_args = 0..=1, default_missing_value = "true")]
    pub trust_request_chat_template: Option<bool>,
    /// Serve tool calls (vLLM's `--enable-auto-tool-choice`): `tool_choice` "auto", "required"
    /// or a named function, calls parsed into `tool_calls` (otherwise only "none" is accepted).
    #[arg(long, env = "TEMPER_ENABLE_TOOL_CALLS", num_args = 0..=1, default_missing_value = "true")]
    pub enable_tool_calls: Option<bool>,
    /// Longest prompt + completion, at most the model's context length [default: the model's].
    #[arg(long, env = "TEMPER_MAX_MODEL_LEN", value_name = "N")]
    pub max_model_len: Option<usize>,
    /// Largest accepted request body; larger ones get a 413 [default: 4194304].
    #[arg(long, env = "TEMPER_MAX_BODY_BYTES", value_name = "BYTES")]
    pub max_body_bytes: Option<usize>,
    /// Most `top_logprobs` a request may ask for; -1 = the whole vocabulary [default: 20].
    #[arg(
        long,
        env = "TEMPER_MAX_LOGPROBS",
        value_name = "N",
        allow_negative_numbers = true
    )]
    pub max_logprobs: Option<i64>,
    /// Most choices (`n`) per request [default: 16].
    #[arg(long, env = "TEMPER_MAX_N", value_name = "N")]
    pub max_n: Option<usize>,
    /// Most sequences decoded together per model [default: the engine's].
    #[arg(long, env = "TEMPER_MAX_RUNNING", value_name = "N")]
    pub max_running: Option<usize>,
    /// Most tokens per batched forward step: decode rows, then prompt chunks [default: 64 per
    /// compute thread, within 128..=2048].
    #[arg(long, env = "TEMPER_MAX_BATCH_TOKENS", value_name = "N")]
    pub max_batch_tokens: Option<usize>,
    /// Most new requests waiting per model; past it a 429 with Retry-After [default: 256].
    #[arg(long, env = "TEMPER_MAX_WAITING", value_name = "N")]
    pub max_waiting: Option<usize>,
    /// Most chat completion requests one team may have in flight, on all models together; past
    /// it a 429 with Retry-After; 0 = no bound [default: 128].
    #[arg(long, env = "TEMPER_MAX_REQUESTS_PER_TEAM", value_name = "N")]
    pub max_requests_per_team: Option<usize>,
    /// What this process does: `all` (serve the API and run training jobs), `api` (serve the
    /// API; jobs are only queued, for workers sharing the store) or `worker` (run the store's
    /// queued jobs; HTTP only answers /health) [default: all].
    #[arg(long, env = "TEMPER_ROLE", value_name = "ROLE")]
    pub role: Option<Role>,
    /// Waiting-queue order: `fcfs`, or `priority` (a request's lower `priority` runs first and
    /// preempts worse ones; with `fcfs` a non-zero `priority` is a 400) [default: fcfs].
    #[arg(long, env = "TEMPER_SCHEDULING", value_name = "POLICY")]
    pub scheduling: Option<SchedulingPolicy>,
    /// Speculative decoding by prompt lookup: most draft tokens per sequence and step, copied
    /// from the prompt and output after an earlier occurrence of the last tokens and verified
    /// in the same forward; the output is unchanged, echoing requests take fewer steps; 0 = off
    /// [default: 4].
    #[arg(long, env = "TEMPER_PROMPT_LOOKUP_TOKENS", value_name = "N")]
    pub prompt_lookup_tokens: Option<usize>,
    /// Largest accepted body of the training API (/v1/preview/*) [default: 67108864].
    #[arg(long, env = "TEMPER_MAX_TRAINING_BODY_BYTES", value_name = "BYTES")]
    pub max_training_body_bytes: Option<usize>,
    /// Memory for loaded LoRA adapters of trained checkpoints; the least recently used are
    /// evicted past it [default: 256].
    #[arg(long, env = "TEMPER_ADAPTER_CACHE_MB", value_name = "MB")]
    pub adapter_cache_mb: Option<usize>,
    /// Memory for each model's KV cache blocks (running requests and the prefix cache);
    /// requests wait, or are preempted, when it is full [default: an eighth of the available
    /// memory at start, between 256 and 2048].
    #[arg(long, env = "TEMPER_KV_CACHE_MB", value_name = "MB")]
    pub kv_cache_mb: Option<usize>,
    /// LoRA rank of trained adapters [default: 8].
    #[arg(long, env = "TEMPER_LORA_RANK", value_name = "R")]
    pub lora_rank: Option<usize>,
    /// LoRA alpha (the update is scaled by alpha / rank) [default: 16].
    #[arg(long, env = "TEMPER_LORA_ALPHA", value_name = "ALPHA")]
    pub lora_alpha: Option<f32>,
    /// Longest packed training sequence in tokens [default: 2048].
    #[arg(long, env = "TEMPER_MAX_TRAIN_SEQ_LEN", value_name = "N")]
    pub max_train_seq_len: Option<usize>,
    /// A training job found running at start-up after this many starts in a row, each ended by
    /// a crash or a kill, is failed instead of re-queued [default: 3].
    #[arg(long, env = "TEMPER_MAX_JOB_ATTEMPTS", value_name = "N")]
    pub max_job_attempts: Option<u32>,
    /// Most queued training jobs per team; past it a 429 with Retry-After; 0 = no bound
    /// [default: 64].
    #[arg(long, env = "TEMPER_MAX_QUEUED_JOBS_PER_TEAM", value_name = "N")]
    pub max_queued_jobs_per_team: Option<u32>,
    /// Threads of the trainer's own pool (the engine keeps the global one) [default: one per
    /// core].
    #[arg(long, env = "TEMPER_TRAIN_THREADS", value_name = "N")]
    pub train_threads: Option<usize>,
    /// How much lower the trainer threads' priority is than the server's, as a nice increment
    /// 0-19 (Linux): a running job then takes the cores decoding leaves idle [default: 19].
    #[arg(long, env = "TEMPER_TRAIN_NICE", value_name = "N")]
    pub train_nice: Option<u8>,
    /// How long a server's claim on the training job it runs lasts unless renewed (it renews
    /// it every third of that): another server re-queues the job of one that died this long
    /// after its last renewal; at least 3 [default: 30].
    #[arg(long, env = "TEMPER_JOB_LEASE_SECS", value_name = "SECONDS")]
    pub job_lease_secs: Option<u64>,
    /// This server's worker name in job leases and `training_started` events; unique among
    /// the servers sharing a store [default: <host>-<pid>-<random hex>].
    #[arg(long, env = "TEMPER_WORKER_ID", value_name = "NAME")]
    pub worker_id: Option<String>,
    /// After SIGINT or SIGTERM, the longest wait for in-flight requests to finish and the
    /// training job to stop before the process exits anyway [default: 30].
    #[arg(long, env = "TEMPER_SHUTDOWN_TIMEOUT", value_name = "SECONDS")]
    pub shutdown_timeout: Option<u64>,
}

/// The TOML file: the same settings as the flags.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    pub host: Option<String>,
    pub port: Option<u16>,
    pub models: Option<Vec<String>>,
    pub api_keys: Option<Vec<String>>,
    pub data_dir: Option<PathBuf>,
    pub artifacts: Option<String>,
    pub store: Option<String>,
    pub chat_template: Option<PathBuf>,
    pub trust_request_chat_template: Option<bool>,
    pub enable_tool_calls: Option<bool>,
    pub max_model_len: Option<usize>,
    pub max_body_bytes: Option<usize>,
    pub max_logprobs: Option<i64>,
    pub max_n: Option<usize>,
    pub max_running: Option<usize>,
    pub max_batch_tokens: Option<usize>,
    pub max_waiting: Option<usize>,
    pub max_requests_per_team: Option<usize>,
    pub role: Option<Role>,
    pub scheduling: Option<SchedulingPolicy>,
    pub prompt_lookup_tokens: Option<usize>,
    pub max_training_body_bytes: Option<usize>,
    pub adapter_cache_mb: Option<usize>,
    pub kv_cache_mb: Option<usize>,
    pub lora_rank: Option<usize>,
    pub lora_alpha: Option<f32>,
    pub max_train_seq_len: Option<usize>,
    pub max_job_attempts: Option<u32>,
    pub max_queued_jobs_per_team: Option<u32>,
    pub train_threads: Option<usize>,
    pub train_nice: Option<u8>,
    pub job_lease_secs: Option<u64>,
    pub worker_id: Option<String>,
    pub shutdown_timeout: Option<u64>,
}

/// The resolved configuration of `temper serve`.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub host: String,
    pub port: u16,
    pub models: Vec<(String, PathBuf)>,
    pub api_keys: Vec<String>,
    pub data_dir: PathBuf,
    pub artifacts: ArtifactsLocation,
    /// The SQLite file in `data_dir`, or `--store`'s PostgreSQL database.
    pub store: StoreLocation,
    pub chat_template: Option<PathBuf>,
    pub trust_request_chat_template: bool,
    pub enable_tool_calls: bool,
    pub max_model_len: Option<usize>,
    pub max_body_bytes: usize,
    /// `None` = unlimited.
    pub max_logprobs: Option<usize>,
    pub max_n: usize,
    pub max_running: Option<usize>,
    pub max_batch_tokens: Option<usize>,
    pub max_waiting: Option<usize>,
    /// `None` = no bound.
    pub max_requests_per_team: Option<usize>,
    pub role: Role,
    pub scheduling: Scheduling,
    /// Draft tokens per sequence and step; 0 = no speculative decoding.
    pub prompt_lookup_tokens: usize,
    pub max_training_body_bytes: usize,
    pub adapter_cache_bytes: usize,
    pub kv_cache_bytes: usize,
    pub lora_rank: usize,
    pub lora_alpha: f32,
    pub max_train_seq_len: usize,
    pub max_job_attempts: u32,
    /// `None` = no bound.
    pub max_queued_jobs_per_team: Option<u32>,
    pub trainer_threads: TrainerThreads,
    pub job_lease: Duration,
    /// `None`: a generated one.
    pub worker_id: Option<String>,
    pub shutdown_timeout: Duration,
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("reading config file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("config file {path}: {source}")]
    Parse {
        path: PathBuf,
        source: toml::de::Error,
    },
    #[error("--model {0:?}: expected NAME=PATH")]
    ModelSpec(String),
    #[error("--max-logprobs must be -1 (unlimited) or >= 0, got {0}")]
    MaxLogprobs(i64),
    #[error("{0} must be at least 1")]
    Zero(&'static str),
    #[error("--lora-alpha must be a positive number, got {0}")]
    LoraAlpha(f32),
    #[error("--train-nice must be 0-19, got {0}")]
    TrainNice(u8),
    #[error("{0}")]
    Artifacts(#[from] temper_store::ArtifactError),
    #[error("--store: {0}")]
    Store(temper_store::Error),
    #[error(
        "--job-lease-secs must be at least 3 (the lease is renewed every third of it), got {0}"
    )]
    JobLease(u64),
    #[error("--worker-id {0:?}: expected 1 to 128 of A-Z a-z 0-9 - _ . :")]
    WorkerId(String),
    #[error(
        "--role {0} needs a store and adapters that other servers share: --store postgres://… \
         and --artifacts s3://… (with the SQLite file and adapters in the data directory, which \
         one server locks, no other server could run its jobs or serve its checkpoints)"
    )]
    RoleNeedsSharedState(&'static str),
}

pub use temper_model::paths::temper_home;

/// `--role`: which parts of the server this process runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, ValueEnum, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// The API and the training worker (one process, today's default).
    #[default]
    All,
    /// The API only: chat completions and the training API; jobs are queued for workers.
    Api,
    /// The training worker only: runs queued jobs; no engine, no API.
    Worker,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::All => "all",
            Role::Api => "api",
            Role::Worker => "worker",
        }
    }

    pub fn serves_api(self) -> bool {
        self != Role::Worker
    }

    pub fn runs_jobs(self) -> bool {
        self != Role::Api
    }
}

/// `--scheduling` / `scheduling = "..."` (the engine's `Scheduling` stays free of clap and serde).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SchedulingPolicy {
    Fcfs,
    Priority,
}

impl SchedulingPolicy {
    fn engine(self) -> Scheduling {
        match self {
            SchedulingPolicy::Fcfs => Scheduling::Fcfs,
            SchedulingPolicy::Priority => Scheduling::Priority,
        }
    }
}

pub fn read_file(path: &Path) -> Result<FileConfig, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.to_owned(),
        source,
    })?;
    toml::from_str(&text).map_err(|source| ConfigError::Parse {
        path: path.to_owned(),
        source,
    })
}

fn parse_model(spec: &str) -> Result<(String, PathBuf), ConfigError> {
    match spec.split_once('=') {
        Some((name, path)) if !name.is_empty() && !path.is_empty() => {
            Ok((name.to_owned(), PathBuf::from(path)))
        }
        _ => Err(ConfigError::ModelSpec(spec.to_owned())),
    }
}

/// The served models `NAME=PATH`: the flags' (`--model`, `TEMPER_MODELS`), else the file's, else
/// the default model.
pub fn resolve_models(
    flags: Vec<String>,
    file: Option<Vec<String>>,
    home: &Path,
) -> Result<Vec<(String, PathBuf)>, ConfigError> {
    let models = match (flags.is_empty(), file) {
        (false, _) => flags,
        (true, Some(m)) => m,
        (true, None) => Vec::new(),
    };
    if models.is_empty() {
        return Ok(vec![(
            DEFAULT_MODEL_NAME.to_owned(),
            home.join("models").join(DEFAULT_MODEL_FILE),
        )]);
    }
    models.iter().map(|m| parse_model(m)).collect()
}

/// Flags/env (already merged by clap) over the file over the defaults.
pub fn resolve(args: ServeArgs, file: FileConfig, home: &Path) -> Result<Config, ConfigError> {
    let models = resolve_models(args.models, file.models, home)?;
    let api_keys = if args.api_keys.is_empty() {
        file.api_keys.unwrap_or_default()
    } else {
        args.api_keys
    };
    let max_logprobs = match args.max_logprobs.or(file.max_logprobs).unwrap_or(20) {
        -1 => None,
        n if n >= 0 => Some(n as usize),
        n => return Err(ConfigError::MaxLogprobs(n)),
    };
    let max_n = args.max_n.or(file.max_n).unwrap_or(16);
    if max_n == 0 {
        return Err(ConfigError::Zero("--max-n"));
    }
    let max_body_bytes = args
        .max_body_bytes
        .or(file.max_body_bytes)
        .unwrap_or(4 << 20);
    if max_body_bytes == 0 {
        return Err(ConfigError::Zero("--max-body-bytes"));
    }
    let positive = |v: Option<usize>, default: usize, name: &'static str| match v.unwrap_or(default)
    {
        0 => Err(ConfigError::Zero(name)),
        n => Ok(n),
    };
    let max_training_body_bytes = positive(
        args.max_training_body_bytes
            .or(file.max_training_body_bytes),
        64 << 20,
        "--max-training-body-bytes",
    )?;
    let lora_rank = positive(args.lora_rank.or(file.lora_rank), 8, "--lora-rank")?;
    let max_train_seq_len = positive(
        args.max_train_seq_len.or(file.max_train_seq_len),
        2048,
        "--max-train-seq-len",
    )?;
    let max_job_attempts = args.max_job_attempts.or(file.max_job_attempts).unwrap_or(3);
    if max_job_attempts == 0 {
        return Err(ConfigError::Zero("--max-job-attempts"));
    }
    let lora_alpha = args.lora_alpha.or(file.lora_alpha).unwrap_or(16.0);
    if !(lora_alpha.is_finite() && lora_alpha > 0.0) {
        return Err(ConfigError::LoraAlpha(lora_alpha));
    }
    let adapter_cache_mb = args
        .adapter_cache_mb
        .or(file.adapter_cache_mb)
        .unwrap_or(256);
    let default_trainer = TrainerThreads::default();
    let train_threads = positive(
        args.train_threads.or(file.train_threads),
        default_trainer.threads.get(),
        "--train-threads",
    )?;
    let train_nice = args
        .train_nice
        .or(file.train_nice)
        .unwrap_or(default_trainer.nice);
    if train_nice > 19 {
        return Err(ConfigError::TrainNice(train_nice));
    }
    let data_dir = args
        .data_dir
        .or(file.data_dir)
        .unwrap_or_else(|| home.join("data"));
    let store = match args.store.or(file.store) {
        Some(url) => StoreLocation::parse_url(&url).map_err(ConfigError::Store)?,
        None => StoreLocation::Sqlite(data_dir.clone()),
    };
    let job_lease = args.job_lease_secs.or(file.job_lease_secs).unwrap_or(30);
    if job_lease < 3 {
        return Err(ConfigError::JobLease(job_lease));
    }
    let worker_id = args.worker_id.or(file.worker_id);
    if let Some(id) = &worker_id {
        let ok = (1..=128).contains(&id.len())
            && id
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b':'));
        if !ok {
            return Err(ConfigError::WorkerId(id.clone()));
        }
    }
    let artifacts = match args.artifacts.or(file.artifacts) {
        Some(url) => url.parse()?,
        None => ArtifactsLocation::DataDir,
    };
    let role = args.role.or(file.role).unwrap_or_default();
    let shared = matches!(store, StoreLocation::Postgres(_))
        && matches!(artifacts, ArtifactsLocation::S3 { .. });
    if role != Role::All && !shared {
        return Err(ConfigError::RoleNeedsSharedState(role.as_str()));
    }
    let kv_cache_mb = args.kv_cache_mb.or(file.kv_cache_mb);
    if kv_cache_mb == Some(0) {
        return Err(ConfigError::Zero("--kv-cache-mb"));
    }
    Ok(Config {
        host: args
            .host
            .or(file.host)
            .unwrap_or_else(|| "127.0.0.1".to_owned()),
        port: args.port.or(file.port).unwrap_or(8000),
        models,
        // An empty env entry (TEMPER_API_KEYS="a,,b") is not a key.
        api_keys: api_keys
            .into_iter()
            .filter(|k| !k.trim().is_empty())
            .collect(),
        data_dir,
        store,
        artifacts,
        chat_template: args.chat_template.or(file.chat_template),
        trust_request_chat_template: args
            .trust_request_chat_template
            .or(file.trust_request_chat_template)
            .unwrap_or(false),
        enable_tool_calls: args
            .enable_tool_calls
            .or(file.enable_tool_calls)
            .unwrap_or(false),
        max_model_len: args.max_model_len.or(file.max_model_len),
        max_body_bytes,
        max_logprobs,
        max_n,
        max_running: args.max_running.or(file.max_running),
        max_batch_tokens: args.max_batch_tokens.or(file.max_batch_tokens),
        max_waiting: args.max_waiting.or(file.max_waiting),
        max_requests_per_team: Some(
            args.max_requests_per_team
                .or(file.max_requests_per_team)
                .unwrap_or(128),
        )
        .filter(|&n| n > 0),
        role,
        scheduling: args
            .scheduling
            .or(file.scheduling)
            .map_or(Scheduling::Fcfs, SchedulingPolicy::engine),
        prompt_lookup_tokens: args
            .prompt_lookup_tokens
            .or(file.prompt_lookup_tokens)
            .unwrap_or_else(|| temper_engine::EngineConfig::default().prompt_lookup_tokens),
        max_training_body_bytes,
        adapter_cache_bytes: adapter_cache_mb << 20,
        kv_cache_bytes: kv_cache_mb.map_or_else(default_kv_cache_bytes, |mb| mb << 20),
        lora_rank,
        lora_alpha,
        max_train_seq_len,
        max_job_attempts,
        max_queued_jobs_per_team: Some(
            args.max_queued_jobs_per_team
                .or(file.max_queued_jobs_per_team)
                .unwrap_or(64),
        )
        .filter(|&n| n > 0),
        trainer_threads: TrainerThreads {
            threads: NonZeroUsize::new(train_threads).unwrap_or(NonZeroUsize::MIN),
            nice: train_nice,
        },
        job_lease: Duration::from_secs(job_lease),
        worker_id,
        shutdown_timeout: Duration::from_secs(
            args.shutdown_timeout
                .or(file.shutdown_timeout)
                .unwrap_or(30),
        ),
    })
}

/// An eighth of the memory available at start (`MemAvailable`), between 256 MB and 2 GB; 1 GB
/// where it cannot be read. Blocks are allocated as they are used, so an idle server holds
/// only what its prefix cache keeps.
fn default_kv_cache_bytes() -> usize {
    let available_kb = std::fs::read_to_string("/proc/meminfo").ok().and_then(|m| {
        m.lines()
            .find_map(|l| l.strip_prefix("MemAvailable:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<usize>().ok())
    });
    available_kb.map_or(1 << 30, |kb| (kb * 1024 / 8).clamp(256 << 20, 2 << 30))
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        serve: ServeArgs,
    }

    fn args(argv: &[&str]) -> ServeArgs {
        Cli::try_parse_from(std::iter::once("temper").chain(argv.iter().copied()))
            .unwrap()
            .serve
    }

    fn home() -> PathBuf {
        PathBuf::from("/h")
    }

    #[test]
    fn defaults() {
        let c = resolve(ServeArgs::default(), FileConfig::default(), &home()).unwrap();
        assert_eq!(c.host, "127.0.0.1");
        assert_eq!(c.port, 8000);
        assert_eq!(
            c.models,
            vec![(
                "gemma-3-270m".to_owned(),
                PathBuf::from("/h/models/gemma-3-270m-q4_k_m.gguf")
            )]
        );
        assert!(c.api_keys.is_empty());
        assert_eq!(c.data_dir, PathBuf::from("/h/data"));
        assert_eq!(c.artifacts, ArtifactsLocation::DataDir);
        assert_eq!(c.store, StoreLocation::Sqlite(PathBuf::from("/h/data")));
        assert_eq!(c.job_lease, Duration::from_secs(30));
        assert_eq!(c.worker_id, None);
        assert!(!c.trust_request_chat_template);
        assert!(!c.enable_tool_calls);
        assert_eq!(c.max_logprobs, Some(20));
        assert_eq!(c.max_body_bytes, 4 << 20);
        assert_eq!(c.max_training_body_bytes, 64 << 20);
        assert_eq!(c.adapter_cache_bytes, 256 << 20);
        assert!((256 << 20..=2 << 30).contains(&c.kv_cache_bytes));
        assert_eq!((c.lora_rank, c.lora_alpha), (8, 16.0));
        assert_eq!(c.max_train_seq_len, 2048);
        assert_eq!(c.max_job_attempts, 3);
        assert_eq!(c.shutdown_timeout, Duration::from_secs(30));
        assert_eq!(c.trainer_threads, TrainerThreads::default());
    }

    #[test]
    fn training_settings() {
        let file: FileConfig = toml::from_str(
            r#"
            adapter_cache_mb = 8
            kv_cache_mb = 100
            lora_rank = 4
            lora_alpha = 8.0
            max_train_seq_len = 512
            max_training_body_bytes = 1000
            max_job_attempts = 5
            shutdown_timeout = 7
            train_threads = 3
            train_nice = 4
            "#,
        )
        .unwrap();
        let c = resolve(args(&["--lora-rank", "16"]), file, &home()).unwrap();
        assert_eq!(c.adapter_cache_bytes, 8 << 20);
        assert_eq!(c.kv_cache_bytes, 100 << 20);
        assert_eq!((c.lora_rank, c.lora_alpha), (16, 8.0));
        assert_eq!(c.max_train_seq_len, 512);
        assert_eq!(c.max_training_body_bytes, 1000);
        assert_eq!(c.max_job_attempts, 5);
        assert_eq!(c.shutdown_timeout, Duration::from_secs(7));
        assert_eq!(
            (c.trainer_threads.threads.get(), c.trainer_threads.nice),
            (3, 4)
        );
        let c = resolve(
            args(&["--max-job-attempts", "1", "--shutdown-timeout", "0"]),
            FileConfig::default(),
            &home(),
        )
        .unwrap();
        assert_eq!(c.max_job_attempts, 1);
        // 0: no wait, the running job is still re-queued.
        assert_eq!(c.shutdown_timeout, Duration::ZERO);
        for bad in [
            &["--lora-rank", "0"][..],
            &["--lora-alpha", "0"],
            &["--max-train-seq-len", "0"],
            &["--max-job-attempts", "0"],
            &["--train-threads", "0"],
            &["--train-nice", "20"],
        ] {
            assert!(
                resolve(args(bad), FileConfig::default(), &home()).is_err(),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn store_job_lease_and_worker_id() {
        let file: FileConfig = toml::from_str(
            r#"
            data_dir = "/srv/temper"
            store = "postgres://temper@db/temper"
            job_lease_secs = 12
            worker_id = "node-1"
            "#,
        )
        .unwrap();
        let c = resolve(ServeArgs::default(), file, &home()).unwrap();
        assert_eq!(
            c.store,
            StoreLocation::Postgres("postgres://temper@db/temper".to_owned())
        );
        // Adapters stay in the data directory.
        assert_eq!(c.data_dir, PathBuf::from("/srv/temper"));
        assert_eq!(c.job_lease, Duration::from_secs(12));
        assert_eq!(c.worker_id.as_deref(), Some("node-1"));
        let c = resolve(
            args(&[
                "--store",
                "postgresql://a@b/c",
                "--job-lease-secs",
                "3",
                "--worker-id",
                "w2",
            ]),
            FileConfig::default(),
            &home(),
        )
        .unwrap();
        assert_eq!(
            c.store,
            StoreLocation::Postgres("postgresql://a@b/c".to_owned())
        );
        assert_eq!(c.job_lease, Duration::from_secs(3));
        assert_eq!(c.worker_id.as_deref(), Some("w2"));
        // Without --store, the SQLite file follows --data-dir.
        let c = resolve(args(&["--data-dir", "/d"]), FileConfig::default(), &home()).unwrap();
        assert_eq!(c.store, StoreLocation::Sqlite(PathBuf::from("/d")));
        for bad in [
            &["--store", "/var/lib/temper.db"][..],
            &["--job-lease-secs", "2"],
            &["--worker-id", ""],
            &["--worker-id", "a b"],
        ] {
            assert!(
                resolve(args(bad), FileConfig::default(), &home()).is_err(),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn role_from_file_and_flag() {
        let c = resolve(ServeArgs::default(), FileConfig::default(), &home()).unwrap();
        assert_eq!(c.role, Role::All);
        assert!(c.role.serves_api() && c.role.runs_jobs());
        let shared = [
            "--store",
            "postgres://u@db/temper",
            "--artifacts",
            "s3://bucket/p",
        ];
        let file: FileConfig = toml::from_str(r#"role = "worker""#).unwrap();
        let c = resolve(args(&shared), file, &home()).unwrap();
        assert!(!c.role.serves_api() && c.role.runs_jobs());
        let file: FileConfig = toml::from_str(r#"role = "worker""#).unwrap();
        let c = resolve(
            args(&[&shared[..], &["--role", "api"]].concat()),
            file,
            &home(),
        )
        .unwrap();
        assert!(c.role.serves_api() && !c.role.runs_jobs());
        assert!(Cli::try_parse_from(["temper", "--role", "trainer"]).is_err());
    }

    #[test]
    fn a_split_role_needs_a_shared_store_and_shared_adapters() {
        for argv in [
            &["--role", "api"][..],
            &["--role", "worker", "--store", "postgres://u@db/temper"],
            &["--role", "api", "--artifacts", "s3://bucket"],
        ] {
            let e = resolve(args(argv), FileConfig::default(), &home()).unwrap_err();
            assert!(
                matches!(e, ConfigError::RoleNeedsSharedState(_)),
                "{argv:?}: {e}"
            );
            assert!(e.to_string().contains("--store postgres://"), "{e}");
        }
    }

    #[test]
    fn artifacts_from_file_and_flag() {
        let file: FileConfig = toml::from_str(r#"artifacts = "s3://from-file/a""#).unwrap();
        let c = resolve(ServeArgs::default(), file, &home()).unwrap();
        let s3 = |bucket: &str, prefix: &str| ArtifactsLocation::S3 {
            bucket: bucket.into(),
            prefix: prefix.into(),
        };
        assert_eq!(c.artifacts, s3("from-file", "a"));
        let file: FileConfig = toml::from_str(r#"artifacts = "s3://from-file/a""#).unwrap();
        let c = resolve(args(&["--artifacts", "s3://flag/b/c/"]), file, &home()).unwrap();
        assert_eq!(c.artifacts, s3("flag", "b/c"));
        let err = resolve(
            args(&["--artifacts", "/mnt/adapters"]),
            FileConfig::default(),
            &home(),
        )
        .unwrap_err();
        assert!(err.to_string().contains("s3://BUCKET"), "{err}");
    }

    #[test]
    fn scheduling_from_file_and_flag() {
        let c = resolve(ServeArgs::default(), FileConfig::default(), &home()).unwrap();
        assert_eq!(c.scheduling, Scheduling::Fcfs);
        let file: FileConfig = toml::from_str(r#"scheduling = "priority""#).unwrap();
        let c = resolve(ServeArgs::default(), file, &home()).unwrap();
        assert_eq!(c.scheduling, Scheduling::Priority);
        let file: FileConfig = toml::from_str(r#"scheduling = "priority""#).unwrap();
        let c = resolve(args(&["--scheduling", "fcfs"]), file, &home()).unwrap();
        assert_eq!(c.scheduling, Scheduling::Fcfs);
        assert!(toml::from_str::<FileConfig>(r#"scheduling = "lifo""#).is_err());
        assert!(Cli::try_parse_from(["temper", "--scheduling", "lifo"]).is_err());
    }

    #[test]
    fn prompt_lookup_tokens_from_file_and_flag() {
        let c = resolve(ServeArgs::default(), FileConfig::default(), &home()).unwrap();
        assert_eq!(c.prompt_lookup_tokens, 4);
        let file: FileConfig = toml::from_str("prompt_lookup_tokens = 0").unwrap();
        let c = resolve(ServeArgs::default(), file, &home()).unwrap();
        assert_eq!(c.prompt_lookup_tokens, 0);
        let file: FileConfig = toml::from_str("prompt_lookup_tokens = 0").unwrap();
        let c = resolve(args(&["--prompt-lookup-tokens", "8"]), file, &home()).unwrap();
        assert_eq!(c.prompt_lookup_tokens, 8);
    }

    #[test]
    fn flags_override_file() {
        let file: FileConfig = toml::from_str(
            r#"
            host = "0.0.0.0"
            port = 9000
            models = ["a=/a.gguf"]
            api_keys = ["filekey"]
            max_body_bytes = 1000
            trust_request_chat_template = true
            "#,
        )
        .unwrap();
        let a = args(&[
            "--port",
            "8100",
            "--model",
            "x=/x.gguf",
            "--model",
            "y=/y.gguf",
            "--api-key",
            "k1",
            "--max-logprobs",
            "-1",
            "--trust-request-chat-template=false",
        ]);
        let c = resolve(a, file, &home()).unwrap();
        assert_eq!(c.host, "0.0.0.0"); // from the file
        assert_eq!(c.port, 8100);
        assert_eq!(
            c.models,
            vec![
                ("x".to_owned(), PathBuf::from("/x.gguf")),
                ("y".to_owned(), PathBuf::from("/y.gguf"))
            ]
        );
        assert_eq!(c.api_keys, vec!["k1"]);
        assert_eq!(c.max_body_bytes, 1000);
        assert_eq!(c.max_logprobs, None);
        assert!(!c.trust_request_chat_template);
    }

    #[test]
    fn bare_trust_flag_means_true() {
        let c = resolve(
            args(&["--trust-request-chat-template"]),
            FileConfig::default(),
            &home(),
        )
        .unwrap();
        assert!(c.trust_request_chat_template);
    }

    #[test]
    fn tool_calls_from_flag_or_file() {
        let c = resolve(
            args(&["--enable-tool-calls"]),
            FileConfig::default(),
            &home(),
        )
        .unwrap();
        assert!(c.enable_tool_calls);
        let file: FileConfig = toml::from_str("enable_tool_calls = true").unwrap();
        assert!(
            resolve(ServeArgs::default(), file, &home())
                .unwrap()
                .enable_tool_calls
        );
        let file: FileConfig = toml::from_str("enable_tool_calls = true").unwrap();
        let c = resolve(args(&["--enable-tool-calls=false"]), file, &home()).unwrap();
        assert!(!c.enable_tool_calls);
    }

    #[test]
    fn env_sits_between_flags_and_file() {
        // The only test touching these variables.
        std::env::set_var("TEMPER_MAX_N", "5");
        std::env::set_var("TEMPER_API_KEYS", "e1,e2,");
        let file = FileConfig {
            max_n: Some(3),
            api_keys: Some(vec!["f".into()]),
            ..FileConfig::default()
        };
        let c = resolve(args(&[]), file, &home()).unwrap();
        assert_eq!(c.max_n, 5);
        assert_eq!(c.api_keys, vec!["e1", "e2"]);
        let c = resolve(args(&["--max-n", "7"]), FileConfig::default(), &home()).unwrap();
        assert_eq!(c.max_n, 7);
        std::env::remove_var("TEMPER_MAX_N");
        std::env::remove_var("TEMPER_API_KEYS");
    }

    #[test]
    fn bad_values() {
        assert!(matches!(
            resolve(
                args(&["--model", "noequals"]),
                FileConfig::default(),
                &home()
            ),
            Err(ConfigError::ModelSpec(_))
        ));
        assert!(matches!(
            resolve(
                args(&["--max-logprobs", "-3"]),
                FileConfig::default(),
                &home()
            ),
            Err(ConfigError::MaxLogprobs(-3))
        ));
        assert!(toml::from_str::<FileConfig>("nonsense = 1").is_err());
    }
}
