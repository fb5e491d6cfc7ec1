//! Statistics for a fresh database: `ANALYZE` each of idem's looked-up tables once it has
//! grown past a few hundred rows, if PostgreSQL has never analyzed it.
//!
//! Every pooled and writer connection plans a statement once and keeps the plan
//! (`plan_cache_mode = force_generic_plan`, see `connect_options`). On a table that has
//! never been analyzed the planner has no statistics: `tenant = $1` gets the default
//! selectivity (0.5 %) and, while the table is a few pages, a lookup by `(tenant, op_key)`
//! through `operations_by_created (tenant, created_at, op_key)` — bounded by `tenant`
//! alone, every record of the tenant read and filtered — costs the same as the primary
//! key's probe. Plans made then picked either at random (auto_explain under 16 clients on
//! a fresh database: 467 of ~3 800 batch statements probed by `operations_by_created`),
//! and kept them until an `ANALYZE` invalidated them: each probe then read the whole
//! tenant, a cost growing with the ledger. Autovacuum analyzes a table within about a
//! minute of it changing (its naptime); this does it within [`CHECK_EVERY`] of the table
//! reaching [`MIN_PAGES`], and the `ANALYZE` invalidates every session's cached plans, so
//! they are made again with statistics (one tenant value → the tenant-bounded scan costs
//! the whole table, the primary key wins).
//!
//! Checked by `hot_path_statements_probe_the_key_index_on_a_fresh_database`.

use sqlx::PgPool;
use std::sync::Weak;
use std::time::Duration;

/// The tables whose statements look rows up by key and so depend on statistics to choose
/// the primary key over a wider index that shares its first column, each with the
/// statement that analyzes it.
const TABLES: &[(&str, &str)] = &[
    ("operations", "ANALYZE operations"),
    ("workflow_instances", "ANALYZE workflow_instances"),
    ("workflow_steps", "ANALYZE workflow_steps"),
];
/// Size (8 KiB pages, PostgreSQL's default block size) from which a never-analyzed table
/// is analyzed: 100–200 records of `operations`. Large enough that a plan made from the
/// statistics probes an index for a single key rather than read the table (which
/// a plan would keep while the table grows), small enough to come early.
const MIN_PAGES: i64 = 8;
/// How often the tables are checked while one of them has never been analyzed: every
/// second for the first [`FAST_CHECKS`] checks (a fresh node under load), then every 30 s
/// (a table idem has not used yet, such as the workflow tables of a deployment without
/// workflows, stays unanalyzed until it is used).
const CHECK_EVERY: Duration = Duration::from_secs(1);
const FAST_CHECKS: u32 = 120;
const CHECK_LATER: Duration = Duration::from_secs(30);

/// The tables of [`TABLES`] that were never analyzed or vacuumed (`reltuples < 0`, as
/// PostgreSQL 14+ marks them) and whose size has reached [`MIN_PAGES`]; and whether any
/// listed table is still unanalyzed at all.
const DUE: &str = "SELECT c.relname::text, pg_relation_size(c.oid) / current_setting('block_size')::bigint >= $2 \
     FROM pg_class c WHERE c.relname = ANY($1) AND c.relkind = 'r' AND c.reltuples < 0 \
     AND c.relnamespace = to_regnamespace(current_schema())";

/// Checks (see [`CHECK_EVERY`]) for as long as `alive` (the store) exists and some table
/// of [`TABLES`] has never been analyzed. A table it cannot analyze is logged once and
/// left to autovacuum; a failed check is retried on the next one.
pub(super) fn spawn<T: Send + Sync + 'static>(alive: Weak<T>, pool: PgPool) {
    tokio::spawn(async move {
        let tables: Vec<String> = TABLES.iter().map(|(t, _)| (*t).to_owned()).collect();
        let mut checks = 0u32;
        // Tables this node could not analyze (no privilege, say): warned about once, left
        // to autovacuum.
        let mut refused: Vec<String> = Vec::new();
        while alive.strong_count() > 0 {
            checks = checks.saturating_add(1);
            match sqlx::query_as::<_, (String, bool)>(DUE).bind(&tables).bind(MIN_PAGES).fetch_all(&pool).await {
                Ok(rows) if rows.iter().all(|(t, _)| refused.contains(t)) => return,
                Ok(rows) => {
                    for (table, due) in rows {
                        let Some((_, analyze)) = TABLES.iter().find(|(t, _)| *t == table) else { continue };
                        if due && !refused.contains(&table) {
                            match sqlx::raw_sql(*analyze).execute(&pool).await {
                                Ok(_) => tracing::info!(table, "analyzed a fresh table so its lookups plan by key"),
                                Err(e) => {
                                    tracing::warn!(table, error = %e, "cannot analyze a fresh table; autovacuum will");
                                    refused.push(table);
                                }
                            }
                        }
                    }
                }
                Err(e) => tracing::debug!(error = %e, "cannot check for tables never analyzed"),
            }
            tokio::time::sleep(if checks < FAST_CHECKS { CHECK_EVERY } else { CHECK_LATER }).await;
        }
    });
}
