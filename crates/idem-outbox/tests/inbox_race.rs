//! Inbox races against real PostgreSQL: the same message delivered 10 times at once to
//! each of two consumer processes is applied once; a consumer killed with kill -9 between
//! its claim (the inbox marker) and its business row, or between the row and its commit,
//! leaves neither — and the redelivery applies it once.
//!
//! The consumers are this test binary run again as child processes (the ignored test
//! `consumer`).

use idem_outbox::InboxDecision;
use idem_outbox::inbox::{claim_message, content_fingerprint, finish};
use serde_json::json;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

const MESSAGE: &str = "pay-7";

/// A consumer process: delivers `MESSAGE` to itself `DELIVERIES` times at once; each
/// delivery claims it, credits account 7 (a row in `credits`) and finishes, in one
/// transaction. Prints one `CHILD <decision>` line per delivery, or `CHILD at <point>` and
/// waits to be killed there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the child process of the inbox race tests"]
async fn consumer() {
    let url = std::env::var("APP_DB").expect("run by the inbox tests");
    let deliveries: usize = std::env::var("DELIVERIES").unwrap().parse().unwrap();
    let crash_at = std::env::var("CRASH_AT").unwrap_or_default();
    let pool = sqlx::postgres::PgPoolOptions::new().max_connections(deliveries as u32).connect(&url).await.unwrap();
    let body = json!({"account": 7, "amount": 10});
    let tasks: Vec<_> = (0..deliveries)
        .map(|_| {
            let (pool, body, crash_at) = (pool.clone(), body.clone(), crash_at.clone());
            tokio::spawn(async move {
                let stop = |point: &str| {
                    if crash_at == point {
                        println!("CHILD at {point}");
                        std::thread::sleep(std::time::Duration::from_secs(60));
                    }
                };
                let fp = content_fingerprint(&body).unwrap();
                let mut t = pool.begin().await.unwrap();
                let d = claim_message(&mut *t, "billing", MESSAGE, fp.as_str()).await.unwrap();
                if d == InboxDecision::Apply {
                    stop("after_claim");
                    sqlx::query("INSERT INTO credits (message_id, amount) VALUES ($1, 10)")
                        .bind(MESSAGE)
                        .execute(&mut *t)
                        .await
                        .unwrap();
                    stop("after_business_row");
                    finish(&mut *t, "billing", MESSAGE, &json!({"credited": 10})).await.unwrap();
                }
                t.commit().await.unwrap();
                println!("CHILD {}", d.as_str());
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
}

fn spawn_consumer(url: &str, deliveries: usize, crash_at: &str) -> std::process::Child {
    Command::new(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", "consumer", "--nocapture", "--test-threads", "1"])
        .env("APP_DB", url)
        .env("DELIVERIES", deliveries.to_string())
        .env("CRASH_AT", crash_at)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

/// What a child printed (`CHILD …` lines), until it exits or, with `until`, that line.
fn said(child: &mut std::process::Child, until: Option<&str>) -> Vec<String> {
    let mut out = Vec::new();
    for line in BufReader::new(child.stdout.take().unwrap()).lines().map_while(Result::ok) {
        if let Some((_, s)) = line.split_once("CHILD ") {
            out.push(s.to_owned());
            if Some(s) == until {
                break;
            }
        }
    }
    out
}

async fn db() -> (idem_store::testing::TestDatabase, sqlx::PgPool) {
    let url = idem_store::testing::fresh_pg_database("idem_inbox").await;
    idem_outbox::schema::install(&url).await.unwrap();
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    sqlx::query("CREATE TABLE credits (message_id text NOT NULL, amount integer NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    (url, pool)
}

async fn counts(pool: &sqlx::PgPool) -> (i64, i64) {
    let credits: i64 = sqlx::query_scalar("SELECT count(*) FROM credits").fetch_one(pool).await.unwrap();
    let claims: i64 = sqlx::query_scalar("SELECT count(*) FROM idem.inbox").fetch_one(pool).await.unwrap();
    (credits, claims)
}

#[tokio::test]
async fn ten_concurrent_redeliveries_to_two_consumer_processes_apply_once() {
    let (url, pool) = db().await;
    let mut a = spawn_consumer(&url, 10, "");
    let mut b = spawn_consumer(&url, 10, "");
    let (sa, sb) = (said(&mut a, None), said(&mut b, None));
    assert!(a.wait().unwrap().success() && b.wait().unwrap().success());
    let all: Vec<_> = sa.iter().chain(&sb).collect();
    assert_eq!(all.len(), 20);
    assert_eq!(all.iter().filter(|d| **d == "apply").count(), 1, "{all:?}");
    assert_eq!(all.iter().filter(|d| **d == "duplicate").count(), 19, "{all:?}");
    assert_eq!(counts(&pool).await, (1, 1), "one business row, one marker");
}

#[tokio::test]
async fn a_consumer_killed_between_marker_and_business_row_leaves_neither() {
    for point in ["after_claim", "after_business_row"] {
        let (url, pool) = db().await;
        let mut c = spawn_consumer(&url, 1, point);
        assert_eq!(
            said(&mut c, Some(&format!("at {point}"))).last().map(String::as_str),
            Some(&*format!("at {point}"))
        );
        c.kill().unwrap(); // SIGKILL inside the open transaction
        c.wait().unwrap();
        assert_eq!(counts(&pool).await, (0, 0), "killed {point}: the marker and the row commit together or not at all");
        // The redelivery (another process) applies it, once.
        let mut again = spawn_consumer(&url, 3, "");
        let s = said(&mut again, None);
        assert!(again.wait().unwrap().success());
        assert_eq!(s.iter().filter(|d| *d == "apply").count(), 1, "{s:?}");
        assert_eq!(counts(&pool).await, (1, 1));
    }
}
