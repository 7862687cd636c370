//! Text side of temper: the tokenizer, SentencePiece-style or byte-level BPE (from GGUF metadata
//! or a Hugging Face `tokenizer.json`), the streaming detokenizer and Jinja chat templates.

mod bytelevel;
mod decode;
mod export;
mod load;
mod merge;
mod partition;
mod reasoning;
mod template;
mod tojson;
mod tokenizer;
pub mod tool_calls;

use std::path::PathBuf;

pub use decode::{DecodeOptions, DecodeStream};
pub use export::HfTokenizerFiles;
pub use load::{gguf_chat_template, load_tokenizer};
pub use reasoning::{split_reasoning, ReasoningDelta, ReasoningParser, THINK_END, THINK_START};
pub use template::{
    ChatMessage, ChatTemplate, ContentPart, FunctionCall, FunctionDef, MessageContent,
    TemplateInput, ToolCall, ToolDef,
};
pub use tokenizer::{TokenKind, Tokenizer};

/// Everything that can go wrong in this crate.
#[derive(Debug, thiserror::Error)]
pub enum TextError {
    /// GGUF tokenizer metadata is missing or has the wrong type.
    #[error("GGUF tokenizer metadata: {0}")]
    Metadata(String),
    /// A `tokenizer.json` that cannot be used.
    #[error("tokenizer.json: {0}")]
    TokenizerJson(String),
    /// A tokenizer kind or feature this crate does not implement.
    #[error("unsupported tokenizer: {0}")]
    Unsupported(String),
    #[error("reading {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("invalid JSON: {0}")]
    Json(#[from] serde_json::Error),
    /// Template compile or render error, including `raise_exception(msg)` (the message as is).
    #[error("chat template: {0}")]
    Template(String),
}
