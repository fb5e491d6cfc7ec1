//! `/v1/workflows`: start, get, list, and the steps your code performs (DESIGN.md §8).
//!
//! Handlers validate, call idem-flow, and translate its answers into status codes; they
//! decide nothing. A step's acquire and completion are an operation's (`{instance}:{step}`)
//! and answer with the same statuses as `/v1/operations` (DESIGN.md §3).

pub mod dto;

use crate::AppState;
use crate::auth::Caller;
use crate::dto::{CompleteBody, OperationView};
use crate::json::{ApiJson, ApiQuery};
use crate::operations::{
    decode_cursor, encode_cursor, holder_of, in_range, late_arrival, outcome_of, parse_instant, store_problem,
    trigger_answer, with_rid,
};
use crate::problem::Problem;
use axum::extract::State;
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use dto::{
    CompensateBody, InstancePage, InstanceQuery, InstanceView, RerunBody, RerunView, StartBody, StepAcquireBody,
};
use idem_core::decision::{DEFAULT_LEASE_MS, MAX_LEASE_MS, MIN_LEASE_MS};
use idem_core::flow::{GroupDef, InstanceState, StartDecision};
use idem_flow::FlowError;
use idem_flow::driven::{StepAcquire, StepComplete};
use idem_flow::start::{StartCall, StepDecl};
use idem_store::flow::InstanceFilter;

/// The problem for a refused or failed workflow call.
pub fn flow_problem(e: FlowError) -> Problem {
    let detail = e.to_string();
    match e {
        FlowError::Store(e) => store_problem(e),
        FlowError::Invalid(_) | FlowError::DeclaredWorkflow(_) => Problem::invalid(detail),
        FlowError::Definition(_) => Problem::new(StatusCode::BAD_REQUEST, "invalid-definition", detail),
        FlowError::UnknownWorkflow(_) => Problem::new(StatusCode::BAD_REQUEST, "unknown-workflow", detail),
        FlowError::WorkflowNotAllowed { .. } => Problem::new(StatusCode::FORBIDDEN, "workflow-not-allowed", detail),
        FlowError::InstanceNotFound(_) => Problem::new(StatusCode::NOT_FOUND, "not-found", detail),
        FlowError::Late { state, .. } => {
            let mut p = Problem::new(StatusCode::GONE, "late-arrival", detail);
            p.state = Some(state.as_str().into());
            p
        }
        FlowError::UnknownStep { .. } => Problem::new(StatusCode::NOT_FOUND, "unknown-step", detail),
        FlowError::IdemPerforms { .. } => Problem::new(StatusCode::CONFLICT, "step-performed-by-idem", detail),
        FlowError::PreviousStepUnfinished { state, .. } => {
            let mut p = Problem::new(StatusCode::CONFLICT, "previous-step-unfinished", detail);
            p.state = Some(state.as_str().into());
            p
        }
        // The same answer as an unfinished earlier step: this step cannot start yet, retry
        // later. `state` is that of the branches in flight.
        FlowError::GroupFull { retry_after_ms, .. } => {
            let mut p = Problem::new(StatusCode::CONFLICT, "previous-step-unfinished", detail);
            p.state = Some(idem_core::flow::StepState::Executing.as_str().into());
            p.retry_after_ms = Some(retry_after_ms);
            p
        }
        FlowError::NotRunning { state, .. } => {
            let mut p = Problem::new(StatusCode::CONFLICT, "instance-not-running", detail);
            p.state = Some(state.as_str().into());
            p
        }
        FlowError::MissingReason => Problem::new(StatusCode::BAD_REQUEST, "missing-reason", detail),
        FlowError::StepKeyConflict { .. } => Problem::new(StatusCode::CONFLICT, "step-key-conflict", detail),
        FlowError::Busy(_) => Problem::new(StatusCode::CONFLICT, "instance-busy", detail),
        FlowError::Rerun(r) => rerun_problem(r, detail),
        FlowError::Compensation(c) => {
            use idem_core::flow::CompensationRefusal as C;
            let (slug, state) = match c {
                C::NotStopped { state } => ("instance-not-stopped", Some(state)),
                C::AlreadyCompensating => ("compensation-in-progress", None),
                C::NothingToCompensate => ("nothing-to-compensate", None),
            };
            let mut p = Problem::new(StatusCode::CONFLICT, slug, detail);
            p.state = state.map(|s| s.as_str().into());
            p
        }
        FlowError::DefinitionMissing { .. } | FlowError::DefinitionMismatch(_) => {
            tracing::error!(error = %detail, "workflow storage is inconsistent");
            Problem::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", "internal error")
        }
    }
}

/// The problem of a refused re-run.
fn rerun_problem(r: idem_core::flow::RerunRefusal, detail: String) -> Problem {
    use idem_core::flow::RerunRefusal as R;
    let (status, slug) = match &r {
        R::StillRunning { .. } => (StatusCode::CONFLICT, "instance-running"),
        R::Compensated => (StatusCode::CONFLICT, "instance-compensated"),
        R::UnknownStep(_) => (StatusCode::BAD_REQUEST, "unknown-step"),
        R::StepBusy { .. } => (StatusCode::CONFLICT, "step-busy"),
        R::Compensating(_) => (StatusCode::CONFLICT, "compensation-in-progress"),
        R::NothingToRedo => (StatusCode::CONFLICT, "nothing-to-rerun"),
        R::NeedsResolution(_) => (StatusCode::CONFLICT, "step-needs-resolution"),
        R::TooManyReruns(_) => (StatusCode::CONFLICT, "too-many-reruns"),
        R::PlanChanged { .. } => (StatusCode::CONFLICT, "plan-changed"),
        // RFC 6585 §3: the server requires the request to be conditional (on a plan hash).
        R::PlanHashRequired { .. } => (StatusCode::PRECONDITION_REQUIRED, "plan-hash-required"),
    };
    let mut p = Problem::new(status, slug, detail);
    if let R::StillRunning { state } = r {
        p.state = Some(state.as_str().into());
    }
    p
}

/// A path segment (instance id or step name), percent-decoded by the extractor.
fn segment<'a>(name: &str, raw: &'a str) -> Result<&'a str, Problem> {
    // The one identifier rule (idem_core::ident), before anything reaches a query: a NUL
    // reached PostgreSQL and came back as a 503 that told the client to retry (issue 28 §7).
    idem_core::ident::check_identifier(name, raw, 255).map_err(|e| Problem::invalid(e.to_string()))?;
    Ok(raw)
}

/// Start (or find) a workflow instance.
#[utoipa::path(
    post, path = "/v1/workflows", tag = "workflows",
    request_body = StartBody,
    responses(
        (status = 201, description = "A new instance; a declared workflow's steps start at once", body = InstanceView),
        (status = 200, description = "The instance exists with the same workflow and input: the same instance, as it stands now; header `Idempotent-Replayed: true`", body = InstanceView),
        (status = 400, description = "Malformed request, unknown workflow, or steps or groups that cannot run (`invalid-definition`, naming the field: `steps[2].group`, `groups[0].max_concurrency`); nothing was written", body = Problem, content_type = "application/problem+json"),
        (status = 403, description = "The declared workflow does not serve the caller's tenant (`workflow-not-allowed`); nothing was written", body = Problem, content_type = "application/problem+json"),
        (status = 401, description = "Missing or invalid API key", body = Problem, content_type = "application/problem+json"),
        (status = 410, description = "The instance finished and was removed after its retention window; nothing runs again", body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "The instance id was used with another workflow, input, steps or groups; nothing changed", body = Problem, content_type = "application/problem+json"),
    ),
    security(("bearer" = []))
)]
pub async fn start(
    State(state): State<AppState>,
    caller: Caller,
    ApiJson(body): ApiJson<StartBody>,
) -> Result<Response, Problem> {
    // A refused id (an e-mail address, say) stays out of the logs, as a refused key does.
    if idem_core::flow::validate_instance_id(&body.instance_id).is_ok() {
        crate::logging::record_key(&body.instance_id);
    }
    let call = StartCall {
        tenant: caller.tenant.clone(),
        instance_id: body.instance_id,
        workflow: body.workflow,
        input: body.input.map_or(serde_json::Value::Null, |p| p.0),
        source_event: body.source_event,
        trace_id: body.trace_id,
        steps: body.steps.map(|steps| {
            steps
                .into_iter()
                .map(|s| StepDecl { name: s.name, action: s.action, policy: s.policy, group: s.group })
                .collect()
        }),
        groups: body.groups.map(|groups| {
            groups
                .into_iter()
                .map(|g| GroupDef {
                    name: g.name,
                    on_failure: g.on_failure.unwrap_or_default(),
                    max_concurrency: g.max_concurrency,
                })
                .collect()
        }),
        actor: caller.actor(),
    };
    let out = state.flows.start(call).await.map_err(|e| with_rid(flow_problem(e), &caller))?;
    // A new declared workflow's steps start now, not at the runner's next look.
    if out.decision == StartDecision::Created && state.flows.performs_steps(&out.instance.workflow) {
        state.flows.advance_started_in_background(out.clone());
    }
    let view = || axum::Json(InstanceView::of(out.instance.clone()));
    Ok(match out.decision {
        StartDecision::Created => (StatusCode::CREATED, view()).into_response(),
        StartDecision::Existing => {
            let mut r = (StatusCode::OK, view()).into_response();
            r.headers_mut().insert("idempotent-replayed", HeaderValue::from_static("true"));
            r
        }
        StartDecision::Mismatch => with_rid(
            Problem::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "instance-mismatch",
                "this instance id was first used with another workflow, input, steps or groups; a new intent needs a new instance id",
            ),
            &caller,
        )
        .into_response(),
        StartDecision::Late => {
            let state = match out.instance.state {
                InstanceState::Failed => idem_core::State::Failed,
                _ => idem_core::State::Succeeded,
            };
            let mut p = late_arrival(state, out.instance.completed_at, "nothing runs again");
            p.state = Some(out.instance.state.as_str().into());
            with_rid(p, &caller).into_response()
        }
    })
}

/// One instance with its checkpoints and events.
#[utoipa::path(
    get, path = "/v1/workflows/{instance}", tag = "workflows",
    params(("instance" = String, Path, description = "Instance id (percent-encoded)")),
    responses(
        (status = 200, description = "The instance with `steps` (checkpoints), `last_good_step`, `current_step` and `events`", body = InstanceView),
        (status = 404, description = "No such instance in the caller's tenant", body = Problem, content_type = "application/problem+json"),
        (status = 401, description = "Missing or invalid API key", body = Problem, content_type = "application/problem+json"),
    ),
    security(("bearer" = []))
)]
pub async fn get_one(
    State(state): State<AppState>,
    caller: Caller,
    crate::json::ApiPath(raw): crate::json::ApiPath,
) -> Result<Response, Problem> {
    let id = segment("the instance id", &raw).map_err(|p| with_rid(p, &caller))?;
    let view = state.flows.view(&caller.tenant, id).await.map_err(|e| with_rid(flow_problem(e), &caller))?;
    match view {
        Some(v) => Ok(axum::Json(InstanceView::full(v)).into_response()),
        None => Err(with_rid(flow_problem(FlowError::InstanceNotFound(id.to_owned())), &caller)),
    }
}

/// Instances of the caller's tenant, newest first.
#[utoipa::path(
    get, path = "/v1/workflows", tag = "workflows",
    params(InstanceQuery),
    responses(
        (status = 200, description = "One page", body = InstancePage),
        (status = 400, description = "Invalid filter", body = Problem, content_type = "application/problem+json"),
        (status = 401, description = "Missing or invalid API key", body = Problem, content_type = "application/problem+json"),
    ),
    security(("bearer" = []))
)]
pub async fn list(
    State(state): State<AppState>,
    caller: Caller,
    ApiQuery(q): ApiQuery<InstanceQuery>,
) -> Result<Response, Problem> {
    let filter = instance_filter(q).map_err(|p| with_rid(p, &caller))?;
    let page = state
        .store
        .flows()
        .list_instances(&caller.tenant, &filter)
        .await
        .map_err(|e| with_rid(store_problem(e), &caller))?;
    Ok(axum::Json(InstancePage {
        items: page.items.into_iter().map(InstanceView::of).collect(),
        next_cursor: page.next_cursor.map(|(at, id)| encode_cursor(at, &id)),
    })
    .into_response())
}

fn instance_filter(q: InstanceQuery) -> Result<InstanceFilter, Problem> {
    let state =
        q.state.as_deref().map(str::parse::<InstanceState>).transpose().map_err(|e| Problem::invalid(e.to_string()))?;
    if q.workflow.as_deref().is_some_and(|w| w.contains('\0')) {
        return Err(Problem::invalid("filters must not contain U+0000 (NUL)"));
    }
    let cursor = q.cursor.as_deref().map(decode_cursor).transpose()?;
    if cursor.as_ref().is_some_and(|(_, id)| id.contains('\0')) {
        return Err(Problem::invalid("cursor is not one this server issued"));
    }
    Ok(InstanceFilter {
        state,
        workflow: q.workflow,
        created_from: q.created_after.as_deref().map(|t| parse_instant("created_after", t)).transpose()?,
        created_before: q.created_before.as_deref().map(|t| parse_instant("created_before", t)).transpose()?,
        limit: in_range("limit", q.limit, 1, idem_store::MAX_PAGE, 50)?,
        cursor,
    })
}

/// Acquire a step your code performs: the answers of `POST /v1/operations` for the step's
/// operation `{instance}:{step}`.
#[utoipa::path(
    post, path = "/v1/workflows/{instance}/steps/{step}", tag = "workflows",
    params(
        ("instance" = String, Path, description = "Instance id (percent-encoded)"),
        ("step" = String, Path, description = "Step name"),
    ),
    request_body = StepAcquireBody,
    responses(
        (status = 201, description = "Lease granted: perform the step, then complete it with the fencing token", body = OperationView),
        (status = 200, description = "The step finished before: its recorded result; header `Idempotent-Replayed: true`", body = OperationView),
        (status = 202, description = "The step's outcome is UNKNOWN: do not redo it", body = OperationView),
        (status = 400, description = "Malformed request", body = Problem, content_type = "application/problem+json"),
        (status = 401, description = "Missing or invalid API key", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "No such instance, or no such step in its definition", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "In progress / retry not due (`Retry-After`), an earlier step has not succeeded or the branch's group already has `max_concurrency` branches in flight (`previous-step-unfinished`; `Retry-After` for the latter) or its key holds an operation not made for it (`step-key-conflict`), the instance is not RUNNING, or idem performs this step", body = Problem, content_type = "application/problem+json"),
        (status = 410, description = "The instance (or step) finished and was removed after retention", body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "The step was acquired before with another payload", body = Problem, content_type = "application/problem+json"),
    ),
    security(("bearer" = []))
)]
pub async fn acquire_step(
    State(state): State<AppState>,
    caller: Caller,
    axum::extract::Path((instance, step)): axum::extract::Path<(String, String)>,
    ApiJson(body): ApiJson<StepAcquireBody>,
) -> Result<Response, Problem> {
    let rid = |p| with_rid(p, &caller);
    let payload = body.payload.map_or(serde_json::Value::Null, |p| p.0);
    let fingerprint = idem_core::fingerprint(&payload, body.fingerprint_fields.as_deref())
        .map_err(|e| rid(Problem::invalid(e.to_string())))?
        .0;
    let instance_id = segment("the instance id", &instance).map_err(rid)?.to_owned();
    let step = segment("the step name", &step).map_err(rid)?.to_owned();
    let op_key = idem_core::flow::step_key(&instance_id, &step);
    let holder = holder_of(&caller, body.holder.as_deref(), &op_key, state.clock.now_ms()).map_err(rid)?;
    let call = StepAcquire {
        tenant: caller.tenant.clone(),
        instance_id,
        step,
        payload,
        fingerprint,
        lease_ms: in_range("lease_ms", body.lease_ms, MIN_LEASE_MS, MAX_LEASE_MS, DEFAULT_LEASE_MS).map_err(rid)?,
        holder,
        actor: caller.actor(),
    };
    if idem_core::flow::validate_instance_id(&call.instance_id).is_ok() {
        crate::logging::record_key(&idem_core::flow::step_key(&call.instance_id, &call.step));
    }
    let out = state.flows.acquire_step(call).await.map_err(|e| rid(flow_problem(e)))?;
    // The key the step's operation has: `{instance}:{group}:{step}` for a branch.
    crate::logging::record_key(&out.record.key);
    state.answered_trigger(&out.decision, &caller.tenant, &out.record.key, caller.request_id.as_deref());
    Ok(trigger_answer(out, &caller))
}

/// Report the outcome of a step your code performed; the instance advances (SUCCEEDED after
/// the last step, FAILED on a final failure, PAUSED on UNKNOWN).
#[utoipa::path(
    post, path = "/v1/workflows/{instance}/steps/{step}/complete", tag = "workflows",
    params(
        ("instance" = String, Path, description = "Instance id (percent-encoded)"),
        ("step" = String, Path, description = "Step name"),
    ),
    request_body = CompleteBody,
    responses(
        (status = 200, description = "The step's operation, updated", body = OperationView),
        (status = 400, description = "Malformed request or outcome", body = Problem, content_type = "application/problem+json"),
        (status = 401, description = "Missing or invalid API key", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "No such instance or step (or the step was never acquired)", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "Stale fencing token, already final, or not executing; nothing changed", body = Problem, content_type = "application/problem+json"),
        (status = 410, description = "The instance finished and was removed after retention", body = Problem, content_type = "application/problem+json"),
    ),
    security(("bearer" = []))
)]
pub async fn complete_step(
    State(state): State<AppState>,
    caller: Caller,
    axum::extract::Path((instance, step)): axum::extract::Path<(String, String)>,
    ApiJson(body): ApiJson<CompleteBody>,
) -> Result<Response, Problem> {
    let rid = |p| with_rid(p, &caller);
    let fencing_token = body.fencing_token;
    let call = StepComplete {
        tenant: caller.tenant.clone(),
        instance_id: segment("the instance id", &instance).map_err(rid)?.to_owned(),
        step: segment("the step name", &step).map_err(rid)?.to_owned(),
        fencing_token,
        outcome: outcome_of(body).map_err(rid)?,
        actor: caller.actor(),
        policy: None,
    };
    let done = state.flows.complete_step(call).await.map_err(|e| rid(flow_problem(e)))?;
    crate::logging::record_key(&done.record.key);
    Ok((StatusCode::OK, axum::Json(OperationView::of(done.record))).into_response())
}

/// Re-run an instance, guarded (`operator` role, a reason): a dry run shows exactly what it
/// would do — per step kept, runs, redone (a new side effect under a new key), looked up
/// first, compensated or compensation_runs, with the action and key each acts on, and for a
/// step for each item the same per item (`items`: a plain re-run redoes its failed items,
/// naming the step redoes them all) — with a plan hash; a run may pass that hash and is
/// refused if the instance changed since. A step that SUCCEEDED is redone only when named,
/// and a run that redoes a SUCCEEDED or UNKNOWN step (or item) must pass the hash (428
/// without it), so a request sent twice cannot redo it twice.
#[utoipa::path(
    post, path = "/v1/workflows/{instance}/rerun", tag = "workflows",
    params(("instance" = String, Path, description = "Instance id (percent-encoded)")),
    request_body = RerunBody,
    responses(
        (status = 200, description = "The plan (a dry run: nothing changed), or the plan run and the instance after it", body = RerunView),
        (status = 400, description = "No reason (`missing-reason`), a step the definition does not have (`unknown-step`), or a malformed body", body = Problem, content_type = "application/problem+json"),
        (status = 401, description = "Missing or invalid API key", body = Problem, content_type = "application/problem+json"),
        (status = 403, description = "The key's role is not `operator` or `admin`", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "No such instance in the caller's tenant", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "Refused, nothing changed: `plan-changed` (the instance changed since the approved plan), `instance-running`, `instance-compensated`, `step-busy`, `compensation-in-progress`, `nothing-to-rerun`, `step-needs-resolution`, `too-many-reruns`; when it concerns an item of a step for each item, the detail names the item (`send (item r2)`)", body = Problem, content_type = "application/problem+json"),
        (status = 410, description = "The instance was removed after its retention window", body = Problem, content_type = "application/problem+json"),
        (status = 428, description = "`plan-hash-required`: the re-run redoes a step (or an item of a step for each item) that SUCCEEDED or is UNKNOWN (a new side effect), so it runs only with the `plan_hash` of a dry run (RFC 6585 §3); the detail names the steps and the plan hash now", body = Problem, content_type = "application/problem+json"),
    ),
    security(("bearer" = []))
)]
pub async fn rerun(
    State(state): State<AppState>,
    caller: Caller,
    crate::json::ApiPath(raw): crate::json::ApiPath,
    ApiJson(body): ApiJson<RerunBody>,
) -> Result<Response, Problem> {
    let rid = |p| with_rid(p, &caller);
    caller.require(idem_store::keys::Role::Operator).map_err(rid)?;
    let id = segment("the instance id", &raw).map_err(rid)?;
    let named = body.steps.unwrap_or_default();
    let view = if body.dry_run.unwrap_or(false) {
        let plan = state.flows.preview_rerun(&caller.tenant, id, &named).await.map_err(|e| rid(flow_problem(e)))?;
        RerunView::of(plan, None)
    } else {
        let reason = body.reason.unwrap_or_default();
        let (plan, inst) = state
            .flows
            .rerun(&caller.tenant, id, &named, body.plan_hash.as_deref(), &reason, &caller.actor())
            .await
            .map_err(|e| rid(flow_problem(e)))?;
        RerunView::of(plan, Some(inst))
    };
    Ok(axum::Json(view).into_response())
}

/// Ask to compensate an instance (`operator` role, a reason): a FAILED one, or one PAUSED
/// before any compensation. The compensations of the steps whose effects may exist run,
/// last step first, each as its own operation (`{operation key}:compensate`).
#[utoipa::path(
    post, path = "/v1/workflows/{instance}/compensate", tag = "workflows",
    params(("instance" = String, Path, description = "Instance id (percent-encoded)")),
    request_body = CompensateBody,
    responses(
        (status = 200, description = "COMPENSATING: the compensations start", body = InstanceView),
        (status = 400, description = "No reason (`missing-reason`), or a malformed body", body = Problem, content_type = "application/problem+json"),
        (status = 401, description = "Missing or invalid API key", body = Problem, content_type = "application/problem+json"),
        (status = 403, description = "The key's role is not `operator` or `admin`", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "No such instance in the caller's tenant", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "Refused, nothing changed: `instance-not-stopped` (another request won: the instance is COMPENSATING now), `compensation-in-progress`, `nothing-to-compensate`, `instance-busy`", body = Problem, content_type = "application/problem+json"),
        (status = 410, description = "The instance was removed after its retention window", body = Problem, content_type = "application/problem+json"),
    ),
    security(("bearer" = []))
)]
pub async fn compensate(
    State(state): State<AppState>,
    caller: Caller,
    crate::json::ApiPath(raw): crate::json::ApiPath,
    ApiJson(body): ApiJson<CompensateBody>,
) -> Result<Response, Problem> {
    let rid = |p| with_rid(p, &caller);
    caller.require(idem_store::keys::Role::Operator).map_err(rid)?;
    let id = segment("the instance id", &raw).map_err(rid)?;
    let reason = body.reason.unwrap_or_default();
    let inst =
        state.flows.compensate(&caller.tenant, id, &reason, &caller.actor()).await.map_err(|e| rid(flow_problem(e)))?;
    Ok(axum::Json(InstanceView::of(inst)).into_response())
}
