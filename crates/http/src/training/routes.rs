//! The preview training API (training.md): models, checkpoints, `/log`, training jobs and their
//! events; SFT jobs, which share the jobs' life cycle. Every call acts for the key's team;
//! another team's resources are 404.

use axum::extract::{FromRequestParts, Path, State};
use axum::http::request::Parts;
use axum::{Extension, Json};
use temper_store::JobKind;
use temper_text::{ChatTemplate, Tokenizer};
use uuid::Uuid;

use crate::auth::RequestContext;
use crate::error::ApiError;
use crate::extract::{parse_json, JsonBody, ValidJson, ValidQuery};
use crate::state::AppState;
use crate::training::idempotency::ClaimedKey;
use crate::training::wire::{
    CheckpointJson, CheckpointQuery, CreateJobRequest, CreateModelRequest, CreateSftJobRequest,
    CursorPage, DeleteCheckpointsRequest, DeletedCheckpointsJson, DeletedModelJson, EventJson,
    EventListJson, EventQuery, JobCreatedJson, JobJson, JobQuery, LogGroup, LogRequest, ModelJson,
    ModelListJson,
};

/// Default page size of the list calls.
const DEFAULT_LIMIT: u32 = 20;

/// A UUID from a path or query parameter; anything else is a 400 naming it.
pub fn parse_id(param: &str, value: &str) -> Result<Uuid, ApiError> {
    Uuid::parse_str(value)
        .map_err(|_| ApiError::bad(param, format!("`{param}` must be a UUID, got {value:?}.")))
}

/// The `{id}` of a model route.
pub struct ModelId(pub Uuid);

/// The `{id}` of a training-job route.
pub struct JobId(pub Uuid);

impl<S: Send + Sync> FromRequestParts<S> for ModelId {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        path_id(parts, state, "model_id").await.map(ModelId)
    }
}

impl<S: Send + Sync> FromRequestParts<S> for JobId {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        path_id(parts, state, "job_id").await.map(JobId)
    }
}

/// The route's `{id}` as a UUID. Anything else, a percent-escape that does not decode to UTF-8
/// included, is a 400 naming `param` (not axum's plain-text rejection).
async fn path_id<S: Send + Sync>(
    parts: &mut Parts,
    state: &S,
    param: &str,
) -> Result<Uuid, ApiError> {
    let Path(raw) = Path::<String>::from_request_parts(parts, state)
        .await
        .map_err(|e| {
            ApiError::bad(
                param,
                format!("`{param}` in the URL path is malformed: {}", e.body_text()),
            )
        })?;
    parse_id(param, &raw)
}

fn parse_limit(value: Option<&str>) -> Result<u32, ApiError> {
    let Some(value) = value else {
        return Ok(DEFAULT_LIMIT);
    };
    match value.parse::<u32>() {
        Ok(n) if (1..=temper_store::MAX_LIMIT).contains(&n) => Ok(n),
        _ => Err(ApiError::bad(
            "limit",
            format!(
                "`limit` must be an integer from 1 to {}, got {value:?}.",
                temper_store::MAX_LIMIT
            ),
        )),
    }
}

pub async fn create_model(
    State(state): State<AppState>,
    Extension(ctx): Extension<RequestContext>,
    ValidJson(req): ValidJson<CreateModelRequest>,
) -> Result<Json<ModelJson>, ApiError> {
    let training = state.require_training()?;
    if let Some(entity) = req.entity.as_deref().filter(|e| *e != ctx.team) {
        // Another team's entity is as absent as another team's model.
        return Err(ApiError::NotFound(format!(
            "The entity `{entity}` does not exist."
        )));
    }
    if state.model(Some(&req.base_model)).is_err() {
        return Err(ApiError::bad(
            "base_model",
            format!(
                "`{}` is not a base model this server serves (GET /v1/models lists them).",
                req.base_model
            ),
        ));
    }
    let new = temper_store::NewModel {
        team: &ctx.team,
        project: &req.project,
        name: &req.name,
        base_model: &req.base_model,
    };
    let model = match training.store.create_model(&new).await {
        Err(temper_store::Error::ModelExists { .. }) if req.return_existing => {
            let existing = training
                .store
                .get_model_by_name(&ctx.team, &req.project, &req.name)
                .await?;
            if existing.base_model != req.base_model {
                return Err(ApiError::Conflict(format!(
                    "The model {}/{}/{} exists with base model `{}`, not `{}`.",
                    existing.team,
                    existing.project,
                    existing.name,
                    existing.base_model,
                    req.base_model
                )));
            }
            existing
        }
        other => other?,
    };
    Ok(Json(ModelJson::from(&model)))
}

pub async fn list_models(
    State(state): State<AppState>,
    Extension(ctx): Extension<RequestContext>,
) -> Result<Json<ModelListJson>, ApiError> {
    let training = state.require_training()?;
    let models = training.store.list_models(&ctx.team).await?;
    Ok(Json(ModelListJson {
        object: "list",
        data: models.iter().map(ModelJson::from).collect(),
    }))
}

pub async fn get_model(
    State(state): State<AppState>,
    Extension(ctx): Extension<RequestContext>,
    ModelId(id): ModelId,
) -> Result<Json<ModelJson>, ApiError> {
    let training = state.require_training()?;
    let model = training.store.get_model(&ctx.team, id).await?;
    Ok(Json(ModelJson::from(&model)))
}

/// Deletes the model, its checkpoints and their adapter files; its queued and running jobs fail.
pub async fn delete_model(
    State(state): State<AppState>,
    Extension(ctx): Extension<RequestContext>,
    ModelId(id): ModelId,
) -> Result<Json<DeletedModelJson>, ApiError> {
    let training = state.require_training()?;
    let deleted = training.store.delete_model(&ctx.team, id).await?;
    for job in &deleted.failed_jobs {
        training.stop_job(*job);
    }
    let dir = training.model_dir(id);
    if let Err(e) = std::fs::remove_dir_all(&dir) {
        if e.kind() != std::io::ErrorKind::NotFound {
            tracing::warn!(dir = %dir.display(), error = %e, "removing a deleted model's adapters");
        }
    }
    Ok(Json(DeletedModelJson {
        model_id: id.to_string(),
        deleted_checkpoints: deleted.deleted_checkpoints,
        deleted_run: true,
    }))
}

pub async fn list_checkpoints(
    State(state): State<AppState>,
    Extension(ctx): Extension<RequestContext>,
    ModelId(model_id): ModelId,
    ValidQuery(q): ValidQuery<CheckpointQuery>,
) -> Result<Json<CursorPage<CheckpointJson>>, ApiError> {
    let training = state.require_training()?;
    let after = q
        .after
        .as_deref()
        .map(|a| parse_id("after", a))
        .transpose()?;
    let limit = parse_limit(q.limit.as_deref())?;
    let order = q.order.as_deref().unwrap_or("asc").parse()?;
    let page = training
        .store
        .list_checkpoints(&ctx.team, model_id, after, limit, order)
        .await?;
    let data = page.items.into_iter().map(CheckpointJson::from).collect();
    Ok(Json(CursorPage::new(data, page.has_more, |c| &c.id)))
}

/// Deletes checkpoints by step, with their adapter files.
pub async fn delete_checkpoints(
    State(state): State<AppState>,
    Extension(ctx): Extension<RequestContext>,
    ModelId(model_id): ModelId,
    ValidJson(req): ValidJson<DeleteCheckpointsRequest>,
) -> Result<Json<DeletedCheckpointsJson>, ApiError> {
    let training = state.require_training()?;
    let deleted = training
        .store
        .delete_checkpoints(&ctx.team, model_id, &req.steps)
        .await?;
    for step in req
        .steps
        .iter()
        .filter(|s| !deleted.not_found_steps.contains(s))
    {
        let path = training.adapter_path(model_id, *step);
        if let Err(e) = std::fs::remove_file(&path) {
            if e.kind() != std::io::ErrorKind::NotFound {
                tracing::warn!(path = %path.display(), error = %e, "removing a deleted checkpoint");
            }
        }
    }
    Ok(Json(DeletedCheckpointsJson {
        deleted_count: deleted.deleted_count,
        not_found_steps: deleted.not_found_steps,
    }))
}

/// `/log`: reward statistics and the trajectories' own metrics of one split (e.g. `val`),
/// merged into the latest checkpoint's metrics as `<split>/<name>`.
pub async fn log_metrics(
    State(state): State<AppState>,
    Extension(ctx): Extension<RequestContext>,
    ModelId(model_id): ModelId,
    ValidJson(req): ValidJson<LogRequest>,
) -> Result<Json<serde_json::Map<String, serde_json::Value>>, ApiError> {
    let training = state.require_training()?;
    if parse_id("model_id", &req.model_id)? != model_id {
        return Err(ApiError::bad(
            "model_id",
            "`model_id` must be the model of the path.",
        ));
    }
    let split = &req.split;
    let valid_split = !split.is_empty()
        && split.len() <= 64
        && split
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
    if !valid_split {
        return Err(ApiError::bad(
            "split",
            "`split` must be 1-64 of A-Z a-z 0-9 - _ . (e.g. `val`).",
        ));
    }
    let metrics = split_metrics(split, &req.trajectory_groups)?;
    training
        .store
        .log_metrics(&ctx.team, model_id, metrics)
        .await?;
    Ok(Json(serde_json::Map::new()))
}

/// `<split>/reward` (mean), `<split>/reward_std_dev` (population), `<split>/num_trajectories`,
/// `<split>/num_groups`, and the mean of each numeric trajectory metric as `<split>/<name>`.
fn split_metrics(
    split: &str,
    groups: &[LogGroup],
) -> Result<serde_json::Map<String, serde_json::Value>, ApiError> {
    use serde_json::json;
    if groups.is_empty() {
        return Err(ApiError::bad(
            "trajectory_groups",
            "`trajectory_groups` must not be empty.",
        ));
    }
    if let Some(i) = groups.iter().position(|g| g.trajectories.is_empty()) {
        return Err(ApiError::bad(
            format!("trajectory_groups[{i}].trajectories"),
            "A group must have at least one trajectory.",
        ));
    }
    let trajectories: Vec<_> = groups.iter().flat_map(|g| &g.trajectories).collect();
    let n = trajectories.len() as f64;
    let mean = trajectories.iter().map(|t| t.reward).sum::<f64>() / n;
    let var = trajectories
        .iter()
        .map(|t| (t.reward - mean).powi(2))
        .sum::<f64>()
        / n;
    let mut out = serde_json::Map::new();
    out.insert(format!("{split}/reward"), json!(mean));
    out.insert(format!("{split}/reward_std_dev"), json!(var.sqrt()));
    out.insert(
        format!("{split}/num_trajectories"),
        json!(trajectories.len()),
    );
    out.insert(format!("{split}/num_groups"), json!(groups.len()));
    out.extend(temper_train::mean_trajectory_metrics(
        trajectories.iter().map(|t| &t.metrics),
        &format!("{split}/"),
    ));
    Ok(out)
}

/// `POST /v1/preview/training-jobs`: an RL job (see [`enqueue_validated`]).
pub async fn create_job(
    State(state): State<AppState>,
    Extension(ctx): Extension<RequestContext>,
    claimed: Option<Extension<ClaimedKey>>,
    JsonBody(body): JsonBody,
) -> Result<Json<JobCreatedJson>, ApiError> {
    let req: CreateJobRequest = parse_json(&body)?;
    let request = temper_train::TrainingRequest {
        trajectory_groups: req.trajectory_groups,
        experimental_config: req.experimental_config,
    };
    let job = Queued {
        model_id: &req.model_id,
        kind: JobKind::Rl,
        body: &body,
        claimed: claimed.as_ref().map(|c| &c.0),
    };
    enqueue_validated(&state, &ctx, job, {
        move |tokenizer, template, max_seq_len| {
            temper_train::tokenize_job(&request, tokenizer, template)?.check_lengths(max_seq_len)
        }
    })
    .await
}

/// `POST /v1/preview/sft-training-jobs`: a supervised fine-tuning job on inline trajectories
/// (see [`enqueue_validated`]).
pub async fn create_sft_job(
    State(state): State<AppState>,
    Extension(ctx): Extension<RequestContext>,
    claimed: Option<Extension<ClaimedKey>>,
    JsonBody(body): JsonBody,
) -> Result<Json<JobCreatedJson>, ApiError> {
    let req: CreateSftJobRequest = parse_json(&body)?;
    if req.training_data_url.is_some() {
        return Err(ApiError::bad(
            "training_data_url",
            "`training_data_url` is not supported: post the conversations inline as \
             `trajectories` (each `{\"messages\": [...], \"tools\": [...]}`).",
        ));
    }
    let request = temper_train::SftRequest {
        trajectories: req.trajectories.unwrap_or_default(),
        config: req.config,
    };
    let job = Queued {
        model_id: &req.model_id,
        kind: JobKind::Sft,
        body: &body,
        claimed: claimed.as_ref().map(|c| &c.0),
    };
    enqueue_validated(&state, &ctx, job, {
        move |tokenizer, template, max_seq_len| {
            temper_train::tokenize_sft_job(&request, tokenizer, template)?
                .check_lengths(max_seq_len)
        }
    })
    .await
}

/// A job to queue, as posted.
struct Queued<'a> {
    model_id: &'a str,
    kind: JobKind,
    body: &'a [u8],
    /// The request's `Idempotency-Key`, answered in the job's own transaction.
    claimed: Option<&'a ClaimedKey>,
}

/// Validates a job's whole body (`validate` tokenizes it with the base model's template, so a
/// job that could not train is a 400 now, not a failed job later), then stores it as posted and
/// answers once it is on disk.
async fn enqueue_validated(
    state: &AppState,
    ctx: &RequestContext,
    queued: Queued<'_>,
    validate: impl FnOnce(&Tokenizer, &ChatTemplate, usize) -> Result<(), temper_train::TrainError>
        + Send
        + 'static,
) -> Result<Json<JobCreatedJson>, ApiError> {
    let training = state.require_training()?;
    crate::usage::check_quota(state, &ctx.team).await?;
    let Queued {
        model_id,
        kind,
        body,
        claimed,
    } = queued;
    let model_id = parse_id("model_id", model_id)?;
    let model = training.store.get_model(&ctx.team, model_id).await?;
    let base = state.model(Some(&model.base_model)).map_err(|_| {
        ApiError::ServiceUnavailable(format!(
            "The base model `{}` is not served by this server.",
            model.base_model
        ))
    })?;
    let template = base.chat_template.clone().ok_or_else(|| {
        ApiError::bad(
            "model_id",
            format!(
                "The base model `{}` has no chat template.",
                model.base_model
            ),
        )
    })?;
    let tokenizer = base.tokenizer.clone();
    let max_seq_len = training.options.max_seq_len;
    tokio::task::spawn_blocking(move || validate(&tokenizer, &template, max_seq_len))
        .await
        .map_err(|e| ApiError::Internal(format!("validating trajectories panicked: {e}")))??;
    // parse_json has read it as JSON, so it is UTF-8.
    let text = String::from_utf8_lossy(body);
    let store = &training.store;
    let job = match claimed {
        Some(key) => {
            store
                .enqueue_job_idempotent(&ctx.team, model_id, kind, &text, key.as_key())
                .await?
        }
        None => store.enqueue_job(&ctx.team, model_id, kind, &text).await?,
    };
    training.wake.notify_one();
    tracing::info!(job_id = %job.id, model_id = %model_id, kind = kind.as_str(), "training job queued");
    Ok(Json(JobCreatedJson {
        id: job.id.to_string(),
    }))
}

pub async fn get_job(
    State(state): State<AppState>,
    Extension(ctx): Extension<RequestContext>,
    JobId(id): JobId,
) -> Result<Json<JobJson>, ApiError> {
    let training = state.require_training()?;
    let job = training.store.get_job(&ctx.team, id).await?;
    Ok(Json(job.into()))
}

/// The team's jobs, newest first; `after` is the last id of the previous page.
pub async fn list_jobs(
    State(state): State<AppState>,
    Extension(ctx): Extension<RequestContext>,
    ValidQuery(q): ValidQuery<JobQuery>,
) -> Result<Json<CursorPage<JobJson>>, ApiError> {
    let training = state.require_training()?;
    let model_id = q
        .model_id
        .as_deref()
        .map(|m| parse_id("model_id", m))
        .transpose()?;
    let after = q
        .after
        .as_deref()
        .map(|a| parse_id("after", a))
        .transpose()?;
    let limit = parse_limit(q.limit.as_deref())?;
    let page = training
        .store
        .list_jobs(&ctx.team, model_id, after, limit)
        .await?;
    let data = page.items.into_iter().map(JobJson::from).collect();
    Ok(Json(CursorPage::new(data, page.has_more, |j| &j.id)))
}

/// A job's events after event id `after`, oldest first: polling the same `after` again gives
/// the same events (and any new ones after them).
pub async fn list_events(
    State(state): State<AppState>,
    Extension(ctx): Extension<RequestContext>,
    JobId(job_id): JobId,
    ValidQuery(q): ValidQuery<EventQuery>,
) -> Result<Json<EventListJson>, ApiError> {
    let training = state.require_training()?;
    let after = match q.after.as_deref() {
        None => None,
        Some(a) => Some(a.parse::<i64>().ok().filter(|n| *n >= 0).ok_or_else(|| {
            ApiError::bad(
                "after",
                format!("`after` must be an event id (an integer >= 0), got {a:?}."),
            )
        })?),
    };
    let limit = parse_limit(q.limit.as_deref())?;
    let page = training
        .store
        .list_events(&ctx.team, job_id, after, limit)
        .await?;
    Ok(Json(EventListJson {
        object: "list",
        data: page.items.into_iter().map(EventJson::from).collect(),
        has_more: page.has_more,
    }))
}

/// Cancels a queued or running job; a running one stops before its next gradient step and
/// makes no checkpoint. A finished job is a 409.
pub async fn cancel_job(
    State(state): State<AppState>,
    Extension(ctx): Extension<RequestContext>,
    JobId(id): JobId,
) -> Result<Json<JobJson>, ApiError> {
    let training = state.require_training()?;
    let job = training.store.cancel_job(&ctx.team, id).await?;
    training.stop_job(job.id);
    Ok(Json(job.into()))
}
