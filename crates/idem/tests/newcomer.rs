//! Where a newcomer was misled (issue 28 §6): the cause of an UNKNOWN shown first, in
//! words a person on call understands, wherever the operation is shown; what `PENDING`
//! means for an operation the caller's code performs; a hint for a key with a raw `/`.

mod common;

use common::{ADMIN_KEY, BACKENDS, Server, idem_bin, ui_session};
use serde_json::json;
use std::time::Duration;

async fn page(s: &Server, cookie: &str, path: &str) -> String {
    let r = s.http.get(s.url(path)).header("cookie", cookie).send().await.unwrap();
    assert_eq!(r.status(), 200, "{path}");
    r.text().await.unwrap()
}

/// An attempt whose lease ran out: the answer, the record, the review queue, the
/// operation's page and the CLI say the worker may have acted — not "nothing executed".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_lease_says_the_worker_may_have_acted_everywhere() {
    for backend in BACKENDS {
        let db = common::Db::new(backend).await;
        let s = Server::start(&db.url);
        let body =
            json!({"key": "INQ-3001:confirmation:v1", "action": "send_confirmation", "payload": {}, "lease_ms": 200});
        assert_eq!(s.post(ADMIN_KEY, "/v1/operations", &body).await.status, 201);
        tokio::time::sleep(Duration::from_millis(400)).await;
        let r = s.post(ADMIN_KEY, "/v1/operations", &body).await;
        assert_eq!((r.status.as_u16(), r.body["state"].as_str()), (202, Some("UNKNOWN")), "{backend:?}: {r:?}");
        assert_eq!(r.body["error"]["class"], "lease_expired", "{r:?}");
        let cause = r.body["error"]["message"].as_str().unwrap().to_owned();
        assert!(cause.contains("may have performed the effect") && !cause.contains("nothing executed"), "{cause}");
        let events = s.record("INQ-3001:confirmation:v1").await.body["events"].clone();
        assert!(!events.to_string().contains("nothing executed"), "{events}");
        // The sweeper's path (no trigger after the expiry) gives the same cause.
        let other =
            json!({"key": "INQ-3002:confirmation:v1", "action": "send_confirmation", "payload": {}, "lease_ms": 200});
        s.post(ADMIN_KEY, "/v1/operations", &other).await;
        let swept = s.wait_for("INQ-3002:confirmation:v1", 10, |r| r["needs_review"] == true).await;
        assert_eq!(
            (swept["state"].as_str(), swept["error"]["class"].as_str()),
            (Some("UNKNOWN"), Some("lease_expired"))
        );

        let cookie = ui_session(&s, ADMIN_KEY).await;
        let review = page(&s, &cookie, "/ui/review").await;
        let review = review.replace("&#39;", "'").replace("&#x27;", "'");
        assert!(review.contains("lease_expired: the worker's lease"), "{review}");
        let op = page(&s, &cookie, "/ui/operations/INQ-3002:confirmation:v1").await;
        assert!(op.contains("Why it is UNKNOWN") && op.contains("may have performed the effect"), "{op}");

        let out = std::process::Command::new(idem_bin())
            .args([
                "acquire",
                "INQ-3001:confirmation:v1",
                "--action",
                "send_confirmation",
                "--payload",
                "{}",
                "--lease-ms",
                "200",
            ])
            .env("IDEM_URL", &s.base)
            .env("IDEM_API_KEY", ADMIN_KEY)
            .output()
            .unwrap();
        let line = String::from_utf8_lossy(&out.stdout);
        assert_eq!(out.status.code(), Some(11), "{line}");
        assert!(line.contains("may have performed the effect") && line.contains("resolve"), "{line}");
    }
}

/// `resolve --to pending` of an operation your code performs runs nothing by itself: the
/// page says so, and the next trigger gets the lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pending_after_a_resolution_waits_for_the_callers_next_trigger() {
    let db = common::Db::new(common::Backend::Sqlite).await;
    let s = Server::start(&db.url);
    let key = "INQ-3003:confirmation:v1";
    let body = json!({"key": key, "action": "send_confirmation", "payload": {}, "lease_ms": 200});
    s.post(ADMIN_KEY, "/v1/operations", &body).await;
    s.wait_for(key, 10, |r| r["state"] == "UNKNOWN").await;
    let cookie = ui_session(&s, ADMIN_KEY).await;
    let before = page(&s, &cookie, &format!("/ui/operations/{key}")).await;
    assert!(before.contains("your code performs it at its next trigger"), "the choice says it: {before}");
    let r = s
        .post(
            ADMIN_KEY,
            &format!("/v1/operations/{key}/resolve"),
            &json!({"to": "PENDING", "reason": "the customer never got it"}),
        )
        .await;
    assert_eq!(r.body["state"], "PENDING", "{r:?}");
    let after = page(&s, &cookie, &format!("/ui/operations/{key}")).await;
    assert!(
        after.contains("id=\"waits-for-caller\"") && after.contains("nothing runs until a trigger arrives"),
        "{after}"
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(s.record(key).await.body["state"], "PENDING", "nothing performed it meanwhile");
    let again = s.post(ADMIN_KEY, "/v1/operations", &body).await;
    assert_eq!((again.status.as_u16(), again.body["attempt"].as_i64()), (201, Some(2)), "{again:?}");
}

/// A key with a raw `/` reaches no route: the 404 (or 405) says to percent-encode it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_raw_slash_in_a_key_gets_a_hint() {
    let db = common::Db::new(common::Backend::Sqlite).await;
    let s = Server::start(&db.url);
    for (method, path) in [
        ("GET", "/v1/operations/order/7"),
        ("POST", "/v1/operations/order/7/complete"),
        ("GET", "/v1/workflows/ORD/7:intake"),
    ] {
        let req = if method == "GET" { s.http.get(s.url(path)) } else { s.http.post(s.url(path)).json(&json!({})) };
        let r = common::Resp::read(req.bearer_auth(ADMIN_KEY).send().await.unwrap()).await;
        assert!(matches!(r.status.as_u16(), 404 | 405), "{path}: {r:?}");
        let detail = r.body["detail"].as_str().unwrap();
        assert!(detail.contains("%2F"), "{path}: {detail}");
    }
    let plain = s.get(ADMIN_KEY, "/v1/nothing").await;
    assert_eq!(plain.body["detail"], "no such route");
}
