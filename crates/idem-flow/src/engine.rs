//! One pass for one instance: read → `plan_advance` → perform that one [`Next`] → write →
//! plan again, until the instance waits, pauses or finishes.
//!
//! A step idem performs goes through the ledger's own claim: the engine *acquires* the
//! step's operation (`{instance}:{step}`) like any trigger, and only a grant (201) leads to
//! a call, made by idem-connect's executor, which completes the operation with its fencing
//! token. So two passes on two nodes, or a pass racing the executor's retry loop, never
//! perform a step twice, and a finished step replays instead of running. Nothing here is
//! remembered between passes: every decision is made from the stored checkpoints.

use crate::{FlowError, Flows};
use idem_core::flow::StepRow;
use idem_core::flow::{
    Checkpoint, Definition, InstanceRecord, InstanceState, ItemCheckpoint, Next, RecoveryPolicy, StepDef, plan_advance,
    plan_instance_update,
};
use idem_core::{AcquireInput, Actor, Decision, State};
use idem_store::flow::{InstanceUpdate, StartOutcome};
use idem_store::{ResolveRequest, StoreError};
use serde_json::Value;

/// How long to wait before looking again at a step whose connector is not configured on
/// this node (ms).
const NO_CONNECTOR_WAIT_MS: i64 = 60_000;

/// An operation the engine performs: a step, or a step's compensation.
#[derive(Debug, Clone, Copy)]
struct Job<'a> {
    /// The step's index.
    index: usize,
    /// The operation's key.
    key: &'a str,
    /// Its action.
    action: &'a str,
    /// The connector that performs it.
    connector: &'a str,
    /// Whether an expired lease is re-granted (policy `redo_safe`).
    redo_safe: bool,
    /// `step`, `branch` (of a parallel group), `item` (of a step for each item) or
    /// `compensation`, for metrics.
    kind: &'static str,
}

impl<'a> Job<'a> {
    /// Step `step` (a connector step: `plan_advance` runs no other), or an item of it,
    /// under operation key `key`.
    fn step(step: &'a StepDef, index: usize, key: &'a str) -> Self {
        Job {
            index,
            key,
            action: &step.action,
            connector: step.connector.as_deref().unwrap_or_default(),
            redo_safe: step.policy == RecoveryPolicy::RedoSafe,
            kind: match (&step.group, &step.for_each) {
                (Some(_), _) => "branch",
                (None, Some(_)) => "item",
                (None, None) => "step",
            },
        }
    }

    /// The compensation of `step` (or of an item of it) under key `key`, if it has one with
    /// a connector.
    fn compensation(step: &'a StepDef, index: usize, key: &'a str) -> Option<Self> {
        let comp = step.compensation.as_ref()?;
        Some(Job {
            index,
            key,
            action: &comp.action,
            connector: comp.connector.as_deref()?,
            redo_safe: false,
            kind: "compensation",
        })
    }
}

/// Where an operation's record goes in the checkpoints: step `index`'s (or its item
/// `item`'s) operation, or its compensation's.
struct Target {
    index: usize,
    item: Option<String>,
    compensation: bool,
}

impl Target {
    /// Puts `op` where it belongs, deriving the states again.
    fn record(self, checkpoints: &mut [Checkpoint], op: Box<idem_core::OperationRecord>) {
        let cp = &mut checkpoints[self.index];
        let put = |operation: &mut Option<idem_core::OperationRecord>,
                   comp: &mut Option<idem_core::OperationRecord>| {
            if self.compensation { *comp = Some(*op) } else { *operation = Some(*op) }
        };
        match &self.item {
            None => {
                let (mut operation, mut comp) = (cp.operation.take(), cp.compensation.take());
                put(&mut operation, &mut comp);
                let items = std::mem::take(&mut cp.items);
                *cp = Checkpoint::with_compensation(cp.row.clone(), operation, comp);
                cp.items = items;
            }
            Some(id) => {
                let mut items = std::mem::take(&mut cp.items);
                if let Some(i) = items.iter_mut().find(|i| &i.row.item == id) {
                    let (mut operation, mut comp) = (i.operation.take(), i.compensation.take());
                    put(&mut operation, &mut comp);
                    *i = ItemCheckpoint::of(i.row.clone(), operation, comp);
                }
                *cp = Checkpoint::with_items(cp.row.clone(), items);
            }
        }
    }
}

/// What a round of a pass does next, after performing what it planned.
enum Round {
    /// Something progressed (the checkpoints are updated): plan again.
    Again,
    /// Nothing can move now: write this and end the pass.
    Write(Next),
    /// What this pass knows is stale (another pass changed the instance): read it again.
    Reread,
}

/// What one attempt at a `Run`, `Compensate` or `Redo` led to.
enum Attempt {
    /// The operation moved (or was found finished): its record as stored now.
    Done(Target, Box<idem_core::OperationRecord>),
    /// An UNKNOWN `redo_safe` operation was moved back to PENDING.
    Redone,
    /// It cannot move now: write this.
    Blocked(Next),
    /// Not started: the instance changed under this pass (see [`StepRun::Stale`]).
    Stale,
}

/// What performing a `Run` or a `Compensate` led to.
enum StepRun {
    /// The step's operation moved (or was found finished): plan again from its record as
    /// stored now.
    Progressed(Box<idem_core::OperationRecord>),
    /// The step cannot move now: write this and end the pass.
    Blocked(Next),
    /// Not started: the instance began compensating since this pass read it, and the
    /// granted attempt was declined (nothing sent): read the instance again.
    Stale,
}

impl Flows {
    /// Runs one pass over instance `instance_id` of `tenant` and returns it as stored
    /// afterwards (`None` if there is no such instance).
    ///
    /// # Errors
    /// Store errors (the pass stops; the runner tries again later), corruption
    /// ([`FlowError::DefinitionMismatch`], [`FlowError::DefinitionMissing`]).
    pub async fn advance(&self, tenant: &str, instance_id: &str) -> Result<Option<InstanceRecord>, FlowError> {
        self.advance_from(tenant, instance_id, None).await
    }

    /// [`Flows::advance`] for an instance just created by `started` (its checkpoints are
    /// known: no step has run), without reading it back first. Stale knowledge is safe:
    /// a step that ran meanwhile replays, and instance writes are conditional.
    ///
    /// # Errors
    /// As [`Flows::advance`].
    pub async fn advance_started(&self, started: &StartOutcome) -> Result<Option<InstanceRecord>, FlowError> {
        let inst = started.instance.clone();
        let def = self.pinned(&inst).await?;
        let rows = StepRow::all_of(&inst.tenant, &inst.instance_id, &def);
        let checkpoints = rows.into_iter().map(|r| Checkpoint::of(r, None)).collect();
        let (tenant, id) = (inst.tenant.clone(), inst.instance_id.clone());
        self.advance_from(&tenant, &id, Some((inst, checkpoints))).await
    }

    /// One pass starting from `known` (or from a read).
    async fn advance_from(
        &self,
        tenant: &str,
        instance_id: &str,
        mut known: Option<(InstanceRecord, Vec<Checkpoint>)>,
    ) -> Result<Option<InstanceRecord>, FlowError> {
        let flows = self.store.flows();
        // What this pass knows: read at first (unless given), and again whenever another
        // writer may have changed it (a conditional write lost, a step answered from
        // elsewhere). Its own writes it keeps as written: a step's record as the executor
        // stored it, the instance as `update_instance` wrote it, so a step costs no extra
        // reads.
        // Each round performs one step or writes the instance; a pass never loops forever.
        for _ in 0..64 {
            let (inst, mut checkpoints) = match known.take() {
                Some(k) => k,
                None => {
                    let Some(inst) = flows.instance(tenant, instance_id).await? else {
                        return Ok(None);
                    };
                    let checkpoints = flows.checkpoints(tenant, instance_id).await?;
                    (inst, checkpoints)
                }
            };
            let def = self.pinned(&inst).await?;
            let now = self.clock.now_ms();
            let next = plan_advance(&inst, &def, &checkpoints, now)?;
            let next = match next {
                Next::Run { .. }
                | Next::Compensate { .. }
                | Next::Redo { .. }
                | Next::Abandon { .. }
                | Next::Item { .. } => match self.perform(&inst, &def, &mut checkpoints, next).await? {
                    Round::Again => {
                        known = Some((inst, checkpoints));
                        continue;
                    }
                    Round::Reread => continue,
                    Round::Write(next) => next,
                },
                Next::Parallel { runs } => match self.run_branches(&inst, &def, &mut checkpoints, runs).await? {
                    Round::Again => {
                        known = Some((inst, checkpoints));
                        continue;
                    }
                    Round::Reread => continue,
                    Round::Write(next) => next,
                },
                Next::PlanItems { items, .. } => {
                    // Written once (identical rows from another pass change nothing); then
                    // read back with their operations.
                    flows.add_items(items).await?;
                    continue;
                }
                other => other,
            };
            let Some((record, events)) = plan_instance_update(&inst, &def, &next, &Actor::system(), now) else {
                return Ok(Some(inst));
            };
            let update = InstanceUpdate { record: record.clone(), read_version: inst.version, events };
            if !flows.update_instance(update).await? {
                // Another pass (or a start, or the runner's claim) changed it: read again.
                continue;
            }
            count(&inst, &record);
            if matches!(next, Next::BeginCompensation { .. }) {
                // Read the checkpoints again, after COMPENSATING is written: a step another
                // pass acquired since this one read them is then seen in flight (and waited
                // for); one acquired later sees the compensation and is not started.
                let checkpoints = flows.checkpoints(tenant, instance_id).await?;
                known = Some((record, checkpoints));
                continue;
            }
            if matches!(next, Next::Resume { .. }) {
                known = Some((record, checkpoints));
                continue;
            }
            return Ok(Some(record));
        }
        Ok(flows.instance(tenant, instance_id).await?)
    }

    /// Runs [`Flows::advance`] in its own task (a failed pass is logged; the runner tries
    /// the instance again when it is due).
    pub fn advance_in_background(&self, tenant: &str, instance_id: &str) {
        let Some(me) = self.me.upgrade() else { return };
        let (tenant, id) = (tenant.to_owned(), instance_id.to_owned());
        tokio::spawn(async move {
            if let Err(e) = me.advance(&tenant, &id).await {
                tracing::warn!(tenant = %tenant, error = %e, "workflow pass failed; the runner retries it");
            }
        });
    }

    /// Runs [`Flows::advance_started`] in its own task.
    pub fn advance_started_in_background(&self, started: StartOutcome) {
        let Some(me) = self.me.upgrade() else { return };
        tokio::spawn(async move {
            if let Err(e) = me.advance_started(&started).await {
                let tenant = &started.instance.tenant;
                tracing::warn!(tenant = %tenant, error = %e, "workflow pass failed; the runner retries it");
            }
        });
    }

    /// Acquires the operation of `job` with `payload` and, when granted, performs it with
    /// the job's connector (through the executor, which completes it with its token).
    async fn run_operation(&self, inst: &InstanceRecord, job: Job<'_>, payload: Value) -> Result<StepRun, FlowError> {
        let now = self.clock.now_ms();
        let index = job.index;
        let Some(entry) = self.registry.get(job.connector).filter(|e| e.executes) else {
            tracing::warn!(
                workflow = %inst.workflow, key_hash = %idem_core::key::log_hash(job.key), connector = job.connector,
                "the connector is not configured on this node; the instance waits"
            );
            return Ok(StepRun::Blocked(Next::Wait { index, until_ms: now + NO_CONNECTOR_WAIT_MS }));
        };
        // A step fingerprint: no trigger made under this key by anyone else can match it.
        let fingerprint = idem_core::fingerprint(&payload, None).map_err(|e| FlowError::Invalid(e.to_string()))?.0;
        let fingerprint = idem_core::flow::step_fingerprint(job.key, &fingerprint);
        let input = AcquireInput {
            tenant: inst.tenant.clone(),
            key: job.key.to_owned(),
            action: job.action.to_owned(),
            payload,
            fingerprint,
            lease_ms: entry.connector.lease_ms(),
            redo_safe: job.redo_safe,
            connector: Some(job.connector.to_owned()),
            // Connector operations keep no holder: a resend must never start a second call.
            holder: None,
            actor: Actor::executor(),
        };
        let out = self.store.acquire(input).await?;
        Ok(match out.decision {
            Decision::Acquire if job.kind != "compensation" && self.began_compensating(inst).await? => {
                let message = format!(
                    "not started: workflow instance {:?} began compensating before this attempt could start (nothing was sent)",
                    inst.instance_id
                );
                self.executor.decline_attempt(out.record, "not_started", message).await?;
                StepRun::Stale
            }
            Decision::Acquire => {
                let started = std::time::Instant::now();
                let done = self.executor.run_attempt(out.record).await?;
                metrics::histogram!("idem_workflow_step_seconds", "kind" => job.kind)
                    .record(started.elapsed().as_secs_f64());
                if matches!(job.kind, "branch" | "item") {
                    metrics::counter!("idem_workflow_branches_total", "kind" => job.kind, "outcome" => done.state.as_str())
                        .increment(1);
                }
                idem_connect::crash::crash_point("flow.after_step", job.key);
                StepRun::Progressed(Box::new(done))
            }
            Decision::InProgress { retry_after_ms } | Decision::RetryNotDue { retry_after_ms } => {
                StepRun::Blocked(Next::Wait { index, until_ms: now + retry_after_ms.max(1) })
            }
            // Never for a connector operation (it keeps no holder); if it were, the lease is held.
            Decision::AlreadyHeld => StepRun::Blocked(Next::Wait {
                index,
                until_ms: out.record.lease_expires_at.unwrap_or(now).max(now + 1),
            }),
            Decision::Replay | Decision::Unknown | Decision::ExpireToUnknown => {
                StepRun::Progressed(Box::new(out.record))
            }
            Decision::Mismatch | Decision::Late => StepRun::Blocked(Next::Pause {
                index,
                class: "step_key_conflict",
                reason: format!(
                    "the operation key {:?} is taken by another operation (action {:?}, connector {:?}, fingerprint {}; or one removed after retention): it does not count as this step's result — re-run the instance naming the step to perform it under a new key",
                    job.key,
                    out.record.action,
                    out.record.connector.as_deref().unwrap_or("none"),
                    out.record.fingerprint.get(..12).unwrap_or(&out.record.fingerprint),
                ),
            }),
        })
    }

    /// Whether `inst` compensates as stored now, although this pass planned a forward step
    /// from an older read: another pass (the runner's, an operator's `wf compensate`) may
    /// have begun the compensation since. Read after the step's operation was granted, so
    /// either that pass's reading of the checkpoints (after it wrote COMPENSATING) sees the
    /// operation in flight and waits for it, or this read sees the compensation and the
    /// attempt is not started: nothing new is performed while an instance compensates.
    async fn began_compensating(&self, inst: &InstanceRecord) -> Result<bool, FlowError> {
        if inst.compensates() {
            return Ok(true);
        }
        let now = self.store.flows().instance(&inst.tenant, &inst.instance_id).await?;
        Ok(now.is_some_and(|i| i.compensates()))
    }

    /// Performs the branches of a parallel group at once (each its own operation: a grant
    /// leads to a call, anything else is read from its record), and redoes the UNKNOWN
    /// `redo_safe` ones. Updates `checkpoints` with what progressed: [`Round::Reread`] when
    /// an attempt was declined because the instance began compensating, else
    /// [`Round::Again`] when something progressed, else what to write: a pause if one
    /// branch's key holds another operation, else the earliest wait.
    async fn run_branches(
        &self,
        inst: &InstanceRecord,
        def: &Definition,
        checkpoints: &mut [Checkpoint],
        runs: Vec<Next>,
    ) -> Result<Round, FlowError> {
        let results = {
            let (cps, me) = (&*checkpoints, self);
            let jobs = runs.into_iter().map(|run| async move { me.attempt(inst, def, cps, run).await });
            futures_util::future::join_all(jobs).await
        };
        let mut progressed = false;
        let mut stale = false;
        let mut blocked: Option<Next> = None;
        for result in results {
            match result? {
                Attempt::Done(target, op) => {
                    target.record(checkpoints, op);
                    progressed = true;
                }
                Attempt::Redone => progressed = true,
                Attempt::Stale => stale = true,
                Attempt::Blocked(next) => {
                    let earlier = |n: &Next| match n {
                        Next::Wait { until_ms, .. } => *until_ms,
                        _ => i64::MIN,
                    };
                    if blocked.as_ref().is_none_or(|b| earlier(&next) < earlier(b)) {
                        blocked = Some(next);
                    }
                }
            }
        }
        Ok(if stale {
            Round::Reread
        } else if progressed {
            Round::Again
        } else {
            blocked.map_or(Round::Again, Round::Write)
        })
    }

    /// Performs one `Run`, `Compensate` or `Redo` (of a step, or wrapped in `Item` for an
    /// item): [`Round::Again`] when it progressed (`checkpoints` updated), [`Round::Reread`]
    /// when it was declined because the instance began compensating, else what to write.
    async fn perform(
        &self,
        inst: &InstanceRecord,
        def: &Definition,
        checkpoints: &mut [Checkpoint],
        next: Next,
    ) -> Result<Round, FlowError> {
        Ok(match self.attempt(inst, def, checkpoints, next).await? {
            Attempt::Done(target, op) => {
                target.record(checkpoints, op);
                Round::Again
            }
            Attempt::Redone => Round::Again,
            Attempt::Blocked(next) => Round::Write(next),
            Attempt::Stale => Round::Reread,
        })
    }

    /// One `Run`, `Compensate` or `Redo`, against the checkpoints as read.
    async fn attempt(
        &self,
        inst: &InstanceRecord,
        def: &Definition,
        checkpoints: &[Checkpoint],
        next: Next,
    ) -> Result<Attempt, FlowError> {
        let (item, next) = match next {
            Next::Item { item, next } => (Some(item), *next),
            other => (None, other),
        };
        let index = match &next {
            Next::Run { index, .. }
            | Next::Compensate { index, .. }
            | Next::Redo { index }
            | Next::Abandon { index } => *index,
            other => return Err(FlowError::Invalid(format!("{other:?} cannot be performed"))),
        };
        let cp = &checkpoints[index];
        let (op_key, comp_key) = match &item {
            None => (cp.row.op_key.as_str(), cp.row.comp_key.as_str()),
            Some(id) => match cp.items.iter().find(|i| &i.row.item == id) {
                Some(i) => (i.row.op_key.as_str(), i.row.comp_key.as_str()),
                None => return Err(FlowError::Invalid(format!("item {id:?} was planned but is not stored"))),
            },
        };
        let step = &def.steps[index];
        let (job, compensation, payload) = match next {
            Next::Run { payload, .. } => (Job::step(step, index, op_key), false, payload),
            Next::Compensate { payload, .. } => match Job::compensation(step, index, comp_key) {
                Some(job) => (job, true, payload),
                None => return Err(FlowError::Invalid("a compensation without a connector was planned".into())),
            },
            Next::Abandon { .. } => {
                // The operation as it is now (closed, or acquired by a worker first) goes
                // into the checkpoints: the next round plans from it, never from the stale one.
                let op = self.abandon(inst, step, op_key).await?;
                return Ok(match op {
                    Some(op) => Attempt::Done(Target { index, item, compensation: false }, Box::new(op)),
                    None => Attempt::Redone,
                });
            }
            _ => {
                self.redo(inst, step, op_key).await?;
                return Ok(Attempt::Redone);
            }
        };
        Ok(match self.run_operation(inst, job, payload).await? {
            StepRun::Progressed(op) => Attempt::Done(Target { index, item, compensation }, op),
            StepRun::Blocked(next) => Attempt::Blocked(next),
            StepRun::Stale => Attempt::Stale,
        })
    }

    /// Closes a PENDING step (or item) operation FAILED while its instance compensates
    /// ([`Next::Abandon`]): a worker that acquired it meanwhile wins, and the compensation
    /// waits for its attempt instead.
    async fn abandon(
        &self,
        inst: &InstanceRecord,
        step: &StepDef,
        key: &str,
    ) -> Result<Option<idem_core::OperationRecord>, FlowError> {
        let reason = format!(
            "not performed again: workflow instance {:?} compensates, and step {:?} was PENDING (due for another attempt)",
            inst.instance_id, step.name
        );
        self.system_resolve(inst, key, State::Pending, State::Failed, reason).await
    }

    /// Moves an UNKNOWN `redo_safe` step's operation back to PENDING, so the next round
    /// runs it again.
    async fn redo(&self, inst: &InstanceRecord, step: &StepDef, key: &str) -> Result<(), FlowError> {
        let reason = format!(
            "recovery policy redo_safe: step {:?} of workflow instance {:?} is redone",
            step.name, inst.instance_id
        );
        self.system_resolve(inst, key, State::Unknown, State::Pending, reason).await.map(|_| ())
    }

    /// An audited system resolution of operation `key` from `from` to `to`: the operation as
    /// it is afterwards. When it is no longer `from` (another writer came first), nothing is
    /// changed and the operation is read as it is.
    async fn system_resolve(
        &self,
        inst: &InstanceRecord,
        key: &str,
        from: State,
        to: State,
        reason: String,
    ) -> Result<Option<idem_core::OperationRecord>, FlowError> {
        let req = ResolveRequest {
            tenant: inst.tenant.clone(),
            key: key.to_owned(),
            to,
            expected_state: Some(from),
            reason,
            evidence: None,
            actor: Actor::system(),
        };
        match self.store.resolve(req).await {
            Ok(op) => Ok(Some(op)),
            Err(StoreError::Resolve(_)) => Ok(self.store.get(&inst.tenant, key).await?),
            Err(e) => Err(e.into()),
        }
    }
}

/// Counts a written instance change in `/metrics`.
fn count(before: &InstanceRecord, after: &InstanceRecord) {
    if before.state == after.state {
        return;
    }
    let state = after.state.as_str();
    metrics::counter!("idem_workflow_transitions_total", "to" => state).increment(1);
    if after.state == InstanceState::Compensated
        || after.error_class.as_deref().is_some_and(|c| c.starts_with("compensation"))
    {
        let outcome = if after.state == InstanceState::Compensated { "compensated" } else { "paused" };
        let workflow = idem_connect::labels::bounded_label("workflow", &after.workflow);
        metrics::counter!("idem_compensations_total", "workflow" => workflow, "outcome" => outcome).increment(1);
    }
    if after.state == InstanceState::Paused {
        tracing::warn!(
            tenant = %after.tenant, workflow = %after.workflow, step = ?after.stopped_step,
            reason = ?after.error_message, "workflow instance paused: it waits for a person"
        );
    }
}

/// The definition's step names, comma-separated (for messages).
pub(crate) fn step_names(def: &Definition) -> String {
    def.steps.iter().map(|s| s.name.as_str()).collect::<Vec<_>>().join(", ")
}
