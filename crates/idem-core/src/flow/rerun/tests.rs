//! Re-run plans over canned histories (see `flow::canned`).

use super::*;
use crate::flow::canned::{NOW, checkpoints, checkpoints_with, comp, def, instance, op};
use crate::flow::state::InstanceState;
use crate::record::Actor;
use serde_json::json;

fn lookups(name: &str) -> bool {
    name == "erp"
}

fn failed_at_write_back() -> InstanceRecord {
    let mut i = instance();
    i.state = InstanceState::Failed;
    i
}

fn dispositions(p: &RerunPlan) -> Vec<(String, StepDisposition)> {
    p.steps.iter().map(|s| (s.step.clone(), s.disposition)).collect()
}

/// create_order SUCCEEDED, send_confirmation SUCCEEDED, write_back FAILED (an instance whose
/// steps have no compensation to run, FAILED): a plain re-run keeps the finished steps and
/// redoes write_back under a new key; naming create_order redoes it too.
#[test]
fn a_plain_rerun_continues_from_the_failed_step_and_keeps_the_finished_ones() {
    let inst = failed_at_write_back();
    let cps = checkpoints(vec![
        Some(op("create_order", State::Succeeded)),
        Some(op("send_confirmation", State::Succeeded)),
        Some(op("write_back", State::Failed)),
    ]);
    let p = plan_rerun(&inst, &def(), &cps, &[], &lookups).unwrap();
    use StepDisposition::*;
    assert_eq!(
        dispositions(&p),
        [("create_order".into(), Kept), ("send_confirmation".into(), Kept), ("write_back".into(), Redone)]
    );
    assert_eq!(p.steps[2].op_key, "ORD-7:intake:write_back:rerun-1", "a new intent, a new key");
    assert_eq!(p.steps[2].comp_key, "ORD-7:intake:write_back:rerun-1:compensate");
    assert_eq!(p.steps[2].input, Some(json!({"order": "create_order-ref"})), "shows what it would send");
    assert_eq!(p.steps[0].op_key, "ORD-7:intake:create_order");
    assert_eq!(p.resumes_as, InstanceState::Running);
    let again = plan_rerun(&inst, &def(), &cps, &[], &lookups).unwrap();
    assert_eq!(again.hash, p.hash, "the same state gives the same plan and hash");
    let named = plan_rerun(&inst, &def(), &cps, &["create_order".into()], &lookups).unwrap();
    assert_eq!(named.steps[0].disposition, Redone);
    assert_ne!(named.hash, p.hash);
    let mut moved = inst.clone();
    moved.version += 1;
    moved.next_run_at = Some(NOW + 5_000);
    moved.updated_at = NOW + 1;
    assert_eq!(
        plan_rerun(&moved, &def(), &cps, &[], &lookups).unwrap().hash,
        p.hash,
        "bookkeeping (a version bump) does not change what the operator approved"
    );
    let mut paused = inst.clone();
    paused.state = InstanceState::Paused;
    assert_ne!(plan_rerun(&paused, &def(), &cps, &[], &lookups).unwrap().hash, p.hash, "the state does");
    let looked = checkpoints(vec![
        Some(op("create_order", State::Succeeded)),
        Some(op("send_confirmation", State::Succeeded)),
        Some(op("write_back", State::Unknown)),
    ]);
    assert_ne!(
        plan_rerun(&inst, &def(), &looked, &[], &lookups).map(|p| p.hash),
        Ok(p.hash.clone()),
        "a step's state does"
    );
}

#[test]
fn refusals_say_why_and_change_nothing() {
    let cps = checkpoints(vec![Some(op("create_order", State::Succeeded))]);
    let running = instance();
    assert!(matches!(plan_rerun(&running, &def(), &cps, &[], &lookups), Err(RerunRefusal::StillRunning { .. })));
    let mut done = instance();
    done.state = InstanceState::Succeeded;
    let all = checkpoints(vec![
        Some(op("create_order", State::Succeeded)),
        Some(op("send_confirmation", State::Succeeded)),
        Some(op("write_back", State::Succeeded)),
    ]);
    assert_eq!(plan_rerun(&done, &def(), &all, &[], &lookups), Err(RerunRefusal::NothingToRedo));
    assert!(plan_rerun(&done, &def(), &all, &["write_back".into()], &lookups).is_ok(), "named: redone");
    assert_eq!(
        plan_rerun(&done, &def(), &all, &["nope".into()], &lookups),
        Err(RerunRefusal::UnknownStep("nope".into()))
    );
    let mut compensated = instance();
    compensated.state = InstanceState::Compensated;
    assert_eq!(plan_rerun(&compensated, &def(), &all, &[], &lookups), Err(RerunRefusal::Compensated));
    let mut paused = instance();
    paused.state = InstanceState::Paused;
    let unknown_mail =
        checkpoints(vec![Some(op("create_order", State::Succeeded)), Some(op("send_confirmation", State::Unknown))]);
    assert_eq!(
        plan_rerun(&paused, &def(), &unknown_mail, &[], &lookups),
        Err(RerunRefusal::NeedsResolution("send_confirmation".into())),
        "mail has no lookup: a person resolves it, or names it"
    );
    let named = plan_rerun(&paused, &def(), &unknown_mail, &["send_confirmation".into()], &lookups).unwrap();
    assert_eq!(named.steps[1].disposition, StepDisposition::Redone);
    let unknown_erp = checkpoints(vec![Some(op("create_order", State::Unknown))]);
    let p = plan_rerun(&paused, &def(), &unknown_erp, &[], &lookups).unwrap();
    assert_eq!(p.steps[0].disposition, StepDisposition::LookedUp);
    assert_eq!(p.steps[1].disposition, StepDisposition::Runs);
}

/// Paused during compensation (create_order SUCCEEDED, send_confirmation SUCCEEDED,
/// write_back FAILED; send_correction FAILED): the re-run redoes the compensation under
/// `…:compensate-2`, resumes COMPENSATING, and refuses to redo a step.
#[test]
fn a_compensation_rerun_redoes_the_failed_compensation() {
    let mut paused = instance();
    paused.state = InstanceState::Paused;
    let cps = checkpoints_with(
        vec![
            Some(op("create_order", State::Succeeded)),
            Some(op("send_confirmation", State::Succeeded)),
            Some(op("write_back", State::Failed)),
        ],
        vec![None, Some(comp("send_confirmation", State::Failed))],
    );
    let p = plan_rerun(&paused, &def(), &cps, &[], &lookups).unwrap();
    assert_eq!(p.resumes_as, InstanceState::Compensating);
    assert_eq!(p.steps[1].disposition, StepDisposition::Compensated);
    assert_eq!(p.steps[1].comp_key, "ORD-7:intake:send_confirmation:compensate-2");
    assert_eq!(
        (p.steps[1].key.as_str(), p.steps[1].action.as_str()),
        (p.steps[1].comp_key.as_str(), "send_correction")
    );
    // create_order's compensation has not begun: it runs after, a new effect the plan shows.
    assert_eq!(p.steps[0].disposition, StepDisposition::CompensationRuns);
    assert_eq!(
        (p.steps[0].key.as_str(), p.steps[0].action.as_str()),
        ("ORD-7:intake:create_order:compensate", "cancel_order")
    );
    assert_eq!(p.steps[0].input, Some(json!({"order": "create_order-ref"})), "shows what it would send");
    assert_eq!(p.steps[2].disposition, StepDisposition::Kept, "write_back has no compensation");
    assert!(matches!(
        plan_rerun(&paused, &def(), &cps, &["create_order".into()], &lookups),
        Err(RerunRefusal::Compensating(_))
    ));
}

/// create_order's key holds an operation another caller made (action "unrelated"),
/// SUCCEEDED; the instance paused on the conflict: a re-run redoes create_order under a new
/// key without being told to, and shows no input for the steps built from its result.
#[test]
fn a_step_whose_key_holds_another_operation_is_redone_and_later_inputs_wait_for_it() {
    let mut paused = instance();
    paused.state = InstanceState::Paused;
    let mut foreign = op("create_order", State::Succeeded);
    foreign.action = "unrelated".into();
    let cps = checkpoints(vec![Some(foreign)]);
    let p = plan_rerun(&paused, &def(), &cps, &[], &lookups).unwrap();
    assert_eq!(p.steps[0].disposition, StepDisposition::Redone);
    assert_eq!(p.steps[0].key, "ORD-7:intake:create_order:rerun-1");
    assert_eq!(p.steps[0].input, Some(json!({"customer": "C-1"})));
    assert_eq!(p.steps[1].disposition, StepDisposition::Runs);
    assert_eq!(p.steps[1].input, None, "built from create_order's new result, when its turn comes");

    // FAILED at write_back: unnamed, write_back's input is known; with create_order named,
    // it is not (it will carry the new order's reference).
    let inst = failed_at_write_back();
    let cps = checkpoints(vec![
        Some(op("create_order", State::Succeeded)),
        Some(op("send_confirmation", State::Succeeded)),
        Some(op("write_back", State::Failed)),
    ]);
    let plain = plan_rerun(&inst, &def(), &cps, &[], &lookups).unwrap();
    assert_eq!(plain.steps[2].input, Some(json!({"order": "create_order-ref"})));
    let named = plan_rerun(&inst, &def(), &cps, &["create_order".into()], &lookups).unwrap();
    assert_eq!(named.steps[2].disposition, StepDisposition::Redone);
    assert_eq!(named.steps[2].input, None, "not the old order's reference");
}

/// A compensation key that holds another operation is redone under a new key.
#[test]
fn a_compensation_whose_key_holds_another_operation_is_redone() {
    let mut paused = instance();
    paused.state = InstanceState::Paused;
    let mut foreign = comp("send_confirmation", State::Succeeded);
    foreign.action = "unrelated".into();
    let cps = checkpoints_with(
        vec![
            Some(op("create_order", State::Succeeded)),
            Some(op("send_confirmation", State::Succeeded)),
            Some(op("write_back", State::Failed)),
        ],
        vec![None, Some(foreign)],
    );
    let p = plan_rerun(&paused, &def(), &cps, &[], &lookups).unwrap();
    assert_eq!(p.steps[1].disposition, StepDisposition::Compensated);
    assert_eq!(p.steps[1].key, "ORD-7:intake:send_confirmation:compensate-2");
}

#[test]
fn applying_checks_the_approved_hash_and_audits_the_reason() {
    let inst = failed_at_write_back();
    let cps = checkpoints(vec![
        Some(op("create_order", State::Succeeded)),
        Some(op("send_confirmation", State::Succeeded)),
        Some(op("write_back", State::Failed)),
    ]);
    let plan = plan_rerun(&inst, &def(), &cps, &[], &lookups).unwrap();
    let ops = Actor { principal: "ops-anna".into(), request_id: Some("r-1".into()) };
    let stale = plan_rerun_apply(&inst, &plan, Some("0".repeat(64).as_str()), "retry after the CRM fix", &ops, NOW);
    assert!(matches!(stale, Err(RerunRefusal::PlanChanged { .. })));
    let (rec, e) =
        plan_rerun_apply(&inst, &plan, Some(plan.hash.as_str()), "retry after the CRM fix", &ops, NOW).unwrap();
    assert_eq!((rec.state, rec.next_run_at, rec.version), (InstanceState::Running, Some(NOW), inst.version + 1));
    assert_eq!((e.kind.as_str(), e.principal.as_str()), ("rerun", "ops-anna"));
    let why = e.reason.unwrap();
    assert!(
        why.contains("retry after the CRM fix") && why.contains("write_back redone as ORD-7:intake:write_back:rerun-1"),
        "{why}"
    );
}

/// An item is redone as a step is: a plan that redoes a SUCCEEDED or UNKNOWN item (the
/// step named) runs only with its hash, naming the items; the audit event names each item
/// and its new key; an UNKNOWN item's old operation is closed (`superseded`), a FAILED
/// one's is left as it is.
#[test]
fn redoing_items_needs_the_hash_audits_each_item_and_supersedes_unknown_ones() {
    use crate::flow::items::tests::{S, cps, def, instance};
    let d = def("pause");
    let mut inst = instance(&d, &["r1", "r2", "r3"]);
    inst.state = InstanceState::Paused;
    let (f, u) = (Some(State::Failed), Some(State::Unknown));
    let checkpoints = cps(&d, S, &[("r1", S, None), ("r2", f, None), ("r3", u, None)]);
    let ops = Actor { principal: "ops-anna".into(), request_id: None };
    let named = ["send".to_owned()];
    let plan = plan_rerun(&inst, &d, &checkpoints, &named, &|_| false).unwrap();
    match plan_rerun_apply(&inst, &plan, None, "the mail relay is fixed", &ops, NOW) {
        Err(RerunRefusal::PlanHashRequired { steps, now }) => {
            assert_eq!(steps, ["send (item r1)", "send (item r3)"], "SUCCEEDED and UNKNOWN, not FAILED");
            assert_eq!(now, plan.hash);
        }
        other => panic!("{other:?}"),
    }
    let (_, e) = plan_rerun_apply(&inst, &plan, Some(&plan.hash), "the mail relay is fixed", &ops, NOW).unwrap();
    let why = e.reason.unwrap();
    assert!(why.contains("send item r2 redone as ORD-7:intake:send:r2:rerun-1"), "{why}");
    let closed = plan_superseded(&d, &plan, &checkpoints, "the mail relay is fixed", &ops, NOW);
    let keys: Vec<_> = closed.iter().map(|(r, _, _)| (r.key.as_str(), r.state, r.error_class.as_deref())).collect();
    assert_eq!(keys, [("ORD-7:intake:send:r3", State::Failed, Some("superseded"))]);
    let message = closed[0].0.error_message.clone().unwrap();
    assert!(message.contains("item \"r3\" of step \"send\" re-run as ORD-7:intake:send:r3:rerun-1"), "{message}");

    // A plain re-run with a lookup: r2 redone (no hash needed: it FAILED), r3 looked up.
    let plain = plan_rerun(&inst, &d, &checkpoints, &[], &|_| true).unwrap();
    assert!(plan_rerun_apply(&inst, &plain, None, "retry", &ops, NOW).is_ok(), "a failed item has no effect");
    assert!(plan_superseded(&d, &plain, &checkpoints, "retry", &ops, NOW).is_empty(), "r3 is looked up, not closed");
}
