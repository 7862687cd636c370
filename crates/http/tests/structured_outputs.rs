//! Structured outputs through HTTP: `response_format` and `structured_outputs` on the real
//! default model (JSON schema, json_object, regex, choice, Lark grammar, structural tags), and
//! their validation errors on the tiny model.

mod common;

use common::{check_stream, options, TestServer};
use serde_json::{json, Value};

async fn real_server() -> Option<TestServer> {
    let path = temper_model::paths::real_model_for_tests()?;
    Some(TestServer::model("gemma-3-270m", &path, options()).await)
}

fn user(text: &str) -> Value {
    json!([{"role": "user", "content": text}])
}

async fn contents(s: &TestServer, body: Value) -> Vec<(String, String)> {
    let (status, v) = s.chat(&body).await;
    assert_eq!(status, 200, "{v}");
    v["choices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            (
                c["message"]["content"].as_str().unwrap().to_owned(),
                c["finish_reason"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

fn person_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}
        },
        "required": ["name", "age", "tags"],
        "additionalProperties": false
    })
}

/// `person_schema` checked by hand (no schema validator among the dependencies).
fn check_person(text: &str) {
    let v: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
    let o = v
        .as_object()
        .unwrap_or_else(|| panic!("not an object: {text:?}"));
    assert_eq!(o.len(), 3, "{text:?}");
    assert!(
        o["name"].as_str().is_some_and(|n| n.chars().count() <= 20),
        "{text:?}"
    );
    assert!(o["age"].as_u64().is_some_and(|a| a <= 120), "{text:?}");
    let tags = o["tags"].as_array().unwrap_or_else(|| panic!("{text:?}"));
    assert!(tags.len() <= 3, "{text:?}");
    assert!(
        tags.iter()
            .all(|t| ["a", "b", "c"].contains(&t.as_str().unwrap_or(""))),
        "{text:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_schema_output_parses_and_validates_at_temperature_0_and_1() {
    let Some(s) = real_server().await else { return };
    let response_format = json!({"type": "json_schema",
        "json_schema": {"name": "person", "schema": person_schema(), "strict": true}});
    let body = |temperature: f64, seed: i64, n: usize| {
        json!({"messages": user("Describe a person as JSON."), "temperature": temperature,
            "seed": seed, "n": n, "max_completion_tokens": 120, "response_format": response_format})
    };
    for (text, finish) in contents(&s, body(0.0, 0, 1)).await {
        check_person(&text);
        assert_eq!(finish, "stop");
    }
    for seed in [1, 2] {
        for (text, finish) in contents(&s, body(1.0, seed, 3)).await {
            check_person(&text);
            assert_eq!(finish, "stop");
        }
    }
    // The same constraint through structured_outputs.json (a string), compact.
    let compact = json!({"messages": user("Describe a person as JSON."), "temperature": 1.0,
        "seed": 3, "n": 3, "max_completion_tokens": 120,
        "structured_outputs": {"json": person_schema().to_string(), "disable_any_whitespace": true}});
    for (text, _) in contents(&s, compact).await {
        check_person(&text);
        assert!(!text.contains('\n') && !text.contains(": "), "{text:?}");
    }
    // Streamed: the same text as the non-streamed request with the same seed.
    let mut streamed = body(1.0, 7, 2);
    let plain = contents(&s, streamed.clone()).await;
    streamed["stream"] = json!(true);
    let (choices, _) = check_stream(&s.chat_stream(&streamed).await, 2);
    for (c, (text, finish)) in choices.iter().zip(&plain) {
        assert_eq!(&c.content, text);
        assert_eq!(c.finish_reason.as_deref(), Some(finish.as_str()));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_object_regex_choice_grammar_and_structural_tag() {
    let Some(s) = real_server().await else { return };
    // json_object: any JSON object.
    for rf in [
        json!({"response_format": {"type": "json_object"}}),
        json!({"structured_outputs": {"json_object": true}}),
    ] {
        let mut body = json!({"messages": user("Reply with a JSON object."), "temperature": 1.0,
            "seed": 11, "n": 3, "max_completion_tokens": 120,
            "structured_outputs": {"disable_any_whitespace": true}});
        for (k, v) in rf.as_object().unwrap() {
            match body.get_mut(k) {
                Some(Value::Object(existing)) => {
                    existing.extend(v.as_object().unwrap().clone());
                }
                _ => body[k] = v.clone(),
            }
        }
        for (text, finish) in contents(&s, body).await {
            // A length cut cannot be judged; nothing else may fail to parse.
            if finish == "stop" {
                let v: Value =
                    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
                assert!(v.is_object(), "{text:?}");
            }
        }
    }
    // A regex over 20 samples at temperature 1.
    let mut outputs = std::collections::HashSet::new();
    for seed in [21, 22] {
        let body = json!({"messages": user("Write a date."), "temperature": 1.0, "seed": seed,
            "n": 10, "max_completion_tokens": 20,
            "structured_outputs": {"regex": "20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]"}});
        for (text, finish) in contents(&s, body).await {
            let b = text.as_bytes();
            let digit = |i: usize| b[i].is_ascii_digit();
            assert!(
                b.len() == 10
                    && text.starts_with("20")
                    && digit(2)
                    && digit(3)
                    && b[4] == b'-'
                    && ((b[5] == b'0' && (b'1'..=b'9').contains(&b[6]))
                        || (b[5] == b'1' && (b'0'..=b'2').contains(&b[6])))
                    && b[7] == b'-'
                    && (b'0'..=b'2').contains(&b[8])
                    && digit(9),
                "{text:?}"
            );
            assert_eq!(finish, "stop");
            outputs.insert(text);
        }
    }
    assert!(outputs.len() > 2, "{outputs:?}");
    // choice
    let body = json!({"messages": user("Is the sky blue?"), "temperature": 1.0, "seed": 5,
        "n": 6, "max_completion_tokens": 10,
        "structured_outputs": {"choice": ["yes", "no", "maybe so"]}});
    for (text, finish) in contents(&s, body).await {
        assert!(
            ["yes", "no", "maybe so"].contains(&text.as_str()),
            "{text:?}"
        );
        assert_eq!(finish, "stop");
    }
    // A Lark grammar.
    let grammar = "start: greeting \", \" NAME \"!\"\ngreeting: \"Hello\" | \"Hi\"\nNAME: /[A-Z][a-z]{1,8}/\n";
    let body = json!({"messages": user("Greet someone."), "temperature": 1.0, "seed": 9,
        "n": 4, "max_completion_tokens": 20, "structured_outputs": {"grammar": grammar}});
    for (text, finish) in contents(&s, body).await {
        let rest = text
            .strip_prefix("Hello, ")
            .or_else(|| text.strip_prefix("Hi, "))
            .unwrap_or_else(|| panic!("{text:?}"));
        let name = rest.strip_suffix('!').unwrap_or_else(|| panic!("{text:?}"));
        assert!(
            (2..=9).contains(&name.len())
                && name.chars().next().is_some_and(|c| c.is_ascii_uppercase())
                && name.chars().skip(1).all(|c| c.is_ascii_lowercase()),
            "{text:?}"
        );
        assert_eq!(finish, "stop");
    }
    // Structural tags: free text, but a trigger must open a well-formed structure.
    let tag = json!({"type": "structural_tag", "triggers": ["<call="],
        "structures": [{"begin": "<call=add>", "end": "</call>",
            "schema": {"type": "object", "properties": {"x": {"type": "integer"}},
                       "required": ["x"], "additionalProperties": false}}]});
    let body = json!({"messages": user("Call the add tool with <call=add>{\"x\": 1}</call>."),
        "temperature": 1.0, "seed": 4, "n": 4, "max_completion_tokens": 40,
        "structured_outputs": {"structural_tag": tag.to_string(), "disable_any_whitespace": true}});
    for (text, _) in contents(&s, body).await {
        let mut rest = text.as_str();
        while let Some(i) = rest.find("<call=") {
            let after = &rest[i..];
            let Some(body) = after.strip_prefix("<call=add>") else {
                panic!("trigger without its structure: {text:?}")
            };
            // The output may be cut by the token limit inside a structure.
            let Some(end) = body.find("</call>") else {
                break;
            };
            let v: Value =
                serde_json::from_str(&body[..end]).unwrap_or_else(|e| panic!("{text:?}: {e}"));
            assert!(v["x"].is_i64(), "{text:?}");
            rest = &body[end..];
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_constrained_request_does_not_change_its_batch_neighbours() {
    let Some(s) = real_server().await else { return };
    // Long enough to overlap the constrained request; its prompt comes from the prefix cache the
    // second time.
    let free = json!({"messages": user("Tell me about the sea."), "temperature": 1.0,
        "seed": 42, "max_completion_tokens": 160, "ignore_eos": true, "return_token_ids": true});
    // A long constrained answer (a story of at least 400 characters: ~100 tokens or more), so
    // that the free request, sent once the engine runs this one, joins it however fast the
    // host decodes (a person's few fields finished first once, and no step held both).
    let story_schema = json!({"type": "object",
        "properties": {"story": {"type": "string", "minLength": 400, "maxLength": 600}},
        "required": ["story"], "additionalProperties": false});
    let constrained = json!({"messages": user("Tell a story, as JSON."), "temperature": 1.0,
        "seed": 1, "max_completion_tokens": 240,
        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": story_schema}}});
    let (status, alone) = s.chat(&free).await;
    assert_eq!(status, 200, "{alone}");
    // The constrained request first, and the free one once the engine runs it: its grammar is
    // compiled before it is submitted, which on a loaded host can take longer than the free
    // request's whole answer, so sent together the two need not share a step.
    let (a, b) = tokio::join!(s.chat(&constrained), async {
        let start = std::time::Instant::now();
        while s.engine_stats().running_requests == 0 {
            assert!(
                start.elapsed() < std::time::Duration::from_secs(60),
                "never submitted"
            );
            tokio::time::sleep(std::time::Duration::from_millis(2)).await;
        }
        s.chat(&free).await
    });
    assert_eq!(a.0, 200, "{}", a.1);
    assert_eq!(b.0, 200, "{}", b.1);
    assert_eq!(
        b.1["choices"][0]["token_ids"],
        alone["choices"][0]["token_ids"]
    );
    assert_eq!(b.1["choices"][0]["message"], alone["choices"][0]["message"]);
    if a.1["choices"][0]["finish_reason"] == "stop" {
        let text = a.1["choices"][0]["message"]["content"].as_str().unwrap();
        let v: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
        let story = v["story"].as_str().unwrap_or_else(|| panic!("{text:?}"));
        assert!((400..=600).contains(&story.chars().count()), "{text:?}");
    }
    let stats = s.wait_idle(std::time::Duration::from_secs(5)).await;
    assert!(stats.max_rows_in_step >= 2, "{stats:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_constraints_are_400s_naming_the_field() {
    let s = TestServer::tiny(options(), None).await;
    let cases = [
        (
            json!({"structured_outputs": {"regex": "(unclosed"}}),
            "structured_outputs.regex",
        ),
        (
            json!({"structured_outputs": {"json": {"type": "no-such-type"}}}),
            "structured_outputs.json",
        ),
        (
            json!({"structured_outputs": {"json": "{not json"}}),
            "structured_outputs.json",
        ),
        (
            json!({"structured_outputs": {"grammar": "start: missing_rule"}}),
            "structured_outputs.grammar",
        ),
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}}),
            "response_format.json_schema.schema",
        ),
        (
            json!({"response_format": {"type": "json_schema"}}),
            "response_format.json_schema",
        ),
        (
            json!({"response_format": {"type": "yaml"}}),
            "response_format.type",
        ),
        (
            json!({"structured_outputs": {"regex": "a", "choice": ["a"]}}),
            "structured_outputs",
        ),
        (
            json!({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}),
            "structured_outputs",
        ),
        (
            json!({"structured_outputs": {"regex": "a", "disable_any_whitespace": true}}),
            "structured_outputs.disable_any_whitespace",
        ),
        (
            json!({"structured_outputs": {"regex": 5}}),
            "structured_outputs.regex",
        ),
    ];
    for (extra, param) in cases {
        let mut body = json!({"messages": user("hi"), "max_completion_tokens": 5});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        let (status, v) = s.chat(&body).await;
        assert_eq!(status, 400, "{extra}: {v}");
        assert_eq!(v["error"]["param"], param, "{extra}: {v}");
        assert_eq!(v["error"]["type"], "BadRequestError");
    }
    // The server is fine afterwards, and a valid constraint on the tiny model works.
    let (status, v) = s
        .chat(
            &json!({"messages": user("hi"), "max_completion_tokens": 10, "temperature": 1.0,
            "structured_outputs": {"choice": ["cat", "dog"]}}),
        )
        .await;
    assert_eq!(status, 200, "{v}");
    let text = v["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(text == "cat" || text == "dog", "{text:?}");
}
