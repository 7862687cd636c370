//! Hugging Face chat templates on minijinja, with the Python/Jinja2 behaviour templates rely on.

use std::borrow::Cow;

use minijinja::value::Serde;
use minijinja::{Environment, Error, ErrorKind, Value};
use serde::{Deserialize, Serialize};

use crate::tool_calls::{template_call_id, ToolCallFormat};
use crate::TextError;

/// One chat message as the template sees it (a dict; `None` fields are left out).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<MessageContent>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCall>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// An assistant turn's reasoning (`reasoning_content`, its older name, is accepted too).
    #[serde(
        default,
        alias = "reasoning_content",
        skip_serializing_if = "Option::is_none"
    )]
    pub reasoning: Option<String>,
}

impl ChatMessage {
    /// A message with plain text content.
    pub fn text(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage {
            role: role.into(),
            content: Some(MessageContent::Text(content.into())),
            ..Default::default()
        }
    }
}

/// Message content: a string, or a list of typed parts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum MessageContent {
    Text(String),
    Parts(Vec<ContentPart>),
}

impl MessageContent {
    /// The text of the content (parts concatenated).
    pub fn text(&self) -> Cow<'_, str> {
        match self {
            MessageContent::Text(s) => Cow::Borrowed(s),
            MessageContent::Parts(parts) => match parts.as_slice() {
                [ContentPart::Text { text }] => Cow::Borrowed(text),
                _ => Cow::Owned(
                    parts
                        .iter()
                        .map(|ContentPart::Text { text }| text.as_str())
                        .collect(),
                ),
            },
        }
    }
}

/// `{"type": "text", "text": ...}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ContentPart {
    Text { text: String },
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolCall {
    pub id: String,
    pub r#type: String,
    pub function: FunctionCall,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FunctionCall {
    pub name: String,
    /// JSON text of the arguments, as in the OpenAI API. Templates see it parsed into a dict.
    pub arguments: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolDef {
    pub r#type: String,
    pub function: FunctionDef,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FunctionDef {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parameters: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub strict: Option<bool>,
}

/// Everything a render takes.
#[derive(Debug, Clone, Copy)]
pub struct TemplateInput<'a> {
    pub messages: &'a [ChatMessage],
    pub tools: Option<&'a [ToolDef]>,
    pub documents: Option<&'a [serde_json::Map<String, serde_json::Value>]>,
    pub add_generation_prompt: bool,
    /// Leave the final message open so the model continues it (vLLM semantics).
    pub continue_final_message: bool,
    pub reasoning_effort: Option<&'a str>,
    /// `chat_template_kwargs`: each entry becomes a top-level template variable.
    pub kwargs: &'a serde_json::Map<String, serde_json::Value>,
}

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// The Jinja source as given (what a Hugging Face `tokenizer_config.json` carries).
    source: String,
    bos_token: Option<String>,
    eos_token: Option<String>,
    marks_thinking: bool,
    tool_call_format: ToolCallFormat,
}

const TEMPLATE_NAME: &str = "chat_template";

/// Marks an error raised by the template's own `raise_exception`.
#[derive(Debug)]
struct Raised(String);

impl std::fmt::Display for Raised {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Raised {}

fn raise_exception(msg: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, msg.clone()).with_source(Raised(msg)))
}

/// `{{ value }}` output as Jinja2 under Python prints it where it differs from minijinja:
/// `True`/`False`/`None`.
fn python_formatter(
    out: &mut minijinja::Output,
    state: &mut minijinja::State,
    value: &Value,
) -> Result<(), Error> {
    let text = match value.kind() {
        minijinja::value::ValueKind::Bool if value.is_true() => "True",
        minijinja::value::ValueKind::Bool => "False",
        minijinja::value::ValueKind::None => "None",
        _ => return minijinja::escape_formatter(out, state, value),
    };
    std::fmt::Write::write_str(out, text)
        .map_err(|e| Error::new(ErrorKind::WriteFailure, e.to_string()))
}

fn strftime_now(format: String) -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64);
    crate::template::strftime(&format, secs)
}

fn template_error(err: Error) -> TextError {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(&err);
    while let Some(e) = source {
        if let Some(Raised(msg)) = e.downcast_ref::<Raised>() {
            return TextError::Template(msg.clone());
        }
        source = e.source();
    }
    TextError::Template(err.to_string())
}

impl ChatTemplate {
    /// Hugging Face's Gemma 3 chat template: a system message is folded into the first user
    /// turn, `assistant` is rendered as `model`, contents are trimmed, roles must alternate.
    ///
    /// Extended for tools (the GGUF's template ignores them); without `tools` and tool messages
    /// it renders exactly as Hugging Face's. `tools` are described after the system text in the
    /// first user turn together with the call format; an assistant's `tool_calls` are written in
    /// that format (`crate::tool_calls`) after its content; `tool` results, which Gemma has no
    /// role for, are `<tool_response>` blocks in a user turn (consecutive results share one).
    pub const GEMMA3: &'static str = r#"{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- if tools -%}
    {%- set described = namespace(text='') -%}
    {%- for tool in tools -%}
        {%- set described.text = described.text + (tool['function'] | tojson) + '\n' -%}
    {%- endfor -%}
    {%- set first_user_prefix = first_user_prefix + 'You can call these functions, each described in JSON:\n' + described.text + '\nTo call functions, answer with one block per call and nothing else:\n<tool_call>\n{"name": "function name", "arguments": {"argument name": "value"}}\n</tool_call>\n\n' -%}
{%- endif -%}
{%- set turn = namespace(index=0) -%}
{%- for message in loop_messages -%}
    {%- set is_tool = message['role'] == 'tool' -%}
    {%- if not (is_tool and loop.previtem is defined and loop.previtem['role'] == 'tool') -%}
        {%- if (message['role'] == 'user' or is_tool) != (turn.index % 2 == 0) -%}
            {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
        {%- endif -%}
        {%- set turn.index = turn.index + 1 -%}
        {%- if (message['role'] == 'assistant') -%}
            {%- set role = "model" -%}
        {%- elif is_tool -%}
            {%- set role = "user" -%}
        {%- else -%}
            {%- set role = message['role'] -%}
        {%- endif -%}
        {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- else -%}
        {{ '\n' }}
    {%- endif -%}
    {%- if is_tool -%}
        {{ '<tool_response>\n' }}
    {%- endif -%}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- elif not message['tool_calls'] -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {%- if message['tool_calls'] -%}
        {%- for call in message['tool_calls'] -%}
            {%- if not loop.first or message['content'] -%}
                {{ '\n' }}
            {%- endif -%}
            {{ '<tool_call>\n{"name": ' + (call['function']['name'] | tojson) + ', "arguments": ' + (call['function']['arguments'] | tojson) + '}\n</tool_call>' }}
        {%- endfor -%}
    {%- endif -%}
    {%- if is_tool -%}
        {{ '\n</tool_response>' }}
    {%- endif -%}
    {%- if not (is_tool and loop.nextitem is defined and loop.nextitem['role'] == 'tool') -%}
        {{ '<end_of_turn>\n' }}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"#;

    /// Compiles `source` once (Jinja2 settings of Hugging Face: trim_blocks, lstrip_blocks).
    pub fn new(
        source: &str,
        bos_token: Option<String>,
        eos_token: Option<String>,
    ) -> Result<Self, TextError> {
        let mut env = Environment::new();
        let mut syntax = minijinja::syntax::SyntaxConfig::builder();
        syntax.trim_blocks(true).lstrip_blocks(true);
        env.set_syntax(
            syntax
                .build()
                .map_err(|e| TextError::Template(e.to_string()))?,
        );
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.set_formatter(python_formatter);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", crate::tojson::tojson);
        env.add_template_owned(TEMPLATE_NAME, neutralize_generation_tags(source))
            .map_err(template_error)?;
        Ok(ChatTemplate {
            env,
            source: source.to_owned(),
            bos_token,
            eos_token,
            marks_thinking: source.contains(crate::THINK_START),
            tool_call_format: ToolCallFormat::of_template(source),
        })
    }

    /// The template's Jinja source as given.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Whether the template writes `<think>`: its model then thinks in `<think>…</think>` and
    /// the output goes through the reasoning parser.
    pub fn marks_thinking(&self) -> bool {
        self.marks_thinking
    }

    /// How the template's model writes tool calls.
    pub fn tool_call_format(&self) -> ToolCallFormat {
        self.tool_call_format
    }

    /// Renders the prompt. `TextError::Template` carries `raise_exception`'s message as is.
    pub fn render(&self, input: &TemplateInput<'_>) -> Result<String, TextError> {
        let tmpl = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(template_error)?;
        let mut vars: Vec<(String, Value)> = input
            .kwargs
            .iter()
            .map(|(k, v)| (k.clone(), Value::from(Serde(v))))
            .collect();
        let messages: Vec<MessageView<'_>> = input
            .messages
            .iter()
            .map(|m| MessageView::new(m, self.tool_call_format))
            .collect();
        let fixed = [
            ("messages", Value::from(Serde(&messages))),
            (
                "tools",
                input
                    .tools
                    .map_or(Value::from(()), |t| Value::from(Serde(t))),
            ),
            (
                "documents",
                input
                    .documents
                    .map_or(Value::from(()), |d| Value::from(Serde(d))),
            ),
            (
                "add_generation_prompt",
                Value::from(input.add_generation_prompt && !input.continue_final_message),
            ),
        ];
        vars.extend(fixed.into_iter().map(|(k, v)| (k.to_string(), v)));
        if let Some(effort) = input.reasoning_effort {
            vars.push(("reasoning_effort".to_string(), Value::from(effort)));
        }
        // The template's own special tokens, unless kwargs override them.
        for (key, token) in [
            ("bos_token", &self.bos_token),
            ("eos_token", &self.eos_token),
        ] {
            if let Some(token) = token {
                if !input.kwargs.contains_key(key) {
                    vars.push((key.to_string(), Value::from(token.as_str())));
                }
            }
        }
        let rendered = tmpl
            .render(Value::from_pairs(vars))
            .map_err(template_error)?;
        if !input.continue_final_message {
            return Ok(rendered);
        }
        let last = input
            .messages
            .last()
            .ok_or_else(|| TextError::Template("continue_final_message without messages".into()))?;
        let content = match &last.content {
            Some(MessageContent::Text(s)) => s.as_str(),
            Some(MessageContent::Parts(parts)) => match parts.last() {
                Some(ContentPart::Text { text }) => text.as_str(),
                None => "",
            },
            None => "",
        };
        cut_after_final_message(rendered, content)
    }
}

/// vLLM's `continue_final_message`: cut the render right after the last occurrence of the
/// final message's content (as is, else trimmed, since templates often trim it).
fn cut_after_final_message(mut rendered: String, content: &str) -> Result<String, TextError> {
    for needle in [content, content.trim()] {
        if needle.is_empty() {
            continue;
        }
        if let Some(i) = rendered.rfind(needle) {
            rendered.truncate(i + needle.len());
            return Ok(rendered);
        }
    }
    if content.trim().is_empty() {
        // Nothing to find: the message is open wherever the template left it.
        return Ok(rendered);
    }
    Err(TextError::Template(
        "continue_final_message is set but the final message does not appear in the rendered chat"
            .to_string(),
    ))
}

/// Templates written for transformers may mark assistant text with `{% generation %}` blocks
/// (a transformers-only Jinja extension). They change nothing in the output, so they become
/// `{% if true %}` blocks, keeping their whitespace-control markers.
fn neutralize_generation_tags(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(i) = rest.find("{%") {
        out.push_str(&rest[..i]);
        let tag = &rest[i..];
        let Some(end) = tag.find("%}") else {
            out.push_str(tag);
            return out;
        };
        let inner = &tag[2..end];
        let (lead, body) = match inner.strip_prefix(['-', '+']) {
            Some(b) => (&inner[..1], b),
            None => ("", inner),
        };
        let (body, trail) = match body.strip_suffix(['-', '+']) {
            Some(b) => (b, &body[b.len()..]),
            None => (body, ""),
        };
        let replacement = match body.trim() {
            "generation" => Some("if true"),
            "endgeneration" => Some("endif"),
            _ => None,
        };
        match replacement {
            Some(r) => {
                out.push_str("{%");
                out.push_str(lead);
                out.push(' ');
                out.push_str(r);
                out.push(' ');
                out.push_str(trail);
                out.push_str("%}");
            }
            None => out.push_str(&tag[..end + 2]),
        }
        rest = &tag[end + 2..];
    }
    out.push_str(rest);
    out
}

/// The content a template sees for an assistant's tool-call message sent with `content: null`
/// (as OpenAI clients send it): an empty string, as vLLM gives it. Templates that test the
/// content as a string (Qwen 3's) refuse a null one.
static EMPTY_CONTENT: MessageContent = MessageContent::Text(String::new());

/// A message as the template receives it: tool-call arguments parsed into a dict (as vLLM
/// does, since templates index into them or pass them to `tojson`), call ids as the template's
/// format takes them (`tool_calls::template_call_id`).
#[derive(Serialize)]
struct MessageView<'a> {
    role: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    content: Option<&'a MessageContent>,
    #[serde(skip_serializing_if = "Option::is_none")]
    name: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_calls: Option<Vec<ToolCallView<'a>>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_call_id: Option<Cow<'a, str>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    reasoning: Option<&'a str>,
    /// The same under the name templates read it by (Qwen 3's), as vLLM gives both.
    #[serde(skip_serializing_if = "Option::is_none")]
    reasoning_content: Option<&'a str>,
}

#[derive(Serialize)]
struct ToolCallView<'a> {
    id: Cow<'a, str>,
    r#type: &'a str,
    function: FunctionView<'a>,
}

#[derive(Serialize)]
struct FunctionView<'a> {
    name: &'a str,
    arguments: Value,
}

impl<'a> MessageView<'a> {
    fn new(m: &'a ChatMessage, format: ToolCallFormat) -> Self {
        MessageView {
            role: &m.role,
            content: match (&m.content, &m.tool_calls) {
                (None, Some(_)) => Some(&EMPTY_CONTENT),
                (content, _) => content.as_ref(),
            },
            name: m.name.as_deref(),
            tool_calls: m.tool_calls.as_ref().map(|calls| {
                calls
                    .iter()
                    .map(|c| ToolCallView {
                        id: template_call_id(format, &c.id),
                        r#type: &c.r#type,
                        function: FunctionView {
                            name: &c.function.name,
                            arguments: parse_arguments(&c.function.arguments),
                        },
                    })
                    .collect()
            }),
            tool_call_id: m
                .tool_call_id
                .as_deref()
                .map(|id| template_call_id(format, id)),
            reasoning: m.reasoning.as_deref(),
            reasoning_content: m.reasoning.as_deref(),
        }
    }
}

/// Arguments JSON text as a template value: an empty string is `{}`, text that is not valid
/// JSON stays a string.
fn parse_arguments(args: &str) -> Value {
    if args.trim().is_empty() {
        return Value::from_pairs(std::iter::empty::<(String, Value)>());
    }
    serde_json::from_str::<Value>(args).unwrap_or_else(|_| Value::from(args))
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const WEEKDAYS: [&str; 7] = [
    "Sunday",
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
];

/// C `strftime` in UTC for the common conversions; unknown ones are kept as written.
pub(crate) fn strftime(format: &str, unix_secs: i64) -> String {
    let days = unix_secs.div_euclid(86_400);
    let secs = unix_secs.rem_euclid(86_400);
    let (hour, minute, second) = (secs / 3600, secs / 60 % 60, secs % 60);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy_mar = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy_mar + 2) / 153;
    let day = doy_mar - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    const CUM: [i64; 12] = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = CUM[(month - 1) as usize] + day + i64::from(leap && month > 2);
    let wday = (days + 4).rem_euclid(7) as usize;
    let month_name = MONTHS[(month - 1) as usize];
    let hour12 = if hour % 12 == 0 { 12 } else { hour % 12 };

    let mut out = String::with_capacity(format.len() + 16);
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let Some(spec) = chars.next() else {
            out.push('%');
            break;
        };
        let piece = match spec {
            'Y' => year.to_string(),
            'y' => format!("{:02}", year.rem_euclid(100)),
            'm' => format!("{month:02}"),
            'd' => format!("{day:02}"),
            'e' => format!("{day:>2}"),
            'H' => format!("{hour:02}"),
            'I' => format!("{hour12:02}"),
            'M' => format!("{minute:02}"),
            'S' => format!("{second:02}"),
            'p' => (if hour < 12 { "AM" } else { "PM" }).to_string(),
            'B' => month_name.to_string(),
            'b' | 'h' => month_name[..3].to_string(),
            'A' => WEEKDAYS[wday].to_string(),
            'a' => WEEKDAYS[wday][..3].to_string(),
            'j' => format!("{yday:03}"),
            'u' => (if wday == 0 { 7 } else { wday }).to_string(),
            'w' => wday.to_string(),
            'F' => format!("{year}-{month:02}-{day:02}"),
            'T' => format!("{hour:02}:{minute:02}:{second:02}"),
            'D' => format!("{month:02}/{day:02}/{:02}", year.rem_euclid(100)),
            'Z' => "UTC".to_string(),
            'z' => "+0000".to_string(),
            '%' => "%".to_string(),
            other => format!("%{other}"),
        };
        out.push_str(&piece);
    }
    out
}
