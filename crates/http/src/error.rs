//! The one error type of the HTTP layer and its mapping to the OpenAI error envelope
//! `{"error": {"message", "type", "param", "code"}}`.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Serialize;

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// Malformed body, wrong field type, out-of-range value, invalid combination.
    #[error("{message}")]
    BadRequest {
        message: String,
        param: Option<String>,
    },
    #[error("{0}")]
    Unauthorized(String),
    #[error("The model `{0}` does not exist.")]
    ModelNotFound(String),
    #[error("{0}")]
    NotFound(String),
    /// A name that is taken, or a state change the resource's state forbids.
    #[error("{0}")]
    Conflict(String),
    /// An `Idempotency-Key` used with another body, or while its first request is handled.
    #[error("{0}")]
    IdempotencyConflict(String),
    #[error("Method {0} is not allowed on this path.")]
    MethodNotAllowed(String),
    #[error("The request body is larger than the limit of {0} bytes.")]
    RequestTooLarge(usize),
    #[error("{0}")]
    ServiceUnavailable(String),
    /// Overload: the model's waiting queue, or a team's share of the server, is full. Sent with
    /// `Retry-After`.
    #[error("{0}")]
    TooManyRequests(String),
    /// The team has used its monthly token quota: retrying does not help before the next
    /// month, so no `Retry-After`, and `x-should-retry: false` stops the OpenAI SDK's retries.
    #[error("{0}")]
    QuotaExceeded(String),
    /// A server fault. Its text (SQL, file paths, panics) goes to the log only: the client gets
    /// a fixed message and finds the log lines by the response's `x-request-id`.
    #[error("{0}")]
    Internal(String),
    /// The engine could not finish a generation (e.g. the sampling constraints left no token):
    /// its message describes the request, not the server, and is shown.
    #[error("{0}")]
    Generation(String),
}

/// When a client refused for overload should try again (the OpenAI SDK honours it).
const RETRY_AFTER_SECONDS: &str = "1";

/// What a client is told of an [`ApiError::Internal`].
pub const INTERNAL_MESSAGE: &str =
    "The server failed to handle the request; its log has the details under this response's \
     x-request-id.";

impl ApiError {
    /// A 400 naming the offending field.
    pub fn bad(param: impl Into<String>, message: impl Into<String>) -> Self {
        ApiError::BadRequest {
            message: message.into(),
            param: Some(param.into()),
        }
    }

    /// A 400 about the request as a whole (e.g. unparseable JSON).
    pub fn bad_body(message: impl Into<String>) -> Self {
        ApiError::BadRequest {
            message: message.into(),
            param: None,
        }
    }

    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::BadRequest { .. } => StatusCode::BAD_REQUEST,
            ApiError::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            ApiError::ModelNotFound(_) | ApiError::NotFound(_) => StatusCode::NOT_FOUND,
            ApiError::MethodNotAllowed(_) => StatusCode::METHOD_NOT_ALLOWED,
            ApiError::Conflict(_) | ApiError::IdempotencyConflict(_) => StatusCode::CONFLICT,
            ApiError::RequestTooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::ServiceUnavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::TooManyRequests(_) | ApiError::QuotaExceeded(_) => {
                StatusCode::TOO_MANY_REQUESTS
            }
            ApiError::Internal(_) | ApiError::Generation(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    fn kind(&self) -> &'static str {
        match self {
            ApiError::BadRequest { .. } => "BadRequestError",
            ApiError::Unauthorized(_) => "AuthenticationError",
            ApiError::ModelNotFound(_) | ApiError::NotFound(_) => "NotFoundError",
            ApiError::MethodNotAllowed(_) => "MethodNotAllowedError",
            ApiError::Conflict(_) | ApiError::IdempotencyConflict(_) => "ConflictError",
            ApiError::RequestTooLarge(_) => "RequestTooLargeError",
            ApiError::ServiceUnavailable(_) => "ServiceUnavailableError",
            ApiError::TooManyRequests(_) => "RateLimitError",
            ApiError::QuotaExceeded(_) => "QuotaExceededError",
            ApiError::Internal(_) | ApiError::Generation(_) => "InternalServerError",
        }
    }

    fn param(&self) -> Option<&str> {
        match self {
            ApiError::BadRequest { param, .. } => param.as_deref(),
            ApiError::ModelNotFound(_) => Some("model"),
            ApiError::IdempotencyConflict(_) => Some(crate::protocol::IDEMPOTENCY_KEY_HEADER),
            _ => None,
        }
    }

    /// The envelope, also used inside an SSE stream (`data: {"error": …}`).
    pub fn envelope(&self) -> ErrorEnvelope<'_> {
        ErrorEnvelope {
            error: ErrorBody {
                message: match self {
                    ApiError::Internal(_) => INTERNAL_MESSAGE.to_owned(),
                    e => e.to_string(),
                },
                r#type: self.kind(),
                param: self.param(),
                code: self.status().as_u16(),
            },
        }
    }
}

#[derive(Debug, Serialize)]
pub struct ErrorEnvelope<'a> {
    pub error: ErrorBody<'a>,
}

#[derive(Debug, Serialize)]
pub struct ErrorBody<'a> {
    pub message: String,
    pub r#type: &'static str,
    pub param: Option<&'a str>,
    pub code: u16,
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        if self.status().is_server_error() {
            tracing::error!(error = %self, "request failed");
        } else {
            tracing::info!(error = %self, status = self.status().as_u16(), "request rejected");
        }
        let mut response = (self.status(), axum::Json(self.envelope())).into_response();
        let headers = response.headers_mut();
        match self {
            ApiError::TooManyRequests(_) => {
                headers.insert(
                    header::RETRY_AFTER,
                    HeaderValue::from_static(RETRY_AFTER_SECONDS),
                );
            }
            ApiError::QuotaExceeded(_) => {
                headers.insert("x-should-retry", HeaderValue::from_static("false"));
            }
            _ => {}
        }
        response
    }
}

impl From<temper_engine::EngineError> for ApiError {
    fn from(e: temper_engine::EngineError) -> Self {
        use temper_engine::EngineError as E;
        match e {
            // Only a stopped scheduler is the server's fault; validation already rules out the
            // rest, so reaching them means a request the engine cannot serve.
            E::Stopped => {
                ApiError::ServiceUnavailable(format!("The engine cannot take requests: {e}."))
            }
            E::PromptTooLong { .. } => ApiError::bad("messages", e.to_string()),
            E::TooLong { .. } => ApiError::bad("max_completion_tokens", e.to_string()),
            E::MinTokensOverBudget { .. } => ApiError::bad("min_tokens", e.to_string()),
            E::BeamSearchConstraint => ApiError::bad("structured_outputs", e.to_string()),
            E::BeamTooWide { .. } => ApiError::bad("n", e.to_string()),
            E::AdapterMismatch => {
                ApiError::Internal(format!("The model's adapter is unusable: {e}."))
            }
            E::QueueFull { .. } => ApiError::TooManyRequests(format!(
                "The server is overloaded: {e}. Try again shortly."
            )),
            E::EmptyPrompt | E::NoChoices | E::NoTokens | E::TokenOutOfRange { .. } => {
                ApiError::bad_body(e.to_string())
            }
        }
    }
}

impl From<temper_store::Error> for ApiError {
    fn from(e: temper_store::Error) -> Self {
        use temper_store::Error as E;
        match e {
            // The store treats another team's rows as missing: the 404 leaks nothing.
            E::NotFound(what) => ApiError::NotFound(format!("The {what} does not exist.")),
            E::Invalid { field, reason } => {
                ApiError::bad(field, format!("Invalid `{field}`: {reason}."))
            }
            E::ModelExists { .. }
            | E::CheckpointExists { .. }
            | E::JobState { .. }
            | E::LeaseLost { .. }
            | E::ModelBusy { .. } => ApiError::Conflict(format!("{e}.")),
            E::TeamQueueFull { .. } => ApiError::TooManyRequests(format!(
                "Too many queued training jobs: {e}. Post again once one has started."
            )),
            E::DataDir { .. }
            | E::Locked { .. }
            | E::LockFile { .. }
            | E::Location(_)
            | E::Db(_)
            | E::Migrate(_)
            | E::Random(_)
            | E::Corrupt(_) => ApiError::Internal(format!("The store failed: {e}")),
        }
    }
}

impl From<temper_catalog::CatalogError> for ApiError {
    fn from(e: temper_catalog::CatalogError) -> Self {
        match e {
            temper_catalog::CatalogError::Store(e) => e.into(),
            temper_catalog::CatalogError::Adapter { .. } => ApiError::Internal(e.to_string()),
        }
    }
}

impl From<temper_train::service::ServiceError> for ApiError {
    fn from(e: temper_train::service::ServiceError) -> Self {
        use temper_train::service::ServiceError as E;
        match e {
            E::Store(e) => e.into(),
            E::Train(e) => e.into(),
            E::Invalid { param, message } => ApiError::bad(param, message),
            E::EntityNotFound(_) => ApiError::NotFound(e.to_string()),
            E::UnknownBaseModel(_) => ApiError::bad("base_model", e.to_string()),
            E::NoChatTemplate(_) => ApiError::bad("model_id", e.to_string()),
            E::BaseModelNotServed(_) => ApiError::ServiceUnavailable(e.to_string()),
            E::Conflict(message) => ApiError::Conflict(message),
            E::InvalidAdapter(ref file) => ApiError::bad(file.subject.clone(), e.to_string()),
            E::Internal(message) => ApiError::Internal(message),
        }
    }
}

impl From<temper_train::TrainError> for ApiError {
    fn from(e: temper_train::TrainError) -> Self {
        match e {
            temper_train::TrainError::Invalid { param, message } => {
                ApiError::bad(param.clone(), format!("Invalid `{param}`: {message}."))
            }
            e => ApiError::Internal(e.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn json(e: &ApiError) -> serde_json::Value {
        serde_json::to_value(e.envelope()).unwrap()
    }

    #[test]
    fn bad_request_names_param() {
        let v = json(&ApiError::bad("temperature", "too hot"));
        assert_eq!(
            v,
            serde_json::json!({"error": {"message": "too hot", "type": "BadRequestError", "param": "temperature", "code": 400}})
        );
    }

    #[test]
    fn every_variant_maps_status_type_and_code() {
        let cases = [
            (ApiError::bad_body("x"), 400, "BadRequestError", None),
            (
                ApiError::Unauthorized("k".into()),
                401,
                "AuthenticationError",
                None,
            ),
            (
                ApiError::ModelNotFound("m".into()),
                404,
                "NotFoundError",
                Some("model"),
            ),
            (ApiError::NotFound("r".into()), 404, "NotFoundError", None),
            (
                ApiError::MethodNotAllowed("PUT".into()),
                405,
                "MethodNotAllowedError",
                None,
            ),
            (ApiError::Conflict("c".into()), 409, "ConflictError", None),
            (
                ApiError::IdempotencyConflict("k".into()),
                409,
                "ConflictError",
                Some("Idempotency-Key"),
            ),
            (
                ApiError::RequestTooLarge(10),
                413,
                "RequestTooLargeError",
                None,
            ),
            (
                ApiError::ServiceUnavailable("s".into()),
                503,
                "ServiceUnavailableError",
                None,
            ),
            (
                ApiError::QuotaExceeded("q".into()),
                429,
                "QuotaExceededError",
                None,
            ),
            (
                ApiError::Internal("i".into()),
                500,
                "InternalServerError",
                None,
            ),
            (
                ApiError::Generation("g".into()),
                500,
                "InternalServerError",
                None,
            ),
        ];
        for (err, code, kind, param) in cases {
            assert_eq!(err.status().as_u16(), code);
            let v = json(&err);
            assert_eq!(v["error"]["code"], code);
            assert_eq!(v["error"]["type"], kind);
            assert_eq!(v["error"]["param"].as_str(), param);
            assert!(v["error"]["message"].is_string());
        }
    }

    #[test]
    fn internal_details_stay_in_the_log() {
        let v = json(&ApiError::Internal(
            "The store failed: database: error returned from database: (code: 1) no such table: \
             jobs at /var/lib/temper/temper.db"
                .into(),
        ));
        assert_eq!(v["error"]["message"], INTERNAL_MESSAGE);
        // A generation failure describes the request and is shown.
        let v = json(&ApiError::Generation("no token is left to sample".into()));
        assert_eq!(v["error"]["message"], "no token is left to sample");
    }

    #[test]
    fn a_full_queue_is_a_429_with_retry_after() {
        let e: ApiError = temper_engine::EngineError::QueueFull { max_waiting: 4 }.into();
        let v = json(&e);
        assert_eq!(v["error"]["code"], 429);
        assert_eq!(v["error"]["type"], "RateLimitError");
        assert!(v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("4 requests are already waiting"));
        let response = e.into_response();
        assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(response.headers()["retry-after"], "1");
    }

    #[test]
    fn context_errors_name_their_field() {
        use temper_engine::EngineError as E;
        let param = |e: E| json(&e.into())["error"]["param"].clone();
        let prompt = E::PromptTooLong {
            prompt_tokens: 100,
            max_model_len: 100,
        };
        assert_eq!(param(prompt), "messages");
        let too_long = E::TooLong {
            prompt_tokens: 90,
            max_tokens: 11,
            max_model_len: 100,
        };
        assert_eq!(param(too_long), "max_completion_tokens");
        let min = E::MinTokensOverBudget {
            min_tokens: 11,
            max_tokens: 10,
        };
        assert_eq!(param(min), "min_tokens");
    }

    #[test]
    fn unknown_model_message_is_exact() {
        let v = json(&ApiError::ModelNotFound("gpt-9".into()));
        assert_eq!(v["error"]["message"], "The model `gpt-9` does not exist.");
    }
}
