//! The relay inside `idem serve` (`[outbox] in_serve = true`): events delivered to a real
//! webhook receiver, `/metrics` (delivered / dead by sink, the lag, events by state), and
//! the admin page's `/ui/outbox` — dead letters shown to the outbox tenant's operators
//! only, redrive refused without a reason and audited with one.

mod common;

use common::{ADMIN_KEY, Backend, Db, Server, ui_session};
use idem::acceptance::receiver::Receiver;
use idem_core::outbox::NewEvent;
use serde_json::json;
use std::time::{Duration, Instant};

const SECRET: &str = "whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD";

async fn wait_state(store: &idem_outbox::store::OutboxStore, id: &str, state: &str) {
    let start = Instant::now();
    loop {
        if let Some((row, _)) = store.get(id).await.unwrap()
            && row.state == state
        {
            return;
        }
        assert!(start.elapsed() < Duration::from_secs(20), "{id} never became {state}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn form(fields: &[(&str, &str)]) -> String {
    reqwest::Url::parse_with_params("http://x/", fields).unwrap().query().unwrap().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_in_serve_shows_on_metrics_and_the_admin_page_and_operators_redrive_with_a_reason() {
    let app_url = idem_store::testing::fresh_pg_database("idem_app").await;
    idem_outbox::schema::install(&app_url).await.unwrap();
    let app = sqlx::PgPool::connect(&app_url).await.unwrap();
    let receiver = Receiver::start(&[SECRET], None).await;
    receiver.script("d1", &[400]);
    let dir = tempfile::tempdir().unwrap();
    let secret = dir.path().join("secret");
    std::fs::write(&secret, SECRET).unwrap();
    let config = format!(
        "[outbox]\ndatabase_url = \"{app_url}\"\nin_serve = true\npoll_interval_ms = 100\nlease_ms = 5000\n\
         [outbox.sinks.hooks]\nkind = \"webhook\"\nurl = \"{}\"\ntopics = [\"orders.*\"]\nsecrets = [{{ file = \"{}\" }}]\n\
         timeout_ms = 2000\n",
        receiver.url(),
        secret.display()
    );
    let db = Db::new(Backend::Sqlite).await;
    let s = Server::start_with_config(&db.url, &config);
    // Before any delivery the counters are there, at 0 (an alert's rate() needs them).
    let before = s.http.get(s.url("/metrics")).send().await.unwrap().text().await.unwrap();
    for line in ["idem_outbox_delivered_total{sink=\"hooks\"} 0", "idem_outbox_dead_total{sink=\"none\"} 0"] {
        assert!(before.lines().any(|l| l == line), "{line} in\n{before}");
    }
    let mut t = app.begin().await.unwrap();
    for id in ["d1", "ok1"] {
        let e = NewEvent {
            id: id.into(),
            aggregate_type: "order".into(),
            aggregate_id: id.into(),
            topic: "orders.created".into(),
            payload: json!({"id": id}),
            headers: Default::default(),
        };
        idem_outbox::append(&mut *t, &e).await.unwrap();
    }
    t.commit().await.unwrap();
    let store = idem_outbox::store::OutboxStore::Postgres(app.clone());
    wait_state(&store, "ok1", "DELIVERED").await;
    wait_state(&store, "d1", "DEAD").await;

    // /metrics: counters by sink, and the gauges (refreshed every 2 s).
    let start = Instant::now();
    let metrics = loop {
        let m = s.http.get(s.url("/metrics")).send().await.unwrap().text().await.unwrap();
        if m.contains("idem_outbox_events{state=\"DEAD\"} 1") || start.elapsed() > Duration::from_secs(10) {
            break m;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    for line in [
        "idem_outbox_delivered_total{sink=\"hooks\"} 1",
        "idem_outbox_dead_total{sink=\"hooks\"} 1",
        "idem_outbox_events{state=\"DEAD\"} 1",
        "idem_outbox_events{state=\"DELIVERED\"} 1",
        "idem_outbox_lag_ms 0",
    ] {
        assert!(metrics.lines().any(|l| l == line), "{line} in\n{metrics}");
    }

    // The admin page: the outbox tenant's operator sees the dead letter; a client key and
    // another tenant's operator do not.
    let http = reqwest::Client::builder().redirect(reqwest::redirect::Policy::none()).build().unwrap();
    let page = |cookie: String| {
        let http = http.clone();
        let url = s.url("/ui/outbox");
        async move { http.get(url).header("cookie", cookie).send().await.unwrap() }
    };
    let admin = ui_session(&s, ADMIN_KEY).await;
    let r = page(admin.clone()).await;
    assert_eq!(r.status(), 200);
    let html = r.text().await.unwrap();
    let dead_table = html.split("id=\"dead\"").nth(1).unwrap().split("</table>").next().unwrap();
    assert!(dead_table.contains("d1") && !dead_table.contains("ok1"), "{dead_table}");
    assert!(html.contains("id=\"lag\""));
    let client = ui_session(&s, &s.create_key("default", "client")).await;
    assert_eq!(page(client).await.status(), 403);
    let other = ui_session(&s, &s.create_key("acme", "operator")).await;
    assert_eq!(page(other).await.status(), 403);

    // Redrive: refused without a reason (nothing changes), done with one and audited.
    let csrf = html.split("name=\"csrf-token\" content=\"").nth(1).unwrap().split('"').next().unwrap().to_string();
    let post = |reason: &'static str| {
        let (http, url, cookie, csrf) = (http.clone(), s.url("/ui/outbox/d1/redrive"), admin.clone(), csrf.clone());
        async move {
            http.post(url)
                .header("cookie", cookie)
                .header("content-type", "application/x-www-form-urlencoded")
                .body(form(&[("csrf", &csrf), ("reason", reason)]))
                .send()
                .await
                .unwrap()
        }
    };
    let r = post("  ").await;
    assert_eq!(r.status(), 422);
    assert!(r.text().await.unwrap().contains("a reason is mandatory"));
    assert_eq!(store.get("d1").await.unwrap().unwrap().0.state, "DEAD");
    let r = post("the receiver accepts v2 payloads now").await;
    assert_eq!(r.status(), 303);
    wait_state(&store, "d1", "DELIVERED").await;
    let (_, trail) = store.get("d1").await.unwrap().unwrap();
    let redrive = trail.iter().find(|t| t.kind == "redrive").unwrap();
    assert_eq!(redrive.reason.as_deref(), Some("the receiver accepts v2 payloads now"));
    assert!(redrive.operator.as_deref().unwrap().starts_with("default/"), "{redrive:?}");
}
