//! `/v1/operations`: acquire, renew, complete, get, list (DESIGN.md §3 and §10).
//!
//! Handlers validate input, ask the store, and translate the decision into the status
//! codes of DESIGN.md §3. They decide nothing about the protocol themselves.

use crate::AppState;
use crate::auth::Caller;
use crate::dto::{AcquireBody, CompleteBody, EventView, ListQuery, OperationPage, OperationView, RenewBody};
use crate::json::{ApiJson, ApiQuery};
use crate::problem::Problem;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use idem_core::decision::{DEFAULT_LEASE_MS, MAX_LEASE_MS, MIN_LEASE_MS};
use idem_core::{AcquireInput, CompleteError, Decision, IdempotencyKey, Outcome, RenewError, fingerprint};
use idem_store::{CompleteRequest, ListFilter, RenewRequest, StoreError};
use std::time::Duration;

/// Longest `wait_ms` a caller may ask for.
pub const MAX_WAIT_MS: i64 = 30_000;
/// How often a waiting trigger looks at the record again (ms).
const WAIT_POLL_MS: u64 = 25;

/// `Retry-After` of a 503 `unavailable` (the database did not answer): 1 s. A restarted
/// PostgreSQL is used again within about half a second (RFC 9110 §10.2.3).
pub const UNAVAILABLE_RETRY_AFTER_MS: i64 = 1000;

/// `Retry-After` of a 409 `contention` (the write lost too many races, or its row is
/// locked by another transaction and as many requests as may wait for row locks already
/// do): 1 s (RFC 9110 §10.2.3).
pub const CONTENTION_RETRY_AFTER_MS: i64 = 1000;

/// Maps a store error to its problem (503 `unavailable` with `Retry-After` when the
/// database did not answer, 409 `contention` with `Retry-After`).
pub fn store_problem(e: StoreError) -> Problem {
    if e.schema_missing() {
        tracing::error!(error = %e, "idem's tables are missing from the database");
        let mut p = Problem::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "schema-missing",
            "idem's tables are missing from the database (dropped or replaced under this node): nothing was recorded",
        );
        p.retry_after_ms = Some(UNAVAILABLE_RETRY_AFTER_MS);
        return p;
    }
    match e {
        StoreError::NotFound => Problem::not_found(),
        StoreError::Complete(c) => complete_problem(c),
        StoreError::Resolve(r) => resolve_problem(r),
        StoreError::Renew(r) => renew_problem(r),
        StoreError::Contention => {
            let mut p = Problem::new(StatusCode::CONFLICT, "contention", e.to_string());
            p.retry_after_ms = Some(CONTENTION_RETRY_AFTER_MS);
            p
        }
        StoreError::Invalid(msg) => Problem::invalid(msg),
        StoreError::NotStored(_) => {
            tracing::error!(error = %e, "write not stored");
            Problem::new(StatusCode::INTERNAL_SERVER_ERROR, "write-not-stored", e.to_string())
        }
        StoreError::Refused(_) | StoreError::Database(_) if e.refusal().is_some() => {
            // A constraint or a trigger said no: trying again gets the same answer. Its
            // message (table and constraint names, a trigger's text) stays in the server's
            // log: a client is never shown the database's own words.
            tracing::error!(error = %e, "write refused by the database");
            Problem::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "write-refused",
                "the database refused the write (an integrity constraint or a trigger on idem's tables); its message is in the server's log under this request id",
            )
        }
        StoreError::NotDurable(_) => not_durable(&e),
        StoreError::NoAnswer(_) => {
            tracing::error!(error = %e, "store unavailable");
            let mut p = Problem::new(StatusCode::SERVICE_UNAVAILABLE, "unavailable", e.to_string());
            p.retry_after_ms = Some(UNAVAILABLE_RETRY_AFTER_MS);
            p
        }
        StoreError::Database(_) | StoreError::Closed => {
            tracing::error!(error = %e, "store unavailable");
            let mut p = Problem::new(StatusCode::SERVICE_UNAVAILABLE, "unavailable", "the database did not answer");
            p.retry_after_ms = Some(UNAVAILABLE_RETRY_AFTER_MS);
            p
        }
        StoreError::SchemaMissing(_) => unreachable!("answered above"),
        StoreError::Corrupt(_) | StoreError::Migrate(_) | StoreError::Refused(_) => {
            tracing::error!(error = %e, "store error");
            Problem::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", "internal error")
        }
    }
}

/// `Retry-After` of a 503 `not-durable`: 5 s, about what a supervisor takes to restart the
/// node once `/healthz` fails (RFC 9110 §10.2.3).
pub const NOT_DURABLE_RETRY_AFTER_MS: i64 = 5000;

/// The 503 `not-durable` problem: the SQLite WAL could not be synced, so this node takes
/// nothing more until it is restarted (idem-store `StoreError::NotDurable`).
pub fn not_durable(e: &StoreError) -> Problem {
    tracing::error!(error = %e, "store cannot make writes durable");
    let mut p = Problem::new(StatusCode::SERVICE_UNAVAILABLE, "not-durable", e.to_string());
    p.retry_after_ms = Some(NOT_DURABLE_RETRY_AFTER_MS);
    p
}

fn complete_problem(e: CompleteError) -> Problem {
    let detail = e.to_string();
    match e {
        CompleteError::StaleToken { current, .. } => {
            let mut p = Problem::new(StatusCode::CONFLICT, "stale-fencing-token", detail);
            p.current_fencing_token = Some(current);
            p
        }
        CompleteError::AlreadyFinal { state } => {
            let mut p = Problem::new(StatusCode::CONFLICT, "operation-final", detail);
            p.state = Some(state.as_str().into());
            p
        }
        CompleteError::NotExecuting { state } => {
            let mut p = Problem::new(StatusCode::CONFLICT, "operation-not-executing", detail);
            p.state = Some(state.as_str().into());
            p
        }
        CompleteError::ConnectorOwned { .. } => Problem::new(StatusCode::CONFLICT, "connector-owned", detail),
        CompleteError::Invalid(_) => Problem::invalid(detail),
    }
}

fn renew_problem(e: RenewError) -> Problem {
    let detail = e.to_string();
    match e {
        RenewError::StaleToken { current, .. } => {
            let mut p = Problem::new(StatusCode::CONFLICT, "stale-fencing-token", detail);
            p.current_fencing_token = Some(current);
            p
        }
        RenewError::LeaseExpired { .. } => Problem::new(StatusCode::CONFLICT, "lease-expired", detail),
        RenewError::NotExecuting { state } => {
            let mut p = Problem::new(StatusCode::CONFLICT, "operation-not-executing", detail);
            p.state = Some(state.as_str().into());
            p
        }
        RenewError::ConnectorOwned { .. } => Problem::new(StatusCode::CONFLICT, "connector-owned", detail),
        RenewError::InvalidLease(_) => Problem::invalid(detail),
    }
}

fn resolve_problem(e: idem_core::ResolveError) -> Problem {
    let detail = e.to_string();
    match e {
        idem_core::ResolveError::NotResolvable { state } => {
            let mut p = Problem::new(StatusCode::CONFLICT, "not-resolvable", detail);
            p.state = Some(state.as_str().into());
            p
        }
        idem_core::ResolveError::StateChanged { actual, .. } => {
            let mut p = Problem::new(StatusCode::CONFLICT, "state-changed", detail);
            p.state = Some(actual.as_str().into());
            p
        }
        _ => Problem::invalid(detail),
    }
}

/// The idempotency key of a path or body, validated (`idem_core::key` rules) and recorded
/// on the request's log span (its hash; the key itself unless `--redact-keys`).
///
/// # Errors
/// 400 `invalid-idempotency-key`.
pub fn parse_key(raw: &str) -> Result<IdempotencyKey, Problem> {
    let key = IdempotencyKey::parse(raw)
        .map_err(|e| Problem::new(StatusCode::BAD_REQUEST, "invalid-idempotency-key", e.to_string()))?;
    crate::logging::record_key(key.as_str());
    Ok(key)
}

fn check_action(action: &str) -> Result<(), Problem> {
    let ok = !action.is_empty()
        && action.len() <= 128
        && action.bytes().all(|b| b.is_ascii_alphanumeric() || b"_.:-".contains(&b));
    if ok { Ok(()) } else { Err(Problem::invalid("action must be 1-128 characters of [A-Za-z0-9_.:-]")) }
}

pub(crate) fn in_range(name: &str, v: Option<i64>, min: i64, max: i64, default: i64) -> Result<i64, Problem> {
    match v {
        None => Ok(default),
        Some(x) if (min..=max).contains(&x) => Ok(x),
        Some(x) => Err(Problem::invalid(format!("{name} is {x}; it must be between {min} and {max}"))),
    }
}

/// An RFC 8941 sf-string (`"a\"b"`, the IETF draft's form of the header) or, leniently,
/// a bare token; only `\"` and `\\` are escapes (RFC 8941 §3.3.3).
pub(crate) fn sf_string(raw: &str) -> Result<String, String> {
    let raw = raw.trim();
    let Some(inner) = raw.strip_prefix('"') else {
        // A bare value (as many clients send) must not contain what only a quoted
        // string may: spaces, quotes, backslashes.
        if raw.contains([' ', '"', '\\']) {
            return Err(
                "an Idempotency-Key with spaces, quotes or backslashes must be an RFC 8941 quoted string".into()
            );
        }
        return Ok(raw.to_owned());
    };
    let mut out = String::with_capacity(inner.len());
    let mut chars = inner.chars();
    loop {
        match chars.next() {
            None => return Err("the Idempotency-Key header opens a quoted string it does not close".into()),
            Some('\\') => match chars.next() {
                Some(e @ ('"' | '\\')) => out.push(e),
                _ => {
                    return Err(
                        "the Idempotency-Key header has an invalid escape (only \\\" and \\\\ are allowed)".into()
                    );
                }
            },
            Some('"') => break,
            Some(c) => out.push(c),
        }
    }
    let rest = chars.as_str().trim();
    if rest.starts_with(';') {
        return Err(format!(
            "the Idempotency-Key header has parameters after its quoted string ({rest}); idem uses none: send the quoted string alone"
        ));
    }
    if !rest.is_empty() {
        return Err(format!(
            "the Idempotency-Key header has {rest:?} after its quoted string; send the quoted string alone"
        ));
    }
    Ok(out)
}

/// The key from the body or the `Idempotency-Key` header (IETF httpapi draft §2); both
/// present and different, or the header twice, is an error.
fn key_of(body: Option<&str>, headers: &HeaderMap) -> Result<IdempotencyKey, Problem> {
    let bad = |detail: &str| Problem::new(StatusCode::BAD_REQUEST, "invalid-idempotency-key", detail);
    let mut values = headers.get_all("idempotency-key").iter();
    let header = match (values.next(), values.next()) {
        (None, _) => None,
        (Some(_), Some(_)) => return Err(bad("more than one Idempotency-Key header")),
        (Some(v), None) => Some(
            sf_string(v.to_str().map_err(|_| bad("the Idempotency-Key header is not ASCII"))?).map_err(|e| bad(&e))?,
        ),
    };
    let header = header.as_deref();
    match (body, header) {
        (Some(b), Some(h)) if b != h => Err(Problem::invalid("the body's key and the Idempotency-Key header differ")),
        (Some(k), _) | (None, Some(k)) => parse_key(k),
        (None, None) => Err(Problem::new(
            StatusCode::BAD_REQUEST,
            "missing-idempotency-key",
            "no idempotency key: send \"key\" in the body or an Idempotency-Key header",
        )),
    }
}

pub(crate) fn with_rid(p: Problem, caller: &Caller) -> Problem {
    p.with_request_id(caller.request_id.as_deref())
}

/// Trigger an operation: acquire its lease, or learn what it already is.
#[utoipa::path(
    post, path = "/v1/operations", tag = "operations",
    request_body = AcquireBody,
    params(
        ("Idempotency-Key" = Option<String>, Header, description = "The key, if not in the body"),
        ("X-Request-Id" = Option<String>, Header, description = "The request's id (1-128 characters of `[A-Za-z0-9._:-]`; others are replaced by a generated one), recorded on the trigger's event and in the logs. Never a lease holder: name the attempt in the body's `holder`"),
    ),
    responses(
        (status = 201, description = "Lease granted to this caller: perform the side effect, then complete with the fencing token. Only ever for an operation the caller performs (never when a connector performs it). Also the answer to the lease's own attempt (same principal and `holder`) while its lease is valid: the same grant, unchanged (same fencing token, `lease_expires_at` and attempt), for a request resent after its reply was lost", body = OperationView),
        (status = 200, description = "Final (SUCCEEDED or FAILED): do not perform the side effect; the outcome is in the body. Either a replay of a finished operation (header `Idempotent-Replayed: true`) or the outcome of the attempt a connector of idem's just made during this request (header `Idem-Performed-By: connector`)", body = OperationView),
        (status = 202, description = "Not final, and not this caller's to perform: do not perform the side effect. UNKNOWN — a worker's lease ended while it may have acted, or a call's outcome was lost — until the reconciler's lookup or an operator settles it (`needs_review`, `last_error` say which); or, for an operation a connector performs, idem's attempt still running or its retry scheduled (header `Location` to poll)", body = OperationView),
        (status = 400, description = "Malformed request, missing or invalid key, a payload with duplicate member names (also after NFC) or a number an IEEE 754 double does not carry exactly, or a `holder` that does not identify one attempt (`invalid-holder`)", body = Problem, content_type = "application/problem+json"),
        (status = 401, description = "Missing or invalid API key", body = Problem, content_type = "application/problem+json"),
        (status = 403, description = "The connector (named, or the action's default) does not serve the caller's tenant (`connector-not-allowed`); nothing was recorded", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "In progress (another worker's lease), or the next attempt is not due; header `Retry-After`", body = Problem, content_type = "application/problem+json"),
        (status = 410, description = "Late arrival: the key's operation completed and its record was removed after its retention window (default 24 h after completion); a tombstone remembers it (default 30 days after completion) and nothing executes. After the tombstone is gone the key is new again.", body = Problem, content_type = "application/problem+json"),
        (status = 413, description = "Body too large", body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "The key was used with another payload or action", body = Problem, content_type = "application/problem+json"),
    ),
    security(("bearer" = []))
)]
pub async fn acquire(
    State(state): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    ApiJson(mut body): ApiJson<AcquireBody>,
) -> Result<Response, Problem> {
    let payload = body.payload.take().map_or(serde_json::Value::Null, |p| p.0);
    let now_ms = state.clock.now_ms();
    let input =
        acquire_input(&caller, &headers, body.key.as_deref(), &body, payload, state.executor.registry(), now_ms)
            .map_err(|p| with_rid(p, &caller))?;
    let wait_ms = in_range("wait_ms", body.wait_ms, 0, MAX_WAIT_MS, 0).map_err(|p| with_rid(p, &caller))?;
    let deadline = tokio::time::Instant::now() + Duration::from_millis(wait_ms as u64);
    if let Some(p) = retry_budget_refusal(&state, &input).await {
        return Ok(with_rid(p, &caller).into_response());
    }
    if wait_ms > 0 {
        // Wait before triggering, so a waiting trigger is logged once (with its outcome).
        wait_for_change(&state, &input, deadline).await;
    }
    loop {
        let out = state.store.acquire(input.clone()).await.map_err(|e| with_rid(store_problem(e), &caller))?;
        let waits_again = matches!(out.decision, Decision::InProgress { .. }) && tokio::time::Instant::now() < deadline;
        if !waits_again {
            state.answered_trigger(&out.decision, &caller.tenant, &input.key, caller.request_id.as_deref());
        }
        return Ok(match out.decision {
            Decision::Acquire if out.record.connector.is_some() => {
                run_connector_attempt(&state, out.record.clone(), deadline, &caller).await?
            }
            Decision::InProgress { .. } if tokio::time::Instant::now() < deadline => {
                wait_for_change(&state, &input, deadline).await;
                continue;
            }
            Decision::Mismatch => with_rid(
                Problem::new(
                    StatusCode::UNPROCESSABLE_ENTITY,
                    "fingerprint-mismatch",
                    mismatch_detail(&out.record, &input, body.fingerprint_fields.as_deref()),
                ),
                &caller,
            )
            .into_response(),
            _ => trigger_answer(out, &caller),
        });
    }
}

/// What differs between a refused trigger (`input`, which named `fields` as its
/// `fingerprint_fields`) and the record its key is bound to, in words for the 422: the
/// action, the connector, or the fingerprint — and then whether the payload itself is the
/// same (so the `fingerprint_fields` differ) or not.
fn mismatch_detail(rec: &idem_core::OperationRecord, input: &AcquireInput, fields: Option<&[String]>) -> String {
    let ours = match fields {
        Some(f) => format!("only its fingerprint_fields {f:?}"),
        None => "the whole payload (it sent no fingerprint_fields)".to_owned(),
    };
    if rec.action != input.action {
        format!(
            "this key was first used with action {:?}, this request has {:?}; a new intent needs a new key",
            rec.action, input.action
        )
    } else if rec.connector != input.connector {
        format!(
            "this key was first used with connector {:?}, this request has {:?}; a new intent needs a new key",
            rec.connector, input.connector
        )
    } else if rec.payload == input.payload {
        format!(
            "the payload is the one this key was first used with, but the fingerprints differ: this request fingerprinted {ours}, the first one other fields; send the same fingerprint_fields as the first request"
        )
    } else {
        format!(
            "this key was first used with another payload: this request's fingerprint covers {ours}, and it differs from the first one's; a new intent needs a new key (if only fields outside the intent changed, every request for the key must send the same fingerprint_fields naming the intent's fields)"
        )
    }
}

/// The answer to a trigger (DESIGN.md §3) once it is decided: 201 grant (or the same grant
/// again for the lease's own holder), 200 replay (`Idempotent-Replayed: true`), 202
/// UNKNOWN, 409 in progress / retry not due (`Retry-After`), 410 late, 422 mismatch.
pub(crate) fn trigger_answer(out: idem_store::AcquireOutcome, caller: &Caller) -> Response {
    // The record moves into the one view an answer makes (a clone cost ~4 700
    // instructions a request, scripts/callgrind.sh).
    let record = out.record;
    let (state, completed_at) = (record.state, record.completed_at);
    let view = move || OperationView::of(record);
    match out.decision {
        Decision::Acquire | Decision::AlreadyHeld => (StatusCode::CREATED, axum::Json(view())).into_response(),
        Decision::Replay => {
            let mut r = (StatusCode::OK, axum::Json(view())).into_response();
            r.headers_mut().insert("idempotent-replayed", HeaderValue::from_static("true"));
            r
        }
        Decision::Unknown | Decision::ExpireToUnknown => (StatusCode::ACCEPTED, axum::Json(view())).into_response(),
        Decision::InProgress { retry_after_ms } => {
            let mut p = Problem::new(
                StatusCode::CONFLICT,
                "operation-in-progress",
                "another worker holds the lease for this key",
            );
            p.retry_after_ms = Some(retry_after_ms);
            p.state = Some("EXECUTING".into());
            with_rid(p, caller).into_response()
        }
        Decision::RetryNotDue { retry_after_ms } => {
            let mut p = Problem::new(
                StatusCode::CONFLICT,
                "retry-not-due",
                format!("the next attempt is due in {retry_after_ms} ms"),
            );
            p.retry_after_ms = Some(retry_after_ms);
            p.state = Some("PENDING".into());
            with_rid(p, caller).into_response()
        }
        Decision::Late => {
            let p = late_arrival(state, completed_at, "nothing was executed");
            with_rid(p, caller).into_response()
        }
        Decision::Mismatch => with_rid(
            Problem::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "fingerprint-mismatch",
                "this key was first used with another payload, action or connector; a new intent needs a new key",
            ),
            caller,
        )
        .into_response(),
    }
}

/// A caller's re-trigger of a connector operation whose retry is due would make idem call
/// the provider again: it draws on the connector's retry budget like the executor's own
/// retries, so callers looping on a failing provider cannot turn an outage into a storm.
/// `Some(409)` when the budget is empty.
async fn retry_budget_refusal(state: &AppState, input: &AcquireInput) -> Option<Problem> {
    let entry = state.executor.registry().get(input.connector.as_deref()?)?;
    let rec = state.store.get(&input.tenant, &input.key).await.ok()??;
    let is_due_retry = rec.state == idem_core::State::Pending
        && rec.fingerprint == input.fingerprint
        && rec.next_attempt_at.is_none_or(|t| t <= state.clock.now_ms());
    if !is_due_retry || entry.budget.try_take() {
        return None;
    }
    let mut p = Problem::new(
        StatusCode::CONFLICT,
        "retry-not-due",
        "the connector's retry budget is spent (an outage?); idem retries on its own when the budget allows",
    );
    p.retry_after_ms = Some(1_000);
    p.state = Some("PENDING".into());
    Some(p)
}

/// Polls the record while another worker's lease is valid, until `deadline` (reads only;
/// the trigger after the wait is recorded as usual). The trigger's own lease (its holder)
/// is not waited for.
async fn wait_for_change(state: &AppState, input: &AcquireInput, deadline: tokio::time::Instant) {
    loop {
        let now = tokio::time::Instant::now();
        if now >= deadline {
            return;
        }
        match state.store.get(&input.tenant, &input.key).await {
            Ok(Some(r))
                if r.fingerprint == input.fingerprint
                    && r.lease_valid_at(state.clock.now_ms())
                    && !idem_core::lease::held_by(&r, input.holder_id(), state.clock.now_ms()) => {}
            _ => return,
        }
        tokio::time::sleep(Duration::from_millis(WAIT_POLL_MS).min(deadline - now)).await;
    }
}

/// The header that marks a `200` whose outcome a connector of idem's produced during the
/// request (beside `Idempotent-Replayed: true`, which marks a replay).
pub const PERFORMED_BY_HEADER: &str = "idem-performed-by";

/// Runs the attempt idem was just granted for a connector-backed operation, in its own
/// task so it finishes even if the caller goes away, and waits for it until `deadline`.
/// Finished (SUCCEEDED or FAILED) in time ⇒ 200 with the result and
/// `Idem-Performed-By: connector`; otherwise (still running, retry scheduled, or UNKNOWN)
/// ⇒ 202 with `Location` to poll. Never 201: that means "you hold the lease, perform the
/// effect" (DESIGN.md §3 "One answer, one meaning"), and idem performed it.
async fn run_connector_attempt(
    state: &AppState,
    granted: idem_core::OperationRecord,
    deadline: tokio::time::Instant,
    caller: &Caller,
) -> Result<Response, Problem> {
    let location = format!("/v1/operations/{}", path_segment(&granted.key));
    let task = state.executor.spawn_attempt(granted.clone());
    let record = match tokio::time::timeout_at(deadline, task).await {
        Ok(Ok(Ok(rec))) => rec,
        Ok(Ok(Err(e))) => return Err(with_rid(store_problem(e), caller)),
        Ok(Err(join)) => {
            tracing::error!(error = %join, "attempt task failed");
            granted
        }
        Err(_) => granted,
    };
    let status = if record.state.is_final() { StatusCode::OK } else { StatusCode::ACCEPTED };
    let mut resp = (status, axum::Json(OperationView::of(record))).into_response();
    if status == StatusCode::OK {
        resp.headers_mut().insert(PERFORMED_BY_HEADER, HeaderValue::from_static("connector"));
    } else if let Ok(v) = HeaderValue::from_str(&location) {
        resp.headers_mut().insert(axum::http::header::LOCATION, v);
    }
    Ok(resp)
}

/// Percent-encodes a key for a URL path segment (RFC 3986 unreserved characters stay).
fn path_segment(key: &str) -> String {
    key.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-_.~:".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

fn acquire_input(
    caller: &Caller,
    headers: &HeaderMap,
    key: Option<&str>,
    body: &AcquireBody,
    payload: serde_json::Value,
    registry: &idem_connect::Registry,
    now_ms: i64,
) -> Result<AcquireInput, Problem> {
    let key = key_of(key, headers)?;
    check_action(&body.action)?;

    let connector = match body.connector.as_deref().or_else(|| registry.for_action(&body.action)) {
        None => None,
        Some(name) => match registry.get(name).filter(|e| e.executes) {
            Some(e) if e.allows(&caller.tenant) => Some(name.to_owned()),
            Some(e) => return Err(connector_not_allowed(name, &body, &caller.tenant, &e.tenants)),
            None => {
                return Err(Problem::invalid(format!(
                    "unknown connector {name:?}: it is not configured on this server"
                )));
            }
        },
    };
    // A connector's attempt gets at least the connector's lease (longer than its
    // timeouts): a shorter one could expire under a live call and invite a second one.
    let connector_lease = connector.as_deref().and_then(|c| registry.get(c)).map(|e| e.connector.lease_ms());
    let asked = in_range("lease_ms", body.lease_ms, MIN_LEASE_MS, MAX_LEASE_MS, DEFAULT_LEASE_MS)?;
    let lease_ms = match connector_lease {
        Some(min) => body.lease_ms.map_or(min, |_| asked.max(min)),
        None => asked,
    };
    let fp = fingerprint(&payload, body.fingerprint_fields.as_deref()).map_err(|e| Problem::invalid(e.to_string()))?;
    Ok(AcquireInput {
        holder: holder_of(caller, body.holder.as_deref(), key.as_str(), now_ms)?,
        tenant: caller.tenant.clone(),
        key: key.to_string(),
        action: body.action.clone(),
        payload,
        fingerprint: fp.0,
        lease_ms,
        redo_safe: body.redo_safe.unwrap_or(false),
        connector,
        actor: caller.actor(),
    })
}

/// 403 `connector-not-allowed`: the caller's tenant is not among the connector's
/// `tenants` (issue 28 §4: a client key of another tenant sent mail through the default
/// tenant's SMTP account). Nothing was recorded. Says whether the connector came from
/// the request or from the action's default.
fn connector_not_allowed(
    name: &str,
    body: &AcquireBody,
    tenant: &str,
    allowed: &idem_connect::tenants::TenantScope,
) -> Problem {
    let how = if body.connector.is_some() {
        format!("this request names connector {name:?}")
    } else {
        format!("action {:?} runs on connector {name:?} by default", body.action)
    };
    Problem::new(
        StatusCode::FORBIDDEN,
        "connector-not-allowed",
        format!(
            "{how}, which does not serve tenant {tenant:?} (it serves {}; connectors.{name}.tenants in the server's configuration); nothing was recorded",
            allowed.describe()
        ),
    )
}

/// The trigger's lease holder identity: the body's `holder`, checked by
/// [`idem_core::holder::validate_holder`] against the operation's `key` at the ledger's
/// `now_ms`; `None` when the body names none. A request id never serves as a holder
/// (gateways and frameworks propagate one along a chain of calls, DESIGN.md §3
/// "Holders"), and a holder that *is* this request's own `X-Request-Id` is refused for
/// the same reason.
///
/// # Errors
/// 400 `invalid-holder`, saying what to send instead.
pub(crate) fn holder_of(
    caller: &Caller,
    holder: Option<&str>,
    key: &str,
    now_ms: i64,
) -> Result<Option<String>, Problem> {
    let Some(h) = holder else { return Ok(None) };
    let invalid = |detail: String| Problem::new(StatusCode::BAD_REQUEST, "invalid-holder", detail);
    idem_core::holder::validate_holder(h, key, now_ms).map_err(|e| invalid(e.to_string()))?;
    if caller.request_id_from_client && caller.request_id.as_deref().is_some_and(|rid| rid.eq_ignore_ascii_case(h)) {
        return Err(invalid(
            "holder is this request's X-Request-Id; request ids are propagated along a chain of calls, so another attempt could present the same one: generate a new UUID (version 4 or 7) for each attempt as its holder".into(),
        ));
    }
    Ok(Some(h.to_ascii_lowercase()))
}

pub(crate) fn outcome_of(b: CompleteBody) -> Result<Outcome, Problem> {
    if b.message.as_ref().is_some_and(|m| m.len() > idem_core::completion::MAX_MESSAGE_LEN) {
        return Err(Problem::invalid(format!(
            "message is longer than {} bytes",
            idem_core::completion::MAX_MESSAGE_LEN
        )));
    }
    let extra = |name: &str, present: bool| {
        if present { Err(Problem::invalid(format!("{name} does not apply to outcome {}", b.outcome))) } else { Ok(()) }
    };
    let need = |name: &str, v: Option<String>| {
        v.ok_or_else(|| Problem::invalid(format!("outcome {} needs {name}", b.outcome)))
    };
    match b.outcome.as_str() {
        "succeeded" => {
            extra("error_class", b.error_class.is_some())?;
            extra("retry_after_ms", b.retry_after_ms.is_some())?;
            extra("message", b.message.is_some())?;
            Ok(Outcome::Succeeded {
                provider_ref: need("provider_ref (the evidence)", b.provider_ref.clone())?,
                result: b.result.map(|r| r.0),
            })
        }
        "retryable_failure" => {
            extra("provider_ref", b.provider_ref.is_some())?;
            extra("result", b.result.is_some())?;
            Ok(Outcome::RetryableFailure {
                error_class: need("error_class", b.error_class.clone())?,
                message: b.message,
                retry_after_ms: b.retry_after_ms,
            })
        }
        "final_failure" => {
            extra("provider_ref", b.provider_ref.is_some())?;
            extra("retry_after_ms", b.retry_after_ms.is_some())?;
            Ok(Outcome::FinalFailure {
                error_class: need("error_class", b.error_class.clone())?,
                message: b.message,
                result: b.result.map(|r| r.0),
            })
        }
        "unknown" => {
            extra("provider_ref", b.provider_ref.is_some())?;
            extra("result", b.result.is_some())?;
            extra("error_class", b.error_class.is_some())?;
            extra("retry_after_ms", b.retry_after_ms.is_some())?;
            Ok(Outcome::Unknown { message: b.message })
        }
        other => Err(Problem::invalid(format!(
            "unknown outcome {other:?}: expected succeeded, retryable_failure, final_failure or unknown"
        ))),
    }
}

/// Report the outcome of the attempt that holds `fencing_token`.
#[utoipa::path(
    post, path = "/v1/operations/{key}/complete", tag = "operations",
    params(("key" = String, Path, description = "Idempotency key (percent-encoded)")),
    request_body = CompleteBody,
    responses(
        (status = 200, description = "The updated record (or the unchanged one, for an identical repeat)", body = OperationView),
        (status = 400, description = "Malformed request or outcome, or a `result` with duplicate member names or a number an IEEE 754 double does not carry exactly", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "No such operation in the caller's tenant", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "Stale fencing token, already final, or not executing; nothing changed", body = Problem, content_type = "application/problem+json"),
        (status = 410, description = "Late: the operation completed and its record was removed after its retention window (a tombstone remains); nothing recorded", body = Problem, content_type = "application/problem+json"),
        (status = 401, description = "Missing or invalid API key", body = Problem, content_type = "application/problem+json"),
    ),
    security(("bearer" = []))
)]
pub async fn complete(
    State(state): State<AppState>,
    caller: Caller,
    crate::json::ApiPath(raw_key): crate::json::ApiPath,
    ApiJson(body): ApiJson<CompleteBody>,
) -> Result<Response, Problem> {
    let key = parse_key(&raw_key).map_err(|p| with_rid(p, &caller))?;
    let fencing_token = body.fencing_token;
    let outcome = outcome_of(body).map_err(|p| with_rid(p, &caller))?;
    let done = state
        .store
        .complete(CompleteRequest {
            tenant: caller.tenant.clone(),
            key: key.to_string(),
            fencing_token,
            outcome,
            actor: caller.actor(),
            policy: None,
        })
        .await;
    if let Ok(out) = &done
        && out.changed
    {
        state.flows.operation_settled(&out.record.tenant, &out.record.key).await;
    }
    record_or_problem(&state, &caller, key.as_str(), "this completion was not recorded", done.map(|o| o.record)).await
}

/// 200 with the record a worker's call (completion, renewal) left, or its problem: for a
/// key without a record, 410 `late-arrival` when it was removed after its retention (a
/// tombstone is left; `consequence` says what happened to this request), else 404.
async fn record_or_problem(
    state: &AppState,
    caller: &Caller,
    key: &str,
    consequence: &str,
    rec: Result<idem_core::OperationRecord, StoreError>,
) -> Result<Response, Problem> {
    let p = match rec {
        Ok(rec) => return Ok(axum::Json(OperationView::of(rec)).into_response()),
        Err(StoreError::NotFound) => match state.store.tombstone(&caller.tenant, key).await {
            Ok(Some(t)) => late_arrival(t.final_state, Some(t.completed_at), consequence),
            Ok(None) => Problem::not_found(),
            Err(e) => store_problem(e),
        },
        Err(e) => store_problem(e),
    };
    Err(with_rid(p, caller))
}

/// Renew the lease of `fencing_token` (a heartbeat): it then ends `lease_ms` from now.
#[utoipa::path(
    post, path = "/v1/operations/{key}/renew", tag = "operations",
    params(("key" = String, Path, description = "Idempotency key (percent-encoded)")),
    request_body = RenewBody,
    responses(
        (status = 200, description = "Renewed: the record with the new `lease_expires_at` (same fencing token and attempt)", body = OperationView),
        (status = 400, description = "Malformed request, or `lease_ms` out of range", body = Problem, content_type = "application/problem+json"),
        (status = 401, description = "Missing or invalid API key", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "No such operation in the caller's tenant", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "Not renewed, nothing changed: `lease-expired` (the lease already ran out: complete with the token to report what happened), `stale-fencing-token` (another lease was granted), `operation-not-executing` (PENDING, SUCCEEDED or FAILED), `connector-owned`", body = Problem, content_type = "application/problem+json"),
        (status = 410, description = "Late: the operation completed and its record was removed after its retention window; nothing recorded", body = Problem, content_type = "application/problem+json"),
    ),
    security(("bearer" = []))
)]
pub async fn renew(
    State(state): State<AppState>,
    caller: Caller,
    crate::json::ApiPath(raw_key): crate::json::ApiPath,
    ApiJson(body): ApiJson<RenewBody>,
) -> Result<Response, Problem> {
    let key = parse_key(&raw_key).map_err(|p| with_rid(p, &caller))?;
    let lease_ms = in_range("lease_ms", body.lease_ms, MIN_LEASE_MS, MAX_LEASE_MS, DEFAULT_LEASE_MS)
        .map_err(|p| with_rid(p, &caller))?;
    let renewed = state
        .store
        .renew(RenewRequest {
            tenant: caller.tenant.clone(),
            key: key.to_string(),
            fencing_token: body.fencing_token,
            lease_ms,
            actor: caller.actor(),
        })
        .await;
    record_or_problem(&state, &caller, key.as_str(), "there is no lease to renew", renewed).await
}

/// One operation with its event timeline.
#[utoipa::path(
    get, path = "/v1/operations/{key}", tag = "operations",
    params(("key" = String, Path, description = "Idempotency key (percent-encoded)")),
    responses(
        (status = 200, description = "The record with `events`", body = OperationView),
        (status = 404, description = "No such operation in the caller's tenant", body = Problem, content_type = "application/problem+json"),
        (status = 401, description = "Missing or invalid API key", body = Problem, content_type = "application/problem+json"),
    ),
    security(("bearer" = []))
)]
pub async fn get_one(
    State(state): State<AppState>,
    caller: Caller,
    crate::json::ApiPath(raw_key): crate::json::ApiPath,
) -> Result<Response, Problem> {
    let key = parse_key(&raw_key).map_err(|p| with_rid(p, &caller))?;
    let rec = state.store.get(&caller.tenant, key.as_str()).await.map_err(|e| with_rid(store_problem(e), &caller))?;
    let Some(rec) = rec else {
        return Err(with_rid(Problem::not_found(), &caller));
    };
    let events =
        state.store.events(&caller.tenant, key.as_str()).await.map_err(|e| with_rid(store_problem(e), &caller))?;
    let mut view = OperationView::of(rec);
    view.events = Some(events.into_iter().map(EventView::of).collect());
    Ok(axum::Json(view).into_response())
}

/// Operations of the caller's tenant, newest first, filtered and paginated.
#[utoipa::path(
    get, path = "/v1/operations", tag = "operations",
    params(ListQuery),
    responses(
        (status = 200, description = "One page", body = OperationPage),
        (status = 400, description = "Invalid filter", body = Problem, content_type = "application/problem+json"),
        (status = 401, description = "Missing or invalid API key", body = Problem, content_type = "application/problem+json"),
    ),
    security(("bearer" = []))
)]
pub async fn list(
    State(state): State<AppState>,
    caller: Caller,
    ApiQuery(q): ApiQuery<ListQuery>,
) -> Result<Response, Problem> {
    let filter = list_filter(q).map_err(|p| with_rid(p, &caller))?;
    let page = state.store.list(&caller.tenant, &filter).await.map_err(|e| with_rid(store_problem(e), &caller))?;
    Ok(axum::Json(OperationPage {
        items: page.items.into_iter().map(OperationView::of).collect(),
        next_cursor: page.next_cursor.map(|(at, key)| encode_cursor(at, &key)),
    })
    .into_response())
}

/// 410 `late-arrival`: the key's operation ended in `final_state` at `completed_at` (epoch
/// ms) and only its tombstone is left; `consequence` says what happened to this request.
pub(crate) fn late_arrival(final_state: idem_core::State, completed_at: Option<i64>, consequence: &str) -> Problem {
    let done = completed_at.map(crate::dto::rfc3339).unwrap_or_default();
    let mut p = Problem::new(
        StatusCode::GONE,
        "late-arrival",
        format!(
            "this key's operation completed ({final_state}) at {done} and its record outlived its retention window; {consequence}"
        ),
    );
    p.state = Some(final_state.as_str().into());
    p
}

/// An opaque page cursor: hex of `created_at:key` of the page's last record.
pub(crate) fn encode_cursor(at: i64, key: &str) -> String {
    idem_core::fingerprint::hex(format!("{at}:{key}").as_bytes())
}

pub(crate) fn decode_cursor(c: &str) -> Result<(i64, String), Problem> {
    let bad = || Problem::invalid("cursor is not one this server issued");
    if !c.len().is_multiple_of(2) || c.len() > 1024 {
        return Err(bad());
    }
    let bytes: Vec<u8> = (0..c.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(c.get(i..i + 2).ok_or_else(bad)?, 16).map_err(|_| bad()))
        .collect::<Result<_, _>>()?;
    let text = String::from_utf8(bytes).map_err(|_| bad())?;
    let (at, key) = text.split_once(':').ok_or_else(bad)?;
    Ok((at.parse().map_err(|_| bad())?, key.to_owned()))
}

fn list_filter(q: ListQuery) -> Result<ListFilter, Problem> {
    let state = q
        .state
        .as_deref()
        .map(str::parse::<idem_core::State>)
        .transpose()
        .map_err(|e| Problem::invalid(e.to_string()))?;
    let cursor = q.cursor.as_deref().map(decode_cursor).transpose()?;
    if q.key_prefix.as_ref().is_some_and(|p| p.len() > idem_core::key::MAX_KEY_LEN) {
        return Err(Problem::invalid("key_prefix is longer than a key can be"));
    }
    let filter = ListFilter {
        state,
        action: q.action,
        needs_review: q.needs_review,
        key_prefix: q.key_prefix,
        created_from: q.created_after.as_deref().map(|t| parse_instant("created_after", t)).transpose()?,
        created_before: q.created_before.as_deref().map(|t| parse_instant("created_before", t)).transpose()?,
        limit: in_range("limit", q.limit, 1, idem_store::MAX_PAGE, 50)?,
        cursor,
    };
    check_filter_text(&filter).map_err(Problem::invalid)?;
    Ok(filter)
}

/// Refuses a list filter whose text holds U+0000 (NUL). No key or action can hold it, and
/// PostgreSQL text cannot: such a filter matches nothing, said as a 400 (API) or an error
/// on the page (admin page) rather than a database error.
///
/// # Errors
/// A one-line message.
pub(crate) fn check_filter_text(f: &ListFilter) -> Result<(), &'static str> {
    let nul = |v: Option<&str>| v.is_some_and(|t| t.contains('\0'));
    if nul(f.action.as_deref()) || nul(f.key_prefix.as_deref()) || nul(f.cursor.as_ref().map(|(_, k)| k.as_str())) {
        return Err("filters must not contain U+0000 (NUL)");
    }
    Ok(())
}

/// Epoch ms of an RFC 3339 instant (`2026-11-30T12:00:00Z`).
///
/// # Errors
/// A 400 problem naming `field`.
pub fn parse_instant(field: &str, text: &str) -> Result<i64, Problem> {
    text.parse::<jiff::Timestamp>()
        .map(|t| t.as_millisecond())
        .map_err(|_| Problem::invalid(format!("{field} must be an RFC 3339 instant like 2026-11-30T12:00:00Z")))
}

#[cfg(test)]
mod sf_string_tests {
    use super::sf_string;

    #[test]
    fn quoted_strings_bare_tokens_and_what_is_refused_say_why() {
        assert_eq!(sf_string(r#""a\"b\\c""#).unwrap(), r#"a"b\c"#);
        assert_eq!(sf_string("ORD-1:confirmation").unwrap(), "ORD-1:confirmation");
        assert_eq!(sf_string(r#"  "k"  "#).unwrap(), "k");
        for (raw, says) in [
            (r#""k";a=1"#, "parameters"),
            (r#""k" ;a=1"#, "parameters"),
            (r#""a"b""#, "after its quoted string"),
            (r#""open"#, "does not close"),
            (r#""a\nb""#, "invalid escape"),
            ("a b", "quoted string"),
        ] {
            let e = sf_string(raw).unwrap_err();
            assert!(e.contains(says), "{raw}: {e}");
        }
    }
}

#[cfg(test)]
mod store_problem_tests {
    use super::*;

    /// A write the database skipped is a 500 naming it, not a "retry" 503.
    #[test]
    fn a_write_not_stored_is_a_500_without_retry_after() {
        let p = store_problem(StoreError::NotStored("an operation record: 0 of 1 rows written".into()));
        assert_eq!(p.status, 500);
        assert!(p.kind.ends_with("/write-not-stored"), "{}", p.kind);
        assert!(p.detail.contains("0 of 1 rows") && p.retry_after_ms.is_none(), "{p:?}");
        let p = store_problem(StoreError::Closed);
        assert_eq!(p.status, 503);
        assert!(p.retry_after_ms.is_some());
    }
}
