//! Canned histories of a step for each item: `create_order`, then `send` once for each
//! recipient of the input (by `/id`, at most 2 at once), then `close` with their results.

use super::*;
use crate::State;
use crate::flow::canned::{ID, NOW, made_by_idem, op_at};
use crate::flow::plan::{plan_advance, plan_instance_update};
use crate::flow::record::{ItemCheckpoint, StepRow, step_key};
use crate::flow::{InstanceState, plan_start};
use crate::record::{Actor, OperationRecord};
use serde_json::json;

fn def(on_failure: &str) -> Definition {
    serde_json::from_value(json!({
        "name": "each",
        "steps": [
            {"name": "create_order", "action": "create_order", "connector": "c", "policy": "redo_safe",
             "compensation": {"action": "cancel_order", "connector": "c"}},
            {"name": "send", "action": "send", "connector": "c", "policy": "redo_safe",
             "for_each": {"items": "/input/recipients", "id": "/id", "max_concurrency": 2, "on_failure": on_failure},
             "input": {"to": {"from": "/item/address"}, "order": {"from": "/steps/create_order/result/id"}},
             "compensation": {"action": "unsend", "connector": "c", "input": {"to": {"from": "/item/address"}}}},
            {"name": "close", "action": "close", "connector": "c", "policy": "redo_safe",
             "input": {"sent": {"from": "/steps/send/result"}}}
        ]
    }))
    .unwrap()
}

fn recipients(ids: &[&str]) -> serde_json::Value {
    json!(ids.iter().map(|id| json!({"id": id, "address": format!("{id}@example.org")})).collect::<Vec<_>>())
}

fn instance(d: &Definition, ids: &[&str]) -> InstanceRecord {
    let mut start = crate::flow::canned::start();
    start.workflow = d.name.clone();
    start.definition_version = d.version();
    start.input = json!({"recipients": recipients(ids)});
    plan_start(None, None, &start, NOW - 10_000).record
}

fn op(key: &str, action: &str, state: State) -> OperationRecord {
    let mut r = op_at(key, state);
    r.action = action.into();
    r.connector = Some("c".into());
    if state == State::Executing {
        r.lease_expires_at = Some(NOW + 5_000);
    }
    made_by_idem(r)
}

/// Checkpoints: create_order in `first`, the items of `send` with their states (and
/// compensations), close not started.
fn cps(d: &Definition, first: Option<State>, items: &[(&str, Option<State>, Option<State>)]) -> Vec<Checkpoint> {
    let rows = StepRow::all_of("t", ID, d);
    let first = Checkpoint::of(rows[0].clone(), first.map(|s| op(&step_key(ID, "create_order"), "create_order", s)));
    let items = items
        .iter()
        .enumerate()
        .map(|(i, (id, state, comp))| {
            let op_key = item_key(ID, "send", id);
            let row = ItemRow {
                tenant: "t".into(),
                instance_id: ID.into(),
                position: 1,
                step: "send".into(),
                item: (*id).into(),
                seq: i as i64 + 1,
                comp_key: compensation_key(&op_key),
                op_key: op_key.clone(),
                policy: d.steps[1].policy,
            };
            let c = comp.map(|s| op(&compensation_key(&op_key), "unsend", s));
            ItemCheckpoint::of(row, state.map(|s| op(&op_key, "send", s)), c)
        })
        .collect();
    vec![first, Checkpoint::with_items(rows[1].clone(), items), Checkpoint::of(rows[2].clone(), None)]
}

const S: Option<State> = Some(State::Succeeded);

#[test]
fn items_are_planned_by_identity_not_position() {
    let d = def("pause");
    let inst = instance(&d, &["r1", "r2", "r3"]);
    let n = plan_advance(&inst, &d, &cps(&d, S, &[]), NOW).unwrap();
    let Next::PlanItems { index: 1, items } = n else { panic!("{n:?}") };
    let keys: Vec<_> = items.iter().map(|r| r.op_key.as_str()).collect();
    assert_eq!(keys, ["ORD-7:intake:send:r1", "ORD-7:intake:send:r2", "ORD-7:intake:send:r3"]);
    // The same list reordered keys the same items.
    let reordered = plan_items(&instance(&d, &["r3", "r1", "r2"]), &d, &cps(&d, S, &[]), 1).unwrap();
    let mut a: Vec<_> = reordered.iter().map(|r| r.op_key.clone()).collect();
    a.sort();
    assert_eq!(a, keys);
    // A repeated item is one item; an identity that cannot end a key fails the step.
    assert_eq!(plan_items(&instance(&d, &["r1", "r1"]), &d, &cps(&d, S, &[]), 1).unwrap().len(), 1);
    for bad in ["a:b", "compensate", ""] {
        let e = plan_items(&instance(&d, &[bad]), &d, &cps(&d, S, &[]), 1).unwrap_err();
        assert!(e.contains("identity"), "{e}");
    }
    let mut inst = instance(&d, &["r1"]);
    inst.input = json!({"recipients": [{"id": "r1", "address": "x"}, {"id": "r1", "address": "y"}]});
    let e = plan_items(&inst, &d, &cps(&d, S, &[]), 1).unwrap_err();
    assert!(e.contains("different contents"), "{e}");
    inst.input = json!({"recipients": {"id": "r1"}});
    let n = plan_advance(&inst, &d, &cps(&d, S, &[]), NOW).unwrap();
    assert!(matches!(n, Next::Finish { state: InstanceState::Failed, class: Some("step_input"), .. }), "{n:?}");
    // An empty list: nothing to do; the next step runs.
    let empty = instance(&d, &[]);
    assert!(matches!(plan_advance(&empty, &d, &cps(&d, S, &[]), NOW).unwrap(), Next::Run { index: 2, .. }));
}

#[test]
fn items_run_at_most_max_concurrency_at_once_then_the_next_step() {
    let d = def("pause");
    let inst = instance(&d, &["r1", "r2", "r3"]);
    let n = plan_advance(&inst, &d, &cps(&d, S, &[("r1", None, None), ("r2", None, None), ("r3", None, None)]), NOW)
        .unwrap();
    let Next::Parallel { runs } = &n else { panic!("{n:?}") };
    assert_eq!(runs.len(), 2, "max_concurrency 2");
    let Next::Item { item, next } = &runs[0] else { panic!("{runs:?}") };
    assert_eq!(item, "r1");
    assert_eq!(**next, Next::Run { index: 1, payload: json!({"to": "r1@example.org", "order": 42}) });
    let e = Some(State::Executing);
    let n = plan_advance(&inst, &d, &cps(&d, S, &[("r1", S, None), ("r2", e, None), ("r3", None, None)]), NOW).unwrap();
    assert!(matches!(&n, Next::Item { item, .. } if item == "r3"), "one in flight: r3 starts; r1 is not redone: {n:?}");
    let n = plan_advance(&inst, &d, &cps(&d, S, &[("r1", S, None), ("r2", S, None), ("r3", S, None)]), NOW).unwrap();
    let Next::Run { index: 2, payload } = n else { panic!("{n:?}") };
    assert_eq!(payload["sent"], json!({"r1": {"id": 42}, "r2": {"id": 42}, "r3": {"id": 42}}));
    assert_eq!(
        plan_instance_update(&inst, &d, &Next::PlanItems { index: 1, items: vec![] }, &Actor::system(), NOW),
        None
    );
}

#[test]
fn a_failed_item_compensates_exactly_the_completed_items_each_once() {
    let d = def("compensate");
    let inst = instance(&d, &["r1", "r2", "r3"]);
    let f = Some(State::Failed);
    let items = [("r1", S, None), ("r2", f, None), ("r3", S, None)];
    let begin = plan_advance(&inst, &d, &cps(&d, S, &items), NOW).unwrap();
    assert!(matches!(begin, Next::BeginCompensation { index: 1, .. }), "{begin:?}");
    let (comp, _) = plan_instance_update(&inst, &d, &begin, &Actor::system(), NOW).unwrap();
    let n = plan_advance(&comp, &d, &cps(&d, S, &items), NOW).unwrap();
    let Next::Item { item, next } = &n else { panic!("{n:?}") };
    assert_eq!(
        (item.as_str(), &**next),
        ("r3", &Next::Compensate { index: 1, payload: json!({"to": "r3@example.org"}) })
    );
    let items = [("r1", S, None), ("r2", f, None), ("r3", S, S)];
    assert!(
        matches!(plan_advance(&comp, &d, &cps(&d, S, &items), NOW).unwrap(), Next::Item { item, .. } if item == "r1")
    );
    let items = [("r1", S, S), ("r2", f, None), ("r3", S, S)];
    let n = plan_advance(&comp, &d, &cps(&d, S, &items), NOW).unwrap();
    assert!(matches!(n, Next::Compensate { index: 0, .. }), "then the step before: {n:?}");
    let n = plan_advance(
        &comp,
        &d,
        &cps(&d, S, &items)
            .into_iter()
            .enumerate()
            .map(|(i, c)| {
                if i == 0 {
                    Checkpoint::with_compensation(
                        c.row,
                        c.operation,
                        Some(op("ORD-7:intake:create_order:compensate", "cancel_order", State::Succeeded)),
                    )
                } else {
                    c
                }
            })
            .collect::<Vec<_>>(),
        NOW,
    )
    .unwrap();
    assert!(matches!(n, Next::Finish { state: InstanceState::Compensated, .. }), "{n:?}");
    // Under pause: the instance pauses naming the item.
    let d = def("pause");
    let n = plan_advance(&inst, &d, &cps(&d, S, &[("r1", S, None), ("r2", f, None)]), NOW).unwrap();
    let Next::Pause { index: 1, class: "branch_failed", reason } = n else { panic!("{n:?}") };
    assert!(reason.contains("item \"r2\" of step \"send\""), "{reason}");
}

#[test]
fn a_bad_for_each_is_refused_naming_its_field() {
    let caps = |_: &str| Some(crate::flow::definition::ConnectorCaps { has_lookup: false });
    let check = |edit: &dyn Fn(&mut Definition), field: &str| {
        let mut d = def("pause");
        edit(&mut d);
        let e = d.validate("workflows.w", &caps).unwrap_err();
        assert_eq!(e.field, field, "{e}");
    };
    check(&|d| d.steps[1].for_each.as_mut().unwrap().items = "/nowhere".into(), "workflows.w.steps[1].for_each.items");
    check(
        &|d| d.steps[1].for_each.as_mut().unwrap().items = "/steps/close/result".into(),
        "workflows.w.steps[1].for_each.items",
    );
    check(&|d| d.steps[1].for_each.as_mut().unwrap().id = "id".into(), "workflows.w.steps[1].for_each.id");
    check(
        &|d| d.steps[1].for_each.as_mut().unwrap().max_concurrency = Some(0),
        "workflows.w.steps[1].for_each.max_concurrency",
    );
    check(&|d| d.steps[2].input = json!({"x": {"from": "/item/id"}}), "workflows.w.steps[2].input/x");
    check(&|d| d.steps[1].group = Some("g".into()), "workflows.w.steps[1].for_each.items");
    def("pause").validate("workflows.w", &caps).unwrap();
}

/// A re-run keeps a step for each item whose items all SUCCEEDED and redoes the failed
/// step after it; one with a failed item is refused (items are not re-run).
#[test]
fn a_rerun_keeps_finished_items_and_refuses_failed_ones() {
    use crate::flow::rerun::{RerunRefusal, StepDisposition, plan_rerun};
    let d = def("pause");
    let mut inst = instance(&d, &["r1", "r2"]);
    inst.state = InstanceState::Failed;
    let mut checkpoints = cps(&d, S, &[("r1", S, None), ("r2", S, None)]);
    checkpoints[2] =
        Checkpoint::of(checkpoints[2].row.clone(), Some(op(&step_key(ID, "close"), "close", State::Failed)));
    let plan = plan_rerun(&inst, &d, &checkpoints, &[], &|_| false).unwrap();
    let dispositions: Vec<_> = plan.steps.iter().map(|p| p.disposition).collect();
    assert_eq!(dispositions, [StepDisposition::Kept, StepDisposition::Kept, StepDisposition::Redone]);
    let failed = cps(&d, S, &[("r1", S, None), ("r2", Some(State::Failed), None)]);
    let refused = plan_rerun(&inst, &d, &failed, &[], &|_| false).unwrap_err();
    assert_eq!(refused, RerunRefusal::ItemsNotRerunnable("send".into()));
}

/// An UNKNOWN item (policy `redo_safe` here, in the review queue) is settled by a person
/// before the compensation undoes anything; once resolved SUCCEEDED it is compensated too. A lapsed
/// lease is waited for (the sweeper records the expiry). Before this, it was skipped.
#[test]
fn compensation_waits_for_unknown_items_to_settle() {
    let d = def("compensate");
    let inst = instance(&d, &["r1", "r2", "r3"]);
    let (f, u) = (Some(State::Failed), Some(State::Unknown));
    let items = [("r1", S, None), ("r2", f, None), ("r3", u, None)];
    let begin = plan_advance(&inst, &d, &cps(&d, S, &items), NOW).unwrap();
    assert!(matches!(begin, Next::BeginCompensation { index: 1, .. }), "{begin:?}");
    let (comp, _) = plan_instance_update(&inst, &d, &begin, &Actor::system(), NOW).unwrap();
    let mut review = cps(&d, S, &items);
    review[1].items[2].operation.as_mut().unwrap().needs_review = true;
    let n = plan_advance(&comp, &d, &review, NOW).unwrap();
    let Next::Pause { index: 1, class: "compensation_unknown", reason } = &n else { panic!("{n:?}") };
    assert!(reason.contains("item \"r3\" of step \"send\""), "{reason}");
    let items = [("r1", S, None), ("r2", f, None), ("r3", S, None)];
    let n = plan_advance(&comp, &d, &cps(&d, S, &items), NOW).unwrap();
    assert!(matches!(&n, Next::Item { item, .. } if item == "r3"), "{n:?}");
    let items = [("r1", S, None), ("r2", f, None), ("r3", Some(State::Executing), None)];
    let mut lapsed = cps(&d, S, &items);
    lapsed[1].items[2].operation.as_mut().unwrap().lease_expires_at = Some(NOW - 1);
    let n = plan_advance(&comp, &d, &lapsed, NOW).unwrap();
    assert_eq!(n, Next::Wait { index: 1, until_ms: NOW + crate::flow::plan::EXPIRY_POLL_MS });
}
