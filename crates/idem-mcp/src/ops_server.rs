//! `idem mcp-ops`: a read-only MCP server of idem's own, so an agent can ask what became of
//! an operation (issue 29 §7) — for instance one a guard told it was "outcome unknown".
//!
//! Three tools, all `readOnlyHint: true`, scoped to one tenant, reading the ledger directly
//! (the same store calls as `GET /v1/operations`):
//! - `get_operation {key}`: state, outcome, evidence, error, review flag, times;
//! - `list_operations {key_prefix?, state?, needs_review?, limit?}`: newest first, ≤ 100;
//! - `operation_events {key}`: the event log, oldest first.
//!
//! It changes nothing: resolving stays with operators (`idem ops resolve`, `/ui`).

use crate::texts::rfc3339;
use idem_core::{OperationRecord, State};
use idem_store::{ListFilter, Store};
use rmcp::model::*;
use rmcp::service::{RequestContext, RoleServer};
use rmcp::{ErrorData as McpError, ServerHandler};
use serde_json::{Value, json};
use std::sync::Arc;

/// The server: a store and the tenant it reads.
#[derive(Clone)]
pub struct OpsServer {
    store: Arc<dyn Store>,
    tenant: String,
}

impl OpsServer {
    /// A server reading `tenant`'s operations in `store`.
    pub fn new(store: Arc<dyn Store>, tenant: String) -> Self {
        OpsServer { store, tenant }
    }
}

fn schema(v: Value) -> Arc<JsonObject> {
    Arc::new(v.as_object().cloned().unwrap_or_default())
}

fn tools() -> Vec<Tool> {
    let ro = ToolAnnotations::new().read_only(true);
    let key = json!({"type": "object", "properties": {"key": {"type": "string", "description": "the operation key, e.g. the io.idem/operation of a guard's answer"}}, "required": ["key"]});
    vec![
        Tool::new("get_operation", "What became of one operation: state, outcome, evidence, error, review flag, times.", schema(key.clone()))
            .with_annotations(ro.clone()),
        Tool::new(
            "list_operations",
            "Operations, newest first: filter by key prefix (mcp:SERVER:TASK: for one task's calls), state, review flag.",
            schema(json!({"type": "object", "properties": {
                "key_prefix": {"type": "string"},
                "state": {"type": "string", "enum": ["PENDING", "EXECUTING", "SUCCEEDED", "FAILED", "UNKNOWN"]},
                "needs_review": {"type": "boolean"},
                "limit": {"type": "integer", "minimum": 1, "maximum": 100}}})),
        )
        .with_annotations(ro.clone()),
        Tool::new("operation_events", "One operation's event log, oldest first: every trigger and transition.", schema(key))
            .with_annotations(ro),
    ]
}

/// An operation as the agent reads it.
pub fn describe(r: &OperationRecord) -> Value {
    json!({
        "key": r.key, "action": r.action, "state": r.state.as_str(), "needs_review": r.needs_review,
        "attempts": r.attempt_count, "provider_ref": r.provider_ref, "evidence_source": r.evidence_source,
        "error_class": r.error_class, "error_message": r.error_message, "result": r.result,
        "created_at": rfc3339(r.created_at), "updated_at": rfc3339(r.updated_at),
        "completed_at": r.completed_at.map(rfc3339),
    })
}

fn answer(v: Value) -> CallToolResult {
    let mut r = CallToolResult::structured(v);
    r.is_error = Some(false);
    r
}

fn refuse(why: String) -> CallToolResult {
    CallToolResult::error(vec![ContentBlock::text(why)])
}

impl OpsServer {
    async fn run(&self, name: &str, args: &JsonObject) -> Result<CallToolResult, String> {
        let key =
            || args.get("key").and_then(Value::as_str).map(str::to_owned).ok_or("give the operation's key".to_owned());
        let db = |e: idem_store::StoreError| {
            tracing::warn!(error = %e, "idem mcp-ops: reading the ledger failed");
            "the ledger could not be read; try again".to_owned()
        };
        match name {
            "get_operation" => {
                let key = key()?;
                match self.store.get(&self.tenant, &key).await.map_err(db)? {
                    Some(r) => Ok(answer(describe(&r))),
                    None => Ok(refuse(format!("no operation {key:?} (or it is past retention)"))),
                }
            }
            "operation_events" => {
                let key = key()?;
                let events = self.store.events(&self.tenant, &key).await.map_err(db)?;
                let list: Vec<Value> = events
                    .iter()
                    .map(|e| json!({"at": rfc3339(e.at), "kind": e.kind, "principal": e.principal, "from": e.from_state.map(State::as_str), "to": e.to_state.map(State::as_str), "reason": e.reason}))
                    .collect();
                Ok(answer(json!({"key": key, "events": list})))
            }
            "list_operations" => {
                let state = match args.get("state").and_then(Value::as_str) {
                    Some(s) => Some(s.parse::<State>().map_err(|_| format!("unknown state {s:?}"))?),
                    None => None,
                };
                // The schema says 1-100: outside it (or not an integer) is an error, not clamped.
                let limit = match args.get("limit") {
                    None | Some(Value::Null) => 20,
                    Some(v) => match v.as_i64() {
                        Some(n @ 1..=100) => n,
                        _ => return Err(format!("limit must be an integer from 1 to 100; got {v}")),
                    },
                };
                let filter = ListFilter {
                    state,
                    needs_review: args.get("needs_review").and_then(Value::as_bool),
                    key_prefix: args.get("key_prefix").and_then(Value::as_str).map(str::to_owned),
                    limit,
                    ..Default::default()
                };
                let page = self.store.list(&self.tenant, &filter).await.map_err(db)?;
                Ok(answer(json!({"operations": page.items.iter().map(describe).collect::<Vec<_>>()})))
            }
            other => Err(format!("no tool named {other:?} (get_operation, list_operations, operation_events)")),
        }
    }
}

impl ServerHandler for OpsServer {
    fn get_info(&self) -> ServerConfig {
        let mut c = ServerCapabilities::default();
        c.tools = Some(ToolsCapability::default());
        let mut info = ServerConfig::new(c);
        info.server_info = Implementation::new("idem-ops", env!("CARGO_PKG_VERSION"));
        info.instructions = Some(format!(
            "Read-only view of idem's ledger (tenant {}): what became of an operation, e.g. one an idem mcp guard answered with \"outcome unknown\".",
            self.tenant
        ));
        info
    }

    async fn list_tools(
        &self,
        _: Option<PaginatedRequestParams>,
        _: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, McpError> {
        Ok(ListToolsResult::with_all_items(tools()))
    }

    async fn call_tool(
        &self,
        p: CallToolRequestParams,
        _: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, McpError> {
        let args = p.arguments.unwrap_or_default();
        let r = self.run(&p.name, &args).await.unwrap_or_else(refuse);
        Ok(CallToolResponse::Complete(r))
    }
}

/// Serves the ops server to a host over stdio until it goes away.
///
/// # Errors
/// The host did not complete the handshake.
pub async fn serve_stdio(server: OpsServer) -> Result<(), String> {
    use rmcp::ServiceExt;
    let running = server
        .serve(crate::stdio_lines::transport())
        .await
        .map_err(|e| format!("the host did not complete the MCP handshake: {e}"))?;
    running.waiting().await.map_err(|e| e.to_string())?;
    Ok(())
}
