//! The relay against real servers: PostgreSQL (the application's database), an HTTP
//! webhook receiver on loopback that verifies Standard Webhooks signatures with its own
//! code, and NATS JetStream (a stream of the test's own).

mod common;

use common::nats::TestStream;
use idem::acceptance::receiver::Receiver;
use idem_core::outbox::{NewEvent, OperatorAction};
use idem_outbox::relay::Relay;
use idem_outbox::relay::config::RelayConfig;
use serde_json::json;
use std::time::Duration;

const OLD_SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
const NEW_SECRET: &str = "whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD";

/// An application database with the idem schema; its URL and pool.
async fn app_db() -> (idem_store::testing::TestDatabase, sqlx::PgPool) {
    let url = idem_store::testing::fresh_pg_database("idem_app").await;
    idem_outbox::schema::install(&url).await.unwrap();
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    (url, pool)
}

async fn append(pool: &sqlx::PgPool, events: &[NewEvent]) {
    let mut t = pool.begin().await.unwrap();
    for e in events {
        idem_outbox::append(&mut *t, e).await.unwrap();
    }
    t.commit().await.unwrap();
}

fn event(id: &str, aggregate: &str, topic: &str) -> NewEvent {
    NewEvent {
        id: id.into(),
        aggregate_type: "order".into(),
        aggregate_id: aggregate.into(),
        topic: topic.into(),
        payload: json!({"id": id, "amount": 10}),
        headers: Default::default(),
    }
}

async fn relay(config: &str) -> Relay {
    let v: toml::Value = toml::from_str(config).unwrap();
    Relay::from_config(&RelayConfig::parse(v.get("outbox").unwrap()).unwrap()).await.unwrap()
}

/// Ticks until a pass claims nothing for 300 ms (at most 10 s).
async fn drain(r: &Relay) {
    let start = std::time::Instant::now();
    let mut idle_since = None;
    while start.elapsed() < Duration::from_secs(10) {
        if r.tick().await.unwrap().claimed == 0 {
            let since = *idle_since.get_or_insert_with(std::time::Instant::now);
            if since.elapsed() > Duration::from_millis(300) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        } else {
            idle_since = None;
        }
    }
    panic!("the relay never went idle");
}

fn secret_file(dir: &tempfile::TempDir, name: &str, secret: &str) -> String {
    let p = dir.path().join(name);
    std::fs::write(&p, format!("{secret}\n")).unwrap();
    p.display().to_string()
}

#[tokio::test]
async fn webhooks_are_signed_and_retried_or_dead_by_what_the_receiver_answers() {
    let (url, pool) = app_db().await;
    // The receiver already moved to the new secret; the relay signs with both (rotation).
    let receiver = Receiver::start(&[NEW_SECRET], None).await;
    let dir = tempfile::tempdir().unwrap();
    let (old, new) = (secret_file(&dir, "old", OLD_SECRET), secret_file(&dir, "new", NEW_SECRET));
    let r = relay(&format!(
        "[outbox]\ndatabase_url = \"{url}\"\nlease_ms = 5000\n\
         [outbox.sinks.hooks]\nkind = \"webhook\"\nurl = \"{}\"\ntopics = [\"orders.*\"]\n\
         secrets = [{{ file = \"{old}\" }}, {{ file = \"{new}\" }}]\ntimeout_ms = 2000\n\
         retry = {{ base_ms = 10, cap_ms = 40, max_attempts = 3 }}\n",
        receiver.url()
    ))
    .await;
    receiver.script("o1", &[503, 503]);
    receiver.script("o2", &[400]);
    receiver.script("o3", &[500, 503, 504]);
    let mut o5 = event("o5", "5", "orders.created");
    o5.headers.insert("x-trace".into(), "t-1".into());
    append(
        &pool,
        &[
            event("o1", "1", "orders.created"),
            event("o2", "2", "orders.created"),
            event("o3", "3", "orders.created"),
            event("o4", "4", "billing.created"),
            o5,
        ],
    )
    .await;
    drain(&r).await;
    let s = r.store();
    let state = |id: &'static str| async move {
        let (row, _) = s.get(id).await.unwrap().unwrap();
        (row.state, row.attempts, row.evidence, row.error_class)
    };
    assert_eq!(state("o1").await, ("DELIVERED".into(), 3, Some("HTTP 204".into()), None), "503 twice, then 204");
    assert_eq!(state("o2").await.0, "DEAD", "400 is refused for good");
    assert_eq!(state("o2").await.1, 1);
    assert_eq!(state("o3").await, ("DEAD".into(), 3, None, Some("server_error".into())), "out of attempts");
    assert_eq!(state("o4").await.3.as_deref(), Some("no_sink"));
    let o4 = s.get("o4").await.unwrap().unwrap().0.error_message.unwrap_or_default();
    assert!(o4.starts_with("no sink of this relay takes topic") && !o4.contains("receiver"), "{o4}");
    assert_eq!(state("o5").await.0, "DELIVERED");
    let arrivals = receiver.arrivals();
    assert!(arrivals.iter().all(|a| a.verified), "every signature verified with the new secret alone");
    let count = |id: &str| arrivals.iter().filter(|a| a.id == id).count();
    assert_eq!((count("o1"), count("o2"), count("o3"), count("o4"), count("o5")), (3, 1, 3, 0, 1));
    let o1 = arrivals.iter().find(|a| a.id == "o1").unwrap();
    assert_eq!(serde_json::from_slice::<serde_json::Value>(&o1.body).unwrap(), json!({"id": "o1", "amount": 10}));
    let now_s = jiff::Timestamp::now().as_second();
    assert!((o1.timestamp - now_s).abs() < 30, "webhook-timestamp is now, in seconds");

    // An operator redrives o2 (the receiver is fixed now): one manual attempt, delivered.
    let reason = "receiver deployed the fix";
    assert!(s.operator_action("o2", OperatorAction::Redrive, reason, "alice").await.unwrap().is_ok());
    drain(&r).await;
    assert_eq!(state("o2").await.0, "DELIVERED");
    let (_, trail) = s.get("o2").await.unwrap().unwrap();
    assert!(trail.iter().any(|t| t.kind == "redrive" && t.operator.as_deref() == Some("alice")));
    assert_eq!(trail.last().unwrap().trigger.as_deref(), Some("manual"));
}

#[tokio::test]
async fn a_receiver_with_the_wrong_secret_refuses_and_the_event_goes_dead_not_lost() {
    let (url, pool) = app_db().await;
    let receiver = Receiver::start(&[NEW_SECRET], None).await;
    let dir = tempfile::tempdir().unwrap();
    let old = secret_file(&dir, "old", OLD_SECRET);
    let r = relay(&format!(
        "[outbox]\ndatabase_url = \"{url}\"\nlease_ms = 5000\n[outbox.sinks.hooks]\nkind = \"webhook\"\n\
         url = \"{}\"\ntopics = [\">\"]\nsecrets = [{{ file = \"{old}\" }}]\ntimeout_ms = 2000\n",
        receiver.url()
    ))
    .await;
    append(&pool, &[event("w1", "1", "orders.created")]).await;
    drain(&r).await;
    let (row, _) = r.store().get("w1").await.unwrap().unwrap();
    assert_eq!((row.state.as_str(), row.error_class.as_deref()), ("DEAD", Some("auth")), "401: dead, kept for review");
    assert!(!receiver.arrivals()[0].verified);
}

#[tokio::test]
async fn nats_publishes_carry_the_event_id_and_a_duplicate_ack_counts_as_delivered() {
    let (url, pool) = app_db().await;
    let stream = TestStream::create(Duration::from_secs(120)).await;
    let r = relay(&format!(
        "[outbox]\ndatabase_url = \"{url}\"\nlease_ms = 5000\n[outbox.sinks.bus]\nkind = \"nats\"\n\
         url = \"{}\"\ntopics = [\"orders.>\"]\nsubject_prefix = \"{}.\"\ntimeout_ms = 2000\n",
        common::nats::NATS_URL,
        stream.prefix
    ))
    .await;
    append(
        &pool,
        &[event("n1", "A", "orders.created"), event("n2", "A", "orders.paid"), event("n3", "B", "orders.created")],
    )
    .await;
    drain(&r).await;
    assert_eq!(stream.messages().await, 3);
    let mut seen = Vec::new();
    for seq in 1..=3 {
        let (id, payload) = stream.message(seq).await;
        assert_eq!(serde_json::from_slice::<serde_json::Value>(&payload).unwrap()["id"], json!(id));
        seen.push(id);
    }
    assert!(
        seen.iter().position(|i| i == "n1") < seen.iter().position(|i| i == "n2"),
        "aggregate A in order: {seen:?}"
    );
    let (n1, _) = r.store().get("n1").await.unwrap().unwrap();
    let evidence = n1.evidence.unwrap();
    assert!(evidence.starts_with(&format!("{}:", stream.name)), "{evidence}");

    // A relay that published and died before recording: the event is claimed again and
    // published again; the stream answers "duplicate" with the first sequence.
    sqlx::query("UPDATE idem.outbox SET state = 'PENDING', evidence = NULL WHERE id = 'n1'")
        .execute(&pool)
        .await
        .unwrap();
    drain(&r).await;
    let (again, _) = r.store().get("n1").await.unwrap().unwrap();
    assert_eq!(again.state, "DELIVERED");
    assert_eq!(again.evidence.unwrap(), format!("{evidence} (duplicate)"));
    assert_eq!(stream.messages().await, 3, "stored once");
    stream.delete().await;
}
