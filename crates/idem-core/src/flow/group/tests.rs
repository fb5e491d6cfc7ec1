//! Canned histories of a workflow with a parallel group: `create_order`, then branches
//! `email`, `chat`, `data` of group `notify` at once, then `close` after all of them.

use super::*;
use crate::flow::canned::{ID, NOW, made_by_idem, op_at};
use crate::flow::plan::{plan_advance, plan_instance_update};
use crate::flow::record::{StepRow, compensation_key};
use crate::flow::{InstanceState, rerun::plan_rerun};
use crate::record::{Actor, OperationRecord};
use serde_json::json;

const STEPS: [&str; 5] = ["create_order", "email", "chat", "data", "close"];

/// The definition, with `on_failure` and `max_concurrency` for group `notify`.
pub(crate) fn fan_out(on_failure: &str, max: Option<u32>) -> Definition {
    let branch = |name: &str, policy: &str| {
        json!({"name": name, "action": format!("notify_{name}"), "connector": "c", "policy": policy, "group": "notify",
               "input": {"order": {"from": "/steps/create_order/result/id"}},
               "compensation": {"action": format!("undo_{name}"), "connector": "c"}})
    };
    let mut group = json!({"name": "notify", "on_failure": on_failure});
    if let Some(m) = max {
        group["max_concurrency"] = json!(m);
    }
    serde_json::from_value(json!({
        "name": "fan-out",
        "steps": [
            {"name": "create_order", "action": "create_order", "connector": "c", "policy": "redo_safe",
             "compensation": {"action": "cancel_order", "connector": "c"}},
            branch("email", "manual"), branch("chat", "redo_safe"), branch("data", "redo_safe"),
            {"name": "close", "action": "close", "connector": "c", "policy": "redo_safe",
             "input": {"email": {"from": "/steps/email/result"}, "chat": {"from": "/steps/chat/result"}}}
        ],
        "groups": [group]
    }))
    .unwrap()
}

fn instance(def: &Definition) -> InstanceRecord {
    let mut start = crate::flow::canned::start();
    start.workflow = def.name.clone();
    start.definition_version = def.version();
    crate::flow::plan_start(None, None, &start, NOW - 10_000).record
}

/// The operation of step `name` of `def` in `state`, made for it.
fn op(def: &Definition, name: &str, state: State) -> OperationRecord {
    let s = def.steps.iter().find(|s| s.name == name).unwrap();
    let mut r = op_at(&crate::flow::step_key(ID, &s.key_name()), state);
    r.action = s.action.clone();
    r.connector = s.connector.clone();
    if state == State::Executing {
        r.lease_expires_at = Some(NOW + 5_000);
    }
    made_by_idem(r)
}

/// The compensation of step `name` in `state`.
fn comp(def: &Definition, name: &str, state: State) -> OperationRecord {
    let s = def.steps.iter().find(|s| s.name == name).unwrap();
    let c = s.compensation.clone().unwrap();
    let mut r = op_at(&compensation_key(&crate::flow::step_key(ID, &s.key_name())), state);
    r.action = c.action;
    r.connector = c.connector;
    made_by_idem(r)
}

/// Checkpoints of `def`: `states[i]` is step i's operation state (`None`: no operation),
/// `comps` the states of compensations by step name.
fn cps(def: &Definition, states: &[Option<State>], comps: &[(&str, State)]) -> Vec<Checkpoint> {
    StepRow::all_of("t", ID, def)
        .into_iter()
        .enumerate()
        .map(|(i, row)| {
            let name = row.step.clone();
            let operation = states.get(i).copied().flatten().map(|s| op(def, &name, s));
            let c = comps.iter().find(|(n, _)| *n == name).map(|(_, s)| comp(def, &name, *s));
            Checkpoint::with_compensation(row, operation, c)
        })
        .collect()
}

fn next(def: &Definition, inst: &InstanceRecord, states: &[Option<State>]) -> Next {
    plan_advance(inst, def, &cps(def, states, &[]), NOW).unwrap()
}

fn indexes(n: &Next) -> Vec<usize> {
    match n {
        Next::Parallel { runs } => runs.iter().flat_map(indexes).collect(),
        Next::Run { index, .. } | Next::Redo { index } => vec![*index],
        _ => vec![],
    }
}

const S: Option<State> = Some(State::Succeeded);

#[test]
fn branches_have_their_own_keys_and_the_group_is_consecutive() {
    let def = fan_out("pause", None);
    def.validate("workflows.fan-out", &|_| Some(crate::flow::definition::ConnectorCaps { has_lookup: false })).unwrap();
    let rows = StepRow::all_of("t", ID, &def);
    assert_eq!(rows[1].op_key, "ORD-7:intake:notify:email");
    assert_eq!(rows[1].comp_key, "ORD-7:intake:notify:email:compensate");
    assert_eq!(rows[4].op_key, "ORD-7:intake:close", "a step outside a group keeps {{instance}}:{{step}}");
    assert_eq!(def.span(2), 1..4);
    assert_eq!(def.span(0), 0..1);
    assert_eq!(def.span(4), 4..5);
}

#[test]
fn a_bad_group_is_refused_naming_its_field() {
    let caps = |_: &str| Some(crate::flow::definition::ConnectorCaps { has_lookup: false });
    let check = |edit: &dyn Fn(&mut Definition), field: &str, words: &str| {
        let mut d = fan_out("pause", None);
        edit(&mut d);
        let e = d.validate("workflows.w", &caps).unwrap_err();
        assert_eq!(e.field, field, "{e}");
        assert!(e.message.contains(words), "{e}");
    };
    check(
        &|d| {
            d.steps[4].input = serde_json::Value::Null;
            d.steps.swap(2, 4);
        },
        "workflows.w.steps[3].group",
        "consecutive",
    );
    check(&|d| d.steps[1].group = Some("close".into()), "workflows.w.steps[1].group", "name of a step");
    check(&|d| d.steps[1].group = Some("a:b".into()), "workflows.w.steps[1].group", "group name");
    check(&|d| d.steps[1].group = Some("g".repeat(45)), "workflows.w.steps[1].group", "at most 48");
    check(
        &|d| d.steps[2].input = json!({"x": {"from": "/steps/email/result"}}),
        "workflows.w.steps[2].input/x",
        "does not run before",
    );
    check(&|d| d.groups[0].name = "other".into(), "workflows.w.groups[0].name", "no step names");
    check(&|d| d.groups[0].max_concurrency = Some(0), "workflows.w.groups[0].max_concurrency", "at least 1");
    check(&|d| d.groups[0].max_concurrency = Some(65), "workflows.w.groups[0].max_concurrency", "at most 64");
    check(&|d| d.groups.push(d.groups[0].clone()), "workflows.w.groups[1].name", "twice");
}

/// create_order SUCCEEDED → every branch at once; some SUCCEEDED → only the others; all
/// SUCCEEDED → the join (`close`, with every branch's result); then SUCCEEDED.
#[test]
fn all_branches_run_at_once_and_the_join_waits_for_all() {
    let def = fan_out("pause", None);
    let inst = instance(&def);
    assert_eq!(indexes(&next(&def, &inst, &[])), vec![0]);
    let n = next(&def, &inst, &[S]);
    assert_eq!(indexes(&n), vec![1, 2, 3]);
    let Next::Parallel { runs } = &n else { panic!("{n:?}") };
    assert_eq!(runs[0], Next::Run { index: 1, payload: json!({"order": 42}) });
    assert_eq!(indexes(&next(&def, &inst, &[S, None, S, None])), vec![1, 3], "a finished branch is not run again");
    let exec = Some(State::Executing);
    assert_eq!(
        next(&def, &inst, &[S, S, exec, S]),
        Next::Wait { index: 2, until_ms: NOW + 5_000 },
        "the join waits for the branch still in flight"
    );
    assert_eq!(
        next(&def, &inst, &[S, S, S, S]),
        Next::Run { index: 4, payload: json!({"email": {"id": 42}, "chat": {"id": 42}}) }
    );
    let done = next(&def, &inst, &[S, S, S, S, S]);
    assert!(matches!(done, Next::Finish { state: InstanceState::Succeeded, .. }), "{done:?}");
    assert_eq!(plan_instance_update(&inst, &def, &Next::Parallel { runs: vec![] }, &Actor::system(), NOW), None);
}

#[test]
fn at_most_max_concurrency_branches_are_in_flight() {
    let def = fan_out("pause", Some(2));
    let inst = instance(&def);
    assert_eq!(indexes(&next(&def, &inst, &[S])), vec![1, 2]);
    let exec = Some(State::Executing);
    assert_eq!(indexes(&next(&def, &inst, &[S, exec])), vec![2], "one in flight: room for one more");
    assert!(matches!(next(&def, &inst, &[S, exec, exec]), Next::Wait { .. }), "two in flight: none starts");
    assert_eq!(indexes(&next(&def, &inst, &[S, S, exec])), vec![3]);
}

/// The caller's acquire of a branch that would start it beyond `max_concurrency` is refused
/// (naming the group, its limit, the branches in flight and when the first lease ends); an
/// acquire that starts nothing always passes.
#[test]
fn a_callers_acquire_beyond_max_concurrency_is_refused() {
    let def = fan_out("pause", Some(2));
    let exec = Some(State::Executing);
    let cp = |states: &[Option<State>]| cps(&def, states, &[]);
    assert_eq!(admit_branch(&def, &cp(&[S]), 1, NOW), Ok(()));
    assert_eq!(admit_branch(&def, &cp(&[S, exec]), 2, NOW), Ok(()), "one in flight: room for one more");
    let full = admit_branch(&def, &cp(&[S, exec, exec]), 3, NOW).unwrap_err();
    let want = GroupFull {
        group: "notify".into(),
        max: 2,
        in_flight: vec!["email".into(), "chat".into()],
        until_ms: NOW + 5_000,
    };
    assert_eq!(full, want);
    let pending = Some(State::Pending);
    assert!(admit_branch(&def, &cp(&[S, exec, exec, pending]), 3, NOW).is_err(), "a PENDING branch would start");
    assert_eq!(admit_branch(&def, &cp(&[S, exec, exec]), 2, NOW), Ok(()), "its own lease: a resend starts nothing");
    assert_eq!(admit_branch(&def, &cp(&[S, exec, exec, S]), 3, NOW), Ok(()), "a finished branch replays");
    assert_eq!(admit_branch(&def, &cp(&[S, exec, exec]), 3, NOW + 5_000), Ok(()), "the leases lapsed");
    assert_eq!(admit_branch(&def, &cp(&[S, exec, exec]), 0, NOW), Ok(()), "a step outside the group");
    assert_eq!(admit_branch(&fan_out("pause", None), &cp(&[S, exec, exec]), 3, NOW), Ok(()), "no limit");
    // `chat` (redo_safe) lost its lease: the acquire would grant it again, with two in flight.
    let mut c = cp(&[S, exec, exec, exec]);
    c[2].operation.as_mut().unwrap().lease_expires_at = Some(NOW - 1);
    let full = admit_branch(&def, &c, 2, NOW).unwrap_err();
    assert_eq!(full.in_flight, vec!["email".to_owned(), "data".to_owned()]);
}

/// A branch fails finally under `pause`: the instance pauses naming the branch, even with
/// a sibling runnable (nothing new starts) or in flight (its state is kept).
#[test]
fn a_failed_branch_pauses_the_instance_under_pause() {
    let def = fan_out("pause", None);
    let inst = instance(&def);
    let f = Some(State::Failed);
    for others in [[None, None], [S, None], [Some(State::Executing), S]] {
        let n = next(&def, &inst, &[S, others[0], f, others[1]]);
        let Next::Pause { index, class, reason } = &n else { panic!("{n:?}") };
        assert_eq!((*index, *class), (2, "branch_failed"));
        assert!(reason.contains("branch \"chat\" of group \"notify\"") && reason.contains("pause"), "{reason}");
    }
    // Paused: it stays paused while the branch is FAILED; a late sibling's success changes
    // nothing, and nothing after the group runs.
    let (paused, _) = plan_instance_update(
        &inst,
        &def,
        &next(&def, &inst, &[S, Some(State::Executing), f, S]),
        &Actor::system(),
        NOW,
    )
    .unwrap();
    assert_eq!(paused.state, InstanceState::Paused);
    assert_eq!(next(&def, &paused, &[S, S, f, S]), Next::Idle);
}

/// An UNKNOWN branch under `manual` pauses the instance (pause), or compensates (compensate).
#[test]
fn an_unknown_branch_follows_the_group_policy() {
    let u = Some(State::Unknown);
    let def = fan_out("pause", None);
    let n = next(&def, &instance(&def), &[S, u, S, S]);
    assert!(matches!(n, Next::Pause { index: 1, class: "unknown_manual", .. }), "{n:?}");
    let def = fan_out("compensate", None);
    let n = next(&def, &instance(&def), &[S, u, S, S]);
    assert!(matches!(n, Next::BeginCompensation { index: 1, .. }), "{n:?}");
}

/// Under `compensate`: a failed branch begins compensation; it waits for the branch in
/// flight, then compensates exactly the branches that SUCCEEDED (and the step before),
/// last first, each once; never the failed one or one that never ran.
#[test]
fn compensation_covers_exactly_the_completed_branches_each_once() {
    let def = fan_out("compensate", None);
    let inst = instance(&def);
    let (f, e) = (Some(State::Failed), Some(State::Executing));
    let begin = next(&def, &inst, &[S, S, f, e]);
    assert!(matches!(begin, Next::BeginCompensation { index: 2, .. }), "{begin:?}");
    let (comp_inst, _) = plan_instance_update(&inst, &def, &begin, &Actor::system(), NOW).unwrap();
    assert_eq!(comp_inst.state, InstanceState::Compensating);
    let step = |states: &[Option<State>], comps: &[(&str, State)]| {
        plan_advance(&comp_inst, &def, &cps(&def, states, comps), NOW).unwrap()
    };
    assert_eq!(step(&[S, S, f, e], &[]), Next::Wait { index: 3, until_ms: NOW + 5_000 }, "data is in flight");
    // data finished late: SUCCEEDED, so it is compensated too, first (last in order).
    assert!(matches!(step(&[S, S, f, S], &[]), Next::Compensate { index: 3, .. }));
    let done = State::Succeeded;
    assert!(
        matches!(step(&[S, S, f, S], &[("data", done)]), Next::Compensate { index: 1, .. }),
        "chat failed: skipped"
    );
    assert!(matches!(step(&[S, S, f, S], &[("data", done), ("email", done)]), Next::Compensate { index: 0, .. }));
    let all = [("data", done), ("email", done), ("create_order", done)];
    assert!(matches!(step(&[S, S, f, S], &all), Next::Finish { state: InstanceState::Compensated, .. }));
    // data never ran: not compensated.
    let n = step(&[S, S, f, None], &[("email", done)]);
    assert!(matches!(n, Next::Compensate { index: 0, .. }), "{n:?}");
}

/// The group's state follows its table, pair by pair; each derived state is reachable.
#[test]
fn group_moves_are_exactly_the_table() {
    use GroupState::*;
    let legal = [
        (NotStarted, Running),
        (Running, Succeeded),
        (Running, Stopped),
        (Stopped, Running),
        (Stopped, Compensated),
        (Succeeded, Compensated),
        (Succeeded, Running),
    ];
    for a in GroupState::ALL {
        for b in GroupState::ALL {
            assert_eq!(a.can_become(b), legal.contains(&(a, b)), "{a} -> {b}");
        }
    }
    use StepState as St;
    assert_eq!(GroupState::of(&[St::NotStarted, St::NotStarted]), NotStarted);
    assert_eq!(GroupState::of(&[St::Succeeded, St::Executing]), Running);
    assert_eq!(GroupState::of(&[St::Succeeded, St::Succeeded]), Succeeded);
    assert_eq!(GroupState::of(&[St::Succeeded, St::Failed]), Stopped);
    assert_eq!(GroupState::of(&[St::Compensated, St::Failed]), Stopped);
    assert_eq!(GroupState::of(&[St::Compensated, St::NotStarted]), Compensated);
    let def = fan_out("pause", None);
    let g = groups_of(&def, &cps(&def, &[S, S, Some(State::Failed), None], &[]));
    assert_eq!(g, vec![("notify".to_owned(), Stopped, 1..4)]);
}

/// A re-run plans branches like steps: a dry run lists each branch (a plain re-run keeps
/// the finished ones), and naming one redoes only it, under `{instance}:{group}:{branch}:rerun-1`.
#[test]
fn a_rerun_plans_each_branch() {
    let def = fan_out("pause", None);
    let mut inst = instance(&def);
    inst.state = InstanceState::Paused;
    let checkpoints = cps(&def, &[S, S, Some(State::Failed), S], &[]);
    let plan = plan_rerun(&inst, &def, &checkpoints, &["chat".to_owned()], &|_| false).unwrap();
    let names: Vec<_> = plan.steps.iter().map(|p| p.step.as_str()).collect();
    assert_eq!(names, STEPS.to_vec());
    let chat = &plan.steps[2];
    assert_eq!(chat.key, "ORD-7:intake:notify:chat:rerun-1", "{chat:?}");
    assert_eq!(plan.steps[1].key, "ORD-7:intake:notify:email", "a finished branch keeps its key");
    let other = plan_rerun(&inst, &def, &checkpoints, &["email".to_owned()], &|_| false).unwrap();
    assert_ne!(plan.hash, other.hash, "the plan hash covers the branches");
}

/// Compensation settles every branch first (the table in `recovery`): an UNKNOWN branch
/// with a lookup is waited for, and compensated only if the lookup found its effect; one
/// that needs a person pauses the compensation until it is resolved; one in flight, or
/// whose lease lapsed, is waited for. Before this, an UNKNOWN branch was skipped and its
/// effect, once found, was never compensated.
#[test]
fn compensation_waits_for_unknown_branches_to_settle() {
    use crate::flow::definition::RecoveryPolicy;
    use crate::flow::recovery::LOOKUP_POLL_MS;
    let (f, u, e) = (Some(State::Failed), Some(State::Unknown), Some(State::Executing));
    let mut def = fan_out("compensate", None);
    def.steps[3].policy = RecoveryPolicy::LookupBeforeRedo;
    let inst = instance(&def);
    // chat failed while data's outcome is UNKNOWN: data's lookup decides.
    let begin = next(&def, &inst, &[S, S, f, u]);
    assert!(matches!(begin, Next::BeginCompensation { index: 2, .. }), "{begin:?}");
    let (comp_inst, _) = plan_instance_update(&inst, &def, &begin, &Actor::system(), NOW).unwrap();
    let step = |def: &Definition, cps: Vec<Checkpoint>| plan_advance(&comp_inst, def, &cps, NOW).unwrap();
    let n = step(&def, cps(&def, &[S, S, f, u], &[]));
    assert!(matches!(n, Next::Wait { index: 3, until_ms } if until_ms >= NOW + LOOKUP_POLL_MS), "{n:?}");
    // The lookup found it: it is compensated, first. It proved it absent (PENDING, due for
    // another attempt): it is closed FAILED before anything performs it, then skipped.
    assert!(matches!(step(&def, cps(&def, &[S, S, f, S], &[])), Next::Compensate { index: 3, .. }));
    let n = step(&def, cps(&def, &[S, S, f, Some(State::Pending)], &[]));
    assert_eq!(n, Next::Abandon { index: 3 }, "a PENDING branch is never performed while compensating");
    let n = step(&def, cps(&def, &[S, S, f, f], &[]));
    assert!(matches!(n, Next::Compensate { index: 1, .. }), "{n:?}");
    // In flight: waited for until its lease ends; lapsed: until the sweeper records it.
    assert_eq!(step(&def, cps(&def, &[S, S, f, e], &[])), Next::Wait { index: 3, until_ms: NOW + 5_000 });
    let mut lapsed = cps(&def, &[S, S, f, e], &[]);
    lapsed[3].operation.as_mut().unwrap().lease_expires_at = Some(NOW - 1);
    assert_eq!(step(&def, lapsed), Next::Wait { index: 3, until_ms: NOW + crate::flow::plan::EXPIRY_POLL_MS });
    // redo_safe: not redone while compensating; the reconciler's lookup settles it.
    def.steps[3].policy = RecoveryPolicy::RedoSafe;
    let n = step(&def, cps(&def, &[S, S, f, u], &[]));
    assert!(matches!(n, Next::Wait { index: 3, until_ms } if until_ms >= NOW + LOOKUP_POLL_MS), "{n:?}");
    // manual, or in the review queue (a redo_safe step without a lookup): a person resolves it.
    for review in [false, true] {
        def.steps[3].policy = if review { RecoveryPolicy::RedoSafe } else { RecoveryPolicy::Manual };
        let policy = def.steps[3].policy;
        let cps = |states: &[Option<State>]| {
            let mut cps = cps(&def, states, &[]);
            if let Some(op) = cps[3].operation.as_mut() {
                op.needs_review = review && op.state == State::Unknown;
            }
            cps
        };
        let n = step(&def, cps(&[S, S, f, u]));
        let Next::Pause { index: 3, class: "compensation_unknown", reason } = &n else { panic!("{policy:?}: {n:?}") };
        assert!(
            reason.contains("branch \"data\" of group \"notify\"") && reason.contains("ORD-7:intake:notify:data"),
            "{reason}"
        );
        // Paused there, it stays paused (never back to the forward run) until resolved.
        let (paused, _) = plan_instance_update(&comp_inst, &def, &n, &Actor::system(), NOW).unwrap();
        assert_eq!(paused.state, InstanceState::Paused);
        assert_eq!(plan_advance(&paused, &def, &cps(&[S, S, f, u]), NOW + 5_000).unwrap(), Next::Idle);
        for resolved in [State::Succeeded, State::Failed] {
            let n = plan_advance(&paused, &def, &cps(&[S, S, f, Some(resolved)]), NOW).unwrap();
            assert_eq!(n, Next::Resume { to: InstanceState::Compensating }, "resolved {resolved:?}");
        }
    }
    let mut review = cps(&def, &[S, S, f, u], &[]);
    def.steps[3].policy = RecoveryPolicy::LookupBeforeRedo;
    review[3].operation.as_mut().unwrap().needs_review = true;
    assert!(matches!(step(&def, review), Next::Pause { index: 3, class: "compensation_unknown", .. }));
    // Under `compensate` it is undone as if it happened; without a compensation, skipped.
    def.steps[3].policy = RecoveryPolicy::Compensate;
    assert!(matches!(step(&def, cps(&def, &[S, S, f, u], &[])), Next::Compensate { index: 3, .. }));
    def.steps[3].policy = RecoveryPolicy::Manual;
    def.steps[3].compensation = None;
    assert!(matches!(step(&def, cps(&def, &[S, S, f, u], &[])), Next::Compensate { index: 1, .. }));
}

/// The branch whose UNKNOWN outcome began the compensation (policy `manual`) is settled by a
/// person before anything is undone.
#[test]
fn an_unknown_branch_that_began_the_compensation_is_resolved_first() {
    let u = Some(State::Unknown);
    let def = fan_out("compensate", None);
    let inst = instance(&def);
    let begin = next(&def, &inst, &[S, u, S, S]);
    let (comp_inst, _) = plan_instance_update(&inst, &def, &begin, &Actor::system(), NOW).unwrap();
    let n = plan_advance(&comp_inst, &def, &cps(&def, &[S, u, S, S], &[]), NOW).unwrap();
    assert!(matches!(n, Next::Pause { index: 1, class: "compensation_unknown", .. }), "{n:?}");
    // Resolved SUCCEEDED: email's effect is undone too, after data and chat.
    let done = State::Succeeded;
    let n = plan_advance(&comp_inst, &def, &cps(&def, &[S, S, S, S], &[("data", done), ("chat", done)]), NOW).unwrap();
    assert!(matches!(n, Next::Compensate { index: 1, .. }), "{n:?}");
}
