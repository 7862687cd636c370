//! temper's durable state: teams and API keys, trainable models, checkpoints, training jobs and
//! their events, token usage and quotas. By default in one SQLite file under the data directory
//! (one server); or in a PostgreSQL database that any number of servers share
//! (`--store postgres://…`).
//!
//! Every query lives in this crate; callers get typed values. Team-scoped methods treat another
//! team's rows exactly like missing ones ([`Error::NotFound`]), so existence never leaks.
//!
//! One set of queries serves both databases (sqlx's `Any` driver, `$N` parameters, SQL both
//! accept); where they must differ (row locks, JSON) a query is a `Dialects` pair. The same
//! numbered migrations run on both, with a PostgreSQL file only where its SQL must differ.
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
use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use sqlx::any::{AnyConnectOptions, AnyPoolOptions};
use sqlx::migrate::{Migration, MigrationType, Migrator};
use sqlx::AnyPool;
use sqlx::{Executor, SqlSafeStr};

pub use artifacts::{ArtifactError, Artifacts, ArtifactsLocation};
pub use idempotency::{Claim, IdempotencyKey, MAX_IDEMPOTENCY_KEY_LEN};
pub use jobs::{event, Event, Job, JobKind, JobStatus, Recovery, TrainingTotals};
pub use keys::{KeyInfo, Team, SECRET_PREFIX};
pub use lock::DataDirLock;
pub use models::{
    Checkpoint, CheckpointAnswer, CheckpointImport, DeletedCheckpoints, DeletedModel, Model,
    NewModel,
};
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
    /// A `--store` value that is not a PostgreSQL URL (its password hidden).
    #[error("invalid store {0:?}: expected a postgres:// or postgresql:// URL (without one the store is the SQLite file in the data directory)")]
    Location(String),
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
    /// A checkpoint cannot be imported while the model has a queued or running job (the job
    /// would make the same step).
    #[error(
        "model {model_id} has a queued or running training job; import once it has ended (or \
         cancel it)"
    )]
    ModelBusy { model_id: uuid::Uuid },
    #[error("invalid {field}: {reason}")]
    Invalid { field: &'static str, reason: String },
    /// A state transition asked of a job in another state (e.g. finishing a cancelled job).
    #[error("training job {id} is {status}")]
    JobState { id: uuid::Uuid, status: JobStatus },
    /// A worker's write to a job it no longer holds: its lease expired and the job went back to
    /// the queue (and may run under another worker now). The worker stops, recording nothing.
    #[error(
        "training job {id} is no longer held by worker {worker}: its lease expired and the job \
         was re-queued"
    )]
    LeaseLost { id: uuid::Uuid, worker: String },
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

/// Where a store keeps its rows.
#[derive(Clone, PartialEq, Eq)]
pub enum StoreLocation {
    /// [`DB_FILE`] in this data directory: the default, for one server (see [`DataDirLock`]).
    Sqlite(PathBuf),
    /// A PostgreSQL database (a `postgres://` URL) that any number of servers share.
    Postgres(String),
}

impl StoreLocation {
    /// `--store`'s value: a `postgres://` or `postgresql://` URL.
    pub fn parse_url(url: &str) -> Result<StoreLocation> {
        if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            Ok(StoreLocation::Postgres(url.to_owned()))
        } else {
            Err(Error::Location(redact_password(url).into_owned()))
        }
    }

    pub fn backend(&self) -> Backend {
        match self {
            StoreLocation::Sqlite(_) => Backend::Sqlite,
            StoreLocation::Postgres(_) => Backend::Postgres,
        }
    }
}

/// Shows a URL's password as `***`, so the location can go into logs and errors.
impl fmt::Display for StoreLocation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StoreLocation::Sqlite(dir) => write!(f, "{}", dir.join(DB_FILE).display()),
            StoreLocation::Postgres(url) => f.write_str(&redact_password(url)),
        }
    }
}

impl fmt::Debug for StoreLocation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StoreLocation::Sqlite(dir) => f.debug_tuple("Sqlite").field(dir).finish(),
            StoreLocation::Postgres(url) => f
                .debug_tuple("Postgres")
                .field(&redact_password(url))
                .finish(),
        }
    }
}

fn redact_password(url: &str) -> Cow<'_, str> {
    let Some((scheme, rest)) = url.split_once("://") else {
        return Cow::Borrowed(url);
    };
    let authority_end = rest.find(['/', '?']).unwrap_or(rest.len());
    let Some(at) = rest[..authority_end].rfind('@') else {
        return Cow::Borrowed(url);
    };
    match rest[..at].split_once(':') {
        Some((user, _password)) => Cow::Owned(format!("{scheme}://{user}:***{}", &rest[at..])),
        None => Cow::Borrowed(url),
    }
}

/// The database a store runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// One file, one server: its running jobs are all this server's.
    Sqlite,
    /// Shared by servers: a running job belongs to whichever worker holds its lease.
    Postgres,
}

/// A statement whose SQL differs between the backends, each a `&'static str` (sqlx refuses
/// dynamically built SQL); [`Store::sql`] picks one. Mostly made by [`locking!`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct Dialects {
    pub sqlite: &'static str,
    pub postgres: &'static str,
}

/// A statement that takes row locks on PostgreSQL (`FOR UPDATE`, `FOR UPDATE SKIP LOCKED`, …),
/// where concurrent transactions run side by side; on SQLite the clause is left out, since
/// every write transaction there holds the whole database ([`Store::write_tx`]).
/// `locking!(before, clause)` or `locking!(before, clause, after)` (the clause in a subquery).
macro_rules! locking {
    ($before:expr, $clause:literal $(, $after:expr)?) => {
        $crate::Dialects {
            sqlite: concat!($before $(, $after)?),
            postgres: concat!($before, " ", $clause $(, $after)?),
        }
    };
}
pub(crate) use locking;

/// The store: a pool over its database. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Store {
    pool: AnyPool,
    backend: Backend,
    /// Most queued jobs a team may have; enqueueing past it is [`Error::TeamQueueFull`].
    max_queued_jobs_per_team: Option<u32>,
}

/// One numbered migration: `migrations/<name>.sql`, in SQL both backends accept, and where
/// PostgreSQL needs other SQL, `migrations/postgres/<name>.sql`.
struct MigrationFile {
    name: &'static str,
    sql: &'static str,
    postgres: Option<&'static str>,
}

/// `migration!("0004_usage")`, or `migration!("0001_initial", postgres)` for one with a
/// PostgreSQL file of its own. Embedded with include_str! rather than `sqlx::migrate!`: that
/// macro needs sqlx's proc-macro crate, which builds SQLite a second time for the host.
macro_rules! migration {
    ($name:literal) => {
        MigrationFile {
            name: $name,
            sql: include_str!(concat!("../migrations/", $name, ".sql")),
            postgres: None,
        }
    };
    ($name:literal, postgres) => {
        MigrationFile {
            name: $name,
            sql: include_str!(concat!("../migrations/", $name, ".sql")),
            postgres: Some(include_str!(concat!(
                "../migrations/postgres/",
                $name,
                ".sql"
            ))),
        }
    };
}

/// Every migration, in order. A new one: its file(s) and a line here. SQLite runs exactly the
/// `.sql` files it always ran (an applied migration's checksum must never change).
const MIGRATIONS: &[MigrationFile] = &[
    migration!("0001_initial", postgres),
    migration!("0002_job_kind_idempotency", postgres),
    migration!("0003_job_attempts"),
    migration!("0004_usage"),
    migration!("0005_job_leases"),
];

fn migrator(backend: Backend) -> Migrator {
    let migrations = MIGRATIONS
        .iter()
        .map(|m| {
            let (version, description) = m
                .name
                .split_once('_')
                .and_then(|(v, d)| Some((v.parse().ok()?, d)))
                .expect("migration names are NNNN_description");
            let sql = match (backend, m.postgres) {
                (Backend::Postgres, Some(postgres)) => postgres,
                _ => m.sql,
            };
            Migration::new(
                version,
                Cow::Borrowed(description),
                MigrationType::Simple,
                sql.into_sql_str(),
                false,
            )
        })
        .collect();
    Migrator::with_migrations(migrations)
}

/// Connections to a PostgreSQL store per server (its API and its worker).
const POSTGRES_CONNECTIONS: u32 = 8;

impl Store {
    /// Opens (creating when missing) `data_dir/temper.db` and brings its schema up to date.
    pub async fn open(data_dir: &Path) -> Result<Store> {
        Store::connect(&StoreLocation::Sqlite(data_dir.to_owned())).await
    }

    /// Opens the store at `location` and brings its schema up to date (on PostgreSQL under an
    /// advisory lock, so servers starting together migrate once).
    pub async fn connect(location: &StoreLocation) -> Result<Store> {
        sqlx::any::install_default_drivers();
        let pool = match location {
            StoreLocation::Sqlite(data_dir) => open_sqlite(data_dir).await?,
            StoreLocation::Postgres(url) => {
                AnyPoolOptions::new()
                    .max_connections(POSTGRES_CONNECTIONS)
                    .connect_with(AnyConnectOptions::from_str(url)?)
                    .await?
            }
        };
        let backend = location.backend();
        migrator(backend).run(&pool).await?;
        Ok(Store {
            pool,
            backend,
            max_queued_jobs_per_team: None,
        })
    }

    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// Bounds each team's queued jobs (checked in the transaction that enqueues, so concurrent
    /// posts cannot pass it together).
    pub fn with_max_queued_jobs_per_team(mut self, limit: u32) -> Store {
        self.max_queued_jobs_per_team = Some(limit);
        self
    }

    /// Waits for the pool's connections to close (on SQLite, checkpointing the WAL). Dropping a
    /// store without it loses nothing that was committed.
    pub async fn close(self) {
        self.pool.close().await;
    }

    /// A write transaction. SQLite's takes the write lock at once, so two read-then-write
    /// transactions cannot both read and then fail to upgrade (SQLITE_BUSY); PostgreSQL's run
    /// side by side, so their queries lock the rows they read before writing ([`locking!`]).
    async fn write_tx(&self) -> Result<sqlx::Transaction<'static, sqlx::Any>> {
        Ok(match self.backend {
            Backend::Sqlite => self.pool.begin_with("BEGIN IMMEDIATE").await?,
            Backend::Postgres => self.pool.begin().await?,
        })
    }

    /// This backend's SQL of a statement.
    pub(crate) fn sql(&self, dialects: Dialects) -> &'static str {
        match self.backend {
            Backend::Sqlite => dialects.sqlite,
            Backend::Postgres => dialects.postgres,
        }
    }
}

/// The SQLite file through the `Any` driver, which takes only a URL: the settings that URLs
/// cannot carry are PRAGMAs on each new connection.
async fn open_sqlite(data_dir: &Path) -> Result<AnyPool> {
    std::fs::create_dir_all(data_dir).map_err(|source| Error::DataDir {
        path: data_dir.to_owned(),
        source,
    })?;
    // Absolute: in the URL a relative path's first part would be taken for a host.
    let path = std::path::absolute(data_dir.join(DB_FILE)).map_err(|source| Error::DataDir {
        path: data_dir.to_owned(),
        source,
    })?;
    let url = format!(
        "sqlite://{}?mode=rwc",
        percent_encode(path.as_os_str().as_encoded_bytes())
    );
    let options = AnyConnectOptions::from_str(&url)?;
    Ok(AnyPoolOptions::new()
        .max_connections(4)
        .after_connect(|conn, _| {
            Box::pin(async move {
                // WAL; FULL: a committed transaction (an accepted job) survives a power cut,
                // not only a killed process. sqlx's SQLite connections enforce foreign keys.
                conn.execute(
                    "PRAGMA journal_mode = WAL; PRAGMA synchronous = FULL; \
                     PRAGMA busy_timeout = 10000;",
                )
                .await?;
                Ok(())
            })
        })
        .connect_with(options)
        .await?)
}

/// Every byte of a path but `A-Z a-z 0-9 / . - _` as `%XX`, as the SQLite URL's parser decodes
/// it (a data directory may hold `?`, `#`, `%` or spaces).
fn percent_encode(bytes: &[u8]) -> String {
    let mut s = String::with_capacity(bytes.len());
    for &b in bytes {
        if b.is_ascii_alphanumeric() || matches!(b, b'/' | b'.' | b'-' | b'_') {
            s.push(b as char);
        } else {
            s.push('%');
            s.push_str(&hex(&[b]).to_ascii_uppercase());
        }
    }
    s
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
pub(crate) async fn ensure_team(conn: &mut sqlx::AnyConnection, team: &str, at: i64) -> Result<()> {
    check_name("team", team, 64)?;
    sqlx::query("INSERT INTO teams (name, created_at) VALUES ($1, $2) ON CONFLICT DO NOTHING")
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

/// A name for a new worker, unique across servers and restarts (`<host>-<pid>-<random hex>`):
/// its job leases say which server runs a job.
pub fn new_worker_id() -> Result<String> {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "host".to_owned());
    Ok(format!(
        "{host}-{}-{}",
        std::process::id(),
        hex(&random_bytes::<4>()?)
    ))
}

/// `at` plus `d`, for a lease's end (whole seconds, as every time in the store).
pub(crate) fn seconds_from(at: i64, d: Duration) -> i64 {
    at.saturating_add(i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sql_files(dir: &Path) -> Vec<String> {
        let mut files: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".sql"))
            .collect();
        files.sort();
        files
    }

    /// Migrations are listed by hand in `MIGRATIONS`: a new file must be listed too, and a
    /// PostgreSQL file only exists beside its migration's portable one.
    #[test]
    fn every_migration_file_is_embedded() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("migrations");
        let listed: Vec<String> = MIGRATIONS
            .iter()
            .map(|m| format!("{}.sql", m.name))
            .collect();
        assert_eq!(sql_files(&dir), listed);
        let postgres: Vec<String> = MIGRATIONS
            .iter()
            .filter(|m| m.postgres.is_some())
            .map(|m| format!("{}.sql", m.name))
            .collect();
        assert_eq!(sql_files(&dir.join("postgres")), postgres);
        for backend in [Backend::Sqlite, Backend::Postgres] {
            let versions: Vec<i64> = migrator(backend).iter().map(|m| m.version).collect();
            assert!(versions.windows(2).all(|w| w[0] < w[1]), "{versions:?}");
        }
    }

    #[test]
    fn store_locations_hide_passwords_and_take_only_postgres_urls() {
        let url = "postgres://temper:s3cret@db.internal:5432/temper?sslmode=disable";
        let location = StoreLocation::parse_url(url).unwrap();
        assert_eq!(location.backend(), Backend::Postgres);
        let shown = location.to_string();
        assert_eq!(
            shown,
            "postgres://temper:***@db.internal:5432/temper?sslmode=disable"
        );
        assert!(!format!("{location:?}").contains("s3cret"));
        let no_password = "postgresql://temper@localhost/temper?host=/run/pg";
        assert_eq!(
            StoreLocation::parse_url(no_password).unwrap().to_string(),
            no_password
        );
        for bad in ["sqlite:///tmp/x.db", "/var/lib/temper", "mysql://a@b/c", ""] {
            assert!(
                matches!(StoreLocation::parse_url(bad), Err(Error::Location(_))),
                "{bad}"
            );
        }
        let refused = StoreLocation::parse_url("mysql://root:hunter2@db/x").unwrap_err();
        assert!(!refused.to_string().contains("hunter2"), "{refused}");
    }

    #[test]
    fn paths_are_percent_encoded_for_the_sqlite_url() {
        assert_eq!(percent_encode(b"/data/temper.db"), "/data/temper.db");
        assert_eq!(
            percent_encode("/a b/%?#é".as_bytes()),
            "/a%20b/%25%3F%23%C3%A9"
        );
    }
}
