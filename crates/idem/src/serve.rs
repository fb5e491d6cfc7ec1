//! `idem serve`: open the store (applying migrations), then run the HTTP server.

use crate::cli::{LogFormat, ServeArgs};
use anyhow::Context;
use idem_core::{Clock, SystemClock};
use std::sync::Arc;
use std::time::Duration;
use tracing_subscriber::EnvFilter;

/// Sets up the global tracing subscriber: the `RUST_LOG` filter (default
/// `info,sqlx=warn,tower_http=warn`), log lines on stderr (text or JSON), and, with
/// `otlp_endpoint` in a build with the `otel` feature, span export to OpenTelemetry
/// ([`crate::otel`]; the same filter decides which spans go out).
///
/// # Errors
/// An OTLP endpoint in a build without the `otel` feature (one line naming the feature),
/// or an endpoint the exporter refuses.
pub(crate) fn init_logging(format: LogFormat, otlp_endpoint: Option<&str>) -> anyhow::Result<()> {
    init_logging_with(format, otlp_endpoint, "info,sqlx=warn,tower_http=warn")
}

/// [`init_logging`] with another default filter (when `RUST_LOG` is not set).
pub(crate) fn init_logging_with(format: LogFormat, otlp_endpoint: Option<&str>, default: &str) -> anyhow::Result<()> {
    use std::io::IsTerminal;
    use tracing_subscriber::prelude::*;
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default));
    // Colours only for a terminal: redirected logs stay plain text.
    let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr).with_ansi(std::io::stderr().is_terminal());
    let fmt = match format {
        LogFormat::Text => fmt.boxed(),
        LogFormat::Json => fmt.json().boxed(),
    };
    #[cfg(feature = "otel")]
    let otel = otlp_endpoint.map(crate::otel::layer).transpose()?;
    #[cfg(not(feature = "otel"))]
    let otel: Option<tracing_subscriber::layer::Identity> = match otlp_endpoint {
        Some(_) => anyhow::bail!(
            "--otlp-endpoint (OTEL_EXPORTER_OTLP_ENDPOINT) needs an idem built with `--features otel`; this build has no OpenTelemetry export"
        ),
        None => None,
    };
    tracing_subscriber::registry().with(filter).with(fmt).with(otel).try_init()?;
    Ok(())
}

/// Takes an exclusive lock beside an SQLite file for this process's lifetime: one
/// `idem serve` per file (its writer task assumes it is the only one batching writes).
/// `idem keys …` does not take it, so it works beside a running server.
fn lock_sqlite(path: &str) -> anyhow::Result<Option<std::fs::File>> {
    if let Some(why) = idem_store::sqlite_path_error(path) {
        anyhow::bail!(why);
    }
    let lock_path = format!("{path}.serve-lock");
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path)
        .with_context(|| format!("cannot create the lock file {lock_path}"))?;
    match file.try_lock() {
        Ok(()) => Ok(Some(file)),
        Err(std::fs::TryLockError::WouldBlock) => anyhow::bail!(
            "another idem serve already uses {path}: run one server per SQLite file, or use PostgreSQL for several nodes"
        ),
        Err(std::fs::TryLockError::Error(e)) => Err(e).with_context(|| format!("cannot lock {lock_path}")),
    }
}

/// What `serve` and `proxy` set up alike: logging, the lock, the config, the store.
struct Prepared {
    _lock: Option<std::fs::File>,
    store: Arc<dyn idem_store::Store>,
    clock: Arc<dyn Clock>,
    config: idem_server::ServerConfig,
}

async fn prepare(args: ServeArgs, lookup: Option<Arc<dyn idem_connect::Connector>>) -> anyhow::Result<Prepared> {
    // First, before anything is opened: an OTLP endpoint this build cannot honour fails here.
    init_logging(args.log_format, args.otlp_endpoint.as_deref().filter(|e| !e.trim().is_empty()))?;
    idem_server::logging::set_redact_keys(args.redact_keys);
    // The configuration is checked before anything is opened or created (the lock file,
    // the database): a bad one fails at once and leaves nothing behind.
    let connect = match &args.config {
        Some(path) => idem_connect::Config::load(path)?,
        None => idem_connect::Config::default(),
    };
    let mut registry = idem_connect::Registry::from_config(&connect)?;
    if let Some(l) = lookup {
        // The proxy's client decides when to retry: a request its lookup proved absent is
        // forwarded again however often that happened (no attempt limit on its behalf).
        let policy = idem_core::RetryPolicy { max_attempts: i64::MAX, ..Default::default() };
        registry.add_lookup_only(idem_server::proxy::PROXY_LOOKUP, l, policy, 5);
    }
    let workflows = idem_flow::config::definitions(&connect, &registry)?;
    if let Some(key) = &args.bootstrap_key {
        idem_store::keys::validate_supplied_secret(key)
            .map_err(|e| anyhow::anyhow!("bootstrap key (IDEM_BOOTSTRAP_KEY, --bootstrap-key): {e}"))?;
    }
    // Then the socket: a port in use fails before the database file is created.
    let listener = Arc::new(idem_server::listen(&args.listen).await?.into_std()?);
    let lock = match idem_store::parse_database_url(&args.db.database_url)? {
        idem_store::DatabaseUrl::Sqlite(path) => lock_sqlite(path)?,
        idem_store::DatabaseUrl::Postgres(_) => None,
    };
    let outbox = crate::outbox::relay_config(&connect)?;
    let registry = Arc::new(registry);
    // One clock for the whole ledger (DESIGN.md §2 invariant 7): on PostgreSQL the
    // database's, for the store and everything else in the process that needs "now".
    let database_clock = match idem_store::parse_database_url(&args.db.database_url)? {
        idem_store::DatabaseUrl::Postgres(url) => Some(
            idem_store::postgres::DatabaseClock::connect(url, args.max_clock_uncertainty_ms)
                .await
                .with_context(|| format!("cannot connect to the database {} (to read its clock)", redact(url)))?,
        ),
        idem_store::DatabaseUrl::Sqlite(_) => None,
    };
    let clock: Arc<dyn Clock> = match &database_clock {
        Some(c) => c.clone(),
        None => Arc::new(SystemClock),
    };
    let store_config = idem_store::StoreConfig {
        retention: connect.retention()?,
        acquire_timeout: Some(Duration::from_millis(args.db_acquire_timeout_ms)),
        answer_timeout: Some(Duration::from_millis(args.db_answer_timeout_ms)),
        ..Default::default()
    };
    let store = idem_store::open(&args.db.database_url, clock.clone(), store_config)
        .await
        .with_context(|| format!("cannot open the database {}", redact(&args.db.database_url)))?;
    let config = idem_server::ServerConfig {
        listen: args.listen.clone(),
        listener: Some(listener),
        limits: idem_server::request_body::Limits {
            max_body_bytes: args.max_body_bytes,
            max_inflight_body_bytes: args.max_inflight_body_bytes,
            inflight_wait: Duration::from_millis(args.inflight_wait_ms),
            body_read_timeout: Duration::from_millis(args.body_read_timeout_ms),
            header_read_timeout: Duration::from_millis(args.header_read_timeout_ms),
        },
        sweep_interval: Duration::from_millis(args.sweep_interval_ms),
        bootstrap_key: args.bootstrap_key,
        metrics_token: args.metrics_token.filter(|t| !t.is_empty()),
        connect,
        registry,
        database_clock,
        workflows,
        outbox,
    };
    Ok(Prepared { _lock: lock, store, clock, config })
}

/// `--check-config`: what a start checks of its configuration before it opens anything —
/// the file (`--config`: connectors with their secrets, action defaults, workflows, the
/// `[outbox]` relay, retention) and the bootstrap key — without opening the database or
/// binding the port. Prints one line when a start would get past them.
///
/// # Errors
/// The first thing a start would refuse, as one line naming the field.
fn check_config(args: &ServeArgs) -> anyhow::Result<()> {
    let connect = match &args.config {
        Some(path) => idem_connect::Config::load(path)?,
        None => idem_connect::Config::default(),
    };
    let registry = idem_connect::Registry::from_config(&connect)?;
    let workflows = idem_flow::config::definitions(&connect, &registry)?;
    crate::outbox::relay_config(&connect)?;
    connect.retention()?;
    if let Some(key) = &args.bootstrap_key {
        idem_store::keys::validate_supplied_secret(key)
            .map_err(|e| anyhow::anyhow!("bootstrap key (IDEM_BOOTSTRAP_KEY, --bootstrap-key): {e}"))?;
    }
    let names: Vec<&str> = registry.names().filter(|n| !n.starts_with("lookup:")).collect();
    crate::out!(
        "idem: configuration OK ({}: {} connector(s){}, {} workflow(s){})",
        args.config.as_ref().map_or_else(|| "no --config".to_owned(), |p| p.display().to_string()),
        names.len(),
        if names.is_empty() { String::new() } else { format!(" {}", names.join(", ")) },
        workflows.len(),
        if connect.outbox.is_some() { ", an [outbox] relay" } else { "" }
    );
    Ok(())
}

pub async fn run(args: ServeArgs) -> anyhow::Result<()> {
    if args.check_config {
        return check_config(&args);
    }
    let p = prepare(args, None).await?;
    let served = idem_server::run(p.store, p.clock, p.config).await;
    #[cfg(feature = "otel")]
    crate::otel::shutdown().await;
    Ok(served?)
}

pub async fn run_proxy(args: crate::cli::ProxyArgs) -> anyhow::Result<()> {
    use axum::http::{HeaderName, Method};
    let upstream =
        reqwest::Url::parse(&args.upstream).with_context(|| format!("--upstream {:?} is not a URL", args.upstream))?;
    if !matches!(upstream.scheme(), "http" | "https") {
        anyhow::bail!("--upstream must be an http:// or https:// URL");
    }
    let header = |h: &String| {
        HeaderName::from_bytes(h.to_ascii_lowercase().as_bytes()).with_context(|| format!("{h:?} is not a header name"))
    };
    let methods = args
        .methods
        .split(',')
        .map(|m| {
            Method::from_bytes(m.trim().to_ascii_uppercase().as_bytes())
                .with_context(|| format!("{m:?} is not an HTTP method"))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let proxy = idem_server::proxy::ProxyConfig {
        upstream,
        methods,
        prefixes: args.route_prefix.clone(),
        fingerprint_headers: args.fingerprint_header.iter().map(header).collect::<anyhow::Result<_>>()?,
        stored_headers: args.store_header.iter().map(header).collect::<anyhow::Result<_>>()?,
        max_request_bytes: args.serve.max_body_bytes,
        max_stored_bytes: args.max_stored_body_bytes,
        timeout: Duration::from_millis(args.timeout_ms),
        auth: match &args.principal_header {
            Some(h) => idem_server::proxy::ClientAuth::TrustedHeader(header(h)?),
            None => idem_server::proxy::ClientAuth::ApiKey,
        },
        outcome_unknown: idem_server::proxy::parse_outcome_unknown_statuses(&args.outcome_unknown_statuses)
            .map_err(|e| anyhow::anyhow!("--outcome-unknown-statuses {e}"))?,
        provider_deduplicates: idem_server::proxy::parse_provider_deduplicates(&args.provider_deduplicates)
            .map_err(|e| anyhow::anyhow!("--provider-deduplicates {e}"))?,
        error_format: idem_server::proxy::parse_error_formats(&args.error_format)
            .map_err(|e| anyhow::anyhow!("--error-format {e}"))?,
    };
    let lookup: Option<Arc<dyn idem_connect::Connector>> = match &args.lookup_url {
        Some(url) => Some(Arc::new(idem_server::proxy::ProxyLookup::new(
            url,
            &args.lookup_found_pointer,
            Duration::from_millis(args.lookup_absent_after_ms),
            proxy.timeout,
        )?)),
        None => None,
    };
    if args.serve.check_config {
        return check_config(&args.serve);
    }
    let p = prepare(args.serve, lookup).await?;
    let served = idem_server::run_proxy(p.store, p.clock, p.config, proxy).await;
    #[cfg(feature = "otel")]
    crate::otel::shutdown().await;
    Ok(served?)
}

/// The URL without its password, for messages.
pub fn redact(url: &str) -> String {
    match (url.find("://"), url.find('@')) {
        (Some(s), Some(at)) if at > s => {
            let creds = &url[s + 3..at];
            match creds.split_once(':') {
                Some((user, _)) => format!("{}{user}:***{}", &url[..s + 3], &url[at..]),
                None => url.to_string(),
            }
        }
        _ => url.to_string(),
    }
}
