//! The chat templates of the families temper serves (Qwen 2.5, Qwen 3, Llama 3.1 / 3.2,
//! SmolLM3, Mistral Nemo: the template strings their GGUF files carry) render exactly what
//! transformers' `apply_chat_template` renders for the same conversation: tools, tool calls and
//! results, multi-turn, no generation prompt, a continued final message, `enable_thinking`.
//! The expected texts come from transformers (`scripts/template-parity.py`, committed under
//! `tests/fixtures/templates/`).

use serde::Deserialize;
use serde_json::{Map, Value};
use temper_text::{ChatMessage, ChatTemplate, TemplateInput, ToolDef};

#[derive(Deserialize)]
struct Case {
    template: String,
    bos_token: Option<String>,
    eos_token: Option<String>,
    case: String,
    messages: Vec<ChatMessage>,
    tools: Option<Vec<ToolDef>>,
    kwargs: Map<String, Value>,
    add_generation_prompt: bool,
    continue_final_message: bool,
    /// `None`: transformers' render raised (the template refuses the conversation).
    expected: Option<String>,
}

const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/templates");

#[test]
fn family_templates_render_as_transformers_does() {
    let cases: Vec<Case> =
        serde_json::from_str(&std::fs::read_to_string(format!("{FIXTURES}/cases.json")).unwrap())
            .unwrap();
    assert!(cases.len() >= 40, "{} cases", cases.len());
    let mut failures = Vec::new();
    for c in &cases {
        let source = std::fs::read_to_string(format!("{FIXTURES}/{}.jinja", c.template)).unwrap();
        let template = ChatTemplate::new(&source, c.bos_token.clone(), c.eos_token.clone())
            .unwrap_or_else(|e| panic!("{}: {e}", c.template));
        let rendered = template.render(&TemplateInput {
            messages: &c.messages,
            tools: c.tools.as_deref(),
            documents: None,
            add_generation_prompt: c.add_generation_prompt,
            continue_final_message: c.continue_final_message,
            reasoning_effort: None,
            kwargs: &c.kwargs,
        });
        let ok = match (&rendered, &c.expected) {
            (Ok(text), Some(expected)) => text == expected,
            (Err(_), None) => true,
            _ => false,
        };
        if !ok {
            failures.push(format!(
                "{} / {}:\n  temper:       {:?}\n  transformers: {:?}",
                c.template, c.case, rendered, c.expected
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} cases differ:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}
