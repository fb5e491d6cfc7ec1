//! The real MCP server behind the guard, as rmcp's client sees it: a child process over
//! stdio or a Streamable HTTP URL.
//!
//! The connection is made at start and made again on the next request after it ended (the
//! server crashed, or never started): the guard keeps serving, and a call that finds no
//! server is told so, with nothing recorded as performed. Notifications the server sends
//! (log messages, list changes, resource updates) are passed on to every connected host
//! unchanged; progress goes to the host whose request it is about, with its own token
//! ([`ProgressRoutes`]).

// Log messages are deprecated by SEP-2577 but still sent by servers on older revisions.
#![allow(deprecated)]

use rmcp::model::ClientRequest;
use rmcp::model::{
    ClientConfig, Implementation, LoggingMessageNotificationParam, ProgressNotificationParam, ProgressToken,
    ResourceUpdatedNotificationParam, Tool,
};
use rmcp::service::{
    NotificationContext, Peer, PeerRequestOptions, RequestHandle, RoleClient, RoleServer, RunningService, ServiceError,
};
use rmcp::{ClientHandler, ServiceExt};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Where the server is.
#[derive(Debug, Clone)]
pub enum Target {
    /// A command (program and arguments) started as a child process, spoken to over stdio.
    Command(Vec<String>),
    /// A Streamable HTTP endpoint (`http://127.0.0.1:9000/mcp`).
    Url(String),
}

/// The hosts connected to the guard, for passing on what the server sends by itself.
#[derive(Default)]
pub struct Hosts {
    peers: Mutex<Vec<Peer<RoleServer>>>,
}

impl Hosts {
    /// Adds a host (at its `initialize`).
    pub fn add(&self, p: Peer<RoleServer>) {
        let mut peers = self.peers.lock().expect("hosts lock");
        peers.retain(|p| !p.is_transport_closed());
        peers.push(p);
    }

    fn all(&self) -> Vec<Peer<RoleServer>> {
        let mut peers = self.peers.lock().expect("hosts lock");
        peers.retain(|p| !p.is_transport_closed());
        peers.clone()
    }

    async fn each<F, Fut>(&self, f: F)
    where
        F: Fn(Peer<RoleServer>) -> Fut,
        Fut: Future<Output = Result<(), rmcp::service::ServiceError>>,
    {
        for p in self.all() {
            if let Err(e) = f(p).await {
                tracing::debug!(error = %e, "idem mcp: a host did not take a notification");
            }
        }
    }
}

/// Where the server's progress notifications go: rmcp gives every request to the server a
/// progress token of its own, so each request the guard passes on that carried a host's
/// token is entered here (the server's token → the host and its token) while it runs.
#[derive(Default)]
pub struct ProgressRoutes(Mutex<HashMap<ProgressToken, (Peer<RoleServer>, ProgressToken)>>);

/// An entry of [`ProgressRoutes`], removed when dropped (the request ended).
pub struct Route<'a> {
    routes: &'a ProgressRoutes,
    token: ProgressToken,
}

impl ProgressRoutes {
    /// Routes the server's progress on `token` to `host` as `host_token` until the returned
    /// entry is dropped.
    pub fn route(&self, token: ProgressToken, host: Peer<RoleServer>, host_token: ProgressToken) -> Route<'_> {
        self.0.lock().expect("routes lock").insert(token.clone(), (host, host_token));
        Route { routes: self, token }
    }

    fn get(&self, token: &ProgressToken) -> Option<(Peer<RoleServer>, ProgressToken)> {
        self.0.lock().expect("routes lock").get(token).cloned()
    }
}

impl Drop for Route<'_> {
    fn drop(&mut self) {
        self.routes.0.lock().expect("routes lock").remove(&self.token);
    }
}

/// The guard's client handler: passes the server's notifications on to the hosts.
pub struct Relay {
    hosts: Arc<Hosts>,
    tools: Arc<Mutex<Option<HashMap<String, Tool>>>>,
    routes: Arc<ProgressRoutes>,
}

impl ClientHandler for Relay {
    async fn on_progress(&self, mut params: ProgressNotificationParam, _: NotificationContext<RoleClient>) {
        // Progress of a request no host asked progress for has nowhere to go.
        if let Some((host, token)) = self.routes.get(&params.progress_token) {
            params.progress_token = token;
            if let Err(e) = host.notify_progress(params).await {
                tracing::debug!(error = %e, "idem mcp: a host did not take a progress notification");
            }
        }
    }

    async fn on_logging_message(&self, params: LoggingMessageNotificationParam, _: NotificationContext<RoleClient>) {
        self.hosts
            .each(|p| {
                let v = params.clone();
                async move { p.notify_logging_message(v).await }
            })
            .await;
    }

    async fn on_resource_updated(&self, params: ResourceUpdatedNotificationParam, _: NotificationContext<RoleClient>) {
        self.hosts
            .each(|p| {
                let v = params.clone();
                async move { p.notify_resource_updated(v).await }
            })
            .await;
    }

    async fn on_resource_list_changed(&self, _: NotificationContext<RoleClient>) {
        self.hosts.each(|p| async move { p.notify_resource_list_changed().await }).await;
    }

    async fn on_tool_list_changed(&self, _: NotificationContext<RoleClient>) {
        *self.tools.lock().expect("tools lock") = None;
        self.hosts.each(|p| async move { p.notify_tool_list_changed().await }).await;
    }

    async fn on_prompt_list_changed(&self, _: NotificationContext<RoleClient>) {
        self.hosts.each(|p| async move { p.notify_prompt_list_changed().await }).await;
    }

    fn get_info(&self) -> ClientConfig {
        let mut c = ClientConfig::default();
        c.client_info = Implementation::new("idem-mcp", env!("CARGO_PKG_VERSION"));
        c
    }
}

/// One connection to the server.
struct Conn {
    service: RunningService<RoleClient, Relay>,
}

/// The server behind the guard.
pub struct Downstream {
    target: Target,
    hosts: Arc<Hosts>,
    conn: tokio::sync::Mutex<Option<Conn>>,
    tools: Arc<Mutex<Option<HashMap<String, Tool>>>>,
    routes: Arc<ProgressRoutes>,
    start_timeout: Duration,
}

/// What the guard knows of the server from its handshake.
#[derive(Debug, Clone)]
pub struct ServerFacts {
    /// `serverInfo.name`, if it sent one.
    pub name: Option<String>,
    /// The capabilities, instructions and identity, to show the host.
    pub info: rmcp::model::ServerPeerInfo,
}

impl Downstream {
    /// A server at `target`; the handshake must finish within `start_timeout`.
    pub fn new(target: Target, hosts: Arc<Hosts>, start_timeout: Duration) -> Self {
        Downstream {
            target,
            hosts,
            conn: Default::default(),
            tools: Default::default(),
            routes: Default::default(),
            start_timeout,
        }
    }

    /// A peer of a live connection, connecting first when there is none.
    ///
    /// # Errors
    /// Why the server is not running (for the agent's "not performed" answer).
    pub async fn peer(&self) -> Result<Peer<RoleClient>, String> {
        let mut conn = self.conn.lock().await;
        if let Some(c) = conn.as_ref()
            && !c.service.is_closed()
        {
            return Ok(c.service.peer().clone());
        }
        if conn.take().is_some() {
            *self.tools.lock().expect("tools lock") = None;
            tracing::warn!("idem mcp: the connection to the tool server ended; starting it again");
        }
        let c = self.connect().await?;
        let peer = c.service.peer().clone();
        *conn = Some(c);
        Ok(peer)
    }

    /// Where the server's progress notifications go.
    pub fn routes(&self) -> &ProgressRoutes {
        &self.routes
    }

    /// Sends `req` with the options `opts` makes, and returns the handle of its answer. A
    /// connection that turns out closed (the server just died: rmcp notices on the next
    /// write) is replaced once and the request sent on the new one — safe, since nothing
    /// was sent.
    ///
    /// # Errors
    /// Why nothing could be sent.
    pub async fn send(
        &self,
        req: ClientRequest,
        opts: impl Fn() -> PeerRequestOptions,
    ) -> Result<RequestHandle<RoleClient>, String> {
        let peer = self.peer().await.map_err(|why| format!("the tool server is not running: {why}"))?;
        match peer.send_request_with_option(req.clone(), opts()).await {
            Err(ServiceError::TransportClosed) => {
                self.forget(&peer).await;
                let peer = self.peer().await.map_err(|why| format!("the tool server is not running: {why}"))?;
                peer.send_request_with_option(req, opts()).await.map_err(|e| e.to_string())
            }
            other => other.map_err(|e| e.to_string()),
        }
    }

    /// Drops the current connection (its session): the next call connects again.
    pub async fn reset(&self) {
        if let Some(c) = self.conn.lock().await.take() {
            *self.tools.lock().expect("tools lock") = None;
            let mut c = c;
            let _ = c.service.close().await;
        }
    }

    /// Drops the connection `peer` belongs to, if it is still the current one.
    async fn forget(&self, peer: &Peer<RoleClient>) {
        let mut conn = self.conn.lock().await;
        if conn.as_ref().is_some_and(|c| c.service.peer().is_transport_closed() || peer.is_transport_closed()) {
            conn.take();
            *self.tools.lock().expect("tools lock") = None;
        }
    }

    /// The server's handshake facts (connecting when needed).
    ///
    /// # Errors
    /// Why the server is not running.
    pub async fn facts(&self) -> Result<ServerFacts, String> {
        let peer = self.peer().await?;
        let info = peer.peer_info().ok_or("the server sent no handshake")?;
        let info = (*info).clone();
        Ok(ServerFacts { name: info.server_info.as_ref().map(|i| i.name.clone()), info })
    }

    async fn connect(&self) -> Result<Conn, String> {
        let relay = Relay { hosts: self.hosts.clone(), tools: self.tools.clone(), routes: self.routes.clone() };
        let started = match &self.target {
            Target::Command(argv) => {
                let (program, args) = argv.split_first().ok_or("no server command given")?;
                let mut cmd = tokio::process::Command::new(program);
                cmd.args(args);
                // The server's stderr is the guard's: the host shows it in its log.
                let (transport, _) = rmcp::transport::TokioChildProcess::builder(cmd)
                    .stderr(std::process::Stdio::inherit())
                    .spawn()
                    .map_err(|e| format!("the server command {program:?} could not be started: {e}"))?;
                tokio::time::timeout(self.start_timeout, relay.serve(transport)).await
            }
            Target::Url(url) => {
                let transport = rmcp::transport::StreamableHttpClientTransport::from_uri(url.as_str());
                tokio::time::timeout(self.start_timeout, relay.serve(transport)).await
            }
        };
        match started {
            Ok(Ok(service)) => {
                tracing::info!("idem mcp: connected to the tool server");
                Ok(Conn { service })
            }
            Ok(Err(e)) => Err(format!("it did not complete the MCP handshake: {e}")),
            Err(_) => {
                Err(format!("it did not complete the MCP handshake within {} ms", self.start_timeout.as_millis()))
            }
        }
    }

    /// The server's tools by name, listed once per connection (again after a
    /// `tools/list_changed`, or when `refresh`).
    ///
    /// # Errors
    /// Why the server is not running or did not list its tools.
    pub async fn tools(&self, refresh: bool) -> Result<HashMap<String, Tool>, String> {
        if !refresh && let Some(t) = self.tools.lock().expect("tools lock").clone() {
            return Ok(t);
        }
        let peer = self.peer().await?;
        let list = peer.list_all_tools().await.map_err(|e| format!("tools/list failed: {e}"))?;
        let map: HashMap<String, Tool> = list.into_iter().map(|t| (t.name.to_string(), t)).collect();
        *self.tools.lock().expect("tools lock") = Some(map.clone());
        Ok(map)
    }

    /// Forgets the tool list (the host listed the tools again: the next call sees the
    /// list the host saw).
    pub fn cache_tools(&self, tools: &[Tool]) {
        let map = tools.iter().map(|t| (t.name.to_string(), t.clone())).collect();
        let mut cached = self.tools.lock().expect("tools lock");
        match cached.as_mut() {
            Some(m) => m.extend::<HashMap<String, Tool>>(map),
            None => *cached = Some(map),
        }
    }

    /// Ends the connection (the child process is stopped).
    pub async fn close(&self) {
        if let Some(mut c) = self.conn.lock().await.take() {
            let _ = c.service.close().await;
        }
    }
}
