//! `Idempotency-Key` on the training API's POST and DELETE calls: a retry with the same key and
//! body gets the first request's answer (same status, same body: the same job id) instead of
//! doing it again, across restarts. Keys are scoped to the key's team and the route (method and
//! path). The same key with another body is a 409; while the first request is still being
//! handled, a duplicate is a 409 too, so concurrent duplicates never both run. Only successful
//! answers are kept: after an error the key is free again and a retry is handled afresh.

use axum::body::{to_bytes, Body};
use axum::extract::{Request, State};
use axum::http::{HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use temper_store::{Claim, IdempotencyKey, MAX_IDEMPOTENCY_KEY_LEN};
use tracing::Instrument;

use crate::auth::RequestContext;
use crate::error::ApiError;
use crate::extract::BodyLimit;
use crate::state::AppState;

pub use crate::protocol::IDEMPOTENCY_KEY_HEADER as HEADER;
/// Set on a replayed answer.
pub const REPLAYED_HEADER: &str = "Idempotent-Replayed";

/// The claimed key of the request being handled (a request extension), for a handler that
/// commits the key's answer together with what it does (see `Store::enqueue_job_idempotent`).
#[derive(Debug, Clone)]
pub struct ClaimedKey {
    team: String,
    key: String,
    route: String,
}

impl ClaimedKey {
    pub fn as_key(&self) -> IdempotencyKey<'_> {
        IdempotencyKey {
            team: &self.team,
            key: &self.key,
            route: &self.route,
        }
    }
}

/// The middleware (a route layer of the training routes, inside authentication).
pub async fn idempotent(
    State(state): State<AppState>,
    req: Request,
    next: Next,
) -> Result<Response, ApiError> {
    let Some(value) = req.headers().get(HEADER) else {
        return Ok(next.run(req).await);
    };
    if !matches!(*req.method(), Method::POST | Method::DELETE) {
        return Ok(next.run(req).await);
    }
    let key = parse_key(value)?;
    let training = state.require_training()?.clone();
    let team = req
        .extensions()
        .get::<RequestContext>()
        .map(|ctx| ctx.team.clone())
        .ok_or_else(|| ApiError::Internal("no request context".to_owned()))?;
    let route = format!("{} {}", req.method(), req.uri().path());
    let limit = req
        .extensions()
        .get::<BodyLimit>()
        .map_or(state.options().max_body_bytes, |l| l.0);
    let (parts, body) = req.into_parts();
    let body = to_bytes(body, limit)
        .await
        .map_err(|_| ApiError::RequestTooLarge(limit))?;
    let claimed = ClaimedKey { team, key, route };
    let (key, route) = (&claimed.key, &claimed.route);
    match training
        .store
        .claim_idempotency(claimed.as_key(), &body)
        .await?
    {
        Claim::Claimed => {}
        Claim::Replay { status, body } => {
            let status = StatusCode::from_u16(status)
                .map_err(|e| ApiError::Internal(format!("a stored answer's status: {e}")))?;
            let mut resp = (
                status,
                [(axum::http::header::CONTENT_TYPE, "application/json")],
                body,
            )
                .into_response();
            resp.headers_mut()
                .insert(REPLAYED_HEADER, HeaderValue::from_static("true"));
            return Ok(resp);
        }
        Claim::Mismatch => {
            return Err(ApiError::IdempotencyConflict(format!(
                "The `{HEADER}` {key:?} was already used on {route} with another body; use a \
                 new key for a new request."
            )))
        }
        Claim::InProgress => {
            return Err(ApiError::IdempotencyConflict(format!(
                "A request with the `{HEADER}` {key:?} on {route} is still being handled; \
                 retry it once that one has answered."
            )))
        }
    }
    // Handled on its own task, so that a client hanging up (which drops this future) cannot
    // leave the key claimed with the request half done: it runs to its end and is remembered.
    let mut request = Request::from_parts(parts, Body::from(body));
    request.extensions_mut().insert(claimed.clone());
    tokio::spawn(
        async move {
            let id = claimed.as_key();
            let resp = next.run(request).await;
            remember(&training.store, id, resp).await
        }
        .instrument(tracing::Span::current()),
    )
    .await
    .map_err(|e| ApiError::Internal(format!("an idempotent request panicked: {e}")))?
}

/// Keeps a successful answer for the key's retries; after an error the key is released, so it
/// may be retried (with a corrected body, too).
async fn remember(
    store: &temper_store::Store,
    id: IdempotencyKey<'_>,
    resp: Response,
) -> Result<Response, ApiError> {
    if !resp.status().is_success() {
        store.release_idempotency(id).await?;
        return Ok(resp);
    }
    let (parts, body) = resp.into_parts();
    // The training API's answers are small JSON documents.
    let body = to_bytes(body, usize::MAX)
        .await
        .map_err(|e| ApiError::Internal(format!("reading an answer to remember it: {e}")))?;
    if let Err(e) = store
        .complete_idempotency(id, parts.status.as_u16(), &body)
        .await
    {
        // The request did happen: answer it, and free the key rather than leave it in progress.
        tracing::error!(error = %e, "remembering an idempotent answer");
        if let Err(e) = store.release_idempotency(id).await {
            tracing::error!(error = %e, "releasing an idempotency key");
        }
    }
    Ok(Response::from_parts(parts, Body::from(body)))
}

/// 1 to 255 visible ASCII characters (what the header can carry unambiguously).
fn parse_key(value: &HeaderValue) -> Result<String, ApiError> {
    let bad = || {
        ApiError::bad(
            HEADER,
            format!(
                "`{HEADER}` must be 1 to {MAX_IDEMPOTENCY_KEY_LEN} visible ASCII characters \
                 (e.g. a UUID)."
            ),
        )
    };
    let key = value.to_str().map_err(|_| bad())?;
    let visible = key.bytes().all(|b| b.is_ascii_graphic());
    if key.is_empty() || key.len() > MAX_IDEMPOTENCY_KEY_LEN || !visible {
        return Err(bad());
    }
    Ok(key.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_bounded_visible_ascii() {
        let ok = |s: &str| parse_key(&HeaderValue::from_str(s).unwrap()).is_ok();
        assert!(ok("3f2b-uuid-like"));
        assert!(ok(&"k".repeat(255)));
        assert!(!ok(&"k".repeat(256)));
        assert!(!ok(""));
        assert!(!ok("with space"));
    }
}
