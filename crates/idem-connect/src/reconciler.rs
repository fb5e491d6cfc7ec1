//! The reconciler (DESIGN.md §5): settles UNKNOWN operations by asking the provider.
//!
//! Each pass takes the UNKNOWN operations whose next lookup is due and not flagged for
//! review, calls the connector's `lookup`, and records the answer through idem-core's
//! `plan_reconciliation`: found ⇒ SUCCEEDED with the provider's reference
//! (`evidence_source = "lookup"`), absent ⇒ PENDING (the executor tries again), anything
//! else ⇒ stays UNKNOWN, looked up again with backoff, flagged `needs_review` after the
//! connector's `max_lookups`. An operation the caller executed itself (no connector), or
//! one whose connector has no lookup configured ([`crate::Connector::can_look_up`]), has
//! nobody to ask: it is flagged for review at once; so is a workflow step whose recovery
//! policy is `manual` or `compensate` (DESIGN.md §8: a person decides).

use crate::executor::ctx_of;
use crate::registry::Registry;
use idem_core::{Actor, Clock, Lookup, OperationRecord, RetryPolicy};
use idem_store::{ReconcileOutcome, ReconcileRequest, Store, StoreError};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Due operations read per round of a pass.
pub const BATCH: i64 = 256;
/// Lookups and review flags in flight at once. Concurrent writes share statements and
/// commits in the stores (group commit), so a backlog is worked off at the ledger's own
/// write rate rather than one round trip at a time.
pub const CONCURRENCY: usize = 32;
/// A pass stops starting new rounds after this long, so it never runs unbounded.
pub const PASS_BUDGET: Duration = Duration::from_secs(10);

/// Reconciles UNKNOWN operations for one node.
pub struct Reconciler {
    store: Arc<dyn Store>,
    registry: Arc<Registry>,
    clock: Arc<dyn Clock>,
    interval: Duration,
    wake: tokio::sync::Notify,
}

impl Reconciler {
    /// A reconciler over `store` with the connectors of `registry`; lookups judge the time
    /// since an attempt on `clock` (the ledger's: the one the store reads).
    pub fn new(store: Arc<dyn Store>, registry: Arc<Registry>, clock: Arc<dyn Clock>, interval: Duration) -> Self {
        Reconciler { store, registry, clock, interval, wake: tokio::sync::Notify::new() }
    }

    /// Starts a pass now instead of at the next interval (e.g. after the lease sweeper
    /// turned expired leases into UNKNOWN: an operation nobody can be asked about is then
    /// flagged for review at once).
    pub fn wake(&self) {
        self.wake.notify_one();
    }

    /// Looks `rec` up now and records the answer, on behalf of `actor`.
    ///
    /// # Errors
    /// Store errors; [`StoreError::NotFound`] if the record vanished.
    pub async fn reconcile_one(&self, rec: &OperationRecord, actor: Actor) -> Result<ReconcileOutcome, StoreError> {
        // A workflow step whose policy leaves it to a person is never looked up (or redone
        // on a proven absence): it goes to review at once. Step keys always hold a ':'.
        let for_a_person = match rec.key.contains(':') {
            true => self.store.flows().step_of_operation(&rec.tenant, &rec.key).await?.filter(|s| {
                matches!(
                    s.policy,
                    idem_core::flow::RecoveryPolicy::Manual | idem_core::flow::RecoveryPolicy::Compensate
                )
            }),
            false => None,
        };
        let (lookup, policy, max_lookups) = match rec.connector.as_deref() {
            _ if let Some(step) = &for_a_person => (
                Lookup::Inconclusive {
                    why: format!(
                        "workflow step {:?} has the {} policy: an operator decides, nothing is looked up or redone",
                        step.step, step.policy
                    ),
                },
                RetryPolicy::default(),
                1,
            ),
            None => (
                Lookup::Inconclusive {
                    why: "the caller performed the side effect (no connector to ask): an operator must resolve it"
                        .into(),
                },
                RetryPolicy::default(),
                1,
            ),
            Some(name) => match self.registry.get(name) {
                // Asking again would get the same "no lookup": review now, not after
                // `max_lookups` backoffs.
                Some(entry) if !entry.connector.can_look_up() => (
                    Lookup::Inconclusive {
                        why: format!("connector {name:?} has no lookup configured: an operator must resolve it"),
                    },
                    entry.policy.clone(),
                    1,
                ),
                Some(entry) => (
                    entry.connector.lookup(&ctx_of(rec, self.clock.now_ms())).await,
                    entry.policy.clone(),
                    entry.max_lookups,
                ),
                // A lookup-only name (the proxy's) without a configured lookup: nobody to
                // ask, so an operator decides, as for the caller's own effects.
                None if name.starts_with("lookup:") => (
                    Lookup::Inconclusive {
                        why: "no lookup is configured for these requests: an operator must resolve it".into(),
                    },
                    RetryPolicy::default(),
                    1,
                ),
                None => (
                    Lookup::Inconclusive { why: format!("connector {name:?} is not configured on this node") },
                    RetryPolicy::default(),
                    i64::MAX,
                ),
            },
        };
        tracing::info!(
            tenant = %rec.tenant,
            key_hash = %idem_core::key::log_hash(&rec.key),
            connector = ?rec.connector,
            lookup = ?lookup,
            "reconciliation lookup"
        );
        self.store
            .reconcile(ReconcileRequest {
                tenant: rec.tenant.clone(),
                key: rec.key.clone(),
                lookup,
                actor,
                policy,
                max_lookups,
            })
            .await
    }

    /// One pass over due UNKNOWN operations: rounds of [`BATCH`] due operations, each
    /// worked [`CONCURRENCY`] at a time, until fewer than a batch are due, a round had a
    /// failure (it is retried next pass) or [`PASS_BUDGET`] is spent. Returns how many
    /// were looked up (or flagged).
    ///
    /// # Errors
    /// Store errors while listing due work.
    pub async fn tick(&self) -> Result<usize, StoreError> {
        use futures_util::StreamExt as _;
        let started = Instant::now();
        let mut total = 0;
        loop {
            let due = self.store.due_reconciliations(BATCH).await?;
            let n = due.len();
            let failed = std::sync::atomic::AtomicBool::new(false);
            futures_util::stream::iter(due)
                .for_each_concurrent(CONCURRENCY, |rec| {
                    let failed = &failed;
                    async move {
                        if let Err(e) = self.reconcile_one(&rec, Actor::system()).await {
                            failed.store(true, std::sync::atomic::Ordering::Relaxed);
                            tracing::warn!(tenant = %rec.tenant, error = %e, "reconciliation failed");
                        }
                    }
                })
                .await;
            total += n;
            if (n as i64) < BATCH || failed.into_inner() || started.elapsed() > PASS_BUDGET {
                return Ok(total);
            }
        }
    }

    /// Runs a pass every interval until the process ends.
    pub fn spawn_loop(self: Arc<Self>) -> tokio::task::JoinHandle<()> {
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(self.interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = tick.tick() => {}
                    () = self.wake.notified() => {}
                }
                if let Err(e) = self.tick().await {
                    tracing::warn!(error = %e, "reconciler pass failed");
                }
            }
        })
    }
}

impl std::fmt::Debug for Reconciler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reconciler").field("registry", &self.registry).finish_non_exhaustive()
    }
}
