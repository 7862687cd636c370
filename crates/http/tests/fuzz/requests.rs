//! Mutated request bodies against a real server on the tiny model (chat completions,
//! completions, `/tokenize`, `/detokenize`, the training API): every answer is a 200 of the route's shape or
//! a 4xx in the error envelope `{"error": {"message", "type", "param", "code"}}`; never a 5xx, a
//! dropped connection (a handler's panic) or a hang.

use std::time::Duration;

use serde_json::{json, Map, Value};
use temper_http::{CatalogOptions, TrainingOptions};

use crate::common::{options, parse_sse, TestServer};
use crate::{Campaign, Rng};

/// A request to the tiny model answers in well under a second; this is a hang.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// Prompt plus completion: keeps every accepted request cheap whatever its `max_tokens`.
const MAX_MODEL_LEN: usize = 64;

const CHAT: &str = "/v1/chat/completions";

const COMPLETIONS: &str = "/v1/completions";

/// Field names the mutator adds to objects, so that values reach the deserializers of real
/// fields at every level.
const FIELD_NAMES: &[&str] = &[
    "messages",
    "model",
    "max_tokens",
    "max_completion_tokens",
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "stream",
    "stream_options",
    "include_usage",
    "logprobs",
    "top_logprobs",
    "prompt_logprobs",
    "logit_bias",
    "allowed_token_ids",
    "bad_words",
    "min_tokens",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
    "length_penalty",
    "use_beam_search",
    "response_format",
    "structured_outputs",
    "tools",
    "tool_choice",
    "echo",
    "continue_final_message",
    "add_generation_prompt",
    "add_special_tokens",
    "truncate_prompt_tokens",
    "repetition_detection",
    "request_id",
    "priority",
    "cache_salt",
    "documents",
    "reasoning_effort",
    "return_token_ids",
    "return_tokens_as_token_ids",
    "chat_template",
    "chat_template_kwargs",
    "service_tier",
    "role",
    "content",
    "name",
    "tool_calls",
    "tool_call_id",
    "type",
    "text",
    "function",
    "arguments",
    "parameters",
    "json_schema",
    "schema",
    "strict",
    "json",
    "regex",
    "choice",
    "grammar",
    "json_object",
    "structural_tag",
    "triggers",
    "structures",
    "begin",
    "end",
    "whitespace_pattern",
    "prompt",
    "best_of",
    "suffix",
    "prompt_embeds",
    "tokens",
    "model_id",
    "trajectory_groups",
    "trajectories",
    "messages_and_choices",
    "reward",
    "metrics",
    "experimental_config",
    "learning_rate",
    "config",
    "batch_size",
    "epochs",
    "steps",
    "split",
    "project",
    "entity",
    "base_model",
    "return_existing",
    "training_data_url",
    "finish_reason",
    "message",
    "index",
    "token",
    "logprob",
    "initial_policy_version",
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_get_an_answer_or_the_error_envelope() {
    let data = tempfile::tempdir().unwrap();
    let server = TestServer::tiny_training(
        temper_http::ServerOptions {
            enable_tool_calls: true,
            ..options()
        },
        CatalogOptions::new(data.path()),
        TrainingOptions::default(),
        Some(MAX_MODEL_LEN),
    )
    .await;
    let client = reqwest::Client::builder()
        .timeout(REQUEST_TIMEOUT)
        .build()
        .unwrap();
    let (status, created) = send(
        &client,
        &server.url("/v1/preview/models"),
        "application/json",
        json!({"project": "fuzz", "name": "m", "base_model": "tiny"})
            .to_string()
            .into_bytes(),
    )
    .await
    .unwrap();
    assert_eq!(status, 200, "{created:?}");
    let created: Value = serde_json::from_slice(&created).unwrap();
    let corpus = corpus(created["id"].as_str().unwrap());

    let mut outcomes = [0usize; 2];
    let mut campaign = Campaign::new("requests_get_an_answer_or_the_error_envelope", 0x6a73_6f6e);
    while let Some(seed) = campaign.next() {
        let rng = &mut Rng::new(seed);
        let (path, valid) = rng.pick(&corpus);
        let (content_type, body) = mutate(valid, rng);
        let url = server.url(path);
        let checked = match send(&client, &url, content_type, body.clone()).await {
            Ok((status, answer)) => check(path, status, &answer).map(|()| status == 200),
            Err(e) => Err(format!("no answer: {e}")),
        };
        match checked {
            Ok(accepted) => outcomes[usize::from(accepted)] += 1,
            Err(what) => campaign.fail(
                seed,
                &format!(
                    "POST {path} with {content_type} body {}: {what}",
                    String::from_utf8_lossy(&body[..body.len().min(4000)])
                ),
            ),
        }
    }
    println!(
        "requests: {} accepted, {} refused with a 4xx",
        outcomes[1], outcomes[0]
    );
}

async fn send(
    client: &reqwest::Client,
    url: &str,
    content_type: &str,
    body: Vec<u8>,
) -> reqwest::Result<(u16, Vec<u8>)> {
    let resp = client
        .post(url)
        .bearer_auth(crate::common::KEY)
        .header("content-type", content_type)
        .body(body)
        .send()
        .await?;
    let status = resp.status().as_u16();
    Ok((status, resp.bytes().await?.to_vec()))
}

/// A 200 of the route's shape, or a 4xx in the envelope.
fn check(path: &str, status: u16, body: &[u8]) -> Result<(), String> {
    let text = String::from_utf8_lossy(body);
    if status != 200 {
        if !(400..500).contains(&status) {
            return Err(format!("status {status}: {text}"));
        }
        let v: Value =
            serde_json::from_slice(body).map_err(|e| format!("{status} not JSON ({e}): {text}"))?;
        let e = &v["error"];
        let envelope = v.as_object().is_some_and(|o| o.len() == 1)
            && e.as_object().is_some_and(|o| o.len() == 4)
            && e["message"].as_str().is_some_and(|m| !m.is_empty())
            && e["type"].is_string()
            && (e["param"].is_null() || e["param"].is_string())
            && e["code"].as_u64() == Some(u64::from(status));
        return if envelope {
            Ok(())
        } else {
            Err(format!("{status} outside the envelope: {text}"))
        };
    }
    if (path == CHAT || path == COMPLETIONS) && text.starts_with("data: ") {
        return check_stream(&text);
    }
    let v: Value =
        serde_json::from_slice(body).map_err(|e| format!("200 not JSON ({e}): {text}"))?;
    let well_formed = match path {
        CHAT => {
            v["object"] == "chat.completion"
                && v["choices"].as_array().is_some_and(|cs| {
                    !cs.is_empty()
                        && cs
                            .iter()
                            .all(|c| c["finish_reason"].is_string() && c["message"].is_object())
                })
                && v["usage"]["completion_tokens"].is_u64()
        }
        COMPLETIONS => {
            v["object"] == "text_completion"
                && v["choices"].as_array().is_some_and(|cs| {
                    !cs.is_empty()
                        && cs
                            .iter()
                            .all(|c| c["finish_reason"].is_string() && c["text"].is_string())
                })
                && v["usage"]["completion_tokens"].is_u64()
        }
        "/tokenize" => v["tokens"].is_array() && v["count"].is_u64(),
        "/detokenize" => v["prompt"].is_string(),
        _ => v.is_object(),
    };
    if well_formed {
        Ok(())
    } else {
        Err(format!("a malformed 200: {text}"))
    }
}

/// Every event parses, none is an error, and `[DONE]` ends the stream.
fn check_stream(text: &str) -> Result<(), String> {
    let events = std::panic::catch_unwind(|| parse_sse(text))
        .map_err(|_| format!("a malformed event stream: {text}"))?;
    if events.last() != Some(&json!("[DONE]")) {
        return Err(format!("a stream without [DONE]: {text}"));
    }
    match events.iter().find(|e| e.get("error").is_some()) {
        Some(e) => Err(format!("an error event: {e}")),
        None => Ok(()),
    }
}

/// Valid bodies of every route, each cheap to answer (`max_tokens` ≤ 4).
fn corpus(model_id: &str) -> Vec<(String, Value)> {
    let user = |text: &str| json!({"role": "user", "content": text});
    let schema = json!({"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0}}, "required": ["name"], "additionalProperties": false});
    let tool = json!({"type": "function", "function": {"name": "add", "description": "Adds.",
        "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}});
    let choice = json!({"index": 0, "finish_reason": "stop",
        "message": {"role": "assistant", "content": "x"},
        "logprobs": {"content": [{"token": "token_id:5", "logprob": -0.1}]}});
    let chat = [
        json!({"messages": [user("Hello")], "max_tokens": 3}),
        json!({"model": "tiny", "messages": [{"role": "system", "content": "Be brief."}, user("Hi"),
            {"role": "assistant", "content": "Hello"}, user("Bye")], "max_completion_tokens": 4,
            "temperature": 0.7, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "seed": 3, "n": 2}),
        json!({"messages": [user("Count")], "max_tokens": 4, "stream": true,
            "stream_options": {"include_usage": true, "continuous_usage_stats": true}}),
        json!({"messages": [user("a")], "max_tokens": 4, "logprobs": true, "top_logprobs": 3,
            "prompt_logprobs": 2, "return_token_ids": true, "echo": false}),
        json!({"messages": [user("b")], "max_tokens": 4, "stop": ["the", "\n"],
            "stop_token_ids": [1, 2], "logit_bias": {"5": 10.5, "6": -100},
            "frequency_penalty": 0.5, "presence_penalty": -0.5, "repetition_penalty": 1.2,
            "min_tokens": 1, "bad_words": ["cat"], "allowed_token_ids": [5, 6, 7, 8, 9, 10]}),
        json!({"messages": [user("c")], "max_tokens": 4, "n": 2, "use_beam_search": true,
            "length_penalty": 0.8, "temperature": 0}),
        json!({"messages": [user("d")], "max_tokens": 4,
            "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}}),
        json!({"messages": [user("e")], "max_tokens": 4, "response_format": {"type": "json_object"}}),
        json!({"messages": [user("f")], "max_tokens": 4, "structured_outputs": {"regex": "[a-z]{1,5}"}}),
        json!({"messages": [user("g")], "max_tokens": 4, "structured_outputs": {"choice": ["yes", "no"]}}),
        json!({"messages": [user("h")], "max_tokens": 4,
            "structured_outputs": {"grammar": "start: \"Hi \" NAME\nNAME: /[A-Z][a-z]+/\n"}}),
        json!({"messages": [user("i")], "max_tokens": 4, "structured_outputs": {"structural_tag":
            json!({"type": "structural_tag", "triggers": ["<call="], "structures": [
                {"begin": "<call=add>", "end": "</call>", "schema": {"type": "object"}}]}).to_string()}}),
        json!({"messages": [user("j")], "max_tokens": 4, "tools": [tool], "tool_choice": "auto",
            "parallel_tool_calls": false}),
        json!({"messages": [user("k")], "max_tokens": 4, "tools": [tool],
            "tool_choice": {"type": "function", "function": {"name": "add"}}}),
        json!({"messages": [user("l"), {"role": "assistant", "content": null, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{\"x\": 1}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "2"}], "max_tokens": 4, "tools": [tool]}),
        json!({"messages": [user("m"), {"role": "assistant", "content": "The"}], "max_tokens": 2,
            "add_generation_prompt": false, "continue_final_message": true, "echo": true}),
        json!({"messages": [{"role": "user", "content": [{"type": "text", "text": "n"}]}],
            "max_tokens": 2, "truncate_prompt_tokens": 20, "request_id": "req-1", "user": "u",
            "cache_salt": "s", "service_tier": "auto", "priority": 0, "ignore_eos": true,
            "skip_special_tokens": false, "include_stop_str_in_output": true,
            "repetition_detection": {"max_pattern_size": 4, "min_count": 3}}),
    ];
    let completions = [
        json!({"prompt": "Hello", "max_tokens": 3}),
        json!({"model": "tiny", "prompt": ["Hi", "the cat"], "max_tokens": 4, "n": 2,
            "best_of": 3, "temperature": 0.7, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
            "seed": 3}),
        json!({"prompt": [2, 5, 6, 7], "max_tokens": 4, "stream": true, "echo": true,
            "logprobs": 2, "return_token_ids": true,
            "stream_options": {"include_usage": true, "continuous_usage_stats": true}}),
        json!({"prompt": [[2, 5], [2, 6, 7]], "max_tokens": 4, "echo": true, "logprobs": 3,
            "prompt_logprobs": 2, "return_tokens_as_token_ids": true,
            "add_special_tokens": false}),
        json!({"prompt": "b", "max_tokens": 0, "echo": true, "logprobs": 1}),
        json!({"prompt": "c", "max_tokens": 4, "stop": ["the", "\n"], "stop_token_ids": [1, 2],
            "logit_bias": {"5": 10.5, "6": -100}, "frequency_penalty": 0.5,
            "presence_penalty": -0.5, "repetition_penalty": 1.2, "min_tokens": 1,
            "bad_words": ["cat"], "allowed_token_ids": [5, 6, 7, 8, 9, 10],
            "include_stop_str_in_output": true, "skip_special_tokens": false}),
        json!({"prompt": "d", "max_tokens": 4, "n": 2, "use_beam_search": true,
            "length_penalty": 0.8, "temperature": 0}),
        json!({"prompt": "e", "max_tokens": 4, "structured_outputs": {"regex": "[a-z]{1,5}"}}),
        json!({"prompt": "f", "max_tokens": 4,
            "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}}),
        json!({"prompt": "g", "max_tokens": 2, "truncate_prompt_tokens": 20, "request_id": "req-2",
            "user": "u", "cache_salt": "s", "priority": 0, "ignore_eos": true,
            "engine_xargs": {"k": 1}, "kv_transfer_params": {"a": 1},
            "repetition_detection": {"max_pattern_size": 4, "min_count": 3}}),
    ];
    let tokenize = [
        json!({"prompt": "Hello world", "add_special_tokens": true}),
        json!({"model": "tiny", "messages": [user("Hi")], "add_generation_prompt": true,
            "tools": [tool]}),
    ];
    let detokenize = [
        json!({"tokens": [2, 5, 6, 7]}),
        json!({"model": "tiny", "tokens": []}),
    ];
    let trajectory =
        json!({"messages_and_choices": [user("q"), choice], "reward": 1.0, "metrics": {"ok": 1}});
    let training = [
        (
            "/v1/preview/models".to_owned(),
            json!({"entity": null, "project": "p", "name": "n", "base_model": "tiny",
                "return_existing": true}),
        ),
        (
            format!("/v1/preview/models/{model_id}/log"),
            json!({"model_id": model_id, "split": "val",
                "trajectory_groups": [{"trajectories": [trajectory]}]}),
        ),
        (
            "/v1/preview/training-jobs".to_owned(),
            json!({"model_id": model_id, "trajectory_groups": [{"trajectories": [trajectory]}],
                "experimental_config": {"learning_rate": 1e-4, "ppo": false}}),
        ),
        (
            "/v1/preview/sft-training-jobs".to_owned(),
            json!({"model_id": model_id, "trajectories": [{"messages": [user("q"),
                {"role": "assistant", "content": "a"}], "tools": []}],
                "config": {"learning_rate": 1e-3, "batch_size": 1, "epochs": 1}}),
        ),
    ];
    let routes = [
        (CHAT, &chat[..]),
        (COMPLETIONS, &completions),
        ("/tokenize", &tokenize),
        ("/detokenize", &detokenize),
    ];
    routes
        .iter()
        .flat_map(|(path, bodies)| bodies.iter().map(|b| (path.to_string(), b.clone())))
        .chain(training)
        .collect()
}

/// A mutated body: one value-level mutation of `valid` (1 in 4: two to four), then (1 in 10)
/// byte-level ones of its text, and (1 in 30) another content type. Mostly single mutations:
/// a body with several faults is refused at the first, and the paths past it go untested.
fn mutate(valid: &Value, rng: &mut Rng) -> (&'static str, Vec<u8>) {
    let mut body = valid.clone();
    let mutations = if rng.one_in(4) { 2 + rng.below(3) } else { 1 };
    for _ in 0..mutations {
        mutate_value(&mut body, rng);
    }
    let mut bytes = serde_json::to_vec(&body).unwrap();
    if rng.one_in(10) {
        mutate_bytes(&mut bytes, rng);
    }
    let content_type = if rng.one_in(30) {
        rng.pick(&[
            "text/plain",
            "application/x-www-form-urlencoded",
            "application/vnd+json",
        ])
    } else {
        "application/json"
    };
    (content_type, bytes)
}

/// One change at a random place of the tree: a value replaced (random, boundary, or a
/// generated schema/regex/grammar), removed, duplicated, or a known field added.
fn mutate_value(root: &mut Value, rng: &mut Rng) {
    let paths = paths(root);
    let path = rng.pick(&paths).clone();
    let target = pointer_mut(root, &path);
    match rng.below(10) {
        0..=2 => *target = random_value(rng, 3),
        3 | 4 => *target = boundary_value(rng),
        5 => *target = generated_constraint(rng),
        6 => match target {
            Value::Object(o) if !o.is_empty() => {
                let key = o.keys().nth(rng.below(o.len())).unwrap().clone();
                o.remove(&key);
            }
            Value::Array(a) if !a.is_empty() => {
                a.remove(rng.below(a.len()));
            }
            other => *other = Value::Null,
        },
        7 => match target {
            Value::Array(a) if !a.is_empty() => {
                let copies = if rng.one_in(4) { 200 } else { 1 };
                let item = a[rng.below(a.len())].clone();
                a.extend(std::iter::repeat_n(item, copies));
            }
            other => *other = json!([other.clone(), other.clone()]),
        },
        _ => {
            let value = random_value(rng, 2);
            match target {
                Value::Object(o) => {
                    o.insert(rng.pick(FIELD_NAMES).to_string(), value);
                }
                other => *other = json!({ *rng.pick(FIELD_NAMES): value }),
            }
        }
    }
}

/// JSON-pointer-like paths (keys and indices) of every node, the root included.
fn paths(root: &Value) -> Vec<Vec<PathStep>> {
    let mut out = Vec::new();
    let mut stack = vec![(root, Vec::new())];
    while let Some((v, path)) = stack.pop() {
        match v {
            Value::Object(o) => {
                for (k, child) in o {
                    let mut p = path.clone();
                    p.push(PathStep::Key(k.clone()));
                    stack.push((child, p));
                }
            }
            Value::Array(a) => {
                for (i, child) in a.iter().enumerate() {
                    let mut p = path.clone();
                    p.push(PathStep::Index(i));
                    stack.push((child, p));
                }
            }
            _ => {}
        }
        out.push(path);
    }
    out
}

#[derive(Clone)]
enum PathStep {
    Key(String),
    Index(usize),
}

fn pointer_mut<'a>(root: &'a mut Value, path: &[PathStep]) -> &'a mut Value {
    path.iter().fold(root, |v, step| match step {
        PathStep::Key(k) => &mut v[k.as_str()],
        PathStep::Index(i) => &mut v[*i],
    })
}

fn random_value(rng: &mut Rng, depth: usize) -> Value {
    let kinds = if depth == 0 { 6 } else { 8 };
    match rng.below(kinds) {
        0 => Value::Null,
        1 => json!(rng.one_in(2)),
        2 => json!(rng.next_u64() as i64 >> rng.below(64)),
        3 => json!((rng.next_u64() as i64 >> rng.below(64)) as f64 / 1000.0),
        4 => json!(random_string(rng)),
        5 => boundary_value(rng),
        6 => Value::Array(
            (0..rng.below(4))
                .map(|_| random_value(rng, depth - 1))
                .collect(),
        ),
        _ => Value::Object(
            (0..rng.below(4))
                .map(|_| {
                    (
                        rng.pick(FIELD_NAMES).to_string(),
                        random_value(rng, depth - 1),
                    )
                })
                .collect::<Map<_, _>>(),
        ),
    }
}

fn random_string(rng: &mut Rng) -> String {
    const PIECES: &[&str] = &[
        "a",
        "the",
        " ",
        "\n",
        "\t",
        "\"",
        "\\",
        "{",
        "}",
        "<",
        ">",
        "<start_of_turn>",
        "<end_of_turn>",
        "<bos>",
        "<eos>",
        "{{",
        "}}",
        "{%",
        "%}",
        "é",
        "日本",
        "🦀",
        "\u{0}",
        "\u{7f}",
        "\u{200b}",
        "\u{fffd}",
        "\u{10ffff}",
        "token_id:5",
        "token_id:-1",
        "token_id:99999999999",
        "add",
        "user",
        "assistant",
        "tool",
        "system",
        "function",
        "NaN",
        "Infinity",
        "-0",
        "1e999",
        "[",
        "]",
        "(",
        ")",
        "*",
        "+",
        "?",
        "|",
        "^",
        "$",
    ];
    (0..rng.below(12)).map(|_| *rng.pick(PIECES)).collect()
}

/// Values at the edges of what a field's parser, range check or allocation handles.
fn boundary_value(rng: &mut Rng) -> Value {
    match rng.below(24) {
        0 => json!(0),
        1 => json!(-1),
        2 => json!(1),
        3 => json!(i64::MAX),
        4 => json!(i64::MIN),
        5 => json!(u64::MAX),
        6 => json!(1e308),
        7 => json!(-1e308),
        8 => json!(5e-324),
        9 => json!(-0.0),
        10 => json!(9007199254740993u64),
        11 => json!(4294967296u64),
        12 => json!(2147483648u64),
        13 => json!(1e19),
        14 => json!(*rng.pick(&["NaN", "Infinity", "-Infinity", "inf", "1e999", ""])),
        15 => json!("x".repeat(1 << (10 + rng.below(8)))),
        16 => json!(std::iter::repeat_n('\u{0}', 64).collect::<String>()),
        17 => (0..rng.below(300)).fold(json!(0), |v, _| json!([v])),
        18 => (0..rng.below(300)).fold(json!(0), |v, _| json!({"a": v})),
        19 => json!([]),
        20 => json!({}),
        21 => json!(vec![rng.next_u64() % 400; 1 << rng.below(14)]),
        22 => json!(2.5),
        _ => json!(rng.below(300)),
    }
}

/// A random JSON schema, regex, grammar or structural tag: the constraint compilers' input.
fn generated_constraint(rng: &mut Rng) -> Value {
    match rng.below(4) {
        0 => random_schema(rng, 3),
        1 => json!(random_regex(rng, 3)),
        2 => json!(random_grammar(rng)),
        _ => json!({"type": "structural_tag", "triggers": [random_string(rng)],
            "structures": [{"begin": random_string(rng), "end": random_string(rng),
                "schema": random_schema(rng, 2)}]}),
    }
}

fn random_schema(rng: &mut Rng, depth: usize) -> Value {
    const TYPES: &[&str] = &[
        "object", "array", "string", "integer", "number", "boolean", "null", "nope",
    ];
    let mut schema = Map::new();
    if rng.below(5) > 0 {
        schema.insert("type".into(), json!(rng.pick(TYPES)));
    }
    for _ in 0..rng.below(4) {
        let (key, value) = match rng.below(16) {
            0 if depth > 0 => (
                "properties",
                json!({"a": random_schema(rng, depth - 1), "b": random_schema(rng, depth - 1)}),
            ),
            1 if depth > 0 => ("items", random_schema(rng, depth - 1)),
            2 if depth > 0 => (
                *rng.pick(&["anyOf", "oneOf", "allOf"]),
                json!([random_schema(rng, depth - 1), random_schema(rng, depth - 1)]),
            ),
            3 => ("required", json!(["a", "z"])),
            4 => (
                *rng.pick(&[
                    "minLength",
                    "maxLength",
                    "minItems",
                    "maxItems",
                    "minProperties",
                ]),
                boundary_value(rng),
            ),
            5 => (
                *rng.pick(&["minimum", "maximum", "exclusiveMinimum", "multipleOf"]),
                boundary_value(rng),
            ),
            6 => ("pattern", json!(random_regex(rng, 2))),
            7 => ("enum", json!([random_value(rng, 1), random_value(rng, 1)])),
            8 => ("const", random_value(rng, 1)),
            9 => (
                "$ref",
                json!(rng.pick(&["#", "#/properties/a", "#/$defs/x", "http://x/y", "#/nope"])),
            ),
            10 if depth > 0 => ("$defs", json!({"x": random_schema(rng, depth - 1)})),
            11 => ("additionalProperties", random_value(rng, 1)),
            12 => (
                "format",
                json!(rng.pick(&["date-time", "email", "uuid", "nope"])),
            ),
            _ => (*rng.pick(FIELD_NAMES), random_value(rng, 1)),
        };
        schema.insert(key.to_string(), value);
    }
    Value::Object(schema)
}

fn random_regex(rng: &mut Rng, depth: usize) -> String {
    const ATOMS: &[&str] = &[
        "a",
        ".",
        "[a-z]",
        "[^x]",
        "\\d",
        "\\w",
        "\\s",
        "\\p{L}",
        "[",
        "(",
        ")",
        "\\",
        "é",
        "^",
        "$",
        "\\b",
        "(?=a)",
        "\\1",
        "[z-a]",
        "\\u{10FFFF}",
        "x{0}",
    ];
    const REPEATS: &[&str] = &[
        "",
        "",
        "*",
        "+",
        "?",
        "{2}",
        "{1,3}",
        "{0,}",
        "{1000}",
        "{4294967296}",
        "{3,1}",
        "*?",
        "**",
    ];
    (0..1 + rng.below(4))
        .map(|_| {
            let atom = if depth > 0 && rng.one_in(3) {
                format!(
                    "({}|{})",
                    random_regex(rng, depth - 1),
                    random_regex(rng, depth - 1)
                )
            } else {
                rng.pick(ATOMS).to_string()
            };
            atom + *rng.pick(REPEATS)
        })
        .collect()
}

fn random_grammar(rng: &mut Rng) -> String {
    const RULES: &[&str] = &["start", "a", "b", "c"];
    const TERMINALS: &[&str] = &["A", "B", "NUM"];
    let symbol = |rng: &mut Rng| -> String {
        match rng.below(5) {
            0 => rng.pick(RULES).to_string(),
            1 => rng.pick(TERMINALS).to_string(),
            2 => format!("{:?}", random_string(rng)),
            3 => format!("/{}/", random_regex(rng, 1)),
            _ => format!("{}{}", rng.pick(RULES), rng.pick(&["*", "+", "?", ""])),
        }
    };
    let mut grammar = String::new();
    for rule in RULES.iter().chain(TERMINALS).take(1 + rng.below(7)) {
        let alternatives: Vec<String> = (0..1 + rng.below(3))
            .map(|_| {
                (0..1 + rng.below(3))
                    .map(|_| symbol(rng))
                    .collect::<Vec<_>>()
                    .join(" ")
            })
            .collect();
        grammar += &format!("{rule}: {}\n", alternatives.join(" | "));
    }
    if rng.one_in(4) {
        grammar += *rng.pick(&[
            "%ignore \" \"\n",
            "%import common.NUMBER\n",
            "%llguidance {}\n",
        ]);
    }
    grammar
}

/// Byte-level damage to the serialized body: truncation, invalid UTF-8, flipped bytes,
/// duplicated keys, numbers out of every range, or random bytes.
fn mutate_bytes(bytes: &mut Vec<u8>, rng: &mut Rng) {
    let at = rng.below(bytes.len() + 1);
    match rng.below(7) {
        0 => bytes.truncate(at),
        1 => {
            let invalid: &[&[u8]] = &[
                b"\xff",
                b"\xc3",
                b"\xed\xa0\x80",
                b"\xf4\x90\x80\x80",
                b"\xc0\xaf",
            ];
            bytes.splice(at..at, rng.pick(invalid).iter().copied());
        }
        2 => {
            if let Some(b) = bytes.get_mut(at) {
                *b ^= 1 << rng.below(8);
            }
        }
        3 => {
            // A key that is already there, again: the last one wins or the body is refused.
            if let Some(open) = bytes.iter().position(|&b| b == b'{') {
                let dup = format!("\"{}\":{},", rng.pick(FIELD_NAMES), random_value(rng, 1));
                bytes.splice(open + 1..open + 1, dup.into_bytes());
            }
        }
        4 => {
            let text: &[&str] = &[
                "1e999999",
                "-1e999999",
                "123456789012345678901234567890",
                "-0",
                "0.0e-99999",
                "\"\\ud800\"",
                "\"\\u0000\"",
                "NaN",
                "Infinity",
            ];
            bytes.splice(at..at, rng.pick(text).bytes());
        }
        5 => bytes.extend((0..rng.below(32)).map(|_| rng.next_u64() as u8)),
        _ => *bytes = (0..rng.below(256)).map(|_| rng.next_u64() as u8).collect(),
    }
}
