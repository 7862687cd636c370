//! The training service below HTTP: models, checkpoints and jobs in the store (training.md's
//! life cycle) and the worker that runs queued jobs. It trains the base models of a
//! [`temper_catalog::Catalog`] and writes the checkpoints serving finds there. The HTTP layer's
//! training routes call it and convert wire types; a worker node (`temper serve --role worker`)
//! runs only its worker.

mod worker;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{json, Map, Value};
use temper_catalog::{BaseModel, Catalog};
use temper_model::{AdapterFormat, ExportedAdapter, LoraAdapter, PeftFiles};
use temper_store::{
    Artifacts, Backend, Checkpoint, CheckpointAnswer, DeletedCheckpoints, DeletedModel,
    IdempotencyKey, Job, JobKind, Model, NewModel, Store,
};
use uuid::Uuid;

use crate::{LogGroup, SftRequest, TrainError, TrainerPool, TrainerThreads, TrainingRequest};

/// Settings of the training service.
#[derive(Debug, Clone)]
pub struct TrainingOptions {
    /// How long the worker's claim on a running job lasts unless renewed (it renews it every
    /// third of that); a server that dies loses its job to another worker this long after.
    pub job_lease: Duration,
    /// This server's worker name in job leases and events (`None`: a generated one, see
    /// [`temper_store::new_worker_id`]); unique among the servers sharing a store.
    pub worker_id: Option<String>,
    /// Largest accepted body of the training routes (trajectory groups are large).
    pub max_body_bytes: usize,
    pub lora_rank: usize,
    pub lora_alpha: f32,
    /// Longest packed training sequence, in tokens.
    pub max_seq_len: usize,
    /// A job found running at start-up after this many starts in a row (each ended by a crash
    /// or a kill) is failed instead of re-queued (at least 1).
    pub max_job_attempts: u32,
    /// Most queued jobs per team (`None`: no bound); past it a post is a 429.
    pub max_queued_jobs_per_team: Option<u32>,
    /// The worker's own threads and their priority (below serving's), started with the worker.
    pub trainer_threads: TrainerThreads,
}

impl Default for TrainingOptions {
    fn default() -> Self {
        TrainingOptions {
            job_lease: Duration::from_secs(30),
            worker_id: None,
            max_body_bytes: 64 << 20,
            lora_rank: 8,
            lora_alpha: 16.0,
            max_seq_len: 2048,
            max_job_attempts: 3,
            max_queued_jobs_per_team: Some(64),
            trainer_threads: TrainerThreads::default(),
        }
    }
}

/// What a call of the service can fail with; the HTTP layer maps each to its status.
#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    #[error(transparent)]
    Store(#[from] temper_store::Error),
    /// The trajectories cannot be trained on (a field of the request is named).
    #[error(transparent)]
    Train(#[from] TrainError),
    /// A bad value of a request field other than the trajectories.
    #[error("{message}")]
    Invalid { param: String, message: String },
    /// Another team's entity is as absent as a missing one.
    #[error("The entity `{0}` does not exist.")]
    EntityNotFound(String),
    #[error("`{0}` is not a base model this server serves (GET /v1/models lists them).")]
    UnknownBaseModel(String),
    /// The model exists, but its base model is not loaded by this process.
    #[error("The base model `{0}` is not served by this server.")]
    BaseModelNotServed(String),
    #[error("The base model `{0}` has no chat template.")]
    NoChatTemplate(String),
    #[error("{0}")]
    Conflict(String),
    /// An imported adapter's file is refused; `subject` names the tensor (or config field).
    #[error("Invalid adapter: {0}.")]
    InvalidAdapter(#[from] temper_model::AdapterFileError),
    #[error("{0}")]
    Internal(String),
}

#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    #[error("the training service needs a store")]
    NoStore,
    #[error("recovering the jobs of stopped workers: {0}")]
    Store(#[from] temper_store::Error),
}

/// A job's request: posted to the API, stored as posted, read back by the worker.
pub enum JobSpec {
    Rl(TrainingRequest),
    Sft(SftRequest),
}

impl JobSpec {
    pub fn kind(&self) -> JobKind {
        match self {
            JobSpec::Rl(_) => JobKind::Rl,
            JobSpec::Sft(_) => JobKind::Sft,
        }
    }

    fn parse(kind: JobKind, text: &str) -> Result<JobSpec, String> {
        let parsed = match kind {
            JobKind::Rl => serde_json::from_str(text).map(JobSpec::Rl),
            JobKind::Sft => serde_json::from_str(text).map(JobSpec::Sft),
        };
        parsed.map_err(|e| format!("the stored request does not parse: {e}"))
    }
}

/// The store plus what the API calls and the worker share.
pub struct TrainingService {
    pub store: Store,
    /// The checkpoints' adapters.
    pub artifacts: Artifacts,
    /// This server's worker, as its job leases and `training_started` events name it.
    pub worker_id: String,
    pub options: TrainingOptions,
    /// What jobs train: the base models this process loaded.
    catalog: Arc<Catalog>,
    /// Wakes the worker when a job is queued.
    wake: tokio::sync::Notify,
    /// The cancel flag of each job the worker is running.
    running: Mutex<HashMap<Uuid, Arc<AtomicBool>>>,
    /// Set (under the `running` lock) by [`TrainingService::begin_shutdown`]: the worker claims
    /// no more jobs.
    shutting_down: AtomicBool,
    /// The trainer's threads, once the worker has started them: other training in the process
    /// (the Tinker API's steps) runs on them too.
    pool: std::sync::OnceLock<Arc<TrainerPool>>,
}

impl TrainingService {
    /// Over the catalog's store and artifacts (it must have them): removes the temporary files
    /// of adapter saves a crash cut short, and puts back in the queue the jobs whose worker is
    /// gone (the worker then re-runs them from their start), or fails those interrupted
    /// `options.max_job_attempts` times in a row. Starts no threads: the trainer's start with
    /// [`TrainingService::spawn_worker`].
    ///
    /// On SQLite every running job was this server's: the caller holds the data directory's
    /// [`temper_store::DataDirLock`] (`temper serve` takes it before this), so no other server
    /// uses the store. On PostgreSQL other servers' jobs are alive: only expired leases count.
    pub async fn open(
        options: TrainingOptions,
        catalog: Arc<Catalog>,
    ) -> Result<TrainingService, OpenError> {
        let storage = catalog.storage().ok_or(OpenError::NoStore)?;
        let mut store = storage.store.clone();
        if let Some(limit) = options.max_queued_jobs_per_team {
            store = store.with_max_queued_jobs_per_team(limit);
        }
        let artifacts = storage.artifacts.clone();
        for path in artifacts.remove_stray_temp_files().await {
            tracing::warn!(
                path = %path.display(),
                "removed the temporary file of an interrupted adapter save"
            );
        }
        let max_attempts = options.max_job_attempts.max(1);
        let recovery = match store.backend() {
            Backend::Sqlite => store.recover_after_crash(max_attempts).await,
            Backend::Postgres => store.requeue_expired_leases(max_attempts).await,
        }?;
        worker::log_recovery(&recovery, max_attempts);
        let worker_id = match &options.worker_id {
            Some(id) => id.clone(),
            None => temper_store::new_worker_id()?,
        };
        Ok(TrainingService {
            store,
            artifacts,
            worker_id,
            catalog,
            wake: tokio::sync::Notify::new(),
            running: Mutex::new(HashMap::new()),
            shutting_down: AtomicBool::new(false),
            pool: std::sync::OnceLock::new(),
            options,
        })
    }

    /// Starts the trainer's threads and the job worker on the current runtime (a process runs
    /// at most one); the error says which step of starting the threads failed.
    pub fn spawn_worker(self: &Arc<Self>) -> Result<tokio::task::JoinHandle<()>, String> {
        let pool = Arc::new(TrainerPool::new(self.options.trainer_threads)?);
        let _ = self.pool.set(pool.clone());
        Ok(tokio::spawn(worker::run(self.clone(), pool)))
    }

    /// The worker's trainer threads (see [`TrainerPool`]), when it runs in this process.
    pub fn trainer_pool(&self) -> Option<Arc<TrainerPool>> {
        self.pool.get().cloned()
    }

    pub fn base_model(&self, name: &str) -> Option<&Arc<BaseModel>> {
        self.catalog.base_model(name)
    }

    fn served_base(&self, model: &Model) -> Result<&Arc<BaseModel>, ServiceError> {
        self.base_model(&model.base_model)
            .ok_or_else(|| ServiceError::BaseModelNotServed(model.base_model.clone()))
    }

    /// Registers a trainable model of `team` on a served base model. `entity` other than the
    /// team is a 404; with `return_existing`, an existing model of that name on the same base
    /// is returned instead of a conflict.
    pub async fn create_model(
        &self,
        team: &str,
        entity: Option<&str>,
        new: &NewModel<'_>,
        return_existing: bool,
    ) -> Result<Model, ServiceError> {
        if let Some(entity) = entity.filter(|e| *e != team) {
            return Err(ServiceError::EntityNotFound(entity.to_owned()));
        }
        if self.base_model(new.base_model).is_none() {
            return Err(ServiceError::UnknownBaseModel(new.base_model.to_owned()));
        }
        match self.store.create_model(new).await {
            Err(temper_store::Error::ModelExists { .. }) if return_existing => {
                let existing = self
                    .store
                    .get_model_by_name(team, new.project, new.name)
                    .await?;
                if existing.base_model != new.base_model {
                    return Err(ServiceError::Conflict(format!(
                        "The model {}/{}/{} exists with base model `{}`, not `{}`.",
                        existing.team,
                        existing.project,
                        existing.name,
                        existing.base_model,
                        new.base_model
                    )));
                }
                Ok(existing)
            }
            other => Ok(other?),
        }
    }

    /// Deletes the model, its checkpoints and their adapters; its queued and running jobs fail
    /// (a running one stops before its next step).
    pub async fn delete_model(&self, team: &str, id: Uuid) -> Result<DeletedModel, ServiceError> {
        let deleted = self.store.delete_model(team, id).await?;
        for job in &deleted.failed_jobs {
            self.stop_job(*job);
        }
        if let Err(e) = self.artifacts.delete_model(id).await {
            tracing::warn!(error = %e, "removing a deleted model's adapters");
        }
        Ok(deleted)
    }

    /// Deletes checkpoints by step, with their adapters.
    pub async fn delete_checkpoints(
        &self,
        team: &str,
        model_id: Uuid,
        steps: &[i64],
    ) -> Result<DeletedCheckpoints, ServiceError> {
        let deleted = self.store.delete_checkpoints(team, model_id, steps).await?;
        for step in steps
            .iter()
            .filter(|s| !deleted.not_found_steps.contains(s))
        {
            if let Err(e) = self.artifacts.delete(model_id, *step).await {
                tracing::warn!(error = %e, "removing a deleted checkpoint's adapter");
            }
        }
        Ok(deleted)
    }

    /// A checkpoint's adapter in `format`, for the tools users deploy with (PEFT, vLLM,
    /// llama.cpp). Step 0 (the base weights) has none.
    pub async fn export_adapter(
        &self,
        team: &str,
        model_id: Uuid,
        step: i64,
        format: AdapterFormat,
    ) -> Result<(Model, ExportedAdapter), ServiceError> {
        let model = self.store.get_model(team, model_id).await?;
        let checkpoint = self.store.get_checkpoint(team, model_id, step).await?;
        if step == 0 {
            return Err(ServiceError::Invalid {
                param: "step".to_owned(),
                message: "Step 0 is the base weights: it has no adapter to export.".to_owned(),
            });
        }
        let base = self.served_base(&model)?.clone();
        let adapter = self
            .catalog
            .adapter(&base, &checkpoint)
            .await
            .map_err(|e| ServiceError::Internal(e.to_string()))?
            .ok_or_else(|| ServiceError::Internal(format!("step {step} has no adapter")))?;
        if format == AdapterFormat::Gguf
            && adapter.config().unembed
            && base.model.config().tied_embeddings
        {
            return Err(ServiceError::Invalid {
                param: "format".to_owned(),
                message: "This checkpoint adapts the LM head, which the base model shares with \
                          its embedding table: a llama.cpp adapter cannot express that. Export \
                          `format=peft`, or merge it into the base GGUF (`temper export \
                          --format merged-gguf`)."
                    .to_owned(),
            });
        }
        let exported = tokio::task::spawn_blocking(move || {
            adapter.export(base.model.config(), &base.name, format)
        })
        .await
        .map_err(|e| ServiceError::Internal(format!("exporting the adapter panicked: {e}")))?
        .map_err(|e| ServiceError::Internal(format!("exporting the adapter: {e}")))?;
        Ok((model, exported))
    }

    /// Imports a PEFT adapter as the model's next checkpoint, served by name at once and the
    /// start of the model's next job. Every tensor is checked against the base model first
    /// (a bad one is [`ServiceError::InvalidAdapter`] naming it); projections the file does not
    /// adapt start as a fresh adapter's (no change). The adapter is stored under the new step
    /// while the store holds the model (see [`Store::begin_checkpoint_import`]), then the
    /// checkpoint commits, with the `Idempotency-Key`'s answer when there is one.
    pub async fn import_checkpoint(
        &self,
        team: &str,
        model_id: Uuid,
        files: PeftFiles,
        idempotency: Option<CheckpointAnswer<'_>>,
    ) -> Result<Checkpoint, ServiceError> {
        let model = self.store.get_model(team, model_id).await?;
        let base = self.served_base(&model)?.clone();
        let seed = worker::adapter_seed(&model);
        let (bytes, rank, alpha) = tokio::task::spawn_blocking(move || {
            let adapter = LoraAdapter::from_peft(&files, base.model.config(), seed)?;
            let cfg = adapter.config();
            let bytes = adapter
                .to_bytes()
                .map_err(|e| ServiceError::Internal(format!("serializing the adapter: {e}")))?;
            Ok::<_, ServiceError>((bytes, cfg.rank, cfg.alpha))
        })
        .await
        .map_err(|e| ServiceError::Internal(format!("reading the adapter panicked: {e}")))??;
        let metrics = json!({ "imported": true, "lora_rank": rank, "lora_alpha": alpha });
        self.store_checkpoint(team, model_id, bytes, &metrics, idempotency)
            .await
    }

    /// Stores `bytes` (a serialized adapter of the model's base) as the model's next checkpoint,
    /// served by name at once: the adapter is stored under the new step while the store holds
    /// the model (see [`Store::begin_checkpoint_import`]), then the checkpoint commits, with the
    /// `Idempotency-Key`'s answer when there is one.
    pub async fn store_checkpoint(
        &self,
        team: &str,
        model_id: Uuid,
        bytes: Vec<u8>,
        metrics: &Value,
        idempotency: Option<CheckpointAnswer<'_>>,
    ) -> Result<Checkpoint, ServiceError> {
        let import = self.store.begin_checkpoint_import(team, model_id).await?;
        let step = import.step;
        self.artifacts
            .put(model_id, step, bytes)
            .await
            .map_err(|e| ServiceError::Internal(format!("storing the adapter: {e}")))?;
        match import.commit(metrics, idempotency).await {
            Ok(checkpoint) => {
                tracing::info!(model_id = %model_id, step, "stored a checkpoint");
                Ok(checkpoint)
            }
            Err(e) => {
                // No checkpoint row points at the adapter, and none can be written for this
                // step until the import's transaction ends: it must not outlive this.
                if let Err(e) = self.artifacts.delete(model_id, step).await {
                    tracing::warn!(error = %e, "removing the adapter of an uncommitted import");
                }
                Err(e.into())
            }
        }
    }

    /// `/log`: reward statistics and the trajectories' own metrics of one split (e.g. `val`),
    /// merged into the latest checkpoint's metrics as `<split>/<name>`.
    pub async fn log_metrics(
        &self,
        team: &str,
        model_id: Uuid,
        split: &str,
        groups: &[LogGroup],
    ) -> Result<Checkpoint, ServiceError> {
        let metrics = split_metrics(split, groups)?;
        Ok(self.store.log_metrics(team, model_id, metrics).await?)
    }

    /// Validates a job's whole request (it is tokenized with the base model's template, so a
    /// job that could not train is refused now, not failed later), then stores `body` (the
    /// request as posted) and answers once it is committed, with the `Idempotency-Key`'s answer
    /// in the same transaction when there is one.
    pub async fn enqueue_job(
        &self,
        team: &str,
        model_id: Uuid,
        spec: JobSpec,
        body: &str,
        idempotency: Option<IdempotencyKey<'_>>,
    ) -> Result<Job, ServiceError> {
        let model = self.store.get_model(team, model_id).await?;
        let base = self.served_base(&model)?;
        let template = base
            .chat_template
            .clone()
            .ok_or_else(|| ServiceError::NoChatTemplate(model.base_model.clone()))?;
        let tokenizer = base.tokenizer.clone();
        let max_seq_len = self.options.max_seq_len;
        let kind = spec.kind();
        tokio::task::spawn_blocking(move || match spec {
            JobSpec::Rl(request) => {
                crate::tokenize_job(&request, &tokenizer, &template)?.check_lengths(max_seq_len)
            }
            JobSpec::Sft(request) => {
                crate::tokenize_sft_job(&request, &tokenizer, &template)?.check_lengths(max_seq_len)
            }
        })
        .await
        .map_err(|e| ServiceError::Internal(format!("validating trajectories panicked: {e}")))??;
        let job = match idempotency {
            Some(key) => {
                self.store
                    .enqueue_job_idempotent(team, model_id, kind, body, key)
                    .await?
            }
            None => self.store.enqueue_job(team, model_id, kind, body).await?,
        };
        self.wake.notify_one();
        tracing::info!(job_id = %job.id, model_id = %model_id, kind = kind.as_str(), "training job queued");
        Ok(job)
    }

    /// Cancels a queued or running job; a running one stops before its next gradient step and
    /// makes no checkpoint.
    pub async fn cancel_job(&self, team: &str, id: Uuid) -> Result<Job, ServiceError> {
        let job = self.store.cancel_job(team, id).await?;
        self.stop_job(job.id);
        Ok(job)
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
    /// until [`TrainingService::requeue_at_shutdown`].
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

    fn is_shutting_down(&self) -> bool {
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
    fn register(&self, id: Uuid) -> Arc<AtomicBool> {
        let mut running = self.lock_running();
        // A job claimed while the shutdown begins stops before its first step.
        let flag = Arc::new(AtomicBool::new(self.is_shutting_down()));
        running.insert(id, flag.clone());
        flag
    }

    fn unregister(&self, id: Uuid) {
        self.lock_running().remove(&id);
    }

    fn lock_running(&self) -> std::sync::MutexGuard<'_, HashMap<Uuid, Arc<AtomicBool>>> {
        // The map stays consistent even if a holder panicked: every update is one insert/remove.
        self.running.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// `<split>/reward` (mean), `<split>/reward_std_dev` (population), `<split>/num_trajectories`,
/// `<split>/num_groups`, and the mean of each numeric trajectory metric as `<split>/<name>`.
fn split_metrics(split: &str, groups: &[LogGroup]) -> Result<Map<String, Value>, ServiceError> {
    let valid_split = !split.is_empty()
        && split.len() <= 64
        && split
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
    if !valid_split {
        return Err(ServiceError::Invalid {
            param: "split".to_owned(),
            message: "`split` must be 1-64 of A-Z a-z 0-9 - _ . (e.g. `val`).".to_owned(),
        });
    }
    if groups.is_empty() {
        return Err(ServiceError::Invalid {
            param: "trajectory_groups".to_owned(),
            message: "`trajectory_groups` must not be empty.".to_owned(),
        });
    }
    if let Some(i) = groups.iter().position(|g| g.trajectories.is_empty()) {
        return Err(ServiceError::Invalid {
            param: format!("trajectory_groups[{i}].trajectories"),
            message: "A group must have at least one trajectory.".to_owned(),
        });
    }
    let trajectories: Vec<_> = groups.iter().flat_map(|g| &g.trajectories).collect();
    let n = trajectories.len() as f64;
    let mean = trajectories.iter().map(|t| t.reward).sum::<f64>() / n;
    let var = trajectories
        .iter()
        .map(|t| (t.reward - mean).powi(2))
        .sum::<f64>()
        / n;
    let mut out = Map::new();
    out.insert(format!("{split}/reward"), json!(mean));
    out.insert(format!("{split}/reward_std_dev"), json!(var.sqrt()));
    out.insert(
        format!("{split}/num_trajectories"),
        json!(trajectories.len()),
    );
    out.insert(format!("{split}/num_groups"), json!(groups.len()));
    out.extend(crate::mean_trajectory_metrics(
        trajectories.iter().map(|t| &t.metrics),
        &format!("{split}/"),
    ));
    Ok(out)
}
