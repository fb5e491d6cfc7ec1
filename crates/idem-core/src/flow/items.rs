//! A step for each item of a list (`for_each`): the list comes from the instance input or
//! an earlier step's result; each item is its own operation, keyed by the item's own
//! identity (`{instance}:{step}:{id}`, the value of the declared `for_each.id` field), never
//! by its position, so a reordered or repeated list redoes nothing.
//!
//! When the step is reached its list is read once and its items written
//! ([`Next::PlanItems`]); from then on the stored items are the step's: the list's source
//! (the input, or an earlier step's result) no longer changes. The items then run like the
//! branches of a parallel group (see [`super::group`]): at most `max_concurrency` in
//! flight, each with the step's recovery policy, the step after them once all SUCCEEDED;
//! a failed or UNKNOWN item follows `on_failure` (pause or compensate — the items that
//! completed are compensated, each once, `{item key}:compensate`). An empty list is a step
//! with nothing to do, shown SUCCEEDED once the instance moved past it
//! ([`settle_empty_lists`]). An operator's re-run plans each item as a step (see
//! `super::rerun`): a failed item is redone under `{item key}:rerun-N`.
//!
//! An item's input is the step's input template with `/item` the item itself (`null`
//! template: the item as it is); the step's result, for later steps, maps each item's
//! identity to its result.

use super::definition::Definition;
use super::group::{is_in_flight, stopped, until};
use super::input::build_step_input;
use super::plan::{Next, operation_next};
use super::record::{Checkpoint, InstanceRecord, ItemRow, compensation_key, input_context, item_key};
use super::record::{MAX_STEP_NAME_LEN, validate_step_name};
use serde_json::Value;

/// The most items one step for each item takes. Every pass over the instance reads all of
/// its items with their operations, so a pass costs in proportion to the list: beyond this,
/// split the list over several instances (one per batch, say).
pub const MAX_ITEMS: usize = 1_000;

/// The items of step `index` (a step for each item) as rows to write, in the list's order,
/// or why the list cannot be read (a missing or non-list value, an item without a valid
/// identity, two items with one identity and different contents).
///
/// # Errors
/// A one-line message naming the pointer or the item.
pub fn plan_items(
    inst: &InstanceRecord,
    def: &Definition,
    checkpoints: &[Checkpoint],
    index: usize,
) -> Result<Vec<ItemRow>, String> {
    let step = &def.steps[index];
    let fe = step.for_each.as_ref().ok_or("not a step for each item")?;
    let list = list_of(inst, def, checkpoints, index)?;
    if list.len() > MAX_ITEMS {
        return Err(format!(
            "it has {} items, more than the {MAX_ITEMS} a step for each item takes: split the list over several instances",
            list.len()
        ));
    }
    let mut rows: Vec<ItemRow> = Vec::with_capacity(list.len());
    // (identity, item, its 1-based place in the list) of each identity's first item.
    let mut seen: Vec<(&str, &Value, usize)> = Vec::new();
    let ids: Vec<String> =
        list.iter().enumerate().map(|(i, v)| identity(v, &fe.id, i, &step.name)).collect::<Result<_, _>>()?;
    for (i, (item, id)) in list.iter().zip(&ids).enumerate() {
        if let Some((_, other, first)) = seen.iter().find(|(s, _, _)| *s == id.as_str()) {
            if *other != item {
                return Err(format!("items {first} and {} have the identity {id:?} with different contents", i + 1));
            }
            continue;
        }
        seen.push((id, item, i + 1));
        let op_key = item_key(&inst.instance_id, &step.name, id);
        rows.push(ItemRow {
            tenant: inst.tenant.clone(),
            instance_id: inst.instance_id.clone(),
            position: index as i64,
            step: step.name.clone(),
            item: id.clone(),
            seq: rows.len() as i64 + 1,
            comp_key: compensation_key(&op_key),
            op_key,
            policy: step.policy,
        });
    }
    Ok(rows)
}

/// The list of step `index`, read from its `for_each.items` pointer.
fn list_of(
    inst: &InstanceRecord,
    def: &Definition,
    checkpoints: &[Checkpoint],
    index: usize,
) -> Result<Vec<Value>, String> {
    let fe = def.steps[index].for_each.as_ref().ok_or("not a step for each item")?;
    let ctx = input_context(inst, checkpoints);
    match build_step_input(&serde_json::json!({"from": fe.items}), &ctx).map_err(|e| e.to_string())? {
        Value::Array(items) => Ok(items),
        other => Err(format!("{:?} is {}, not a list", fe.items, kind(&other))),
    }
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

/// The identity of item `i` (0-based) of step `step`: the string or integer at `pointer`,
/// a valid key ending (`[A-Za-z0-9_.-]`, not `compensate…` or `rerun-…`) that leaves
/// `{step}:{id}` within [`MAX_STEP_NAME_LEN`] characters.
fn identity(item: &Value, pointer: &str, i: usize, step: &str) -> Result<String, String> {
    let id = match item.pointer(pointer) {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Number(n)) if n.is_i64() || n.is_u64() => n.to_string(),
        Some(other) => {
            return Err(format!(
                "item {}: its identity {pointer:?} is {}, not a string or an integer",
                i + 1,
                kind(other)
            ));
        }
        None => return Err(format!("item {}: it has no identity at {pointer:?}", i + 1)),
    };
    let room = MAX_STEP_NAME_LEN.saturating_sub(step.len() + 1);
    if id.len() > room || validate_step_name(&id).is_err() {
        return Err(format!(
            "item {}: its identity {id:?} must be 1-{room} characters of [A-Za-z0-9_.-], not starting with compensate or rerun- (it ends the item's key)",
            i + 1
        ));
    }
    Ok(id)
}

/// The input context of a step: the instance's (see [`input_context`]), where a step for
/// each item whose list was empty has an empty result (`{}`).
pub(super) fn context(inst: &InstanceRecord, def: &Definition, checkpoints: &[Checkpoint]) -> Value {
    let mut ctx = input_context(inst, checkpoints);
    for (step, c) in def.steps.iter().zip(checkpoints) {
        if step.for_each.is_some() && c.items.is_empty() && ctx["steps"].get(&step.name).is_none() {
            ctx["steps"][&step.name] = serde_json::json!({"result": {}, "provider_ref": null});
        }
    }
    ctx
}

/// The input context of item `item` of step `index`: the instance's, with `/item` the
/// item's value in the list (`null` if it is no longer there).
pub(super) fn item_context(
    inst: &InstanceRecord,
    def: &Definition,
    checkpoints: &[Checkpoint],
    index: usize,
    item: &str,
) -> Value {
    let mut ctx = context(inst, def, checkpoints);
    let value = def.steps[index].for_each.as_ref().and_then(|fe| {
        let list = list_of(inst, def, checkpoints, index).ok()?;
        list.into_iter()
            .enumerate()
            .find(|(i, v)| identity(v, &fe.id, *i, &def.steps[index].name).ok().as_deref() == Some(item))
    });
    ctx["item"] = value.map_or(Value::Null, |(_, v)| v);
    ctx
}

/// The input item `item` of step `index` sends: the step's input template built with
/// `/item` the item (a `null` template: the item as it is).
///
/// # Errors
/// The input builder's message (a pointer that is missing).
pub(super) fn item_input(
    inst: &InstanceRecord,
    def: &Definition,
    checkpoints: &[Checkpoint],
    index: usize,
    item: &str,
) -> Result<Value, String> {
    let ctx = item_context(inst, def, checkpoints, index, item);
    let template = &def.steps[index].input;
    if template.is_null() {
        Ok(ctx["item"].clone())
    } else {
        build_step_input(template, &ctx).map_err(|e| e.to_string())
    }
}

/// Marks SUCCEEDED each step for each item that has no items because its list was empty,
/// once the instance moved past it (it SUCCEEDED, or a later step has begun): such a
/// step had nothing to do, and showing it NOT_STARTED forever (`wf get`, the admin page,
/// a re-run's plan) said otherwise. Derived, as every checkpoint is: no operation is
/// invented (its `operation` stays `None`), and a list that is not empty now (an earlier
/// step was redone since) leaves the step as it is: it runs when its turn comes.
pub fn settle_empty_lists(inst: &InstanceRecord, def: &Definition, checkpoints: &mut [Checkpoint]) {
    for index in 0..checkpoints.len().min(def.steps.len()) {
        let c = &checkpoints[index];
        if def.steps[index].for_each.is_none()
            || !c.items.is_empty()
            || c.operation.is_some()
            || c.state != super::StepState::NotStarted
        {
            continue;
        }
        let moved_past = inst.state == super::InstanceState::Succeeded
            || checkpoints[index + 1..].iter().any(|l| l.state != super::StepState::NotStarted);
        if moved_past && list_of(inst, def, checkpoints, index).is_ok_and(|l| l.is_empty()) {
            checkpoints[index].state = super::StepState::Succeeded;
        }
    }
}

/// What step `index`, a step for each item, needs next; `None` when every item SUCCEEDED
/// (or the list is empty).
pub(super) fn next_items(
    inst: &InstanceRecord,
    def: &Definition,
    checkpoints: &[Checkpoint],
    index: usize,
    now_ms: i64,
) -> Option<Next> {
    let (step, c) = (&def.steps[index], &checkpoints[index]);
    let fe = step.for_each.as_ref()?;
    if c.items.is_empty() {
        return match plan_items(inst, def, checkpoints, index) {
            Ok(items) if items.is_empty() => None,
            Ok(items) => Some(Next::PlanItems { index, items }),
            Err(e) => Some(Next::Finish {
                state: super::InstanceState::Failed,
                index: Some(index),
                class: Some("step_input"),
                reason: format!("the list of step {:?} cannot be read: {e}", step.name),
            }),
        };
    }
    let (mut runs, mut waits, mut in_flight) = (Vec::new(), Vec::new(), 0usize);
    for item in &c.items {
        let cp = item.as_checkpoint();
        in_flight += usize::from(is_in_flight(&cp, now_ms));
        let next = if let Some(op) = cp.foreign_step_operation(step) {
            Some(super::plan::key_conflict(index, step, op, "the step"))
        } else {
            match &cp.operation {
                None => {
                    let built = item_input(inst, def, checkpoints, index, &item.row.item);
                    Some(match built {
                        Ok(payload) => Next::Run { index, payload },
                        Err(e) => Next::Finish {
                            state: super::InstanceState::Failed,
                            index: Some(index),
                            class: Some("step_input"),
                            reason: format!(
                                "the input of item {:?} of step {:?} cannot be built: {e}",
                                item.row.item, step.name
                            ),
                        },
                    })
                }
                Some(op) => operation_next(step, index, cp.state, op, now_ms),
            }
        };
        let wrap = |n: Next| Next::Item { item: item.row.item.clone(), next: Box::new(n) };
        match next {
            None => {}
            Some(run @ (Next::Run { .. } | Next::Redo { .. })) => runs.push(wrap(run)),
            Some(wait @ (Next::Wait { .. } | Next::WaitForCaller { .. })) => waits.push(wait),
            Some(stop) => {
                let label = |_: usize| format!("item {:?} of step {:?}", item.row.item, step.name);
                return Some(stopped(def, checkpoints, &label, fe.on_failure, index + 1, stop));
            }
        }
    }
    let room = fe.max_concurrency.map_or(usize::MAX, |m| (m as usize).saturating_sub(in_flight));
    runs.truncate(room);
    match runs.len() {
        0 => waits.into_iter().min_by_key(until),
        1 => runs.pop(),
        _ => Some(Next::Parallel { runs }),
    }
}

#[cfg(test)]
pub(super) mod tests;
