//! Row shapes of the workflow tables, shared by both backends, and their conversion.

use crate::StoreError;
use crate::row::OperationRow;
use idem_core::flow::{Checkpoint, InstanceEvent, InstanceRecord, InstanceState, RecoveryPolicy, StepRow};

/// Columns of `workflow_instances` in `SELECT` order.
macro_rules! instance_columns {
    () => {
        "tenant, instance_id, workflow, definition_version, source_event, input, input_fingerprint, state, \
         stopped_step, error_class, error_message, trace_id, next_run_at, created_at, updated_at, completed_at, \
         expires_at, version"
    };
}
pub(crate) use instance_columns;

/// Columns of `workflow_events` in `SELECT` order.
macro_rules! instance_event_columns {
    () => {
        "seq, tenant, instance_id, at, kind, principal, request_id, from_state, to_state, step, reason"
    };
}
pub(crate) use instance_event_columns;

/// A `workflow_instances` row.
#[derive(Debug, sqlx::FromRow)]
pub(crate) struct InstanceRow {
    pub tenant: String,
    pub instance_id: String,
    pub workflow: String,
    pub definition_version: String,
    pub source_event: Option<String>,
    pub input: String,
    pub input_fingerprint: String,
    pub state: String,
    pub stopped_step: Option<String>,
    pub error_class: Option<String>,
    pub error_message: Option<String>,
    pub trace_id: Option<String>,
    pub next_run_at: Option<i64>,
    pub created_at: i64,
    pub updated_at: i64,
    pub completed_at: Option<i64>,
    pub expires_at: Option<i64>,
    pub version: i64,
}

pub(crate) fn parse_instance_state(s: &str) -> Result<InstanceState, StoreError> {
    s.parse().map_err(|e: idem_core::flow::state::ParseInstanceStateError| StoreError::Corrupt(e.to_string()))
}

fn parse_policy(s: &str) -> Result<RecoveryPolicy, StoreError> {
    serde_json::from_value(serde_json::Value::String(s.to_owned()))
        .map_err(|_| StoreError::Corrupt(format!("unknown recovery policy {s:?}")))
}

impl InstanceRow {
    pub(crate) fn into_record(self) -> Result<InstanceRecord, StoreError> {
        Ok(InstanceRecord {
            tenant: self.tenant,
            instance_id: self.instance_id,
            workflow: self.workflow,
            definition_version: self.definition_version,
            source_event: self.source_event,
            input: serde_json::from_str(&self.input).map_err(|e| StoreError::Corrupt(format!("stored input: {e}")))?,
            input_fingerprint: self.input_fingerprint,
            state: parse_instance_state(&self.state)?,
            stopped_step: self.stopped_step,
            error_class: self.error_class,
            error_message: self.error_message,
            trace_id: self.trace_id,
            next_run_at: self.next_run_at,
            created_at: self.created_at,
            updated_at: self.updated_at,
            completed_at: self.completed_at,
            expires_at: self.expires_at,
            version: self.version,
        })
    }
}

/// A `workflow_events` row.
#[derive(Debug, sqlx::FromRow)]
pub(crate) struct InstanceEventRow {
    pub seq: i64,
    pub tenant: String,
    pub instance_id: String,
    pub at: i64,
    pub kind: String,
    pub principal: String,
    pub request_id: Option<String>,
    pub from_state: Option<String>,
    pub to_state: Option<String>,
    pub step: Option<String>,
    pub reason: Option<String>,
}

impl InstanceEventRow {
    pub(crate) fn into_event(self) -> Result<InstanceEvent, StoreError> {
        Ok(InstanceEvent {
            seq: self.seq,
            tenant: self.tenant,
            instance_id: self.instance_id,
            at: self.at,
            kind: self.kind,
            principal: self.principal,
            request_id: self.request_id,
            from_state: self.from_state.as_deref().map(parse_instance_state).transpose()?,
            to_state: self.to_state.as_deref().map(parse_instance_state).transpose()?,
            step: self.step,
            reason: self.reason,
        })
    }
}

/// A `workflow_steps` row.
#[derive(Debug, sqlx::FromRow)]
pub(crate) struct StepRowRow {
    pub tenant: String,
    pub instance_id: String,
    pub position: i64,
    pub step: String,
    pub op_key: String,
    pub comp_key: String,
    pub policy: String,
}

impl StepRowRow {
    pub(crate) fn into_row(self) -> Result<StepRow, StoreError> {
        Ok(StepRow {
            tenant: self.tenant,
            instance_id: self.instance_id,
            position: self.position,
            step: self.step,
            op_key: self.op_key,
            comp_key: self.comp_key,
            policy: parse_policy(&self.policy)?,
        })
    }
}

/// The checkpoints statement: each step row (`s_…` columns) with its operation's columns
/// (NULL when the operation does not exist yet), then (`UNION ALL`, `s_kind` 1) each
/// compensation operation that exists, so one round trip reads both.
pub(crate) static CHECKPOINTS_SQL: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    let cols = |t: &str| -> String {
        crate::row::operation_columns!().split(',').map(|c| format!("{t}.{}", c.trim())).collect::<Vec<_>>().join(", ")
    };
    let step = "s.tenant AS s_tenant, s.instance_id AS s_instance_id, s.position AS s_position, s.step AS s_step, \
         s.op_key AS s_op_key, s.comp_key AS s_comp_key, s.policy AS s_policy";
    format!(
        "SELECT 0 AS s_kind, {step}, {} FROM workflow_steps s \
         LEFT JOIN operations o ON o.tenant = s.tenant AND o.op_key = s.op_key \
         WHERE s.tenant = $1 AND s.instance_id = $2 \
         UNION ALL SELECT 1 AS s_kind, {step}, {} FROM workflow_steps s \
         JOIN operations c ON c.tenant = s.tenant AND c.op_key = s.comp_key \
         WHERE s.tenant = $1 AND s.instance_id = $2 ORDER BY s_position, s_kind",
        cols("o"),
        cols("c")
    )
});

/// The rows of [`CHECKPOINTS_SQL`] as checkpoints: each step's row, then its
/// compensation's, if any.
pub(crate) fn checkpoints_of<R>(rows: &[R]) -> Result<Vec<Checkpoint>, StoreError>
where
    R: sqlx::Row,
    for<'r> OperationRow: sqlx::FromRow<'r, R>,
    for<'r> &'r str: sqlx::ColumnIndex<R>,
    String: for<'r> sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    Option<String>: for<'r> sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    i64: for<'r> sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    i32: for<'r> sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
{
    let mut out: Vec<Checkpoint> = Vec::with_capacity(rows.len());
    for row in rows {
        let kind: i32 = row.try_get("s_kind")?;
        let step = StepRowRow {
            tenant: row.try_get("s_tenant")?,
            instance_id: row.try_get("s_instance_id")?,
            position: row.try_get("s_position")?,
            step: row.try_get("s_step")?,
            op_key: row.try_get("s_op_key")?,
            comp_key: row.try_get("s_comp_key")?,
            policy: row.try_get("s_policy")?,
        }
        .into_row()?;
        let exists: Option<String> = row.try_get("state")?;
        let op = match exists {
            Some(_) => Some(<OperationRow as sqlx::FromRow<R>>::from_row(row)?.into_record()?),
            None => None,
        };
        match (kind, out.last_mut()) {
            (1, Some(last)) if last.row.position == step.position => {
                *last = Checkpoint::with_compensation(last.row.clone(), last.operation.take(), op);
            }
            (1, _) => return Err(StoreError::Corrupt("a compensation without its step in the checkpoints".into())),
            _ => out.push(Checkpoint::of(step, op)),
        }
    }
    Ok(out)
}
