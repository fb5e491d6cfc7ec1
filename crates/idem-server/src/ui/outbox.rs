//! The admin page's outbox view (`/ui/outbox`): events by state, the outbox lag (age of
//! the oldest undelivered event), the dead letters with the operator's redrive and skip
//! (a mandatory reason, audited in the event's attempts), and the latest events.
//!
//! The outbox is `[outbox]`'s application database, not a tenant's data: only operator
//! and admin keys of `[outbox] tenant` (default `default`) see it. Redrive and skip go
//! through idem-outbox's `operator_action`, whose rules are idem-core's.

use super::pages::Nav;
use super::{UiUser, error_page, html};
use crate::AppState;
use crate::dto::rfc3339;
use askama::Template;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Redirect, Response};
use idem_core::outbox::{OperatorAction, OutboxState};
use idem_outbox::store::{EventRow, OutboxStore};
use idem_store::keys::Role;
use serde::Deserialize;

/// Dead letters and latest events shown, at most.
const LIST: i64 = 100;

struct EventView {
    id: String,
    aggregate: String,
    topic: String,
    state: String,
    attempts: i64,
    created: String,
    sink: String,
    evidence: String,
    error: String,
}

impl From<EventRow> for EventView {
    fn from(r: EventRow) -> Self {
        EventView {
            error: match (&r.error_class, &r.error_message) {
                (Some(c), Some(m)) if r.state != "DELIVERED" => format!("{c}: {m}"),
                _ => String::new(),
            },
            id: r.id,
            aggregate: format!("{}/{}", r.aggregate_type, r.aggregate_id),
            topic: r.topic,
            state: r.state,
            attempts: r.attempts,
            created: rfc3339(r.created_at),
            sink: r.sink.unwrap_or_default(),
            evidence: r.evidence.unwrap_or_default(),
        }
    }
}

#[derive(Template)]
#[template(path = "ui/outbox.html")]
struct OutboxPage {
    nav: Nav,
    configured: bool,
    counts: Vec<(&'static str, i64)>,
    lag_s: String,
    dead: Vec<EventView>,
    latest: Vec<EventView>,
    done: String,
    error: String,
}

/// The outbox `user` may see, or the page that says why not.
fn outbox_of<'a>(state: &'a AppState, user: &UiUser) -> Result<Option<&'a OutboxStore>, Response> {
    user.caller.require(Role::Operator).map_err(|p| error_page(Some(user), StatusCode::FORBIDDEN, &p.detail))?;
    match &state.outbox {
        Some((_, tenant)) if *tenant != user.caller.tenant => Err(error_page(
            Some(user),
            StatusCode::FORBIDDEN,
            "The outbox is shown to operators of the tenant named in [outbox] tenant.",
        )),
        Some((store, _)) => Ok(Some(store)),
        None => Ok(None),
    }
}

/// `?done=` after an action.
#[derive(Debug, Default, Deserialize)]
pub struct Done {
    #[serde(default)]
    done: String,
}

/// `e` for the page, in idem's words (the log gets the database's own).
fn words(e: &idem_outbox::OutboxError) -> String {
    tracing::warn!(error = %e, "the outbox's database failed");
    e.in_idems_words()
}

async fn page(store: Option<&OutboxStore>, user: &UiUser, done: String, error: String) -> Result<OutboxPage, String> {
    let mut p = OutboxPage {
        nav: Nav::of(Some(user)),
        configured: store.is_some(),
        counts: vec![],
        lag_s: String::new(),
        dead: vec![],
        latest: vec![],
        done,
        error,
    };
    if let Some(store) = store {
        let stats = store.stats().await.map_err(|e| words(&e))?;
        p.counts = OutboxState::ALL
            .iter()
            .map(|s| (s.as_str(), stats.by_state.get(s.as_str()).copied().unwrap_or(0)))
            .collect();
        p.lag_s = format!("{:.1}", stats.lag_ms as f64 / 1000.0);
        let dead = store.list(Some(OutboxState::Dead), LIST, None).await.map_err(|e| words(&e))?;
        p.dead = dead.into_iter().map(EventView::from).collect();
        let latest = store.list(None, LIST, None).await.map_err(|e| words(&e))?;
        p.latest = latest.into_iter().map(EventView::from).collect();
    }
    Ok(p)
}

/// `GET /ui/outbox`.
pub async fn show(State(state): State<AppState>, user: UiUser, super::UiQuery(d): super::UiQuery<Done>) -> Response {
    let store = match outbox_of(&state, &user) {
        Ok(s) => s,
        Err(r) => return r,
    };
    match page(store, &user, d.done, String::new()).await {
        Ok(p) => html(StatusCode::OK, &p),
        Err(e) => error_page(Some(&user), StatusCode::SERVICE_UNAVAILABLE, &format!("The outbox cannot be read: {e}")),
    }
}

/// The redrive/skip form.
#[derive(Debug, Deserialize)]
pub struct ActionForm {
    #[serde(default)]
    csrf: String,
    #[serde(default)]
    reason: String,
}

/// `POST /ui/outbox/{id}/redrive` and `…/skip` (operator role, CSRF, a reason).
pub async fn act(
    State(state): State<AppState>,
    user: UiUser,
    Path((id, action)): Path<(String, String)>,
    super::UiForm(f): super::UiForm<ActionForm>,
) -> Response {
    if let Err(r) = user.check_csrf(&f.csrf) {
        return r;
    }
    let store = match outbox_of(&state, &user) {
        Ok(Some(s)) => s,
        Ok(None) => return error_page(Some(&user), StatusCode::NOT_FOUND, "No outbox is configured."),
        Err(r) => return r,
    };
    let action = match action.as_str() {
        "redrive" => OperatorAction::Redrive,
        "skip" => OperatorAction::Skip,
        _ => return error_page(Some(&user), StatusCode::NOT_FOUND, "Unknown outbox action."),
    };
    // An id no event can have (a NUL, padding, too long) never reaches a query (issue 28 §7).
    if let Err(e) = idem_core::ident::check_identifier("the event id", &id, idem_core::outbox::MAX_EVENT_ID_LEN) {
        return error_page(Some(&user), StatusCode::BAD_REQUEST, &format!("No event can have this id: {e}."));
    }
    let operator = format!("{}/{}", user.caller.tenant, user.caller.principal);
    let refused = match store.operator_action(&id, action, &f.reason, &operator).await {
        Ok(Ok(_)) => return Redirect::to(&format!("/ui/outbox?done={}", action.as_str())).into_response(),
        Ok(Err(refusal)) => refusal.to_string(),
        Err(e) => words(&e),
    };
    match page(Some(store), &user, String::new(), format!("{} of {id} refused: {refused}", action.as_str())).await {
        Ok(p) => html(StatusCode::UNPROCESSABLE_ENTITY, &p),
        Err(e) => error_page(Some(&user), StatusCode::SERVICE_UNAVAILABLE, &e),
    }
}
