//! The Tinker API's live objects, in memory and team-scoped: sessions, training runs (a LoRA
//! adapter, its optimizer and its accumulated gradient, each run's requests applied one at a time
//! in arrival order), sampling sessions, and the futures requests answer with.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::future::BoxFuture;
use serde_json::Value;
use temper_model::LoraAdapter;
use temper_train::AdamW;
use tokio::sync::{mpsc, watch};
use uuid::Uuid;

use crate::error::ApiError;
use crate::state::ServedModel;
use crate::tinker::wire::UntypedFuture;

/// How a future ended.
#[derive(Debug, Clone)]
pub enum Outcome {
    Json(Value),
    /// A result the SDK reads only as protobuf (`ForwardBackwardOutput`, `SampleResponse`), and
    /// the same as JSON for other clients.
    Proto {
        bytes: Vec<u8>,
        json: Value,
    },
    /// `category`: `user` (the request cannot succeed) or `server`.
    Failed {
        error: String,
        category: &'static str,
    },
}

impl Outcome {
    pub fn user(error: impl Into<String>) -> Self {
        Outcome::Failed {
            error: error.into(),
            category: "user",
        }
    }

    pub fn server(error: impl Into<String>) -> Self {
        Outcome::Failed {
            error: error.into(),
            category: "server",
        }
    }

    /// An [`ApiError`] as a failed future: 4xx the user's, else the server's.
    pub fn from_error(e: &ApiError) -> Self {
        let message = serde_json::to_value(e.envelope())
            .ok()
            .and_then(|v| v["error"]["message"].as_str().map(str::to_owned))
            .unwrap_or_else(|| e.to_string());
        if e.status().is_client_error() {
            Outcome::user(message)
        } else {
            Outcome::server(message)
        }
    }
}

struct FutureEntry {
    team: String,
    result: watch::Receiver<Option<Outcome>>,
    created: std::time::Instant,
}

/// How long a future's result is kept (for the SDK's polls and retries).
pub const FUTURE_TTL: Duration = Duration::from_secs(3600);

/// A saved state (`save_weights`): the adapter and its optimizer.
#[derive(Clone)]
pub struct SavedState {
    pub adapter: LoraAdapter,
    pub optimizer: AdamW,
}

/// A checkpoint a run saved, as the SDK lists it.
#[derive(Clone)]
pub struct SavedCheckpoint {
    /// `weights/<name>` or `sampler_weights/<name>`.
    pub id: String,
    pub time: i64,
    /// The store checkpoint's step (sampler weights, served by name).
    pub step: Option<i64>,
    /// The training state (`weights`).
    pub state: Option<SavedState>,
    pub size_bytes: usize,
}

impl SavedCheckpoint {
    pub fn is_sampler(&self) -> bool {
        self.id.starts_with("sampler_weights/")
    }
}

/// What a run's requests change, one at a time.
pub struct RunState {
    pub adapter: LoraAdapter,
    pub optimizer: AdamW,
    /// The gradient accumulated since the last `optim_step`.
    pub grads: Option<Vec<Vec<f32>>>,
    /// Positions with a loss in the backward passes since the last `optim_step`: the trained
    /// tokens its usage counts.
    pub pending_tokens: u64,
    pub checkpoints: Vec<SavedCheckpoint>,
    pub last_request: i64,
}

/// A unit of a run's work: runs after the run's earlier requests, with the run.
pub type Work = Box<dyn FnOnce(Arc<TrainingRun>) -> BoxFuture<'static, Outcome> + Send>;

/// What a run is, fixed when it is made.
pub struct RunInfo {
    /// The run's `model_id` and `training_run_id`: 32 hex digits, also in its store model's
    /// name (`run-<id>`), or `<session>:train:<n>` for a run made from a saved state (the SDK
    /// names those itself).
    pub id: String,
    /// The store model's id.
    pub store_id: Uuid,
    pub team: String,
    pub base: Arc<ServedModel>,
    pub rank: usize,
    /// The projections `optim_step` trains; the others' pairs stay as they are (B = 0 in a
    /// fresh adapter: no change).
    pub trains: TrainedTargets,
    /// `<team>/<project>/<name>` of the store model: a checkpoint is served as `…:step<N>`.
    pub served_name: String,
    pub user_metadata: Option<serde_json::Map<String, Value>>,
}

/// Which layer projections a run trains (`lora_config.train_attn`, `train_mlp`); an LM-head
/// pair, where the adapter has one, always trains.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TrainedTargets {
    pub attention: bool,
    pub mlp: bool,
}

impl TrainedTargets {
    /// Whether a pair of `target` (`None`: the LM head's) trains.
    pub fn trains(self, target: Option<temper_model::LoraTarget>) -> bool {
        match target {
            None => true,
            Some(t) if t.is_attention() => self.attention,
            Some(_) => self.mlp,
        }
    }
}

/// A LoRA training run (the SDK's training model), backed by a store model whose checkpoints are
/// the run's sampler weights.
pub struct TrainingRun {
    pub info: RunInfo,
    pub state: Mutex<RunState>,
    queue: mpsc::UnboundedSender<(Work, watch::Sender<Option<Outcome>>)>,
}

impl std::ops::Deref for TrainingRun {
    type Target = RunInfo;

    fn deref(&self) -> &RunInfo {
        &self.info
    }
}

impl TrainingRun {
    pub fn model_id(&self) -> String {
        self.id.clone()
    }

    pub fn lock(&self) -> std::sync::MutexGuard<'_, RunState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// What [`Tinker::add_run`] registers.
pub struct NewRun {
    pub info: RunInfo,
    pub adapter: LoraAdapter,
    /// `None`: a fresh one.
    pub optimizer: Option<AdamW>,
    pub now: i64,
}

/// A sampling session: what `asample` samples from.
#[derive(Clone)]
pub struct Sampler {
    pub team: String,
    pub base_model: String,
    /// The model name serving uses (the base model's, or a checkpoint's trained name).
    pub served_name: String,
    pub model_path: Option<String>,
}

#[derive(Default)]
struct Inner {
    /// Session id → team.
    sessions: HashMap<String, String>,
    runs: HashMap<String, Arc<TrainingRun>>,
    samplers: HashMap<String, Sampler>,
    futures: HashMap<String, FutureEntry>,
    /// (team, a request's identity: its run and `seq_id`) → the future it was answered with, so
    /// a retried request is never applied twice.
    seen: HashMap<(String, String), UntypedFuture>,
}

#[derive(Default)]
pub struct Tinker {
    inner: Mutex<Inner>,
    /// Base model name → its exported Hugging Face tokenizer directory.
    tokenizers: tokio::sync::Mutex<HashMap<String, std::path::PathBuf>>,
}

/// How long `retrieve_future` waits for a pending result before answering "try again".
pub const LONG_POLL: Duration = Duration::from_secs(20);

fn not_found(what: &str, id: &str) -> ApiError {
    ApiError::NotFound(format!("The {what} `{id}` does not exist."))
}

impl Tinker {
    fn inner(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn create_session(&self, team: &str) -> String {
        let id = Uuid::new_v4().to_string();
        self.inner().sessions.insert(id.clone(), team.to_owned());
        id
    }

    /// The session, if it is the team's (another team's is as absent as a missing one).
    pub fn check_session(&self, team: &str, id: &str) -> Result<(), ApiError> {
        match self.inner().sessions.get(id) {
            Some(t) if t == team => Ok(()),
            _ => Err(not_found("session", id)),
        }
    }

    /// Registers a run and starts its queue.
    pub fn add_run(&self, new: NewRun) -> Arc<TrainingRun> {
        let (tx, mut rx) = mpsc::unbounded_channel::<(Work, watch::Sender<Option<Outcome>>)>();
        let run = Arc::new(TrainingRun {
            info: new.info,
            state: Mutex::new(RunState {
                optimizer: new.optimizer.unwrap_or_else(|| AdamW::new(&new.adapter)),
                adapter: new.adapter,
                grads: None,
                pending_tokens: 0,
                checkpoints: Vec::new(),
                last_request: new.now,
            }),
            queue: tx,
        });
        let weak = Arc::downgrade(&run);
        tokio::spawn(async move {
            while let Some((work, done)) = rx.recv().await {
                let Some(run) = weak.upgrade() else { break };
                let outcome = work(run).await;
                done.send_replace(Some(outcome));
            }
        });
        self.inner().runs.insert(run.id.clone(), run.clone());
        run
    }

    /// The team's run `model_id`.
    pub fn run(&self, team: &str, model_id: &str) -> Result<Arc<TrainingRun>, ApiError> {
        self.inner()
            .runs
            .get(model_id)
            .filter(|r| r.team == team)
            .cloned()
            .ok_or_else(|| not_found("training model", model_id))
    }

    pub fn runs(&self, team: &str) -> Vec<Arc<TrainingRun>> {
        let mut runs: Vec<_> = self
            .inner()
            .runs
            .values()
            .filter(|r| r.team == team)
            .cloned()
            .collect();
        runs.sort_by(|a, b| a.id.cmp(&b.id));
        runs
    }

    pub fn add_sampler(&self, sampler: Sampler) -> String {
        let id = Uuid::new_v4().to_string();
        self.inner().samplers.insert(id.clone(), sampler);
        id
    }

    pub fn sampler(&self, team: &str, id: &str) -> Result<Sampler, ApiError> {
        self.inner()
            .samplers
            .get(id)
            .filter(|s| s.team == team)
            .cloned()
            .ok_or_else(|| not_found("sampling session", id))
    }

    /// The future a request with this identity was already answered with.
    pub fn seen(&self, team: &str, key: &str) -> Option<UntypedFuture> {
        self.inner()
            .seen
            .get(&(team.to_owned(), key.to_owned()))
            .cloned()
    }

    /// A new pending future of `team`: its id and the sender that completes it. `key` (a
    /// request's identity) makes a retry of the same request answer with this future.
    pub fn new_future(
        &self,
        team: &str,
        key: Option<&str>,
        answer: impl FnOnce(String) -> UntypedFuture,
    ) -> (UntypedFuture, watch::Sender<Option<Outcome>>) {
        let id = Uuid::new_v4().to_string();
        let (tx, rx) = watch::channel(None);
        let future = answer(id.clone());
        let mut inner = self.inner();
        // Finished futures older than the TTL go, with the retry identities that name them.
        let before = inner.futures.len();
        inner
            .futures
            .retain(|_, f| f.created.elapsed() < FUTURE_TTL || f.result.borrow().is_none());
        if inner.futures.len() < before {
            let Inner { futures, seen, .. } = &mut *inner;
            seen.retain(|_, f| futures.contains_key(&f.request_id));
        }
        inner.futures.insert(
            id,
            FutureEntry {
                team: team.to_owned(),
                result: rx,
                created: std::time::Instant::now(),
            },
        );
        if let Some(key) = key {
            inner
                .seen
                .insert((team.to_owned(), key.to_owned()), future.clone());
        }
        (future, tx)
    }

    /// Queues `work` on `run` (after its earlier requests) and answers with a future of its
    /// outcome; a request already seen under `key` answers with its first future.
    pub fn submit(&self, run: &Arc<TrainingRun>, key: Option<&str>, work: Work) -> UntypedFuture {
        if let Some(seen) = key.and_then(|k| self.seen(&run.team, k)) {
            return seen;
        }
        let (future, done) = self.new_future(&run.team, key, |request_id| UntypedFuture {
            request_id,
            model_id: Some(run.model_id()),
            sample_sequence_ids: None,
        });
        if let Err(mpsc::error::SendError((_, done))) = run.queue.send((work, done)) {
            done.send_replace(Some(Outcome::server("the training run has stopped")));
        }
        future
    }

    /// The outcome of the team's future `id`, waiting up to `wait` for it; `None` while it is
    /// pending.
    pub async fn retrieve(
        &self,
        team: &str,
        id: &str,
        wait: Duration,
    ) -> Result<Option<Outcome>, ApiError> {
        let mut rx = self
            .inner()
            .futures
            .get(id)
            .filter(|f| f.team == team)
            .map(|f| f.result.clone())
            .ok_or_else(|| not_found("future", id))?;
        let result = tokio::time::timeout(wait, rx.wait_for(Option::is_some)).await;
        Ok(match result {
            Ok(Ok(outcome)) => outcome.clone(),
            Ok(Err(_)) => Some(Outcome::server("the request's task ended without a result")),
            Err(_) => None,
        })
    }

    /// The base model's tokenizer as a Hugging Face directory (`tokenizer.json`,
    /// `tokenizer_config.json` with the chat template), written once per process under the
    /// system's temporary directory, named by the model and a hash of the files.
    pub async fn tokenizer_dir(&self, base: &ServedModel) -> Result<std::path::PathBuf, ApiError> {
        let mut dirs = self.tokenizers.lock().await;
        if let Some(dir) = dirs.get(&base.name) {
            return Ok(dir.clone());
        }
        let (tokenizer, template, name) = (
            base.base.tokenizer.clone(),
            base.base.chat_template.clone(),
            base.name.clone(),
        );
        let dir = tokio::task::spawn_blocking(move || {
            let files = tokenizer
                .to_hf_files(template.as_deref().map(|t| t.source()))
                .map_err(|e| ApiError::Internal(e.to_string()))?;
            write_tokenizer_dir(&name, &files)
                .map_err(|e| ApiError::Internal(format!("writing the tokenizer directory: {e}")))
        })
        .await
        .map_err(|e| ApiError::Internal(format!("exporting the tokenizer panicked: {e}")))??;
        dirs.insert(base.name.clone(), dir.clone());
        Ok(dir)
    }

    /// Whether the team has the future `id`.
    pub fn has_future(&self, team: &str, id: &str) -> bool {
        self.inner().futures.get(id).is_some_and(|f| f.team == team)
    }
}

/// Writes `files` to `<tmp>/temper-tokenizers/<name>-<hash>` (complete or not at all: written
/// beside it, then renamed) unless it is there.
fn write_tokenizer_dir(
    name: &str,
    files: &temper_text::HfTokenizerFiles,
) -> std::io::Result<std::path::PathBuf> {
    let mut hash = 0xcbf2_9ce4_8422_2325_u64;
    for byte in files
        .tokenizer_json
        .bytes()
        .chain(files.tokenizer_config_json.bytes())
    {
        hash = (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3);
    }
    let safe: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '.' {
                c
            } else {
                '_'
            }
        })
        .collect();
    let root = std::env::temp_dir().join("temper-tokenizers");
    let dir = root.join(format!("{safe}-{hash:016x}"));
    if dir.join("tokenizer_config.json").exists() {
        return Ok(dir);
    }
    let tmp = root.join(format!(".{safe}-{}", Uuid::new_v4().simple()));
    std::fs::create_dir_all(&tmp)?;
    std::fs::write(tmp.join("tokenizer.json"), &files.tokenizer_json)?;
    std::fs::write(
        tmp.join("tokenizer_config.json"),
        &files.tokenizer_config_json,
    )?;
    match std::fs::rename(&tmp, &dir) {
        Ok(()) => Ok(dir),
        // Another process wrote it first.
        Err(_) if dir.join("tokenizer_config.json").exists() => {
            let _ = std::fs::remove_dir_all(&tmp);
            Ok(dir)
        }
        Err(e) => Err(e),
    }
}
