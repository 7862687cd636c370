//! Adapter files on disk, durably: a checkpoint row is committed only after its file's bytes and
//! its directory entry are on disk, so after a power cut no committed checkpoint points at a
//! missing or truncated file; and a save cut short leaves only a temporary file, removed at the
//! next start.

use std::io;
use std::path::{Path, PathBuf};

use temper_model::LoraAdapter;

/// What a save in progress writes before renaming it into place. Contains
/// [`TEMP_MARKER`] (so does the adapter's own temporary file inside it).
fn temp_path(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(".tmp");
    PathBuf::from(name)
}

/// In the name of every temporary file of an adapter save (`step-N.safetensors.tmp…`), and of
/// no committed file.
const TEMP_MARKER: &str = ".safetensors.tmp";

/// Writes `adapter` to `path` durably: to a temporary file, fsynced, renamed over `path`, then
/// the directory fsynced (the rename itself on disk). Directories it creates are fsynced in
/// their parents too.
pub fn save_adapter(adapter: &LoraAdapter, path: &Path) -> io::Result<()> {
    let dir = path
        .parent()
        .ok_or_else(|| io::Error::other(format!("{} has no directory", path.display())))?;
    create_dir_durably(dir)?;
    let tmp = temp_path(path);
    let saved = adapter
        .save(&tmp)
        .map_err(io::Error::other)
        .and_then(|()| sync_file(&tmp))
        .and_then(|()| std::fs::rename(&tmp, path));
    if let Err(e) = saved {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    sync_dir(dir)
}

/// Removes the temporary files of saves a crash cut short, under `data_dir/adapters/*/`.
/// Returns what it removed. Run at start-up, with the data directory's lock held (no save of
/// another process can be in flight).
pub fn remove_stray_temp_files(data_dir: &Path) -> Vec<PathBuf> {
    let mut removed = Vec::new();
    let Ok(models) = std::fs::read_dir(data_dir.join("adapters")) else {
        return removed;
    };
    for model in models.flatten() {
        let Ok(files) = std::fs::read_dir(model.path()) else {
            continue;
        };
        for file in files.flatten() {
            let is_temp = file.file_name().to_string_lossy().contains(TEMP_MARKER)
                && file.file_type().is_ok_and(|t| t.is_file());
            if !is_temp {
                continue;
            }
            let path = file.path();
            match std::fs::remove_file(&path) {
                Ok(()) => removed.push(path),
                Err(e) => tracing::warn!(path = %path.display(), error = %e,
                    "cannot remove a temporary adapter file"),
            }
        }
    }
    removed
}

fn create_dir_durably(dir: &Path) -> io::Result<()> {
    if dir.is_dir() {
        return Ok(());
    }
    // The missing ancestors, deepest last: each new entry is made durable in its parent.
    let mut missing = Vec::new();
    let mut d = Some(dir);
    while let Some(p) = d.filter(|p| !p.as_os_str().is_empty() && !p.is_dir()) {
        missing.push(p);
        d = p.parent();
    }
    std::fs::create_dir_all(dir)?;
    for p in missing.iter().rev() {
        if let Some(parent) = p.parent().filter(|p| !p.as_os_str().is_empty()) {
            sync_dir(parent)?;
        }
    }
    Ok(())
}

fn sync_file(path: &Path) -> io::Result<()> {
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)?
        .sync_all()
}

/// Makes a directory's entries (a rename, a new file) durable. Only Unix can fsync a directory.
fn sync_dir(dir: &Path) -> io::Result<()> {
    #[cfg(unix)]
    {
        std::fs::File::open(dir)?.sync_all()
    }
    #[cfg(not(unix))]
    {
        let _ = dir;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_temporary_adapter_files_are_stray() {
        let dir = tempfile::tempdir().unwrap();
        let model = dir.path().join("adapters").join("m");
        std::fs::create_dir_all(&model).unwrap();
        for name in [
            "step-1.safetensors",
            "step-2.safetensors.tmp",
            "step-2.safetensors.tmp.tmp123",
            "step-3.safetensors.tmp77",
        ] {
            std::fs::write(model.join(name), b"x").unwrap();
        }
        let mut removed: Vec<String> = remove_stray_temp_files(dir.path())
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        removed.sort();
        assert_eq!(
            removed,
            [
                "step-2.safetensors.tmp",
                "step-2.safetensors.tmp.tmp123",
                "step-3.safetensors.tmp77"
            ]
        );
        assert!(model.join("step-1.safetensors").exists());
        // No adapters directory at all: nothing to do.
        assert!(remove_stray_temp_files(&dir.path().join("nowhere")).is_empty());
    }
}
