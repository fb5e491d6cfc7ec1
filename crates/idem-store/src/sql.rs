//! The SQL both backends share, written once.
//!
//! Both schemas have the same columns and types, and every statement here is valid on
//! SQLite ≥ 3.35 and PostgreSQL ≥ 12 (`$n` parameters, `ON CONFLICT … DO NOTHING`,
//! `CAST`). sqlx has no generic executor that is pleasant to bound over two databases, so
//! [`sql_ops!`] expands the same functions once per backend module.
//!
//! The claim protocol lives in `acquire_once` / `complete_once`: read the record, let
//! idem-core plan the change, then write it with an atomic insert
//! (`INSERT … ON CONFLICT DO NOTHING`) or a conditional update (`WHERE version = $read`).
//! A write whose condition fails returns `None`: the caller rolls back and starts over
//! from the read. Nothing here ever decides from a stale read.

use crate::row::operation_columns;

// The background queries (`$1` = now in epoch ms, `$2` = limit). Each is served by one of
// the partial indexes of migration 0005; `background_queries_use_the_partial_indexes`
// (tests/conformance.rs, through `testing`) checks the plans on both backends.

/// Up to `$2` expired leases of operations that are not redo-safe, oldest first.
pub(crate) const EXPIRE_LEASES: &str = concat!(
    "SELECT ",
    operation_columns!(),
    " FROM operations WHERE state = 'EXECUTING' AND redo_safe = FALSE \
     AND lease_expires_at <= $1 ORDER BY lease_expires_at LIMIT $2"
);
/// Up to `$2` operations of connector `$3` due for an attempt, oldest due first: PENDING
/// ones whose attempt is due, and redo-safe EXECUTING ones whose lease expired. Two
/// branches (`UNION ALL`) so that each uses its partial index; an `OR` of the two would
/// scan the table on SQLite.
pub(crate) const DUE_EXECUTIONS: &str = concat!(
    "SELECT * FROM (SELECT ",
    operation_columns!(),
    " FROM operations WHERE state = 'PENDING' \
     AND (next_attempt_at IS NULL OR next_attempt_at <= $1) AND connector = $3 AND connector NOT LIKE 'lookup:%' \
     UNION ALL SELECT ",
    operation_columns!(),
    " FROM operations WHERE state = 'EXECUTING' \
     AND lease_expires_at <= $1 AND redo_safe = TRUE AND connector = $3 AND connector NOT LIKE 'lookup:%') AS due \
     ORDER BY next_attempt_at LIMIT $2"
);
/// Up to `$2` UNKNOWN operations whose next lookup is due.
pub(crate) const DUE_RECONCILIATIONS: &str = concat!(
    "SELECT ",
    operation_columns!(),
    " FROM operations WHERE state = 'UNKNOWN' AND needs_review = FALSE \
     AND (next_attempt_at IS NULL OR next_attempt_at <= $1) ORDER BY next_attempt_at LIMIT $2"
);
/// Up to `$2` final records past their retention, oldest expiry first. An operation that
/// is a step (or an item of a step for each item) of a workflow instance (or the compensation of one) stays while its instance
/// does (the instance's sweep removes its step rows, and the operation goes on the next
/// sweep): a paused instance must still see what its earlier steps did.
pub(crate) const SWEEP: &str = concat!(
    "SELECT ",
    operation_columns!(),
    " FROM operations WHERE state IN ('SUCCEEDED', 'FAILED') \
     AND expires_at <= $1 \
     AND NOT EXISTS (SELECT 1 FROM workflow_steps s WHERE s.tenant = operations.tenant AND s.op_key = operations.op_key) \
     AND NOT EXISTS (SELECT 1 FROM workflow_steps s WHERE s.tenant = operations.tenant AND s.comp_key = operations.op_key) \
     AND NOT EXISTS (SELECT 1 FROM workflow_items i WHERE i.tenant = operations.tenant AND i.op_key = operations.op_key) \
     AND NOT EXISTS (SELECT 1 FROM workflow_items i WHERE i.tenant = operations.tenant AND i.comp_key = operations.op_key) \
     ORDER BY expires_at LIMIT $2"
);

/// Every background query by name.
pub(crate) const BACKGROUND: [(&str, &str); 4] = [
    ("expire_leases", EXPIRE_LEASES),
    ("due_executions", DUE_EXECUTIONS),
    ("due_reconciliations", DUE_RECONCILIATIONS),
    ("sweep", SWEEP),
];

/// Expands the shared statements for one backend. `$Conn` is its connection type.
macro_rules! sql_ops {
    ($Conn:ty) => {
        use $crate::row::{operation_columns, ApiKeyRow, EventRow, OperationRow};
        use $crate::{AcquireOutcome, CompleteOutcome, CompleteRequest, ListFilter, Page, StoreError};
        use idem_core::{
            plan_acquire, plan_completion, plan_lease_expiry, AcquireInput, OperationEvent, OperationRecord,
            RetryPolicy,
        };

        fn json_text(v: &serde_json::Value) -> String {
            v.to_string()
        }

        pub(crate) async fn load(conn: &mut $Conn, tenant: &str, key: &str) -> Result<Option<OperationRecord>, StoreError> {
            let sql = concat!("SELECT ", operation_columns!(), " FROM operations WHERE tenant = $1 AND op_key = $2");
            let row: Option<OperationRow> = sqlx::query_as(sql).bind(tenant).bind(key).fetch_optional(&mut *conn).await?;
            row.map(OperationRow::into_record).transpose()
        }

        /// Inserts a new record; false if the key already exists (another writer won).
        pub(crate) async fn insert_new(conn: &mut $Conn, r: &OperationRecord) -> Result<bool, StoreError> {
            let done = sqlx::query(
                "INSERT INTO operations (tenant, op_key, action, fingerprint, payload, state, attempt_count, \
                 lease_owner, lease_expires_at, fencing_token, next_attempt_at, provider_ref, result, error_class, \
                 error_message, verified_at, evidence_source, needs_review, redo_safe, created_at, updated_at, \
                 completed_at, expires_at, version, connector, lookup_attempts, lease_holder) \
                 VALUES ($1,$2,$3,$4,$5,$6,$7,$8,$9,$10,$11,$12,$13,$14,$15,$16,$17,$18,$19,$20,$21,$22,$23,$24,$25,$26,$27) \
                 ON CONFLICT (tenant, op_key) DO NOTHING",
            )
            .bind(&r.tenant)
            .bind(&r.key)
            .bind(&r.action)
            .bind(&r.fingerprint)
            .bind(json_text(&r.payload))
            .bind(r.state.as_str())
            .bind(r.attempt_count)
            .bind(&r.lease_owner)
            .bind(r.lease_expires_at)
            .bind(r.fencing_token)
            .bind(r.next_attempt_at)
            .bind(&r.provider_ref)
            .bind(r.result.as_ref().map(json_text))
            .bind(&r.error_class)
            .bind(&r.error_message)
            .bind(r.verified_at)
            .bind(&r.evidence_source)
            .bind(r.needs_review)
            .bind(r.redo_safe)
            .bind(r.created_at)
            .bind(r.updated_at)
            .bind(r.completed_at)
            .bind(r.expires_at)
            .bind(r.version)
            .bind(&r.connector)
            .bind(r.lookup_attempts)
            .bind(&r.lease_holder)
            .execute(&mut *conn)
            .await?;
            Ok(done.rows_affected() == 1)
        }

        /// Writes every mutable field of `r` if the stored version is still `read_version`.
        pub(crate) async fn update_cas(conn: &mut $Conn, r: &OperationRecord, read_version: i64) -> Result<bool, StoreError> {
            let done = sqlx::query(
                "UPDATE operations SET state = $1, attempt_count = $2, lease_owner = $3, lease_expires_at = $4, \
                 fencing_token = $5, next_attempt_at = $6, provider_ref = $7, result = $8, error_class = $9, \
                 error_message = $10, verified_at = $11, evidence_source = $12, needs_review = $13, \
                 updated_at = $14, completed_at = $15, expires_at = $16, version = $17, lookup_attempts = $18, \
                 lease_holder = $19 WHERE tenant = $20 AND op_key = $21 AND version = $22",
            )
            .bind(r.state.as_str())
            .bind(r.attempt_count)
            .bind(&r.lease_owner)
            .bind(r.lease_expires_at)
            .bind(r.fencing_token)
            .bind(r.next_attempt_at)
            .bind(&r.provider_ref)
            .bind(r.result.as_ref().map(json_text))
            .bind(&r.error_class)
            .bind(&r.error_message)
            .bind(r.verified_at)
            .bind(&r.evidence_source)
            .bind(r.needs_review)
            .bind(r.updated_at)
            .bind(r.completed_at)
            .bind(r.expires_at)
            .bind(r.version)
            .bind(r.lookup_attempts)
            .bind(&r.lease_holder)
            .bind(&r.tenant)
            .bind(&r.key)
            .bind(read_version)
            .execute(&mut *conn)
            .await?;
            Ok(done.rows_affected() == 1)
        }

        pub(crate) async fn append_event(conn: &mut $Conn, e: &OperationEvent) -> Result<(), StoreError> {
            let done = sqlx::query(
                "INSERT INTO operation_events (tenant, op_key, at, kind, principal, request_id, from_state, \
                 to_state, fencing_token, fingerprint, reason, error_class, wait_ms) \
                 VALUES ($1,$2,$3,$4,$5,$6,$7,$8,$9,$10,$11,$12,$13)",
            )
            .bind(&e.tenant)
            .bind(&e.key)
            .bind(e.at)
            .bind(&e.kind)
            .bind(&e.principal)
            .bind(&e.request_id)
            .bind(e.from_state.map(|s| s.as_str()))
            .bind(e.to_state.map(|s| s.as_str()))
            .bind(e.fencing_token)
            .bind(&e.fingerprint)
            .bind(&e.reason)
            .bind(&e.error_class)
            .bind(e.wait_ms)
            .execute(&mut *conn)
            .await?;
            crate::error::stored("an operation event", done.rows_affected(), 1)
        }

        /// One try of an acquire inside the caller's transaction; `None` = lost a race, retry.
        pub(crate) async fn acquire_once(conn: &mut $Conn, input: &AcquireInput, now_ms: i64) -> Result<Option<AcquireOutcome>, StoreError> {
            let existing = load(conn, &input.tenant, &input.key).await?;
            if existing.is_none()
                && let Some(t) = load_tombstone(conn, &input.tenant, &idem_core::retention::key_hash(&input.key)).await?
                && let Some(late) = idem_core::plan_late_arrival(&t, input, now_ms)
            {
                return Ok(Some(AcquireOutcome { decision: late.decision, record: late.record }));
            }
            let plan = plan_acquire(existing.as_ref(), input, now_ms);
            if plan.changed {
                let won = match &existing {
                    None => insert_new(conn, &plan.record).await?,
                    Some(prev) => update_cas(conn, &plan.record, prev.version).await?,
                };
                if !won {
                    return Ok(None);
                }
            }
            for e in &plan.events {
                append_event(conn, e).await?;
            }
            Ok(Some(AcquireOutcome { decision: plan.decision, record: plan.record }))
        }

        /// One try of a completion inside the caller's transaction; `None` = lost a race, retry.
        pub(crate) async fn complete_once(
            conn: &mut $Conn,
            req: &CompleteRequest,
            policy: &RetryPolicy,
            retention: &idem_core::Retention,
            jitter: f64,
            now_ms: i64,
        ) -> Result<Option<CompleteOutcome>, StoreError> {
            let Some(rec) = load(conn, &req.tenant, &req.key).await? else {
                return Err(StoreError::NotFound);
            };
            let policy = req.policy.as_ref().unwrap_or(policy);
            let mut plan = plan_completion(&rec, req.fencing_token, &req.outcome, &req.actor, policy, jitter, now_ms)?;
            if plan.changed {
                retention.apply(&mut plan.record);
            }
            if plan.changed && !update_cas(conn, &plan.record, rec.version).await? {
                return Ok(None);
            }
            if let Some(e) = &plan.event {
                append_event(conn, e).await?;
            }
            Ok(Some(CompleteOutcome { record: plan.record, changed: plan.changed }))
        }

        /// Turns up to `limit` expired leases into UNKNOWN; returns how many changed.
        pub(crate) async fn expire_leases(conn: &mut $Conn, now_ms: i64, limit: i64) -> Result<u64, StoreError> {
            let sql = $crate::sql::EXPIRE_LEASES;
            let rows: Vec<OperationRow> = sqlx::query_as(sql).bind(now_ms).bind(limit).fetch_all(&mut *conn).await?;
            let mut changed = 0;
            for row in rows {
                let rec = row.into_record()?;
                if let Some((next, ev)) = plan_lease_expiry(&rec, now_ms)
                    && update_cas(conn, &next, rec.version).await?
                {
                    append_event(conn, &ev).await?;
                    changed += 1;
                }
            }
            Ok(changed)
        }

        /// Connector operations due for an attempt: PENDING whose next attempt is due, and
        /// EXECUTING redo_safe ones whose lease expired; oldest due first. Connectors named
        /// `lookup:…` only look up (the caller performs the effect) and are never due.
        pub(crate) async fn due_executions(conn: &mut $Conn, connector: &str, now_ms: i64, limit: i64) -> Result<Vec<OperationRecord>, StoreError> {
            let sql = $crate::sql::DUE_EXECUTIONS;
            let rows: Vec<OperationRow> = sqlx::query_as(sql).bind(now_ms).bind(limit).bind(connector).fetch_all(&mut *conn).await?;
            rows.into_iter().map(OperationRow::into_record).collect()
        }

        /// UNKNOWN operations not yet flagged for review whose next lookup is due.
        pub(crate) async fn due_reconciliations(conn: &mut $Conn, now_ms: i64, limit: i64) -> Result<Vec<OperationRecord>, StoreError> {
            let sql = $crate::sql::DUE_RECONCILIATIONS;
            let rows: Vec<OperationRow> = sqlx::query_as(sql).bind(now_ms).bind(limit).fetch_all(&mut *conn).await?;
            rows.into_iter().map(OperationRow::into_record).collect()
        }

        /// One try of a reconciliation; `Ok(None)` = lost a race, retry; the inner `None` =
        /// the record is in no state to be reconciled (returned unchanged).
        pub(crate) async fn reconcile_once(
            conn: &mut $Conn,
            req: &$crate::ReconcileRequest,
            retention: &idem_core::Retention,
            jitter: f64,
            now_ms: i64,
        ) -> Result<Option<$crate::ReconcileOutcome>, StoreError> {
            let Some(rec) = load(conn, &req.tenant, &req.key).await? else {
                return Err(StoreError::NotFound);
            };
            let Some((mut next, ev)) = idem_core::plan_reconciliation(&rec, &req.lookup, &req.actor, &req.policy, req.max_lookups, jitter, now_ms) else {
                return Ok(Some($crate::ReconcileOutcome { record: rec, changed: false }));
            };
            retention.apply(&mut next);
            if !update_cas(conn, &next, rec.version).await? {
                return Ok(None);
            }
            append_event(conn, &ev).await?;
            Ok(Some($crate::ReconcileOutcome { record: next, changed: true }))
        }

        /// One try of a lease renewal; `None` = lost a race, retry.
        pub(crate) async fn renew_once(conn: &mut $Conn, req: &$crate::RenewRequest, now_ms: i64) -> Result<Option<OperationRecord>, StoreError> {
            let Some(rec) = load(conn, &req.tenant, &req.key).await? else {
                return Err(StoreError::NotFound);
            };
            let (next, ev) = idem_core::plan_renewal(&rec, req.fencing_token, req.lease_ms, &req.actor, now_ms)?;
            if !update_cas(conn, &next, rec.version).await? {
                return Ok(None);
            }
            append_event(conn, &ev).await?;
            Ok(Some(next))
        }

        /// One try of an operator's resolution; `None` = lost a race, retry.
        pub(crate) async fn resolve_once(conn: &mut $Conn, req: &$crate::ResolveRequest, retention: &idem_core::Retention, now_ms: i64) -> Result<Option<OperationRecord>, StoreError> {
            let Some(rec) = load(conn, &req.tenant, &req.key).await? else {
                return Err(StoreError::NotFound);
            };
            let (mut next, ev) = idem_core::plan_resolution(&rec, req.to, req.expected_state, &req.reason, req.evidence.as_deref(), &req.actor, now_ms)?;
            retention.apply(&mut next);
            if !update_cas(conn, &next, rec.version).await? {
                return Ok(None);
            }
            append_event(conn, &ev).await?;
            Ok(Some(next))
        }

        pub(crate) async fn load_tombstone(conn: &mut $Conn, tenant: &str, key_hash: &str) -> Result<Option<idem_core::Tombstone>, StoreError> {
            let row: Option<(String, String, String, String, i64, i64)> = sqlx::query_as(
                "SELECT tenant, key_hash, fingerprint, final_state, completed_at, expires_at FROM tombstones \
                 WHERE tenant = $1 AND key_hash = $2",
            )
            .bind(tenant)
            .bind(key_hash)
            .fetch_optional(&mut *conn)
            .await?;
            row.map(|(tenant, key_hash, fingerprint, state, completed_at, expires_at)| {
                Ok(idem_core::Tombstone {
                    tenant,
                    key_hash,
                    fingerprint,
                    final_state: crate::row::parse_state(&state)?,
                    completed_at,
                    expires_at,
                })
            })
            .transpose()
        }

        /// Removes up to `limit` expired final records (with their events), leaving a
        /// tombstone each, and up to `limit` expired tombstones. Only SUCCEEDED and FAILED
        /// records with `expires_at <= now` are touched (`idem_core::is_expired`).
        pub(crate) async fn sweep(conn: &mut $Conn, retention: &idem_core::Retention, now_ms: i64, limit: i64) -> Result<$crate::SweepOutcome, StoreError> {
            let sql = $crate::sql::SWEEP;
            let rows: Vec<OperationRow> = sqlx::query_as(sql).bind(now_ms).bind(limit).fetch_all(&mut *conn).await?;
            let mut records = 0;
            for row in rows {
                let rec = row.into_record()?;
                if !idem_core::is_expired(&rec, now_ms) {
                    continue;
                }
                let t = idem_core::Tombstone::of(&rec, retention);
                sqlx::query(
                    "INSERT INTO tombstones (tenant, key_hash, fingerprint, final_state, completed_at, expires_at) \
                     VALUES ($1,$2,$3,$4,$5,$6) ON CONFLICT (tenant, key_hash) DO UPDATE SET \
                     fingerprint = $3, final_state = $4, completed_at = $5, expires_at = $6",
                )
                .bind(&t.tenant)
                .bind(&t.key_hash)
                .bind(&t.fingerprint)
                .bind(t.final_state.as_str())
                .bind(t.completed_at)
                .bind(t.expires_at)
                .execute(&mut *conn)
                .await?;
                let gone = sqlx::query("DELETE FROM operations WHERE tenant = $1 AND op_key = $2 AND version = $3")
                    .bind(&rec.tenant)
                    .bind(&rec.key)
                    .bind(rec.version)
                    .execute(&mut *conn)
                    .await?;
                if gone.rows_affected() == 1 {
                    sqlx::query("DELETE FROM operation_events WHERE tenant = $1 AND op_key = $2")
                        .bind(&rec.tenant)
                        .bind(&rec.key)
                        .execute(&mut *conn)
                        .await?;
                    records += 1;
                }
            }
            let tombstones = sqlx::query(
                "DELETE FROM tombstones WHERE (tenant, key_hash) IN \
                 (SELECT tenant, key_hash FROM tombstones WHERE expires_at <= $1 ORDER BY expires_at LIMIT $2)",
            )
            .bind(now_ms)
            .bind(limit)
            .execute(&mut *conn)
            .await?
            .rows_affected();
            Ok($crate::SweepOutcome { records, tombstones })
        }

        /// The key's events from its current record's creation on (all of them if it has no
        /// record), allowing [`crate::EVENT_CLOCK_SKEW_MS`] for nodes whose clocks lag. A
        /// trigger answered while the sweeper removed the previous record can append its
        /// event after that record's events were deleted; such a leftover is older than
        /// the new record by at least the tombstone window (days by default), so it never
        /// shows in the new record's timeline.
        pub(crate) async fn events(conn: &mut $Conn, tenant: &str, key: &str) -> Result<Vec<OperationEvent>, StoreError> {
            let rows: Vec<EventRow> = sqlx::query_as(
                "SELECT seq, tenant, op_key, at, kind, principal, request_id, from_state, to_state, fencing_token, \
                 fingerprint, reason, error_class, wait_ms FROM operation_events \
                 WHERE tenant = $1 AND op_key = $2 \
                 AND at >= COALESCE((SELECT created_at FROM operations WHERE tenant = $1 AND op_key = $2), 0) - $3 \
                 ORDER BY seq",
            )
            .bind(tenant)
            .bind(key)
            .bind($crate::EVENT_CLOCK_SKEW_MS)
            .fetch_all(&mut *conn)
            .await?;
            rows.into_iter().map(EventRow::into_event).collect()
        }

        pub(crate) async fn list(conn: &mut $Conn, tenant: &str, f: &ListFilter) -> Result<Page, StoreError> {
            let sql = concat!(
                "SELECT ", operation_columns!(), " FROM operations WHERE tenant = $1 \
                 AND (CAST($2 AS TEXT) IS NULL OR state = $2) \
                 AND (CAST($3 AS TEXT) IS NULL OR action = $3) \
                 AND (CAST($4 AS BOOLEAN) IS NULL OR needs_review = $4) \
                 AND (CAST($5 AS BIGINT) IS NULL OR created_at < $5 OR (created_at = $5 AND op_key < $6)) \
                 AND (CAST($8 AS TEXT) IS NULL OR substr(op_key, 1, length(CAST($8 AS TEXT))) = $8) \
                 AND (CAST($9 AS BIGINT) IS NULL OR created_at >= $9) \
                 AND (CAST($10 AS BIGINT) IS NULL OR created_at < $10) \
                 ORDER BY created_at DESC, op_key DESC LIMIT $7"
            );
            let limit = f.limit.clamp(1, $crate::MAX_PAGE);
            let (after_at, after_key) = match &f.cursor {
                Some((at, key)) => (Some(*at), Some(key.as_str())),
                None => (None, None),
            };
            let rows: Vec<OperationRow> = sqlx::query_as(sql)
                .bind(tenant)
                .bind(f.state.map(|s| s.as_str()))
                .bind(f.action.as_deref())
                .bind(f.needs_review)
                .bind(after_at)
                .bind(after_key)
                .bind(limit + 1)
                .bind(f.key_prefix.as_deref().filter(|p| !p.is_empty()))
                .bind(f.created_from)
                .bind(f.created_before)
                .fetch_all(&mut *conn)
                .await?;
            let more = rows.len() as i64 > limit;
            let mut items = Vec::with_capacity(rows.len());
            for row in rows.into_iter().take(limit as usize) {
                items.push(row.into_record()?);
            }
            let next_cursor = if more { items.last().map(|r| (r.created_at, r.key.clone())) } else { None };
            Ok(Page { items, next_cursor })
        }

        /// Counts for the operator's overview: per (action, state, needs_review) of `tenant`
        /// (all tenants when `None`), UNKNOWN records unchanged since before `stale_before_ms`,
        /// and the `recent` latest mismatch (422) events of the tenant.
        pub(crate) async fn overview(
            conn: &mut $Conn,
            tenant: Option<&str>,
            stale_before_ms: i64,
            recent: i64,
        ) -> Result<$crate::Overview, StoreError> {
            let groups: Vec<(String, String, bool, i64)> = sqlx::query_as(
                "SELECT action, state, needs_review, COUNT(*) FROM operations \
                 WHERE (CAST($1 AS TEXT) IS NULL OR tenant = $1) GROUP BY action, state, needs_review \
                 ORDER BY action, state, needs_review",
            )
            .bind(tenant)
            .fetch_all(&mut *conn)
            .await?;
            let groups = groups
                .into_iter()
                .map(|(action, state, needs_review, count)| {
                    let state = crate::row::parse_state(&state)?;
                    Ok($crate::GroupCount { action, state, needs_review, count })
                })
                .collect::<Result<Vec<_>, StoreError>>()?;
            let (unknown_stale,): (i64,) = sqlx::query_as(
                "SELECT COUNT(*) FROM operations WHERE (CAST($1 AS TEXT) IS NULL OR tenant = $1) \
                 AND state = 'UNKNOWN' AND updated_at < $2",
            )
            .bind(tenant)
            .bind(stale_before_ms)
            .fetch_one(&mut *conn)
            .await?;
            let rows: Vec<EventRow> = sqlx::query_as(
                "SELECT seq, tenant, op_key, at, kind, principal, request_id, from_state, to_state, fencing_token, \
                 fingerprint, reason, error_class, wait_ms FROM operation_events \
                 WHERE (CAST($1 AS TEXT) IS NULL OR tenant = $1) AND kind = 'mismatch' ORDER BY seq DESC LIMIT $2",
            )
            .bind(tenant)
            .bind(recent.clamp(0, $crate::MAX_PAGE))
            .fetch_all(&mut *conn)
            .await?;
            let recent_mismatches = rows.into_iter().map(EventRow::into_event).collect::<Result<Vec<_>, _>>()?;
            Ok($crate::Overview { groups, unknown_stale, recent_mismatches })
        }

        pub(crate) async fn insert_api_key(
            conn: &mut $Conn,
            info: &$crate::keys::ApiKeyInfo,
            key_hash: &str,
        ) -> Result<(), StoreError> {
            let done = sqlx::query(
                "INSERT INTO api_keys (id, key_hash, tenant, principal, role, created_at, revoked_at) \
                 VALUES ($1,$2,$3,$4,$5,$6,NULL) ON CONFLICT (key_hash) DO NOTHING",
            )
            .bind(&info.id)
            .bind(key_hash)
            .bind(&info.tenant)
            .bind(&info.principal)
            .bind(info.role.as_str())
            .bind(info.created_at)
            .execute(&mut *conn)
            .await?;
            if done.rows_affected() != 1 {
                return Err(StoreError::Invalid("an API key with that secret already exists".into()));
            }
            Ok(())
        }

        pub(crate) async fn find_api_key(conn: &mut $Conn, key_hash: &str) -> Result<Option<$crate::keys::ApiKeyInfo>, StoreError> {
            let sql = "SELECT id, tenant, principal, role, created_at, revoked_at FROM api_keys \
                       WHERE key_hash = $1 AND revoked_at IS NULL";
            let row: Option<ApiKeyRow> = sqlx::query_as(sql).bind(key_hash).fetch_optional(&mut *conn).await?;
            row.map(ApiKeyRow::into_info).transpose()
        }

        pub(crate) async fn list_api_keys(conn: &mut $Conn, tenant: Option<&str>) -> Result<Vec<$crate::keys::ApiKeyInfo>, StoreError> {
            let sql = "SELECT id, tenant, principal, role, created_at, revoked_at FROM api_keys \
                       WHERE CAST($1 AS TEXT) IS NULL OR tenant = $1 ORDER BY created_at, id";
            let rows: Vec<ApiKeyRow> = sqlx::query_as(sql).bind(tenant).fetch_all(&mut *conn).await?;
            rows.into_iter().map(ApiKeyRow::into_info).collect()
        }

        pub(crate) async fn revoke_api_key(conn: &mut $Conn, id: &str, now_ms: i64) -> Result<bool, StoreError> {
            let done = sqlx::query("UPDATE api_keys SET revoked_at = $1 WHERE id = $2 AND revoked_at IS NULL")
                .bind(now_ms)
                .bind(id)
                .execute(&mut *conn)
                .await?;
            Ok(done.rows_affected() == 1)
        }

        /// The check and the write of `revoke_api_key_keeping_an_admin`; the caller makes
        /// them atomic (a transaction holding the tenant's key lock, or SQLite's writer).
        pub(crate) async fn revoke_keeping_an_admin(
            conn: &mut $Conn,
            tenant: &str,
            id: &str,
            now_ms: i64,
        ) -> Result<crate::keys::Revocation, StoreError> {
            use crate::keys::Revocation;
            let role: Option<(String,)> =
                sqlx::query_as("SELECT role FROM api_keys WHERE id = $1 AND tenant = $2 AND revoked_at IS NULL")
                    .bind(id)
                    .bind(tenant)
                    .fetch_optional(&mut *conn)
                    .await?;
            let Some((role,)) = role else { return Ok(Revocation::NotFound) };
            if role == "admin" {
                let (others,): (i64,) = sqlx::query_as(
                    "SELECT COUNT(*) FROM api_keys WHERE tenant = $1 AND role = 'admin' AND revoked_at IS NULL AND id <> $2",
                )
                .bind(tenant)
                .bind(id)
                .fetch_one(&mut *conn)
                .await?;
                if others == 0 {
                    return Ok(Revocation::LastAdmin);
                }
            }
            Ok(if revoke_api_key(conn, id, now_ms).await? { Revocation::Revoked } else { Revocation::NotFound })
        }

        pub(crate) async fn count_api_keys(conn: &mut $Conn) -> Result<i64, StoreError> {
            let (n,): (i64,) = sqlx::query_as("SELECT COUNT(*) FROM api_keys").fetch_one(&mut *conn).await?;
            Ok(n)
        }
    };
}

pub(crate) use sql_ops;
