//! Crash safety: `kill -9` between acquire and complete, restart on the same database.
//! The record is intact, the lease expires into UNKNOWN (never a second grant), and every
//! acknowledged write survives.

mod common;

use common::{ADMIN_KEY, Backend, Db, Server, event_kinds};
use serde_json::json;
use std::time::Duration;

async fn crash_between_acquire_and_complete(b: Backend) {
    let db = Db::new(b).await;
    let s = Server::start(&db.url);
    let key = "ORD-102:create-order";
    let body = json!({"key": key, "action": "create_order", "payload": {"sku": "A-1", "qty": 2}, "lease_ms": 800});
    let granted = s.post(ADMIN_KEY, "/v1/operations", &body).await;
    assert_eq!(granted.status, 201);
    // Acknowledged writes before the crash: 50 more acquires.
    for i in 0..50 {
        let r = s.acquire(&format!("ack-{i}"), json!({"i": i})).await;
        assert_eq!(r.status, 201);
    }
    s.kill9();

    let s = Server::start(&db.url);
    let rec = s.record(key).await;
    assert_eq!(rec.status, 200, "record survived the crash: {rec:?}");
    assert_eq!(rec.body["payload"], json!({"sku": "A-1", "qty": 2}));
    assert_eq!(rec.body["fencing_token"], granted.token());
    for i in 0..50 {
        assert_eq!(s.record(&format!("ack-{i}")).await.status, 200, "acknowledged acquire {i} lost");
    }
    // Let the lease run out: the sweeper (or the next trigger) turns it UNKNOWN.
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    let retry = s.post(ADMIN_KEY, "/v1/operations", &body).await;
    assert_eq!(retry.status, 202, "UNKNOWN, not a second grant: {retry:?}");
    assert_eq!(retry.body["state"], "UNKNOWN");
    assert_eq!(retry.body["fencing_token"], granted.token(), "no new grant");
    let rec = s.record(key).await.body;
    assert_eq!(rec["state"], "UNKNOWN");
    assert_eq!(rec["attempt"], 1);
    let kinds = event_kinds(&rec);
    assert_eq!(kinds[..2], ["acquired", "lease_expired"], "{kinds:?}");
    assert_eq!(kinds.iter().filter(|k| *k == "acquired").count(), 1, "never a second grant: {kinds:?}");
    assert!(kinds.contains(&"unknown_pending".to_string()));
    // Nobody can be asked about an effect the caller performed: it waits for review.
    for _ in 0..50 {
        if s.record(key).await.body["needs_review"] == true {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(s.record(key).await.body["needs_review"], true);
    let queue = s.get(ADMIN_KEY, "/v1/operations?needs_review=true").await.body;
    assert_eq!(queue["items"][0]["key"], key);
    let expired = &rec["events"][1];
    assert_eq!((expired["from_state"].as_str(), expired["to_state"].as_str()), (Some("EXECUTING"), Some("UNKNOWN")));
    // The crashed worker's late report (same token, no newer grant) settles it with evidence.
    let late = s
        .complete(key, json!({"fencing_token": granted.token(), "outcome": "succeeded", "provider_ref": "ord-102"}))
        .await;
    assert_eq!(late.status, 200);
    assert_eq!(late.body["state"], "SUCCEEDED");
    let unknowns = s.get(ADMIN_KEY, "/v1/operations?state=UNKNOWN").await.body;
    assert!(unknowns["items"].as_array().unwrap().iter().all(|o| o["key"] != key));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_crash_between_acquire_and_complete() {
    crash_between_acquire_and_complete(Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_crash_between_acquire_and_complete() {
    crash_between_acquire_and_complete(Backend::Postgres).await;
}

/// Group commit never acknowledges before the commit is durable: concurrent acquires are
/// batched into shared transactions; the server is killed while they are still arriving;
/// every acknowledged one is there after the restart.
async fn acknowledged_batches_survive_kill_9(b: Backend) {
    let db = Db::new(b).await;
    let s = Server::start(&db.url);
    let (http, url) = (s.http.clone(), s.url("/v1/operations"));
    let acked = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    // 32 clients, each sending acquires back to back: the writer batches them.
    let tasks: Vec<_> = (0..32)
        .map(|w| {
            let (http, url, acked) = (http.clone(), url.clone(), acked.clone());
            tokio::spawn(async move {
                let mut mine = Vec::new();
                for i in 0..200 {
                    let key = format!("batch-{w}-{i}");
                    let body = json!({"key": key, "action": "send", "payload": {"i": i}});
                    match http.post(&url).bearer_auth(ADMIN_KEY).json(&body).send().await {
                        Ok(r) if r.status() == 201 => {
                            mine.push(key);
                            acked.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                        }
                        _ => break, // not acknowledged: the server died first
                    }
                }
                mine
            })
        })
        .collect();
    let start = std::time::Instant::now();
    while acked.load(std::sync::atomic::Ordering::SeqCst) < 300 && start.elapsed() < Duration::from_secs(20) {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    s.kill9(); // while the clients are still sending
    let mut acknowledged = Vec::new();
    for t in tasks {
        acknowledged.extend(t.await.unwrap());
    }
    let s = Server::start(&db.url);
    assert!(acknowledged.len() >= 300, "acquires were acknowledged before the kill");
    assert!(acknowledged.len() < 32 * 200, "the kill happened while clients were still sending");
    for k in &acknowledged {
        let r = s.record(k).await;
        assert_eq!(r.status, 200, "acknowledged {k} was lost");
        assert_eq!(r.body["state"], "EXECUTING");
    }
    eprintln!("{} acquires acknowledged before kill -9; all found after restart", acknowledged.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_acknowledged_batches_survive_kill_9() {
    acknowledged_batches_survive_kill_9(Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_acknowledged_batches_survive_kill_9() {
    acknowledged_batches_survive_kill_9(Backend::Postgres).await;
}

/// The same for whole pairs and replays, the path the writer's record cache serves (a
/// completion planned from the record its acquire left in memory, a replay answered from
/// it): 16 clients run acquire -> complete -> replay back to back, the server is killed
/// while they do; after the restart (an empty cache) every acknowledged completion is
/// SUCCEEDED with its evidence, and a replay answers it from the database.
async fn acknowledged_pairs_survive_kill_9(b: Backend) {
    let db = Db::new(b).await;
    let s = Server::start(&db.url);
    let (http, base) = (s.http.clone(), s.url("/v1/operations"));
    let done = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let tasks: Vec<_> = (0..16)
        .map(|w| {
            let (http, base, done) = (http.clone(), base.clone(), done.clone());
            tokio::spawn(async move {
                let mut completed = Vec::new();
                for i in 0..500 {
                    let key = format!("pair-{w}-{i}");
                    let body = json!({"key": key, "action": "send", "payload": {"i": i}});
                    let Ok(r) = http.post(&base).bearer_auth(ADMIN_KEY).json(&body).send().await else { break };
                    if r.status() != 201 {
                        break;
                    }
                    let Ok(granted) = r.json::<serde_json::Value>().await else { break };
                    let complete = json!({"fencing_token": granted["fencing_token"], "outcome": "succeeded", "provider_ref": format!("ref-{key}")});
                    let url = format!("{base}/{}/complete", common::enc(&key));
                    match http.post(&url).bearer_auth(ADMIN_KEY).json(&complete).send().await {
                        Ok(r) if r.status() == 200 => completed.push(key),
                        _ => break,
                    }
                    done.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    match http.post(&base).bearer_auth(ADMIN_KEY).json(&body).send().await {
                        Ok(r) if r.status() == 200 => {}
                        _ => break,
                    }
                }
                completed
            })
        })
        .collect();
    let start = std::time::Instant::now();
    while done.load(std::sync::atomic::Ordering::SeqCst) < 200 && start.elapsed() < Duration::from_secs(30) {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    s.kill9();
    let mut completed = Vec::new();
    for t in tasks {
        completed.extend(t.await.unwrap());
    }
    assert!(completed.len() >= 200, "completions were acknowledged before the kill");
    assert!(completed.len() < 16 * 500, "the kill happened while clients were still sending");
    let s = Server::start(&db.url);
    for k in &completed {
        let r = s.record(k).await;
        assert_eq!(r.status, 200, "acknowledged {k} was lost");
        assert_eq!(
            (r.body["state"].as_str(), r.body["provider_ref"].as_str()),
            (Some("SUCCEEDED"), Some(&*format!("ref-{k}")))
        );
    }
    let k = &completed[completed.len() / 2];
    let replay = s.post(ADMIN_KEY, "/v1/operations", &json!({"key": k, "action": "send", "payload": {"i": k.rsplit('-').next().unwrap().parse::<i64>().unwrap()}})).await;
    assert_eq!(replay.status, 200, "{replay:?}");
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    eprintln!("{} pairs acknowledged before kill -9; all SUCCEEDED after restart", completed.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_acknowledged_pairs_survive_kill_9() {
    acknowledged_pairs_survive_kill_9(Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_acknowledged_pairs_survive_kill_9() {
    acknowledged_pairs_survive_kill_9(Backend::Postgres).await;
}

/// PostgreSQL: a request that meets a row lock another transaction holds leaves its batch
/// and waits on the transactional path (`acquire_waiting`, `complete_waiting` in
/// idem-store's postgres.rs). The server is killed while such requests wait and the
/// batches beside them go on: every request it answered is there after the restart; a
/// waiting one, never answered, either did not happen or happened once, and its client's
/// retry (the same holder, the same fencing token) gets the answer it would have got —
/// one grant, one completion, never two.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_kill_9_while_requests_wait_for_a_row_lock() {
    use sqlx::Connection;
    let db = Db::new(Backend::Postgres).await;
    let s = Server::start(&db.url);
    let mut tokens = Vec::new();
    for i in 0..16 {
        let r = s.acquire(&format!("lease-{i}"), json!({"i": i})).await;
        assert_eq!(r.status, 201, "{r:?}");
        tokens.push(r.token());
    }
    // Two leases locked and two new keys inserted, uncommitted, by another transaction:
    // four waiters, what a 2-core node lets wait (half its pool of 8).
    let (locked_leases, locked_new) = ([3usize, 11], [5usize, 12]);
    let mut holder = sqlx::PgConnection::connect(&db.url).await.unwrap();
    let mut lock = "BEGIN; SELECT 1 FROM operations WHERE tenant = 'default' AND op_key IN ('lease-3', 'lease-11') \
                    FOR UPDATE;"
        .to_owned();
    for i in locked_new {
        lock += &format!(
            "INSERT INTO operations (tenant, op_key, action, fingerprint, payload, state, attempt_count, \
             fencing_token, created_at, updated_at, version) VALUES ('default', 'new-{i}', 'send', 'f', '{{}}', \
             'PENDING', 0, 1, 1, 1, 1);"
        );
    }
    sqlx::raw_sql(sqlx::AssertSqlSafe(lock)).execute(&mut holder).await.unwrap();

    let complete_body = |i: usize, token: i64| json!({"fencing_token": token, "outcome": "succeeded", "provider_ref": format!("ref-lease-{i}")});
    // One attempt per new key, its holder kept for the retry after the restart.
    let holders: Vec<String> = (0..16).map(|_| uuid::Uuid::now_v7().to_string()).collect();
    let acquire_body =
        |i: usize| json!({"key": format!("new-{i}"), "action": "send", "payload": {"n": i}, "holder": holders[i]});
    let answered = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for (i, &token) in tokens.iter().enumerate() {
        let (http, answered) = (s.http.clone(), answered.clone());
        let complete = (s.url(&format!("/v1/operations/lease-{i}/complete")), complete_body(i, token));
        let acquire = (s.url("/v1/operations"), acquire_body(i));
        for (kind, (url, body)) in [("complete", complete), ("acquire", acquire)] {
            let (http, answered) = (http.clone(), answered.clone());
            tasks.push(tokio::spawn(async move {
                let status = match http.post(&url).bearer_auth(ADMIN_KEY).json(&body).send().await {
                    Ok(r) => Some(r.status().as_u16()),
                    Err(_) => None, // the server died first
                };
                answered.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                (kind, i, status)
            }));
        }
    }
    let start = std::time::Instant::now();
    while answered.load(std::sync::atomic::Ordering::SeqCst) < 28 && start.elapsed() < Duration::from_secs(20) {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Past the writers' lock timeout (100 ms): the four are on the waiting path, and a
    // fifth request for a locked row finds no place to wait: 409 contention, Retry-After.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let fifth = s.complete("lease-3", complete_body(3, tokens[3])).await;
    assert_eq!((fifth.status.as_u16(), fifth.problem()), (409, "contention"), "{fifth:?}");
    assert_eq!(fifth.header("retry-after"), Some("1"));
    s.kill9();
    let mut results = Vec::new();
    for t in tasks {
        results.push(t.await.unwrap());
    }
    sqlx::raw_sql("ROLLBACK").execute(&mut holder).await.unwrap();
    for &(kind, i, status) in &results {
        let locked = if kind == "complete" { locked_leases.contains(&i) } else { locked_new.contains(&i) };
        if locked {
            assert_eq!(status, None, "{kind} {i} waited for the lock, and the server was killed first");
        } else {
            let want = if kind == "complete" { 200 } else { 201 };
            assert_eq!(status, Some(want), "{kind} {i} was answered beside the locked ones");
        }
    }

    let s = Server::start(&db.url);
    for i in 0..16 {
        let lease = s.record(&format!("lease-{i}")).await.body;
        let new = s.record(&format!("new-{i}")).await;
        if !locked_leases.contains(&i) {
            assert_eq!(
                (lease["state"].as_str(), lease["provider_ref"].as_str()),
                (Some("SUCCEEDED"), Some(&*format!("ref-lease-{i}")))
            );
        }
        if !locked_new.contains(&i) {
            assert_eq!(
                (new.status.as_u16(), new.body["state"].as_str()),
                (200, Some("EXECUTING")),
                "acknowledged new-{i}: {new:?}"
            );
            assert_eq!(new.body["payload"], json!({"n": i}));
        }
    }
    for i in locked_leases {
        let retry = s.complete(&format!("lease-{i}"), complete_body(i, tokens[i])).await;
        assert_eq!((retry.status.as_u16(), retry.body["state"].as_str()), (200, Some("SUCCEEDED")), "{retry:?}");
        let kinds = event_kinds(&s.record(&format!("lease-{i}")).await.body);
        assert_eq!(kinds.iter().filter(|k| *k == "completed").count(), 1, "one completion of lease-{i}: {kinds:?}");
    }
    for i in locked_new {
        let retry = s.post(ADMIN_KEY, "/v1/operations", &acquire_body(i)).await;
        assert_eq!(retry.status, 201, "the retry of new-{i} holds its lease: {retry:?}");
        let rec = s.record(&format!("new-{i}")).await.body;
        assert_eq!(
            rec["payload"],
            json!({"n": i}),
            "the killed request's write, or the retry's, not the other transaction's"
        );
        let kinds = event_kinds(&rec);
        assert_eq!(kinds.iter().filter(|k| *k == "acquired").count(), 1, "one grant of new-{i}: {kinds:?}");
        assert_eq!(rec["fencing_token"], retry.token());
    }
}
