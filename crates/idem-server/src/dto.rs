//! The HTTP API's request and response bodies (DESIGN.md §10). Field names are the
//! contract: instants are RFC 3339 UTC strings, durations are milliseconds named `*_ms`.

use idem_core::{OperationEvent, OperationRecord};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::{IntoParams, ToSchema};

/// An epoch-millisecond instant as RFC 3339 UTC (`2026-11-30T09:02:00.123Z`).
pub fn rfc3339(ms: i64) -> String {
    jiff::Timestamp::from_millisecond(ms).map_or_else(|_| ms.to_string(), |t| format!("{t:.3}"))
}

fn opt_time(ms: Option<i64>) -> Option<String> {
    ms.map(rfc3339)
}

/// `POST /v1/operations`: one trigger of an idempotency key.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct AcquireBody {
    /// The idempotency key: 1-255 printable ASCII characters, no personal data. May instead
    /// come in the `Idempotency-Key` header.
    #[schema(example = "INQ-001:confirmation:v1")]
    pub key: Option<String>,
    /// The action (the kind of side effect): 1-128 characters of `[A-Za-z0-9_.:-]`.
    #[schema(example = "send_confirmation")]
    pub action: String,
    /// The payload that defines the intent. Kept with the record as received; its
    /// fingerprint (NFC of every string, then RFC 8785 canonical JSON, then SHA-256) binds
    /// the key. Refused (400): duplicate member names, also names equal after NFC (I-JSON,
    /// RFC 7493 §2.3), and number literals an IEEE 754 double does not carry exactly or
    /// beyond ±2^53 (`1e-400`, `4e-324`, `9007199254740993`: send them as strings).
    /// Default `null`.
    #[schema(value_type = Object)]
    pub payload: Option<idem_core::Payload>,
    /// JSON pointers (RFC 6901) of the payload fields that define the intent; when given,
    /// only they are fingerprinted. Compared in NFC, like the payload's member names.
    #[schema(example = json!(["/to", "/template"]))]
    pub fingerprint_fields: Option<Vec<String>>,
    /// Lease length in ms (100-3600000, default 30000).
    pub lease_ms: Option<i64>,
    /// How long to wait (ms, 0-30000, default 0) for another worker's lease to end before
    /// answering 409; the answer is then whatever the trigger gets at that point.
    pub wait_ms: Option<i64>,
    /// Whether the action can be redone safely: then an expired lease is re-granted
    /// instead of becoming UNKNOWN. Fixed by the first trigger. Default false.
    pub redo_safe: Option<bool>,
    /// Name of a configured connector that performs the side effect (the payload is its
    /// input); default: the action's connector in the config, else none (the caller
    /// performs it). With a connector, idem executes on a grant and answers 200 with the
    /// result and `Idem-Performed-By: connector` if it finishes within `wait_ms`, else 202
    /// with `Location` — never 201, which only ever hands the effect to the caller.
    pub connector: Option<String>,
    /// The attempt's lease holder identity (the etcd/Kubernetes term): a UUID (RFC 9562,
    /// version 4 or 7; 1, 6 also) generated for this one attempt, scoped to the caller's
    /// principal. While the lease is valid, a trigger of the same principal and holder with
    /// the same intent gets its grant back unchanged (201: same fencing token, lease end
    /// and attempt) — the resend of a request whose reply was lost; anyone else gets 409.
    /// Send it only on that attempt's resends: never a worker name, an event id, a
    /// request id or a constant, which other attempts share (refused where idem can tell:
    /// not a UUID, a name-based or Nil UUID, a time-based one over an hour old, part of the
    /// key, equal to `X-Request-Id` — 400 `invalid-holder`). Default: none (a resend gets
    /// 409 like anyone else's trigger). Ignored for connector operations (idem's executor
    /// holds their lease). DESIGN.md §3 "Holders".
    #[schema(example = "0b6f7a1e-3c2d-4e5f-8a9b-0c1d2e3f4a5b")]
    pub holder: Option<String>,
}

/// `POST /v1/operations/{key}/renew`: a heartbeat of the worker holding `fencing_token`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RenewBody {
    /// Token of the lease the worker holds.
    pub fencing_token: i64,
    /// The lease then ends this many ms after the renewal (100-3600000, default 30000),
    /// counted on the ledger's clock (on PostgreSQL, the database's).
    pub lease_ms: Option<i64>,
}

/// The last error of an operation.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct ErrorView {
    /// Error class (`validation`, `unavailable`, `unknown`, …).
    pub class: Option<String>,
    /// Message.
    pub message: Option<String>,
}

/// An operation record.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct OperationView {
    /// Idempotency key.
    pub key: String,
    /// Action.
    pub action: String,
    /// PENDING, EXECUTING, SUCCEEDED, FAILED or UNKNOWN.
    #[schema(example = "EXECUTING")]
    pub state: String,
    /// SHA-256 hex of the RFC 8785 canonical payload (or its named fields) with every
    /// string in NFC.
    pub fingerprint: String,
    /// The payload as first received.
    #[schema(value_type = Object)]
    pub payload: Value,
    /// Attempts granted so far; while EXECUTING, the number of the current attempt.
    pub attempt: i64,
    /// Token of the latest lease; present it to complete. Grows by one per grant; the
    /// first is the operation's creation instant in epoch ms (so it is large).
    pub fencing_token: i64,
    /// Principal holding (or last holding) the lease.
    pub lease_owner: Option<String>,
    /// Holder identity (within `lease_owner`) holding or last holding the lease, when the
    /// trigger named one (`holder`, lowercase).
    pub lease_holder: Option<String>,
    /// End of the current lease.
    pub lease_expires_at: Option<String>,
    /// Earliest next attempt (PENDING).
    pub next_attempt_at: Option<String>,
    /// The provider's reference for the side effect (the evidence).
    pub provider_ref: Option<String>,
    /// The stored result, replayed to repeated triggers.
    #[schema(value_type = Option<Object>)]
    pub result: Option<Value>,
    /// The last error.
    pub error: Option<ErrorView>,
    /// When the evidence was recorded or verified.
    pub verified_at: Option<String>,
    /// Where the evidence came from (`caller`, `lookup`, `operator`).
    pub evidence_source: Option<String>,
    /// Flagged for an operator's review.
    pub needs_review: bool,
    /// Declared safe to redo after an expired lease.
    pub redo_safe: bool,
    /// Connector that performs the side effect; absent when the caller does.
    pub connector: Option<String>,
    /// Reconciliation lookups since the operation became UNKNOWN.
    pub lookup_attempts: i64,
    /// Creation instant.
    pub created_at: String,
    /// Last change.
    pub updated_at: String,
    /// When it became SUCCEEDED or FAILED.
    pub completed_at: Option<String>,
    /// When retention may remove it (not scheduled yet: retention is not configured).
    pub expires_at: Option<String>,
    /// The event log, oldest first (only on `GET /v1/operations/{key}`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub events: Option<Vec<EventView>>,
}

impl OperationView {
    /// The view of `r`, without events.
    pub fn of(r: OperationRecord) -> Self {
        let error = (r.error_class.is_some() || r.error_message.is_some())
            .then_some(ErrorView { class: r.error_class, message: r.error_message });
        OperationView {
            key: r.key,
            action: r.action,
            state: r.state.as_str().into(),
            fingerprint: r.fingerprint,
            payload: r.payload,
            attempt: r.attempt_count,
            fencing_token: r.fencing_token,
            lease_owner: r.lease_owner,
            lease_holder: r.lease_holder,
            lease_expires_at: opt_time(r.lease_expires_at),
            next_attempt_at: opt_time(r.next_attempt_at),
            provider_ref: r.provider_ref,
            result: r.result,
            error,
            verified_at: opt_time(r.verified_at),
            evidence_source: r.evidence_source,
            needs_review: r.needs_review,
            redo_safe: r.redo_safe,
            connector: r.connector,
            lookup_attempts: r.lookup_attempts,
            created_at: rfc3339(r.created_at),
            updated_at: rfc3339(r.updated_at),
            completed_at: opt_time(r.completed_at),
            expires_at: opt_time(r.expires_at),
            events: None,
        }
    }
}

/// One entry of an operation's event log.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct EventView {
    /// Position in the log.
    pub seq: i64,
    /// When.
    pub at: String,
    /// `acquired`, `already_held`, `replayed`, `in_progress`, `retry_not_due`,
    /// `unknown_pending`, `mismatch`, `lease_expired`, `lease_renewed`, `completed`,
    /// `reconciled`, `resolved`.
    pub kind: String,
    /// Who (`system` for the lease sweeper).
    pub principal: String,
    /// Request id of the trigger or completion.
    pub request_id: Option<String>,
    /// State before.
    pub from_state: Option<String>,
    /// State after.
    pub to_state: Option<String>,
    /// Fencing token granted or presented.
    pub fencing_token: Option<i64>,
    /// Fingerprint of the trigger.
    pub fingerprint: Option<String>,
    /// Why.
    pub reason: Option<String>,
    /// Error class of a failure.
    pub error_class: Option<String>,
    /// Wait imposed or scheduled (ms).
    pub wait_ms: Option<i64>,
}

impl EventView {
    /// The view of `e`.
    pub fn of(e: OperationEvent) -> Self {
        EventView {
            seq: e.seq,
            at: rfc3339(e.at),
            kind: e.kind,
            principal: e.principal,
            request_id: e.request_id,
            from_state: e.from_state.map(|s| s.as_str().into()),
            to_state: e.to_state.map(|s| s.as_str().into()),
            fencing_token: e.fencing_token,
            fingerprint: e.fingerprint,
            reason: e.reason,
            error_class: e.error_class,
            wait_ms: e.wait_ms,
        }
    }
}

/// `POST /v1/operations/{key}/complete`: the outcome of the attempt holding `fencing_token`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CompleteBody {
    /// Token of the lease the worker holds.
    pub fencing_token: i64,
    /// `succeeded`, `retryable_failure`, `final_failure` or `unknown`.
    #[schema(example = "succeeded")]
    pub outcome: String,
    /// Evidence of the side effect (required for `succeeded`, at most 512 bytes).
    pub provider_ref: Option<String>,
    /// Result to store and replay (`succeeded`, `final_failure`), kept as received. The
    /// payload's rules apply (400): no duplicate member names, no number literal an IEEE 754
    /// double does not carry exactly (send such numbers as strings).
    #[schema(value_type = Option<Object>)]
    pub result: Option<idem_core::Payload>,
    /// Error class (required for the failures): 1-64 characters of `[A-Za-z0-9_.-]`.
    pub error_class: Option<String>,
    /// Human-readable message (failures and `unknown`).
    pub message: Option<String>,
    /// Provider's requested wait before the next attempt (ms, `retryable_failure`).
    pub retry_after_ms: Option<i64>,
}

/// `GET /v1/operations` query.
#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct ListQuery {
    /// Only this state.
    pub state: Option<String>,
    /// Only this action.
    pub action: Option<String>,
    /// Only operations with (or without) the review flag.
    pub needs_review: Option<bool>,
    /// Only keys that start with this (exact, case-sensitive).
    pub key_prefix: Option<String>,
    /// Only operations created at or after this instant (RFC 3339).
    pub created_after: Option<String>,
    /// Only operations created before this instant (RFC 3339).
    pub created_before: Option<String>,
    /// Page size, 1-500 (default 50).
    pub limit: Option<i64>,
    /// `next_cursor` of the previous page.
    pub cursor: Option<String>,
}

/// One page of operations, newest first.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct OperationPage {
    /// The operations.
    pub items: Vec<OperationView>,
    /// Pass as `cursor` for the next page; absent on the last page.
    pub next_cursor: Option<String>,
}
