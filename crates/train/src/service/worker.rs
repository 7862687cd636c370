//! The job worker: one per server. It claims queued jobs (RL and SFT alike) (in order per model, one job at a time:
//! the trainer and the serving engine share the machine's cores, and one training job already
//! keeps them busy), trains from the model's latest checkpoint on a blocking thread, streams the
//! trainer's events into the store as they come, saves the new adapter and records the
//! checkpoint in one transaction with the job's success.
//!
//! The worker holds the job it runs by a lease in the store, renewed every third of
//! `job_lease` while the job runs; when idle it re-queues the jobs of workers whose lease
//! expired (other servers sharing a PostgreSQL store, dead or cut off).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Map, Value};
use temper_model::{LoraAdapter, LoraConfig};
use temper_store::{event, Job, Recovery};
use tracing::Instrument;
use uuid::Uuid;

use super::{JobSpec, TrainingService};
use crate::{TrainEvent, TrainerConfig, TrainerPool};

/// How often an idle worker looks at the queue even without a wake-up (jobs queued by another
/// process sharing the store).
const IDLE_POLL: Duration = Duration::from_secs(2);
/// An `Idempotency-Key` claim still unanswered this long after it was made belongs to a request
/// whose server died (a request holds its claim for as long as its handler runs).
const STALE_IDEMPOTENCY_CLAIM: Duration = Duration::from_secs(600);

/// Runs queued jobs until the process begins shutting down
/// ([`TrainingService::begin_shutdown`]), and returns once its job has stopped.
/// Runs queued jobs one at a time, each on `pool` (the trainer's threads).
pub(super) async fn run(training: Arc<TrainingService>, pool: Arc<TrainerPool>) {
    let lease = training.options.job_lease;
    // `TrainingService::open` just swept.
    let mut swept = Instant::now();
    while !training.is_shutting_down() {
        match training
            .store
            .claim_next_job(&training.worker_id, lease)
            .await
        {
            Ok(Some(job)) => {
                let id = job.id;
                if let Err(message) = run_job(&training, &pool, job).await {
                    record_failure(&training, id, &message).await;
                }
                release_freed_memory();
            }
            Ok(None) => {
                if swept.elapsed() >= lease {
                    swept = Instant::now();
                    if sweep(&training).await {
                        continue;
                    }
                }
                let _ = tokio::time::timeout(IDLE_POLL, training.wake.notified()).await;
            }
            Err(e) => {
                tracing::error!(error = %e, "claiming a training job");
                tokio::time::sleep(IDLE_POLL).await;
            }
        }
    }
}

/// Re-queues the jobs whose worker's lease expired (or fails them at the attempt limit) and
/// releases stale idempotency claims. Returns whether a job was re-queued.
async fn sweep(training: &TrainingService) -> bool {
    let max_attempts = training.options.max_job_attempts.max(1);
    let requeued = match training.store.requeue_expired_leases(max_attempts).await {
        Ok(recovery) => {
            log_recovery(&recovery, max_attempts);
            !recovery.requeued.is_empty()
        }
        Err(e) => {
            tracing::error!(error = %e, "re-queuing training jobs whose lease expired");
            false
        }
    };
    match training
        .store
        .release_stale_idempotency_claims(STALE_IDEMPOTENCY_CLAIM)
        .await
    {
        Ok(0) => {}
        Ok(n) => tracing::warn!(
            claims = n,
            "released idempotency keys a dead server left claimed"
        ),
        Err(e) => tracing::error!(error = %e, "releasing stale idempotency claims"),
    }
    requeued
}

/// Logs what a recovery did with the jobs whose worker was gone.
pub(crate) fn log_recovery(recovery: &Recovery, max_attempts: u32) {
    for id in &recovery.requeued {
        tracing::warn!(job_id = %id, "re-queued a training job whose worker is gone");
    }
    for id in &recovery.failed {
        tracing::error!(
            job_id = %id,
            max_attempts,
            "failed a training job that lost its worker at its attempt limit"
        );
    }
}

/// A job frees hundreds of MB of step buffers on the trainer's threads. glibc keeps freed memory
/// in the arena of the thread that freed it, where the engine's threads never reuse it, so the
/// server's RSS grew job after job under load (`make soak`: +190 MB a minute); this hands the
/// free pages of every arena back to the OS (a few milliseconds, once per job).
fn release_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only returns free memory to the OS; no allocation is touched.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Marks a job failed, unless it already ended (cancelled, its model deleted).
async fn record_failure(training: &TrainingService, id: Uuid, message: &str) {
    tracing::warn!(job_id = %id, error = message, "training job failed");
    match training
        .store
        .fail_job(id, &training.worker_id, message)
        .await
    {
        Ok(_)
        | Err(temper_store::Error::JobState { .. } | temper_store::Error::LeaseLost { .. }) => {}
        Err(e) => tracing::error!(job_id = %id, error = %e, "recording a failed training job"),
    }
}

/// A seed per model name (team, project, name: FNV-1a), not per registration: the same run
/// registered again, on this server or a fresh one, starts from the same fresh adapter, so its
/// training is reproducible.
pub(super) fn adapter_seed(model: &temper_store::Model) -> u64 {
    let mut hash = 0xcbf2_9ce4_8422_2325_u64;
    for part in [&model.team, &model.project, &model.name] {
        // The separator keeps ("ab", "c") and ("a", "bc") apart.
        for byte in part.bytes().chain([0]) {
            hash = (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3);
        }
    }
    hash
}

/// Runs one claimed job to its end, renewing its lease meanwhile. `Err` is the message of a
/// failure still to be recorded.
async fn run_job(
    training: &Arc<TrainingService>,
    pool: &Arc<TrainerPool>,
    job: Job,
) -> Result<(), String> {
    let span = tracing::info_span!("training_job", job_id = %job.id, model_id = %job.model_id);
    let _renewal = Renewal(tokio::spawn(
        keep_lease(training.clone(), job.id).instrument(span.clone()),
    ));
    run_claimed(training, pool, job).instrument(span).await
}

/// The lease renewal of the job being run, stopped when its run ends, however it ends.
struct Renewal(tokio::task::JoinHandle<()>);

impl Drop for Renewal {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Renews this worker's lease on a job every third of the lease, so a failed renewal is retried
/// twice before the lease lapses. A job no longer this worker's (cancelled, its model deleted,
/// or re-queued once the lease lapsed) is stopped before its next step, recording nothing.
async fn keep_lease(training: Arc<TrainingService>, job_id: Uuid) {
    let lease = training.options.job_lease;
    let mut ticks = tokio::time::interval((lease / 3).max(Duration::from_secs(1)));
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The first tick is at once: the claim has just set the lease.
    ticks.tick().await;
    loop {
        ticks.tick().await;
        match training
            .store
            .renew_lease(job_id, &training.worker_id, lease)
            .await
        {
            Ok(()) => {}
            Err(
                e @ (temper_store::Error::JobState { .. } | temper_store::Error::LeaseLost { .. }),
            ) => {
                tracing::warn!(error = %e, "the training job is no longer this worker's: stopping it");
                training.stop_job(job_id);
                return;
            }
            Err(e) => tracing::error!(error = %e, "renewing the training job's lease"),
        }
    }
}

async fn run_claimed(
    training: &Arc<TrainingService>,
    pool: &Arc<TrainerPool>,
    job: Job,
) -> Result<(), String> {
    let store = &training.store;
    let request = JobSpec::parse(
        job.kind,
        &store.job_request(job.id).await.map_err(|e| e.to_string())?,
    )?;
    let model = store
        .get_model(&job.team, job.model_id)
        .await
        .map_err(|e| e.to_string())?;
    let base = training
        .base_model(&model.base_model)
        .ok_or_else(|| format!("the base model `{}` is not served", model.base_model))?;
    let template = base
        .chat_template
        .clone()
        .ok_or_else(|| format!("the base model `{}` has no chat template", model.base_model))?;
    let latest_step = store
        .latest_checkpoint(&job.team, job.model_id)
        .await
        .map_err(|e| e.to_string())?
        .map_or(0, |c| c.step);
    let options = &training.options;
    let lora = LoraConfig {
        rank: options.lora_rank,
        alpha: options.lora_alpha,
        unembed: false,
    };
    // The previous step's adapter, from the artifact store (maybe written by another server).
    let start_bytes = if latest_step > 0 {
        let bytes = training
            .artifacts
            .get(job.model_id, latest_step)
            .await
            .map_err(|e| format!("loading the adapter of step {latest_step}: {e}"))?;
        Some((bytes, training.artifacts.key(job.model_id, latest_step)))
    } else {
        None
    };
    let trainer = TrainerConfig {
        lora,
        max_seq_len: options.max_seq_len,
    };
    // Echoed in every gradient step (and so in the checkpoint's metrics).
    let bookkeeping = match &request {
        JobSpec::Rl(r) => r.bookkeeping_metrics(latest_step),
        JobSpec::Sft(_) => Map::new(),
    };

    let cancel = training.register(job.id);
    let (events_tx, mut events_rx) = tokio::sync::mpsc::unbounded_channel::<TrainEvent>();
    let weights = base.model.clone();
    let tokenizer = base.tokenizer.clone();
    let flag = cancel.clone();
    let seed = adapter_seed(&model);
    let pool = pool.clone();
    // The trainer is CPU-bound for seconds to minutes: it runs on its own pool (waited on by a
    // blocking thread) while this task writes its events.
    let trained = tokio::task::spawn_blocking(move || {
        pool.install(move || {
            let start = match start_bytes {
                Some((bytes, origin)) => LoraAdapter::from_bytes(&bytes, &origin, weights.config())
                    .map_err(|e| format!("loading the adapter of step {latest_step}: {e}"))?,
                None => LoraAdapter::new(weights.config(), lora, seed),
            };
            // The receiver only goes away when the worker is dropped with the server.
            let mut send = |e| {
                let _ = events_tx.send(e);
            };
            match request {
                JobSpec::Rl(request) => {
                    let tokenized = crate::tokenize_job(&request, &tokenizer, &template)
                        .map_err(|e| e.to_string())?;
                    crate::run_job(&weights, &start, &tokenized, &trainer, &flag, &mut send)
                }
                JobSpec::Sft(request) => {
                    let tokenized = crate::tokenize_sft_job(&request, &tokenizer, &template)
                        .map_err(|e| e.to_string())?;
                    crate::run_sft_job(&weights, &start, &tokenized, &trainer, &flag, &mut send)
                        .map(Some)
                }
            }
            .map_err(|e| e.to_string())
        })
    });

    let mut step_metrics: Vec<Map<String, Value>> = Vec::new();
    let mut ended_message = None;
    while let Some(e) = events_rx.recv().await {
        let (kind, data) = match e {
            TrainEvent::Started { num_sequences } => (
                event::TRAINING_STARTED,
                json!({ "num_sequences": num_sequences, "worker": training.worker_id }),
            ),
            TrainEvent::GradientStep(metrics) => step_data(
                serde_json::to_value(&metrics),
                &bookkeeping,
                &mut step_metrics,
            ),
            TrainEvent::SftStep(metrics) => step_data(
                serde_json::to_value(&metrics),
                &bookkeeping,
                &mut step_metrics,
            ),
            // The checkpoint step is the worker's to give: training_ended is written with it.
            TrainEvent::Ended { message, .. } => {
                ended_message = message;
                continue;
            }
        };
        match store
            .append_event(job.id, &training.worker_id, kind, &data)
            .await
        {
            Ok(_) => {}
            // Cancelled, its model deleted, or its lease lost: stop before the next step.
            Err(temper_store::Error::JobState { .. } | temper_store::Error::LeaseLost { .. }) => {
                cancel.store(true, Ordering::Relaxed)
            }
            Err(e) => tracing::error!(error = %e, "writing a training event"),
        }
    }
    let trained = trained.await;
    training.unregister(job.id);
    let trained = trained.map_err(|e| format!("the trainer panicked: {e}"))?;
    if cancel.load(Ordering::Relaxed) {
        // The store already says how it ended (cancelled, or failed with its model deleted), or
        // the server is shutting down and re-queues it.
        tracing::info!("training job stopped");
        return Ok(());
    }
    match trained? {
        Some(adapter) => {
            let step = latest_step + 1;
            let bytes = tokio::task::spawn_blocking(move || adapter.to_bytes())
                .await
                .map_err(|e| format!("serializing the adapter panicked: {e}"))?
                .map_err(|e| format!("serializing the adapter: {e}"))?;
            // Stored (a file and its directory entry fsynced, or an S3 object acknowledged)
            // before the checkpoint row commits.
            training
                .artifacts
                .put(job.model_id, step, bytes)
                .await
                .map_err(|e| format!("storing the adapter: {e}"))?;
            let metrics = mean_metrics(&step_metrics);
            match store
                .succeed_job(
                    job.id,
                    &training.worker_id,
                    step,
                    Some(metrics),
                    &json!({ "step": step }),
                )
                .await
            {
                Ok(_) => {
                    tracing::info!(step, "training job made a checkpoint");
                    Ok(())
                }
                Err(e) => {
                    // No checkpoint row points at the adapter: it must not outlive this.
                    if let Err(e) = training.artifacts.delete(job.model_id, step).await {
                        tracing::warn!(error = %e, "removing the adapter of an uncommitted step");
                    }
                    match e {
                        temper_store::Error::JobState { .. }
                        | temper_store::Error::LeaseLost { .. } => Ok(()),
                        e => Err(e.to_string()),
                    }
                }
            }
        }
        None => {
            let message = ended_message.unwrap_or_else(|| {
                "nothing to learn from: every group has equal rewards or no trainable tokens"
                    .to_owned()
            });
            let data = json!({ "step": latest_step, "message": message });
            match store
                .succeed_job(job.id, &training.worker_id, latest_step, None, &data)
                .await
            {
                Ok(_)
                | Err(
                    temper_store::Error::JobState { .. } | temper_store::Error::LeaseLost { .. },
                ) => Ok(()),
                Err(e) => Err(e.to_string()),
            }
        }
    }
}

/// A `gradient_step` event's data: the trainer's metrics plus the job's bookkeeping metrics,
/// also kept for the checkpoint's metrics.
fn step_data(
    metrics: serde_json::Result<Value>,
    bookkeeping: &Map<String, Value>,
    steps: &mut Vec<Map<String, Value>>,
) -> (&'static str, Value) {
    let mut data = match metrics {
        Ok(Value::Object(m)) => m,
        // Plain structs of numbers always serialize to objects.
        _ => Map::new(),
    };
    data.extend(bookkeeping.clone());
    steps.push(data.clone());
    (event::GRADIENT_STEP, Value::Object(data))
}

/// A checkpoint's metrics: the mean over the job's gradient steps of every numeric metric.
fn mean_metrics(steps: &[Map<String, Value>]) -> Value {
    let mut sums: Map<String, Value> = Map::new();
    let mut counts: std::collections::HashMap<String, f64> = Default::default();
    for step in steps {
        for (k, v) in step.iter().filter(|(k, _)| k.as_str() != "step") {
            if let Some(x) = v.as_f64() {
                let sum = sums.get(k).and_then(Value::as_f64).unwrap_or(0.0) + x;
                sums.insert(k.clone(), json!(sum));
                *counts.entry(k.clone()).or_default() += 1.0;
            }
        }
    }
    let mut out = Map::new();
    for (k, sum) in sums {
        let n = counts.get(&k).copied().unwrap_or(1.0);
        out.insert(k, json!(sum.as_f64().unwrap_or(0.0) / n));
    }
    out.insert("num_gradient_steps".to_owned(), json!(steps.len()));
    Value::Object(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_are_averaged_over_steps() {
        let steps: Vec<Map<String, Value>> = [
            json!({"loss": 1.0, "reward": 0.5, "step": 1, "note": "x"}),
            json!({"loss": 3.0, "reward": 0.5, "step": 2}),
        ]
        .into_iter()
        .map(|v| v.as_object().unwrap().clone())
        .collect();
        assert_eq!(
            mean_metrics(&steps),
            json!({"loss": 2.0, "reward": 0.5, "num_gradient_steps": 2})
        );
        assert_eq!(mean_metrics(&[]), json!({"num_gradient_steps": 0}));
    }

    #[test]
    fn the_fresh_adapter_is_seeded_by_the_model_name_not_its_id() {
        let model = |team: &str, project: &str, name: &str| temper_store::Model {
            id: Uuid::new_v4(),
            team: team.into(),
            project: project.into(),
            name: name.into(),
            base_model: "base".into(),
            run_id: Uuid::new_v4().to_string(),
            created_at: 0,
        };
        let seed = adapter_seed(&model("t", "p", "agent"));
        assert_eq!(seed, adapter_seed(&model("t", "p", "agent")));
        for other in [
            model("t", "p", "agent2"),
            model("t", "pa", "gent"),
            model("u", "p", "agent"),
        ] {
            assert_ne!(seed, adapter_seed(&other));
        }
    }
}
