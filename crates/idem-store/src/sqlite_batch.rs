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
use crate::sqlite_ffi::{Arg, Db, Statements};
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

const UPSERT_HEAD: &str = concat!("INSERT INTO operations (", crate::row::record_bind_columns!(), ") ");
const EVENTS_HEAD: &str = concat!("INSERT INTO operation_events (", crate::row::event_bind_columns!(), ") ");
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
/// The hot path's reads by name, for `testing::hot_read_plans_sqlite`: the general path's
/// reads of a key list (`json_each`) and the fast path's point reads.
pub(crate) const HOT_READS: [(&str, &str); 4] = [
    ("records", read_records!()),
    ("tombstones", read_tombstones!()),
    ("record", READ_RECORD),
    ("tombstone", READ_TOMBSTONE),
];
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
        let final_state = crate::row::parse_state(&state)?;
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
        q.push(upsert_tail());
        let done = q.build().execute(&mut *conn).await?;
        crate::error::stored("operation records", done.rows_affected(), chunk.len())?;
    }
    Ok(())
}

async fn insert_events(conn: &mut SqliteConnection, events: &[OperationEvent]) -> Result<(), StoreError> {
    for chunk in events.chunks(CHUNK) {
        let mut q: QueryBuilder<Sqlite> = QueryBuilder::new(EVENTS_HEAD);
        q.push_values(chunk, crate::row::bind_event);
        let done = q.build().execute(&mut *conn).await?;
        crate::error::stored("operation events", done.rows_affected(), chunk.len())?;
    }
    Ok(())
}

/// What a segment writes and answers: the pure plans applied in order to one read.
struct Planned {
    results: Vec<HotResult>,
    changed: Vec<OperationRecord>,
    /// The records the requests read and left as they were (the writer puts them back
    /// into its cache with the changed ones).
    unchanged: Vec<OperationRecord>,
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
    let unchanged = records.into_values().collect();
    Planned { results, changed, unchanged, events }
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

/// How a batch went on the fast path.
pub(crate) enum Fast {
    /// `BEGIN IMMEDIATE` failed: nothing ran.
    BeginFailed(String),
    /// A statement failed inside the transaction, which is rolled back: the caller runs
    /// the batch on the general path (savepoints, one by one on error).
    Retry(StoreError),
    /// The transaction ended: committed (`None`) or its `COMMIT` failed (`Some`, and what
    /// was left of it rolled back).
    Done(Vec<HotResult>, Option<String>),
}

const BEGIN: &str = "BEGIN IMMEDIATE";
const DATA_VERSION: &str = "PRAGMA data_version";
const COMMIT: &str = "COMMIT";
const ROLLBACK: &str = "ROLLBACK";
const ANY_TOMBSTONE: &str = "SELECT EXISTS (SELECT 1 FROM tombstones)";
/// One record by key: a probe of the UNIQUE (tenant, op_key) index.
pub(crate) const READ_RECORD: &str =
    concat!("SELECT ", operation_columns!(), " FROM operations WHERE tenant = ? AND op_key = ?");
/// One tombstone by key hash: a probe of its primary key.
pub(crate) const READ_TOMBSTONE: &str = "SELECT tenant, key_hash, fingerprint, final_state, completed_at, expires_at \
     FROM tombstones WHERE tenant = ? AND key_hash = ?";
/// Columns of [`crate::row::event_bind_columns!`].
const EVENT_COLUMNS: usize = column_count(crate::row::event_bind_columns!());

/// The number of columns in a comma-separated column list.
const fn column_count(list: &str) -> usize {
    let bytes = list.as_bytes();
    let (mut n, mut i) = (1, 0);
    while i < bytes.len() {
        if bytes[i] == b',' {
            n += 1;
        }
        i += 1;
    }
    n
}

/// `?, ?, …` with `n` placeholders.
fn placeholders(n: usize) -> String {
    vec!["?"; n].join(", ")
}

/// The columns a record's update changes (the upsert's `DO UPDATE SET` list), in the order
/// [`changing_args`] binds them. Everything else (key, action, fingerprint, payload,
/// connector, redo_safe, created_at) is fixed when the record is created.
const CHANGING_COLUMNS: [&str; 19] = [
    "state",
    "attempt_count",
    "lease_owner",
    "lease_expires_at",
    "fencing_token",
    "next_attempt_at",
    "provider_ref",
    "result",
    "error_class",
    "error_message",
    "verified_at",
    "evidence_source",
    "needs_review",
    "updated_at",
    "completed_at",
    "expires_at",
    "version",
    "lookup_attempts",
    "lease_holder",
];
/// The columns set once, at creation, in the order [`upsert_record`] binds them.
const FIXED_COLUMNS: [&str; 8] =
    ["tenant", "op_key", "action", "fingerprint", "payload", "redo_safe", "created_at", "connector"];

/// ` ON CONFLICT … DO UPDATE SET` of both upserts (the multi-row one of [`run_segment`]
/// and [`upsert_one`]): the changing columns only.
fn upsert_tail() -> &'static str {
    static SQL: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
        let set: Vec<String> = CHANGING_COLUMNS.iter().map(|c| format!("{c} = excluded.{c}")).collect();
        format!(" ON CONFLICT (tenant, op_key) DO UPDATE SET {}", set.join(", "))
    });
    SQL.as_str()
}

/// The upsert of one record: its fixed columns then its changing ones, and on a conflict
/// the changing ones only ([`upsert_tail`]).
pub(crate) fn upsert_one() -> &'static str {
    static SQL: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
        let columns: Vec<&str> = FIXED_COLUMNS.iter().chain(&CHANGING_COLUMNS).copied().collect();
        format!(
            "INSERT INTO operations ({}) VALUES ({}){}",
            columns.join(", "),
            placeholders(columns.len()),
            upsert_tail()
        )
    });
    SQL.as_str()
}

/// The update of a record that is there: its changing columns, by key.
pub(crate) fn update_one() -> &'static str {
    static SQL: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
        let set: Vec<String> = CHANGING_COLUMNS.iter().map(|c| format!("{c} = ?")).collect();
        format!("UPDATE operations SET {} WHERE tenant = ? AND op_key = ?", set.join(", "))
    });
    SQL.as_str()
}

/// The insert of one event.
pub(crate) fn insert_event_one() -> &'static str {
    static SQL: std::sync::LazyLock<String> =
        std::sync::LazyLock::new(|| format!("{EVENTS_HEAD}VALUES ({})", placeholders(EVENT_COLUMNS)));
    SQL.as_str()
}

/// A whole batch of acquires and completions in one transaction on the writer's own
/// connection, through SQLite's C API ([`crate::sqlite_ffi`]): `BEGIN IMMEDIATE`,
/// `data_version`, a point read per key the cache does not hold (and per tombstone an
/// acquire may need), the plans in memory, an upsert per changed record, an insert per
/// event, `COMMIT`. Same reads, plans and writes as [`run_segment`]; a batch that only
/// holds hot requests needs no savepoint, since on any error the whole transaction is
/// rolled back and the caller runs the batch again the general way. `before_commit` runs
/// right before `COMMIT` (the writer numbers its commits there, `sqlite_sync`); the
/// `COMMIT` writes the WAL, its fsync is the sync thread's.
pub(crate) fn run_batch(
    db: Db,
    stmts: &mut Statements,
    reqs: &[Hot<'_>],
    config: &StoreConfig,
    now_ms: i64,
    cache: &mut WriterCache,
    before_commit: impl FnOnce(),
) -> Fast {
    let fast = match stmts.exec(db, BEGIN, &[]) {
        Err(e) => Fast::BeginFailed(e.to_string()),
        Ok(()) => match read_and_write(db, stmts, reqs, config, now_ms, cache) {
            Err(e) => {
                rollback(db, stmts);
                Fast::Retry(e)
            }
            Ok(planned) => {
                before_commit();
                let start = std::time::Instant::now();
                match stmts.exec(db, COMMIT, &[]) {
                    Err(e) => {
                        rollback(db, stmts);
                        Fast::Done(planned.results, Some(e.to_string()))
                    }
                    Ok(()) => {
                        crate::sqlite::record_commit(start.elapsed().as_secs_f64());
                        let Planned { results, changed, unchanged, .. } = planned;
                        if cache.data_version.is_some() {
                            // What the batch read and wrote is the committed state: kept,
                            // moved (the reads took their records out of the cache).
                            for r in changed.into_iter().chain(unchanged) {
                                cache.records.put(r);
                            }
                        }
                        Fast::Done(results, None)
                    }
                }
            }
        },
    };
    if !matches!(fast, Fast::Done(_, None)) {
        // Rolled back or not begun: what the cache took from this batch may be undone.
        cache.invalidate();
    }
    fast
}

/// Ends an open transaction after an error (a failed statement may already have).
fn rollback(db: Db, stmts: &mut Statements) {
    if !db.autocommit()
        && let Err(e) = stmts.exec(db, ROLLBACK, &[])
    {
        tracing::warn!(error = %e, "rollback of a failed group commit failed");
    }
}

/// Inside the transaction: the reads, the plans and the writes of [`run_batch`].
fn read_and_write(
    db: Db,
    stmts: &mut Statements,
    reqs: &[Hot<'_>],
    config: &StoreConfig,
    now_ms: i64,
    cache: &mut WriterCache,
) -> Result<Planned, StoreError> {
    let data_version = stmts.int(db, DATA_VERSION)?;
    if cache.data_version != Some(data_version) {
        // Another connection committed since: nothing cached can be trusted. The cache is
        // used again from this version on unless a trigger could rewrite idem's rows.
        cache.records.clear();
        let triggers = stmts.int(db, HOT_TABLE_TRIGGERS)?;
        cache.data_version = (triggers == 0).then_some(data_version);
    }
    let caching = cache.data_version.is_some();
    let mut keys: Vec<(&str, &str)> = reqs.iter().map(Hot::key).collect();
    keys.sort_unstable();
    keys.dedup();
    // The records: taken from the cache (valid: data_version checked under the write
    // lock), or read now; what was read under the lock is the database's record. Either
    // way it goes back into the cache, as the batch leaves it, once the batch committed
    // (`run_batch`): moved, not copied; a batch that does not commit empties the cache.
    let mut records = HashMap::with_capacity(keys.len());
    let mut existing = Vec::with_capacity(keys.len());
    let mut missing = Vec::new();
    for &(tenant, key) in &keys {
        let cached = if caching { cache.records.take(tenant, key) } else { None };
        let found = match cached {
            Some(r) => Some(r),
            None => read_record(db, stmts, tenant, key)?,
        };
        match found {
            Some(r) => {
                records.insert((tenant.to_owned(), key.to_owned()), r);
                existing.push((tenant, key));
            }
            None => missing.push((tenant, key)),
        }
    }
    // Tombstones, only for keys without a record that an acquire names (`plan` consults
    // one only for an acquire: a completion of a key without a record is 404 either way),
    // so a completion costs no SHA-256 of its key.
    let mut tombstones = HashMap::new();
    if !missing.is_empty() {
        // Sorted once, searched per key: a scan of the batch per missing key was quadratic
        // in the batch (256 new keys: 65 536 comparisons).
        let mut acquired: Vec<(&str, &str)> =
            reqs.iter().filter(|r| matches!(r, Hot::Acquire(_))).map(Hot::key).collect();
        acquired.sort_unstable();
        missing.retain(|k| acquired.binary_search(k).is_ok());
    }
    if !missing.is_empty() && stmts.int(db, ANY_TOMBSTONE)? != 0 {
        for (tenant, key) in missing {
            if let Some(t) = read_tombstone(db, stmts, tenant, &key_hash(key))? {
                tombstones.insert((tenant.to_owned(), key.to_owned()), t);
            }
        }
    }
    let planned = plan(reqs, records, &tombstones, config, now_ms);
    // A record that was there (read under the write lock, or cached and still true) is
    // updated in place, without its payload serialized and bound again; a new one is
    // inserted (the upsert). `existing` is sorted: keys were visited in order.
    for r in &planned.changed {
        if existing.binary_search(&(r.tenant.as_str(), r.key.as_str())).is_ok() {
            update_record(db, stmts, r)?;
        } else {
            upsert_record(db, stmts, r)?;
        }
    }
    for e in &planned.events {
        insert_event(db, stmts, e)?;
    }
    Ok(planned)
}

fn read_record(db: Db, stmts: &mut Statements, tenant: &str, key: &str) -> Result<Option<OperationRecord>, StoreError> {
    let mut found = None;
    stmts.get(db, READ_RECORD)?.run(db, &[tenant.into(), key.into()], |r| {
        let row = OperationRow {
            tenant: r.text(0)?,
            op_key: r.text(1)?,
            action: r.text(2)?,
            fingerprint: r.text(3)?,
            payload: r.text(4)?,
            state: r.text(5)?,
            attempt_count: r.int(6),
            lease_owner: r.opt_text(7)?,
            lease_expires_at: r.opt_int(8),
            fencing_token: r.int(9),
            next_attempt_at: r.opt_int(10),
            provider_ref: r.opt_text(11)?,
            result: r.opt_text(12)?,
            error_class: r.opt_text(13)?,
            error_message: r.opt_text(14)?,
            verified_at: r.opt_int(15),
            evidence_source: r.opt_text(16)?,
            needs_review: r.bool(17),
            redo_safe: r.bool(18),
            connector: r.opt_text(19)?,
            lookup_attempts: r.int(20),
            created_at: r.int(21),
            updated_at: r.int(22),
            completed_at: r.opt_int(23),
            expires_at: r.opt_int(24),
            version: r.int(25),
            lease_holder: r.opt_text(26)?,
        };
        found = Some(row.into_record()?);
        Ok(())
    })?;
    Ok(found)
}

fn read_tombstone(db: Db, stmts: &mut Statements, tenant: &str, hash: &str) -> Result<Option<Tombstone>, StoreError> {
    let mut found = None;
    stmts.get(db, READ_TOMBSTONE)?.run(db, &[tenant.into(), hash.into()], |r| {
        found = Some(Tombstone {
            tenant: r.text(0)?,
            key_hash: r.text(1)?,
            fingerprint: r.text(2)?,
            final_state: crate::row::parse_state(&r.text(3)?)?,
            completed_at: r.int(4),
            expires_at: r.int(5),
        });
        Ok(())
    })?;
    Ok(found)
}

/// `r`'s values of [`CHANGING_COLUMNS`], in order (`result` is `r.result` as JSON text).
fn changing_args<'a>(r: &'a OperationRecord, result: Option<&'a str>) -> [Arg<'a>; 19] {
    [
        r.state.as_str().into(),
        r.attempt_count.into(),
        r.lease_owner.as_deref().into(),
        r.lease_expires_at.into(),
        r.fencing_token.into(),
        r.next_attempt_at.into(),
        r.provider_ref.as_deref().into(),
        result.into(),
        r.error_class.as_deref().into(),
        r.error_message.as_deref().into(),
        r.verified_at.into(),
        r.evidence_source.as_deref().into(),
        r.needs_review.into(),
        r.updated_at.into(),
        r.completed_at.into(),
        r.expires_at.into(),
        r.version.into(),
        r.lookup_attempts.into(),
        r.lease_holder.as_deref().into(),
    ]
}

/// Inserts `r`, or updates its changing columns if its key is there ([`upsert_one`]).
fn upsert_record(db: Db, stmts: &mut Statements, r: &OperationRecord) -> Result<(), StoreError> {
    let payload = r.payload.to_string();
    let result = r.result.as_ref().map(ToString::to_string);
    let fixed: [Arg<'_>; 8] = [
        r.tenant.as_str().into(),
        r.key.as_str().into(),
        r.action.as_str().into(),
        r.fingerprint.as_str().into(),
        payload.as_str().into(),
        r.redo_safe.into(),
        r.created_at.into(),
        r.connector.as_deref().into(),
    ];
    let mut args = [Arg::Null; FIXED_COLUMNS.len() + CHANGING_COLUMNS.len()];
    args[..fixed.len()].copy_from_slice(&fixed);
    args[fixed.len()..].copy_from_slice(&changing_args(r, result.as_deref()));
    stmts.exec(db, upsert_one(), &args)?;
    crate::error::stored("an operation record", db.changes() as u64, 1)
}

/// Updates the record `r` names, which must be there ([`update_one`]): a row count other
/// than one is [`StoreError::NotStored`] (the batch is rolled back and runs again the
/// general way, which checks its row counts too), never a write acknowledged and lost.
fn update_record(db: Db, stmts: &mut Statements, r: &OperationRecord) -> Result<(), StoreError> {
    let result = r.result.as_ref().map(ToString::to_string);
    let mut args = [Arg::Null; CHANGING_COLUMNS.len() + 2];
    args[..CHANGING_COLUMNS.len()].copy_from_slice(&changing_args(r, result.as_deref()));
    args[CHANGING_COLUMNS.len()..].copy_from_slice(&[r.tenant.as_str().into(), r.key.as_str().into()]);
    stmts.exec(db, update_one(), &args)?;
    crate::error::stored("an operation record's update", db.changes() as u64, 1)
}

/// Binds `e` in [`crate::row::event_bind_columns!`] order (as [`crate::row::bind_event`]).
fn insert_event(db: Db, stmts: &mut Statements, e: &OperationEvent) -> Result<(), StoreError> {
    let args: [Arg<'_>; EVENT_COLUMNS] = [
        e.tenant.as_str().into(),
        e.key.as_str().into(),
        e.at.into(),
        e.kind.as_str().into(),
        e.principal.as_str().into(),
        e.request_id.as_deref().into(),
        e.from_state.map(|s| s.as_str()).into(),
        e.to_state.map(|s| s.as_str()).into(),
        e.fencing_token.into(),
        e.fingerprint.as_deref().into(),
        e.reason.as_deref().into(),
        e.error_class.as_deref().into(),
        e.wait_ms.into(),
    ];
    stmts.exec(db, insert_event_one(), &args)?;
    crate::error::stored("an operation event", db.changes() as u64, 1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    /// The fast path's one-row statements write what the general path's multi-row upsert
    /// writes: every bound column once, and on a conflict the same columns.
    #[test]
    fn one_row_writes_match_the_multi_row_upsert() {
        let list = |s: &str| s.split(',').map(|c| c.trim().to_owned()).collect::<BTreeSet<_>>();
        let bound = list(crate::row::record_bind_columns!());
        let ours: BTreeSet<String> = FIXED_COLUMNS.iter().chain(&CHANGING_COLUMNS).map(|c| (*c).to_owned()).collect();
        assert_eq!(ours.len(), FIXED_COLUMNS.len() + CHANGING_COLUMNS.len(), "a column listed twice");
        assert_eq!(ours, bound);
        let set: BTreeSet<String> = upsert_tail()
            .split("DO UPDATE SET")
            .nth(1)
            .unwrap()
            .split(',')
            .map(|a| a.split('=').next().unwrap().trim().to_owned())
            .collect();
        assert_eq!(set, CHANGING_COLUMNS.iter().map(|c| (*c).to_owned()).collect::<BTreeSet<_>>());
        assert_eq!(update_one().matches('?').count(), CHANGING_COLUMNS.len() + 2);
        assert_eq!(upsert_one().matches('?').count(), bound.len());
    }
}
