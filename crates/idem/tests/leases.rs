//! Lease holder identity and lease renewal over HTTP, against real `idem serve` processes
//! on both stores (issue 11 item 1; DESIGN.md §2 invariant 6).
//!
//! A worker whose acquire reply was lost resends the same request (same `X-Request-Id`):
//! it must get its own grant back, not 409. Anyone else — another request id, a request id
//! idem generated, another principal naming the same holder — still gets 409; after the
//! lease expired the old rules apply. Renewal extends a valid lease and nothing else.

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resent_acquire_gets_its_own_grant_back_and_nobody_else_does() {
    for backend in BACKENDS {
        let db = common::Db::new(backend).await;
        let s = Server::start(&db.url);
        let other_principal = s.create_key("default", "client");

        // The input, kept as it was reported.
        let body = json!({"key": "INV-88:send", "action": "send_invoice", "payload": {"to": "c-1"}});
        let first = trigger(&s, ADMIN_KEY, Some("w7-attempt-1"), &body).await;
        assert_eq!(first.status, StatusCode::CREATED, "{backend:?}: {:?}", first.body);
        // The reply never reached the worker; its HTTP client resends the same request.
        let resent = trigger(&s, ADMIN_KEY, Some("w7-attempt-1"), &body).await;
        assert_eq!(resent.status, StatusCode::CREATED, "{backend:?}: {:?}", resent.body);
        assert_eq!(resent.body, first.body, "{backend:?}: the same grant: token, lease end, attempt, everything");
        assert_eq!(resent.body["lease_holder"], "w7-attempt-1");

        // Anyone else is another worker: 409.
        let others: [(&str, Option<&str>, &str); 4] = [
            (ADMIN_KEY, Some("w8-attempt-1"), "another request id"),
            (ADMIN_KEY, None, "no request id: idem generates one, which never names a holder"),
            (ADMIN_KEY, Some("w7 attempt 1"), "an unusable request id is replaced by a generated one"),
            (&other_principal, Some("w7-attempt-1"), "the same request id from another principal"),
        ];
        for (api_key, rid, why) in others {
            let r = trigger(&s, api_key, rid, &body).await;
            assert_eq!(r.status, StatusCode::CONFLICT, "{backend:?}, {why}: {:?}", r.body);
            assert_eq!(r.problem(), "operation-in-progress", "{why}");
        }
        // The same holder with another payload is another intent.
        let other_payload = json!({"key": "INV-88:send", "action": "send_invoice", "payload": {"to": "c-2"}});
        let r = trigger(&s, ADMIN_KEY, Some("w7-attempt-1"), &other_payload).await;
        assert_eq!((r.status, r.problem()), (StatusCode::UNPROCESSABLE_ENTITY, "fingerprint-mismatch"));

        let rec = s.record("INV-88:send").await.body;
        assert_eq!(rec["fencing_token"], first.body["fencing_token"], "still the first grant");
        assert_eq!(rec["attempt"], 1);
        assert_eq!(
            event_kinds(&rec),
            ["acquired", "already_held", "in_progress", "in_progress", "in_progress", "in_progress", "mismatch"],
            "every trigger is recorded"
        );

        // The worker completes with the token it got back.
        let done = s
            .complete(
                "INV-88:send",
                json!({"fencing_token": resent.token(), "outcome": "succeeded", "provider_ref": "inv-88"}),
            )
            .await;
        assert_eq!(done.status, 200, "{:?}", done.body);

        // A request id idem generated (none sent, or an unusable one) never names a holder.
        for (key, rid) in [("INV-92:send", None), ("INV-93:send", Some("w7 attempt 1"))] {
            let body = json!({"key": key, "action": "send_invoice", "payload": {"to": "c-1"}});
            let r = trigger(&s, ADMIN_KEY, rid, &body).await;
            assert_eq!(r.status, StatusCode::CREATED);
            assert!(r.header("x-request-id").is_some_and(|g| !g.is_empty()), "idem generated one");
            assert_eq!(r.body["lease_holder"], Value::Null, "{backend:?} {rid:?}: {:?}", r.body);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_explicit_holder_names_the_worker_across_request_ids() {
    for backend in BACKENDS {
        let db = common::Db::new(backend).await;
        let s = Server::start(&db.url);
        let other_principal = s.create_key("default", "client");
        let body = |holder: &str| json!({"key": "INV-89:send", "action": "send_invoice", "payload": {"to": "c-1"}, "holder": holder});
        let first = trigger(&s, ADMIN_KEY, Some("try-1"), &body("worker-7")).await;
        assert_eq!(first.status, StatusCode::CREATED);
        assert_eq!(first.body["lease_holder"], "worker-7", "the body's holder wins over the request id");
        // A new request id (a fresh HTTP request of the same worker): still its lease.
        let again = trigger(&s, ADMIN_KEY, Some("try-2"), &body("worker-7")).await;
        assert_eq!((again.status, &again.body), (StatusCode::CREATED, &first.body), "{backend:?}");
        let again = trigger(&s, ADMIN_KEY, None, &body("worker-7")).await;
        assert_eq!((again.status, &again.body), (StatusCode::CREATED, &first.body), "{backend:?}");
        for (api_key, holder) in [(ADMIN_KEY, "worker-8"), (other_principal.as_str(), "worker-7")] {
            let r = trigger(&s, api_key, Some("try-1"), &body(holder)).await;
            assert_eq!((r.status, r.problem()), (StatusCode::CONFLICT, "operation-in-progress"), "{holder}");
        }
        // A holder that is not 1-128 of [A-Za-z0-9._:-] is a 400; nothing is recorded.
        for bad in ["", "has space", "ü", &"h".repeat(129), "a/b"] {
            let r = trigger(&s, ADMIN_KEY, None, &body(bad)).await;
            assert_eq!((r.status, r.problem()), (StatusCode::BAD_REQUEST, "invalid-request"), "{bad:?}");
            assert!(r.body["detail"].as_str().unwrap().contains("holder"), "{:?}", r.body);
        }
        assert_eq!(event_kinds(&s.record("INV-89:send").await.body).len(), 5, "bad requests record nothing");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_the_lease_expired_the_holder_gets_unknown_not_its_grant() {
    for backend in BACKENDS {
        let db = common::Db::new(backend).await;
        let s = Server::start(&db.url);
        let body = json!({"key": "INV-90:send", "action": "send_invoice", "payload": {"to": "c-1"}, "lease_ms": 300});
        let first = trigger(&s, ADMIN_KEY, Some("w7-attempt-1"), &body).await;
        assert_eq!(first.status, StatusCode::CREATED);
        tokio::time::sleep(Duration::from_millis(450)).await;
        let late = trigger(&s, ADMIN_KEY, Some("w7-attempt-1"), &body).await;
        assert_eq!(late.status, StatusCode::ACCEPTED, "{backend:?}: {:?}", late.body);
        assert_eq!(late.body["state"], "UNKNOWN");
        // redo_safe: a new grant with a new token, as for anyone.
        let mut safe = json!({"key": "INV-91:send", "action": "send_invoice", "payload": {}, "lease_ms": 300});
        safe["redo_safe"] = json!(true);
        let t1 = trigger(&s, ADMIN_KEY, Some("w7-attempt-1"), &safe).await.token();
        tokio::time::sleep(Duration::from_millis(450)).await;
        let regrant = trigger(&s, ADMIN_KEY, Some("w7-attempt-1"), &safe).await;
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
    let acquire =
        ["acquire", "RPT-1:render", "--action", "render", "--holder", "worker-7", "--lease-ms", "2000", "--json"];
    let first = idem(&acquire);
    assert_eq!(first.status.code(), Some(0), "{}", String::from_utf8_lossy(&first.stderr));
    let again = idem(&acquire);
    assert_eq!(again.status.code(), Some(0), "the holder's own grant: {}", String::from_utf8_lossy(&again.stderr));
    assert_eq!(first.stdout, again.stdout);
    let v: Value = serde_json::from_slice(&first.stdout).unwrap();
    let token = v["fencing_token"].as_i64().unwrap().to_string();
    let renewed = idem(&["renew", "RPT-1:render", "--token", &token, "--lease-ms", "60000"]);
    assert_eq!(renewed.status.code(), Some(0), "{}", String::from_utf8_lossy(&renewed.stderr));
    assert!(String::from_utf8_lossy(&renewed.stdout).contains("lease until"));
    let stale = idem(&["renew", "RPT-1:render", "--token", "1"]);
    assert_eq!(stale.status.code(), Some(1));
    let err = String::from_utf8_lossy(&stale.stderr);
    assert!(err.starts_with("idem: 409 stale-fencing-token") && err.trim_end().lines().count() == 1, "{err}");
    let bad = idem(&["acquire", "RPT-2:render", "--action", "render", "--holder", "not ok"]);
    assert_eq!(bad.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("holder must be"));
    let help = String::from_utf8_lossy(&Command::new(idem_bin()).args(["renew", "--help"]).output().unwrap().stdout)
        .into_owned();
    assert!(help.contains("--lease-ms") && help.contains("--token"), "{help}");
    // The API documents the route and the new problem type.
    let doc = s.get(ADMIN_KEY, "/openapi.json").await.body;
    assert!(doc["paths"]["/v1/operations/{key}/renew"]["post"].is_object());
    assert!(doc["components"]["schemas"]["AcquireBody"]["properties"]["holder"].is_object());
    let described = s.get("", "/problems/lease-expired").await;
    assert_eq!(described.status, 200);
}
