//! Fault injection: `kill -9` at random moments of job runs and checkpoint writes, round after
//! round on one data directory, then one clean start. Every accepted job must end succeeded
//! exactly once, every committed checkpoint's file must load, and no temporary file may be left.
//! `TEMPER_FAULT_SEED` and `TEMPER_FAULT_ROUNDS` replay or lengthen a run (the seed is printed).

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use common::*;

/// xorshift64*: the test's only randomness, so a seed replays a run's choices.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) % n
    }
}

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Files under `dir` whose name has `.tmp` in it.
fn temp_files(dir: &Path) -> Vec<String> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        if path.is_dir() {
            found.extend(temp_files(&path));
        } else if entry.file_name().to_string_lossy().contains(".tmp") {
            found.push(path.display().to_string());
        }
    }
    found
}

/// Waits (polling fast) until some job of `jobs` has a gradient step in its current run, so the
/// kill that follows lands in the rest of that run: its last steps, its checkpoint write and
/// commit. Gives up after `within`.
async fn wait_for_a_gradient_step(server: &Server, jobs: &[String], within: Duration) {
    let start = Instant::now();
    while start.elapsed() < within {
        for job in jobs {
            let types = event_types(&server.events(job).await);
            let run = types
                .iter()
                .rposition(|t| t == "training_started")
                .map_or(&[][..], |i| &types[i..]);
            if run.iter().any(|t| t == "gradient_step") && !types.contains(&"training_ended".into())
            {
                return;
            }
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_at_random_moments_loses_no_job_and_breaks_no_checkpoint() {
    let seed = env_or("TEMPER_FAULT_SEED", 20_261_123);
    let rounds = env_or("TEMPER_FAULT_ROUNDS", 24);
    println!("fault injection: seed {seed}, {rounds} rounds (TEMPER_FAULT_SEED/ROUNDS replay)");
    let mut rng = Rng(seed | 1);
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let data = dir.path().join("data");
    // Every attempt may be killed: the attempt limit is not what this test is about.
    let args = ["--max-train-seq-len", "64", "--max-job-attempts", "1000"];

    // Two models, and trajectory groups to post (rolled out once, posted many times).
    let server = Server::start(&model, &data, &args);
    let mut models = Vec::new();
    for name in ["first", "second"] {
        let created = server
            .post(
                "/v1/preview/models",
                &json!({"project": "proj", "name": name, "base_model": "tiny"}),
            )
            .await;
        models.push((
            created["id"].as_str().unwrap().to_owned(),
            format!("default/proj/{name}"),
        ));
    }
    let small = groups(
        &server,
        "tiny",
        &["Hello", "the cat sat", "what is the capital"],
    )
    .await;
    drop(server);

    // job id -> model id, for every job whose POST returned 200.
    let mut accepted: BTreeMap<String, String> = BTreeMap::new();
    for round in 0..rounds {
        let mut server = Server::start(&model, &data, &args);
        let mut posted = Vec::new();
        for _ in 0..rng.below(3) {
            let (model_id, _) = &models[rng.below(2) as usize];
            // From one gradient step to a few dozen: runs of ~0.05 s to ~1 s.
            let copies = 1 + rng.below(24) as usize;
            let body: Vec<Value> = (0..copies)
                .flat_map(|_| small.as_array().unwrap().iter().cloned())
                .collect();
            let job = post_job(&server, model_id, &body).await;
            accepted.insert(job.clone(), model_id.clone());
            posted.push(job);
        }
        let pending: Vec<String> = accepted.keys().cloned().collect();
        let how = if rng.below(2) == 0 {
            let delay = rng.below(1500);
            tokio::time::sleep(Duration::from_millis(delay)).await;
            format!("after {delay} ms")
        } else {
            // Inside a run, a moment after one of its steps: often its checkpoint write.
            wait_for_a_gradient_step(&server, &pending, Duration::from_secs(3)).await;
            let delay = rng.below(40);
            tokio::time::sleep(Duration::from_millis(delay)).await;
            format!("{delay} ms after a gradient step")
        };
        server.kill();
        println!("round {round}: posted {}, killed {how}", posted.len());
    }

    // The last start: recovery, then every job runs to its end.
    let server = Server::start(&model, &data, &args);
    for job in accepted.keys() {
        server.wait_until_succeeded(job).await;
        let types = event_types(&server.events(job).await);
        let ends = types.iter().filter(|t| *t == "training_ended").count();
        assert_eq!(ends, 1, "job {job} ended {ends} times: {types:?}");
        assert!(!types.contains(&"training_failed".into()), "{types:?}");
    }
    // Exactly the accepted jobs exist: none lost, none duplicated.
    let listed = server.get("/v1/preview/training-jobs?limit=100").await;
    let mut ids: Vec<&str> = listed["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|j| j["id"].as_str().unwrap())
        .collect();
    ids.sort_unstable();
    assert_eq!(ids, accepted.keys().map(String::as_str).collect::<Vec<_>>());

    // Each model: its step 0 (the untrained adapter, no file) and one checkpoint per job, steps
    // 1..=n, every file on disk and served by name.
    for (model_id, name) in &models {
        let jobs = accepted.values().filter(|m| *m == model_id).count() as i64;
        let page = server
            .get(&format!(
                "/v1/preview/models/{model_id}/checkpoints?limit=100"
            ))
            .await;
        let steps: Vec<i64> = page["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["step"].as_i64().unwrap())
            .collect();
        assert_eq!(steps, (0..=jobs).collect::<Vec<_>>(), "model {name}");
        for step in steps {
            let file = data
                .join("adapters")
                .join(model_id)
                .join(format!("step-{step}.safetensors"));
            assert!(step == 0 || file.is_file(), "{} is missing", file.display());
            let (status, v) = server
                .call(
                    "POST",
                    "/v1/chat/completions",
                    Some(&json!({"model": format!("{name}:step{step}"),
                        "messages": user("Hello"), "max_tokens": 2})),
                )
                .await;
            assert_eq!(status, 200, "{name}:step{step}: {v}");
        }
    }
    assert_eq!(temp_files(&data), Vec::<String>::new());
}
