//! The SQLite writer's record cache (`sqlite_batch::WriterCache`) never answers from a
//! record the database no longer holds: a change by another connection on the same file
//! (another process, `PRAGMA data_version`), by a command outside the hot path (lease
//! expiry, sweeps: `total_changes()`) or by a trigger someone added to idem's tables
//! (the batch changed more rows than it wrote) makes the next batch read the record again.

mod common;

use common::success;
use idem_core::{AcquireInput, Decision, ManualClock};
use idem_store::{Store, StoreError, sqlite::SqliteStore};
use sqlx::Connection;
use std::sync::Arc;

fn input(key: &str) -> AcquireInput {
    common::input(key, 1_000)
}

async fn open() -> (tempfile::TempDir, SqliteStore, sqlx::SqliteConnection, Arc<ManualClock>) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cache.db");
    let clock = Arc::new(ManualClock::new(1_000_000));
    let store = SqliteStore::open(&path, clock.clone(), Default::default()).await.unwrap();
    let raw = sqlx::SqliteConnection::connect(&format!("sqlite://{}", path.display())).await.unwrap();
    (dir, store, raw, clock)
}

#[tokio::test]
async fn a_new_token_granted_by_another_process_fences_the_cached_one() {
    let (_dir, store, mut raw, _clock) = open().await;
    let token = store.acquire(input("k")).await.unwrap().record.fencing_token;
    // Another process on the same file re-grants the lease (the next token).
    sqlx::query("UPDATE operations SET fencing_token = ?, attempt_count = 2, version = version + 1 WHERE op_key = 'k'")
        .bind(token + 1)
        .execute(&mut raw)
        .await
        .unwrap();
    let stale = store.complete(success("k", token)).await;
    assert!(matches!(stale, Err(StoreError::Complete(_))), "the first token is stale now: {stale:?}");
    assert!(store.complete(success("k", token + 1)).await.is_ok());
}

#[tokio::test]
async fn a_record_another_process_removed_is_not_replayed_from_the_cache() {
    let (_dir, store, mut raw, _clock) = open().await;
    let token = store.acquire(input("k")).await.unwrap().record.fencing_token;
    store.complete(success("k", token)).await.unwrap();
    assert_eq!(store.acquire(input("k")).await.unwrap().decision, Decision::Replay);
    sqlx::query("DELETE FROM operations WHERE op_key = 'k'").execute(&mut raw).await.unwrap();
    let again = store.acquire(input("k")).await.unwrap();
    assert_eq!(again.decision, Decision::Acquire, "the key is new again");
    assert_eq!(again.record.attempt_count, 1);
}

#[tokio::test]
async fn a_lease_the_sweeper_expired_is_seen_by_the_next_trigger() {
    let (_dir, store, _raw, clock) = open().await;
    store.acquire(input("k")).await.unwrap();
    clock.advance(2_000);
    assert_eq!(store.expire_leases(100).await.unwrap(), 1);
    // From the database: UNKNOWN, reconciliation pending. From a stale cache it would be
    // EXECUTING with an expired lease, expired a second time (ExpireToUnknown).
    assert_eq!(store.acquire(input("k")).await.unwrap().decision, Decision::Unknown);
    let expiries = store.events("t", "k").await.unwrap().iter().filter(|e| e.kind.as_str() == "lease_expired").count();
    assert_eq!(expiries, 1);
}

#[tokio::test]
async fn a_trigger_that_rewrites_idems_row_is_not_hidden_by_the_cache() {
    // A break-it finding: a trigger on `operations` changed the row during the writer's
    // own commit, and replays kept answering the cached copy.
    let (_dir, store, mut raw, _clock) = open().await;
    sqlx::query(
        "CREATE TRIGGER rewrite_ref AFTER UPDATE OF state ON operations WHEN NEW.state = 'SUCCEEDED' \
         BEGIN UPDATE operations SET provider_ref = 'from-trigger' WHERE id = NEW.id; END",
    )
    .execute(&mut raw)
    .await
    .unwrap();
    let token = store.acquire(input("k")).await.unwrap().record.fencing_token;
    store.complete(success("k", token)).await.unwrap();
    let replay = store.acquire(input("k")).await.unwrap();
    assert_eq!(replay.decision, Decision::Replay);
    assert_eq!(replay.record.provider_ref.as_deref(), Some("from-trigger"), "the database's row, not the cached one");
}
