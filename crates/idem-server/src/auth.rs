//! Authentication: `Authorization: Bearer <api key>` on every `/v1` call.
//!
//! The key is looked up by its SHA-256 digest (see `idem_store::keys`); the caller's
//! tenant scopes every query that follows. A missing, malformed, unknown or revoked key
//! is answered 401 with `WWW-Authenticate: Bearer` (RFC 6750 §3).

use crate::AppState;
use crate::problem::Problem;
use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use idem_core::Actor;
use idem_store::keys::Role;

/// The authenticated caller of a request.
#[derive(Debug, Clone)]
pub struct Caller {
    /// Tenant every query is scoped to.
    pub tenant: String,
    /// Principal recorded on every event.
    pub principal: String,
    /// What the key may do.
    pub role: Role,
    /// The request's id (`x-request-id`).
    pub request_id: Option<String>,
    /// Whether `request_id` is the client's own `X-Request-Id` (kept by
    /// [`crate::logging::sanitize_request_id`]) rather than one idem generated: only then
    /// may it stand for the lease holder identity.
    pub request_id_from_client: bool,
}

impl Caller {
    /// The actor stamped on events caused by this request.
    pub fn actor(&self) -> Actor {
        Actor { principal: self.principal.clone(), request_id: self.request_id.clone() }
    }

    /// Refuses with 403 unless the caller's role is at least `role`.
    ///
    /// # Errors
    /// A 403 `forbidden` problem.
    pub fn require(&self, role: Role) -> Result<(), Problem> {
        if self.role >= role {
            Ok(())
        } else {
            Err(Problem::new(
                StatusCode::FORBIDDEN,
                "forbidden",
                format!("this call needs the {role} role; the key has {}", self.role),
            ))
        }
    }
}

/// The request id set by the request-id layer (`x-request-id`), if any.
pub fn request_id(headers: &HeaderMap) -> Option<&str> {
    headers.get("x-request-id").and_then(|v| v.to_str().ok())
}

fn unauthorized(detail: &str, rid: Option<&str>) -> Response {
    let mut r = Problem::new(StatusCode::UNAUTHORIZED, "unauthorized", detail).with_request_id(rid).into_response();
    r.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer realm=\"idem\""));
    r
}

impl FromRequestParts<AppState> for Caller {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, Self::Rejection> {
        let rid = request_id(&parts.headers).map(str::to_owned);
        let request_id_from_client = parts.extensions.get::<crate::logging::ClientRequestId>().is_some();
        let Some(value) = parts.headers.get(header::AUTHORIZATION) else {
            return Err(unauthorized("missing Authorization: Bearer <api key>", rid.as_deref()));
        };
        let secret = value
            .to_str()
            .ok()
            .and_then(|v| v.split_once(' '))
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
            .map(|(_, s)| s.trim())
            .filter(|s| !s.is_empty() && s.len() <= 256);
        let Some(secret) = secret else {
            return Err(unauthorized("the Authorization header must be `Bearer <api key>`", rid.as_deref()));
        };
        match state.store.authenticate(secret).await {
            Ok(Some(info)) => {
                tracing::Span::current().record("tenant", info.tenant.as_str());
                Ok(Caller {
                    tenant: info.tenant,
                    principal: info.principal,
                    role: info.role,
                    request_id: rid,
                    request_id_from_client,
                })
            }
            Ok(None) => Err(unauthorized("unknown or revoked API key", rid.as_deref())),
            Err(e) => Err(crate::operations::store_problem(e).with_request_id(rid.as_deref()).into_response()),
        }
    }
}
