//! The prompt- and response-side fields (tools, documents, reasoning_effort, reasoning parser,
//! echo, truncate_prompt_tokens, extension fields) through the real router on the tiny model.

mod common;

use std::sync::{Arc, Mutex};

use common::{check_stream, options, TestServer};
use serde_json::{json, Value};
use temper_http::extras::RequestExtras;
use temper_http::protocol::ServiceTier;
use temper_http::validation::{ChatParams, CompletionParams};
use temper_http::{ApiError, RequestHook, ServerOptions};

fn trusted() -> ServerOptions {
    ServerOptions {
        trust_request_chat_template: true,
        ..options()
    }
}

/// Prints what the template was given, so the prompt tokens show whether a field arrived.
const SHOW_FIELDS: &str = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}\
{% if tools %}{% for t in tools %}TOOL {{ t.function.name }} {{ t.function.parameters | tojson }}\n{% endfor %}{% endif %}\
{% if documents %}{% for d in documents %}DOC {{ d.title }}: {{ d.text }}\n{% endfor %}{% endif %}\
{% if reasoning_effort %}EFFORT {{ reasoning_effort }}\n{% endif %}model:";

/// The prompt text a request was rendered to (its `prompt_token_ids`, detokenized).
async fn prompt_text(s: &TestServer, extra: Value) -> String {
    let mut body = json!({"messages": [{"role": "user", "content": "weather?"}],
        "max_completion_tokens": 1, "return_token_ids": true, "chat_template": SHOW_FIELDS});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    let (status, v) = s.chat(&body).await;
    assert_eq!(status, 200, "{v}");
    let r = s
        .post("/detokenize", &json!({"tokens": v["prompt_token_ids"]}))
        .send()
        .await
        .unwrap();
    let d: Value = r.json().await.unwrap();
    d["prompt"].as_str().unwrap().to_owned()
}

#[tokio::test]
async fn tools_documents_and_reasoning_effort_reach_the_template() {
    let s = TestServer::tiny(trusted(), None).await;
    let plain = prompt_text(&s, json!({})).await;
    assert!(!plain.contains("TOOL") && !plain.contains("DOC") && !plain.contains("EFFORT"));
    let tools = json!([{"type": "function", "function": {"name": "get_weather",
        "description": "d", "parameters": {"type": "object"}, "strict": true}}]);
    let text = prompt_text(
        &s,
        json!({"tools": tools, "tool_choice": "none",
            "documents": [{"title": "Paris", "text": "sunny"}], "reasoning_effort": "high"}),
    )
    .await;
    assert!(
        text.contains(r#"TOOL get_weather {"type": "object"}"#),
        "{text}"
    );
    assert!(text.contains("DOC Paris: sunny"), "{text}");
    assert!(text.contains("EFFORT high"), "{text}");

    // /tokenize with messages takes tools too (as vLLM's chat tokenize request).
    let tok = |tools: Option<Value>| {
        let mut body = json!({"messages": [{"role": "user", "content": "weather?"}],
            "chat_template": SHOW_FIELDS});
        if let Some(t) = tools {
            body["tools"] = t;
        }
        s.post("/tokenize", &body).send()
    };
    let without: Value = tok(None).await.unwrap().json().await.unwrap();
    let with: Value = tok(Some(tools)).await.unwrap().json().await.unwrap();
    assert!(with["count"].as_u64() > without["count"].as_u64(), "{with}");
}

#[tokio::test]
async fn tool_and_field_shapes_are_400s() {
    let s = TestServer::tiny(trusted(), None).await;
    let bad = [
        (json!({"tools": []}), "tools"),
        (
            json!({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}),
            "tools[0].type",
        ),
        (json!({"tools": [{"type": "function"}]}), "tools[0]"),
        (
            json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]}),
            "tools[0].function.parameters",
        ),
        (json!({"documents": [{"title": 1}]}), "documents[0].title"),
        (json!({"reasoning_effort": "max"}), "reasoning_effort"),
        (
            json!({"truncate_prompt_tokens": -2}),
            "truncate_prompt_tokens",
        ),
        (
            json!({"truncate_prompt_tokens": 0}),
            "truncate_prompt_tokens",
        ),
        (
            json!({"mm_processor_kwargs": {"size": 3}}),
            "mm_processor_kwargs",
        ),
        (json!({"cache_salt": ""}), "cache_salt"),
        (json!({"engine_xargs": {"a": {"b": 1}}}), "engine_xargs.a"),
        (json!({"engine_xargs": {"a": [1, true]}}), "engine_xargs.a"),
        (json!({"kv_transfer_params": [1]}), "kv_transfer_params"),
        (json!({"service_tier": "gold"}), "service_tier"),
    ];
    for (extra, param) in bad {
        let mut body = json!({"messages": [{"role": "user", "content": "hi"}],
            "max_completion_tokens": 1});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        let (status, v) = s.chat(&body).await;
        assert_eq!(status, 400, "{extra}: {v}");
        assert_eq!(v["error"]["param"], param, "{extra}: {v}");
    }
}

#[tokio::test]
async fn truncate_prompt_tokens_keeps_the_last_k() {
    let s = TestServer::tiny(options(), Some(256)).await;
    let body = |extra: Value| {
        let mut b = json!({"messages": [{"role": "user", "content": "one two three four five six"}],
            "max_completion_tokens": 1, "return_token_ids": true});
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        b
    };
    let (_, full) = s.chat(&body(json!({}))).await;
    let full_ids = full["prompt_token_ids"].as_array().unwrap().clone();
    assert!(full_ids.len() > 5);
    let (status, v) = s.chat(&body(json!({"truncate_prompt_tokens": 5}))).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["usage"]["prompt_tokens"], 5);
    assert_eq!(
        v["prompt_token_ids"].as_array().unwrap(),
        &full_ids[full_ids.len() - 5..]
    );
    // -1 = the context length: this prompt fits, so nothing is cut.
    let (_, v) = s.chat(&body(json!({"truncate_prompt_tokens": -1}))).await;
    assert_eq!(v["prompt_token_ids"].as_array().unwrap(), &full_ids);
    let (status, v) = s.chat(&body(json!({"truncate_prompt_tokens": 257}))).await;
    assert_eq!(status, 400);
    assert_eq!(v["error"]["param"], "truncate_prompt_tokens");
}

#[tokio::test]
async fn echo_prepends_the_continued_message() {
    let s = TestServer::tiny(options(), None).await;
    let body = |echo: bool, stream: bool| {
        json!({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}],
            "continue_final_message": true, "add_generation_prompt": false, "echo": echo,
            "stream": stream, "max_completion_tokens": 4, "temperature": 0, "ignore_eos": true})
    };
    let (_, plain) = s.chat(&body(false, false)).await;
    let generated = plain["choices"][0]["message"]["content"].as_str().unwrap();
    let (status, v) = s.chat(&body(true, false)).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(
        v["choices"][0]["message"]["content"],
        format!("Hel{generated}")
    );
    assert_eq!(v["usage"]["completion_tokens"], 4);
    // Streaming: the echo is the first content chunk after the role chunk.
    let events = s.chat_stream(&body(true, true)).await;
    assert_eq!(events[1]["choices"][0]["delta"], json!({"content": "Hel"}));
    let (choices, _) = check_stream(&events, 1);
    assert_eq!(choices[0].content, format!("Hel{generated}"));
    // Nothing to echo when the last message is the user's.
    let (_, v) = s
        .chat(
            &json!({"messages": [{"role": "user", "content": "hi"}], "echo": true,
            "max_completion_tokens": 4, "temperature": 0, "ignore_eos": true}),
        )
        .await;
    let (_, w) = s
        .chat(&json!({"messages": [{"role": "user", "content": "hi"}],
            "max_completion_tokens": 4, "temperature": 0, "ignore_eos": true}))
        .await;
    assert_eq!(
        v["choices"][0]["message"]["content"],
        w["choices"][0]["message"]["content"]
    );
}

/// A template that opens the thinking in the generation prompt, as Qwen3-style templates do.
const THINKING: &str =
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}model: <think>";
/// The same prompt without the marker.
const NOT_THINKING: &str =
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}model: ";

fn reasoning_body(template: &str, extra: Value) -> Value {
    let mut b = json!({"messages": [{"role": "user", "content": "think"}], "chat_template": template,
        "max_completion_tokens": 6, "temperature": 0, "ignore_eos": true,
        "skip_special_tokens": false});
    for (k, v) in extra.as_object().unwrap() {
        b[k] = v.clone();
    }
    b
}

#[tokio::test]
async fn reasoning_is_split_off_when_the_template_thinks() {
    let s = TestServer::tiny(trusted(), None).await;
    // Without the marker the output is all content.
    let (_, v) = s.chat(&reasoning_body(NOT_THINKING, json!({}))).await;
    let m = &v["choices"][0]["message"];
    assert!(m.get("reasoning").is_none(), "{v}");
    let (_, v) = s.chat(&reasoning_body(THINKING, json!({}))).await;
    let m = &v["choices"][0]["message"];
    let reasoning = m["reasoning"].as_str().unwrap().to_owned();
    assert!(!reasoning.is_empty(), "{v}");
    // The random model never closes the thinking: everything it wrote is reasoning, and the text
    // is exactly what the same prompt yields as content without the parser.
    assert_eq!(m["content"], "");
    let raw = {
        let mut b = reasoning_body(THINKING, json!({"return_token_ids": true}));
        b["max_completion_tokens"] = json!(6);
        let (_, v) = s.chat(&b).await;
        let r = s
            .post(
                "/detokenize",
                &json!({"tokens": v["choices"][0]["token_ids"]}),
            )
            .send()
            .await
            .unwrap();
        r.json::<Value>().await.unwrap()["prompt"]
            .as_str()
            .unwrap()
            .to_owned()
    };
    assert_eq!(reasoning, raw);

    // include_reasoning: false drops it.
    let (_, v) = s
        .chat(&reasoning_body(
            THINKING,
            json!({"include_reasoning": false}),
        ))
        .await;
    let m = &v["choices"][0]["message"];
    assert!(m.get("reasoning").is_none(), "{v}");
    assert_eq!(m["content"], "");

    // Streaming: the same split, in delta.reasoning.
    let events = s
        .chat_stream(&reasoning_body(THINKING, json!({"stream": true})))
        .await;
    let streamed: String = events
        .iter()
        .filter_map(|e| e["choices"][0]["delta"]["reasoning"].as_str())
        .collect();
    assert_eq!(streamed, reasoning);
    let (choices, _) = check_stream(&events, 1);
    assert_eq!(choices[0].content, "");
}

#[derive(Debug, Default)]
struct Recorder {
    seen: Mutex<Vec<RequestExtras>>,
}

impl Recorder {
    fn see(&self, extras: &RequestExtras) -> Result<(), ApiError> {
        if extras.engine_xargs.contains_key("refuse") {
            return Err(ApiError::bad("engine_xargs.refuse", "refused by the hook"));
        }
        self.seen.lock().unwrap().push(extras.clone());
        Ok(())
    }
}

impl RequestHook for Recorder {
    fn on_request(&self, params: &ChatParams) -> Result<(), ApiError> {
        self.see(&params.extras)
    }

    fn on_completion(&self, params: &CompletionParams) -> Result<(), ApiError> {
        self.see(&params.extras)
    }
}

#[tokio::test]
async fn a_registered_hook_sees_the_extension_fields() {
    let hook = Arc::new(Recorder::default());
    let s = TestServer::tiny(
        ServerOptions {
            request_hook: hook.clone(),
            ..options()
        },
        None,
    )
    .await;
    let xargs = json!({"adapter": "a1", "k": 3, "ids": [1, "x", 2.5]});
    let (status, v) = s
        .chat(
            &json!({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 1,
            "engine_xargs": xargs, "kv_transfer_params": {"remote": "h:1"}, "cache_salt": "s3cret",
            "service_tier": "flex", "parallel_tool_calls": false, "user": "u1",
            "mm_processor_kwargs": {}}),
        )
        .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["service_tier"], "flex");
    assert!(v.get("kv_transfer_params").is_none());
    {
        let seen = hook.seen.lock().unwrap();
        assert_eq!(seen.len(), 1);
        assert_eq!(Value::Object(seen[0].engine_xargs.clone()), xargs);
        assert_eq!(
            seen[0].kv_transfer_params.clone().map(Value::Object),
            Some(json!({"remote": "h:1"}))
        );
        assert_eq!(seen[0].cache_salt.as_deref(), Some("s3cret"));
        assert_eq!(seen[0].service_tier, Some(ServiceTier::Flex));
        assert!(!seen[0].parallel_tool_calls);
    }
    let (status, v) = s
        .chat(&json!({"messages": [{"role": "user", "content": "hi"}],
            "engine_xargs": {"refuse": 1}}))
        .await;
    assert_eq!(status, 400);
    assert_eq!(v["error"]["param"], "engine_xargs.refuse");
    let (_, v) = s
        .chat(&json!({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 1}))
        .await;
    assert!(v["service_tier"].is_null(), "{v}");

    // Completions reach the hook too, and it may refuse them.
    let completion = |extra: Value| {
        let mut body = json!({"prompt": "hi", "max_tokens": 1});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        s.post("/v1/completions", &body).send()
    };
    let resp = completion(json!({"engine_xargs": {"k": 1}, "cache_salt": "c1",
        "kv_transfer_params": {"remote": "h:2"}}))
    .await
    .unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    {
        let seen = hook.seen.lock().unwrap();
        let last = seen.last().unwrap();
        assert_eq!(Value::Object(last.engine_xargs.clone()), json!({"k": 1}));
        assert_eq!(last.cache_salt.as_deref(), Some("c1"));
        assert_eq!(
            last.kv_transfer_params.clone().map(Value::Object),
            Some(json!({"remote": "h:2"}))
        );
    }
    let resp = completion(json!({"engine_xargs": {"refuse": 1}}))
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 400);
    let v: Value = resp.json().await.unwrap();
    assert_eq!(v["error"]["param"], "engine_xargs.refuse");
}
