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

/// Bounded retries of a transaction whose conditional write lost a race.
pub const CAS_RETRIES: usize = 16;
/// Connections per process.
const POOL_SIZE: u32 = 16;

static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations/postgres");

/// The PostgreSQL [`Store`].
#[derive(Debug, Clone)]
pub struct PgStore {
    pool: PgPool,
    clock: Arc<dyn Clock>,
    config: StoreConfig,
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
            .connect(url)
            .await?;
        MIGRATOR.run(&pool).await?;
        Ok(PgStore { pool, clock, config })
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
                    tx.commit().await?;
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
        retrying!(self, |conn| ops::acquire_once(conn, &input, self.clock.now_ms()).await)
    }

    async fn complete(&self, req: CompleteRequest) -> Result<CompleteOutcome, StoreError> {
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

    async fn events(&self, tenant: &str, key: &str) -> Result<Vec<OperationEvent>, StoreError> {
        ops::events(&mut *self.pool.acquire().await?, tenant, key).await
    }

    async fn list(&self, tenant: &str, filter: &ListFilter) -> Result<Page, StoreError> {
        ops::list(&mut *self.pool.acquire().await?, tenant, filter).await
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
