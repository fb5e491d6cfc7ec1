//! A worker's completion: the outcome of one attempt, fenced by the token of its lease.
//!
//! Rules ([`plan_completion`]):
//! - The presented fencing token must equal the record's current token; otherwise the
//!   completion is stale ([`CompleteError::StaleToken`]) and changes nothing
//!   (DESIGN.md §2 invariant 1).
//! - A connector's operation (other than a lookup-only `lookup:…` one) is completed only by
//!   idem's executor ([`CompleteError::ConnectorOwned`]).
//! - The record must be EXECUTING, or UNKNOWN because that same lease expired (a *late*
//!   completion: nobody was granted since, and the worker's report is the best evidence
//!   there is — it settles the UNKNOWN as reconciliation would).
//! - SUCCEEDED requires evidence: a non-empty `provider_ref` (invariant 2).
//! - Repeating the completion that was already applied under the same token (same outcome
//!   with the same provider_ref or error class) is idempotent: it returns the record
//!   unchanged (a repeat's `result` is not stored again), so a worker may retry a completion
//!   whose answer it lost. Any other completion of a SUCCEEDED or FAILED record is refused
//!   ([`CompleteError::AlreadyFinal`]).
//! - A retryable failure goes back to PENDING with `next_attempt_at` from the
//!   [`RetryPolicy`], or to FAILED once `max_attempts` attempts were made.
//! - An ambiguous answer from a provider that deduplicates by the idempotency key
//!   ([`Outcome::AmbiguousRetryable`]) is scheduled the same way, but when the attempts run
//!   out it becomes UNKNOWN, never FAILED: the provider may have acted (DESIGN.md §4).

use crate::State;
use crate::record::{Actor, EventKind, OperationEvent, OperationRecord};
use crate::retry::RetryPolicy;
use serde_json::Value;

/// Longest error class, in bytes.
pub const MAX_ERROR_CLASS_LEN: usize = 64;
/// Longest provider reference, in bytes.
pub const MAX_PROVIDER_REF_LEN: usize = 512;
/// Longest error message kept on a record, in bytes. The HTTP API refuses longer ones;
/// connectors' messages (provider error bodies) are cut to it ([`clip_message`]).
pub const MAX_MESSAGE_LEN: usize = 4096;

/// `m` cut to at most [`MAX_MESSAGE_LEN`] bytes at a character boundary, with `…` when cut.
pub fn clip_message(m: &str) -> String {
    if m.len() <= MAX_MESSAGE_LEN {
        return m.to_owned();
    }
    let mut end = MAX_MESSAGE_LEN - '…'.len_utf8();
    while !m.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &m[..end])
}

/// What the worker reports after an attempt.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// The side effect happened; `provider_ref` is the evidence, `result` is replayed later.
    Succeeded { provider_ref: String, result: Option<Value> },
    /// The side effect did not happen and may be tried again (after `retry_after_ms` if the
    /// provider said so, e.g. HTTP `Retry-After`).
    RetryableFailure { error_class: String, message: Option<String>, retry_after_ms: Option<i64> },
    /// The provider may have acted (e.g. HTTP 500/502/504 or a timeout after the request
    /// was sent), but it deduplicates by the idempotency key idem sends, so another attempt
    /// is safe (DESIGN.md §4). Scheduled like a retryable failure (`retry_after_ms` is a
    /// floor); when the attempts run out the operation becomes UNKNOWN, not FAILED, since
    /// the effect may exist. Reported by idem's connectors only, not accepted over the API.
    AmbiguousRetryable { error_class: String, message: Option<String>, retry_after_ms: Option<i64> },
    /// The side effect did not happen and never will (validation, auth, not found).
    FinalFailure { error_class: String, message: Option<String>, result: Option<Value> },
    /// The worker cannot tell whether the side effect happened (timeout after sending).
    Unknown { message: Option<String> },
}

impl Outcome {
    /// The outcome's name as in the HTTP API.
    pub fn name(&self) -> &'static str {
        match self {
            Outcome::Succeeded { .. } => "succeeded",
            Outcome::RetryableFailure { .. } => "retryable_failure",
            Outcome::AmbiguousRetryable { .. } => "ambiguous_retryable",
            Outcome::FinalFailure { .. } => "final_failure",
            Outcome::Unknown { .. } => "unknown",
        }
    }

    /// The outcome with the text a provider sent made storable ([`crate::text::storable`]:
    /// control characters escaped in `provider_ref` and `message`), for an outcome a
    /// connector reports: what a provider answers must not make its completion invalid, or
    /// a refusal would end UNKNOWN instead of FAILED (issue 28 §8). A client's completion
    /// over the API is validated as sent instead.
    #[must_use]
    pub fn into_storable(self) -> Outcome {
        let text = |s: String| match crate::text::storable(&s) {
            std::borrow::Cow::Borrowed(_) => s,
            std::borrow::Cow::Owned(escaped) => escaped,
        };
        let msg = |m: Option<String>| m.map(text);
        match self {
            Outcome::Succeeded { provider_ref, result } => {
                Outcome::Succeeded { provider_ref: text(provider_ref), result }
            }
            Outcome::RetryableFailure { error_class, message, retry_after_ms } => {
                Outcome::RetryableFailure { error_class, message: msg(message), retry_after_ms }
            }
            Outcome::AmbiguousRetryable { error_class, message, retry_after_ms } => {
                Outcome::AmbiguousRetryable { error_class, message: msg(message), retry_after_ms }
            }
            Outcome::FinalFailure { error_class, message, result } => {
                Outcome::FinalFailure { error_class, message: msg(message), result }
            }
            Outcome::Unknown { message } => Outcome::Unknown { message: msg(message) },
        }
    }

    /// Checks the outcome's own fields.
    ///
    /// # Errors
    /// [`CompleteError::Invalid`] with a one-line reason.
    pub fn validate(&self) -> Result<(), CompleteError> {
        let class_ok = |c: &str| {
            !c.is_empty()
                && c.len() <= MAX_ERROR_CLASS_LEN
                && c.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'.' || b == b'-')
        };
        match self {
            Outcome::Succeeded { provider_ref, .. } => {
                if provider_ref.trim().is_empty() {
                    return Err(CompleteError::Invalid(
                        "outcome succeeded needs a non-empty provider_ref: SUCCEEDED requires evidence".into(),
                    ));
                }
                if provider_ref.len() > MAX_PROVIDER_REF_LEN {
                    return Err(CompleteError::Invalid(format!(
                        "provider_ref is longer than {MAX_PROVIDER_REF_LEN} bytes"
                    )));
                }
                if provider_ref.chars().any(char::is_control) {
                    return Err(CompleteError::Invalid("provider_ref must not contain control characters".into()));
                }
            }
            Outcome::RetryableFailure { error_class, retry_after_ms, .. }
            | Outcome::AmbiguousRetryable { error_class, retry_after_ms, .. } => {
                if !class_ok(error_class) {
                    return Err(CompleteError::Invalid(format!(
                        "error_class must be 1-{MAX_ERROR_CLASS_LEN} characters of [A-Za-z0-9_.-]"
                    )));
                }
                if retry_after_ms.is_some_and(|ms| !(0..=86_400_000).contains(&ms)) {
                    return Err(CompleteError::Invalid(
                        "retry_after_ms must be between 0 and 86400000 (one day)".into(),
                    ));
                }
            }
            Outcome::FinalFailure { error_class, .. } => {
                if !class_ok(error_class) {
                    return Err(CompleteError::Invalid(format!(
                        "error_class must be 1-{MAX_ERROR_CLASS_LEN} characters of [A-Za-z0-9_.-]"
                    )));
                }
            }
            Outcome::Unknown { .. } => {}
        }
        if self.message().is_some_and(|m| m.contains('\0')) {
            return Err(CompleteError::Invalid(
                "message must not contain U+0000 (NUL): PostgreSQL text cannot hold it".into(),
            ));
        }
        Ok(())
    }

    /// The failure's message, if it has one.
    fn message(&self) -> Option<&str> {
        match self {
            Outcome::RetryableFailure { message, .. }
            | Outcome::AmbiguousRetryable { message, .. }
            | Outcome::FinalFailure { message, .. }
            | Outcome::Unknown { message } => message.as_deref(),
            Outcome::Succeeded { .. } => None,
        }
    }
}

/// Why a completion was refused. Nothing is written in any of these cases.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CompleteError {
    /// The token is not the record's current one: another grant happened, or it never existed.
    #[error("stale fencing token {presented}: the current token is {current}, the lease was lost or never held")]
    StaleToken { presented: i64, current: i64 },
    /// The record is SUCCEEDED or FAILED and this is not a repeat of that completion.
    #[error("the operation is already {state}; a final record cannot be completed again")]
    AlreadyFinal { state: State },
    /// The record is PENDING: the lease behind this token was already completed.
    #[error("the operation is {state}, not EXECUTING: acquire it before completing")]
    NotExecuting { state: State },
    /// A connector performs this operation; only idem's executor reports its outcome.
    #[error(
        "connector {connector:?} performs this operation and reports its outcome; use resolve for an operator's decision"
    )]
    ConnectorOwned { connector: String },
    /// The outcome's fields are malformed.
    #[error("{0}")]
    Invalid(String),
}

/// The plan for one completion: the record to write and the event to append.
#[derive(Debug, Clone)]
pub struct CompletionPlan {
    /// The record after the completion.
    pub record: OperationRecord,
    /// False for an idempotent repeat of the completion already applied.
    pub changed: bool,
    /// The event to append (`None` for a repeat).
    pub event: Option<OperationEvent>,
}

/// Applies `outcome`, reported under `fencing_token`, to `rec` at `now_ms`.
///
/// `jitter` is a uniform random number in `[0, 1)` for the full-jitter backoff of a
/// retryable failure (the caller draws it, so this function stays pure).
///
/// # Errors
/// A [`CompleteError`]; the record must then be left as it is.
pub fn plan_completion(
    rec: &OperationRecord,
    fencing_token: i64,
    outcome: &Outcome,
    actor: &Actor,
    policy: &RetryPolicy,
    jitter: f64,
    now_ms: i64,
) -> Result<CompletionPlan, CompleteError> {
    outcome.validate()?;
    if let Some(c) = rec.executor_only(actor) {
        return Err(CompleteError::ConnectorOwned { connector: c.to_owned() });
    }
    if fencing_token != rec.fencing_token {
        return Err(CompleteError::StaleToken { presented: fencing_token, current: rec.fencing_token });
    }
    match rec.state {
        State::Executing | State::Unknown => {}
        State::Succeeded | State::Failed => {
            let repeat = match (rec.state, outcome) {
                (State::Succeeded, Outcome::Succeeded { provider_ref, .. }) => {
                    rec.provider_ref.as_deref() == Some(provider_ref.as_str())
                }
                (
                    State::Failed,
                    Outcome::FinalFailure { error_class, .. } | Outcome::RetryableFailure { error_class, .. },
                ) => rec.error_class.as_deref() == Some(error_class.as_str()),
                _ => false,
            };
            if repeat {
                return Ok(CompletionPlan { record: rec.clone(), changed: false, event: None });
            }
            return Err(CompleteError::AlreadyFinal { state: rec.state });
        }
        State::Pending => {
            // A repeat of the retryable failure that made it PENDING (same lease, same class).
            let repeat = matches!(outcome, Outcome::RetryableFailure { error_class, .. }
                | Outcome::AmbiguousRetryable { error_class, .. }
                if rec.error_class.as_deref() == Some(error_class.as_str()));
            if repeat {
                return Ok(CompletionPlan { record: rec.clone(), changed: false, event: None });
            }
            return Err(CompleteError::NotExecuting { state: rec.state });
        }
    }
    if rec.state == State::Unknown && matches!(outcome, Outcome::Unknown { .. }) {
        // Still unknown: nothing new to record.
        return Ok(CompletionPlan { record: rec.clone(), changed: false, event: None });
    }
    let late = rec.state == State::Unknown || !rec.lease_valid_at(now_ms);
    let mut next = rec.clone();
    next.lease_expires_at = None;
    next.updated_at = now_ms;
    next.version += 1;
    let mut ev = actor.event(rec, EventKind::Completed, now_ms);
    ev.from_state = Some(rec.state);
    ev.fencing_token = Some(fencing_token);
    let mut reason = format!("outcome {}", outcome.name());
    match outcome {
        Outcome::Succeeded { provider_ref, result } => {
            next.state = State::Succeeded;
            next.provider_ref = Some(provider_ref.clone());
            next.result = result.clone();
            next.verified_at = Some(now_ms);
            // Reported by idem's own executor (a connector's answer) or by the caller.
            let source = if actor.principal == crate::record::EXECUTOR_PRINCIPAL { "connector" } else { "caller" };
            next.evidence_source = Some(source.into());
            next.completed_at = Some(now_ms);
            next.needs_review = false;
            // Earlier attempts' errors stay in the event log, not on a success.
            next.error_class = None;
            next.error_message = None;
            reason.push_str(&format!(" with provider_ref {provider_ref}"));
        }
        Outcome::FinalFailure { error_class, message, result } => {
            next.state = State::Failed;
            next.error_class = Some(error_class.clone());
            next.error_message = message.as_deref().map(clip_message);
            next.result = result.clone();
            next.completed_at = Some(now_ms);
            ev.error_class = Some(error_class.clone());
        }
        Outcome::RetryableFailure { error_class, message, retry_after_ms }
        | Outcome::AmbiguousRetryable { error_class, message, retry_after_ms } => {
            next.error_class = Some(error_class.clone());
            next.error_message = message.as_deref().map(clip_message);
            ev.error_class = Some(error_class.clone());
            let wait = policy.delay_ms(rec.attempt_count, jitter, *retry_after_ms);
            let elapsed_out = policy.max_elapsed_ms.is_some_and(|max| now_ms + wait - rec.created_at > max);
            if rec.attempt_count >= policy.max_attempts || elapsed_out {
                reason.push_str(&if elapsed_out {
                    format!("; retry time limit reached after {} attempts", rec.attempt_count)
                } else {
                    format!("; retry limit reached after {} attempts", rec.attempt_count)
                });
                if matches!(outcome, Outcome::AmbiguousRetryable { .. }) {
                    // The provider may have acted: FAILED would claim it did not.
                    if rec.state == State::Unknown {
                        return Ok(CompletionPlan { record: rec.clone(), changed: false, event: None });
                    }
                    next.state = State::Unknown;
                    reason.push_str("; the provider may have acted, so the outcome is UNKNOWN");
                } else {
                    next.state = State::Failed;
                    next.completed_at = Some(now_ms);
                }
            } else {
                next.state = State::Pending;
                next.next_attempt_at = Some(now_ms + wait);
                ev.wait_ms = Some(wait);
                reason.push_str(&format!("; next attempt in {wait} ms"));
            }
        }
        Outcome::Unknown { message } => {
            next.state = State::Unknown;
            next.error_class = Some("unknown".into());
            next.error_message = message.as_deref().map(clip_message);
        }
    }
    if late {
        reason.push_str(" (late: reported after the lease expired, no newer grant exists)");
    }
    debug_assert!(rec.state.can_become(next.state));
    ev.to_state = Some(next.state);
    ev.reason = Some(reason);
    Ok(CompletionPlan { record: next, changed: true, event: Some(ev) })
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_connectors_outcome_is_made_storable_and_then_valid() {
        let o = Outcome::FinalFailure {
            error_class: "rejected".into(),
            message: Some("HTTP 400: \u{1f}\u{8b}\0\0".into()),
            result: None,
        };
        assert!(o.validate().is_err(), "NUL is refused as sent");
        let s = o.into_storable();
        assert!(s.validate().is_ok(), "{s:?}");
        assert!(
            matches!(&s, Outcome::FinalFailure { message: Some(m), .. } if m == "HTTP 400: \\u{1f}\\u{8b}\\u{0}\\u{0}"),
            "{s:?}"
        );
        let ok = Outcome::Succeeded { provider_ref: "ref\u{7}1".into(), result: None }.into_storable();
        assert_eq!(ok, Outcome::Succeeded { provider_ref: "ref\\u{7}1".into(), result: None });
        assert!(ok.validate().is_ok());
    }

    #[test]
    fn a_message_with_nul_is_refused() {
        let o = super::Outcome::Unknown { message: Some("a\0b".into()) };
        assert!(matches!(o.validate(), Err(super::CompleteError::Invalid(m)) if m.contains("NUL")));
        assert!(super::Outcome::Unknown { message: Some("line 1\nline 2".into()) }.validate().is_ok());
    }

    #[test]
    fn long_messages_are_clipped_at_a_character_boundary() {
        assert_eq!(clip_message("short"), "short");
        let long = "é".repeat(MAX_MESSAGE_LEN);
        let c = clip_message(&long);
        assert!(c.len() <= MAX_MESSAGE_LEN && c.ends_with('…') && c.starts_with("éé"));
    }

    use super::*;
    use crate::decision::{AcquireInput, plan_acquire};
    use serde_json::json;

    fn acquired() -> OperationRecord {
        let input = AcquireInput {
            tenant: "t".into(),
            key: "k".into(),
            action: "send".into(),
            payload: json!({"to": "x"}),
            fingerprint: "f".into(),
            lease_ms: 1000,
            redo_safe: false,
            connector: None,
            holder: None,
            actor: Actor::default(),
        };
        plan_acquire(None, &input, 0).record
    }

    fn done(rec: &OperationRecord, token: i64, o: Outcome, now: i64) -> Result<CompletionPlan, CompleteError> {
        plan_completion(rec, token, &o, &Actor::default(), &RetryPolicy::default(), 0.5, now)
    }

    fn ok(r: &str) -> Outcome {
        Outcome::Succeeded { provider_ref: r.into(), result: None }
    }

    #[test]
    fn success_needs_evidence_and_the_current_token() {
        let rec = acquired();
        assert!(matches!(done(&rec, 1, ok(" "), 10), Err(CompleteError::Invalid(_))));
        assert_eq!(done(&rec, 2, ok("m"), 10).unwrap_err(), CompleteError::StaleToken { presented: 2, current: 1 });
        let p = done(&rec, 1, ok("m"), 10).unwrap();
        assert_eq!(p.record.state, State::Succeeded);
        assert_eq!(p.record.provider_ref.as_deref(), Some("m"));
        assert_eq!(p.record.version, rec.version + 1);
    }

    #[test]
    fn repeats_are_idempotent_and_other_completions_of_final_records_refused() {
        let rec = done(&acquired(), 1, ok("m"), 10).unwrap().record;
        let again = done(&rec, 1, ok("m"), 20).unwrap();
        assert!(!again.changed);
        assert_eq!(again.record, rec);
        assert_eq!(
            done(&rec, 1, ok("other"), 20).unwrap_err(),
            CompleteError::AlreadyFinal { state: State::Succeeded }
        );
        let fail = Outcome::FinalFailure { error_class: "validation".into(), message: None, result: None };
        assert!(matches!(done(&rec, 1, fail, 20), Err(CompleteError::AlreadyFinal { .. })));
    }

    #[test]
    fn retryable_failure_schedules_the_next_attempt_until_the_limit() {
        let rec = acquired();
        let o =
            Outcome::RetryableFailure { error_class: "unavailable".into(), message: None, retry_after_ms: Some(1500) };
        let p = done(&rec, 1, o.clone(), 100).unwrap();
        assert_eq!(p.record.state, State::Pending);
        assert_eq!(p.record.next_attempt_at, Some(1600));
        let repeat = done(&p.record, 1, o.clone(), 200).unwrap();
        assert!(!repeat.changed, "a lost answer's retry is idempotent");
        let other = Outcome::RetryableFailure { error_class: "timeout".into(), message: None, retry_after_ms: None };
        assert!(matches!(done(&p.record, 1, other, 200), Err(CompleteError::NotExecuting { .. })));
        let mut last = rec.clone();
        last.attempt_count = RetryPolicy::default().max_attempts;
        assert_eq!(done(&last, 1, o, 100).unwrap().record.state, State::Failed);
    }

    /// Issue 11 item 2: an ambiguous answer (HTTP 504 after the request was sent) from a
    /// provider that deduplicates by the key is retried like a retryable failure, but when
    /// the attempts run out it is UNKNOWN — the provider may have acted — never FAILED.
    #[test]
    fn an_ambiguous_answer_retried_to_the_limit_is_unknown_not_failed() {
        let rec = acquired();
        let o = Outcome::AmbiguousRetryable {
            error_class: "server_error".into(),
            message: Some("HTTP 504".into()),
            retry_after_ms: Some(1500),
        };
        let p = done(&rec, 1, o.clone(), 100).unwrap();
        assert_eq!((p.record.state, p.record.next_attempt_at), (State::Pending, Some(1600)));
        assert!(!done(&p.record, 1, o.clone(), 200).unwrap().changed, "a repeat is idempotent");
        let mut last = rec.clone();
        last.attempt_count = RetryPolicy::default().max_attempts;
        let p = done(&last, 1, o.clone(), 100).unwrap();
        assert_eq!(p.record.state, State::Unknown);
        assert_eq!((p.record.completed_at, p.record.error_class.as_deref()), (None, Some("server_error")));
        assert!(p.event.unwrap().reason.unwrap().contains("may have acted"));
        assert!(!done(&p.record, 1, o, 300).unwrap().changed, "a repeat on the UNKNOWN record changes nothing");
        // The time limit ends it the same way.
        let timed = RetryPolicy { max_elapsed_ms: Some(50), ..RetryPolicy::default() };
        let o = Outcome::AmbiguousRetryable { error_class: "timeout".into(), message: None, retry_after_ms: None };
        let p = plan_completion(&rec, 1, &o, &Actor::default(), &timed, 0.5, 100).unwrap();
        assert_eq!(p.record.state, State::Unknown);
    }

    #[test]
    fn only_the_executor_completes_a_connectors_operation() {
        let mut rec = acquired();
        rec.connector = Some("mail".into());
        let o = ok("m");
        let policy = RetryPolicy::default();
        let by_caller = plan_completion(&rec, rec.fencing_token, &o, &Actor::default(), &policy, 0.5, 10);
        assert_eq!(by_caller.unwrap_err(), CompleteError::ConnectorOwned { connector: "mail".into() });
        let by_executor = plan_completion(&rec, rec.fencing_token, &o, &Actor::executor(), &policy, 0.5, 10).unwrap();
        assert_eq!(by_executor.record.evidence_source.as_deref(), Some("connector"));
        rec.connector = Some("lookup:proxy".into());
        assert!(plan_completion(&rec, rec.fencing_token, &o, &Actor::default(), &policy, 0.5, 10).is_ok());
    }

    #[test]
    fn late_completion_by_the_last_holder_settles_unknown() {
        let mut rec = acquired();
        rec.state = State::Unknown;
        rec.lease_expires_at = None;
        let p = done(&rec, 1, ok("m"), 5000).unwrap();
        assert_eq!(p.record.state, State::Succeeded);
        assert!(p.event.unwrap().reason.unwrap().contains("late"));
    }
}
