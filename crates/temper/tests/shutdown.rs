//! Graceful shutdown through the built binary on the tiny model: the first SIGTERM stops
//! accepting, lets a stream finish and re-queues the running training job (its attempt given
//! back) before the process exits; `--shutdown-timeout` bounds the wait; a second signal exits
//! at once.

mod common;

use std::time::{Duration, Instant};

use serde_json::{json, Value};

use common::*;

/// Starts a streamed completion of `max_tokens` tokens from the base model (`n` choices).
async fn start_stream(server: &Server, max_tokens: usize, n: usize) -> reqwest::Response {
    let response = server
        .client
        .post(format!("{}/v1/chat/completions", server.base))
        .bearer_auth(KEY)
        .json(&json!({"model": "tiny", "messages": user("hello"), "n": n,
            "max_completion_tokens": max_tokens, "ignore_eos": true, "stream": true,
            "stream_options": {"include_usage": true}}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 200);
    response
}

/// The `data:` payloads of a server-sent event stream.
fn sse_data(text: &str) -> Vec<&str> {
    text.split("\n\n")
        .filter_map(|event| event.strip_prefix("data: "))
        .collect()
}

/// Whether a new connection to the server fails (refused, or closed without an answer).
async fn refuses_new_connections(server: &Server) -> bool {
    reqwest::Client::new()
        .get(format!("{}/health", server.base))
        .timeout(Duration::from_secs(2))
        .send()
        .await
        .is_err()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_finishes_the_stream_requeues_the_job_and_exits() {
    let dir = tempfile::tempdir().unwrap();
    // At 2 attempts, a shutdown counted as an attempt would fail the job at the crash below.
    let args = ["--max-train-seq-len", "64", "--max-job-attempts", "2"];
    let RunningJob {
        model,
        data,
        mut server,
        job,
        ..
    } = start_with_a_running_job(dir.path(), &args).await;

    // Some 250 ms of decoding on this host: still running when the signal arrives.
    let max_tokens = 1000;
    let mut stream = start_stream(&server, max_tokens, 1).await;
    let mut text = String::from_utf8(stream.chunk().await.unwrap().unwrap().to_vec()).unwrap();
    let signalled = Instant::now();
    server.signal("TERM");
    // The listener closes as soon as the server has the signal, while the stream still runs.
    while !refuses_new_connections(&server).await {
        assert!(
            signalled.elapsed() < Duration::from_secs(5),
            "still accepting"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    while let Some(chunk) = stream.chunk().await.unwrap() {
        text.push_str(std::str::from_utf8(&chunk).unwrap());
    }
    let events = sse_data(&text);
    assert_eq!(events.last(), Some(&"[DONE]"), "{text}");
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    let usage = &chunks.last().unwrap()["usage"];
    assert_eq!(usage["completion_tokens"], max_tokens, "{usage}");
    assert!(chunks
        .iter()
        .any(|c| c["choices"][0]["finish_reason"] == "length"));
    let status = server
        .wait_for_exit(Duration::from_secs(30))
        .expect("exits within the timeout");
    assert_eq!(status.code(), Some(0), "{status}");
    // The stream's usage (the only request to the base model by name) was stored before the
    // process ended.
    let store = temper_store::Store::open(&data).await.unwrap();
    let base: Vec<_> = store
        .usage_rows("default", 0, i64::MAX)
        .await
        .unwrap()
        .into_iter()
        .filter(|r| r.model == "tiny")
        .collect();
    store.close().await;
    assert_eq!(base.len(), 1, "{base:?}");
    assert_eq!(
        (
            base[0].counts.num_model_requests,
            base[0].counts.output_tokens
        ),
        (1, max_tokens as u64)
    );

    // Re-queued with its event and run again from its start; the shutdown was no attempt, so the
    // crash of the second run leaves it one attempt short of the limit: re-queued again.
    let mut server = Server::start(&model, &data, &args);
    let kinds = event_types(&server.events(&job).await);
    assert!(
        kinds.iter().any(|k| k == "training_requeued_at_shutdown"),
        "{kinds:?}"
    );
    wait_for_step_of_attempt(&server, &job, 2).await;
    server.kill();
    let server = Server::start(&model, &data, &args);
    let done = server.wait_until_succeeded(&job).await;
    assert_eq!(done["step"], 1);
    let kinds = event_types(&server.events(&job).await);
    let ends: Vec<&str> = kinds
        .iter()
        .map(String::as_str)
        .filter(|k| !matches!(*k, "training_started" | "gradient_step"))
        .collect();
    assert_eq!(
        ends,
        [
            "training_requeued_at_shutdown",
            "training_requeued",
            "training_ended"
        ]
    );
    assert_eq!(
        kinds.iter().filter(|k| *k == "training_started").count(),
        3,
        "{kinds:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_longer_than_the_shutdown_timeout_is_cut() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let mut server = Server::start(
        &model,
        &dir.path().join("data"),
        &["--shutdown-timeout", "1"],
    );
    // Never read past its first chunk: its 6 MB (some 6 s of decoding here) cannot all fit in
    // the sockets' buffers.
    let mut stream = start_stream(&server, 1900, 16).await;
    stream.chunk().await.unwrap().unwrap();
    let signalled = Instant::now();
    server.signal("TERM");
    let status = server
        .wait_for_exit(Duration::from_secs(10))
        .expect("exits after the timeout");
    let exited_after = signalled.elapsed();
    assert!(
        (Duration::from_secs(1)..Duration::from_secs(4)).contains(&exited_after),
        "{exited_after:?}"
    );
    assert_eq!(status.code(), Some(1), "{status}");
    drop(stream);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_signal_exits_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let args = ["--max-train-seq-len", "64"];
    let RunningJob {
        model,
        data,
        mut server,
        job,
        ..
    } = start_with_a_running_job(dir.path(), &args).await;
    // A stream that cannot finish keeps the first signal's shutdown waiting.
    let mut stream = start_stream(&server, 1900, 16).await;
    stream.chunk().await.unwrap().unwrap();
    server.signal("TERM");
    let signalled = Instant::now();
    while !refuses_new_connections(&server).await {
        assert!(
            signalled.elapsed() < Duration::from_secs(5),
            "still accepting"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(server.wait_for_exit(Duration::ZERO).is_none(), "waits");
    let signalled = Instant::now();
    server.signal("INT");
    let status = server
        .wait_for_exit(Duration::from_secs(2))
        .expect("exits at once");
    assert!(signalled.elapsed() < Duration::from_secs(1));
    assert_eq!(status.code(), Some(130), "{status}");
    drop(stream);

    // Back in the queue at the next start: re-queued by the first signal once its trainer
    // stopped, or (had the second come first) by the start-up recovery as after a crash.
    let server = Server::start(&model, &data, &args);
    let kinds = event_types(&server.events(&job).await);
    let requeues = kinds
        .iter()
        .filter(|k| {
            matches!(
                k.as_str(),
                "training_requeued_at_shutdown" | "training_requeued"
            )
        })
        .count();
    assert_eq!(requeues, 1, "{kinds:?}");
    assert_ne!(
        server
            .get(&format!("/v1/preview/training-jobs/{job}"))
            .await["status"],
        "failed"
    );
}
