//! A checkpoint's adapter out of temper and in: `GET /v1/preview/models/{id}/checkpoints/{step}/
//! adapter?format=peft|gguf` (a tar of PEFT's two files, or a llama.cpp LoRA GGUF) and
//! `POST /v1/preview/models/{id}/checkpoints` (a PEFT adapter as a tar body or a multipart
//! form, stored as the next step). The files are read here, at the edge, into
//! [`PeftFiles`]; what they hold is checked by the model crate ([`LoraAdapter::from_peft`],
//! through the training service).
//!
//! [`LoraAdapter::from_peft`]: temper_model::LoraAdapter::from_peft

use std::io::Read;

use axum::body::{Body, Bytes};
use axum::extract::{FromRequest, FromRequestParts, Multipart, Path, Request, State};
use axum::http::request::Parts;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use serde::Deserialize;
use temper_model::{
    AdapterFormat, ExportedAdapter, PeftFiles, PEFT_CONFIG_FILE, PEFT_WEIGHTS_FILE,
};
use uuid::Uuid;

use crate::auth::RequestContext;
use crate::error::ApiError;
use crate::extract::{BodyLimit, ValidQuery};
use crate::state::AppState;
use crate::training::idempotency::ClaimedKey;
use crate::training::routes::{parse_id, ModelId};
use crate::training::wire::CheckpointJson;

/// The `{id}` and `{step}` of `/v1/preview/models/{id}/checkpoints/{step}/adapter`.
pub struct CheckpointPath {
    pub model_id: Uuid,
    pub step: i64,
}

impl<S: Send + Sync> FromRequestParts<S> for CheckpointPath {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        let Path((id, step)) = Path::<(String, String)>::from_request_parts(parts, state)
            .await
            .map_err(|e| {
                ApiError::bad_body(format!("The URL path is malformed: {}", e.body_text()))
            })?;
        let model_id = parse_id("model_id", &id)?;
        let step = step
            .parse::<i64>()
            .ok()
            .filter(|s| *s >= 0)
            .ok_or_else(|| {
                ApiError::bad(
                    "step",
                    format!("`step` must be a checkpoint step (an integer >= 0), got {step:?}."),
                )
            })?;
        Ok(CheckpointPath { model_id, step })
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExportQuery {
    pub format: Option<String>,
}

/// The adapter of a checkpoint (step >= 1) as a download: `format=peft` (the default) a tar of
/// `adapter_model.safetensors` and `adapter_config.json`, `format=gguf` a llama.cpp LoRA
/// adapter file.
pub async fn export_adapter(
    State(state): State<AppState>,
    Extension(ctx): Extension<RequestContext>,
    path: CheckpointPath,
    ValidQuery(q): ValidQuery<ExportQuery>,
) -> Result<Response, ApiError> {
    let training = state.require_training()?;
    let format: AdapterFormat = q.format.as_deref().unwrap_or("peft").parse().map_err(|_| {
        ApiError::bad(
            "format",
            format!(
                "`format` must be `peft` or `gguf`, got {:?}.",
                q.format.unwrap_or_default()
            ),
        )
    })?;
    let (model, exported) = training
        .export_adapter(&ctx.team, path.model_id, path.step, format)
        .await?;
    let stem = format!("{}-{}-step{}", model.project, model.name, path.step);
    let (content_type, filename, body) = match exported {
        ExportedAdapter::Peft(files) => (
            "application/x-tar",
            format!("{stem}-peft.tar"),
            tar(&files)?,
        ),
        ExportedAdapter::Gguf(bytes) => (
            "application/octet-stream",
            format!("{stem}-lora.gguf"),
            bytes,
        ),
    };
    // Project and model names are 1-64 of A-Z a-z 0-9 - _ . (the store checks them).
    let disposition = HeaderValue::from_str(&format!("attachment; filename=\"{filename}\""))
        .map_err(|e| ApiError::Internal(format!("a download's filename: {e}")))?;
    Ok((
        StatusCode::OK,
        [
            (header::CONTENT_TYPE, HeaderValue::from_static(content_type)),
            (header::CONTENT_DISPOSITION, disposition),
        ],
        Body::from(body),
    )
        .into_response())
}

/// PEFT's two files as a tar (what `tar -xf` unpacks into a directory `PeftModel.from_pretrained`
/// loads).
fn tar(files: &PeftFiles) -> Result<Vec<u8>, ApiError> {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let mut builder = tar::Builder::new(Vec::new());
    for (name, bytes) in [
        (PEFT_WEIGHTS_FILE, &files.weights),
        (PEFT_CONFIG_FILE, &files.config),
    ] {
        let mut header = tar::Header::new_ustar();
        header.set_size(bytes.len() as u64);
        header.set_mode(0o644);
        header.set_mtime(now);
        header.set_entry_type(tar::EntryType::Regular);
        builder
            .append_data(&mut header, name, bytes.as_slice())
            .map_err(|e| ApiError::Internal(format!("writing the tar: {e}")))?;
    }
    builder
        .into_inner()
        .map_err(|e| ApiError::Internal(format!("writing the tar: {e}")))
}

/// An uploaded PEFT adapter: a tar (`Content-Type: application/x-tar`) or a
/// `multipart/form-data` form whose parts are named (or have the file names)
/// `adapter_model.safetensors` and `adapter_config.json`. Other files (a README.md) are
/// ignored; either file missing or given twice is a 400 naming it.
pub struct AdapterUpload(pub PeftFiles);

impl FromRequest<AppState> for AdapterUpload {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &AppState) -> Result<Self, ApiError> {
        let limit = req
            .extensions()
            .get::<BodyLimit>()
            .map_or(state.options().max_body_bytes, |l| l.0);
        let too_large = |status: StatusCode, text: String| {
            if status == StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::RequestTooLarge(limit)
            } else {
                ApiError::bad_body(text)
            }
        };
        let content_type = req
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .split(';')
            .next()
            .unwrap_or("")
            .trim()
            .to_ascii_lowercase();
        let mut files = UploadedFiles::default();
        match content_type.as_str() {
            "multipart/form-data" => {
                let mut form = Multipart::from_request(req, state)
                    .await
                    .map_err(|e| too_large(e.status(), e.body_text()))?;
                while let Some(field) = form
                    .next_field()
                    .await
                    .map_err(|e| too_large(e.status(), e.body_text()))?
                {
                    let name = [field.file_name(), field.name()]
                        .into_iter()
                        .flatten()
                        .map(base_name)
                        .find(|n| UploadedFiles::wanted(n))
                        .map(str::to_owned);
                    let bytes = field
                        .bytes()
                        .await
                        .map_err(|e| too_large(e.status(), e.body_text()))?;
                    if let Some(name) = name {
                        files.add(&name, bytes.to_vec())?;
                    }
                }
            }
            "application/x-tar" | "application/tar" => {
                let body = Bytes::from_request(req, state)
                    .await
                    .map_err(|e| too_large(e.status(), e.body_text()))?;
                read_tar(&body, &mut files)?;
            }
            _ => {
                return Err(ApiError::bad_body(format!(
                    "Expected the adapter as `Content-Type: application/x-tar` (a tar of \
                     {PEFT_WEIGHTS_FILE} and {PEFT_CONFIG_FILE}) or `multipart/form-data` \
                     (parts named so), got {content_type:?}."
                )))
            }
        }
        files.finish().map(AdapterUpload)
    }
}

/// The last component of a path in an archive or a form (`./x`, `dir/x`, `C:\dir\x`).
fn base_name(path: &str) -> &str {
    path.rsplit(['/', '\\']).next().unwrap_or(path)
}

#[derive(Default)]
struct UploadedFiles {
    weights: Option<Vec<u8>>,
    config: Option<Vec<u8>>,
}

impl UploadedFiles {
    fn wanted(name: &str) -> bool {
        name == PEFT_WEIGHTS_FILE || name == PEFT_CONFIG_FILE
    }

    fn add(&mut self, name: &str, bytes: Vec<u8>) -> Result<(), ApiError> {
        let slot = if name == PEFT_WEIGHTS_FILE {
            &mut self.weights
        } else {
            &mut self.config
        };
        if slot.replace(bytes).is_some() {
            return Err(ApiError::bad(
                name,
                format!("The upload holds {name} twice."),
            ));
        }
        Ok(())
    }

    fn finish(self) -> Result<PeftFiles, ApiError> {
        let missing = |name: &str| {
            ApiError::bad(
                name,
                format!("The upload has no {name} (a PEFT adapter is {PEFT_WEIGHTS_FILE} and {PEFT_CONFIG_FILE})."),
            )
        };
        Ok(PeftFiles {
            weights: self.weights.ok_or_else(|| missing(PEFT_WEIGHTS_FILE))?,
            config: self.config.ok_or_else(|| missing(PEFT_CONFIG_FILE))?,
        })
    }
}

fn read_tar(body: &[u8], files: &mut UploadedFiles) -> Result<(), ApiError> {
    let bad =
        |e: std::io::Error| ApiError::bad_body(format!("The body is not a readable tar: {e}"));
    let mut archive = tar::Archive::new(body);
    for entry in archive.entries().map_err(bad)? {
        let mut entry = entry.map_err(bad)?;
        if !entry.header().entry_type().is_file() {
            continue;
        }
        let path = entry.path().map_err(bad)?.to_string_lossy().into_owned();
        let name = base_name(&path);
        if UploadedFiles::wanted(name) {
            let name = name.to_owned();
            let mut bytes = Vec::new();
            entry.read_to_end(&mut bytes).map_err(bad)?;
            files.add(&name, bytes)?;
        }
    }
    Ok(())
}

/// Imports a PEFT adapter (see [`AdapterUpload`]) as the model's next checkpoint: checked
/// against the base model, stored, served by name at once and trained on by the next job.
pub async fn import_checkpoint(
    State(state): State<AppState>,
    Extension(ctx): Extension<RequestContext>,
    claimed: Option<Extension<ClaimedKey>>,
    ModelId(model_id): ModelId,
    AdapterUpload(files): AdapterUpload,
) -> Result<Json<CheckpointJson>, ApiError> {
    let training = state.require_training()?;
    let answer = |c: &temper_store::Checkpoint| {
        serde_json::to_vec(&CheckpointJson::from(c.clone())).unwrap_or_default()
    };
    let key = claimed.as_ref().map(|c| c.0.as_key());
    let idempotency = key.map(|k| {
        (
            k,
            &answer as &(dyn Fn(&temper_store::Checkpoint) -> Vec<u8> + Sync),
        )
    });
    let checkpoint = training
        .import_checkpoint(&ctx.team, model_id, files, idempotency)
        .await?;
    Ok(Json(CheckpointJson::from(checkpoint)))
}
