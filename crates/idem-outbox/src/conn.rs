//! The connection the transaction half writes on: the caller's open transaction, on
//! PostgreSQL or SQLite.

use sqlx::{PgConnection, SqliteConnection};

/// A connection inside the caller's transaction (`&mut *tx` of a
/// `sqlx::Transaction<'_, Postgres>` or `<'_, Sqlite>`). Every function of this crate that
/// takes one writes in that transaction and never commits: the caller's commit makes the
/// business rows and idem's rows durable together, its rollback drops both.
///
/// On SQLite open the transaction with `pool.begin_with("BEGIN IMMEDIATE")`: a deferred
/// transaction that first reads then writes can fail with `SQLITE_BUSY` under concurrency.
#[derive(Debug)]
pub enum Conn<'c> {
    /// PostgreSQL: the `idem` schema's tables and functions.
    Postgres(&'c mut PgConnection),
    /// SQLite: the `idem_*` tables.
    Sqlite(&'c mut SqliteConnection),
}

impl<'c> From<&'c mut PgConnection> for Conn<'c> {
    fn from(c: &'c mut PgConnection) -> Self {
        Conn::Postgres(c)
    }
}

impl<'c> From<&'c mut SqliteConnection> for Conn<'c> {
    fn from(c: &'c mut SqliteConnection) -> Self {
        Conn::Sqlite(c)
    }
}

/// SQLite's "now" in epoch ms (the database's clock, as `idem.now_ms()` on PostgreSQL).
pub(crate) const SQLITE_NOW_MS: &str = "CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER)";
