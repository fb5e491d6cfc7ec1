//! The shared conformance suite on both stores: SQLite in a temporary file, and a real
//! PostgreSQL server (a fresh database per run; see `idem_store::testing`).

use idem_store::{Store, StoreConfig, conformance, postgres::PgStore, sqlite::SqliteStore};
use std::sync::Arc;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_passes_the_conformance_suite() {
    let dir = tempfile::tempdir().unwrap();
    let n = std::sync::atomic::AtomicUsize::new(0);
    conformance::run_all(|clock| {
        let path = dir.path().join(format!(
            "case{}.db",
            n.fetch_add(1, std::sync::atomic::Ordering::SeqCst)
        ));
        async move {
            Arc::new(
                SqliteStore::open(path, clock, conformance::case_config())
                    .await
                    .unwrap(),
            ) as Arc<dyn Store>
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_passes_the_conformance_suite() {
    let url = idem_store::testing::fresh_pg_database("idem_conformance").await;
    conformance::run_all(|clock| {
        let url = url.url.clone();
        async move {
            Arc::new(
                PgStore::connect(&url, clock, conformance::case_config())
                    .await
                    .unwrap(),
            ) as Arc<dyn Store>
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_file_uses_wal_and_full_sync() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("idem.db");
    let _store = SqliteStore::open(&path, Arc::new(idem_core::SystemClock), StoreConfig::default()).await.unwrap();
    assert!(path.exists(), "created on first open");
    use sqlx::{Connection, SqliteConnection};
    let mut c = SqliteConnection::connect(&format!("sqlite://{}", path.display())).await.unwrap();
    let (mode,): (String,) = sqlx::query_as("PRAGMA journal_mode").fetch_one(&mut c).await.unwrap();
    assert_eq!(mode, "wal");
}

/// The index each background query must use (migration 0005's partial indexes); a plan
/// that scans the table, or uses another index, fails.
const BACKGROUND_INDEXES: [(&str, &[&str]); 4] = [
    ("expire_leases", &["operations_executing"]),
    ("due_executions", &["operations_pending", "operations_executing"]),
    ("due_reconciliations", &["operations_unknown"]),
    ("sweep", &["operations_by_expiry"]),
];

fn check_plans(plans: Vec<(&'static str, String)>) {
    assert_eq!(plans.len(), BACKGROUND_INDEXES.len());
    for ((name, plan), (expected, indexes)) in plans.into_iter().zip(BACKGROUND_INDEXES) {
        assert_eq!(name, expected);
        for index in indexes {
            assert!(plan.contains(index), "{name} does not use {index}: {plan}");
        }
    }
}

/// A table shaped like a live one: 400 finished operations and 40 in flight.
async fn fill(store: &dyn Store) {
    use idem_core::{AcquireInput, Actor, Outcome};
    for i in 0..440 {
        let key = format!("k{i}");
        let input = AcquireInput {
            tenant: "t".into(),
            key: key.clone(),
            action: "send".into(),
            payload: serde_json::json!({"i": i}),
            fingerprint: "f".into(),
            lease_ms: 60_000,
            redo_safe: false,
            connector: None,
            holder: None,
            actor: Actor::default(),
        };
        let granted = store.acquire(input).await.unwrap();
        if i < 400 {
            let done = idem_store::CompleteRequest {
                tenant: "t".into(),
                key,
                fencing_token: granted.record.fencing_token,
                outcome: Outcome::Succeeded { provider_ref: format!("r{i}"), result: None },
                actor: Actor::default(),
                policy: None,
            };
            store.complete(done).await.unwrap();
        }
    }
}

/// The batch writer's reads (records and tombstones of a batch's keys) are one probe of the
/// unique index per key and build no ephemeral B-tree: `IN (VALUES …)` did, and that was
/// 12 % of a pair's instructions (scripts/callgrind.sh).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hot_reads_probe_the_unique_indexes_without_temporary_tables() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("hot.db");
    let sqlite = SqliteStore::open(&path, Arc::new(idem_core::SystemClock), StoreConfig::default()).await.unwrap();
    fill(&sqlite).await;
    let mut conn =
        <sqlx::SqliteConnection as sqlx::Connection>::connect(&format!("sqlite://{}", path.display())).await.unwrap();
    let plans = idem_store::testing::hot_read_plans_sqlite(&mut conn).await.unwrap();
    assert_eq!(plans.len(), 4);
    for (name, plan, ops) in plans {
        if name.ends_with('s') {
            assert!(plan.contains("SCAN j VIRTUAL TABLE"), "{name}: the key list must be the outer loop: {plan}");
        } else {
            assert!(!plan.contains("SCAN"), "{name}: a point read scans nothing: {plan}");
        }
        assert!(plan.contains("SEARCH") && plan.contains("INDEX"), "{name}: one index probe per key: {plan}");
        assert!(!ops.iter().any(|o| o == "OpenEphemeral"), "{name}: builds an ephemeral table: {ops:?}");
    }
}

/// No write to a hot table builds an ephemeral table. A CHECK constraint with an `IN` list
/// of more than two constants did, per written row (an acquire's upsert once, a
/// completion's twice: ~13 % of a pair's instructions with the connection effect of
/// migration 0010, scripts/callgrind.sh).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hot_writes_build_no_ephemeral_tables() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("writes.db");
    let _store = SqliteStore::open(&path, Arc::new(idem_core::SystemClock), StoreConfig::default()).await.unwrap();
    let mut conn =
        <sqlx::SqliteConnection as sqlx::Connection>::connect(&format!("sqlite://{}", path.display())).await.unwrap();
    let writes = idem_store::testing::hot_write_opcodes_sqlite(&mut conn).await.unwrap();
    assert_eq!(writes.len(), 6);
    for (sql, ops) in writes {
        assert!(ops.len() > 10, "{sql}: {ops:?}");
        assert!(!ops.iter().any(|o| o == "OpenEphemeral"), "{sql}: builds an ephemeral table: {ops:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn background_queries_use_the_partial_indexes() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("plans.db");
    let sqlite = SqliteStore::open(&path, Arc::new(idem_core::SystemClock), StoreConfig::default()).await.unwrap();
    fill(&sqlite).await;
    let mut conn =
        <sqlx::SqliteConnection as sqlx::Connection>::connect(&format!("sqlite://{}", path.display())).await.unwrap();
    sqlx::query("ANALYZE").execute(&mut conn).await.unwrap();
    check_plans(idem_store::testing::background_query_plans_sqlite(&mut conn).await.unwrap());

    let url = idem_store::testing::fresh_pg_database("idem_plans").await;
    let pg = PgStore::connect(&url, Arc::new(idem_core::SystemClock), StoreConfig::default()).await.unwrap();
    fill(&pg).await;
    let mut conn = pg.pool().acquire().await.unwrap();
    sqlx::query("ANALYZE operations").execute(&mut *conn).await.unwrap();
    check_plans(idem_store::testing::background_query_plans_postgres(&mut conn).await.unwrap());
}
