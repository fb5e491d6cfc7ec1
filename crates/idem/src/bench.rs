//! `idem bench`: prints, in one run on this machine, idem's throughput and latency next to
//! baselines that do the same work naively, so the ratios say what idem costs or saves.
//!
//! - embedded: acquire+complete pairs/s through the SQLite store (every answer after the
//!   WAL's fsync; pipelined group commit) at several concurrencies, against a naive baseline: the same two
//!   statements (insert the operation, mark it done), each committed on its own;
//! - http: pairs/s and p50/p99/max latency of a pair over loopback against `idem serve`
//!   (SQLite, and PostgreSQL when `--postgres-url` is given), against the raw baseline of
//!   the same two statements issued to the same kind of database by as many clients;
//! - replays/s of a SUCCEEDED key over HTTP;
//! - peak RSS (VmHWM) of the server process under that load;
//! - MCP tool calls through `idem mcp` against calling the server directly: added latency
//!   p50/p99 and the guard's peak RSS with 100 calls in flight (`bench_mcp`);
//! - three-step workflows per second (`bench_workflows`), SQLite and PostgreSQL;
//! - the outbox relay's events/s to a webhook receiver and to NATS JetStream, and its
//!   commit-to-delivery p50/p99 at 1 000 events/s, against publishing right after the
//!   commit (`bench_relay`; PostgreSQL, NATS with `--nats-url`).
//!
//! The ceiling of group commit is about C / (2·F) pairs/s for concurrency C and fsync
//! latency F (two commits per pair); the run measures F and prints that ceiling too.

use anyhow::Context;
use idem_core::{AcquireInput, Actor, Clock, Outcome, SystemClock};
use idem_store::{CompleteRequest, Store};
use serde_json::json;
use sqlx::{ConnectOptions, Connection};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// What to run.
#[derive(Debug, Clone)]
pub struct BenchArgs {
    /// Seconds per measurement.
    pub seconds: f64,
    /// Concurrencies of the embedded runs.
    pub concurrency: Vec<usize>,
    /// Concurrency of the HTTP runs.
    pub http_concurrency: usize,
    /// PostgreSQL admin URL for the PostgreSQL runs (a database is created for them).
    pub postgres_url: Option<String>,
    /// NATS server for the relay's JetStream rows (a stream is created and deleted).
    pub nats_url: Option<String>,
}

struct Row {
    what: String,
    idem: f64,
    baseline: Option<f64>,
    extra: String,
}

fn print_rows(rows: &[Row]) {
    println!("{:<44} {:>12} {:>12} {:>8}  notes", "measurement", "idem", "baseline", "ratio");
    for r in rows {
        let (b, ratio) = match r.baseline {
            Some(b) if b > 0.0 => (format!("{b:.0}"), format!("{:.1}×", r.idem / b)),
            _ => ("-".into(), "-".into()),
        };
        println!("{:<44} {:>12.0} {:>12} {:>8}  {}", r.what, r.idem, b, ratio, r.extra);
    }
}

fn input(key: String) -> AcquireInput {
    AcquireInput {
        tenant: "bench".into(),
        key,
        action: "bench".into(),
        payload: json!({"n": 1}),
        fingerprint: "f".into(),
        lease_ms: 30_000,
        redo_safe: false,
        connector: None,
        holder: None,
        actor: Actor { principal: "bench".into(), request_id: None },
    }
}

/// Runs `pair(key)` back to back on `c` workers for `secs` with fresh keys; pairs/s.
async fn drive<F, Fut>(c: usize, secs: f64, pair: F) -> anyhow::Result<f64>
where
    F: Fn(String) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = anyhow::Result<()>> + Send,
{
    Ok(drive_timed(c, secs, pair).await?.rate)
}

/// Throughput and latency of one measurement.
struct Timed {
    /// Pairs per second.
    rate: f64,
    /// Median, 99th percentile and longest pair (ms).
    p50: f64,
    p99: f64,
    max: f64,
}

/// [`drive`], also timing each pair.
async fn drive_timed<F, Fut>(c: usize, secs: f64, pair: F) -> anyhow::Result<Timed>
where
    F: Fn(String) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = anyhow::Result<()>> + Send,
{
    let deadline = Instant::now() + Duration::from_secs_f64(secs);
    let run = uuid_like();
    let mut tasks = Vec::new();
    for w in 0..c {
        let (pair, run) = (pair.clone(), run.clone());
        tasks.push(tokio::spawn(async move {
            let mut lat = Vec::new();
            let mut i = 0u64;
            while Instant::now() < deadline {
                let t0 = Instant::now();
                pair(format!("{run}-{w}-{i}")).await?;
                lat.push(t0.elapsed().as_micros() as u64);
                i += 1;
            }
            anyhow::Ok(lat)
        }));
    }
    let start = Instant::now();
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await??);
    }
    all.sort_unstable();
    Ok(Timed {
        rate: all.len() as f64 / start.elapsed().as_secs_f64().max(secs),
        p50: percentile(&all, 0.5),
        p99: percentile(&all, 0.99),
        max: all.last().copied().unwrap_or(0) as f64 / 1000.0,
    })
}

/// Pairs per second through `store` with `c` concurrent workers for `secs`.
async fn store_pairs(store: Arc<dyn Store>, c: usize, secs: f64) -> anyhow::Result<f64> {
    drive(c, secs, move |key: String| {
        let store = store.clone();
        async move {
            let granted = store.acquire(input(key.clone())).await?;
            store
                .complete(CompleteRequest {
                    tenant: "bench".into(),
                    key,
                    fencing_token: granted.record.fencing_token,
                    outcome: Outcome::Succeeded { provider_ref: "r".into(), result: None },
                    actor: Actor::default(),
                    policy: None,
                })
                .await?;
            Ok(())
        }
    })
    .await
}

fn uuid_like() -> String {
    format!("{:x}", std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos())
}

/// The naive baseline on SQLite: one connection, each statement its own durable commit.
async fn naive_sqlite_pairs(path: &std::path::Path, c: usize, secs: f64) -> anyhow::Result<f64> {
    let opts = sqlx::sqlite::SqliteConnectOptions::new()
        .filename(path)
        .create_if_missing(true)
        .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal)
        .synchronous(sqlx::sqlite::SqliteSynchronous::Full)
        .busy_timeout(Duration::from_secs(30));
    let pool = sqlx::sqlite::SqlitePoolOptions::new().max_connections(1).connect_with(opts).await?;
    sqlx::query("CREATE TABLE IF NOT EXISTS naive (k TEXT PRIMARY KEY, state TEXT NOT NULL, ref TEXT)")
        .execute(&pool)
        .await?;
    Ok(raw_pairs(RawDb::Sqlite(pool), c, secs).await?.rate)
}

enum RawDb {
    Sqlite(sqlx::SqlitePool),
    Postgres(sqlx::PgPool),
}

/// The same two statements idem needs at minimum (insert, then mark done), autocommit.
async fn raw_pairs(db: RawDb, c: usize, secs: f64) -> anyhow::Result<Timed> {
    const INSERT: &str = "INSERT INTO naive (k, state) VALUES ($1, 'EXECUTING')";
    const UPDATE: &str = "UPDATE naive SET state = 'SUCCEEDED', ref = 'r' WHERE k = $1";
    let db = Arc::new(db);
    drive_timed(c, secs, move |k: String| {
        let db = db.clone();
        async move {
            match db.as_ref() {
                RawDb::Sqlite(p) => {
                    sqlx::query(INSERT).bind(&k).execute(p).await?;
                    sqlx::query(UPDATE).bind(&k).execute(p).await?;
                }
                RawDb::Postgres(p) => {
                    sqlx::query(INSERT).bind(&k).execute(p).await?;
                    sqlx::query(UPDATE).bind(&k).execute(p).await?;
                }
            }
            Ok(())
        }
    })
    .await
}

/// Mean fsync latency of a small write on the disk under `dir` (ms).
fn fsync_ms(dir: &std::path::Path) -> anyhow::Result<f64> {
    use std::io::Write;
    let mut f = std::fs::File::create(dir.join("fsync.probe"))?;
    let n = 50;
    let start = Instant::now();
    for _ in 0..n {
        f.write_all(b"x")?;
        f.sync_data()?;
    }
    Ok(start.elapsed().as_secs_f64() * 1000.0 / n as f64)
}

struct Served {
    child: std::process::Child,
    base: String,
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn serve(db_url: &str, key: &str) -> anyhow::Result<Served> {
    use std::io::BufRead;
    let exe = std::env::current_exe()?;
    let mut child = std::process::Command::new(exe)
        .args(["serve", "--listen", "127.0.0.1:0", "--database-url", db_url])
        .env("IDEM_BOOTSTRAP_KEY", key)
        .env("RUST_LOG", "error")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::inherit())
        .spawn()?;
    let mut out = std::io::BufReader::new(child.stdout.take().context("no stdout")?);
    let mut line = String::new();
    loop {
        line.clear();
        if out.read_line(&mut line)? == 0 {
            anyhow::bail!("idem serve exited before listening");
        }
        if let Some(addr) = line.trim().strip_prefix("idem: listening on ") {
            return Ok(Served { child, base: addr.to_owned() });
        }
    }
}

/// CPU time (user + system, seconds) of the processes `which` selects by pid and command
/// name, from `/proc/<pid>/stat` (fields 14 and 15, in clock ticks of 1/100 s: Linux's
/// USER_HZ, fixed by its ABI). Processes that exit in between are not counted.
fn cpu_seconds(which: impl Fn(u32, &str) -> bool) -> f64 {
    let Ok(dir) = std::fs::read_dir("/proc") else { return 0.0 };
    let mut ticks = 0u64;
    for entry in dir.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else { continue };
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else { continue };
        // "pid (comm) state ppid …": comm may hold spaces; the fields follow its last ')'.
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else { continue };
        if !which(pid, &stat[open + 1..close]) {
            continue;
        }
        let fields: Vec<&str> = stat[close + 1..].split_whitespace().collect();
        // fields[0] is the state (field 3), so utime (14) and stime (15) are 11 and 12.
        ticks += fields.get(11).and_then(|f| f.parse::<u64>().ok()).unwrap_or(0);
        ticks += fields.get(12).and_then(|f| f.parse::<u64>().ok()).unwrap_or(0);
    }
    ticks as f64 / 100.0
}

/// CPU time of every PostgreSQL process on this machine (seconds).
fn postgres_cpu() -> f64 {
    cpu_seconds(|_, comm| comm == "postgres")
}

/// CPU time of process `pid` (seconds).
pub(crate) fn process_cpu(pid: u32) -> f64 {
    cpu_seconds(|p, _| p == pid)
}

pub(crate) fn peak_rss_mib(pid: u32) -> Option<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb / 1024.0)
}

/// The `p` quantile of `sorted` microseconds, in ms.
pub(crate) fn percentile(sorted: &[u64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i] as f64 / 1000.0
}

/// HTTP pairs (acquire + complete of a new key) by `c` clients for `secs`, timed.
async fn http_pairs(base: &str, key: &str, c: usize, secs: f64) -> anyhow::Result<Timed> {
    let http = reqwest::Client::builder().pool_max_idle_per_host(c).build()?;
    let (base, key) = (Arc::<str>::from(base), Arc::<str>::from(key));
    drive_timed(c, secs, move |k: String| {
        let (http, base, key) = (http.clone(), base.clone(), key.clone());
        async move {
            let r = http
                .post(format!("{base}/v1/operations"))
                .bearer_auth(&key)
                .json(&json!({"key": k, "action": "bench", "payload": {"n": k}}))
                .send()
                .await?;
            anyhow::ensure!(r.status() == 201, "acquire answered {}", r.status());
            let token = r.json::<serde_json::Value>().await?["fencing_token"].as_i64().unwrap_or(0);
            let r = http
                .post(format!("{base}/v1/operations/{k}/complete"))
                .bearer_auth(&key)
                .json(&json!({"fencing_token": token, "outcome": "succeeded", "provider_ref": "r"}))
                .send()
                .await?;
            anyhow::ensure!(r.status() == 200, "complete answered {}", r.status());
            Ok(())
        }
    })
    .await
}

/// Replays per second of one SUCCEEDED key.
async fn http_replays(base: &str, key: &str, c: usize, secs: f64) -> anyhow::Result<f64> {
    let http = reqwest::Client::builder().pool_max_idle_per_host(c).build()?;
    let body = json!({"key": "bench-replay", "action": "bench", "payload": {"n": 0}});
    let r = http.post(format!("{base}/v1/operations")).bearer_auth(key).json(&body).send().await?;
    if r.status() == 201 {
        let token = r.json::<serde_json::Value>().await?["fencing_token"].as_i64().unwrap_or(0);
        http.post(format!("{base}/v1/operations/bench-replay/complete"))
            .bearer_auth(key)
            .json(&json!({"fencing_token": token, "outcome": "succeeded", "provider_ref": "r"}))
            .send()
            .await?;
    }
    let done = Arc::new(AtomicU64::new(0));
    let deadline = Instant::now() + Duration::from_secs_f64(secs);
    let mut tasks = Vec::new();
    for _ in 0..c {
        let (http, base, key, body, done) = (http.clone(), base.to_owned(), key.to_owned(), body.clone(), done.clone());
        tasks.push(tokio::spawn(async move {
            while Instant::now() < deadline {
                let r = http.post(format!("{base}/v1/operations")).bearer_auth(&key).json(&body).send().await?;
                anyhow::ensure!(r.status() == 200, "replay answered {}", r.status());
                done.fetch_add(1, Ordering::Relaxed);
            }
            anyhow::Ok(())
        }));
    }
    let start = Instant::now();
    for t in tasks {
        t.await??;
    }
    Ok(done.load(Ordering::Relaxed) as f64 / start.elapsed().as_secs_f64().max(secs))
}

/// Creates a database for one run on the server of `admin`; returns its name and URL.
async fn fresh_pg(admin: &str) -> anyhow::Result<(String, String)> {
    let mut conn = sqlx::postgres::PgConnectOptions::from_url(&admin.parse()?)?.connect().await?;
    let name = format!("idem_bench_{}", uuid_like());
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}"))).execute(&mut conn).await?;
    conn.close().await?;
    let base = admin.rsplit_once('/').map_or(admin, |(b, _)| b);
    Ok((name.clone(), format!("{base}/{name}")))
}

/// Drops the databases [`fresh_pg`] created (`WITH (FORCE)`: PostgreSQL ≥ 13).
async fn drop_pg(admin: &str, names: &[String]) -> anyhow::Result<()> {
    let mut conn = sqlx::postgres::PgConnectOptions::from_url(&admin.parse()?)?.connect().await?;
    for name in names {
        sqlx::query(sqlx::AssertSqlSafe(format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)")))
            .execute(&mut conn)
            .await?;
    }
    conn.close().await?;
    Ok(())
}

/// Runs everything and prints the table.
///
/// # Errors
/// Anything that keeps a measurement from running (a database, the server).
pub async fn run(args: BenchArgs) -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let f = fsync_ms(dir.path())?;
    println!(
        "idem bench: {} s per measurement, {} cores, fsync ≈ {f:.2} ms on {}",
        args.seconds,
        std::thread::available_parallelism().map_or(1, |n| n.get()),
        dir.path().display()
    );
    let mut rows = Vec::new();

    // Embedded, SQLite: every answer after the WAL's fsync.
    for &c in &args.concurrency {
        let store = idem_store::open(
            &format!("sqlite://{}", dir.path().join(format!("emb-{c}.db")).display()),
            Arc::new(SystemClock) as Arc<dyn Clock>,
            Default::default(),
        )
        .await?;
        let idem = store_pairs(store, c, args.seconds).await?;
        let naive = naive_sqlite_pairs(&dir.path().join(format!("naive-{c}.db")), c, args.seconds).await?;
        let ceiling = c as f64 / (2.0 * f / 1000.0);
        rows.push(Row {
            what: format!("embedded SQLite pairs/s, concurrency {c}"),
            idem,
            baseline: Some(naive),
            extra: format!("group-commit ceiling C/(2F) ≈ {ceiling:.0}/s ({:.0}% of it)", 100.0 * idem / ceiling),
        });
    }

    // HTTP end to end.
    let key = "bench-key-0123456789abcdef0123456789abcdef";
    let c = args.http_concurrency;
    let mut targets = vec![("SQLite", format!("sqlite://{}", dir.path().join("http.db").display()), None)];
    let mut created = Vec::new();
    if let Some(admin) = &args.postgres_url {
        let (name, url) = fresh_pg(admin).await?;
        let (raw_name, raw_url) = fresh_pg(admin).await?;
        created.extend([name, raw_name]);
        let raw = sqlx::postgres::PgPoolOptions::new().max_connections(c as u32).connect(&raw_url).await?;
        sqlx::query("CREATE TABLE naive (k TEXT PRIMARY KEY, state TEXT NOT NULL, ref TEXT)").execute(&raw).await?;
        targets.push(("PostgreSQL", url, Some(raw)));
    }
    for (name, url, raw) in targets {
        let server = serve(&url, key)?;
        let (server_cpu, pg_cpu, start) = (process_cpu(server.child.id()), postgres_cpu(), Instant::now());
        let Timed { rate, p50, p99, max } = http_pairs(&server.base, key, c, args.seconds).await?;
        let pairs = rate * start.elapsed().as_secs_f64();
        let server_us = (process_cpu(server.child.id()) - server_cpu) * 1e6 / pairs.max(1.0);
        let mut cpu = format!("CPU per pair: server {server_us:.0} µs");
        let pg_us = (postgres_cpu() - pg_cpu) * 1e6 / pairs.max(1.0);
        let mut latency = format!("pair latency p50 {p50:.1} ms, p99 {p99:.1} ms, max {max:.1} ms");
        let baseline = match raw {
            Some(pool) => {
                let (pg_cpu, start) = (postgres_cpu(), Instant::now());
                let raw = raw_pairs(RawDb::Postgres(pool.clone()), c, args.seconds).await?;
                let raw_us = (postgres_cpu() - pg_cpu) * 1e6 / (raw.rate * start.elapsed().as_secs_f64()).max(1.0);
                cpu += &format!(", PostgreSQL {pg_us:.0} µs (raw baseline: {raw_us:.0} µs)");
                latency += &format!(" (raw baseline: p50 {:.1}, p99 {:.1}, max {:.1} ms)", raw.p50, raw.p99, raw.max);
                pool.close().await;
                Some(raw.rate)
            }
            None => Some(naive_sqlite_pairs(&dir.path().join("http-naive.db"), c, args.seconds).await?),
        };
        rows.push(Row {
            what: format!("HTTP {name} pairs/s, concurrency {c}"),
            idem: rate,
            baseline,
            extra: format!("{latency}; {cpu}"),
        });
        let replays = http_replays(&server.base, key, c, args.seconds).await?;
        let rss = peak_rss_mib(server.child.id()).map_or("-".into(), |m| format!("{m:.1} MiB"));
        rows.push(Row {
            what: format!("HTTP {name} replays/s, concurrency {c}"),
            idem: replays,
            baseline: None,
            extra: format!("server peak RSS {rss}"),
        });
    }
    // What the MCP guard adds to a tool call (bench_mcp).
    let (what, idem, baseline, extra) = crate::bench_mcp::row(dir.path(), args.seconds).await?;
    rows.push(Row { what, idem, baseline, extra });
    // Three-step workflows, the engine embedded, each step an HTTP call to a no-op provider.
    let mut wf_targets = vec![("SQLite", format!("sqlite://{}", dir.path().join("workflows.db").display()))];
    if let Some(admin) = &args.postgres_url {
        let (name, url) = fresh_pg(admin).await?;
        created.push(name);
        wf_targets.push(("PostgreSQL", url));
    }
    use crate::bench_workflows::Shape;
    let shapes = [
        (Shape::Sequential, "3-step workflows/s", "3 HTTP steps each"),
        (Shape::FanOut, "fan-out workflows/s", "1 start, 10 parallel HTTP steps, 1 join each"),
    ];
    for (name, url) in wf_targets {
        for (shape, what, steps) in shapes {
            let pg_cpu = postgres_cpu();
            let start = Instant::now();
            let (rate, cpu_us) = crate::bench_workflows::workflows_per_second(&url, c, args.seconds, shape).await?;
            let mut extra = format!("{steps}; idem CPU {cpu_us:.0} µs per workflow");
            if name == "PostgreSQL" {
                let n = (rate * start.elapsed().as_secs_f64()).max(1.0);
                extra += &format!(", PostgreSQL {:.0} µs", (postgres_cpu() - pg_cpu) * 1e6 / n);
            }
            rows.push(Row { what: format!("{name} {what}, concurrency {c}"), idem: rate, baseline: None, extra });
        }
    }
    // The outbox relay against publishing right after the commit (PostgreSQL only).
    if let Some(admin) = &args.postgres_url {
        let (name, url) = fresh_pg(admin).await?;
        created.push(name);
        for (what, idem, baseline, extra) in
            crate::bench_relay::rows(&url, args.nats_url.as_deref(), 16, args.seconds).await?
        {
            rows.push(Row { what, idem, baseline, extra });
        }
    }
    if let Some(admin) = &args.postgres_url {
        drop_pg(admin, &created).await?;
    }
    print_rows(&rows);
    println!(
        "\nA pair is one acquire plus one complete of a new key, each acknowledged after a durable commit.\n\
         Baselines: embedded = the same writes, one SQLite transaction (and fsync) per statement;\n\
         HTTP SQLite = that naive store; HTTP PostgreSQL = an INSERT and an UPDATE per pair sent\n\
         straight to the database by the same number of clients. Replays trigger one finished key.\n\
         A 3-step workflow: a start, then per step an acquire, an HTTP call to a no-op provider on\n\
         loopback and a completion, each write durable; compare with bench/peers (DBOS).\n\
         MCP: sequential tools/call to a no-op rmcp server over Streamable HTTP, directly and through\n\
         idem mcp (SQLite ledger, each call a new intent: a durable acquire and completion), interleaved.\n\
         Group-commit ceiling C/(2F): C concurrent clients, F = fsync time, two commits per pair.\n\
         Relay rows: producers commit a row and an outbox event together; one relay delivers to a\n\
         local webhook receiver (signatures verified) or JetStream (PubAck awaited). Baseline: each\n\
         producer publishes itself right after its commit (no outbox: a crash in between loses it)."
    );
    if args.postgres_url.is_none() {
        println!("PostgreSQL rows skipped: pass --postgres-url (or IDEM_BENCH_PG_URL) to include them.");
    }
    Ok(())
}
