//! Scenarios S1, S2, S3, S5 and S8 of shared/scenarios/retry_scenarios.csv over HTTP
//! against a running `idem serve`, on SQLite and on PostgreSQL. The caller plays the
//! worker: it performs the side effect (counted here) only when granted a lease (201).

mod common;

use common::{ADMIN_KEY, Backend, Db, Server, event_kinds};
use serde_json::json;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

macro_rules! on_both_stores {
    ($($name:ident),* $(,)?) => {
        mod sqlite {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() { super::$name(super::Backend::Sqlite).await })*
        }
        mod postgres {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() { super::$name(super::Backend::Postgres).await })*
        }
    };
}

on_both_stores!(
    s1_same_message_sent_twice,
    s2_same_key_reused_with_different_content,
    s3_concurrent_claims_one_acquire,
    s5_validation_failure_is_replayed,
    s8_approved_new_version_is_a_new_intent,
);

fn p1() -> serde_json::Value {
    json!({"to": "customer-42", "template": "confirmation", "inquiry": "INQ-001"})
}

async fn s1_same_message_sent_twice(b: Backend) {
    let db = Db::new(b).await;
    let s = Server::start(&db.url);
    let key = "INQ-001:confirmation:v1";
    let t0 = s.acquire(key, p1()).await;
    assert_eq!(t0.status, 201, "{t0:?}");
    assert_eq!(t0.body["state"], "EXECUTING");
    assert!(t0.token() > 1_700_000_000_000, "tokens start at the creation instant (epoch ms)");
    let done = s
        .complete(key, json!({"fencing_token": t0.token(), "outcome": "succeeded", "provider_ref": "msg-001", "result": {"message_id": "msg-001"}}))
        .await;
    assert_eq!(done.status, 200, "{done:?}");
    // Same request again, with the payload's fields in another order.
    let t1 = s.acquire(key, json!({"inquiry": "INQ-001", "template": "confirmation", "to": "customer-42"})).await;
    assert_eq!(t1.status, 200, "{t1:?}");
    assert_eq!(t1.header("idempotent-replayed"), Some("true"));
    assert_eq!(t1.body["provider_ref"], "msg-001");
    assert_eq!(t1.body["result"], json!({"message_id": "msg-001"}));
    let rec = s.record(key).await.body;
    assert_eq!(rec["state"], "SUCCEEDED");
    assert_eq!(rec["attempt"], 1, "2 triggers mapped to 1 attempt");
    assert!(rec["verified_at"].is_string());
    assert_eq!(event_kinds(&rec), ["acquired", "completed", "replayed"]);
}

async fn s2_same_key_reused_with_different_content(b: Backend) {
    let db = Db::new(b).await;
    let s = Server::start(&db.url);
    let key = "INQ-002:confirmation:v1";
    let t0 = s.acquire(key, p1()).await;
    assert_eq!(t0.status, 201);
    let fp1 = t0.body["fingerprint"].as_str().unwrap().to_string();
    s.complete(key, json!({"fencing_token": t0.token(), "outcome": "succeeded", "provider_ref": "msg-002"})).await;
    let mut p2 = p1();
    p2["to"] = json!("someone-else");
    let t1 = s.acquire(key, p2).await;
    assert_eq!(t1.status, 422, "{t1:?}");
    assert_eq!(t1.problem(), "fingerprint-mismatch");
    let rec = s.record(key).await.body;
    assert_eq!(rec["state"], "SUCCEEDED");
    assert_eq!(rec["payload"], p1(), "stored payload P1 unchanged");
    assert_eq!(rec["fingerprint"], fp1.as_str());
    let mismatch = rec["events"].as_array().unwrap().iter().find(|e| e["kind"] == "mismatch").unwrap();
    let fp2 = mismatch["fingerprint"].as_str().unwrap();
    assert_ne!(fp2, fp1);
    assert!(mismatch["reason"].as_str().unwrap().contains(&fp1), "both fingerprints logged: {mismatch}");
}

async fn s3_concurrent_claims_one_acquire(b: Backend) {
    let db = Db::new(b).await;
    let s = Arc::new(Server::start(&db.url));
    let key = "INQ-003:confirmation:v1";
    let side_effects = Arc::new(AtomicUsize::new(0));
    let tasks: Vec<_> = (0..16)
        .map(|_| {
            let (s, fx) = (s.clone(), side_effects.clone());
            tokio::spawn(async move {
                let r = s.acquire(key, p1()).await;
                if r.status == 201 {
                    fx.fetch_add(1, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(200)).await; // the provider takes 200 ms
                    let c = s
                        .complete(
                            key,
                            json!({"fencing_token": r.token(), "outcome": "succeeded", "provider_ref": "msg-003"}),
                        )
                        .await;
                    assert_eq!(c.status, 200);
                } else {
                    assert_eq!(r.status, 409, "{r:?}");
                    assert_eq!(r.problem(), "operation-in-progress");
                    assert!(r.header("retry-after").is_some());
                }
                r.status.as_u16()
            })
        })
        .collect();
    let mut statuses = Vec::new();
    for t in tasks {
        statuses.push(t.await.unwrap());
    }
    assert_eq!(statuses.iter().filter(|s| **s == 201).count(), 1, "{statuses:?}");
    assert_eq!(side_effects.load(Ordering::SeqCst), 1);
    let rec = s.record(key).await.body;
    assert_eq!(rec["state"], "SUCCEEDED");
    assert_eq!(rec["attempt"], 1);
    assert_eq!(event_kinds(&rec).len(), 17, "16 triggers + 1 completion logged");

    // Waiting duplicates: they hold until the winner completes, then get the replay.
    let key = "INQ-003b:confirmation:v1";
    let first = s.acquire(key, p1()).await;
    assert_eq!(first.status, 201);
    let waiters: Vec<_> = (0..4)
        .map(|_| {
            let s = s.clone();
            tokio::spawn(async move {
                let body = json!({"key": key, "action": "send_confirmation", "payload": p1(), "wait_ms": 10_000});
                s.post(ADMIN_KEY, "/v1/operations", &body).await
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(200)).await;
    s.complete(key, json!({"fencing_token": first.token(), "outcome": "succeeded", "provider_ref": "msg-003b"})).await;
    for w in waiters {
        let r = w.await.unwrap();
        assert_eq!(r.status, 200, "{r:?}");
        assert_eq!(r.body["provider_ref"], "msg-003b");
    }
    let rec = s.record(key).await.body;
    assert_eq!(
        event_kinds(&rec),
        ["acquired", "completed", "replayed", "replayed", "replayed", "replayed"],
        "a waiting trigger is logged once"
    );
}

async fn s5_validation_failure_is_replayed(b: Backend) {
    let db = Db::new(b).await;
    let s = Server::start(&db.url);
    let key = "INQ-005:confirmation:v1";
    let bad = json!({"to": "not a valid recipient", "template": "confirmation"});
    let t0 = s.acquire(key, bad.clone()).await;
    assert_eq!(t0.status, 201);
    // The provider rejected the recipient (4xx); the caller reports the final failure.
    let f = s
        .complete(
            key,
            json!({"fencing_token": t0.token(), "outcome": "final_failure", "error_class": "validation",
                   "message": "550 5.1.3 bad recipient address syntax", "result": {"provider_status": 550}}),
        )
        .await;
    assert_eq!(f.status, 200, "{f:?}");
    assert_eq!(f.body["state"], "FAILED");
    let t1 = s.acquire(key, bad).await;
    assert_eq!(t1.status, 200, "{t1:?}");
    assert_eq!(t1.header("idempotent-replayed"), Some("true"));
    assert_eq!(t1.body["state"], "FAILED");
    assert_eq!(t1.body["error"]["class"], "validation");
    assert_eq!(t1.body["result"]["provider_status"], 550);
    let rec = s.record(key).await.body;
    assert_eq!(rec["attempt"], 1, "no second call to the provider");
    let completed = rec["events"].as_array().unwrap().iter().find(|e| e["kind"] == "completed").unwrap();
    assert_eq!(completed["error_class"], "validation");
}

async fn s8_approved_new_version_is_a_new_intent(b: Backend) {
    let db = Db::new(b).await;
    let s = Server::start(&db.url);
    let v1 = s.acquire("INQ-008:confirmation:v1", p1()).await;
    assert_eq!(v1.status, 201);
    s.complete(
        "INQ-008:confirmation:v1",
        json!({"fencing_token": v1.token(), "outcome": "succeeded", "provider_ref": "msg-008-v1"}),
    )
    .await;
    let mut p2 = p1();
    p2["template"] = json!("confirmation-revised");
    let v2 = s.acquire("INQ-008:confirmation:v2", p2).await;
    assert_eq!(v2.status, 201, "a new version is a new intent, not blocked: {v2:?}");
    s.complete(
        "INQ-008:confirmation:v2",
        json!({"fencing_token": v2.token(), "outcome": "succeeded", "provider_ref": "msg-008-v2"}),
    )
    .await;
    for (k, r) in [("INQ-008:confirmation:v1", "msg-008-v1"), ("INQ-008:confirmation:v2", "msg-008-v2")] {
        let rec = s.record(k).await.body;
        assert_eq!(rec["state"], "SUCCEEDED");
        assert_eq!(rec["provider_ref"], r);
    }
    let page = s.get(ADMIN_KEY, "/v1/operations?state=SUCCEEDED").await;
    assert_eq!(page.body["items"].as_array().unwrap().len(), 2);
}
