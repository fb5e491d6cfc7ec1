//! Prepared statements on SQLite's C API, for the writer's hot path only
//! ([`crate::sqlite_batch::run_batch`]).
//!
//! Why not sqlx there: per statement sqlx builds the SQL text (a multi-row statement per
//! batch shape), hashes it to find its cached statement, boxes every bound value, and runs
//! it on the connection's own thread, two round trips per batch. Measured under
//! `scripts/callgrind.sh`, that was ~50 000 instructions per request beside SQLite's own
//! work. Here the writer takes the connection from sqlx's thread for the batch
//! (`SqliteConnection::lock_handle`) and steps statements it prepared once
//! (`SQLITE_PREPARE_PERSISTENT`), binding the values where they are (`SQLITE_STATIC`:
//! SQLite does not copy them; every call resets and clears its bindings before it
//! returns, while the values are still borrowed).
//!
//! Everything else the writer does (the general path, savepoints, migrations) stays on
//! sqlx. These statements must be finalized before sqlx closes the connection (sqlx's
//! `sqlite3_close` panics while a statement is open): [`Statements`] is dropped first,
//! under the connection's lock (`writer_loop`).

use crate::StoreError;
use libsqlite3_sys as ffi;
use std::ffi::CStr;
use std::ptr::NonNull;

/// A value to bind. `Text` is bound without a copy (`SQLITE_STATIC`).
#[derive(Debug, Clone, Copy)]
pub(crate) enum Arg<'a> {
    Null,
    Int(i64),
    Text(&'a str),
}

impl<'a> From<&'a str> for Arg<'a> {
    fn from(s: &'a str) -> Self {
        Arg::Text(s)
    }
}

impl<'a> From<Option<&'a str>> for Arg<'a> {
    fn from(s: Option<&'a str>) -> Self {
        s.map_or(Arg::Null, Arg::Text)
    }
}

impl From<i64> for Arg<'_> {
    fn from(v: i64) -> Self {
        Arg::Int(v)
    }
}

impl From<Option<i64>> for Arg<'_> {
    fn from(v: Option<i64>) -> Self {
        v.map_or(Arg::Null, Arg::Int)
    }
}

impl From<bool> for Arg<'_> {
    fn from(v: bool) -> Self {
        Arg::Int(i64::from(v))
    }
}

/// The open connection's raw handle, valid while the `LockedSqliteHandle` it came from is
/// held (the caller's borrow).
#[derive(Clone, Copy)]
pub(crate) struct Db(NonNull<ffi::sqlite3>);

impl Db {
    /// # Safety
    /// `raw` is an open connection that nothing else uses until this `Db` and every
    /// statement run with it are done (the `LockedSqliteHandle` is held).
    pub(crate) unsafe fn new(raw: NonNull<ffi::sqlite3>) -> Db {
        Db(raw)
    }

    /// The connection's last error as a [`StoreError::Database`]: SQLite's message and
    /// extended result code (<https://www.sqlite.org/rescode.html>).
    fn error(self, rc: i32) -> StoreError {
        // SAFETY: an open handle; errmsg's text is copied before any other call.
        let message = unsafe {
            let m = ffi::sqlite3_errmsg(self.0.as_ptr());
            if m.is_null() { String::new() } else { CStr::from_ptr(m).to_string_lossy().into_owned() }
        };
        // SAFETY: an open handle.
        let code = unsafe { ffi::sqlite3_extended_errcode(self.0.as_ptr()) };
        let code = if code == 0 { rc } else { code };
        StoreError::Database(sqlx::Error::Protocol(format!("{message} (SQLite error {code})")))
    }

    /// Rows the last finished INSERT, UPDATE or DELETE changed (`sqlite3_changes64`).
    pub(crate) fn changes(self) -> i64 {
        // SAFETY: an open handle.
        unsafe { ffi::sqlite3_changes64(self.0.as_ptr()) }
    }

    /// Whether the connection is outside a transaction (`sqlite3_get_autocommit`).
    pub(crate) fn autocommit(self) -> bool {
        // SAFETY: an open handle.
        unsafe { ffi::sqlite3_get_autocommit(self.0.as_ptr()) != 0 }
    }

    /// Rows this connection inserted, updated or deleted since it opened
    /// (`sqlite3_total_changes64`; rolled-back ones included).
    pub(crate) fn total_changes(self) -> i64 {
        // SAFETY: an open handle.
        unsafe { ffi::sqlite3_total_changes64(self.0.as_ptr()) }
    }

    /// The path of the main database's write-ahead log, as SQLite names it
    /// (`sqlite3_filename_wal(sqlite3_db_filename(db, "main"))`); `None` for a database
    /// without a file.
    pub(crate) fn wal_path(self) -> Option<std::path::PathBuf> {
        // SAFETY: an open handle; the returned names belong to the connection and are
        // copied before any other call.
        unsafe {
            let db_name = ffi::sqlite3_db_filename(self.0.as_ptr(), c"main".as_ptr());
            if db_name.is_null() || *db_name == 0 {
                return None;
            }
            let wal = ffi::sqlite3_filename_wal(db_name);
            if wal.is_null() || *wal == 0 {
                return None;
            }
            Some(std::path::PathBuf::from(CStr::from_ptr(wal).to_string_lossy().into_owned()))
        }
    }
}

/// One prepared statement.
pub(crate) struct Stmt(NonNull<ffi::sqlite3_stmt>);

// SAFETY: a statement is used only by the writer, while it holds its connection's lock;
// the writer may move between threads between batches.
unsafe impl Send for Stmt {}

impl Drop for Stmt {
    fn drop(&mut self) {
        // SAFETY: prepared by `prepare`, finalized once.
        unsafe { ffi::sqlite3_finalize(self.0.as_ptr()) };
    }
}

impl Stmt {
    /// Prepares `sql` (one statement) to be kept (`SQLITE_PREPARE_PERSISTENT`).
    fn prepare(db: Db, sql: &str) -> Result<Stmt, StoreError> {
        let mut raw = std::ptr::null_mut();
        let len = i32::try_from(sql.len()).map_err(|_| StoreError::Invalid("statement too long".into()))?;
        // SAFETY: `sql` is valid for `len` bytes; `raw` receives the statement.
        let rc = unsafe {
            ffi::sqlite3_prepare_v3(
                db.0.as_ptr(),
                sql.as_ptr().cast(),
                len,
                ffi::SQLITE_PREPARE_PERSISTENT,
                &mut raw,
                std::ptr::null_mut(),
            )
        };
        match NonNull::new(raw) {
            Some(stmt) if rc == ffi::SQLITE_OK => Ok(Stmt(stmt)),
            Some(stmt) => {
                drop(Stmt(stmt));
                Err(db.error(rc))
            }
            None if rc == ffi::SQLITE_OK => Err(StoreError::Invalid(format!("no statement in {sql:?}"))),
            None => Err(db.error(rc)),
        }
    }

    /// Binds `args` (`?1`, `?2`, …), steps to the end calling `row` for each result row,
    /// then resets the statement and clears its bindings, whatever happened: the borrowed
    /// texts are not used after this returns.
    ///
    /// # Errors
    /// SQLite's error (a constraint, `SQLITE_BUSY`, I/O), or `row`'s.
    pub(crate) fn run(
        &mut self,
        db: Db,
        args: &[Arg<'_>],
        mut row: impl FnMut(&Row<'_>) -> Result<(), StoreError>,
    ) -> Result<(), StoreError> {
        let stmt = self.0.as_ptr();
        let result = (|| {
            for (i, arg) in args.iter().enumerate() {
                let i = i as i32 + 1;
                // SAFETY: `stmt` is prepared; texts outlive the binding (cleared below).
                let rc = unsafe {
                    match *arg {
                        Arg::Null => ffi::sqlite3_bind_null(stmt, i),
                        Arg::Int(v) => ffi::sqlite3_bind_int64(stmt, i, v),
                        Arg::Text(s) => ffi::sqlite3_bind_text(
                            stmt,
                            i,
                            s.as_ptr().cast(),
                            i32::try_from(s.len()).map_err(|_| StoreError::Invalid("value too long".into()))?,
                            ffi::SQLITE_STATIC(),
                        ),
                    }
                };
                if rc != ffi::SQLITE_OK {
                    return Err(db.error(rc));
                }
            }
            loop {
                // SAFETY: `stmt` is prepared and bound.
                match unsafe { ffi::sqlite3_step(stmt) } {
                    ffi::SQLITE_ROW => row(&Row { stmt, _borrow: std::marker::PhantomData })?,
                    ffi::SQLITE_DONE => return Ok(()),
                    rc => return Err(db.error(rc)),
                }
            }
        })();
        // SAFETY: `stmt` is prepared. reset's code repeats the step's error, already taken.
        unsafe {
            ffi::sqlite3_reset(stmt);
            ffi::sqlite3_clear_bindings(stmt);
        }
        result
    }
}

/// The current result row of a statement, valid for one `row` callback.
pub(crate) struct Row<'s> {
    stmt: *mut ffi::sqlite3_stmt,
    _borrow: std::marker::PhantomData<&'s ()>,
}

impl Row<'_> {
    fn is_null(&self, i: i32) -> bool {
        // SAFETY: the statement is on a row; `i` is checked by SQLite (out of range reads NULL).
        unsafe { ffi::sqlite3_column_type(self.stmt, i) == ffi::SQLITE_NULL }
    }

    /// Column `i` as an integer (NULL reads 0: use [`Self::opt_int`] where it may be NULL).
    pub(crate) fn int(&self, i: i32) -> i64 {
        // SAFETY: as above.
        unsafe { ffi::sqlite3_column_int64(self.stmt, i) }
    }

    /// Column `i`, `None` for NULL.
    pub(crate) fn opt_int(&self, i: i32) -> Option<i64> {
        (!self.is_null(i)).then(|| self.int(i))
    }

    /// Column `i` as a boolean (0 is false).
    pub(crate) fn bool(&self, i: i32) -> bool {
        self.int(i) != 0
    }

    /// Column `i` as UTF-8 text, copied.
    ///
    /// # Errors
    /// [`StoreError::Corrupt`] for NULL or text that is not UTF-8.
    pub(crate) fn text(&self, i: i32) -> Result<String, StoreError> {
        self.opt_text(i)?.ok_or_else(|| StoreError::Corrupt(format!("column {i} is NULL")))
    }

    /// Column `i` as UTF-8 text, copied; `None` for NULL.
    ///
    /// # Errors
    /// [`StoreError::Corrupt`] for text that is not UTF-8.
    pub(crate) fn opt_text(&self, i: i32) -> Result<Option<String>, StoreError> {
        if self.is_null(i) {
            return Ok(None);
        }
        // SAFETY: the statement is on a row; text then bytes, as SQLite documents
        // (https://www.sqlite.org/c3ref/column_blob.html); copied before the next step.
        let bytes = unsafe {
            let p = ffi::sqlite3_column_text(self.stmt, i);
            let n = ffi::sqlite3_column_bytes(self.stmt, i);
            if p.is_null() { &[][..] } else { std::slice::from_raw_parts(p, n as usize) }
        };
        std::str::from_utf8(bytes)
            .map(|s| Some(s.to_owned()))
            .map_err(|e| StoreError::Corrupt(format!("column {i} is not UTF-8: {e}")))
    }
}

/// The writer's hot statements, each prepared on first use and kept for the connection's
/// life.
#[derive(Default)]
pub(crate) struct Statements {
    stmts: Vec<(&'static str, Stmt)>,
}

impl Statements {
    /// The statement for `sql` (prepared now if this is its first use).
    ///
    /// # Errors
    /// SQLite's error preparing it.
    pub(crate) fn get(&mut self, db: Db, sql: &'static str) -> Result<&mut Stmt, StoreError> {
        // A handful of statements: a linear scan (by address first) beats hashing the text.
        let i = match self.stmts.iter().position(|(s, _)| std::ptr::eq(*s, sql) || *s == sql) {
            Some(i) => i,
            None => {
                self.stmts.push((sql, Stmt::prepare(db, sql)?));
                self.stmts.len() - 1
            }
        };
        Ok(&mut self.stmts[i].1)
    }

    /// Runs `sql` once with `args`, ignoring rows.
    ///
    /// # Errors
    /// As [`Stmt::run`].
    pub(crate) fn exec(&mut self, db: Db, sql: &'static str, args: &[Arg<'_>]) -> Result<(), StoreError> {
        self.get(db, sql)?.run(db, args, |_| Ok(()))
    }

    /// The first column of the first row `sql` returns, as an integer (`PRAGMA
    /// data_version`, a count, `EXISTS`).
    ///
    /// # Errors
    /// As [`Stmt::run`]; [`StoreError::Corrupt`] when it returns no row.
    pub(crate) fn int(&mut self, db: Db, sql: &'static str) -> Result<i64, StoreError> {
        let mut value = None;
        self.get(db, sql)?.run(db, &[], |r| {
            value = value.or(Some(r.int(0)));
            Ok(())
        })?;
        value.ok_or_else(|| StoreError::Corrupt(format!("{sql:?} returned no row")))
    }

    /// Finalizes every statement (they must be gone before the connection closes).
    pub(crate) fn clear(&mut self) {
        self.stmts.clear();
    }
}
