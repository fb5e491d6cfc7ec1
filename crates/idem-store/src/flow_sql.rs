//! The workflow statements both backends share, written once and expanded per backend by
//! [`flow_ops!`] (as `sql_ops!` does for operations). Every statement is valid on SQLite
//! ≥ 3.35 and PostgreSQL ≥ 12. Writes are conditional (`ON CONFLICT DO NOTHING`,
//! `WHERE version = $read`); a write whose condition fails returns `None`/`false` and the
//! caller starts over from a fresh read.

/// Expands the workflow statements for one backend. `$Conn` is its connection type.
macro_rules! flow_ops {
    ($Conn:ty) => {
        use $crate::flow::{InstanceFilter, InstancePage, InstanceUpdate, StartOutcome, StartRequest};
        use $crate::flow_row::{instance_columns, instance_event_columns, InstanceEventRow, InstanceRow, StepRowRow};
        use $crate::StoreError;
        use idem_core::flow::{
            Checkpoint, Definition, InstanceEvent, InstanceRecord, InstanceTombstone, StartDecision, StepRow,
            plan_start,
        };

        pub(crate) async fn load_instance(conn: &mut $Conn, tenant: &str, id: &str) -> Result<Option<InstanceRecord>, StoreError> {
            let sql = concat!("SELECT ", instance_columns!(), " FROM workflow_instances WHERE tenant = $1 AND instance_id = $2");
            let row: Option<InstanceRow> = sqlx::query_as(sql).bind(tenant).bind(id).fetch_optional(&mut *conn).await?;
            row.map(InstanceRow::into_record).transpose()
        }

        pub(crate) async fn load_instance_tombstone(conn: &mut $Conn, tenant: &str, id: &str) -> Result<Option<InstanceTombstone>, StoreError> {
            let row: Option<(String, String, String, String, i64, i64)> = sqlx::query_as(
                "SELECT tenant, id_hash, input_fingerprint, final_state, completed_at, expires_at \
                 FROM workflow_tombstones WHERE tenant = $1 AND id_hash = $2",
            )
            .bind(tenant)
            .bind(idem_core::retention::key_hash(id))
            .fetch_optional(&mut *conn)
            .await?;
            row.map(|(tenant, id_hash, input_fingerprint, state, completed_at, expires_at)| {
                Ok(InstanceTombstone {
                    tenant,
                    id_hash,
                    input_fingerprint,
                    final_state: $crate::flow_row::parse_instance_state(&state)?,
                    completed_at,
                    expires_at,
                })
            })
            .transpose()
        }

        async fn insert_instance(conn: &mut $Conn, r: &InstanceRecord) -> Result<bool, StoreError> {
            let done = sqlx::query(concat!(
                "INSERT INTO workflow_instances (", instance_columns!(), ") \
                 VALUES ($1,$2,$3,$4,$5,$6,$7,$8,$9,$10,$11,$12,$13,$14,$15,$16,$17,$18) \
                 ON CONFLICT (tenant, instance_id) DO NOTHING"
            ))
            .bind(&r.tenant)
            .bind(&r.instance_id)
            .bind(&r.workflow)
            .bind(&r.definition_version)
            .bind(&r.source_event)
            .bind(r.input.to_string())
            .bind(&r.input_fingerprint)
            .bind(r.state.as_str())
            .bind(&r.stopped_step)
            .bind(&r.error_class)
            .bind(&r.error_message)
            .bind(&r.trace_id)
            .bind(r.next_run_at)
            .bind(r.created_at)
            .bind(r.updated_at)
            .bind(r.completed_at)
            .bind(r.expires_at)
            .bind(r.version)
            .execute(&mut *conn)
            .await?;
            Ok(done.rows_affected() == 1)
        }

        async fn append_instance_event(conn: &mut $Conn, e: &InstanceEvent) -> Result<(), StoreError> {
            sqlx::query(
                "INSERT INTO workflow_events (tenant, instance_id, at, kind, principal, request_id, from_state, \
                 to_state, step, reason) VALUES ($1,$2,$3,$4,$5,$6,$7,$8,$9,$10)",
            )
            .bind(&e.tenant)
            .bind(&e.instance_id)
            .bind(e.at)
            .bind(&e.kind)
            .bind(&e.principal)
            .bind(&e.request_id)
            .bind(e.from_state.map(|s| s.as_str()))
            .bind(e.to_state.map(|s| s.as_str()))
            .bind(&e.step)
            .bind(&e.reason)
            .execute(&mut *conn)
            .await?;
            Ok(())
        }

        /// One try of a start inside the caller's transaction; `None` = another start of
        /// the same instance won the insert: retry from the read.
        pub(crate) async fn start_once(conn: &mut $Conn, req: &StartRequest, now_ms: i64) -> Result<Option<StartOutcome>, StoreError> {
            let input = &req.input;
            let existing = load_instance(conn, &input.tenant, &input.instance_id).await?;
            let tombstone = match existing {
                None => load_instance_tombstone(conn, &input.tenant, &input.instance_id).await?,
                Some(_) => None,
            };
            let plan = plan_start(existing.as_ref(), tombstone.as_ref(), input, now_ms);
            if plan.decision == StartDecision::Created {
                let text = serde_json::to_string(&req.definition).map_err(|e| StoreError::Invalid(e.to_string()))?;
                sqlx::query(
                    "INSERT INTO workflow_definitions (tenant, name, version, definition, created_at) \
                     VALUES ($1,$2,$3,$4,$5) ON CONFLICT (tenant, name, version) DO NOTHING",
                )
                .bind(&input.tenant)
                .bind(&req.definition.name)
                .bind(&input.definition_version)
                .bind(text)
                .bind(now_ms)
                .execute(&mut *conn)
                .await?;
                if !insert_instance(conn, &plan.record).await? {
                    return Ok(None);
                }
                for row in StepRow::all_of(&input.tenant, &input.instance_id, &req.definition) {
                    sqlx::query(
                        "INSERT INTO workflow_steps (tenant, instance_id, position, step, op_key, comp_key, policy) \
                         VALUES ($1,$2,$3,$4,$5,$6,$7)",
                    )
                    .bind(&row.tenant)
                    .bind(&row.instance_id)
                    .bind(row.position)
                    .bind(&row.step)
                    .bind(&row.op_key)
                    .bind(&row.comp_key)
                    .bind(row.policy.as_str())
                    .execute(&mut *conn)
                    .await?;
                }
            }
            for e in &plan.events {
                append_instance_event(conn, e).await?;
            }
            Ok(Some(StartOutcome { decision: plan.decision, instance: plan.record }))
        }

        /// Writes `u` if the stored version is still `u.read_version` (with its events);
        /// false otherwise. Sets the retention window of an instance that became final.
        pub(crate) async fn update_instance_once(conn: &mut $Conn, u: &InstanceUpdate, retention: &idem_core::Retention) -> Result<bool, StoreError> {
            let mut r = u.record.clone();
            r.apply_retention(retention);
            let done = sqlx::query(
                "UPDATE workflow_instances SET state = $1, stopped_step = $2, error_class = $3, error_message = $4, \
                 next_run_at = $5, updated_at = $6, completed_at = $7, expires_at = $8, version = $9 \
                 WHERE tenant = $10 AND instance_id = $11 AND version = $12 AND created_at = $13",
            )
            .bind(r.state.as_str())
            .bind(&r.stopped_step)
            .bind(&r.error_class)
            .bind(&r.error_message)
            .bind(r.next_run_at)
            .bind(r.updated_at)
            .bind(r.completed_at)
            .bind(r.expires_at)
            .bind(r.version)
            .bind(&r.tenant)
            .bind(&r.instance_id)
            .bind(u.read_version)
            .bind(r.created_at)
            .execute(&mut *conn)
            .await?;
            if done.rows_affected() != 1 {
                return Ok(false);
            }
            for e in &u.events {
                append_instance_event(conn, e).await?;
            }
            Ok(true)
        }

        /// An operator's re-run (`RerunWrite`: the instance, the operations it closes, the step
        /// and item rows it points at new keys), inside the caller's transaction; false if the
        /// instance or an operation it closes changed since it was read (the caller rolls
        /// back).
        pub(crate) async fn apply_rerun_once(
            conn: &mut $Conn,
            w: &$crate::flow::RerunWrite,
            retention: &idem_core::Retention,
        ) -> Result<bool, StoreError> {
            let (u, keys) = (&w.update, &w.keys);
            if !update_instance_once(conn, u, retention).await? {
                return Ok(false);
            }
            for (record, read_version, event) in &w.superseded {
                let mut closed = record.clone();
                retention.apply(&mut closed);
                if !super::ops::update_cas(conn, &closed, *read_version).await? {
                    return Ok(false);
                }
                super::ops::append_event(conn, event).await?;
            }
            for (position, op_key, comp_key) in keys {
                sqlx::query(
                    "UPDATE workflow_steps SET op_key = $1, comp_key = $2 \
                     WHERE tenant = $3 AND instance_id = $4 AND position = $5",
                )
                .bind(op_key)
                .bind(comp_key)
                .bind(&u.record.tenant)
                .bind(&u.record.instance_id)
                .bind(position)
                .execute(&mut *conn)
                .await?;
            }
            for (position, item, op_key, comp_key) in &w.item_keys {
                sqlx::query(
                    "UPDATE workflow_items SET op_key = $1, comp_key = $2 \
                     WHERE tenant = $3 AND instance_id = $4 AND position = $5 AND item = $6",
                )
                .bind(op_key)
                .bind(comp_key)
                .bind(&u.record.tenant)
                .bind(&u.record.instance_id)
                .bind(position)
                .bind(item)
                .execute(&mut *conn)
                .await?;
            }
            Ok(true)
        }

        /// Writes the items of a step for each item, each once (a second writer's identical
        /// rows change nothing).
        pub(crate) async fn add_items(conn: &mut $Conn, items: &[idem_core::flow::ItemRow]) -> Result<(), StoreError> {
            for i in items {
                sqlx::query(
                    "INSERT INTO workflow_items (tenant, instance_id, position, item, seq, step, op_key, comp_key, policy) \
                     VALUES ($1,$2,$3,$4,$5,$6,$7,$8,$9) ON CONFLICT (tenant, instance_id, position, item) DO NOTHING",
                )
                .bind(&i.tenant)
                .bind(&i.instance_id)
                .bind(i.position)
                .bind(&i.item)
                .bind(i.seq)
                .bind(&i.step)
                .bind(&i.op_key)
                .bind(&i.comp_key)
                .bind(i.policy.as_str())
                .execute(&mut *conn)
                .await?;
            }
            Ok(())
        }

        pub(crate) async fn checkpoints(conn: &mut $Conn, tenant: &str, id: &str) -> Result<Vec<Checkpoint>, StoreError> {
            let rows = sqlx::query($crate::flow_row::CHECKPOINTS_SQL.as_str())
                .bind(tenant)
                .bind(id)
                .fetch_all(&mut *conn)
                .await?;
            $crate::flow_row::checkpoints_of(&rows)
        }

        pub(crate) async fn definition(conn: &mut $Conn, tenant: &str, name: &str, version: &str) -> Result<Option<Definition>, StoreError> {
            let row: Option<(String,)> = sqlx::query_as(
                "SELECT definition FROM workflow_definitions WHERE tenant = $1 AND name = $2 AND version = $3",
            )
            .bind(tenant)
            .bind(name)
            .bind(version)
            .fetch_optional(&mut *conn)
            .await?;
            row.map(|(text,)| serde_json::from_str(&text).map_err(|e| StoreError::Corrupt(format!("stored definition: {e}"))))
                .transpose()
        }

        pub(crate) async fn instance_events(conn: &mut $Conn, tenant: &str, id: &str) -> Result<Vec<InstanceEvent>, StoreError> {
            let sql = concat!("SELECT ", instance_event_columns!(), " FROM workflow_events \
                 WHERE tenant = $1 AND instance_id = $2 ORDER BY seq");
            let rows: Vec<InstanceEventRow> = sqlx::query_as(sql).bind(tenant).bind(id).fetch_all(&mut *conn).await?;
            rows.into_iter().map(InstanceEventRow::into_event).collect()
        }

        pub(crate) async fn list_instances(conn: &mut $Conn, tenant: &str, f: &InstanceFilter) -> Result<InstancePage, StoreError> {
            let sql = concat!(
                "SELECT ", instance_columns!(), " FROM workflow_instances WHERE tenant = $1 \
                 AND (CAST($2 AS TEXT) IS NULL OR state = $2) \
                 AND (CAST($3 AS TEXT) IS NULL OR workflow = $3) \
                 AND (CAST($4 AS BIGINT) IS NULL OR created_at < $4 OR (created_at = $4 AND instance_id < $5)) \
                 AND (CAST($6 AS BIGINT) IS NULL OR created_at >= $6) \
                 AND (CAST($7 AS BIGINT) IS NULL OR created_at < $7) \
                 ORDER BY created_at DESC, instance_id DESC LIMIT $8"
            );
            let limit = f.limit.clamp(1, $crate::MAX_PAGE);
            let (after_at, after_id) = match &f.cursor {
                Some((at, id)) => (Some(*at), Some(id.as_str())),
                None => (None, None),
            };
            let rows: Vec<InstanceRow> = sqlx::query_as(sql)
                .bind(tenant)
                .bind(f.state.map(|s| s.as_str()))
                .bind(f.workflow.as_deref())
                .bind(after_at)
                .bind(after_id)
                .bind(f.created_from)
                .bind(f.created_before)
                .bind(limit + 1)
                .fetch_all(&mut *conn)
                .await?;
            let more = rows.len() as i64 > limit;
            let items = rows.into_iter().take(limit as usize).map(InstanceRow::into_record).collect::<Result<Vec<_>, _>>()?;
            let next_cursor = if more { items.last().map(|r| (r.created_at, r.instance_id.clone())) } else { None };
            Ok(InstancePage { items, next_cursor })
        }

        /// Claims due instances (see `WorkflowStore::claim_due_instances`).
        pub(crate) async fn claim_due(conn: &mut $Conn, now_ms: i64, hold_ms: i64, limit: i64) -> Result<Vec<InstanceRecord>, StoreError> {
            let sql = concat!(
                "UPDATE workflow_instances SET next_run_at = $1 + $2, version = version + 1 \
                 WHERE (tenant, instance_id) IN (SELECT tenant, instance_id FROM workflow_instances \
                 WHERE next_run_at <= $1 ORDER BY next_run_at LIMIT $3) AND next_run_at <= $1 \
                 RETURNING ", instance_columns!()
            );
            let rows: Vec<InstanceRow> =
                sqlx::query_as(sql).bind(now_ms).bind(hold_ms).bind(limit).fetch_all(&mut *conn).await?;
            rows.into_iter().map(InstanceRow::into_record).collect()
        }

        pub(crate) async fn step_of_operation(conn: &mut $Conn, tenant: &str, op_key: &str) -> Result<Option<StepRow>, StoreError> {
            let row: Option<StepRowRow> = sqlx::query_as(
                "SELECT tenant, instance_id, position, step, op_key, comp_key, policy FROM workflow_steps \
                 WHERE tenant = $1 AND op_key = $2 \
                 UNION ALL SELECT tenant, instance_id, position, step, op_key, comp_key, policy FROM workflow_items \
                 WHERE tenant = $1 AND op_key = $2",
            )
            .bind(tenant)
            .bind(op_key)
            .fetch_optional(&mut *conn)
            .await?;
            row.map(StepRowRow::into_row).transpose()
        }

        pub(crate) async fn count_instances(conn: &mut $Conn, tenant: Option<&str>) -> Result<Vec<(idem_core::flow::InstanceState, i64)>, StoreError> {
            let rows: Vec<(String, i64)> = sqlx::query_as(
                "SELECT state, COUNT(*) FROM workflow_instances WHERE (CAST($1 AS TEXT) IS NULL OR tenant = $1) \
                 GROUP BY state ORDER BY state",
            )
            .bind(tenant)
            .fetch_all(&mut *conn)
            .await?;
            rows.into_iter().map(|(s, n)| Ok(($crate::flow_row::parse_instance_state(&s)?, n))).collect()
        }

        /// Removes up to `limit` final instances past `expires_at` (step rows and events
        /// too), leaving a tombstone each, and up to `limit` expired tombstones.
        pub(crate) async fn sweep_instances(conn: &mut $Conn, retention: &idem_core::Retention, now_ms: i64, limit: i64) -> Result<u64, StoreError> {
            let sql = concat!("SELECT ", instance_columns!(), " FROM workflow_instances \
                 WHERE expires_at <= $1 ORDER BY expires_at LIMIT $2");
            let rows: Vec<InstanceRow> = sqlx::query_as(sql).bind(now_ms).bind(limit).fetch_all(&mut *conn).await?;
            let mut removed = 0;
            for row in rows {
                let rec = row.into_record()?;
                if !rec.state.is_final() || rec.expires_at.is_none_or(|t| t > now_ms) {
                    continue;
                }
                let t = InstanceTombstone::of(&rec, retention);
                sqlx::query(
                    "INSERT INTO workflow_tombstones (tenant, id_hash, input_fingerprint, final_state, completed_at, \
                     expires_at) VALUES ($1,$2,$3,$4,$5,$6) ON CONFLICT (tenant, id_hash) DO UPDATE SET \
                     input_fingerprint = $3, final_state = $4, completed_at = $5, expires_at = $6",
                )
                .bind(&t.tenant)
                .bind(&t.id_hash)
                .bind(&t.input_fingerprint)
                .bind(t.final_state.as_str())
                .bind(t.completed_at)
                .bind(t.expires_at)
                .execute(&mut *conn)
                .await?;
                let gone = sqlx::query("DELETE FROM workflow_instances WHERE tenant = $1 AND instance_id = $2 AND version = $3")
                    .bind(&rec.tenant)
                    .bind(&rec.instance_id)
                    .bind(rec.version)
                    .execute(&mut *conn)
                    .await?;
                if gone.rows_affected() == 1 {
                    for table in ["DELETE FROM workflow_steps WHERE tenant = $1 AND instance_id = $2",
                                  "DELETE FROM workflow_items WHERE tenant = $1 AND instance_id = $2",
                                  "DELETE FROM workflow_events WHERE tenant = $1 AND instance_id = $2"] {
                        sqlx::query(table).bind(&rec.tenant).bind(&rec.instance_id).execute(&mut *conn).await?;
                    }
                    removed += 1;
                }
            }
            sqlx::query(
                "DELETE FROM workflow_tombstones WHERE (tenant, id_hash) IN \
                 (SELECT tenant, id_hash FROM workflow_tombstones WHERE expires_at <= $1 ORDER BY expires_at LIMIT $2)",
            )
            .bind(now_ms)
            .bind(limit)
            .execute(&mut *conn)
            .await?;
            Ok(removed)
        }
    };
}

pub(crate) use flow_ops;
