//! `POST /v1/completions` through real HTTP on the tiny model: every prompt form, echo with
//! logprobs (the prompt's logprobs equal chat's `prompt_logprobs` and the model's own
//! log-softmax), greedy determinism, token-id prompts equal to their text, n and best_of, stop
//! strings, streaming equal to the whole answer, usage with cached tokens, checkpoint names,
//! metering, and the 400s.

mod common;

use std::time::Duration;

use common::{direct_log_softmax, options, parse_sse, TestServer, KEY};
use futures_util::StreamExt;
use serde_json::{json, Value};

const PATH: &str = "/v1/completions";

async fn complete(s: &TestServer, body: &Value) -> (u16, Value) {
    let resp = s.post(PATH, body).send().await.unwrap();
    let status = resp.status().as_u16();
    (status, resp.json().await.unwrap())
}

async fn complete_ok(s: &TestServer, body: &Value) -> Value {
    let (status, v) = complete(s, body).await;
    assert_eq!(status, 200, "{body}: {v}");
    check_response(&v);
    v
}

/// The `data:` payloads of a streamed completion (`[DONE]` as the string).
async fn complete_stream(s: &TestServer, body: &Value) -> Vec<Value> {
    let resp = s.post(PATH, body).send().await.unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    assert_eq!(
        resp.headers()["content-type"].to_str().unwrap(),
        "text/event-stream"
    );
    parse_sse(&resp.text().await.unwrap())
}

async fn refused(s: &TestServer, body: &Value, param: &str) -> Value {
    let (status, v) = complete(s, body).await;
    assert_eq!(status, 400, "{body}: {v}");
    assert_eq!(v["error"]["type"], "BadRequestError", "{v}");
    assert_eq!(v["error"]["code"], 400, "{v}");
    assert_eq!(v["error"]["param"], param, "{body}: {v}");
    v
}

/// vLLM's response shape, and logprobs arrays of one length.
fn check_response(v: &Value) {
    assert_eq!(v["object"], "text_completion", "{v}");
    assert!(v["id"].as_str().unwrap().starts_with("cmpl-"), "{v}");
    assert!(v["created"].as_u64().unwrap() > 1_600_000_000);
    assert!(v["system_fingerprint"].is_string());
    for (i, c) in v["choices"].as_array().unwrap().iter().enumerate() {
        assert_eq!(c["index"], i, "{v}");
        assert!(c["text"].is_string());
        assert!(c["finish_reason"].is_string(), "{v}");
        assert!(c.get("stop_reason").is_some());
        if let Some(lp) = c["logprobs"].as_object() {
            let len = lp["tokens"].as_array().unwrap().len();
            for key in ["text_offset", "token_logprobs", "top_logprobs"] {
                assert_eq!(lp[key].as_array().unwrap().len(), len, "{key}: {v}");
            }
        } else {
            assert!(c["logprobs"].is_null());
        }
    }
    let u = &v["usage"];
    assert_eq!(
        u["total_tokens"].as_u64().unwrap(),
        u["prompt_tokens"].as_u64().unwrap() + u["completion_tokens"].as_u64().unwrap()
    );
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap_or_else(|| panic!("not a list of ids: {v}"))
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect()
}

fn texts(v: &Value) -> Vec<String> {
    v["choices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["text"].as_str().unwrap().to_owned())
        .collect()
}

/// `/tokenize`'s ids for a text prompt.
async fn tokenize(s: &TestServer, text: &str) -> Vec<u32> {
    let v = s
        .post_ok("/tokenize", &json!({"model": "tiny", "prompt": text}))
        .await;
    ids(&v["tokens"])
}

const PROMPT: &str = "the dog and the cat";

#[tokio::test]
async fn every_prompt_form_is_served_and_token_ids_equal_the_text() {
    let s = TestServer::tiny(options(), None).await;
    let greedy = |prompt: Value| {
        json!({"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0,
               "ignore_eos": true, "return_token_ids": true})
    };
    let one = complete_ok(&s, &greedy(json!(PROMPT))).await;
    assert_eq!(one["model"], "tiny");
    let choice = &one["choices"][0];
    assert_eq!(choice["finish_reason"], "length");
    assert!(choice["stop_reason"].is_null());
    assert!(choice["logprobs"].is_null());
    assert_eq!(ids(&choice["token_ids"]).len(), 6);
    assert_eq!(one["usage"]["completion_tokens"], 6);
    // The text's tokens are /tokenize's, BOS in front (add_special_tokens defaults to true).
    let tokens = tokenize(&s, PROMPT).await;
    assert_eq!(tokens[0], 2, "{tokens:?}");
    assert_eq!(ids(&choice["prompt_token_ids"]), tokens);
    assert_eq!(one["usage"]["prompt_tokens"], tokens.len());
    // Greedy: the same again.
    let again = complete_ok(&s, &greedy(json!(PROMPT))).await;
    assert_eq!(texts(&again), texts(&one));
    assert_eq!(again["choices"][0]["token_ids"], choice["token_ids"]);

    // The same prompt as token ids: the same tokens in, the same text out.
    let as_ids = complete_ok(&s, &greedy(json!(tokens))).await;
    assert_eq!(as_ids["choices"][0]["prompt_token_ids"], json!(tokens));
    assert_eq!(texts(&as_ids), texts(&one));
    // Token ids are used as given: without BOS it is another prompt.
    let no_bos = complete_ok(&s, &greedy(json!(tokens[1..]))).await;
    assert_eq!(ids(&no_bos["choices"][0]["prompt_token_ids"]), tokens[1..]);
    let unspecial = complete_ok(
        &s,
        &json!({"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": true,
                "return_token_ids": true, "add_special_tokens": false}),
    )
    .await;
    assert_eq!(
        unspecial["choices"][0]["prompt_token_ids"],
        no_bos["choices"][0]["prompt_token_ids"]
    );
    assert_eq!(texts(&unspecial), texts(&no_bos));

    // Lists: each prompt its own choices, in order, each as it would be alone.
    let other = "a river in the hills";
    let other_alone = complete_ok(&s, &greedy(json!(other))).await;
    let list = complete_ok(&s, &greedy(json!([PROMPT, other]))).await;
    assert_eq!(list["choices"].as_array().unwrap().len(), 2);
    assert_eq!(
        texts(&list),
        [texts(&one)[0].clone(), texts(&other_alone)[0].clone()]
    );
    let other_tokens = tokenize(&s, other).await;
    let lists = complete_ok(&s, &greedy(json!([tokens, other_tokens]))).await;
    assert_eq!(texts(&lists), texts(&list));
    assert_eq!(lists["choices"][1]["prompt_token_ids"], json!(other_tokens));
    // Usage adds up over the prompts.
    assert_eq!(
        lists["usage"]["prompt_tokens"],
        tokens.len() + other_tokens.len()
    );
    assert_eq!(lists["usage"]["completion_tokens"], 12);
    // A one-string list is the string.
    let single = complete_ok(&s, &greedy(json!([PROMPT]))).await;
    assert_eq!(texts(&single), texts(&one));

    // max_tokens defaults to 16.
    let default = complete_ok(
        &s,
        &json!({"prompt": PROMPT, "temperature": 0, "ignore_eos": true}),
    )
    .await;
    assert_eq!(default["usage"]["completion_tokens"], 16);
    assert!(default["choices"][0].get("token_ids").is_none());
    assert!(default["choices"][0].get("prompt_token_ids").is_none());
}

/// `n` choices per prompt: index runs over prompts × n; with a seed each choice is
/// reproducible, and `best_of` returns the n of the best_of of highest cumulative logprob.
#[tokio::test]
async fn n_and_best_of() {
    let s = TestServer::tiny(options(), None).await;
    let body = |extra: Value| {
        let mut b = json!({"prompt": PROMPT, "max_tokens": 5, "temperature": 1, "seed": 11,
                           "logprobs": 0});
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        b
    };
    let four = complete_ok(&s, &body(json!({"n": 4}))).await;
    let cumulative: Vec<f64> = four["choices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            c["logprobs"]["token_logprobs"]
                .as_array()
                .unwrap()
                .iter()
                .map(|l| l.as_f64().unwrap())
                .sum()
        })
        .collect();
    assert_eq!(four["usage"]["completion_tokens"], 20);
    let best = complete_ok(&s, &body(json!({"n": 2, "best_of": 4}))).await;
    let choices = best["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 2);
    let mut order: Vec<usize> = (0..4).collect();
    order.sort_by(|&a, &b| cumulative[b].total_cmp(&cumulative[a]));
    for (rank, &i) in order[..2].iter().enumerate() {
        assert_eq!(choices[rank]["text"], four["choices"][i]["text"], "{best}");
        assert_eq!(
            choices[rank]["logprobs"], four["choices"][i]["logprobs"],
            "{best}"
        );
    }
    // Every generated choice counts.
    assert_eq!(best["usage"]["completion_tokens"], 20);
    // Without `logprobs` the ranking is the same; none are shown.
    let mut plain = body(json!({"n": 2, "best_of": 4}));
    plain.as_object_mut().unwrap().remove("logprobs");
    let plain = complete_ok(&s, &plain).await;
    assert_eq!(texts(&plain), texts(&best));
    assert!(plain["choices"][0]["logprobs"].is_null());
    // best_of = n is n.
    let same = complete_ok(&s, &body(json!({"n": 2, "best_of": 2}))).await;
    assert_eq!(texts(&same), texts(&four)[..2]);

    // Two prompts × n = 2: indices 0..4, prompt-major.
    let two = complete_ok(
        &s,
        &json!({"prompt": [PROMPT, "a river"], "n": 2, "max_tokens": 3, "temperature": 1,
                "seed": 11, "return_token_ids": true}),
    )
    .await;
    let c = two["choices"].as_array().unwrap();
    assert_eq!(c.len(), 4);
    assert_eq!(c[0]["prompt_token_ids"], c[1]["prompt_token_ids"]);
    assert_eq!(c[2]["prompt_token_ids"], c[3]["prompt_token_ids"]);
    assert_ne!(c[0]["prompt_token_ids"], c[2]["prompt_token_ids"]);
    assert_eq!(two["usage"]["completion_tokens"], 12);
    // Greedy n > 1 would repeat one choice: refused, as in chat.
    refused(
        &s,
        &json!({"prompt": PROMPT, "n": 2, "temperature": 0}),
        "n",
    )
    .await;
    refused(
        &s,
        &json!({"prompt": PROMPT, "best_of": 2, "temperature": 0}),
        "best_of",
    )
    .await;
}

/// echo + logprobs: the prompt's text in front, its tokens' logprobs first (the first null), each
/// equal to chat's `prompt_logprobs` for the same tokens and to the model's log-softmax; the
/// generated tokens after, their strings making up the generated text.
#[tokio::test]
async fn echo_with_logprobs_scores_the_prompt() {
    let s = TestServer::tiny(options(), None).await;
    let (status, chat) = s
        .chat(&json!({"messages": [{"role": "user", "content": PROMPT}],
            "max_completion_tokens": 1, "prompt_logprobs": 3, "return_token_ids": true}))
        .await;
    assert_eq!(status, 200, "{chat}");
    let prompt = ids(&chat["prompt_token_ids"]);
    let body = json!({"prompt": prompt, "max_tokens": 4, "temperature": 0, "echo": true,
                      "logprobs": 3, "prompt_logprobs": 3, "ignore_eos": true,
                      "return_token_ids": true});
    let v = complete_ok(&s, &body).await;
    let choice = &v["choices"][0];
    // The same prompt logprobs as chat's, bit for bit.
    assert_eq!(choice["prompt_logprobs"], chat["prompt_logprobs"]);

    let lp = &choice["logprobs"];
    let tokens = lp["tokens"].as_array().unwrap();
    let generated = ids(&choice["token_ids"]);
    assert_eq!(tokens.len(), prompt.len() + generated.len());
    assert!(lp["token_logprobs"][0].is_null());
    assert!(lp["top_logprobs"][0].is_null());
    let lsm = direct_log_softmax(&s, &prompt);
    for i in 1..prompt.len() {
        let got = lp["token_logprobs"][i].as_f64().unwrap();
        let entry = &chat["prompt_logprobs"][i][prompt[i].to_string()];
        assert_eq!(got, entry["logprob"].as_f64().unwrap(), "position {i}");
        assert!((got - lsm[i - 1][prompt[i] as usize]).abs() < 1e-4);
        // {token: logprob}: the position's own token first, at most 3 alternatives.
        let top = lp["top_logprobs"][i].as_object().unwrap();
        assert!((1..=4).contains(&top.len()), "{top:?}");
        let (first, first_lp) = top.iter().next().unwrap();
        assert_eq!(first, tokens[i].as_str().unwrap());
        assert_eq!(first_lp.as_f64().unwrap(), got);
    }
    // Offsets: each token string's start in the concatenated token strings.
    let mut offset = 0;
    for (i, t) in tokens.iter().enumerate() {
        assert_eq!(lp["text_offset"][i], offset);
        offset += t.as_str().unwrap().chars().count();
    }
    // The text: the prompt's (decoded, BOS kept: it was sent as ids), then the generation,
    // which the generated token strings spell.
    let text = choice["text"].as_str().unwrap();
    let decoded = s.post_ok("/detokenize", &json!({"tokens": prompt})).await["prompt"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(text.starts_with(&decoded), "{text:?} vs {decoded:?}");
    // Tokens of whole characters (not byte pieces, ids 9-264, nor control tokens) spell it.
    if generated.iter().all(|&t| t >= 265) {
        let spelled: String = tokens[prompt.len()..]
            .iter()
            .map(|t| t.as_str().unwrap())
            .collect();
        assert_eq!(&text[decoded.len()..], spelled);
    }
    // Each generated token's own logprob first, then its alternatives, best first.
    for i in prompt.len()..tokens.len() {
        let top: Vec<f64> = lp["top_logprobs"][i]
            .as_object()
            .unwrap()
            .values()
            .map(|l| l.as_f64().unwrap())
            .collect();
        assert_eq!(top[0], lp["token_logprobs"][i].as_f64().unwrap());
        assert!(top[1..].windows(2).all(|w| w[0] >= w[1]), "{top:?}");
    }
    // Usage counts the generation only.
    assert_eq!(v["usage"]["completion_tokens"], 4);
    assert_eq!(v["usage"]["prompt_tokens"], prompt.len());

    // A text prompt echoes as sent; its logprobs are the same as its ids'.
    let text_prompt = complete_ok(
        &s,
        &json!({"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "echo": true,
                "logprobs": 3, "ignore_eos": true}),
    )
    .await;
    let c = &text_prompt["choices"][0];
    let text = c["text"].as_str().unwrap();
    assert!(text.starts_with(PROMPT), "{text:?}");
    let as_ids = complete_ok(
        &s,
        &json!({"prompt": tokenize(&s, PROMPT).await, "max_tokens": 4, "temperature": 0,
                "echo": true, "logprobs": 3, "ignore_eos": true}),
    )
    .await;
    assert_eq!(c["logprobs"], as_ids["choices"][0]["logprobs"]);

    // max_tokens 0 with echo: the prompt scored, nothing generated.
    let scored = complete_ok(
        &s,
        &json!({"prompt": prompt, "max_tokens": 0, "echo": true, "logprobs": 1,
                "return_token_ids": true}),
    )
    .await;
    let c = &scored["choices"][0];
    assert_eq!(c["text"], decoded.as_str());
    assert_eq!(c["finish_reason"], "length");
    assert_eq!(c["token_ids"], json!([]));
    assert_eq!(
        c["logprobs"]["token_logprobs"],
        json!(lp["token_logprobs"].as_array().unwrap()[..prompt.len()])
    );
    assert_eq!(scored["usage"]["completion_tokens"], 0);
    refused(
        &s,
        &json!({"prompt": PROMPT, "max_tokens": 0}),
        "max_tokens",
    )
    .await;

    // return_tokens_as_token_ids: every token, and every alternative, as "token_id:<id>".
    let v = complete_ok(
        &s,
        &json!({"prompt": prompt, "max_tokens": 2, "temperature": 0, "echo": true,
                "logprobs": 2, "return_tokens_as_token_ids": true, "return_token_ids": true}),
    )
    .await;
    let c = &v["choices"][0];
    let all: Vec<u32> = prompt.iter().copied().chain(ids(&c["token_ids"])).collect();
    let shown: Vec<String> = c["logprobs"]["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap().to_owned())
        .collect();
    let expected: Vec<String> = all.iter().map(|t| format!("token_id:{t}")).collect();
    assert_eq!(shown, expected);
    for top in c["logprobs"]["top_logprobs"]
        .as_array()
        .unwrap()
        .iter()
        .skip(1)
    {
        assert!(top
            .as_object()
            .unwrap()
            .keys()
            .all(|k| k.starts_with("token_id:")));
    }
}

#[tokio::test]
async fn stop_strings_and_tokens() {
    let s = TestServer::tiny(options(), None).await;
    let body = |extra: Value| {
        let mut b = json!({"prompt": PROMPT, "max_tokens": 12, "temperature": 0,
                           "ignore_eos": true, "return_token_ids": true});
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        b
    };
    let free = complete_ok(&s, &body(json!({}))).await;
    let text = free["choices"][0]["text"].as_str().unwrap().to_owned();
    let generated = ids(&free["choices"][0]["token_ids"]);
    // A stop string from the middle of the greedy text: cut before it.
    let chars: Vec<char> = text.chars().collect();
    assert!(chars.len() >= 6, "{text:?}");
    let stop: String = chars[chars.len() / 2..chars.len() / 2 + 2].iter().collect();
    let cut = &text[..text.find(&stop).unwrap()];
    let v = complete_ok(&s, &body(json!({"stop": [stop]}))).await;
    let c = &v["choices"][0];
    assert_eq!(c["text"], cut);
    assert_eq!(c["finish_reason"], "stop");
    assert_eq!(c["stop_reason"], stop.as_str());
    let v = complete_ok(
        &s,
        &body(json!({"stop": stop, "include_stop_str_in_output": true})),
    )
    .await;
    assert_eq!(v["choices"][0]["text"], format!("{cut}{stop}"));
    // A stop token id.
    let v = complete_ok(&s, &body(json!({"stop_token_ids": [generated[3]]}))).await;
    let c = &v["choices"][0];
    assert_eq!(c["finish_reason"], "stop");
    assert_eq!(c["stop_reason"], generated[3]);
    let first = generated.iter().position(|&t| t == generated[3]).unwrap();
    assert_eq!(ids(&c["token_ids"]), generated[..=first]);
    // The sampling fields reach the engine as for chat: a forced token.
    let forced = (5..).find(|t| !generated.contains(t)).unwrap();
    let v = complete_ok(
        &s,
        &body(json!({"logit_bias": {forced.to_string(): 100}, "max_tokens": 3})),
    )
    .await;
    assert_eq!(ids(&v["choices"][0]["token_ids"]), vec![forced; 3]);
    let v = complete_ok(
        &s,
        &body(json!({"allowed_token_ids": [40, 41], "temperature": 1, "seed": 2})),
    )
    .await;
    assert!(ids(&v["choices"][0]["token_ids"])
        .iter()
        .all(|t| [40, 41].contains(t)));
    let v = complete_ok(&s, &body(json!({"repetition_penalty": 1.8}))).await;
    assert_ne!(ids(&v["choices"][0]["token_ids"]), generated);
    // Structured outputs, as chat has them.
    let v = complete_ok(
        &s,
        &json!({"prompt": PROMPT, "max_tokens": 10, "temperature": 1, "seed": 1,
                "structured_outputs": {"choice": ["yes", "no"]}}),
    )
    .await;
    let t = v["choices"][0]["text"].as_str().unwrap();
    assert!(t == "yes" || t == "no", "{t:?}");
    // Beam search of width n.
    let v = complete_ok(
        &s,
        &json!({"prompt": PROMPT, "max_tokens": 4, "n": 2, "temperature": 0,
                "use_beam_search": true, "ignore_eos": true}),
    )
    .await;
    assert_eq!(v["choices"].as_array().unwrap().len(), 2);
    assert_ne!(v["choices"][0]["text"], v["choices"][1]["text"]);
}

/// A streamed completion: `text_completion` chunks, one choice each, exactly one finish chunk
/// per choice, the usage chunk last before `[DONE]`; the chunks' text, logprobs and token ids
/// concatenate to the whole answer's.
#[tokio::test]
async fn streamed_chunks_concatenate_to_the_whole_answer() {
    let s = TestServer::tiny(options(), None).await;
    for (prompt, n, echo) in [
        (json!(PROMPT), 1, false),
        (json!(PROMPT), 1, true),
        (json!([PROMPT, "a river"]), 2, true),
    ] {
        let whole_body = json!({"prompt": prompt, "max_tokens": 7, "n": n, "temperature": 1,
            "seed": 5, "echo": echo, "logprobs": 2, "return_token_ids": true,
            "stop": ["zz"]});
        let whole = complete_ok(&s, &whole_body).await;
        let mut body = whole_body.clone();
        body["stream"] = json!(true);
        body["stream_options"] = json!({"include_usage": true});
        let events = complete_stream(&s, &body).await;
        assert_eq!(events.last().unwrap(), "[DONE]");
        let choices = whole["choices"].as_array().unwrap();
        let mut text = vec![String::new(); choices.len()];
        let mut logprobs = vec![
            json!({"text_offset": [], "token_logprobs": [], "tokens": [],
                                        "top_logprobs": []});
            choices.len()
        ];
        let mut token_ids = vec![Vec::new(); choices.len()];
        let mut prompt_ids = vec![None; choices.len()];
        let mut finishes = vec![Vec::new(); choices.len()];
        let mut usage = None;
        let id = events[0]["id"].as_str().unwrap();
        assert!(id.starts_with("cmpl-"));
        for e in &events[..events.len() - 1] {
            assert_eq!(e["object"], "text_completion", "{e}");
            assert_eq!(e["id"], id);
            let cs = e["choices"].as_array().unwrap();
            if cs.is_empty() {
                assert!(usage.is_none());
                usage = Some(e["usage"].clone());
                continue;
            }
            assert!(usage.is_none(), "a chunk after the usage chunk");
            assert!(e.get("usage").is_none());
            assert_eq!(cs.len(), 1);
            let c = &cs[0];
            let i = c["index"].as_u64().unwrap() as usize;
            assert!(finishes[i].is_empty(), "a chunk after the finish: {e}");
            text[i].push_str(c["text"].as_str().unwrap());
            if let Some(lp) = c["logprobs"].as_object() {
                for (k, v) in lp {
                    logprobs[i][k]
                        .as_array_mut()
                        .unwrap()
                        .extend(v.as_array().unwrap().iter().cloned());
                }
            }
            token_ids[i].extend(ids(&c["token_ids"]));
            if let Some(p) = c.get("prompt_token_ids") {
                assert!(prompt_ids[i].is_none(), "prompt ids twice: {e}");
                prompt_ids[i] = Some(p.clone());
            }
            if let Some(f) = c["finish_reason"].as_str() {
                finishes[i].push(f.to_owned());
            }
        }
        for (i, c) in choices.iter().enumerate() {
            assert_eq!(text[i], c["text"].as_str().unwrap(), "choice {i}");
            assert_eq!(logprobs[i], c["logprobs"], "choice {i}");
            assert_eq!(token_ids[i], ids(&c["token_ids"]), "choice {i}");
            assert_eq!(prompt_ids[i].as_ref(), Some(&c["prompt_token_ids"]));
            assert_eq!(finishes[i], [c["finish_reason"].as_str().unwrap()]);
        }
        let mut usage = usage.expect("a usage chunk");
        let mut whole_usage = whole["usage"].clone();
        // The streamed request may find the first one's prompt blocks cached.
        usage["prompt_tokens_details"] = json!(null);
        whole_usage["prompt_tokens_details"] = json!(null);
        assert_eq!(usage, whole_usage);
    }

    // continuous_usage_stats: every chunk carries the usage so far.
    let events = complete_stream(
        &s,
        &json!({"prompt": PROMPT, "max_tokens": 4, "ignore_eos": true, "stream": true,
                "stream_options": {"include_usage": true, "continuous_usage_stats": true}}),
    )
    .await;
    assert!(events[..events.len() - 1]
        .iter()
        .all(|e| e["usage"]["prompt_tokens"].as_u64().unwrap() > 0));
    // Without stream_options: no usage, no ids, no logprobs.
    let events = complete_stream(
        &s,
        &json!({"prompt": PROMPT, "max_tokens": 4, "ignore_eos": true, "stream": true}),
    )
    .await;
    for e in &events[..events.len() - 1] {
        assert!(e.get("usage").is_none());
        let c = &e["choices"][0];
        assert!(
            c["logprobs"].is_null() && c.get("token_ids").is_none(),
            "{e}"
        );
    }
    // best_of above n cannot stream; prompt_logprobs cannot either.
    refused(
        &s,
        &json!({"prompt": PROMPT, "n": 1, "best_of": 2, "stream": true}),
        "best_of",
    )
    .await;
    refused(
        &s,
        &json!({"prompt": PROMPT, "prompt_logprobs": 1, "stream": true}),
        "prompt_logprobs",
    )
    .await;
}

/// A client that goes away mid-stream cancels every prompt's request.
#[tokio::test]
async fn a_dropped_stream_cancels_its_requests() {
    let s = TestServer::tiny(options(), None).await;
    let resp = s
        .post(
            PATH,
            &json!({"prompt": [PROMPT, "a river"], "max_tokens": 1500, "ignore_eos": true,
                    "stream": true}),
        )
        .send()
        .await
        .unwrap();
    let mut body = resp.bytes_stream();
    body.next().await.unwrap().unwrap();
    drop(body);
    s.wait_idle(Duration::from_secs(30)).await;
}

/// The second time a long prompt comes, its full blocks come from the prefix cache; over several
/// prompts the cached tokens add up.
#[tokio::test]
async fn usage_reports_cached_prompt_tokens() {
    let s = TestServer::tiny(options(), None).await;
    let long = "tell me about the river and the city and the bridge and the hills ".repeat(4);
    let body = json!({"prompt": long, "max_tokens": 3, "temperature": 0});
    let first = complete_ok(&s, &body).await;
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let again = complete_ok(&s, &body).await;
    let prompt = again["usage"]["prompt_tokens"].as_u64().unwrap();
    let block = temper_model::BLOCK_TOKENS as u64;
    let cached = (prompt - 1) / block * block;
    assert!(cached > 0);
    assert_eq!(
        again["usage"]["prompt_tokens_details"]["cached_tokens"],
        cached
    );
    assert_eq!(texts(&again), texts(&first));
    let two = complete_ok(
        &s,
        &json!({"prompt": [long, long], "max_tokens": 3, "temperature": 0}),
    )
    .await;
    assert_eq!(two["usage"]["prompt_tokens"], 2 * prompt);
    assert_eq!(
        two["usage"]["prompt_tokens_details"]["cached_tokens"],
        2 * cached
    );
}

#[tokio::test]
async fn bad_requests_are_400s_naming_the_field() {
    let s = TestServer::tiny(options(), Some(64)).await;
    let cases = [
        (json!({"prompt": ""}), "prompt"),
        (json!({"prompt": []}), "prompt"),
        (json!({"prompt": [[]]}), "prompt[0]"),
        (json!({"prompt": ["a", ""]}), "prompt[1]"),
        (json!({"prompt": ["a", 5]}), "prompt[1]"),
        (json!({"prompt": [5, [6]]}), "prompt[1]"),
        (json!({"prompt": [5, 1_000_000]}), "prompt[1]"),
        (json!({"prompt": [5, -1]}), "prompt[1]"),
        (json!({"prompt": [[5], [6, 1_000_000]]}), "prompt[1][1]"),
        (json!({"prompt": true}), "prompt"),
        (json!({"prompt": [1.5]}), "prompt"),
        (json!({"prompt": null}), "prompt"),
        (json!({"model": "tiny"}), "prompt"),
        (json!({"prompt": "a", "suffix": "b"}), "suffix"),
        (
            json!({"prompt": "a", "prompt_embeds": "AAAA"}),
            "prompt_embeds",
        ),
        (json!({"prompt": "a", "logprobs": 21}), "logprobs"),
        (json!({"prompt": "a", "logprobs": -1}), "logprobs"),
        (json!({"prompt": "a", "logprobs": true}), "logprobs"),
        (
            json!({"prompt": "a", "prompt_logprobs": 21}),
            "prompt_logprobs",
        ),
        (json!({"prompt": "a", "n": 0}), "n"),
        (json!({"prompt": "a", "n": 17}), "n"),
        (json!({"prompt": "a", "n": 3, "best_of": 2}), "best_of"),
        (json!({"prompt": "a", "best_of": 17}), "best_of"),
        (
            json!({"prompt": "a", "best_of": 2, "n": 1, "use_beam_search": true, "temperature": 0}),
            "best_of",
        ),
        (json!({"prompt": "a", "max_tokens": -1}), "max_tokens"),
        (json!({"prompt": "a", "max_tokens": 64}), "max_tokens"),
        (
            json!({"prompt": "a", "max_tokens": 0, "echo": true, "min_tokens": 1}),
            "min_tokens",
        ),
        (json!({"prompt": "a", "min_tokens": 17}), "min_tokens"),
        (json!({"prompt": "a", "temperature": 3}), "temperature"),
        (json!({"prompt": "a", "top_p": 0}), "top_p"),
        (json!({"prompt": "a", "top_k": -2}), "top_k"),
        (json!({"prompt": "a", "stop": [""]}), "stop"),
        (
            json!({"prompt": "a", "stop_token_ids": [1_000_000]}),
            "stop_token_ids",
        ),
        (json!({"prompt": "a", "logit_bias": {"x": 1}}), "logit_bias"),
        (
            json!({"prompt": "a", "stream_options": {"include_usage": true}}),
            "stream_options",
        ),
        (json!({"prompt": "a", "priority": 1}), "priority"),
        (json!({"prompt": "a", "request_id": ""}), "request_id"),
        (json!({"prompt": "a", "cache_salt": ""}), "cache_salt"),
        (
            json!({"prompt": "a", "length_penalty": 0.5}),
            "length_penalty",
        ),
        (
            json!({"prompt": "a", "structured_outputs": {"regex": "(unclosed"}}),
            "structured_outputs.regex",
        ),
        (
            json!({"prompt": "a", "use_beam_search": true, "n": 2, "temperature": 0, "top_p": 0.5}),
            "top_p",
        ),
        (
            json!({"prompt": "a", "truncate_prompt_tokens": 65}),
            "truncate_prompt_tokens",
        ),
        // Longer than the context (64): as text, as ids, as one of several prompts.
        (json!({"prompt": "the river ".repeat(40)}), "prompt"),
        (json!({"prompt": vec![5; 64]}), "prompt"),
        (
            json!({"prompt": ["a", "the river ".repeat(40)]}),
            "prompt[1]",
        ),
        // Far past it: refused by the byte count, before tokenizing.
        (json!({"prompt": "x".repeat(100_000)}), "prompt"),
    ];
    for (body, param) in cases {
        refused(&s, &body, param).await;
    }
    // The default max_tokens (16) is cut to what the context leaves after the prompt.
    let v = complete_ok(
        &s,
        &json!({"prompt": vec![5; 60], "ignore_eos": true, "temperature": 0}),
    )
    .await;
    assert_eq!(v["usage"]["completion_tokens"], 4);
    // truncate_prompt_tokens keeps the last tokens; the echo is what was kept.
    let v = complete_ok(
        &s,
        &json!({"prompt": "the river ".repeat(40), "truncate_prompt_tokens": 10, "max_tokens": 2,
                "echo": true, "return_token_ids": true}),
    )
    .await;
    let kept = ids(&v["choices"][0]["prompt_token_ids"]);
    assert_eq!(kept.len(), 10);
    let decoded = s.post_ok("/detokenize", &json!({"tokens": kept})).await["prompt"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(v["choices"][0]["text"]
        .as_str()
        .unwrap()
        .starts_with(&decoded));
    // More prompts than may wait (--max-waiting).
    let s = TestServer::tiny(options(), None).await;
    let max = s.state.models()[0].engine.max_waiting();
    let v = refused(&s, &json!({"prompt": vec!["a"; max + 1]}), "prompt").await;
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .contains("--max-waiting"));
    // Not found, unauthorized, malformed.
    let (status, v) = complete(&s, &json!({"prompt": "a", "model": "gpt-9"})).await;
    assert_eq!((status, &v["error"]["param"]), (404, &json!("model")));
    let resp = s
        .client
        .post(s.url(PATH))
        .json(&json!({"prompt": "a"}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 401);
    let resp = s
        .client
        .post(s.url(PATH))
        .bearer_auth(KEY)
        .header("content-type", "application/json")
        .body("{\"prompt\": ")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 400);
    let v: Value = resp.json().await.unwrap();
    assert!(v["error"]["param"].is_null(), "{v}");
}

/// A trained model's name is served as chat serves it (step 0 is the base model itself);
/// usage is metered per project and model; /metrics counts the tokens; the quota applies.
#[tokio::test]
async fn checkpoint_names_usage_metrics_and_quota() {
    let data = tempfile::tempdir().unwrap();
    let s = TestServer::tiny_training_in(data.path()).await;
    s.post_ok(
        "/v1/preview/models",
        &json!({"project": "docs", "name": "agent", "base_model": "tiny"}),
    )
    .await;
    let body = |model: &str| {
        json!({"model": model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0,
               "ignore_eos": true})
    };
    let base = complete_ok(&s, &body("tiny")).await;
    for name in [
        "default/docs/agent",
        "default/docs/agent:step0",
        "default/docs/agent:latest",
    ] {
        let v = complete_ok(&s, &body(name)).await;
        assert_eq!(v["model"], name);
        assert_eq!(texts(&v), texts(&base));
    }
    for name in [
        "default/docs/agent:step3",
        "acme/docs/agent",
        "default/docs/other",
    ] {
        let (status, v) = complete(&s, &body(name)).await;
        assert_eq!(status, 404, "{name}: {v}");
        assert_eq!(v["error"]["param"], "model");
    }
    // A trained checkpoint: its adapter applies as in chat (the same greedy tokens after the
    // same prompt tokens), and changes what the base model says.
    let model = s
        .post_ok(
            "/v1/preview/models",
            &json!({"project": "docs", "name": "agent", "base_model": "tiny",
                    "return_existing": true}),
        )
        .await;
    let job = s
        .post_ok(
            "/v1/preview/sft-training-jobs",
            &json!({"model_id": model["id"], "trajectories": [{"messages": [
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": "zebra zebra zebra zebra"}]}],
                "config": {"learning_rate": 0.05, "epochs": 3}}),
        )
        .await;
    s.state.training().unwrap().spawn_worker().unwrap();
    let job_id = job["id"].as_str().unwrap();
    let start = std::time::Instant::now();
    loop {
        let j: Value = s
            .get(&format!("/v1/preview/training-jobs/{job_id}"))
            .await
            .json()
            .await
            .unwrap();
        match j["status"].as_str().unwrap() {
            "succeeded" => break,
            "queued" | "running" => {}
            _ => panic!("{j}"),
        }
        assert!(start.elapsed() < Duration::from_secs(120), "{j}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (status, chat) = s
        .chat(&json!({"model": "default/docs/agent:step1",
            "messages": [{"role": "user", "content": PROMPT}], "max_completion_tokens": 6,
            "temperature": 0, "ignore_eos": true, "return_token_ids": true}))
        .await;
    assert_eq!(status, 200, "{chat}");
    let trained_body = |model: &str| {
        json!({"model": model, "prompt": chat["prompt_token_ids"], "max_tokens": 6,
               "temperature": 0, "ignore_eos": true, "return_token_ids": true})
    };
    let trained = complete_ok(&s, &trained_body("default/docs/agent:step1")).await;
    assert_eq!(trained["model"], "default/docs/agent:step1");
    assert_eq!(
        trained["choices"][0]["token_ids"],
        chat["choices"][0]["token_ids"]
    );
    let untrained = complete_ok(&s, &trained_body("tiny")).await;
    assert_ne!(
        untrained["choices"][0]["token_ids"],
        trained["choices"][0]["token_ids"]
    );

    // Usage: under the request's project, per model; n and several prompts count as one request.
    let resp = s
        .post(
            PATH,
            &json!({"prompt": [PROMPT, "a river"], "n": 2, "max_tokens": 3, "temperature": 1,
                    "ignore_eos": true}),
        )
        .header("OpenAI-Project", "default/scoring")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    let multi: Value = resp.json().await.unwrap();
    let since = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        - 3600;
    let page: Value = s
        .get(&format!(
            "/v1/usage?start={since}&bucket_width=1h&group_by=project,model"
        ))
        .await
        .json()
        .await
        .unwrap();
    let results: Vec<&Value> = page["data"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|b| b["results"].as_array().unwrap())
        .collect();
    let scoring: Vec<&&Value> = results
        .iter()
        .filter(|r| r["project_id"] == "scoring")
        .collect();
    assert_eq!(scoring.len(), 1, "{page}");
    assert_eq!(scoring[0]["model"], "tiny");
    assert_eq!(scoring[0]["num_model_requests"], 1);
    assert_eq!(scoring[0]["input_tokens"], multi["usage"]["prompt_tokens"]);
    assert_eq!(scoring[0]["output_tokens"], 12);
    let checkpoint: u64 = results
        .iter()
        .filter(|r| {
            r["model"]
                .as_str()
                .is_some_and(|m| m.starts_with("default/docs/agent"))
        })
        .map(|r| r["num_model_requests"].as_u64().unwrap())
        .sum();
    // Three on step 0 (however named), the chat request and one completion on step 1.
    assert_eq!(checkpoint, 5, "{page}");

    // /metrics: the engine's counters include every prompt's tokens.
    s.wait_idle(Duration::from_secs(30)).await;
    let text = s.get("/metrics").await.text().await.unwrap();
    let generated: f64 = text
        .lines()
        .find_map(|l| l.strip_prefix("vllm:generation_tokens_total{model_name=\"tiny\"} "))
        .unwrap()
        .parse()
        .unwrap();
    // 4 tokens for each of the first 4 requests, 6 for the chat, trained and untrained ones,
    // 12 for the two prompts × 2.
    assert_eq!(generated, 4.0 * 4.0 + 6.0 * 3.0 + 12.0);

    // A team past its quota gets a 429, streamed or not.
    s.state
        .training()
        .unwrap()
        .store
        .set_quota("default", Some(1))
        .await
        .unwrap();
    for stream in [false, true] {
        let mut b = body("tiny");
        b["stream"] = json!(stream);
        let (status, v) = complete(&s, &b).await;
        assert_eq!(status, 429, "{v}");
        assert_eq!(v["error"]["type"], "QuotaExceededError");
    }
}
