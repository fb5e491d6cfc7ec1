//! The workflow plans: what a start gets ([`plan_start`]), what to do next for an
//! instance ([`plan_advance`]), and the instance write that goes with it
//! ([`plan_instance_update`]).
//!
//! The engine (idem-flow) is one loop: read the instance and its checkpoints →
//! [`plan_advance`] → perform that one [`Next`] (acquire and run a step through the same
//! claim as any trigger, or wait) → write → plan again. Because the plan reads only
//! checkpoints, a worker that never saw the first worker's memory resumes from the right
//! place, and a finished step is never performed again: its operation replays.

use super::definition::{Definition, RecoveryPolicy, StepDef};
use super::input::build_step_input;
use super::record::{Checkpoint, InstanceEvent, InstanceEventKind, InstanceRecord, InstanceTombstone, input_context};
use super::recovery::{Recovery, plan_recovery};
use super::state::{InstanceState, StepState};
use crate::State;
use crate::record::Actor;
use serde_json::Value;

/// How often a PAUSED instance is looked at again, to resume it once its step is
/// resolved (ms).
pub const PAUSED_POLL_MS: i64 = 5_000;
/// How often an instance that waits for the caller's code is looked at, as a backstop for
/// completions made outside the step API (ms).
pub const CALLER_POLL_MS: i64 = 30_000;
/// How soon an expired lease of a caller-performed step is looked at again (the lease
/// sweeper records the expiry) (ms).
pub const EXPIRY_POLL_MS: i64 = 1_000;

/// A start, as the API received it (validated).
#[derive(Debug, Clone)]
pub struct StartInput {
    /// Tenant of the caller.
    pub tenant: String,
    /// Instance id (validated).
    pub instance_id: String,
    /// Workflow name.
    pub workflow: String,
    /// Version of the definition the instance would pin.
    pub definition_version: String,
    /// Whether the caller sent the definition itself (steps of a workflow its code runs):
    /// then another version for the same instance is another intent (422). A declared
    /// workflow's version comes from the configuration, which may change under a running
    /// instance without making a repeated start a different intent.
    pub definition_given: bool,
    /// Source event id.
    pub source_event: Option<String>,
    /// The input.
    pub input: Value,
    /// Its fingerprint (RFC 8785 + SHA-256, as for operations).
    pub input_fingerprint: String,
    /// Trace / correlation id.
    pub trace_id: Option<String>,
    /// Who starts it.
    pub actor: Actor,
    /// How long the starter holds a new instance before a runner may claim it (ms; 0: due
    /// at once): the starter runs its first pass itself, and a runner's pass beside it
    /// would only read it again and collide. If the starter dies, a runner resumes the
    /// instance once the hold has passed, as after a pass whose node died.
    pub hold_ms: i64,
}

/// What a start gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StartDecision {
    /// A new instance. HTTP 201.
    Created,
    /// The instance exists with the same workflow and input: the same instance. HTTP 200.
    Existing,
    /// The instance exists with another workflow, input or given definition. HTTP 422;
    /// nothing changes.
    Mismatch,
    /// The instance finished and was removed after retention; its tombstone lives. HTTP 410.
    Late,
}

/// What to write for a start.
#[derive(Debug, Clone)]
pub struct StartPlan {
    /// The answer.
    pub decision: StartDecision,
    /// The instance (new, stored, or a view of the tombstone for [`StartDecision::Late`]).
    pub record: InstanceRecord,
    /// Events to append (none for a late start: there is no instance to log against).
    pub events: Vec<InstanceEvent>,
}

/// Plans a start against the stored instance (`existing`) or its live tombstone.
pub fn plan_start(
    existing: Option<&InstanceRecord>,
    tombstone: Option<&InstanceTombstone>,
    input: &StartInput,
    now_ms: i64,
) -> StartPlan {
    let Some(rec) = existing else {
        let mut record = InstanceRecord {
            tenant: input.tenant.clone(),
            instance_id: input.instance_id.clone(),
            workflow: input.workflow.clone(),
            definition_version: input.definition_version.clone(),
            source_event: input.source_event.clone(),
            input: input.input.clone(),
            input_fingerprint: input.input_fingerprint.clone(),
            state: InstanceState::Running,
            stopped_step: None,
            error_class: None,
            error_message: None,
            trace_id: input.trace_id.clone(),
            next_run_at: Some(now_ms + input.hold_ms.max(0)),
            created_at: now_ms,
            updated_at: now_ms,
            completed_at: None,
            expires_at: None,
            version: 1,
        };
        if let Some(t) = tombstone.filter(|t| t.expires_at > now_ms) {
            record.state = t.final_state;
            record.input = Value::Null;
            record.input_fingerprint = t.input_fingerprint.clone();
            record.next_run_at = None;
            record.completed_at = Some(t.completed_at);
            record.expires_at = Some(t.expires_at);
            return StartPlan { decision: StartDecision::Late, record, events: Vec::new() };
        }
        let mut e = InstanceEvent::new(&input.actor, &record, InstanceEventKind::Started, now_ms);
        e.reason = Some(match &input.source_event {
            Some(ev) => format!("started from event {ev:?} on definition {}", short(&input.definition_version)),
            None => format!("started on definition {}", short(&input.definition_version)),
        });
        return StartPlan { decision: StartDecision::Created, record, events: vec![e] };
    };
    let mut why = Vec::new();
    if rec.workflow != input.workflow {
        why.push(format!("workflow {:?}, not {:?}", rec.workflow, input.workflow));
    }
    if rec.input_fingerprint != input.input_fingerprint {
        why.push(format!(
            "input fingerprint {}, not {}",
            short(&rec.input_fingerprint),
            short(&input.input_fingerprint)
        ));
    }
    if input.definition_given && rec.definition_version != input.definition_version {
        why.push(format!("definition {}, not {}", short(&rec.definition_version), short(&input.definition_version)));
    }
    let (decision, kind, reason) = if why.is_empty() {
        (StartDecision::Existing, InstanceEventKind::StartReplayed, format!("same instance, state {}", rec.state))
    } else {
        (
            StartDecision::Mismatch,
            InstanceEventKind::StartMismatch,
            format!("instance id reused with another intent: it has {}", why.join(", ")),
        )
    };
    let mut e = InstanceEvent::new(&input.actor, rec, kind, now_ms);
    e.from_state = Some(rec.state);
    e.reason = Some(reason);
    StartPlan { decision, record: rec.clone(), events: vec![e] }
}

/// The first 12 hex digits of a fingerprint or version, for messages.
fn short(hex: &str) -> &str {
    hex.get(..12).unwrap_or(hex)
}

/// The next thing to do for an instance.
#[derive(Debug, Clone, PartialEq)]
pub enum Next {
    /// Acquire step `index`'s operation with `payload` (its built input, or the stored
    /// payload of an operation that exists) and, for a connector step, perform it. Also
    /// how an expired lease is handled: the acquire records the expiry (UNKNOWN) or
    /// re-grants a `redo_safe` step.
    Run {
        /// Step index.
        index: usize,
        /// The operation's payload.
        payload: Value,
    },
    /// Branches of a parallel group (or items of a step for each item) to perform at once:
    /// each entry is a [`Next::Run`] or a [`Next::Redo`] of its own step, at least two.
    /// Each is its own operation (its own key, claim, lease and fencing token), so running
    /// them concurrently, or again after a crash, performs none twice.
    Parallel {
        /// The runs, in definition order.
        runs: Vec<Next>,
    },
    /// Step `index` runs once for each item of its list, and its items are not written yet:
    /// write these rows (their identities and keys), then plan again.
    PlanItems {
        /// Step index.
        index: usize,
        /// The items, in the list's order.
        items: Vec<super::record::ItemRow>,
    },
    /// `next` (a [`Next::Run`], [`Next::Redo`] or [`Next::Compensate`] of step `index`)
    /// concerns item `item` of that step for each item: it acts on the item's operation.
    Item {
        /// The item's identity.
        item: String,
        /// What to do for it.
        next: Box<Next>,
    },
    /// Step `index` is performed by the caller's code: nothing for idem to do; look again
    /// at `until_ms` (a backstop), or when the step's completion arrives.
    WaitForCaller {
        /// Step index.
        index: usize,
        /// When to look again (epoch ms).
        until_ms: i64,
    },
    /// Step `index` is not due (a retry later, a lease held, a lookup pending): look again
    /// at `until_ms`.
    Wait {
        /// Step index.
        index: usize,
        /// When (epoch ms).
        until_ms: i64,
    },
    /// Step `index` is UNKNOWN and `redo_safe`: move its operation to PENDING (audited),
    /// then run it.
    Redo {
        /// Step index.
        index: usize,
    },
    /// Pause the instance for a person.
    Pause {
        /// Step index.
        index: usize,
        /// Reason class.
        class: &'static str,
        /// Reason.
        reason: String,
    },
    /// A paused instance whose step no longer needs a person: RUNNING again (or
    /// COMPENSATING, when it paused during compensation).
    Resume {
        /// The state it goes back to.
        to: InstanceState,
    },
    /// Close the PENDING operation of step `index` (a retry or a redo waiting for its turn)
    /// as FAILED, an audited system resolution expecting PENDING, so that nothing performs
    /// it while the instance compensates: an effect started now would only be undone (or
    /// could not be, like an e-mail). If a worker acquired it first, the resolution is
    /// refused and the compensation waits for that attempt like any in flight.
    Abandon {
        /// Step index.
        index: usize,
    },
    /// Begin compensation: a step failed finally (or its outcome is UNKNOWN under the
    /// `compensate` policy), and earlier steps' effects have compensations.
    BeginCompensation {
        /// The step that failed.
        index: usize,
        /// Why.
        reason: String,
    },
    /// Acquire the operation of step `index`'s compensation (`comp_key`) with `payload`
    /// and, with a connector, perform it.
    Compensate {
        /// Step index.
        index: usize,
        /// The compensation's payload (built, or the stored one of an existing operation).
        payload: Value,
    },
    /// The instance is done.
    Finish {
        /// SUCCEEDED, FAILED or COMPENSATED.
        state: InstanceState,
        /// The step that decided it (FAILED).
        index: Option<usize>,
        /// Reason class (`step_failed`, `step_input`), `None` for SUCCEEDED.
        class: Option<&'static str>,
        /// Reason.
        reason: String,
    },
    /// Nothing to do (a final state, or still paused).
    Idle,
}

/// The checkpoints do not match the pinned definition: corruption, never a state change.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("instance {instance:?}: its steps {found:?} do not match its pinned definition's {expected:?}")]
pub struct DefinitionMismatch {
    /// Instance id.
    pub instance: String,
    /// Step names of the definition.
    pub expected: Vec<String>,
    /// Step names of the stored rows.
    pub found: Vec<String>,
}

/// The next thing to do for `inst` (running its pinned `def`), given its checkpoints in
/// definition order, at `now_ms`.
///
/// # Errors
/// [`DefinitionMismatch`] when the checkpoints are not the definition's steps in order.
pub fn plan_advance(
    inst: &InstanceRecord,
    def: &Definition,
    checkpoints: &[Checkpoint],
    now_ms: i64,
) -> Result<Next, DefinitionMismatch> {
    let names_match =
        checkpoints.len() == def.steps.len() && checkpoints.iter().zip(&def.steps).all(|(c, s)| c.row.step == s.name);
    if !names_match {
        return Err(DefinitionMismatch {
            instance: inst.instance_id.clone(),
            expected: def.steps.iter().map(|s| s.name.clone()).collect(),
            found: checkpoints.iter().map(|c| c.row.step.clone()).collect(),
        });
    }
    match inst.state {
        InstanceState::Running => Ok(next_running(inst, def, checkpoints, now_ms)),
        InstanceState::Compensating => Ok(next_compensating(inst, def, checkpoints, now_ms)),
        // Paused during compensation (a compensation exists, or the pause is one of the
        // compensation's: its class begins `compensation_`); else in the forward run.
        InstanceState::Paused if paused_in_compensation(inst, checkpoints) => {
            Ok(match next_compensating(inst, def, checkpoints, now_ms) {
                Next::Pause { .. } => Next::Idle,
                _ => Next::Resume { to: InstanceState::Compensating },
            })
        }
        InstanceState::Paused => Ok(match next_running(inst, def, checkpoints, now_ms) {
            Next::Pause { .. } => Next::Idle,
            _ => Next::Resume { to: InstanceState::Running },
        }),
        _ => Ok(Next::Idle),
    }
}

/// Whether step `step`'s effect may exist and has a compensation to undo it: its operation
/// SUCCEEDED, or is UNKNOWN under the `compensate` policy.
/// An operation under the step's key that was not made for it (see
/// [`Checkpoint::foreign_operation`]) is not the step's effect: it needs no compensation.
pub fn needs_compensation(step: &StepDef, c: &Checkpoint) -> bool {
    if !c.items.is_empty() {
        return c.items.iter().any(|i| needs_compensation(step, &i.as_checkpoint()));
    }
    step.compensation.is_some()
        && c.foreign_step_operation(step).is_none()
        && match c.operation.as_ref().map(|o| o.state) {
            Some(State::Succeeded) => true,
            Some(State::Unknown) => step.policy == RecoveryPolicy::Compensate,
            _ => false,
        }
}

/// Whether PAUSED `inst` paused during its compensation (a compensation's operation
/// exists, or the pause is one of the compensation's: its class begins `compensation_`),
/// rather than in its forward run.
pub fn paused_in_compensation(inst: &InstanceRecord, checkpoints: &[Checkpoint]) -> bool {
    inst.state == InstanceState::Paused && (compensation_began(checkpoints) || inst.compensates())
}

/// Whether a compensation's operation exists, for a step or an item of one.
pub fn compensation_began(checkpoints: &[Checkpoint]) -> bool {
    checkpoints.iter().any(|c| c.compensation.is_some() || c.items.iter().any(|i| i.compensation.is_some()))
}

/// Whether step `step` (or an item of it) is UNKNOWN and has a compensation: its effect may
/// exist, and the compensation settles it first (a person resolves it, or its lookup).
fn unknown_with_compensation(step: &StepDef, c: &Checkpoint) -> bool {
    step.compensation.is_some()
        && (c.operation.as_ref().is_some_and(|o| o.state == State::Unknown)
            || c.items.iter().any(|i| i.operation.as_ref().is_some_and(|o| o.state == State::Unknown)))
}

/// Why an operator's request to compensate is refused (nothing changes).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CompensationRefusal {
    /// Only a FAILED instance, or one PAUSED before any compensation, can be compensated.
    #[error("the instance is {state}: only a FAILED or PAUSED instance can be compensated")]
    NotStopped {
        /// Its state.
        state: InstanceState,
    },
    /// Its compensation already began (re-run it to redo a failed compensation).
    #[error("the instance's compensation already began: re-run it to redo a failed compensation")]
    AlreadyCompensating,
    /// No step's effect has a compensation to run.
    #[error("no step whose effect may exist has a compensation: there is nothing to compensate")]
    NothingToCompensate,
}

/// An operator's request to compensate `inst` (FAILED, or PAUSED before any compensation):
/// COMPENSATING from now, with an audited event naming who and why.
///
/// # Errors
/// A [`CompensationRefusal`]; nothing may be written then.
pub fn plan_operator_compensation(
    inst: &InstanceRecord,
    def: &Definition,
    checkpoints: &[Checkpoint],
    reason: &str,
    actor: &Actor,
    now_ms: i64,
) -> Result<(InstanceRecord, InstanceEvent), CompensationRefusal> {
    if !matches!(inst.state, InstanceState::Failed | InstanceState::Paused) {
        return Err(CompensationRefusal::NotStopped { state: inst.state });
    }
    if compensation_began(checkpoints) {
        return Err(CompensationRefusal::AlreadyCompensating);
    }
    if !def.steps.iter().zip(checkpoints).any(|(s, c)| needs_compensation(s, c) || unknown_with_compensation(s, c)) {
        return Err(CompensationRefusal::NothingToCompensate);
    }
    let mut rec = inst.clone();
    rec.state = InstanceState::Compensating;
    rec.completed_at = None;
    rec.expires_at = None;
    rec.next_run_at = Some(now_ms);
    rec.updated_at = now_ms;
    rec.version += 1;
    let mut e = InstanceEvent::new(actor, &rec, InstanceEventKind::Compensating, now_ms);
    e.from_state = Some(inst.state);
    e.step = inst.stopped_step.clone();
    e.reason = Some(format!("operator asked to compensate: {}", reason.trim()));
    Ok((rec, e))
}

/// [`plan_advance`] for a COMPENSATING instance: the compensations of the steps whose
/// effects may exist, last step first, each as its own operation; COMPENSATED when all
/// succeeded. A compensation that failed finally, or waits for a person, pauses it.
fn next_compensating(inst: &InstanceRecord, def: &Definition, checkpoints: &[Checkpoint], now_ms: i64) -> Next {
    // A branch or item may still be in flight, or UNKNOWN, when a sibling's failure (or an
    // operator) began the compensation: it settles first, so that an effect it made is
    // compensated too (see `recovery`'s table).
    if let Some(next) = super::recovery::settle_before_compensation(def, checkpoints, now_ms) {
        return next;
    }
    let mut done = 0;
    for (index, (step, c)) in def.steps.iter().zip(checkpoints).enumerate().rev() {
        if c.items.is_empty() {
            let ctx = || input_context(inst, checkpoints);
            match compensation_next(step, index, c, ctx, now_ms) {
                Ok(n) => done += n,
                Err(next) => return next,
            }
            continue;
        }
        // A step for each item: its items' compensations, last first, each its own.
        for item in c.items.iter().rev() {
            let ctx = || super::items::item_context(inst, def, checkpoints, index, &item.row.item);
            match compensation_next(step, index, &item.as_checkpoint(), ctx, now_ms) {
                Ok(n) => done += n,
                Err(next @ Next::Compensate { .. }) => {
                    return Next::Item { item: item.row.item.clone(), next: Box::new(next) };
                }
                // A pause names the item whose compensation waits for a person.
                Err(Next::Pause { index, class, reason }) => {
                    let reason = format!("item {:?}: {reason} (key {:?})", item.row.item, item.row.comp_key);
                    return Next::Pause { index, class, reason };
                }
                Err(next) => return next,
            }
        }
    }
    Next::Finish {
        state: InstanceState::Compensated,
        index: None,
        class: None,
        reason: format!("{done} compensation(s) succeeded, last step first"),
    }
}

/// The compensation of the step (or item) checkpoint `c` of step `index`: `Ok(1)` when it
/// SUCCEEDED, `Ok(0)` when none is needed, else what to do (its input built from `ctx`).
fn compensation_next(
    step: &StepDef,
    index: usize,
    c: &Checkpoint,
    ctx: impl FnOnce() -> Value,
    now_ms: i64,
) -> Result<usize, Next> {
    if let Some(op) = c.foreign_compensation(step) {
        return Err(key_conflict(index, step, op, "its compensation"));
    }
    let Some(comp) = step.compensation.as_ref().filter(|_| needs_compensation(step, c)) else { return Ok(0) };
    let pause = |class: &'static str, why: String| Next::Pause {
        index,
        class,
        reason: format!("the compensation of step {:?} ({}) {why}", step.name, comp.action),
    };
    let Some(op) = c.compensation.as_ref() else {
        if comp.connector.is_none() {
            return Err(pause(
                "compensation_by_hand",
                format!(
                    "has no connector: your code (or a person) performs it and records it as the operation {:?} (acquire it with action {:?} through POST /v1/operations, then complete it); the compensation then goes on by itself",
                    c.row.comp_key, comp.action
                ),
            ));
        }
        return Err(match build_step_input(&comp.input, &ctx()) {
            Ok(payload) => Next::Compensate { index, payload },
            Err(e) => pause("compensation_input", format!("cannot be built: {e}")),
        });
    };
    let why = || {
        format!(
            "{}{}",
            op.error_class.as_deref().unwrap_or("failed"),
            op.error_message.as_deref().map(|m| format!(": {m}")).unwrap_or_default()
        )
    };
    Err(match op.state {
        State::Succeeded => return Ok(1),
        State::Pending => match op.next_attempt_at.filter(|at| *at > now_ms) {
            Some(at) => Next::Wait { index, until_ms: at },
            None => Next::Compensate { index, payload: op.payload.clone() },
        },
        State::Executing => match op.lease_expires_at.filter(|end| *end > now_ms) {
            Some(end) => Next::Wait { index, until_ms: end },
            None => Next::Compensate { index, payload: op.payload.clone() },
        },
        State::Unknown if op.needs_review => {
            let what = op.error_message.as_deref().unwrap_or("its outcome is unknown");
            pause("compensation_needs_review", format!("is UNKNOWN and in the review queue: {what}"))
        }
        State::Unknown => {
            let until = op.next_attempt_at.unwrap_or(now_ms).max(now_ms + super::recovery::LOOKUP_POLL_MS);
            Next::Wait { index, until_ms: until }
        }
        State::Failed => pause("compensation_failed", format!("failed: {}", why())),
    })
}

/// [`plan_advance`] for a RUNNING instance: the first step (or parallel group) that has
/// not SUCCEEDED decides; SUCCEEDED once every step has.
fn next_running(inst: &InstanceRecord, def: &Definition, checkpoints: &[Checkpoint], now_ms: i64) -> Next {
    let mut index = 0;
    while index < def.steps.len() {
        let span = def.span(index);
        let next = match def.steps[index].group.as_deref() {
            _ if def.steps[index].for_each.is_some() => super::items::next_items(inst, def, checkpoints, index, now_ms),
            Some(group) => super::group::next_group(inst, def, checkpoints, group, span.clone(), now_ms),
            None => step_next(inst, def, checkpoints, index, now_ms).map(|next| match next {
                Next::Finish { state: InstanceState::Failed, index: Some(i), class: Some("step_failed"), reason } => {
                    failed_finally(def, checkpoints, i, i, reason)
                }
                other => other,
            }),
        };
        if let Some(next) = next {
            return next;
        }
        index = span.end;
    }
    Next::Finish {
        state: InstanceState::Succeeded,
        index: None,
        class: None,
        reason: format!("all {} steps succeeded", def.steps.len()),
    }
}

/// Step `index` failed finally (`reason`): compensate when a step before `upto` has an
/// effect to undo, else FAILED.
pub(super) fn failed_finally(
    def: &Definition,
    checkpoints: &[Checkpoint],
    index: usize,
    upto: usize,
    reason: String,
) -> Next {
    let compensable = def.steps.iter().zip(checkpoints).take(upto).any(|(s, c)| needs_compensation(s, c));
    if compensable {
        return Next::BeginCompensation { index, reason };
    }
    Next::Finish { state: InstanceState::Failed, index: Some(index), class: Some("step_failed"), reason }
}

/// What step `index` alone needs next; `None` when it SUCCEEDED. A final failure comes back
/// as `Finish` FAILED with class `step_failed` (the caller decides about compensation).
pub(super) fn step_next(
    inst: &InstanceRecord,
    def: &Definition,
    checkpoints: &[Checkpoint],
    index: usize,
    now_ms: i64,
) -> Option<Next> {
    let (step, c) = (&def.steps[index], &checkpoints[index]);
    if let Some(op) = c.foreign_step_operation(step) {
        return Some(key_conflict(index, step, op, "the step"));
    }
    if let Some(op) = c.foreign_compensation(step) {
        return Some(key_conflict(index, step, op, "its compensation"));
    }
    let by_caller = step.connector.is_none();
    let Some(op) = c.operation.as_ref() else {
        if by_caller {
            return Some(Next::WaitForCaller { index, until_ms: now_ms + CALLER_POLL_MS });
        }
        return Some(match build_step_input(&step.input, &super::items::context(inst, def, checkpoints)) {
            Ok(payload) => Next::Run { index, payload },
            Err(e) => Next::Finish {
                state: InstanceState::Failed,
                index: Some(index),
                class: Some("step_input"),
                reason: format!("the input of step {:?} cannot be built: {e}", step.name),
            },
        });
    };
    operation_next(step, index, c.state, op, now_ms)
}

/// What step `index` (or an item of it) needs next given its operation `op`, in step state
/// `state`; `None` when it SUCCEEDED. A final failure is `Finish` FAILED (`step_failed`).
pub(super) fn operation_next(
    step: &StepDef,
    index: usize,
    state: StepState,
    op: &crate::OperationRecord,
    now_ms: i64,
) -> Option<Next> {
    let by_caller = step.connector.is_none();
    Some(match state {
        StepState::Succeeded => return None,
        // A compensated step's instance is COMPENSATING or beyond; if an operator's
        // re-run made it RUNNING again, it is a step to do again, not one done.
        StepState::Compensated => return None,
        StepState::NotStarted => unreachable!("a checkpoint with an operation has started"),
        StepState::Failed => Next::Finish {
            state: InstanceState::Failed,
            index: Some(index),
            class: Some("step_failed"),
            reason: format!(
                "step {:?} failed: {}{}",
                step.name,
                op.error_class.as_deref().unwrap_or("failed"),
                op.error_message.as_deref().map(|m| format!(": {m}")).unwrap_or_default()
            ),
        },
        StepState::Pending => {
            let due = op.next_attempt_at.is_none_or(|at| at <= now_ms);
            match (by_caller, due) {
                (true, _) => Next::WaitForCaller { index, until_ms: now_ms + CALLER_POLL_MS },
                (false, true) => Next::Run { index, payload: op.payload.clone() },
                (false, false) => Next::Wait { index, until_ms: op.next_attempt_at.unwrap_or(now_ms) },
            }
        }
        StepState::Executing => match op.lease_expires_at.filter(|end| *end > now_ms) {
            Some(end) => Next::Wait { index, until_ms: end },
            // The caller re-acquires its own step; the lease sweeper records the expiry.
            None if by_caller => Next::Wait { index, until_ms: now_ms + EXPIRY_POLL_MS },
            None => Next::Run { index, payload: op.payload.clone() },
        },
        StepState::Unknown => match plan_recovery(step, op, now_ms) {
            Recovery::Redo => Next::Redo { index },
            Recovery::AwaitLookup { until_ms } => Next::Wait { index, until_ms },
            Recovery::Pause { class, reason } => Next::Pause { index, class, reason },
            Recovery::Compensate { reason } => Next::BeginCompensation { index, reason },
        },
    })
}

/// Pause for an operation under one of step `index`'s keys that was not made for `what`
/// (the step, or its compensation): it never counts as their result.
pub(super) fn key_conflict(index: usize, step: &StepDef, op: &crate::OperationRecord, what: &str) -> Next {
    let (action, connector) = if what == "the step" {
        (step.action.as_str(), step.connector.as_deref())
    } else {
        let comp = step.compensation.as_ref();
        (comp.map_or("", |c| c.action.as_str()), comp.and_then(|c| c.connector.as_deref()))
    };
    let connector_name = |c: Option<&str>| c.map_or_else(|| "none (your code)".to_owned(), |c| format!("{c:?}"));
    Next::Pause {
        index,
        class: "step_key_conflict",
        reason: format!(
            "the operation under key {:?} was not made for {what} of step {:?}: it has action {:?} and connector {}, where {what} has action {:?} and connector {}; it does not count as their result — re-run the instance naming the step to perform it under a new key",
            op.key,
            step.name,
            op.action,
            connector_name(op.connector.as_deref()),
            action,
            connector_name(connector),
        ),
    }
}

/// The instance write that goes with `next` (`None`: nothing to write). `def` names the
/// steps for messages; the record comes back with its version bumped, and events to append.
pub fn plan_instance_update(
    inst: &InstanceRecord,
    def: &Definition,
    next: &Next,
    actor: &Actor,
    now_ms: i64,
) -> Option<(InstanceRecord, Vec<InstanceEvent>)> {
    let mut rec = inst.clone();
    let mut event = None;
    let step_name = |i: usize| def.steps.get(i).map(|s| s.name.clone());
    match next {
        Next::Run { .. }
        | Next::Redo { .. }
        | Next::Abandon { .. }
        | Next::Compensate { .. }
        | Next::Parallel { .. }
        | Next::PlanItems { .. }
        | Next::Item { .. } => return None,
        Next::Wait { until_ms, .. } | Next::WaitForCaller { until_ms, .. } => {
            if rec.next_run_at == Some(*until_ms) {
                return None;
            }
            rec.next_run_at = Some(*until_ms);
        }
        Next::Idle => {
            let want = (inst.state == InstanceState::Paused).then_some(now_ms + PAUSED_POLL_MS);
            if inst.state == InstanceState::Paused && rec.next_run_at.is_some_and(|t| t > now_ms) {
                return None;
            }
            if rec.next_run_at == want {
                return None;
            }
            rec.next_run_at = want;
        }
        Next::Pause { index, class, reason } => {
            rec.state = InstanceState::Paused;
            rec.stopped_step = step_name(*index);
            rec.error_class = Some((*class).into());
            rec.error_message = Some(reason.clone());
            rec.next_run_at = Some(now_ms + PAUSED_POLL_MS);
            let mut e = InstanceEvent::new(actor, &rec, InstanceEventKind::Paused, now_ms);
            e.step = rec.stopped_step.clone();
            e.reason = Some(reason.clone());
            event = Some(e);
        }
        Next::Resume { to } => {
            let step = rec.stopped_step.take();
            rec.state = *to;
            rec.error_class = None;
            rec.error_message = None;
            rec.next_run_at = Some(now_ms);
            let mut e = InstanceEvent::new(actor, &rec, InstanceEventKind::Resumed, now_ms);
            e.reason = Some(match &step {
                Some(s) => format!("step {s:?} no longer needs a person"),
                None => "resumed".into(),
            });
            e.step = step;
            event = Some(e);
        }
        Next::BeginCompensation { index, reason } => {
            rec.state = InstanceState::Compensating;
            rec.stopped_step = step_name(*index);
            rec.error_class = Some("step_failed".into());
            rec.error_message = Some(reason.clone());
            rec.next_run_at = Some(now_ms);
            let mut e = InstanceEvent::new(actor, &rec, InstanceEventKind::Compensating, now_ms);
            e.step = rec.stopped_step.clone();
            e.reason = Some(format!("{reason}; compensating the steps before it, last first"));
            event = Some(e);
        }
        Next::Finish { state, index, class, reason } => {
            rec.state = *state;
            rec.stopped_step = index.and_then(step_name);
            rec.error_class = class.map(str::to_owned);
            rec.error_message = class.map(|_| reason.clone());
            rec.next_run_at = None;
            rec.completed_at = Some(now_ms);
            let kind = match state {
                InstanceState::Succeeded => InstanceEventKind::Succeeded,
                InstanceState::Compensated => InstanceEventKind::Compensated,
                _ => InstanceEventKind::Failed,
            };
            let mut e = InstanceEvent::new(actor, &rec, kind, now_ms);
            e.step = rec.stopped_step.clone();
            e.reason = Some(reason.clone());
            event = Some(e);
        }
    }
    let mut events = Vec::new();
    if let Some(mut e) = event {
        e.from_state = Some(inst.state);
        events.push(e);
    }
    rec.updated_at = now_ms;
    rec.version += 1;
    Some((rec, events))
}

#[cfg(test)]
mod tests;
