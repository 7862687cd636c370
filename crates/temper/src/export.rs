//! `temper export CHECKPOINT --format peft|gguf|merged-gguf --out PATH`: a trained checkpoint's
//! adapter for other tools, read from the server's store and adapter storage as the server reads
//! them (the catalog), converted by the model crate.

use std::path::{Path, PathBuf};

use clap::{Args, ValueEnum};
use temper_catalog::{BaseModel, Catalog, CatalogOptions};
use temper_model::{merge_into_gguf, AdapterFormat, ExportedAdapter, MergedWeights};
use temper_store::{ArtifactsLocation, StoreLocation};

use crate::config;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Format {
    /// A directory with `adapter_model.safetensors` and `adapter_config.json` (PEFT, vLLM,
    /// llama.cpp's convert_lora_to_gguf.py).
    Peft,
    /// A llama.cpp LoRA adapter file (`llama-server --lora`).
    Gguf,
    /// The base GGUF with the adapter merged in: a model file any llama.cpp-family server loads.
    MergedGguf,
}

#[derive(Debug, Args)]
pub struct ExportArgs {
    /// The checkpoint, by its inference name: `<entity>/<project>/<name>` (the latest step),
    /// `…:step<N>` or `…:latest`.
    checkpoint: String,
    #[arg(long, value_enum)]
    format: Format,
    /// Where to write: a directory (peft, created if missing) or a file (gguf, merged-gguf).
    #[arg(long, value_name = "PATH")]
    out: PathBuf,
    /// merged-gguf: store the merged projections as F16 instead of quantizing them again to
    /// the base's types.
    #[arg(long)]
    f16: bool,
    /// The base models as `temper serve` has them, NAME=PATH (repeatable) [default: the config
    /// file's `models`, else the default model].
    #[arg(
        long = "model",
        value_name = "NAME=PATH",
        env = "TEMPER_MODELS",
        value_delimiter = ','
    )]
    models: Vec<String>,
    /// The server's state directory [default: as `temper serve`: the config file's `data_dir`,
    /// else $TEMPER_HOME/data].
    #[arg(long, env = "TEMPER_DATA_DIR", value_name = "DIR")]
    data_dir: Option<PathBuf>,
    /// The server's PostgreSQL store, as `temper serve --store`.
    #[arg(long, env = "TEMPER_STORE", value_name = "URL", hide_env_values = true)]
    store: Option<String>,
    /// The server's adapter storage, as `temper serve --artifacts`.
    #[arg(long, env = "TEMPER_ARTIFACTS", value_name = "URL")]
    artifacts: Option<String>,
    /// `temper serve`'s TOML file, read for its `models`, `data_dir`, `store` and `artifacts`.
    #[arg(long, env = "TEMPER_CONFIG", value_name = "FILE")]
    config: Option<PathBuf>,
}

pub fn run(args: ExportArgs) -> Result<(), String> {
    if args.f16 && args.format != Format::MergedGguf {
        return Err("--f16 is for --format merged-gguf only".to_owned());
    }
    let file = match &args.config {
        Some(path) => config::read_file(path).map_err(|e| e.to_string())?,
        None => config::FileConfig::default(),
    };
    let home = config::temper_home();
    let models =
        config::resolve_models(args.models, file.models, &home).map_err(|e| e.to_string())?;
    let data_dir = args
        .data_dir
        .or(file.data_dir)
        .unwrap_or_else(|| home.join("data"));
    let store = match args.store.or(file.store) {
        Some(url) => StoreLocation::parse_url(&url).map_err(|e| format!("--store: {e}"))?,
        None => StoreLocation::Sqlite(data_dir.clone()),
    };
    let artifacts = match args.artifacts.or(file.artifacts) {
        Some(url) => url.parse().map_err(|e| format!("--artifacts: {e}"))?,
        None => ArtifactsLocation::DataDir,
    };
    let options = CatalogOptions {
        store,
        artifacts,
        ..CatalogOptions::new(data_dir)
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("starting the runtime: {e}"))?;
    // Like `temper keys`, no data-directory lock: this only reads the store and the adapters.
    runtime.block_on(async {
        let catalog = Catalog::open(Vec::new(), &options)
            .await
            .map_err(|e| e.to_string())?;
        let entity = args.checkpoint.split('/').next().unwrap_or_default();
        let found = catalog
            .resolve(entity, &args.checkpoint)
            .await
            .map_err(|e| e.to_string())?
            .ok_or_else(|| {
                format!(
                    "no checkpoint {:?} in the store (expected <entity>/<project>/<name>[:step<N>])",
                    args.checkpoint
                )
            })?;
        let step = found.checkpoint.step;
        if step == 0 {
            return Err(format!(
                "{} is step 0, the base weights: it has no adapter to export",
                args.checkpoint
            ));
        }
        let base_name = &found.model.base_model;
        let path = models
            .iter()
            .find(|(name, _)| name == base_name)
            .map(|(_, path)| path.clone())
            .ok_or_else(|| {
                format!("the base model `{base_name}` is not among --model (give it as {base_name}=PATH)")
            })?;
        let base = BaseModel::load(base_name, &path, None).map_err(|e| e.to_string())?;
        let adapter = catalog
            .adapter(&base, &found.checkpoint)
            .await
            .map_err(|e| e.to_string())?
            .ok_or_else(|| format!("step {step} has no adapter"))?;
        let config = base.model.config();
        match args.format {
            Format::Peft | Format::Gguf => {
                let format = if args.format == Format::Peft {
                    AdapterFormat::Peft
                } else {
                    AdapterFormat::Gguf
                };
                match adapter.export(config, base_name, format).map_err(|e| e.to_string())? {
                    ExportedAdapter::Peft(files) => {
                        std::fs::create_dir_all(&args.out).map_err(|e| io(&args.out, e))?;
                        for (name, bytes) in [
                            (temper_model::PEFT_WEIGHTS_FILE, &files.weights),
                            (temper_model::PEFT_CONFIG_FILE, &files.config),
                        ] {
                            let file = args.out.join(name);
                            std::fs::write(&file, bytes).map_err(|e| io(&file, e))?;
                        }
                    }
                    ExportedAdapter::Gguf(bytes) => {
                        std::fs::write(&args.out, bytes).map_err(|e| io(&args.out, e))?
                    }
                }
            }
            Format::MergedGguf => {
                let weights = if args.f16 {
                    MergedWeights::F16
                } else {
                    MergedWeights::AsBase
                };
                merge_into_gguf(&path, &adapter, &args.out, weights).map_err(|e| e.to_string())?;
            }
        }
        eprintln!(
            "exported {} (step {step}) as {} to {}",
            args.checkpoint,
            args.format
                .to_possible_value()
                .map_or_else(String::new, |v| v.get_name().to_owned()),
            args.out.display()
        );
        Ok(())
    })
}

fn io(path: &Path, e: std::io::Error) -> String {
    format!("writing {}: {e}", path.display())
}
