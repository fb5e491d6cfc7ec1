//! The NATS JetStream connector against the local NATS server, through `idem serve`:
//! S1-style replay (one message, the evidence is stream:sequence), a lost PubAck (a fault
//! proxy drops the server's answer after the publish) → UNKNOWN → settled by re-publishing
//! with the same Nats-Msg-Id inside the duplicate window (the server answers "duplicate"
//! with the original sequence), the same outside the window → review, never a second
//! message; and configuration errors that name the field.

mod common;

use common::nats::{NATS_URL, TestStream};
use common::proxy::FaultProxy;
use common::{ADMIN_KEY, Backend, Db, Server};
use serde_json::{Value, json};
use std::time::Duration;

fn config(nats: &str, stream: &TestStream, extra: &str) -> String {
    format!(
        "[executor]\npoll_interval_ms = 50\n[reconciler]\ninterval_ms = 100\n\
         [connectors.events]\nkind = \"nats\"\nurl = \"{nats}\"\nsubject = \"{}.orders.created\"\nstream = \"{}\"\n\
         timeout_ms = 1000\nretry = {{ base_ms = 50, cap_ms = 200, max_attempts = 3, max_lookups = 1 }}\n{extra}",
        stream.prefix, stream.name
    )
}

fn trigger(key: &str, payload: Value) -> Value {
    json!({"key": key, "action": "publish_order", "connector": "events", "payload": payload, "wait_ms": 5000})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publish_is_replayed_not_repeated_and_its_evidence_is_stream_and_sequence() {
    let stream = TestStream::create(Duration::from_secs(120)).await;
    let db = Db::new(Backend::Sqlite).await;
    let s = Server::start_with_config(&db.url, &config(NATS_URL, &stream, ""));
    let first = s.post(ADMIN_KEY, "/v1/operations", &trigger("ORD-1:publish", json!({"order": 1}))).await;
    assert_eq!((first.status.as_u16(), first.body["state"].as_str()), (200, Some("SUCCEEDED")), "{first:?}");
    assert_eq!(first.header("idem-performed-by"), Some("connector"));
    assert_eq!(first.body["provider_ref"], json!(format!("{}:1", stream.name)));
    let again = s.post(ADMIN_KEY, "/v1/operations", &trigger("ORD-1:publish", json!({"order": 1}))).await;
    assert_eq!((again.status.as_u16(), again.header("idempotent-replayed")), (200, Some("true")));
    assert_eq!(stream.messages().await, 1);
    let (msg_id, payload) = stream.message(1).await;
    assert_eq!(msg_id, "default:ORD-1:publish", "Nats-Msg-Id = the operation's key (tenant-scoped)");
    assert_eq!(serde_json::from_slice::<Value>(&payload).unwrap(), json!({"order": 1}));
    stream.delete().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_puback_is_unknown_then_settled_as_a_duplicate_with_the_original_sequence() {
    let stream = TestStream::create(Duration::from_secs(120)).await;
    // The first connection loses the server's answer to the publish (the payload's marker).
    let proxy = FaultProxy::start("127.0.0.1:4222".parse().unwrap(), b"lose-the-ack", 1).await;
    let db = Db::new(Backend::Postgres).await;
    let s = Server::start_with_config(&db.url, &config(&format!("nats://{}", proxy.addr), &stream, ""));
    let key = "ORD-2:publish";
    let t = s.post(ADMIN_KEY, "/v1/operations", &trigger(key, json!({"order": 2, "marker": "lose-the-ack"}))).await;
    assert_eq!(t.body["state"], "UNKNOWN", "no PubAck: it may be stored: {t:?}");
    let rec = s.wait_for(key, 20, |r| r["state"] == "SUCCEEDED").await;
    assert_eq!(proxy.cut_done.load(std::sync::atomic::Ordering::SeqCst), 1, "the PubAck was dropped");
    assert_eq!(rec["evidence_source"], "lookup");
    assert_eq!(rec["provider_ref"], json!(format!("{}:1", stream.name)), "the original sequence: {rec}");
    assert_eq!(stream.messages().await, 1, "stored once");
    assert_eq!(rec["attempt"], 1);
    stream.delete().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outside_the_duplicate_window_a_lost_puback_goes_to_review_and_nothing_is_published_again() {
    // A 2 s window, shorter than the connector's lease (timeout + 10 s): a re-publish
    // could no longer be recognised as a duplicate.
    let stream = TestStream::create(Duration::from_secs(2)).await;
    let proxy = FaultProxy::start("127.0.0.1:4222".parse().unwrap(), b"lose-the-ack", 1).await;
    let db = Db::new(Backend::Sqlite).await;
    let s = Server::start_with_config(&db.url, &config(&format!("nats://{}", proxy.addr), &stream, ""));
    let key = "ORD-3:publish";
    s.post(ADMIN_KEY, "/v1/operations", &trigger(key, json!({"order": 3, "marker": "lose-the-ack"}))).await;
    let rec = s.wait_for(key, 20, |r| r["needs_review"] == true).await;
    assert_eq!(rec["state"], "UNKNOWN");
    let reconciled: Vec<&Value> =
        rec["events"].as_array().unwrap().iter().filter(|e| e["kind"] == "reconciled").collect();
    assert!(reconciled[0]["reason"].as_str().unwrap_or_default().contains("outside stream"), "{rec}");
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(stream.messages().await, 1, "never published a second time");
    stream.delete().await;
}

#[tokio::test]
async fn nats_connector_configuration_errors_name_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let db = Db::new(Backend::Sqlite).await;
    let base = "[connectors.events]\nkind = \"nats\"\nurl = \"nats://127.0.0.1:4222\"\nsubject = \"orders.created\"\n";
    for (config, expected) in [
        (base.to_owned(), "missing field `stream`"),
        (format!("{base}stream = \"\"\n"), "connectors.events.stream: name the JetStream stream"),
        (format!("{base}stream = \"S\"\ntimeout_ms = 9000\nlease_ms = 5000\n"), "connectors.events.lease_ms"),
        (base.replace("orders.created", "orders.*") + "stream = \"S\"\n", "connectors.events.subject"),
        (base.replace("nats://", "http://") + "stream = \"S\"\n", "connectors.events.url"),
    ] {
        let path = dir.path().join("idem.toml");
        std::fs::write(&path, config).unwrap();
        let out = std::process::Command::new(common::idem_bin())
            .args(["serve", "--listen", "127.0.0.1:0", "--database-url", &db.url, "--config"])
            .arg(&path)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{err}");
        assert!(err.contains(expected), "{expected}: {err}");
    }
}
