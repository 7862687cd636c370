//! Typed server state: the served models (each a catalog base model with its engine), the
//! catalog of trained checkpoints, the training service when the server has one, and the
//! server-wide options.

use std::path::PathBuf;
use std::sync::Arc;

use temper_catalog::{BaseModel, Catalog};
use temper_engine::{Engine, EngineConfig, Scheduling};
use temper_store::{Checkpoint, Store};
use temper_text::tool_calls::ToolCallFormat;
use temper_train::service::TrainingService;

use crate::error::ApiError;
use crate::meter::{unix_now, UsageMeter};
use crate::team_limits::TeamRequests;
use crate::validation::{ChatParams, CompletionParams, Limits};

/// One model the server answers for: a base model of the catalog (shared with the training
/// service) and its own engine (scheduler thread). Reads as its [`BaseModel`] (name, weights, tokenizer,
/// template).
pub struct ServedModel {
    pub base: Arc<BaseModel>,
    pub engine: Engine,
    pub max_model_len: usize,
    /// [`temper_text::Tokenizer::max_text_bytes_per_token`], for the context check before tokenizing.
    pub max_text_bytes_per_token: usize,
    pub scheduling: Scheduling,
}

impl std::ops::Deref for ServedModel {
    type Target = BaseModel;
    fn deref(&self) -> &BaseModel {
        &self.base
    }
}

/// An extension point: sees every validated chat completion and completion request (with its
/// `engine_xargs` and `kv_transfer_params`) before it reaches the engine, and may refuse it with
/// an error. Both methods are required, so that a hook cannot let one route through unseen.
pub trait RequestHook: Send + Sync + std::fmt::Debug {
    fn on_request(&self, params: &ChatParams) -> Result<(), ApiError>;
    /// `POST /v1/completions`.
    fn on_completion(&self, params: &CompletionParams) -> Result<(), ApiError>;
}

/// The default hook: does nothing.
#[derive(Debug, Default)]
pub struct NoHook;

impl RequestHook for NoHook {
    fn on_request(&self, _: &ChatParams) -> Result<(), ApiError> {
        Ok(())
    }

    fn on_completion(&self, _: &CompletionParams) -> Result<(), ApiError> {
        Ok(())
    }
}

/// How to load one served model from a GGUF file.
#[derive(Debug, Clone)]
pub struct ModelSpec {
    pub name: String,
    pub path: PathBuf,
    /// `--chat-template`: overrides the template found in the file.
    pub chat_template: Option<PathBuf>,
    /// `--max-model-len`: at most the model's context length (`None`: that length).
    pub max_model_len: Option<usize>,
    /// The engine's limits (`--max-running`, `--max-batch-tokens`, `--max-waiting`,
    /// `--scheduling`, `--prompt-lookup-tokens`, `--kv-cache-mb`); its `max_model_len` comes
    /// from the field above.
    pub engine: EngineConfig,
}

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error(transparent)]
    Base(#[from] temper_catalog::LoadError),
    #[error("--max-model-len {requested} exceeds the context length {context} of model `{name}`")]
    MaxModelLen {
        name: String,
        requested: usize,
        context: usize,
    },
    #[error("model name `{0}` is served twice")]
    DuplicateName(String),
    #[error("no model to serve")]
    NoModels,
}

impl ModelSpec {
    pub fn new(name: impl Into<String>, path: impl Into<PathBuf>) -> Self {
        ModelSpec {
            name: name.into(),
            path: path.into(),
            chat_template: None,
            max_model_len: None,
            engine: EngineConfig::default(),
        }
    }
}

impl ServedModel {
    /// Loads weights, tokenizer and template and starts the model's engine.
    /// Template precedence: `spec.chat_template` file, then the GGUF's `tokenizer.chat_template`,
    /// then the shipped Gemma 3 template for gemma3 files.
    pub fn load(spec: &ModelSpec) -> Result<ServedModel, LoadError> {
        let base = BaseModel::load(&spec.name, &spec.path, spec.chat_template.as_deref())?;
        let name = spec.name.clone();
        let context = base.model.config().context_length;
        let max_model_len = match spec.max_model_len {
            Some(n) if n > context => {
                return Err(LoadError::MaxModelLen {
                    name,
                    requested: n,
                    context,
                })
            }
            Some(n) => n,
            None => context,
        };
        let max_text_bytes_per_token = base.tokenizer.max_text_bytes_per_token();
        let engine = Engine::start(
            base.model.clone(),
            base.tokenizer.clone(),
            EngineConfig {
                max_model_len,
                ..spec.engine.clone()
            },
        );
        Ok(ServedModel {
            base: Arc::new(base),
            engine,
            max_model_len,
            max_text_bytes_per_token,
            scheduling: spec.engine.scheduling,
        })
    }
}

/// Server-wide settings that shape request handling.
#[derive(Debug, Clone)]
pub struct ServerOptions {
    /// Bearer keys of team `default`. With none here and no active key in the store, requests
    /// need no key (the binary only allows that on loopback).
    pub api_keys: Vec<String>,
    /// Ask every request for a key even when none is configured (the binary sets it when it
    /// binds a non-loopback address, so revoking the last store key never opens the server).
    pub require_key: bool,
    pub trust_request_chat_template: bool,
    /// `--enable-tool-calls`: `tool_choice` other than "none" is served.
    pub enable_tool_calls: bool,
    pub max_body_bytes: usize,
    /// Most `top_logprobs` per token; `None` = the whole vocabulary may be requested.
    pub max_logprobs: Option<usize>,
    pub max_n: usize,
    /// `--max-requests-per-team`: generation requests one team may have in flight (`None`: no
    /// bound); past it a 429.
    pub max_requests_per_team: Option<usize>,
    /// Sees every validated chat completion and completion request (extensions; the default
    /// does nothing).
    pub request_hook: Arc<dyn RequestHook>,
}

impl Default for ServerOptions {
    fn default() -> Self {
        ServerOptions {
            api_keys: Vec::new(),
            require_key: false,
            trust_request_chat_template: false,
            enable_tool_calls: false,
            max_body_bytes: 4 * 1024 * 1024,
            max_logprobs: Some(20),
            max_n: 16,
            max_requests_per_team: Some(128),
            request_hook: Arc::new(NoHook),
        }
    }
}

/// Shared by every handler; cheap to clone.
#[derive(Clone)]
pub struct AppState {
    inner: Arc<Inner>,
}

struct Inner {
    /// In order of configuration; the first answers requests that name no model.
    models: Vec<Arc<ServedModel>>,
    options: ServerOptions,
    team_requests: Arc<TeamRequests>,
    /// Trained checkpoints and their adapters (with a store); base models only without one.
    catalog: Arc<Catalog>,
    /// The training routes' service (jobs, models, checkpoints); `None` without a store.
    training: Option<Arc<TrainingService>>,
    /// Counts chat completions' tokens into the catalog's store; `None` without one.
    usage: Option<Arc<UsageMeter>>,
    /// Reported as every model's `created`.
    started: u64,
}

impl AppState {
    /// Base models only: no store, no training API.
    pub fn new(models: Vec<ServedModel>, options: ServerOptions) -> Result<Self, LoadError> {
        let bases = models.iter().map(|m| m.base.clone()).collect();
        Self::with_catalog(models, options, Arc::new(Catalog::base_only(bases)), None)
    }

    /// The served models, the catalog their trained checkpoints resolve in, and the training
    /// API's service (over the catalog's store) when there is one.
    pub fn with_catalog(
        models: Vec<ServedModel>,
        options: ServerOptions,
        catalog: Arc<Catalog>,
        training: Option<Arc<TrainingService>>,
    ) -> Result<Self, LoadError> {
        if models.is_empty() {
            return Err(LoadError::NoModels);
        }
        for (i, m) in models.iter().enumerate() {
            if models[..i].iter().any(|o| o.name == m.name) {
                return Err(LoadError::DuplicateName(m.name.clone()));
            }
        }
        Ok(AppState {
            inner: Arc::new(Inner {
                models: models.into_iter().map(Arc::new).collect(),
                team_requests: TeamRequests::new(options.max_requests_per_team),
                options,
                usage: catalog.store().map(|s| UsageMeter::new(s.clone())),
                catalog,
                training,
                started: unix_now(),
            }),
        })
    }

    pub fn models(&self) -> &[Arc<ServedModel>] {
        &self.inner.models
    }

    pub fn options(&self) -> &ServerOptions {
        &self.inner.options
    }

    /// Each team's generation requests in flight.
    pub fn team_requests(&self) -> &Arc<TeamRequests> {
        &self.inner.team_requests
    }

    pub fn started(&self) -> u64 {
        self.inner.started
    }

    pub fn training(&self) -> Option<&Arc<TrainingService>> {
        self.inner.training.as_ref()
    }

    pub fn catalog(&self) -> &Arc<Catalog> {
        &self.inner.catalog
    }

    /// The store (keys, usage, trained models); `None` for base models only.
    pub fn store(&self) -> Option<&Store> {
        self.inner.catalog.store()
    }

    /// Where chat completions' usage is counted (with the store).
    pub fn usage_meter(&self) -> Option<&Arc<UsageMeter>> {
        self.inner.usage.as_ref()
    }

    /// The training service, or a 503 saying the server runs without one.
    pub fn require_training(&self) -> Result<&Arc<TrainingService>, ApiError> {
        self.training().ok_or_else(|| {
            ApiError::ServiceUnavailable(
                "This server runs without a store: the training API is off.".to_owned(),
            )
        })
    }

    /// The model a request names; as in vLLM, a request without `model` gets the first one.
    pub fn model(&self, name: Option<&str>) -> Result<Arc<ServedModel>, ApiError> {
        match name {
            None => Ok(self.inner.models[0].clone()),
            Some(name) => self
                .inner
                .models
                .iter()
                .find(|m| m.name == name)
                .cloned()
                .ok_or_else(|| ApiError::ModelNotFound(name.to_owned())),
        }
    }

    /// Resolves a request's `model`: a base model's own name first, then a trained name of the
    /// key's team in the catalog. Unknown names, another team's and missing steps are all the
    /// same 404.
    pub async fn resolve(
        &self,
        requested: Option<&str>,
        team: &str,
    ) -> Result<ResolvedModel, ApiError> {
        let base_err = match self.model(requested) {
            Ok(base) => {
                return Ok(ResolvedModel {
                    name: base.name.clone(),
                    base,
                    checkpoint: None,
                })
            }
            Err(e) => e,
        };
        let Some(requested) = requested else {
            return Err(base_err);
        };
        let Some(trained) = self.inner.catalog.resolve(team, requested).await? else {
            return Err(ApiError::ModelNotFound(requested.to_owned()));
        };
        let base = self.model(Some(&trained.model.base_model)).map_err(|_| {
            ApiError::ServiceUnavailable(format!(
                "The base model `{}` of `{requested}` is not served by this server.",
                trained.model.base_model
            ))
        })?;
        Ok(ResolvedModel {
            base,
            name: requested.to_owned(),
            checkpoint: Some(trained.checkpoint),
        })
    }

    pub fn limits(&self, model: &ServedModel) -> Limits {
        Limits {
            vocab_size: model.tokenizer.vocab_size(),
            max_logprobs: self.inner.options.max_logprobs,
            max_n: self.inner.options.max_n,
            trust_request_chat_template: self.inner.options.trust_request_chat_template,
            max_model_len: model.max_model_len,
            priority_scheduling: model.scheduling == Scheduling::Priority,
            tool_calls: self.inner.options.enable_tool_calls.then(|| {
                model
                    .chat_template
                    .as_ref()
                    .map_or(ToolCallFormat::default(), |t| t.tool_call_format())
            }),
            max_prompts: model.engine.max_waiting(),
        }
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
