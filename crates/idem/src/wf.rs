//! `idem wf …`: workflow instances on a running server, over HTTP.

use crate::cli::WfCommand;
use crate::client::{Api, check, print, read_json};
use crate::output;
use reqwest::Method;
use serde_json::json;
use std::process::ExitCode;

pub async fn run(cmd: WfCommand) -> anyhow::Result<ExitCode> {
    match cmd {
        WfCommand::Start { server, workflow, instance_id, input, input_file, source_event, trace_id, steps } => {
            let api = Api::new(&server)?;
            let mut body = json!({"workflow": workflow, "instance_id": instance_id});
            if let Some(v) = read_json(input.as_deref(), input_file.as_deref(), "input")? {
                body["input"] = v;
            }
            if let Some(e) = source_event {
                body["source_event"] = json!(e);
            }
            if let Some(t) = trace_id {
                body["trace_id"] = json!(t);
            }
            if !steps.is_empty() {
                body["steps"] = steps.iter().map(|s| json!({"name": s})).collect();
            }
            let a = api.call(Method::POST, api.url(&["v1", "workflows"])?, Some(body)).await?;
            check(&a)?;
            print(server.json, &a, |v| output::instance_summary(a.status.as_u16(), v));
        }
        WfCommand::Rerun { server, instance_id, reason, steps, dry_run, plan_hash } => {
            let api = Api::new(&server)?;
            let body = json!({"reason": reason, "steps": steps, "dry_run": dry_run, "plan_hash": plan_hash});
            let a = api.call(Method::POST, api.url(&["v1", "workflows", &instance_id, "rerun"])?, Some(body)).await?;
            check(&a)?;
            print(server.json, &a, output::rerun_plan);
        }
        WfCommand::Compensate { server, instance_id, reason } => {
            let api = Api::new(&server)?;
            let body = json!({"reason": reason});
            let a =
                api.call(Method::POST, api.url(&["v1", "workflows", &instance_id, "compensate"])?, Some(body)).await?;
            check(&a)?;
            print(server.json, &a, |v| output::instance_summary(a.status.as_u16(), v));
        }
        WfCommand::Get { server, instance_id } => {
            let api = Api::new(&server)?;
            let a = api.call(Method::GET, api.url(&["v1", "workflows", &instance_id])?, None).await?;
            check(&a)?;
            print(server.json, &a, output::instance_with_steps);
        }
        WfCommand::List { server, state, workflow, created_after, created_before, limit, cursor } => {
            let api = Api::new(&server)?;
            let mut url = api.url(&["v1", "workflows"])?;
            {
                let mut q = url.query_pairs_mut();
                q.append_pair("limit", &limit.to_string());
                for (name, v) in [
                    ("state", &state),
                    ("workflow", &workflow),
                    ("created_after", &created_after),
                    ("created_before", &created_before),
                    ("cursor", &cursor),
                ] {
                    if let Some(v) = v {
                        q.append_pair(name, v);
                    }
                }
            }
            let a = api.call(Method::GET, url, None).await?;
            check(&a)?;
            print(server.json, &a, output::instance_table);
        }
    }
    Ok(ExitCode::SUCCESS)
}
