//! Operation states and the legal transitions between them (DESIGN.md §2).
//!
//! ```text
//! (new) ─► EXECUTING                       acquire of a new key
//! PENDING ─► EXECUTING                     acquire when the retry is due
//! EXECUTING ─► SUCCEEDED | FAILED | PENDING | UNKNOWN     completion
//! EXECUTING ─► UNKNOWN                     lease expired (worker may have acted)
//! EXECUTING ─► EXECUTING                   lease expired, action redo_safe: re-grant
//! UNKNOWN ─► SUCCEEDED | PENDING | FAILED   reconciliation / operator resolution /
//!                                          late completion by the last lease holder
//! PENDING ─► SUCCEEDED | FAILED            operator resolution only (with a reason;
//!                                          SUCCEEDED with an evidence reference)
//! ```
//! SUCCEEDED and FAILED are final: nothing leaves them.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// The state of an operation record. Serialized upper-case, as in the HTTP API.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum State {
    /// Waiting for an attempt (new retry due at `next_attempt_at`, or reconciled absent).
    Pending,
    /// A worker holds the lease and may be performing the side effect.
    Executing,
    /// The side effect happened; the record carries evidence (`provider_ref`).
    Succeeded,
    /// Final failure; the side effect did not happen and will not be retried.
    Failed,
    /// Nobody knows whether the side effect happened: to be reconciled, never re-run blindly.
    Unknown,
}

impl State {
    /// Every state, in the order of the table in DESIGN.md §3.
    pub const ALL: [State; 5] = [State::Pending, State::Executing, State::Succeeded, State::Unknown, State::Failed];

    /// The upper-case name used in storage and in the API.
    pub fn as_str(self) -> &'static str {
        match self {
            State::Pending => "PENDING",
            State::Executing => "EXECUTING",
            State::Succeeded => "SUCCEEDED",
            State::Failed => "FAILED",
            State::Unknown => "UNKNOWN",
        }
    }

    /// SUCCEEDED and FAILED: nothing leaves these states.
    pub fn is_final(self) -> bool {
        matches!(self, State::Succeeded | State::Failed)
    }

    /// Whether `self → to` is a legal transition (the diagram in the module docs).
    pub fn can_become(self, to: State) -> bool {
        use State::*;
        matches!(
            (self, to),
            (Pending, Executing | Succeeded | Failed)
                | (Executing, Succeeded | Failed | Pending | Unknown | Executing)
                | (Unknown, Succeeded | Pending | Failed)
        )
    }
}

impl fmt::Display for State {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(self.as_str())
    }
}

/// The text was not one of PENDING, EXECUTING, SUCCEEDED, FAILED, UNKNOWN.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown state {0:?}: expected one of PENDING, EXECUTING, SUCCEEDED, FAILED, UNKNOWN")]
pub struct ParseStateError(pub String);

impl FromStr for State {
    type Err = ParseStateError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        State::ALL
            .into_iter()
            .find(|st| st.as_str().eq_ignore_ascii_case(s))
            .ok_or_else(|| ParseStateError(s.to_owned()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn final_states_have_no_exit() {
        for from in [State::Succeeded, State::Failed] {
            for to in State::ALL {
                assert!(!from.can_become(to), "{from} -> {to}");
            }
        }
    }

    #[test]
    fn unknown_is_never_re_executed_directly() {
        assert!(!State::Unknown.can_become(State::Executing));
        assert!(!State::Pending.can_become(State::Unknown));
    }

    #[test]
    fn parses_round_trip() {
        for s in State::ALL {
            assert_eq!(s.as_str().parse::<State>().unwrap(), s);
        }
        assert!("DONE".parse::<State>().is_err());
    }
}
