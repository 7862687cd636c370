//! temper's HTTP layer: OpenAI/vLLM-compatible routes over typed server state.
//!
//! `router` builds the whole application from an `AppState`; the binary and the integration
//! tests serve it the same way.

pub mod auth;
pub mod chat;
pub mod completions;
mod dashboard;
pub mod error;
pub mod extract;
pub mod extras;
pub mod meter;
pub mod metrics;
pub mod openapi;
pub mod prompt;
pub mod protocol;
pub mod sampling;
pub mod state;
pub mod structured;
pub mod team_limits;
pub mod tinker;
pub mod tokenize;
pub mod training;
pub mod usage;
pub mod validation;

use std::future::Future;

use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::StatusCode;
use axum::routing::{get, post, MethodRouter};
use axum::{middleware, Extension, Json, Router};

pub use error::ApiError;
pub use state::{AppState, LoadError, ModelSpec, ServedModel, ServerOptions};
pub use state::{NoHook, RequestHook};
pub use temper_catalog::{Catalog, CatalogOptions};
pub use temper_train::service::{TrainingOptions, TrainingService};

use protocol::{ModelCard, ModelList};

/// A path and the handlers of its methods.
type Route = (&'static str, MethodRouter<AppState>);

/// The application: every route, authentication, body limit, the error envelope for axum's own
/// rejections, and the per-request tracing span. Every route is in one of the tables below
/// (`open_routes`, `serving_routes`, `training_route_table`, `tinker_route_table`), so that
/// `route_paths` lists it.
pub fn router(state: AppState) -> Router {
    let api = mount(serving_routes())
        .merge(training_routes(&state))
        .merge(tinker_routes(&state))
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            auth::authorize,
        ));
    mount(open_routes())
        .merge(api)
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(state.options().max_body_bytes))
        .layer(middleware::from_fn(auth::request_context))
        .with_state(state)
}

/// Every path `router` serves, as axum spells it (`{id}` for a path parameter): the OpenAPI
/// document's test checks each against the document.
pub fn route_paths() -> Vec<&'static str> {
    [
        open_routes(),
        serving_routes(),
        training_route_table(),
        tinker_route_table(),
    ]
    .into_iter()
    .flatten()
    .map(|(path, _)| path)
    .collect()
}

fn mount(routes: Vec<Route>) -> Router<AppState> {
    routes
        .into_iter()
        .fold(Router::new(), |router, (path, handlers)| {
            router.route(path, handlers)
        })
}

/// Served without a key.
fn open_routes() -> Vec<Route> {
    vec![
        ("/health", get(health)),
        ("/openapi.json", get(openapi::document)),
        ("/dashboard", get(dashboard::page)),
    ]
}

/// The OpenAI/vLLM-compatible routes.
fn serving_routes() -> Vec<Route> {
    vec![
        ("/v1/chat/completions", post(chat::chat_completions)),
        ("/v1/completions", post(completions::completions)),
        ("/v1/models", get(list_models)),
        ("/tokenize", post(tokenize::tokenize)),
        ("/detokenize", post(tokenize::detokenize)),
        ("/metrics", get(metrics::metrics)),
        ("/v1/usage", get(usage::usage)),
    ]
}

/// training.md's preview API, with its own (larger) body limit and `Idempotency-Key`s.
fn training_routes(state: &AppState) -> Router<AppState> {
    let limit = state
        .training()
        .map_or(state.options().max_body_bytes, |t| t.options.max_body_bytes);
    mount(training_route_table())
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            training::idempotency::idempotent,
        ))
        .layer(DefaultBodyLimit::max(limit))
        .layer(Extension(extract::BodyLimit(limit)))
}

fn training_route_table() -> Vec<Route> {
    use training::routes as r;
    vec![
        (
            "/v1/preview/models",
            post(r::create_model).get(r::list_models),
        ),
        (
            "/v1/preview/models/{id}",
            get(r::get_model).delete(r::delete_model),
        ),
        (
            "/v1/preview/models/{id}/checkpoints",
            get(r::list_checkpoints)
                .delete(r::delete_checkpoints)
                .post(training::adapters::import_checkpoint),
        ),
        (
            "/v1/preview/models/{id}/checkpoints/{step}/adapter",
            get(training::adapters::export_adapter),
        ),
        ("/v1/preview/models/{id}/log", post(r::log_metrics)),
        (
            "/v1/preview/training-jobs",
            get(r::list_jobs).post(r::create_job),
        ),
        ("/v1/preview/training-jobs/{id}", get(r::get_job)),
        ("/v1/preview/training-jobs/{id}/events", get(r::list_events)),
        ("/v1/preview/training-jobs/{id}/cancel", post(r::cancel_job)),
        ("/v1/preview/sft-training-jobs", post(r::create_sft_job)),
    ]
}

/// The Tinker API (`tinker`): its own registry of live objects, the training routes' body limit.
fn tinker_routes(state: &AppState) -> Router<AppState> {
    let limit = state
        .training()
        .map_or(state.options().max_body_bytes, |t| t.options.max_body_bytes);
    mount(tinker_route_table())
        .layer(DefaultBodyLimit::max(limit))
        .layer(Extension(extract::BodyLimit(limit)))
        .layer(Extension(std::sync::Arc::new(tinker::Tinker::default())))
}

fn tinker_route_table() -> Vec<Route> {
    use tinker::routes as t;
    vec![
        ("/api/v1/healthz", get(t::healthz)),
        ("/api/v1/client/config", post(t::client_config)),
        ("/api/v1/client/dynamic_config", post(t::dynamic_config)),
        ("/api/v1/telemetry", post(t::telemetry)),
        ("/api/v1/create_session", post(t::create_session)),
        ("/api/v1/session_heartbeat", post(t::session_heartbeat)),
        (
            "/api/v1/get_server_capabilities",
            get(t::server_capabilities),
        ),
        ("/api/v1/create_model", post(t::create_model)),
        ("/api/v1/get_info", post(t::get_info)),
        ("/api/v1/forward_backward", post(t::forward_backward)),
        ("/api/v1/optim_step", post(t::optim_step)),
        ("/api/v1/save_weights", post(t::save_weights)),
        (
            "/api/v1/save_weights_for_sampler",
            post(t::save_weights_for_sampler),
        ),
        ("/api/v1/load_weights", post(t::load_weights)),
        (
            "/api/v1/create_sampling_session",
            post(t::create_sampling_session),
        ),
        ("/api/v1/samplers/{id}", get(t::get_sampler)),
        ("/api/v1/asample", post(t::asample)),
        ("/api/v1/retrieve_future", post(t::retrieve_future)),
        ("/api/v1/cancel_future", post(t::cancel_future)),
        ("/api/v1/training_runs", get(t::training_runs)),
        ("/api/v1/training_runs/{id}", get(t::training_run)),
        (
            "/api/v1/training_runs/{id}/checkpoints",
            get(t::run_checkpoints),
        ),
        (
            "/api/v1/training_runs/{id}/checkpoints/{kind}/{name}",
            axum::routing::delete(t::delete_checkpoint),
        ),
        ("/api/v1/checkpoints", get(t::checkpoints)),
    ]
}

/// A worker node's HTTP (`temper serve --role worker`): `/health` only, for probes.
pub fn worker_router() -> Router {
    Router::new()
        .route("/health", get(health))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(middleware::from_fn(auth::request_context))
}

/// Serves `router(state)` on `listener` until `shutdown` resolves; in-flight requests finish.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: AppState,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    serve_router(listener, router(state), shutdown).await
}

/// Serves `app` (see [`router`], [`worker_router`]) until `shutdown` resolves.
pub async fn serve_router(
    listener: tokio::net::TcpListener,
    app: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
}

async fn health() -> StatusCode {
    StatusCode::OK
}

/// The base models, then the team's trained models: each under its bare name (the latest
/// checkpoint) and each checkpoint as `…:step<N>`, with `parent` naming the base model.
async fn list_models(
    State(state): State<AppState>,
    Extension(ctx): Extension<auth::RequestContext>,
) -> Result<Json<ModelList>, ApiError> {
    let mut data: Vec<ModelCard> = state
        .models()
        .iter()
        .map(|m| ModelCard {
            id: m.name.clone(),
            object: "model",
            created: state.started(),
            owned_by: "temper".to_owned(),
            max_model_len: m.max_model_len,
            parent: None,
        })
        .collect();
    if let Some(store) = state.store() {
        for model in store.list_models(&ctx.team).await? {
            let Ok(base) = state.model(Some(&model.base_model)) else {
                continue;
            };
            let card = |id: String, created: i64| ModelCard {
                id,
                object: "model",
                created: u64::try_from(created).unwrap_or(0),
                owned_by: model.team.clone(),
                max_model_len: base.max_model_len,
                parent: Some(model.base_model.clone()),
            };
            data.push(card(
                format!("{}/{}/{}", model.team, model.project, model.name),
                model.created_at,
            ));
            let mut after = None;
            loop {
                let page = store
                    .list_checkpoints(
                        &ctx.team,
                        model.id,
                        after,
                        temper_store::MAX_LIMIT,
                        temper_store::Order::Asc,
                    )
                    .await?;
                after = page.items.last().map(|c| c.id);
                for c in &page.items {
                    let id = temper_catalog::names::checkpoint_name(
                        &model.team,
                        &model.project,
                        &model.name,
                        c.step,
                    );
                    data.push(card(id, c.created_at));
                }
                if !page.has_more {
                    break;
                }
            }
        }
    }
    Ok(Json(ModelList {
        object: "list",
        data,
    }))
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
