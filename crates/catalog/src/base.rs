//! Base models: the weights, tokenizer and chat template a trainer trains on and a server serves
//! (one copy of each, shared by both).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use temper_model::Decoder;
use temper_text::{ChatTemplate, Tokenizer};

/// One base model by its served name.
pub struct BaseModel {
    pub name: String,
    /// Read-only, shared by the serving engine and the trainer.
    pub model: Arc<Decoder>,
    pub tokenizer: Arc<Tokenizer>,
    /// `None` when neither the operator, the file nor the architecture gives one: such a model
    /// needs a request `chat_template` and cannot be trained on.
    pub chat_template: Option<Arc<ChatTemplate>>,
}

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("loading model `{name}` from {path}: {source}")]
    Model {
        name: String,
        path: PathBuf,
        // Boxed: the model error is large and load errors are rare.
        source: Box<temper_model::ModelError>,
    },
    #[error("tokenizer of model `{name}`: {source}")]
    Tokenizer {
        name: String,
        source: temper_text::TextError,
    },
    #[error("reading chat template {path}: {source}")]
    TemplateFile {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("chat template of model `{name}`: {source}")]
    Template {
        name: String,
        source: temper_text::TextError,
    },
}

impl BaseModel {
    /// Loads weights, tokenizer and template from a GGUF file. Template precedence:
    /// `chat_template` (a file), then the GGUF's `tokenizer.chat_template`, then the shipped
    /// Gemma 3 template for gemma3 files.
    pub fn load(
        name: &str,
        path: &Path,
        chat_template: Option<&Path>,
    ) -> Result<BaseModel, LoadError> {
        let loaded = temper_model::load_gguf(path).map_err(|source| LoadError::Model {
            name: name.to_owned(),
            path: path.to_owned(),
            source: Box::new(source),
        })?;
        let tokenizer = temper_text::load_tokenizer(&loaded.metadata, path).map_err(|source| {
            LoadError::Tokenizer {
                name: name.to_owned(),
                source,
            }
        })?;
        let source =
            match chat_template {
                Some(path) => Some(std::fs::read_to_string(path).map_err(|source| {
                    LoadError::TemplateFile {
                        path: path.to_owned(),
                        source,
                    }
                })?),
                None => temper_text::gguf_chat_template(&loaded.metadata).or_else(|| {
                    let arch = loaded
                        .metadata
                        .get("general.architecture")
                        .and_then(|v| v.to_string().ok());
                    (arch.map(String::as_str) == Some("gemma3"))
                        .then(|| ChatTemplate::GEMMA3.to_owned())
                }),
            };
        let chat_template = source
            .map(|src| {
                ChatTemplate::new(
                    &src,
                    tokenizer.bos_token().map(str::to_owned),
                    tokenizer.eos_token().map(str::to_owned),
                )
                .map(Arc::new)
                .map_err(|source| LoadError::Template {
                    name: name.to_owned(),
                    source,
                })
            })
            .transpose()?;
        Ok(BaseModel {
            name: name.to_owned(),
            model: Arc::new(loaded.model),
            tokenizer: Arc::new(tokenizer),
            chat_template,
        })
    }
}
