//! The proxy's own error answers in the shape the clients of the fronted API expect
//! (`--error-format`, per route): RFC 9457 problem+json, the default and idem's own, or
//! Stripe's error object, so that a Stripe SDK in front of a Stripe-style API raises its
//! own typed errors and follows its own retry rules for them.
//!
//! Only the proxy's own answers are shaped (400 missing or malformed key, 401, 409 in
//! progress, 413, 415, 422 mismatch, outcome-unknown, 502/504 on upstream failure, the
//! store's and the request body limits' problems), never an upstream's answer it passes on
//! or replays, and never idem's API under `/_idem/`.

use super::{PerRoute, ProxyState};
use crate::problem::{Problem, Rendered};
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::Response;
use serde_json::json;

/// How the proxy renders its own errors on a route (`--error-format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorFormat {
    /// RFC 9457 `application/problem+json`, as idem's API (the default).
    Problem,
    /// Stripe's error object, `{"error": {"type", "code", "message"}}` as `application/json`
    /// (docs.stripe.com/api/errors), with `Stripe-Should-Retry` and `Request-Id`
    /// (docs.stripe.com/error-low-level); see [`stripe_error`].
    Stripe,
}

/// Parses the values of `--error-format` ([`PerRoute::parse`]): `problem` or `stripe`. No
/// values: `problem` everywhere.
///
/// # Errors
/// A one-line message naming the bad value.
pub fn parse_error_formats(values: &[String]) -> Result<PerRoute<ErrorFormat>, String> {
    PerRoute::parse(values, ErrorFormat::Problem, "/v1/=stripe", |v| match v.trim() {
        "problem" => Ok(ErrorFormat::Problem),
        "stripe" => Ok(ErrorFormat::Stripe),
        other => Err(format!("{other:?} is not an error format (problem or stripe)")),
    })
}

/// One of idem's problems as Stripe's error object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct StripeError {
    /// The answer's status: the problem's, but 400 for `fingerprint-mismatch`.
    pub status: StatusCode,
    /// `type`: one of Stripe's documented types.
    pub kind: &'static str,
    /// `code`: the problem's slug with `_`, or Stripe's own code where it has one.
    pub code: String,
    /// `Stripe-Should-Retry`: `Some(true)` when a retry of the same request is safe and may
    /// succeed, `Some(false)` when it gets the same answer or must not be forwarded, `None`
    /// when the proxy cannot tell (Stripe's SDKs then go by the status).
    pub should_retry: Option<bool>,
}

/// Stripe's shape of the problem `slug` answered with `status`:
/// - `type` is `idempotency_error` for a key reused with another request
///   (`fingerprint-mismatch`; Stripe's meaning of the type), `api_error` for what failed on
///   the way to or at the upstream or the store (`outcome-unknown`, `contention`, every
///   5xx), and `invalid_request_error` for the rest (a missing or malformed key, 401, a body
///   too large, a request in progress);
/// - `code` is the slug with `_` (`outcome_unknown`), except `operation-in-progress`, which
///   is Stripe's `idempotency_key_in_use`;
/// - the status is the problem's, except `fingerprint-mismatch`: Stripe answers a reused
///   key with 400, and its SDKs raise their idempotency error only for a 400 (stripe-python
///   `_api_requestor.specific_v1_api_error`), so 400 there, not the draft's 422;
/// - `Stripe-Should-Retry: true` where nothing was done and a retry is safe and may
///   succeed (in progress, upstream unreachable, a deduplicating upstream's missing answer,
///   the store unavailable or contended, the body limits' 408/503), `false` where a retry
///   gets the same answer or must not be forwarded (every refusal of the request,
///   `fingerprint-mismatch`, `outcome-unknown`: the SDKs otherwise retry a 409 and a 5xx).
pub(super) fn stripe_error(slug: &str, status: StatusCode) -> StripeError {
    let kind = match slug {
        "fingerprint-mismatch" => "idempotency_error",
        "outcome-unknown" | "contention" => "api_error",
        _ if status.is_server_error() => "api_error",
        _ => "invalid_request_error",
    };
    let code = match slug {
        "operation-in-progress" => "idempotency_key_in_use".to_owned(),
        _ => slug.replace('-', "_"),
    };
    let should_retry = match slug {
        "operation-in-progress"
        | "retry-not-due"
        | "upstream-unreachable"
        | "upstream-no-answer"
        | "unavailable"
        | "contention"
        | "overloaded"
        | "request-timeout"
        | "clock-uncertain"
        | "not-durable" => Some(true),
        "internal" => None,
        _ => Some(false),
    };
    let status = if slug == "fingerprint-mismatch" { StatusCode::BAD_REQUEST } else { status };
    StripeError { status, kind, code, should_retry }
}

/// Middleware on everything the proxy forwards or answers itself: on a route whose format
/// is [`ErrorFormat::Stripe`], renders each of idem's own problems (marked [`Rendered`])
/// as Stripe's error object, keeping its headers (`Retry-After`, `Connection`), with
/// `Request-Id` the request's `x-request-id`. Other answers pass untouched.
pub(super) async fn shape_errors(
    State(state): State<ProxyState>,
    req: Request,
    next: axum::middleware::Next,
) -> Response {
    let format = *state.config.error_format.for_path(req.uri().path());
    let request_id = req.headers().get("x-request-id").cloned();
    let mut resp = next.run(req).await;
    if format == ErrorFormat::Problem {
        return resp;
    }
    let Some(Rendered(problem)) = resp.extensions_mut().remove::<Rendered>() else {
        return resp;
    };
    stripe_response(&problem, resp, request_id)
}

fn stripe_response(problem: &Problem, resp: Response, request_id: Option<HeaderValue>) -> Response {
    let slug = problem.kind.trim_start_matches("/problems/");
    let e = stripe_error(slug, problem.status_code());
    let body = json!({"error": {"type": e.kind, "code": e.code, "message": problem.detail}});
    let (mut parts, _) = resp.into_parts();
    parts.status = e.status;
    let h = &mut parts.headers;
    h.remove(header::CONTENT_LENGTH);
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    if let Some(retry) = e.should_retry {
        h.insert("stripe-should-retry", HeaderValue::from_static(if retry { "true" } else { "false" }));
    }
    if let Some(id) = request_id {
        h.insert("request-id", id);
    }
    Response::from_parts(parts, Body::from(body.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_formats_per_route() {
        let p = |v: &[&str]| parse_error_formats(&v.iter().map(|s| s.to_string()).collect::<Vec<_>>());
        assert_eq!(*p(&[]).unwrap().for_path("/v1/charges"), ErrorFormat::Problem, "problem+json by default");
        let f = p(&["/v1/=stripe"]).unwrap();
        assert_eq!((*f.for_path("/v1/charges"), *f.for_path("/health")), (ErrorFormat::Stripe, ErrorFormat::Problem));
        assert_eq!(*p(&["stripe", "/internal=problem"]).unwrap().for_path("/internal/x"), ErrorFormat::Problem);
        for bad in [&["json"][..], &["v1=stripe"], &["stripe", "problem"]] {
            assert!(p(bad).is_err(), "{bad:?}");
        }
        assert!(p(&["/v1=Stripe"]).unwrap_err().contains("not an error format"));
    }

    #[test]
    fn stripe_shapes_follow_stripes_types_and_retry_rules() {
        let s = |slug: &str, status: u16| stripe_error(slug, StatusCode::from_u16(status).unwrap());
        let e = s("fingerprint-mismatch", 422);
        assert_eq!((e.status.as_u16(), e.kind, e.should_retry), (400, "idempotency_error", Some(false)));
        let e = s("operation-in-progress", 409);
        assert_eq!(
            (e.status.as_u16(), e.kind, e.code.as_str()),
            (409, "invalid_request_error", "idempotency_key_in_use")
        );
        assert_eq!(e.should_retry, Some(true));
        for status in [409, 500, 502, 504] {
            let e = s("outcome-unknown", status);
            assert_eq!((e.status.as_u16(), e.kind, e.code.as_str()), (status, "api_error", "outcome_unknown"));
            assert_eq!(e.should_retry, Some(false), "never forwarded again: the SDK must not retry {status}");
        }
        for (slug, status) in [("upstream-no-answer", 504), ("upstream-unreachable", 502), ("unavailable", 503)] {
            assert_eq!((s(slug, status).kind, s(slug, status).should_retry), ("api_error", Some(true)), "{slug}");
        }
        for (slug, status) in [("missing-idempotency-key", 400), ("unauthorized", 401), ("payload-too-large", 413)] {
            let e = s(slug, status);
            assert_eq!((e.status.as_u16(), e.kind, e.should_retry), (status, "invalid_request_error", Some(false)));
            assert_eq!(e.code, slug.replace('-', "_"));
        }
        assert_eq!(s("internal", 500).should_retry, None);
    }
}
