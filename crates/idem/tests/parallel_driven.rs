//! Code-driven parallel groups with settings, against real servers on SQLite and
//! PostgreSQL: a start's `groups` (`on_failure`, `max_concurrency`) checked like
//! `[[workflows.NAME.groups]]` and part of the instance's intent; `max_concurrency` held for
//! branches your code acquires (a refused acquire answers 409 `previous-step-unfinished`
//! with `Retry-After` and records nothing); a failing branch under `pause` and `compensate`;
//! the branches' completions counted in `/metrics`; `idem wf start --steps/--group`.

mod common;

use common::{ADMIN_KEY, Backend, Db, Resp, Server, enc, idem_bin, instance, metric};
use serde_json::{Value, json};
use std::process::Command;

fn server(db: &Db) -> Server {
    Server::start_with_config(&db.url, "[executor]\npoll_interval_ms = 50\n")
}

/// Branches `names` of group `notify`, then `close`.
fn fan_out(names: &[&str]) -> Value {
    let mut steps: Vec<Value> = names.iter().map(|n| json!({"name": n, "group": "notify"})).collect();
    steps.push(json!({"name": "close"}));
    Value::Array(steps)
}

async fn start(s: &Server, id: &str, steps: Value, groups: Option<Value>) -> Resp {
    let mut body = json!({"workflow": "driven", "instance_id": id, "steps": steps});
    if let Some(g) = groups {
        body["groups"] = g;
    }
    s.post(ADMIN_KEY, "/v1/workflows", &body).await
}

async fn acquire(s: &Server, id: &str, step: &str) -> Resp {
    let body = json!({"payload": {"step": step}, "lease_ms": 30_000});
    s.post(ADMIN_KEY, &format!("/v1/workflows/{}/steps/{step}", enc(id)), &body).await
}

async fn complete(s: &Server, id: &str, step: &str, token: &Value, outcome: &str) -> Resp {
    let mut body = json!({"fencing_token": token, "outcome": outcome});
    match outcome {
        "succeeded" => body["provider_ref"] = json!(format!("{step}-1")),
        "unknown" => body["message"] = json!("the provider timed out"),
        _ => body["error_class"] = json!("bounced"),
    }
    s.post(ADMIN_KEY, &format!("/v1/workflows/{}/steps/{step}/complete", enc(id)), &body).await
}

async fn branches_metric(s: &Server, outcome: &str) -> f64 {
    let text = s.http.get(s.url("/metrics")).send().await.unwrap().text().await.unwrap();
    metric(&text, "idem_workflow_branches_total", &[("kind", "branch"), ("outcome", outcome)])
}

/// `max_concurrency = 1`: the second branch's acquire is refused (409, `Retry-After`, the
/// group and its limit named, nothing recorded) until the first completed; then granted.
/// Each completion moves `idem_workflow_branches_total{kind="branch"}` once.
async fn one_branch_at_once(b: Backend) {
    let db = Db::new(b).await;
    let s = server(&db);
    let id = "ORD-50:one";
    let groups = json!([{"name": "notify", "max_concurrency": 1}]);
    assert_eq!(start(&s, id, fan_out(&["email", "chat"]), Some(groups)).await.status, 201);
    let email = acquire(&s, id, "email").await;
    assert_eq!(email.status, 201, "{email:?}");
    let chat = acquire(&s, id, "chat").await;
    assert_eq!(chat.status, 409, "{chat:?}");
    assert_eq!(chat.problem(), "previous-step-unfinished");
    assert_eq!(chat.body["state"], "EXECUTING");
    let detail = chat.body["detail"].as_str().unwrap();
    assert!(detail.contains("\"notify\"") && detail.contains("at most 1") && detail.contains("email"), "{detail}");
    let wait: u64 = chat.header("retry-after").expect("Retry-After").parse().unwrap();
    assert!((1..=30).contains(&wait), "the first lease ends within 30 s: {wait}");
    let refused = s.get(ADMIN_KEY, &format!("/v1/operations/{}", enc(&format!("{id}:notify:chat")))).await;
    assert_eq!(refused.status, 404, "a refused acquire records nothing: {refused:?}");
    assert_eq!(acquire(&s, id, "close").await.problem(), "previous-step-unfinished", "the join still waits");

    let before = branches_metric(&s, "SUCCEEDED").await;
    let token = email.body["fencing_token"].clone();
    assert_eq!(complete(&s, id, "email", &token, "succeeded").await.status, 200);
    assert_eq!(branches_metric(&s, "SUCCEEDED").await, before + 1.0, "a code-driven branch's completion counts");
    assert_eq!(complete(&s, id, "email", &token, "succeeded").await.status, 200, "the same completion again");
    assert_eq!(branches_metric(&s, "SUCCEEDED").await, before + 1.0, "a repeated completion is not counted");
    assert_eq!(acquire(&s, id, "email").await.status, 200, "a finished branch replays");

    let chat = acquire(&s, id, "chat").await;
    assert_eq!(chat.status, 201, "email finished: chat may start: {chat:?}");
    assert_eq!(complete(&s, id, "chat", &chat.body["fencing_token"], "succeeded").await.status, 200);
    let close = acquire(&s, id, "close").await;
    assert_eq!(close.status, 201, "{close:?}");
    assert_eq!(complete(&s, id, "close", &close.body["fencing_token"], "succeeded").await.status, 200);
    assert_eq!(branches_metric(&s, "SUCCEEDED").await, before + 2.0, "close is no branch");
    let v = common::wait_instance(&s, id, 10, |v| v["state"] != "RUNNING").await;
    assert_eq!(v["state"], "SUCCEEDED", "{v:#}");
    assert_eq!(v["groups"][0]["max_concurrency"], 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_one_branch_at_once() {
    one_branch_at_once(Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_one_branch_at_once() {
    one_branch_at_once(Backend::Postgres).await;
}

/// Six branches acquired at the same time under `max_concurrency = 2`: exactly two granted,
/// the four others refused without a record.
async fn six_at_once_admit_two(b: Backend) {
    let db = Db::new(b).await;
    let s = server(&db);
    let id = "ORD-51:six";
    let names = ["b1", "b2", "b3", "b4", "b5", "b6"];
    let groups = json!([{"name": "notify", "max_concurrency": 2}]);
    assert_eq!(start(&s, id, fan_out(&names), Some(groups)).await.status, 201);
    let answers = futures_util::future::join_all(names.iter().map(|n| acquire(&s, id, n))).await;
    let granted: Vec<&str> = names.iter().zip(&answers).filter(|(_, r)| r.status == 201).map(|(n, _)| *n).collect();
    assert_eq!(granted.len(), 2, "exactly max_concurrency granted: {answers:#?}");
    for (n, r) in names.iter().zip(&answers).filter(|(_, r)| r.status != 201) {
        assert_eq!(r.status, 409, "{n}: {r:?}");
        assert_eq!(r.problem(), "previous-step-unfinished");
        assert!(r.header("retry-after").is_some(), "{r:?}");
        let key = format!("{id}:notify:{n}");
        assert_eq!(s.get(ADMIN_KEY, &format!("/v1/operations/{}", enc(&key))).await.status, 404, "{key}");
    }
    let v = instance(&s, id).await;
    let executing = v["steps"].as_array().unwrap().iter().filter(|c| c["state"] == "EXECUTING").count();
    assert_eq!(executing, 2, "{v:#}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_six_at_once_admit_two() {
    six_at_once_admit_two(Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_six_at_once_admit_two() {
    six_at_once_admit_two(Backend::Postgres).await;
}

/// Bad settings are refused naming their field, writing nothing; the settings are part of
/// the instance's intent (other settings: 422), and settings that say what the defaults say
/// are the same as none.
async fn group_settings_are_checked_and_pinned(b: Backend) {
    let db = Db::new(b).await;
    let s = server(&db);
    let two = fan_out(&["email", "chat"]);
    let bad = [
        (two.clone(), json!([{"name": "mail"}]), "groups[0].name"),
        (two.clone(), json!([{"name": "notify", "max_concurrency": 0}]), "groups[0].max_concurrency"),
        (two.clone(), json!([{"name": "notify", "max_concurrency": 65}]), "groups[0].max_concurrency"),
        (two.clone(), json!([{"name": "notify"}, {"name": "notify"}]), "groups[1].name"),
        (
            json!([{"name": "email", "group": "notify"}, {"name": "x"}, {"name": "chat", "group": "notify"}]),
            json!([]),
            "steps[2].group",
        ),
    ];
    for (steps, groups, field) in bad {
        let r = start(&s, "ORD-52:bad", steps, Some(groups.clone())).await;
        assert_eq!(r.status, 400, "{groups}: {r:?}");
        assert_eq!(r.problem(), "invalid-definition");
        assert!(r.body["detail"].as_str().unwrap().starts_with(&format!("{field}: ")), "{field}: {r:?}");
    }
    for groups in [json!([{"name": "notify", "on_failure": "retry"}]), json!([{"name": "notify", "max": 2}])] {
        let r = start(&s, "ORD-52:bad", two.clone(), Some(groups)).await;
        assert_eq!((r.status.as_u16(), r.problem()), (400, "invalid-request"), "{r:?}");
    }
    let r = s
        .post(ADMIN_KEY, "/v1/workflows", &json!({"workflow": "driven", "instance_id": "ORD-52:bad", "groups": []}))
        .await;
    assert_eq!((r.status.as_u16(), r.problem()), (400, "invalid-request"), "groups without steps: {r:?}");
    assert_eq!(s.get(ADMIN_KEY, "/v1/workflows/ORD-52:bad").await.status, 404, "nothing was written");

    let id = "ORD-52:pinned";
    let limited = json!([{"name": "notify", "on_failure": "compensate", "max_concurrency": 2}]);
    assert_eq!(start(&s, id, two.clone(), Some(limited.clone())).await.status, 201);
    assert_eq!(start(&s, id, two.clone(), Some(limited)).await.status, 200, "the same start: the same instance");
    for other in [Some(json!([{"name": "notify", "on_failure": "compensate", "max_concurrency": 3}])), None] {
        let r = start(&s, id, two.clone(), other).await;
        assert_eq!((r.status.as_u16(), r.problem()), (422, "instance-mismatch"), "{r:?}");
    }
    let v = instance(&s, id).await;
    assert_eq!(
        (v["groups"][0]["on_failure"].clone(), v["groups"][0]["max_concurrency"].clone()),
        (json!("compensate"), json!(2))
    );

    let plain = "ORD-52:plain";
    assert_eq!(start(&s, plain, two.clone(), None).await.status, 201);
    let defaults = json!([{"name": "notify", "on_failure": "pause"}]);
    assert_eq!(start(&s, plain, two.clone(), Some(defaults)).await.status, 200, "the defaults, written out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_group_settings_are_checked_and_pinned() {
    group_settings_are_checked_and_pinned(Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_group_settings_are_checked_and_pinned() {
    group_settings_are_checked_and_pinned(Backend::Postgres).await;
}

/// A branch your code reports as failed finally, or UNKNOWN, while a sibling is in flight:
/// under `pause` the instance pauses (`branch_failed`, `unknown_caller`), under
/// `compensate` it fails (steps your code runs have no compensation: nothing to undo);
/// either way a branch not started is refused (`instance-not-running`) and the sibling's
/// completion is recorded.
async fn a_failed_branch_follows_on_failure(b: Backend) {
    let db = Db::new(b).await;
    let s = server(&db);
    let cases = [
        ("pause", "final_failure", "PAUSED", "branch_failed"),
        ("pause", "unknown", "PAUSED", "unknown_caller"),
        ("compensate", "final_failure", "FAILED", "step_failed"),
        ("compensate", "unknown", "FAILED", "step_failed"),
    ];
    for (on_failure, outcome, state, class) in cases {
        let id = format!("ORD-53:{on_failure}:{outcome}");
        let groups = json!([{"name": "notify", "on_failure": on_failure}]);
        assert_eq!(start(&s, &id, fan_out(&["email", "chat", "data"]), Some(groups)).await.status, 201);
        let (email, chat) = (acquire(&s, &id, "email").await, acquire(&s, &id, "chat").await);
        assert!(email.status == 201 && chat.status == 201, "{email:?} {chat:?}");
        let label = if outcome == "unknown" { "UNKNOWN" } else { "FAILED" };
        let counted = branches_metric(&s, label).await;
        let r = complete(&s, &id, "email", &email.body["fencing_token"], outcome).await;
        assert_eq!(r.status, 200, "{r:?}");
        assert_eq!(branches_metric(&s, label).await, counted + 1.0, "the stopped branch counts");
        let v = common::wait_instance(&s, &id, 10, |v| v["state"] != "RUNNING").await;
        assert_eq!(v["state"], state, "{on_failure} {outcome}: {v:#}");
        assert_eq!(v["error"]["class"], class, "{on_failure} {outcome}: {v:#}");
        assert_eq!(v["stopped_step"], "email");
        assert!(v["error"]["message"].as_str().unwrap().contains("email"), "{v:#}");
        let data = acquire(&s, &id, "data").await;
        assert_eq!((data.status.as_u16(), data.problem()), (409, "instance-not-running"), "{on_failure}: {data:?}");
        let done = complete(&s, &id, "chat", &chat.body["fencing_token"], "succeeded").await;
        assert_eq!(done.status, 200, "a branch in flight is still recorded: {done:?}");
        let v = instance(&s, &id).await;
        assert_eq!(v["state"], state, "nothing after the group runs: {v:#}");
        assert_eq!(v["steps"][1]["state"], "SUCCEEDED");
        assert_eq!(v["groups"][0]["state"], "STOPPED");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_failed_branch_follows_on_failure() {
    a_failed_branch_follows_on_failure(Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_failed_branch_follows_on_failure() {
    a_failed_branch_follows_on_failure(Backend::Postgres).await;
}

/// `idem wf start --steps notify:email,… --group notify:…` declares the branches and the
/// group's settings; a bad setting is refused before any request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_declares_groups() {
    let db = Db::new(Backend::Sqlite).await;
    let s = server(&db);
    let wf = |args: &[&str]| {
        let mut all = vec!["wf", "start", "driven", "ORD-54:cli"];
        all.extend(args);
        Command::new(idem_bin()).args(all).env("IDEM_URL", &s.base).env("IDEM_API_KEY", ADMIN_KEY).output().unwrap()
    };
    let bad = wf(&["--steps", "notify:email,close", "--group", "notify:max=2"]);
    assert_eq!(bad.status.code(), Some(2), "{bad:?}");
    assert!(String::from_utf8_lossy(&bad.stderr).contains("max_concurrency=N"), "{bad:?}");
    let no_steps = wf(&["--group", "notify:max_concurrency=2"]);
    assert_eq!(no_steps.status.code(), Some(2), "--group needs --steps: {no_steps:?}");
    assert_eq!(s.get(ADMIN_KEY, "/v1/workflows/ORD-54:cli").await.status, 404);
    let out = wf(&[
        "--steps",
        "intake,notify:email,notify:chat,close",
        "--group",
        "notify:on_failure=compensate,max_concurrency=1",
    ]);
    assert!(out.status.success(), "{out:?}");
    let v = instance(&s, "ORD-54:cli").await;
    assert_eq!(v["steps"][2]["operation_key"], "ORD-54:cli:notify:chat", "{v:#}");
    let g = &v["groups"][0];
    assert_eq!(
        (g["name"].clone(), g["on_failure"].clone(), g["max_concurrency"].clone()),
        (json!("notify"), json!("compensate"), json!(1))
    );
}

/// A branch whose lease lapsed becomes UNKNOWN (the sweeper) before the engine's next pass
/// pauses the instance: a branch not started yet is refused in that moment too (the
/// acquire applies the pass first), never granted.
async fn a_branch_does_not_start_once_a_sibling_is_unknown(b: Backend) {
    let db = Db::new(b).await;
    let s = server(&db);
    let id = "ORD-54:lapsed";
    assert_eq!(start(&s, id, fan_out(&["email", "chat", "data"]), None).await.status, 201);
    let body = json!({"payload": {"step": "email"}, "lease_ms": 1000});
    let email = s.post(ADMIN_KEY, &format!("/v1/workflows/{}/steps/email", enc(id)), &body).await;
    assert_eq!(email.status, 201, "{email:?}");
    let key = format!("{id}:notify:email");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let op = s.get(ADMIN_KEY, &format!("/v1/operations/{}", enc(&key))).await;
        if op.body["state"] == "UNKNOWN" {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "the lease never lapsed: {op:?}");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let data = acquire(&s, id, "data").await;
    assert_eq!((data.status.as_u16(), data.problem()), (409, "instance-not-running"), "{data:?}");
    let v = instance(&s, id).await;
    assert_eq!(v["state"], "PAUSED", "{v:#}");
    assert!(v["steps"][2]["operation"].is_null() || v["steps"][2]["state"] == "NOT_STARTED", "{v:#}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_branch_does_not_start_once_a_sibling_is_unknown() {
    a_branch_does_not_start_once_a_sibling_is_unknown(Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_branch_does_not_start_once_a_sibling_is_unknown() {
    a_branch_does_not_start_once_a_sibling_is_unknown(Backend::Postgres).await;
}
