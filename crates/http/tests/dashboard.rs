//! `GET /dashboard`: the page is served without a key, and every route its script reads answers
//! (with the key) the fields it reads, after a real job on the tiny model. The page's behaviour
//! in a browser is scripts/dashboard-test.sh's (headless Chromium on the default model).

mod common;

use std::time::{Duration, Instant};

use common::TestServer;
use serde_json::{json, Value};

async fn get(server: &TestServer, path: &str) -> Value {
    let resp = server.get(path).await;
    let status = resp.status().as_u16();
    let v: Value = resp.json().await.unwrap();
    assert_eq!(status, 200, "GET {path}: {v}");
    v
}

#[tokio::test]
async fn page_is_public_and_the_routes_it_reads_answer_what_it_reads() {
    let data = tempfile::tempdir().unwrap();
    let server = TestServer::tiny_training_in(data.path()).await;
    server.state.training().unwrap().spawn_worker().unwrap();

    // The page: no key needed, HTML, confined to this server.
    let resp = server
        .client
        .get(server.url("/dashboard"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    let headers = resp.headers().clone();
    assert_eq!(headers["content-type"], "text/html; charset=utf-8");
    let csp = headers["content-security-policy"].to_str().unwrap();
    assert!(
        csp.contains("connect-src 'self'") && csp.contains("default-src 'none'"),
        "{csp}"
    );
    let page = resp.text().await.unwrap();
    assert!(page.starts_with("<!doctype html>"), "{}", &page[..100]);
    // What the script fetches; each is called below as the page calls it.
    for route in [
        "\"/v1/preview/models\"",
        "\"/v1/models\"",
        "/v1/preview/models/${id}/checkpoints?order=asc",
        "/v1/preview/training-jobs?model_id=${id}",
        "/v1/preview/training-jobs/${encodeURIComponent(job.id)}/events?limit=${PAGE_LIMIT}",
        "const PAGE_LIMIT = 100;",
    ] {
        assert!(page.contains(route), "the page no longer reads {route}");
    }
    let post = server
        .client
        .post(server.url("/dashboard"))
        .send()
        .await
        .unwrap();
    assert_eq!(post.status().as_u16(), 405);

    // Without a key the data routes are the 401 whose message the page shows.
    let resp = server
        .client
        .get(server.url("/v1/preview/models"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 401);
    let err: Value = resp.json().await.unwrap();
    assert!(
        err["error"]["message"]
            .as_str()
            .unwrap()
            .starts_with("Missing API key"),
        "{err}"
    );

    // A model with one SFT checkpoint and a `/log`.
    let model = server
        .post_ok(
            "/v1/preview/models",
            &json!({"project": "dash", "name": "m", "base_model": "tiny"}),
        )
        .await;
    let id = model["id"].as_str().unwrap();
    let turn = |q: &str, a: &str| json!({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]});
    let job = server
        .post_ok(
            "/v1/preview/sft-training-jobs",
            &json!({"model_id": id, "trajectories": [turn("hi", "hello"), turn("bye", "ciao")]}),
        )
        .await;
    let job_id = job["id"].as_str().unwrap();
    let start = Instant::now();
    let job = loop {
        let j = get(&server, &format!("/v1/preview/training-jobs/{job_id}")).await;
        if j["status"] == "succeeded" {
            break j;
        }
        assert!(j["status"] == "queued" || j["status"] == "running", "{j}");
        assert!(start.elapsed() < Duration::from_secs(300), "{j}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let log = json!({"model_id": id, "split": "val",
        "trajectory_groups": [{"trajectories": [{"reward": 1.0}, {"reward": 0.0}]}]});
    server
        .post_ok(&format!("/v1/preview/models/{id}/log"), &log)
        .await;

    let models = get(&server, "/v1/preview/models").await;
    let m = &models["data"][0];
    for field in ["id", "entity", "project", "name", "base_model"] {
        assert!(m[field].is_string(), "{field}: {m}");
    }
    let name = format!("{}/{}/{}", m["entity"].as_str().unwrap(), "dash", "m");

    let checkpoints = get(
        &server,
        &format!("/v1/preview/models/{id}/checkpoints?order=asc&limit=100"),
    )
    .await;
    assert_eq!(checkpoints["has_more"], false);
    let data = checkpoints["data"].as_array().unwrap();
    assert_eq!(
        data.iter()
            .map(|c| c["step"].as_i64().unwrap())
            .collect::<Vec<_>>(),
        [0, 1]
    );
    assert!(data[1]["metrics"]["loss"].is_number(), "{}", data[1]);
    assert_eq!(data[1]["metrics"]["val/reward"], 0.5, "{}", data[1]);
    assert_eq!(checkpoints["last_id"], data[1]["id"]);

    let jobs = get(
        &server,
        &format!("/v1/preview/training-jobs?model_id={id}&limit=100"),
    )
    .await;
    assert_eq!(jobs["data"], json!([job]));
    assert_eq!(
        (&job["kind"], &job["step"], &job["error"]),
        (&json!("sft"), &json!(1), &Value::Null)
    );
    for field in ["created_at", "started_at", "finished_at"] {
        assert!(job[field].is_i64(), "{field}: {job}");
    }

    let events = get(
        &server,
        &format!("/v1/preview/training-jobs/{job_id}/events?limit=100"),
    )
    .await;
    assert_eq!(events["has_more"], false);
    let events = events["data"].as_array().unwrap();
    let types: Vec<&str> = events.iter().map(|e| e["type"].as_str().unwrap()).collect();
    assert_eq!(
        types,
        ["training_started", "gradient_step", "training_ended"]
    );
    assert!(events[1]["data"]["loss"].is_number(), "{}", events[1]);
    assert!(events
        .iter()
        .all(|e| e["id"].is_i64() && e["created_at"].is_i64()));
    let after = events[0]["id"].as_i64().unwrap();
    let rest = get(
        &server,
        &format!("/v1/preview/training-jobs/{job_id}/events?limit=100&after={after}"),
    )
    .await;
    assert_eq!(rest["data"].as_array().unwrap()[..], events[1..]);

    // A checkpoint's creation time: its card in the OpenAI model list.
    let served = get(&server, "/v1/models").await;
    let card = served["data"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["id"] == format!("{name}:step1"))
        .unwrap_or_else(|| panic!("no card for {name}:step1: {served}"));
    assert!(card["created"].as_u64().unwrap() > 0, "{card}");
}
