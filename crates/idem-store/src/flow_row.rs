//! Row shapes of the workflow tables, shared by both backends, and their conversion.

use crate::StoreError;
use crate::row::OperationRow;
use idem_core::flow::{
    Checkpoint, InstanceEvent, InstanceRecord, InstanceState, ItemCheckpoint, ItemRow, RecoveryPolicy, StepRow,
};

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
/// compensation operation that exists, then each item of a step for each item (`s_kind`
/// 2, `s_item`, `s_seq`) with its operation, and its compensation's (`s_kind` 3), so one
/// round trip reads them all.
pub(crate) static CHECKPOINTS_SQL: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    let cols = |t: &str| -> String {
        crate::row::operation_columns!().split(',').map(|c| format!("{t}.{}", c.trim())).collect::<Vec<_>>().join(", ")
    };
    let row = |t: &str| {
        format!(
            "{t}.tenant AS s_tenant, {t}.instance_id AS s_instance_id, {t}.position AS s_position, {t}.step AS s_step, \
             {t}.op_key AS s_op_key, {t}.comp_key AS s_comp_key, {t}.policy AS s_policy"
        )
    };
    let (step, item) = (row("s"), row("i"));
    let no_item = "'' AS s_item, CAST(0 AS BIGINT) AS s_seq";
    let an_item = "i.item AS s_item, i.seq AS s_seq";
    format!(
        "SELECT 0 AS s_kind, {step}, {no_item}, {o} FROM workflow_steps s \
         LEFT JOIN operations o ON o.tenant = s.tenant AND o.op_key = s.op_key \
         WHERE s.tenant = $1 AND s.instance_id = $2 \
         UNION ALL SELECT 1 AS s_kind, {step}, {no_item}, {c} FROM workflow_steps s \
         JOIN operations c ON c.tenant = s.tenant AND c.op_key = s.comp_key \
         WHERE s.tenant = $1 AND s.instance_id = $2 \
         UNION ALL SELECT 2 AS s_kind, {item}, {an_item}, {o} FROM workflow_items i \
         LEFT JOIN operations o ON o.tenant = i.tenant AND o.op_key = i.op_key \
         WHERE i.tenant = $1 AND i.instance_id = $2 \
         UNION ALL SELECT 3 AS s_kind, {item}, {an_item}, {c} FROM workflow_items i \
         JOIN operations c ON c.tenant = i.tenant AND c.op_key = i.comp_key \
         WHERE i.tenant = $1 AND i.instance_id = $2 ORDER BY s_position, s_seq, s_kind",
        o = cols("o"),
        c = cols("c")
    )
});

/// The rows of [`CHECKPOINTS_SQL`] as checkpoints: each step's row, then its
/// compensation's, if any, then its items with theirs.
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
    let mut items: Vec<ItemCheckpoint> = Vec::new();
    let flush = |out: &mut Vec<Checkpoint>, items: &mut Vec<ItemCheckpoint>| {
        if let (Some(last), false) = (out.last_mut(), items.is_empty()) {
            *last = Checkpoint::with_items(last.row.clone(), std::mem::take(items));
        }
    };
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
        if kind >= 2 {
            if out.last().is_none_or(|last| last.row.position != step.position) {
                return Err(StoreError::Corrupt("an item without its step in the checkpoints".into()));
            }
            let item = ItemRow {
                item: row.try_get("s_item")?,
                seq: row.try_get("s_seq")?,
                tenant: step.tenant,
                instance_id: step.instance_id,
                position: step.position,
                step: step.step,
                op_key: step.op_key,
                comp_key: step.comp_key,
                policy: step.policy,
            };
            match (kind, items.last_mut()) {
                (3, Some(last)) if last.row.item == item.item => {
                    *last = ItemCheckpoint::of(last.row.clone(), last.operation.take(), op);
                }
                (3, _) => return Err(StoreError::Corrupt("a compensation without its item in the checkpoints".into())),
                _ => items.push(ItemCheckpoint::of(item, op, None)),
            }
            continue;
        }
        match (kind, out.last_mut()) {
            (1, Some(last)) if last.row.position == step.position => {
                *last = Checkpoint::with_compensation(last.row.clone(), last.operation.take(), op);
            }
            (1, _) => return Err(StoreError::Corrupt("a compensation without its step in the checkpoints".into())),
            _ => {
                flush(&mut out, &mut items);
                out.push(Checkpoint::of(step, op));
            }
        }
    }
    flush(&mut out, &mut items);
    Ok(out)
}
