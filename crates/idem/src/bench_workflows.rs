//! `idem bench`'s workflow rows: three-step declared workflows per second, and fan-out
//! workflows (one start step, ten parallel branches, one join), each step an HTTP call to
//! a local no-op provider, started and run to SUCCEEDED by concurrent workers
//! through idem's engine embedded in this process (as DBOS Transact runs in its caller's
//! process), on SQLite and on PostgreSQL.
//!
//! A workflow here is: one start (instance, pinned definition, three step rows, an event,
//! one commit), then per step an acquire of its operation (one commit), the HTTP call, a
//! completion (one commit), and the instance's final write. Every write is durable before
//! the next thing happens, as for any operation.

use anyhow::Context;
use idem_core::Actor;
use idem_core::flow::InstanceState;
use idem_flow::start::StartCall;
use serde_json::json;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// A no-op provider on loopback: `POST /` answers `201 {"id": "x"}` at once.
async fn noop_provider() -> anyhow::Result<std::net::SocketAddr> {
    let app = axum::Router::new().route(
        "/",
        axum::routing::post(|| async { (axum::http::StatusCode::CREATED, axum::Json(json!({"id": "x"}))) }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move { axum::serve(listener, app).await });
    Ok(addr)
}

/// The workflows `idem bench` runs.
#[derive(Debug, Clone, Copy)]
pub enum Shape {
    /// Three steps one after the other.
    Sequential,
    /// One step, ten parallel branches (one group), one join.
    FanOut,
}

impl Shape {
    fn workflow(self) -> &'static str {
        match self {
            Shape::Sequential => "bench-3",
            Shape::FanOut => "bench-fanout",
        }
    }
}

/// The configuration of the benchmark: a connector on the no-op provider, a three-step
/// workflow and a fan-out workflow on it.
fn config(addr: std::net::SocketAddr) -> String {
    let branches: String = (0..10)
        .map(|i| {
            format!(
                "  {{ name = \"b{i}\", group = \"fan\", connector = \"noop\", policy = \"redo_safe\", input = {{ key = {{ from = \"/input/key\" }}, prev = {{ from = \"/steps/start/provider_ref\" }} }} }},\n"
            )
        })
        .collect();
    format!(
        r#"[connectors.noop]
kind = "http"
url = "http://{addr}/"
timeout_ms = 10000
provider_ref = {{ json_pointer = "/id" }}
tenants = ["bench"]

[workflows.bench-3]
tenants = ["bench"]
steps = [
  {{ name = "validate", connector = "noop", policy = "redo_safe" }},
  {{ name = "render", connector = "noop", policy = "redo_safe", input = {{ key = {{ from = "/input/key" }}, prev = {{ from = "/steps/validate/provider_ref" }} }} }},
  {{ name = "send", connector = "noop", policy = "redo_safe", input = {{ key = {{ from = "/input/key" }}, prev = {{ from = "/steps/render/provider_ref" }} }} }},
]

[workflows.bench-fanout]
tenants = ["bench"]
steps = [
  {{ name = "start", connector = "noop", policy = "redo_safe" }},
{branches}  {{ name = "join", connector = "noop", policy = "redo_safe", input = {{ key = {{ from = "/input/key" }}, last = {{ from = "/steps/b9/provider_ref" }} }} }},
]
"#
    )
}

/// Workflows of `shape` per second on `db_url` with `c` concurrent workers for `secs`, and
/// the CPU this process spent per workflow (µs).
pub async fn workflows_per_second(db_url: &str, c: usize, secs: f64, shape: Shape) -> anyhow::Result<(f64, f64)> {
    let addr = noop_provider().await?;
    let connect = idem_connect::Config::parse(&config(addr))?;
    let registry = idem_connect::Registry::from_config(&connect)?;
    let declared = idem_flow::config::definitions(&connect, &registry)?;
    let registry = Arc::new(registry);
    let clock: Arc<dyn idem_core::Clock> = Arc::new(idem_core::SystemClock);
    let store = idem_store::open(db_url, clock.clone(), Default::default()).await.context("bench store")?;
    let executor = Arc::new(idem_connect::Executor::new(
        store.clone(),
        registry.clone(),
        clock.clone(),
        c,
        Duration::from_secs(3600),
    ));
    let reconciler = Arc::new(idem_connect::Reconciler::new(
        store.clone(),
        registry.clone(),
        clock.clone(),
        Duration::from_secs(3600),
    ));
    let flows = idem_flow::Flows::new(store, executor, reconciler, registry, clock, declared);
    let done = Arc::new(AtomicU64::new(0));
    let deadline = Instant::now() + Duration::from_secs_f64(secs);
    let run = format!("{:x}", std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.as_micros());
    let cpu = super::bench::process_cpu(std::process::id());
    let start = Instant::now();
    let mut tasks = Vec::new();
    for w in 0..c {
        let (flows, done, run) = (flows.clone(), done.clone(), run.clone());
        tasks.push(tokio::spawn(async move {
            let mut i = 0u64;
            while Instant::now() < deadline {
                let id = format!("WF-{run}-{w}-{i}");
                let call = StartCall {
                    tenant: "bench".into(),
                    instance_id: id.clone(),
                    workflow: shape.workflow().into(),
                    input: json!({"key": id}),
                    source_event: None,
                    trace_id: None,
                    steps: None,
                    groups: None,
                    actor: Actor { principal: "bench".into(), request_id: None },
                };
                let started = flows.start(call).await?;
                let inst = flows.advance_started(&started).await?.context("the instance vanished")?;
                anyhow::ensure!(inst.state == InstanceState::Succeeded, "workflow {id} ended {}", inst.state);
                done.fetch_add(1, Ordering::Relaxed);
                i += 1;
            }
            anyhow::Ok(())
        }));
    }
    for t in tasks {
        t.await??;
    }
    let n = done.load(Ordering::Relaxed) as f64;
    let elapsed = start.elapsed().as_secs_f64().max(secs);
    let cpu_us = (super::bench::process_cpu(std::process::id()) - cpu) * 1e6 / n.max(1.0);
    Ok((n / elapsed, cpu_us))
}
