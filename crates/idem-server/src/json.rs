//! Request extractors whose rejections are RFC 9457 problems instead of axum's plain text.

use crate::problem::Problem;
use axum::extract::rejection::{JsonRejection, QueryRejection};
use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::StatusCode;
use axum::http::request::Parts;
use serde::de::DeserializeOwned;

/// A JSON body; malformed JSON, wrong types and unknown fields are 400 `invalid-request`,
/// a body over the limit 413 `payload-too-large`, a non-JSON content type or any
/// `Content-Encoding` but `identity` 415 (RFC 9110 §15.5.16).
#[derive(Debug)]
pub struct ApiJson<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for ApiJson<T> {
    type Rejection = Problem;

    /// Parses with plain `serde_json::from_slice` and only on failure again with axum's
    /// `Json::from_bytes`, whose path tracking (serde_path_to_error) names the failing
    /// field in the message but costs about a third more per parse: the same answers, the
    /// cost only on bad input. A non-JSON content type goes to axum's extractor whole, so
    /// its rule (`application/json` or a `+json` suffix) and rejection stay axum's.
    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let rid = crate::auth::request_id(req.headers()).map(str::to_owned);
        if let Some(p) = content_coding_refused(req.headers()) {
            return Err(p.with_request_id(rid.as_deref()));
        }
        let problem = |r: JsonRejection| json_problem(&r).with_request_id(rid.as_deref());
        if !json_content_type(req.headers()) {
            return match axum::Json::<T>::from_request(req, state).await {
                Ok(axum::Json(v)) => Ok(ApiJson(v)),
                Err(r) => Err(problem(r)),
            };
        }
        let bytes = axum::body::Bytes::from_request(req, state).await.map_err(|r| problem(r.into()))?;
        match serde_json::from_slice(&bytes) {
            Ok(v) => Ok(ApiJson(v)),
            Err(_) => match axum::Json::<T>::from_bytes(&bytes) {
                Ok(axum::Json(v)) => Ok(ApiJson(v)),
                Err(r) => Err(problem(r)),
            },
        }
    }
}

/// 415 `unsupported-media-type` for a body with a `Content-Encoding` other than
/// `identity` (RFC 9110 §15.5.16: a content coding the server does not support): idem
/// reads, fingerprints and stores bodies as sent, so a compressed one cannot be read as
/// the JSON it carries. Used by the API's extractor and by `idem proxy` for a JSON body on a keyed route.
pub(crate) fn content_coding_refused(headers: &axum::http::HeaderMap) -> Option<Problem> {
    let coding = headers.get(axum::http::header::CONTENT_ENCODING)?;
    if coding.as_bytes().eq_ignore_ascii_case(b"identity") {
        return None;
    }
    let detail = format!(
        "Content-Encoding {:?} is not supported: send the body uncompressed",
        String::from_utf8_lossy(coding.as_bytes())
    );
    Some(Problem::new(StatusCode::UNSUPPORTED_MEDIA_TYPE, "unsupported-media-type", detail))
}

/// axum's rule for a JSON body (axum 0.8 `json_content_type`): `Content-Type` parses as a
/// media type `application/json` or `application/*+json`, parameters allowed.
fn json_content_type(headers: &axum::http::HeaderMap) -> bool {
    headers
        .get(axum::http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<mime::Mime>().ok())
        .is_some_and(|m| {
            m.type_() == "application" && (m.subtype() == "json" || m.suffix().is_some_and(|s| s == "json"))
        })
}

fn json_problem(rejection: &JsonRejection) -> Problem {
    match rejection {
        JsonRejection::MissingJsonContentType(_) => Problem::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported-media-type",
            "expected Content-Type: application/json",
        ),
        JsonRejection::BytesRejection(b) if b.status() == StatusCode::PAYLOAD_TOO_LARGE => Problem::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "payload-too-large",
            "the request body is larger than the server accepts",
        ),
        JsonRejection::JsonSyntaxError(e) => {
            Problem::invalid(format!("the body is not valid JSON: {}", source_text(e)))
        }
        JsonRejection::JsonDataError(e) => {
            Problem::invalid(format!("the body does not fit the schema: {}", without_type_names(&source_text(e))))
        }
        other => Problem::invalid(other.body_text()),
    }
}

/// serde's "expected struct AcquireBody with 9 elements" names one of our Rust types,
/// which means nothing to a caller: it is "a JSON object" (the OpenAPI document has the
/// fields).
fn without_type_names(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(i) = rest.find("struct ") {
        out.push_str(&rest[..i]);
        let after = &rest[i + "struct ".len()..];
        let name_len = after.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(after.len());
        if name_len == 0 {
            out.push_str("struct ");
            rest = after;
            continue;
        }
        let mut tail = &after[name_len..];
        if let Some(t) = tail.strip_prefix(" with ")
            && let Some(end) = t.find(" elements")
            && t[..end].bytes().all(|b| b.is_ascii_digit())
        {
            tail = &t[end + " elements".len()..];
        }
        out.push_str("a JSON object");
        rest = tail;
    }
    out.push_str(rest);
    out
}

/// The innermost error message (serde's, with line and column), without axum's prefix,
/// with a hint where serde's own words do not say what is wrong.
fn source_text(e: &dyn std::error::Error) -> String {
    let mut cur: &dyn std::error::Error = e;
    while let Some(next) = cur.source() {
        cur = next;
    }
    let text = cur.to_string();
    let hint = idem_core::payload::json_error_hint(&text);
    format!("{text}{hint}")
}

/// Query parameters; a malformed query is 400 `invalid-request`.
#[derive(Debug)]
pub struct ApiQuery<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequestParts<S> for ApiQuery<T> {
    type Rejection = Problem;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        match axum::extract::Query::<T>::from_request_parts(parts, state).await {
            Ok(axum::extract::Query(v)) => Ok(ApiQuery(v)),
            Err(e) => {
                let rid = crate::auth::request_id(&parts.headers);
                Err(Problem::invalid(query_text(&e)).with_request_id(rid))
            }
        }
    }
}

fn query_text(e: &QueryRejection) -> String {
    format!("invalid query string: {}", source_text(e))
}

/// A `{key}` (or `{id}`) path segment, percent-decoded; one that is not UTF-8 is 400
/// `invalid-idempotency-key` instead of axum's plain text.
#[derive(Debug)]
pub struct ApiPath(pub String);

impl<S: Send + Sync> FromRequestParts<S> for ApiPath {
    type Rejection = Problem;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        match axum::extract::Path::<String>::from_request_parts(parts, state).await {
            Ok(axum::extract::Path(v)) => Ok(ApiPath(v)),
            Err(e) => {
                let rid = crate::auth::request_id(&parts.headers);
                Err(Problem::new(
                    StatusCode::BAD_REQUEST,
                    "invalid-idempotency-key",
                    format!("the path segment is not acceptable: {}", source_text(&e)),
                )
                .with_request_id(rid))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn serde_type_names_become_json_words() {
        let f = super::without_type_names;
        assert_eq!(
            f("invalid type: sequence, expected struct AcquireBody with 9 elements at line 1 column 2"),
            "invalid type: sequence, expected a JSON object at line 1 column 2"
        );
        assert_eq!(
            f("invalid type: string \"x\", expected struct RerunBody"),
            "invalid type: string \"x\", expected a JSON object"
        );
        assert_eq!(f("missing field `key`"), "missing field `key`");
        assert_eq!(f("a struct  alone"), "a struct  alone");
    }
}
