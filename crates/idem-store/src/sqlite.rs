//! The embedded SQLite store: one file, WAL, pipelined group commit.
//!
//! Writes: one writer thread owns the only write connection. It takes the first waiting
//! request, then every other request already queued (up to [`MAX_BATCH`]), runs them in
//! one `BEGIN IMMEDIATE` transaction (the hot path in `sqlite_batch`; other commands each
//! inside its own `SAVEPOINT`, so one request's database error rolls back only that
//! request), commits once, and hands the answers to the WAL's sync thread
//! (`sqlite_sync`), which fsyncs the log and only then answers, while the writer runs the
//! next batch. An acknowledged write is therefore durable, and N concurrent requests cost
//! one fsync instead of N. Reads wait until what they may have seen is durable.
//!
//! `BEGIN IMMEDIATE` takes the write lock up front: a DEFERRED transaction that upgrades
//! from read to write can fail with SQLITE_BUSY without waiting (CRATES.md §4.3).
//! Another process writing the same file (e.g. `idem keys create`) waits on `busy_timeout`.
//!
//! Reads go to a separate pool of connections, which WAL lets run beside the writer.
//! One `idem serve` per SQLite file; use PostgreSQL for several nodes.

use crate::keys::{ApiKeyInfo, Role, hash_secret};
use crate::{AcquireOutcome, CompleteOutcome, CompleteRequest, ListFilter, Page, Store, StoreConfig, StoreError};
use crate::{ReconcileOutcome, ReconcileRequest, RenewRequest, ResolveRequest};
use async_trait::async_trait;
use idem_core::{AcquireInput, Clock, OperationEvent, OperationRecord};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous};
use sqlx::{ConnectOptions, Connection, SqliteConnection};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};

mod ops {
    crate::sql::sql_ops!(sqlx::SqliteConnection);
}

mod flow_ops {
    crate::flow_sql::flow_ops!(sqlx::SqliteConnection);
}

/// Most requests committed in one transaction.
pub const MAX_BATCH: usize = 256;
/// The writer's checkpoint interval: SQLite copies the WAL back into the database file
/// (and fsyncs both, three fsyncs that stall the writer) once the WAL holds this many
/// pages, 4 000 × 4 KiB ≈ 16 MiB, instead of SQLite's default 1 000. Under load the same
/// index pages are written again and again, so a longer interval copies fewer pages per
/// commit and stalls the writer a quarter as often: `idem bench` embedded SQLite at
/// concurrency 64, 8-second runs interleaved, 5 627 / 5 269 → 7 725 / 5 995 pairs/s (and
/// 6 554 / 6 508 at 10 000 pages). The cost: the `-wal` file grows to ~16 MiB before
/// the log starts over, and a restart after a crash reads up to that much.
const WAL_AUTOCHECKPOINT: &str = "PRAGMA wal_autocheckpoint = 4000";
/// How long a writer or a reader waits for another process's lock.
const BUSY_TIMEOUT: Duration = Duration::from_secs(10);

static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations/sqlite");

type Reply<T> = oneshot::Sender<Result<T, StoreError>>;

/// A write request for the writer task.
enum Command {
    Acquire(AcquireInput, Reply<AcquireOutcome>),
    Complete(CompleteRequest, Reply<CompleteOutcome>),
    Renew(RenewRequest, Reply<OperationRecord>),
    ExpireLeases(i64, Reply<u64>),
    Sweep(i64, Reply<crate::SweepOutcome>),
    Reconcile(ReconcileRequest, Reply<ReconcileOutcome>),
    Resolve(ResolveRequest, Reply<OperationRecord>),
    CreateKey(ApiKeyInfo, String, Reply<()>),
    RevokeKey(String, Reply<bool>),
    RevokeKeyKeepingAdmin(String, String, Reply<crate::keys::Revocation>),
    StartInstance(Box<crate::flow::StartRequest>, Reply<crate::flow::StartOutcome>),
    UpdateInstance(Box<crate::flow::InstanceUpdate>, Reply<bool>),
    ApplyRerun(Box<crate::flow::RerunWrite>, Reply<bool>),
    AddItems(Vec<idem_core::flow::ItemRow>, Reply<()>),
    ClaimDueInstances { limit: i64, hold_ms: i64, reply: Reply<Vec<idem_core::flow::InstanceRecord>> },
    SweepInstances(i64, Reply<u64>),
}

/// The SQLite [`Store`].
#[derive(Debug, Clone)]
pub struct SqliteStore {
    writer: mpsc::Sender<Command>,
    readers: SqlitePool,
    clock: Arc<dyn Clock>,
    keys: Arc<crate::key_cache::KeyCache>,
    /// What the writer has committed and what of it is durable: reads wait for it.
    durability: Arc<crate::sqlite_sync::Durability>,
}

/// How often a server reads `api_key_epoch` (migration 0007) to learn of API key changes
/// made outside it (the CLI on the same file, or by hand): the longest a key revoked that
/// way keeps working on it. A revocation through the server itself takes effect at once.
pub const KEY_EPOCH_POLL: Duration = Duration::from_millis(100);

/// Empties `cache` whenever `api_key_epoch` changes, and keeps it in use only while that
/// counter can be read; stops when the store is gone.
fn spawn_key_epoch_poller(cache: &Arc<crate::key_cache::KeyCache>, readers: SqlitePool) {
    let cache = Arc::downgrade(cache);
    tokio::spawn(async move {
        let mut seen: Option<i64> = None;
        loop {
            let epoch: Result<(i64,), sqlx::Error> =
                sqlx::query_as("SELECT epoch FROM api_key_epoch WHERE id = 1").fetch_one(&readers).await;
            let Some(cache) = cache.upgrade() else { return };
            match epoch {
                Ok((e,)) if seen == Some(e) => {}
                Ok((e,)) => {
                    // First read, or a change: start over (set_live empties the cache).
                    cache.set_live(true);
                    seen = Some(e);
                }
                Err(e) => {
                    if cache.is_live() {
                        tracing::warn!(error = %e, "cannot read api_key_epoch; reading keys from the database");
                    }
                    cache.set_live(false);
                    seen = None;
                }
            }
            drop(cache);
            tokio::time::sleep(KEY_EPOCH_POLL).await;
        }
    });
}

fn options(path: &Path) -> SqliteConnectOptions {
    SqliteConnectOptions::new()
        .filename(path)
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .synchronous(SqliteSynchronous::Full)
        .busy_timeout(BUSY_TIMEOUT)
        .foreign_keys(true)
        // Statement journals (the undo log of a SAVEPOINT or of one statement inside the
        // transaction) in memory instead of a temporary file created, written and deleted
        // per batch. They only serve rollbacks inside an open transaction; crash recovery
        // uses the WAL, so durability is unchanged.
        .pragma("temp_store", "memory")
}

/// Turns on SQLite's query planner stability guarantee (`SQLITE_DBCONFIG_ENABLE_QPSG`,
/// <https://www.sqlite.org/c3ref/c_dbconfig_defensive.html>) on one connection.
///
/// Without it SQLite plans some statements for the values bound at their first run and
/// marks them expired whenever those parameters are bound again: any `LIMIT ?` (the
/// planner reads the bound limit, `sqlite3ExprIsInteger`) and any `col = ?` next to a
/// partial index. sqlx clears the bindings after every run, so each run of such a
/// statement was parsed and planned again (`sqlite3Reprepare`, about 180 000 instructions
/// each): the lease sweeper, the retention sweep, the reconciler's and the workflow
/// engine's polls, at about 7 re-prepares a second with nothing to do, half the idle
/// server's instructions (scripts/callgrind.sh: idle 2.66 M -> 1.10 M instructions/s).
/// Plans no longer depend on bound values; the statements' plans are checked by
/// `testing::hot_read_plans_sqlite` and `conformance background_queries_use_the_partial_indexes`.
/// The outbox relay's SQLite pool (idem-outbox) sets it too: its claim's `LIMIT ?` was
/// re-prepared on every tick.
///
/// # Errors
/// [`StoreError::Database`] if the connection's worker thread is gone or SQLite refuses
/// the setting.
pub async fn stable_plans(conn: &mut SqliteConnection) -> Result<(), StoreError> {
    let mut handle = conn.lock_handle().await?;
    let db = handle.as_raw_handle().as_ptr();
    let mut on: std::os::raw::c_int = 0;
    // SAFETY: `lock_handle` gives exclusive use of the open handle for this call, and
    // SQLITE_DBCONFIG_ENABLE_QPSG takes (int, int*) as passed.
    let rc = unsafe { libsqlite3_sys::sqlite3_db_config(db, libsqlite3_sys::SQLITE_DBCONFIG_ENABLE_QPSG, 1, &mut on) };
    if rc != libsqlite3_sys::SQLITE_OK || on != 1 {
        return Err(StoreError::Database(sqlx::Error::Protocol(format!(
            "sqlite3_db_config(SQLITE_DBCONFIG_ENABLE_QPSG) failed: rc {rc}, setting {on}"
        ))));
    }
    Ok(())
}

/// [`stable_plans`] for a pool's `after_connect` hook, which wants sqlx's error: the
/// ledger's readers and the outbox relay's pool (idem-outbox) both set it this way.
///
/// # Errors
/// As [`stable_plans`], as [`sqlx::Error::Protocol`] with its message.
pub async fn stable_plans_on_connect(conn: &mut SqliteConnection) -> Result<(), sqlx::Error> {
    stable_plans(conn).await.map_err(|e| sqlx::Error::Protocol(e.to_string()))
}

/// An exclusive lock on `{path}.migrate-lock` (created if missing), waited for on a
/// blocking thread; released when the file is dropped.
async fn migration_lock(path: &Path) -> Result<std::fs::File, StoreError> {
    let mut lock_path = path.as_os_str().to_owned();
    lock_path.push(".migrate-lock");
    let file = std::fs::OpenOptions::new().create(true).truncate(false).write(true).open(&lock_path).map_err(|e| {
        StoreError::Invalid(format!("cannot create {}: {e}", std::path::Path::new(&lock_path).display()))
    })?;
    tokio::task::spawn_blocking(move || file.lock().map(|()| file))
        .await
        .map_err(|e| StoreError::Invalid(format!("waiting for the migration lock failed: {e}")))?
        .map_err(|e| StoreError::Invalid(format!("cannot lock the database for its migrations: {e}")))
}

impl SqliteStore {
    /// Opens (creating if missing) the database file at `path` and applies migrations.
    ///
    /// # Errors
    /// [`StoreError::Database`] if the file cannot be opened, [`StoreError::Migrate`] if
    /// migrations fail.
    pub async fn open(path: impl AsRef<Path>, clock: Arc<dyn Clock>, config: StoreConfig) -> Result<Self, StoreError> {
        let opts = options(path.as_ref());
        // Migrations on a connection of their own, closed before the writer's opens: a
        // connection that had run a migration's DDL (a table rebuild, measured) kept
        // SQLite's lookaside memory (its small per-connection allocator) full, and every
        // bound value of the writer's statements then went to malloc: ~66 allocations and
        // ~20 000 instructions per acquire (scripts/callgrind.sh). A fresh connection
        // parses the schema with lookaside off.
        // sqlx takes no lock to migrate SQLite, so two processes opening a new file at once
        // (two `idem mcp` guards on one ledger) both ran migration 8, and one failed
        // ("duplicate column name"). An exclusive lock beside the file, held while
        // migrating, makes the second wait and find the schema done.
        let lock = migration_lock(path.as_ref()).await?;
        let mut migrating = opts.clone().connect().await?;
        MIGRATOR.run(&mut migrating).await?;
        sqlx::Connection::close(migrating).await?;
        drop(lock);
        let mut conn = opts.clone().connect().await?;
        stable_plans(&mut conn).await?;
        // The writer's commits write the WAL without an fsync; the sync thread fsyncs it
        // before any answer (sqlite_sync). A read first, so that the WAL file exists.
        exec(&mut conn, "PRAGMA synchronous = NORMAL").await?;
        exec(&mut conn, WAL_AUTOCHECKPOINT).await?;
        sqlx::query("SELECT count(*) FROM sqlite_schema").execute(&mut conn).await?;
        let wal = with_db(&mut conn, crate::sqlite_ffi::Db::wal_path).await?;
        let wal = wal.ok_or_else(|| StoreError::Invalid("the SQLite database has no write-ahead log file".into()))?;
        let syncer = crate::sqlite_sync::Syncer::start(&wal)?;
        let durability = syncer.durability().clone();
        // No ping before handing out a reader: a connection to a local file does not go
        // stale, and the ping is one more round trip to the connection's thread per read.
        let readers = SqlitePoolOptions::new()
            .max_connections(8)
            .acquire_timeout(config.acquire_timeout())
            .test_before_acquire(false)
            .after_connect(|conn, _| Box::pin(stable_plans_on_connect(conn)))
            .connect_with(opts.read_only(true))
            .await?;
        let (tx, rx) = mpsc::channel(4 * MAX_BATCH);
        // The writer on a thread of its own: its hot path waits in SQLite's fsync on this
        // thread (it used to be sqlx's connection thread), never on a worker of the
        // server's runtime.
        let writer_clock = clock.clone();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| StoreError::Invalid(format!("cannot start the SQLite writer: {e}")))?;
        std::thread::Builder::new()
            .name("idem-sqlite-writer".into())
            .spawn(move || runtime.block_on(writer_loop(conn, rx, writer_clock, config, syncer)))
            .map_err(|e| StoreError::Invalid(format!("cannot start the SQLite writer: {e}")))?;
        let keys = Arc::new(crate::key_cache::KeyCache::default());
        spawn_key_epoch_poller(&keys, readers.clone());
        Ok(SqliteStore { writer: tx, readers, clock, keys, durability })
    }

    async fn send<T>(&self, make: impl FnOnce(Reply<T>) -> Command) -> Result<T, StoreError> {
        let (tx, rx) = oneshot::channel();
        self.writer.send(make(tx)).await.map_err(|_| StoreError::Closed)?;
        rx.await.map_err(|_| StoreError::Closed)?
    }
}

/// Why a batch's writes are not acknowledged.
#[derive(Debug, Clone)]
enum Unacknowledged {
    /// Its `COMMIT` (or its transaction) failed: what SQLite said.
    Commit(String),
    /// It committed, but the WAL's fsync failed (`sqlite_sync`).
    NotDurable(String),
}

impl Unacknowledged {
    fn error(&self) -> StoreError {
        match self {
            Unacknowledged::Commit(e) => StoreError::Database(sqlx::Error::Protocol(format!("commit failed: {e}"))),
            Unacknowledged::NotDurable(e) => StoreError::NotDurable(e.clone()),
        }
    }
}

/// A finished request whose answer waits for the commit and its fsync.
type Pending = Box<dyn FnOnce(Option<&Unacknowledged>) + Send>;

fn pending<T: Send + 'static>(reply: Reply<T>, result: Result<T, StoreError>) -> Pending {
    Box::new(move |failed: Option<&Unacknowledged>| {
        let answer = match (failed, result) {
            (Some(f), Ok(_)) => Err(f.error()),
            (_, r) => r,
        };
        let _ = reply.send(answer);
    })
}

async fn exec(conn: &mut SqliteConnection, sql: &'static str) -> Result<(), sqlx::Error> {
    sqlx::query(sql).execute(&mut *conn).await.map(|_| ())
}

/// Runs one command inside the open transaction, under a savepoint.
async fn run_one(conn: &mut SqliteConnection, cmd: Command, clock: &dyn Clock, config: &StoreConfig) -> Pending {
    // A savepoint per request: a database error undoes this request only.
    if let Err(e) = exec(conn, "SAVEPOINT req").await {
        return fail(cmd, e.into());
    }
    // Inside BEGIN IMMEDIATE this connection holds the write lock and read the record
    // in the same transaction, so a conditional write cannot lose a race: `None` means the
    // database did not apply it (a trigger on idem's tables), reported, never retried.
    macro_rules! guarded {
        ($reply:expr, $body:expr) => {{
            let result = $body;
            let finish = if result.is_ok() {
                exec(conn, "RELEASE req").await
            } else {
                match exec(conn, "ROLLBACK TO req").await {
                    Ok(()) => exec(conn, "RELEASE req").await,
                    Err(e) => Err(e),
                }
            };
            // The request's own error first: after a trigger's RAISE(ROLLBACK) the savepoint
            // is gone too, and "no such savepoint" would hide why.
            pending($reply, result.and_then(|v| finish.map_err(StoreError::from).map(|()| v)))
        }};
    }
    let now = clock.now_ms();
    match cmd {
        Command::Acquire(input, reply) => {
            guarded!(reply, ops::acquire_once(conn, &input, now).await.and_then(|o| o.ok_or_else(unapplied)))
        }
        Command::Complete(req, reply) => guarded!(
            reply,
            ops::complete_once(conn, &req, &config.retry_policy, &config.retention, crate::jitter(), now)
                .await
                .and_then(|o| o.ok_or_else(unapplied))
        ),
        Command::Renew(req, reply) => {
            guarded!(reply, ops::renew_once(conn, &req, now).await.and_then(|o| o.ok_or_else(unapplied)))
        }
        Command::ExpireLeases(limit, reply) => {
            guarded!(reply, ops::expire_leases(conn, now, limit).await)
        }
        Command::Sweep(limit, reply) => {
            guarded!(reply, ops::sweep(conn, &config.retention, now, limit).await)
        }
        Command::Reconcile(req, reply) => guarded!(
            reply,
            ops::reconcile_once(conn, &req, &config.retention, crate::jitter(), now)
                .await
                .and_then(|o| o.ok_or_else(unapplied))
        ),
        Command::Resolve(req, reply) => guarded!(
            reply,
            ops::resolve_once(conn, &req, &config.retention, now).await.and_then(|o| o.ok_or_else(unapplied))
        ),
        Command::CreateKey(info, hash, reply) => {
            guarded!(reply, ops::insert_api_key(conn, &info, &hash).await)
        }
        Command::RevokeKey(id, reply) => guarded!(reply, ops::revoke_api_key(conn, &id, now).await),
        Command::RevokeKeyKeepingAdmin(tenant, id, reply) => {
            guarded!(reply, ops::revoke_keeping_an_admin(conn, &tenant, &id, now).await)
        }
        Command::StartInstance(req, reply) => {
            guarded!(reply, flow_ops::start_once(conn, &req, now).await.and_then(|o| o.ok_or_else(unapplied)))
        }
        Command::UpdateInstance(u, reply) => {
            guarded!(reply, flow_ops::update_instance_once(conn, &u, &config.retention).await)
        }
        Command::ApplyRerun(r, reply) => {
            guarded!(reply, flow_ops::apply_rerun_once(conn, &r, &config.retention).await)
        }
        Command::AddItems(items, reply) => guarded!(reply, flow_ops::add_items(conn, &items).await),
        Command::ClaimDueInstances { limit, hold_ms, reply } => {
            guarded!(reply, flow_ops::claim_due(conn, now, hold_ms, limit).await)
        }
        Command::SweepInstances(limit, reply) => {
            guarded!(reply, flow_ops::sweep_instances(conn, &config.retention, now, limit).await)
        }
    }
}

/// The acquires and completions of `cmds`, as the batch writer sees them.
fn hot_views(cmds: &[Command]) -> Vec<crate::sqlite_batch::Hot<'_>> {
    use crate::sqlite_batch::Hot;
    cmds.iter()
        .filter_map(|c| match c {
            Command::Acquire(i, _) => Some(Hot::Acquire(i)),
            Command::Complete(r, _) => Some(Hot::Complete(r)),
            _ => None,
        })
        .collect()
}

/// Pairs hot commands with their answers, in order.
fn answers(cmds: impl Iterator<Item = Command>, results: Vec<crate::sqlite_batch::HotResult>) -> Vec<Pending> {
    use crate::sqlite_batch::HotResult;
    cmds.zip(results)
        .map(|(cmd, res)| match (cmd, res) {
            (Command::Acquire(_, reply), HotResult::Acquire(r)) => pending(reply, r),
            (Command::Complete(_, reply), HotResult::Complete(r)) => pending(reply, r),
            (cmd, _) => fail(cmd, StoreError::Corrupt("batch answers out of order".into())),
        })
        .collect()
}

fn is_hot(cmd: &Command) -> bool {
    matches!(cmd, Command::Acquire(..) | Command::Complete(..))
}

/// Runs a run of acquires and completions as one segment (see `sqlite_batch`): a few
/// statements for all of them. On a database error the segment is undone and its
/// requests run one by one, so one bad request cannot fail the others.
async fn run_hot(
    conn: &mut SqliteConnection,
    segment: Vec<Command>,
    clock: &dyn Clock,
    config: &StoreConfig,
) -> (Vec<Pending>, Vec<Command>) {
    use crate::sqlite_batch::run_segment;
    if let Err(e) = exec(conn, "SAVEPOINT seg").await {
        let msg = e.to_string();
        let failed = segment.into_iter().map(|c| fail(c, StoreError::Database(sqlx::Error::Protocol(msg.clone()))));
        return (failed.collect(), Vec::new());
    }
    let outcome = { run_segment(conn, &hot_views(&segment), config, clock.now_ms()).await };
    match outcome {
        Ok(results) if exec(conn, "RELEASE seg").await.is_ok() => (answers(segment.into_iter(), results), Vec::new()),
        other => {
            if let Err(e) = &other {
                tracing::warn!(error = %e, "group-commit segment failed; retrying its requests one by one");
            }
            let _ = exec(conn, "ROLLBACK TO seg").await;
            let _ = exec(conn, "RELEASE seg").await;
            let mut done = Vec::with_capacity(segment.len());
            let mut cmds = segment.into_iter();
            while transaction_open(conn).await
                && let Some(cmd) = cmds.next()
            {
                done.push(run_one(conn, cmd, clock, config).await);
            }
            // What is left would run outside any transaction (see `transaction_open`): the
            // caller runs it in transactions of its own.
            (done, cmds.collect())
        }
    }
}

fn fail(cmd: Command, e: StoreError) -> Pending {
    match cmd {
        Command::Acquire(_, r) => pending(r, Err(e)),
        Command::Complete(_, r) => pending(r, Err(e)),
        Command::Renew(_, r) => pending(r, Err(e)),
        Command::ExpireLeases(_, r) => pending(r, Err(e)),
        Command::Sweep(_, r) => pending(r, Err(e)),
        Command::Reconcile(_, r) => pending(r, Err(e)),
        Command::Resolve(_, r) => pending(r, Err(e)),
        Command::CreateKey(_, _, r) => pending(r, Err(e)),
        Command::RevokeKey(_, r) => pending(r, Err(e)),
        Command::RevokeKeyKeepingAdmin(_, _, r) => pending(r, Err(e)),
        Command::StartInstance(_, r) => pending(r, Err(e)),
        Command::UpdateInstance(_, r) => pending(r, Err(e)),
        Command::ApplyRerun(_, r) => pending(r, Err(e)),
        Command::AddItems(_, r) => pending(r, Err(e)),
        Command::ClaimDueInstances { reply, .. } => pending(reply, Err(e)),
        Command::SweepInstances(_, r) => pending(r, Err(e)),
    }
}

async fn writer_loop(
    mut conn: SqliteConnection,
    mut rx: mpsc::Receiver<Command>,
    clock: Arc<dyn Clock>,
    config: StoreConfig,
    syncer: crate::sqlite_sync::Syncer,
) {
    let durability = syncer.durability().clone();
    let mut batch = Vec::with_capacity(MAX_BATCH);
    let mut cache = crate::sqlite_batch::WriterCache::default();
    let mut stmts = crate::sqlite_ffi::Statements::default();
    let mut open = rx.recv_many(&mut batch, MAX_BATCH).await > 0;
    while open {
        if let Some(StoreError::NotDurable(why)) = durability.failure() {
            // The WAL could not be synced: no more writes until a restart (sqlite_sync).
            let failed = batch.drain(..).map(|cmd| fail(cmd, StoreError::NotDurable(why.clone()))).collect();
            answer(failed, None, 0);
        } else if batch.iter().all(is_hot) {
            // A run of hot batches keeps the connection taken from sqlx's thread (each
            // handoff wakes that thread twice) until a batch needs sqlx: one with another
            // command, or one the fast path gave back (`Fast::Retry`).
            match conn.lock_handle().await {
                Err(e) => answer(begin_failed(batch.drain(..), &e.to_string()), None, 0),
                Ok(mut locked) => {
                    // SAFETY: the handle is the writer's alone while `locked` lives, and
                    // `db` is not used after it drops (the end of this block).
                    let db = unsafe { crate::sqlite_ffi::Db::new(locked.as_raw_handle()) };
                    loop {
                        let n = batch.len();
                        let before = db.total_changes();
                        let views = hot_views(&batch);
                        let outcome = crate::sqlite_batch::run_batch(
                            db,
                            &mut stmts,
                            &views,
                            &config,
                            clock.now_ms(),
                            &mut cache,
                            || {
                                durability.committing();
                            },
                        );
                        drop(views);
                        match fast_answers(&mut batch, outcome) {
                            Some((done, commit_error)) => {
                                let wrote = db.total_changes() != before;
                                hand_over(&syncer, wrote, done, commit_error, n)
                            }
                            // Rolled back: the general path below runs the batch again.
                            None => break,
                        }
                        open = rx.recv_many(&mut batch, MAX_BATCH).await > 0;
                        if !open || !batch.iter().all(is_hot) || durability.failure().is_some() {
                            break;
                        }
                    }
                }
            }
        }
        if !batch.is_empty() && durability.failure().is_none() {
            let n = batch.len();
            let before = total_changes(&mut conn).await;
            let (done, commit_error) =
                run_general(&mut conn, &mut batch, clock.as_ref(), &config, &mut cache, &durability).await;
            let wrote = before.is_none() || total_changes(&mut conn).await != before;
            hand_over(&syncer, wrote, done, commit_error, n);
        }
        if open && batch.is_empty() {
            open = rx.recv_many(&mut batch, MAX_BATCH).await > 0;
        }
    }
    // Every answer handed over is sent (after its fsync) before the connection closes.
    drop(syncer);
    // The C API's statements go before sqlx closes the connection (its sqlite3_close
    // panics while one is open), under the connection's lock.
    {
        let _locked = conn.lock_handle().await;
        stmts.clear();
    }
    let _ = conn.close().await;
}

/// Hands a batch's answers to the WAL's sync thread: they are sent once the batch's
/// writes (`wrote`) are durable, after every earlier batch's (`sqlite_sync`).
fn hand_over(
    syncer: &crate::sqlite_sync::Syncer,
    wrote: bool,
    done: Vec<Pending>,
    commit_error: Option<String>,
    n: usize,
) {
    syncer.submit(
        wrote,
        Box::new(move |synced: Result<(), &str>| {
            let failed = match (commit_error, synced) {
                (Some(e), _) => Some(Unacknowledged::Commit(e)),
                (None, Err(e)) => Some(Unacknowledged::NotDurable(e.to_owned())),
                (None, Ok(())) => None,
            };
            answer(done, failed, n);
        }),
    );
}

/// Sends a batch's answers, once its commit ended (`commit_error` if it failed), and
/// counts the batch (`n` requests) when it committed.
fn answer(done: Vec<Pending>, failed: Option<Unacknowledged>, n: usize) {
    if failed.is_none() && n > 0 {
        metrics::histogram!("idem_store_batch_size", "backend" => "sqlite").record(n as f64);
    }
    tracing::trace!(batch = done.len(), "sqlite group commit");
    for p in done {
        p(failed.as_ref());
    }
}

/// A conditional write that changed no row under the write lock (see `run_one`).
fn unapplied() -> StoreError {
    StoreError::NotStored("a conditional write changed no row under the write lock".into())
}

/// The answers to every request of `batch` when its transaction could not begin (`msg`):
/// nothing ran.
fn begin_failed(batch: impl IntoIterator<Item = Command>, msg: &str) -> Vec<Pending> {
    let failure = || StoreError::Database(sqlx::Error::Protocol(format!("begin failed: {msg}")));
    batch.into_iter().map(|cmd| fail(cmd, failure())).collect()
}

/// The answers to a batch the fast path ran, or `None` when it gave the batch back
/// (rolled back after a database error) for the general path, request by request.
fn fast_answers(
    batch: &mut Vec<Command>,
    outcome: crate::sqlite_batch::Fast,
) -> Option<(Vec<Pending>, Option<String>)> {
    use crate::sqlite_batch::Fast;
    match outcome {
        Fast::BeginFailed(msg) => Some((begin_failed(batch.drain(..), &msg), None)),
        Fast::Retry(e) => {
            tracing::warn!(error = %e, "group-commit batch failed; running it again request by request");
            None
        }
        Fast::Done(results, commit_error) => {
            if let Some(msg) = &commit_error {
                tracing::warn!(error = %msg, "group commit failed");
            }
            Some((answers(batch.drain(..), results), commit_error))
        }
    }
}

/// Runs `f` on the connection's raw handle, taken from sqlx's thread for the call
/// (`lock_handle`); `f` must not keep the handle.
async fn with_db<T>(conn: &mut SqliteConnection, f: impl FnOnce(crate::sqlite_ffi::Db) -> T) -> Result<T, sqlx::Error> {
    let mut locked = conn.lock_handle().await?;
    // SAFETY: the handle is ours while `locked` lives, and `f` gets it for this call only.
    Ok(f(unsafe { crate::sqlite_ffi::Db::new(locked.as_raw_handle()) }))
}

/// Rows this connection inserted, updated or deleted since it opened (SQLite's
/// `total_changes()`, rolled-back ones included); `None` when it cannot be read.
async fn total_changes(conn: &mut SqliteConnection) -> Option<i64> {
    with_db(conn, crate::sqlite_ffi::Db::total_changes).await.ok()
}

/// Records one `COMMIT` statement's time (without the WAL's fsync, `sqlite_sync`).
pub(crate) fn record_commit(seconds: f64) {
    metrics::histogram!("idem_store_commit_seconds", "backend" => "sqlite").record(seconds);
}

/// Any batch: `BEGIN IMMEDIATE`, runs of hot requests as segments and other commands one
/// by one, each under its own savepoint, then `COMMIT`.
///
/// The writer's record cache follows: the keys of hot segments are forgotten (they were
/// written without it), and the whole cache is dropped after any other command that
/// changed a row (sweeps, lease expiry, reconciliation, workflows write records it does
/// not follow); most of those are polls that find nothing due and write nothing.
async fn run_general(
    conn: &mut SqliteConnection,
    batch: &mut Vec<Command>,
    clock: &dyn Clock,
    config: &StoreConfig,
    cache: &mut crate::sqlite_batch::WriterCache,
    durability: &crate::sqlite_sync::Durability,
) -> (Vec<Pending>, Option<String>) {
    let mut done: Vec<Pending> = Vec::with_capacity(batch.len());
    let commit_error = match exec(conn, "BEGIN IMMEDIATE").await {
        Err(e) => {
            done = begin_failed(batch.drain(..), &e.to_string());
            None
        }
        Ok(()) => {
            let mut cmds = batch.drain(..).peekable();
            let mut lost = false;
            let mut isolate = Vec::new();
            while let Some(cmd) = cmds.next() {
                if lost {
                    isolate.push(cmd);
                    continue;
                }
                if is_hot(&cmd) {
                    let mut segment = vec![cmd];
                    while let Some(next) = cmds.next_if(is_hot) {
                        segment.push(next);
                    }
                    for h in hot_views(&segment) {
                        let (tenant, key) = h.key();
                        cache.forget(tenant, key);
                    }
                    let (answered, left) = run_hot(conn, segment, clock, config).await;
                    done.extend(answered);
                    isolate.extend(left);
                } else {
                    let before = total_changes(conn).await;
                    done.push(run_one(conn, cmd, clock, config).await);
                    if before.is_none() || total_changes(conn).await != before {
                        cache.invalidate();
                    }
                }
                lost = !transaction_open(conn).await;
            }
            if lost {
                // Everything this batch wrote before is undone: no answer may say otherwise
                // (the request that ended it keeps its own error). What did not run yet
                // runs now, each request in a transaction of its own.
                cache.invalidate();
                answer(std::mem::take(&mut done), Some(Unacknowledged::Commit(ROLLED_BACK.to_owned())), 0);
                done = run_isolated(conn, isolate, clock, config, durability).await;
                None
            } else {
                commit(conn, durability).await
            }
        }
    };
    (done, commit_error)
}

/// Commits the writer's transaction (and times it); on failure rolls back what is left of
/// it and returns why, for the answers of the requests it held.
async fn commit(conn: &mut SqliteConnection, durability: &crate::sqlite_sync::Durability) -> Option<String> {
    durability.committing();
    let start = std::time::Instant::now();
    match exec(conn, "COMMIT").await {
        Ok(()) => {
            record_commit(start.elapsed().as_secs_f64());
            None
        }
        Err(e) => {
            let _ = exec(conn, "ROLLBACK").await;
            Some(e.to_string())
        }
    }
}

/// Why a batch's answers failed when the database rolled its whole transaction back.
const ROLLED_BACK: &str =
    "the database rolled back the batch's transaction (a trigger's RAISE(ROLLBACK)?); nothing of it was kept";

/// Whether the writer's transaction is still open. A trigger's `RAISE(ROLLBACK)` ends the
/// whole transaction, not one statement: the savepoints are gone with it, and anything run
/// after would commit statement by statement, outside the batch (a break-it pass saw
/// requests stored but answered 503, then stuck in UNKNOWN). `false` also when the
/// connection cannot be asked.
async fn transaction_open(conn: &mut SqliteConnection) -> bool {
    with_db(conn, |db| !db.autocommit()).await.unwrap_or(false)
}

/// Runs each of `cmds` in a transaction of its own (after the database rolled back a
/// batch's transaction): a request whose write makes the database roll back again fails
/// alone with its own error, the others commit one by one. Each answer carries its own
/// commit's outcome.
async fn run_isolated(
    conn: &mut SqliteConnection,
    cmds: Vec<Command>,
    clock: &dyn Clock,
    config: &StoreConfig,
    durability: &crate::sqlite_sync::Durability,
) -> Vec<Pending> {
    let mut out: Vec<Pending> = Vec::with_capacity(cmds.len());
    for cmd in cmds {
        if let Err(e) = exec(conn, "BEGIN IMMEDIATE").await {
            out.extend(begin_failed([cmd], &e.to_string()));
            continue;
        }
        let p = run_one(conn, cmd, clock, config).await;
        let commit_error =
            if transaction_open(conn).await { commit(conn, durability).await } else { Some(ROLLED_BACK.to_owned()) };
        // This request's own commit decides its answer; the batch's fsync still comes first.
        out.push(Box::new(move |synced: Option<&Unacknowledged>| {
            let own = commit_error.map(Unacknowledged::Commit);
            p(own.as_ref().or(synced.filter(|f| matches!(f, Unacknowledged::NotDurable(_)))));
        }));
    }
    out
}

#[async_trait]
impl Store for SqliteStore {
    async fn acquire(&self, input: AcquireInput) -> Result<AcquireOutcome, StoreError> {
        self.send(|r| Command::Acquire(input, r)).await
    }

    async fn complete(&self, req: CompleteRequest) -> Result<CompleteOutcome, StoreError> {
        self.send(|r| Command::Complete(req, r)).await
    }

    async fn renew(&self, req: RenewRequest) -> Result<OperationRecord, StoreError> {
        self.send(|r| Command::Renew(req, r)).await
    }

    async fn get(&self, tenant: &str, key: &str) -> Result<Option<OperationRecord>, StoreError> {
        let mut conn = self.readers.acquire().await?;
        let read = ops::load(&mut conn, tenant, key).await?;
        self.durability.settled(read).await
    }

    async fn tombstone(&self, tenant: &str, key: &str) -> Result<Option<idem_core::Tombstone>, StoreError> {
        let mut conn = self.readers.acquire().await?;
        let t = ops::load_tombstone(&mut conn, tenant, &idem_core::retention::key_hash(key)).await?;
        let t = self.durability.settled(t).await?;
        Ok(t.filter(|t| t.expires_at > self.clock.now_ms()))
    }

    async fn events(&self, tenant: &str, key: &str) -> Result<Vec<OperationEvent>, StoreError> {
        let mut conn = self.readers.acquire().await?;
        let read = ops::events(&mut conn, tenant, key).await?;
        self.durability.settled(read).await
    }

    async fn list(&self, tenant: &str, filter: &ListFilter) -> Result<Page, StoreError> {
        let mut conn = self.readers.acquire().await?;
        let read = ops::list(&mut conn, tenant, filter).await?;
        self.durability.settled(read).await
    }

    async fn overview(
        &self,
        tenant: Option<&str>,
        stale_before_ms: i64,
        recent: i64,
    ) -> Result<crate::Overview, StoreError> {
        let mut conn = self.readers.acquire().await?;
        let read = ops::overview(&mut conn, tenant, stale_before_ms, recent).await?;
        self.durability.settled(read).await
    }

    async fn expire_leases(&self, limit: i64) -> Result<u64, StoreError> {
        self.send(|r| Command::ExpireLeases(limit, r)).await
    }

    async fn sweep(&self, limit: i64) -> Result<crate::SweepOutcome, StoreError> {
        self.send(|r| Command::Sweep(limit, r)).await
    }

    async fn due_executions(&self, connector: &str, limit: i64) -> Result<Vec<OperationRecord>, StoreError> {
        let mut conn = self.readers.acquire().await?;
        let read = ops::due_executions(&mut conn, connector, self.clock.now_ms(), limit).await?;
        self.durability.settled(read).await
    }

    async fn due_reconciliations(&self, limit: i64) -> Result<Vec<OperationRecord>, StoreError> {
        let mut conn = self.readers.acquire().await?;
        let read = ops::due_reconciliations(&mut conn, self.clock.now_ms(), limit).await?;
        self.durability.settled(read).await
    }

    async fn reconcile(&self, req: ReconcileRequest) -> Result<ReconcileOutcome, StoreError> {
        self.send(|r| Command::Reconcile(req, r)).await
    }

    async fn resolve(&self, req: ResolveRequest) -> Result<OperationRecord, StoreError> {
        self.send(|r| Command::Resolve(req, r)).await
    }

    async fn create_api_key(
        &self,
        tenant: &str,
        principal: &str,
        role: Role,
        secret: Option<String>,
    ) -> Result<(ApiKeyInfo, String), StoreError> {
        let (info, secret) = crate::new_key_info(tenant, principal, role, secret, self.clock.now_ms())?;
        let hash = hash_secret(&secret);
        let stored = info.clone();
        self.send(|r| Command::CreateKey(stored, hash, r)).await?;
        Ok((info, secret))
    }

    async fn authenticate(&self, secret: &str) -> Result<Option<ApiKeyInfo>, StoreError> {
        self.keys
            .authenticate(secret, async |hash| {
                let read = ops::find_api_key(&mut *self.readers.acquire().await?, &hash).await?;
                self.durability.settled(read).await
            })
            .await
    }

    async fn list_api_keys(&self, tenant: Option<&str>) -> Result<Vec<ApiKeyInfo>, StoreError> {
        let mut conn = self.readers.acquire().await?;
        let read = ops::list_api_keys(&mut conn, tenant).await?;
        self.durability.settled(read).await
    }

    async fn revoke_api_key(&self, id: &str) -> Result<bool, StoreError> {
        let id = id.to_owned();
        let revoked = self.send(|r| Command::RevokeKey(id, r)).await;
        // Before answering; the epoch poller would notice within KEY_EPOCH_POLL anyway.
        self.keys.invalidate();
        revoked
    }

    async fn revoke_api_key_keeping_an_admin(
        &self,
        tenant: &str,
        id: &str,
    ) -> Result<crate::keys::Revocation, StoreError> {
        let (tenant, id) = (tenant.to_owned(), id.to_owned());
        // The single writer runs the check and the write back to back: atomic.
        let revoked = self.send(|r| Command::RevokeKeyKeepingAdmin(tenant, id, r)).await;
        self.keys.invalidate();
        revoked
    }

    async fn count_api_keys(&self) -> Result<i64, StoreError> {
        let mut conn = self.readers.acquire().await?;
        let read = ops::count_api_keys(&mut conn).await?;
        self.durability.settled(read).await
    }

    async fn ping(&self) -> Result<(), StoreError> {
        let mut conn = self.readers.acquire().await?;
        let applied: Result<Option<i64>, sqlx::Error> =
            sqlx::query_scalar("SELECT max(version) FROM _sqlx_migrations").fetch_one(&mut *conn).await;
        crate::schema_check(applied.map_err(StoreError::from), &MIGRATOR)
    }

    async fn commit_durability(&self) -> Result<crate::CommitDurability, StoreError> {
        Ok(crate::CommitDurability::sqlite())
    }

    /// The writer waits at most SQLite's busy timeout for the file's lock.
    fn answer_timeout(&self) -> Option<std::time::Duration> {
        None
    }

    fn fatal(&self) -> Option<StoreError> {
        self.durability.failure()
    }

    fn flows(&self) -> &dyn crate::flow::WorkflowStore {
        self
    }
}

#[async_trait]
impl crate::flow::WorkflowStore for SqliteStore {
    async fn start_instance(&self, req: crate::flow::StartRequest) -> Result<crate::flow::StartOutcome, StoreError> {
        self.send(|r| Command::StartInstance(Box::new(req), r)).await
    }

    async fn instance(
        &self,
        tenant: &str,
        instance_id: &str,
    ) -> Result<Option<idem_core::flow::InstanceRecord>, StoreError> {
        let read = flow_ops::load_instance(&mut *self.readers.acquire().await?, tenant, instance_id).await?;
        self.durability.settled(read).await
    }

    async fn checkpoints(
        &self,
        tenant: &str,
        instance_id: &str,
    ) -> Result<Vec<idem_core::flow::Checkpoint>, StoreError> {
        let read = flow_ops::checkpoints(&mut *self.readers.acquire().await?, tenant, instance_id).await?;
        self.durability.settled(read).await
    }

    async fn definition(
        &self,
        tenant: &str,
        name: &str,
        version: &str,
    ) -> Result<Option<idem_core::flow::Definition>, StoreError> {
        let read = flow_ops::definition(&mut *self.readers.acquire().await?, tenant, name, version).await?;
        self.durability.settled(read).await
    }

    async fn instance_events(
        &self,
        tenant: &str,
        instance_id: &str,
    ) -> Result<Vec<idem_core::flow::InstanceEvent>, StoreError> {
        let read = flow_ops::instance_events(&mut *self.readers.acquire().await?, tenant, instance_id).await?;
        self.durability.settled(read).await
    }

    async fn list_instances(
        &self,
        tenant: &str,
        filter: &crate::flow::InstanceFilter,
    ) -> Result<crate::flow::InstancePage, StoreError> {
        let read = flow_ops::list_instances(&mut *self.readers.acquire().await?, tenant, filter).await?;
        self.durability.settled(read).await
    }

    async fn update_instance(&self, update: crate::flow::InstanceUpdate) -> Result<bool, StoreError> {
        self.send(|r| Command::UpdateInstance(Box::new(update), r)).await
    }

    async fn apply_rerun(&self, write: crate::flow::RerunWrite) -> Result<bool, StoreError> {
        self.send(|r| Command::ApplyRerun(Box::new(write), r)).await
    }

    async fn add_items(&self, items: Vec<idem_core::flow::ItemRow>) -> Result<(), StoreError> {
        self.send(|r| Command::AddItems(items, r)).await
    }

    async fn claim_due_instances(
        &self,
        limit: i64,
        hold_ms: i64,
    ) -> Result<Vec<idem_core::flow::InstanceRecord>, StoreError> {
        // Looked for on a reader first (one probe of the partial index
        // `workflow_instances_due`): when nothing is due, the usual case, the poll costs no
        // write transaction and does not send a batch of acquires and completions down the
        // writer's general path, ten times a second. An instance that falls due right after
        // this read is claimed on the next poll.
        let (due,): (bool,) =
            sqlx::query_as("SELECT EXISTS (SELECT 1 FROM workflow_instances WHERE next_run_at <= $1)")
                .bind(self.clock.now_ms())
                .fetch_one(&mut *self.readers.acquire().await?)
                .await?;
        if !due {
            return Ok(Vec::new());
        }
        self.send(|reply| Command::ClaimDueInstances { limit, hold_ms, reply }).await
    }

    async fn step_of_operation(
        &self,
        tenant: &str,
        op_key: &str,
    ) -> Result<Option<idem_core::flow::StepRow>, StoreError> {
        let read = flow_ops::step_of_operation(&mut *self.readers.acquire().await?, tenant, op_key).await?;
        self.durability.settled(read).await
    }

    async fn instance_tombstone(
        &self,
        tenant: &str,
        instance_id: &str,
    ) -> Result<Option<idem_core::flow::InstanceTombstone>, StoreError> {
        let t = flow_ops::load_instance_tombstone(&mut *self.readers.acquire().await?, tenant, instance_id).await?;
        let t = self.durability.settled(t).await?;
        Ok(t.filter(|t| t.expires_at > self.clock.now_ms()))
    }

    async fn count_instances(
        &self,
        tenant: Option<&str>,
    ) -> Result<Vec<(idem_core::flow::InstanceState, i64)>, StoreError> {
        let read = flow_ops::count_instances(&mut *self.readers.acquire().await?, tenant).await?;
        self.durability.settled(read).await
    }

    async fn sweep_instances(&self, limit: i64) -> Result<u64, StoreError> {
        self.send(|r| Command::SweepInstances(limit, r)).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use libsqlite3_sys as ffi;

    /// Runs `SELECT … LIMIT ?` twice on `conn`'s handle, rebinding the limit as sqlx does
    /// (reset, clear bindings, bind), and returns how often SQLite re-prepared it.
    async fn reprepares_of_a_limit_query(conn: &mut SqliteConnection) -> i32 {
        let mut handle = conn.lock_handle().await.unwrap();
        let db = handle.as_raw_handle().as_ptr();
        let sql = c"SELECT value FROM json_each('[1,2,3]') LIMIT ?1";
        // SAFETY: exclusive use of the open handle (lock_handle); the statement is
        // finalized before the guard is dropped.
        unsafe {
            let mut stmt = std::ptr::null_mut();
            assert_eq!(ffi::sqlite3_prepare_v3(db, sql.as_ptr(), -1, 0, &mut stmt, std::ptr::null_mut()), 0);
            for limit in [2, 1] {
                assert_eq!(ffi::sqlite3_bind_int64(stmt, 1, limit), 0);
                let mut rows = 0;
                while ffi::sqlite3_step(stmt) == ffi::SQLITE_ROW {
                    rows += 1;
                }
                assert_eq!(rows, limit, "the bound limit is honoured");
                ffi::sqlite3_reset(stmt);
                ffi::sqlite3_clear_bindings(stmt);
            }
            let n = ffi::sqlite3_stmt_status(stmt, ffi::SQLITE_STMTSTATUS_REPREPARE, 0);
            ffi::sqlite3_finalize(stmt);
            n
        }
    }

    #[tokio::test]
    async fn bound_limits_do_not_make_sqlite_prepare_a_statement_again() {
        let dir = tempfile::tempdir().unwrap();
        let mut plain = options(&dir.path().join("a.db")).connect().await.unwrap();
        assert!(reprepares_of_a_limit_query(&mut plain).await > 0, "without the setting SQLite re-prepares");
        let mut stable = options(&dir.path().join("b.db")).connect().await.unwrap();
        stable_plans(&mut stable).await.unwrap();
        assert_eq!(reprepares_of_a_limit_query(&mut stable).await, 0);
    }
}
