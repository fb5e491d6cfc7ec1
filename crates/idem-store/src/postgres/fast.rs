//! The hot path without explicit transactions: every write is one atomic statement that
//! carries its own condition (a unique insert, or `WHERE version = $read`) and appends its
//! events in the same statement (a data-modifying CTE), so an acquire or a completion costs
//! one durable write, like the raw two-statement baseline. Each statement takes many
//! requests (rows of a `VALUES` list, numbered `ord`), so the batchers of `postgres.rs`
//! write concurrent requests with one round trip and one commit; each row keeps its own
//! condition, so one request's conflict does not affect another's. Anything unusual
//! (a conflict, a tombstone) falls back to the transactional path of `sql_ops!`.

use super::connections::Connections;
use crate::StoreError;
use idem_core::{OperationEvent, OperationRecord};
use sqlx::{Postgres, QueryBuilder};

const OP_COLS: &str = crate::row::record_bind_columns!();
const EV_COLS: &str = crate::row::event_bind_columns!();
/// Appends events (no condition): [`events`].
const EVENTS_INSERT: &str = concat!("INSERT INTO operation_events (", crate::row::event_bind_columns!(), ") ");

/// `cols` (a comma-separated column list) with each column prefixed by `table.`.
fn prefixed(table: &str, cols: &str) -> String {
    cols.split(',').map(|c| format!("{table}.{}", c.trim())).collect::<Vec<_>>().join(", ")
}

/// The fixed text of the statements, built once (not per statement: this runs for every
/// batch on the hot path).
struct Fragments {
    claim_head: String,
    claim_insert: String,
    claim_select: String,
    update_head: String,
    update_set: String,
    events_head: String,
    events_tail: String,
}

static SQL: std::sync::LazyLock<Fragments> = std::sync::LazyLock::new(|| Fragments {
    claim_head: format!("WITH v (ord, key_hash, not_after, {OP_COLS}) AS ("),
    claim_insert: format!(
        "), ins AS (INSERT INTO operations ({OP_COLS}) SELECT {OP_COLS} FROM v WHERE NOT EXISTS \
         (SELECT 1 FROM tombstones t WHERE t.tenant = v.tenant AND t.key_hash = v.key_hash AND t.expires_at > v.not_after) \
         AND NOT EXISTS (SELECT 1 FROM operations x WHERE x.tenant = v.tenant AND x.op_key = v.op_key) \
         ON CONFLICT (tenant, op_key) DO NOTHING RETURNING tenant, op_key), "
    ),
    claim_select: format!(
        " SELECT v.ord, ins.op_key IS NOT NULL AS inserted, {} FROM v \
         LEFT JOIN ins ON ins.tenant = v.tenant AND ins.op_key = v.op_key \
         LEFT JOIN operations o ON o.tenant = v.tenant AND o.op_key = v.op_key",
        prefixed("o", crate::row::operation_columns!())
    ),
    update_head: format!("WITH v (ord, read_version, {OP_COLS}) AS ("),
    update_set: format!(
        "), upd AS (UPDATE operations o SET ({OP_COLS}) = ({}) FROM v \
         WHERE o.tenant = v.tenant AND o.op_key = v.op_key AND o.version = v.read_version \
         AND o.created_at = v.created_at RETURNING v.ord), ",
        prefixed("v", OP_COLS)
    ),
    events_head: format!("ev AS (INSERT INTO operation_events ({EV_COLS}) SELECT {EV_COLS} FROM ("),
    events_tail: format!(") AS e (ord, {EV_COLS}) WHERE "),
});

/// Pushes the CTE `ev` that appends the events of the requests the rest of the statement
/// wrote: `events` are `(ord, event)` for request number `ord`, and `written` a condition
/// on `e.ord` / `e.tenant` / `e.op_key` that holds for a written request.
fn push_events_cte<'a>(
    q: &mut QueryBuilder<Postgres>,
    events: impl IntoIterator<Item = (i32, &'a OperationEvent)>,
    written: &str,
) {
    let events: Vec<_> = events.into_iter().collect();
    if events.is_empty() {
        q.push("ev AS (SELECT 1)");
        return;
    }
    q.push(&SQL.events_head);
    q.push_values(events, |mut b, (ord, e)| {
        b.push_bind(ord);
        crate::row::bind_event(b, e);
    });
    q.push(&SQL.events_tail).push(written).push(" RETURNING 1)");
}

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
    let mut q: QueryBuilder<Postgres> = QueryBuilder::new(&SQL.claim_head);
    q.push_values(new.iter().enumerate(), |mut b, (ord, n)| {
        b.push_bind(ord as i32).push_bind(idem_core::retention::key_hash(&n.record.key)).push_bind(n.now_ms);
        crate::row::bind_record(b, &n.record);
    });
    q.push(&SQL.claim_insert);
    push_events_cte(
        &mut q,
        new.iter().enumerate().flat_map(|(ord, n)| n.events.iter().map(move |e| (ord as i32, e))),
        "EXISTS (SELECT 1 FROM ins WHERE ins.tenant = e.tenant AND ins.op_key = e.op_key)",
    );
    q.push(&SQL.claim_select);
    let rows = super::committed_batch(new.len(), conns.fetch_all(q.build())).await?;
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
    let mut q: QueryBuilder<Postgres> = QueryBuilder::new(&SQL.update_head);
    q.push_values(updates.iter().enumerate(), |mut b, (ord, u)| {
        b.push_bind(ord as i32).push_bind(u.read_version);
        crate::row::bind_record(b, &u.record);
    });
    q.push(&SQL.update_set);
    push_events_cte(
        &mut q,
        updates.iter().enumerate().flat_map(|(ord, u)| u.events.iter().map(move |e| (ord as i32, e))),
        "e.ord IN (SELECT ord FROM upd)",
    );
    q.push(" SELECT ord FROM upd");
    let rows = super::committed_batch(updates.len(), conns.fetch_all(q.build())).await?;
    let mut written = vec![false; updates.len()];
    for row in rows {
        if let Some(w) = usize::try_from(row.try_get::<i32, _>("ord")?).ok().and_then(|i| written.get_mut(i)) {
            *w = true;
        }
    }
    Ok(written)
}

/// Appends events in one autocommit statement per 1 000 (the caller records metrics).
pub(super) async fn events(conns: &Connections, events: &[&OperationEvent]) -> Result<(), StoreError> {
    for chunk in events.chunks(1000) {
        let mut q: QueryBuilder<Postgres> = QueryBuilder::new(EVENTS_INSERT);
        q.push_values(chunk, |b, e| crate::row::bind_event(b, e));
        conns.execute(q.build()).await?;
    }
    Ok(())
}
