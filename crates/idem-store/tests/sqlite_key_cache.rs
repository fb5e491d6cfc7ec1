//! The SQLite server's API key cache: a key revoked outside the server (another process on
//! the same file, like `idem keys revoke`, or by hand) stops working within the epoch poll.

use idem_store::keys::Role;
use idem_store::{Store, sqlite::SqliteStore};
use sqlx::Connection;
use std::sync::Arc;
use std::time::Duration;

/// Polls `store` for up to 2 s until `secret` no longer authenticates.
async fn stops_authenticating(store: &SqliteStore, secret: &str) -> bool {
    for _ in 0..40 {
        if store.authenticate(secret).await.unwrap().is_none() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_revoked_outside_the_server_stops_working_within_the_poll() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("keys.db");
    let clock = Arc::new(idem_core::SystemClock);
    let server = SqliteStore::open(&path, clock.clone(), Default::default()).await.unwrap();
    // Let the epoch poller start (the cache is off until its first read).
    tokio::time::sleep(idem_store::sqlite::KEY_EPOCH_POLL * 3).await;
    let mut raw = sqlx::SqliteConnection::connect(&format!("sqlite://{}", path.display())).await.unwrap();

    // The cache is in use: a change that bypasses the triggers goes unseen by the server.
    let (k1, s1) = server.create_api_key("t", "p1", Role::Client, None).await.unwrap();
    assert!(server.authenticate(&s1).await.unwrap().is_some());
    sqlx::query("DROP TRIGGER api_keys_updated").execute(&mut raw).await.unwrap();
    sqlx::query("UPDATE api_keys SET revoked_at = 1 WHERE id = ?").bind(&k1.id).execute(&mut raw).await.unwrap();
    sqlx::query(
        "CREATE TRIGGER api_keys_updated AFTER UPDATE ON api_keys \
         BEGIN UPDATE api_key_epoch SET epoch = epoch + 1 WHERE id = 1; END",
    )
    .execute(&mut raw)
    .await
    .unwrap();
    tokio::time::sleep(idem_store::sqlite::KEY_EPOCH_POLL * 2).await;
    assert!(server.authenticate(&s1).await.unwrap().is_some(), "the server read the database: no cache in use");

    // Revoked by another process on the same file (what `idem keys revoke` does).
    let (k2, s2) = server.create_api_key("t", "p2", Role::Client, None).await.unwrap();
    assert!(server.authenticate(&s2).await.unwrap().is_some());
    let cli = SqliteStore::open(&path, clock.clone(), Default::default()).await.unwrap();
    assert!(cli.revoke_api_key(&k2.id).await.unwrap());
    assert!(stops_authenticating(&server, &s2).await, "a key revoked by another process still works");
    assert!(server.authenticate(&s1).await.unwrap().is_none(), "the epoch change emptied the whole cache");

    // Revoked through the server itself: at once.
    let (k3, s3) = server.create_api_key("t", "p3", Role::Client, None).await.unwrap();
    assert!(server.authenticate(&s3).await.unwrap().is_some());
    assert!(server.revoke_api_key(&k3.id).await.unwrap());
    assert!(server.authenticate(&s3).await.unwrap().is_none());

    // Deleted by hand.
    let (k4, s4) = server.create_api_key("t", "p4", Role::Client, None).await.unwrap();
    assert!(server.authenticate(&s4).await.unwrap().is_some());
    sqlx::query("DELETE FROM api_keys WHERE id = ?").bind(&k4.id).execute(&mut raw).await.unwrap();
    assert!(stops_authenticating(&server, &s4).await, "a key deleted by hand still works");
}
