//! `idem bench`'s MCP row: what the guard (`idem mcp`) adds to a tool call.
//!
//! A no-op MCP tool server (rmcp, Streamable HTTP on loopback, in this process) answers
//! `create_ticket` at once and `slow_ticket` after 500 ms. The same rmcp client calls it
//! directly and through an `idem mcp` child process (Streamable HTTP on both sides, SQLite
//! ledger, every call a new intent, so each guarded call is one durable acquire and one
//! durable completion), sequentially, interleaved in rounds of 50: p50 and p99 of each,
//! and their difference. Then 100 `slow_ticket` calls at once through the guard, and the
//! guard process's peak RSS (VmHWM) under them.

use idem_mcp::rmcp;
use rmcp::model::*;
use rmcp::service::{RequestContext, RoleServer};
use rmcp::{ErrorData, ServerHandler, ServiceExt};
use serde_json::json;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

#[derive(Clone, Default)]
struct NoOp(Arc<AtomicU64>);

impl ServerHandler for NoOp {
    fn get_info(&self) -> ServerConfig {
        let mut c = ServerCapabilities::default();
        c.tools = Some(ToolsCapability::default());
        let mut info = ServerConfig::new(c);
        info.server_info = Implementation::new("bench-tickets", "0");
        info
    }

    async fn list_tools(
        &self,
        _: Option<PaginatedRequestParams>,
        _: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        let schema = json!({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]});
        let schema = Arc::new(schema.as_object().cloned().unwrap_or_default());
        Ok(ListToolsResult::with_all_items(vec![
            Tool::new("create_ticket", "no-op", schema.clone()),
            Tool::new("slow_ticket", "no-op after 500 ms", schema),
        ]))
    }

    async fn call_tool(
        &self,
        p: CallToolRequestParams,
        _: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        if p.name == "slow_ticket" {
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        let n = self.0.fetch_add(1, Ordering::Relaxed);
        Ok(CallToolResponse::Complete(CallToolResult::structured(json!({"id": format!("T-{n}")}))))
    }
}

async fn serve_noop() -> anyhow::Result<String> {
    use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
    use rmcp::transport::{StreamableHttpServerConfig, StreamableHttpService};
    let handler = NoOp::default();
    let service = StreamableHttpService::new(
        move || Ok(handler.clone()),
        Arc::new(LocalSessionManager::default()),
        StreamableHttpServerConfig::default(),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}/mcp", listener.local_addr()?);
    tokio::spawn(async move { axum::serve(listener, axum::Router::new().nest_service("/mcp", service)).await });
    Ok(url)
}

type Client = rmcp::service::RunningService<rmcp::RoleClient, ()>;

async fn client(url: &str) -> anyhow::Result<Client> {
    let transport = rmcp::transport::StreamableHttpClientTransport::from_uri(url.to_owned());
    Ok(().serve(transport).await?)
}

async fn timed_call(c: &Client, tool: &'static str, n: u64) -> anyhow::Result<f64> {
    let args = json!({"n": n}).as_object().cloned().unwrap_or_default();
    let start = Instant::now();
    let r = c.peer().call_tool(CallToolRequestParams::new(tool).with_arguments(args)).await?;
    anyhow::ensure!(r.is_error != Some(true), "{tool} failed: {r:?}");
    Ok(start.elapsed().as_secs_f64() * 1000.0)
}

/// The row: guarded calls/s (sequential) against direct, with the latencies and the peak
/// RSS in `extra`.
pub async fn row(dir: &std::path::Path, secs: f64) -> anyhow::Result<(String, f64, Option<f64>, String)> {
    let server = serve_noop().await?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let mut guard = std::process::Command::new(std::env::current_exe()?)
        .args(["mcp", "--listen", &format!("127.0.0.1:{port}"), "--server-url", &server, "--task-id", "bench"])
        .arg("--database-url")
        .arg(format!("sqlite://{}", dir.join("mcp.db").display()))
        .env("RUST_LOG", "warn")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .spawn()?;
    let result = measure(&server, port, guard.id(), secs).await;
    let _ = guard.kill();
    let _ = guard.wait();
    result
}

/// The warm-up call's argument: 2^53 − 1, the largest integer I-JSON carries exactly.
const WARM_UP_N: u64 = (1 << 53) - 1;

async fn measure(server: &str, port: u16, pid: u32, secs: f64) -> anyhow::Result<(String, f64, Option<f64>, String)> {
    let start = Instant::now();
    let guarded = loop {
        match client(&format!("http://127.0.0.1:{port}/mcp")).await {
            Ok(c) => break c,
            Err(_) if start.elapsed() < Duration::from_secs(30) => tokio::time::sleep(Duration::from_millis(100)).await,
            Err(e) => return Err(e.context("idem mcp did not start")),
        }
    };
    let direct = client(server).await?;
    let (mut d, mut g) = (Vec::new(), Vec::new());
    let mut n = 0u64;
    let (warm, until) =
        // The warm-up's n is apart from the measured ones (1, 2, …) and within what a JSON
        // number carries exactly: the guard refuses integers beyond ±2^53 (RFC 7493 §2.2).
        (timed_call(&guarded, "create_ticket", WARM_UP_N).await?, Instant::now() + Duration::from_secs_f64(secs * 2.0));
    let _ = warm;
    while Instant::now() < until {
        for _ in 0..50 {
            n += 1;
            d.push(timed_call(&direct, "create_ticket", n).await?);
        }
        for _ in 0..50 {
            n += 1;
            g.push(timed_call(&guarded, "create_ticket", n).await?);
        }
    }
    let pct = |v: &mut Vec<f64>, p: f64| {
        v.sort_by(f64::total_cmp);
        v[((v.len() as f64 - 1.0) * p).round() as usize]
    };
    let (d50, d99, g50, g99) = (pct(&mut d, 0.5), pct(&mut d, 0.99), pct(&mut g, 0.5), pct(&mut g, 0.99));
    let rate = |v: &[f64]| 1000.0 * v.len() as f64 / v.iter().sum::<f64>();
    // 100 calls in flight through the guard, each held 500 ms by the server.
    let in_flight = futures_util::future::join_all((0..100u64).map(|i| {
        let g = &guarded;
        async move { timed_call(g, "slow_ticket", 1_000_000 + i).await }
    }))
    .await;
    let failed = in_flight.iter().filter(|r| r.is_err()).count();
    let rss = crate::bench::peak_rss_mib(pid).map_or("-".into(), |m| format!("{m:.1} MiB"));
    let extra = format!(
        "added latency p50 {:.2} ms, p99 {:.2} ms (guarded p50 {g50:.2} / p99 {g99:.2} ms, direct p50 {d50:.2} / p99 {d99:.2} ms, {} calls each); guard peak RSS {rss} with 100 calls in flight{}",
        g50 - d50,
        g99 - d99,
        g.len(),
        if failed > 0 { format!(" ({failed} failed)") } else { String::new() }
    );
    Ok(("MCP tools/call per s, sequential, guarded".into(), rate(&g), Some(rate(&d)), extra))
}
