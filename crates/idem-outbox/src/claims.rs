//! The claim both [`crate::tx`] (a key) and [`crate::inbox`] (a message id) make: insert
//! the claim or read the one recorded, and answer with idem-core's
//! [`decide_inbox`](idem_core::inbox::decide_inbox). On PostgreSQL the SQL functions
//! `idem.key_claim` / `idem.inbox_claim` do it (the same code other languages call); on
//! SQLite these statements.
//!
//! Concurrency: two transactions claiming the same id at once meet on the primary key.
//! The second one's insert waits for the first one's commit (PostgreSQL), or for the write
//! lock (SQLite, `BEGIN IMMEDIATE`), and then reads the committed claim: a duplicate or a
//! conflict, never a second apply. If the first rolls back, the second applies.

use crate::conn::{Conn, SQLITE_NOW_MS};
use crate::error::OutboxError;
use idem_core::inbox::{InboxDecision, InboxRecord, decide_inbox};
use serde_json::Value;

/// What is claimed.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Target<'a> {
    /// An idempotency key (table `keys`).
    Key(&'a str),
    /// A consumer's message id (table `inbox`).
    Inbox { consumer: &'a str, message_id: &'a str },
}

impl Target<'_> {
    /// (SQLite table, its outcome column, the WHERE clause on the id).
    fn sqlite(&self) -> (&'static str, &'static str, &'static str) {
        match self {
            Target::Key(_) => ("idem_keys", "result", "key = ?"),
            Target::Inbox { .. } => ("idem_inbox", "outcome", "consumer = ? AND message_id = ?"),
        }
    }

    fn bind_id<'q>(
        &self,
        q: sqlx::query::Query<'q, sqlx::Sqlite, sqlx::sqlite::SqliteArguments>,
    ) -> sqlx::query::Query<'q, sqlx::Sqlite, sqlx::sqlite::SqliteArguments>
    where
        Self: 'q,
    {
        match *self {
            Target::Key(k) => q.bind(k.to_owned()),
            Target::Inbox { consumer, message_id } => q.bind(consumer.to_owned()).bind(message_id.to_owned()),
        }
    }

    fn describe(&self) -> String {
        match self {
            Target::Key(k) => format!("key {k:?} was not claimed in this transaction: call claim first"),
            Target::Inbox { consumer, message_id } => {
                format!("consumer {consumer:?} has no claim for message {message_id:?}: call claim_message first")
            }
        }
    }
}

fn decision(name: &str, outcome: Option<Value>, recorded: Option<String>) -> InboxDecision {
    match name {
        "apply" => InboxDecision::Apply,
        "duplicate" => InboxDecision::Duplicate { outcome },
        _ => InboxDecision::Conflict { recorded_fingerprint: recorded.unwrap_or_default() },
    }
}

/// Claims `target` with `fingerprint` in the transaction of `conn`.
pub(crate) async fn claim(conn: Conn<'_>, target: Target<'_>, fingerprint: &str) -> Result<InboxDecision, OutboxError> {
    match conn {
        Conn::Postgres(c) => {
            let row: (String, Option<Value>, Option<String>) = match target {
                Target::Key(k) => {
                    sqlx::query_as("SELECT decision, result, recorded_fingerprint FROM idem.key_claim($1, $2)")
                        .bind(k)
                        .bind(fingerprint)
                        .fetch_one(c)
                        .await?
                }
                Target::Inbox { consumer, message_id } => {
                    sqlx::query_as("SELECT decision, outcome, recorded_fingerprint FROM idem.inbox_claim($1, $2, $3)")
                        .bind(consumer)
                        .bind(message_id)
                        .bind(fingerprint)
                        .fetch_one(c)
                        .await?
                }
            };
            Ok(decision(&row.0, row.1, row.2))
        }
        Conn::Sqlite(c) => {
            let (table, outcome_col, by_id) = target.sqlite();
            let cols = match target {
                Target::Key(_) => "key",
                Target::Inbox { .. } => "consumer, message_id",
            };
            let marks = match target {
                Target::Key(_) => "?",
                Target::Inbox { .. } => "?, ?",
            };
            let insert = format!(
                "INSERT INTO {table} ({cols}, fingerprint, claimed_at) VALUES ({marks}, ?, {SQLITE_NOW_MS}) ON CONFLICT DO NOTHING"
            );
            let inserted = target
                .bind_id(sqlx::query(sqlx::AssertSqlSafe(insert)))
                .bind(fingerprint.to_owned())
                .execute(&mut *c)
                .await?
                .rows_affected();
            if inserted == 1 {
                return Ok(InboxDecision::Apply);
            }
            let select = format!("SELECT fingerprint, {outcome_col} FROM {table} WHERE {by_id}");
            let row = target.bind_id(sqlx::query(sqlx::AssertSqlSafe(select))).fetch_one(&mut *c).await?;
            use sqlx::Row;
            let outcome: Option<String> = row.try_get(1)?;
            let recorded = InboxRecord {
                fingerprint: row.try_get(0)?,
                outcome: outcome.map(|t| serde_json::from_str(&t).unwrap_or(Value::String(t))),
            };
            let d = decide_inbox(Some(&recorded), fingerprint);
            if let InboxDecision::Conflict { .. } = d {
                let update = format!(
                    "UPDATE {table} SET conflicts = conflicts + 1, last_conflict_fingerprint = ?, \
                     last_conflict_at = {SQLITE_NOW_MS} WHERE {by_id}"
                );
                target
                    .bind_id(sqlx::query(sqlx::AssertSqlSafe(update)).bind(fingerprint.to_owned()))
                    .execute(&mut *c)
                    .await?;
            }
            Ok(d)
        }
    }
}

/// Records `outcome` on the claim of `target` (in the same transaction as the claim).
pub(crate) async fn finish(conn: Conn<'_>, target: Target<'_>, outcome: &Value) -> Result<(), OutboxError> {
    let not_claimed = |e: sqlx::Error| match e.as_database_error() {
        Some(d) if d.message().contains("call idem.") => OutboxError::NotClaimed(target.describe()),
        _ => OutboxError::from(e),
    };
    match conn {
        Conn::Postgres(c) => {
            let q = match target {
                Target::Key(k) => sqlx::query("SELECT idem.key_finish($1, $2::json)").bind(k).bind(outcome.to_string()),
                Target::Inbox { consumer, message_id } => sqlx::query("SELECT idem.inbox_finish($1, $2, $3::json)")
                    .bind(consumer)
                    .bind(message_id)
                    .bind(outcome.to_string()),
            };
            q.execute(c).await.map_err(not_claimed)?;
            Ok(())
        }
        Conn::Sqlite(c) => {
            let (table, outcome_col, by_id) = target.sqlite();
            let update = format!("UPDATE {table} SET {outcome_col} = ?, finished_at = {SQLITE_NOW_MS} WHERE {by_id}");
            let done = target
                .bind_id(sqlx::query(sqlx::AssertSqlSafe(update)).bind(outcome.to_string()))
                .execute(c)
                .await?
                .rows_affected();
            if done == 0 {
                return Err(OutboxError::NotClaimed(target.describe()));
            }
            Ok(())
        }
    }
}
