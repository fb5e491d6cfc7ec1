//! The admin page's workflow view: instances by state with their last good step and
//! current step (`/ui/workflows`), and one instance with its steps as a timeline, its
//! checkpoints and its events (`/ui/workflows/{instance}`). Read-only: a paused step is
//! resolved on its operation's page, which the step links to; its instance then resumes.

use super::pages::{Nav, enc, op_href};
use super::{UiUser, error_page, html};
use crate::AppState;
use crate::dto::rfc3339;
use crate::workflows::dto::{CheckpointView, InstanceEventView};
use askama::Template;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Response;
use idem_core::flow::{InstanceRecord, InstanceState, Progress};
use idem_store::flow::InstanceFilter;
use serde::Deserialize;

/// The admin page's link to one instance.
pub(super) fn instance_href(id: &str) -> String {
    format!("/ui/workflows/{}", enc(id))
}

/// One row of the instance list.
struct InstanceRow {
    id: String,
    href: String,
    workflow: String,
    state: String,
    last_good_step: String,
    current_step: String,
    why: String,
    created: String,
    updated: String,
}

/// `GET /ui/workflows` filters.
#[derive(Debug, Default, Deserialize)]
pub struct WorkflowParams {
    #[serde(default)]
    state: String,
    #[serde(default)]
    workflow: String,
}

#[derive(Template)]
#[template(path = "ui/workflows.html")]
struct WorkflowsPage {
    nav: Nav,
    p: WorkflowParams,
    state_names: Vec<&'static str>,
    waiting: Vec<InstanceRow>,
    rows: Vec<InstanceRow>,
    error: String,
}

/// Most instances the list shows (newest first); PAUSED and COMPENSATING ones are listed
/// first, up to the same number.
const LIST: i64 = 100;

/// The rows of the instances `filter` selects, each with its progress (one read of its
/// checkpoints per instance: a page, not the hot path).
async fn rows(
    state: &AppState,
    tenant: &str,
    filter: &InstanceFilter,
) -> Result<Vec<InstanceRow>, idem_store::StoreError> {
    let flows = state.store.flows();
    let page = flows.list_instances(tenant, filter).await?;
    let mut rows = Vec::with_capacity(page.items.len());
    for inst in page.items {
        let progress = Progress::of(&flows.checkpoints(tenant, &inst.instance_id).await?);
        rows.push(row(inst, progress));
    }
    Ok(rows)
}

fn row(inst: InstanceRecord, progress: Progress) -> InstanceRow {
    InstanceRow {
        href: instance_href(&inst.instance_id),
        id: inst.instance_id,
        workflow: inst.workflow,
        state: inst.state.as_str().into(),
        last_good_step: progress.last_good_step.unwrap_or_default(),
        current_step: progress.current_step.unwrap_or_default(),
        why: inst.error_message.unwrap_or_default(),
        created: rfc3339(inst.created_at),
        updated: rfc3339(inst.updated_at),
    }
}

/// `GET /ui/workflows`: the instances waiting for a person first, then the list.
pub async fn list(
    State(state): State<AppState>,
    user: UiUser,
    super::UiQuery(p): super::UiQuery<WorkflowParams>,
) -> Response {
    let state_names = InstanceState::ALL.iter().map(|s| s.as_str()).collect();
    let mut page = WorkflowsPage {
        nav: Nav::of(Some(&user)),
        p,
        state_names,
        waiting: vec![],
        rows: vec![],
        error: String::new(),
    };
    let wanted = match page.p.state.as_str() {
        "" => None,
        s => match s.parse::<InstanceState>() {
            Ok(s) => Some(s),
            Err(e) => {
                page.error = e.to_string();
                return html(StatusCode::BAD_REQUEST, &page);
            }
        },
    };
    if page.p.workflow.contains('\0') {
        page.error = "The workflow filter cannot contain U+0000.".into();
        return html(StatusCode::BAD_REQUEST, &page);
    }
    let workflow = Some(page.p.workflow.clone()).filter(|w| !w.is_empty());
    let tenant = &user.caller.tenant;
    if wanted.is_none() {
        for s in [InstanceState::Paused, InstanceState::Compensating] {
            let f = InstanceFilter { state: Some(s), workflow: workflow.clone(), limit: LIST, ..Default::default() };
            match rows(&state, tenant, &f).await {
                Ok(rows) => page.waiting.extend(rows),
                Err(e) => return super::pages::fail(&user, e),
            }
        }
    }
    let f = InstanceFilter { state: wanted, workflow, limit: LIST, ..Default::default() };
    match rows(&state, tenant, &f).await {
        Ok(rows) => page.rows = rows,
        Err(e) => return super::pages::fail(&user, e),
    }
    html(StatusCode::OK, &page)
}

/// One step on the instance page.
struct StepLine {
    c: CheckpointView,
    href: String,
}

#[derive(Template)]
#[template(path = "ui/workflow.html")]
struct InstancePage {
    nav: Nav,
    i: crate::workflows::dto::InstanceView,
    steps: Vec<StepLine>,
    events: Vec<InstanceEventView>,
}

/// `GET /ui/workflows/{instance}`.
pub async fn one(
    State(state): State<AppState>,
    user: UiUser,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Response {
    match state.flows.view(&user.caller.tenant, &id).await {
        Ok(Some(v)) => {
            let mut i = crate::workflows::dto::InstanceView::full(v);
            let steps = i
                .steps
                .take()
                .unwrap_or_default()
                .into_iter()
                .map(|c| StepLine { href: op_href(&c.operation_key), c })
                .collect();
            let events = i.events.take().unwrap_or_default();
            html(StatusCode::OK, &InstancePage { nav: Nav::of(Some(&user)), i, steps, events })
        }
        Ok(None) => error_page(Some(&user), StatusCode::NOT_FOUND, "No workflow instance with this id."),
        Err(e) => {
            let p = crate::workflows::flow_problem(e);
            error_page(Some(&user), p.status_code(), &p.detail)
        }
    }
}
