//! Request and response bodies of `/v1/workflows` (DESIGN.md §8, §10). Instants are RFC
//! 3339 UTC strings, durations milliseconds named `*_ms`.

use crate::dto::{ErrorView, rfc3339};
use idem_core::flow::{Checkpoint, GroupFailure, InstanceEvent, InstanceRecord, Progress, RecoveryPolicy, StepDef};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::{IntoParams, ToSchema};

/// A step of a workflow your code runs, declared when the instance starts.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct StepDeclBody {
    /// Step name: 1-48 characters of `[A-Za-z0-9_.-]`, unique, not `compensate` or `rerun-…`.
    #[schema(example = "create_order")]
    pub name: String,
    /// Action of the step's operation (1-128 characters of `[A-Za-z0-9_.:-]`; default: the name).
    pub action: Option<String>,
    /// What an UNKNOWN outcome or a dead worker leads to: `manual` (default: the instance
    /// pauses for a person) or `redo_safe` (an expired lease goes to the next worker).
    #[schema(value_type = Option<String>, example = "manual")]
    pub policy: Option<RecoveryPolicy>,
    /// The parallel group the step is a branch of (1-48 characters of `[A-Za-z0-9_.-]`, no
    /// step's name): consecutive steps naming the same group may be acquired at once, and
    /// the step after them only once every branch SUCCEEDED. The branch's operation key is
    /// `{instance}:{group}:{step}`; `{group}:{step}` has at most 48 characters.
    #[schema(example = "notify")]
    pub group: Option<String>,
}

/// Settings of a parallel group of a workflow your code runs, declared when the instance
/// starts (the rules of `[[workflows.NAME.groups]]`).
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct GroupDeclBody {
    /// The group, as its branches' `group` names it.
    #[schema(example = "notify")]
    pub name: String,
    /// What a branch that fails finally, or is UNKNOWN and left to a person, does: `pause`
    /// (default: the instance pauses for a person) or `compensate` (the compensations of the
    /// effects that exist run; the instance FAILS when none has one, as steps your code
    /// runs declare none).
    #[schema(value_type = Option<String>, example = "pause")]
    pub on_failure: Option<GroupFailure>,
    /// Most branches in flight at once, 1-64 (default: all): an acquire that would start
    /// another is refused (409 `previous-step-unfinished`, `Retry-After`), recording nothing.
    #[schema(example = 2)]
    pub max_concurrency: Option<u32>,
}

/// `POST /v1/workflows`: start (or find) an instance.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct StartBody {
    /// Workflow name: a `[workflows.NAME]` of idem's configuration (idem runs it), or any
    /// name with `steps` (your code runs it).
    #[schema(example = "order-intake")]
    pub workflow: String,
    /// Stable business id of the instance (the rules of an idempotency key, at most 180
    /// characters, no `/`): the same id and input are the same instance.
    #[schema(example = "ORD-7:intake")]
    pub instance_id: String,
    /// The instance input (default `null`); its fingerprint (RFC 8785 + SHA-256, strings
    /// NFC-normalized as for payloads) is the input version every step pins.
    #[schema(value_type = Object)]
    pub input: Option<idem_core::Payload>,
    /// The event the instance comes from (e.g. the webhook's event id): 1-255 characters
    /// without spaces or control characters. Kept as first given; not part of the intent.
    #[schema(example = "evt_1PQ7")]
    pub source_event: Option<String>,
    /// Correlation / trace id: 1-128 characters of `[A-Za-z0-9._:-]`.
    pub trace_id: Option<String>,
    /// The steps of a workflow your code runs, in order (1-64); leave out for a declared
    /// workflow.
    pub steps: Option<Vec<StepDeclBody>>,
    /// Settings of the parallel groups the steps name (only with `steps`; a group without
    /// an entry pauses on a failure and runs every branch at once). Part of the instance's
    /// definition: a start again with other settings is another intent (422).
    pub groups: Option<Vec<GroupDeclBody>>,
}

/// `POST /v1/workflows/{instance}/steps/{step}`: acquire a step your code performs.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct StepAcquireBody {
    /// What the step is about to do; its fingerprint binds the step's operation, as a
    /// payload binds an idempotency key. Default `null`.
    #[schema(value_type = Object)]
    pub payload: Option<idem_core::Payload>,
    /// JSON pointers (RFC 6901) of the payload fields that define the intent.
    pub fingerprint_fields: Option<Vec<String>>,
    /// Lease length in ms (100-3600000, default 30000).
    pub lease_ms: Option<i64>,
    /// The attempt's lease holder identity: a UUID generated for this attempt (the rules of
    /// `holder` in `POST /v1/operations`; default none): a resend by the same holder
    /// during its lease gets its grant back instead of 409.
    pub holder: Option<String>,
}

/// One step's checkpoint: its identity and versions, its state, the external result and
/// diagnostics. The state is the step operation's.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct CheckpointView {
    /// Step name.
    pub step: String,
    /// Position (0-based).
    pub position: i64,
    /// Key of the step's operation (`{instance}:{step}`; `{instance}:{group}:{step}` for a
    /// branch of a parallel group): GET `/v1/operations/{key}` for its
    /// full timeline. For a step for each item it is only the prefix of its items' keys
    /// (`{instance}:{step}:{item}`): no operation has it; see `items`.
    pub operation_key: String,
    /// Action of the step.
    pub action: String,
    /// Connector idem performs it with; absent when your code performs it.
    pub connector: Option<String>,
    /// Recovery policy.
    #[schema(example = "lookup_before_redo")]
    pub policy: String,
    /// NOT_STARTED, PENDING, EXECUTING, SUCCEEDED, FAILED, UNKNOWN or COMPENSATED.
    #[schema(example = "SUCCEEDED")]
    pub state: String,
    /// The input version (the instance input's fingerprint) the step ran under.
    pub input_version: String,
    /// The pinned definition version.
    pub definition_version: String,
    /// Attempts granted so far.
    pub attempts: i64,
    /// The provider's reference for the step's effect (the evidence).
    pub provider_ref: Option<String>,
    /// Where the evidence came from: `caller`, `lookup` or `operator`.
    pub evidence_source: Option<String>,
    /// The stored result.
    #[schema(value_type = Option<Object>)]
    pub result: Option<Value>,
    /// The last error.
    pub error: Option<ErrorView>,
    /// Flagged for an operator's review.
    pub needs_review: bool,
    /// When the step's operation was created.
    pub started_at: Option<String>,
    /// Its last change.
    pub updated_at: Option<String>,
    /// When it became final.
    pub completed_at: Option<String>,
    /// Key of the operation that compensates the step (`{operation_key}:compensate`, or
    /// `…:compensate-N` after an operator re-ran a failed compensation).
    pub compensation_key: String,
    /// That operation, once it exists.
    pub compensation: Option<CompensationView>,
    /// The parallel group the step is a branch of (its key is then
    /// `{instance}:{group}:{step}`); absent for a step that runs alone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(example = "notify")]
    pub group: Option<String>,
    /// For a step for each item of a list: its items, in the list's order, each its own
    /// operation (`{instance}:{step}:{item}`); absent for other steps.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub items: Option<Vec<ItemView>>,
}

/// One item of a step for each item.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct ItemView {
    /// The item's identity (the value of the step's `for_each.id` field).
    #[schema(example = "r-17")]
    pub item: String,
    /// Key of the item's operation.
    pub operation_key: String,
    /// NOT_STARTED, PENDING, EXECUTING, SUCCEEDED, FAILED, UNKNOWN or COMPENSATED.
    #[schema(example = "SUCCEEDED")]
    pub state: String,
    /// The provider's reference for the item's effect.
    pub provider_ref: Option<String>,
    /// Attempts granted so far.
    pub attempts: i64,
}

/// A parallel group of an instance: its branches run at once, the step after it waits for
/// all of them. Its state is derived from its branches' (`idem_core::flow::group`).
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct GroupView {
    /// Group name.
    #[schema(example = "notify")]
    pub name: String,
    /// NOT_STARTED, RUNNING, SUCCEEDED, STOPPED (a branch FAILED or is UNKNOWN) or COMPENSATED.
    #[schema(example = "RUNNING")]
    pub state: String,
    /// What a failed or UNKNOWN branch does: `pause` or `compensate`.
    #[schema(example = "pause")]
    pub on_failure: String,
    /// Most branches in flight at once; absent: all.
    pub max_concurrency: Option<u32>,
    /// Its branches (step names), each with its state.
    pub branches: Vec<BranchView>,
}

/// A branch of a parallel group and its state.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct BranchView {
    /// Step name.
    pub step: String,
    /// The branch's state (its operation's; see the step's checkpoint).
    #[schema(example = "SUCCEEDED")]
    pub state: String,
}

/// A step's compensation operation.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct CompensationView {
    /// Its action.
    pub action: String,
    /// PENDING, EXECUTING, SUCCEEDED, FAILED or UNKNOWN.
    pub state: String,
    /// Attempts granted so far.
    pub attempts: i64,
    /// The provider's reference for the compensating effect.
    pub provider_ref: Option<String>,
    /// The last error.
    pub error: Option<ErrorView>,
    /// Flagged for an operator's review.
    pub needs_review: bool,
    /// Its last change.
    pub updated_at: String,
}

impl CheckpointView {
    /// The view of `c`, a step defined by `def`, of `inst`.
    pub fn of(c: &Checkpoint, def: &StepDef, inst: &InstanceRecord) -> Self {
        let op = c.operation.as_ref();
        CheckpointView {
            step: c.row.step.clone(),
            position: c.row.position,
            operation_key: c.row.op_key.clone(),
            action: def.action.clone(),
            connector: def.connector.clone(),
            policy: c.row.policy.as_str().into(),
            state: c.state.as_str().into(),
            input_version: inst.input_fingerprint.clone(),
            definition_version: inst.definition_version.clone(),
            attempts: op.map_or(0, |o| o.attempt_count),
            provider_ref: op.and_then(|o| o.provider_ref.clone()),
            evidence_source: op.and_then(|o| o.evidence_source.clone()),
            result: op.and_then(|o| o.result.clone()),
            error: op
                .filter(|o| o.error_class.is_some() || o.error_message.is_some())
                .map(|o| ErrorView { class: o.error_class.clone(), message: o.error_message.clone() }),
            needs_review: op.is_some_and(|o| o.needs_review),
            started_at: op.map(|o| rfc3339(o.created_at)),
            updated_at: op.map(|o| rfc3339(o.updated_at)),
            completed_at: op.and_then(|o| o.completed_at).map(rfc3339),
            compensation_key: c.row.comp_key.clone(),
            group: def.group.clone(),
            items: def.for_each.as_ref().map(|_| {
                c.items
                    .iter()
                    .map(|i| ItemView {
                        item: i.row.item.clone(),
                        operation_key: i.row.op_key.clone(),
                        state: i.state.as_str().into(),
                        provider_ref: i.operation.as_ref().and_then(|o| o.provider_ref.clone()),
                        attempts: i.operation.as_ref().map_or(0, |o| o.attempt_count),
                    })
                    .collect()
            }),
            compensation: c.compensation.as_ref().map(|k| CompensationView {
                action: k.action.clone(),
                state: k.state.as_str().into(),
                attempts: k.attempt_count,
                provider_ref: k.provider_ref.clone(),
                error: (k.error_class.is_some() || k.error_message.is_some())
                    .then(|| ErrorView { class: k.error_class.clone(), message: k.error_message.clone() }),
                needs_review: k.needs_review,
                updated_at: rfc3339(k.updated_at),
            }),
        }
    }
}

/// One event of an instance's log.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct InstanceEventView {
    /// Position in the log.
    pub seq: i64,
    /// When.
    pub at: String,
    /// `started`, `start_replayed`, `start_mismatch`, `paused`, `resumed`, `succeeded`, `failed`.
    pub kind: String,
    /// Who (`system` for idem's runner).
    pub principal: String,
    /// The request, if any.
    pub request_id: Option<String>,
    /// State before.
    pub from_state: Option<String>,
    /// State after.
    pub to_state: Option<String>,
    /// The step concerned.
    pub step: Option<String>,
    /// Why.
    pub reason: Option<String>,
}

impl InstanceEventView {
    /// The view of `e`.
    pub fn of(e: InstanceEvent) -> Self {
        InstanceEventView {
            seq: e.seq,
            at: rfc3339(e.at),
            kind: e.kind,
            principal: e.principal,
            request_id: e.request_id,
            from_state: e.from_state.map(|s| s.as_str().into()),
            to_state: e.to_state.map(|s| s.as_str().into()),
            step: e.step,
            reason: e.reason,
        }
    }
}

/// A workflow instance.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct InstanceView {
    /// Instance id.
    pub instance_id: String,
    /// Workflow name.
    pub workflow: String,
    /// RUNNING, SUCCEEDED, FAILED, PAUSED, COMPENSATING or COMPENSATED.
    #[schema(example = "RUNNING")]
    pub state: String,
    /// The pinned definition version (SHA-256 hex of its canonical form).
    pub definition_version: String,
    /// The event it came from.
    pub source_event: Option<String>,
    /// The input as first received.
    #[schema(value_type = Object)]
    pub input: Value,
    /// The input's fingerprint: the input version.
    pub input_fingerprint: String,
    /// Trace id.
    pub trace_id: Option<String>,
    /// The last step of the run of SUCCEEDED steps from the start (with `steps`).
    pub last_good_step: Option<String>,
    /// The first step that has not SUCCEEDED (with `steps`).
    pub current_step: Option<String>,
    /// The step that paused or failed the instance.
    pub stopped_step: Option<String>,
    /// Why it paused or failed.
    pub error: Option<ErrorView>,
    /// When idem looks at it next (absent when finished, or waiting for your code).
    pub next_run_at: Option<String>,
    /// Created.
    pub created_at: String,
    /// Last change.
    pub updated_at: String,
    /// When it became final.
    pub completed_at: Option<String>,
    /// When retention removes it.
    pub expires_at: Option<String>,
    /// The checkpoints, in step order (single-instance answers only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub steps: Option<Vec<CheckpointView>>,
    /// Its parallel groups with each branch's state (single-instance answers of a workflow
    /// that has groups only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub groups: Option<Vec<GroupView>>,
    /// The instance's events, oldest first (single-instance answers only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub events: Option<Vec<InstanceEventView>>,
}

impl InstanceView {
    /// The view of `r` without steps or events.
    pub fn of(r: InstanceRecord) -> Self {
        InstanceView {
            error: (r.error_class.is_some() || r.error_message.is_some())
                .then(|| ErrorView { class: r.error_class.clone(), message: r.error_message.clone() }),
            instance_id: r.instance_id,
            workflow: r.workflow,
            state: r.state.as_str().into(),
            definition_version: r.definition_version,
            source_event: r.source_event,
            input: r.input,
            input_fingerprint: r.input_fingerprint,
            trace_id: r.trace_id,
            last_good_step: None,
            current_step: None,
            stopped_step: r.stopped_step,
            next_run_at: r.next_run_at.map(rfc3339),
            created_at: rfc3339(r.created_at),
            updated_at: rfc3339(r.updated_at),
            completed_at: r.completed_at.map(rfc3339),
            expires_at: r.expires_at.map(rfc3339),
            steps: None,
            groups: None,
            events: None,
        }
    }

    /// The full view: checkpoints, progress and events.
    pub fn full(v: idem_flow::InstanceView) -> Self {
        let steps =
            v.checkpoints.iter().zip(&v.definition.steps).map(|(c, d)| CheckpointView::of(c, d, &v.instance)).collect();
        let groups: Vec<GroupView> = idem_core::flow::groups_of(&v.definition, &v.checkpoints)
            .into_iter()
            .map(|(name, state, span)| {
                let settings = v.definition.group_def(&name);
                GroupView {
                    state: state.as_str().into(),
                    on_failure: settings.on_failure.as_str().into(),
                    max_concurrency: settings.max_concurrency,
                    branches: v.checkpoints[span]
                        .iter()
                        .map(|c| BranchView { step: c.row.step.clone(), state: c.state.as_str().into() })
                        .collect(),
                    name,
                }
            })
            .collect();
        let Progress { last_good_step, current_step } = v.progress;
        let mut out = InstanceView::of(v.instance);
        out.groups = (!groups.is_empty()).then_some(groups);
        out.last_good_step = last_good_step;
        out.current_step = current_step;
        out.steps = Some(steps);
        out.events = Some(v.events.into_iter().map(InstanceEventView::of).collect());
        out
    }
}

/// One page of instances.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct InstancePage {
    /// Instances, newest first.
    pub items: Vec<InstanceView>,
    /// Pass as `cursor` for the next page; absent on the last page.
    pub next_cursor: Option<String>,
}

/// `GET /v1/workflows` filters.
#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct InstanceQuery {
    /// Only instances in this state.
    pub state: Option<String>,
    /// Only instances of this workflow.
    pub workflow: Option<String>,
    /// Only instances created at or after this RFC 3339 instant.
    pub created_after: Option<String>,
    /// Only instances created before this RFC 3339 instant.
    pub created_before: Option<String>,
    /// Page size (1-500, default 50).
    pub limit: Option<i64>,
    /// The `next_cursor` of the previous page.
    pub cursor: Option<String>,
}

/// `POST /v1/workflows/{instance}/rerun`: an operator's guarded re-run.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RerunBody {
    /// Why (mandatory, at most 2000 bytes): kept in the instance's events with who asked.
    #[schema(example = "the CRM was down; it is back")]
    pub reason: Option<String>,
    /// Steps to redo although they SUCCEEDED (each a new intent under a new key). Leave out
    /// to continue from where the instance stopped.
    pub steps: Option<Vec<String>>,
    /// Only show the plan; change nothing (default false).
    pub dry_run: Option<bool>,
    /// The `hash` of the plan you approved (from a dry run): refused with 409
    /// `plan-changed` if the plan is another now.
    pub plan_hash: Option<String>,
}

/// `POST /v1/workflows/{instance}/compensate`: an operator asks for compensation.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CompensateBody {
    /// Why (mandatory, at most 2000 bytes): kept in the instance's events with who asked.
    #[schema(example = "the customer cancelled the order")]
    pub reason: Option<String>,
}

/// One step of a re-run plan.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct PlannedStepView {
    /// Step name.
    pub step: String,
    /// The step's state now (its compensation's, for a compensation re-run).
    #[schema(example = "FAILED")]
    pub state: String,
    /// `kept` (its recorded result is reused), `runs` (for the first time), `redone` (a new
    /// side effect, under a new key), `looked_up` (its provider is asked first),
    /// `compensated` (its compensation is redone, under a new key) or `compensation_runs`
    /// (its compensation runs for the first time: a new side effect).
    #[schema(example = "redone")]
    pub disposition: String,
    /// The action performed: the step's, or its compensation's in a compensation re-run.
    #[schema(example = "create_order")]
    pub action: String,
    /// The key of the operation this line acts on: `operation_key`, or
    /// `compensation_key` in a compensation re-run.
    pub key: String,
    /// The operation key the step runs under.
    pub operation_key: String,
    /// The key of its compensation.
    pub compensation_key: String,
    /// The connector that performs it (absent: your code).
    pub connector: Option<String>,
    /// The input it would send (a step or compensation idem redoes or runs), when it is
    /// known now: absent after a redone step, whose new result it is built from when its
    /// turn comes.
    #[schema(value_type = Option<Object>)]
    pub input: Option<Value>,
    /// For a step for each item whose list was read: each item, in the list's order, planned
    /// as a step is (absent for other steps). The step's own line then sums its items up:
    /// its disposition is the strongest of theirs (`redone`, `compensated`, `looked_up`,
    /// `runs`, `kept`), and its keys are only the prefix of its items' keys (no operation
    /// has them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub items: Option<Vec<PlannedItemView>>,
}

/// One item of a step for each item in a re-run plan.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct PlannedItemView {
    /// The item's identity (the value of its step's `for_each.id` field).
    #[schema(example = "r-17")]
    pub item: String,
    /// The item's state now (its compensation's, for a compensation re-run).
    #[schema(example = "FAILED")]
    pub state: String,
    /// As for a step: `kept`, `runs`, `redone` (under `{item key}:rerun-N`), `looked_up`,
    /// `compensated` (under `{item key}:compensate-N`) or `compensation_runs`.
    #[schema(example = "redone")]
    pub disposition: String,
    /// The action performed: the step's, or its compensation's in a compensation re-run.
    pub action: String,
    /// The key of the operation this line acts on: `operation_key`, or `compensation_key`
    /// in a compensation re-run.
    pub key: String,
    /// The operation key the item runs under.
    pub operation_key: String,
    /// The key of its compensation.
    pub compensation_key: String,
    /// The input it would send (an item or compensation idem redoes or runs), when it is
    /// known now.
    #[schema(value_type = Option<Object>)]
    pub input: Option<Value>,
}

/// The wire name of a disposition (`redone`, `looked_up`, …).
fn disposition_name(d: idem_core::flow::StepDisposition) -> String {
    serde_json::to_value(d).ok().and_then(|v| v.as_str().map(str::to_owned)).unwrap_or_default()
}

/// What a re-run does (or did), with the plan's hash.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct RerunView {
    /// True for a dry run: nothing was changed.
    pub dry_run: bool,
    /// SHA-256 hex of the plan: pass it as `plan_hash` to run exactly this plan.
    pub plan_hash: String,
    /// The state the instance goes to: RUNNING, or COMPENSATING (a compensation re-run).
    pub resumes_as: String,
    /// Every step, in order.
    pub steps: Vec<PlannedStepView>,
    /// The instance after the re-run (absent for a dry run).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub instance: Option<InstanceView>,
}

impl RerunView {
    /// The view of `plan`, with the instance it left (none: a dry run).
    pub fn of(plan: idem_core::flow::RerunPlan, instance: Option<InstanceRecord>) -> Self {
        RerunView {
            dry_run: instance.is_none(),
            plan_hash: plan.hash,
            resumes_as: plan.resumes_as.as_str().into(),
            steps: plan
                .steps
                .into_iter()
                .map(|s| PlannedStepView {
                    step: s.step,
                    state: s.state.as_str().into(),
                    disposition: disposition_name(s.disposition),
                    action: s.action,
                    key: s.key,
                    operation_key: s.op_key,
                    compensation_key: s.comp_key,
                    connector: s.connector,
                    input: s.input,
                    items: (!s.items.is_empty()).then(|| {
                        s.items
                            .into_iter()
                            .map(|i| PlannedItemView {
                                item: i.item,
                                state: i.state.as_str().into(),
                                disposition: disposition_name(i.disposition),
                                action: i.action,
                                key: i.key,
                                operation_key: i.op_key,
                                compensation_key: i.comp_key,
                                input: i.input,
                            })
                            .collect()
                    }),
                })
                .collect(),
            instance: instance.map(InstanceView::of),
        }
    }
}
