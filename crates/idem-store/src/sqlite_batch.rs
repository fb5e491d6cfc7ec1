//! Group commit for the hot path: a run of acquires and completions written with a
//! handful of statements, however many requests it holds.
//!
//! The writer task holds SQLite's write lock for the whole batch (`BEGIN IMMEDIATE`), so
//! what it reads cannot change under it. A segment therefore:
//! 1. reads every record it touches with one `SELECT … WHERE (tenant, op_key) IN (VALUES …)`
//!    (and the tombstones of the keys that have no record, if any tombstone exists);
//! 2. applies each request *in order* to that in-memory view with idem-core's pure plans
//!    (`plan_acquire`, `plan_completion`, `plan_late_arrival`), so two requests for one key
//!    in one batch see each other exactly as if run one by one;
//! 3. writes the changed records with one multi-row upsert and the events with one
//!    multi-row insert.
//!
//! Answers are the same as the one-request-at-a-time path (`sql_ops!`), which the
//! conformance suite checks; a database error fails the segment, and the caller retries
//! its requests one by one so one bad request cannot fail the others.

use crate::row::{OperationRow, operation_columns};
use crate::{AcquireOutcome, CompleteOutcome, CompleteRequest, StoreConfig, StoreError};
use idem_core::retention::key_hash;
use idem_core::{
    AcquireInput, OperationEvent, OperationRecord, Tombstone, plan_acquire, plan_completion, plan_late_arrival,
};
use sqlx::{QueryBuilder, Sqlite, SqliteConnection};
use std::collections::HashMap;

/// A hot request.
pub(crate) enum Hot<'a> {
    Acquire(&'a AcquireInput),
    Complete(&'a CompleteRequest),
}

/// Its answer.
pub(crate) enum HotResult {
    Acquire(Result<AcquireOutcome, StoreError>),
    Complete(Result<CompleteOutcome, StoreError>),
}

/// Rows per multi-row statement (SQLite allows 32 766 bound values; 26 columns × 500).
const CHUNK: usize = 500;

type Key = (String, String);

fn key_of(h: &Hot<'_>) -> Key {
    match h {
        Hot::Acquire(i) => (i.tenant.clone(), i.key.clone()),
        Hot::Complete(c) => (c.tenant.clone(), c.key.clone()),
    }
}

async fn load_all(conn: &mut SqliteConnection, keys: &[Key]) -> Result<HashMap<Key, OperationRecord>, StoreError> {
    let mut out = HashMap::with_capacity(keys.len());
    for chunk in keys.chunks(CHUNK) {
        let mut q: QueryBuilder<Sqlite> =
            QueryBuilder::new(concat!("SELECT ", operation_columns!(), " FROM operations WHERE (tenant, op_key) IN ("));
        q.push_values(chunk, |mut b, (t, k)| {
            b.push_bind(t.clone()).push_bind(k.clone());
        });
        q.push(")");
        let rows: Vec<OperationRow> = q.build_query_as().fetch_all(&mut *conn).await?;
        for row in rows {
            let rec = row.into_record()?;
            out.insert((rec.tenant.clone(), rec.key.clone()), rec);
        }
    }
    Ok(out)
}

async fn load_tombstones(conn: &mut SqliteConnection, keys: &[Key]) -> Result<HashMap<Key, Tombstone>, StoreError> {
    let mut out = HashMap::new();
    let (any,): (bool,) = sqlx::query_as("SELECT EXISTS (SELECT 1 FROM tombstones)").fetch_one(&mut *conn).await?;
    if !any || keys.is_empty() {
        return Ok(out);
    }
    for chunk in keys.chunks(CHUNK) {
        let mut q: QueryBuilder<Sqlite> = QueryBuilder::new(
            "SELECT tenant, key_hash, fingerprint, final_state, completed_at, expires_at FROM tombstones WHERE (tenant, key_hash) IN (",
        );
        q.push_values(chunk, |mut b, (t, k)| {
            b.push_bind(t.clone()).push_bind(key_hash(k));
        });
        q.push(")");
        let rows: Vec<(String, String, String, String, i64, i64)> = q.build_query_as().fetch_all(&mut *conn).await?;
        let by_hash: HashMap<(String, String), &Key> =
            chunk.iter().map(|k| ((k.0.clone(), key_hash(&k.1)), k)).collect();
        for (tenant, hash, fingerprint, state, completed_at, expires_at) in rows {
            let Some(key) = by_hash.get(&(tenant.clone(), hash.clone())) else { continue };
            let final_state =
                state.parse().map_err(|e: idem_core::state::ParseStateError| StoreError::Corrupt(e.to_string()))?;
            out.insert(
                (*key).clone(),
                Tombstone { tenant, key_hash: hash, fingerprint, final_state, completed_at, expires_at },
            );
        }
    }
    Ok(out)
}

async fn upsert(conn: &mut SqliteConnection, records: &[&OperationRecord]) -> Result<(), StoreError> {
    for chunk in records.chunks(CHUNK) {
        let mut q: QueryBuilder<Sqlite> = QueryBuilder::new(
            "INSERT INTO operations (tenant, op_key, action, fingerprint, payload, state, attempt_count, lease_owner, \
             lease_expires_at, fencing_token, next_attempt_at, provider_ref, result, error_class, error_message, verified_at, \
             evidence_source, needs_review, redo_safe, created_at, updated_at, completed_at, expires_at, version, connector, \
             lookup_attempts) ",
        );
        q.push_values(chunk, |b, r| crate::row::bind_record(b, r));
        q.push(
            " ON CONFLICT (tenant, op_key) DO UPDATE SET state = excluded.state, attempt_count = excluded.attempt_count, \
             lease_owner = excluded.lease_owner, lease_expires_at = excluded.lease_expires_at, \
             fencing_token = excluded.fencing_token, next_attempt_at = excluded.next_attempt_at, \
             provider_ref = excluded.provider_ref, result = excluded.result, error_class = excluded.error_class, \
             error_message = excluded.error_message, verified_at = excluded.verified_at, \
             evidence_source = excluded.evidence_source, needs_review = excluded.needs_review, \
             updated_at = excluded.updated_at, completed_at = excluded.completed_at, expires_at = excluded.expires_at, \
             version = excluded.version, lookup_attempts = excluded.lookup_attempts",
        );
        q.build().execute(&mut *conn).await?;
    }
    Ok(())
}

async fn insert_events(conn: &mut SqliteConnection, events: &[OperationEvent]) -> Result<(), StoreError> {
    for chunk in events.chunks(CHUNK) {
        let mut q: QueryBuilder<Sqlite> = QueryBuilder::new(
            "INSERT INTO operation_events (tenant, op_key, at, kind, principal, request_id, from_state, to_state, \
             fencing_token, fingerprint, reason, error_class, wait_ms) ",
        );
        q.push_values(chunk, |b, e| crate::row::bind_event(b, e));
        q.build().execute(&mut *conn).await?;
    }
    Ok(())
}

/// Runs `reqs` in order against one read of their records and writes the result with a
/// few statements. `Err` only for database failures (the caller then retries one by one).
pub(crate) async fn run_segment(
    conn: &mut SqliteConnection,
    reqs: &[Hot<'_>],
    config: &StoreConfig,
    now_ms: i64,
) -> Result<Vec<HotResult>, StoreError> {
    let mut keys: Vec<Key> = reqs.iter().map(key_of).collect();
    keys.sort();
    keys.dedup();
    let mut records = load_all(conn, &keys).await?;
    let missing: Vec<Key> = keys.iter().filter(|k| !records.contains_key(*k)).cloned().collect();
    let tombstones = load_tombstones(conn, &missing).await?;
    let mut dirty: Vec<Key> = Vec::new();
    let mut events = Vec::new();
    let mut results = Vec::with_capacity(reqs.len());
    for req in reqs {
        let key = key_of(req);
        match req {
            Hot::Acquire(input) => {
                let existing = records.get(&key);
                if existing.is_none()
                    && let Some(late) = tombstones.get(&key).and_then(|t| plan_late_arrival(t, input, now_ms))
                {
                    results
                        .push(HotResult::Acquire(Ok(AcquireOutcome { decision: late.decision, record: late.record })));
                    continue;
                }
                let plan = plan_acquire(existing, input, now_ms);
                events.extend(plan.events);
                if plan.changed {
                    records.insert(key.clone(), plan.record.clone());
                    dirty.push(key);
                }
                results.push(HotResult::Acquire(Ok(AcquireOutcome { decision: plan.decision, record: plan.record })));
            }
            Hot::Complete(req) => {
                let Some(rec) = records.get(&key) else {
                    results.push(HotResult::Complete(Err(StoreError::NotFound)));
                    continue;
                };
                let policy = req.policy.as_ref().unwrap_or(&config.retry_policy);
                match plan_completion(rec, req.fencing_token, &req.outcome, &req.actor, policy, crate::jitter(), now_ms)
                {
                    Err(e) => results.push(HotResult::Complete(Err(e.into()))),
                    Ok(mut plan) => {
                        if plan.changed {
                            config.retention.apply(&mut plan.record);
                            records.insert(key.clone(), plan.record.clone());
                            dirty.push(key);
                        }
                        events.extend(plan.event);
                        results.push(HotResult::Complete(Ok(CompleteOutcome {
                            record: plan.record,
                            changed: plan.changed,
                        })));
                    }
                }
            }
        }
    }
    dirty.sort();
    dirty.dedup();
    let changed: Vec<&OperationRecord> = dirty.iter().filter_map(|k| records.get(k)).collect();
    upsert(conn, &changed).await?;
    insert_events(conn, &events).await?;
    Ok(results)
}
