//! `OutboxStore` conformance, on PostgreSQL and SQLite: claims are exclusive, each
//! aggregate is delivered head first, a failing or dead event holds back only its own
//! aggregate, a stale fencing token writes nothing, operators' redrive and skip are
//! audited and refused without a reason — and (PostgreSQL) two transactions that commit
//! out of seq order are both claimed, none skipped, while appenders of one aggregate take
//! turns until commit.

mod common;

use common::AppDb;
use idem_core::outbox::{DeliveryPlan, NewEvent, OperatorAction, OperatorRefusal, OutboxState};
use idem_outbox::append;
use idem_outbox::store::{Claimed, OutboxStore};
use serde_json::json;
use std::collections::BTreeSet;

fn ev(id: &str, aggregate: &str) -> NewEvent {
    NewEvent {
        id: id.into(),
        aggregate_type: "order".into(),
        aggregate_id: aggregate.into(),
        topic: "orders.changed".into(),
        payload: json!({"id": id}),
        headers: Default::default(),
    }
}

async fn append_all(db: &AppDb, events: &[(&str, &str)]) {
    in_tx!(db, commit, |conn| {
        for (id, agg) in events {
            append(&mut *conn, &ev(id, agg)).await.unwrap();
        }
    });
}

fn store(db: &AppDb) -> OutboxStore {
    match db {
        AppDb::Postgres(p, _) => OutboxStore::Postgres(p.clone()),
        AppDb::Sqlite(p, _, _) => OutboxStore::Sqlite(p.clone()),
    }
}

fn ids(c: &[Claimed]) -> BTreeSet<String> {
    c.iter().map(|c| c.row.id.clone()).collect()
}

fn delivered() -> DeliveryPlan {
    DeliveryPlan::Delivered { evidence: "HTTP 204".into() }
}

#[tokio::test]
async fn heads_only_exclusive_claims_and_fenced_records() {
    for db in AppDb::both().await {
        let s = store(&db);
        append_all(&db, &[("a1", "A"), ("a2", "A"), ("b1", "B"), ("b2", "B"), ("c1", "C")]).await;
        // Two relays at once: disjoint claims, heads only.
        let (r1, r2) = tokio::join!(s.claim_batch("r1", 30_000, 2), s.claim_batch("r2", 30_000, 10));
        let (r1, r2) = (r1.unwrap(), r2.unwrap());
        assert!(ids(&r1).is_disjoint(&ids(&r2)), "{}: {:?} {:?}", db.name(), ids(&r1), ids(&r2));
        let all: BTreeSet<_> = ids(&r1).union(&ids(&r2)).cloned().collect();
        assert_eq!(all, ["a1", "b1", "c1"].map(String::from).into(), "{}: one head per aggregate", db.name());
        // Leased heads block their aggregates: nothing more to claim.
        assert!(s.claim_batch("r3", 30_000, 10).await.unwrap().is_empty());
        // Deliver a1; its aggregate's next event is claimable, the others stay blocked.
        let a1 = r1.iter().chain(&r2).find(|c| c.row.id == "a1").unwrap().clone();
        assert!(s.record(&a1, &delivered(), "hooks", "r1").await.unwrap());
        assert_eq!(ids(&s.claim_batch("r3", 30_000, 10).await.unwrap()), ["a2"].map(String::from).into());
        // A stale token (the event was claimed again after the lease) writes nothing.
        let b1 = r1.iter().chain(&r2).find(|c| c.row.id == "b1").unwrap().clone();
        let mut stale = b1.clone();
        stale.row.fencing_token -= 1;
        assert!(!s.record(&stale, &delivered(), "hooks", "old").await.unwrap(), "{}", db.name());
        let (row, trail) = s.get("b1").await.unwrap().unwrap();
        assert_eq!((row.state.as_str(), trail.len()), ("PENDING", 0), "{}: nothing written", db.name());
        // Recording twice with the same token: the second finds the event no longer PENDING.
        assert!(!s.record(&a1, &delivered(), "hooks", "r1").await.unwrap());
    }
}

#[tokio::test]
async fn an_expired_lease_is_claimed_again_with_a_new_token() {
    for db in AppDb::both().await {
        let s = store(&db);
        append_all(&db, &[("x1", "X")]).await;
        let first = s.claim_batch("r1", 1, 10).await.unwrap();
        assert_eq!(first.len(), 1);
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        let second = s.claim_batch("r2", 30_000, 10).await.unwrap();
        assert_eq!(second.len(), 1, "{}: the lease ran out", db.name());
        assert_eq!(second[0].row.fencing_token, first[0].row.fencing_token + 1);
        assert_eq!(second[0].row.attempts, 2);
        // The first relay wakes up late: its outcome is refused, the second's is kept.
        assert!(!s.record(&first[0], &delivered(), "hooks", "r1").await.unwrap());
        assert!(s.record(&second[0], &delivered(), "hooks", "r2").await.unwrap());
        let (row, trail) = s.get("x1").await.unwrap().unwrap();
        assert_eq!((row.state.as_str(), row.evidence.as_deref(), trail.len()), ("DELIVERED", Some("HTTP 204"), 1));
        assert_eq!(trail[0].relay.as_deref(), Some("r2"));
    }
}

#[tokio::test]
async fn a_failing_or_dead_event_holds_back_only_its_aggregate_until_an_operator_acts() {
    for db in AppDb::both().await {
        let s = store(&db);
        append_all(&db, &[("f1", "F"), ("f2", "F"), ("g1", "G"), ("g2", "G")]).await;
        let claims = s.claim_batch("r1", 30_000, 10).await.unwrap();
        let (f1, g1) =
            (claims.iter().find(|c| c.row.id == "f1").unwrap(), claims.iter().find(|c| c.row.id == "g1").unwrap());
        let later = f1.claimed_at + 60_000;
        let retry = DeliveryPlan::RetryAt { at_ms: later, error_class: "unavailable".into(), message: "503".into() };
        assert!(s.record(f1, &retry, "hooks", "r1").await.unwrap());
        assert!(s.record(g1, &delivered(), "hooks", "r1").await.unwrap());
        // F waits for its retry; G goes on.
        assert_eq!(
            ids(&s.claim_batch("r1", 30_000, 10).await.unwrap()),
            ["g2"].map(String::from).into(),
            "{}",
            db.name()
        );
        // F's head becomes dead: F stays blocked.
        let dead_test = |state: &str| format!("SELECT count(*) FROM idem.outbox WHERE state = '{state}'");
        sqlx_exec(&db, "UPDATE idem.outbox SET next_attempt_at = NULL WHERE id = 'f1'").await;
        let f1 = s.claim_batch("r1", 30_000, 10).await.unwrap().into_iter().find(|c| c.row.id == "f1").unwrap();
        let dead = DeliveryPlan::Dead { error_class: "validation".into(), message: "HTTP 400".into() };
        assert!(s.record(&f1, &dead, "hooks", "r1").await.unwrap());
        assert_eq!(db.count(&dead_test("DEAD")).await, 1);
        assert!(s.claim_batch("r1", 30_000, 10).await.unwrap().is_empty(), "{}: f2 waits behind dead f1", db.name());
        // Operators: a reason is mandatory; only dead letters; redrive → one manual attempt.
        assert_eq!(
            s.operator_action("f1", OperatorAction::Redrive, " ", "ops").await.unwrap(),
            Err(OperatorRefusal::MissingReason)
        );
        assert_eq!(
            s.operator_action("f2", OperatorAction::Skip, "why", "ops").await.unwrap(),
            Err(OperatorRefusal::NotDead("PENDING"))
        );
        assert!(s.operator_action("nope", OperatorAction::Skip, "why", "ops").await.is_err());
        assert_eq!(
            s.operator_action("f1", OperatorAction::Redrive, "receiver fixed", "ops").await.unwrap(),
            Ok(OutboxState::Pending)
        );
        let again = s.claim_batch("r1", 30_000, 10).await.unwrap();
        assert_eq!(ids(&again), ["f1"].map(String::from).into());
        assert!(again[0].row.manual, "{}: the redrive's attempt is manual", db.name());
        assert!(s.record(&again[0], &dead, "hooks", "r1").await.unwrap());
        // Skip: f2 goes on.
        assert_eq!(
            s.operator_action("f1", OperatorAction::Skip, "obsolete order", "ops").await.unwrap(),
            Ok(OutboxState::Skipped)
        );
        assert_eq!(ids(&s.claim_batch("r1", 30_000, 10).await.unwrap()), ["f2"].map(String::from).into());
        let (_, trail) = s.get("f1").await.unwrap().unwrap();
        let kinds: Vec<_> =
            trail.iter().map(|t| (t.kind.as_str(), t.trigger.as_deref(), t.reason.as_deref())).collect();
        assert_eq!(
            kinds,
            [
                ("attempt", Some("scheduled"), None),
                ("attempt", Some("scheduled"), None),
                ("redrive", None, Some("receiver fixed")),
                ("attempt", Some("manual"), None),
                ("skip", None, Some("obsolete order")),
            ],
            "{}",
            db.name()
        );
        let stats = s.stats().await.unwrap();
        assert_eq!(stats.by_state.get("SKIPPED"), Some(&1));
        assert!(stats.lag_ms >= 0);
    }
}

async fn sqlx_exec(db: &AppDb, sql: &str) {
    match db {
        AppDb::Postgres(p, _) => sqlx::query(sqlx::AssertSqlSafe(sql.to_owned())).execute(p).await.map(|_| ()),
        AppDb::Sqlite(p, _, _) => {
            sqlx::query(sqlx::AssertSqlSafe(common::sqlite_sql(sql))).execute(p).await.map(|_| ())
        }
    }
    .unwrap();
}

/// Watermill-sql's late-commit case: T1 appends (seq n) and stays open; T2 appends (seq
/// n+1) and commits. The relay takes T2's event, and T1's once it commits — never skipped.
/// Within one aggregate, the second appender waits for the first one's commit, so seq
/// order is commit order.
#[tokio::test]
async fn transactions_committing_out_of_order_are_both_delivered() {
    let db = AppDb::postgres().await;
    let AppDb::Postgres(pool, _) = &db else { unreachable!() };
    let s = store(&db);
    let mut t1 = pool.begin().await.unwrap();
    let seq1 = append(&mut *t1, &ev("late", "L")).await.unwrap();
    let mut t2 = pool.begin().await.unwrap();
    let seq2 = append(&mut *t2, &ev("early", "E")).await.unwrap();
    assert!(seq1 < seq2);
    t2.commit().await.unwrap();
    let first = s.claim_batch("r1", 30_000, 10).await.unwrap();
    assert_eq!(ids(&first), ["early"].map(String::from).into());
    s.record(&first[0], &delivered(), "hooks", "r1").await.unwrap();
    t1.commit().await.unwrap();
    let second = s.claim_batch("r1", 30_000, 10).await.unwrap();
    assert_eq!(ids(&second), ["late"].map(String::from).into(), "the late commit is not skipped");

    // One aggregate: the second appender waits until the first commits.
    let mut t3 = pool.begin().await.unwrap();
    append(&mut *t3, &ev("m1", "M")).await.unwrap();
    let pool4 = pool.clone();
    let t4 = tokio::spawn(async move {
        let mut t4 = pool4.begin().await.unwrap();
        let seq = append(&mut *t4, &ev("m2", "M")).await.unwrap();
        t4.commit().await.unwrap();
        seq
    });
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    assert!(!t4.is_finished(), "appenders of one aggregate take turns until commit");
    assert!(s.claim_batch("r1", 30_000, 10).await.unwrap().iter().all(|c| c.row.id != "m1"), "m1 is not committed");
    t3.commit().await.unwrap();
    t4.await.unwrap();
    let heads = s.claim_batch("r1", 30_000, 10).await.unwrap();
    assert_eq!(ids(&heads), ["m1"].map(String::from).into(), "m1 first: committed first");
}

/// Appenders NOTIFY only while a relay says it waits (NOTIFY serializes commits); the
/// notification comes at commit, never for a rollback.
#[tokio::test]
async fn appenders_wake_relays_only_while_one_waits() {
    let db = AppDb::postgres().await;
    let AppDb::Postgres(pool, _) = &db else { unreachable!() };
    let s = store(&db);
    let mut listener = sqlx::postgres::PgListener::connect_with(pool).await.unwrap();
    listener.listen("idem_outbox").await.unwrap();
    append_all(&db, &[("busy", "N")]).await;
    assert!(!woke(&mut listener).await, "no relay waits: no NOTIFY");
    s.set_idle("r1", Some(60_000)).await.unwrap();
    let mut t = pool.begin().await.unwrap();
    append(&mut *t, &ev("rolled-back", "N")).await.unwrap();
    t.rollback().await.unwrap();
    assert!(!woke(&mut listener).await, "a rolled-back append wakes nobody");
    append_all(&db, &[("idle", "N")]).await;
    assert!(woke(&mut listener).await, "a relay waits: NOTIFY at commit");
    s.set_idle("r1", None).await.unwrap();
    append_all(&db, &[("busy-again", "N")]).await;
    assert!(!woke(&mut listener).await);
}

async fn woke(l: &mut sqlx::postgres::PgListener) -> bool {
    tokio::time::timeout(std::time::Duration::from_millis(300), l.recv()).await.is_ok()
}

#[tokio::test]
async fn delivered_and_skipped_events_leave_after_their_retention() {
    for db in AppDb::both().await {
        let s = store(&db);
        append_all(&db, &[("old", "R"), ("open", "S")]).await;
        let c = s.claim_batch("r1", 30_000, 10).await.unwrap();
        let old = c.iter().find(|c| c.row.id == "old").unwrap();
        s.record(old, &delivered(), "hooks", "r1").await.unwrap();
        assert_eq!(s.sweep(60_000, 100).await.unwrap(), 0, "{}: younger than the retention", db.name());
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        assert_eq!(s.sweep(10, 100).await.unwrap(), 1, "{}", db.name());
        assert!(s.get("old").await.unwrap().is_none());
        assert!(s.get("open").await.unwrap().is_some(), "a pending event is never swept");
    }
}
