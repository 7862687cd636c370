//! The training service: models, checkpoints and jobs in the store (the preview API of
//! training.md), the worker that runs queued jobs, inference names of trained checkpoints and
//! the cache of their adapters.

pub mod files;
pub mod idempotency;
pub mod lru;
pub mod names;
pub mod routes;
pub mod wire;
pub mod worker;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use temper_model::LoraAdapter;
use temper_store::{Backend, Checkpoint, Store, StoreLocation};
use temper_train::{TrainerPool, TrainerThreads};
use uuid::Uuid;

use crate::error::ApiError;
use crate::state::{AppState, ServedModel};
use lru::ByteLru;
use names::StepSelector;

/// Server settings of the training service.
#[derive(Debug, Clone)]
pub struct TrainingOptions {
    /// The adapter files live here, and by default the store.
    pub data_dir: PathBuf,
    /// The store: the SQLite file in `data_dir` (the default), or a PostgreSQL database that
    /// several servers share.
    pub store: StoreLocation,
    /// How long the worker's claim on a running job lasts unless renewed (it renews it every
    /// third of that); a server that dies loses its job to another worker this long after.
    pub job_lease: Duration,
    /// This server's worker name in job leases and events (`None`: a generated one, see
    /// [`temper_store::new_worker_id`]); unique among the servers sharing a store.
    pub worker_id: Option<String>,
    /// Largest accepted body of the training routes (trajectory groups are large).
    pub max_body_bytes: usize,
    /// Memory the cache of loaded adapters may use before it evicts the least recently used.
    pub adapter_cache_bytes: usize,
    pub lora_rank: usize,
    pub lora_alpha: f32,
    /// Longest packed training sequence, in tokens.
    pub max_seq_len: usize,
    /// A job found running at start-up after this many starts in a row (each ended by a crash
    /// or a kill) is failed instead of re-queued (at least 1).
    pub max_job_attempts: u32,
    /// Most queued jobs per team (`None`: no bound); past it a post is a 429.
    pub max_queued_jobs_per_team: Option<u32>,
    /// The trainer's own threads and their priority (below serving's).
    pub trainer_threads: TrainerThreads,
}

impl TrainingOptions {
    pub fn new(data_dir: impl Into<PathBuf>) -> Self {
        let data_dir = data_dir.into();
        TrainingOptions {
            store: StoreLocation::Sqlite(data_dir.clone()),
            data_dir,
            job_lease: Duration::from_secs(30),
            worker_id: None,
            max_body_bytes: 64 << 20,
            adapter_cache_bytes: 256 << 20,
            lora_rank: 8,
            lora_alpha: 16.0,
            max_seq_len: 2048,
            max_job_attempts: 3,
            max_queued_jobs_per_team: Some(64),
            trainer_threads: TrainerThreads::default(),
        }
    }
}

/// The store plus what the routes and the worker share.
pub struct Training {
    pub store: Store,
    /// This server's worker, as its job leases name it.
    pub worker_id: String,
    pub options: TrainingOptions,
    /// Wakes the worker when a job is queued.
    pub(crate) wake: tokio::sync::Notify,
    /// The cancel flag of each job the worker is running.
    running: Mutex<HashMap<Uuid, Arc<AtomicBool>>>,
    /// Set (under the `running` lock) by [`Training::begin_shutdown`]: the worker claims no
    /// more jobs.
    shutting_down: AtomicBool,
    /// Loaded adapters by checkpoint id (a deleted and re-made step gets a new id).
    adapters: Mutex<ByteLru<Uuid, Arc<LoraAdapter>>>,
    /// Where the worker runs jobs, so that they do not take the engine's threads.
    pub(crate) trainer_pool: TrainerPool,
}

#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    #[error("opening the store {location}: {source}")]
    Store {
        location: StoreLocation,
        source: temper_store::Error,
    },
    #[error("{0}")]
    TrainerPool(String),
}

impl Training {
    /// Opens the store (`options.store`), removes the temporary files of adapter saves a crash
    /// cut short, and puts back in the queue the jobs whose worker is gone (the worker then
    /// re-runs them from their start), or fails those interrupted `options.max_job_attempts`
    /// times in a row. Starts the trainer's threads.
    ///
    /// On SQLite every running job was this server's: the caller holds the data directory's
    /// [`temper_store::DataDirLock`] (`temper serve` takes it before this), so no other server
    /// uses the store. On PostgreSQL other servers' jobs are alive: only expired leases count.
    pub async fn open(options: TrainingOptions) -> Result<Training, OpenError> {
        let trainer_pool =
            TrainerPool::new(options.trainer_threads).map_err(OpenError::TrainerPool)?;
        let store_error = |source| OpenError::Store {
            location: options.store.clone(),
            source,
        };
        let mut store = Store::connect(&options.store).await.map_err(store_error)?;
        if let Some(limit) = options.max_queued_jobs_per_team {
            store = store.with_max_queued_jobs_per_team(limit);
        }
        for path in files::remove_stray_temp_files(&options.data_dir) {
            tracing::warn!(
                path = %path.display(),
                "removed the temporary file of an interrupted adapter save"
            );
        }
        let max_attempts = options.max_job_attempts.max(1);
        let recovery = match store.backend() {
            Backend::Sqlite => store.recover_after_crash(max_attempts).await,
            Backend::Postgres => store.requeue_expired_leases(max_attempts).await,
        }
        .map_err(store_error)?;
        worker::log_recovery(&recovery, max_attempts);
        Ok(Training {
            store,
            worker_id: match &options.worker_id {
                Some(id) => id.clone(),
                None => temper_store::new_worker_id().map_err(store_error)?,
            },
            wake: tokio::sync::Notify::new(),
            running: Mutex::new(HashMap::new()),
            shutting_down: AtomicBool::new(false),
            adapters: Mutex::new(ByteLru::new(options.adapter_cache_bytes)),
            trainer_pool,
            options,
        })
    }

    /// Asks the worker to stop a job it is running (cancelled, or its model deleted) before its
    /// next gradient step. A job not running is left alone.
    pub fn stop_job(&self, id: Uuid) {
        if let Some(flag) = self.lock_running().get(&id) {
            flag.store(true, Ordering::Relaxed);
        }
    }

    /// The first step of a graceful shutdown: the worker claims no more jobs and stops the one
    /// it runs before its next gradient step, writing no checkpoint; the job stays `running`
    /// until [`Training::requeue_at_shutdown`].
    pub fn begin_shutdown(&self) {
        let running = self.lock_running();
        // Under the lock: a job registered after this starts stopped.
        self.shutting_down.store(true, Ordering::Relaxed);
        for flag in running.values() {
            flag.store(true, Ordering::Relaxed);
        }
        drop(running);
        self.wake.notify_one();
    }

    pub(crate) fn is_shutting_down(&self) -> bool {
        self.shutting_down.load(Ordering::Relaxed)
    }

    /// The last step of a graceful shutdown, once the worker has stopped (or the time is up):
    /// puts this worker's running job back in the queue, its attempt given back. Errors are
    /// logged: the job is re-queued as after a crash instead (at the next start on SQLite, once
    /// its lease expires on PostgreSQL).
    pub async fn requeue_at_shutdown(&self) {
        match self.store.requeue_at_shutdown(&self.worker_id).await {
            Ok(ids) => {
                for id in ids {
                    tracing::info!(job_id = %id, "re-queued the running training job for the next start");
                }
            }
            Err(e) => {
                tracing::error!(error = %e, "re-queuing the running training job at shutdown")
            }
        }
    }

    /// The cancel flag of a job the worker starts running.
    pub(crate) fn register(&self, id: Uuid) -> Arc<AtomicBool> {
        let mut running = self.lock_running();
        // A job claimed while the shutdown begins stops before its first step.
        let flag = Arc::new(AtomicBool::new(self.is_shutting_down()));
        running.insert(id, flag.clone());
        flag
    }

    pub(crate) fn unregister(&self, id: Uuid) {
        self.lock_running().remove(&id);
    }

    fn lock_running(&self) -> std::sync::MutexGuard<'_, HashMap<Uuid, Arc<AtomicBool>>> {
        // The map stays consistent even if a holder panicked: every update is one insert/remove.
        self.running.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The adapter a checkpoint is served with: none for step 0 (the base weights), else its
    /// file, loaded once into the LRU cache.
    pub async fn adapter(
        &self,
        base: &ServedModel,
        checkpoint: &Checkpoint,
    ) -> Result<Option<Arc<LoraAdapter>>, ApiError> {
        if checkpoint.step == 0 {
            return Ok(None);
        }
        if let Some(adapter) = self.lock_adapters().get(&checkpoint.id) {
            return Ok(Some(adapter));
        }
        let path = self.adapter_path(checkpoint.model_id, checkpoint.step);
        let weights = base.model.clone();
        let loaded =
            tokio::task::spawn_blocking(move || LoraAdapter::load(&path, weights.config()))
                .await
                .map_err(|e| ApiError::Internal(format!("loading an adapter panicked: {e}")))?
                .map_err(|e| {
                    ApiError::Internal(format!(
                        "The adapter of checkpoint step {} cannot be loaded: {e}",
                        checkpoint.step
                    ))
                })?;
        let adapter = Arc::new(loaded);
        let bytes = adapter.memory_bytes();
        self.lock_adapters()
            .insert(checkpoint.id, adapter.clone(), bytes);
        Ok(Some(adapter))
    }

    fn lock_adapters(&self) -> std::sync::MutexGuard<'_, ByteLru<Uuid, Arc<LoraAdapter>>> {
        // Each cache operation leaves it consistent, so a panic elsewhere cannot corrupt it.
        self.adapters.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Where the adapter of a model's checkpoint is kept.
    pub fn adapter_path(&self, model_id: Uuid, step: i64) -> PathBuf {
        self.model_dir(model_id)
            .join(format!("step-{step}.safetensors"))
    }

    pub fn model_dir(&self, model_id: Uuid) -> PathBuf {
        self.options
            .data_dir
            .join("adapters")
            .join(model_id.to_string())
    }
}

/// What a request's `model` names: a served base model, and for a trained name the checkpoint
/// whose adapter goes on top of it.
pub struct ResolvedModel {
    pub base: Arc<ServedModel>,
    /// The name as the request gave it (echoed in the response).
    pub name: String,
    pub checkpoint: Option<Checkpoint>,
}

/// Resolves a request's `model`: a base model's own name first, then a trained name of the
/// key's team through the store. Unknown names, another team's and missing steps are all the
/// same 404.
pub async fn resolve_model(
    state: &AppState,
    requested: Option<&str>,
    team: &str,
) -> Result<ResolvedModel, ApiError> {
    let base_err = match state.model(requested) {
        Ok(base) => {
            return Ok(ResolvedModel {
                name: base.name.clone(),
                base,
                checkpoint: None,
            })
        }
        Err(e) => e,
    };
    let (Some(requested), Some(training)) = (requested, state.training()) else {
        return Err(base_err);
    };
    let Some(parsed) = names::parse(requested).filter(|n| n.entity == team) else {
        return Err(base_err);
    };
    let store = &training.store;
    let not_found = |e: temper_store::Error| match e {
        temper_store::Error::NotFound(_) => ApiError::ModelNotFound(requested.to_owned()),
        e => e.into(),
    };
    let model = store
        .get_model_by_name(team, parsed.project, parsed.name)
        .await
        .map_err(not_found)?;
    let checkpoint = match parsed.step {
        StepSelector::Latest => store
            .latest_checkpoint(team, model.id)
            .await
            .map_err(not_found)?
            .ok_or_else(|| ApiError::ModelNotFound(requested.to_owned()))?,
        StepSelector::Step(step) => store
            .get_checkpoint(team, model.id, step)
            .await
            .map_err(not_found)?,
    };
    let base = state.model(Some(&model.base_model)).map_err(|_| {
        ApiError::ServiceUnavailable(format!(
            "The base model `{}` of `{requested}` is not served by this server.",
            model.base_model
        ))
    })?;
    Ok(ResolvedModel {
        base,
        name: requested.to_owned(),
        checkpoint: Some(checkpoint),
    })
}
