//! One atomic boundary: claim an idempotency key, write your business rows, store the
//! result — in one transaction of your own database (DESIGN.md §8).
//!
//! ```no_run
//! # async fn f(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
//! use idem_outbox::tx::{self, Claim};
//! use serde_json::json;
//! let payload = json!({"source_batch": "B-7"});
//! let mut t = pool.begin().await?;
//! let job = match tx::claim(&mut *t, "B-7:export:v1", "export", &payload).await? {
//!     Claim::New => {
//!         sqlx::query("INSERT INTO jobs (id, batch) VALUES ('job-42', 'B-7')").execute(&mut *t).await?;
//!         let result = json!({"job": "job-42"});
//!         tx::finish(&mut *t, "B-7:export:v1", &result).await?;
//!         result
//!     }
//!     Claim::Replay(result) => result.unwrap_or_default(), // a retry: the stored result
//!     Claim::Conflict { .. } => return Err("the key was used with another payload".into()),
//! };
//! t.commit().await?; // key record, job row and result: all or nothing
//! # let _ = job; Ok(()) }
//! ```
//!
//! A crash before the commit leaves nothing (the next try claims anew); after it, the key,
//! the rows and the result all exist, and a retry with the same key and payload gets
//! [`Claim::Replay`] with the stored result. The same key with another action or payload is
//! a [`Claim::Conflict`], counted on the key's row (commit to keep that count). A second
//! transaction claiming the key while the first is open waits for its commit, then
//! replays (or claims, if the first rolled back): never two "new" claims.
//!
//! Keys are claimed in the inbox table under the consumer `idem.keys` (on PostgreSQL through
//! `idem.key_claim` / `idem.key_finish`, which other languages call too).
//!
//! This is not the idem ledger's lease protocol: no lease, no UNKNOWN. The business write
//! is local to the transaction, so its outcome is never in doubt; side effects that leave
//! the database go through the outbox ([`crate::append`]) in the same transaction.

use crate::claims::{KEYS, claim as claim_id, finish as finish_id};
use crate::conn::Conn;
use crate::error::OutboxError;
use idem_core::IdempotencyKey;
use idem_core::fingerprint::{Fingerprint, fingerprint};
use idem_core::inbox::InboxDecision;
use serde_json::{Value, json};

/// What a key claim found.
#[derive(Debug, Clone, PartialEq)]
pub enum Claim {
    /// The key is new: write the business rows, [`finish`] with the result, commit.
    New,
    /// The key was claimed and committed before with the same action and payload: do
    /// nothing; this is the result [`finish`] stored (`None` if none was).
    Replay(Option<Value>),
    /// The key was claimed with another action or payload: nothing is applied.
    Conflict {
        /// The fingerprint it was claimed with.
        recorded_fingerprint: String,
    },
}

/// The fingerprint of a key claim: SHA-256 of the RFC 8785 form of
/// `{"action": action, "payload": payload}` (strings in NFC), 64 hex digits.
///
/// # Errors
/// [`OutboxError::Fingerprint`] for member names equal after NFC.
pub fn claim_fingerprint(action: &str, payload: &Value) -> Result<Fingerprint, OutboxError> {
    Ok(fingerprint(&json!({"action": action, "payload": payload}), None)?)
}

/// Claims `key` for `action` with `payload` in the transaction of `conn`.
///
/// # Errors
/// [`OutboxError::Key`] for a key that breaks idem's key rules (1–255 printable ASCII, no
/// personal data); [`OutboxError::NotInstalled`]; database errors.
pub async fn claim<'c>(
    conn: impl Into<Conn<'c>>,
    key: &str,
    action: &str,
    payload: &Value,
) -> Result<Claim, OutboxError> {
    IdempotencyKey::parse(key)?;
    let fp = claim_fingerprint(action, payload)?;
    Ok(match claim_id(conn.into(), KEYS, key, fp.as_str()).await? {
        InboxDecision::Apply => Claim::New,
        InboxDecision::Duplicate { outcome } => Claim::Replay(outcome),
        InboxDecision::Conflict { recorded_fingerprint } => Claim::Conflict { recorded_fingerprint },
    })
}

/// Stores `result` for `key`, claimed earlier in the same transaction; a retry's
/// [`Claim::Replay`] returns it.
///
/// # Errors
/// [`OutboxError::NotClaimed`] when the key has no claim; database errors.
pub async fn finish<'c>(conn: impl Into<Conn<'c>>, key: &str, result: &Value) -> Result<(), OutboxError> {
    finish_id(conn.into(), KEYS, key, result).await
}
