//! The relay: delivers committed outbox events **at least once**.
//!
//! [`Relay::tick`] is one pass: claim a batch (the head event of each aggregate, with a
//! lease and a fencing token: [`OutboxStore::claim_batch`]), commit the claim, deliver the
//! claimed events concurrently (one per aggregate, so per-aggregate order holds), then
//! record each outcome as idem-core's [`plan_delivery`] says, fenced by the claim's token.
//! No transaction is held across a delivery. [`Relay::run`] loops over `tick`, waking on
//! PostgreSQL NOTIFY (a hint) or the poll interval.
//!
//! What can happen to an event, and why it stays correct:
//! - the relay dies mid-batch ⇒ its leases expire and another relay (or it, restarted)
//!   claims those events again: delivered twice at worst, never lost;
//! - a relay outlives its lease (stalled) ⇒ another relay claims the event with a newer
//!   token; the stale relay's record is refused (nothing written);
//! - a delivery fails ⇒ retried with full jitter ([`RetryPolicy`], the connectors'
//!   schedule) while the sink's retry budget allows (an empty budget defers the retry
//!   without counting an attempt), until the last attempt ⇒ DEAD: it holds its aggregate
//!   back until an operator redrives or skips it; other aggregates go on;
//! - a topic no sink takes ⇒ DEAD at once (`no_sink`).

pub mod config;
pub mod wake;

use crate::error::OutboxError;
use crate::sink::nats::NatsSink;
use crate::sink::webhook::WebhookSink;
use crate::sink::{Envelope, Sink};
use crate::store::{Claimed, OutboxStore, Recorded};
use config::{RelayConfig, SinkConfig, topic_matches};
use idem_connect::budget::RetryBudget;
use idem_connect::config::ConfigError;
use idem_core::RetryPolicy;
use idem_core::outbox::{AttemptRow, DeliveryPlan, DeliveryResult, Trigger, plan_delivery};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::Notify;

/// How long a retry deferred by an empty retry budget waits (ms).
const BUDGET_DEFER_MS: i64 = 1_000;

/// One sink with the topics it takes, its retry schedule and its retry budget.
#[derive(Debug)]
pub struct Route {
    /// The sink's name (`outbox.sinks.NAME`; the metrics' `sink` label).
    pub name: String,
    /// Topic patterns (NATS-style).
    pub topics: Vec<String>,
    /// The sink.
    pub sink: Arc<dyn Sink>,
    /// Retry schedule.
    pub policy: RetryPolicy,
    /// Retry budget (retries only; first attempts and redrives are not charged).
    pub budget: RetryBudget,
}

/// What one [`Relay::tick`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TickReport {
    /// Events claimed.
    pub claimed: usize,
    /// Delivered.
    pub delivered: usize,
    /// Scheduled for a retry.
    pub retried: usize,
    /// Dead.
    pub dead: usize,
    /// Given back unattempted (retry budget empty).
    pub deferred: usize,
    /// Outcomes not recorded: the lease had been lost (another relay holds the event).
    pub fenced_out: usize,
    /// Outcomes the database refused even on their own (logged with the event's id): the
    /// event is attempted again after its lease.
    pub unrecorded: usize,
}

/// Longest a stopping relay waits for its deliveries in flight.
pub const DRAIN: Duration = Duration::from_secs(30);

/// A relay over one application database.
#[derive(Debug)]
pub struct Relay {
    store: OutboxStore,
    routes: Vec<Route>,
    id: String,
    lease_ms: i64,
    batch: i64,
    poll: Duration,
    /// Set by [`Relay::stop`]: [`Relay::run`] returns after the pass in flight.
    stopping: std::sync::atomic::AtomicBool,
    stop_wake: Notify,
}

impl Relay {
    /// A relay named `id` (its lease owner name) over `store`.
    pub fn new(store: OutboxStore, routes: Vec<Route>, id: String, lease_ms: i64, batch: i64, poll: Duration) -> Self {
        Relay {
            store,
            routes,
            id,
            lease_ms,
            batch,
            poll,
            stopping: std::sync::atomic::AtomicBool::new(false),
            stop_wake: Notify::new(),
        }
    }

    /// Builds the sinks of `config` and connects to its database.
    ///
    /// # Errors
    /// A [`ConfigError`] naming the field for a bad sink (a secret that is unset or not a
    /// Standard Webhooks secret, a bad URL); `outbox.database_url` when the database
    /// cannot be opened or has no schema.
    pub async fn from_config(config: &RelayConfig) -> Result<Relay, ConfigError> {
        let mut routes = Vec::new();
        for (name, c) in &config.sinks {
            let sink: Arc<dyn Sink> = match c {
                SinkConfig::Webhook(w) => Arc::new(WebhookSink::new(name, w)?),
                SinkConfig::Nats(n) => Arc::new(NatsSink::new(name, n)?),
            };
            let r = c.retry();
            routes.push(Route {
                name: name.clone(),
                topics: c.topics().to_vec(),
                sink,
                policy: r.policy(),
                budget: RetryBudget::new(r.budget_per_s, r.budget_burst),
            });
        }
        let store = OutboxStore::connect(&config.database_url, 8)
            .await
            .map_err(|e| ConfigError { field: "outbox.database_url".into(), message: e.to_string() })?;
        let id = format!("relay-{}-{}", std::process::id(), &uuid::Uuid::now_v7().simple().to_string()[20..]);
        Ok(Relay::new(store, routes, id, config.lease_ms, config.batch, Duration::from_millis(config.poll_interval_ms)))
    }

    /// This relay's name (the `lease_owner` of the events it holds).
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The outbox it reads.
    pub fn store(&self) -> &OutboxStore {
        &self.store
    }

    fn route(&self, topic: &str) -> Option<&Route> {
        self.routes.iter().find(|r| r.topics.iter().any(|p| topic_matches(p, topic)))
    }

    /// One pass: claim, deliver, record (see the module docs).
    ///
    /// # Errors
    /// Database errors while claiming or recording (an outcome not recorded is left to its
    /// lease: the event is delivered again after it expires).
    pub async fn tick(&self) -> Result<TickReport, OutboxError> {
        let claimed = self.store.claim_batch(&self.id, self.lease_ms, self.batch).await?;
        let mut report = TickReport { claimed: claimed.len(), ..TickReport::default() };
        // One event per aggregate per batch: they can all go at once.
        let attempts = futures_util::future::join_all(claimed.iter().map(|c| self.deliver_one(c))).await;
        let mut outcomes = Vec::with_capacity(attempts.len());
        for (c, a) in claimed.iter().zip(&attempts) {
            match a {
                Ok(Attempt::Made { plan, sink }) => outcomes.push(Recorded { claimed: c, plan, sink }),
                Ok(Attempt::Deferred) => report.deferred += 1,
                Ok(Attempt::Lost) => report.fenced_out += 1,
                Err(e) => tracing::warn!(error = %e, "a retry could not be deferred; its lease will expire"),
            }
        }
        if outcomes.is_empty() {
            return Ok(report);
        }
        let applied = self.record_outcomes(&outcomes).await?;
        for (o, applied) in outcomes.iter().zip(applied) {
            let labels = [("sink", o.sink.to_owned())];
            let Some(applied) = applied else {
                report.unrecorded += 1;
                metrics::counter!("idem_outbox_unrecorded_total", &labels).increment(1);
                continue;
            };
            if !applied {
                tracing::warn!(event = %o.claimed.row.id, "the lease was lost before the outcome was recorded; another relay holds the event");
                report.fenced_out += 1;
                continue;
            }
            match o.plan {
                DeliveryPlan::Delivered { .. } => {
                    report.delivered += 1;
                    metrics::counter!("idem_outbox_delivered_total", &labels).increment(1);
                }
                DeliveryPlan::RetryAt { .. } => {
                    report.retried += 1;
                    metrics::counter!("idem_outbox_retried_total", &labels).increment(1);
                }
                DeliveryPlan::Dead { .. } => {
                    report.dead += 1;
                    metrics::counter!("idem_outbox_dead_total", &labels).increment(1);
                }
            }
        }
        Ok(report)
    }

    /// Delivers one claimed event (or defers it when its sink's retry budget is empty) and
    /// plans what to record.
    async fn deliver_one(&self, c: &Claimed) -> Result<Attempt<'_>, OutboxError> {
        let start = Instant::now();
        let row = &c.row;
        let now = |start: Instant| c.claimed_at + start.elapsed().as_millis() as i64;
        let trigger = row.trigger();
        let (sink, result, policy) = match self.route(&row.topic) {
            None => (
                "none",
                DeliveryResult::Rejected {
                    error_class: "no_sink".into(),
                    message: format!(
                        "no sink of this relay takes topic {:?} (outbox.sinks.*.topics); every relay of one outbox needs the same sinks; redrive it once one does",
                        row.topic
                    ),
                },
                RetryPolicy::default(),
            ),
            Some(route) => {
                if row.attempts > 1 && trigger == Trigger::Scheduled && !route.budget.try_take() {
                    tracing::debug!(sink = %route.name, "retry budget exhausted; retry deferred");
                    let released = self.store.release(c, now(start) + BUDGET_DEFER_MS).await?;
                    return Ok(if released { Attempt::Deferred } else { Attempt::Lost });
                }
                let headers = row.header_map();
                let envelope = Envelope {
                    id: &row.id,
                    topic: &row.topic,
                    payload: &row.payload,
                    headers: &headers,
                    now_ms: now(start),
                };
                let result = route.sink.deliver(&envelope).await;
                (route.name.as_str(), result, route.policy.clone())
            }
        };
        let attempt = AttemptRow { attempts: row.attempts, created_at: row.created_at, trigger };
        let plan = plan_delivery(&attempt, result, &policy, now(start), rand::random::<f64>());
        Ok(Attempt::Made { plan, sink })
    }

    /// Records a pass's outcomes in one statement; if the database refuses it, each outcome
    /// on its own, so one outcome it cannot take never costs the others theirs (issue 28
    /// §8: one receiver's binary error body lost every delivery of the pass, again and
    /// again). Per outcome: `Some(applied)` as [`OutboxStore::record_all`] says, `None`
    /// when even its own statement failed (logged; the event is attempted again after its
    /// lease).
    ///
    /// # Errors
    /// The batch's error when there is only one outcome, or when no outcome could be
    /// recorded on its own either (the database is down, not one row).
    async fn record_outcomes(&self, outcomes: &[Recorded<'_>]) -> Result<Vec<Option<bool>>, OutboxError> {
        let batch_error = match self.store.record_all(outcomes, &self.id).await {
            Ok(applied) => return Ok(applied.into_iter().map(Some).collect()),
            Err(e) if outcomes.len() == 1 => return Err(e),
            Err(e) => e,
        };
        tracing::warn!(error = %batch_error, "recording the pass's outcomes together failed; recording them one by one");
        let mut each = Vec::with_capacity(outcomes.len());
        for o in outcomes {
            match self.store.record_all(std::slice::from_ref(o), &self.id).await {
                Ok(applied) => each.push(applied.first().copied()),
                Err(e) => {
                    tracing::error!(event = %o.claimed.row.id, error = %e, "the outcome of this attempt could not be recorded; the event is attempted again after its lease");
                    each.push(None);
                }
            }
        }
        if each.iter().all(Option::is_none) {
            return Err(batch_error);
        }
        Ok(each)
    }

    /// Runs passes until the process ends: again at once after a pass that claimed
    /// something (an aggregate's next event becomes its head only once the previous one is
    /// recorded), else on a `hint` (NOTIFY) or after the poll interval, whichever comes
    /// first. While it waits it says so (`idem.relay_idle`), so that appenders NOTIFY; a
    /// busy relay takes that back, and appenders skip the NOTIFY, whose commit-time lock
    /// would halve their commit rate. After saying it waits it makes one more pass, so an
    /// event committed just before is not left to the poll.
    ///
    /// Returns once [`Relay::stop`] was called, after the pass in flight: its deliveries
    /// finish and are recorded, so a stopped relay leaves no claimed event behind for
    /// another relay to deliver a second time.
    pub async fn run(self: Arc<Self>, hint: Option<Arc<Notify>>) {
        let hint = hint.unwrap_or_else(|| Arc::new(Notify::new()));
        let idle_for_ms = 3 * self.poll.as_millis() as i64 + 1_000;
        let mut said_idle = false;
        loop {
            if self.stopping.load(std::sync::atomic::Ordering::SeqCst) {
                if said_idle {
                    let _ = self.store.set_idle(&self.id, None).await;
                }
                return;
            }
            let busy = match self.tick().await {
                Ok(r) => r.claimed > 0,
                Err(e) => {
                    tracing::warn!(error = %e, "relay pass failed");
                    false
                }
            };
            if busy {
                if said_idle && self.store.set_idle(&self.id, None).await.is_ok() {
                    said_idle = false;
                }
                continue;
            }
            let first = !said_idle;
            match self.store.set_idle(&self.id, Some(idle_for_ms)).await {
                Ok(()) => said_idle = true,
                Err(e) => tracing::warn!(error = %e, "cannot mark the relay idle; appenders will not wake it"),
            }
            if first && said_idle {
                continue;
            }
            tokio::select! {
                () = hint.notified() => {}
                () = self.stop_wake.notified() => {}
                () = tokio::time::sleep(self.poll) => {}
            }
        }
    }

    /// Asks [`Relay::run`] to return after the pass in flight (its deliveries recorded);
    /// claims no more events. For a graceful shutdown (SIGTERM).
    pub fn stop(&self) {
        self.stopping.store(true, std::sync::atomic::Ordering::SeqCst);
        // `notify_one` keeps a permit when `run` is not waiting yet (it is in a pass), so
        // its next wait ends at once instead of after the poll interval.
        self.stop_wake.notify_one();
    }

    /// [`Relay::stop`], then waits up to [`DRAIN`] for `task` (the [`Relay::spawn`] handle)
    /// to finish the pass in flight. A delivery still running after that is left to its
    /// lease: another relay delivers it again (at least once).
    pub async fn stop_and_drain(&self, task: tokio::task::JoinHandle<()>) {
        self.stop();
        if tokio::time::timeout(DRAIN, task).await.is_err() {
            tracing::warn!("outbox deliveries still in flight after {} s; their leases will run out", DRAIN.as_secs());
        }
    }

    /// Starts [`Relay::run`] (with LISTEN on PostgreSQL) and a task that publishes the
    /// outbox gauges every 2 s — `idem_outbox_lag_ms` (age of the oldest undelivered
    /// event) and `idem_outbox_events{state}` — and deletes delivered and skipped events
    /// past `retention_ms` (up to 1 000 each time).
    pub fn spawn(self: Arc<Self>, retention_ms: Option<i64>) -> tokio::task::JoinHandle<()> {
        // Every sink's counters exist from the start (at 0), so a rate() or an alert on
        // them works before the first delivery; `none` counts the `no_sink` dead events.
        for sink in self.routes.iter().map(|r| r.name.as_str()).chain(["none"]) {
            for name in ["idem_outbox_delivered_total", "idem_outbox_retried_total", "idem_outbox_dead_total"] {
                metrics::counter!(name, "sink" => sink.to_owned()).increment(0);
            }
        }
        let hint = self.store.postgres().map(|p| wake::listen(p.clone()));
        let store = self.store.clone();
        tokio::spawn(async move {
            loop {
                match store.stats().await {
                    Ok(s) => {
                        metrics::gauge!("idem_outbox_lag_ms").set(s.lag_ms as f64);
                        for state in idem_core::outbox::OutboxState::ALL {
                            let n = s.by_state.get(state.as_str()).copied().unwrap_or(0);
                            metrics::gauge!("idem_outbox_events", "state" => state.as_str()).set(n as f64);
                        }
                    }
                    Err(e) => tracing::warn!(error = %e, "reading the outbox gauges failed"),
                }
                if let Some(ms) = retention_ms
                    && let Err(e) = store.sweep(ms, 1_000).await
                {
                    tracing::warn!(error = %e, "the outbox retention sweep failed");
                }
                tokio::time::sleep(Duration::from_secs(2)).await;
            }
        });
        tokio::spawn(self.run(hint))
    }
}

/// What happened to one claimed event before recording.
enum Attempt<'a> {
    /// Delivered or failed: record this plan (for this sink).
    Made { plan: DeliveryPlan, sink: &'a str },
    /// Given back unattempted (retry budget empty).
    Deferred,
    /// Given back too late: another relay holds it now.
    Lost,
}
