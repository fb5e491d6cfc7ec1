//! The connector contract (DESIGN.md §7): perform a side effect, and look it up afterwards.
//!
//! Outcomes are classified by what the answer proves, never guessed (DESIGN.md §4): a
//! failure *before* anything reached the provider, or an answer that says it did not
//! process the request, is retryable; a failure or an answer that leaves open whether the
//! provider acted (a timeout, a reset, an HTTP 500/502/504) is ambiguous — UNKNOWN, to be
//! settled by [`Connector::lookup`] or an operator — unless the provider deduplicates by
//! the idempotency key idem sends, which makes another attempt safe ([`ambiguous`]).
//! Connectors never retry themselves: exactly one layer retries, the executor, on the
//! durable schedule.

use async_trait::async_trait;
use idem_core::fingerprint::sha256_hex;
use idem_core::{Lookup, Outcome};
use serde_json::Value;

/// What a connector knows about the attempt it performs.
#[derive(Debug, Clone)]
pub struct OperationCtx {
    /// Tenant of the operation.
    pub tenant: String,
    /// The caller's idempotency key.
    pub key: String,
    /// The action.
    pub action: String,
    /// The payload (the connector's input).
    pub payload: Value,
    /// Fencing token of the lease this attempt runs under.
    pub fencing_token: i64,
    /// Attempt number (1-based).
    pub attempt: i64,
    /// When the operation last changed state (epoch ms): for an UNKNOWN one, about when
    /// the attempt in doubt ended.
    pub updated_at: i64,
    /// The ledger's clock when this context was made (epoch ms; on PostgreSQL the
    /// database's, DESIGN.md §2 invariant 7): a lookup judges how long ago `updated_at`
    /// was by it, never by this node's wall clock.
    pub now_ms: i64,
}

impl OperationCtx {
    /// The key as sent to providers: `tenant:key`, so two tenants' equal keys never collide
    /// in a provider's own idempotency store.
    pub fn provider_key(&self) -> String {
        format!("{}:{}", self.tenant, self.key)
    }

    /// A stable digest of tenant and key (32 hex digits), e.g. for a `Message-ID`.
    pub fn stable_id(&self) -> String {
        sha256_hex(format!("{}\u{0}{}", self.tenant, self.key).as_bytes())[..32].to_owned()
    }
}

/// Performs one kind of side effect against one provider.
#[async_trait]
pub trait Connector: Send + Sync + std::fmt::Debug {
    /// Performs the side effect once and classifies what happened. Must not retry.
    async fn execute(&self, op: &OperationCtx) -> Outcome;

    /// Asks the provider whether the side effect of `op` happened.
    async fn lookup(&self, op: &OperationCtx) -> Lookup;

    /// Lease to take for one attempt (ms): longer than [`Connector::max_call_ms`], so a
    /// lease never expires under a live attempt.
    fn lease_ms(&self) -> i64;

    /// The longest one `execute` can take (ms), from its timeouts. An attempt does not
    /// start unless at least this much of its lease is left.
    fn max_call_ms(&self) -> i64;

    /// Whether [`Connector::lookup`] can ever find anything (a lookup is configured). When
    /// not, the reconciler flags an UNKNOWN operation for review at once instead of asking
    /// `max_lookups` times, and a workflow step on it defaults to the `manual` policy
    /// (DESIGN.md §8).
    fn can_look_up(&self) -> bool {
        true
    }
}

/// `retryable_failure` with a class and message.
pub fn retryable(class: &str, message: impl Into<String>, retry_after_ms: Option<i64>) -> Outcome {
    Outcome::RetryableFailure { error_class: class.into(), message: Some(message.into()), retry_after_ms }
}

/// `final_failure` with a class and message.
pub fn final_failure(class: &str, message: impl Into<String>) -> Outcome {
    Outcome::FinalFailure { error_class: class.into(), message: Some(message.into()), result: None }
}

/// An ambiguous answer (the provider may have acted, DESIGN.md §4): UNKNOWN, or, when the
/// provider deduplicates by the idempotency key idem sends, an
/// [`Outcome::AmbiguousRetryable`] with `class` (another attempt is safe; UNKNOWN once the
/// attempts run out).
pub fn ambiguous(
    provider_deduplicates: bool,
    class: &str,
    message: impl Into<String>,
    retry_after_ms: Option<i64>,
) -> Outcome {
    if provider_deduplicates {
        Outcome::AmbiguousRetryable { error_class: class.into(), message: Some(message.into()), retry_after_ms }
    } else {
        unknown(message)
    }
}

/// `unknown` with a message.
pub fn unknown(message: impl Into<String>) -> Outcome {
    Outcome::Unknown { message: Some(message.into()) }
}
