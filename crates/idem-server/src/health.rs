//! What this node knows about its database, for `/readyz`.
//!
//! A prober pings the store every [`PROBE_INTERVAL`] (each ping bounded by
//! [`PROBE_TIMEOUT`]) and keeps the last result, so `/readyz` answers at once from it —
//! also while PostgreSQL is down, when a ping of its own would wait for the pool's
//! acquire timeout and a health checker with a shorter time-out would see a time-out
//! instead of a 503.

use idem_store::{CommitDurability, Store, StoreError};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How often the prober pings the database.
pub const PROBE_INTERVAL: Duration = Duration::from_millis(250);
/// The longest a probe waits for the database before it counts as down.
pub const PROBE_TIMEOUT: Duration = Duration::from_millis(1000);
/// A last probe older than this is not trusted (the prober is stuck): not ready.
pub const STALE_AFTER: Duration = Duration::from_secs(5);
/// The prober reads the database's durability settings every this many probes (1 s):
/// a failover can change them.
pub const DURABILITY_EVERY: u32 = 4;

/// The database's last known state on this node.
#[derive(Debug, Default)]
pub struct Health {
    last: Mutex<Option<Probe>>,
    /// What the database last said it promises about a commit ([`Store::commit_durability`]).
    durability: Mutex<Option<CommitDurability>>,
    probes: AtomicU32,
}

#[derive(Debug, Clone)]
struct Probe {
    at: Instant,
    /// `None`: the database answered. `Some((since, failure))`: it has not since.
    down: Option<(Instant, Failure)>,
}

/// A failed probe, in idem's words (a client is never shown the database's own message:
/// the log has it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    /// The database answers but idem's tables are gone ([`StoreError::SchemaMissing`]):
    /// the node cannot serve until the database is restored or the node restarted.
    pub schema_missing: bool,
    /// What failed, in one line of idem's own.
    pub words: String,
}

impl Failure {
    /// `e` (a failed ping) in idem's words.
    pub fn of(e: &StoreError) -> Failure {
        Failure { schema_missing: e.schema_missing(), words: e.in_idems_words() }
    }
}

/// Why the database is not usable, for `/readyz`'s problem.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NotReady {
    /// The last probe failed; down for `for_ms` ms (since the first failed probe).
    Down { for_ms: u64, failure: Failure },
    /// No probe for `ms` ms: the prober is stuck, so nothing is known.
    Stale { ms: u64 },
    /// No probe has run yet.
    Unknown,
}

impl Health {
    /// The last probe's verdict: `Ok(())` when the database answered it.
    ///
    /// # Errors
    /// [`NotReady`] when it did not, the last probe is older than [`STALE_AFTER`], or none
    /// ran yet.
    pub fn database(&self) -> Result<(), NotReady> {
        let last = self.last.lock().expect("health lock").clone();
        let Some(p) = last else { return Err(NotReady::Unknown) };
        let age = p.at.elapsed();
        if age > STALE_AFTER {
            return Err(NotReady::Stale { ms: age.as_millis() as u64 });
        }
        match p.down {
            None => Ok(()),
            Some((since, failure)) => Err(NotReady::Down { for_ms: since.elapsed().as_millis() as u64, failure }),
        }
    }

    /// Whether the last probe found idem's tables missing (for `/healthz`: the node
    /// cannot serve anything until the database is restored or the node restarted).
    pub fn schema_missing(&self) -> Option<Failure> {
        let last = self.last.lock().expect("health lock");
        last.as_ref().and_then(|p| p.down.as_ref()).map(|(_, f)| f.clone()).filter(|f| f.schema_missing)
    }

    /// Records one probe's result; `error` is what the log gets on a change.
    pub fn record(&self, result: Result<(), (Failure, String)>) {
        let mut last = self.last.lock().expect("health lock");
        let since = last.as_ref().and_then(|p| p.down.as_ref()).map(|(s, _)| *s);
        let was = last.as_ref().and_then(|p| p.down.as_ref()).map(|(_, f)| f.clone());
        let down = match result {
            Ok(()) => None,
            Err((failure, error)) => {
                if was.as_ref().is_none_or(|w| w.schema_missing != failure.schema_missing) {
                    if failure.schema_missing {
                        tracing::error!(error = %error, "idem's tables are missing from the database: it was dropped or replaced under this node; nothing can be served");
                    } else {
                        tracing::warn!(error = %error, "the database does not answer");
                    }
                }
                Some((since.unwrap_or_else(Instant::now), failure))
            }
        };
        if down.is_none() && was.is_some() {
            tracing::info!("the database answers again");
        }
        *last = Some(Probe { at: Instant::now(), down });
    }

    /// What the database last said it promises about an acknowledged commit; `None`
    /// before it was first read.
    pub fn durability(&self) -> Option<CommitDurability> {
        self.durability.lock().expect("health lock").clone()
    }

    /// Records what the database promises: logged and put in `/metrics` when it changed
    /// (`idem_database_replicated_commits` 1 or 0, and
    /// `idem_database_durability_info{synchronous_commit, synchronous_standby_names, level}`
    /// 1 for the settings in force, 0 for those before).
    pub fn record_durability(&self, now: CommitDurability) {
        let mut last = self.durability.lock().expect("health lock");
        if last.as_ref() == Some(&now) {
            return;
        }
        let info = |d: &CommitDurability, v: f64| {
            metrics::gauge!(
                "idem_database_durability_info",
                "synchronous_commit" => d.synchronous_commit.clone().unwrap_or_default(),
                "synchronous_standby_names" => d.synchronous_standby_names.clone().unwrap_or_default(),
                "level" => d.level().as_str(),
            )
            .set(v);
        };
        if let Some(before) = last.as_ref() {
            info(before, 0.0);
        }
        info(&now, 1.0);
        let replicated = now.level() == idem_store::durability::Level::Replicated;
        metrics::gauge!("idem_database_replicated_commits").set(if replicated { 1.0 } else { 0.0 });
        match (&*last, replicated) {
            (Some(before), false) if before.level() > now.level() => {
                tracing::warn!(durability = %now.describe(), "the database promises less about commits than before");
            }
            (None, false) if now.hosts > 1 => {
                tracing::warn!(durability = %now.describe(), "the database's cluster has no synchronous standby");
            }
            _ => tracing::info!(durability = %now.describe(), "the database's durability"),
        }
        *last = Some(now);
    }

    /// Pings `store` once, bounded by [`PROBE_TIMEOUT`], and records the result; every
    /// [`DURABILITY_EVERY`] probes it reads the durability settings too.
    pub async fn probe(&self, store: &dyn Store) {
        if self.probes.fetch_add(1, Ordering::Relaxed) % DURABILITY_EVERY == 0
            && let Ok(Ok(d)) = tokio::time::timeout(PROBE_TIMEOUT, store.commit_durability()).await
        {
            self.record_durability(d);
        }
        let result = match tokio::time::timeout(PROBE_TIMEOUT, store.ping()).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err((Failure::of(&e), e.to_string())),
            Err(_) => {
                let words = format!("no answer within {} ms", PROBE_TIMEOUT.as_millis());
                Err((Failure { schema_missing: false, words: words.clone() }, words))
            }
        };
        self.record(result);
    }
}

/// Runs the prober until the process ends.
pub fn spawn_prober(health: Arc<Health>, store: Arc<dyn Store>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(PROBE_INTERVAL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            health.probe(store.as_ref()).await;
        }
    })
}
