//! Errors over HTTP: RFC 9457 problem details (`application/problem+json`).
//!
//! Every error response carries a stable `type`, a relative URI `/problems/<slug>` that
//! the server itself resolves to a short description (RFC 9457 §3.1.1 allows relative
//! references). Clients should branch on `type`, never on `detail`.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use utoipa::ToSchema;

/// The problem types idem answers with: (slug, title, description).
pub const PROBLEM_TYPES: &[(&str, &str, &str)] = &[
    (
        "unauthorized",
        "Missing or invalid API key",
        "Every /v1 call needs `Authorization: Bearer <api key>`; the key was missing, malformed, unknown or revoked.",
    ),
    (
        "forbidden",
        "The API key's role does not allow this",
        "The key is valid but its role (client, operator, admin) is too low for this call.",
    ),
    (
        "invalid-request",
        "The request is malformed",
        "The body is not valid JSON, has unknown or duplicate fields (member names equal after Unicode NFC are duplicates), a field has the wrong type or is out of range, a number in a payload or result is not exactly an IEEE 754 double or is beyond ±2^53 (send it as a string), or a query parameter is invalid. Nothing was recorded.",
    ),
    (
        "missing-idempotency-key",
        "The idempotency key is missing",
        "POST /v1/operations needs a `key` (or an `Idempotency-Key` header). IETF httpapi Idempotency-Key draft §2.7: 400.",
    ),
    (
        "invalid-idempotency-key",
        "The idempotency key is not acceptable",
        "Keys are 1-255 printable ASCII characters, without surrounding spaces, and must not contain personal data such as e-mail addresses or phone numbers.",
    ),
    (
        "payload-too-large",
        "The request body is too large",
        "The body exceeds the server's limit (`--max-body-bytes`, default 1 MiB). Nothing was recorded.",
    ),
    (
        "request-timeout",
        "The request body did not arrive in time",
        "The client did not send the whole body within the server's limit (`--body-read-timeout-ms`, default 30 s); the connection is closed. Nothing was recorded. RFC 9110 §15.5.9.",
    ),
    (
        "overloaded",
        "Too many request bodies in flight",
        "This node already holds its limit of request body bytes being read and processed (`--max-inflight-body-bytes`, default 8 MiB) and none finished within `--inflight-wait-ms`; it refuses rather than run out of memory. Nothing was recorded; retry after `Retry-After` seconds, or send it to another node.",
    ),
    (
        "unsupported-media-type",
        "The body must be uncompressed JSON",
        "Send `Content-Type: application/json` and no `Content-Encoding` (or `identity`).",
    ),
    (
        "not-found",
        "Not found",
        "No operation with this key exists for the caller's tenant (or no such route, API key or problem type).",
    ),
    ("method-not-allowed", "Method not allowed", "The route exists, but not for this HTTP method; see /openapi.json."),
    (
        "operation-in-progress",
        "The operation is in progress",
        "Another worker holds the lease (another principal, another holder identity, or a trigger that names none). Retry after `Retry-After` seconds, or pass `wait_ms`. The lease's own attempt (same principal and `holder`, a UUID made for that attempt) gets its grant back instead. IETF httpapi Idempotency-Key draft §2.7: 409.",
    ),
    (
        "invalid-holder",
        "The holder does not identify one attempt",
        "A lease's holder gets the grant back while the lease is valid, so whoever presents it acts: it must be a UUID generated for one attempt (version 4 or 7; 1 and 6 too) and sent again only to resend that attempt's request. Refused: anything but a UUID (a worker name, an event id), a name-based (version 3, 5), Nil or Max UUID, a time-based one made over an hour ago, one that is part of the idempotency key, one equal to the request's X-Request-Id. Generate a new one per attempt, or send none. Nothing was recorded. DESIGN.md §3 \"Holders\".",
    ),
    (
        "connector-not-allowed",
        "The connector does not serve this tenant",
        "The trigger names a connector, or its action has one by default, whose configuration does not list the caller's tenant (`tenants = [...]` of `[connectors.NAME]`; default `[\"default\"]`): a connector acts with the operator's credentials, so it serves only the tenants listed. Nothing was recorded. Ask the operator to add the tenant, or perform the effect yourself under another action.",
    ),
    (
        "workflow-not-allowed",
        "The workflow does not serve this tenant",
        "The workflow is declared in the server's configuration for other tenants only (`tenants = [...]` of `[workflows.NAME]`; default `[\"default\"]`): its steps run on the operator's connectors. Nothing was written.",
    ),
    (
        "retry-not-due",
        "The next attempt is not due yet",
        "The operation failed retryably and its next attempt is scheduled; retry after `Retry-After` seconds.",
    ),
    (
        "fingerprint-mismatch",
        "The key was reused with another payload",
        "The key is bound to the first payload (fingerprint) and action it was used with; a different one is a different intent and needs a new key. IETF httpapi Idempotency-Key draft §2.7: 422. Nothing was changed.",
    ),
    (
        "late-arrival",
        "The key outlived its retention window",
        "The operation under this key completed, and its record was removed when its retention window ended (default 24 h after completion). A tombstone keeps the key's hash, fingerprint and final state (default 30 days after completion), so this late retry executes nothing. After the tombstone is gone the key is new again.",
    ),
    (
        "outcome-unknown",
        "The outcome is unknown",
        "idem proxy: a request with this idempotency key reached the upstream, and no complete answer came back (timeout or reset) or the upstream answered a status that does not prove it did nothing (by default every 5xx but 501, 503, 505 and 511; `--outcome-unknown-statuses`). It may or may not have taken effect, so it is not forwarded again until the upstream's lookup (`--lookup-url`) or an operator settles the operation (POST /_idem/v1/operations/{principal}%2F{key}/resolve). The first request gets this problem with the upstream's status (504 for a timeout, 502 for a reset), its retries get it with 409. Never on a route declared `--provider-deduplicates` (see upstream-no-answer).",
    ),
    (
        "upstream-no-answer",
        "The upstream did not answer; send the request again with the same key",
        "idem proxy, on a route whose upstream deduplicates by Idempotency-Key (`--provider-deduplicates`): the request reached the upstream and no complete answer came back (504 after `--timeout-ms`, 502 for a reset). It may have taken effect, but the upstream answers a repeated key with the first request's result, so the key was released: send the same request with the same Idempotency-Key and it is forwarded again.",
    ),
    (
        "upstream-unreachable",
        "The upstream could not be reached",
        "Nothing was sent to the upstream (connection refused or failed); retrying with the same key is safe.",
    ),
    (
        "connector-owned",
        "idem performs this operation",
        "The operation runs on a configured connector; idem's executor reports its outcome. Callers cannot complete it; operators resolve it with POST /v1/operations/{key}/resolve.",
    ),
    (
        "stale-fencing-token",
        "The lease was lost",
        "The fencing token is not the operation's current one: another lease was granted, or the token never existed. The completion or renewal was ignored.",
    ),
    (
        "lease-expired",
        "The lease expired",
        "The lease of this fencing token ran out before the renewal arrived, and a renewal never revives a lease: the operation may already be UNKNOWN (or, for a redo_safe action, granted to another worker at any moment). Stop the work if you can, and complete with your token to report what happened: `succeeded` with evidence, a failure, or `unknown` (a late completion is accepted while no newer lease exists). Nothing was changed.",
    ),
    (
        "operation-final",
        "The operation is already final",
        "The operation is SUCCEEDED or FAILED; only an identical repeat of the completion that made it final is accepted.",
    ),
    (
        "operation-not-executing",
        "The operation is not executing",
        "Only an EXECUTING operation (or an UNKNOWN one, by the holder of the last lease) can be completed, and only an EXECUTING one renewed; acquire it first.",
    ),
    (
        "not-resolvable",
        "The operation cannot be resolved now",
        "Only UNKNOWN or PENDING operations, or EXECUTING ones whose lease expired, can be resolved by an operator; final ones never change.",
    ),
    (
        "state-changed",
        "The operation changed since you looked",
        "The resolution named the state it was decided from (`expected_state`), and the operation is in another state now (another operator, a late completion or a lookup came first). Nothing was changed; look at it again.",
    ),
    (
        "unknown-workflow",
        "No such workflow",
        "The workflow is not declared in idem's configuration (`[workflows.NAME]`) and the request gave no `steps` to run it from your code. Nothing was written.",
    ),
    (
        "invalid-definition",
        "The workflow's steps cannot run",
        "A step name is invalid or repeated, a policy does not fit the step (a step your code performs cannot use lookup_before_redo), there are no steps, or a group's settings do not fit its steps (a group no step names, max_concurrency not 1-64, branches of one group that are not consecutive). The detail names the field. Nothing was written.",
    ),
    (
        "instance-mismatch",
        "The instance id was reused with another intent",
        "The workflow instance was started with another workflow, input (fingerprint), steps or group settings; a start with the same instance id and a different intent needs a new instance id. Nothing was changed.",
    ),
    (
        "unknown-step",
        "No such step",
        "The instance's pinned definition has no step of that name; the detail lists its steps.",
    ),
    (
        "step-performed-by-idem",
        "idem performs this step",
        "The step runs on a configured connector; idem's workflow engine performs it. Only the steps without a connector are acquired and completed by your code.",
    ),
    (
        "previous-step-unfinished",
        "An earlier step has not succeeded",
        "Steps run in order: a step starts only after the step before it SUCCEEDED. The problem's `state` is the earlier step's state. Also the answer to a branch whose parallel group already has `max_concurrency` branches in flight: `state` is EXECUTING, the detail names the group and its limit, and `Retry-After` says when the first of their leases ends. Nothing was recorded; retry later.",
    ),
    (
        "instance-not-running",
        "The workflow instance is not running",
        "The instance is PAUSED, FAILED, SUCCEEDED, COMPENSATING or COMPENSATED (the problem's `state`): no step may start. Finished steps are still replayed.",
    ),
    (
        "last-admin-key",
        "The tenant's last admin key cannot be revoked",
        "Revoking it would leave the tenant without an active admin key, and nobody could manage its keys over HTTP. Create another admin key first (POST /v1/keys with {\"role\": \"admin\"}, or `idem keys create --tenant T --role admin` on the database), then revoke this one. Nothing was changed.",
    ),
    (
        "step-key-conflict",
        "A step's key holds an operation not made for it",
        "An operation with another action or connector was created (through /v1/operations) under the key of an earlier step: it never counts as that step's result. The instance pauses; a re-run performs the step under a new key.",
    ),
    (
        "instance-busy",
        "The workflow instance kept changing under the request",
        "Other writers changed the instance at every attempt of an operator's request; nothing was changed by it. Look at the instance again.",
    ),
    (
        "missing-reason",
        "A reason is mandatory",
        "An operator's re-run, compensation or resolution needs a reason; it is kept in the events with who asked. Nothing was changed.",
    ),
    (
        "plan-changed",
        "The instance changed since the plan you approved",
        "A re-run passed the `plan_hash` of a dry run, and the plan is another now (the instance moved on, or its steps changed). Nothing was changed: look at the new plan.",
    ),
    (
        "plan-hash-required",
        "This re-run needs the plan hash of a dry run",
        "The re-run redoes a step that SUCCEEDED or whose outcome is UNKNOWN: a new side effect. It runs only as a plan the operator saw: send the request again with `dry_run: true`, check the plan, and pass its `plan_hash` (`idem wf rerun --dry-run`, then `--plan-hash`). A request sent twice then redoes nothing twice. Nothing was changed.",
    ),
    (
        "instance-running",
        "The workflow instance is running",
        "A re-run needs the instance FAILED, PAUSED or SUCCEEDED; wait until it pauses or finishes.",
    ),
    (
        "instance-compensated",
        "The workflow instance was compensated",
        "Its effects were undone; start a new instance for a new attempt.",
    ),
    (
        "instance-not-stopped",
        "The workflow instance is not stopped",
        "Only a FAILED instance, or one PAUSED before any compensation, can be compensated on request.",
    ),
    (
        "compensation-in-progress",
        "Compensation already began",
        "The instance's compensation began: a re-run redoes a failed compensation; steps are not redone then.",
    ),
    ("nothing-to-compensate", "Nothing to compensate", "No step whose effect may exist has a compensation."),
    ("nothing-to-rerun", "Nothing to re-run", "The instance SUCCEEDED: name the steps to redo."),
    ("step-busy", "The step is on its way", "The step is PENDING or EXECUTING: it cannot be redone now."),
    (
        "step-needs-resolution",
        "The step's outcome is unknown and cannot be looked up",
        "Resolve the step's operation (POST /v1/operations/{key}/resolve), or name the step to redo it on purpose.",
    ),
    ("too-many-reruns", "The step was re-run too often", "A step can be re-run 999 times; start a new instance."),
    (
        "contention",
        "Too much contention on this key",
        "Concurrent writers kept changing the record, or another transaction holds its row locked (PostgreSQL) and as many requests as may wait for row locks already do; retry after Retry-After.",
    ),
    (
        "clock-uncertain",
        "This node does not know the ledger's time closely enough",
        "On PostgreSQL every node judges leases, retries and retention on the database's clock, read over the network. This node's last reading (half its round trip plus 100 ppm drift since) is less certain than `--max-clock-uncertainty-ms`, so it reports not ready until a new reading succeeds.",
    ),
    (
        "unavailable",
        "The store is unavailable",
        "The database did not answer, or stopped answering after the request was sent (a failover, a network partition: `--db-answer-timeout-ms`): the request may or may not have been recorded. Send the same request again (an acquire with the same `holder`): every call is safe to resend, and its answer says what was recorded.",
    ),
    (
        "not-durable",
        "This node cannot make writes durable",
        "The fsync of the SQLite write-ahead log failed. What this node committed since the fsync before may or may not survive (after a failed fsync the OS may have dropped it), so this request's outcome is unknown, and the node takes no more writes, answers no reads, and fails `/healthz` and `/readyz` until it is restarted. Send the same request again after the restart: its answer then says what was recorded.",
    ),
    (
        "schema-missing",
        "idem's tables are missing from the database",
        "The database answers, but the tables idem keeps its ledger in are gone: it was dropped and created again, or replaced, under the running node. Nothing can be read or recorded; this request changed nothing. `/healthz` and `/readyz` answer 503 too. Restore the database from a backup, then restart the node. A restart on an empty database migrates it and serves an empty ledger that has forgotten every key, so a retried trigger would perform its effect again.",
    ),
    (
        "write-refused",
        "The database refused the write",
        "An integrity constraint or a trigger on idem's tables refused this request's write; the database's message is in the server's log under the request id (a client is never shown it). Nothing of the request was recorded; sending it again gets the same answer until the constraint or trigger changes.",
    ),
    (
        "write-not-stored",
        "The database did not store the write",
        "The database reported no error but stored fewer rows than idem wrote: a trigger on idem's tables skipped the write (`RAISE(IGNORE)`, or a PostgreSQL `BEFORE` trigger returning NULL). Nothing of the request was recorded or acknowledged.",
    ),
    ("internal", "Internal error", "An unexpected error; see the server log with the request id."),
];

/// A problem details object (RFC 9457 §3).
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Problem {
    /// Stable problem type, `/problems/<slug>`.
    #[serde(rename = "type")]
    pub kind: String,
    /// Short summary of the problem type.
    pub title: String,
    /// HTTP status code.
    pub status: u16,
    /// What went wrong with this request, in words.
    pub detail: String,
    /// Request id (also in the `x-request-id` response header).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub request_id: Option<String>,
    /// For 409: milliseconds to wait before retrying.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub retry_after_ms: Option<i64>,
    /// For `stale-fencing-token`: the operation's current token.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub current_fencing_token: Option<i64>,
    /// For `operation-final` / `operation-not-executing`: the operation's state.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub state: Option<String>,
}

impl Problem {
    /// A problem of type `slug` with `status` and `detail`.
    ///
    /// # Panics
    /// In debug builds, if `slug` is not in [`PROBLEM_TYPES`].
    pub fn new(status: StatusCode, slug: &str, detail: impl Into<String>) -> Self {
        let title = PROBLEM_TYPES.iter().find(|(s, _, _)| *s == slug).map(|(_, t, _)| *t);
        debug_assert!(title.is_some(), "unknown problem slug {slug}");
        Problem {
            kind: format!("/problems/{slug}"),
            title: title.unwrap_or("Error").into(),
            status: status.as_u16(),
            detail: detail.into(),
            request_id: None,
            retry_after_ms: None,
            current_fencing_token: None,
            state: None,
        }
    }

    /// The HTTP status (`status` is always one a `StatusCode` was made from).
    pub fn status_code(&self) -> StatusCode {
        StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
    }

    /// 400 `invalid-request`.
    pub fn invalid(detail: impl Into<String>) -> Self {
        Problem::new(StatusCode::BAD_REQUEST, "invalid-request", detail)
    }

    /// 404 `not-found`.
    pub fn not_found() -> Self {
        Problem::new(StatusCode::NOT_FOUND, "not-found", "no operation with this key")
    }

    /// Sets the request id shown in the body.
    pub fn with_request_id(mut self, id: Option<&str>) -> Self {
        self.request_id = id.map(str::to_owned);
        self
    }
}

/// Marks a response as one of idem's own problems (never an upstream's answer that
/// `idem proxy` passes on), so [`fill_request_id`] may complete its body.
#[derive(Clone)]
pub(crate) struct Rendered(pub(crate) Box<Problem>);

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        let status = self.status_code();
        let retry = self.retry_after_ms;
        let body = serde_json::to_vec(&self).unwrap_or_default();
        let mut resp = (status, body).into_response();
        if self.request_id.is_none() {
            resp.extensions_mut().insert(Rendered(Box::new(self)));
        }
        let h = resp.headers_mut();
        h.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/problem+json"));
        if let Some(ms) = retry {
            // Retry-After is in whole seconds (RFC 9110 §10.2.3): round up, at least 1.
            let secs = ((ms.max(1) + 999) / 1000).to_string();
            if let Ok(v) = HeaderValue::from_str(&secs) {
                h.insert(header::RETRY_AFTER, v);
            }
        }
        resp
    }
}

/// Middleware: every problem idem answers carries the request's id (`request_id`, the
/// same as the `x-request-id` response header), also those built where the id was not at
/// hand (extractor rejections, the proxy, fallbacks). Runs inside the layer that sets
/// `x-request-id` on the request; other responses pass through untouched.
pub async fn fill_request_id(req: axum::extract::Request, next: axum::middleware::Next) -> Response {
    let id = req.headers().get("x-request-id").and_then(|v| v.to_str().ok()).map(str::to_owned);
    let mut resp = next.run(req).await;
    let (Some(id), Some(Rendered(problem))) = (id, resp.extensions_mut().remove::<Rendered>()) else {
        return resp;
    };
    let problem = Problem { request_id: Some(id), ..*problem };
    let (mut parts, _) = resp.into_parts();
    parts.headers.remove(header::CONTENT_LENGTH);
    Response::from_parts(parts, axum::body::Body::from(serde_json::to_vec(&problem).unwrap_or_default()))
}

/// `GET /problems/{slug}`: the description of a problem type, as plain text.
#[utoipa::path(get, path = "/problems/{slug}", tag = "health",
    params(("slug" = String, Path, description = "The problem type's slug, the last segment of its `type` (`/problems/<slug>`)", pattern = "^[a-z-]{1,64}$")),
    responses(
        (status = 200, description = "Title and description of the problem type", content_type = "text/plain", body = String),
        (status = 404, description = "No such problem type (`not-found`)", body = Problem, content_type = "application/problem+json"),
    )
)]
pub async fn describe(axum::extract::Path(slug): axum::extract::Path<String>) -> Response {
    match PROBLEM_TYPES.iter().find(|(s, _, _)| *s == slug) {
        Some((_, title, text)) => (StatusCode::OK, format!("{title}\n\n{text}\n")).into_response(),
        None => Problem::new(StatusCode::NOT_FOUND, "not-found", "no such problem type").into_response(),
    }
}
