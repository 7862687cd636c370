//! `temper serve --store postgres://…` through the built binary: servers sharing one PostgreSQL
//! database. Each test makes its own database on the server at `TEMPER_TEST_POSTGRES_URL`
//! (`scripts/with-postgres.sh` starts one); without it they print why they skip, unless
//! `TEMPER_REQUIRE_POSTGRES=1` (`make test`): then they fail.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::{create_model, groups, post_job, tiny_model, user, Server, PROMPTS};
use serde_json::json;
use sqlx::{Connection, Executor};
use temper_store::{Store, StoreLocation};

/// A URL of a new, empty database, or `None` (with the reason printed) without a server.
async fn new_database() -> Option<String> {
    let Ok(server) = std::env::var("TEMPER_TEST_POSTGRES_URL") else {
        assert!(
            std::env::var("TEMPER_REQUIRE_POSTGRES").as_deref() != Ok("1"),
            "TEMPER_REQUIRE_POSTGRES=1 but TEMPER_TEST_POSTGRES_URL is not set: run the tests \
             under scripts/with-postgres.sh"
        );
        eprintln!(
            "skipped: TEMPER_TEST_POSTGRES_URL is not set (scripts/with-postgres.sh CMD runs CMD \
             with a throwaway PostgreSQL server)"
        );
        return None;
    };
    let name = format!("temper_test_{}", uuid_hex());
    let mut admin = sqlx::PgConnection::connect(&server).await.unwrap();
    admin
        .execute(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
        .await
        .unwrap();
    admin.close().await.unwrap();
    // The database is the URL's path.
    let (base, query) = server.split_once('?').unwrap_or((&server, ""));
    let (scheme, rest) = base.split_once("://").unwrap();
    let authority = rest.split('/').next().unwrap();
    Some(format!("{scheme}://{authority}/{name}?{query}"))
}

fn uuid_hex() -> String {
    let mut bytes = [0u8; 16];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut bytes))
        .unwrap();
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

async fn store(url: &str) -> Store {
    Store::connect(&StoreLocation::parse_url(url).unwrap())
        .await
        .unwrap()
}

#[tokio::test]
async fn a_server_on_a_postgres_store_trains_serves_and_takes_its_keys() {
    let Some(url) = new_database().await else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let data = dir.path().join("data");
    let created = Command::new(env!("CARGO_BIN_EXE_temper"))
        .args(["keys", "create", "--team", "acme", "--store", &url])
        .env_remove("TEMPER_CONFIG")
        .output()
        .unwrap();
    assert!(
        created.status.success(),
        "{}",
        String::from_utf8_lossy(&created.stderr)
    );
    let secret = String::from_utf8(created.stdout).unwrap().trim().to_owned();

    let server = Server::start(&model, &data, &["--store", &url]);
    let model_id = create_model(&server).await;
    let name = "default/proj/agent";
    let job = post_job(&server, &model_id, &groups(&server, name, PROMPTS).await).await;
    assert_eq!(server.wait_until_succeeded(&job).await["step"], 1);
    server
        .post(
            "/v1/chat/completions",
            &json!({"model": format!("{name}:step1"), "messages": user("Hello"), "max_tokens": 4}),
        )
        .await;
    // The key made by `temper keys --store` authenticates (as its team).
    let listed = server
        .client
        .get(format!("{}/v1/preview/models", server.base))
        .bearer_auth(&secret)
        .send()
        .await
        .unwrap();
    assert_eq!(listed.status(), 200);

    // The rows are in PostgreSQL; the data directory has the adapter and no database.
    let store = store(&url).await;
    let job = store
        .get_job("default", job.parse().unwrap())
        .await
        .unwrap();
    assert_eq!(job.attempts, 1);
    assert_eq!(job.lease_owner, None);
    assert!(data
        .join("adapters")
        .join(&model_id)
        .join("step-1.safetensors")
        .exists());
    assert!(!data.join(temper_store::DB_FILE).exists());
}

/// Two servers share the queue. While its server lives, a job outlives its lease (renewed);
/// once that server is killed, the other re-queues the job when the lease expires and runs it
/// to the end.
#[tokio::test]
async fn a_killed_servers_job_is_rerun_by_another_once_its_lease_expires() {
    let Some(url) = new_database().await else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let args = |worker| {
        [
            "--store",
            &url,
            "--job-lease-secs",
            "3",
            "--max-train-seq-len",
            "64",
            "--worker-id",
            worker,
        ]
        .map(str::to_owned)
    };
    let mut servers = ["worker-a", "worker-b"].map(|worker| {
        let args = args(worker);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        Server::start(&model, &dir.path().join(worker), &args)
    });
    let model_id = create_model(&servers[0]).await;
    // Longer than post_long_job's: it has to outlast the wait below (200 copies did until the
    // trainer got faster).
    let small = groups(&servers[1], "default/proj/agent", PROMPTS).await;
    let long: Vec<serde_json::Value> = (0..800)
        .flat_map(|_| small.as_array().unwrap().iter().cloned())
        .collect();
    let job = post_job(&servers[1], &model_id, &long).await;
    let id = job.parse().unwrap();
    let store = store(&url).await;
    // Whichever server's worker claimed it.
    let start = Instant::now();
    let owner = loop {
        let running = store.get_job("default", id).await.unwrap();
        if let Some(owner) = running.lease_owner {
            break owner;
        }
        assert!(start.elapsed() < Duration::from_secs(60), "never claimed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let running = ["worker-a", "worker-b"]
        .iter()
        .position(|w| *w == owner)
        .unwrap_or_else(|| panic!("{owner} is neither server's worker"));

    // Past the lease, renewed: still running under its first claim.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let renewed = store.get_job("default", id).await.unwrap();
    assert_eq!(
        (renewed.status.as_str(), renewed.attempts),
        ("running", 1),
        "the job must outlast its lease while its server lives (make it longer if it ended)"
    );
    assert_eq!(renewed.lease_owner.as_deref(), Some(owner.as_str()));

    servers[running].kill();
    let other = &servers[1 - running];
    let done = other.wait_until_succeeded(&job).await;
    assert_eq!(done["step"], 1);
    let events = other.events(&job).await;
    let requeued: Vec<_> = events
        .iter()
        .filter(|e| e["type"] == "training_requeued")
        .collect();
    assert_eq!(requeued.len(), 1, "{events:?}");
    assert_eq!(requeued[0]["data"]["worker"], owner.as_str());
    // Each run's training_started names its worker: the killed one, then the other.
    let started: Vec<&str> = events
        .iter()
        .filter(|e| e["type"] == "training_started")
        .map(|e| e["data"]["worker"].as_str().unwrap())
        .collect();
    assert_eq!(
        started,
        [owner.as_str(), ["worker-a", "worker-b"][1 - running]]
    );
    let job = store.get_job("default", id).await.unwrap();
    assert_eq!(job.attempts, 2);
}
