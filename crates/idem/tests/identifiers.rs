//! One rule for every identifier (issue 28 §3) at the entry points of the server and the
//! CLI: idem-core's table of bad ids ([`idem_core::ident::BAD_IDS`]) as an operation key
//! (body and path), a workflow instance id and step name, a principal, a tenant, a lease
//! holder — each refused with a 400 (or exit 1/2 and one line), nothing recorded. The
//! libraries and SQL functions run the same table in `idem-outbox/tests/identifiers.rs`.

mod common;

use common::{ADMIN_KEY, BACKENDS, Server, idem_bin};
use idem_core::ident::BAD_IDS;
use serde_json::json;
use std::process::Command;

/// Percent-encodes every byte but unreserved ones, so the id reaches the route as it is.
fn path(id: &str) -> String {
    id.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_refuses_every_bad_id_and_records_nothing() {
    for backend in BACKENDS {
        let db = common::Db::new(backend).await;
        let s = Server::start(&db.url);
        for (bad, _) in BAD_IDS {
            let why = format!("{backend:?} {bad:?}");
            let r = s.post(ADMIN_KEY, "/v1/operations", &json!({"key": bad, "action": "send", "payload": {}})).await;
            assert_eq!((r.status.as_u16(), r.problem()), (400, "invalid-idempotency-key"), "key {why}: {r:?}");
            if !bad.is_empty() {
                let r = s.get(ADMIN_KEY, &format!("/v1/operations/{}", path(bad))).await;
                assert!(matches!(r.status.as_u16(), 400 | 404), "get {why}: {r:?}");
                assert!(!r.body.to_string().contains("database"), "{why}: {r:?}");
            }
            let start = json!({"workflow": "intake", "instance_id": bad, "steps": [{"name": "notify"}]});
            let r = s.post(ADMIN_KEY, "/v1/workflows", &start).await;
            assert_eq!(r.status, 400, "instance id {why}: {r:?}");
            let start = json!({"workflow": "intake", "instance_id": "ORD-1:intake", "steps": [{"name": bad}]});
            let r = s.post(ADMIN_KEY, "/v1/workflows", &start).await;
            assert_eq!(r.status, 400, "step name {why}: {r:?}");
            let r = s.post(ADMIN_KEY, "/v1/keys", &json!({"role": "client", "principal": bad})).await;
            assert_eq!(r.status, 400, "principal {why}: {r:?}");
            let body = json!({"key": "INQ-1:send", "action": "send", "payload": {}, "holder": bad});
            let r = s.post(ADMIN_KEY, "/v1/operations", &body).await;
            assert_eq!((r.status.as_u16(), r.problem()), (400, "invalid-holder"), "holder {why}: {r:?}");
        }
        let listed = s.get(ADMIN_KEY, "/v1/operations").await.body;
        assert_eq!(listed["items"].as_array().map(Vec::len), Some(0), "{backend:?}: {listed}");
        let listed = s.get(ADMIN_KEY, "/v1/workflows").await.body;
        assert_eq!(listed["items"].as_array().map(Vec::len), Some(0), "{backend:?}: {listed}");
        let keys = s.get(ADMIN_KEY, "/v1/keys").await.body;
        assert_eq!(keys.as_array().map(Vec::len), Some(1), "only the bootstrap key: {keys}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_refuses_every_bad_id_in_one_line() {
    let db = common::Db::new(common::Backend::Sqlite).await;
    let s = Server::start(&db.url);
    let idem = |args: &[&str]| {
        Command::new(idem_bin())
            .args(args)
            .env("IDEM_URL", &s.base)
            .env("IDEM_API_KEY", ADMIN_KEY)
            .env("IDEM_DATABASE_URL", &db.url)
            .output()
            .unwrap()
    };
    for (bad, _) in BAD_IDS {
        for args in [
            vec!["acquire", bad, "--action", "send"],
            vec!["acquire", "INQ-1:send", "--action", "send", "--holder", bad],
            vec!["wf", "start", "intake", bad, "--steps", "notify"],
            vec!["wf", "start", "intake", "ORD-1:intake", "--steps", bad],
            vec!["keys", "create", "--tenant", bad, "--role", "client"],
            vec!["keys", "create", "--tenant", "acme", "--role", "client", "--principal", bad],
        ] {
            let out = idem(&args);
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(matches!(out.status.code(), Some(1 | 2)), "{args:?}: {err}");
            assert!(err.starts_with("idem: ") && err.trim_end().lines().count() == 1, "{args:?}: {err}");
        }
    }
    assert_eq!(s.get(ADMIN_KEY, "/v1/operations").await.body["items"].as_array().map(Vec::len), Some(0));
    let keys = idem(&["keys", "list", "--json"]);
    let listed: serde_json::Value = serde_json::from_slice(&keys.stdout).unwrap();
    assert_eq!(listed.as_array().map(Vec::len), Some(1), "{listed}");
}
