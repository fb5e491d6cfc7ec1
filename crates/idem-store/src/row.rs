//! Row shapes shared by both SQL backends, and their conversion to the domain types.
//!
//! Both schemas use the same column names and types (BIGINT epoch ms, TEXT JSON, BOOLEAN),
//! so one `FromRow` derive serves SQLite and PostgreSQL.

use crate::StoreError;
use crate::keys::{ApiKeyInfo, Role};
use idem_core::{OperationEvent, OperationRecord, State};

/// Columns of `operations` in `SELECT` order (see [`OPERATION_COLUMNS`]).
#[derive(Debug, sqlx::FromRow)]
pub(crate) struct OperationRow {
    pub tenant: String,
    pub op_key: String,
    pub action: String,
    pub fingerprint: String,
    pub payload: String,
    pub state: String,
    pub attempt_count: i64,
    pub lease_owner: Option<String>,
    pub lease_holder: Option<String>,
    pub lease_expires_at: Option<i64>,
    pub fencing_token: i64,
    pub next_attempt_at: Option<i64>,
    pub provider_ref: Option<String>,
    pub result: Option<String>,
    pub error_class: Option<String>,
    pub error_message: Option<String>,
    pub verified_at: Option<i64>,
    pub evidence_source: Option<String>,
    pub needs_review: bool,
    pub redo_safe: bool,
    pub connector: Option<String>,
    pub lookup_attempts: i64,
    pub created_at: i64,
    pub updated_at: i64,
    pub completed_at: Option<i64>,
    pub expires_at: Option<i64>,
    pub version: i64,
}

/// The column list of [`OperationRow`], as a literal so statements stay `&'static str`
/// (sqlx 0.9 refuses dynamic SQL text unless audited).
macro_rules! operation_columns {
    () => {
        "tenant, op_key, action, fingerprint, payload, state, attempt_count, \
    lease_owner, lease_expires_at, fencing_token, next_attempt_at, provider_ref, result, error_class, \
    error_message, verified_at, evidence_source, needs_review, redo_safe, connector, lookup_attempts, \
         created_at, updated_at, \
    completed_at, expires_at, version, lease_holder"
    };
}
pub(crate) use operation_columns;

/// A stored state name; anything else is [`StoreError::Corrupt`].
pub(crate) fn parse_state(s: &str) -> Result<State, StoreError> {
    s.parse().map_err(|e: idem_core::state::ParseStateError| StoreError::Corrupt(e.to_string()))
}

fn parse_json(s: &str) -> Result<serde_json::Value, StoreError> {
    serde_json::from_str(s).map_err(|e| StoreError::Corrupt(format!("stored JSON: {e}")))
}

impl OperationRow {
    pub(crate) fn into_record(self) -> Result<OperationRecord, StoreError> {
        Ok(OperationRecord {
            tenant: self.tenant,
            key: self.op_key,
            action: self.action,
            fingerprint: self.fingerprint,
            payload: parse_json(&self.payload)?,
            state: parse_state(&self.state)?,
            attempt_count: self.attempt_count,
            lease_owner: self.lease_owner,
            lease_holder: self.lease_holder,
            lease_expires_at: self.lease_expires_at,
            fencing_token: self.fencing_token,
            next_attempt_at: self.next_attempt_at,
            provider_ref: self.provider_ref,
            result: self.result.as_deref().map(parse_json).transpose()?,
            error_class: self.error_class,
            error_message: self.error_message,
            verified_at: self.verified_at,
            evidence_source: self.evidence_source,
            needs_review: self.needs_review,
            redo_safe: self.redo_safe,
            connector: self.connector,
            lookup_attempts: self.lookup_attempts,
            created_at: self.created_at,
            updated_at: self.updated_at,
            completed_at: self.completed_at,
            expires_at: self.expires_at,
            version: self.version,
        })
    }
}

/// Columns of `operation_events`.
#[derive(Debug, sqlx::FromRow)]
pub(crate) struct EventRow {
    pub seq: i64,
    pub tenant: String,
    pub op_key: String,
    pub at: i64,
    pub kind: String,
    pub principal: String,
    pub request_id: Option<String>,
    pub from_state: Option<String>,
    pub to_state: Option<String>,
    pub fencing_token: Option<i64>,
    pub fingerprint: Option<String>,
    pub reason: Option<String>,
    pub error_class: Option<String>,
    pub wait_ms: Option<i64>,
}

impl EventRow {
    pub(crate) fn into_event(self) -> Result<OperationEvent, StoreError> {
        Ok(OperationEvent {
            seq: self.seq,
            tenant: self.tenant,
            key: self.op_key,
            at: self.at,
            kind: self.kind,
            principal: self.principal,
            request_id: self.request_id,
            from_state: self.from_state.as_deref().map(parse_state).transpose()?,
            to_state: self.to_state.as_deref().map(parse_state).transpose()?,
            fencing_token: self.fencing_token,
            fingerprint: self.fingerprint,
            reason: self.reason,
            error_class: self.error_class,
            wait_ms: self.wait_ms,
        })
    }
}

/// Columns of `api_keys` (without the hash).
#[derive(Debug, sqlx::FromRow)]
pub(crate) struct ApiKeyRow {
    pub id: String,
    pub tenant: String,
    pub principal: String,
    pub role: String,
    pub created_at: i64,
    pub revoked_at: Option<i64>,
}

impl ApiKeyRow {
    pub(crate) fn into_info(self) -> Result<ApiKeyInfo, StoreError> {
        Ok(ApiKeyInfo {
            id: self.id,
            tenant: self.tenant,
            principal: self.principal,
            role: self.role.parse::<Role>().map_err(StoreError::Corrupt)?,
            created_at: self.created_at,
            revoked_at: self.revoked_at,
        })
    }
}

/// The columns [`bind_record`] binds, in its order: what a multi-row writer lists after
/// `INSERT INTO operations`. A literal, for `concat!`.
macro_rules! record_bind_columns {
    () => {
        "tenant, op_key, action, fingerprint, payload, state, attempt_count, lease_owner, lease_expires_at, \
         fencing_token, next_attempt_at, provider_ref, result, error_class, error_message, verified_at, \
         evidence_source, needs_review, redo_safe, created_at, updated_at, completed_at, expires_at, version, \
         connector, lookup_attempts, lease_holder"
    };
}
pub(crate) use record_bind_columns;

/// The columns [`bind_event`] binds, in its order (a literal, for `concat!`).
macro_rules! event_bind_columns {
    () => {
        "tenant, op_key, at, kind, principal, request_id, from_state, to_state, fencing_token, fingerprint, \
         reason, error_class, wait_ms"
    };
}
pub(crate) use event_bind_columns;

/// Binds every column of `r`, in [`record_bind_columns!`] order, on either backend.
pub(crate) fn bind_record<DB: sqlx::Database>(
    mut b: sqlx::query_builder::Separated<'_, DB, &'static str>,
    r: &OperationRecord,
) where
    for<'t> String: sqlx::Encode<'t, DB> + sqlx::Type<DB>,
    for<'t> Option<String>: sqlx::Encode<'t, DB> + sqlx::Type<DB>,
    for<'t> &'static str: sqlx::Encode<'t, DB> + sqlx::Type<DB>,
    for<'t> i64: sqlx::Encode<'t, DB> + sqlx::Type<DB>,
    for<'t> Option<i64>: sqlx::Encode<'t, DB> + sqlx::Type<DB>,
    for<'t> bool: sqlx::Encode<'t, DB> + sqlx::Type<DB>,
{
    b.push_bind(r.tenant.clone())
        .push_bind(r.key.clone())
        .push_bind(r.action.clone())
        .push_bind(r.fingerprint.clone())
        .push_bind(r.payload.to_string())
        .push_bind(r.state.as_str())
        .push_bind(r.attempt_count)
        .push_bind(r.lease_owner.clone())
        .push_bind(r.lease_expires_at)
        .push_bind(r.fencing_token)
        .push_bind(r.next_attempt_at)
        .push_bind(r.provider_ref.clone())
        .push_bind(r.result.as_ref().map(|v| v.to_string()))
        .push_bind(r.error_class.clone())
        .push_bind(r.error_message.clone())
        .push_bind(r.verified_at)
        .push_bind(r.evidence_source.clone())
        .push_bind(r.needs_review)
        .push_bind(r.redo_safe)
        .push_bind(r.created_at)
        .push_bind(r.updated_at)
        .push_bind(r.completed_at)
        .push_bind(r.expires_at)
        .push_bind(r.version)
        .push_bind(r.connector.clone())
        .push_bind(r.lookup_attempts)
        .push_bind(r.lease_holder.clone());
}

/// Binds every column of `e`, in [`event_bind_columns!`] order, on either backend.
pub(crate) fn bind_event<DB: sqlx::Database>(
    mut b: sqlx::query_builder::Separated<'_, DB, &'static str>,
    e: &OperationEvent,
) where
    for<'t> String: sqlx::Encode<'t, DB> + sqlx::Type<DB>,
    for<'t> Option<String>: sqlx::Encode<'t, DB> + sqlx::Type<DB>,
    for<'t> Option<&'static str>: sqlx::Encode<'t, DB> + sqlx::Type<DB>,
    for<'t> i64: sqlx::Encode<'t, DB> + sqlx::Type<DB>,
    for<'t> Option<i64>: sqlx::Encode<'t, DB> + sqlx::Type<DB>,
{
    b.push_bind(e.tenant.clone())
        .push_bind(e.key.clone())
        .push_bind(e.at)
        .push_bind(e.kind.clone())
        .push_bind(e.principal.clone())
        .push_bind(e.request_id.clone())
        .push_bind(e.from_state.map(|s| s.as_str()))
        .push_bind(e.to_state.map(|s| s.as_str()))
        .push_bind(e.fencing_token)
        .push_bind(e.fingerprint.clone())
        .push_bind(e.reason.clone())
        .push_bind(e.error_class.clone())
        .push_bind(e.wait_ms);
}
