//! What the second of two concurrent claims of one message gets, by isolation level, as the
//! book's outbox page says (docs/src/guides/outbox-inbox.md; issue 28 §9): under READ
//! COMMITTED (PostgreSQL's default) it waits for the first transaction and then answers
//! `duplicate`; under REPEATABLE READ and SERIALIZABLE
//! it fails with SQLSTATE 40001 (serialization_failure); with a `lock_timeout` shorter
//! than the first transaction it fails with 55P03 (lock_not_available). In every failing
//! case the consumer rolls back and runs its transaction again, which then answers
//! `duplicate`: the message is applied once.

use idem_outbox::InboxDecision;
use idem_outbox::inbox::{claim_message, content_fingerprint};
use serde_json::json;
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_second_claim_waits_or_fails_retryably_by_isolation_level() {
    let url = idem_store::testing::fresh_pg_database("idem_inbox_iso").await;
    idem_outbox::schema::install(&url).await.unwrap();
    let pool = sqlx::postgres::PgPoolOptions::new().max_connections(4).connect(&url).await.unwrap();
    let fp = content_fingerprint(&json!({"account": 7, "amount": 10})).unwrap();
    for (i, (setup, expected)) in [
        ("", Ok(InboxDecision::Duplicate { outcome: None })),
        ("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ", Err("40001")),
        ("SET TRANSACTION ISOLATION LEVEL SERIALIZABLE", Err("40001")),
        ("SET LOCAL lock_timeout = '100ms'", Err("55P03")),
    ]
    .into_iter()
    .enumerate()
    {
        let id = format!("pay-{i}");
        let mut first = pool.begin().await.unwrap();
        assert_eq!(claim_message(&mut *first, "billing", &id, fp.as_str()).await.unwrap(), InboxDecision::Apply);
        let (pool2, id2, fp2) = (pool.clone(), id.clone(), fp.clone());
        let second = tokio::spawn(async move {
            let mut t = pool2.begin().await.unwrap();
            if !setup.is_empty() {
                sqlx::query(setup).execute(&mut *t).await.unwrap();
            }
            // A snapshot taken before the first commits (as a consumer's earlier read would).
            sqlx::query("SELECT 1").execute(&mut *t).await.unwrap();
            let got = claim_message(&mut *t, "billing", &id2, fp2.as_str()).await;
            let got = got.map_err(|e| match e {
                idem_outbox::OutboxError::Database(sqlx::Error::Database(db)) => {
                    db.code().unwrap_or_default().into_owned()
                }
                other => panic!("{other}"),
            });
            drop(t);
            got
        });
        tokio::time::sleep(Duration::from_millis(300)).await;
        first.commit().await.unwrap();
        let got = second.await.unwrap();
        match expected {
            Ok(d) => assert_eq!(got, Ok(d), "{setup:?}"),
            Err(code) => assert_eq!(got, Err(code.to_owned()), "{setup:?}"),
        }
        // The consumer's retry of its whole transaction: a duplicate.
        let mut again = pool.begin().await.unwrap();
        assert_eq!(
            claim_message(&mut *again, "billing", &id, fp.as_str()).await.unwrap(),
            InboxDecision::Duplicate { outcome: None },
            "{setup:?}"
        );
        again.rollback().await.unwrap();
    }
}
