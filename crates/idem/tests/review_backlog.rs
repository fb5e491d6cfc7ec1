//! A large expired backlog (issue 15 §1): after 100 000 leases expired on PostgreSQL, all
//! became UNKNOWN within 10 s but review flagging went at ~64/s (32 operations per 500 ms
//! pass, one write at a time). It now keeps up with the ledger's write rate, and an
//! operation the caller performed is flagged as soon as its expired lease is swept.

mod common;

use common::{ADMIN_KEY, Backend, Db, Server};
use serde_json::json;
use sqlx::Connection;
use std::time::{Duration, Instant};

async fn counts(db_url: &str) -> (i64, i64) {
    let mut conn = sqlx::PgConnection::connect(db_url).await.unwrap();
    sqlx::query_as(
        "SELECT count(*) FILTER (WHERE state = 'UNKNOWN'), count(*) FILTER (WHERE needs_review) FROM operations",
    )
    .fetch_one(&mut conn)
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn thousands_of_expired_leases_are_flagged_for_review_at_the_ledgers_pace() {
    let db = Db::new(Backend::Postgres).await;
    let s = Server::start(&db.url);
    const N: usize = 3000;
    let http = reqwest::Client::new();
    let acquire = |i: usize| {
        let req = http
            .post(s.url("/v1/operations"))
            .bearer_auth(ADMIN_KEY)
            .json(&json!({"key": format!("bulk-{i}"), "action": "import_row", "payload": {"row": i}, "lease_ms": 100}));
        async move { req.send().await.unwrap().status() }
    };
    use futures_util::StreamExt as _;
    let statuses: Vec<_> = futures_util::stream::iter(0..N).map(acquire).buffer_unordered(64).collect().await;
    assert!(statuses.iter().all(|s| *s == 201), "every acquire granted");
    let granted = Instant::now();

    // All N leases have run out 100 ms from now; then each must be flagged.
    loop {
        let (unknown, flagged) = counts(&db.url).await;
        if flagged as usize == N {
            assert_eq!(unknown as usize, N);
            break;
        }
        assert!(
            granted.elapsed() < Duration::from_secs(15),
            "{flagged} of {N} flagged for review after {:?} ({unknown} UNKNOWN)",
            granted.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    eprintln!("{N} expired leases flagged for review {:?} after the last grant", granted.elapsed());
    let metrics = s.http.get(s.url("/metrics")).send().await.unwrap().text().await.unwrap();
    assert!(metrics.lines().any(|l| l == "idem_reconciliation_backlog 0"), "{metrics}");
    assert!(metrics.lines().any(|l| l == format!("idem_review_queue_depth {N}")));
}

/// The book (docs/src/concepts/unknown.md) says an operation the caller performed is
/// flagged as soon as its expired lease is swept; it took about 2 s (the next reconciler
/// pass).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_performed_operation_is_flagged_as_soon_as_its_lease_is_swept() {
    for backend in common::BACKENDS {
        let db = Db::new(backend).await;
        // The reconciler's own pass comes every 5 s here: only the sweep's wake-up can be fast.
        let s = Server::start_with_config(&db.url, "[reconciler]\ninterval_ms = 5000\n");
        tokio::time::sleep(Duration::from_millis(300)).await;
        let r = s.post(ADMIN_KEY, "/v1/operations", &json!({"key": "cp-1", "action": "a", "lease_ms": 100})).await;
        assert_eq!(r.status, 201);
        let granted = Instant::now();
        let rec = s.wait_for("cp-1", 10, |r| r["needs_review"] == true).await;
        let took = granted.elapsed();
        assert_eq!(rec["state"], "UNKNOWN");
        // Lease 100 ms + a sweep every 50 ms (the harness's --sweep-interval-ms).
        assert!(took < Duration::from_millis(1000), "{backend:?}: flagged {took:?} after the grant");
    }
}
