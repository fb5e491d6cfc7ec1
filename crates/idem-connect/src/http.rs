//! The HTTP connector (reqwest): sends the payload as JSON to a configured URL with the
//! operation's key in `Idempotency-Key`, and looks operations up by a URL template.
//!
//! Classification, by what the answer proves (DESIGN.md §4; the status table is in
//! [`crate::http_status`]):
//! - 2xx ⇒ succeeded; the provider's reference comes from a JSON pointer or a header
//!   (falling back to the `Idempotency-Key` sent, which the provider accepted);
//! - connection refused or DNS failure (nothing was sent) ⇒ retryable (`connect`);
//! - 408, 425, 429, 503 (the provider says it did not process the request) ⇒ retryable
//!   (`unavailable`, `rate_limited`), `Retry-After` (delta-seconds) honoured;
//! - other 4xx, and 501, 505, 511 ⇒ final (`validation`, `auth`, `not_found`, `conflict`,
//!   `too_large`, `client_error`, `server_error`);
//! - 500, 502, 504 and every other 5xx, a timeout or a reset after the request was sent ⇒
//!   ambiguous: the provider may have acted, so the outcome is UNKNOWN and the reconciler
//!   asks the lookup (or, without one, an operator reviews it) — unless the connector
//!   declares `provider_deduplicates = true`: the provider answers a repeated
//!   `Idempotency-Key` with the first request's result, so these are retried
//!   ([`Outcome::AmbiguousRetryable`], class `server_error`, `timeout` or `connection`;
//!   UNKNOWN if the attempts run out), and its 409 means "still in progress" (retried,
//!   `in_progress`);
//! - a redirect (never followed) ⇒ UNKNOWN.
//!
//! The client never retries or follows redirects by itself: exactly one layer retries.

use crate::config::{ConfigError, HeaderValueConfig, HttpConfig, check_template, interpolate};
use crate::connector::{Connector, OperationCtx, ambiguous, final_failure, retryable, unknown};
use crate::http_status::{Answer, classify};
use async_trait::async_trait;
use idem_core::{Lookup, Outcome};
use reqwest::Method;
use reqwest::header::{HeaderMap, HeaderName, HeaderValue};
use serde_json::Value;
use std::time::Duration;

/// A configured HTTP connector.
#[derive(Debug)]
pub struct HttpConnector {
    name: String,
    client: reqwest::Client,
    method: Method,
    url: String,
    headers: HeaderMap,
    ref_pointer: Option<String>,
    ref_header: Option<HeaderName>,
    lookup: Option<crate::config::HttpLookupConfig>,
    lease_ms: i64,
    max_call_ms: i64,
    provider_deduplicates: bool,
}

/// An HTTP client that never retries and never follows a redirect (exactly one layer
/// retries, and a redirect proves nothing), with a whole-request and a connect timeout
/// (ms). Shared with the relay's webhook sink.
///
/// # Errors
/// reqwest's, when the TLS stack cannot be set up.
pub fn client(timeout_ms: u64, connect_timeout_ms: u64) -> reqwest::Result<reqwest::Client> {
    reqwest::Client::builder()
        .timeout(Duration::from_millis(timeout_ms))
        .connect_timeout(Duration::from_millis(connect_timeout_ms))
        .redirect(reqwest::redirect::Policy::none())
        .retry(reqwest::retry::never())
        .build()
}

/// Replaces `{key}`, `{tenant}`, `{idempotency_key}` with percent-encoded values.
fn fill(template: &str, op: &OperationCtx) -> String {
    fn enc(s: &str) -> String {
        s.bytes()
            .map(|b| {
                if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
                    (b as char).to_string()
                } else {
                    format!("%{b:02X}")
                }
            })
            .collect()
    }
    template
        .replace("{key}", &enc(&op.key))
        .replace("{tenant}", &enc(&op.tenant))
        .replace("{idempotency_key}", &enc(&op.provider_key()))
}

/// Longest wait a `Retry-After` can ask for: one day, in ms.
pub const MAX_RETRY_AFTER_MS: i64 = 86_400_000;

/// `Retry-After` in ms from now (RFC 9110 §10.2.3: delay-seconds or an HTTP-date), at most
/// [`MAX_RETRY_AFTER_MS`]: a delay too large for any integer type is that cap, an HTTP-date
/// in the past is 0. `None` when absent or neither form. Shared with the relay's webhook
/// sink.
pub fn retry_after_ms(headers: &HeaderMap) -> Option<i64> {
    let v = headers.get(reqwest::header::RETRY_AFTER)?.to_str().ok()?.trim();
    retry_after_at(v, std::time::SystemTime::now())
}

fn retry_after_at(v: &str, now: std::time::SystemTime) -> Option<i64> {
    if !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()) {
        let secs = v.parse::<i64>().unwrap_or(i64::MAX);
        return Some(secs.saturating_mul(1000).min(MAX_RETRY_AFTER_MS));
    }
    let at = httpdate::parse_http_date(v).ok()?;
    let ms = at.duration_since(now).map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
    Some(ms.min(MAX_RETRY_AFTER_MS))
}

impl HttpConnector {
    /// Builds the connector, resolving secrets and checking templates.
    ///
    /// # Errors
    /// A [`ConfigError`] naming the field (`connectors.NAME.url`, `….headers.X`, …).
    pub fn new(name: &str, c: &HttpConfig) -> Result<Self, ConfigError> {
        let field = format!("connectors.{name}");
        let bad = |f: &str, m: String| ConfigError { field: format!("{field}.{f}"), message: m };
        let url = interpolate(&format!("{field}.url"), &c.url)?;
        check_template(&format!("{field}.url"), &url)?;
        let method = Method::from_bytes(c.method.to_ascii_uppercase().as_bytes())
            .map_err(|_| bad("method", format!("not an HTTP method: {}", c.method)))?;
        let mut headers = HeaderMap::new();
        for (k, v) in &c.headers {
            let hfield = format!("{field}.headers.{k}");
            let name = HeaderName::from_bytes(k.as_bytes())
                .map_err(|_| bad("headers", format!("{k:?} is not a header name")))?;
            let (text, sensitive) = match v {
                HeaderValueConfig::Plain(t) => (interpolate(&hfield, t)?, false),
                HeaderValueConfig::Secret(s) => (s.resolve(&hfield)?.expose().to_owned(), true),
            };
            let mut value = HeaderValue::from_str(&text)
                .map_err(|_| ConfigError { field: hfield.clone(), message: "not a valid header value".into() })?;
            value.set_sensitive(sensitive);
            headers.insert(name, value);
        }
        let (ref_pointer, ref_header) = match &c.provider_ref {
            None => (None, None),
            Some(p) => {
                if let Some(ptr) = &p.json_pointer
                    && !ptr.starts_with('/')
                {
                    return Err(bad("provider_ref.json_pointer", "a JSON pointer starts with /".into()));
                }
                if p.json_pointer.is_some() == p.header.is_some() {
                    return Err(bad("provider_ref", "give exactly one of json_pointer or header".into()));
                }
                let header = p
                    .header
                    .as_deref()
                    .map(|h| {
                        HeaderName::from_bytes(h.as_bytes())
                            .map_err(|_| bad("provider_ref.header", format!("{h:?} is not a header name")))
                    })
                    .transpose()?;
                (p.json_pointer.clone(), header)
            }
        };
        let lookup = match &c.lookup {
            None => None,
            Some(l) => {
                let mut l = l.clone();
                l.url = interpolate(&format!("{field}.lookup.url"), &l.url)?;
                check_template(&format!("{field}.lookup.url"), &l.url)?;
                if !l.found_pointer.starts_with('/') {
                    return Err(bad("lookup.found_pointer", "a JSON pointer starts with /".into()));
                }
                if let Some(s) = l.absent_statuses.iter().find(|s| !(400..=499).contains(*s)) {
                    return Err(bad(
                        "lookup.absent_statuses",
                        format!("{s} cannot prove absence: only 4xx statuses can"),
                    ));
                }
                if l.absent_after_ms < 0 {
                    return Err(bad("lookup.absent_after_ms", "must not be negative".into()));
                }
                Some(l)
            }
        };
        if c.timeout_ms == 0 || c.connect_timeout_ms == 0 {
            return Err(bad("timeout_ms", "timeouts must be positive".into()));
        }
        let lease_ms = c.lease_ms.unwrap_or(c.timeout_ms as i64 + 10_000);
        if lease_ms <= c.timeout_ms as i64 {
            return Err(bad(
                "lease_ms",
                format!("must exceed timeout_ms ({}), or a lease could expire under a live call", c.timeout_ms),
            ));
        }
        let client = client(c.timeout_ms, c.connect_timeout_ms)
            .map_err(|e| bad("url", format!("cannot build the HTTP client: {e}")))?;
        Ok(HttpConnector {
            name: name.to_owned(),
            client,
            method,
            url,
            headers,
            ref_pointer,
            ref_header,
            lookup,
            lease_ms,
            max_call_ms: c.timeout_ms as i64,
            provider_deduplicates: c.provider_deduplicates,
        })
    }

    fn provider_ref(&self, headers: &HeaderMap, body: &Value, fallback: String) -> String {
        let from_header =
            self.ref_header.as_ref().and_then(|h| headers.get(h)).and_then(|v| v.to_str().ok()).map(str::to_owned);
        let from_body = self.ref_pointer.as_deref().and_then(|p| body.pointer(p)).and_then(|v| match v {
            Value::String(s) => Some(s.clone()),
            Value::Number(n) => Some(n.to_string()),
            _ => None,
        });
        // A reference the ledger cannot keep as evidence (empty, too long, control
        // characters: `Outcome::validate`) would leave the effect unrecorded: use the
        // fallback, which names the operation.
        let keepable = |r: &String| {
            !r.trim().is_empty()
                && r.len() <= idem_core::completion::MAX_PROVIDER_REF_LEN
                && !r.chars().any(char::is_control)
        };
        from_header.filter(keepable).or(from_body.filter(keepable)).unwrap_or(fallback)
    }
}

/// Largest provider answer read and kept in a result (bytes): 1 MiB, as a request body.
pub const MAX_ANSWER_BYTES: usize = 1 << 20;

/// Reads at most `cap` bytes of `resp`'s body: the bytes, and whether that was all of it (a
/// body that fails midway counts as not whole).
pub async fn read_capped(mut resp: reqwest::Response, cap: usize) -> (Vec<u8>, bool) {
    let mut out = Vec::new();
    loop {
        match resp.chunk().await {
            Ok(Some(chunk)) if out.len() + chunk.len() <= cap => out.extend_from_slice(&chunk),
            Ok(Some(chunk)) => {
                out.extend_from_slice(&chunk[..cap - out.len()]);
                return (out, false);
            }
            Ok(None) => return (out, true),
            Err(_) => return (out, false),
        }
    }
}

/// Classifies a transport error: before the request left ⇒ retryable; after ⇒ ambiguous
/// (UNKNOWN, or retried when the provider deduplicates: `provider_deduplicates`).
/// The URL is left out of the message: it may carry a token interpolated from `${VAR}`.
/// Shared with the relay's webhook sink (whose receivers dedupe by `webhook-id`).
pub fn classify_error(e: reqwest::Error, provider_deduplicates: bool) -> Outcome {
    let e = e.without_url();
    if e.is_connect() {
        retryable("connect", format!("could not connect, nothing was sent: {e}"), None)
    } else if e.is_builder() {
        final_failure("invalid_request", format!("the request could not be built: {e}"))
    } else if e.is_timeout() {
        ambiguous(provider_deduplicates, "timeout", format!("timed out after the request was sent: {e}"), None)
    } else {
        ambiguous(
            provider_deduplicates,
            "connection",
            format!("the connection failed after the request was sent: {e}"),
            None,
        )
    }
}

#[async_trait]
impl Connector for HttpConnector {
    async fn execute(&self, op: &OperationCtx) -> Outcome {
        let url = fill(&self.url, op);
        let request = self
            .client
            .request(self.method.clone(), &url)
            .headers(self.headers.clone())
            .header("idempotency-key", op.provider_key())
            .json(&op.payload);
        let resp = match request.send().await {
            Ok(r) => r,
            Err(e) => {
                let outcome = classify_error(e, self.provider_deduplicates);
                tracing::warn!(connector = %self.name, outcome = outcome.name(), "HTTP attempt failed");
                return outcome;
            }
        };
        let status = resp.status();
        let headers = resp.headers().clone();
        // The status decides; a body we cannot read (cut off, not JSON, too large) does not
        // undo it.
        let (bytes, whole) = read_capped(resp, MAX_ANSWER_BYTES).await;
        let snippet = || idem_core::text::snippet(&bytes, idem_core::text::SNIPPET_CHARS);
        match classify(status.as_u16(), self.provider_deduplicates) {
            Answer::Succeeded => {
                let parsed = match (whole, bytes.is_empty()) {
                    (false, _) => Err(format!("the answer is larger than {MAX_ANSWER_BYTES} bytes; it is not kept")),
                    (true, true) => Ok(Value::Null),
                    (true, false) => serde_json::from_slice::<Value>(&bytes)
                        .map_err(|e| format!("the answer is not JSON idem can read ({e}); it is not kept")),
                };
                let body = parsed.as_ref().cloned().unwrap_or(Value::Null);
                let provider_ref = self.provider_ref(&headers, &body, op.provider_key());
                let mut result = serde_json::json!({"status": status.as_u16(), "body": body});
                let omitted = match parsed {
                    Err(why) => Some(why),
                    Ok(_) => idem_core::check_depth(&result).err().map(|why| format!("{why}: the answer is not kept")),
                };
                if let Some(why) = omitted {
                    result = serde_json::json!({"status": status.as_u16(), "body": null, "body_omitted": why});
                }
                Outcome::Succeeded { provider_ref, result: Some(result) }
            }
            Answer::NotProcessed { class } => {
                retryable(class, format!("HTTP {status}: {}", snippet()), retry_after_ms(&headers))
            }
            Answer::Ambiguous { class } => ambiguous(
                self.provider_deduplicates,
                class,
                format!("HTTP {status} after the request was sent; the provider may have acted: {}", snippet()),
                retry_after_ms(&headers),
            ),
            // A 303 after a POST often means "created, look here"; 307/308 mean "not
            // processed". Without following it, nobody knows: ask the lookup.
            Answer::Redirect => {
                unknown(format!("HTTP {status}: a redirect, not followed; the provider may have acted"))
            }
            Answer::Refused { class } => Outcome::FinalFailure {
                error_class: class.into(),
                message: Some(format!("HTTP {status}: {}", snippet())),
                result: Some(serde_json::json!({"status": status.as_u16()})),
            },
        }
    }

    async fn lookup(&self, op: &OperationCtx) -> Lookup {
        let Some(l) = &self.lookup else {
            return Lookup::Inconclusive { why: format!("connector {} has no lookup configured", self.name) };
        };
        let url = fill(&l.url, op);
        let resp = match self.client.get(&url).headers(self.headers.clone()).send().await {
            Ok(r) => r,
            Err(e) => return Lookup::Inconclusive { why: format!("lookup failed: {}", e.without_url()) },
        };
        let status = resp.status();
        let absent = if l.absent_statuses.contains(&status.as_u16()) {
            true
        } else if !status.is_success() {
            return Lookup::Inconclusive { why: format!("lookup answered HTTP {status}") };
        } else {
            match resp.json::<Value>().await {
                Ok(body) => match body.pointer(&l.found_pointer) {
                    Some(Value::String(s)) if !s.is_empty() => return Lookup::Found { provider_ref: s.clone() },
                    Some(Value::Number(n)) => return Lookup::Found { provider_ref: n.to_string() },
                    // Only an empty answer proves absence; a non-empty one without the
                    // reference means the pointer or the lookup is misconfigured.
                    None if body == Value::Array(vec![]) || body == Value::Null => true,
                    None => {
                        return Lookup::Inconclusive {
                            why: format!("the lookup's answer is not empty but has nothing at {}", l.found_pointer),
                        };
                    }
                    Some(other) => {
                        return Lookup::Inconclusive {
                            why: format!("lookup's {} is not a reference: {other}", l.found_pointer),
                        };
                    }
                },
                Err(e) => {
                    return Lookup::Inconclusive { why: format!("lookup's answer is not JSON: {}", e.without_url()) };
                }
            }
        };
        // A provider may still be processing a request whose reply timed out: "not found"
        // proves absence only once the attempt has had time to settle.
        let since = op.now_ms - op.updated_at;
        if absent && since < l.absent_after_ms {
            return Lookup::TooEarly {
                why: format!("not found {since} ms after the attempt; absence counts after {} ms", l.absent_after_ms),
                retry_in_ms: l.absent_after_ms - since,
            };
        }
        Lookup::Absent
    }

    fn lease_ms(&self) -> i64 {
        self.lease_ms
    }

    fn max_call_ms(&self) -> i64 {
        self.max_call_ms
    }

    fn can_look_up(&self) -> bool {
        self.lookup.is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn templates_are_filled_percent_encoded() {
        let op = OperationCtx {
            tenant: "acme".into(),
            key: "ORD 1/2".into(),
            action: "a".into(),
            payload: Value::Null,
            fencing_token: 1,
            attempt: 1,
            updated_at: 0,
            now_ms: 0,
        };
        assert_eq!(
            fill("http://p/o?ref={idempotency_key}&k={key}", &op),
            "http://p/o?ref=acme%3AORD%201%2F2&k=ORD%201%2F2"
        );
    }

    #[test]
    fn retry_after_in_seconds_or_as_a_date() {
        let mut h = HeaderMap::new();
        h.insert(reqwest::header::RETRY_AFTER, HeaderValue::from_static("2"));
        assert_eq!(retry_after_ms(&h), Some(2000));
        let now = std::time::UNIX_EPOCH + std::time::Duration::from_secs(1_445_412_470); // 07:27:50
        // The break-it run's receiver: a date 10 s ahead was ignored, the event dead in 2 s.
        assert_eq!(retry_after_at("Wed, 21 Oct 2015 07:28:00 GMT", now), Some(10_000));
        assert_eq!(retry_after_at("Wednesday, 21-Oct-15 07:28:00 GMT", now), Some(10_000), "RFC 850 form");
        assert_eq!(retry_after_at("Wed Oct 21 07:28:00 2015", now), Some(10_000), "asctime form");
        assert_eq!(retry_after_at("Wed, 21 Oct 2015 07:27:00 GMT", now), Some(0), "in the past: now");
        assert_eq!(retry_after_at("Sun, 21 Oct 2035 07:28:00 GMT", now), Some(MAX_RETRY_AFTER_MS), "capped");
        assert_eq!(retry_after_at("99999999999999999999", now), Some(MAX_RETRY_AFTER_MS), "too large: the cap");
        assert_eq!(retry_after_at("120", now), Some(120_000));
        for bad in ["", "-1", "1.5", "soon", "2 s"] {
            assert_eq!(retry_after_at(bad, now), None, "{bad:?}");
        }
    }
}
