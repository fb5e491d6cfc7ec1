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
use idem_core::text::storable;
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

/// One attempt's outcome to record: the claim it was made under, the plan, the sink.
#[derive(Debug, Clone, Copy)]
pub struct Recorded<'a> {
    /// The claim (its fencing token guards the write).
    pub claimed: &'a Claimed,
    /// idem-core's plan for the attempt.
    pub plan: &'a DeliveryPlan,
    /// The sink it went through (`none` when no sink takes its topic).
    pub sink: &'a str,
}

/// A [`Recorded`] as the columns it writes.
struct RecordRow {
    seq: i64,
    token: i64,
    state: &'static str,
    next_at: Option<i64>,
    evidence: Option<String>,
    class: Option<String>,
    message: Option<String>,
    sink: String,
    trigger: &'static str,
    result: &'static str,
}

impl RecordRow {
    fn of(r: &Recorded<'_>) -> Self {
        // What sinks report comes from outside (a receiver's body, a broker's error): kept as
        // text every database accepts, so no row can fail the batch (issue 28 §8).
        let text = |s: &String| Some(storable(s).into_owned());
        let (state, next_at, evidence, class, message, result) = match r.plan {
            DeliveryPlan::Delivered { evidence } => ("DELIVERED", None, text(evidence), None, None, "delivered"),
            DeliveryPlan::RetryAt { at_ms, error_class, message } => {
                ("PENDING", Some(*at_ms), None, text(error_class), text(message), "retry")
            }
            DeliveryPlan::Dead { error_class, message } => {
                ("DEAD", None, None, text(error_class), text(message), "dead")
            }
        };
        RecordRow {
            seq: r.claimed.row.seq,
            token: r.claimed.row.fencing_token,
            state,
            next_at,
            evidence,
            class,
            message,
            sink: r.sink.to_owned(),
            trigger: r.claimed.row.trigger().as_str(),
            result,
        }
    }
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

/// An open (PENDING or DEAD) event of `o`'s aggregate older than `o`: `o` is not its head.
const OLDER_OPEN: &str = "SELECT 1 FROM idem.outbox p WHERE p.aggregate_type = o.aggregate_type \
    AND p.aggregate_id = o.aggregate_id AND p.state IN ('PENDING', 'DEAD') AND p.seq < o.seq";

/// The targets of cluster URLs ([`OutboxStore::connect`]), kept for the process so their
/// pools follow the primary.
static KEPT_TARGETS: std::sync::Mutex<Vec<std::sync::Arc<idem_store::postgres::target::Target>>> =
    std::sync::Mutex::new(Vec::new());

/// How long a call waits for a pooled connection before it fails: 10 s (sqlx's default
/// is 30 s).
const POOL_ACQUIRE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

impl OutboxStore {
    /// Connects to the application's database at `url` (`postgres://…` or `sqlite://…`).
    /// The schema must be installed (`idem schema install`).
    ///
    /// # Errors
    /// [`OutboxError::Database`] when unreachable (at once: no retry window);
    /// [`OutboxError::Open`] for an SQLite file (or directory) that does not exist;
    /// [`OutboxError::NotInstalled`].
    pub async fn connect(url: &str, max_connections: u32) -> Result<Self, OutboxError> {
        let store = if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            // A cluster's URL (several hosts) is followed to its primary through a
            // failover (idem-store `postgres::target`).
            let target = idem_store::postgres::target::Target::shared(url).map_err(OutboxError::Database)?;
            // One direct connection first: a pool retries a failing connect until its
            // acquire timeout (sqlx's default, 30 s) and then says only "pool timed out";
            // the direct attempt fails at once and names the cause (refused, no such
            // database, bad password). A relay started before its database exits, for its
            // supervisor to restart it.
            let first = target.connect(|o| o).await.map_err(OutboxError::Database)?;
            let options = sqlx::postgres::PgPoolOptions::new()
                .max_connections(max_connections)
                .acquire_timeout(POOL_ACQUIRE_TIMEOUT);
            let pool = target.pool_lazy(options, |o| o);
            let _ = sqlx::Connection::close(first).await;
            if target.host_count() > 1 {
                // The pool follows the primary while its target lives: for the process.
                KEPT_TARGETS.lock().expect("kept targets lock").push(target);
            }
            OutboxStore::Postgres(pool)
        } else {
            let path = crate::error::sqlite_path(url);
            crate::error::check_sqlite_path(path, false)?;
            let opts = sqlx::sqlite::SqliteConnectOptions::new()
                .filename(path)
                .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal)
                .busy_timeout(std::time::Duration::from_secs(10));
            // Plans that do not depend on bound values: without it SQLite parsed and planned
            // the claim (its `LIMIT ?`) and the recording statements again on every tick,
            // 80 % of a relayed event's instructions one at a time (scripts/callgrind.sh).
            let pool = sqlx::sqlite::SqlitePoolOptions::new()
                .max_connections(max_connections)
                .after_connect(|conn, _| Box::pin(idem_store::sqlite::stable_plans_on_connect(conn)))
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
        // Walk PENDING events oldest first (index `outbox_pending`) and keep those with no
        // older open event in their aggregate (an index probe each): a batch costs about
        // `limit` probes, not a pass over the whole backlog.
        let picked = format!(
            "SELECT o.seq FROM idem.outbox o WHERE {due} AND NOT EXISTS ({OLDER_OPEN}) ORDER BY o.seq LIMIT $3"
        );
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
        Ok(self.record_all(&[Recorded { claimed, plan, sink }], relay).await?[0])
    }

    /// [`OutboxStore::record`] for a whole batch, in one statement (PostgreSQL) or one
    /// transaction (SQLite); one flag per outcome, in order.
    ///
    /// # Errors
    /// Database errors (then nothing of the batch is written).
    pub async fn record_all(&self, outcomes: &[Recorded<'_>], relay: &str) -> Result<Vec<bool>, OutboxError> {
        let rows: Vec<RecordRow> = outcomes.iter().map(RecordRow::of).collect();
        let update = "UPDATE idem.outbox SET state = $3, next_attempt_at = $4, evidence = $5, error_class = $6, \
             error_message = $7, sink = $8, delivered_at = CASE WHEN $3 = 'DELIVERED' THEN idem.now_ms() END, \
             lease_owner = NULL, lease_expires_at = NULL, manual = FALSE \
             WHERE seq = $1 AND fencing_token = $2 AND state = 'PENDING'";
        let insert = "INSERT INTO idem.outbox_attempts (event_seq, at, kind, trigger, relay, fencing_token, result, \
             sink, error_class, message, evidence) ";
        match self {
            OutboxStore::Postgres(pool) => {
                // One statement for the batch: the rows as arrays, the update conditional on
                // each row's token, an attempt row for each row updated.
                let sql = format!(
                    "WITH i AS (SELECT * FROM unnest($1::bigint[], $2::bigint[], $3::text[], $4::bigint[], $5::text[], \
                       $6::text[], $7::text[], $8::text[], $9::text[], $10::text[]) \
                       AS t(seq, token, state, next_at, evidence, class, message, sink, trigger, result)), \
                     u AS (UPDATE idem.outbox o SET state = i.state, next_attempt_at = i.next_at, evidence = i.evidence, \
                       error_class = i.class, error_message = i.message, sink = i.sink, \
                       delivered_at = CASE WHEN i.state = 'DELIVERED' THEN idem.now_ms() END, \
                       lease_owner = NULL, lease_expires_at = NULL, manual = FALSE \
                       FROM i WHERE o.seq = i.seq AND o.fencing_token = i.token AND o.state = 'PENDING' \
                       RETURNING o.seq, i.token, i.trigger, i.result, i.sink, i.class, i.message, i.evidence), \
                     a AS ({insert} SELECT seq, {at}, 'attempt', trigger, $11, token, result, sink, class, \
                       message, evidence FROM u) \
                     SELECT seq FROM u",
                    at = trail_at("u.seq")
                );
                let col = |f: fn(&RecordRow) -> Option<String>| rows.iter().map(f).collect::<Vec<_>>();
                let applied: Vec<i64> = sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
                    .bind(rows.iter().map(|r| r.seq).collect::<Vec<_>>())
                    .bind(rows.iter().map(|r| r.token).collect::<Vec<_>>())
                    .bind(col(|r| Some(r.state.to_owned())))
                    .bind(rows.iter().map(|r| r.next_at).collect::<Vec<_>>())
                    .bind(col(|r| r.evidence.clone()))
                    .bind(col(|r| r.class.clone()))
                    .bind(col(|r| r.message.clone()))
                    .bind(col(|r| Some(r.sink.clone())))
                    .bind(col(|r| Some(r.trigger.to_owned())))
                    .bind(col(|r| Some(r.result.to_owned())))
                    .bind(relay)
                    .fetch_all(pool)
                    .await?;
                Ok(rows.iter().map(|r| applied.contains(&r.seq)).collect())
            }
            OutboxStore::Sqlite(pool) => {
                // The statements' text once for the batch, not once per row.
                let update = sqlite(update);
                let insert = sqlite(&format!(
                    "{insert} VALUES ($1, {}, 'attempt', $2, $3, $4, $5, $6, $7, $8, $9)",
                    trail_at("$1")
                ));
                let mut tx = pool.begin_with("BEGIN IMMEDIATE").await?;
                let mut applied = Vec::with_capacity(rows.len());
                for r in &rows {
                    let n = sqlx::query(sqlx::AssertSqlSafe(update.clone()))
                        .bind(r.seq)
                        .bind(r.token)
                        .bind(r.state)
                        .bind(r.next_at)
                        .bind(&r.evidence)
                        .bind(&r.class)
                        .bind(&r.message)
                        .bind(&r.sink)
                        .execute(&mut *tx)
                        .await?
                        .rows_affected();
                    if n == 1 {
                        sqlx::query(sqlx::AssertSqlSafe(insert.clone()))
                            .bind(r.seq)
                            .bind(r.trigger)
                            .bind(relay)
                            .bind(r.token)
                            .bind(r.result)
                            .bind(&r.sink)
                            .bind(&r.class)
                            .bind(&r.message)
                            .bind(&r.evidence)
                            .execute(&mut *tx)
                            .await?;
                    }
                    applied.push(n == 1);
                }
                tx.commit().await?;
                Ok(applied)
            }
        }
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

    /// One event by id, with its audit trail (oldest first: by `at`, which [`trail_at`] keeps
    /// strictly increasing per event).
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
        let audit = format!(
            "INSERT INTO idem.outbox_attempts (event_seq, at, kind, operator, reason) VALUES ($1, {}, $2, $3, $4)",
            trail_at("$1")
        );
        let audit = audit.as_str();
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

    /// Says that `relay` waits for work until `until_ms` from now (ms), so appenders
    /// NOTIFY; or, with `None`, that it is busy (appenders need not). PostgreSQL only (SQLite
    /// has no NOTIFY: a no-op there).
    ///
    /// # Errors
    /// Database errors.
    pub async fn set_idle(&self, relay: &str, for_ms: Option<i64>) -> Result<(), OutboxError> {
        let OutboxStore::Postgres(pool) = self else { return Ok(()) };
        match for_ms {
            Some(ms) => {
                sqlx::query(
                    "INSERT INTO idem.relay_idle (relay, until_ms) VALUES ($1, idem.now_ms() + $2) \
                 ON CONFLICT (relay) DO UPDATE SET until_ms = excluded.until_ms",
                )
                .bind(relay)
                .bind(ms)
                .execute(pool)
                .await?
            }
            None => sqlx::query("DELETE FROM idem.relay_idle WHERE relay = $1").bind(relay).execute(pool).await?,
        };
        Ok(())
    }

    /// Deletes up to `limit` DELIVERED and SKIPPED events appended more than
    /// `retention_ms` ago (with their attempt rows); returns how many.
    ///
    /// # Errors
    /// Database errors.
    pub async fn sweep(&self, retention_ms: i64, limit: i64) -> Result<u64, OutboxError> {
        let sql = "DELETE FROM idem.outbox WHERE seq IN (SELECT seq FROM idem.outbox \
                   WHERE state IN ('DELIVERED', 'SKIPPED') AND created_at < idem.now_ms() - $1 LIMIT $2)";
        Ok(on_pool!(self, |pool, q| sqlx::query(q(sql))
            .bind(retention_ms)
            .bind(limit)
            .execute(pool)
            .await?
            .rows_affected()))
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

/// The `at` (epoch ms) of a new row of event `seq`'s audit trail: now, or 1 ms after the
/// event's latest row when that is not earlier, so the trail's order is the order its rows
/// were written even within one millisecond (a redrive and the manual attempt it causes; a
/// dead attempt and the redrive right after it). Portable SQL (PostgreSQL and SQLite).
fn trail_at(seq: &str) -> String {
    format!(
        "(SELECT CASE WHEN coalesce(max(x.at), 0) >= idem.now_ms() THEN max(x.at) + 1 ELSE idem.now_ms() END \
         FROM idem.outbox_attempts x WHERE x.event_seq = {seq})"
    )
}
