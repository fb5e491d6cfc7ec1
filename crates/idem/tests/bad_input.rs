//! Bad input gets a clear problem+json error and changes nothing already recorded.

mod common;

use common::{ADMIN_KEY, Backend, Db, Server, event_kinds};
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_are_clear_errors_and_change_nothing() {
    let db = Db::new(Backend::Sqlite).await;
    let s = Server::start(&db.url);
    let key = "INQ-200:confirmation:v1";
    let granted = s.acquire(key, json!({"to": "c"})).await;
    assert_eq!(granted.status, 201);
    let tok = granted.token();
    let ok = s.complete(key, json!({"fencing_token": tok, "outcome": "succeeded", "provider_ref": "m-200"})).await;
    assert_eq!(ok.status, 200);
    let before = s.record(key).await.body;
    // One connection per request: the server closes a connection after refusing a body
    // too large to read (413), and a pooled client could send the next request on it
    // before it sees the close (a flake: `IncompleteMessage`).
    let raw = |body: String| {
        s.http
            .post(s.url("/v1/operations"))
            .bearer_auth(ADMIN_KEY)
            .header("content-type", "application/json")
            .header("connection", "close")
            .body(body)
            .send()
    };

    // Oversized body: 413 (default limit 1 MiB).
    let big = format!(r#"{{"key":"{key}","action":"send_confirmation","payload":"{}"}}"#, "x".repeat(2 * 1024 * 1024));
    let r = raw(big).await.unwrap();
    assert_eq!(r.status(), 413);
    assert_eq!(r.headers()["content-type"], "application/problem+json");
    // Refused before its handler, yet counted under its route (the body guard runs inside
    // the router; outside it, a break-it pass saw route="unmatched").
    let metrics = s.http.get(s.url("/metrics")).send().await.unwrap().text().await.unwrap();
    assert!(
        metrics.contains(r#"idem_http_requests_total{method="POST",route="/v1/operations",status="413"} 1"#),
        "{metrics}"
    );
    // Invalid JSON: 400.
    let r = raw(format!(r#"{{"key":"{key}","action":"#)).await.unwrap();
    assert_eq!(r.status(), 400);
    let body: serde_json::Value = r.json().await.unwrap();
    assert_eq!(body["type"], "/problems/invalid-request");
    assert!(body["detail"].as_str().unwrap().contains("not valid JSON"), "{body}");
    // Missing key: 400 missing-idempotency-key.
    let r = s.post(ADMIN_KEY, "/v1/operations", &json!({"action": "send_confirmation"})).await;
    assert_eq!((r.status.as_u16(), r.problem()), (400, "missing-idempotency-key"));
    // A key with an e-mail address: 400 invalid-idempotency-key.
    let r = s.acquire("welcome:jane.doe@example.com", json!({})).await;
    assert_eq!((r.status.as_u16(), r.problem()), (400, "invalid-idempotency-key"));
    assert!(r.body["detail"].as_str().unwrap().contains("e-mail"));
    // Unknown field, duplicate member, out-of-range lease: 400.
    let r = s.post(ADMIN_KEY, "/v1/operations", &json!({"key": key, "action": "a", "colour": "red"})).await;
    assert_eq!((r.status.as_u16(), r.problem()), (400, "invalid-request"));
    assert!(r.body["detail"].as_str().unwrap().contains("colour"));
    let r = raw(format!(r#"{{"key":"{key}","action":"send_confirmation","payload":{{"to":"c","to":"d"}}}}"#))
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    // Numbers a double cannot carry exactly would collide in the fingerprint: 400.
    let r = raw(r#"{"key":"big-id","action":"refund","payload":{"payment_id":1795999717611524801}}"#.to_string())
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    assert!(r.text().await.unwrap().contains("2^53"));
    // A fingerprint field that names nothing (a typo) or an empty list: 400, never a silent pass.
    let typo = json!({"key": "ff", "action": "send", "payload": {"to": "a"}, "fingerprint_fields": ["/To"]});
    let r = s.post(ADMIN_KEY, "/v1/operations", &typo).await;
    assert_eq!((r.status.as_u16(), r.problem()), (400, "invalid-request"));
    let empty = json!({"key": "ff", "action": "send", "payload": {"to": "a"}, "fingerprint_fields": []});
    assert_eq!(s.post(ADMIN_KEY, "/v1/operations", &empty).await.status, 400);
    // Keys URLs cannot address, and a doubled Idempotency-Key header: 400.
    assert_eq!(s.acquire("..", json!({})).await.problem(), "invalid-idempotency-key");
    let r = s
        .http
        .post(s.url("/v1/operations"))
        .bearer_auth(ADMIN_KEY)
        .header("idempotency-key", "m-1")
        .header("idempotency-key", "m-2")
        .json(&json!({"action": "send"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    // A path key that is not UTF-8 once decoded: 400 problem+json, not plain text.
    let r = s.get(ADMIN_KEY, "/v1/operations/%FF%FE").await;
    assert_eq!((r.status.as_u16(), r.problem()), (400, "invalid-idempotency-key"));
    // Evidence with control characters (terminal escapes): 400.
    let esc = json!({"fencing_token": tok, "outcome": "succeeded", "provider_ref": "ok\u{1b}[2J"});
    assert_eq!(s.complete(key, esc).await.problem(), "invalid-request");
    // An over-long completion message: 400.
    let long = json!({"fencing_token": tok, "outcome": "unknown", "message": "m".repeat(5000)});
    assert_eq!(s.complete(key, long).await.problem(), "invalid-request");
    // Wrong method on a known route: 405 problem+json.
    let r = s.http.delete(s.url("/v1/operations")).bearer_auth(ADMIN_KEY).send().await.unwrap();
    assert_eq!(r.status(), 405);
    assert_eq!(r.headers()["content-type"], "application/problem+json");

    // Stale fencing token: 409 stale-fencing-token.
    let r = s.complete(key, json!({"fencing_token": tok + 1, "outcome": "succeeded", "provider_ref": "other"})).await;
    assert_eq!((r.status.as_u16(), r.problem()), (409, "stale-fencing-token"));
    assert_eq!(r.body["current_fencing_token"], tok);
    // Completion of a SUCCEEDED record with another outcome: 409 operation-final.
    let r =
        s.complete(key, json!({"fencing_token": tok, "outcome": "final_failure", "error_class": "validation"})).await;
    assert_eq!((r.status.as_u16(), r.problem()), (409, "operation-final"));
    // Succeeded without evidence: 400.
    let r = s.complete(key, json!({"fencing_token": tok, "outcome": "succeeded"})).await;
    assert_eq!((r.status.as_u16(), r.problem()), (400, "invalid-request"));
    // No or wrong API key: 401 with WWW-Authenticate.
    let r = s.acquire_as("idem_not-a-key", key, json!({})).await;
    assert_eq!((r.status.as_u16(), r.problem()), (401, "unauthorized"));
    assert!(r.header("www-authenticate").unwrap().starts_with("Bearer"));
    // Wrong content type: 415.
    let r = s.http.post(s.url("/v1/operations")).bearer_auth(ADMIN_KEY).body("{}").send().await.unwrap();
    assert_eq!(r.status(), 415);
    // A compressed body is not read as JSON (a break-it pass got 400 "not valid JSON"): 415.
    let r = s
        .http
        .post(s.url("/v1/operations"))
        .bearer_auth(ADMIN_KEY)
        .header("content-type", "application/json")
        .header("content-encoding", "gzip")
        .body(vec![0x1f, 0x8b, 0x08, 0x00])
        .send()
        .await
        .unwrap();
    let r = common::Resp::read(r).await;
    assert_eq!((r.status.as_u16(), r.problem()), (415, "unsupported-media-type"), "{r:?}");
    assert!(r.body["detail"].as_str().unwrap().contains("gzip"), "{r:?}");
    // Bad list filter: 400.
    let r = s.get(ADMIN_KEY, "/v1/operations?state=DONE").await;
    assert_eq!((r.status.as_u16(), r.problem()), (400, "invalid-request"));

    // Messages that say what is wrong (a break-it pass found misleading ones).
    let r = s.post_raw(ADMIN_KEY, "/v1/operations", r#"{"key":"k-s","action":"a","payload":{"t":"\ud800"}}"#).await;
    assert_eq!(r.status, 400);
    assert!(r.body["detail"].as_str().unwrap().contains("surrogate pair"), "{r:?}");
    let deep = format!(r#"{{"key":"k-d","action":"a","payload":{}{}}}"#, "[".repeat(65), "]".repeat(65));
    let r = s.post_raw(ADMIN_KEY, "/v1/operations", &deep).await;
    assert!(r.body["detail"].as_str().unwrap().contains("at most 64 levels"), "{r:?}");
    let r = s
        .http
        .post(s.url("/v1/operations"))
        .bearer_auth(ADMIN_KEY)
        .header("idempotency-key", r#""k-p";a=1"#)
        .json(&json!({"action": "a"}))
        .send()
        .await
        .unwrap();
    let r = common::Resp::read(r).await;
    assert_eq!(r.problem(), "invalid-idempotency-key");
    assert!(r.body["detail"].as_str().unwrap().contains("parameters"), "{r:?}");
    for (body, says) in [
        (
            json!({"workflow": "w", "instance_id": "i-1", "trace_id": "abc+1", "steps": [{"name": "a", "action": "a"}]}),
            "[A-Za-z0-9._:-]",
        ),
        (json!({"workflow": "w", "instance_id": "", "steps": [{"name": "a", "action": "a"}]}), "1 to 180"),
        (
            json!({"workflow": "w", "instance_id": "i-2", "steps": [{"name": "compensate-2", "action": "a"}]}),
            "compensate",
        ),
    ] {
        let r = s.post(ADMIN_KEY, "/v1/workflows", &body).await;
        assert_eq!(r.status, 400, "{r:?}");
        assert!(r.body["detail"].as_str().unwrap().contains(says), "{says}: {r:?}");
    }

    // Nothing changed: the record and its log are exactly as before.
    let after = s.record(key).await.body;
    assert_eq!(before, after);
    assert_eq!(event_kinds(&after), ["acquired", "completed"]);
    let all = s.get(ADMIN_KEY, "/v1/operations").await.body;
    assert_eq!(all["items"].as_array().unwrap().len(), 1, "no record created by a bad request");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openapi_and_probes_are_served() {
    let db = Db::new(Backend::Sqlite).await;
    let s = Server::start(&db.url);
    let doc = s.get(ADMIN_KEY, "/openapi.json").await.body;
    assert!(doc["openapi"].as_str().unwrap().starts_with("3."));
    for p in ["/v1/operations", "/v1/operations/{key}", "/v1/operations/{key}/complete", "/healthz", "/readyz"] {
        assert!(doc["paths"].get(p).is_some(), "{p} missing from the OpenAPI document");
    }
    assert!(doc["components"]["schemas"]["Problem"].is_object());
    assert_eq!(s.get("", "/healthz").await.status, 200);
    assert_eq!(s.get("", "/readyz").await.status, 200);
    let described = s.get("", "/problems/stale-fencing-token").await;
    assert_eq!(described.status, 200);
    assert!(described.body.as_str().unwrap().contains("fencing token"));
}

/// PostgreSQL text cannot hold U+0000: free text and filters with it are a 400 on both
/// stores (found as a 503 on PostgreSQL by a break-it pass), and nothing changes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nul_in_free_text_or_filters_is_a_400_on_postgres() {
    let db = Db::new(Backend::Postgres).await;
    let s = Server::start(&db.url);
    let key = "nul-1";
    let tok = s.acquire(key, json!({"to": "c"})).await.token();
    for outcome in [
        json!({"fencing_token": tok, "outcome": "unknown", "message": "a\u{0}b"}),
        json!({"fencing_token": tok, "outcome": "final_failure", "error_class": "x", "message": "a\u{0}b"}),
        json!({"fencing_token": tok, "outcome": "retryable_failure", "error_class": "x", "message": "\u{0}"}),
    ] {
        let r = s.complete(key, outcome).await;
        assert_eq!((r.status.as_u16(), r.problem()), (400, "invalid-request"), "{}", r.body);
    }
    assert_eq!(s.record(key).await.body["state"], "EXECUTING", "nothing changed");
    // Settle it as UNKNOWN, then an operator resolution with NUL in its reason.
    assert_eq!(s.complete(key, json!({"fencing_token": tok, "outcome": "unknown"})).await.status, 200);
    let r = s.post(ADMIN_KEY, "/v1/operations/nul-1/resolve", &json!({"to": "FAILED", "reason": "checked\u{0}"})).await;
    assert_eq!(r.status.as_u16(), 400, "{}", r.body);
    assert_eq!(s.record(key).await.body["state"], "UNKNOWN", "nothing changed");
    for filter in ["key_prefix=a%00", "action=a%00"] {
        let r = s.get(ADMIN_KEY, &format!("/v1/operations?{filter}")).await;
        assert_eq!(r.status.as_u16(), 400, "{filter}: {}", r.body);
    }
}

/// A body declared over the limit (1 MiB) but at most 16 MiB is read and dropped before
/// its 413, so a client that writes its whole body before it reads an answer (Python's
/// `http.client`) gets the 413 rather than a connection reset (a break-it pass: 7 of 10
/// such 2 MiB requests ended in `BrokenPipeError`); so is a chunked body found too large
/// while it is read; the connection stays usable. A larger one is answered at once,
/// before its body arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_body_sent_in_full_gets_its_413() {
    use std::io::{Read, Write};
    let db = Db::new(Backend::Sqlite).await;
    let s = Server::start(&db.url);
    let addr = s.base.trim_start_matches("http://").to_owned();
    let head = |len: usize| {
        format!(
            "POST /v1/operations HTTP/1.1\r\nHost: idem\r\nAuthorization: Bearer {ADMIN_KEY}\r\n\
             Content-Type: application/json\r\nContent-Length: {len}\r\n\r\n"
        )
    };
    tokio::task::spawn_blocking(move || {
        // One answer: its head, then as many body bytes as its Content-Length says.
        let answer = |c: &mut std::net::TcpStream| {
            let mut got = Vec::new();
            let mut buf = [0u8; 4096];
            loop {
                let text = String::from_utf8_lossy(&got).into_owned();
                if let Some(end) = text.find("\r\n\r\n") {
                    let len = text[..end]
                        .lines()
                        .find_map(|l| l.to_ascii_lowercase().strip_prefix("content-length: ").map(str::to_owned))
                        .map_or(0, |n| n.trim().parse::<usize>().unwrap());
                    if got.len() >= end + 4 + len {
                        return text;
                    }
                }
                let n = c.read(&mut buf).expect("the answer");
                assert!(n > 0, "closed before the whole answer: {text}");
                got.extend_from_slice(&buf[..n]);
            }
        };
        let body = vec![b' '; 2 * 1024 * 1024];
        let mut c = std::net::TcpStream::connect(&addr).unwrap();
        c.set_read_timeout(Some(std::time::Duration::from_secs(10))).unwrap();
        for i in 0..3 {
            // Sent as a network delivers it, in pieces: a server that answers and closes
            // at once resets the connection under the writes still to come.
            c.write_all(head(body.len()).as_bytes()).unwrap();
            for (n, piece) in body.chunks(64 * 1024).enumerate() {
                c.write_all(piece).unwrap_or_else(|e| panic!("request {i}: reset at piece {n} of the body: {e}"));
                std::thread::sleep(std::time::Duration::from_millis(2));
            }
            let got = answer(&mut c);
            assert!(got.starts_with("HTTP/1.1 413"), "request {i}: {got}");
            assert!(got.contains("application/problem+json") && got.contains("--max-body-bytes"), "{got}");
        }
        // The same body chunked: found too large while it is read, drained, then the 413.
        let chunked = head(0).replace("Content-Length: 0", "Transfer-Encoding: chunked");
        c.write_all(chunked.as_bytes()).unwrap();
        for (n, piece) in body.chunks(64 * 1024).enumerate() {
            let frame = [format!("{:x}\r\n", piece.len()).as_bytes(), piece, b"\r\n"].concat();
            c.write_all(&frame).unwrap_or_else(|e| panic!("chunked: reset at piece {n} of the body: {e}"));
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        c.write_all(b"0\r\n\r\n").unwrap();
        let got = answer(&mut c);
        assert!(got.starts_with("HTTP/1.1 413"), "chunked: {got}");
        // 20 MiB declared, nothing of it sent: the 413 comes without waiting for it.
        let mut c = std::net::TcpStream::connect(&addr).unwrap();
        c.set_read_timeout(Some(std::time::Duration::from_secs(5))).unwrap();
        c.write_all(head(20 * 1024 * 1024).as_bytes()).unwrap();
        let started = std::time::Instant::now();
        let got = answer(&mut c);
        assert!(got.starts_with("HTTP/1.1 413"), "{got}");
        assert!(started.elapsed() < std::time::Duration::from_secs(2), "answered after {:?}", started.elapsed());
    })
    .await
    .unwrap();
}
