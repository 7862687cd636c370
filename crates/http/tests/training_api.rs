//! The preview training API through real HTTP on the tiny model with a real store: keys and
//! teams, tenancy (another team's resources are 404), models, checkpoint pagination, validation.

mod common;

use common::{options, TestServer, KEY};
use serde_json::{json, Value};
use temper_http::{CatalogOptions, ServerOptions, TrainingOptions};

/// The worker these tests play, writing jobs' results straight into the store.
const WORKER: &str = "test-worker";
const LEASE: std::time::Duration = std::time::Duration::from_secs(600);

struct Api {
    server: TestServer,
    _data: tempfile::TempDir,
}

async fn api(options: ServerOptions) -> Api {
    let data = tempfile::tempdir().unwrap();
    let server = TestServer::tiny_training(
        options,
        CatalogOptions::new(data.path()),
        TrainingOptions::default(),
        None,
    )
    .await;
    Api {
        server,
        _data: data,
    }
}

impl Api {
    fn store(&self) -> &temper_store::Store {
        &self.server.state.training().unwrap().store
    }

    async fn call(
        &self,
        method: &str,
        path: &str,
        key: Option<&str>,
        body: Option<Value>,
    ) -> (u16, Value) {
        let mut req = self
            .server
            .client
            .request(method.parse().unwrap(), self.server.url(path));
        if let Some(key) = key {
            req = req.bearer_auth(key);
        }
        if let Some(body) = body {
            req = req.json(&body);
        }
        let resp = req.send().await.unwrap();
        let status = resp.status().as_u16();
        let text = resp.text().await.unwrap();
        (
            status,
            serde_json::from_str(&text).unwrap_or(Value::String(text)),
        )
    }

    async fn get(&self, path: &str, key: &str) -> (u16, Value) {
        self.call("GET", path, Some(key), None).await
    }

    async fn post(&self, path: &str, key: &str, body: Value) -> (u16, Value) {
        self.call("POST", path, Some(key), Some(body)).await
    }

    async fn create_model(&self, key: &str, name: &str) -> Value {
        let (status, body) = self
            .post(
                "/v1/preview/models",
                key,
                json!({"entity": null, "project": "proj", "name": name, "base_model": "tiny"}),
            )
            .await;
        assert_eq!(status, 200, "{body}");
        body
    }
}

fn param(body: &Value) -> Option<&str> {
    body["error"]["param"].as_str()
}

#[tokio::test]
async fn keys_from_the_store_and_the_command_line() {
    let api = api(options()).await;
    let (_, acme) = api.store().create_key("acme").await.unwrap();

    // A command-line key is team `default`; a store key its own team.
    let m = api.create_model(KEY, "m").await;
    assert_eq!(m["entity"], "default");
    let m = api.create_model(&acme, "m").await;
    assert_eq!(m["entity"], "acme");

    let (status, _) = api.call("GET", "/v1/preview/models", None, None).await;
    assert_eq!(status, 401);
    let (status, body) = api.get("/v1/preview/models", "tp-wrong").await;
    assert_eq!(status, 401);
    assert_eq!(body["error"]["type"], "AuthenticationError");

    // A key created while the server runs works at once; revoked, it stops at once.
    let (info, late) = api.store().create_key("acme").await.unwrap();
    let (status, body) = api.get("/v1/preview/models", &late).await;
    assert_eq!(status, 200);
    assert_eq!(body["data"].as_array().unwrap().len(), 1);
    api.store().revoke_key(&info.id).await.unwrap();
    let (status, _) = api.get("/v1/preview/models", &late).await;
    assert_eq!(status, 401);
}

#[tokio::test]
async fn without_keys_the_server_is_open_until_the_store_has_one() {
    let api = api(ServerOptions::default()).await;
    let (status, body) = api.call("GET", "/v1/preview/models", None, None).await;
    assert_eq!((status, &body["data"]), (200, &json!([])));
    let (info, key) = api.store().create_key("acme").await.unwrap();
    let (status, _) = api.call("GET", "/v1/preview/models", None, None).await;
    assert_eq!(status, 401);
    let (status, _) = api.get("/v1/preview/models", &key).await;
    assert_eq!(status, 200);
    api.store().revoke_key(&info.id).await.unwrap();
    let (status, _) = api.call("GET", "/v1/preview/models", None, None).await;
    assert_eq!(status, 200);

    // `require_key` (a non-loopback bind) never opens.
    let api = api_requiring_key().await;
    let (status, _) = api.call("GET", "/v1/preview/models", None, None).await;
    assert_eq!(status, 401);
}

async fn api_requiring_key() -> Api {
    api(ServerOptions {
        require_key: true,
        ..ServerOptions::default()
    })
    .await
}

#[tokio::test]
async fn another_teams_resources_are_not_found() {
    let api = api(options()).await;
    let (_, a) = api.store().create_key("team-a").await.unwrap();
    let (_, b) = api.store().create_key("team-b").await.unwrap();
    let model = api.create_model(&a, "secret").await;
    let id = model["id"].as_str().unwrap();
    let job = api
        .store()
        .enqueue_job(
            "team-a",
            id.parse().unwrap(),
            temper_store::JobKind::Rl,
            "{}",
        )
        .await
        .unwrap();

    for path in [
        format!("/v1/preview/models/{id}"),
        format!("/v1/preview/models/{id}/checkpoints"),
        format!("/v1/preview/training-jobs/{}", job.id),
        format!("/v1/preview/training-jobs/{}/events", job.id),
    ] {
        let (status, body) = api.get(&path, &b).await;
        assert_eq!(status, 404, "{path}: {body}");
        assert_eq!(body["error"]["type"], "NotFoundError");
        let (status, _) = api.get(&path, &a).await;
        assert_eq!(status, 200, "{path}");
    }
    let (status, _) = api
        .post(
            &format!("/v1/preview/training-jobs/{}/cancel", job.id),
            &b,
            json!({}),
        )
        .await;
    assert_eq!(status, 404);
    let (status, _) = api
        .call(
            "DELETE",
            &format!("/v1/preview/models/{id}"),
            Some(&b),
            None,
        )
        .await;
    assert_eq!(status, 404);
    let (_, listed) = api.get("/v1/preview/models", &b).await;
    assert_eq!(listed["data"], json!([]));
    let (_, jobs) = api.get("/v1/preview/training-jobs", &b).await;
    assert_eq!(jobs["data"], json!([]));
    // Creating under another team's entity: as absent as its models.
    let (status, _) = api
        .post(
            "/v1/preview/models",
            &b,
            json!({"entity": "team-a", "project": "proj", "name": "x", "base_model": "tiny"}),
        )
        .await;
    assert_eq!(status, 404);

    // Serving by name: the owner gets the checkpoint, the other team a 404 like any unknown name.
    let api = &api;
    let chat = |key: String, model: &str| {
        let body = json!({"model": model, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2});
        async move { api.post("/v1/chat/completions", &key, body).await }
    };
    for name in [
        "team-a/proj/secret",
        "team-a/proj/secret:step0",
        "art:///team-a/proj/secret:latest",
    ] {
        let (status, body) = chat(a.clone(), name).await;
        assert_eq!(status, 200, "{name}: {body}");
        assert_eq!(body["model"], name);
        let (status, body) = chat(b.clone(), name).await;
        assert_eq!(status, 404, "{name}");
        assert_eq!(param(&body), Some("model"));
    }
    let (status, _) = chat(a.clone(), "team-a/proj/secret:step1").await;
    assert_eq!(status, 404);
    let (_, models) = api.get("/v1/models", &a).await;
    let ids: Vec<&str> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(
        ids,
        ["tiny", "team-a/proj/secret", "team-a/proj/secret:step0"]
    );
    assert_eq!(models["data"][1]["parent"], "tiny");
    let (_, models) = api.get("/v1/models", &b).await;
    assert_eq!(models["data"].as_array().unwrap().len(), 1);
}

#[tokio::test]
async fn models_create_get_list_delete() {
    let api = api(options()).await;
    let body = json!({"entity": "default", "project": "p", "name": "m", "base_model": "tiny"});
    let (status, created) = api.post("/v1/preview/models", KEY, body.clone()).await;
    assert_eq!(status, 200);
    let keys = sorted_keys(&created);
    assert_eq!(
        keys,
        ["base_model", "entity", "id", "name", "project", "run_id"]
    );
    let id = created["id"].as_str().unwrap();
    assert!(uuid::Uuid::parse_str(id).is_ok());

    let (status, dup) = api.post("/v1/preview/models", KEY, body.clone()).await;
    assert_eq!(status, 409, "{dup}");
    let mut again = body.clone();
    again["return_existing"] = json!(true);
    let (status, existing) = api.post("/v1/preview/models", KEY, again).await;
    assert_eq!((status, &existing), (200, &created));

    let (status, got) = api.get(&format!("/v1/preview/models/{id}"), KEY).await;
    assert_eq!((status, &got), (200, &created));
    let (_, list) = api.get("/v1/preview/models", KEY).await;
    assert_eq!(list, json!({"object": "list", "data": [created.clone()]}));

    let (status, deleted) = api
        .call(
            "DELETE",
            &format!("/v1/preview/models/{id}"),
            Some(KEY),
            None,
        )
        .await;
    assert_eq!(status, 200);
    assert_eq!(
        deleted,
        json!({"model_id": id, "deleted_checkpoints": 1, "deleted_run": true})
    );
    let (status, _) = api.get(&format!("/v1/preview/models/{id}"), KEY).await;
    assert_eq!(status, 404);
}

#[tokio::test]
async fn model_validation() {
    let api = api(options()).await;
    let cases = [
        (
            json!({"project": "p", "name": "m", "base_model": "nope"}),
            400,
            Some("base_model"),
        ),
        (
            json!({"project": "p", "name": "a/b", "base_model": "tiny"}),
            400,
            Some("name"),
        ),
        (
            json!({"project": "", "name": "m", "base_model": "tiny"}),
            400,
            Some("project"),
        ),
        (
            json!({"project": "p", "base_model": "tiny"}),
            400,
            Some("name"),
        ),
        (
            json!({"project": "p", "name": "m", "base_model": "tiny", "colour": 1}),
            400,
            Some("colour"),
        ),
        (
            json!({"project": "p", "name": "m", "base_model": "tiny", "return_existing": "yes"}),
            400,
            Some("return_existing"),
        ),
    ];
    for (body, status, want) in cases {
        let (got, err) = api.post("/v1/preview/models", KEY, body.clone()).await;
        assert_eq!(got, status, "{body}: {err}");
        assert_eq!(param(&err), want, "{body}: {err}");
    }
    for (path, want) in [
        ("/v1/preview/models/not-a-uuid", "model_id"),
        ("/v1/preview/training-jobs/42", "job_id"),
        ("/v1/preview/training-jobs/42/events", "job_id"),
    ] {
        let (status, err) = api.get(path, KEY).await;
        assert_eq!(status, 400, "{path}");
        assert_eq!(param(&err), Some(want));
    }
    let missing = uuid::Uuid::new_v4();
    let (status, _) = api.get(&format!("/v1/preview/models/{missing}"), KEY).await;
    assert_eq!(status, 404);
}

/// Malformed percent-escapes (`%ZZ`, or escapes that decode to invalid UTF-8) in a path or a
/// query string are 400s in the error envelope, never axum's plain-text rejections.
#[tokio::test]
async fn malformed_urls_are_400s_in_the_envelope() {
    let api = api(options()).await;
    let job = uuid::Uuid::new_v4();
    for (method, path, want) in [
        ("GET", "/v1/preview/models/%ZZ".to_owned(), Some("model_id")),
        (
            "GET",
            "/v1/preview/models/%FF%FE".to_owned(),
            Some("model_id"),
        ),
        (
            "DELETE",
            "/v1/preview/models/%C3%28".to_owned(),
            Some("model_id"),
        ),
        (
            "GET",
            "/v1/preview/models/%FF/checkpoints".to_owned(),
            Some("model_id"),
        ),
        (
            "POST",
            "/v1/preview/models/%FF/log".to_owned(),
            Some("model_id"),
        ),
        (
            "GET",
            "/v1/preview/training-jobs/%FF".to_owned(),
            Some("job_id"),
        ),
        (
            "GET",
            "/v1/preview/training-jobs/%FF/events".to_owned(),
            Some("job_id"),
        ),
        (
            "POST",
            "/v1/preview/training-jobs/%FF/cancel".to_owned(),
            Some("job_id"),
        ),
        (
            "GET",
            format!("/v1/preview/training-jobs/{job}/events?after=%FF"),
            Some("after"),
        ),
        (
            "GET",
            "/v1/preview/training-jobs?limit=%FF".to_owned(),
            Some("limit"),
        ),
    ] {
        let body = (method == "POST").then(|| json!({}));
        let (status, err) = api.call(method, &path, Some(KEY), body).await;
        assert_eq!(status, 400, "{method} {path}: {err}");
        assert_eq!(
            err["error"]["type"], "BadRequestError",
            "{method} {path}: {err}"
        );
        assert_eq!(param(&err), want, "{method} {path}: {err}");
    }
    // No such route: a 404 in the envelope.
    let (status, err) = api.get("/v1/models/%ZZ", KEY).await;
    assert_eq!(status, 404, "{err}");
    assert!(err["error"]["message"].is_string(), "{err}");
}

/// Adds checkpoints 1..=n through the store's job path (what the worker records).
async fn add_checkpoints(api: &Api, model_id: uuid::Uuid, n: i64) {
    add_checkpoints_from(api, model_id, 1, n).await;
}

async fn add_checkpoints_from(api: &Api, model_id: uuid::Uuid, first: i64, last: i64) {
    let store = api.store();
    for step in first..=last {
        let job = store
            .enqueue_job("default", model_id, temper_store::JobKind::Rl, "{}")
            .await
            .unwrap();
        let claimed = store.claim_next_job(WORKER, LEASE).await.unwrap().unwrap();
        assert_eq!(claimed.id, job.id);
        store
            .succeed_job(
                job.id,
                WORKER,
                step,
                Some(json!({"loss": step})),
                &json!({"step": step}),
            )
            .await
            .unwrap();
    }
}

#[tokio::test]
async fn checkpoint_pagination_and_deletion() {
    let api = api(options()).await;
    let model = api.create_model(KEY, "m").await;
    let id = model["id"].as_str().unwrap();
    add_checkpoints(&api, id.parse().unwrap(), 4).await;
    let base = format!("/v1/preview/models/{id}/checkpoints");

    let (status, page) = api.get(&format!("{base}?limit=2"), KEY).await;
    assert_eq!(status, 200);
    let steps = |p: &Value| -> Vec<i64> {
        p["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["step"].as_i64().unwrap())
            .collect()
    };
    assert_eq!(steps(&page), [0, 1]);
    assert_eq!(page["object"], "list");
    assert_eq!(page["has_more"], true);
    assert_eq!(page["first_id"], page["data"][0]["id"]);
    assert_eq!(page["last_id"], page["data"][1]["id"]);
    assert_eq!(page["data"][1]["metrics"], json!({"loss": 1}));
    let keys = sorted_keys(&page["data"][0]);
    assert_eq!(keys, ["id", "metrics", "step"]);

    let after = page["last_id"].as_str().unwrap();
    let (_, page2) = api.get(&format!("{base}?limit=2&after={after}"), KEY).await;
    assert_eq!(steps(&page2), [2, 3]);
    assert_eq!(page2["has_more"], true);
    let (_, page3) = api
        .get(
            &format!(
                "{base}?limit=2&after={}",
                page2["last_id"].as_str().unwrap()
            ),
            KEY,
        )
        .await;
    assert_eq!(steps(&page3), [4]);
    assert_eq!(page3["has_more"], false);
    let (_, desc) = api.get(&format!("{base}?order=desc&limit=3"), KEY).await;
    assert_eq!(steps(&desc), [4, 3, 2]);
    let (_, all) = api.get(&base, KEY).await;
    assert_eq!(steps(&all), [0, 1, 2, 3, 4]);

    for (query, want) in [
        ("limit=0", Some("limit")),
        ("limit=101", Some("limit")),
        ("limit=ten", Some("limit")),
        ("order=sideways", Some("order")),
        ("after=nope", Some("after")),
        (&format!("after={}", uuid::Uuid::new_v4()), Some("after")),
        ("colour=red", None),
    ] {
        let (status, err) = api.get(&format!("{base}?{query}"), KEY).await;
        assert_eq!(status, 400, "{query}: {err}");
        assert_eq!(param(&err), want, "{query}");
    }

    let (status, deleted) = api
        .call(
            "DELETE",
            &base,
            Some(KEY),
            Some(json!({"steps": [1, 7, 3]})),
        )
        .await;
    assert_eq!(status, 200);
    assert_eq!(deleted, json!({"deleted_count": 2, "not_found_steps": [7]}));
    let (_, all) = api.get(&base, KEY).await;
    assert_eq!(steps(&all), [0, 2, 4]);
    let (status, err) = api
        .call("DELETE", &base, Some(KEY), Some(json!({"steps": "all"})))
        .await;
    assert_eq!((status, param(&err)), (400, Some("steps")));
}

#[tokio::test]
async fn job_reads_events_and_cancel() {
    let api = api(options()).await;
    let model = api.create_model(KEY, "m").await;
    let model_id: uuid::Uuid = model["id"].as_str().unwrap().parse().unwrap();
    let store = api.store();
    let first = store
        .enqueue_job("default", model_id, temper_store::JobKind::Rl, "{}")
        .await
        .unwrap();
    let second = store
        .enqueue_job("default", model_id, temper_store::JobKind::Rl, "{}")
        .await
        .unwrap();

    let (status, job) = api
        .get(&format!("/v1/preview/training-jobs/{}", first.id), KEY)
        .await;
    assert_eq!(status, 200);
    let keys = sorted_keys(&job);
    assert_eq!(
        keys,
        [
            "created_at",
            "error",
            "finished_at",
            "id",
            "kind",
            "model_id",
            "started_at",
            "status",
            "step"
        ]
    );
    assert_eq!(job["status"], "queued");
    assert_eq!(job["kind"], "rl");
    assert_eq!(job["model_id"], model["id"]);

    // Newest first, with a cursor.
    let (_, list) = api.get("/v1/preview/training-jobs?limit=1", KEY).await;
    assert_eq!(list["data"][0]["id"], second.id.to_string());
    assert_eq!(list["has_more"], true);
    let (_, list) = api
        .get(
            &format!(
                "/v1/preview/training-jobs?limit=1&after={}&model_id={model_id}",
                second.id
            ),
            KEY,
        )
        .await;
    assert_eq!(list["data"][0]["id"], first.id.to_string());
    assert_eq!(list["has_more"], false);
    let (status, err) = api.get("/v1/preview/training-jobs?model_id=x", KEY).await;
    assert_eq!((status, param(&err)), (400, Some("model_id")));

    // Events: the same `after` twice gives the same events.
    store.claim_next_job(WORKER, LEASE).await.unwrap();
    for i in 0..3 {
        store
            .append_event(first.id, WORKER, "gradient_step", &json!({"step": i}))
            .await
            .unwrap();
    }
    let events = format!("/v1/preview/training-jobs/{}/events", first.id);
    let (_, page) = api.get(&format!("{events}?limit=2"), KEY).await;
    assert_eq!(page["object"], "list");
    assert_eq!(page["has_more"], true);
    let last = page["data"][1]["id"].as_i64().unwrap();
    let (_, rest) = api.get(&format!("{events}?after={last}"), KEY).await;
    let (_, again) = api.get(&format!("{events}?after={last}"), KEY).await;
    assert_eq!(rest, again);
    assert_eq!(rest["data"].as_array().unwrap().len(), 1);
    assert_eq!(rest["data"][0]["type"], "gradient_step");
    assert_eq!(rest["data"][0]["data"], json!({"step": 2}));
    let (status, err) = api.get(&format!("{events}?after=-1"), KEY).await;
    assert_eq!((status, param(&err)), (400, Some("after")));

    // Cancel: the job comes back cancelled, a training_failed event says so; again is a 409.
    let cancel = format!("/v1/preview/training-jobs/{}/cancel", first.id);
    let (status, job) = api.post(&cancel, KEY, json!({})).await;
    assert_eq!(status, 200);
    assert_eq!(job["status"], "cancelled");
    let (_, rest) = api.get(&format!("{events}?after={last}"), KEY).await;
    assert_eq!(rest["data"][1]["type"], "training_failed");
    let (status, _) = api.post(&cancel, KEY, json!({})).await;
    assert_eq!(status, 409);
}

#[tokio::test]
async fn training_routes_have_their_own_body_limit() {
    let data = tempfile::tempdir().unwrap();
    let training = TrainingOptions {
        max_body_bytes: 2000,
        ..TrainingOptions::default()
    };
    let server = TestServer::tiny_training(
        ServerOptions {
            max_body_bytes: 500,
            ..options()
        },
        CatalogOptions::new(data.path()),
        training,
        None,
    )
    .await;
    let api = Api {
        server,
        _data: data,
    };
    // 1000 bytes: over the server-wide limit, under the training one.
    let padded = |n: usize| {
        json!({"project": "p", "name": "m", "base_model": "tiny", "entity": null,
            "return_existing": true, "pad": "x".repeat(n)})
    };
    let (status, err) = api.post("/v1/preview/models", KEY, padded(1000)).await;
    assert_eq!((status, param(&err)), (400, Some("pad")), "{err}");
    let (status, err) = api.post("/v1/preview/models", KEY, padded(3000)).await;
    assert_eq!(status, 413);
    assert!(
        err["error"]["message"].as_str().unwrap().contains("2000"),
        "{err}"
    );
    let chat = json!({"messages": [{"role": "user", "content": "x".repeat(1000)}]});
    let (status, err) = api.post("/v1/chat/completions", KEY, chat).await;
    assert_eq!(status, 413);
    assert!(
        err["error"]["message"].as_str().unwrap().contains("500"),
        "{err}"
    );
}

#[tokio::test]
async fn log_stores_split_metrics_on_the_latest_checkpoint() {
    let api = api(options()).await;
    let model = api.create_model(KEY, "m").await;
    let id = model["id"].as_str().unwrap();
    let log = format!("/v1/preview/models/{id}/log");
    let traj = |reward: f64, acc: f64| {
        json!({"messages_and_choices": [{"role": "user", "content": "q"}], "reward": reward,
            "metrics": {"accuracy": acc, "label": "x"}})
    };
    let body = json!({"model_id": id, "split": "val", "trajectory_groups": [
        {"trajectories": [traj(1.0, 1.0), traj(0.0, 0.0)]},
        {"trajectories": [traj(0.5, 1.0)]},
    ]});
    let (status, answer) = api.post(&log, KEY, body.clone()).await;
    assert_eq!((status, &answer), (200, &json!({})));
    let (_, page) = api
        .get(&format!("/v1/preview/models/{id}/checkpoints"), KEY)
        .await;
    let metrics = &page["data"][0]["metrics"];
    assert_eq!(metrics["val/reward"], 0.5);
    let std = metrics["val/reward_std_dev"].as_f64().unwrap();
    assert!((std - (1.0f64 / 6.0).sqrt()).abs() < 1e-12, "{std}");
    assert_eq!(metrics["val/num_trajectories"], 3);
    assert_eq!(metrics["val/num_groups"], 2);
    assert!((metrics["val/accuracy"].as_f64().unwrap() - 2.0 / 3.0).abs() < 1e-12);
    assert!(metrics.get("val/label").is_none());

    let mut bad = body.clone();
    bad["split"] = json!("a/b");
    let mut other_model = body.clone();
    other_model["model_id"] = json!(uuid::Uuid::new_v4().to_string());
    let mut empty = body.clone();
    empty["trajectory_groups"] = json!([]);
    let mut empty_group = body.clone();
    empty_group["trajectory_groups"][1]["trajectories"] = json!([]);
    for (body, want) in [
        (bad, "split"),
        (other_model, "model_id"),
        (empty, "trajectory_groups"),
        (empty_group, "trajectory_groups[1].trajectories"),
    ] {
        let (status, err) = api.post(&log, KEY, body).await;
        assert_eq!((status, param(&err)), (400, Some(want)), "{err}");
    }
    let (_, b) = api.store().create_key("other").await.unwrap();
    let (status, _) = api.post(&log, &b, body).await;
    assert_eq!(status, 404);
}

/// A checkpoint's adapter as the worker leaves it: stored in the artifacts and a store row.
/// Its weights are set by hand (a fresh adapter changes nothing) so that it visibly differs.
async fn checkpoint_with_adapter(api: &Api, model_id: uuid::Uuid, step: i64, scale: f32) {
    add_checkpoints_from(api, model_id, step, step).await;
    let training = api.server.state.training().unwrap();
    let config = api.server.state.models()[0].model.config().clone();
    let mut adapter =
        temper_model::LoraAdapter::new(&config, temper_model::LoraConfig::default(), 3);
    for p in adapter.params_mut() {
        for (i, x) in p.iter_mut().enumerate() {
            *x = ((i % 7) as f32 - 3.0) * scale;
        }
    }
    training
        .artifacts
        .put(model_id, step, adapter.to_bytes().unwrap())
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checkpoints_are_served_with_their_adapters_in_one_batch() {
    let api = api(options()).await;
    let model = api.create_model(KEY, "m").await;
    let id: uuid::Uuid = model["id"].as_str().unwrap().parse().unwrap();
    checkpoint_with_adapter(&api, id, 1, 0.05).await;
    checkpoint_with_adapter(&api, id, 2, -0.03).await;

    // Long enough answers that the five requests overlap however fast the tiny model decodes
    // (six tokens each finished one by one once decode stopped waking the pool).
    let greedy = |model: &str| {
        json!({"model": model, "messages": [{"role": "user", "content": "the cat"}],
            "temperature": 0.0, "max_tokens": 64, "logprobs": true, "ignore_eos": true})
    };
    let logprobs = |v: &Value| -> Vec<f64> {
        v["choices"][0]["logprobs"]["content"]
            .as_array()
            .unwrap_or_else(|| panic!("{v}"))
            .iter()
            .map(|t| t["logprob"].as_f64().unwrap())
            .collect()
    };
    let names = [
        "tiny",
        "default/proj/m:step0",
        "default/proj/m:step1",
        "default/proj/m:step2",
        "default/proj/m",
    ];
    let mut alone = Vec::new();
    for name in names {
        let (status, body) = api.post("/v1/chat/completions", KEY, greedy(name)).await;
        assert_eq!(status, 200, "{name}: {body}");
        alone.push(logprobs(&body));
    }
    assert_eq!(alone[1], alone[0], "step 0 is the base model");
    assert_ne!(alone[2], alone[0], "step 1's adapter changes the outputs");
    assert_ne!(alone[3], alone[2]);
    assert_eq!(alone[4], alone[3], "the bare name is the latest checkpoint");

    // All at once: the engine batches the rows (each with its own adapter or none) and every
    // answer is what it was alone.
    let before = api.server.engine_stats();
    let together = futures_util::future::join_all(
        names.map(|name| api.post("/v1/chat/completions", KEY, greedy(name))),
    )
    .await;
    for ((status, body), want) in together.iter().zip(&alone) {
        assert_eq!(*status, 200);
        let got = logprobs(body);
        for (g, w) in got.iter().zip(want) {
            assert!((g - w).abs() < 1e-4, "{got:?} vs {want:?}");
        }
    }
    let after = api.server.engine_stats();
    assert!(after.max_rows_in_step >= 2, "{before:?} -> {after:?}");
}

/// An object's keys in sorted order (serde_json keeps insertion order: llguidance enables its
/// `preserve_order`).
fn sorted_keys(v: &Value) -> Vec<&String> {
    let mut keys: Vec<&String> = v.as_object().unwrap().keys().collect();
    keys.sort();
    keys
}

#[tokio::test]
async fn training_job_bodies_are_validated_at_the_edge() {
    let api = api(options()).await;
    let model = api.create_model(KEY, "m").await;
    let id = model["id"].as_str().unwrap();
    let vocab_token = |t: &str| {
        json!({"message": {"role": "assistant", "content": "x"}, "finish_reason": "stop",
            "index": 0, "logprobs": {"content": [{"token": t, "logprob": -0.1}]}})
    };
    let trajectory = |choice: Value| json!({"messages_and_choices": [{"role": "user", "content": "q"}, choice], "reward": 1});
    let body = |groups: Value| json!({"model_id": id, "trajectory_groups": groups});
    let good = body(json!([{"trajectories": [trajectory(vocab_token("token_id:5"))]}]));
    let (status, created) = api
        .post("/v1/preview/training-jobs", KEY, good.clone())
        .await;
    assert_eq!(status, 200, "{created}");
    assert_eq!(created.as_object().unwrap().len(), 1);
    let job_id = created["id"].as_str().unwrap();
    // Stored durably before the answer: the store has it, queued.
    let job = api
        .store()
        .get_job("default", job_id.parse().unwrap())
        .await
        .unwrap();
    assert_eq!(job.status, temper_store::JobStatus::Queued);

    let mut bad_uuid = good.clone();
    bad_uuid["model_id"] = json!("nope");
    let mut extra = good.clone();
    extra["colour"] = json!(1);
    let mut bad_option = good.clone();
    bad_option["experimental_config"] = json!({"learning_rate": -1});
    let mut unknown_option = good.clone();
    unknown_option["experimental_config"] = json!({"warmup": 1});
    let mut bad_level = good.clone();
    bad_level["experimental_config"] = json!({"importance_sampling_level": "tokens"});
    let mut bad_reward = good.clone();
    bad_reward["trajectory_groups"][0]["trajectories"][0]["reward"] = json!("high");
    let unrenderable = json!({"messages_and_choices": [{"role": "user", "content": "q"},
        {"role": "user", "content": "q"}, vocab_token("token_id:5")], "reward": 1});
    // Longer than the trainer's max_seq_len (2048) once tokenized: a 400 naming the sequence,
    // never a trajectory trained cut short.
    let long_answer = json!({"message": {"role": "assistant", "content": "x"},
        "logprobs": {"content": vec![json!({"token": "token_id:5", "logprob": -0.1}); 2100]}});
    let long = body(json!([{"trajectories": [
        trajectory(vocab_token("token_id:5")),
        trajectory(long_answer.clone())
    ]}]));
    let mut long_history = trajectory(vocab_token("token_id:5"));
    long_history["additional_histories"] =
        json!([{"messages_and_choices": [{"role": "user", "content": "q"}, long_answer]}]);
    let long_history = body(json!([{"trajectories": [long_history]}]));
    let cases = [
        (bad_uuid, "model_id"),
        (extra, "colour"),
        (body(json!([])), "trajectory_groups"),
        (body(json!([{"trajectories": []}])), "trajectory_groups[0].trajectories"),
        (
            body(json!([{"trajectories": [trajectory(vocab_token("not-a-piece"))]}])),
            "trajectory_groups[0].trajectories[0].messages_and_choices[1].logprobs.content[0].token",
        ),
        (
            body(json!([{"trajectories": [trajectory(vocab_token("token_id:999999"))]}])),
            "trajectory_groups[0].trajectories[0].messages_and_choices[1].logprobs.content[0].token",
        ),
        (
            body(json!([{"trajectories": [unrenderable]}])),
            "trajectory_groups[0].trajectories[0].messages_and_choices",
        ),
        (bad_option, "experimental_config.learning_rate"),
        (unknown_option, "experimental_config.warmup"),
        (bad_level, "experimental_config.importance_sampling_level"),
        (bad_reward, "trajectory_groups[0].trajectories[0].reward"),
        (long, "trajectory_groups[0].trajectories[1].messages_and_choices"),
        (
            long_history,
            "trajectory_groups[0].trajectories[0].additional_histories[0].messages_and_choices",
        ),
    ];
    for (body, want) in cases {
        let (status, err) = api.post("/v1/preview/training-jobs", KEY, body).await;
        assert_eq!((status, param(&err)), (400, Some(want)), "{err}");
    }
    let mut missing = good.clone();
    missing["model_id"] = json!(uuid::Uuid::new_v4().to_string());
    let (status, _) = api.post("/v1/preview/training-jobs", KEY, missing).await;
    assert_eq!(status, 404);
    let (_, other) = api.store().create_key("other").await.unwrap();
    let (status, _) = api.post("/v1/preview/training-jobs", &other, good).await;
    assert_eq!(status, 404, "another team's model");
    let (_, jobs) = api.get("/v1/preview/training-jobs", KEY).await;
    assert_eq!(
        jobs["data"].as_array().unwrap().len(),
        1,
        "only the valid job was stored"
    );
}

/// A completion's logprobs posted back as a trajectory's Choice, with plain `token` strings and
/// their `bytes` as agents send them, tokenize to the completion's token ids. Sampled hot from
/// the tiny random model they are any token of its vocabulary: byte-fallback pieces of partial
/// characters (`token` U+FFFD), spaces, control tokens. A byte-fallback piece whose byte is also
/// a piece of its own (`<0x0A>` and `\n`) shows the same entry; it comes back as that piece.
#[tokio::test]
async fn completion_logprobs_round_trip_into_training_tokens() {
    let api = api(options()).await;
    let model = api.create_model(KEY, "m").await;
    let user = json!({"role": "user", "content": "the cat"});
    let (status, completion) = api
        .post(
            "/v1/chat/completions",
            KEY,
            json!({"model": "tiny", "messages": [user], "max_completion_tokens": 300,
                "temperature": 2, "seed": 1, "ignore_eos": true, "n": 4, "logprobs": true,
                "top_logprobs": 3, "return_token_ids": true}),
        )
        .await;
    assert_eq!(status, 200, "{completion}");
    let served = &api.server.state.models()[0];
    let tok = &served.tokenizer;
    let template = served.chat_template.as_deref().unwrap();
    let (mut lossy, mut shared_bytes) = (0, 0);
    let mut trajectories = Vec::new();
    for choice in completion["choices"].as_array().unwrap() {
        let sampled: Vec<u32> = serde_json::from_value(choice["token_ids"].clone()).unwrap();
        let trajectory =
            json!({"messages_and_choices": [user, choice], "reward": trajectories.len()});
        let request: temper_train::TrainingRequest =
            serde_json::from_value(json!({"trajectory_groups": [{"trajectories": [trajectory]}]}))
                .unwrap();
        let job = temper_train::tokenize_job(&request, tok, template).unwrap();
        let seq = &job.sequences[0];
        let trained: Vec<u32> = seq.trained_ids().collect();
        assert_eq!(trained.len(), sampled.len());
        for (&got, &id) in trained.iter().zip(&sampled) {
            let (token, bytes) = tok.logprob_token(id).unwrap();
            lossy += usize::from(token.as_bytes() != bytes);
            if got != id {
                shared_bytes += 1;
                assert_eq!(tok.kind(id), Some(temper_text::TokenKind::Byte), "{id}");
                assert_eq!(tok.token_bytes(got), tok.token_bytes(id), "{id} -> {got}");
            }
        }
        // The alternatives name tokens the same way.
        for entry in choice["logprobs"]["content"].as_array().unwrap() {
            for top in entry["top_logprobs"].as_array().unwrap() {
                let bytes: Vec<u8> = serde_json::from_value(top["bytes"].clone()).unwrap();
                let id = tok.id_of_logprob_token(top["token"].as_str().unwrap(), Some(&bytes));
                assert_eq!(tok.logprob_token(id.unwrap()).unwrap().1, bytes);
            }
        }
        trajectories.push(trajectory);
    }
    println!("partial-character entries {lossy}, shared-byte entries {shared_bytes}");
    assert!(lossy > 0, "the sample has no partial characters");
    // The same trajectories are accepted as a training job.
    let (status, body) = api
        .post(
            "/v1/preview/training-jobs",
            KEY,
            json!({"model_id": model["id"], "trajectory_groups": [{"trajectories": trajectories}]}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
}
