//! Instance and step states, and the legal moves between them (DESIGN.md §8).
//!
//! ```text
//! instance  from           to                               by
//!           (new)          RUNNING                          start
//!           RUNNING        SUCCEEDED                        last step SUCCEEDED
//!           RUNNING        FAILED                           a step FAILED (final) / input error
//!           RUNNING        PAUSED                           a step needs a person
//!           RUNNING        COMPENSATING                     a later step failed; compensations run
//!           PAUSED         RUNNING                          the step was resolved, or a re-run
//!           PAUSED         FAILED | COMPENSATING            an operator gives up / compensates
//!           FAILED         RUNNING | COMPENSATING           an operator's re-run / compensation
//!           SUCCEEDED      RUNNING                          an operator's re-run naming a step
//!           COMPENSATING   COMPENSATED | PAUSED             compensations done / one failed
//!
//! step      NOT_STARTED    EXECUTING                        its operation is acquired
//!           then the operation's own moves (idem_core::State::can_become);
//!           SUCCEEDED      COMPENSATED                      its compensation SUCCEEDED
//! ```
//! SUCCEEDED, FAILED and COMPENSATED are final for an instance: nothing automatic leaves
//! them, only an operator's audited re-run.

use crate::State;
use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// The state of a workflow instance. Stored and shown upper-case.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum InstanceState {
    /// Steps are being performed (or waited for).
    Running,
    /// Every step SUCCEEDED.
    Succeeded,
    /// A step failed finally (or its input could not be built); nothing more runs.
    Failed,
    /// Waiting for a person: a step's outcome is UNKNOWN under the `manual` policy, its
    /// lookups were inconclusive, or a compensation failed. The step is in the review queue.
    Paused,
    /// Compensations of succeeded steps are running, in reverse order.
    Compensating,
    /// Every compensation needed SUCCEEDED.
    Compensated,
}

impl InstanceState {
    /// Every state.
    pub const ALL: [InstanceState; 6] = [
        InstanceState::Running,
        InstanceState::Succeeded,
        InstanceState::Failed,
        InstanceState::Paused,
        InstanceState::Compensating,
        InstanceState::Compensated,
    ];

    /// The upper-case name used in storage and in the API.
    pub fn as_str(self) -> &'static str {
        match self {
            InstanceState::Running => "RUNNING",
            InstanceState::Succeeded => "SUCCEEDED",
            InstanceState::Failed => "FAILED",
            InstanceState::Paused => "PAUSED",
            InstanceState::Compensating => "COMPENSATING",
            InstanceState::Compensated => "COMPENSATED",
        }
    }

    /// SUCCEEDED, FAILED, COMPENSATED: nothing automatic leaves them (retention applies).
    pub fn is_final(self) -> bool {
        matches!(self, InstanceState::Succeeded | InstanceState::Failed | InstanceState::Compensated)
    }

    /// Whether `self → to` is legal (the table in the module docs).
    pub fn can_become(self, to: InstanceState) -> bool {
        use InstanceState::*;
        matches!(
            (self, to),
            (Running, Succeeded | Failed | Paused | Compensating)
                | (Paused, Running | Failed | Compensating)
                | (Failed, Running | Compensating)
                | (Succeeded, Running)
                | (Compensating, Compensated | Paused)
        )
    }
}

impl fmt::Display for InstanceState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(self.as_str())
    }
}

/// The text was not an instance state.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown workflow state {0:?}: expected one of RUNNING, SUCCEEDED, FAILED, PAUSED, COMPENSATING, COMPENSATED")]
pub struct ParseInstanceStateError(pub String);

impl FromStr for InstanceState {
    type Err = ParseInstanceStateError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        InstanceState::ALL
            .into_iter()
            .find(|st| st.as_str().eq_ignore_ascii_case(s))
            .ok_or_else(|| ParseInstanceStateError(s.to_owned()))
    }
}

/// The state of one step: its operation's state, or NOT_STARTED before its operation
/// exists, or COMPENSATED once its compensation SUCCEEDED.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum StepState {
    /// No operation yet.
    NotStarted,
    /// The operation waits for a retry (or was reconciled absent).
    Pending,
    /// A worker holds the step's lease.
    Executing,
    /// The step's effect happened (with evidence).
    Succeeded,
    /// The step failed finally.
    Failed,
    /// Nobody knows whether the step's effect happened.
    Unknown,
    /// The step succeeded and its compensation succeeded.
    Compensated,
}

impl StepState {
    /// Every state.
    pub const ALL: [StepState; 7] = [
        StepState::NotStarted,
        StepState::Pending,
        StepState::Executing,
        StepState::Succeeded,
        StepState::Failed,
        StepState::Unknown,
        StepState::Compensated,
    ];

    /// The upper-case name shown in the API.
    pub fn as_str(self) -> &'static str {
        match self {
            StepState::NotStarted => "NOT_STARTED",
            StepState::Pending => "PENDING",
            StepState::Executing => "EXECUTING",
            StepState::Succeeded => "SUCCEEDED",
            StepState::Failed => "FAILED",
            StepState::Unknown => "UNKNOWN",
            StepState::Compensated => "COMPENSATED",
        }
    }

    /// The step state of an operation in `state` (`None`: no operation yet).
    pub fn of_operation(state: Option<State>) -> StepState {
        match state {
            None => StepState::NotStarted,
            Some(State::Pending) => StepState::Pending,
            Some(State::Executing) => StepState::Executing,
            Some(State::Succeeded) => StepState::Succeeded,
            Some(State::Failed) => StepState::Failed,
            Some(State::Unknown) => StepState::Unknown,
        }
    }

    /// Whether `self → to` is legal: NOT_STARTED → EXECUTING, the operation's own moves,
    /// and SUCCEEDED → COMPENSATED.
    pub fn can_become(self, to: StepState) -> bool {
        let op = |s: StepState| match s {
            StepState::Pending => Some(State::Pending),
            StepState::Executing => Some(State::Executing),
            StepState::Succeeded => Some(State::Succeeded),
            StepState::Failed => Some(State::Failed),
            StepState::Unknown => Some(State::Unknown),
            StepState::NotStarted | StepState::Compensated => None,
        };
        match (self, to) {
            (StepState::NotStarted, StepState::Executing) => true,
            (StepState::Succeeded, StepState::Compensated) => true,
            (a, b) => match (op(a), op(b)) {
                (Some(a), Some(b)) => a.can_become(b),
                _ => false,
            },
        }
    }
}

impl fmt::Display for StepState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every pair, both ways: the legal moves are exactly the table's.
    #[test]
    fn instance_moves_are_exactly_the_table() {
        use InstanceState::*;
        let legal = [
            (Running, Succeeded),
            (Running, Failed),
            (Running, Paused),
            (Running, Compensating),
            (Paused, Running),
            (Paused, Failed),
            (Paused, Compensating),
            (Failed, Running),
            (Failed, Compensating),
            (Succeeded, Running),
            (Compensating, Compensated),
            (Compensating, Paused),
        ];
        for a in InstanceState::ALL {
            for b in InstanceState::ALL {
                assert_eq!(a.can_become(b), legal.contains(&(a, b)), "{a} -> {b}");
            }
        }
        assert!(!Compensated.can_become(Running), "compensated is the end");
    }

    #[test]
    fn step_moves_are_the_operations_plus_start_and_compensation() {
        use StepState::*;
        let legal = [
            (NotStarted, Executing),
            (Pending, Executing),
            (Pending, Succeeded),
            (Pending, Failed),
            (Executing, Succeeded),
            (Executing, Failed),
            (Executing, Pending),
            (Executing, Unknown),
            (Executing, Executing),
            (Unknown, Succeeded),
            (Unknown, Pending),
            (Unknown, Failed),
            (Succeeded, Compensated),
        ];
        for a in StepState::ALL {
            for b in StepState::ALL {
                assert_eq!(a.can_become(b), legal.contains(&(a, b)), "{a} -> {b}");
            }
        }
    }

    #[test]
    fn names_round_trip() {
        for s in InstanceState::ALL {
            assert_eq!(s.as_str().parse::<InstanceState>().unwrap(), s);
        }
        assert!("DONE".parse::<InstanceState>().is_err());
        for s in State::ALL {
            assert_eq!(StepState::of_operation(Some(s)).as_str(), s.as_str());
        }
    }
}
