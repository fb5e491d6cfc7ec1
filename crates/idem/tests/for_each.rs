//! A step for each item of a list against real servers (issue 34): one order, then one HTTP
//! call for each recipient of the input (keyed by the recipient's id, at most two at once),
//! then the step after them — on SQLite and PostgreSQL; kill -9 of `idem serve` before and
//! after each item's call and after its outcome; a reordered list under another instance
//! keys the same items; a refused item compensates exactly the items that completed. Every
//! effect is counted at the provider double.

mod common;

use common::{ADMIN_KEY, Backend, Db, Resp, Server, crash_at_then_restart, start_provider, wait_instance};
use idem::acceptance::provider::{Provider, Step};
use serde_json::{Value, json};
use std::net::SocketAddr;
use std::time::Duration;

const RECIPIENTS: [&str; 4] = ["r1", "r2", "r3", "r4"];

fn config(orders: SocketAddr, on_failure: &str) -> String {
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

[workflows.each]
steps = [
  {{ name = "create_order", connector = "orders", input = {{ customer = {{ from = "/input/customer" }} }}, compensation = {{ action = "cancel_order", connector = "orders" }} }},
  {{ name = "send", connector = "orders", policy = "lookup_before_redo",
     for_each = {{ items = "/input/recipients", id = "/id", max_concurrency = 2, on_failure = "{on_failure}" }},
     input = {{ to = {{ from = "/item/address" }}, order = {{ from = "/steps/create_order/provider_ref" }} }},
     compensation = {{ action = "unsend", connector = "orders" }} }},
  {{ name = "close", connector = "orders", input = {{ sent = {{ from = "/steps/send/result" }} }} }},
]
"#
    )
}

fn recipients(ids: &[&str]) -> Value {
    json!(ids.iter().map(|id| json!({"id": id, "address": format!("{id}@example.org")})).collect::<Vec<_>>())
}

async fn start(s: &Server, id: &str, ids: &[&str]) -> Resp {
    let input = json!({"customer": "C-1", "recipients": recipients(ids)});
    s.post(ADMIN_KEY, "/v1/workflows", &json!({"workflow": "each", "instance_id": id, "input": input})).await
}

/// Instance `id` SUCCEEDED with every effect exactly once: the order, one per recipient,
/// the step after them.
fn assert_effects_once(p: &Provider, v: &Value, id: &str) {
    assert_eq!(v["state"], "SUCCEEDED", "{v:#}");
    let mut keys = vec![format!("{id}:create_order"), format!("{id}:close")];
    keys.extend(RECIPIENTS.iter().map(|r| format!("{id}:send:{r}")));
    for key in keys {
        assert_eq!(p.effects(&key), 1, "{key}: one effect at the provider");
    }
}

async fn each_item_once_then_the_next_step(b: Backend) {
    let (provider, addr) = start_provider().await;
    let db = Db::new(b).await;
    let s = Server::start_with_config(&db.url, &config(addr, "pause"));
    let id = "ORD-1:each";
    assert_eq!(start(&s, id, &RECIPIENTS).await.status, 201);
    let v = wait_instance(&s, id, 20, |v| v["state"] != "RUNNING").await;
    assert_effects_once(&provider, &v, id);
    let items: Vec<_> = v["steps"][1]["items"].as_array().unwrap().iter().map(|i| i["item"].clone()).collect();
    assert_eq!(items, RECIPIENTS.map(Value::from).to_vec(), "{v:#}");
    assert_eq!(v["steps"][1]["items"][0]["operation_key"], "ORD-1:each:send:r1");
    assert_eq!(v["steps"][1]["state"], "SUCCEEDED");
    let metrics = s.http.get(s.url("/metrics")).send().await.unwrap().text().await.unwrap();
    let items = metrics.lines().find(|l| l.starts_with("idem_workflow_branches_total") && l.contains("kind=\"item\""));
    assert!(items.is_some_and(|l| l.contains("SUCCEEDED")), "/metrics counts the items:\n{metrics}");
    // The same start again, even with the list reordered under the same input? No: another
    // input is another intent (422); the same input is the same instance, nothing redone.
    assert_eq!(start(&s, id, &RECIPIENTS).await.status, 200);
    let reordered = ["r3", "r1", "r4", "r2"];
    assert_eq!(start(&s, id, &reordered).await.status, 422);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_effects_once(&provider, &wait_instance(&s, id, 5, |_| true).await, id);
    // An empty list: nothing to do, and the step shows SUCCEEDED once the instance moved
    // past it (it showed NOT_STARTED forever), with no operation of its own.
    let empty = "ORD-1:empty";
    assert_eq!(start(&s, empty, &[]).await.status, 201);
    let v = wait_instance(&s, empty, 20, |v| v["state"] != "RUNNING").await;
    assert_eq!((v["state"].as_str(), v["steps"][1]["state"].as_str()), (Some("SUCCEEDED"), Some("SUCCEEDED")), "{v:#}");
    assert_eq!((v["steps"][1]["items"].clone(), v["steps"][1]["attempts"].clone()), (json!([]), json!(0)));
    assert_eq!(v["current_step"], Value::Null, "{v:#}");
    assert_eq!(provider.effects(&format!("{empty}:close")), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_each_item_once_then_the_next_step() {
    each_item_once_then_the_next_step(Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_each_item_once_then_the_next_step() {
    each_item_once_then_the_next_step(Backend::Postgres).await;
}

/// kill -9 before and after each item's call, and right after its outcome is recorded:
/// after a restart every item and the step after them had their effect exactly once.
async fn kill_9_at_every_item_boundary(b: Backend) {
    let (provider, addr) = start_provider().await;
    let db = Db::new(b).await;
    let config = config(addr, "pause");
    let mut s = Server::start_with_config(&db.url, &config);
    let points = ["executor.before_call", "executor.after_call", "flow.after_step"];
    let crashes: Vec<(&str, &str)> = points.iter().flat_map(|p| ["r1", "r4"].map(move |r| (*p, r))).collect();
    for (i, (point, item)) in crashes.iter().enumerate() {
        let id = format!("ORD-{i}:{}", point.replace('.', "-"));
        let crash_at = format!("{point}@{id}:send:{item}");
        drop(s);
        let input = json!({"customer": "C-1", "recipients": recipients(&RECIPIENTS)});
        let body = json!({"workflow": "each", "instance_id": id, "input": input});
        s = crash_at_then_restart(&db.url, &config, &crash_at, &body).await;
        let v = wait_instance(&s, &id, 30, |v| v["state"] != "RUNNING").await;
        assert_effects_once(&provider, &v, &id);
        eprintln!("kill -9 at {crash_at}: finished, each item and the next step once");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_kill_9_at_every_item_boundary() {
    kill_9_at_every_item_boundary(Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_kill_9_at_every_item_boundary() {
    kill_9_at_every_item_boundary(Backend::Postgres).await;
}

/// An item refused by the provider under `compensate`: exactly the order and the items
/// that completed are compensated, each once; the step after them never runs.
async fn a_refused_item_compensates_the_completed_ones(b: Backend) {
    let (provider, addr) = start_provider().await;
    let db = Db::new(b).await;
    let s = Server::start_with_config(&db.url, &config(addr, "compensate"));
    let id = "ORD-2:each";
    provider.script(&format!("{id}:send:r3"), vec![Step::Status(422, None)]);
    assert_eq!(start(&s, id, &RECIPIENTS).await.status, 201);
    let v = wait_instance(&s, id, 20, |v| !matches!(v["state"].as_str(), Some("RUNNING" | "COMPENSATING"))).await;
    assert_eq!(v["state"], "COMPENSATED", "{v:#}");
    let mut compensated = 1; // the order
    assert_eq!(provider.effects(&format!("{id}:create_order:compensate")), 1);
    for r in RECIPIENTS {
        let key = format!("{id}:send:{r}");
        let done = provider.effects(&key);
        assert!(done <= 1, "{key}");
        assert_eq!(provider.effects(&format!("{key}:compensate")), done, "{key}: compensated once iff it completed");
        compensated += done;
    }
    assert_eq!(provider.effects(&format!("{id}:send:r3")), 0);
    assert_eq!(provider.calls(&format!("{id}:close")), 0, "nothing after the failed step runs");
    eprintln!("{compensated} compensations, each once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_refused_item_compensates_the_completed_ones() {
    a_refused_item_compensates_the_completed_ones(Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_refused_item_compensates_the_completed_ones() {
    a_refused_item_compensates_the_completed_ones(Backend::Postgres).await;
}

/// An item refused by the provider under `pause`: the instance PAUSED on it. The dry run
/// lists each item with what happens to it — only the refused one is redone, under
/// `…:rerun-1`, with the input it would send — and the operator's re-run with the dry
/// run's plan hash performs only that item again, then the step after them. At the
/// provider: every item exactly once under its key (the refused one: no effect under its
/// old key, one under the new), the order and the join once.
async fn an_operator_reruns_only_the_refused_item(b: Backend) {
    let (provider, addr) = start_provider().await;
    let db = Db::new(b).await;
    let s = Server::start_with_config(&db.url, &config(addr, "pause"));
    let id = "ORD-3:each";
    provider.script(&format!("{id}:send:r3"), vec![Step::Status(422, None)]);
    assert_eq!(start(&s, id, &RECIPIENTS).await.status, 201);
    // Paused, and no item still on its way (a sibling in flight finishes by itself).
    let settled = |v: &Value| {
        v["state"] == "PAUSED"
            && v["steps"][1]["items"].as_array().is_some_and(|items| {
                items.iter().all(|i| !matches!(i["state"].as_str(), Some("EXECUTING" | "PENDING")))
            })
    };
    let v = wait_instance(&s, id, 20, settled).await;
    assert_eq!(v["steps"][1]["items"][2]["state"], "FAILED", "{v:#}");
    assert_eq!(provider.calls(&format!("{id}:close")), 0);

    let operator = s.create_key("default", "operator");
    let path = format!("/v1/workflows/{}/rerun", common::enc(id));
    let dry = s.post(&operator, &path, &json!({"dry_run": true})).await;
    assert_eq!(dry.status, 200, "{dry:?}");
    let send = &dry.body["steps"][1];
    assert_eq!(send["disposition"], "redone", "{send:#}");
    let lines: Vec<(String, String)> = send["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| (i["item"].as_str().unwrap().to_owned(), i["disposition"].as_str().unwrap().to_owned()))
        .collect();
    let expected: Vec<(String, String)> = RECIPIENTS
        .iter()
        .map(|r| {
            let done = provider.effects(&format!("{id}:send:{r}")) == 1;
            let what = match (*r, done) {
                ("r3", _) => "redone",
                (_, true) => "kept",
                (_, false) => "runs",
            };
            ((*r).to_owned(), what.to_owned())
        })
        .collect();
    assert_eq!(lines, expected, "{send:#}");
    assert_eq!(send["items"][2]["key"], format!("{id}:send:r3:rerun-1"));
    let order = provider.effects(&format!("{id}:create_order"));
    assert_eq!(order, 1);
    assert_eq!(send["items"][2]["input"]["to"], "r3@example.org", "shows what it would send: {send:#}");
    assert_eq!(dry.body["steps"][2]["disposition"], "runs");

    let run =
        s.post(&operator, &path, &json!({"reason": "the address was fixed", "plan_hash": dry.body["plan_hash"]})).await;
    assert_eq!(run.status, 200, "{run:?}");
    let v = wait_instance(&s, id, 20, |v| !matches!(v["state"].as_str(), Some("RUNNING" | "PAUSED"))).await;
    assert_eq!(v["state"], "SUCCEEDED", "{v:#}");
    assert_eq!(v["steps"][1]["items"][2]["operation_key"], format!("{id}:send:r3:rerun-1"));
    assert_eq!(provider.effects(&format!("{id}:send:r3")), 0, "the refused attempt had no effect");
    assert_eq!(provider.effects(&format!("{id}:send:r3:rerun-1")), 1, "the re-run item: once, under its new key");
    for key in ["create_order".to_owned(), "close".to_owned()]
        .into_iter()
        .chain(["r1", "r2", "r4"].map(|r| format!("send:{r}")))
    {
        assert_eq!(provider.effects(&format!("{id}:{key}")), 1, "{key}: once");
    }
    assert_eq!(v["steps"][2]["state"], "SUCCEEDED");
    let old = s.record(&format!("{id}:send:r3")).await.body;
    assert_eq!(old["state"], "FAILED", "the old attempt stays with its own outcome");
    let e = v["events"].as_array().unwrap().iter().find(|e| e["kind"] == "rerun").unwrap().clone();
    assert!(e["reason"].as_str().unwrap().contains(&format!("send item r3 redone as {id}:send:r3:rerun-1")), "{e}");
    // Nothing is left to redo; a second request with the same hash changes nothing.
    let again = s.post(&operator, &path, &json!({"reason": "again", "plan_hash": dry.body["plan_hash"]})).await;
    assert_eq!(again.status.as_u16(), 409, "{again:?}");
    assert_eq!(provider.effects(&format!("{id}:send:r3:rerun-1")), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_an_operator_reruns_only_the_refused_item() {
    an_operator_reruns_only_the_refused_item(Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_an_operator_reruns_only_the_refused_item() {
    an_operator_reruns_only_the_refused_item(Backend::Postgres).await;
}

/// Under `compensate`, an item's compensation refused by the provider pauses the
/// compensation; the operator's re-run redoes that item's compensation under
/// `{item key}:compensate-2` (the dry run says so, item by item), and the compensation
/// goes on to the order. Each compensation at most once per key at the provider double.
async fn a_rerun_redoes_a_failed_item_compensation(b: Backend) {
    let (provider, addr) = start_provider().await;
    let db = Db::new(b).await;
    let s = Server::start_with_config(&db.url, &config(addr, "compensate"));
    let id = "ORD-4:each";
    provider.script(&format!("{id}:send:r3"), vec![Step::Status(422, None)]);
    provider.script(&format!("{id}:send:r1:compensate"), vec![Step::Status(422, None)]);
    assert_eq!(start(&s, id, &RECIPIENTS).await.status, 201);
    let v = wait_instance(&s, id, 20, |v| !matches!(v["state"].as_str(), Some("RUNNING" | "COMPENSATING"))).await;
    assert_eq!(v["state"], "PAUSED", "{v:#}");
    assert_eq!(provider.effects(&format!("{id}:send:r1:compensate")), 0);

    let operator = s.create_key("default", "operator");
    let path = format!("/v1/workflows/{}/rerun", common::enc(id));
    let dry = s.post(&operator, &path, &json!({"dry_run": true})).await;
    assert_eq!(dry.status, 200, "{dry:?}");
    assert_eq!(dry.body["resumes_as"], "COMPENSATING");
    let r1 = &dry.body["steps"][1]["items"][0];
    assert_eq!((r1["item"].as_str(), r1["disposition"].as_str()), (Some("r1"), Some("compensated")), "{dry:?}");
    assert_eq!(r1["key"], format!("{id}:send:r1:compensate-2"));
    assert_eq!(r1["action"], "unsend");
    assert_eq!(dry.body["steps"][0]["disposition"], "compensation_runs", "then the order: {dry:?}");

    let run = s.post(&operator, &path, &json!({"reason": "unsend is fixed", "plan_hash": dry.body["plan_hash"]})).await;
    assert_eq!(run.status, 200, "{run:?}");
    let v = wait_instance(&s, id, 20, |v| !matches!(v["state"].as_str(), Some("RUNNING" | "COMPENSATING"))).await;
    assert_eq!(v["state"], "COMPENSATED", "{v:#}");
    assert_eq!(provider.effects(&format!("{id}:send:r1:compensate-2")), 1, "redone once, under its new key");
    assert_eq!(provider.effects(&format!("{id}:send:r1:compensate")), 0, "the refused attempt had no effect");
    assert_eq!(provider.effects(&format!("{id}:create_order:compensate")), 1);
    for r in RECIPIENTS {
        let key = format!("{id}:send:{r}");
        let undone = provider.effects(&format!("{key}:compensate")) + provider.effects(&format!("{key}:compensate-2"));
        assert_eq!(undone, provider.effects(&key), "{key}: compensated once iff it completed");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_rerun_redoes_a_failed_item_compensation() {
    a_rerun_redoes_a_failed_item_compensation(Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_rerun_redoes_a_failed_item_compensation() {
    a_rerun_redoes_a_failed_item_compensation(Backend::Postgres).await;
}
