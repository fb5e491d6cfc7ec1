//! A workflow pass that planned a forward step from a stale read, while another pass (the
//! runner's, an operator's) began the instance's compensation: the step's operation may be
//! granted, but its call is never started — nothing new is performed while an instance
//! compensates. Found as a one-in-many failure of `parallel.rs`'s
//! `compensation_waits_for_an_unknown_branch` beside the whole suite: the runner's pass saw
//! a failed branch before the start's pass had acquired a sibling, compensated, and the
//! sibling was then performed (its effect only undone later).
//!
//! The interleaving is made deterministic with idem's engine embedded in this process: the
//! instance is started, then written COMPENSATING as the other pass would, and only then
//! does the start's pass run from its stale knowledge (RUNNING, nothing done), on SQLite
//! and PostgreSQL. Both kinds of forward step are checked: a sequential step and the
//! branches of a parallel group.

mod common;

use common::{Backend, Db, start_provider};
use idem_core::flow::{InstanceState, StepState};
use idem_core::{Actor, State};
use idem_flow::start::StartCall;
use serde_json::json;
use std::sync::Arc;
use std::time::Duration;

fn config(addr: std::net::SocketAddr) -> String {
    let step = |name: &str, group: &str| {
        format!(
            r#"  {{ name = "{name}", {group}connector = "orders", input = {{ order = {{ from = "/input/order" }} }}, compensation = {{ action = "undo_{name}", connector = "orders" }} }},"#
        )
    };
    format!(
        r#"[connectors.orders]
kind = "http"
url = "http://{addr}/orders"
timeout_ms = 2000
provider_ref = {{ json_pointer = "/id" }}
lookup = {{ url = "http://{addr}/orders?client_reference={{idempotency_key}}", found_pointer = "/0/id", absent_after_ms = 200 }}

[workflows.sequential]
steps = [
{}
{}
]

[workflows.fan-out]
steps = [
{}
{}
]
"#,
        step("reserve", ""),
        step("charge", ""),
        step("email", r#"group = "notify", "#),
        step("chat", r#"group = "notify", "#),
    )
}

async fn stale_pass_performs_nothing(b: Backend) {
    let (provider, addr) = start_provider().await;
    let db = Db::new(b).await;
    let connect = idem_connect::Config::parse(&config(addr)).unwrap();
    let registry = idem_connect::Registry::from_config(&connect).unwrap();
    let declared = idem_flow::config::definitions(&connect, &registry).unwrap();
    let registry = Arc::new(registry);
    let clock: Arc<dyn idem_core::Clock> = Arc::new(idem_core::SystemClock);
    let store = idem_store::open(&db.url, clock.clone(), Default::default()).await.unwrap();
    let hour = Duration::from_secs(3600);
    let executor = Arc::new(idem_connect::Executor::new(store.clone(), registry.clone(), clock.clone(), 8, hour));
    let reconciler = Arc::new(idem_connect::Reconciler::new(store.clone(), registry.clone(), clock.clone(), hour));
    let flows = idem_flow::Flows::new(store.clone(), executor, reconciler, registry, clock, declared);

    for (workflow, steps) in [("sequential", ["reserve", "charge"]), ("fan-out", ["email", "chat"])] {
        let id = format!("ORD-{workflow}");
        let call = StartCall {
            tenant: "default".into(),
            instance_id: id.clone(),
            workflow: workflow.into(),
            input: json!({"order": id}),
            source_event: None,
            trace_id: None,
            steps: None,
            groups: None,
            actor: Actor { principal: "test".into(), request_id: None },
        };
        let started = flows.start(call).await.unwrap();
        // Another pass begins the compensation after the start's pass has read the instance.
        let mut other = started.instance.clone();
        other.state = InstanceState::Compensating;
        other.version += 1;
        let update =
            idem_store::flow::InstanceUpdate { record: other, read_version: started.instance.version, events: vec![] };
        assert!(store.flows().update_instance(update).await.unwrap(), "the other pass's write");

        let after = flows.advance_started(&started).await.unwrap().expect("the instance");
        for step in steps {
            let key = format!("{id}:{step}");
            assert_eq!(provider.calls(&key), 0, "{workflow}: {step} was performed while the instance compensated");
        }
        // The declined operations are closed by the compensation, which has nothing to undo.
        let after = match after.state {
            InstanceState::Compensating => flows.advance(&after.tenant, &id).await.unwrap().expect("the instance"),
            _ => after,
        };
        assert_eq!(after.state, InstanceState::Compensated, "{workflow}: {after:?}");
        // What the stale pass planned (the first step; both branches) was granted and
        // declined, then closed FAILED by the compensation; nothing after it was reached.
        let planned = if workflow == "sequential" { 1 } else { 2 };
        for (i, cp) in store.flows().checkpoints("default", &id).await.unwrap().iter().enumerate() {
            match &cp.operation {
                Some(op) if i < planned => {
                    assert_eq!(op.state, State::Failed, "{workflow}: {op:?}");
                    let why = op.error_message.as_deref().unwrap_or_default();
                    assert!(why.contains("compensates"), "{workflow}: closed by the compensation: {op:?}");
                    assert_eq!(cp.state, StepState::Failed, "{workflow}: {cp:?}");
                }
                None if i >= planned => {}
                other => panic!("{workflow}: step {i}: {other:?}"),
            }
            assert!(cp.compensation.is_none(), "{workflow}: nothing to undo: {cp:?}");
        }
        for step in steps {
            assert_eq!(provider.calls(&format!("{id}:{step}:compensate")), 0, "{workflow}: {step}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_stale_pass_performs_nothing_while_the_instance_compensates() {
    stale_pass_performs_nothing(Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_stale_pass_performs_nothing_while_the_instance_compensates() {
    stale_pass_performs_nothing(Backend::Postgres).await;
}
