//! What a trigger gets: the decision table of DESIGN.md §3 as one pure function
//! ([`decide`]), and [`plan_acquire`], which turns a decision into the record to write and
//! the events to append.
//!
//! Stores never decide anything themselves: they read the record, call [`plan_acquire`],
//! and write its plan with an atomic insert (`INSERT … ON CONFLICT DO NOTHING`) or a
//! conditional update (`… WHERE version = <read version>`), retrying from the read when
//! the condition fails. The table therefore holds on every store, and is property-tested
//! here once (tests/interleavings.rs).

use crate::State;
use crate::lease::{HolderId, held_by};
use crate::record::{Actor, EventKind, OperationEvent, OperationRecord};
use serde_json::Value;

/// Default lease length when the caller names none (ms).
pub const DEFAULT_LEASE_MS: i64 = 30_000;
/// Shortest lease a caller may ask for (ms).
pub const MIN_LEASE_MS: i64 = 100;
/// Longest lease a caller may ask for: one hour (ms).
pub const MAX_LEASE_MS: i64 = 3_600_000;

/// The answer to one trigger of an idempotency key (DESIGN.md §3).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Grant the lease: a new key, a due retry of PENDING, or an expired lease of a
    /// `redo_safe` action. HTTP 201.
    Acquire,
    /// SUCCEEDED or FAILED: answer with the stored result. HTTP 200 + `Idempotent-Replayed`.
    Replay,
    /// The trigger's own principal and holder identity hold the valid lease (a resent
    /// acquire whose reply was lost): its grant is returned unchanged — same fencing
    /// token, lease end and attempt. HTTP 201 with the same body as the first answer
    /// (DESIGN.md §2 invariant 6; see [`crate::lease`]).
    AlreadyHeld,
    /// Another worker holds a valid lease. HTTP 409; retry after `retry_after_ms`.
    InProgress { retry_after_ms: i64 },
    /// PENDING whose next attempt is not due yet. HTTP 409 + `Retry-After`.
    RetryNotDue { retry_after_ms: i64 },
    /// EXECUTING whose lease expired and whose action is not `redo_safe`: the worker may
    /// have acted, so the record becomes UNKNOWN and the trigger is answered as UNKNOWN.
    ExpireToUnknown,
    /// UNKNOWN: reconciliation pending, no new side effect. HTTP 202.
    Unknown,
    /// Same key, different fingerprint or action. HTTP 422; nothing changes.
    Mismatch,
    /// The record was removed after its retention window and only its tombstone is left:
    /// a late arrival. HTTP 410; nothing executes (see [`crate::retention`]).
    Late,
}

/// The table of DESIGN.md §3, for a trigger with `fingerprint` and `action` at `now_ms`,
/// sent by `holder` (its principal and holder identity, when it names one).
///
/// `existing` is the stored record, if any. The action and the connector count as part of
/// the intent: the same key with another action or connector is a mismatch, like another
/// fingerprint. A valid lease held by `holder` itself is [`Decision::AlreadyHeld`]; held by
/// anyone else, [`Decision::InProgress`].
pub fn decide(
    existing: Option<&OperationRecord>,
    fingerprint: &str,
    action: &str,
    connector: Option<&str>,
    holder: Option<HolderId<'_>>,
    now_ms: i64,
) -> Decision {
    let Some(rec) = existing else {
        return Decision::Acquire;
    };
    if rec.fingerprint != fingerprint || rec.action != action || rec.connector.as_deref() != connector {
        return Decision::Mismatch;
    }
    match rec.state {
        State::Pending => match rec.next_attempt_at {
            Some(at) if at > now_ms => Decision::RetryNotDue { retry_after_ms: at - now_ms },
            _ => Decision::Acquire,
        },
        State::Executing if held_by(rec, holder, now_ms) => Decision::AlreadyHeld,
        State::Executing => match rec.lease_expires_at {
            Some(at) if at > now_ms => Decision::InProgress { retry_after_ms: at - now_ms },
            _ if rec.redo_safe => Decision::Acquire,
            _ => Decision::ExpireToUnknown,
        },
        State::Succeeded | State::Failed => Decision::Replay,
        State::Unknown => Decision::Unknown,
    }
}

/// One trigger, as the API received it (already validated).
#[derive(Debug, Clone)]
pub struct AcquireInput {
    /// Tenant of the caller.
    pub tenant: String,
    /// Validated idempotency key.
    pub key: String,
    /// Action name (1–128 characters, checked by the API).
    pub action: String,
    /// The payload (kept with a new record).
    pub payload: Value,
    /// Fingerprint of the payload (see [`crate::fingerprint`]).
    pub fingerprint: String,
    /// Lease length asked for (ms), within [`MIN_LEASE_MS`]..=[`MAX_LEASE_MS`].
    pub lease_ms: i64,
    /// Whether the action may be redone after an expired lease.
    pub redo_safe: bool,
    /// Connector that executes the side effect (server-side execution); `None` = the
    /// caller performs it. Part of the intent, like the action.
    pub connector: Option<String>,
    /// The lease holder identity the trigger names (one attempt's UUID, checked at the
    /// entry points by [`crate::holder::validate_holder`]), scoped to `actor.principal`;
    /// `None` = anonymous (every other trigger is another worker). Kept on a grant of an
    /// operation the caller performs (no connector); see [`crate::lease`].
    pub holder: Option<String>,
    /// Who triggers, and through which request.
    pub actor: Actor,
}

impl AcquireInput {
    /// The trigger as a lease would know it: its principal and holder identity, if it
    /// names one.
    pub fn holder_id(&self) -> Option<HolderId<'_>> {
        self.holder.as_deref().map(|holder| HolderId { principal: &self.actor.principal, holder })
    }

    /// The record a new key starts from: PENDING, no grant yet, created now.
    ///
    /// Its fencing token starts at the creation instant (epoch ms), so the first grant is
    /// `now_ms + 1`. A key used again after its tombstone is gone (a new operation) thus
    /// never hands out a token an earlier operation under the same key handed out — as
    /// long as fewer grants were made than milliseconds passed between them (the
    /// retention and tombstone windows, days by default) — and a worker of the old
    /// operation cannot complete the new one.
    pub fn new_record(&self, now_ms: i64) -> OperationRecord {
        OperationRecord {
            tenant: self.tenant.clone(),
            key: self.key.clone(),
            action: self.action.clone(),
            fingerprint: self.fingerprint.clone(),
            payload: self.payload.clone(),
            state: State::Pending,
            attempt_count: 0,
            lease_owner: None,
            lease_holder: None,
            lease_expires_at: None,
            fencing_token: now_ms.max(0),
            next_attempt_at: None,
            provider_ref: None,
            result: None,
            error_class: None,
            error_message: None,
            verified_at: None,
            evidence_source: None,
            needs_review: false,
            redo_safe: self.redo_safe,
            connector: self.connector.clone(),
            lookup_attempts: 0,
            created_at: now_ms,
            updated_at: now_ms,
            completed_at: None,
            expires_at: None,
            version: 0,
        }
    }
}

/// What to write for one trigger.
#[derive(Debug, Clone)]
pub struct AcquirePlan {
    /// The answer.
    pub decision: Decision,
    /// The record after this trigger (the stored one, unchanged, unless `changed`).
    pub record: OperationRecord,
    /// Whether `record` differs from the stored one (a grant or a lease expiry).
    pub changed: bool,
    /// Events to append, in order (every trigger appends at least one).
    pub events: Vec<OperationEvent>,
}

/// Applies [`decide`] to `existing` and returns the plan to persist.
///
/// For [`Decision::Acquire`] the returned record is EXECUTING with `attempt_count + 1`,
/// `fencing_token + 1`, a lease of `input.lease_ms` from `now_ms`, the trigger's principal
/// as `lease_owner` and its holder identity as `lease_holder` (only when the caller
/// performs the effect: a connector's lease is idem's executor's). For
/// [`Decision::ExpireToUnknown`] it is UNKNOWN with the lease cleared. Otherwise it is the
/// stored record unchanged. The version is bumped whenever the record changes.
pub fn plan_acquire(existing: Option<&OperationRecord>, input: &AcquireInput, now_ms: i64) -> AcquirePlan {
    let decision =
        decide(existing, &input.fingerprint, &input.action, input.connector.as_deref(), input.holder_id(), now_ms);
    let mut record = existing.cloned().unwrap_or_else(|| input.new_record(now_ms));
    let from = existing.map(|r| r.state);
    let mut events = Vec::with_capacity(2);
    let ev = |kind: EventKind, rec: &OperationRecord| {
        let mut e = input.actor.event(rec, kind, now_ms);
        e.fingerprint = Some(input.fingerprint.clone());
        e.from_state = from;
        e.to_state = Some(rec.state);
        e.fencing_token = Some(rec.fencing_token);
        e
    };
    let changed = match decision {
        Decision::Acquire => {
            let prev_lease_expired = existing.is_some_and(|r| r.state == State::Executing);
            record.state = State::Executing;
            record.attempt_count += 1;
            record.fencing_token += 1;
            record.lease_owner = Some(input.actor.principal.clone());
            record.lease_holder = input.holder.clone().filter(|_| input.connector.is_none());
            record.lease_expires_at = Some(now_ms + input.lease_ms);
            record.next_attempt_at = None;
            let mut e = ev(EventKind::Acquired, &record);
            e.reason = Some(match (existing, prev_lease_expired) {
                (None, _) => "new key: lease granted".into(),
                (Some(_), true) => {
                    format!("lease expired; action is redo_safe: re-granted as attempt {}", record.attempt_count)
                }
                (Some(_), false) => format!("retry due: attempt {}", record.attempt_count),
            });
            events.push(e);
            true
        }
        Decision::ExpireToUnknown => {
            expire_into_unknown(&mut record);
            let mut e = ev(EventKind::LeaseExpired, &record);
            e.error_class = record.error_class.clone();
            e.reason = record.error_message.clone();
            events.push(e);
            let mut t = ev(EventKind::UnknownPending, &record);
            t.from_state = Some(State::Unknown);
            t.reason = Some(UNKNOWN_TRIGGER.into());
            events.push(t);
            true
        }
        Decision::Replay => {
            let mut e = ev(EventKind::Replayed, &record);
            e.reason = Some(format!("replayed the stored {} result", record.state));
            events.push(e);
            false
        }
        Decision::AlreadyHeld => {
            let mut e = ev(EventKind::AlreadyHeld, &record);
            e.reason = Some(format!(
                "holder {:?} of principal {:?} acquired again during its lease (a resent request?): its grant returned unchanged",
                input.holder.as_deref().unwrap_or_default(),
                input.actor.principal
            ));
            events.push(e);
            false
        }
        Decision::InProgress { retry_after_ms } => {
            let mut e = ev(EventKind::InProgress, &record);
            e.wait_ms = Some(retry_after_ms);
            e.reason = Some("another worker holds the lease".into());
            events.push(e);
            false
        }
        Decision::RetryNotDue { retry_after_ms } => {
            let mut e = ev(EventKind::RetryNotDue, &record);
            e.wait_ms = Some(retry_after_ms);
            e.reason = Some("the next attempt is not due yet".into());
            events.push(e);
            false
        }
        Decision::Unknown => {
            let mut e = ev(EventKind::UnknownPending, &record);
            e.reason = Some(UNKNOWN_TRIGGER.into());
            events.push(e);
            false
        }
        // `decide` never answers Late (it sees no tombstones); `plan_late_arrival` does.
        Decision::Late => false,
        Decision::Mismatch => {
            let mut e = ev(EventKind::Mismatch, &record);
            e.reason = Some(format!(
                "key reused with another intent: stored fingerprint {} action {:?}, trigger fingerprint {} action {:?}",
                record.fingerprint, record.action, input.fingerprint, input.action
            ));
            events.push(e);
            false
        }
    };
    if changed {
        record.updated_at = now_ms;
        record.version += 1;
    }
    AcquirePlan { decision, record, changed, events }
}

/// Plans the lease sweeper's touch of `rec` at `now_ms`: an EXECUTING record whose lease
/// expired (and whose action is not `redo_safe`) becomes UNKNOWN. `None` when nothing is due.
pub fn plan_lease_expiry(rec: &OperationRecord, now_ms: i64) -> Option<(OperationRecord, OperationEvent)> {
    if rec.state != State::Executing || rec.redo_safe || rec.lease_valid_at(now_ms) {
        return None;
    }
    let mut next = rec.clone();
    expire_into_unknown(&mut next);
    next.updated_at = now_ms;
    next.version += 1;
    let mut e = Actor::system().event(&next, EventKind::LeaseExpired, now_ms);
    e.from_state = Some(State::Executing);
    e.to_state = Some(State::Unknown);
    e.fencing_token = Some(rec.fencing_token);
    e.error_class = next.error_class.clone();
    e.reason = next.error_message.clone();
    Some((next, e))
}

/// The error class of an operation whose lease ended while it was EXECUTING.
pub const LEASE_EXPIRED_CLASS: &str = "lease_expired";

/// What a trigger of an UNKNOWN operation is told (and its event records): it performs
/// nothing, and what will settle it.
pub const UNKNOWN_TRIGGER: &str = "the outcome is unknown (the effect may have happened): this trigger performs nothing; it waits for the provider's lookup or a person's resolution";

/// Turns an EXECUTING record whose lease ended into UNKNOWN and records the cause as its
/// last error, in words for a person on call (issue 28 §6: the answer and the admin page
/// gave "reconciliation pending, nothing executed" and an empty error, so the reason —
/// the worker may have acted — was only in the timeline).
fn expire_into_unknown(rec: &mut OperationRecord) {
    rec.state = State::Unknown;
    rec.lease_expires_at = None;
    rec.error_class = Some(LEASE_EXPIRED_CLASS.into());
    rec.error_message = Some(match &rec.connector {
        Some(c) => format!(
            "idem's attempt {} on connector {c:?} did not report before its lease ended (the node stopped?): the call may have reached the provider, so it is not sent again until the lookup answers or a person resolves it",
            rec.attempt_count
        ),
        None => format!(
            "the worker's lease (attempt {}, fencing token {}) ended before it reported: it may have performed the effect, so idem does not hand it out again; the worker may still complete with its token, or a person who knows resolves it",
            rec.attempt_count, rec.fencing_token
        ),
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn input(fp: &str) -> AcquireInput {
        AcquireInput {
            tenant: "t".into(),
            key: "k".into(),
            action: "send".into(),
            payload: json!({}),
            fingerprint: fp.into(),
            lease_ms: 1000,
            redo_safe: false,
            connector: None,
            holder: None,
            actor: Actor { principal: "p".into(), request_id: None },
        }
    }

    fn with_state(state: State) -> OperationRecord {
        let mut r = plan_acquire(None, &input("a"), 0).record;
        r.state = state;
        r
    }

    #[test]
    fn the_table_of_design_section_3() {
        let now = 10_000;
        assert_eq!(decide(None, "a", "send", None, None, now), Decision::Acquire);
        let mut pending = with_state(State::Pending);
        pending.next_attempt_at = Some(now + 500);
        assert_eq!(decide(Some(&pending), "a", "send", None, None, now), Decision::RetryNotDue { retry_after_ms: 500 });
        pending.next_attempt_at = Some(now);
        assert_eq!(decide(Some(&pending), "a", "send", None, None, now), Decision::Acquire);
        let mut exec = with_state(State::Executing);
        exec.lease_expires_at = Some(now + 1);
        assert_eq!(decide(Some(&exec), "a", "send", None, None, now), Decision::InProgress { retry_after_ms: 1 });
        exec.lease_expires_at = Some(now);
        assert_eq!(decide(Some(&exec), "a", "send", None, None, now), Decision::ExpireToUnknown);
        exec.redo_safe = true;
        assert_eq!(decide(Some(&exec), "a", "send", None, None, now), Decision::Acquire);
        for s in [State::Succeeded, State::Failed] {
            assert_eq!(decide(Some(&with_state(s)), "a", "send", None, None, now), Decision::Replay);
        }
        assert_eq!(decide(Some(&with_state(State::Unknown)), "a", "send", None, None, now), Decision::Unknown);
        for s in State::ALL {
            assert_eq!(decide(Some(&with_state(s)), "b", "send", None, None, now), Decision::Mismatch);
            assert_eq!(decide(Some(&with_state(s)), "a", "other", None, None, now), Decision::Mismatch);
            assert_eq!(decide(Some(&with_state(s)), "a", "send", Some("mail"), None, now), Decision::Mismatch);
        }
    }

    #[test]
    fn a_grant_raises_the_fencing_token_and_logs_the_trigger() {
        let first = plan_acquire(None, &input("a"), 0);
        assert_eq!(first.decision, Decision::Acquire);
        assert_eq!(first.record.fencing_token, 1);
        assert_eq!(first.record.lease_expires_at, Some(1000));
        assert_eq!(first.events.len(), 1);
        let dup = plan_acquire(Some(&first.record), &input("a"), 10);
        assert!(!dup.changed);
        assert_eq!(dup.record, first.record);
        assert_eq!(dup.events[0].kind, "in_progress");
        let expired = plan_acquire(Some(&first.record), &input("a"), 1000);
        assert_eq!(expired.record.state, State::Unknown);
        assert_eq!(expired.record.fencing_token, 1, "no new grant");
        assert_eq!(expired.events.len(), 2);
    }

    #[test]
    fn sweeper_expires_only_lapsed_leases() {
        let rec = plan_acquire(None, &input("a"), 0).record;
        assert!(plan_lease_expiry(&rec, 999).is_none());
        let (next, ev) = plan_lease_expiry(&rec, 1000).unwrap();
        assert_eq!(next.state, State::Unknown);
        assert_eq!(ev.principal, "system");
        let mut safe = rec.clone();
        safe.redo_safe = true;
        assert!(plan_lease_expiry(&safe, 5000).is_none());
    }
}
