//! Canned histories for the plan tests (temporalio/sdk-core's `canned_histories` idea): a
//! three-step definition, an instance, and operations in any state, assembled into
//! checkpoints. Each test's doc comment lists the checkpoints it starts from.

use super::definition::Definition;
use super::plan::{StartInput, plan_start};
use super::record::{Checkpoint, InstanceRecord, StepRow, compensation_key, step_fingerprint, step_key};
use crate::record::{Actor, OperationRecord};
use crate::{AcquireInput, State};
use serde_json::json;

/// "Now" of every canned history (epoch ms).
pub const NOW: i64 = 1_000_000;
/// The instance id of every canned history.
pub const ID: &str = "ORD-7:intake";
/// The steps of [`def`], in order.
pub const STEPS: [&str; 3] = ["create_order", "send_confirmation", "write_back"];

/// create_order (erp, lookup_before_redo, compensated by cancel_order), send_confirmation
/// (mail, manual, compensated by send_correction), write_back (crm, redo_safe, no
/// compensation).
pub fn def() -> Definition {
    serde_json::from_value(json!({
        "name": "order-intake",
        "steps": [
            {"name": "create_order", "action": "create_order", "connector": "erp", "policy": "lookup_before_redo",
             "input": {"customer": {"from": "/input/customer"}},
             "compensation": {"action": "cancel_order", "connector": "erp",
                              "input": {"order": {"from": "/steps/create_order/provider_ref"}}}},
            {"name": "send_confirmation", "action": "send_confirmation", "connector": "mail", "policy": "manual",
             "input": {"order_id": {"from": "/steps/create_order/result/id"}},
             "compensation": {"action": "send_correction", "connector": "mail"}},
            {"name": "write_back", "action": "write_back", "connector": "crm", "policy": "redo_safe",
             "input": {"order": {"from": "/steps/create_order/provider_ref"}}}
        ]
    }))
    .unwrap()
}

/// The start of the canned instance.
pub fn start() -> StartInput {
    StartInput {
        tenant: "t".into(),
        instance_id: ID.into(),
        workflow: "order-intake".into(),
        definition_version: def().version(),
        definition_given: false,
        source_event: Some("evt_1".into()),
        input: json!({"customer": "C-1"}),
        input_fingerprint: "f".repeat(64),
        trace_id: None,
        actor: Actor { principal: "p".into(), request_id: None },
        hold_ms: 0,
    }
}

/// The canned instance, RUNNING since 10 s before [`NOW`].
pub fn instance() -> InstanceRecord {
    plan_start(None, None, &start(), NOW - 10_000).record
}

/// An operation under `key` in `state` (SUCCEEDED ones carry evidence and a result).
pub fn op_at(key: &str, state: State) -> OperationRecord {
    let input = AcquireInput {
        tenant: "t".into(),
        key: key.into(),
        action: key.rsplit(':').next().unwrap_or(key).into(),
        payload: json!({"p": key}),
        fingerprint: "x".into(),
        lease_ms: 1000,
        redo_safe: false,
        connector: Some("c".into()),
        holder: None,
        actor: Actor::default(),
    };
    let mut r = input.new_record(NOW - 5_000);
    r.state = state;
    if state == State::Succeeded {
        r.provider_ref = Some(format!("{}-ref", key.rsplit(':').next().unwrap_or(key)));
        r.result = Some(json!({"id": 42}));
    }
    r
}

/// The operation of step `step` in `state`, made for it (the step's action and connector).
pub fn op(step: &str, state: State) -> OperationRecord {
    let d = def();
    let s = d.steps.iter().find(|s| s.name == step).expect("a step of the canned definition");
    let mut r = op_at(&step_key(ID, step), state);
    r.action = s.action.clone();
    r.connector = s.connector.clone();
    made_by_idem(r)
}

/// `r` with the fingerprint idem gives the operations it performs for a workflow.
pub fn made_by_idem(mut r: OperationRecord) -> OperationRecord {
    r.fingerprint = step_fingerprint(&r.key, &crate::fingerprint(&r.payload, None).unwrap().0);
    r
}

/// The operation of step `step`'s compensation in `state`, made for it.
pub fn comp(step: &str, state: State) -> OperationRecord {
    let d = def();
    let c = d.steps.iter().find(|s| s.name == step).and_then(|s| s.compensation.clone());
    let c = c.expect("a compensated step of the canned definition");
    let mut r = op_at(&compensation_key(&step_key(ID, step)), state);
    r.action = c.action;
    r.connector = c.connector;
    made_by_idem(r)
}

/// Checkpoints of [`def`]: `ops[i]` is step i's operation and `comps[i]` its compensation's
/// (missing = none).
pub fn checkpoints_with(ops: Vec<Option<OperationRecord>>, comps: Vec<Option<OperationRecord>>) -> Vec<Checkpoint> {
    let d = def();
    STEPS
        .iter()
        .enumerate()
        .map(|(i, n)| {
            let op_key = step_key(ID, n);
            let row = StepRow {
                tenant: "t".into(),
                instance_id: ID.into(),
                position: i as i64,
                step: (*n).into(),
                comp_key: compensation_key(&op_key),
                op_key,
                policy: d.steps[i].policy,
            };
            Checkpoint::with_compensation(row, ops.get(i).cloned().flatten(), comps.get(i).cloned().flatten())
        })
        .collect()
}

/// [`checkpoints_with`] without compensations.
pub fn checkpoints(ops: Vec<Option<OperationRecord>>) -> Vec<Checkpoint> {
    checkpoints_with(ops, vec![])
}
