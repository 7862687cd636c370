//! The real router on an ephemeral port over the tiny random model and a real engine.

mod common;

use std::time::Duration;

use common::{check_stream, options, parse_sse, TestServer, KEY};
use futures_util::StreamExt;
use serde_json::{json, Value};
use temper_http::ServerOptions;

fn user(text: &str) -> Value {
    json!([{"role": "user", "content": text}])
}

fn assert_error(body: &Value, code: u16, kind: &str, param: Option<&str>) {
    let e = &body["error"];
    assert_eq!(e["code"], code, "{body}");
    assert_eq!(e["type"], kind, "{body}");
    assert_eq!(e["param"].as_str(), param, "{body}");
    assert!(
        e["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{body}"
    );
}

#[tokio::test]
async fn health_needs_no_key() {
    let s = TestServer::tiny(options(), None).await;
    let r = s.client.get(s.url("/health")).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 200);
}

#[tokio::test]
async fn missing_or_wrong_key_is_401() {
    let s = TestServer::tiny(options(), None).await;
    let body = json!({"model": "tiny", "messages": user("hi")});
    let r = s
        .client
        .post(s.url("/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 401);
    assert_error(&r.json().await.unwrap(), 401, "AuthenticationError", None);
    let r = s
        .client
        .post(s.url("/v1/chat/completions"))
        .bearer_auth("wrong")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 401);
    assert_error(&r.json().await.unwrap(), 401, "AuthenticationError", None);
    let r = s.client.get(s.url("/v1/models")).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 401);
}

#[tokio::test]
async fn models_list() {
    let s = TestServer::tiny(options(), Some(512)).await;
    let r = s
        .client
        .get(s.url("/v1/models"))
        .bearer_auth(KEY)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["object"], "list");
    let m = &v["data"][0];
    assert_eq!(m["id"], "tiny");
    assert_eq!(m["object"], "model");
    assert_eq!(m["owned_by"], "temper");
    assert_eq!(m["max_model_len"], 512);
    assert!(m["created"].as_u64().unwrap() > 1_600_000_000);
}

/// The next turn of a conversation finds the earlier turn's blocks: `cached_tokens` says how
/// many prompt tokens came from the cache, streamed or not, and the answer does not change;
/// another `cache_salt` finds nothing.
#[tokio::test]
async fn a_next_turn_reports_its_cached_prompt_tokens() {
    let s = TestServer::tiny(options(), None).await;
    let long = "tell me about the river and the city and the bridge and the hills ".repeat(4);
    let body = |salt: &str| {
        json!({"messages": user(&long), "max_completion_tokens": 6, "temperature": 0,
               "cache_salt": salt})
    };
    let (status, first) = s.chat(&body("a")).await;
    assert_eq!(status, 200, "{first}");
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let (_, again) = s.chat(&body("a")).await;
    let prompt = again["usage"]["prompt_tokens"].as_u64().unwrap();
    let cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    let block = temper_model::BLOCK_TOKENS as u64;
    assert_eq!(cached, (prompt - 1) / block * block, "{again}");
    assert_eq!(
        first["choices"][0]["message"],
        again["choices"][0]["message"]
    );
    let (_, other) = s.chat(&body("b")).await;
    assert_eq!(other["usage"]["prompt_tokens_details"]["cached_tokens"], 0);

    let mut streamed = body("a");
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let events = s.chat_stream(&streamed).await;
    let usage = events
        .iter()
        .rev()
        .find_map(|e| e.get("usage").filter(|u| !u.is_null()));
    assert_eq!(
        usage.expect("a usage chunk")["prompt_tokens_details"]["cached_tokens"],
        cached
    );
}

/// Prompts of megabytes are rendered and tokenized on blocking threads: while four of them are
/// being tokenized, `/health` and a small completion are answered (before the big ones are).
/// (`truncate_prompt_tokens` makes the server tokenize them whole: without it, prompts this far
/// past the context are refused by their byte count alone.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_prompts_do_not_hold_up_health_or_small_requests() {
    let s = std::sync::Arc::new(TestServer::tiny(options(), None).await);
    let big = "lorem ipsum dolor sit amet ".repeat(120_000);
    let done = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..4 {
        let (s, big, done) = (s.clone(), big.clone(), done.clone());
        tasks.push(tokio::spawn(async move {
            let (status, v) = s
                .chat(&json!({"messages": user(&big), "max_completion_tokens": 1,
                    "truncate_prompt_tokens": 16}))
                .await;
            assert_eq!(status, 200, "{v}");
            done.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }));
    }
    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    let r = s.client.get(s.url("/health")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let (status, v) = s
        .chat(&json!({"messages": user("hi"), "max_completion_tokens": 2}))
        .await;
    assert_eq!(status, 200, "{v}");
    let finished_first = done.load(std::sync::atomic::Ordering::SeqCst);
    for t in tasks {
        t.await.unwrap();
    }
    // Each large prompt takes seconds to tokenize; the small requests took milliseconds.
    assert_eq!(
        finished_first, 0,
        "the small requests waited for a large prompt"
    );
}

#[tokio::test]
async fn non_streaming_completion_shape() {
    let s = TestServer::tiny(options(), None).await;
    let (status, v) = s
        .chat(
            &json!({"model": "tiny", "messages": user("Hello world"), "max_completion_tokens": 8,
            "temperature": 0, "request_id": "abc-1"}),
        )
        .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["id"], "chatcmpl-abc-1");
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["model"], "tiny");
    assert!(v["created"].as_u64().is_some());
    assert!(v["system_fingerprint"]
        .as_str()
        .unwrap()
        .starts_with("temper-"));
    assert!(v.get("prompt_token_ids").is_none());
    let c = &v["choices"][0];
    assert_eq!(c["index"], 0);
    assert_eq!(c["message"]["role"], "assistant");
    assert!(c["message"]["content"].is_string());
    assert!(c["logprobs"].is_null());
    assert!(c.get("token_ids").is_none());
    assert!(["stop", "length"].contains(&c["finish_reason"].as_str().unwrap()));
    assert!(c.as_object().unwrap().contains_key("stop_reason"));
    let u = &v["usage"];
    let (p, g) = (
        u["prompt_tokens"].as_u64().unwrap(),
        u["completion_tokens"].as_u64().unwrap(),
    );
    assert!(p > 0 && (1..=8).contains(&g), "{u}");
    assert_eq!(u["total_tokens"].as_u64().unwrap(), p + g);
    assert_eq!(u["prompt_tokens_details"]["cached_tokens"], 0);
    // Without request_id the id is generated.
    let (_, v) = s
        .chat(&json!({"messages": user("Hello"), "max_completion_tokens": 2}))
        .await;
    let id = v["id"].as_str().unwrap();
    assert!(id.starts_with("chatcmpl-") && id.len() > 20, "{id}");
}

#[tokio::test]
async fn length_finish_and_token_ids() {
    let s = TestServer::tiny(options(), None).await;
    let (status, v) = s
        .chat(
            &json!({"messages": user("the cat sat"), "max_completion_tokens": 5,
            "ignore_eos": true, "temperature": 0, "return_token_ids": true}),
        )
        .await;
    assert_eq!(status, 200, "{v}");
    let c = &v["choices"][0];
    assert_eq!(c["finish_reason"], "length");
    assert!(c["stop_reason"].is_null());
    assert_eq!(c["token_ids"].as_array().unwrap().len(), 5);
    assert_eq!(v["usage"]["completion_tokens"], 5);
    let prompt = v["prompt_token_ids"].as_array().unwrap();
    assert_eq!(
        prompt.len() as u64,
        v["usage"]["prompt_tokens"].as_u64().unwrap()
    );
}

#[tokio::test]
async fn streaming_matches_non_streaming() {
    let s = TestServer::tiny(options(), None).await;
    let body = json!({"messages": user("Hello world the cat"), "max_completion_tokens": 12,
        "temperature": 0, "return_token_ids": true, "ignore_eos": true});
    let (status, full) = s.chat(&body).await;
    assert_eq!(status, 200, "{full}");
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let events = s.chat_stream(&streamed).await;
    // The prompt ids ride on the first chunk only.
    assert_eq!(events[0]["prompt_token_ids"], full["prompt_token_ids"]);
    assert!(events[1..]
        .iter()
        .all(|e| e.get("prompt_token_ids").is_none()));
    let (choices, usage) = check_stream(&events, 1);
    assert_eq!(
        choices[0].content,
        full["choices"][0]["message"]["content"].as_str().unwrap()
    );
    let ids: Vec<u64> = full["choices"][0]["token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    assert_eq!(choices[0].token_ids, ids);
    assert_eq!(choices[0].finish_reason.as_deref(), Some("length"));
    // The same counts; the streamed request found the first one's prompt blocks.
    let mut usage = usage.unwrap();
    assert_eq!(usage["prompt_tokens_details"]["cached_tokens"], 16);
    usage["prompt_tokens_details"]["cached_tokens"] = json!(0);
    assert_eq!(usage, full["usage"]);
    // Without include_usage no chunk carries usage.
    streamed["stream_options"] = json!(null);
    let events = s.chat_stream(&streamed).await;
    assert!(events.iter().all(|e| e.get("usage").is_none()));
    let (again, usage) = check_stream(&events, 1);
    assert!(usage.is_none());
    assert_eq!(again[0].content, choices[0].content);
}

#[tokio::test]
async fn streaming_n_choices_with_seed_and_continuous_usage() {
    let s = TestServer::tiny(options(), None).await;
    let body = json!({"messages": user("hello"), "max_completion_tokens": 6, "n": 3,
        "temperature": 1.0, "seed": 11, "ignore_eos": true});
    let (status, full) = s.chat(&body).await;
    assert_eq!(status, 200, "{full}");
    assert_eq!(full["choices"].as_array().unwrap().len(), 3);
    assert_eq!(full["usage"]["completion_tokens"], 18);
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true, "continuous_usage_stats": true});
    let events = s.chat_stream(&streamed).await;
    let (choices, usage) = check_stream(&events, 3);
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(
            c.content,
            full["choices"][i]["message"]["content"].as_str().unwrap(),
            "choice {i}: same seed, same text"
        );
    }
    assert_eq!(usage.unwrap()["completion_tokens"], 18);
    // Every chunk but [DONE] carries the usage so far, never decreasing.
    let mut last = 0;
    for e in &events[..events.len() - 1] {
        let done = e["usage"]["completion_tokens"].as_u64().unwrap();
        assert!(done >= last);
        last = done;
    }
}

#[tokio::test]
async fn logprobs_in_openai_shape() {
    let s = TestServer::tiny(options(), None).await;
    let (status, v) = s
        .chat(
            &json!({"messages": user("the dog"), "max_completion_tokens": 4, "temperature": 0,
            "ignore_eos": true, "logprobs": true, "top_logprobs": 3}),
        )
        .await;
    assert_eq!(status, 200, "{v}");
    let content = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len(), 4);
    for entry in content {
        let lp = entry["logprob"].as_f64().unwrap();
        assert!(lp <= 0.0);
        assert!(entry["token"].is_string());
        assert!(entry["bytes"].is_array());
        let top = entry["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3);
        // Greedy: the sampled token is the most likely one.
        assert_eq!(top[0]["token"], entry["token"]);
        assert!((top[0]["logprob"].as_f64().unwrap() - lp).abs() < 1e-5);
        assert!(top[0]["logprob"].as_f64() >= top[1]["logprob"].as_f64());
    }
    // Streaming carries the same per-token entries.
    let events = s
        .chat_stream(
            &json!({"messages": user("the dog"), "max_completion_tokens": 4,
            "temperature": 0, "ignore_eos": true, "logprobs": true, "top_logprobs": 3,
            "stream": true}),
        )
        .await;
    let streamed: Vec<Value> = events
        .iter()
        .filter_map(|e| e["choices"][0]["logprobs"]["content"].as_array().cloned())
        .flatten()
        .collect();
    assert_eq!(&streamed, content);
}

#[tokio::test]
async fn unknown_model_and_route_are_404_envelopes() {
    let s = TestServer::tiny(options(), None).await;
    let (status, v) = s
        .chat(&json!({"model": "gpt-x", "messages": user("hi")}))
        .await;
    assert_eq!(status, 404);
    assert_error(&v, 404, "NotFoundError", Some("model"));
    assert_eq!(v["error"]["message"], "The model `gpt-x` does not exist.");
    let r = s
        .client
        .get(s.url("/v1/nothing"))
        .bearer_auth(KEY)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 404);
    assert_error(&r.json().await.unwrap(), 404, "NotFoundError", None);
    let r = s
        .client
        .get(s.url("/v1/chat/completions"))
        .bearer_auth(KEY)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 405);
    assert_error(&r.json().await.unwrap(), 405, "MethodNotAllowedError", None);
    let r = s
        .post("/tokenize", &json!({"model": "nope", "prompt": "x"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 404);
    assert_error(
        &r.json().await.unwrap(),
        404,
        "NotFoundError",
        Some("model"),
    );
}

#[tokio::test]
async fn oversized_body_is_413() {
    let s = TestServer::tiny(
        ServerOptions {
            max_body_bytes: 16 * 1024,
            ..options()
        },
        None,
    )
    .await;
    let big = "hello ".repeat(10_000);
    let (status, v) = s.chat(&json!({"messages": user(&big)})).await;
    assert_eq!(status, 413);
    assert_error(&v, 413, "RequestTooLargeError", None);
}

#[tokio::test]
async fn malformed_bodies_are_400() {
    let s = TestServer::tiny(options(), None).await;
    let send = |body: &'static str, ct: &'static str| {
        s.client
            .post(s.url("/v1/chat/completions"))
            .bearer_auth(KEY)
            .header("content-type", ct)
            .body(body)
            .send()
    };
    let r = send("{\"messages\": [", "application/json").await.unwrap();
    assert_eq!(r.status().as_u16(), 400);
    assert_error(&r.json().await.unwrap(), 400, "BadRequestError", None);
    let r = send("{\"messages\": []}", "text/plain").await.unwrap();
    assert_eq!(r.status().as_u16(), 400);
    assert_error(&r.json().await.unwrap(), 400, "BadRequestError", None);
    let r = send(
        r#"{"messages": [{"role": "user", "content": "x"}], "max_tokens": "many"}"#,
        "application/json",
    )
    .await
    .unwrap();
    assert_eq!(r.status().as_u16(), 400);
    assert_error(
        &r.json().await.unwrap(),
        400,
        "BadRequestError",
        Some("max_tokens"),
    );
}

#[tokio::test]
async fn validation_errors_name_the_param() {
    let s = TestServer::tiny(options(), None).await;
    let cases = [
        (
            json!({"messages": user("x"), "temperature": 3}),
            "temperature",
        ),
        (
            json!({"messages": user("x"), "stream_options": {"include_usage": true}}),
            "stream_options",
        ),
        (
            json!({"messages": user("x"), "logit_bias": {"five": 1}}),
            "logit_bias",
        ),
        (
            json!({"messages": user("x"), "chat_template": "{{ 'x' }}"}),
            "chat_template",
        ),
        (
            json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]}),
            "messages[0].content[0].type",
        ),
        // Gemma's template raises on roles out of order.
        (
            json!({"messages": [{"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}]}),
            "messages",
        ),
    ];
    for (body, param) in cases {
        let (status, v) = s.chat(&body).await;
        assert_eq!(status, 400, "{body}: {v}");
        assert_error(&v, 400, "BadRequestError", Some(param));
    }
}

#[tokio::test]
async fn context_length_errors() {
    let s = TestServer::tiny(options(), Some(64)).await;
    let long = "the cat sat on the mat ".repeat(20);
    let (status, v) = s.chat(&json!({"messages": user(&long)})).await;
    assert_eq!(status, 400, "{v}");
    assert_error(&v, 400, "BadRequestError", Some("messages"));
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .contains("maximum context length is 64"));
    // Far past the context by its bytes alone: refused before tokenizing, saying so.
    let huge = "the cat sat on the mat ".repeat(40_000);
    let (status, v) = s.chat(&json!({"messages": user(&huge)})).await;
    assert_eq!(status, 400, "{v}");
    assert_error(&v, 400, "BadRequestError", Some("messages"));
    let message = v["error"]["message"].as_str().unwrap();
    assert!(message.contains("has at least"), "{message}");
    let (status, v) = s
        .chat(&json!({"messages": user("hi"), "max_tokens": 64}))
        .await;
    assert_eq!(status, 400, "{v}");
    assert_error(&v, 400, "BadRequestError", Some("max_completion_tokens"));
    // With no max given, the rest of the context is the budget.
    let (status, v) = s
        .chat(&json!({"messages": user("hi"), "ignore_eos": true, "temperature": 0}))
        .await;
    assert_eq!(status, 200, "{v}");
    let u = &v["usage"];
    assert_eq!(u["total_tokens"], 64);
    assert_eq!(v["choices"][0]["finish_reason"], "length");
}

#[tokio::test]
async fn tokenize_detokenize_round_trip() {
    let s = TestServer::tiny(options(), Some(1000)).await;
    let text = "Hello world, the cat sat on the mat.";
    let r = s
        .post(
            "/tokenize",
            &json!({"model": "tiny", "prompt": text, "add_special_tokens": false}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let v: Value = r.json().await.unwrap();
    let tokens = v["tokens"].as_array().unwrap().clone();
    assert_eq!(v["count"].as_u64().unwrap() as usize, tokens.len());
    assert_eq!(v["max_model_len"], 1000);
    let r = s
        .post("/detokenize", &json!({"model": "tiny", "tokens": tokens}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let d: Value = r.json().await.unwrap();
    assert_eq!(d["prompt"], text);
    // add_special_tokens defaults to true for a prompt: BOS first.
    let v: Value = s
        .post(
            "/tokenize",
            &json!({"prompt": text, "return_token_strs": true}),
        )
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(v["count"].as_u64().unwrap() as usize, tokens.len() + 1);
    assert_eq!(v["tokens"].as_array().unwrap()[1..], tokens[..]);
    assert_eq!(v["token_strs"].as_array().unwrap().len(), tokens.len() + 1);
    // The chat form gives exactly the prompt a chat completion uses.
    let messages = user("Hello world");
    let t: Value = s
        .post("/tokenize", &json!({"messages": messages}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let (_, c) = s
        .chat(&json!({"messages": messages, "max_completion_tokens": 1, "return_token_ids": true}))
        .await;
    assert_eq!(t["tokens"], c["prompt_token_ids"]);
    // Out-of-vocabulary ids and malformed requests are 400s.
    let r = s
        .post("/detokenize", &json!({"tokens": [1, 99999999]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 400);
    assert_error(
        &r.json().await.unwrap(),
        400,
        "BadRequestError",
        Some("tokens"),
    );
    let r = s
        .post("/tokenize", &json!({"prompt": "x", "messages": messages}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 400);
}

#[tokio::test]
async fn project_header_is_validated() {
    let s = TestServer::tiny(options(), None).await;
    let body = json!({"messages": user("hi"), "max_completion_tokens": 1});
    let r = s
        .post("/v1/chat/completions", &body)
        .header("OpenAI-Project", "default/agents")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    assert!(r.headers().contains_key("x-request-id"));
    // Another team's project than the key's (team `default`).
    for bad in ["acme", "acme/", "a/b/c", "acme/has space", "acme/agents"] {
        let r = s
            .post("/v1/chat/completions", &body)
            .header("OpenAI-Project", bad)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 400, "{bad}");
        assert_error(
            &r.json().await.unwrap(),
            400,
            "BadRequestError",
            Some("OpenAI-Project"),
        );
    }
}

/// The body of a streaming request for `max_tokens` tokens (EOS ignored), its status checked.
async fn long_stream(
    s: &TestServer,
    max_tokens: usize,
) -> impl futures_util::Stream<Item = reqwest::Result<axum::body::Bytes>> {
    let r = s
        .post(
            "/v1/chat/completions",
            &json!({"messages": user("hello"), "max_completion_tokens": max_tokens,
                "ignore_eos": true, "stream": true}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    r.bytes_stream()
}

#[tokio::test]
async fn client_disconnect_cancels_the_stream() {
    let s = TestServer::tiny(options(), None).await;
    let max_tokens = 1900;
    let mut body = long_stream(&s, max_tokens).await;
    let mut seen = String::new();
    while seen.matches("\n\n").count() < 4 {
        seen.push_str(std::str::from_utf8(&body.next().await.unwrap().unwrap()).unwrap());
    }
    assert_eq!(s.engine_stats().running, 1);
    drop(body);
    let stats = s.wait_idle(Duration::from_secs(5)).await;
    // Stopped early: far fewer decode rows than the request asked for, and nothing more runs.
    assert!(stats.rows < max_tokens as u64 / 2, "{stats:?}");
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(s.engine_stats().steps, stats.steps);
}

/// `--max-requests-per-team 1`: while the team's stream runs, its next request is a 429 with
/// `Retry-After` in the envelope; once the stream is gone (here: the client dropped it), the
/// team's place is free again.
#[tokio::test]
async fn a_team_past_its_request_limit_gets_a_429() {
    let s = TestServer::tiny(
        ServerOptions {
            max_requests_per_team: Some(1),
            ..options()
        },
        None,
    )
    .await;
    let mut body = long_stream(&s, 1900).await;
    body.next().await.unwrap().unwrap();
    let refused = s
        .post(
            "/v1/chat/completions",
            &json!({"messages": user("hi"), "max_completion_tokens": 2}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status().as_u16(), 429);
    assert_eq!(refused.headers()["retry-after"], "1");
    let v: Value = refused.json().await.unwrap();
    assert_error(&v, 429, "RateLimitError", None);
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("--max-requests-per-team"),
        "{v}"
    );
    drop(body);
    s.wait_idle(Duration::from_secs(5)).await;
    // The place is given back when the server's response stream notices the client is gone,
    // which can come a moment after the engine dropped the request.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let (status, v) = s
            .chat(&json!({"messages": user("hi"), "max_completion_tokens": 2}))
            .await;
        if status == 200 {
            break;
        }
        assert_eq!(status, 429, "{v}");
        assert!(
            std::time::Instant::now() < deadline,
            "the team's place never came back"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn client_disconnect_cancels_non_streaming() {
    let s = TestServer::tiny(options(), None).await;
    // Four choices of all but the context: work for well over 50 ms even where the tiny model
    // decodes fast (one choice of 1,900 tokens came within 5% of half done under the suite's
    // load).
    let (max_tokens, n) = (1900u64, 4u64);
    let result = s
        .post(
            "/v1/chat/completions",
            &json!({"messages": user("hello"), "max_completion_tokens": max_tokens, "n": n,
                "ignore_eos": true}),
        )
        .timeout(Duration::from_millis(50))
        .send()
        .await;
    assert!(result.is_err(), "finished within 50 ms?");
    let stats = s.wait_idle(Duration::from_secs(5)).await;
    assert!(stats.rows < n * max_tokens / 2, "{stats:?}");
}

#[tokio::test]
async fn concurrent_requests_are_batched() {
    let s = TestServer::tiny(options(), None).await;
    let requests = (0..4).map(|i| {
        let body = json!({"messages": user(&format!("hello {i}")), "max_completion_tokens": 40,
            "ignore_eos": true, "temperature": 0});
        let s = &s;
        async move { s.chat(&body).await }
    });
    let results = futures_util::future::join_all(requests).await;
    for (status, v) in results {
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["usage"]["completion_tokens"], 40);
    }
    assert!(
        s.engine_stats().max_rows_in_step >= 4,
        "{:?}",
        s.engine_stats()
    );
}

#[test]
fn sse_parser_rejects_bad_framing() {
    assert!(std::panic::catch_unwind(|| parse_sse("data: {}\n")).is_err());
    assert!(std::panic::catch_unwind(|| parse_sse("event: x\n\n")).is_err());
    assert_eq!(parse_sse("data: [DONE]\n\n"), vec![json!("[DONE]")]);
}

#[tokio::test]
async fn request_chat_template_when_trusted() {
    let s = TestServer::tiny(
        ServerOptions {
            trust_request_chat_template: true,
            ..options()
        },
        None,
    )
    .await;
    let template = "{% for m in messages %}{{ m.content }}|{% endfor %}{{ suffix }}";
    let messages =
        json!([{"role": "user", "content": "hello"}, {"role": "assistant", "content": "world"}]);
    let t: Value = s
        .post(
            "/tokenize",
            &json!({"messages": messages, "chat_template": template,
                "chat_template_kwargs": {"suffix": "the end"}}),
        )
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let p: Value = s
        .post(
            "/tokenize",
            &json!({"prompt": "hello|world|the end", "add_special_tokens": false}),
        )
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(t["tokens"], p["tokens"]);
    let (status, v) = s
        .chat(
            &json!({"messages": messages, "chat_template": template, "max_completion_tokens": 2,
            "return_token_ids": true, "chat_template_kwargs": {"suffix": "the end"}}),
        )
        .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["prompt_token_ids"], p["tokens"]);
    // A template that raises is the caller's error about the messages; one that does not
    // compile is about the template.
    let (status, v) = s
        .chat(&json!({"messages": messages, "chat_template": "{{ raise_exception('no assistants') }}"}))
        .await;
    assert_eq!(status, 400, "{v}");
    assert_error(&v, 400, "BadRequestError", Some("messages"));
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .contains("no assistants"));
    let (status, v) = s
        .chat(&json!({"messages": messages, "chat_template": "{% for %}"}))
        .await;
    assert_eq!(status, 400, "{v}");
    assert_error(&v, 400, "BadRequestError", Some("chat_template"));
}

#[tokio::test]
async fn continue_final_message_leaves_the_turn_open() {
    let s = TestServer::tiny(options(), None).await;
    let messages =
        json!([{"role": "user", "content": "hello"}, {"role": "assistant", "content": "the cat"}]);
    let detok = |tokens: Value| {
        let s = &s;
        async move {
            let v: Value = s
                .post("/detokenize", &json!({"tokens": tokens}))
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            v["prompt"].as_str().unwrap().to_owned()
        }
    };
    let (status, open) = s
        .chat(
            &json!({"messages": messages, "continue_final_message": true,
            "add_generation_prompt": false, "max_completion_tokens": 1, "return_token_ids": true}),
        )
        .await;
    assert_eq!(status, 200, "{open}");
    let open = detok(open["prompt_token_ids"].clone()).await;
    assert!(open.ends_with("the cat"), "{open:?}");
    let (_, closed) = s
        .chat(
            &json!({"messages": messages, "add_generation_prompt": false,
            "max_completion_tokens": 1, "return_token_ids": true}),
        )
        .await;
    let closed = detok(closed["prompt_token_ids"].clone()).await;
    assert!(
        closed.starts_with(&open) && closed.len() > open.len(),
        "{closed:?}"
    );
}
