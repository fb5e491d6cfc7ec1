//! Plan-level tests: given records, assert the returned plan. The canned histories (see
//! `flow::canned`) are the shared fixtures of DESIGN.md §8's checks; each test's doc comment
//! lists its checkpoints.

use super::*;
use crate::State;
use crate::flow::canned::{NOW, checkpoints, checkpoints_with, comp, def, instance, op, start};
use crate::flow::definition::RecoveryPolicy;
use crate::flow::record::InstanceTombstone;
use serde_json::json;

fn advance(inst: &InstanceRecord, ops: Vec<Option<crate::record::OperationRecord>>) -> Next {
    plan_advance(inst, &def(), &checkpoints(ops), NOW).unwrap()
}

#[test]
fn start_is_idempotent_by_instance_id_and_input() {
    let first = plan_start(None, None, &start(), NOW);
    assert_eq!(first.decision, StartDecision::Created);
    assert_eq!(first.record.state, InstanceState::Running);
    assert_eq!(first.record.next_run_at, Some(NOW), "the runner picks a new instance up at once");
    assert_eq!(first.events[0].kind, "started");
    let again = plan_start(Some(&first.record), None, &start(), NOW + 1);
    assert_eq!(again.decision, StartDecision::Existing);
    assert_eq!(again.record, first.record, "a repeated start changes nothing");
    assert_eq!(again.events[0].kind, "start_replayed");
    let mut other = start();
    other.input_fingerprint = "0".repeat(64);
    assert_eq!(plan_start(Some(&first.record), None, &other, NOW).decision, StartDecision::Mismatch);
    let mut other = start();
    other.workflow = "refund".into();
    assert_eq!(plan_start(Some(&first.record), None, &other, NOW).decision, StartDecision::Mismatch);
    // A starter that runs the first pass itself holds the instance, as a runner's claim would.
    let mut held = start();
    held.hold_ms = 5_000;
    assert_eq!(plan_start(None, None, &held, NOW).record.next_run_at, Some(NOW + 5_000));
}

#[test]
fn a_changed_definition_is_another_intent_only_when_the_caller_gave_it() {
    let first = plan_start(None, None, &start(), NOW).record;
    let mut changed = start();
    changed.definition_version = "9".repeat(64);
    assert_eq!(
        plan_start(Some(&first), None, &changed, NOW).decision,
        StartDecision::Existing,
        "the configuration changed under a running instance: the start is still the same intent"
    );
    changed.definition_given = true;
    let p = plan_start(Some(&first), None, &changed, NOW);
    assert_eq!(p.decision, StartDecision::Mismatch);
    assert!(p.events[0].reason.as_deref().unwrap().contains("definition"));
    assert_eq!(p.record.definition_version, def().version(), "the pinned version never changes");
}

#[test]
fn a_live_tombstone_makes_a_late_start() {
    let t = InstanceTombstone {
        tenant: "t".into(),
        id_hash: "h".into(),
        input_fingerprint: "f".repeat(64),
        final_state: InstanceState::Succeeded,
        completed_at: NOW - 100,
        expires_at: NOW + 100,
    };
    let p = plan_start(None, Some(&t), &start(), NOW);
    assert_eq!(p.decision, StartDecision::Late);
    assert!(p.events.is_empty());
    assert_eq!(plan_start(None, Some(&t), &start(), NOW + 100).decision, StartDecision::Created);
}

/// `three_steps_ok`: create_order SUCCEEDED, send_confirmation SUCCEEDED, write_back SUCCEEDED
/// → the instance SUCCEEDS; along the way each next step runs with its built input.
#[test]
fn three_steps_ok() {
    let inst = instance();
    assert_eq!(advance(&inst, vec![]), Next::Run { index: 0, payload: json!({"customer": "C-1"}) });
    let s1 = op("create_order", State::Succeeded);
    assert_eq!(advance(&inst, vec![Some(s1.clone())]), Next::Run { index: 1, payload: json!({"order_id": 42}) });
    let s2 = op("send_confirmation", State::Succeeded);
    assert_eq!(
        advance(&inst, vec![Some(s1.clone()), Some(s2.clone())]),
        Next::Run { index: 2, payload: json!({"order": "create_order-ref"}) }
    );
    let s3 = op("write_back", State::Succeeded);
    let next = advance(&inst, vec![Some(s1), Some(s2), Some(s3)]);
    assert!(matches!(next, Next::Finish { state: InstanceState::Succeeded, .. }), "{next:?}");
    let (rec, events) = plan_instance_update(&inst, &def(), &next, &Actor::system(), NOW).unwrap();
    assert_eq!((rec.state, rec.next_run_at, rec.completed_at), (InstanceState::Succeeded, None, Some(NOW)));
    assert_eq!(events[0].kind, "succeeded");
}

/// `second_step_unknown_lookup_found`: create_order SUCCEEDED, send_confirmation UNKNOWN with
/// `lookup_before_redo` → wait for the reconciler; once it found the message (SUCCEEDED) the
/// instance goes on to write_back without a redo.
#[test]
fn second_step_unknown_lookup_found() {
    let mut d = def();
    d.steps[1].policy = RecoveryPolicy::LookupBeforeRedo;
    let inst = instance();
    let s1 = op("create_order", State::Succeeded);
    let mut s2 = op("send_confirmation", State::Unknown);
    s2.next_attempt_at = Some(NOW + 3_000);
    let next = plan_advance(&inst, &d, &checkpoints(vec![Some(s1.clone()), Some(s2)]), NOW).unwrap();
    assert_eq!(next, Next::Wait { index: 1, until_ms: NOW + 3_000 });
    let found = op("send_confirmation", State::Succeeded);
    let next = plan_advance(&inst, &d, &checkpoints(vec![Some(s1), Some(found)]), NOW).unwrap();
    assert!(matches!(next, Next::Run { index: 2, .. }), "{next:?}");
}

/// `second_step_unknown_manual`: create_order SUCCEEDED, send_confirmation UNKNOWN under
/// `manual` → PAUSED at send_confirmation; resolved SUCCEEDED by an operator → RESUMED.
#[test]
fn second_step_unknown_manual() {
    let inst = instance();
    let s1 = op("create_order", State::Succeeded);
    let s2 = op("send_confirmation", State::Unknown);
    let next = advance(&inst, vec![Some(s1.clone()), Some(s2.clone())]);
    let Next::Pause { index: 1, class: "unknown_manual", .. } = &next else { panic!("{next:?}") };
    let (paused, events) = plan_instance_update(&inst, &def(), &next, &Actor::system(), NOW).unwrap();
    assert_eq!(paused.state, InstanceState::Paused);
    assert_eq!(paused.stopped_step.as_deref(), Some("send_confirmation"));
    assert_eq!(events[0].kind, "paused");
    assert_eq!(advance(&paused, vec![Some(s1.clone()), Some(s2)]), Next::Idle, "still waiting for a person");
    let resolved = op("send_confirmation", State::Succeeded);
    let next = advance(&paused, vec![Some(s1), Some(resolved)]);
    assert_eq!(next, Next::Resume { to: InstanceState::Running });
    let (running, events) = plan_instance_update(&paused, &def(), &next, &Actor::system(), NOW).unwrap();
    assert_eq!((running.state, running.stopped_step.as_deref()), (InstanceState::Running, None));
    assert_eq!(events[0].kind, "resumed");
}

#[test]
fn unknown_redo_safe_is_redone_and_review_always_pauses() {
    let inst = instance();
    let ok = || Some(op("create_order", State::Succeeded));
    let mid = || Some(op("send_confirmation", State::Succeeded));
    assert_eq!(advance(&inst, vec![ok(), mid(), Some(op("write_back", State::Unknown))]), Next::Redo { index: 2 });
    let mut flagged = op("write_back", State::Unknown);
    flagged.needs_review = true;
    let next = advance(&inst, vec![ok(), mid(), Some(flagged)]);
    assert!(matches!(next, Next::Pause { index: 2, class: "needs_review", .. }), "{next:?}");
}

#[test]
fn retries_wait_until_due_and_expired_leases_go_through_acquire() {
    let inst = instance();
    let mut pending = op("create_order", State::Pending);
    pending.next_attempt_at = Some(NOW + 500);
    assert_eq!(advance(&inst, vec![Some(pending.clone())]), Next::Wait { index: 0, until_ms: NOW + 500 });
    pending.next_attempt_at = Some(NOW);
    assert_eq!(advance(&inst, vec![Some(pending.clone())]), Next::Run { index: 0, payload: pending.payload.clone() });
    let mut executing = op("create_order", State::Executing);
    executing.lease_expires_at = Some(NOW + 700);
    assert_eq!(advance(&inst, vec![Some(executing.clone())]), Next::Wait { index: 0, until_ms: NOW + 700 });
    executing.lease_expires_at = Some(NOW);
    assert_eq!(
        advance(&inst, vec![Some(executing.clone())]),
        Next::Run { index: 0, payload: executing.payload },
        "the acquire records the expiry (or re-grants a redo_safe step)"
    );
}

#[test]
fn a_failed_step_fails_the_instance_and_a_missing_value_fails_it_before_the_call() {
    let inst = instance();
    let mut failed = op("create_order", State::Failed);
    failed.error_class = Some("validation".into());
    let next = advance(&inst, vec![Some(failed)]);
    let Next::Finish { state: InstanceState::Failed, index: Some(0), class: Some("step_failed"), reason } = &next
    else {
        panic!("{next:?}")
    };
    assert!(reason.contains("validation"), "{reason}");
    let mut no_id = op("create_order", State::Succeeded);
    no_id.result = Some(json!({"other": 1}));
    let next = advance(&inst, vec![Some(no_id)]);
    let Next::Finish { class: Some("step_input"), index: Some(1), reason, .. } = &next else { panic!("{next:?}") };
    assert!(reason.contains("/steps/create_order/result/id"), "{reason}");
}

/// The operation of step `step`, made by the caller's code (no connector).
fn caller_op(step: &str, state: State) -> crate::OperationRecord {
    let mut o = op(step, state);
    o.connector = None;
    o
}

#[test]
fn steps_the_caller_performs_are_waited_for() {
    let mut d = def();
    for s in &mut d.steps {
        s.connector = None;
        s.input = Value::Null;
        s.policy = RecoveryPolicy::Manual;
    }
    let inst = instance();
    let cps = checkpoints(vec![Some(caller_op("create_order", State::Succeeded))]);
    assert_eq!(
        plan_advance(&inst, &d, &cps, NOW).unwrap(),
        Next::WaitForCaller { index: 1, until_ms: NOW + CALLER_POLL_MS }
    );
    let mut expired = caller_op("send_confirmation", State::Executing);
    expired.lease_expires_at = Some(NOW - 1);
    let cps = checkpoints(vec![Some(caller_op("create_order", State::Succeeded)), Some(expired)]);
    assert_eq!(
        plan_advance(&inst, &d, &cps, NOW).unwrap(),
        Next::Wait { index: 1, until_ms: NOW + EXPIRY_POLL_MS },
        "idem never acquires a step the caller performs"
    );
    let cps = checkpoints(vec![
        Some(caller_op("create_order", State::Succeeded)),
        Some(caller_op("send_confirmation", State::Unknown)),
    ]);
    assert!(matches!(plan_advance(&inst, &d, &cps, NOW).unwrap(), Next::Pause { class: "unknown_caller", .. }));
}

/// create_order's key holds an operation made through `/v1/operations` (another action, or
/// no connector), SUCCEEDED: it is never the step's result — the instance pauses
/// (`step_key_conflict`) instead of passing its reference on, and it is not compensated.
/// The same for an operation under a compensation's key.
#[test]
fn an_operation_not_made_for_the_step_never_counts_as_its_result() {
    let inst = instance();
    let mut unrelated = op("create_order", State::Succeeded);
    unrelated.action = "unrelated".into();
    let mut no_connector = op("create_order", State::Succeeded);
    no_connector.connector = None;
    // The same action and connector, triggered through /v1/operations: its fingerprint is
    // its payload's own, not the step fingerprint idem gives what it performs.
    let mut triggered = op("create_order", State::Succeeded);
    triggered.fingerprint = crate::fingerprint(&triggered.payload, None).unwrap().0;
    for foreign in [unrelated, no_connector, triggered] {
        let next = advance(&inst, vec![Some(foreign.clone())]);
        let Next::Pause { index: 0, class: "step_key_conflict", reason } = &next else { panic!("{next:?}") };
        assert!(reason.contains("ORD-7:intake:create_order") && reason.contains("re-run"), "{reason}");
        let cps = checkpoints(vec![Some(foreign)]);
        assert!(!needs_compensation(&def().steps[0], &cps[0]), "someone else's effect is not compensated");
    }
    let mut compensating = instance();
    compensating.state = InstanceState::Compensating;
    let mut other = comp("create_order", State::Succeeded);
    other.action = "unrelated".into();
    let cps = checkpoints_with(
        vec![Some(op("create_order", State::Succeeded)), Some(op("send_confirmation", State::Failed))],
        vec![Some(other)],
    );
    let next = plan_advance(&compensating, &def(), &cps, NOW).unwrap();
    let Next::Pause { index: 0, class: "step_key_conflict", reason } = &next else { panic!("{next:?}") };
    assert!(reason.contains("compensate") && reason.contains("cancel_order"), "{reason}");
}

/// A step's operation read back from storage (its payload through JSON text, doubles
/// included) is still recognised as the one idem made: the check recomputes its
/// fingerprint from the stored payload.
#[test]
fn a_stored_step_operation_with_awkward_doubles_is_still_the_steps() {
    let mut o = op("create_order", State::Succeeded);
    o.payload = json!({"amounts": [1.0715660391465826e-75, -1.81996730402717e-179, 0.1, 1e300, -0.0, 5e-324]});
    let o = crate::flow::canned::made_by_idem(o);
    let mut stored = o.clone();
    stored.payload = serde_json::from_str(&serde_json::to_string(&o.payload).unwrap()).unwrap();
    let cps = checkpoints(vec![Some(stored)]);
    assert!(cps[0].foreign_operation(&def().steps[0]).is_none());
}

/// Progress: the run of SUCCEEDED steps; a COMPENSATED step counts as having succeeded;
/// a COMPENSATED instance has no current step.
#[test]
fn progress_names_the_last_good_step_and_the_current_one() {
    use crate::flow::record::Progress;
    let cps =
        checkpoints(vec![Some(op("create_order", State::Succeeded)), Some(op("send_confirmation", State::Failed))]);
    let p = Progress::of(InstanceState::Failed, &cps);
    assert_eq!(
        (p.last_good_step.as_deref(), p.current_step.as_deref()),
        (Some("create_order"), Some("send_confirmation"))
    );
    let cps = checkpoints_with(
        vec![Some(op("create_order", State::Succeeded)), Some(op("send_confirmation", State::Failed))],
        vec![Some(comp("create_order", State::Succeeded))],
    );
    let p = Progress::of(InstanceState::Compensated, &cps);
    assert_eq!((p.last_good_step.as_deref(), p.current_step), (Some("create_order"), None));
    let p = Progress::of(InstanceState::Running, &checkpoints(vec![]));
    assert_eq!((p.last_good_step, p.current_step.as_deref()), (None, Some("create_order")));
}

#[test]
fn checkpoints_that_do_not_match_the_definition_are_corruption() {
    let inst = instance();
    let mut cps = checkpoints(vec![]);
    cps.swap(0, 1);
    assert!(plan_advance(&inst, &def(), &cps, NOW).is_err());
    assert!(plan_advance(&inst, &def(), &cps[..2], NOW).is_err());
}

#[test]
fn final_instances_are_idle_and_waits_write_only_when_the_time_changes() {
    let mut inst = instance();
    let next = Next::Wait { index: 0, until_ms: NOW + 10 };
    let (rec, events) = plan_instance_update(&inst, &def(), &next, &Actor::system(), NOW).unwrap();
    assert_eq!((rec.next_run_at, events.len(), rec.version), (Some(NOW + 10), 0, inst.version + 1));
    assert!(plan_instance_update(&rec, &def(), &next, &Actor::system(), NOW).is_none());
    inst.state = InstanceState::Succeeded;
    assert_eq!(plan_advance(&inst, &def(), &checkpoints(vec![]), NOW).unwrap(), Next::Idle);
}

/// `third_step_failed_compensated`: create_order SUCCEEDED, send_confirmation SUCCEEDED,
/// write_back FAILED → COMPENSATING; send_correction, then cancel_order (last step first),
/// each built from its step's checkpoint → COMPENSATED, both steps COMPENSATED.
#[test]
fn third_step_failed_compensated() {
    let inst = instance();
    let ops = || {
        vec![
            Some(op("create_order", State::Succeeded)),
            Some(op("send_confirmation", State::Succeeded)),
            Some(op("write_back", State::Failed)),
        ]
    };
    let next = plan_advance(&inst, &def(), &checkpoints(ops()), NOW).unwrap();
    let Next::BeginCompensation { index: 2, .. } = &next else { panic!("{next:?}") };
    let (compensating, events) = plan_instance_update(&inst, &def(), &next, &Actor::system(), NOW).unwrap();
    assert_eq!((compensating.state, compensating.next_run_at), (InstanceState::Compensating, Some(NOW)));
    assert_eq!(events[0].kind, "compensating");
    let at = |comps| plan_advance(&compensating, &def(), &checkpoints_with(ops(), comps), NOW).unwrap();
    assert_eq!(at(vec![]), Next::Compensate { index: 1, payload: json!({"customer": "C-1"}) }, "the last step first");
    assert_eq!(
        at(vec![None, Some(comp("send_confirmation", State::Succeeded))]),
        Next::Compensate { index: 0, payload: json!({"order": "create_order-ref"}) },
        "built from the step's own checkpoint"
    );
    let all = vec![Some(comp("create_order", State::Succeeded)), Some(comp("send_confirmation", State::Succeeded))];
    let cps = checkpoints_with(ops(), all.clone());
    assert_eq!(
        (cps[0].state, cps[1].state, cps[2].state),
        (StepState::Compensated, StepState::Compensated, StepState::Failed)
    );
    let next = at(all);
    let Next::Finish { state: InstanceState::Compensated, .. } = &next else { panic!("{next:?}") };
    let (done, events) = plan_instance_update(&compensating, &def(), &next, &Actor::system(), NOW).unwrap();
    assert_eq!((done.state, done.completed_at, done.next_run_at), (InstanceState::Compensated, Some(NOW), None));
    assert_eq!(events[0].kind, "compensated");
}

/// `compensation_failed_paused`: the steps as in `third_step_failed_compensated`, COMPENSATING,
/// send_correction FAILED → PAUSED (the compensation failed); still paused while it is;
/// once an operator settles it (a re-run's new compensation SUCCEEDED) → back to
/// COMPENSATING, not RUNNING.
#[test]
fn compensation_failed_paused() {
    let mut inst = instance();
    inst.state = InstanceState::Compensating;
    let ops = || {
        vec![
            Some(op("create_order", State::Succeeded)),
            Some(op("send_confirmation", State::Succeeded)),
            Some(op("write_back", State::Failed)),
        ]
    };
    let failed = vec![None, Some(comp("send_confirmation", State::Failed))];
    let next = plan_advance(&inst, &def(), &checkpoints_with(ops(), failed.clone()), NOW).unwrap();
    let Next::Pause { index: 1, class: "compensation_failed", reason } = &next else { panic!("{next:?}") };
    assert!(reason.contains("send_correction"), "{reason}");
    let (paused, _) = plan_instance_update(&inst, &def(), &next, &Actor::system(), NOW).unwrap();
    assert_eq!(plan_advance(&paused, &def(), &checkpoints_with(ops(), failed), NOW).unwrap(), Next::Idle);
    let settled = vec![None, Some(comp("send_confirmation", State::Succeeded))];
    assert_eq!(
        plan_advance(&paused, &def(), &checkpoints_with(ops(), settled), NOW).unwrap(),
        Next::Resume { to: InstanceState::Compensating }
    );
    let mut review = comp("send_confirmation", State::Unknown);
    review.needs_review = true;
    let next = plan_advance(&inst, &def(), &checkpoints_with(ops(), vec![None, Some(review)]), NOW).unwrap();
    assert!(matches!(next, Next::Pause { class: "compensation_needs_review", .. }), "{next:?}");
    let mut later = comp("send_confirmation", State::Pending);
    later.next_attempt_at = Some(NOW + 700);
    let next = plan_advance(&inst, &def(), &checkpoints_with(ops(), vec![None, Some(later)]), NOW).unwrap();
    assert_eq!(next, Next::Wait { index: 1, until_ms: NOW + 700 }, "a retryable compensation waits for its retry");
}

/// Under `compensate`, an UNKNOWN step starts compensation, and its own compensation runs
/// (its effect may exist); a step failing first with nothing to undo just FAILS.
#[test]
fn an_unknown_step_under_compensate_is_compensated_with_the_earlier_ones() {
    let mut d = def();
    d.steps[1].policy = RecoveryPolicy::Compensate;
    let inst = instance();
    let ops = || vec![Some(op("create_order", State::Succeeded)), Some(op("send_confirmation", State::Unknown))];
    let next = plan_advance(&inst, &d, &checkpoints(ops()), NOW).unwrap();
    assert!(matches!(next, Next::BeginCompensation { index: 1, .. }), "{next:?}");
    let mut compensating = inst.clone();
    compensating.state = InstanceState::Compensating;
    let next = plan_advance(&compensating, &d, &checkpoints(ops()), NOW).unwrap();
    assert!(matches!(next, Next::Compensate { index: 1, .. }), "the UNKNOWN step is compensated too: {next:?}");
    let first_failed = vec![Some(op("create_order", State::Failed))];
    assert!(matches!(
        plan_advance(&inst, &def(), &checkpoints(first_failed), NOW).unwrap(),
        Next::Finish { state: InstanceState::Failed, .. }
    ));
    let _ = start();
}

#[test]
fn an_operator_compensates_a_failed_or_paused_instance_with_a_reason() {
    let mut failed = instance();
    failed.state = InstanceState::Failed;
    let ops = vec![Some(op("create_order", State::Succeeded)), Some(op("send_confirmation", State::Unknown))];
    let ops_ = checkpoints(ops);
    let anna = Actor { principal: "ops-anna".into(), request_id: None };
    let (rec, e) = plan_operator_compensation(&failed, &def(), &ops_, "customer cancelled", &anna, NOW).unwrap();
    assert_eq!((rec.state, rec.next_run_at), (InstanceState::Compensating, Some(NOW)));
    assert_eq!((e.kind.as_str(), e.principal.as_str()), ("compensating", "ops-anna"));
    assert!(e.reason.unwrap().contains("customer cancelled"));
    let running = instance();
    assert!(matches!(
        plan_operator_compensation(&running, &def(), &ops_, "r", &anna, NOW),
        Err(CompensationRefusal::NotStopped { .. })
    ));
    let nothing = checkpoints(vec![Some(op("create_order", State::Failed))]);
    assert_eq!(
        plan_operator_compensation(&failed, &def(), &nothing, "r", &anna, NOW),
        Err(CompensationRefusal::NothingToCompensate)
    );
    let begun = checkpoints_with(
        vec![Some(op("create_order", State::Succeeded))],
        vec![Some(comp("create_order", State::Failed))],
    );
    assert_eq!(
        plan_operator_compensation(&failed, &def(), &begun, "r", &anna, NOW),
        Err(CompensationRefusal::AlreadyCompensating)
    );
}
