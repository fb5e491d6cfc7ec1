//! Per-route settings of `idem proxy` and what an upstream's answer means for a route.

use axum::http::StatusCode;

/// A setting of `idem proxy` that may differ per route (path prefix): one value for every
/// path no route names, and one per prefix, the longest prefix a path starts with winning.
///
/// Its command-line flags take `VALUE` (every route) or `PREFIX=VALUE` (paths starting
/// with `PREFIX`, which starts with `/`), repeatable ([`PerRoute::parse`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PerRoute<T> {
    /// The value of every path no route names.
    pub default: T,
    /// `(path prefix, value)`; the longest prefix a path starts with wins.
    pub routes: Vec<(String, T)>,
}

impl<T> PerRoute<T> {
    /// `default` for every path.
    pub fn new(default: T) -> Self {
        PerRoute { default, routes: Vec::new() }
    }

    /// The value for a request to `path`.
    pub fn for_path(&self, path: &str) -> &T {
        self.routes
            .iter()
            .filter(|(prefix, _)| path.starts_with(prefix.as_str()))
            .max_by_key(|(prefix, _)| prefix.len())
            .map_or(&self.default, |(_, v)| v)
    }

    /// Parses a flag's values, each `VALUE` or `PREFIX=VALUE`, with `value` reading one
    /// `VALUE`; no values: `default` everywhere. `example` is a `PREFIX=VALUE` for the
    /// message about a prefix without its leading `/`.
    ///
    /// # Errors
    /// A one-line message naming the bad value: one `value` refuses, a prefix that does not
    /// start with `/`, or the same route (or every route) given twice.
    pub fn parse(
        values: &[String],
        default: T,
        example: &str,
        value: impl Fn(&str) -> Result<T, String>,
    ) -> Result<Self, String> {
        let mut out = PerRoute::new(default);
        let mut default_given = false;
        for given in values {
            let (prefix, v) = match given.split_once('=') {
                Some((p, v)) => (Some(p.trim()), v),
                None => (None, given.as_str()),
            };
            let v = value(v).map_err(|e| format!("{given:?}: {e}"))?;
            match prefix {
                None if default_given => return Err(format!("{given:?}: the value for every route is given twice")),
                None => {
                    default_given = true;
                    out.default = v;
                }
                Some(p) if !p.starts_with('/') => {
                    return Err(format!("{given:?}: a route is a path prefix starting with /, e.g. {example}"));
                }
                Some(p) if out.routes.iter().any(|(q, _)| q == p) => {
                    return Err(format!("{given:?}: route {p} is given twice"));
                }
                Some(p) => out.routes.push((p.to_owned(), v)),
            }
        }
        Ok(out)
    }
}

/// Which upstream statuses leave a request's outcome unknown, per route.
///
/// Default for every route: the 5xx that do not prove the upstream did nothing, i.e. all
/// but 501, 503, 505 and 511 ([`idem_connect::http_status::ambiguous_server_errors`];
/// DESIGN.md §4). 500 is among them: an application's 500 is as often thrown after its
/// write as before it, and a second charge costs more than a key held until the lookup or
/// an operator settles it. A route may narrow or widen the list (e.g. to `502,504`, or
/// `none` for the old behaviour: every 5xx passed on and released for a retry).
pub type OutcomeUnknownStatuses = PerRoute<Vec<u16>>;

/// Parses the values of `--outcome-unknown-statuses` ([`PerRoute::parse`]): `LIST` is
/// comma-separated statuses in 500–599, or `none`. No values: the default above.
///
/// # Errors
/// A one-line message naming the bad value.
pub fn parse_outcome_unknown_statuses(values: &[String]) -> Result<OutcomeUnknownStatuses, String> {
    let default = idem_connect::http_status::ambiguous_server_errors();
    PerRoute::parse(values, default, "/payments=502,504", |list| {
        if list.trim() == "none" {
            return Ok(Vec::new());
        }
        list.split(',')
            .map(|s| match s.trim().parse::<u16>() {
                Ok(code) if (500..=599).contains(&code) => Ok(code),
                _ => Err(format!(
                    "{:?} is not a 5xx status (only a server or gateway error can leave the outcome unknown; `none` for no status)",
                    s.trim()
                )),
            })
            .collect()
    })
}

/// Parses the values of `--provider-deduplicates` ([`PerRoute::parse`]): `true` for a
/// route whose upstream answers a repeated `Idempotency-Key` with the first request's
/// result, as the HTTP connector's `provider_deduplicates` (DESIGN.md §2 invariant 4,
/// §4); `false` otherwise. No values: `false` everywhere.
///
/// # Errors
/// A one-line message naming the bad value.
pub fn parse_provider_deduplicates(values: &[String]) -> Result<PerRoute<bool>, String> {
    PerRoute::parse(values, false, "/v1/charges=true", |v| match v.trim() {
        "true" => Ok(true),
        "false" => Ok(false),
        other => Err(format!(
            "{other:?} is not true or false (true only if the upstream answers a repeated Idempotency-Key with the first request's result)"
        )),
    })
}

/// What the proxy does with an upstream answer (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum UpstreamAnswer {
    /// Final: stored and replayed.
    Store,
    /// Proves nothing happened (or the route says to treat it so): passed on, key released.
    Release,
    /// The upstream may have acted, and it deduplicates by the key: passed on, key
    /// released, so the client's retry with the same key is forwarded.
    ReleaseAmbiguous,
    /// The upstream may have acted: UNKNOWN, never forwarded again on its own.
    Unknown,
}

/// Classifies an upstream status under a route's outcome-unknown statuses and whether its
/// upstream deduplicates by the `Idempotency-Key` (then its 409 answers a retry that came
/// while the first request is still processed: it did nothing, and is not stored; IETF
/// httpapi Idempotency-Key draft §2.7, [`idem_connect::http_status::classify`]).
pub(super) fn upstream_answer(status: StatusCode, outcome_unknown: &[u16], deduplicates: bool) -> UpstreamAnswer {
    let code = status.as_u16();
    if outcome_unknown.contains(&code) {
        if deduplicates { UpstreamAnswer::ReleaseAmbiguous } else { UpstreamAnswer::Unknown }
    } else if matches!(code, 408 | 425 | 429) || status.is_server_error() || (deduplicates && code == 409) {
        UpstreamAnswer::Release
    } else {
        UpstreamAnswer::Store
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    fn parse(v: &[&str]) -> Result<OutcomeUnknownStatuses, String> {
        parse_outcome_unknown_statuses(&strings(v))
    }

    #[test]
    fn outcome_unknown_statuses_per_route() {
        let d = parse(&[]).unwrap();
        assert!(d.for_path("/charges").contains(&504) && d.for_path("/x").contains(&500));
        assert!(!d.for_path("/charges").contains(&503), "503 proves the upstream did not act");
        let c = parse(&["502,504", "/search=none", "/pay=500, 502,504", "/pay/refunds=504"]).unwrap();
        assert_eq!(c.for_path("/charges"), &[502, 504]);
        assert_eq!(c.for_path("/search?q=1"), &[] as &[u16]);
        assert_eq!(c.for_path("/pay/1"), &[500, 502, 504]);
        assert_eq!(c.for_path("/pay/refunds/9"), &[504], "the longest prefix wins");
        for bad in [&["404"][..], &["5xx"], &["pay=504"], &["504", "502"], &["/a=504", "/a=502"], &["600"]] {
            assert!(parse(bad).is_err(), "{bad:?}");
        }
        assert!(parse(&["404"]).unwrap_err().contains("not a 5xx status"));
    }

    #[test]
    fn provider_deduplicates_per_route() {
        let p = |v: &[&str]| parse_provider_deduplicates(&strings(v));
        let d = p(&[]).unwrap();
        assert!(!*d.for_path("/v1/charges"), "off unless declared");
        let c = p(&["/v1/charges=true", "/v1/charges/search=false", "/v1/payment_intents= true"]).unwrap();
        assert!(*c.for_path("/v1/charges") && *c.for_path("/v1/payment_intents/pi_1/confirm"));
        assert!(!*c.for_path("/v1/charges/search") && !*c.for_path("/v1/refunds"));
        assert!(*p(&["true", "/search=false"]).unwrap().for_path("/v1/refunds"));
        for (bad, says) in [
            (&["yes"][..], "not true or false"),
            (&["/a=1"], "not true or false"),
            (&["v1=true"], "path prefix"),
            (&["true", "false"], "every route is given twice"),
            (&["/a=true", "/a=false"], "route /a is given twice"),
        ] {
            let e = p(bad).unwrap_err();
            assert!(e.contains(says) && e.contains(bad[bad.len() - 1]), "{bad:?}: {e}");
        }
    }

    #[test]
    fn upstream_answers_are_stored_released_or_unknown() {
        let unknown = parse(&[]).unwrap();
        let a = |s: u16, dedup: bool| upstream_answer(StatusCode::from_u16(s).unwrap(), &unknown.default, dedup);
        for s in [500, 502, 504, 507, 524] {
            assert_eq!(a(s, false), UpstreamAnswer::Unknown, "{s}");
            assert_eq!(a(s, true), UpstreamAnswer::ReleaseAmbiguous, "{s}: the upstream deduplicates");
        }
        for s in [503, 501, 429, 408, 425] {
            assert_eq!(a(s, false), UpstreamAnswer::Release, "{s}");
            assert_eq!(a(s, true), UpstreamAnswer::Release, "{s}");
        }
        for s in [200, 201, 303, 404, 422, 409] {
            assert_eq!(a(s, false), UpstreamAnswer::Store, "{s}");
        }
        assert_eq!(a(409, true), UpstreamAnswer::Release, "a deduplicating upstream's 409: still in progress");
        assert_eq!(a(422, true), UpstreamAnswer::Store);
        assert_eq!(upstream_answer(StatusCode::GATEWAY_TIMEOUT, &[], false), UpstreamAnswer::Release, "a route's none");
        assert_eq!(upstream_answer(StatusCode::GATEWAY_TIMEOUT, &[], true), UpstreamAnswer::Release);
    }
}
