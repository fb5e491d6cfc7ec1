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
    /// A conditional write kept losing to concurrent writers (after bounded retries), or
    /// (PostgreSQL) its row is locked by another transaction and as many requests as may
    /// wait for row locks (half the pool) already do.
    #[error(
        "the record kept changing under concurrent writers, or another transaction holds it locked and enough requests already wait for that; try again"
    )]
    Contention,
    /// A stored row could not be read back (corrupt or foreign data).
    #[error("stored data is not readable: {0}")]
    Corrupt(String),
    /// The database stored a different number of rows than idem wrote, with no error: a
    /// trigger someone put on idem's tables skipped the write (`RAISE(IGNORE)`, or a
    /// PostgreSQL `BEFORE` trigger returning NULL). Nothing of the request is kept and
    /// nothing is acknowledged.
    #[error("the database did not store the write ({0}); is there a trigger on idem's tables?")]
    NotStored(String),
    /// The database refused the write (a constraint, a trigger's exception), reported
    /// after the writer isolated the request whose write it was; its message.
    #[error("the database refused the write: {0}")]
    Refused(String),
    /// The store cannot make writes durable: the fsync of SQLite's write-ahead log failed
    /// (its message). What was committed since the fsync before may or may not survive a
    /// power loss, and after a failed fsync the OS may have dropped it, so the store takes
    /// no more writes and answers no reads until the process is restarted (idem-store
    /// `sqlite_sync`).
    #[error("the store cannot make writes durable: {0}; restart idem")]
    NotDurable(String),
    /// Bad input that only the store can detect (e.g. a duplicate API key).
    #[error("{0}")]
    Invalid(String),
    /// The database did not answer within the store's answer timeout (ms)
    /// ([`crate::StoreConfig::answer_timeout`]): what was sent may or may not have been
    /// recorded (a commit may have been on its way); the same request sent again finds out.
    #[error("the database did not answer within {0} ms; what was sent may or may not have been recorded")]
    NoAnswer(u64),
    /// The database failed.
    #[error("database error: {}", database_message(.0))]
    Database(#[from] sqlx::Error),
    /// Migrations could not be applied at start-up.
    #[error("database migration failed: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    /// The store's writer stopped (the process is shutting down).
    #[error("the store is shutting down")]
    Closed,
    /// The database answers, but idem's tables are not there (or are older than this
    /// binary): it was dropped and created again, or replaced, under the running node
    /// (issue 28 §7). Nothing can be served from it; a restart migrates it, empty.
    #[error("idem's tables are missing from the database ({0}): it was dropped or replaced under this node")]
    SchemaMissing(String),
}

impl StoreError {
    /// The error in idem's own words, for a client or a health check: a database's own
    /// message (table and constraint names, its text in the server's language) is
    /// replaced by what kind of failure it was and its SQLSTATE; the log keeps the whole.
    #[must_use]
    pub fn in_idems_words(&self) -> String {
        match self {
            StoreError::Database(sqlx::Error::Database(db)) => format!(
                "the database answered with an error (SQLSTATE {}); the server's log has its message",
                db.code().unwrap_or_default()
            ),
            StoreError::Database(sqlx::Error::Io(_)) => "cannot reach the database (the connection failed)".into(),
            StoreError::Database(sqlx::Error::PoolTimedOut) => {
                "no database connection within the pool's timeout".into()
            }
            StoreError::Database(sqlx::Error::Tls(_)) => "TLS to the database failed".into(),
            StoreError::Database(_) => "the database connection failed; the server's log has why".into(),
            StoreError::Refused(_) => "the database refused the write; the server's log has its message".into(),
            StoreError::Migrate(_) => "the database's migrations failed; the server's log has why".into(),
            other => other.to_string(),
        }
    }

    /// Whether the database says the tables or schema idem uses do not exist (PostgreSQL
    /// SQLSTATE 42P01 `undefined_table`, 3F000 `invalid_schema_name`; SQLite "no such
    /// table"), or a probe found them missing ([`StoreError::SchemaMissing`]).
    #[must_use]
    pub fn schema_missing(&self) -> bool {
        match self {
            StoreError::SchemaMissing(_) => true,
            StoreError::Database(sqlx::Error::Database(db)) => {
                matches!(db.code().as_deref(), Some("42P01" | "3F000")) || db.message().starts_with("no such table")
            }
            _ => false,
        }
    }

    /// The database's message when this is a refusal that repeats on retry rather than an
    /// outage: an integrity constraint or a trigger's `RAISE` (SQLite's primary result code
    /// `SQLITE_CONSTRAINT`, 19, <https://www.sqlite.org/rescode.html#constraint>;
    /// PostgreSQL's SQLSTATE class 23, integrity constraint violation, or P0001,
    /// `raise_exception`). `None` for anything else.
    #[must_use]
    pub fn refusal(&self) -> Option<&str> {
        if let StoreError::Refused(why) = self {
            return Some(why);
        }
        let StoreError::Database(sqlx::Error::Database(db)) = self else { return None };
        let code = db.code().unwrap_or_default();
        let sqlite_constraint = !code.starts_with('0') && code.parse::<i32>().is_ok_and(|c| c & 0xff == 19);
        (code.starts_with("23") || code == "P0001" || sqlite_constraint).then(|| db.message())
    }
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

/// `Ok` when a write changed `expected` rows, else [`StoreError::NotStored`] naming `what`.
///
/// # Errors
/// [`StoreError::NotStored`].
pub(crate) fn stored(what: &str, changed: u64, expected: usize) -> Result<(), StoreError> {
    if changed == expected as u64 {
        Ok(())
    } else {
        Err(StoreError::NotStored(format!("{what}: {changed} of {expected} rows written")))
    }
}
