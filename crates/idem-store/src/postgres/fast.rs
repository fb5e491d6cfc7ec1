//! The hot path without explicit transactions: every write is one atomic statement that
//! carries its own condition (a unique insert, or `WHERE version = $read`) and appends its
//! events in the same statement (a data-modifying CTE), so an acquire or a completion costs
//! one durable write, like the raw two-statement baseline. Each statement takes many
//! requests (one array per column, read back as rows numbered `ord` by `unnest`: see
//! `columns.rs`), so the batchers of `postgres.rs` write concurrent requests with one
//! round trip and one commit, through one prepared statement per kind; each row keeps its own
//! condition, so one request's conflict does not affect another's. Anything unusual
//! (a conflict, a tombstone) falls back to the transactional path of `sql_ops!`.

use super::columns::{self, EVENT_TYPES, RECORD_TYPES};
use super::connections::Connections;
use crate::StoreError;
use idem_core::{OperationEvent, OperationRecord};

const OP_COLS: &str = crate::row::record_bind_columns!();
const EV_COLS: &str = crate::row::event_bind_columns!();

/// `cols` (a comma-separated column list) with each column prefixed by `table.`.
fn prefixed(table: &str, cols: &str) -> String {
    cols.split(',').map(|c| format!("{table}.{}", c.trim())).collect::<Vec<_>>().join(", ")
}

/// `head` followed by `columns`: the typed column list of an `unnest` row source whose
/// first columns are the statement's own (`ord`, …).
fn with_head(
    head: &[(&'static str, &'static str)],
    columns: &[(&'static str, &'static str)],
) -> Vec<(&'static str, &'static str)> {
    head.iter().chain(columns).copied().collect()
}

/// The CTE `ev` that appends events given as arrays from parameter `first` on (`ord`,
/// then [`EVENT_TYPES`]), keeping those of the requests for which `written` (a condition
/// on `e.ord` / `e.tenant` / `e.op_key`) holds.
fn events_cte(first: usize, written: &str) -> String {
    let source = columns::unnest(first, &with_head(&[("ord", "int4")], &EVENT_TYPES), "e");
    format!(
        "ev AS (INSERT INTO operation_events ({EV_COLS}) SELECT {EV_COLS} FROM {source} WHERE {written} RETURNING 1)"
    )
}

/// The hot path's statements, one text per kind whatever the batch size (built once:
/// this runs for every batch).
struct Statements {
    /// [`insert_or_read`]: `ord`, `key_hash`, `not_after`, the record's 27 columns, then
    /// the events (`ord` and 13 columns): 44 array parameters.
    claim: String,
    /// [`update`]: `ord`, `read_version`, the 27 columns, then the events: 43.
    update: String,
    /// [`events`]: the 13 event columns.
    events: String,
}

static SQL: std::sync::LazyLock<Statements> = std::sync::LazyLock::new(|| {
    let claim_rows = with_head(&[("ord", "int4"), ("key_hash", "text"), ("not_after", "int8")], &RECORD_TYPES);
    let update_rows = with_head(&[("ord", "int4"), ("read_version", "int8")], &RECORD_TYPES);
    Statements {
        claim: format!(
            "WITH v AS MATERIALIZED (SELECT * FROM {}), \
             ins AS (INSERT INTO operations ({OP_COLS}) SELECT {OP_COLS} FROM v WHERE NOT EXISTS \
             (SELECT 1 FROM tombstones t WHERE t.tenant = v.tenant AND t.key_hash = v.key_hash AND t.expires_at > v.not_after) \
             AND NOT EXISTS (SELECT 1 FROM operations x WHERE x.tenant = v.tenant AND x.op_key = v.op_key) \
             ON CONFLICT (tenant, op_key) DO NOTHING RETURNING tenant, op_key), {} \
             SELECT v.ord, ins.op_key IS NOT NULL AS inserted, {} FROM v \
             LEFT JOIN ins ON ins.tenant = v.tenant AND ins.op_key = v.op_key \
             LEFT JOIN operations o ON o.tenant = v.tenant AND o.op_key = v.op_key",
            columns::unnest(1, &claim_rows, "v"),
            events_cte(
                1 + claim_rows.len(),
                "EXISTS (SELECT 1 FROM ins WHERE ins.tenant = e.tenant AND ins.op_key = e.op_key)"
            ),
            prefixed("o", crate::row::operation_columns!())
        ),
        update: format!(
            "WITH v AS (SELECT * FROM {}), \
             upd AS (UPDATE operations o SET ({OP_COLS}) = ({}) FROM v \
             WHERE o.tenant = v.tenant AND o.op_key = v.op_key AND o.version = v.read_version \
             AND o.created_at = v.created_at RETURNING v.ord), {} SELECT ord FROM upd",
            columns::unnest(1, &update_rows, "v"),
            prefixed("v", OP_COLS),
            events_cte(1 + update_rows.len(), "e.ord IN (SELECT ord FROM upd)"),
        ),
        events: format!(
            "INSERT INTO operation_events ({EV_COLS}) SELECT {EV_COLS} FROM {}",
            columns::unnest(1, &EVENT_TYPES, "e")
        ),
    }
});

/// What [`insert_or_read`] found for one new record.
pub(super) enum Claim {
    /// The new record and its events were written.
    Inserted,
    /// The key has a record (as of the statement's snapshot); nothing was written.
    Existing(Box<OperationRecord>),
    /// Neither: a live tombstone holds the key, or a concurrent insert of it has not
    /// committed yet. The transactional path decides.
    Neither,
}

/// A new record to claim with [`insert_or_read`]: the record, its events, and the
/// instant (epoch ms) a tombstone must outlive to hold the key.
pub(super) struct NewRecord {
    pub record: OperationRecord,
    pub events: Vec<OperationEvent>,
    pub now_ms: i64,
}

/// One statement that inserts each new record with its events unless its key exists or a
/// live tombstone holds it, and otherwise returns the stored record. "Exists" is judged on
/// the statement's snapshot, like the tombstone: a record the sweeper is removing (its
/// tombstone not yet committed) still counts, so the trigger is answered from it (a
/// replay) instead of the insert waiting for the sweep and slipping in next to the new
/// tombstone. A new key costs one round trip instead of a read and a write, an existing
/// one the same as a read; `n` records cost one round trip and one commit. Keys must be
/// distinct (one row per key in one `INSERT … ON CONFLICT`); answers are in the order of
/// `new`.
pub(super) async fn insert_or_read(conns: &Connections, new: &[NewRecord]) -> Result<Vec<Claim>, StoreError> {
    use sqlx::{FromRow, Row};
    let ords: Vec<i32> = (0..new.len()).map(|i| i as i32).collect();
    let key_hashes: Vec<String> = new.iter().map(|n| idem_core::retention::key_hash(&n.record.key)).collect();
    let not_after: Vec<i64> = new.iter().map(|n| n.now_ms).collect();
    let q = sqlx::query(SQL.claim.as_str()).bind(ords).bind(key_hashes).bind(not_after);
    let q = columns::Records::of(new.iter().map(|n| &n.record)).bind(q);
    let events = new.iter().enumerate().flat_map(|(ord, n)| n.events.iter().map(move |e| (ord as i32, e)));
    let q = columns::Events::of(events).bind(q, true);
    let rows = super::committed_batch(new.len(), conns.fetch_all(q)).await?;
    let mut out: Vec<Option<Claim>> = new.iter().map(|_| None).collect();
    for row in rows {
        let ord = usize::try_from(row.try_get::<i32, _>("ord")?).ok().filter(|&i| i < new.len());
        let Some(ord) = ord else { return Err(StoreError::Corrupt("insert_or_read answered an unknown row".into())) };
        let seen = row.try_get::<Option<String>, _>("op_key")?.is_some();
        out[ord] = Some(if row.try_get::<bool, _>("inserted")? {
            if seen {
                // The insert is guarded by NOT EXISTS on the same snapshot: unreachable.
                return Err(StoreError::Corrupt("insert_or_read inserted over a record it saw".into()));
            }
            Claim::Inserted
        } else if seen {
            Claim::Existing(Box::new(crate::row::OperationRow::from_row(&row)?.into_record()?))
        } else {
            Claim::Neither
        });
    }
    out.into_iter().map(|c| c.ok_or_else(|| StoreError::Corrupt("insert_or_read lost a row".into()))).collect()
}

/// A conditional write for [`update`]: `record` replaces the stored one if that is still
/// the one read (same incarnation of the key, `created_at`, at `read_version`).
pub(super) struct Update {
    pub record: OperationRecord,
    pub read_version: i64,
    pub events: Vec<OperationEvent>,
}

/// Writes each record if the stored one is still the one read: the same incarnation of
/// the key (`created_at`; a key reused after its tombstone expired starts a new record
/// whose version counts from 1 again) at `read_version`. With its events, all in one
/// statement (one round trip, one commit). Keys must be distinct. One answer per update,
/// in order: true if written.
pub(super) async fn update(conns: &Connections, updates: &[Update]) -> Result<Vec<bool>, StoreError> {
    use sqlx::Row;
    let ords: Vec<i32> = (0..updates.len()).map(|i| i as i32).collect();
    let read_versions: Vec<i64> = updates.iter().map(|u| u.read_version).collect();
    let q = sqlx::query(SQL.update.as_str()).bind(ords).bind(read_versions);
    let q = columns::Records::of(updates.iter().map(|u| &u.record)).bind(q);
    let events = updates.iter().enumerate().flat_map(|(ord, u)| u.events.iter().map(move |e| (ord as i32, e)));
    let q = columns::Events::of(events).bind(q, true);
    let rows = super::committed_batch(updates.len(), conns.fetch_all(q)).await?;
    let mut written = vec![false; updates.len()];
    for row in rows {
        if let Some(w) = usize::try_from(row.try_get::<i32, _>("ord")?).ok().and_then(|i| written.get_mut(i)) {
            *w = true;
        }
    }
    Ok(written)
}

/// Appends events in one autocommit statement (the caller records metrics).
pub(super) async fn events(conns: &Connections, events: &[&OperationEvent]) -> Result<(), StoreError> {
    let q = columns::Events::of(events.iter().map(|e| (0, *e))).bind(sqlx::query(SQL.events.as_str()), false);
    conns.execute(q).await?;
    Ok(())
}
