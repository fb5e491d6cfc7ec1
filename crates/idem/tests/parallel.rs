//! Parallel branches against real servers (issue 34): a declared fan-out — one order, then
//! three HTTP branches of group `notify` at once, then the join — on SQLite and PostgreSQL;
//! kill -9 of `idem serve` before and after each branch's call, after each branch's
//! outcome and at the join; a failing branch under `on_failure = "compensate"` (exactly the
//! completed branches compensated, each once) and `"pause"`; and the code-driven mode
//! (branches acquired at once, the step after them refused until all SUCCEEDED). Every
//! effect is counted at the provider double.

mod common;

use common::{
    ADMIN_KEY, Backend, Db, Resp, Server, crash_at_then_restart, enc, instance, start_provider, ui_session,
    wait_instance,
};
use idem::acceptance::provider::{Provider, Step};
use serde_json::{Value, json};
use std::net::SocketAddr;
use std::time::Duration;

const BRANCHES: [&str; 3] = ["email", "chat", "data"];

/// create_order → email, chat, data (group `notify`, `on_failure`) → close; every step and
/// compensation over HTTP at the provider double.
fn config(orders: SocketAddr, on_failure: &str) -> String {
    config_with(orders, on_failure, "lookup_before_redo")
}

/// [`config`] with branch `data`'s recovery policy `data_policy`.
fn config_with(orders: SocketAddr, on_failure: &str, data_policy: &str) -> String {
    let branch = |name: &str| {
        let policy = if name == "data" { data_policy } else { "lookup_before_redo" };
        format!(
            r#"  {{ name = "{name}", group = "notify", connector = "orders", policy = "{policy}", input = {{ order = {{ from = "/steps/create_order/provider_ref" }} }}, compensation = {{ action = "undo_{name}", connector = "orders" }} }},"#
        )
    };
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

[workflows.fan-out]
steps = [
  {{ name = "create_order", connector = "orders", input = {{ customer = {{ from = "/input/customer" }} }}, compensation = {{ action = "cancel_order", connector = "orders" }} }},
{b0}
{b1}
{b2}
  {{ name = "close", connector = "orders", input = {{ email = {{ from = "/steps/email/provider_ref" }}, chat = {{ from = "/steps/chat/provider_ref" }}, data = {{ from = "/steps/data/provider_ref" }} }} }},
]
[[workflows.fan-out.groups]]
name = "notify"
on_failure = "{on_failure}"
"#,
        b0 = branch("email"),
        b1 = branch("chat"),
        b2 = branch("data"),
    )
}

async fn start(s: &Server, id: &str) -> Resp {
    s.post(ADMIN_KEY, "/v1/workflows", &json!({"workflow": "fan-out", "instance_id": id, "input": {"customer": "C-1"}}))
        .await
}

/// The keys of instance `id`'s operations: the order, each branch, the join.
fn keys(id: &str) -> Vec<String> {
    let mut keys = vec![format!("{id}:create_order")];
    keys.extend(BRANCHES.iter().map(|b| format!("{id}:notify:{b}")));
    keys.push(format!("{id}:close"));
    keys
}

/// Instance `id` SUCCEEDED with every effect exactly once at the provider.
fn assert_effects_once(p: &Provider, v: &Value, id: &str) {
    assert_eq!(v["state"], "SUCCEEDED", "{v:#}");
    for key in keys(id) {
        assert_eq!(p.effects(&key), 1, "{key}: one effect at the provider");
    }
}

async fn fan_out_runs_every_branch_once_and_joins(b: Backend) {
    let (provider, addr) = start_provider().await;
    let db = Db::new(b).await;
    let s = Server::start_with_config(&db.url, &config(addr, "pause"));
    let id = "ORD-1:fan";
    assert_eq!(start(&s, id).await.status, 201);
    let v = wait_instance(&s, id, 20, |v| v["state"] != "RUNNING").await;
    assert_effects_once(&provider, &v, id);
    // `wf get` (the API) shows the group with each branch's state and its key.
    let groups = &v["groups"];
    assert_eq!(groups[0]["name"], "notify", "{v:#}");
    assert_eq!(groups[0]["state"], "SUCCEEDED");
    assert_eq!(groups[0]["on_failure"], "pause");
    let branches: Vec<_> = groups[0]["branches"].as_array().unwrap().iter().map(|b| b["step"].clone()).collect();
    assert_eq!(branches, BRANCHES.map(Value::from).to_vec());
    assert_eq!(v["steps"][2]["operation_key"], "ORD-1:fan:notify:chat");
    assert_eq!(v["steps"][2]["group"], "notify");
    // The join got every branch's reference.
    let close = provider.order_ids(&format!("{id}:close"));
    assert_eq!(close.len(), 1);
    // A start again is the same instance: nothing runs again.
    assert_eq!(start(&s, id).await.status, 200);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_effects_once(&provider, &instance(&s, id).await, id);
    // The admin page shows the group with each branch's state.
    let cookie = ui_session(&s, ADMIN_KEY).await;
    let page = s.http.get(s.url(&format!("/ui/workflows/{}", enc(id)))).header("cookie", cookie).send().await.unwrap();
    let page = page.text().await.unwrap();
    assert!(page.contains("Parallel groups") && page.contains("notify"), "{page}");
    let metrics = s.http.get(s.url("/metrics")).send().await.unwrap().text().await.unwrap();
    assert!(metrics.contains("idem_workflow_branches_total"), "/metrics counts branches");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_fan_out_runs_every_branch_once_and_joins() {
    fan_out_runs_every_branch_once_and_joins(Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_fan_out_runs_every_branch_once_and_joins() {
    fan_out_runs_every_branch_once_and_joins(Backend::Postgres).await;
}

/// kill -9 before and after each branch's call, right after each branch's outcome is
/// recorded, and at the join (before and after its call): after a restart every branch and
/// the step after the group have had their effect exactly once.
async fn kill_9_at_every_branch_boundary(b: Backend) {
    let (provider, addr) = start_provider().await;
    let db = Db::new(b).await;
    let config = config(addr, "pause");
    let mut s = Server::start_with_config(&db.url, &config);
    let points = ["executor.before_call", "executor.after_call", "flow.after_step"];
    let mut crashes: Vec<(String, String)> =
        points.iter().flat_map(|p| BRANCHES.iter().map(move |b| (p.to_string(), format!("notify:{b}")))).collect();
    crashes.push(("executor.before_call".into(), "close".into()));
    crashes.push(("executor.after_call".into(), "close".into()));
    for (i, (point, step)) in crashes.iter().enumerate() {
        let id = format!("ORD-{i}:{}", point.replace('.', "-"));
        let crash_at = format!("{point}@{id}:{step}");
        drop(s);
        let body = json!({"workflow": "fan-out", "instance_id": id, "input": {"customer": "C-1"}});
        s = crash_at_then_restart(&db.url, &config, &crash_at, &body).await;
        let v = wait_instance(&s, &id, 30, |v| v["state"] != "RUNNING").await;
        assert_effects_once(&provider, &v, &id);
        eprintln!("kill -9 at {crash_at}: finished, each branch and the join once");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_kill_9_at_every_branch_boundary() {
    kill_9_at_every_branch_boundary(Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_kill_9_at_every_branch_boundary() {
    kill_9_at_every_branch_boundary(Backend::Postgres).await;
}

/// A branch refused by the provider (422): under `compensate` the instance compensates
/// exactly the order and the branches that completed, each once, never the failed branch,
/// and the join never runs; under `pause` it pauses naming the branch, the others kept.
async fn a_failed_branch_follows_the_group_policy(b: Backend) {
    let (provider, addr) = start_provider().await;
    let db = Db::new(b).await;
    let s = Server::start_with_config(&db.url, &config(addr, "compensate"));
    let id = "ORD-2:fan";
    provider.script(&format!("{id}:notify:chat"), vec![Step::Status(422, None)]);
    assert_eq!(start(&s, id).await.status, 201);
    let v = wait_instance(&s, id, 20, |v| !matches!(v["state"].as_str(), Some("RUNNING" | "COMPENSATING"))).await;
    assert_eq!(v["state"], "COMPENSATED", "{v:#}");
    assert_eq!(v["groups"][0]["state"], "STOPPED", "{v:#}");
    for done in [format!("{id}:create_order"), format!("{id}:notify:email"), format!("{id}:notify:data")] {
        assert_eq!(provider.effects(&done), 1, "{done}");
        assert_eq!(provider.effects(&format!("{done}:compensate")), 1, "{done} compensated once");
    }
    assert_eq!(provider.effects(&format!("{id}:notify:chat:compensate")), 0, "the failed branch had no effect");
    assert_eq!(provider.calls(&format!("{id}:close")), 0, "nothing after the group runs");
    drop(s);

    let s = Server::start_with_config(&db.url, &config(addr, "pause"));
    let id = "ORD-3:fan";
    provider.script(&format!("{id}:notify:data"), vec![Step::Status(422, None)]);
    assert_eq!(start(&s, id).await.status, 201);
    let v = wait_instance(&s, id, 20, |v| v["state"] != "RUNNING").await;
    assert_eq!(v["state"], "PAUSED", "{v:#}");
    assert_eq!(v["stopped_step"], "data");
    assert_eq!(v["error"]["class"], "branch_failed");
    let states: Vec<_> = v["groups"][0]["branches"].as_array().unwrap().iter().map(|b| b["state"].clone()).collect();
    assert_eq!(states, vec![json!("SUCCEEDED"), json!("SUCCEEDED"), json!("FAILED")]);
    assert_eq!(provider.calls(&format!("{id}:close")), 0);
    // An operator re-runs the failed branch: only it runs again (under a new key), then the join.
    let r = s
        .post(ADMIN_KEY, &format!("/v1/workflows/{}/rerun", enc(id)), &json!({"steps": ["data"], "reason": "fixed"}))
        .await;
    assert!(r.status == 200 || r.status == 202, "{r:?}");
    let v = wait_instance(&s, id, 20, |v| v["state"] != "RUNNING").await;
    assert_eq!(v["state"], "SUCCEEDED", "{v:#}");
    assert_eq!(provider.effects(&format!("{id}:notify:data:rerun-1")), 1);
    for key in [format!("{id}:notify:email"), format!("{id}:notify:chat"), format!("{id}:close")] {
        assert_eq!(provider.effects(&key), 1, "{key}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_failed_branch_follows_the_group_policy() {
    a_failed_branch_follows_the_group_policy(Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_failed_branch_follows_the_group_policy() {
    a_failed_branch_follows_the_group_policy(Backend::Postgres).await;
}

/// Code-driven: two branches acquired at once (both 201), the step after them refused with
/// `previous-step-unfinished` until both SUCCEEDED; a step after a sequential one keeps the
/// refusal as before.
async fn code_driven_branches_run_at_once(b: Backend) {
    let db = Db::new(b).await;
    let s = Server::start_with_config(&db.url, "[executor]\npoll_interval_ms = 50\n");
    let id = "ORD-4:driven";
    let steps = json!([
        {"name": "intake"},
        {"name": "email", "group": "notify"},
        {"name": "chat", "group": "notify"},
        {"name": "close"}
    ]);
    let r = s.post(ADMIN_KEY, "/v1/workflows", &json!({"workflow": "driven", "instance_id": id, "steps": steps})).await;
    assert_eq!(r.status, 201, "{r:?}");
    let step = |name: &str| format!("/v1/workflows/{}/steps/{name}", enc(id));
    let acquire = |name: &'static str| {
        let s = &s;
        let path = step(name);
        async move { s.post(ADMIN_KEY, &path, &json!({"payload": {"n": name}})).await }
    };
    let r = acquire("email").await;
    assert_eq!(r.status, 409, "a branch waits for the steps before its group: {r:?}");
    assert_eq!(r.body["type"].as_str().unwrap().rsplit('/').next(), Some("previous-step-unfinished"));
    let r = acquire("intake").await;
    assert_eq!(r.status, 201);
    let token = r.body["fencing_token"].clone();
    let c = s
        .post(
            ADMIN_KEY,
            &format!("{}/complete", step("intake")),
            &json!({"fencing_token": token, "outcome": "succeeded", "provider_ref": "in-1"}),
        )
        .await;
    assert_eq!(c.status, 200, "{c:?}");
    let (email, chat) = tokio::join!(acquire("email"), acquire("chat"));
    assert!(email.status == 201 && chat.status == 201, "siblings run at once: {email:?} {chat:?}");
    assert_eq!(email.body["key"], "ORD-4:driven:notify:email");
    let r = acquire("close").await;
    assert_eq!(r.status, 409, "the join waits for every branch");
    assert_eq!(r.body["type"].as_str().unwrap().rsplit('/').next(), Some("previous-step-unfinished"));
    for (name, got) in [("email", &email), ("chat", &chat)] {
        let body = json!({"fencing_token": got.body["fencing_token"], "outcome": "succeeded", "provider_ref": format!("{name}-1")});
        assert_eq!(s.post(ADMIN_KEY, &format!("{}/complete", step(name)), &body).await.status, 200);
    }
    assert_eq!(acquire("email").await.status, 200, "a finished branch replays");
    let r = acquire("close").await;
    assert_eq!(r.status, 201, "{r:?}");
    let body = json!({"fencing_token": r.body["fencing_token"], "outcome": "succeeded", "provider_ref": "close-1"});
    assert_eq!(s.post(ADMIN_KEY, &format!("{}/complete", step("close")), &body).await.status, 200);
    let v = wait_instance(&s, id, 10, |v| v["state"] != "RUNNING").await;
    assert_eq!(v["state"], "SUCCEEDED", "{v:#}");
    assert_eq!(v["groups"][0]["state"], "SUCCEEDED");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_code_driven_branches_run_at_once() {
    code_driven_branches_run_at_once(Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_code_driven_branches_run_at_once() {
    code_driven_branches_run_at_once(Backend::Postgres).await;
}

/// A sibling's failure begins the compensation while branch `data` acted and its answer
/// was lost (UNKNOWN): the compensation waits for it to settle — its lookup, or with
/// `manual` a person — and then undoes it too, once. kill -9 right after the failing
/// branch's outcome leaves `data` EXECUTING under a dead node's lease: the restarted node
/// waits for the lease to lapse and the lookup. Before, `data` was skipped and its effect,
/// found later, was never compensated.
async fn compensation_waits_for_an_unknown_branch(b: Backend) {
    let (provider, addr) = start_provider().await;
    let db = Db::new(b).await;
    let compensated_once = |id: &str| {
        for done in ["create_order", "notify:email", "notify:data"].map(|k| format!("{id}:{k}")) {
            assert_eq!(provider.effects(&done), 1, "{done}");
            assert_eq!(provider.effects(&format!("{done}:compensate")), 1, "{done} compensated once");
        }
        assert_eq!(provider.effects(&format!("{id}:notify:chat:compensate")), 0, "the failed branch had no effect");
        assert_eq!(provider.calls(&format!("{id}:close")), 0, "nothing after the group runs");
    };
    let settled = |v: &Value| !matches!(v["state"].as_str(), Some("RUNNING" | "COMPENSATING"));
    let script = |id: &str| {
        provider.script(&format!("{id}:notify:chat"), vec![Step::Status(422, None)]);
        provider.script(&format!("{id}:notify:data"), vec![Step::EffectThenHang]);
    };

    // The lookup settles it: found, so compensated.
    let config = config(addr, "compensate");
    let s = Server::start_with_config(&db.url, &config);
    let id = "ORD-4:fan";
    script(id);
    assert_eq!(start(&s, id).await.status, 201);
    let v = wait_instance(&s, id, 30, settled).await;
    assert_eq!(v["state"], "COMPENSATED", "{v:#}");
    compensated_once(id);

    // kill -9 right after chat's failure is recorded, data's call hanging.
    drop(s);
    let id = "ORD-5:fan";
    script(id);
    let body = json!({"workflow": "fan-out", "instance_id": id, "input": {"customer": "C-1"}});
    let s = crash_at_then_restart(&db.url, &config, &format!("flow.after_step@{id}:notify:chat"), &body).await;
    let v = wait_instance(&s, id, 30, settled).await;
    assert_eq!(v["state"], "COMPENSATED", "{v:#}");
    compensated_once(id);
    drop(s);

    // `manual`: the compensation pauses for a person, who finds the effect and says so.
    let s = Server::start_with_config(&db.url, &config_with(addr, "compensate", "manual"));
    let id = "ORD-6:fan";
    script(id);
    assert_eq!(start(&s, id).await.status, 201);
    let v = wait_instance(&s, id, 30, settled).await;
    assert_eq!(v["state"], "PAUSED", "{v:#}");
    assert_eq!(v["error"]["class"], "compensation_unknown", "{v:#}");
    assert_eq!(v["stopped_step"], "data", "{v:#}");
    assert_eq!(provider.effects(&format!("{id}:notify:email:compensate")), 0, "nothing undone before it settles");
    let key = format!("{id}:notify:data");
    let resolve = json!({"to": "SUCCEEDED", "reason": "the data platform shows the row", "evidence": "row-1"});
    let r = s.post(ADMIN_KEY, &format!("/v1/operations/{}/resolve", enc(&key)), &resolve).await;
    assert_eq!(r.status, 200, "{r:?}");
    let v = wait_instance(&s, id, 30, |v| v["state"] == "COMPENSATED").await;
    assert_eq!(v["state"], "COMPENSATED", "{v:#}");
    compensated_once(id);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_compensation_waits_for_an_unknown_branch() {
    compensation_waits_for_an_unknown_branch(Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_compensation_waits_for_an_unknown_branch() {
    compensation_waits_for_an_unknown_branch(Backend::Postgres).await;
}

/// Nothing new is performed while compensating: a branch whose lookup proved its effect
/// absent (PENDING, due for another attempt), or that an operator resolved to PENDING during
/// the compensation's pause, is closed FAILED ("not performed again") instead of being
/// performed only to be undone. Before, the executor performed it again meanwhile.
async fn nothing_new_is_performed_while_compensating(b: Backend) {
    let (provider, addr) = start_provider().await;
    let db = Db::new(b).await;
    let settled = |v: &Value| !matches!(v["state"].as_str(), Some("RUNNING" | "COMPENSATING"));
    let s = Server::start_with_config(&db.url, &config(addr, "compensate"));
    let id = "ORD-7:fan";
    provider.script(&format!("{id}:notify:chat"), vec![Step::Status(422, None)]);
    provider.script(&format!("{id}:notify:data"), vec![Step::Hang, Step::Ok]);
    assert_eq!(start(&s, id).await.status, 201);
    let v = wait_instance(&s, id, 30, settled).await;
    assert_eq!(v["state"], "COMPENSATED", "{v:#}");
    let data = format!("{id}:notify:data");
    assert_eq!((provider.calls(&data), provider.effects(&data)), (1, 0), "data was not called again");
    assert_eq!(provider.calls(&format!("{data}:compensate")), 0, "nothing to undo");
    let op = s.get(ADMIN_KEY, &format!("/v1/operations/{}", enc(&data))).await;
    assert_eq!(op.body["state"], "FAILED", "{op:?}");
    drop(s);

    let s = Server::start_with_config(&db.url, &config_with(addr, "compensate", "manual"));
    let id = "ORD-8:fan";
    provider.script(&format!("{id}:notify:chat"), vec![Step::Status(422, None)]);
    provider.script(&format!("{id}:notify:data"), vec![Step::EffectThenHang, Step::Ok]);
    assert_eq!(start(&s, id).await.status, 201);
    let v = wait_instance(&s, id, 30, settled).await;
    assert_eq!(v["error"]["class"], "compensation_unknown", "{v:#}");
    let data = format!("{id}:notify:data");
    let pending = json!({"to": "PENDING", "reason": "the operator believes it did not happen"});
    let r = s.post(ADMIN_KEY, &format!("/v1/operations/{}/resolve", enc(&data)), &pending).await;
    assert_eq!(r.status, 200, "{r:?}");
    let v = wait_instance(&s, id, 30, |v| v["state"] == "COMPENSATED").await;
    assert_eq!(v["state"], "COMPENSATED", "{v:#}");
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(provider.calls(&data), 1, "not performed again after the resolution to PENDING");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_nothing_new_is_performed_while_compensating() {
    nothing_new_is_performed_while_compensating(Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_nothing_new_is_performed_while_compensating() {
    nothing_new_is_performed_while_compensating(Backend::Postgres).await;
}

/// kill -9 while the instance compensates and a `redo_safe` branch's call hangs after
/// acting: after the restart its lapsed lease is re-granted (as its declaration allows),
/// the compensation waits for that attempt and then undoes it; the instance ends
/// COMPENSATED. Before, the executor left it alone while compensating and the
/// compensation waited forever.
async fn a_redo_safe_branch_in_flight_when_a_compensating_node_dies_is_settled(b: Backend) {
    let (provider, addr) = start_provider().await;
    let db = Db::new(b).await;
    // data's call hangs for up to 15 s (its timeout) under a 16 s lease: the kill comes
    // while it is in flight, however loaded the machine (4 s was seen to be too short
    // beside the whole suite).
    let config = config_with(addr, "compensate", "redo_safe")
        .replace("timeout_ms = 800", "timeout_ms = 15000")
        .replace("lease_ms = 1500", "lease_ms = 16000");
    let s = Server::start_with_config(&db.url, &config);
    let id = "ORD-9:fan";
    provider.script(&format!("{id}:notify:chat"), vec![Step::Status(422, None)]);
    provider.script(&format!("{id}:notify:data"), vec![Step::EffectThenHang, Step::Ok]);
    assert_eq!(start(&s, id).await.status, 201);
    let v = wait_instance(&s, id, 30, |v| v["state"] != "RUNNING").await;
    assert_eq!(v["state"], "COMPENSATING", "{v:#}");
    let data = format!("{id}:notify:data");
    let op = s.get(ADMIN_KEY, &format!("/v1/operations/{}", enc(&data))).await;
    // Usually the compensation begins while data's call hangs (the case this test is for).
    // Under load the pass that ran the branches may begin it only once data's call timed
    // out (UNKNOWN, then its lookup): the kill then tests that path, which must settle too.
    eprintln!("data is {} when the node is killed", op.body["state"]);
    drop(s); // kill -9
    let s = Server::start_with_config(&db.url, &config);
    let v = wait_instance(&s, id, 60, |v| v["state"] != "COMPENSATING").await;
    assert_eq!(v["state"], "COMPENSATED", "{v:#}");
    assert!(provider.effects(&data) >= 1);
    assert_eq!(provider.calls(&format!("{data}:compensate")), 1, "data's effect undone once");
    assert_eq!(provider.calls(&format!("{id}:close")), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_redo_safe_branch_in_flight_when_a_compensating_node_dies_is_settled() {
    a_redo_safe_branch_in_flight_when_a_compensating_node_dies_is_settled(Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_redo_safe_branch_in_flight_when_a_compensating_node_dies_is_settled() {
    a_redo_safe_branch_in_flight_when_a_compensating_node_dies_is_settled(Backend::Postgres).await;
}
