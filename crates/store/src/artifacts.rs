//! The adapter files of checkpoints ("artifacts"), by model and step: under the data directory
//! (the default: `data_dir/adapters/<model id>/step-<N>.safetensors`), or in an S3 bucket
//! (`--artifacts s3://bucket/prefix`: `prefix/<model id>/step-<N>.safetensors`), where every
//! server sharing the store finds them.
//!
//! A put returns once the bytes are durable (a local file and its directory entry fsynced; an
//! S3 object acknowledged), so that a checkpoint row committed after it never points at a
//! missing or truncated adapter. A local put cut short leaves only a temporary file, removed at
//! the next start ([`Artifacts::remove_stray_temp_files`]); an S3 put is all or nothing.

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Arc;

use futures_util::{StreamExt, TryStreamExt};
use object_store::aws::{AmazonS3, AmazonS3Builder};
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload};
use uuid::Uuid;

/// Where the adapters live (`--artifacts`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum ArtifactsLocation {
    /// `data_dir/adapters`: one server, nothing to configure.
    #[default]
    DataDir,
    /// `s3://bucket/prefix` (the prefix may be empty).
    S3 { bucket: String, prefix: String },
}

impl FromStr for ArtifactsLocation {
    type Err = ArtifactError;

    /// `s3://BUCKET` or `s3://BUCKET/PREFIX` (a trailing `/` is dropped).
    fn from_str(s: &str) -> Result<Self, ArtifactError> {
        let invalid = |reason: String| ArtifactError::Location {
            location: s.to_owned(),
            reason,
        };
        let rest = s.strip_prefix("s3://").ok_or_else(|| {
            invalid("expected s3://BUCKET[/PREFIX] (leave it out for the data directory)".into())
        })?;
        let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        // S3's bucket naming rules (letters lower case; no `_`, which virtual-hosted URLs reject).
        let valid_bucket = (3..=63).contains(&bucket.len())
            && bucket
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'.' || b == b'-')
            && bucket.starts_with(|c: char| c.is_ascii_alphanumeric())
            && bucket.ends_with(|c: char| c.is_ascii_alphanumeric());
        if !valid_bucket {
            return Err(invalid(format!(
                "{bucket:?} is not a bucket name (3-63 of a-z, 0-9, `.` and `-`)"
            )));
        }
        let prefix = prefix.strip_suffix('/').unwrap_or(prefix);
        if !prefix.is_empty() {
            ObjectPath::parse(prefix).map_err(|e| invalid(format!("prefix {prefix:?}: {e}")))?;
        }
        Ok(ArtifactsLocation::S3 {
            bucket: bucket.to_owned(),
            prefix: prefix.to_owned(),
        })
    }
}

impl fmt::Display for ArtifactsLocation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ArtifactsLocation::DataDir => f.write_str("the data directory"),
            ArtifactsLocation::S3 { bucket, prefix } if prefix.is_empty() => {
                write!(f, "s3://{bucket}")
            }
            ArtifactsLocation::S3 { bucket, prefix } => write!(f, "s3://{bucket}/{prefix}"),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ArtifactError {
    #[error("--artifacts {location:?}: {reason}")]
    Location { location: String, reason: String },
    /// The S3 client cannot be made from the settings (the `AWS_*` environment variables).
    #[error("artifacts in {location}: {source}")]
    Config {
        location: String,
        source: object_store::Error,
    },
    /// The start-up check of an S3 store failed (bucket, endpoint, credentials).
    #[error("cannot reach the adapter store {location} (--artifacts): {source}")]
    Unreachable {
        location: String,
        source: object_store::Error,
    },
    /// No adapter is stored under this key.
    #[error("{0} does not exist")]
    NotFound(String),
    #[error("{key}: {source}")]
    Io { key: String, source: io::Error },
    #[error("{key}: {source}")]
    Object {
        key: String,
        source: object_store::Error,
    },
}

/// The adapters of every model's checkpoints. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Artifacts {
    backend: Backend,
}

#[derive(Clone, Debug)]
enum Backend {
    Local {
        /// `data_dir/adapters`.
        dir: PathBuf,
    },
    S3 {
        store: Arc<AmazonS3>,
        /// Keys are `prefix/<model id>/step-<N>.safetensors`.
        prefix: ObjectPath,
        /// `s3://bucket/prefix`, for messages.
        location: String,
    },
}

/// In the name of every temporary file of a local save (`step-N.safetensors.tmp…`), and of no
/// committed file.
const TEMP_MARKER: &str = ".safetensors.tmp";

fn file_name(step: i64) -> String {
    format!("step-{step}.safetensors")
}

impl Artifacts {
    /// Adapters under `data_dir/adapters`.
    pub fn local(data_dir: &Path) -> Artifacts {
        Artifacts {
            backend: Backend::Local {
                dir: data_dir.join("adapters"),
            },
        }
    }

    /// Adapters where `location` says; for S3 the client is configured from the `AWS_*`
    /// environment variables (credentials, region, endpoint; see
    /// [`AmazonS3Builder::from_env`]), and the bucket is listed once so that a wrong bucket,
    /// endpoint or credentials fail here, at start, rather than at the first checkpoint.
    pub async fn open(
        location: &ArtifactsLocation,
        data_dir: &Path,
    ) -> Result<Artifacts, ArtifactError> {
        let (bucket, prefix) = match location {
            ArtifactsLocation::DataDir => return Ok(Artifacts::local(data_dir)),
            ArtifactsLocation::S3 { bucket, prefix } => (bucket, prefix),
        };
        let config_error = |source| ArtifactError::Config {
            location: location.to_string(),
            source,
        };
        let store = AmazonS3Builder::from_env()
            .with_bucket_name(bucket)
            .build()
            .map_err(config_error)?;
        let artifacts = Artifacts {
            backend: Backend::S3 {
                store: Arc::new(store),
                prefix: ObjectPath::from(prefix.as_str()),
                location: location.to_string(),
            },
        };
        artifacts.check().await?;
        Ok(artifacts)
    }

    /// Lists the store's prefix (one page): reaching the store with these settings works.
    async fn check(&self) -> Result<(), ArtifactError> {
        match &self.backend {
            Backend::Local { .. } => Ok(()),
            Backend::S3 {
                store,
                prefix,
                location,
            } => store
                .list_with_delimiter(Some(prefix))
                .await
                .map(drop)
                .map_err(|source| ArtifactError::Unreachable {
                    location: location.clone(),
                    source,
                }),
        }
    }

    /// Where the adapter of a model's step is kept, for messages: a file path or an `s3://` URL.
    pub fn key(&self, model_id: Uuid, step: i64) -> String {
        match &self.backend {
            Backend::Local { dir } => local_path(dir, model_id, step).display().to_string(),
            Backend::S3 { location, .. } => format!("{location}/{model_id}/{}", file_name(step)),
        }
    }

    /// Stores the adapter of a model's step durably, replacing any there. Returns once the
    /// bytes are stored: a local file is written beside, fsynced, renamed into place and its
    /// directory fsynced; an S3 object is written whole by one request or not at all.
    pub async fn put(
        &self,
        model_id: Uuid,
        step: i64,
        bytes: Vec<u8>,
    ) -> Result<(), ArtifactError> {
        let key = self.key(model_id, step);
        match &self.backend {
            Backend::Local { dir } => {
                let path = local_path(dir, model_id, step);
                blocking(move || write_durably(&path, &bytes))
                    .await
                    .map_err(|source| ArtifactError::Io { key, source })
            }
            Backend::S3 { store, prefix, .. } => store
                .put(
                    &object_path(prefix, model_id, step),
                    PutPayload::from(bytes),
                )
                .await
                .map(drop)
                .map_err(|source| ArtifactError::Object { key, source }),
        }
    }

    /// The stored adapter of a model's step; [`ArtifactError::NotFound`] when there is none.
    pub async fn get(&self, model_id: Uuid, step: i64) -> Result<Vec<u8>, ArtifactError> {
        let key = self.key(model_id, step);
        match &self.backend {
            Backend::Local { dir } => {
                let path = local_path(dir, model_id, step);
                match blocking(move || std::fs::read(path)).await {
                    Ok(bytes) => Ok(bytes),
                    Err(e) if e.kind() == io::ErrorKind::NotFound => {
                        Err(ArtifactError::NotFound(key))
                    }
                    Err(source) => Err(ArtifactError::Io { key, source }),
                }
            }
            Backend::S3 { store, prefix, .. } => {
                let read = async {
                    store
                        .get(&object_path(prefix, model_id, step))
                        .await?
                        .bytes()
                        .await
                };
                match read.await {
                    Ok(bytes) => Ok(Vec::from(bytes)),
                    Err(object_store::Error::NotFound { .. }) => Err(ArtifactError::NotFound(key)),
                    Err(source) => Err(ArtifactError::Object { key, source }),
                }
            }
        }
    }

    /// Deletes the adapter of a model's step; one already gone is no error.
    pub async fn delete(&self, model_id: Uuid, step: i64) -> Result<(), ArtifactError> {
        let key = self.key(model_id, step);
        match &self.backend {
            Backend::Local { dir } => {
                let path = local_path(dir, model_id, step);
                match blocking(move || std::fs::remove_file(path)).await {
                    Err(e) if e.kind() != io::ErrorKind::NotFound => {
                        Err(ArtifactError::Io { key, source: e })
                    }
                    _ => Ok(()),
                }
            }
            Backend::S3 { store, prefix, .. } => {
                match store.delete(&object_path(prefix, model_id, step)).await {
                    Err(e) if !matches!(e, object_store::Error::NotFound { .. }) => {
                        Err(ArtifactError::Object { key, source: e })
                    }
                    _ => Ok(()),
                }
            }
        }
    }

    /// Deletes every adapter of a model (a deleted model's); none there is no error.
    pub async fn delete_model(&self, model_id: Uuid) -> Result<(), ArtifactError> {
        match &self.backend {
            Backend::Local { dir } => {
                let model_dir = dir.join(model_id.to_string());
                let key = model_dir.display().to_string();
                match blocking(move || std::fs::remove_dir_all(model_dir)).await {
                    Err(e) if e.kind() != io::ErrorKind::NotFound => {
                        Err(ArtifactError::Io { key, source: e })
                    }
                    _ => Ok(()),
                }
            }
            Backend::S3 {
                store,
                prefix,
                location,
            } => {
                let model = prefix.clone().join(model_id.to_string());
                let key = format!("{location}/{model_id}/");
                let listed = store
                    .list(Some(&model))
                    .map_ok(|meta| meta.location)
                    .boxed();
                store
                    .delete_stream(listed)
                    .try_for_each(|_| async { Ok(()) })
                    .await
                    .map_err(|source| ArtifactError::Object { key, source })
            }
        }
    }

    /// Removes the temporary files of local saves a crash cut short (an S3 store has none) and
    /// returns their paths. Run at start-up, with the data directory's lock held (no save of
    /// another process can be in flight).
    pub async fn remove_stray_temp_files(&self) -> Vec<PathBuf> {
        match &self.backend {
            Backend::Local { dir } => {
                let dir = dir.clone();
                blocking(move || Ok(remove_temp_files(&dir)))
                    .await
                    .unwrap_or_default()
            }
            Backend::S3 { .. } => Vec::new(),
        }
    }
}

fn local_path(dir: &Path, model_id: Uuid, step: i64) -> PathBuf {
    dir.join(model_id.to_string()).join(file_name(step))
}

fn object_path(prefix: &ObjectPath, model_id: Uuid, step: i64) -> ObjectPath {
    prefix
        .clone()
        .join(model_id.to_string())
        .join(file_name(step))
}

/// Runs file I/O on a blocking thread.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> io::Result<T> + Send + 'static,
) -> io::Result<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| io::Error::other(format!("file I/O panicked: {e}")))?
}

/// Writes `bytes` to `path` durably: to a temporary file, fsynced, renamed over `path`, then the
/// directory fsynced (the rename itself on disk). Directories it creates are fsynced in their
/// parents too.
fn write_durably(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let dir = path
        .parent()
        .ok_or_else(|| io::Error::other(format!("{} has no directory", path.display())))?;
    create_dir_durably(dir)?;
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    let written = write_synced(&tmp, bytes).and_then(|()| std::fs::rename(&tmp, path));
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    sync_dir(dir)
}

fn write_synced(path: &Path, bytes: &[u8]) -> io::Result<()> {
    use std::io::Write;
    let mut file = std::fs::File::create(path)?;
    file.write_all(bytes)?;
    file.sync_all()
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

/// The temporary files under `dir/*/`, removed.
fn remove_temp_files(dir: &Path) -> Vec<PathBuf> {
    let mut removed = Vec::new();
    let Ok(models) = std::fs::read_dir(dir) else {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn locations_parse() {
        let s3 = |bucket: &str, prefix: &str| ArtifactsLocation::S3 {
            bucket: bucket.into(),
            prefix: prefix.into(),
        };
        for (text, want, shown) in [
            ("s3://bucket", s3("bucket", ""), "s3://bucket"),
            ("s3://bucket/", s3("bucket", ""), "s3://bucket"),
            (
                "s3://my.bucket-1/a/b/",
                s3("my.bucket-1", "a/b"),
                "s3://my.bucket-1/a/b",
            ),
        ] {
            let parsed: ArtifactsLocation = text.parse().unwrap();
            assert_eq!(parsed, want, "{text}");
            assert_eq!(parsed.to_string(), shown);
        }
        for bad in [
            "/data/adapters",
            "file:///data",
            "S3://bucket",
            "s3://",
            "s3://ab",
            "s3://Bucket",
            "s3://my_bucket",
            "s3://-bucket",
            "s3://bucket/a//b",
            "s3://bucket/a/../b",
        ] {
            let err = bad.parse::<ArtifactsLocation>().unwrap_err();
            assert!(
                matches!(err, ArtifactError::Location { .. }),
                "{bad}: {err}"
            );
        }
    }

    #[test]
    fn only_temporary_adapter_files_are_stray() {
        let dir = tempfile::tempdir().unwrap();
        let model = dir.path().join("m");
        std::fs::create_dir_all(&model).unwrap();
        for name in [
            "step-1.safetensors",
            "step-2.safetensors.tmp",
            "step-2.safetensors.tmp.tmp123",
            "step-3.safetensors.tmp77",
        ] {
            std::fs::write(model.join(name), b"x").unwrap();
        }
        let mut removed: Vec<String> = remove_temp_files(dir.path())
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
        assert!(remove_temp_files(&dir.path().join("nowhere")).is_empty());
    }
}
