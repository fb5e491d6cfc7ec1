//! Property test of workflows (DESIGN.md §8): random interleavings of engine passes whose
//! calls succeed, fail, time out or crash (before or after the provider acted), slow
//! workers that report late, reconciliation lookups, lease expiries, truthful operators
//! who resolve, re-run (naming random steps) and ask for compensation — all through the
//! pure plans the engine and the stores use. After every step:
//! - at most one effect per operation key at a provider that does not deduplicate (a step,
//!   or a compensation: each compensation runs at most once);
//! - nothing is SUCCEEDED without its effect (evidence is never invented);
//! - a step has effects under two keys only if an applied re-run named it;
//! - the instance keeps its pinned definition version.
//!
//! At the end, with calls that now succeed and truthful operators, every instance reaches
//! SUCCEEDED, FAILED or COMPENSATED: no instance is left RUNNING with nothing due.
//!
//! A second model runs `reserve` and `charge` as branches of a parallel group (at most two
//! in flight, `on_failure` either way) before a fourth step `notify`: the step after the
//! join never starts before every branch SUCCEEDED.
//!
//! The model: three steps — `create_order` (a provider with a lookup, `lookup_before_redo`,
//! compensated by `cancel_order` on it), `reserve` (no lookup, `manual`, compensated by
//! `release` on a provider without a lookup), `charge` (`redo_safe`: its provider
//! deduplicates by key, as the policy requires). Workers are honest: a success is reported
//! only after the effect, a failure only without one.

use idem_core::flow::{
    Checkpoint, Definition, InstanceRecord, InstanceState, Next, RecoveryPolicy, StartInput, StepDisposition, StepRow,
    compensation_key, plan_advance, plan_instance_update, plan_operator_compensation, plan_rerun, plan_rerun_apply,
    plan_start, step_key,
};
use idem_core::{
    AcquireInput, Actor, Decision, Lookup, OperationRecord, Outcome, RetryPolicy, State, plan_acquire, plan_completion,
    plan_lease_expiry, plan_reconciliation, plan_resolution,
};
use proptest::prelude::*;
use serde_json::json;
use std::collections::{HashMap, HashSet};

const LEASE_MS: i64 = 100;
const ID: &str = "ORD-P";

fn def() -> Definition {
    serde_json::from_value(json!({
        "name": "prop",
        "steps": [
            {"name": "create_order", "action": "create_order", "connector": "erp", "policy": "lookup_before_redo",
             "compensation": {"action": "cancel_order", "connector": "erp"}},
            {"name": "reserve", "action": "reserve", "connector": "stock", "policy": "manual",
             "compensation": {"action": "release", "connector": "stock"}},
            {"name": "charge", "action": "charge", "connector": "pay", "policy": "redo_safe"}
        ]
    }))
    .unwrap()
}

/// [`def`] with `reserve` and `charge` as branches of parallel group `pay` (compensated on
/// a failure; at most `max` in flight), and a `notify` step after the join.
fn grouped(on_failure: &str, max: u32) -> Definition {
    serde_json::from_value(json!({
        "name": "prop-group",
        "steps": [
            {"name": "create_order", "action": "create_order", "connector": "erp", "policy": "lookup_before_redo",
             "compensation": {"action": "cancel_order", "connector": "erp"}},
            {"name": "reserve", "action": "reserve", "connector": "stock", "policy": "manual", "group": "pay",
             "compensation": {"action": "release", "connector": "stock"}},
            {"name": "charge", "action": "charge", "connector": "pay", "policy": "redo_safe", "group": "pay"},
            {"name": "notify", "action": "notify", "connector": "pay", "policy": "redo_safe"}
        ],
        "groups": [{"name": "pay", "on_failure": on_failure, "max_concurrency": max}]
    }))
    .unwrap()
}

/// Whether connector `c` can look effects up.
fn has_lookup(c: &str) -> bool {
    c == "erp"
}

#[derive(Debug, Clone)]
enum Act {
    /// One engine round; `pick` chooses what a call does.
    Pass { pick: u8 },
    /// A slow worker's late report; `pick` chooses which and how.
    Late { pick: u8 },
    /// The reconciler looks every due operation up.
    Reconcile,
    /// Time passes.
    Advance { ms: i64 },
    /// The lease sweeper.
    Sweep,
    /// A truthful operator resolves a flagged operation (`pick`: PENDING or FAILED when the
    /// effect did not happen).
    Resolve { pick: u8 },
    /// An operator re-runs, naming the steps of `mask`.
    Rerun { mask: u8 },
    /// An operator asks for compensation.
    Compensate,
}

fn act() -> impl Strategy<Value = Act> {
    prop_oneof![
        8 => (0u8..9).prop_map(|pick| Act::Pass { pick }),
        2 => any::<u8>().prop_map(|pick| Act::Late { pick }),
        3 => Just(Act::Reconcile),
        3 => (10i64..300).prop_map(|ms| Act::Advance { ms }),
        1 => Just(Act::Sweep),
        2 => (0u8..2).prop_map(|pick| Act::Resolve { pick }),
        1 => (0u8..8).prop_map(|mask| Act::Rerun { mask }),
        1 => Just(Act::Compensate),
    ]
}

/// A granted attempt whose worker has not reported (slow, or crashed: `reports` false).
#[derive(Debug, Clone)]
struct InFlight {
    key: String,
    token: i64,
    effect: bool,
    reports: bool,
}

struct World {
    def: Definition,
    version: String,
    inst: InstanceRecord,
    rows: Vec<StepRow>,
    ops: HashMap<String, OperationRecord>,
    effects: HashMap<String, u32>,
    in_flight: Vec<InFlight>,
    now: i64,
    /// Steps an applied re-run named (redoing them is then allowed).
    named: HashSet<String>,
    /// Every key each step ran under.
    keys_of: HashMap<String, HashSet<String>>,
}

fn policy() -> RetryPolicy {
    RetryPolicy { base_ms: 10, cap_ms: 50, max_attempts: 4, max_elapsed_ms: None }
}

impl World {
    fn new(def: Definition) -> Self {
        let version = def.version();
        let start = StartInput {
            tenant: "t".into(),
            instance_id: ID.into(),
            workflow: "prop".into(),
            definition_version: version.clone(),
            definition_given: false,
            source_event: None,
            input: json!({"n": 1}),
            input_fingerprint: "f".repeat(64),
            trace_id: None,
            actor: Actor::default(),
            hold_ms: 0,
        };
        let inst = plan_start(None, None, &start, 1_000).record;
        let rows = StepRow::all_of("t", ID, &def);
        let keys_of =
            def.steps.iter().map(|s| (s.name.clone(), HashSet::from([step_key(ID, &s.key_name())]))).collect();
        World {
            def,
            version,
            inst,
            rows,
            ops: HashMap::new(),
            effects: HashMap::new(),
            in_flight: vec![],
            now: 1_000,
            named: HashSet::new(),
            keys_of,
        }
    }

    fn checkpoints(&self) -> Vec<Checkpoint> {
        self.rows
            .iter()
            .map(|r| {
                Checkpoint::with_compensation(
                    r.clone(),
                    self.ops.get(&r.op_key).cloned(),
                    self.ops.get(&r.comp_key).cloned(),
                )
            })
            .collect()
    }

    /// The connector, policy and dedupe of the operation `key`.
    fn about(&self, key: &str) -> (&'static str, bool) {
        let row = self.rows.iter().find(|r| r.op_key == key || r.comp_key == key);
        let step = row
            .map(|r| r.step.as_str())
            .or_else(|| self.keys_of.iter().find(|(_, ks)| ks.contains(key)).map(|(s, _)| s.as_str()));
        let is_comp = key.contains(":compensate");
        match (step, is_comp) {
            (Some("create_order"), _) => ("erp", false),
            (Some("reserve"), _) => ("stock", false),
            _ => ("pay", true),
        }
    }

    fn effect(&mut self, key: &str) {
        let (_, dedupes) = self.about(key);
        let n = self.effects.entry(key.to_owned()).or_default();
        *n = if dedupes { 1 } else { *n + 1 };
    }

    fn effects(&self, key: &str) -> u32 {
        self.effects.get(key).copied().unwrap_or(0)
    }

    fn store(&mut self, rec: OperationRecord) {
        self.ops.insert(rec.key.clone(), rec);
    }

    /// Completes `key`'s attempt `token` honestly: `effect` says whether it acted.
    fn report(&mut self, key: &str, token: i64, effect: bool, pick: u8) {
        let outcome = match (effect, pick % 3) {
            (true, 0 | 1) => Outcome::Succeeded { provider_ref: format!("ref-{key}"), result: None },
            (true, _) => Outcome::Unknown { message: Some("timeout after the request was sent".into()) },
            (false, 0) => Outcome::FinalFailure { error_class: "validation".into(), message: None, result: None },
            (false, 1) => {
                Outcome::RetryableFailure { error_class: "unavailable".into(), message: None, retry_after_ms: Some(0) }
            }
            (false, _) => Outcome::Unknown { message: None },
        };
        let Some(rec) = self.ops.get(key).cloned() else { return };
        if let Ok(plan) = plan_completion(&rec, token, &outcome, &Actor::executor(), &policy(), 0.5, self.now)
            && plan.changed
        {
            self.store(plan.record);
        }
    }

    /// Acquires and performs `key` (a step or a compensation) per `pick`.
    fn run(&mut self, key: &str, action: &str, connector: &str, redo_safe: bool, payload: serde_json::Value, pick: u8) {
        let input = AcquireInput {
            tenant: "t".into(),
            key: key.into(),
            action: action.into(),
            fingerprint: idem_core::flow::step_fingerprint(key, &idem_core::fingerprint(&payload, None).unwrap().0),
            payload,
            lease_ms: LEASE_MS,
            redo_safe,
            connector: Some(connector.into()),
            holder: None,
            actor: Actor::executor(),
        };
        let plan = plan_acquire(self.ops.get(key), &input, self.now);
        if plan.changed {
            self.store(plan.record.clone());
        }
        if plan.decision != Decision::Acquire {
            return;
        }
        let token = plan.record.fencing_token;
        match pick {
            0..=2 => {
                self.effect(key);
                self.report(key, token, true, pick);
            }
            3 | 4 => self.report(key, token, false, pick),
            5 => self.in_flight.push(InFlight { key: key.into(), token, effect: false, reports: false }),
            6 => {
                self.effect(key);
                self.in_flight.push(InFlight { key: key.into(), token, effect: true, reports: false });
            }
            _ => {
                self.effect(key);
                self.in_flight.push(InFlight { key: key.into(), token, effect: true, reports: true });
            }
        }
    }

    fn pass(&mut self, pick: u8) {
        let cps = self.checkpoints();
        let next = plan_advance(&self.inst, &self.def, &cps, self.now).expect("checkpoints match the definition");
        self.perform(next, pick, &cps);
    }

    fn perform(&mut self, next: Next, pick: u8, cps: &[Checkpoint]) {
        match next {
            Next::Parallel { runs } => {
                assert!(runs.len() >= 2, "a parallel plan runs at least two branches");
                let in_flight = cps
                    .iter()
                    .filter(|c| {
                        c.operation.as_ref().is_some_and(|o| {
                            o.state == State::Executing && o.lease_expires_at.is_some_and(|e| e > self.now)
                        })
                    })
                    .count();
                assert!(runs.len() + in_flight <= 2, "max_concurrency 2: {} runs, {in_flight} in flight", runs.len());
                for (n, run) in runs.into_iter().enumerate() {
                    let (Next::Run { index, .. } | Next::Redo { index }) = &run else {
                        panic!("{run:?} in a parallel plan")
                    };
                    assert!(self.def.steps[*index].group.is_some(), "only branches run in parallel");
                    self.perform(run, pick.wrapping_add(n as u8 * 3) % 9, cps);
                }
            }
            Next::Run { index, payload } => {
                if let Some(start) = (0..index).rev().find(|i| self.def.steps[*i].group.is_some())
                    && self.def.steps[index].group.is_none()
                {
                    let span = self.def.span(start);
                    for c in &cps[span] {
                        assert_eq!(
                            c.state,
                            idem_core::flow::StepState::Succeeded,
                            "the join ran before {} succeeded",
                            c.row.step
                        );
                    }
                }
                let step = self.def.steps[index].clone();
                let key = self.rows[index].op_key.clone();
                let redo_safe = step.policy == RecoveryPolicy::RedoSafe;
                self.run(&key, &step.action, step.connector.as_deref().unwrap(), redo_safe, payload, pick);
            }
            Next::Compensate { index, payload } => {
                let comp = self.def.steps[index].compensation.clone().unwrap();
                let key = self.rows[index].comp_key.clone();
                self.run(&key, &comp.action, comp.connector.as_deref().unwrap(), false, payload, pick);
            }
            Next::Redo { index } => {
                let key = self.rows[index].op_key.clone();
                let rec = self.ops[&key].clone();
                if let Ok((next, _)) = plan_resolution(
                    &rec,
                    State::Pending,
                    Some(State::Unknown),
                    "redo_safe",
                    None,
                    &Actor::system(),
                    self.now,
                ) {
                    self.store(next);
                }
            }
            Next::Abandon { index } => {
                // As the engine does: a PENDING step closed FAILED while compensating.
                let key = self.rows[index].op_key.clone();
                let rec = self.ops[&key].clone();
                if let Ok((next, _)) = plan_resolution(
                    &rec,
                    State::Failed,
                    Some(State::Pending),
                    "compensating",
                    None,
                    &Actor::system(),
                    self.now,
                ) {
                    self.store(next);
                }
            }
            other => {
                if let Some((rec, _)) = plan_instance_update(&self.inst, &self.def, &other, &Actor::system(), self.now)
                {
                    self.inst = rec;
                }
            }
        }
    }

    fn late(&mut self, pick: u8) {
        let reporting: Vec<usize> = (0..self.in_flight.len()).filter(|i| self.in_flight[*i].reports).collect();
        if reporting.is_empty() {
            return;
        }
        let f = self.in_flight.remove(reporting[pick as usize % reporting.len()]);
        self.report(&f.key, f.token, f.effect, pick / 7);
    }

    fn reconcile(&mut self) {
        let keys: Vec<String> = self.ops.keys().cloned().collect();
        for key in keys {
            let rec = self.ops[&key].clone();
            if rec.needs_review {
                continue;
            }
            let (connector, _) = self.about(&key);
            let manual = self.rows.iter().any(|r| r.op_key == key && r.policy == RecoveryPolicy::Manual);
            let (lookup, max) = if manual || !has_lookup(connector) {
                (Lookup::Inconclusive { why: "a person decides".into() }, 1)
            } else if self.effects(&key) > 0 {
                (Lookup::Found { provider_ref: format!("found-{key}") }, 5)
            } else {
                (Lookup::Absent, 5)
            };
            if let Some((next, _)) = plan_reconciliation(&rec, &lookup, &Actor::system(), &policy(), max, 0.5, self.now)
            {
                self.store(next);
            }
        }
    }

    fn sweep(&mut self) {
        let keys: Vec<String> = self.ops.keys().cloned().collect();
        for key in keys {
            if let Some((next, _)) = plan_lease_expiry(&self.ops[&key], self.now) {
                self.store(next);
            }
        }
    }

    fn resolve(&mut self, pick: u8) {
        let Some(rec) = self.ops.values().find(|o| o.needs_review).cloned() else { return };
        let (to, evidence) = match (self.effects(&rec.key) > 0, pick) {
            (true, _) => (State::Succeeded, Some("seen at the provider")),
            (false, 0) => (State::Pending, None),
            (false, _) => (State::Failed, None),
        };
        if let Ok((next, _)) =
            plan_resolution(&rec, to, None, "checked the provider", evidence, &Actor::default(), self.now)
        {
            self.store(next);
        }
    }

    fn rerun(&mut self, mask: u8) {
        let named: Vec<String> = self
            .def
            .steps
            .iter()
            .enumerate()
            .filter(|(i, _)| mask & (1 << i) != 0)
            .map(|(_, s)| s.name.clone())
            .collect();
        let cps = self.checkpoints();
        let Ok(plan) = plan_rerun(&self.inst, &self.def, &cps, &named, &has_lookup) else { return };
        let (rec, _) = plan_rerun_apply(&self.inst, &plan, Some(&plan.hash), "property", &Actor::default(), self.now)
            .expect("the plan just made is the plan");
        for (p, row) in plan.steps.iter().zip(self.rows.iter_mut()) {
            if p.disposition == StepDisposition::Redone {
                self.named.insert(p.step.clone());
            }
            if p.disposition == StepDisposition::Redone && !named.contains(&p.step) {
                // An unnamed redo is only ever of a step that failed (no effect).
                let old = self.ops.get(&row.op_key).map(|o| o.state);
                assert_eq!(old, Some(State::Failed), "an unnamed redo of {} in {:?}", p.step, old);
            }
            row.op_key = p.op_key.clone();
            row.comp_key = p.comp_key.clone();
            self.keys_of.get_mut(&p.step).unwrap().insert(p.op_key.clone());
        }
        self.inst = rec;
        for p in &plan.steps {
            if p.disposition == StepDisposition::LookedUp {
                self.reconcile();
            }
        }
    }

    fn compensate(&mut self) {
        let cps = self.checkpoints();
        if let Ok((rec, _)) =
            plan_operator_compensation(&self.inst, &self.def, &cps, "property", &Actor::default(), self.now)
        {
            self.inst = rec;
        }
    }

    fn apply(&mut self, a: &Act) {
        match a {
            Act::Pass { pick } => self.pass(*pick),
            Act::Late { pick } => self.late(*pick),
            Act::Reconcile => self.reconcile(),
            Act::Advance { ms } => self.now += ms,
            Act::Sweep => self.sweep(),
            Act::Resolve { pick } => self.resolve(*pick),
            Act::Rerun { mask } => self.rerun(*mask),
            Act::Compensate => self.compensate(),
        }
    }

    fn check(&self, after: &Act) {
        for (key, n) in &self.effects {
            assert!(*n <= 1, "{n} effects under {key} after {after:?}");
        }
        for op in self.ops.values() {
            if op.state == State::Succeeded {
                assert!(self.effects(&op.key) > 0, "{} SUCCEEDED without its effect after {after:?}", op.key);
            }
        }
        for (step, keys) in &self.keys_of {
            let with_effect = keys.iter().filter(|k| self.effects(k) > 0).count();
            assert!(
                with_effect <= 1 || self.named.contains(step),
                "step {step} has effects under {with_effect} keys but no re-run named it"
            );
        }
        assert_eq!(self.inst.definition_version, self.version, "the pinned version never changes");
        let _ = compensation_key(ID);
    }

    /// A COMPENSATED instance undid every effect that exists: each step (or branch) that
    /// has a compensation and whose effect happened under its key had its compensation's
    /// effect too — also one whose outcome was UNKNOWN when the compensation began. Steps
    /// an operator's re-run named are left out (their earlier keys are kept as they were).
    fn check_compensated(&self) {
        if self.inst.state != InstanceState::Compensated {
            return;
        }
        for (step, c) in self.def.steps.iter().zip(self.checkpoints()) {
            if step.compensation.is_none() || self.named.contains(&step.name) {
                continue;
            }
            if self.effects(&c.row.op_key) > 0 {
                assert!(
                    self.effects(&c.row.comp_key) > 0,
                    "COMPENSATED, but {} has its effect and {} never ran",
                    c.row.op_key,
                    c.row.comp_key
                );
            }
        }
    }

    /// Calls succeed from now on, late workers report, operators are truthful; true when
    /// the instance reached a final state.
    fn settle(&mut self) -> bool {
        for round in 0..400 {
            if self.inst.state.is_final() {
                return true;
            }
            match round % 6 {
                0 | 1 => self.pass(0),
                2 => self.late(0),
                3 => {
                    self.now += 150;
                    self.sweep();
                    self.reconcile();
                }
                4 => self.resolve(0),
                _ => {
                    if self.inst.state == InstanceState::Paused {
                        self.rerun(0);
                    }
                }
            }
        }
        false
    }
}

/// Applies `acts`, checking after each, then lets the instance settle.
fn play(mut w: World, acts: &[Act]) -> World {
    for a in acts {
        w.apply(a);
        w.check(a);
    }
    w.settle();
    w.check(&Act::Sweep);
    w.check_compensated();
    w
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]
    #[test]
    fn workflows_never_double_an_effect_and_always_settle(acts in proptest::collection::vec(act(), 1..60)) {
        let w = play(World::new(def()), &acts);
        prop_assert!(w.inst.state.is_final(), "stuck in {} after {:?}: {:?}", w.inst.state, acts, w.checkpoints().iter().map(|c| (c.row.op_key.clone(), c.state)).collect::<Vec<_>>());
    }

    /// The same with a parallel group: every branch's and compensation's effect at most
    /// once, the step after the join only once every branch SUCCEEDED, at most
    /// `max_concurrency` branches in flight, and every instance settles, under either
    /// `on_failure`.
    #[test]
    fn parallel_branches_never_double_an_effect_and_always_settle(
        acts in proptest::collection::vec(act(), 1..60),
        compensate in any::<bool>(),
    ) {
        let w = play(World::new(grouped(if compensate { "compensate" } else { "pause" }, 2)), &acts);
        prop_assert!(w.inst.state.is_final(), "stuck in {} after {:?}: {:?}", w.inst.state, acts, w.checkpoints().iter().map(|c| (c.row.op_key.clone(), c.state)).collect::<Vec<_>>());
    }
}
