//! The Tinker API (`/api/v1`, issue 33) through real HTTP on the tiny model with a real store, as
//! the tinker SDK speaks it (protobuf `forward_backward`, futures): a training step and its
//! sampler weights served by name, retries that never apply a step twice, another team's
//! objects as absent as missing ones, and bad input refused with a clear 4xx.

mod common;

use common::{TestServer, KEY};
use serde_json::{json, Value};
use temper_http::tinker::proto::{Chunk, Datum, ForwardBackwardRequest, Tensor};

struct Api {
    server: TestServer,
    _data: tempfile::TempDir,
}

async fn api() -> Api {
    let data = tempfile::tempdir().unwrap();
    Api {
        server: TestServer::tiny_training_in(data.path()).await,
        _data: data,
    }
}

/// A call the SDK's way: `X-API-Key` with the `tml-` prefix it requires; a JSON body with POST.
async fn call(s: &TestServer, key: &str, path: &str, body: Option<&Value>) -> (u16, Value) {
    let req = match body {
        Some(body) => s.client.post(s.url(path)).json(body),
        None => s.client.get(s.url(path)),
    };
    let resp = req
        .header("x-api-key", format!("tml-{key}"))
        .send()
        .await
        .unwrap();
    let status = resp.status().as_u16();
    (status, resp.json().await.unwrap())
}

impl Api {
    async fn post(&self, key: &str, path: &str, body: &Value) -> (u16, Value) {
        call(&self.server, key, path, Some(body)).await
    }

    /// A key of another team.
    async fn other_team(&self) -> String {
        let store = &self.server.state.training().unwrap().store;
        store.create_key("other").await.unwrap().1
    }

    async fn forward_backward(&self, key: &str, req: &ForwardBackwardRequest) -> (u16, Value) {
        let resp = self
            .server
            .client
            .post(self.server.url("/api/v1/forward_backward"))
            .header("x-api-key", format!("tml-{key}"))
            .header("content-type", "application/x-protobuf")
            .body(req.encode())
            .send()
            .await
            .unwrap();
        let status = resp.status().as_u16();
        (status, resp.json().await.unwrap())
    }

    /// Polls a future to its end (as JSON).
    async fn result(&self, key: &str, future: &Value) -> Value {
        loop {
            let (status, v) = self
                .post(
                    key,
                    "/api/v1/retrieve_future",
                    &json!({ "request_id": future["request_id"] }),
                )
                .await;
            assert_eq!(status, 200, "{v}");
            if v["type"] != "try_again" {
                return v;
            }
        }
    }

    async fn session(&self, key: &str) -> String {
        let (status, v) = self
            .post(
                key,
                "/api/v1/create_session",
                &json!({ "tags": [], "user_metadata": {}, "sdk_version": "0.38.0" }),
            )
            .await;
        assert_eq!(status, 200, "{v}");
        v["session_id"].as_str().unwrap().to_owned()
    }

    async fn create_model(&self, key: &str, session: &str, seed: u64) -> String {
        let (status, future) = self
            .post(
                key,
                "/api/v1/create_model",
                &json!({
                    "session_id": session, "model_seq_id": 0, "base_model": "tiny",
                    // The SDK's default `train_unembed=True`: the LM head is adapted too.
                    "lora_config": { "rank": 2, "seed": seed },
                }),
            )
            .await;
        assert_eq!(status, 200, "{future}");
        let v = self.result(key, &future).await;
        v["model_id"].as_str().unwrap().to_owned()
    }
}

/// A supervised datum: input `tokens`, targets shifted by one, every position weighted.
fn datum(tokens: &[u32], last: u32) -> Datum {
    let mut targets: Vec<i64> = tokens[1..].iter().map(|&t| t.into()).collect();
    targets.push(last.into());
    let mut d = Datum {
        chunks: vec![Chunk::Tokens(tokens.to_vec())],
        ..Datum::default()
    };
    d.loss_fn_inputs
        .insert("target_tokens".into(), Tensor::i64(&targets));
    d.loss_fn_inputs
        .insert("weights".into(), Tensor::f32(&vec![1.0; tokens.len()]));
    d
}

fn request(model_id: &str, seq_id: i64, loss: &str, data: Vec<Datum>) -> ForwardBackwardRequest {
    ForwardBackwardRequest {
        model_id: model_id.to_owned(),
        seq_id,
        data,
        loss_fn: loss.to_owned(),
        ..ForwardBackwardRequest::default()
    }
}

fn logprobs(output: &Value) -> Vec<f64> {
    output["loss_fn_outputs"][0]["logprobs"]["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect()
}

const TOKENS: [u32; 6] = [2, 17, 33, 8, 91, 5];

async fn optim_step(api: &Api, model: &str, seq_id: i64) -> Value {
    let body = json!({
        "model_id": model, "seq_id": seq_id,
        "adam_params": { "learning_rate": 0.05, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8 },
    });
    let (status, future) = api.post(KEY, "/api/v1/optim_step", &body).await;
    assert_eq!(status, 200, "{future}");
    future
}

#[tokio::test]
async fn a_training_step_its_retries_and_its_sampler_weights() {
    let api = api().await;
    let session = api.session(KEY).await;
    let a = api.create_model(KEY, &session, 7).await;
    let b = api.create_model(KEY, &session, 7).await;
    let fresh = {
        let req = request(&a, 1, "cross_entropy", vec![datum(&TOKENS, 4)]);
        let (status, future) = api.forward_backward(KEY, &req).await;
        assert_eq!(status, 200, "{future}");
        assert_eq!(future["model_id"], a.as_str());
        api.result(KEY, &future).await
    };
    assert_eq!(logprobs(&fresh).len(), TOKENS.len());
    let loss: f64 = -logprobs(&fresh).iter().sum::<f64>();
    assert!((fresh["metrics"]["loss:sum"].as_f64().unwrap() - loss).abs() < 1e-3);

    // The same optim_step sent twice (the SDK's retry: same seq_id) is one step: the second
    // answer is the first's future.
    let first = optim_step(&api, &a, 2).await;
    let again = optim_step(&api, &a, 2).await;
    assert_eq!(first["request_id"], again["request_id"]);
    let metrics = api.result(KEY, &first).await;
    assert!(metrics["metrics"]["grad_norm"].as_f64().unwrap() > 0.0);
    // Run b (same seed) takes exactly one step: a's weights must equal b's.
    let req = request(&b, 1, "cross_entropy", vec![datum(&TOKENS, 4)]);
    let (_, future) = api.forward_backward(KEY, &req).await;
    api.result(KEY, &future).await;
    api.result(KEY, &optim_step(&api, &b, 2).await).await;
    let forward = |model: &str, seq| {
        let mut req = request(model, seq, "cross_entropy", vec![datum(&TOKENS, 4)]);
        req.forward_only = true;
        req
    };
    let (_, fa) = api.forward_backward(KEY, &forward(&a, 3)).await;
    let (_, fb) = api.forward_backward(KEY, &forward(&b, 3)).await;
    let (la, lb) = (
        logprobs(&api.result(KEY, &fa).await),
        logprobs(&api.result(KEY, &fb).await),
    );
    assert_eq!(la, lb);
    assert_ne!(la, logprobs(&fresh), "the step changed nothing");
    // Each step's trained tokens count in the team's usage, under the run's store model.
    let start = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        - 3600;
    let usage: Value = api
        .server
        .get(&format!("/v1/usage?start={start}&group_by=model"))
        .await
        .json()
        .await
        .unwrap();
    let results: Vec<&Value> = usage["data"]
        .as_array()
        .unwrap_or_else(|| panic!("{usage}"))
        .iter()
        .flat_map(|b| b["results"].as_array().unwrap())
        .collect();
    let of = |model: &str| {
        let name = format!("default/tinker/run-{model}");
        results
            .iter()
            .find(|r| r["model"] == name.as_str())
            .copied()
    };
    for run in [&a, &b] {
        let r = of(run).unwrap_or_else(|| panic!("no usage of {run}: {usage}"));
        assert_eq!(r["trained_tokens"], TOKENS.len(), "{r}");
        assert_eq!(r["num_gradient_steps"], 1, "{r}");
    }

    // The policy losses read the sampler's logprobs and the advantages; their logprobs are the
    // same forward's.
    for (seq, loss) in [(4, "importance_sampling"), (5, "ppo"), (6, "cispo")] {
        let mut d = datum(&TOKENS, 4);
        d.loss_fn_inputs.remove("weights");
        let old: Vec<f32> = la.iter().map(|&x| x as f32 - 0.1).collect();
        d.loss_fn_inputs
            .insert("logprobs".into(), Tensor::f32(&old));
        d.loss_fn_inputs.insert(
            "advantages".into(),
            Tensor::f32(&[0.0, 0.0, 1.0, 1.0, -1.0, 0.5]),
        );
        let mut req = request(&a, seq, loss, vec![d]);
        if loss != "importance_sampling" {
            req.loss_fn_config = [(
                "clip_high_threshold".to_owned(),
                temper_http::tinker::proto::ConfigValue::Number(1.05),
            )]
            .into();
        }
        let (status, future) = api.forward_backward(KEY, &req).await;
        assert_eq!(status, 200, "{loss}: {future}");
        let out = api.result(KEY, &future).await;
        assert_eq!(logprobs(&out), la, "{loss}");
        assert!(
            out["metrics"]["loss:sum"].as_f64().unwrap().is_finite(),
            "{out}"
        );
    }
    // (Their gradients accumulate; no step follows, so the weights below are still a's.)

    // Sampler weights: a temper checkpoint served by name, listed in /v1/models.
    let (status, future) = api
        .post(
            KEY,
            "/api/v1/save_weights_for_sampler",
            &json!({ "model_id": a, "path": "w1", "seq_id": 7 }),
        )
        .await;
    assert_eq!(status, 200, "{future}");
    let saved = api.result(KEY, &future).await;
    assert_eq!(saved["path"], format!("tinker://{a}/sampler_weights/w1"));
    let models = api.server.get("/v1/models").await;
    let models: Value = models.json().await.unwrap();
    let name = format!("default/tinker/run-{a}:step1");
    assert!(
        models["data"]
            .as_array()
            .unwrap()
            .iter()
            .any(|m| m["id"] == name.as_str()),
        "{models}"
    );
    // Its prompt logprobs over /v1/completions are forward's (train/serve identity).
    let mut ids: Vec<u32> = TOKENS.to_vec();
    ids.push(4);
    let (status, served) = api
        .post(
            KEY,
            "/v1/completions",
            &json!({ "model": name, "prompt": ids, "max_tokens": 1, "prompt_logprobs": 0 }),
        )
        .await;
    assert_eq!(status, 200, "{served}");
    let served: Vec<f64> = served["choices"][0]["prompt_logprobs"]
        .as_array()
        .unwrap()
        .iter()
        .zip(&ids)
        .skip(1)
        .map(|(e, t)| e[t.to_string()]["logprob"].as_f64().unwrap())
        .collect();
    let as_f32 = |v: &[f64]| v.iter().map(|&x| x as f32).collect::<Vec<_>>();
    assert_eq!(as_f32(&served), as_f32(&la));

    // Sampling from the saved weights through a sampling session.
    let (status, s) = api
        .post(
            KEY,
            "/api/v1/create_sampling_session",
            &json!({ "session_id": session, "sampling_session_seq_id": 0,
                     "model_path": saved["path"] }),
        )
        .await;
    assert_eq!(status, 200, "{s}");
    let (status, future) = api
        .post(
            KEY,
            "/api/v1/asample",
            &json!({
                "sampling_session_id": s["sampling_session_id"], "seq_id": 0, "num_samples": 3,
                "prompt": { "chunks": [{ "type": "encoded_text", "tokens": TOKENS }] },
                "sampling_params": { "max_tokens": 4, "temperature": 1.0, "seed": 5 },
                "prompt_logprobs": true,
            }),
        )
        .await;
    assert_eq!(status, 200, "{future}");
    assert_eq!(future["sample_sequence_ids"].as_array().unwrap().len(), 3);
    let sample = api.result(KEY, &future).await;
    let sequences = sample["sequences"].as_array().unwrap();
    assert_eq!(sequences.len(), 3);
    for s in sequences {
        let n = s["tokens"].as_array().unwrap().len();
        assert!((1..=4).contains(&n), "{s}");
        assert_eq!(s["logprobs"].as_array().unwrap().len(), n);
    }
    let prompt_lps = sample["prompt_logprobs"].as_array().unwrap();
    assert_eq!(prompt_lps.len(), TOKENS.len());
    assert!(prompt_lps[0].is_null());
}

#[tokio::test]
async fn another_teams_objects_and_bad_input() {
    let api = api().await;
    let other = api.other_team().await;
    let session = api.session(KEY).await;
    let model = api.create_model(KEY, &session, 1).await;
    let req = request(&model, 1, "cross_entropy", vec![datum(&TOKENS, 4)]);
    let (_, future) = api.forward_backward(KEY, &req).await;

    // Another team: the future, the model and the session are as absent as missing ones.
    let (status, v) = api
        .post(
            &other,
            "/api/v1/retrieve_future",
            &json!({ "request_id": future["request_id"] }),
        )
        .await;
    assert_eq!(status, 404, "{v}");
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .contains("does not exist"));
    let (status, _) = api
        .post(&other, "/api/v1/get_info", &json!({ "model_id": model }))
        .await;
    assert_eq!(status, 404);
    let (status, _) = api.forward_backward(&other, &req).await;
    assert_eq!(status, 404);
    let (status, _) = api
        .post(
            &other,
            "/api/v1/session_heartbeat",
            &json!({ "session_id": session }),
        )
        .await;
    assert_eq!(status, 404);
    api.result(KEY, &future).await;

    // Bad input: a 400 naming the field, before any future exists.
    let bad = |loss: &str, data: Vec<Datum>| request(&model, 0, loss, data);
    let (status, v) = api
        .forward_backward(KEY, &bad("no_such_loss", vec![datum(&TOKENS, 4)]))
        .await;
    assert_eq!(
        (status, v["error"]["param"].as_str()),
        (400, Some("loss_fn")),
        "{v}"
    );
    let mut short = datum(&TOKENS, 4);
    short
        .loss_fn_inputs
        .insert("weights".into(), Tensor::f32(&[1.0, 1.0]));
    let (status, v) = api
        .forward_backward(KEY, &bad("cross_entropy", vec![short]))
        .await;
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["param"], "data[0].loss_fn_inputs.weights");
    let mut shifted = datum(&TOKENS, 4);
    shifted
        .loss_fn_inputs
        .insert("target_tokens".into(), Tensor::i64(&[1, 2, 3, 4, 5, 6]));
    let (status, v) = api
        .forward_backward(KEY, &bad("cross_entropy", vec![shifted]))
        .await;
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["param"], "data[0].loss_fn_inputs.target_tokens");
    let (status, v) = api
        .forward_backward(KEY, &bad("importance_sampling", vec![datum(&TOKENS, 4)]))
        .await;
    assert_eq!(status, 400, "{v}");
    assert!(
        v["error"]["message"].as_str().unwrap().contains("logprobs"),
        "{v}"
    );
    let (status, v) = api
        .forward_backward(KEY, &bad("cross_entropy", vec![]))
        .await;
    assert_eq!(status, 400, "{v}");
    let resp = api
        .server
        .client
        .post(api.server.url("/api/v1/forward_backward"))
        .header("x-api-key", format!("tml-{KEY}"))
        .body(vec![0x0a, 0x05, 1])
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 400);

    // Unknown models and what temper cannot train.
    let (status, v) = api
        .post(
            KEY,
            "/api/v1/get_info",
            &json!({ "model_id": "no-such-model" }),
        )
        .await;
    assert_eq!(status, 404, "{v}");
    let create = |base: &str, lora: Value| json!({ "session_id": session, "model_seq_id": 1, "base_model": base, "lora_config": lora });
    for (body, param) in [
        (
            create("no-such-base", json!({ "rank": 2, "train_unembed": false })),
            "base_model",
        ),
        (
            create("tiny", json!({ "rank": 0, "train_unembed": false })),
            "lora_config.rank",
        ),
        (
            create(
                "tiny",
                json!({ "rank": 2, "train_unembed": false, "train_mlp": false,
                        "train_attn": false }),
            ),
            "lora_config",
        ),
    ] {
        let (status, v) = api.post(KEY, "/api/v1/create_model", &body).await;
        assert_eq!(
            (status, v["error"]["param"].as_str()),
            (400, Some(param)),
            "{v}"
        );
    }
    // Attention only (the MLP pairs stay frozen: crates/train/tests/step.rs): it trains.
    let (status, future) = api
        .post(
            KEY,
            "/api/v1/create_model",
            &create("tiny", json!({ "rank": 2, "train_mlp": false })),
        )
        .await;
    assert_eq!(status, 200, "{future}");
    let attention_only = api.result(KEY, &future).await["model_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let req = request(&attention_only, 1, "cross_entropy", vec![datum(&TOKENS, 4)]);
    let (_, future) = api.forward_backward(KEY, &req).await;
    api.result(KEY, &future).await;
    let stepped = api
        .result(KEY, &optim_step(&api, &attention_only, 2).await)
        .await;
    assert!(
        stepped["metrics"]["grad_norm"].as_f64().unwrap() > 0.0,
        "{stepped}"
    );
    let (status, v) = api
        .post(
            KEY,
            "/api/v1/optim_step",
            &json!({ "model_id": model, "adam_params": { "learning_rate": -1.0 } }),
        )
        .await;
    assert_eq!(status, 400, "{v}");
    let (status, v) = api
        .post(
            KEY,
            "/api/v1/asample",
            &json!({
                "base_model": "tiny", "num_samples": 1, "topk_prompt_logprobs": 2,
                "prompt": { "chunks": [{ "type": "encoded_text", "tokens": [1, 2] }] },
                "sampling_params": {},
            }),
        )
        .await;
    assert_eq!(
        (status, v["error"]["param"].as_str()),
        (400, Some("topk_prompt_logprobs"))
    );
    // A failure inside a future comes back as the SDK's `{"error", "category"}`.
    let (status, v) = api
        .post(
            KEY,
            "/api/v1/asample",
            &json!({
                "base_model": "tiny", "num_samples": 1,
                "prompt": { "chunks": [{ "type": "encoded_text", "tokens": [1, 2] }] },
                "sampling_params": { "temperature": -3.0 },
            }),
        )
        .await;
    assert_eq!(status, 200, "{v}");
    let failed = api.result(KEY, &v).await;
    assert_eq!(failed["category"], "user", "{failed}");
    assert!(
        failed["error"].as_str().unwrap().contains("temperature"),
        "{failed}"
    );
}

#[tokio::test]
async fn without_a_store_training_is_a_400_not_a_retried_503() {
    let s = TestServer::tiny(common::options(), None).await;
    let (_, session) = call(
        &s,
        KEY,
        "/api/v1/create_session",
        Some(&json!({"tags": []})),
    )
    .await;
    let body = json!({ "session_id": session["session_id"], "base_model": "tiny",
        "lora_config": { "rank": 2, "train_unembed": false } });
    let (status, v) = call(&s, KEY, "/api/v1/create_model", Some(&body)).await;
    assert_eq!(status, 400);
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("--data-dir"),
        "{v}"
    );
    // Sampling the base model needs no store.
    let (_, caps) = call(&s, KEY, "/api/v1/get_server_capabilities", None).await;
    assert_eq!(caps["supported_models"][0]["trainable"], false, "{caps}");
    assert_eq!(caps["supported_models"][0]["sampleable"], true, "{caps}");
}
