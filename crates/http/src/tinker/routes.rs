//! The Tinker API's handlers (`/api/v1/...`), as the `tinker` SDK 0.38.0 calls them. Requests
//! that compute (model creation, `forward_backward`, `optim_step`, saves and loads, sampling)
//! answer with a future at once; `retrieve_future` long-polls it. Bad input is refused before a
//! future exists, with temper's error envelope and a 4xx the SDK does not retry.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, HeaderValue};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use serde_json::{json, Value};
use temper_model::{LoraAdapter, LoraConfig};
use temper_store::NewModel;
use temper_train::{AdamW, StepDatum, StepLoss};
use uuid::Uuid;

use crate::auth::RequestContext;
use crate::error::ApiError;
use crate::extract::{ValidJson, ValidQuery};
use crate::meter::unix_now;
use crate::state::AppState;
use crate::tinker::proto::{self, Chunk, ConfigValue, ForwardBackwardRequest};
use crate::tinker::registry::{
    NewRun, Outcome, RunInfo, Sampler, SavedCheckpoint, SavedState, Tinker, TrainedTargets,
    TrainingRun, Work, LONG_POLL,
};
use crate::tinker::wire::{
    CreateModelRequest, CreateSamplingSessionRequest, CreateSessionRequest, FutureRequest,
    ListQuery, LoadWeightsRequest, ModelIdRequest, OptimStepRequest, SampleRequest,
    SaveWeightsRequest, SessionRequest, UntypedFuture,
};

type Registry = Extension<Arc<Tinker>>;

/// The store project of every Tinker training run.
pub const PROJECT: &str = "tinker";
/// LoRA alpha of every run: the scale is `alpha / rank`.
pub const LORA_ALPHA: f32 = 32.0;
/// Largest LoRA rank a run may ask for.
pub const MAX_RANK: i64 = 256;
const PROTOBUF: &str = "application/x-protobuf";

fn now() -> i64 {
    unix_now() as i64
}

/// The SDK's client flags: no JWT exchange (temper's team keys are the API keys), plain httpx,
/// uncompressed protobuf `forward_backward` bodies sent one chunk at a time, per-request futures.
pub async fn client_config() -> Json<Value> {
    Json(json!({
        "pjwt_auth_enabled": false,
        "credential_default_source": "api_key",
        "parallel_fwdbwd_chunks": false,
        "proto_compress_fwdbwd": false,
        "use_pyqwest_transport": false,
        "sample_use_retrieve_futures": false,
        "custom_loss_server_side": false,
        "sample_join_sampling_session": false,
    }))
}

pub async fn dynamic_config() -> Json<Value> {
    Json(json!({ "refresh_interval_sec": 300, "sample_cancel_enabled": false }))
}

/// The SDK's telemetry, accepted and dropped.
pub async fn telemetry() -> Json<Value> {
    Json(json!({ "status": "accepted" }))
}

pub async fn healthz() -> Json<Value> {
    Json(json!({ "status": "ok" }))
}

pub async fn create_session(
    Extension(tinker): Registry,
    Extension(ctx): Extension<RequestContext>,
    ValidJson(_req): ValidJson<CreateSessionRequest>,
) -> Json<Value> {
    let session_id = tinker.create_session(&ctx.team);
    Json(json!({ "type": "create_session", "session_id": session_id }))
}

pub async fn session_heartbeat(
    Extension(tinker): Registry,
    Extension(ctx): Extension<RequestContext>,
    ValidJson(req): ValidJson<SessionRequest>,
) -> Result<Json<Value>, ApiError> {
    tinker.check_session(&ctx.team, &req.session_id)?;
    Ok(Json(json!({ "type": "session_heartbeat" })))
}

/// The served base models: each samples; each with a chat template trains (with a store).
pub async fn server_capabilities(State(state): State<AppState>) -> Json<Value> {
    let trains = state.training().is_some();
    let models: Vec<Value> = state
        .models()
        .iter()
        .map(|m| {
            json!({
                "model_name": m.name,
                "max_context_length": m.max_model_len,
                "trainable": trains && m.base.chat_template.is_some(),
                "sampleable": true,
            })
        })
        .collect();
    Json(json!({ "supported_models": models }))
}

/// The training service; without a store a 400 (the SDK retries a 503 for minutes).
fn training_service(
    state: &AppState,
) -> Result<&Arc<temper_train::service::TrainingService>, ApiError> {
    state.training().ok_or_else(|| {
        ApiError::bad_body(
            "This server runs without a store (`--data-dir`): training and sampler weights are off.",
        )
    })
}

/// A completed future (for requests that finish at once).
fn done(tinker: &Tinker, team: &str, model_id: Option<String>, outcome: Outcome) -> UntypedFuture {
    let (future, tx) = tinker.new_future(team, None, |request_id| UntypedFuture {
        request_id,
        model_id,
        sample_sequence_ids: None,
    });
    tx.send_replace(Some(outcome));
    future
}

/// A new LoRA training run on a served base model: a store model `<team>/tinker/run-<id>` whose
/// checkpoints are the run's sampler weights. The adapter covers the attention and MLP
/// projections of every layer; the unembedding is not adapted.
pub async fn create_model(
    State(state): State<AppState>,
    Extension(tinker): Registry,
    Extension(ctx): Extension<RequestContext>,
    ValidJson(req): ValidJson<CreateModelRequest>,
) -> Result<Json<UntypedFuture>, ApiError> {
    let training = training_service(&state)?;
    tinker.check_session(&ctx.team, &req.session_id)?;
    let base = state.model(Some(&req.base_model)).map_err(|_| {
        ApiError::bad(
            "base_model",
            format!(
                "`{}` is not a base model this server serves (GET /api/v1/get_server_capabilities \
                 lists them).",
                req.base_model
            ),
        )
    })?;
    let Some(lora) = req.lora_config else {
        return Err(ApiError::bad(
            "lora_config",
            "temper trains LoRA adapters only: send `lora_config`.",
        ));
    };
    if !(1..=MAX_RANK).contains(&lora.rank) {
        return Err(ApiError::bad(
            "lora_config.rank",
            format!("The LoRA rank must be 1 to {MAX_RANK}, got {}.", lora.rank),
        ));
    }
    if !(lora.train_mlp || lora.train_attn || lora.train_unembed) {
        return Err(ApiError::bad(
            "lora_config",
            "`train_attn`, `train_mlp` and `train_unembed` are all false: nothing would train.",
        ));
    }
    if let Some(opt) = req.optimizer_config.as_ref().filter(|o| o.kind != "adamw") {
        return Err(ApiError::bad(
            "optimizer_config.type",
            format!("temper's training runs use AdamW only, not `{}`.", opt.kind),
        ));
    }
    if base.base.chat_template.is_none() {
        return Err(ApiError::bad(
            "base_model",
            format!(
                "The base model `{}` has no chat template: it cannot be trained.",
                base.name
            ),
        ));
    }
    let rank = lora.rank as usize;
    let seed = lora.seed.unwrap_or_else(|| Uuid::new_v4().as_u64_pair().0);
    let weights = base.base.model.clone();
    let adapter = tokio::task::spawn_blocking(move || {
        LoraAdapter::new(
            weights.config(),
            LoraConfig {
                rank,
                alpha: LORA_ALPHA,
                unembed: lora.train_unembed,
            },
            seed,
        )
    })
    .await
    .map_err(|e| ApiError::Internal(format!("creating the adapter panicked: {e}")))?;
    let id = Uuid::new_v4().simple().to_string();
    let new = RunParts {
        base,
        rank,
        trains: TrainedTargets {
            attention: lora.train_attn,
            mlp: lora.train_mlp,
        },
        adapter,
        optimizer: None,
        user_metadata: req.user_metadata,
    };
    let run = register_run(training, &tinker, &ctx, id, new).await?;
    let answer = json!({ "type": "create_model", "model_id": run.model_id() });
    Ok(Json(done(
        &tinker,
        &ctx.team,
        Some(run.model_id()),
        Outcome::Json(answer),
    )))
}

/// What a new run starts from.
struct RunParts {
    base: Arc<crate::state::ServedModel>,
    rank: usize,
    trains: TrainedTargets,
    adapter: LoraAdapter,
    /// `None`: a fresh one.
    optimizer: Option<AdamW>,
    user_metadata: Option<serde_json::Map<String, Value>>,
}

/// Registers the run `id` of the team, with its store model `<team>/tinker/run-<hex>` (the
/// run's id when it is hex, else a fresh one).
async fn register_run(
    training: &temper_train::service::TrainingService,
    tinker: &Tinker,
    ctx: &RequestContext,
    id: String,
    parts: RunParts,
) -> Result<Arc<TrainingRun>, ApiError> {
    let hex = if id.bytes().all(|b| b.is_ascii_hexdigit()) {
        id.clone()
    } else {
        Uuid::new_v4().simple().to_string()
    };
    let name = format!("run-{hex}");
    let model = training
        .create_model(
            &ctx.team,
            None,
            &NewModel {
                team: &ctx.team,
                project: PROJECT,
                name: &name,
                base_model: &parts.base.name,
            },
            false,
        )
        .await?;
    let rank = parts.rank;
    let run = tinker.add_run(NewRun {
        info: RunInfo {
            id,
            store_id: model.id,
            team: ctx.team.clone(),
            base: parts.base,
            rank,
            trains: parts.trains,
            served_name: format!("{}/{}/{}", model.team, model.project, model.name),
            user_metadata: parts.user_metadata,
        },
        adapter: parts.adapter,
        optimizer: parts.optimizer,
        now: now(),
    });
    tracing::info!(model_id = %run.model_id(), rank, "tinker training run created");
    Ok(run)
}

/// Where the SDK finds the base model's tokenizer (`AutoTokenizer.from_pretrained`): the
/// `TEMPER_TINKER_TOKENIZER_<name>` variable's value when set (the name in upper case, other
/// characters as `_`: for a client on another machine), else the directory temper exports the
/// tokenizer to (for a client on this one).
async fn tokenizer_id(
    tinker: &Tinker,
    base: &crate::state::ServedModel,
) -> Result<String, ApiError> {
    let key: String = base
        .name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_uppercase()
            } else {
                '_'
            }
        })
        .collect();
    if let Ok(id) = std::env::var(format!("TEMPER_TINKER_TOKENIZER_{key}")) {
        return Ok(id);
    }
    Ok(tinker.tokenizer_dir(base).await?.display().to_string())
}

pub async fn get_info(
    Extension(tinker): Registry,
    Extension(ctx): Extension<RequestContext>,
    ValidJson(req): ValidJson<ModelIdRequest>,
) -> Result<Json<Value>, ApiError> {
    let run = tinker.run(&ctx.team, &req.model_id)?;
    Ok(Json(json!({
        "type": "get_info",
        "model_id": run.model_id(),
        "model_data": {
            "arch": run.base.base.model.config().arch.name(),
            "model_name": run.base.name,
            "tokenizer_id": tokenizer_id(&tinker, &run.base).await?,
        },
        "is_lora": true,
        "lora_rank": run.rank,
        "model_name": run.base.name,
    })))
}

/// With the team past its monthly token quota, a future that fails with the quota's message
/// (the SDK raises it at once; a 429 it would retry for minutes).
async fn over_quota(
    state: &AppState,
    tinker: &Tinker,
    ctx: &RequestContext,
    run: &TrainingRun,
) -> Option<UntypedFuture> {
    let e = crate::usage::check_quota(state, &ctx.team).await.err()?;
    Some(done(
        tinker,
        &ctx.team,
        Some(run.model_id()),
        Outcome::from_error(&e),
    ))
}

/// A request's identity for retries: its run and `seq_id` (the SDK numbers a training client's
/// requests from 1 and keeps the number when it retries one).
fn request_key(model_id: &str, seq_id: Option<i64>) -> Option<String> {
    seq_id.filter(|s| *s > 0).map(|s| format!("{model_id}#{s}"))
}

/// A `loss_fn_config` number.
fn config_number(
    cfg: &std::collections::BTreeMap<String, ConfigValue>,
    key: &str,
    default: f64,
) -> Result<f64, ApiError> {
    match cfg.get(key) {
        None => Ok(default),
        Some(ConfigValue::Number(x)) if x.is_finite() => Ok(*x),
        Some(_) => Err(ApiError::bad(
            format!("loss_fn_config.{key}"),
            format!("`{key}` must be a finite number."),
        )),
    }
}

fn parse_loss(req: &ForwardBackwardRequest) -> Result<StepLoss, ApiError> {
    let cfg = &req.loss_fn_config;
    let clip = || -> Result<(f64, f64), ApiError> {
        let low = config_number(cfg, "clip_low_threshold", 0.8)?;
        let high = config_number(cfg, "clip_high_threshold", 1.2)?;
        if !((0.0..=1.0).contains(&low) && high >= 1.0) {
            return Err(ApiError::bad(
                "loss_fn_config",
                "`clip_low_threshold` must be in [0, 1] and `clip_high_threshold` at least 1.",
            ));
        }
        Ok((low, high))
    };
    let loss = match req.loss_fn.as_str() {
        "cross_entropy" => StepLoss::CrossEntropy,
        "importance_sampling" => StepLoss::ImportanceSampling,
        "ppo" => {
            let (clip_low, clip_high) = clip()?;
            StepLoss::Ppo {
                clip_low,
                clip_high,
            }
        }
        "cispo" => {
            let (clip_low, clip_high) = clip()?;
            StepLoss::Cispo {
                clip_low,
                clip_high,
            }
        }
        other => {
            return Err(ApiError::bad(
                "loss_fn",
                format!(
                    "Unknown or unsupported loss `{other}`: temper supports `cross_entropy`, \
                     `importance_sampling`, `ppo` and `cispo` (custom and `dro` losses are not \
                     supported)."
                ),
            ))
        }
    };
    let known: &[&str] = match loss {
        StepLoss::CrossEntropy | StepLoss::ImportanceSampling => &[],
        _ => &["clip_low_threshold", "clip_high_threshold"],
    };
    if let Some(k) = cfg.keys().find(|k| !known.contains(&k.as_str())) {
        return Err(ApiError::bad(
            format!("loss_fn_config.{k}"),
            format!("`{}` takes no setting `{k}`.", req.loss_fn),
        ));
    }
    Ok(loss)
}

/// The request's datums as the trainer takes them, checked: text chunks only, ids in the
/// vocabulary, each loss input of the loss present with one value per input token, and the
/// targets the input shifted by one (position `i` predicts input token `i + 1`) wherever the loss
/// is not zero. With each datum, its positions whose target is another token (reported with
/// logprob 0).
fn parse_data(
    req: &ForwardBackwardRequest,
    loss: StepLoss,
    vocab: usize,
) -> Result<Vec<(StepDatum, Vec<usize>)>, ApiError> {
    if req.data.is_empty() {
        return Err(ApiError::bad("data", "No datums: send at least one."));
    }
    let needed: &[&str] = if loss.uses_weights() {
        &["target_tokens", "weights"]
    } else {
        &["target_tokens", "logprobs", "advantages"]
    };
    let mut out = Vec::with_capacity(req.data.len());
    for (i, d) in req.data.iter().enumerate() {
        let param = |p: &str| format!("data[{i}].{p}");
        let mut tokens = Vec::new();
        for c in &d.chunks {
            match c {
                Chunk::Tokens(t) => tokens.extend(t),
                Chunk::Other(kind) => {
                    return Err(ApiError::bad(
                        param("model_input"),
                        format!("temper's models take text only, not {kind} chunks."),
                    ))
                }
            }
        }
        let n = tokens.len();
        if n == 0 {
            return Err(ApiError::bad(
                param("model_input"),
                "The model input has no tokens.",
            ));
        }
        let values = |name: &str| -> Result<Vec<f64>, ApiError> {
            let t = d.loss_fn_inputs.get(name).ok_or_else(|| {
                ApiError::bad(
                    param("loss_fn_inputs"),
                    format!("`{}` needs the loss input `{name}`.", req.loss_fn),
                )
            })?;
            let v = t.values().ok_or_else(|| {
                ApiError::bad(
                    param(&format!("loss_fn_inputs.{name}")),
                    "A loss input must be a dense float32 or int64 tensor.",
                )
            })?;
            let shape_ok = t.shape.is_empty() || t.shape == [v.len() as i64];
            if v.len() != n || !shape_ok {
                return Err(ApiError::bad(
                    param(&format!("loss_fn_inputs.{name}")),
                    format!(
                        "`{name}` has {} values (shape {:?}), but the model input has {n} tokens: \
                         every loss input needs one value per input token.",
                        v.len(),
                        t.shape
                    ),
                ));
            }
            if v.iter().any(|x| !x.is_finite()) {
                return Err(ApiError::bad(
                    param(&format!("loss_fn_inputs.{name}")),
                    format!("`{name}` has a value that is not finite."),
                ));
            }
            Ok(v)
        };
        let inputs: Vec<Vec<f64>> = needed.iter().map(|k| values(k)).collect::<Result<_, _>>()?;
        if let Some(k) = d
            .loss_fn_inputs
            .keys()
            .find(|k| !needed.contains(&k.as_str()))
        {
            return Err(ApiError::bad(
                param(&format!("loss_fn_inputs.{k}")),
                format!("`{}` takes no loss input `{k}`.", req.loss_fn),
            ));
        }
        let targets: Vec<u32> = inputs[0].iter().map(|&x| x as u32).collect();
        let out_of_vocab = |t: &u32| *t as usize >= vocab;
        if inputs[0].iter().any(|&x| x < 0.0 || x.fract() != 0.0)
            || targets.iter().any(out_of_vocab)
            || tokens.iter().any(out_of_vocab)
        {
            return Err(ApiError::bad(
                param("model_input"),
                format!("Token ids must be integers in [0, {vocab})."),
            ));
        }
        // A position whose target is not the next input token (the cookbook's RL loop pads the
        // prompt's targets with 0) must carry no loss: temper scores the next input token only.
        let loss_at = &inputs[if loss.uses_weights() { 1 } else { 2 }];
        let mut unscored = Vec::new();
        for i in 0..n - 1 {
            if targets[i] != tokens[i + 1] {
                if loss_at[i] != 0.0 {
                    return Err(ApiError::bad(
                        param("loss_fn_inputs.target_tokens"),
                        format!(
                            "`target_tokens[{i}]` is not the next input token, yet position {i}                              has a nonzero {}: temper scores each position's next input token                              only (position i predicts input token i + 1, the last position any                              token).",
                            if loss.uses_weights() { "weight" } else { "advantage" }
                        ),
                    ));
                }
                unscored.push(i);
            }
        }
        let f32s = |v: &[f64]| v.iter().map(|&x| x as f32).collect::<Vec<f32>>();
        let (weights, old_logprobs, advantages) = if loss.uses_weights() {
            (f32s(&inputs[1]), Vec::new(), Vec::new())
        } else {
            (Vec::new(), f32s(&inputs[1]), f32s(&inputs[2]))
        };
        out.push((
            StepDatum {
                last_target: targets[n - 1],
                tokens,
                weights,
                old_logprobs,
                advantages,
            },
            unscored,
        ));
    }
    Ok(out)
}

/// `forward_backward` (and `forward`, with `forward_only`): the SDK's protobuf body. The
/// gradient of the loss's sum adds to the run's until `optim_step`.
pub async fn forward_backward(
    State(state): State<AppState>,
    Extension(tinker): Registry,
    Extension(ctx): Extension<RequestContext>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Json<UntypedFuture>, ApiError> {
    if headers.get(header::CONTENT_ENCODING).is_some() {
        return Err(ApiError::bad_body(
            "temper reads uncompressed forward_backward bodies (its client config says so).",
        ));
    }
    let req =
        ForwardBackwardRequest::decode(&body).map_err(|e| ApiError::bad_body(e.to_string()))?;
    let run = tinker.run(&ctx.team, &req.model_id)?;
    let loss = parse_loss(&req)?;
    if let Some(refused) = over_quota(&state, &tinker, &ctx, &run).await {
        return Ok(Json(refused));
    }
    let (data, unscored): (Vec<StepDatum>, Vec<Vec<usize>>) =
        parse_data(&req, loss, run.base.base.model.config().vocab_size)?
            .into_iter()
            .unzip();
    let max_seq_len = state
        .training()
        .map_or(run.base.max_model_len, |t| t.options.max_seq_len);
    let pool = state.training().and_then(|t| t.trainer_pool());
    let backward = !req.forward_only;
    // Positions with a loss: what the step's usage counts as trained tokens.
    let trained: u64 = data
        .iter()
        .map(|d| {
            let at = if loss.uses_weights() {
                &d.weights
            } else {
                &d.advantages
            };
            at.iter().filter(|x| **x != 0.0).count() as u64
        })
        .sum();
    let key = request_key(&req.model_id, Some(req.seq_id));
    let work: Work = Box::new(move |run: Arc<TrainingRun>| {
        Box::pin(async move {
            let adapter = run.lock().adapter.clone();
            let model = run.base.base.model.clone();
            let stepped = tokio::task::spawn_blocking(move || {
                let step = || {
                    temper_train::forward_backward(
                        &model,
                        &adapter,
                        &data,
                        loss,
                        backward,
                        max_seq_len,
                    )
                };
                // On the trainer's threads, below serving's priority, when the worker runs here.
                match pool {
                    Some(pool) => pool.install(step),
                    None => step(),
                }
            })
            .await;
            let mut output = match stepped {
                Ok(Ok(o)) => o,
                Ok(Err(e)) => return Outcome::from_error(&e.into()),
                Err(e) => return Outcome::server(format!("the step panicked: {e}")),
            };
            for (lps, unscored) in output.logprobs.iter_mut().zip(&unscored) {
                for &i in unscored {
                    lps[i] = 0.0;
                }
            }
            if let Some(g) = &output.grads {
                let mut st = run.lock();
                match &mut st.grads {
                    Some(sum) => temper_train::add_grads(sum, g),
                    None => st.grads = Some(g.clone()),
                }
                st.pending_tokens += trained;
                st.last_request = now();
            }
            let metrics = [("loss:sum", output.loss_sum)];
            let json = json!({
                "loss_fn_output_type": "ArrayRecord",
                "loss_fn_outputs": output.logprobs.iter().map(|lp| json!({
                    "logprobs": { "data": lp, "dtype": "float32", "shape": [lp.len()] },
                })).collect::<Vec<_>>(),
                "metrics": { "loss:sum": output.loss_sum },
            });
            let bytes = proto::forward_backward_output(
                &[("logprobs", output.logprobs.clone())],
                output.logprobs.len(),
                &metrics,
            );
            Outcome::Proto { bytes, json }
        })
    });
    Ok(Json(tinker.submit(&run, key.as_deref(), work)))
}

/// One AdamW step on the accumulated gradient, which then starts again from zero. Without a
/// gradient (no `forward_backward` since the last step) the weights stay as they are.
pub async fn optim_step(
    State(state): State<AppState>,
    Extension(tinker): Registry,
    Extension(ctx): Extension<RequestContext>,
    ValidJson(req): ValidJson<OptimStepRequest>,
) -> Result<Json<UntypedFuture>, ApiError> {
    let run = tinker.run(&ctx.team, &req.model_id)?;
    let meter = state.usage_meter().cloned();
    let project = ctx.usage_project().to_owned();
    let Some(p) = req.adam_params else {
        return Err(ApiError::bad(
            "adam_params",
            "`optim_step` needs `adam_params`.",
        ));
    };
    if p.kind
        .as_deref()
        .is_some_and(|k| k != "adam" && k != "adamw")
    {
        return Err(ApiError::bad(
            "adam_params.type",
            "temper's training runs use AdamW only.",
        ));
    }
    let checks = [
        (
            "learning_rate",
            p.learning_rate >= 0.0 && p.learning_rate.is_finite(),
        ),
        ("beta1", (0.0..1.0).contains(&p.beta1)),
        ("beta2", (0.0..1.0).contains(&p.beta2)),
        ("eps", p.eps > 0.0 && p.eps.is_finite()),
        (
            "weight_decay",
            p.weight_decay >= 0.0 && p.weight_decay.is_finite(),
        ),
        (
            "grad_clip_norm",
            p.grad_clip_norm >= 0.0 && p.grad_clip_norm.is_finite(),
        ),
    ];
    if let Some((name, _)) = checks.iter().find(|(_, ok)| !ok) {
        return Err(ApiError::bad(
            format!("adam_params.{name}"),
            "learning_rate, eps, weight_decay and grad_clip_norm must be finite and not \
             negative (eps positive); beta1 and beta2 in [0, 1).",
        ));
    }
    let params = temper_train::AdamParams {
        learning_rate: p.learning_rate,
        beta1: p.beta1,
        beta2: p.beta2,
        eps: p.eps,
        weight_decay: p.weight_decay,
        grad_clip_norm: p.grad_clip_norm,
    };
    let key = request_key(&req.model_id, req.seq_id);
    let work: Work = Box::new(move |run: Arc<TrainingRun>| {
        Box::pin(async move {
            let (grads, trained, mut adapter, mut optimizer) = {
                let mut st = run.lock();
                st.last_request = now();
                let Some(mut grads) = st.grads.take() else {
                    return Outcome::Json(json!({ "metrics": { "grad_norm": 0.0 } }));
                };
                // Frozen pairs get an empty gradient: AdamW leaves them as they are.
                for (i, g) in grads.iter_mut().enumerate() {
                    if !run.trains.trains(st.adapter.param_target(i)) {
                        *g = Vec::new();
                    }
                }
                let trained = std::mem::take(&mut st.pending_tokens);
                (grads, trained, st.adapter.clone(), st.optimizer.clone())
            };
            let stepped = tokio::task::spawn_blocking(move || {
                let step = optimizer.steps() as usize + 1;
                temper_train::adam_step(&mut optimizer, &mut adapter, &grads, &params, step)
                    .map(|norm| (norm, adapter, optimizer))
            })
            .await;
            match stepped {
                Ok(Ok((grad_norm, adapter, optimizer))) => {
                    {
                        let mut st = run.lock();
                        st.adapter = adapter;
                        st.optimizer = optimizer;
                    }
                    if let Some(meter) = meter {
                        let key = temper_store::UsageKey {
                            team: run.team.clone(),
                            project,
                            model: run.served_name.clone(),
                            bucket_start: temper_store::usage_bucket(now()),
                        };
                        let counts = temper_store::TokenCounts {
                            trained_tokens: trained,
                            num_gradient_steps: 1,
                            ..Default::default()
                        };
                        meter.add(key, counts);
                    }
                    Outcome::Json(json!({
                        "metrics": {
                            "grad_norm": grad_norm,
                            "learning_rate": params.learning_rate,
                        }
                    }))
                }
                Ok(Err(e)) => Outcome::from_error(&e.into()),
                Err(e) => Outcome::server(format!("the optimizer step panicked: {e}")),
            }
        })
    });
    Ok(Json(tinker.submit(&run, key.as_deref(), work)))
}

/// A checkpoint name as the SDK may give it: 1-128 of letters, digits, `-`, `_`, `.`.
fn checkpoint_name(param: &str, name: Option<&str>, default: String) -> Result<String, ApiError> {
    let Some(name) = name else { return Ok(default) };
    let ok = !name.is_empty()
        && name.len() <= 128
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
    if ok {
        Ok(name.to_owned())
    } else {
        Err(ApiError::bad(
            param,
            format!("A checkpoint name is 1-128 letters, digits, '-', '_' or '.', got {name:?}."),
        ))
    }
}

fn tinker_path(run: &TrainingRun, id: &str) -> String {
    format!("tinker://{}/{id}", run.model_id())
}

/// Records a saved checkpoint, replacing one of the same id.
fn record(run: &TrainingRun, saved: SavedCheckpoint) {
    let mut st = run.lock();
    st.checkpoints.retain(|c| c.id != saved.id);
    st.checkpoints.push(saved);
}

/// `save_weights` (`save_state`): the adapter and its optimizer, kept in memory for
/// `load_weights` while the server runs.
pub async fn save_weights(
    Extension(tinker): Registry,
    Extension(ctx): Extension<RequestContext>,
    ValidJson(req): ValidJson<SaveWeightsRequest>,
) -> Result<Json<UntypedFuture>, ApiError> {
    let run = tinker.run(&ctx.team, &req.model_id)?;
    let name = req.path.clone();
    let fallback = format!("state-{}", req.seq_id.unwrap_or(0));
    let name = checkpoint_name("path", name.as_deref(), fallback)?;
    let key = request_key(&req.model_id, req.seq_id);
    let work: Work = Box::new(move |run: Arc<TrainingRun>| {
        Box::pin(async move {
            let id = format!("weights/{name}");
            let (adapter, optimizer) = {
                let st = run.lock();
                (st.adapter.clone(), st.optimizer.clone())
            };
            let size_bytes = adapter.memory_bytes();
            record(
                &run,
                SavedCheckpoint {
                    id: id.clone(),
                    time: now(),
                    step: None,
                    state: Some(SavedState { adapter, optimizer }),
                    size_bytes,
                },
            );
            Outcome::Json(json!({ "type": "save_weights", "path": tinker_path(&run, &id) }))
        })
    });
    Ok(Json(tinker.submit(&run, key.as_deref(), work)))
}

/// `save_weights_for_sampler`: the adapter as the store model's next checkpoint, served by name
/// (`<team>/tinker/run-<id>:step<N>`, also over `/v1/chat/completions`) and listed in
/// `/v1/models`. Without a name (`save_weights_and_get_sampling_client`) the answer is a
/// sampling session on it.
pub async fn save_weights_for_sampler(
    State(state): State<AppState>,
    Extension(tinker): Registry,
    Extension(ctx): Extension<RequestContext>,
    ValidJson(req): ValidJson<SaveWeightsRequest>,
) -> Result<Json<UntypedFuture>, ApiError> {
    let training = training_service(&state)?.clone();
    let run = tinker.run(&ctx.team, &req.model_id)?;
    if req.kind.as_deref().is_some_and(|k| k != "snapshot") {
        return Err(ApiError::bad(
            "kind",
            "temper's sampler weights are snapshots only (`kind=\"snapshot\"`).",
        ));
    }
    let name = match &req.path {
        Some(p) => Some(checkpoint_name("path", Some(p), String::new())?),
        None => None,
    };
    let key = request_key(&req.model_id, req.seq_id);
    let registry = tinker.clone();
    let work: Work = Box::new(move |run: Arc<TrainingRun>| {
        Box::pin(async move {
            let adapter = run.lock().adapter.clone();
            let bytes = match tokio::task::spawn_blocking(move || adapter.to_bytes()).await {
                Ok(Ok(b)) => b,
                Ok(Err(e)) => return Outcome::server(format!("serializing the adapter: {e}")),
                Err(e) => return Outcome::server(format!("serializing the adapter panicked: {e}")),
            };
            let size_bytes = bytes.len();
            let metrics =
                json!({ "tinker": true, "lora_rank": run.rank, "lora_alpha": LORA_ALPHA });
            let checkpoint = match training
                .store_checkpoint(&run.team, run.store_id, bytes, &metrics, None)
                .await
            {
                Ok(c) => c,
                Err(e) => return Outcome::from_error(&e.into()),
            };
            let step = checkpoint.step;
            let id = format!(
                "sampler_weights/{}",
                name.unwrap_or_else(|| format!("step-{step}"))
            );
            record(
                &run,
                SavedCheckpoint {
                    id: id.clone(),
                    time: now(),
                    step: Some(step),
                    state: None,
                    size_bytes,
                },
            );
            let path = tinker_path(&run, &id);
            let sampler = registry.add_sampler(Sampler {
                team: run.team.clone(),
                base_model: run.base.name.clone(),
                served_name: format!("{}:step{step}", run.served_name),
                model_path: Some(path.clone()),
            });
            tracing::info!(model_id = %run.model_id(), step, "tinker sampler weights saved");
            Outcome::Json(json!({
                "type": "save_weights_for_sampler",
                "path": path,
                "sampling_session_id": sampler,
            }))
        })
    });
    Ok(Json(tinker.submit(&run, key.as_deref(), work)))
}

/// `tinker://<run>/<weights|sampler_weights>/<name>` of the team: the run and the checkpoint.
fn resolve_path(
    tinker: &Tinker,
    team: &str,
    path: &str,
) -> Result<(Arc<TrainingRun>, SavedCheckpoint), ApiError> {
    let bad = || {
        ApiError::bad(
            "path",
            format!(
                "{path:?} is not a checkpoint path: `tinker://<training_run_id>/weights/<name>` \
                 or `tinker://<training_run_id>/sampler_weights/<name>`."
            ),
        )
    };
    let rest = path.strip_prefix("tinker://").ok_or_else(bad)?;
    let (run_id, id) = rest.split_once('/').ok_or_else(bad)?;
    let run = tinker.run(team, run_id)?;
    let saved = run
        .lock()
        .checkpoints
        .iter()
        .find(|c| c.id == id)
        .cloned()
        .ok_or_else(|| ApiError::NotFound(format!("The checkpoint `{path}` does not exist.")))?;
    Ok((run, saved))
}

/// `load_weights` (`load_state`, `load_state_with_optimizer`) into an existing run, from a
/// `weights/` checkpoint saved while the server runs; any accumulated gradient is dropped.
pub async fn load_weights(
    State(state): State<AppState>,
    Extension(tinker): Registry,
    Extension(ctx): Extension<RequestContext>,
    ValidJson(req): ValidJson<LoadWeightsRequest>,
) -> Result<Json<UntypedFuture>, ApiError> {
    let Some(model_id) = req.model_id.clone() else {
        return load_into_new_run(&state, &tinker, &ctx, req)
            .await
            .map(Json);
    };
    let run = tinker.run(&ctx.team, &model_id)?;
    let (_, saved) = resolve_path(&tinker, &ctx.team, &req.path)?;
    let Some(state) = saved.state.clone() else {
        return Err(ApiError::bad(
            "path",
            "Sampler weights have no training state: load a `weights/` checkpoint (save_state).",
        ));
    };
    if !state.adapter.fits(run.base.base.model.config()) {
        return Err(ApiError::bad(
            "path",
            "The checkpoint is of another base model than this training client's.",
        ));
    }
    let key = request_key(&model_id, req.seq_id);
    let with_optimizer = req.optimizer;
    let path = req.path.clone();
    let work: Work = Box::new(move |run: Arc<TrainingRun>| {
        Box::pin(async move {
            let mut st = run.lock();
            st.optimizer = if with_optimizer {
                state.optimizer
            } else {
                AdamW::new(&state.adapter)
            };
            st.adapter = state.adapter;
            st.grads = None;
            st.last_request = now();
            Outcome::Json(
                json!({ "type": "load_weights", "path": path, "model_id": run.model_id() }),
            )
        })
    });
    Ok(Json(tinker.submit(&run, key.as_deref(), work)))
}

/// `create_training_client_from_state`: a new run `<session_id>:train:<model_seq_id>` (the id
/// the SDK gives it) from a saved state, with its optimizer when asked. A retry finds the run.
async fn load_into_new_run(
    state: &AppState,
    tinker: &Tinker,
    ctx: &RequestContext,
    req: LoadWeightsRequest,
) -> Result<UntypedFuture, ApiError> {
    let training = training_service(state)?;
    let (Some(session), Some(seq)) = (&req.session_id, req.model_seq_id) else {
        return Err(ApiError::bad(
            "model_id",
            "`load_weights` needs a `model_id`, or a `session_id` and `model_seq_id` for a new \
             training model.",
        ));
    };
    tinker.check_session(&ctx.team, session)?;
    let model_id = format!("{session}:train:{seq}");
    let key = format!("load#{model_id}");
    if let Some(seen) = tinker.seen(&ctx.team, &key) {
        return Ok(seen);
    }
    let (source, saved) = resolve_path(tinker, &ctx.team, &req.path)?;
    let Some(saved_state) = saved.state else {
        return Err(ApiError::bad(
            "path",
            "Sampler weights have no training state: load a `weights/` checkpoint (save_state).",
        ));
    };
    if let Some(base) = req.base_model.as_deref().filter(|b| *b != source.base.name) {
        return Err(ApiError::bad(
            "base_model",
            format!("The checkpoint is of `{}`, not `{base}`.", source.base.name),
        ));
    }
    if tinker.run(&ctx.team, &model_id).is_ok() {
        return Err(ApiError::Conflict(format!(
            "The training model `{model_id}` exists."
        )));
    }
    let optimizer = req.optimizer.then_some(saved_state.optimizer);
    let parts = RunParts {
        base: source.base.clone(),
        rank: source.rank,
        trains: source.trains,
        adapter: saved_state.adapter,
        optimizer,
        user_metadata: req.user_metadata,
    };
    let run = register_run(training, tinker, ctx, model_id, parts).await?;
    let answer = json!({ "type": "load_weights", "path": req.path, "model_id": run.model_id() });
    let (future, tx) = tinker.new_future(&ctx.team, Some(&key), |request_id| UntypedFuture {
        request_id,
        model_id: Some(run.model_id()),
        sample_sequence_ids: None,
    });
    tx.send_replace(Some(Outcome::Json(answer)));
    Ok(future)
}

/// What a sampling request names: a `tinker://…/sampler_weights/…` path or a base model.
fn sampler_for(
    state: &AppState,
    tinker: &Tinker,
    team: &str,
    model_path: Option<&str>,
    base_model: Option<&str>,
) -> Result<Sampler, ApiError> {
    if let Some(path) = model_path {
        let (run, saved) = resolve_path(tinker, team, path)?;
        let Some(step) = saved.step else {
            return Err(ApiError::bad(
                "model_path",
                "Sample from sampler weights (`save_weights_for_sampler`), not a training state.",
            ));
        };
        return Ok(Sampler {
            team: team.to_owned(),
            base_model: run.base.name.clone(),
            served_name: format!("{}:step{step}", run.served_name),
            model_path: Some(path.to_owned()),
        });
    }
    let Some(base) = base_model else {
        return Err(ApiError::bad(
            "base_model",
            "Name a `base_model` or a `model_path` to sample from.",
        ));
    };
    let model = state.model(Some(base)).map_err(|_| {
        ApiError::bad(
            "base_model",
            format!("`{base}` is not a base model this server serves."),
        )
    })?;
    Ok(Sampler {
        team: team.to_owned(),
        base_model: model.name.clone(),
        served_name: model.name.clone(),
        model_path: None,
    })
}

pub async fn create_sampling_session(
    State(state): State<AppState>,
    Extension(tinker): Registry,
    Extension(ctx): Extension<RequestContext>,
    ValidJson(req): ValidJson<CreateSamplingSessionRequest>,
) -> Result<Json<Value>, ApiError> {
    tinker.check_session(&ctx.team, &req.session_id)?;
    let sampler = sampler_for(
        &state,
        &tinker,
        &ctx.team,
        req.model_path.as_deref(),
        req.base_model.as_deref(),
    )?;
    let id = tinker.add_sampler(sampler);
    Ok(Json(
        json!({ "type": "create_sampling_session", "sampling_session_id": id }),
    ))
}

pub async fn get_sampler(
    Extension(tinker): Registry,
    Extension(ctx): Extension<RequestContext>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let s = tinker.sampler(&ctx.team, &id)?;
    Ok(Json(json!({
        "sampler_id": id,
        "base_model": s.base_model,
        "model_path": s.model_path,
    })))
}

/// The `/v1/completions` body of a sample request: the prompt's ids, `n` samples, each
/// sampled token's logprob and id, the prompt's logprobs when asked.
fn completion_body(
    served_name: &str,
    req: &SampleRequest,
    prompt: &[u32],
    context: usize,
) -> Result<Value, ApiError> {
    let p = &req.sampling_params;
    let mut body = json!({
        "model": served_name,
        "prompt": prompt,
        "n": req.num_samples,
        "temperature": p.temperature,
        "top_p": p.top_p,
        "logprobs": 0,
        "return_token_ids": true,
        "skip_special_tokens": false,
    });
    if p.top_k > 0 {
        body["top_k"] = json!(p.top_k);
    }
    // Without `max_tokens`, the context the prompt leaves (the completions route's default
    // is 16).
    match p.max_tokens {
        Some(m) => body["max_tokens"] = json!(m),
        None if context > prompt.len() => body["max_tokens"] = json!(context - prompt.len()),
        None => {}
    }
    if let Some(seed) = p.seed {
        body["seed"] = json!(seed);
    }
    if req.prompt_logprobs == Some(true) {
        body["prompt_logprobs"] = json!(0);
    }
    match &p.stop {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => body["stop"] = json!([s]),
        Some(Value::Array(items)) if items.is_empty() => body["ignore_eos"] = json!(true),
        Some(Value::Array(items)) if items.iter().all(Value::is_string) => {
            body["stop"] = json!(items)
        }
        Some(Value::Array(items)) if items.iter().all(Value::is_i64) => {
            body["stop_token_ids"] = json!(items)
        }
        Some(_) => {
            return Err(ApiError::bad(
                "sampling_params.stop",
                "`stop` is a string, a list of strings or a list of token ids.",
            ))
        }
    }
    Ok(body)
}

fn prompt_tokens(input: &crate::tinker::wire::ModelInput) -> Result<Vec<u32>, ApiError> {
    let mut tokens = Vec::new();
    for (i, c) in input.chunks.iter().enumerate() {
        let kind = c
            .get("type")
            .and_then(Value::as_str)
            .unwrap_or("encoded_text");
        let ids = c.get("tokens").and_then(Value::as_array);
        match (kind, ids) {
            ("encoded_text", Some(ids)) => {
                for id in ids {
                    let id = id
                        .as_u64()
                        .and_then(|x| u32::try_from(x).ok())
                        .ok_or_else(|| {
                            ApiError::bad(
                                format!("prompt.chunks[{i}].tokens"),
                                "Token ids are integers of at least 0.",
                            )
                        })?;
                    tokens.push(id);
                }
            }
            _ => {
                return Err(ApiError::bad(
                    format!("prompt.chunks[{i}]"),
                    format!(
                        "temper's models take text chunks (`encoded_text`) only, not `{kind}`."
                    ),
                ))
            }
        }
    }
    if tokens.is_empty() {
        return Err(ApiError::bad("prompt", "The prompt has no tokens."));
    }
    Ok(tokens)
}

/// `asample`: `num_samples` sequences through temper's engine (the `/v1/completions` path, with
/// its admission, quotas and usage), each sampled token's logprob, the prompt's when asked.
pub async fn asample(
    State(state): State<AppState>,
    Extension(tinker): Registry,
    Extension(ctx): Extension<RequestContext>,
    ValidJson(req): ValidJson<SampleRequest>,
) -> Result<Json<UntypedFuture>, ApiError> {
    let (sampler, session) = match &req.sampling_session_id {
        Some(id) => (tinker.sampler(&ctx.team, id)?, id.clone()),
        None => (
            sampler_for(
                &state,
                &tinker,
                &ctx.team,
                req.model_path.as_deref(),
                req.base_model.as_deref(),
            )?,
            String::new(),
        ),
    };
    let unsupported = [
        ("topk_prompt_logprobs", req.topk_prompt_logprobs != 0),
        ("topk_sample_logprobs", req.topk_sample_logprobs != 0),
        (
            "target_prompt_logprobs",
            req.target_prompt_logprobs.is_some(),
        ),
        ("prompt_alt_tokens_k", req.prompt_alt_tokens_k != 0),
    ];
    if let Some((name, _)) = unsupported.iter().find(|(_, set)| *set) {
        return Err(ApiError::bad(
            *name,
            format!("temper does not support `{name}` (per-token logprobs and prompt logprobs are supported)."),
        ));
    }
    if req.num_samples < 1 {
        return Err(ApiError::bad(
            "num_samples",
            "`num_samples` must be at least 1.",
        ));
    }
    let prompt = prompt_tokens(&req.prompt)?;
    let context = state
        .model(Some(&sampler.base_model))
        .map_or(0, |m| m.max_model_len);
    let body = completion_body(&sampler.served_name, &req, &prompt, context)?;
    let completion: crate::protocol::CompletionRequest =
        crate::extract::parse_json(body.to_string().as_bytes())?;
    let key = req
        .seq_id
        .filter(|_| !session.is_empty())
        .map(|s| format!("sample#{session}#{s}"));
    if let Some(seen) = key.as_deref().and_then(|k| tinker.seen(&ctx.team, k)) {
        return Ok(Json(seen));
    }
    let n = req.num_samples as usize;
    let (future, tx) = tinker.new_future(&ctx.team, key.as_deref(), |request_id| UntypedFuture {
        sample_sequence_ids: Some((0..n).map(|i| format!("{request_id}:{i}")).collect()),
        request_id,
        model_id: None,
    });
    let with_prompt_logprobs = req.prompt_logprobs == Some(true);
    tokio::spawn(async move {
        let response =
            crate::completions::completions(State(state), Extension(ctx), ValidJson(completion))
                .await;
        let outcome = match response {
            Ok(r) => sample_outcome(r, &prompt, with_prompt_logprobs).await,
            Err(e) => Outcome::from_error(&e),
        };
        tx.send_replace(Some(outcome));
    });
    Ok(Json(future))
}

/// The completion's answer as a `SampleResponse`.
async fn sample_outcome(response: Response, prompt: &[u32], with_prompt_logprobs: bool) -> Outcome {
    let status = response.status();
    let body = match axum::body::to_bytes(response.into_body(), usize::MAX).await {
        Ok(b) => b,
        Err(e) => return Outcome::server(format!("reading the completion: {e}")),
    };
    let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    if !status.is_success() {
        let message = v["error"]["message"]
            .as_str()
            .unwrap_or("sampling failed")
            .to_owned();
        return if status.is_client_error() {
            Outcome::user(message)
        } else {
            Outcome::server(message)
        };
    }
    let mut choices: Vec<&Value> = v["choices"]
        .as_array()
        .map(|c| c.iter().collect())
        .unwrap_or_default();
    choices.sort_by_key(|c| c["index"].as_u64());
    let f32_or_nan = |x: &Value| x.as_f64().map_or(f32::NAN, |x| x as f32);
    let sequences: Vec<proto::Sequence> = choices
        .iter()
        .map(|c| proto::Sequence {
            stopped: c["finish_reason"].as_str() != Some("length"),
            tokens: c["token_ids"]
                .as_array()
                .map(|ids| {
                    ids.iter()
                        .filter_map(|x| x.as_u64())
                        .map(|x| x as u32)
                        .collect()
                })
                .unwrap_or_default(),
            logprobs: c["logprobs"]["token_logprobs"]
                .as_array()
                .map(|l| l.iter().map(f32_or_nan).collect())
                .unwrap_or_default(),
        })
        .collect();
    let prompt_logprobs: Option<Vec<f32>> = with_prompt_logprobs.then(|| {
        let at = choices.first().map(|c| &c["prompt_logprobs"]);
        prompt
            .iter()
            .enumerate()
            .map(|(i, id)| {
                at.and_then(|a| a.get(i))
                    .and_then(|e| e.get(id.to_string()))
                    .map_or(f32::NAN, |e| f32_or_nan(&e["logprob"]))
            })
            .collect()
    });
    let json = json!({
        "sequences": sequences.iter().map(|s| json!({
            "stop_reason": if s.stopped { "stop" } else { "length" },
            "tokens": s.tokens,
            "logprobs": s.logprobs.iter().map(|x| if x.is_nan() { Value::Null } else { json!(x) }).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
        "prompt_logprobs": prompt_logprobs.as_ref().map(|l| l.iter().map(|x| if x.is_nan() { Value::Null } else { json!(x) }).collect::<Vec<_>>()),
    });
    Outcome::Proto {
        bytes: proto::sample_response(&sequences, prompt_logprobs.as_deref()),
        json,
    }
}

/// A future's result, or `{"type": "try_again"}` after waiting [`LONG_POLL`] for it. A failed
/// request's answer is `{"error", "category"}` (the SDK raises it); a result the SDK reads as
/// protobuf comes as protobuf when the request accepts it, else as JSON.
pub async fn retrieve_future(
    Extension(tinker): Registry,
    Extension(ctx): Extension<RequestContext>,
    headers: HeaderMap,
    ValidJson(req): ValidJson<FutureRequest>,
) -> Result<Response, ApiError> {
    let outcome = tinker
        .retrieve(&ctx.team, &req.request_id, LONG_POLL)
        .await?;
    let accepts_proto = headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.contains(PROTOBUF));
    Ok(match outcome {
        None => Json(json!({
            "type": "try_again",
            "request_id": req.request_id,
            "queue_state": "active",
        }))
        .into_response(),
        Some(Outcome::Json(v)) => Json(v).into_response(),
        Some(Outcome::Proto { bytes, .. }) if accepts_proto => {
            let mut r = bytes.into_response();
            r.headers_mut()
                .insert(header::CONTENT_TYPE, HeaderValue::from_static(PROTOBUF));
            r
        }
        Some(Outcome::Proto { json, .. }) => Json(json).into_response(),
        Some(Outcome::Failed { error, category }) => {
            Json(json!({ "error": error, "category": category })).into_response()
        }
    })
}

/// Work already queued runs to its end; a cancel only checks the future is the team's.
pub async fn cancel_future(
    Extension(tinker): Registry,
    Extension(ctx): Extension<RequestContext>,
    ValidJson(req): ValidJson<FutureRequest>,
) -> Result<Json<Value>, ApiError> {
    if !tinker.has_future(&ctx.team, &req.request_id) {
        return Err(ApiError::NotFound(format!(
            "The future `{}` does not exist.",
            req.request_id
        )));
    }
    Ok(Json(json!({})))
}

fn checkpoint_json(run: &TrainingRun, c: &SavedCheckpoint) -> Value {
    json!({
        "checkpoint_id": c.id,
        "checkpoint_type": if c.is_sampler() { "sampler" } else { "training" },
        "time": c.time,
        "tinker_path": tinker_path(run, &c.id),
        "size_bytes": c.size_bytes,
        "public": false,
    })
}

fn run_json(run: &TrainingRun) -> Value {
    let st = run.lock();
    let last = |sampler: bool| {
        st.checkpoints
            .iter()
            .rev()
            .find(|c| c.is_sampler() == sampler)
            .map(|c| checkpoint_json(run, c))
    };
    // The SDK reads metadata as strings.
    let metadata = run.user_metadata.as_ref().map(|m| {
        m.iter()
            .map(|(k, v)| {
                (
                    k.clone(),
                    Value::String(v.as_str().map_or_else(|| v.to_string(), str::to_owned)),
                )
            })
            .collect::<serde_json::Map<_, _>>()
    });
    json!({
        "training_run_id": run.model_id(),
        "base_model": run.base.name,
        "model_owner": run.team,
        "is_lora": true,
        "corrupted": false,
        "lora_rank": run.rank,
        "last_request_time": st.last_request,
        "last_checkpoint": last(false),
        "last_sampler_checkpoint": last(true),
        "user_metadata": metadata,
    })
}

fn page(query: &ListQuery, total: usize) -> (usize, usize) {
    let limit = query.limit.unwrap_or(20).clamp(1, 1000);
    (query.offset.unwrap_or(0).min(total), limit)
}

pub async fn training_runs(
    Extension(tinker): Registry,
    Extension(ctx): Extension<RequestContext>,
    ValidQuery(query): ValidQuery<ListQuery>,
) -> Json<Value> {
    let runs = tinker.runs(&ctx.team);
    let (offset, limit) = page(&query, runs.len());
    let items: Vec<Value> = runs
        .iter()
        .skip(offset)
        .take(limit)
        .map(|r| run_json(r))
        .collect();
    Json(json!({
        "training_runs": items,
        "cursor": { "offset": offset, "limit": limit, "total_count": runs.len() },
    }))
}

pub async fn training_run(
    Extension(tinker): Registry,
    Extension(ctx): Extension<RequestContext>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let run = tinker.run(&ctx.team, &id)?;
    Ok(Json(run_json(&run)))
}

fn checkpoints_of(run: &TrainingRun) -> Vec<Value> {
    let st = run.lock();
    st.checkpoints
        .iter()
        .map(|c| checkpoint_json(run, c))
        .collect()
}

pub async fn run_checkpoints(
    Extension(tinker): Registry,
    Extension(ctx): Extension<RequestContext>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let run = tinker.run(&ctx.team, &id)?;
    Ok(Json(json!({ "checkpoints": checkpoints_of(&run) })))
}

/// Every checkpoint of the team's runs.
pub async fn checkpoints(
    Extension(tinker): Registry,
    Extension(ctx): Extension<RequestContext>,
    ValidQuery(query): ValidQuery<ListQuery>,
) -> Json<Value> {
    let all: Vec<Value> = tinker
        .runs(&ctx.team)
        .iter()
        .flat_map(|r| checkpoints_of(r))
        .collect();
    let (offset, limit) = page(&query, all.len());
    Json(json!({
        "checkpoints": all.iter().skip(offset).take(limit).collect::<Vec<_>>(),
        "cursor": { "offset": offset, "limit": limit, "total_count": all.len() },
    }))
}

/// Deletes a checkpoint; sampler weights' store checkpoint (and its served name) go with it.
pub async fn delete_checkpoint(
    State(state): State<AppState>,
    Extension(tinker): Registry,
    Extension(ctx): Extension<RequestContext>,
    Path((id, kind, name)): Path<(String, String, String)>,
) -> Result<Json<Value>, ApiError> {
    let path = format!("tinker://{id}/{kind}/{name}");
    let (run, saved) = resolve_path(&tinker, &ctx.team, &path)?;
    if let Some(step) = saved.step {
        state
            .require_training()?
            .delete_checkpoints(&ctx.team, run.store_id, &[step])
            .await?;
    }
    run.lock().checkpoints.retain(|c| c.id != saved.id);
    Ok(Json(json!({})))
}
