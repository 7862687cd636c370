//! Training jobs run by the worker through real HTTP on the tiny model: an SFT job and then an
//! RL job on the same model (both checkpoints served), the RL job's bookkeeping metrics, SFT
//! validation at the edge, and `Idempotency-Key`s (replays, mismatches, concurrent duplicates,
//! a restart on the same data directory).

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::{options, TestServer, KEY};
use serde_json::{json, Value};
use temper_http::{CatalogOptions, TrainingOptions};

/// A server over a store in `data` (kept by the caller, so a second server can reopen it), with
/// the job worker running.
async fn server(data: &Path, max_seq_len: usize) -> TestServer {
    let training = TrainingOptions {
        max_seq_len,
        ..TrainingOptions::default()
    };
    let server =
        TestServer::tiny_training(options(), CatalogOptions::new(data), training, None).await;
    server.state.training().unwrap().spawn_worker().unwrap();
    server
}

/// `(status, body, whether the answer was a replay)`.
async fn call(
    server: &TestServer,
    method: &str,
    path: &str,
    key: &str,
    idempotency_key: Option<&str>,
    body: Option<&Value>,
) -> (u16, Value, bool) {
    let mut req = server
        .client
        .request(method.parse().unwrap(), server.url(path))
        .bearer_auth(key);
    if let Some(k) = idempotency_key {
        req = req.header("Idempotency-Key", k);
    }
    if let Some(body) = body {
        req = req.json(body);
    }
    let resp = req.send().await.unwrap();
    let status = resp.status().as_u16();
    let replayed = resp.headers().get("Idempotent-Replayed").is_some();
    let text = resp.text().await.unwrap();
    let body = serde_json::from_str(&text).unwrap_or(Value::String(text));
    (status, body, replayed)
}

async fn post(server: &TestServer, path: &str, body: &Value) -> Value {
    let (status, v, _) = call(server, "POST", path, KEY, None, Some(body)).await;
    assert_eq!(status, 200, "POST {path}: {v}");
    v
}

async fn get(server: &TestServer, path: &str) -> Value {
    let (status, v, _) = call(server, "GET", path, KEY, None, None).await;
    assert_eq!(status, 200, "GET {path}: {v}");
    v
}

async fn create_model(server: &TestServer, name: &str) -> String {
    let body = json!({"project": "proj", "name": name, "base_model": "tiny"});
    post(server, "/v1/preview/models", &body).await["id"]
        .as_str()
        .unwrap()
        .to_owned()
}

async fn wait_finished(server: &TestServer, job: &str) -> Value {
    let start = Instant::now();
    loop {
        let j = get(server, &format!("/v1/preview/training-jobs/{job}")).await;
        if ["succeeded", "failed", "cancelled"].contains(&j["status"].as_str().unwrap()) {
            return j;
        }
        assert!(start.elapsed() < Duration::from_secs(300), "job {job}: {j}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn events(server: &TestServer, job: &str) -> Vec<Value> {
    let page = get(
        server,
        &format!("/v1/preview/training-jobs/{job}/events?limit=100"),
    )
    .await;
    page["data"].as_array().unwrap().clone()
}

/// The agent library reads every `gradient_step` value with `float(v)`.
fn assert_all_numbers(events: &[Value]) {
    for e in events.iter().filter(|e| e["type"] == "gradient_step") {
        let data = e["data"].as_object().unwrap();
        assert!(data.values().all(Value::is_number), "{e}");
    }
}

fn user(text: &str) -> Value {
    json!({"role": "user", "content": text})
}

fn param(body: &Value) -> Option<&str> {
    body["error"]["param"].as_str()
}

#[tokio::test]
async fn sft_then_rl_on_the_same_model_both_checkpoints_served() {
    let data = tempfile::tempdir().unwrap();
    let server = server(data.path(), 2048).await;
    let model_id = create_model(&server, "m").await;

    // SFT: ART's JSONL line shape, config keys null or left out = defaults.
    let line = |q: &str, a: &str| json!({"messages": [user(q), {"role": "assistant", "content": a}], "tools": []});
    let sft = post(
        &server,
        "/v1/preview/sft-training-jobs",
        &json!({"model_id": model_id, "trajectories": [line("hi", "hello"), line("bye", "ciao")],
                "config": {"learning_rate": 1e-3, "batch_size": null}}),
    )
    .await;
    let sft = sft["id"].as_str().unwrap();
    let job = wait_finished(&server, sft).await;
    assert_eq!(
        (&job["status"], &job["kind"], &job["step"]),
        (&json!("succeeded"), &json!("sft"), &json!(1)),
        "{job}"
    );
    let ev = events(&server, sft).await;
    assert_all_numbers(&ev);
    let kinds: Vec<&str> = ev.iter().map(|e| e["type"].as_str().unwrap()).collect();
    assert_eq!(
        kinds,
        ["training_started", "gradient_step", "training_ended"]
    );
    assert_eq!(ev[0]["data"]["num_sequences"], 1);
    // The worker that ran it, as its lease names it.
    assert!(ev[0]["data"]["worker"].is_string(), "{}", ev[0]);
    let step = &ev[1]["data"];
    assert_eq!(
        (
            &step["step"],
            &step["learning_rate"],
            &step["num_trajectories"]
        ),
        (&json!(1), &json!(1e-3), &json!(2))
    );
    assert!(step["loss"].as_f64().unwrap() > 0.0 && step["grad_norm"].as_f64().unwrap() > 0.0);
    assert!(
        step["num_trainable_tokens"].as_u64().unwrap() >= 4,
        "{step}"
    );
    assert_eq!(ev[2]["data"], json!({"step": 1}));

    // RL on top: roll out from the SFT checkpoint (policy version 1), reward one answer.
    let rollout = post(
        &server,
        "/v1/chat/completions",
        &json!({"model": "default/proj/m", "messages": [user("hi")], "max_tokens": 3, "n": 2,
                "temperature": 1.0, "seed": 5, "logprobs": true,
                "return_tokens_as_token_ids": true}),
    )
    .await;
    let choices = rollout["choices"].as_array().unwrap();
    let trajectories: Vec<Value> = choices
        .iter()
        .enumerate()
        .map(|(i, c)| {
            json!({"messages_and_choices": [user("hi"), c], "reward": i as f64,
                   "initial_policy_version": 1 - i as i64, "final_policy_version": 1,
                   "metrics": {"correct": i == 1, "turns": 1}, "metadata": {"scenario_id": "s"}})
        })
        .collect();
    let rl = post(
        &server,
        "/v1/preview/training-jobs",
        &json!({"model_id": model_id, "trajectory_groups": [{"trajectories": trajectories}],
                "experimental_config": {"learning_rate": 1e-4}}),
    )
    .await;
    let rl = rl["id"].as_str().unwrap();
    let job = wait_finished(&server, rl).await;
    assert_eq!(
        (&job["status"], &job["kind"], &job["step"]),
        (&json!("succeeded"), &json!("rl"), &json!(2)),
        "{job}"
    );
    // Bookkeeping: trained from step 1, trajectories of versions 1 and 0 were 0 and 1 steps
    // off policy; the trajectory metrics' means; the counts ART reads.
    let ev = events(&server, rl).await;
    assert_all_numbers(&ev);
    let step = &ev
        .iter()
        .find(|e| e["type"] == "gradient_step")
        .expect("a gradient step")["data"];
    for (k, v) in [
        ("off_policy_steps", json!(0.5)),
        ("off_policy_steps_max", json!(1)),
        ("train/correct", json!(0.5)),
        ("train/turns", json!(1.0)),
        ("num_trajectories", json!(2)),
        ("num_groups_submitted", json!(1)),
        ("num_groups_trainable", json!(1)),
    ] {
        assert_eq!(step[k], v, "{k} in {step}");
    }
    let checkpoints = get(
        &server,
        &format!("/v1/preview/models/{model_id}/checkpoints"),
    )
    .await;
    let data = checkpoints["data"].as_array().unwrap();
    assert_eq!(
        data.iter().map(|c| c["step"].clone()).collect::<Vec<_>>(),
        [json!(0), json!(1), json!(2)]
    );
    assert!(data[1]["metrics"]["loss"].as_f64().unwrap() > 0.0);
    assert_eq!(data[2]["metrics"]["off_policy_steps"], json!(0.5));
    assert_eq!(data[2]["metrics"]["train/correct"], json!(0.5));

    // Both checkpoints are served by name, with different weights.
    let mut logprobs = Vec::new();
    for name in ["default/proj/m:step1", "default/proj/m:step2"] {
        let out = post(
            &server,
            "/v1/chat/completions",
            &json!({"model": name, "messages": [user("hi")], "max_tokens": 1,
                    "temperature": 0.0, "logprobs": true}),
        )
        .await;
        assert_eq!(out["model"], name);
        logprobs.push(out["choices"][0]["logprobs"]["content"][0]["logprob"].clone());
    }
    assert_ne!(logprobs[0], logprobs[1]);
}

#[tokio::test]
async fn sft_bodies_are_validated_at_the_edge() {
    let data = tempfile::tempdir().unwrap();
    let server = server(data.path(), 64).await;
    let model_id = create_model(&server, "m").await;
    let answer = |a: &str| json!({"role": "assistant", "content": a});
    let body = |trajectories: Value, config: Value| json!({"model_id": model_id, "trajectories": trajectories, "config": config});
    let good = json!({"messages": [user("q"), answer("a")]});
    let cases = [
        (body(json!([]), json!(null)), "trajectories"),
        (json!({"model_id": model_id}), "trajectories"),
        (
            json!({"model_id": model_id, "training_data_url": "wandb-artifact:///e/p/a:v0"}),
            "training_data_url",
        ),
        (
            body(json!([good, {"messages": [user("q")]}]), json!(null)),
            "trajectories[1].messages",
        ),
        (
            body(
                json!([{"messages": [user(&"word ".repeat(100)), answer("a")]}]),
                json!({}),
            ),
            "trajectories[0].messages",
        ),
        (
            body(json!([good]), json!({"batch_size": 0})),
            "config.batch_size",
        ),
        (body(json!([good]), json!({"epochs": -1})), "config.epochs"),
        (
            body(json!([good]), json!({"learning_rate": "fast"})),
            "config.learning_rate",
        ),
        (
            body(json!([good]), json!({"learning_rate": [1e-4, 1e-4]})),
            "config.learning_rate",
        ),
        (body(json!([good]), json!({"warmup": 0.1})), "config.warmup"),
    ];
    for (body, want) in cases {
        let (status, err, _) = call(
            &server,
            "POST",
            "/v1/preview/sft-training-jobs",
            KEY,
            None,
            Some(&body),
        )
        .await;
        assert_eq!((status, param(&err)), (400, Some(want)), "{body}: {err}");
    }
    let jobs = get(&server, "/v1/preview/training-jobs").await;
    assert_eq!(jobs["data"], json!([]), "nothing invalid was stored");
    let ok = post(
        &server,
        "/v1/preview/sft-training-jobs",
        &body(json!([good]), json!({"learning_rate": [1e-4]})),
    )
    .await;
    assert!(ok["id"].is_string());
}

/// A body the worker cannot start on at once (the job stays queued: nothing runs it).
fn job_body(model_id: &str, reward: f64) -> Value {
    let choice = json!({"message": {"role": "assistant", "content": "x"}, "finish_reason": "stop",
        "index": 0, "logprobs": {"content": [{"token": "token_id:5", "logprob": -0.1}]}});
    json!({"model_id": model_id, "trajectory_groups": [{"trajectories": [
        {"messages_and_choices": [user("q"), choice], "reward": reward}]}]})
}

#[tokio::test]
async fn idempotency_keys_replay_conflict_and_survive_a_restart() {
    let data = tempfile::tempdir().unwrap();
    // No worker: jobs stay queued, so cancelling them is possible at any time.
    let server = TestServer::tiny_training_in(data.path()).await;
    let s = &server;
    let post_with = |path: &'static str, key: &'static str, body: Value| async move {
        call(s, "POST", path, KEY, Some(key), Some(&body)).await
    };

    // Models: the retry gets the first answer (without the key it would be a 409).
    let model = json!({"project": "proj", "name": "m", "base_model": "tiny"});
    let (status, first, replayed) = post_with("/v1/preview/models", "model-1", model.clone()).await;
    assert_eq!((status, replayed), (200, false), "{first}");
    let (status, again, replayed) = post_with("/v1/preview/models", "model-1", model.clone()).await;
    assert_eq!((status, &again, replayed), (200, &first, true));
    let model_id = first["id"].as_str().unwrap().to_owned();

    // Jobs: same key and body, same job.
    let body = job_body(&model_id, 1.0);
    let (status, job, _) = post_with("/v1/preview/training-jobs", "job-1", body.clone()).await;
    assert_eq!(status, 200, "{job}");
    let (status, again, replayed) =
        post_with("/v1/preview/training-jobs", "job-1", body.clone()).await;
    assert_eq!((status, &again, replayed), (200, &job, true));
    // Same key, another body: a 409 naming the header.
    let (status, err, _) = post_with(
        "/v1/preview/training-jobs",
        "job-1",
        job_body(&model_id, 2.0),
    )
    .await;
    assert_eq!(
        (status, param(&err)),
        (409, Some("Idempotency-Key")),
        "{err}"
    );
    assert_eq!(err["error"]["type"], "ConflictError");
    // The same key on another route is another key.
    let (status, sft, replayed) = post_with(
        "/v1/preview/sft-training-jobs",
        "job-1",
        json!({"model_id": model_id, "trajectories": [
            {"messages": [user("q"), {"role": "assistant", "content": "a"}]}]}),
    )
    .await;
    assert_eq!((status, replayed), (200, false), "{sft}");
    assert_ne!(sft["id"], job["id"]);

    // A failed request is not remembered: the key works for the corrected body.
    let mut invalid = body.clone();
    invalid["trajectory_groups"] = json!([]);
    let (status, _, _) = post_with("/v1/preview/training-jobs", "job-2", invalid).await;
    assert_eq!(status, 400);
    let (status, job2, replayed) = post_with(
        "/v1/preview/training-jobs",
        "job-2",
        job_body(&model_id, 3.0),
    )
    .await;
    assert_eq!((status, replayed), (200, false), "{job2}");

    // Concurrent duplicates create one job: one answer, the others replays or "in progress".
    let concurrent = job_body(&model_id, 4.0);
    let answers = futures_util::future::join_all((0..8).map(|_| {
        call(
            s,
            "POST",
            "/v1/preview/training-jobs",
            KEY,
            Some("job-3"),
            Some(&concurrent),
        )
    }))
    .await;
    let ids: std::collections::BTreeSet<String> = answers
        .iter()
        .filter(|(status, _, _)| *status == 200)
        .map(|(_, b, _)| b["id"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(ids.len(), 1, "{answers:?}");
    for (status, b, _) in &answers {
        assert!(
            *status == 200 || (*status == 409 && param(b) == Some("Idempotency-Key")),
            "{status} {b}"
        );
    }
    let jobs = get(s, "/v1/preview/training-jobs?limit=100").await;
    assert_eq!(jobs["data"].as_array().unwrap().len(), 4, "{jobs}");

    // Cancel: the retry replays the first answer (without the key, a finished job is a 409).
    let cancel = format!(
        "/v1/preview/training-jobs/{}/cancel",
        job["id"].as_str().unwrap()
    );
    let (status, cancelled, _) = call(s, "POST", &cancel, KEY, Some("c-1"), Some(&json!({}))).await;
    assert_eq!((status, &cancelled["status"]), (200, &json!("cancelled")));
    let (status, again, replayed) =
        call(s, "POST", &cancel, KEY, Some("c-1"), Some(&json!({}))).await;
    assert_eq!((status, &again, replayed), (200, &cancelled, true));
    let (status, _, _) = call(s, "POST", &cancel, KEY, None, Some(&json!({}))).await;
    assert_eq!(status, 409);

    // Keys are scoped to the team: another team's identical request is its own (a 404 here).
    let (_, other) = s
        .state
        .training()
        .unwrap()
        .store
        .create_key("other")
        .await
        .unwrap();
    let (status, _, _) = call(
        s,
        "POST",
        "/v1/preview/training-jobs",
        &other,
        Some("job-1"),
        Some(&body),
    )
    .await;
    assert_eq!(status, 404);

    // Bounded keys.
    for bad in ["k".repeat(256), "two words".to_owned()] {
        let (status, err, _) = call(
            s,
            "POST",
            "/v1/preview/training-jobs",
            KEY,
            Some(&bad),
            Some(&body),
        )
        .await;
        assert_eq!(
            (status, param(&err)),
            (400, Some("Idempotency-Key")),
            "{err}"
        );
    }

    // DELETE too: the retry gets the first answer, not a 404.
    let delete = format!("/v1/preview/models/{model_id}");
    let (status, deleted, _) = call(s, "DELETE", &delete, KEY, Some("d-1"), None).await;
    assert_eq!(
        (status, &deleted["deleted_run"]),
        (200, &json!(true)),
        "{deleted}"
    );
    let (status, again, replayed) = call(s, "DELETE", &delete, KEY, Some("d-1"), None).await;
    assert_eq!((status, &again, replayed), (200, &deleted, true));
    let (status, _, _) = call(s, "DELETE", &delete, KEY, None, None).await;
    assert_eq!(status, 404);

    // After a restart on the same data directory: the same answers, the same conflicts.
    drop(server);
    let server = TestServer::tiny_training_in(data.path()).await;
    let (status, again, replayed) = call(
        &server,
        "POST",
        "/v1/preview/training-jobs",
        KEY,
        Some("job-1"),
        Some(&body),
    )
    .await;
    assert_eq!((status, &again, replayed), (200, &job, true));
    let (status, err, _) = call(
        &server,
        "POST",
        "/v1/preview/training-jobs",
        KEY,
        Some("job-1"),
        Some(&job_body(&model_id, 2.0)),
    )
    .await;
    assert_eq!((status, param(&err)), (409, Some("Idempotency-Key")));
    let (status, again, _) = call(
        &server,
        "POST",
        "/v1/preview/models",
        KEY,
        Some("model-1"),
        Some(&model),
    )
    .await;
    assert_eq!((status, &again), (200, &first));
    let jobs = get(&server, "/v1/preview/training-jobs?limit=100").await;
    assert_eq!(jobs["data"].as_array().unwrap().len(), 4);
}

#[tokio::test]
async fn temporary_files_of_an_interrupted_adapter_save_are_removed_at_start() {
    let data = tempfile::tempdir().unwrap();
    let model_dir = data
        .path()
        .join("adapters")
        .join("00000000-0000-4000-8000-000000000001");
    std::fs::create_dir_all(&model_dir).unwrap();
    // A committed adapter, the worker's temporary file and the adapter writer's own.
    for name in [
        "step-1.safetensors",
        "step-2.safetensors.tmp",
        "step-2.safetensors.tmp.tmp4242",
    ] {
        std::fs::write(model_dir.join(name), b"bytes").unwrap();
    }
    let _server = server(data.path(), 2048).await;
    let left: Vec<String> = std::fs::read_dir(&model_dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(left, ["step-1.safetensors"]);
}
