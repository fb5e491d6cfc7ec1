//! One clock for the whole ledger (issue 11 item 3; DESIGN.md §2 invariant 7): two
//! `idem serve` processes share one PostgreSQL database, and node B's wall clock runs
//! 20 s ahead (libfaketime, Debian package `faketime`, installed by scripts/test.sh).
//!
//! A 10 s lease granted by node A must be judged on the database's clock by node B too:
//! B answers 409 for it (not 202 UNKNOWN; with `redo_safe`, not a second 201 grant), B's
//! lease sweeper leaves it EXECUTING, and A's worker completes it. B's `/metrics` shows
//! the offset between the database's clock and its own (about -20 000 ms).

mod common;

use common::{ADMIN_KEY, Backend, Db, Server};
use reqwest::StatusCode;
use serde_json::json;
use std::path::PathBuf;
use std::time::Duration;

/// How far node B's wall clock runs ahead (s); more than the lease.
const SKEW_S: i64 = 20;
/// The leases node A grants (ms).
const LEASE_MS: i64 = 10_000;

/// libfaketime's preload library (the thread-safe build when there is one).
fn libfaketime() -> PathBuf {
    let mut found: Vec<PathBuf> = std::fs::read_dir("/usr/lib")
        .into_iter()
        .flatten()
        .flatten()
        .flat_map(|d| ["libfaketimeMT.so.1", "libfaketime.so.1"].map(|f| d.path().join("faketime").join(f)))
        .filter(|p| p.exists())
        .collect();
    found.sort_by_key(|p| !p.to_string_lossy().contains("MT"));
    found.into_iter().next().expect("libfaketime is missing: install Debian's faketime (scripts/test.sh does)")
}

/// A gauge's value in a Prometheus text exposition.
fn gauge(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|rest| rest.strip_prefix(' ')))
        .unwrap_or_else(|| panic!("{name} missing from /metrics:\n{text}"))
        .trim()
        .parse()
        .unwrap()
}

/// The `Date` header (RFC 9110 §6.6.1) a server sends: its wall clock, in epoch seconds.
async fn server_date(s: &Server) -> i64 {
    let r = s.http.get(s.url("/healthz")).send().await.unwrap();
    let date = r.headers().get("date").expect("a Date header").to_str().unwrap().to_owned();
    jiff::fmt::rfc2822::parse(&date).unwrap().timestamp().as_second()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_whose_clock_runs_ahead_judges_leases_on_the_database_clock() {
    let started = std::time::Instant::now();
    let lib = libfaketime();
    let db = Db::new(Backend::Postgres).await;
    let a = Server::start(&db.url);
    let skew = format!("+{SKEW_S}s");
    let b = Server::start_with_env(
        &db.url,
        &[],
        &[
            ("LD_PRELOAD", lib.to_str().unwrap()),
            ("FAKETIME", skew.as_str()),
            // Only the wall clock: timers and the anchor run on the real monotonic clock.
            ("FAKETIME_DONT_FAKE_MONOTONIC", "1"),
        ],
    );
    let ahead = server_date(&b).await - server_date(&a).await;
    assert!((SKEW_S - 2..=SKEW_S + 2).contains(&ahead), "node B's wall clock is not {SKEW_S} s ahead: {ahead} s");

    // Node A grants three 10 s leases: a plain one, a redo_safe one, and one nobody
    // triggers again (only B's sweeper looks at it).
    let body = |key: &str, redo_safe: bool| json!({"key": key, "action": "send_invoice", "payload": {"to": "c-1"}, "lease_ms": LEASE_MS, "redo_safe": redo_safe});
    let keys = [("SKEW-1:send", false), ("SKEW-2:send", true), ("SKEW-3:send", false)];
    let mut tokens = Vec::new();
    for (key, redo_safe) in keys {
        let r = a.post(ADMIN_KEY, "/v1/operations", &body(key, redo_safe)).await;
        assert_eq!(r.status, StatusCode::CREATED, "{key}: {:?}", r.body);
        tokens.push(r.token());
    }

    // Node B sees the leases as A does: held, not expired.
    for (key, redo_safe) in &keys[..2] {
        let r = b.post(ADMIN_KEY, "/v1/operations", &body(key, *redo_safe)).await;
        assert_eq!(r.status, StatusCode::CONFLICT, "node B, {key} (redo_safe {redo_safe}): {:?}", r.body);
        assert_eq!(r.problem(), "operation-in-progress");
        let wait = r.body["retry_after_ms"].as_i64().unwrap();
        assert!(0 < wait && wait <= LEASE_MS, "B computes the lease's rest on the database's clock: {wait} ms");
    }
    // B's lease sweeper runs every 50 ms: give it two seconds.
    tokio::time::sleep(Duration::from_secs(2)).await;
    for ((key, _), token) in keys.iter().zip(&tokens) {
        let rec = a.record(key).await.body;
        assert_eq!(rec["state"], "EXECUTING", "{key}: {rec}");
        assert_eq!((rec["attempt"].as_i64(), rec["fencing_token"].as_i64()), (Some(1), Some(*token)), "{key}");
    }

    // A's worker finishes all three.
    for ((key, _), token) in keys.iter().zip(&tokens) {
        let done = a
            .complete(
                key,
                json!({"fencing_token": token, "outcome": "succeeded", "provider_ref": format!("ref-{key}")}),
            )
            .await;
        assert_eq!((done.status.as_u16(), &done.body["state"]), (200, &json!("SUCCEEDED")), "{key}");
    }

    // Each node shows its offset to the database's clock; both are ready.
    let metrics = b.get("", "/metrics").await.body.as_str().unwrap().to_owned();
    let offset_b = gauge(&metrics, "idem_clock_offset_ms");
    assert!((offset_b + (SKEW_S * 1000) as f64).abs() < 1_500.0, "node B's offset: {offset_b}");
    assert!(gauge(&metrics, "idem_clock_uncertainty_ms") < 500.0);
    let offset_a = gauge(a.get("", "/metrics").await.body.as_str().unwrap(), "idem_clock_offset_ms");
    assert!(offset_a.abs() < 1_500.0, "node A's offset: {offset_a}");
    for s in [&a, &b] {
        assert_eq!(s.get("", "/readyz").await.status, 200);
    }
    assert!(started.elapsed() < Duration::from_secs(LEASE_MS as u64 / 1000), "the leases must outlive the test");
}

/// A TCP proxy to `upstream` that holds every chunk of the answers for `delay`: a
/// database far away.
async fn slow_proxy(upstream: std::net::SocketAddr, delay: Duration) -> std::net::SocketAddr {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            tokio::spawn(async move {
                let Ok(up) = tokio::net::TcpStream::connect(upstream).await else { return };
                let ((mut cr, mut cw), (mut ur, mut uw)) = (client.into_split(), up.into_split());
                let to_upstream = tokio::io::copy(&mut cr, &mut uw);
                let to_client = async {
                    let mut buf = vec![0u8; 16 * 1024];
                    while let Ok(n @ 1..) = ur.read(&mut buf).await {
                        tokio::time::sleep(delay).await;
                        if cw.write_all(&buf[..n]).await.is_err() {
                            return;
                        }
                    }
                };
                tokio::select! {
                    _ = to_upstream => {},
                    () = to_client => {},
                }
            });
        }
    });
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_cannot_read_the_database_clock_closely_enough_is_not_ready() {
    let db = Db::new(Backend::Postgres).await;
    let mut url = reqwest::Url::parse(&db.url).unwrap();
    let pg = std::net::SocketAddr::new(url.host_str().unwrap().parse().unwrap(), url.port().unwrap_or(5432));
    let proxy = slow_proxy(pg, Duration::from_millis(20)).await;
    url.set_port(Some(proxy.port())).unwrap();
    // Every reading of the database's clock takes at least 20 ms: known within 10 ms at best.
    let s = Server::start_with_args(url.as_str(), &["--max-clock-uncertainty-ms", "5"]);
    let r = s.get("", "/readyz").await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "{:?}", r.body);
    assert_eq!(r.problem(), "clock-uncertain");
    let metrics = s.get("", "/metrics").await.body.as_str().unwrap().to_owned();
    assert!(gauge(&metrics, "idem_clock_uncertainty_ms") >= 10.0, "{metrics}");
    // Not ready, but still serving (a load balancer decides): the clock is only less certain.
    assert_eq!(s.acquire("k", json!({})).await.status, StatusCode::CREATED);
    // The same database, near: ready.
    let near = Server::start_with_args(&db.url, &["--max-clock-uncertainty-ms", "5"]);
    assert_eq!(near.get("", "/readyz").await.status, StatusCode::OK);
}
