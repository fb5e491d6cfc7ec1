//! `idem bench`'s outbox rows (PostgreSQL): the relay against the naive way, to a local
//! webhook receiver and to NATS JetStream.
//!
//! - Throughput: `c` producers each commit a business row and, in the same transaction,
//!   append an outbox event (`idem.outbox_append`); one relay in this process delivers.
//!   events/s = events committed / (last delivery − first commit). The baseline, "publish
//!   right after commit, no outbox": each producer commits the business row, then
//!   publishes itself (POST to the receiver / JetStream publish awaiting its PubAck) — the
//!   dual write the outbox replaces (a crash between the two loses the event).
//! - The halves alone: producers appending with no relay running (events/s committed),
//!   then the relay draining that backlog with no producer (events/s delivered), so the
//!   row shows which of the two limits the throughput above.
//! - Latency: producers paced to 1 000 events/s in all; commit-to-delivery = the receiver's
//!   arrival (webhook) or a subscriber's receipt (NATS) minus the producer's commit, p50
//!   and p99.
//!
//! Events go to 1 000 aggregates (the relay keeps each aggregate's order, one event per
//! aggregate in flight). The receiver verifies every signature.

use idem::acceptance::receiver::Receiver;
use idem_outbox::relay::Relay;
use idem_outbox::relay::config::RelayConfig;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const SECRET: &str = "whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD";
const AGGREGATES: u64 = 1_000;

/// One row: what, idem's figure, the baseline's, notes.
pub type RelayRow = (String, f64, Option<f64>, String);

/// Where the events go.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Target {
    Webhook,
    Nats,
}

/// Commit instants by event id, and arrival instants by event id.
type Times = Arc<Mutex<HashMap<String, Instant>>>;

struct Setup {
    pool: sqlx::PgPool,
    relay: Arc<Relay>,
    receiver: Receiver,
    nats: Option<(async_nats::jetstream::Context, String, String)>,
    arrivals: Times,
    _secret: tempfile::NamedTempFile,
}

async fn setup(app_url: &str, nats_url: Option<&str>) -> anyhow::Result<Setup> {
    idem_outbox::schema::install(app_url).await?;
    let pool = sqlx::postgres::PgPoolOptions::new().max_connections(40).connect(app_url).await?;
    sqlx::query("CREATE TABLE IF NOT EXISTS orders (id text PRIMARY KEY, n bigint NOT NULL)").execute(&pool).await?;
    let receiver = Receiver::start(&[SECRET], None).await;
    let secret = tempfile::NamedTempFile::new()?;
    std::fs::write(secret.path(), SECRET)?;
    let arrivals: Times = Arc::default();
    let mut sinks = format!(
        "[outbox.sinks.hooks]\nkind = \"webhook\"\nurl = \"{}\"\ntopics = [\"hooks.>\"]\nsecrets = [{{ file = \"{}\" }}]\n\
         timeout_ms = 5000\n",
        receiver.url(),
        secret.path().display()
    );
    let mut nats = None;
    if let Some(url) = nats_url {
        let client = async_nats::connect(url).await?;
        let js = async_nats::jetstream::new(client.clone());
        let id = uuid::Uuid::now_v7().simple().to_string();
        let (stream, prefix) = (format!("IDEMBENCH_{id}"), format!("b{id}"));
        js.create_stream(async_nats::jetstream::stream::Config {
            name: stream.clone(),
            subjects: vec![format!("{prefix}.>")],
            ..Default::default()
        })
        .await?;
        // A subscriber sees each message as the server takes it: the arrival time.
        let mut sub = client.subscribe(format!("{prefix}.>")).await?;
        let arr = arrivals.clone();
        tokio::spawn(async move {
            use futures_util::StreamExt;
            while let Some(m) = sub.next().await {
                if let Some(id) = m.headers.as_ref().and_then(|h| h.get("Nats-Msg-Id")) {
                    arr.lock().unwrap().entry(id.as_str().to_owned()).or_insert_with(Instant::now);
                }
            }
        });
        sinks += &format!(
            "[outbox.sinks.bus]\nkind = \"nats\"\nurl = \"{url}\"\ntopics = [\"bus.>\"]\nsubject_prefix = \"{prefix}.\"\n\
             timeout_ms = 5000\n"
        );
        nats = Some((js, stream, prefix));
    }
    let text = format!("[outbox]\ndatabase_url = \"{app_url}\"\nlease_ms = 30000\nbatch = 500\n{sinks}");
    let value: toml::Value = toml::from_str(&text)?;
    let config = RelayConfig::parse(value.get("outbox").expect("written above"))?;
    let relay = Arc::new(Relay::from_config(&config).await?);
    Ok(Setup { pool, relay, receiver, nats, arrivals, _secret: secret })
}

impl Setup {
    /// Arrival instants of the webhook receiver and the NATS subscriber.
    fn arrived(&self) -> HashMap<String, Instant> {
        let mut all = self.arrivals.lock().unwrap().clone();
        for a in self.receiver.arrivals() {
            all.entry(a.id).or_insert(a.at);
        }
        all
    }
}

/// One producer's event `i`: commits an order row, and with `outbox` the event in the
/// same transaction; without, publishes it after the commit (the naive dual write).
async fn produce(
    s: &Setup,
    target: Target,
    run: &str,
    w: usize,
    i: u64,
    outbox: bool,
    commits: &Times,
) -> anyhow::Result<()> {
    let id = format!("{run}-{w}-{i}");
    let topic = match target {
        Target::Webhook => "hooks.order",
        Target::Nats => "bus.order",
    };
    let payload = format!("{{\"order\":\"{id}\",\"n\":{i}}}");
    let mut t = s.pool.begin().await?;
    sqlx::query("INSERT INTO orders (id, n) VALUES ($1, $2)").bind(&id).bind(i as i64).execute(&mut *t).await?;
    if outbox {
        sqlx::query("SELECT idem.outbox_append($1, 'order', $2, $3, $4::json)")
            .bind(&id)
            .bind(((w as u64 * 7919 + i) % AGGREGATES).to_string())
            .bind(topic)
            .bind(&payload)
            .execute(&mut *t)
            .await?;
    }
    t.commit().await?;
    commits.lock().unwrap().insert(id.clone(), Instant::now());
    if !outbox {
        match target {
            Target::Webhook => {
                let now = idem_core::Clock::now_ms(&idem_core::SystemClock);
                let secret = idem_outbox::signature::WebhookSecret::parse(SECRET)?;
                let sig = idem_outbox::signature::signature_header(&[secret], &id, now / 1000, payload.as_bytes());
                let r = HTTP
                    .post(s.receiver.url())
                    .header("webhook-id", &id)
                    .header("webhook-timestamp", (now / 1000).to_string())
                    .header("webhook-signature", sig)
                    .body(payload)
                    .send()
                    .await?;
                anyhow::ensure!(r.status().is_success(), "the receiver answered {}", r.status());
            }
            Target::Nats => {
                let (js, _, prefix) = s.nats.as_ref().expect("NATS rows only with a server");
                let out = idem_connect::nats::publish(
                    js,
                    &format!("{prefix}.order"),
                    &id,
                    &Default::default(),
                    payload.into_bytes(),
                )
                .await;
                anyhow::ensure!(matches!(out, idem_connect::nats::PublishOutcome::Stored { .. }), "publish: {out:?}");
            }
        }
    }
    Ok(())
}

static HTTP: std::sync::LazyLock<reqwest::Client> =
    std::sync::LazyLock::new(|| reqwest::Client::builder().pool_max_idle_per_host(64).build().expect("a client"));

/// Runs `c` producers for `secs` (paced to `rate` events/s in all when given); returns the
/// commit instants by event id and when the first commit was.
async fn producers(
    s: &Arc<Setup>,
    target: Target,
    c: usize,
    secs: f64,
    rate: Option<f64>,
    outbox: bool,
) -> anyhow::Result<(Times, Instant)> {
    let commits: Times = Arc::default();
    let run = uuid::Uuid::now_v7().simple().to_string()[20..].to_owned();
    let start = Instant::now();
    let deadline = start + Duration::from_secs_f64(secs);
    let mut tasks = Vec::new();
    for w in 0..c {
        let (s, commits, run) = (s.clone(), commits.clone(), run.clone());
        tasks.push(tokio::spawn(async move {
            let mut i = 0u64;
            while Instant::now() < deadline {
                if let Some(rate) = rate {
                    let due = start + Duration::from_secs_f64((i as f64 * c as f64 + w as f64) / rate);
                    tokio::time::sleep_until(due.into()).await;
                }
                produce(&s, target, &run, w, i, outbox, &commits).await?;
                i += 1;
            }
            anyhow::Ok(())
        }));
    }
    for t in tasks {
        t.await??;
    }
    Ok((commits, start))
}

/// Waits until the outbox holds no undelivered event (at most 60 s: polling the database,
/// not the receiver's records, whose copying would take CPU from the relay in this
/// process), then returns the last arrival of the events in `commits`.
async fn drained(s: &Setup, commits: &Times) -> anyhow::Result<Instant> {
    let give_up = Instant::now() + Duration::from_secs(60);
    loop {
        let open: i64 = sqlx::query_scalar("SELECT count(*) FROM idem.outbox WHERE state <> 'DELIVERED'")
            .fetch_one(&s.pool)
            .await?;
        if open == 0 {
            break;
        }
        anyhow::ensure!(Instant::now() < give_up, "the relay did not deliver every event within 60 s");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let arrived = s.arrived();
    let commits = commits.lock().unwrap();
    anyhow::ensure!(
        commits.keys().all(|id| arrived.contains_key(id)),
        "an event was recorded delivered but never arrived"
    );
    Ok(commits.keys().filter_map(|id| arrived.get(id)).max().copied().unwrap_or_else(Instant::now))
}

fn latencies(s: &Setup, commits: &Times) -> Vec<u64> {
    let arrived = s.arrived();
    let mut l: Vec<u64> = commits
        .lock()
        .unwrap()
        .iter()
        .filter_map(|(id, c)| arrived.get(id).map(|a| a.saturating_duration_since(*c).as_micros() as u64))
        .collect();
    l.sort_unstable();
    l
}

/// The relay rows on a fresh application database at `app_url`.
pub async fn rows(app_url: &str, nats_url: Option<&str>, c: usize, secs: f64) -> anyhow::Result<Vec<RelayRow>> {
    let s = Arc::new(setup(app_url, nats_url).await?);
    let mut out = Vec::new();
    // The two halves alone, to show which one limits: producers appending with no relay
    // running, then the relay draining that backlog with no producers.
    let (backlog, t0) = producers(&s, Target::Webhook, c, secs, None, true).await?;
    let appended = backlog.lock().unwrap().len() as f64;
    let append_rate = appended / t0.elapsed().as_secs_f64();
    let relay_task = s.relay.clone().spawn(None);
    let t0 = Instant::now();
    drained(&s, &backlog).await?;
    let drain_rate = appended / t0.elapsed().as_secs_f64();
    out.push((
        format!("outbox append alone, {c} producers, events/s"),
        append_rate,
        None,
        "producers committing a row and its outbox event, no relay running (compare the relay → webhook row's baseline)"
            .to_owned(),
    ));
    out.push((
        "relay drain alone → webhook, events/s".to_owned(),
        drain_rate,
        None,
        format!("one relay delivering the {appended:.0} events appended above, no producer running"),
    ));
    let mut targets = vec![(Target::Webhook, "webhook")];
    if s.nats.is_some() {
        targets.push((Target::Nats, "NATS"));
    }
    for (target, name) in targets {
        let (naive, t0) = producers(&s, target, c, secs, None, false).await?;
        let naive_rate = naive.lock().unwrap().len() as f64 / t0.elapsed().as_secs_f64();
        let (commits, t0) = producers(&s, target, c, secs, None, true).await?;
        let produced_in = t0.elapsed().as_secs_f64();
        let last = drained(&s, &commits).await?;
        let n = commits.lock().unwrap().len() as f64;
        let relay_rate = n / last.saturating_duration_since(t0).as_secs_f64();
        let l = latencies(&s, &commits);
        out.push((
            format!("relay → {name} events/s, {c} producers"),
            relay_rate,
            Some(naive_rate),
            format!(
                "baseline: publish after commit; producers committed {:.0} events/s; commit-to-delivery p50 {:.1} ms, p99 {:.1} ms",
                n / produced_in,
                crate::bench::percentile(&l, 0.5),
                crate::bench::percentile(&l, 0.99)
            ),
        ));
        let (paced, _) = producers(&s, target, c, secs, Some(1_000.0), true).await?;
        drained(&s, &paced).await?;
        let l = latencies(&s, &paced);
        let (p50, p99) = (crate::bench::percentile(&l, 0.5), crate::bench::percentile(&l, 0.99));
        out.push((
            format!("relay → {name} at 1 000 events/s: p99 ms"),
            p99,
            None,
            format!("commit-to-delivery p50 {p50:.1} ms, p99 {p99:.1} ms over {} events (target p99 ≤ 50 ms)", l.len()),
        ));
    }
    relay_task.abort();
    if let Some((js, stream, _)) = &s.nats {
        js.delete_stream(stream).await?;
    }
    Ok(out)
}
