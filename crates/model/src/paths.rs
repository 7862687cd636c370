//! Where models live by default, shared by the binary and every test that needs the real model.

use std::path::PathBuf;

/// The default model's file name inside `$TEMPER_HOME/models` (`scripts/fetch-model.sh` puts it
/// there).
pub const DEFAULT_MODEL_FILE: &str = "gemma-3-270m-q4_k_m.gguf";

/// `${TEMPER_HOME:-$HOME/.cache/temper}`.
pub fn temper_home() -> PathBuf {
    match std::env::var_os("TEMPER_HOME") {
        Some(h) if !h.is_empty() => PathBuf::from(h),
        _ => std::env::var_os("HOME")
            .map(PathBuf::from)
            .unwrap_or_default()
            .join(".cache")
            .join("temper"),
    }
}

/// The cached default model file (it may not exist).
pub fn default_model_path() -> PathBuf {
    temper_home().join("models").join(DEFAULT_MODEL_FILE)
}

/// For tests on the real default model: `$TEMPER_MODEL_PATH`, else [`default_model_path`].
/// `None` (the caller skips, with a notice) when the file is absent, unless
/// `TEMPER_REQUIRE_MODEL=1` (as `make test` and CI set), which makes absence a failure.
pub fn real_model_for_tests() -> Option<PathBuf> {
    let path = std::env::var_os("TEMPER_MODEL_PATH")
        .map(PathBuf::from)
        .unwrap_or_else(default_model_path);
    if path.is_file() {
        return Some(path);
    }
    assert!(
        std::env::var("TEMPER_REQUIRE_MODEL").as_deref() != Ok("1"),
        "TEMPER_REQUIRE_MODEL=1 but the default model is missing at {} (run scripts/fetch-model.sh)",
        path.display()
    );
    eprintln!(
        "skipping: the default model is not at {} (run scripts/fetch-model.sh)",
        path.display()
    );
    None
}
