//! temper's durable state: teams and API keys, trainable models, checkpoints, training jobs and
//! their events, token usage and quotas, in one SQLite file under the data directory (sqlx, so PostgreSQL can follow).
//!
//! Every query lives in this crate; callers get typed values. Team-scoped methods treat another
//! team's rows exactly like missing ones ([`Error::NotFound`]), so existence never leaks.
//!
//! The checkpoints' adapter files are kept by [`Artifacts`]: under the data directory, or in an
//! S3 bucket that every server sharing the store reads.

mod artifacts;
mod idempotency;
mod jobs;
mod keys;
mod lock;
mod models;
mod usage;

use std::borrow::Cow;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use sqlx::migrate::{Migration, MigrationType, Migrator};
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous,
};
use sqlx::SqlSafeStr;

pub use artifacts::{ArtifactError, Artifacts, ArtifactsLocation};
pub use idempotency::{Claim, IdempotencyKey, MAX_IDEMPOTENCY_KEY_LEN};
pub use jobs::{event, Event, Job, JobKind, JobStatus, Recovery, TrainingTotals};
pub use keys::{KeyInfo, Team, SECRET_PREFIX};
pub use lock::DataDirLock;
pub use models::{Checkpoint, DeletedCheckpoints, DeletedModel, Model, NewModel};
pub use usage::{
    usage_bucket, utc_date, utc_month, Quota, TokenCounts, UsageKey, UsageRow, USAGE_BUCKET_SECONDS,
};

/// The database file inside the data directory.
pub const DB_FILE: &str = "temper.db";
/// The lock file inside the data directory (see [`DataDirLock`]); it holds the pid of the
/// process that holds the lock.
pub const LOCK_FILE: &str = "temper.lock";
/// Largest page a list call returns.
pub const MAX_LIMIT: u32 = 100;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("creating data directory {path}: {source}")]
    DataDir {
        path: PathBuf,
        source: std::io::Error,
    },
    /// Another process holds the data directory's lock ([`DataDirLock`]).
    #[error(
        "the data directory {} is in use by another temper process ({}): only one server may \
         use a data directory at a time; stop that process or use another data directory",
        data_dir.display(),
        pid.map_or_else(|| "pid unknown".to_owned(), |p| format!("pid {p}"))
    )]
    Locked { data_dir: PathBuf, pid: Option<u32> },
    #[error("locking {path}: {source}")]
    LockFile {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("database: {0}")]
    Db(#[from] sqlx::Error),
    #[error("migrating the database: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    /// Missing, or belonging to another team.
    #[error("{0} not found")]
    NotFound(&'static str),
    #[error("a model named {team}/{project}/{name} already exists")]
    ModelExists {
        team: String,
        project: String,
        name: String,
    },
    #[error("model {model_id} already has a checkpoint at step {step}")]
    CheckpointExists { model_id: uuid::Uuid, step: i64 },
    #[error("invalid {field}: {reason}")]
    Invalid { field: &'static str, reason: String },
    /// A state transition asked of a job in another state (e.g. finishing a cancelled job).
    #[error("training job {id} is {status}")]
    JobState { id: uuid::Uuid, status: JobStatus },
    /// The team already has the most queued jobs [`Store::with_max_queued_jobs_per_team`]
    /// allows.
    #[error("team {team} already has {limit} queued training jobs")]
    TeamQueueFull { team: String, limit: u32 },
    #[error("reading random bytes from the OS: {0}")]
    Random(String),
    #[error("stored data is corrupt: {0}")]
    Corrupt(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// One page of a list, and whether more follow it.
#[derive(Debug, Clone, PartialEq)]
pub struct Page<T> {
    pub items: Vec<T>,
    pub has_more: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Order {
    #[default]
    Asc,
    Desc,
}

impl FromStr for Order {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "asc" => Ok(Order::Asc),
            "desc" => Ok(Order::Desc),
            _ => Err(invalid("order", format!("expected asc or desc, got {s:?}"))),
        }
    }
}

/// The store: a pool over one SQLite file. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Store {
    pool: SqlitePool,
    /// Most queued jobs a team may have; enqueueing past it is [`Error::TeamQueueFull`].
    max_queued_jobs_per_team: Option<u32>,
}

fn migrator() -> Migrator {
    // Embedded with include_str! rather than `sqlx::migrate!`: that macro needs sqlx's
    // proc-macro crate, which builds SQLite a second time for the host.
    let migration = |version, description, sql: &'static str| {
        Migration::new(
            version,
            Cow::Borrowed(description),
            MigrationType::Simple,
            sql.into_sql_str(),
            false,
        )
    };
    Migrator::with_migrations(vec![
        migration(1, "initial", include_str!("../migrations/0001_initial.sql")),
        migration(
            2,
            "job_kind_idempotency",
            include_str!("../migrations/0002_job_kind_idempotency.sql"),
        ),
        migration(
            3,
            "job_attempts",
            include_str!("../migrations/0003_job_attempts.sql"),
        ),
        migration(4, "usage", include_str!("../migrations/0004_usage.sql")),
    ])
}

impl Store {
    /// Opens (creating when missing) `data_dir/temper.db` and brings its schema up to date.
    pub async fn open(data_dir: &Path) -> Result<Store> {
        std::fs::create_dir_all(data_dir).map_err(|source| Error::DataDir {
            path: data_dir.to_owned(),
            source,
        })?;
        let options = SqliteConnectOptions::new()
            .filename(data_dir.join(DB_FILE))
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            // FULL: a committed transaction (an accepted job) survives a power cut, not only a
            // killed process.
            .synchronous(SqliteSynchronous::Full)
            .foreign_keys(true)
            .busy_timeout(Duration::from_secs(10));
        let pool = SqlitePoolOptions::new()
            .max_connections(4)
            .connect_with(options)
            .await?;
        migrator().run(&pool).await?;
        Ok(Store {
            pool,
            max_queued_jobs_per_team: None,
        })
    }

    /// Bounds each team's queued jobs (checked in the statement that enqueues, so concurrent
    /// posts cannot pass it together).
    pub fn with_max_queued_jobs_per_team(mut self, limit: u32) -> Store {
        self.max_queued_jobs_per_team = Some(limit);
        self
    }

    /// Waits for the pool's connections to close (checkpointing the WAL). Dropping a store
    /// without it loses nothing that was committed.
    pub async fn close(self) {
        self.pool.close().await;
    }

    /// A write transaction that takes the write lock at once, so two read-then-write
    /// transactions cannot both read and then fail to upgrade (SQLITE_BUSY).
    async fn write_tx(&self) -> Result<sqlx::Transaction<'static, sqlx::Sqlite>> {
        Ok(self.pool.begin_with("BEGIN IMMEDIATE").await?)
    }
}

pub(crate) fn invalid(field: &'static str, reason: impl Into<String>) -> Error {
    Error::Invalid {
        field,
        reason: reason.into(),
    }
}

pub(crate) fn now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}

pub(crate) fn random_bytes<const N: usize>() -> Result<[u8; N]> {
    let mut buf = [0u8; N];
    getrandom::fill(&mut buf).map_err(|e| Error::Random(e.to_string()))?;
    Ok(buf)
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(DIGITS[(b >> 4) as usize] as char);
        s.push(DIGITS[(b & 15) as usize] as char);
    }
    s
}

pub(crate) fn parse_uuid(s: &str) -> Result<uuid::Uuid> {
    uuid::Uuid::parse_str(s).map_err(|e| Error::Corrupt(format!("stored id {s:?}: {e}")))
}

pub(crate) fn parse_json(s: &str) -> Result<serde_json::Value> {
    serde_json::from_str(s).map_err(|e| Error::Corrupt(format!("stored JSON: {e}")))
}

pub(crate) fn check_limit(limit: u32) -> Result<i64> {
    if (1..=MAX_LIMIT).contains(&limit) {
        Ok(i64::from(limit))
    } else {
        Err(invalid(
            "limit",
            format!("must be 1 to {MAX_LIMIT}, got {limit}"),
        ))
    }
}

/// Names that end up in inference names (`<team>/<project>/<name>:step<N>`): 1 to `max` of
/// `A-Z a-z 0-9 - _ .`, so that name can be split back unambiguously.
pub(crate) fn check_name(field: &'static str, value: &str, max: usize) -> Result<()> {
    let ok = !value.is_empty()
        && value.len() <= max
        && value
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
    if ok {
        Ok(())
    } else {
        Err(invalid(
            field,
            format!("{value:?} must be 1 to {max} of A-Z a-z 0-9 - _ ."),
        ))
    }
}

/// Creates the team row on first use.
pub(crate) async fn ensure_team(
    conn: &mut sqlx::SqliteConnection,
    team: &str,
    at: i64,
) -> Result<()> {
    check_name("team", team, 64)?;
    sqlx::query("INSERT OR IGNORE INTO teams (name, created_at) VALUES (?, ?)")
        .bind(team)
        .bind(at)
        .execute(conn)
        .await?;
    Ok(())
}

/// Keeps the first `limit` rows and says whether there were more (queries fetch `limit + 1`).
pub(crate) fn page<T>(mut items: Vec<T>, limit: i64) -> Page<T> {
    let has_more = items.len() as i64 > limit;
    items.truncate(limit as usize);
    Page { items, has_more }
}

#[cfg(test)]
mod tests {
    /// Migrations are listed by hand in `migrator()`: a new file there must be listed too.
    #[test]
    fn every_migration_file_is_embedded() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("migrations");
        let mut files: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".sql"))
            .collect();
        files.sort();
        let embedded: Vec<String> = super::migrator()
            .iter()
            .map(|m| format!("{:04}_{}.sql", m.version, m.description))
            .collect();
        assert_eq!(files, embedded);
    }
}
