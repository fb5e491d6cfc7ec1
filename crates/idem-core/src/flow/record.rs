//! Workflow instances, their step rows and events, as plain data; the operation keys a
//! step derives from its instance; and the checkpoint a resuming worker reads.
//!
//! All instants are Unix epoch **milliseconds** (UTC) as `i64`.

use super::definition::{Definition, RecoveryPolicy, StepDef};
use super::state::{InstanceState, StepState};
use crate::key::IdempotencyKey;
use crate::record::{Actor, OperationRecord};
use crate::retention::Retention;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};

/// Longest instance id, in characters. Leaves room for `:{step}` (≤ 48), a re-run's
/// `:rerun-N` (N ≤ 999) and `:compensate` within the 255 characters of an idempotency key.
pub const MAX_INSTANCE_ID_LEN: usize = 180;
/// Most operator re-runs of one step (its keys end `:rerun-1` … `:rerun-999`).
pub const MAX_RERUNS: u32 = 999;
/// Longest step name, in characters.
pub const MAX_STEP_NAME_LEN: usize = 48;
/// Longest workflow name, in characters.
pub const MAX_WORKFLOW_NAME_LEN: usize = 64;

/// Checks an instance id: a stable business id (`ORD-7:intake`) with the rules of an
/// idempotency key (printable ASCII, no surrounding space, no e-mail address or phone
/// number: it is logged and shown to operators), at most [`MAX_INSTANCE_ID_LEN`]
/// characters, and no `/` (it travels as one URL path segment).
///
/// # Errors
/// A one-line message for the caller.
pub fn validate_instance_id(id: &str) -> Result<(), String> {
    if id.is_empty() || id.len() > MAX_INSTANCE_ID_LEN {
        return Err(format!("the instance id has {} characters; it must have 1 to {MAX_INSTANCE_ID_LEN}", id.len()));
    }
    if id.contains('/') {
        return Err("the instance id cannot contain '/'".into());
    }
    IdempotencyKey::parse(id).map(|_| ()).map_err(|e| e.to_string().replace("idempotency key", "instance id"))
}

/// Checks a step name: 1–[`MAX_STEP_NAME_LEN`] characters of `[A-Za-z0-9_.-]` (no `:`), and
/// not `compensate…` or `rerun-…`, so that a derived key names one step of one instance:
/// `A:b:compensate` (or `A:b:compensate-2`, an operator's redo of it) is the compensation
/// of step `b` of `A`, never step `compensate` (`compensate-2`) of `A:b`.
///
/// # Errors
/// A one-line message.
pub fn validate_step_name(name: &str) -> Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= MAX_STEP_NAME_LEN
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b"_.-".contains(&b))
        && name != "."
        && name != ".."
        && !name.starts_with("compensate")
        && !name.starts_with("rerun-");
    if ok {
        Ok(())
    } else {
        Err(format!(
            "a step name is 1-{MAX_STEP_NAME_LEN} characters of [A-Za-z0-9_.-], not starting with compensate or rerun- (those end the keys idem derives)"
        ))
    }
}

/// Checks a workflow name: 1–[`MAX_WORKFLOW_NAME_LEN`] characters of `[A-Za-z0-9_.-]`.
///
/// # Errors
/// A one-line message.
pub fn validate_workflow_name(name: &str) -> Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= MAX_WORKFLOW_NAME_LEN
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b"_.-".contains(&b));
    if ok { Ok(()) } else { Err(format!("a workflow name is 1-{MAX_WORKFLOW_NAME_LEN} characters of [A-Za-z0-9_.-]")) }
}

/// The idempotency key of step `step` of instance `instance`: `{instance}:{step}`; for a
/// branch of a parallel group, `step` is `{group}:{branch}` ([`StepDef::key_name`]).
pub fn step_key(instance: &str, step: &str) -> String {
    format!("{instance}:{step}")
}

/// The key of the compensation of the step operation `op_key`: `{op_key}:compensate`
/// (`{instance}:{step}:compensate`, or `{instance}:{step}:rerun-N:compensate` for a re-run's
/// effect): one compensation per effect, so each runs at most once.
pub fn compensation_key(op_key: &str) -> String {
    format!("{op_key}:compensate")
}

/// The key of the `n`-th (n ≥ 2) operator-requested redo of a failed compensation of
/// `op_key`: `{op_key}:compensate-{n}` (a new intent, audited).
pub fn compensation_rerun_key(op_key: &str, n: u32) -> String {
    format!("{op_key}:compensate-{n}")
}

/// Which attempt a compensation key is: 1 for `…:compensate`, N for `…:compensate-N`.
pub fn compensation_number(comp_key: &str) -> u32 {
    comp_key.rsplit_once(":compensate-").and_then(|(_, n)| n.parse().ok()).unwrap_or(1)
}

/// The key of the `n`-th operator-requested redo of a step: `{instance}:{step}:rerun-{n}`
/// (a new intent, so a new key).
pub fn rerun_key(instance: &str, step: &str, n: u32) -> String {
    format!("{instance}:{step}:rerun-{n}")
}

/// Which re-run a step's operation key is: 0 for `{instance}:{step}`, N for `…:rerun-N`.
pub fn rerun_number(op_key: &str) -> u32 {
    op_key.rsplit_once(":rerun-").and_then(|(_, n)| n.parse().ok()).unwrap_or(0)
}

/// One workflow instance.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InstanceRecord {
    /// Tenant that owns it.
    pub tenant: String,
    /// Stable business id (see [`validate_instance_id`]).
    pub instance_id: String,
    /// Workflow (definition) name.
    pub workflow: String,
    /// The pinned definition version (see `Definition::version`).
    pub definition_version: String,
    /// The event the instance came from (a webhook's event id, say), as first given.
    pub source_event: Option<String>,
    /// The input, as first received.
    pub input: Value,
    /// RFC 8785 + SHA-256 fingerprint of the input: the input version every step pins.
    pub input_fingerprint: String,
    /// Current state.
    pub state: InstanceState,
    /// The step that failed or paused the instance, when it is FAILED or PAUSED.
    pub stopped_step: Option<String>,
    /// Why it failed or paused (class), e.g. `step_failed`, `step_input`, `needs_review`.
    pub error_class: Option<String>,
    /// Why, in words.
    pub error_message: Option<String>,
    /// Correlation / trace id given at start.
    pub trace_id: Option<String>,
    /// When the runner should look at the instance again (epoch ms); `None`: only when
    /// something happens to it (a step completed through the API).
    pub next_run_at: Option<i64>,
    /// Creation instant.
    pub created_at: i64,
    /// Last change.
    pub updated_at: i64,
    /// When it reached a final state.
    pub completed_at: Option<i64>,
    /// When retention may remove it (set when final).
    pub expires_at: Option<i64>,
    /// Optimistic-concurrency version: +1 on every write.
    pub version: i64,
}

/// A step of an instance as stored: what its operation record does not say. Written once,
/// with the instance, for every step of the pinned definition.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepRow {
    /// Tenant.
    pub tenant: String,
    /// Instance id.
    pub instance_id: String,
    /// Position in the definition (0-based).
    pub position: i64,
    /// Step name.
    pub step: String,
    /// Key of the step's operation ([`step_key`]; a re-run points it at a [`rerun_key`]).
    pub op_key: String,
    /// Key of the operation that compensates it ([`compensation_key`] of `op_key`; an
    /// operator's re-run of a failed compensation points it at `…:compensate-N`).
    pub comp_key: String,
    /// The step's recovery policy, pinned with the definition (the reconciler reads it:
    /// it never looks up a `manual` or `compensate` step, it flags it for review).
    pub policy: RecoveryPolicy,
}

impl StepRow {
    /// The rows of a new instance of `def`, one per step, in order.
    pub fn all_of(tenant: &str, instance_id: &str, def: &Definition) -> Vec<StepRow> {
        def.steps
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let op_key = step_key(instance_id, &s.key_name());
                StepRow {
                    tenant: tenant.to_owned(),
                    instance_id: instance_id.to_owned(),
                    position: i as i64,
                    step: s.name.clone(),
                    comp_key: compensation_key(&op_key),
                    op_key,
                    policy: s.policy,
                }
            })
            .collect()
    }
}

/// The fingerprint of an operation idem performs for a workflow (a step or a compensation
/// with a connector): SHA-256 (hex) of a domain tag, the operation's key and its payload's
/// fingerprint. No trigger through `/v1/operations` can produce it (there the fingerprint
/// is the payload's own), so an operation idem made for a step is told apart from one made
/// under its key by anyone else, by recomputing it from the stored payload.
pub fn step_fingerprint(op_key: &str, payload_fingerprint: &str) -> String {
    crate::fingerprint::sha256_hex(format!("idem workflow operation\n{op_key}\n{payload_fingerprint}").as_bytes())
}

/// Whether `op` is what idem makes for an action on `connector`: the same action and
/// connector, and — when idem performs it (a connector) — a [`step_fingerprint`] of its own
/// stored payload. An operation a step's code performs (no connector) is checked by action
/// and connector only: its fingerprint is the worker's payload's, possibly of named fields.
fn made_for(op: &OperationRecord, action: &str, connector: Option<&str>) -> bool {
    if op.action != action || op.connector.as_deref() != connector {
        return false;
    }
    connector.is_none()
        || crate::fingerprint(&op.payload, None).is_ok_and(|f| op.fingerprint == step_fingerprint(&op.key, &f.0))
}

/// What a resuming worker reads for one step: the step row, its operation (if it exists),
/// its compensation's operation (if one ran) and the versions it runs under. Derived, never
/// stored.
#[derive(Debug, Clone, PartialEq)]
pub struct Checkpoint {
    /// The step row.
    pub row: StepRow,
    /// The step's state: its operation's, or COMPENSATED once its compensation SUCCEEDED.
    pub state: StepState,
    /// The step's operation, once it exists: result, provider reference, attempts, error
    /// class, times.
    pub operation: Option<OperationRecord>,
    /// The operation of the step's compensation (`{op_key}:compensate`), once it exists.
    pub compensation: Option<OperationRecord>,
    /// For a step for each item: its items, in the order the list had when they were
    /// planned (empty before, and for every other step).
    pub items: Vec<ItemCheckpoint>,
}

/// One item of a step for each item, as stored: its identity and keys. Written once, when
/// the step is reached and its list is read (see [`super::items`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ItemRow {
    /// Tenant.
    pub tenant: String,
    /// Instance id.
    pub instance_id: String,
    /// Position of its step in the definition.
    pub position: i64,
    /// Its step's name.
    pub step: String,
    /// The item's identity: the value of the step's `for_each.id` field in the item.
    pub item: String,
    /// Its place in the list when planned (1-based; shown in that order).
    pub seq: i64,
    /// Key of the item's operation: `{instance}:{step}:{item}` ([`item_key`]).
    pub op_key: String,
    /// Key of its compensation's operation ([`compensation_key`] of `op_key`).
    pub comp_key: String,
    /// The step's recovery policy, pinned.
    pub policy: RecoveryPolicy,
}

/// The key of item `item` of step `step` of instance `instance`: `{instance}:{step}:{item}`,
/// by the item's own identity, never its position, so a reordered list redoes nothing.
pub fn item_key(instance: &str, step: &str, item: &str) -> String {
    format!("{instance}:{step}:{item}")
}

/// What a resuming worker reads for one item: its row, its operation and its
/// compensation's, once they exist.
#[derive(Debug, Clone, PartialEq)]
pub struct ItemCheckpoint {
    /// The item row.
    pub row: ItemRow,
    /// Its operation's state (COMPENSATED once its compensation SUCCEEDED).
    pub state: StepState,
    /// The item's operation.
    pub operation: Option<OperationRecord>,
    /// Its compensation's operation.
    pub compensation: Option<OperationRecord>,
}

impl ItemCheckpoint {
    /// The item as a step's checkpoint (its keys in the row), for the plans a step and an
    /// item share: what its operation's state leads to, its compensation.
    pub fn as_checkpoint(&self) -> Checkpoint {
        let row = StepRow {
            tenant: self.row.tenant.clone(),
            instance_id: self.row.instance_id.clone(),
            position: self.row.position,
            step: self.row.step.clone(),
            op_key: self.row.op_key.clone(),
            comp_key: self.row.comp_key.clone(),
            policy: self.row.policy,
        };
        Checkpoint::with_compensation(row, self.operation.clone(), self.compensation.clone())
    }

    /// The checkpoint of `row` given its operations.
    pub fn of(row: ItemRow, operation: Option<OperationRecord>, compensation: Option<OperationRecord>) -> Self {
        let compensated = compensation.as_ref().is_some_and(|c| c.state == crate::State::Succeeded);
        let state = match operation.as_ref().map(|o| o.state) {
            _ if compensated => StepState::Compensated,
            s => StepState::of_operation(s),
        };
        ItemCheckpoint { row, state, operation, compensation }
    }
}

impl Checkpoint {
    /// An operation under one of this step's keys that was not made for it: its action or
    /// connector is not the step's (for the step's operation) or not its compensation's
    /// (for the compensation's). Such an operation — created through `/v1/operations`
    /// under a key that happens to be the step's — must never count as the step's result
    /// (a SUCCEEDED one would skip a step that never ran): the engine pauses the instance
    /// (`step_key_conflict`), and a re-run redoes the step under a new key. The ledger's own
    /// rule is the same: the action and the connector are part of an operation's intent
    /// (DESIGN.md §3), so any acquire of the step through the step API would get 422.
    pub fn foreign_operation(&self, step: &StepDef) -> Option<&OperationRecord> {
        self.foreign_step_operation(step).or_else(|| self.foreign_compensation(step))
    }

    /// The step's operation, if it was not made for the step (see
    /// [`Checkpoint::foreign_operation`]).
    pub fn foreign_step_operation(&self, step: &StepDef) -> Option<&OperationRecord> {
        self.operation.as_ref().filter(|op| !made_for(op, &step.action, step.connector.as_deref()))
    }

    /// The compensation's operation, if it was not made for the step's compensation (or
    /// the step has none).
    pub fn foreign_compensation(&self, step: &StepDef) -> Option<&OperationRecord> {
        self.compensation.as_ref().filter(|op| match &step.compensation {
            Some(def) => !made_for(op, &def.action, def.connector.as_deref()),
            None => true,
        })
    }

    /// The checkpoint of `row` given its operation record (no compensation).
    pub fn of(row: StepRow, operation: Option<OperationRecord>) -> Self {
        Checkpoint::with_compensation(row, operation, None)
    }

    /// The checkpoint of `row` given its operation and its compensation's operation.
    pub fn with_compensation(
        row: StepRow,
        operation: Option<OperationRecord>,
        compensation: Option<OperationRecord>,
    ) -> Self {
        let compensated = compensation.as_ref().is_some_and(|c| c.state == crate::State::Succeeded);
        let state = match operation.as_ref().map(|o| o.state) {
            _ if compensated => StepState::Compensated,
            s => StepState::of_operation(s),
        };
        Checkpoint { row, state, operation, compensation, items: Vec::new() }
    }

    /// The checkpoint of a step for each item, given its items: SUCCEEDED once every item
    /// SUCCEEDED, FAILED or UNKNOWN as soon as one is, COMPENSATED once every item whose
    /// effect existed is compensated, EXECUTING while some run, NOT_STARTED before.
    pub fn with_items(row: StepRow, items: Vec<ItemCheckpoint>) -> Self {
        let states: Vec<StepState> = items.iter().map(|i| i.state).collect();
        let any = |s: StepState| states.contains(&s);
        let state = if items.is_empty() {
            StepState::NotStarted
        } else if states.iter().all(|s| *s == StepState::Succeeded) {
            StepState::Succeeded
        } else if any(StepState::Failed) {
            StepState::Failed
        } else if any(StepState::Unknown) {
            StepState::Unknown
        } else if any(StepState::Compensated) && !any(StepState::Succeeded) && !any(StepState::Executing) {
            StepState::Compensated
        } else if any(StepState::Executing) || any(StepState::Succeeded) {
            StepState::Executing
        } else if any(StepState::Pending) {
            StepState::Pending
        } else {
            StepState::NotStarted
        };
        Checkpoint { row, state, operation: None, compensation: None, items }
    }
}

/// Where an instance stands, derived from its checkpoints (in definition order).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Progress {
    /// The last step of the run of SUCCEEDED steps from the start (a COMPENSATED step
    /// counts: it succeeded, then its effect was undone).
    pub last_good_step: Option<String>,
    /// The first step that has not SUCCEEDED (`None` when all have, and for a COMPENSATED
    /// instance: nothing is current any more).
    pub current_step: Option<String>,
}

impl Progress {
    /// The progress of an instance in `state` with checkpoints in definition order.
    pub fn of(state: InstanceState, checkpoints: &[Checkpoint]) -> Self {
        let mut p = Progress::default();
        for c in checkpoints {
            if matches!(c.state, StepState::Succeeded | StepState::Compensated) {
                p.last_good_step = Some(c.row.step.clone());
            } else {
                p.current_step = (state != InstanceState::Compensated).then(|| c.row.step.clone());
                break;
            }
        }
        p
    }
}

/// The document step inputs are built from (see [`super::input`]): the instance input,
/// its identity, and the results of the steps that SUCCEEDED.
pub fn input_context(inst: &InstanceRecord, checkpoints: &[Checkpoint]) -> Value {
    let mut steps = Map::new();
    for c in checkpoints {
        // A step whose outcome is UNKNOWN is there too (its result null): a compensation may
        // have to undo an effect that may exist (policy `compensate`).
        if !c.items.is_empty() {
            // A step for each item: its result maps each item's identity to its result.
            let done = c.items.iter().filter_map(|i| {
                let op = i.operation.as_ref().filter(|o| o.state == crate::State::Succeeded)?;
                Some((i.row.item.clone(), op.result.clone().unwrap_or(Value::Null)))
            });
            steps.insert(c.row.step.clone(), json!({"result": Map::from_iter(done), "provider_ref": null}));
            continue;
        }
        if let Some(op) =
            c.operation.as_ref().filter(|o| matches!(o.state, crate::State::Succeeded | crate::State::Unknown))
        {
            steps.insert(
                c.row.step.clone(),
                json!({"result": op.result.clone().unwrap_or(Value::Null), "provider_ref": op.provider_ref}),
            );
        }
    }
    json!({
        "input": inst.input,
        "instance": {"id": inst.instance_id, "workflow": inst.workflow, "source_event": inst.source_event},
        "steps": steps,
    })
}

impl InstanceRecord {
    /// Whether the instance compensates: COMPENSATING, or PAUSED by its compensation (the
    /// pause's class begins `compensation_`). Nothing new is performed for such an instance:
    /// an effect started now would only be undone, or could not be. A pause taken by the
    /// forward run is not this, even after a compensation's operation exists; the engine's
    /// plan tells those apart with the checkpoints
    /// ([`paused_in_compensation`](super::paused_in_compensation)).
    pub fn compensates(&self) -> bool {
        self.state == InstanceState::Compensating
            || (self.state == InstanceState::Paused
                && self.error_class.as_deref().is_some_and(|c| c.starts_with("compensation_")))
    }

    /// Sets `expires_at` on an instance that just became final (SUCCEEDED, FAILED,
    /// COMPENSATED): `completed_at` + the default retention (DESIGN.md §6); never on
    /// another state. Its step operations are kept while the instance is (the operation
    /// sweeper skips operations that belong to a step).
    pub fn apply_retention(&mut self, r: &Retention) {
        self.expires_at = match (self.state.is_final(), self.completed_at) {
            (true, Some(done)) => r.default_ms.map(|ms| done.saturating_add(ms)),
            _ => None,
        };
    }
}

/// What is left of a removed final instance: enough to answer a late start with 410.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InstanceTombstone {
    /// Tenant.
    pub tenant: String,
    /// SHA-256 hex of the instance id.
    pub id_hash: String,
    /// Input fingerprint.
    pub input_fingerprint: String,
    /// The final state.
    pub final_state: InstanceState,
    /// When it finished.
    pub completed_at: i64,
    /// When the tombstone goes.
    pub expires_at: i64,
}

impl InstanceTombstone {
    /// The tombstone of a final instance: kept until `completed_at` + the tombstone window
    /// (never shorter than the retention).
    pub fn of(rec: &InstanceRecord, r: &Retention) -> Self {
        let done = rec.completed_at.unwrap_or(rec.updated_at);
        InstanceTombstone {
            tenant: rec.tenant.clone(),
            id_hash: crate::retention::key_hash(&rec.instance_id),
            input_fingerprint: rec.input_fingerprint.clone(),
            final_state: rec.state,
            completed_at: done,
            expires_at: done.saturating_add(r.default_ms.unwrap_or(0).max(r.tombstone_ms)),
        }
    }
}

/// The kinds of instance events.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InstanceEventKind {
    /// The instance was created (RUNNING).
    Started,
    /// A start with the same input found the instance (200).
    StartReplayed,
    /// A start with another input or definition found the instance (422).
    StartMismatch,
    /// The instance paused for a person.
    Paused,
    /// A paused instance runs again (its step was resolved).
    Resumed,
    /// Every step SUCCEEDED.
    Succeeded,
    /// A step failed finally, or its input could not be built.
    Failed,
    /// Compensation began: the compensations of succeeded steps run in reverse order.
    Compensating,
    /// Every compensation needed SUCCEEDED.
    Compensated,
    /// An operator re-ran the instance (its plan, reason and the steps redone).
    Rerun,
}

impl InstanceEventKind {
    /// The stored name.
    pub fn as_str(self) -> &'static str {
        match self {
            InstanceEventKind::Started => "started",
            InstanceEventKind::StartReplayed => "start_replayed",
            InstanceEventKind::StartMismatch => "start_mismatch",
            InstanceEventKind::Paused => "paused",
            InstanceEventKind::Resumed => "resumed",
            InstanceEventKind::Succeeded => "succeeded",
            InstanceEventKind::Failed => "failed",
            InstanceEventKind::Compensating => "compensating",
            InstanceEventKind::Compensated => "compensated",
            InstanceEventKind::Rerun => "rerun",
        }
    }
}

/// One row of an instance's append-only event log.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InstanceEvent {
    /// Position in the log, assigned by the store.
    pub seq: i64,
    /// Tenant.
    pub tenant: String,
    /// Instance id.
    pub instance_id: String,
    /// When (epoch ms).
    pub at: i64,
    /// What happened ([`InstanceEventKind::as_str`]).
    pub kind: String,
    /// Who caused it (`system` for idem's own runner).
    pub principal: String,
    /// The request that caused it, if any.
    pub request_id: Option<String>,
    /// State before (`None` for the start).
    pub from_state: Option<InstanceState>,
    /// State after.
    pub to_state: Option<InstanceState>,
    /// The step concerned, if any.
    pub step: Option<String>,
    /// Why, in words.
    pub reason: Option<String>,
}

impl InstanceEvent {
    /// A blank event of `kind` for `inst`, stamped with `actor`, `seq` 0 until stored.
    pub fn new(actor: &Actor, inst: &InstanceRecord, kind: InstanceEventKind, at: i64) -> Self {
        InstanceEvent {
            seq: 0,
            tenant: inst.tenant.clone(),
            instance_id: inst.instance_id.clone(),
            at,
            kind: kind.as_str().into(),
            principal: actor.principal.clone(),
            request_id: actor.request_id.clone(),
            from_state: None,
            to_state: Some(inst.state),
            step: None,
            reason: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn derived_keys_fit_an_idempotency_key() {
        let id = "I".repeat(MAX_INSTANCE_ID_LEN);
        let step = "s".repeat(MAX_STEP_NAME_LEN);
        validate_instance_id(&id).unwrap();
        validate_step_name(&step).unwrap();
        let rerun = rerun_key(&id, &step, MAX_RERUNS);
        for key in
            [step_key(&id, &step), compensation_key(&step_key(&id, &step)), compensation_key(&rerun), rerun.clone()]
        {
            IdempotencyKey::parse(&key).unwrap();
        }
        assert_eq!((rerun_number(&rerun), rerun_number(&step_key(&id, &step))), (MAX_RERUNS, 0));
        let again = compensation_rerun_key(&rerun, MAX_RERUNS);
        IdempotencyKey::parse(&again).unwrap();
        assert_eq!((compensation_number(&again), compensation_number(&compensation_key(&rerun))), (MAX_RERUNS, 1));
        assert_eq!(step_key("ORD-7:intake", "create_order"), "ORD-7:intake:create_order");
    }

    #[test]
    fn instance_ids_follow_the_key_rules() {
        assert!(validate_instance_id("ORD-7:intake").is_ok());
        assert!(validate_instance_id("").is_err());
        assert!(validate_instance_id("a/b").is_err());
        assert!(validate_instance_id(&"x".repeat(MAX_INSTANCE_ID_LEN + 1)).is_err());
        let e = validate_instance_id("order-jane.doe@example.com").unwrap_err();
        assert!(e.contains("instance id") && e.contains("e-mail"), "{e}");
        assert!(validate_step_name("a:b").is_err());
        assert!(validate_step_name("compensate").is_err() && validate_step_name("rerun-2").is_err());
        assert!(validate_step_name("compensate-2").is_err(), "an operator's redo of a compensation ends its key so");
        assert!(validate_step_name("compensated_refund").is_err() && validate_step_name("rerun").is_ok());
        let e = validate_instance_id("").unwrap_err();
        assert!(e.contains(&format!("1 to {MAX_INSTANCE_ID_LEN}")), "{e}");
        assert!(validate_workflow_name("order intake").is_err());
    }
}
