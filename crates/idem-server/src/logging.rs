//! Request logging: one span per HTTP request, one access-log line per response.
//!
//! The span `request` carries `request_id` (the `x-request-id` header, generated when
//! absent), `method`, `route` (the route template, e.g. `/v1/operations/{key}`, never the
//! raw path, which would hold the key), `tenant` (once authenticated), `key_hash` (first 16
//! hex digits of the key's SHA-256, [`idem_core::key::log_hash`]) and `key` (the raw key,
//! left empty when [`set_redact_keys`] asked for redaction). Every event logged while the
//! request runs carries these fields (with `--log-format json`, as the `span` object).
//!
//! The access log (`target: idem::access`, INFO) logs `status` and `latency_ms` when the
//! response is ready; silence it with `RUST_LOG=info,idem::access=off`.
//!
//! A client may send its own `x-request-id` to correlate its logs with idem's event log;
//! [`sanitize_request_id`] keeps it only when it is 1–128 characters of
//! `[A-Za-z0-9._:-]` and otherwise lets idem generate one, so a request id never carries
//! markup, quotes or kilobytes into logs and the event log. A kept one is marked
//! [`ClientRequestId`]: only the client's own request id can name a lease holder (a
//! resend of the same request carries the same one); a generated one never does.

use axum::body::Body;
use axum::http::{Request, Response};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
use tower_http::classify::{ServerErrorsAsFailures, SharedClassifier};
use tower_http::trace::{DefaultOnRequest, TraceLayer};
use tracing::Span;
use tracing::field::Empty;

static REDACT_KEYS: AtomicBool = AtomicBool::new(false);

/// With `true`, logs carry only the key's hash, never the raw key (`--redact-keys`).
pub fn set_redact_keys(on: bool) {
    REDACT_KEYS.store(on, Ordering::Relaxed);
}

/// Whether raw keys are kept out of logs.
pub fn redact_keys() -> bool {
    REDACT_KEYS.load(Ordering::Relaxed)
}

/// Records the operation's key on the current request span: its hash always, the raw key
/// unless redaction is on. Nothing (not even the hash) when the span is disabled, e.g.
/// `RUST_LOG=warn`: the SHA-256 was ~4 500 instructions a request for nobody
/// (scripts/callgrind.sh runs with `RUST_LOG=warn`).
pub fn record_key(key: &str) {
    let span = Span::current();
    if span.is_disabled() {
        return;
    }
    span.record("key_hash", idem_core::key::log_hash(key).as_str());
    if !redact_keys() {
        span.record("key", key);
    }
}

fn make_span(req: &Request<Body>) -> Span {
    let request_id = crate::auth::request_id(req.headers()).unwrap_or("");
    tracing::info_span!(
        "request",
        request_id,
        method = %req.method(),
        route = Empty,
        tenant = Empty,
        key_hash = Empty,
        key = Empty,
    )
}

fn on_response(resp: &Response<Body>, latency: Duration, _span: &Span) {
    tracing::info!(
        target: "idem::access",
        status = resp.status().as_u16(),
        latency_ms = latency.as_secs_f64() * 1000.0,
        "request finished"
    );
}

/// The tower-http trace layer with idem's span and access log.
pub type IdemTraceLayer = TraceLayer<
    SharedClassifier<ServerErrorsAsFailures>,
    fn(&Request<Body>) -> Span,
    DefaultOnRequest,
    fn(&Response<Body>, Duration, &Span),
>;

/// The trace layer [`crate::router`] installs.
pub fn trace_layer() -> IdemTraceLayer {
    TraceLayer::new_for_http()
        .make_span_with(make_span as fn(&Request<Body>) -> Span)
        .on_response(on_response as fn(&Response<Body>, Duration, &Span))
}

/// [`IdemTraceLayer`] without its ERROR line for a 5xx answer.
pub type ProxiedTraceLayer = TraceLayer<
    SharedClassifier<ServerErrorsAsFailures>,
    fn(&Request<Body>) -> Span,
    DefaultOnRequest,
    fn(&Response<Body>, Duration, &Span),
    tower_http::trace::DefaultOnBodyChunk,
    tower_http::trace::DefaultOnEos,
    (),
>;

/// The trace layer of what `idem proxy` forwards: the same span and access line, but a
/// 5xx is the upstream's answer passed on, not a failure of idem's, so it gets no ERROR
/// line of its own (the access line has its status).
pub fn proxied_trace_layer() -> ProxiedTraceLayer {
    trace_layer().on_failure(())
}

/// Longest client-supplied request id kept, in bytes.
pub const MAX_REQUEST_ID_LEN: usize = 128;

/// Request extension: the `x-request-id` is the client's own (kept by
/// [`sanitize_request_id`]), not one idem generated.
#[derive(Debug, Clone, Copy)]
pub struct ClientRequestId;

/// Middleware (outermost): drops an `x-request-id` that is empty, longer than
/// [`MAX_REQUEST_ID_LEN`] or has a character outside `[A-Za-z0-9._:-]`; the request-id
/// layer then generates a UUID for it. A kept one is marked with [`ClientRequestId`]. A
/// request id correlates logs and answers; it never names a lease holder (frameworks and
/// gateways propagate one id along a chain of calls, so several attempts would share it).
pub async fn sanitize_request_id(
    mut req: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    let headers = req.headers_mut();
    let mut values = headers.get_all("x-request-id").iter();
    let kept = match (values.next(), values.next()) {
        (Some(v), None) => is_kept_request_id(v.as_bytes()),
        _ => false,
    };
    if kept {
        req.extensions_mut().insert(ClientRequestId);
    } else {
        req.headers_mut().remove("x-request-id");
    }
    next.run(req).await
}

/// Whether a client's `x-request-id` is kept: 1–[`MAX_REQUEST_ID_LEN`] bytes of
/// `[A-Za-z0-9._:-]` (safe in logs and headers as it is).
pub fn is_kept_request_id(id: &[u8]) -> bool {
    !id.is_empty()
        && id.len() <= MAX_REQUEST_ID_LEN
        && id.iter().all(|c| c.is_ascii_alphanumeric() || b"._:-".contains(c))
}

/// Makes the `x-request-id` of a request that came without a usable one: a random UUID
/// (version 4, RFC 9562 §5.4), lowercase hyphenated, as tower-http's `MakeRequestUuid`
/// makes, but from the thread's userspace generator (`rand::rng()`, a ChaCha generator
/// seeded from the OS) instead of one `getrandom` system call per request. A request id
/// correlates logs and answers; it is no secret.
#[derive(Debug, Clone, Copy, Default)]
pub struct MakeRequestId;

impl tower_http::request_id::MakeRequestId for MakeRequestId {
    fn make_request_id<B>(&mut self, _: &axum::http::Request<B>) -> Option<tower_http::request_id::RequestId> {
        use rand::RngExt;
        let id = uuid::Builder::from_random_bytes(rand::rng().random()).into_uuid();
        let mut text = [0u8; uuid::fmt::Hyphenated::LENGTH];
        let text = id.hyphenated().encode_lower(&mut text);
        axum::http::HeaderValue::from_str(text).ok().map(tower_http::request_id::RequestId::new)
    }
}

#[cfg(test)]
mod request_id_tests {
    use super::MakeRequestId;
    use tower_http::request_id::MakeRequestId as _;

    #[test]
    fn generated_request_ids_are_distinct_version_4_uuids() {
        let req = axum::http::Request::new(());
        let mut make = MakeRequestId;
        let ids: std::collections::HashSet<String> = (0..1000)
            .map(|_| {
                let id = make.make_request_id(&req).expect("an id");
                let text = id.header_value().to_str().unwrap().to_owned();
                let parsed = uuid::Uuid::parse_str(&text).unwrap();
                assert_eq!(parsed.get_version_num(), 4, "{text}");
                assert_eq!(text, parsed.hyphenated().to_string(), "lowercase hyphenated");
                text
            })
            .collect();
        assert_eq!(ids.len(), 1000);
    }
}
