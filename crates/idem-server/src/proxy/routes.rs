//! Per-route settings of `idem proxy` and what an upstream's answer means for a route.

use axum::http::StatusCode;

/// Which upstream statuses leave a request's outcome unknown, per route (path prefix).
///
/// Default for every route: the 5xx that do not prove the upstream did nothing, i.e. all
/// but 501, 503, 505 and 511 ([`idem_connect::http_status::ambiguous_server_errors`];
/// DESIGN.md §4). 500 is among them: an application's 500 is as often thrown after its
/// write as before it, and a second charge costs more than a key held until the lookup or
/// an operator settles it. A route may narrow or widen the list (e.g. to `502,504`, or
/// `none` for the old behaviour: every 5xx passed on and released for a retry).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutcomeUnknownStatuses {
    /// The statuses of every path no route names.
    pub default: Vec<u16>,
    /// `(path prefix, statuses)`; the longest prefix a path starts with wins.
    pub routes: Vec<(String, Vec<u16>)>,
}

impl Default for OutcomeUnknownStatuses {
    fn default() -> Self {
        OutcomeUnknownStatuses { default: idem_connect::http_status::ambiguous_server_errors(), routes: Vec::new() }
    }
}

impl OutcomeUnknownStatuses {
    /// The statuses that leave the outcome of a request to `path` unknown.
    pub fn for_path(&self, path: &str) -> &[u16] {
        self.routes
            .iter()
            .filter(|(prefix, _)| path.starts_with(prefix.as_str()))
            .max_by_key(|(prefix, _)| prefix.len())
            .map_or(&self.default, |(_, statuses)| statuses)
    }

    /// Parses the values of `--outcome-unknown-statuses`: each `LIST` (for every route) or
    /// `PREFIX=LIST` (for paths starting with `PREFIX`, which starts with `/`), where `LIST`
    /// is comma-separated statuses in 500–599, or `none`. No values: the default.
    ///
    /// # Errors
    /// A one-line message naming the bad value.
    pub fn parse(values: &[String]) -> Result<Self, String> {
        let mut out = OutcomeUnknownStatuses::default();
        let mut default_given = false;
        for value in values {
            let (prefix, list) = match value.split_once('=') {
                Some((p, l)) => (Some(p.trim()), l),
                None => (None, value.as_str()),
            };
            let statuses = if list.trim() == "none" {
                Vec::new()
            } else {
                list.split(',')
                    .map(|s| match s.trim().parse::<u16>() {
                        Ok(code) if (500..=599).contains(&code) => Ok(code),
                        _ => Err(format!(
                            "{value:?}: {:?} is not a 5xx status (only a server or gateway error can leave the outcome unknown; `none` for no status)",
                            s.trim()
                        )),
                    })
                    .collect::<Result<Vec<_>, _>>()?
            };
            match prefix {
                None if default_given => return Err(format!("{value:?}: the list for every route is given twice")),
                None => {
                    default_given = true;
                    out.default = statuses;
                }
                Some(p) if !p.starts_with('/') => {
                    return Err(format!("{value:?}: a route is a path prefix starting with /, e.g. /payments=502,504"));
                }
                Some(p) if out.routes.iter().any(|(q, _)| q == p) => {
                    return Err(format!("{value:?}: route {p} is given twice"));
                }
                Some(p) => out.routes.push((p.to_owned(), statuses)),
            }
        }
        Ok(out)
    }
}

/// What the proxy does with an upstream answer (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum UpstreamAnswer {
    /// Final: stored and replayed.
    Store,
    /// Proves nothing happened (or the route says to treat it so): passed on, key released.
    Release,
    /// The upstream may have acted: UNKNOWN, never forwarded again on its own.
    Unknown,
}

/// Classifies an upstream status under a route's outcome-unknown statuses.
pub(super) fn upstream_answer(status: StatusCode, outcome_unknown: &[u16]) -> UpstreamAnswer {
    if outcome_unknown.contains(&status.as_u16()) {
        UpstreamAnswer::Unknown
    } else if matches!(status.as_u16(), 408 | 425 | 429) || status.is_server_error() {
        UpstreamAnswer::Release
    } else {
        UpstreamAnswer::Store
    }
}
#[cfg(test)]
mod tests {
    use super::*;

    fn parse(v: &[&str]) -> Result<OutcomeUnknownStatuses, String> {
        OutcomeUnknownStatuses::parse(&v.iter().map(|s| s.to_string()).collect::<Vec<_>>())
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
    fn upstream_answers_are_stored_released_or_unknown() {
        let unknown = OutcomeUnknownStatuses::default();
        let a = |s: u16| upstream_answer(StatusCode::from_u16(s).unwrap(), &unknown.default);
        for s in [500, 502, 504, 507, 524] {
            assert_eq!(a(s), UpstreamAnswer::Unknown, "{s}");
        }
        for s in [503, 501, 429, 408, 425] {
            assert_eq!(a(s), UpstreamAnswer::Release, "{s}");
        }
        for s in [200, 201, 303, 404, 422] {
            assert_eq!(a(s), UpstreamAnswer::Store, "{s}");
        }
        assert_eq!(upstream_answer(StatusCode::GATEWAY_TIMEOUT, &[]), UpstreamAnswer::Release, "a route's none");
    }
}
