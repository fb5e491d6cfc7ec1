//! Statistics for a fresh (or never vacuumed) database: `ANALYZE` each of idem's looked-up
//! tables once it has grown past a few hundred rows if PostgreSQL has never analyzed it,
//! and again whenever it has grown tenfold since (autovacuum would have; it may be off).
//!
//! Every pooled and writer connection plans a statement once and keeps the plan
//! (`plan_cache_mode = force_generic_plan`, see `pool_options`). On a table that has
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
    ("workflow_items", "ANALYZE workflow_items"),
];
/// Size (8 KiB pages, PostgreSQL's default block size) from which a never-analyzed table
/// is analyzed: 100–200 records of `operations`. Large enough that a plan made from the
/// statistics probes an index for a single key rather than read the table (which
/// a plan would keep while the table grows), small enough to come early.
const MIN_PAGES: i64 = 8;
/// How often the tables are checked: every second for the first [`FAST_CHECKS`] checks (a
/// fresh node under load), then every 30 s. One catalog query each.
const CHECK_EVERY: Duration = Duration::from_secs(1);
const FAST_CHECKS: u32 = 120;
const CHECK_LATER: Duration = Duration::from_secs(30);

/// How much a table must have grown (in pages) since PostgreSQL last analyzed or
/// vacuumed it before idem analyzes it again. Autovacuum analyzes after 10 % of the rows
/// changed, so with it on this never fires; with it off (as on some managed and test
/// servers) the statistics of a table analyzed at 200 rows would describe it forever.
const GROWTH: i64 = 10;

/// Each table of [`TABLES`] with whether it is due: never analyzed or vacuumed
/// (`reltuples < 0`, as PostgreSQL 14+ marks it) and at least [`MIN_PAGES`], or grown to
/// [`GROWTH`] times its size (`relpages`) at its last ANALYZE or VACUUM.
const DUE: &str = "SELECT c.relname::text, pg_relation_size(c.oid) / current_setting('block_size')::bigint >= \
     CASE WHEN c.reltuples < 0 THEN $2 ELSE $3 * greatest(c.relpages::bigint, $2) END \
     FROM pg_class c WHERE c.relname = ANY($1) AND c.relkind = 'r' \
     AND c.relnamespace = to_regnamespace(current_schema())";

/// The tables of [`TABLES`] that are due (see [`DUE`]).
async fn due(pool: &PgPool, tables: &[String]) -> Result<Vec<String>, sqlx::Error> {
    let rows =
        sqlx::query_as::<_, (String, bool)>(DUE).bind(tables).bind(MIN_PAGES).bind(GROWTH).fetch_all(pool).await?;
    Ok(rows.into_iter().filter(|(_, due)| *due).map(|(t, _)| t).collect())
}

/// Checks (see [`CHECK_EVERY`]) for as long as `alive` (the store) exists. A table this
/// node cannot analyze — PostgreSQL answers a role that does not own it with a warning,
/// not an error, so that is seen as the table still being due right after its ANALYZE —
/// is logged once and left alone; a failed check is retried on the next one.
pub(super) fn spawn<T: Send + Sync + 'static>(alive: Weak<T>, pool: PgPool) {
    tokio::spawn(async move {
        let tables: Vec<String> = TABLES.iter().map(|(t, _)| (*t).to_owned()).collect();
        let mut checks = 0u32;
        let mut refused: Vec<String> = Vec::new();
        while alive.strong_count() > 0 {
            checks = checks.saturating_add(1);
            match due(&pool, &tables).await {
                Ok(tables_due) => {
                    let mut analyzed = Vec::new();
                    let tables_due: Vec<String> = tables_due.into_iter().filter(|t| !refused.contains(t)).collect();
                    for table in tables_due {
                        let Some((_, analyze)) = TABLES.iter().find(|(t, _)| *t == table) else { continue };
                        match sqlx::raw_sql(*analyze).execute(&pool).await {
                            Ok(_) => analyzed.push(table),
                            Err(e) => {
                                tracing::warn!(table, error = %e, "cannot analyze a table idem looks rows up in");
                                refused.push(table);
                            }
                        }
                    }
                    if !analyzed.is_empty() {
                        let still = due(&pool, &tables).await.unwrap_or_default();
                        for table in analyzed {
                            if still.contains(&table) {
                                tracing::warn!(
                                    table,
                                    "ANALYZE left the table without statistics (is idem's role its owner?); \
                                     its plans rely on autovacuum or on its owner running ANALYZE"
                                );
                                refused.push(table);
                            } else {
                                tracing::info!(table, "analyzed a grown table so its lookups plan by key");
                            }
                        }
                    }
                }
                Err(e) => tracing::debug!(error = %e, "cannot check the tables' statistics"),
            }
            tokio::time::sleep(if checks < FAST_CHECKS { CHECK_EVERY } else { CHECK_LATER }).await;
        }
    });
}
