//! Leases: who holds one (the holder identity) and how a holder keeps it (renewal).
//!
//! - **Holder identity** (the term of etcd and Kubernetes leases): an attempt names itself
//!   when it acquires — a UUID made for that attempt ([`crate::holder`]) — and the record
//!   keeps it ([`OperationRecord::lease_holder`])
//!   beside the principal that was granted the lease ([`OperationRecord::lease_owner`]).
//!   A holder is scoped to its principal: the same string sent by another principal is
//!   another holder. While the lease is valid, a trigger from the same principal and
//!   holder, with the same intent, gets the grant it already holds back unchanged
//!   ([`crate::Decision::AlreadyHeld`]): a worker whose acquire reply was lost and whose
//!   HTTP client resent the request is not locked out of its own lease (DESIGN.md §2
//!   invariant 6). Any other caller still gets 409, and once the lease has expired the
//!   usual rules apply (UNKNOWN, or a new grant for a `redo_safe` action).
//! - **Renewal** (a heartbeat, [`plan_renewal`]): the holder of the current fencing token
//!   moves the end of a *valid* lease to `now + lease_ms`, so a slow effect does not
//!   outlive its lease and get taken over. An expired lease is never revived, and a
//!   token other than the current one renews nothing.
//!
//! Only operations the caller performs itself (no connector) keep a holder: a connector's
//! attempts are held by idem's executor, and handing their grant to a caller would start
//! a second call.

use crate::State;
use crate::decision::{MAX_LEASE_MS, MIN_LEASE_MS};
use crate::record::{Actor, EventKind, OperationEvent, OperationRecord};

pub use crate::holder::{HOLDER_LEN, HolderError, validate_holder};

/// A worker as a lease knows it: the authenticated principal and the holder identity it
/// names. Two triggers are the same holder only if both parts are equal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HolderId<'a> {
    /// The principal (API key owner) of the trigger.
    pub principal: &'a str,
    /// The holder identity the trigger names.
    pub holder: &'a str,
}

/// Whether `who` holds `rec`'s lease and that lease is valid at `now_ms`: EXECUTING, not
/// expired, granted to the same principal under the same holder identity.
pub fn held_by(rec: &OperationRecord, who: Option<HolderId<'_>>, now_ms: i64) -> bool {
    let Some(who) = who else { return false };
    rec.lease_valid_at(now_ms)
        && rec.lease_holder.as_deref() == Some(who.holder)
        && rec.lease_owner.as_deref() == Some(who.principal)
}

/// Why a renewal was refused. Nothing is written in any of these cases.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RenewError {
    /// The token is not the record's current one: another grant happened, or it never
    /// existed. The same refusal a completion gets.
    #[error("stale fencing token {presented}: the current token is {current}, the lease was lost or never held")]
    StaleToken {
        /// The token the worker sent.
        presented: i64,
        /// The record's current token.
        current: i64,
    },
    /// The lease of this token ran out (the record may already be UNKNOWN): a renewal
    /// never revives it.
    #[error(
        "the lease of fencing token {token} expired{}; it cannot be renewed: stop, and complete with this token to report what happened (succeeded with evidence, a failure, or unknown)",
        .expired_at.map(|t| format!(" at {t} (epoch ms)")).unwrap_or_default()
    )]
    LeaseExpired {
        /// The token the worker sent (the current one).
        token: i64,
        /// When the lease ended (epoch ms), if the record still says.
        expired_at: Option<i64>,
    },
    /// The record is not EXECUTING under this token (PENDING after a retryable failure,
    /// SUCCEEDED or FAILED): there is no lease to renew.
    #[error("the operation is {state}, not EXECUTING: there is no lease to renew")]
    NotExecuting {
        /// The record's state.
        state: State,
    },
    /// A connector performs this operation; idem's executor holds its lease.
    #[error("connector {connector:?} performs this operation and holds its lease; callers cannot renew it")]
    ConnectorOwned {
        /// The connector's name.
        connector: String,
    },
    /// `lease_ms` is out of bounds.
    #[error("lease_ms is {0}; it must be between {MIN_LEASE_MS} and {MAX_LEASE_MS}")]
    InvalidLease(i64),
}

/// Plans the renewal of `rec`'s lease by the worker holding `fencing_token`: the lease
/// ends `lease_ms` after `now_ms` (which may also shorten it, as an etcd keep-alive resets
/// a TTL). Returns the record to write (version + 1) and the `lease_renewed` event.
///
/// Rules, checked in this order: `lease_ms` within [`MIN_LEASE_MS`]..=[`MAX_LEASE_MS`];
/// a connector's operation is renewed only by idem's executor (as for completions); the
/// token must be the current one ([`RenewError::StaleToken`], DESIGN.md §2 invariant 1);
/// the record must be EXECUTING with its lease still valid at `now_ms`
/// ([`RenewError::LeaseExpired`] when it ran out, including an UNKNOWN record whose lease
/// expired; [`RenewError::NotExecuting`] otherwise).
///
/// # Errors
/// A [`RenewError`]; the record must then be left as it is.
pub fn plan_renewal(
    rec: &OperationRecord,
    fencing_token: i64,
    lease_ms: i64,
    actor: &Actor,
    now_ms: i64,
) -> Result<(OperationRecord, OperationEvent), RenewError> {
    if !(MIN_LEASE_MS..=MAX_LEASE_MS).contains(&lease_ms) {
        return Err(RenewError::InvalidLease(lease_ms));
    }
    if let Some(c) = rec.executor_only(actor) {
        return Err(RenewError::ConnectorOwned { connector: c.to_owned() });
    }
    if fencing_token != rec.fencing_token {
        return Err(RenewError::StaleToken { presented: fencing_token, current: rec.fencing_token });
    }
    match rec.state {
        State::Executing if rec.lease_valid_at(now_ms) => {}
        State::Executing | State::Unknown => {
            return Err(RenewError::LeaseExpired { token: fencing_token, expired_at: rec.lease_expires_at });
        }
        state => return Err(RenewError::NotExecuting { state }),
    }
    let mut next = rec.clone();
    let until = now_ms + lease_ms;
    next.lease_expires_at = Some(until);
    next.updated_at = now_ms;
    next.version += 1;
    let mut e = actor.event(rec, EventKind::LeaseRenewed, now_ms);
    e.from_state = Some(State::Executing);
    e.to_state = Some(State::Executing);
    e.fencing_token = Some(fencing_token);
    e.reason = Some(format!(
        "lease renewed for {lease_ms} ms (it was to end at {}, now at {until}, epoch ms)",
        rec.lease_expires_at.unwrap_or(now_ms)
    ));
    Ok((next, e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decision::{AcquireInput, Decision, plan_acquire};
    use serde_json::json;

    fn input(principal: &str, holder: Option<&str>) -> AcquireInput {
        AcquireInput {
            tenant: "t".into(),
            key: "INV-88:send".into(),
            action: "send_invoice".into(),
            payload: json!({"to": "c-1"}),
            fingerprint: "f".into(),
            lease_ms: 1000,
            redo_safe: false,
            connector: None,
            holder: holder.map(str::to_owned),
            actor: Actor { principal: principal.into(), request_id: holder.map(str::to_owned) },
        }
    }

    #[test]
    fn the_same_holder_gets_its_grant_back_and_nobody_else_does() {
        let first = plan_acquire(None, &input("worker", Some("w7-attempt-1")), 0);
        assert_eq!(first.decision, Decision::Acquire);
        assert_eq!(first.record.lease_holder.as_deref(), Some("w7-attempt-1"));
        let again = plan_acquire(Some(&first.record), &input("worker", Some("w7-attempt-1")), 10);
        assert_eq!(again.decision, Decision::AlreadyHeld);
        assert!(!again.changed);
        assert_eq!(again.record, first.record, "the grant is returned unchanged");
        assert_eq!(again.events.len(), 1);
        assert_eq!(again.events[0].kind, "already_held");
        for other in
            [input("worker", Some("w8")), input("other-principal", Some("w7-attempt-1")), input("worker", None)]
        {
            let d = plan_acquire(Some(&first.record), &other, 10).decision;
            assert_eq!(d, Decision::InProgress { retry_after_ms: 990 }, "{other:?}");
        }
        // Another intent is another intent, whoever sends it.
        let mut other_payload = input("worker", Some("w7-attempt-1"));
        other_payload.fingerprint = "g".into();
        assert_eq!(plan_acquire(Some(&first.record), &other_payload, 10).decision, Decision::Mismatch);
        // Expired: the old rules, holder or not.
        let late = plan_acquire(Some(&first.record), &input("worker", Some("w7-attempt-1")), 1000);
        assert_eq!(late.decision, Decision::ExpireToUnknown);
    }

    #[test]
    fn a_connector_operation_keeps_no_holder() {
        let mut i = input("worker", Some("w7"));
        i.connector = Some("mail".into());
        let first = plan_acquire(None, &i, 0);
        assert_eq!(first.record.lease_holder, None);
        assert_eq!(plan_acquire(Some(&first.record), &i, 10).decision, Decision::InProgress { retry_after_ms: 990 });
    }

    #[test]
    fn renewal_extends_only_a_valid_lease_of_the_current_token() {
        let rec = plan_acquire(None, &input("worker", Some("w7")), 0).record;
        let actor = Actor { principal: "worker".into(), request_id: None };
        let t = rec.fencing_token;
        let (next, ev) = plan_renewal(&rec, t, 5000, &actor, 900).unwrap();
        assert_eq!(next.lease_expires_at, Some(5900));
        assert_eq!((next.fencing_token, next.attempt_count, next.state), (t, 1, State::Executing));
        assert_eq!(next.version, rec.version + 1);
        assert_eq!(ev.kind, "lease_renewed");
        assert_eq!(
            plan_renewal(&rec, t + 1, 5000, &actor, 900),
            Err(RenewError::StaleToken { presented: t + 1, current: t })
        );
        assert_eq!(
            plan_renewal(&rec, t, 5000, &actor, 1000),
            Err(RenewError::LeaseExpired { token: t, expired_at: Some(1000) })
        );
        let mut unknown = rec.clone();
        unknown.state = State::Unknown;
        unknown.lease_expires_at = None;
        assert!(matches!(plan_renewal(&unknown, t, 5000, &actor, 10), Err(RenewError::LeaseExpired { .. })));
        for s in [State::Succeeded, State::Failed, State::Pending] {
            let mut done = rec.clone();
            done.state = s;
            assert_eq!(plan_renewal(&done, t, 5000, &actor, 10), Err(RenewError::NotExecuting { state: s }));
        }
        assert_eq!(plan_renewal(&rec, t, 99, &actor, 10), Err(RenewError::InvalidLease(99)));
        let mut owned = rec.clone();
        owned.connector = Some("mail".into());
        assert!(matches!(plan_renewal(&owned, t, 5000, &actor, 10), Err(RenewError::ConnectorOwned { .. })));
        assert!(plan_renewal(&owned, t, 5000, &Actor::executor(), 10).is_ok());
    }
}
