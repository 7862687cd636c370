//! `GET /metrics` through real HTTP on the tiny model: vLLM's serving series add up to what the
//! responses reported, and the training series count a job the worker ran.

mod common;

use std::time::{Duration, Instant};

use common::{options, TestServer};
use serde_json::{json, Value};

/// The scraped text, after checking the answer's status and content type.
async fn scrape(server: &TestServer) -> String {
    let resp = server.get("/metrics").await;
    assert_eq!(resp.status().as_u16(), 200);
    assert_eq!(
        resp.headers()["content-type"].to_str().unwrap(),
        "text/plain; version=0.0.4; charset=utf-8"
    );
    resp.text().await.unwrap()
}

/// The value of the sample written exactly as `series` (name and labels).
fn value(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("no sample {series} in:\n{text}"))
}

fn user(text: &str) -> Value {
    json!([{"role": "user", "content": text}])
}

#[tokio::test]
async fn serving_series_add_up_to_the_responses() {
    let s = TestServer::tiny(options(), None).await;
    let anonymous = s.client.get(s.url("/metrics")).send().await.unwrap();
    assert_eq!(anonymous.status().as_u16(), 401);
    let before = scrape(&s).await;
    let m = "{model_name=\"tiny\"}";
    assert_eq!(value(&before, &format!("vllm:prompt_tokens_total{m}")), 0.0);
    assert_eq!(
        value(
            &before,
            &format!("vllm:time_to_first_token_seconds_count{m}")
        ),
        0.0
    );

    let (status, one) = s
        .chat(
            &json!({"model": "tiny", "messages": user("hello there"), "n": 2,
                      "max_tokens": 5, "ignore_eos": true}),
        )
        .await;
    assert_eq!(status, 200, "{one}");
    let events = s
        .chat_stream(
            &json!({"model": "tiny", "messages": user("and again"), "max_tokens": 3,
                             "ignore_eos": true, "stream": true,
                             "stream_options": {"include_usage": true}}),
        )
        .await;
    let two = events
        .iter()
        .find(|e| e["usage"].is_object())
        .expect("a usage chunk");
    s.wait_idle(Duration::from_secs(30)).await;

    let text = scrape(&s).await;
    let usage = |field: &str| {
        (one["usage"][field].as_u64().unwrap() + two["usage"][field].as_u64().unwrap()) as f64
    };
    assert_eq!(
        value(&text, &format!("vllm:prompt_tokens_total{m}")),
        usage("prompt_tokens")
    );
    assert_eq!(
        value(&text, &format!("vllm:generation_tokens_total{m}")),
        usage("completion_tokens")
    );
    for h in ["time_to_first_token_seconds", "e2e_request_latency_seconds"] {
        assert_eq!(value(&text, &format!("vllm:{h}_count{m}")), 2.0, "{h}");
        assert_eq!(
            value(
                &text,
                &format!("vllm:{h}_bucket{{model_name=\"tiny\",le=\"+Inf\"}}")
            ),
            2.0
        );
        assert!(value(&text, &format!("vllm:{h}_sum{m}")) > 0.0);
    }
    let finished = |reason: &str| {
        value(
            &text,
            &format!(
                "vllm:request_success_total{{model_name=\"tiny\",finished_reason=\"{reason}\"}}"
            ),
        )
    };
    assert_eq!((finished("length"), finished("stop")), (3.0, 0.0));
    assert_eq!(value(&text, &format!("vllm:num_requests_running{m}")), 0.0);
    assert_eq!(value(&text, &format!("vllm:num_requests_waiting{m}")), 0.0);
    let kv = value(&text, &format!("vllm:kv_cache_usage_perc{m}"));
    assert!((0.0..=1.0).contains(&kv), "{kv}");
    assert!(value(&text, &format!("temper:model_weight_bytes{m}")) > 0.0);
    assert!(value(&text, &format!("temper:kv_cache_capacity_bytes{m}")) > 0.0);
    assert!(
        !text.contains("temper:training_jobs"),
        "no training series without the training service"
    );
}

#[tokio::test]
async fn training_series_count_a_finished_job() {
    let data = tempfile::tempdir().unwrap();
    let s = TestServer::tiny_training_in(data.path()).await;
    s.state.training().unwrap().spawn_worker().unwrap();
    let text = scrape(&s).await;
    assert_eq!(
        value(&text, "temper:training_jobs{status=\"succeeded\"}"),
        0.0
    );
    assert_eq!(value(&text, "temper:gradient_steps_total"), 0.0);

    let model = s
        .post_ok(
            "/v1/preview/models",
            &json!({"project": "p", "name": "m", "base_model": "tiny"}),
        )
        .await;
    let line = json!({"messages": [{"role": "user", "content": "hi"},
                                   {"role": "assistant", "content": "hello"}]});
    let job = s
        .post_ok(
            "/v1/preview/sft-training-jobs",
            &json!({"model_id": model["id"], "trajectories": [line],
                    "config": {"learning_rate": 1e-3}}),
        )
        .await;
    let id = job["id"].as_str().expect("job id");
    let start = Instant::now();
    let events = loop {
        let page: Value = s
            .get(&format!("/v1/preview/training-jobs/{id}/events?limit=100"))
            .await
            .json()
            .await
            .unwrap();
        let events = page["data"].as_array().unwrap().clone();
        if events.iter().any(|e| e["type"] == "training_ended") {
            break events;
        }
        assert!(start.elapsed() < Duration::from_secs(120), "{page}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let tokens: u64 = events
        .iter()
        .filter(|e| e["type"] == "gradient_step")
        .map(|e| e["data"]["num_trainable_tokens"].as_u64().unwrap())
        .sum();
    // The job's status is written with its last event; wait for the store to say succeeded.
    let start = Instant::now();
    let text = loop {
        let text = scrape(&s).await;
        if value(&text, "temper:training_jobs{status=\"succeeded\"}") == 1.0 {
            break text;
        }
        assert!(start.elapsed() < Duration::from_secs(30), "{text}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(value(&text, "temper:training_jobs{status=\"queued\"}"), 0.0);
    assert_eq!(value(&text, "temper:gradient_steps_total"), 1.0);
    assert_eq!(value(&text, "temper:trained_tokens_total"), tokens as f64);
    assert!(tokens > 0);
    assert_eq!(
        value(&text, "temper:training_job_duration_seconds_count"),
        1.0
    );
}
