//! The admin page's handlers and the data each template shows.

use super::session::{LOGIN_COOKIE, SESSION_COOKIE, cookie, random_token, same_token, set_cookie};
use super::{UiUser, error_page, html};
use crate::AppState;
use crate::dto::{EventView, OperationView, rfc3339};
use crate::operations::store_problem;
use askama::Template;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Redirect, Response};
use idem_store::keys::Role;
use idem_store::{ListFilter, ResolveRequest};
use percent_encoding::{NON_ALPHANUMERIC, utf8_percent_encode};
use serde::Deserialize;

/// The header bar: who is signed in, and the CSRF token for its sign-out form.
pub struct Nav {
    pub signed_in: bool,
    pub tenant: String,
    pub principal: String,
    pub role: String,
    pub csrf: String,
}

impl Nav {
    pub fn of(user: Option<&UiUser>) -> Self {
        match user {
            Some(u) => Nav {
                signed_in: true,
                tenant: u.caller.tenant.clone(),
                principal: u.caller.principal.clone(),
                role: u.caller.role.to_string(),
                csrf: u.csrf.clone(),
            },
            None => Nav {
                signed_in: false,
                tenant: String::new(),
                principal: String::new(),
                role: String::new(),
                csrf: String::new(),
            },
        }
    }
}

/// `s` percent-encoded for a path segment or a query value.
pub(super) fn enc(s: &str) -> String {
    utf8_percent_encode(s, NON_ALPHANUMERIC).to_string()
}

/// The admin page's link to one operation.
pub(super) fn op_href(key: &str) -> String {
    format!("/ui/operations/{}", enc(key))
}

pub(super) fn fail(user: &UiUser, e: idem_store::StoreError) -> Response {
    let p = store_problem(e);
    error_page(Some(user), p.status_code(), &p.detail)
}

#[derive(Template)]
#[template(path = "ui/error.html")]
pub struct ErrorPage {
    pub nav: Nav,
    pub status: u16,
    pub message: String,
}

// ---------------------------------------------------------------- sign-in / sign-out

#[derive(Template)]
#[template(path = "ui/login.html")]
struct LoginPage {
    nav: Nav,
    csrf: String,
    error: String,
}

fn login_page(headers: &HeaderMap, status: StatusCode, error: &str) -> Response {
    let csrf = random_token();
    let mut r = html(status, &LoginPage { nav: Nav::of(None), csrf: csrf.clone(), error: error.into() });
    r.headers_mut().append(header::SET_COOKIE, set_cookie(headers, LOGIN_COOKIE, &csrf, 600));
    r
}

/// `GET /ui/login`.
pub async fn login_form(headers: HeaderMap) -> Response {
    login_page(&headers, StatusCode::OK, "")
}

#[derive(Deserialize)]
pub struct LoginForm {
    #[serde(default)]
    api_key: String,
    #[serde(default)]
    csrf: String,
}

/// `POST /ui/login`: exchanges an API key for a session.
pub async fn login(
    State(state): State<AppState>,
    headers: HeaderMap,
    super::UiForm(form): super::UiForm<LoginForm>,
) -> Response {
    let expected = cookie(&headers, LOGIN_COOKIE).unwrap_or("");
    if expected.is_empty() || !same_token(expected, &form.csrf) {
        return login_page(&headers, StatusCode::FORBIDDEN, "The sign-in form expired; please try again.");
    }
    let secret = form.api_key.trim();
    if secret.is_empty() || secret.len() > 256 {
        return login_page(&headers, StatusCode::UNAUTHORIZED, "Enter an API key.");
    }
    match state.store.authenticate(secret).await {
        Ok(Some(info)) => {
            tracing::info!(tenant = %info.tenant, principal = %info.principal, "admin page: signed in");
            let Some((id, _csrf)) = state.ui.sessions.start(secret.to_owned()) else {
                let msg = "Too many people are signed in to this node; try again later.";
                return login_page(&headers, StatusCode::SERVICE_UNAVAILABLE, msg);
            };
            let mut r = Redirect::to("/ui").into_response();
            let ttl = super::session::SESSION_TTL.as_secs();
            r.headers_mut().append(header::SET_COOKIE, set_cookie(&headers, SESSION_COOKIE, &id, ttl));
            r.headers_mut().append(header::SET_COOKIE, set_cookie(&headers, LOGIN_COOKIE, "", 0));
            r
        }
        Ok(None) => login_page(&headers, StatusCode::UNAUTHORIZED, "Unknown or revoked API key."),
        Err(e) => {
            let p = store_problem(e);
            login_page(&headers, p.status_code(), &p.detail)
        }
    }
}

#[derive(Deserialize)]
pub struct CsrfForm {
    #[serde(default)]
    csrf: String,
}

/// `POST /ui/logout`.
pub async fn logout(
    State(state): State<AppState>,
    user: UiUser,
    headers: HeaderMap,
    super::UiForm(f): super::UiForm<CsrfForm>,
) -> Response {
    if let Err(r) = user.check_csrf(&f.csrf) {
        return r;
    }
    state.ui.sessions.end(&user.session);
    let mut r = Redirect::to("/ui/login").into_response();
    r.headers_mut().append(header::SET_COOKIE, set_cookie(&headers, SESSION_COOKIE, "", 0));
    r
}

// ---------------------------------------------------------------- overview

struct StateCount {
    state: &'static str,
    count: i64,
    href: String,
}

struct ActionRow {
    action: String,
    href: String,
    cells: Vec<i64>,
    total: i64,
}

struct Conflict {
    key: String,
    href: String,
    at: String,
    principal: String,
    request_id: String,
    fingerprint: String,
}

struct Late {
    key: String,
    at: String,
    request_id: String,
}

#[derive(Template)]
#[template(path = "ui/overview.html")]
struct OverviewPage {
    nav: Nav,
    states: Vec<StateCount>,
    state_names: Vec<&'static str>,
    actions: Vec<ActionRow>,
    review_depth: i64,
    stale_min: i64,
    unknown_stale: i64,
    conflicts: Vec<Conflict>,
    lates: Vec<Late>,
}

#[derive(Deserialize)]
pub struct OverviewQuery {
    #[serde(default)]
    stale_min: String,
}

/// `GET /ui`: the overview.
pub async fn overview(
    State(state): State<AppState>,
    user: UiUser,
    super::UiQuery(q): super::UiQuery<OverviewQuery>,
) -> Response {
    let stale_min = match q.stale_min.as_str() {
        "" => 15,
        s => match s.parse::<i64>() {
            Ok(n) if (1..=7 * 24 * 60).contains(&n) => n,
            _ => {
                let msg = "stale_min must be a whole number of minutes from 1 to 10080 (a week)";
                return error_page(Some(&user), StatusCode::BAD_REQUEST, msg);
            }
        },
    };
    let stale_before = state.clock.now_ms() - stale_min * 60_000;
    let o = match state.store.overview(Some(&user.caller.tenant), stale_before, 20).await {
        Ok(o) => o,
        Err(e) => return fail(&user, e),
    };
    let all = idem_core::State::ALL;
    let states = all
        .iter()
        .map(|s| StateCount {
            state: s.as_str(),
            count: o.count_state(*s),
            href: format!("/ui/operations?state={}", s.as_str()),
        })
        .collect();
    let mut actions: Vec<ActionRow> = Vec::new();
    for g in &o.groups {
        if actions.last().is_none_or(|a| a.action != g.action) {
            actions.push(ActionRow {
                action: g.action.clone(),
                href: format!("/ui/operations?action={}", enc(&g.action)),
                cells: vec![0; all.len()],
                total: 0,
            });
        }
        let row = actions.last_mut().expect("pushed above");
        if let Some(i) = all.iter().position(|s| *s == g.state) {
            row.cells[i] += g.count;
        }
        row.total += g.count;
    }
    let review_depth = o.needs_review();
    let conflicts = o
        .recent_mismatches
        .into_iter()
        .map(|e| Conflict {
            href: op_href(&e.key),
            key: e.key,
            at: rfc3339(e.at),
            principal: e.principal,
            request_id: e.request_id.unwrap_or_default(),
            fingerprint: e.fingerprint.unwrap_or_default(),
        })
        .collect();
    let lates = state
        .ui
        .recent_late(&user.caller.tenant, 20)
        .into_iter()
        .map(|l| Late { key: l.key, at: rfc3339(l.at_ms), request_id: l.request_id.unwrap_or_default() })
        .collect();
    let page = OverviewPage {
        nav: Nav::of(Some(&user)),
        states,
        state_names: all.iter().map(|s| s.as_str()).collect(),
        actions,
        review_depth,
        stale_min,
        unknown_stale: o.unknown_stale,
        conflicts,
        lates,
    };
    html(StatusCode::OK, &page)
}

// ---------------------------------------------------------------- operations list

struct OpRow {
    key: String,
    href: String,
    action: String,
    state: String,
    attempt: i64,
    needs_review: bool,
    created: String,
    updated: String,
    /// The last error (class: message), for the review queue.
    error: String,
    /// Time since the last change, in words ("4 min"), for the review queue.
    age: String,
    /// The caller's code performs it (no connector): resolving it PENDING runs nothing
    /// until its next trigger.
    caller_performs: bool,
}

/// A duration in the largest whole unit: "45 s", "4 min", "3 h", "2 d".
fn age_words(ms: i64) -> String {
    let s = ms.max(0) / 1000;
    match s {
        0..60 => format!("{s} s"),
        60..3600 => format!("{} min", s / 60),
        3600..86_400 => format!("{} h", s / 3600),
        _ => format!("{} d", s / 86_400),
    }
}

/// The record's last error as one line (`class: message`), or "".
fn error_line(r: &idem_core::OperationRecord) -> String {
    match (&r.error_class, &r.error_message) {
        (Some(c), Some(m)) => format!("{c}: {m}"),
        (Some(c), None) => c.clone(),
        (None, Some(m)) => m.clone(),
        (None, None) => String::new(),
    }
}

impl OpRow {
    fn of(r: &idem_core::OperationRecord, now_ms: i64) -> Self {
        OpRow {
            error: error_line(r),
            age: age_words(now_ms - r.updated_at),
            caller_performs: r.connector.is_none(),
            key: r.key.clone(),
            href: op_href(&r.key),
            action: r.action.clone(),
            state: r.state.as_str().into(),
            attempt: r.attempt_count,
            needs_review: r.needs_review,
            created: rfc3339(r.created_at),
            updated: rfc3339(r.updated_at),
        }
    }
}

/// The list's filters, as typed in its form (all optional).
#[derive(Deserialize, Default)]
pub struct ListParams {
    #[serde(default)]
    state: String,
    #[serde(default)]
    action: String,
    #[serde(default)]
    key_prefix: String,
    /// `yes`, `no` or empty.
    #[serde(default)]
    needs_review: String,
    /// RFC 3339, or `YYYY-MM-DDTHH:MM` (a datetime-local field) taken as UTC.
    #[serde(default)]
    from: String,
    #[serde(default)]
    to: String,
    #[serde(default)]
    cursor: String,
}

#[derive(Template)]
#[template(path = "ui/operations.html")]
struct ListPage {
    nav: Nav,
    p: ListParams,
    state_names: Vec<&'static str>,
    rows: Vec<OpRow>,
    next_href: String,
    error: String,
}

/// Epoch ms of a form's time field: RFC 3339, or a `datetime-local` value taken as UTC.
pub(super) fn parse_time(field: &str, text: &str) -> Result<Option<i64>, String> {
    let t = text.trim();
    if t.is_empty() {
        return Ok(None);
    }
    [t.to_owned(), format!("{t}Z"), format!("{t}:00Z")]
        .iter()
        .find_map(|c| c.parse::<jiff::Timestamp>().ok())
        .map(|ts| Some(ts.as_millisecond()))
        .ok_or_else(|| format!("{field}: expected a time like 2026-11-30T12:00 (UTC) or an RFC 3339 instant"))
}

fn list_filter(p: &ListParams) -> Result<ListFilter, String> {
    let state = match p.state.as_str() {
        "" => None,
        s => Some(s.parse::<idem_core::State>().map_err(|e| e.to_string())?),
    };
    let needs_review = match p.needs_review.as_str() {
        "" => None,
        "yes" | "true" => Some(true),
        "no" | "false" => Some(false),
        other => return Err(format!("needs_review: expected yes or no, not {other:?}")),
    };
    let cursor = match p.cursor.split_once(':') {
        Some((at, key)) => Some((at.parse::<i64>().map_err(|_| "bad page cursor".to_string())?, key.to_owned())),
        None if p.cursor.is_empty() => None,
        None => return Err("bad page cursor".into()),
    };
    let filter = ListFilter {
        state,
        action: Some(p.action.trim().to_owned()).filter(|a| !a.is_empty()),
        needs_review,
        key_prefix: Some(p.key_prefix.clone()).filter(|k| !k.is_empty()),
        created_from: parse_time("from", &p.from)?,
        created_before: parse_time("to", &p.to)?,
        limit: 50,
        cursor,
    };
    crate::operations::check_filter_text(&filter)?;
    Ok(filter)
}

/// `GET /ui/operations`: filtered, paginated list.
pub async fn operations(
    State(state): State<AppState>,
    user: UiUser,
    super::UiQuery(p): super::UiQuery<ListParams>,
) -> Response {
    let state_names = idem_core::State::ALL.iter().map(|s| s.as_str()).collect();
    let filter = match list_filter(&p) {
        Ok(f) => f,
        Err(error) => {
            let page =
                ListPage { nav: Nav::of(Some(&user)), p, state_names, rows: vec![], next_href: String::new(), error };
            return html(StatusCode::BAD_REQUEST, &page);
        }
    };
    let page = match state.store.list(&user.caller.tenant, &filter).await {
        Ok(page) => page,
        Err(e) => return fail(&user, e),
    };
    let next_href = page.next_cursor.map_or_else(String::new, |(at, key)| {
        let q = [
            ("state", p.state.as_str()),
            ("action", p.action.as_str()),
            ("key_prefix", p.key_prefix.as_str()),
            ("needs_review", p.needs_review.as_str()),
            ("from", p.from.as_str()),
            ("to", p.to.as_str()),
        ];
        let mut href = String::from("/ui/operations?");
        for (k, v) in q.iter().filter(|(_, v)| !v.is_empty()) {
            href.push_str(&format!("{k}={}&", enc(v)));
        }
        href.push_str(&format!("cursor={}", enc(&format!("{at}:{key}"))));
        href
    });
    let now = state.clock.now_ms();
    let rows = page.items.iter().map(|r| OpRow::of(r, now)).collect();
    html(StatusCode::OK, &ListPage { nav: Nav::of(Some(&user)), p, state_names, rows, next_href, error: String::new() })
}

// ---------------------------------------------------------------- one operation

struct EventLine {
    seq: i64,
    at: String,
    kind: String,
    principal: String,
    request_id: String,
    transition: String,
    token: String,
    error_class: String,
    wait_ms: String,
    reason: String,
    fingerprint: String,
}

impl EventLine {
    fn of(e: EventView) -> Self {
        let transition = match (e.from_state, e.to_state) {
            (Some(a), Some(b)) if a != b => format!("{a} → {b}"),
            (Some(a), _) => a,
            (None, Some(b)) => format!("→ {b}"),
            (None, None) => String::new(),
        };
        EventLine {
            seq: e.seq,
            at: e.at,
            kind: e.kind,
            principal: e.principal,
            request_id: e.request_id.unwrap_or_default(),
            transition,
            token: e.fencing_token.map(|t| t.to_string()).unwrap_or_default(),
            error_class: e.error_class.unwrap_or_default(),
            wait_ms: e.wait_ms.map(|w| w.to_string()).unwrap_or_default(),
            reason: e.reason.unwrap_or_default(),
            fingerprint: e.fingerprint.unwrap_or_default(),
        }
    }
}

#[derive(Template)]
#[template(path = "ui/operation.html")]
struct OperationPage {
    nav: Nav,
    key: String,
    href: String,
    state: String,
    fields: Vec<(&'static str, String)>,
    fingerprint: String,
    payload: String,
    result: String,
    events: Vec<EventLine>,
    settled: bool,
    can_act: bool,
    /// A connector performs it, so idem can ask its provider (and schedules attempts).
    has_connector: bool,
    /// Why the operation is where it is: the last reason or error, with its event.
    cause: String,
    /// The state it was in before its current one, and since when.
    before: String,
    message: String,
    error: String,
    /// What the operator typed into the resolve form, kept after a refusal.
    form: ResolveInput,
}

/// The resolve form's values as typed.
#[derive(Default, Clone)]
struct ResolveInput {
    to: String,
    reason: String,
    evidence: String,
}

fn pretty(v: &serde_json::Value) -> String {
    serde_json::to_string_pretty(v).unwrap_or_default()
}

/// Why `rec` is where it is, in words: the error that brought it there (the record's
/// last error, with the event that reported it), then the latest reason given since (a
/// lookup, a review flag), or "" when nothing was reported.
fn cause_of(rec: &idem_core::OperationRecord, events: &[idem_core::OperationEvent]) -> String {
    let said = |e: &idem_core::OperationEvent| format!("{} by {}, {}", e.kind, e.principal, rfc3339(e.at));
    let error = error_line(rec);
    let failed = events.iter().rev().find(|e| e.error_class.is_some());
    let first = match (error.is_empty(), failed) {
        (false, Some(e)) => format!("{error} ({})", said(e)),
        (false, None) => error,
        (true, _) => String::new(),
    };
    let latest = events
        .iter()
        .rev()
        .find(|e| e.reason.is_some() && failed.is_none_or(|f| e.seq > f.seq))
        .map(|e| format!("{} ({})", e.reason.as_deref().unwrap_or_default(), said(e)));
    match (first.is_empty(), latest) {
        (false, Some(l)) => format!("{first}; then {l}"),
        (false, None) => first,
        (true, Some(l)) => l,
        (true, None) => String::new(),
    }
}

/// The state `events` show the operation in before its current one ("EXECUTING from
/// … (attempt 1)"), or "".
fn before_of(rec: &idem_core::OperationRecord, events: &[idem_core::OperationEvent]) -> String {
    let Some(left) =
        events.iter().rev().find(|e| e.to_state == Some(rec.state) && e.from_state.is_some_and(|f| f != rec.state))
    else {
        return String::new();
    };
    let from = left.from_state.expect("checked");
    let entered =
        events.iter().rev().find(|e| e.seq < left.seq && e.to_state == Some(from) && e.from_state != Some(from));
    match entered {
        Some(e) => format!("{} from {} until {}", from.as_str(), rfc3339(e.at), rfc3339(left.at)),
        None => format!("{} until {}", from.as_str(), rfc3339(left.at)),
    }
}

fn operation_page(
    user: &UiUser,
    rec: idem_core::OperationRecord,
    events: Vec<idem_core::OperationEvent>,
    message: String,
    error: String,
    form: ResolveInput,
) -> OperationPage {
    let settled = rec.state.is_final();
    let has_connector = rec.connector.is_some();
    let cause = if settled { String::new() } else { cause_of(&rec, &events) };
    let before = if settled { String::new() } else { before_of(&rec, &events) };
    let v = OperationView::of(rec);
    let opt = |o: &Option<String>| o.clone().unwrap_or_default();
    let (error_class, error_message) =
        v.error.as_ref().map_or((String::new(), String::new()), |e| (opt(&e.class), opt(&e.message)));
    let fields = vec![
        ("Action", v.action.clone()),
        ("State", v.state.clone()),
        ("Needs review", if v.needs_review { "yes".into() } else { "no".into() }),
        ("Connector", opt(&v.connector)),
        ("Attempts", v.attempt.to_string()),
        ("Fencing token", v.fencing_token.to_string()),
        ("Lease owner", opt(&v.lease_owner)),
        ("Lease holder", opt(&v.lease_holder)),
        ("Lease expires", opt(&v.lease_expires_at)),
        // idem schedules attempts only for what a connector performs.
        ("Next attempt", if has_connector { opt(&v.next_attempt_at) } else { String::new() }),
        ("Lookups", v.lookup_attempts.to_string()),
        ("Provider reference (evidence)", opt(&v.provider_ref)),
        ("Evidence source", opt(&v.evidence_source)),
        ("Verified at", opt(&v.verified_at)),
        ("Error class", error_class),
        ("Error message", error_message),
        ("Redo-safe", if v.redo_safe { "yes".into() } else { "no".into() }),
        ("Created", v.created_at.clone()),
        ("Updated", v.updated_at.clone()),
        ("Completed", opt(&v.completed_at)),
        ("Expires (retention)", opt(&v.expires_at)),
    ]
    .into_iter()
    .filter(|(_, value)| !value.is_empty())
    .collect();
    OperationPage {
        nav: Nav::of(Some(user)),
        href: op_href(&v.key),
        key: v.key.clone(),
        state: v.state.clone(),
        fields,
        fingerprint: v.fingerprint.clone(),
        payload: pretty(&v.payload),
        result: v.result.as_ref().map(pretty).unwrap_or_default(),
        events: events.into_iter().map(|e| EventLine::of(EventView::of(e))).collect(),
        settled,
        can_act: user.caller.role >= Role::Operator,
        has_connector,
        cause,
        before,
        message,
        error,
        form,
    }
}

#[derive(Deserialize)]
pub struct DetailQuery {
    #[serde(default)]
    done: String,
}

/// `GET /ui/operations/{key}`.
pub async fn operation(
    State(state): State<AppState>,
    user: UiUser,
    super::UiKey(key): super::UiKey,
    super::UiQuery(q): super::UiQuery<DetailQuery>,
) -> Response {
    let key = match key {
        Ok(k) => k,
        Err(why) => return error_page(Some(&user), StatusCode::BAD_REQUEST, &why),
    };
    let message = match q.done.as_str() {
        "resolved" => "Resolved; the resolution is the last entry of the timeline.",
        "reconciled" => "Asked the provider; the answer is in the timeline.",
        _ => "",
    };
    show_operation(&state, &user, &key, StatusCode::OK, message.into(), String::new(), ResolveInput::default()).await
}

async fn show_operation(
    state: &AppState,
    user: &UiUser,
    key: &idem_core::IdempotencyKey,
    status: StatusCode,
    message: String,
    error: String,
    form: ResolveInput,
) -> Response {
    let rec = match state.store.get(&user.caller.tenant, key.as_str()).await {
        Ok(Some(r)) => r,
        Ok(None) => return error_page(Some(user), StatusCode::NOT_FOUND, "No operation with this key."),
        Err(e) => return fail(user, e),
    };
    let events = match state.store.events(&user.caller.tenant, key.as_str()).await {
        Ok(e) => e,
        Err(e) => return fail(user, e),
    };
    html(status, &operation_page(user, rec, events, message, error, form))
}

#[derive(Deserialize)]
pub struct ResolveForm {
    #[serde(default)]
    csrf: String,
    #[serde(default)]
    to: String,
    /// The state the page showed: a resolution decided from an older state is refused.
    #[serde(default)]
    expected_state: String,
    #[serde(default)]
    reason: String,
    #[serde(default)]
    evidence: String,
}

/// The checks of an operator's form post, in this order: the key (parsed, and so logged,
/// by [`super::UiKey`] before anything can refuse), the session's CSRF token, the
/// operator role.
fn operator_post(
    user: &UiUser,
    key: Result<idem_core::IdempotencyKey, String>,
    csrf: &str,
) -> Result<idem_core::IdempotencyKey, Response> {
    let key = key.map_err(|why| error_page(Some(user), StatusCode::BAD_REQUEST, &why))?;
    user.check_csrf(csrf)?;
    user.caller.require(Role::Operator).map_err(|p| error_page(Some(user), StatusCode::FORBIDDEN, &p.detail))?;
    Ok(key)
}

/// `POST /ui/operations/{key}/resolve`: an operator's resolution (needs the operator role,
/// a reason, and evidence for SUCCEEDED, as in the API).
pub async fn resolve(
    State(state): State<AppState>,
    user: UiUser,
    super::UiKey(key): super::UiKey,
    super::UiForm(f): super::UiForm<ResolveForm>,
) -> Response {
    let key = match operator_post(&user, key, &f.csrf) {
        Ok(k) => k,
        Err(r) => return r,
    };
    let typed = ResolveInput { to: f.to.clone(), reason: f.reason.clone(), evidence: f.evidence.clone() };
    let parse = |s: &str| s.parse::<idem_core::State>().map_err(|e| e.to_string());
    let expected = Some(f.expected_state.as_str()).filter(|s| !s.is_empty()).map(parse).transpose();
    let to = match f.to.as_str() {
        "" => Err("Choose what to resolve the operation as: SUCCEEDED, FAILED or PENDING.".to_owned()),
        t => parse(t),
    };
    let (to, expected_state) = match (to, expected) {
        (Ok(to), Ok(expected)) => (to, expected),
        (Err(e), _) | (_, Err(e)) => {
            return show_operation(&state, &user, &key, StatusCode::BAD_REQUEST, String::new(), e, typed).await;
        }
    };
    let req = ResolveRequest {
        tenant: user.caller.tenant.clone(),
        key: key.to_string(),
        to,
        expected_state,
        reason: f.reason,
        evidence: Some(f.evidence.trim().to_owned()).filter(|e| !e.is_empty()),
        actor: user.caller.actor(),
    };
    match state.store.resolve(req).await {
        Ok(rec) => {
            state.flows.operation_settled(&rec.tenant, &rec.key).await;
            Redirect::to(&format!("{}?done=resolved", op_href(key.as_str()))).into_response()
        }
        Err(idem_store::StoreError::NotFound) => {
            error_page(Some(&user), StatusCode::NOT_FOUND, "No operation with this key.")
        }
        Err(e) => {
            let p = store_problem(e);
            let status = p.status_code();
            show_operation(&state, &user, &key, status, String::new(), for_the_page(&p.detail), typed).await
        }
    }
}

/// A refusal's text worded for the form on the page: the API's and CLI's names of a field
/// (`--evidence / "evidence"`) become the field's label.
fn for_the_page(detail: &str) -> String {
    let worded = detail
        .replace(" (--evidence / \"evidence\")", ": fill in Evidence with the provider's reference")
        .replace("--reason", "Reason")
        .replace("--evidence", "Evidence");
    let mut chars = worded.chars();
    chars.next().map_or_else(String::new, |c| c.to_uppercase().chain(chars).collect::<String>() + ".")
}

/// `POST /ui/operations/{key}/reconcile`: ask the provider now (operator role).
pub async fn reconcile(
    State(state): State<AppState>,
    user: UiUser,
    super::UiKey(key): super::UiKey,
    super::UiForm(f): super::UiForm<CsrfForm>,
) -> Response {
    let key = match operator_post(&user, key, &f.csrf) {
        Ok(k) => k,
        Err(r) => return r,
    };
    let rec = match state.store.get(&user.caller.tenant, key.as_str()).await {
        Ok(Some(r)) => r,
        Ok(None) => return error_page(Some(&user), StatusCode::NOT_FOUND, "No operation with this key."),
        Err(e) => return fail(&user, e),
    };
    match state.reconciler.reconcile_one(&rec, user.caller.actor()).await {
        Ok(out) => {
            if out.changed {
                state.flows.operation_settled(&out.record.tenant, &out.record.key).await;
            }
            Redirect::to(&format!("{}?done=reconciled", op_href(key.as_str()))).into_response()
        }
        Err(e) => fail(&user, e),
    }
}

// ---------------------------------------------------------------- review queue

#[derive(Template)]
#[template(path = "ui/review.html")]
struct ReviewPage {
    nav: Nav,
    flagged: Vec<OpRow>,
    unknown: Vec<OpRow>,
    can_act: bool,
}

/// `GET /ui/review`: operations flagged for review, then UNKNOWN ones awaiting
/// reconciliation (100 of each, newest first).
pub async fn review(State(state): State<AppState>, user: UiUser) -> Response {
    let flagged = ListFilter { needs_review: Some(true), limit: 100, ..Default::default() };
    let unknown = ListFilter {
        state: Some(idem_core::State::Unknown),
        needs_review: Some(false),
        limit: 100,
        ..Default::default()
    };
    let flagged = match state.store.list(&user.caller.tenant, &flagged).await {
        Ok(p) => p.items,
        Err(e) => return fail(&user, e),
    };
    let unknown = match state.store.list(&user.caller.tenant, &unknown).await {
        Ok(p) => p.items,
        Err(e) => return fail(&user, e),
    };
    let now = state.clock.now_ms();
    let page = ReviewPage {
        nav: Nav::of(Some(&user)),
        flagged: flagged.iter().map(|r| OpRow::of(r, now)).collect(),
        unknown: unknown.iter().map(|r| OpRow::of(r, now)).collect(),
        can_act: user.caller.role >= Role::Operator,
    };
    html(StatusCode::OK, &page)
}

/// `GET /ui/style.css`.
pub async fn style() -> Response {
    let mut r = include_str!("../../templates/ui/style.css").into_response();
    r.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("text/css; charset=utf-8"));
    r
}
