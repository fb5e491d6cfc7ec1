//! idem-server: the HTTP API over a [`Store`].
//!
//! - [`router`]: `/v1/operations…`, `/v1/workflows…` ([`workflows`]), `/healthz`, `/readyz`, `/openapi.json`, `/problems/{slug}`,
//!   `/metrics` ([`metrics`]) and the admin page under `/ui` ([`ui`]).
//! - [`run`]: binds, bootstraps the first admin key, starts the lease sweeper, serves until
//!   SIGINT/SIGTERM.
//!
//! This crate owns HTTP concerns only (auth, validation, status codes, problem+json,
//! OpenAPI). It must not talk SQL or decide protocol questions: the store and idem-core do.

// `Problem` (about 170 bytes) is the error of every handler and validator; the error path
// is cold, and boxing it everywhere would only add noise.
#![allow(clippy::result_large_err)]

pub mod auth;
pub mod dto;
pub mod health;
pub mod http_server;
pub mod index;
pub mod json;
pub mod keys;
pub mod logging;
pub mod metric_handles;
pub mod metrics;
pub mod openapi;
pub mod openapi_contract;
pub mod operations;
pub mod problem;
pub mod proxy;
pub mod request_body;
pub mod review;
pub mod ui;
pub mod workflows;

use axum::Router;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use idem_connect::{Executor, Reconciler, Registry};
use idem_core::Clock;
use idem_store::Store;
use idem_store::keys::Role;
use idem_store::postgres::DatabaseClock;
use std::sync::Arc;
use std::time::Duration;
use tower_http::request_id::{PropagateRequestIdLayer, SetRequestIdLayer};

/// Default request body limit: 1 MiB.
pub const DEFAULT_MAX_BODY_BYTES: usize = 1024 * 1024;

/// What every handler shares.
#[derive(Clone)]
pub struct AppState {
    /// The ledger.
    pub store: Arc<dyn Store>,
    /// Time source: the ledger's clock, the same one the store reads (on PostgreSQL the
    /// database's, [`idem_store::postgres::DatabaseClock`]; on SQLite the system clock).
    pub clock: Arc<dyn Clock>,
    /// The database's clock when `clock` is one: its offset and uncertainty for
    /// `/metrics`, and its bound for `/readyz`.
    pub database_clock: Option<Arc<DatabaseClock>>,
    /// Runs connector-backed operations.
    pub executor: Arc<Executor>,
    /// Settles UNKNOWN operations by lookup.
    pub reconciler: Arc<Reconciler>,
    /// Workflows: the declared definitions and the engine.
    pub flows: Arc<idem_flow::Flows>,
    /// The admin page's sessions and recent late arrivals.
    pub ui: Arc<ui::UiState>,
    /// When `/metrics` last read its gauges from the store.
    pub gauges: Arc<metrics::GaugeCache>,
    /// Bearer token `/metrics` asks for; `None` = open.
    pub metrics_token: Option<Arc<str>>,
    /// The database's last known state, for `/readyz` ([`health::spawn_prober`]).
    pub health: Arc<health::Health>,
    /// The outbox of `[outbox]`, if configured (the admin page's `/ui/outbox`), and the
    /// tenant whose operators see it.
    pub outbox: Option<(idem_outbox::store::OutboxStore, String)>,
}

impl AppState {
    /// State with the connectors of `registry`, the loops set up by `config`. The store is
    /// wrapped in a [`metrics::MeteredStore`], so every user of `AppState::store` (handlers,
    /// executor, reconciler, sweepers) is counted.
    pub fn new(
        store: Arc<dyn Store>,
        clock: Arc<dyn Clock>,
        registry: Arc<Registry>,
        config: &idem_connect::Config,
        workflows: std::collections::BTreeMap<String, idem_flow::config::Declared>,
    ) -> Self {
        let store: Arc<dyn Store> = Arc::new(metrics::MeteredStore(store));
        let executor = Arc::new(Executor::new(
            store.clone(),
            registry.clone(),
            clock.clone(),
            config.executor.concurrency,
            Duration::from_millis(config.executor.poll_interval_ms),
        ));
        let reconciler = Arc::new(Reconciler::new(
            store.clone(),
            registry.clone(),
            clock.clone(),
            Duration::from_millis(config.reconciler.interval_ms),
        ));
        let flows = idem_flow::Flows::new(
            store.clone(),
            executor.clone(),
            reconciler.clone(),
            registry,
            clock.clone(),
            workflows,
        );
        AppState {
            store,
            clock,
            executor,
            reconciler,
            database_clock: None,
            flows,
            ui: Default::default(),
            gauges: Default::default(),
            metrics_token: None,
            health: Default::default(),
            outbox: None,
        }
    }
}

impl AppState {
    /// Accounts for one answered trigger (API or proxy): its decision's counter, and a
    /// late arrival (410) on the admin page's overview.
    pub fn answered_trigger(&self, decision: &idem_core::Decision, tenant: &str, key: &str, request_id: Option<&str>) {
        metrics::record_trigger(decision);
        if *decision == idem_core::Decision::Late {
            self.ui.record_late(ui::LateArrival {
                tenant: tenant.to_owned(),
                key: key.to_owned(),
                at_ms: self.clock.now_ms(),
                request_id: request_id.map(str::to_owned),
            });
        }
    }
}

/// Server settings.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Address to listen on, `HOST:PORT` (`127.0.0.1:8080`, `localhost:0`; port 0 picks a
    /// free one).
    pub listen: String,
    /// A socket already listening on `listen`: `idem serve` binds before it opens the
    /// store, so a start that cannot listen creates no database file. `None`: bound at
    /// start, before the bootstrap key is created.
    pub listener: Option<Arc<std::net::TcpListener>>,
    /// Body size limit, in-flight body budget, body and header read deadlines.
    pub limits: request_body::Limits,
    /// How often the lease sweeper turns expired leases into UNKNOWN.
    pub sweep_interval: Duration,
    /// Secret of the admin key to create on first start (`IDEM_BOOTSTRAP_KEY`).
    pub bootstrap_key: Option<String>,
    /// Bearer token `/metrics` asks for (`IDEM_METRICS_TOKEN`); `None` = open.
    pub metrics_token: Option<String>,
    /// Executor and reconciler settings (`--config`).
    pub connect: idem_connect::Config,
    /// The connectors built from `connect` (built before start-up, so a bad config fails
    /// before anything listens).
    pub registry: Arc<Registry>,
    /// On PostgreSQL, the database's clock that the `clock` given to [`run`] is: `/readyz`
    /// checks its uncertainty bound and `/metrics` shows its offset and uncertainty.
    pub database_clock: Option<Arc<DatabaseClock>>,
    /// The workflows declared in `connect` (`[workflows.NAME]`), validated against
    /// `registry` before start-up.
    pub workflows: std::collections::BTreeMap<String, idem_flow::config::Declared>,
    /// `[outbox]` of `connect`, checked: the admin page shows that outbox, and with
    /// `in_serve = true` this server runs its relay.
    pub outbox: Option<idem_outbox::relay::config::RelayConfig>,
}

/// The application's routes with their middleware: the API, `/metrics` and the admin page;
/// request bodies bounded by `budget` ([`request_body`]).
pub fn router(state: AppState, budget: request_body::BodyBudget) -> Router {
    app(state, budget, true)
}

/// [`router`] without the admin page, for `idem proxy`, which nests it under `/_idem/`
/// (the page's links and cookie assume `/ui`; run `idem serve` on the same database for it).
pub fn api_router(state: AppState, budget: request_body::BodyBudget) -> Router {
    app(state, budget, false)
}

fn app(state: AppState, budget: request_body::BodyBudget, with_ui: bool) -> Router {
    let max_body_bytes = budget.limits().max_body_bytes;
    let x_request_id = axum::http::HeaderName::from_static("x-request-id");
    let routes = if with_ui { ui::router().route("/", get(index::index)) } else { Router::new() };
    let routes = routes
        .route("/v1/operations", post(operations::acquire).get(operations::list))
        .route("/v1/operations/{key}", get(operations::get_one))
        .route("/v1/operations/{key}/complete", post(operations::complete))
        .route("/v1/operations/{key}/renew", post(operations::renew))
        .route("/v1/operations/{key}/resolve", post(review::resolve))
        .route("/v1/operations/{key}/reconcile", post(review::reconcile))
        .route("/v1/workflows", post(workflows::start).get(workflows::list))
        .route("/v1/workflows/{instance}", get(workflows::get_one))
        .route("/v1/workflows/{instance}/rerun", post(workflows::rerun))
        .route("/v1/workflows/{instance}/compensate", post(workflows::compensate))
        .route("/v1/workflows/{instance}/steps/{step}", post(workflows::acquire_step))
        .route("/v1/workflows/{instance}/steps/{step}/complete", post(workflows::complete_step))
        .route("/v1/keys", post(keys::create).get(keys::list))
        .route("/v1/keys/{id}", axum::routing::delete(keys::revoke))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/openapi.json", get(openapi::serve))
        .route("/problems/{slug}", get(problem::describe))
        .route("/metrics", get(metrics::serve))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(state)
        // Inside the router, so that a body refused before its handler (413, 503
        // overloaded, 408) is still counted and logged under its route.
        .layer(axum::middleware::from_fn_with_state(budget, request_body::guard))
        .layer(axum::middleware::from_fn(metrics::expose_route));
    // The middleware wraps the router once, outermost first. Applied with `Router::layer`
    // it wrapped every route's service instead, and each layer clones the service below
    // it on every request: 35 boxed clones and ~45 allocations per request (callgrind),
    // about 20 000 instructions of an acquire's ~320 000.
    let service = tower::ServiceBuilder::new()
        .layer(axum::middleware::from_fn(logging::sanitize_request_id))
        .layer(SetRequestIdLayer::new(x_request_id.clone(), logging::MakeRequestId))
        .layer(logging::trace_layer())
        .layer(PropagateRequestIdLayer::new(x_request_id))
        .layer(DefaultBodyLimit::max(max_body_bytes))
        .layer(axum::middleware::from_fn(metrics::track_http))
        .layer(axum::middleware::from_fn(problem::fill_request_id))
        .service(routes);
    Router::new().fallback_service(service)
}

/// Whether `uri` is on the admin page, whose errors are HTML pages, not problem+json.
fn is_ui(uri: &axum::http::Uri) -> bool {
    uri.path() == "/ui" || uri.path().starts_with("/ui/")
}

async fn method_not_allowed(uri: axum::http::Uri) -> Response {
    if is_ui(&uri) {
        return ui::error_page(None, StatusCode::METHOD_NOT_ALLOWED, "This page does not take that method.");
    }
    let detail = format!("this route does not take that method{}", slash_hint(&uri));
    problem::Problem::new(StatusCode::METHOD_NOT_ALLOWED, "method-not-allowed", detail).into_response()
}

async fn not_found(uri: axum::http::Uri) -> Response {
    if is_ui(&uri) {
        return ui::error_page(None, StatusCode::NOT_FOUND, "No such page.");
    }
    let detail = format!("no such route{}", slash_hint(&uri));
    problem::Problem::new(StatusCode::NOT_FOUND, "not-found", detail).into_response()
}

/// A hint for a path that reads as a key or id holding a raw `/` (issue 28 §6: `GET
/// /v1/operations/order/7` got a bare 404): such ids travel as one percent-encoded path
/// segment (RFC 3986 §2.1), `order%2F7`. "" for other paths.
fn slash_hint(uri: &axum::http::Uri) -> String {
    for base in ["/v1/operations/", "/v1/workflows/"] {
        if let Some(rest) = uri.path().strip_prefix(base)
            && rest.contains('/')
        {
            let (first, _) = rest.split_once('/').unwrap_or((rest, ""));
            let whole = rest.trim_end_matches(['/']);
            return format!(
                ": a key or id that holds '/' goes into the path percent-encoded as one segment ({base}{}, not {base}{whole}); if {first:?} is the whole id, check the route in /openapi.json",
                whole.replace('/', "%2F"),
            );
        }
    }
    String::new()
}

/// Liveness: the process answers, and nothing only a restart ends has happened to it: a
/// failed fsync of the SQLite write-ahead log ([`idem_store::StoreError::NotDurable`])
/// makes it 503 `not-durable`, so a supervisor that restarts on liveness restarts it; the
/// last probe finding idem's tables gone (the database was dropped and created again under
/// the node) makes it 503 `schema-missing`.
#[utoipa::path(get, path = "/healthz", tag = "health", responses(
    (status = 200, description = "alive", content_type = "text/plain", body = String),
    (status = 503, description = "this node cannot serve: the SQLite write-ahead log could not be synced (`not-durable`, with `Retry-After`: restart it), or idem's tables are gone from the database, which was dropped or replaced under it (`schema-missing`, with `Retry-After`: restore the database)", body = problem::Problem, content_type = "application/problem+json")
))]
pub async fn healthz(State(state): State<AppState>) -> Response {
    if let Some(e) = state.store.fatal() {
        return operations::not_durable(&e).into_response();
    }
    if let Some(f) = state.health.schema_missing() {
        return schema_missing(&f).into_response();
    }
    "ok\n".into_response()
}

/// 503 `schema-missing`: the database answers but idem's tables are gone (issue 28 §7).
fn schema_missing(f: &health::Failure) -> problem::Problem {
    let mut p = problem::Problem::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "schema-missing",
        format!(
            "{}: every request fails; restore the database from a backup, then restart this node (a restart on an empty database starts an empty ledger that has forgotten every key)",
            f.words
        ),
    );
    p.retry_after_ms = Some(operations::UNAVAILABLE_RETRY_AFTER_MS);
    p
}

/// Readiness: the database answered this node's last probe (every 250 ms, see
/// [`health`]) and, on PostgreSQL, this node knows the database's time within
/// `--max-clock-uncertainty-ms`. Answers at once from what the node knows, never waiting
/// for the database.
#[utoipa::path(get, path = "/readyz", tag = "health", operation_id = "readyz", responses(
    (status = 200, description = "ready", content_type = "text/plain", body = String),
    (status = 503, description = "the database did not answer the last probe (`unavailable`, with `Retry-After`), this node must be restarted because the SQLite write-ahead log could not be synced (`not-durable`, with `Retry-After`), idem's tables are gone from the database (`schema-missing`, with `Retry-After`), or this node cannot tell the database's time closely enough (`clock-uncertain`)", body = problem::Problem, content_type = "application/problem+json")
))]
pub async fn readyz(State(state): State<AppState>) -> Response {
    if let Some(e) = state.store.fatal() {
        return operations::not_durable(&e).into_response();
    }
    if matches!(state.health.database(), Err(health::NotReady::Unknown)) {
        // No probe ran yet (a router without the prober): probe once, bounded.
        state.health.probe(state.store.as_ref()).await;
    }
    if let Err(why) = state.health.database() {
        let detail = match why {
            health::NotReady::Down { failure, .. } if failure.schema_missing => {
                return schema_missing(&failure).into_response();
            }
            health::NotReady::Down { for_ms, failure } => {
                format!("the database has not answered for {for_ms} ms ({})", failure.words)
            }
            health::NotReady::Stale { ms } => format!("the database has not been checked for {ms} ms"),
            health::NotReady::Unknown => "the database has not been checked yet".to_owned(),
        };
        let mut p = problem::Problem::new(StatusCode::SERVICE_UNAVAILABLE, "unavailable", detail);
        p.retry_after_ms = Some(operations::UNAVAILABLE_RETRY_AFTER_MS);
        return p.into_response();
    }
    if let Some(s) = state.database_clock.as_ref().map(|c| c.status())
        && !s.within_bound()
    {
        return problem::Problem::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "clock-uncertain",
            format!(
                "this node knows the database's time only within {} ms (bound {} ms; last reading {} ms ago)",
                s.uncertainty_ms, s.max_uncertainty_ms, s.since_reading_ms
            ),
        )
        .into_response();
    }
    match state.health.durability() {
        Some(d) => format!("ready\ndurability: {}\n", d.describe()).into_response(),
        None => "ready\n".into_response(),
    }
}

/// Creates the first admin key if the store has none (DESIGN.md §10): the given secret
/// (`IDEM_BOOTSTRAP_KEY`) or a generated one. Returns the generated secret, which the
/// caller shows once; `None` when nothing was generated.
///
/// # Errors
/// Store errors, or an invalid supplied secret.
pub async fn bootstrap(store: &dyn Store, supplied: Option<String>) -> Result<Option<String>, idem_store::StoreError> {
    if store.count_api_keys().await? > 0 {
        if let Some(s) = supplied
            && store.authenticate(&s).await?.is_none()
        {
            tracing::warn!("IDEM_BOOTSTRAP_KEY is ignored: API keys already exist in this database");
        }
        return Ok(None);
    }
    let generated = supplied.is_none();
    match store.create_api_key("default", "bootstrap", Role::Admin, supplied.clone()).await {
        Ok((info, secret)) => {
            tracing::info!(id = %info.id, "created the bootstrap admin key for tenant \"default\"");
            Ok(generated.then_some(secret))
        }
        Err(idem_store::StoreError::Invalid(msg)) => {
            // Another node sharing the database may have created the same supplied key first.
            match supplied {
                Some(s) if store.authenticate(&s).await?.is_some() => Ok(None),
                _ => Err(idem_store::StoreError::Invalid(msg)),
            }
        }
        Err(e) => Err(e),
    }
}

/// Runs the lease sweeper until the process ends: every `interval`, expired leases of
/// actions that are not redo_safe become UNKNOWN (in batches of 500), and `reconciler` is
/// woken when any did, so those nobody can be asked about are flagged for review at once.
pub fn spawn_lease_sweeper(
    store: Arc<dyn Store>,
    interval: Duration,
    reconciler: Arc<Reconciler>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            loop {
                match store.expire_leases(500).await {
                    Ok(500) => {
                        reconciler.wake();
                        continue;
                    }
                    Ok(n) => {
                        if n > 0 {
                            tracing::info!(expired = n, "leases expired into UNKNOWN");
                            reconciler.wake();
                        }
                        break;
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "lease sweep failed");
                        break;
                    }
                }
            }
        }
    })
}

/// Runs the retention sweeper until the process ends: every `interval`, final records past
/// their retention become tombstones and expired tombstones go, in bounded batches.
pub fn spawn_retention_sweeper(store: Arc<dyn Store>, interval: Duration, batch: i64) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            // Finished workflow instances first: their step operations become sweepable.
            loop {
                match store.flows().sweep_instances(batch).await {
                    Ok(n) if n as i64 == batch => continue,
                    Ok(n) => {
                        if n > 0 {
                            tracing::info!(instances = n, "retention sweep of workflow instances");
                        }
                        break;
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "retention sweep of workflow instances failed");
                        break;
                    }
                }
            }
            loop {
                match store.sweep(batch).await {
                    Ok(out) => {
                        if out.records > 0 || out.tombstones > 0 {
                            tracing::info!(records = out.records, tombstones = out.tombstones, "retention sweep");
                        }
                        if out.records < batch as u64 && out.tombstones < batch as u64 {
                            break;
                        }
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "retention sweep failed");
                        break;
                    }
                }
            }
        }
    })
}

/// Serves the API on `config.listen` until SIGINT or SIGTERM, with the lease sweeper, the
/// executor and the reconciler running beside it.
///
/// Prints `idem: listening on http://ADDR` on stdout once bound (scripts and tests read
/// the port from it), and the generated bootstrap key on first start.
///
/// # Errors
/// Bind failures, store errors during bootstrap, or I/O errors from the server.
pub async fn run(store: Arc<dyn Store>, clock: Arc<dyn Clock>, config: ServerConfig) -> std::io::Result<()> {
    serve_with(store, clock, config, |state, budget| Ok(router(state, budget))).await
}

/// Like [`run`], but serving `idem proxy`: requests are proxied to the upstream with
/// Idempotency-Key semantics (see [`proxy`]), and idem's API lives under `/_idem/`.
///
/// # Errors
/// As [`run`].
pub async fn run_proxy(
    store: Arc<dyn Store>,
    clock: Arc<dyn Clock>,
    config: ServerConfig,
    proxy_config: proxy::ProxyConfig,
) -> std::io::Result<()> {
    serve_with(store, clock, config, move |state, budget| {
        let api = api_router(state.clone(), budget.clone());
        println!(
            "idem: proxy for the upstream {} (Idempotency-Key on {}; idem's own API under /_idem/)",
            proxy_config.upstream,
            proxy_config.methods.iter().map(|m| m.as_str()).collect::<Vec<_>>().join(", ")
        );
        let proxy_state = proxy::ProxyState::new(state, proxy_config).map_err(std::io::Error::other)?;
        Ok(proxy::router(proxy_state, api, budget))
    })
    .await
}

/// A socket listening on `addr` (`HOST:PORT`, names resolved, port 0 picks a free one).
///
/// # Errors
/// An address that does not resolve or cannot be bound (in use, not local, a privileged
/// port), as one line naming `addr`.
pub async fn listen(addr: &str) -> std::io::Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| std::io::Error::new(e.kind(), format!("cannot listen on {addr}: {e}")))
}

async fn serve_with(
    store: Arc<dyn Store>,
    clock: Arc<dyn Clock>,
    config: ServerConfig,
    app: impl FnOnce(AppState, request_body::BodyBudget) -> std::io::Result<Router>,
) -> std::io::Result<()> {
    // Bind first: a start that cannot listen must not use up the one-time admin key (it
    // would be printed to a start that then fails, and never again).
    let listener = match &config.listener {
        Some(bound) => tokio::net::TcpListener::from_std(bound.try_clone()?)?,
        None => listen(&config.listen).await?,
    };
    let io = |e: idem_store::StoreError| std::io::Error::other(format!("bootstrap key (IDEM_BOOTSTRAP_KEY): {e}"));
    if let Some(secret) = bootstrap(store.as_ref(), config.bootstrap_key.clone()).await.map_err(io)? {
        println!("idem: first start: created an admin API key for tenant \"default\". It is shown only this once:");
        println!("idem: IDEM_API_KEY={secret}");
    }
    metrics::handle();
    let mut state = AppState::new(store, clock, config.registry.clone(), &config.connect, config.workflows.clone());
    state.database_clock = config.database_clock.clone();
    state.metrics_token = config.metrics_token.as_deref().map(Arc::from);
    let mut relay_task = None;
    if let Some(outbox) = &config.outbox {
        let relay = idem_outbox::relay::Relay::from_config(outbox).await.map_err(std::io::Error::other)?;
        state.outbox = Some((relay.store().clone(), outbox.tenant.clone()));
        if outbox.in_serve {
            let relay = Arc::new(relay);
            relay_task = Some((relay.clone(), relay.spawn(outbox.retention_ms)));
        }
    }
    let store = state.store.clone();
    let budget = request_body::BodyBudget::new(config.limits.clone());
    let app = app(state.clone(), budget)?;
    println!("idem: listening on http://{}", listener.local_addr()?);
    let sweep_every = Duration::from_millis(config.connect.retention.sweep_interval_ms);
    let loops = [
        spawn_retention_sweeper(store.clone(), sweep_every, config.connect.retention.sweep_batch),
        state.flows.clone().spawn_runner(
            Duration::from_millis(config.connect.executor.poll_interval_ms),
            config.connect.executor.concurrency,
            Duration::from_millis(config.connect.executor.workflow_hold_ms),
        ),
        spawn_lease_sweeper(store, config.sweep_interval, state.reconciler.clone()),
        state.executor.clone().spawn_loop(),
        state.reconciler.clone().spawn_loop(),
        metrics::spawn_upkeep(),
        health::spawn_prober(state.health.clone(), state.store.clone()),
    ];
    let result = http_server::serve(listener, app, config.limits.header_read_timeout, shutdown_signal()).await;
    for l in loops {
        l.abort();
    }
    if let Some((relay, task)) = relay_task {
        // As `idem relay` does: finish and record the deliveries in flight, claim no more.
        relay.stop_and_drain(task).await;
    }
    result
}

/// Resolves on Ctrl-C (SIGINT) or SIGTERM: when `idem serve` and `idem relay` shut down
/// gracefully.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        if let Ok(mut s) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            s.recv().await;
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {},
        () = term => {},
    }
    tracing::info!("shutting down");
}
