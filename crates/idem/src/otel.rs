//! OpenTelemetry trace export (cargo feature `otel`, off by default; issue 6).
//!
//! With `--otlp-endpoint URL` (or `OTEL_EXPORTER_OTLP_ENDPOINT`), every tracing span idem
//! records is also exported as an OpenTelemetry span, over OTLP/HTTP with protobuf bodies
//! (`POST {URL}/v1/traces`, `Content-Type: application/x-protobuf`). The span that
//! matters is `request` (idem-server's `logging.rs`: one per HTTP request, with
//! `request_id`, `method`, `route`, `tenant`, `key_hash` and `key`, the last left empty
//! under `--redact-keys`); its fields become span attributes.
//!
//! Rules and where they come from:
//! - The endpoint is the *base* URL, as the OTLP exporter specification defines
//!   `OTEL_EXPORTER_OTLP_ENDPOINT`: the signal path `v1/traces` is appended to its path
//!   (`http://collector:4318` → `http://collector:4318/v1/traces`). Plain `http://` to a
//!   collector on the same host or pod is the usual deployment; `https://` works too, with
//!   the workspace's reqwest (rustls on aws-lc-rs, webpki roots).
//! - The service name is `OTEL_SERVICE_NAME` (or `service.name` in
//!   `OTEL_RESOURCE_ATTRIBUTES`) when set, else `idem` (OpenTelemetry resource semantic
//!   conventions; the SDK's own fallback would be `unknown_service`).
//! - Spans are batched by the SDK's batch processor on its own thread: by default every
//!   5 000 ms or 512 spans, queue 2 048 spans, dropped beyond that (tunable with the
//!   standard `OTEL_BSP_SCHEDULE_DELAY`, `OTEL_BSP_MAX_EXPORT_BATCH_SIZE`,
//!   `OTEL_BSP_MAX_QUEUE_SIZE`, all read by `opentelemetry_sdk`). Each export is one
//!   blocking HTTP POST from that thread with a 10 s timeout, so a slow collector never
//!   stalls a request.
//! - Which spans are exported follows the same `RUST_LOG` filter as the logs (default
//!   `info`): `request` is an INFO span, so `RUST_LOG=warn` exports nothing.
//! - [`shutdown`] flushes what is queued; `idem serve` and `idem proxy` call it after a
//!   graceful shutdown (SIGINT/SIGTERM). A `kill -9` loses at most one batch interval.
//!
//! Export failures (collector down, 4xx/5xx) are logged by the SDK itself (its
//! `internal-logs` feature) at WARN/ERROR under the targets `opentelemetry-otlp` and
//! `opentelemetry_sdk`, once per failed batch after the exporter's own retries; they never
//! fail a request. Silence them with e.g. `RUST_LOG=info,opentelemetry_sdk=off,opentelemetry-otlp=off`.

use anyhow::Context;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::{Protocol, WithExportConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::{SdkTracer, SdkTracerProvider};
use std::sync::OnceLock;
use std::time::Duration;
use tracing::Subscriber;
use tracing_opentelemetry::OpenTelemetryLayer;
use tracing_subscriber::registry::LookupSpan;

/// The provider behind the layer, kept for [`shutdown`].
static PROVIDER: OnceLock<SdkTracerProvider> = OnceLock::new();

/// Service name used when neither `OTEL_SERVICE_NAME` nor `OTEL_RESOURCE_ATTRIBUTES` names one.
pub const DEFAULT_SERVICE_NAME: &str = "idem";

/// Timeout of one export POST.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(10);

/// The traces URL for an OTLP base endpoint: `v1/traces` appended to the base URL's path
/// (OTLP exporter spec, `OTEL_EXPORTER_OTLP_ENDPOINT`).
///
/// # Errors
/// The endpoint is not an absolute `http://` or `https://` URL.
pub fn traces_url(endpoint: &str) -> anyhow::Result<String> {
    let mut url = reqwest::Url::parse(endpoint.trim())
        .with_context(|| format!("--otlp-endpoint {endpoint:?} is not a URL (e.g. http://127.0.0.1:4318)"))?;
    if !matches!(url.scheme(), "http" | "https") {
        anyhow::bail!("--otlp-endpoint must be an http:// or https:// URL (OTLP/HTTP), not {endpoint:?}");
    }
    let path = format!("{}/v1/traces", url.path().trim_end_matches('/'));
    url.set_path(&path);
    Ok(url.into())
}

/// Builds the exporter, the batching tracer provider and the tracing layer that feeds it.
/// Call once, at start-up; the provider is kept for [`shutdown`].
///
/// # Errors
/// A bad endpoint URL, or the exporter's HTTP client cannot be built.
pub fn layer<S>(endpoint: &str) -> anyhow::Result<OpenTelemetryLayer<S, SdkTracer>>
where
    S: Subscriber + for<'span> LookupSpan<'span>,
{
    let url = traces_url(endpoint)?;
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(Protocol::HttpBinary)
        .with_endpoint(url.clone())
        .with_timeout(EXPORT_TIMEOUT)
        .build()
        .with_context(|| format!("cannot set up the OTLP exporter to {url}"))?;
    let provider = SdkTracerProvider::builder().with_batch_exporter(exporter).with_resource(resource()).build();
    let tracer = provider.tracer("idem");
    if PROVIDER.set(provider).is_err() {
        anyhow::bail!("OpenTelemetry export was set up twice");
    }
    Ok(tracing_opentelemetry::layer().with_tracer(tracer))
}

/// The resource: what the SDK detects from the environment (`OTEL_SERVICE_NAME`,
/// `OTEL_RESOURCE_ATTRIBUTES`, SDK name and version), with `service.name` = `idem` unless
/// the environment named the service.
fn resource() -> Resource {
    let detected = Resource::builder().build();
    let named = detected
        .get(&opentelemetry::Key::from_static_str("service.name"))
        .is_some_and(|v| !v.as_str().starts_with("unknown_service"));
    if named { detected } else { Resource::builder().with_service_name(DEFAULT_SERVICE_NAME).build() }
}

/// Flushes the queued spans and stops the exporter (blocking, on a blocking-pool thread).
/// Does nothing if export was never set up.
pub async fn shutdown() {
    let Some(provider) = PROVIDER.get() else { return };
    let provider = provider.clone();
    let done = tokio::task::spawn_blocking(move || provider.shutdown()).await;
    match done {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::warn!("OpenTelemetry export did not shut down cleanly: {e}"),
        Err(e) => tracing::warn!("OpenTelemetry shutdown task failed: {e}"),
    }
}
