//! Corrupt GGUF files that once crashed the loader (see also the fuzz test,
//! `crates/http/tests/fuzz/gguf.rs`): each is an error, not a panic or an allocation of the
//! size a field claims.

use std::path::PathBuf;

use candle_core::quantized::{gguf_file, QTensor};
use candle_core::Device;
use temper_model::{load_gguf, tiny, ModelError};

fn tiny_path(name: &str) -> PathBuf {
    let path =
        std::env::temp_dir().join(format!("temper-model-{}-{name}.gguf", std::process::id()));
    tiny::write_tiny_gguf(&path, 7).expect("write tiny model");
    path
}

/// The tiny model with the u32 metadata value of `key` replaced by `value`.
fn tiny_with(name: &str, key: &str, value: u32) -> PathBuf {
    let path = tiny_path(name);
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

#[test]
fn an_alignment_of_zero_is_an_error() {
    // Rewritten through candle's writer with the key added (the tiny model has none).
    let path = tiny_path("alignment");
    let mut reader = std::io::BufReader::new(std::fs::File::open(&path).unwrap());
    let content = gguf_file::Content::read(&mut reader).unwrap();
    let tensors: Vec<(String, QTensor)> = content
        .tensor_infos
        .keys()
        .map(|name| {
            let t = content.tensor(&mut reader, name, &Device::Cpu).unwrap();
            (name.clone(), t)
        })
        .collect();
    let alignment = gguf_file::Value::U32(0);
    let metadata: Vec<(&str, &gguf_file::Value)> = content
        .metadata
        .iter()
        .map(|(k, v)| (k.as_str(), v))
        .chain([("general.alignment", &alignment)])
        .collect();
    let tensors: Vec<(&str, &QTensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let mut out = std::fs::File::create(&path).unwrap();
    gguf_file::write(&mut out, &metadata, &tensors).unwrap();
    drop(out);
    let e = load_error(path);
    assert!(e.to_string().contains("the GGUF header is corrupt"), "{e}");
}
