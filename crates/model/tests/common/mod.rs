//! Helpers shared by the adapter and training tests.
#![allow(dead_code)] // each test binary uses its own subset

use std::path::Path;

use temper_model::{load_gguf, tiny, Decoder, LoraAdapter, LoraConfig, ModelError};

/// The tiny random model through the real GGUF writer and loader.
pub fn tiny_model(name: &str) -> Decoder {
    load_tiny(name, tiny::write_tiny_gguf)
}

/// The tiny model with F32 weights (exact matmuls).
pub fn tiny_model_f32(name: &str) -> Decoder {
    load_tiny(name, tiny::write_tiny_gguf_f32)
}

fn load_tiny(name: &str, write: fn(&Path, u64) -> Result<(), ModelError>) -> Decoder {
    let path =
        std::env::temp_dir().join(format!("temper-model-{}-{name}.gguf", std::process::id()));
    write(&path, 7).expect("write tiny model");
    let model = load_gguf(&path).expect("load tiny model").model;
    let _ = std::fs::remove_file(&path);
    model
}

/// An adapter whose B is nonzero (as after some training), so it changes the model: every
/// parameter gets a deterministic pseudo-random value of about `b_scale` (B) or its init (A).
pub fn trained_adapter(model: &Decoder, seed: u64, b_scale: f32) -> LoraAdapter {
    let mut adapter = LoraAdapter::new(model.config(), LoraConfig::default(), seed);
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    for (i, p) in adapter.params_mut().into_iter().enumerate() {
        // params alternate A, B.
        if i % 2 == 1 {
            for v in p.iter_mut() {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                *v = b_scale * ((state >> 40) as f32 / (1u64 << 23) as f32 - 1.0);
            }
        }
    }
    adapter
}

pub fn tokens(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| 10 + (i * 37 + salt * 101) % 400)
        .collect()
}
