//! The code-driven mode: your code performs the steps idem has no connector for.
//!
//! A worker starts (or attaches to) the instance, then acquires and completes each step as
//! an operation bound to the instance — the key is `{instance}:{step}`, so every answer of
//! DESIGN.md §3 applies. A worker that crashed and starts over from the top gets replays
//! (200) for the steps that finished and a grant (201) at the first unfinished one: it
//! needs to remember nothing. Steps run in order: a step cannot start before the one
//! before it SUCCEEDED, and no step starts while the instance is not RUNNING (replays of
//! finished steps are always answered). The branches of a parallel group may be acquired
//! at once (each is its own operation, `{instance}:{group}:{step}`): a branch needs only
//! the steps before its group to have SUCCEEDED, and the step after the group needs every
//! branch. A group's `max_concurrency` holds for them too: while that many branches are in
//! flight (EXECUTING under a live lease), an acquire that would start another is refused
//! ([`FlowError::GroupFull`]) and records nothing.

use crate::engine::step_names;
use crate::{FlowError, Flows};
use idem_core::flow::{
    Checkpoint, Definition, GroupFull, InstanceRecord, InstanceState, RecoveryPolicy, StepState, admit_branch,
};
use idem_core::{AcquireInput, Actor, Decision, Outcome, RetryPolicy, State};
use idem_store::{AcquireOutcome, CompleteOutcome, CompleteRequest};
use serde_json::Value;
use std::sync::Arc;

/// A step's acquire, as the API (or a library caller) sends it.
#[derive(Debug, Clone)]
pub struct StepAcquire {
    /// Tenant of the caller.
    pub tenant: String,
    /// The instance.
    pub instance_id: String,
    /// The step name.
    pub step: String,
    /// The step's payload (what the worker is about to do).
    pub payload: Value,
    /// Its fingerprint (RFC 8785 + SHA-256 of the payload or of its named fields).
    pub fingerprint: String,
    /// Lease length (ms).
    pub lease_ms: i64,
    /// The lease holder identity (see `idem_core::lease`): the same holder resending
    /// during its lease gets its own grant back.
    pub holder: Option<String>,
    /// Who acquires, through which request.
    pub actor: Actor,
}

/// A step's completion.
#[derive(Debug, Clone)]
pub struct StepComplete {
    /// Tenant of the caller.
    pub tenant: String,
    /// The instance.
    pub instance_id: String,
    /// The step name.
    pub step: String,
    /// The fencing token of the step's lease.
    pub fencing_token: i64,
    /// What happened.
    pub outcome: Outcome,
    /// Who reports.
    pub actor: Actor,
    /// Retry schedule of a retryable failure (`None`: the store's).
    pub policy: Option<RetryPolicy>,
}

/// A located step of an instance.
struct Located {
    inst: InstanceRecord,
    def: Arc<Definition>,
    checkpoints: Vec<Checkpoint>,
    index: usize,
}

impl Flows {
    /// The instance and step a caller names, checked: it exists (else 404, or 410 when its
    /// tombstone lives), has that step, and the caller's code performs it.
    async fn locate(&self, tenant: &str, instance_id: &str, step: &str) -> Result<Located, FlowError> {
        let flows = self.store.flows();
        let Some(inst) = flows.instance(tenant, instance_id).await? else {
            return Err(match flows.instance_tombstone(tenant, instance_id).await? {
                Some(t) => FlowError::Late { instance: instance_id.to_owned(), state: t.final_state },
                None => FlowError::InstanceNotFound(instance_id.to_owned()),
            });
        };
        let def = self.pinned(&inst).await?;
        let Some(index) = def.position(step) else {
            return Err(FlowError::UnknownStep {
                instance: instance_id.to_owned(),
                step: step.to_owned(),
                steps: step_names(&def),
            });
        };
        if let Some(connector) = &def.steps[index].connector {
            return Err(FlowError::IdemPerforms { step: step.to_owned(), connector: connector.clone() });
        }
        let checkpoints = flows.checkpoints(tenant, instance_id).await?;
        Ok(Located { inst, def, checkpoints, index })
    }

    /// The admission lock of instance `instance_id` of `tenant` (one of a fixed set of
    /// stripes: instances that share one wait for each other's acquires only).
    fn admission_lock(&self, tenant: &str, instance_id: &str) -> &tokio::sync::Mutex<()> {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        (tenant, instance_id).hash(&mut h);
        &self.admission[(h.finish() % self.admission.len() as u64) as usize]
    }

    /// Acquires a step your code performs (the answers of DESIGN.md §3 for its operation).
    ///
    /// A branch of a group with `max_concurrency` is checked and acquired under the
    /// instance's admission lock, on checkpoints read under it: concurrent acquires on this
    /// node admit at most the limit. (Acquires racing on several nodes in the same instant
    /// may exceed it briefly; each branch is still performed once.)
    ///
    /// # Errors
    /// [`FlowError::InstanceNotFound`], [`FlowError::Late`], [`FlowError::UnknownStep`],
    /// [`FlowError::IdemPerforms`], [`FlowError::PreviousStepUnfinished`],
    /// [`FlowError::NotRunning`] (a new grant on an instance that is not RUNNING),
    /// [`FlowError::GroupFull`], store errors.
    pub async fn acquire_step(&self, call: StepAcquire) -> Result<AcquireOutcome, FlowError> {
        let Located { inst, def, mut checkpoints, index } =
            self.locate(&call.tenant, &call.instance_id, &call.step).await?;
        let limited = def.steps[index].group.as_deref().is_some_and(|g| def.group_def(g).max_concurrency.is_some());
        let _admission = if limited {
            let guard = self.admission_lock(&call.tenant, &call.instance_id).lock().await;
            checkpoints = self.store.flows().checkpoints(&call.tenant, &call.instance_id).await?;
            Some(guard)
        } else {
            None
        };
        // The steps before this one's parallel group (or before it): its sibling branches
        // run meanwhile, so they need not have finished.
        let before = def.span(index).start;
        let earlier = def.steps.iter().zip(&checkpoints).take(before);
        if let Some((s, op)) = earlier.filter_map(|(s, c)| c.foreign_step_operation(s).map(|op| (s, op))).next() {
            // The instance pauses on it (a pass plans `step_key_conflict`).
            self.advance_in_background(&call.tenant, &call.instance_id);
            return Err(FlowError::StepKeyConflict {
                step: call.step,
                before: s.name.clone(),
                key: op.key.clone(),
                action: op.action.clone(),
            });
        }
        if let Some(before) = checkpoints[..before].iter().find(|c| c.state != StepState::Succeeded) {
            return Err(FlowError::PreviousStepUnfinished {
                step: call.step,
                before: before.row.step.clone(),
                state: before.state,
            });
        }
        let cp = &checkpoints[index];
        let would_grant = cp.operation.as_ref().is_none_or(|o| o.state == State::Pending);
        let mut state = inst.state;
        if state == InstanceState::Paused && would_grant {
            // The cause of the pause may have just been settled (a completion through
            // /v1/operations, an operator's resolution): its pass runs in the background.
            // Apply it now, so the answer does not depend on which comes first.
            state = self.advance(&call.tenant, &call.instance_id).await?.map_or(state, |i| i.state);
        }
        if state != InstanceState::Running && would_grant {
            return Err(FlowError::NotRunning { instance: call.instance_id, state });
        }
        // A sibling branch FAILED or is UNKNOWN: the group stopped, and the engine pauses,
        // compensates or fails the instance at its next pass. A branch not started yet must
        // not start meanwhile: apply that pass now, and answer as for a stopped instance.
        let span = def.span(index);
        let group_stopped = def.steps[index].group.is_some()
            && checkpoints[span].iter().any(|c| matches!(c.state, StepState::Failed | StepState::Unknown));
        if would_grant && group_stopped {
            let state = self.advance(&call.tenant, &call.instance_id).await?.map_or(state, |i| i.state);
            if state != InstanceState::Running {
                return Err(FlowError::NotRunning { instance: call.instance_id, state });
            }
        }
        let now = self.clock.now_ms();
        if let Err(GroupFull { group, max, in_flight, until_ms }) = admit_branch(&def, &checkpoints, index, now) {
            return Err(FlowError::GroupFull {
                step: call.step,
                group,
                max,
                in_flight: in_flight.join(", "),
                retry_after_ms: (until_ms - now).max(1),
            });
        }
        let step = &def.steps[index];
        let input = AcquireInput {
            tenant: call.tenant,
            key: cp.row.op_key.clone(),
            action: step.action.clone(),
            payload: call.payload,
            fingerprint: call.fingerprint,
            lease_ms: call.lease_ms,
            redo_safe: step.policy == RecoveryPolicy::RedoSafe,
            connector: None,
            holder: call.holder,
            actor: call.actor,
        };
        let out = self.store.acquire(input).await?;
        // The step just turned out UNKNOWN (its worker died): the instance pauses now, not
        // at its next scheduled look.
        if matches!(out.decision, Decision::Unknown | Decision::ExpireToUnknown) {
            self.operation_settled(&out.record.tenant, &out.record.key).await;
        }
        Ok(out)
    }

    /// Something outside the engine settled operation `key` (an operator's resolution, a
    /// completion through `/v1/operations`): if it is a workflow step, run a pass over its
    /// instance in the background, so a paused instance resumes at once.
    pub async fn operation_settled(&self, tenant: &str, key: &str) {
        if !key.contains(':') {
            return;
        }
        let step = match self.store.flows().step_of_operation(tenant, key).await {
            Ok(Some(step)) => step,
            Ok(None) => return,
            Err(e) => {
                tracing::warn!(tenant, error = %e, "cannot find the workflow step of an operation");
                return;
            }
        };
        self.advance_in_background(&step.tenant, &step.instance_id);
    }

    /// Completes a step your code performed, then advances the instance (the last step's
    /// success makes it SUCCEEDED, a final failure FAILED, an UNKNOWN outcome PAUSED).
    ///
    /// # Errors
    /// As [`Flows::acquire_step`] for locating the step; the completion's own refusals
    /// (stale fencing token, …) as [`FlowError::Store`].
    pub async fn complete_step(&self, call: StepComplete) -> Result<CompleteOutcome, FlowError> {
        let Located { def, checkpoints, index, .. } = self.locate(&call.tenant, &call.instance_id, &call.step).await?;
        let req = CompleteRequest {
            tenant: call.tenant.clone(),
            key: checkpoints[index].row.op_key.clone(),
            fencing_token: call.fencing_token,
            outcome: call.outcome,
            actor: call.actor,
            policy: call.policy,
        };
        let done = self.store.complete(req).await?;
        // A branch's completion counts as the engine counts the calls of branches it makes
        // (`kind="branch"`, the state after it); a repeated completion changed nothing.
        if done.changed && def.steps[index].group.is_some() {
            metrics::counter!("idem_workflow_branches_total", "kind" => "branch", "outcome" => done.record.state.as_str())
                .increment(1);
        }
        // The completion is recorded; the instance follows now, or at the runner's next pass.
        if let Err(e) = self.advance(&call.tenant, &call.instance_id).await {
            tracing::warn!(tenant = %call.tenant, error = %e, "workflow pass after a step completion failed");
        }
        Ok(done)
    }
}
