//! Group commit for the hot path: a run of acquires and completions written with a
//! handful of statements, however many requests it holds.
//!
//! The writer task holds SQLite's write lock for the whole batch (`BEGIN IMMEDIATE`), so
//! what it reads cannot change under it. A segment therefore:
//! 1. reads every record it touches with one `SELECT` joining the keys (`json_each`) to the
//!    `(tenant, op_key)` index
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

use crate::record_cache::RecordCache;
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

impl Hot<'_> {
    /// `(tenant, key)` of the request.
    pub(crate) fn key(&self) -> (&str, &str) {
        match self {
            Hot::Acquire(i) => (&i.tenant, &i.key),
            Hot::Complete(c) => (&c.tenant, &c.key),
        }
    }
}

/// Its answer.
pub(crate) enum HotResult {
    Acquire(Result<AcquireOutcome, StoreError>),
    Complete(Result<CompleteOutcome, StoreError>),
}

/// Rows per multi-row statement (SQLite allows 32 766 bound values; 27 columns × 500).
const CHUNK: usize = 500;

type Key = (String, String);

pub(crate) const UPSERT_HEAD: &str = concat!("INSERT INTO operations (", crate::row::record_bind_columns!(), ") ");
pub(crate) const UPSERT_TAIL: &str = " ON CONFLICT (tenant, op_key) DO UPDATE SET state = excluded.state, \
     attempt_count = excluded.attempt_count, lease_owner = excluded.lease_owner, \
     lease_expires_at = excluded.lease_expires_at, fencing_token = excluded.fencing_token, \
     next_attempt_at = excluded.next_attempt_at, provider_ref = excluded.provider_ref, result = excluded.result, \
     error_class = excluded.error_class, error_message = excluded.error_message, verified_at = excluded.verified_at, \
     evidence_source = excluded.evidence_source, needs_review = excluded.needs_review, \
     updated_at = excluded.updated_at, completed_at = excluded.completed_at, expires_at = excluded.expires_at, \
     version = excluded.version, lookup_attempts = excluded.lookup_attempts, lease_holder = excluded.lease_holder";
pub(crate) const EVENTS_HEAD: &str = concat!("INSERT INTO operation_events (", crate::row::event_bind_columns!(), ") ");
/// The records of a JSON array of `[tenant, op_key]` pairs (`?`). The array is the outer
/// loop (`CROSS JOIN` keeps it there) and each pair is one probe of the UNIQUE (tenant,
/// op_key) index. A row-value `IN (VALUES …)` made SQLite build and zero an ephemeral
/// B-tree per statement: 12 % of a pair's instructions (929 000 -> 816 000 per pair under
/// scripts/callgrind.sh).
macro_rules! read_records {
    () => {
        concat!(
            "SELECT ",
            operation_columns!(),
            " FROM json_each(?) AS j CROSS JOIN operations WHERE tenant = j.value ->> 0 AND op_key = j.value ->> 1"
        )
    };
}
/// The tombstones of a JSON array of `[tenant, key_hash]` pairs (`?`), the same way.
macro_rules! read_tombstones {
    () => {
        "SELECT tenant, key_hash, fingerprint, final_state, completed_at, expires_at \
         FROM json_each(?) AS j CROSS JOIN tombstones WHERE tenant = j.value ->> 0 AND key_hash = j.value ->> 1"
    };
}
/// The hot path's reads by name, for `testing::hot_read_plans_sqlite`.
pub(crate) const HOT_READS: [(&str, &str); 2] = [("records", read_records!()), ("tombstones", read_tombstones!())];
/// The first round trip of [`run_batch`]: the write lock, `data_version` (has another
/// connection committed since this one last looked?), the records, the tombstones.
const BATCH_READ: &str = concat!("BEGIN IMMEDIATE; PRAGMA data_version; ", read_records!(), "; ", read_tombstones!());
/// Triggers on idem's two hot tables (idem puts none there).
const HOT_TABLE_TRIGGERS: &str = "SELECT count(*) FROM sqlite_schema \
     WHERE type = 'trigger' AND tbl_name IN ('operations', 'operation_events')";

/// The writer's [`RecordCache`] and the `PRAGMA data_version` it is valid for.
///
/// The writer connection is the only one of its process that writes, and it holds the
/// write lock for a whole batch, so a record it committed (or read under the lock) stays
/// the database's record until another connection commits (another process on the same
/// file: `data_version` changes, <https://www.sqlite.org/pragma.html#pragma_data_version>)
/// or a command outside the hot path writes it (the writer calls [`Self::invalidate`]
/// after any such command that changed a row: `total_changes()` moved). A batch checks
/// `data_version` under the write lock before it plans with a cached record, and re-reads
/// the keys it took from the cache when it changed. idem puts no triggers on `operations` or `operation_events`; while someone
/// else's trigger is there (it could change a row during the writer's own commit), the
/// cache is not used at all (creating one is a commit by another connection, so the next
/// batch looks: [`HOT_TABLE_TRIGGERS`] runs whenever `data_version` moved). Saves
/// the read of the record a completion (or a replay) names: ~40 000 instructions per
/// completion (scripts/callgrind.sh).
#[derive(Debug)]
pub(crate) struct WriterCache {
    records: RecordCache,
    data_version: Option<i64>,
}

/// Records the SQLite writer keeps: enough for the completions of a few hundred leases in
/// flight and the keys being replayed. A miss costs one read; memory counts against the
/// server's budget (2 048 records added ~7 MiB to the peak RSS under `idem bench`).
const WRITER_CACHE_ENTRIES: usize = 1024;

impl Default for WriterCache {
    fn default() -> Self {
        WriterCache { records: RecordCache::new(WRITER_CACHE_ENTRIES), data_version: None }
    }
}

impl WriterCache {
    /// Forgets everything: the next batch reads every record it needs.
    pub(crate) fn invalidate(&mut self) {
        self.records.clear();
        self.data_version = None;
    }

    /// Forgets the record of `(tenant, key)`.
    pub(crate) fn forget(&self, tenant: &str, key: &str) {
        self.records.forget(tenant, key);
    }
}

/// `[[tenant, key], …]` as JSON text, the parameter of `read_records!` and
/// `read_tombstones!`.
fn pairs_json<'a>(pairs: impl Iterator<Item = (&'a str, &'a str)>) -> String {
    serde_json::to_string(&pairs.collect::<Vec<_>>()).expect("strings serialize")
}

fn key_of(h: &Hot<'_>) -> Key {
    let (tenant, key) = h.key();
    (tenant.to_owned(), key.to_owned())
}

async fn load_all(conn: &mut SqliteConnection, keys: &[Key]) -> Result<HashMap<Key, OperationRecord>, StoreError> {
    let list = pairs_json(keys.iter().map(|(t, k)| (t.as_str(), k.as_str())));
    let rows: Vec<OperationRow> = sqlx::query_as(read_records!()).bind(list).fetch_all(&mut *conn).await?;
    let mut out = HashMap::with_capacity(rows.len());
    for row in rows {
        let rec = row.into_record()?;
        out.insert((rec.tenant.clone(), rec.key.clone()), rec);
    }
    Ok(out)
}

async fn load_tombstones(conn: &mut SqliteConnection, keys: &[Key]) -> Result<HashMap<Key, Tombstone>, StoreError> {
    let mut out = HashMap::new();
    let (any,): (bool,) = sqlx::query_as("SELECT EXISTS (SELECT 1 FROM tombstones)").fetch_one(&mut *conn).await?;
    if !any || keys.is_empty() {
        return Ok(out);
    }
    let hashes: Vec<String> = keys.iter().map(|(_, k)| key_hash(k)).collect();
    let list = pairs_json(keys.iter().zip(&hashes).map(|((t, _), h)| (t.as_str(), h.as_str())));
    let rows: Vec<(String, String, String, String, i64, i64)> =
        sqlx::query_as(read_tombstones!()).bind(list).fetch_all(&mut *conn).await?;
    let by_hash: HashMap<(&str, &str), &Key> =
        keys.iter().zip(&hashes).map(|(k, h)| ((k.0.as_str(), h.as_str()), k)).collect();
    for (tenant, hash, fingerprint, state, completed_at, expires_at) in rows {
        let Some(key) = by_hash.get(&(tenant.as_str(), hash.as_str())).copied() else { continue };
        let final_state =
            state.parse().map_err(|e: idem_core::state::ParseStateError| StoreError::Corrupt(e.to_string()))?;
        out.insert(
            key.clone(),
            Tombstone { tenant, key_hash: hash, fingerprint, final_state, completed_at, expires_at },
        );
    }
    Ok(out)
}

async fn upsert(conn: &mut SqliteConnection, records: &[&OperationRecord]) -> Result<(), StoreError> {
    for chunk in records.chunks(CHUNK) {
        let mut q: QueryBuilder<Sqlite> = QueryBuilder::new(UPSERT_HEAD);
        q.push_values(chunk, |b, r| crate::row::bind_record(b, r));
        q.push(UPSERT_TAIL);
        q.build().execute(&mut *conn).await?;
    }
    Ok(())
}

async fn insert_events(conn: &mut SqliteConnection, events: &[OperationEvent]) -> Result<(), StoreError> {
    for chunk in events.chunks(CHUNK) {
        let mut q: QueryBuilder<Sqlite> = QueryBuilder::new(EVENTS_HEAD);
        q.push_values(chunk, crate::row::bind_event);
        q.build().execute(&mut *conn).await?;
    }
    Ok(())
}

/// What a segment writes and answers: the pure plans applied in order to one read.
struct Planned {
    results: Vec<HotResult>,
    changed: Vec<OperationRecord>,
    events: Vec<OperationEvent>,
}

/// Applies `reqs` in order to `records` (and, for keys without a record, their
/// tombstones) with idem-core's plans. No I/O.
fn plan(
    reqs: &[Hot<'_>],
    mut records: HashMap<Key, OperationRecord>,
    tombstones: &HashMap<Key, Tombstone>,
    config: &StoreConfig,
    now_ms: i64,
) -> Planned {
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
    let changed = dirty.iter().filter_map(|k| records.remove(k)).collect();
    Planned { results, changed, events }
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
    let records = load_all(conn, &keys).await?;
    let missing: Vec<Key> = keys.iter().filter(|k| !records.contains_key(*k)).cloned().collect();
    let tombstones = load_tombstones(conn, &missing).await?;
    let planned = plan(reqs, records, &tombstones, config, now_ms);
    let changed: Vec<&OperationRecord> = planned.changed.iter().collect();
    upsert(conn, &changed).await?;
    insert_events(conn, &planned.events).await?;
    Ok(planned.results)
}

/// The next item of a sqlx stream.
async fn next<T>(stream: &mut (impl futures_core::Stream<Item = T> + Unpin)) -> Option<T> {
    std::future::poll_fn(|cx| std::pin::Pin::new(&mut *stream).poll_next(cx)).await
}

/// How a batch went on the fast path.
pub(crate) enum Fast {
    /// `BEGIN IMMEDIATE` failed: nothing ran.
    BeginFailed(sqlx::Error),
    /// A statement failed inside the open transaction: the caller rolls back and runs
    /// the batch on the general path (savepoints, one by one on error).
    Retry(StoreError),
    /// The transaction ended: committed (`None`) or its `COMMIT` failed (`Some`).
    Done(Vec<HotResult>, Option<sqlx::Error>),
}

/// A whole batch of acquires and completions in two round trips to SQLite's thread:
/// `BEGIN IMMEDIATE` + the read of every record and tombstone, then the multi-row
/// upsert + the events + `COMMIT`. Same reads, plans and writes as [`run_segment`]; a
/// batch that only holds hot requests needs no savepoint, since on any error the whole
/// transaction is rolled back and the caller runs the batch again the general way.
///
/// sqlx runs the statements of one query string in order, binding positional `?`
/// parameters across them, and reports each statement's end (`Either::Left`), so an
/// error is attributed to the statement that raised it.
pub(crate) async fn run_batch(
    conn: &mut SqliteConnection,
    reqs: &[Hot<'_>],
    config: &StoreConfig,
    now_ms: i64,
    cache: &mut WriterCache,
    commit_seconds: impl FnOnce(f64),
) -> Fast {
    let fast = run_batch_cached(conn, reqs, config, now_ms, cache, commit_seconds).await;
    if !matches!(fast, Fast::Done(_, None)) {
        // Rolled back or not begun: what the cache took from this batch may be undone.
        cache.invalidate();
    }
    fast
}

async fn run_batch_cached(
    conn: &mut SqliteConnection,
    reqs: &[Hot<'_>],
    config: &StoreConfig,
    now_ms: i64,
    cache: &mut WriterCache,
    commit_seconds: impl FnOnce(f64),
) -> Fast {
    use sqlx::{Either, Executor, FromRow, Row};
    let mut all_keys: Vec<Key> = reqs.iter().map(key_of).collect();
    all_keys.sort();
    all_keys.dedup();
    if all_keys.len() > CHUNK {
        // Never with MAX_BATCH requests; keeps every statement within SQLite's limits.
        return Fast::Retry(StoreError::Invalid("batch too large for the fast path".into()));
    }
    // Records the cache holds are not read (if data_version says they are still true).
    let mut cached = Vec::new();
    let mut keys = Vec::with_capacity(all_keys.len());
    for k in all_keys {
        match cache.data_version.and_then(|_| cache.records.get(&k.0, &k.1)) {
            Some(r) => cached.push(r),
            None => keys.push(k),
        }
    }
    // 1. BEGIN IMMEDIATE; the records; the tombstones of the keys some acquire names
    //    (`plan` consults a tombstone only for an acquire: a completion of a key without
    //    a record is 404 either way), so a completion costs no SHA-256 of its key.
    let acquired: std::collections::HashSet<(&str, &str)> =
        reqs.iter().filter(|r| matches!(r, Hot::Acquire(_))).map(Hot::key).collect();
    let hashes: Vec<Option<String>> =
        keys.iter().map(|(t, k)| acquired.contains(&(t.as_str(), k.as_str())).then(|| key_hash(k))).collect();
    let key_list = pairs_json(keys.iter().map(|(t, k)| (t.as_str(), k.as_str())));
    let hash_list =
        pairs_json(keys.iter().zip(&hashes).filter_map(|((t, _), h)| h.as_deref().map(|h| (t.as_str(), h))));
    let q = sqlx::query(BATCH_READ).bind(key_list).bind(hash_list);
    let mut records = HashMap::with_capacity(keys.len() + cached.len());
    let mut tombstones = HashMap::new();
    let mut data_version = None;
    let mut ended = 0;
    {
        let mut stream = conn.fetch_many(q);
        loop {
            let item = match next(&mut stream).await {
                Some(Ok(item)) => item,
                None => break,
                Some(Err(e)) if ended == 0 => return Fast::BeginFailed(e),
                Some(Err(e)) => return Fast::Retry(e.into()),
            };
            let decoded = match item {
                Either::Left(_) => {
                    ended += 1;
                    Ok(())
                }
                Either::Right(row) if row.len() == 1 => {
                    row.try_get::<i64, _>(0).map(|v| data_version = Some(v)).map_err(StoreError::from)
                }
                Either::Right(row) if row.len() == 6 => <(String, String, String, String, i64, i64)>::from_row(&row)
                    .map_err(StoreError::from)
                    .and_then(|(tenant, hash, fingerprint, state, completed_at, expires_at)| {
                        let final_state = state
                            .parse()
                            .map_err(|e: idem_core::state::ParseStateError| StoreError::Corrupt(e.to_string()))?;
                        if let Some(i) = hashes.iter().position(|h| h.as_deref() == Some(hash.as_str()))
                            && keys[i].0 == tenant
                        {
                            let t = Tombstone {
                                tenant,
                                key_hash: hash,
                                fingerprint,
                                final_state,
                                completed_at,
                                expires_at,
                            };
                            tombstones.insert(keys[i].clone(), t);
                        }
                        Ok(())
                    }),
                Either::Right(row) => OperationRow::from_row(&row).map_err(StoreError::from).and_then(|r| {
                    let rec = r.into_record()?;
                    records.insert((rec.tenant.clone(), rec.key.clone()), rec);
                    Ok(())
                }),
            };
            if let Err(e) = decoded {
                return Fast::Retry(e);
            }
        }
    }
    let Some(data_version) = data_version else {
        return Fast::Retry(StoreError::Corrupt("PRAGMA data_version returned no row".into()));
    };
    if cache.data_version != Some(data_version) {
        // Another connection committed since: nothing cached can be trusted, and the keys
        // taken from the cache are read now, under the same write lock. The cache is used
        // again from this version on unless a trigger could rewrite idem's rows.
        cache.records.clear();
        let triggers: Result<i64, _> = sqlx::query_scalar(HOT_TABLE_TRIGGERS).fetch_one(&mut *conn).await;
        cache.data_version = match triggers {
            Ok(0) => Some(data_version),
            Ok(_) => None,
            Err(e) => return Fast::Retry(e.into()),
        };
        if !cached.is_empty() {
            let stale: Vec<Key> = cached.drain(..).map(|r| (r.tenant, r.key)).collect();
            match load_all(conn, &stale).await {
                Ok(found) => records.extend(found),
                Err(e) => return Fast::Retry(e),
            }
            let missing: Vec<Key> = stale.into_iter().filter(|k| !records.contains_key(k)).collect();
            match load_tombstones(conn, &missing).await {
                Ok(found) => tombstones.extend(found),
                Err(e) => return Fast::Retry(e),
            }
        }
    }
    // What was read under the write lock is the database's record: kept while the cache
    // is in use (never while a trigger may rewrite rows).
    if cache.data_version.is_some() {
        for r in records.values() {
            cache.records.put(r);
        }
    }
    for r in cached {
        records.insert((r.tenant.clone(), r.key.clone()), r);
    }
    // A tombstone counts only for a key without a record.
    tombstones.retain(|k, _| !records.contains_key(k));
    // 2. The plans, in memory.
    let planned = plan(reqs, records, &tombstones, config, now_ms);
    // 3. The upsert, the events, COMMIT.
    let mut q: QueryBuilder<Sqlite> = QueryBuilder::new("");
    let mut before_commit = 0;
    if !planned.changed.is_empty() {
        q.push(UPSERT_HEAD);
        q.push_values(&planned.changed, crate::row::bind_record);
        q.push(UPSERT_TAIL);
        q.push("; ");
        before_commit += 1;
    }
    for chunk in planned.events.chunks(CHUNK) {
        q.push(EVENTS_HEAD);
        q.push_values(chunk, crate::row::bind_event);
        q.push("; ");
        before_commit += 1;
    }
    q.push("COMMIT");
    let start = std::time::Instant::now();
    let mut ended = 0;
    let mut stream = conn.fetch_many(q.build());
    loop {
        match next(&mut stream).await {
            Some(Ok(Either::Left(_))) => ended += 1,
            Some(Ok(Either::Right(_))) => {}
            None => break,
            Some(Err(e)) if ended == before_commit => return Fast::Done(planned.results, Some(e)),
            Some(Err(e)) => return Fast::Retry(e.into()),
        }
    }
    commit_seconds(start.elapsed().as_secs_f64());
    if cache.data_version.is_some() {
        for r in &planned.changed {
            cache.records.put(r);
        }
    }
    Fast::Done(planned.results, None)
}
