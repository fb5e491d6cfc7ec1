//! What the fingerprint reads, over HTTP against real `idem serve` and `idem proxy`
//! processes, with the request bytes written out literally:
//! - canonically equivalent text (Unicode NFC, UAX #15) is the same intent: a retry whose
//!   client library normalizes differently is the same operation, not a 422;
//! - a number literal that an IEEE 754 double cannot carry exactly (`1e-400`, `4e-324`,
//!   `1.00000000000000000001`, …) is refused with a 400 that names it, instead of being
//!   taken for another number; nothing recorded changes.

mod common;

use common::{ADMIN_KEY, Backend, Db, Resp, Server, enc, event_kinds, idem_bin};
use serde_json::{Value, json};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

const OPS: &str = "/v1/operations";

/// An acquire body with `payload` spliced in as JSON text.
fn trigger(key: &str, payload: &str) -> String {
    format!(r#"{{"key":"{key}","action":"a","payload":{payload}}}"#)
}

fn detail(r: &Resp) -> &str {
    r.body["detail"].as_str().unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn canonically_equivalent_text_is_the_same_intent() {
    let db = Db::new(Backend::Sqlite).await;
    let s = Server::start(&db.url);

    // The issue's pair: ü as one code point (U+00FC), then as u + combining diaeresis.
    let composed = trigger("CITY-1", "{\"city\":\"Z\u{00FC}rich\"}");
    let decomposed = trigger("CITY-1", "{\"city\":\"Zu\u{0308}rich\"}");
    let first = s.post_raw(ADMIN_KEY, OPS, &composed).await;
    assert_eq!(first.status, 201, "{first:?}");
    let busy = s.post_raw(ADMIN_KEY, OPS, &decomposed).await;
    assert_eq!((busy.status.as_u16(), busy.problem()), (409, "operation-in-progress"), "{busy:?}");
    let done = s
        .complete("CITY-1", json!({"fencing_token": first.token(), "outcome": "succeeded", "provider_ref": "m-1"}))
        .await;
    assert_eq!(done.status, 200, "{done:?}");
    let replay = s.post_raw(ADMIN_KEY, OPS, &decomposed).await;
    assert_eq!((replay.status.as_u16(), replay.header("idempotent-replayed")), (200, Some("true")), "{replay:?}");
    assert_eq!(replay.body["fingerprint"], first.body["fingerprint"]);

    // Neighbours of the kind. The first form is sent first, and the record keeps the payload
    // exactly as it came (only the fingerprint's input is normalized).
    let pairs = [
        // Precomposed Hangul syllables vs conjoining jamo (sent first: stored as jamo).
        ("HANGUL", "\"\u{1112}\u{1161}\u{11AB}\u{1100}\u{116E}\u{11A8}\"", "\"\u{D55C}\u{AD6D}\""),
        // U+212B ANGSTROM SIGN is canonically equivalent to U+00C5 (a singleton).
        ("ANGSTROM", "\"\u{212B}\"", "\"\u{00C5}\""),
        // Member names, not only values.
        ("NAME", "{\"Zu\u{0308}rich\":1}", "{\"Z\u{00FC}rich\":1}"),
        // Deep inside arrays and objects.
        ("NESTED", "{\"a\":[1,{\"b\":[\"cafe\u{0301}\"]}]}", "{\"a\":[1,{\"b\":[\"caf\u{00E9}\"]}]}"),
        // Written as JSON escapes: the decoded text is what counts.
        ("ESCAPED", r#"{"w":"cafe\u0301"}"#, r#"{"w":"caf\u00e9"}"#),
        // Two combining marks in either order (canonical ordering: below before above).
        ("ORDER", "\"q\u{0323}\u{0307}\"", "\"q\u{0307}\u{0323}\""),
    ];
    for (key, a, b) in pairs {
        let r = s.post_raw(ADMIN_KEY, OPS, &trigger(key, a)).await;
        assert_eq!(r.status, 201, "{key}: {r:?}");
        let r = s.post_raw(ADMIN_KEY, OPS, &trigger(key, b)).await;
        assert_eq!((r.status.as_u16(), r.problem()), (409, "operation-in-progress"), "{key}: {r:?}");
        let stored = s.record(key).await.body;
        assert_eq!(stored["payload"], serde_json::from_str::<Value>(a).unwrap(), "{key}: stored as received");
    }

    // Compatibility equivalents are other text (NFC, not NFKC): the ligature ﬁ is not "fi".
    assert_eq!(s.post_raw(ADMIN_KEY, OPS, &trigger("LIGATURE", "\"\u{FB01}le\"")).await.status, 201);
    let r = s.post_raw(ADMIN_KEY, OPS, &trigger("LIGATURE", "\"file\"")).await;
    assert_eq!((r.status.as_u16(), r.problem()), (422, "fingerprint-mismatch"));

    // Two member names that are one name after NFC are duplicate members (I-JSON, RFC 7493
    // §2.3): refused, never one kept silently; nothing is recorded.
    for (key, payload) in [
        ("DUP-1", "{\"Z\u{00FC}rich\":1,\"Zu\u{0308}rich\":2}"),
        ("DUP-2", "{\"a\":[{\"\u{212B}\":1,\"\u{00C5}\":1}]}"),
    ] {
        let r = s.post_raw(ADMIN_KEY, OPS, &trigger(key, payload)).await;
        assert_eq!((r.status.as_u16(), r.problem()), (400, "invalid-request"), "{key}: {r:?}");
        assert!(detail(&r).contains("duplicate member name"), "{key}: {r:?}");
        assert_eq!(s.record(key).await.status, 404, "{key}: nothing recorded");
    }

    // fingerprint_fields: a pointer written in NFD names the NFC member (and vice versa).
    let with_fields = |payload: &str, field: &str| {
        format!(r#"{{"key":"PTR-1","action":"a","payload":{payload},"fingerprint_fields":["{field}"]}}"#)
    };
    let r = s.post_raw(ADMIN_KEY, OPS, &with_fields("{\"Z\u{00FC}rich\":\"x\",\"trace\":1}", "/Zu\u{0308}rich")).await;
    assert_eq!(r.status, 201, "{r:?}");
    let r = s.post_raw(ADMIN_KEY, OPS, &with_fields("{\"Zu\u{0308}rich\":\"x\",\"trace\":2}", "/Z\u{00FC}rich")).await;
    assert_eq!((r.status.as_u16(), r.problem()), (409, "operation-in-progress"), "{r:?}");
    let r = s.post_raw(ADMIN_KEY, OPS, &with_fields("{\"Z\u{00FC}rich\":\"y\"}", "/Z\u{00FC}rich")).await;
    assert_eq!((r.status.as_u16(), r.problem()), (422, "fingerprint-mismatch"), "{r:?}");
    // Two pointers that are one after NFC name one field twice: 400.
    let twice = "{\"key\":\"PTR-2\",\"action\":\"a\",\"payload\":{\"Z\u{00FC}rich\":1},\
                 \"fingerprint_fields\":[\"/Z\u{00FC}rich\",\"/Zu\u{0308}rich\"]}";
    let r = s.post_raw(ADMIN_KEY, OPS, twice).await;
    assert_eq!((r.status.as_u16(), r.problem()), (400, "invalid-request"), "{r:?}");
    assert!(detail(&r).contains("named twice"), "{r:?}");
}

/// Literals that do not survive the round trip through an IEEE 754 double and back to its
/// shortest form (RFC 8785 §3.2.2.3), with the issue's `1e-400` first.
const INEXACT: [&str; 11] = [
    "1e-400",
    "-1e-400",
    "1E-400",
    "1e400",
    "-1e400",
    "4e-324",
    "2.5e-324",
    "1.00000000000000000001",
    "0.1000000000000000000000000001",
    "9007199254740993",
    "123456789012345678",
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn numbers_a_double_cannot_carry_exactly_are_refused() {
    let db = Db::new(Backend::Sqlite).await;
    let s = Server::start(&db.url);
    let granted = s.post_raw(ADMIN_KEY, OPS, &trigger("N-1", r#"{"n":0}"#)).await;
    assert_eq!(granted.status, 201, "{granted:?}");
    let before = s.record("N-1").await.body;

    for lit in INEXACT {
        for payload in [format!(r#"{{"n":{lit}}}"#), format!(r#"{{"a":[1,{{"b":[{lit}]}}]}}"#)] {
            let r = s.post_raw(ADMIN_KEY, OPS, &trigger("N-1", &payload)).await;
            assert_eq!((r.status.as_u16(), r.problem()), (400, "invalid-request"), "{payload}: {r:?}");
            assert!(detail(&r).contains(lit) && detail(&r).contains("as a string"), "{payload}: {r:?}");
        }
        // A new key is not created either.
        let r = s.post_raw(ADMIN_KEY, OPS, &trigger("N-NEW", &format!("[{lit}]"))).await;
        assert_eq!(r.status, 400, "{lit}: {r:?}");
    }
    // The completion's `result` follows the same rule: refused, the lease still held.
    let token = granted.token();
    for lit in INEXACT {
        let body = format!(
            r#"{{"fencing_token":{token},"outcome":"succeeded","provider_ref":"p-1","result":{{"amount":{lit}}}}}"#
        );
        let r = s.post_raw(ADMIN_KEY, &format!("/v1/operations/{}/complete", enc("N-1")), &body).await;
        assert_eq!((r.status.as_u16(), r.problem()), (400, "invalid-request"), "{body}: {r:?}");
        assert!(detail(&r).contains(lit), "{body}: {r:?}");
    }
    // Nothing recorded changed.
    let after = s.record("N-1").await.body;
    assert_eq!(after, before);
    assert_eq!(event_kinds(&after), ["acquired"]);

    // -0 and every other spelling of zero are the same number as 0: one fingerprint (each
    // such trigger is recorded as an in-progress event, as every trigger is).
    for zero in ["-0", "0.0", "-0.0", "0e10", "-0.000E-5"] {
        let r = s.post_raw(ADMIN_KEY, OPS, &trigger("N-1", &format!(r#"{{"n":{zero}}}"#))).await;
        assert_eq!((r.status.as_u16(), r.problem()), (409, "operation-in-progress"), "{zero}: {r:?}");
    }
    // Literals that are exactly their double are accepted, each spelling of one number
    // alike: 1, 1.0, 1e0 and 10e-1 are one fingerprint.
    for (i, lit) in [
        "0.1",
        "1.0",
        "1e0",
        "5e-324",
        "2.2250738585072014e-308",
        "0.30000000000000004",
        "9007199254740992",
        "-9007199254740992",
        "123.456e-2",
    ]
    .into_iter()
    .enumerate()
    {
        let r = s.post_raw(ADMIN_KEY, OPS, &trigger(&format!("OK-{i}"), &format!(r#"{{"n":{lit}}}"#))).await;
        assert_eq!(r.status, 201, "{lit}: {r:?}");
    }
    assert_eq!(s.post_raw(ADMIN_KEY, OPS, &trigger("ONE", "1")).await.status, 201);
    for one in ["1.0", "1e0", "10e-1", "0.1e1"] {
        let r = s.post_raw(ADMIN_KEY, OPS, &trigger("ONE", one)).await;
        assert_eq!(r.status, 409, "{one}: {r:?}");
    }
    // Number-like text inside strings is text (also after an escaped quote).
    let r = s.post_raw(ADMIN_KEY, OPS, &trigger("STR-1", r#"{"n":"1e-400","m":"a\"1e-400\\"}"#)).await;
    assert_eq!(r.status, 201, "{r:?}");

    // A result that is exact is stored as sent.
    let body =
        format!(r#"{{"fencing_token":{token},"outcome":"succeeded","provider_ref":"p-1","result":{{"amount":0.1}}}}"#);
    let r = s.post_raw(ADMIN_KEY, &format!("/v1/operations/{}/complete", enc("N-1")), &body).await;
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(r.body["result"], json!({"amount": 0.1}));
}

/// The CLI parses a payload and a result with the server's rules (it refuses inexact numbers
/// and duplicate members before sending; the server refuses names equal after NFC): one
/// line, exit 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_refuses_what_the_server_would() {
    let db = Db::new(Backend::Sqlite).await;
    let s = Server::start(&db.url);
    let idem = |args: &[&str]| {
        std::process::Command::new(idem_bin())
            .args(args)
            .env("IDEM_URL", &s.base)
            .env("IDEM_API_KEY", ADMIN_KEY)
            .output()
            .unwrap()
    };
    let acquire = |payload: &'static str| vec!["acquire", "CLI-1", "--action", "a", "--payload", payload];
    let complete = |result: &'static str| {
        vec!["complete", "CLI-1", "--token", "1", "--outcome", "succeeded", "--provider-ref", "p", "--result", result]
    };
    for (args, shown) in [
        (acquire(r#"{"n":1e-400}"#), "1e-400"),
        (acquire("[4e-324]"), "4e-324"),
        (acquire("{\"Z\u{00FC}\":1,\"Zu\u{0308}\":2}"), "duplicate"),
        (complete(r#"{"n":1e400}"#), "1e400"),
        (complete(r#"{"a":1,"a":2}"#), "duplicate"),
    ] {
        let out = idem(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(err.starts_with("idem: ") && err.trim_end().lines().count() == 1, "{args:?}: {err}");
        assert!(err.contains(shown), "{args:?}: {err}");
    }
    assert_eq!(s.record("CLI-1").await.status, 404, "nothing recorded");
    // The same payload in NFC and in NFD is one operation from the CLI too (exit 12: in progress).
    let ok = idem(&["acquire", "CLI-2", "--action", "a", "--payload", "{\"city\":\"Z\u{00FC}rich\"}"]);
    assert_eq!(ok.status.code(), Some(0), "{}", String::from_utf8_lossy(&ok.stderr));
    let again = idem(&["acquire", "CLI-2", "--action", "a", "--payload", "{\"city\":\"Zu\u{0308}rich\"}"]);
    assert_eq!(again.status.code(), Some(12), "{}", String::from_utf8_lossy(&again.stderr));
}

/// `idem proxy` fingerprints JSON bodies by the same rules: an NFD retry of an NFC body is
/// replayed, and a body with an inexact number is refused before anything is forwarded
/// (else `{"amount":1e-400}` would be replayed the answer stored for `{"amount":0}`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxy_reads_bodies_by_the_same_rules() {
    let forwarded = Arc::new(AtomicU64::new(0));
    let counter = forwarded.clone();
    let app = axum::Router::new().fallback(move || {
        let n = counter.fetch_add(1, Ordering::SeqCst) + 1;
        async move { (axum::http::StatusCode::CREATED, format!("{{\"charge\":{n}}}")) }
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let upstream = format!("http://{}/", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    let db = Db::new(Backend::Sqlite).await;
    let p = Server::start_proxy(&db.url, &upstream, &[]);
    let send = |key: &'static str, body: &'static str| {
        p.http
            .post(p.url("/charges"))
            .header("idem-api-key", ADMIN_KEY)
            .header("idempotency-key", key)
            .header("content-type", "application/json")
            .body(body)
            .send()
    };

    let r = send("c-1", "{\"city\":\"Z\u{00FC}rich\",\"amount\":0}").await.unwrap();
    assert_eq!(r.status(), 201);
    let r = send("c-1", "{\"amount\":-0,\"city\":\"Zu\u{0308}rich\"}").await.unwrap();
    assert_eq!((r.status().as_u16(), r.headers().get("idempotent-replayed").is_some()), (201, true));
    assert_eq!(r.text().await.unwrap(), r#"{"charge":1}"#);
    for (key, body) in [("c-1", r#"{"city":"Zürich","amount":1e-400}"#), ("c-2", r#"{"amount":4e-324}"#)] {
        let r = send(key, body).await.unwrap();
        assert_eq!(r.status(), 400, "{body}");
        let text = r.text().await.unwrap();
        assert!(text.contains("as a string"), "{body}: {text}");
    }
    assert_eq!(forwarded.load(Ordering::SeqCst), 1, "nothing refused reached the upstream");
}
