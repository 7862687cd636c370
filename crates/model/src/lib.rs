//! One decoder for the Llama, Qwen 2/3 and Gemma 3 families on candle tensors (CPU): GGUF
//! loading configured from the file's metadata, a batched ragged forward pass over per-sequence
//! KV caches, training over the same layer, and a tiny random model writer for tests.

mod adapter_files;
mod attention;
mod cache;
mod config;
mod kernels;
mod layer;
mod linear;
mod loader;
mod lora;
mod model;
mod ops;
mod pages;
pub mod paths;
pub mod softmax;
mod team;
pub mod tiny;
mod train;

use std::collections::HashMap;

use candle_core::quantized::gguf_file;

pub use adapter_files::{
    merge_into_gguf, AdapterFileError, AdapterFormat, ExportedAdapter, MergedWeights, PeftFiles,
    MAX_IMPORT_RANK, PEFT_CONFIG_FILE, PEFT_WEIGHTS_FILE,
};
pub use cache::{KvArena, KvBlock, SeqCache, BLOCK_TOKENS};
pub use config::{Activation, Arch, ModelConfig, RopeLayout, Yarn};
pub use kernels::selected_isa;
pub use loader::load_gguf;
pub use lora::{LoraAdapter, LoraConfig, LoraGrads, LoraTarget};
pub use model::{Decoder, Logits, SeqInput};
pub use train::{PackedSequence, PointwiseLossGrad, TokenScores, TrainTape};

/// A model loaded from a GGUF file, with the file's metadata (the caller builds the tokenizer
/// from it).
pub struct LoadedModel {
    pub model: Decoder,
    pub metadata: HashMap<String, gguf_file::Value>,
}

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("i/o error on {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("tensor error: {0}")]
    Candle(#[from] candle_core::Error),
    #[error("unsupported architecture {0:?} (supported: {names})", names = Arch::names())]
    Architecture(String),
    #[error("metadata key {key}: {reason}")]
    Metadata { key: String, reason: String },
    #[error("tensor {0} is missing from the model file")]
    MissingTensor(String),
    #[error("tensor {name} is not part of the {arch} layout this decoder runs")]
    UnexpectedTensor { name: String, arch: &'static str },
    #[error("tensor {name} has shape {got:?}, expected {expected:?}")]
    TensorShape {
        name: String,
        expected: Vec<usize>,
        got: Vec<usize>,
    },
    #[error("batch entry {index} has no tokens")]
    EmptyInput { index: usize },
    #[error("token id {token} is out of range for a vocabulary of {vocab}")]
    TokenOutOfRange { token: u32, vocab: usize },
    #[error("sequence of {len} tokens exceeds the context length {max}")]
    ContextOverflow { len: usize, max: usize },
    #[error("the KV cache was made for a model of another shape")]
    CacheMismatch,
    #[error("batch entry {index}: no KV blocks are reserved for its new positions")]
    KvNotReserved { index: usize },
    #[error("adapter {path}: {reason}")]
    Adapter { path: String, reason: String },
    #[error("batch entry {index}: the adapter was made for a model of another shape")]
    AdapterMismatch { index: usize },
    #[error("packed sequence: {0}")]
    Packing(String),
}
