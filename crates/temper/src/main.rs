//! The `temper` binary: configuration → served models → HTTP server. Nothing else lives here.

mod bandwidth;
mod bench;
mod config;
mod export;
mod keys;

use std::io::IsTerminal;
use std::net::{SocketAddr, ToSocketAddrs};
use std::process::ExitCode;
use std::sync::Arc;

use clap::{Parser, Subcommand};
use temper_catalog::{BaseModel, Catalog, CatalogOptions};
use temper_http::{
    AppState, ModelSpec, ServedModel, ServerOptions, TrainingOptions, TrainingService,
};
use temper_store::StoreLocation;

use config::{Config, ServeArgs};

#[derive(Parser)]
#[command(
    name = "temper",
    version,
    about = "OpenAI/vLLM-compatible chat completions from local models"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve chat completions over HTTP.
    Serve(Box<ServeArgs>),
    /// Measure prompt and decode throughput, structured outputs and training on this host and print a table (`make bench-compare` puts llama.cpp next to it).
    Bench(bench::BenchArgs),
    /// Create, list and revoke team API keys (stored in the data directory).
    Keys(keys::KeysArgs),
    /// Write a trained checkpoint's adapter for other tools: PEFT files, a llama.cpp LoRA GGUF,
    /// or the base GGUF with the adapter merged in.
    Export(Box<export::ExportArgs>),
}

fn main() -> ExitCode {
    keep_large_buffers_in_the_heap();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    let result = match Cli::parse().command {
        Command::Serve(args) => temper_model::selected_isa().and_then(|_| serve(*args)),
        Command::Bench(args) => temper_model::selected_isa()
            .and_then(|_| bench::run(args, temper_model::paths::default_model_path())),
        Command::Keys(args) => keys::run(args),
        Command::Export(args) => temper_model::selected_isa().and_then(|_| export::run(*args)),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("temper: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Every engine step allocates and frees buffers of megabytes (the LM head's logits: 1 MB per
/// row). Above glibc's mmap threshold each one is a fresh mapping whose pages fault in zeroed,
/// which cost ~4% of a 16-client decode's CPU time in sys time and page clearing; from the heap
/// they are reused. The trim threshold lets an arena keep that much free memory instead of
/// handing it back after every step (the training worker still trims after each job). One
/// arena for every thread: the trainer's parallel parts (the attention backward's tiles)
/// allocate megabytes on the pool's threads, and an arena per thread each kept its own free
/// memory: Qwen3-0.6B's training step peaked at 4.6 GiB instead of 3.7 GiB, and it and
/// decoding were no slower with one arena (`temper bench`, alternated).
fn keep_large_buffers_in_the_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes allocator settings, before any thread is started.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 64 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 128 << 20);
        libc::mallopt(libc::M_ARENA_MAX, 1);
    }
}

fn serve(args: ServeArgs) -> Result<(), String> {
    let file = match &args.config {
        Some(path) => config::read_file(path).map_err(|e| e.to_string())?,
        None => config::FileConfig::default(),
    };
    let cfg = config::resolve(args, file, &config::temper_home()).map_err(|e| e.to_string())?;
    // One server per data directory, locked before the store is touched: with the SQLite store
    // in it, a second server must neither migrate the store nor re-queue (as crashed) the first
    // one's running job; with a PostgreSQL store, servers share the database but each keeps
    // its own data directory (its adapter files). Held until the process exits (declared
    // before the runtime, so dropped after it and its blocking threads, the trainer's
    // included); the OS releases it however the process ends.
    let _lock = temper_store::DataDirLock::acquire(&cfg.data_dir).map_err(|e| e.to_string())?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("starting the runtime: {e}"))?;

    // An API process serves each model with an engine; a worker only trains on their weights.
    let mut served = Vec::new();
    let mut base_models = Vec::new();
    for (name, path) in &cfg.models {
        if !path.exists() {
            return Err(format!(
                "model file {} (for `{name}`) does not exist; `scripts/fetch-model.sh` fetches \
                 the default model",
                path.display()
            ));
        }
        tracing::info!(model = %name, path = %path.display(), "loading");
        if cfg.role.serves_api() {
            let model =
                ServedModel::load(&model_spec(&cfg, name, path)).map_err(|e| e.to_string())?;
            tracing::info!(
                model = %name,
                max_model_len = model.max_model_len,
                weights_mb = model.model.decode_weight_bytes() >> 20,
                kv_cache_mb = cfg.kv_cache_bytes >> 20,
                kernels = temper_model::selected_isa().unwrap_or("?"),
                "loaded"
            );
            base_models.push(model.base.clone());
            served.push(model);
        } else {
            let base = BaseModel::load(name, path, cfg.chat_template.as_deref())
                .map_err(|e| e.to_string())?;
            tracing::info!(model = %name, "loaded for training");
            base_models.push(Arc::new(base));
        }
    }
    let catalog = runtime
        .block_on(Catalog::open(
            base_models,
            &CatalogOptions {
                data_dir: cfg.data_dir.clone(),
                artifacts: cfg.artifacts.clone(),
                store: cfg.store.clone(),
                adapter_cache_bytes: cfg.adapter_cache_bytes,
            },
        ))
        .map_err(|e| e.to_string())?;
    let catalog = Arc::new(catalog);
    let training = runtime
        .block_on(TrainingService::open(
            TrainingOptions {
                job_lease: cfg.job_lease,
                worker_id: cfg.worker_id.clone(),
                max_body_bytes: cfg.max_training_body_bytes,
                lora_rank: cfg.lora_rank,
                lora_alpha: cfg.lora_alpha,
                max_seq_len: cfg.max_train_seq_len,
                max_job_attempts: cfg.max_job_attempts,
                max_queued_jobs_per_team: cfg.max_queued_jobs_per_team,
                trainer_threads: cfg.trainer_threads,
            },
            catalog.clone(),
        ))
        .map_err(|e| e.to_string())?;
    let training = Arc::new(training);
    let store_keys = runtime
        .block_on(training.store.has_active_keys())
        .map_err(|e| format!("reading the store's keys: {e}"))?;
    // A worker's HTTP answers /health only: nothing to protect with a key.
    let addrs = bind_addresses(&cfg, store_keys || !cfg.role.serves_api())?;
    let names: Vec<String> = cfg.models.iter().map(|(name, _)| name.clone()).collect();
    let state = if cfg.role.serves_api() {
        let state = AppState::with_catalog(
            served,
            ServerOptions {
                api_keys: cfg.api_keys.clone(),
                // Once reachable from the network, never open: not even after the last store key
                // is revoked.
                require_key: addrs.iter().any(|a| !a.ip().is_loopback()),
                trust_request_chat_template: cfg.trust_request_chat_template,
                enable_tool_calls: cfg.enable_tool_calls,
                max_body_bytes: cfg.max_body_bytes,
                max_logprobs: cfg.max_logprobs,
                max_n: cfg.max_n,
                max_requests_per_team: cfg.max_requests_per_team,
                ..ServerOptions::default()
            },
            catalog,
            Some(training.clone()),
        )
        .map_err(|e| e.to_string())?;
        Some(state)
    } else {
        None
    };
    let app = state
        .clone()
        .map_or_else(temper_http::worker_router, temper_http::router);

    let shutdown_timeout = cfg.shutdown_timeout;
    let ended = runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind(addrs.as_slice())
            .await
            .map_err(|e| format!("binding {}:{}: {e}", cfg.host, cfg.port))?;
        let local = listener
            .local_addr()
            .map_err(|e| format!("reading the bound address: {e}"))?;
        // Before the banner: from then on a signal is a graceful shutdown.
        let mut signals = ShutdownSignals::listen()?;
        // Only a process that runs jobs starts the trainer's threads.
        let worker = match cfg.role.runs_jobs() {
            true => Some(training.spawn_worker()?),
            false => None,
        };
        print_banner(&cfg, local, &names, store_keys);
        let (stop_accepting, accepting_stopped) = tokio::sync::oneshot::channel::<()>();
        let mut server = tokio::spawn(temper_http::serve_router(listener, app, async {
            let _ = accepting_stopped.await;
        }));
        let signal = tokio::select! {
            signal = signals.next() => signal,
            served = &mut server => {
                return Err(match served {
                    Ok(Ok(())) => "the server stopped on its own".to_owned(),
                    Ok(Err(e)) => format!("serving: {e}"),
                    Err(e) => format!("the server task failed: {e}"),
                });
            }
        };
        tracing::info!(
            signal = signal.name,
            timeout_s = shutdown_timeout.as_secs(),
            "shutting down: no new connections, in-flight requests finish, the training job \
             stops at its next step; a second signal exits at once"
        );
        let _ = stop_accepting.send(());
        // Only a process that runs jobs has any of its own to stop and put back.
        let worker_training = worker.is_some().then_some(&training);
        if let Some(training) = worker_training {
            training.begin_shutdown();
        }
        let stop_training = async {
            let Some(worker) = worker else { return };
            if let Err(e) = worker.await {
                tracing::error!(error = %e, "the training worker failed");
            }
            // At once, not after the streams: a second signal then finds the job queued.
            training.requeue_at_shutdown().await;
        };
        let drain = async {
            let drained = tokio::time::timeout(shutdown_timeout, async {
                match tokio::join!(server, stop_training).0 {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => tracing::error!(error = %e, "serving"),
                    Err(e) => tracing::error!(error = %e, "the server task failed"),
                }
            })
            .await
            .is_ok();
            if !drained {
                // A trainer still in its step: its job is re-queued all the same.
                if let Some(training) = worker_training {
                    training.requeue_at_shutdown().await;
                }
            }
            // The usage of the requests that ended, not yet written.
            if let Some(meter) = state.as_ref().and_then(|s| s.usage_meter()) {
                if let Err(e) = meter.flush().await {
                    tracing::error!(error = %e, "writing usage at shutdown");
                }
            }
            drained
        };
        Ok(tokio::select! {
            drained = drain => if drained { Shutdown::Drained } else { Shutdown::TimedOut },
            signal = signals.next() => Shutdown::Interrupted(signal),
        })
    })?;
    match ended {
        Shutdown::Drained => {
            tracing::info!("shut down");
            Ok(())
        }
        // `exit`, not a return: dropping the runtime would wait for the trainer's thread.
        Shutdown::TimedOut => {
            eprintln!(
                "temper: the shutdown timeout ({} s) passed with requests or a training step \
                 still running: exiting without them",
                shutdown_timeout.as_secs()
            );
            std::process::exit(1)
        }
        Shutdown::Interrupted(signal) => {
            eprintln!("temper: a second signal ({}): exiting at once", signal.name);
            std::process::exit(signal.exit_code)
        }
    }
}

/// How to load a served model: the file's path and the engine's settings from the config.
fn model_spec(cfg: &Config, name: &str, path: &std::path::Path) -> ModelSpec {
    let mut spec = ModelSpec::new(name, path);
    spec.chat_template = cfg.chat_template.clone();
    spec.max_model_len = cfg.max_model_len;
    if let Some(n) = cfg.max_running {
        spec.engine.max_running = n;
    }
    if let Some(n) = cfg.max_batch_tokens {
        spec.engine.max_batch_tokens = n;
    }
    if let Some(n) = cfg.max_waiting {
        spec.engine.max_waiting = n;
    }
    spec.engine.scheduling = cfg.scheduling;
    spec.engine.prompt_lookup_tokens = cfg.prompt_lookup_tokens;
    spec.engine.kv_cache_bytes = cfg.kv_cache_bytes;
    spec
}

/// How the graceful shutdown after the first signal ended.
enum Shutdown {
    /// Every request finished and the training job stopped within the timeout.
    Drained,
    /// The timeout passed first.
    TimedOut,
    /// A second signal came first.
    Interrupted(ReceivedSignal),
}

struct ReceivedSignal {
    name: &'static str,
    /// What a process killed by the signal reports (128 + its number).
    exit_code: i32,
}

/// SIGINT (Ctrl-C) and SIGTERM: once listened to, they no longer kill the process but are
/// delivered here, the first to start a graceful shutdown, the second to end it at once.
struct ShutdownSignals {
    #[cfg(unix)]
    interrupt: tokio::signal::unix::Signal,
    #[cfg(unix)]
    terminate: tokio::signal::unix::Signal,
}

impl ShutdownSignals {
    #[cfg(unix)]
    fn listen() -> Result<Self, String> {
        use tokio::signal::unix::{signal, SignalKind};
        let listen = |kind, name| signal(kind).map_err(|e| format!("listening for {name}: {e}"));
        Ok(ShutdownSignals {
            interrupt: listen(SignalKind::interrupt(), "SIGINT")?,
            terminate: listen(SignalKind::terminate(), "SIGTERM")?,
        })
    }

    #[cfg(not(unix))]
    fn listen() -> Result<Self, String> {
        Ok(ShutdownSignals {})
    }

    #[cfg(unix)]
    async fn next(&mut self) -> ReceivedSignal {
        tokio::select! {
            _ = self.interrupt.recv() => ReceivedSignal { name: "SIGINT", exit_code: 130 },
            _ = self.terminate.recv() => ReceivedSignal { name: "SIGTERM", exit_code: 143 },
        }
    }

    #[cfg(not(unix))]
    async fn next(&mut self) -> ReceivedSignal {
        if let Err(e) = tokio::signal::ctrl_c().await {
            tracing::error!(error = %e, "cannot listen for ctrl-c");
            std::future::pending::<()>().await;
        }
        ReceivedSignal {
            name: "ctrl-c",
            exit_code: 130,
        }
    }
}

/// Resolves the host; without a key (none given, none active in the store) only loopback
/// addresses are allowed, so an unauthenticated server is never reachable from the network.
fn bind_addresses(cfg: &Config, store_keys: bool) -> Result<Vec<SocketAddr>, String> {
    let addrs: Vec<SocketAddr> = (cfg.host.as_str(), cfg.port)
        .to_socket_addrs()
        .map_err(|e| format!("resolving --host {}: {e}", cfg.host))?
        .collect();
    if addrs.is_empty() {
        return Err(format!("--host {} resolves to no address", cfg.host));
    }
    if cfg.api_keys.is_empty() && !store_keys && addrs.iter().any(|a| !a.ip().is_loopback()) {
        return Err(format!(
            "refusing to serve on non-loopback address {} without an API key: pass --api-key KEY \
             (or set TEMPER_API_KEYS), create one with `temper keys create --team T`, or bind \
             127.0.0.1",
            cfg.host
        ));
    }
    Ok(addrs)
}

/// Where the state is, for the banner: the data directory, or the PostgreSQL store (its
/// password hidden) and the data directory of the adapters.
fn state_location(cfg: &Config) -> String {
    match &cfg.store {
        StoreLocation::Sqlite(_) => cfg.data_dir.display().to_string(),
        StoreLocation::Postgres(_) => {
            format!("{}, adapters in {}", cfg.store, cfg.data_dir.display())
        }
    }
}

fn print_banner(cfg: &Config, addr: SocketAddr, names: &[String], store_keys: bool) {
    let url = format!("http://{addr}");
    if !cfg.role.serves_api() {
        println!(
            "temper worker running the training jobs of {} (health at {url}/health)",
            names.join(", ")
        );
        println!(
            "  state (models, checkpoints, jobs) in {}",
            state_location(cfg)
        );
        return;
    }
    println!("temper serving {} at {url}/v1", names.join(", "));
    println!(
        "  state (models, checkpoints, jobs, keys) in {}",
        state_location(cfg)
    );
    if !cfg.role.runs_jobs() {
        println!("  role api: training jobs are queued for the workers that share the store");
    }
    if cfg.api_keys.is_empty() && !store_keys {
        println!("  no API key configured: open to clients on this machine only");
        println!(
            "  try: curl {url}/v1/chat/completions -H 'Content-Type: application/json' \
             -d '{{\"model\": \"{}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello\"}}]}}'",
            names[0]
        );
    } else {
        println!(
            "  authenticate with `Authorization: Bearer <key>`: a --api-key key (team `default`, \
             {} given) or a `temper keys create` key",
            cfg.api_keys.len()
        );
        println!(
            "  try: curl {url}/v1/chat/completions -H \"Authorization: Bearer $KEY\" \
             -H 'Content-Type: application/json' \
             -d '{{\"model\": \"{}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello\"}}]}}'",
            names[0]
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(host: &str, keys: &[&str]) -> Config {
        let mut c = config::resolve(
            ServeArgs::default(),
            config::FileConfig::default(),
            std::path::Path::new("/h"),
        )
        .unwrap();
        c.host = host.to_owned();
        c.api_keys = keys.iter().map(|k| k.to_string()).collect();
        c
    }

    #[test]
    fn no_key_means_loopback_only() {
        assert!(bind_addresses(&cfg("127.0.0.1", &[]), false).is_ok());
        assert!(bind_addresses(&cfg("localhost", &[]), false).is_ok());
        let e = bind_addresses(&cfg("0.0.0.0", &[]), false).unwrap_err();
        assert!(e.contains("without an API key"), "{e}");
        assert!(bind_addresses(&cfg("0.0.0.0", &["k"]), false).is_ok());
        // A key in the store is a key.
        assert!(bind_addresses(&cfg("0.0.0.0", &[]), true).is_ok());
    }
}
