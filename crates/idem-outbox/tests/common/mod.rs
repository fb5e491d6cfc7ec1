//! Test support: application databases (a fresh PostgreSQL database or an SQLite file)
//! with the idem schema and a business table `jobs`.
#![allow(dead_code)] // each test file uses a different subset

use sqlx::{PgPool, SqlitePool};

/// An application database of either kind.
pub enum AppDb {
    Postgres(PgPool, idem_store::testing::TestDatabase),
    Sqlite(SqlitePool, String, tempfile::TempDir),
}

impl AppDb {
    pub async fn postgres() -> AppDb {
        let url = idem_store::testing::fresh_pg_database("idem_outbox").await;
        idem_outbox::schema::install(&url).await.unwrap();
        let pool = PgPool::connect(&url).await.unwrap();
        sqlx::query("CREATE TABLE jobs (id text PRIMARY KEY, batch text NOT NULL)").execute(&pool).await.unwrap();
        AppDb::Postgres(pool, url)
    }

    pub async fn sqlite() -> AppDb {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}", dir.path().join("app.db").display());
        idem_outbox::schema::install(&url).await.unwrap();
        let opts = sqlx::sqlite::SqliteConnectOptions::new()
            .filename(dir.path().join("app.db"))
            .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal)
            .busy_timeout(std::time::Duration::from_secs(10));
        let pool = SqlitePool::connect_with(opts).await.unwrap();
        sqlx::query("CREATE TABLE jobs (id TEXT PRIMARY KEY, batch TEXT NOT NULL)").execute(&pool).await.unwrap();
        AppDb::Sqlite(pool, url, dir)
    }

    pub async fn both() -> Vec<AppDb> {
        vec![AppDb::sqlite().await, AppDb::postgres().await]
    }

    pub fn url(&self) -> &str {
        match self {
            AppDb::Postgres(_, u) => &u.url,
            AppDb::Sqlite(_, u, _) => u,
        }
    }

    /// The pool of the PostgreSQL database, for the SQL functions; `None` on SQLite.
    pub fn pg_pool(&self) -> Option<&PgPool> {
        match self {
            AppDb::Postgres(p, _) => Some(p),
            AppDb::Sqlite(..) => None,
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            AppDb::Postgres(..) => "postgres",
            AppDb::Sqlite(..) => "sqlite",
        }
    }

    /// `SELECT count(*)` of a query on either backend (`idem.TABLE` becomes `idem_TABLE` on
    /// SQLite).
    pub async fn count(&self, sql: &str) -> i64 {
        match self {
            AppDb::Postgres(p, _) => {
                sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(sql.to_owned())).fetch_one(p).await.unwrap()
            }
            AppDb::Sqlite(p, _, _) => {
                sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(sqlite_sql(sql))).fetch_one(p).await.unwrap()
            }
        }
    }
}

/// A statement on the `idem` schema's tables, for SQLite's `idem_*` tables.
pub fn sqlite_sql(sql: &str) -> String {
    ["outbox_attempts", "outbox", "inbox", "relay_idle", "schema_version"]
        .iter()
        .fold(sql.to_owned(), |s, t| s.replace(&format!("idem.{t}"), &format!("idem_{t}")))
}

/// Runs `$body` with `$conn` bound to a connection inside a new transaction of `$db`
/// (`BEGIN IMMEDIATE` on SQLite), then commits (`commit`) or rolls back (`rollback`).
#[macro_export]
macro_rules! in_tx {
    ($db:expr, $end:ident, |$conn:ident| $body:expr) => {{
        match $db {
            common::AppDb::Postgres(p, _) => {
                let mut t = p.begin().await.unwrap();
                let out = {
                    let $conn = &mut *t;
                    $body
                };
                t.$end().await.unwrap();
                out
            }
            common::AppDb::Sqlite(p, _, _) => {
                let mut t = p.begin_with("BEGIN IMMEDIATE").await.unwrap();
                let out = {
                    let $conn = &mut *t;
                    $body
                };
                t.$end().await.unwrap();
                out
            }
        }
    }};
}
