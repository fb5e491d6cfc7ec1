//! The PostgreSQL store: several `idem serve` processes share one database.
//!
//! Each write is one short READ COMMITTED transaction: read the record, let idem-core plan
//! the change, write it with `INSERT … ON CONFLICT (tenant, op_key) DO NOTHING` (a new key)
//! or `UPDATE … WHERE version = $read` (an existing one), append the events, commit. Two
//! racing writers cannot both succeed: the unique constraint or the version condition
//! lets exactly one through; the loser rolls back and starts again from a fresh read, at
//! most [`CAS_RETRIES`] times. Migrations take PostgreSQL's advisory lock, so several
//! nodes starting at once apply them once.

use crate::keys::{ApiKeyInfo, Role, hash_secret};
use crate::{AcquireOutcome, CompleteOutcome, CompleteRequest, ListFilter, Page, Store, StoreConfig, StoreError};
use crate::{ReconcileOutcome, ReconcileRequest, ResolveRequest};
use async_trait::async_trait;
use idem_core::{AcquireInput, Clock, OperationEvent, OperationRecord};
use sqlx::postgres::{PgPool, PgPoolOptions};
use std::sync::Arc;
use std::time::Duration;

mod ops {
    crate::sql::sql_ops!(sqlx::PgConnection);
}

/// The hot path without explicit transactions: every write is one atomic statement that
/// carries its own condition (a unique insert, or `WHERE version = $read`) and appends its
/// events in the same statement (a data-modifying CTE), so an acquire or a completion costs
/// a read and one durable write, like the raw two-statement baseline. Anything unusual
/// (a conflict, a tombstone) falls back to the transactional path of `sql_ops!`.
mod fast {
    use crate::StoreError;
    use idem_core::{OperationEvent, OperationRecord};
    use sqlx::{PgPool, Postgres, QueryBuilder};

    const OP_COLS: &str = "tenant, op_key, action, fingerprint, payload, state, attempt_count, lease_owner, \
        lease_expires_at, fencing_token, next_attempt_at, provider_ref, result, error_class, error_message, verified_at, \
        evidence_source, needs_review, redo_safe, created_at, updated_at, completed_at, expires_at, version, connector, \
        lookup_attempts";
    const EV_COLS: &str = "tenant, op_key, at, kind, principal, request_id, from_state, to_state, fencing_token, fingerprint, reason, error_class, wait_ms";

    fn push_record(q: &mut QueryBuilder<Postgres>, r: &OperationRecord) {
        crate::row::bind_record(q.separated(", "), r);
    }

    fn push_events(q: &mut QueryBuilder<Postgres>, events: &[OperationEvent]) {
        q.push_values(events, crate::row::bind_event);
    }

    /// What [`insert_or_read`] found.
    pub(super) enum Claim {
        /// The new record and its events were written.
        Inserted,
        /// The key has a record (as of the statement's snapshot); nothing was written.
        Existing(Box<OperationRecord>),
        /// Neither: a live tombstone holds the key, or a concurrent insert of it has not
        /// committed yet. The transactional path decides.
        Neither,
    }

    /// One statement that inserts `r` with its events unless the key exists or a live
    /// tombstone holds it, and otherwise returns the stored record: a new key costs one
    /// round trip instead of a read and a write, an existing one the same as a read.
    pub(super) async fn insert_or_read(
        pool: &PgPool,
        r: &OperationRecord,
        events: &[OperationEvent],
        now_ms: i64,
    ) -> Result<Claim, StoreError> {
        use sqlx::{FromRow, Row};
        let mut q: QueryBuilder<Postgres> =
            QueryBuilder::new(format!("WITH ins AS (INSERT INTO operations ({OP_COLS}) SELECT "));
        push_record(&mut q, r);
        q.push(" WHERE NOT EXISTS (SELECT 1 FROM tombstones WHERE tenant = ")
            .push_bind(r.tenant.clone())
            .push(" AND key_hash = ")
            .push_bind(idem_core::retention::key_hash(&r.key))
            .push(" AND expires_at > ")
            .push_bind(now_ms)
            .push(format!(
                ") ON CONFLICT (tenant, op_key) DO NOTHING RETURNING 1), ev AS (INSERT INTO operation_events ({EV_COLS}) SELECT v.* FROM ("
            ));
        push_events(&mut q, events);
        q.push(format!(") AS v({EV_COLS}) WHERE EXISTS (SELECT 1 FROM ins) RETURNING 1) SELECT (SELECT count(*) FROM ins) AS inserted, "))
            .push(crate::row::operation_columns!().replace("tenant, op_key,", "o.tenant, o.op_key,"))
            .push(" FROM (SELECT 1) AS one LEFT JOIN operations o ON o.tenant = ")
            .push_bind(r.tenant.clone())
            .push(" AND o.op_key = ")
            .push_bind(r.key.clone());
        let row = super::committed(q.build().fetch_one(pool)).await?;
        if row.try_get::<i64, _>("inserted")? == 1 {
            return Ok(Claim::Inserted);
        }
        match row.try_get::<Option<String>, _>("op_key")? {
            Some(_) => Ok(Claim::Existing(Box::new(crate::row::OperationRow::from_row(&row)?.into_record()?))),
            None => Ok(Claim::Neither),
        }
    }

    /// Writes `r` if the stored record is still the one read: the same incarnation of the
    /// key (`created_at`; a key reused after its tombstone expired starts a new record whose
    /// version counts from 1 again) at `read_version`. With its events, in one statement.
    /// True if written.
    pub(super) async fn update(
        pool: &PgPool,
        r: &OperationRecord,
        read_version: i64,
        events: &[OperationEvent],
    ) -> Result<bool, StoreError> {
        let mut q: QueryBuilder<Postgres> =
            QueryBuilder::new(format!("WITH upd AS (UPDATE operations SET ({OP_COLS}) = ("));
        push_record(&mut q, r);
        q.push(") WHERE tenant = ")
            .push_bind(r.tenant.clone())
            .push(" AND op_key = ")
            .push_bind(r.key.clone())
            .push(" AND version = ")
            .push_bind(read_version)
            .push(" AND created_at = ")
            .push_bind(r.created_at)
            .push(format!(" RETURNING 1) INSERT INTO operation_events ({EV_COLS}) SELECT v.* FROM ("));
        push_events(&mut q, events);
        q.push(format!(") AS v({EV_COLS}) WHERE EXISTS (SELECT 1 FROM upd)"));
        let done = super::committed(q.build().execute(pool)).await?;
        Ok(done.rows_affected() == events.len() as u64)
    }

    /// Appends events in one autocommit statement per 1 000 (the caller records metrics).
    pub(super) async fn events(pool: &PgPool, events: &[OperationEvent]) -> Result<(), StoreError> {
        for chunk in events.chunks(1000) {
            let mut q: QueryBuilder<Postgres> = QueryBuilder::new(format!("INSERT INTO operation_events ({EV_COLS}) "));
            push_events(&mut q, chunk);
            q.build().execute(pool).await?;
        }
        Ok(())
    }
}

/// Group commit for triggers that write nothing but their event (replays, 409s, 422s):
/// concurrent ones are appended by one multi-row `INSERT` (one commit), and each is
/// answered only after that commit, like every other write (DESIGN invariant 5: every
/// trigger is recorded before it is answered). One batch is in flight at a time; what
/// arrives meanwhile forms the next (at most [`EVENT_BATCH`] triggers).
#[derive(Debug)]
struct EventBatcher {
    tx: tokio::sync::mpsc::Sender<(Vec<OperationEvent>, EventReply)>,
}

/// Where an [`EventBatcher`] answers: the commit's error text, if any.
type EventReply = tokio::sync::oneshot::Sender<Result<(), String>>;

/// Most triggers whose events one [`EventBatcher`] commit carries.
const EVENT_BATCH: usize = 256;

impl EventBatcher {
    fn spawn(pool: PgPool) -> Self {
        let (tx, mut rx) = tokio::sync::mpsc::channel::<(Vec<OperationEvent>, EventReply)>(4 * EVENT_BATCH);
        tokio::spawn(async move {
            while let Some(first) = rx.recv().await {
                let mut batch = vec![first];
                while batch.len() < EVENT_BATCH {
                    match rx.try_recv() {
                        Ok(next) => batch.push(next),
                        Err(_) => break,
                    }
                }
                let events: Vec<OperationEvent> = batch.iter().flat_map(|(e, _)| e.iter().cloned()).collect();
                let done = committed_batch(batch.len(), fast::events(&pool, &events)).await.map_err(|e| e.to_string());
                for (_, reply) in batch {
                    let _ = reply.send(done.clone());
                }
            }
        });
        EventBatcher { tx }
    }

    /// Appends `events` durably (returns after the commit).
    async fn append(&self, events: Vec<OperationEvent>) -> Result<(), StoreError> {
        if events.is_empty() {
            return Ok(());
        }
        let (reply, answer) = tokio::sync::oneshot::channel();
        self.tx.send((events, reply)).await.map_err(|_| StoreError::Closed)?;
        match answer.await.map_err(|_| StoreError::Closed)? {
            Ok(()) => Ok(()),
            Err(e) => Err(StoreError::Database(sqlx::Error::Protocol(format!("appending events failed: {e}")))),
        }
    }
}

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

/// Records this node wrote last, to skip the read before the next write of the same key.
///
/// Correct under several nodes because a cached record is only ever used in two ways:
/// - as the base of a conditional write (`WHERE version = <cached version> AND created_at =
///   <cached created_at>`): if another node changed the record since, or the key was
///   reused for a new record after its tombstone expired, the write does nothing and the
///   store re-reads;
/// - to answer a trigger without writing the record, only when the cached record is
///   SUCCEEDED or FAILED (final records never change) and not past its retention
///   (`expires_at`), so it cannot have been swept.
///
/// Bounded: at most [`CACHE_ENTRIES`] records, each with a payload and result of at most
/// [`CACHE_MAX_JSON_BYTES`] bytes (larger ones are not cached); full, it starts over.
#[derive(Debug, Default)]
struct RecordCache {
    map: std::sync::Mutex<std::collections::HashMap<(String, String), OperationRecord>>,
}

/// Records kept by [`RecordCache`].
const CACHE_ENTRIES: usize = 2048;
/// Largest payload (and result) of a cached record, serialised, in bytes.
const CACHE_MAX_JSON_BYTES: usize = 8 * 1024;

impl RecordCache {
    fn get(&self, tenant: &str, key: &str) -> Option<OperationRecord> {
        let map = self.map.lock().expect("record cache lock");
        map.get(&(tenant.to_owned(), key.to_owned())).cloned()
    }

    fn put(&self, r: &OperationRecord) {
        let small = |v: &serde_json::Value| json_fits(v, CACHE_MAX_JSON_BYTES);
        if !small(&r.payload) || r.result.as_ref().is_some_and(|v| !small(v)) {
            self.forget(&r.tenant, &r.key);
            return;
        }
        let mut map = self.map.lock().expect("record cache lock");
        if map.len() >= CACHE_ENTRIES {
            map.clear();
        }
        map.insert((r.tenant.clone(), r.key.clone()), r.clone());
    }

    fn forget(&self, tenant: &str, key: &str) {
        self.map.lock().expect("record cache lock").remove(&(tenant.to_owned(), key.to_owned()));
    }
}

/// Whether `v` serialises to at most `limit` bytes, counted without building the text and
/// given up as soon as the limit is passed (this runs on every write of the hot path).
fn json_fits(v: &serde_json::Value, limit: usize) -> bool {
    struct Count {
        seen: usize,
        limit: usize,
    }
    impl std::io::Write for Count {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.seen += buf.len();
            if self.seen > self.limit { Err(std::io::Error::other("over the limit")) } else { Ok(buf.len()) }
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    serde_json::to_writer(Count { seen: 0, limit }, v).is_ok()
}

/// Bounded retries of a transaction whose conditional write lost a race.
pub const CAS_RETRIES: usize = 16;
/// Connections per process.
const POOL_SIZE: u32 = 16;
/// A pooled connection idle for longer than this is pinged before it is used.
const IDLE_CHECK: Duration = Duration::from_secs(5);

static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations/postgres");

/// The PostgreSQL [`Store`].
#[derive(Debug, Clone)]
pub struct PgStore {
    pool: PgPool,
    clock: Arc<dyn Clock>,
    config: StoreConfig,
    cache: Arc<RecordCache>,
    events: Arc<EventBatcher>,
}

impl PgStore {
    /// Connects to `url` (`postgres://user@host:port/db`) and applies migrations.
    ///
    /// # Errors
    /// [`StoreError::Database`] if the server cannot be reached, [`StoreError::Migrate`] if
    /// migrations fail.
    pub async fn connect(url: &str, clock: Arc<dyn Clock>, config: StoreConfig) -> Result<Self, StoreError> {
        let pool = PgPoolOptions::new()
            .max_connections(POOL_SIZE)
            .acquire_timeout(Duration::from_secs(10))
            // sqlx pings every idle connection before handing it out: one more network round
            // trip per statement on the hot path. Only a connection left idle for a while is
            // checked (a server restart or a dropped TCP connection shows up there); a busy
            // one has just answered.
            .test_before_acquire(false)
            .before_acquire(|conn, meta| {
                Box::pin(async move {
                    if meta.idle_for > IDLE_CHECK {
                        sqlx::Connection::ping(conn).await?;
                    }
                    Ok(true)
                })
            })
            .connect(url)
            .await?;
        MIGRATOR.run(&pool).await?;
        let events = Arc::new(EventBatcher::spawn(pool.clone()));
        Ok(PgStore { pool, clock, config, cache: Default::default(), events })
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
        if !fast::update(&self.pool, &plan.record, read_version, &events).await? {
            return Ok(None);
        }
        self.cache.put(&plan.record);
        Ok(Some(CompleteOutcome { record: plan.record, changed: true }))
    }

    /// The connection pool (tests use it to inspect the database).
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }
}

/// Runs `$once` (which takes `&mut PgConnection` as `$conn`) in a fresh transaction until
/// its conditional write wins, at most CAS_RETRIES times.
macro_rules! retrying {
    ($self:ident, |$conn:ident| $once:expr) => {{
        let mut outcome = Err(StoreError::Contention);
        for _ in 0..CAS_RETRIES {
            let mut tx = $self.pool.begin().await?;
            let $conn: &mut sqlx::PgConnection = &mut tx;
            match $once {
                Ok(Some(o)) => {
                    committed(tx.commit()).await?;
                    outcome = Ok(o);
                    break;
                }
                Ok(None) => tx.rollback().await?,
                Err(e) => {
                    outcome = Err(e);
                    break;
                }
            }
        }
        outcome
    }};
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
                self.events.append(plan.events).await?;
                return Ok(AcquireOutcome { decision: plan.decision, record: plan.record });
            }
        }
        // Most triggers carry a new key: insert it, or learn the stored record, in one go.
        let fresh = idem_core::plan_acquire(None, &input, now);
        let mut existing = match fast::insert_or_read(&self.pool, &fresh.record, &fresh.events, now).await? {
            fast::Claim::Inserted => {
                self.cache.put(&fresh.record);
                return Ok(AcquireOutcome { decision: fresh.decision, record: fresh.record });
            }
            fast::Claim::Existing(r) => Some(*r),
            // A concurrent insert or a tombstone: the transactional path decides.
            fast::Claim::Neither => None,
        };
        for _ in 0..CAS_RETRIES {
            let Some(read) = existing.take() else { break };
            let now = self.clock.now_ms();
            let plan = idem_core::plan_acquire(Some(&read), &input, now);
            let outcome = AcquireOutcome { decision: plan.decision, record: plan.record.clone() };
            if !plan.changed {
                self.events.append(plan.events).await?;
                self.cache.put(&plan.record);
                return Ok(outcome);
            }
            if fast::update(&self.pool, &plan.record, read.version, &plan.events).await? {
                self.cache.put(&plan.record);
                return Ok(outcome);
            }
            // Another writer changed it since the read: read again.
            existing = ops::load(&mut *self.pool.acquire().await?, &input.tenant, &input.key).await?;
        }
        self.cache.forget(&input.tenant, &input.key);
        retrying!(self, |conn| ops::acquire_once(conn, &input, self.clock.now_ms()).await)
    }

    async fn complete(&self, req: CompleteRequest) -> Result<CompleteOutcome, StoreError> {
        // The lease this node granted: complete it without reading it back. The write is
        // conditional on the cached version, so a change elsewhere makes it a no-op.
        if let Some(cached) = self.cache.get(&req.tenant, &req.key)
            && cached.state == idem_core::State::Executing
            && cached.fencing_token == req.fencing_token
        {
            if let Ok(plan) = self.plan_completion(&cached, &req)
                && plan.changed
                && let Some(done) = self.write_completion(plan, cached.version).await?
            {
                return Ok(done);
            }
            self.cache.forget(&req.tenant, &req.key);
        }
        for _ in 0..CAS_RETRIES {
            let Some(rec) = ops::load(&mut *self.pool.acquire().await?, &req.tenant, &req.key).await? else {
                return Err(StoreError::NotFound);
            };
            let plan = self.plan_completion(&rec, &req)?;
            if !plan.changed {
                return Ok(CompleteOutcome { record: plan.record, changed: false });
            }
            if let Some(done) = self.write_completion(plan, rec.version).await? {
                return Ok(done);
            }
        }
        retrying!(self, |conn| {
            ops::complete_once(
                conn,
                &req,
                &self.config.retry_policy,
                &self.config.retention,
                crate::jitter(),
                self.clock.now_ms(),
            )
            .await
        })
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
        ops::find_api_key(&mut *self.pool.acquire().await?, &hash_secret(secret)).await
    }

    async fn list_api_keys(&self, tenant: Option<&str>) -> Result<Vec<ApiKeyInfo>, StoreError> {
        ops::list_api_keys(&mut *self.pool.acquire().await?, tenant).await
    }

    async fn revoke_api_key(&self, id: &str) -> Result<bool, StoreError> {
        ops::revoke_api_key(&mut *self.pool.acquire().await?, id, self.clock.now_ms()).await
    }

    async fn count_api_keys(&self) -> Result<i64, StoreError> {
        ops::count_api_keys(&mut *self.pool.acquire().await?).await
    }

    async fn ping(&self) -> Result<(), StoreError> {
        sqlx::query("SELECT 1").execute(&self.pool).await?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::json_fits;
    use serde_json::json;

    #[test]
    fn json_fits_counts_the_serialised_bytes() {
        let v = json!({"to": "customer-42"});
        let n = serde_json::to_vec(&v).unwrap().len();
        assert!(json_fits(&v, n));
        assert!(!json_fits(&v, n - 1));
        assert!(!json_fits(&json!("x".repeat(10_000)), 8 * 1024));
    }
}
