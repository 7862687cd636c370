//! One writer per data directory: an exclusive OS lock (`flock` on Unix) on
//! [`LOCK_FILE`](crate::LOCK_FILE) in the data directory, held by `temper serve` for its whole
//! life. The OS releases it when the process ends, however it ends (`kill -9` included), so a
//! stale lock never needs cleaning up: the file's presence means nothing, only the lock does.

use std::fs::{File, OpenOptions, TryLockError};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use crate::{Error, Result, LOCK_FILE};

/// The held lock of a data directory; dropping it (or the process ending) releases it.
#[derive(Debug)]
pub struct DataDirLock {
    _file: File,
    path: PathBuf,
}

impl DataDirLock {
    /// Takes the lock of `data_dir` (created when missing), or fails at once with
    /// [`Error::Locked`] naming the directory and the holder's pid when another process holds
    /// it. Writes this process's pid into the lock file once held; a refused caller changes
    /// nothing (the file is opened without truncating, and only written under the lock).
    pub fn acquire(data_dir: &Path) -> Result<DataDirLock> {
        std::fs::create_dir_all(data_dir).map_err(|source| Error::DataDir {
            path: data_dir.to_owned(),
            source,
        })?;
        let path = data_dir.join(LOCK_FILE);
        let io = |source| Error::LockFile {
            path: path.clone(),
            source,
        };
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(io)?;
        match file.try_lock() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => {
                let mut text = String::new();
                // The holder writes its pid right after locking: a reader racing that write
                // sees an empty file, reported as an unknown pid.
                let _ = file.read_to_string(&mut text);
                return Err(Error::Locked {
                    data_dir: data_dir.to_owned(),
                    pid: text.trim().parse().ok(),
                });
            }
            Err(TryLockError::Error(e)) => return Err(io(e)),
        }
        file.set_len(0).map_err(io)?;
        file.seek(SeekFrom::Start(0)).map_err(io)?;
        writeln!(file, "{}", std::process::id()).map_err(io)?;
        file.flush().map_err(io)?;
        Ok(DataDirLock { _file: file, path })
    }

    /// The lock file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_holder_is_refused_with_the_first_ones_pid_until_it_lets_go() {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        let first = DataDirLock::acquire(&data).unwrap();
        assert_eq!(
            std::fs::read_to_string(first.path()).unwrap().trim(),
            std::process::id().to_string()
        );
        // flock locks belong to the open file, so a second open in this process is refused too.
        match DataDirLock::acquire(&data) {
            Err(Error::Locked { data_dir, pid }) => {
                assert_eq!(data_dir, data);
                assert_eq!(pid, Some(std::process::id()));
            }
            other => panic!("expected Locked, got {other:?}"),
        }
        let message = DataDirLock::acquire(&data).unwrap_err().to_string();
        assert!(message.contains(&data.display().to_string()), "{message}");
        assert!(
            message.contains(&format!("pid {}", std::process::id())),
            "{message}"
        );
        // The refused attempts left the holder's pid alone.
        assert_eq!(
            std::fs::read_to_string(first.path()).unwrap().trim(),
            std::process::id().to_string()
        );
        drop(first);
        let again = DataDirLock::acquire(&data).unwrap();
        drop(again);
    }
}
