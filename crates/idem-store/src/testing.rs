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

/// A database a test created; dropped (`DROP DATABASE … WITH (FORCE)`, which ends its
/// connections) when this guard goes, also when the test panics. Derefs to its URL.
///
/// A test process that is killed leaves its databases behind; `scripts/test.sh` drops
/// those its name dates (a UUIDv7) to before the run, never one a running test owns.
#[derive(Debug)]
pub struct TestDatabase {
    /// `postgres://…/<name>`.
    pub url: String,
    name: String,
    admin: String,
}

impl std::ops::Deref for TestDatabase {
    type Target = str;
    fn deref(&self) -> &str {
        &self.url
    }
}

impl std::fmt::Display for TestDatabase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.url)
    }
}

impl Drop for TestDatabase {
    fn drop(&mut self) {
        // Drop runs inside the test's runtime, which cannot be blocked on: a thread of
        // its own with a runtime of its own does the round trips.
        let (admin, name) = (self.admin.clone(), self.name.clone());
        let dropped = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().ok()?;
            rt.block_on(async {
                let mut conn = PgConnection::connect(&admin).await.ok()?;
                // The name is ours (prefix + UUID), not user input.
                sqlx::query(sqlx::AssertSqlSafe(format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)")))
                    .execute(&mut conn)
                    .await
                    .ok()
            })
        })
        .join();
        if !matches!(dropped, Ok(Some(_))) {
            eprintln!("could not drop the test database {}; scripts/test.sh drops it on its next run", self.name);
        }
    }
}

/// Creates a fresh, uniquely named database (`{prefix}_{UUIDv7}`); the guard drops it.
///
/// # Panics
/// If the server cannot be reached: PostgreSQL tests must not pass silently without one.
pub async fn fresh_pg_database(prefix: &str) -> TestDatabase {
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
    TestDatabase { url: format!("{base}/{name}"), name, admin }
}

/// The plan (EXPLAIN, lines joined by `; `) of the workflow checkpoints query for
/// `tenant`'s `instance` on `conn`, for the test that checks pooled connections join by
/// key lookups.
#[doc(hidden)]
pub async fn checkpoints_plan_postgres(
    conn: &mut sqlx::PgConnection,
    tenant: &str,
    instance: &str,
) -> Result<String, sqlx::Error> {
    let rows: Vec<(String,)> =
        sqlx::query_as(sqlx::AssertSqlSafe(format!("EXPLAIN {}", crate::flow_row::CHECKPOINTS_SQL.as_str())))
            .bind(tenant)
            .bind(instance)
            .fetch_all(&mut *conn)
            .await?;
    Ok(rows.into_iter().map(|r| r.0).collect::<Vec<_>>().join("; "))
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

/// The opcodes of the SQLite writer's writes to its hot tables — its upsert of one record,
/// its update of one, its insert of one event, an instance's and a step's insert, an instance's state change —
/// as `(statement, opcodes)`: the test that checks no write builds an ephemeral table (a
/// CHECK's `IN` list of more than two constants did, per written row; migration 0010).
#[doc(hidden)]
pub async fn hot_write_opcodes_sqlite(
    conn: &mut sqlx::SqliteConnection,
) -> Result<Vec<(String, Vec<String>)>, sqlx::Error> {
    let values = |cols: &str| format!("VALUES ({})", vec!["?"; cols.split(',').count()].join(", "));
    let statements = [
        crate::sqlite_batch::upsert_one().to_owned(),
        crate::sqlite_batch::update_one().to_owned(),
        crate::sqlite_batch::insert_event_one().to_owned(),
        format!(
            "INSERT INTO workflow_instances ({}) {}",
            crate::flow_row::instance_columns!(),
            values(crate::flow_row::instance_columns!())
        ),
        "UPDATE workflow_instances SET state = ?, version = version + 1 WHERE tenant = ? AND instance_id = ?"
            .to_owned(),
        format!(
            "INSERT INTO workflow_steps (tenant, instance_id, position, step, op_key, comp_key, policy) {}",
            values("tenant, instance_id, position, step, op_key, comp_key, policy")
        ),
    ];
    let mut out = Vec::new();
    for sql in statements {
        let rows: Vec<sqlx::sqlite::SqliteRow> =
            sqlx::query(sqlx::AssertSqlSafe(format!("EXPLAIN {sql}"))).fetch_all(&mut *conn).await?;
        let ops = rows.iter().map(|r| sqlx::Row::try_get::<String, _>(r, 1)).collect::<Result<Vec<_>, _>>()?;
        out.push((sql, ops));
    }
    Ok(out)
}

/// The hot path's reads on SQLite (the batch's records and tombstones), each as
/// `(name, plan text, opcodes)`: the test that checks they probe the unique indexes and
/// build no ephemeral table (an `OpenEphemeral` per statement cost 12 % of a pair's
/// instructions, see `sqlite_batch`).
#[doc(hidden)]
pub async fn hot_read_plans_sqlite(
    conn: &mut sqlx::SqliteConnection,
) -> Result<Vec<(&'static str, String, Vec<String>)>, sqlx::Error> {
    let mut out = Vec::new();
    for (name, sql) in crate::sqlite_batch::HOT_READS {
        // A key list (`json_each(?)`) or one key (`tenant = ? AND … = ?`).
        let binds: &[&str] = if sql.contains("json_each") { &[r#"[["t","k1"],["t","k2"]]"#] } else { &["t", "k1"] };
        let mut plan =
            sqlx::query_as::<_, (i64, i64, i64, String)>(sqlx::AssertSqlSafe(format!("EXPLAIN QUERY PLAN {sql}")));
        let mut explain = sqlx::query(sqlx::AssertSqlSafe(format!("EXPLAIN {sql}")));
        for b in binds {
            plan = plan.bind(*b);
            explain = explain.bind(*b);
        }
        let plan = plan.fetch_all(&mut *conn).await?;
        let ops: Vec<sqlx::sqlite::SqliteRow> = explain.fetch_all(&mut *conn).await?;
        let ops = ops.iter().map(|r| sqlx::Row::try_get::<String, _>(r, 1)).collect::<Result<Vec<_>, _>>()?;
        out.push((name, plan.into_iter().map(|r| r.3).collect::<Vec<_>>().join("; "), ops));
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
