//! Guarded operator re-runs (DESIGN.md §8; seed 003: "the re-run entry itself needs
//! guardrails").
//!
//! [`plan_rerun`] says, for every step, exactly what a re-run would do — without changing
//! anything (the dry run) — and gives the plan a hash. [`plan_rerun_apply`] turns a plan
//! into the instance write. The store applies it only if the instance is still at the
//! version the plan was made from, so what the operator approved is what runs (a plan hash
//! the caller saw and the one planned now must be equal, too).
//!
//! | step                                     | not named                        | named            |
//! |------------------------------------------|----------------------------------|------------------|
//! | SUCCEEDED                                | kept (its result is reused)      | redone: new key `{instance}:{step}:rerun-N` |
//! | the first that did not succeed: FAILED   | redone: new key                  | redone           |
//! | the first that did not succeed: UNKNOWN  | looked up first (needs a lookup) | redone           |
//! | not started                              | runs                             | runs             |
//! | PENDING, EXECUTING                       | kept (it is on its way)          | refused          |
//!
//! A step for each item is planned item by item, each item a line of its own (under the
//! step's, in [`PlannedStep::items`]) with its own key, as a step is (the table in
//! `rerun/items.rs`): a plain re-run redoes its FAILED items (`{item key}:rerun-N`), looks
//! its UNKNOWN ones up and keeps its SUCCEEDED ones; naming the step redoes every item. A
//! step for each item whose list was empty is SUCCEEDED once the instance moved past it
//! ([`super::items::settle_empty_lists`]).
//!
//! An operation under a step's key that was not made for the step (another action or
//! connector: [`Checkpoint::foreign_operation`]) is never reused: the step is redone under
//! a new key, named or not.
//!
//! An instance that paused during compensation re-runs its compensation: a compensation
//! that FAILED is redone under a new key (`…:compensate-N`), one that is UNKNOWN is looked
//! up first, and the compensations not begun yet run after them (last step first); no
//! step is redone then.
//!
//! The plan shows the input a step would send only when it can be known now: when every
//! step before it is kept. After a redone step, a later step's input is built from the
//! redone step's new result, when its turn comes. A re-run never takes a changed definition or input:
//! the instance's pinned version is used (start a new instance for another). A redone
//! step is a new intent: its old operation stays, with its own evidence, in the history.

use super::definition::Definition;
use super::input::build_step_input;
use super::plan::needs_compensation;
use super::record::{
    Checkpoint, InstanceEvent, InstanceEventKind, InstanceRecord, MAX_RERUNS, compensation_key, compensation_number,
    compensation_rerun_key, input_context, rerun_key, rerun_number,
};
use super::state::{InstanceState, StepState};
use crate::State;
use crate::fingerprint::{canonical_json, sha256_hex};
use crate::record::Actor;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

/// What a re-run does to one step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StepDisposition {
    /// Left as it is: a finished step's recorded result is reused (or a step on its way).
    Kept,
    /// Runs for the first time.
    Runs,
    /// Performed again as a new intent, under a new operation key: a new side effect.
    Redone,
    /// Its provider is asked first (the reconciler's lookup); redone only if absence is
    /// proven.
    LookedUp,
    /// Its compensation is redone under a new key (it failed).
    Compensated,
    /// Its compensation runs for the first time (a compensation re-run goes on with the
    /// compensations not begun yet, last step first): a new side effect.
    CompensationRuns,
}

impl StepDisposition {
    /// Whether this disposition acts on the step's compensation (its key is `comp_key`),
    /// not on the step itself.
    pub fn is_compensation(self) -> bool {
        matches!(self, StepDisposition::Compensated | StepDisposition::CompensationRuns)
    }
}

/// One step of a [`RerunPlan`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PlannedStep {
    /// Step name.
    pub step: String,
    /// The step's state now (its compensation's, for a compensation re-run).
    pub state: StepState,
    /// What happens to it.
    pub disposition: StepDisposition,
    /// The action performed: the step's, or its compensation's for a compensation re-run
    /// (an UNKNOWN compensation looked up too).
    pub action: String,
    /// The key of the operation the disposition acts on: `op_key`, or `comp_key` for a
    /// compensation re-run's steps.
    pub key: String,
    /// The operation key the step will run under (a new one when redone).
    pub op_key: String,
    /// The key of its compensation (a new one when its compensation is redone).
    pub comp_key: String,
    /// The connector that performs it (`None`: the caller's code).
    pub connector: Option<String>,
    /// The input it would send, for a step (or compensation) idem performs that is redone
    /// or runs, when it can be known now: every step before it is kept (after a redone
    /// step, the input is built from its new result when its turn comes).
    pub input: Option<Value>,
    /// For a step for each item: each of its items, in the list's order (empty for other
    /// steps, and before its list was read). The step's own line then sums them up: its
    /// disposition is the strongest of its items' (redone, looked up, runs, kept), its
    /// keys are only the prefix of its items' (no operation has them).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub items: Vec<PlannedItem>,
}

/// One item of a step for each item in a [`RerunPlan`]: planned as a step is.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PlannedItem {
    /// The item's identity (the value of its step's `for_each.id` field).
    pub item: String,
    /// The item's state now (its compensation's, for a compensation re-run).
    pub state: StepState,
    /// What happens to it.
    pub disposition: StepDisposition,
    /// The action performed: the step's, or its compensation's for a compensation re-run.
    pub action: String,
    /// The key of the operation the disposition acts on: `op_key`, or `comp_key` for a
    /// compensation re-run.
    pub key: String,
    /// The operation key the item will run under (`{instance}:{step}:{item}`, or a new
    /// `…:rerun-N` when redone).
    pub op_key: String,
    /// The key of its compensation (a new one when the item or its compensation is redone).
    pub comp_key: String,
    /// The input it would send (an item or compensation idem performs that is redone or
    /// runs), when it can be known now: every step before its step is kept.
    pub input: Option<Value>,
}

/// What a re-run would do, step by step, and its hash.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RerunPlan {
    /// The instance version the plan was made from: it is applied only at this version (not
    /// part of the hash).
    pub instance_version: i64,
    /// The state the instance goes to: RUNNING, or COMPENSATING (a compensation re-run).
    pub resumes_as: InstanceState,
    /// Every step, in order.
    pub steps: Vec<PlannedStep>,
    /// SHA-256 (hex) of the canonical JSON of the above: what the operator approves.
    pub hash: String,
}

/// Why a re-run is refused (nothing changes).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RerunRefusal {
    /// The instance is RUNNING or COMPENSATING: wait for it to pause or finish.
    #[error("the instance is {state}: a re-run needs it FAILED, PAUSED or SUCCEEDED")]
    StillRunning {
        /// Its state.
        state: InstanceState,
    },
    /// The instance was compensated: its effects were undone; start a new instance.
    #[error("the instance was COMPENSATED: its effects were undone; start a new instance for a new attempt")]
    Compensated,
    /// A named step is not in the instance's definition.
    #[error("no step {0:?} in the instance's definition")]
    UnknownStep(String),
    /// A named step is on its way (PENDING or EXECUTING): it cannot be redone now.
    #[error("step {step:?} is {state}: it is on its way and cannot be redone now")]
    StepBusy {
        /// The step.
        step: String,
        /// Its state.
        state: StepState,
    },
    /// A named step cannot be redone during a compensation re-run.
    #[error("the instance paused during compensation: a re-run redoes its compensation, not step {0:?}")]
    Compensating(String),
    /// Nothing would change (a SUCCEEDED instance re-run without naming a step).
    #[error("nothing to re-run: the instance SUCCEEDED; name the steps to redo")]
    NothingToRedo,
    /// A step's outcome is UNKNOWN and its provider cannot be asked: resolve it, or name it
    /// to redo it on purpose.
    #[error(
        "step {0:?} is UNKNOWN and cannot be looked up (no lookup): resolve it (idem ops resolve), or name it to redo it on purpose"
    )]
    NeedsResolution(String),
    /// A step was re-run too often.
    #[error("step {0:?} was re-run {MAX_RERUNS} times; start a new instance")]
    TooManyReruns(String),
    /// The plan redoes steps whose effects exist or may exist (SUCCEEDED or UNKNOWN): a new
    /// side effect, which runs only as a plan the operator saw. A re-run request sent twice
    /// (a double click, a client's retry after a timeout) then meets `PlanChanged` instead
    /// of redoing the step twice (found by a break-it run: three notifications).
    #[error(
        "this re-run redoes {steps:?}, whose effects exist or may exist: a new side effect; preview it (dry_run) and send its plan_hash ({now}) to run it"
    )]
    PlanHashRequired {
        /// The steps it would redo.
        steps: Vec<String>,
        /// The hash of the plan now.
        now: String,
    },
    /// The plan approved (its hash) is not the plan now: the instance changed since.
    #[error("the instance changed since the plan {approved} was made (the plan now is {now}): look at the new plan")]
    PlanChanged {
        /// The hash the caller approved.
        approved: String,
        /// The hash of the plan now.
        now: String,
    },
}

/// Plans a re-run of `inst` (its pinned `def`, its checkpoints in order) redoing the steps
/// `named` (empty: continue from where it stopped). `has_lookup` tells whether a
/// connector can look effects up.
///
/// # Errors
/// A [`RerunRefusal`]; nothing may be written then.
pub fn plan_rerun(
    inst: &InstanceRecord,
    def: &Definition,
    checkpoints: &[Checkpoint],
    named: &[String],
    has_lookup: &dyn Fn(&str) -> bool,
) -> Result<RerunPlan, RerunRefusal> {
    if let Some(unknown) = named.iter().find(|n| def.position(n).is_none()) {
        return Err(RerunRefusal::UnknownStep(unknown.clone()));
    }
    match inst.state {
        InstanceState::Running | InstanceState::Compensating => {
            return Err(RerunRefusal::StillRunning { state: inst.state });
        }
        InstanceState::Compensated => return Err(RerunRefusal::Compensated),
        _ => {}
    }
    let mut settled = checkpoints.to_vec();
    super::items::settle_empty_lists(inst, def, &mut settled);
    let checkpoints = settled.as_slice();
    let compensating = super::plan::paused_in_compensation(inst, checkpoints);
    if inst.state == InstanceState::Paused && compensating {
        if let Some(n) = named.first() {
            return Err(RerunRefusal::Compensating(n.clone()));
        }
        return plan_compensation_rerun(inst, def, checkpoints, has_lookup);
    }
    let ctx = super::items::context(inst, def, checkpoints);
    let mut steps = Vec::with_capacity(def.steps.len());
    // The first step that has not SUCCEEDED, with the branches of its parallel group: each
    // of them that failed is redone, each UNKNOWN one looked up (they run at once).
    let mut first_open: Option<std::ops::Range<usize>> = None;
    let mut all_kept_before = true;
    for (index, (step, c)) in def.steps.iter().zip(checkpoints).enumerate() {
        let is_named = named.contains(&step.name);
        let foreign = c.foreign_step_operation(step).is_some();
        // A step for each item has no operation of its own: SUCCEEDED once all its items are
        // (kept), else open; its items are planned one by one below.
        let state = match step.for_each {
            Some(_) => (c.state == StepState::Succeeded).then_some(State::Succeeded),
            None => c.operation.as_ref().map(|o| o.state),
        };
        let open = foreign || state != Some(State::Succeeded);
        if open && first_open.is_none() {
            first_open = Some(def.span(index));
        }
        let first = open && first_open.as_ref().is_some_and(|span| span.contains(&index));
        if step.for_each.is_some() && !c.items.is_empty() {
            let items =
                items::plan_forward(inst, def, checkpoints, index, is_named, first, all_kept_before, has_lookup)?;
            let disposition = items::summary(&items);
            all_kept_before &= disposition == StepDisposition::Kept;
            steps.push(PlannedStep {
                step: step.name.clone(),
                state: c.state,
                disposition,
                action: step.action.clone(),
                key: c.row.op_key.clone(),
                op_key: c.row.op_key.clone(),
                comp_key: c.row.comp_key.clone(),
                connector: step.connector.clone(),
                input: None,
                items,
            });
            continue;
        }
        let disposition = match (state, is_named) {
            _ if foreign => StepDisposition::Redone,
            (None, _) => StepDisposition::Runs,
            (Some(State::Pending | State::Executing), true) => {
                return Err(RerunRefusal::StepBusy { step: step.name.clone(), state: c.state });
            }
            (Some(_), true) => StepDisposition::Redone,
            (Some(State::Failed), false) if first => StepDisposition::Redone,
            (Some(State::Unknown), false) if first => {
                let asks = step.connector.as_deref().is_some_and(has_lookup);
                if !asks {
                    return Err(RerunRefusal::NeedsResolution(step.name.clone()));
                }
                StepDisposition::LookedUp
            }
            (Some(_), false) => StepDisposition::Kept,
        };
        let op_key = match disposition {
            StepDisposition::Redone => redo_key(inst, &step.key_name(), &c.row.op_key, || step.name.clone())?,
            _ => c.row.op_key.clone(),
        };
        let comp_key = if op_key == c.row.op_key { c.row.comp_key.clone() } else { compensation_key(&op_key) };
        let input = match disposition {
            // A step for each item's input is its items' (its list is read when it runs).
            StepDisposition::Redone | StepDisposition::Runs
                if step.connector.is_some() && all_kept_before && step.for_each.is_none() =>
            {
                build_step_input(&step.input, &ctx).ok()
            }
            _ => None,
        };
        all_kept_before &= disposition == StepDisposition::Kept;
        steps.push(PlannedStep {
            step: step.name.clone(),
            state: c.state,
            disposition,
            action: step.action.clone(),
            key: op_key.clone(),
            op_key,
            comp_key,
            connector: step.connector.clone(),
            input,
            items: Vec::new(),
        });
    }
    if steps.iter().all(|s| s.disposition == StepDisposition::Kept) {
        return Err(RerunRefusal::NothingToRedo);
    }
    Ok(seal(inst, InstanceState::Running, steps))
}

/// The key a redone step (or item) runs under: `{instance}:{key_name}:rerun-N`, N one more
/// than its current key's (`op_key`).
///
/// # Errors
/// [`RerunRefusal::TooManyReruns`] naming `who()` past [`MAX_RERUNS`].
fn redo_key(
    inst: &InstanceRecord,
    key_name: &str,
    op_key: &str,
    who: impl FnOnce() -> String,
) -> Result<String, RerunRefusal> {
    let n = rerun_number(op_key) + 1;
    if n > MAX_RERUNS {
        return Err(RerunRefusal::TooManyReruns(who()));
    }
    Ok(rerun_key(&inst.instance_id, key_name, n))
}

/// A re-run of an instance that paused during compensation: its failed compensation is
/// redone under a new key, an UNKNOWN one looked up first; the steps are kept.
fn plan_compensation_rerun(
    inst: &InstanceRecord,
    def: &Definition,
    checkpoints: &[Checkpoint],
    has_lookup: &dyn Fn(&str) -> bool,
) -> Result<RerunPlan, RerunRefusal> {
    let ctx = input_context(inst, checkpoints);
    let mut steps = Vec::with_capacity(def.steps.len());
    for (index, (step, c)) in def.steps.iter().zip(checkpoints).enumerate() {
        if !c.items.is_empty() {
            let items = items::plan_compensation(inst, def, checkpoints, index, has_lookup)?;
            let comp_def = step.compensation.as_ref();
            steps.push(PlannedStep {
                step: step.name.clone(),
                state: c.state,
                disposition: items::summary(&items),
                action: comp_def.map_or_else(|| step.action.clone(), |d| d.action.clone()),
                key: c.row.comp_key.clone(),
                op_key: c.row.op_key.clone(),
                comp_key: c.row.comp_key.clone(),
                connector: comp_def.and_then(|k| k.connector.clone()),
                input: None,
                items,
            });
            continue;
        }
        let comp = c.compensation.as_ref();
        let foreign = c.foreign_compensation(step).is_some();
        let state = comp.map(|o| if foreign { State::Failed } else { o.state });
        let (disposition, comp_key) = match state {
            Some(State::Failed) => {
                let n = compensation_number(&c.row.comp_key) + 1;
                if n > MAX_RERUNS {
                    return Err(RerunRefusal::TooManyReruns(step.name.clone()));
                }
                (StepDisposition::Compensated, compensation_rerun_key(&c.row.op_key, n))
            }
            Some(State::Unknown) => {
                let connector = step.compensation.as_ref().and_then(|k| k.connector.as_deref());
                if !connector.is_some_and(has_lookup) {
                    return Err(RerunRefusal::NeedsResolution(format!("{} (its compensation)", step.name)));
                }
                (StepDisposition::LookedUp, c.row.comp_key.clone())
            }
            None if needs_compensation(step, c) => (StepDisposition::CompensationRuns, c.row.comp_key.clone()),
            _ => (StepDisposition::Kept, c.row.comp_key.clone()),
        };
        let comp_def = step.compensation.as_ref();
        let input = match (disposition.is_compensation(), comp_def) {
            (true, Some(def)) if def.connector.is_some() => build_step_input(&def.input, &ctx).ok(),
            _ => None,
        };
        steps.push(PlannedStep {
            step: step.name.clone(),
            state: StepState::of_operation(comp.map(|o| o.state)),
            disposition,
            action: comp_def.map_or_else(|| step.action.clone(), |d| d.action.clone()),
            key: comp_key.clone(),
            op_key: c.row.op_key.clone(),
            comp_key,
            connector: comp_def.and_then(|k| k.connector.clone()),
            input,
            items: Vec::new(),
        });
    }
    if steps.iter().all(|s| s.disposition == StepDisposition::Kept) {
        return Err(RerunRefusal::NothingToRedo);
    }
    Ok(seal(inst, InstanceState::Compensating, steps))
}

/// The plan with its hash. The hash covers what the operator approves — the instance's
/// state, and per step its state now, what happens to it, its keys and the input it would
/// send — not the instance's version, which the runner's bookkeeping moves while nothing
/// an operator sees changes (so an approval does not go stale by itself).
fn seal(inst: &InstanceRecord, resumes_as: InstanceState, steps: Vec<PlannedStep>) -> RerunPlan {
    let canonical = json!({
        "instance": inst.instance_id,
        "state": inst.state,
        "resumes_as": resumes_as,
        "steps": steps,
    });
    let hash = sha256_hex(canonical_json(&canonical).expect("a plan canonicalizes").as_bytes());
    RerunPlan { instance_version: inst.version, resumes_as, steps, hash }
}

/// The instance write of an approved plan: RUNNING (or COMPENSATING) from now, the reason
/// and the plan in an audited event. The step rows to point at new keys are the plan's
/// steps whose `op_key` or `comp_key` changed.
///
/// # Errors
/// [`RerunRefusal::PlanChanged`] when `approved` (a hash the caller saw) is not the plan's;
/// [`RerunRefusal::PlanHashRequired`] when nothing was approved and the plan redoes a step
/// (or an item) that SUCCEEDED or is UNKNOWN.
pub fn plan_rerun_apply(
    inst: &InstanceRecord,
    plan: &RerunPlan,
    approved: Option<&str>,
    reason: &str,
    actor: &Actor,
    now_ms: i64,
) -> Result<(InstanceRecord, InstanceEvent), RerunRefusal> {
    if let Some(a) = approved
        && a != plan.hash
    {
        return Err(RerunRefusal::PlanChanged { approved: a.to_owned(), now: plan.hash.clone() });
    }
    let again = |d: StepDisposition, s: StepState| {
        d == StepDisposition::Redone && matches!(s, StepState::Succeeded | StepState::Unknown)
    };
    let mut effects_again = Vec::new();
    for s in &plan.steps {
        if s.items.is_empty() && again(s.disposition, s.state) {
            effects_again.push(s.step.clone());
        }
        let items = s.items.iter().filter(|i| again(i.disposition, i.state));
        effects_again.extend(items.map(|i| format!("{} (item {})", s.step, i.item)));
    }
    if approved.is_none() && !effects_again.is_empty() {
        return Err(RerunRefusal::PlanHashRequired { steps: effects_again, now: plan.hash.clone() });
    }
    let mut rec = inst.clone();
    rec.state = plan.resumes_as;
    rec.stopped_step = None;
    rec.error_class = None;
    rec.error_message = None;
    rec.completed_at = None;
    rec.expires_at = None;
    rec.next_run_at = Some(now_ms);
    rec.updated_at = now_ms;
    rec.version += 1;
    let line = |name: &str, d: StepDisposition, op_key: &str, comp_key: &str| match d {
        StepDisposition::Redone => format!("{name} redone as {op_key}"),
        StepDisposition::Compensated => format!("{name} compensated again as {comp_key}"),
        StepDisposition::LookedUp => format!("{name} looked up first"),
        _ => format!("{name} runs"),
    };
    let mut summary: Vec<String> = Vec::new();
    for s in plan.steps.iter().filter(|s| s.disposition != StepDisposition::Kept) {
        if s.items.is_empty() {
            summary.push(line(&s.step, s.disposition, &s.op_key, &s.comp_key));
        }
        for i in s.items.iter().filter(|i| i.disposition != StepDisposition::Kept) {
            let name = format!("{} item {}", s.step, i.item);
            summary.push(line(&name, i.disposition, &i.op_key, &i.comp_key));
        }
    }
    let mut e = InstanceEvent::new(actor, &rec, InstanceEventKind::Rerun, now_ms);
    e.from_state = Some(inst.state);
    e.reason = Some(format!("operator re-run: {}; plan {}: {}", reason.trim(), &plan.hash[..12], summary.join(", ")));
    Ok((rec, e))
}

/// An operation a re-run closes: `(record as closed, version it was read at, audit event)`.
pub type Superseded = (crate::OperationRecord, i64, crate::OperationEvent);

/// The operations a re-run would otherwise leave open. A step named to be redone while
/// its operation is UNKNOWN gets a new key; the old operation stayed UNKNOWN in the review
/// queue, where resolving it to PENDING performed the step a second time (found by a
/// break-it run: two notifications). The re-run closes each such operation in the same
/// transaction as the re-run itself, as an operator resolution to FAILED with error class
/// `superseded`: it leaves the review queue and is never performed again. Its message and
/// audit event name the new key, say that this attempt's outcome was never known, and
/// keep the operator's reason. An operation of another caller under the step's key
/// (`foreign`) is not ours to close and is left alone.
#[must_use]
pub fn plan_superseded(
    def: &Definition,
    plan: &RerunPlan,
    checkpoints: &[Checkpoint],
    reason: &str,
    actor: &Actor,
    now_ms: i64,
) -> Vec<Superseded> {
    let mut out = Vec::new();
    // (what was redone, as named in the message; its plan line's disposition and new key;
    // its checkpoint), for the steps and the items.
    let mut redone: Vec<(String, StepDisposition, &str, Checkpoint)> = Vec::new();
    for ((p, c), step) in plan.steps.iter().zip(checkpoints).zip(&def.steps) {
        if p.items.is_empty() {
            if c.foreign_step_operation(step).is_none() {
                redone.push((format!("step {:?}", p.step), p.disposition, &p.op_key, c.clone()));
            }
            continue;
        }
        for (i, ic) in p.items.iter().zip(&c.items) {
            let cp = ic.as_checkpoint();
            if cp.foreign_step_operation(step).is_none() {
                redone.push((format!("item {:?} of step {:?}", i.item, p.step), i.disposition, &i.op_key, cp));
            }
        }
    }
    for (what, disposition, new_key, c) in redone {
        let Some(op) = c.operation.as_ref() else { continue };
        if disposition != StepDisposition::Redone || new_key == c.row.op_key || op.state != State::Unknown {
            continue;
        }
        let head = format!(
            // No "superseded:" prefix: the error class says it, and the CLI shows
            // "CLASS: MESSAGE" ("superseded: superseded: ..." was read twice).
            "{what} re-run as {new_key} (the outcome of this attempt was never known)"
        );
        let full = format!("{head}: {}", reason.trim());
        let planned = crate::plan_resolution(op, State::Failed, None, &full, None, actor, now_ms)
            .or_else(|_| crate::plan_resolution(op, State::Failed, None, &head, None, actor, now_ms));
        if let Ok((mut next, ev)) = planned {
            next.error_class = Some("superseded".into());
            out.push((next, op.version, ev));
        }
    }
    out
}

mod items;

#[cfg(test)]
mod tests;
