//! Request bodies under bounds: a deadline for reading them and a budget of body bytes in
//! flight, so slow clients cannot hold a connection and wide payloads cannot take all
//! the memory (issue 15 §1).
//!
//! [`guard`] runs before any handler. A request whose body is not known to be empty:
//! 1. reserves its size from the node's in-flight budget ([`Limits::max_inflight_body_bytes`]):
//!    the `Content-Length`, or the body limit when it is chunked. When the budget is
//!    spent it waits up to [`Limits::inflight_wait`] for other requests to finish, then
//!    answers `503 overloaded` with `Retry-After` (RFC 9110 §15.6.4) — never more in
//!    flight than configured. A `Content-Length` over the body limit is `413`, without
//!    reserving anything: a body of at most [`DRAIN_OVERSIZED_MAX`] is first read and
//!    dropped frame by frame (within the body deadline), so that a client still writing
//!    it — Python's `http.client` reads no answer before its body is sent — receives the
//!    413 instead of a reset (what nginx's lingering close is for); a larger one is
//!    answered at once and its connection closed. A chunked body found over the limit
//!    while it is read is drained the same way, up to the same bound, before its 413.
//! 2. reads the whole body within [`Limits::body_read_timeout`], else `408
//!    request-timeout` and the connection is closed (RFC 9110 §15.5.9);
//! 3. keeps its reservation until the handler has answered: parsing, fingerprinting and
//!    storing a payload take a multiple of its size, and that is what the budget bounds.
//!
//! When the last reservation of a burst of large bodies is released, freed memory is
//! handed back to the operating system (glibc `malloc_trim`), so a burst does not leave
//! its peak resident.

use crate::problem::Problem;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;
use tokio::sync::Semaphore;

/// Default [`Limits::max_inflight_body_bytes`]: 8 MiB (eight bodies of the default 1 MiB
/// limit at once).
pub const DEFAULT_MAX_INFLIGHT_BODY_BYTES: usize = 8 * 1024 * 1024;
/// Default [`Limits::inflight_wait`]: 5 s.
pub const DEFAULT_INFLIGHT_WAIT: Duration = Duration::from_secs(5);
/// Default [`Limits::body_read_timeout`]: 30 s.
pub const DEFAULT_BODY_READ_TIMEOUT: Duration = Duration::from_secs(30);
/// Default [`Limits::header_read_timeout`]: 10 s.
pub const DEFAULT_HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// The largest body declared over the limit that is still read (and dropped) before its
/// 413, so its client gets the answer rather than a connection reset: 16 MiB. It costs
/// reading, never holding: one frame at a time, no reservation.
pub const DRAIN_OVERSIZED_MAX: usize = 16 * 1024 * 1024;
/// Released bytes after which an idle moment returns freed memory to the OS: 4 MiB.
const TRIM_AFTER_BYTES: usize = 4 * 1024 * 1024;

/// What a node accepts from its clients, per connection and in total.
#[derive(Debug, Clone)]
pub struct Limits {
    /// Largest request body, in bytes (`--max-body-bytes`); larger is `413`.
    pub max_body_bytes: usize,
    /// Request body bytes all requests together may hold (`--max-inflight-body-bytes`).
    pub max_inflight_body_bytes: usize,
    /// How long a request waits for room in that budget before `503 overloaded`
    /// (`--inflight-wait-ms`).
    pub inflight_wait: Duration,
    /// Longest time to read a whole request body (`--body-read-timeout-ms`); then `408`.
    pub body_read_timeout: Duration,
    /// Longest time a client may take to send a request's headers
    /// (`--header-read-timeout-ms`); then the connection is closed.
    pub header_read_timeout: Duration,
}

impl Limits {
    /// The defaults, with `max_body_bytes` as the body limit.
    pub fn with_max_body_bytes(max_body_bytes: usize) -> Self {
        Limits {
            max_body_bytes,
            max_inflight_body_bytes: DEFAULT_MAX_INFLIGHT_BODY_BYTES.max(max_body_bytes),
            inflight_wait: DEFAULT_INFLIGHT_WAIT,
            body_read_timeout: DEFAULT_BODY_READ_TIMEOUT,
            header_read_timeout: DEFAULT_HEADER_READ_TIMEOUT,
        }
    }
}

/// The node's body budget, shared by its routes.
#[derive(Debug, Clone)]
pub struct BodyBudget {
    limits: Limits,
    permits: Arc<Semaphore>,
    in_flight: Arc<AtomicUsize>,
    released_since_trim: Arc<AtomicUsize>,
}

impl BodyBudget {
    /// A budget of `limits.max_inflight_body_bytes` (at least one maximal body).
    pub fn new(mut limits: Limits) -> Self {
        limits.max_inflight_body_bytes = limits.max_inflight_body_bytes.max(limits.max_body_bytes).max(1);
        let total = limits.max_inflight_body_bytes.min(Semaphore::MAX_PERMITS);
        limits.max_inflight_body_bytes = total;
        BodyBudget {
            limits,
            permits: Arc::new(Semaphore::new(total)),
            in_flight: Default::default(),
            released_since_trim: Default::default(),
        }
    }

    /// The limits it enforces.
    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// Body bytes reserved right now (for `/metrics`).
    pub fn in_flight_bytes(&self) -> usize {
        self.in_flight.load(Ordering::Relaxed)
    }

    fn release(&self, bytes: usize) {
        let left = self.in_flight.fetch_sub(bytes, Ordering::AcqRel) - bytes;
        let released = self.released_since_trim.fetch_add(bytes, Ordering::AcqRel) + bytes;
        if left == 0 && released >= TRIM_AFTER_BYTES {
            self.released_since_trim.store(0, Ordering::Release);
            tokio::task::spawn_blocking(return_freed_memory);
        }
    }
}

/// Hands freed heap memory back to the operating system (glibc keeps it otherwise, per
/// thread arena, and a burst of wide payloads would stay resident).
fn return_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only walks glibc's own heap structures under its locks.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Middleware: reserve, read under a deadline, answer, release (see the module docs).
pub async fn guard(State(budget): State<BodyBudget>, req: Request, next: Next) -> Response {
    use http_body::Body as _;
    let hint = req.body().size_hint();
    // Empty, or already read and reserved by an outer guard (the proxy nests the API).
    if hint.exact() == Some(0) || req.extensions().get::<BodyRead>().is_some() {
        return next.run(req).await;
    }
    let limits = budget.limits();
    let declared = hint.exact().map(|n| usize::try_from(n).unwrap_or(usize::MAX));
    if let Some(n) = declared
        && n > limits.max_body_bytes
    {
        if n <= DRAIN_OVERSIZED_MAX {
            let (_, body) = req.into_parts();
            let _ = tokio::time::timeout(limits.body_read_timeout, drain(body, n)).await;
        }
        return too_large(limits.max_body_bytes);
    }
    let reserve = declared.unwrap_or(limits.max_body_bytes).max(1);
    let permit = match tokio::time::timeout(
        limits.inflight_wait,
        budget.permits.clone().acquire_many_owned(u32::try_from(reserve).unwrap_or(u32::MAX)),
    )
    .await
    {
        Ok(Ok(p)) => p,
        _ => {
            // Read (and drop, frame by frame) what the client sends, so that it gets the
            // answer instead of a reset while it is still writing.
            let (_, body) = req.into_parts();
            let _ = tokio::time::timeout(limits.body_read_timeout, drain(body, limits.max_body_bytes)).await;
            let mut p = Problem::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "overloaded",
                format!(
                    "this node holds its limit of request bodies in flight ({} bytes: --max-inflight-body-bytes, at least one --max-body-bytes body) and none finished within {} ms; retry",
                    limits.max_inflight_body_bytes,
                    limits.inflight_wait.as_millis()
                ),
            );
            p.retry_after_ms = Some(1000);
            return p.into_response();
        }
    };
    budget.in_flight.fetch_add(reserve, Ordering::AcqRel);
    let release = Release { budget: &budget, bytes: reserve };
    let (parts, body) = req.into_parts();
    let started = tokio::time::Instant::now();
    let read = read_within(body, limits.max_body_bytes);
    let bytes = match tokio::time::timeout(limits.body_read_timeout, read).await {
        Ok(Ok(b)) => b,
        Ok(Err(BodyError::TooLarge(rest, seen))) => {
            // A chunked body found too large: the rest, up to the drain bound, is read and
            // dropped before the 413 (within what is left of the body deadline).
            let left = limits.body_read_timeout.saturating_sub(started.elapsed());
            let _ = tokio::time::timeout(left, drain(rest, DRAIN_OVERSIZED_MAX.saturating_sub(seen))).await;
            return too_large(limits.max_body_bytes);
        }
        Ok(Err(BodyError::Failed(e))) => {
            return Problem::invalid(format!("the request body could not be read: {e}")).into_response();
        }
        Err(_) => {
            let mut r = Problem::new(
                StatusCode::REQUEST_TIMEOUT,
                "request-timeout",
                format!(
                    "the request body did not arrive within {} ms (--body-read-timeout-ms)",
                    limits.body_read_timeout.as_millis()
                ),
            )
            .into_response();
            r.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("close"));
            return r;
        }
    };
    let mut req = Request::from_parts(parts, Body::from(bytes));
    req.extensions_mut().insert(BodyRead);
    let response = next.run(req).await;
    drop(permit);
    drop(release);
    response
}

/// Why [`read_within`] returned no body.
enum BodyError {
    /// Over the limit after this many bytes; the body's unread rest.
    TooLarge(Body, usize),
    /// The connection failed or the client broke the framing.
    Failed(axum::Error),
}

/// Reads `body` whole if it holds at most `limit` bytes (a body sent in one frame is kept
/// as that frame, uncopied); past `limit` it stops and hands back the rest, so the caller
/// can drain it before answering.
async fn read_within(mut body: Body, limit: usize) -> Result<axum::body::Bytes, BodyError> {
    use http_body_util::BodyExt as _;
    let mut first: Option<axum::body::Bytes> = None;
    let mut joined: Vec<u8> = Vec::new();
    let mut seen = 0usize;
    while let Some(frame) = body.frame().await {
        let Ok(data) = frame.map_err(BodyError::Failed)?.into_data() else { continue }; // trailers
        seen += data.len();
        if seen > limit {
            return Err(BodyError::TooLarge(body, seen));
        }
        match &first {
            None => first = Some(data),
            Some(f) => {
                if joined.is_empty() {
                    joined.extend_from_slice(f);
                }
                joined.extend_from_slice(&data);
            }
        }
    }
    Ok(if joined.is_empty() { first.unwrap_or_default() } else { joined.into() })
}

/// Reads and discards up to `limit` bytes of `body`, holding one frame at a time.
async fn drain(mut body: Body, limit: usize) {
    use http_body_util::BodyExt as _;
    let mut seen = 0usize;
    while let Some(Ok(frame)) = body.frame().await {
        seen += frame.data_ref().map_or(0, |d| d.len());
        if seen > limit {
            break;
        }
    }
}

/// Marks a request whose body a guard has read and reserved.
#[derive(Clone, Copy)]
struct BodyRead;

/// Gives a reservation's bytes back when the request is done (or cancelled).
struct Release<'a> {
    budget: &'a BodyBudget,
    bytes: usize,
}

impl Drop for Release<'_> {
    fn drop(&mut self) {
        self.budget.release(self.bytes);
    }
}

fn too_large(limit: usize) -> Response {
    Problem::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        "payload-too-large",
        format!("the request body is larger than {limit} bytes (--max-body-bytes)"),
    )
    .into_response()
}
