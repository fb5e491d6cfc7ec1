//! `idem proxy`: the IETF Idempotency-Key header in front of an API that never had it.
//! A real upstream HTTP server in the test counts what reaches it; curl and reqwest are
//! the clients.

mod common;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::post;
use axum::{Json, Router};
use common::{ADMIN_KEY, Backend, Db, Server};
use serde_json::{Value, json};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

#[derive(Clone, Default)]
struct Upstream(Arc<Mutex<HashMap<String, u64>>>);

impl Upstream {
    fn hit(&self, path: &str) -> u64 {
        let mut m = self.0.lock().unwrap();
        let n = m.entry(path.to_string()).or_default();
        *n += 1;
        *n
    }
    fn count(&self, path: &str) -> u64 {
        self.0.lock().unwrap().get(path).copied().unwrap_or(0)
    }
}

async fn start_upstream() -> (Upstream, String) {
    let up = Upstream::default();
    let app = Router::new()
        .route(
            "/charges",
            post(|State(u): State<Upstream>, Json(b): Json<Value>| async move {
                let n = u.hit("/charges");
                (
                    StatusCode::CREATED,
                    [("x-upstream", "yes"), ("location", "/charges/1")],
                    Json(json!({"id": format!("ch_{n}"), "amount": b["amount"]})),
                )
            })
            .get(|| async { Json(json!([])) }),
        )
        .route(
            "/slow",
            post(|State(u): State<Upstream>| async move {
                u.hit("/slow");
                tokio::time::sleep(Duration::from_millis(500)).await;
                (StatusCode::CREATED, "slow done")
            }),
        )
        .route(
            "/flaky",
            post(|State(u): State<Upstream>| async move {
                if u.hit("/flaky") == 1 {
                    (StatusCode::SERVICE_UNAVAILABLE, "busy").into_response()
                } else {
                    (StatusCode::CREATED, "ok").into_response()
                }
            }),
        )
        .route(
            "/invalid",
            post(|State(u): State<Upstream>| async move {
                u.hit("/invalid");
                (StatusCode::UNPROCESSABLE_ENTITY, Json(json!({"error": "amount must be positive"})))
            }),
        )
        .route(
            "/hang",
            post(|State(u): State<Upstream>| async move {
                u.hit("/hang");
                std::future::pending::<()>().await;
            }),
        )
        .route("/acts_then/{status}", post(acts_then))
        .route("/legacy/acts_then/{status}", post(acts_then))
        .route("/narrow/acts_then/{status}", post(acts_then))
        .route(
            "/die",
            post(|State(u): State<Upstream>| async move {
                u.hit("/die");
                // Headers and a first chunk go out, then the connection dies mid-body.
                let chunks: Vec<Result<&'static str, std::io::Error>> =
                    vec![Ok("{\"partial\":"), Err(std::io::Error::other("upstream died"))];
                axum::body::Body::from_stream(futures_util::stream::iter(chunks))
            }),
        )
        .with_state(up.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (up, format!("http://{addr}/"))
}

/// The upstream acts (counts the request as done), then its gateway answers `status`.
async fn acts_then(
    State(u): State<Upstream>,
    uri: axum::http::Uri,
    axum::extract::Path(status): axum::extract::Path<u16>,
) -> axum::response::Response {
    u.hit(uri.path());
    (StatusCode::from_u16(status).unwrap(), format!("gateway error {status}")).into_response()
}

async fn send(
    p: &Server,
    path: &str,
    key: Option<&str>,
    client_key: &str,
    body: &str,
) -> (u16, reqwest::header::HeaderMap, String) {
    let mut r = p
        .http
        .post(p.url(path))
        .header("idem-api-key", client_key)
        .header("content-type", "application/json")
        // A new connection each time: after a 413 the server closes the connection, and a
        // pooled one could be reused before the client sees that.
        .header("connection", "close")
        .body(body.to_string());
    if let Some(k) = key {
        r = r.header("idempotency-key", k);
    }
    let resp = r.send().await.unwrap();
    let (status, headers) = (resp.status().as_u16(), resp.headers().clone());
    (status, headers, resp.text().await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxy_replays_refuses_and_never_resends_the_unknown() {
    let (up, upstream) = start_upstream().await;
    let db = Db::new(Backend::Sqlite).await;
    let p = Server::start_proxy(&db.url, &upstream, &["--timeout-ms", "800", "--max-body-bytes", "65536"]);

    // First request forwarded; the retry (curl, same JSON in another order) is replayed
    // byte-for-byte with Idempotent-Replayed.
    let (s1, h1, b1) = send(&p, "/charges", Some("charge-1"), ADMIN_KEY, r#"{"amount": 100, "currency": "EUR"}"#).await;
    assert_eq!(s1, 201, "{b1}");
    assert!(h1.get("idempotent-replayed").is_none());
    let curl = std::process::Command::new("curl")
        .args([
            "-s",
            "-i",
            "-X",
            "POST",
            &p.url("/charges"),
            "-H",
            &format!("idem-api-key: {ADMIN_KEY}"),
            "-H",
            "idempotency-key: charge-1",
        ])
        .args(["-H", "content-type: application/json", "--data", r#"{ "currency":"EUR","amount":100 }"#])
        .output()
        .expect("curl");
    let text = String::from_utf8_lossy(&curl.stdout).to_string();
    assert!(text.starts_with("HTTP/1.1 201"), "{text}");
    assert!(text.to_ascii_lowercase().contains("idempotent-replayed: true"), "{text}");
    assert!(text.to_ascii_lowercase().contains("location: /charges/1"), "{text}");
    assert!(text.ends_with(&b1), "byte-for-byte body: {text}");
    assert_eq!(up.count("/charges"), 1);

    // Another body under the same key: 422. No key: 400. A bad key: 400. GET passes.
    let (s, _, b) = send(&p, "/charges", Some("charge-1"), ADMIN_KEY, r#"{"amount": 999}"#).await;
    assert_eq!(s, 422, "{b}");
    assert_eq!(send(&p, "/charges", None, ADMIN_KEY, "{}").await.0, 400);
    assert_eq!(send(&p, "/charges", Some("mail:jane@example.com"), ADMIN_KEY, "{}").await.0, 400);
    // A key that fits alone but not as the stored `principal/key`: 400 naming the limit,
    // never an operation the operator API could not address.
    let (s, _, b) = send(&p, "/charges", Some(&"k".repeat(255)), ADMIN_KEY, "{}").await;
    assert_eq!(s, 400, "{b}");
    assert!(b.contains("at most"), "{b}");
    assert_eq!(p.http.get(p.url("/charges")).send().await.unwrap().status(), 200);
    assert_eq!(up.count("/charges"), 1, "nothing refused reached the upstream");

    // Keys are per client: another principal's same key is its own request.
    let other = p.create_key("default", "client");
    assert_eq!(send(&p, "/charges", Some("charge-1"), &other, r#"{"amount": 100, "currency": "EUR"}"#).await.0, 201);
    assert_eq!(up.count("/charges"), 2);
    assert_eq!(send(&p, "/charges", Some("charge-1"), "idem_bogus", "{}").await.0, 401);

    // Concurrent duplicates: one forwarded, the rest 409 while it is in flight.
    let tasks: Vec<_> = (0..8)
        .map(|_| {
            let (http, url) = (p.http.clone(), p.url("/slow"));
            tokio::spawn(async move {
                http.post(url)
                    .header("idem-api-key", ADMIN_KEY)
                    .header("idempotency-key", "slow-1")
                    .body("{}")
                    .send()
                    .await
                    .unwrap()
                    .status()
                    .as_u16()
            })
        })
        .collect();
    let mut statuses = Vec::new();
    for t in tasks {
        statuses.push(t.await.unwrap());
    }
    assert_eq!(statuses.iter().filter(|s| **s == 201).count(), 1, "{statuses:?}");
    assert!(statuses.iter().all(|s| *s == 201 || *s == 409), "{statuses:?}");
    assert_eq!(up.count("/slow"), 1);

    // 5xx is not stored: the key is released and the retry is forwarded.
    assert_eq!(send(&p, "/flaky", Some("flaky-1"), ADMIN_KEY, "{}").await.0, 503);
    assert_eq!(send(&p, "/flaky", Some("flaky-1"), ADMIN_KEY, "{}").await.0, 201);
    assert_eq!(send(&p, "/flaky", Some("flaky-1"), ADMIN_KEY, "{}").await.1["idempotent-replayed"], "true");
    assert_eq!(up.count("/flaky"), 2);
    // A final 4xx is stored and replayed.
    assert_eq!(send(&p, "/invalid", Some("inv-1"), ADMIN_KEY, "{}").await.0, 422);
    let (s, h, _) = send(&p, "/invalid", Some("inv-1"), ADMIN_KEY, "{}").await;
    assert_eq!((s, h["idempotent-replayed"].to_str().unwrap()), (422, "true"));
    assert_eq!(up.count("/invalid"), 1);

    // Too large: 413, clearly, and nothing forwarded.
    let big = format!(r#"{{"amount": 1, "pad": "{}"}}"#, "x".repeat(100_000));
    let (s, h, b) = send(&p, "/charges", Some("big-1"), ADMIN_KEY, &big).await;
    assert_eq!(s, 413, "{b}");
    assert_eq!(h["content-type"], "application/problem+json");

    // The upstream takes the request and never answers: 504 outcome unknown; the retry is
    // 409 and is not forwarded again.
    let (s, _, b) = send(&p, "/hang", Some("hang-1"), ADMIN_KEY, "{}").await;
    assert_eq!(s, 504, "{b}");
    assert!(b.contains("outcome-unknown"));
    assert!(!b.contains(&upstream) && !b.contains("127.0.0.1"), "the upstream's address stays private: {b}");
    for bad in ["\"unterminated", "a b", "a\"b"] {
        assert_eq!(send(&p, "/charges", Some(bad), ADMIN_KEY, "{}").await.0, 400, "{bad}");
    }
    let (s, _, b) = send(&p, "/hang", Some("hang-1"), ADMIN_KEY, "{}").await;
    assert_eq!(s, 409, "{b}");
    assert!(b.contains("outcome-unknown"));
    assert_eq!(up.count("/hang"), 1, "never forwarded again on its own");

    // The upstream dies in the middle of its answer: 502 outcome unknown, never resent.
    let (s, _, b) = send(&p, "/die", Some("die-1"), ADMIN_KEY, "{}").await;
    assert_eq!(s, 502, "{b}");
    assert!(b.contains("outcome-unknown"));
    assert_eq!(send(&p, "/die", Some("die-1"), ADMIN_KEY, "{}").await.0, 409);
    assert_eq!(up.count("/die"), 1);

    // Restart between the first request and a retry: nothing is lost.
    let p = p.restart();
    let (s, h, b) = send(&p, "/charges", Some("charge-1"), ADMIN_KEY, r#"{"amount": 100, "currency": "EUR"}"#).await;
    assert_eq!((s, h["idempotent-replayed"].to_str().unwrap()), (201, "true"));
    assert_eq!(b, b1);
    assert_eq!(send(&p, "/hang", Some("hang-1"), ADMIN_KEY, "{}").await.0, 409);

    // An operator settles the unknown one through idem's API under /_idem/.
    // The client's tenant-mates cannot reach its proxied requests through idem's API.
    let mate = p.create_key("default", "operator");
    assert_eq!(p.get(&mate, "/_idem/v1/operations/bootstrap%2Fhang-1").await.status, 404);
    let squat = json!({"key": "bootstrap/squat-1", "action": "proxy:POST", "payload": {}});
    assert_eq!(p.post(&mate, "/_idem/v1/operations", &squat).await.status, 201, "its own tenant's record");
    assert_eq!(send(&p, "/charges", Some("squat-1"), ADMIN_KEY, r#"{"amount": 1}"#).await.0, 201, "not blocked by it");
    // An operator of the proxy's tenant (default.proxy) settles the unknown one.
    let operator = p.create_key("default.proxy", "operator");
    let r = p
        .post(
            &operator,
            "/_idem/v1/operations/bootstrap%2Fhang-1/resolve",
            &json!({"to": "SUCCEEDED", "reason": "the upstream's log shows it", "evidence": "hang-log-1"}),
        )
        .await;
    assert_eq!(r.status, 200, "{r:?}");
    let (s, h, _) = send(&p, "/hang", Some("hang-1"), ADMIN_KEY, "{}").await;
    assert_eq!((s, h["idempotent-replayed"].to_str().unwrap()), (200, "true"));
    assert_eq!(up.count("/hang"), 1);
}

/// Issue 11 item 2 through the proxy: the upstream acts, then answers 504 (502, 500). That
/// does not prove it did nothing, so the outcome is UNKNOWN like a timeout: the client gets
/// problem outcome-unknown with the upstream's status, its retry 409, and the request is
/// never forwarded again. A 503 is still released for the retry, and a route configured
/// with `--outcome-unknown-statuses` gets the list it names (`none`: the old behaviour).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ambiguous_5xx_from_the_upstream_is_never_forwarded_again() {
    let (up, upstream) = start_upstream().await;
    let db = Db::new(Backend::Sqlite).await;
    let routes = ["--outcome-unknown-statuses", "/legacy=none", "--outcome-unknown-statuses", "/narrow=502,504"];
    let p = Server::start_proxy(&db.url, &upstream, &routes);
    let operator = p.create_key("default.proxy", "operator");
    for status in [504, 502, 500] {
        let (path, key) = (format!("/acts_then/{status}"), format!("amb-{status}"));
        let (s, h, b) = send(&p, &path, Some(&key), ADMIN_KEY, "{}").await;
        assert_eq!(s, status, "the upstream's status: {b}");
        assert_eq!(h["content-type"], "application/problem+json", "{b}");
        let v: Value = serde_json::from_str(&b).unwrap();
        assert_eq!(v["type"], "/problems/outcome-unknown", "{b}");
        assert!(v["detail"].as_str().unwrap().contains("will not be forwarded again"), "{b}");
        let (s, _, b) = send(&p, &path, Some(&key), ADMIN_KEY, "{}").await;
        assert_eq!(s, 409, "{b}");
        assert!(b.contains("outcome-unknown"), "{b}");
        assert_eq!(up.count(&path), 1, "{status}: one upstream effect, the retry was not forwarded");
        // No lookup configured: the reconciler flags it for an operator.
        let start = std::time::Instant::now();
        loop {
            let rec = p.get(&operator, &format!("/_idem/v1/operations/bootstrap%2F{key}")).await.body;
            assert_eq!(rec["state"], "UNKNOWN", "{rec}");
            if rec["needs_review"] == true {
                break;
            }
            assert!(start.elapsed() < Duration::from_secs(10), "never flagged for review: {rec}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    // 503 proves the upstream did not process it: passed on, and the retry is forwarded.
    assert_eq!(send(&p, "/flaky", Some("flaky-2"), ADMIN_KEY, "{}").await.0, 503);
    assert_eq!(send(&p, "/flaky", Some("flaky-2"), ADMIN_KEY, "{}").await.0, 201);
    assert_eq!(up.count("/flaky"), 2);

    // A route with `none`: every 5xx passed on as the upstream sent it, the retry forwarded.
    let (s, h, b) = send(&p, "/legacy/acts_then/504", Some("legacy-1"), ADMIN_KEY, "{}").await;
    assert_eq!((s, b.as_str()), (504, "gateway error 504"));
    assert_ne!(h["content-type"], "application/problem+json");
    assert_eq!(send(&p, "/legacy/acts_then/504", Some("legacy-1"), ADMIN_KEY, "{}").await.0, 504);
    assert_eq!(up.count("/legacy/acts_then/504"), 2, "forwarded again, as before");
    // A route narrowed to 502 and 504: its 500 is released, its 504 is unknown.
    send(&p, "/narrow/acts_then/500", Some("narrow-500"), ADMIN_KEY, "{}").await;
    send(&p, "/narrow/acts_then/500", Some("narrow-500"), ADMIN_KEY, "{}").await;
    assert_eq!(up.count("/narrow/acts_then/500"), 2);
    send(&p, "/narrow/acts_then/504", Some("narrow-504"), ADMIN_KEY, "{}").await;
    assert_eq!(send(&p, "/narrow/acts_then/504", Some("narrow-504"), ADMIN_KEY, "{}").await.0, 409);
    assert_eq!(up.count("/narrow/acts_then/504"), 1);
}

/// A bad per-route flag stops the proxy at start-up with one line naming it.
#[test]
fn a_bad_per_route_flag_fails_at_start_up() {
    let dir = tempfile::tempdir().unwrap();
    for (flag, bad, says) in [
        ("--outcome-unknown-statuses", "404", "not a 5xx status"),
        ("--outcome-unknown-statuses", "payments=504", "path prefix"),
        ("--outcome-unknown-statuses", "5o4", "not a 5xx status"),
        ("--provider-deduplicates", "yes", "not true or false"),
        ("--provider-deduplicates", "v1/charges=true", "path prefix"),
        ("--error-format", "json", "not an error format"),
        ("--error-format", "v1=stripe", "path prefix"),
    ] {
        let out = std::process::Command::new(common::idem_bin())
            .args(["proxy", "--upstream", "http://127.0.0.1:9/", "--listen", "127.0.0.1:0", "--database-url"])
            .arg(dir.path().join("p.db"))
            .args([flag, bad])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{bad}: {err}");
        assert!(err.contains(flag) && err.contains(says) && err.contains(bad), "{bad}: {err}");
        assert_eq!(err.trim_end().lines().count(), 1, "one line: {err}");
    }
}

/// A provider that deduplicates by `Idempotency-Key` itself, as Stripe does: it stores its
/// answer per key and replays it. Modes, for the first request of a key: `fails_first`
/// answers 500 without acting, `busy_first` 409 ("a request with this key is in
/// progress"), `hangs_first` never answers and does not act, `acts_then_hangs` acts and
/// stores, then never answers; `acts` just acts.
#[derive(Clone, Default)]
struct Dedup(Arc<Mutex<HashMap<String, Seen>>>);

/// Per key: the requests received, and the stored answer once the effect exists.
type Seen = (u64, Option<String>);

impl Dedup {
    /// (requests received, whether the key's effect exists) for `key`.
    fn seen(&self, key: &str) -> (u64, bool) {
        self.0.lock().unwrap().get(key).map_or((0, false), |(n, stored)| (*n, stored.is_some()))
    }
}

async fn dedup_provider(
    State(d): State<Dedup>,
    axum::extract::Path(mode): axum::extract::Path<String>,
    headers: axum::http::HeaderMap,
) -> axum::response::Response {
    let key = headers["idempotency-key"].to_str().unwrap().to_string();
    let (calls, stored) = {
        let mut m = d.0.lock().unwrap();
        let e = m.entry(key.clone()).or_default();
        e.0 += 1;
        (e.0, e.1.clone())
    };
    if let Some(body) = stored {
        return (StatusCode::CREATED, [("idempotent-replayed", "true")], body).into_response();
    }
    let act = || {
        let body = json!({"id": format!("ch_{key}")}).to_string();
        d.0.lock().unwrap().get_mut(&key).unwrap().1 = Some(body.clone());
        body
    };
    match (mode.as_str(), calls) {
        ("fails_first", 1) => (StatusCode::INTERNAL_SERVER_ERROR, Json(json!({"error": "try again"}))).into_response(),
        ("busy_first", 1) => (StatusCode::CONFLICT, Json(json!({"error": "in progress"}))).into_response(),
        ("hangs_first", 1) => std::future::pending().await,
        ("acts_then_hangs", 1) => {
            act();
            std::future::pending().await
        }
        _ => (StatusCode::CREATED, act()).into_response(),
    }
}

/// Issue 28 §5 with a plain client: on a route declared `--provider-deduplicates`, an
/// ambiguous answer (500, a timeout before or after the upstream acted) and the upstream's
/// own 409 release the key instead of leaving the outcome unknown; the retry with the same
/// key is forwarded and the upstream's deduplication makes it one effect. The upstream's
/// answers are passed on as sent and not stored; the proxy's own timeout answer is a
/// problem+json `upstream-no-answer`. A route not declared keeps outcome-unknown.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deduplicating_upstream_gets_the_retry_with_the_same_key() {
    let (up, upstream) = start_upstream().await;
    let d = Dedup::default();
    let app = Router::new().route("/dedup/{mode}", post(dedup_provider)).with_state(d.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let dedup_url = format!("http://{}/", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    let db = Db::new(Backend::Sqlite).await;
    let routes = ["--provider-deduplicates", "/dedup=true", "--timeout-ms", "400"];
    let p = Server::start_proxy(&db.url, &dedup_url, &routes);
    let operator = p.create_key("default.proxy", "operator");

    for (mode, first_status) in
        [("fails_first", 500), ("busy_first", 409), ("hangs_first", 504), ("acts_then_hangs", 504)]
    {
        let (path, key) = (format!("/dedup/{mode}"), format!("dd-{mode}"));
        // What the upstream is sent: the key scoped by the client's tenant and principal.
        let sent = format!("default.proxy/bootstrap/{key}");
        let (s, h, b) = send(&p, &path, Some(&key), ADMIN_KEY, "{}").await;
        assert_eq!(s, first_status, "{mode}: {b}");
        if first_status == 504 {
            let v: Value = serde_json::from_str(&b).unwrap();
            assert_eq!(h["content-type"], "application/problem+json", "{mode}: {b}");
            assert_eq!(v["type"], "/problems/upstream-no-answer", "{mode}: {b}");
        } else {
            assert_ne!(h["content-type"], "application/problem+json", "{mode}: the upstream's own answer: {b}");
            assert!(b.contains("error"), "{mode}: the upstream's body: {b}");
        }
        let rec = p.get(&operator, &format!("/_idem/v1/operations/bootstrap%2F{key}")).await.body;
        assert_eq!((rec["state"].as_str(), rec["redo_safe"].as_bool()), (Some("PENDING"), Some(true)), "{mode}: {rec}");
        let (s, _, b) = send(&p, &path, Some(&key), ADMIN_KEY, "{}").await;
        assert_eq!(s, 201, "{mode}: the retry is forwarded: {b}");
        assert_eq!(serde_json::from_str::<Value>(&b).unwrap()["id"], format!("ch_{sent}"), "{mode}");
        let (s, h, b2) = send(&p, &path, Some(&key), ADMIN_KEY, "{}").await;
        assert_eq!((s, h["idempotent-replayed"].to_str().unwrap(), b2), (201, "true", b), "{mode}: idem replays");
        assert_eq!(d.seen(&sent), (2, true), "{mode}: two requests reached the upstream, one effect");
        let rec = p.get(&operator, &format!("/_idem/v1/operations/bootstrap%2F{key}")).await.body;
        assert_eq!(rec["state"], "SUCCEEDED", "{mode}: {rec}");
    }

    // A final answer is stored as before: a mismatch is 422, and what the upstream refused
    // stays refused.
    let (s, _, b) = send(&p, "/dedup/acts", Some("dd-fails_first"), ADMIN_KEY, "{}").await;
    assert_eq!(s, 422, "another path under the same key: {b}");

    // Routes are independent: the same proxy in front of the first upstream, where only
    // /legacy deduplicates, keeps outcome-unknown on every other route.
    drop(p);
    let db = Db::new(Backend::Sqlite).await;
    let p = Server::start_proxy(&db.url, &upstream, &["--provider-deduplicates", "/legacy=true"]);
    let (s, h, _) = send(&p, "/acts_then/500", Some("nd-1"), ADMIN_KEY, "{}").await;
    assert_eq!((s, h["content-type"].to_str().unwrap()), (500, "application/problem+json"));
    assert_eq!(send(&p, "/acts_then/500", Some("nd-1"), ADMIN_KEY, "{}").await.0, 409);
    assert_eq!(up.count("/acts_then/500"), 1);
    let (s, _, b) = send(&p, "/legacy/acts_then/500", Some("nd-2"), ADMIN_KEY, "{}").await;
    assert_eq!((s, b.as_str()), (500, "gateway error 500"), "passed on as sent");
    assert_eq!(send(&p, "/legacy/acts_then/500", Some("nd-2"), ADMIN_KEY, "{}").await.0, 500);
    assert_eq!(up.count("/legacy/acts_then/500"), 2, "forwarded again: the upstream deduplicates");
}

/// Break-it findings: two clients that pick the same key are two requests to an upstream
/// that deduplicates by it (client B was answered with client A's charge, its own never
/// made), and an answer the upstream would compress is stored and replayed readable (a
/// gzip answer was replayed without its `Content-Encoding`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_keys_are_scoped_at_the_upstream_and_replays_are_readable() {
    let d = Dedup::default();
    let encodings: Arc<Mutex<Vec<Option<String>>>> = Arc::default();
    let seen = encodings.clone();
    let app = Router::new().route("/dedup/{mode}", post(dedup_provider)).with_state(d.clone()).layer(
        axum::middleware::from_fn(move |req: axum::extract::Request, next: axum::middleware::Next| {
            let seen = seen.clone();
            async move {
                let ae = req.headers().get("accept-encoding").map(|v| v.to_str().unwrap().to_owned());
                seen.lock().unwrap().push(ae);
                next.run(req).await
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    let db = Db::new(Backend::Sqlite).await;
    let p = Server::start_proxy(&db.url, &url, &["--provider-deduplicates", "/dedup=true"]);
    let other = p.create_key("default", "client");
    let (s, _, a) = send(&p, "/dedup/acts", Some("charge-42"), ADMIN_KEY, "{\"amount\":100}").await;
    assert_eq!(s, 201, "{a}");
    let (s, _, b) = send(&p, "/dedup/acts", Some("charge-42"), &other, "{\"amount\":999}").await;
    assert_eq!(s, 201, "{b}");
    assert_ne!(a, b, "B got its own charge, not A's");
    let keys: Vec<String> = d.0.lock().unwrap().keys().cloned().collect();
    assert_eq!(keys.len(), 2, "{keys:?}");
    assert!(keys.iter().all(|k| k.starts_with("default.proxy/") && k.ends_with("/charge-42")), "{keys:?}");
    // A quoted key (RFC 8941, as the draft writes it) is sent quoted.
    let (s, _, _) = send(&p, "/dedup/acts", Some("\"charge-43\""), ADMIN_KEY, "{}").await;
    assert_eq!(s, 201);
    assert!(d.0.lock().unwrap().contains_key("\"default.proxy/bootstrap/charge-43\""));
    // A client that accepts gzip: the upstream is not asked for it, so the stored answer
    // replays as plain JSON to any client.
    for _ in 0..2 {
        let r = p
            .http
            .post(p.url("/dedup/acts"))
            .header("idem-api-key", ADMIN_KEY)
            .header("idempotency-key", "gz-1")
            .header("accept-encoding", "gzip")
            .header("content-type", "application/json")
            .body("{}")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 201);
        assert!(r.headers().get("content-encoding").is_none());
        let v: Value = serde_json::from_slice(&r.bytes().await.unwrap()).expect("readable JSON");
        assert!(v["id"].as_str().unwrap().ends_with("/gz-1"), "{v}");
    }
    assert!(encodings.lock().unwrap().iter().all(Option::is_none), "{:?}", encodings.lock().unwrap());
}

/// `--error-format stripe`: the proxy's own errors are Stripe's error object with the
/// status unchanged (a reused key: 400 `idempotency_error`, as Stripe answers it), a
/// truthful `Stripe-Should-Retry` and `Request-Id`; the upstream's answers and the routes
/// left at `problem` are untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stripe_error_format_shapes_only_the_proxys_own_answers() {
    let (up, upstream) = start_upstream().await;
    let db = Db::new(Backend::Sqlite).await;
    let args = ["--error-format", "stripe", "--error-format", "/legacy=problem", "--timeout-ms", "300"];
    let p = Server::start_proxy(&db.url, &upstream, &[&args[..], &["--max-body-bytes", "1024"]].concat());
    let stripe = |what: &str, (s, h, b): &(u16, reqwest::header::HeaderMap, String)| {
        assert_eq!(h["content-type"], "application/json", "{what}: {b}");
        assert_eq!(h["request-id"], h["x-request-id"], "{what}: Stripe's SDKs read Request-Id");
        let v: Value = serde_json::from_str(b).unwrap();
        let e = &v["error"];
        assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{what}: {b}");
        let retry = h.get("stripe-should-retry").map(|v| v.to_str().unwrap().to_owned());
        (*s, e["type"].as_str().unwrap().to_owned(), e["code"].as_str().unwrap().to_owned(), retry)
    };
    let t = |s: u16, kind: &str, code: &str, retry: &str| (s, kind.to_owned(), code.to_owned(), Some(retry.to_owned()));

    let r = send(&p, "/charges", None, ADMIN_KEY, "{}").await;
    assert_eq!(stripe("no key", &r), t(400, "invalid_request_error", "missing_idempotency_key", "false"));
    let r = send(&p, "/charges", Some("a b"), ADMIN_KEY, "{}").await;
    assert_eq!(stripe("bad key", &r), t(400, "invalid_request_error", "invalid_idempotency_key", "false"));
    let r = send(&p, "/charges", Some("st-1"), "idem_bogus", "{}").await;
    assert_eq!(stripe("unknown API key", &r), t(401, "invalid_request_error", "unauthorized", "false"));
    let r = send(&p, "/charges", Some("st-2"), ADMIN_KEY, &format!(r#"{{"pad": "{}"}}"#, "x".repeat(2000))).await;
    assert_eq!(stripe("too large", &r), t(413, "invalid_request_error", "payload_too_large", "false"));
    assert_eq!(send(&p, "/charges", Some("st-3"), ADMIN_KEY, r#"{"amount": 1}"#).await.0, 201);
    let r = send(&p, "/charges", Some("st-3"), ADMIN_KEY, r#"{"amount": 2}"#).await;
    assert_eq!(stripe("reused key", &r), t(400, "idempotency_error", "fingerprint_mismatch", "false"));
    let r = send(&p, "/acts_then/500", Some("st-4"), ADMIN_KEY, "{}").await;
    assert_eq!(stripe("ambiguous 500", &r), t(500, "api_error", "outcome_unknown", "false"));
    let r = send(&p, "/acts_then/500", Some("st-4"), ADMIN_KEY, "{}").await;
    assert_eq!(stripe("its retry", &r), t(409, "api_error", "outcome_unknown", "false"));
    let r = send(&p, "/hang", Some("st-5"), ADMIN_KEY, "{}").await;
    assert_eq!(stripe("timeout", &r), t(504, "api_error", "outcome_unknown", "false"));
    assert_eq!((up.count("/charges"), up.count("/acts_then/500"), up.count("/hang")), (1, 1, 1));

    // The upstream's own answer passes untouched.
    let (s, h, b) = send(&p, "/invalid", Some("st-6"), ADMIN_KEY, "{}").await;
    assert_eq!((s, b.as_str()), (422, r#"{"error":"amount must be positive"}"#));
    assert!(h.get("stripe-should-retry").is_none() && h.get("request-id").is_none(), "{h:?}");
    // A route left at problem+json keeps it, request id in the body.
    let (s, h, b) = send(&p, "/legacy/acts_then/500", None, ADMIN_KEY, "{}").await;
    assert_eq!((s, h["content-type"].to_str().unwrap()), (400, "application/problem+json"));
    let v: Value = serde_json::from_str(&b).unwrap();
    assert_eq!(
        (v["type"].as_str(), v["request_id"].as_str()),
        (Some("/problems/missing-idempotency-key"), h["x-request-id"].to_str().ok())
    );
    // idem's own API under /_idem/ is idem's: problem+json.
    let r = p.get("idem_bogus", "/_idem/v1/operations/x").await;
    assert_eq!((r.status.as_u16(), r.problem()), (401, "unauthorized"));
}

#[derive(Clone, Default)]
struct Booked(Arc<Mutex<(Vec<String>, u64)>>);

/// With `--lookup-url`, an UNKNOWN request is settled by asking the upstream: found ⇒ the
/// retry gets the evidence, absent ⇒ the next retry is forwarded, never before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxy_settles_unknown_requests_by_the_upstream_lookup() {
    let booked = Booked::default();
    let app = Router::new()
        .route(
            "/book",
            post(|State(b): State<Booked>, headers: axum::http::HeaderMap| async move {
                let key = headers["idempotency-key"].to_str().unwrap().to_string();
                b.0.lock().unwrap().0.push(key);
                std::future::pending::<()>().await;
            }),
        )
        .route(
            "/maybe",
            post(|State(b): State<Booked>, headers: axum::http::HeaderMap| async move {
                let calls = {
                    let mut g = b.0.lock().unwrap();
                    g.1 += 1;
                    g.1
                };
                if calls == 1 {
                    std::future::pending::<()>().await; // never took effect
                }
                b.0.lock().unwrap().0.push(headers["idempotency-key"].to_str().unwrap().to_string());
                (StatusCode::CREATED, "booked")
            }),
        )
        .route(
            "/lookup",
            axum::routing::get(
                |State(b): State<Booked>, q: axum::extract::Query<HashMap<String, String>>| async move {
                    let found = b.0.lock().unwrap().0.contains(&q["key"]);
                    Json(if found { json!([{"id": format!("bk_{}", q["key"])}]) } else { json!([]) })
                },
            ),
        )
        .with_state(booked.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    let db = Db::new(Backend::Postgres).await;
    let lookup = format!("http://{addr}/lookup?key={{key}}");
    let p = Server::start_proxy(
        &db.url,
        &format!("http://{addr}/"),
        &["--timeout-ms", "600", "--lookup-url", &lookup, "--lookup-absent-after-ms", "300"],
    );

    assert_eq!(send(&p, "/book", Some("b-1"), ADMIN_KEY, "{}").await.0, 504);
    let start = std::time::Instant::now();
    let settled = loop {
        let (s, h, b) = send(&p, "/book", Some("b-1"), ADMIN_KEY, "{}").await;
        if s != 409 {
            break (s, h, b);
        }
        assert!(start.elapsed() < Duration::from_secs(15), "never settled");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(settled.0, 200, "{settled:?}");
    assert_eq!(settled.1["idempotent-replayed"], "true");
    // The lookup asks with the key the upstream was sent (scoped by tenant and principal).
    assert!(settled.2.contains("bk_default.proxy/bootstrap/b-1"), "the evidence: {}", settled.2);
    assert_eq!(
        booked.0.lock().unwrap().0.iter().filter(|k| *k == "default.proxy/bootstrap/b-1").count(),
        1,
        "booked once"
    );

    assert_eq!(send(&p, "/maybe", Some("m-1"), ADMIN_KEY, "{}").await.0, 504);
    let start = std::time::Instant::now();
    let retried = loop {
        let (s, _, b) = send(&p, "/maybe", Some("m-1"), ADMIN_KEY, "{}").await;
        if s != 409 {
            break (s, b);
        }
        assert!(start.elapsed() < Duration::from_secs(15), "never settled");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(retried.0, 201, "absent ⇒ forwarded again: {retried:?}");
    assert_eq!(booked.0.lock().unwrap().1, 2, "exactly one more call after the lookup proved absence");
}

/// Turning the lookup on (or off) between a request and its retry changes nothing for the
/// client: the same key is the same operation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_config_change_between_request_and_retry_is_not_a_new_intent() {
    let (up, upstream) = start_upstream().await;
    let db = Db::new(Backend::Sqlite).await;
    let p = Server::start_proxy(&db.url, &upstream, &[]);
    let (s1, _, b1) = send(&p, "/charges", Some("cfg-1"), ADMIN_KEY, r#"{"amount": 5}"#).await;
    assert_eq!(s1, 201);
    drop(p);
    let lookup = format!("{upstream}charges?k={{key}}");
    let p = Server::start_proxy(&db.url, &upstream, &["--lookup-url", &lookup]);
    let (s, h, b) = send(&p, "/charges", Some("cfg-1"), ADMIN_KEY, r#"{"amount": 5}"#).await;
    assert_eq!((s, h["idempotent-replayed"].to_str().unwrap(), b), (201, "true", b1));
    assert_eq!(up.count("/charges"), 1);
}

/// Issue 15: the proxy's own problem answers had no `request_id` / `x-request-id` (serve's
/// have both), and its start-up output did not name the upstream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxys_own_answers_carry_the_request_id_and_its_start_names_the_upstream() {
    use std::io::BufRead;
    let db = Db::new(Backend::Sqlite).await;
    let (up, upstream) = start_upstream().await;
    let p = Server::start_proxy(&db.url, &upstream, &["--max-body-bytes", "1024"]);
    let post = |path: &str| p.http.post(p.url(path)).header("content-type", "application/json");
    let cases = [
        ("no Idempotency-Key", post("/charges").header("idem-api-key", ADMIN_KEY).body("{}"), 400),
        ("no Idem-Api-Key", post("/charges").header("idempotency-key", "k-1").body("{}"), 401),
        (
            "unknown API key",
            post("/charges").header("idem-api-key", "idem_nope").header("idempotency-key", "k-1").body("{}"),
            401,
        ),
        (
            "too large",
            post("/charges").header("idem-api-key", ADMIN_KEY).header("idempotency-key", "k-2").body(vec![b' '; 4096]),
            413,
        ),
        (
            "bad JSON",
            post("/charges").header("idem-api-key", ADMIN_KEY).header("idempotency-key", "k-3").body("{"),
            400,
        ),
        (
            "a compressed body (as the API: 415, not 'not valid JSON')",
            post("/charges")
                .header("idem-api-key", ADMIN_KEY)
                .header("idempotency-key", "k-5")
                .header("content-encoding", "gzip")
                .body(vec![0x1f, 0x8b, 0x08, 0x00]),
            415,
        ),
    ];
    for (what, req, status) in cases {
        for own_id in [None, Some("client-req-7")] {
            let req = req.try_clone().unwrap();
            let req = match own_id {
                Some(id) => req.header("x-request-id", id),
                None => req,
            };
            let r = common::Resp::read(req.send().await.unwrap()).await;
            assert_eq!(r.status.as_u16(), status, "{what}: {r:?}");
            assert_eq!(r.header("content-type"), Some("application/problem+json"), "{what}: the default format");
            assert!(r.header("stripe-should-retry").is_none(), "{what}: {r:?}");
            let header = r.header("x-request-id").unwrap_or_else(|| panic!("{what}: no x-request-id: {r:?}"));
            assert_eq!(r.body["request_id"].as_str(), Some(header), "{what}: {r:?}");
            if let Some(id) = own_id {
                assert_eq!(header, id, "{what}: the client's own id is kept");
            }
        }
    }
    assert_eq!(up.count("/charges"), 0, "nothing was forwarded");
    // A gzip body under `content_type`, to the upstream's /invalid (which answers 422).
    let gzip_post = |key: &'static str, content_type: &'static str| {
        p.http
            .post(p.url("/invalid"))
            .header("idem-api-key", ADMIN_KEY)
            .header("idempotency-key", key)
            .header("content-type", content_type)
            .header("content-encoding", "gzip")
            .body(vec![0x1f, 0x8b, 0x08, 0x00])
            .send()
    };
    // A compressed body that is not JSON is fingerprinted as sent and forwarded.
    assert_eq!(gzip_post("k-6", "application/octet-stream").await.unwrap().status(), 422, "the upstream's answer");
    assert_eq!(up.count("/invalid"), 1);
    // Media types are case-insensitive: an upper-case JSON type is JSON (RFC 9110 §8.3.1).
    assert_eq!(gzip_post("k-7", "Application/JSON").await.unwrap().status(), 415);
    assert_eq!(up.count("/invalid"), 1, "not forwarded");
    // An upstream's answer is passed on as it was (no request id put into its body).
    let r = p
        .http
        .post(p.url("/invalid"))
        .header("idem-api-key", ADMIN_KEY)
        .header("idempotency-key", "k-4")
        .header("content-type", "application/json")
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 422);
    assert_eq!(r.json::<Value>().await.unwrap(), json!({"error": "amount must be positive"}));

    // `/metrics` counts what the proxy forwarded and refused itself, under one route label,
    // and the `/_idem/` API once (its own router counts it, the proxy's does not).
    let health = p.http.get(p.url("/_idem/healthz")).send().await.unwrap();
    assert_eq!(health.status(), 200);
    let text = p.http.get(p.url("/_idem/metrics")).send().await.unwrap().text().await.unwrap();
    let proxied = |status: &str| {
        common::metric(
            &text,
            "idem_http_requests_total",
            &[("method", "POST"), ("route", "proxied"), ("status", status)],
        )
    };
    for (status, n) in [("400", 4.0), ("401", 4.0), ("413", 2.0), ("415", 3.0), ("422", 2.0)] {
        assert_eq!(proxied(status), n, "{status}: {text}");
    }
    assert_eq!(common::metric(&text, "idem_http_requests_total", &[("route", "/_idem/healthz")]), 1.0, "{text}");
    assert!(!text.contains("/charges") && !text.contains("/invalid"), "no raw path is a label: {text}");

    // The start-up lines name the upstream (another database: one process per SQLite file).
    let db = Db::new(Backend::Sqlite).await;
    let mut child = std::process::Command::new(common::idem_bin())
        .args(["proxy", "--upstream", &upstream, "--listen", "127.0.0.1:0", "--database-url", &db.url])
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = Vec::new();
    for line in std::io::BufReader::new(child.stdout.take().unwrap()).lines() {
        let line = line.unwrap();
        let done = line.starts_with("idem: listening on ");
        lines.push(line);
        if done {
            break;
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    assert!(lines.iter().any(|l| l.contains(&upstream)), "{lines:?}");
}
