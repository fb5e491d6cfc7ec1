//! What to do with a step whose outcome is UNKNOWN, per its recovery policy. Never "redo
//! blindly": a redo needs the `redo_safe` declaration or a lookup that proved absence (the
//! reconciler's answer, which moves the operation to PENDING by itself).
//!
//! | step's operation                 | redo_safe | lookup_before_redo  | manual | compensate  |
//! |----------------------------------|-----------|---------------------|--------|-------------|
//! | UNKNOWN, in the review queue     | pause     | pause               | pause  | pause       |
//! | UNKNOWN                          | redo      | wait for the lookup | pause  | compensate  |
//! | UNKNOWN, performed by the caller | pause     | (not allowed)       | pause  | pause       |
//!
//! `compensate` runs the compensations of this step (its effect may exist) and of the
//! earlier steps, last first; a compensation must therefore tolerate an effect that does
//! not exist (cancelling an order that was never created is a no-op, or a final 4xx the
//! operator resolves).
//!
//! A worker that died mid-step leaves an EXECUTING operation whose lease ran out: the
//! engine acquires it like any trigger, which records the expiry (UNKNOWN) or, for a
//! `redo_safe` step, re-grants it — the same claim as a first run.
//!
//! **Before a compensation undoes anything** ([`settle_before_compensation`]), every
//! step, branch and item whose effect may still come into being, or whose outcome is
//! UNKNOWN, settles first, so that compensation covers exactly the effects that exist:
//!
//! | operation of a step, branch or item              | the compensation           |
//! |--------------------------------------------------|----------------------------|
//! | EXECUTING (lease live, or lapsed: the sweeper records UNKNOWN) | waits        |
//! | UNKNOWN, policy `compensate`                     | undoes it (it may exist)   |
//! | UNKNOWN, `lookup_before_redo` or `redo_safe`     | waits for the reconciler's lookup |
//! | UNKNOWN, `manual`, in the review queue, or performed by the caller | pauses (`compensation_unknown`) until a person resolves it |
//! | UNKNOWN, and the step has no compensation        | does not wait (nothing to undo) |
//! | PENDING (a retry or a redo not yet run), performed by idem | closes it FAILED first (`Next::Abandon`): nothing new is performed while compensating |
//!
//! An UNKNOWN `redo_safe` step is not redone while compensating (that would make an effect
//! only to undo it): the reconciler's lookup settles it — found: SUCCEEDED, and it is
//! undone; absent: PENDING, then closed as above — or, on a connector without a lookup,
//! sends it to the review queue, and a person resolves it: SUCCEEDED (its compensation then
//! runs) or FAILED. (A `redo_safe` operation whose lease lapsed is re-granted by the
//! executor as for any trigger — its declaration says a repeat is harmless — and the
//! compensation waits for that attempt.)

use super::definition::{Definition, RecoveryPolicy, StepDef};
use super::plan::{EXPIRY_POLL_MS, Next, needs_compensation};
use super::record::Checkpoint;
use crate::State;
use crate::record::OperationRecord;

/// Shortest wait before looking again at a step whose lookup is pending (ms).
pub const LOOKUP_POLL_MS: i64 = 1_000;

/// The answer of [`plan_recovery`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Recovery {
    /// Move the operation to PENDING (an audited system resolution) and run it again.
    Redo,
    /// The reconciler asks the provider; look at the step again at `until_ms`.
    AwaitLookup {
        /// When (epoch ms).
        until_ms: i64,
    },
    /// Compensate: undo this step's possible effect and the earlier steps' (policy
    /// `compensate`).
    Compensate {
        /// Why.
        reason: String,
    },
    /// Pause the instance for a person.
    Pause {
        /// Class of the reason (`needs_review`, `unknown_manual`, …).
        class: &'static str,
        /// The reason, in words.
        reason: String,
    },
}

/// The recovery of `step` whose operation `op` is UNKNOWN, at `now_ms`.
pub fn plan_recovery(step: &StepDef, op: &OperationRecord, now_ms: i64) -> Recovery {
    debug_assert_eq!(op.state, State::Unknown);
    let why = op.error_message.as_deref().unwrap_or("outcome unknown");
    if op.needs_review {
        return Recovery::Pause {
            class: "needs_review",
            reason: format!("step {:?} is in the review queue: {why}", step.name),
        };
    }
    if step.connector.is_none() {
        return Recovery::Pause {
            class: "unknown_caller",
            reason: format!("step {:?} (performed by your code) ended UNKNOWN: {why}", step.name),
        };
    }
    match step.policy {
        RecoveryPolicy::RedoSafe => Recovery::Redo,
        RecoveryPolicy::LookupBeforeRedo => {
            Recovery::AwaitLookup { until_ms: op.next_attempt_at.unwrap_or(now_ms).max(now_ms + LOOKUP_POLL_MS) }
        }
        RecoveryPolicy::Manual => Recovery::Pause {
            class: "unknown_manual",
            reason: format!("step {:?} ended UNKNOWN and its policy is manual: {why}", step.name),
        },
        RecoveryPolicy::Compensate => Recovery::Compensate {
            reason: format!(
                "step {:?} ended UNKNOWN and its policy is compensate: its effect (if any) and the earlier ones are undone: {why}",
                step.name
            ),
        },
    }
}

/// What a compensating instance waits for before it undoes anything (see the module's
/// table): `None` when every step, branch and item of `def` has settled; else a
/// [`Next::Pause`] (class `compensation_unknown`) for the first that needs a person, or the
/// earliest [`Next::Wait`].
pub(super) fn settle_before_compensation(def: &Definition, checkpoints: &[Checkpoint], now_ms: i64) -> Option<Next> {
    let mut waits = Vec::new();
    for (index, (step, c)) in def.steps.iter().zip(checkpoints).enumerate() {
        let one = |cp: &Checkpoint, label: String| settle(step, index, cp, &label, now_ms);
        let found: Vec<(Next, Option<String>)> = if c.items.is_empty() {
            let label = match &step.group {
                Some(g) => format!("branch {:?} of group {g:?}", step.name),
                None => format!("step {:?}", step.name),
            };
            one(c, label).into_iter().map(|n| (n, None)).collect()
        } else {
            c.items
                .iter()
                .filter_map(|i| {
                    let next = one(&i.as_checkpoint(), format!("item {:?} of step {:?}", i.row.item, step.name))?;
                    Some((next, Some(i.row.item.clone())))
                })
                .collect()
        };
        for (next, item) in found {
            match next {
                pause @ Next::Pause { .. } => return Some(pause),
                Next::Abandon { index } => {
                    let abandon = Next::Abandon { index };
                    return Some(match item {
                        Some(item) => Next::Item { item, next: Box::new(abandon) },
                        None => abandon,
                    });
                }
                wait => waits.push(wait),
            }
        }
    }
    waits.into_iter().min_by_key(super::group::until)
}

/// [`settle_before_compensation`] for one checkpoint `c` of step `index` (`label` names it).
fn settle(step: &StepDef, index: usize, c: &Checkpoint, label: &str, now_ms: i64) -> Option<Next> {
    let op = c.operation.as_ref().filter(|_| c.foreign_step_operation(step).is_none())?;
    match op.state {
        State::Executing => Some(Next::Wait {
            index,
            until_ms: op.lease_expires_at.filter(|end| *end > now_ms).unwrap_or(now_ms + EXPIRY_POLL_MS),
        }),
        State::Pending if step.connector.is_some() => Some(Next::Abandon { index }),
        State::Unknown if step.compensation.is_none() || needs_compensation(step, c) => None,
        State::Unknown => {
            let cause = match plan_recovery(step, op, now_ms) {
                Recovery::AwaitLookup { until_ms } => return Some(Next::Wait { index, until_ms }),
                Recovery::Redo => {
                    let until_ms = op.next_attempt_at.unwrap_or(now_ms).max(now_ms + LOOKUP_POLL_MS);
                    return Some(Next::Wait { index, until_ms });
                }
                Recovery::Compensate { .. } => return None,
                Recovery::Pause { class: "needs_review", .. } => "it is in the review queue",
                Recovery::Pause { class: "unknown_caller", .. } => "it is performed by your code",
                Recovery::Pause { .. } => "its policy is manual",
            };
            let why = op.error_message.as_deref().unwrap_or("outcome unknown");
            Some(Next::Pause {
                index,
                class: "compensation_unknown",
                reason: format!(
                    "the compensation waits for {label}, whose outcome is UNKNOWN ({why}; {cause}): resolve its operation {:?} as SUCCEEDED (its compensation then runs) or FAILED (nothing to undo)",
                    op.key
                ),
            })
        }
        _ => None,
    }
}
