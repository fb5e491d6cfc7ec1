//! PostgreSQL stopped and started under a running node (issue 15 §1): requests and
//! `/readyz` fail fast with 503 + Retry-After while it is down, and the node recovers on
//! its own when it is back, with nothing recorded lost.
//!
//! Its own test binary and its own PostgreSQL cluster ([`common::pg_cluster`]): stopping
//! the shared server would break the tests that run beside it.

mod common;

use common::pg_cluster::PgCluster;
use common::{ADMIN_KEY, Resp, Server};
use serde_json::json;
use std::time::{Duration, Instant};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_down_fails_fast_with_503_and_recovers_on_its_own() {
    let pg = PgCluster::start();
    let s = Server::start(&pg.url());
    let http = reqwest::Client::builder().timeout(Duration::from_secs(30)).build().unwrap();
    let acquire = |key: String| {
        let req = http
            .post(s.url("/v1/operations"))
            .bearer_auth(ADMIN_KEY)
            .json(&json!({"key": key, "action": "send_confirmation", "payload": {"to": "c-1"}}));
        async move {
            let started = Instant::now();
            (Resp::read(req.send().await.unwrap()).await, started.elapsed())
        }
    };
    let (r, _) = acquire("before-outage".into()).await;
    assert_eq!(r.status, 201, "{r:?}");
    let done = s
        .complete("before-outage", json!({"fencing_token": r.token(), "outcome": "succeeded", "provider_ref": "m-1"}))
        .await;
    assert_eq!(done.status, 200);
    assert_eq!(http.get(s.url("/readyz")).send().await.unwrap().status(), 200);

    pg.stop();
    let stopped = Instant::now();

    // /readyz answers at once, every time (a health checker with a 1 s time-out gets its
    // 503, not a time-out), and says 503 within a probe or two.
    let checker = reqwest::Client::builder().timeout(Duration::from_secs(1)).build().unwrap();
    let mut not_ready = None;
    while stopped.elapsed() < Duration::from_secs(5) {
        let r = Resp::read(checker.get(s.url("/readyz")).send().await.expect("/readyz answered within 1 s")).await;
        if r.status == 503 {
            not_ready = Some(r);
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let r = not_ready.expect("/readyz said 503 within 5 s of the stop");
    assert_eq!(r.problem(), "unavailable", "{r:?}");
    assert_eq!(r.header("retry-after"), Some("1"));

    // Under load every request fails fast: rounds of 16 concurrent acquires, each answered
    // 503 + Retry-After well within a health checker's patience (the pool used to hold
    // each for its 10 s acquire timeout). /readyz stays instant meanwhile.
    for round in 0..3 {
        let answers =
            futures_util::future::join_all((0..16).map(|i| acquire(format!("during-outage-{round}-{i}")))).await;
        for (r, took) in &answers {
            assert_eq!(r.status, 503, "round {round}: {r:?}");
            assert_eq!(r.problem(), "unavailable");
            assert_eq!(r.header("retry-after"), Some("1"), "{r:?}");
            assert!(*took < Duration::from_millis(2500), "round {round}: a 503 took {took:?}");
        }
        let t = Instant::now();
        assert_eq!(checker.get(s.url("/readyz")).send().await.unwrap().status(), 503);
        assert!(t.elapsed() < Duration::from_millis(200), "/readyz took {:?}", t.elapsed());
    }

    // Back: the node recovers by itself (no restart of idem), quickly.
    pg.pg_ctl_start();
    let restarted = Instant::now();
    let mut n = 0;
    loop {
        n += 1;
        let (r, _) = acquire(format!("after-outage-{n}")).await;
        if r.status == 201 {
            break;
        }
        assert_eq!(r.status, 503, "{r:?}");
        assert!(restarted.elapsed() < Duration::from_secs(5), "not recovered 5 s after the restart");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let recovered = restarted.elapsed();
    loop {
        if checker.get(s.url("/readyz")).send().await.unwrap().status() == 200 {
            break;
        }
        assert!(restarted.elapsed() < Duration::from_secs(5), "/readyz not ready 5 s after the restart");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!("recovered {recovered:?} after the restart; /readyz ready after {:?}", restarted.elapsed());

    // Nothing recorded before the outage was lost; nothing was recorded during it.
    let (r, _) = acquire("before-outage".into()).await;
    assert_eq!((r.status.as_u16(), r.body["state"].as_str()), (200, Some("SUCCEEDED")), "{r:?}");
    assert_eq!(s.record("during-outage-0-0").await.status, 404);
}
