//! What an HTTP status, received after the request was sent, proves about the side effect
//! (DESIGN.md §4). Shared by the HTTP connector and `idem proxy`, so both read an answer
//! the same way.
//!
//! A status is evidence only as far as its definition goes:
//!
//! | status | what it proves | [`Answer`] | error class |
//! |---|---|---|---|
//! | 2xx | the provider acted | `Succeeded` | — |
//! | 408 (RFC 9110 §15.5.9), 425 (RFC 8470 §5.2), 429 (RFC 6585 §4), 503 (RFC 9110 §15.6.4) | the provider did not process the request; a later attempt may succeed | `NotProcessed` | `unavailable`, `rate_limited` (429) |
//! | other 4xx | the provider refused the request; another attempt gets the same answer | `Refused` | `validation` (400, 422), `auth` (401, 403), `not_found` (404, 410), `conflict` (409), `too_large` (413), `client_error` |
//! | 501, 505 (RFC 9110 §15.6.2, §15.6.6), 511 (RFC 6585 §6) | the request was not processed and cannot be (method or version unsupported; a network in between wants a login) | `Refused` | `server_error` |
//! | 500, 502, 504 and every other 5xx (506, 507, 508, 510, vendor codes such as 520–530, unassigned ones) | nothing: a server or a gateway failed, possibly after the provider acted | `Ambiguous` | `server_error` |
//! | 3xx (redirects are not followed) | nothing: a 303 after a POST often means "created, see there" | `Redirect` | — |
//!
//! Unregistered codes (e.g. a CDN's 52x) prove nothing: their meaning is one vendor's, and
//! some of them (524: the origin took the request and did not answer in time) are sent
//! after the provider may have acted.
//!
//! When the provider deduplicates by the `Idempotency-Key` idem sends, a 409 answers a
//! retry that arrived while the first request is still being processed (IETF httpapi
//! Idempotency-Key draft §2.7): this request did nothing, so it is `NotProcessed`
//! (`in_progress`) and tried again later.

/// What a status proves (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answer {
    /// 2xx: the provider acted.
    Succeeded,
    /// The provider did not process the request; another attempt may succeed.
    NotProcessed {
        /// Error class recorded for the attempt.
        class: &'static str,
    },
    /// The provider refused the request; another attempt would get the same answer.
    Refused {
        /// Error class recorded for the attempt.
        class: &'static str,
    },
    /// Nothing is proven: the provider may have acted.
    Ambiguous {
        /// Error class recorded for the attempt.
        class: &'static str,
    },
    /// A redirect, not followed: the provider may have acted.
    Redirect,
}

/// Classifies `status` (100–599) received after the request was sent.
/// `provider_deduplicates`: the provider answers a repeated `Idempotency-Key` with the first
/// request's result (its 409 then means "the first one is still in progress").
pub fn classify(status: u16, provider_deduplicates: bool) -> Answer {
    match status {
        200..=299 => Answer::Succeeded,
        300..=399 => Answer::Redirect,
        429 => Answer::NotProcessed { class: "rate_limited" },
        408 | 425 | 503 => Answer::NotProcessed { class: "unavailable" },
        409 if provider_deduplicates => Answer::NotProcessed { class: "in_progress" },
        400 | 422 => Answer::Refused { class: "validation" },
        401 | 403 => Answer::Refused { class: "auth" },
        404 | 410 => Answer::Refused { class: "not_found" },
        409 => Answer::Refused { class: "conflict" },
        413 => Answer::Refused { class: "too_large" },
        400..=499 => Answer::Refused { class: "client_error" },
        501 | 505 | 511 => Answer::Refused { class: "server_error" },
        // Every other 5xx, and anything outside the registered classes.
        _ => Answer::Ambiguous { class: "server_error" },
    }
}

/// The 5xx statuses that prove nothing (`Ambiguous` without deduplication): the default
/// of `idem proxy --outcome-unknown-statuses`.
pub fn ambiguous_server_errors() -> Vec<u16> {
    (500..=599).filter(|s| matches!(classify(*s, false), Answer::Ambiguous { .. })).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_are_classified_by_what_they_prove() {
        for s in [408, 425, 503] {
            assert_eq!(classify(s, false), Answer::NotProcessed { class: "unavailable" }, "{s}");
        }
        assert_eq!(classify(429, false), Answer::NotProcessed { class: "rate_limited" });
        // The input and its neighbours: a gateway or server failure proves nothing.
        for s in [500, 502, 504, 506, 507, 508, 510, 520, 524, 599] {
            assert_eq!(classify(s, false), Answer::Ambiguous { class: "server_error" }, "{s}");
            assert_eq!(classify(s, true), Answer::Ambiguous { class: "server_error" }, "{s}");
        }
        for s in [501, 505, 511] {
            assert_eq!(classify(s, false), Answer::Refused { class: "server_error" }, "{s}");
        }
        assert_eq!(classify(422, false), Answer::Refused { class: "validation" });
        assert_eq!(classify(403, false), Answer::Refused { class: "auth" });
        assert_eq!(classify(418, false), Answer::Refused { class: "client_error" });
        assert_eq!(classify(201, false), Answer::Succeeded);
        assert_eq!(classify(303, true), Answer::Redirect);
        // A deduplicating provider's 409 means "the first request is still in progress".
        assert_eq!(classify(409, false), Answer::Refused { class: "conflict" });
        assert_eq!(classify(409, true), Answer::NotProcessed { class: "in_progress" });
    }

    #[test]
    fn the_proxy_default_is_every_5xx_that_proves_nothing() {
        let d = ambiguous_server_errors();
        assert!(d.contains(&500) && d.contains(&502) && d.contains(&504) && d.contains(&507));
        assert!(!d.contains(&501) && !d.contains(&503) && !d.contains(&505) && !d.contains(&511));
        assert_eq!(d.len(), 100 - 4);
    }
}
