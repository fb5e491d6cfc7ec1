//! PostgreSQL group commit: concurrent requests share one statement, yet each gets its own
//! answer. A request the database refuses fails alone.

use idem_core::{AcquireInput, Actor, Clock, Decision, SystemClock};
use idem_store::{Store, StoreError, postgres::PgStore};
use serde_json::json;
use std::sync::Arc;

mod common;

/// A request to run while a lock is held ([`under_lock`]).
type Job<T> = std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send>>;

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

/// Index tuples read through `operations_by_created` and rows read by sequential scans of
/// `operations`, once every backend has reported them (PostgreSQL 15 flushes a backend's
/// counters when it is idle, within seconds): read until two reads a second apart agree.
async fn settled_reads(pool: &sqlx::PgPool) -> (i64, i64) {
    let read = async || -> (i64, i64) {
        sqlx::query_as(
            "SELECT (SELECT idx_tup_read FROM pg_stat_user_indexes WHERE indexrelname = 'operations_by_created'), \
             (SELECT seq_tup_read FROM pg_stat_user_tables WHERE relname = 'operations')",
        )
        .fetch_one(pool)
        .await
        .unwrap()
    };
    let mut last = read().await;
    for _ in 0..20 {
        tokio::time::sleep(std::time::Duration::from_millis(1_200)).await;
        let now = read().await;
        if now == last {
            return now;
        }
        last = now;
    }
    last
}

/// 16 workers, each running `per_worker` acquire + complete pairs of new keys one after
/// the other (the writers batch what arrives together, in batches of every size from 1
/// up, as under an HTTP load). The keys are scattered, as users' keys are (UUIDs,
/// hashes): inserted out of order they split the primary key's pages, which can make its
/// probe cost a little more than a tenant-bounded scan of `operations_by_created` in a
/// plan made without statistics.
async fn pairs(store: &Arc<dyn Store>, round: &str, per_worker: usize) {
    let tasks: Vec<_> = (0..16u64)
        .map(|w| {
            let (store, round) = (store.clone(), round.to_owned());
            tokio::spawn(async move {
                for i in 0..per_worker as u64 {
                    let scatter = (w * 1_000_003 + i + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
                    let key = format!("{scatter:016x}-{round}");
                    let granted = store.acquire(input(&key)).await.unwrap();
                    assert_eq!(granted.decision, Decision::Acquire);
                    let done = idem_store::CompleteRequest {
                        tenant: "t".into(),
                        key,
                        fencing_token: granted.record.fencing_token,
                        outcome: idem_core::Outcome::Succeeded { provider_ref: "r".into(), result: None },
                        actor: Actor::default(),
                        policy: None,
                    };
                    store.complete(done).await.unwrap();
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
}

/// The hot path's statements are planned once per connection and kept. On a fresh
/// database (no statistics yet, a table of a few pages) they were planned as a hash join
/// over a sequential scan of `operations`, or (auto_explain under an HTTP load with
/// scattered keys) as a probe of `operations_by_created` bounded by the tenant alone, and
/// kept those plans while the ledger grew: every batch read every record. Now the writers'
/// connections plan nested loops over index probes (`writer_options`) and the store
/// analyzes the table once it has grown (`postgres::fresh_stats`), after which a plan
/// made without statistics is made again with them.
///
/// Checked here: the store analyzes `operations` within seconds of it growing (autovacuum
/// would take up to a minute); then 1 280 more pairs read no more than two
/// `operations_by_created` entries per pair and nothing by sequential scan, from
/// PostgreSQL's own counters (without `writer_options`: rows read by sequential
/// scans in this test, 26 412).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hot_path_statements_probe_the_key_index_on_a_fresh_database() {
    let url = idem_store::testing::fresh_pg_database("idem_fresh_plans").await;
    let store: Arc<dyn Store> =
        Arc::new(PgStore::connect(&url, Arc::new(SystemClock), Default::default()).await.unwrap());
    let watch = PgStore::connect(&url, Arc::new(SystemClock), Default::default()).await.unwrap();
    // Grow the table past the size at which the store analyzes it, in batches.
    pairs(&store, "grow", 40).await;
    // The store checks every second; autovacuum takes up to a minute (its naptime).
    let mut analyzed = false;
    for _ in 0..50 {
        let (n,): (f32,) = sqlx::query_as("SELECT reltuples FROM pg_class WHERE relname = 'operations'")
            .fetch_one(watch.pool())
            .await
            .unwrap();
        if n >= 0.0 {
            analyzed = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    assert!(analyzed, "the store analyzes operations once it has grown on a fresh database");
    let before = settled_reads(watch.pool()).await;
    const MORE: usize = 1_280;
    pairs(&store, "more", MORE / 16).await;
    let after = settled_reads(watch.pool()).await;
    let (by_created, seq) = (after.0 - before.0, after.1 - before.1);
    eprintln!(
        "{MORE} pairs after ANALYZE read {by_created} entries of operations_by_created, {seq} rows by sequential scan"
    );
    assert!(
        by_created <= 2 * MORE as i64,
        "{by_created} entries of operations_by_created read for {MORE} pairs: a lookup by key scanned the tenant"
    );
    assert!(seq <= MORE as i64, "{seq} rows of operations read by sequential scans for {MORE} pairs");
}

/// Every pooled connection joins by key lookups (nested loops over index probes), never by
/// hash or merge joins, whose choice depends on statistics that may be stale: a kept plan
/// of the workflow checkpoints query merge-joined one instance's steps with every
/// operation of the tenant (a break-it pass: workflow steps 117/s, then 29/s after ~90 000
/// operations). Here the statistics are those of a ledger whose only instance had all the
/// steps (ANALYZE then): without the connection options PostgreSQL hashes both tables
/// whole for one instance's checkpoints.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pool_joins_probe_by_key() {
    let url = idem_store::testing::fresh_pg_database("idem_pool_joins").await;
    let pg = PgStore::connect(&url, Arc::new(SystemClock), Default::default()).await.unwrap();
    let mut conn = pg.pool().acquire().await.unwrap();
    for setting in ["enable_hashjoin", "enable_mergejoin"] {
        let (v,): (String,) =
            sqlx::query_as(sqlx::AssertSqlSafe(format!("SHOW {setting}"))).fetch_one(&mut *conn).await.unwrap();
        assert_eq!(v, "off", "{setting} on a pooled connection");
    }
    sqlx::raw_sql(
        "INSERT INTO workflow_steps SELECT 't', 'i1', p, 's' || p, 'wf:i1:s' || p, 'wf:i1:s' || p || ':compensate', \
         'lookup_before_redo' FROM generate_series(1, 400) p; \
         INSERT INTO operations (tenant, op_key, action, fingerprint, payload, state, attempt_count, fencing_token, \
         created_at, updated_at, version, provider_ref) SELECT 't', k, 'a', 'f', '{}', 'SUCCEEDED', 1, 1, 1, 1, 1, 'r' \
         FROM workflow_steps, LATERAL (VALUES (op_key), (comp_key)) AS keys (k); \
         ANALYZE operations; ANALYZE workflow_steps;",
    )
    .execute(&mut *conn)
    .await
    .unwrap();
    let plan = idem_store::testing::checkpoints_plan_postgres(&mut conn, "t", "i1").await.unwrap();
    assert!(!plan.contains("Hash Join") && !plan.contains("Merge Join"), "{plan}");
    assert!(plan.contains("Index Scan using operations_pkey"), "each step's operations probed by key: {plan}");
}

/// Replays append only an event, and concurrent replays share one statement. When the
/// database refuses one request's event (here a trigger's exception), the others are
/// written and answered, and the refused one hears the database's message as a refusal,
/// not as an outage (a break-it pass had 72 of 120 concurrent replays fail with 503).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_event_fails_only_its_own_replay() {
    let url = idem_store::testing::fresh_pg_database("idem_events").await;
    let store: Arc<dyn Store> =
        Arc::new(PgStore::connect(&url, Arc::new(SystemClock), Default::default()).await.unwrap());
    let keys: Vec<String> = (0..24).map(|i| if i == 5 { "refused".to_owned() } else { format!("k{i}") }).collect();
    for k in &keys {
        let token = store.acquire(input(k)).await.unwrap().record.fencing_token;
        let done = idem_store::CompleteRequest {
            tenant: "t".into(),
            key: k.clone(),
            fencing_token: token,
            outcome: idem_core::Outcome::Succeeded { provider_ref: format!("ref-{k}"), result: None },
            actor: Actor { principal: "w".into(), request_id: None },
            policy: None,
        };
        store.complete(done).await.unwrap();
    }
    let mut admin = <sqlx::PgConnection as sqlx::Connection>::connect(&url).await.unwrap();
    sqlx::raw_sql(
        "CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS \
         $$ BEGIN RAISE EXCEPTION 'no replays of %', NEW.op_key; END $$; \
         CREATE TRIGGER refuse_replay BEFORE INSERT ON operation_events \
         FOR EACH ROW WHEN (NEW.kind = 'replayed' AND NEW.op_key = 'refused') EXECUTE FUNCTION refuse();",
    )
    .execute(&mut admin)
    .await
    .unwrap();
    for round in 0..3 {
        let tasks: Vec<_> = keys
            .iter()
            .map(|k| {
                let (store, k) = (store.clone(), k.clone());
                tokio::spawn(async move { (k.clone(), store.acquire(input(&k)).await) })
            })
            .collect();
        for t in tasks {
            let (k, got) = t.await.unwrap();
            if k == "refused" {
                let e = got.expect_err("the trigger refuses this replay's event");
                assert_eq!(e.refusal(), Some("no replays of refused"), "round {round}: {e}");
            } else {
                assert_eq!(got.unwrap().decision, Decision::Replay, "{k}, round {round}");
            }
        }
    }
    let replays = |k: &str| {
        let store = store.clone();
        let k = k.to_owned();
        async move { store.events("t", &k).await.unwrap().iter().filter(|e| e.kind == "replayed").count() }
    };
    assert_eq!(replays("k0").await, 3);
    assert_eq!(replays("refused").await, 0);
}

/// Runs `jobs` at once while `holder` holds what `lock` (statements after `BEGIN`) takes,
/// for `hold` (`meanwhile` runs during it), then rolls back: each job's answer and how
/// long it took from the start.
async fn under_lock<T: Send + 'static>(
    holder: &mut sqlx::PgConnection,
    lock: &str,
    hold: std::time::Duration,
    jobs: Vec<Job<T>>,
    meanwhile: impl std::future::Future<Output = ()>,
) -> Vec<(T, std::time::Duration)> {
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("BEGIN; {lock}"))).execute(&mut *holder).await.unwrap();
    let start = std::time::Instant::now();
    let tasks: Vec<_> = jobs.into_iter().map(|job| tokio::spawn(async move { (job.await, start.elapsed()) })).collect();
    tokio::join!(tokio::time::sleep(hold), meanwhile);
    sqlx::raw_sql("ROLLBACK").execute(&mut *holder).await.unwrap();
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap());
    }
    out
}

/// Requests batched with a row another transaction holds locked are not held back for the
/// lock's duration, and the locked one is answered once the lock is released.
///
/// Found by a break-it pass: an operator's `SELECT … FOR UPDATE` on one operation (or an
/// uncommitted insert of a key) held every request sharing its batch statement — and,
/// four such batches stuck, every completion of the node — for as long as the lock was
/// held. The batch writers now give up a lock after 100 ms and the locked request takes
/// the transactional path, which waits. Checked for completions (a row lock) and for
/// claims of new keys (an uncommitted insert of one of them), with a lock held 4 s: the
/// other requests must be answered well within it. With more locked rows than the node
/// lets wait (each waiter holds a pooled connection), the surplus is told to try again
/// (`Contention`) at once, and reads go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_locked_row_holds_back_only_its_own_request() {
    use sqlx::Connection;
    use std::time::{Duration, Instant};
    const HOLD: Duration = Duration::from_secs(4);
    let url = idem_store::testing::fresh_pg_database("idem_row_lock").await;
    let store: Arc<dyn Store> =
        Arc::new(PgStore::connect(&url, Arc::new(SystemClock), Default::default()).await.unwrap());
    let complete = common::success;
    let completions = |keys: &[String], tokens: &[i64]| -> Vec<Job<Result<idem_store::CompleteOutcome, StoreError>>> {
        keys.iter()
            .zip(tokens)
            .map(|(k, &t)| {
                let (store, req) = (store.clone(), complete(k, t));
                Box::pin(async move { store.complete(req).await }) as Job<_>
            })
            .collect()
    };
    let acquire_all = async |keys: &[String]| {
        let mut tokens = Vec::new();
        for k in keys {
            tokens.push(store.acquire(input(k)).await.unwrap().record.fencing_token);
        }
        tokens
    };
    let mut holder = sqlx::PgConnection::connect(&url).await.unwrap();
    for round in 0..3 {
        // Completions: 16 leases, one of them locked by another transaction.
        let keys: Vec<String> = (0..16).map(|i| format!("c{round}-{i}")).collect();
        let tokens = acquire_all(&keys).await;
        let lock = format!("SELECT 1 FROM operations WHERE tenant = 't' AND op_key = '{}' FOR UPDATE", keys[5]);
        let answers = under_lock(&mut holder, &lock, HOLD, completions(&keys, &tokens), async {}).await;
        for (i, (done, took)) in answers.into_iter().enumerate() {
            let done = done.unwrap_or_else(|e| panic!("completion {i} of round {round}: {e}"));
            assert_eq!(done.record.provider_ref.as_deref(), Some(format!("ref-{}", keys[i]).as_str()));
            if i == 5 {
                assert!(took >= HOLD, "the locked completion was answered before the lock was released");
            } else {
                assert!(took < HOLD / 2, "completion {i} of round {round} waited {took:?} for another row's lock");
            }
        }
        // Claims: 16 new keys, one of them inserted (not yet committed) by another transaction.
        let keys: Vec<String> = (0..16).map(|i| format!("n{round}-{i}")).collect();
        let lock = format!(
            "INSERT INTO operations (tenant, op_key, action, fingerprint, payload, state, attempt_count, \
             fencing_token, created_at, updated_at, version) VALUES ('t', '{}', 'send', 'f', '{{}}', 'PENDING', 0, \
             1, 1, 1, 1)",
            keys[9]
        );
        let claims: Vec<Job<Result<idem_store::AcquireOutcome, StoreError>>> = keys
            .iter()
            .map(|k| {
                let (store, k) = (store.clone(), k.clone());
                Box::pin(async move { store.acquire(input(&k)).await }) as Job<_>
            })
            .collect();
        let answers = under_lock(&mut holder, &lock, HOLD, claims, async {}).await;
        for (i, (got, took)) in answers.into_iter().enumerate() {
            let got = got.unwrap_or_else(|e| panic!("acquire {i} of round {round}: {e}"));
            assert_eq!(got.decision, Decision::Acquire, "acquire {i} of round {round}");
            if i == 9 {
                assert!(took >= HOLD, "the claim of the key being inserted elsewhere did not wait for it");
            } else {
                assert!(took < HOLD / 2, "acquire {i} of round {round} waited {took:?} for another key's insert");
            }
        }
    }
    // Each request was written once, with one event.
    let pg = PgStore::connect(&url, Arc::new(SystemClock), Default::default()).await.unwrap();
    let (ops,): (i64,) = sqlx::query_as("SELECT COUNT(*) FROM operations").fetch_one(pg.pool()).await.unwrap();
    let (events,): (i64,) = sqlx::query_as("SELECT COUNT(*) FROM operation_events").fetch_one(pg.pool()).await.unwrap();
    assert_eq!((ops, events), (3 * 32, 3 * (16 * 2 + 16)));

    // More locked rows than the node lets wait (half its pool, at most 16): the others are
    // told to try again at once instead of taking every pooled connection, so reads and
    // other completions go on; after the release every one of them completes. Held
    // longer: the batch that meets the locks writes its requests again one per statement,
    // four keys at a time, and each locked one costs the writer's lock timeout (100 ms)
    // before it leaves for the waiting path or is refused.
    const LONG_HOLD: Duration = Duration::from_secs(8);
    let keys: Vec<String> = (0..21).map(|i| format!("many-{i}")).collect();
    let tokens = acquire_all(&keys).await;
    let meanwhile = async {
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let read = Instant::now();
        assert!(store.get("t", &keys[20]).await.unwrap().is_some());
        let other = store.complete(complete(&keys[20], tokens[20])).await.unwrap();
        assert_eq!(other.record.provider_ref.as_deref(), Some("ref-many-20"));
        assert!(read.elapsed() < HOLD / 2, "a read and a completion of an unlocked row took {:?}", read.elapsed());
    };
    let lock = "SELECT 1 FROM operations WHERE op_key LIKE 'many-%' AND op_key <> 'many-20' FOR UPDATE";
    let answers = under_lock(&mut holder, lock, LONG_HOLD, completions(&keys[..20], &tokens[..20]), meanwhile).await;
    let (mut waited, mut refused) = (0, 0);
    for (i, answer) in answers.into_iter().enumerate() {
        match answer {
            (Ok(done), took) => {
                assert!(took >= LONG_HOLD, "locked completion {i} answered before the release");
                assert_eq!(done.record.provider_ref.as_deref(), Some(format!("ref-{}", keys[i]).as_str()));
                waited += 1;
            }
            (Err(StoreError::Contention), took) => {
                assert!(took < LONG_HOLD, "locked completion {i} was refused only after the release ({took:?})");
                let again = store.complete(complete(&keys[i], tokens[i])).await.unwrap();
                assert_eq!(again.record.provider_ref.as_deref(), Some(format!("ref-{}", keys[i]).as_str()));
                refused += 1;
            }
            (Err(e), _) => panic!("locked completion {i}: {e}"),
        }
    }
    assert!(waited <= 16 && refused >= 4, "{waited} waited for their locks, {refused} were told to try again");
}

/// Renewals (and the other requests on the transactional path: resolve, reconcile, a
/// workflow's start) of a row another transaction holds locked wait for it only with a
/// place among the lock waiters (half the pool, at most 16); the rest are told to try
/// again at once. Before, twenty renewals of one locked lease each held a pooled
/// connection until the release, and every other request then waited for a connection
/// (a break-it pass: unrelated reads answered 503 after the pool's acquire timeout).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewals_of_a_locked_lease_do_not_take_the_pool() {
    use sqlx::Connection;
    use std::time::{Duration, Instant};
    const HOLD: Duration = Duration::from_secs(4);
    let url = idem_store::testing::fresh_pg_database("idem_renew_lock").await;
    let store: Arc<dyn Store> =
        Arc::new(PgStore::connect(&url, Arc::new(SystemClock), Default::default()).await.unwrap());
    let token = store.acquire(input("held")).await.unwrap().record.fencing_token;
    let other = store.acquire(input("other")).await.unwrap().record.fencing_token;
    let renew = |lease_ms: i64| idem_store::RenewRequest {
        tenant: "t".into(),
        key: "held".into(),
        fencing_token: token,
        lease_ms,
        actor: Actor { principal: "w".into(), request_id: None },
    };
    let renewals: Vec<Job<Result<idem_core::OperationRecord, StoreError>>> = (0..20)
        .map(|_| {
            let (store, req) = (store.clone(), renew(120_000));
            Box::pin(async move { store.renew(req).await }) as Job<_>
        })
        .collect();
    let meanwhile = async {
        tokio::time::sleep(Duration::from_millis(1000)).await;
        let start = Instant::now();
        for _ in 0..10 {
            assert!(store.get("t", "other").await.unwrap().is_some());
        }
        let done = store.complete(common::success("other", other)).await.unwrap();
        assert_eq!(done.record.provider_ref.as_deref(), Some("ref-other"));
        assert!(start.elapsed() < HOLD / 4, "ten reads and a completion of another row took {:?}", start.elapsed());
    };
    let mut holder = sqlx::PgConnection::connect(&url).await.unwrap();
    let lock = "SELECT 1 FROM operations WHERE tenant = 't' AND op_key = 'held' FOR UPDATE";
    let answers = under_lock(&mut holder, lock, HOLD, renewals, meanwhile).await;
    let (mut waited, mut refused) = (0, 0);
    for (i, answer) in answers.into_iter().enumerate() {
        match answer {
            (Ok(rec), took) => {
                assert!(took >= HOLD, "renewal {i} of the locked lease answered before the release");
                assert_eq!(rec.fencing_token, token);
                waited += 1;
            }
            (Err(StoreError::Contention), took) => {
                assert!(took < HOLD / 2, "renewal {i} was refused only after {took:?}");
                refused += 1;
            }
            (Err(e), _) => panic!("renewal {i}: {e}"),
        }
    }
    assert!(
        (1..=16).contains(&waited) && refused >= 4,
        "{waited} waited for the lock, {refused} were told to try again"
    );
    let after = store.renew(renew(60_000)).await.unwrap();
    assert_eq!(after.fencing_token, token, "a renewal after the release");
}
