//! idem performs side effects itself (issue 3): S4 over SMTP (real aiosmtpd + Dovecot) and
//! over HTTP, S5, S6, C1 and C2 with kill -9, the retry storm, operator review, and bad
//! configuration. The provider double counts every side effect; nothing here dedupes but
//! idem.

mod common;

use common::mail::{IMAP_PASSWORD, IMAP_USER, MailServers};
use common::proxy::FaultProxy;
use common::{ADMIN_KEY, Backend, Db, Server, orders_config, start_provider};
use idem::acceptance::provider::Step;
use serde_json::{Value, json};
use std::time::Duration;

fn trigger(key: &str, connector: &str, payload: Value, wait_ms: u64) -> Value {
    json!({"key": key, "action": "create_order", "connector": connector, "payload": payload, "wait_ms": wait_ms})
}

fn events_of(rec: &Value, kind: &str) -> Vec<Value> {
    rec["events"].as_array().unwrap().iter().filter(|e| e["kind"] == kind).cloned().collect()
}

fn at_ms(e: &Value) -> i64 {
    e["at"].as_str().unwrap().parse::<jiff::Timestamp>().unwrap().as_millisecond()
}

/// S4 over HTTP: the provider creates the order but the reply never comes (timeout after
/// the request was sent) ⇒ UNKNOWN; the re-run gets 202 and sends nothing; the reconciler
/// finds the order by the key ⇒ SUCCEEDED with evidence.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_http_lost_reply_is_reconciled_never_resent() {
    let (provider, addr) = start_provider().await;
    let key = "INQ-004:confirmation:v1";
    provider.script(key, vec![Step::EffectThenHang]);
    let db = Db::new(Backend::Sqlite).await;
    // A slow reconciler, so the 09:02 re-run surely finds the operation still UNKNOWN.
    let config = orders_config(addr, "").replace("interval_ms = 100", "interval_ms = 1500");
    let s = Server::start_with_config(&db.url, &config);
    let t0 = s.post(ADMIN_KEY, "/v1/operations", &trigger(key, "orders", json!({"sku": "A"}), 5_000)).await;
    assert_eq!(t0.status, 202, "{t0:?}");
    assert_eq!(t0.body["state"], "UNKNOWN");
    assert!(t0.header("location").unwrap().ends_with("/v1/operations/INQ-004:confirmation:v1"));
    let t1 = s.post(ADMIN_KEY, "/v1/operations", &trigger(key, "orders", json!({"sku": "A"}), 0)).await;
    assert_eq!(t1.status, 202, "reconciliation pending: {t1:?}");
    let rec = s.wait_for(key, 15, |r| r["state"] == "SUCCEEDED").await;
    assert_eq!(rec["provider_ref"], "ord-1");
    assert_eq!(rec["evidence_source"], "lookup");
    assert!(rec["verified_at"].is_string());
    assert_eq!((provider.calls(key), provider.effects(key)), (1, 1), "one call, one order: nothing resent");
    assert_eq!(events_of(&rec, "reconciled").len(), 1);
}

/// S4 over SMTP: the fault proxy lets the message through and cuts the connection before
/// the server's 250 reaches idem ⇒ UNKNOWN; the re-run sends nothing; the reconciler finds
/// the message by its Message-ID over IMAP ⇒ SUCCEEDED; the mailbox holds exactly one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_smtp_reply_cut_after_data_is_found_over_imap() {
    let mail = MailServers::start();
    let proxy = FaultProxy::start(format!("127.0.0.1:{}", mail.smtp_port).parse().unwrap(), b"\r\n.\r\n", 1).await;
    let dir = tempfile::tempdir().unwrap();
    let secret = dir.path().join("imap-password");
    std::fs::write(&secret, IMAP_PASSWORD).unwrap();
    let config = format!(
        "[reconciler]\ninterval_ms = 1500\n[connectors.mail]\nkind = \"smtp\"\nhost = \"127.0.0.1\"\nport = {}\ntls = \"none\"\n\
         from = \"idem@example.org\"\ntimeout_ms = 3000\n\
         imap = {{ host = \"127.0.0.1\", port = {}, tls = \"none\", username = \"{IMAP_USER}\", password = {{ file = \"{}\" }}, delivery_grace_ms = 0 }}\n",
        proxy.addr.port(),
        mail.imap_port,
        secret.display()
    );
    let db = Db::new(Backend::Sqlite).await;
    let s = Server::start_with_config(&db.url, &config);
    let key = "INQ-004:confirmation:v1";
    let body = json!({"key": key, "action": "send_confirmation", "connector": "mail", "wait_ms": 8000,
                      "payload": {"to": "customer-42@example.org", "subject": "Your inquiry", "text": "Thank you."}});
    let t0 = s.post(ADMIN_KEY, "/v1/operations", &body).await;
    assert_eq!(t0.status, 202, "{t0:?}");
    assert_eq!(t0.body["state"], "UNKNOWN", "reply lost after DATA: {t0:?}");
    assert_eq!(proxy.cut_done.load(std::sync::atomic::Ordering::SeqCst), 1);
    let t1 = s.post(ADMIN_KEY, "/v1/operations", &body).await;
    assert_eq!(t1.status, 202, "the 09:02 re-run sends nothing: {t1:?}");
    let rec = s.wait_for(key, 20, |r| r["state"] == "SUCCEEDED").await;
    assert_eq!(rec["evidence_source"], "lookup");
    let message_id = rec["provider_ref"].as_str().unwrap().to_string();
    assert!(message_id.starts_with("<idem."), "{message_id}");
    let delivered = mail.delivered();
    assert_eq!(delivered.len(), 1, "exactly one message in the mailbox");
    assert!(delivered[0].contains(&message_id));
    assert_eq!(rec["attempt"], 1);
}

/// S5: the provider refuses (422) ⇒ FAILED with class validation; the retry is a replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s5_validation_failure_is_final_and_replayed() {
    let (provider, addr) = start_provider().await;
    let key = "INQ-005:confirmation:v1";
    provider.script(key, vec![Step::Status(422, None)]);
    let db = Db::new(Backend::Sqlite).await;
    let s = Server::start_with_config(&db.url, &orders_config(addr, ""));
    let t0 = s.post(ADMIN_KEY, "/v1/operations", &trigger(key, "orders", json!({"to": "bad"}), 5_000)).await;
    // idem performed it and it failed finally: 200 with idem's own marker, never 201
    // (which would tell a caller to perform it; issue 28 §1).
    assert_eq!((t0.status.as_u16(), t0.header("idem-performed-by")), (200, Some("connector")), "{t0:?}");
    assert_eq!(t0.header("idempotent-replayed"), None);
    assert_eq!(t0.body["state"], "FAILED");
    assert_eq!(t0.body["error"]["class"], "validation");
    let t1 = s.post(ADMIN_KEY, "/v1/operations", &trigger(key, "orders", json!({"to": "bad"}), 0)).await;
    assert_eq!(t1.status, 200);
    assert_eq!(t1.header("idempotent-replayed"), Some("true"));
    assert_eq!((provider.calls(key), provider.effects(key)), (1, 0), "no second call to the provider");
}

/// S6: 503 (Retry-After 1), 503, then success: three attempts, each logged with its class
/// and wait; Retry-After honoured; never more than max_attempts calls.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s6_retryable_failures_back_off_then_succeed() {
    let (provider, addr) = start_provider().await;
    let key = "INQ-006:confirmation:v1";
    provider.script(key, vec![Step::Status(503, Some(1)), Step::Status(503, None), Step::Ok]);
    let exhausted = "INQ-006b:confirmation:v1";
    provider.script(exhausted, vec![Step::Status(503, None); 10]);
    let db = Db::new(Backend::Postgres).await;
    let s = Server::start_with_config(&db.url, &orders_config(addr, ""));
    let t0 = s.post(ADMIN_KEY, "/v1/operations", &trigger(key, "orders", json!({"n": 1}), 2_000)).await;
    assert_eq!(t0.status, 202, "first attempt failed retryably: {t0:?}");
    let rec = s.wait_for(key, 15, |r| r["state"] == "SUCCEEDED").await;
    assert_eq!(rec["attempt"], 3);
    assert_eq!((provider.calls(key), provider.effects(key)), (3, 1));
    let done = events_of(&rec, "completed");
    assert_eq!(done.len(), 3);
    assert_eq!(
        (done[0]["error_class"].as_str(), done[1]["error_class"].as_str()),
        (Some("unavailable"), Some("unavailable"))
    );
    assert!(done[0]["wait_ms"].as_i64().unwrap() >= 1_000, "Retry-After: 1 is a floor: {}", done[0]);
    let grants = events_of(&rec, "acquired");
    assert!(at_ms(&grants[1]) - at_ms(&done[0]) >= 1_000, "the second attempt waited for Retry-After");

    s.post(ADMIN_KEY, "/v1/operations", &trigger(exhausted, "orders", json!({"n": 2}), 0)).await;
    let rec = s.wait_for(exhausted, 15, |r| r["state"] == "FAILED").await;
    assert_eq!(provider.calls(exhausted), 4, "at most max_attempts (4) calls");
    assert_eq!(rec["attempt"], 4);
}

/// The orders connector without its lookup line.
fn without_lookup(config: &str) -> String {
    config.lines().filter(|l| !l.starts_with("lookup")).collect::<Vec<_>>().join("\n")
}

/// Issue 11 item 2: the provider creates the order, then its gateway answers 504 (and the
/// neighbours 502, 500). That does not prove nothing happened: without a lookup the
/// operation is UNKNOWN and flagged for review at once, and never sent again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_5xx_after_the_provider_acted_is_unknown_and_reviewed_never_resent() {
    let (provider, addr) = start_provider().await;
    let db = Db::new(Backend::Sqlite).await;
    let s = Server::start_with_config(&db.url, &without_lookup(&orders_config(addr, "")));
    for status in [504, 502, 500] {
        let key = format!("ORD-{status}:create-order");
        provider.script(&key, vec![Step::EffectThenStatus(status), Step::Ok]);
        let t0 = s.post(ADMIN_KEY, "/v1/operations", &trigger(&key, "orders", json!({"sku": "A"}), 3_000)).await;
        assert_eq!((t0.status.as_u16(), t0.body["state"].as_str()), (202, Some("UNKNOWN")), "{status}: {t0:?}");
        let started = std::time::Instant::now();
        let rec = s.wait_for(&key, 10, |r| r["needs_review"] == true).await;
        assert!(started.elapsed() < Duration::from_secs(5), "{status}: flagged for review promptly");
        assert_eq!(rec["state"], "UNKNOWN", "{status}");
        assert!(rec["error"]["message"].as_str().unwrap().contains(&format!("HTTP {status}")), "{rec}");
        assert_eq!(events_of(&rec, "reconciled").len(), 1, "no lookup to ask: review at once");
        let again = s.post(ADMIN_KEY, "/v1/operations", &trigger(&key, "orders", json!({"sku": "A"}), 0)).await;
        assert_eq!(again.status, 202, "{status}: a re-trigger sends nothing: {again:?}");
        tokio::time::sleep(Duration::from_millis(300)).await; // the executor's poll runs meanwhile
        assert_eq!((provider.calls(&key), provider.effects(&key)), (1, 1), "{status}: exactly one order");
    }
}

/// The same answers with a lookup configured: the reconciler finds the order the 504 hid,
/// SUCCEEDED with evidence from the lookup, one order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_5xx_after_the_provider_acted_is_found_by_the_lookup() {
    let (provider, addr) = start_provider().await;
    let db = Db::new(Backend::Postgres).await;
    let s = Server::start_with_config(&db.url, &orders_config(addr, ""));
    for status in [504, 502, 500] {
        let key = format!("ORD-{status}:create-order");
        provider.script(&key, vec![Step::EffectThenStatus(status), Step::Ok]);
        s.post(ADMIN_KEY, "/v1/operations", &trigger(&key, "orders", json!({"sku": "B"}), 0)).await;
        let rec = s.wait_for(&key, 10, |r| r["state"] != "EXECUTING" && r["state"] != "UNKNOWN").await;
        assert_eq!(
            (rec["state"].as_str(), rec["evidence_source"].as_str()),
            (Some("SUCCEEDED"), Some("lookup")),
            "{rec}"
        );
        assert!(rec["provider_ref"].as_str().unwrap().starts_with("ord-"), "{rec}");
        assert_eq!(rec["attempt"], 1, "{status}");
        assert_eq!((provider.calls(&key), provider.effects(&key)), (1, 1), "{status}: exactly one order");
    }
    // A provider that answers 500 every time and never acts: each attempt ends UNKNOWN, the
    // lookup proves it absent, and the next attempt runs — but no more than max_attempts (4).
    let key = "ORD-500-always:create-order";
    provider.script(key, vec![Step::Status(500, None); 10]);
    s.post(ADMIN_KEY, "/v1/operations", &trigger(key, "orders", json!({}), 0)).await;
    let rec = s.wait_for(key, 20, |r| r["state"] == "FAILED").await;
    assert_eq!((provider.calls(key), provider.effects(key), rec["attempt"].as_i64()), (4, 0, Some(4)), "{rec}");
}

/// With `provider_deduplicates = true` (and a provider that does deduplicate by the
/// Idempotency-Key), the same answers, and a reply lost to a timeout, are retried: the
/// provider answers the retry with the first order. 503 and 429 are retried as before;
/// 501 proves nothing was done and is final.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_provider_that_deduplicates_is_retried_and_proven_statuses_keep_their_class() {
    let (provider, addr) = start_provider().await;
    provider.set_deduplicates(true);
    let db = Db::new(Backend::Sqlite).await;
    let config = without_lookup(&orders_config(addr, "")) + "\nprovider_deduplicates = true\n";
    let s = Server::start_with_config(&db.url, &config);
    let cases = [
        (Step::EffectThenStatus(504), "server_error"),
        (Step::EffectThenStatus(502), "server_error"),
        (Step::EffectThenStatus(500), "server_error"),
        (Step::EffectThenHang, "timeout"),
        (Step::Status(503, None), "unavailable"),
        (Step::Status(429, None), "rate_limited"),
    ];
    for (i, (first, class)) in cases.into_iter().enumerate() {
        let key = format!("DD-{i}:create-order");
        let created_first = matches!(first, Step::EffectThenStatus(_) | Step::EffectThenHang);
        provider.script(&key, vec![first.clone(), Step::Ok]);
        s.post(ADMIN_KEY, "/v1/operations", &trigger(&key, "orders", json!({"i": i}), 0)).await;
        let rec = s.wait_for(&key, 15, |r| r["state"] == "SUCCEEDED").await;
        assert_eq!(
            (rec["attempt"].as_i64(), rec["evidence_source"].as_str()),
            (Some(2), Some("connector")),
            "{first:?}"
        );
        assert_eq!(events_of(&rec, "completed")[0]["error_class"], class, "{first:?}: {rec}");
        assert_eq!(provider.calls(&key), 2, "{first:?}: retried once");
        assert_eq!(provider.effects(&key), 1, "{first:?}: one order");
        if created_first {
            assert_eq!(rec["provider_ref"], provider.order_ids(&key)[0], "the first order, answered again: {rec}");
        }
    }
    // Ambiguous to the last attempt: UNKNOWN (the provider may have acted), never FAILED.
    let key = "DD-504-always:create-order";
    provider.script(key, vec![Step::Status(504, None); 10]);
    s.post(ADMIN_KEY, "/v1/operations", &trigger(key, "orders", json!({}), 0)).await;
    let rec = s.wait_for(key, 15, |r| r["needs_review"] == true).await;
    assert_eq!((rec["state"].as_str(), rec["attempt"].as_i64()), (Some("UNKNOWN"), Some(4)), "{rec}");
    assert_eq!(provider.calls(key), 4, "max_attempts calls");

    let key = "DD-501:create-order";
    provider.script(key, vec![Step::Status(501, None), Step::Ok]);
    let r = s.post(ADMIN_KEY, "/v1/operations", &trigger(key, "orders", json!({}), 3_000)).await;
    assert_eq!((r.status.as_u16(), r.body["state"].as_str()), (200, Some("FAILED")), "{r:?}");
    assert_eq!(r.header("idem-performed-by"), Some("connector"));
    assert_eq!(r.body["error"]["class"], "server_error");
    assert_eq!(provider.calls(key), 1, "501: not retried");
}

/// C1: the server dies mid-attempt before the provider acted; after restart the lease
/// expires into UNKNOWN, the lookup proves absence, and the operation runs exactly once more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c1_crash_before_the_effect_is_redone_once_after_lookup_absent() {
    let (provider, addr) = start_provider().await;
    let key = "ORD-101:create-order";
    provider.script(key, vec![Step::Hang]);
    let db = Db::new(Backend::Sqlite).await;
    let config = orders_config(addr, "").replace("timeout_ms = 800", "timeout_ms = 1000") + "lease_ms = 1500\n";
    let s = Server::start_with_config(&db.url, &config);
    let t0 = s.post(ADMIN_KEY, "/v1/operations", &trigger(key, "orders", json!({"sku": "B"}), 200)).await;
    assert_eq!(t0.status, 202);
    while provider.calls(key) == 0 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let s = s.restart(); // kill -9 while the attempt is in flight, then a new process
    let rec = s.wait_for(key, 20, |r| r["state"] == "SUCCEEDED").await;
    assert_eq!(provider.effects(key), 1, "exactly one order");
    assert_eq!(provider.calls(key), 2);
    let reconciled = events_of(&rec, "reconciled");
    assert!(
        reconciled.iter().any(|e| e["reason"].as_str().unwrap().contains("proved the side effect absent")),
        "{reconciled:?}"
    );
    assert_eq!(rec["attempt"], 2);
}

/// C2: the provider created the order, the server died before recording it; after
/// restart the reconciler finds the order by the key: SUCCEEDED, no second create.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c2_crash_after_the_effect_is_found_not_redone() {
    let (provider, addr) = start_provider().await;
    let key = "ORD-102:create-order";
    provider.script(key, vec![Step::EffectThenHang]);
    let db = Db::new(Backend::Postgres).await;
    let config = orders_config(addr, "").replace("timeout_ms = 800", "timeout_ms = 1000") + "lease_ms = 1500\n";
    let s = Server::start_with_config(&db.url, &config);
    s.post(ADMIN_KEY, "/v1/operations", &trigger(key, "orders", json!({"sku": "C"}), 200)).await;
    while provider.effects(key) == 0 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let s = s.restart();
    let rec = s.wait_for(key, 20, |r| r["state"] == "SUCCEEDED").await;
    assert_eq!(rec["provider_ref"], "ord-1");
    assert_eq!(rec["evidence_source"], "lookup");
    assert_eq!((provider.calls(key), provider.effects(key)), (1, 1), "no second create");
}

/// The storm: the provider answers 503 for 10 s while 200 operations are due. The retry
/// budget (burst 20, 20/s) bounds the calls; all 200 succeed after recovery, once each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outage_does_not_become_a_retry_storm() {
    let (provider, addr) = start_provider().await;
    let db = Db::new(Backend::Sqlite).await;
    let config = orders_config(addr, ", budget_per_s = 20, budget_burst = 20")
        .replace("base_ms = 100, cap_ms = 400, max_attempts = 4", "base_ms = 100, cap_ms = 300, max_attempts = 1000");
    let s = Server::start_with_config(&db.url, &config);
    let outage = Duration::from_secs(10);
    provider.outage(outage);
    let started = std::time::Instant::now();
    for i in 0..200 {
        let r =
            s.post(ADMIN_KEY, "/v1/operations", &trigger(&format!("storm-{i}"), "orders", json!({"i": i}), 0)).await;
        assert!(r.status == 200 || r.status == 202, "{r:?}");
    }
    tokio::time::sleep(outage.saturating_sub(started.elapsed()) + Duration::from_millis(200)).await;
    let during = provider.outage_calls();
    let secs = started.elapsed().as_secs_f64();
    // 200 first attempts are not budgeted; retries are: burst + rate × time.
    let allowed = 200.0 + 20.0 + 20.0 * secs;
    assert!((during as f64) <= allowed, "{during} calls during the outage, budget allows {allowed:.0}");
    // Without a budget each operation would retry every 100-300 ms: thousands of calls.
    assert!(during >= 200, "every operation was tried once: {during}");
    let deadline = std::time::Instant::now() + Duration::from_secs(40);
    loop {
        let page = s.get(ADMIN_KEY, "/v1/operations?state=SUCCEEDED&limit=500").await.body;
        if page["items"].as_array().unwrap().len() == 200 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "not all recovered: {} succeeded",
            page["items"].as_array().unwrap().len()
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    assert_eq!(provider.total_effects(), 200, "each operation once");
}

/// Review: an UNKNOWN operation waits for an operator; a client key cannot resolve it;
/// SUCCEEDED needs evidence; the resolution is audited.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operators_resolve_reviewed_operations_with_a_reason() {
    let (provider, addr) = start_provider().await;
    let key = "INQ-009:confirmation:v1";
    provider.script(key, vec![Step::Hang]);
    let db = Db::new(Backend::Sqlite).await;
    // No lookup configured: nobody to ask, so it is flagged at the first reconciliation.
    let s = Server::start_with_config(&db.url, &without_lookup(&orders_config(addr, ", max_lookups = 2")));
    s.post(ADMIN_KEY, "/v1/operations", &trigger(key, "orders", json!({}), 2_000)).await;
    let rec = s.wait_for(key, 15, |r| r["needs_review"] == true).await;
    assert_eq!(rec["state"], "UNKNOWN");
    assert_eq!(events_of(&rec, "reconciled").len(), 1);
    let queue = s.get(ADMIN_KEY, "/v1/operations?needs_review=true").await.body;
    assert_eq!(queue["items"][0]["key"], key);

    // The same from the command line: reconcile now (still inconclusive), and a resolve
    // without evidence is a one-line error.
    let cli = |args: &[&str]| {
        std::process::Command::new(common::idem_bin())
            .args(args)
            .env("IDEM_URL", &s.base)
            .env("IDEM_API_KEY", ADMIN_KEY)
            .output()
            .unwrap()
    };
    let out = cli(&["ops", "reconcile", key, "--json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["state"], "UNKNOWN");
    assert_eq!(v["lookup_attempts"], 2);
    let out = cli(&["ops", "resolve", key, "--to", "succeeded", "--reason", "looked"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("evidence"));

    let path = format!("/v1/operations/{}/resolve", common::enc(key));
    let client = s.create_key("default", "client");
    let r = s.post(&client, &path, &json!({"to": "SUCCEEDED", "reason": "checked", "evidence": "ord-77"})).await;
    assert_eq!(r.status, 403);
    let r = s.post(ADMIN_KEY, &path, &json!({"to": "SUCCEEDED", "reason": "checked the order system"})).await;
    assert_eq!((r.status.as_u16(), r.problem()), (400, "invalid-request"), "SUCCEEDED needs evidence");
    let r = s.post(ADMIN_KEY, &path, &json!({"to": "SUCCEEDED", "reason": " ", "evidence": "ord-77"})).await;
    assert_eq!(r.status, 400, "a reason is mandatory");
    let r = s
        .post(
            ADMIN_KEY,
            &path,
            &json!({"to": "SUCCEEDED", "reason": "found it in the order system", "evidence": "ord-77"}),
        )
        .await;
    assert_eq!(r.status, 200, "{r:?}");
    let rec = s.record(key).await.body;
    assert_eq!(
        (rec["state"].as_str(), rec["evidence_source"].as_str(), rec["provider_ref"].as_str()),
        (Some("SUCCEEDED"), Some("operator"), Some("ord-77"))
    );
    assert_eq!(rec["needs_review"], false);
    let resolved = events_of(&rec, "resolved");
    assert_eq!(resolved[0]["principal"], "bootstrap");
    assert!(resolved[0]["reason"].as_str().unwrap().contains("found it in the order system"));
    let again = s.post(ADMIN_KEY, &path, &json!({"to": "FAILED", "reason": "oops"})).await;
    assert_eq!((again.status.as_u16(), again.problem()), (409, "not-resolvable"));
    assert_eq!(provider.effects(key), 0);
}

/// Bad configuration fails at start-up with a message naming the field; nothing listens.
#[test]
fn bad_config_fails_at_start_up_naming_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        ("[connectors.x]\nkind = \"ftp\"\n", "ftp"),
        ("[actions.send]\nconnector = \"mial\"\n", "actions.send.connector"),
        (
            "[connectors.mail]\nkind = \"smtp\"\nhost = \"h\"\nport = 25\nfrom = \"a@b.org\"\nusername = \"u\"\npassword = { env = \"IDEM_TEST_NO_SUCH_SECRET\" }\n",
            "connectors.mail.password",
        ),
        (
            "[connectors.orders]\nkind = \"http\"\nurl = \"http://127.0.0.1:1/o\"\nlookup = { url = \"http://127.0.0.1:1/o?r={client_ref}\", found_pointer = \"/0/id\" }\n",
            "connectors.orders.lookup.url",
        ),
    ];
    for (i, (toml, field)) in cases.iter().enumerate() {
        let path = dir.path().join(format!("bad{i}.toml"));
        std::fs::write(&path, toml).unwrap();
        let out = std::process::Command::new(common::idem_bin())
            .args(["serve", "--listen", "127.0.0.1:0", "--database-url"])
            .arg(dir.path().join(format!("db{i}.db")))
            .arg("--config")
            .arg(&path)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{toml}: {err}");
        assert!(err.contains(field), "{toml}: {err}");
        assert!(!String::from_utf8_lossy(&out.stdout).contains("listening"));
        assert_eq!(err.trim_end().lines().count(), 1, "one line: {err}");
    }
}

/// Regressions from a break-it session: a caller's short lease, a caller's completion of a
/// connector's operation, and a lookup whose answer lacks the reference must never lead
/// to a second side effect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_a_caller_or_a_bad_lookup_does_causes_a_second_effect() {
    let (provider, addr) = start_provider().await;
    let db = Db::new(Backend::Sqlite).await;
    let config = orders_config(addr, ", max_lookups = 2").replace("timeout_ms = 800", "timeout_ms = 3000");
    let s = Server::start_with_config(&db.url, &config);

    // A 100 ms lease asked by the caller is raised to the connector's lease.
    provider.script("short-lease", vec![Step::Slow(1_500), Step::Ok]);
    let mut t = trigger("short-lease", "orders", json!({}), 5_000);
    t["lease_ms"] = json!(100);
    let r = s.post(ADMIN_KEY, "/v1/operations", &t).await;
    assert_eq!((r.status.as_u16(), r.body["state"].as_str()), (200, Some("SUCCEEDED")), "{r:?}");
    assert_eq!(r.header("idem-performed-by"), Some("connector"));
    assert_eq!((provider.calls("short-lease"), provider.effects("short-lease")), (1, 1));

    // Callers cannot complete what idem's connector is performing.
    provider.script("owned", vec![Step::Slow(1_000)]);
    let r = s.post(ADMIN_KEY, "/v1/operations", &trigger("owned", "orders", json!({}), 0)).await;
    assert_eq!(r.status, 202);
    let c = s.complete("owned", json!({"fencing_token": 1, "outcome": "retryable_failure", "error_class": "x"})).await;
    assert_eq!((c.status.as_u16(), c.problem()), (409, "connector-owned"));
    s.wait_for("owned", 10, |r| r["state"] == "SUCCEEDED").await;
    assert_eq!(provider.effects("owned"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lookup_answer_without_the_reference_is_not_proof_of_absence() {
    let (provider, addr) = start_provider().await;
    let key = "misconfigured";
    provider.script(key, vec![Step::EffectThenHang, Step::Ok]);
    let db = Db::new(Backend::Sqlite).await;
    // The order exists, but the pointer names a field the provider does not return.
    let config = orders_config(addr, ", max_lookups = 2")
        .replace("found_pointer = \"/0/id\"", "found_pointer = \"/0/order_id\"");
    let s = Server::start_with_config(&db.url, &config);
    s.post(ADMIN_KEY, "/v1/operations", &trigger(key, "orders", json!({}), 2_000)).await;
    let rec = s.wait_for(key, 15, |r| r["needs_review"] == true).await;
    assert_eq!(rec["state"], "UNKNOWN");
    assert_eq!((provider.calls(key), provider.effects(key)), (1, 1), "never redone on a doubtful lookup");
}

/// One connector's outage (and its empty budget) does not hold back another's retries.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_connectors_outage_does_not_starve_another() {
    let (provider, addr) = start_provider().await;
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap(); // closed once dropped
    let config = orders_config(addr, "")
        + &format!(
            "\n[connectors.down]\nkind = \"http\"\nurl = \"http://{dead}/x\"\nconnect_timeout_ms = 200\n\
             retry = {{ base_ms = 1, cap_ms = 1, max_attempts = 1000000, budget_per_s = 0.01, budget_burst = 1 }}\n"
        );
    let db = Db::new(Backend::Sqlite).await;
    let s = Server::start_with_config(&db.url, &config);
    for i in 0..80 {
        s.post(ADMIN_KEY, "/v1/operations", &trigger(&format!("down-{i}"), "down", json!({}), 0)).await;
    }
    let key = "healthy";
    provider.script(key, vec![Step::Status(503, None), Step::Ok]);
    s.post(ADMIN_KEY, "/v1/operations", &trigger(key, "orders", json!({}), 0)).await;
    s.wait_for(key, 10, |r| r["state"] == "SUCCEEDED").await;
}

/// Callers re-triggering a failing connector operation draw on the retry budget too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn re_triggers_by_callers_draw_on_the_retry_budget() {
    let (provider, addr) = start_provider().await;
    let config = orders_config(addr, ", budget_per_s = 1, budget_burst = 2")
        .replace("base_ms = 100, cap_ms = 400, max_attempts = 4", "base_ms = 1, cap_ms = 1, max_attempts = 1000");
    let db = Db::new(Backend::Sqlite).await;
    let s = Server::start_with_config(&db.url, &config);
    let keys: Vec<String> = (0..10).map(|i| format!("loop-{i}")).collect();
    for k in &keys {
        provider.script(k, vec![Step::Status(503, None); 1000]);
    }
    let start = std::time::Instant::now();
    for _round in 0..15 {
        for k in &keys {
            s.post(ADMIN_KEY, "/v1/operations", &trigger(k, "orders", json!({}), 0)).await;
        }
    }
    let secs = start.elapsed().as_secs_f64();
    let calls = provider.total_calls() as f64;
    // 10 first attempts, then retries: burst 2 + 1/s (shared by the executor and callers).
    assert!(calls <= 10.0 + 2.0 + secs + 2.0, "{calls} calls in {secs:.1} s: the budget did not hold");
}

/// What a provider answers with is kept only as far as it can be read back: an answer
/// nested deeper than idem keeps (64 levels; serde_json reads 128), larger than 1 MiB, or
/// with a reference the ledger cannot keep as evidence is recorded as SUCCEEDED without its
/// body (or with the fallback reference) — and every read of the tenant keeps working:
/// the record, a replay, the list, the admin page and `idem ops list`. Found by a break-it
/// pass: a 2xx answer 127 levels deep made every read of the tenant a 500.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn provider_answers_of_any_shape_leave_every_read_working() {
    use axum::extract::Path;
    fn nested(depth: usize) -> Value {
        let mut v = json!(1);
        for _ in 0..depth {
            v = json!([v]);
        }
        v
    }
    let cases: Vec<(String, Value, bool)> = [1usize, 61, 62, 63, 64, 65, 126, 127, 128, 200]
        .iter()
        .map(|d| {
            // The body's depth with its wrapper object.
            let body = json!({"id": format!("deep-{d}"), "deep": nested(d.saturating_sub(1))});
            (format!("deep-{d}"), body, *d <= 63)
        })
        .chain([
            ("large".to_owned(), json!({"id": "large-1", "blob": "x".repeat(2 << 20)}), false),
            ("long-ref".to_owned(), json!({"id": "r".repeat(600)}), true),
            ("control-ref".to_owned(), json!({"id": "a\u{7}b"}), true),
        ])
        .collect();
    let answers: std::collections::HashMap<String, String> =
        cases.iter().map(|(k, b, _)| (k.clone(), b.to_string())).collect();
    let app = axum::Router::new().route(
        "/answer/{key}",
        axum::routing::post(move |Path(key): Path<String>| {
            let body = answers.get(&key).cloned().unwrap_or_default();
            async move { ([(axum::http::header::CONTENT_TYPE, "application/json")], body) }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let config = format!(
        "[connectors.answers]\nkind = \"http\"\nurl = \"http://{addr}/answer/{{key}}\"\ntimeout_ms = 5000\n\
         provider_ref = {{ json_pointer = \"/id\" }}\n"
    );
    let db = Db::new(Backend::Sqlite).await;
    let s = Server::start_with_config(&db.url, &config);
    for (key, _, kept) in &cases {
        let t = s.post(ADMIN_KEY, "/v1/operations", &trigger(key, "answers", json!({"k": key}), 8_000)).await;
        assert_eq!((t.status.as_u16(), t.body["state"].as_str()), (200, Some("SUCCEEDED")), "{key}: {t:?}");
        let rec = s.record(key).await;
        assert_eq!(rec.status, 200, "{key}: {rec:?}");
        let body = &rec.body["result"]["body"];
        assert_eq!(!body.is_null(), *kept, "{key}: {:?}", rec.body["result"]);
        if !kept {
            assert!(rec.body["result"]["body_omitted"].is_string(), "{key}: says why: {:?}", rec.body["result"]);
        }
        // The reference comes from the answer when serde_json can parse it (128 levels).
        let (_, answer, _) = cases.iter().find(|(k, _, _)| k == key).unwrap();
        let parses = answer.to_string().len() <= 1 << 20 && serde_json::from_str::<Value>(&answer.to_string()).is_ok();
        let expected_ref = match key.as_str() {
            "long-ref" | "control-ref" => format!("default:{key}"),
            k if parses => k.to_owned(),
            k => format!("default:{k}"),
        };
        assert_eq!(rec.body["provider_ref"], expected_ref.as_str(), "{key}");
        let replay = s.post(ADMIN_KEY, "/v1/operations", &trigger(key, "answers", json!({"k": key}), 0)).await;
        assert_eq!(replay.status, 200, "{key}: {replay:?}");
    }
    let list = s.get(ADMIN_KEY, "/v1/operations?limit=100").await;
    assert_eq!((list.status.as_u16(), list.body["items"].as_array().map(Vec::len)), (200, Some(cases.len())));
    let cookie = common::ui_session(&s, ADMIN_KEY).await;
    let page = s.http.get(s.url("/ui/operations")).header("cookie", &cookie).send().await.unwrap();
    assert_eq!(page.status(), 200);
    let cli = std::process::Command::new(common::idem_bin())
        .args(["ops", "list", "--limit", "100"])
        .env("IDEM_URL", &s.base)
        .env("IDEM_API_KEY", ADMIN_KEY)
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&cli.stdout);
    assert_eq!(cli.status.code(), Some(0), "{}", String::from_utf8_lossy(&cli.stderr));
    assert!(cases.iter().all(|(k, _, _)| out.contains(k.as_str())), "every record is listed: {out}");
}
