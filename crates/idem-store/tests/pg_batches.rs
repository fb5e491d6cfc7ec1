//! PostgreSQL group commit: concurrent requests share one statement, yet each gets its own
//! answer. A request the database refuses fails alone.

use idem_core::{AcquireInput, Actor, Clock, Decision, SystemClock};
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
        holder: None,
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

/// A trigger that arrives while the sweeper is removing its finished record is answered
/// from that record (a replay) or from its tombstone (410), never with a new lease, and
/// several such triggers, same payload or not, never see a record of their own.
///
/// Found by two break-it passes: first the trigger's insert waited for the sweeping
/// transaction and then went through (its tombstone check ran on an older snapshot): a
/// second lease; then a fix that wrote and took back that record made concurrent
/// triggers answer 409 or 422 from it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trigger_racing_the_sweep_of_its_record_is_late_not_granted() {
    use idem_core::{ManualClock, Outcome};
    use sqlx::Connection;
    let url = idem_store::testing::fresh_pg_database("idem_sweep_race").await;
    let clock = Arc::new(ManualClock::new(1_000_000));
    let store: Arc<dyn Store> = Arc::new(PgStore::connect(&url, clock.clone(), Default::default()).await.unwrap());
    for round in 0..3 {
        let key = format!("swept-{round}");
        let granted = store.acquire(input(&key)).await.unwrap();
        let done = idem_store::CompleteRequest {
            tenant: "t".into(),
            key: key.clone(),
            fencing_token: granted.record.fencing_token,
            outcome: Outcome::Succeeded { provider_ref: "r".into(), result: None },
            actor: Actor::default(),
            policy: None,
        };
        let completed = store.complete(done).await.unwrap().record;
        // Past its retention: what the sweeper does, held open while the trigger arrives.
        clock.advance(completed.expires_at.unwrap() - clock.now_ms() + 1);
        let mut sweeper = sqlx::PgConnection::connect(&url).await.unwrap();
        let mut tx = sweeper.begin().await.unwrap();
        sqlx::query(
            "INSERT INTO tombstones (tenant, key_hash, fingerprint, final_state, completed_at, expires_at) \
             VALUES ('t', $1, 'f', 'SUCCEEDED', $2, $3)",
        )
        .bind(idem_core::retention::key_hash(&key))
        .bind(clock.now_ms())
        .bind(clock.now_ms() + 3_600_000)
        .execute(&mut *tx)
        .await
        .unwrap();
        sqlx::query("DELETE FROM operations WHERE tenant = 't' AND op_key = $1")
            .bind(&key)
            .execute(&mut *tx)
            .await
            .unwrap();
        sqlx::query("DELETE FROM operation_events WHERE tenant = 't' AND op_key = $1")
            .bind(&key)
            .execute(&mut *tx)
            .await
            .unwrap();
        let triggers: Vec<_> = (0..8)
            .map(|i| {
                let (store, key) = (store.clone(), key.clone());
                let mut trigger = input(&key);
                if i % 4 == 3 {
                    trigger.fingerprint = "another payload".into();
                }
                tokio::spawn(async move { (i, store.acquire(trigger).await) })
            })
            .collect();
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        tx.commit().await.unwrap();
        for t in triggers {
            let (i, answer) = t.await.unwrap();
            let decision = answer.unwrap().decision;
            let fine = if i % 4 == 3 {
                matches!(decision, Decision::Mismatch | Decision::Late)
            } else {
                matches!(decision, Decision::Replay | Decision::Late)
            };
            assert!(fine, "round {round}: trigger {i} racing the sweep was answered {decision:?}");
        }
        assert_eq!(store.acquire(input(&key)).await.unwrap().decision, Decision::Late, "after the sweep");
        let pg = PgStore::connect(&url, clock.clone(), Default::default()).await.unwrap();
        let (records,): (i64,) = sqlx::query_as("SELECT COUNT(*) FROM operations WHERE op_key = $1")
            .bind(&key)
            .fetch_one(pg.pool())
            .await
            .unwrap();
        assert_eq!(records, 0, "round {round}: a record was left next to the live tombstone");
        // A replay answered from the old record just before the sweep can log its event
        // just after it: a leftover without a record.
        sqlx::query(
            "INSERT INTO operation_events (tenant, op_key, at, kind, principal) VALUES ('t', $1, $2, 'replayed', 'w')",
        )
        .bind(&key)
        .bind(clock.now_ms())
        .execute(pg.pool())
        .await
        .unwrap();
        // Once the tombstone is gone the key starts a new record, whose timeline holds
        // nothing of the old one.
        clock.advance(3_600_001);
        assert_eq!(store.acquire(input(&key)).await.unwrap().decision, Decision::Acquire);
        let kinds: Vec<String> = store.events("t", &key).await.unwrap().into_iter().map(|e| e.kind).collect();
        assert_eq!(kinds, ["acquired"], "round {round}");
    }
}
