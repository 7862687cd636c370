//! Request context (id, tracing span), bearer authentication and the `OpenAI-Project` header.

use std::time::Instant;

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue};
use axum::middleware::Next;
use axum::response::Response;
use tracing::Instrument;

use crate::error::ApiError;
use crate::state::AppState;

pub const PROJECT_HEADER: &str = "openai-project";
const REQUEST_ID_HEADER: &str = "x-request-id";

/// The team of keys given on the command line (`--api-key`), and of every request when the
/// server needs no key.
pub const DEFAULT_TEAM: &str = "default";

/// Per-request facts that handlers need, set by the middleware.
#[derive(Debug, Clone)]
pub struct RequestContext {
    pub request_id: String,
    pub project: Option<Project>,
    /// The team the key belongs to: what the request may see of models, checkpoints and jobs.
    pub team: String,
}

impl RequestContext {
    /// The project the request's usage counts under: the `OpenAI-Project` header's, else
    /// [`DEFAULT_PROJECT`](crate::meter::DEFAULT_PROJECT).
    pub fn usage_project(&self) -> &str {
        self.project
            .as_ref()
            .map_or(crate::meter::DEFAULT_PROJECT, |p| p.project.as_str())
    }
}

/// `OpenAI-Project: <team>/<project>`: usage attribution. The team must be the key's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Project {
    pub team: String,
    pub project: String,
}

impl Project {
    /// Each part: 1–64 characters of ASCII letters, digits, `-`, `_`, `.`.
    pub fn parse(value: &str) -> Result<Project, ApiError> {
        let valid = |s: &str| {
            !s.is_empty()
                && s.len() <= 64
                && s.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
        };
        match value.split_once('/') {
            Some((team, project)) if valid(team) && valid(project) => Ok(Project {
                team: team.to_owned(),
                project: project.to_owned(),
            }),
            _ => Err(ApiError::bad(
                "OpenAI-Project",
                "The OpenAI-Project header must be `<team>/<project>`, each 1-64 characters of \
                 letters, digits, '-', '_' or '.'.",
            )),
        }
    }
}

/// Outermost layer: assigns the request id (a client's `X-Request-Id` if sane), opens the span
/// every log line of the request runs in, and logs one line when the handler returns.
pub async fn request_context(mut req: Request, next: Next) -> Response {
    let request_id = req
        .headers()
        .get(REQUEST_ID_HEADER)
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.is_empty() && v.len() <= 128 && v.bytes().all(|b| b.is_ascii_graphic()))
        .map(str::to_owned)
        .unwrap_or_else(|| uuid::Uuid::new_v4().simple().to_string());
    let span = tracing::info_span!(
        "request",
        request_id = %request_id,
        method = %req.method(),
        path = %req.uri().path(),
        team = tracing::field::Empty,
        project = tracing::field::Empty,
    );
    req.extensions_mut().insert(RequestContext {
        request_id: request_id.clone(),
        project: None,
        team: DEFAULT_TEAM.to_owned(),
    });
    let start = Instant::now();
    let mut response = next.run(req).instrument(span.clone()).await;
    span.in_scope(|| {
        tracing::info!(
            status = response.status().as_u16(),
            latency_ms = start.elapsed().as_millis() as u64,
            "response"
        )
    });
    if let Ok(v) = HeaderValue::from_str(&request_id) {
        response.headers_mut().insert(REQUEST_ID_HEADER, v);
    }
    response
}

/// Key check (`Authorization: Bearer`, or `X-API-Key` as the tinker SDK sends it), then the
/// project header, whose team must be the key's (a 400 otherwise).
/// Every route but `/health` runs through this.
pub async fn authorize(
    State(state): State<AppState>,
    mut req: Request,
    next: Next,
) -> Result<Response, ApiError> {
    let team = authenticate(&state, req.headers()).await?;
    tracing::Span::current().record("team", team.as_str());
    let project = match req.headers().get(PROJECT_HEADER) {
        None => None,
        Some(v) => Some(Project::parse(v.to_str().map_err(|_| {
            ApiError::bad("OpenAI-Project", "The OpenAI-Project header is not ASCII.")
        })?)?),
    };
    if let Some(p) = &project {
        if p.team != team {
            // Usage is the key's team's: another team's project would put it on their account.
            return Err(ApiError::bad(
                "OpenAI-Project",
                format!(
                    "The OpenAI-Project header names team `{}`, but the API key belongs to team \
                     `{team}`: send `OpenAI-Project: {team}/<project>`.",
                    p.team
                ),
            ));
        }
        tracing::Span::current().record("project", p.project.as_str());
    }
    if let Some(ctx) = req.extensions_mut().get_mut::<RequestContext>() {
        ctx.project = project;
        ctx.team = team;
    }
    Ok(next.run(req).await)
}

/// The team a request acts for. Keys given on the command line belong to `default`; any other
/// key is looked up in the store on every request, so keys created or revoked while the server
/// runs take effect at once. A request without a valid key is refused unless the server needs
/// none: no command-line key, `require_key` off and no active key in the store.
async fn authenticate(state: &AppState, headers: &HeaderMap) -> Result<String, ApiError> {
    let options = state.options();
    let store = state.store();
    let presented = bearer(headers).or_else(|| api_key_header(headers));
    if let Some(presented) = presented {
        // The tinker SDK only sends keys that start with `tml-`: `tml-<key>` is `<key>` too.
        let unprefixed = presented.strip_prefix(TINKER_KEY_PREFIX);
        for key in std::iter::once(presented).chain(unprefixed) {
            if matches_any(&options.api_keys, key) {
                return Ok(DEFAULT_TEAM.to_owned());
            }
            if let Some(store) = store {
                if let Some(team) = store.authenticate(key).await? {
                    return Ok(team.name);
                }
            }
        }
    }
    let open = options.api_keys.is_empty()
        && !options.require_key
        && match store {
            Some(store) => !store.has_active_keys().await?,
            None => true,
        };
    match (open, presented) {
        (true, _) => Ok(DEFAULT_TEAM.to_owned()),
        (false, None) => Err(ApiError::Unauthorized(
            "Missing API key: send `Authorization: Bearer <key>`.".to_owned(),
        )),
        (false, Some(_)) => Err(ApiError::Unauthorized("Invalid API key.".to_owned())),
    }
}

/// The key of `Authorization: Bearer <key>`; the scheme is case-insensitive (RFC 9110 11.1), so
/// `bearer <key>` works as clients send it.
fn bearer(headers: &HeaderMap) -> Option<&str> {
    let value = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, key) = value.split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| key.trim())
}

/// The prefix the tinker SDK requires of an API key; temper strips it when the whole does not
/// match (see [`authenticate`]).
const TINKER_KEY_PREFIX: &str = "tml-";

/// `X-API-Key: <key>`, as the tinker SDK sends its key.
fn api_key_header(headers: &HeaderMap) -> Option<&str> {
    let key = headers.get("x-api-key")?.to_str().ok()?.trim();
    (!key.is_empty()).then_some(key)
}

/// Compares against every key without early exit so timing does not reveal a prefix match.
fn matches_any(keys: &[String], presented: &str) -> bool {
    keys.iter().fold(false, |acc, k| {
        acc | ct_eq(k.as_bytes(), presented.as_bytes())
    })
}

fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn project_header_parsing() {
        assert_eq!(
            Project::parse("acme/agents-v2").unwrap(),
            Project {
                team: "acme".into(),
                project: "agents-v2".into()
            }
        );
        assert!(Project::parse("team_1/proj.x").is_ok());
        for bad in [
            "",
            "acme",
            "/p",
            "t/",
            "a/b/c",
            "a b/c",
            "t/ü",
            &"x".repeat(65),
        ] {
            let e = Project::parse(bad).unwrap_err();
            assert_eq!(e.status().as_u16(), 400, "{bad}");
            let v = serde_json::to_value(e.envelope()).unwrap();
            assert_eq!(v["error"]["param"], "OpenAI-Project");
        }
    }

    fn headers(auth: Option<&str>) -> HeaderMap {
        let mut h = HeaderMap::new();
        if let Some(a) = auth {
            h.insert(header::AUTHORIZATION, a.parse().unwrap());
        }
        h
    }

    #[test]
    fn bearer_keys() {
        let keys = vec!["k1".to_owned(), "secret-2".to_owned()];
        let ok = |auth| bearer(&headers(auth)).is_some_and(|k| matches_any(&keys, k));
        assert!(ok(Some("Bearer k1")));
        assert!(ok(Some("Bearer secret-2")));
        assert!(ok(Some("bearer k1")));
        assert!(ok(Some("BEARER k1")));
        for bad in [
            None,
            Some("Bearer k"),
            Some("Bearer k12"),
            Some("k1"),
            Some("Basic k1"),
            Some("Bearerk1"),
            Some("Bearer"),
        ] {
            assert!(!ok(bad), "{bad:?}");
        }
    }
}
