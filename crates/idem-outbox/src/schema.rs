//! `idem schema install`: the `idem` schema in the application's own database, versioned.
//!
//! - PostgreSQL: schema `idem` with the tables `inbox` (consumers' claims, and the claimed
//!   keys under consumer `idem.keys`), `outbox`, `outbox_attempts`, `relay_idle`,
//!   `schema_version`, and the SQL functions any language can call in
//!   its own transaction: `idem.outbox_append(id, aggregate_type, aggregate_id, topic,
//!   payload json, headers json)`, `idem.inbox_claim(consumer, message_id, fingerprint)`,
//!   `idem.inbox_finish(consumer, message_id, outcome json)`, `idem.key_claim(key,
//!   fingerprint)`, `idem.key_finish(key, result json)` (`schema/postgres/*.sql`).
//! - SQLite: the same tables named `idem_*` (`schema/sqlite/*.sql`); the Rust library does
//!   what the functions do.
//!
//! Versions are numbered scripts applied in order, each once, in one transaction (on
//! PostgreSQL under an advisory lock, so two installers cannot race); installing again is a
//! no-op. A database whose schema is newer than this library is refused. The limits in the
//! scripts (`{{MAX_PAYLOAD_BYTES}}`, …) are idem-core's constants, filled in at install.

use crate::error::OutboxError;
use idem_core::inbox::MAX_MESSAGE_ID_LEN;
use idem_core::outbox::{
    MAX_AGGREGATE_LEN, MAX_EVENT_ID_LEN, MAX_HEADER_LEN, MAX_HEADERS, MAX_PAYLOAD_BYTES, MAX_TOPIC_LEN,
};
use sqlx::{Connection, PgConnection, SqliteConnection};

/// The PostgreSQL scripts, by version (1-based, in order).
const POSTGRES: &[&str] =
    &[include_str!("schema/postgres/0001_init.sql"), include_str!("schema/postgres/0002_identifiers.sql")];
/// The SQLite scripts, by version.
const SQLITE: &[&str] =
    &[include_str!("schema/sqlite/0001_init.sql"), include_str!("schema/sqlite/0002_identifiers.sql")];

/// The schema version this library writes and needs.
pub const VERSION: i64 = 2;

/// What an install did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Installed {
    /// The version found (0: none).
    pub from: i64,
    /// The version now installed ([`VERSION`]).
    pub to: i64,
}

/// `script` with idem-core's limits filled in.
fn fill(script: &str) -> String {
    [
        ("{{MAX_EVENT_ID_LEN}}", MAX_EVENT_ID_LEN),
        ("{{MAX_AGGREGATE_LEN}}", MAX_AGGREGATE_LEN),
        ("{{MAX_TOPIC_LEN}}", MAX_TOPIC_LEN),
        ("{{MAX_PAYLOAD_BYTES}}", MAX_PAYLOAD_BYTES),
        ("{{MAX_HEADERS}}", MAX_HEADERS),
        ("{{MAX_HEADER_LEN}}", MAX_HEADER_LEN),
        ("{{MAX_MESSAGE_ID_LEN}}", MAX_MESSAGE_ID_LEN),
    ]
    .iter()
    .fold(script.to_owned(), |s, (name, value)| s.replace(name, &value.to_string()))
}

fn newer(found: i64) -> OutboxError {
    OutboxError::SchemaNewer { found, known: VERSION }
}

/// Installs or upgrades the schema in the database at `url` (`postgres://…` or
/// `sqlite://PATH`, created if missing).
///
/// # Errors
/// [`OutboxError::Database`] when the database cannot be reached or a script fails (then
/// nothing of the install is kept); an error naming both versions when the database holds
/// a newer schema.
pub async fn install(url: &str) -> Result<Installed, OutboxError> {
    if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        let mut c = PgConnection::connect(url).await.map_err(OutboxError::Database)?;
        install_postgres(&mut c).await
    } else {
        let path = crate::error::sqlite_path(url);
        crate::error::check_sqlite_path(path, true)?;
        let opts = sqlx::sqlite::SqliteConnectOptions::new().filename(path).create_if_missing(true);
        let mut c = SqliteConnection::connect_with(&opts).await.map_err(OutboxError::Database)?;
        install_sqlite(&mut c).await
    }
}

/// The install, the same on both databases: in one transaction `$tx`, run `$bootstrap`
/// (the version table), read the version, refuse a newer one, then run the scripts past it,
/// each followed by `$record` (its version as `$1`).
macro_rules! install_in {
    ($tx:expr, $bootstrap:expr, $version:expr, $scripts:expr, $record:expr) => {{
        let db = |e| OutboxError::Database(e);
        let mut tx = $tx.map_err(db)?;
        sqlx::raw_sql($bootstrap).execute(&mut *tx).await.map_err(db)?;
        let (from,): (i64,) = sqlx::query_as($version).fetch_one(&mut *tx).await.map_err(db)?;
        if from > VERSION {
            return Err(newer(from));
        }
        for (i, script) in $scripts.iter().enumerate().skip(from as usize) {
            sqlx::raw_sql(sqlx::AssertSqlSafe(fill(script))).execute(&mut *tx).await.map_err(db)?;
            sqlx::query(sqlx::AssertSqlSafe($record)).bind(i as i64 + 1).execute(&mut *tx).await.map_err(db)?;
        }
        tx.commit().await.map_err(db)?;
        Ok(Installed { from, to: from.max($scripts.len() as i64) })
    }};
}

/// [`install`] on an open PostgreSQL connection (under an advisory lock).
///
/// # Errors
/// As [`install`].
pub async fn install_postgres(c: &mut PgConnection) -> Result<Installed, OutboxError> {
    install_postgres_up_to(c, VERSION).await
}

/// [`install_postgres`], but only up to `version` (1..=[`VERSION`]): the tests' way to make
/// a database of an earlier version and upgrade it.
///
/// # Errors
/// As [`install`].
#[doc(hidden)]
pub async fn install_postgres_up_to(c: &mut PgConnection, version: i64) -> Result<Installed, OutboxError> {
    let scripts = &POSTGRES[..(version.clamp(1, VERSION) as usize)];
    install_in!(
        c.begin().await,
        "SELECT pg_advisory_xact_lock(hashtext('idem.schema')); CREATE SCHEMA IF NOT EXISTS idem; \
         CREATE TABLE IF NOT EXISTS idem.schema_version (version bigint PRIMARY KEY, installed_at bigint NOT NULL)",
        "SELECT coalesce(max(version), 0)::bigint FROM idem.schema_version",
        scripts,
        "INSERT INTO idem.schema_version VALUES ($1, (extract(epoch FROM now()) * 1000)::bigint)".to_owned()
    )
}

/// [`install`] on an open SQLite connection (`BEGIN IMMEDIATE`).
///
/// # Errors
/// As [`install`].
pub async fn install_sqlite(c: &mut SqliteConnection) -> Result<Installed, OutboxError> {
    install_in!(
        c.begin_with("BEGIN IMMEDIATE").await,
        "CREATE TABLE IF NOT EXISTS idem_schema_version (version INTEGER PRIMARY KEY, installed_at INTEGER NOT NULL)",
        "SELECT coalesce(max(version), 0) FROM idem_schema_version",
        SQLITE,
        format!("INSERT INTO idem_schema_version VALUES ($1, {})", crate::conn::SQLITE_NOW_MS)
    )
}
