//! Reads and the WAL's sync thread (`sqlite_sync`): a read waits only for commits that
//! started before it, never for a batch that is still waiting for another process's write
//! lock, and every write is readable (and its answer sent) once acknowledged.

mod common;

use common::{input, success};
use idem_core::{State, SystemClock};
use idem_store::{Store, sqlite::SqliteStore};
use sqlx::Connection;
use std::sync::Arc;
use std::time::{Duration, Instant};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_does_not_wait_for_a_write_blocked_by_another_process() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("idem.db");
    let store = Arc::new(SqliteStore::open(&path, Arc::new(SystemClock), Default::default()).await.unwrap());
    let granted = store.acquire(input("before", 60_000)).await.unwrap();
    store.complete(success("before", granted.record.fencing_token)).await.unwrap();

    // Another process holds the write lock (as `idem keys create` or a user's transaction
    // would); the store's next write waits for it (busy_timeout).
    let mut other = sqlx::SqliteConnection::connect(&format!("sqlite://{}", path.display())).await.unwrap();
    sqlx::query("BEGIN IMMEDIATE").execute(&mut other).await.unwrap();
    let blocked = {
        let store = store.clone();
        tokio::spawn(async move { store.acquire(input("blocked", 60_000)).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!blocked.is_finished(), "the write waits for the other process's lock");

    // Reads answer meanwhile, from what is durable.
    let start = Instant::now();
    let read = store.get("t", "before").await.unwrap().expect("the acknowledged record");
    assert_eq!(read.state, State::Succeeded);
    assert_eq!(read.fencing_token, granted.record.fencing_token);
    assert!(store.get("t", "blocked").await.unwrap().is_none());
    let events = store.events("t", "before").await.unwrap();
    assert!(!events.is_empty());
    assert!(
        start.elapsed() < Duration::from_secs(2),
        "reads waited {:?} for a write blocked by another process",
        start.elapsed()
    );

    // The lock goes; the write goes through and is readable once answered.
    sqlx::query("ROLLBACK").execute(&mut other).await.unwrap();
    let granted = tokio::time::timeout(Duration::from_secs(15), blocked).await.unwrap().unwrap().unwrap();
    let read = store.get("t", "blocked").await.unwrap().expect("acknowledged, so readable");
    assert_eq!(read.fencing_token, granted.record.fencing_token);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_writes_are_readable_as_soon_as_they_are_answered() {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(
        SqliteStore::open(dir.path().join("idem.db"), Arc::new(SystemClock), Default::default()).await.unwrap(),
    );
    let tasks: Vec<_> = (0..64)
        .map(|i| {
            let store = store.clone();
            tokio::spawn(async move {
                let key = format!("k-{i}");
                for round in 0..5 {
                    let k = format!("{key}-{round}");
                    let granted = store.acquire(input(&k, 60_000)).await.unwrap();
                    let seen = store.get("t", &k).await.unwrap().expect("an answered acquire is readable");
                    assert_eq!(seen.fencing_token, granted.record.fencing_token);
                    store.complete(success(&k, granted.record.fencing_token)).await.unwrap();
                    let seen = store.get("t", &k).await.unwrap().unwrap();
                    assert_eq!(seen.state, State::Succeeded, "{k}");
                }
            })
        })
        .collect();
    for t in tasks {
        tokio::time::timeout(Duration::from_secs(60), t).await.unwrap().unwrap();
    }
}
