//! The default model (Gemma 3 270M Q4_K_M) through HTTP with the shipped template, against
//! llama.cpp's greedy output. Needs the model file: `$TEMPER_MODEL_PATH`, else
//! `${TEMPER_HOME:-$HOME/.cache/temper}/models/gemma-3-270m-q4_k_m.gguf`. Without it the tests
//! skip with a notice, or fail when `TEMPER_REQUIRE_MODEL=1` (as `make test` and CI set).

mod common;

use common::{check_stream, options, TestServer};
use serde_json::{json, Value};

const GOLDEN: &str = include_str!("fixtures/greedy-sample.jsonl");

async fn server() -> Option<TestServer> {
    let path = temper_model::paths::real_model_for_tests()?;
    Some(TestServer::model("gemma-3-270m", &path, options()).await)
}

/// Below this top-1/top-2 gap (nats) llama.cpp's greedy choice is decided by last-bit rounding
/// of its 8-bit activation quantization; ids are compared up to the first such position
/// (docs/how-it-works.md, Correctness).
const NEAR_TIE: f64 = 0.5;

fn first_near_tie(top_logprobs: &Value) -> usize {
    let positions = top_logprobs.as_array().unwrap();
    positions
        .iter()
        .position(|top| {
            top[0]["logprob"].as_f64().unwrap() - top[1]["logprob"].as_f64().unwrap() < NEAR_TIE
        })
        .unwrap_or(positions.len())
}

fn ids(v: &Value) -> Vec<u64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn greedy_matches_llama_cpp() {
    let Some(s) = server().await else { return };
    let mut matching = 0;
    let mut report = Vec::new();
    for line in GOLDEN.lines().filter(|l| !l.trim().is_empty()) {
        let golden: Value = serde_json::from_str(line).unwrap();
        let (status, v) = s
            .chat(&json!({"model": "gemma-3-270m",
                "messages": [{"role": "user", "content": golden["message"]}],
                "temperature": 0, "max_completion_tokens": 16, "return_token_ids": true}))
            .await;
        assert_eq!(status, 200, "{v}");
        // The shipped template and the tokenizer must give llama.cpp's prompt exactly.
        assert_eq!(
            ids(&v["prompt_token_ids"]),
            ids(&golden["prompt_ids"]),
            "prompt of {}",
            golden["message"]
        );
        let got = ids(&v["choices"][0]["token_ids"]);
        let want: Vec<u64> = ids(&golden["ids"])[..16].to_vec();
        let near_tie = first_near_tie(&golden["top_logprobs"]);
        match (0..16).find(|&p| got[p] != want[p]) {
            None => matching += 1,
            Some(p) => {
                let line = format!(
                    "{}: diverges at {p}, llama.cpp's first near-tie at {near_tie}: got {got:?}, \
                     want {want:?}",
                    golden["message"]
                );
                eprintln!("{line}");
                if p < near_tie {
                    report.push(line);
                }
            }
        }
    }
    // Our arithmetic is not llama.cpp's (issue 11: no row-count-dependent paths, no f16
    // roundings): ids must agree up to llama.cpp's first near tie (docs/how-it-works.md,
    // Correctness).
    eprintln!("{matching}/5 reproduce llama.cpp's first 16 greedy ids");
    assert!(
        report.is_empty(),
        "diverged from llama.cpp before a near-tie:\n{}",
        report.join("\n")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_and_non_streamed_completions() {
    let Some(s) = server().await else { return };
    let body = json!({"messages": [{"role": "user", "content": "What is the capital of France?"}],
        "temperature": 0, "max_completion_tokens": 24, "return_token_ids": true});
    let (status, full) = s.chat(&body).await;
    assert_eq!(status, 200, "{full}");
    let text = full["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(!text.is_empty());
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let events = s.chat_stream(&streamed).await;
    let (choices, usage) = check_stream(&events, 1);
    assert_eq!(choices[0].content, text);
    assert_eq!(choices[0].token_ids, ids(&full["choices"][0]["token_ids"]));
    assert_eq!(
        choices[0].finish_reason.as_deref(),
        full["choices"][0]["finish_reason"].as_str()
    );
    assert_eq!(usage.unwrap(), full["usage"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_concurrent_requests_are_batched() {
    let Some(s) = server().await else { return };
    let questions = [
        "Name a color.",
        "What is two plus two?",
        "Say hello.",
        "Write a short poem about the sea.",
    ];
    let requests = questions.iter().map(|q| {
        let body = json!({"messages": [{"role": "user", "content": q}],
            "max_completion_tokens": 24, "ignore_eos": true, "temperature": 0.7, "seed": 1});
        let s = &s;
        async move { s.chat(&body).await }
    });
    let results = futures_util::future::join_all(requests).await;
    for (status, v) in &results {
        assert_eq!(*status, 200, "{v}");
        assert_eq!(v["usage"]["completion_tokens"], 24);
        assert!(!v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .is_empty());
    }
    let stats = s.engine_stats();
    assert!(
        stats.max_rows_in_step >= 4,
        "never batched 4 rows: {stats:?}"
    );
}
