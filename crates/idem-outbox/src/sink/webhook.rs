//! The webhook sink: `POST` the payload to an endpoint, signed as the Standard Webhooks
//! specification says (see [`crate::signature`]): `webhook-id` = the event id (constant
//! across attempts: the receiver dedupes by it), `webhook-timestamp` = this attempt's time
//! in seconds, `webhook-signature` = one `v1,…` per configured secret (two during a
//! rotation). The event's headers go along; `content-type: application/json`.
//!
//! Answers, by what they prove (idem-connect's `http_status`, read as for a receiver that
//! dedupes): 2xx ⇒ delivered (evidence `HTTP <status>`); 408, 425, 429, 503 ⇒ retryable
//! (`Retry-After` honoured); a connect failure ⇒ retryable; 500, 502, 504 and other 5xx, a
//! timeout or a reset after sending ⇒ unknown, retried; other 4xx, 501, 505, 511 ⇒ rejected
//! (dead); a redirect (never followed) ⇒ rejected (`redirect`: fix the URL, then redrive).

use super::{Envelope, Sink};
use crate::relay::config::WebhookSinkConfig;
use crate::signature::{WebhookSecret, signature_header};
use async_trait::async_trait;
use idem_connect::config::ConfigError;
use idem_connect::http::{classify_error, read_capped, retry_after_ms};
use idem_connect::http_status::{Answer, classify};
use idem_core::Outcome;
use idem_core::outbox::DeliveryResult;

/// Bytes of a receiver's answer read, at most: enough for [`idem_core::text::SNIPPET_CHARS`]
/// characters of any encoding; the rest is not read.
const SNIPPET_BYTES: usize = 4 * idem_core::text::SNIPPET_CHARS;

/// A configured webhook endpoint.
#[derive(Debug)]
pub struct WebhookSink {
    client: reqwest::Client,
    url: reqwest::Url,
    secrets: Vec<WebhookSecret>,
}

impl WebhookSink {
    /// Builds the sink `name`: resolves and checks its secrets now.
    ///
    /// # Errors
    /// A [`ConfigError`] naming the field (`outbox.sinks.NAME.secrets[1]: …`, `….url`).
    pub fn new(name: &str, c: &WebhookSinkConfig) -> Result<Self, ConfigError> {
        let field = format!("outbox.sinks.{name}");
        let url = idem_connect::config::interpolate(&format!("{field}.url"), &c.url)?;
        let url =
            reqwest::Url::parse(&url).ok().filter(|u| matches!(u.scheme(), "http" | "https")).ok_or_else(|| {
                ConfigError { field: format!("{field}.url"), message: "must be an http:// or https:// URL".into() }
            })?;
        let mut secrets = Vec::new();
        for (i, s) in c.secrets.iter().enumerate() {
            let f = format!("{field}.secrets[{i}]");
            let secret = s.resolve(&f)?;
            secrets.push(
                WebhookSecret::parse(secret.expose()).map_err(|e| ConfigError { field: f, message: e.to_string() })?,
            );
        }
        let client = idem_connect::http::client(c.timeout_ms, c.connect_timeout_ms).map_err(|e| ConfigError {
            field: format!("{field}.url"),
            message: format!("cannot build the HTTP client: {e}"),
        })?;
        Ok(WebhookSink { client, url, secrets })
    }
}

#[async_trait]
impl Sink for WebhookSink {
    async fn deliver(&self, e: &Envelope<'_>) -> DeliveryResult {
        let ts = e.now_ms.div_euclid(1000);
        let signature = signature_header(&self.secrets, e.id, ts, e.payload.as_bytes());
        let mut req = self
            .client
            .post(self.url.clone())
            .header("content-type", "application/json")
            .header("webhook-id", e.id)
            .header("webhook-timestamp", ts.to_string())
            .header("webhook-signature", signature);
        // Framing and connection headers are refused at append; one stored before that
        // check (or written into the table by hand) is dropped here, never sent.
        for (k, v) in e.headers.iter().filter(|(k, _)| !idem_core::outbox::is_reserved_header(k)) {
            req = req.header(k.as_str(), v.as_str());
        }
        let resp = match req.body(e.payload.to_owned()).send().await {
            Ok(r) => r,
            // Receivers dedupe by webhook-id, so an ambiguous failure is retried.
            Err(err) => {
                return match classify_error(err, true) {
                    Outcome::RetryableFailure { error_class, message, retry_after_ms } => {
                        DeliveryResult::Retryable { error_class, message: message.unwrap_or_default(), retry_after_ms }
                    }
                    Outcome::FinalFailure { error_class, message, .. } => {
                        DeliveryResult::Rejected { error_class, message: message.unwrap_or_default() }
                    }
                    Outcome::AmbiguousRetryable { error_class, message, .. } => {
                        DeliveryResult::Unknown { error_class, message: message.unwrap_or_default() }
                    }
                    other => DeliveryResult::Unknown { error_class: "unknown".into(), message: format!("{other:?}") },
                };
            }
        };
        let status = resp.status();
        let retry_after = retry_after_ms(resp.headers());
        // Only the start of the answer is kept, as text every store accepts (a receiver's
        // error page may be gzip, UTF-16 or hold a zero byte: issue 28 §8).
        let (body, _) = read_capped(resp, SNIPPET_BYTES).await;
        let snippet = idem_core::text::snippet(&body, idem_core::text::SNIPPET_CHARS);
        match classify(status.as_u16(), true) {
            Answer::Succeeded => DeliveryResult::Delivered { evidence: format!("HTTP {}", status.as_u16()) },
            Answer::NotProcessed { class } => DeliveryResult::Retryable {
                error_class: class.into(),
                message: format!("HTTP {status}: {snippet}"),
                retry_after_ms: retry_after,
            },
            Answer::Ambiguous { class } => {
                DeliveryResult::Unknown { error_class: class.into(), message: format!("HTTP {status}: {snippet}") }
            }
            Answer::Redirect => DeliveryResult::Rejected {
                error_class: "redirect".into(),
                message: format!("HTTP {status}: a redirect, not followed; fix the sink's url"),
            },
            Answer::Refused { class } => {
                DeliveryResult::Rejected { error_class: class.into(), message: format!("HTTP {status}: {snippet}") }
            }
        }
    }
}
