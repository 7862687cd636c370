//! The prompt- and response-side fields of a chat completion beyond sampling: tools, documents,
//! reasoning, echo, truncation, and the fields that only extensions act on (`cache_salt`,
//! `kv_transfer_params`, `engine_xargs`, `service_tier`, …). `validation` calls these checks as
//! part of its one step; nothing downstream re-checks.

use serde_json::{json, Value};
use temper_engine::OutputConstraint;
use temper_text::tool_calls::{FunctionSchema, ToolCallFormat, ToolCallParser};
use temper_text::{ChatMessage, ToolDef};

use crate::error::ApiError;
use crate::protocol::{JsonObject, ServiceTier};
use crate::structured::RequestedConstraint;

/// `reasoning_effort`, handed to the chat template as its string.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReasoningEffort {
    Low,
    Medium,
    High,
}

impl ReasoningEffort {
    pub fn as_str(self) -> &'static str {
        match self {
            ReasoningEffort::Low => "low",
            ReasoningEffort::Medium => "medium",
            ReasoningEffort::High => "high",
        }
    }
}

/// Fields no built-in code acts on; a `RequestHook` sees them.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RequestExtras {
    /// Will key the prefix cache; there is no prefix cache yet, so today it has no other effect.
    pub cache_salt: Option<String>,
    pub kv_transfer_params: Option<JsonObject>,
    /// Values are strings, numbers or lists of them (checked).
    pub engine_xargs: JsonObject,
    pub service_tier: Option<ServiceTier>,
    pub parallel_tool_calls: bool,
}

pub fn tools(tools: Option<Vec<Value>>) -> Result<Option<Vec<ToolDef>>, ApiError> {
    let Some(tools) = tools else { return Ok(None) };
    if tools.is_empty() {
        return Err(ApiError::bad(
            "tools",
            "`tools` must not be empty: omit it when there are no tools.",
        ));
    }
    tools
        .into_iter()
        .enumerate()
        .map(|(i, t)| {
            let def: ToolDef = serde_json::from_value(t).map_err(|e| {
                ApiError::bad(
                    format!("tools[{i}]"),
                    format!("A tool is `{{type: \"function\", function: {{name, description?, parameters?, strict?}}}}`: {e}."),
                )
            })?;
            if def.r#type != "function" {
                return Err(ApiError::bad(
                    format!("tools[{i}].type"),
                    "The only tool type is \"function\".",
                ));
            }
            if def.function.name.is_empty() {
                return Err(ApiError::bad(
                    format!("tools[{i}].function.name"),
                    "A function needs a non-empty `name`.",
                ));
            }
            if def.function.parameters.as_ref().is_some_and(|p| !p.is_object()) {
                return Err(ApiError::bad(
                    format!("tools[{i}].function.parameters"),
                    "`parameters` must be a JSON Schema object.",
                ));
            }
            Ok(def)
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Some)
}

/// What `tool_choice` makes of the output: the parser that finds calls in it (auto, required,
/// a named function) and, for required and named choices, the constraint to calls.
#[derive(Debug, Default)]
pub struct ToolCalling {
    pub parser: Option<ToolCallParser>,
    pub constraint: Option<RequestedConstraint>,
}

/// `tool_choice` against the request's validated `tools`. "none" (also the default without
/// the server flag) leaves the output alone; the tools still reach the template, as in vLLM.
/// The other forms need `format` (`--enable-tool-calls`: the format the model's template asks
/// for), as vLLM's need `--enable-auto-tool-choice`; with it, a request with tools and no
/// `tool_choice` is "auto".
pub fn tool_choice(
    choice: Option<Value>,
    tools: Option<&[ToolDef]>,
    parallel: bool,
    format: Option<ToolCallFormat>,
) -> Result<ToolCalling, ApiError> {
    let choice = match choice {
        None | Some(Value::Null) if format.is_some() && tools.is_some() => Value::from("auto"),
        None | Some(Value::Null) => return Ok(ToolCalling::default()),
        Some(c) => c,
    };
    if choice.as_str() == Some("none") {
        return Ok(ToolCalling::default());
    }
    let Some(format) = format else {
        return Err(ApiError::bad(
            "tool_choice",
            "The only supported `tool_choice` is \"none\": \"auto\", \"required\" and named \
             functions need the server to be started with --enable-tool-calls.",
        ));
    };
    let tools = match choice.as_str() {
        Some("auto" | "required") | None => tools.ok_or_else(|| {
            ApiError::bad(
                "tool_choice",
                "`tool_choice` other than \"none\" needs `tools`.",
            )
        })?,
        Some(other) => {
            return Err(ApiError::bad(
                "tool_choice",
                format!(
                    "`tool_choice` must be \"none\", \"auto\", \"required\" or \
                     {{\"type\": \"function\", \"function\": {{\"name\": …}}}}, got {other:?}."
                ),
            ))
        }
    };
    // The functions calls may use: all of them, or the named one.
    let callable: Vec<&ToolDef> = match &choice {
        Value::String(_) => tools.iter().collect(),
        named => {
            let name = named
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .filter(|_| named.get("type").and_then(Value::as_str) == Some("function"))
                .ok_or_else(|| {
                    ApiError::bad(
                        "tool_choice",
                        "A named `tool_choice` is {\"type\": \"function\", \"function\": \
                         {\"name\": …}}.",
                    )
                })?;
            let tool = tools
                .iter()
                .find(|t| t.function.name == name)
                .ok_or_else(|| {
                    ApiError::bad(
                        "tool_choice",
                        format!(
                            "`tool_choice` names the function {name:?}, which is not in `tools`."
                        ),
                    )
                })?;
            vec![tool]
        }
    };
    let names = callable.iter().map(|t| t.function.name.clone()).collect();
    let max_calls = if parallel { usize::MAX } else { 1 };
    let constraint = (choice.as_str() != Some("auto")).then(|| RequestedConstraint {
        param: "tools",
        constraint: OutputConstraint::ToolCalls {
            format,
            functions: callable
                .iter()
                .map(|t| FunctionSchema {
                    name: t.function.name.clone(),
                    // OpenAI: leaving `parameters` out declares a function without arguments.
                    parameters: t.function.parameters.clone().unwrap_or_else(
                        || json!({"type": "object", "properties": {}, "additionalProperties": false}),
                    ),
                })
                .collect(),
            parallel,
        },
    });
    Ok(ToolCalling {
        parser: Some(ToolCallParser::new(format, names, max_calls)),
        constraint,
    })
}

/// vLLM types documents as string-to-string maps (`title`, `text`, …).
pub fn documents(docs: Option<Vec<JsonObject>>) -> Result<Option<Vec<JsonObject>>, ApiError> {
    if let Some(docs) = &docs {
        for (i, doc) in docs.iter().enumerate() {
            if let Some((key, _)) = doc.iter().find(|(_, v)| !v.is_string()) {
                return Err(ApiError::bad(
                    format!("documents[{i}].{key}"),
                    "Document fields (`title`, `text`, …) must be strings.",
                ));
            }
        }
    }
    Ok(docs)
}

pub fn reasoning_effort(effort: Option<String>) -> Result<Option<ReasoningEffort>, ApiError> {
    effort
        .map(|e| match e.as_str() {
            "low" => Ok(ReasoningEffort::Low),
            "medium" => Ok(ReasoningEffort::Medium),
            "high" => Ok(ReasoningEffort::High),
            other => Err(ApiError::bad(
                "reasoning_effort",
                format!("`reasoning_effort` must be low, medium or high, got {other:?}."),
            )),
        })
        .transpose()
}

pub fn service_tier(tier: Option<String>) -> Result<Option<ServiceTier>, ApiError> {
    tier.map(|t| match t.as_str() {
        "auto" => Ok(ServiceTier::Auto),
        "default" => Ok(ServiceTier::Default),
        "flex" => Ok(ServiceTier::Flex),
        "scale" => Ok(ServiceTier::Scale),
        "priority" => Ok(ServiceTier::Priority),
        other => Err(ApiError::bad(
            "service_tier",
            format!(
                "`service_tier` must be auto, default, flex, scale or priority, got {other:?}."
            ),
        )),
    })
    .transpose()
}

/// Number of last prompt tokens to keep: -1 = the context length. 0 would leave nothing to
/// continue from, so it is refused like values above the context.
pub fn truncate_prompt_tokens(
    k: Option<i64>,
    max_model_len: usize,
) -> Result<Option<usize>, ApiError> {
    match k {
        None => Ok(None),
        Some(-1) => Ok(Some(max_model_len)),
        Some(k) if k >= 1 && k as u64 <= max_model_len as u64 => Ok(Some(k as usize)),
        Some(k) => Err(ApiError::bad(
            "truncate_prompt_tokens",
            format!(
                "`truncate_prompt_tokens` must be -1 (the context length) or in [1, \
                 {max_model_len}], got {k}."
            ),
        )),
    }
}

/// The served models are text-only: multimodal processor options cannot apply.
pub fn mm_processor_kwargs(kwargs: Option<&JsonObject>) -> Result<(), ApiError> {
    match kwargs {
        Some(k) if !k.is_empty() => Err(ApiError::bad(
            "mm_processor_kwargs",
            "`mm_processor_kwargs` has no effect on a text-only model: omit it or send {}.",
        )),
        _ => Ok(()),
    }
}

pub fn cache_salt(salt: Option<String>) -> Result<Option<String>, ApiError> {
    if salt.as_deref() == Some("") {
        return Err(ApiError::bad(
            "cache_salt",
            "`cache_salt` must not be empty.",
        ));
    }
    Ok(salt)
}

/// Each value a string, a number, or a list of strings and numbers.
pub fn engine_xargs(xargs: Option<JsonObject>) -> Result<JsonObject, ApiError> {
    let xargs = xargs.unwrap_or_default();
    let scalar = |v: &Value| v.is_string() || v.is_number();
    for (key, value) in &xargs {
        let ok = scalar(value) || value.as_array().is_some_and(|a| a.iter().all(scalar));
        if !ok {
            return Err(ApiError::bad(
                format!("engine_xargs.{key}"),
                "`engine_xargs` values must be strings, numbers or lists of them.",
            ));
        }
    }
    Ok(xargs)
}

/// `echo`: the text to put in front of every choice's content: the last message's, when it has
/// the response's role (a prefill being continued).
pub fn echo(echo: Option<bool>, messages: &[ChatMessage]) -> Option<String> {
    if !echo.unwrap_or(false) {
        return None;
    }
    messages.last().filter(|m| m.role == "assistant").map(|m| {
        m.content
            .as_ref()
            .map(|c| c.text().into_owned())
            .unwrap_or_default()
    })
}
