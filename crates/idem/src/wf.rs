//! `idem wf …`: workflow instances on a running server, over HTTP.

use crate::cli::WfCommand;
use crate::client::{Api, check, print, read_json};
use crate::output;
use reqwest::Method;
use serde_json::{Value, json};
use std::process::ExitCode;

pub async fn run(cmd: WfCommand) -> anyhow::Result<ExitCode> {
    match cmd {
        WfCommand::Start {
            server,
            workflow,
            instance_id,
            input,
            input_file,
            source_event,
            trace_id,
            steps,
            groups,
        } => {
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
                body["steps"] = Value::Array(steps);
            }
            if !groups.is_empty() {
                body["groups"] = Value::Array(groups);
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

/// One step of `--steps`: `STEP`, or `GROUP:STEP` for a branch of parallel group GROUP, as
/// the start body's `{"name", "group"}`. The server checks the names.
pub(crate) fn step_decl(s: &str) -> Result<Value, String> {
    match s.split_once(':') {
        None if !s.is_empty() => Ok(json!({"name": s})),
        Some((group, name)) if !group.is_empty() && !name.is_empty() && !name.contains(':') => {
            Ok(json!({"name": name, "group": group}))
        }
        _ => Err(format!("{s:?}: a step is STEP, or GROUP:STEP for a branch of parallel group GROUP")),
    }
}

/// One `--group`: `GROUP` or `GROUP:SETTING=VALUE,...` (`on_failure=pause|compensate`,
/// `max_concurrency=N`), as the start body's `{"name", "on_failure", "max_concurrency"}`.
/// The server checks the name and the range of N (1-64).
pub(crate) fn group_decl(s: &str) -> Result<Value, String> {
    let (name, settings) = s.split_once(':').unwrap_or((s, ""));
    if name.is_empty() {
        return Err(format!("{s:?}: give the group's name first, GROUP:SETTING=VALUE,..."));
    }
    let mut group = json!({"name": name});
    for setting in settings.split(',').filter(|p| !p.is_empty()) {
        match setting.split_once('=') {
            Some(("on_failure", v @ ("pause" | "compensate"))) => group["on_failure"] = json!(v),
            Some(("on_failure", v)) => return Err(format!("on_failure={v}: it is pause or compensate")),
            Some(("max_concurrency", v)) => match v.parse::<u32>() {
                Ok(n) => group["max_concurrency"] = json!(n),
                Err(_) => return Err(format!("max_concurrency={v}: a number of branches (1-64)")),
            },
            _ => {
                return Err(format!(
                    "{setting:?}: a group's settings are on_failure=pause|compensate and max_concurrency=N"
                ));
            }
        }
    }
    Ok(group)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_and_groups_parse_into_the_start_body() {
        assert_eq!(step_decl("close"), Ok(json!({"name": "close"})));
        assert_eq!(step_decl("notify:email"), Ok(json!({"name": "email", "group": "notify"})));
        for bad in ["", ":email", "notify:", "a:b:c"] {
            assert!(step_decl(bad).is_err(), "{bad:?}");
        }
        assert_eq!(group_decl("notify"), Ok(json!({"name": "notify"})));
        assert_eq!(
            group_decl("notify:on_failure=compensate,max_concurrency=2"),
            Ok(json!({"name": "notify", "on_failure": "compensate", "max_concurrency": 2}))
        );
        for bad in [":max_concurrency=2", "n:on_failure=retry", "n:max_concurrency=-1", "n:max=2", "n:pause"] {
            assert!(group_decl(bad).is_err(), "{bad:?}");
        }
    }
}
