//! A batch of records or events as one PostgreSQL array per column, for the hot path's
//! statements to read back as rows with `unnest(…)`.
//!
//! One statement text then serves every batch size: PostgreSQL parses and plans it once
//! per connection (a generic plan, `plan_cache_mode = force_generic_plan`) and sqlx
//! caches it under one key. A `VALUES` list instead made each batch size its own
//! statement: up to 64 texts per kind and connection, each parsed and planned on first
//! use, with `27 × n` parameters to bind, and more shapes than sqlx's statement cache
//! (100 a connection) keeps. Binding arrays is the usual way to send many rows in one
//! statement with sqlx (it has no multi-row bind of its own).
//!
//! The arrays borrow the batch's strings; nothing is copied but the payload and result
//! JSON, which the columns store as text.

use idem_core::{OperationEvent, OperationRecord};
use sqlx::Postgres;
use sqlx::postgres::PgArguments;
use sqlx::query::Query;

/// The columns of [`crate::row::record_bind_columns!`] with their PostgreSQL types, in
/// that order: what `unnest` casts each array parameter to.
pub(super) const RECORD_TYPES: [(&str, &str); 27] = [
    ("tenant", "text"),
    ("op_key", "text"),
    ("action", "text"),
    ("fingerprint", "text"),
    ("payload", "text"),
    ("state", "text"),
    ("attempt_count", "int8"),
    ("lease_owner", "text"),
    ("lease_expires_at", "int8"),
    ("fencing_token", "int8"),
    ("next_attempt_at", "int8"),
    ("provider_ref", "text"),
    ("result", "text"),
    ("error_class", "text"),
    ("error_message", "text"),
    ("verified_at", "int8"),
    ("evidence_source", "text"),
    ("needs_review", "bool"),
    ("redo_safe", "bool"),
    ("created_at", "int8"),
    ("updated_at", "int8"),
    ("completed_at", "int8"),
    ("expires_at", "int8"),
    ("version", "int8"),
    ("connector", "text"),
    ("lookup_attempts", "int8"),
    ("lease_holder", "text"),
];

/// The columns of [`crate::row::event_bind_columns!`] with their PostgreSQL types.
pub(super) const EVENT_TYPES: [(&str, &str); 13] = [
    ("tenant", "text"),
    ("op_key", "text"),
    ("at", "int8"),
    ("kind", "text"),
    ("principal", "text"),
    ("request_id", "text"),
    ("from_state", "text"),
    ("to_state", "text"),
    ("fencing_token", "int8"),
    ("fingerprint", "text"),
    ("reason", "text"),
    ("error_class", "text"),
    ("wait_ms", "int8"),
];

/// `unnest($first::t1[], $first+1::t2[], …) AS alias (name1, name2, …)` for `columns`:
/// the row source of a statement whose parameters from number `first` on are one array
/// per column.
pub(super) fn unnest(first: usize, columns: &[(&str, &str)], alias: &str) -> String {
    let params: Vec<String> =
        columns.iter().enumerate().map(|(i, (_, ty))| format!("${}::{ty}[]", first + i)).collect();
    let names: Vec<&str> = columns.iter().map(|(name, _)| *name).collect();
    format!("unnest({}) AS {alias} ({})", params.join(", "), names.join(", "))
}

/// Records, one vector per column of [`RECORD_TYPES`].
#[derive(Default)]
pub(super) struct Records<'a> {
    tenant: Vec<&'a str>,
    op_key: Vec<&'a str>,
    action: Vec<&'a str>,
    fingerprint: Vec<&'a str>,
    payload: Vec<String>,
    state: Vec<&'static str>,
    attempt_count: Vec<i64>,
    lease_owner: Vec<Option<&'a str>>,
    lease_expires_at: Vec<Option<i64>>,
    fencing_token: Vec<i64>,
    next_attempt_at: Vec<Option<i64>>,
    provider_ref: Vec<Option<&'a str>>,
    result: Vec<Option<String>>,
    error_class: Vec<Option<&'a str>>,
    error_message: Vec<Option<&'a str>>,
    verified_at: Vec<Option<i64>>,
    evidence_source: Vec<Option<&'a str>>,
    needs_review: Vec<bool>,
    redo_safe: Vec<bool>,
    created_at: Vec<i64>,
    updated_at: Vec<i64>,
    completed_at: Vec<Option<i64>>,
    expires_at: Vec<Option<i64>>,
    version: Vec<i64>,
    connector: Vec<Option<&'a str>>,
    lookup_attempts: Vec<i64>,
    lease_holder: Vec<Option<&'a str>>,
}

impl<'a> Records<'a> {
    /// The columns of `records`, in their order.
    pub(super) fn of(records: impl ExactSizeIterator<Item = &'a OperationRecord>) -> Self {
        let mut c = Records::default();
        c.reserve(records.len());
        for r in records {
            c.tenant.push(&r.tenant);
            c.op_key.push(&r.key);
            c.action.push(&r.action);
            c.fingerprint.push(&r.fingerprint);
            c.payload.push(r.payload.to_string());
            c.state.push(r.state.as_str());
            c.attempt_count.push(r.attempt_count);
            c.lease_owner.push(r.lease_owner.as_deref());
            c.lease_expires_at.push(r.lease_expires_at);
            c.fencing_token.push(r.fencing_token);
            c.next_attempt_at.push(r.next_attempt_at);
            c.provider_ref.push(r.provider_ref.as_deref());
            c.result.push(r.result.as_ref().map(|v| v.to_string()));
            c.error_class.push(r.error_class.as_deref());
            c.error_message.push(r.error_message.as_deref());
            c.verified_at.push(r.verified_at);
            c.evidence_source.push(r.evidence_source.as_deref());
            c.needs_review.push(r.needs_review);
            c.redo_safe.push(r.redo_safe);
            c.created_at.push(r.created_at);
            c.updated_at.push(r.updated_at);
            c.completed_at.push(r.completed_at);
            c.expires_at.push(r.expires_at);
            c.version.push(r.version);
            c.connector.push(r.connector.as_deref());
            c.lookup_attempts.push(r.lookup_attempts);
            c.lease_holder.push(r.lease_holder.as_deref());
        }
        c
    }

    fn reserve(&mut self, n: usize) {
        self.tenant.reserve(n);
        self.op_key.reserve(n);
        self.payload.reserve(n);
    }

    /// Binds the 27 arrays, in [`RECORD_TYPES`] order.
    pub(super) fn bind(self, q: Query<'a, Postgres, PgArguments>) -> Query<'a, Postgres, PgArguments> {
        q.bind(self.tenant)
            .bind(self.op_key)
            .bind(self.action)
            .bind(self.fingerprint)
            .bind(self.payload)
            .bind(self.state)
            .bind(self.attempt_count)
            .bind(self.lease_owner)
            .bind(self.lease_expires_at)
            .bind(self.fencing_token)
            .bind(self.next_attempt_at)
            .bind(self.provider_ref)
            .bind(self.result)
            .bind(self.error_class)
            .bind(self.error_message)
            .bind(self.verified_at)
            .bind(self.evidence_source)
            .bind(self.needs_review)
            .bind(self.redo_safe)
            .bind(self.created_at)
            .bind(self.updated_at)
            .bind(self.completed_at)
            .bind(self.expires_at)
            .bind(self.version)
            .bind(self.connector)
            .bind(self.lookup_attempts)
            .bind(self.lease_holder)
    }
}

/// Events, each tagged with the number (`ord`) of the request it belongs to, one vector
/// per column: `ord`, then [`EVENT_TYPES`].
#[derive(Default)]
pub(super) struct Events<'a> {
    ord: Vec<i32>,
    tenant: Vec<&'a str>,
    op_key: Vec<&'a str>,
    at: Vec<i64>,
    kind: Vec<&'a str>,
    principal: Vec<&'a str>,
    request_id: Vec<Option<&'a str>>,
    from_state: Vec<Option<&'static str>>,
    to_state: Vec<Option<&'static str>>,
    fencing_token: Vec<Option<i64>>,
    fingerprint: Vec<Option<&'a str>>,
    reason: Vec<Option<&'a str>>,
    error_class: Vec<Option<&'a str>>,
    wait_ms: Vec<Option<i64>>,
}

impl<'a> Events<'a> {
    /// The columns of `events`, each `(ord, event)`.
    pub(super) fn of(events: impl IntoIterator<Item = (i32, &'a OperationEvent)>) -> Self {
        let mut c = Events::default();
        for (ord, e) in events {
            c.ord.push(ord);
            c.tenant.push(&e.tenant);
            c.op_key.push(&e.key);
            c.at.push(e.at);
            c.kind.push(&e.kind);
            c.principal.push(&e.principal);
            c.request_id.push(e.request_id.as_deref());
            c.from_state.push(e.from_state.map(|s| s.as_str()));
            c.to_state.push(e.to_state.map(|s| s.as_str()));
            c.fencing_token.push(e.fencing_token);
            c.fingerprint.push(e.fingerprint.as_deref());
            c.reason.push(e.reason.as_deref());
            c.error_class.push(e.error_class.as_deref());
            c.wait_ms.push(e.wait_ms);
        }
        c
    }

    /// Binds the `ord` array (unless `with_ord` is false) and the 13 event arrays, in
    /// [`EVENT_TYPES`] order.
    pub(super) fn bind(self, q: Query<'a, Postgres, PgArguments>, with_ord: bool) -> Query<'a, Postgres, PgArguments> {
        let q = if with_ord { q.bind(self.ord) } else { q };
        q.bind(self.tenant)
            .bind(self.op_key)
            .bind(self.at)
            .bind(self.kind)
            .bind(self.principal)
            .bind(self.request_id)
            .bind(self.from_state)
            .bind(self.to_state)
            .bind(self.fencing_token)
            .bind(self.fingerprint)
            .bind(self.reason)
            .bind(self.error_class)
            .bind(self.wait_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::{EVENT_TYPES, RECORD_TYPES, unnest};

    fn names(columns: &[(&str, &str)]) -> Vec<String> {
        columns.iter().map(|(n, _)| (*n).to_owned()).collect()
    }

    fn list(literal: &str) -> Vec<String> {
        literal.split(',').map(|c| c.trim().to_owned()).collect()
    }

    #[test]
    fn the_typed_columns_are_the_bind_columns_in_order() {
        assert_eq!(names(&RECORD_TYPES), list(crate::row::record_bind_columns!()));
        assert_eq!(names(&EVENT_TYPES), list(crate::row::event_bind_columns!()));
    }

    #[test]
    fn unnest_numbers_one_array_parameter_per_column() {
        assert_eq!(unnest(3, &[("a", "text"), ("b", "int8")], "v"), "unnest($3::text[], $4::int8[]) AS v (a, b)");
    }
}
