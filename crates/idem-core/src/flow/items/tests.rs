//! Canned histories of a step for each item: `create_order`, then `send` once for each
//! recipient of the input (by `/id`, at most 2 at once), then `close` with their results.

use super::*;
use crate::State;
use crate::flow::canned::{ID, NOW, made_by_idem, op_at};
use crate::flow::plan::{plan_advance, plan_instance_update};
use crate::flow::record::{ItemCheckpoint, StepRow, step_key};
use crate::flow::{InstanceState, StepState, plan_start};
use crate::record::{Actor, OperationRecord};
use serde_json::json;

pub(crate) fn def(on_failure: &str) -> Definition {
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

pub(crate) fn recipients(ids: &[&str]) -> serde_json::Value {
    json!(ids.iter().map(|id| json!({"id": id, "address": format!("{id}@example.org")})).collect::<Vec<_>>())
}

pub(crate) fn instance(d: &Definition, ids: &[&str]) -> InstanceRecord {
    let mut start = crate::flow::canned::start();
    start.workflow = d.name.clone();
    start.definition_version = d.version();
    start.input = json!({"recipients": recipients(ids)});
    plan_start(None, None, &start, NOW - 10_000).record
}

pub(crate) fn op(key: &str, action: &str, state: State) -> OperationRecord {
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
pub(crate) fn cps(
    d: &Definition,
    first: Option<State>,
    items: &[(&str, Option<State>, Option<State>)],
) -> Vec<Checkpoint> {
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

pub(crate) const S: Option<State> = Some(State::Succeeded);

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
    assert!(e.contains("items 1 and 2 have the identity \"r1\" with different contents"), "{e}");
    inst.input = json!({"recipients": [{"id": "r1", "address": "x"}, {"id": "r2", "address": "y"}, {"id": "r1", "address": "z"}]});
    let e = plan_items(&inst, &d, &cps(&d, S, &[]), 1).unwrap_err();
    assert!(e.starts_with("items 1 and 3 have the identity \"r1\""), "both positions: {e}");
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

/// A re-run plans each item as a step (`rerun::items`'s table): with the items all
/// SUCCEEDED the step is kept and the failed step after it redone; paused on a FAILED item
/// (r2; r1 and r3 SUCCEEDED), a plain re-run redoes only r2, under `…:send:r2:rerun-1`,
/// each item its own line with its input, and the step after it runs; a second re-run of
/// it gets `:rerun-2`.
#[test]
fn a_plain_rerun_redoes_only_the_failed_items() {
    use crate::flow::rerun::{StepDisposition::*, plan_rerun};
    let d = def("pause");
    let mut inst = instance(&d, &["r1", "r2"]);
    inst.state = InstanceState::Failed;
    let mut checkpoints = cps(&d, S, &[("r1", S, None), ("r2", S, None)]);
    checkpoints[2] =
        Checkpoint::of(checkpoints[2].row.clone(), Some(op(&step_key(ID, "close"), "close", State::Failed)));
    let plan = plan_rerun(&inst, &d, &checkpoints, &[], &|_| false).unwrap();
    let dispositions: Vec<_> = plan.steps.iter().map(|p| p.disposition).collect();
    assert_eq!(dispositions, [Kept, Kept, Redone]);
    assert!(plan.steps[1].items.iter().all(|i| i.disposition == Kept), "{:?}", plan.steps[1]);

    let mut inst = instance(&d, &["r1", "r2", "r3"]);
    inst.state = InstanceState::Paused;
    let f = Some(State::Failed);
    let checkpoints = cps(&d, S, &[("r1", S, None), ("r2", f, None), ("r3", S, None)]);
    let plan = plan_rerun(&inst, &d, &checkpoints, &[], &|_| false).unwrap();
    let send = &plan.steps[1];
    let lines: Vec<_> = send.items.iter().map(|i| (i.item.as_str(), i.disposition, i.key.as_str())).collect();
    assert_eq!(
        lines,
        [
            ("r1", Kept, "ORD-7:intake:send:r1"),
            ("r2", Redone, "ORD-7:intake:send:r2:rerun-1"),
            ("r3", Kept, "ORD-7:intake:send:r3")
        ]
    );
    assert_eq!(send.items[1].comp_key, "ORD-7:intake:send:r2:rerun-1:compensate");
    assert_eq!(send.items[1].input, Some(json!({"to": "r2@example.org", "order": 42})), "what it would send");
    assert_eq!((send.items[1].state, send.items[1].action.as_str()), (StepState::Failed, "send"));
    assert_eq!(send.items[0].input, None, "a kept item sends nothing");
    assert_eq!((send.disposition, send.key.as_str()), (Redone, "ORD-7:intake:send"), "the step's line sums up");
    assert_eq!((plan.steps[2].disposition, &plan.steps[2].input), (Runs, &None), "built from the new result");

    // The re-run item failed again: the next re-run gets `:rerun-2`.
    let mut again = checkpoints.clone();
    let r2 = &mut again[1].items[1];
    r2.row.op_key = "ORD-7:intake:send:r2:rerun-1".into();
    r2.row.comp_key = compensation_key(&r2.row.op_key);
    r2.operation = Some(op(&r2.row.op_key, "send", State::Failed));
    let second = plan_rerun(&inst, &d, &again, &[], &|_| false).unwrap();
    assert_eq!(second.steps[1].items[1].key, "ORD-7:intake:send:r2:rerun-2");
    assert_ne!(second.hash, plan.hash);
}

/// The plan hash covers the items: an item's state, and which items are named.
#[test]
fn the_plan_hash_covers_each_item() {
    use crate::flow::rerun::plan_rerun;
    let d = def("pause");
    let mut inst = instance(&d, &["r1", "r2", "r3"]);
    inst.state = InstanceState::Paused;
    let f = Some(State::Failed);
    let base =
        plan_rerun(&inst, &d, &cps(&d, S, &[("r1", S, None), ("r2", f, None), ("r3", S, None)]), &[], &|_| false)
            .unwrap();
    let same =
        plan_rerun(&inst, &d, &cps(&d, S, &[("r1", S, None), ("r2", f, None), ("r3", S, None)]), &[], &|_| false)
            .unwrap();
    assert_eq!(base.hash, same.hash);
    let e = Some(State::Executing);
    let moved =
        plan_rerun(&inst, &d, &cps(&d, S, &[("r1", S, None), ("r2", f, None), ("r3", e, None)]), &[], &|_| false)
            .unwrap();
    assert_eq!(moved.steps[1].items[2].disposition, crate::flow::StepDisposition::Kept, "on its way: kept");
    assert_ne!(moved.hash, base.hash, "r3's state changed: another plan");
}

/// Naming the step redoes every item, under new keys (an item on its way refuses it); an
/// UNKNOWN item is looked up when its connector can, else a person resolves it first (or
/// the step is named); an item re-run 999 times is refused.
#[test]
fn naming_the_step_redoes_every_item_and_unknown_items_follow_the_step_rules() {
    use crate::flow::rerun::{RerunRefusal, StepDisposition::*, plan_rerun};
    let d = def("pause");
    let mut inst = instance(&d, &["r1", "r2", "r3"]);
    inst.state = InstanceState::Paused;
    let (f, u) = (Some(State::Failed), Some(State::Unknown));
    let named = ["send".to_owned()];
    let checkpoints = cps(&d, S, &[("r1", S, None), ("r2", f, None), ("r3", S, None)]);
    let plan = plan_rerun(&inst, &d, &checkpoints, &named, &|_| false).unwrap();
    let keys: Vec<_> = plan.steps[1].items.iter().map(|i| (i.disposition, i.key.as_str())).collect();
    assert_eq!(
        keys,
        [
            (Redone, "ORD-7:intake:send:r1:rerun-1"),
            (Redone, "ORD-7:intake:send:r2:rerun-1"),
            (Redone, "ORD-7:intake:send:r3:rerun-1")
        ]
    );
    assert_eq!(plan.steps[0].disposition, Kept);
    let busy = cps(&d, S, &[("r1", S, None), ("r2", Some(State::Executing), None)]);
    assert_eq!(
        plan_rerun(&inst, &d, &busy, &named, &|_| false),
        Err(RerunRefusal::StepBusy { step: "send (item r2)".into(), state: StepState::Executing })
    );

    let unknown = cps(&d, S, &[("r1", S, None), ("r2", u, None)]);
    assert_eq!(
        plan_rerun(&inst, &d, &unknown, &[], &|_| false),
        Err(RerunRefusal::NeedsResolution("send (item r2)".into())),
        "no lookup: a person resolves it, or names the step"
    );
    let looked = plan_rerun(&inst, &d, &unknown, &[], &|c| c == "c").unwrap();
    let lines: Vec<_> = looked.steps[1].items.iter().map(|i| (i.disposition, i.key.as_str())).collect();
    assert_eq!(lines, [(Kept, "ORD-7:intake:send:r1"), (LookedUp, "ORD-7:intake:send:r2")]);
    assert_eq!(looked.steps[1].disposition, LookedUp);
    let redone = plan_rerun(&inst, &d, &unknown, &named, &|_| false).unwrap();
    assert_eq!(redone.steps[1].items[1].key, "ORD-7:intake:send:r2:rerun-1");

    let mut worn = cps(&d, S, &[("r1", S, None), ("r2", f, None)]);
    let r2 = &mut worn[1].items[1];
    r2.row.op_key = format!("ORD-7:intake:send:r2:rerun-{}", crate::flow::record::MAX_RERUNS);
    r2.operation = Some(op(&r2.row.op_key, "send", State::Failed));
    assert_eq!(
        plan_rerun(&inst, &d, &worn, &[], &|_| false),
        Err(RerunRefusal::TooManyReruns("send (item r2)".into()))
    );
}

/// Paused during compensation with an item's compensation FAILED (r1's): a re-run redoes
/// it under `{item key}:compensate-2`, runs the compensations not begun (r3's, then
/// create_order's) and keeps the failed item (nothing to undo).
#[test]
fn a_compensation_rerun_redoes_failed_item_compensations() {
    use crate::flow::rerun::{StepDisposition::*, plan_rerun};
    let d = def("compensate");
    let mut inst = instance(&d, &["r1", "r2", "r3"]);
    inst.state = InstanceState::Paused;
    let f = Some(State::Failed);
    let checkpoints = cps(&d, S, &[("r1", S, f), ("r2", f, None), ("r3", S, None)]);
    let plan = plan_rerun(&inst, &d, &checkpoints, &[], &|_| false).unwrap();
    assert_eq!(plan.resumes_as, InstanceState::Compensating);
    let lines: Vec<_> = plan.steps[1].items.iter().map(|i| (i.disposition, i.key.as_str())).collect();
    assert_eq!(
        lines,
        [
            (Compensated, "ORD-7:intake:send:r1:compensate-2"),
            (Kept, "ORD-7:intake:send:r2:compensate"),
            (CompensationRuns, "ORD-7:intake:send:r3:compensate")
        ]
    );
    assert_eq!(plan.steps[1].items[0].action, "unsend");
    assert_eq!(plan.steps[1].items[0].input, Some(json!({"to": "r1@example.org"})));
    assert_eq!(plan.steps[1].disposition, Compensated);
    assert_eq!(plan.steps[0].disposition, CompensationRuns);
}

/// A step for each item whose list was empty: NOT_STARTED until the instance moves past
/// it, then SUCCEEDED (no operation invented); a re-run of the step after it keeps it.
#[test]
fn an_empty_list_is_succeeded_once_the_instance_moved_past_it() {
    use crate::flow::rerun::{StepDisposition::*, plan_rerun};
    let d = def("pause");
    let mut inst = instance(&d, &[]);
    let mut waiting = cps(&d, S, &[]);
    settle_empty_lists(&inst, &d, &mut waiting);
    assert_eq!(waiting[1].state, StepState::NotStarted, "not passed yet");
    let mut failed = cps(&d, S, &[]);
    failed[2] = Checkpoint::of(failed[2].row.clone(), Some(op(&step_key(ID, "close"), "close", State::Failed)));
    inst.state = InstanceState::Failed;
    let plan = plan_rerun(&inst, &d, &failed, &[], &|_| false).unwrap();
    let dispositions: Vec<_> = plan.steps.iter().map(|p| p.disposition).collect();
    assert_eq!(dispositions, [Kept, Kept, Redone]);
    assert_eq!(plan.steps[2].input, Some(json!({"sent": {}})), "the empty list's result is {{}}");
    settle_empty_lists(&inst, &d, &mut failed);
    assert_eq!((failed[1].state, failed[1].operation.is_none()), (StepState::Succeeded, true));
    let mut done = cps(&d, S, &[]);
    inst.state = InstanceState::Succeeded;
    settle_empty_lists(&inst, &d, &mut done);
    assert_eq!(done[1].state, StepState::Succeeded);
    // A list that is not empty (now) is not settled: its items were never planned.
    let mut full = cps(&d, S, &[]);
    settle_empty_lists(&instance(&d, &["r1"]), &d, &mut full);
    assert_eq!(full[1].state, StepState::NotStarted);
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

/// A list of exactly MAX_ITEMS items is planned; one more fails the step (step_input) with
/// a message that says how to split it, before any item is written.
#[test]
fn a_list_longer_than_max_items_fails_the_step() {
    let d = def("pause");
    let ids: Vec<String> = (0..=MAX_ITEMS).map(|i| format!("r{i}")).collect();
    let refs: Vec<&str> = ids.iter().map(String::as_str).collect();
    let at_most = instance(&d, &refs[..MAX_ITEMS]);
    assert_eq!(plan_items(&at_most, &d, &cps(&d, S, &[]), 1).unwrap().len(), MAX_ITEMS);
    let too_many = instance(&d, &refs);
    let n = plan_advance(&too_many, &d, &cps(&d, S, &[]), NOW).unwrap();
    let Next::Finish { state: InstanceState::Failed, class: Some("step_input"), reason, .. } = &n else {
        panic!("{n:?}")
    };
    assert!(reason.contains("1001 items") && reason.contains("split the list"), "{reason}");
}

/// An item's compensation that failed pauses the instance naming the item and its key.
#[test]
fn a_failed_item_compensation_pauses_naming_the_item() {
    let d = def("compensate");
    let inst = instance(&d, &["r1", "r2"]);
    let items = [("r1", S, Some(State::Failed)), ("r2", Some(State::Failed), None)];
    let begin = plan_advance(&inst, &d, &cps(&d, S, &items), NOW).unwrap();
    let (comp, _) = plan_instance_update(&inst, &d, &begin, &Actor::system(), NOW).unwrap();
    let n = plan_advance(&comp, &d, &cps(&d, S, &items), NOW).unwrap();
    let Next::Pause { index: 1, class: "compensation_failed", reason } = &n else { panic!("{n:?}") };
    assert!(reason.starts_with("item \"r1\": ") && reason.contains("ORD-7:intake:send:r1:compensate"), "{reason}");
}

/// A PENDING item (a retry waiting for its turn) is closed before the compensation undoes
/// anything, so nothing performs it while the instance compensates.
#[test]
fn a_pending_item_is_abandoned_while_compensating() {
    let d = def("compensate");
    let inst = instance(&d, &["r1", "r2", "r3"]);
    let f = Some(State::Failed);
    let items = [("r1", S, None), ("r2", f, None), ("r3", Some(State::Pending), None)];
    let begin = plan_advance(&inst, &d, &cps(&d, S, &items), NOW).unwrap();
    let (comp, _) = plan_instance_update(&inst, &d, &begin, &Actor::system(), NOW).unwrap();
    let n = plan_advance(&comp, &d, &cps(&d, S, &items), NOW).unwrap();
    assert_eq!(n, Next::Item { item: "r3".into(), next: Box::new(Next::Abandon { index: 1 }) });
}
