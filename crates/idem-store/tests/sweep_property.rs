//! Property: a sweep removes exactly the final records whose retention ended — never a
//! PENDING, EXECUTING or UNKNOWN one — under random interleavings of acquires,
//! completions, lease expiry and clock jumps (SQLite store, manual clock).

use idem_core::{AcquireInput, Actor, ManualClock, Outcome, State};
use idem_store::{CompleteRequest, Store, conformance::case_config, sqlite::SqliteStore};
use proptest::prelude::*;
use serde_json::json;
use std::sync::Arc;

#[derive(Debug, Clone)]
enum Step {
    Acquire(u8),
    Complete(u8, u8),
    Advance(i64),
    ExpireLeases,
    Sweep,
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        3 => (0u8..5).prop_map(Step::Acquire),
        3 => (0u8..5, 0u8..4).prop_map(|(k, o)| Step::Complete(k, o)),
        2 => (0i64..2_500).prop_map(Step::Advance),
        1 => Just(Step::ExpireLeases),
        2 => Just(Step::Sweep),
    ]
}

fn outcome(o: u8) -> Outcome {
    match o {
        0 => Outcome::Succeeded { provider_ref: "m".into(), result: None },
        1 => Outcome::FinalFailure { error_class: "validation".into(), message: None, result: None },
        2 => Outcome::RetryableFailure { error_class: "unavailable".into(), message: None, retry_after_ms: Some(100) },
        _ => Outcome::Unknown { message: None },
    }
}

async fn run(steps: Vec<Step>) -> Result<(), TestCaseError> {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::new(1_000_000));
    let store = SqliteStore::open(dir.path().join("p.db"), clock.clone(), case_config()).await.unwrap();
    let keys: Vec<String> = (0..5).map(|i| format!("k{i}")).collect();
    for s in steps {
        match s {
            Step::Acquire(k) => {
                let mut input = AcquireInput {
                    tenant: "t".into(),
                    key: keys[k as usize].clone(),
                    action: if k == 4 { "forever_action".into() } else { "send".into() },
                    payload: json!({}),
                    fingerprint: "f".into(),
                    lease_ms: 500,
                    redo_safe: false,
                    connector: None,
                    holder: None,
                    actor: Actor::default(),
                };
                input.actor.principal = "w".into();
                store.acquire(input).await.unwrap();
            }
            Step::Complete(k, o) => {
                let key = &keys[k as usize];
                if let Some(rec) = store.get("t", key).await.unwrap() {
                    let _ = store
                        .complete(CompleteRequest {
                            tenant: "t".into(),
                            key: key.clone(),
                            fencing_token: rec.fencing_token,
                            outcome: outcome(o),
                            actor: Actor::default(),
                            policy: None,
                        })
                        .await;
                }
            }
            Step::Advance(ms) => clock.advance(ms),
            Step::ExpireLeases => {
                store.expire_leases(100).await.unwrap();
            }
            Step::Sweep => {
                let mut before = Vec::new();
                for k in &keys {
                    before.push(store.get("t", k).await.unwrap());
                }
                store.sweep(1_000).await.unwrap();
                let now = idem_core::Clock::now_ms(clock.as_ref());
                for (k, rec) in keys.iter().zip(before) {
                    let Some(rec) = rec else { continue };
                    let still = store.get("t", k).await.unwrap().is_some();
                    if rec.state.is_final() {
                        prop_assert_eq!(still, !idem_core::is_expired(&rec, now), "{} {:?}", k, rec.expires_at);
                    } else {
                        prop_assert!(still, "non-final {} ({}) was swept", k, rec.state);
                    }
                    if rec.action == "forever_action" && rec.state == State::Succeeded {
                        prop_assert!(still);
                    }
                }
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    #[test]
    fn sweeping_removes_only_expired_final_records(steps in prop::collection::vec(step(), 1..40)) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(run(steps))?;
    }
}
