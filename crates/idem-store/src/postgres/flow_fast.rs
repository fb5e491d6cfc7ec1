//! Workflow writes as single statements on PostgreSQL (the engine's hot path): an instance
//! write carries its events in a data-modifying CTE, so a conditional write costs one round
//! trip and one commit instead of BEGIN, UPDATE, INSERT and COMMIT.

use crate::StoreError;
use crate::flow::InstanceUpdate;
use sqlx::{PgPool, Postgres, QueryBuilder, Row};

/// Writes `u` (with its events) if the stored version is still `u.read_version`, applying
/// the retention window of an instance that became final; true if written.
pub(super) async fn update_instance(
    pool: &PgPool,
    u: &InstanceUpdate,
    retention: &idem_core::Retention,
) -> Result<bool, StoreError> {
    let mut r = u.record.clone();
    r.apply_retention(retention);
    let mut q: QueryBuilder<Postgres> = QueryBuilder::new("WITH upd AS (UPDATE workflow_instances SET state = ");
    q.push_bind(r.state.as_str())
        .push(", stopped_step = ")
        .push_bind(r.stopped_step.clone())
        .push(", error_class = ")
        .push_bind(r.error_class.clone())
        .push(", error_message = ")
        .push_bind(r.error_message.clone())
        .push(", next_run_at = ")
        .push_bind(r.next_run_at)
        .push(", updated_at = ")
        .push_bind(r.updated_at)
        .push(", completed_at = ")
        .push_bind(r.completed_at)
        .push(", expires_at = ")
        .push_bind(r.expires_at)
        .push(", version = ")
        .push_bind(r.version)
        .push(" WHERE tenant = ")
        .push_bind(r.tenant.clone())
        .push(" AND instance_id = ")
        .push_bind(r.instance_id.clone())
        .push(" AND version = ")
        .push_bind(u.read_version)
        .push(" AND created_at = ")
        .push_bind(r.created_at)
        .push(" RETURNING 1)");
    if !u.events.is_empty() {
        q.push(
            ", ev AS (INSERT INTO workflow_events (tenant, instance_id, at, kind, principal, request_id, from_state, \
             to_state, step, reason) SELECT * FROM (",
        );
        q.push_values(&u.events, |mut b, e| {
            b.push_bind(e.tenant.clone())
                .push_bind(e.instance_id.clone())
                .push_bind(e.at)
                .push_bind(e.kind.clone())
                .push_bind(e.principal.clone())
                .push_bind(e.request_id.clone())
                .push_bind(e.from_state.map(|s| s.as_str()))
                .push_bind(e.to_state.map(|s| s.as_str()))
                .push_bind(e.step.clone())
                .push_bind(e.reason.clone());
        });
        q.push(") AS e WHERE EXISTS (SELECT 1 FROM upd))");
    }
    q.push(" SELECT COUNT(*) AS n FROM upd");
    let row = super::committed(q.build().fetch_one(pool)).await?;
    Ok(row.try_get::<i64, _>("n")? == 1)
}
