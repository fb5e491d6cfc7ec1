//! Operator actions on one operation (DESIGN.md §5): reconcile now, and resolve by hand.
//! Both need the `operator` role and are audited in the event log with the operator's
//! principal and request id.

use crate::AppState;
use crate::auth::Caller;
use crate::dto::OperationView;
use crate::json::ApiJson;
use crate::operations::{parse_key, store_problem};
use crate::problem::Problem;
use axum::extract::State;
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
    /// Why (mandatory, at most 2000 bytes; recorded in the event log).
    #[schema(example = "found the message in the customer's mailbox export")]
    pub reason: String,
    /// Evidence reference (mandatory for SUCCEEDED): the provider's id of the effect, at
    /// most 512 bytes.
    pub evidence: Option<String>,
    /// The state you decided from (`UNKNOWN`, …). If the operation is in another state now,
    /// nothing changes and the answer is 409 `state-changed`. Omit it to resolve whatever the
    /// (resolvable) state.
    #[schema(example = "UNKNOWN")]
    pub expected_state: Option<String>,
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
        (status = 409, description = "Final, a worker holds a valid lease, or the state is not `expected_state` any more", body = Problem, content_type = "application/problem+json"),
    ),
    security(("bearer" = []))
)]
pub async fn resolve(
    State(state): State<AppState>,
    caller: Caller,
    crate::json::ApiPath(raw_key): crate::json::ApiPath,
    ApiJson(body): ApiJson<ResolveBody>,
) -> Result<Response, Problem> {
    let rid = caller.request_id.clone();
    let fail = |p: Problem| p.with_request_id(rid.as_deref());
    let key = parse_key(&raw_key).map_err(fail)?;
    caller.require(Role::Operator).map_err(fail)?;
    let to = body
        .to
        .parse::<idem_core::State>()
        .ok()
        .filter(|s| matches!(s, idem_core::State::Succeeded | idem_core::State::Pending | idem_core::State::Failed))
        .ok_or_else(|| {
            fail(Problem::invalid(format!(
                "to is {:?}; an operation is resolved to SUCCEEDED, PENDING (try again) or FAILED",
                body.to
            )))
        })?;
    let expected_state = body
        .expected_state
        .as_deref()
        .map(str::parse::<idem_core::State>)
        .transpose()
        .map_err(|e| fail(Problem::invalid(format!("expected_state: {e}"))))?;
    let rec = state
        .store
        .resolve(ResolveRequest {
            tenant: caller.tenant.clone(),
            key: key.to_string(),
            to,
            expected_state,
            reason: body.reason,
            evidence: body.evidence,
            actor: caller.actor(),
        })
        .await
        .map_err(|e| fail(store_problem(e)))?;
    state.flows.operation_settled(&rec.tenant, &rec.key).await;
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
    crate::json::ApiPath(raw_key): crate::json::ApiPath,
) -> Result<Response, Problem> {
    let rid = caller.request_id.clone();
    let fail = |p: Problem| p.with_request_id(rid.as_deref());
    let key = parse_key(&raw_key).map_err(fail)?;
    caller.require(Role::Operator).map_err(fail)?;
    let rec = state
        .store
        .get(&caller.tenant, key.as_str())
        .await
        .map_err(|e| fail(store_problem(e)))?
        .ok_or_else(|| fail(Problem::not_found()))?;
    let out = state.reconciler.reconcile_one(&rec, caller.actor()).await.map_err(|e| fail(store_problem(e)))?;
    if out.changed {
        state.flows.operation_settled(&out.record.tenant, &out.record.key).await;
    }
    Ok(axum::Json(OperationView::of(out.record)).into_response())
}
