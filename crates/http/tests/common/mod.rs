//! A real server on 127.0.0.1:0 over a real model and engine, plus SSE parsing.

#![allow(dead_code)] // each test binary uses a different part of this module

use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use std::sync::Arc;

use temper_http::{
    AppState, Catalog, CatalogOptions, ModelSpec, ServedModel, ServerOptions, TrainingOptions,
    TrainingService,
};

pub const KEY: &str = "test-key";

pub struct TestServer {
    pub base: String,
    pub state: AppState,
    pub client: reqwest::Client,
    _dir: Option<tempfile::TempDir>,
}

impl TestServer {
    /// Serves the tiny random Gemma-3-shaped model (written and loaded through the real code).
    pub async fn tiny(options: ServerOptions, max_model_len: Option<usize>) -> TestServer {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tiny.gguf");
        temper_model::tiny::write_tiny_gguf(&path, 7).unwrap();
        let mut spec = ModelSpec::new("tiny", &path);
        spec.max_model_len = max_model_len;
        let mut server = Self::start(&spec, options).await;
        server._dir = Some(dir);
        server
    }

    pub async fn model(name: &str, path: &Path, options: ServerOptions) -> TestServer {
        Self::start(&ModelSpec::new(name, path), options).await
    }

    /// The tiny model with the catalog over a store in `catalog.data_dir` and the training
    /// service.
    pub async fn tiny_training(
        options: ServerOptions,
        catalog: CatalogOptions,
        training: TrainingOptions,
        max_model_len: Option<usize>,
    ) -> TestServer {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tiny.gguf");
        temper_model::tiny::write_tiny_gguf(&path, 7).unwrap();
        let mut spec = ModelSpec::new("tiny", &path);
        spec.max_model_len = max_model_len;
        let model = ServedModel::load(&spec).unwrap();
        let mut server = Self::with_training(vec![model], options, catalog, training).await;
        server._dir = Some(dir);
        server
    }

    /// `models` with the catalog over a store in `catalog.data_dir` and the training service.
    pub async fn with_training(
        models: Vec<ServedModel>,
        options: ServerOptions,
        catalog: CatalogOptions,
        training: TrainingOptions,
    ) -> TestServer {
        let bases = models.iter().map(|m| m.base.clone()).collect();
        let catalog = Arc::new(Catalog::open(bases, &catalog).await.unwrap());
        let training = TrainingService::open(training, catalog.clone())
            .await
            .unwrap();
        let state =
            AppState::with_catalog(models, options, catalog, Some(Arc::new(training))).unwrap();
        Self::serve(state).await
    }

    /// [`TestServer::tiny_training`] with the default options and a store in `data`.
    pub async fn tiny_training_in(data: &Path) -> TestServer {
        Self::tiny_training(
            options(),
            CatalogOptions::new(data),
            TrainingOptions::default(),
            None,
        )
        .await
    }

    async fn start(spec: &ModelSpec, options: ServerOptions) -> TestServer {
        let model = ServedModel::load(spec).unwrap();
        Self::serve(AppState::new(vec![model], options).unwrap()).await
    }

    async fn serve(state: AppState) -> TestServer {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(temper_http::serve(
            listener,
            state.clone(),
            std::future::pending(),
        ));
        TestServer {
            base,
            state,
            client: reqwest::Client::new(),
            _dir: None,
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// An authenticated POST of `body`.
    pub fn post(&self, path: &str, body: &Value) -> reqwest::RequestBuilder {
        self.client.post(self.url(path)).bearer_auth(KEY).json(body)
    }

    /// An authenticated GET.
    pub async fn get(&self, path: &str) -> reqwest::Response {
        self.client
            .get(self.url(path))
            .bearer_auth(KEY)
            .send()
            .await
            .unwrap()
    }

    /// An authenticated POST of `body` that must answer 200; its JSON.
    pub async fn post_ok(&self, path: &str, body: &Value) -> Value {
        let resp = self.post(path, body).send().await.unwrap();
        let status = resp.status().as_u16();
        let v: Value = resp.json().await.unwrap();
        assert_eq!(status, 200, "POST {path}: {v}");
        v
    }

    pub async fn chat(&self, body: &Value) -> (u16, Value) {
        let resp = self
            .post("/v1/chat/completions", body)
            .send()
            .await
            .unwrap();
        let status = resp.status().as_u16();
        (status, resp.json().await.unwrap())
    }

    /// A streamed completion: the `data:` payloads in order (`[DONE]` as the string).
    pub async fn chat_stream(&self, body: &Value) -> Vec<Value> {
        let resp = self
            .post("/v1/chat/completions", body)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status().as_u16(), 200);
        assert_eq!(
            resp.headers()["content-type"].to_str().unwrap(),
            "text/event-stream"
        );
        parse_sse(&resp.text().await.unwrap())
    }

    pub fn engine_stats(&self) -> temper_engine::EngineStats {
        self.state.models()[0].engine.stats()
    }

    /// Waits until the engine has nothing running or waiting.
    pub async fn wait_idle(&self, within: Duration) -> temper_engine::EngineStats {
        let start = Instant::now();
        loop {
            let s = self.engine_stats();
            if s.running == 0 && s.waiting == 0 {
                return s;
            }
            assert!(start.elapsed() < within, "engine still busy: {s:?}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

/// Log-softmax of every row of the served model's logits for `tokens`, from one plain forward.
pub fn direct_log_softmax(server: &TestServer, tokens: &[u32]) -> Vec<Vec<f64>> {
    let model = &server.state.models()[0].model;
    let mut cache = model.new_cache();
    let logits = model
        .forward(&mut [temper_model::SeqInput {
            tokens,
            cache: &mut cache,
            all_logits: true,
            adapter: None,
        }])
        .unwrap();
    (0..tokens.len())
        .map(|i| {
            let row = logits[0].row(i);
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
            let lse = max
                + row
                    .iter()
                    .map(|&v| (v as f64 - max).exp())
                    .sum::<f64>()
                    .ln();
            row.iter().map(|&v| v as f64 - lse).collect()
        })
        .collect()
}

pub fn options() -> ServerOptions {
    ServerOptions {
        api_keys: vec![KEY.to_owned()],
        ..ServerOptions::default()
    }
}

/// Splits an SSE body into its `data:` payloads; every event must be exactly `data: …\n\n`.
pub fn parse_sse(body: &str) -> Vec<Value> {
    assert!(
        body.ends_with("\n\n"),
        "unterminated event stream: {body:?}"
    );
    body.trim_end_matches("\n\n")
        .split("\n\n")
        .map(|event| {
            let data = event
                .strip_prefix("data: ")
                .unwrap_or_else(|| panic!("not a data event: {event:?}"));
            assert!(!data.contains('\n'), "multi-line event: {event:?}");
            if data == "[DONE]" {
                Value::String("[DONE]".into())
            } else {
                serde_json::from_str(data).unwrap()
            }
        })
        .collect()
}

/// What a stream says per choice.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct StreamedChoice {
    pub content: String,
    pub token_ids: Vec<u64>,
    pub finish_reason: Option<String>,
    pub finish_chunks: usize,
    /// Tool calls reassembled from their deltas as OpenAI clients do: a call's first delta has
    /// its `index`, `id`, `type` and `function.name`; `function.arguments` pieces are appended.
    pub tool_calls: Vec<Value>,
}

/// Checks the chunk grammar of chat.md and collects each choice:
/// role chunk first per choice, one choice per chunk, exactly one finish chunk per choice, an
/// optional usage chunk with `choices: []`, `[DONE]` last.
pub fn check_stream(events: &[Value], n: usize) -> (Vec<StreamedChoice>, Option<Value>) {
    assert_eq!(
        events.last().unwrap(),
        "[DONE]",
        "stream must end with [DONE]"
    );
    let mut choices = vec![StreamedChoice::default(); n];
    let mut opened = vec![false; n];
    let mut usage = None;
    let id = events[0]["id"].as_str().unwrap().to_owned();
    for ev in &events[..events.len() - 1] {
        assert!(ev.get("error").is_none(), "error event: {ev}");
        assert_eq!(ev["object"], "chat.completion.chunk");
        assert_eq!(ev["id"], id.as_str());
        let cs = ev["choices"].as_array().unwrap();
        if cs.is_empty() {
            assert!(usage.is_none(), "two usage chunks");
            usage = Some(ev["usage"].clone());
            continue;
        }
        assert!(usage.is_none(), "chunk after the usage chunk");
        assert_eq!(cs.len(), 1, "one choice per chunk");
        let c = &cs[0];
        let i = c["index"].as_u64().unwrap() as usize;
        let delta = &c["delta"];
        if !opened[i] {
            assert_eq!(
                delta["role"], "assistant",
                "first chunk of choice {i}: {ev}"
            );
            assert_eq!(delta["content"], "");
            opened[i] = true;
            continue;
        }
        assert!(delta.get("role").is_none());
        assert_eq!(choices[i].finish_chunks, 0, "chunk after finish: {ev}");
        if let Some(t) = delta["content"].as_str() {
            choices[i].content.push_str(t);
        }
        for call in delta["tool_calls"].as_array().into_iter().flatten() {
            let k = call["index"].as_u64().unwrap() as usize;
            let calls = &mut choices[i].tool_calls;
            let arguments = call["function"]["arguments"].as_str().unwrap_or("");
            if k == calls.len() {
                assert!(
                    call["id"].is_string(),
                    "a call's first delta has its id: {ev}"
                );
                assert_eq!(call["type"], "function", "{ev}");
                calls.push(json!({"id": call["id"], "type": "function",
                    "function": {"name": call["function"]["name"], "arguments": arguments}}));
            } else {
                let so_far = calls[k]["function"]["arguments"]
                    .as_str()
                    .unwrap()
                    .to_owned();
                calls[k]["function"]["arguments"] = json!(so_far + arguments);
            }
        }
        if let Some(ids) = c["token_ids"].as_array() {
            choices[i]
                .token_ids
                .extend(ids.iter().map(|v| v.as_u64().unwrap()));
        }
        if let Some(r) = c["finish_reason"].as_str() {
            choices[i].finish_reason = Some(r.to_owned());
            choices[i].finish_chunks += 1;
        }
    }
    for (i, c) in choices.iter().enumerate() {
        assert!(opened[i], "choice {i} has no role chunk");
        assert_eq!(c.finish_chunks, 1, "choice {i} finish chunks");
    }
    (choices, usage)
}
