//! `OutboxError`: what the transaction half and the relay report.

use idem_core::inbox::InboxError;
use idem_core::key::KeyError;
use idem_core::outbox::EventError;

/// Why a call failed. Nothing of the call was written (the caller's transaction may still
/// be used, except after [`OutboxError::Database`] on PostgreSQL, which aborts it).
#[derive(Debug, thiserror::Error)]
pub enum OutboxError {
    /// The event breaks a rule of [`idem_core::outbox::NewEvent::validate`].
    #[error("bad outbox event: {0}")]
    Event(#[from] EventError),
    /// An event with this id was appended before (ids are unique: they are the receiver's
    /// dedupe key).
    #[error("an outbox event with id {0:?} already exists; event ids are unique")]
    DuplicateEventId(String),
    /// A bad consumer name, message id or fingerprint.
    #[error("{0}")]
    Inbox(#[from] InboxError),
    /// A bad idempotency key.
    #[error("{0}")]
    Key(#[from] KeyError),
    /// The payload cannot be fingerprinted (member names equal after NFC).
    #[error("{0}")]
    Fingerprint(#[from] idem_core::FingerprintError),
    /// `finish` without a claim in this transaction.
    #[error("{0}")]
    NotClaimed(String),
    /// The `idem` schema is missing or older than this library.
    #[error("the idem schema is not installed in this database: run `idem schema install --database-url URL`")]
    NotInstalled,
    /// The database holds a newer schema than this library knows.
    #[error("the idem schema in this database is version {found}, newer than this idem knows ({known}): upgrade idem")]
    SchemaNewer {
        /// The version in the database.
        found: i64,
        /// [`crate::schema::VERSION`].
        known: i64,
    },
    /// An SQLite database that cannot be opened: the file is missing where it must exist,
    /// or its directory is (SQLite's own text is only "unable to open database file").
    #[error("{0}")]
    Open(String),
    /// The database said no.
    #[error("database error: {}", plain(.0))]
    Database(#[source] sqlx::Error),
}

impl OutboxError {
    /// The error in idem's own words, for the admin page: a database's own message (table
    /// and constraint names, its text in the server's language) is replaced by the kind of
    /// failure and its SQLSTATE; the log keeps the whole. Other errors are idem's already.
    #[must_use]
    pub fn in_idems_words(&self) -> String {
        match self {
            OutboxError::Database(sqlx::Error::Database(db)) => format!(
                "the outbox's database answered with an error (SQLSTATE {}); the server's log has its message",
                db.code().unwrap_or_default()
            ),
            OutboxError::Database(_) => "the outbox's database did not answer; the server's log has why".into(),
            other => other.to_string(),
        }
    }
}

/// For an error the database server returned, its own message: sqlx's text adds "error
/// returned from database: " and, on PostgreSQL, " at line N" of the server's C source,
/// which read as if the user's config or query were at fault. (idem-store's
/// `database_message` says the same; this crate does not depend on idem-store.)
fn plain(e: &sqlx::Error) -> String {
    match e {
        sqlx::Error::Database(db) => db.message().to_owned(),
        other => other.to_string(),
    }
}

/// The file path of an SQLite database URL: `sqlite://PATH`, `sqlite:PATH` or a plain path
/// (as `idem serve` reads it; `sqlite:` alone is an empty path, refused by
/// [`check_sqlite_path`]).
pub(crate) fn sqlite_path(url: &str) -> &str {
    url.strip_prefix("sqlite://").or_else(|| url.strip_prefix("sqlite:")).unwrap_or(url)
}

/// Checks an SQLite database path before SQLite opens it: its directory must exist, and
/// the file too unless `create` (SQLite creates a file, never a directory).
///
/// # Errors
/// [`OutboxError::Open`] naming the path and what is missing.
pub(crate) fn check_sqlite_path(path: &str, create: bool) -> Result<(), OutboxError> {
    let file = std::path::Path::new(path);
    if path.is_empty() {
        return Err(OutboxError::Open("the SQLite database path is empty: use sqlite://PATH".into()));
    }
    if file.is_dir() {
        return Err(OutboxError::Open(format!(
            "cannot open the database {path}: it is a directory; name a file in it"
        )));
    }
    if path == ":memory:" || path.starts_with("file:") || file.exists() {
        return Ok(());
    }
    if let Some(dir) = file.parent().filter(|d| !d.as_os_str().is_empty())
        && !dir.is_dir()
    {
        let what = if dir.exists() { "is not a directory" } else { "does not exist" };
        return Err(OutboxError::Open(format!("cannot open the database {path}: {} {what}", dir.display())));
    }
    if create {
        return Ok(());
    }
    Err(OutboxError::Open(format!(
        "no database at {path}: run `idem schema install --database-url sqlite://{path}` to create it"
    )))
}

impl From<sqlx::Error> for OutboxError {
    fn from(e: sqlx::Error) -> Self {
        if let Some(db) = e.as_database_error() {
            let code = db.code().unwrap_or_default();
            // 42P01 undefined table, 3F000 undefined schema, 42883 undefined function.
            if matches!(code.as_ref(), "42P01" | "3F000" | "42883") || db.message().contains("no such table: idem_") {
                return OutboxError::NotInstalled;
            }
        }
        OutboxError::Database(e)
    }
}
