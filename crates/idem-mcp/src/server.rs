//! The guard as the host sees it: an MCP server (rmcp's `ServerHandler`) that passes
//! everything through to the real server unchanged — `tools/list`, resources, prompts,
//! completions, log levels, and the server's notifications — except `tools/call` of a
//! guarded tool, which goes through [`crate::guard::Guard`].
//!
//! A guarded call is checked before anything is recorded or sent: the tool must be one the
//! server lists, a task id must be known (`_meta` `io.idem/task-id`, else the process's),
//! and the arguments must satisfy the tool's `inputSchema` (JSON Schema, `jsonschema`);
//! a refusal is a tool error naming what is wrong. The call itself runs in a task of its
//! own, so a host that cancels or disconnects mid-call does not cut the recording short.

use crate::downstream::{Downstream, Hosts};
use crate::guard::{Guard, Sent, refusal_code};
use crate::texts::{self, META_TASK_ID, meta};
use rmcp::model::*;
use rmcp::service::{PeerRequestOptions, RequestContext, RoleServer, ServiceError};
use rmcp::{ErrorData as McpError, ServerHandler};
use serde_json::{Map, Value};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Shared by every host session of one guard process.
pub struct Shared {
    /// The ledger side.
    pub guard: Arc<Guard>,
    /// The real server.
    pub downstream: Arc<Downstream>,
    /// The connected hosts.
    pub hosts: Arc<Hosts>,
    /// The process's task id (`--task-id`, `IDEM_MCP_TASK_ID`, or `--task-per-process`).
    pub task_id: Option<String>,
    /// What the server said in its handshake (capabilities, identity, instructions).
    pub info: ServerPeerInfo,
    /// Compiled `inputSchema`s by tool name (and the schema they were compiled from).
    schemas: Mutex<HashMap<String, (Arc<JsonObject>, Arc<jsonschema::Validator>)>>,
    /// Wakes the lookup loop after a call ended UNKNOWN.
    pub settle: tokio::sync::Notify,
}

impl Shared {
    /// The state of a guard process.
    pub fn new(
        guard: Arc<Guard>,
        downstream: Arc<Downstream>,
        hosts: Arc<Hosts>,
        task_id: Option<String>,
        info: ServerPeerInfo,
    ) -> Self {
        Shared { guard, downstream, hosts, task_id, info, schemas: Default::default(), settle: Default::default() }
    }
}

/// One host session's handler (cheap: the state is shared).
#[derive(Clone)]
pub struct GuardServer(pub Arc<Shared>);

/// The `tool` label of a call's metrics: a tool the server lists, or `unlisted` (labels stay
/// bounded whatever names an agent sends).
fn count(tool: &str, listed: bool, decision: &'static str) {
    let tool = if listed { tool.to_owned() } else { "unlisted".to_owned() };
    metrics::counter!("idem_mcp_calls_total", "tool" => tool, "decision" => decision).increment(1);
}

/// Request `_meta` to pass on: the host's own (trace context, `io.idem/…`), without the
/// per-request protocol fields of the host's connection (`io.modelcontextprotocol/…`),
/// which are not the server's, and without its progress token (rmcp gives each request to
/// the server a token of its own: [`HostProgress`] routes that token's notifications back).
fn passed_meta(ctx: &RequestContext<RoleServer>) -> Option<RequestMetaObject> {
    let m: JsonObject = ctx
        .meta
        .0
        .0
        .iter()
        .filter(|(k, _)| !k.starts_with("io.modelcontextprotocol/") && k.as_str() != "progressToken")
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    if m.is_empty() { None } else { Some(RequestMetaObject(MetaObject(m))) }
}

/// The host that asked for progress on a request, and its token.
#[derive(Clone)]
pub struct HostProgress {
    peer: rmcp::Peer<RoleServer>,
    token: ProgressToken,
}

fn host_progress(ctx: &RequestContext<RoleServer>) -> Option<HostProgress> {
    let token = ctx.meta.0.0.get("progressToken").cloned()?;
    Some(HostProgress { peer: ctx.peer.clone(), token: serde_json::from_value(token).ok()? })
}

fn service_error(e: ServiceError) -> McpError {
    match e {
        ServiceError::McpError(e) => e,
        other => McpError::internal_error(format!("the tool server did not answer: {other}"), None),
    }
}

impl GuardServer {
    async fn forward(&self, req: ClientRequest, ctx: &RequestContext<RoleServer>) -> Result<ServerResult, McpError> {
        let meta = passed_meta(ctx);
        let opts = || {
            let o = PeerRequestOptions::no_options();
            match &meta {
                Some(m) => o.with_meta(m.clone()),
                None => o,
            }
        };
        let handle = self.0.downstream.send(req, opts).await.map_err(|why| McpError::internal_error(why, None))?;
        let _route = host_progress(ctx)
            .map(|h| self.0.downstream.routes().route(handle.progress_token.clone(), h.peer, h.token));
        handle.await_response().await.map_err(service_error)
    }

    fn validator(&self, tool: &Tool) -> Result<Arc<jsonschema::Validator>, String> {
        let mut schemas = self.0.schemas.lock().expect("schemas lock");
        if let Some((s, v)) = schemas.get(tool.name.as_ref())
            && Arc::ptr_eq(s, &tool.input_schema)
        {
            return Ok(v.clone());
        }
        let v = Arc::new(
            jsonschema::validator_for(&Value::Object((*tool.input_schema).clone()))
                .map_err(|e| format!("the tool's inputSchema is not a schema idem can check: {e}"))?,
        );
        schemas.insert(tool.name.to_string(), (tool.input_schema.clone(), v.clone()));
        Ok(v)
    }

    async fn guarded_call(
        &self,
        params: CallToolRequestParams,
        ctx: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, McpError> {
        let name = params.name.to_string();
        let refuse = |why: String, decision: &'static str, listed: bool| {
            count(&name, listed, decision);
            to_result(texts::result(&texts::refused(&why), true, meta("refused", None, None, None)))
        };
        let tools = match self.0.downstream.tools(false).await {
            Ok(t) => t,
            Err(why) => return refuse(format!("the tool server is not running ({why})"), "refused", false),
        };
        let tool = match tools.get(&name) {
            Some(t) => t.clone(),
            // Listed since? (A server may add tools without telling.)
            None => match self.0.downstream.tools(true).await.ok().and_then(|t| t.get(&name).cloned()) {
                Some(t) => t,
                None => {
                    let mut names: Vec<&String> = tools.keys().collect();
                    names.sort();
                    let list = names.iter().map(|n| n.as_str()).collect::<Vec<_>>().join(", ");
                    return refuse(
                        format!("the server has no tool named {name:?} (its tools: {list})"),
                        "refused",
                        false,
                    );
                }
            },
        };
        let read_only = tool.annotations.as_ref().and_then(|a| a.read_only_hint);
        if !self.0.guard.config().guarded(&name, read_only) {
            count(&name, true, "pass_through");
            let req = ClientRequest::CallToolRequest(Request::new(params));
            return match self.forward(req, &ctx).await? {
                ServerResult::CallToolResult(r) => Ok(r),
                _ => Err(McpError::internal_error("the tool server's answer was not a tool result", None)),
            };
        }
        // A task id in _meta that is not a string is never replaced by the process's: that
        // would join two tasks. An integer is its decimal string; anything else is refused.
        let task = match ctx.meta.0.0.get(META_TASK_ID) {
            None | Some(Value::Null) => self.0.task_id.clone(),
            Some(Value::String(t)) => Some(t.clone()),
            Some(Value::Number(n)) if n.is_i64() || n.is_u64() => Some(n.to_string()),
            Some(other) => {
                count(&name, true, "refused");
                let why = format!(
                    "the task id in _meta (\"{META_TASK_ID}\") must be a string; got {}",
                    idem_core::text::snippet(other.to_string().as_bytes(), 64)
                );
                return to_result(texts::result(&texts::refused(&why), true, meta("refused", None, None, None)));
            }
        };
        let Some(task) = task else {
            count(&name, true, "refused");
            return to_result(texts::result(texts::NO_TASK_ID, true, meta("refused", None, None, None)));
        };
        let arguments = params.arguments.clone().unwrap_or_default();
        let validator = match self.validator(&tool) {
            Ok(v) => Some(v),
            Err(e) => {
                tracing::warn!(tool = %name, error = %e, "idem mcp: arguments not checked");
                None
            }
        };
        if let Some(v) = validator {
            let args = Value::Object(arguments.clone());
            let errors: Vec<String> = v
                .iter_errors(&args)
                .take(3)
                .map(|e| {
                    let at = e.instance_path().to_string();
                    if at.is_empty() { e.to_string() } else { format!("{at}: {e}") }
                })
                .collect();
            if !errors.is_empty() {
                let why = format!(
                    "the arguments do not match the tool's inputSchema ({}); correct them and call again",
                    errors.join("; ")
                );
                return refuse(why, "refused", true);
            }
        }
        let meta_on = passed_meta(&ctx);
        let progress = host_progress(&ctx);
        let me = self.clone();
        // Its own task: a host that goes away mid-call does not cut the recording short.
        let run = tokio::spawn(async move {
            let downstream = me.0.downstream.clone();
            let send = |args: Map<String, Value>, timeout: Duration| async move {
                let mut p = params.clone();
                p.arguments = Some(args);
                send_call(&downstream, p, meta_on, progress, timeout).await
            };
            let (answer, decision) = me.0.guard.call(&task, &name, &arguments, send).await;
            count(&name, true, decision);
            if decision == "unknown" {
                me.0.settle.notify_one();
            }
            answer
        });
        match run.await {
            Ok(Ok(v)) => to_result(v),
            Ok(Err(e)) => Err(e),
            Err(e) => Err(McpError::internal_error(format!("the guard failed: {e}"), None)),
        }
    }
}

/// Sends one guarded call to the server and says what became of it (see [`Sent`]).
pub async fn send_call(
    downstream: &Downstream,
    params: CallToolRequestParams,
    meta: Option<RequestMetaObject>,
    progress: Option<HostProgress>,
    timeout: Duration,
) -> Sent {
    let opts = || {
        let o = PeerRequestOptions::with_timeout(timeout);
        match &meta {
            Some(m) => o.with_meta(m.clone()),
            None => o,
        }
    };
    let req = ClientRequest::CallToolRequest(Request::new(params));
    let handle = match downstream.send(req, opts).await {
        Ok(h) => h,
        Err(why) => return Sent::NotSent(why),
    };
    let _route = progress.map(|h| downstream.routes().route(handle.progress_token.clone(), h.peer, h.token));
    // rmcp's own timeout ends the wait; this one only bounds a transport that never does.
    match tokio::time::timeout(timeout + Duration::from_secs(1), handle.await_response()).await {
        Err(_) | Ok(Err(ServiceError::Timeout { .. })) => Sent::Lost(texts::timed_out(timeout.as_millis() as u64)),
        Ok(Ok(ServerResult::CallToolResult(r))) => match serde_json::to_value(&r) {
            Ok(v) => Sent::Result(v),
            Err(_) => Sent::Lost("the server's answer could not be read".into()),
        },
        Ok(Ok(_)) => Sent::Lost("the server's answer was not a valid tool result".into()),
        Ok(Err(ServiceError::McpError(e))) if refusal_code(e.code.0) => Sent::Refused(e),
        Ok(Err(ServiceError::McpError(e))) => Sent::Lost(format!(
            "the server answered with error {} ({}), which does not prove the call did nothing",
            e.code.0, e.message
        )),
        Ok(Err(ServiceError::TransportClosed)) => {
            Sent::Lost("the connection to the server ended before its answer".into())
        }
        Ok(Err(e)) if connection_refused(&e) => {
            // Streamable HTTP opens a connection per request: a refused connection carried
            // nothing (a reset or a timeout after connecting might have), so the call was
            // not made and a repeat may send it. The session is dropped, so the next call
            // starts a new one with the server when it is back.
            tracing::warn!(error = %e, "idem mcp: no connection to the tool server; nothing was sent");
            downstream.reset().await;
            Sent::NotSent("no connection could be made to its URL: it is not running".into())
        }
        Ok(Err(e)) => {
            // The transport's own error names Rust types and internals: logged, not shown.
            tracing::warn!(error = %e, "idem mcp: no answer from the tool server");
            Sent::Lost("no answer came back (the transport to the server failed after the call was sent)".into())
        }
    }
}

/// Whether `e` says no connection to the server could be made (refused, no route, connect
/// timeout): the request never left, as opposed to a reset or timeout after connecting.
/// rmcp's Streamable HTTP error does not expose its client error as a source, so that one
/// is looked into by type (reqwest's `is_connect`); elsewhere the chain of sources is
/// searched for an `ECONNREFUSED`.
fn connection_refused(e: &ServiceError) -> bool {
    use rmcp::transport::streamable_http_client::StreamableHttpError;
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        if err.downcast_ref::<std::io::Error>().is_some_and(|io| io.kind() == std::io::ErrorKind::ConnectionRefused) {
            return true;
        }
        if let Some(StreamableHttpError::Client(c)) = err.downcast_ref::<StreamableHttpError<reqwest::Error>>() {
            return c.is_connect();
        }
        cur = err.source();
    }
    false
}

/// A paginated list request's envelope.
fn paged<M: Default>(params: Option<PaginatedRequestParams>) -> RequestOptionalParam<M, PaginatedRequestParams> {
    RequestOptionalParam { method: Default::default(), params, extensions: Default::default() }
}

/// Passes a request on and takes the one kind of answer it may have.
macro_rules! pass {
    ($self:ident, $ctx:ident, $req:expr, $answer:path, $method:literal) => {
        match $self.forward($req, &$ctx).await? {
            $answer(r) => Ok(r),
            _ => Err(McpError::internal_error(concat!("unexpected answer to ", $method), None)),
        }
    };
}

fn to_result(v: Value) -> Result<CallToolResult, McpError> {
    serde_json::from_value(v)
        .map_err(|e| McpError::internal_error(format!("the guard built an invalid result: {e}"), None))
}

impl ServerHandler for GuardServer {
    fn get_info(&self) -> ServerConfig {
        let i = &self.0.info;
        let mut c = ServerCapabilities::default();
        c.tools = i.capabilities.tools.clone().or_else(|| Some(ToolsCapability::default()));
        c.prompts = i.capabilities.prompts.clone();
        c.resources = i.capabilities.resources.clone();
        c.completions = i.capabilities.completions.clone();
        c.logging = i.capabilities.logging.clone();
        let mut info = ServerConfig::new(c);
        if let Some(s) = &i.server_info {
            info.server_info = s.clone();
        }
        info.instructions = i.instructions.clone();
        info
    }

    async fn initialize(
        &self,
        request: InitializeRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<InitializeResult, McpError> {
        context.peer.set_peer_info(request.clone());
        self.0.hosts.add(context.peer.clone());
        self.negotiate_initialize(&request)
    }

    async fn list_tools(
        &self,
        request: Option<PaginatedRequestParams>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, McpError> {
        let req = ClientRequest::ListToolsRequest(paged(request));
        match self.forward(req, &ctx).await? {
            ServerResult::ListToolsResult(r) => {
                self.0.downstream.cache_tools(&r.tools);
                Ok(r)
            }
            _ => Err(McpError::internal_error("unexpected answer to tools/list", None)),
        }
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        ctx: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, McpError> {
        self.guarded_call(request, ctx).await.map(CallToolResponse::Complete)
    }

    async fn list_prompts(
        &self,
        request: Option<PaginatedRequestParams>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<ListPromptsResult, McpError> {
        pass!(
            self,
            ctx,
            ClientRequest::ListPromptsRequest(paged(request)),
            ServerResult::ListPromptsResult,
            "prompts/list"
        )
    }

    async fn get_prompt(
        &self,
        request: GetPromptRequestParams,
        ctx: RequestContext<RoleServer>,
    ) -> Result<GetPromptResponse, McpError> {
        match self.forward(ClientRequest::GetPromptRequest(Request::new(request)), &ctx).await? {
            ServerResult::GetPromptResult(r) => Ok(GetPromptResponse::Complete(r)),
            ServerResult::InputRequiredResult(r) => Ok(GetPromptResponse::InputRequired(r)),
            _ => Err(McpError::internal_error("unexpected answer to prompts/get", None)),
        }
    }

    async fn list_resources(
        &self,
        request: Option<PaginatedRequestParams>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<ListResourcesResult, McpError> {
        let req = ClientRequest::ListResourcesRequest(paged(request));
        pass!(self, ctx, req, ServerResult::ListResourcesResult, "resources/list")
    }

    async fn list_resource_templates(
        &self,
        request: Option<PaginatedRequestParams>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<ListResourceTemplatesResult, McpError> {
        let req = ClientRequest::ListResourceTemplatesRequest(paged(request));
        pass!(self, ctx, req, ServerResult::ListResourceTemplatesResult, "resources/templates/list")
    }

    async fn read_resource(
        &self,
        request: ReadResourceRequestParams,
        ctx: RequestContext<RoleServer>,
    ) -> Result<ReadResourceResponse, McpError> {
        match self.forward(ClientRequest::ReadResourceRequest(Request::new(request)), &ctx).await? {
            ServerResult::ReadResourceResult(r) => Ok(ReadResourceResponse::Complete(r)),
            ServerResult::InputRequiredResult(r) => Ok(ReadResourceResponse::InputRequired(r)),
            _ => Err(McpError::internal_error("unexpected answer to resources/read", None)),
        }
    }

    async fn complete(
        &self,
        request: CompleteRequestParams,
        ctx: RequestContext<RoleServer>,
    ) -> Result<CompleteResult, McpError> {
        let req = ClientRequest::CompleteRequest(Request::new(request));
        pass!(self, ctx, req, ServerResult::CompleteResult, "completion/complete")
    }

    #[allow(deprecated)]
    async fn set_level(&self, request: SetLevelRequestParams, ctx: RequestContext<RoleServer>) -> Result<(), McpError> {
        self.forward(ClientRequest::SetLevelRequest(Request::new(request)), &ctx).await.map(|_| ())
    }

    #[allow(deprecated)]
    async fn subscribe(
        &self,
        request: SubscribeRequestParams,
        ctx: RequestContext<RoleServer>,
    ) -> Result<(), McpError> {
        self.forward(ClientRequest::SubscribeRequest(Request::new(request)), &ctx).await.map(|_| ())
    }

    #[allow(deprecated)]
    async fn unsubscribe(
        &self,
        request: UnsubscribeRequestParams,
        ctx: RequestContext<RoleServer>,
    ) -> Result<(), McpError> {
        self.forward(ClientRequest::UnsubscribeRequest(Request::new(request)), &ctx).await.map(|_| ())
    }
}
