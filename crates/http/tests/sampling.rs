//! Sampling controls over HTTP on the tiny model: validation errors name their field, accepted
//! controls reach the engine, and `return_tokens_as_token_ids` reshapes logprobs (streaming too).

mod common;

use common::{check_stream, direct_log_softmax, options, TestServer};
use serde_json::{json, Value};

fn body(extra: Value) -> Value {
    let mut b = json!({"messages": [{"role": "user", "content": "the dog and the cat"}],
        "max_completion_tokens": 12, "temperature": 0, "ignore_eos": true,
        "return_token_ids": true});
    for (k, v) in extra.as_object().unwrap() {
        b[k] = v.clone();
    }
    b
}

fn ids(v: &Value) -> Vec<u64> {
    v["choices"][0]["token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect()
}

#[tokio::test]
async fn invalid_controls_are_400s_naming_the_field() {
    let s = TestServer::tiny(options(), None).await;
    let cases = [
        (json!({"frequency_penalty": 2.5}), "frequency_penalty"),
        (json!({"presence_penalty": -2.1}), "presence_penalty"),
        (json!({"repetition_penalty": 0}), "repetition_penalty"),
        (json!({"repetition_penalty": -1}), "repetition_penalty"),
        (json!({"logit_bias": {"abc": 1}}), "logit_bias"),
        (json!({"logit_bias": {"1000000": 1}}), "logit_bias"),
        (json!({"logit_bias": {"-1": 1}}), "logit_bias"),
        (json!({"logit_bias": {"5": 1, "05": 2}}), "logit_bias"),
        (json!({"allowed_token_ids": []}), "allowed_token_ids"),
        (
            json!({"allowed_token_ids": [1, 1000000]}),
            "allowed_token_ids",
        ),
        (json!({"min_tokens": -1}), "min_tokens"),
        (json!({"min_tokens": 13}), "min_tokens"),
        (
            json!({"repetition_detection": {"max_pattern_size": -1}}),
            "repetition_detection.max_pattern_size",
        ),
        (
            json!({"repetition_detection": {"max_pattern_size": 2, "min_pattern_size": 3, "min_count": 2}}),
            "repetition_detection.min_pattern_size",
        ),
        (
            json!({"repetition_detection": {"max_pattern_size": 2, "min_count": 1}}),
            "repetition_detection.min_count",
        ),
    ];
    for (extra, param) in cases {
        let (status, v) = s.chat(&body(extra.clone())).await;
        assert_eq!(status, 400, "{extra}: {v}");
        assert_eq!(v["error"]["param"], param, "{extra}: {v}");
        assert_eq!(v["error"]["type"], "BadRequestError");
    }
    // min_tokens above the implicit budget (context left after the prompt).
    let s = TestServer::tiny(options(), Some(64)).await;
    let mut b = body(json!({"min_tokens": 64}));
    b.as_object_mut().unwrap().remove("max_completion_tokens");
    let (status, v) = s.chat(&b).await;
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["param"], "min_tokens");
}

#[tokio::test]
async fn accepted_controls_change_the_output() {
    let s = TestServer::tiny(options(), None).await;
    let (status, base) = s.chat(&body(json!({}))).await;
    assert_eq!(status, 200, "{base}");
    let base_ids = ids(&base);
    // A forced token: logit_bias +100 (values beyond 100 are clamped, not rejected).
    let forced = (5..).find(|t| !base_ids.contains(t)).unwrap();
    let (status, v) = s
        .chat(&body(json!({"logit_bias": {forced.to_string(): 250}})))
        .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(ids(&v), vec![forced; 12]);
    // allowed_token_ids at temperature 1.
    let (_, v) = s
        .chat(&body(
            json!({"allowed_token_ids": [40, 41, 77], "temperature": 1, "seed": 3}),
        ))
        .await;
    assert!(ids(&v).iter().all(|t| [40, 41, 77].contains(t)), "{v}");
    // Penalties change greedy output.
    for extra in [
        json!({"repetition_penalty": 1.8}),
        json!({"frequency_penalty": 2}),
        json!({"presence_penalty": 2}),
    ] {
        let (status, v) = s.chat(&body(extra.clone())).await;
        assert_eq!(status, 200, "{v}");
        assert_ne!(ids(&v), base_ids, "{extra} had no effect");
    }
    // bad_words: the first greedy token, as a word, is never generated.
    let first = base_ids[0];
    let post = |path: &'static str, b: Value| {
        let req = s.post(path, &b);
        async move { req.send().await.unwrap().json::<Value>().await.unwrap() }
    };
    let word = post("/detokenize", json!({"tokens": [first]})).await["prompt"]
        .as_str()
        .unwrap()
        .trim_start()
        .to_owned();
    let mut one_token = false;
    for spelling in [word.clone(), format!(" {word}")] {
        let v = post(
            "/tokenize",
            json!({"prompt": spelling, "add_special_tokens": false}),
        )
        .await;
        one_token |= v["tokens"] == json!([first]);
    }
    assert!(one_token, "{word:?} does not tokenize back to {first}");
    let (status, v) = s.chat(&body(json!({"bad_words": [word]}))).await;
    assert_eq!(status, 200, "{v}");
    assert!(!ids(&v).contains(&first), "{v}");
    // Repetition detection on a forced loop.
    let (status, v) = s
        .chat(&body(json!({"allowed_token_ids": [forced],
            "repetition_detection": {"max_pattern_size": 1, "min_count": 3}})))
        .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(ids(&v), vec![forced; 3]);
    assert_eq!(v["choices"][0]["finish_reason"], "repetition");
    assert_eq!(v["choices"][0]["stop_reason"], "repetition_detected");
    let mut streamed = body(json!({"allowed_token_ids": [forced], "stream": true,
        "repetition_detection": {"max_pattern_size": 1, "min_count": 3}}));
    streamed["stream"] = json!(true);
    let events = s.chat_stream(&streamed).await;
    let (choices, _) = check_stream(&events, 1);
    assert_eq!(choices[0].finish_reason.as_deref(), Some("repetition"));
    // max_pattern_size 0 is "off" and accepted.
    let (status, v) = s
        .chat(&body(
            json!({"repetition_detection": {"max_pattern_size": 0}}),
        ))
        .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(ids(&v), base_ids);
    // min_tokens within the budget is accepted.
    let (status, v) = s.chat(&body(json!({"min_tokens": 12}))).await;
    assert_eq!(status, 200, "{v}");
}

#[tokio::test]
async fn return_tokens_as_token_ids_in_logprobs() {
    let s = TestServer::tiny(options(), None).await;
    let b = body(json!({"logprobs": true, "top_logprobs": 2,
        "return_tokens_as_token_ids": true}));
    let (status, v) = s.chat(&b).await;
    assert_eq!(status, 200, "{v}");
    let content = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    for (entry, id) in content.iter().zip(ids(&v)) {
        assert_eq!(entry["token"], format!("token_id:{id}"));
        let top = entry["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 2);
        for t in top {
            let token = t["token"].as_str().unwrap();
            let n = token.strip_prefix("token_id:").expect("token_id form");
            assert!(n.parse::<u32>().is_ok(), "{token}");
        }
        // Greedy: the best alternative is the sampled token.
        assert_eq!(top[0]["token"], entry["token"]);
    }
    // Off: plain token text.
    let (_, plain) = s
        .chat(&body(json!({"logprobs": true, "top_logprobs": 2})))
        .await;
    let first = &plain["choices"][0]["logprobs"]["content"][0]["token"];
    assert!(!first.as_str().unwrap().starts_with("token_id:"));
    // Streaming: the same entries.
    let mut streamed = b.clone();
    streamed["stream"] = json!(true);
    let events = s.chat_stream(&streamed).await;
    let entries: Vec<Value> = events
        .iter()
        .filter_map(|e| e["choices"][0]["logprobs"]["content"].as_array().cloned())
        .flatten()
        .collect();
    assert_eq!(&entries, content);
}

/// prompt_logprobs: null first, then per position the prompt token (rank = tokens at least as
/// likely) followed by the k best, all equal to a direct log-softmax of the model's logits.
#[tokio::test]
async fn prompt_logprobs_equal_the_models_log_softmax() {
    let s = TestServer::tiny(options(), None).await;
    let (status, v) = s
        .chat(&body(
            json!({"prompt_logprobs": 2, "n": 2, "temperature": 1, "seed": 3}),
        ))
        .await;
    assert_eq!(status, 200, "{v}");
    let prompt: Vec<u32> = v["prompt_token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect();
    let entries = v["prompt_logprobs"].as_array().unwrap();
    assert_eq!(entries.len(), prompt.len());
    assert!(entries[0].is_null());
    let want = direct_log_softmax(&s, &prompt);
    let mut outside_top = 0;
    for (i, entry) in entries.iter().enumerate().skip(1) {
        let lsm = &want[i - 1];
        let mut order: Vec<usize> = (0..lsm.len()).collect();
        order.sort_by(|&a, &b| lsm[b].total_cmp(&lsm[a]).then(a.cmp(&b)));
        let map = entry.as_object().unwrap();
        let keys: Vec<usize> = map.keys().map(|k| k.parse().unwrap()).collect();
        let token = prompt[i] as usize;
        // The prompt token first, then the top 2 without it.
        let mut expected = vec![token];
        expected.extend(order[..2].iter().filter(|&&t| t != token));
        assert_eq!(keys, expected, "position {i}");
        if expected.len() == 3 {
            outside_top += 1;
        }
        for (key, lp) in map {
            let id: usize = key.parse().unwrap();
            let got = lp["logprob"].as_f64().unwrap();
            assert!(
                (got - lsm[id]).abs() < 1e-4,
                "position {i} token {id}: {got} vs {}",
                lsm[id]
            );
            let rank = lsm.iter().filter(|&&l| l >= lsm[id]).count();
            assert_eq!(lp["rank"], rank, "position {i} token {id}");
            assert!(lp["decoded_token"].is_string());
        }
    }
    assert!(
        outside_top > 0,
        "no position had its token outside the top 2"
    );
    // n = 2 choices came from the one prefill.
    assert_eq!(v["choices"].as_array().unwrap().len(), 2);
    assert_eq!(s.engine_stats().prompt_logprobs, prompt.len() as u64 - 1);

    for (extra, param) in [
        (json!({"prompt_logprobs": -2}), "prompt_logprobs"),
        (json!({"prompt_logprobs": 21}), "prompt_logprobs"),
        (
            json!({"prompt_logprobs": 1, "stream": true}),
            "prompt_logprobs",
        ),
    ] {
        let (status, v) = s.chat(&body(extra)).await;
        assert_eq!(status, 400, "{v}");
        assert_eq!(v["error"]["param"], param);
    }
}

/// use_beam_search through HTTP: width 1 is greedy; width 3 gives 3 distinct choices whose
/// scores (recomputed from the model's log-softmax) are best first; usage counts every
/// returned token; streaming gives the same choices; fields beam search cannot honour are 400s.
#[tokio::test]
async fn beam_search_over_http() {
    let s = TestServer::tiny(options(), None).await;
    let (_, greedy) = s.chat(&body(json!({}))).await;
    let (status, width1) = s
        .chat(&body(json!({"use_beam_search": true, "n": 1})))
        .await;
    assert_eq!(status, 200, "{width1}");
    assert_eq!(ids(&width1), ids(&greedy));

    let beam = body(
        json!({"use_beam_search": true, "n": 3, "length_penalty": 0.5,
                           "logprobs": true, "top_logprobs": 1}),
    );
    let (status, v) = s.chat(&beam).await;
    assert_eq!(status, 200, "{v}");
    let prompt: Vec<u32> = v["prompt_token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect();
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3);
    let mut scores = Vec::new();
    let mut total = 0;
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i);
        assert_eq!(c["finish_reason"], "length");
        let out: Vec<u32> = c["token_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(out.len(), 12);
        assert_eq!(c["logprobs"]["content"].as_array().unwrap().len(), 12);
        total += out.len();
        let tokens: Vec<u32> = prompt.iter().chain(&out).copied().collect();
        let lsm = direct_log_softmax(&s, &tokens);
        let cum: f64 = (prompt.len()..tokens.len())
            .map(|j| lsm[j - 1][tokens[j] as usize])
            .sum();
        for (j, entry) in c["logprobs"]["content"]
            .as_array()
            .unwrap()
            .iter()
            .enumerate()
        {
            let want = lsm[prompt.len() + j - 1][out[j] as usize];
            assert!((entry["logprob"].as_f64().unwrap() - want).abs() < 1e-4);
        }
        scores.push(cum / (tokens.len() as f64).powf(0.5));
    }
    assert_ne!(
        ids(&v),
        choices[1]["token_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap())
            .collect::<Vec<_>>()
    );
    for w in scores.windows(2) {
        assert!(w[0] >= w[1] - 1e-5, "not best first: {scores:?}");
    }
    assert_eq!(v["usage"]["completion_tokens"], total);

    // Streaming: the same choices, sent when the search ends.
    let mut streamed = beam.clone();
    streamed["stream"] = json!(true);
    let events = s.chat_stream(&streamed).await;
    let (got, _) = check_stream(&events, 3);
    for (g, c) in got.iter().zip(choices) {
        assert_eq!(g.content, c["message"]["content"].as_str().unwrap());
        assert_eq!(g.finish_reason.as_deref(), Some("length"));
    }

    for (extra, param) in [
        (json!({"top_p": 0.9}), "top_p"),
        (json!({"stop": ["x"]}), "stop"),
        (
            json!({"response_format": {"type": "json_object"}}),
            "response_format",
        ),
    ] {
        let mut b = body(json!({"use_beam_search": true, "n": 2}));
        for (k, val) in extra.as_object().unwrap() {
            b[k] = val.clone();
        }
        let (status, v) = s.chat(&b).await;
        assert_eq!(status, 400, "{v}");
        assert!(
            v["error"]["param"].as_str().unwrap().starts_with(param),
            "{v}"
        );
    }
    let (status, v) = s.chat(&body(json!({"length_penalty": 2}))).await;
    assert_eq!(
        (status, v["error"]["param"].as_str()),
        (400, Some("length_penalty"))
    );
}
