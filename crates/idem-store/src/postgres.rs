//! The PostgreSQL store: several `idem serve` processes share one database.
//!
//! The hot path (`fast.rs`) writes each acquire or completion with one conditional
//! statement that carries its events: `INSERT … ON CONFLICT (tenant, op_key) DO NOTHING`
//! for a new key, `UPDATE … WHERE version = $read AND created_at = $read` for an existing
//! one. Concurrent requests share statements and commits (`Writers`, `batch.rs`), and API
//! keys are served from a per-node cache that every node empties on a key change
//! (`key_cache.rs`, `postgres/key_listener.rs`: LISTEN/NOTIFY). Two racing writers cannot
//! both succeed: the unique constraint or the version condition lets exactly one through. The rest (and the hot
//! path's losers) use one short READ COMMITTED transaction: read the record, let
//! idem-core plan the change, write it conditionally, append the events, commit; a loser
//! rolls back and starts again from a fresh read, at most [`CAS_RETRIES`] times.
//! Migrations take PostgreSQL's advisory lock, so several nodes starting at once apply
//! them once.

use crate::keys::{ApiKeyInfo, Role, hash_secret};
use crate::{AcquireOutcome, CompleteOutcome, CompleteRequest, ListFilter, Page, Store, StoreConfig, StoreError};
use crate::{ReconcileOutcome, ReconcileRequest, RenewRequest, ResolveRequest};
use async_trait::async_trait;
use futures_util::future::BoxFuture;
use idem_core::{AcquireInput, Clock, OperationEvent, OperationRecord};
use sqlx::postgres::{PgPool, PgPoolOptions};
use std::sync::Arc;
use std::time::Duration;

mod ops {
    crate::sql::sql_ops!(sqlx::PgConnection);
}

mod flow_ops {
    crate::flow_sql::flow_ops!(sqlx::PgConnection);
}

mod key_listener;

mod batch;
mod clock;
mod columns;
mod connections;
mod fast;
mod flow_fast;
mod fresh_stats;
pub mod target;

pub use clock::{ClockStatus, DEFAULT_MAX_UNCERTAINTY_MS, DatabaseClock};

/// The hot path's writes, each kind through its own [`batch::Batcher`]:
/// - `claims`: acquires of new keys ([`fast::insert_or_read`]);
/// - `updates`: conditional writes of a read (or cached) record with its events
///   ([`fast::update`]): completions, and acquires that take over an existing key;
/// - `events`: triggers that write nothing but their event (replays, 409s, 422s): every
///   trigger is recorded before it is answered (DESIGN invariant 5).
///
/// Each request is answered after the commit of the statement that carried it. A batch
/// whose statement fails is written again one request at a time, so one bad request
/// cannot fail the others; a key that appears twice in one batch is written on its own
/// after the batch (one row per key per statement).
#[derive(Debug)]
struct Writers {
    claims: batch::Batcher<fast::NewRecord, Result<fast::Claim, StoreError>>,
    updates: batch::Batcher<fast::Update, Result<bool, StoreError>>,
    events: batch::Batcher<Vec<OperationEvent>, Result<(), EventsFailure>>,
}

/// Claims and updates: at most 64 requests a statement; one statement of a kind at a
/// time unless every one in flight has run for 20 ms (a lock wait, a slow disk), then up
/// to 4 (see [`batch`]). 20 ms is several times a loaded commit's median here (2–6 ms),
/// so a normal statement never shares its turn, and a held row lock delays the others
/// by that much at most.
const BATCHES: batch::Policy =
    batch::Policy { max: 64, in_flight: BATCHES_IN_FLIGHT, patience: Duration::from_millis(20) };
/// Batches of one kind in flight at once, at most.
const BATCHES_IN_FLIGHT: usize = 4;
/// Events-only appends (replays, refusals): up to 256 triggers a commit, one at a time
/// (an append takes no row lock, so it cannot wait on one).
const EVENT_BATCHES: batch::Policy = batch::Policy { max: 256, in_flight: 1, patience: Duration::from_secs(3600) };

impl Writers {
    fn spawn(conns: &Arc<connections::Connections>) -> Self {
        let claims = distinct_batcher(
            conns,
            |n: &fast::NewRecord| (n.record.tenant.clone(), n.record.key.clone()),
            |p, many| async move {
                let written = fast::insert_or_read(&p, &many).await;
                (many, written)
            },
        );
        let updates = distinct_batcher(
            conns,
            |u: &fast::Update| (u.record.tenant.clone(), u.record.key.clone()),
            |p, many| async move {
                let written = fast::update(&p, &many).await;
                (many, written)
            },
        );
        let p = conns.clone();
        let events = batch::Batcher::spawn(EVENT_BATCHES, move |batch: Vec<Vec<OperationEvent>>| {
            let p = p.clone();
            async move {
                let n = batch.len();
                let all: Vec<&OperationEvent> = batch.iter().flatten().collect();
                match committed_batch(n, fast::events(&p, &all)).await {
                    Ok(()) => vec![Ok(()); n],
                    Err(e) if n == 1 => vec![Err(EventsFailure::of(&e))],
                    Err(_) => {
                        // One request's events may be what the database refused (a trigger,
                        // a constraint): each request's on its own, so the others are
                        // written and the refused one hears why.
                        let mut out = Vec::with_capacity(n);
                        for events in &batch {
                            let own: Vec<&OperationEvent> = events.iter().collect();
                            out.push(
                                committed_batch(1, fast::events(&p, &own)).await.map_err(|e| EventsFailure::of(&e)),
                            );
                        }
                        out
                    }
                }
            }
        });
        Writers { claims, updates, events }
    }

    /// Claims a new record (see [`fast::insert_or_read`]).
    async fn claim(&self, new: fast::NewRecord) -> Result<fast::Claim, StoreError> {
        self.claims.submit(new).await?
    }

    /// A conditional write (see [`fast::update`]); true if written.
    async fn update(
        &self,
        record: OperationRecord,
        read_version: i64,
        events: Vec<OperationEvent>,
    ) -> Result<bool, StoreError> {
        self.updates.submit(fast::Update { record, read_version, events }).await?
    }

    /// Appends `events` durably (returns after the commit).
    async fn append(&self, events: Vec<OperationEvent>) -> Result<(), StoreError> {
        if events.is_empty() {
            return Ok(());
        }
        match self.events.submit(events).await? {
            Ok(()) => Ok(()),
            Err(e) => Err(e.into_error()),
        }
    }
}

/// Why a request's events were not appended, as the batch writer hands it back (one
/// batch's answer is cloned to each of its requests).
#[derive(Debug, Clone)]
struct EventsFailure {
    message: String,
    /// The database's message when it refused the write ([`StoreError::refusal`]).
    refusal: Option<String>,
}

impl EventsFailure {
    fn of(e: &StoreError) -> Self {
        EventsFailure { message: e.to_string(), refusal: e.refusal().map(str::to_owned) }
    }

    fn into_error(self) -> StoreError {
        match self.refusal {
            Some(why) => StoreError::Refused(why),
            None => StoreError::Database(sqlx::Error::Protocol(format!("appending events failed: {}", self.message))),
        }
    }
}

/// A batcher whose batches go through [`write_distinct`] with `key` and `write` (which
/// gets the writers' connections and the requests, and hands the requests back with its answers).
fn distinct_batcher<T, O, Fut>(
    conns: &Arc<connections::Connections>,
    key: fn(&T) -> (String, String),
    write: impl Fn(Arc<connections::Connections>, Vec<T>) -> Fut + Copy + Send + Sync + 'static,
) -> batch::Batcher<T, Result<O, StoreError>>
where
    T: Send + 'static,
    O: Send + 'static,
    Fut: std::future::Future<Output = (Vec<T>, Result<Vec<O>, StoreError>)> + Send + 'static,
{
    let conns = conns.clone();
    batch::Batcher::spawn(BATCHES, move |items: Vec<T>| {
        let conns = conns.clone();
        async move { write_distinct(items, key, |many| write(conns.clone(), many), lock_timed_out).await }
    })
}

/// Writes `items` with `write` (one statement for many, its rows in key order), keeping
/// each request's answer its own: the first request of each key goes into one statement;
/// if that statement fails, they are written again one per statement; later requests for
/// a key already in the statement are written one per statement after it. Answers are in
/// the order of `items`.
///
/// The statements written again run [`RETRY_CONCURRENCY`] keys at a time, the requests
/// of one key in order — but once one of them gave up on a row lock (`locked`, on
/// PostgreSQL [`lock_timed_out`]) the key's other requests go at once, together: each
/// would wait as long for the same lock. So a batch with locked rows is answered about
/// two lock timeouts late, not one per locked request (a break-it pass: ten completions
/// of one locked lease in a batch held an unrelated completion 1.1 s).
async fn write_distinct<T, O, Fut>(
    items: Vec<T>,
    key: impl Fn(&T) -> (String, String),
    write: impl Fn(Vec<T>) -> Fut,
    locked: impl Fn(&StoreError) -> bool,
) -> Vec<Result<O, StoreError>>
where
    Fut: std::future::Future<Output = (Vec<T>, Result<Vec<O>, StoreError>)>,
{
    use futures_util::StreamExt as _;
    let n = items.len();
    let mut keyed: Vec<((String, String), usize, T)> =
        items.into_iter().enumerate().map(|(i, item)| (key(&item), i, item)).collect();
    // In key order, so that two statements that lock some of the same rows (two batches
    // in flight, or two nodes) take the locks in the same order and cannot deadlock.
    keyed.sort_by(|a, b| (&a.0, a.1).cmp(&(&b.0, b.1)));
    // The first request of each key, and the key's later ones (`later[j]` for `first[j]`).
    let (mut first, mut first_at) = (Vec::with_capacity(n), Vec::with_capacity(n));
    let mut later: Vec<Vec<(usize, T)>> = Vec::with_capacity(n);
    let mut last_key = None;
    for (k, i, item) in keyed {
        if last_key.as_ref() == Some(&k) {
            later.last_mut().expect("a first request of this key").push((i, item));
        } else {
            first.push(item);
            first_at.push(i);
            later.push(Vec::new());
            last_key = Some(k);
        }
    }
    let mut out: Vec<Option<Result<O, StoreError>>> = (0..n).map(|_| None).collect();
    let one = async |item: T| write(vec![item]).await.1.and_then(|mut v| v.pop().ok_or(StoreError::Contention));
    // Requests of one key, in order: after one gave up on the row's lock, the rest at once.
    let one_key = async |requests: Vec<(usize, T)>, mut lock_met: bool| {
        let mut answered = Vec::with_capacity(requests.len());
        let mut requests = requests.into_iter();
        if !lock_met {
            for (i, item) in requests.by_ref() {
                let answer = one(item).await;
                lock_met = answer.as_ref().err().is_some_and(&locked);
                answered.push((i, answer));
                if lock_met {
                    break;
                }
            }
        }
        let rest = requests.map(async |(i, item)| (i, one(item).await));
        answered.extend(futures_util::future::join_all(rest).await);
        answered
    };
    let (first, written) = write(first).await;
    // Keys to write again one request per statement (never empty), and whether a request
    // of the key already gave up on its row's lock.
    let mut again: Vec<(Vec<(usize, T)>, bool)> = Vec::new();
    match written {
        // The statement ran: never write its requests again, whatever it answered.
        Ok(answers) => {
            let complete = answers.len() == first.len();
            let mut answers = answers.into_iter();
            for i in first_at {
                out[i] = Some(match answers.next() {
                    Some(a) if complete => Ok(a),
                    _ => Err(StoreError::Corrupt("a batched statement answered the wrong number of rows".into())),
                });
            }
            again.extend(later.into_iter().filter(|l| !l.is_empty()).map(|l| (l, false)));
        }
        Err(e) if first.len() == 1 => {
            if let Some(rest) = later.pop().filter(|l| !l.is_empty()) {
                again.push((rest, locked(&e)));
            }
            out[first_at[0]] = Some(Err(e));
        }
        // The statement failed as a whole (one request's bad value, a row lock): each on
        // its own.
        Err(_) => {
            for (head, rest) in first_at.into_iter().zip(first).zip(later) {
                again.push((std::iter::once(head).chain(rest).collect(), false));
            }
        }
    }
    if !again.is_empty() {
        let keys = again.into_iter().map(|(requests, lock_met)| one_key(requests, lock_met));
        let mut written = futures_util::stream::iter(keys).buffer_unordered(RETRY_CONCURRENCY);
        while let Some(answers) = written.next().await {
            for (i, answer) in answers {
                out[i] = Some(answer);
            }
        }
    }
    out.into_iter().map(|o| o.unwrap_or(Err(StoreError::Contention))).collect()
}

/// How many keys of a batch [`write_distinct`] writes again at once, one statement each
/// on a writer connection of its own: 4 (a batch whose statement failed opens at most as
/// many connections more).
const RETRY_CONCURRENCY: usize = 4;

/// Awaits a statement or transaction that commits on its own (an autocommit statement
/// of the hot path, or `COMMIT`), recording its latency and a batch of one request.
async fn committed<T, E>(commit: impl std::future::Future<Output = Result<T, E>>) -> Result<T, E> {
    committed_batch(1, commit).await
}

/// [`committed`] for a commit that carries `requests` requests.
async fn committed_batch<T, E>(
    requests: usize,
    commit: impl std::future::Future<Output = Result<T, E>>,
) -> Result<T, E> {
    let start = std::time::Instant::now();
    let out = commit.await;
    if out.is_ok() {
        metrics::histogram!("idem_store_commit_seconds", "backend" => "postgres").record(start.elapsed().as_secs_f64());
        metrics::histogram!("idem_store_batch_size", "backend" => "postgres").record(requests as f64);
    }
    out
}

/// Opens a pool. sqlx keeps retrying a connection that fails (refused, no such database,
/// bad password) until the pool's acquire timeout and then says only "pool timed out while
/// waiting for an open connection"; on that answer one connection is tried directly, so
/// the error names the cause (a helper's break-it pass: a wrong port read as a timeout
/// after 10 s). The retry window is kept, for a server that is still starting.
///
/// # Errors
/// The direct attempt's error, else sqlx's.
pub async fn connect_pool(
    pool: PgPoolOptions,
    options: sqlx::postgres::PgConnectOptions,
) -> Result<PgPool, sqlx::Error> {
    match pool.connect_with(options.clone()).await {
        Err(sqlx::Error::PoolTimedOut) => {
            match <sqlx::PgConnection as sqlx::Connection>::connect_with(&options).await {
                Err(cause) => Err(cause),
                Ok(conn) => {
                    let _ = sqlx::Connection::close(conn).await;
                    Err(sqlx::Error::PoolTimedOut)
                }
            }
        }
        other => other,
    }
}

/// The options of every pooled connection: `url`, plus `plan_cache_mode =
/// force_generic_plan`. The hot path's statements are prepared once per connection (and
/// per batch size) and executed thousands of times a second; by default PostgreSQL plans
/// the first five executions of each anew and keeps re-planning whenever its estimate
/// favours a custom plan, which cost about a tenth of the server's CPU under the
/// benchmark. Every idem statement is an indexed lookup by key, or a background query
/// whose partial index the generic plan uses (checked by
/// `background_queries_use_the_partial_indexes`).
///
/// Also no hash joins and no merge joins: every join idem runs starts from a few rows
/// (one instance's steps, a batch of due keys, a `LIMIT`ed sweep) and looks each one up
/// by key, so a nested loop over index probes is the right plan at any size, and the only
/// one that does not depend on statistics being fresh. A kept plan of the workflow
/// checkpoints query, made from statistics of a smaller ledger, merge-joined one
/// instance's steps with every operation of the tenant in key order (found by a
/// break-it pass: workflow steps 117/s at first, 29/s after ~90 000 operations); checked
/// by `pool_joins_probe_by_key`.
fn pool_options(options: sqlx::postgres::PgConnectOptions) -> sqlx::postgres::PgConnectOptions {
    options.options([
        ("plan_cache_mode", "force_generic_plan"),
        ("enable_hashjoin", "off"),
        ("enable_mergejoin", "off"),
    ])
}

/// The options of the batch writers' own connections: [`pool_options`] (no hash or
/// merge joins) plus no sequential scans, so every lookup of a key in the hot path's
/// statements is a nested loop over an index probe whatever the table's size looked like
/// when the statement was planned.
///
/// The writers' statements are planned once per connection and batch size (generic plans,
/// see [`pool_options`]) and then run for the connection's lifetime. A plan made while
/// `operations` was small, on a fresh database before autovacuum's first ANALYZE, joined
/// the batch's rows to `operations` with a hash join over a sequential scan of the whole
/// table; kept, that plan read every record on every batch, its cost growing with the
/// ledger until an ANALYZE invalidated it (auto_explain under 16 clients on a fresh
/// database: 391 of 5 285 batch statements, 1.3 ms each against 0.17 ms). The joins
/// between the statement's own CTEs (a batch's rows against the rows it inserted) become
/// nested loops too: at most 64 × 64 comparisons of a key, far cheaper than a scan.
/// Checked by `hot_path_statements_probe_the_key_index_on_a_fresh_database`.
///
/// And a lock timeout ([`WRITER_LOCK_TIMEOUT`]): one batch statement carries many
/// requests, so a row lock another transaction holds on one of them (an operator's
/// `SELECT … FOR UPDATE` in psql, another node's transaction, an uncommitted insert of the
/// same key) would hold back every request of the batch, and with batches stuck that way
/// every later one of its kind, for as long as the lock is held (a break-it pass: 9.6 s
/// for 14 unrelated completions under a 10 s lock; four locked rows stopped all
/// completions). Past the timeout the statement fails (`lock_not_available`), its
/// requests are written again one per statement, and the one that still waits leaves
/// the batch writers for the transactional path on a pooled connection, which waits for
/// the lock as long as it is held ([`lock_timed_out`]).
fn writer_options(options: sqlx::postgres::PgConnectOptions) -> sqlx::postgres::PgConnectOptions {
    pool_options(options).options([("enable_seqscan", "off"), ("lock_timeout", WRITER_LOCK_TIMEOUT)])
}

/// How long a batch writer's statement waits for a row lock before it gives up (see
/// [`writer_options`]): long enough for another transaction's ordinary commit, short
/// against the requests it holds back.
const WRITER_LOCK_TIMEOUT: &str = "100ms";

/// The `BEGIN` of a transaction on a pooled connection that waits for a row lock at most
/// [`WRITER_LOCK_TIMEOUT`] (`SET LOCAL`: the connection's own setting is back after the
/// transaction), in the same round trip (see `retrying!`).
const BEGIN_WITH_LOCK_TIMEOUT: &str = "BEGIN; SET LOCAL lock_timeout = '100ms'";

/// Whether `e` is a batch writer's statement that gave up waiting for a lock
/// (`lock_not_available`, SQLSTATE 55P03, after [`WRITER_LOCK_TIMEOUT`]): the request then
/// takes the transactional path, which waits for the lock.
fn lock_timed_out(e: &StoreError) -> bool {
    matches!(e, StoreError::Database(sqlx::Error::Database(db)) if db.code().as_deref() == Some("55P03"))
}

/// Bounded retries of a transaction whose conditional write lost a race.
pub const CAS_RETRIES: usize = 16;
/// Connections per process: four per core, between 8 and 32. The hot path needs few (its
/// batches are at most `3 × BATCHES_IN_FLIGHT` statements at a time), the rest serve
/// reads, the background loops and the fallback transactions; more connections than
/// the database's cores can use only add contention. Each node also holds one
/// connection of its own that listens for API key changes.
fn pool_size() -> u32 {
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
    u32::try_from(cores * 4).unwrap_or(32).clamp(8, 32)
}
/// A pooled connection idle for longer than this is pinged before it is used.
const IDLE_CHECK: Duration = Duration::from_secs(5);

static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations/postgres");

/// The PostgreSQL [`Store`].
#[derive(Debug, Clone)]
pub struct PgStore {
    pool: PgPool,
    clock: Arc<dyn Clock>,
    config: StoreConfig,
    cache: Arc<crate::record_cache::RecordCache>,
    writers: Arc<Writers>,
    keys: Arc<crate::key_cache::KeyCache>,
    /// Requests waiting for a row lock on the transactional path (see [`lock_timed_out`]),
    /// each on a pooled connection: at most half the pool, so reads and the rest keep
    /// theirs; beyond it a locked request is answered [`StoreError::Contention`] at once.
    lock_waiters: Arc<tokio::sync::Semaphore>,
    /// Where the database is (one host, or a cluster's primary), shared by the pool, the
    /// batch writers' connections and the listener for API key changes.
    target: Arc<target::Target>,
}

impl PgStore {
    /// Connects to `url` (`postgres://user@host:port/db`) and applies migrations.
    ///
    /// # Errors
    /// [`StoreError::Database`] if the server cannot be reached, [`StoreError::Migrate`] if
    /// migrations fail.
    pub async fn connect(url: &str, clock: Arc<dyn Clock>, config: StoreConfig) -> Result<Self, StoreError> {
        let target = target::Target::shared(url)?;
        let pool = PgPoolOptions::new()
            .max_connections(pool_size())
            // While the database is down sqlx keeps trying to connect until this runs
            // out: keep it short, so requests fail fast (503) instead of queueing.
            .acquire_timeout(config.acquire_timeout())
            // sqlx pings every idle connection before handing it out: one more network round
            // trip per statement on the hot path. Only a connection left idle for a while is
            // checked (a server restart or a dropped TCP connection shows up there); a busy
            // one has just answered.
            .test_before_acquire(false);
        let pool = target.pool(pool, pool_options, Some(IDLE_CHECK)).await?;
        MIGRATOR.run(&pool).await?;
        let writers = Arc::new(Writers::spawn(&Arc::new(connections::Connections::new(
            target.clone(),
            writer_options,
            config.acquire_timeout(),
        ))));
        fresh_stats::spawn(Arc::downgrade(&writers), pool.clone());
        let keys = Arc::new(crate::key_cache::KeyCache::default());
        key_listener::spawn(&keys, target.clone());
        let lock_waiters = Arc::new(tokio::sync::Semaphore::new(pool_size() as usize / 2));
        Ok(PgStore { pool, clock, config, cache: Default::default(), writers, keys, lock_waiters, target })
    }

    /// idem-core's plan for `req` against `rec` (the store's retry policy unless the
    /// request brings its connector's).
    fn plan_completion(
        &self,
        rec: &OperationRecord,
        req: &CompleteRequest,
    ) -> Result<idem_core::CompletionPlan, idem_core::CompleteError> {
        let policy = req.policy.as_ref().unwrap_or(&self.config.retry_policy);
        idem_core::plan_completion(
            rec,
            req.fencing_token,
            &req.outcome,
            &req.actor,
            policy,
            crate::jitter(),
            self.clock.now_ms(),
        )
    }

    /// Writes a changing completion plan if the stored version is still `read_version`;
    /// `None` when another writer came first.
    async fn write_completion(
        &self,
        mut plan: idem_core::CompletionPlan,
        read_version: i64,
    ) -> Result<Option<CompleteOutcome>, StoreError> {
        self.config.retention.apply(&mut plan.record);
        let events: Vec<_> = plan.event.iter().cloned().collect();
        if !self.writers.update(plan.record.clone(), read_version, events).await? {
            return Ok(None);
        }
        self.cache.put(plan.record.clone());
        Ok(Some(CompleteOutcome { record: plan.record, changed: true }))
    }

    /// Whether this node serves API keys from its cache: true while its connection
    /// listening for key changes is up (see `key_cache.rs`).
    pub fn key_cache_live(&self) -> bool {
        self.keys.is_live()
    }

    /// The connection pool (tests use it to inspect the database).
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }
}

/// Runs `$once` (which takes `&mut PgConnection` as `$conn`) in a fresh transaction until
/// its conditional write wins, at most CAS_RETRIES times.
///
/// A row lock another transaction holds (an operator's `SELECT … FOR UPDATE`, another
/// node's transaction, an uncommitted insert of the same key) is waited for at most
/// [`WRITER_LOCK_TIMEOUT`] ([`BEGIN_WITH_LOCK_TIMEOUT`]); past it the request waits for
/// the lock as long as it is held only with a place among the lock waiters
/// ([`PgStore::lock_waiter`]; `$waiter` when the caller already holds one), else it is
/// refused with [`StoreError::Contention`] at once. Without that, requests for one locked
/// row (ten renewals of a lease an operator held `FOR UPDATE`, a break-it pass) each held
/// a pooled connection for the lock's duration, and once the pool was taken every other
/// request timed out with 503.
macro_rules! retrying {
    ($self:ident, |$conn:ident| $once:expr) => {
        retrying!($self, None, |$conn| $once)
    };
    ($self:ident, $waiter:expr, |$conn:ident| $once:expr) => {{
        let mut waiter: Option<tokio::sync::SemaphorePermit<'_>> = $waiter;
        let mut outcome = Err(StoreError::Contention);
        for _ in 0..CAS_RETRIES {
            let mut tx = match waiter {
                None => $self.pool.begin_with(BEGIN_WITH_LOCK_TIMEOUT).await?,
                Some(_) => $self.pool.begin().await?,
            };
            let $conn: &mut sqlx::PgConnection = &mut tx;
            match $once {
                Ok(Some(o)) => {
                    committed(tx.commit()).await?;
                    outcome = Ok(o);
                    break;
                }
                Ok(None) => tx.rollback().await?,
                Err(e) if waiter.is_none() && lock_timed_out(&e) => {
                    tx.rollback().await?;
                    waiter = Some($self.lock_waiter()?);
                }
                Err(e) => {
                    outcome = Err(e);
                    break;
                }
            }
        }
        outcome
    }};
}

impl PgStore {
    /// A place among the requests waiting for a row lock ([`PgStore::lock_waiters`]).
    ///
    /// # Errors
    /// [`StoreError::Contention`] when every place is taken (try again).
    fn lock_waiter(&self) -> Result<tokio::sync::SemaphorePermit<'_>, StoreError> {
        self.lock_waiters.try_acquire().map_err(|_| StoreError::Contention)
    }

    /// An acquire on the transactional path, on a pooled connection: after a claim that
    /// found neither a record nor room for one (a tombstone, an insert not yet committed),
    /// after [`CAS_RETRIES`] lost races, or when the batch writers would not wait for a
    /// row lock (`locked`): as [`PgStore::complete_waiting`].
    ///
    /// Boxed, as is `complete_waiting`: held inline, this cold path's future made every
    /// acquire's future several KiB, copied whole into its box on each call (see
    /// `batch.rs` for the measured cost).
    fn acquire_waiting<'a>(
        &'a self,
        input: &'a AcquireInput,
        locked: bool,
    ) -> BoxFuture<'a, Result<AcquireOutcome, StoreError>> {
        Box::pin(async move {
            self.cache.forget(&input.tenant, &input.key);
            let waiter = if locked { Some(self.lock_waiter()?) } else { None };
            retrying!(self, waiter, |conn| ops::acquire_once(conn, input, self.clock.now_ms()).await)
        })
    }

    /// A completion on the transactional path, on a pooled connection: after
    /// [`CAS_RETRIES`] lost races, or when the batch writers would not wait for a row
    /// lock (`locked`, [`lock_timed_out`]); this path waits for it, if a waiter's place is
    /// free. Boxed (see `acquire_waiting`).
    fn complete_waiting<'a>(
        &'a self,
        req: &'a CompleteRequest,
        locked: bool,
    ) -> BoxFuture<'a, Result<CompleteOutcome, StoreError>> {
        Box::pin(async move {
            let waiter = if locked { Some(self.lock_waiter()?) } else { None };
            retrying!(self, waiter, |conn| {
                ops::complete_once(
                    conn,
                    req,
                    &self.config.retry_policy,
                    &self.config.retention,
                    crate::jitter(),
                    self.clock.now_ms(),
                )
                .await
            })
        })
    }
}

#[async_trait]
impl Store for PgStore {
    async fn acquire(&self, input: AcquireInput) -> Result<AcquireOutcome, StoreError> {
        let now = self.clock.now_ms();
        // A final record this node wrote: a replay (or a mismatch) needs only its event.
        if let Some(cached) = self.cache.get(&input.tenant, &input.key)
            && cached.state.is_final()
            && cached.expires_at.is_none_or(|end| end > now)
        {
            let plan = idem_core::plan_acquire(Some(&cached), &input, now);
            if !plan.changed {
                self.writers.append(plan.events).await?;
                return Ok(AcquireOutcome { decision: plan.decision, record: plan.record });
            }
        }
        // Most triggers carry a new key: insert it, or learn the stored record, in one go.
        let fresh = idem_core::plan_acquire(None, &input, now);
        let new = fast::NewRecord { record: fresh.record.clone(), events: fresh.events, now_ms: now };
        let mut existing = match self.writers.claim(new).await {
            Ok(fast::Claim::Inserted) => {
                self.cache.put(fresh.record.clone());
                return Ok(AcquireOutcome { decision: fresh.decision, record: fresh.record });
            }
            Ok(fast::Claim::Existing(r)) => Some(*r),
            // A concurrent insert or a tombstone (or a lock the batch writer would not
            // wait for): the transactional path decides.
            Ok(fast::Claim::Neither) => None,
            Err(e) if lock_timed_out(&e) => return self.acquire_waiting(&input, true).await,
            Err(e) => return Err(e),
        };
        for _ in 0..CAS_RETRIES {
            let Some(read) = existing.take() else { break };
            let now = self.clock.now_ms();
            let plan = idem_core::plan_acquire(Some(&read), &input, now);
            let outcome = AcquireOutcome { decision: plan.decision, record: plan.record.clone() };
            if !plan.changed {
                self.writers.append(plan.events).await?;
                self.cache.put(plan.record.clone());
                return Ok(outcome);
            }
            match self.writers.update(plan.record.clone(), read.version, plan.events).await {
                Ok(true) => {
                    self.cache.put(plan.record.clone());
                    return Ok(outcome);
                }
                Ok(false) => {}
                Err(e) if lock_timed_out(&e) => return self.acquire_waiting(&input, true).await,
                Err(e) => return Err(e),
            }
            // Another writer changed it since the read: read again.
            // (`get` is boxed: the cold read does not widen this future.)
            existing = self.get(&input.tenant, &input.key).await?;
        }
        self.acquire_waiting(&input, false).await
    }

    async fn complete(&self, req: CompleteRequest) -> Result<CompleteOutcome, StoreError> {
        // The lease this node granted: complete it without reading it back. The write is
        // conditional on the cached version, so a change elsewhere makes it a no-op.
        if let Some(cached) = self.cache.get(&req.tenant, &req.key)
            && cached.state == idem_core::State::Executing
            && cached.fencing_token == req.fencing_token
        {
            let mut locked = false;
            if let Ok(plan) = self.plan_completion(&cached, &req)
                && plan.changed
            {
                match self.write_completion(plan, cached.version).await {
                    Ok(Some(done)) => return Ok(done),
                    Ok(None) => {}
                    Err(e) if lock_timed_out(&e) => locked = true,
                    Err(e) => return Err(e),
                }
            }
            self.cache.forget(&req.tenant, &req.key);
            if locked {
                return self.complete_waiting(&req, true).await;
            }
        }
        for _ in 0..CAS_RETRIES {
            let Some(rec) = self.get(&req.tenant, &req.key).await? else {
                return Err(StoreError::NotFound);
            };
            let plan = self.plan_completion(&rec, &req)?;
            if !plan.changed {
                return Ok(CompleteOutcome { record: plan.record, changed: false });
            }
            match self.write_completion(plan, rec.version).await {
                Ok(Some(done)) => return Ok(done),
                Ok(None) => {}
                Err(e) if lock_timed_out(&e) => return self.complete_waiting(&req, true).await,
                Err(e) => return Err(e),
            }
        }
        self.complete_waiting(&req, false).await
    }

    async fn renew(&self, req: RenewRequest) -> Result<OperationRecord, StoreError> {
        let renewed = retrying!(self, |conn| ops::renew_once(conn, &req, self.clock.now_ms()).await);
        match &renewed {
            // The completion that usually follows starts from this node's cache.
            Ok(rec) => self.cache.put(rec.clone()),
            Err(_) => self.cache.forget(&req.tenant, &req.key),
        }
        renewed
    }

    async fn get(&self, tenant: &str, key: &str) -> Result<Option<OperationRecord>, StoreError> {
        ops::load(&mut *self.pool.acquire().await?, tenant, key).await
    }

    async fn tombstone(&self, tenant: &str, key: &str) -> Result<Option<idem_core::Tombstone>, StoreError> {
        let mut conn = self.pool.acquire().await?;
        let t = ops::load_tombstone(&mut conn, tenant, &idem_core::retention::key_hash(key)).await?;
        Ok(t.filter(|t| t.expires_at > self.clock.now_ms()))
    }

    async fn events(&self, tenant: &str, key: &str) -> Result<Vec<OperationEvent>, StoreError> {
        ops::events(&mut *self.pool.acquire().await?, tenant, key).await
    }

    async fn list(&self, tenant: &str, filter: &ListFilter) -> Result<Page, StoreError> {
        ops::list(&mut *self.pool.acquire().await?, tenant, filter).await
    }

    async fn overview(
        &self,
        tenant: Option<&str>,
        stale_before_ms: i64,
        recent: i64,
    ) -> Result<crate::Overview, StoreError> {
        ops::overview(&mut *self.pool.acquire().await?, tenant, stale_before_ms, recent).await
    }

    async fn sweep(&self, limit: i64) -> Result<crate::SweepOutcome, StoreError> {
        let mut tx = self.pool.begin().await?;
        let out = ops::sweep(&mut tx, &self.config.retention, self.clock.now_ms(), limit).await?;
        tx.commit().await?;
        Ok(out)
    }

    async fn due_executions(&self, connector: &str, limit: i64) -> Result<Vec<OperationRecord>, StoreError> {
        ops::due_executions(&mut *self.pool.acquire().await?, connector, self.clock.now_ms(), limit).await
    }

    async fn due_reconciliations(&self, limit: i64) -> Result<Vec<OperationRecord>, StoreError> {
        ops::due_reconciliations(&mut *self.pool.acquire().await?, self.clock.now_ms(), limit).await
    }

    async fn reconcile(&self, req: ReconcileRequest) -> Result<ReconcileOutcome, StoreError> {
        retrying!(self, |conn| ops::reconcile_once(
            conn,
            &req,
            &self.config.retention,
            crate::jitter(),
            self.clock.now_ms()
        )
        .await)
    }

    async fn resolve(&self, req: ResolveRequest) -> Result<OperationRecord, StoreError> {
        retrying!(self, |conn| ops::resolve_once(conn, &req, &self.config.retention, self.clock.now_ms()).await)
    }

    async fn expire_leases(&self, limit: i64) -> Result<u64, StoreError> {
        let mut tx = self.pool.begin().await?;
        let n = ops::expire_leases(&mut tx, self.clock.now_ms(), limit).await?;
        tx.commit().await?;
        Ok(n)
    }

    async fn create_api_key(
        &self,
        tenant: &str,
        principal: &str,
        role: Role,
        secret: Option<String>,
    ) -> Result<(ApiKeyInfo, String), StoreError> {
        let (info, secret) = crate::new_key_info(tenant, principal, role, secret, self.clock.now_ms())?;
        ops::insert_api_key(&mut *self.pool.acquire().await?, &info, &hash_secret(&secret)).await?;
        Ok((info, secret))
    }

    async fn authenticate(&self, secret: &str) -> Result<Option<ApiKeyInfo>, StoreError> {
        self.keys
            .authenticate(secret, async |hash| ops::find_api_key(&mut *self.pool.acquire().await?, &hash).await)
            .await
    }

    async fn list_api_keys(&self, tenant: Option<&str>) -> Result<Vec<ApiKeyInfo>, StoreError> {
        ops::list_api_keys(&mut *self.pool.acquire().await?, tenant).await
    }

    async fn revoke_api_key(&self, id: &str) -> Result<bool, StoreError> {
        let revoked = ops::revoke_api_key(&mut *self.pool.acquire().await?, id, self.clock.now_ms()).await?;
        // Other nodes learn it from the trigger's NOTIFY; this one before it answers.
        self.keys.invalidate();
        Ok(revoked)
    }

    async fn revoke_api_key_keeping_an_admin(
        &self,
        tenant: &str,
        id: &str,
    ) -> Result<crate::keys::Revocation, StoreError> {
        let mut tx = self.pool.begin().await?;
        // One revocation per tenant at a time: the check below then sees every earlier one.
        sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended($1, 0))")
            .bind(format!("idem api keys of {tenant}"))
            .execute(&mut *tx)
            .await?;
        let done = ops::revoke_keeping_an_admin(&mut tx, tenant, id, self.clock.now_ms()).await?;
        tx.commit().await?;
        self.keys.invalidate();
        Ok(done)
    }

    async fn count_api_keys(&self) -> Result<i64, StoreError> {
        ops::count_api_keys(&mut *self.pool.acquire().await?).await
    }

    async fn ping(&self) -> Result<(), StoreError> {
        let applied: Result<Option<i64>, sqlx::Error> =
            sqlx::query_scalar("SELECT max(version) FROM _sqlx_migrations").fetch_one(&self.pool).await;
        crate::schema_check(applied.map_err(StoreError::from), &MIGRATOR)
    }

    async fn commit_durability(&self) -> Result<crate::CommitDurability, StoreError> {
        let (commit, standbys): (String, String) = sqlx::query_as(
            "SELECT current_setting('synchronous_commit'), current_setting('synchronous_standby_names')",
        )
        .fetch_one(&self.pool)
        .await?;
        Ok(crate::CommitDurability {
            synchronous_commit: Some(commit),
            synchronous_standby_names: Some(standbys),
            primary: Some(self.target.primary()),
            hosts: self.target.host_count(),
        })
    }

    fn answer_timeout(&self) -> Option<Duration> {
        Some(self.config.answer_timeout())
    }

    /// PostgreSQL keeps its own WAL: nothing here needs a restart of idem.
    fn fatal(&self) -> Option<StoreError> {
        None
    }

    fn flows(&self) -> &dyn crate::flow::WorkflowStore {
        self
    }
}

#[async_trait]
impl crate::flow::WorkflowStore for PgStore {
    async fn start_instance(&self, req: crate::flow::StartRequest) -> Result<crate::flow::StartOutcome, StoreError> {
        retrying!(self, |conn| flow_ops::start_once(conn, &req, self.clock.now_ms()).await)
    }

    async fn instance(
        &self,
        tenant: &str,
        instance_id: &str,
    ) -> Result<Option<idem_core::flow::InstanceRecord>, StoreError> {
        flow_ops::load_instance(&mut *self.pool.acquire().await?, tenant, instance_id).await
    }

    async fn checkpoints(
        &self,
        tenant: &str,
        instance_id: &str,
    ) -> Result<Vec<idem_core::flow::Checkpoint>, StoreError> {
        flow_ops::checkpoints(&mut *self.pool.acquire().await?, tenant, instance_id).await
    }

    async fn definition(
        &self,
        tenant: &str,
        name: &str,
        version: &str,
    ) -> Result<Option<idem_core::flow::Definition>, StoreError> {
        flow_ops::definition(&mut *self.pool.acquire().await?, tenant, name, version).await
    }

    async fn instance_events(
        &self,
        tenant: &str,
        instance_id: &str,
    ) -> Result<Vec<idem_core::flow::InstanceEvent>, StoreError> {
        flow_ops::instance_events(&mut *self.pool.acquire().await?, tenant, instance_id).await
    }

    async fn list_instances(
        &self,
        tenant: &str,
        filter: &crate::flow::InstanceFilter,
    ) -> Result<crate::flow::InstancePage, StoreError> {
        flow_ops::list_instances(&mut *self.pool.acquire().await?, tenant, filter).await
    }

    async fn update_instance(&self, update: crate::flow::InstanceUpdate) -> Result<bool, StoreError> {
        flow_fast::update_instance(&self.pool, &update, &self.config.retention).await
    }

    async fn add_items(&self, items: Vec<idem_core::flow::ItemRow>) -> Result<(), StoreError> {
        let mut tx = self.pool.begin().await?;
        flow_ops::add_items(&mut tx, &items).await?;
        committed(tx.commit()).await?;
        Ok(())
    }

    async fn apply_rerun(&self, write: crate::flow::RerunWrite) -> Result<bool, StoreError> {
        let mut tx = self.pool.begin().await?;
        let written = flow_ops::apply_rerun_once(&mut tx, &write, &self.config.retention).await?;
        if written {
            committed(tx.commit()).await?;
        } else {
            tx.rollback().await?;
        }
        Ok(written)
    }

    async fn claim_due_instances(
        &self,
        limit: i64,
        hold_ms: i64,
    ) -> Result<Vec<idem_core::flow::InstanceRecord>, StoreError> {
        flow_ops::claim_due(&mut *self.pool.acquire().await?, self.clock.now_ms(), hold_ms, limit).await
    }

    async fn step_of_operation(
        &self,
        tenant: &str,
        op_key: &str,
    ) -> Result<Option<idem_core::flow::StepRow>, StoreError> {
        flow_ops::step_of_operation(&mut *self.pool.acquire().await?, tenant, op_key).await
    }

    async fn instance_tombstone(
        &self,
        tenant: &str,
        instance_id: &str,
    ) -> Result<Option<idem_core::flow::InstanceTombstone>, StoreError> {
        let t = flow_ops::load_instance_tombstone(&mut *self.pool.acquire().await?, tenant, instance_id).await?;
        Ok(t.filter(|t| t.expires_at > self.clock.now_ms()))
    }

    async fn count_instances(
        &self,
        tenant: Option<&str>,
    ) -> Result<Vec<(idem_core::flow::InstanceState, i64)>, StoreError> {
        flow_ops::count_instances(&mut *self.pool.acquire().await?, tenant).await
    }

    async fn sweep_instances(&self, limit: i64) -> Result<u64, StoreError> {
        let mut tx = self.pool.begin().await?;
        let n = flow_ops::sweep_instances(&mut tx, &self.config.retention, self.clock.now_ms(), limit).await?;
        tx.commit().await?;
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::{StoreError, write_distinct};
    use std::sync::Mutex;

    /// A `write` that records each statement's keys and refuses a statement holding "bad".
    async fn run(items: Vec<&'static str>) -> (Vec<Result<String, StoreError>>, Vec<Vec<&'static str>>) {
        let statements = Mutex::new(Vec::new());
        let out = write_distinct(
            items,
            |k: &&str| ("t".to_owned(), (*k).to_owned()),
            |many: Vec<&'static str>| {
                statements.lock().unwrap().push(many.clone());
                let answer = if many.contains(&"bad") {
                    Err(StoreError::Contention)
                } else {
                    Ok(many.iter().map(|k| format!("{k}!")).collect())
                };
                async move { (many, answer) }
            },
            |_| false,
        )
        .await;
        (out, statements.into_inner().unwrap())
    }

    #[test]
    fn pooled_transactions_wait_for_a_lock_as_long_as_the_batch_writers() {
        let set = format!("lock_timeout = '{}'", super::WRITER_LOCK_TIMEOUT);
        assert!(super::BEGIN_WITH_LOCK_TIMEOUT.ends_with(&set), "{}", super::BEGIN_WITH_LOCK_TIMEOUT);
    }

    fn answers(out: Vec<Result<String, StoreError>>) -> Vec<String> {
        out.into_iter().map(|r| r.unwrap_or_else(|e| format!("error: {e}"))).collect()
    }

    #[tokio::test]
    async fn one_statement_in_key_order_and_answers_in_request_order() {
        let (out, statements) = run(vec!["c", "a", "b"]).await;
        assert_eq!(answers(out), ["c!", "a!", "b!"]);
        assert_eq!(statements, [vec!["a", "b", "c"]]);
    }

    #[tokio::test]
    async fn a_key_seen_twice_is_written_on_its_own_after_the_statement() {
        let (out, statements) = run(vec!["b", "a", "b"]).await;
        assert_eq!(answers(out), ["b!", "a!", "b!"]);
        assert_eq!(statements, [vec!["a", "b"], vec!["b"]]);
    }

    /// Statements with "locked" wait 100 ms and give up, as on a row lock.
    async fn run_locked(items: Vec<&'static str>) -> (Vec<Result<String, StoreError>>, std::time::Duration) {
        let started = std::time::Instant::now();
        let out = write_distinct(
            items,
            |k: &&str| ("t".to_owned(), (*k).to_owned()),
            |many: Vec<&'static str>| async move {
                if many.contains(&"locked") {
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                    (many, Err(StoreError::Contention))
                } else {
                    let answer = Ok(many.iter().map(|k| format!("{k}!")).collect());
                    (many, answer)
                }
            },
            |e| matches!(e, StoreError::Contention),
        )
        .await;
        (out, started.elapsed())
    }

    #[tokio::test]
    async fn requests_of_a_locked_row_give_up_together_not_one_after_another() {
        // Ten requests of one locked row beside two others: the batch (100 ms), the
        // locked row's first request alone (100 ms), its nine others at once (100 ms).
        let mut items = vec!["a"];
        items.extend(["locked"; 10]);
        items.push("z");
        let (out, took) = run_locked(items).await;
        let out = answers(out);
        assert_eq!((out[0].as_str(), out[11].as_str()), ("a!", "z!"));
        assert!(out[1..11].iter().all(|o| o.starts_with("error")), "{out:?}");
        let ms = took.as_millis();
        assert!((300..700).contains(&ms), "{ms} ms (one after another: 1 100 ms)");
        // Alone in its statement: its later requests go at once after it.
        let (_, took) = run_locked(vec!["locked"; 5]).await;
        let ms = took.as_millis();
        assert!((200..450).contains(&ms), "{ms} ms (one after another: 500 ms)");
    }

    #[tokio::test]
    async fn a_failed_statement_is_retried_one_request_at_a_time() {
        let (out, statements) = run(vec!["a", "bad", "c"]).await;
        let out = answers(out);
        assert_eq!((&out[0], &out[2]), (&"a!".to_owned(), &"c!".to_owned()));
        assert!(out[1].starts_with("error"), "{out:?}");
        assert_eq!(statements, [vec!["a", "bad", "c"], vec!["a"], vec!["bad"], vec!["c"]]);
    }
}
