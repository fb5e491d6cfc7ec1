//! The workflow cases of the conformance suite ([`crate::flow::WorkflowStore`]).

use super::{Harness, actor, complete, success};
use crate::flow::{InstanceFilter, InstanceUpdate, StartRequest};
use idem_core::flow::{
    Definition, InstanceState, Next, StartDecision, StartInput, StepState, plan_instance_update, step_key,
};
use idem_core::{AcquireInput, Actor};
use serde_json::{Value, json};

fn definition() -> Definition {
    serde_json::from_value(json!({
        "name": "order-intake",
        "steps": [
            {"name": "create_order", "action": "create_order", "policy": "manual"},
            {"name": "send_confirmation", "action": "send_confirmation", "policy": "redo_safe"},
            {"name": "write_back", "action": "write_back", "policy": "manual"}
        ]
    }))
    .unwrap()
}

fn start(h: &Harness, id: &str, input: Value) -> StartRequest {
    let definition = definition();
    StartRequest {
        input: StartInput {
            tenant: h.tenant.clone(),
            instance_id: id.into(),
            workflow: definition.name.clone(),
            definition_version: definition.version(),
            definition_given: true,
            source_event: Some("evt_1".into()),
            input_fingerprint: idem_core::fingerprint(&input, None).unwrap().0,
            input,
            trace_id: Some("trace-1".into()),
            actor: actor("starter"),
            hold_ms: 0,
        },
        definition,
    }
}

fn step_input(h: &Harness, id: &str, step: &str) -> AcquireInput {
    AcquireInput {
        tenant: h.tenant.clone(),
        key: step_key(id, step),
        action: step.into(),
        payload: json!({"step": step}),
        fingerprint: format!("fp-{step}"),
        lease_ms: 1_000,
        redo_safe: false,
        connector: None,
        holder: None,
        actor: actor("worker-a"),
    }
}

pub(super) async fn starts_are_idempotent_and_pin_their_definition(h: Harness) {
    let flows = h.store.flows();
    let first = flows.start_instance(start(&h, "ORD-7:intake", json!({"customer": "C-1"}))).await.unwrap();
    assert_eq!(first.decision, StartDecision::Created);
    assert_eq!(first.instance.state, InstanceState::Running);
    let again = flows.start_instance(start(&h, "ORD-7:intake", json!({"customer": "C-1"}))).await.unwrap();
    assert_eq!(again.decision, StartDecision::Existing);
    assert_eq!(again.instance, first.instance, "a repeated start is the same instance");
    let other = flows.start_instance(start(&h, "ORD-7:intake", json!({"customer": "C-2"}))).await.unwrap();
    assert_eq!(other.decision, StartDecision::Mismatch);
    let stored = flows.instance(&h.tenant, "ORD-7:intake").await.unwrap().unwrap();
    assert_eq!(stored, first.instance, "a mismatch changes nothing");
    assert_eq!(stored.input, json!({"customer": "C-1"}));
    let events: Vec<_> = flows.instance_events(&h.tenant, "ORD-7:intake").await.unwrap();
    let kinds: Vec<_> = events.iter().map(|e| e.kind.as_str()).collect();
    assert_eq!(kinds, ["started", "start_replayed", "start_mismatch"]);
    let pinned = flows.definition(&h.tenant, "order-intake", &stored.definition_version).await.unwrap();
    assert_eq!(pinned, Some(definition()), "the pinned version is kept");
    let cps = flows.checkpoints(&h.tenant, "ORD-7:intake").await.unwrap();
    let names: Vec<_> = cps.iter().map(|c| (c.row.step.as_str(), c.state)).collect();
    assert_eq!(
        names,
        [
            ("create_order", StepState::NotStarted),
            ("send_confirmation", StepState::NotStarted),
            ("write_back", StepState::NotStarted)
        ]
    );
}

pub(super) async fn concurrent_starts_create_one_instance(h: Harness) {
    let mut tasks = Vec::new();
    for _ in 0..10 {
        let store = h.store.clone();
        let req = start(&h, "ORD-8:intake", json!({"n": 1}));
        tasks.push(tokio::spawn(async move { store.flows().start_instance(req).await.unwrap().decision }));
    }
    let mut created = 0;
    for t in tasks {
        if t.await.unwrap() == StartDecision::Created {
            created += 1;
        }
    }
    assert_eq!(created, 1, "ten concurrent starts of one instance create it once");
    assert_eq!(h.store.flows().checkpoints(&h.tenant, "ORD-8:intake").await.unwrap().len(), 3);
}

pub(super) async fn checkpoints_are_the_step_operations(h: Harness) {
    let flows = h.store.flows();
    flows.start_instance(start(&h, "ORD-9", json!({}))).await.unwrap();
    let granted = h.store.acquire(step_input(&h, "ORD-9", "create_order")).await.unwrap().record;
    let cps = flows.checkpoints(&h.tenant, "ORD-9").await.unwrap();
    assert_eq!(cps[0].state, StepState::Executing);
    assert_eq!(cps[0].operation.as_ref().unwrap().fencing_token, granted.fencing_token);
    h.store.complete(complete(&h, "ORD-9:create_order", granted.fencing_token, success("ord-9"))).await.unwrap();
    let cps = flows.checkpoints(&h.tenant, "ORD-9").await.unwrap();
    assert_eq!((cps[0].state, cps[1].state), (StepState::Succeeded, StepState::NotStarted));
    let op = cps[0].operation.as_ref().unwrap();
    assert_eq!(op.provider_ref.as_deref(), Some("ord-9"));
    assert_eq!(op.result, Some(json!({"message_id": "ord-9"})));
    let step = flows.step_of_operation(&h.tenant, "ORD-9:send_confirmation").await.unwrap().unwrap();
    assert_eq!((step.step.as_str(), step.position), ("send_confirmation", 1));
    assert_eq!(step.policy, idem_core::flow::RecoveryPolicy::RedoSafe);
    assert!(flows.step_of_operation(&h.tenant, "ORD-9").await.unwrap().is_none());
    let other_tenant = format!("{}-b", h.tenant);
    assert!(flows.step_of_operation(&other_tenant, "ORD-9:send_confirmation").await.unwrap().is_none());
    assert!(flows.instance(&other_tenant, "ORD-9").await.unwrap().is_none(), "tenants are isolated");
    assert!(flows.checkpoints(&other_tenant, "ORD-9").await.unwrap().is_empty());
}

pub(super) async fn instance_writes_are_conditional(h: Harness) {
    let flows = h.store.flows();
    let inst = flows.start_instance(start(&h, "ORD-10", json!({}))).await.unwrap().instance;
    let now = 1_000_000;
    let next = Next::Wait { index: 0, until_ms: now + 50 };
    let (rec, events) = plan_instance_update(&inst, &definition(), &next, &Actor::system(), now).unwrap();
    let update = InstanceUpdate { record: rec.clone(), read_version: inst.version, events };
    assert!(flows.update_instance(update.clone()).await.unwrap());
    assert!(!flows.update_instance(update).await.unwrap(), "a stale version writes nothing");
    assert_eq!(flows.instance(&h.tenant, "ORD-10").await.unwrap().unwrap(), rec);
}

pub(super) async fn due_instances_are_claimed_by_one_runner_at_a_time(h: Harness) {
    let flows = h.store.flows();
    flows.start_instance(start(&h, "ORD-11", json!({}))).await.unwrap();
    let claimed = flows.claim_due_instances(100, 10_000).await.unwrap();
    let mine: Vec<_> = claimed.iter().filter(|i| i.tenant == h.tenant).collect();
    assert_eq!(mine.len(), 1);
    assert_eq!(mine[0].next_run_at, Some(1_000_000 + 10_000));
    let again = flows.claim_due_instances(100, 10_000).await.unwrap();
    assert!(again.iter().all(|i| i.tenant != h.tenant), "held by the first claim");
    h.clock.advance(10_000);
    let after = flows.claim_due_instances(100, 10_000).await.unwrap();
    assert_eq!(after.iter().filter(|i| i.tenant == h.tenant).count(), 1, "a runner that died lets the hold run out");
}

pub(super) async fn finished_instances_keep_their_steps_then_leave_tombstones(h: Harness) {
    let flows = h.store.flows();
    let inst = flows.start_instance(start(&h, "ORD-12", json!({}))).await.unwrap().instance;
    let t = h.store.acquire(step_input(&h, "ORD-12", "create_order")).await.unwrap().record.fencing_token;
    h.store.complete(complete(&h, "ORD-12:create_order", t, success("ord-12"))).await.unwrap();
    h.clock.advance(10_000);
    while h.store.sweep(100).await.unwrap() != crate::SweepOutcome::default() {}
    assert!(
        h.store.get(&h.tenant, "ORD-12:create_order").await.unwrap().is_some(),
        "a step's operation stays while its instance does"
    );
    let now = 1_010_000;
    let next = Next::Finish { state: InstanceState::Succeeded, index: None, class: None, reason: "done".into() };
    let (rec, events) = plan_instance_update(&inst, &definition(), &next, &Actor::system(), now).unwrap();
    assert!(flows.update_instance(InstanceUpdate { record: rec, read_version: inst.version, events }).await.unwrap());
    let done = flows.instance(&h.tenant, "ORD-12").await.unwrap().unwrap();
    assert_eq!(done.expires_at, Some(now + 1_000), "retention from completion");
    h.clock.advance(1_000);
    assert_eq!(flows.sweep_instances(100).await.unwrap(), 1);
    assert!(flows.instance(&h.tenant, "ORD-12").await.unwrap().is_none());
    assert!(flows.instance_events(&h.tenant, "ORD-12").await.unwrap().is_empty());
    let late = flows.start_instance(start(&h, "ORD-12", json!({}))).await.unwrap();
    assert_eq!((late.decision, late.instance.state), (StartDecision::Late, InstanceState::Succeeded));
    assert!(flows.instance_tombstone(&h.tenant, "ORD-12").await.unwrap().is_some());
    while h.store.sweep(100).await.unwrap().records > 0 {}
    assert!(h.store.get(&h.tenant, "ORD-12:create_order").await.unwrap().is_none(), "then its steps go too");
}

pub(super) async fn instances_list_with_filters_and_pages(h: Harness) {
    let flows = h.store.flows();
    for i in 0..5 {
        flows.start_instance(start(&h, &format!("L-{i}"), json!({"i": i}))).await.unwrap();
        h.clock.advance(1);
    }
    let mut f = InstanceFilter { limit: 2, ..Default::default() };
    let mut seen = Vec::new();
    loop {
        let page = flows.list_instances(&h.tenant, &f).await.unwrap();
        seen.extend(page.items.iter().map(|i| i.instance_id.clone()));
        match page.next_cursor {
            Some(c) => f.cursor = Some(c),
            None => break,
        }
    }
    assert_eq!(seen, ["L-4", "L-3", "L-2", "L-1", "L-0"], "newest first, every instance once");
    let only = InstanceFilter { state: Some(InstanceState::Paused), limit: 50, ..Default::default() };
    assert!(flows.list_instances(&h.tenant, &only).await.unwrap().items.is_empty());
    let by_name = InstanceFilter { workflow: Some("order-intake".into()), limit: 50, ..Default::default() };
    assert_eq!(flows.list_instances(&h.tenant, &by_name).await.unwrap().items.len(), 5);
    let window = InstanceFilter {
        created_from: Some(1_000_001),
        created_before: Some(1_000_003),
        limit: 50,
        ..Default::default()
    };
    let ids: Vec<_> =
        flows.list_instances(&h.tenant, &window).await.unwrap().items.into_iter().map(|i| i.instance_id).collect();
    assert_eq!(ids, ["L-2", "L-1"]);
    let counts = flows.count_instances(Some(&h.tenant)).await.unwrap();
    assert_eq!(counts, [(InstanceState::Running, 5)]);
    let other = format!("{}-b", h.tenant);
    assert!(flows.count_instances(Some(&other)).await.unwrap().is_empty());
}

pub(super) async fn compensations_are_checkpointed_and_reruns_repoint_steps(h: Harness) {
    let flows = h.store.flows();
    let inst = flows.start_instance(start(&h, "ORD-13", json!({}))).await.unwrap().instance;
    let t = h.store.acquire(step_input(&h, "ORD-13", "create_order")).await.unwrap().record.fencing_token;
    h.store.complete(complete(&h, "ORD-13:create_order", t, success("ord-13"))).await.unwrap();
    let cps = flows.checkpoints(&h.tenant, "ORD-13").await.unwrap();
    assert_eq!(cps[0].row.comp_key, "ORD-13:create_order:compensate");
    assert!(cps[0].compensation.is_none());
    let mut undo = step_input(&h, "ORD-13", "create_order");
    undo.key = cps[0].row.comp_key.clone();
    let t = h.store.acquire(undo).await.unwrap().record.fencing_token;
    h.store.complete(complete(&h, "ORD-13:create_order:compensate", t, success("cancel-13"))).await.unwrap();
    let cps = flows.checkpoints(&h.tenant, "ORD-13").await.unwrap();
    assert_eq!(cps.len(), 3, "one checkpoint per step, the compensation inside it");
    assert_eq!(cps[0].state, StepState::Compensated);
    assert_eq!(cps[0].compensation.as_ref().unwrap().provider_ref.as_deref(), Some("cancel-13"));
    assert_eq!(cps[0].operation.as_ref().unwrap().provider_ref.as_deref(), Some("ord-13"));
    h.clock.advance(10_000);
    while h.store.sweep(100).await.unwrap() != crate::SweepOutcome::default() {}
    assert!(
        h.store.get(&h.tenant, "ORD-13:create_order:compensate").await.unwrap().is_some(),
        "kept with its instance"
    );

    let now = 1_010_000;
    let next = Next::Wait { index: 1, until_ms: now };
    let (rec, events) = plan_instance_update(&inst, &definition(), &next, &Actor::system(), now).unwrap();
    let keys = vec![(
        1,
        "ORD-13:send_confirmation:rerun-1".to_string(),
        "ORD-13:send_confirmation:rerun-1:compensate".to_string(),
    )];
    let stale = InstanceUpdate { record: rec.clone(), read_version: inst.version - 1, events: events.clone() };
    let write = |update, keys| crate::flow::RerunWrite { update, keys, item_keys: Vec::new(), superseded: Vec::new() };
    assert!(!flows.apply_rerun(write(stale, keys.clone())).await.unwrap(), "a stale version writes nothing");
    assert_eq!(flows.checkpoints(&h.tenant, "ORD-13").await.unwrap()[1].row.op_key, "ORD-13:send_confirmation");
    let update = InstanceUpdate { record: rec, read_version: inst.version, events };
    assert!(flows.apply_rerun(write(update, keys)).await.unwrap());
    let cps = flows.checkpoints(&h.tenant, "ORD-13").await.unwrap();
    assert_eq!(cps[1].row.op_key, "ORD-13:send_confirmation:rerun-1");
    assert_eq!(cps[1].row.comp_key, "ORD-13:send_confirmation:rerun-1:compensate");
    let step = flows.step_of_operation(&h.tenant, "ORD-13:send_confirmation:rerun-1").await.unwrap().unwrap();
    assert_eq!(step.step, "send_confirmation");
}

/// Item `item` (at `seq` in its list) of step `send_confirmation` of instance `id`, with its
/// derived keys.
fn item_row(h: &Harness, id: &str, item: &str, seq: i64) -> idem_core::flow::ItemRow {
    let op_key = idem_core::flow::item_key(id, "send_confirmation", item);
    idem_core::flow::ItemRow {
        tenant: h.tenant.clone(),
        instance_id: id.into(),
        position: 1,
        step: "send_confirmation".into(),
        item: item.into(),
        seq,
        comp_key: idem_core::flow::compensation_key(&op_key),
        op_key,
        policy: idem_core::flow::RecoveryPolicy::RedoSafe,
    }
}

/// The items of a step for each item: written once (again: nothing changes), read with
/// their operations and compensations in the checkpoints, found by their keys, and removed
/// with their instance.
pub(super) async fn items_are_written_once_and_read_with_their_operations(h: Harness) {
    use idem_core::flow::{compensation_key, item_key};
    let flows = h.store.flows();
    flows.start_instance(start(&h, "ORD-11", json!({}))).await.unwrap();
    let row = |item: &str, seq: i64| item_row(&h, "ORD-11", item, seq);
    flows.add_items(vec![row("r2", 1), row("r1", 2)]).await.unwrap();
    flows.add_items(vec![row("r1", 1), row("r2", 2)]).await.unwrap();
    let mut input = step_input(&h, "ORD-11", "x");
    input.key = item_key("ORD-11", "send_confirmation", "r1");
    let granted = h.store.acquire(input).await.unwrap().record;
    let mut comp = step_input(&h, "ORD-11", "x");
    comp.key = compensation_key(&item_key("ORD-11", "send_confirmation", "r2"));
    h.store.acquire(comp).await.unwrap();
    let cps = flows.checkpoints(&h.tenant, "ORD-11").await.unwrap();
    assert_eq!(cps.len(), 3, "items are not steps");
    let items: Vec<_> = cps[1].items.iter().map(|i| (i.row.item.as_str(), i.row.seq, i.state)).collect();
    assert_eq!(items, [("r2", 1, StepState::NotStarted), ("r1", 2, StepState::Executing)], "the first write stands");
    assert_eq!(cps[1].items[1].operation.as_ref().unwrap().fencing_token, granted.fencing_token);
    assert!(cps[1].items[0].compensation.is_some(), "an item's compensation is read with it");
    assert_eq!(cps[1].state, StepState::Executing);
    assert!(cps[0].items.is_empty() && cps[2].items.is_empty());
    let found = flows.step_of_operation(&h.tenant, "ORD-11:send_confirmation:r1").await.unwrap().unwrap();
    assert_eq!(
        (found.step.as_str(), found.position, found.op_key.as_str()),
        ("send_confirmation", 1, "ORD-11:send_confirmation:r1")
    );
    let other_tenant = format!("{}-b", h.tenant);
    assert!(flows.step_of_operation(&other_tenant, "ORD-11:send_confirmation:r1").await.unwrap().is_none());
}

/// A re-run points an item at its new key (`{item key}:rerun-1`) with the instance, at the
/// version it was planned from only: the item's checkpoint then reads the new key's
/// operation (none yet: NOT_STARTED), its old operation stays under the old key, and the
/// new key finds the item; the other items keep theirs.
pub(super) async fn reruns_repoint_items(h: Harness) {
    use idem_core::flow::{compensation_key, item_key};
    let flows = h.store.flows();
    let inst = flows.start_instance(start(&h, "ORD-12", json!({}))).await.unwrap().instance;
    let row = |item: &str, seq: i64| item_row(&h, "ORD-12", item, seq);
    flows.add_items(vec![row("r1", 1), row("r2", 2)]).await.unwrap();
    for item in ["r1", "r2"] {
        let mut input = step_input(&h, "ORD-12", "send_confirmation");
        input.key = item_key("ORD-12", "send_confirmation", item);
        let t = h.store.acquire(input.clone()).await.unwrap().record.fencing_token;
        let outcome = match item {
            "r1" => success("sent-r1"),
            _ => idem_core::Outcome::FinalFailure { error_class: "validation".into(), message: None, result: None },
        };
        h.store.complete(complete(&h, &input.key, t, outcome)).await.unwrap();
    }
    let cps = flows.checkpoints(&h.tenant, "ORD-12").await.unwrap();
    assert_eq!(cps[1].items[1].state, StepState::Failed);

    let now = 1_010_000;
    let next = Next::Wait { index: 1, until_ms: now };
    let (rec, events) = plan_instance_update(&inst, &definition(), &next, &Actor::system(), now).unwrap();
    let new_key = "ORD-12:send_confirmation:r2:rerun-1".to_string();
    let item_keys = vec![(1, "r2".to_string(), new_key.clone(), compensation_key(&new_key))];
    let write =
        |update, item_keys| crate::flow::RerunWrite { update, keys: Vec::new(), item_keys, superseded: Vec::new() };
    let stale = InstanceUpdate { record: rec.clone(), read_version: inst.version - 1, events: events.clone() };
    assert!(!flows.apply_rerun(write(stale, item_keys.clone())).await.unwrap(), "a stale version writes nothing");
    let cps = flows.checkpoints(&h.tenant, "ORD-12").await.unwrap();
    assert_eq!(cps[1].items[1].row.op_key, "ORD-12:send_confirmation:r2");
    let update = InstanceUpdate { record: rec, read_version: inst.version, events };
    assert!(flows.apply_rerun(write(update, item_keys)).await.unwrap());
    let cps = flows.checkpoints(&h.tenant, "ORD-12").await.unwrap();
    let items: Vec<_> = cps[1].items.iter().map(|i| (i.row.item.as_str(), i.row.op_key.as_str(), i.state)).collect();
    assert_eq!(
        items,
        [("r1", "ORD-12:send_confirmation:r1", StepState::Succeeded), ("r2", new_key.as_str(), StepState::NotStarted),],
        "only the re-run item moves; its new key has no operation yet"
    );
    assert_eq!(cps[1].items[1].row.comp_key, "ORD-12:send_confirmation:r2:rerun-1:compensate");
    let old = h.store.get(&h.tenant, "ORD-12:send_confirmation:r2").await.unwrap().unwrap();
    assert_eq!(old.state, idem_core::State::Failed, "the old attempt stays, with its evidence");
    let found = flows.step_of_operation(&h.tenant, &new_key).await.unwrap().unwrap();
    assert_eq!((found.step.as_str(), found.op_key.as_str()), ("send_confirmation", new_key.as_str()));
    assert!(flows.step_of_operation(&h.tenant, "ORD-12:send_confirmation:r2").await.unwrap().is_none());
}
