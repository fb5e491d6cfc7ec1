//! The transaction half against real databases (PostgreSQL and an SQLite file): the key
//! claim of seed 002's export job, outbox append rules (Rust and SQL refuse the same
//! events), inbox parity (idem-core's table through the Rust claim on both backends and
//! through the SQL function), concurrent claims, and the schema install.

mod common;

use common::AppDb;
use idem_core::inbox::{InboxDecision, parity_cases};
use idem_core::outbox::examples::{bad_events, event};
use idem_outbox::tx::{self, Claim};
use idem_outbox::{OutboxError, append, inbox};
use serde_json::json;

/// Seed 002: the key record and `job-42` are created together; a retry returns the same
/// job; another payload is a conflict; a rolled-back attempt leaves nothing.
#[tokio::test]
async fn the_export_job_is_claimed_created_and_replayed_in_one_transaction() {
    for db in AppDb::both().await {
        let payload = json!({"source_batch": "B-7"});
        // A first attempt that rolls back (the application failed): nothing stays.
        let c = in_tx!(&db, rollback, |conn| {
            let c = tx::claim(&mut *conn, "B-7:export:v1", "export", &payload).await.unwrap();
            sqlx::query("INSERT INTO jobs VALUES ('job-41', 'B-7')").execute(&mut *conn).await.unwrap();
            c
        });
        assert_eq!(c, Claim::New);
        assert_eq!(db.count("SELECT count(*) FROM idem.inbox WHERE consumer = 'idem.keys'").await, 0, "{}", db.name());
        // The real first attempt.
        let c = in_tx!(&db, commit, |conn| {
            let c = tx::claim(&mut *conn, "B-7:export:v1", "export", &payload).await.unwrap();
            sqlx::query("INSERT INTO jobs VALUES ('job-42', 'B-7')").execute(&mut *conn).await.unwrap();
            tx::finish(&mut *conn, "B-7:export:v1", &json!({"job": "job-42"})).await.unwrap();
            c
        });
        assert_eq!(c, Claim::New);
        // A retry (field order does not matter): the stored result, nothing written.
        let retry = json!({"source_batch": "B-7"});
        let c = in_tx!(&db, commit, |conn| tx::claim(&mut *conn, "B-7:export:v1", "export", &retry).await.unwrap());
        assert_eq!(c, Claim::Replay(Some(json!({"job": "job-42"}))), "{}", db.name());
        // Another payload, or another action: a conflict, counted.
        for (action, p) in [("export", json!({"source_batch": "B-8"})), ("import", payload.clone())] {
            let c = in_tx!(&db, commit, |conn| tx::claim(&mut *conn, "B-7:export:v1", action, &p).await.unwrap());
            assert!(matches!(c, Claim::Conflict { .. }), "{} {c:?}", db.name());
        }
        assert_eq!(db.count("SELECT count(*) FROM jobs").await, 1);
        assert_eq!(db.count("SELECT sum(conflicts) FROM idem.inbox WHERE consumer = 'idem.keys'").await, 2);
        // Finishing a key nobody claimed is an error naming it; bad keys are refused.
        let e = in_tx!(&db, rollback, |conn| tx::finish(&mut *conn, "B-9:export:v1", &json!(1)).await.unwrap_err());
        assert!(matches!(e, OutboxError::NotClaimed(ref m) if m.contains("B-9")), "{e}");
        let e = in_tx!(&db, rollback, |conn| tx::claim(&mut *conn, "", "export", &payload).await.unwrap_err());
        assert!(matches!(e, OutboxError::Key(_)), "{e}");
    }
}

/// Two transactions claim one key at once: the second waits for the first and replays its
/// result (or claims anew if the first rolled back) — never two "new" claims.
#[tokio::test]
async fn concurrent_claims_of_one_key_apply_once() {
    let db = AppDb::postgres().await;
    let AppDb::Postgres(pool, _) = &db else { unreachable!() };
    for first_commits in [true, false] {
        let key = format!("K-{first_commits}:export:v1");
        let mut t1 = pool.begin().await.unwrap();
        assert_eq!(tx::claim(&mut *t1, &key, "export", &json!(1)).await.unwrap(), Claim::New);
        tx::finish(&mut *t1, &key, &json!("first")).await.unwrap();
        let (pool2, key2) = (pool.clone(), key.clone());
        let second = tokio::spawn(async move {
            let mut t2 = pool2.begin().await.unwrap();
            let c = tx::claim(&mut *t2, &key2, "export", &json!(1)).await.unwrap();
            t2.commit().await.unwrap();
            c
        });
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        assert!(!second.is_finished(), "the second claim waits for the first transaction");
        if first_commits {
            t1.commit().await.unwrap()
        } else {
            t1.rollback().await.unwrap()
        }
        let expected = if first_commits { Claim::Replay(Some(json!("first"))) } else { Claim::New };
        assert_eq!(second.await.unwrap(), expected);
    }
}

/// The issue's bad input, and its neighbours: refused by `append` before anything is
/// written, and by `idem.outbox_append` (what other languages call) with the same message.
#[tokio::test]
async fn bad_events_are_refused_in_rust_and_in_sql_alike() {
    for db in AppDb::both().await {
        for (what, e, expected) in bad_events() {
            let err = in_tx!(&db, commit, |conn| append(&mut *conn, &e).await.unwrap_err());
            assert!(matches!(&err, OutboxError::Event(x) if *x == expected), "{what}: {err}");
            if let AppDb::Postgres(pool, _) = &db {
                let sql = sqlx::query("SELECT idem.outbox_append($1, $2, $3, $4, $5::json, $6::json)")
                    .bind(&e.id)
                    .bind(&e.aggregate_type)
                    .bind(&e.aggregate_id)
                    .bind(&e.topic)
                    .bind(e.payload_text())
                    .bind(serde_json::to_string(&e.headers).unwrap())
                    .execute(pool)
                    .await
                    .unwrap_err();
                let msg = sql.as_database_error().unwrap().message().to_owned();
                assert_eq!(msg, format!("idem.outbox_append: {expected}"), "{what}");
            }
        }
        assert_eq!(db.count("SELECT count(*) FROM idem.outbox").await, 0, "{}: nothing written", db.name());
        // The good event goes in; its id again is refused, and the first one is kept.
        let seq = in_tx!(&db, commit, |conn| append(&mut *conn, &event()).await.unwrap());
        assert!(seq > 0);
        let err = in_tx!(&db, rollback, |conn| append(&mut *conn, &event()).await.unwrap_err());
        assert!(matches!(err, OutboxError::DuplicateEventId(ref id) if id == "order-42:created"), "{err}");
        assert_eq!(db.count("SELECT count(*) FROM idem.outbox WHERE state = 'PENDING'").await, 1);
    }
}

/// idem-core's inbox table through the Rust claim (both backends) and through the SQL
/// function `idem.inbox_claim`: the same answers.
#[tokio::test]
async fn inbox_decisions_are_the_same_in_core_rust_and_sql() {
    for db in AppDb::both().await {
        for (i, (existing, fp, expected)) in parity_cases().into_iter().enumerate() {
            let id = format!("msg-{i}");
            if let Some(rec) = &existing {
                in_tx!(&db, commit, |conn| {
                    let d = inbox::claim_message(&mut *conn, "billing", &id, &rec.fingerprint).await.unwrap();
                    assert_eq!(d, InboxDecision::Apply);
                    if let Some(o) = &rec.outcome {
                        inbox::finish(&mut *conn, "billing", &id, o).await.unwrap();
                    }
                });
            }
            let got = in_tx!(&db, rollback, |conn| inbox::claim_message(&mut *conn, "billing", &id, fp).await.unwrap());
            assert_eq!(got, expected, "{} case {i}", db.name());
            if let AppDb::Postgres(pool, _) = &db {
                let (decision,): (String,) = sqlx::query_as("SELECT decision FROM idem.inbox_claim('billing', $1, $2)")
                    .bind(&id)
                    .bind(fp)
                    .fetch_one(pool)
                    .await
                    .unwrap();
                assert_eq!(decision, expected.as_str(), "SQL case {i}");
            }
        }
        // Another consumer has its own claims.
        let d =
            in_tx!(&db, commit, |conn| inbox::claim_message(&mut *conn, "shipping", "msg-1", "fp-a").await.unwrap());
        assert_eq!(d, InboxDecision::Apply);
        let e = in_tx!(&db, rollback, |conn| inbox::claim_message(&mut *conn, "", "m", "f").await.unwrap_err());
        assert_eq!(e.to_string(), "consumer is empty", "{e}");
        // The keys' consumer is idem's own: a consumer cannot claim or finish under it.
        let e = in_tx!(&db, rollback, |conn| inbox::claim_message(&mut *conn, "idem.keys", "B-7:export:v1", "f")
            .await
            .unwrap_err());
        assert!(e.to_string().contains("reserved"), "{e}");
        if let AppDb::Postgres(pool, _) = &db {
            let e = sqlx::query("SELECT idem.inbox_claim('idem.keys', 'B-7:export:v1', 'f')")
                .execute(pool)
                .await
                .unwrap_err();
            assert!(e.to_string().contains("consumer names starting with idem. are reserved"), "{e}");
        }
    }
}

#[tokio::test]
async fn the_schema_installs_once_and_refuses_a_newer_one() {
    for db in AppDb::both().await {
        let again = idem_outbox::schema::install(db.url()).await.unwrap();
        let v = idem_outbox::schema::VERSION;
        assert_eq!((again.from, again.to), (v, v), "{}: installing again is a no-op", db.name());
        match &db {
            AppDb::Postgres(p, _) => {
                sqlx::query("INSERT INTO idem.schema_version VALUES (99, 0)").execute(p).await.map(|_| ())
            }
            AppDb::Sqlite(p, _, _) => {
                sqlx::query("INSERT INTO idem_schema_version VALUES (99, 0)").execute(p).await.map(|_| ())
            }
        }
        .unwrap();
        let e = idem_outbox::schema::install(db.url()).await.unwrap_err();
        assert!(matches!(e, OutboxError::SchemaNewer { found: 99, known: 2 }), "{e}");
    }
    // A database without the schema: a clear error, not a raw SQL one.
    let url = idem_store::testing::fresh_pg_database("idem_outbox").await;
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    let mut t = pool.begin().await.unwrap();
    let e = append(&mut *t, &event()).await.unwrap_err();
    assert!(matches!(e, OutboxError::NotInstalled), "{e}");
    assert!(e.to_string().contains("idem schema install"));
}

/// Receiving webhooks: a verified message is claimed by its `webhook-id`; its redelivery
/// (new timestamp, new signature, same body) is a duplicate; a bad signature or a missing
/// header never reaches the inbox.
#[tokio::test]
async fn a_received_webhook_is_verified_then_claimed_once() {
    use idem_outbox::receive::Unverified;
    use idem_outbox::signature::{WebhookError, WebhookSecret, signature_header};
    let secret = WebhookSecret::parse("whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD").unwrap();
    let other = WebhookSecret::parse("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").unwrap();
    let body = br#"{"order": 42, "state": "paid"}"#.to_vec();
    let message = |ts: i64, signer: &WebhookSecret| {
        let sig = signature_header(std::slice::from_ref(signer), "evt-42", ts, &body);
        let headers: std::collections::HashMap<&str, String> =
            [("webhook-id", "evt-42".to_owned()), ("webhook-timestamp", ts.to_string()), ("webhook-signature", sig)]
                .into();
        Unverified::new(|h| headers.get(h).cloned(), body.clone()).unwrap()
    };
    for db in AppDb::both().await {
        for (ts, expected) in [(1_000, "apply"), (1_060, "duplicate")] {
            let verified = message(ts, &secret).verify(std::slice::from_ref(&secret), ts).unwrap();
            let d = in_tx!(&db, commit, |conn| verified.claim(&mut *conn, "orders-receiver").await.unwrap());
            assert_eq!(d.as_str(), expected, "{} at {ts}", db.name());
        }
        let forged = message(1_100, &other).verify(std::slice::from_ref(&secret), 1_100);
        assert_eq!(forged.unwrap_err(), WebhookError::NoMatchingSignature);
        let missing = Unverified::new(|h| (h != "webhook-signature").then(|| "x".to_owned()), body.clone());
        assert_eq!(missing.unwrap_err(), WebhookError::MissingHeader("webhook-signature"));
        assert_eq!(db.count("SELECT count(*) FROM idem.inbox WHERE consumer = 'orders-receiver'").await, 1);
    }
}
