//! Upgrading an existing SQLite ledger: migration 0010 edits the definitions of
//! `operations`, `workflow_instances` and `workflow_steps` in place (CHECK constraints
//! without ephemeral tables, `operations.id` without AUTOINCREMENT). A ledger written
//! under 0009 must come out of it with every row, id, index and trigger, its constraints
//! still enforced, and readable by the store.

use idem_core::{ManualClock, State};
use idem_store::{Store, StoreConfig, sqlite::SqliteStore};
use sqlx::{Connection, Row, SqliteConnection};
use std::sync::Arc;

/// `(table, columns)` whose rows must survive the rebuild unchanged.
const TABLES: [(&str, &str); 3] = [
    (
        "operations",
        "id, tenant, op_key, action, fingerprint, payload, state, attempt_count, lease_owner, lease_expires_at, \
         fencing_token, next_attempt_at, provider_ref, result, error_class, error_message, verified_at, \
         evidence_source, needs_review, redo_safe, created_at, updated_at, completed_at, expires_at, version, \
         connector, lookup_attempts, lease_holder",
    ),
    (
        "workflow_instances",
        "tenant, instance_id, workflow, definition_version, source_event, input, input_fingerprint, state, \
         stopped_step, error_class, error_message, trace_id, next_run_at, created_at, updated_at, completed_at, \
         expires_at, version",
    ),
    ("workflow_steps", "tenant, instance_id, position, step, op_key, comp_key, policy"),
];

/// Every row of `TABLES` as text, in key order.
async fn rows(conn: &mut SqliteConnection) -> Vec<String> {
    let mut out = Vec::new();
    for (table, cols) in TABLES {
        let sql = format!("SELECT json_array({cols}) FROM {table} ORDER BY 1");
        for row in sqlx::query(sqlx::AssertSqlSafe(sql)).fetch_all(&mut *conn).await.unwrap() {
            out.push(format!("{table}: {}", row.get::<String, _>(0)));
        }
    }
    out
}

/// The indexes of `TABLES`: (name, table, SQL; autoindexes without SQL).
async fn indexes(conn: &mut SqliteConnection) -> Vec<(String, String, Option<String>)> {
    sqlx::query_as(
        "SELECT name, tbl_name, sql FROM sqlite_schema WHERE type = 'index' \
         AND tbl_name IN ('operations', 'workflow_instances', 'workflow_steps') ORDER BY name",
    )
    .fetch_all(&mut *conn)
    .await
    .unwrap()
}

#[tokio::test]
async fn a_ledger_written_under_0009_keeps_every_row_index_and_rule() {
    let dir = tempfile::tempdir().unwrap();
    // Migrations 0001–0009 as they shipped, from this crate's own files.
    let old = dir.path().join("migrations-0009");
    std::fs::create_dir(&old).unwrap();
    let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("migrations/sqlite");
    for entry in std::fs::read_dir(&src).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_str().unwrap().to_owned();
        if name.as_str() < "0010" {
            std::fs::copy(&path, old.join(&name)).unwrap();
        }
    }
    let db = dir.path().join("idem.db");
    let url = format!("sqlite://{}?mode=rwc", db.display());
    let mut conn = SqliteConnection::connect(&url).await.unwrap();
    sqlx::migrate::Migrator::new(old.as_path()).await.unwrap().run(&mut conn).await.unwrap();
    let statements = [
        "INSERT INTO operations (tenant, op_key, action, fingerprint, payload, state, attempt_count, \
         fencing_token, provider_ref, result, evidence_source, verified_at, created_at, updated_at, completed_at, \
         expires_at, version, connector, lookup_attempts) VALUES ('t', 'order-1', 'send', 'fp1', '{\"to\":\"a\"}', \
         'SUCCEEDED', 1, 1, 'ref-1', '{\"id\":\"m1\"}', 'provider', 2000, 1000, 2000, 2000, 90000, 2, 'mail', 1)",
        "INSERT INTO operations (tenant, op_key, action, fingerprint, payload, state, attempt_count, lease_owner, \
         lease_expires_at, fencing_token, redo_safe, created_at, updated_at, version, lease_holder) \
         VALUES ('t', 'order-2', 'send', 'fp2', '{}', 'EXECUTING', 1, 'w', 5000, 1, 1, 1500, 1500, 1, 'job-7')",
        "INSERT INTO operations (tenant, op_key, action, fingerprint, payload, state, attempt_count, fencing_token, \
         error_class, error_message, needs_review, next_attempt_at, created_at, updated_at, version) \
         VALUES ('u', 'order-3', 'charge', 'fp3', '[1,2]', 'UNKNOWN', 2, 2, 'timeout', 'no answer', 1, 7000, 1600, \
         1700, 3)",
        "INSERT INTO workflow_instances (tenant, instance_id, workflow, definition_version, input, input_fingerprint, \
         state, next_run_at, created_at, updated_at, version) VALUES ('t', 'inst-1', 'signup', 'v1', '{}', 'fpi', \
         'RUNNING', 3000, 1000, 1000, 1)",
        "INSERT INTO workflow_steps (tenant, instance_id, position, step, op_key, comp_key, policy) \
         VALUES ('t', 'inst-1', 0, 'welcome', 'order-1', 'order-1:compensate', 'lookup_before_redo')",
    ];
    for s in statements {
        sqlx::query(s).execute(&mut conn).await.unwrap();
    }
    // A trigger of the user's on a hot table (a rebuild would have dropped it).
    sqlx::query(
        "CREATE TRIGGER users_audit AFTER UPDATE OF state ON operations \
         BEGIN UPDATE operations SET error_message = 'seen by users_audit' WHERE id = NEW.id; END",
    )
    .execute(&mut conn)
    .await
    .unwrap();
    let rows_before = rows(&mut conn).await;
    let indexes_before = indexes(&mut conn).await;
    assert_eq!(rows_before.len(), 5);
    conn.close().await.unwrap();

    let store = SqliteStore::open(&db, Arc::new(ManualClock::new(10_000)), StoreConfig::default()).await.unwrap();
    let mut conn = SqliteConnection::connect(&url).await.unwrap();
    let applied: Vec<(i64,)> =
        sqlx::query_as("SELECT version FROM _sqlx_migrations ORDER BY version").fetch_all(&mut conn).await.unwrap();
    assert!(applied.iter().any(|(v,)| *v == 10), "0010 ran: {applied:?}");
    assert_eq!(rows(&mut conn).await, rows_before, "every row kept, every column unchanged");
    let indexes_after = indexes(&mut conn).await;
    assert_eq!(indexes_after, indexes_before, "the same indexes");
    let schema: Vec<(String,)> = sqlx::query_as(
        "SELECT sql FROM sqlite_schema WHERE name IN ('operations', 'workflow_instances', 'workflow_steps')",
    )
    .fetch_all(&mut conn)
    .await
    .unwrap();
    for (sql,) in &schema {
        assert!(!sql.contains(" IN ("), "no IN list left in a CHECK: {sql}");
    }
    assert!(!schema.iter().any(|(s,)| s.contains("AUTOINCREMENT")), "{schema:?}");
    let (check,): (String,) = sqlx::query_as("PRAGMA integrity_check").fetch_one(&mut conn).await.unwrap();
    assert_eq!(check, "ok");
    let (triggers,): (i64,) =
        sqlx::query_as("SELECT count(*) FROM sqlite_schema WHERE type = 'trigger' AND name = 'users_audit'")
            .fetch_one(&mut conn)
            .await
            .unwrap();
    assert_eq!(triggers, 1, "the user's trigger is kept");

    // The rules still hold: each CHECK refuses what it refused before.
    for bad in [
        "UPDATE operations SET state = 'DONE' WHERE op_key = 'order-2'",
        "UPDATE operations SET provider_ref = NULL WHERE op_key = 'order-1'",
        "INSERT INTO operations (tenant, op_key, action, fingerprint, payload, state, attempt_count, fencing_token, \
         created_at, updated_at, version) VALUES ('t', 'order-1', 'a', 'f', '{}', 'PENDING', 0, 0, 1, 1, 1)",
        "UPDATE workflow_instances SET state = 'DONE'",
        "UPDATE workflow_steps SET policy = 'retry'",
        "INSERT INTO workflow_steps (tenant, instance_id, position, step, op_key, comp_key, policy) \
         VALUES ('t', 'inst-1', 1, 'other', 'order-1', 'x', 'manual')",
    ] {
        assert!(sqlx::query(bad).execute(&mut conn).await.is_err(), "accepted: {bad}");
    }
    assert_eq!(rows(&mut conn).await, rows_before, "the refused writes changed nothing");

    // And the store reads and writes the upgraded ledger.
    let rec = store.get("t", "order-1").await.unwrap().expect("the record is there");
    assert_eq!((rec.state, rec.provider_ref.as_deref(), rec.version), (State::Succeeded, Some("ref-1"), 2));
    let rec = store.get("u", "order-3").await.unwrap().expect("the record is there");
    assert_eq!((rec.state, rec.needs_review), (State::Unknown, true));
    let page = store.list("t", &idem_store::ListFilter { limit: 10, ..Default::default() }).await.unwrap();
    assert_eq!(page.items.len(), 2, "listed by its index");
    // A new record gets a new id, above the old ones, and the trigger still fires.
    let input = idem_core::AcquireInput {
        tenant: "t".into(),
        key: "order-4".into(),
        action: "send".into(),
        payload: serde_json::json!({}),
        fingerprint: "fp4".into(),
        lease_ms: 1_000,
        redo_safe: false,
        connector: None,
        holder: None,
        actor: idem_core::Actor { principal: "w".into(), request_id: None },
    };
    let token = store.acquire(input).await.unwrap().record.fencing_token;
    let done = idem_store::CompleteRequest {
        tenant: "t".into(),
        key: "order-4".into(),
        fencing_token: token,
        outcome: idem_core::Outcome::Succeeded { provider_ref: "ref-4".into(), result: None },
        actor: idem_core::Actor { principal: "w".into(), request_id: None },
        policy: None,
    };
    store.complete(done).await.unwrap();
    let (id, message): (i64, Option<String>) =
        sqlx::query_as("SELECT id, error_message FROM operations WHERE op_key = 'order-4'")
            .fetch_one(&mut conn)
            .await
            .unwrap();
    assert!(id > 3, "a fresh id: {id}");
    assert_eq!(message.as_deref(), Some("seen by users_audit"));
}
