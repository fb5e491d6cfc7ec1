//! Operator actions on one operation (DESIGN.md §5): reconcile now, and resolve by hand.
//! Both need the `operator` role and are audited in the event log with the operator's
//! principal and request id.

use crate::AppState;
use crate::auth::Caller;
use crate::dto::OperationView;
use crate::json::ApiJson;
use crate::operations::{parse_key, store_problem};
use crate::problem::Problem;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use idem_store::ResolveRequest;
use idem_store::keys::Role;
use serde::Deserialize;
use utoipa::ToSchema;

/// `POST /v1/operations/{key}/resolve`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ResolveBody {
    /// `SUCCEEDED`, `PENDING` (try again) or `FAILED`.
    #[schema(example = "SUCCEEDED")]
    pub to: String,
    /// Why (mandatory; recorded in the event log).
    #[schema(example = "found the message in the customer's mailbox export")]
    pub reason: String,
    /// Evidence reference (mandatory for SUCCEEDED): the provider's id of the effect.
    pub evidence: Option<String>,
}

/// Resolve an operation by hand (UNKNOWN, PENDING, or EXECUTING with an expired lease).
#[utoipa::path(
    post, path = "/v1/operations/{key}/resolve", tag = "review",
    params(("key" = String, Path, description = "Idempotency key (percent-encoded)")),
    request_body = ResolveBody,
    responses(
        (status = 200, description = "The resolved record", body = OperationView),
        (status = 400, description = "Missing reason, missing evidence for SUCCEEDED, bad target", body = Problem, content_type = "application/problem+json"),
        (status = 401, description = "Missing or invalid API key", body = Problem, content_type = "application/problem+json"),
        (status = 403, description = "Not an operator key", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "No such operation in the caller's tenant", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "Final, or a worker holds a valid lease", body = Problem, content_type = "application/problem+json"),
    ),
    security(("bearer" = []))
)]
pub async fn resolve(
    State(state): State<AppState>,
    caller: Caller,
    Path(raw_key): Path<String>,
    ApiJson(body): ApiJson<ResolveBody>,
) -> Result<Response, Problem> {
    let rid = caller.request_id.clone();
    let fail = |p: Problem| p.with_request_id(rid.as_deref());
    caller.require(Role::Operator).map_err(fail)?;
    let key = parse_key(&raw_key).map_err(fail)?;
    let to = body.to.parse::<idem_core::State>().map_err(|e| fail(Problem::invalid(e.to_string())))?;
    let rec = state
        .store
        .resolve(ResolveRequest {
            tenant: caller.tenant.clone(),
            key: key.to_string(),
            to,
            reason: body.reason,
            evidence: body.evidence,
            actor: caller.actor(),
        })
        .await
        .map_err(|e| fail(store_problem(e)))?;
    Ok(axum::Json(OperationView::of(rec)).into_response())
}

/// Look the operation up at its provider now (even if flagged for review) and record the
/// answer.
#[utoipa::path(
    post, path = "/v1/operations/{key}/reconcile", tag = "review",
    params(("key" = String, Path, description = "Idempotency key (percent-encoded)")),
    responses(
        (status = 200, description = "The record after the lookup (unchanged if it was not UNKNOWN or an expired lease)", body = OperationView),
        (status = 401, description = "Missing or invalid API key", body = Problem, content_type = "application/problem+json"),
        (status = 403, description = "Not an operator key", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "No such operation in the caller's tenant", body = Problem, content_type = "application/problem+json"),
    ),
    security(("bearer" = []))
)]
pub async fn reconcile(
    State(state): State<AppState>,
    caller: Caller,
    Path(raw_key): Path<String>,
) -> Result<Response, Problem> {
    let rid = caller.request_id.clone();
    let fail = |p: Problem| p.with_request_id(rid.as_deref());
    caller.require(Role::Operator).map_err(fail)?;
    let key = parse_key(&raw_key).map_err(fail)?;
    let rec = state
        .store
        .get(&caller.tenant, key.as_str())
        .await
        .map_err(|e| fail(store_problem(e)))?
        .ok_or_else(|| fail(Problem::not_found()))?;
    let out = state.reconciler.reconcile_one(&rec, caller.actor()).await.map_err(|e| fail(store_problem(e)))?;
    Ok(axum::Json(OperationView::of(out.record)).into_response())
}
