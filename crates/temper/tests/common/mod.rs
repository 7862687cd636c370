//! What the binary's end-to-end tests share: a `temper serve` child process on the tiny model, and
//! the rollouts, groups and jobs they post.
#![allow(dead_code)] // each test binary uses its own subset

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

pub const KEY: &str = "test-key";

/// A `temper serve` child process on an ephemeral port.
pub struct Server {
    pub child: Child,
    pub base: String,
    pub client: reqwest::Client,
}

impl Server {
    pub fn start(model: &Path, data_dir: &Path, extra: &[&str]) -> Server {
        Self::start_named("tiny", model, data_dir, extra)
    }

    pub fn start_named(name: &str, model: &Path, data_dir: &Path, extra: &[&str]) -> Server {
        let mut child = Command::new(env!("CARGO_BIN_EXE_temper"))
            .arg("serve")
            .args(["--port", "0", "--api-key", KEY])
            .arg("--model")
            .arg(format!("{name}={}", model.display()))
            .arg("--data-dir")
            .arg(data_dir)
            .args(extra)
            .env_remove("TEMPER_CONFIG")
            .env_remove("TEMPER_STORE")
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start temper serve");
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let mut first = String::new();
        stdout.read_line(&mut first).unwrap();
        // Keep reading: a closed pipe would make the server's next print fail.
        std::thread::spawn(move || std::io::copy(&mut stdout, &mut std::io::sink()));
        // "temper serving tiny at http://127.0.0.1:PORT/v1"
        let url = first
            .split_whitespace()
            .find(|w| w.starts_with("http://"))
            .unwrap_or_else(|| panic!("no URL in {first:?}"));
        Server {
            child,
            base: url.trim_end_matches("/v1").to_owned(),
            client: reqwest::Client::new(),
        }
    }

    pub async fn call(&self, method: &str, path: &str, body: Option<&Value>) -> (u16, Value) {
        let mut req = self
            .client
            .request(method.parse().unwrap(), format!("{}{path}", self.base))
            .bearer_auth(KEY);
        if let Some(body) = body {
            req = req.json(body);
        }
        let resp = req.send().await.unwrap();
        let status = resp.status().as_u16();
        (status, resp.json().await.unwrap())
    }

    pub async fn post(&self, path: &str, body: &Value) -> Value {
        let (status, v) = self.call("POST", path, Some(body)).await;
        assert_eq!(status, 200, "POST {path}: {v}");
        v
    }

    pub async fn get(&self, path: &str) -> Value {
        let (status, v) = self.call("GET", path, None).await;
        assert_eq!(status, 200, "GET {path}: {v}");
        v
    }

    /// Every event of a job so far, following the `after` cursor.
    pub async fn events(&self, job: &str) -> Vec<Value> {
        let mut all = Vec::new();
        let mut after = 0;
        loop {
            let page = self
                .get(&format!(
                    "/v1/preview/training-jobs/{job}/events?after={after}&limit=100"
                ))
                .await;
            let data = page["data"].as_array().unwrap().clone();
            if let Some(last) = data.last() {
                after = last["id"].as_i64().unwrap();
            }
            all.extend(data);
            if page["has_more"] != true {
                return all;
            }
        }
    }

    pub async fn wait_for_status(&self, job: &str, want: &[&str], within: Duration) -> Value {
        let start = Instant::now();
        loop {
            let j = self.get(&format!("/v1/preview/training-jobs/{job}")).await;
            if want.contains(&j["status"].as_str().unwrap()) {
                return j;
            }
            assert!(start.elapsed() < within, "job {job} still {}", j["status"]);
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Sends `signal` ("TERM", "INT") to the server process, as `kill -TERM <pid>` does.
    /// Waits for the job to end (up to 15 minutes: the default model's jobs are slow on two
    /// cores) and returns it; fails the test unless it succeeded.
    pub async fn wait_until_succeeded(&self, job: &str) -> Value {
        let done = self
            .wait_for_status(
                job,
                &["succeeded", "failed", "cancelled"],
                Duration::from_secs(900),
            )
            .await;
        assert_eq!(done["status"], "succeeded", "job {job}: {done}");
        done
    }

    pub fn signal(&self, signal: &str) {
        let status = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(self.child.id().to_string())
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -{signal}: {status}");
    }

    /// Waits for the process to exit on its own; `None` if it still runs after `within`.
    pub fn wait_for_exit(&mut self, within: Duration) -> Option<ExitStatus> {
        let start = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return Some(status);
            }
            if start.elapsed() > within {
                return None;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    pub fn kill(&mut self) {
        // SIGKILL: no shutdown code runs.
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn tiny_model(dir: &Path) -> PathBuf {
    let path = dir.join("tiny.gguf");
    temper_model::tiny::write_tiny_gguf(&path, 7).unwrap();
    path
}

pub fn user(text: &str) -> Value {
    json!([{"role": "user", "content": text}])
}

/// `n` sampled completions of `prompt` with logprobs and token ids, as training.md's rollout.
pub async fn rollout(server: &Server, model: &str, prompt: &str, n: usize, seed: u64) -> Value {
    server
        .post(
            "/v1/chat/completions",
            &json!({"model": model, "messages": user(prompt), "n": n, "seed": seed,
                "temperature": 1.0, "max_tokens": 8, "logprobs": true,
                "return_tokens_as_token_ids": true}),
        )
        .await
}

/// One group per prompt: each choice a trajectory rewarded by whether its first sampled token
/// id is even (a behaviour the model can learn), so rewards differ within the group.
pub async fn groups(server: &Server, model: &str, prompts: &[&str]) -> Value {
    let mut groups = Vec::new();
    for (i, prompt) in prompts.iter().enumerate() {
        let completion = rollout(server, model, prompt, 4, i as u64).await;
        let trajectories: Vec<Value> = completion["choices"]
            .as_array()
            .unwrap()
            .iter()
            .enumerate()
            .map(|(j, choice)| {
                let first = choice["logprobs"]["content"][0]["token"].as_str().unwrap();
                let id: u32 = first.strip_prefix("token_id:").unwrap().parse().unwrap();
                // Reward the even first tokens; break ties so no group is all equal.
                let reward = if id.is_multiple_of(2) { 1.0 } else { 0.0 } + j as f64 * 1e-3;
                json!({"messages_and_choices": [user(prompt)[0].clone(), choice], "reward": reward})
            })
            .collect();
        groups.push(json!({"trajectories": trajectories}));
    }
    Value::Array(groups)
}

pub async fn create_model(server: &Server) -> String {
    create_model_on(server, "tiny").await
}

pub async fn create_model_on(server: &Server, base: &str) -> String {
    let model = server
        .post(
            "/v1/preview/models",
            &json!({"project": "proj", "name": "agent", "base_model": base}),
        )
        .await;
    model["id"].as_str().unwrap().to_owned()
}

pub const PROMPTS: &[&str] = &["Hello", "the cat sat", "what is the capital of France"];
/// Posts a job long enough to be caught running and still run while a test acts on it (many
/// one-step packed sequences with `--max-train-seq-len 64`); returns its id. About 10 s on this
/// project's host; 40 copies (0.5 s) once ended before a test's next request in CI, so keep a
/// wide margin as the trainer gets faster.
pub async fn post_long_job(server: &Server, model_id: &str) -> String {
    let small = groups(server, "default/proj/agent", PROMPTS).await;
    let big: Vec<Value> = (0..800)
        .flat_map(|_| small.as_array().unwrap().iter().cloned())
        .collect();
    post_job(server, model_id, &big).await
}

/// Waits until the job's `attempt`-th run (its `attempt`-th `training_started`) has made a
/// gradient step.
pub async fn wait_for_step_of_attempt(server: &Server, job: &str, attempt: usize) {
    let start = Instant::now();
    loop {
        let events = server.events(job).await;
        let runs: Vec<usize> = events
            .iter()
            .enumerate()
            .filter(|(_, e)| e["type"] == "training_started")
            .map(|(i, _)| i)
            .collect();
        if runs.len() == attempt
            && events[runs[attempt - 1]..]
                .iter()
                .any(|e| e["type"] == "gradient_step")
        {
            return;
        }
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "no gradient step in run {attempt} of job {job}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

pub fn event_types(events: &[Value]) -> Vec<String> {
    events
        .iter()
        .map(|e| e["type"].as_str().unwrap().to_owned())
        .collect()
}

/// Posts a training job of `groups` for `model_id`; returns the job's id.
pub async fn post_job(server: &Server, model_id: &str, groups: &impl serde::Serialize) -> String {
    server
        .post(
            "/v1/preview/training-jobs",
            &json!({"model_id": model_id, "trajectory_groups": groups}),
        )
        .await["id"]
        .as_str()
        .unwrap()
        .to_owned()
}

/// A server on a fresh data directory with a long job caught running (its first run has made a
/// gradient step): where crash, lock and shutdown tests start.
pub struct RunningJob {
    pub model: PathBuf,
    pub data: PathBuf,
    pub server: Server,
    pub model_id: String,
    pub job: String,
}

/// [`RunningJob`] under `dir`, the server started with `args`.
pub async fn start_with_a_running_job(dir: &Path, args: &[&str]) -> RunningJob {
    let model = tiny_model(dir);
    let data = dir.join("data");
    let server = Server::start(&model, &data, args);
    let model_id = create_model(&server).await;
    let job = post_long_job(&server, &model_id).await;
    wait_for_step_of_attempt(&server, &job, 1).await;
    RunningJob {
        model,
        data,
        server,
        model_id,
        job,
    }
}
