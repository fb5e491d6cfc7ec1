//! Wide payloads (issue 15 §1): one ~1 MB payload of 60 000 members took a node from 15 to
//! 68 MB; 32 at once took 576 MB, and 553 MB stayed after they finished. The in-flight
//! body budget (`--max-inflight-body-bytes`) bounds the peak by configuration, and the
//! memory comes back after the burst. Bounded in time: at most 8 requests at once. More
//! would wait longer than a kernel keeps a stalled sender's connection: a body the server
//! does not read yet leaves its sender probing a zero window, and Linux 6.18 aborted such
//! connections after ~30 s (ETIMEDOUT) while a debug build worked through 32 of them two at a
//! time. The production default waits 5 s (`--inflight-wait-ms`), then answers 503.

mod common;

use common::{ADMIN_KEY, Backend, Db, Server};
use serde_json::{Value, json};
use std::time::{Duration, Instant};

/// (VmRSS, VmHWM) of a process, in bytes.
fn memory(pid: u32) -> (u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kb = |name: &str| -> u64 {
        let line = status.lines().find(|l| l.starts_with(name)).unwrap();
        line.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() * 1024
    };
    (kb("VmRSS:"), kb("VmHWM:"))
}

/// The issue's payload: 60 000 members, about 1 MB of JSON.
fn wide_payload() -> Value {
    Value::Object((0..60_000).map(|i| (format!("k{i:07}"), json!(i))).collect())
}

async fn burst(s: &Server, n: usize, tag: &str, payload: &Value) -> Vec<common::Resp> {
    let http = reqwest::Client::builder().timeout(Duration::from_secs(120)).build().unwrap();
    let body = |i: usize| {
        serde_json::to_vec(&json!({"key": format!("{tag}-{i}"), "action": "import", "payload": payload})).unwrap()
    };
    let reqs = (0..n).map(|i| {
        let req = http
            .post(s.url("/v1/operations"))
            .bearer_auth(ADMIN_KEY)
            .header("content-type", "application/json")
            .body(body(i));
        async move { common::Resp::read(req.send().await.unwrap()).await }
    });
    futures_util::future::join_all(reqs).await
}

const MB: u64 = 1024 * 1024;

/// Wide requests sent at once against a budget of two: enough that an unbounded node
/// (about `BURST` × one request) fails the 4× bound by a wide margin.
const BURST: usize = 8;

/// One test, its two parts one after the other: each measures a server while it works
/// alone on this machine's two cores.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn wide_payloads_are_bounded_by_the_in_flight_budget() {
    wide_payloads_take_memory_within_the_configured_budget_and_give_it_back().await;
    beyond_the_budget_a_request_gets_503_overloaded_with_retry_after().await;
}

async fn wide_payloads_take_memory_within_the_configured_budget_and_give_it_back() {
    let payload = wide_payload();
    assert!(serde_json::to_vec(&payload).unwrap().len() > 1_000_000);
    let db = Db::new(Backend::Sqlite).await;
    // Room for two such bodies at once; the others wait (up to 60 s) instead of failing.
    let s = Server::start_with_args(&db.url, &["--max-inflight-body-bytes", "2200000", "--inflight-wait-ms", "60000"]);
    assert_eq!(s.acquire("warm-up", json!({"to": "c-1"})).await.status, 201);
    let (baseline, _) = memory(s.pid());

    let one = burst(&s, 1, "alone", &payload).await;
    assert_eq!(one[0].status, 201, "{:?}", one[0]);
    let (_, peak_one) = memory(s.pid());
    let per_request = peak_one.saturating_sub(baseline).max(MB);

    let started = Instant::now();
    let answers = burst(&s, BURST, "burst", &payload).await;
    let took = started.elapsed();
    for r in &answers {
        assert_eq!(r.status, 201, "{r:?}");
    }
    let (_, peak) = memory(s.pid());
    let grew = peak.saturating_sub(baseline);
    eprintln!(
        "baseline {} MiB; one wide payload +{} MiB; {BURST} at once (budget: 2 bodies) peak +{} MiB in {took:?}",
        baseline / MB,
        per_request / MB,
        grew / MB
    );
    // Two in flight by configuration: about twice one request's peak (without the budget
    // it grows with the burst: the old node took about 32 times for 32).
    assert!(grew <= 4 * per_request, "peak +{} MiB > 4 × {} MiB", grew / MB, per_request / MB);

    // Returned after the burst (what stays is SQLite's page caches and the like: well
    // under two requests' worth; the old node kept about 30 of 32).
    let returned = Instant::now();
    loop {
        let (rss, _) = memory(s.pid());
        if rss.saturating_sub(baseline) <= 2 * per_request {
            eprintln!("resident +{} MiB {:?} after the burst", rss.saturating_sub(baseline) / MB, returned.elapsed());
            break;
        }
        assert!(
            returned.elapsed() < Duration::from_secs(5),
            "still +{} MiB 5 s after the burst",
            rss.saturating_sub(baseline) / MB
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Beyond the budget, a request that cannot wait gets 503 overloaded + Retry-After, never
/// another 5xx, and nothing of it is recorded.
async fn beyond_the_budget_a_request_gets_503_overloaded_with_retry_after() {
    let payload = wide_payload();
    let db = Db::new(Backend::Sqlite).await;
    let s = Server::start_with_args(&db.url, &["--max-inflight-body-bytes", "1100000", "--inflight-wait-ms", "0"]);
    let answers = burst(&s, 8, "w", &payload).await;
    let (ok, refused): (Vec<_>, Vec<_>) = answers.iter().partition(|r| r.status == 201);
    assert!(!ok.is_empty() && !refused.is_empty(), "{answers:?}");
    for r in &refused {
        assert_eq!((r.status.as_u16(), r.problem()), (503, "overloaded"), "{r:?}");
        assert_eq!(r.header("retry-after"), Some("1"));
    }
    let listed = s.get(ADMIN_KEY, "/v1/operations?limit=50").await.body;
    assert_eq!(listed["items"].as_array().unwrap().len(), ok.len(), "only the accepted ones are recorded");
    // Each 503 is counted under its route, not as "unmatched".
    let metrics = s.http.get(s.url("/metrics")).send().await.unwrap().text().await.unwrap();
    let counted =
        format!(r#"idem_http_requests_total{{method="POST",route="/v1/operations",status="503"}} {}"#, refused.len());
    assert!(metrics.contains(&counted), "{counted} in {metrics}");
    // Small requests still go through afterwards.
    assert_eq!(s.acquire("small", json!({"to": "c-1"})).await.status, 201);
}
