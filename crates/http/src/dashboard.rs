//! `GET /dashboard`: one self-contained page (HTML, inline script and style, SVG charts drawn by
//! the script; nothing fetched from elsewhere) over the preview training API. The page itself is
//! public: it holds no data. It asks for an API key, keeps it in the tab's `sessionStorage`, and
//! reads the team's models, checkpoints, jobs and events through the JSON routes with
//! `Authorization: Bearer`, so it sees exactly what the key may see.

use axum::http::header;
use axum::response::IntoResponse;

const PAGE: &str = include_str!("dashboard.html");

/// The page may run only its own inline script and style and talk only to this server; no
/// other site may frame it.
const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'unsafe-inline'; \
     style-src 'unsafe-inline'; connect-src 'self'; img-src 'self' data:; base-uri 'none'; \
     form-action 'none'; frame-ancestors 'none'";

pub async fn page() -> impl IntoResponse {
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (header::CONTENT_SECURITY_POLICY, CONTENT_SECURITY_POLICY),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
            (header::REFERRER_POLICY, "no-referrer"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        PAGE,
    )
}
