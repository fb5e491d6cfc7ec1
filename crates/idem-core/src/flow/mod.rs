//! Workflows (DESIGN.md §8): the pure half. No I/O, no clock reads, no randomness.
//!
//! A **workflow instance** is one run of a named [`Definition`] under a stable business id
//! (`ORD-7:intake`), with the event it came from, an input and its fingerprint, and the
//! definition version it was started with (pinned: nothing changes it later). Its steps
//! run in order, except the branches of a parallel group, which run at once (see [`group`]).
//! Each **step** is an ordinary operation of the ledger whose idempotency key
//! is derived from the instance ([`step_key`]: `{instance}:{step}`), so every guarantee of
//! an operation holds per step: atomic claim, lease and fencing token, evidence, UNKNOWN,
//! reconciliation, replay.
//!
//! **Checkpoints are derived, never copied.** A step's state *is* its operation's state.
//! The store keeps per step only what the operation record lacks (name, position, the
//! operation key); the [`Checkpoint`] a resuming worker reads is that row joined with the
//! operation record and the instance's input and definition versions. A checkpoint and the
//! step's state therefore cannot disagree, even after a crash between two writes.
//!
//! ```text
//! instance:   (new) ─► RUNNING ─► SUCCEEDED                  every step SUCCEEDED
//!                         │  ├──► FAILED                     a step FAILED (final), or its
//!                         │  │                               input could not be built
//!                         │  └──► PAUSED ─► RUNNING          a step needs a person; resumes
//!                         │                                  once the step is resolved
//!                         └─────► COMPENSATING ─► COMPENSATED | PAUSED   (compensation)
//! step:       NOT_STARTED ─► EXECUTING ─► SUCCEEDED | FAILED | PENDING | UNKNOWN
//!             (the operation's states; SUCCEEDED ─► COMPENSATED by its compensation)
//! ```
//!
//! - [`state`]: [`InstanceState`], [`StepState`] and their legal moves.
//! - [`definition`]: [`Definition`], [`StepDef`], [`RecoveryPolicy`]; validation and the
//!   pinned version.
//! - [`input`]: building a step's input from the instance input and earlier results.
//! - [`record`]: [`InstanceRecord`], [`StepRow`], [`Checkpoint`], [`InstanceEvent`], and the
//!   derived operation keys.
//! - [`plan`]: [`plan_start`] (new, same, mismatch, late) and [`plan_advance`] (the next
//!   thing to do for an instance), [`plan_instance_update`] (the instance write for it).
//! - [`group`]: parallel groups — branches that run at once, the join, what a failed
//!   branch does ([`GroupState`], its table).
//! - [`items`]: a step for each item of a list — each item its own operation, keyed by
//!   its identity.
//! - [`recovery`]: [`plan_recovery`], the per-policy answer for a step whose outcome is
//!   UNKNOWN or whose worker died.
//! - [`rerun`]: guarded operator re-runs: [`plan_rerun`] (the dry run, with a plan hash)
//!   and [`plan_rerun_apply`].
//!
//! Compensation is part of [`plan_advance`]: a step that fails finally (or is UNKNOWN
//! under the `compensate` policy) turns the instance COMPENSATING, and the compensations of
//! the steps whose effects may exist run last first, each as its own operation
//! (`{op_key}:compensate`, see [`compensation_key`]); COMPENSATED when all succeeded, PAUSED
//! when one fails finally or waits for a person.

pub mod definition;
pub mod group;
pub mod input;
pub mod items;
pub mod plan;
pub mod record;
pub mod recovery;
pub mod rerun;
pub mod state;

#[cfg(test)]
mod canned;

pub use definition::{
    CompensationDef, Definition, DefinitionError, ForEachDef, GroupDef, GroupFailure, RecoveryPolicy, StepDef,
};
pub use group::{GroupFull, GroupState, admit_branch, groups_of};
pub use input::{InputError, build_step_input};
pub use items::{plan_items, settle_empty_lists};
pub use plan::{
    CompensationRefusal, Next, StartDecision, StartInput, StartPlan, needs_compensation, plan_advance,
    plan_instance_update, plan_operator_compensation, plan_start,
};
pub use record::{
    Checkpoint, InstanceEvent, InstanceEventKind, InstanceRecord, InstanceTombstone, ItemCheckpoint, ItemRow, Progress,
    StepRow, compensation_key, compensation_rerun_key, item_key, rerun_key, step_fingerprint, step_key,
    validate_instance_id, validate_step_name, validate_workflow_name,
};
pub use recovery::{Recovery, plan_recovery};
pub use rerun::{
    PlannedItem, PlannedStep, RerunPlan, RerunRefusal, StepDisposition, Superseded, plan_rerun, plan_rerun_apply,
    plan_superseded,
};
pub use state::{InstanceState, StepState};
