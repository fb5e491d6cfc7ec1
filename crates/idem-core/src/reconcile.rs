//! Settling UNKNOWN operations: by asking the provider (reconciliation, DESIGN.md §5) or by
//! an operator's resolution.
//!
//! Reconciliation ([`plan_reconciliation`]) moves a record only on evidence:
//! - [`Lookup::Found`] ⇒ SUCCEEDED with the provider's reference, `verified_at` and
//!   `evidence_source = "lookup"`;
//! - [`Lookup::Absent`] (the provider proves it did not happen) ⇒ PENDING, eligible again —
//!   or FAILED once the operation's attempts or retry time are used up (`policy`'s
//!   `max_attempts`, `max_elapsed_ms`), so an attempt that keeps ending UNKNOWN (a timeout,
//!   an HTTP 504) is not retried without end;
//! - [`Lookup::Inconclusive`] ⇒ stays UNKNOWN, the attempt logged, the next lookup
//!   scheduled with backoff; after `max_lookups` the record is flagged `needs_review`;
//! - [`Lookup::TooEarly`] ⇒ stays as it is; asked again later, not counted.
//!   Nothing ever writes SUCCEEDED to make the question go away (invariant 2).
//!
//! Resolution ([`plan_resolution`]) is the operator's override, audited with a mandatory
//! reason; SUCCEEDED needs an evidence reference.

use crate::State;
use crate::record::{Actor, EventKind, OperationEvent, OperationRecord};
use crate::retry::RetryPolicy;

/// What the provider says about an operation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Lookup {
    /// The side effect happened; the provider's reference for it.
    Found { provider_ref: String },
    /// The provider proves the side effect did not happen.
    Absent,
    /// The provider could not tell (or could not be asked); why.
    Inconclusive { why: String },
    /// Not found, but too soon after the attempt for that to prove absence (a provider may
    /// still be processing, a mail still be in transit): ask again in `retry_in_ms`. Does
    /// not count towards `max_lookups`.
    TooEarly { why: String, retry_in_ms: i64 },
}

/// Plans the reconciliation of `rec` with the provider's answer `lookup`, at `now_ms`.
///
/// Applies to UNKNOWN records and to EXECUTING records whose lease expired (the worker may
/// have acted). `policy` spaces out inconclusive lookups and bounds the attempts an absent
/// answer allows; `max_lookups` inconclusive answers flag the record for review. Returns `None` when the record is in no state to be
/// reconciled (a valid lease, or already settled) — nothing is written then.
pub fn plan_reconciliation(
    rec: &OperationRecord,
    lookup: &Lookup,
    actor: &Actor,
    policy: &RetryPolicy,
    max_lookups: i64,
    jitter: f64,
    now_ms: i64,
) -> Option<(OperationRecord, OperationEvent)> {
    let eligible = rec.state == State::Unknown || (rec.state == State::Executing && !rec.lease_valid_at(now_ms));
    if !eligible {
        return None;
    }
    let mut next = rec.clone();
    next.lease_expires_at = None;
    next.updated_at = now_ms;
    next.version += 1;
    let mut ev = actor.event(rec, EventKind::Reconciled, now_ms);
    ev.from_state = Some(rec.state);
    ev.fencing_token = Some(rec.fencing_token);
    match lookup {
        Lookup::Found { provider_ref } => {
            next.state = State::Succeeded;
            next.provider_ref = Some(provider_ref.clone());
            next.verified_at = Some(now_ms);
            next.evidence_source = Some("lookup".into());
            next.completed_at = Some(now_ms);
            next.needs_review = false;
            next.next_attempt_at = None;
            next.error_class = None;
            next.error_message = None;
            ev.reason = Some(format!("lookup found the side effect: provider_ref {provider_ref}"));
        }
        Lookup::Absent => {
            next.lookup_attempts = 0;
            next.needs_review = false;
            let elapsed_out = policy.max_elapsed_ms.is_some_and(|max| now_ms - rec.created_at > max);
            if rec.attempt_count >= policy.max_attempts || elapsed_out {
                next.state = State::Failed;
                next.next_attempt_at = None;
                next.completed_at = Some(now_ms);
                ev.reason = Some(format!(
                    "lookup proved the side effect absent; retry {} reached after {} attempts",
                    if elapsed_out { "time limit" } else { "limit" },
                    rec.attempt_count
                ));
            } else {
                next.state = State::Pending;
                next.next_attempt_at = Some(now_ms);
                ev.reason = Some("lookup proved the side effect absent: eligible for another attempt".into());
            }
        }
        Lookup::TooEarly { why, retry_in_ms } => {
            next.state = rec.state;
            next.updated_at = rec.updated_at; // the attempt in doubt still ended then
            let wait = (*retry_in_ms).max(1);
            next.next_attempt_at = Some(now_ms + wait);
            ev.wait_ms = Some(wait);
            ev.reason = Some(format!("lookup too early: {why}"));
        }
        Lookup::Inconclusive { why } => {
            next.state = State::Unknown;
            // Only the lookup schedule changes: `updated_at` keeps marking when the
            // attempt in doubt ended, which "too early" checks count from.
            next.updated_at = rec.updated_at;
            next.lookup_attempts += 1;
            let wait = policy.delay_ms(next.lookup_attempts, jitter, None);
            next.next_attempt_at = Some(now_ms + wait);
            ev.wait_ms = Some(wait);
            if next.lookup_attempts >= max_lookups {
                next.needs_review = true;
            }
            ev.reason = Some(format!(
                "lookup {} inconclusive: {why}{}",
                next.lookup_attempts,
                if next.needs_review { "; flagged for review" } else { "" }
            ));
        }
    }
    ev.to_state = Some(next.state);
    Some((next, ev))
}

/// Why an operator's resolution was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ResolveError {
    /// The record is final, or a worker holds a valid lease.
    #[error(
        "an operation that is {state} cannot be resolved (only UNKNOWN, PENDING or an EXECUTING one whose lease expired)"
    )]
    NotResolvable { state: State },
    /// The target state is not one an operator may set.
    #[error("resolve to SUCCEEDED, PENDING or FAILED, not {0}")]
    BadTarget(State),
    /// No reason given.
    #[error("a resolution needs a reason")]
    MissingReason,
    /// SUCCEEDED without an evidence reference.
    #[error("resolving to SUCCEEDED needs an evidence reference (--evidence / \"evidence\")")]
    MissingEvidence,
    /// The reason or the evidence is longer than allowed.
    #[error(
        "the reason may have at most {MAX_REASON_LEN} bytes and the evidence at most {} bytes",
        crate::completion::MAX_PROVIDER_REF_LEN
    )]
    TooLong,
    /// The evidence (it becomes the provider reference) holds control characters, or the
    /// reason holds U+0000 (NUL), which PostgreSQL text cannot store.
    #[error("the evidence must not contain control characters, nor the reason U+0000 (NUL)")]
    ControlCharacters,
    /// The operator saw another state than the record has now (another resolution, a late
    /// completion or a lookup came first): nothing is written, so no decision overwrites one
    /// its author never saw.
    #[error("the operation is {actual} now, not {expected} as when you looked; look again before resolving")]
    StateChanged { expected: State, actual: State },
}

/// Longest resolution reason, in bytes.
pub const MAX_REASON_LEN: usize = 2000;

/// Plans an operator's resolution of `rec` to `to` (SUCCEEDED, PENDING or FAILED).
/// `expected` is the state the operator saw: when given and the record is in another
/// state now, the resolution is refused ([`ResolveError::StateChanged`]), a
/// compare-and-set on the state an operator decided from.
///
/// # Errors
/// A [`ResolveError`]; nothing may be written then.
pub fn plan_resolution(
    rec: &OperationRecord,
    to: State,
    expected: Option<State>,
    reason: &str,
    evidence: Option<&str>,
    actor: &Actor,
    now_ms: i64,
) -> Result<(OperationRecord, OperationEvent), ResolveError> {
    if !matches!(to, State::Succeeded | State::Pending | State::Failed) {
        return Err(ResolveError::BadTarget(to));
    }
    if let Some(expected) = expected
        && expected != rec.state
    {
        return Err(ResolveError::StateChanged { expected, actual: rec.state });
    }
    if reason.len() > MAX_REASON_LEN || evidence.is_some_and(|e| e.len() > crate::completion::MAX_PROVIDER_REF_LEN) {
        return Err(ResolveError::TooLong);
    }
    if evidence.is_some_and(|e| e.chars().any(char::is_control)) || reason.contains('\0') {
        return Err(ResolveError::ControlCharacters);
    }
    let resolvable = matches!(rec.state, State::Unknown | State::Pending)
        || (rec.state == State::Executing && !rec.lease_valid_at(now_ms));
    if !resolvable {
        return Err(ResolveError::NotResolvable { state: rec.state });
    }
    let reason = reason.trim();
    if reason.is_empty() {
        return Err(ResolveError::MissingReason);
    }
    let evidence = evidence.map(str::trim).filter(|e| !e.is_empty());
    let mut next = rec.clone();
    next.lease_expires_at = None;
    next.needs_review = false;
    next.updated_at = now_ms;
    next.version += 1;
    match to {
        State::Succeeded => {
            let Some(evidence) = evidence else {
                return Err(ResolveError::MissingEvidence);
            };
            next.state = State::Succeeded;
            next.provider_ref = Some(evidence.to_owned());
            next.evidence_source = Some("operator".into());
            next.verified_at = Some(now_ms);
            next.completed_at = Some(now_ms);
            next.next_attempt_at = None;
        }
        State::Pending => {
            next.state = State::Pending;
            next.next_attempt_at = Some(now_ms);
            next.lookup_attempts = 0;
        }
        State::Failed => {
            next.state = State::Failed;
            next.error_class = Some("operator_resolved".into());
            next.error_message = Some(reason.to_owned());
            next.completed_at = Some(now_ms);
            next.next_attempt_at = None;
        }
        other => return Err(ResolveError::BadTarget(other)),
    }
    let mut ev = actor.event(rec, EventKind::Resolved, now_ms);
    ev.from_state = Some(rec.state);
    ev.to_state = Some(next.state);
    ev.fencing_token = Some(rec.fencing_token);
    ev.reason = Some(match evidence {
        Some(e) => format!("operator resolution: {reason} (evidence {e})"),
        None => format!("operator resolution: {reason}"),
    });
    Ok((next, ev))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decision::{AcquireInput, plan_acquire};
    use serde_json::json;

    fn unknown() -> OperationRecord {
        let input = AcquireInput {
            tenant: "t".into(),
            key: "k".into(),
            action: "send".into(),
            payload: json!({}),
            fingerprint: "f".into(),
            lease_ms: 1000,
            redo_safe: false,
            connector: Some("mail".into()),
            holder: None,
            actor: Actor::default(),
        };
        let mut r = plan_acquire(None, &input, 0).record;
        r.state = State::Unknown;
        r.lease_expires_at = None;
        r
    }

    fn rec(r: &OperationRecord, l: Lookup, now: i64) -> Option<(OperationRecord, OperationEvent)> {
        plan_reconciliation(r, &l, &Actor::system(), &RetryPolicy::default(), 3, 0.5, now)
    }

    #[test]
    fn found_is_success_with_evidence_absent_is_pending() {
        let (s, ev) = rec(&unknown(), Lookup::Found { provider_ref: "m1".into() }, 50).unwrap();
        assert_eq!(s.state, State::Succeeded);
        assert_eq!(
            (s.provider_ref.as_deref(), s.evidence_source.as_deref(), s.verified_at),
            (Some("m1"), Some("lookup"), Some(50))
        );
        assert_eq!(ev.kind, "reconciled");
        let (p, _) = rec(&unknown(), Lookup::Absent, 50).unwrap();
        assert_eq!((p.state, p.next_attempt_at), (State::Pending, Some(50)));
        assert_eq!(p.fencing_token, 1, "no grant yet: the next acquire grants token 2");
    }

    /// An attempt that keeps ending UNKNOWN (e.g. a provider that answers 500 and never
    /// acts, proven absent each time) is not retried without end: absence after the last
    /// allowed attempt (or past the retry time limit) is FAILED.
    #[test]
    fn absent_after_the_last_attempt_is_failed_not_another_attempt() {
        let mut last = unknown();
        last.attempt_count = RetryPolicy::default().max_attempts;
        let (f, ev) = rec(&last, Lookup::Absent, 50).unwrap();
        assert_eq!((f.state, f.completed_at, f.next_attempt_at), (State::Failed, Some(50), None));
        assert!(ev.reason.unwrap().contains("retry limit reached after 8 attempts"));
        let timed = RetryPolicy { max_elapsed_ms: Some(100), ..RetryPolicy::default() };
        let r = unknown();
        let early = plan_reconciliation(&r, &Lookup::Absent, &Actor::system(), &timed, 3, 0.5, 100).unwrap().0;
        assert_eq!(early.state, State::Pending);
        let late = plan_reconciliation(&r, &Lookup::Absent, &Actor::system(), &timed, 3, 0.5, 101).unwrap().0;
        assert_eq!(late.state, State::Failed);
    }

    #[test]
    fn inconclusive_stays_unknown_and_flags_review_after_n() {
        let mut r = unknown();
        for i in 1..=3 {
            let (next, _) = rec(&r, Lookup::Inconclusive { why: "imap down".into() }, 100).unwrap();
            assert_eq!(next.state, State::Unknown);
            assert_eq!(next.lookup_attempts, i);
            assert_eq!(next.needs_review, i >= 3);
            assert!(next.next_attempt_at.unwrap() >= 100);
            r = next;
        }
        assert!(r.provider_ref.is_none(), "never SUCCEEDED without evidence");
    }

    #[test]
    fn valid_leases_and_final_records_are_not_reconciled() {
        let mut r = unknown();
        r.state = State::Executing;
        r.lease_expires_at = Some(1000);
        assert!(rec(&r, Lookup::Absent, 10).is_none());
        assert!(rec(&r, Lookup::Absent, 1000).is_some(), "expired lease: reconcilable");
        r.state = State::Succeeded;
        assert!(rec(&r, Lookup::Absent, 5000).is_none());
    }

    #[test]
    fn resolution_needs_reason_and_evidence_for_success() {
        let a = Actor::default();
        let r = unknown();
        assert_eq!(
            plan_resolution(&r, State::Succeeded, None, " ", Some("e"), &a, 1).unwrap_err(),
            ResolveError::MissingReason
        );
        assert_eq!(
            plan_resolution(&r, State::Succeeded, None, "checked", None, &a, 1).unwrap_err(),
            ResolveError::MissingEvidence
        );
        let (s, ev) = plan_resolution(&r, State::Succeeded, None, "checked the mailbox", Some("msg-9"), &a, 1).unwrap();
        assert_eq!((s.state, s.evidence_source.as_deref()), (State::Succeeded, Some("operator")));
        assert!(ev.reason.unwrap().contains("checked the mailbox"));
        assert!(matches!(
            plan_resolution(&s, State::Pending, None, "again", None, &a, 2),
            Err(ResolveError::NotResolvable { .. })
        ));
        assert_eq!(
            plan_resolution(&r, State::Unknown, None, "x", None, &a, 1).unwrap_err(),
            ResolveError::BadTarget(State::Unknown)
        );
        assert_eq!(
            plan_resolution(&s, State::Executing, None, "x", None, &a, 2).unwrap_err(),
            ResolveError::BadTarget(State::Executing),
            "a bad target is named even when the state is not resolvable"
        );
        let (f, _) = plan_resolution(&r, State::Failed, None, "customer cancelled", None, &a, 1).unwrap();
        assert_eq!(f.error_message.as_deref(), Some("customer cancelled"));
    }

    #[test]
    fn resolution_is_refused_when_the_state_moved_or_the_text_is_too_long() {
        let a = Actor::default();
        let r = unknown();
        // Another operator made it PENDING after this one looked at UNKNOWN.
        let (pending, _) = plan_resolution(&r, State::Pending, Some(State::Unknown), "retry", None, &a, 1).unwrap();
        assert_eq!(
            plan_resolution(&pending, State::Failed, Some(State::Unknown), "give up", None, &a, 2).unwrap_err(),
            ResolveError::StateChanged { expected: State::Unknown, actual: State::Pending }
        );
        assert!(plan_resolution(&pending, State::Failed, Some(State::Pending), "give up", None, &a, 2).is_ok());
        let long = "x".repeat(MAX_REASON_LEN + 1);
        assert_eq!(plan_resolution(&r, State::Failed, None, &long, None, &a, 1).unwrap_err(), ResolveError::TooLong);
        let big_ref = "e".repeat(crate::completion::MAX_PROVIDER_REF_LEN + 1);
        assert_eq!(
            plan_resolution(&r, State::Succeeded, None, "ok", Some(&big_ref), &a, 1).unwrap_err(),
            ResolveError::TooLong
        );
        assert_eq!(
            plan_resolution(&r, State::Succeeded, None, "ok", Some("m-1\u{1b}[2J"), &a, 1).unwrap_err(),
            ResolveError::ControlCharacters
        );
    }
}
