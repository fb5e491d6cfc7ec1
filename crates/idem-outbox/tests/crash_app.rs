//! The crash window is closed: an application killed with kill -9 after its business
//! write, after its outbox append (both before the commit), and right after its commit.
//! The outbox holds the event exactly when the business row exists, and the application's
//! retry (same key) finishes the job once — on PostgreSQL and on SQLite.
//!
//! The application is this test binary run again as a child process (the ignored test
//! `application`), which prints `CHILD at <point>` and waits to be killed there.

mod common;

use common::AppDb;
use idem_core::outbox::NewEvent;
use idem_outbox::tx::{self, Claim};
use serde_json::json;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

const POINTS: [&str; 3] = ["after_business_write", "after_append", "after_commit"];

/// The application: export job `job-42` for batch B-7 under key `B-7:export:v1`, with an
/// `export.created` event, in one transaction. Run only as the child of the test below.
#[tokio::test]
#[ignore = "the child process of a_kill_9_at_any_point_leaves_the_event_exactly_when_the_row_exists"]
async fn application() {
    let url = std::env::var("APP_DB").expect("run by the crash test");
    let crash_at = std::env::var("CRASH_AT").unwrap_or_default();
    let stop = |point: &str| {
        if crash_at == point {
            println!("CHILD at {point}");
            std::thread::sleep(std::time::Duration::from_secs(60));
        }
    };
    let payload = json!({"source_batch": "B-7"});
    let event = NewEvent {
        id: "export:job-42:created".into(),
        aggregate_type: "export".into(),
        aggregate_id: "job-42".into(),
        topic: "export.created".into(),
        payload: json!({"job": "job-42"}),
        headers: Default::default(),
    };
    macro_rules! run {
        ($t:expr) => {{
            let mut t = $t;
            match tx::claim(&mut *t, "B-7:export:v1", "export", &payload).await.unwrap() {
                Claim::New => {
                    sqlx::query("INSERT INTO jobs VALUES ('job-42', 'B-7')").execute(&mut *t).await.unwrap();
                    stop("after_business_write");
                    idem_outbox::append(&mut *t, &event).await.unwrap();
                    tx::finish(&mut *t, "B-7:export:v1", &json!({"job": "job-42"})).await.unwrap();
                    stop("after_append");
                    t.commit().await.unwrap();
                    stop("after_commit");
                    println!("CHILD created job-42");
                }
                Claim::Replay(r) => println!("CHILD replayed {}", r.unwrap()),
                Claim::Conflict { .. } => panic!("conflict"),
            }
        }};
    }
    if url.starts_with("postgres") {
        let pool = sqlx::PgPool::connect(&url).await.unwrap();
        run!(pool.begin().await.unwrap());
    } else {
        let pool = sqlx::SqlitePool::connect(&url).await.unwrap();
        run!(pool.begin_with("BEGIN IMMEDIATE").await.unwrap());
    }
}

/// Runs the application; with `crash_at`, kills it (SIGKILL) once it reports that point.
/// Returns what it printed last.
fn run_application(url: &str, crash_at: Option<&str>) -> String {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", "application", "--nocapture", "--test-threads", "1"])
        .env("APP_DB", url)
        .env("CRASH_AT", crash_at.unwrap_or(""))
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut last = String::new();
    for line in BufReader::new(child.stdout.take().unwrap()).lines().map_while(Result::ok) {
        // libtest may print "test application ... " on the same line first.
        if let Some((_, said)) = line.split_once("CHILD ") {
            last = said.to_owned();
            if crash_at.is_some() {
                break;
            }
        }
    }
    if crash_at.is_some() {
        child.kill().unwrap(); // SIGKILL: no destructor, no rollback by the client
    }
    let status = child.wait().unwrap();
    assert!(crash_at.is_some() || status.success(), "the application failed: {last}");
    last
}

#[tokio::test]
async fn a_kill_9_at_any_point_leaves_the_event_exactly_when_the_row_exists() {
    for point in POINTS {
        for db in AppDb::both().await {
            let last = run_application(db.url(), Some(point));
            assert_eq!(last, format!("at {point}"), "{}: the child reached the point", db.name());
            // PostgreSQL rolls back a dead client's transaction once it sees the socket
            // close; reading committed data never waits for that.
            let jobs = db.count("SELECT count(*) FROM jobs").await;
            let events = db.count("SELECT count(*) FROM idem.outbox").await;
            let keys = db.count("SELECT count(*) FROM idem.inbox WHERE consumer = 'idem.keys'").await;
            let committed = i64::from(point == "after_commit");
            assert_eq!((jobs, events, keys), (committed, committed, committed), "{} killed {point}", db.name());
            // The application's retry: creates the job once, or replays it.
            let last = run_application(db.url(), None);
            let expected = if committed == 1 { "replayed {\"job\":\"job-42\"}" } else { "created job-42" };
            assert_eq!(last, expected, "{} after a kill {point}", db.name());
            assert_eq!(db.count("SELECT count(*) FROM jobs").await, 1);
            assert_eq!(db.count("SELECT count(*) FROM idem.outbox").await, 1);
        }
    }
}
