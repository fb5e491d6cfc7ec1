//! Property test: random interleavings of acquire, execute, complete, renew and clock
//! advances by several workers against the pure decision functions, checking invariants
//! 1–6 of DESIGN.md §2 after every step.
//!
//! The model: workers are honest — a worker reports `succeeded` only if it performed the
//! side effect, a failure only if it did not, and `unknown` either way — but they may be
//! slow (their lease expires mid-attempt, "zombies") and may never report at all (crash).
//! The provider counts side effects. If the decision table ever granted a second lease
//! while an earlier attempt might have acted, the count would exceed one.
//!
//! Every worker names a holder identity when it acquires. Workers 0 and 1 share a
//! principal; worker 2 has another principal but names the same holder string as worker
//! 0, so a holder that is not scoped to its principal would hand worker 0's lease to it.
//! An acquire's reply may be lost (the worker learns nothing) and the worker may resend
//! it; workers renew their leases (and forge renewals with made-up tokens). After every
//! step: at most one worker holds the current fencing token; a grant returned to its
//! holder changes nothing; a renewal never revives an expired lease nor extends another
//! token's lease; a stale token never completes.

use idem_core::{
    AcquireInput, Actor, CompleteError, Decision, OperationRecord, Outcome, RenewError, RetryPolicy, State,
    plan_acquire, plan_completion, plan_lease_expiry, plan_renewal,
};
use proptest::prelude::*;
use serde_json::json;

const WORKERS: usize = 3;
const LEASE_MS: i64 = 100;

#[derive(Debug, Clone)]
enum Step {
    /// Worker w triggers the key with payload variant p (0 = the intent, 1 = another).
    Acquire { w: usize, p: u8 },
    /// Worker w triggers the key, but the reply is lost: the worker learns nothing (it
    /// may resend with a later `Acquire`).
    LostAcquire { w: usize },
    /// Worker w renews the lease it believes it holds, for `ms`.
    Renew { w: usize, ms: i64 },
    /// Worker w renews with a made-up token.
    ForgeRenew { w: usize, token: i64 },
    /// Worker w performs the side effect if it holds a grant it has not used.
    Execute { w: usize },
    /// Worker w reports; `pick` chooses among the honest outcomes.
    Complete { w: usize, pick: u8 },
    /// Worker w reports with a made-up token.
    Forge { w: usize, token: i64 },
    /// Time passes.
    Advance { ms: i64 },
    /// The lease sweeper runs.
    Sweep,
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        4 => (0..WORKERS, prop_oneof![9 => Just(0u8), 1 => Just(1u8)]).prop_map(|(w, p)| Step::Acquire { w, p }),
        1 => (0..WORKERS).prop_map(|w| Step::LostAcquire { w }),
        2 => (0..WORKERS, 100i64..300).prop_map(|(w, ms)| Step::Renew { w, ms }),
        1 => (0..WORKERS, 0i64..6).prop_map(|(w, token)| Step::ForgeRenew { w, token }),
        3 => (0..WORKERS).prop_map(|w| Step::Execute { w }),
        3 => (0..WORKERS, 0u8..4).prop_map(|(w, pick)| Step::Complete { w, pick }),
        1 => (0..WORKERS, 0i64..6).prop_map(|(w, token)| Step::Forge { w, token }),
        2 => (1i64..250).prop_map(|ms| Step::Advance { ms }),
        1 => Just(Step::Sweep),
    ]
}

#[derive(Debug, Clone, Default)]
struct Worker {
    /// Token of the grant this worker believes it holds, and whether it executed under it.
    grant: Option<(i64, bool)>,
}

/// Workers 0 and 1 share a principal; worker 2 is another principal.
fn principal(w: usize) -> String {
    if w == 2 { "other".into() } else { "team".into() }
}

/// Worker 2 names the same holder string as worker 0 (another principal: another holder).
fn holder(w: usize) -> String {
    format!("h{}", if w == 2 { 0 } else { w })
}

fn actor(w: usize) -> Actor {
    Actor { principal: principal(w), request_id: None }
}

fn input(w: usize, p: u8, redo_safe: bool) -> AcquireInput {
    AcquireInput {
        tenant: "t".into(),
        key: "INQ-001:confirmation:v1".into(),
        action: "send".into(),
        payload: json!({ "to": p }),
        fingerprint: format!("fp{p}"),
        lease_ms: LEASE_MS,
        redo_safe,
        connector: None,
        holder: Some(holder(w)),
        actor: actor(w),
    }
}

fn run(steps: Vec<Step>, redo_safe: bool) -> Result<(), TestCaseError> {
    let policy = RetryPolicy { base_ms: 10, cap_ms: 50, max_attempts: 4, max_elapsed_ms: None };
    let mut now = 0i64;
    let mut rec: Option<OperationRecord> = None;
    let mut workers = vec![Worker::default(); WORKERS];
    let mut effects = 0u32; // side effects the provider saw
    let mut grants = 0i64;
    // Tokens start at the record's creation instant (the first grant is created_at + 1).
    let mut token_base: Option<i64> = None;
    let mut triggers = 0usize;
    let mut events = 0usize;
    let mut first_fp: Option<String> = None;

    for s in steps {
        let before = rec.clone();
        match s {
            Step::Acquire { w, p } => {
                triggers += 1;
                let plan = plan_acquire(rec.as_ref(), &input(w, p, redo_safe), now);
                events += plan.events.iter().filter(|e| e.kind != "lease_expired").count();
                check_grant(&plan, before.as_ref(), w, now, redo_safe, &mut grants, &mut token_base)?;
                match plan.decision {
                    Decision::Acquire => workers[w].grant = Some((plan.record.fencing_token, false)),
                    // Its own grant again (a resend after a lost reply): keep what the
                    // worker already knows about it (whether it executed).
                    Decision::AlreadyHeld => {
                        let t = plan.record.fencing_token;
                        if workers[w].grant.map(|g| g.0) != Some(t) {
                            workers[w].grant = Some((t, false));
                        }
                    }
                    _ => {}
                }
                rec = Some(plan.record);
            }
            Step::LostAcquire { w } => {
                triggers += 1;
                let plan = plan_acquire(rec.as_ref(), &input(w, 0, redo_safe), now);
                events += plan.events.iter().filter(|e| e.kind != "lease_expired").count();
                check_grant(&plan, before.as_ref(), w, now, redo_safe, &mut grants, &mut token_base)?;
                rec = Some(plan.record);
            }
            Step::Renew { w, ms } => {
                if let Some((token, _)) = workers[w].grant {
                    check_renewal(&mut rec, token, ms, w, now)?;
                }
            }
            Step::ForgeRenew { w, token } => {
                check_renewal(&mut rec, token, 200, w, now)?;
            }
            Step::Execute { w } => {
                if let Some((t, false)) = workers[w].grant {
                    effects += 1;
                    workers[w].grant = Some((t, true));
                }
            }
            Step::Complete { w, pick } => {
                let (Some((token, executed)), Some(r)) = (workers[w].grant, rec.as_ref()) else {
                    continue;
                };
                let outcome = match (executed, pick) {
                    (true, p) if p % 2 == 0 => {
                        Outcome::Succeeded { provider_ref: format!("msg-{token}"), result: None }
                    }
                    (true, _) | (false, 2) => Outcome::Unknown { message: None },
                    (false, 1) => {
                        Outcome::FinalFailure { error_class: "validation".into(), message: None, result: None }
                    }
                    (false, _) => Outcome::RetryableFailure {
                        error_class: "unavailable".into(),
                        message: None,
                        retry_after_ms: None,
                    },
                };
                match plan_completion(r, token, &outcome, &actor(w), &policy, 0.5, now) {
                    Ok(plan) => {
                        prop_assert_eq!(token, r.fencing_token, "only the current token completes");
                        rec = Some(plan.record);
                        workers[w].grant = None;
                    }
                    Err(_) => {
                        workers[w].grant = None;
                    }
                }
            }
            Step::Forge { w, token } => {
                let Some(r) = rec.as_ref() else { continue };
                let outcome = Outcome::Succeeded { provider_ref: "forged".into(), result: None };
                let res = plan_completion(r, token, &outcome, &actor(w), &policy, 0.5, now);
                if token != r.fencing_token {
                    // Invariant 1: a stale token is rejected (and the caller writes nothing).
                    let is_stale = matches!(res, Err(CompleteError::StaleToken { .. }));
                    prop_assert!(is_stale);
                } else if let Ok(plan) = res {
                    // A forger holding the current token is indistinguishable from the holder;
                    // keep the model honest by treating it as the holder's report only if it
                    // executed. Otherwise discard: the model has no dishonest workers.
                    if workers.iter().any(|wk| wk.grant == Some((token, true))) {
                        rec = Some(plan.record);
                    }
                }
            }
            Step::Advance { ms } => now += ms,
            Step::Sweep => {
                if let Some(r) = rec.as_ref()
                    && let Some((next, ev)) = plan_lease_expiry(r, now)
                {
                    prop_assert_eq!(ev.to_state, Some(State::Unknown));
                    rec = Some(next);
                }
            }
        }

        if let Some(r) = &rec {
            // Legal transitions only.
            if let Some(b) = &before
                && b.state != r.state
            {
                prop_assert!(b.state.can_become(r.state), "{} -> {}", b.state, r.state);
            }
            // Invariant 2: SUCCEEDED carries evidence, and evidence is truthful.
            if r.state == State::Succeeded {
                prop_assert!(r.provider_ref.as_deref().is_some_and(|p| !p.is_empty()));
                prop_assert!(effects >= 1, "SUCCEEDED without a side effect");
            }
            // Invariant 3: the key stays bound to its first fingerprint.
            let fp = first_fp.get_or_insert_with(|| r.fingerprint.clone());
            prop_assert_eq!(&r.fingerprint, fp);
            prop_assert_eq!(r.fencing_token, token_base.unwrap_or(r.created_at) + grants);
            // Invariant 1 (and 6): at most one worker holds the current fencing token.
            let holders = workers.iter().filter(|wk| wk.grant.is_some_and(|g| g.0 == r.fencing_token)).count();
            prop_assert!(holders <= 1, "{} workers hold token {}", holders, r.fencing_token);
        }
        // Invariant 5: every trigger is recorded; at most one side effect per intent
        // (unless the action was declared redo_safe, where the provider dedupes).
        prop_assert_eq!(events, triggers);
        if !redo_safe {
            prop_assert!(effects <= 1, "{} side effects", effects);
        }
    }
    Ok(())
}

/// Checks an acquire's plan: a grant raises the token by one and only from PENDING or an
/// expired lease of a redo-safe action (invariants 1 and 4); a grant returned to its holder
/// changes nothing and only goes to the principal and holder of the valid lease
/// (invariant 6); a mismatch changes nothing (invariant 3).
fn check_grant(
    plan: &idem_core::AcquirePlan,
    before: Option<&OperationRecord>,
    w: usize,
    now: i64,
    redo_safe: bool,
    grants: &mut i64,
    token_base: &mut Option<i64>,
) -> Result<(), TestCaseError> {
    match plan.decision {
        Decision::Acquire => {
            *grants += 1;
            let base = *token_base.get_or_insert(plan.record.created_at);
            prop_assert_eq!(plan.record.fencing_token, base + *grants);
            if let Some(prev) = before {
                let expired_redo_safe = prev.state == State::Executing && redo_safe && !prev.lease_valid_at(now);
                prop_assert!(prev.state == State::Pending || expired_redo_safe, "granted from {:?}", prev.state);
            }
        }
        Decision::AlreadyHeld => {
            let prev = before.expect("a grant returned needs a record");
            prop_assert!(!plan.changed);
            prop_assert_eq!(&plan.record, prev);
            prop_assert!(prev.lease_valid_at(now), "returned an expired lease");
            let (p, h) = (principal(w), holder(w));
            prop_assert_eq!(prev.lease_owner.as_deref(), Some(p.as_str()));
            prop_assert_eq!(prev.lease_holder.as_deref(), Some(h.as_str()));
        }
        Decision::Mismatch => prop_assert!(!plan.changed),
        _ => {}
    }
    Ok(())
}

/// Renews `r` with `token` for worker `w`: a renewal that is accepted extended the valid
/// lease of the current token (never an expired one, never another token's), and a
/// refused one changes nothing.
fn check_renewal(
    rec: &mut Option<OperationRecord>,
    token: i64,
    ms: i64,
    w: usize,
    now: i64,
) -> Result<(), TestCaseError> {
    let Some(r) = rec.as_ref() else { return Ok(()) };
    match plan_renewal(r, token, ms, &actor(w), now) {
        Ok((next, ev)) => {
            prop_assert_eq!(token, r.fencing_token, "renewed another token's lease");
            prop_assert!(r.lease_valid_at(now), "revived an expired lease");
            prop_assert_eq!(next.lease_expires_at, Some(now + ms));
            prop_assert_eq!((next.state, next.fencing_token), (State::Executing, r.fencing_token));
            prop_assert_eq!(ev.kind.as_str(), "lease_renewed");
            *rec = Some(next);
        }
        Err(RenewError::StaleToken { .. }) => prop_assert_ne!(token, r.fencing_token),
        Err(RenewError::LeaseExpired { .. } | RenewError::NotExecuting { .. }) => {
            prop_assert!(!r.lease_valid_at(now));
        }
        Err(e) => prop_assert!(false, "unexpected refusal {e}"),
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn invariants_hold_under_random_interleavings(steps in prop::collection::vec(step(), 1..60)) {
        run(steps, false)?;
    }

    #[test]
    fn redo_safe_actions_are_re_granted_but_stay_fenced(steps in prop::collection::vec(step(), 1..60)) {
        run(steps, true)?;
    }
}
