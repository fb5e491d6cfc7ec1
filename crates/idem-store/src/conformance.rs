//! The conformance suite every [`Store`] must pass (DESIGN.md §9).
//!
//! [`run_all`] runs each case on a fresh store made by the caller's factory, with a
//! [`ManualClock`] the case drives (lease expiry, retry schedules). Each case uses its own
//! tenants, so stores that share one database across cases (PostgreSQL) stay independent.
//! A failing case panics inside its own task; `run_all` reports every failed case by name
//! and then panics itself.

use crate::keys::Role;
use crate::{CompleteRequest, ListFilter, RenewRequest, Store, StoreError};
use idem_core::{AcquireInput, Actor, Clock, CompleteError, Decision, ManualClock, Outcome, RenewError, State};
use serde_json::json;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

/// What a case gets: a fresh store, the clock it reads, and a tenant name unique to the case.
#[derive(Clone)]
pub struct Harness {
    /// The store under test.
    pub store: Arc<dyn Store>,
    /// The clock the store reads; starts at 1 000 000 ms.
    pub clock: Arc<ManualClock>,
    /// A tenant name no other case uses.
    pub tenant: String,
}

type CaseFn = fn(Harness) -> Pin<Box<dyn Future<Output = ()> + Send>>;

macro_rules! cases {
    ($($name:ident),* $(,)?) => {
        /// Every case, by name.
        pub const CASES: &[(&str, CaseFn)] = &[$((stringify!($name), |h| Box::pin($name(h)))),*];
    };
}

cases!(
    new_key_is_granted_with_token_one,
    duplicate_while_executing_is_in_progress,
    success_is_replayed_with_evidence,
    mismatch_changes_nothing_and_logs_both_fingerprints,
    stale_token_is_rejected_and_changes_nothing,
    final_records_refuse_other_completions_but_accept_repeats,
    expired_lease_becomes_unknown_not_a_second_grant,
    redo_safe_expired_lease_is_re_granted_with_a_new_token,
    retryable_failure_schedules_a_fenced_retry,
    final_failure_is_replayed,
    late_completion_settles_unknown,
    sweeper_expires_leases_in_bounded_batches,
    tenants_are_isolated,
    list_filters_and_paginates,
    overview_counts_states_review_and_mismatches,
    api_keys_authenticate_until_revoked,
    the_last_admin_key_survives_concurrent_revocations,
    concurrent_acquires_grant_exactly_once,
    every_trigger_is_logged,
    expired_records_leave_tombstones_that_refuse_late_arrivals,
    sweeping_never_removes_records_that_are_not_final,
    the_same_holder_gets_its_grant_back_during_its_lease,
    renewal_extends_a_valid_lease_and_nothing_else,
    starts_are_idempotent_and_pin_their_definition,
    concurrent_starts_create_one_instance,
    checkpoints_are_the_step_operations,
    instance_writes_are_conditional,
    due_instances_are_claimed_by_one_runner_at_a_time,
    finished_instances_keep_their_steps_then_leave_tombstones,
    instances_list_with_filters_and_pages,
    compensations_are_checkpointed_and_reruns_repoint_steps,
    items_are_written_once_and_read_with_their_operations,
    reruns_repoint_items,
);

mod flow;
use flow::*;

/// The first fencing token of a key created at the harness clock's start (1 000 000 ms):
/// tokens start at the creation instant.
const T1: i64 = 1_000_001;

/// The store settings every case runs with: records kept 1 000 ms after completion
/// (`forever_action`: forever), tombstones 5 000 ms.
pub fn case_config() -> crate::StoreConfig {
    crate::StoreConfig {
        retention: idem_core::Retention {
            default_ms: Some(1_000),
            per_action: [("forever_action".to_string(), None)].into(),
            tombstone_ms: 5_000,
        },
        ..Default::default()
    }
}

/// Runs every case in [`CASES`]; `make` builds a fresh store reading the given clock, with
/// the settings of [`case_config`].
///
/// # Panics
/// After all cases ran, if any failed, naming each.
pub async fn run_all<F, Fut>(make: F)
where
    F: Fn(Arc<ManualClock>) -> Fut,
    Fut: Future<Output = Arc<dyn Store>>,
{
    let run_id = uuid::Uuid::now_v7().simple().to_string();
    let mut failed = Vec::new();
    for (i, (name, case)) in CASES.iter().enumerate() {
        let clock = Arc::new(ManualClock::new(1_000_000));
        let store = make(clock.clone()).await;
        let h = Harness { store, clock, tenant: format!("t{}-{i}", &run_id[run_id.len() - 10..]) };
        match tokio::spawn(case(h)).await {
            Ok(()) => eprintln!("conformance: {name} ... ok"),
            Err(e) => {
                eprintln!("conformance: {name} ... FAILED: {e}");
                failed.push(*name);
            }
        }
    }
    assert!(failed.is_empty(), "conformance cases failed: {failed:?}");
}

fn actor(p: &str) -> Actor {
    Actor { principal: p.into(), request_id: Some(format!("req-{p}")) }
}

fn input(h: &Harness, key: &str, fp: &str) -> AcquireInput {
    AcquireInput {
        tenant: h.tenant.clone(),
        key: key.into(),
        action: "send_confirmation".into(),
        payload: json!({"to": fp, "template": "confirmation"}),
        fingerprint: format!("fp-{fp}"),
        lease_ms: 1_000,
        redo_safe: false,
        connector: None,
        holder: None,
        actor: actor("worker-a"),
    }
}

fn complete(h: &Harness, key: &str, token: i64, outcome: Outcome) -> CompleteRequest {
    CompleteRequest {
        tenant: h.tenant.clone(),
        key: key.into(),
        fencing_token: token,
        outcome,
        actor: actor("worker-a"),
        policy: None,
    }
}

fn success(r: &str) -> Outcome {
    Outcome::Succeeded { provider_ref: r.into(), result: Some(json!({"message_id": r})) }
}

async fn new_key_is_granted_with_token_one(h: Harness) {
    let out = h.store.acquire(input(&h, "INQ-001:confirmation:v1", "P1")).await.unwrap();
    assert_eq!(out.decision, Decision::Acquire);
    let r = out.record;
    assert_eq!((r.state, r.fencing_token, r.attempt_count), (State::Executing, T1, 1));
    assert_eq!(r.lease_expires_at, Some(1_001_000));
    assert_eq!(r.lease_owner.as_deref(), Some("worker-a"));
    let stored = h.store.get(&h.tenant, "INQ-001:confirmation:v1").await.unwrap().unwrap();
    assert_eq!(stored, r, "the answer is what was stored");
    assert_eq!(stored.payload, json!({"to": "P1", "template": "confirmation"}));
}

async fn duplicate_while_executing_is_in_progress(h: Harness) {
    h.store.acquire(input(&h, "k", "P1")).await.unwrap();
    h.clock.advance(400);
    let dup = h.store.acquire(input(&h, "k", "P1")).await.unwrap();
    assert_eq!(dup.decision, Decision::InProgress { retry_after_ms: 600 });
    assert_eq!(dup.record.fencing_token, T1);
}

async fn success_is_replayed_with_evidence(h: Harness) {
    let t = h.store.acquire(input(&h, "k", "P1")).await.unwrap().record.fencing_token;
    let done = h.store.complete(complete(&h, "k", t, success("msg-001"))).await.unwrap();
    assert!(done.changed);
    assert_eq!(done.record.state, State::Succeeded);
    assert_eq!(done.record.verified_at, Some(1_000_000));
    assert_eq!(done.record.evidence_source.as_deref(), Some("caller"));
    h.clock.advance(5_000);
    let again = h.store.acquire(input(&h, "k", "P1")).await.unwrap();
    assert_eq!(again.decision, Decision::Replay);
    assert_eq!(again.record.provider_ref.as_deref(), Some("msg-001"));
    assert_eq!(again.record.result, Some(json!({"message_id": "msg-001"})));
    assert_eq!(again.record.attempt_count, 1, "two triggers, one attempt");
}

async fn mismatch_changes_nothing_and_logs_both_fingerprints(h: Harness) {
    let t = h.store.acquire(input(&h, "k", "P1")).await.unwrap().record.fencing_token;
    h.store.complete(complete(&h, "k", t, success("m"))).await.unwrap();
    let before = h.store.get(&h.tenant, "k").await.unwrap().unwrap();
    let other = h.store.acquire(input(&h, "k", "P2")).await.unwrap();
    assert_eq!(other.decision, Decision::Mismatch);
    let after = h.store.get(&h.tenant, "k").await.unwrap().unwrap();
    assert_eq!(before, after, "a mismatch writes nothing to the record");
    assert_eq!(after.payload["to"], "P1");
    let events = h.store.events(&h.tenant, "k").await.unwrap();
    let m = events.iter().find(|e| e.kind == "mismatch").expect("mismatch logged");
    assert_eq!(m.fingerprint.as_deref(), Some("fp-P2"));
    assert!(m.reason.as_deref().unwrap().contains("fp-P1"), "{m:?}");
    let mut other_action = input(&h, "k", "P1");
    other_action.action = "create_ticket".into();
    assert_eq!(h.store.acquire(other_action).await.unwrap().decision, Decision::Mismatch);
}

async fn stale_token_is_rejected_and_changes_nothing(h: Harness) {
    h.store.acquire(input(&h, "k", "P1")).await.unwrap();
    let before = h.store.get(&h.tenant, "k").await.unwrap().unwrap();
    let err = h.store.complete(complete(&h, "k", 7, success("m"))).await.unwrap_err();
    assert!(matches!(err, StoreError::Complete(CompleteError::StaleToken { presented: 7, current: T1 })), "{err}");
    assert_eq!(h.store.get(&h.tenant, "k").await.unwrap().unwrap(), before);
    let missing = h.store.complete(complete(&h, "nope", 1, success("m"))).await.unwrap_err();
    assert!(matches!(missing, StoreError::NotFound), "{missing}");
}

async fn final_records_refuse_other_completions_but_accept_repeats(h: Harness) {
    let t = h.store.acquire(input(&h, "k", "P1")).await.unwrap().record.fencing_token;
    h.store.complete(complete(&h, "k", t, success("m"))).await.unwrap();
    let before = h.store.get(&h.tenant, "k").await.unwrap().unwrap();
    let repeat = h.store.complete(complete(&h, "k", t, success("m"))).await.unwrap();
    assert!(!repeat.changed);
    let fail = Outcome::FinalFailure { error_class: "validation".into(), message: None, result: None };
    let err = h.store.complete(complete(&h, "k", t, fail)).await.unwrap_err();
    assert!(matches!(err, StoreError::Complete(CompleteError::AlreadyFinal { state: State::Succeeded })), "{err}");
    assert_eq!(h.store.get(&h.tenant, "k").await.unwrap().unwrap(), before);
    let completions = h.store.events(&h.tenant, "k").await.unwrap().iter().filter(|e| e.kind == "completed").count();
    assert_eq!(completions, 1);
}

async fn expired_lease_becomes_unknown_not_a_second_grant(h: Harness) {
    h.store.acquire(input(&h, "k", "P1")).await.unwrap();
    h.clock.advance(1_000);
    let t = h.store.acquire(input(&h, "k", "P1")).await.unwrap();
    assert_eq!(t.decision, Decision::ExpireToUnknown);
    assert_eq!(t.record.state, State::Unknown);
    assert_eq!(t.record.fencing_token, T1, "no new grant");
    h.clock.advance(60_000);
    let again = h.store.acquire(input(&h, "k", "P1")).await.unwrap();
    assert_eq!(again.decision, Decision::Unknown);
    assert_eq!(again.record.attempt_count, 1);
    let kinds: Vec<String> = h.store.events(&h.tenant, "k").await.unwrap().into_iter().map(|e| e.kind).collect();
    assert_eq!(kinds, ["acquired", "lease_expired", "unknown_pending", "unknown_pending"]);
}

async fn redo_safe_expired_lease_is_re_granted_with_a_new_token(h: Harness) {
    let mut i = input(&h, "k", "P1");
    i.redo_safe = true;
    h.store.acquire(i.clone()).await.unwrap();
    h.clock.advance(1_500);
    let second = h.store.acquire(i).await.unwrap();
    assert_eq!(second.decision, Decision::Acquire);
    assert_eq!((second.record.fencing_token, second.record.attempt_count), (T1 + 1, 2));
    let err = h.store.complete(complete(&h, "k", T1, success("m"))).await.unwrap_err();
    assert!(matches!(err, StoreError::Complete(CompleteError::StaleToken { .. })), "{err}");
    h.store.complete(complete(&h, "k", T1 + 1, success("m"))).await.unwrap();
}

async fn retryable_failure_schedules_a_fenced_retry(h: Harness) {
    h.store.acquire(input(&h, "k", "P1")).await.unwrap();
    let retry = Outcome::RetryableFailure {
        error_class: "unavailable".into(),
        message: Some("503".into()),
        retry_after_ms: Some(2_000),
    };
    let r = h.store.complete(complete(&h, "k", T1, retry)).await.unwrap().record;
    assert_eq!(r.state, State::Pending);
    assert!(r.next_attempt_at.unwrap() >= 1_002_000);
    let wait = r.next_attempt_at.unwrap() - 1_000_000;
    let early = h.store.acquire(input(&h, "k", "P1")).await.unwrap();
    assert_eq!(early.decision, Decision::RetryNotDue { retry_after_ms: wait });
    h.clock.advance(wait);
    let due = h.store.acquire(input(&h, "k", "P1")).await.unwrap();
    assert_eq!(due.decision, Decision::Acquire);
    assert_eq!((due.record.fencing_token, due.record.attempt_count), (T1 + 1, 2));
    let ev = h.store.events(&h.tenant, "k").await.unwrap();
    let c = ev.iter().find(|e| e.kind == "completed").unwrap();
    assert_eq!((c.error_class.as_deref(), c.wait_ms), (Some("unavailable"), Some(wait)));
}

async fn final_failure_is_replayed(h: Harness) {
    h.store.acquire(input(&h, "k", "P1")).await.unwrap();
    let fail = Outcome::FinalFailure {
        error_class: "validation".into(),
        message: Some("invalid recipient".into()),
        result: Some(json!({"status": 550})),
    };
    let r = h.store.complete(complete(&h, "k", T1, fail)).await.unwrap().record;
    assert_eq!(r.state, State::Failed);
    let again = h.store.acquire(input(&h, "k", "P1")).await.unwrap();
    assert_eq!(again.decision, Decision::Replay);
    assert_eq!(again.record.error_class.as_deref(), Some("validation"));
    assert_eq!(again.record.result, Some(json!({"status": 550})));
}

async fn late_completion_settles_unknown(h: Harness) {
    h.store.acquire(input(&h, "k", "P1")).await.unwrap();
    h.clock.advance(2_000);
    // Stores sharing a database across cases may expire other cases' leases too.
    assert!(h.store.expire_leases(1_000).await.unwrap() >= 1);
    assert_eq!(h.store.get(&h.tenant, "k").await.unwrap().unwrap().state, State::Unknown);
    let r = h.store.complete(complete(&h, "k", T1, success("m-late"))).await.unwrap().record;
    assert_eq!(r.state, State::Succeeded);
    assert_eq!(r.provider_ref.as_deref(), Some("m-late"));
}

async fn sweeper_expires_leases_in_bounded_batches(h: Harness) {
    let other = format!("{}-b", h.tenant);
    for k in ["a", "b", "c"] {
        h.store.acquire(input(&h, k, "P1")).await.unwrap();
    }
    let mut i = input(&h, "d", "P1");
    i.tenant = other.clone();
    h.store.acquire(i).await.unwrap();
    let mut safe = input(&h, "safe", "P1");
    safe.redo_safe = true;
    h.store.acquire(safe).await.unwrap();
    assert_eq!(h.store.expire_leases(100).await.unwrap(), 0, "nothing expired yet");
    h.clock.advance(1_000);
    // Other cases may share the database: count only ours afterwards.
    let mut total = 0;
    loop {
        let n = h.store.expire_leases(2).await.unwrap();
        assert!(n <= 2, "bounded batch");
        total += n;
        if n == 0 {
            break;
        }
    }
    assert!(total >= 4);
    for (t, k) in [(&h.tenant, "a"), (&h.tenant, "b"), (&h.tenant, "c"), (&other, "d")] {
        assert_eq!(h.store.get(t, k).await.unwrap().unwrap().state, State::Unknown);
    }
    assert_eq!(h.store.get(&h.tenant, "safe").await.unwrap().unwrap().state, State::Executing);
}

async fn tenants_are_isolated(h: Harness) {
    let b = format!("{}-b", h.tenant);
    h.store.acquire(input(&h, "shared-key", "P1")).await.unwrap();
    assert!(h.store.get(&b, "shared-key").await.unwrap().is_none());
    assert!(h.store.events(&b, "shared-key").await.unwrap().is_empty());
    let mut ib = input(&h, "shared-key", "OTHER");
    ib.tenant = b.clone();
    let out = h.store.acquire(ib).await.unwrap();
    assert_eq!(out.decision, Decision::Acquire, "B's key is its own, never a mismatch with A's");
    let err = h
        .store
        .complete(CompleteRequest {
            tenant: b.clone(),
            key: "shared-key".into(),
            fencing_token: T1,
            outcome: success("b"),
            actor: actor("b"),
            policy: None,
        })
        .await;
    assert!(err.is_ok());
    assert_eq!(h.store.get(&h.tenant, "shared-key").await.unwrap().unwrap().state, State::Executing);
    let page = h.store.list(&b, &ListFilter { limit: 50, ..Default::default() }).await.unwrap();
    assert_eq!(page.items.len(), 1);
    assert_eq!(page.items[0].tenant, b);
}

async fn list_filters_and_paginates(h: Harness) {
    for i in 0..7 {
        let k = format!("k{i}");
        h.store.acquire(input(&h, &k, "P1")).await.unwrap();
        if i % 2 == 0 {
            h.store.complete(complete(&h, &k, T1, success("m"))).await.unwrap();
        }
    }
    let mut seen = Vec::new();
    let mut cursor = None;
    loop {
        let f = ListFilter { limit: 3, cursor, ..Default::default() };
        let page = h.store.list(&h.tenant, &f).await.unwrap();
        seen.extend(page.items.iter().map(|r| r.key.clone()));
        match page.next_cursor {
            Some(c) => cursor = Some(c),
            None => break,
        }
    }
    assert_eq!(seen, ["k6", "k5", "k4", "k3", "k2", "k1", "k0"], "newest first, no gaps or repeats");
    let f = ListFilter { state: Some(State::Succeeded), limit: 50, ..Default::default() };
    assert_eq!(h.store.list(&h.tenant, &f).await.unwrap().items.len(), 4);
    let f = ListFilter { action: Some("other".into()), limit: 50, ..Default::default() };
    assert!(h.store.list(&h.tenant, &f).await.unwrap().items.is_empty());
    let f = ListFilter { needs_review: Some(false), limit: 50, ..Default::default() };
    assert_eq!(h.store.list(&h.tenant, &f).await.unwrap().items.len(), 7);
    // Key prefix: exact and case-sensitive; SQL wildcards are plain characters.
    h.clock.advance(1_000);
    h.store.acquire(input(&h, "k%_x", "P1")).await.unwrap();
    let keys = |f: ListFilter| {
        let store = h.store.clone();
        let tenant = h.tenant.clone();
        async move { store.list(&tenant, &f).await.unwrap().items.into_iter().map(|r| r.key).collect::<Vec<_>>() }
    };
    assert_eq!(keys(ListFilter { key_prefix: Some("k%".into()), limit: 50, ..Default::default() }).await, ["k%_x"]);
    assert_eq!(keys(ListFilter { key_prefix: Some("k1".into()), limit: 50, ..Default::default() }).await, ["k1"]);
    assert!(keys(ListFilter { key_prefix: Some("K".into()), limit: 50, ..Default::default() }).await.is_empty());
    // Time range: [created_from, created_before).
    let late = h.clock.now_ms();
    let f = ListFilter { created_from: Some(late), limit: 50, ..Default::default() };
    assert_eq!(keys(f).await, ["k%_x"]);
    let f = ListFilter { created_before: Some(late), limit: 50, ..Default::default() };
    assert_eq!(keys(f).await.len(), 7);
}

async fn overview_counts_states_review_and_mismatches(h: Harness) {
    for k in ["a", "b", "c"] {
        h.store.acquire(input(&h, k, "P1")).await.unwrap();
    }
    h.store.complete(complete(&h, "a", T1, success("m"))).await.unwrap();
    h.store.complete(complete(&h, "b", T1, Outcome::Unknown { message: Some("timeout".into()) })).await.unwrap();
    let mismatch = h.store.acquire(input(&h, "a", "P2")).await.unwrap();
    assert_eq!(mismatch.decision, Decision::Mismatch);
    let now = h.clock.now_ms();
    let o = h.store.overview(Some(&h.tenant), now + 1, 10).await.unwrap();
    assert_eq!(o.count_state(State::Succeeded), 1);
    assert_eq!(o.count_state(State::Unknown), 1);
    assert_eq!(o.count_state(State::Executing), 1);
    assert_eq!(o.unknown_stale, 1, "b has been UNKNOWN since before now + 1");
    assert_eq!(h.store.overview(Some(&h.tenant), now, 10).await.unwrap().unknown_stale, 0);
    assert_eq!(o.recent_mismatches.len(), 1);
    assert_eq!(o.recent_mismatches[0].key, "a");
    // Another tenant sees none of it; all tenants together see at least it.
    let other = h.store.overview(Some(&format!("{}-other", h.tenant)), now + 1, 10).await.unwrap();
    assert!(other.groups.is_empty() && other.recent_mismatches.is_empty() && other.unknown_stale == 0);
    let all = h.store.overview(None, now + 1, 10).await.unwrap();
    assert!(all.count_state(State::Unknown) >= 1);
}

async fn api_keys_authenticate_until_revoked(h: Harness) {
    let (info, secret) = h.store.create_api_key(&h.tenant, "ci-bot", Role::Operator, None).await.unwrap();
    assert!(secret.starts_with("idem_") && secret.len() == 69);
    let found = h.store.authenticate(&secret).await.unwrap().unwrap();
    assert_eq!(found, info);
    assert!(h.store.authenticate("idem_wrong").await.unwrap().is_none());
    assert!(h.store.count_api_keys().await.unwrap() >= 1);
    let supplied = "bootstrap-secret-0123456789abcdef0123".to_string();
    h.store.create_api_key(&h.tenant, "boot", Role::Admin, Some(supplied.clone())).await.unwrap();
    let dup = h.store.create_api_key(&h.tenant, "boot2", Role::Admin, Some(supplied)).await;
    assert!(matches!(dup, Err(StoreError::Invalid(_))));
    assert!(matches!(h.store.create_api_key("bad tenant", "p", Role::Client, None).await, Err(StoreError::Invalid(_))));
    let mine = h.store.list_api_keys(Some(&h.tenant)).await.unwrap();
    assert_eq!(mine.len(), 2);
    assert!(h.store.revoke_api_key(&info.id).await.unwrap());
    assert!(!h.store.revoke_api_key(&info.id).await.unwrap());
    assert!(h.store.authenticate(&secret).await.unwrap().is_none());
}

/// Two admins revoking each other at the same moment: exactly one revocation happens, the
/// tenant keeps an admin key; other roles and other tenants' keys are unaffected.
async fn the_last_admin_key_survives_concurrent_revocations(h: Harness) {
    use crate::keys::Revocation;
    for round in 0..8 {
        let tenant = format!("{}-admins-{round}", h.tenant);
        let (a, _) = h.store.create_api_key(&tenant, "a", Role::Admin, None).await.unwrap();
        let (b, _) = h.store.create_api_key(&tenant, "b", Role::Admin, None).await.unwrap();
        let (c, _) = h.store.create_api_key(&tenant, "c", Role::Client, None).await.unwrap();
        let (x, y) = tokio::join!(
            h.store.revoke_api_key_keeping_an_admin(&tenant, &a.id),
            h.store.revoke_api_key_keeping_an_admin(&tenant, &b.id)
        );
        let mut got = [x.unwrap(), y.unwrap()];
        got.sort_by_key(|r| *r as u8);
        assert_eq!(got, [Revocation::Revoked, Revocation::LastAdmin], "round {round}");
        let live = h.store.list_api_keys(Some(&tenant)).await.unwrap();
        assert_eq!(live.iter().filter(|k| k.role == Role::Admin && k.revoked_at.is_none()).count(), 1);
        assert_eq!(
            h.store.revoke_api_key_keeping_an_admin(&format!("{tenant}-other"), &c.id).await.unwrap(),
            Revocation::NotFound,
            "another tenant's key"
        );
        assert_eq!(h.store.revoke_api_key_keeping_an_admin(&tenant, &c.id).await.unwrap(), Revocation::Revoked);
        assert_eq!(h.store.revoke_api_key_keeping_an_admin(&tenant, &c.id).await.unwrap(), Revocation::NotFound);
    }
}

async fn concurrent_acquires_grant_exactly_once(h: Harness) {
    for round in 0..5 {
        let key = format!("race-{round}");
        let tasks: Vec<_> = (0..32)
            .map(|_| {
                let (s, i) = (h.store.clone(), input(&h, &key, "P1"));
                tokio::spawn(async move { s.acquire(i).await.unwrap().decision })
            })
            .collect();
        let mut grants = 0;
        for t in tasks {
            match t.await.unwrap() {
                Decision::Acquire => grants += 1,
                Decision::InProgress { .. } => {}
                d => panic!("unexpected {d:?}"),
            }
        }
        assert_eq!(grants, 1, "round {round}");
        let ev = h.store.events(&h.tenant, &key).await.unwrap();
        assert_eq!(ev.len(), 32, "every trigger logged");
    }
}

async fn every_trigger_is_logged(h: Harness) {
    let t = h.store.acquire(input(&h, "k", "P1")).await.unwrap().record.fencing_token;
    h.store.acquire(input(&h, "k", "P1")).await.unwrap();
    h.store.complete(complete(&h, "k", t, success("m"))).await.unwrap();
    h.store.acquire(input(&h, "k", "P1")).await.unwrap();
    h.store.acquire(input(&h, "k", "P2")).await.unwrap();
    let ev = h.store.events(&h.tenant, "k").await.unwrap();
    let kinds: Vec<&str> = ev.iter().map(|e| e.kind.as_str()).collect();
    assert_eq!(kinds, ["acquired", "in_progress", "completed", "replayed", "mismatch"]);
    assert!(ev.windows(2).all(|w| w[0].seq < w[1].seq));
    assert!(ev.iter().all(|e| e.request_id.as_deref() == Some("req-worker-a")));
    let c = &ev[2];
    assert_eq!((c.from_state, c.to_state), (Some(State::Executing), Some(State::Succeeded)));
}

async fn expired_records_leave_tombstones_that_refuse_late_arrivals(h: Harness) {
    let t = h.store.acquire(input(&h, "INQ-007", "P1")).await.unwrap().record.fencing_token;
    let done = h.store.complete(complete(&h, "INQ-007", t, success("m-7"))).await.unwrap().record;
    assert_eq!(done.expires_at, Some(1_001_000), "expires 1 000 ms after completion");
    h.clock.advance(999);
    h.store.sweep(100).await.unwrap();
    assert!(h.store.get(&h.tenant, "INQ-007").await.unwrap().is_some(), "kept until its retention ends");
    h.clock.advance(1);
    assert!(h.store.sweep(100).await.unwrap().records >= 1);
    assert!(h.store.get(&h.tenant, "INQ-007").await.unwrap().is_none());
    assert!(h.store.events(&h.tenant, "INQ-007").await.unwrap().is_empty(), "its events go with it");
    for fp in ["P1", "P2"] {
        let late = h.store.acquire(input(&h, "INQ-007", fp)).await.unwrap();
        assert_eq!(late.decision, Decision::Late, "late arrival ({fp})");
        assert_eq!(late.record.state, State::Succeeded);
    }
    assert!(h.store.get(&h.tenant, "INQ-007").await.unwrap().is_none(), "a late arrival executes nothing");
    // Another tenant's same key is not affected by this tombstone.
    let mut other = input(&h, "INQ-007", "P1");
    other.tenant = format!("{}-b", h.tenant);
    assert_eq!(h.store.acquire(other).await.unwrap().decision, Decision::Acquire);
    // The tombstone lives 5 000 ms from completion; then the key is new again.
    h.clock.advance(4_000);
    assert!(h.store.sweep(100).await.unwrap().tombstones >= 1);
    let again = h.store.acquire(input(&h, "INQ-007", "P2")).await.unwrap();
    assert_eq!(again.decision, Decision::Acquire);
    // A new operation under the old key: the old operation's token is stale for it.
    assert!(again.record.fencing_token > t, "tokens never repeat across operations of one key");
    let stale = h.store.complete(complete(&h, "INQ-007", t, success("from-the-old-worker"))).await.unwrap_err();
    assert!(matches!(stale, StoreError::Complete(CompleteError::StaleToken { .. })), "{stale}");
}

async fn sweeping_never_removes_records_that_are_not_final(h: Harness) {
    h.store.acquire(input(&h, "executing", "P1")).await.unwrap();
    h.store.acquire(input(&h, "pending", "P1")).await.unwrap();
    let retry = Outcome::RetryableFailure {
        error_class: "unavailable".into(),
        message: None,
        retry_after_ms: Some(86_400_000),
    };
    h.store.complete(complete(&h, "pending", T1, retry)).await.unwrap();
    h.store.acquire(input(&h, "unknown", "P1")).await.unwrap();
    h.store.complete(complete(&h, "unknown", T1, Outcome::Unknown { message: None })).await.unwrap();
    let mut forever = input(&h, "forever", "P1");
    forever.action = "forever_action".into();
    h.store.acquire(forever).await.unwrap();
    let mut forever_done = complete(&h, "forever", T1, success("f"));
    forever_done.key = "forever".into();
    let rec = h.store.complete(forever_done).await.unwrap().record;
    assert_eq!(rec.expires_at, None, "a permanent key never expires");
    h.clock.advance(10 * 365 * 86_400_000);
    while h.store.sweep(100).await.unwrap() != crate::SweepOutcome::default() {}
    for k in ["executing", "pending", "unknown", "forever"] {
        assert!(h.store.get(&h.tenant, k).await.unwrap().is_some(), "{k} was swept");
    }
}

/// A trigger of `key` by `principal` naming the holder identity `holder`.
fn held_by(h: &Harness, key: &str, principal: &str, holder: Option<&str>) -> AcquireInput {
    let mut i = input(h, key, "P1");
    i.actor = Actor { principal: principal.into(), request_id: holder.map(str::to_owned) };
    i.holder = holder.map(str::to_owned);
    i
}

async fn the_same_holder_gets_its_grant_back_during_its_lease(h: Harness) {
    let mine = || held_by(&h, "INV-88:send", "worker-a", Some("w7-attempt-1"));
    let first = h.store.acquire(mine()).await.unwrap();
    assert_eq!(first.decision, Decision::Acquire);
    assert_eq!(first.record.lease_holder.as_deref(), Some("w7-attempt-1"));
    h.clock.advance(300);
    // The resent request (its reply was lost): the same grant, unchanged.
    let again = h.store.acquire(mine()).await.unwrap();
    assert_eq!(again.decision, Decision::AlreadyHeld);
    assert_eq!(again.record, first.record, "same token, lease end, attempt, version");
    assert_eq!(h.store.get(&h.tenant, "INV-88:send").await.unwrap().unwrap(), first.record, "nothing written");
    // Anyone else is another worker: another holder, the same holder string of another
    // principal, or a trigger that names no holder.
    for other in [
        held_by(&h, "INV-88:send", "worker-a", Some("w8-attempt-1")),
        held_by(&h, "INV-88:send", "worker-b", Some("w7-attempt-1")),
        held_by(&h, "INV-88:send", "worker-a", None),
    ] {
        let d = h.store.acquire(other).await.unwrap().decision;
        assert_eq!(d, Decision::InProgress { retry_after_ms: 700 });
    }
    let kinds: Vec<String> =
        h.store.events(&h.tenant, "INV-88:send").await.unwrap().into_iter().map(|e| e.kind).collect();
    assert_eq!(
        kinds,
        ["acquired", "already_held", "in_progress", "in_progress", "in_progress"],
        "every trigger logged"
    );
    // After the lease expired the old rules apply, holder or not.
    h.clock.advance(700);
    assert_eq!(h.store.acquire(mine()).await.unwrap().decision, Decision::ExpireToUnknown);
    let mut safe = held_by(&h, "safe", "worker-a", Some("w7-attempt-1"));
    safe.redo_safe = true;
    let t = h.store.acquire(safe.clone()).await.unwrap().record.fencing_token;
    h.clock.advance(1_000);
    let regrant = h.store.acquire(safe).await.unwrap();
    assert_eq!(regrant.decision, Decision::Acquire);
    assert_eq!(
        (regrant.record.fencing_token, regrant.record.attempt_count),
        (t + 1, 2),
        "a new grant, not the old one"
    );
}

fn renewal(h: &Harness, key: &str, token: i64, lease_ms: i64) -> RenewRequest {
    RenewRequest { tenant: h.tenant.clone(), key: key.into(), fencing_token: token, lease_ms, actor: actor("worker-a") }
}

async fn renewal_extends_a_valid_lease_and_nothing_else(h: Harness) {
    let t = h.store.acquire(input(&h, "k", "P1")).await.unwrap().record.fencing_token;
    h.clock.advance(900);
    let renewed = h.store.renew(renewal(&h, "k", t, 2_000)).await.unwrap();
    assert_eq!(renewed.lease_expires_at, Some(1_002_900), "now + lease_ms");
    assert_eq!((renewed.state, renewed.fencing_token, renewed.attempt_count), (State::Executing, t, 1));
    assert_eq!(h.store.get(&h.tenant, "k").await.unwrap().unwrap(), renewed);
    // Past the original end (1 001 000) the lease still holds.
    h.clock.advance(1_500);
    let dup = h.store.acquire(input(&h, "k", "P1")).await.unwrap();
    assert_eq!(dup.decision, Decision::InProgress { retry_after_ms: 500 });
    h.store.expire_leases(1_000).await.unwrap();
    assert_eq!(h.store.get(&h.tenant, "k").await.unwrap().unwrap().state, State::Executing);
    // Another token renews nothing.
    let err = h.store.renew(renewal(&h, "k", t + 5, 2_000)).await.unwrap_err();
    assert!(
        matches!(err, StoreError::Renew(RenewError::StaleToken { presented, current }) if presented == t + 5 && current == t),
        "{err}"
    );
    // An expired lease is never revived, whether or not the sweeper saw it yet.
    h.clock.advance(500);
    let err = h.store.renew(renewal(&h, "k", t, 2_000)).await.unwrap_err();
    assert!(matches!(err, StoreError::Renew(RenewError::LeaseExpired { expired_at: Some(1_002_900), .. })), "{err}");
    assert_eq!(h.store.get(&h.tenant, "k").await.unwrap().unwrap(), renewed, "a refusal writes nothing");
    h.store.expire_leases(1_000).await.unwrap();
    let err = h.store.renew(renewal(&h, "k", t, 2_000)).await.unwrap_err();
    assert!(matches!(err, StoreError::Renew(RenewError::LeaseExpired { .. })), "UNKNOWN: {err}");
    // The worker reports what happened instead (a late completion).
    let done = h.store.complete(complete(&h, "k", t, success("m"))).await.unwrap().record;
    assert_eq!(done.state, State::Succeeded);
    let err = h.store.renew(renewal(&h, "k", t, 2_000)).await.unwrap_err();
    assert!(matches!(err, StoreError::Renew(RenewError::NotExecuting { state: State::Succeeded })), "{err}");
    let kinds: Vec<String> = h.store.events(&h.tenant, "k").await.unwrap().into_iter().map(|e| e.kind).collect();
    assert_eq!(kinds, ["acquired", "lease_renewed", "in_progress", "lease_expired", "completed"]);
    // FAILED and PENDING records have no lease to renew either.
    let failed = h.store.acquire(input(&h, "failed", "P1")).await.unwrap().record.fencing_token;
    let fail = Outcome::FinalFailure { error_class: "validation".into(), message: None, result: None };
    h.store.complete(complete(&h, "failed", failed, fail)).await.unwrap();
    let err = h.store.renew(renewal(&h, "failed", failed, 2_000)).await.unwrap_err();
    assert!(matches!(err, StoreError::Renew(RenewError::NotExecuting { state: State::Failed })), "{err}");
    let pending = h.store.acquire(input(&h, "pending", "P1")).await.unwrap().record.fencing_token;
    let retry = Outcome::RetryableFailure { error_class: "unavailable".into(), message: None, retry_after_ms: None };
    h.store.complete(complete(&h, "pending", pending, retry)).await.unwrap();
    let err = h.store.renew(renewal(&h, "pending", pending, 2_000)).await.unwrap_err();
    assert!(matches!(err, StoreError::Renew(RenewError::NotExecuting { state: State::Pending })), "{err}");
    let missing = h.store.renew(renewal(&h, "nope", 1, 2_000)).await.unwrap_err();
    assert!(matches!(missing, StoreError::NotFound), "{missing}");
}
