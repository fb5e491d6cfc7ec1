//! The transactional outbox's pure half (DESIGN.md §8): what an event must hold, and what
//! the relay writes after each delivery attempt.
//!
//! An application appends an event in the same database transaction as its business
//! write; a relay later delivers it **at least once** (a receiver dedupes by the event id,
//! which travels as `webhook-id` or `Nats-Msg-Id`). Nothing here does I/O or reads a
//! clock: the relay passes `now_ms` and `jitter` in.
//!
//! - [`NewEvent::validate`]: the limits an event must keep. The SQL function
//!   `idem.outbox_append` (idem-outbox's schema) checks the same rules with the same
//!   messages, so an event refused in Rust is refused in SQL too.
//! - [`plan_delivery`]: delivered (with evidence), retry at a time (full jitter, the
//!   connectors' [`RetryPolicy`]), or dead. A *manual* attempt (an operator's redrive)
//!   schedules nothing further: if it fails the event is dead again.
//! - [`plan_operator_action`]: an operator's redrive or skip of a dead letter, with a
//!   mandatory reason.
//!
//! States (stored upper-case): PENDING → DELIVERED; PENDING → DEAD (after the last attempt,
//! or refused by the receiver); DEAD → PENDING (redrive, the next attempt is manual);
//! DEAD → SKIPPED (skip). A DEAD event holds back the later events of its aggregate until
//! an operator acts, because they must be delivered in order.

use crate::retry::RetryPolicy;
use serde_json::Value;
use std::collections::BTreeMap;

/// Longest event id, in bytes.
pub const MAX_EVENT_ID_LEN: usize = 255;
/// Longest aggregate type or aggregate id, in bytes.
pub const MAX_AGGREGATE_LEN: usize = 255;
/// Longest topic, in bytes.
pub const MAX_TOPIC_LEN: usize = 255;
/// Largest payload, in bytes of its JSON text (what is stored and sent): 256 KiB. NATS
/// servers refuse messages over their `max_payload` (1 MiB by default) and webhook
/// receivers commonly cap bodies far lower; an event is a notification, not a blob store.
pub const MAX_PAYLOAD_BYTES: usize = 262_144;
/// Most headers an event may carry.
pub const MAX_HEADERS: usize = 32;
/// Longest header name or value, in bytes.
pub const MAX_HEADER_LEN: usize = 1024;
/// Header names an event may not carry (lower case): the message's framing and the
/// connection's own headers (RFC 9110 §7.6.1, §8.6; RFC 9112 §6.1), which belong to the
/// transport, not to the event. A `content-length: 2` sent along truncated a delivered
/// body to `{"` while the relay recorded it DELIVERED, and `host` re-addressed it (found
/// by a break-it run). The webhook sink also drops them from events stored before this
/// check.
pub const RESERVED_HEADERS: [&str; 10] = [
    "connection",
    "content-length",
    "expect",
    "host",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

/// Whether `name` is one of [`RESERVED_HEADERS`] (ASCII case-insensitive).
#[must_use]
pub fn is_reserved_header(name: &str) -> bool {
    RESERVED_HEADERS.iter().any(|r| r.eq_ignore_ascii_case(name))
}
/// Longest operator reason, in bytes.
pub const MAX_REASON_LEN: usize = crate::reconcile::MAX_REASON_LEN;

/// An event to append to the outbox.
#[derive(Debug, Clone, PartialEq)]
pub struct NewEvent {
    /// Unique id, chosen by the producer (e.g. a UUID, or `order-42:created`): 1–255
    /// printable ASCII characters without spaces. It is the receiver's deduplication key
    /// (`webhook-id`, `Nats-Msg-Id`); appending an id twice fails (unique).
    pub id: String,
    /// Kind of the entity the event is about (`order`). Events of one aggregate (type +
    /// id) are delivered in commit order.
    pub aggregate_type: String,
    /// Id of that entity (`42`).
    pub aggregate_id: String,
    /// Where it goes: the NATS subject, and the name sinks route on (`orders.created`).
    /// 1–255 characters of `[A-Za-z0-9_:-]` in dot-separated tokens (no empty token, no
    /// wildcard).
    pub topic: String,
    /// The event's content (JSON).
    pub payload: Value,
    /// Extra headers sent with it (at most [`MAX_HEADERS`]); names are HTTP tokens, must
    /// not start with `webhook-` or `nats-` (the relay sets those) and are not one of
    /// [`RESERVED_HEADERS`].
    pub headers: BTreeMap<String, String>,
}

/// Why an event was refused. The messages are those of `idem.outbox_append` too.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EventError {
    /// No id.
    #[error("event id is missing")]
    MissingId,
    /// An id that is too long or not printable ASCII without spaces.
    #[error("event id must be 1-255 printable ASCII characters without spaces")]
    BadId,
    /// No aggregate type.
    #[error("aggregate_type is missing")]
    MissingAggregateType,
    /// No aggregate id.
    #[error("aggregate_id is missing")]
    MissingAggregateId,
    /// An aggregate type or id over [`MAX_AGGREGATE_LEN`] bytes or with a control character.
    #[error("aggregate_type and aggregate_id must be at most 255 bytes without control characters")]
    BadAggregate,
    /// An aggregate type or id that is blank or starts or ends with whitespace
    /// ([`crate::ident`]): `" 42"` and `"42"` would be two aggregates, ordered apart.
    /// Checked before every other rule.
    #[error("aggregate_type and aggregate_id must not be blank or start or end with whitespace")]
    PaddedAggregate,
    /// No topic.
    #[error("topic is missing")]
    MissingTopic,
    /// A topic that breaks the subject rules.
    #[error("topic must be 1-255 characters of [A-Za-z0-9_:-] in dot-separated tokens")]
    BadTopic,
    /// The payload's JSON text is over [`MAX_PAYLOAD_BYTES`].
    #[error("payload is {0} bytes; at most 262144 are allowed")]
    PayloadTooLarge(usize),
    /// More than [`MAX_HEADERS`] headers, or a bad name or value.
    #[error(
        "headers: at most 32, names are HTTP tokens not starting with webhook- or nats- and not a framing or connection header (content-length, transfer-encoding, host, connection, ...), values at most 1024 bytes without control characters"
    )]
    BadHeaders,
}

fn topic_ok(t: &str) -> bool {
    t.len() <= MAX_TOPIC_LEN
        && t.split('.')
            .all(|tok| !tok.is_empty() && tok.bytes().all(|b| b.is_ascii_alphanumeric() || b"_:-".contains(&b)))
}

fn header_name_ok(n: &str) -> bool {
    let lower = n.to_ascii_lowercase();
    !n.is_empty()
        && n.len() <= MAX_HEADER_LEN
        && n.bytes().all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
        && !lower.starts_with("webhook-")
        && !lower.starts_with("nats-")
        && !is_reserved_header(&lower)
}

impl NewEvent {
    /// The payload's JSON text, as stored and sent.
    pub fn payload_text(&self) -> String {
        self.payload.to_string()
    }

    /// Checks the event against the limits above; the first rule broken is reported.
    ///
    /// # Errors
    /// An [`EventError`] naming the field.
    pub fn validate(&self) -> Result<(), EventError> {
        // First (schema version 2 of idem.outbox_append checks them before version 1's rules).
        for a in [&self.aggregate_type, &self.aggregate_id] {
            if a.starts_with(crate::ident::is_padding) || a.ends_with(crate::ident::is_padding) {
                return Err(EventError::PaddedAggregate);
            }
        }
        if self.id.is_empty() {
            return Err(EventError::MissingId);
        }
        if self.id.len() > MAX_EVENT_ID_LEN || !self.id.bytes().all(|b| (0x21..=0x7e).contains(&b)) {
            return Err(EventError::BadId);
        }
        if self.aggregate_type.is_empty() {
            return Err(EventError::MissingAggregateType);
        }
        if self.aggregate_id.is_empty() {
            return Err(EventError::MissingAggregateId);
        }
        for a in [&self.aggregate_type, &self.aggregate_id] {
            if a.len() > MAX_AGGREGATE_LEN || a.chars().any(char::is_control) {
                return Err(EventError::BadAggregate);
            }
        }

        if self.topic.is_empty() {
            return Err(EventError::MissingTopic);
        }
        if !topic_ok(&self.topic) {
            return Err(EventError::BadTopic);
        }
        let size = self.payload_text().len();
        if size > MAX_PAYLOAD_BYTES {
            return Err(EventError::PayloadTooLarge(size));
        }
        let headers_ok = self.headers.len() <= MAX_HEADERS
            && self
                .headers
                .iter()
                .all(|(k, v)| header_name_ok(k) && v.len() <= MAX_HEADER_LEN && !v.chars().any(char::is_control));
        if !headers_ok {
            return Err(EventError::BadHeaders);
        }
        Ok(())
    }
}

/// The stored state of an outbox event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OutboxState {
    /// Waiting to be delivered (or being delivered under a relay's lease).
    Pending,
    /// Delivered: a sink returned evidence.
    Delivered,
    /// Out of attempts, or refused by the receiver: waits for an operator.
    Dead,
    /// An operator decided not to deliver it (with a reason).
    Skipped,
}

impl OutboxState {
    /// Every state.
    pub const ALL: [OutboxState; 4] =
        [OutboxState::Pending, OutboxState::Delivered, OutboxState::Dead, OutboxState::Skipped];

    /// The stored name (`PENDING`, …).
    pub fn as_str(self) -> &'static str {
        match self {
            OutboxState::Pending => "PENDING",
            OutboxState::Delivered => "DELIVERED",
            OutboxState::Dead => "DEAD",
            OutboxState::Skipped => "SKIPPED",
        }
    }

    /// Parses a stored name.
    pub fn parse(s: &str) -> Option<OutboxState> {
        OutboxState::ALL.into_iter().find(|st| st.as_str() == s)
    }
}

/// Who started a delivery attempt (the Svix "trigger type").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Trigger {
    /// The relay's schedule (a first attempt or a retry).
    Scheduled,
    /// An operator's redrive of a dead letter.
    Manual,
}

impl Trigger {
    /// The stored name (`scheduled`, `manual`).
    pub fn as_str(self) -> &'static str {
        match self {
            Trigger::Scheduled => "scheduled",
            Trigger::Manual => "manual",
        }
    }
}

/// What the relay knows about the event whose attempt just ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttemptRow {
    /// Attempts made so far, this one included (1 after the first).
    pub attempts: i64,
    /// When the event was appended (epoch ms); `max_elapsed_ms` counts from it.
    pub created_at: i64,
    /// Who started this attempt.
    pub trigger: Trigger,
}

/// What a sink reports for one delivery attempt, classified by what the answer proves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeliveryResult {
    /// The receiver took it; `evidence` says where (`HTTP 204`, `stream ORDERS seq 42`).
    Delivered {
        /// Non-empty proof of delivery.
        evidence: String,
    },
    /// It did not arrive, or the receiver asked to try later (connect error, 429, 503…).
    Retryable {
        /// Stable class (`connect`, `rate_limited`, …).
        error_class: String,
        /// Human-readable detail.
        message: String,
        /// The receiver's floor for the next try (ms), e.g. HTTP `Retry-After`.
        retry_after_ms: Option<i64>,
    },
    /// Whether it arrived is not known (a timeout after sending, a lost acknowledgement).
    /// Delivery is at least once and receivers dedupe by the event id, so it is retried.
    Unknown {
        /// Stable class (`timeout`, `server_error`, `connection`, …).
        error_class: String,
        /// Human-readable detail.
        message: String,
    },
    /// The receiver refused it for good (a 4xx other than 408/425/429): dead at once.
    Rejected {
        /// Stable class (`validation`, `auth`, `not_found`, …).
        error_class: String,
        /// Human-readable detail.
        message: String,
    },
}

/// What to write after an attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeliveryPlan {
    /// State DELIVERED with this evidence.
    Delivered {
        /// The sink's proof.
        evidence: String,
    },
    /// Stay PENDING; the next attempt is due at `at_ms` (epoch ms).
    RetryAt {
        /// When the next attempt is due (epoch ms).
        at_ms: i64,
        /// The failure's class.
        error_class: String,
        /// The failure's detail.
        message: String,
    },
    /// State DEAD: an operator decides (redrive or skip).
    Dead {
        /// The failure's class.
        error_class: String,
        /// Why, including why no further attempt is made.
        message: String,
    },
}

/// The plan after one attempt of `row` that ended with `result`, at `now_ms`.
///
/// - Delivered with non-empty evidence ⇒ [`DeliveryPlan::Delivered`]; empty evidence is
///   not proof and counts as [`DeliveryResult::Unknown`].
/// - Rejected ⇒ Dead.
/// - Retryable or Unknown ⇒ RetryAt `now + policy.delay_ms(attempts, jitter,
///   retry_after)` (full jitter, `Retry-After` a floor; AWS "Exponential Backoff and
///   Jitter"), unless this was a manual attempt (a redrive schedules nothing further), the
///   `max_attempts` are used up, or the next attempt would fall after `created_at +
///   max_elapsed_ms` ⇒ Dead.
///
/// `jitter` is uniform in `[0, 1)`, drawn by the caller.
pub fn plan_delivery(
    row: &AttemptRow,
    result: DeliveryResult,
    policy: &RetryPolicy,
    now_ms: i64,
    jitter: f64,
) -> DeliveryPlan {
    let (error_class, message, retry_after_ms) = match result {
        DeliveryResult::Delivered { evidence } if !evidence.trim().is_empty() => {
            return DeliveryPlan::Delivered { evidence };
        }
        DeliveryResult::Delivered { .. } => {
            ("unknown".to_owned(), "the sink reported delivery without evidence".to_owned(), None)
        }
        // `no_sink` is the relay's own refusal: no receiver was involved.
        DeliveryResult::Rejected { error_class, message } if error_class == "no_sink" => {
            return DeliveryPlan::Dead { error_class, message };
        }
        DeliveryResult::Rejected { error_class, message } => {
            return DeliveryPlan::Dead { error_class, message: format!("refused by the receiver: {message}") };
        }
        DeliveryResult::Retryable { error_class, message, retry_after_ms } => (error_class, message, retry_after_ms),
        DeliveryResult::Unknown { error_class, message } => (error_class, message, None),
    };
    if row.trigger == Trigger::Manual {
        return DeliveryPlan::Dead {
            error_class,
            message: format!("manual attempt failed (no retry scheduled): {message}"),
        };
    }
    if row.attempts >= policy.max_attempts {
        return DeliveryPlan::Dead {
            error_class,
            message: format!("attempt {} of {} failed: {message}", row.attempts, policy.max_attempts),
        };
    }
    let at_ms = now_ms.saturating_add(policy.delay_ms(row.attempts, jitter, retry_after_ms));
    if policy.max_elapsed_ms.is_some_and(|max| at_ms > row.created_at.saturating_add(max)) {
        return DeliveryPlan::Dead {
            error_class,
            message: format!("the next attempt would fall after max_elapsed_ms: {message}"),
        };
    }
    DeliveryPlan::RetryAt { at_ms, error_class, message }
}

/// An operator's decision about a dead letter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OperatorAction {
    /// Deliver it again: one manual attempt (its failure makes it dead again).
    Redrive,
    /// Do not deliver it: the aggregate's later events go on.
    Skip,
}

impl OperatorAction {
    /// The audited name (`redrive`, `skip`).
    pub fn as_str(self) -> &'static str {
        match self {
            OperatorAction::Redrive => "redrive",
            OperatorAction::Skip => "skip",
        }
    }
}

/// Why an operator's action was refused; nothing changes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OperatorRefusal {
    /// No reason given (it is audited and mandatory).
    #[error("a reason is mandatory: it is kept in the audit log")]
    MissingReason,
    /// A reason over [`MAX_REASON_LEN`] bytes or with NUL.
    #[error("the reason may have at most 2000 bytes and no NUL")]
    BadReason,
    /// Only DEAD events are redriven or skipped.
    #[error("the event is {0}, not DEAD: only dead letters are redriven or skipped")]
    NotDead(&'static str),
}

/// The state an operator's `action` on an event in `state` leads to, with `reason`.
///
/// # Errors
/// An [`OperatorRefusal`]: reason missing or too long, or the event not DEAD.
pub fn plan_operator_action(
    state: OutboxState,
    action: OperatorAction,
    reason: &str,
) -> Result<OutboxState, OperatorRefusal> {
    if reason.trim().is_empty() {
        return Err(OperatorRefusal::MissingReason);
    }
    if reason.len() > MAX_REASON_LEN || reason.contains('\0') {
        return Err(OperatorRefusal::BadReason);
    }
    if state != OutboxState::Dead {
        return Err(OperatorRefusal::NotDead(state.as_str()));
    }
    Ok(match action {
        OperatorAction::Redrive => OutboxState::Pending,
        OperatorAction::Skip => OutboxState::Skipped,
    })
}

#[doc(hidden)]
pub mod examples;
#[cfg(test)]
mod tests;
