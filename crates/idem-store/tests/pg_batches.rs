//! PostgreSQL group commit: concurrent requests share one statement, yet each gets its own
//! answer. A request the database refuses fails alone.

use idem_core::{AcquireInput, Actor, Decision, SystemClock};
use idem_store::{Store, StoreError, postgres::PgStore};
use serde_json::json;
use std::sync::Arc;

fn input(key: &str) -> AcquireInput {
    AcquireInput {
        tenant: "t".into(),
        key: key.into(),
        action: "send".into(),
        payload: json!({"to": key}),
        fingerprint: "f".into(),
        lease_ms: 60_000,
        redo_safe: false,
        connector: None,
        actor: Actor { principal: "w".into(), request_id: None },
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_the_database_refuses_does_not_fail_its_batch() {
    let url = idem_store::testing::fresh_pg_database("idem_batches").await;
    let store: Arc<dyn Store> =
        Arc::new(PgStore::connect(&url, Arc::new(SystemClock), Default::default()).await.unwrap());
    for round in 0..5 {
        // PostgreSQL text cannot hold a NUL byte: that row makes its statement fail.
        let keys: Vec<String> =
            (0..32).map(|i| if i == 7 { format!("bad\0{round}") } else { format!("r{round}-k{i}") }).collect();
        let tasks: Vec<_> = keys
            .iter()
            .map(|k| {
                let (store, k) = (store.clone(), k.clone());
                tokio::spawn(async move { store.acquire(input(&k)).await })
            })
            .collect();
        for (i, t) in tasks.into_iter().enumerate() {
            let got = t.await.unwrap();
            if i == 7 {
                assert!(matches!(got, Err(StoreError::Database(_))), "the bad request must fail: {got:?}");
            } else {
                assert_eq!(got.unwrap().decision, Decision::Acquire, "request {i} of round {round}");
            }
        }
    }
    // Every good request was written exactly once, with its event.
    let pg = PgStore::connect(&url, Arc::new(SystemClock), Default::default()).await.unwrap();
    let (ops,): (i64,) = sqlx::query_as("SELECT COUNT(*) FROM operations").fetch_one(pg.pool()).await.unwrap();
    let (events,): (i64,) = sqlx::query_as("SELECT COUNT(*) FROM operation_events").fetch_one(pg.pool()).await.unwrap();
    assert_eq!((ops, events), (5 * 31, 5 * 31));
}
