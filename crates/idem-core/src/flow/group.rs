//! Parallel groups: named branches that run concurrently, and the join after them.
//!
//! A **branch** is a step of the definition whose `group` names its group; the branches of
//! a group are consecutive steps, and the step after them runs only once every branch
//! SUCCEEDED (wait for all). Each branch is its own operation under its own key,
//! `{instance}:{group}:{branch}` ([`super::StepDef::key_name`]), with its own claim,
//! lease, fencing token, checkpoint and recovery policy: a branch that finished is never
//! performed again because a sibling failed, the instance was resumed or a worker crashed
//! — its operation replays.
//!
//! The group's state is derived from its branches' (never stored), like a step's from its
//! operation:
//!
//! ```text
//! group   from          to            by
//!         NOT_STARTED   RUNNING       a branch's operation is acquired
//!         RUNNING       SUCCEEDED     every branch SUCCEEDED (the join: the next step runs)
//!         RUNNING       STOPPED       a branch FAILED finally, or is UNKNOWN
//!         STOPPED       RUNNING       the branch was resolved, or an operator re-ran it
//!         STOPPED       COMPENSATED   the compensations of its SUCCEEDED branches ran
//!         SUCCEEDED     COMPENSATED   a later step failed; its branches were compensated
//!         SUCCEEDED     RUNNING       an operator's re-run names one of its branches
//! ```
//!
//! **A stopped branch** (failed finally; or UNKNOWN and its recovery policy leaves it to a
//! person or to compensation; or its input cannot be built): the group's `on_failure`
//! decides ([`GroupFailure`]). `pause`: the instance pauses for a person; no branch that
//! has not started starts, the other branches keep their states. `compensate`: the
//! compensation waits until every branch has settled — none in flight, none UNKNOWN unless
//! its lookup or a person settled it (the table in [`super::recovery`]) — then compensates
//! exactly the steps and branches whose effects exist, last first, each once (its key
//! `{op_key}:compensate`); FAILED when none has a compensation.
//!
//! **A branch that finishes after its group was abandoned** (the instance paused, failed
//! or compensated meanwhile — its worker held a lease): its completion is recorded like
//! any operation's (its result, its evidence), and nothing after it runs again: the steps
//! after the group run only while the instance is RUNNING, and a RUNNING instance again
//! (resumed, re-run) replays the branch instead of performing it.
//!
//! **Concurrency**: at most `max_concurrency` branches in flight (EXECUTING with a live
//! lease); the others start as those finish. Branches idem performs are planned that way
//! ([`next_group`]); an acquire of a branch your code performs is refused while the limit
//! is reached ([`admit_branch`]): nothing is recorded, and the caller retries once a
//! sibling finished or its lease ended.

use super::definition::{Definition, GroupFailure, RecoveryPolicy};
use super::plan::{Next, failed_finally, step_next};
use super::record::{Checkpoint, InstanceRecord};
use super::state::StepState;
use crate::State;
use serde::{Deserialize, Serialize};
use std::fmt;
use std::ops::Range;

/// The state of a parallel group, derived from its branches'.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum GroupState {
    /// No branch's operation exists yet.
    NotStarted,
    /// Branches run (or wait for a retry, a lookup, a worker).
    Running,
    /// Every branch SUCCEEDED.
    Succeeded,
    /// A branch FAILED finally or is UNKNOWN: the group's `on_failure` decided.
    Stopped,
    /// The compensations of its SUCCEEDED branches SUCCEEDED.
    Compensated,
}

impl GroupState {
    /// Every state.
    pub const ALL: [GroupState; 5] = [
        GroupState::NotStarted,
        GroupState::Running,
        GroupState::Succeeded,
        GroupState::Stopped,
        GroupState::Compensated,
    ];

    /// The upper-case name shown in the API.
    pub fn as_str(self) -> &'static str {
        match self {
            GroupState::NotStarted => "NOT_STARTED",
            GroupState::Running => "RUNNING",
            GroupState::Succeeded => "SUCCEEDED",
            GroupState::Stopped => "STOPPED",
            GroupState::Compensated => "COMPENSATED",
        }
    }

    /// The state of a group whose branches are in `branches`.
    pub fn of(branches: &[StepState]) -> GroupState {
        use StepState::*;
        if branches.iter().all(|s| *s == Succeeded) {
            GroupState::Succeeded
        } else if branches.iter().any(|s| matches!(s, Failed | Unknown)) {
            GroupState::Stopped
        } else if branches.contains(&Compensated) && !branches.iter().any(|s| matches!(s, Succeeded | Executing)) {
            GroupState::Compensated
        } else if branches.iter().all(|s| *s == NotStarted) {
            GroupState::NotStarted
        } else {
            GroupState::Running
        }
    }

    /// Whether `self → to` is legal (the table in the module docs).
    pub fn can_become(self, to: GroupState) -> bool {
        use GroupState::*;
        matches!(
            (self, to),
            (NotStarted, Running)
                | (Running, Succeeded | Stopped)
                | (Stopped, Running | Compensated)
                | (Succeeded, Compensated | Running)
        )
    }
}

impl fmt::Display for GroupState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(self.as_str())
    }
}

/// Whether `c`'s operation is in flight: EXECUTING under a live lease.
pub(super) fn is_in_flight(c: &Checkpoint, now_ms: i64) -> bool {
    c.operation
        .as_ref()
        .is_some_and(|op| op.state == State::Executing && op.lease_expires_at.is_some_and(|end| end > now_ms))
}

/// An acquire of a branch the caller's code performs that would put more than its group's
/// `max_concurrency` branches in flight: refused, nothing recorded; retry later.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupFull {
    /// The group's name.
    pub group: String,
    /// Its `max_concurrency`.
    pub max: u32,
    /// The branches in flight (step names), in definition order.
    pub in_flight: Vec<String>,
    /// When the first of their leases ends (epoch ms): a slot frees then at the latest
    /// (the branch finishes, or its lapsed lease is recorded).
    pub until_ms: i64,
}

/// Whether an acquire of branch `index` (a step the caller's code performs) may start it at
/// `now_ms`. `Err` when the acquire would start the branch — no operation yet, or one
/// PENDING, or a lapsed lease that a `redo_safe` branch gets again — while `max_concurrency`
/// of its siblings are in flight (EXECUTING under a live lease). Every other acquire is
/// admitted: a step outside a group with a limit, and one that starts nothing (a resend
/// during the branch's own lease, a replay of a finished branch, an UNKNOWN one, a lapsed
/// lease recorded as UNKNOWN).
///
/// # Errors
/// [`GroupFull`], naming the group, its limit and the branches in flight.
pub fn admit_branch(def: &Definition, checkpoints: &[Checkpoint], index: usize, now_ms: i64) -> Result<(), GroupFull> {
    let (Some(step), Some(c)) = (def.steps.get(index), checkpoints.get(index)) else { return Ok(()) };
    let Some(group) = step.group.as_deref() else { return Ok(()) };
    let Some(max) = def.group_def(group).max_concurrency else { return Ok(()) };
    let starts = match &c.operation {
        None => true,
        Some(op) => match op.state {
            State::Pending => true,
            State::Executing => {
                step.policy == RecoveryPolicy::RedoSafe && op.lease_expires_at.is_none_or(|end| end <= now_ms)
            }
            _ => false,
        },
    };
    if !starts {
        return Ok(());
    }
    let span = def.span(index);
    let busy: Vec<usize> =
        span.filter(|&i| i != index && checkpoints.get(i).is_some_and(|c| is_in_flight(c, now_ms))).collect();
    if busy.len() < max as usize {
        return Ok(());
    }
    let until_ms = busy
        .iter()
        .filter_map(|&i| checkpoints[i].operation.as_ref().and_then(|op| op.lease_expires_at))
        .min()
        .unwrap_or(now_ms);
    Err(GroupFull {
        group: group.to_owned(),
        max,
        in_flight: busy.iter().map(|&i| def.steps[i].name.clone()).collect(),
        until_ms,
    })
}

/// What the group of steps `span` (named `group`) needs next; `None` when every branch
/// SUCCEEDED (the join: the step after it runs).
pub(super) fn next_group(
    inst: &InstanceRecord,
    def: &Definition,
    checkpoints: &[Checkpoint],
    group: &str,
    span: Range<usize>,
    now_ms: i64,
) -> Option<Next> {
    let settings = def.group_def(group);
    let (mut runs, mut waits, mut in_flight) = (Vec::new(), Vec::new(), 0usize);
    for index in span.clone() {
        in_flight += usize::from(is_in_flight(&checkpoints[index], now_ms));
        match step_next(inst, def, checkpoints, index, now_ms) {
            None => {}
            Some(run @ (Next::Run { .. } | Next::Redo { .. })) => runs.push(run),
            Some(wait @ (Next::Wait { .. } | Next::WaitForCaller { .. })) => waits.push(wait),
            Some(stop) => {
                let label = |i: usize| format!("branch {:?} of group {group:?}", def.steps[i].name);
                return Some(stopped(def, checkpoints, &label, settings.on_failure, span.end, stop));
            }
        }
    }
    let room = settings.max_concurrency.map_or(usize::MAX, |m| (m as usize).saturating_sub(in_flight));
    runs.truncate(room);
    match runs.len() {
        0 => waits.into_iter().min_by_key(until),
        1 => runs.pop(),
        _ => Some(Next::Parallel { runs }),
    }
}

/// When a wait ends.
pub(super) fn until(next: &Next) -> i64 {
    match next {
        Next::Wait { until_ms, .. } | Next::WaitForCaller { until_ms, .. } => *until_ms,
        _ => i64::MAX,
    }
}

/// A branch of `group` stopped with `stop` (a final failure, an input that cannot be
/// built, an UNKNOWN outcome its policy leaves to a person or to compensation, a key
/// conflict): what `on_failure` makes of it. A key conflict always pauses: the operation
/// under the branch's key is not its effect, and only a person can tell what to do.
pub(super) fn stopped(
    def: &Definition,
    checkpoints: &[Checkpoint],
    label: &dyn Fn(usize) -> String,
    on_failure: GroupFailure,
    end: usize,
    stop: Next,
) -> Next {
    let (index, class, reason) = match stop {
        Next::Pause { class: "step_key_conflict", .. } => return stop,
        Next::Pause { index, class, reason } => (index, class, reason),
        Next::Finish { index: Some(index), class: Some(class), reason, .. } => {
            (index, if class == "step_failed" { "branch_failed" } else { class }, reason)
        }
        Next::BeginCompensation { index, reason } => (index, "branch_unknown", reason),
        other => return other,
    };
    let what = label(index);
    match on_failure {
        GroupFailure::Pause => Next::Pause {
            index,
            class,
            reason: format!(
                "{what}: {reason}; it pauses the instance (on_failure = pause), the others keep their states"
            ),
        },
        GroupFailure::Compensate => {
            let reason = format!("{what}: {reason} (on_failure = compensate)");
            failed_finally(def, checkpoints, index, end, reason)
        }
    }
}

/// The state of every parallel group of `def` given its checkpoints, in definition order:
/// `(group, its state, its branches' indexes)`, for `wf get` and the admin page.
pub fn groups_of(def: &Definition, checkpoints: &[Checkpoint]) -> Vec<(String, GroupState, Range<usize>)> {
    let mut out = Vec::new();
    let mut index = 0;
    while index < def.steps.len() {
        let span = def.span(index);
        if let Some(group) = &def.steps[index].group {
            let states: Vec<StepState> =
                checkpoints.get(span.clone()).unwrap_or_default().iter().map(|c| c.state).collect();
            out.push((group.clone(), GroupState::of(&states), span.clone()));
        }
        index = span.end.max(index + 1);
    }
    out
}

#[cfg(test)]
mod tests;
