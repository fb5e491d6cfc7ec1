//! The SQLite writer's fast path (a batch of acquires and completions in one transaction
//! through SQLite's C API, `sqlite_batch::run_batch`) gives a batch back to the general
//! path when SQLite refuses one of its writes: the transaction is rolled back whole, the
//! requests run again one by one, and only the refused one fails — no other request is
//! failed, written twice or lost. A user's trigger that refuses one key stands in for any
//! database error in the middle of a batch.

mod common;

use common::success;
use idem_core::{AcquireInput, Decision, State, SystemClock};
use idem_store::{Store, StoreError, sqlite::SqliteStore};
use sqlx::Connection;
use std::sync::Arc;

fn input(key: &str) -> AcquireInput {
    common::input(key, 60_000)
}

const KEYS: usize = 40;

/// The successes of every `(key, token)` sent at once, so that batches hold several.
async fn complete_all(
    store: &Arc<SqliteStore>,
    tokens: &[(String, i64)],
) -> Vec<(String, Result<idem_store::CompleteOutcome, StoreError>)> {
    let tasks: Vec<_> = tokens
        .iter()
        .cloned()
        .map(|(key, token)| {
            let store = store.clone();
            tokio::spawn(async move { (key.clone(), store.complete(success(&key, token)).await) })
        })
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap());
    }
    out
}

/// A store on a new file, with `triggers` created on it by another connection (kept open,
/// returned for more).
async fn open_with_triggers(triggers: &'static str) -> (tempfile::TempDir, Arc<SqliteStore>, sqlx::SqliteConnection) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("fast.db");
    let store = Arc::new(SqliteStore::open(&path, Arc::new(SystemClock), Default::default()).await.unwrap());
    let mut raw = sqlx::SqliteConnection::connect(&format!("sqlite://{}", path.display())).await.unwrap();
    sqlx::raw_sql(triggers).execute(&mut raw).await.unwrap();
    (dir, store, raw)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_sqlite_refuses_fails_that_request_alone() {
    let (_dir, store, mut raw) = open_with_triggers(
        "CREATE TRIGGER refuse_insert BEFORE INSERT ON operations WHEN NEW.op_key = 'poison' \
         BEGIN SELECT RAISE(ABORT, 'poisoned key refused'); END; \
         CREATE TRIGGER refuse_success BEFORE UPDATE ON operations \
         WHEN NEW.op_key = 'k-7' AND NEW.state = 'SUCCEEDED' \
         BEGIN SELECT RAISE(ABORT, 'k-7 may not succeed'); END;",
    )
    .await;

    // Acquires of many keys and the refused one at once, so that batches hold both.
    let mut tasks = Vec::new();
    for i in 0..=KEYS {
        let store = store.clone();
        let key = if i == KEYS { "poison".to_owned() } else { format!("k-{i}") };
        tasks.push(tokio::spawn(async move { (key.clone(), store.acquire(input(&key)).await) }));
    }
    let mut tokens = Vec::new();
    for t in tasks {
        let (key, out) = t.await.unwrap();
        if key == "poison" {
            let e = out.expect_err("the trigger refuses this key");
            assert_eq!(e.refusal(), Some("poisoned key refused"), "a refusal, not an outage: {e}");
        } else {
            let out = out.unwrap_or_else(|e| panic!("{key} failed with the refused key's batch: {e}"));
            assert_eq!(out.decision, Decision::Acquire, "{key}");
            tokens.push((key, out.record.fencing_token));
        }
    }
    assert!(store.get("t", "poison").await.unwrap().is_none(), "nothing of the refused request is kept");

    // Their completions at once; the trigger refuses k-7's.
    for (key, out) in complete_all(&store, &tokens).await {
        if key == "k-7" {
            let e = out.expect_err("the trigger refuses k-7's success");
            assert_eq!(e.refusal(), Some("k-7 may not succeed"), "{e}");
        } else {
            assert_eq!(out.unwrap().record.state, State::Succeeded, "{key}");
        }
    }

    // Every record and event once: the rolled-back attempt left nothing behind.
    for (key, token) in &tokens {
        let rec = store.get("t", key).await.unwrap().unwrap();
        assert_eq!(rec.fencing_token, *token, "{key}");
        let events = store.events("t", key).await.unwrap();
        let kinds: Vec<&str> = events.iter().map(|e| e.kind.as_str()).collect();
        if key == "k-7" {
            assert_eq!(rec.state, State::Executing, "{key}");
            assert_eq!(kinds, ["acquired"], "{key}");
        } else {
            assert_eq!(rec.state, State::Succeeded, "{key}");
            assert_eq!(rec.provider_ref.as_deref(), Some(format!("ref-{key}").as_str()));
            assert_eq!(kinds, ["acquired", "completed"], "{key}");
        }
    }
    // The writer goes on: k-7 completes once the trigger is gone, and the replays answer.
    sqlx::query("DROP TRIGGER refuse_success").execute(&mut raw).await.unwrap();
    let k7 = tokens.iter().find(|(k, _)| k == "k-7").unwrap().1;
    assert_eq!(store.complete(success("k-7", k7)).await.unwrap().record.state, State::Succeeded);
    for (key, _) in &tokens {
        assert_eq!(store.acquire(input(key)).await.unwrap().decision, Decision::Replay, "{key}");
    }
}

/// A trigger that skips a write without an error (`RAISE(IGNORE)`) must never turn into an
/// acknowledged write: the request fails with `NotStored`, nothing of it is kept, and the
/// other requests of its batches are answered and stored (a break-it pass got two 201s for
/// one key this way before row counts were checked).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_a_trigger_skips_is_never_acknowledged() {
    let (_dir, store, _raw) = open_with_triggers(
        "CREATE TRIGGER skip_insert BEFORE INSERT ON operations WHEN NEW.op_key = 'dbl' \
         BEGIN SELECT RAISE(IGNORE); END; \
         CREATE TRIGGER skip_success BEFORE UPDATE ON operations \
         WHEN NEW.op_key = 'k-3' AND NEW.state = 'SUCCEEDED' BEGIN SELECT RAISE(IGNORE); END; \
         CREATE TRIGGER skip_event BEFORE INSERT ON operation_events \
         WHEN NEW.op_key = 'k-5' AND NEW.kind = 'completed' BEGIN SELECT RAISE(IGNORE); END;",
    )
    .await;
    let not_stored = |e: &StoreError| matches!(e, StoreError::NotStored(_));
    let mut tasks = Vec::new();
    for i in 0..=20 {
        // `dbl` twice, from two holders: neither may be granted.
        for holder in ["w1", "w2"] {
            let store = store.clone();
            let key = if i == 20 { "dbl".to_owned() } else { format!("k-{i}") };
            if key != "dbl" && holder == "w2" {
                continue;
            }
            tasks.push(tokio::spawn(async move {
                let mut inp = input(&key);
                inp.holder = Some(holder.into());
                (key, store.acquire(inp).await)
            }));
        }
    }
    let mut tokens = Vec::new();
    for t in tasks {
        let (key, out) = t.await.unwrap();
        match out {
            Err(e) if key == "dbl" => assert!(not_stored(&e), "{e}"),
            Ok(out) if key != "dbl" => {
                assert_eq!(out.decision, Decision::Acquire, "{key}");
                tokens.push((key, out.record.fencing_token));
            }
            other => panic!("{key}: {other:?}"),
        }
    }
    assert!(store.get("t", "dbl").await.unwrap().is_none());
    assert!(store.events("t", "dbl").await.unwrap().is_empty());
    for (key, out) in complete_all(&store, &tokens).await {
        match out {
            Err(e) if key == "k-3" || key == "k-5" => assert!(not_stored(&e), "{key}: {e}"),
            Ok(out) if key != "k-3" && key != "k-5" => assert_eq!(out.record.state, State::Succeeded, "{key}"),
            other => panic!("{key}: {other:?}"),
        }
    }
    for (key, _) in &tokens {
        let rec = store.get("t", key).await.unwrap().unwrap();
        let kinds: Vec<String> = store.events("t", key).await.unwrap().into_iter().map(|e| e.kind).collect();
        if key == "k-3" || key == "k-5" {
            assert_eq!(rec.state, State::Executing, "{key}: nothing of the completion is kept");
            assert_eq!(kinds, ["acquired"], "{key}");
        } else {
            assert_eq!(rec.state, State::Succeeded, "{key}");
            assert_eq!(kinds, ["acquired", "completed"], "{key}");
        }
    }
}

/// A trigger's `RAISE(ROLLBACK)` ends the writer's whole transaction, not one statement.
/// The request that did it fails with its own error; every other answer agrees with what
/// is stored: a request answered with an error left nothing (it may be sent again and is
/// granted), one answered with a grant is stored (a break-it pass saw requests stored but
/// answered 503 — run outside any transaction once the batch's was gone — then stuck).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trigger_that_rolls_back_the_transaction_leaves_answers_true() {
    let (_dir, store, _raw) = open_with_triggers(
        "CREATE TRIGGER rb BEFORE INSERT ON operations WHEN NEW.op_key LIKE 'abr-%' \
         BEGIN SELECT RAISE(ROLLBACK, 'rollback trigger'); END;",
    )
    .await;
    for round in 0..5 {
        let mut tasks = Vec::new();
        for i in 0..16 {
            let store = store.clone();
            let key = if i == 7 { format!("abr-{round}") } else { format!("r{round}-k{i}") };
            tasks.push(tokio::spawn(async move { (key.clone(), store.acquire(input(&key)).await) }));
        }
        for t in tasks {
            let (key, out) = t.await.unwrap();
            let stored = store.get("t", &key).await.unwrap();
            match out {
                Err(e) if key.starts_with("abr-") => {
                    assert_eq!(e.refusal(), Some("rollback trigger"), "{key}: {e}");
                    assert!(stored.is_none());
                }
                Ok(out) if !key.starts_with("abr-") => {
                    assert_eq!(out.decision, Decision::Acquire, "{key}");
                    assert_eq!(stored.map(|r| r.fencing_token), Some(out.record.fencing_token), "{key}");
                }
                Err(e) => {
                    assert!(stored.is_none(), "{key} answered {e} but stored");
                    let again = store.acquire(input(&key)).await.unwrap();
                    assert_eq!(again.decision, Decision::Acquire, "{key}: sent again after {e}");
                }
                Ok(out) => panic!("{key}: {out:?}"),
            }
        }
    }
}
