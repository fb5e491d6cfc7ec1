//! `OutboxStore`: the relay's reads and writes of the outbox, on PostgreSQL or SQLite.
//!
//! - [`OutboxStore::claim_batch`] takes up to `limit` events, each the **head** (oldest
//!   open event) of its aggregate, due and not leased: it gives each a lease
//!   (`lease_expires_at`), a new fencing token and one more attempt, in one statement. On
//!   PostgreSQL the rows are locked `FOR UPDATE SKIP LOCKED` and re-checked after any
//!   concurrent change, so two relays never claim the same row; a DEAD head holds its
//!   aggregate back (order), and a leased head too (in flight). The relay keeps no
//!   cursor: it reads open rows, so a row committed late is read when it becomes visible,
//!   never skipped.
//! - [`OutboxStore::record`] writes idem-core's [`DeliveryPlan`] and an attempt row, only
//!   `WHERE fencing_token = <the claim's>` and the event is still PENDING: a relay whose
//!   lease expired and whose row was claimed again writes nothing.
//! - [`OutboxStore::operator_action`]: redrive or skip a dead letter (idem-core's
//!   [`plan_operator_action`]), audited with who and why.
//!
//! Instants are the database's clock (`idem.now_ms()`; SQLite's `julianday('now')`), so
//! relays on different hosts judge leases alike. Stores never decide: the plans are
//! idem-core's.

use crate::conn::SQLITE_NOW_MS;
use crate::error::OutboxError;
use idem_core::outbox::{DeliveryPlan, OperatorAction, OperatorRefusal, OutboxState, Trigger, plan_operator_action};
use sqlx::{PgPool, SqlitePool};
use std::collections::BTreeMap;

/// The columns of [`EventRow`], cast to types both databases decode alike.
const COLUMNS: &str = "seq, id, aggregate_type, aggregate_id, topic, CAST(payload AS TEXT) AS payload, \
    CAST(headers AS TEXT) AS headers, created_at, state, CAST(attempts AS BIGINT) AS attempts, next_attempt_at, \
    manual, lease_owner, lease_expires_at, fencing_token, sink, evidence, error_class, error_message, delivered_at";

/// One outbox event as stored.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct EventRow {
    /// Position: commit order within an aggregate.
    pub seq: i64,
    /// The event id (`webhook-id`, `Nats-Msg-Id`).
    pub id: String,
    /// Aggregate type.
    pub aggregate_type: String,
    /// Aggregate id.
    pub aggregate_id: String,
    /// Topic (NATS subject; sinks route on it).
    pub topic: String,
    /// The payload's JSON text, as appended.
    pub payload: String,
    /// The headers, a JSON object of strings.
    pub headers: String,
    /// When it was appended (epoch ms).
    pub created_at: i64,
    /// PENDING, DELIVERED, DEAD or SKIPPED.
    pub state: String,
    /// Attempts made (claims), including one in flight.
    pub attempts: i64,
    /// When the next attempt is due (epoch ms), after a failure.
    pub next_attempt_at: Option<i64>,
    /// The next (or current) attempt is an operator's redrive.
    pub manual: bool,
    /// The relay holding the lease.
    pub lease_owner: Option<String>,
    /// When that lease ends (epoch ms).
    pub lease_expires_at: Option<i64>,
    /// Grows by one on every claim; a write must present the current one.
    pub fencing_token: i64,
    /// The sink of the last attempt.
    pub sink: Option<String>,
    /// The sink's evidence of delivery.
    pub evidence: Option<String>,
    /// Class of the last failure.
    pub error_class: Option<String>,
    /// Detail of the last failure.
    pub error_message: Option<String>,
    /// When it was delivered (epoch ms).
    pub delivered_at: Option<i64>,
}

impl EventRow {
    /// The headers as a map (empty when malformed, which the schema prevents).
    pub fn header_map(&self) -> BTreeMap<String, String> {
        serde_json::from_str(&self.headers).unwrap_or_default()
    }

    /// Who started the attempt this claim is for.
    pub fn trigger(&self) -> Trigger {
        if self.manual { Trigger::Manual } else { Trigger::Scheduled }
    }
}

/// An event claimed by a relay: the row after the claim, and the database's "now" then.
#[derive(Debug, Clone, PartialEq)]
pub struct Claimed {
    /// The row (lease, token and attempts already updated).
    pub row: EventRow,
    /// The database's clock at the claim (epoch ms).
    pub claimed_at: i64,
}

/// One row of an event's audit trail: a delivery attempt or an operator's action.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct AttemptRecord {
    /// When (epoch ms).
    pub at: i64,
    /// `attempt`, `redrive` or `skip`.
    pub kind: String,
    /// `scheduled` or `manual` (attempts).
    pub trigger: Option<String>,
    /// The relay that made the attempt.
    pub relay: Option<String>,
    /// Its fencing token.
    pub fencing_token: Option<i64>,
    /// `delivered`, `retry` or `dead` (attempts).
    pub result: Option<String>,
    /// The sink.
    pub sink: Option<String>,
    /// Failure class.
    pub error_class: Option<String>,
    /// Failure detail.
    pub message: Option<String>,
    /// Delivery evidence.
    pub evidence: Option<String>,
    /// Who redrove or skipped.
    pub operator: Option<String>,
    /// Why (mandatory for operators).
    pub reason: Option<String>,
}

/// Counts for `/metrics` and the admin page.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct OutboxStats {
    /// Events per state (`PENDING`, …).
    pub by_state: BTreeMap<String, i64>,
    /// Age of the oldest undelivered (PENDING) event, in ms; 0 when none.
    pub lag_ms: i64,
}

/// The outbox of one application database.
#[derive(Debug, Clone)]
pub enum OutboxStore {
    /// PostgreSQL (schema `idem`).
    Postgres(PgPool),
    /// SQLite (tables `idem_*`).
    Sqlite(SqlitePool),
}

/// Runs `$q` (a query built from `$sql`) on whichever pool `$store` holds.
macro_rules! on_pool {
    ($store:expr, |$pool:ident, $sql:ident| $body:expr) => {
        match $store {
            OutboxStore::Postgres($pool) => {
                let $sql = |s: &str| sqlx::AssertSqlSafe(s.to_owned());
                $body
            }
            OutboxStore::Sqlite($pool) => {
                let $sql = |s: &str| sqlx::AssertSqlSafe(sqlite(s));
                $body
            }
        }
    };
}

/// A statement written for PostgreSQL, for SQLite: `idem_*` tables, SQLite's clock.
fn sqlite(s: &str) -> String {
    s.replace("idem.now_ms()", SQLITE_NOW_MS)
        .replace("idem.", "idem_")
        .replace(" FOR UPDATE SKIP LOCKED", "")
        .replace(" FOR UPDATE", "")
}

/// Open events that head their aggregate (the oldest PENDING or DEAD one of each).
const HEADS: &str =
    "SELECT min(seq) FROM idem.outbox WHERE state IN ('PENDING', 'DEAD') GROUP BY aggregate_type, aggregate_id";

impl OutboxStore {
    /// Connects to the application's database at `url` (`postgres://…` or `sqlite://…`).
    /// The schema must be installed (`idem schema install`).
    ///
    /// # Errors
    /// [`OutboxError::Database`] when unreachable; [`OutboxError::NotInstalled`].
    pub async fn connect(url: &str, max_connections: u32) -> Result<Self, OutboxError> {
        let store = if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            let pool = sqlx::postgres::PgPoolOptions::new()
                .max_connections(max_connections)
                .connect(url)
                .await
                .map_err(OutboxError::Database)?;
            OutboxStore::Postgres(pool)
        } else {
            let path = url.strip_prefix("sqlite://").unwrap_or(url);
            let opts = sqlx::sqlite::SqliteConnectOptions::new()
                .filename(path)
                .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal)
                .busy_timeout(std::time::Duration::from_secs(10));
            let pool = sqlx::sqlite::SqlitePoolOptions::new()
                .max_connections(max_connections)
                .connect_with(opts)
                .await
                .map_err(OutboxError::Database)?;
            OutboxStore::Sqlite(pool)
        };
        store.stats().await?;
        Ok(store)
    }

    /// The PostgreSQL pool, if this is one (for LISTEN).
    pub fn postgres(&self) -> Option<&PgPool> {
        match self {
            OutboxStore::Postgres(p) => Some(p),
            OutboxStore::Sqlite(_) => None,
        }
    }

    /// Claims up to `limit` due heads of aggregates for `relay`, each with a lease of
    /// `lease_ms` (see the module docs).
    ///
    /// # Errors
    /// Database errors.
    pub async fn claim_batch(&self, relay: &str, lease_ms: i64, limit: i64) -> Result<Vec<Claimed>, OutboxError> {
        let due = "o.state = 'PENDING' AND (o.next_attempt_at IS NULL OR o.next_attempt_at <= idem.now_ms()) \
                   AND (o.lease_expires_at IS NULL OR o.lease_expires_at <= idem.now_ms())";
        let set = "lease_owner = $1, lease_expires_at = idem.now_ms() + $2, fencing_token = fencing_token + 1, \
                   attempts = attempts + 1";
        let picked =
            format!("SELECT o.seq FROM idem.outbox o WHERE o.seq IN ({HEADS}) AND {due} ORDER BY o.seq LIMIT $3");
        let sql = match self {
            // A data-modifying CTE: lock (skipping rows another relay holds), then update.
            OutboxStore::Postgres(_) => format!(
                "WITH picked AS ({picked} FOR UPDATE SKIP LOCKED) UPDATE idem.outbox SET {set} \
                 FROM picked WHERE idem.outbox.seq = picked.seq RETURNING {COLUMNS}, idem.now_ms() AS claimed_at"
            )
            .replace("RETURNING seq,", "RETURNING idem.outbox.seq,"),
            OutboxStore::Sqlite(_) => {
                format!(
                    "UPDATE idem.outbox SET {set} WHERE seq IN ({picked}) RETURNING {COLUMNS}, idem.now_ms() AS claimed_at"
                )
            }
        };
        #[derive(sqlx::FromRow)]
        struct Row {
            #[sqlx(flatten)]
            row: EventRow,
            claimed_at: i64,
        }
        let rows: Vec<Row> = on_pool!(self, |pool, q| {
            let mut tx = match self {
                OutboxStore::Sqlite(_) => pool.begin_with("BEGIN IMMEDIATE").await?,
                OutboxStore::Postgres(_) => pool.begin().await?,
            };
            let rows = sqlx::query_as(q(&sql)).bind(relay).bind(lease_ms).bind(limit).fetch_all(&mut *tx).await?;
            tx.commit().await?;
            rows
        });
        let mut claimed: Vec<Claimed> =
            rows.into_iter().map(|r| Claimed { row: r.row, claimed_at: r.claimed_at }).collect();
        claimed.sort_by_key(|c| c.row.seq);
        Ok(claimed)
    }

    /// Writes `plan` for the attempt of `claimed` made through `sink` by `relay`, with its
    /// attempt row. Returns false (and writes nothing) when the fencing token is no longer
    /// the row's (the lease was lost) or the event is no longer PENDING.
    ///
    /// # Errors
    /// Database errors.
    pub async fn record(
        &self,
        claimed: &Claimed,
        plan: &DeliveryPlan,
        sink: &str,
        relay: &str,
    ) -> Result<bool, OutboxError> {
        let row = &claimed.row;
        let (state, next_at, evidence, class, message, result) = match plan {
            DeliveryPlan::Delivered { evidence } => {
                ("DELIVERED", None, Some(evidence.as_str()), None, None, "delivered")
            }
            DeliveryPlan::RetryAt { at_ms, error_class, message } => {
                ("PENDING", Some(*at_ms), None, Some(error_class.as_str()), Some(message.as_str()), "retry")
            }
            DeliveryPlan::Dead { error_class, message } => {
                ("DEAD", None, None, Some(error_class.as_str()), Some(message.as_str()), "dead")
            }
        };
        let update = "UPDATE idem.outbox SET state = $3, next_attempt_at = $4, evidence = $5, error_class = $6, \
             error_message = $7, sink = $8, delivered_at = CASE WHEN $3 = 'DELIVERED' THEN idem.now_ms() END, \
             lease_owner = NULL, lease_expires_at = NULL, manual = FALSE \
             WHERE seq = $1 AND fencing_token = $2 AND state = 'PENDING'";
        let insert = "INSERT INTO idem.outbox_attempts (event_seq, at, kind, trigger, relay, fencing_token, result, \
             sink, error_class, message, evidence) ";
        let trigger = row.trigger().as_str();
        let applied = on_pool!(self, |pool, q| {
            match self {
                OutboxStore::Postgres(_) => {
                    let sql = format!(
                        "WITH u AS ({update} RETURNING seq) {insert} \
                         SELECT seq, idem.now_ms(), 'attempt', $9, $10, $2, $11, $8, $6, $7, $5 FROM u"
                    );
                    sqlx::query(q(&sql))
                        .bind(row.seq)
                        .bind(row.fencing_token)
                        .bind(state)
                        .bind(next_at)
                        .bind(evidence)
                        .bind(class)
                        .bind(message)
                        .bind(sink)
                        .bind(trigger)
                        .bind(relay)
                        .bind(result)
                        .execute(pool)
                        .await?
                        .rows_affected()
                        == 1
                }
                OutboxStore::Sqlite(_) => {
                    let mut tx = pool.begin_with("BEGIN IMMEDIATE").await?;
                    let n = sqlx::query(q(update))
                        .bind(row.seq)
                        .bind(row.fencing_token)
                        .bind(state)
                        .bind(next_at)
                        .bind(evidence)
                        .bind(class)
                        .bind(message)
                        .bind(sink)
                        .execute(&mut *tx)
                        .await?
                        .rows_affected();
                    if n == 1 {
                        let sql =
                            format!("{insert} VALUES ($1, idem.now_ms(), 'attempt', $2, $3, $4, $5, $6, $7, $8, $9)");
                        sqlx::query(q(&sql))
                            .bind(row.seq)
                            .bind(trigger)
                            .bind(relay)
                            .bind(row.fencing_token)
                            .bind(result)
                            .bind(sink)
                            .bind(class)
                            .bind(message)
                            .bind(evidence)
                            .execute(&mut *tx)
                            .await?;
                    }
                    tx.commit().await?;
                    n == 1
                }
            }
        });
        Ok(applied)
    }

    /// Gives a claim back without an attempt (the retry budget is empty): the attempt it
    /// counted is taken back and the event is due again at `at_ms`. Fenced like
    /// [`OutboxStore::record`].
    ///
    /// # Errors
    /// Database errors.
    pub async fn release(&self, claimed: &Claimed, at_ms: i64) -> Result<bool, OutboxError> {
        let sql = "UPDATE idem.outbox SET attempts = attempts - 1, next_attempt_at = $3, lease_owner = NULL, \
                   lease_expires_at = NULL WHERE seq = $1 AND fencing_token = $2 AND state = 'PENDING'";
        let n = on_pool!(self, |pool, q| sqlx::query(q(sql))
            .bind(claimed.row.seq)
            .bind(claimed.row.fencing_token)
            .bind(at_ms)
            .execute(pool)
            .await?
            .rows_affected());
        Ok(n == 1)
    }

    /// Events, newest first: all, or those in `state`; at most `limit`, older than
    /// `before_seq` when given (paging).
    ///
    /// # Errors
    /// Database errors.
    pub async fn list(
        &self,
        state: Option<OutboxState>,
        limit: i64,
        before_seq: Option<i64>,
    ) -> Result<Vec<EventRow>, OutboxError> {
        let sql = format!(
            "SELECT {COLUMNS} FROM idem.outbox WHERE ($1 IS NULL OR state = $1) AND ($2 IS NULL OR seq < $2) \
             ORDER BY seq DESC LIMIT $3"
        );
        let state = state.map(OutboxState::as_str);
        Ok(on_pool!(self, |pool, q| sqlx::query_as(q(&sql))
            .bind(state)
            .bind(before_seq)
            .bind(limit)
            .fetch_all(pool)
            .await?))
    }

    /// One event by id, with its audit trail (oldest first).
    ///
    /// # Errors
    /// Database errors.
    pub async fn get(&self, id: &str) -> Result<Option<(EventRow, Vec<AttemptRecord>)>, OutboxError> {
        let sql = format!("SELECT {COLUMNS} FROM idem.outbox WHERE id = $1");
        let attempts = "SELECT at, kind, trigger, relay, fencing_token, result, sink, error_class, message, evidence, \
                        operator, reason FROM idem.outbox_attempts WHERE event_seq = $1 ORDER BY at, kind";
        on_pool!(self, |pool, q| {
            let row: Option<EventRow> = sqlx::query_as(q(&sql)).bind(id).fetch_optional(pool).await?;
            match row {
                None => Ok(None),
                Some(row) => {
                    let trail = sqlx::query_as(q(attempts)).bind(row.seq).fetch_all(pool).await?;
                    Ok(Some((row, trail)))
                }
            }
        })
    }

    /// An operator's redrive or skip of the dead letter `id`, with a mandatory `reason`,
    /// audited under `operator`. Returns the new state, or the refusal (nothing written).
    /// A redrive makes the next attempt manual: if it fails, the event is dead again.
    ///
    /// # Errors
    /// [`OutboxError::NotClaimed`] (naming the id) when there is no such event; database
    /// errors.
    pub async fn operator_action(
        &self,
        id: &str,
        action: OperatorAction,
        reason: &str,
        operator: &str,
    ) -> Result<Result<OutboxState, OperatorRefusal>, OutboxError> {
        // A relay writing this row right now holds its lock for one statement: wait for it.
        let read = "SELECT seq, state FROM idem.outbox WHERE id = $1 FOR UPDATE";
        let update = "UPDATE idem.outbox SET state = $2, manual = $3, next_attempt_at = NULL, lease_owner = NULL, \
                      lease_expires_at = NULL WHERE seq = $1";
        let audit = "INSERT INTO idem.outbox_attempts (event_seq, at, kind, operator, reason) \
                     VALUES ($1, idem.now_ms(), $2, $3, $4)";
        on_pool!(self, |pool, q| {
            let mut tx = match self {
                OutboxStore::Sqlite(_) => pool.begin_with("BEGIN IMMEDIATE").await?,
                OutboxStore::Postgres(_) => pool.begin().await?,
            };
            let found: Option<(i64, String)> = sqlx::query_as(q(read)).bind(id).fetch_optional(&mut *tx).await?;
            let Some((seq, state)) = found else {
                return Err(OutboxError::NotClaimed(format!("no outbox event has id {id:?}")));
            };
            let state = OutboxState::parse(&state).unwrap_or(OutboxState::Pending);
            let to = match plan_operator_action(state, action, reason) {
                Ok(to) => to,
                Err(refusal) => return Ok(Err(refusal)),
            };
            sqlx::query(q(update))
                .bind(seq)
                .bind(to.as_str())
                .bind(action == OperatorAction::Redrive)
                .execute(&mut *tx)
                .await?;
            sqlx::query(q(audit))
                .bind(seq)
                .bind(action.as_str())
                .bind(operator)
                .bind(reason.trim())
                .execute(&mut *tx)
                .await?;
            tx.commit().await?;
            Ok(Ok(to))
        })
    }

    /// Counts by state and the age of the oldest PENDING event.
    ///
    /// # Errors
    /// Database errors; [`OutboxError::NotInstalled`] without the schema.
    pub async fn stats(&self) -> Result<OutboxStats, OutboxError> {
        let counts = "SELECT state, count(*) FROM idem.outbox GROUP BY state";
        let lag = "SELECT CAST(coalesce(idem.now_ms() - min(created_at), 0) AS BIGINT) FROM idem.outbox \
                   WHERE state = 'PENDING'";
        on_pool!(self, |pool, q| {
            let rows: Vec<(String, i64)> = sqlx::query_as(q(counts)).fetch_all(pool).await?;
            let lag_ms: i64 = sqlx::query_scalar(q(lag)).fetch_one(pool).await?;
            Ok(OutboxStats { by_state: rows.into_iter().collect(), lag_ms: lag_ms.max(0) })
        })
    }
}
