//! The operator's admin page at `/ui`: server-rendered HTML (askama templates in
//! `templates/ui/`, auto-escaped), readable without JavaScript.
//!
//! | route | what |
//! |---|---|
//! | `GET /ui/login`, `POST /ui/login`, `POST /ui/logout` | sign in with an API key, sign out ([`session`]) |
//! | `GET /ui` | overview: counts by state and action, review queue depth, stale UNKNOWN, recent 422s and 410s |
//! | `GET /ui/operations` | list with filters (state, action, key prefix, review flag, created from/to) and pages |
//! | `GET /ui/operations/{key}` | one operation: fields, fingerprint, evidence, payload, result, event timeline |
//! | `GET /ui/review` | the review queue: flagged operations and UNKNOWN ones, with the resolve form |
//! | `POST /ui/operations/{key}/resolve`, `…/reconcile` | operator actions (role checked on the server, CSRF-protected) |
//! | `GET /ui/outbox`, `POST /ui/outbox/{id}/redrive`, `…/skip` | the outbox of `[outbox]`: counts, lag, dead letters with redrive/skip, latest events ([`outbox`]; operators of `[outbox] tenant`) |
//!
//! Every page is scoped to the signed-in key's tenant through the same store calls as the
//! API: another tenant's operation is "not found" here too. This module renders and
//! validates forms; it decides nothing the API would not (resolution rules live in
//! idem-core, reached through the store).

mod outbox;
mod pages;
pub mod session;
mod workflows;

use crate::AppState;
use axum::Router;
use axum::http::StatusCode;
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post};
use std::collections::VecDeque;
use std::sync::Mutex;

pub use session::{Sessions, UiUser};

/// Late arrivals (410) remembered per process for the overview.
pub const MAX_LATE_ARRIVALS: usize = 500;

/// What the admin page keeps in memory: sessions and recent late arrivals.
#[derive(Default)]
pub struct UiState {
    /// Signed-in sessions.
    pub sessions: Sessions,
    late: Mutex<VecDeque<LateArrival>>,
}

/// A trigger answered 410 `late-arrival`. Kept in memory only (a tombstone has no event
/// log): the overview shows this node's most recent ones since it started.
#[derive(Debug, Clone)]
pub struct LateArrival {
    /// Tenant of the trigger.
    pub tenant: String,
    /// The key it used.
    pub key: String,
    /// When (epoch ms).
    pub at_ms: i64,
    /// Its request id.
    pub request_id: Option<String>,
}

impl UiState {
    /// Remembers a late arrival, forgetting the oldest beyond [`MAX_LATE_ARRIVALS`].
    pub fn record_late(&self, late: LateArrival) {
        let mut q = self.late.lock().expect("late arrivals lock");
        if q.len() >= MAX_LATE_ARRIVALS {
            q.pop_front();
        }
        q.push_back(late);
    }

    /// The `n` latest late arrivals of `tenant`, newest first.
    pub fn recent_late(&self, tenant: &str, n: usize) -> Vec<LateArrival> {
        let q = self.late.lock().expect("late arrivals lock");
        q.iter().rev().filter(|l| l.tenant == tenant).take(n).cloned().collect()
    }
}

/// The admin page's routes (mounted at `/ui`).
pub fn router() -> Router<AppState> {
    Router::new()
        .route("/ui", get(pages::overview))
        .route("/ui/", get(pages::overview))
        .route("/ui/login", get(pages::login_form).post(pages::login))
        .route("/ui/logout", post(pages::logout))
        .route("/ui/operations", get(pages::operations))
        .route("/ui/operations/{key}", get(pages::operation))
        .route("/ui/operations/{key}/resolve", post(pages::resolve))
        .route("/ui/operations/{key}/reconcile", post(pages::reconcile))
        .route("/ui/review", get(pages::review))
        .route("/ui/workflows", get(workflows::list))
        .route("/ui/workflows/{instance}", get(workflows::one))
        .route("/ui/workflows/{instance}/rerun", post(workflows::rerun))
        .route("/ui/workflows/{instance}/compensate", post(workflows::compensate))
        .route("/ui/outbox", get(outbox::show))
        .route("/ui/outbox/{id}/{action}", post(outbox::act))
        .route("/ui/style.css", get(pages::style))
}

/// A form body (`application/x-www-form-urlencoded`). A malformed or oversized body is an
/// HTML error page, not axum's plain text; a cross-origin post (an `Origin` header that
/// is not this server's `Host`) is refused with 403, a check OWASP recommends besides the
/// CSRF token (it also covers the sign-in form, which has no session yet).
pub struct UiForm<T>(pub T);

impl<S: Send + Sync, T: serde::de::DeserializeOwned> axum::extract::FromRequest<S> for UiForm<T> {
    type Rejection = Response;

    async fn from_request(req: axum::extract::Request, state: &S) -> Result<Self, Self::Rejection> {
        let headers = req.headers();
        let origins: Vec<_> = headers.get_all(axum::http::header::ORIGIN).iter().collect();
        if !origins.is_empty() {
            // This server's own origin: the scheme it is reached by (HTTPS behind a proxy
            // that says so) and the Host the browser used.
            let host = headers.get(axum::http::header::HOST).and_then(|h| h.to_str().ok()).unwrap_or("");
            let own = format!("{}://{host}", if session::via_https(headers) { "https" } else { "http" });
            if origins.len() > 1 || origins[0].to_str().ok() != Some(own.as_str()) {
                let msg = "This form was posted from another site; it is refused.";
                return Err(error_page(None, StatusCode::FORBIDDEN, msg));
            }
        }
        let (parts, body) = req.into_parts();
        let bytes =
            match axum::body::Bytes::from_request(axum::extract::Request::from_parts(parts.clone(), body), state).await
            {
                Ok(b) => b,
                Err(e) => return Err(error_page(None, e.status(), "The form is larger than this server accepts.")),
            };
        // Refuse what the form decoder would silently turn into U+FFFD.
        let valid_utf8 = bytes
            .split(|b| *b == b'&')
            .flat_map(|pair| pair.split(|b| *b == b'='))
            .all(|part| percent_encoding::percent_decode(part).decode_utf8().is_ok());
        if !valid_utf8 {
            return Err(error_page(None, StatusCode::BAD_REQUEST, "The form holds text that is not valid UTF-8."));
        }
        let req = axum::extract::Request::from_parts(parts, axum::body::Body::from(bytes));
        match axum::Form::<T>::from_request(req, state).await {
            Ok(axum::Form(v)) => Ok(UiForm(v)),
            Err(e) => Err(error_page(None, e.status(), "The form could not be read; reload the page and try again.")),
        }
    }
}

/// Query parameters; a malformed query is an HTML error page.
pub struct UiQuery<T>(pub T);

impl<S: Send + Sync, T: serde::de::DeserializeOwned> axum::extract::FromRequestParts<S> for UiQuery<T> {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut axum::http::request::Parts, state: &S) -> Result<Self, Self::Rejection> {
        match axum::extract::Query::<T>::from_request_parts(parts, state).await {
            Ok(axum::extract::Query(v)) => Ok(UiQuery(v)),
            Err(e) => Err(error_page(None, StatusCode::BAD_REQUEST, &e.body_text())),
        }
    }
}

/// The `{key}` path segment, percent-decoded and parsed once (which also puts its hash on
/// the request's log span before any check can refuse the request). A segment that is
/// not UTF-8 is an HTML 400 page; a key idem refuses is `Err(why)`, for the handler to
/// show on a page with the signed-in user's header.
pub struct UiKey(pub Result<idem_core::IdempotencyKey, String>);

impl<S: Send + Sync> axum::extract::FromRequestParts<S> for UiKey {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut axum::http::request::Parts, state: &S) -> Result<Self, Self::Rejection> {
        match axum::extract::Path::<String>::from_request_parts(parts, state).await {
            Ok(axum::extract::Path(v)) => Ok(UiKey(crate::operations::parse_key(&v).map_err(|p| p.detail))),
            Err(_) => Err(error_page(None, StatusCode::BAD_REQUEST, "The key in the address is not valid.")),
        }
    }
}

/// The `{instance}` path segment of the workflow pages, percent-decoded and checked by the
/// one identifier rule (idem_core::ident) before it reaches a query: an id no instance
/// can have (a NUL, padding, over 255 bytes) is an HTML 400 page, never a database error
/// (issue 28 §7).
pub struct UiInstance(pub String);

impl<S: Send + Sync> axum::extract::FromRequestParts<S> for UiInstance {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut axum::http::request::Parts, state: &S) -> Result<Self, Self::Rejection> {
        match axum::extract::Path::<String>::from_request_parts(parts, state).await {
            Ok(axum::extract::Path(v)) => match idem_core::ident::check_identifier("the instance id", &v, 255) {
                Ok(()) => Ok(UiInstance(v)),
                Err(e) => {
                    Err(error_page(None, StatusCode::BAD_REQUEST, &format!("No instance can have this id: {e}.")))
                }
            },
            Err(_) => Err(error_page(None, StatusCode::BAD_REQUEST, "The instance id in the address is not valid.")),
        }
    }
}

/// An HTML error page with `status` and `message`.
pub fn error_page(user: Option<&UiUser>, status: StatusCode, message: &str) -> Response {
    html(status, &pages::ErrorPage { nav: pages::Nav::of(user), status: status.as_u16(), message: message.into() })
}

/// Headers every admin page carries: not cached (it shows tenant data), not framed
/// (clickjacking of the resolve form), scripts and forms only from this origin (OWASP
/// Secure Headers).
const PAGE_HEADERS: [(&str, &str); 5] = [
    ("cache-control", "no-store"),
    ("x-content-type-options", "nosniff"),
    ("x-frame-options", "DENY"),
    ("content-security-policy", "default-src 'self'; frame-ancestors 'none'; form-action 'self'"),
    ("referrer-policy", "same-origin"),
];

/// Renders an askama template as an HTML response with `status`.
fn html<T: askama::Template>(status: StatusCode, t: &T) -> Response {
    match t.render() {
        Ok(body) => {
            let mut r = (status, Html(body)).into_response();
            for (name, value) in PAGE_HEADERS {
                r.headers_mut().insert(name, axum::http::HeaderValue::from_static(value));
            }
            r
        }
        Err(e) => {
            tracing::error!(error = %e, "admin page: template failed");
            (StatusCode::INTERNAL_SERVER_ERROR, "template error").into_response()
        }
    }
}
