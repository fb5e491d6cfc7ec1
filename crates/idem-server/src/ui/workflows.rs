//! The admin page's workflow view: instances by state with their last good step and
//! current step (`/ui/workflows`), and one instance with its steps as a timeline, its
//! checkpoints, compensations and events (`/ui/workflows/{instance}`), with the operator's
//! guarded re-run (preview the plan, give a reason, confirm: the server checks the role,
//! the CSRF token and the plan's hash again) and compensation forms. A paused step is
//! resolved on its operation's page, which the step links to; its instance then resumes.

use super::pages::{Nav, enc, op_href};
use super::{UiUser, error_page, html};
use crate::AppState;
use crate::dto::rfc3339;
use crate::workflows::dto::{CheckpointView, InstanceEventView};
use askama::Template;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use idem_core::flow::{InstanceRecord, InstanceState, Progress};
use idem_store::flow::InstanceFilter;
use idem_store::keys::Role;
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
    /// RFC 3339, or `YYYY-MM-DDTHH:MM` (a datetime-local field) taken as UTC.
    #[serde(default)]
    from: String,
    #[serde(default)]
    to: String,
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
        let progress = Progress::of(inst.state, &flows.checkpoints(tenant, &inst.instance_id).await?);
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
    let times = super::pages::parse_time("from", &page.p.from)
        .and_then(|from| Ok((from, super::pages::parse_time("to", &page.p.to)?)));
    let (created_from, created_before) = match times {
        Ok(t) => t,
        Err(e) => {
            page.error = e;
            return html(StatusCode::BAD_REQUEST, &page);
        }
    };
    let tenant = &user.caller.tenant;
    if wanted.is_none() {
        for s in [InstanceState::Paused, InstanceState::Compensating] {
            let f = InstanceFilter {
                state: Some(s),
                workflow: workflow.clone(),
                created_from,
                created_before,
                limit: LIST,
                ..Default::default()
            };
            match rows(&state, tenant, &f).await {
                Ok(rows) => page.waiting.extend(rows),
                Err(e) => return super::pages::fail(&user, e),
            }
        }
    }
    let f = InstanceFilter { state: wanted, workflow, created_from, created_before, limit: LIST, ..Default::default() };
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
    comp_href: String,
}

#[derive(Template)]
#[template(path = "ui/workflow.html")]
struct InstancePage {
    nav: Nav,
    i: crate::workflows::dto::InstanceView,
    href: String,
    steps: Vec<StepLine>,
    events: Vec<InstanceEventView>,
    can_act: bool,
    can_rerun: bool,
    can_compensate: bool,
    /// A re-run's dry run, to confirm.
    plan: Option<crate::workflows::dto::RerunView>,
    /// What the operator typed (kept after a preview or an error).
    reason: String,
    steps_named: String,
    message: String,
    error: String,
}

/// What the instance page shows besides the instance.
#[derive(Default)]
struct Extra {
    plan: Option<crate::workflows::dto::RerunView>,
    reason: String,
    steps_named: String,
    message: String,
    error: String,
}

/// The instance page, with `extra`.
async fn show(state: &AppState, user: &UiUser, id: &str, status: StatusCode, extra: Extra) -> Response {
    match state.flows.view(&user.caller.tenant, id).await {
        Ok(Some(v)) => {
            let mut i = crate::workflows::dto::InstanceView::full(v);
            let steps = i
                .steps
                .take()
                .unwrap_or_default()
                .into_iter()
                .map(|c| StepLine { href: op_href(&c.operation_key), comp_href: op_href(&c.compensation_key), c })
                .collect();
            let events = i.events.take().unwrap_or_default();
            let can_act = user.caller.role >= Role::Operator;
            let st = i.state.as_str();
            let page = InstancePage {
                nav: Nav::of(Some(user)),
                href: instance_href(&i.instance_id),
                can_rerun: matches!(st, "FAILED" | "PAUSED" | "SUCCEEDED"),
                can_compensate: matches!(st, "FAILED" | "PAUSED"),
                i,
                steps,
                events,
                can_act,
                plan: extra.plan,
                reason: extra.reason,
                steps_named: extra.steps_named,
                message: extra.message,
                error: extra.error,
            };
            html(status, &page)
        }
        Ok(None) => error_page(Some(user), StatusCode::NOT_FOUND, "No workflow instance with this id."),
        Err(e) => {
            let p = crate::workflows::flow_problem(e);
            error_page(Some(user), p.status_code(), &p.detail)
        }
    }
}

/// `?done=…` after a form post.
#[derive(Debug, Default, Deserialize)]
pub struct DoneParams {
    #[serde(default)]
    done: String,
}

/// `GET /ui/workflows/{instance}`.
pub async fn one(
    State(state): State<AppState>,
    user: UiUser,
    super::UiInstance(id): super::UiInstance,
    super::UiQuery(q): super::UiQuery<DoneParams>,
) -> Response {
    let message = match q.done.as_str() {
        "rerun" => "Re-run started: the plan you approved runs now.".into(),
        "compensate" => "Compensation started: the steps' compensations run now, last step first.".into(),
        _ => String::new(),
    };
    show(&state, &user, &id, StatusCode::OK, Extra { message, ..Default::default() }).await
}

/// The re-run form: preview (a dry run) or run (with the previewed plan's hash).
#[derive(Debug, Default, Deserialize)]
pub struct RerunForm {
    #[serde(default)]
    csrf: String,
    #[serde(default)]
    reason: String,
    /// Steps to redo although they SUCCEEDED, comma-separated.
    #[serde(default)]
    steps: String,
    /// The hash of the plan previewed (set by the confirm form).
    #[serde(default)]
    plan_hash: String,
    /// `preview` or `run`.
    #[serde(default)]
    action: String,
}

/// The operator checks of a form post: CSRF token, then the operator role.
fn operator_form(user: &UiUser, csrf: &str) -> Result<(), Response> {
    user.check_csrf(csrf)?;
    user.caller.require(Role::Operator).map_err(|p| error_page(Some(user), StatusCode::FORBIDDEN, &p.detail))
}

/// `POST /ui/workflows/{instance}/rerun`: preview a re-run, or run the previewed plan (the
/// server checks the role, the CSRF token and the plan's hash again).
pub async fn rerun(
    State(state): State<AppState>,
    user: UiUser,
    super::UiInstance(id): super::UiInstance,
    super::UiForm(f): super::UiForm<RerunForm>,
) -> Response {
    if let Err(r) = operator_form(&user, &f.csrf) {
        return r;
    }
    let named: Vec<String> = f.steps.split(',').map(str::trim).filter(|s| !s.is_empty()).map(str::to_owned).collect();
    let keep = |error: String, plan| Extra {
        plan,
        reason: f.reason.clone(),
        steps_named: f.steps.clone(),
        error,
        ..Default::default()
    };
    let tenant = &user.caller.tenant;
    if f.action != "run" {
        return match state.flows.preview_rerun(tenant, &id, &named).await {
            Ok(plan) => {
                let view = crate::workflows::dto::RerunView::of(plan, None);
                show(&state, &user, &id, StatusCode::OK, keep(String::new(), Some(view))).await
            }
            Err(e) => {
                let p = crate::workflows::flow_problem(e);
                show(&state, &user, &id, p.status_code(), keep(p.detail, None)).await
            }
        };
    }
    let approved = Some(f.plan_hash.as_str()).filter(|h| !h.is_empty());
    if approved.is_none() {
        let why = "Preview the re-run first: only a plan you saw runs.".to_owned();
        return show(&state, &user, &id, StatusCode::BAD_REQUEST, keep(why, None)).await;
    }
    match state.flows.rerun(tenant, &id, &named, approved, &f.reason, &user.caller.actor()).await {
        Ok(_) => axum::response::Redirect::to(&format!("{}?done=rerun", instance_href(&id))).into_response(),
        Err(e) => {
            let p = crate::workflows::flow_problem(e);
            show(&state, &user, &id, p.status_code(), keep(p.detail, None)).await
        }
    }
}

/// The compensate form.
#[derive(Debug, Default, Deserialize)]
pub struct CompensateForm {
    #[serde(default)]
    csrf: String,
    #[serde(default)]
    reason: String,
}

/// `POST /ui/workflows/{instance}/compensate`: an operator asks for compensation.
pub async fn compensate(
    State(state): State<AppState>,
    user: UiUser,
    super::UiInstance(id): super::UiInstance,
    super::UiForm(f): super::UiForm<CompensateForm>,
) -> Response {
    if let Err(r) = operator_form(&user, &f.csrf) {
        return r;
    }
    match state.flows.compensate(&user.caller.tenant, &id, &f.reason, &user.caller.actor()).await {
        Ok(_) => axum::response::Redirect::to(&format!("{}?done=compensate", instance_href(&id))).into_response(),
        Err(e) => {
            let p = crate::workflows::flow_problem(e);
            let status = p.status_code();
            let extra = Extra { reason: f.reason, error: p.detail, ..Default::default() };
            show(&state, &user, &id, status, extra).await
        }
    }
}
