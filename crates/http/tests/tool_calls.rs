//! Tool calls through HTTP (`--enable-tool-calls`): on the tiny random model, a `required` or
//! named `tool_choice` constrains any output to calls of the right functions whose arguments
//! match their schemas, streamed calls reassemble to the non-streamed ones, and the refusals;
//! on the real default model (when present), the same through the shipped template.

mod common;

use common::{check_stream, options, TestServer};
use serde_json::{json, Value};
use temper_http::ServerOptions;

fn tool_options() -> ServerOptions {
    ServerOptions {
        enable_tool_calls: true,
        ..options()
    }
}

fn tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_weather",
            "description": "The weather of a city over the next days.",
            "parameters": {"type": "object",
                "properties": {"city": {"type": "string", "maxLength": 12},
                               "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                "required": ["city", "days"], "additionalProperties": false}}},
        {"type": "function", "function": {"name": "get_time",
            "description": "The current time."}},
    ])
}

fn body(extra: Value) -> Value {
    let mut body = json!({"messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": tools(), "max_completion_tokens": 300});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

/// A call as the API shows it, checked against `tools()`; returns its function name.
fn check_call(call: &Value) -> String {
    let id = call["id"].as_str().unwrap();
    assert!(id.starts_with("chatcmpl-tool-") && id.len() > 20, "{call}");
    assert_eq!(call["type"], "function");
    let name = call["function"]["name"].as_str().unwrap();
    let arguments = call["function"]["arguments"].as_str().unwrap();
    let args: Value = serde_json::from_str(arguments)
        .unwrap_or_else(|e| panic!("arguments {arguments:?} do not parse: {e}"));
    let args = args.as_object().unwrap();
    match name {
        "get_weather" => {
            assert_eq!(args.len(), 2, "{arguments}");
            assert!(args["city"].as_str().unwrap().chars().count() <= 12);
            assert!((1..=7).contains(&args["days"].as_u64().unwrap()));
        }
        "get_time" => assert!(args.is_empty(), "{arguments}"),
        other => panic!("unknown function {other}"),
    }
    name.to_owned()
}

/// Every choice called tools and said nothing else; the names of the calls per choice.
fn called(v: &Value) -> Vec<Vec<String>> {
    v["choices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            assert_eq!(c["finish_reason"], "tool_calls", "{c}");
            assert!(c["message"]["content"].is_null(), "{c}");
            c["message"]["tool_calls"]
                .as_array()
                .unwrap()
                .iter()
                .map(check_call)
                .collect()
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn required_output_is_always_valid_calls() {
    let s = TestServer::tiny(tool_options(), None).await;
    let mut names = std::collections::HashSet::new();
    for seed in 0..3 {
        let (status, v) = s
            .chat(&body(
                json!({"tool_choice": "required", "parallel_tool_calls": false,
                "temperature": 1, "seed": seed, "n": 4}),
            ))
            .await;
        assert_eq!(status, 200, "{v}");
        for calls in called(&v) {
            assert_eq!(calls.len(), 1, "parallel_tool_calls: false");
            names.extend(calls);
        }
    }
    assert_eq!(names.len(), 2, "both functions get called: {names:?}");
    // Parallel calls: one or more per choice, each valid (a choice the budget cut mid-call
    // keeps its finished calls; none is cut here).
    let (status, v) = s
        .chat(&body(
            json!({"tool_choice": "required", "temperature": 1, "seed": 9, "n": 4,
            "max_completion_tokens": 1000}),
        ))
        .await;
    assert_eq!(status, 200, "{v}");
    assert!(called(&v).iter().all(|calls| !calls.is_empty()));
}

/// A Llama 3.x template asks for bare JSON calls (`{"name", "parameters"}`): calls are
/// constrained and found in that format, here through a request's template.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn llama3_templates_get_llama3_json_calls() {
    let template = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../text/tests/fixtures/templates/llama3.1.jinja"
    ))
    .unwrap();
    let s = TestServer::tiny(
        ServerOptions {
            trust_request_chat_template: true,
            ..tool_options()
        },
        None,
    )
    .await;
    for parallel in [false, true] {
        let (status, v) = s
            .chat(&body(
                json!({"tool_choice": "required", "chat_template": template,
                "parallel_tool_calls": parallel, "temperature": 1, "seed": 3, "n": 3,
                "return_token_ids": true}),
            ))
            .await;
        assert_eq!(status, 200, "{v}");
        for (calls, choice) in called(&v).iter().zip(v["choices"].as_array().unwrap()) {
            assert!(
                !calls.is_empty() && (parallel || calls.len() == 1),
                "{choice}"
            );
            // The raw output is the bare JSON answer, not `<tool_call>` blocks.
            let ids: Vec<u32> = serde_json::from_value(choice["token_ids"].clone()).unwrap();
            let text = s.post_ok("/detokenize", &json!({"tokens": ids})).await;
            let text = text["prompt"].as_str().unwrap();
            assert!(text.starts_with("{\"name\": "), "{text:?}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_named_function_is_the_only_one_called() {
    let s = TestServer::tiny(tool_options(), None).await;
    for name in ["get_weather", "get_time"] {
        let (status, v) = s
            .chat(&body(
                json!({"tool_choice": {"type": "function", "function": {"name": name}},
                "temperature": 1, "seed": 4, "n": 4, "parallel_tool_calls": false}),
            ))
            .await;
        assert_eq!(status, 200, "{v}");
        for calls in called(&v) {
            assert_eq!(calls, [name]);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_calls_reassemble_to_the_non_streamed_ones() {
    let s = TestServer::tiny(tool_options(), None).await;
    for extra in [
        json!({"tool_choice": "required", "seed": 11}),
        json!({"tool_choice": "required", "seed": 12, "parallel_tool_calls": false}),
        json!({"tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "seed": 13}),
        // Unconstrained: whatever the random model says, streamed and whole agree.
        json!({"tool_choice": "auto", "seed": 14, "max_completion_tokens": 40}),
    ] {
        let mut request = body(extra);
        request["temperature"] = json!(1);
        request["n"] = json!(2);
        let (status, whole) = s.chat(&request).await;
        assert_eq!(status, 200, "{whole}");
        request["stream"] = json!(true);
        let (streamed, _) = check_stream(&s.chat_stream(&request).await, 2);
        for (c, w) in streamed.iter().zip(whole["choices"].as_array().unwrap()) {
            assert_eq!(c.finish_reason.as_deref(), w["finish_reason"].as_str());
            assert_eq!(c.content, w["message"]["content"].as_str().unwrap_or(""));
            let strip_ids = |calls: &[Value]| -> Vec<Value> {
                calls.iter().map(|call| call["function"].clone()).collect()
            };
            let whole_calls = w["message"]["tool_calls"]
                .as_array()
                .map(|a| strip_ids(a))
                .unwrap_or_default();
            assert_eq!(strip_ids(&c.tool_calls), whole_calls, "{request}");
            c.tool_calls.iter().for_each(|call| {
                check_call(call);
            });
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_choice_refusals_name_the_field() {
    let off = TestServer::tiny(options(), None).await;
    for choice in [json!("auto"), json!("required")] {
        let (status, v) = off.chat(&body(json!({"tool_choice": choice}))).await;
        assert_eq!(status, 400, "{v}");
        assert_eq!(v["error"]["param"], "tool_choice");
        assert!(
            v["error"]["message"]
                .as_str()
                .unwrap()
                .contains("--enable-tool-calls"),
            "{v}"
        );
    }
    // Without the flag, "none" is served as before: no parsing, no tool_calls.
    let (status, v) = off
        .chat(&body(
            json!({"tool_choice": "none", "max_completion_tokens": 5}),
        ))
        .await;
    assert_eq!(status, 200, "{v}");
    assert!(v["choices"][0]["message"]["content"].is_string());
    assert!(v["choices"][0]["message"].get("tool_calls").is_none());

    let on = TestServer::tiny(tool_options(), None).await;
    for (extra, param) in [
        (
            json!({"tool_choice": {"type": "function", "function": {"name": "nope"}}}),
            "tool_choice",
        ),
        (json!({"tool_choice": "sometimes"}), "tool_choice"),
        (
            json!({"tool_choice": "required", "response_format": {"type": "json_object"}}),
            "tool_choice",
        ),
        // A schema llguidance cannot compile is the tools' fault.
        (
            json!({"tool_choice": "required", "tools": [{"type": "function", "function":
                {"name": "f", "parameters": {"type": "object",
                    "properties": {"a": {"type": "no-such-type"}}}}}]}),
            "tools",
        ),
    ] {
        let (status, v) = on.chat(&body(extra.clone())).await;
        assert_eq!(status, 400, "{extra}: {v}");
        assert_eq!(v["error"]["param"], param, "{extra}: {v}");
    }
}

async fn real_server() -> Option<TestServer> {
    let path = temper_model::paths::real_model_for_tests()?;
    Some(TestServer::model("gemma-3-270m", &path, tool_options()).await)
}

/// The default model through the shipped template: required calls are valid at temperature 0
/// and 1, streamed the same, and a conversation with a call and its result renders and runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn default_model_calls_tools() {
    let Some(s) = real_server().await else { return };
    let (status, v) = s
        .chat(&body(
            json!({"tool_choice": "required", "temperature": 0, "parallel_tool_calls": false}),
        ))
        .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(called(&v), [["get_weather"]]);
    // With parallel calls the small model tends to go on calling until the budget ends (the
    // call it was writing then stays content); every finished call is valid.
    let (status, v) = s
        .chat(&body(json!({"tool_choice": "required", "temperature": 0})))
        .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "tool_calls");
    let calls = v["choices"][0]["message"]["tool_calls"].as_array().unwrap();
    assert!(!calls.is_empty());
    calls.iter().for_each(|c| {
        check_call(c);
    });
    let mut request = body(
        json!({"tool_choice": "required", "temperature": 1, "seed": 5, "n": 3,
        "parallel_tool_calls": false}),
    );
    let (status, whole) = s.chat(&request).await;
    assert_eq!(status, 200, "{whole}");
    for calls in called(&whole) {
        assert_eq!(calls.len(), 1);
    }
    request["stream"] = json!(true);
    let (streamed, _) = check_stream(&s.chat_stream(&request).await, 3);
    for (c, w) in streamed.iter().zip(whole["choices"].as_array().unwrap()) {
        assert_eq!(c.finish_reason.as_deref(), Some("tool_calls"));
        assert_eq!(c.tool_calls.len(), 1);
        assert_eq!(
            c.tool_calls[0]["function"],
            w["message"]["tool_calls"][0]["function"]
        );
    }
    // The call and its result back in the conversation: the model answers (or calls again).
    let call = &whole["choices"][0]["message"]["tool_calls"][0];
    let (status, v) = s
        .chat(&json!({"messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": null, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": "Sunny, 24 C."},
        ], "tools": tools(), "temperature": 0, "max_completion_tokens": 30}))
        .await;
    assert_eq!(status, 200, "{v}");
    let choice = &v["choices"][0];
    assert!(
        choice["message"]["content"].is_string() || choice["message"]["tool_calls"].is_array(),
        "{v}"
    );
}
