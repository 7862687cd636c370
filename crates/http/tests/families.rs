//! A Qwen2-shaped model served end to end through HTTP: a random tiny `qwen2` GGUF with a
//! byte-level BPE vocabulary (Qwen's pre-tokenizer and special tokens) and Qwen 2.5's chat
//! template (`scripts/make-tiny-served.py`). Its prompt renders and tokenizes to exactly the ids
//! transformers and the Hugging Face tokenizer give; chat completions stream and end at
//! `<|im_end|>`'s id; forced tool calls come back in Qwen's `<tool_call>` format and parse. And
//! beside a Gemma-shaped model in one server, an RL round on it: roll out, train, serve the
//! checkpoint by name.

mod common;

use std::time::{Duration, Instant};

use common::{check_stream, options, TestServer};
use serde_json::{json, Value};
use temper_http::{CatalogOptions, ModelSpec, ServedModel, ServerOptions, TrainingOptions};

const FIXTURE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/tiny-qwen2-bpe");

fn expected() -> Value {
    serde_json::from_str(&std::fs::read_to_string(format!("{FIXTURE}.json")).unwrap()).unwrap()
}

async fn server() -> TestServer {
    let options = ServerOptions {
        enable_tool_calls: true,
        ..options()
    };
    TestServer::model("tiny-qwen2", format!("{FIXTURE}.gguf").as_ref(), options).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_qwen2_bpe_model_tokenizes_its_template_as_transformers_does() {
    let s = server().await;
    let want = expected();
    let v = s
        .post_ok(
            "/tokenize",
            &json!({"messages": want["messages"], "tools": want["tools"],
                "add_generation_prompt": true}),
        )
        .await;
    assert_eq!(v["tokens"], want["prompt_ids"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_qwen2_bpe_model_answers_streams_and_calls_tools() {
    let s = server().await;
    let want = expected();
    let body = json!({"messages": want["messages"], "max_completion_tokens": 12,
        "temperature": 0, "logprobs": true, "return_token_ids": true});
    let (status, v) = s.chat(&body).await;
    assert_eq!(status, 200, "{v}");
    let choice = &v["choices"][0];
    let prompt = s
        .post_ok("/tokenize", &json!({"messages": want["messages"]}))
        .await;
    assert_eq!(v["usage"]["prompt_tokens"], prompt["count"]);
    let ids = choice["token_ids"].as_array().unwrap();
    assert!(!ids.is_empty() && ids.len() <= 12, "{choice}");
    assert_eq!(
        choice["logprobs"]["content"].as_array().unwrap().len(),
        ids.len()
    );
    // Streamed, the same greedy answer.
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let (choices, _) = check_stream(&s.chat_stream(&streamed).await, 1);
    assert_eq!(
        choices[0].content,
        choice["message"]["content"].as_str().unwrap()
    );

    // `tool_choice: required`: calls in Qwen's format, parsed into tool_calls.
    let (status, v) = s
        .chat(
            &json!({"messages": want["messages"], "tools": want["tools"],
            "tool_choice": "required", "parallel_tool_calls": false, "temperature": 1,
            "seed": 5, "n": 3, "max_completion_tokens": 200, "return_token_ids": true}),
        )
        .await;
    assert_eq!(status, 200, "{v}");
    for choice in v["choices"].as_array().unwrap() {
        assert_eq!(choice["finish_reason"], "tool_calls", "{choice}");
        let calls = choice["message"]["tool_calls"].as_array().unwrap();
        assert_eq!(calls.len(), 1, "{choice}");
        assert_eq!(calls[0]["function"]["name"], "get_weather");
        let args: Value =
            serde_json::from_str(calls[0]["function"]["arguments"].as_str().unwrap()).unwrap();
        assert!((1..=7).contains(&args["days"].as_u64().unwrap()), "{args}");
        let raw = s
            .post_ok("/detokenize", &json!({"tokens": choice["token_ids"]}))
            .await;
        assert!(
            raw["prompt"]
                .as_str()
                .unwrap()
                .starts_with("<tool_call>\n{\"name\": "),
            "{raw}"
        );
    }
}

/// Two families in one server: `/v1/models` lists both; a model registered on the qwen2 base
/// trains on rollouts from it (the job names its base), and its checkpoint serves by name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_qwen2_model_trains_beside_a_gemma_model() {
    let data = tempfile::tempdir().unwrap();
    let gemma_path = data.path().join("tiny-gemma.gguf");
    temper_model::tiny::write_tiny_gguf(&gemma_path, 7).unwrap();
    let models = [
        ModelSpec::new("tiny-gemma", &gemma_path),
        ModelSpec::new("tiny-qwen2", format!("{FIXTURE}.gguf")),
    ]
    .iter()
    .map(|spec| ServedModel::load(spec).unwrap())
    .collect();
    let s = TestServer::with_training(
        models,
        options(),
        CatalogOptions::new(data.path()),
        TrainingOptions::default(),
    )
    .await;
    s.state.training().unwrap().spawn_worker().unwrap();
    let listed = s.get("/v1/models").await.json::<Value>().await.unwrap();
    let ids: Vec<&str> = listed["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["tiny-gemma", "tiny-qwen2"]);

    let model = s
        .post_ok(
            "/v1/preview/models",
            &json!({"project": "proj", "name": "q", "base_model": "tiny-qwen2"}),
        )
        .await;
    let user = json!({"role": "user", "content": "Weather in Paris?"});
    let rollout = s
        .post_ok(
            "/v1/chat/completions",
            &json!({"model": "tiny-qwen2", "messages": [user], "max_tokens": 4, "n": 2,
                "temperature": 1.0, "seed": 5, "logprobs": true,
                "return_tokens_as_token_ids": true}),
        )
        .await;
    let trajectories: Vec<Value> = rollout["choices"]
        .as_array()
        .unwrap()
        .iter()
        .enumerate()
        .map(|(i, c)| json!({"messages_and_choices": [user, c], "reward": i as f64}))
        .collect();
    let job = s
        .post_ok(
            "/v1/preview/training-jobs",
            &json!({"model_id": model["id"],
                "trajectory_groups": [{"trajectories": trajectories}]}),
        )
        .await;
    let path = format!("/v1/preview/training-jobs/{}", job["id"].as_str().unwrap());
    let started = Instant::now();
    let job = loop {
        let job = s.get(&path).await.json::<Value>().await.unwrap();
        if !matches!(job["status"].as_str(), Some("queued" | "running")) {
            break job;
        }
        assert!(started.elapsed() < Duration::from_secs(120), "{job}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(
        (&job["status"], &job["step"]),
        (&json!("succeeded"), &json!(1)),
        "{job}"
    );
    let (status, v) = s
        .chat(&json!({"model": "default/proj/q:step1", "messages": [user], "max_tokens": 4}))
        .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["model"], "default/proj/q:step1");
}

/// Qwen 3's template marks thinking: output opening with `<think>` is split into `reasoning`
/// (dropped with `include_reasoning: false`); with `enable_thinking: false` the template closes
/// the thinking in the prompt and the output is content. The output is forced by a regex.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qwen3s_template_splits_thinking_into_reasoning() {
    check_thinking_split("qwen3", &[]).await;
}

/// SmolLM3's the same way: thinking on by default (its `/think` mode: the model opens
/// `<think>` itself after `<|im_start|>assistant\n`), off by `enable_thinking: false` or a
/// system message's `/no_think` (the generation prompt then ends with an empty
/// `<think>\n\n</think>\n`, after which the output is content).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn smollm3s_template_splits_thinking_into_reasoning() {
    let no_think = json!({"role": "system", "content": "Be brief. /no_think"});
    check_thinking_split("smollm3", &[no_think]).await;
}

/// The reasoning split of a template of `crates/text/tests/fixtures/templates/` served with the
/// tiny Qwen2 model; `off`: messages put in front of the user's that turn thinking off, each
/// checked as `enable_thinking: false` is.
async fn check_thinking_split(template: &str, off: &[Value]) {
    let template = std::fs::read_to_string(format!(
        "{}/../text/tests/fixtures/templates/{template}.jinja",
        env!("CARGO_MANIFEST_DIR")
    ))
    .unwrap();
    let s = TestServer::model(
        "tiny-qwen2",
        format!("{FIXTURE}.gguf").as_ref(),
        ServerOptions {
            trust_request_chat_template: true,
            ..options()
        },
    )
    .await;
    let user = json!({"role": "user", "content": "Hi"});
    let ask = |extra: Value| {
        let mut body = json!({"messages": [user],
            "chat_template": template, "max_completion_tokens": 40, "temperature": 0});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        body
    };
    let thinking = json!({"structured_outputs": {"regex": "<think>\nab\n</think>\n\ncd"}});
    let (status, v) = s.chat(&ask(thinking.clone())).await;
    assert_eq!(status, 200, "{v}");
    let message = &v["choices"][0]["message"];
    // Unstripped, as vLLM's Qwen 3 reasoning parser leaves them.
    assert_eq!(
        (&message["reasoning"], &message["content"]),
        (&json!("\nab\n"), &json!("\n\ncd")),
        "{v}"
    );
    let mut hidden = thinking.clone();
    hidden["include_reasoning"] = json!(false);
    let (_, v) = s.chat(&ask(hidden)).await;
    let message = &v["choices"][0]["message"];
    assert!(message.get("reasoning").is_none_or(Value::is_null), "{v}");
    assert_eq!(message["content"], "\n\ncd");
    let content_only = json!({"structured_outputs": {"regex": "cd"}});
    let mut offs = vec![json!({"chat_template_kwargs": {"enable_thinking": false}})];
    offs.extend(off.iter().map(|m| json!({"messages": [m, user]})));
    for extra in offs {
        let mut body = ask(content_only.clone());
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        let (status, v) = s.chat(&body).await;
        assert_eq!(status, 200, "{extra}: {v}");
        let message = &v["choices"][0]["message"];
        assert_eq!(message["content"], "cd", "{extra}: {v}");
        assert!(
            message.get("reasoning").is_none_or(Value::is_null),
            "{extra}: {v}"
        );
    }
}
