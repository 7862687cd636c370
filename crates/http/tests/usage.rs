//! Usage accounting through real HTTP on the tiny model: `GET /v1/usage` against the `usage`
//! of the responses (plain, streamed with and without `include_usage`, n > 1, cancelled),
//! projects and teams kept apart, trained tokens of a training job, monthly quotas (429s) and
//! the query's validation.

mod common;

use std::time::{Duration, Instant};

use common::{check_stream, options, TestServer, KEY};
use futures_util::StreamExt;
use serde_json::{json, Value};

async fn server() -> (TestServer, tempfile::TempDir) {
    let data = tempfile::tempdir().unwrap();
    let server = TestServer::tiny_training_in(data.path()).await;
    (server, data)
}

fn store(server: &TestServer) -> &temper_store::Store {
    &server.state.training().unwrap().store
}

fn now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
}

fn user(text: &str) -> Value {
    json!([{"role": "user", "content": text}])
}

/// A chat completion as `key`, under `project` (the `OpenAI-Project` header) when given.
async fn chat(
    server: &TestServer,
    key: &str,
    project: Option<&str>,
    body: &Value,
) -> reqwest::Response {
    let mut req = server
        .client
        .post(server.url("/v1/chat/completions"))
        .bearer_auth(key)
        .json(body);
    if let Some(p) = project {
        req = req.header("OpenAI-Project", p);
    }
    req.send().await.unwrap()
}

async fn chat_ok(server: &TestServer, key: &str, project: Option<&str>, body: &Value) -> Value {
    let resp = chat(server, key, project, body).await;
    assert_eq!(resp.status().as_u16(), 200);
    resp.json().await.unwrap()
}

async fn stream_ok(server: &TestServer, project: Option<&str>, body: &Value) -> Vec<Value> {
    let resp = chat(server, KEY, project, body).await;
    assert_eq!(resp.status().as_u16(), 200);
    common::parse_sse(&resp.text().await.unwrap())
}

/// `GET /v1/usage?<query>` as `key`: status and body.
async fn usage(server: &TestServer, key: &str, query: &str) -> (u16, Value) {
    let resp = server
        .client
        .get(server.url(&format!("/v1/usage?{query}")))
        .bearer_auth(key)
        .send()
        .await
        .unwrap();
    (resp.status().as_u16(), resp.json().await.unwrap())
}

/// The results of the last hour's usage (start an hour back, so a day boundary can split it),
/// summed per (project_id, model) over the buckets.
async fn results(server: &TestServer, key: &str, group_by: &str) -> Vec<Value> {
    let query = format!("start={}&bucket_width=1h&group_by={group_by}", now() - 3600);
    let (status, page) = usage(server, key, &query).await;
    assert_eq!(status, 200, "{page}");
    assert_eq!(page["object"], "page");
    assert_eq!(page["has_more"], false);
    let mut sums: Vec<Value> = Vec::new();
    for bucket in page["data"].as_array().unwrap() {
        assert_eq!(bucket["object"], "bucket");
        assert_eq!(
            bucket["end_time"].as_i64().unwrap() - bucket["start_time"].as_i64().unwrap(),
            3600
        );
        for r in bucket["results"].as_array().unwrap() {
            let same =
                |s: &&mut Value| s["project_id"] == r["project_id"] && s["model"] == r["model"];
            match sums.iter_mut().find(same) {
                Some(sum) => {
                    for field in COUNTERS {
                        sum[field] =
                            json!(sum[field].as_u64().unwrap() + r[field].as_u64().unwrap());
                    }
                }
                None => sums.push(r.clone()),
            }
        }
    }
    sums
}

const COUNTERS: [&str; 6] = [
    "input_tokens",
    "input_cached_tokens",
    "output_tokens",
    "num_model_requests",
    "trained_tokens",
    "num_gradient_steps",
];

/// A result's counters as `[input, cached, output, requests, trained, steps]`.
fn counters(result: &Value) -> [u64; 6] {
    COUNTERS.map(|f| {
        result[f]
            .as_u64()
            .unwrap_or_else(|| panic!("{f}: {result}"))
    })
}

/// The counters chat completions' `usage`s add.
fn chat_counters(usages: &[&Value]) -> [u64; 6] {
    let mut sum = [0, 0, 0, usages.len() as u64, 0, 0];
    for u in usages {
        sum[0] += u["prompt_tokens"].as_u64().unwrap();
        sum[1] += u["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap();
        sum[2] += u["completion_tokens"].as_u64().unwrap();
    }
    sum
}

fn find<'a>(results: &'a [Value], project: &str) -> &'a Value {
    results
        .iter()
        .find(|r| r["project_id"] == project)
        .unwrap_or_else(|| panic!("no project {project}: {results:?}"))
}

#[tokio::test]
async fn counts_equal_the_responses_usage_per_project_and_team() {
    let (server, _data) = server().await;
    let (_, acme) = store(&server).create_key("acme").await.unwrap();

    // Project `agents`: streamed without include_usage (its tokens counted from their ids; the
    // first request, so nothing of its prompt is cached), n = 3, streamed with include_usage
    // (n = 2), and one that fails validation (counts nothing).
    let agents = Some("default/agents");
    let events = stream_ok(
        &server,
        agents,
        &json!({"messages": user("a fresh prompt"), "max_completion_tokens": 7, "ignore_eos": true,
                "stream": true, "return_token_ids": true}),
    )
    .await;
    let (choices, none) = check_stream(&events, 1);
    assert!(none.is_none());
    assert_eq!(choices[0].token_ids.len(), 7);
    let prompt_tokens = events[0]["prompt_token_ids"].as_array().unwrap().len() as u64;
    let three = chat_ok(
        &server,
        KEY,
        agents,
        &json!({"messages": user("hi"), "max_completion_tokens": 4, "n": 3, "temperature": 1.0}),
    )
    .await;
    let events = stream_ok(
        &server,
        agents,
        &json!({"messages": user("a stream"), "max_completion_tokens": 6, "n": 2,
                "stream": true, "stream_options": {"include_usage": true}}),
    )
    .await;
    let (_, streamed_usage) = check_stream(&events, 2);
    let streamed_usage = streamed_usage.expect("a usage chunk");
    let bad = chat(
        &server,
        KEY,
        agents,
        &json!({"messages": user("hi"), "temperature": -1}),
    )
    .await;
    assert_eq!(bad.status().as_u16(), 400);
    // Project `default` (no header): one plain completion.
    let plain = chat_ok(
        &server,
        KEY,
        None,
        &json!({"messages": user("hello there"), "max_completion_tokens": 5}),
    )
    .await;
    // Another team, in a project of the same name.
    let other = chat_ok(
        &server,
        &acme,
        Some("acme/agents"),
        &json!({"messages": user("theirs"), "max_completion_tokens": 3}),
    )
    .await;

    let by_project = results(&server, KEY, "project").await;
    assert_eq!(by_project.len(), 2, "{by_project:?}");
    assert_eq!(
        counters(find(&by_project, "default")),
        chat_counters(&[&plain["usage"]])
    );
    let mut agents_expected = chat_counters(&[&three["usage"], &streamed_usage]);
    // The stream without usage: its prompt, none of it cached, and its 7 tokens.
    agents_expected[0] += prompt_tokens;
    agents_expected[2] += 7;
    agents_expected[3] += 1;
    assert_eq!(counters(find(&by_project, "agents")), agents_expected);
    assert!(by_project.iter().all(|r| r["model"].is_null()));

    // Not grouped: one total; by model: the served name.
    let total = results(&server, KEY, "model").await;
    assert_eq!(total.len(), 1, "{total:?}");
    assert_eq!(total[0]["model"], "tiny");
    assert!(total[0]["project_id"].is_null());
    assert_eq!(total[0]["num_model_requests"], 4);

    // The other team sees its own request only, and ours see nothing of it.
    let theirs = results(&server, &acme, "project,model").await;
    assert_eq!(theirs.len(), 1, "{theirs:?}");
    assert_eq!(
        counters(find(&theirs, "agents")),
        chat_counters(&[&other["usage"]])
    );
    let (status, page) = usage(&server, &acme, &format!("start={}", now() - 60)).await;
    assert_eq!(status, 200);
    assert!(page["quota"].is_null());
}

#[tokio::test]
async fn cached_prompt_tokens_are_counted_as_the_response_reports_them() {
    let (server, _data) = server().await;
    let body = json!({"messages": user(&"the same long prompt ".repeat(20)),
                      "max_completion_tokens": 2});
    let first = chat_ok(&server, KEY, None, &body).await;
    let second = chat_ok(&server, KEY, None, &body).await;
    assert!(
        second["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            > 0,
        "{second}"
    );
    let total = results(&server, KEY, "project").await;
    assert_eq!(
        counters(&total[0]),
        chat_counters(&[&first["usage"], &second["usage"]])
    );
}

#[tokio::test]
async fn a_cancelled_stream_counts_what_was_generated() {
    let (server, _data) = server().await;
    let max_tokens = 1900;
    let resp = chat(
        &server,
        KEY,
        Some("default/cut"),
        &json!({"messages": user("hello"), "max_completion_tokens": max_tokens,
                "ignore_eos": true, "stream": true}),
    )
    .await;
    assert_eq!(resp.status().as_u16(), 200);
    let mut body = resp.bytes_stream();
    let mut seen = String::new();
    // The role chunk, then at least 5 tokens.
    while seen.matches("\n\n").count() < 6 {
        seen.push_str(std::str::from_utf8(&body.next().await.unwrap().unwrap()).unwrap());
    }
    drop(body);
    server.wait_idle(Duration::from_secs(5)).await;
    let start = Instant::now();
    let cut = loop {
        let results = results(&server, KEY, "project").await;
        if let Some(r) = results.iter().find(|r| r["project_id"] == "cut") {
            break r.clone();
        }
        assert!(start.elapsed() < Duration::from_secs(10), "not counted");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(cut["num_model_requests"], 1);
    assert!(cut["input_tokens"].as_u64().unwrap() > 0);
    let output = cut["output_tokens"].as_u64().unwrap();
    assert!((5..max_tokens as u64 / 2).contains(&output), "{cut}");
}

#[tokio::test]
async fn trained_tokens_count_for_the_models_project() {
    let (server, _data) = server().await;
    server.state.training().unwrap().spawn_worker().unwrap();
    let model = server
        .post_ok(
            "/v1/preview/models",
            &json!({"project": "research", "name": "m", "base_model": "tiny"}),
        )
        .await;
    let line = |q: &str, a: &str| {
        json!({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}],
               "tools": []})
    };
    let job = server
        .post_ok(
            "/v1/preview/sft-training-jobs",
            &json!({"model_id": model["id"], "trajectories": [line("hi", "hello"), line("bye", "ciao")]}),
        )
        .await;
    let job = job["id"].as_str().unwrap();
    let start = Instant::now();
    loop {
        let j: Value = server
            .get(&format!("/v1/preview/training-jobs/{job}"))
            .await
            .json()
            .await
            .unwrap();
        if j["status"] != "queued" && j["status"] != "running" {
            assert_eq!(j["status"], "succeeded", "{j}");
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(300), "{j}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let events: Value = server
        .get(&format!("/v1/preview/training-jobs/{job}/events?limit=100"))
        .await
        .json()
        .await
        .unwrap();
    let steps: Vec<u64> = events["data"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["type"] == "gradient_step")
        .map(|e| e["data"]["num_trainable_tokens"].as_u64().unwrap())
        .collect();
    assert!(
        !steps.is_empty() && steps.iter().all(|&t| t > 0),
        "{events}"
    );

    let trained = results(&server, KEY, "project,model").await;
    assert_eq!(trained.len(), 1, "{trained:?}");
    assert_eq!(trained[0]["model"], "default/research/m");
    assert_eq!(
        counters(find(&trained, "research")),
        [0, 0, 0, 0, steps.iter().sum(), steps.len() as u64]
    );

    // Chat with the checkpoint counts under its step's name.
    chat_ok(
        &server,
        KEY,
        Some("default/research"),
        &json!({"model": "default/research/m", "messages": user("hi"), "max_completion_tokens": 2}),
    )
    .await;
    let by_model = results(&server, KEY, "model").await;
    let mut models: Vec<&str> = by_model
        .iter()
        .map(|r| r["model"].as_str().unwrap())
        .collect();
    models.sort();
    assert_eq!(models, ["default/research/m", "default/research/m:step1"]);
}

#[tokio::test]
async fn a_team_past_its_monthly_quota_gets_a_429() {
    let (server, _data) = server().await;
    let (_, acme) = store(&server).create_key("acme").await.unwrap();
    // One token: the first request passes (nothing used yet) and uses it up.
    store(&server).set_quota("default", Some(1)).await.unwrap();
    let body = json!({"messages": user("hi"), "max_completion_tokens": 3});
    let first = chat_ok(&server, KEY, None, &body).await;
    let used = first["usage"]["total_tokens"].as_u64().unwrap();
    let (status, page) = usage(&server, KEY, &format!("start={}", now() - 60)).await;
    assert_eq!(status, 200);
    let quota = &page["quota"];
    assert_eq!(quota["monthly_tokens"], 1);
    assert_eq!(quota["used_tokens"], used);
    assert_eq!(quota["remaining_tokens"], 0);
    let (period_start, period_end) = temper_store::utc_month(now());
    assert_eq!(quota["period_start"], period_start);
    assert_eq!(quota["period_end"], period_end);

    for stream in [false, true] {
        let refused = chat(
            &server,
            KEY,
            None,
            &json!({"messages": user("hi"), "stream": stream}),
        )
        .await;
        assert_eq!(refused.status().as_u16(), 429);
        assert_eq!(refused.headers()["x-should-retry"], "false");
        assert!(refused.headers().get("retry-after").is_none());
        let v: Value = refused.json().await.unwrap();
        assert_eq!(v["error"]["type"], "QuotaExceededError", "{v}");
        assert_eq!(v["error"]["code"], 429);
        let message = v["error"]["message"].as_str().unwrap();
        assert!(
            message.contains(&format!("used {used} of its 1 tokens"))
                && message.contains("temper keys quota"),
            "{message}"
        );
    }
    // Training job posts too.
    let model = server
        .post_ok(
            "/v1/preview/models",
            &json!({"project": "p", "name": "m", "base_model": "tiny"}),
        )
        .await;
    let refused = server
        .post(
            "/v1/preview/sft-training-jobs",
            &json!({"model_id": model["id"], "trajectories": []}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status().as_u16(), 429);
    // Refused requests count nothing; another team has no quota.
    let counted = results(&server, KEY, "project").await;
    assert_eq!(counted[0]["num_model_requests"], 1);
    chat_ok(&server, &acme, None, &body).await;
    // A raised quota lets the team through again.
    store(&server)
        .set_quota("default", Some(used + 100))
        .await
        .unwrap();
    chat_ok(&server, KEY, None, &body).await;
    store(&server).set_quota("default", None).await.unwrap();
    let (_, page) = usage(&server, KEY, &format!("start={}", now() - 60)).await;
    assert!(page["quota"].is_null());
}

#[tokio::test]
async fn bad_queries_are_400s_and_keys_are_required() {
    let (server, _data) = server().await;
    let t = now();
    for (query, param) in [
        (String::new(), Some("start")),
        ("start=abc".to_owned(), Some("start")),
        ("start=-5".to_owned(), Some("start")),
        (format!("start={t}&end={t}"), Some("end")),
        (format!("start={t}&end=1.5"), Some("end")),
        (format!("start={t}&bucket_width=1m"), Some("bucket_width")),
        (format!("start={t}&group_by=team"), Some("group_by")),
        (
            format!("start={t}&group_by=project,project"),
            Some("group_by"),
        ),
        ("start=0&bucket_width=1h".to_owned(), Some("end")),
        // Unknown and repeated parameters.
        (format!("start={t}&limit=7"), None),
        (format!("start={t}&group_by=project&group_by=model"), None),
    ] {
        let (status, v) = usage(&server, KEY, &query).await;
        assert_eq!(status, 400, "{query}: {v}");
        assert_eq!(v["error"]["type"], "BadRequestError");
        assert_eq!(v["error"]["param"].as_str(), param, "{query}: {v}");
    }
    let (status, page) = usage(
        &server,
        KEY,
        &format!("start={}&bucket_width=1d", t - 86_400),
    )
    .await;
    assert_eq!(status, 200);
    let buckets = page["data"].as_array().unwrap();
    assert_eq!(buckets.len(), 2, "{page}");
    assert_eq!(buckets[0]["start_time"].as_i64().unwrap() % 86_400, 0);
    assert!(buckets.iter().all(|b| b["results"] == json!([])));
    let resp = server
        .client
        .get(server.url(&format!("/v1/usage?start={t}")))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 401);
}

#[tokio::test]
async fn a_server_without_a_store_has_no_usage() {
    let server = TestServer::tiny(options(), None).await;
    let (status, v) = usage(&server, KEY, &format!("start={}", now())).await;
    assert_eq!(status, 503, "{v}");
    chat_ok(
        &server,
        KEY,
        None,
        &json!({"messages": user("hi"), "max_completion_tokens": 1}),
    )
    .await;
}
