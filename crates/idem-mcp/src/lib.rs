//! idem-mcp: `idem mcp`, an MCP guard for AI agents (MCP 2025-06-18 and later, on the
//! official Rust SDK `rmcp`).
//!
//! The agent's host starts the guard instead of a tool server. To the host it is an MCP
//! server (stdio, or Streamable HTTP on an address); to one real MCP server it is a client
//! (a child process over stdio, or a Streamable HTTP URL). Everything passes through
//! unchanged but `tools/call` of a guarded tool, which runs through idem's ledger as one
//! operation per intent:
//!
//! - [`config`]: the TOML file — which tools are guarded (every tool but those whose
//!   `readOnlyHint` is true, unless the file says otherwise), intent fields, times, what a
//!   tool error means, the idempotency-key argument, the lookup tool;
//! - [`intent`]: the operation key (task id + server + tool + intent fields, RFC 8785) and
//!   the fingerprint of the arguments;
//! - [`guard`]: acquire, send at most once, record what the answer proves, replay;
//! - [`texts`]: what the agent is told, word for word;
//! - [`lookup`]: settling an unknown outcome with a lookup tool (evidence only);
//! - [`downstream`], [`server`]: the rmcp client and server halves;
//! - [`ops_server`]: `idem mcp-ops`, a read-only MCP server of the ledger's operations.
//!
//! Guarded calls are ordinary operations in the same ledger `idem serve` uses: tenant
//! `default` (configurable), principal `idem-mcp`, action `mcp:{tool}`, connector
//! `lookup:mcp:{server}`, keys `mcp:{server}:{task}:{tool}:{hash}`.
//!
//! Must not: write SQL or decide protocol questions (idem-store and idem-core do), or send a
//! guarded call without holding its operation's lease.

pub mod config;
pub mod downstream;
pub mod guard;
pub mod intent;
pub mod lookup;
pub mod ops_server;
pub mod server;
pub mod stdio_lines;
pub mod texts;

pub use config::GuardConfig;
pub use downstream::Target;
/// The MCP SDK the guard is built on (for callers that speak MCP to it, like `idem bench`).
pub use rmcp;

use downstream::{Downstream, Hosts};
use guard::Guard;
use idem_core::Clock;
use idem_store::Store;
use rmcp::ServiceExt;
use server::{GuardServer, Shared};
use std::sync::Arc;
use std::time::Duration;

/// Where the host speaks to the guard.
#[derive(Debug, Clone)]
pub enum HostSide {
    /// Standard input and output (the host started the guard as its server).
    Stdio,
    /// Streamable HTTP on a listening socket, at path `/mcp`.
    Http(Arc<std::net::TcpListener>),
}

/// What one guard process needs.
pub struct Options {
    /// The configuration file, read.
    pub config: GuardConfig,
    /// The real server.
    pub target: Target,
    /// The process's task id, if the user gave one (or chose one per process).
    pub task_id: Option<String>,
    /// Where the host speaks to the guard.
    pub host: HostSide,
    /// The ledger.
    pub store: Arc<dyn Store>,
    /// The ledger's clock.
    pub clock: Arc<dyn Clock>,
    /// How long the server's start-up handshake may take.
    pub start_timeout: Duration,
}

/// The server's name in keys: the file's `server`, else its `serverInfo.name` with every
/// character outside `[A-Za-z0-9._-]` made `-` (at most 64), else `mcp-server`.
pub fn server_name(config: &GuardConfig, reported: Option<&str>) -> String {
    if let Some(s) = &config.server {
        return s.clone();
    }
    let cleaned: String = reported
        .unwrap_or_default()
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() || "._-".contains(c) { c } else { '-' })
        .take(64)
        .collect();
    if cleaned.is_empty() { "mcp-server".into() } else { cleaned }
}

/// Runs a guard until the host goes away (stdio) or the process is stopped (HTTP).
///
/// # Errors
/// The host side could not be served (one line).
pub async fn run(opts: Options) -> Result<(), String> {
    let hosts = Arc::new(Hosts::default());
    let downstream = Arc::new(Downstream::new(opts.target.clone(), hosts.clone(), opts.start_timeout));
    let facts = downstream.facts().await;
    let info = match &facts {
        Ok(f) => f.info.clone(),
        Err(why) => {
            tracing::error!(
                "idem mcp: the tool server did not start: {why}; the guard serves anyway and starts it again on the next request"
            );
            rmcp::model::ServerPeerInfo::new(Default::default(), Default::default())
        }
    };
    if opts.config.server.is_none() && facts.is_err() {
        return Err(
            "the tool server did not start, so its name is unknown: name it with `server = \"NAME\"` in the config file to serve without it"
                .into(),
        );
    }
    let name = server_name(&opts.config, facts.as_ref().ok().and_then(|f| f.name.as_deref()));
    let guard =
        Arc::new(Guard::new(opts.store.clone(), opts.clock.clone(), Arc::new(opts.config.clone()), name.clone()));
    let shared = Arc::new(Shared::new(guard.clone(), downstream.clone(), hosts, opts.task_id.clone(), info));
    tracing::info!(server = %name, tenant = %opts.config.tenant, "idem mcp: guarding the tool server");
    let settler = tokio::spawn(settle_loop(shared.clone(), Duration::from_millis(opts.config.lookup_interval_ms)));
    let served = match opts.host {
        HostSide::Stdio => serve_stdio(shared.clone()).await,
        HostSide::Http(listener) => serve_http(shared.clone(), listener).await,
    };
    settler.abort();
    downstream.close().await;
    served
}

async fn serve_stdio(shared: Arc<Shared>) -> Result<(), String> {
    let running = GuardServer(shared)
        .serve(crate::stdio_lines::transport())
        .await
        .map_err(|e| format!("the host did not complete the MCP handshake: {e}"))?;
    running.waiting().await.map_err(|e| e.to_string())?;
    Ok(())
}

async fn serve_http(shared: Arc<Shared>, listener: Arc<std::net::TcpListener>) -> Result<(), String> {
    use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
    use rmcp::transport::{StreamableHttpServerConfig, StreamableHttpService};
    let service = StreamableHttpService::new(
        move || Ok(GuardServer(shared.clone())),
        Arc::new(LocalSessionManager::default()),
        StreamableHttpServerConfig::default(),
    );
    let app = axum::Router::new().nest_service("/mcp", service);
    let std_listener = listener.try_clone().map_err(|e| e.to_string())?;
    std_listener.set_nonblocking(true).map_err(|e| e.to_string())?;
    let listener = tokio::net::TcpListener::from_std(std_listener).map_err(|e| e.to_string())?;
    axum::serve(listener, app).with_graceful_shutdown(shutdown_signal()).await.map_err(|e| e.to_string())
}

async fn shutdown_signal() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        () = term => {}
    }
}

/// Looks up this server's unknown calls now and every `interval` (and at once after a call
/// ended UNKNOWN), while the guard runs.
async fn settle_loop(shared: Arc<Shared>, interval: Duration) {
    loop {
        let downstream = shared.downstream.clone();
        let clock_now = {
            let g = shared.guard.clone();
            move || g.now_ms()
        };
        shared
            .guard
            .settle_pass(|cfg, rec| {
                let downstream = downstream.clone();
                let now = clock_now.clone();
                async move {
                    let args = lookup::lookup_arguments(&cfg.arguments, &rec);
                    let params = rmcp::model::CallToolRequestParams::new(cfg.tool.clone()).with_arguments(args);
                    let answer = match server::send_call(&downstream, params, None, None, Duration::from_secs(10)).await
                    {
                        guard::Sent::Result(v) => Ok(v),
                        guard::Sent::Refused(e) => Err(format!("error {} ({})", e.code.0, e.message)),
                        guard::Sent::NotSent(why) | guard::Sent::Lost(why) => Err(why),
                    };
                    lookup::judge(&cfg, &rec, answer, now())
                }
            })
            .await;
        tokio::select! {
            () = tokio::time::sleep(interval) => {}
            () = shared.settle.notified() => {}
        }
    }
}
