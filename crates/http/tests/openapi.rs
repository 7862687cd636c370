//! The OpenAPI document (`GET /openapi.json`, `crates/http/src/openapi.json`) held to the server:
//! every path the router serves is documented with exactly the methods it serves; each request
//! schema lists exactly the fields its request type accepts; and real answers of the tiny model,
//! errors and stream chunks included, have documented statuses, headers, content types and
//! bodies that match the documented schemas, for every documented operation.
//! (`scripts/openapi-tests.sh` checks the document against the OpenAPI 3.1 schema itself.)

mod common;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use common::{options, parse_sse, TestServer, KEY};
use futures_util::StreamExt;
use reqwest::Method;
use serde::de::{Deserialize, Visitor};
use serde_json::{json, Value};
use temper_http::{CatalogOptions, ServerOptions, TrainingOptions};

fn document() -> Value {
    serde_json::from_str(temper_http::openapi::DOCUMENT).expect("openapi.json is JSON")
}

/// `{id}`, `{model_id}`, … all become `{}`: the router and the document may name a path
/// parameter differently.
fn normalize(path: &str) -> String {
    let mut out = String::new();
    let mut in_param = false;
    for c in path.chars() {
        match c {
            '{' => {
                in_param = true;
                out.push_str("{}");
            }
            '}' => in_param = false,
            c if !in_param => out.push(c),
            _ => {}
        }
    }
    out
}

const HTTP_METHODS: [&str; 8] = [
    "get", "put", "post", "delete", "options", "head", "patch", "trace",
];

/// Every documented `(normalized path, METHOD)`.
fn documented_operations(doc: &Value) -> BTreeSet<(String, String)> {
    let mut ops = BTreeSet::new();
    for (path, item) in doc["paths"].as_object().unwrap() {
        for method in HTTP_METHODS {
            if item.get(method).is_some() {
                ops.insert((normalize(path), method.to_uppercase()));
            }
        }
    }
    ops
}

fn essence(content_type: &str) -> String {
    content_type
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase()
}

#[tokio::test]
async fn the_document_is_served_without_a_key() {
    let s = TestServer::tiny(options(), None).await;
    let resp = s.client.get(s.url("/openapi.json")).send().await.unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    assert_eq!(resp.headers()["content-type"], "application/json");
    let served: Value = resp.json().await.unwrap();
    assert_eq!(served, document());
    assert_eq!(served["openapi"], "3.1.0");
    assert_eq!(served["info"]["version"], env!("CARGO_PKG_VERSION"));
    // The document itself says which routes need no key.
    let no_key = s.client.get(s.url("/v1/models")).send().await.unwrap();
    assert_eq!(no_key.status().as_u16(), 401);
    for (path, item) in served["paths"].as_object().unwrap() {
        for (method, op) in item.as_object().unwrap() {
            let public = op.get("security") == Some(&json!([]));
            assert_eq!(
                public,
                ["/health", "/openapi.json", "/dashboard"].contains(&path.as_str()),
                "{method} {path}: its `security` says a key is {}needed",
                if public { "not " } else { "" }
            );
        }
    }
}

/// The router's own list of paths (`route_paths`, the table it mounts) is probed with every
/// method: whatever is not the 405 fallback is served. That set and the document's must match.
#[tokio::test]
async fn every_route_is_documented_and_every_documented_operation_is_served() {
    // Without a store the training routes are still routed (they answer 503).
    let s = TestServer::tiny(options(), None).await;
    let doc = document();
    let mut served = BTreeSet::new();
    for path in temper_http::route_paths() {
        let concrete = normalize(path).replace("{}", UNKNOWN_ID);
        for method in [
            Method::GET,
            Method::POST,
            Method::PUT,
            Method::PATCH,
            Method::DELETE,
        ] {
            let resp = s
                .client
                .request(method.clone(), s.url(&concrete))
                .bearer_auth(KEY)
                .send()
                .await
                .unwrap();
            let status = resp.status().as_u16();
            let text = resp.text().await.unwrap();
            if status == 405 {
                let v: Value = serde_json::from_str(&text).unwrap();
                assert_eq!(v["error"]["type"], "MethodNotAllowedError", "{v}");
                continue;
            }
            assert!(
                !(status == 404 && text.contains("No route for")),
                "route_paths lists {path}, which the router does not serve"
            );
            served.insert((normalize(path), method.to_string()));
        }
    }
    let documented = documented_operations(&doc);
    let undocumented: Vec<_> = served.difference(&documented).collect();
    let unserved: Vec<_> = documented.difference(&served).collect();
    assert!(
        undocumented.is_empty() && unserved.is_empty(),
        "served but not in openapi.json: {undocumented:?}; in openapi.json but not served: \
         {unserved:?}"
    );
}

/// An id nothing has.
const UNKNOWN_ID: &str = "0b7e4a52-3f1c-4d8e-9a6b-2c5d7e8f9a01";

// ---- request fields ----

/// What a probe of a serde type found: the field names it accepts (aliases included).
#[derive(Debug)]
enum Probe {
    Fields(&'static [&'static str]),
    Other(String),
}

impl std::fmt::Display for Probe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Probe::Fields(fields) => write!(f, "fields {fields:?}"),
            Probe::Other(message) => f.write_str(message),
        }
    }
}

impl std::error::Error for Probe {}

impl serde::de::Error for Probe {
    fn custom<T: std::fmt::Display>(msg: T) -> Self {
        Probe::Other(msg.to_string())
    }
}

/// A deserializer that only answers a struct's request for its fields, with the list.
struct FieldProbe;

impl<'de> serde::Deserializer<'de> for FieldProbe {
    type Error = Probe;

    fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Probe> {
        Err(Probe::Other("not a struct".to_owned()))
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _: &'static str,
        fields: &'static [&'static str],
        _: V,
    ) -> Result<V::Value, Probe> {
        Err(Probe::Fields(fields))
    }

    serde::forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf
        option unit unit_struct newtype_struct seq tuple tuple_struct map enum identifier
        ignored_any
    }
}

/// The field names `T` deserializes.
fn fields<'de, T: Deserialize<'de>>() -> BTreeSet<String> {
    match T::deserialize(FieldProbe) {
        Err(Probe::Fields(fields)) => fields.iter().map(|f| f.to_string()).collect(),
        Err(other) => panic!("{}: {other}", std::any::type_name::<T>()),
        Ok(_) => unreachable!(),
    }
}

fn schema_properties(doc: &Value, schema: &str) -> BTreeSet<String> {
    doc["components"]["schemas"][schema]["properties"]
        .as_object()
        .unwrap_or_else(|| panic!("no schema {schema} with properties"))
        .keys()
        .cloned()
        .collect()
}

fn query_parameters(doc: &Value, path: &str) -> BTreeSet<String> {
    doc["paths"][path]["get"]["parameters"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| resolve(doc, "", p).1)
        .filter(|p| p["in"] == "query")
        .map(|p| p["name"].as_str().unwrap().to_owned())
        .collect()
}

/// A request type's fields are the documented properties of its schema, no more, no less: a
/// field added to a type without documenting it (or documented and not accepted) fails here.
#[test]
fn request_schemas_list_exactly_the_accepted_fields() {
    use temper_http::protocol as p;
    use temper_http::training::wire as w;
    let doc = document();
    let types: Vec<(BTreeSet<String>, &str)> = vec![
        (
            fields::<p::ChatCompletionRequest>(),
            "ChatCompletionRequest",
        ),
        (fields::<p::CompletionRequest>(), "CompletionRequest"),
        (fields::<p::StreamOptionsField>(), "StreamOptions"),
        (fields::<p::RequestMessage>(), "ChatMessage"),
        (fields::<temper_text::ChatMessage>(), "ChatMessage"),
        (fields::<p::ContentPartField>(), "TextContentPart"),
        (fields::<p::ToolCallField>(), "ToolCall"),
        (fields::<temper_text::ToolCall>(), "ToolCall"),
        (fields::<p::FunctionCallField>(), "FunctionCall"),
        (fields::<temper_text::FunctionCall>(), "FunctionCall"),
        (fields::<temper_text::ToolDef>(), "Tool"),
        (fields::<temper_text::FunctionDef>(), "FunctionDefinition"),
        (fields::<p::ResponseFormat>(), "ResponseFormat"),
        (fields::<p::JsonSchemaFormat>(), "JsonSchemaFormat"),
        (fields::<p::TagStructureField>(), "TagStructure"),
        (fields::<p::StructuredOutputs>(), "StructuredOutputs"),
        (fields::<p::TokenizeRequest>(), "TokenizeRequest"),
        (fields::<p::DetokenizeRequest>(), "DetokenizeRequest"),
        (fields::<w::CreateModelRequest>(), "CreateModelRequest"),
        (
            fields::<w::DeleteCheckpointsRequest>(),
            "DeleteCheckpointsRequest",
        ),
        (fields::<w::LogRequest>(), "LogRequest"),
        (fields::<temper_train::LogGroup>(), "LogTrajectoryGroup"),
        (fields::<temper_train::LogTrajectory>(), "LogTrajectory"),
        (fields::<w::CreateJobRequest>(), "CreateTrainingJobRequest"),
        (fields::<w::CreateSftJobRequest>(), "CreateSftJobRequest"),
        (fields::<temper_train::TrajectoryGroup>(), "TrajectoryGroup"),
        (fields::<temper_train::Trajectory>(), "Trajectory"),
        (fields::<temper_train::History>(), "History"),
        (fields::<temper_train::Choice>(), "Choice"),
        (fields::<temper_train::ChoiceLogprobs>(), "SampledLogprobs"),
        (fields::<temper_train::TokenLogprob>(), "SampledToken"),
        (
            fields::<temper_train::ExperimentalConfig>(),
            "ExperimentalConfig",
        ),
        (fields::<temper_train::SftTrajectory>(), "SftTrajectory"),
        (fields::<temper_train::SftConfig>(), "SftConfig"),
    ];
    let mut drift = Vec::new();
    for (accepted, schema) in types {
        let documented = schema_properties(&doc, schema);
        if accepted != documented {
            drift.push(format!(
                "{schema}: accepted, not documented {:?}; documented, not accepted {:?}",
                accepted.difference(&documented).collect::<Vec<_>>(),
                documented.difference(&accepted).collect::<Vec<_>>()
            ));
        }
    }
    for (accepted, path) in [
        (
            fields::<w::CheckpointQuery>(),
            "/v1/preview/models/{model_id}/checkpoints",
        ),
        (
            fields::<temper_http::training::adapters::ExportQuery>(),
            "/v1/preview/models/{model_id}/checkpoints/{step}/adapter",
        ),
        (fields::<w::JobQuery>(), "/v1/preview/training-jobs"),
        (
            fields::<w::EventQuery>(),
            "/v1/preview/training-jobs/{job_id}/events",
        ),
        (fields::<temper_http::usage::UsageQuery>(), "/v1/usage"),
    ] {
        let documented = query_parameters(&doc, path);
        if accepted != documented {
            drift.push(format!(
                "GET {path}: query {accepted:?} accepted, {documented:?} documented"
            ));
        }
    }
    assert!(drift.is_empty(), "{}", drift.join("\n"));
}

// ---- real responses ----

/// Follows `$ref`s from `value` (found at JSON pointer `at`): the pointer and the value reached.
fn resolve(doc: &Value, at: &str, value: &Value) -> (String, Value) {
    let (mut at, mut value) = (at.to_owned(), value.clone());
    while let Some(r) = value.get("$ref").and_then(Value::as_str) {
        at = r.strip_prefix('#').expect("local $ref").to_owned();
        value = doc
            .pointer(&at)
            .unwrap_or_else(|| panic!("$ref #{at} points nowhere"))
            .clone();
    }
    (at, value)
}

fn escape(token: &str) -> String {
    token.replace('~', "~0").replace('/', "~1")
}

/// An instance checked against the schema at `pointer` of the document, `$ref`s resolved in it.
fn check_schema(doc: &Value, pointer: &str, instance: &Value, what: &str) {
    let mut root = doc.clone();
    // A URI fragment: the pointer's `{` and `}` (path templates) percent-encoded.
    let fragment = pointer.replace('{', "%7B").replace('}', "%7D");
    root["$ref"] = json!(format!("#{fragment}"));
    let validator = jsonschema::draft202012::options()
        .should_validate_formats(true)
        .build(&root)
        .unwrap_or_else(|e| panic!("the schema at {pointer} does not compile: {e}"));
    let errors: Vec<String> = validator
        .iter_errors(instance)
        .map(|e| format!("{e} (at {})", e.instance_path))
        .collect();
    if !errors.is_empty() {
        let text = instance.to_string();
        let shown: String = text.chars().take(2000).collect();
        panic!(
            "{what} does not match {pointer}:\n{}\n{shown}",
            errors.join("\n")
        );
    }
}

/// A request of the test.
struct Call<'a> {
    method: &'a str,
    /// As documented (`/v1/preview/models/{model_id}`).
    template: &'a str,
    /// With the parameters filled in, and a query string.
    path: String,
    key: Option<&'a str>,
    headers: Vec<(&'a str, String)>,
    body: Option<Value>,
    /// A body sent as is (not JSON).
    raw: Option<Vec<u8>>,
}

impl<'a> Call<'a> {
    fn new(method: &'a str, template: &'a str) -> Self {
        Call {
            method,
            template,
            path: template.to_owned(),
            key: Some(KEY),
            headers: Vec::new(),
            body: None,
            raw: None,
        }
    }

    fn at(mut self, path: impl Into<String>) -> Self {
        self.path = path.into();
        self
    }

    fn json(mut self, body: Value) -> Self {
        self.body = Some(body);
        self
    }

    fn raw(mut self, body: Vec<u8>) -> Self {
        self.raw = Some(body);
        self
    }

    fn without_key(mut self) -> Self {
        self.key = None;
        self
    }

    fn header(mut self, name: &'a str, value: impl Into<String>) -> Self {
        self.headers.push((name, value.into()));
        self
    }
}

/// Sends calls and checks each answer against the document; remembers which operations were
/// answered with success.
struct Checker {
    doc: Value,
    succeeded: BTreeSet<(String, String)>,
}

/// An answer: headers and the body (JSON, or a string; an SSE stream as its list of
/// `data:` payloads).
struct Answer {
    headers: reqwest::header::HeaderMap,
    body: Value,
}

impl Checker {
    async fn send(&mut self, s: &TestServer, call: Call<'_>, expect: u16) -> Answer {
        let doc = &self.doc;
        let path_item = format!("/paths/{}", escape(call.template));
        let op_at = format!("{path_item}/{}", call.method.to_ascii_lowercase());
        let op = doc
            .pointer(&op_at)
            .unwrap_or_else(|| panic!("{} {} is not documented", call.method, call.template))
            .clone();
        let what = format!("{} {}", call.method, call.path);
        if let (Some(body), true) = (&call.body, (200..300).contains(&expect)) {
            // A request the server accepts is one the document allows.
            let at = format!("{op_at}/requestBody/content/application~1json/schema");
            check_schema(doc, &at, body, &format!("the body of {what}"));
        }
        let mut req = s
            .client
            .request(call.method.parse().unwrap(), s.url(&call.path));
        if let Some(key) = call.key {
            req = req.bearer_auth(key);
        }
        for (name, value) in &call.headers {
            req = req.header(*name, value);
        }
        if let Some(body) = &call.body {
            req = req.json(body);
        }
        if let Some(raw) = call.raw {
            if !call
                .headers
                .iter()
                .any(|(name, _)| name.eq_ignore_ascii_case("content-type"))
            {
                req = req.header("content-type", "application/json");
            }
            req = req.body(raw);
        }
        let resp = req.send().await.unwrap();
        let status = resp.status().as_u16();
        let headers = resp.headers().clone();
        let text = resp.text().await.unwrap();
        assert_eq!(status, expect, "{what}: {text}");

        let responses = &op["responses"];
        let response = responses
            .get(status.to_string())
            .unwrap_or_else(|| panic!("{what}: status {status} is not documented"));
        let (response_at, response) =
            resolve(doc, &format!("{op_at}/responses/{status}"), response);
        for (name, header) in response["headers"].as_object().into_iter().flatten() {
            let (_, header) = resolve(doc, "", header);
            if header["required"] == true {
                assert!(
                    headers.contains_key(name.as_str()),
                    "{what}: no documented header {name}"
                );
            }
        }
        let body = match response.get("content") {
            None => {
                assert!(text.is_empty(), "{what}: undocumented body {text:?}");
                Value::Null
            }
            Some(content) => {
                let content_type = essence(
                    headers
                        .get("content-type")
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or(""),
                );
                let (media, _) = content
                    .as_object()
                    .unwrap()
                    .iter()
                    .find(|(media, _)| essence(media) == content_type)
                    .unwrap_or_else(|| {
                        panic!("{what}: content type {content_type:?} is not documented")
                    });
                let schema_at = format!("{response_at}/content/{}/schema", escape(media));
                match content_type.as_str() {
                    "application/json" => {
                        let v: Value = serde_json::from_str(&text).unwrap();
                        check_schema(doc, &schema_at, &v, &what);
                        v
                    }
                    "text/event-stream" => {
                        let events = parse_sse(&text);
                        assert_eq!(events.last(), Some(&json!("[DONE]")), "{what}");
                        for event in &events[..events.len() - 1] {
                            check_schema(doc, &schema_at, event, &format!("an event of {what}"));
                        }
                        Value::Array(events)
                    }
                    _ => {
                        let v = Value::String(text);
                        check_schema(doc, &schema_at, &v, &what);
                        v
                    }
                }
            }
        };
        if (200..300).contains(&status) {
            self.succeeded
                .insert((call.template.to_owned(), call.method.to_owned()));
        }
        Answer { headers, body }
    }

    /// An error from outside any operation (the router's fallbacks).
    async fn fallback(&self, s: &TestServer, method: Method, path: &str, expect: u16) {
        let resp = s
            .client
            .request(method, s.url(path))
            .bearer_auth(KEY)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status().as_u16(), expect);
        assert!(resp.headers().contains_key("x-request-id"));
        let v: Value = resp.json().await.unwrap();
        check_schema(
            &self.doc,
            "/components/schemas/ErrorEnvelope",
            &v,
            &format!("the fallback answer to {path}"),
        );
        assert_eq!(v["error"]["code"], expect);
    }
}

fn user(text: &str) -> Value {
    json!([{"role": "user", "content": text}])
}

fn tools() -> Value {
    json!([{"type": "function", "function": {"name": "get_time",
        "description": "The current time."}}])
}

/// A group the trainer can learn from: two answers of different rewards, sampled tokens given.
fn trajectory_groups() -> Value {
    let choice = |token: &str, reward: f64| {
        json!({"messages_and_choices": [
            {"role": "user", "content": "q"},
            {"message": {"role": "assistant", "content": "x"}, "finish_reason": "stop",
             "index": 0, "logprobs": {"content": [{"token": token, "logprob": -0.1}]}}],
            "reward": reward, "metrics": {"correct": reward > 0.5}})
    };
    json!([{"trajectories": [choice("token_id:5", 1.0), choice("token_id:6", 0.0)]}])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_responses_match_the_documented_schemas() {
    let data = tempfile::tempdir().unwrap();
    let training = TrainingOptions {
        max_queued_jobs_per_team: Some(1),
        max_body_bytes: 1 << 20,
        ..TrainingOptions::default()
    };
    let server_options = ServerOptions {
        enable_tool_calls: true,
        max_body_bytes: 64 << 10,
        ..options()
    };
    let s = TestServer::tiny_training(
        server_options,
        CatalogOptions::new(data.path()),
        training,
        None,
    )
    .await;
    let mut c = Checker {
        doc: document(),
        succeeded: BTreeSet::new(),
    };
    let chat = "/v1/chat/completions";

    // Open routes.
    c.send(&s, Call::new("GET", "/health").without_key(), 200)
        .await;
    c.send(&s, Call::new("GET", "/openapi.json").without_key(), 200)
        .await;
    c.send(&s, Call::new("GET", "/dashboard").without_key(), 200)
        .await;

    // Training: models, the job queue, logs.
    let models = "/v1/preview/models";
    let create = json!({"entity": null, "project": "docs", "name": "agent", "base_model": "tiny"});
    let model = c
        .send(&s, Call::new("POST", models).json(create.clone()), 200)
        .await;
    let model_id = model.body["id"].as_str().unwrap().to_owned();
    c.send(&s, Call::new("POST", models).json(create.clone()), 409)
        .await;
    let mut existing = create.clone();
    existing["return_existing"] = json!(true);
    let again = c
        .send(&s, Call::new("POST", models).json(existing), 200)
        .await;
    assert_eq!(again.body["id"], model_id.as_str());
    let second = json!({"project": "docs", "name": "sft", "base_model": "tiny"});
    for replayed in [false, true] {
        let a = c
            .send(
                &s,
                Call::new("POST", models)
                    .json(second.clone())
                    .header("Idempotency-Key", "doc-key-1"),
                200,
            )
            .await;
        assert_eq!(a.headers.contains_key("idempotent-replayed"), replayed);
    }
    c.send(
        &s,
        Call::new("POST", models).json(json!({"entity": "other-team", "project": "p",
            "name": "n", "base_model": "tiny"})),
        404,
    )
    .await;
    c.send(
        &s,
        Call::new("POST", models).json(json!({"project": "p", "name": "n", "base_model": "tiny",
            "colour": "red"})),
        400,
    )
    .await;
    c.send(&s, Call::new("GET", models), 200).await;
    let one = "/v1/preview/models/{model_id}";
    c.send(
        &s,
        Call::new("GET", one).at(format!("{models}/{model_id}")),
        200,
    )
    .await;
    c.send(
        &s,
        Call::new("GET", one).at(format!("{models}/not-a-uuid")),
        400,
    )
    .await;
    c.send(
        &s,
        Call::new("GET", one).at(format!("{models}/{UNKNOWN_ID}")),
        404,
    )
    .await;

    let log = "/v1/preview/models/{model_id}/log";
    c.send(
        &s,
        Call::new("POST", log)
            .at(format!("{models}/{model_id}/log"))
            .json(json!({"model_id": model_id, "split": "val",
                "trajectory_groups": trajectory_groups()})),
        200,
    )
    .await;

    let jobs = "/v1/preview/training-jobs";
    let rl_job = json!({"model_id": model_id, "trajectory_groups": trajectory_groups(),
        "experimental_config": {"learning_rate": 1e-4, "ppo": null, "kimi_k2_tau": 0.01}});
    let queued = c
        .send(&s, Call::new("POST", jobs).json(rl_job.clone()), 200)
        .await;
    let queued_id = queued.body["id"].as_str().unwrap().to_owned();
    // No worker runs yet: the job stays queued, and the team's queue (1 job) is full.
    c.send(&s, Call::new("POST", jobs).json(rl_job.clone()), 429)
        .await;
    c.send(
        &s,
        Call::new("POST", jobs).raw(vec![b'x'; (1 << 20) + 1]),
        413,
    )
    .await;
    c.send(
        &s,
        Call::new("GET", jobs).at(format!("{jobs}?model_id={model_id}&limit=10")),
        200,
    )
    .await;
    c.send(
        &s,
        Call::new("GET", jobs).at(format!("{jobs}?limit=0")),
        400,
    )
    .await;
    let job = "/v1/preview/training-jobs/{job_id}";
    c.send(
        &s,
        Call::new("GET", job).at(format!("{jobs}/{queued_id}")),
        200,
    )
    .await;
    let cancel = "/v1/preview/training-jobs/{job_id}/cancel";
    let cancelled = c
        .send(
            &s,
            Call::new("POST", cancel).at(format!("{jobs}/{queued_id}/cancel")),
            200,
        )
        .await;
    assert_eq!(cancelled.body["status"], "cancelled");
    c.send(
        &s,
        Call::new("POST", cancel).at(format!("{jobs}/{queued_id}/cancel")),
        409,
    )
    .await;

    // An SFT job, then an RL job, run by the worker: their events and checkpoints.
    let sft = c
        .send(
            &s,
            Call::new("POST", "/v1/preview/sft-training-jobs").json(json!({
                "model_id": model_id,
                "trajectories": [{"messages": [{"role": "user", "content": "q"},
                                               {"role": "assistant", "content": "a"}]}],
                "config": {"learning_rate": 1e-4, "batch_size": null, "epochs": 1}})),
            200,
        )
        .await;
    let sft_id = sft.body["id"].as_str().unwrap().to_owned();
    s.state.training().unwrap().spawn_worker().unwrap();
    wait_succeeded(&s, &sft_id).await;
    let rl = c.send(&s, Call::new("POST", jobs).json(rl_job), 200).await;
    let rl_id = rl.body["id"].as_str().unwrap().to_owned();
    wait_succeeded(&s, &rl_id).await;
    let events = "/v1/preview/training-jobs/{job_id}/events";
    for id in [&sft_id, &rl_id] {
        let page = c
            .send(
                &s,
                Call::new("GET", events).at(format!("{jobs}/{id}/events?after=0&limit=100")),
                200,
            )
            .await;
        let types: Vec<&str> = page.body["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["type"].as_str().unwrap())
            .collect();
        assert!(types.contains(&"gradient_step"), "{types:?}");
    }
    c.send(
        &s,
        Call::new("GET", events).at(format!("{jobs}/{rl_id}/events?after=-1")),
        400,
    )
    .await;
    let checkpoints = "/v1/preview/models/{model_id}/checkpoints";
    let page = c
        .send(
            &s,
            Call::new("GET", checkpoints).at(format!(
                "{models}/{model_id}/checkpoints?order=desc&limit=2"
            )),
            200,
        )
        .await;
    assert_eq!(page.body["data"][0]["step"], 2, "{}", page.body);
    c.send(
        &s,
        Call::new("GET", checkpoints).at(format!("{models}/{model_id}/checkpoints?colour=red")),
        400,
    )
    .await;

    // Step 2's adapter exported (a PEFT tar, a llama.cpp GGUF) and imported back as step 3.
    let adapter = "/v1/preview/models/{model_id}/checkpoints/{step}/adapter";
    let at = |query: &str| format!("{models}/{model_id}/checkpoints/2/adapter{query}");
    for (query, file) in [("?format=peft", "peft.tar"), ("?format=gguf", "lora.gguf")] {
        let a = c
            .send(&s, Call::new("GET", adapter).at(at(query)), 200)
            .await;
        let disposition = a.headers["content-disposition"].to_str().unwrap();
        assert!(
            disposition.ends_with(&format!("-step2-{file}\"")),
            "{disposition}"
        );
    }
    c.send(&s, Call::new("GET", adapter).at(at("?format=onnx")), 400)
        .await;
    let peft = s.get(&at("")).await.bytes().await.unwrap().to_vec();
    let import = |body: Vec<u8>| {
        Call::new("POST", checkpoints)
            .at(format!("{models}/{model_id}/checkpoints"))
            .header("content-type", "application/x-tar")
            .raw(body)
    };
    let imported = c.send(&s, import(peft), 200).await;
    assert_eq!(imported.body["step"], 3, "{}", imported.body);
    c.send(&s, import(b"no tar".repeat(100)), 400).await;

    // Serving, with the trained checkpoints listed and served by name.
    c.send(&s, Call::new("GET", "/metrics"), 200).await;
    let usage = c
        .send(
            &s,
            Call::new("GET", "/v1/usage").at(format!(
                "/v1/usage?start={}&bucket_width=1h&group_by=project,model",
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap()
                    .as_secs()
                    - 3600
            )),
            200,
        )
        .await;
    assert!(!usage.body["data"].as_array().unwrap().is_empty());
    c.send(
        &s,
        Call::new("GET", "/v1/usage").at("/v1/usage?start=yesterday".to_owned()),
        400,
    )
    .await;
    let listed = c.send(&s, Call::new("GET", "/v1/models"), 200).await;
    assert!(listed.body["data"]
        .as_array()
        .unwrap()
        .iter()
        .any(|m| m["id"] == "default/docs/agent:step2" && m["parent"] == "tiny"));
    c.send(
        &s,
        Call::new("GET", "/v1/models").header("OpenAI-Project", "no-slash"),
        400,
    )
    .await;
    c.send(
        &s,
        Call::new("POST", chat).json(json!({"messages": user("hi"),
            "model": "default/docs/agent:step1", "max_completion_tokens": 4, "n": 2,
            "temperature": 1, "seed": 1, "logprobs": true, "top_logprobs": 2,
            "return_token_ids": true, "return_tokens_as_token_ids": true,
            "prompt_logprobs": 1, "service_tier": "auto", "request_id": "doc-1"})),
        200,
    )
    .await;
    let streamed = c
        .send(
            &s,
            Call::new("POST", chat).json(json!({"messages": user("hi"),
                "max_completion_tokens": 4, "stream": true, "logprobs": true,
                "return_token_ids": true,
                "stream_options": {"include_usage": true, "continuous_usage_stats": true}})),
            200,
        )
        .await;
    assert!(streamed.body.as_array().unwrap().len() > 3);
    // Tool calls, whole and streamed.
    let calls = json!({"messages": user("What time is it?"), "tools": tools(),
        "tool_choice": "required", "parallel_tool_calls": false, "max_completion_tokens": 300,
        "seed": 3});
    let answer = c
        .send(&s, Call::new("POST", chat).json(calls.clone()), 200)
        .await;
    assert_eq!(answer.body["choices"][0]["finish_reason"], "tool_calls");
    let mut stream_calls = calls;
    stream_calls["stream"] = json!(true);
    let events = c
        .send(&s, Call::new("POST", chat).json(stream_calls), 200)
        .await;
    assert!(events
        .body
        .as_array()
        .unwrap()
        .iter()
        .any(|e| e["choices"][0]["delta"]["tool_calls"].is_array()));
    c.send(
        &s,
        Call::new("POST", chat).json(json!({"messages": user("hi"), "temperature": 3})),
        400,
    )
    .await;
    // Completions: a trained checkpoint, echo with logprobs, best_of, prompt forms, streamed.
    let completions = "/v1/completions";
    let answer = c
        .send(
            &s,
            Call::new("POST", completions).json(json!({"prompt": "hi",
                "model": "default/docs/agent:step1", "max_tokens": 4, "n": 2, "best_of": 3,
                "temperature": 1, "seed": 1, "echo": true, "logprobs": 2, "prompt_logprobs": 1,
                "return_token_ids": true, "return_tokens_as_token_ids": true,
                "request_id": "doc-2", "stop": ["zz"], "user": "u"})),
            200,
        )
        .await;
    assert_eq!(answer.body["choices"].as_array().unwrap().len(), 2);
    c.send(
        &s,
        Call::new("POST", completions).json(json!({"prompt": [[2, 5, 6], [2, 7]],
            "max_tokens": 0, "echo": true, "logprobs": 0, "add_special_tokens": false})),
        200,
    )
    .await;
    let streamed = c
        .send(
            &s,
            Call::new("POST", completions).json(json!({"prompt": ["hi", "there"],
                "max_tokens": 4, "n": 2, "temperature": 1, "stream": true, "echo": true,
                "logprobs": 1, "return_token_ids": true,
                "stream_options": {"include_usage": true, "continuous_usage_stats": true}})),
            200,
        )
        .await;
    assert!(streamed.body.as_array().unwrap().len() > 5);
    c.send(
        &s,
        Call::new("POST", completions).json(json!({"prompt": "hi", "suffix": "there"})),
        400,
    )
    .await;
    c.send(
        &s,
        Call::new("POST", completions).json(json!({"prompt": "hi", "model": "gpt-9"})),
        404,
    )
    .await;
    c.send(
        &s,
        Call::new("POST", completions)
            .json(json!({"prompt": "hi"}))
            .without_key(),
        401,
    )
    .await;
    c.send(
        &s,
        Call::new("POST", completions).raw(vec![b' '; (64 << 10) + 1]),
        413,
    )
    .await;
    c.send(
        &s,
        Call::new("POST", chat).json(json!({"messages": user("hi"), "model": "gpt-9"})),
        404,
    )
    .await;
    c.send(
        &s,
        Call::new("POST", chat)
            .json(json!({"messages": user("hi")}))
            .without_key(),
        401,
    )
    .await;
    c.send(
        &s,
        Call::new("POST", chat).raw(vec![b' '; (64 << 10) + 1]),
        413,
    )
    .await;

    c.send(
        &s,
        Call::new("POST", "/tokenize").json(json!({"model": "tiny", "prompt": "hello there",
            "return_token_strs": true})),
        200,
    )
    .await;
    let tokens = c
        .send(
            &s,
            Call::new("POST", "/tokenize").json(json!({"messages": user("hello"),
                "tools": tools()})),
            200,
        )
        .await;
    c.send(
        &s,
        Call::new("POST", "/tokenize").json(json!({"prompt": "a", "messages": user("b")})),
        400,
    )
    .await;
    c.send(
        &s,
        Call::new("POST", "/detokenize").json(json!({"tokens": tokens.body["tokens"]})),
        200,
    )
    .await;
    c.send(
        &s,
        Call::new("POST", "/detokenize").json(json!({"model": "nope", "tokens": [1]})),
        404,
    )
    .await;

    // Deleting.
    let deleted = c
        .send(
            &s,
            Call::new("DELETE", checkpoints)
                .at(format!("{models}/{model_id}/checkpoints"))
                .json(json!({"steps": [1, 7]})),
            200,
        )
        .await;
    assert_eq!(deleted.body["not_found_steps"], json!([7]));
    c.send(
        &s,
        Call::new("DELETE", one).at(format!("{models}/{model_id}")),
        200,
    )
    .await;
    c.send(
        &s,
        Call::new("DELETE", one).at(format!("{models}/{model_id}")),
        404,
    )
    .await;

    // The router's own fallbacks answer in the envelope too.
    c.fallback(&s, Method::GET, "/v1/nothing-here", 404).await;
    c.fallback(&s, Method::PUT, "/v1/models", 405).await;

    tinker_calls(&mut c, &s).await;

    // A server without the store: the training API is off; one team's burst past its share.
    let base_only = TestServer::tiny(
        ServerOptions {
            max_requests_per_team: Some(1),
            ..options()
        },
        None,
    )
    .await;
    c.send(&base_only, Call::new("GET", models), 503).await;
    let long = base_only
        .post(
            chat,
            &json!({"messages": user("hello"), "max_completion_tokens": 1900,
                "ignore_eos": true, "stream": true}),
        )
        .send()
        .await
        .unwrap();
    let mut body = long.bytes_stream();
    body.next().await.unwrap().unwrap();
    c.send(
        &base_only,
        Call::new("POST", chat).json(json!({"messages": user("hi"), "max_completion_tokens": 2})),
        429,
    )
    .await;
    c.send(
        &base_only,
        Call::new("POST", "/v1/completions").json(json!({"prompt": "hi", "max_tokens": 2})),
        429,
    )
    .await;
    drop(body);

    // Every documented operation answered with success at least once above.
    let succeeded: BTreeSet<_> = c
        .succeeded
        .iter()
        .map(|(path, method)| (normalize(path), method.clone()))
        .collect();
    let documented = documented_operations(&c.doc);
    let missing: Vec<_> = documented.difference(&succeeded).collect();
    assert!(
        missing.is_empty(),
        "documented operations this test never saw succeed: {missing:?}"
    );
}

/// Every Tinker API operation once, in the SDK's order: session, run, a step, weights, sampling,
/// listings.
async fn tinker_calls(c: &mut Checker, s: &TestServer) {
    use temper_http::tinker::proto::{Chunk, Datum, ForwardBackwardRequest, Tensor};
    for (method, path) in [
        ("GET", "/api/v1/healthz"),
        ("POST", "/api/v1/client/config"),
        ("POST", "/api/v1/client/dynamic_config"),
        ("POST", "/api/v1/telemetry"),
        ("GET", "/api/v1/get_server_capabilities"),
    ] {
        let call = Call::new(method, path);
        let call = if method == "POST" {
            call.json(json!({}))
        } else {
            call
        };
        c.send(s, call, 200).await;
    }
    let session = c
        .send(
            s,
            Call::new("POST", "/api/v1/create_session").json(json!({"tags": []})),
            200,
        )
        .await
        .body["session_id"]
        .clone();
    let heartbeat = json!({"session_id": session});
    c.send(
        s,
        Call::new("POST", "/api/v1/session_heartbeat").json(heartbeat),
        200,
    )
    .await;
    let create = json!({"session_id": session, "base_model": "tiny",
        "lora_config": {"rank": 2, "seed": 1, "train_unembed": false}});
    let future = c
        .send(
            s,
            Call::new("POST", "/api/v1/create_model").json(create),
            200,
        )
        .await;
    let result = |future: Value| {
        let body = json!({"request_id": future["request_id"]});
        Call::new("POST", "/api/v1/retrieve_future").json(body)
    };
    let model = c.send(s, result(future.body), 200).await.body["model_id"].clone();
    let model_id = model.as_str().unwrap();
    c.send(
        s,
        Call::new("POST", "/api/v1/get_info").json(json!({"model_id": model})),
        200,
    )
    .await;
    let mut datum = Datum {
        chunks: vec![Chunk::Tokens(vec![2, 17, 33])],
        ..Datum::default()
    };
    datum
        .loss_fn_inputs
        .insert("target_tokens".into(), Tensor::i64(&[17, 33, 4]));
    datum
        .loss_fn_inputs
        .insert("weights".into(), Tensor::f32(&[1.0; 3]));
    let step = ForwardBackwardRequest {
        model_id: model_id.to_owned(),
        seq_id: 1,
        data: vec![datum],
        loss_fn: "cross_entropy".into(),
        ..ForwardBackwardRequest::default()
    };
    let future = c
        .send(
            s,
            Call::new("POST", "/api/v1/forward_backward")
                .raw(step.encode())
                .header("content-type", "application/x-protobuf"),
            200,
        )
        .await;
    c.send(s, result(future.body), 200).await;
    let calls = [
        (
            "/api/v1/optim_step",
            json!({"model_id": model, "seq_id": 2,
            "adam_params": {"learning_rate": 0.01}}),
        ),
        (
            "/api/v1/save_weights",
            json!({"model_id": model, "seq_id": 3, "path": "s1"}),
        ),
        (
            "/api/v1/load_weights",
            json!({"model_id": model, "seq_id": 4,
            "path": format!("tinker://{model_id}/weights/s1"), "optimizer": true}),
        ),
        (
            "/api/v1/save_weights_for_sampler",
            json!({"model_id": model, "seq_id": 5,
            "path": "w1"}),
        ),
    ];
    for (path, body) in calls {
        let future = c.send(s, Call::new("POST", path).json(body), 200).await;
        c.send(s, result(future.body), 200).await;
    }
    let sampler = c
        .send(
            s,
            Call::new("POST", "/api/v1/create_sampling_session").json(json!({
                "session_id": session,
                "model_path": format!("tinker://{model_id}/sampler_weights/w1"),
            })),
            200,
        )
        .await
        .body["sampling_session_id"]
        .clone();
    let sampler_path = format!("/api/v1/samplers/{}", sampler.as_str().unwrap());
    c.send(
        s,
        Call::new("GET", "/api/v1/samplers/{id}").at(sampler_path),
        200,
    )
    .await;
    let sample = json!({"sampling_session_id": sampler, "seq_id": 0, "num_samples": 2,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [2, 17]}]},
        "sampling_params": {"max_tokens": 2}});
    let future = c
        .send(s, Call::new("POST", "/api/v1/asample").json(sample), 200)
        .await;
    let cancel = json!({"request_id": future.body["request_id"]});
    c.send(s, result(future.body), 200).await;
    c.send(
        s,
        Call::new("POST", "/api/v1/cancel_future").json(cancel),
        200,
    )
    .await;
    let run = format!("/api/v1/training_runs/{model_id}");
    c.send(s, Call::new("GET", "/api/v1/training_runs"), 200)
        .await;
    c.send(
        s,
        Call::new("GET", "/api/v1/training_runs/{id}").at(&run),
        200,
    )
    .await;
    let checkpoints = "/api/v1/training_runs/{id}/checkpoints";
    c.send(
        s,
        Call::new("GET", checkpoints).at(format!("{run}/checkpoints")),
        200,
    )
    .await;
    c.send(s, Call::new("GET", "/api/v1/checkpoints"), 200)
        .await;
    let delete = "/api/v1/training_runs/{id}/checkpoints/{kind}/{name}";
    let at = format!("{run}/checkpoints/sampler_weights/w1");
    c.send(s, Call::new("DELETE", delete).at(at), 200).await;
}

async fn wait_succeeded(s: &TestServer, job: &str) {
    let start = Instant::now();
    loop {
        let j: Value = s
            .get(&format!("/v1/preview/training-jobs/{job}"))
            .await
            .json()
            .await
            .unwrap();
        match j["status"].as_str().unwrap() {
            "succeeded" => return,
            "queued" | "running" => {}
            _ => panic!("job {job}: {j}"),
        }
        assert!(start.elapsed() < Duration::from_secs(120), "job {job}: {j}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
