//! The tool-call formats: how a chat template writes an assistant's calls, the Lark grammar
//! that constrains output to calls, and the parser that finds calls in output. The three must
//! agree (tests render calls with the templates and parse them back).
//!
//! [`ToolCallFormat::Hermes`] (the shipped Gemma 3 template, Qwen 2.5 / 3, SmolLM3): one block
//! per call, blocks separated by a line break:
//!
//! ```text
//! <tool_call>
//! {"name": "get_weather", "arguments": {"city": "Paris"}}
//! </tool_call>
//! ```
//!
//! Plain tags and one JSON object are easy for a small base model to copy from the prompt, easy
//! to constrain (the envelope is literal text around one JSON value) and easy to find in free
//! text.
//!
//! [`ToolCallFormat::Llama3Json`] (Llama 3.1 / 3.2 / 3.3): the whole answer is the call,
//! `{"name": "get_weather", "parameters": {"city": "Paris"}}`, calls separated by `; `,
//! optionally after `<|python_tag|>`.
//!
//! [`ToolCallFormat::MistralJson`] (Mistral's templates: Nemo, 7B v0.3, Small): the whole answer
//! is `[TOOL_CALLS]` and a JSON array of the calls, `[TOOL_CALLS][{"name": "get_weather",
//! "arguments": {"city": "Paris"}}]`; the template writes each call back with a nine-character
//! `id` ([`template_call_id`]).

use serde::Deserialize;
use serde_json::value::RawValue;

pub const CALL_OPEN: &str = "<tool_call>";
pub const CALL_CLOSE: &str = "</tool_call>";
/// Between consecutive calls.
pub const CALL_SEPARATOR: &str = "\n";
/// What Llama 3.x may write before its JSON calls.
pub const PYTHON_TAG: &str = "<|python_tag|>";
/// Between consecutive Llama 3.x calls.
pub const JSON_CALL_SEPARATOR: &str = "; ";
/// What opens Mistral's calls (a control token of its vocabularies).
pub const MISTRAL_CALLS: &str = "[TOOL_CALLS]";
/// Between consecutive calls in Mistral's array (as its templates write them).
pub const MISTRAL_CALL_SEPARATOR: &str = ", ";
/// The length of a call id Mistral's templates accept (they raise on any other).
pub const MISTRAL_ID_LEN: usize = 9;

/// How a model writes its tool calls (decided by its chat template).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ToolCallFormat {
    /// `<tool_call>` blocks around `{"name", "arguments"}`.
    #[default]
    Hermes,
    /// The answer is `{"name", "parameters"}` objects and nothing else.
    Llama3Json,
    /// The answer is `[TOOL_CALLS]` and an array of `{"name", "arguments"}` objects.
    MistralJson,
}

impl ToolCallFormat {
    /// The format a template asks its model for: Llama 3.x's templates describe the JSON answer
    /// (`"parameters": dictionary of argument name and its value`) and have no `<tool_call>`
    /// tags; Mistral's write `[TOOL_CALLS]`; everything else gets the tags.
    pub fn of_template(source: &str) -> ToolCallFormat {
        if source.contains(CALL_OPEN) {
            ToolCallFormat::Hermes
        } else if source.contains(MISTRAL_CALLS) {
            ToolCallFormat::MistralJson
        } else if source.contains(r#""parameters": dictionary"#) {
            ToolCallFormat::Llama3Json
        } else {
            ToolCallFormat::Hermes
        }
    }
}

/// A call id as a template of `format` is given it: Mistral's take ids of exactly nine
/// characters, so a longer one keeps its last nine (as vLLM truncates them) and a shorter one is
/// padded with `0` in front (the same id maps to the same in a call and in its result); other
/// formats take ids as they are.
pub fn template_call_id(format: ToolCallFormat, id: &str) -> std::borrow::Cow<'_, str> {
    let chars = id.chars().count();
    match format {
        ToolCallFormat::MistralJson if chars > MISTRAL_ID_LEN => {
            let skip = id
                .char_indices()
                .nth(chars - MISTRAL_ID_LEN)
                .map_or(0, |(i, _)| i);
            id[skip..].into()
        }
        ToolCallFormat::MistralJson if chars < MISTRAL_ID_LEN => {
            format!("{}{id}", "0".repeat(MISTRAL_ID_LEN - chars)).into()
        }
        _ => id.into(),
    }
}

/// One call found in output. `arguments` is the arguments' JSON text exactly as generated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedCall {
    pub name: String,
    pub arguments: String,
}

/// A function constrained output may call: its name and the JSON schema of its arguments.
#[derive(Debug, Clone, PartialEq)]
pub struct FunctionSchema {
    pub name: String,
    pub parameters: serde_json::Value,
}

/// A Lark grammar whose sentences are calls of `functions` in `format` (at least one; at most
/// one when `parallel` is false), with nothing around them. Each call is the template's exact
/// envelope around JSON matching the function's schema, embedded as given (the caller adds its
/// JSON whitespace options).
pub fn grammar(format: ToolCallFormat, functions: &[FunctionSchema], parallel: bool) -> String {
    let literal = |s: &str| serde_json::Value::String(s.to_owned()).to_string();
    let (open, key, close, separator) = match format {
        ToolCallFormat::Hermes => (
            format!("{CALL_OPEN}\n"),
            "arguments",
            format!("}}\n{CALL_CLOSE}"),
            CALL_SEPARATOR,
        ),
        ToolCallFormat::Llama3Json => (
            String::new(),
            "parameters",
            "}".to_owned(),
            JSON_CALL_SEPARATOR,
        ),
        ToolCallFormat::MistralJson => (
            String::new(),
            "arguments",
            "}".to_owned(),
            MISTRAL_CALL_SEPARATOR,
        ),
    };
    let mut rules = Vec::with_capacity(functions.len());
    for (i, f) in functions.iter().enumerate() {
        let head = format!(
            "{open}{{\"name\": {}, \"{key}\": ",
            serde_json::Value::String(f.name.clone())
        );
        rules.push(format!(
            "call_{i}: {} %json {} {}",
            literal(&head),
            f.parameters,
            literal(&close)
        ));
    }
    let calls: Vec<String> = (0..functions.len()).map(|i| format!("call_{i}")).collect();
    let calls_rule = if parallel {
        format!("call ({} call)*", literal(separator))
    } else {
        "call".to_owned()
    };
    let start = match format {
        ToolCallFormat::MistralJson => format!(
            "start: {} {calls_rule} \"]\"",
            literal(&format!("{MISTRAL_CALLS}["))
        ),
        _ => format!("start: {calls_rule}"),
    };
    format!(
        "{start}\ncall: {}\n{}\n",
        calls.join(" | "),
        rules.join("\n")
    )
}

/// The body between the tags: `{"name": …, "arguments": …}` in any order and spacing.
#[derive(Deserialize)]
struct CallBody<'a> {
    name: String,
    /// Unconstrained (`tool_choice` "auto"), small models often write Llama's `parameters`.
    #[serde(borrow, alias = "parameters")]
    arguments: &'a RawValue,
}

/// What one pushed piece of output turned into.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ToolCallDelta {
    pub content: String,
    pub calls: Vec<ParsedCall>,
}

/// Finds calls in output, whole or streamed (`split` is `push` of the whole text then `finish`,
/// so concatenated deltas equal the whole parse).
///
/// Rules: a call is `CALL_OPEN`, a JSON object with a `name` among the request's functions and
/// `arguments` (or `parameters`), then `CALL_CLOSE`. Everything else is content, except whitespace touching a call
/// (the separators and the line break before the first call). A block that does not parse, or
/// that generation left unfinished, stays content as written. After `max_calls` calls, further
/// blocks are content.
#[derive(Debug, Clone)]
pub struct ToolCallParser {
    format: ToolCallFormat,
    names: Vec<String>,
    max_calls: usize,
    calls: usize,
    /// Unresolved text: not yet known to be content or a call.
    held: String,
    /// Inside a block: `held` is what follows `CALL_OPEN` (Llama 3.x: `held` opens a JSON
    /// object, so it is held to the end).
    in_call: bool,
    /// Whitespace seen right before the open block: content again if the block is not a call.
    space_before: String,
    /// The last thing resolved was a call: leading whitespace is dropped.
    after_call: bool,
    /// Llama 3.x: the output does not start as a call, so all of it is content.
    plain: bool,
}

impl ToolCallParser {
    /// Llama 3.x's calls are found in the whole output, at its end (`Llama3Json` output that
    /// starts like a call is held back until then); Hermes blocks as each closes.
    pub fn new(format: ToolCallFormat, names: Vec<String>, max_calls: usize) -> Self {
        ToolCallParser {
            format,
            names,
            max_calls,
            calls: 0,
            held: String::new(),
            in_call: false,
            space_before: String::new(),
            after_call: false,
            plain: false,
        }
    }

    /// The format it finds calls in.
    pub fn format(&self) -> ToolCallFormat {
        self.format
    }

    /// One whole output: its content and its calls. Content is `None` when the output is
    /// calls and nothing else (OpenAI's null content), `Some` (maybe empty) without calls.
    pub fn split(mut self, text: &str) -> (Option<String>, Vec<ParsedCall>) {
        let mut out = self.push(text);
        let last = self.finish();
        out.content.push_str(&last.content);
        out.calls.extend(last.calls);
        let content = (!out.content.is_empty() || out.calls.is_empty()).then_some(out.content);
        (content, out.calls)
    }

    pub fn push(&mut self, text: &str) -> ToolCallDelta {
        match self.format {
            ToolCallFormat::Hermes => self.push_blocks(text),
            ToolCallFormat::Llama3Json | ToolCallFormat::MistralJson => self.push_json(text),
        }
    }

    /// Llama 3.x: holds the output while it may still be a call (empty, whitespace, a prefix
    /// of `<|python_tag|>`, or starting with `{` after them); Mistral: while it may still start
    /// with `[TOOL_CALLS]`. Once it cannot be, all of it is content as it comes.
    fn push_json(&mut self, text: &str) -> ToolCallDelta {
        if self.plain || self.max_calls == 0 {
            return ToolCallDelta {
                content: text.to_owned(),
                calls: Vec::new(),
            };
        }
        self.held.push_str(text);
        // Once the answer opens a JSON object it is held to the end: no rescan per token.
        if self.in_call {
            return ToolCallDelta::default();
        }
        let start = self.held.trim_start();
        let (opens, may_open) = if self.format == ToolCallFormat::MistralJson {
            (
                start.starts_with(MISTRAL_CALLS),
                MISTRAL_CALLS.starts_with(start),
            )
        } else {
            let after_tag = start
                .strip_prefix(PYTHON_TAG)
                .map_or(start, str::trim_start);
            (
                after_tag.starts_with('{'),
                PYTHON_TAG.starts_with(after_tag),
            )
        };
        if opens {
            self.in_call = true;
            return ToolCallDelta::default();
        }
        // Nothing yet but whitespace, or a prefix of what opens calls.
        if may_open {
            return ToolCallDelta::default();
        }
        self.plain = true;
        ToolCallDelta {
            content: std::mem::take(&mut self.held),
            calls: Vec::new(),
        }
    }

    /// Llama 3.x: the held output as calls, when all of it is calls of known functions
    /// separated by `;` (at most `max_calls`); Mistral: when it is `[TOOL_CALLS]` and an array
    /// of them.
    fn json_calls(&self) -> Option<Vec<ParsedCall>> {
        let start = self.held.trim();
        if self.format == ToolCallFormat::MistralJson {
            let array = start.strip_prefix(MISTRAL_CALLS)?;
            let bodies: Vec<CallBody<'_>> = serde_json::from_str(array).ok()?;
            let calls = bodies
                .into_iter()
                .map(|body| self.known(body))
                .collect::<Option<Vec<_>>>()?;
            return (!calls.is_empty() && calls.len() <= self.max_calls).then_some(calls);
        }
        let mut rest = start.strip_prefix(PYTHON_TAG).unwrap_or(start).trim_start();
        let mut calls = Vec::new();
        while !rest.is_empty() {
            let mut values = serde_json::Deserializer::from_str(rest).into_iter::<CallBody<'_>>();
            let body = values.next()?.ok()?;
            let used = values.byte_offset();
            calls.push(self.known(body)?);
            rest = rest[used..].trim_start();
            rest = rest.strip_prefix(';').unwrap_or(rest).trim_start();
        }
        (!calls.is_empty() && calls.len() <= self.max_calls).then_some(calls)
    }

    fn push_blocks(&mut self, text: &str) -> ToolCallDelta {
        self.held.push_str(text);
        let mut out = ToolCallDelta::default();
        loop {
            if self.in_call {
                let Some(end) = self.held.find(CALL_CLOSE) else {
                    return out;
                };
                let body = &self.held[..end];
                match self.call(body) {
                    Some(call) => {
                        out.calls.push(call);
                        self.calls += 1;
                        self.space_before.clear();
                        self.after_call = true;
                    }
                    None => {
                        out.content
                            .push_str(&std::mem::take(&mut self.space_before));
                        out.content.push_str(CALL_OPEN);
                        out.content.push_str(&self.held[..end + CALL_CLOSE.len()]);
                        self.after_call = false;
                    }
                }
                self.held.drain(..end + CALL_CLOSE.len());
                self.in_call = false;
                continue;
            }
            if self.after_call {
                let trimmed = self.held.trim_start();
                if trimmed.is_empty() {
                    self.held.clear();
                    return out;
                }
                self.held.drain(..self.held.len() - trimmed.len());
                self.after_call = false;
            }
            let open = (self.calls < self.max_calls)
                .then(|| self.held.find(CALL_OPEN))
                .flatten();
            match open {
                Some(at) => {
                    let before = &self.held[..at];
                    let text = before.trim_end();
                    out.content.push_str(text);
                    self.space_before = before[text.len()..].to_owned();
                    self.held.drain(..at + CALL_OPEN.len());
                    self.in_call = true;
                }
                None => {
                    // Hold back trailing whitespace (it is dropped if a call follows) and
                    // whatever could be the start of `CALL_OPEN`.
                    let keep = if self.calls < self.max_calls {
                        partial_open(&self.held)
                    } else {
                        0
                    };
                    let resolved = &self.held[..self.held.len() - keep];
                    let emit = resolved.trim_end().len();
                    out.content.push_str(&self.held[..emit]);
                    self.held.drain(..emit);
                    return out;
                }
            }
        }
    }

    /// The end of the output: held text is content (an unfinished block included), except
    /// whitespace after a call.
    pub fn finish(&mut self) -> ToolCallDelta {
        if self.format != ToolCallFormat::Hermes {
            self.in_call = false;
            return match self.json_calls() {
                Some(calls) => {
                    self.held.clear();
                    ToolCallDelta {
                        content: String::new(),
                        calls,
                    }
                }
                None => ToolCallDelta {
                    content: std::mem::take(&mut self.held),
                    calls: Vec::new(),
                },
            };
        }
        let mut content = std::mem::take(&mut self.space_before);
        if self.in_call {
            content.push_str(CALL_OPEN);
        }
        let held = std::mem::take(&mut self.held);
        if !(self.after_call && held.trim().is_empty()) {
            content.push_str(&held);
        }
        self.in_call = false;
        ToolCallDelta {
            content,
            calls: Vec::new(),
        }
    }

    fn call(&self, body: &str) -> Option<ParsedCall> {
        self.known(serde_json::from_str(body.trim()).ok()?)
    }

    /// A call of one of the request's functions.
    fn known(&self, body: CallBody<'_>) -> Option<ParsedCall> {
        self.names.contains(&body.name).then(|| ParsedCall {
            name: body.name,
            arguments: body.arguments.get().to_owned(),
        })
    }
}

/// Length of the longest suffix of `text` that is a proper prefix of `CALL_OPEN`.
fn partial_open(text: &str) -> usize {
    (1..CALL_OPEN.len())
        .rev()
        .find(|&n| text.ends_with(&CALL_OPEN[..n]))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parser() -> ToolCallParser {
        ToolCallParser::new(
            ToolCallFormat::Hermes,
            vec!["f".into(), "g".into()],
            usize::MAX,
        )
    }

    fn call(name: &str, arguments: &str) -> ParsedCall {
        ParsedCall {
            name: name.into(),
            arguments: arguments.into(),
        }
    }

    /// Every split of `text` into two pushes gives the whole parse.
    fn streamed_agrees(p: &ToolCallParser, text: &str) {
        let whole = p.clone().split(text);
        for cut in (0..=text.len()).filter(|&i| text.is_char_boundary(i)) {
            for step in [1, 3, 7] {
                let mut s = p.clone();
                let mut content = String::new();
                let mut calls = Vec::new();
                let mut pieces = vec![&text[..cut]];
                let rest = &text[cut..];
                let mut i = 0;
                while i < rest.len() {
                    let mut j = (i + step).min(rest.len());
                    while !rest.is_char_boundary(j) {
                        j += 1;
                    }
                    pieces.push(&rest[i..j]);
                    i = j;
                }
                for piece in pieces {
                    let d = s.push(piece);
                    content.push_str(&d.content);
                    calls.extend(d.calls);
                }
                let d = s.finish();
                content.push_str(&d.content);
                calls.extend(d.calls);
                let content = (!content.is_empty() || calls.is_empty()).then_some(content);
                assert_eq!(
                    (content, calls),
                    whole,
                    "{text:?} cut at {cut}, step {step}"
                );
            }
        }
    }

    #[test]
    fn calls_and_content() {
        let two = "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}}\n</tool_call>\n\
                   <tool_call>\n{\"arguments\":{\"b\" : [2]},\"name\":\"g\"}\n</tool_call>";
        assert_eq!(
            parser().split(two),
            (
                None,
                vec![call("f", "{\"a\": 1}"), call("g", "{\"b\" : [2]}")]
            )
        );
        let llama_style = "<tool_call>{\"name\": \"f\", \"parameters\": {\"a\": 2}}</tool_call>";
        assert_eq!(
            parser().split(llama_style),
            (None, vec![call("f", "{\"a\": 2}")])
        );
        let text = format!("Let me look.\n\n{two}\n");
        assert_eq!(parser().split(&text).0.as_deref(), Some("Let me look."));
        assert_eq!(parser().split(&text).1.len(), 2);
        // One call allowed: the second block is content.
        let (content, calls) =
            ToolCallParser::new(ToolCallFormat::Hermes, vec!["f".into(), "g".into()], 1).split(two);
        assert_eq!(calls, vec![call("f", "{\"a\": 1}")]);
        assert!(content.unwrap().starts_with("<tool_call>\n{\"arguments\""));
        assert_eq!(
            parser().split("no calls here  "),
            (Some("no calls here  ".into()), vec![])
        );
        assert_eq!(parser().split(""), (Some(String::new()), vec![]));
        for text in [two, &text, "a <tool_call> b", "x<tool_", ""] {
            streamed_agrees(&parser(), text);
        }
    }

    #[test]
    fn malformed_or_unfinished_blocks_stay_content() {
        for text in [
            "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}\n</tool_call>",
            "<tool_call>{\"name\": \"unknown\", \"arguments\": {}}</tool_call>",
            "<tool_call>{\"arguments\": {}}</tool_call>",
            "Sure. <tool_call>\n{\"name\": \"f\", \"argu",
            "<tool_",
        ] {
            assert_eq!(parser().split(text), (Some(text.to_owned()), vec![]));
            streamed_agrees(&parser(), text);
        }
        let mixed = "<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call> then \
                     <tool_call>{\"name\": \"f\", \"argu";
        let (content, calls) = parser().split(mixed);
        assert_eq!(calls, vec![call("f", "{}")]);
        assert_eq!(
            content.as_deref(),
            Some("then <tool_call>{\"name\": \"f\", \"argu")
        );
        streamed_agrees(&parser(), mixed);
    }

    #[test]
    fn grammar_embeds_each_schema_in_the_envelope() {
        let functions = [
            FunctionSchema {
                name: "f".into(),
                parameters: serde_json::json!({"type": "object"}),
            },
            FunctionSchema {
                name: "g\"".into(),
                parameters: serde_json::json!(true),
            },
        ];
        assert_eq!(
            grammar(ToolCallFormat::Hermes, &functions, true),
            "start: call (\"\\n\" call)*\ncall: call_0 | call_1\n\
             call_0: \"<tool_call>\\n{\\\"name\\\": \\\"f\\\", \\\"arguments\\\": \" %json {\"type\":\"object\"} \"}\\n</tool_call>\"\n\
             call_1: \"<tool_call>\\n{\\\"name\\\": \\\"g\\\\\\\"\\\", \\\"arguments\\\": \" %json true \"}\\n</tool_call>\"\n"
        );
        assert!(grammar(ToolCallFormat::Hermes, &functions[..1], false)
            .starts_with("start: call\ncall: call_0\n"));
    }

    fn llama() -> ToolCallParser {
        ToolCallParser::new(
            ToolCallFormat::Llama3Json,
            vec!["f".into(), "g".into()],
            usize::MAX,
        )
    }

    #[test]
    fn llama3_answers_that_are_calls_become_calls() {
        let one = r#"{"name": "f", "parameters": {"city": "Paris"}}"#;
        assert_eq!(
            llama().split(one),
            (None, vec![call("f", r#"{"city": "Paris"}"#)])
        );
        let tagged = format!("{PYTHON_TAG}{one}");
        assert_eq!(
            llama().split(&tagged).1,
            vec![call("f", r#"{"city": "Paris"}"#)]
        );
        let two = r#" {"name": "f", "parameters": {}}; {"name": "g", "arguments": {"x": 1}} "#;
        assert_eq!(
            llama().split(two),
            (None, vec![call("f", "{}"), call("g", r#"{"x": 1}"#)])
        );
        for text in [one, tagged.as_str(), two] {
            streamed_agrees(&llama(), text);
        }
    }

    #[test]
    fn llama3_anything_else_is_content() {
        for text in [
            "Paris is sunny.",
            r#"{"name": "unknown", "parameters": {}}"#,
            r#"{"name": "f", "parameters": {}} and then some words"#,
            r#"{"name": "f", "parameters": "#,
            "  <|python",
            "",
        ] {
            assert_eq!(
                llama().split(text),
                (Some(text.to_owned()), vec![]),
                "{text}"
            );
            streamed_agrees(&llama(), text);
        }
        // Past `max_calls` the answer is content.
        let two = r#"{"name": "f", "parameters": {}}; {"name": "g", "parameters": {}}"#;
        let one_call =
            ToolCallParser::new(ToolCallFormat::Llama3Json, vec!["f".into(), "g".into()], 1);
        assert_eq!(one_call.split(two), (Some(two.to_owned()), vec![]));
    }

    #[test]
    fn the_template_decides_the_format() {
        assert_eq!(
            ToolCallFormat::of_template(crate::ChatTemplate::GEMMA3),
            ToolCallFormat::Hermes
        );
        let llama = r#"Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}."#;
        assert_eq!(
            ToolCallFormat::of_template(llama),
            ToolCallFormat::Llama3Json
        );
        assert_eq!(
            ToolCallFormat::of_template("{{ '<tool_call>' }} \"parameters\": dictionary"),
            ToolCallFormat::Hermes
        );
        let nemo = include_str!("../tests/fixtures/templates/mistral-nemo.jinja");
        assert_eq!(
            ToolCallFormat::of_template(nemo),
            ToolCallFormat::MistralJson
        );
    }

    fn mistral(max_calls: usize) -> ToolCallParser {
        ToolCallParser::new(
            ToolCallFormat::MistralJson,
            vec!["f".into(), "g".into()],
            max_calls,
        )
    }

    #[test]
    fn mistral_answers_that_are_calls_become_calls() {
        let one = r#"[TOOL_CALLS][{"name": "f", "arguments": {"city": "Paris"}}]"#;
        assert_eq!(
            mistral(9).split(one),
            (None, vec![call("f", r#"{"city": "Paris"}"#)])
        );
        // Mistral 7B writes a space after the tag; ids in the calls are ignored.
        let two = r#" [TOOL_CALLS] [{"name": "f", "arguments": {}, "id": "abc123def"}, {"name": "g", "arguments": {"x": 1}}] "#;
        assert_eq!(
            mistral(9).split(two),
            (None, vec![call("f", "{}"), call("g", r#"{"x": 1}"#)])
        );
        for text in [one, two] {
            streamed_agrees(&mistral(9), text);
        }
    }

    #[test]
    fn mistral_anything_else_is_content() {
        for text in [
            "Paris is sunny.",
            r#"[{"name": "f", "arguments": {}}]"#,
            r#"[TOOL_CALLS][{"name": "unknown", "arguments": {}}]"#,
            r#"[TOOL_CALLS][{"name": "f", "arguments": {}}] and then some words"#,
            r#"[TOOL_CALLS][{"name": "f", "arguments": "#,
            "[TOOL_CALLS][]",
            " [TOOL_",
            "",
        ] {
            assert_eq!(
                mistral(9).split(text),
                (Some(text.to_owned()), vec![]),
                "{text}"
            );
            streamed_agrees(&mistral(9), text);
        }
        // Past `max_calls` the answer is content.
        let two = r#"[TOOL_CALLS][{"name": "f", "arguments": {}}, {"name": "g", "arguments": {}}]"#;
        assert_eq!(mistral(1).split(two), (Some(two.to_owned()), vec![]));
    }

    #[test]
    fn mistral_grammar_is_its_answer_shape() {
        let functions = [FunctionSchema {
            name: "f".into(),
            parameters: serde_json::json!({"type": "object"}),
        }];
        assert_eq!(
            grammar(ToolCallFormat::MistralJson, &functions, true),
            "start: \"[TOOL_CALLS][\" call (\", \" call)* \"]\"\ncall: call_0\n\
             call_0: \"{\\\"name\\\": \\\"f\\\", \\\"arguments\\\": \" %json {\"type\":\"object\"} \"}\"\n"
        );
        assert!(grammar(ToolCallFormat::MistralJson, &functions, false)
            .starts_with("start: \"[TOOL_CALLS][\" call \"]\"\n"));
    }

    #[test]
    fn mistral_templates_get_nine_character_ids() {
        let mistral = ToolCallFormat::MistralJson;
        assert_eq!(template_call_id(mistral, "call_1"), "000call_1");
        assert_eq!(template_call_id(mistral, "abc123def"), "abc123def");
        assert_eq!(
            template_call_id(mistral, "chatcmpl-tool-0123456789abcdef"),
            "789abcdef"
        );
        assert_eq!(template_call_id(ToolCallFormat::Hermes, "call_1"), "call_1");
    }

    #[test]
    fn llama3_grammar_is_its_answer_shape() {
        let functions = [FunctionSchema {
            name: "f".into(),
            parameters: serde_json::json!({"type": "object"}),
        }];
        assert_eq!(
            grammar(ToolCallFormat::Llama3Json, &functions, true),
            "start: call (\"; \" call)*\ncall: call_0\n\
             call_0: \"{\\\"name\\\": \\\"f\\\", \\\"parameters\\\": \" %json {\"type\":\"object\"} \"}\"\n"
        );
    }
}
