//! The OpenAPI 3.1 document served at `/openapi.json`, generated from the handlers'
//! annotations (utoipa), so it cannot drift from the routes' types.

use crate::dto::{AcquireBody, CompleteBody, ErrorView, EventView, OperationPage, OperationView, RenewBody};
use crate::problem::Problem;
use axum::response::{IntoResponse, Response};
use utoipa::openapi::security::{Http, HttpAuthScheme, SecurityScheme};
use utoipa::{Modify, OpenApi};

/// The API description.
#[derive(OpenApi)]
#[openapi(
    info(
        title = "idem",
        description = "idem makes side effects safe to retry. Acquire an idempotency key before a side effect, \
perform it only when granted (201: the one answer that hands the effect to the caller), then complete with \
the fencing token. Repeated triggers get the recorded result (200 + `Idempotent-Replayed: true`), 409 while \
another worker holds the lease, 202 while the outcome is UNKNOWN, and 422 when the key is reused with another \
payload. When a connector of idem's performs the effect, the trigger gets 200 + `Idem-Performed-By: connector` \
with the outcome (or 202 while it runs), never 201. A lease has a holder identity (`holder`: a UUID generated \
for one attempt, never a worker name or request id): that attempt's resend during its lease gets its own grant \
back (201), and it renews the lease with its fencing token (`POST /v1/operations/{key}/renew`, a heartbeat). Leases, retries \
and retention are judged on one clock per ledger (on PostgreSQL, the database's). Status codes follow the IETF httpapi \
Idempotency-Key draft; errors are RFC 9457 problem+json whose `type` is `/problems/<slug>`. Instants are \
RFC 3339 UTC, durations milliseconds. Every /v1 call needs `Authorization: Bearer <api key>` and sees only \
its tenant: another tenant's key is answered exactly like a missing one (404).\n\nRetention: a SUCCEEDED or \
FAILED record is kept for its action's retention window, counted from completion (default 24 h; `forever` for \
permanent business keys); then a tombstone (key hash, fingerprint, final state) is kept until the tombstone \
window ends, counted from completion too (default 30 days), and a retry of the key is answered 410 \
(`/problems/late-arrival`) without executing anything. After that the key is new again. Operations that are \
not final (PENDING, EXECUTING, UNKNOWN, flagged for review) never expire.\n\nOperators: `/metrics` serves \
Prometheus counters (no API key; no tenant data), and `/ui` is the admin page (HTML; sign in with an API key).",
    ),
    paths(
        crate::operations::acquire,
        crate::operations::renew,
        crate::operations::complete,
        crate::operations::get_one,
        crate::operations::list,
        crate::workflows::start,
        crate::workflows::get_one,
        crate::workflows::list,
        crate::workflows::acquire_step,
        crate::workflows::complete_step,
        crate::workflows::rerun,
        crate::workflows::compensate,
        crate::review::resolve,
        crate::review::reconcile,
        crate::keys::create,
        crate::keys::list,
        crate::keys::revoke,
        crate::healthz,
        crate::readyz,
        crate::metrics::serve,
        crate::index::index,
        serve,
        crate::problem::describe,
    ),
    components(schemas(crate::index::IndexView, AcquireBody, RenewBody, CompleteBody, OperationView, EventView, ErrorView, OperationPage, Problem, crate::keys::NewKeyBody, crate::review::ResolveBody, crate::keys::ApiKeyView, crate::workflows::dto::StartBody, crate::workflows::dto::StepDeclBody, crate::workflows::dto::StepAcquireBody, crate::workflows::dto::InstanceView, crate::workflows::dto::CheckpointView, crate::workflows::dto::GroupView, crate::workflows::dto::BranchView, crate::workflows::dto::ItemView, crate::workflows::dto::CompensationView, crate::workflows::dto::InstanceEventView, crate::workflows::dto::InstancePage, crate::workflows::dto::RerunBody, crate::workflows::dto::CompensateBody, crate::workflows::dto::RerunView, crate::workflows::dto::PlannedStepView, crate::workflows::dto::PlannedItemView)),
    modifiers(&BearerAuth),
    tags((name = "operations", description = "The ledger of side effects"), (name = "workflows", description = "Multi-step workflows: instances whose steps are operations (`{instance}:{step}`), with a checkpoint per step; idem runs declared workflows, your code runs the steps idem has no connector for"), (name = "review", description = "Operator actions: reconcile now, resolve by hand (operator role)"), (name = "keys", description = "API keys of the caller's tenant (admin role)"), (name = "health", description = "Probes"))
)]
pub struct ApiDoc;

struct BearerAuth;

impl Modify for BearerAuth {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        if let Some(components) = openapi.components.as_mut() {
            components.add_security_scheme("bearer", SecurityScheme::Http(Http::new(HttpAuthScheme::Bearer)));
        }
    }
}

/// This document: utoipa's, completed by [`crate::openapi_contract`] (unique operation
/// ids, every status, every field rule), with the names of the connectors `connectors`
/// this node has configured (the only values `connector` takes).
pub fn document(connectors: &[String]) -> serde_json::Value {
    static BASE: std::sync::OnceLock<serde_json::Value> = std::sync::OnceLock::new();
    let base = BASE.get_or_init(|| serde_json::to_value(ApiDoc::openapi()).expect("the document is JSON"));
    crate::openapi_contract::complete(base.clone(), connectors)
}

/// The OpenAPI 3.1 document of this server.
#[utoipa::path(get, path = "/openapi.json", tag = "health", responses(
    (status = 200, description = "The OpenAPI 3.1 document (JSON)", content_type = "application/json", body = Object),
))]
pub async fn serve(axum::extract::State(state): axum::extract::State<crate::AppState>) -> Response {
    let connectors: Vec<String> =
        state.executor.registry().names().filter(|n| !n.starts_with("lookup:")).map(str::to_owned).collect();
    axum::Json(document(&connectors)).into_response()
}
