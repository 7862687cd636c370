//! temper's HTTP layer: OpenAI/vLLM-compatible routes over typed server state.
//!
//! `router` builds the whole application from an `AppState`; the binary and the integration
//! tests serve it the same way.

pub mod auth;
pub mod chat;
pub mod error;
pub mod extract;
pub mod extras;
pub mod prompt;
pub mod protocol;
pub mod sampling;
pub mod state;
pub mod tokenize;
pub mod validation;

use std::future::Future;

use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::StatusCode;
use axum::routing::{get, post};
use axum::{middleware, Json, Router};

pub use error::ApiError;
pub use extras::{NoHook, RequestHook};
pub use state::{AppState, LoadError, ModelSpec, ServedModel, ServerOptions};

use protocol::{ModelCard, ModelList};

/// The application: every route, authentication, body limit, the error envelope for axum's own
/// rejections, and the per-request tracing span.
pub fn router(state: AppState) -> Router {
    let api = Router::new()
        .route("/v1/chat/completions", post(chat::chat_completions))
        .route("/v1/models", get(list_models))
        .route("/tokenize", post(tokenize::tokenize))
        .route("/detokenize", post(tokenize::detokenize))
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            auth::authorize,
        ));
    Router::new()
        .route("/health", get(health))
        .merge(api)
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(state.options().max_body_bytes))
        .layer(middleware::from_fn(auth::request_context))
        .with_state(state)
}

/// Serves `router(state)` on `listener` until `shutdown` resolves; in-flight requests finish.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: AppState,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router(state))
        .with_graceful_shutdown(shutdown)
        .await
}

async fn health() -> StatusCode {
    StatusCode::OK
}

async fn list_models(State(state): State<AppState>) -> Json<ModelList> {
    Json(ModelList {
        object: "list",
        data: state
            .models()
            .iter()
            .map(|m| ModelCard {
                id: m.name.clone(),
                object: "model",
                created: state.started(),
                owned_by: "temper",
                max_model_len: m.max_model_len,
            })
            .collect(),
    })
}

async fn not_found(req: Request) -> ApiError {
    ApiError::NotFound(format!(
        "No route for {} {}.",
        req.method(),
        req.uri().path()
    ))
}

async fn method_not_allowed(req: Request) -> ApiError {
    ApiError::MethodNotAllowed(req.method().to_string())
}
