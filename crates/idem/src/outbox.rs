//! `idem schema install`, `idem relay` and `idem outbox …`: the outbox of an application's
//! own database (idem-outbox).

use crate::cli::{OperatorArgs, OutboxCommand, RelayArgs, SchemaCommand};
use crate::serve::redact;
use anyhow::Context;
use idem_core::outbox::{OperatorAction, OutboxState};
use idem_outbox::relay::Relay;
use idem_outbox::relay::config::RelayConfig;
use idem_outbox::store::{EventRow, OutboxStore};
use idem_server::dto::rfc3339;
use std::sync::Arc;

pub async fn schema(cmd: SchemaCommand) -> anyhow::Result<()> {
    match cmd {
        SchemaCommand::Install { db } => {
            let url = &db.database_url;
            let done = idem_outbox::schema::install(url)
                .await
                .with_context(|| format!("cannot install the idem schema in {}", redact(url)))?;
            if done.from == done.to {
                crate::out!("idem: the idem schema is already at version {}", done.to);
            } else {
                crate::out!("idem: installed the idem schema, version {} (was {})", done.to, done.from);
            }
            Ok(())
        }
    }
}

/// `[outbox]` of the config file at `path`.
///
/// # Errors
/// One line naming the field; "no [outbox] section" when it is missing.
pub fn relay_config(connect: &idem_connect::Config) -> anyhow::Result<Option<RelayConfig>> {
    Ok(connect.outbox.as_ref().map(RelayConfig::parse).transpose()?)
}

pub async fn relay(args: RelayArgs) -> anyhow::Result<()> {
    crate::serve::init_logging(args.log_format, None)?;
    let connect = idem_connect::Config::load(&args.config)?;
    let config = relay_config(&connect)?.ok_or_else(|| {
        anyhow::anyhow!(
            "{}: no [outbox] section: it names the application database and the sinks",
            args.config.display()
        )
    })?;
    let relay = Arc::new(Relay::from_config(&config).await?);
    idem_server::metrics::handle();
    if let Some(listen) = &args.listen {
        let listener =
            tokio::net::TcpListener::bind(listen).await.with_context(|| format!("cannot listen on {listen}"))?;
        crate::out!("idem: relay metrics on http://{}/metrics", listener.local_addr()?);
        let app = axum::Router::new()
            .route("/metrics", axum::routing::get(|| async { idem_server::metrics::handle().render() }));
        tokio::spawn(async move { axum::serve(listener, app).await });
    }
    crate::out!("idem: relay {} delivering from {}", relay.id(), redact(&config.database_url));
    let mut task = relay.clone().spawn(config.retention_ms);
    tokio::select! {
        r = &mut task => r.context("the relay stopped")?,
        () = idem_server::shutdown_signal() => {
            // SIGTERM or Ctrl-C: claim nothing more, finish and record the deliveries in
            // flight (bounded by the sinks' timeouts), then exit. A delivery cut off here
            // would be redelivered by another relay once its lease ran out.
            crate::out!(
                "idem: relay stopping: finishing the deliveries in flight (at most {} s)",
                idem_outbox::relay::DRAIN.as_secs()
            );
            relay.stop_and_drain(task).await;
        }
    }
    Ok(())
}

async fn open(url: &str) -> anyhow::Result<OutboxStore> {
    OutboxStore::connect(url, 2).await.with_context(|| format!("cannot open the outbox in {}", redact(url)))
}

fn row_json(r: &EventRow) -> serde_json::Value {
    serde_json::json!({
        "id": r.id, "seq": r.seq, "aggregate_type": r.aggregate_type, "aggregate_id": r.aggregate_id,
        "topic": r.topic, "state": r.state, "attempts": r.attempts, "created_at": rfc3339(r.created_at),
        "next_attempt_at": r.next_attempt_at.map(rfc3339), "sink": r.sink, "evidence": r.evidence,
        "error_class": r.error_class, "error_message": r.error_message,
        "delivered_at": r.delivered_at.map(rfc3339),
        "headers": serde_json::from_str::<serde_json::Value>(&r.headers).unwrap_or(serde_json::Value::Null),
        "payload": serde_json::from_str::<serde_json::Value>(&r.payload).unwrap_or(serde_json::Value::Null),
    })
}

pub async fn outbox(cmd: OutboxCommand) -> anyhow::Result<()> {
    match cmd {
        OutboxCommand::List { db, state, limit, json } => {
            let state = state
                .map(|s| {
                    OutboxState::parse(&s.to_ascii_uppercase())
                        .ok_or_else(|| anyhow::anyhow!("--state {s:?}: expected PENDING, DELIVERED, DEAD or SKIPPED"))
                })
                .transpose()?;
            let rows = open(&db.database_url).await?.list(state, limit, None).await?;
            if json {
                crate::out!("{}", serde_json::Value::Array(rows.iter().map(row_json).collect()));
            } else {
                for r in &rows {
                    crate::out!("{}", crate::output::outbox_line(&row_json(r)));
                }
            }
            Ok(())
        }
        OutboxCommand::Get { db, id, json } => {
            let (row, trail) = open(&db.database_url)
                .await?
                .get(&id)
                .await?
                .ok_or_else(|| anyhow::anyhow!("no outbox event has id {id:?}"))?;
            let mut v = row_json(&row);
            v["attempts_log"] = trail
                .iter()
                .map(|t| {
                    serde_json::json!({"at": rfc3339(t.at), "kind": t.kind, "trigger": t.trigger, "relay": t.relay,
                        "result": t.result, "sink": t.sink, "error_class": t.error_class, "message": t.message,
                        "evidence": t.evidence, "operator": t.operator, "reason": t.reason})
                })
                .collect();
            if json {
                crate::out!("{v}");
            } else {
                crate::out!("{}", crate::output::outbox_event(&v));
            }
            Ok(())
        }
        OutboxCommand::Redrive(a) => act(a, OperatorAction::Redrive).await,
        OutboxCommand::Skip(a) => act(a, OperatorAction::Skip).await,
    }
}

async fn act(a: OperatorArgs, action: OperatorAction) -> anyhow::Result<()> {
    let OperatorArgs { db, id, reason, operator } = a;
    match open(&db.database_url).await?.operator_action(&id, action, &reason, &operator).await? {
        Ok(to) => {
            use crate::output::printable_str as shown;
            crate::out!(
                "idem: {} is {} ({} by {}: {})",
                shown(&id),
                to.as_str(),
                action.as_str(),
                shown(&operator),
                shown(reason.trim())
            );
            Ok(())
        }
        Err(refusal) => {
            anyhow::bail!("{} of {} refused: {}", action.as_str(), crate::output::printable_str(&id), refusal)
        }
    }
}
