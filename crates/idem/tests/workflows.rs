//! Workflows against real servers (issue 12, seed 003's pre-launch checks): a three-step
//! declared workflow — create an order over HTTP (the provider double), send the
//! confirmation over SMTP (aiosmtpd, found again over IMAP in Dovecot), write the result
//! back over HTTP — killed with kill -9 before and after every external call, started ten
//! times at once, on two PostgreSQL nodes, with a lost reply; and the code-driven mode with
//! a worker killed between steps. Every effect is counted at the provider or in the mailbox.

mod common;

use common::mail::{IMAP_PASSWORD, IMAP_USER, MailServers};
use common::{ADMIN_KEY, Backend, Db, Resp, Server, enc, instance, start_provider, ui_session, wait_instance};
use idem::acceptance::provider::{Provider, Step};
use serde_json::{Value, json};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// The three-step workflow, with short timeouts and leases so crashes settle in seconds.
fn config(orders: SocketAddr, mail: &MailServers, secret: &std::path::Path) -> String {
    format!(
        r#"[executor]
poll_interval_ms = 50
workflow_hold_ms = 1000
[reconciler]
interval_ms = 100

[connectors.orders]
kind = "http"
url = "http://{orders}/orders"
timeout_ms = 800
connect_timeout_ms = 300
lease_ms = 1500
provider_ref = {{ json_pointer = "/id" }}
lookup = {{ url = "http://{orders}/orders?client_reference={{idempotency_key}}", found_pointer = "/0/id", absent_after_ms = 200 }}
retry = {{ base_ms = 100, cap_ms = 400, max_attempts = 4 }}

[connectors.mail]
kind = "smtp"
host = "127.0.0.1"
port = {smtp}
tls = "none"
from = "orders@example.org"
timeout_ms = 300
lease_ms = 2500
imap = {{ host = "127.0.0.1", port = {imap}, tls = "none", username = "{IMAP_USER}", password = {{ file = "{secret}" }}, delivery_grace_ms = 0 }}

[workflows.order-intake]
steps = [
  {{ name = "create_order", connector = "orders", input = {{ customer = {{ from = "/input/customer" }}, sku = {{ from = "/input/sku" }} }} }},
  {{ name = "send_confirmation", connector = "mail", input = {{ to = {{ from = "/input/email" }}, subject = "Your order", text = {{ from = "/steps/create_order/provider_ref" }} }} }},
  {{ name = "write_back", connector = "orders", input = {{ order = {{ from = "/steps/create_order/provider_ref" }}, instance = {{ from = "/instance/id" }} }} }},
]
"#,
        smtp = mail.smtp_port,
        imap = mail.imap_port,
        secret = secret.display(),
    )
}

/// Real mail servers, the provider double, and the config text for both.
struct World {
    provider: Provider,
    mail: MailServers,
    config: String,
    _dir: tempfile::TempDir,
}

async fn world() -> World {
    let (provider, addr) = start_provider().await;
    let mail = MailServers::start();
    let dir = tempfile::tempdir().unwrap();
    let secret = dir.path().join("imap-password");
    std::fs::write(&secret, IMAP_PASSWORD).unwrap();
    let config = config(addr, &mail, &secret);
    World { provider, mail, config, _dir: dir }
}

fn start_body(id: &str) -> Value {
    json!({"workflow": "order-intake", "instance_id": id, "source_event": format!("evt-{id}"),
           "input": {"customer": "C-1", "sku": "A-7", "email": "customer-1@example.org"}})
}

async fn start(s: &Server, id: &str) -> Resp {
    s.post(ADMIN_KEY, "/v1/workflows", &start_body(id)).await
}

/// Each step of instance `id` had its effect exactly once: one order for each HTTP step at
/// the provider, one message for the mail step in the mailbox (found by its Message-ID).
fn assert_effects_once(w: &World, v: &Value, id: &str) {
    assert_eq!(v["state"], "SUCCEEDED", "{v:#}");
    for step in ["create_order", "write_back"] {
        assert_eq!(w.provider.effects(&format!("{id}:{step}")), 1, "{id}:{step}: one order at the provider");
    }
    let message_id = v["steps"][1]["provider_ref"].as_str().unwrap();
    let copies = w.mail.delivered().iter().filter(|m| m.contains(message_id)).count();
    assert_eq!(copies, 1, "{id}: exactly one confirmation e-mail ({message_id})");
}

/// Seed 003 check 1: kill -9 before and after every external call, and right after each
/// step's outcome is recorded; after a restart every instance finishes with each effect
/// exactly once.
async fn kill_9_at_every_step_boundary(b: Backend) {
    let w = world().await;
    let db = Db::new(b).await;
    let mut s = Server::start_with_config(&db.url, &w.config);
    let points = ["executor.before_call", "executor.after_call", "flow.after_step"];
    let steps = ["create_order", "send_confirmation", "write_back"];
    for (i, (point, step)) in points.iter().flat_map(|p| steps.iter().map(move |s| (p, s))).enumerate() {
        let id = format!("ORD-{i}:{}", point.replace('.', "-"));
        let crash_at = format!("{point}@{id}:{step}");
        drop(s);
        let crashing = Server::start_with_config_env(&db.url, &w.config, &[("IDEM_TEST_CRASH_AT", &crash_at)]);
        assert_eq!(start(&crashing, &id).await.status, 201);
        // The process aborts at the crash point; wait until it is gone.
        let deadline = Instant::now() + Duration::from_secs(20);
        while crashing.http.get(crashing.url("/healthz")).send().await.is_ok() {
            assert!(Instant::now() < deadline, "{crash_at}: the server never reached its crash point");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        drop(crashing);
        s = Server::start_with_config(&db.url, &w.config);
        let v = wait_instance(&s, &id, 30, |v| v["state"] != "RUNNING").await;
        assert_effects_once(&w, &v, &id);
        eprintln!("kill -9 at {crash_at}: finished, each effect once");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_kill_9_at_every_step_boundary() {
    kill_9_at_every_step_boundary(Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_kill_9_at_every_step_boundary() {
    kill_9_at_every_step_boundary(Backend::Postgres).await;
}

/// Seed 003 check 2: the same source event delivered twice, and ten times at once, starts
/// one instance and one set of effects; another input under the same id is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_start_ten_times_at_once_is_one_instance() {
    let w = world().await;
    let db = Db::new(Backend::Sqlite).await;
    let s = Server::start_with_config(&db.url, &w.config);
    let starts: Vec<_> = (0..10)
        .map(|_| {
            let (http, url) = (s.http.clone(), s.url("/v1/workflows"));
            tokio::spawn(async move {
                http.post(url).bearer_auth(ADMIN_KEY).json(&start_body("ORD-10")).send().await.unwrap().status()
            })
        })
        .collect();
    let mut codes = Vec::new();
    for t in starts {
        codes.push(t.await.unwrap().as_u16());
    }
    codes.sort();
    assert_eq!(codes, [200, 200, 200, 200, 200, 200, 200, 200, 200, 201], "one start created it");
    let v = wait_instance(&s, "ORD-10", 20, |v| v["state"] != "RUNNING").await;
    assert_effects_once(&w, &v, "ORD-10");
    let again = start(&s, "ORD-10").await;
    assert_eq!((again.status.as_u16(), again.header("idempotent-replayed")), (200, Some("true")));
    assert_eq!(again.body["state"], "SUCCEEDED", "the second delivery gets the instance's state");
    let mut other = start_body("ORD-10");
    other["input"]["sku"] = json!("B-9");
    let refused = s.post(ADMIN_KEY, "/v1/workflows", &other).await;
    assert_eq!((refused.status.as_u16(), refused.problem()), (422, "instance-mismatch"));
    let kinds: Vec<_> = instance(&s, "ORD-10").await["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["kind"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(kinds.iter().filter(|k| *k == "started").count(), 1, "{kinds:?}");
    assert_eq!(kinds.iter().filter(|k| *k == "start_mismatch").count(), 1, "{kinds:?}");
    assert_effects_once(&w, &instance(&s, "ORD-10").await, "ORD-10");
}

/// Seed 003 check 3: identical jobs started at once on two PostgreSQL nodes: one set of
/// effects per instance.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_postgres_nodes_start_the_same_jobs_one_set_of_effects() {
    let w = world().await;
    let db = Db::new(Backend::Postgres).await;
    let a = Server::start_with_config(&db.url, &w.config);
    let b = Server::start_with_config(&db.url, &w.config);
    let ids: Vec<String> = (0..8).map(|i| format!("ORD-2N-{i}")).collect();
    let mut tasks = Vec::new();
    for id in &ids {
        for node in [&a, &b] {
            let (http, url, body) = (node.http.clone(), node.url("/v1/workflows"), start_body(id));
            tasks.push(tokio::spawn(async move {
                http.post(url).bearer_auth(ADMIN_KEY).json(&body).send().await.unwrap().status().as_u16()
            }));
        }
    }
    let mut created = 0;
    for t in tasks {
        let code = t.await.unwrap();
        assert!(code == 200 || code == 201, "{code}");
        created += usize::from(code == 201);
    }
    assert_eq!(created, ids.len(), "each instance created once over both nodes");
    for id in &ids {
        let v = wait_instance(&a, id, 30, |v| v["state"] != "RUNNING").await;
        assert_effects_once(&w, &v, id);
        assert_eq!(instance(&b, id).await["state"], "SUCCEEDED", "both nodes see it");
    }
}

/// Seed 003 check 4: the provider completes a step but the reply is lost ⇒ the step is
/// UNKNOWN, the lookup finds it, the workflow continues without a redo. Under `manual`, the
/// instance pauses instead, the step waits in the review queue, and an operator's
/// resolution lets the instance finish.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_reply_is_looked_up_or_waits_for_a_person() {
    let w = world().await;
    let db = Db::new(Backend::Sqlite).await;
    let manual = w.config.replace(
        r#"{ name = "write_back", connector = "orders","#,
        r#"{ name = "write_back", connector = "orders", policy = "manual","#,
    );
    let s = Server::start_with_config(&db.url, &manual);
    w.provider.script("ORD-20:create_order", vec![Step::EffectThenHang]);
    assert_eq!(start(&s, "ORD-20").await.status, 201);
    let v = wait_instance(&s, "ORD-20", 30, |v| v["state"] != "RUNNING").await;
    assert_effects_once(&w, &v, "ORD-20");
    assert_eq!(v["steps"][0]["evidence_source"], "lookup", "found by the lookup, not redone");
    assert_eq!(w.provider.calls("ORD-20:create_order"), 1, "one call: nothing was resent");

    w.provider.script("ORD-21:write_back", vec![Step::EffectThenHang]);
    assert_eq!(start(&s, "ORD-21").await.status, 201);
    let v = wait_instance(&s, "ORD-21", 30, |v| v["state"] != "RUNNING").await;
    assert_eq!(v["state"], "PAUSED", "{v:#}");
    assert_eq!(
        (v["stopped_step"].as_str(), v["last_good_step"].as_str()),
        (Some("write_back"), Some("send_confirmation"))
    );
    let op = s.wait_for("ORD-21:write_back", 10, |r| r["needs_review"] == true).await;
    assert_eq!(op["state"], "UNKNOWN");
    assert!(
        op["events"]
            .as_array()
            .unwrap()
            .iter()
            .all(|e| e["kind"] != "reconciled" || e["reason"].as_str().unwrap().contains("manual")),
        "never looked up: {op:#}"
    );
    let queue = s.get(ADMIN_KEY, "/v1/operations?needs_review=true").await.body;
    assert!(queue["items"].as_array().unwrap().iter().any(|o| o["key"] == "ORD-21:write_back"));
    assert_eq!(w.provider.calls("ORD-21:write_back"), 1, "not redone while paused");
    // The admin page lists it first, waiting for a person, with its last good step; its
    // page links the stopped step to that operation's page (where it is resolved).
    let cookie = ui_session(&s, ADMIN_KEY).await;
    let page = |path: &str| {
        let (http, url, cookie) = (s.http.clone(), s.url(path), cookie.clone());
        async move { http.get(url).header("cookie", cookie).send().await.unwrap().text().await.unwrap() }
    };
    let list = page("/ui/workflows").await;
    let waiting = list.split("id=\"waiting\"").nth(1).expect("a table of instances waiting for a person");
    let row = waiting.split("</tr>").find(|r| r.contains("ORD-21")).expect("ORD-21 waits");
    assert!(row.contains("PAUSED") && row.contains("send_confirmation") && row.contains("write_back"), "{row}");
    let later = page("/ui/workflows?from=2099-01-01T00:00").await;
    assert!(!later.contains("ORD-21"), "the creation-time filter applies to the waiting list too");
    let one = page("/ui/workflows/ORD-21").await;
    assert!(one.contains("id=\"last-good-step\">send_confirmation"), "{one}");
    assert!(one.contains("href=\"/ui/operations/ORD%2D21%3Awrite%5Fback\""), "{one}");
    let resolved = s
        .post(
            ADMIN_KEY,
            &format!("/v1/operations/{}/resolve", enc("ORD-21:write_back")),
            &json!({"to": "SUCCEEDED", "reason": "the CRM shows the order", "evidence": "crm-note-21"}),
        )
        .await;
    assert_eq!(resolved.status, 200, "{resolved:?}");
    let v = wait_instance(&s, "ORD-21", 20, |v| v["state"] == "SUCCEEDED").await;
    let kinds: Vec<_> = v["events"].as_array().unwrap().iter().map(|e| e["kind"].as_str().unwrap()).collect();
    assert_eq!(kinds, ["started", "paused", "resumed", "succeeded"]);
    assert_eq!(w.provider.effects("ORD-21:write_back"), 1);
}

/// Bad input: unknown workflow, personal data in the instance id, and a step input that
/// cannot be built (the instance FAILS before the call, naming the pointer) — nothing
/// half-written; a definition error fails `idem serve` at start-up with one line naming
/// the field.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_refused_clearly_and_writes_nothing() {
    let w = world().await;
    let db = Db::new(Backend::Sqlite).await;
    let s = Server::start_with_config(&db.url, &w.config);
    let mut unknown = start_body("ORD-30");
    unknown["workflow"] = json!("order-intke");
    let r = s.post(ADMIN_KEY, "/v1/workflows", &unknown).await;
    assert_eq!((r.status.as_u16(), r.problem()), (400, "unknown-workflow"));
    let r = s.post(ADMIN_KEY, "/v1/workflows", &start_body("order-for-jane.doe@example.com")).await;
    assert_eq!((r.status.as_u16(), r.problem()), (400, "invalid-request"));
    assert!(r.body["detail"].as_str().unwrap().contains("e-mail"), "{r:?}");
    let mut given = start_body("ORD-31");
    given["steps"] = json!([{"name": "x"}]);
    let r = s.post(ADMIN_KEY, "/v1/workflows", &given).await;
    assert_eq!((r.status.as_u16(), r.problem()), (400, "invalid-request"), "a declared workflow takes no steps");
    let list = s.get(ADMIN_KEY, "/v1/workflows").await.body;
    assert_eq!(list["items"], json!([]), "nothing was written");
    let mut no_email = start_body("ORD-32");
    no_email["input"].as_object_mut().unwrap().remove("email");
    assert_eq!(s.post(ADMIN_KEY, "/v1/workflows", &no_email).await.status, 201);
    let v = wait_instance(&s, "ORD-32", 20, |v| v["state"] != "RUNNING").await;
    assert_eq!((v["state"].as_str(), v["stopped_step"].as_str()), (Some("FAILED"), Some("send_confirmation")));
    assert_eq!(v["error"]["class"], "step_input");
    assert!(v["error"]["message"].as_str().unwrap().contains("/input/email"), "{v:#}");
    assert_eq!(v["steps"][1]["state"], "NOT_STARTED", "nothing was sent");
    assert!(w.mail.delivered().is_empty());

    let bad = w.config.replace(r#"connector = "mail""#, r#"connector = "mial""#);
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("idem.toml"), bad).unwrap();
    let out = std::process::Command::new(common::idem_bin())
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--database-url",
            &format!("sqlite://{}/x.db", dir.path().display()),
        ])
        .arg("--config")
        .arg(dir.path().join("idem.toml"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(err.contains("workflows.order-intake.steps[1].connector"), "{err}");
}

/// The code-driven mode: a worker (Python, from examples/, on idem's Python client) performs
/// each step itself, calling the provider double; killed right after step 2's effect, before
/// reporting it, it starts again from the top: step 1 replays, step 2 is UNKNOWN (the instance
/// pauses for a person, nothing is redone); run after the operator resolved it, it finishes
/// step 3. The Python is `IDEM_CLIENT_PYTHON`: the venv scripts/test.sh installs
/// clients/python into.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_between_steps_starts_over_and_redoes_nothing() {
    let (provider, addr) = start_provider().await;
    let db = Db::new(Backend::Sqlite).await;
    let s = Server::start_with_config(&db.url, "[executor]\npoll_interval_ms = 50\n");
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples/workflow_worker.py");
    let python = std::env::var("IDEM_CLIENT_PYTHON")
        .expect("IDEM_CLIENT_PYTHON (a Python with clients/python installed): run ./scripts/test.sh, which makes it");
    let run = |crash_after: Option<&str>| {
        let mut cmd = std::process::Command::new(&python);
        cmd.arg(script)
            .env("IDEM_URL", &s.base)
            .env("IDEM_API_KEY", ADMIN_KEY)
            .env("PROVIDER_URL", format!("http://{addr}"))
            .env("INSTANCE_ID", "ORD-40:manual");
        if let Some(step) = crash_after {
            cmd.env("CRASH_AFTER_EFFECT", step);
        }
        cmd.output().unwrap()
    };
    // First run: killed (SIGKILL, by itself) after step 2's effect, before it reports it.
    let first = run(Some("reserve_stock"));
    assert!(!first.status.success(), "the worker was killed");
    assert_eq!(provider.effects("ORD-40:manual:create_ticket"), 1);
    assert_eq!(provider.effects("ORD-40:manual:reserve_stock"), 1);
    // Second run, from the top: step 1 replays; step 2's lease runs out (2 s) into UNKNOWN.
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    let second = run(None);
    let out = String::from_utf8_lossy(&second.stdout);
    assert!(out.contains("create_ticket: replayed"), "{out}");
    assert!(out.contains("reserve_stock: outcome UNKNOWN"), "{out}");
    assert_eq!(provider.effects("ORD-40:manual:create_ticket"), 1, "a finished step is never redone");
    assert_eq!(provider.effects("ORD-40:manual:reserve_stock"), 1, "an UNKNOWN step is never redone");
    let v = wait_instance(&s, "ORD-40:manual", 10, |v| v["state"] == "PAUSED").await;
    assert_eq!(v["stopped_step"], "reserve_stock");
    // An operator confirms the reservation; the worker runs again and finishes.
    let r = s
        .post(
            ADMIN_KEY,
            &format!("/v1/operations/{}/resolve", enc("ORD-40:manual:reserve_stock")),
            &json!({"to": "SUCCEEDED", "reason": "the stock system shows it", "evidence": "res-40"}),
        )
        .await;
    assert_eq!(r.status, 200);
    wait_instance(&s, "ORD-40:manual", 10, |v| v["state"] == "RUNNING").await;
    let third = run(None);
    let out = String::from_utf8_lossy(&third.stdout);
    assert!(third.status.success(), "{out}{}", String::from_utf8_lossy(&third.stderr));
    assert!(out.contains("reserve_stock: replayed") && out.contains("notify: done"), "{out}");
    let v = wait_instance(&s, "ORD-40:manual", 10, |v| v["state"] == "SUCCEEDED").await;
    assert_eq!(v["last_good_step"], "notify");
    for step in ["create_ticket", "reserve_stock", "notify"] {
        assert_eq!(provider.effects(&format!("ORD-40:manual:{step}")), 1, "{step}");
    }
}
