//! Trajectory tokenization on the tiny model's tokenizer and the shipped Gemma 3 template.

use serde_json::{json, Value};
use temper_text::{ChatMessage, ChatTemplate, TemplateInput, Tokenizer};
use temper_train::{tokenize_job, TrainError, TrainingRequest};

fn setup() -> (Tokenizer, ChatTemplate) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny.gguf");
    temper_model::tiny::write_tiny_gguf(&path, 7).unwrap();
    let loaded = temper_model::load_gguf(&path).unwrap();
    let tok = temper_text::load_tokenizer(&loaded.metadata, &path).unwrap();
    let template = ChatTemplate::new(
        ChatTemplate::GEMMA3,
        tok.bos_token().map(str::to_owned),
        tok.eos_token().map(str::to_owned),
    )
    .unwrap();
    (tok, template)
}

/// The prompt text serving renders for `messages` (with the generation prompt).
fn served_text(
    template: &ChatTemplate,
    messages: &[ChatMessage],
    tools: Option<&[temper_text::ToolDef]>,
) -> String {
    template
        .render(&TemplateInput {
            messages,
            tools,
            documents: None,
            add_generation_prompt: true,
            continue_final_message: false,
            reasoning_effort: None,
            kwargs: &serde_json::Map::new(),
        })
        .unwrap()
}

fn prompt(tok: &Tokenizer, template: &ChatTemplate, messages: &[ChatMessage]) -> Vec<u32> {
    tok.encode(&served_text(template, messages, None), true)
}

fn choice(ids: &[u32], text: &str) -> Value {
    let content: Vec<Value> = ids
        .iter()
        .map(|id| json!({"token": format!("token_id:{id}"), "logprob": -0.5}))
        .collect();
    json!({"message": {"role": "assistant", "content": text}, "finish_reason": "stop",
        "index": 0, "logprobs": {"content": content}})
}

fn request(items: Value) -> TrainingRequest {
    serde_json::from_value(json!({"trajectory_groups": [{"trajectories": [
        {"messages_and_choices": items, "reward": 1.0}]}]}))
    .unwrap()
}

#[test]
fn sampled_tokens_are_spliced_after_the_served_prompt() {
    let (tok, template) = setup();
    let eot = tok.token_id("<end_of_turn>").unwrap();
    let hello = tok.encode("Hello world", false);
    let user = ChatMessage::text("user", "the cat");
    let mut sampled = hello.clone();
    sampled.push(eot);
    let job = tokenize_job(
        &request(json!([{"role": "user", "content": "the cat"}, choice(&sampled, "Hello world")])),
        &tok,
        &template,
    )
    .unwrap();
    assert_eq!(job.sequences.len(), 1);
    let s = &job.sequences[0];
    let served = prompt(&tok, &template, std::slice::from_ref(&user));
    // The served prompt, the sampled tokens (their end of turn not repeated), then the newline
    // the template writes after the turn.
    let mut want = served.clone();
    want.extend(&sampled);
    want.extend(tok.encode("\n", true));
    assert_eq!(s.tokens, want);
    let mask: Vec<bool> = (0..want.len())
        .map(|i| i >= served.len() && i < served.len() + sampled.len())
        .collect();
    assert_eq!(s.mask, mask);
    assert!(s.old_logprobs[served.len()..served.len() + sampled.len()]
        .iter()
        .all(|&l| l == -0.5));

    // Without the end of turn in the sample, the template's is context.
    let job = tokenize_job(
        &request(json!([{"role": "user", "content": "the cat"}, choice(&hello, "Hello world")])),
        &tok,
        &template,
    )
    .unwrap();
    let s = &job.sequences[0];
    assert_eq!(s.tokens[served.len() + hello.len()], eot);
    assert!(!s.mask[served.len() + hello.len()]);
    assert_eq!(s.trainable_tokens(), hello.len());
}

#[test]
fn context_choices_histories_and_dropped_tail() {
    let (tok, template) = setup();
    let a = tok.encode("yes", false);
    let b = tok.encode("no", false);
    let no_logprobs = json!({"message": {"role": "assistant", "content": "good day"},
        "finish_reason": "stop", "index": 0});
    let items = json!([
        {"role": "user", "content": "Hello"},
        no_logprobs,
        {"role": "user", "content": "question"},
        choice(&a, "yes"),
        {"role": "user", "content": "and"},
        choice(&b, "no"),
        {"role": "user", "content": "dropped after the last trainable choice"},
    ]);
    let mut req = request(items);
    req.trajectory_groups[0].trajectories[0].additional_histories = serde_json::from_value(
        json!([{"messages_and_choices": [{"role": "user", "content": "Hello"}, choice(&b, "no")]}]),
    )
    .unwrap();
    let job = tokenize_job(&req, &tok, &template).unwrap();
    assert_eq!(job.sequences.len(), 2, "the trajectory and its history");
    let s = &job.sequences[0];
    assert_eq!(s.trainable_tokens(), a.len() + b.len());
    let text = tok.decode(
        &s.tokens,
        temper_text::DecodeOptions {
            skip_special_tokens: false,
            spaces_between_special_tokens: false,
        },
    );
    assert!(
        text.contains("good day"),
        "a Choice without logprobs is context: {text}"
    );
    assert!(!text.contains("dropped"), "{text}");
    assert!(text.ends_with("no<end_of_turn>\n"), "{text:?}");
    assert_eq!(job.sequences[1].trainable_tokens(), b.len());
    assert_eq!(job.sequences[1].trajectory, 0);
}

/// Entries as chat completions show them (`token` the text, `bytes` the raw bytes, no
/// `token_id:`) give back the sampled ids: `\r` and partial UTF-8 characters (byte-fallback
/// pieces, `token` U+FFFD), a space-prefixed word, the end of turn.
#[test]
fn logprob_entries_as_served_give_the_sampled_ids() {
    let (tok, template) = setup();
    let mut sampled = tok.encode("the\r", false);
    sampled.extend(tok.encode("é", false));
    sampled.push(tok.token_id("<end_of_turn>").unwrap());
    let bytes = |piece: &str| tok.token_id(piece).unwrap();
    assert!(sampled.contains(&bytes("<0x0D>")) && sampled.contains(&bytes("<0xC3>")));
    let content: Vec<Value> = sampled
        .iter()
        .map(|&id| {
            let (token, bytes) = tok.logprob_token(id).unwrap();
            json!({"token": token, "bytes": bytes, "logprob": -0.5, "top_logprobs": []})
        })
        .collect();
    let partial = sampled
        .iter()
        .position(|&id| id == bytes("<0xC3>"))
        .unwrap();
    assert_eq!(content[partial]["token"], "\u{FFFD}");
    let served = json!({"message": {"role": "assistant", "content": "the\ré"},
        "finish_reason": "stop", "index": 0, "logprobs": {"content": content}});
    let job = tokenize_job(
        &request(json!([{"role": "user", "content": "q"}, served])),
        &tok,
        &template,
    )
    .unwrap();
    let s = &job.sequences[0];
    let trained: Vec<u32> = (0..s.tokens.len())
        .filter(|&i| s.mask[i])
        .map(|i| s.tokens[i])
        .collect();
    assert_eq!(trained, sampled);
}

#[test]
fn invalid_trajectories_name_the_field() {
    let (tok, template) = setup();
    let err = |items: Value| match tokenize_job(&request(items), &tok, &template) {
        Err(TrainError::Invalid { param, .. }) => param,
        other => panic!("{other:?}"),
    };
    let mut bad = choice(&[1], "x");
    bad["logprobs"]["content"][0]["token"] = json!("no-such-token-anywhere");
    assert_eq!(
        err(json!([{"role": "user", "content": "q"}, bad])),
        "trajectory_groups[0].trajectories[0].messages_and_choices[1].logprobs.content[0].token"
    );
    let mut out_of_range = choice(&[1], "x");
    out_of_range["logprobs"]["content"][0]["token"] = json!("token_id:99999999");
    assert!(
        err(json!([{"role": "user", "content": "q"}, out_of_range])).ends_with("content[0].token")
    );
    // `token` must be what `bytes` read as UTF-8 are.
    let mut disagree = choice(&[1], "x");
    disagree["logprobs"]["content"][0] = json!({"token": "a", "bytes": [98], "logprob": -0.5});
    assert_eq!(
        err(json!([{"role": "user", "content": "q"}, disagree])),
        "trajectory_groups[0].trajectories[0].messages_and_choices[1].logprobs.content[0]"
    );
    // Gemma's template raises on roles that do not alternate.
    assert_eq!(
        err(
            json!([{"role": "user", "content": "q"}, {"role": "user", "content": "q"}, choice(&[5], "x")])
        ),
        "trajectory_groups[0].trajectories[0].messages_and_choices"
    );
    let empty: TrainingRequest = serde_json::from_value(json!({"trajectory_groups": []})).unwrap();
    assert!(
        matches!(tokenize_job(&empty, &tok, &template), Err(TrainError::Invalid { param, .. }) if param == "trajectory_groups")
    );
    let config: TrainingRequest = serde_json::from_value(json!({"trajectory_groups": [{"trajectories": [
        {"messages_and_choices": [], "reward": 0}]}], "experimental_config": {"advantage_balance": 3}})).unwrap();
    assert!(
        matches!(tokenize_job(&config, &tok, &template), Err(TrainError::Invalid { param, .. }) if param == "experimental_config.advantage_balance")
    );
}

/// The tools and a context assistant turn's tool calls reach the template (the shipped Gemma 3
/// template renders neither, as Hugging Face's does not; this one renders both, and roles that do
/// not alternate), and the trainable answer after the tool result is spliced in after exactly the
/// prompt serving would render.
#[test]
fn tools_and_tool_calls_are_context() {
    let (tok, _) = setup();
    let template = ChatTemplate::new(
        "{{ bos_token }}{% for t in tools %}[tool {{ t.function.name }}]{% endfor %}\
         {% for m in messages %}<{{ m.role }}>{% if m.content %}{{ m.content }}{% endif %}\
         {% for c in m.tool_calls %}[call {{ c.function.name }} {{ c.function.arguments }}]{% endfor %}\
         </{{ m.role }}>{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}",
        tok.bos_token().map(str::to_owned),
        tok.eos_token().map(str::to_owned),
    )
    .unwrap();
    let tools: Vec<temper_text::ToolDef> = serde_json::from_value(json!([{"type": "function",
        "function": {"name": "get_weather", "description": "Weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]))
    .unwrap();
    let context = json!([
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]);
    let answer = tok.encode("It is sunny", false);
    let mut items = context.as_array().unwrap().clone();
    items.push(choice(&answer, "It is sunny"));
    let mut req = request(Value::Array(items));
    req.trajectory_groups[0].trajectories[0].tools = Some(tools.clone());
    let job = tokenize_job(&req, &tok, &template).unwrap();
    let s = &job.sequences[0];

    let messages: Vec<ChatMessage> = serde_json::from_value(context).unwrap();
    let served_text = served_text(&template, &messages, Some(&tools));
    assert!(
        served_text.contains("[tool get_weather]")
            && served_text.contains("[call get_weather {'city': 'Paris'}]")
            && served_text.contains("<tool>sunny</tool>"),
        "{served_text}"
    );
    let served = tok.encode(&served_text, true);
    assert_eq!(&s.tokens[..served.len()], served.as_slice());
    let end = served.len() + answer.len();
    assert_eq!(&s.tokens[served.len()..end], answer.as_slice());
    let masked: Vec<usize> = (0..s.tokens.len()).filter(|&i| s.mask[i]).collect();
    assert_eq!(masked, (served.len()..end).collect::<Vec<_>>());
    let tail = tok.decode(
        &s.tokens[end..],
        temper_text::DecodeOptions {
            skip_special_tokens: false,
            spaces_between_special_tokens: false,
        },
    );
    assert_eq!(
        tail, "</assistant>",
        "the template's text after the answer is context"
    );
}

/// With the shipped Gemma 3 template: a Choice that called a tool trains on exactly its sampled
/// call tokens, and the tool result after it is context, written as the served prompt writes it.
#[test]
fn sampled_tool_calls_are_trainable_and_tool_results_context() {
    let (tok, template) = setup();
    let eot = tok.token_id("<end_of_turn>").unwrap();
    let tools: Vec<temper_text::ToolDef> = serde_json::from_value(json!([{"type": "function",
        "function": {"name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]))
    .unwrap();
    let call_text =
        "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
    let mut call_ids = tok.encode(call_text, false);
    call_ids.push(eot);
    let mut call_choice = choice(&call_ids, "");
    call_choice["message"] = json!({"role": "assistant", "content": null, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]});
    call_choice["finish_reason"] = json!("tool_calls");
    let answer = tok.encode("It is sunny", false);
    let mut req = request(json!([
        {"role": "user", "content": "Weather in Paris?"},
        call_choice,
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        choice(&answer, "It is sunny"),
    ]));
    req.trajectory_groups[0].trajectories[0].tools = Some(tools.clone());
    let job = tokenize_job(&req, &tok, &template).unwrap();
    let s = &job.sequences[0];

    let user = [ChatMessage::text("user", "Weather in Paris?")];
    let served_text = served_text(&template, &user, Some(&tools));
    assert!(served_text.contains("get_weather"), "{served_text}");
    let served = tok.encode(&served_text, true);
    assert_eq!(&s.tokens[..served.len()], served.as_slice());
    let call_end = served.len() + call_ids.len();
    assert_eq!(&s.tokens[served.len()..call_end], call_ids.as_slice());
    let answer_start = s.tokens.len() - answer.len() - tok.encode("<end_of_turn>\n", true).len();
    assert_eq!(
        &s.tokens[answer_start..answer_start + answer.len()],
        answer.as_slice()
    );
    let context = tok.decode(
        &s.tokens[call_end..answer_start],
        temper_text::DecodeOptions {
            skip_special_tokens: false,
            spaces_between_special_tokens: false,
        },
    );
    assert_eq!(
        context,
        "\n<start_of_turn>user\n<tool_response>\nsunny\n</tool_response><end_of_turn>\n\
         <start_of_turn>model\n"
    );
    let masked: Vec<usize> = (0..s.tokens.len()).filter(|&i| s.mask[i]).collect();
    let want: Vec<usize> = (served.len()..call_end)
        .chain(answer_start..answer_start + answer.len())
        .collect();
    assert_eq!(masked, want, "call and answer tokens only");
}
