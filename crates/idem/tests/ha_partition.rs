//! Issue 33: a network partition between one `idem serve` node and its database.
//!
//! Node A runs in a network namespace of the test's own ([`common::netns`]) and reaches
//! PostgreSQL over a veth link that the test cuts (packets dropped, no reset), while A's
//! clients still reach A; node B runs beside the database. While A is cut off:
//! - A's clients get 503 + Retry-After within A's answer timeout, never a hang, and A's
//!   `/readyz` says 503;
//! - A's leases run out on the database's clock: B answers 409 to another holder while
//!   A's lease could still be acted on, and only after it ran out grants the `redo_safe`
//!   key to a second holder (the other key turns UNKNOWN, no second grant).
//!
//! After the partition heals, A neither completes with its stale token (409
//! `stale-fencing-token`, the record keeps B's outcome) nor loses what its clients were
//! told: what A acknowledged before the cut is there, and the completion it answered 503
//! is settled by sending it again.

mod common;

use common::netns::Netns;
use common::pg_cluster::PgCluster;
use common::{ADMIN_KEY, Resp, Server, enc};
use serde_json::{Value, json};
use std::time::{Duration, Instant};

/// Node A's answer timeout (`--db-answer-timeout-ms`).
const ANSWER_TIMEOUT_MS: u64 = 2000;
/// The leases A takes.
const LEASE_MS: i64 = 3000;

async fn acquire(node: &Server, key: &str, holder: &str, redo_safe: bool) -> Resp {
    let body = json!({"key": key, "action": "ship", "payload": {"order": key}, "lease_ms": LEASE_MS,
                      "holder": holder, "redo_safe": redo_safe});
    node.post(ADMIN_KEY, "/v1/operations", &body).await
}

async fn complete(node: &Server, key: &str, token: i64, provider_ref: &str) -> Resp {
    let body = json!({"fencing_token": token, "outcome": "succeeded", "provider_ref": provider_ref});
    node.post(ADMIN_KEY, &format!("/v1/operations/{}/complete", enc(key)), &body).await
}

fn holder() -> String {
    uuid::Uuid::new_v4().to_string()
}

/// The instant an RFC 3339 time of an answer names, as epoch ms.
fn epoch_ms(v: &Value) -> i64 {
    let text = v.as_str().unwrap_or_else(|| panic!("a time: {v}"));
    let out = std::process::Command::new("date").args(["-d", text, "+%s%3N"]).output().unwrap();
    String::from_utf8(out.stdout).unwrap().trim().parse().unwrap()
}

fn now_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as i64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_node_cut_off_its_database_never_lets_two_holders_act() {
    let net = Netns::new();
    let pg = PgCluster::start_listening(Some((&net.db_ip, &net.db_net)));
    let b = Server::start(&pg.url());
    let url_a = format!("postgres://postgres@{}:{}/postgres?sslmode=disable", net.db_ip, pg.port);
    let a = Server::start_in_netns(&net.name, &net.node_ip, &url_a, &["--db-answer-timeout-ms", "2000"]);

    // Before the cut: A grants two leases and acknowledges a completion.
    let done = acquire(&a, "part-done", &holder(), false).await;
    assert_eq!(done.status, 201, "{done:?}");
    assert_eq!(complete(&a, "part-done", done.token(), "ship-done").await.status, 200);
    let (ha_redo, ha_plain) = (holder(), holder());
    let redo = acquire(&a, "part-redo", &ha_redo, true).await;
    let plain = acquire(&a, "part-plain", &ha_plain, false).await;
    assert_eq!((redo.status.as_u16(), plain.status.as_u16()), (201, 201), "{redo:?} {plain:?}");
    let (token_redo, token_plain) = (redo.token(), plain.token());
    let lease_end = epoch_ms(&redo.body["lease_expires_at"]).max(epoch_ms(&plain.body["lease_expires_at"]));

    net.cut();
    let cut = Instant::now();

    // A's clients: 503 with Retry-After within the answer timeout, never a hang.
    let sent = Instant::now();
    let r = complete(&a, "part-plain", token_plain, "ship-plain").await;
    let took = sent.elapsed();
    assert_eq!(r.status, 503, "{r:?}");
    assert_eq!(r.problem(), "unavailable");
    assert_eq!(r.header("retry-after"), Some("1"));
    assert!(took < Duration::from_millis(ANSWER_TIMEOUT_MS + 2000), "the 503 took {took:?}");
    let mut ready = a.get("", "/readyz").await;
    while ready.status == 200 && cut.elapsed() < Duration::from_secs(5) {
        tokio::time::sleep(Duration::from_millis(100)).await;
        ready = a.get("", "/readyz").await;
    }
    assert_eq!(ready.status, 503, "A's /readyz while cut off: {ready:?}");

    // B: no second holder while A's leases could still be acted on (judged on the
    // database's clock), then a second grant of the redo_safe key only.
    let hb = holder();
    let second = loop {
        let r = acquire(&b, "part-redo", &hb, true).await;
        match r.status.as_u16() {
            409 => {
                assert_eq!(r.problem(), "operation-in-progress", "{r:?}");
                assert!(cut.elapsed() < Duration::from_secs(30), "B never took over");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            201 => break r,
            _ => panic!("B: {r:?}"),
        }
    };
    // When the database granted it (its clock): the new lease's end less its length.
    let granted_at = epoch_ms(&second.body["lease_expires_at"]) - LEASE_MS;
    assert!(granted_at >= lease_end, "B granted {} ms before A's lease ran out", lease_end - granted_at);
    assert!(now_ms() >= lease_end);
    let token_b = second.token();
    assert!(token_b > token_redo, "a new fencing token: {token_b} after {token_redo}");
    let r = acquire(&b, "part-plain", &holder(), false).await;
    assert_eq!(r.status, 202, "not redo_safe: UNKNOWN, no second grant: {r:?}");
    assert_eq!(r.body["state"], "UNKNOWN");
    assert_eq!(complete(&b, "part-redo", token_b, "ship-by-b").await.status, 200);

    net.heal();
    let healed = Instant::now();

    // A is back: its stale token changes nothing.
    let stale = loop {
        let r = complete(&a, "part-redo", token_redo, "ship-by-a").await;
        if r.status != 503 {
            break r;
        }
        assert!(healed.elapsed() < Duration::from_secs(20), "A still 503 after the heal: {r:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(stale.status, 409, "{stale:?}");
    assert_eq!(stale.problem(), "stale-fencing-token");
    for node in [&a, &b] {
        let rec = node.record("part-redo").await.body;
        assert_eq!((rec["state"].as_str(), rec["provider_ref"].as_str()), (Some("SUCCEEDED"), Some("ship-by-b")));
    }
    // What A's clients were told stays true; the completion A answered 503 is settled by
    // sending it again (accepted late: nobody was granted since; or already recorded).
    let again = complete(&a, "part-plain", token_plain, "ship-plain").await;
    assert_eq!(again.status, 200, "{again:?}");
    for node in [&a, &b] {
        let rec = node.record("part-done").await.body;
        assert_eq!((rec["state"].as_str(), rec["provider_ref"].as_str()), (Some("SUCCEEDED"), Some("ship-done")));
        let rec = node.record("part-plain").await.body;
        assert_eq!((rec["state"].as_str(), rec["provider_ref"].as_str()), (Some("SUCCEEDED"), Some("ship-plain")));
    }
    eprintln!(
        "A cut off: 503 after {took:?}; B granted the redo_safe key {} ms after A's lease ran out; \
         A answered again {:?} after the heal",
        granted_at - lease_end,
        healed.elapsed()
    );
}
