//! Corrupt GGUF files the fuzz test (`crates/http/tests/fuzz/gguf.rs`) found: each is an error,
//! not a panic or an allocation of the size a field claims.

use std::path::PathBuf;

use temper_model::{load_gguf, tiny, ModelError};

/// The tiny model with the u32 metadata value of `key` replaced by `value`.
fn tiny_with(name: &str, key: &str, value: u32) -> PathBuf {
    let path =
        std::env::temp_dir().join(format!("temper-model-{}-{name}.gguf", std::process::id()));
    tiny::write_tiny_gguf(&path, 7).expect("write tiny model");
    let mut bytes = std::fs::read(&path).unwrap();
    let key_at = bytes
        .windows(key.len())
        .position(|w| w == key.as_bytes())
        .unwrap_or_else(|| panic!("{key} is in the tiny model"));
    // The key's bytes, then its u32 value type, then the value.
    let value_at = key_at + key.len() + 4;
    bytes[value_at..value_at + 4].copy_from_slice(&value.to_le_bytes());
    std::fs::write(&path, bytes).unwrap();
    path
}

fn load_error(path: PathBuf) -> ModelError {
    let result = load_gguf(&path);
    let _ = std::fs::remove_file(&path);
    match result {
        Ok(_) => panic!("{} loaded", path.display()),
        Err(e) => e,
    }
}

#[test]
fn a_huge_block_count_is_a_missing_tensor() {
    let e = load_error(tiny_with("blocks", "gemma3.block_count", u32::MAX));
    assert!(
        matches!(&e, ModelError::MissingTensor(name) if name.starts_with("blk.4.")),
        "{e}"
    );
}
