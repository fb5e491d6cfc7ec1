//! The inbox: a consumer applies each message once (DESIGN.md §8).
//!
//! Before applying a message, claim its id for this consumer *in the same transaction as
//! the business update*; then [`finish`] with an outcome and commit. The claim and the
//! update commit together or not at all, so a crash between them leaves neither, and the
//! redelivery applies it. A redelivery of a committed message finds the claim:
//! [`InboxDecision::Duplicate`] with the recorded outcome — acknowledge it and do nothing.
//! The same id with other content is [`InboxDecision::Conflict`]: not applied, counted on
//! the claim (commit to keep the count) — report it.
//!
//! ```no_run
//! # async fn f(pool: sqlx::PgPool, msg_id: &str, body: serde_json::Value) -> Result<(), Box<dyn std::error::Error>> {
//! use idem_outbox::inbox::{self, InboxDecision};
//! let mut t = pool.begin().await?;
//! let fp = inbox::content_fingerprint(&body)?;
//! match inbox::claim_message(&mut *t, "billing", msg_id, fp.as_str()).await? {
//!     InboxDecision::Apply => {
//!         sqlx::query("UPDATE accounts SET balance = balance + 10 WHERE id = 7").execute(&mut *t).await?;
//!         inbox::finish(&mut *t, "billing", msg_id, &serde_json::json!({"credited": 10})).await?;
//!     }
//!     InboxDecision::Duplicate { .. } => {}                 // already applied: acknowledge
//!     InboxDecision::Conflict { .. } => eprintln!("message {msg_id} reused with other content"),
//! }
//! t.commit().await?;
//! # Ok(()) }
//! ```
//!
//! The fingerprint covers the content the producer declares (the payload), never headers
//! that change on redelivery. On PostgreSQL this runs `idem.claim` / `idem.finish`, the
//! functions behind `idem.inbox_claim` / `idem.inbox_finish`, which other languages call.

use crate::claims::{claim, finish as finish_id};
use crate::conn::Conn;
use crate::error::OutboxError;
use idem_core::fingerprint::{Fingerprint, fingerprint};
pub use idem_core::inbox::InboxDecision;
use idem_core::inbox::{InboxError, check_id};

/// A consumer name: 1–255 printable ASCII, not starting with `idem.` (idem's own, e.g. the
/// claimed idempotency keys).
fn check_consumer(consumer: &str) -> Result<(), OutboxError> {
    check_id("consumer", consumer)?;
    if consumer.starts_with("idem.") {
        return Err(InboxError::Reserved.into());
    }
    Ok(())
}
use serde_json::Value;

/// The fingerprint of a message's content: SHA-256 of its RFC 8785 form (strings in NFC),
/// 64 hex digits — what idem's relay and the Rust receivers use.
///
/// # Errors
/// [`OutboxError::Fingerprint`] for member names equal after NFC.
pub fn content_fingerprint(content: &Value) -> Result<Fingerprint, OutboxError> {
    Ok(fingerprint(content, None)?)
}

/// Claims `message_id` for `consumer` with the content's `fingerprint`, in the transaction
/// of `conn`.
///
/// # Errors
/// [`OutboxError::Inbox`] for a consumer, id or fingerprint that is empty, over 255 bytes
/// or not printable ASCII, or a consumer named `idem.…`; [`OutboxError::NotInstalled`];
/// database errors.
pub async fn claim_message<'c>(
    conn: impl Into<Conn<'c>>,
    consumer: &str,
    message_id: &str,
    fingerprint: &str,
) -> Result<InboxDecision, OutboxError> {
    check_consumer(consumer)?;
    check_id("message id", message_id)?;
    check_id("fingerprint", fingerprint)?;
    claim(conn.into(), consumer, message_id, fingerprint).await
}

/// Records `outcome` on the claim (same transaction); a redelivery's
/// [`InboxDecision::Duplicate`] carries it.
///
/// # Errors
/// [`OutboxError::NotClaimed`] without a claim; database errors.
pub async fn finish<'c>(
    conn: impl Into<Conn<'c>>,
    consumer: &str,
    message_id: &str,
    outcome: &Value,
) -> Result<(), OutboxError> {
    check_consumer(consumer)?;
    finish_id(conn.into(), consumer, message_id, outcome).await
}
