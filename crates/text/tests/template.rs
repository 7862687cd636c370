//! Chat template rendering: the shipped Gemma 3 template and the Jinja features Hugging Face
//! templates rely on.

use temper_text::{
    ChatMessage, ChatTemplate, ContentPart, FunctionCall, FunctionDef, MessageContent,
    TemplateInput, TextError, ToolCall, ToolDef,
};

fn gemma() -> ChatTemplate {
    ChatTemplate::new(
        ChatTemplate::GEMMA3,
        Some("<bos>".into()),
        Some("<eos>".into()),
    )
    .expect("GEMMA3 compiles")
}

fn input<'a>(
    messages: &'a [ChatMessage],
    kwargs: &'a serde_json::Map<String, serde_json::Value>,
) -> TemplateInput<'a> {
    TemplateInput {
        messages,
        tools: None,
        documents: None,
        add_generation_prompt: true,
        continue_final_message: false,
        reasoning_effort: None,
        kwargs,
    }
}

fn no_kwargs() -> serde_json::Map<String, serde_json::Value> {
    serde_json::Map::new()
}

#[test]
fn gemma3_folds_system_renames_assistant_and_trims() {
    let kw = no_kwargs();
    let messages = [
        ChatMessage::text("system", "Be brief."),
        ChatMessage::text("user", "  Hi there \n"),
        ChatMessage::text("assistant", "Hello!"),
        ChatMessage {
            role: "user".into(),
            content: Some(MessageContent::Parts(vec![
                ContentPart::Text {
                    text: "Part one. ".into(),
                },
                ContentPart::Text {
                    text: "Part two".into(),
                },
            ])),
            ..Default::default()
        },
    ];
    let out = gemma().render(&input(&messages, &kw)).expect("render");
    assert_eq!(
        out,
        "<bos><start_of_turn>user\nBe brief.\n\nHi there<end_of_turn>\n\
         <start_of_turn>model\nHello!<end_of_turn>\n\
         <start_of_turn>user\nPart one.Part two<end_of_turn>\n\
         <start_of_turn>model\n"
    );
    let mut no_prompt = input(&messages, &kw);
    no_prompt.add_generation_prompt = false;
    let out = gemma().render(&no_prompt).expect("render");
    assert!(out.ends_with("Part two<end_of_turn>\n"));
}

#[test]
fn gemma3_rejects_non_alternating_roles_with_the_template_message() {
    let kw = no_kwargs();
    let messages = [
        ChatMessage::text("user", "a"),
        ChatMessage::text("user", "b"),
    ];
    match gemma().render(&input(&messages, &kw)) {
        Err(TextError::Template(msg)) => assert_eq!(
            msg,
            "Conversation roles must alternate user/assistant/user/assistant/..."
        ),
        other => panic!("expected the template's exception, got {other:?}"),
    }
}

#[test]
fn continue_final_message_leaves_the_last_message_open() {
    let kw = no_kwargs();
    let messages = [
        ChatMessage::text("user", "Count to three."),
        ChatMessage::text("assistant", "One, two, "),
    ];
    let mut inp = input(&messages, &kw);
    inp.add_generation_prompt = false;
    inp.continue_final_message = true;
    // The template trims the content, so the trimmed text is where the prompt ends.
    assert_eq!(
        gemma().render(&inp).expect("render"),
        "<bos><start_of_turn>user\nCount to three.<end_of_turn>\n<start_of_turn>model\nOne, two,"
    );
    // The last occurrence counts, not an earlier identical text.
    let messages = [
        ChatMessage::text("user", "same"),
        ChatMessage::text("assistant", "same"),
    ];
    let mut inp = input(&messages, &kw);
    inp.continue_final_message = true;
    assert_eq!(
        gemma().render(&inp).expect("render"),
        "<bos><start_of_turn>user\nsame<end_of_turn>\n<start_of_turn>model\nsame"
    );
}

#[test]
fn kwargs_tools_documents_and_reasoning_effort_reach_the_template() {
    let source = "{% for t in tools %}{{ t.function.name }}={{ t.function.parameters | tojson }};{% endfor %}\n\
                  {{ documents[0].title }}|{{ reasoning_effort }}|{{ enable_thinking }}|{{ greeting | upper }}|{{ bos_token }}";
    let template = ChatTemplate::new(source, Some("<s>".into()), None).expect("compiles");
    let tools = [ToolDef {
        r#type: "function".into(),
        function: FunctionDef {
            name: "get_weather".into(),
            description: Some("Weather".into()),
            parameters: Some(serde_json::json!({
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
                "type": "object"
            })),
            strict: None,
        },
    }];
    let doc = serde_json::json!({"title": "Doc A"});
    let docs = [doc.as_object().expect("object").clone()];
    let mut kw = serde_json::Map::new();
    kw.insert("enable_thinking".into(), false.into());
    kw.insert("greeting".into(), "hi".into());
    let messages = [ChatMessage::text("user", "x")];
    let mut inp = input(&messages, &kw);
    inp.tools = Some(&tools);
    inp.documents = Some(&docs);
    inp.reasoning_effort = Some("low");
    assert_eq!(
        template.render(&inp).expect("render"),
        "get_weather={\"properties\": {\"city\": {\"type\": \"string\"}}, \"required\": [\"city\"], \"type\": \"object\"};\
         Doc A|low|False|HI|<s>"
    );
}

#[test]
fn absent_tools_are_none_and_messages_are_dicts() {
    let template = ChatTemplate::new(
        "{{ tools is none }} {{ documents is none }} {{ reasoning_effort is defined }}\n\
         {%- for m in messages %} {{ m.role }}:{{ m.content }}:{{ m.name is defined }}\n\
         {%- for c in m.tool_calls or [] %} {{ c.function.name }}({{ c.function.arguments.city }}){{ c.function.arguments | tojson }}{% endfor %}{% endfor %}",
        None,
        None,
    )
    .expect("compiles");
    let kw = no_kwargs();
    let messages = [
        ChatMessage::text("user", "weather?"),
        ChatMessage {
            role: "assistant".into(),
            tool_calls: Some(vec![ToolCall {
                id: "call_1".into(),
                r#type: "function".into(),
                function: FunctionCall {
                    name: "get_weather".into(),
                    arguments: r#"{"city": "Paris", "unit": "C"}"#.into(),
                },
            }]),
            ..Default::default()
        },
    ];
    assert_eq!(
        template.render(&input(&messages, &kw)).expect("render"),
        "True True False user:weather?:False assistant::False \
         get_weather(Paris){\"city\": \"Paris\", \"unit\": \"C\"}"
    );
}

#[test]
fn python_string_methods_tojson_indent_and_strftime() {
    let template = ChatTemplate::new(
        "{{ '  x  '.strip() }}|{{ 'abc'.startswith('ab') }}|{% for k, v in {'a': 1}.items() %}{{ k }}{{ v }}{% endfor %}|\
         {{ {'a': [1, 2]} | tojson(indent=2) }}|{{ strftime_now('%Y') | length }}",
        None,
        None,
    )
    .expect("compiles");
    let kw = no_kwargs();
    let out = template.render(&input(&[], &kw)).expect("render");
    assert_eq!(out, "x|True|a1|{\n  \"a\": [\n    1,\n    2\n  ]\n}|4");
}

#[test]
fn generation_blocks_and_template_errors() {
    let template = ChatTemplate::new(
        "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}",
        None,
        None,
    )
    .expect("transformers' generation tag compiles");
    let kw = no_kwargs();
    let messages = [ChatMessage::text("assistant", "ok")];
    assert_eq!(
        template.render(&input(&messages, &kw)).expect("render"),
        "ok"
    );

    assert!(matches!(
        ChatTemplate::new("{% if %}", None, None),
        Err(TextError::Template(_))
    ));
    let raising =
        ChatTemplate::new("{{ raise_exception('bad ' ~ 1) }}", None, None).expect("compiles");
    match raising.render(&input(&[], &kw)) {
        Err(TextError::Template(msg)) => assert_eq!(msg, "bad 1"),
        other => panic!("expected raise_exception, got {other:?}"),
    }
}

#[test]
fn messages_serialize_like_the_openai_api() {
    let m = ChatMessage::text("user", "hi");
    assert_eq!(
        serde_json::to_value(&m).expect("serialize"),
        serde_json::json!({"role": "user", "content": "hi"})
    );
    let parts: ChatMessage = serde_json::from_value(serde_json::json!({
        "role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    }))
    .expect("deserialize");
    assert_eq!(
        parts.content.as_ref().map(|c| c.text().into_owned()),
        Some("ab".into())
    );
}

#[test]
fn thinking_is_marked_by_the_template_source() {
    let thinking = ChatTemplate::new("{{ '<start_of_turn>model\\n<think>' }}", None, None).unwrap();
    assert!(thinking.marks_thinking());
    assert!(!ChatTemplate::new(ChatTemplate::GEMMA3, None, None)
        .unwrap()
        .marks_thinking());
}

fn weather_tool() -> ToolDef {
    ToolDef {
        r#type: "function".into(),
        function: FunctionDef {
            name: "get_weather".into(),
            description: Some("Weather of a city".into()),
            // In sorted order: serde_json keeps or sorts keys depending on its features.
            parameters: Some(serde_json::json!({
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
                "type": "object"
            })),
            strict: None,
        },
    }
}

fn call(id: &str, name: &str, arguments: &str) -> ToolCall {
    ToolCall {
        id: id.into(),
        r#type: "function".into(),
        function: FunctionCall {
            name: name.into(),
            arguments: arguments.into(),
        },
    }
}

#[test]
fn gemma3_describes_tools_writes_calls_and_wraps_tool_results() {
    let kw = no_kwargs();
    let tools = [weather_tool()];
    let messages = [
        ChatMessage::text("system", "Be brief."),
        ChatMessage::text("user", "Weather in Paris and Rome?"),
        ChatMessage {
            role: "assistant".into(),
            content: Some(MessageContent::Text("Checking.".into())),
            tool_calls: Some(vec![
                call("c1", "get_weather", r#"{"city": "Paris"}"#),
                call("c2", "get_weather", r#"{"city": "Rome"}"#),
            ]),
            ..Default::default()
        },
        ChatMessage {
            tool_call_id: Some("c1".into()),
            ..ChatMessage::text("tool", "sunny")
        },
        ChatMessage {
            tool_call_id: Some("c2".into()),
            ..ChatMessage::text("tool", " rain ")
        },
        ChatMessage::text("assistant", "Sunny in Paris, rain in Rome."),
        ChatMessage::text("user", "Thanks"),
    ];
    let mut inp = input(&messages, &kw);
    inp.tools = Some(&tools);
    assert_eq!(
        gemma().render(&inp).expect("render"),
        "<bos><start_of_turn>user\nBe brief.\n\n\
         You can call these functions, each described in JSON:\n\
         {\"name\": \"get_weather\", \"description\": \"Weather of a city\", \"parameters\": \
         {\"properties\": {\"city\": {\"type\": \"string\"}}, \"required\": [\"city\"], \"type\": \"object\"}}\n\
         \nTo call functions, answer with one block per call and nothing else:\n\
         <tool_call>\n{\"name\": \"function name\", \"arguments\": {\"argument name\": \"value\"}}\n</tool_call>\n\n\
         Weather in Paris and Rome?<end_of_turn>\n\
         <start_of_turn>model\nChecking.\n\
         <tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n\
         <tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}\n</tool_call><end_of_turn>\n\
         <start_of_turn>user\n<tool_response>\nsunny\n</tool_response>\n\
         <tool_response>\nrain\n</tool_response><end_of_turn>\n\
         <start_of_turn>model\nSunny in Paris, rain in Rome.<end_of_turn>\n\
         <start_of_turn>user\nThanks<end_of_turn>\n\
         <start_of_turn>model\n"
    );
    // A tool result where the model should speak still breaks the alternation.
    let wrong = [
        ChatMessage::text("user", "q"),
        ChatMessage::text("tool", "r"),
    ];
    assert!(matches!(
        gemma().render(&input(&wrong, &kw)),
        Err(TextError::Template(_))
    ));
}

/// What the template writes for an assistant's calls is what the output parser reads back.
#[test]
fn gemma3_calls_parse_back_to_the_same_calls() {
    use temper_text::tool_calls::{ParsedCall, ToolCallFormat, ToolCallParser};
    let kw = no_kwargs();
    let calls = vec![
        call("a", "get_weather", r#"{"city": "Paris", "days": [1, 2]}"#),
        call("b", "get_time", r#"{"zone": "Europe/Rome", "exact": true}"#),
        call("c", "ping", "{}"),
    ];
    for content in [None, Some("Let me check.")] {
        let messages = [
            ChatMessage::text("user", "q"),
            ChatMessage {
                role: "assistant".into(),
                content: content.map(|c| MessageContent::Text(c.into())),
                tool_calls: Some(calls.clone()),
                ..Default::default()
            },
        ];
        let mut inp = input(&messages, &kw);
        inp.add_generation_prompt = false;
        let text = gemma().render(&inp).expect("render");
        let turn = text
            .rsplit("<start_of_turn>model\n")
            .next()
            .and_then(|t| t.strip_suffix("<end_of_turn>\n"))
            .expect("an assistant turn");
        let parser = ToolCallParser::new(
            ToolCallFormat::Hermes,
            vec!["get_weather".into(), "get_time".into(), "ping".into()],
            usize::MAX,
        );
        let (parsed_content, parsed) = parser.split(turn);
        assert_eq!(parsed_content.as_deref(), content);
        let want: Vec<ParsedCall> = calls
            .iter()
            .map(|c| ParsedCall {
                name: c.function.name.clone(),
                arguments: c.function.arguments.clone(),
            })
            .collect();
        assert_eq!(parsed, want, "{turn}");
    }
}

#[test]
fn qwen3_renders_the_reasoning_sent_back_under_either_name() {
    // Qwen 3's template reads `reasoning_content`; the API returns the reasoning as `reasoning`,
    // which an agent sends back: the template sees both names (as vLLM gives them).
    let source = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/templates/qwen3.jinja"
    ))
    .unwrap();
    let template = ChatTemplate::new(&source, None, Some("<|im_end|>".into())).unwrap();
    let kw = no_kwargs();
    for field in ["reasoning", "reasoning_content"] {
        let messages: Vec<ChatMessage> = serde_json::from_value(serde_json::json!([
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": null, field: "I should call the tool.",
             "tool_calls": [{"id": "c1", "type": "function",
                             "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "Sunny."}
        ]))
        .unwrap();
        assert_eq!(
            messages[1].reasoning.as_deref(),
            Some("I should call the tool.")
        );
        let text = template.render(&input(&messages, &kw)).unwrap();
        assert!(
            text.contains("<|im_start|>assistant\n<think>\nI should call the tool.\n</think>\n\n"),
            "{field}: {text}"
        );
    }
}
