//! idem-store: where operation records, their event log and API keys live.
//!
//! One [`Store`] trait, two implementations that pass one conformance suite
//! ([`conformance`]):
//! - [`sqlite::SqliteStore`]: the embedded default. One file, WAL. All writes go through
//!   one writer thread that batches concurrent requests into one `BEGIN IMMEDIATE`
//!   transaction (group commit); a second thread fsyncs the WAL and answers each request
//!   only once its commit is durable, while the writer runs the next batch
//!   (`sqlite_sync`); reads use a separate pool of WAL readers and wait for the same.
//! - [`postgres::PgStore`]: several `idem serve` processes share one database. Every claim
//!   is an atomic `INSERT … ON CONFLICT DO NOTHING` or a conditional
//!   `UPDATE … WHERE version = $read`, never check-then-insert.
//!
//! The store decides nothing: idem-core plans every change (`plan_acquire`,
//! `plan_completion`, `plan_lease_expiry`) and the store writes the plan atomically with
//! its events. Versioned migrations (`migrations/sqlite`, `migrations/postgres`) are
//! applied when a store opens. Time comes from a [`Clock`].

pub mod conformance;
pub mod durability;
mod error;
pub mod flow;
mod flow_row;
mod flow_sql;
mod key_cache;
mod record_cache;
pub use key_cache::{KEY_ENTRIES, KEY_TTL};
pub mod keys;
pub mod postgres;
mod row;
mod sql;
pub mod sqlite;
mod sqlite_batch;
mod sqlite_ffi;
mod sqlite_sync;
pub mod testing;

/// How far (ms) behind a record's `created_at` an event may be stamped and still show in
/// the record's timeline: several nodes' clocks may disagree by this much. Leftover events
/// of a key's previous record are older than that by the tombstone window.
pub const EVENT_CLOCK_SKEW_MS: i64 = 60_000;

use async_trait::async_trait;
pub use durability::CommitDurability;
pub use error::{StoreError, database_message};
use idem_core::{
    AcquireInput, Actor, Clock, Decision, Lookup, OperationEvent, OperationRecord, Outcome, RetryPolicy, State,
};
use keys::{ApiKeyInfo, Role};
use std::sync::Arc;

/// Largest page [`Store::list`] returns.
pub const MAX_PAGE: i64 = 500;

/// The answer to one trigger: the decision and the record as it stands after it.
#[derive(Debug, Clone)]
pub struct AcquireOutcome {
    /// What the trigger gets (DESIGN.md §3).
    pub decision: Decision,
    /// The record after the trigger was applied.
    pub record: OperationRecord,
}

/// A worker's report for the lease it holds.
#[derive(Debug, Clone)]
pub struct CompleteRequest {
    /// Tenant of the caller.
    pub tenant: String,
    /// Idempotency key of the operation.
    pub key: String,
    /// Token of the lease the worker holds.
    pub fencing_token: i64,
    /// What happened.
    pub outcome: Outcome,
    /// Who reports, and through which request.
    pub actor: Actor,
    /// Retry schedule for a retryable failure; `None` = the store's default
    /// ([`StoreConfig::retry_policy`]). Connector-executed operations pass their connector's.
    pub policy: Option<RetryPolicy>,
}

/// A lease holder's heartbeat: extend the valid lease of `fencing_token` (see
/// `idem_core::lease`).
#[derive(Debug, Clone)]
pub struct RenewRequest {
    /// Tenant of the caller.
    pub tenant: String,
    /// Idempotency key of the operation.
    pub key: String,
    /// Token of the lease the worker holds.
    pub fencing_token: i64,
    /// The lease ends this long after the renewal (ms, 100–3 600 000).
    pub lease_ms: i64,
    /// Who renews, and through which request.
    pub actor: Actor,
}

/// The provider's answer about an UNKNOWN operation, to record.
#[derive(Debug, Clone)]
pub struct ReconcileRequest {
    /// Tenant of the operation.
    pub tenant: String,
    /// Idempotency key.
    pub key: String,
    /// What the lookup found.
    pub lookup: Lookup,
    /// Who asked (`system` for the reconciler loop, the operator for `ops reconcile`).
    pub actor: Actor,
    /// Spacing of inconclusive lookups.
    pub policy: RetryPolicy,
    /// Inconclusive lookups before the operation is flagged `needs_review`.
    pub max_lookups: i64,
}

/// The record after a reconciliation.
#[derive(Debug, Clone)]
pub struct ReconcileOutcome {
    /// The record as stored now.
    pub record: OperationRecord,
    /// False when the record was in no state to be reconciled (a valid lease, or settled).
    pub changed: bool,
}

/// An operator's resolution of an operation.
#[derive(Debug, Clone)]
pub struct ResolveRequest {
    /// Tenant of the operation.
    pub tenant: String,
    /// Idempotency key.
    pub key: String,
    /// SUCCEEDED, PENDING or FAILED.
    pub to: State,
    /// The state the operator saw; the resolution is refused if the record is in another
    /// one now. `None`: resolve whatever the (resolvable) state.
    pub expected_state: Option<State>,
    /// Why (mandatory, audited).
    pub reason: String,
    /// Evidence reference (mandatory for SUCCEEDED).
    pub evidence: Option<String>,
    /// The operator.
    pub actor: Actor,
}

/// The record after a completion.
#[derive(Debug, Clone)]
pub struct CompleteOutcome {
    /// The record as stored now.
    pub record: OperationRecord,
    /// False when the completion repeated the one already applied (nothing written).
    pub changed: bool,
}

/// Filters of [`Store::list`]; `None` means "any".
#[derive(Debug, Clone, Default)]
pub struct ListFilter {
    /// Only records in this state.
    pub state: Option<State>,
    /// Only records of this action.
    pub action: Option<String>,
    /// Only records with this `needs_review` flag.
    pub needs_review: Option<bool>,
    /// Only records whose key starts with this (exact, case-sensitive; empty = any).
    pub key_prefix: Option<String>,
    /// Only records created at or after this instant (epoch ms).
    pub created_from: Option<i64>,
    /// Only records created before this instant (epoch ms).
    pub created_before: Option<i64>,
    /// Page size, clamped to 1..=[`MAX_PAGE`].
    pub limit: i64,
    /// Continue after this position (from [`Page::next_cursor`]): `(created_at, key)` of
    /// the last record of the previous page.
    pub cursor: Option<(i64, String)>,
}

/// One page of records, newest first (by `created_at`, then key, descending).
#[derive(Debug, Clone)]
pub struct Page {
    /// The records.
    pub items: Vec<OperationRecord>,
    /// Position after which the next page starts; `None` on the last page. Made only of the
    /// tenant's own data, so it reveals nothing about other tenants.
    pub next_cursor: Option<(i64, String)>,
}

/// How many records share one (action, state, needs_review) in [`Overview::groups`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupCount {
    /// The action.
    pub action: String,
    /// The state.
    pub state: State,
    /// The review flag.
    pub needs_review: bool,
    /// Number of records.
    pub count: i64,
}

/// The operator's summary of a tenant (or of all tenants), from [`Store::overview`].
#[derive(Debug, Clone, Default)]
pub struct Overview {
    /// Record counts per (action, state, needs_review), ordered by action then state.
    pub groups: Vec<GroupCount>,
    /// UNKNOWN records not updated since the `stale_before_ms` instant.
    pub unknown_stale: i64,
    /// The latest mismatch (422) events, newest first.
    pub recent_mismatches: Vec<OperationEvent>,
}

impl Overview {
    /// Records in `state`, over all actions.
    pub fn count_state(&self, state: State) -> i64 {
        self.groups.iter().filter(|g| g.state == state).map(|g| g.count).sum()
    }

    /// Records flagged `needs_review` (the review queue's depth).
    pub fn needs_review(&self) -> i64 {
        self.groups.iter().filter(|g| g.needs_review).map(|g| g.count).sum()
    }
}

/// Store-wide settings.
#[derive(Debug, Clone, Default)]
pub struct StoreConfig {
    /// Backoff schedule for retryable failures reported by workers.
    pub retry_policy: RetryPolicy,
    /// Refuse to create a missing SQLite file (for tools that must find the server's
    /// database, like `idem keys`).
    pub must_exist: bool,
    /// How long final records and their tombstones are kept.
    pub retention: idem_core::Retention,
    /// How long a request waits for a database connection before it fails with
    /// [`StoreError::Database`] (HTTP 503); `None` = [`DEFAULT_ACQUIRE_TIMEOUT`]. Short, so
    /// that while PostgreSQL is down every request fails fast instead of holding a worker.
    pub acquire_timeout: Option<std::time::Duration>,
    /// PostgreSQL: how long one store call may wait for the database's answer, commit
    /// included, before it fails with [`StoreError::NoAnswer`] (HTTP 503); `None` =
    /// [`DEFAULT_ANSWER_TIMEOUT`]. A connection cut off by a network partition sends no
    /// reset and would wait for TCP to give up (minutes), and a commit waiting for a
    /// synchronous standby that is gone is not covered by `statement_timeout`. Users of
    /// the [`Store`] apply it ([`Store::answer_timeout`]); SQLite's writer has its own
    /// bound (the busy timeout).
    pub answer_timeout: Option<std::time::Duration>,
}

/// Default [`StoreConfig::acquire_timeout`]: 1 s.
pub const DEFAULT_ACQUIRE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(1);
/// Default [`StoreConfig::answer_timeout`]: 10 s, as long as SQLite's busy timeout.
pub const DEFAULT_ANSWER_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

impl StoreConfig {
    /// [`StoreConfig::acquire_timeout`] or its default.
    pub fn acquire_timeout(&self) -> std::time::Duration {
        self.acquire_timeout.unwrap_or(DEFAULT_ACQUIRE_TIMEOUT)
    }

    /// [`StoreConfig::answer_timeout`] or its default.
    pub fn answer_timeout(&self) -> std::time::Duration {
        self.answer_timeout.unwrap_or(DEFAULT_ANSWER_TIMEOUT)
    }
}

/// What one sweep removed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SweepOutcome {
    /// Final records removed (each leaving a tombstone).
    pub records: u64,
    /// Expired tombstones removed.
    pub tombstones: u64,
}

/// The ledger's storage. Every method is scoped to a tenant where it touches operations;
/// a key of another tenant behaves exactly like a missing key.
///
/// Implementations must pass [`conformance::run_all`].
#[async_trait]
pub trait Store: Send + Sync + 'static {
    /// Applies one trigger atomically: the decision of DESIGN.md §3, the resulting record
    /// change (grant or lease expiry) and its events, all in one transaction.
    async fn acquire(&self, input: AcquireInput) -> Result<AcquireOutcome, StoreError>;

    /// Applies a fenced completion atomically with its event.
    ///
    /// # Errors
    /// [`StoreError::NotFound`] for a missing key, [`StoreError::Complete`] when idem-core
    /// refuses it (stale token, final record); nothing is written then.
    async fn complete(&self, req: CompleteRequest) -> Result<CompleteOutcome, StoreError>;

    /// Renews a valid lease atomically with its `lease_renewed` event: the lease of
    /// `req.fencing_token` ends `req.lease_ms` after now (idem-core `plan_renewal`).
    ///
    /// # Errors
    /// [`StoreError::NotFound`] for a missing key, [`StoreError::Renew`] when idem-core
    /// refuses it (the lease expired, another token is current, the record is not
    /// EXECUTING); nothing is written then.
    async fn renew(&self, req: RenewRequest) -> Result<OperationRecord, StoreError>;

    /// The record, or `None`.
    async fn get(&self, tenant: &str, key: &str) -> Result<Option<OperationRecord>, StoreError>;

    /// The live tombstone (`expires_at` after now) of a removed record of `key`, if any:
    /// what a late completion is told instead of "not found".
    async fn tombstone(&self, tenant: &str, key: &str) -> Result<Option<idem_core::Tombstone>, StoreError>;

    /// The record's event log, oldest first.
    async fn events(&self, tenant: &str, key: &str) -> Result<Vec<OperationEvent>, StoreError>;

    /// Records of `tenant` matching `filter`, newest first.
    async fn list(&self, tenant: &str, filter: &ListFilter) -> Result<Page, StoreError>;

    /// Counts for the operator's overview of `tenant` (all tenants when `None`, for
    /// metrics): per (action, state, needs_review), UNKNOWN records not updated since
    /// `stale_before_ms` (epoch ms), and the `recent` latest mismatch events (at most
    /// [`MAX_PAGE`]). A full scan of the tenant's records: meant for pages and scrapes,
    /// not the hot path.
    async fn overview(&self, tenant: Option<&str>, stale_before_ms: i64, recent: i64) -> Result<Overview, StoreError>;

    /// Up to `limit` operations of `connector` due for an attempt (PENDING whose next
    /// attempt is due; EXECUTING redo_safe ones whose lease expired), across tenants,
    /// oldest due first: the executor's work queue, one per connector.
    async fn due_executions(&self, connector: &str, limit: i64) -> Result<Vec<OperationRecord>, StoreError>;

    /// Up to `limit` UNKNOWN operations, not flagged for review, whose next lookup is due,
    /// across tenants (the reconciler's work queue).
    async fn due_reconciliations(&self, limit: i64) -> Result<Vec<OperationRecord>, StoreError>;

    /// Records a lookup's answer atomically with its event (idem-core `plan_reconciliation`).
    ///
    /// # Errors
    /// [`StoreError::NotFound`] for a missing key.
    async fn reconcile(&self, req: ReconcileRequest) -> Result<ReconcileOutcome, StoreError>;

    /// Applies an operator's resolution atomically with its event.
    ///
    /// # Errors
    /// [`StoreError::NotFound`], or [`StoreError::Resolve`] when idem-core refuses it.
    async fn resolve(&self, req: ResolveRequest) -> Result<OperationRecord, StoreError>;

    /// Removes up to `limit` final records whose retention ended, leaving tombstones, and
    /// up to `limit` expired tombstones (see `idem_core::retention`). Never touches a
    /// record that is not SUCCEEDED or FAILED. One short transaction: acquires wait at
    /// most for one bounded batch.
    async fn sweep(&self, limit: i64) -> Result<SweepOutcome, StoreError>;

    /// Turns up to `limit` EXECUTING records whose lease expired (and whose action is not
    /// redo_safe) into UNKNOWN, across tenants. Returns how many changed.
    async fn expire_leases(&self, limit: i64) -> Result<u64, StoreError>;

    /// Stores a new API key. With `secret = None` a random one is generated.
    /// Returns the key's info and its secret (the only time the secret is available).
    async fn create_api_key(
        &self,
        tenant: &str,
        principal: &str,
        role: Role,
        secret: Option<String>,
    ) -> Result<(ApiKeyInfo, String), StoreError>;

    /// The live (not revoked) key whose secret is `secret`.
    async fn authenticate(&self, secret: &str) -> Result<Option<ApiKeyInfo>, StoreError>;

    /// Keys, of one tenant or all.
    async fn list_api_keys(&self, tenant: Option<&str>) -> Result<Vec<ApiKeyInfo>, StoreError>;

    /// Revokes a key by id; false if there was no live key with that id.
    async fn revoke_api_key(&self, id: &str) -> Result<bool, StoreError>;

    /// Revokes tenant `tenant`'s live key `id` unless it is the tenant's last active admin
    /// key — checked and written atomically (on PostgreSQL under a per-tenant transaction
    /// lock, on SQLite by its single writer), so two admins revoking each other at the same
    /// moment cannot both succeed.
    async fn revoke_api_key_keeping_an_admin(&self, tenant: &str, id: &str) -> Result<keys::Revocation, StoreError>;

    /// Number of keys ever created (revoked ones included): 0 means a first start.
    async fn count_api_keys(&self) -> Result<i64, StoreError>;

    /// Checks the database answers and still holds idem's tables (for `/readyz` and
    /// `/healthz`).
    ///
    /// # Errors
    /// [`StoreError::SchemaMissing`] when the tables are gone (the database was dropped
    /// and created again under the node), else the database's error.
    async fn ping(&self) -> Result<(), StoreError>;

    /// What the database promises about an acknowledged commit, read from it now (on
    /// PostgreSQL `synchronous_commit` and `synchronous_standby_names`, which a failover
    /// can change). Required (no default), so that a store wrapping another forwards it.
    ///
    /// # Errors
    /// The database's error.
    async fn commit_durability(&self) -> Result<CommitDurability, StoreError>;

    /// How long a caller should let one call wait for the database before it gives up
    /// with [`StoreError::NoAnswer`] ([`StoreConfig::answer_timeout`] on PostgreSQL);
    /// `None`: the store bounds its waits itself (SQLite).
    fn answer_timeout(&self) -> Option<std::time::Duration>;

    /// A failure only a restart of this process ends ([`StoreError::NotDurable`]: the
    /// SQLite WAL could not be synced), for `/healthz`; `None` while the store works.
    /// Required (no default), so that a store wrapping another cannot hide it.
    fn fatal(&self) -> Option<StoreError>;

    /// The workflow tables of the same database ([`flow::WorkflowStore`]).
    fn flows(&self) -> &dyn flow::WorkflowStore;
}

/// A ping's verdict from the highest migration the database has applied: the database
/// answered and holds at least every migration `migrator` has, or
/// [`StoreError::SchemaMissing`] when the migrations table or a migration is gone (the
/// database was dropped and created again under the node), or the database's error.
pub(crate) fn schema_check(
    applied: Result<Option<i64>, StoreError>,
    migrator: &sqlx::migrate::Migrator,
) -> Result<(), StoreError> {
    let latest = migrator.iter().map(|m| m.version).max().unwrap_or(0);
    match applied {
        Ok(Some(v)) if v >= latest => Ok(()),
        Ok(v) => Err(StoreError::SchemaMissing(format!(
            "its highest migration is {}, this binary's is {latest}",
            v.map_or_else(|| "none".to_owned(), |v| v.to_string())
        ))),
        Err(e) if e.schema_missing() => Err(StoreError::SchemaMissing("no migrations table".into())),
        Err(e) => Err(e),
    }
}

/// Validates the names and builds the info of a new key (shared by both stores).
pub(crate) fn new_key_info(
    tenant: &str,
    principal: &str,
    role: Role,
    secret: Option<String>,
    now_ms: i64,
) -> Result<(ApiKeyInfo, String), StoreError> {
    keys::validate_name("tenant", tenant).map_err(StoreError::Invalid)?;
    keys::validate_name("principal", principal).map_err(StoreError::Invalid)?;
    let secret = match secret {
        Some(s) => {
            keys::validate_supplied_secret(&s).map_err(StoreError::Invalid)?;
            s
        }
        None => keys::generate_secret(),
    };
    let info = ApiKeyInfo {
        id: uuid::Uuid::now_v7().to_string(),
        tenant: tenant.into(),
        principal: principal.into(),
        role,
        created_at: now_ms,
        revoked_at: None,
    };
    Ok((info, secret))
}

/// A uniform random number in `[0, 1)` for full-jitter backoff.
pub(crate) fn jitter() -> f64 {
    use rand::RngExt;
    rand::rng().random::<f64>()
}

/// Where a database URL points.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DatabaseUrl<'a> {
    /// `postgres://…` / `postgresql://…`.
    Postgres(&'a str),
    /// `sqlite://PATH`, `sqlite:PATH` or a plain file path: the file's path.
    Sqlite(&'a str),
}

/// Classifies `url`.
///
/// # Errors
/// [`StoreError::Invalid`] for another scheme (`mysql://…`, `foo:bar`): a typo must not
/// silently become an SQLite file of that name.
pub fn parse_database_url(url: &str) -> Result<DatabaseUrl<'_>, StoreError> {
    if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        return Ok(DatabaseUrl::Postgres(url));
    }
    if let Some(path) = url.strip_prefix("sqlite://").or_else(|| url.strip_prefix("sqlite:")) {
        return Ok(DatabaseUrl::Sqlite(path));
    }
    let looks_like_scheme = url.split_once(':').is_some_and(|(scheme, _)| {
        !scheme.is_empty() && scheme.bytes().all(|b| b.is_ascii_alphanumeric() || b"+.-".contains(&b))
    });
    if looks_like_scheme || url.is_empty() {
        return Err(StoreError::Invalid(format!(
            "unsupported database URL {url:?}: use sqlite://PATH (or a file path) or postgres://user@host:port/db"
        )));
    }
    Ok(DatabaseUrl::Sqlite(url))
}

/// Why an SQLite database cannot be opened or created at `path`, if that is clear before
/// SQLite tries (it then says only "unable to open database file"): an empty path, a path
/// that is a directory, or a directory that is missing or not a directory (SQLite creates
/// the file, never its directory). `None` otherwise.
#[must_use]
pub fn sqlite_path_error(path: &str) -> Option<String> {
    if path.is_empty() {
        return Some("the SQLite database path is empty: use sqlite://PATH or a file path".into());
    }
    let file = std::path::Path::new(path);
    if file.is_dir() {
        return Some(format!("cannot open the database {path}: it is a directory; name a file in it"));
    }
    let dir = file.parent().filter(|d| !d.as_os_str().is_empty())?;
    if dir.is_dir() {
        return None;
    }
    let what = if dir.exists() { "is not a directory" } else { "does not exist" };
    Some(format!("cannot create the database {path}: {} {what}", dir.display()))
}

/// Opens the store a database URL names (see [`parse_database_url`]), applying migrations.
/// An SQLite file is created if missing unless `config.must_exist` is set.
///
/// # Errors
/// [`StoreError::Invalid`] for an unsupported URL, a missing file that must exist, or an
/// SQLite path [`sqlite_path_error`] refuses,
/// [`StoreError::Database`] if the database cannot be opened, [`StoreError::Migrate`] if
/// its schema cannot be brought up to date.
pub async fn open(url: &str, clock: Arc<dyn Clock>, config: StoreConfig) -> Result<Arc<dyn Store>, StoreError> {
    match parse_database_url(url)? {
        DatabaseUrl::Postgres(url) => Ok(Arc::new(postgres::PgStore::connect(url, clock, config).await?)),
        DatabaseUrl::Sqlite(path) => {
            if let Some(why) = sqlite_path_error(path) {
                return Err(StoreError::Invalid(why));
            }
            if config.must_exist && !std::path::Path::new(path).exists() {
                return Err(StoreError::Invalid(format!(
                    "no database at {path}: point --database-url at the file idem serve uses"
                )));
            }
            Ok(Arc::new(sqlite::SqliteStore::open(path, clock, config).await?))
        }
    }
}
