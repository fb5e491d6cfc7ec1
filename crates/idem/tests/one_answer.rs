//! One answer, one meaning (issue 28 §1, §4; DESIGN.md §3): `201` and the CLI's exit 0
//! only ever hand the side effect to the caller. When a connector of idem's performs it —
//! named in the trigger, or the action's default — the trigger gets `200` with
//! `Idem-Performed-By: connector` (exit 14) or `202` (exit 11), never `201`/0. And a
//! connector, or a declared workflow, serves only the tenants its configuration lists.

mod common;

use common::mail::MailServers;
use common::{ADMIN_KEY, Backend, Db, Server, idem_bin, orders_config, start_provider};
use idem::acceptance::provider::Step;
use serde_json::{Value, json};
use std::process::{Command, Output};

fn cli(s: &Server, api_key: &str, args: &[&str]) -> Output {
    Command::new(idem_bin()).args(args).env("IDEM_URL", &s.base).env("IDEM_API_KEY", api_key).output().unwrap()
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

/// The issue's input, as reported: `[actions.send_confirmation] connector = "mail"`, then
/// `idem acquire` and `POST /v1/operations` naming only the action. Both used to answer
/// "perform it" (exit 0, `201`) for a message idem had already sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_default_connectors_effect_is_never_handed_to_the_caller() {
    let mail = MailServers::start();
    let config = format!(
        "[actions.send_confirmation]\nconnector = \"mail\"\n\n[connectors.mail]\nkind = \"smtp\"\nhost = \"127.0.0.1\"\n\
         port = {}\ntls = \"none\"\nfrom = \"idem@example.org\"\ntimeout_ms = 3000\n",
        mail.smtp_port
    );
    let db = Db::new(Backend::Sqlite).await;
    let s = Server::start_with_config(&db.url, &config);
    let payload = r#"{"to":"customer-1007@example.org","subject":"Your inquiry","text":"Thank you."}"#;
    let acquire = [
        "acquire",
        "INQ-1007:confirmation:v1",
        "--action",
        "send_confirmation",
        "--payload",
        payload,
        "--wait-ms",
        "8000",
    ];
    let first = cli(&s, ADMIN_KEY, &acquire);
    assert_eq!(first.status.code(), Some(14), "idem performed it: {}", text(&first));
    assert!(
        text(&first).starts_with("performed INQ-1007:confirmation:v1: SUCCEEDED by connector mail"),
        "{}",
        text(&first)
    );
    assert!(text(&first).contains("do nothing"), "{}", text(&first));
    let again = cli(&s, ADMIN_KEY, &acquire);
    assert_eq!(again.status.code(), Some(10), "a replay: {}", text(&again));

    let body = json!({"key": "INQ-1008:confirmation:v1", "action": "send_confirmation", "wait_ms": 8000,
                      "payload": serde_json::from_str::<Value>(payload).unwrap()});
    let r = s.post(ADMIN_KEY, "/v1/operations", &body).await;
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!((r.header("idem-performed-by"), r.header("idempotent-replayed")), (Some("connector"), None));
    assert_eq!((r.body["state"].as_str(), r.body["connector"].as_str()), (Some("SUCCEEDED"), Some("mail")));
    let replay = s.post(ADMIN_KEY, "/v1/operations", &body).await;
    assert_eq!((replay.status.as_u16(), replay.header("idempotent-replayed")), (200, Some("true")));
    assert_eq!(replay.header("idem-performed-by"), None, "a replay is not idem's attempt of this request");
    assert_eq!(mail.delivered().len(), 2, "one message per key, whatever the callers did");
}

/// The neighbours over HTTP: an explicit connector, a final failure, an attempt still
/// running when `wait_ms` ends, a caller's re-trigger of a due retry. None is ever 201 or
/// exit 0, and the OpenAPI document says what each answer means.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_path_of_a_connector_operation_answers_201() {
    let (provider, addr) = start_provider().await;
    let db = Db::new(Backend::Sqlite).await;
    let config = orders_config(addr, "").replace("base_ms = 100, cap_ms = 400", "base_ms = 60000, cap_ms = 60000")
        + "\n[actions.create_order]\nconnector = \"orders\"\n";
    let s = Server::start_with_config(&db.url, &config);
    let acquire = |key: &str, connector: Option<&str>, wait: &str| {
        let mut args = vec!["acquire", key, "--action", "create_order", "--payload", "{}", "--wait-ms", wait];
        if let Some(c) = connector {
            args.extend(["--connector", c]);
        }
        cli(&s, ADMIN_KEY, &args)
    };
    // Explicit connector, success.
    let o = acquire("ORD-1:create", Some("orders"), "5000");
    assert_eq!(o.status.code(), Some(14), "{}", text(&o));
    // A final failure (the provider refuses): idem performed it, it failed — still 14.
    provider.script("ORD-2:create", vec![Step::Status(422, None)]);
    let o = acquire("ORD-2:create", None, "5000");
    assert_eq!(o.status.code(), Some(14), "{}", text(&o));
    assert!(text(&o).contains("FAILED by connector orders"), "{}", text(&o));
    // Still running when wait_ms ends: 202, exit 11.
    provider.script("ORD-3:create", vec![Step::Slow(1500)]);
    let o = acquire("ORD-3:create", None, "200");
    assert_eq!(o.status.code(), Some(11), "{}", text(&o));
    assert!(text(&o).contains("idem is on it"), "{}", text(&o));
    // A retry scheduled (503), then the caller re-triggers: 409 until due, never 201.
    provider.script("ORD-4:create", vec![Step::Status(503, None), Step::Ok]);
    let r = s
        .post(ADMIN_KEY, "/v1/operations", &json!({"key": "ORD-4:create", "action": "create_order", "wait_ms": 3000}))
        .await;
    assert_eq!((r.status.as_u16(), r.body["state"].as_str()), (202, Some("PENDING")), "{r:?}");
    let again = s.post(ADMIN_KEY, "/v1/operations", &json!({"key": "ORD-4:create", "action": "create_order"})).await;
    assert_eq!(again.status, 409, "{again:?}");
    // The statuses the OpenAPI document gives say the same.
    let doc = s.get("", "/openapi.json").await.body;
    let responses = &doc["paths"]["/v1/operations"]["post"]["responses"];
    assert!(responses["201"]["description"].as_str().unwrap().contains("never when a connector performs it"));
    assert!(responses["200"]["description"].as_str().unwrap().contains("Idem-Performed-By: connector"));
    // The help lists exit 14.
    let help = String::from_utf8_lossy(&Command::new(idem_bin()).args(["acquire", "--help"]).output().unwrap().stdout)
        .into_owned();
    assert!(help.contains("14 = idem performed it"), "{help}");
}

/// Issue 28 §4, as reported: a client key of tenant `acme` triggered the SMTP connector
/// configured for the default tenant. A connector serves `tenants` (default
/// `["default"]`); a declared workflow too; a change of the configuration reaches
/// operations made before it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connectors_and_declared_workflows_serve_only_their_tenants() {
    let (provider, addr) = start_provider().await;
    let db = Db::new(Backend::Sqlite).await;
    let base = orders_config(addr, "")
        + "\n[connectors.shared]\nkind = \"http\"\nurl = \"http://"
        + &addr.to_string()
        + "/orders\"\ntimeout_ms = 800\ntenants = [\"default\", \"acme\"]\n"
        + "\n[actions.create_order]\nconnector = \"orders\"\n"
        + "\n[workflows.intake]\nsteps = [{ name = \"create\", connector = \"orders\" }]\n";
    let s = Server::start_with_config(&db.url, &base);
    let acme = s.create_key("acme", "client");
    let trigger = |key: &str, connector: Option<&str>| {
        let mut b = json!({"key": key, "action": "create_order", "payload": {}, "wait_ms": 3000});
        if let Some(c) = connector {
            b["connector"] = json!(c);
        }
        b
    };
    for (body, how) in [(trigger("ACME-1", Some("orders")), "names connector"), (trigger("ACME-2", None), "by default")]
    {
        let r = s.post(&acme, "/v1/operations", &body).await;
        assert_eq!((r.status.as_u16(), r.problem()), (403, "connector-not-allowed"), "{r:?}");
        let detail = r.body["detail"].as_str().unwrap();
        assert!(
            detail.contains(how) && detail.contains("\"acme\"") && detail.contains("connectors.orders.tenants"),
            "{detail}"
        );
        let key = body["key"].as_str().unwrap();
        assert_eq!(s.get(&acme, &format!("/v1/operations/{key}")).await.status, 404, "nothing recorded");
    }
    // The CLI says it in one line, exit 1.
    let o = cli(&s, &acme, &["acquire", "ACME-3", "--action", "create_order"]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(String::from_utf8_lossy(&o.stderr).starts_with("idem: 403 connector-not-allowed"), "{}", text(&o));
    assert_eq!(provider.calls("ACME-1") + provider.calls("ACME-2") + provider.calls("ACME-3"), 0);
    // A connector that lists the tenant serves it; the default tenant keeps its own.
    let r = s.post(&acme, "/v1/operations", &trigger("ACME-4", Some("shared"))).await;
    assert_eq!((r.status.as_u16(), r.header("idem-performed-by")), (200, Some("connector")), "{r:?}");
    let r = s.post(ADMIN_KEY, "/v1/operations", &trigger("DEF-1", None)).await;
    assert_eq!(r.status, 200, "{r:?}");
    // A declared workflow: only its tenants start it.
    let start = json!({"workflow": "intake", "instance_id": "ACME-5:intake", "input": {}});
    let r = s.post(&acme, "/v1/workflows", &start).await;
    assert_eq!((r.status.as_u16(), r.problem()), (403, "workflow-not-allowed"), "{r:?}");
    assert_eq!(s.get(&acme, "/v1/workflows/ACME-5:intake").await.status, 404);

    // An operation made while a tenant was served waits for its retry; the operator then
    // takes the tenant off: the retry sends nothing, and says why.
    provider.script("ACME-6", vec![Step::Status(503, None), Step::Ok]);
    let shared_fast = base.replace(
        "tenants = [\"default\", \"acme\"]\n",
        "tenants = [\"default\", \"acme\"]\nretry = { base_ms = 300, cap_ms = 300, max_attempts = 3 }\n",
    );
    drop(s);
    let s = Server::start_with_config(&db.url, &shared_fast);
    let r = s.post(&acme, "/v1/operations", &trigger("ACME-6", Some("shared"))).await;
    assert_eq!(r.body["state"], "PENDING", "{r:?}");
    drop(s);
    let s = Server::start_with_config(
        &db.url,
        &shared_fast.replace("tenants = [\"default\", \"acme\"]", "tenants = [\"default\"]"),
    );
    let mut rec = Value::Null;
    for _ in 0..100 {
        rec = s.get(&acme, "/v1/operations/ACME-6").await.body;
        if rec["error"]["class"] == "not_allowed" || rec["state"] == "FAILED" {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert_eq!(rec["error"]["class"], "not_allowed", "{rec}");
    assert!(rec["error"]["message"].as_str().unwrap().contains("does not serve tenant \"acme\""), "{rec}");
    assert_eq!(provider.calls("ACME-6"), 1, "only the first attempt reached the provider");

    // A workflow may not serve a tenant its connectors do not: the start fails, naming it.
    let bad = base.replace("[workflows.intake]\n", "[workflows.intake]\ntenants = [\"acme\"]\n");
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("idem.toml"), bad).unwrap();
    let o = Command::new(idem_bin())
        .args(["serve", "--listen", "127.0.0.1:0", "--config"])
        .arg(dir.path().join("idem.toml"))
        .arg("--database-url")
        .arg(format!("sqlite://{}", dir.path().join("x.db").display()))
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(String::from_utf8_lossy(&o.stderr).contains("workflows.intake.tenants"), "{}", text(&o));
}
