//! What an operator does to an instance (DESIGN.md §8): preview and run a guarded re-run,
//! or ask for compensation. Both need the `operator` role (the HTTP layer checks it) and a
//! reason, which is kept in the instance's events with who asked.

use crate::{FlowError, Flows};
use idem_core::Actor;
use idem_core::flow::{
    Checkpoint, Definition, InstanceRecord, RerunPlan, StepDisposition, plan_operator_compensation, plan_rerun,
    plan_rerun_apply,
};
use idem_store::flow::InstanceUpdate;
use std::sync::Arc;

/// Longest operator reason, in bytes (as for resolutions).
pub const MAX_REASON_LEN: usize = 2_000;

/// Checks an operator's reason: not blank, at most [`MAX_REASON_LEN`] bytes, no NUL.
///
/// # Errors
/// [`FlowError::MissingReason`] or [`FlowError::Invalid`].
pub fn check_reason(reason: &str) -> Result<(), FlowError> {
    if reason.trim().is_empty() {
        return Err(FlowError::MissingReason);
    }
    if reason.len() > MAX_REASON_LEN || reason.contains('\0') {
        return Err(FlowError::Invalid(format!("the reason must be at most {MAX_REASON_LEN} bytes, without U+0000")));
    }
    Ok(())
}

impl Flows {
    /// The instance, its pinned definition and its checkpoints (404/410 when missing).
    async fn load(
        &self,
        tenant: &str,
        id: &str,
    ) -> Result<(InstanceRecord, Arc<Definition>, Vec<Checkpoint>), FlowError> {
        let flows = self.store.flows();
        let Some(inst) = flows.instance(tenant, id).await? else {
            return Err(match flows.instance_tombstone(tenant, id).await? {
                Some(t) => FlowError::Late { instance: id.to_owned(), state: t.final_state },
                None => FlowError::InstanceNotFound(id.to_owned()),
            });
        };
        let def = self.pinned(&inst).await?;
        let checkpoints = flows.checkpoints(tenant, id).await?;
        Ok((inst, def, checkpoints))
    }

    /// Whether connector `name` can look effects up.
    fn looks_up(&self, name: &str) -> bool {
        self.registry.get(name).is_some_and(|e| e.connector.can_look_up())
    }

    /// The dry run: what a re-run of instance `id` redoing `named` (none: from where it
    /// stopped) would do, step by step, with its hash. Changes nothing.
    ///
    /// # Errors
    /// [`FlowError::Rerun`] with the refusal; not found, late, store errors.
    pub async fn preview_rerun(&self, tenant: &str, id: &str, named: &[String]) -> Result<RerunPlan, FlowError> {
        let (inst, def, checkpoints) = self.load(tenant, id).await?;
        Ok(plan_rerun(&inst, &def, &checkpoints, named, &|c| self.looks_up(c))?)
    }

    /// Runs a re-run: plans it again, refuses it when `approved` (a plan hash the operator
    /// saw) is not the plan now, writes the instance and the step rows in one transaction
    /// (only if the instance is still at the planned version), asks the provider now for
    /// the steps to look up first, and starts a pass.
    ///
    /// # Errors
    /// [`FlowError::MissingReason`], [`FlowError::Rerun`] (including `PlanChanged`), not
    /// found, late, store errors.
    pub async fn rerun(
        &self,
        tenant: &str,
        id: &str,
        named: &[String],
        approved: Option<&str>,
        reason: &str,
        actor: &Actor,
    ) -> Result<(RerunPlan, InstanceRecord), FlowError> {
        check_reason(reason)?;
        // The runner's bookkeeping (a PAUSED instance's next look) moves the instance's
        // version without changing the plan: when the conditional write loses to it, plan
        // again and write if the plan is still the one approved.
        let mut lost = None;
        for _ in 0..OPERATOR_WRITE_TRIES {
            let (inst, def, checkpoints) = self.load(tenant, id).await?;
            let plan = plan_rerun(&inst, &def, &checkpoints, named, &|c| self.looks_up(c))?;
            let approved = approved.or(lost.as_deref());
            let now = self.clock.now_ms();
            let (record, event) = plan_rerun_apply(&inst, &plan, approved, reason, actor, now)?;
            let keys: Vec<(i64, String, String)> = plan
                .steps
                .iter()
                .zip(&checkpoints)
                .filter(|(p, c)| p.op_key != c.row.op_key || p.comp_key != c.row.comp_key)
                .map(|(p, c)| (c.row.position, p.op_key.clone(), p.comp_key.clone()))
                .collect();
            // The items of a step for each item, planned in their stored order.
            let item_keys: Vec<(i64, String, String, String)> = plan
                .steps
                .iter()
                .zip(&checkpoints)
                .flat_map(|(p, c)| p.items.iter().zip(&c.items))
                .filter(|(p, i)| p.op_key != i.row.op_key || p.comp_key != i.row.comp_key)
                .map(|(p, i)| (i.row.position, i.row.item.clone(), p.op_key.clone(), p.comp_key.clone()))
                .collect();
            let superseded = idem_core::flow::plan_superseded(&def, &plan, &checkpoints, reason, actor, now);
            let update = InstanceUpdate { record: record.clone(), read_version: inst.version, events: vec![event] };
            let write = idem_store::flow::RerunWrite { update, keys, item_keys, superseded };
            if self.store.flows().apply_rerun(write).await? {
                return self.after_rerun(tenant, id, actor, plan, checkpoints, record).await;
            }
            // Without an approved hash, the plan first made is the one the caller asked for.
            lost = Some(plan.hash);
        }
        let now = self.preview_rerun(tenant, id, named).await.map(|p| p.hash).unwrap_or_default();
        Err(FlowError::Rerun(idem_core::flow::RerunRefusal::PlanChanged {
            approved: approved.map(str::to_owned).or(lost).unwrap_or_default(),
            now,
        }))
    }

    /// After a re-run was written: count it, ask the providers of the steps (and items) to
    /// look up first, and start a pass.
    async fn after_rerun(
        &self,
        tenant: &str,
        id: &str,
        actor: &Actor,
        plan: RerunPlan,
        checkpoints: Vec<Checkpoint>,
        record: InstanceRecord,
    ) -> Result<(RerunPlan, InstanceRecord), FlowError> {
        metrics::counter!("idem_workflow_reruns_total").increment(1);
        // (disposition, planned compensation key, checkpoint) of every step and item.
        let mut lines = Vec::new();
        for (p, c) in plan.steps.iter().zip(&checkpoints) {
            match p.items.is_empty() {
                true => lines.push((p.disposition, p.comp_key.as_str(), c.clone())),
                false => lines.extend(
                    p.items
                        .iter()
                        .zip(&c.items)
                        .map(|(i, ic)| (i.disposition, i.comp_key.as_str(), ic.as_checkpoint())),
                ),
            }
        }
        for (disposition, comp_key, c) in lines {
            if disposition != StepDisposition::LookedUp {
                continue;
            }
            let op =
                if comp_key != c.row.comp_key || c.compensation.is_some() { &c.compensation } else { &c.operation };
            if let Some(op) = op
                && let Err(e) = self.reconciler.reconcile_one(op, actor.clone()).await
            {
                tracing::warn!(tenant, error = %e, "re-run: the lookup failed; the reconciler tries again");
            }
        }
        self.advance_in_background(tenant, id);
        Ok((plan, record))
    }

    /// An operator asks to compensate instance `id` (FAILED, or PAUSED before any
    /// compensation): it turns COMPENSATING and a pass starts.
    ///
    /// # Errors
    /// [`FlowError::MissingReason`], [`FlowError::Compensation`], not found, late, store
    /// errors.
    pub async fn compensate(
        &self,
        tenant: &str,
        id: &str,
        reason: &str,
        actor: &Actor,
    ) -> Result<InstanceRecord, FlowError> {
        check_reason(reason)?;
        // As for re-runs: a write lost to the runner's bookkeeping is planned again; one
        // lost to another operator's request is refused as that request left it (409).
        for _ in 0..OPERATOR_WRITE_TRIES {
            let (inst, def, checkpoints) = self.load(tenant, id).await?;
            let (record, event) =
                plan_operator_compensation(&inst, &def, &checkpoints, reason, actor, self.clock.now_ms())?;
            let update = InstanceUpdate { record: record.clone(), read_version: inst.version, events: vec![event] };
            if self.store.flows().update_instance(update).await? {
                self.advance_in_background(tenant, id);
                return Ok(record);
            }
        }
        Err(FlowError::Busy(id.to_owned()))
    }
}

/// How often an operator's conditional write is planned again after losing to another
/// writer before the request is refused.
const OPERATOR_WRITE_TRIES: usize = 5;
