//! Compensation and guarded re-runs against real `idem serve` processes and the provider
//! double (issue 14, seed 003's last check): a third step that fails finally compensates
//! the first two, last first, each exactly once even with kill -9 in the middle; a
//! compensation that keeps failing pauses the instance, moves the alert metrics, and waits
//! for an operator, who resolves it or re-runs it; re-runs are previewed, guarded by role,
//! reason and plan hash, and audited.

mod common;

use common::{ADMIN_KEY, Backend, Db, Server, enc, instance, metric, start_provider, wait_instance};
use idem::acceptance::provider::{Provider, Step};
use serde_json::json;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// Three HTTP steps on the provider double; the first two have compensations (on the same
/// provider: an order created under the compensation's key stands for "cancelled"). The
/// `cancels` connector has no lookup, so an UNKNOWN compensation on it waits for a person.
fn config(orders: SocketAddr) -> String {
    format!(
        r#"[executor]
poll_interval_ms = 50
workflow_hold_ms = 1000
[reconciler]
interval_ms = 100

[connectors.orders]
kind = "http"
url = "http://{orders}/orders"
timeout_ms = 600
connect_timeout_ms = 300
lease_ms = 1500
provider_ref = {{ json_pointer = "/id" }}
lookup = {{ url = "http://{orders}/orders?client_reference={{idempotency_key}}", found_pointer = "/0/id", absent_after_ms = 200 }}
retry = {{ base_ms = 100, cap_ms = 300, max_attempts = 3 }}

[connectors.cancels]
kind = "http"
url = "http://{orders}/orders"
timeout_ms = 600
connect_timeout_ms = 300
lease_ms = 1500
provider_ref = {{ json_pointer = "/id" }}
retry = {{ base_ms = 100, cap_ms = 300, max_attempts = 3 }}

[workflows.order-intake]
steps = [
  {{ name = "create_order", connector = "orders", input = {{ customer = {{ from = "/input/customer" }} }},
     compensation = {{ action = "cancel_order", connector = "orders", input = {{ order = {{ from = "/steps/create_order/provider_ref" }} }} }} }},
  {{ name = "reserve_stock", connector = "orders", input = {{ order = {{ from = "/steps/create_order/provider_ref" }} }},
     compensation = {{ action = "release_stock", connector = "cancels", input = {{ reservation = {{ from = "/steps/reserve_stock/provider_ref" }} }} }} }},
  {{ name = "charge", connector = "orders", input = {{ order = {{ from = "/steps/create_order/provider_ref" }} }} }},
]
"#
    )
}

async fn start(s: &Server, id: &str) {
    let body = json!({"workflow": "order-intake", "instance_id": id, "input": {"customer": "C-1"}});
    let r = s.post(ADMIN_KEY, "/v1/workflows", &body).await;
    assert_eq!(r.status, 201, "{r:?}");
}

/// The number in `ord-N` of the order made under `key` (the provider numbers its orders
/// in the order they were made).
fn order_no(p: &Provider, key: &str) -> u64 {
    let ids = p.order_ids(key);
    assert_eq!(ids.len(), 1, "{key}: exactly one effect: {ids:?}");
    ids[0].trim_start_matches("ord-").parse().unwrap()
}

/// Seed 003: the third step fails finally ⇒ the second's and the first's compensations
/// run, last first, each exactly once — also when idem is killed (kill -9) right after a
/// compensation's call, before its outcome is recorded.
async fn a_failed_last_step_compensates_the_earlier_ones_last_first(b: Backend, crash: bool) {
    let (provider, addr) = start_provider().await;
    let db = Db::new(b).await;
    let id = if crash { "ORD-C2" } else { "ORD-C1" };
    provider.script(&format!("{id}:charge"), vec![Step::Status(422, None)]);
    let env = format!("executor.after_call@{id}:reserve_stock:compensate");
    let env: Vec<(&str, &str)> = if crash { vec![("IDEM_TEST_CRASH_AT", &env)] } else { vec![] };
    let s = Server::start_with_config_env(&db.url, &config(addr), &env);
    start(&s, id).await;
    let s = if crash {
        let deadline = Instant::now() + Duration::from_secs(20);
        while s.http.get(s.url("/healthz")).send().await.is_ok() {
            assert!(Instant::now() < deadline, "the crash point was never reached");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        drop(s);
        // The release happened; its outcome was not recorded. The restarted node finds it
        // UNKNOWN; `cancels` has no lookup, so it waits for a person: the operator checks
        // the stock system and records the evidence.
        let s = Server::start_with_config(&db.url, &config(addr));
        let v = wait_instance(&s, id, 20, |v| v["state"] == "PAUSED").await;
        assert_eq!(v["error"]["class"], "compensation_needs_review", "{v:#}");
        let key = format!("{id}:reserve_stock:compensate");
        let r = s
            .post(
                ADMIN_KEY,
                &format!("/v1/operations/{}/resolve", enc(&key)),
                &json!({"to": "SUCCEEDED", "reason": "the stock system shows it released", "evidence": "rel-1"}),
            )
            .await;
        assert_eq!(r.status, 200, "{r:?}");
        s
    } else {
        s
    };
    let v = wait_instance(&s, id, 30, |v| v["state"] == "COMPENSATED").await;
    let states: Vec<_> = v["steps"].as_array().unwrap().iter().map(|c| c["state"].as_str().unwrap()).collect();
    assert_eq!(states, ["COMPENSATED", "COMPENSATED", "FAILED"], "{v:#}");
    for step in ["create_order", "reserve_stock"] {
        assert_eq!(provider.effects(&format!("{id}:{step}")), 1, "{step}: one effect");
        assert_eq!(provider.effects(&format!("{id}:{step}:compensate")), 1, "{step}: compensated exactly once");
    }
    assert_eq!(provider.effects(&format!("{id}:charge")), 0);
    assert!(
        order_no(&provider, &format!("{id}:reserve_stock:compensate"))
            < order_no(&provider, &format!("{id}:create_order:compensate")),
        "the second step is compensated before the first"
    );
    let kinds: Vec<_> = v["events"].as_array().unwrap().iter().map(|e| e["kind"].as_str().unwrap()).collect();
    assert!(kinds.contains(&"compensating") && kinds.last() == Some(&"compensated"), "{kinds:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_failed_last_step_compensates_the_earlier_ones_last_first() {
    a_failed_last_step_compensates_the_earlier_ones_last_first(Backend::Sqlite, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_compensation_survives_kill_9_between_call_and_record() {
    a_failed_last_step_compensates_the_earlier_ones_last_first(Backend::Postgres, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_compensation_survives_kill_9_between_call_and_record() {
    a_failed_last_step_compensates_the_earlier_ones_last_first(Backend::Sqlite, true).await;
}

/// Seed 003's last check: the compensation itself fails — the provider refuses the release
/// (503, retried with backoff), then refuses it for good (422): the instance pauses, the
/// alert metrics move, the context is there; the operator previews a re-run of the
/// compensation (a new key), runs it, and the instance ends COMPENSATED.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_compensation_pauses_alerts_and_the_operator_reruns_it() {
    let (provider, addr) = start_provider().await;
    let db = Db::new(Backend::Sqlite).await;
    let s = Server::start_with_config(&db.url, &config(addr));
    let id = "ORD-C3";
    provider.script(&format!("{id}:charge"), vec![Step::Status(422, None)]);
    provider.script(&format!("{id}:reserve_stock:compensate"), vec![Step::Status(503, None), Step::Status(422, None)]);
    start(&s, id).await;
    let v = wait_instance(&s, id, 30, |v| v["state"] == "PAUSED").await;
    assert_eq!(
        (v["stopped_step"].as_str(), v["error"]["class"].as_str()),
        (Some("reserve_stock"), Some("compensation_failed"))
    );
    assert!(v["error"]["message"].as_str().unwrap().contains("release_stock"), "{v:#}");
    let comp = &v["steps"][1]["compensation"];
    assert_eq!(
        (comp["state"].as_str(), comp["attempts"].as_i64()),
        (Some("FAILED"), Some(2)),
        "retried, then refused: {v:#}"
    );
    assert_eq!(v["steps"][0]["provider_ref"], "ord-1", "the context shows the effects made");
    assert!(v["steps"][0]["compensation"].is_null(), "create_order not compensated yet");
    assert_eq!(provider.calls(&format!("{id}:reserve_stock:compensate")), 2);
    let text = s.http.get(s.url("/metrics")).send().await.unwrap().text().await.unwrap();
    assert!(metric(&text, "idem_workflows_paused", &[]) >= 1.0, "{text}");
    assert!(metric(&text, "idem_compensations_total", &[("workflow", "order-intake"), ("outcome", "paused")]) >= 1.0);

    // The operator: a dry run shows the compensation redone under a new key and nothing else.
    let operator = s.create_key("default", "operator");
    let client = s.create_key("default", "client");
    let path = format!("/v1/workflows/{}/rerun", enc(id));
    let denied = s.post(&client, &path, &json!({"reason": "r", "dry_run": true})).await;
    assert_eq!((denied.status.as_u16(), denied.problem()), (403, "forbidden"));
    let dry = s.post(&operator, &path, &json!({"dry_run": true})).await;
    assert_eq!(dry.status, 200, "{dry:?}");
    assert_eq!(dry.body["resumes_as"], "COMPENSATING");
    let plan: Vec<_> =
        dry.body["steps"].as_array().unwrap().iter().map(|s| s["disposition"].as_str().unwrap()).collect();
    assert_eq!(plan, ["compensation_runs", "compensated", "kept"], "every effect the re-run makes is shown");
    let redo = &dry.body["steps"][1];
    assert_eq!(redo["compensation_key"], format!("{id}:reserve_stock:compensate-2"));
    assert_eq!((&redo["key"], &redo["action"]), (&redo["compensation_key"], &json!("release_stock")));
    assert_eq!(redo["input"], json!({"reservation": "ord-2"}));
    let then = &dry.body["steps"][0];
    assert_eq!(
        (&then["key"], &then["action"]),
        (&json!(format!("{id}:create_order:compensate")), &json!("cancel_order"))
    );

    // The approval does not go stale while the instance waits: the runner looks at a
    // PAUSED instance every 5 s (its version moves), and the plan stays the same.
    let seen = instance(&s, id).await["next_run_at"].clone();
    wait_instance(&s, id, 15, |v| v["next_run_at"] != seen).await;
    let no_reason = s.post(&operator, &path, &json!({"plan_hash": dry.body["plan_hash"]})).await;
    assert_eq!((no_reason.status.as_u16(), no_reason.problem()), (400, "missing-reason"));
    let run = s
        .post(&operator, &path, &json!({"reason": "the stock system is fixed", "plan_hash": dry.body["plan_hash"]}))
        .await;
    assert_eq!(run.status, 200, "{run:?}");
    let v = wait_instance(&s, id, 30, |v| v["state"] == "COMPENSATED").await;
    assert_eq!(v["steps"][1]["compensation_key"], format!("{id}:reserve_stock:compensate-2"));
    assert_eq!(provider.effects(&format!("{id}:reserve_stock:compensate-2")), 1);
    assert_eq!(provider.effects(&format!("{id}:create_order:compensate")), 1);
    let rerun = v["events"].as_array().unwrap().iter().find(|e| e["kind"] == "rerun").expect("an audited re-run");
    assert_ne!(rerun["principal"], "system");
    assert!(rerun["reason"].as_str().unwrap().contains("the stock system is fixed"), "{rerun}");
}

/// A re-run of a FAILED instance (no compensation defined for its failed step's
/// predecessors here: the charge fails first) is previewed without changing anything,
/// refused with a stale plan hash, and runs exactly the plan approved: the failed step is
/// redone under a new key, finished steps are kept (named, one is redone too).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reruns_are_previewed_guarded_and_audited() {
    let (provider, addr) = start_provider().await;
    let db = Db::new(Backend::Sqlite).await;
    // No compensations: a failed step makes the instance FAILED.
    let s = Server::start_with_config(&db.url, &plain_config(addr));
    let id = "ORD-R1";
    provider.script(&format!("{id}:charge"), vec![Step::Status(422, None)]);
    start(&s, id).await;
    let failed = wait_instance(&s, id, 20, |v| v["state"] == "FAILED").await;
    assert_eq!(failed["stopped_step"], "charge");
    let operator = s.create_key("default", "operator");
    let path = format!("/v1/workflows/{}/rerun", enc(id));

    // The dry run changes nothing: the instance, its steps, events and operations are the same.
    let snapshot = || async {
        let ops = s.get(ADMIN_KEY, &format!("/v1/operations?key_prefix={}&limit=500", enc(id))).await.body;
        (instance(&s, id).await, ops)
    };
    let before = snapshot().await;
    let dry = s.post(&operator, &path, &json!({"dry_run": true})).await;
    assert_eq!(dry.status, 200, "{dry:?}");
    let plan: Vec<_> =
        dry.body["steps"].as_array().unwrap().iter().map(|s| s["disposition"].as_str().unwrap()).collect();
    assert_eq!(plan, ["kept", "kept", "redone"]);
    assert_eq!(dry.body["steps"][2]["operation_key"], format!("{id}:charge:rerun-1"));
    assert_eq!(dry.body["steps"][2]["input"], json!({"order": "ord-1"}), "shows what it would send");
    assert_eq!(snapshot().await, before, "a dry run changes nothing");

    let stale = s.post(&operator, &path, &json!({"reason": "r", "plan_hash": "0".repeat(64)})).await;
    assert_eq!((stale.status.as_u16(), stale.problem()), (409, "plan-changed"));
    assert_eq!(snapshot().await, before, "a refused re-run changes nothing");
    let named = s.post(&operator, &path, &json!({"dry_run": true, "steps": ["reserve_stock"]})).await;
    assert_ne!(named.body["plan_hash"], dry.body["plan_hash"], "another plan, another hash");
    let wrong = s
        .post(&operator, &path, &json!({"reason": "r", "steps": ["reserve_stock"], "plan_hash": dry.body["plan_hash"]}))
        .await;
    assert_eq!((wrong.status.as_u16(), wrong.problem()), (409, "plan-changed"), "what was approved is what runs");

    let run =
        s.post(&operator, &path, &json!({"reason": "the card was updated", "plan_hash": dry.body["plan_hash"]})).await;
    assert_eq!(run.status, 200, "{run:?}");
    let v = wait_instance(&s, id, 20, |v| v["state"] == "SUCCEEDED").await;
    assert_eq!(v["steps"][2]["operation_key"], format!("{id}:charge:rerun-1"));
    assert_eq!(provider.effects(&format!("{id}:charge:rerun-1")), 1);
    assert_eq!(provider.effects(&format!("{id}:create_order")), 1, "a finished step is never redone unasked");
    let e = v["events"].as_array().unwrap().iter().find(|e| e["kind"] == "rerun").unwrap().clone();
    assert!(e["reason"].as_str().unwrap().contains("the card was updated"), "{e}");
    assert!(e["principal"].as_str().unwrap() != "system");
    let old = s.record(&format!("{id}:charge")).await.body;
    assert_eq!(old["state"], "FAILED", "the old intent stays in the history with its own outcome");

    // Redoing a SUCCEEDED step must be named, and is a new intent under a new key.
    let again =
        s.post(&operator, &path, &json!({"reason": "resend", "steps": ["create_order"], "dry_run": true})).await;
    let plan: Vec<_> =
        again.body["steps"].as_array().unwrap().iter().map(|s| s["disposition"].as_str().unwrap()).collect();
    assert_eq!(plan, ["redone", "kept", "kept"]);
    let nothing = s.post(&operator, &path, &json!({"reason": "r"})).await;
    assert_eq!((nothing.status.as_u16(), nothing.problem()), (409, "nothing-to-rerun"));
    let comp = s.post(&operator, &format!("/v1/workflows/{}/compensate", enc(id)), &json!({"reason": "r"})).await;
    assert_eq!((comp.status.as_u16(), comp.problem()), (409, "instance-not-stopped"));
}

/// An operation made through `/v1/operations` under a step's key (another action) is never
/// taken as the step's result: the instance pauses on the conflict with no call made, and
/// a re-run performs the step under a new key (the acquire through the step's own key
/// would have been a 422 mismatch, too).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operation_not_made_for_a_step_never_counts_as_its_result() {
    let (provider, addr) = start_provider().await;
    let db = Db::new(Backend::Sqlite).await;
    let s = Server::start_with_config(&db.url, &plain_config(addr));
    let operator = s.create_key("default", "operator");
    // Another action, completed by hand; and the step's own action and connector, triggered
    // (and performed by idem, a real effect) through /v1/operations with another payload.
    for (id, trigger, found) in [
        ("ORD-F1", json!({"action": "unrelated", "payload": {"a": 1}}), "unrelated"),
        (
            "ORD-F2",
            json!({"action": "create_order", "connector": "orders", "payload": {"customer": "C-9"}}),
            "create_order",
        ),
    ] {
        let key = format!("{id}:create_order");
        let mut body = trigger.clone();
        body["key"] = json!(key);
        let r = s.post(ADMIN_KEY, "/v1/operations", &body).await;
        if trigger.get("connector").is_none() {
            assert_eq!(r.status, 201, "{r:?}");
            let done = s
                .complete(
                    &key,
                    json!({"fencing_token": r.token(), "outcome": "succeeded", "provider_ref": "foreign-1"}),
                )
                .await;
            assert_eq!(done.status, 200, "{done:?}");
        } else {
            s.wait_for(&key, 20, |v| v["state"] == "SUCCEEDED").await;
        }
        let calls_before = provider.calls(&key);
        start(&s, id).await;
        let v = wait_instance(&s, id, 20, |v| v["state"] == "PAUSED").await;
        assert_eq!(
            (v["stopped_step"].as_str(), v["error"]["class"].as_str()),
            (Some("create_order"), Some("step_key_conflict"))
        );
        assert!(v["error"]["message"].as_str().unwrap().contains(found), "{v:#}");
        assert_eq!(provider.calls(&key), calls_before, "no call for the step under the taken key");
        assert_eq!(provider.calls(&format!("{id}:reserve_stock")), 0, "the other result is never passed on");

        let path = format!("/v1/workflows/{}/rerun", enc(id));
        let dry = s.post(&operator, &path, &json!({"dry_run": true})).await;
        let plan: Vec<_> =
            dry.body["steps"].as_array().unwrap().iter().map(|s| s["disposition"].as_str().unwrap()).collect();
        assert_eq!(plan, ["redone", "runs", "runs"], "{dry:?}");
        assert_eq!(dry.body["steps"][0]["key"], format!("{key}:rerun-1"));
        assert!(dry.body["steps"][1]["input"].is_null(), "built from the new order, not shown before it exists");
        let run =
            s.post(&operator, &path, &json!({"reason": "the key was taken", "plan_hash": dry.body["plan_hash"]})).await;
        assert_eq!(run.status, 200, "{run:?}");
        let v = wait_instance(&s, id, 20, |v| v["state"] == "SUCCEEDED").await;
        assert_eq!(provider.effects(&format!("{key}:rerun-1")), 1);
        assert_eq!(v["steps"][0]["operation_key"], format!("{key}:rerun-1"));
        let other = s.record(&key).await.body;
        assert_eq!(other["action"], trigger["action"], "the other operation is left as it was: {other}");
    }
}

/// Concurrent requests to compensate one instance (over two nodes): one wins, the others
/// are told 409 as the winner left it; the compensations run once each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_compensation_requests_run_it_once() {
    let (provider, addr) = start_provider().await;
    let db = Db::new(Backend::Postgres).await;
    // charge on the connector without lookup: a lost reply leaves it UNKNOWN, and the
    // instance pauses for a person (policy manual), before any compensation.
    let config = config(addr)
        .replace(r#"{ name = "charge", connector = "orders""#, r#"{ name = "charge", connector = "cancels""#);
    let a = Server::start_with_config(&db.url, &config);
    let b = Server::start_with_config(&db.url, &config);
    let id = "ORD-CC1";
    provider.script(&format!("{id}:charge"), vec![Step::EffectThenHang]);
    start(&a, id).await;
    let v = wait_instance(&a, id, 30, |v| v["state"] == "PAUSED").await;
    assert_eq!(v["stopped_step"], "charge", "{v:#}");
    let operator = a.create_key("default", "operator");
    let path = format!("/v1/workflows/{}/compensate", enc(id));
    let body = json!({"reason": "the customer cancelled"});
    let answers = futures_util::future::join_all((0..8).map(|i| {
        let s = if i % 2 == 0 { &a } else { &b };
        s.post(&operator, &path, &body)
    }))
    .await;
    let mut statuses: Vec<_> = answers.iter().map(|r| r.status.as_u16()).collect();
    statuses.sort();
    assert_eq!(statuses, [200, 409, 409, 409, 409, 409, 409, 409], "the losers are told 409: {answers:?}");
    let v = wait_instance(&a, id, 30, |v| v["state"] == "COMPENSATED").await;
    for step in ["create_order", "reserve_stock"] {
        assert_eq!(provider.effects(&format!("{id}:{step}:compensate")), 1, "{step}: compensated once: {v:#}");
    }
}

/// The connectors of [`config`] with `order-intake` made of `steps`, each `(name,
/// connector)`: the first takes the instance's customer, the others the first's order.
fn config_with_steps(addr: SocketAddr, steps: &[(&str, &str)]) -> String {
    let c = config(addr);
    let start = c.find("[workflows.order-intake]").unwrap();
    let lines: Vec<String> = steps
        .iter()
        .enumerate()
        .map(|(i, (name, connector))| {
            let input = if i == 0 {
                "customer = { from = \"/input/customer\" }"
            } else {
                "order = { from = \"/steps/create_order/provider_ref\" }"
            };
            format!("  {{ name = \"{name}\", connector = \"{connector}\", input = {{ {input} }} }},")
        })
        .collect();
    format!("{}[workflows.order-intake]\nsteps = [\n{}\n]\n", &c[..start], lines.join("\n"))
}

/// The workflow of [`config`] without compensations.
fn plain_config(addr: SocketAddr) -> String {
    config_with_steps(addr, &[("create_order", "orders"), ("reserve_stock", "orders"), ("charge", "orders")])
}

/// The workflow of [`config`] whose second step runs on `cancels`, which has no lookup:
/// an UNKNOWN outcome there pauses the instance for a person (policy `manual`).
fn manual_config(addr: SocketAddr) -> String {
    config_with_steps(addr, &[("create_order", "orders"), ("notify", "cancels")])
}

/// Break-it finding: a step named to be redone while its operation was UNKNOWN got a new
/// key, but the old operation stayed UNKNOWN in the review queue, and an operator working
/// that queue who resolved it to PENDING had the step performed a second time (two
/// notifications). The re-run now closes the old operation in the same transaction
/// (FAILED, `superseded`, its outcome never known): it leaves the queue and can never be
/// performed again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rerun_closes_the_unknown_operation_it_supersedes() {
    for backend in [Backend::Sqlite, Backend::Postgres] {
        let (provider, addr) = start_provider().await;
        let db = Db::new(backend).await;
        let s = Server::start_with_config(&db.url, &manual_config(addr));
        let id = "ORD-S1";
        // The gateway answers 504 after the provider acted: ambiguous, and nobody to ask.
        provider.script(&format!("{id}:notify"), vec![Step::EffectThenStatus(504)]);
        start(&s, id).await;
        wait_instance(&s, id, 20, |v| v["state"] == "PAUSED").await;
        let old_key = format!("{id}:notify");
        // The reconciler finds nobody to ask and puts it in the review queue.
        let deadline = Instant::now() + Duration::from_secs(10);
        let old = loop {
            let old = s.record(&old_key).await.body;
            if old["needs_review"] == true || Instant::now() > deadline {
                break old;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        assert_eq!((old["state"].as_str(), old["needs_review"].as_bool()), (Some("UNKNOWN"), Some(true)), "{old}");

        let operator = s.create_key("default", "operator");
        let path = format!("/v1/workflows/{}/rerun", enc(id));
        let body = json!({"reason": "customer asked again", "steps": ["notify"]});
        let unconfirmed = s.post(&operator, &path, &body).await;
        assert_eq!((unconfirmed.status.as_u16(), unconfirmed.problem()), (428, "plan-hash-required"));
        let dry = s.post(&operator, &path, &json!({"dry_run": true, "steps": ["notify"]})).await;
        let confirmed =
            json!({"reason": "customer asked again", "steps": ["notify"], "plan_hash": dry.body["plan_hash"]});
        // Sent three times at once (a double click, a retry): one runs, the others are refused.
        let answers = futures_util::future::join_all((0..3).map(|_| s.post(&operator, &path, &confirmed))).await;
        let ok: Vec<_> = answers.iter().filter(|a| a.status == 200).collect();
        assert_eq!(ok.len(), 1, "{answers:?}");
        let refused = |a: &&common::Resp| ["plan-changed", "instance-running"].contains(&a.problem());
        assert!(answers.iter().filter(|a| a.status != 200).all(|a| a.status == 409 && refused(&a)), "{answers:?}");
        wait_instance(&s, id, 20, |v| v["state"] == "SUCCEEDED").await;
        assert_eq!(provider.effects(&format!("{old_key}:rerun-1")), 1);

        let old = s.record(&old_key).await.body;
        assert_eq!(old["state"], "FAILED", "{old}");
        assert_eq!(old["error"]["class"], "superseded", "{old}");
        assert_eq!(old["needs_review"], false, "{old}");
        let message = old["error"]["message"].as_str().unwrap();
        assert!(message.contains(&format!("{old_key}:rerun-1")) && message.contains("never known"), "{message}");
        assert!(message.contains("customer asked again"), "{message}");
        assert!(!message.starts_with("superseded"), "the class is not repeated in the message: {message}");
        let queue = s.get(ADMIN_KEY, "/v1/operations?needs_review=true&limit=500").await.body;
        assert!(!queue.to_string().contains(&format!("\"{old_key}\"")), "left the review queue: {queue}");
        let pending = json!({"to": "PENDING", "reason": "provider says it never arrived"});
        let r = s.post(&operator, &format!("/v1/operations/{}/resolve", enc(&old_key)), &pending).await;
        assert_eq!(r.status, 409, "a closed operation is not resolved again: {r:?}");
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert_eq!(provider.effects(&old_key), 1, "the superseded attempt is never performed again");
        assert_eq!(provider.effects(&format!("{old_key}:rerun-1")), 1);
    }
}
