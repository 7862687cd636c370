//! What the store's test files share: a database per test on either backend, and the macro
//! that runs a test on both.
#![allow(dead_code)] // each test file uses its own subset

use sqlx::{Connection, Executor};
use temper_store::{Store, StoreLocation, DB_FILE};
use uuid::Uuid;

/// One test's database, empty at first; [`Db::open`] opens a store on it (again and again, to
/// restart).
pub struct Db {
    pub location: StoreLocation,
    /// The SQLite data directory, deleted with the test.
    dir: Option<tempfile::TempDir>,
}

impl Db {
    pub fn sqlite() -> Db {
        let dir = tempfile::tempdir().unwrap();
        Db {
            location: StoreLocation::Sqlite(dir.path().to_owned()),
            dir: Some(dir),
        }
    }

    /// A new database on the test server, or `None` (with the reason printed) without one.
    pub async fn postgres() -> Option<Db> {
        let Ok(server) = std::env::var("TEMPER_TEST_POSTGRES_URL") else {
            assert!(
                std::env::var("TEMPER_REQUIRE_POSTGRES").as_deref() != Ok("1"),
                "TEMPER_REQUIRE_POSTGRES=1 but TEMPER_TEST_POSTGRES_URL is not set: run the \
                 tests under scripts/with-postgres.sh"
            );
            eprintln!(
                "skipped: TEMPER_TEST_POSTGRES_URL is not set (scripts/with-postgres.sh CMD runs \
                 CMD with a throwaway PostgreSQL server)"
            );
            return None;
        };
        // Its own database per test, so tests run in parallel; the server is thrown away after
        // the run.
        let name = format!("temper_test_{}", Uuid::new_v4().simple());
        let mut admin = sqlx::PgConnection::connect(&server)
            .await
            .expect("connect to TEMPER_TEST_POSTGRES_URL");
        admin
            .execute(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .await
            .unwrap();
        admin.close().await.unwrap();
        Some(Db {
            location: StoreLocation::parse_url(&with_database(&server, &name)).unwrap(),
            dir: None,
        })
    }

    pub async fn open(&self) -> Store {
        Store::connect(&self.location).await.expect("open store")
    }

    /// What the database holds of API keys, as bytes to search: SQLite's files, PostgreSQL's
    /// `api_keys` rows as text.
    pub async fn stored_key_bytes(&self) -> Vec<u8> {
        match (&self.location, &self.dir) {
            (StoreLocation::Sqlite(_), Some(dir)) => {
                // The WAL holds recent commits until a checkpoint copies them into the file.
                let mut bytes = Vec::new();
                for name in [DB_FILE.to_owned(), format!("{DB_FILE}-wal")] {
                    if let Ok(b) = std::fs::read(dir.path().join(name)) {
                        bytes.extend(b);
                    }
                }
                bytes
            }
            (StoreLocation::Postgres(url), _) => {
                let mut conn = sqlx::PgConnection::connect(url).await.unwrap();
                let rows: Vec<String> =
                    sqlx::query_scalar("SELECT CAST(k AS TEXT) FROM api_keys k")
                        .fetch_all(&mut conn)
                        .await
                        .unwrap();
                rows.join("\n").into_bytes()
            }
            (StoreLocation::Sqlite(_), None) => unreachable!("an SQLite Db has its directory"),
        }
    }

    /// How a child process is told the location (see `crash_child`).
    pub fn child_arg(&self) -> String {
        match &self.location {
            StoreLocation::Sqlite(dir) => dir.display().to_string(),
            StoreLocation::Postgres(url) => url.clone(),
        }
    }
}

/// `url` with its database (the path) replaced by `name`.
fn with_database(url: &str, name: &str) -> String {
    let (base, query) = url
        .split_once('?')
        .map_or((url, None), |(b, q)| (b, Some(q)));
    let (scheme, rest) = base.split_once("://").unwrap();
    let authority = rest.split('/').next().unwrap();
    let mut out = format!("{scheme}://{authority}/{name}");
    if let Some(query) = query {
        out.push('?');
        out.push_str(query);
    }
    out
}

/// Each test as `<test>::sqlite` and `<test>::postgres`.
macro_rules! on_both_backends {
    ($($test:ident),* $(,)?) => {
        $(
            mod $test {
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn sqlite() {
                    super::$test(super::Db::sqlite()).await
                }

                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn postgres() {
                    if let Some(db) = super::Db::postgres().await {
                        super::$test(db).await
                    }
                }
            }
        )*
    };
}
pub(crate) use on_both_backends;
