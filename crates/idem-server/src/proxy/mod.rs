//! `idem proxy`: the IETF httpapi "Idempotency-Key HTTP Header Field" draft
//! (draft-ietf-httpapi-idempotency-key-header-07) in front of an HTTP API that was never
//! written with it.
//!
//! For the configured methods (default POST and PATCH) and path prefixes:
//! - a request without `Idempotency-Key` is 400 (draft §2.7), a malformed key 400;
//! - the fingerprint is SHA-256 over RFC 8785 canonical JSON of
//!   `{"method", "path" (with query), "body", "headers"}`, where `body` is the canonical
//!   JSON body for JSON content types and `{"sha256": …}` of the raw bytes otherwise, and
//!   `headers` the configured fingerprint headers; reuse of a key with another fingerprint
//!   is 422 (draft §2.7);
//! - the first request is forwarded, with its key scoped by the client's tenant and
//!   principal (`{tenant}/{principal}/{key}`, [`upstream_key`]) and without
//!   `Accept-Encoding` (a stored answer is replayed to requests that may ask for another
//!   coding); a duplicate while it is in flight is
//!   409 (draft §2.7);
//! - the upstream's final answer — 2xx, 3xx and 4xx except 408/425/429 — is stored
//!   (status, selected headers, body up to a limit) and replayed byte-for-byte with
//!   `Idempotent-Replayed: true`;
//! - an answer that does not prove the upstream did nothing — by default every 5xx but
//!   501, 503, 505 and 511 (DESIGN.md §4, `idem_connect::http_status`), per route
//!   `--outcome-unknown-statuses` ([`OutcomeUnknownStatuses`]) — and a timeout or a reset
//!   after the request reached the upstream are UNKNOWN: the client gets a problem
//!   `outcome-unknown` with the upstream's status (or 504 for a timeout, 502 for a reset;
//!   the upstream's own body is not passed on, since the problem must tell the client
//!   that a retry will not be forwarded); later retries get 409 `outcome-unknown` until
//!   the upstream's lookup (`--lookup-url`, [`ProxyLookup`]) finds it (then they get a 200
//!   naming the evidence) or proves it absent (then the next retry is forwarded), or an
//!   operator resolves it (`/_idem/v1/operations/{principal}%2F{key}/resolve`) — the proxy
//!   never forwards that request again on its own. (409, not the API's 202: to a plain
//!   HTTP client a 2xx for its POST would read as success.);
//! - 408/425/429, and the 5xx not counted as outcome-unknown (503, and any status a route
//!   leaves out of its list), are passed on but not stored, and the key is released for
//!   the client's retry;
//! - on a route whose upstream deduplicates by `Idempotency-Key` itself (answers a repeat
//!   with the first request's result: `--provider-deduplicates`, [`PerRoute`]), forwarding
//!   the same request again with the same key cannot act twice (DESIGN.md §2 invariant 4,
//!   §4, as the HTTP connector's `provider_deduplicates`), so nothing there is UNKNOWN: an
//!   outcome-unknown status, and a 409 (the upstream's "a request with this key is still in
//!   progress"), are passed on as the upstream sent them, not stored, and the key is
//!   released; a timeout or a reset is the problem `upstream-no-answer` (504, 502) and
//!   releases the key too; the client's retry is forwarded with the same key, and the
//!   upstream answers it. An expired lease (the proxy died mid-request) is re-granted.
//!
//! Keys are scoped by the authenticated client: the idem API key in `Idem-Api-Key` (its
//! principal), or a configured trusted header naming the principal. The proxy's own API
//! is mounted under `/_idem/` (the same routes as `idem serve`).

use crate::AppState;
use crate::operations::store_problem;
use crate::problem::Problem;
use axum::body::{Body, Bytes, to_bytes};
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use idem_core::{AcquireInput, Actor, Decision, IdempotencyKey, Outcome, RetryPolicy, fingerprint};
use idem_store::CompleteRequest;
use serde_json::{Value, json};
use std::sync::Arc;
use std::time::Duration;

mod errors;
mod lookup;
mod routes;

pub use errors::{ErrorFormat, parse_error_formats};
pub use lookup::{PROXY_LOOKUP, ProxyLookup};
pub use routes::{OutcomeUnknownStatuses, PerRoute, parse_outcome_unknown_statuses, parse_provider_deduplicates};
use routes::{UpstreamAnswer, upstream_answer};

/// How the proxy tells clients apart.
#[derive(Debug, Clone)]
pub enum ClientAuth {
    /// An idem API key in the `Idem-Api-Key` header (stripped before forwarding).
    ApiKey,
    /// A trusted header (set by a gateway in front) that names the principal; all such
    /// clients share tenant `proxy`.
    TrustedHeader(HeaderName),
}

/// Proxy settings.
#[derive(Debug, Clone)]
pub struct ProxyConfig {
    /// Base URL requests are forwarded to.
    pub upstream: reqwest::Url,
    /// Methods that need an Idempotency-Key (default POST, PATCH).
    pub methods: Vec<Method>,
    /// Path prefixes that need one (default: all).
    pub prefixes: Vec<String>,
    /// Request headers that are part of the fingerprint (lower-case).
    pub fingerprint_headers: Vec<HeaderName>,
    /// Response headers stored and replayed besides `content-type`, `location`, `etag`.
    pub stored_headers: Vec<HeaderName>,
    /// Largest request body accepted (bytes); larger is 413.
    pub max_request_bytes: usize,
    /// Largest response body stored for replay (bytes); a larger one is replayed without
    /// its body and with `Idem-Body-Omitted: true`.
    pub max_stored_bytes: usize,
    /// Upstream timeout; after it the outcome is UNKNOWN.
    pub timeout: Duration,
    /// How clients are told apart.
    pub auth: ClientAuth,
    /// Upstream statuses after which the outcome is UNKNOWN, per route.
    pub outcome_unknown: OutcomeUnknownStatuses,
    /// Per route: whether the upstream answers a repeated `Idempotency-Key` with the first
    /// request's result (`--provider-deduplicates`); then an ambiguous answer releases the
    /// key instead of leaving the outcome UNKNOWN (see the module docs).
    pub provider_deduplicates: PerRoute<bool>,
    /// Per route: how the proxy renders its own errors (`--error-format`; default RFC 9457
    /// problem+json), see [`ErrorFormat`].
    pub error_format: PerRoute<ErrorFormat>,
}

/// The answer to a request whose outcome became unknown: problem `outcome-unknown` with
/// `status`, saying `what` happened and that the request will not be forwarded again.
fn unknown_outcome_problem(status: StatusCode, what: &str) -> Response {
    problem(
        status,
        "outcome-unknown",
        format!(
            "{what}; the upstream may have acted, so the outcome is unknown and this request will not be forwarded again \
             (the upstream's lookup or an operator settles it)"
        ),
    )
}

/// The tenant the proxy keeps the requests of an API-key client of tenant `t` in:
/// `t.proxy`. Its own namespace, so the client's tenant-mates cannot create, read or
/// block them through idem's API; operators resolve them with a key of `t.proxy`.
pub fn proxy_tenant(t: &str) -> String {
    format!("{t}.proxy")
}

/// The tenant of clients named by `--principal-header`.
pub const PROXY_TRUSTED_TENANT: &str = "proxy";

/// The proxy's shared state.
#[derive(Clone)]
pub struct ProxyState {
    app: AppState,
    config: Arc<ProxyConfig>,
    client: reqwest::Client,
}

const HOP_BY_HOP: [&str; 9] = [
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "host",
];

impl ProxyState {
    /// A proxy over `app`'s store.
    ///
    /// # Errors
    /// If the HTTP client cannot be built.
    pub fn new(app: AppState, config: ProxyConfig) -> Result<Self, String> {
        let client = reqwest::Client::builder()
            .timeout(config.timeout)
            .redirect(reqwest::redirect::Policy::none())
            .retry(reqwest::retry::never())
            .build()
            .map_err(|e| e.to_string())?;
        Ok(ProxyState { app, config: Arc::new(config), client })
    }
}

/// The `route` label (in `/metrics` and the access log's span) of every request the proxy
/// forwards or answers itself (400 without a key, 409, 422, replays, 413, ...): one series
/// for them all, since the upstream's paths are unbounded and may hold keys.
pub const PROXIED_ROUTE: &str = "proxied";

/// Middleware: names the request's route [`PROXIED_ROUTE`] in its span and its answer.
async fn label_proxied(req: Request, next: axum::middleware::Next) -> Response {
    tracing::Span::current().record("route", PROXIED_ROUTE);
    let mut resp = next.run(req).await;
    resp.extensions_mut().insert(crate::metrics::RouteLabel(PROXIED_ROUTE));
    resp
}

/// The proxy's router: idem's own API under `/_idem/`, everything else proxied.
///
/// The proxied requests get the API's access log (`idem::access`) and
/// `idem_http_request*{route="proxied"}` series; the API under `/_idem/` has its own (its
/// router carries them), so they are not counted twice.
pub fn router(state: ProxyState, api: axum::Router, budget: crate::request_body::BodyBudget) -> axum::Router {
    let body_limit = state.config.max_request_bytes;
    let x_request_id = axum::http::HeaderName::from_static("x-request-id");
    let proxied = tower::ServiceBuilder::new()
        .layer(crate::logging::proxied_trace_layer())
        .layer(axum::middleware::from_fn(crate::metrics::track_http))
        .layer(axum::middleware::from_fn(label_proxied))
        .layer(axum::middleware::from_fn_with_state(state.clone(), errors::shape_errors))
        .layer(axum::middleware::from_fn_with_state(budget, crate::request_body::guard))
        .service(axum::handler::Handler::with_state(handle, state));
    // The proxy's own answers carry a request id like the API's (`x-request-id`, and
    // `request_id` in its problems); the upstream's answers pass through unchanged.
    axum::Router::new()
        .nest_service("/_idem", api)
        .fallback_service(proxied)
        .layer(axum::middleware::from_fn(crate::problem::fill_request_id))
        .layer(axum::extract::DefaultBodyLimit::max(body_limit))
        .layer(tower_http::request_id::PropagateRequestIdLayer::new(x_request_id.clone()))
        .layer(tower_http::request_id::SetRequestIdLayer::new(x_request_id, crate::logging::MakeRequestId))
        .layer(axum::middleware::from_fn(crate::logging::sanitize_request_id))
}

fn problem(status: StatusCode, slug: &str, detail: impl Into<String>) -> Response {
    Problem::new(status, slug, detail).into_response()
}

fn needs_key(config: &ProxyConfig, method: &Method, path: &str) -> bool {
    config.methods.contains(method)
        && (config.prefixes.is_empty() || config.prefixes.iter().any(|p| path.starts_with(p)))
}

/// The client's scope: (tenant, principal).
async fn client_of(state: &ProxyState, headers: &HeaderMap) -> Result<(String, String), Response> {
    match &state.config.auth {
        ClientAuth::TrustedHeader(h) => match headers.get(h).and_then(|v| v.to_str().ok()) {
            Some(p) if idem_store::keys::validate_name("principal", p).is_ok() => {
                Ok((PROXY_TRUSTED_TENANT.into(), p.to_owned()))
            }
            _ => Err(problem(StatusCode::UNAUTHORIZED, "unauthorized", format!("missing or invalid {h} header"))),
        },
        ClientAuth::ApiKey => {
            let Some(secret) = headers.get("idem-api-key").and_then(|v| v.to_str().ok()) else {
                return Err(problem(StatusCode::UNAUTHORIZED, "unauthorized", "missing Idem-Api-Key header"));
            };
            match state.app.store.authenticate(secret.trim()).await {
                Ok(Some(k)) => Ok((proxy_tenant(&k.tenant), k.principal)),
                Ok(None) => Err(problem(StatusCode::UNAUTHORIZED, "unauthorized", "unknown or revoked API key")),
                Err(e) => Err(store_problem(e).into_response()),
            }
        }
    }
}

/// Whether the request's content type is JSON (`application/json`, `…+json`, any `…json`),
/// whose body the fingerprint takes in canonical form.
fn json_body(headers: &HeaderMap) -> bool {
    headers
        .get(axum::http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        // Media types are case-insensitive (RFC 9110 §8.3.1).
        .is_some_and(|ct| ct.split(';').next().is_some_and(|m| m.trim().to_ascii_lowercase().ends_with("json")))
}

/// The fingerprint of a request (see the module docs).
///
/// A JSON body is read as the API reads a payload ([`idem_core::Payload`], then
/// [`fingerprint`]): strings count in NFC, and a body with duplicate member names or a
/// number literal an IEEE 754 double does not carry exactly is refused — else
/// `{"amount":1e-400}` would share the fingerprint of `{"amount":0}` and be answered with
/// that request's stored response. The body is forwarded as received either way.
///
/// # Errors
/// The reason, for a 400 `invalid-request`: a JSON body idem cannot fingerprint faithfully.
pub fn request_fingerprint(
    config: &ProxyConfig,
    method: &Method,
    path_and_query: &str,
    headers: &HeaderMap,
    body: &[u8],
) -> Result<String, String> {
    let body_part = if body.is_empty() {
        Value::Null
    } else if json_body(headers) {
        let p: idem_core::Payload =
            serde_json::from_slice(body).map_err(|e| format!("the JSON body is not valid for idem: {e}"))?;
        json!({"json": p.0})
    } else {
        json!({"sha256": idem_core::fingerprint::sha256_hex(body)})
    };
    let mut hs = serde_json::Map::new();
    for h in &config.fingerprint_headers {
        let v = headers.get_all(h).iter().filter_map(|v| v.to_str().ok()).collect::<Vec<_>>().join(", ");
        hs.insert(h.as_str().to_owned(), Value::String(v));
    }
    let v = json!({"method": method.as_str(), "path": path_and_query, "body": body_part, "headers": hs});
    fingerprint(&v, None).map(|f| f.0).map_err(|e| e.to_string())
}

/// A stored upstream answer, as kept in the record's `result`.
fn stored_answer(config: &ProxyConfig, status: StatusCode, headers: &HeaderMap, body: &[u8]) -> Value {
    let keep = |n: &HeaderName| {
        matches!(n.as_str(), "content-type" | "content-encoding" | "location" | "etag" | "content-language")
            || config.stored_headers.contains(n)
    };
    let hs: Vec<Value> = headers
        .iter()
        .filter(|(n, _)| keep(n))
        .filter_map(|(n, v)| v.to_str().ok().map(|v| json!([n.as_str(), v])))
        .collect();
    if body.len() > config.max_stored_bytes {
        json!({"status": status.as_u16(), "headers": hs, "body_omitted": true, "body_bytes": body.len()})
    } else {
        json!({"status": status.as_u16(), "headers": hs, "body_b64": base64::engine::general_purpose::STANDARD.encode(body)})
    }
}

/// Rebuilds a response from [`stored_answer`].
fn replay(stored: &Value) -> Response {
    let status = stored["status"].as_u64().and_then(|s| StatusCode::from_u16(s as u16).ok()).unwrap_or(StatusCode::OK);
    let body = stored["body_b64"]
        .as_str()
        .and_then(|b| base64::engine::general_purpose::STANDARD.decode(b).ok())
        .unwrap_or_default();
    let mut resp = Response::new(Body::from(body));
    *resp.status_mut() = status;
    let h = resp.headers_mut();
    for pair in stored["headers"].as_array().into_iter().flatten() {
        if let (Some(n), Some(v)) = (pair[0].as_str(), pair[1].as_str())
            && let (Ok(n), Ok(v)) = (HeaderName::from_bytes(n.as_bytes()), HeaderValue::from_str(v))
        {
            h.append(n, v);
        }
    }
    if stored["body_omitted"] == true {
        h.insert("idem-body-omitted", HeaderValue::from_static("true"));
    }
    h.insert("idempotent-replayed", HeaderValue::from_static("true"));
    resp
}

fn forwardable(headers: &HeaderMap) -> HeaderMap {
    let mut out = HeaderMap::new();
    for (n, v) in headers {
        if !HOP_BY_HOP.contains(&n.as_str()) && n != "idem-api-key" && n != "content-length" {
            out.append(n.clone(), v.clone());
        }
    }
    out
}

/// A policy that releases the key at once after a 408/425/429 or a 5xx that proves
/// nothing was done: the client's retry is forwarded again (the client, not the proxy,
/// decides when to retry).
fn release_policy() -> RetryPolicy {
    RetryPolicy { base_ms: 1, cap_ms: 1, max_attempts: i64::MAX, max_elapsed_ms: None }
}

async fn handle(State(state): State<ProxyState>, req: Request) -> Response {
    let (parts, body) = req.into_parts();
    let path_and_query = parts.uri.path_and_query().map_or("/", |p| p.as_str()).to_owned();
    let body = match to_bytes(body, state.config.max_request_bytes).await {
        Ok(b) => b,
        Err(_) => {
            return problem(
                StatusCode::PAYLOAD_TOO_LARGE,
                "payload-too-large",
                format!("the request body is larger than {} bytes", state.config.max_request_bytes),
            );
        }
    };
    if !needs_key(&state.config, &parts.method, parts.uri.path()) {
        return forward(&state, &parts.method, &path_and_query, &parts.headers, body, None).await.map_or_else(
            |e| problem(StatusCode::BAD_GATEWAY, "upstream-unreachable", e),
            |(status, headers, bytes)| rebuild(status, &headers, bytes),
        );
    }
    let (tenant, principal) = match client_of(&state, &parts.headers).await {
        Ok(c) => c,
        Err(r) => return r,
    };
    tracing::Span::current().record("tenant", tenant.as_str());
    let mut keys = parts.headers.get_all("idempotency-key").iter();
    let raw_key = match (keys.next(), keys.next()) {
        (None, _) => {
            return problem(
                StatusCode::BAD_REQUEST,
                "missing-idempotency-key",
                "this route needs an Idempotency-Key header",
            );
        }
        (Some(_), Some(_)) => {
            return problem(StatusCode::BAD_REQUEST, "invalid-idempotency-key", "more than one Idempotency-Key header");
        }
        (Some(v), None) => {
            match v
                .to_str()
                .map_err(|_| "the Idempotency-Key header is not ASCII".to_string())
                .and_then(crate::operations::sf_string)
            {
                Ok(k) => k,
                Err(e) => return problem(StatusCode::BAD_REQUEST, "invalid-idempotency-key", e),
            }
        }
    };
    let key = match IdempotencyKey::parse(&raw_key) {
        Ok(k) => k,
        Err(e) => return problem(StatusCode::BAD_REQUEST, "invalid-idempotency-key", e.to_string()),
    };
    // Stored as `principal/key`, which must itself be a key the operator API can address.
    // In the log from here on, so a refusal below (415, bad JSON) names its key too.
    let store_key = format!("{principal}/{key}");
    crate::logging::record_key(&store_key);
    // A JSON body is fingerprinted by its canonical form, which compression hides: 415, as
    // the API. Any other body is fingerprinted as the bytes sent, compressed or not.
    if json_body(&parts.headers)
        && let Some(p) = crate::json::content_coding_refused(&parts.headers)
    {
        return p.into_response();
    }
    let deduplicates = *state.config.provider_deduplicates.for_path(parts.uri.path());
    let fp = match request_fingerprint(&state.config, &parts.method, &path_and_query, &parts.headers, &body) {
        Ok(f) => f,
        Err(e) => return problem(StatusCode::BAD_REQUEST, "invalid-request", e),
    };
    if store_key.len() > idem_core::key::MAX_KEY_LEN {
        return problem(
            StatusCode::BAD_REQUEST,
            "invalid-idempotency-key",
            format!(
                "the Idempotency-Key may have at most {} characters here: the proxy keeps it as \"{principal}/<key>\", \
                 and a key has at most {} characters",
                idem_core::key::MAX_KEY_LEN - principal.len() - 1,
                idem_core::key::MAX_KEY_LEN
            ),
        );
    }
    let actor = Actor { principal: principal.clone(), request_id: None };
    let input = AcquireInput {
        tenant: tenant.clone(),
        key: store_key.clone(),
        action: format!("proxy:{}", parts.method),
        payload: json!({
            "method": parts.method.as_str(),
            "path": path_and_query,
            "idempotency_key": key.as_str(),
            "upstream_key": upstream_key(&tenant, &store_key),
        }),
        fingerprint: fp,
        lease_ms: state.config.timeout.as_millis() as i64 + 10_000,
        // A deduplicating upstream makes forwarding again safe, also after a lease that
        // expired because the proxy died mid-request (DESIGN.md §2 invariant 4).
        redo_safe: deduplicates,
        // Always the same, with or without --lookup-url: the connector is part of the
        // intent, and a config change must not turn retries into 422s.
        connector: Some(PROXY_LOOKUP.to_owned()),
        holder: None,
        actor: actor.clone(),
    };
    let out = match state.app.store.acquire(input).await {
        Ok(o) => o,
        Err(e) => return store_problem(e).into_response(),
    };
    let rid = crate::auth::request_id(&parts.headers);
    state.app.answered_trigger(&out.decision, &tenant, &store_key, rid);
    match out.decision {
        Decision::Acquire => {}
        Decision::Replay => {
            return match &out.record.result {
                Some(stored) => replay(stored),
                // Settled by an operator: there is no upstream answer to replay.
                None => {
                    let mut r = (
                        StatusCode::OK,
                        axum::Json(json!({"state": out.record.state.as_str(), "provider_ref": out.record.provider_ref, "error": (out.record.state == idem_core::State::Failed).then_some(&out.record.error_message), "note": "settled by the upstream's lookup or an operator; no upstream answer was stored"})),
                    )
                        .into_response();
                    r.headers_mut().insert("idempotent-replayed", HeaderValue::from_static("true"));
                    r
                }
            };
        }
        Decision::InProgress { retry_after_ms } | Decision::RetryNotDue { retry_after_ms } => {
            let mut p =
                Problem::new(StatusCode::CONFLICT, "operation-in-progress", "a request with this key is in flight");
            p.retry_after_ms = Some(retry_after_ms);
            return p.into_response();
        }
        // The proxy names no holder (it forwards every request itself): never answered.
        Decision::AlreadyHeld => {
            return problem(StatusCode::CONFLICT, "operation-in-progress", "a request with this key is in flight");
        }
        Decision::Unknown | Decision::ExpireToUnknown => {
            return problem(
                StatusCode::CONFLICT,
                "outcome-unknown",
                "an earlier request with this key reached the upstream and its outcome is unknown; it will not be forwarded again until the upstream's lookup or an operator settles it",
            );
        }
        Decision::Mismatch => {
            return problem(
                StatusCode::UNPROCESSABLE_ENTITY,
                "fingerprint-mismatch",
                "this key was used with another request",
            );
        }
        Decision::Late => {
            return problem(
                StatusCode::GONE,
                "late-arrival",
                "this key's request completed and its record outlived its retention window",
            );
        }
    }
    let token = out.record.fencing_token;
    let outcome_unknown = state.config.outcome_unknown.for_path(parts.uri.path());
    let sent_key = upstream_key(&tenant, &store_key);
    let (outcome, response) =
        match forward(&state, &parts.method, &path_and_query, &parts.headers, body, Some(&sent_key)).await {
            Ok((status, headers, bytes)) => match upstream_answer(status, outcome_unknown, deduplicates) {
                UpstreamAnswer::Unknown => (
                    Outcome::Unknown {
                        message: Some(format!("the upstream answered {status} after it received the request")),
                    },
                    unknown_outcome_problem(
                        status,
                        &format!("the upstream answered {status}, which does not prove it did nothing"),
                    ),
                ),
                UpstreamAnswer::Release => (
                    Outcome::RetryableFailure {
                        error_class: format!("http_{}", status.as_u16()),
                        message: None,
                        retry_after_ms: Some(0),
                    },
                    rebuild(status, &headers, bytes),
                ),
                // The client reads the upstream's own answer (its retry logic may, e.g. a
                // Stripe SDK's `Stripe-Should-Retry`); its retry is forwarded with the same key.
                UpstreamAnswer::ReleaseAmbiguous => (
                    Outcome::AmbiguousRetryable {
                        error_class: format!("http_{}", status.as_u16()),
                        message: Some(format!(
                            "the upstream answered {status}; it deduplicates by the key, so a retry is forwarded"
                        )),
                        retry_after_ms: Some(0),
                    },
                    rebuild(status, &headers, bytes),
                ),
                UpstreamAnswer::Store => {
                    let stored = Some(stored_answer(&state.config, status, &headers, &bytes));
                    let outcome = if status.is_success() {
                        Outcome::Succeeded { provider_ref: format!("http {}", status.as_u16()), result: stored }
                    } else {
                        Outcome::FinalFailure {
                            error_class: format!("http_{}", status.as_u16()),
                            message: None,
                            result: stored,
                        }
                    };
                    (outcome, rebuild(status, &headers, bytes))
                }
            },
            Err(ForwardError::NotSent(e)) => (
                Outcome::RetryableFailure {
                    error_class: "connect".into(),
                    message: Some(e.clone()),
                    retry_after_ms: Some(0),
                },
                problem(
                    StatusCode::BAD_GATEWAY,
                    "upstream-unreachable",
                    format!("the upstream could not be reached; nothing was sent: {e}"),
                ),
            ),
            Err(ForwardError::Unknown { timeout, message }) if deduplicates => (
                Outcome::AmbiguousRetryable {
                    error_class: if timeout { "timeout" } else { "connection" }.into(),
                    message: Some(message.clone()),
                    retry_after_ms: Some(0),
                },
                problem(
                    if timeout { StatusCode::GATEWAY_TIMEOUT } else { StatusCode::BAD_GATEWAY },
                    "upstream-no-answer",
                    format!(
                        "the request reached the upstream but no complete answer came back ({message}); the upstream \
                     deduplicates by Idempotency-Key, so send it again with the same key: it will be forwarded"
                    ),
                ),
            ),
            Err(ForwardError::Unknown { timeout, message }) => (
                Outcome::Unknown { message: Some(message.clone()) },
                unknown_outcome_problem(
                    if timeout { StatusCode::GATEWAY_TIMEOUT } else { StatusCode::BAD_GATEWAY },
                    &format!("the request reached the upstream but no complete answer came back ({message})"),
                ),
            ),
        };
    let req = CompleteRequest {
        tenant,
        key: store_key,
        fencing_token: token,
        outcome,
        actor,
        policy: Some(release_policy()),
    };
    if let Err(e) = state.app.store.complete(req).await {
        tracing::error!(error = %e, "proxy: recording the upstream's answer failed");
    }
    response
}

/// Why forwarding failed.
enum ForwardError {
    /// Nothing reached the upstream.
    NotSent(String),
    /// The request may have been processed.
    Unknown { timeout: bool, message: String },
}

impl From<ForwardError> for String {
    fn from(e: ForwardError) -> String {
        match e {
            ForwardError::NotSent(m) | ForwardError::Unknown { message: m, .. } => m,
        }
    }
}

/// The `Idempotency-Key` the upstream is sent for a client's key: the client's key scoped
/// by its tenant and principal (`{tenant}/{principal}/{key}`, or `sha256:` and the 64 hex
/// digits of that when it is longer than 255 bytes). Two clients that happen to pick the
/// same key are two requests to an upstream that deduplicates by the key, as they are in
/// the proxy's ledger (break-it finding: client B was answered with client A's charge and
/// its own never made). The same client's retry is sent the same key.
pub(super) fn upstream_key(tenant: &str, store_key: &str) -> String {
    let scoped = format!("{tenant}/{store_key}");
    if scoped.len() <= idem_core::key::MAX_KEY_LEN {
        scoped
    } else {
        format!("sha256:{}", idem_core::fingerprint::sha256_hex(scoped.as_bytes()))
    }
}

/// Forwards a request. With `idempotency_key` (a keyed request, whose answer may be stored
/// and replayed to later requests), the client's `Idempotency-Key` is replaced by it, in the
/// client's form (bare or an RFC 8941 quoted string), and `Accept-Encoding` is not passed
/// on: the upstream answers in the identity coding, so a replay is readable by a client
/// that asks differently (break-it finding: a gzip answer was replayed without its
/// `Content-Encoding`).
async fn forward(
    state: &ProxyState,
    method: &Method,
    path_and_query: &str,
    headers: &HeaderMap,
    body: Bytes,
    idempotency_key: Option<&str>,
) -> Result<(StatusCode, HeaderMap, Bytes), ForwardError> {
    let mut headers = forwardable(headers);
    if let Some(k) = idempotency_key {
        let quoted = headers.get("idempotency-key").and_then(|v| v.to_str().ok()).is_some_and(|v| v.starts_with('"'));
        let value = if quoted { format!("\"{k}\"") } else { k.to_owned() };
        let value = HeaderValue::from_str(&value).map_err(|e| ForwardError::NotSent(e.to_string()))?;
        headers.insert("idempotency-key", value);
        headers.remove("accept-encoding");
    }
    let url = state
        .config
        .upstream
        .join(path_and_query.trim_start_matches('/'))
        .map_err(|e| ForwardError::NotSent(e.to_string()))?;
    let method =
        reqwest::Method::from_bytes(method.as_str().as_bytes()).map_err(|e| ForwardError::NotSent(e.to_string()))?;
    let resp = state.client.request(method, url).headers(headers).body(body).send().await.map_err(|e| {
        // Errors never carry the upstream's URL to clients.
        let e = e.without_url();
        if e.is_connect() {
            ForwardError::NotSent(e.to_string())
        } else {
            let message = if e.is_timeout() {
                "no answer within the timeout".to_string()
            } else {
                format!("the connection failed: {e}")
            };
            ForwardError::Unknown { timeout: e.is_timeout(), message }
        }
    })?;
    let status = resp.status();
    let headers = resp.headers().clone();
    let bytes = resp.bytes().await.map_err(|e| {
        let e = e.without_url();
        ForwardError::Unknown { timeout: e.is_timeout(), message: format!("the answer was cut off: {e}") }
    })?;
    Ok((status, headers, bytes))
}

fn rebuild(status: StatusCode, headers: &HeaderMap, bytes: Bytes) -> Response {
    let mut resp = Response::new(Body::from(bytes));
    *resp.status_mut() = status;
    for (n, v) in headers {
        if !HOP_BY_HOP.contains(&n.as_str()) && n != "content-length" {
            resp.headers_mut().append(n.clone(), v.clone());
        }
    }
    resp
}
