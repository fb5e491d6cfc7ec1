//! Prometheus metrics at `GET /metrics` (text exposition format 0.0.4).
//!
//! The other crates emit through the `metrics` facade (`counter!`, `histogram!`) and never
//! depend on an exporter; this module installs the process-wide Prometheus recorder
//! ([`handle`]) and renders it. What is exported (no label ever carries a tenant, a key or
//! a payload; `action` and `error_class` keep their first 100 values, later ones are
//! `other`):
//!
//! | metric | type | labels | source |
//! |---|---|---|---|
//! | `idem_acquires_total` | counter | `decision` = acquired, already_held, replay, in_progress, retry_not_due, unknown, mismatch, late | every answered trigger (API and proxy) |
//! | `idem_completions_total` | counter | `action`, `outcome`, `error_class` | every applied completion (workers and connectors) |
//! | `idem_connector_attempts_total`, `idem_connector_retries_total` | counter | `connector` | calls a connector made (idem-connect) |
//! | `idem_reconciliations_total` | counter | `result` = found, absent, inconclusive, too_early | recorded lookups |
//! | `idem_resolutions_total` | counter | `to` | operators' resolutions |
//! | `idem_lease_expiries_total` | counter | | leases that expired into UNKNOWN (sweeper or trigger) |
//! | `idem_http_requests_total` | counter | `method`, `route`, `status` | every HTTP request (route template, not the raw path) |
//! | `idem_http_request_duration_seconds` | histogram | `method`, `route` | the same, seconds |
//! | `idem_store_batch_size`, `idem_store_commit_seconds` | histogram | `backend` | idem-store's commits (the `COMMIT` statement; on SQLite without the WAL's fsync) |
//! | `idem_store_sync_seconds` | histogram | `backend` = sqlite | the fsync of the SQLite write-ahead log that every answer waits for (idem-store `sqlite_sync`) |
//! | `idem_operations` | gauge | `state` | records per state, all tenants (refreshed at most every 5 s) |
//! | `idem_review_queue_depth` | gauge | | records flagged `needs_review` |
//! | `idem_unknown_stale` | gauge | | UNKNOWN records unchanged for 15 minutes or more |
//! | `idem_clock_offset_ms` | gauge | | PostgreSQL: the database's clock minus this node's wall clock at the last reading |
//! | `idem_clock_uncertainty_ms` | gauge | | PostgreSQL: how far this node's idea of the database's time may be off now |
//! | `idem_outbox_delivered_total`, `idem_outbox_retried_total`, `idem_outbox_dead_total`, `idem_outbox_unrecorded_total` | counter | `sink` | the relay's attempts (idem-outbox), in `idem serve` with `[outbox] in_serve` or `idem relay --listen` |
//! | `idem_outbox_lag_ms` | gauge | | age of the oldest undelivered outbox event (refreshed every 2 s by the relay) |
//! | `idem_outbox_events` | gauge | `state` | outbox events per state |
//!
//! `/metrics` needs no API key (Prometheus scrapers rarely carry one) unless
//! `--metrics-token` is set, and then a `Bearer` token. Its labels name no tenant or key,
//! but actions and error classes are those of every tenant, and the first 100 of each are
//! shared by all tenants: set the token (or keep the port private) where tenants must not
//! see each other's action names. Its database counts are cached for 5 s so scraping
//! cannot load the database.

use crate::AppState;
use async_trait::async_trait;
use axum::extract::{MatchedPath, Request, State};
use axum::http::{HeaderValue, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use idem_core::{AcquireInput, Decision, Lookup, OperationEvent, OperationRecord, Outcome};
use idem_store::keys::{ApiKeyInfo, Role};
use idem_store::{
    AcquireOutcome, CompleteOutcome, CompleteRequest, ListFilter, Overview, Page, ReconcileOutcome, ReconcileRequest,
    ResolveRequest, Store, StoreError, SweepOutcome,
};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// How long an UNKNOWN record waits before `idem_unknown_stale` counts it (15 min, in ms).
pub const UNKNOWN_STALE_MS: i64 = 15 * 60 * 1000;

/// How long the database gauges are reused between scrapes.
const GAUGE_TTL: Duration = Duration::from_secs(5);

/// Latency buckets (seconds): 0.5 ms to 10 s.
const SECONDS_BUCKETS: &[f64] = &[0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0];

/// Batch-size buckets (requests per commit).
const BATCH_BUCKETS: &[f64] = &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0];

/// The process-wide Prometheus recorder's handle, installing the recorder on first use.
/// When the embedding program installed another recorder first, idem's metrics go there
/// and this handle renders nothing.
pub fn handle() -> PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let recorder = PrometheusBuilder::new()
                .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), SECONDS_BUCKETS)
                .and_then(|b| b.set_buckets_for_metric(Matcher::Full("idem_store_batch_size".into()), BATCH_BUCKETS))
                .expect("the bucket lists are not empty")
                .build_recorder();
            let handle = recorder.handle();
            if metrics::set_global_recorder(recorder).is_err() {
                tracing::warn!("another metrics recorder is installed; /metrics will be empty");
            }
            describe();
            handle
        })
        .clone()
}

/// The `# HELP` lines.
fn describe() {
    use metrics::{describe_counter, describe_gauge, describe_histogram};
    describe_counter!("idem_acquires_total", "Answered triggers (POST /v1/operations and the proxy) by decision");
    describe_counter!("idem_completions_total", "Applied completions by action, outcome and error class");
    describe_counter!("idem_connector_attempts_total", "Calls a connector made to its provider");
    describe_counter!("idem_connector_retries_total", "Connector calls that were retries (attempt > 1)");
    describe_counter!("idem_reconciliations_total", "Recorded reconciliation lookups by result");
    describe_counter!("idem_resolutions_total", "Operator resolutions by target state");
    describe_counter!("idem_lease_expiries_total", "Leases that expired into UNKNOWN");
    describe_counter!("idem_http_requests_total", "HTTP requests by method, route template and status");
    describe_histogram!(
        "idem_http_request_duration_seconds",
        metrics::Unit::Seconds,
        "HTTP request latency by method and route template"
    );
    describe_histogram!("idem_store_batch_size", "Requests written per store commit (group commit)");
    describe_histogram!("idem_store_commit_seconds", metrics::Unit::Seconds, "Store commit latency");
    describe_histogram!(
        "idem_store_sync_seconds",
        metrics::Unit::Seconds,
        "SQLite: fsync of the write-ahead log that the batches' answers wait for"
    );
    describe_gauge!("idem_operations", "Operation records per state, all tenants");
    describe_gauge!("idem_review_queue_depth", "Operations flagged for review, all tenants");
    describe_gauge!("idem_unknown_stale", "UNKNOWN operations unchanged for 15 minutes or more");
    describe_gauge!(
        "idem_reconciliation_backlog",
        "UNKNOWN operations not yet flagged for review: the reconcilers' work still to do, all tenants"
    );
    describe_counter!("idem_workflows_started_total", "Workflow instances created (a repeated start is not counted)");
    describe_counter!(
        "idem_workflow_transitions_total",
        "Workflow instance state changes made by the engine, by the state entered"
    );
    describe_counter!(
        "idem_workflow_branches_total",
        "Calls of parallel branches and of items of steps for each item idem performed, and completions of branches your code performed, by kind and the state after"
    );
    describe_gauge!("idem_workflow_instances", "Workflow instances per state, all tenants");
    describe_gauge!(
        "idem_workflows_paused",
        "Workflow instances PAUSED, waiting for a person (a step in the review queue), all tenants"
    );
    describe_gauge!(
        "idem_clock_offset_ms",
        "PostgreSQL: the database's clock minus this node's wall clock (ms), at the last reading"
    );
    describe_gauge!(
        "idem_clock_uncertainty_ms",
        "PostgreSQL: how far this node's reading of the database's clock may be off (ms)"
    );
    describe_counter!("idem_outbox_delivered_total", "Outbox events the relay delivered, by sink");
    describe_counter!(
        "idem_outbox_retried_total",
        "Outbox delivery attempts that failed and were scheduled again, by sink"
    );
    describe_counter!("idem_outbox_dead_total", "Outbox events that became dead letters, by sink");
    describe_counter!(
        "idem_outbox_unrecorded_total",
        "Outbox delivery outcomes the database refused to record (the event is attempted again after its lease), by sink"
    );
    describe_gauge!("idem_outbox_lag_ms", "Age of the oldest undelivered (PENDING) outbox event (ms); 0 when none");
    describe_gauge!("idem_outbox_events", "Outbox events per state (PENDING, DELIVERED, DEAD, SKIPPED)");
}

/// Drains histogram samples into their buckets every 5 s (the exporter's upkeep; without
/// it, samples accumulate between scrapes).
pub fn spawn_upkeep() -> tokio::task::JoinHandle<()> {
    let h = handle();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(5));
        loop {
            tick.tick().await;
            h.run_upkeep();
        }
    })
}

/// The gauge values last read from the database, and when.
#[derive(Default)]
pub struct GaugeCache {
    last: Mutex<Option<Instant>>,
}

/// `GET /metrics`: the Prometheus text exposition.
#[utoipa::path(get, path = "/metrics", tag = "health", responses(
    (status = 200, description = "Prometheus text format 0.0.4", content_type = "text/plain"),
    (status = 401, description = "`--metrics-token` is set and the request lacks it", body = crate::problem::Problem, content_type = "application/problem+json"),
))]
pub async fn serve(State(state): State<AppState>, headers: axum::http::HeaderMap) -> Response {
    if let Some(token) = &state.metrics_token {
        let given = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .unwrap_or("");
        if !crate::ui::session::same_token(given, token) {
            let mut r = crate::problem::Problem::new(
                axum::http::StatusCode::UNAUTHORIZED,
                "unauthorized",
                "/metrics needs `Authorization: Bearer <IDEM_METRICS_TOKEN>`",
            )
            .into_response();
            r.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer realm=\"idem-metrics\""));
            return r;
        }
    }
    let due = {
        let mut last = state.gauges.last.lock().expect("gauge cache lock");
        let due = last.is_none_or(|t| t.elapsed() >= GAUGE_TTL);
        if due {
            *last = Some(Instant::now());
        }
        due
    };
    if due {
        let stale_before = state.clock.now_ms() - UNKNOWN_STALE_MS;
        match state.store.overview(None, stale_before, 0).await {
            Ok(o) => {
                for s in idem_core::State::ALL {
                    metrics::gauge!("idem_operations", "state" => s.as_str()).set(o.count_state(s) as f64);
                }
                metrics::gauge!("idem_review_queue_depth").set(o.needs_review() as f64);
                metrics::gauge!("idem_unknown_stale").set(o.unknown_stale as f64);
                let backlog: i64 = o
                    .groups
                    .iter()
                    .filter(|g| g.state == idem_core::State::Unknown && !g.needs_review)
                    .map(|g| g.count)
                    .sum();
                metrics::gauge!("idem_reconciliation_backlog").set(backlog as f64);
            }
            Err(e) => tracing::warn!(error = %e, "metrics: reading the counts failed"),
        }
        match state.store.flows().count_instances(None).await {
            Ok(counts) => {
                let of = |s| counts.iter().find(|(st, _)| *st == s).map_or(0, |(_, n)| *n) as f64;
                for s in idem_core::flow::InstanceState::ALL {
                    metrics::gauge!("idem_workflow_instances", "state" => s.as_str()).set(of(s));
                }
                metrics::gauge!("idem_workflows_paused").set(of(idem_core::flow::InstanceState::Paused));
            }
            Err(e) => tracing::warn!(error = %e, "metrics: reading the workflow counts failed"),
        }
    }
    if let Some(s) = state.database_clock.as_ref().map(|c| c.status()) {
        metrics::gauge!("idem_clock_offset_ms").set(s.offset_ms as f64);
        metrics::gauge!("idem_clock_uncertainty_ms").set(s.uncertainty_ms as f64);
    }
    let mut r = handle().render().into_response();
    r.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"));
    r
}

/// The `decision` label of an answered trigger.
pub fn decision_label(d: &Decision) -> &'static str {
    crate::metric_handles::DECISIONS[crate::metric_handles::decision_index(d)]
}

/// Counts one answered trigger (`idem_acquires_total{decision}`).
pub fn record_trigger(d: &Decision) {
    crate::metric_handles::DECISION_COUNTERS[crate::metric_handles::decision_index(d)].increment(1);
}

/// Middleware: counts and times every request by method, route template and status.
pub async fn track_http(req: Request, next: Next) -> Response {
    // Only the methods of RFC 9110 §9 as labels: any token is a valid method, and a client
    // must not be able to add series at will.
    let method = match req.method().as_str() {
        "GET" => "GET",
        "HEAD" => "HEAD",
        "POST" => "POST",
        "PUT" => "PUT",
        "DELETE" => "DELETE",
        "CONNECT" => "CONNECT",
        "OPTIONS" => "OPTIONS",
        "TRACE" => "TRACE",
        "PATCH" => "PATCH",
        _ => "other",
    };
    let start = Instant::now();
    let resp = next.run(req).await;
    let route = match resp.extensions().get::<MatchedPath>() {
        Some(matched) => matched.as_str(),
        None => resp.extensions().get::<RouteLabel>().map_or("unmatched", |label| label.0),
    };
    crate::metric_handles::record_http(method, route, resp.status().as_u16(), start.elapsed().as_secs_f64());
    resp
}

/// Response extension: the `route` label of an answer no route template matched by design,
/// e.g. [`crate::proxy::PROXIED_ROUTE`] for everything `idem proxy` forwards or refuses
/// itself (the raw path is never a label: it is unbounded and may hold a key).
#[derive(Debug, Clone, Copy)]
pub struct RouteLabel(pub &'static str);

/// Middleware inside the router (the only place that knows which route matched): records
/// the route template (`/v1/operations/{key}`) in the request's span and hands it to
/// [`track_http`], which runs outside the router, in the response's extensions. A
/// request no route matched gets none ("unmatched").
pub async fn expose_route(req: Request, next: Next) -> Response {
    let route = req.extensions().get::<MatchedPath>().cloned();
    if let Some(r) = &route {
        tracing::Span::current().record("route", r.as_str());
    }
    let mut resp = next.run(req).await;
    if let Some(r) = route {
        resp.extensions_mut().insert(r);
    }
    resp
}

/// A [`Store`] that counts what passes through it: completions, reconciliations,
/// resolutions and lease expiries. Everything else is delegated unchanged.
pub struct MeteredStore(pub Arc<dyn Store>);

fn lookup_label(l: &Lookup) -> &'static str {
    match l {
        Lookup::Found { .. } => "found",
        Lookup::Absent => "absent",
        Lookup::Inconclusive { .. } => "inconclusive",
        Lookup::TooEarly { .. } => "too_early",
    }
}

fn error_class(o: &Outcome) -> String {
    match o {
        Outcome::RetryableFailure { error_class, .. }
        | Outcome::AmbiguousRetryable { error_class, .. }
        | Outcome::FinalFailure { error_class, .. } => bounded_label("error_class", error_class),
        _ => String::new(),
    }
}

pub use idem_connect::labels::{MAX_LABEL_VALUES, bounded_label};

impl MeteredStore {
    /// `call`, given up after the store's answer timeout ([`Store::answer_timeout`]) with
    /// [`StoreError::NoAnswer`]: a request is answered 503 instead of waiting on a
    /// database that a network partition cut off, or on a commit that waits for a
    /// synchronous standby that is gone (issue 33).
    async fn bounded<T>(
        &self,
        call: impl std::future::Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        match self.0.answer_timeout() {
            None => call.await,
            Some(limit) => tokio::time::timeout(limit, call)
                .await
                .unwrap_or_else(|_| Err(StoreError::NoAnswer(u64::try_from(limit.as_millis()).unwrap_or(u64::MAX)))),
        }
    }
}

#[async_trait]
impl Store for MeteredStore {
    async fn acquire(&self, input: AcquireInput) -> Result<AcquireOutcome, StoreError> {
        let out = self.bounded(self.0.acquire(input)).await?;
        if out.decision == Decision::ExpireToUnknown {
            metrics::counter!("idem_lease_expiries_total").increment(1);
        }
        Ok(out)
    }

    async fn complete(&self, req: CompleteRequest) -> Result<CompleteOutcome, StoreError> {
        let outcome = req.outcome.name();
        let class = error_class(&req.outcome);
        let out = self.bounded(self.0.complete(req)).await?;
        if out.changed {
            metrics::counter!("idem_completions_total", "action" => bounded_label("action", &out.record.action), "outcome" => outcome, "error_class" => class)
                .increment(1);
        }
        Ok(out)
    }

    async fn renew(&self, req: idem_store::RenewRequest) -> Result<OperationRecord, StoreError> {
        self.bounded(self.0.renew(req)).await
    }

    async fn get(&self, tenant: &str, key: &str) -> Result<Option<OperationRecord>, StoreError> {
        self.bounded(self.0.get(tenant, key)).await
    }

    async fn tombstone(&self, tenant: &str, key: &str) -> Result<Option<idem_core::Tombstone>, StoreError> {
        self.bounded(self.0.tombstone(tenant, key)).await
    }

    async fn events(&self, tenant: &str, key: &str) -> Result<Vec<OperationEvent>, StoreError> {
        self.bounded(self.0.events(tenant, key)).await
    }

    async fn list(&self, tenant: &str, filter: &ListFilter) -> Result<Page, StoreError> {
        self.bounded(self.0.list(tenant, filter)).await
    }

    async fn overview(&self, tenant: Option<&str>, stale_before_ms: i64, recent: i64) -> Result<Overview, StoreError> {
        self.bounded(self.0.overview(tenant, stale_before_ms, recent)).await
    }

    async fn due_executions(&self, connector: &str, limit: i64) -> Result<Vec<OperationRecord>, StoreError> {
        self.bounded(self.0.due_executions(connector, limit)).await
    }

    async fn due_reconciliations(&self, limit: i64) -> Result<Vec<OperationRecord>, StoreError> {
        self.bounded(self.0.due_reconciliations(limit)).await
    }

    async fn reconcile(&self, req: ReconcileRequest) -> Result<ReconcileOutcome, StoreError> {
        let result = lookup_label(&req.lookup);
        let out = self.bounded(self.0.reconcile(req)).await?;
        if out.changed {
            metrics::counter!("idem_reconciliations_total", "result" => result).increment(1);
        }
        Ok(out)
    }

    async fn resolve(&self, req: ResolveRequest) -> Result<OperationRecord, StoreError> {
        let to = req.to.as_str();
        let out = self.bounded(self.0.resolve(req)).await?;
        metrics::counter!("idem_resolutions_total", "to" => to).increment(1);
        Ok(out)
    }

    async fn sweep(&self, limit: i64) -> Result<SweepOutcome, StoreError> {
        self.bounded(self.0.sweep(limit)).await
    }

    async fn expire_leases(&self, limit: i64) -> Result<u64, StoreError> {
        let n = self.bounded(self.0.expire_leases(limit)).await?;
        metrics::counter!("idem_lease_expiries_total").increment(n);
        Ok(n)
    }

    async fn create_api_key(
        &self,
        tenant: &str,
        principal: &str,
        role: Role,
        secret: Option<String>,
    ) -> Result<(ApiKeyInfo, String), StoreError> {
        self.bounded(self.0.create_api_key(tenant, principal, role, secret)).await
    }

    async fn authenticate(&self, secret: &str) -> Result<Option<ApiKeyInfo>, StoreError> {
        self.bounded(self.0.authenticate(secret)).await
    }

    async fn list_api_keys(&self, tenant: Option<&str>) -> Result<Vec<ApiKeyInfo>, StoreError> {
        self.bounded(self.0.list_api_keys(tenant)).await
    }

    async fn revoke_api_key(&self, id: &str) -> Result<bool, StoreError> {
        self.bounded(self.0.revoke_api_key(id)).await
    }

    async fn revoke_api_key_keeping_an_admin(
        &self,
        tenant: &str,
        id: &str,
    ) -> Result<idem_store::keys::Revocation, StoreError> {
        self.bounded(self.0.revoke_api_key_keeping_an_admin(tenant, id)).await
    }

    async fn count_api_keys(&self) -> Result<i64, StoreError> {
        self.bounded(self.0.count_api_keys()).await
    }

    async fn ping(&self) -> Result<(), StoreError> {
        self.0.ping().await
    }

    async fn commit_durability(&self) -> Result<idem_store::CommitDurability, StoreError> {
        self.bounded(self.0.commit_durability()).await
    }

    fn answer_timeout(&self) -> Option<std::time::Duration> {
        self.0.answer_timeout()
    }

    fn fatal(&self) -> Option<StoreError> {
        self.0.fatal()
    }

    fn flows(&self) -> &dyn idem_store::flow::WorkflowStore {
        self.0.flows()
    }
}
