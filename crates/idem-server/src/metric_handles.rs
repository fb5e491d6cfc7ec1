//! Registered handles of the series every request touches, so that counting a request is
//! an atomic add instead of a registration.
//!
//! `metrics::counter!(name, labels…)` builds a key (allocating its labels), hashes it and
//! looks it up in the recorder's registry on every call: about 7 000 instructions per
//! request for `idem_http_requests_total`, `idem_http_request_duration_seconds` and
//! `idem_acquires_total` together (scripts/callgrind.sh). The handles here are registered
//! once per label set and reused; the recorder has no idle timeout, so a handle never
//! outlives its series. The label sets are bounded: methods are the nine of RFC 9110 §9
//! or `other`, routes are the router's templates, statuses are three digits, decisions
//! are eight.

use metrics::{Counter, Histogram};
use std::collections::HashMap;
use std::sync::{LazyLock, RwLock};

/// The series of one `(method, route)`.
struct MethodSeries {
    method: &'static str,
    duration: Histogram,
    by_status: Vec<(u16, Counter)>,
}

/// By route template, then method.
static ROUTES: LazyLock<RwLock<HashMap<String, Vec<MethodSeries>>>> = LazyLock::new(Default::default);

fn find_status(s: &MethodSeries, status: u16) -> Option<&Counter> {
    s.by_status.iter().find(|(st, _)| *st == status).map(|(_, c)| c)
}

/// Counts and times one answered request: `idem_http_requests_total{method,route,status}`
/// and `idem_http_request_duration_seconds{method,route}` (seconds).
pub fn record_http(method: &'static str, route: &str, status: u16, seconds: f64) {
    {
        let routes = ROUTES.read().expect("metric handles lock");
        if let Some(s) = routes.get(route).and_then(|m| m.iter().find(|s| s.method == method))
            && let Some(c) = find_status(s, status)
        {
            c.increment(1);
            s.duration.record(seconds);
            return;
        }
    }
    crate::metrics::handle();
    let mut routes = ROUTES.write().expect("metric handles lock");
    let methods = routes.entry(route.to_owned()).or_default();
    let i = match methods.iter().position(|s| s.method == method) {
        Some(i) => i,
        None => {
            methods.push(MethodSeries {
                method,
                duration: metrics::histogram!("idem_http_request_duration_seconds", "method" => method, "route" => route.to_owned()),
                by_status: Vec::new(),
            });
            methods.len() - 1
        }
    };
    let s = &mut methods[i];
    if find_status(s, status).is_none() {
        let c = metrics::counter!("idem_http_requests_total", "method" => method, "route" => route.to_owned(), "status" => status.to_string());
        s.by_status.push((status, c));
    }
    find_status(s, status).expect("just registered").increment(1);
    s.duration.record(seconds);
}

/// The `decision` labels of `idem_acquires_total`, in [`DECISION_COUNTERS`] order.
pub const DECISIONS: [&str; 8] =
    ["acquired", "already_held", "replay", "in_progress", "retry_not_due", "unknown", "mismatch", "late"];

/// The place of `d`'s label in [`DECISIONS`] (and of its counter in [`DECISION_COUNTERS`]).
pub fn decision_index(d: &idem_core::Decision) -> usize {
    use idem_core::Decision;
    match d {
        Decision::Acquire => 0,
        Decision::AlreadyHeld => 1,
        Decision::Replay => 2,
        Decision::InProgress { .. } => 3,
        Decision::RetryNotDue { .. } => 4,
        Decision::Unknown | Decision::ExpireToUnknown => 5,
        Decision::Mismatch => 6,
        Decision::Late => 7,
    }
}

/// `idem_acquires_total{decision}`, one handle per label of [`DECISIONS`].
pub static DECISION_COUNTERS: LazyLock<[Counter; 8]> = LazyLock::new(|| {
    crate::metrics::handle();
    DECISIONS.map(|d| metrics::counter!("idem_acquires_total", "decision" => d))
});

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(text: &str, series: &str) -> f64 {
        text.lines().find_map(|l| l.strip_prefix(series)?.trim().parse().ok()).unwrap_or(0.0)
    }

    #[test]
    fn cached_handles_count_into_the_exported_series() {
        let route = "/test/metric-handles/{id}";
        let series = format!("idem_http_requests_total{{method=\"PATCH\",route=\"{route}\",status=\"418\"}}");
        record_http("PATCH", route, 418, 0.001);
        record_http("PATCH", route, 418, 0.002);
        record_http("PATCH", route, 200, 0.003);
        let text = crate::metrics::handle().render();
        assert_eq!(sample(&text, &series), 2.0, "{text}");
        let count = format!("idem_http_request_duration_seconds_count{{method=\"PATCH\",route=\"{route}\"}}");
        assert_eq!(sample(&text, &count), 3.0);
        assert_eq!(DECISIONS[decision_index(&idem_core::Decision::Late)], "late");
        assert_eq!(DECISIONS[decision_index(&idem_core::Decision::ExpireToUnknown)], "unknown");
        DECISION_COUNTERS[decision_index(&idem_core::Decision::Late)].increment(1);
        let text = crate::metrics::handle().render();
        assert!(sample(&text, "idem_acquires_total{decision=\"late\"}") >= 1.0);
    }
}
