//! Where workflow instances, their step rows, definitions and events live
//! ([`WorkflowStore`], implemented by both stores; cases in `conformance::flow`).
//!
//! The store decides nothing here either: a start goes through idem-core's
//! `plan_start`, an instance change is the record idem-core's `plan_instance_update`
//! returned, written only if the stored version is still the one read. A step's state is
//! never written here: it is its operation's, read through the join in
//! [`WorkflowStore::checkpoints`].

use crate::StoreError;
use async_trait::async_trait;
use idem_core::flow::{
    Checkpoint, Definition, InstanceEvent, InstanceRecord, InstanceState, InstanceTombstone, StartDecision, StartInput,
    StepRow,
};

/// A start to apply: the validated input and the definition the instance would pin (kept
/// under its version, once per tenant, if the instance is new).
#[derive(Debug, Clone)]
pub struct StartRequest {
    /// The start.
    pub input: StartInput,
    /// The definition whose version `input.definition_version` is.
    pub definition: Definition,
}

/// The answer to a start.
#[derive(Debug, Clone)]
pub struct StartOutcome {
    /// What the start gets.
    pub decision: StartDecision,
    /// The instance as it stands (a view of the tombstone for a late start).
    pub instance: InstanceRecord,
}

/// Filters of [`WorkflowStore::list_instances`]; `None` means "any".
#[derive(Debug, Clone, Default)]
pub struct InstanceFilter {
    /// Only instances in this state.
    pub state: Option<InstanceState>,
    /// Only instances of this workflow.
    pub workflow: Option<String>,
    /// Only instances created at or after this instant (epoch ms).
    pub created_from: Option<i64>,
    /// Only instances created before this instant (epoch ms).
    pub created_before: Option<i64>,
    /// Page size, clamped to 1..=[`crate::MAX_PAGE`].
    pub limit: i64,
    /// Continue after this `(created_at, instance_id)` (from [`InstancePage::next_cursor`]).
    pub cursor: Option<(i64, String)>,
}

/// One page of instances, newest first.
#[derive(Debug, Clone)]
pub struct InstancePage {
    /// The instances.
    pub items: Vec<InstanceRecord>,
    /// Where the next page starts; `None` on the last page.
    pub next_cursor: Option<(i64, String)>,
}

/// A conditional instance write: `record` (from `plan_instance_update`) replaces the
/// stored instance if its version is still `read_version`; `events` are appended with it.
#[derive(Debug, Clone)]
pub struct InstanceUpdate {
    /// The instance to write (its version already bumped).
    pub record: InstanceRecord,
    /// The version it was planned from.
    pub read_version: i64,
    /// Events to append in the same transaction.
    pub events: Vec<InstanceEvent>,
}

/// An operator's re-run as [`WorkflowStore::apply_rerun`] writes it.
#[derive(Debug, Clone)]
pub struct RerunWrite {
    /// The instance (idem-core `plan_rerun_apply`) and its audit event.
    pub update: InstanceUpdate,
    /// Step rows pointed at new keys: `(position, op_key, comp_key)`.
    pub keys: Vec<(i64, String, String)>,
    /// Item rows (of a step for each item) pointed at new keys: `(position of the step,
    /// item identity, op_key, comp_key)` — an item redone under `{item key}:rerun-N`, or
    /// its compensation redone under `…:compensate-N`.
    pub item_keys: Vec<(i64, String, String, String)>,
    /// Operations the re-run closes (idem-core `plan_superseded`): `(record, read
    /// version, event)`.
    pub superseded: Vec<idem_core::flow::Superseded>,
}

/// Workflow storage. Every method is scoped to a tenant where it touches instances; an
/// instance of another tenant behaves exactly like a missing one.
#[async_trait]
pub trait WorkflowStore: Send + Sync {
    /// Applies a start atomically (idem-core `plan_start`): a new instance is written with
    /// its definition (if that version is new for the tenant), one step row per step and
    /// its `started` event, all in one transaction; a repeated start only appends its
    /// event; a late one writes nothing.
    async fn start_instance(&self, req: StartRequest) -> Result<StartOutcome, StoreError>;

    /// The instance, or `None`.
    async fn instance(&self, tenant: &str, instance_id: &str) -> Result<Option<InstanceRecord>, StoreError>;

    /// The instance's checkpoints in step order: each step row joined with its operation
    /// record (if the operation exists), read in one statement.
    async fn checkpoints(&self, tenant: &str, instance_id: &str) -> Result<Vec<Checkpoint>, StoreError>;

    /// Writes the items of a step for each item (idem-core `plan_items`), in one
    /// transaction; an item already written is kept as it is.
    async fn add_items(&self, items: Vec<idem_core::flow::ItemRow>) -> Result<(), StoreError>;

    /// A definition the tenant's instances pinned, by name and version.
    async fn definition(&self, tenant: &str, name: &str, version: &str) -> Result<Option<Definition>, StoreError>;

    /// The instance's events, oldest first.
    async fn instance_events(&self, tenant: &str, instance_id: &str) -> Result<Vec<InstanceEvent>, StoreError>;

    /// Instances of `tenant` matching `filter`, newest first.
    async fn list_instances(&self, tenant: &str, filter: &InstanceFilter) -> Result<InstancePage, StoreError>;

    /// Writes `update` if the stored version is still `read_version`, applying the
    /// retention window when the instance became final; true if written.
    async fn update_instance(&self, update: InstanceUpdate) -> Result<bool, StoreError>;

    /// Applies an operator's re-run ([`RerunWrite`]) in one transaction: the instance
    /// (conditional on the version it was planned from, with its audit event), the step and
    /// item rows pointed at their new keys, and the operations it closes (each conditional on its
    /// version); true if written, false (nothing written) if anything changed since it was
    /// read.
    async fn apply_rerun(&self, write: RerunWrite) -> Result<bool, StoreError>;

    /// Claims up to `limit` instances whose `next_run_at` has come, across tenants, oldest
    /// first, by moving their `next_run_at` `hold_ms` into the future (so no other runner
    /// takes them meanwhile; a runner that dies lets the hold run out). Returns them as
    /// stored after the claim.
    async fn claim_due_instances(&self, limit: i64, hold_ms: i64) -> Result<Vec<InstanceRecord>, StoreError>;

    /// The step an operation key belongs to (for an item of a step for each item: its step,
    /// with the item's keys), if any.
    async fn step_of_operation(&self, tenant: &str, op_key: &str) -> Result<Option<StepRow>, StoreError>;

    /// The live tombstone of a removed instance, if any.
    async fn instance_tombstone(
        &self,
        tenant: &str,
        instance_id: &str,
    ) -> Result<Option<InstanceTombstone>, StoreError>;

    /// How many instances are in each state, of `tenant` (all tenants when `None`, for
    /// metrics). A scan of the instances: for pages and scrapes, not the hot path.
    async fn count_instances(&self, tenant: Option<&str>) -> Result<Vec<(InstanceState, i64)>, StoreError>;

    /// Removes up to `limit` final instances past their retention (with their step rows
    /// and events), leaving a tombstone each, and up to `limit` expired tombstones. Their
    /// step operations become sweepable by [`crate::Store::sweep`]. Returns how many
    /// instances were removed.
    async fn sweep_instances(&self, limit: i64) -> Result<u64, StoreError>;
}
