//! Store errors.

use idem_core::{CompleteError, RenewError, ResolveError};

/// Why a store call failed. Logic refusals (stale token, final record) come back as
/// [`StoreError::Complete`]; everything else is infrastructure.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// No operation with that key in that tenant.
    #[error("no operation with that key")]
    NotFound,
    /// The completion was refused; nothing was written.
    #[error(transparent)]
    Complete(#[from] CompleteError),
    /// The lease renewal was refused (expired, stale token, not executing); nothing was
    /// written.
    #[error(transparent)]
    Renew(#[from] RenewError),
    /// The resolution was refused; nothing was written.
    #[error(transparent)]
    Resolve(#[from] ResolveError),
    /// A conditional write kept losing to concurrent writers (after bounded retries).
    #[error("the record kept changing under concurrent writers; try again")]
    Contention,
    /// A stored row could not be read back (corrupt or foreign data).
    #[error("stored data is not readable: {0}")]
    Corrupt(String),
    /// Bad input that only the store can detect (e.g. a duplicate API key).
    #[error("{0}")]
    Invalid(String),
    /// The database failed.
    #[error("database error: {}", database_message(.0))]
    Database(#[from] sqlx::Error),
    /// Migrations could not be applied at start-up.
    #[error("database migration failed: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    /// The store's writer stopped (the process is shutting down).
    #[error("the store is shutting down")]
    Closed,
}

/// A database error as one line for people: for an error the server returned, its message
/// alone. sqlx's own text prefixes "error returned from database: " and, on PostgreSQL,
/// appends " at line N" — a line of the server's C source (the protocol's `L` field), not
/// of anything the user wrote, read as if the config or a query were at fault.
#[must_use]
pub fn database_message(e: &sqlx::Error) -> String {
    match e {
        sqlx::Error::Database(db) => db.message().to_owned(),
        other => other.to_string(),
    }
}
