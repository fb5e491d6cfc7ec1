//! Helpers for tests that need a real PostgreSQL server.
//!
//! The server comes from `IDEM_TEST_PG_URL` (default
//! `postgres://postgres@127.0.0.1:5432/postgres`, the trust-auth local server that
//! `scripts/test.sh` starts). Each test gets a database of its own, so tests can run in
//! parallel and leave nothing behind that another run could trip over.

use sqlx::{Connection, PgConnection};

/// Default admin URL of the test server.
pub const DEFAULT_PG_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";

/// The admin URL of the test server.
pub fn pg_admin_url() -> String {
    std::env::var("IDEM_TEST_PG_URL").unwrap_or_else(|_| DEFAULT_PG_URL.to_string())
}

/// Creates a fresh, uniquely named database and returns its URL.
///
/// # Panics
/// If the server cannot be reached: PostgreSQL tests must not pass silently without one.
pub async fn fresh_pg_database(prefix: &str) -> String {
    let admin = pg_admin_url();
    let mut conn = PgConnection::connect(&admin).await.unwrap_or_else(|e| {
        panic!("PostgreSQL at {admin} is not reachable ({e}); run ./scripts/test.sh, which starts it")
    });
    let name = format!("{prefix}_{}", uuid::Uuid::now_v7().simple());
    // The name is ours (prefix + UUID), not user input.
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
        .execute(&mut conn)
        .await
        .expect("create test database");
    let base = admin.rsplit_once('/').map_or(admin.as_str(), |(b, _)| b);
    format!("{base}/{name}")
}

/// The query plan of each background query, as `(name, plan text)`, for the test that
/// checks they use their indexes.
#[doc(hidden)]
pub async fn background_query_plans_sqlite(
    conn: &mut sqlx::SqliteConnection,
) -> Result<Vec<(&'static str, String)>, sqlx::Error> {
    let mut out = Vec::new();
    for (name, sql) in crate::sql::BACKGROUND {
        let rows: Vec<(i64, i64, i64, String)> =
            sqlx::query_as(sqlx::AssertSqlSafe(format!("EXPLAIN QUERY PLAN {sql}")))
                .bind(0_i64)
                .bind(10_i64)
                .bind("c")
                .fetch_all(&mut *conn)
                .await?;
        out.push((name, rows.into_iter().map(|r| r.3).collect::<Vec<_>>().join("; ")));
    }
    Ok(out)
}

/// [`background_query_plans_sqlite`] for PostgreSQL, with sequential scans disabled for
/// the session (tiny test tables would otherwise be scanned whatever the indexes).
#[doc(hidden)]
pub async fn background_query_plans_postgres(
    conn: &mut sqlx::PgConnection,
) -> Result<Vec<(&'static str, String)>, sqlx::Error> {
    sqlx::query("SET enable_seqscan = off").execute(&mut *conn).await?;
    let mut out = Vec::new();
    for (name, sql) in crate::sql::BACKGROUND {
        let rows: Vec<(String,)> = sqlx::query_as(sqlx::AssertSqlSafe(format!("EXPLAIN {sql}")))
            .bind(0_i64)
            .bind(10_i64)
            .bind("c")
            .fetch_all(&mut *conn)
            .await?;
        out.push((name, rows.into_iter().map(|r| r.0).collect::<Vec<_>>().join("; ")));
    }
    sqlx::query("RESET enable_seqscan").execute(&mut *conn).await?;
    Ok(out)
}
