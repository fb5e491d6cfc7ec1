//! A scriptable order API for acceptance runs and tests: the provider double behind
//! `idem scenarios provider`.
//!
//! `POST /orders` creates an order for the request's `Idempotency-Key` — *every* time it is
//! told to, with no deduplication of its own, so a test counts exactly the side effects
//! idem caused. What each call does is scripted per operation key (the part of the
//! `Idempotency-Key` after the tenant, `tenant:KEY`):
//!
//! | step | effect | answer |
//! |---|---|---|
//! | `ok` | creates an order | `201 {"id": "ord-N", "client_reference": …}` |
//! | `slow:MS` | creates an order after MS ms | as `ok` |
//! | `NNN` or `NNN:S` (e.g. `503:1`) | none | status NNN, `Retry-After: S` if given |
//! | `effect_then_hang` | creates an order | never answers (the reply is "lost") |
//! | `effect_then_NNN` (e.g. `effect_then_504`) | creates an order | status NNN, as a gateway that failed after the provider acted |
//! | `hang` | none | never answers |
//!
//! An unscripted call is `ok`. A deduplicating provider ([`Provider::set_deduplicates`], as
//! Stripe does with `Idempotency-Key`) answers a call whose `Idempotency-Key` already
//! created an order with that order (`201`, `Idempotent-Replayed: true`) and creates
//! nothing, whatever the script says (the call is counted, the script not consumed). During an outage ([`Provider::outage`]) every call is 503. `GET /orders?client_reference=R` lists the orders created
//! for `R` (the lookup). Control: `POST /_control/script {"key", "steps": [...]}`,
//! `GET /_control/stats?key=K` → `{"calls", "effects"}`, `POST /_control/reset`.

use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{Value, json};
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// One scripted behaviour (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Create the order and answer 201.
    Ok,
    /// Wait, then as `Ok`.
    Slow(u64),
    /// Answer with a status and no effect (optionally `Retry-After` seconds).
    Status(u16, Option<u64>),
    /// Create the order, then never answer.
    EffectThenHang,
    /// Create the order, then answer with a status (a gateway's 504 after the provider acted).
    EffectThenStatus(u16),
    /// Never answer, no effect.
    Hang,
}

impl std::str::FromStr for Step {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || {
            format!(
                "unknown provider step {s:?}: ok, slow:MS, NNN[:RETRY_AFTER_S], effect_then_hang, effect_then_NNN, hang"
            )
        };
        match s {
            "ok" => Ok(Step::Ok),
            "effect_then_hang" => Ok(Step::EffectThenHang),
            "hang" => Ok(Step::Hang),
            _ => {
                if let Some(ms) = s.strip_prefix("slow:") {
                    return ms.parse().map(Step::Slow).map_err(|_| bad());
                }
                if let Some(code) = s.strip_prefix("effect_then_") {
                    return match code.parse::<u16>() {
                        Ok(c) if (100..=599).contains(&c) => Ok(Step::EffectThenStatus(c)),
                        _ => Err(bad()),
                    };
                }
                let (code, ra) = match s.split_once(':') {
                    Some((c, r)) => (c, Some(r.parse::<u64>().map_err(|_| bad())?)),
                    None => (s, None),
                };
                let code: u16 = code.parse().map_err(|_| bad())?;
                if !(100..=599).contains(&code) {
                    return Err(bad());
                }
                Ok(Step::Status(code, ra))
            }
        }
    }
}

/// One created order.
#[derive(Debug, Clone)]
pub struct Order {
    /// `ord-N`.
    pub id: String,
    /// The `Idempotency-Key` it was created with.
    pub client_reference: String,
}

#[derive(Debug, Default)]
struct Inner {
    scripts: HashMap<String, VecDeque<Step>>,
    orders: Vec<Order>,
    calls: HashMap<String, u64>,
    outage_until: Option<std::time::Instant>,
    outage_calls: u64,
    deduplicates: bool,
}

/// The provider's shared state.
#[derive(Debug, Clone, Default)]
pub struct Provider(Arc<Mutex<Inner>>);

/// The operation key inside `tenant:KEY`.
fn op_key(reference: &str) -> &str {
    reference.split_once(':').map_or(reference, |(_, k)| k)
}

impl Provider {
    /// A provider with no scripts and no orders.
    pub fn new() -> Self {
        Provider::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Scripts the next calls for operation key `key`.
    pub fn script(&self, key: &str, steps: Vec<Step>) {
        self.lock().scripts.insert(key.to_owned(), steps.into());
    }

    /// Makes the provider deduplicate by `Idempotency-Key` (see the module docs), or not.
    pub fn set_deduplicates(&self, on: bool) {
        self.lock().deduplicates = on;
    }

    /// Calls received for `key`.
    pub fn calls(&self, key: &str) -> u64 {
        self.lock().calls.get(key).copied().unwrap_or(0)
    }

    /// Orders created for `key` (side effects).
    pub fn effects(&self, key: &str) -> usize {
        self.lock().orders.iter().filter(|o| op_key(&o.client_reference) == key).count()
    }

    /// Ids (`ord-N`) of the orders created for `key`, oldest first.
    pub fn order_ids(&self, key: &str) -> Vec<String> {
        self.lock().orders.iter().filter(|o| op_key(&o.client_reference) == key).map(|o| o.id.clone()).collect()
    }

    /// Answers every `POST /orders` with 503 (no effect) for `d`, counting those calls.
    pub fn outage(&self, d: Duration) {
        let mut inner = self.lock();
        inner.outage_until = Some(std::time::Instant::now() + d);
        inner.outage_calls = 0;
    }

    /// Calls answered 503 by the current or last outage.
    pub fn outage_calls(&self) -> u64 {
        self.lock().outage_calls
    }

    /// All calls received.
    pub fn total_calls(&self) -> u64 {
        self.lock().calls.values().sum()
    }

    /// All orders created.
    pub fn total_effects(&self) -> usize {
        self.lock().orders.len()
    }

    fn create(&self, reference: &str) -> Order {
        let mut inner = self.lock();
        let order = Order { id: format!("ord-{}", inner.orders.len() + 1), client_reference: reference.to_owned() };
        inner.orders.push(order.clone());
        order
    }

    /// The HTTP routes.
    pub fn router(&self) -> Router {
        Router::new()
            .route("/orders", post(create_order).get(find_orders))
            .route("/_control/script", post(control_script))
            .route("/_control/stats", get(control_stats))
            .route("/_control/reset", post(control_reset))
            .with_state(self.clone())
    }

    /// Serves on `listener` until the task is dropped.
    pub async fn serve(self, listener: tokio::net::TcpListener) -> std::io::Result<()> {
        axum::serve(listener, self.router()).await
    }
}

async fn create_order(State(p): State<Provider>, headers: HeaderMap) -> Response {
    let Some(reference) = headers.get("idempotency-key").and_then(|v| v.to_str().ok()).map(str::to_owned) else {
        return (StatusCode::BAD_REQUEST, Json(json!({"error": "Idempotency-Key required"}))).into_response();
    };
    let key = op_key(&reference).to_owned();
    let step = {
        let mut inner = p.lock();
        *inner.calls.entry(key.clone()).or_default() += 1;
        let first = inner.orders.iter().find(|o| o.client_reference == reference).cloned();
        if let Some(order) = first.filter(|_| inner.deduplicates) {
            let mut r = created(order);
            r.headers_mut().insert("idempotent-replayed", axum::http::HeaderValue::from_static("true"));
            return r;
        }
        if inner.outage_until.is_some_and(|t| std::time::Instant::now() < t) {
            inner.outage_calls += 1;
            Step::Status(503, None)
        } else {
            inner.scripts.get_mut(&key).and_then(VecDeque::pop_front).unwrap_or(Step::Ok)
        }
    };
    match step {
        Step::Ok => created(p.create(&reference)),
        Step::Slow(ms) => {
            tokio::time::sleep(Duration::from_millis(ms)).await;
            created(p.create(&reference))
        }
        Step::Status(code, retry_after) => {
            let status = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            let mut r = (status, Json(json!({"error": format!("scripted {code}")}))).into_response();
            if let Some(s) = retry_after
                && let Ok(v) = s.to_string().parse()
            {
                r.headers_mut().insert(axum::http::header::RETRY_AFTER, v);
            }
            r
        }
        Step::EffectThenHang => {
            p.create(&reference);
            std::future::pending::<Response>().await
        }
        Step::EffectThenStatus(code) => {
            p.create(&reference);
            let status = StatusCode::from_u16(code).unwrap_or(StatusCode::GATEWAY_TIMEOUT);
            (status, Json(json!({"error": format!("scripted {code} after the order was created")}))).into_response()
        }
        Step::Hang => std::future::pending::<Response>().await,
    }
}

fn created(o: Order) -> Response {
    (StatusCode::CREATED, Json(json!({"id": o.id, "client_reference": o.client_reference}))).into_response()
}

#[derive(Deserialize)]
struct Find {
    client_reference: String,
}

async fn find_orders(State(p): State<Provider>, Query(q): Query<Find>) -> Json<Value> {
    let inner = p.lock();
    let found: Vec<Value> = inner
        .orders
        .iter()
        .filter(|o| o.client_reference == q.client_reference)
        .map(|o| json!({"id": o.id, "client_reference": o.client_reference}))
        .collect();
    Json(Value::Array(found))
}

#[derive(Deserialize)]
struct ScriptBody {
    key: String,
    steps: Vec<String>,
}

async fn control_script(State(p): State<Provider>, Json(b): Json<ScriptBody>) -> Response {
    match b.steps.iter().map(|s| s.parse::<Step>()).collect::<Result<Vec<_>, _>>() {
        Ok(steps) => {
            p.script(&b.key, steps);
            StatusCode::NO_CONTENT.into_response()
        }
        Err(e) => (StatusCode::BAD_REQUEST, Json(json!({"error": e}))).into_response(),
    }
}

#[derive(Deserialize)]
struct StatsQuery {
    key: String,
}

async fn control_stats(State(p): State<Provider>, Query(q): Query<StatsQuery>) -> Json<Value> {
    Json(json!({"calls": p.calls(&q.key), "effects": p.effects(&q.key)}))
}

async fn control_reset(State(p): State<Provider>) -> StatusCode {
    *p.lock() = Inner::default();
    StatusCode::NO_CONTENT
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_parse() {
        assert_eq!("ok".parse::<Step>().unwrap(), Step::Ok);
        assert_eq!("503:1".parse::<Step>().unwrap(), Step::Status(503, Some(1)));
        assert_eq!("422".parse::<Step>().unwrap(), Step::Status(422, None));
        assert_eq!("slow:200".parse::<Step>().unwrap(), Step::Slow(200));
        assert_eq!("effect_then_504".parse::<Step>().unwrap(), Step::EffectThenStatus(504));
        assert!("effect_then_x".parse::<Step>().is_err());
        assert!("teapot".parse::<Step>().is_err());
        assert!("999".parse::<Step>().is_err());
    }
}
