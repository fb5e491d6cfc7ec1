//! `idem mcp`: the MCP guard (crate idem-mcp) on the database `idem serve` uses.
//!
//! Logs go to stderr only: over stdio, stdout is the host's MCP channel. The guard takes no
//! lock on an SQLite file: it writes beside a running `idem serve` (and beside other
//! guards) as any second process on the file does, through SQLite's own write lock.

use crate::cli::{LogFormat, McpArgs, McpOpsArgs};
use anyhow::Context;
use idem_core::{Clock, SystemClock};
use std::sync::Arc;
use std::time::Duration;

/// `idem mcp-ops`: the read-only MCP server of the ledger's operations, over stdio.
pub async fn run_ops(args: McpOpsArgs) -> anyhow::Result<()> {
    crate::serve::init_logging_with(LogFormat::Text, None, "warn")?;
    idem_store::keys::validate_name("tenant", &args.tenant).map_err(|e| anyhow::anyhow!("--tenant: {e}"))?;
    let url = args.db.database_url.clone();
    let (store, _clock) = open_store(&url).await?;
    idem_mcp::ops_server::serve_stdio(idem_mcp::ops_server::OpsServer::new(store, args.tenant))
        .await
        .map_err(|e| anyhow::anyhow!(e))
}

/// The ledger at `url` and its clock (on PostgreSQL the database's, DESIGN.md §2 invariant 7).
async fn open_store(url: &str) -> anyhow::Result<(Arc<dyn idem_store::Store>, Arc<dyn Clock>)> {
    let database_clock = match idem_store::parse_database_url(url)? {
        idem_store::DatabaseUrl::Postgres(u) => Some(
            idem_store::postgres::DatabaseClock::connect(u, idem_store::postgres::DEFAULT_MAX_UNCERTAINTY_MS)
                .await
                .with_context(|| {
                    format!("cannot connect to the database {} (to read its clock)", crate::serve::redact(u))
                })?,
        ),
        idem_store::DatabaseUrl::Sqlite(_) => None,
    };
    let clock: Arc<dyn Clock> = match &database_clock {
        Some(c) => c.clone(),
        None => Arc::new(SystemClock),
    };
    let store = idem_store::open(url, clock.clone(), Default::default())
        .await
        .with_context(|| format!("cannot open the database {}", crate::serve::redact(url)))?;
    Ok((store, clock))
}

pub async fn run(args: McpArgs) -> anyhow::Result<()> {
    // rmcp logs every session's start and end at INFO: warnings only, unless RUST_LOG says.
    crate::serve::init_logging_with(LogFormat::Text, None, "info,sqlx=warn,rmcp=warn")?;
    let config = match &args.config {
        Some(p) => idem_mcp::GuardConfig::load(p)?,
        None => idem_mcp::GuardConfig::parse("")?,
    };
    let target = match (&args.server_url, args.server_command.is_empty()) {
        (Some(url), true) => idem_mcp::Target::Url(url.clone()),
        (None, false) => idem_mcp::Target::Command(args.server_command.clone()),
        (Some(_), false) => anyhow::bail!("give the server as --server-url or as a command after --, not both"),
        (None, true) => anyhow::bail!(
            "no tool server: give its command after -- (idem mcp -- python server.py) or its Streamable HTTP endpoint as --server-url"
        ),
    };
    let task_id = match (args.task_id, args.task_per_process) {
        (Some(t), _) => {
            idem_mcp::intent::check_task_id(&t).map_err(|e| anyhow::anyhow!("--task-id (IDEM_MCP_TASK_ID): {e}"))?;
            Some(t)
        }
        // Over --listen every agent that connects would share the process's one task: a
        // second agent's identical call would get the first one's result, not its effect.
        (None, true) if args.listen.is_some() => anyhow::bail!(
            "--task-per-process with --listen would make every agent that connects one task (a second agent's identical call would be answered with the first one's result): give each call its task id in _meta (\"io.idem/task-id\"), or --task-id ID for one agent"
        ),
        (None, true) => {
            let t = uuid::Uuid::now_v7().to_string();
            eprintln!("idem mcp: this process is task {t} (--task-per-process): a restart is a new task");
            Some(t)
        }
        (None, false) => None,
    };
    // Sockets first: a port in use fails before anything is opened.
    let host = match &args.listen {
        Some(addr) => idem_mcp::HostSide::Http(Arc::new(idem_server::listen(addr).await?.into_std()?)),
        None => idem_mcp::HostSide::Stdio,
    };
    let metrics = match &args.metrics_listen {
        Some(addr) => Some(idem_server::listen(addr).await?),
        None => None,
    };
    let (store, clock) = open_store(&args.db.database_url).await?;
    if let Some(listener) = metrics {
        // The process-wide recorder idem serve uses; the guard's counters are its only series.
        let handle = idem_server::metrics::handle();
        let app = axum::Router::new().route(
            "/metrics",
            axum::routing::get(move || {
                let h = handle.clone();
                async move { h.render() }
            }),
        );
        tokio::spawn(async move { axum::serve(listener, app).await });
    } else {
        // Counters still count (and cost nothing to keep) without an exporter.
        let _ = idem_server::metrics::handle();
    }
    metrics::describe_counter!(
        "idem_mcp_calls_total",
        "tools/call requests the MCP guard answered, by tool and decision (performed, tool_error, replayed, in_progress, mismatch, unknown, refused, refused_by_server, not_sent, late, pass_through)"
    );
    idem_mcp::run(idem_mcp::Options {
        config,
        target,
        task_id,
        host,
        store,
        clock,
        start_timeout: Duration::from_millis(args.start_timeout_ms),
    })
    .await
    .map_err(|e| anyhow::anyhow!(e))
}
