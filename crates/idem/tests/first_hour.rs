//! The newcomer's first hour (issue 15 §4): what someone who only read the README meets
//! first — the root URL, the README's own walkthrough run as written.

mod common;

use common::{Backend, Db, Server};

/// `GET /` answered a JSON 404: a browser is now sent to the admin page, a client gets the
/// entry points, among them the probes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_root_url_sends_browsers_to_the_admin_page_and_names_the_probes() {
    let db = Db::new(Backend::Sqlite).await;
    let s = Server::start(&db.url);
    let http = reqwest::Client::builder().redirect(reqwest::redirect::Policy::none()).build().unwrap();
    // What Chromium and Firefox send for a navigation.
    for accept in ["text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8", "TEXT/HTML"] {
        let r = http.get(s.url("/")).header("accept", accept).send().await.unwrap();
        assert_eq!(r.status(), 303, "{accept}");
        assert_eq!(r.headers()["location"], "/ui");
    }
    for accept in [None, Some("application/json"), Some("*/*")] {
        let mut req = http.get(s.url("/"));
        if let Some(a) = accept {
            req = req.header("accept", a);
        }
        let r = common::Resp::read(req.send().await.unwrap()).await;
        assert_eq!(r.status, 200, "{accept:?}: {r:?}");
        for (field, path) in
            [("admin_page", "/ui"), ("healthz", "/healthz"), ("readyz", "/readyz"), ("openapi", "/openapi.json")]
        {
            assert_eq!(r.body[field], path, "{r:?}");
            let target = http.get(s.url(path)).send().await.unwrap().status();
            assert!(target.is_success() || target.is_redirection(), "{path}: {target}");
        }
    }
    // Another unknown path is still a problem+json 404.
    let r = http.get(s.url("/nope")).header("accept", "text/html").send().await.unwrap();
    assert_eq!(r.status(), 404);
}

/// A retry that left out `fingerprint_fields` got a 422 whose text never mentioned the
/// field list; now the detail says what differs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mismatch_says_what_differs_and_names_fingerprint_fields() {
    use common::ADMIN_KEY;
    use serde_json::json;
    let db = Db::new(Backend::Sqlite).await;
    let s = Server::start(&db.url);
    let payload = json!({"to": "c-9", "note": "first"});
    let first = json!({"key": "fp-1", "action": "send", "payload": payload, "fingerprint_fields": ["/to"]});
    assert_eq!(s.post(ADMIN_KEY, "/v1/operations", &first).await.status, 201);
    let cases = [
        // The input: the same request without its fingerprint_fields.
        (
            json!({"key": "fp-1", "action": "send", "payload": payload}),
            vec!["the payload is the one", "send the same fingerprint_fields"],
        ),
        // Neighbours: another field list; another payload; another action.
        (
            json!({"key": "fp-1", "action": "send", "payload": payload, "fingerprint_fields": ["/note"]}),
            vec!["[\"/note\"]", "send the same fingerprint_fields"],
        ),
        (
            json!({"key": "fp-1", "action": "send", "payload": {"to": "c-10"}}),
            vec!["another payload", "fingerprint_fields"],
        ),
        (
            json!({"key": "fp-1", "action": "notify", "payload": payload, "fingerprint_fields": ["/to"]}),
            vec!["action \"send\"", "\"notify\""],
        ),
    ];
    for (body, words) in cases {
        let r = s.post(ADMIN_KEY, "/v1/operations", &body).await;
        assert_eq!((r.status.as_u16(), r.problem()), (422, "fingerprint-mismatch"), "{body}");
        let detail = r.body["detail"].as_str().unwrap();
        for w in words {
            assert!(detail.contains(w), "{body}: {detail:?} lacks {w:?}");
        }
    }
    // The retry that matches is still a replay/in-progress, not a 422.
    let again = s.post(ADMIN_KEY, "/v1/operations", &json!({"key": "fp-1", "action": "send", "payload": {"to": "c-9", "note": "other"}, "fingerprint_fields": ["/to"]})).await;
    assert_eq!(again.status, 409);
}
