//! Lease holder identity and lease renewal over HTTP, against real `idem serve` processes
//! on both stores (issue 11 item 1, issue 28 §2; DESIGN.md §2 invariant 6, §3 "Holders").
//!
//! An attempt whose acquire reply was lost resends the same request with the same
//! `holder` (a UUID made for that attempt): it must get its own grant back, not 409.
//! Anyone else — another holder, no holder, another principal naming the same holder —
//! still gets 409; after the lease expired the old rules apply. What other attempts share
//! (a request id, a worker name, an event id, a constant, the key itself) never acts as a
//! holder: refused as one, or never taken for one. Renewal extends a valid lease and
//! nothing else.

mod common;

use common::{ADMIN_KEY, BACKENDS, Server, enc, event_kinds, idem_bin};
use reqwest::StatusCode;
use serde_json::{Value, json};
use std::process::Command;
use std::time::Duration;

/// `POST /v1/operations` with `body`, the API key `api_key` and, if given, `X-Request-Id`.
async fn trigger(s: &Server, api_key: &str, request_id: Option<&str>, body: &Value) -> common::Resp {
    let mut req = s.http.post(s.url("/v1/operations")).bearer_auth(api_key).json(body);
    if let Some(rid) = request_id {
        req = req.header("x-request-id", rid);
    }
    common::Resp::read(req.send().await.unwrap()).await
}

async fn renew(s: &Server, key: &str, body: Value) -> common::Resp {
    s.post(ADMIN_KEY, &format!("/v1/operations/{}/renew", enc(key)), &body).await
}

/// The lease's end as epoch ms (RFC 3339 in the API).
fn lease_end(v: &Value) -> i64 {
    let t: jiff::Timestamp = v["lease_expires_at"].as_str().unwrap().parse().unwrap();
    t.as_millisecond()
}

/// A holder made for one attempt (a UUID, version 7).
fn attempt() -> String {
    uuid::Uuid::now_v7().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resent_acquire_gets_its_own_grant_back_and_nobody_else_does() {
    for backend in BACKENDS {
        let db = common::Db::new(backend).await;
        let s = Server::start(&db.url);
        let other_principal = s.create_key("default", "client");
        let holder = attempt();
        let body = json!({"key": "INV-88:send", "action": "send_invoice", "payload": {"to": "c-1"}, "holder": holder});
        let first = trigger(&s, ADMIN_KEY, Some("req-1"), &body).await;
        assert_eq!(first.status, StatusCode::CREATED, "{backend:?}: {:?}", first.body);
        // The reply never reached the attempt; its HTTP client resends the same request
        // (another request id: a resend is another HTTP request).
        let resent = trigger(&s, ADMIN_KEY, Some("req-2"), &body).await;
        assert_eq!(resent.status, StatusCode::CREATED, "{backend:?}: {:?}", resent.body);
        assert_eq!(resent.body, first.body, "{backend:?}: the same grant: token, lease end, attempt, everything");
        assert_eq!(resent.body["lease_holder"], holder.as_str());

        // Anyone else is another attempt: 409.
        let with_holder = |h: Option<&str>| {
            let mut b = body.clone();
            b["holder"] = h.map_or(Value::Null, |h| json!(h));
            b
        };
        let (another, upper) = (attempt(), holder.to_uppercase());
        let others: [(&str, Value, &str); 3] = [
            (ADMIN_KEY, with_holder(Some(&another)), "another attempt's holder"),
            (ADMIN_KEY, with_holder(None), "no holder"),
            (&other_principal, with_holder(Some(&holder)), "the same holder from another principal"),
        ];
        for (api_key, b, why) in others {
            let r = trigger(&s, api_key, None, &b).await;
            assert_eq!(r.status, StatusCode::CONFLICT, "{backend:?}, {why}: {:?}", r.body);
            assert_eq!(r.problem(), "operation-in-progress", "{why}");
        }
        // A UUID is one UUID in either case.
        let r = trigger(&s, ADMIN_KEY, None, &with_holder(Some(&upper))).await;
        assert_eq!((r.status, &r.body), (StatusCode::CREATED, &first.body), "{backend:?}");
        // The same holder with another payload is another intent.
        let mut other_payload = body.clone();
        other_payload["payload"] = json!({"to": "c-2"});
        let r = trigger(&s, ADMIN_KEY, None, &other_payload).await;
        assert_eq!((r.status, r.problem()), (StatusCode::UNPROCESSABLE_ENTITY, "fingerprint-mismatch"));

        let rec = s.record("INV-88:send").await.body;
        assert_eq!(rec["fencing_token"], first.body["fencing_token"], "still the first grant");
        assert_eq!(rec["attempt"], 1);
        assert_eq!(
            event_kinds(&rec),
            ["acquired", "already_held", "in_progress", "in_progress", "in_progress", "already_held", "mismatch"],
            "every trigger is recorded"
        );
        let done = s
            .complete(
                "INV-88:send",
                json!({"fencing_token": resent.token(), "outcome": "succeeded", "provider_ref": "inv-88"}),
            )
            .await;
        assert_eq!(done.status, 200, "{:?}", done.body);
    }
}

/// Issue 28 §2, as reported: a webhook's event id sent as `X-Request-Id` by two
/// concurrent deliveries, and names, event ids and constants sent as `holder`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_ids_names_and_event_ids_never_act_as_holders() {
    for backend in BACKENDS {
        let db = common::Db::new(backend).await;
        let s = Server::start(&db.url);
        // Two concurrent deliveries of one webhook event, its id as request id: one grant.
        for round in 0..5 {
            let key = format!("INQ-2002:confirmation:v{round}");
            let body = json!({"key": key, "action": "send_confirmation", "payload": {"to": "c-2002"}});
            let (a, b) = tokio::join!(
                trigger(&s, ADMIN_KEY, Some("evt_1PQ7-webhook-delivery"), &body),
                trigger(&s, ADMIN_KEY, Some("evt_1PQ7-webhook-delivery"), &body),
            );
            let mut statuses = [a.status.as_u16(), b.status.as_u16()];
            statuses.sort_unstable();
            assert_eq!(statuses, [201, 409], "{backend:?} round {round}: {:?} {:?}", a.body, b.body);
            let granted = if a.status == 201 { a } else { b };
            assert_eq!(granted.body["lease_holder"], Value::Null, "a request id is no holder");
        }
        // Holders that other attempts share, refused where idem can tell; nothing recorded.
        let key = "INQ-2003:confirmation:v1";
        let hour_ago = jiff::Timestamp::now().as_millisecond() - 3_900_000;
        let old_v7 = uuid::Builder::from_unix_timestamp_millis(hour_ago as u64, &[7; 10]).into_uuid().to_string();
        let in_key = "0b6f7a1e-3c2d-4e5f-8a9b-0c1d2e3f4a5b";
        let cases: [(&str, Option<&str>, &str); 9] = [
            ("worker-7", None, "a worker name"),
            ("evt_1PQ7-webhook-delivery", None, "an event id"),
            ("w7-attempt-1", None, "a counter"),
            ("00000000-0000-0000-0000-000000000000", None, "the Nil UUID"),
            ("2ed6657d-e927-568b-95e1-2665a8aea6a2", None, "a version 5 UUID, made from a name"),
            (&old_v7, None, "a version 7 UUID made over an hour ago: a constant"),
            ("", None, "empty"),
            (in_key, None, "part of the key"),
            ("0b6f7a1e-3c2d-4e5f-8a9b-0c1d2e3f4a5c", Some("0b6f7a1e-3c2d-4e5f-8a9b-0c1d2e3f4a5c"), "the request id"),
        ];
        for (holder, rid, why) in cases {
            let k = if why == "part of the key" { format!("evt-{in_key}:confirmation") } else { key.to_owned() };
            let body = json!({"key": k, "action": "send_confirmation", "payload": {"to": "c-1"}, "holder": holder});
            let r = trigger(&s, ADMIN_KEY, rid, &body).await;
            assert_eq!((r.status, r.problem()), (StatusCode::BAD_REQUEST, "invalid-holder"), "{backend:?} {why}");
            let detail = r.body["detail"].as_str().unwrap();
            assert!(detail.contains("attempt") && detail.contains("UUID"), "{why}: {detail}");
            assert_eq!(s.record(&k).await.status, 404, "{why}: nothing recorded");
        }
        // The same rules for a workflow step the caller's code performs.
        let start = json!({"workflow": "intake", "instance_id": "ORD-2004:intake", "steps": [{"name": "notify"}]});
        assert_eq!(s.post(ADMIN_KEY, "/v1/workflows", &start).await.status, 201);
        let step =
            s.post(ADMIN_KEY, "/v1/workflows/ORD-2004:intake/steps/notify", &json!({"holder": "worker-7"})).await;
        assert_eq!((step.status, step.problem()), (StatusCode::BAD_REQUEST, "invalid-holder"), "{:?}", step.body);
        let step = s.post(ADMIN_KEY, "/v1/workflows/ORD-2004:intake/steps/notify", &json!({"holder": attempt()})).await;
        assert_eq!(step.status, StatusCode::CREATED, "{:?}", step.body);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_the_lease_expired_the_holder_gets_unknown_not_its_grant() {
    for backend in BACKENDS {
        let db = common::Db::new(backend).await;
        let s = Server::start(&db.url);
        let holder = attempt();
        let body = json!({"key": "INV-90:send", "action": "send_invoice", "payload": {"to": "c-1"}, "lease_ms": 300, "holder": holder});
        let first = trigger(&s, ADMIN_KEY, None, &body).await;
        assert_eq!(first.status, StatusCode::CREATED);
        tokio::time::sleep(Duration::from_millis(450)).await;
        let late = trigger(&s, ADMIN_KEY, None, &body).await;
        assert_eq!(late.status, StatusCode::ACCEPTED, "{backend:?}: {:?}", late.body);
        assert_eq!(late.body["state"], "UNKNOWN");
        // redo_safe: a new grant with a new token, as for anyone.
        let safe = json!({"key": "INV-91:send", "action": "send_invoice", "payload": {}, "lease_ms": 300, "redo_safe": true, "holder": holder});
        let t1 = trigger(&s, ADMIN_KEY, None, &safe).await.token();
        tokio::time::sleep(Duration::from_millis(450)).await;
        let regrant = trigger(&s, ADMIN_KEY, None, &safe).await;
        assert_eq!(regrant.status, StatusCode::CREATED);
        assert_eq!((regrant.token(), regrant.body["attempt"].as_i64()), (t1 + 1, Some(2)));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewal_extends_a_valid_lease_and_refuses_the_rest() {
    for backend in BACKENDS {
        let db = common::Db::new(backend).await;
        let s = Server::start(&db.url);
        let key = "EXP-1:export";
        let r = s.post(ADMIN_KEY, "/v1/operations", &json!({"key": key, "action": "export", "lease_ms": 1000})).await;
        let (t, end) = (r.token(), lease_end(&r.body));
        let renewed = renew(&s, key, json!({"fencing_token": t, "lease_ms": 3000})).await;
        assert_eq!(renewed.status, 200, "{backend:?}: {:?}", renewed.body);
        assert!(lease_end(&renewed.body) >= end + 1900, "{:?}", renewed.body);
        assert_eq!((renewed.token(), renewed.body["attempt"].as_i64()), (t, Some(1)));
        // Past the first lease's end (and several sweeps): still held.
        tokio::time::sleep(Duration::from_millis(1300)).await;
        let dup = s.post(ADMIN_KEY, "/v1/operations", &json!({"key": key, "action": "export"})).await;
        assert_eq!((dup.status, dup.problem()), (StatusCode::CONFLICT, "operation-in-progress"), "{backend:?}");
        // Refused, nothing changed: another token; lease_ms out of range; an unknown key.
        let stale = renew(&s, key, json!({"fencing_token": t + 1})).await;
        assert_eq!((stale.status, stale.problem()), (StatusCode::CONFLICT, "stale-fencing-token"));
        assert_eq!(stale.body["current_fencing_token"], t);
        let bad = renew(&s, key, json!({"fencing_token": t, "lease_ms": 50})).await;
        assert_eq!((bad.status, bad.problem()), (StatusCode::BAD_REQUEST, "invalid-request"));
        assert_eq!(renew(&s, "never-used", json!({"fencing_token": 1})).await.status, 404);
        let done = s.complete(key, json!({"fencing_token": t, "outcome": "succeeded", "provider_ref": "exp-1"})).await;
        assert_eq!(done.status, 200);
        let kinds = event_kinds(&s.record(key).await.body);
        assert_eq!(kinds, ["acquired", "lease_renewed", "in_progress", "completed"], "{backend:?}");
        // No lease to renew on a SUCCEEDED or FAILED record.
        let r = renew(&s, key, json!({"fencing_token": t})).await;
        assert_eq!((r.status, r.problem()), (StatusCode::CONFLICT, "operation-not-executing"));
        assert_eq!(r.body["state"], "SUCCEEDED");
        let f = s.post(ADMIN_KEY, "/v1/operations", &json!({"key": "EXP-2:export", "action": "export"})).await.token();
        s.complete(
            "EXP-2:export",
            json!({"fencing_token": f, "outcome": "final_failure", "error_class": "validation"}),
        )
        .await;
        let r = renew(&s, "EXP-2:export", json!({"fencing_token": f})).await;
        assert_eq!(
            (r.status, r.problem(), &r.body["state"]),
            (StatusCode::CONFLICT, "operation-not-executing", &json!("FAILED"))
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_lease_is_never_renewed_and_its_worker_reports_instead() {
    for backend in BACKENDS {
        let db = common::Db::new(backend).await;
        let s = Server::start(&db.url);
        let key = "EXP-3:export";
        let t = s
            .post(ADMIN_KEY, "/v1/operations", &json!({"key": key, "action": "export", "lease_ms": 300}))
            .await
            .token();
        tokio::time::sleep(Duration::from_millis(450)).await;
        let r = renew(&s, key, json!({"fencing_token": t, "lease_ms": 60000})).await;
        assert_eq!((r.status, r.problem()), (StatusCode::CONFLICT, "lease-expired"), "{backend:?}: {:?}", r.body);
        assert!(r.body["detail"].as_str().unwrap().contains("complete with this token"), "{:?}", r.body);
        let rec = s.record(key).await.body;
        assert_ne!(rec["state"], "EXECUTING", "not revived");
        // What the detail says to do: report what happened with the token.
        let done = s.complete(key, json!({"fencing_token": t, "outcome": "succeeded", "provider_ref": "exp-3"})).await;
        assert_eq!((done.status.as_u16(), &done.body["state"]), (200, &json!("SUCCEEDED")));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_acquires_with_a_holder_and_renews() {
    let db = common::Db::new(common::Backend::Sqlite).await;
    let s = Server::start(&db.url);
    let idem = |args: &[&str]| {
        Command::new(idem_bin()).args(args).env("IDEM_URL", &s.base).env("IDEM_API_KEY", ADMIN_KEY).output().unwrap()
    };
    let holder = attempt();
    let acquire =
        ["acquire", "RPT-1:render", "--action", "render", "--holder", &holder, "--lease-ms", "2000", "--json"];
    let first = idem(&acquire);
    assert_eq!(first.status.code(), Some(0), "{}", String::from_utf8_lossy(&first.stderr));
    let again = idem(&acquire);
    assert_eq!(again.status.code(), Some(0), "the attempt's own grant: {}", String::from_utf8_lossy(&again.stderr));
    assert_eq!(first.stdout, again.stdout);
    let v: Value = serde_json::from_slice(&first.stdout).unwrap();
    assert_eq!(v["lease_holder"], holder.as_str());
    let token = v["fencing_token"].as_i64().unwrap().to_string();
    let renewed = idem(&["renew", "RPT-1:render", "--token", &token, "--lease-ms", "60000"]);
    assert_eq!(renewed.status.code(), Some(0), "{}", String::from_utf8_lossy(&renewed.stderr));
    assert!(String::from_utf8_lossy(&renewed.stdout).contains("lease until"));
    let stale = idem(&["renew", "RPT-1:render", "--token", "1"]);
    assert_eq!(stale.status.code(), Some(1));
    let err = String::from_utf8_lossy(&stale.stderr);
    assert!(err.starts_with("idem: 409 stale-fencing-token") && err.trim_end().lines().count() == 1, "{err}");
    let help = String::from_utf8_lossy(&Command::new(idem_bin()).args(["renew", "--help"]).output().unwrap().stdout)
        .into_owned();
    assert!(help.contains("--lease-ms") && help.contains("--token"), "{help}");
    // The API documents the route and the new problem types.
    let doc = s.get(ADMIN_KEY, "/openapi.json").await.body;
    assert!(doc["paths"]["/v1/operations/{key}/renew"]["post"].is_object());
    assert!(doc["components"]["schemas"]["AcquireBody"]["properties"]["holder"].is_object());
    for slug in ["lease-expired", "invalid-holder"] {
        assert_eq!(s.get("", &format!("/problems/{slug}")).await.status, 200, "{slug}");
    }
}

/// Issue 28 §2, as reported: `idem acquire … --holder worker-7` run twice at once (a
/// platform re-running a slow script) got exit 0 twice with one fencing token. Now a name
/// is refused, and without `--holder` each run is its own attempt: one 0, one 12.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_runs_of_one_script_never_share_a_grant() {
    let db = common::Db::new(common::Backend::Sqlite).await;
    let s = Server::start(&db.url);
    let run = |key: &str, holder: Option<&str>| {
        let mut c = Command::new(idem_bin());
        c.args(["acquire", key, "--action", "send_confirmation", "--payload", r#"{"to":"c-2002"}"#]);
        if let Some(h) = holder {
            c.args(["--holder", h]);
        }
        c.env("IDEM_URL", &s.base).env("IDEM_API_KEY", ADMIN_KEY).spawn_output()
    };
    let (a, b) = (run("INQ-2002:confirmation:v1", Some("worker-7")), run("INQ-2002:confirmation:v1", Some("worker-7")));
    for out in [a.wait_with_output().unwrap(), b.wait_with_output().unwrap()] {
        assert_eq!(out.status.code(), Some(1), "{}", String::from_utf8_lossy(&out.stdout));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.starts_with("idem: --holder: holder must be a UUID") && err.trim_end().lines().count() == 1,
            "{err}"
        );
    }
    assert_eq!(s.record("INQ-2002:confirmation:v1").await.status, 404, "refused before anything was sent");
    for round in 0..4 {
        let key = format!("INQ-2002:confirmation:v{}", round + 2);
        let (a, b) = (run(&key, None), run(&key, None));
        let mut codes = [a.wait_with_output().unwrap(), b.wait_with_output().unwrap()].map(|o| o.status.code());
        codes.sort_unstable();
        assert_eq!(codes, [Some(0), Some(12)], "round {round}: one grant, one 'in progress'");
        let rec = s.record(&key).await.body;
        let holder = rec["lease_holder"].as_str().expect("the CLI names its attempt");
        assert!(uuid::Uuid::parse_str(holder).is_ok(), "{holder}");
    }
}

/// The CLI's resend after a lost reply is the same attempt: its own grant back, exit 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_resends_a_lost_acquire_and_gets_its_own_grant_back() {
    let db = common::Db::new(common::Backend::Sqlite).await;
    let s = Server::start(&db.url);
    let upstream = s.base.trim_start_matches("http://").parse().unwrap();
    let proxy = common::proxy::FaultProxy::start(upstream, b"\"action\":\"render\"", 1).await;
    let out = tokio::task::spawn_blocking(move || {
        Command::new(idem_bin())
            .args(["acquire", "RPT-9:render", "--action", "render", "--json"])
            .env("IDEM_URL", format!("http://{}", proxy.addr))
            .env("IDEM_API_KEY", ADMIN_KEY)
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let rec = s.record("RPT-9:render").await.body;
    assert_eq!(event_kinds(&rec), ["acquired", "already_held"], "the first reply was lost, the resend got it back");
    assert_eq!(v["fencing_token"], rec["fencing_token"]);
}

/// The same for a completion (break-it finding: `idem complete` reported an unreachable
/// server, exit 1, for a completion the server had recorded): resent, exit 0, recorded once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_resends_a_lost_completion_and_reports_what_was_recorded() {
    let db = common::Db::new(common::Backend::Sqlite).await;
    let s = Server::start(&db.url);
    let granted = s.acquire("RPT-10:render", json!({})).await;
    assert_eq!(granted.status, 201);
    let token = granted.token().to_string();
    let upstream = s.base.trim_start_matches("http://").parse().unwrap();
    let proxy = common::proxy::FaultProxy::start(upstream, b"\"outcome\":\"succeeded\"", 1).await;
    let out = tokio::task::spawn_blocking(move || {
        Command::new(idem_bin())
            .args(["complete", "RPT-10:render", "--token", &token, "--outcome", "succeeded", "--provider-ref", "r-10"])
            .env("IDEM_URL", format!("http://{}", proxy.addr))
            .env("IDEM_API_KEY", ADMIN_KEY)
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let rec = s.record("RPT-10:render").await.body;
    assert_eq!(rec["state"], "SUCCEEDED");
    assert_eq!(event_kinds(&rec).iter().filter(|k| *k == "completed").count(), 1, "{rec}");
}

trait SpawnOutput {
    fn spawn_output(&mut self) -> std::process::Child;
}

impl SpawnOutput for Command {
    fn spawn_output(&mut self) -> std::process::Child {
        self.stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped()).spawn().unwrap()
    }
}
