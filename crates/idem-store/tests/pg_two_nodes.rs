//! Two PostgreSQL stores (two nodes) on one database. Each node keeps the records it wrote
//! last to skip a read; these tests change a record on the other node behind that cache
//! and check that the first node still answers from the database's truth.

use idem_core::{AcquireInput, Actor, Clock, Decision, ManualClock, Outcome, State};
use idem_store::{CompleteRequest, ResolveRequest, Store, StoreError, postgres::PgStore};
use serde_json::json;
use std::sync::Arc;

/// Two stores on one fresh database, their clock, and the database's guard (the database
/// is dropped with it: keep it until the test ends).
async fn two_nodes() -> (Arc<dyn Store>, Arc<dyn Store>, Arc<ManualClock>, idem_store::testing::TestDatabase) {
    let url = idem_store::testing::fresh_pg_database("idem_two_nodes").await;
    let clock = Arc::new(ManualClock::new(1_000_000));
    let a = PgStore::connect(&url, clock.clone(), Default::default()).await.unwrap();
    let b = PgStore::connect(&url, clock.clone(), Default::default()).await.unwrap();
    (Arc::new(a), Arc::new(b), clock, url)
}

fn input(key: &str, fingerprint: &str) -> AcquireInput {
    AcquireInput {
        tenant: "t".into(),
        key: key.into(),
        action: "send".into(),
        payload: json!({"to": "x"}),
        fingerprint: fingerprint.into(),
        lease_ms: 1_000,
        redo_safe: false,
        connector: None,
        holder: None,
        actor: Actor { principal: "w".into(), request_id: None },
    }
}

fn complete(key: &str, token: i64, outcome: Outcome) -> CompleteRequest {
    CompleteRequest {
        tenant: "t".into(),
        key: key.into(),
        fencing_token: token,
        outcome,
        actor: Actor::default(),
        policy: None,
    }
}

fn succeeded(r: &str) -> Outcome {
    Outcome::Succeeded { provider_ref: r.into(), result: None }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_never_answers_from_a_record_another_node_changed() {
    let (a, b, clock, _db) = two_nodes().await;

    // A grants (and remembers EXECUTING); the lease expires and B's sweeper makes it UNKNOWN.
    let granted = a.acquire(input("k1", "f")).await.unwrap();
    assert_eq!(granted.decision, Decision::Acquire);
    clock.advance(2_000);
    assert_eq!(b.expire_leases(10).await.unwrap(), 1);
    // A trigger on A sees UNKNOWN (202), not its remembered EXECUTING lease (409).
    assert_eq!(a.acquire(input("k1", "f")).await.unwrap().decision, Decision::Unknown);
    // The worker's late completion through A is judged against UNKNOWN and settles it.
    let done = a.complete(complete("k1", granted.record.fencing_token, succeeded("m-1"))).await.unwrap();
    assert_eq!(done.record.state, State::Succeeded);
    assert_eq!(b.get("t", "k1").await.unwrap().unwrap().state, State::Succeeded);

    // A grants k2; an operator resolves it through B after the lease expired; A's worker
    // then completes with its old token: refused as the record is final, not applied.
    let g2 = a.acquire(input("k2", "f")).await.unwrap();
    clock.advance(2_000);
    let resolve = ResolveRequest {
        tenant: "t".into(),
        key: "k2".into(),
        to: State::Failed,
        expected_state: None,
        reason: "customer cancelled".into(),
        evidence: None,
        actor: Actor { principal: "op".into(), request_id: None },
    };
    b.resolve(resolve).await.unwrap();
    let late = a.complete(complete("k2", g2.record.fencing_token, succeeded("m-2"))).await;
    assert!(matches!(late, Err(StoreError::Complete(_))), "{late:?}");
    let stored = b.get("t", "k2").await.unwrap().unwrap();
    assert_eq!((stored.state, stored.provider_ref), (State::Failed, None));
    // And A replays FAILED, not a stale lease.
    assert_eq!(a.acquire(input("k2", "f")).await.unwrap().record.state, State::Failed);

    // B re-grants a PENDING retry; A's old token is stale although A remembers it.
    let g3 = a.acquire(input("k3", "f")).await.unwrap();
    let retry = Outcome::RetryableFailure { error_class: "unavailable".into(), message: None, retry_after_ms: Some(0) };
    a.complete(complete("k3", g3.record.fencing_token, retry)).await.unwrap();
    clock.advance(600_000); // past any backoff
    let regrant = b.acquire(input("k3", "f")).await.unwrap();
    assert_eq!(regrant.decision, Decision::Acquire);
    let stale = a.complete(complete("k3", g3.record.fencing_token, succeeded("m-3"))).await;
    assert!(matches!(stale, Err(StoreError::Complete(_))), "{stale:?}");
    a.complete(complete("k3", regrant.record.fencing_token, succeeded("m-3"))).await.unwrap();

    // A grants k4 and its worker completes through B, within the lease: a trigger on A is
    // a replay of SUCCEEDED, not "in progress" from A's remembered lease.
    let g4 = a.acquire(input("k4", "f")).await.unwrap();
    b.complete(complete("k4", g4.record.fencing_token, succeeded("m-4"))).await.unwrap();
    let again = a.acquire(input("k4", "f")).await.unwrap();
    assert_eq!((again.decision, again.record.state), (Decision::Replay, State::Succeeded));

    // A final record A remembers is replayed, and a new payload for it is a mismatch; every
    // trigger is in the log, on both nodes' view.
    assert_eq!(a.acquire(input("k3", "f")).await.unwrap().decision, Decision::Replay);
    assert_eq!(a.acquire(input("k3", "other")).await.unwrap().decision, Decision::Mismatch);
    let kinds: Vec<String> = b.events("t", "k3").await.unwrap().into_iter().map(|e| e.kind).collect();
    assert_eq!(kinds.iter().filter(|k| *k == "replayed").count(), 1, "{kinds:?}");
    assert_eq!(kinds.iter().filter(|k| *k == "mismatch").count(), 1, "{kinds:?}");
    // A grants k5 and B completes it; the record is swept, its tombstone expires, and B
    // grants the reused key to a new operation. A's old worker then reports with the old
    // token: refused (stale), and the new operation is untouched — although A remembers an
    // EXECUTING record of that key at the same version the new one has.
    let g5 = a.acquire(input("k5", "f")).await.unwrap();
    b.complete(complete("k5", g5.record.fencing_token, succeeded("m-5"))).await.unwrap();
    clock.advance(40 * 24 * 3600 * 1000); // past the default retention (24 h) and tombstone (30 d)
    b.sweep(1000).await.unwrap();
    b.sweep(1000).await.unwrap();
    assert!(b.get("t", "k5").await.unwrap().is_none() && b.tombstone("t", "k5").await.unwrap().is_none());
    let reused = b.acquire(input("k5", "new")).await.unwrap();
    assert_eq!((reused.decision, reused.record.version), (Decision::Acquire, g5.record.version));
    let late = a.complete(complete("k5", g5.record.fencing_token, succeeded("old-late"))).await;
    assert!(matches!(late, Err(StoreError::Complete(_))), "{late:?}");
    let now = b.get("t", "k5").await.unwrap().unwrap();
    assert_eq!((now.state, now.fingerprint.as_str()), (State::Executing, "new"));
    b.complete(complete("k5", reused.record.fencing_token, succeeded("m-5b"))).await.unwrap();

    assert!(clock.now_ms() > 1_000_000);
}

/// Polls `node` for up to 5 s until `secret` no longer authenticates.
async fn stops_authenticating(node: &PgStore, secret: &str) -> bool {
    for _ in 0..100 {
        if node.authenticate(secret).await.unwrap().is_none() {
            return true;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    false
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_revoked_anywhere_stops_working_on_every_node() {
    use idem_store::keys::Role;
    let url = idem_store::testing::fresh_pg_database("idem_key_cache").await;
    let clock = Arc::new(ManualClock::new(1_000_000));
    let a = PgStore::connect(&url, clock.clone(), Default::default()).await.unwrap();
    let b = PgStore::connect(&url, clock.clone(), Default::default()).await.unwrap();
    for _ in 0..100 {
        if a.key_cache_live() {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert!(a.key_cache_live(), "node A never started listening for key changes");
    let new_key = |name: &'static str| {
        let a = a.clone();
        async move { a.create_api_key("t", name, Role::Client, None).await.unwrap() }
    };

    // The cache does serve keys: a change that bypasses the trigger goes unseen by A.
    let (k1, s1) = new_key("p1").await;
    assert!(a.authenticate(&s1).await.unwrap().is_some());
    sqlx::query("ALTER TABLE api_keys DISABLE TRIGGER api_keys_changed").execute(a.pool()).await.unwrap();
    sqlx::query("UPDATE api_keys SET revoked_at = 1 WHERE id = $1").bind(&k1.id).execute(a.pool()).await.unwrap();
    sqlx::query("ALTER TABLE api_keys ENABLE TRIGGER api_keys_changed").execute(a.pool()).await.unwrap();
    assert!(a.authenticate(&s1).await.unwrap().is_some(), "A read the database: the key cache is not in use");

    // Revoked through node B: A learns it from the notification.
    let (k2, s2) = new_key("p2").await;
    assert!(a.authenticate(&s2).await.unwrap().is_some());
    assert!(b.revoke_api_key(&k2.id).await.unwrap());
    assert!(stops_authenticating(&a, &s2).await, "a key revoked on B still works on A");
    assert!(a.authenticate(&s1).await.unwrap().is_none(), "the notification emptied the whole cache");

    // Revoked through A itself: at once.
    let (k3, s3) = new_key("p3").await;
    assert!(a.authenticate(&s3).await.unwrap().is_some());
    assert!(a.revoke_api_key(&k3.id).await.unwrap());
    assert!(a.authenticate(&s3).await.unwrap().is_none());

    // Deleted by hand: the trigger covers it too.
    let (k4, s4) = new_key("p4").await;
    assert!(a.authenticate(&s4).await.unwrap().is_some());
    sqlx::query("DELETE FROM api_keys WHERE id = $1").bind(&k4.id).execute(b.pool()).await.unwrap();
    assert!(stops_authenticating(&a, &s4).await, "a key deleted by hand still works on A");
}
