//! The training service end to end through the built binary on the tiny model: roll out over
//! HTTP, train, serve the checkpoint by name; and the crash test (`kill -9` with a job running
//! and one queued, restart on the same data directory, both finish).

mod common;

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn train_and_serve_the_checkpoint_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let data = dir.path().join("data");
    let server = Server::start(&model, &data, &[]);
    let model_id = create_model(&server).await;
    let name = "default/proj/agent";

    let trajectory_groups = groups(&server, name, PROMPTS).await;
    let job = server
        .post(
            "/v1/preview/training-jobs",
            &json!({"model_id": model_id, "trajectory_groups": trajectory_groups,
                "experimental_config": {"learning_rate": 1e-2}}),
        )
        .await;
    let job_id = job["id"].as_str().unwrap();
    let done = server.wait_until_succeeded(job_id).await;
    assert_eq!(done["step"], 1);
    let events = server.events(job_id).await;
    let kinds: Vec<&str> = events.iter().map(|e| e["type"].as_str().unwrap()).collect();
    assert_eq!(kinds.first(), Some(&"training_started"), "{kinds:?}");
    assert_eq!(kinds.last(), Some(&"training_ended"), "{kinds:?}");
    assert!(kinds.contains(&"gradient_step"));
    assert_eq!(events.last().unwrap()["data"]["step"], 1);
    let step = events
        .iter()
        .find(|e| e["type"] == "gradient_step")
        .unwrap();
    for field in [
        "loss",
        "grad_norm",
        "learning_rate",
        "reward",
        "num_trainable_tokens",
    ] {
        assert!(step["data"][field].is_number(), "{field}: {step}");
    }

    // The checkpoint is listed and servable at once; step 0 is the base model.
    let checkpoints = server
        .get(&format!("/v1/preview/models/{model_id}/checkpoints"))
        .await;
    let steps: Vec<i64> = checkpoints["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["step"].as_i64().unwrap())
        .collect();
    assert_eq!(steps, [0, 1]);
    assert!(checkpoints["data"][1]["metrics"]["loss"].is_number());
    let listed: Vec<String> = server.get("/v1/models").await["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(
        listed,
        [
            "tiny",
            name,
            &format!("{name}:step0"),
            &format!("{name}:step1")
        ]
    );

    let greedy = |model: &str| {
        json!({"model": model, "messages": user("Hello"), "temperature": 0.0, "max_tokens": 8,
            "logprobs": true, "return_token_ids": true})
    };
    let logprobs = |v: &Value| -> Vec<f64> {
        v["choices"][0]["logprobs"]["content"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["logprob"].as_f64().unwrap())
            .collect()
    };
    let base = server.post("/v1/chat/completions", &greedy("tiny")).await;
    let step0 = server
        .post("/v1/chat/completions", &greedy(&format!("{name}:step0")))
        .await;
    let step1 = server
        .post("/v1/chat/completions", &greedy(&format!("{name}:step1")))
        .await;
    let latest = server.post("/v1/chat/completions", &greedy(name)).await;
    assert_eq!(
        step0["choices"][0]["token_ids"],
        base["choices"][0]["token_ids"]
    );
    assert_eq!(logprobs(&step0), logprobs(&base));
    assert_eq!(step1["model"], format!("{name}:step1"));
    assert_eq!(logprobs(&latest), logprobs(&step1));
    let changed = logprobs(&step1)
        .iter()
        .zip(logprobs(&base))
        .any(|(a, b)| (a - b).abs() > 1e-4)
        || step1["choices"][0]["token_ids"] != base["choices"][0]["token_ids"];
    assert!(changed, "step 1 answers exactly as the base model");

    // One model, one set of numbers: the logprobs served for sampled tokens of step 1 are the
    // trainer's scores of the same tokens with the same adapter.
    let mean = served_vs_trainer(&server, name, &model, &data, &model_id).await;
    assert!(mean < 1e-3, "mean |diff| {mean}");
}

/// Mean |served logprob - trainer score| over sampled tokens of `<name>:step1`.
async fn served_vs_trainer(
    server: &Server,
    name: &str,
    model: &Path,
    data: &Path,
    model_id: &str,
) -> f64 {
    let sampled = server
        .post(
            "/v1/chat/completions",
            &json!({"model": format!("{name}:step1"), "messages": user("the cat sat"), "n": 4,
                "seed": 11, "temperature": 1.0, "max_tokens": 12, "logprobs": true,
                "return_token_ids": true}),
        )
        .await;
    let weights = temper_model::load_gguf(model).unwrap().model;
    let adapter = temper_model::LoraAdapter::load(
        &data
            .join("adapters")
            .join(model_id)
            .join("step-1.safetensors"),
        weights.config(),
    )
    .unwrap();
    let prompt: Vec<u32> = token_ids(&sampled["prompt_token_ids"]);
    let (mut diff, mut count) = (0.0, 0usize);
    for choice in sampled["choices"].as_array().unwrap() {
        let completion = token_ids(&choice["token_ids"]);
        let tokens: Vec<u32> = prompt.iter().chain(&completion).copied().collect();
        let scored: Vec<bool> = (0..tokens.len()).map(|i| i >= prompt.len()).collect();
        let scores = weights
            .score(
                &temper_model::PackedSequence {
                    tokens: &tokens,
                    segment_lens: &[tokens.len()],
                    scored: &scored,
                },
                Some(&adapter),
            )
            .unwrap();
        let served: Vec<f64> = choice["logprobs"]["content"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["logprob"].as_f64().unwrap())
            .collect();
        assert_eq!(served.len(), scores.logprobs.len());
        for (s, t) in served.iter().zip(&scores.logprobs) {
            diff += (s - f64::from(*t)).abs();
            count += 1;
        }
    }
    let mean = diff / count as f64;
    eprintln!(
        "served vs trainer logprobs of {name}:step1: mean |diff| {mean:.2e} over {count} tokens"
    );
    mean
}

fn token_ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_server_reruns_its_running_job_and_runs_the_queued_one() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let data = dir.path().join("data");
    // Short packed sequences: one optimizer step each, so the big job runs for many steps.
    let args = ["--max-train-seq-len", "64"];
    let mut server = Server::start(&model, &data, &args);
    let model_id = create_model(&server).await;
    let small = groups(&server, "default/proj/agent", PROMPTS).await;
    let running = post_long_job(&server, &model_id).await;
    let queued = post_job(&server, &model_id, &small).await;
    // Kill once the big job has made progress.
    wait_for_step_of_attempt(&server, &running, 1).await;
    let before = server
        .get(&format!("/v1/preview/training-jobs/{running}"))
        .await;
    assert_eq!(before["status"], "running");
    let queued_before = server
        .get(&format!("/v1/preview/training-jobs/{queued}"))
        .await;
    assert_eq!(queued_before["status"], "queued");
    server.kill();

    let server = Server::start(&model, &data, &args);
    for (job, step) in [(&running, 1), (&queued, 2)] {
        let done = server.wait_until_succeeded(job).await;
        assert_eq!(done["step"], step);
    }
    let kinds: Vec<String> = server
        .events(&running)
        .await
        .iter()
        .map(|e| e["type"].as_str().unwrap().to_owned())
        .collect();
    let requeued = kinds
        .iter()
        .position(|k| k == "training_requeued")
        .expect("requeued event");
    assert_eq!(kinds[0], "training_started");
    assert_eq!(kinds[requeued + 1], "training_started", "{kinds:?}");
    assert_eq!(kinds.last().unwrap(), "training_ended");
    assert_eq!(kinds.iter().filter(|k| *k == "training_ended").count(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_stops_a_running_job_and_equal_rewards_learn_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let data = dir.path().join("data");
    let server = Server::start(&model, &data, &["--max-train-seq-len", "64"]);
    let model_id = create_model(&server).await;
    let small = groups(&server, "default/proj/agent", PROMPTS).await;
    let job = post_long_job(&server, &model_id).await;
    wait_for_step_of_attempt(&server, &job, 1).await;
    let cancelled = server
        .post(
            &format!("/v1/preview/training-jobs/{job}/cancel"),
            &json!({}),
        )
        .await;
    assert_eq!(cancelled["status"], "cancelled");

    // Equal rewards in every group: the job ends with nothing learned and no checkpoint. It
    // runs after the cancelled one has stopped (one model's jobs run in order).
    let mut equal = small.clone();
    for g in equal.as_array_mut().unwrap() {
        for t in g["trajectories"].as_array_mut().unwrap() {
            t["reward"] = json!(0.5);
        }
    }
    let flat = post_job(&server, &model_id, &equal).await;
    let done = server.wait_until_succeeded(&flat).await;
    assert_eq!(done["step"], 0);
    let ended = server.events(&flat).await;
    let last = ended.last().unwrap();
    assert_eq!(last["type"], "training_ended");
    assert_eq!(last["data"]["step"], 0);
    assert!(last["data"]["message"]
        .as_str()
        .unwrap()
        .contains("nothing to learn"));

    // The cancelled job stopped between steps and made no checkpoint; its last event says so.
    let events = server.events(&job).await;
    assert_eq!(events.last().unwrap()["type"], "training_failed");
    let steps_after_cancel = events
        .iter()
        .skip_while(|e| e["type"] != "training_failed")
        .filter(|e| e["type"] == "gradient_step")
        .count();
    assert_eq!(steps_after_cancel, 0);
    assert_eq!(
        server
            .get(&format!("/v1/preview/training-jobs/{job}"))
            .await["status"],
        "cancelled"
    );
    let checkpoints = server
        .get(&format!("/v1/preview/models/{model_id}/checkpoints"))
        .await;
    assert_eq!(
        checkpoints["data"].as_array().unwrap().len(),
        1,
        "{checkpoints}"
    );
    assert!(!data
        .join("adapters")
        .join(&model_id)
        .join("step-1.safetensors")
        .exists());
}

/// The same agreement on the default model (reported in docs/how-it-works.md), through a real
/// job.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn default_model_served_logprobs_match_the_trainer() {
    let Some(model) = temper_model::paths::real_model_for_tests() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let base = "gemma-3-270m";
    let server = Server::start_named(base, &model, &data, &[]);
    let model_id = create_model_on(&server, base).await;
    let name = "default/proj/agent";
    let trajectory_groups = groups(&server, name, &["Hello"]).await;
    let job = server
        .post(
            "/v1/preview/training-jobs",
            &json!({"model_id": model_id, "trajectory_groups": trajectory_groups,
                "experimental_config": {"learning_rate": 1e-3}}),
        )
        .await;
    let done = server
        .wait_until_succeeded(job["id"].as_str().unwrap())
        .await;
    assert_eq!(done["step"], 1);
    let mean = served_vs_trainer(&server, name, &model, &data, &model_id).await;
    assert!(mean < 1e-3, "mean |diff| {mean}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_the_model_fails_its_running_job() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let data = dir.path().join("data");
    let server = Server::start(&model, &data, &["--max-train-seq-len", "64"]);
    let model_id = create_model(&server).await;
    let small = groups(&server, "default/proj/agent", PROMPTS).await;
    let job = post_long_job(&server, &model_id).await;
    server
        .wait_for_status(&job, &["running"], Duration::from_secs(60))
        .await;
    let (status, deleted) = server
        .call("DELETE", &format!("/v1/preview/models/{model_id}"), None)
        .await;
    assert_eq!(status, 200, "{deleted}");
    let failed = server
        .wait_for_status(&job, &["failed"], Duration::from_secs(10))
        .await;
    assert_eq!(failed["error"], "the model was deleted");
    // The worker stops it and moves on: a new model's job runs.
    let again = create_model(&server).await;
    let next = post_job(&server, &again, &small).await;
    server.wait_until_succeeded(&next).await;
    assert!(!data.join("adapters").join(&model_id).exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_server_on_the_same_data_dir_refuses_to_start_and_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let args = ["--max-train-seq-len", "64"];
    let RunningJob {
        model,
        data,
        server: mut first,
        job,
        ..
    } = start_with_a_running_job(dir.path(), &args).await;

    // The same data directory, another port: refused before the store is touched.
    let second = Command::new(env!("CARGO_BIN_EXE_temper"))
        .arg("serve")
        .args(["--port", "0", "--api-key", KEY])
        .arg("--model")
        .arg(format!("tiny={}", model.display()))
        .arg("--data-dir")
        .arg(&data)
        .args(args)
        .env_remove("TEMPER_CONFIG")
        .env_remove("TEMPER_STORE")
        .env("RUST_LOG", "warn")
        .output()
        .expect("run a second temper serve");
    let stderr = String::from_utf8_lossy(&second.stderr);
    assert!(!second.status.success(), "the second server started");
    assert!(second.stdout.is_empty(), "{:?}", second.stdout);
    let pid = first.child.id();
    assert!(
        stderr.contains(&format!(
            "the data directory {} is in use by another temper process (pid {pid})",
            data.display()
        )),
        "{stderr}"
    );
    assert_eq!(
        std::fs::read_to_string(data.join("temper.lock"))
            .unwrap()
            .trim(),
        pid.to_string()
    );

    // The first server's running job was not taken for a crashed one, and it keeps serving.
    let status = first.get(&format!("/v1/preview/training-jobs/{job}")).await;
    assert_eq!(status["status"], "running", "{status}");
    let kinds = event_types(&first.events(&job).await);
    assert!(!kinds.iter().any(|k| k == "training_requeued"), "{kinds:?}");
    let more_steps = kinds.iter().filter(|k| *k == "gradient_step").count();
    let start = Instant::now();
    while event_types(&first.events(&job).await)
        .iter()
        .filter(|k| *k == "gradient_step")
        .count()
        == more_steps
    {
        assert!(start.elapsed() < Duration::from_secs(60), "job stalled");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let chat = first
        .post(
            "/v1/chat/completions",
            &json!({"model": "tiny", "messages": user("Hello"), "max_tokens": 4}),
        )
        .await;
    assert!(chat["choices"][0]["message"]["content"].is_string());

    // `temper keys` does not take the lock (it runs no recovery; SQLite orders its writes with
    // the server's): a key made while the server runs authenticates there at once.
    let created = Command::new(env!("CARGO_BIN_EXE_temper"))
        .args(["keys", "create", "--team", "acme", "--data-dir"])
        .arg(&data)
        .env_remove("TEMPER_CONFIG")
        .env_remove("TEMPER_STORE")
        .output()
        .unwrap();
    assert!(created.status.success(), "{created:?}");
    let secret = String::from_utf8(created.stdout).unwrap().trim().to_owned();
    let models = first
        .client
        .get(format!("{}/v1/preview/models", first.base))
        .bearer_auth(&secret)
        .send()
        .await
        .unwrap();
    assert_eq!(models.status().as_u16(), 200);

    // A killed server's lock goes with it: a new server takes the directory over at once.
    first.kill();
    let third = Server::start(&model, &data, &args);
    assert_eq!(
        std::fs::read_to_string(data.join("temper.lock"))
            .unwrap()
            .trim(),
        third.child.id().to_string()
    );
    let kinds = event_types(&third.events(&job).await);
    assert!(kinds.iter().any(|k| k == "training_requeued"), "{kinds:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_running_at_three_crashes_in_a_row_fails_instead_of_looping() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let data = dir.path().join("data");
    let args = ["--max-train-seq-len", "64"];
    let mut server = Server::start(&model, &data, &args);
    let model_id = create_model(&server).await;
    let job = post_long_job(&server, &model_id).await;
    // Runs 1 and 2 are killed and re-queued at the next start; run 3 is killed too.
    for attempt in 1..=3 {
        wait_for_step_of_attempt(&server, &job, attempt).await;
        server.kill();
        if attempt == 3 {
            // What a save killed half-way leaves behind: removed at the next start.
            let stray = data
                .join("adapters")
                .join(&model_id)
                .join("step-1.safetensors.tmp");
            std::fs::create_dir_all(stray.parent().unwrap()).unwrap();
            std::fs::write(&stray, b"half an adapter").unwrap();
        }
        server = Server::start(&model, &data, &args);
    }

    // The default --max-job-attempts is 3: failed with a message, not re-queued again.
    let failed = server
        .get(&format!("/v1/preview/training-jobs/{job}"))
        .await;
    assert_eq!(failed["status"], "failed", "{failed}");
    let error = failed["error"].as_str().unwrap();
    assert!(
        error.contains("crashed or was killed 3 times in a row"),
        "{error}"
    );
    let events = server.events(&job).await;
    let kinds = event_types(&events);
    assert_eq!(
        kinds.iter().filter(|k| *k == "training_requeued").count(),
        2,
        "{kinds:?}"
    );
    assert_eq!(
        kinds.iter().filter(|k| *k == "training_started").count(),
        3,
        "{kinds:?}"
    );
    assert_eq!(kinds.last().unwrap(), "training_failed");
    assert_eq!(events.last().unwrap()["data"]["error_message"], error);
    let model_dir = data.join("adapters").join(&model_id);
    let leftovers: Vec<String> = std::fs::read_dir(&model_dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");

    // It stays failed, and the model's next job runs to a checkpoint, fsynced into place.
    let small = groups(&server, "default/proj/agent", PROMPTS).await;
    let next = post_job(&server, &model_id, &small).await;
    let done = server.wait_until_succeeded(&next).await;
    assert_eq!(done["step"], 1);
    let files: Vec<String> = std::fs::read_dir(&model_dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(files, ["step-1.safetensors"]);
    assert_eq!(
        server
            .get(&format!("/v1/preview/training-jobs/{job}"))
            .await["status"],
        "failed"
    );
}

/// (name, nice value) of each thread of a process, from /proc/<pid>/task/<tid>/stat.
#[cfg(target_os = "linux")]
fn threads_of(pid: &str) -> Vec<(String, i32)> {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .filter_map(|task| {
            let stat = std::fs::read_to_string(task.ok()?.path().join("stat")).ok()?;
            let (head, rest) = stat.rsplit_once(')')?;
            let name = head.split_once('(')?.1.to_owned();
            // Field 19 is the nice value; `rest` starts at field 3.
            let nice = rest.split_whitespace().nth(16)?.parse().ok()?;
            Some((name, nice))
        })
        .collect()
}

#[cfg(target_os = "linux")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_trainer_runs_on_its_own_threads_at_a_lower_priority() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let server = Server::start(
        &model,
        &dir.path().join("data"),
        &["--train-threads", "3", "--train-nice", "7"],
    );
    // The server inherits this process's nice value; its trainer threads are 7 above it.
    let ours = threads_of("self")[0].1;
    let want = (ours + 7).min(19);
    let pid = server.child.id().to_string();
    let threads = threads_of(&pid);
    let mut trainers: Vec<(String, i32)> = threads
        .iter()
        .filter(|(name, _)| name.starts_with("temper-train-"))
        .cloned()
        .collect();
    trainers.sort();
    let want_trainers: Vec<(String, i32)> = (0..3)
        .map(|i| (format!("temper-train-{i}"), want))
        .collect();
    assert_eq!(trainers, want_trainers);
    // Serving keeps the server's priority.
    assert!(
        threads
            .iter()
            .filter(|(name, _)| !name.starts_with("temper-train-"))
            .all(|&(_, nice)| nice == ours),
        "{threads:?}"
    );

    // Jobs run on them.
    let model_id = create_model(&server).await;
    let trajectory_groups = groups(&server, "default/proj/agent", PROMPTS).await;
    let job = post_job(&server, &model_id, &trajectory_groups).await;
    assert_eq!(server.wait_until_succeeded(&job).await["step"], 1);
}
