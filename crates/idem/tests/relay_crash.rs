//! Two `idem relay` processes deliver 10 000 events over 100 aggregates to a webhook
//! receiver whose consumer applies them through the inbox; one relay is killed with
//! kill -9 while it holds claimed events (mid-batch). Every event is delivered at least
//! once, no aggregate's order is ever violated at the receiver, and the consumer applies
//! each event exactly once (business rows counted). Also: bad relay configurations fail
//! at start with one line naming the field, and nothing is delivered.

mod common;

use idem::acceptance::receiver::Receiver;
use std::collections::{HashMap, HashSet};
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const SECRET: &str = "whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD";
const AGGREGATES: i64 = 100;
const PER_AGGREGATE: i64 = 100;

fn config(dir: &tempfile::TempDir, app_url: &str, receiver: &str, extra_sink: &str) -> std::path::PathBuf {
    let secret = dir.path().join("secret");
    std::fs::write(&secret, SECRET).unwrap();
    let path = dir.path().join("relay.toml");
    std::fs::write(
        &path,
        format!(
            "[outbox]\ndatabase_url = \"{app_url}\"\npoll_interval_ms = 100\nlease_ms = 2000\nbatch = 100\n\
             [outbox.sinks.hooks]\nkind = \"webhook\"\nurl = \"{receiver}\"\ntopics = [\"orders.>\"]\n\
             secrets = [{{ file = \"{}\" }}]\ntimeout_ms = 1500\n\
             retry = {{ base_ms = 50, cap_ms = 500, max_attempts = 20, budget_per_s = 1000, budget_burst = 1000 }}\n{extra_sink}",
            secret.display()
        ),
    )
    .unwrap();
    path
}

/// A relay process, killed (SIGKILL) when dropped, so a failing test leaves none behind.
struct RelayProcess(Child);

impl Drop for RelayProcess {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `idem relay`; returns the process and its relay id (the lease owner).
fn start_relay(config: &std::path::Path) -> (RelayProcess, String) {
    let mut child = Command::new(common::idem_bin())
        .args(["relay", "--config"])
        .arg(config)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Some(rest) = line.strip_prefix("idem: relay ") {
                let _ = tx.send(rest.split_whitespace().next().unwrap_or_default().to_owned());
            }
        }
    });
    let id = rx.recv_timeout(Duration::from_secs(30)).expect("idem relay started");
    (RelayProcess(child), id)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_relays_one_killed_mid_batch_deliver_everything_in_order_and_the_inbox_applies_once() {
    let app_url = idem_store::testing::fresh_pg_database("idem_app").await;
    idem_outbox::schema::install(&app_url).await.unwrap();
    let app = sqlx::PgPool::connect(&app_url).await.unwrap();
    // The consumer's own database, with its inbox and its business table.
    let consumer_url = idem_store::testing::fresh_pg_database("idem_consumer").await;
    idem_outbox::schema::install(&consumer_url).await.unwrap();
    let consumer = sqlx::postgres::PgPoolOptions::new().max_connections(16).connect(&consumer_url).await.unwrap();
    sqlx::query("CREATE TABLE applied (event_id text NOT NULL, body text NOT NULL)").execute(&consumer).await.unwrap();
    let receiver = Receiver::start(&[SECRET], Some((consumer.clone(), "orders-consumer".into()))).await;

    let dir = tempfile::tempdir().unwrap();
    let cfg = config(&dir, &app_url, &receiver.url(), "");
    // Two relays; whichever holds claims when it is time is killed.
    let mut relays: HashMap<String, RelayProcess> =
        [start_relay(&cfg), start_relay(&cfg)].into_iter().map(|(p, id)| (id, p)).collect();
    let mut orphaned: i64 = 0;

    // The application appends while the relays run: 10 transactions of 1 000 events, each
    // event n of aggregate a in order.
    for round in 0..10 {
        let mut t = app.begin().await.unwrap();
        for n in round * 10 + 1..=round * 10 + 10 {
            sqlx::query(
                "SELECT count(idem.outbox_append('e-' || a || '-' || $1, 'order', a::text, 'orders.changed', \
                 json_build_object('agg', a, 'n', $1::bigint))) FROM generate_series(0, $2) a",
            )
            .bind(n)
            .bind(AGGREGATES - 1)
            .execute(&mut *t)
            .await
            .unwrap();
        }
        t.commit().await.unwrap();
        if round == 2 {
            // Kill a relay while it holds claimed, unrecorded events.
            let start = Instant::now();
            loop {
                let holder: Option<String> = sqlx::query_scalar(
                    "SELECT lease_owner FROM idem.outbox WHERE state = 'PENDING' AND lease_owner IS NOT NULL LIMIT 1",
                )
                .fetch_optional(&app)
                .await
                .unwrap();
                if let Some(id) = holder {
                    // Frozen first (SIGSTOP), so that what it holds cannot change between
                    // the count and the kill: a relay that recorded its batch in between
                    // held nothing when killed (one run in three before).
                    let pid = relays[&id].0.id().to_string();
                    let signal = |sig: &str| {
                        assert!(std::process::Command::new("kill").args([sig, &pid]).status().unwrap().success());
                    };
                    signal("-STOP");
                    let held: i64 = sqlx::query_scalar(
                        "SELECT count(*) FROM idem.outbox WHERE state = 'PENDING' AND lease_owner = $1",
                    )
                    .bind(&id)
                    .fetch_one(&app)
                    .await
                    .unwrap();
                    if held > 0 {
                        let mut victim = relays.remove(&id).expect("one of ours");
                        victim.0.kill().unwrap();
                        victim.0.wait().unwrap();
                        orphaned = held;
                        break;
                    }
                    signal("-CONT");
                }
                assert!(start.elapsed() < Duration::from_secs(20), "the victim never held a claim");
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        }
    }

    let total = AGGREGATES * PER_AGGREGATE;
    let start = Instant::now();
    loop {
        let delivered: i64 = sqlx::query_scalar("SELECT count(*) FROM idem.outbox WHERE state = 'DELIVERED'")
            .fetch_one(&app)
            .await
            .unwrap();
        if delivered == total {
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(120), "{delivered} of {total} delivered after 2 minutes");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    drop(relays);

    let arrivals = receiver.arrivals();
    assert!(arrivals.iter().all(|a| a.verified));
    // At least once: every event arrived and was answered 2xx at least once.
    let ok: HashSet<&str> = arrivals.iter().filter(|a| a.status == 204).map(|a| a.id.as_str()).collect();
    assert_eq!(ok.len() as i64, total);
    // Order per aggregate: the first arrival of each event comes after the first arrival of
    // every earlier event of its aggregate (redeliveries of earlier events may follow).
    let mut next: HashMap<i64, i64> = HashMap::new();
    let mut seen = HashSet::new();
    for a in &arrivals {
        if !seen.insert(a.id.clone()) {
            continue;
        }
        let v: serde_json::Value = serde_json::from_slice(&a.body).unwrap();
        let (agg, n) = (v["agg"].as_i64().unwrap(), v["n"].as_i64().unwrap());
        let expected = next.entry(agg).or_insert(1);
        assert_eq!(n, *expected, "aggregate {agg}: event {n} arrived first before event {expected}");
        *expected += 1;
    }
    // Exactly once behind the inbox.
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM applied").fetch_one(&consumer).await.unwrap();
    let distinct: i64 =
        sqlx::query_scalar("SELECT count(DISTINCT event_id) FROM applied").fetch_one(&consumer).await.unwrap();
    assert_eq!((rows, distinct), (total, total), "one business row per event");
    let duplicates = arrivals.len() as i64 - total;
    eprintln!(
        "relay_crash: {total} events, {} arrivals ({duplicates} redeliveries), {orphaned} claims orphaned by the kill",
        arrivals.len()
    );
    assert!(orphaned > 0, "the kill happened mid-batch");
}

#[tokio::test]
async fn bad_relay_configurations_fail_at_start_naming_the_field() {
    let app_url = idem_store::testing::fresh_pg_database("idem_app").await;
    idem_outbox::schema::install(&app_url).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let bad_secret = dir.path().join("bad");
    std::fs::write(&bad_secret, "whsec_c2hvcnQ=").unwrap();
    let cases = [
        ("[outbox.sinks.kafka]\nkind = \"kafka\"\ntopics = [\">\"]\n", "outbox.sinks.kafka: unknown variant `kafka`"),
        (
            &format!(
                "[outbox.sinks.old]\nkind = \"webhook\"\nurl = \"http://127.0.0.1:9/\"\ntopics = [\"x\"]\nsecrets = [{{ file = \"{}\" }}]\ntimeout_ms = 1000\n",
                bad_secret.display()
            ),
            "outbox.sinks.old.secrets[0]: the secret decodes to 5 bytes",
        ),
        (
            "[outbox.sinks.unset]\nkind = \"webhook\"\nurl = \"http://127.0.0.1:9/\"\ntopics = [\"x\"]\nsecrets = [{ env = \"IDEM_TEST_SURELY_UNSET\" }]\ntimeout_ms = 1000\n",
            "outbox.sinks.unset.secrets[0]: the environment variable IDEM_TEST_SURELY_UNSET is not set",
        ),
    ];
    for (extra, expected) in cases {
        let cfg = config(&dir, &app_url, "http://127.0.0.1:9/hook", extra);
        let out = Command::new(common::idem_bin()).args(["relay", "--config"]).arg(&cfg).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{err}");
        assert!(err.contains(expected) && err.lines().count() == 1, "{expected}: {err}");
    }
    let out = Command::new(common::idem_bin())
        .args(["relay", "--config"])
        .arg(config(&dir, "postgres://postgres@127.0.0.1:5432/idem_no_such_db", "http://127.0.0.1:9/hook", ""))
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("outbox.database_url"), "{out:?}");
}

/// A webhook receiver that takes `delay` to answer 204, counting the requests it got.
async fn slow_receiver(delay: Duration) -> (String, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/hooks", listener.local_addr().unwrap());
    let got = std::sync::Arc::new(AtomicUsize::new(0));
    let count = got.clone();
    tokio::spawn(async move {
        while let Ok((mut sock, _)) = listener.accept().await {
            let count = count.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                // The head, then as many body bytes as it announces.
                loop {
                    let Ok(n) = sock.read(&mut chunk).await else { return };
                    if n == 0 {
                        return;
                    }
                    buf.extend_from_slice(&chunk[..n]);
                    let text = String::from_utf8_lossy(&buf).to_ascii_lowercase();
                    if let Some(end) = text.find("\r\n\r\n") {
                        let length = text
                            .lines()
                            .find_map(|l| l.strip_prefix("content-length:"))
                            .and_then(|v| v.trim().parse::<usize>().ok())
                            .unwrap_or(0);
                        if buf.len() >= end + 4 + length {
                            break;
                        }
                    }
                }
                count.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(delay).await;
                let _ = sock.write_all(b"HTTP/1.1 204 No Content\r\ncontent-length: 0\r\n\r\n").await;
            });
        }
    });
    (url, got)
}

/// Break-it finding: a relay stopped with SIGTERM exited at once, mid-delivery, and the
/// event was delivered a second time after its lease ran out. A stopping relay claims
/// nothing more, finishes and records the delivery in flight, then exits 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_finishes_and_records_the_delivery_in_flight() {
    use std::sync::atomic::Ordering;
    let app_url = idem_store::testing::fresh_pg_database("idem_app").await;
    idem_outbox::schema::install(&app_url).await.unwrap();
    let app = sqlx::PgPool::connect(&app_url).await.unwrap();
    let (url, got) = slow_receiver(Duration::from_millis(1_000)).await;
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(&dir, &app_url, &url, "");
    let (mut relay, _) = start_relay(&cfg);
    sqlx::query("SELECT idem.outbox_append('term-1', 'order', '1', 'orders.changed', '{\"n\": 1}')")
        .execute(&app)
        .await
        .unwrap();
    let start = Instant::now();
    while got.load(Ordering::SeqCst) == 0 {
        assert!(start.elapsed() < Duration::from_secs(20), "the relay never delivered");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The receiver holds the answer for a second: stop the relay now.
    let pid = relay.0.id().to_string();
    assert!(Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
    let start = Instant::now();
    let status = loop {
        if let Some(s) = relay.0.try_wait().unwrap() {
            break s;
        }
        assert!(start.elapsed() < Duration::from_secs(15), "the relay did not exit after SIGTERM");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(status.success(), "{status:?}");
    let state: String =
        sqlx::query_scalar("SELECT state FROM idem.outbox WHERE id = 'term-1'").fetch_one(&app).await.unwrap();
    assert_eq!(state, "DELIVERED", "recorded before the relay exited");
    // Another relay finds nothing to deliver again.
    let (_again, _) = start_relay(&cfg);
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    assert_eq!(got.load(Ordering::SeqCst), 1, "delivered once");
}
