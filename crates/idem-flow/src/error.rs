//! [`FlowError`]: why a workflow call was refused or failed. Refusals of the caller's
//! request are their own variants (each maps to one problem type over HTTP); storage
//! failures are [`FlowError::Store`]; a pinned definition that does not match its step
//! rows is corruption ([`FlowError::DefinitionMismatch`]), never a state change.

use idem_core::flow::{InstanceState, StepState};
use idem_store::StoreError;

/// A refused or failed workflow call.
#[derive(Debug, thiserror::Error)]
pub enum FlowError {
    /// The store failed (or refused a completion: stale token, …).
    #[error(transparent)]
    Store(#[from] StoreError),
    /// A malformed request: the message says what to fix.
    #[error("{0}")]
    Invalid(String),
    /// The request's definition (steps) cannot run.
    #[error("{0}")]
    Definition(#[from] idem_core::flow::DefinitionError),
    /// No workflow of that name is declared, and the request gave no steps.
    #[error(
        "no workflow named {0:?} is declared in idem's configuration; declare it under [workflows.{0}], or send \"steps\" to run it from your code"
    )]
    UnknownWorkflow(String),
    /// The request gave steps (or group settings) for a workflow idem's configuration
    /// declares.
    #[error(
        "workflow {0:?} is declared in idem's configuration, which defines its steps and groups; leave out \"steps\" and \"groups\""
    )]
    DeclaredWorkflow(String),
    /// The declared workflow does not serve the caller's tenant (`tenants = [...]`).
    #[error(
        "workflow {workflow:?} does not serve tenant {tenant:?} (it serves {tenants}; workflows.{workflow}.tenants in idem's configuration); nothing was written"
    )]
    WorkflowNotAllowed {
        /// The workflow.
        workflow: String,
        /// The caller's tenant.
        tenant: String,
        /// The tenants it serves, as configured.
        tenants: String,
    },
    /// No such instance (or another tenant's).
    #[error("no workflow instance {0:?}")]
    InstanceNotFound(String),
    /// The instance finished and was removed after its retention window; its tombstone
    /// remembers it (410).
    #[error(
        "workflow instance {instance:?} finished ({state}) and was removed after its retention window: nothing runs again"
    )]
    Late {
        /// The instance id.
        instance: String,
        /// Its final state.
        state: InstanceState,
    },
    /// The instance's definition has no such step.
    #[error("workflow instance {instance:?} has no step {step:?} (its steps: {steps})")]
    UnknownStep {
        /// The instance id.
        instance: String,
        /// The step asked for.
        step: String,
        /// The steps it has, comma-separated.
        steps: String,
    },
    /// The step is performed by idem with a connector, not by the caller.
    #[error("step {step:?} is performed by idem with connector {connector:?}; your code cannot acquire it")]
    IdemPerforms {
        /// The step.
        step: String,
        /// Its connector.
        connector: String,
    },
    /// An earlier step has not succeeded yet: steps run in order.
    #[error("step {step:?} cannot start before step {before:?} succeeded (it is {state})")]
    PreviousStepUnfinished {
        /// The step asked for.
        step: String,
        /// The earlier step.
        before: String,
        /// Its state.
        state: StepState,
    },
    /// A branch your code performs cannot start yet: its group already has
    /// `max_concurrency` branches in flight. Nothing was recorded; retry once one finished
    /// (`retry_after_ms`). Over HTTP the same answer as an unfinished earlier step (409
    /// `previous-step-unfinished`, with `Retry-After`).
    #[error(
        "step {step:?} cannot start yet: group {group:?} runs at most {max} branch(es) at once (max_concurrency) and {in_flight} in flight; nothing was recorded, retry after {retry_after_ms} ms"
    )]
    GroupFull {
        /// The step asked for.
        step: String,
        /// Its group.
        group: String,
        /// The group's `max_concurrency`.
        max: u32,
        /// The branches in flight, comma-separated.
        in_flight: String,
        /// When to retry (ms from now, at least 1): when the first of their leases ends.
        retry_after_ms: i64,
    },
    /// The instance does not run (PAUSED, FAILED, …): no new step may start.
    #[error("workflow instance {instance:?} is {state}: no step may start")]
    NotRunning {
        /// The instance id.
        instance: String,
        /// Its state.
        state: InstanceState,
    },
    /// The pinned definition of a stored instance is missing: corruption.
    #[error("workflow instance {instance:?}: its pinned definition {version} is missing")]
    DefinitionMissing {
        /// The instance id.
        instance: String,
        /// The version.
        version: String,
    },
    /// The step rows of an instance do not match its pinned definition: corruption.
    #[error(transparent)]
    DefinitionMismatch(#[from] idem_core::flow::plan::DefinitionMismatch),
    /// An operator's re-run is refused (nothing changed).
    #[error(transparent)]
    Rerun(#[from] idem_core::flow::RerunRefusal),
    /// An operator's request to compensate is refused (nothing changed).
    #[error(transparent)]
    Compensation(#[from] idem_core::flow::CompensationRefusal),
    /// The instance kept changing under an operator's request (other writers won every
    /// conditional write): nothing was changed by it; look at the instance again (409).
    #[error("workflow instance {0:?} kept changing under the request: nothing was changed by it; look at it again")]
    Busy(String),
    /// A step's key holds an operation not made for it (another action or connector,
    /// created through `/v1/operations`): it never counts as the step's result (409); a
    /// re-run performs the step under a new key.
    #[error(
        "step {step:?} cannot start: the key {key:?} of step {before:?} holds an operation not made for it (action {action:?}); re-run the instance to perform {before:?} under a new key"
    )]
    StepKeyConflict {
        /// The step asked for.
        step: String,
        /// The step whose key is taken.
        before: String,
        /// Its key.
        key: String,
        /// The action of the operation under it.
        action: String,
    },
    /// An operator's action without a reason (it is mandatory and audited).
    #[error("a reason is mandatory: it is kept in the instance's events with who asked")]
    MissingReason,
}
