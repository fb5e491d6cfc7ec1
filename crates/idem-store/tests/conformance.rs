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
        let url = url.clone();
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
