//! The database's clock as a node's clock (`postgres::DatabaseClock`): it tells the
//! database's time (not the node's), never goes backwards, and reports its uncertainty
//! against its bound.

use idem_core::Clock;
use idem_store::postgres::DatabaseClock;
use sqlx::Connection;

/// The database's own clock, read directly (epoch ms), with the read's round trip (ms).
async fn database_now(url: &str) -> (i64, i64) {
    let mut conn = sqlx::PgConnection::connect(url).await.unwrap();
    let start = std::time::Instant::now();
    let (ms,): (i64,) = sqlx::query_as("SELECT CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000 AS BIGINT)")
        .fetch_one(&mut conn)
        .await
        .unwrap();
    (ms, start.elapsed().as_millis() as i64 + 1)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_database_clock_tells_the_database_time_and_never_goes_back() {
    let url = idem_store::testing::fresh_pg_database("idem_clock").await;
    let clock = DatabaseClock::connect(&url, 500).await.unwrap();
    for _ in 0..3 {
        let before = clock.now_ms();
        let (db, rtt) = database_now(&url).await;
        let after = clock.now_ms();
        let s = clock.status();
        // The database's reading falls between the clock's before and after, give or take
        // the clock's uncertainty.
        assert!(before - s.uncertainty_ms <= db && db <= after + s.uncertainty_ms + rtt, "{before} {db} {after} {s:?}");
        assert!(s.within_bound(), "{s:?}");
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let mut last = clock.now_ms();
    for _ in 0..20 {
        clock.resync().await;
        let now = clock.now_ms();
        assert!(now >= last, "went back from {last} to {now}");
        last = now;
    }
    // The same machine: the database's clock and the wall clock agree closely.
    assert!(clock.status().offset_ms.abs() < 1_000, "{:?}", clock.status());
    // A bound of 0 ms is never met (a reading takes time): the node would not be ready.
    let strict = DatabaseClock::connect(&url, 0).await.unwrap();
    assert!(!strict.status().within_bound(), "{:?}", strict.status());
}
