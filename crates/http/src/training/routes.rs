//! The preview training API (training.md): models, checkpoints, `/log`, training jobs and their
//! events; SFT jobs, which share the jobs' life cycle. Every call acts for the key's team;
//! another team's resources are 404.

use axum::extract::{FromRequestParts, Path, State};
use axum::http::request::Parts;
use axum::{Extension, Json};
use temper_train::service::JobSpec;
use uuid::Uuid;

use crate::auth::RequestContext;
use crate::error::ApiError;
use crate::extract::{parse_json, JsonBody, ValidJson, ValidQuery};
use crate::state::AppState;
use crate::training::idempotency::ClaimedKey;
use crate::training::wire::{
    CheckpointJson, CheckpointQuery, CreateJobRequest, CreateModelRequest, CreateSftJobRequest,
    CursorPage, DeleteCheckpointsRequest, DeletedCheckpointsJson, DeletedModelJson, EventJson,
    EventListJson, EventQuery, JobCreatedJson, JobJson, JobQuery, LogRequest, ModelJson,
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
    let new = temper_store::NewModel {
        team: &ctx.team,
        project: &req.project,
        name: &req.name,
        base_model: &req.base_model,
    };
    let model = training
        .create_model(&ctx.team, req.entity.as_deref(), &new, req.return_existing)
        .await?;
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
    let deleted = training.delete_model(&ctx.team, id).await?;
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
        .delete_checkpoints(&ctx.team, model_id, &req.steps)
        .await?;
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
    training
        .log_metrics(&ctx.team, model_id, &req.split, &req.trajectory_groups)
        .await?;
    Ok(Json(serde_json::Map::new()))
}

/// `POST /v1/preview/training-jobs`: an RL job (see [`enqueue`]).
pub async fn create_job(
    State(state): State<AppState>,
    Extension(ctx): Extension<RequestContext>,
    claimed: Option<Extension<ClaimedKey>>,
    JsonBody(body): JsonBody,
) -> Result<Json<JobCreatedJson>, ApiError> {
    let req: CreateJobRequest = parse_json(&body)?;
    let spec = JobSpec::Rl(temper_train::TrainingRequest {
        trajectory_groups: req.trajectory_groups,
        experimental_config: req.experimental_config,
    });
    enqueue(&state, &ctx, &req.model_id, spec, &body, claimed).await
}

/// `POST /v1/preview/sft-training-jobs`: a supervised fine-tuning job on inline trajectories
/// (see [`enqueue`]).
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
    let spec = JobSpec::Sft(temper_train::SftRequest {
        trajectories: req.trajectories.unwrap_or_default(),
        config: req.config,
    });
    enqueue(&state, &ctx, &req.model_id, spec, &body, claimed).await
}

/// Queues a job (the service validates it whole first) with the body as posted.
async fn enqueue(
    state: &AppState,
    ctx: &RequestContext,
    model_id: &str,
    spec: JobSpec,
    body: &[u8],
    claimed: Option<Extension<ClaimedKey>>,
) -> Result<Json<JobCreatedJson>, ApiError> {
    let training = state.require_training()?;
    crate::usage::check_quota(state, &ctx.team).await?;
    let model_id = parse_id("model_id", model_id)?;
    // parse_json has read it as JSON, so it is UTF-8.
    let text = String::from_utf8_lossy(body);
    let key = claimed.as_ref().map(|c| c.0.as_key());
    let job = training
        .enqueue_job(&ctx.team, model_id, spec, &text, key)
        .await?;
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
    let job = training.cancel_job(&ctx.team, id).await?;
    Ok(Json(job.into()))
}
