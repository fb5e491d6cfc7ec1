//! `append`: an outbox event, written in the caller's transaction.
//!
//! The event commits with the business write or not at all: no "row written, event lost"
//! and no "event sent, row rolled back" (the dual-write window). The relay reads committed
//! events only.
//!
//! On PostgreSQL this calls `idem.outbox_append` — the function other languages call —
//! so the rules, the per-aggregate lock and the NOTIFY are the same for every producer.
//! The lock (a transaction-scoped advisory lock on the aggregate) makes a second appender
//! of the same aggregate wait for the first one's commit: per aggregate, the event order
//! (`seq`) is the commit order, and no event can commit behind one the relay already
//! delivered. On SQLite the single writer gives the same order.

use crate::conn::{Conn, SQLITE_NOW_MS};
use crate::error::OutboxError;
use idem_core::outbox::NewEvent;

/// Appends `event` in the transaction of `conn`; returns its position (`seq`, growing in
/// commit order per aggregate).
///
/// # Errors
/// [`OutboxError::Event`] when the event breaks a rule (checked before anything is
/// written: id, aggregate, topic, payload ≤ 256 KiB, headers);
/// [`OutboxError::DuplicateEventId`] for an id appended before (on PostgreSQL that aborts
/// the transaction, as any failed statement does); [`OutboxError::NotInstalled`] without
/// the schema.
pub async fn append<'c>(conn: impl Into<Conn<'c>>, event: &NewEvent) -> Result<i64, OutboxError> {
    event.validate()?;
    let headers = serde_json::to_string(&event.headers).expect("a map of strings serializes");
    // The same six values, bound in the same order, on both databases.
    macro_rules! bound {
        ($sql:expr) => {
            sqlx::query_scalar::<_, i64>($sql)
                .bind(&event.id)
                .bind(&event.aggregate_type)
                .bind(&event.aggregate_id)
                .bind(&event.topic)
                .bind(event.payload_text())
                .bind(headers)
        };
    }
    let result = match conn.into() {
        Conn::Postgres(c) => bound!("SELECT idem.outbox_append($1, $2, $3, $4, $5::json, $6::json)").fetch_one(c).await,
        Conn::Sqlite(c) => {
            bound!(sqlx::AssertSqlSafe(format!(
                "INSERT INTO idem_outbox (id, aggregate_type, aggregate_id, topic, payload, headers, created_at) \
             VALUES (?, ?, ?, ?, ?, ?, {SQLITE_NOW_MS}) RETURNING seq"
            )))
            .fetch_one(c)
            .await
        }
    };
    result.map_err(|e| match e.as_database_error() {
        Some(d) if d.is_unique_violation() => OutboxError::DuplicateEventId(event.id.clone()),
        _ => OutboxError::from(e),
    })
}
