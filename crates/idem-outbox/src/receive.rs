//! Receiving webhooks: verify a Standard Webhooks message, then claim its `webhook-id` in
//! the inbox, in one step (the typestate of svix-bridge's receiver: only a verified
//! message can be claimed).
//!
//! ```no_run
//! # async fn f(pool: sqlx::PgPool, secrets: Vec<idem_outbox::signature::WebhookSecret>,
//! #            headers: std::collections::HashMap<String, String>, body: Vec<u8>, now_s: i64)
//! #            -> Result<(), Box<dyn std::error::Error>> {
//! use idem_outbox::receive::Unverified;
//! use idem_outbox::InboxDecision;
//! let msg = Unverified::new(|h| headers.get(h).cloned(), body)?;  // 400 if a header is missing
//! let msg = msg.verify(&secrets, now_s)?;                          // 401 if the signature fails
//! let mut t = pool.begin().await?;
//! match msg.claim(&mut *t, "orders-receiver").await? {
//!     InboxDecision::Apply => { /* apply msg.payload()? here, in t */ }
//!     InboxDecision::Duplicate { .. } => {}      // a redelivery: answer 2xx, do nothing
//!     InboxDecision::Conflict { .. } => {}       // same webhook-id, other body: report it
//! }
//! t.commit().await?;                            // then answer 2xx
//! # Ok(()) }
//! ```
//!
//! Answer 2xx only after the commit: a sender retries anything else, and the retry finds
//! the claim.

use crate::conn::Conn;
use crate::error::OutboxError;
use crate::inbox::{claim_message, content_fingerprint};
use crate::signature::{DEFAULT_TOLERANCE_S, WebhookError, WebhookSecret, verify};
use idem_core::fingerprint::sha256_hex;
use idem_core::inbox::InboxDecision;
use serde_json::Value;

/// A received message whose signature is not checked yet.
#[derive(Debug, Clone)]
pub struct Unverified {
    id: String,
    timestamp: String,
    signature: String,
    body: Vec<u8>,
}

/// A message whose signature matched one of the receiver's secrets.
#[derive(Debug, Clone)]
pub struct Verified {
    id: String,
    body: Vec<u8>,
}

impl Unverified {
    /// Reads `webhook-id`, `webhook-timestamp` and `webhook-signature` through `header`
    /// (a lookup by lower-case name).
    ///
    /// # Errors
    /// [`WebhookError::MissingHeader`].
    pub fn new(header: impl Fn(&str) -> Option<String>, body: Vec<u8>) -> Result<Self, WebhookError> {
        let get = |name: &'static str| header(name).ok_or(WebhookError::MissingHeader(name));
        Ok(Unverified {
            id: get("webhook-id")?,
            timestamp: get("webhook-timestamp")?,
            signature: get("webhook-signature")?,
            body,
        })
    }

    /// Verifies the signature with `secrets` (either one during a rotation) and the
    /// timestamp against `now_s` (epoch seconds) within 5 minutes.
    ///
    /// # Errors
    /// A [`WebhookError`].
    pub fn verify(self, secrets: &[WebhookSecret], now_s: i64) -> Result<Verified, WebhookError> {
        verify(secrets, &self.id, &self.timestamp, &self.signature, &self.body, now_s, DEFAULT_TOLERANCE_S)?;
        Ok(Verified { id: self.id, body: self.body })
    }
}

impl Verified {
    /// `webhook-id`: the message id (idem's event id).
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The body.
    pub fn body(&self) -> &[u8] {
        &self.body
    }

    /// The body as JSON.
    ///
    /// # Errors
    /// serde_json's error when it is not JSON.
    pub fn payload(&self) -> Result<Value, serde_json::Error> {
        serde_json::from_slice(&self.body)
    }

    /// The content's fingerprint: that of the JSON body (RFC 8785, so the sender's
    /// formatting does not matter), or SHA-256 of the bytes when the body is not JSON.
    /// Headers, which change on every redelivery, are not part of it.
    pub fn fingerprint(&self) -> String {
        match self.payload().ok().and_then(|v| content_fingerprint(&v).ok()) {
            Some(fp) => fp.0,
            None => sha256_hex(&self.body),
        }
    }

    /// Claims `webhook-id` for `consumer` in the transaction of `conn` (see
    /// [`crate::inbox`]).
    ///
    /// # Errors
    /// As [`crate::inbox::claim_message`].
    pub async fn claim<'c>(&self, conn: impl Into<Conn<'c>>, consumer: &str) -> Result<InboxDecision, OutboxError> {
        claim_message(conn, consumer, &self.id, &self.fingerprint()).await
    }
}
