//! S7: a late retry after the retention window gets 410 and executes nothing; after the
//! tombstone window the key is new again. On both stores, with 1 s retention.

mod common;

use common::{ADMIN_KEY, Backend, Db, Server, idem_bin};
use serde_json::json;
use std::time::Duration;

const CONFIG: &str = "[retention]\ndefault = \"1s\"\ntombstone = \"3s\"\nsweep_interval_ms = 100\n\n[actions.export]\nretention = \"forever\"\n";

async fn s7_late_request_after_the_retention_window(b: Backend) {
    let db = Db::new(b).await;
    let s = Server::start_with_config(&db.url, CONFIG);
    let key = "INQ-007:confirmation:v1";
    let granted = s.acquire(key, json!({"to": "c-7"})).await;
    assert_eq!(granted.status, 201);
    let done = s
        .complete(key, json!({"fencing_token": granted.token(), "outcome": "succeeded", "provider_ref": "msg-007"}))
        .await;
    assert!(done.body["expires_at"].is_string(), "{done:?}");
    // A permanent business key never expires.
    let export = json!({"key": "export:batch-1", "action": "export", "payload": {}});
    let exported = s.post(ADMIN_KEY, "/v1/operations", &export).await;
    assert_eq!(exported.status, 201);
    s.complete(
        "export:batch-1",
        json!({"fencing_token": exported.token(), "outcome": "succeeded", "provider_ref": "exp-1"}),
    )
    .await;

    tokio::time::sleep(Duration::from_millis(1_600)).await;
    assert_eq!(s.record(key).await.status, 404, "the record was swept");
    let late = s.acquire(key, json!({"to": "c-7"})).await;
    assert_eq!(late.status, 410, "{late:?}");
    assert_eq!(late.problem(), "late-arrival");
    let other = s.acquire(key, json!({"to": "someone-else"})).await;
    assert_eq!(other.status, 410, "410 whatever the payload");
    // The CLI gives a late arrival its own exit status (13), not the 1 of "server
    // unreachable" that scripts retry on.
    let cli = std::process::Command::new(idem_bin())
        .args(["acquire", key, "--action", "send_email", "--payload", r#"{"to": "c-7"}"#])
        .env("IDEM_URL", &s.base)
        .env("IDEM_API_KEY", ADMIN_KEY)
        .output()
        .unwrap();
    assert_eq!(cli.status.code(), Some(13), "{}", String::from_utf8_lossy(&cli.stderr));
    assert!(String::from_utf8_lossy(&cli.stdout).contains("late-arrival"), "{cli:?}");
    // The old worker's late completion is told the same (not a bare 404), and not recorded.
    let late_done = s
        .complete(key, json!({"fencing_token": granted.token(), "outcome": "succeeded", "provider_ref": "late"}))
        .await;
    assert_eq!((late_done.status.as_u16(), late_done.problem()), (410, "late-arrival"));
    assert_eq!(s.complete("never-used", json!({"fencing_token": 1, "outcome": "unknown"})).await.status, 404);
    assert_eq!(s.record(key).await.status, 404, "nothing executed");
    assert_eq!(s.record("export:batch-1").await.body["state"], "SUCCEEDED", "forever is forever");

    // After the tombstone window (3 s from completion) the key is new again.
    tokio::time::sleep(Duration::from_millis(1_800)).await;
    let again = s.acquire(key, json!({"to": "c-7"})).await;
    assert_eq!(again.status, 201);
    // A worker of the old operation cannot complete the new one.
    assert!(again.token() > granted.token());
    let stale =
        s.complete(key, json!({"fencing_token": granted.token(), "outcome": "succeeded", "provider_ref": "old"})).await;
    assert_eq!((stale.status.as_u16(), stale.problem()), (409, "stale-fencing-token"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_s7_late_request_after_the_retention_window() {
    s7_late_request_after_the_retention_window(Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_s7_late_request_after_the_retention_window() {
    s7_late_request_after_the_retention_window(Backend::Postgres).await;
}
