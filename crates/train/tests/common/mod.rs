//! The tiny random Gemma-3-shaped model (written and loaded through the real code) with the
//! shipped Gemma 3 template, shared by the trainer's test binaries.

#![allow(dead_code)] // each test binary uses a different part of this module

use temper_model::Decoder;
use temper_text::{ChatMessage, ChatTemplate, TemplateInput, Tokenizer};

pub struct Tiny {
    pub model: Decoder,
    pub tokenizer: Tokenizer,
    pub template: ChatTemplate,
}

pub fn tiny(seed: u64) -> Tiny {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("tiny.gguf");
    temper_model::tiny::write_tiny_gguf(&path, seed).expect("write tiny");
    let loaded = temper_model::load_gguf(&path).expect("load");
    let tokenizer = temper_text::load_tokenizer(&loaded.metadata, &path).expect("tokenizer");
    let template = ChatTemplate::new(
        ChatTemplate::GEMMA3,
        tokenizer.bos_token().map(str::to_owned),
        tokenizer.eos_token().map(str::to_owned),
    )
    .expect("template");
    Tiny {
        model: loaded.model,
        tokenizer,
        template,
    }
}

/// The served prompt's tokens for `messages` (generation prompt included).
pub fn served_prompt(t: &Tiny, messages: &[ChatMessage]) -> Vec<u32> {
    let text = t
        .template
        .render(&TemplateInput {
            messages,
            tools: None,
            documents: None,
            add_generation_prompt: true,
            continue_final_message: false,
            reasoning_effort: None,
            kwargs: &serde_json::Map::new(),
        })
        .expect("render");
    t.tokenizer.encode(&text, true)
}
