//! Training jobs (a durable queue, in order per model) and their events.
//!
//! A job is accepted only once its row is committed, so an acknowledged job survives a crash.
//! State changes are conditional updates: a worker finishing a job that was cancelled (or whose
//! model was deleted) meanwhile gets [`Error::JobState`] instead of overwriting the outcome.
//!
//! Workers hold the jobs they run by leases: a claim names the worker and when its lease ends,
//! the worker renews it while the job runs, and every write of the worker is conditional on
//! still holding it ([`Error::LeaseLost`] otherwise). A job whose lease has ended goes back to
//! the queue ([`Store::requeue_expired_leases`]), so a dead worker's job runs elsewhere and the
//! dead worker, should it come back, changes nothing. On PostgreSQL the claim skips rows other
//! workers are locking (`FOR UPDATE SKIP LOCKED`), and a unique index allows one running job
//! per model.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use sqlx::any::AnyRow;
use sqlx::Row;
use uuid::Uuid;

use crate::idempotency::{complete, IdempotencyKey};
use crate::models::insert_checkpoint;
use crate::usage::add_trained_tokens;
use crate::{
    check_limit, invalid, locking, now, page, parse_json, parse_uuid, seconds_from, Checkpoint,
    Error, Page, Result, Store,
};

/// Event types (training.md), and the ones the store itself writes.
pub mod event {
    pub const TRAINING_STARTED: &str = "training_started";
    pub const GRADIENT_STEP: &str = "gradient_step";
    pub const TRAINING_ENDED: &str = "training_ended";
    /// Also written on cancellation and model deletion, so a client polling for the end of a
    /// job always sees one.
    pub const TRAINING_FAILED: &str = "training_failed";
    /// A running job put back in the queue after a restart, or once the lease of the worker
    /// running it expired; it is re-run from its start.
    pub const TRAINING_REQUEUED: &str = "training_requeued";
    /// A running job put back in the queue by a graceful shutdown; it is re-run from its start
    /// and that run does not count as an attempt.
    pub const TRAINING_REQUEUED_AT_SHUTDOWN: &str = "training_requeued_at_shutdown";
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JobStatus {
    Queued,
    Running,
    Succeeded,
    Failed,
    Cancelled,
}

/// Counts over all jobs (see `Store::training_totals`).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct TrainingTotals {
    /// Jobs per status that has any.
    pub jobs_by_status: Vec<(String, u64)>,
    pub succeeded_jobs: u64,
    /// Summed over succeeded jobs, from start to finish (whole seconds as stored).
    pub succeeded_job_seconds: u64,
    /// `gradient_step` events recorded.
    pub gradient_steps: u64,
    /// Their `num_trainable_tokens`, summed.
    pub trained_tokens: u64,
}

impl JobStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            JobStatus::Queued => "queued",
            JobStatus::Running => "running",
            JobStatus::Succeeded => "succeeded",
            JobStatus::Failed => "failed",
            JobStatus::Cancelled => "cancelled",
        }
    }

    pub fn is_finished(self) -> bool {
        matches!(
            self,
            JobStatus::Succeeded | JobStatus::Failed | JobStatus::Cancelled
        )
    }
}

impl fmt::Display for JobStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for JobStatus {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s {
            "queued" => JobStatus::Queued,
            "running" => JobStatus::Running,
            "succeeded" => JobStatus::Succeeded,
            "failed" => JobStatus::Failed,
            "cancelled" => JobStatus::Cancelled,
            _ => return Err(Error::Corrupt(format!("job status {s:?}"))),
        })
    }
}

/// What a job trains, stored with it: the worker reads its request as this kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JobKind {
    /// `POST /v1/preview/training-jobs`: trajectory groups and rewards.
    Rl,
    /// `POST /v1/preview/sft-training-jobs`: supervised fine-tuning on the assistant turns.
    Sft,
}

impl JobKind {
    pub fn as_str(self) -> &'static str {
        match self {
            JobKind::Rl => "rl",
            JobKind::Sft => "sft",
        }
    }
}

impl FromStr for JobKind {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "rl" => Ok(JobKind::Rl),
            "sft" => Ok(JobKind::Sft),
            _ => Err(Error::Corrupt(format!("job kind {s:?}"))),
        }
    }
}

/// A job without its request payload (see [`Store::job_request`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Job {
    pub id: Uuid,
    pub model_id: Uuid,
    pub team: String,
    pub kind: JobKind,
    pub status: JobStatus,
    /// The checkpoint step the job ended at; `None` until it succeeds.
    pub step: Option<i64>,
    pub error: Option<String>,
    pub created_at: i64,
    pub started_at: Option<i64>,
    pub finished_at: Option<i64>,
    /// How many times a worker has started the job, less the runs a graceful shutdown stopped
    /// (see [`Store::requeue_at_shutdown`]). A job still `running` whose worker is gone has been
    /// interrupted this many times in a row (see [`Store::recover_after_crash`] and
    /// [`Store::requeue_expired_leases`]).
    pub attempts: u32,
    /// The worker running the job (`None` unless it is running).
    pub lease_owner: Option<String>,
    /// When that worker's lease ends unless renewed (unix seconds; `None` unless running).
    pub lease_expires_at: Option<i64>,
}

/// What [`Store::recover_after_crash`] or [`Store::requeue_expired_leases`] did with the running
/// jobs that lost their worker, oldest first.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Recovery {
    /// Put back in the queue, each with a `training_requeued` event.
    pub requeued: Vec<Uuid>,
    /// Failed for having lost their worker at `max_attempts` attempts in a row, each with a
    /// `training_failed` event.
    pub failed: Vec<Uuid>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    /// Increases over the whole store: the `after` cursor.
    pub id: i64,
    pub job_id: Uuid,
    /// The event's `type`.
    pub kind: String,
    pub data: serde_json::Value,
    pub created_at: i64,
}

macro_rules! job_columns {
    () => {
        "id, model_id, team, kind, status, step, error, created_at, started_at, finished_at, \
         attempts, lease_owner, lease_expires_at"
    };
}

fn job(row: &AnyRow) -> Result<Job> {
    let attempts: i64 = row.try_get("attempts")?;
    Ok(Job {
        id: parse_uuid(row.try_get("id")?)?,
        model_id: parse_uuid(row.try_get("model_id")?)?,
        team: row.try_get("team")?,
        kind: row.try_get::<&str, _>("kind")?.parse()?,
        status: row.try_get::<&str, _>("status")?.parse()?,
        step: row.try_get("step")?,
        error: row.try_get("error")?,
        created_at: row.try_get("created_at")?,
        started_at: row.try_get("started_at")?,
        finished_at: row.try_get("finished_at")?,
        attempts: u32::try_from(attempts)
            .map_err(|_| Error::Corrupt(format!("job attempts {attempts}")))?,
        lease_owner: row.try_get("lease_owner")?,
        lease_expires_at: row.try_get("lease_expires_at")?,
    })
}

fn event_row(row: &AnyRow) -> Result<Event> {
    Ok(Event {
        id: row.try_get("id")?,
        job_id: parse_uuid(row.try_get("job_id")?)?,
        kind: row.try_get("type")?,
        data: parse_json(row.try_get("data")?)?,
        created_at: row.try_get("created_at")?,
    })
}

/// Appends an event. The caller holds the job's row (on PostgreSQL, locked by the update or the
/// `FOR UPDATE` before it), so one job's event ids rise in commit order and a reader's `after`
/// cursor never skips one.
pub(crate) async fn insert_event(
    conn: &mut sqlx::AnyConnection,
    job_id: &str,
    kind: &str,
    data: &serde_json::Value,
    at: i64,
) -> Result<Event> {
    let id: i64 = sqlx::query_scalar(
        "INSERT INTO job_events (job_id, type, data, created_at) VALUES ($1, $2, $3, $4) \
         RETURNING id",
    )
    .bind(job_id)
    .bind(kind)
    .bind(data.to_string())
    .bind(at)
    .fetch_one(conn)
    .await?;
    Ok(Event {
        id,
        job_id: parse_uuid(job_id)?,
        kind: kind.to_owned(),
        data: data.clone(),
        created_at: at,
    })
}

/// Why running jobs lost their worker (the text of what happens to them).
#[derive(Debug, Clone, Copy)]
enum Interruption {
    /// The single server restarted ([`Store::recover_after_crash`]).
    Restart,
    /// The worker's lease expired ([`Store::requeue_expired_leases`]).
    LeaseExpired,
}

/// A running job that lost its worker, as selected for [`requeue_or_fail`].
type Interrupted = (String, i64, Option<String>);

/// Puts each job back in the queue with a `training_requeued` event (re-run from its start; its
/// partial weights are the trainer's to discard), or fails it with a `training_failed` event
/// when it was interrupted at `max_attempts` attempts in a row, instead of taking down its
/// workers over and over. The caller holds the rows (see [`insert_event`]).
async fn requeue_or_fail(
    conn: &mut sqlx::AnyConnection,
    jobs: &[Interrupted],
    max_attempts: u32,
    cause: Interruption,
    at: i64,
) -> Result<Recovery> {
    let mut recovery = Recovery::default();
    for (id, attempts, worker) in jobs {
        let worker = worker.as_deref().unwrap_or("unknown");
        if *attempts >= i64::from(max_attempts) {
            let error_message = match cause {
                Interruption::Restart => format!(
                    "the job was running when the server crashed or was killed {attempts} times \
                     in a row (the limit is {max_attempts} attempts): it is failed instead of \
                     re-run, since it may be what brings the server down"
                ),
                Interruption::LeaseExpired => format!(
                    "the job's worker was lost while running it {attempts} times in a row (the \
                     lease of worker {worker} expired; the limit is {max_attempts} attempts): it \
                     is failed instead of re-run, since it may be what brings its workers down"
                ),
            };
            sqlx::query(
                "UPDATE training_jobs SET status = 'failed', error = $1, finished_at = $2, \
                 lease_owner = NULL, lease_expires_at = NULL WHERE id = $3",
            )
            .bind(&error_message)
            .bind(at)
            .bind(id)
            .execute(&mut *conn)
            .await?;
            let data = serde_json::json!({
                "error_message": error_message,
                "attempts": attempts,
            });
            insert_event(conn, id, event::TRAINING_FAILED, &data, at).await?;
            recovery.failed.push(parse_uuid(id)?);
        } else {
            sqlx::query(
                "UPDATE training_jobs SET status = 'queued', started_at = NULL, step = NULL, \
                 lease_owner = NULL, lease_expires_at = NULL WHERE id = $1",
            )
            .bind(id)
            .execute(&mut *conn)
            .await?;
            let data = match cause {
                Interruption::Restart => serde_json::json!({
                    "message": "the server restarted while this job was running: its partial \
                                weights are discarded and it is re-run from its start",
                    "attempts": attempts,
                    "max_attempts": max_attempts,
                }),
                Interruption::LeaseExpired => serde_json::json!({
                    "message": format!(
                        "the lease of worker {worker} on this job expired (the worker stopped \
                         renewing it: it crashed, was killed, hung or lost the database): its \
                         partial weights are discarded and it is re-run from its start"
                    ),
                    "worker": worker,
                    "attempts": attempts,
                    "max_attempts": max_attempts,
                }),
            };
            insert_event(conn, id, event::TRAINING_REQUEUED, &data, at).await?;
            recovery.requeued.push(parse_uuid(id)?);
        }
    }
    Ok(recovery)
}

impl Store {
    async fn insert_job(
        &self,
        conn: &mut sqlx::AnyConnection,
        team: &str,
        model_id: Uuid,
        kind: JobKind,
        request: &str,
    ) -> Result<Job> {
        serde_json::from_str::<serde::de::IgnoredAny>(request)
            .map_err(|e| invalid("request", format!("not JSON: {e}")))?;
        let job = Job {
            id: Uuid::new_v4(),
            model_id,
            team: team.to_owned(),
            kind,
            status: JobStatus::Queued,
            step: None,
            error: None,
            created_at: now(),
            started_at: None,
            finished_at: None,
            attempts: 0,
            lease_owner: None,
            lease_expires_at: None,
        };
        // Concurrent posts of a team take turns on PostgreSQL (this lock; FOR NO KEY UPDATE
        // leaves the team's foreign keys free), so each one counts the jobs the previous one
        // queued.
        sqlx::query(self.sql(locking!(
            "SELECT 1 FROM teams WHERE name = $1",
            "FOR NO KEY UPDATE"
        )))
        .bind(team)
        .execute(&mut *conn)
        .await?;
        // The model's row, shared until this commits: a deletion of the model waits for this
        // job, then fails it (see `delete_model`).
        sqlx::query(self.sql(locking!(
            "SELECT 1 FROM models WHERE id = $1 AND team = $2",
            "FOR KEY SHARE"
        )))
        .bind(model_id.to_string())
        .bind(team)
        .execute(&mut *conn)
        .await?;
        let max_queued = self.max_queued_jobs_per_team;
        // One statement: the model check, the team's queue bound and the insert cannot race a
        // deletion or another post.
        let inserted = sqlx::query(
            "INSERT INTO training_jobs (id, model_id, team, kind, status, request, created_at) \
             SELECT $1, id, team, $2, 'queued', $3, $4 FROM models WHERE id = $5 AND team = $6 \
             AND (SELECT count(*) FROM training_jobs WHERE team = $6 AND status = 'queued') < $7",
        )
        .bind(job.id.to_string())
        .bind(kind.as_str())
        .bind(request)
        .bind(job.created_at)
        .bind(model_id.to_string())
        .bind(team)
        .bind(max_queued.map_or(i64::MAX, i64::from))
        .execute(&mut *conn)
        .await?
        .rows_affected();
        if inserted == 0 {
            let model_exists: Option<String> =
                sqlx::query_scalar("SELECT id FROM models WHERE id = $1 AND team = $2")
                    .bind(model_id.to_string())
                    .bind(team)
                    .fetch_optional(&mut *conn)
                    .await?;
            return Err(match (model_exists, max_queued) {
                (Some(_), Some(limit)) => Error::TeamQueueFull {
                    team: team.to_owned(),
                    limit,
                },
                _ => Error::NotFound("model"),
            });
        }
        Ok(job)
    }
}

/// Why a worker's write to a job was refused: the job ended or went back to the queue
/// ([`Error::JobState`]), or runs under another worker now ([`Error::LeaseLost`]).
async fn not_held_error(conn: &mut sqlx::AnyConnection, id: Uuid, worker: &str) -> Error {
    match state_error(conn, id).await {
        Error::JobState {
            status: JobStatus::Running,
            ..
        } => Error::LeaseLost {
            id,
            worker: worker.to_owned(),
        },
        e => e,
    }
}

/// The job's current state, to explain a refused transition.
async fn state_error(conn: &mut sqlx::AnyConnection, id: Uuid) -> Error {
    let status: std::result::Result<Option<String>, _> =
        sqlx::query_scalar("SELECT status FROM training_jobs WHERE id = $1")
            .bind(id.to_string())
            .fetch_optional(conn)
            .await;
    match status {
        Ok(Some(s)) => match s.parse() {
            Ok(status) => Error::JobState { id, status },
            Err(e) => e,
        },
        Ok(None) => Error::NotFound("training job"),
        Err(e) => e.into(),
    }
}

impl Store {
    /// Queues a job for one of the team's models, storing the request body (JSON) as posted.
    /// Returns once the job is committed to disk.
    pub async fn enqueue_job(
        &self,
        team: &str,
        model_id: Uuid,
        kind: JobKind,
        request: &str,
    ) -> Result<Job> {
        let mut tx = self.write_tx().await?;
        let job = self
            .insert_job(&mut tx, team, model_id, kind, request)
            .await?;
        tx.commit().await?;
        Ok(job)
    }

    /// [`Store::enqueue_job`] for a request holding a claimed `Idempotency-Key`: the job and the
    /// answer `{"id": <job id>}` for the key's retries are committed together, so no crash can
    /// leave a job whose retry would queue it again.
    pub async fn enqueue_job_idempotent(
        &self,
        team: &str,
        model_id: Uuid,
        kind: JobKind,
        request: &str,
        key: IdempotencyKey<'_>,
    ) -> Result<Job> {
        let mut tx = self.write_tx().await?;
        let job = self
            .insert_job(&mut tx, team, model_id, kind, request)
            .await?;
        let answer = serde_json::json!({ "id": job.id.to_string() }).to_string();
        complete(&mut tx, key, 200, answer.as_bytes()).await?;
        tx.commit().await?;
        Ok(job)
    }

    pub async fn get_job(&self, team: &str, id: Uuid) -> Result<Job> {
        let row = sqlx::query(concat!(
            "SELECT ",
            job_columns!(),
            " FROM training_jobs WHERE id = $1 AND team = $2"
        ))
        .bind(id.to_string())
        .bind(team)
        .fetch_optional(&self.pool)
        .await?;
        row.as_ref()
            .map(job)
            .unwrap_or(Err(Error::NotFound("training job")))
    }

    /// Totals over every team's jobs, for `/metrics`.
    pub async fn training_totals(&self) -> Result<TrainingTotals> {
        let mut totals = TrainingTotals::default();
        for row in sqlx::query(
            "SELECT status, COUNT(*) FROM training_jobs GROUP BY status ORDER BY status",
        )
        .fetch_all(&self.pool)
        .await?
        {
            let status: String = row.try_get(0)?;
            totals
                .jobs_by_status
                .push((status, row.try_get::<i64, _>(1)? as u64));
        }
        // Sums cast back to BIGINT: PostgreSQL sums integers into NUMERIC.
        let row = sqlx::query(
            "SELECT COUNT(*), CAST(COALESCE(SUM(finished_at - started_at), 0) AS BIGINT) \
             FROM training_jobs \
             WHERE status = 'succeeded' AND started_at IS NOT NULL AND finished_at IS NOT NULL",
        )
        .fetch_one(&self.pool)
        .await?;
        totals.succeeded_jobs = row.try_get::<i64, _>(0)? as u64;
        totals.succeeded_job_seconds = row.try_get::<i64, _>(1)? as u64;
        let row = sqlx::query(self.sql(crate::Dialects {
            sqlite: "SELECT COUNT(*), \
                     CAST(COALESCE(SUM(json_extract(data, '$.num_trainable_tokens')), 0) \
                     AS BIGINT) FROM job_events WHERE type = 'gradient_step'",
            postgres: "SELECT COUNT(*), \
                       CAST(COALESCE(SUM(CAST(CAST(data AS JSONB) ->> 'num_trainable_tokens' \
                       AS NUMERIC)), 0) AS BIGINT) FROM job_events WHERE type = 'gradient_step'",
        }))
        .fetch_one(&self.pool)
        .await?;
        totals.gradient_steps = row.try_get::<i64, _>(0)? as u64;
        totals.trained_tokens = row.try_get::<i64, _>(1)? as u64;
        Ok(totals)
    }

    /// A team's jobs, newest first, optionally of one model. `after` is the id of the last job
    /// of the previous page.
    pub async fn list_jobs(
        &self,
        team: &str,
        model_id: Option<Uuid>,
        after: Option<Uuid>,
        limit: u32,
    ) -> Result<Page<Job>> {
        let limit = check_limit(limit)?;
        let before = match after {
            None => i64::MAX,
            Some(after) => {
                let seq: Option<i64> =
                    sqlx::query_scalar("SELECT seq FROM training_jobs WHERE id = $1 AND team = $2")
                        .bind(after.to_string())
                        .bind(team)
                        .fetch_optional(&self.pool)
                        .await?;
                seq.ok_or_else(|| invalid("after", format!("no training job {after}")))?
            }
        };
        let rows = sqlx::query(concat!(
            "SELECT ",
            job_columns!(),
            " FROM training_jobs WHERE team = $1 AND ($2 IS NULL OR model_id = $2) \
             AND seq < $3 ORDER BY seq DESC LIMIT $4"
        ))
        .bind(team)
        .bind(model_id.map(|m| m.to_string()))
        .bind(before)
        .bind(limit + 1)
        .fetch_all(&self.pool)
        .await?;
        let items = rows.iter().map(job).collect::<Result<Vec<_>>>()?;
        Ok(page(items, limit))
    }

    /// The request body a job was posted with (for the worker).
    pub async fn job_request(&self, id: Uuid) -> Result<String> {
        let request: Option<String> =
            sqlx::query_scalar("SELECT request FROM training_jobs WHERE id = $1")
                .bind(id.to_string())
                .fetch_optional(&self.pool)
                .await?;
        request.ok_or(Error::NotFound("training job"))
    }

    /// Claims the oldest runnable queued job for `worker`: marks it running under a lease of
    /// `lease` (to renew with [`Store::renew_lease`] before it ends), counts the attempt, and
    /// returns it. A job is runnable when its model has no running job and no older queued job,
    /// so each model's jobs run one at a time, in order, however many workers claim at once;
    /// two workers never get the same job.
    pub async fn claim_next_job(&self, worker: &str, lease: Duration) -> Result<Option<Job>> {
        let at = now();
        let claimed = sqlx::query(self.sql(locking!(
            concat!(
                "UPDATE training_jobs SET status = 'running', started_at = $1, \
                 attempts = attempts + 1, lease_owner = $2, lease_expires_at = $3 WHERE seq = \
                 (SELECT q.seq FROM training_jobs q WHERE q.status = 'queued' AND NOT EXISTS \
                   (SELECT 1 FROM training_jobs r WHERE r.model_id = q.model_id \
                    AND (r.status = 'running' OR (r.status = 'queued' AND r.seq < q.seq))) \
                  ORDER BY q.seq LIMIT 1"
            ),
            // Another worker's candidate is skipped, not waited for; its model's later jobs
            // stay behind it, being queued and older.
            "FOR UPDATE SKIP LOCKED",
            concat!(") RETURNING ", job_columns!())
        )))
        .bind(at)
        .bind(worker)
        .bind(seconds_from(at, lease))
        .fetch_optional(&self.pool)
        .await;
        match claimed {
            Ok(row) => row.as_ref().map(job).transpose(),
            // The one-running-job-per-model index refused a race this query's snapshot could
            // not see: nothing claimed this time, the next claim looks again.
            Err(sqlx::Error::Database(e)) if e.is_unique_violation() => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// Extends `worker`'s lease on a job it runs to `lease` from now. [`Error::JobState`] when
    /// the job ended (cancelled, its model deleted) or was re-queued, [`Error::LeaseLost`] when
    /// another worker runs it now: either way this worker stops.
    pub async fn renew_lease(&self, job_id: Uuid, worker: &str, lease: Duration) -> Result<()> {
        let renewed = sqlx::query(
            "UPDATE training_jobs SET lease_expires_at = $1 \
             WHERE id = $2 AND status = 'running' AND lease_owner = $3",
        )
        .bind(seconds_from(now(), lease))
        .bind(job_id.to_string())
        .bind(worker)
        .execute(&self.pool)
        .await?
        .rows_affected();
        if renewed == 0 {
            let mut conn = self.pool.acquire().await?;
            return Err(not_held_error(&mut conn, job_id, worker).await);
        }
        Ok(())
    }

    /// Appends an event to a job `worker` runs. A job it no longer holds (cancelled, its model
    /// deleted, its lease lost) is `JobState` or `LeaseLost`: the worker's signal to stop. A
    /// `gradient_step` event's `num_trainable_tokens` is added to its model's team and project
    /// usage in the same transaction, so a step is counted exactly when its event is stored.
    pub async fn append_event(
        &self,
        job_id: Uuid,
        worker: &str,
        kind: &str,
        data: &serde_json::Value,
    ) -> Result<Event> {
        let mut tx = self.write_tx().await?;
        let held: Option<i64> = sqlx::query_scalar(self.sql(locking!(
            "SELECT 1 FROM training_jobs \
             WHERE id = $1 AND status = 'running' AND lease_owner = $2",
            "FOR UPDATE"
        )))
        .bind(job_id.to_string())
        .bind(worker)
        .fetch_optional(&mut *tx)
        .await?;
        if held.is_none() {
            return Err(not_held_error(&mut tx, job_id, worker).await);
        }
        let at = now();
        let event = insert_event(&mut tx, &job_id.to_string(), kind, data, at).await?;
        if kind == event::GRADIENT_STEP {
            add_trained_tokens(&mut tx, &job_id.to_string(), data, at).await?;
        }
        tx.commit().await?;
        Ok(event)
    }

    /// Ends a job `worker` runs successfully, in one transaction: records `step`, adds the
    /// checkpoint at that step with `checkpoint_metrics` (`None`: nothing was learned, no new
    /// checkpoint) and appends `training_ended` with `data`. A job the worker no longer holds is
    /// `JobState` or `LeaseLost`, and nothing is written.
    pub async fn succeed_job(
        &self,
        job_id: Uuid,
        worker: &str,
        step: i64,
        checkpoint_metrics: Option<serde_json::Value>,
        data: &serde_json::Value,
    ) -> Result<(Job, Option<Checkpoint>)> {
        let at = now();
        let mut tx = self.write_tx().await?;
        // The model before the job, as `delete_model` locks them (the checkpoint's foreign key
        // would take the model's row after the job's otherwise, and the two could deadlock).
        sqlx::query(self.sql(locking!(
            "SELECT 1 FROM models \
             WHERE id = (SELECT model_id FROM training_jobs WHERE id = $1)",
            "FOR KEY SHARE"
        )))
        .bind(job_id.to_string())
        .execute(&mut *tx)
        .await?;
        let row = sqlx::query(concat!(
            "UPDATE training_jobs SET status = 'succeeded', step = $1, finished_at = $2, \
             lease_owner = NULL, lease_expires_at = NULL \
             WHERE id = $3 AND status = 'running' AND lease_owner = $4 RETURNING ",
            job_columns!()
        ))
        .bind(step)
        .bind(at)
        .bind(job_id.to_string())
        .bind(worker)
        .fetch_optional(&mut *tx)
        .await?;
        let Some(row) = row else {
            return Err(not_held_error(&mut tx, job_id, worker).await);
        };
        let job = job(&row)?;
        let added = match checkpoint_metrics {
            Some(metrics) => {
                Some(insert_checkpoint(&mut tx, job.model_id, step, &metrics, at).await?)
            }
            None => None,
        };
        insert_event(
            &mut tx,
            &job_id.to_string(),
            event::TRAINING_ENDED,
            data,
            at,
        )
        .await?;
        tx.commit().await?;
        Ok((job, added))
    }

    /// Ends a job `worker` runs as failed and appends `training_failed {error_message}`; a job
    /// it no longer holds is `JobState` or `LeaseLost`.
    pub async fn fail_job(&self, job_id: Uuid, worker: &str, error_message: &str) -> Result<Job> {
        let at = now();
        let mut tx = self.write_tx().await?;
        let row = sqlx::query(concat!(
            "UPDATE training_jobs SET status = 'failed', error = $1, finished_at = $2, \
             lease_owner = NULL, lease_expires_at = NULL \
             WHERE id = $3 AND status = 'running' AND lease_owner = $4 RETURNING ",
            job_columns!()
        ))
        .bind(error_message)
        .bind(at)
        .bind(job_id.to_string())
        .bind(worker)
        .fetch_optional(&mut *tx)
        .await?;
        let Some(row) = row else {
            return Err(not_held_error(&mut tx, job_id, worker).await);
        };
        let data = serde_json::json!({ "error_message": error_message });
        insert_event(
            &mut tx,
            &job_id.to_string(),
            event::TRAINING_FAILED,
            &data,
            at,
        )
        .await?;
        tx.commit().await?;
        job(&row)
    }

    /// Cancels a queued or running job (`training_failed` says so); a finished job is
    /// `JobState`.
    pub async fn cancel_job(&self, team: &str, id: Uuid) -> Result<Job> {
        let at = now();
        let mut tx = self.write_tx().await?;
        let row = sqlx::query(concat!(
            "UPDATE training_jobs SET status = 'cancelled', finished_at = $1, \
             lease_owner = NULL, lease_expires_at = NULL \
             WHERE id = $2 AND team = $3 AND status IN ('queued', 'running') RETURNING ",
            job_columns!()
        ))
        .bind(at)
        .bind(id.to_string())
        .bind(team)
        .fetch_optional(&mut *tx)
        .await?;
        let Some(row) = row else {
            let owned: Option<i64> =
                sqlx::query_scalar("SELECT 1 FROM training_jobs WHERE id = $1 AND team = $2")
                    .bind(id.to_string())
                    .bind(team)
                    .fetch_optional(&mut *tx)
                    .await?;
            if owned.is_none() {
                return Err(Error::NotFound("training job"));
            }
            return Err(state_error(&mut tx, id).await);
        };
        let data = serde_json::json!({ "error_message": "the job was cancelled" });
        insert_event(&mut tx, &id.to_string(), event::TRAINING_FAILED, &data, at).await?;
        tx.commit().await?;
        job(&row)
    }

    /// A job's events after event id `after` (0 or `None`: from the first), oldest first,
    /// `limit` 1 to 100. The same `after` gives the same events.
    pub async fn list_events(
        &self,
        team: &str,
        job_id: Uuid,
        after: Option<i64>,
        limit: u32,
    ) -> Result<Page<Event>> {
        let limit = check_limit(limit)?;
        self.get_job(team, job_id).await?;
        let rows = sqlx::query(
            "SELECT id, job_id, type, data, created_at FROM job_events \
             WHERE job_id = $1 AND id > $2 ORDER BY id LIMIT $3",
        )
        .bind(job_id.to_string())
        .bind(after.unwrap_or(0))
        .bind(limit + 1)
        .fetch_all(&self.pool)
        .await?;
        let items = rows.iter().map(event_row).collect::<Result<Vec<_>>>()?;
        Ok(page(items, limit))
    }

    /// At a graceful shutdown, once `worker` has stopped (or the shutdown's time is up): each
    /// job it runs goes back to the queue with a `training_requeued_at_shutdown` event (it is
    /// re-run from its start) and gets its attempt back, since a shutdown is not a crash. Other
    /// workers' jobs are left alone. Returns the re-queued jobs.
    pub async fn requeue_at_shutdown(&self, worker: &str) -> Result<Vec<Uuid>> {
        let at = now();
        let mut tx = self.write_tx().await?;
        let ids: Vec<String> = sqlx::query_scalar(
            "UPDATE training_jobs SET status = 'queued', started_at = NULL, step = NULL, \
             attempts = CASE WHEN attempts > 0 THEN attempts - 1 ELSE 0 END, \
             lease_owner = NULL, lease_expires_at = NULL \
             WHERE status = 'running' AND lease_owner = $1 RETURNING id",
        )
        .bind(worker)
        .fetch_all(&mut *tx)
        .await?;
        let data = serde_json::json!({
            "message": "the server shut down while this job was running: its partial weights \
                        are discarded and it is re-run from its start; this run does not count \
                        as an attempt",
        });
        for id in &ids {
            insert_event(&mut tx, id, event::TRAINING_REQUEUED_AT_SHUTDOWN, &data, at).await?;
        }
        tx.commit().await?;
        ids.iter().map(|id| parse_uuid(id)).collect()
    }

    /// At start-up of the one server of an SQLite store, before its worker runs (and with the
    /// data directory's lock held, so no other server's running job is taken for a crashed
    /// one): every job a crash left running lost its worker, whatever its lease says. Each goes
    /// back to the queue with a `training_requeued` event (it is re-run from its start), unless
    /// it was running at `max_attempts` crashes in a row: then it fails, with an error and a
    /// `training_failed` event saying so, instead of bringing the server down on every start.
    /// Idempotency keys whose first request never got its answer are released.
    ///
    /// A store that servers share (PostgreSQL) takes [`Store::requeue_expired_leases`] instead:
    /// there, other servers' running jobs are alive.
    pub async fn recover_after_crash(&self, max_attempts: u32) -> Result<Recovery> {
        let at = now();
        let mut tx = self.write_tx().await?;
        let running: Vec<Interrupted> = sqlx::query_as(self.sql(locking!(
            "SELECT id, attempts, lease_owner FROM training_jobs \
             WHERE status = 'running' ORDER BY seq",
            "FOR UPDATE"
        )))
        .fetch_all(&mut *tx)
        .await?;
        let recovery =
            requeue_or_fail(&mut tx, &running, max_attempts, Interruption::Restart, at).await?;
        crate::idempotency::release_unfinished(&mut tx).await?;
        tx.commit().await?;
        Ok(recovery)
    }

    /// Every running job whose worker's lease has ended (it crashed, was killed, hung, or lost
    /// the database) goes back to the queue with a `training_requeued` event naming that worker,
    /// or fails at `max_attempts` attempts in a row, as in [`Store::recover_after_crash`]. Any
    /// worker calls this from time to time; concurrent callers never handle a job twice, and a
    /// lease renewed meanwhile keeps its job. The old worker's next write is refused.
    pub async fn requeue_expired_leases(&self, max_attempts: u32) -> Result<Recovery> {
        let at = now();
        let mut tx = self.write_tx().await?;
        // A running job without a lease predates leases (an SQLite store's upgrade): its
        // worker is gone.
        let expired: Vec<Interrupted> = sqlx::query_as(self.sql(locking!(
            "SELECT id, attempts, lease_owner FROM training_jobs WHERE status = 'running' \
             AND (lease_expires_at IS NULL OR lease_expires_at <= $1) ORDER BY seq",
            "FOR UPDATE SKIP LOCKED"
        )))
        .bind(at)
        .fetch_all(&mut *tx)
        .await?;
        let recovery = requeue_or_fail(
            &mut tx,
            &expired,
            max_attempts,
            Interruption::LeaseExpired,
            at,
        )
        .await?;
        tx.commit().await?;
        Ok(recovery)
    }
}
