//! `/v1/keys`: API keys of the caller's own tenant, for admins.
//!
//! Keys of other tenants are managed with `idem keys …` on the database. A key of another
//! tenant is answered exactly like a missing one (404).

use crate::AppState;
use crate::auth::Caller;
use crate::dto::rfc3339;
use crate::json::ApiJson;
use crate::operations::store_problem;
use crate::problem::Problem;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use idem_store::keys::{ApiKeyInfo, Role};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// `POST /v1/keys`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewKeyBody {
    /// `client`, `operator` or `admin`.
    #[schema(example = "client")]
    pub role: String,
    /// Principal recorded on every change made with the key (default: the role name);
    /// 1-64 of `[A-Za-z0-9._-]`.
    pub principal: Option<String>,
}

/// An API key, without its secret.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct ApiKeyView {
    /// Identifier, for revocation.
    pub id: String,
    /// Tenant the key acts for.
    pub tenant: String,
    /// Principal recorded on events.
    pub principal: String,
    /// `client`, `operator` or `admin`.
    pub role: String,
    /// Creation instant.
    pub created_at: String,
    /// Revocation instant, if revoked.
    pub revoked_at: Option<String>,
    /// The secret: only in the answer to `POST /v1/keys`, never again.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub secret: Option<String>,
}

impl ApiKeyView {
    fn of(k: ApiKeyInfo, secret: Option<String>) -> Self {
        ApiKeyView {
            id: k.id,
            tenant: k.tenant,
            principal: k.principal,
            role: k.role.as_str().into(),
            created_at: rfc3339(k.created_at),
            revoked_at: k.revoked_at.map(rfc3339),
            secret,
        }
    }
}

/// Create a key for the caller's tenant; the secret is in this answer only.
#[utoipa::path(
    post, path = "/v1/keys", tag = "keys", request_body = NewKeyBody,
    responses(
        (status = 201, description = "The new key with its `secret`", body = ApiKeyView),
        (status = 400, description = "Bad role or principal", body = Problem, content_type = "application/problem+json"),
        (status = 403, description = "Not an admin key", body = Problem, content_type = "application/problem+json"),
        (status = 401, description = "Missing or invalid API key", body = Problem, content_type = "application/problem+json"),
    ),
    security(("bearer" = []))
)]
pub async fn create(
    State(state): State<AppState>,
    caller: Caller,
    ApiJson(body): ApiJson<NewKeyBody>,
) -> Result<Response, Problem> {
    let rid = caller.request_id.clone();
    let fail = |p: Problem| p.with_request_id(rid.as_deref());
    caller.require(Role::Admin).map_err(fail)?;
    let role: Role = body.role.parse().map_err(|e: String| fail(Problem::invalid(e)))?;
    let principal = body.principal.unwrap_or_else(|| role.as_str().to_owned());
    let (info, secret) =
        state.store.create_api_key(&caller.tenant, &principal, role, None).await.map_err(|e| fail(store_problem(e)))?;
    tracing::info!(id = %info.id, by = %caller.principal, "API key created");
    Ok((StatusCode::CREATED, axum::Json(ApiKeyView::of(info, Some(secret)))).into_response())
}

/// The caller's tenant's keys (never their secrets).
#[utoipa::path(
    get, path = "/v1/keys", tag = "keys",
    responses(
        (status = 200, description = "Keys, oldest first", body = Vec<ApiKeyView>),
        (status = 403, description = "Not an admin key", body = Problem, content_type = "application/problem+json"),
        (status = 401, description = "Missing or invalid API key", body = Problem, content_type = "application/problem+json"),
    ),
    security(("bearer" = []))
)]
pub async fn list(State(state): State<AppState>, caller: Caller) -> Result<Response, Problem> {
    caller.require(Role::Admin).map_err(|p| p.with_request_id(caller.request_id.as_deref()))?;
    let keys = state
        .store
        .list_api_keys(Some(&caller.tenant))
        .await
        .map_err(|e| store_problem(e).with_request_id(caller.request_id.as_deref()))?;
    let views: Vec<ApiKeyView> = keys.into_iter().map(|k| ApiKeyView::of(k, None)).collect();
    Ok(axum::Json(views).into_response())
}

/// Revoke one of the caller's tenant's keys; it stops authenticating at once.
///
/// The tenant's last active admin key is not revoked (409 `last-admin-key`): nobody could
/// manage the tenant's keys over HTTP any more. Create another admin key first
/// (`POST /v1/keys` with `{"role": "admin"}`), then revoke this one with it.
#[utoipa::path(
    delete, path = "/v1/keys/{id}", tag = "keys",
    params(("id" = String, Path, description = "Key id")),
    responses(
        (status = 204, description = "Revoked"),
        (status = 403, description = "Not an admin key", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "No live key with that id in the caller's tenant", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "`last-admin-key`: the tenant's only active admin key; create another admin key first", body = Problem, content_type = "application/problem+json"),
        (status = 401, description = "Missing or invalid API key", body = Problem, content_type = "application/problem+json"),
    ),
    security(("bearer" = []))
)]
pub async fn revoke(
    State(state): State<AppState>,
    caller: Caller,
    crate::json::ApiPath(id): crate::json::ApiPath,
) -> Result<Response, Problem> {
    let rid = caller.request_id.clone();
    let fail = |p: Problem| p.with_request_id(rid.as_deref());
    caller.require(Role::Admin).map_err(fail)?;
    idem_core::ident::check_identifier("the key id", &id, 255).map_err(|e| fail(Problem::invalid(e.to_string())))?;
    use idem_store::keys::Revocation;
    match state.store.revoke_api_key_keeping_an_admin(&caller.tenant, &id).await.map_err(|e| fail(store_problem(e)))? {
        Revocation::Revoked => {}
        Revocation::NotFound => {
            return Err(fail(Problem::new(StatusCode::NOT_FOUND, "not-found", "no live API key with that id")));
        }
        Revocation::LastAdmin => {
            return Err(fail(Problem::new(
                StatusCode::CONFLICT,
                "last-admin-key",
                format!(
                    "key {id} is the only active admin key of tenant {:?}; create another admin key first (POST /v1/keys with {{\"role\": \"admin\"}}), then revoke this one with the new key",
                    caller.tenant
                ),
            )));
        }
    }
    tracing::info!(%id, by = %caller.principal, "API key revoked");
    Ok(StatusCode::NO_CONTENT.into_response())
}
