//! idem-flow: workflows — the engine that runs instances step by step from their
//! checkpoints (DESIGN.md §8).
//!
//! - [`config`]: `[workflows.NAME]` → validated definitions.
//! - [`start`]: [`Flows::start`] — validate, pin the definition, start (idempotent by
//!   instance id and input), and kick the engine.
//! - [`engine`]: [`Flows::advance`] — one pass for one instance: read → idem-core's
//!   `plan_advance` → perform that one step (through the same atomic claim as any
//!   trigger) → write → plan again. The only place a plan turns into I/O.
//! - [`driven`]: the code-driven mode — a worker in any language acquires and completes the
//!   steps idem has no connector for; finished steps replay.
//! - [`operator`]: guarded re-runs (dry run, plan hash, reason) and compensation on request.
//! - [`runner`]: the durable loop over due instances (start-up recovery included).
//! - [`error`] — [`FlowError`], why a workflow call was refused or failed.
//!
//! Must not: write SQL (idem-store does), or decide anything (idem-core's `flow` plans
//! do). Steps are ordinary operations: their retries, reconciliation and review are the
//! ledger's own (idem-connect's executor and reconciler work on them too).

pub mod config;
pub mod driven;
pub mod engine;
pub mod error;
pub mod operator;
pub mod runner;
pub mod start;

pub use error::FlowError;

use idem_connect::{Executor, Reconciler, Registry};
use idem_core::Clock;
use idem_core::flow::{Checkpoint, Definition, InstanceEvent, InstanceRecord, Progress};
use idem_store::Store;
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

/// The workflows of one node: the declared definitions, and the engine over the store.
pub struct Flows {
    store: Arc<dyn Store>,
    executor: Arc<Executor>,
    reconciler: Arc<Reconciler>,
    registry: Arc<Registry>,
    clock: Arc<dyn Clock>,
    declared: BTreeMap<String, Arc<Definition>>,
    /// The version (`Definition::version`, a SHA-256 of its canonical JSON) of each declared
    /// workflow, computed once: a start pins it without hashing the definition again.
    versions: BTreeMap<String, String>,
    /// Who may start each declared workflow.
    tenants: BTreeMap<String, idem_connect::tenants::TenantScope>,
    /// Pinned definitions read back from the store, by (tenant, name, version): they never
    /// change once written.
    pinned: Mutex<HashMap<(String, String, String), Arc<Definition>>>,
    /// Serializes, per instance (striped by a hash of tenant and instance id), the check
    /// and the acquire of a branch your code performs in a group with `max_concurrency`,
    /// so that concurrent acquires on this node admit at most that many.
    admission: Vec<tokio::sync::Mutex<()>>,
    /// This value itself, for passes started in the background.
    me: std::sync::Weak<Flows>,
    /// How long a start holds a new instance whose first pass it runs (ms; 0 until
    /// [`Flows::spawn_runner`] sets its hold): see [`idem_core::flow::StartInput::hold_ms`].
    start_hold_ms: std::sync::atomic::AtomicI64,
}

/// Stripes of [`Flows`]' admission locks.
const ADMISSION_STRIPES: usize = 64;

/// Most pinned definitions kept in memory (a full cache starts over).
const PINNED_ENTRIES: usize = 1024;

/// Everything known about one instance, for the API and the admin page.
#[derive(Debug, Clone)]
pub struct InstanceView {
    /// The instance.
    pub instance: InstanceRecord,
    /// Its pinned definition.
    pub definition: Arc<Definition>,
    /// Its checkpoints, in step order.
    pub checkpoints: Vec<Checkpoint>,
    /// Last good step and current step.
    pub progress: Progress,
    /// Its events, oldest first.
    pub events: Vec<InstanceEvent>,
}

impl Flows {
    /// The workflows of `declared` (validated against `registry` by [`config::definitions`])
    /// over `store`, performing connector steps with `executor`; an operator's re-run looks
    /// steps up with `reconciler`.
    pub fn new(
        store: Arc<dyn Store>,
        executor: Arc<Executor>,
        reconciler: Arc<Reconciler>,
        registry: Arc<Registry>,
        clock: Arc<dyn Clock>,
        declared: BTreeMap<String, config::Declared>,
    ) -> Arc<Self> {
        let tenants = declared.iter().map(|(k, v)| (k.clone(), v.tenants.clone())).collect();
        let declared: BTreeMap<String, Arc<Definition>> =
            declared.into_iter().map(|(k, v)| (k, Arc::new(v.definition))).collect();
        let versions = declared.iter().map(|(k, d)| (k.clone(), d.version())).collect();
        Arc::new_cyclic(|me| Flows {
            store,
            executor,
            reconciler,
            registry,
            clock,
            declared,
            versions,
            tenants,
            pinned: Mutex::new(HashMap::new()),
            admission: (0..ADMISSION_STRIPES).map(|_| tokio::sync::Mutex::new(())).collect(),
            me: me.clone(),
            start_hold_ms: std::sync::atomic::AtomicI64::new(0),
        })
    }

    /// The declared workflows, by name.
    pub fn declared(&self) -> &BTreeMap<String, Arc<Definition>> {
        &self.declared
    }

    /// Whether idem performs any step of declared workflow `name` (it has a connector step).
    pub fn performs_steps(&self, name: &str) -> bool {
        self.declared.get(name).is_some_and(|d| d.steps.iter().any(|s| s.connector.is_some()))
    }

    /// The store.
    pub fn store(&self) -> &Arc<dyn Store> {
        &self.store
    }

    /// The definition `inst` pinned.
    ///
    /// # Errors
    /// [`FlowError::DefinitionMissing`] if the store lost it (corruption), or a store error.
    pub async fn pinned(&self, inst: &InstanceRecord) -> Result<Arc<Definition>, FlowError> {
        let key = (inst.tenant.clone(), inst.workflow.clone(), inst.definition_version.clone());
        if let Some(d) = self.pinned.lock().expect("pinned definitions").get(&key) {
            return Ok(d.clone());
        }
        let def =
            self.store.flows().definition(&inst.tenant, &inst.workflow, &inst.definition_version).await?.ok_or_else(
                || FlowError::DefinitionMissing {
                    instance: inst.instance_id.clone(),
                    version: inst.definition_version.clone(),
                },
            )?;
        let def = Arc::new(def);
        let mut cache = self.pinned.lock().expect("pinned definitions");
        if cache.len() >= PINNED_ENTRIES {
            cache.clear();
        }
        cache.insert(key, def.clone());
        Ok(def)
    }

    /// The instance with its definition, checkpoints, progress and events; `None` if there
    /// is no such instance in `tenant`.
    ///
    /// # Errors
    /// Store errors; [`FlowError::DefinitionMissing`].
    pub async fn view(&self, tenant: &str, instance_id: &str) -> Result<Option<InstanceView>, FlowError> {
        let flows = self.store.flows();
        let Some(instance) = flows.instance(tenant, instance_id).await? else {
            return Ok(None);
        };
        let definition = self.pinned(&instance).await?;
        let mut checkpoints = flows.checkpoints(tenant, instance_id).await?;
        // A step for each item whose list was empty shows SUCCEEDED once the instance moved
        // past it (it has no operation to show it by).
        idem_core::flow::settle_empty_lists(&instance, &definition, &mut checkpoints);
        let events = flows.instance_events(tenant, instance_id).await?;
        let progress = Progress::of(instance.state, &checkpoints);
        Ok(Some(InstanceView { instance, definition, checkpoints, progress, events }))
    }
}

impl std::fmt::Debug for Flows {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Flows").field("declared", &self.declared.keys().collect::<Vec<_>>()).finish_non_exhaustive()
    }
}
