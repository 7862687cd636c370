//! Wire types of the preview training API (training.md): request bodies and queries as sent,
//! answers exactly as the spec shapes them.

use serde::{Deserialize, Serialize};
use serde_json::Value;
use temper_store::{Checkpoint, Event, Job, Model};
use temper_train::LogGroup;

/// `POST /v1/preview/models`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateModelRequest {
    /// The team; `null` = the key's team.
    #[serde(default)]
    pub entity: Option<String>,
    pub project: String,
    pub name: String,
    pub base_model: String,
    #[serde(default)]
    pub return_existing: bool,
}

#[derive(Debug, Serialize)]
pub struct ModelJson {
    pub id: String,
    pub entity: String,
    pub project: String,
    pub name: String,
    pub base_model: String,
    pub run_id: String,
}

impl From<&Model> for ModelJson {
    fn from(m: &Model) -> Self {
        ModelJson {
            id: m.id.to_string(),
            entity: m.team.clone(),
            project: m.project.clone(),
            name: m.name.clone(),
            base_model: m.base_model.clone(),
            run_id: m.run_id.clone(),
        }
    }
}

#[derive(Debug, Serialize)]
pub struct ModelListJson {
    pub object: &'static str,
    pub data: Vec<ModelJson>,
}

#[derive(Debug, Serialize)]
pub struct DeletedModelJson {
    pub model_id: String,
    pub deleted_checkpoints: u64,
    pub deleted_run: bool,
}

/// `GET /v1/preview/models/{id}/checkpoints` query.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CheckpointQuery {
    pub after: Option<String>,
    pub limit: Option<String>,
    pub order: Option<String>,
}

#[derive(Debug, Serialize)]
pub struct CheckpointJson {
    pub id: String,
    pub step: i64,
    pub metrics: Value,
}

impl From<Checkpoint> for CheckpointJson {
    fn from(c: Checkpoint) -> Self {
        CheckpointJson {
            id: c.id.to_string(),
            step: c.step,
            metrics: c.metrics,
        }
    }
}

/// A cursor-paginated list: `first_id`/`last_id` are the page's ends (`null` when empty); the
/// next page is `after=<last_id>`.
#[derive(Debug, Serialize)]
pub struct CursorPage<T> {
    pub object: &'static str,
    pub data: Vec<T>,
    pub first_id: Option<String>,
    pub last_id: Option<String>,
    pub has_more: bool,
}

impl<T> CursorPage<T> {
    pub fn new(data: Vec<T>, has_more: bool, id: impl Fn(&T) -> &str) -> Self {
        CursorPage {
            object: "list",
            first_id: data.first().map(|x| id(x).to_owned()),
            last_id: data.last().map(|x| id(x).to_owned()),
            data,
            has_more,
        }
    }
}

/// `DELETE /v1/preview/models/{id}/checkpoints`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeleteCheckpointsRequest {
    pub steps: Vec<i64>,
}

#[derive(Debug, Serialize)]
pub struct DeletedCheckpointsJson {
    pub deleted_count: u64,
    pub not_found_steps: Vec<i64>,
}

/// `POST /v1/preview/training-jobs`: the trainer's request plus the model.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateJobRequest {
    pub model_id: String,
    pub trajectory_groups: Vec<temper_train::TrajectoryGroup>,
    #[serde(default)]
    pub experimental_config: Option<temper_train::ExperimentalConfig>,
}

/// `POST /v1/preview/sft-training-jobs`. `trajectories` is optional here only so that a body
/// with ART's `training_data_url` instead gets a 400 saying what to send.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateSftJobRequest {
    pub model_id: String,
    #[serde(default)]
    pub trajectories: Option<Vec<temper_train::SftTrajectory>>,
    #[serde(default)]
    pub training_data_url: Option<String>,
    #[serde(default)]
    pub config: Option<temper_train::SftConfig>,
}

#[derive(Debug, Serialize)]
pub struct JobCreatedJson {
    pub id: String,
}

#[derive(Debug, Serialize)]
pub struct JobJson {
    pub id: String,
    pub model_id: String,
    /// `rl` or `sft`.
    pub kind: &'static str,
    pub status: &'static str,
    /// The checkpoint step the job made (or, when nothing was learned, the unchanged step).
    pub step: Option<i64>,
    pub error: Option<String>,
    pub created_at: i64,
    pub started_at: Option<i64>,
    pub finished_at: Option<i64>,
}

impl From<Job> for JobJson {
    fn from(j: Job) -> Self {
        JobJson {
            id: j.id.to_string(),
            model_id: j.model_id.to_string(),
            kind: j.kind.as_str(),
            status: j.status.as_str(),
            step: j.step,
            error: j.error,
            created_at: j.created_at,
            started_at: j.started_at,
            finished_at: j.finished_at,
        }
    }
}

/// `GET /v1/preview/training-jobs` query.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobQuery {
    pub model_id: Option<String>,
    pub after: Option<String>,
    pub limit: Option<String>,
}

/// `GET /v1/preview/training-jobs/{id}/events` query.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EventQuery {
    pub after: Option<String>,
    pub limit: Option<String>,
}

#[derive(Debug, Serialize)]
pub struct EventJson {
    pub id: i64,
    pub r#type: String,
    pub data: Value,
    pub created_at: i64,
}

impl From<Event> for EventJson {
    fn from(e: Event) -> Self {
        EventJson {
            id: e.id,
            r#type: e.kind,
            data: e.data,
            created_at: e.created_at,
        }
    }
}

#[derive(Debug, Serialize)]
pub struct EventListJson {
    pub object: &'static str,
    pub data: Vec<EventJson>,
    pub has_more: bool,
}

/// `POST /v1/preview/models/{id}/log`: only what the metrics need is read of each trajectory
/// (its reward and numeric `metrics`); the rest of it is accepted as the training body has it.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LogRequest {
    pub model_id: String,
    pub trajectory_groups: Vec<LogGroup>,
    pub split: String,
}
