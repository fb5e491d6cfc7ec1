//! A re-run's plan for the items of a step for each item: each item is planned like a step
//! (the table in [`super`]), under its own key, and is a line of its own in the plan.
//!
//! | item                                       | step not named                   | step named       |
//! |--------------------------------------------|----------------------------------|------------------|
//! | SUCCEEDED                                  | kept (its result is reused)      | redone: new key `{item key}:rerun-N` |
//! | FAILED                                     | redone: new key                  | redone           |
//! | UNKNOWN                                    | looked up first (needs a lookup) | redone           |
//! | not started                                | runs                             | runs             |
//! | PENDING, EXECUTING                         | kept (it is on its way)          | refused          |
//!
//! (Not named, an item is redone or looked up only while its step is the first that did
//! not succeed: before that, no item stopped.) A compensation re-run plans each item's
//! compensation as a step's: a FAILED one is redone under `{item key}:compensate-N`, an
//! UNKNOWN one looked up first, one not begun yet runs.

use super::{PlannedItem, RerunRefusal, StepDisposition};
use crate::State;
use crate::flow::definition::{Definition, StepDef};
use crate::flow::input::build_step_input;
use crate::flow::items::{item_context, item_input};
use crate::flow::plan::needs_compensation;
use crate::flow::record::{
    Checkpoint, InstanceRecord, ItemCheckpoint, MAX_RERUNS, compensation_key, compensation_number,
    compensation_rerun_key,
};
use crate::flow::state::StepState;

/// How an item is named in refusals: `send (item r2)` (an identity needs no quotes: it is
/// `[A-Za-z0-9_.-]`).
fn label(step: &StepDef, item: &ItemCheckpoint) -> String {
    format!("{} (item {})", step.name, item.row.item)
}

/// What the forward re-run does to the items of step `index`: `named` (the step was named:
/// every item is redone), `first` (the step is the first that did not succeed: its failed
/// items are redone, its UNKNOWN ones looked up), `inputs_known` (every step before it is
/// kept: the inputs can be shown).
///
/// # Errors
/// [`RerunRefusal::StepBusy`] (a named step's item on its way),
/// [`RerunRefusal::NeedsResolution`] (an UNKNOWN item without a lookup),
/// [`RerunRefusal::TooManyReruns`].
#[allow(clippy::too_many_arguments)]
pub(super) fn plan_forward(
    inst: &InstanceRecord,
    def: &Definition,
    checkpoints: &[Checkpoint],
    index: usize,
    named: bool,
    first: bool,
    inputs_known: bool,
    has_lookup: &dyn Fn(&str) -> bool,
) -> Result<Vec<PlannedItem>, RerunRefusal> {
    let step = &def.steps[index];
    let mut out = Vec::with_capacity(checkpoints[index].items.len());
    for item in &checkpoints[index].items {
        let foreign = item.as_checkpoint().foreign_step_operation(step).is_some();
        let disposition = match (item.operation.as_ref().map(|o| o.state), named) {
            _ if foreign => StepDisposition::Redone,
            (None, _) => StepDisposition::Runs,
            (Some(State::Pending | State::Executing), true) => {
                return Err(RerunRefusal::StepBusy { step: label(step, item), state: item.state });
            }
            (Some(_), true) => StepDisposition::Redone,
            (Some(State::Failed), false) if first => StepDisposition::Redone,
            (Some(State::Unknown), false) if first => {
                if !step.connector.as_deref().is_some_and(has_lookup) {
                    return Err(RerunRefusal::NeedsResolution(label(step, item)));
                }
                StepDisposition::LookedUp
            }
            (Some(_), false) => StepDisposition::Kept,
        };
        let op_key = match disposition {
            StepDisposition::Redone => {
                let key_name = format!("{}:{}", step.name, item.row.item);
                super::redo_key(inst, &key_name, &item.row.op_key, || label(step, item))?
            }
            _ => item.row.op_key.clone(),
        };
        let comp_key = if op_key == item.row.op_key { item.row.comp_key.clone() } else { compensation_key(&op_key) };
        let input = match disposition {
            StepDisposition::Redone | StepDisposition::Runs if step.connector.is_some() && inputs_known => {
                item_input(inst, def, checkpoints, index, &item.row.item).ok()
            }
            _ => None,
        };
        out.push(PlannedItem {
            item: item.row.item.clone(),
            state: item.state,
            disposition,
            action: step.action.clone(),
            key: op_key.clone(),
            op_key,
            comp_key,
            input,
        });
    }
    Ok(out)
}

/// What a compensation re-run does to the items of step `index`: each item's compensation
/// planned as a step's (see [`super::plan_rerun`]).
///
/// # Errors
/// [`RerunRefusal::NeedsResolution`] (an UNKNOWN compensation without a lookup),
/// [`RerunRefusal::TooManyReruns`].
pub(super) fn plan_compensation(
    inst: &InstanceRecord,
    def: &Definition,
    checkpoints: &[Checkpoint],
    index: usize,
    has_lookup: &dyn Fn(&str) -> bool,
) -> Result<Vec<PlannedItem>, RerunRefusal> {
    let step = &def.steps[index];
    let comp_def = step.compensation.as_ref();
    let mut out = Vec::with_capacity(checkpoints[index].items.len());
    for item in &checkpoints[index].items {
        let cp = item.as_checkpoint();
        let comp = item.compensation.as_ref();
        let foreign = cp.foreign_compensation(step).is_some();
        let (disposition, comp_key) = match comp.map(|o| if foreign { State::Failed } else { o.state }) {
            Some(State::Failed) => {
                let n = compensation_number(&item.row.comp_key) + 1;
                if n > MAX_RERUNS {
                    return Err(RerunRefusal::TooManyReruns(format!("{} (its compensation)", label(step, item))));
                }
                (StepDisposition::Compensated, compensation_rerun_key(&item.row.op_key, n))
            }
            Some(State::Unknown) => {
                if !comp_def.and_then(|k| k.connector.as_deref()).is_some_and(has_lookup) {
                    return Err(RerunRefusal::NeedsResolution(format!("{} (its compensation)", label(step, item))));
                }
                (StepDisposition::LookedUp, item.row.comp_key.clone())
            }
            None if needs_compensation(step, &cp) => (StepDisposition::CompensationRuns, item.row.comp_key.clone()),
            _ => (StepDisposition::Kept, item.row.comp_key.clone()),
        };
        let input = match comp_def {
            Some(d) if disposition.is_compensation() && d.connector.is_some() => {
                build_step_input(&d.input, &item_context(inst, def, checkpoints, index, &item.row.item)).ok()
            }
            _ => None,
        };
        out.push(PlannedItem {
            item: item.row.item.clone(),
            state: StepState::of_operation(comp.map(|o| o.state)),
            disposition,
            action: comp_def.map_or_else(|| step.action.clone(), |d| d.action.clone()),
            key: comp_key.clone(),
            op_key: item.row.op_key.clone(),
            comp_key,
            input,
        });
    }
    Ok(out)
}

/// The disposition of a step for each item's own line: what happens to the most of its
/// items, in the order redone (or compensated again), looked up, runs, kept.
pub(super) fn summary(items: &[PlannedItem]) -> StepDisposition {
    use StepDisposition::*;
    let has = |d: StepDisposition| items.iter().any(|i| i.disposition == d);
    [Redone, Compensated, LookedUp, Runs, CompensationRuns].into_iter().find(|d| has(*d)).unwrap_or(Kept)
}
