//! `GET /`: where a newcomer lands. A browser (`Accept: text/html`) is sent to the admin
//! page; anything else gets a small JSON index of the service's entry points.

use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Redirect, Response};
use serde::Serialize;
use utoipa::ToSchema;

/// The entry points of an `idem serve` node (paths on this server).
#[derive(Debug, Serialize, ToSchema)]
pub struct IndexView {
    /// Always `idem`.
    pub service: &'static str,
    /// The admin page (HTML; sign in with an API key): `/ui`.
    pub admin_page: &'static str,
    /// The OpenAPI 3.1 document: `/openapi.json`.
    pub openapi: &'static str,
    /// The operations API (Bearer API key): `/v1/operations`.
    pub operations: &'static str,
    /// Liveness probe: `/healthz` (200 while the process answers).
    pub healthz: &'static str,
    /// Readiness probe: `/readyz` (200, or 503 problem+json when the database or the
    /// ledger's clock is not usable).
    pub readyz: &'static str,
    /// Prometheus metrics: `/metrics`.
    pub metrics: &'static str,
}

/// The index: browsers go to the admin page, other clients get the entry points.
#[utoipa::path(get, path = "/", tag = "health", operation_id = "index", responses(
    (status = 200, description = "The service's entry points (for clients that do not ask for HTML)", body = IndexView),
    (status = 303, description = "A browser (`Accept: text/html`) is sent to the admin page, `Location: /ui`"),
))]
pub async fn index(headers: HeaderMap) -> Response {
    if wants_html(&headers) {
        return Redirect::to("/ui").into_response();
    }
    (
        StatusCode::OK,
        axum::Json(IndexView {
            service: "idem",
            admin_page: "/ui",
            openapi: "/openapi.json",
            operations: "/v1/operations",
            healthz: "/healthz",
            readyz: "/readyz",
            metrics: "/metrics",
        }),
    )
        .into_response()
}

/// Whether the client prefers HTML: its `Accept` names `text/html` (as every browser's
/// navigation does; RFC 9110 §12.5.1).
fn wants_html(headers: &HeaderMap) -> bool {
    headers
        .get_all(header::ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|m| m.split(';').next().is_some_and(|t| t.trim().eq_ignore_ascii_case("text/html")))
}
