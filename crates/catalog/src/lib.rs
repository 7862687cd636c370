//! What a request's `model` can name, below HTTP and beside training: the base models this
//! process loaded (weights, tokenizer, chat template), and with a store the trained checkpoints
//! by their inference names (`<team>/<project>/<name>[:step<N>|:latest]`) and the adapters they
//! are served with (read from the artifact storage once, then kept in an LRU under a byte
//! budget). Serving reads it; the training service writes the store and artifacts it reads.

mod base;
mod lru;
pub mod names;

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use temper_model::LoraAdapter;
use temper_store::{Artifacts, ArtifactsLocation, Checkpoint, Model, Store, StoreLocation};
use uuid::Uuid;

pub use base::{BaseModel, LoadError};
use lru::ByteLru;
use names::StepSelector;

/// Where the store and the checkpoints' adapters live, and how much memory loaded adapters may
/// use.
#[derive(Debug, Clone)]
pub struct CatalogOptions {
    /// By default the store and the adapter files live here.
    pub data_dir: PathBuf,
    /// The store: the SQLite file in `data_dir` (the default), or a PostgreSQL database that
    /// several servers share.
    pub store: StoreLocation,
    /// Where checkpoints' adapters are stored (`--artifacts`).
    pub artifacts: ArtifactsLocation,
    /// Memory the cache of loaded adapters may use before it evicts the least recently used.
    pub adapter_cache_bytes: usize,
}

impl CatalogOptions {
    pub fn new(data_dir: impl Into<PathBuf>) -> Self {
        let data_dir = data_dir.into();
        CatalogOptions {
            store: StoreLocation::Sqlite(data_dir.clone()),
            data_dir,
            artifacts: ArtifactsLocation::DataDir,
            adapter_cache_bytes: 256 << 20,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    #[error("opening the store {location}: {source}")]
    Store {
        location: StoreLocation,
        source: temper_store::Error,
    },
    #[error("{0}")]
    Artifacts(#[from] temper_store::ArtifactError),
}

/// What looking up a trained checkpoint or its adapter can fail with.
#[derive(Debug, thiserror::Error)]
pub enum CatalogError {
    #[error(transparent)]
    Store(#[from] temper_store::Error),
    #[error("The adapter of checkpoint step {step} cannot be loaded: {message}")]
    Adapter { step: i64, message: String },
}

/// A trained model's checkpoint a request names (see [`Catalog::resolve`]).
pub struct TrainedCheckpoint {
    pub model: Model,
    pub checkpoint: Checkpoint,
}

/// The store and the adapters' storage, opened.
#[derive(Clone)]
pub struct Storage {
    pub store: Store,
    pub artifacts: Artifacts,
}

/// Base models, and with a store the trained checkpoints on them.
pub struct Catalog {
    base_models: Vec<Arc<BaseModel>>,
    storage: Option<Storage>,
    /// Loaded adapters by checkpoint id (a deleted and re-made step gets a new id).
    adapters: Mutex<ByteLru<Uuid, Arc<LoraAdapter>>>,
}

impl Catalog {
    /// Base models only: no trained names resolve.
    pub fn base_only(base_models: Vec<Arc<BaseModel>>) -> Catalog {
        Catalog {
            base_models,
            storage: None,
            adapters: Mutex::new(ByteLru::new(0)),
        }
    }

    /// Opens the store (`options.store`) and the adapters' storage (an S3 bucket is reached
    /// once, so that wrong settings fail here).
    pub async fn open(
        base_models: Vec<Arc<BaseModel>>,
        options: &CatalogOptions,
    ) -> Result<Catalog, OpenError> {
        let store = Store::connect(&options.store)
            .await
            .map_err(|source| OpenError::Store {
                location: options.store.clone(),
                source,
            })?;
        let artifacts = Artifacts::open(&options.artifacts, &options.data_dir).await?;
        Ok(Catalog {
            base_models,
            storage: Some(Storage { store, artifacts }),
            adapters: Mutex::new(ByteLru::new(options.adapter_cache_bytes)),
        })
    }

    pub fn base_models(&self) -> &[Arc<BaseModel>] {
        &self.base_models
    }

    pub fn base_model(&self, name: &str) -> Option<&Arc<BaseModel>> {
        self.base_models.iter().find(|m| m.name == name)
    }

    /// The store and artifacts; `None` for base models only.
    pub fn storage(&self) -> Option<&Storage> {
        self.storage.as_ref()
    }

    pub fn store(&self) -> Option<&Store> {
        self.storage.as_ref().map(|s| &s.store)
    }

    /// The checkpoint a request's `model` names when it is a trained name of `team`
    /// (`<team>/<project>/<name>[:step<N>|:latest]`); `None` when it is not such a name, names
    /// no model or step of the team, or there is no store.
    pub async fn resolve(
        &self,
        team: &str,
        requested: &str,
    ) -> Result<Option<TrainedCheckpoint>, CatalogError> {
        let Some(store) = self.store() else {
            return Ok(None);
        };
        let Some(parsed) = names::parse(requested).filter(|n| n.entity == team) else {
            return Ok(None);
        };
        let found = async {
            let model = store
                .get_model_by_name(team, parsed.project, parsed.name)
                .await?;
            let checkpoint = match parsed.step {
                StepSelector::Latest => store.latest_checkpoint(team, model.id).await?,
                StepSelector::Step(step) => Some(store.get_checkpoint(team, model.id, step).await?),
            };
            Ok(checkpoint.map(|checkpoint| TrainedCheckpoint { model, checkpoint }))
        };
        match found.await {
            Err(temper_store::Error::NotFound(_)) => Ok(None),
            other => Ok(other?),
        }
    }

    /// The adapter a checkpoint is served with: none for step 0 (the base weights), else the
    /// one stored for it (on this server's disk or in the shared bucket), loaded once into the
    /// LRU cache.
    pub async fn adapter(
        &self,
        base: &BaseModel,
        checkpoint: &Checkpoint,
    ) -> Result<Option<Arc<LoraAdapter>>, CatalogError> {
        let Some(storage) = self.storage.as_ref().filter(|_| checkpoint.step != 0) else {
            return Ok(None);
        };
        if let Some(adapter) = self.lock_adapters().get(&checkpoint.id) {
            return Ok(Some(adapter));
        }
        let step = checkpoint.step;
        let cannot_load = |message: String| CatalogError::Adapter { step, message };
        let model_id = checkpoint.model_id;
        let bytes = storage
            .artifacts
            .get(model_id, step)
            .await
            .map_err(|e| cannot_load(e.to_string()))?;
        let origin = storage.artifacts.key(model_id, step);
        let weights = base.model.clone();
        let loaded = tokio::task::spawn_blocking(move || {
            LoraAdapter::from_bytes(&bytes, &origin, weights.config())
        })
        .await
        .map_err(|e| cannot_load(format!("loading it panicked: {e}")))?
        .map_err(|e| cannot_load(e.to_string()))?;
        let adapter = Arc::new(loaded);
        let bytes = adapter.memory_bytes();
        self.lock_adapters()
            .insert(checkpoint.id, adapter.clone(), bytes);
        Ok(Some(adapter))
    }

    fn lock_adapters(&self) -> std::sync::MutexGuard<'_, ByteLru<Uuid, Arc<LoraAdapter>>> {
        // Each cache operation leaves it consistent, so a panic elsewhere cannot corrupt it.
        self.adapters.lock().unwrap_or_else(|e| e.into_inner())
    }
}
