//! The operation record and its event log entries (DESIGN.md §2), as plain data.
//!
//! All instants are Unix epoch **milliseconds** (UTC) as `i64`, read from a
//! [`Clock`](crate::Clock); durations are milliseconds and say so in their names.

use crate::State;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// One operation: one business intent with one intended side effect.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OperationRecord {
    /// Tenant that owns the record; every query is scoped to it.
    pub tenant: String,
    /// The idempotency key (validated by [`IdempotencyKey`](crate::IdempotencyKey)).
    pub key: String,
    /// What the side effect is, e.g. `send_confirmation`. Part of the intent: the same key
    /// with another action is a mismatch.
    pub action: String,
    /// SHA-256 hex of the canonical payload (or its named fields); never changes.
    pub fingerprint: String,
    /// The payload as first received (kept for audit and for connectors).
    pub payload: Value,
    /// Current state.
    pub state: State,
    /// Attempts granted so far (1 after the first acquire).
    pub attempt_count: i64,
    /// Principal that holds (or last held) the lease.
    pub lease_owner: Option<String>,
    /// Holder identity (within `lease_owner`) that holds or last held the lease, when the
    /// trigger named one (see [`crate::lease`]); `None` for an anonymous trigger and for
    /// connector operations.
    pub lease_holder: Option<String>,
    /// When the current lease ends (epoch ms); `None` when no lease is held.
    pub lease_expires_at: Option<i64>,
    /// Fencing token of the latest grant; grows by one on every grant. A record starts at
    /// its creation instant (epoch ms), so its first grant is `created_at + 1` and tokens
    /// never repeat across operations that reuse a key after retention.
    pub fencing_token: i64,
    /// Earliest instant of the next attempt (epoch ms), for PENDING after a retryable failure.
    pub next_attempt_at: Option<i64>,
    /// Provider's reference for the side effect (message id, resource id): the evidence.
    pub provider_ref: Option<String>,
    /// Stored result returned on replay.
    pub result: Option<Value>,
    /// Class of the last error (`validation`, `timeout`, `rate_limited`, …).
    pub error_class: Option<String>,
    /// Human-readable message of the last error.
    pub error_message: Option<String>,
    /// When the evidence was recorded or verified (epoch ms).
    pub verified_at: Option<i64>,
    /// Where the evidence came from: `caller` (reported on completion), `lookup`, `operator`.
    pub evidence_source: Option<String>,
    /// Flagged for an operator's review.
    pub needs_review: bool,
    /// Declared safe to redo: an expired lease is re-granted instead of becoming UNKNOWN
    /// (DESIGN.md §2 invariant 4).
    pub redo_safe: bool,
    /// Name of the configured connector idem executes the side effect with; `None` when
    /// the caller performs it and reports the outcome ("external").
    pub connector: Option<String>,
    /// Reconciliation lookups made since the record last became UNKNOWN.
    pub lookup_attempts: i64,
    /// Creation instant (epoch ms).
    pub created_at: i64,
    /// Last change (epoch ms).
    pub updated_at: i64,
    /// When the record reached SUCCEEDED or FAILED (epoch ms).
    pub completed_at: Option<i64>,
    /// When retention may remove the record (epoch ms); `None` = not scheduled.
    pub expires_at: Option<i64>,
    /// Optimistic-concurrency version: +1 on every write. Stores update a record only
    /// `WHERE version = <the version read>`, so two writers can never both apply a change.
    pub version: i64,
}

impl OperationRecord {
    /// Whether a lease is held and has not yet expired at `now_ms`.
    pub fn lease_valid_at(&self, now_ms: i64) -> bool {
        self.state == State::Executing && self.lease_expires_at.is_some_and(|t| t > now_ms)
    }

    /// The connector whose executor alone may act on this operation's lease (complete or
    /// renew it), when `actor` is not idem's executor; `None` when `actor` may. A
    /// lookup-only connector (`lookup:…`, the proxy's) is performed, and completed, by its
    /// caller.
    pub fn executor_only(&self, actor: &Actor) -> Option<&str> {
        self.connector.as_deref().filter(|c| !c.starts_with("lookup:") && actor.principal != EXECUTOR_PRINCIPAL)
    }
}

/// One row of the append-only `operation_events` log: a trigger or a transition.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OperationEvent {
    /// Position in the log, assigned by the store (grows with time).
    pub seq: i64,
    /// Tenant of the operation.
    pub tenant: String,
    /// Idempotency key of the operation.
    pub key: String,
    /// When it happened (epoch ms).
    pub at: i64,
    /// What happened; see [`EventKind`].
    pub kind: String,
    /// Authenticated principal that caused it (`system` for the lease sweeper).
    pub principal: String,
    /// Transport-level request id, when there was a request.
    pub request_id: Option<String>,
    /// State before; `None` for the trigger that created the record.
    pub from_state: Option<State>,
    /// State after.
    pub to_state: Option<State>,
    /// Fencing token involved (granted or presented).
    pub fencing_token: Option<i64>,
    /// The trigger's fingerprint (for a mismatch, the rejected one).
    pub fingerprint: Option<String>,
    /// Why, in words.
    pub reason: Option<String>,
    /// Error class of a failure outcome.
    pub error_class: Option<String>,
    /// Wait imposed on the caller or scheduled before the next attempt (ms).
    pub wait_ms: Option<i64>,
}

/// The kinds of events, as stored in [`OperationEvent::kind`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventKind {
    /// A trigger that was granted the lease (new key, due retry, or redo-safe re-grant).
    Acquired,
    /// A trigger answered with the stored result (200).
    Replayed,
    /// A trigger of the lease's own holder during its lease, answered with the grant it
    /// holds (201, nothing changed).
    AlreadyHeld,
    /// A trigger refused because another worker holds the lease (409).
    InProgress,
    /// A trigger refused because the retry is not due yet (409 + Retry-After).
    RetryNotDue,
    /// A trigger answered "reconciliation pending" (202).
    UnknownPending,
    /// A trigger whose fingerprint or action differs from the record's (422).
    Mismatch,
    /// An expired lease turned the record UNKNOWN.
    LeaseExpired,
    /// The holder of the current fencing token renewed its valid lease (heartbeat).
    LeaseRenewed,
    /// A worker's completion was applied.
    Completed,
    /// A reconciliation lookup asked the provider what happened.
    Reconciled,
    /// An operator resolved the operation by hand.
    Resolved,
}

impl EventKind {
    /// The stored name.
    pub fn as_str(self) -> &'static str {
        match self {
            EventKind::Acquired => "acquired",
            EventKind::Replayed => "replayed",
            EventKind::AlreadyHeld => "already_held",
            EventKind::InProgress => "in_progress",
            EventKind::RetryNotDue => "retry_not_due",
            EventKind::UnknownPending => "unknown_pending",
            EventKind::Mismatch => "mismatch",
            EventKind::LeaseExpired => "lease_expired",
            EventKind::LeaseRenewed => "lease_renewed",
            EventKind::Completed => "completed",
            EventKind::Reconciled => "reconciled",
            EventKind::Resolved => "resolved",
        }
    }
}

/// Who caused a change, and through which request: stamped on every event.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Actor {
    /// Authenticated principal.
    pub principal: String,
    /// Request id of the transport attempt, if any.
    pub request_id: Option<String>,
}

/// Principal of idem's own housekeeping (lease sweeper, reconciler). Reserved.
pub const SYSTEM_PRINCIPAL: &str = "system";
/// Principal of idem's executor, which performs connector attempts. Reserved.
pub const EXECUTOR_PRINCIPAL: &str = "executor";

impl Actor {
    /// The actor used for changes made by idem itself (lease sweeper, reconciler).
    pub fn system() -> Self {
        Actor { principal: SYSTEM_PRINCIPAL.into(), request_id: None }
    }

    /// The actor of connector attempts.
    pub fn executor() -> Self {
        Actor { principal: EXECUTOR_PRINCIPAL.into(), request_id: None }
    }

    /// A blank event of `kind` for `rec` at `at`, stamped with this actor; callers fill in
    /// the rest. `seq` is 0 until the store assigns it.
    pub fn event(&self, rec: &OperationRecord, kind: EventKind, at: i64) -> OperationEvent {
        OperationEvent {
            seq: 0,
            tenant: rec.tenant.clone(),
            key: rec.key.clone(),
            at,
            kind: kind.as_str().into(),
            principal: self.principal.clone(),
            request_id: self.request_id.clone(),
            from_state: None,
            to_state: None,
            fencing_token: None,
            fingerprint: None,
            reason: None,
            error_class: None,
            wait_ms: None,
        }
    }
}
