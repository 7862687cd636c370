//! `response_format` and `structured_outputs`: their wire shapes, the rules that combine them
//! (at most one kind of constraint), and the typed `OutputConstraint` the engine compiles.

use serde::Deserialize;
use serde_json::Value;
use temper_engine::{Engine, Grammar, JsonOptions, OutputConstraint, TagStructure};

use crate::error::ApiError;
use crate::protocol::{ResponseFormat, StructuredOutputs, TagStructureField};

/// The one structured-output constraint a request asks for, validated in shape but not yet
/// compiled, with the parameter a compile error is reported against.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestedConstraint {
    pub param: &'static str,
    pub constraint: OutputConstraint,
}

/// The structural tag payload of `structured_outputs.structural_tag`.
#[derive(Debug, Deserialize)]
struct StructuralTagSpec {
    r#type: Option<String>,
    structures: Vec<TagStructureField>,
    triggers: Vec<String>,
}

/// Compiles the request's constraint for `engine`'s model on a blocking thread: building the
/// model's compiler (first use) and compiling a schema take from milliseconds to over a second,
/// which must not hold up the async workers serving other requests. A bad schema, regex or
/// grammar is a 400 naming the parameter it came from.
pub async fn compile_constraint(
    engine: &Engine,
    requested: Option<RequestedConstraint>,
) -> Result<Option<Grammar>, ApiError> {
    let Some(RequestedConstraint { param, constraint }) = requested else {
        return Ok(None);
    };
    let engine = engine.clone();
    tokio::task::spawn_blocking(move || engine.compile_grammar(&constraint))
        .await
        .map_err(|e| ApiError::Internal(format!("Compiling the structured output failed: {e}")))?
        .map(Some)
        .map_err(|e| ApiError::bad(param, e.to_string()))
}

/// Validates both fields: the one constraint they ask for (or none).
pub fn requested_constraint(
    response_format: Option<ResponseFormat>,
    structured: Option<StructuredOutputs>,
) -> Result<Option<RequestedConstraint>, ApiError> {
    Ok(output_constraint(response_format, structured)?
        .map(|(param, constraint)| RequestedConstraint { param, constraint }))
}

/// The requested constraint and the parameter an error in it is reported against.
fn output_constraint(
    response_format: Option<ResponseFormat>,
    structured: Option<StructuredOutputs>,
) -> Result<Option<(&'static str, OutputConstraint)>, ApiError> {
    let so = structured.unwrap_or_default();
    if let Some(b) = so.backend.as_deref() {
        if !matches!(b, "auto" | "guidance") {
            return Err(ApiError::bad(
                "structured_outputs._backend",
                format!(
                    "Unknown structured output backend `{b}`: this server has `guidance` only."
                ),
            ));
        }
    }
    let options = JsonOptions {
        disable_any_whitespace: so.disable_any_whitespace.unwrap_or(false),
        disable_additional_properties: so.disable_additional_properties.unwrap_or(false),
        whitespace_pattern: so.whitespace_pattern.clone(),
    };

    // Each kind asked for, in the order of the interface; at most one is allowed.
    let mut kinds: Vec<(&'static str, OutputConstraint)> = Vec::new();
    if let Some(rf) = response_format {
        if let Some(k) = response_format_kind(rf, &options)? {
            kinds.push(k);
        }
    }
    if let Some(json) = so.json {
        let schema = match json {
            Value::String(s) => serde_json::from_str(&s).map_err(|e| {
                ApiError::bad(
                    "structured_outputs.json",
                    format!("`json` is not a JSON schema: {e}"),
                )
            })?,
            other => other,
        };
        kinds.push((
            "structured_outputs.json",
            OutputConstraint::Json {
                schema,
                options: options.clone(),
            },
        ));
    }
    if let Some(rx) = so.regex {
        kinds.push(("structured_outputs.regex", OutputConstraint::Regex(rx)));
    }
    if let Some(choice) = so.choice {
        if choice.is_empty() {
            return Err(ApiError::bad(
                "structured_outputs.choice",
                "`choice` must list at least one string.",
            ));
        }
        kinds.push((
            "structured_outputs.choice",
            OutputConstraint::Choice(choice),
        ));
    }
    if let Some(grammar) = so.grammar {
        kinds.push((
            "structured_outputs.grammar",
            OutputConstraint::Grammar(grammar),
        ));
    }
    if so.json_object == Some(true) {
        kinds.push(("structured_outputs.json_object", json_object(&options)));
    }
    if let Some(tag) = so.structural_tag {
        let spec: StructuralTagSpec = serde_json::from_str(&tag).map_err(|e| {
            ApiError::bad(
                "structured_outputs.structural_tag",
                format!(
                    "`structural_tag` must be a JSON object with `structures` and `triggers`: {e}"
                ),
            )
        })?;
        if spec
            .r#type
            .as_deref()
            .is_some_and(|t| t != "structural_tag")
        {
            return Err(ApiError::bad(
                "structured_outputs.structural_tag",
                "`structural_tag.type` must be \"structural_tag\".",
            ));
        }
        kinds.push((
            "structured_outputs.structural_tag",
            structural_tag(spec.structures, spec.triggers, &options),
        ));
    }

    if kinds.len() > 1 {
        let names: Vec<&str> = kinds.iter().map(|(p, _)| *p).collect();
        return Err(ApiError::bad(
            "structured_outputs",
            format!(
                "Only one kind of structured output can be requested at a time, got {}.",
                names.join(", ")
            ),
        ));
    }
    let kind = kinds.pop();
    let json_kind = matches!(
        kind,
        Some((
            _,
            OutputConstraint::Json { .. } | OutputConstraint::StructuralTag { .. }
        ))
    );
    // The JSON options change JSON grammars only; anywhere else they would be ignored.
    for (set, param) in [
        (
            so.disable_any_whitespace.is_some_and(|b| b),
            "structured_outputs.disable_any_whitespace",
        ),
        (
            so.disable_additional_properties.is_some_and(|b| b),
            "structured_outputs.disable_additional_properties",
        ),
        (
            so.whitespace_pattern.is_some(),
            "structured_outputs.whitespace_pattern",
        ),
    ] {
        if set && !json_kind {
            return Err(ApiError::bad(
                param,
                "This option shapes JSON output: it needs a JSON schema, json_object or \
                 structural_tag constraint.",
            ));
        }
    }
    Ok(kind)
}

fn json_object(options: &JsonOptions) -> OutputConstraint {
    OutputConstraint::Json {
        schema: serde_json::json!({"type": "object"}),
        options: options.clone(),
    }
}

fn structural_tag(
    structures: Vec<TagStructureField>,
    triggers: Vec<String>,
    options: &JsonOptions,
) -> OutputConstraint {
    OutputConstraint::StructuralTag {
        triggers,
        structures: structures
            .into_iter()
            .map(|s| TagStructure {
                begin: s.begin,
                schema: s.schema,
                end: s.end,
            })
            .collect(),
        options: options.clone(),
    }
}

fn response_format_kind(
    rf: ResponseFormat,
    options: &JsonOptions,
) -> Result<Option<(&'static str, OutputConstraint)>, ApiError> {
    match rf.r#type.as_str() {
        "text" => Ok(None),
        "json_object" => Ok(Some(("response_format", json_object(options)))),
        "json_schema" => {
            let Some(js) = rf.json_schema else {
                return Err(ApiError::bad(
                    "response_format.json_schema",
                    "`response_format` of type `json_schema` needs `json_schema`.",
                ));
            };
            let Some(schema) = js.schema else {
                return Err(ApiError::bad(
                    "response_format.json_schema.schema",
                    "`json_schema` needs a `schema`.",
                ));
            };
            Ok(Some((
                "response_format.json_schema.schema",
                OutputConstraint::Json {
                    schema,
                    options: options.clone(),
                },
            )))
        }
        "structural_tag" => {
            let (Some(structures), Some(triggers)) = (rf.structures, rf.triggers) else {
                return Err(ApiError::bad(
                    "response_format",
                    "`response_format` of type `structural_tag` needs `structures` and `triggers`.",
                ));
            };
            Ok(Some((
                "response_format",
                structural_tag(structures, triggers, options),
            )))
        }
        other => Err(ApiError::bad(
            "response_format.type",
            format!(
                "Unknown `response_format` type `{other}`: one of text, json_object, json_schema, \
                 structural_tag."
            ),
        )),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn kind(rf: Value, so: Value) -> Result<Option<(&'static str, OutputConstraint)>, String> {
        let rf: Option<ResponseFormat> = serde_json::from_value(rf).unwrap();
        let so: Option<StructuredOutputs> = serde_json::from_value(so).unwrap();
        output_constraint(rf, so).map_err(|e| {
            serde_json::to_value(e.envelope()).unwrap()["error"]["param"]
                .as_str()
                .unwrap()
                .to_owned()
        })
    }

    #[test]
    fn each_kind_maps_to_its_constraint() {
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        let (p, c) = kind(
            json!({"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": true}}),
            json!({"disable_any_whitespace": true}),
        )
        .unwrap()
        .unwrap();
        assert_eq!(p, "response_format.json_schema.schema");
        assert_eq!(
            c,
            OutputConstraint::Json {
                schema: schema.clone(),
                options: JsonOptions {
                    disable_any_whitespace: true,
                    ..JsonOptions::default()
                }
            }
        );
        // `json` as a string or an object.
        for json in [json!(schema.to_string()), schema.clone()] {
            let (_, c) = kind(Value::Null, json!({"json": json})).unwrap().unwrap();
            assert!(matches!(c, OutputConstraint::Json { schema: s, .. } if s == schema));
        }
        let (_, c) = kind(json!({"type": "json_object"}), Value::Null)
            .unwrap()
            .unwrap();
        assert!(
            matches!(c, OutputConstraint::Json { schema: s, .. } if s == json!({"type": "object"}))
        );
        let (_, c) = kind(Value::Null, json!({"json_object": true}))
            .unwrap()
            .unwrap();
        assert!(matches!(c, OutputConstraint::Json { .. }));
        let (_, c) = kind(Value::Null, json!({"regex": "a+"})).unwrap().unwrap();
        assert_eq!(c, OutputConstraint::Regex("a+".into()));
        let (_, c) = kind(Value::Null, json!({"choice": ["a", "b"]}))
            .unwrap()
            .unwrap();
        assert_eq!(c, OutputConstraint::Choice(vec!["a".into(), "b".into()]));
        let (_, c) = kind(Value::Null, json!({"grammar": "start: \"x\""}))
            .unwrap()
            .unwrap();
        assert_eq!(c, OutputConstraint::Grammar("start: \"x\"".into()));
        let tag = json!({"type": "structural_tag", "triggers": ["<f="],
            "structures": [{"begin": "<f=a>", "schema": {"type": "integer"}, "end": "</f>"}]});
        let (_, c) = kind(Value::Null, json!({"structural_tag": tag.to_string()}))
            .unwrap()
            .unwrap();
        assert!(
            matches!(c, OutputConstraint::StructuralTag { triggers, .. } if triggers == ["<f="])
        );
        // Nothing asked.
        assert!(kind(json!({"type": "text"}), json!({})).unwrap().is_none());
        assert!(kind(
            Value::Null,
            json!({"json_object": false, "disable_fallback": true})
        )
        .unwrap()
        .is_none());
    }

    #[test]
    fn invalid_combinations_name_the_field() {
        assert_eq!(
            kind(Value::Null, json!({"regex": "a", "choice": ["a"]})).unwrap_err(),
            "structured_outputs"
        );
        assert_eq!(
            kind(json!({"type": "json_object"}), json!({"json": "{}"})).unwrap_err(),
            "structured_outputs"
        );
        assert_eq!(
            kind(json!({"type": "json_schema"}), Value::Null).unwrap_err(),
            "response_format.json_schema"
        );
        assert_eq!(
            kind(
                json!({"type": "json_schema", "json_schema": {"name": "x"}}),
                Value::Null
            )
            .unwrap_err(),
            "response_format.json_schema.schema"
        );
        assert_eq!(
            kind(json!({"type": "xml"}), Value::Null).unwrap_err(),
            "response_format.type"
        );
        assert_eq!(
            kind(Value::Null, json!({"json": "{not json"})).unwrap_err(),
            "structured_outputs.json"
        );
        assert_eq!(
            kind(Value::Null, json!({"choice": []})).unwrap_err(),
            "structured_outputs.choice"
        );
        assert_eq!(
            kind(
                Value::Null,
                json!({"regex": "a", "disable_any_whitespace": true})
            )
            .unwrap_err(),
            "structured_outputs.disable_any_whitespace"
        );
        assert_eq!(
            kind(Value::Null, json!({"whitespace_pattern": " "})).unwrap_err(),
            "structured_outputs.whitespace_pattern"
        );
        assert_eq!(
            kind(Value::Null, json!({"regex": "a", "_backend": "xgrammar"})).unwrap_err(),
            "structured_outputs._backend"
        );
        assert_eq!(
            kind(Value::Null, json!({"structural_tag": "[]"})).unwrap_err(),
            "structured_outputs.structural_tag"
        );
    }
}
