//! The executor: performs connector-backed operations and records their outcomes.
//!
//! - [`Executor::run_attempt`] runs one attempt of a record the caller was just granted
//!   (EXECUTING, with its fencing token): calls the connector, then completes with the
//!   connector's retry policy. The fencing token guards the completion: if the lease was
//!   lost meanwhile, the completion is refused and nothing is overwritten.
//! - [`Executor::spawn_loop`] is the durable worker: it polls the store for due retries
//!   (PENDING with `next_attempt_at` passed; EXECUTING `redo_safe` operations whose lease
//!   expired), takes a token from the connector's retry budget, acquires the operation like
//!   any trigger (so two nodes never run the same attempt), and runs it. Because the
//!   schedule lives in the store, due retries resume after a restart. A workflow step's
//!   PENDING retry whose instance compensates is left alone: the engine closes it instead.

use crate::connector::OperationCtx;
use crate::registry::Registry;
use idem_core::{AcquireInput, Actor, Clock, Decision, OperationRecord};
use idem_store::{CompleteRequest, Store, StoreError};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Semaphore;

/// Runs connector attempts for one node.
pub struct Executor {
    store: Arc<dyn Store>,
    registry: Arc<Registry>,
    clock: Arc<dyn Clock>,
    slots: Arc<Semaphore>,
    poll_interval: Duration,
}

/// The context a connector sees for `rec`, at `now_ms` on the ledger's clock.
pub fn ctx_of(rec: &OperationRecord, now_ms: i64) -> OperationCtx {
    OperationCtx {
        tenant: rec.tenant.clone(),
        key: rec.key.clone(),
        action: rec.action.clone(),
        payload: rec.payload.clone(),
        fencing_token: rec.fencing_token,
        attempt: rec.attempt_count,
        updated_at: rec.updated_at,
        now_ms,
    }
}

impl Executor {
    /// An executor with `concurrency` attempts in flight at most, judging leases on
    /// `clock` (the ledger's: the one the store reads).
    pub fn new(
        store: Arc<dyn Store>,
        registry: Arc<Registry>,
        clock: Arc<dyn Clock>,
        concurrency: usize,
        poll_interval: Duration,
    ) -> Self {
        Executor { store, registry, clock, slots: Arc::new(Semaphore::new(concurrency.max(1))), poll_interval }
    }

    /// The registry this executor runs on.
    pub fn registry(&self) -> &Arc<Registry> {
        &self.registry
    }

    /// Runs one attempt of `granted` (EXECUTING, just acquired) and returns the record as
    /// stored afterwards.
    ///
    /// # Errors
    /// Store errors while completing (the attempt's outcome is then not recorded; the lease
    /// expires into UNKNOWN and the reconciler settles it).
    pub async fn run_attempt(&self, granted: OperationRecord) -> Result<OperationRecord, StoreError> {
        let Some(name) = granted.connector.clone() else {
            return Ok(granted);
        };
        let now = self.clock.now_ms();
        let ctx = ctx_of(&granted, now);
        let (outcome, policy) = match self.registry.get(&name) {
            // Too little of the lease is left for a whole call (it waited for a free slot):
            // do not start; nothing was sent, so a retry is safe.
            // The configuration no longer lets this tenant use the connector (changed since
            // the operation was made): nothing is sent, as when the connector is gone.
            Some(entry) if !entry.allows(&granted.tenant) => (
                crate::connector::retryable(
                    "not_allowed",
                    format!(
                        "connector {name:?} does not serve tenant {:?} (connectors.{name}.tenants = {})",
                        granted.tenant,
                        entry.tenants.describe()
                    ),
                    Some(60_000),
                ),
                Some(entry.policy.clone()),
            ),
            Some(entry) if granted.lease_expires_at.is_some_and(|end| end - now < entry.connector.max_call_ms()) => (
                crate::connector::retryable("not_started", "the lease ran short before the call could start", Some(0)),
                Some(entry.policy.clone()),
            ),
            Some(entry) => {
                crate::crash::crash_point("executor.before_call", &ctx.key);
                let outcome = entry.connector.execute(&ctx).await;
                crate::crash::crash_point("executor.after_call", &ctx.key);
                // Calls that reached the connector (not the ones refused before starting).
                let labels = [("connector", name.clone())];
                metrics::counter!("idem_connector_attempts_total", &labels).increment(1);
                if ctx.attempt > 1 {
                    metrics::counter!("idem_connector_retries_total", &labels).increment(1);
                }
                (outcome, Some(entry.policy.clone()))
            }
            // Nothing was sent: the connector is gone from the config.
            None => (
                crate::connector::retryable(
                    "no_connector",
                    format!("connector {name:?} is not configured on this node"),
                    Some(60_000),
                ),
                None,
            ),
        };
        tracing::info!(
            tenant = %ctx.tenant,
            key_hash = %idem_core::key::log_hash(&granted.key),
            connector = %name,
            attempt = ctx.attempt,
            outcome = outcome.name(),
            "attempt finished"
        );
        self.record(granted, outcome, policy).await
    }

    /// Ends the attempt of `granted` (EXECUTING, just acquired) without calling the
    /// provider: nothing was sent, so it is recorded as a retryable failure of class
    /// `class` due at once (the operation goes back to PENDING; whoever decides about it
    /// next — a retry, or a workflow's compensation closing it — sees that nothing
    /// happened). Returns the record as stored afterwards.
    ///
    /// # Errors
    /// Store errors while completing (the lease then expires: PENDING again under
    /// `redo_safe`, else UNKNOWN, which the reconciler's lookup settles).
    pub async fn decline_attempt(
        &self,
        granted: OperationRecord,
        class: &str,
        message: String,
    ) -> Result<OperationRecord, StoreError> {
        let policy = granted.connector.as_deref().and_then(|n| self.registry.get(n)).map(|e| e.policy.clone());
        tracing::info!(
            tenant = %granted.tenant,
            key_hash = %idem_core::key::log_hash(&granted.key),
            class,
            "attempt not started"
        );
        self.record(granted, crate::connector::retryable(class, message, Some(0)), policy).await
    }

    /// Completes `granted` with `outcome` under its fencing token; the record as stored
    /// afterwards (read back when the completion is refused: another writer came first).
    async fn record(
        &self,
        granted: OperationRecord,
        outcome: idem_core::Outcome,
        policy: Option<idem_core::RetryPolicy>,
    ) -> Result<OperationRecord, StoreError> {
        let req = CompleteRequest {
            tenant: granted.tenant.clone(),
            key: granted.key.clone(),
            fencing_token: granted.fencing_token,
            outcome: outcome.into_storable(),
            actor: Actor::executor(),
            policy,
        };
        match self.store.complete(req).await {
            Ok(done) => Ok(done.record),
            Err(StoreError::Complete(e)) => {
                tracing::warn!(tenant = %granted.tenant, error = %e, "attempt's completion refused");
                self.store.get(&granted.tenant, &granted.key).await.map(|r| r.unwrap_or(granted))
            }
            Err(e) => Err(e),
        }
    }

    /// Runs [`Executor::run_attempt`] in its own task (it finishes even if the caller
    /// stops waiting), bounded by the concurrency limit.
    pub fn spawn_attempt(
        self: &Arc<Self>,
        granted: OperationRecord,
    ) -> tokio::task::JoinHandle<Result<OperationRecord, StoreError>> {
        self.spawn_with(granted, None)
    }

    fn spawn_with(
        self: &Arc<Self>,
        granted: OperationRecord,
        slot: Option<tokio::sync::OwnedSemaphorePermit>,
    ) -> tokio::task::JoinHandle<Result<OperationRecord, StoreError>> {
        let this = self.clone();
        tokio::spawn(async move {
            // A trigger's attempt may wait here for a slot; run_attempt then checks that
            // enough of its lease is left before it calls the provider.
            let _slot = match slot {
                Some(s) => s,
                None => this.slots.clone().acquire_owned().await.expect("the semaphore is never closed"),
            };
            this.run_attempt(granted).await
        })
    }

    /// One pass over due work; returns how many attempts were started.
    ///
    /// # Errors
    /// Store errors while listing due work.
    pub async fn tick(self: &Arc<Self>) -> Result<usize, StoreError> {
        let mut started = 0;
        // Each connector gets its own queue: one connector's outage (or an empty budget)
        // must not hold back another's retries.
        for name in self.registry.names().map(str::to_owned).collect::<Vec<_>>() {
            let Some(entry) = self.registry.get(&name).filter(|e| e.executes) else {
                continue;
            };
            let free = self.slots.available_permits().min(64) as i64;
            if free == 0 {
                break;
            }
            for rec in self.store.due_executions(&name, free).await? {
                // A retry (PENDING) is left alone while its workflow instance compensates;
                // a `redo_safe` operation whose lease lapsed is still re-granted: the
                // compensation waits for that attempt, and nothing else would end it.
                if rec.state == idem_core::State::Pending && self.instance_compensates(&rec).await? {
                    continue;
                }
                // Take a slot before the lease, so a granted lease never waits for one.
                let Ok(slot) = self.slots.clone().try_acquire_owned() else {
                    return Ok(started);
                };
                if !entry.budget.try_take() {
                    tracing::debug!(connector = %entry.name, "retry budget exhausted; retries deferred");
                    break;
                }
                let input = AcquireInput {
                    tenant: rec.tenant.clone(),
                    key: rec.key.clone(),
                    action: rec.action.clone(),
                    payload: rec.payload.clone(),
                    fingerprint: rec.fingerprint.clone(),
                    lease_ms: entry.connector.lease_ms(),
                    redo_safe: rec.redo_safe,
                    connector: rec.connector.clone(),
                    holder: None,
                    actor: Actor::executor(),
                };
                let out = self.store.acquire(input).await?;
                if out.decision == Decision::Acquire {
                    self.spawn_with(out.record, Some(slot));
                    started += 1;
                }
            }
        }
        Ok(started)
    }

    /// Whether `rec` is a workflow step's (or item's) operation whose instance compensates
    /// (COMPENSATING, or PAUSED during its compensation): its retry is not performed — an
    /// effect started now would only be undone, or could not be — and the workflow engine
    /// closes it (FAILED) before compensating. Step keys always hold a ':'.
    async fn instance_compensates(&self, rec: &OperationRecord) -> Result<bool, StoreError> {
        if !rec.key.contains(':') {
            return Ok(false);
        }
        let flows = self.store.flows();
        let Some(step) = flows.step_of_operation(&rec.tenant, &rec.key).await? else { return Ok(false) };
        let Some(inst) = flows.instance(&step.tenant, &step.instance_id).await? else { return Ok(false) };
        Ok(inst.compensates())
    }

    /// Polls for due work every poll interval until the process ends.
    pub fn spawn_loop(self: Arc<Self>) -> tokio::task::JoinHandle<()> {
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(self.poll_interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                if let Err(e) = self.tick().await {
                    tracing::warn!(error = %e, "executor pass failed");
                }
            }
        })
    }
}

impl std::fmt::Debug for Executor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Executor").field("registry", &self.registry).finish_non_exhaustive()
    }
}
