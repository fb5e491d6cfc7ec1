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
