//! JSON body extraction with errors in the envelope: a syntax error is a 400 without `param`, a
//! wrong field type a 400 naming the field's path, an oversized body a 413.

use axum::body::Bytes;
use axum::extract::{FromRequest, FromRequestParts, Query, Request};
use axum::http::request::Parts;
use axum::http::{header, HeaderMap};
use serde::de::DeserializeOwned;

use crate::error::ApiError;
use crate::state::AppState;

pub struct ValidJson<T>(pub T);

/// The body limit a route group sets (with axum's `DefaultBodyLimit`), so a 413 names it;
/// without it the server-wide `max_body_bytes` applies.
#[derive(Debug, Clone, Copy)]
pub struct BodyLimit(pub usize);

impl<T: DeserializeOwned> FromRequest<AppState> for ValidJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &AppState) -> Result<Self, ApiError> {
        let JsonBody(bytes) = JsonBody::from_request(req, state).await?;
        parse_json(&bytes).map(ValidJson)
    }
}

/// A JSON body's bytes, unparsed (for a handler that keeps the body as posted): the content
/// type and the size are checked.
pub struct JsonBody(pub Bytes);

impl FromRequest<AppState> for JsonBody {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &AppState) -> Result<Self, ApiError> {
        if !is_json(req.headers()) {
            return Err(ApiError::bad_body(
                "Expected a JSON body with `Content-Type: application/json`.",
            ));
        }
        let limit = req
            .extensions()
            .get::<BodyLimit>()
            .map_or(state.options().max_body_bytes, |l| l.0);
        let bytes = Bytes::from_request(req, state).await.map_err(|e| {
            if e.status() == axum::http::StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::RequestTooLarge(limit)
            } else {
                ApiError::bad_body(e.body_text())
            }
        })?;
        Ok(JsonBody(bytes))
    }
}

/// A query string with errors in the envelope (an unknown or repeated parameter is a 400).
pub struct ValidQuery<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequestParts<S> for ValidQuery<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, ApiError> {
        Query::<T>::try_from_uri(&parts.uri)
            .map(|Query(q)| ValidQuery(q))
            .map_err(|e| ApiError::bad_body(format!("Invalid query string: {}", e.body_text())))
    }
}

fn is_json(headers: &HeaderMap) -> bool {
    let Some(ct) = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
    else {
        return false;
    };
    let essence = ct
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    essence == "application/json"
        || (essence.starts_with("application/") && essence.ends_with("+json"))
}

pub fn parse_json<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let value = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        match inner.classify() {
            serde_json::error::Category::Data => {
                let param = if path == "." {
                    missing_field(&inner.to_string())
                } else {
                    Some(path)
                };
                ApiError::BadRequest {
                    message: format!("Invalid request body: {inner}"),
                    param,
                }
            }
            _ => ApiError::bad_body(format!("The body is not valid JSON: {inner}")),
        }
    })?;
    de.end()
        .map_err(|e| ApiError::bad_body(format!("The body is not valid JSON: {e}")))?;
    Ok(value)
}

/// serde reports a missing field at the parent's path; the field itself is the useful `param`.
fn missing_field(message: &str) -> Option<String> {
    let rest = message.strip_prefix("missing field `")?;
    Some(rest[..rest.find('`')?].to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::ChatCompletionRequest;

    fn err(body: &str) -> ApiError {
        match parse_json::<ChatCompletionRequest>(body.as_bytes()) {
            Err(e) => e,
            Ok(_) => panic!("{body} parsed"),
        }
    }

    fn param(e: &ApiError) -> Option<String> {
        serde_json::to_value(e.envelope()).unwrap()["error"]["param"]
            .as_str()
            .map(str::to_owned)
    }

    #[test]
    fn syntax_error_has_no_param() {
        let e = err("{\"messages\": [");
        assert_eq!(e.status().as_u16(), 400);
        assert_eq!(param(&e), None);
        let e = err("{\"messages\": []} trailing");
        assert_eq!(param(&e), None);
    }

    #[test]
    fn wrong_type_names_field_path() {
        let e = err(r#"{"messages": [], "temperature": "hot"}"#);
        assert_eq!(param(&e).as_deref(), Some("temperature"));
        let e = err(r#"{"messages": [{"role": "user", "content": 5}]}"#);
        assert_eq!(param(&e).as_deref(), Some("messages[0].content"));
    }

    #[test]
    fn seed_outside_int64_is_rejected() {
        let e = err(r#"{"messages": [], "seed": 9223372036854775808}"#);
        assert_eq!(param(&e).as_deref(), Some("seed"));
    }

    #[test]
    fn missing_messages_names_it() {
        let e = err(r#"{"model": "m"}"#);
        assert_eq!(param(&e).as_deref(), Some("messages"));
    }

    #[test]
    fn unknown_fields_are_ignored() {
        let r: ChatCompletionRequest =
            parse_json(br#"{"messages": [], "vendor_extra": {"a": 1}}"#).unwrap();
        assert!(r.messages.is_empty());
    }

    #[test]
    fn content_type_check() {
        let mut h = HeaderMap::new();
        assert!(!is_json(&h));
        h.insert(
            header::CONTENT_TYPE,
            "application/json; charset=utf-8".parse().unwrap(),
        );
        assert!(is_json(&h));
        h.insert(header::CONTENT_TYPE, "text/plain".parse().unwrap());
        assert!(!is_json(&h));
        h.insert(
            header::CONTENT_TYPE,
            "application/vnd.api+json".parse().unwrap(),
        );
        assert!(is_json(&h));
    }
}
