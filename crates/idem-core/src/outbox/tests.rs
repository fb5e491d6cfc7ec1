use super::examples::{bad_events, event};
use super::*;
use proptest::prelude::*;
use serde_json::json;

#[test]
fn bad_events_are_refused_naming_the_rule() {
    for (what, e, expected) in bad_events() {
        assert_eq!(e.validate(), Err(expected), "{what}");
    }
}

#[test]
fn events_at_the_limits_are_accepted() {
    let mut e = event();
    e.id = "x".repeat(MAX_EVENT_ID_LEN);
    e.aggregate_id = "9".repeat(MAX_AGGREGATE_LEN);
    e.topic = format!("a.{}", "b".repeat(MAX_TOPIC_LEN - 2));
    // {"blob":"…"} is 11 bytes around the string.
    e.payload = json!({"blob": "x".repeat(MAX_PAYLOAD_BYTES - 11)});
    for i in 0..MAX_HEADERS {
        e.headers.insert(format!("x-h{i}"), "v".repeat(MAX_HEADER_LEN));
    }
    assert_eq!(e.validate(), Ok(()));
}

fn policy() -> RetryPolicy {
    RetryPolicy { base_ms: 100, cap_ms: 10_000, max_attempts: 5, max_elapsed_ms: None }
}

fn row(attempts: i64, trigger: Trigger) -> AttemptRow {
    AttemptRow { attempts, created_at: 0, trigger }
}

fn retryable(retry_after_ms: Option<i64>) -> DeliveryResult {
    DeliveryResult::Retryable { error_class: "unavailable".into(), message: "503".into(), retry_after_ms }
}

#[test]
fn delivered_needs_evidence() {
    let p = plan_delivery(
        &row(1, Trigger::Scheduled),
        DeliveryResult::Delivered { evidence: "HTTP 204".into() },
        &policy(),
        1_000,
        0.5,
    );
    assert_eq!(p, DeliveryPlan::Delivered { evidence: "HTTP 204".into() });
    let p = plan_delivery(
        &row(1, Trigger::Scheduled),
        DeliveryResult::Delivered { evidence: " ".into() },
        &policy(),
        1_000,
        0.5,
    );
    assert!(matches!(p, DeliveryPlan::RetryAt { .. }), "{p:?}");
}

#[test]
fn failures_retry_with_full_jitter_until_the_last_attempt() {
    let p = plan_delivery(&row(3, Trigger::Scheduled), retryable(None), &policy(), 1_000, 0.5);
    // ceiling 100·2² = 400, half of it.
    assert_eq!(p, DeliveryPlan::RetryAt { at_ms: 1_200, error_class: "unavailable".into(), message: "503".into() });
    let p = plan_delivery(
        &row(2, Trigger::Scheduled),
        DeliveryResult::Unknown { error_class: "timeout".into(), message: "timeout".into() },
        &policy(),
        0,
        0.0,
    );
    assert!(matches!(p, DeliveryPlan::RetryAt { at_ms: 0, .. }), "unknown is retried: {p:?}");
    let p = plan_delivery(&row(5, Trigger::Scheduled), retryable(None), &policy(), 1_000, 0.5);
    assert!(matches!(p, DeliveryPlan::Dead { .. }), "the fifth of five attempts: {p:?}");
}

#[test]
fn rejected_is_dead_at_once_and_a_manual_attempt_schedules_nothing() {
    let rejected = DeliveryResult::Rejected { error_class: "validation".into(), message: "400".into() };
    assert!(matches!(
        plan_delivery(&row(1, Trigger::Scheduled), rejected, &policy(), 0, 0.5),
        DeliveryPlan::Dead { .. }
    ));
    let p = plan_delivery(&row(1, Trigger::Manual), retryable(None), &policy(), 0, 0.5);
    assert!(matches!(p, DeliveryPlan::Dead { ref message, .. } if message.contains("manual")), "{p:?}");
}

#[test]
fn max_elapsed_ends_the_schedule() {
    let p = RetryPolicy { max_elapsed_ms: Some(1_000), ..policy() };
    assert!(matches!(
        plan_delivery(&row(1, Trigger::Scheduled), retryable(None), &p, 500, 0.0),
        DeliveryPlan::RetryAt { .. }
    ));
    assert!(matches!(
        plan_delivery(&row(1, Trigger::Scheduled), retryable(Some(600)), &p, 500, 0.0),
        DeliveryPlan::Dead { .. }
    ));
}

#[test]
fn operators_act_on_dead_letters_only_and_always_with_a_reason() {
    use OperatorAction::*;
    assert_eq!(plan_operator_action(OutboxState::Dead, Redrive, "receiver fixed"), Ok(OutboxState::Pending));
    assert_eq!(plan_operator_action(OutboxState::Dead, Skip, "obsolete"), Ok(OutboxState::Skipped));
    assert_eq!(plan_operator_action(OutboxState::Dead, Skip, "  "), Err(OperatorRefusal::MissingReason));
    assert_eq!(plan_operator_action(OutboxState::Dead, Skip, &"x".repeat(2001)), Err(OperatorRefusal::BadReason));
    for s in [OutboxState::Pending, OutboxState::Delivered, OutboxState::Skipped] {
        for a in [Redrive, Skip] {
            assert_eq!(plan_operator_action(s, a, "why"), Err(OperatorRefusal::NotDead(s.as_str())));
        }
    }
}

fn any_result() -> impl Strategy<Value = DeliveryResult> {
    prop_oneof![
        "[a-z ]{0,3}".prop_map(|evidence| DeliveryResult::Delivered { evidence }),
        proptest::option::of(0i64..100_000).prop_map(retryable),
        Just(DeliveryResult::Unknown { error_class: "timeout".into(), message: "lost".into() }),
        Just(DeliveryResult::Rejected { error_class: "validation".into(), message: "400".into() }),
    ]
}

proptest! {
    /// Attempts are bounded; nothing is delivered without evidence; a retry is never
    /// sooner than Retry-After nor later than the cap (plus Retry-After); a manual
    /// attempt never schedules another.
    #[test]
    fn delivery_plans_keep_their_promises(
        attempts in 1i64..12, manual in any::<bool>(), result in any_result(),
        now in 0i64..1_000_000_000, jitter in 0.0f64..1.0,
    ) {
        let trigger = if manual { Trigger::Manual } else { Trigger::Scheduled };
        let plan = plan_delivery(&row(attempts, trigger), result.clone(), &policy(), now, jitter);
        match &plan {
            DeliveryPlan::Delivered { evidence } => {
                prop_assert!(!evidence.trim().is_empty());
                let was_delivered = matches!(result, DeliveryResult::Delivered { .. });
                prop_assert!(was_delivered);
            }
            DeliveryPlan::RetryAt { at_ms, .. } => {
                prop_assert!(!manual);
                prop_assert!(attempts < policy().max_attempts);
                let floor = match result { DeliveryResult::Retryable { retry_after_ms, .. } => retry_after_ms.unwrap_or(0), _ => 0 };
                prop_assert!(*at_ms >= now + floor);
                prop_assert!(*at_ms <= now + policy().cap_ms.max(floor));
            }
            DeliveryPlan::Dead { .. } => {
                let rejected = matches!(result, DeliveryResult::Rejected { .. });
                prop_assert!(manual || attempts >= policy().max_attempts || rejected);
            }
        }
    }
}
