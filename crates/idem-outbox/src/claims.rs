//! The claim both [`crate::tx`] (a key, under consumer [`KEYS`]) and [`crate::inbox`] (a
//! consumer's message id) make, on `idem.inbox`: insert the claim or read the one
//! recorded, and answer with idem-core's [`decide_inbox`](idem_core::inbox::decide_inbox).
//! On PostgreSQL the SQL function `idem.claim` does it — the one behind `idem.inbox_claim`
//! and `idem.key_claim`, which other languages call; on SQLite these statements.
//!
//! Concurrency: two transactions claiming the same id at once meet on the primary key.
//! The second one's insert waits for the first one's commit (PostgreSQL), or for the write
//! lock (SQLite, `BEGIN IMMEDIATE`), and then reads the committed claim: a duplicate or a
//! conflict, never a second apply. If the first rolls back, the second applies.

use crate::conn::{Conn, SQLITE_NOW_MS};
use crate::error::OutboxError;
use idem_core::inbox::{InboxDecision, InboxRecord, decide_inbox};
use serde_json::Value;

/// The consumer under which idempotency keys are claimed (names starting with `idem.` are
/// idem's own: `idem.inbox_claim` refuses them).
pub(crate) const KEYS: &str = "idem.keys";

/// Claims `id` for `consumer` with `fingerprint` in the transaction of `conn`.
pub(crate) async fn claim(
    conn: Conn<'_>,
    consumer: &str,
    id: &str,
    fingerprint: &str,
) -> Result<InboxDecision, OutboxError> {
    match conn {
        Conn::Postgres(c) => {
            let (decision, outcome, recorded): (String, Option<Value>, Option<String>) =
                sqlx::query_as("SELECT decision, outcome, recorded_fingerprint FROM idem.claim($1, $2, $3)")
                    .bind(consumer)
                    .bind(id)
                    .bind(fingerprint)
                    .fetch_one(c)
                    .await?;
            Ok(match decision.as_str() {
                "apply" => InboxDecision::Apply,
                "duplicate" => InboxDecision::Duplicate { outcome },
                _ => InboxDecision::Conflict { recorded_fingerprint: recorded.unwrap_or_default() },
            })
        }
        Conn::Sqlite(c) => {
            let inserted = sqlx::query(sqlx::AssertSqlSafe(format!(
                "INSERT INTO idem_inbox (consumer, message_id, fingerprint, claimed_at) \
                 VALUES (?, ?, ?, {SQLITE_NOW_MS}) ON CONFLICT DO NOTHING"
            )))
            .bind(consumer)
            .bind(id)
            .bind(fingerprint)
            .execute(&mut *c)
            .await?
            .rows_affected();
            if inserted == 1 {
                return Ok(InboxDecision::Apply);
            }
            let (recorded, outcome): (String, Option<String>) =
                sqlx::query_as("SELECT fingerprint, outcome FROM idem_inbox WHERE consumer = ? AND message_id = ?")
                    .bind(consumer)
                    .bind(id)
                    .fetch_one(&mut *c)
                    .await?;
            let outcome = outcome.map(|t| serde_json::from_str(&t).unwrap_or(Value::String(t)));
            let d = decide_inbox(Some(&InboxRecord { fingerprint: recorded, outcome }), fingerprint);
            if let InboxDecision::Conflict { .. } = d {
                sqlx::query(sqlx::AssertSqlSafe(format!(
                    "UPDATE idem_inbox SET conflicts = conflicts + 1, last_conflict_fingerprint = ?, \
                     last_conflict_at = {SQLITE_NOW_MS} WHERE consumer = ? AND message_id = ?"
                )))
                .bind(fingerprint)
                .bind(consumer)
                .bind(id)
                .execute(&mut *c)
                .await?;
            }
            Ok(d)
        }
    }
}

/// Records `outcome` on the claim of `id` by `consumer` (in the claim's transaction).
pub(crate) async fn finish(conn: Conn<'_>, consumer: &str, id: &str, outcome: &Value) -> Result<(), OutboxError> {
    let not_claimed = || {
        OutboxError::NotClaimed(if consumer == KEYS {
            format!("key {id:?} was not claimed: call claim first")
        } else {
            format!("consumer {consumer:?} has no claim for message {id:?}: call claim_message first")
        })
    };
    let done =
        match conn {
            Conn::Postgres(c) => sqlx::query("SELECT idem.finish($1, $2, $3::json)")
                .bind(consumer)
                .bind(id)
                .bind(outcome.to_string())
                .execute(c)
                .await
                .map(|_| true)
                .or_else(|e| match e.as_database_error() {
                    Some(d) if d.message().starts_with("idem: nothing was claimed") => Ok(false),
                    _ => Err(e),
                })?,
            Conn::Sqlite(c) => sqlx::query(sqlx::AssertSqlSafe(format!(
                "UPDATE idem_inbox SET outcome = ?, finished_at = {SQLITE_NOW_MS} WHERE consumer = ? AND message_id = ?"
            )))
            .bind(outcome.to_string())
            .bind(consumer)
            .bind(id)
            .execute(c)
            .await?
            .rows_affected()
                == 1,
        };
    if done { Ok(()) } else { Err(not_claimed()) }
}
