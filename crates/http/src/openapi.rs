//! `GET /openapi.json`: the OpenAPI 3.1 document of every route, written by hand beside this file
//! (wire types here are lenient on purpose, so generating it from them would document less than
//! validation enforces). `tests/openapi.rs` holds it to the router, to the request types' fields
//! and to real responses; `scripts/openapi-tests.sh` checks it against the OpenAPI 3.1 schema.

use axum::http::header;
use axum::response::IntoResponse;

/// The document, as served.
pub const DOCUMENT: &str = include_str!("openapi.json");

pub async fn document() -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "application/json")], DOCUMENT)
}
