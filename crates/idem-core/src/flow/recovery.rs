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

use super::definition::{RecoveryPolicy, StepDef};
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
