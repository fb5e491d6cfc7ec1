//! The durable loop: every interval, claim the instances whose `next_run_at` has come
//! (across tenants and nodes; a claim holds an instance for `hold_ms`, the
//! `[executor] workflow_hold_ms` setting) and run a
//! pass over each, at most `concurrency` at once. Because every instance that is not
//! finished has a `next_run_at`, a restarted node resumes every RUNNING instance from its
//! checkpoints, and a node that died mid-pass leaves its instances to the others once the
//! hold runs out. Paused instances are looked at now and then, to resume once their step
//! has been resolved.

use crate::Flows;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Semaphore;

impl Flows {
    /// One pass of the runner: claims up to `limit` due instances and runs a pass over
    /// each (concurrently, bounded by `slots`). Returns how many were claimed.
    ///
    /// # Errors
    /// A store error while claiming.
    pub async fn tick(self: &Arc<Self>, slots: &Arc<Semaphore>, hold_ms: i64) -> Result<usize, idem_store::StoreError> {
        let free = slots.available_permits().min(256) as i64;
        if free == 0 {
            return Ok(0);
        }
        let due = self.store.flows().claim_due_instances(free, hold_ms).await?;
        let n = due.len();
        for inst in due {
            let Ok(slot) = slots.clone().try_acquire_owned() else { break };
            let this = self.clone();
            tokio::spawn(async move {
                let _slot = slot;
                if let Err(e) = this.advance(&inst.tenant, &inst.instance_id).await {
                    tracing::warn!(tenant = %inst.tenant, workflow = %inst.workflow, error = %e, "workflow pass failed");
                }
            });
        }
        Ok(n)
    }

    /// Runs [`Flows::tick`] every `interval` until the process ends, with at most
    /// `concurrency` passes in flight, each holding its instance for `hold`.
    pub fn spawn_runner(
        self: Arc<Self>,
        interval: Duration,
        concurrency: usize,
        hold: Duration,
    ) -> tokio::task::JoinHandle<()> {
        let hold_ms = i64::try_from(hold.as_millis()).unwrap_or(i64::MAX).max(1);
        // A start that runs its instance's first pass holds it as long as a claim would.
        self.start_hold_ms.store(hold_ms, std::sync::atomic::Ordering::Relaxed);
        let slots = Arc::new(Semaphore::new(concurrency.max(1)));
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                if let Err(e) = self.tick(&slots, hold_ms).await {
                    tracing::warn!(error = %e, "workflow runner pass failed");
                }
            }
        })
    }
}
