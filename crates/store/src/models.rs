//! Trainable models (one per team/project/name) and their checkpoints.

use sqlx::any::AnyRow;
use sqlx::Row;
use uuid::Uuid;

use crate::idempotency::{complete, IdempotencyKey};
use crate::jobs::{event, insert_event};
use crate::{
    check_limit, check_name, ensure_team, hex, invalid, locking, now, page, parse_json, parse_uuid,
    random_bytes, Error, Order, Page, Result, Store,
};

/// What `create_model` needs. `team` is the API's `entity`.
#[derive(Debug, Clone)]
pub struct NewModel<'a> {
    pub team: &'a str,
    pub project: &'a str,
    pub name: &'a str,
    pub base_model: &'a str,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Model {
    pub id: Uuid,
    pub team: String,
    pub project: String,
    pub name: String,
    pub base_model: String,
    pub run_id: String,
    pub created_at: i64,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Checkpoint {
    pub id: Uuid,
    pub model_id: Uuid,
    pub step: i64,
    /// A JSON object.
    pub metrics: serde_json::Value,
    pub created_at: i64,
}

#[derive(Debug, Clone, PartialEq)]
pub struct DeletedModel {
    pub model_id: Uuid,
    pub deleted_checkpoints: u64,
    /// Queued or running jobs of the model, now failed.
    pub failed_jobs: Vec<Uuid>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct DeletedCheckpoints {
    pub deleted_count: u64,
    pub not_found_steps: Vec<i64>,
}

// Macros rather than consts so `concat!` keeps each query a `&'static str` (sqlx refuses
// dynamically built SQL).
macro_rules! model_columns {
    () => {
        "id, team, project, name, base_model, run_id, created_at"
    };
}
macro_rules! checkpoint_columns {
    () => {
        "id, model_id, step, metrics, created_at"
    };
}

fn model(row: &AnyRow) -> Result<Model> {
    Ok(Model {
        id: parse_uuid(row.try_get("id")?)?,
        team: row.try_get("team")?,
        project: row.try_get("project")?,
        name: row.try_get("name")?,
        base_model: row.try_get("base_model")?,
        run_id: row.try_get("run_id")?,
        created_at: row.try_get("created_at")?,
    })
}

pub(crate) fn checkpoint(row: &AnyRow) -> Result<Checkpoint> {
    Ok(Checkpoint {
        id: parse_uuid(row.try_get("id")?)?,
        model_id: parse_uuid(row.try_get("model_id")?)?,
        step: row.try_get("step")?,
        metrics: parse_json(row.try_get("metrics")?)?,
        created_at: row.try_get("created_at")?,
    })
}

/// Inserts a checkpoint row; a taken step is `CheckpointExists`.
pub(crate) async fn insert_checkpoint(
    conn: &mut sqlx::AnyConnection,
    model_id: Uuid,
    step: i64,
    metrics: &serde_json::Value,
    at: i64,
) -> Result<Checkpoint> {
    if !metrics.is_object() {
        return Err(invalid("metrics", "must be a JSON object"));
    }
    let id = Uuid::new_v4();
    let inserted = sqlx::query(
        "INSERT INTO checkpoints (id, model_id, step, metrics, created_at) \
         VALUES ($1, $2, $3, $4, $5)",
    )
    .bind(id.to_string())
    .bind(model_id.to_string())
    .bind(step)
    .bind(metrics.to_string())
    .bind(at)
    .execute(conn)
    .await;
    match inserted {
        Ok(_) => Ok(Checkpoint {
            id,
            model_id,
            step,
            metrics: metrics.clone(),
            created_at: at,
        }),
        Err(sqlx::Error::Database(e)) if e.is_unique_violation() => {
            Err(Error::CheckpointExists { model_id, step })
        }
        Err(sqlx::Error::Database(e)) if e.is_foreign_key_violation() => {
            Err(Error::NotFound("model"))
        }
        Err(e) => Err(e.into()),
    }
}

/// A claimed `Idempotency-Key` and how the answer to remember is made of the checkpoint.
pub type CheckpointAnswer<'a> = (
    IdempotencyKey<'a>,
    &'a (dyn Fn(&Checkpoint) -> Vec<u8> + Sync),
);

/// A checkpoint being imported ([`Store::begin_checkpoint_import`]): a write transaction that
/// holds the model (no job can be queued for it, no other import or deletion can run) until
/// [`CheckpointImport::commit`]; dropped, it changes nothing.
pub struct CheckpointImport {
    tx: sqlx::Transaction<'static, sqlx::Any>,
    model_id: Uuid,
    /// The step the checkpoint gets: the latest + 1. Its adapter is stored under this step
    /// before the commit.
    pub step: i64,
}

impl CheckpointImport {
    /// Adds the checkpoint at [`CheckpointImport::step`] with `metrics`, and with a claimed
    /// `Idempotency-Key` the answer `answer` makes of it, in the same transaction.
    pub async fn commit(
        mut self,
        metrics: &serde_json::Value,
        idempotency: Option<CheckpointAnswer<'_>>,
    ) -> Result<Checkpoint> {
        let checkpoint =
            insert_checkpoint(&mut self.tx, self.model_id, self.step, metrics, now()).await?;
        if let Some((key, answer)) = idempotency {
            complete(&mut self.tx, key, 200, &answer(&checkpoint)).await?;
        }
        self.tx.commit().await?;
        Ok(checkpoint)
    }
}

impl Store {
    /// Starts importing a checkpoint of one of the team's models as its next step. The model
    /// row is locked (PostgreSQL; SQLite's write transaction holds the whole database), so a
    /// job queued after this waits for the commit and then trains from the imported step; a
    /// model with a queued or running job is [`Error::ModelBusy`]: that job would write the
    /// same step.
    pub async fn begin_checkpoint_import(
        &self,
        team: &str,
        model_id: Uuid,
    ) -> Result<CheckpointImport> {
        let mut tx = self.write_tx().await?;
        let found: Option<String> = sqlx::query_scalar(self.sql(locking!(
            "SELECT id FROM models WHERE id = $1 AND team = $2",
            "FOR UPDATE"
        )))
        .bind(model_id.to_string())
        .bind(team)
        .fetch_optional(&mut *tx)
        .await?;
        if found.is_none() {
            return Err(Error::NotFound("model"));
        }
        let active: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM training_jobs \
             WHERE model_id = $1 AND status IN ('queued', 'running')",
        )
        .bind(model_id.to_string())
        .fetch_one(&mut *tx)
        .await?;
        if active > 0 {
            return Err(Error::ModelBusy { model_id });
        }
        let step: i64 = sqlx::query_scalar(
            "SELECT COALESCE(MAX(step), 0) + 1 FROM checkpoints WHERE model_id = $1",
        )
        .bind(model_id.to_string())
        .fetch_one(&mut *tx)
        .await?;
        Ok(CheckpointImport { tx, model_id, step })
    }

    /// Registers a model with a step-0 checkpoint (the base weights, so `/log` and "latest"
    /// always have a checkpoint). The same team/project/name again is `ModelExists`.
    pub async fn create_model(&self, new: &NewModel<'_>) -> Result<Model> {
        check_name("project", new.project, 64)?;
        check_name("name", new.name, 128)?;
        if new.base_model.is_empty() || new.base_model.len() > 256 {
            return Err(invalid("base_model", "must be 1 to 256 bytes"));
        }
        let model = Model {
            id: Uuid::new_v4(),
            team: new.team.to_owned(),
            project: new.project.to_owned(),
            name: new.name.to_owned(),
            base_model: new.base_model.to_owned(),
            run_id: hex(&random_bytes::<4>()?),
            created_at: now(),
        };
        let mut tx = self.write_tx().await?;
        ensure_team(&mut tx, new.team, model.created_at).await?;
        let inserted = sqlx::query(
            "INSERT INTO models (id, team, project, name, base_model, run_id, created_at) \
             VALUES ($1, $2, $3, $4, $5, $6, $7)",
        )
        .bind(model.id.to_string())
        .bind(&model.team)
        .bind(&model.project)
        .bind(&model.name)
        .bind(&model.base_model)
        .bind(&model.run_id)
        .bind(model.created_at)
        .execute(&mut *tx)
        .await;
        match inserted {
            Ok(_) => {}
            Err(sqlx::Error::Database(e)) if e.is_unique_violation() => {
                return Err(Error::ModelExists {
                    team: model.team,
                    project: model.project,
                    name: model.name,
                })
            }
            Err(e) => return Err(e.into()),
        }
        insert_checkpoint(
            &mut tx,
            model.id,
            0,
            &serde_json::json!({}),
            model.created_at,
        )
        .await?;
        tx.commit().await?;
        Ok(model)
    }

    pub async fn get_model(&self, team: &str, id: Uuid) -> Result<Model> {
        let row = sqlx::query(concat!(
            "SELECT ",
            model_columns!(),
            " FROM models WHERE id = $1 AND team = $2"
        ))
        .bind(id.to_string())
        .bind(team)
        .fetch_optional(&self.pool)
        .await?;
        row.as_ref()
            .map(model)
            .unwrap_or(Err(Error::NotFound("model")))
    }

    /// The model behind an inference name, or `return_existing`.
    pub async fn get_model_by_name(&self, team: &str, project: &str, name: &str) -> Result<Model> {
        let row = sqlx::query(concat!(
            "SELECT ",
            model_columns!(),
            " FROM models WHERE team = $1 AND project = $2 AND name = $3"
        ))
        .bind(team)
        .bind(project)
        .bind(name)
        .fetch_optional(&self.pool)
        .await?;
        row.as_ref()
            .map(model)
            .unwrap_or(Err(Error::NotFound("model")))
    }

    /// A team's models, oldest first.
    pub async fn list_models(&self, team: &str) -> Result<Vec<Model>> {
        let rows = sqlx::query(concat!(
            "SELECT ",
            model_columns!(),
            " FROM models WHERE team = $1 ORDER BY created_at, rowid"
        ))
        .bind(team)
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(model).collect()
    }

    /// Deletes a model and its checkpoints; its queued and running jobs fail (a running job's
    /// worker then finds it no longer running).
    pub async fn delete_model(&self, team: &str, id: Uuid) -> Result<DeletedModel> {
        let at = now();
        let mut tx = self.write_tx().await?;
        // On PostgreSQL the model's row is locked first: a job being queued for it (which holds
        // the row shared) commits before this fails the model's jobs, and none is queued after.
        // Everything that locks a model and a job locks the model first, so none deadlocks.
        let exists: Option<i64> = sqlx::query_scalar(self.sql(locking!(
            "SELECT 1 FROM models WHERE id = $1 AND team = $2",
            "FOR UPDATE"
        )))
        .bind(id.to_string())
        .bind(team)
        .fetch_optional(&mut *tx)
        .await?;
        if exists.is_none() {
            return Err(Error::NotFound("model"));
        }
        let message = "the model was deleted";
        let failed: Vec<String> = sqlx::query_scalar(
            "UPDATE training_jobs SET status = 'failed', error = $1, finished_at = $2, \
             lease_owner = NULL, lease_expires_at = NULL \
             WHERE model_id = $3 AND status IN ('queued', 'running') RETURNING id",
        )
        .bind(message)
        .bind(at)
        .bind(id.to_string())
        .fetch_all(&mut *tx)
        .await?;
        let mut failed_jobs = Vec::with_capacity(failed.len());
        for job in &failed {
            let data = serde_json::json!({ "error_message": message });
            insert_event(&mut tx, job, event::TRAINING_FAILED, &data, at).await?;
            failed_jobs.push(parse_uuid(job)?);
        }
        let deleted_checkpoints = sqlx::query("DELETE FROM checkpoints WHERE model_id = $1")
            .bind(id.to_string())
            .execute(&mut *tx)
            .await?
            .rows_affected();
        sqlx::query("DELETE FROM models WHERE id = $1")
            .bind(id.to_string())
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(DeletedModel {
            model_id: id,
            deleted_checkpoints,
            failed_jobs,
        })
    }

    /// A page of a model's checkpoints by step. `after` is the id of the last checkpoint of the
    /// previous page; `limit` is 1 to 100.
    pub async fn list_checkpoints(
        &self,
        team: &str,
        model_id: Uuid,
        after: Option<Uuid>,
        limit: u32,
        order: Order,
    ) -> Result<Page<Checkpoint>> {
        let limit = check_limit(limit)?;
        self.get_model(team, model_id).await?;
        let cursor = match after {
            None => None,
            Some(after) => {
                let step: Option<i64> = sqlx::query_scalar(
                    "SELECT step FROM checkpoints WHERE model_id = $1 AND id = $2",
                )
                .bind(model_id.to_string())
                .bind(after.to_string())
                .fetch_optional(&self.pool)
                .await?;
                Some(step.ok_or_else(|| invalid("after", format!("no checkpoint {after}")))?)
            }
        };
        let sql = match order {
            Order::Asc => concat!(
                "SELECT ",
                checkpoint_columns!(),
                " FROM checkpoints WHERE model_id = $1 AND step > $2 \
                 ORDER BY step ASC LIMIT $3"
            ),
            Order::Desc => concat!(
                "SELECT ",
                checkpoint_columns!(),
                " FROM checkpoints WHERE model_id = $1 AND step < $2 \
                 ORDER BY step DESC LIMIT $3"
            ),
        };
        let start = cursor.unwrap_or(match order {
            Order::Asc => i64::MIN,
            Order::Desc => i64::MAX,
        });
        let rows = sqlx::query(sql)
            .bind(model_id.to_string())
            .bind(start)
            .bind(limit + 1)
            .fetch_all(&self.pool)
            .await?;
        let items = rows.iter().map(checkpoint).collect::<Result<Vec<_>>>()?;
        Ok(page(items, limit))
    }

    /// One checkpoint (for `…:step<N>`).
    pub async fn get_checkpoint(
        &self,
        team: &str,
        model_id: Uuid,
        step: i64,
    ) -> Result<Checkpoint> {
        self.get_model(team, model_id).await?;
        let row = sqlx::query(concat!(
            "SELECT ",
            checkpoint_columns!(),
            " FROM checkpoints WHERE model_id = $1 AND step = $2"
        ))
        .bind(model_id.to_string())
        .bind(step)
        .fetch_optional(&self.pool)
        .await?;
        row.as_ref()
            .map(checkpoint)
            .unwrap_or(Err(Error::NotFound("checkpoint")))
    }

    /// The highest-step checkpoint, if any is left.
    pub async fn latest_checkpoint(
        &self,
        team: &str,
        model_id: Uuid,
    ) -> Result<Option<Checkpoint>> {
        self.get_model(team, model_id).await?;
        let row = sqlx::query(concat!(
            "SELECT ",
            checkpoint_columns!(),
            " FROM checkpoints WHERE model_id = $1 \
             ORDER BY step DESC LIMIT 1"
        ))
        .bind(model_id.to_string())
        .fetch_optional(&self.pool)
        .await?;
        row.as_ref().map(checkpoint).transpose()
    }

    /// Merges `metrics` (keys replace keys) into the latest checkpoint's metrics (`/log`).
    pub async fn log_metrics(
        &self,
        team: &str,
        model_id: Uuid,
        metrics: serde_json::Map<String, serde_json::Value>,
    ) -> Result<Checkpoint> {
        let mut tx = self.write_tx().await?;
        // Locked on PostgreSQL, so concurrent merges into one checkpoint never lose a key.
        let row = sqlx::query(self.sql(locking!(
            concat!(
                "SELECT ",
                checkpoint_columns!(),
                " FROM checkpoints WHERE model_id = \
                 (SELECT id FROM models WHERE id = $1 AND team = $2) ORDER BY step DESC LIMIT 1"
            ),
            "FOR UPDATE"
        )))
        .bind(model_id.to_string())
        .bind(team)
        .fetch_optional(&mut *tx)
        .await?;
        let Some(row) = row else {
            // Checked on this transaction: a second pool connection could wait on this one.
            let exists: Option<i64> =
                sqlx::query_scalar("SELECT 1 FROM models WHERE id = $1 AND team = $2")
                    .bind(model_id.to_string())
                    .bind(team)
                    .fetch_optional(&mut *tx)
                    .await?;
            return Err(Error::NotFound(if exists.is_some() {
                "checkpoint"
            } else {
                "model"
            }));
        };
        let mut latest = checkpoint(&row)?;
        if let serde_json::Value::Object(map) = &mut latest.metrics {
            map.extend(metrics);
        } else {
            latest.metrics = serde_json::Value::Object(metrics);
        }
        sqlx::query("UPDATE checkpoints SET metrics = $1 WHERE id = $2")
            .bind(latest.metrics.to_string())
            .bind(latest.id.to_string())
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(latest)
    }

    /// Deletes the given steps of a model; steps it does not have are reported, not an error.
    pub async fn delete_checkpoints(
        &self,
        team: &str,
        model_id: Uuid,
        steps: &[i64],
    ) -> Result<DeletedCheckpoints> {
        let mut tx = self.write_tx().await?;
        let exists: Option<i64> =
            sqlx::query_scalar("SELECT 1 FROM models WHERE id = $1 AND team = $2")
                .bind(model_id.to_string())
                .bind(team)
                .fetch_optional(&mut *tx)
                .await?;
        if exists.is_none() {
            return Err(Error::NotFound("model"));
        }
        let mut result = DeletedCheckpoints {
            deleted_count: 0,
            not_found_steps: Vec::new(),
        };
        for &step in steps {
            let n = sqlx::query("DELETE FROM checkpoints WHERE model_id = $1 AND step = $2")
                .bind(model_id.to_string())
                .bind(step)
                .execute(&mut *tx)
                .await?
                .rows_affected();
            if n == 0 {
                // A step listed twice is deleted once and then "not found".
                result.not_found_steps.push(step);
            }
            result.deleted_count += n;
        }
        tx.commit().await?;
        Ok(result)
    }
}
