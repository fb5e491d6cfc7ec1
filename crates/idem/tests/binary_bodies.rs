//! Issue 28 §8: an error body that is not text (gzip, UTF-16, any body with a zero byte)
//! from a webhook receiver or a connector's provider. The relay kept the body's start as
//! the attempt's error and wrote the pass's outcomes in one statement, which PostgreSQL
//! refused: every outcome of the pass was lost, delivered events were delivered again
//! every lease, and an event answered 400 looped instead of going dead. Now what a
//! receiver sends is kept as escaped text, and no row's outcome can cost the others theirs.

mod common;

use axum::body::Bytes;
use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use common::{Server, orders_config};
use idem_core::outbox::NewEvent;
use serde_json::json;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The start of a gzip stream (magic, deflate, a zero byte, invalid UTF-8).
const GZIP: &[u8] = &[0x1f, 0x8b, 0x08, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x03, 0xcb, 0x48, 0xcd, 0xc9];
/// "error" in UTF-16LE: every other byte is zero.
const UTF16: &[u8] = b"e\0r\0r\0o\0r\0";

/// A server on loopback that answers each request by a name taken from it (the
/// `webhook-id` header, or the JSON body's `name`): a status and a body given per name,
/// 200 `{"id": …}` for names it does not know. Counts requests per name.
#[derive(Clone, Default)]
struct Answers {
    script: Arc<Mutex<Vec<(String, u16, &'static [u8])>>>,
    seen: Arc<Mutex<Vec<String>>>,
}

impl Answers {
    async fn start(script: &[(&str, u16, &'static [u8])]) -> (Answers, std::net::SocketAddr) {
        let a = Answers {
            script: Arc::new(Mutex::new(script.iter().map(|(n, s, b)| (n.to_string(), *s, *b)).collect())),
            ..Answers::default()
        };
        let me = a.clone();
        let app = axum::Router::new().fallback(move |headers: HeaderMap, body: Bytes| {
            let me = me.clone();
            async move {
                let name =
                    headers.get("webhook-id").and_then(|v| v.to_str().ok()).map(str::to_owned).unwrap_or_else(|| {
                        serde_json::from_slice::<serde_json::Value>(&body)
                            .ok()
                            .and_then(|v| v["name"].as_str().map(str::to_owned))
                            .unwrap_or_default()
                    });
                me.seen.lock().unwrap().push(name.clone());
                let answer = me.script.lock().unwrap().iter().find(|(n, _, _)| *n == name).map(|(_, s, b)| (*s, *b));
                match answer {
                    Some((status, body)) => (StatusCode::from_u16(status).unwrap(), body.to_vec()).into_response(),
                    None => axum::Json(json!({"id": format!("ord-{name}")})).into_response(),
                }
            }
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        (a, addr)
    }

    fn count(&self, name: &str) -> usize {
        self.seen.lock().unwrap().iter().filter(|n| *n == name).count()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receivers_binary_error_body_costs_no_other_event_its_outcome() {
    let app = idem_store::testing::fresh_pg_database("idem_binary_app").await;
    idem_outbox::schema::install(&app.url).await.unwrap();
    let pool = sqlx::PgPool::connect(&app.url).await.unwrap();
    let (receiver, addr) =
        Answers::start(&[("gz-400", 400, GZIP), ("u16-500", 500, UTF16), ("nul-503", 503, b"busy\0\0")]).await;
    let v: toml::Value = toml::from_str(&format!(
        "[outbox]\ndatabase_url = \"{}\"\nlease_ms = 5000\n[outbox.sinks.hooks]\nkind = \"webhook\"\n\
         url = \"http://{addr}/hooks\"\ntopics = [\"orders.*\"]\nsecrets = [{{ env = \"BINARY_SECRET\" }}]\n\
         timeout_ms = 2000\nretry = {{ base_ms = 60000, cap_ms = 60000, max_attempts = 5 }}\n",
        app.url
    ))
    .unwrap();
    // SAFETY: set before any thread of this test reads the environment.
    unsafe { std::env::set_var("BINARY_SECRET", "whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD") };
    let config = idem_outbox::relay::config::RelayConfig::parse(v.get("outbox").unwrap()).unwrap();
    let relay = idem_outbox::relay::Relay::from_config(&config).await.unwrap();
    let mut t = pool.begin().await.unwrap();
    for (i, id) in ["ok-1", "gz-400", "ok-2", "u16-500", "nul-503", "ok-3"].iter().enumerate() {
        let e = NewEvent {
            id: (*id).into(),
            aggregate_type: "order".into(),
            aggregate_id: format!("a{i}"),
            topic: "orders.created".into(),
            payload: json!({"n": i}),
            headers: Default::default(),
        };
        idem_outbox::append(&mut *t, &e).await.unwrap();
    }
    t.commit().await.unwrap();

    // One pass claims all six and records all six outcomes.
    let report = relay.tick().await.expect("the pass is recorded");
    assert_eq!((report.claimed, report.delivered, report.dead, report.retried), (6, 3, 1, 2), "{report:?}");
    assert_eq!(report.unrecorded, 0, "{report:?}");
    let store = relay.store();
    let row = |id: &'static str| async move { store.get(id).await.unwrap().unwrap() };
    for id in ["ok-1", "ok-2", "ok-3"] {
        assert_eq!(row(id).await.0.state, "DELIVERED", "{id}");
    }
    let (gz, attempts) = row("gz-400").await;
    assert_eq!((gz.state.as_str(), gz.attempts), ("DEAD", 1), "400 goes dead at once");
    assert_eq!(attempts.iter().filter(|a| a.kind == "attempt").count(), 1, "{attempts:?}");
    let message = gz.error_message.unwrap();
    assert!(
        message
            == "refused by the receiver: HTTP 400 Bad Request: a binary body (gzip), starting 1f 8b 08 00 00 00 00 00 00 03 cb 48 cd c9",
        "{message}"
    );
    let (u16, _) = row("u16-500").await;
    assert_eq!(u16.state, "PENDING");
    assert_eq!(u16.error_message.unwrap(), "HTTP 500 Internal Server Error: UTF-16 text: error");
    assert!(row("nul-503").await.0.error_message.unwrap().ends_with("a binary body, starting 62 75 73 79 00 00"));

    // Nothing is delivered twice: the next passes find nothing due.
    assert_eq!(relay.tick().await.unwrap().claimed, 0);
    for id in ["ok-1", "ok-2", "ok-3", "gz-400", "u16-500", "nul-503"] {
        assert_eq!(receiver.count(id), 1, "{id}");
    }
}

/// The connectors' side: a provider's binary error body is kept as escaped text, and what
/// it proves decides the state — 400 is FAILED (not UNKNOWN after a refused completion),
/// 503 is a retry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_providers_binary_error_body_keeps_the_operations_answer() {
    let ledger = idem_store::testing::fresh_pg_database("idem_binary").await;
    let (provider, addr) = Answers::start(&[("gz", 400, GZIP), ("u16", 503, UTF16)]).await;
    let s = Server::start_with_config(&ledger.url, &orders_config(addr, ""));
    let trigger = |key: &str, name: &str| json!({"key": key, "action": "create_order", "connector": "orders", "payload": {"name": name}, "wait_ms": 3000});
    let r = s.post(common::ADMIN_KEY, "/v1/operations", &trigger("B-1:create", "gz")).await;
    assert_eq!((r.status.as_u16(), r.body["state"].as_str()), (200, Some("FAILED")), "{r:?}");
    let message = r.body["error"]["message"].as_str().unwrap();
    assert_eq!(
        message,
        "HTTP 400 Bad Request: a binary body (gzip), starting 1f 8b 08 00 00 00 00 00 00 03 cb 48 cd c9"
    );
    let r = s.post(common::ADMIN_KEY, "/v1/operations", &trigger("B-2:create", "u16")).await;
    assert_eq!(r.status.as_u16(), 202, "{r:?}");
    let rec = s.wait_for("B-2:create", 10, |r| r["attempt"].as_i64() >= Some(2)).await;
    assert!(rec["error"]["message"].as_str().unwrap().ends_with("UTF-16 text: error"), "{rec}");
    assert_ne!(rec["state"], "UNKNOWN", "{rec}");
    assert!(provider.count("u16") >= 2);
    tokio::time::sleep(Duration::from_millis(50)).await;
}
