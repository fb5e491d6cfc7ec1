//! Sign-in for the admin page: an operator's API key, exchanged for a session cookie.
//!
//! - The cookie `idem_session` holds a random 256-bit session id (never the API key), with
//!   `HttpOnly; SameSite=Strict; Path=/ui` (and `Secure` when the request came over HTTPS,
//!   per `X-Forwarded-Proto`). Sessions live in this process's memory for at most
//!   [`SESSION_TTL`]; a restart signs everyone out, and with several nodes a session is
//!   valid only on the node that made it (put a sticky load balancer in front).
//! - Every request re-authenticates the session's API key against the store, so revoking
//!   the key ends its sessions at once, and the tenant and role are the key's, as in the API.
//! - CSRF (OWASP "synchronizer token pattern"): each session has a random token that every
//!   form posts back as `csrf`; a POST without the session's token is refused with 403,
//!   compared in constant time. The sign-in form, which has no session yet, uses a
//!   double-submit cookie (`idem_login`). `SameSite=Strict` is a second line of defence.

use crate::AppState;
use crate::auth::Caller;
use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Redirect, Response};
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Name of the session cookie.
pub const SESSION_COOKIE: &str = "idem_session";
/// Name of the sign-in form's double-submit cookie.
pub const LOGIN_COOKIE: &str = "idem_login";
/// How long a session lasts after sign-in (8 h), whatever its activity.
pub const SESSION_TTL: Duration = Duration::from_secs(8 * 3600);
/// Most sessions kept at once. When full, a new sign-in is refused (never another user's
/// session evicted).
pub const MAX_SESSIONS: usize = 10_000;
/// Most sessions of one API key; its own oldest session ends when it signs in once more.
pub const MAX_SESSIONS_PER_KEY: usize = 8;

struct Session {
    secret: String,
    csrf: String,
    created: Instant,
}

/// The signed-in sessions of this process.
#[derive(Default)]
pub struct Sessions {
    map: Mutex<HashMap<String, Session>>,
}

/// A random 256-bit token, hex.
pub fn random_token() -> String {
    idem_store::keys::random_hex_256()
}

/// Compares two tokens without an early exit on the first differing byte.
pub fn same_token(a: &str, b: &str) -> bool {
    a.len() == b.len() && a.bytes().zip(b.bytes()).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

impl Sessions {
    /// Starts a session for the API key `secret`; returns (session id, CSRF token), or
    /// `None` when [`MAX_SESSIONS`] live sessions exist. A key with
    /// [`MAX_SESSIONS_PER_KEY`] sessions loses its own oldest one, so one key (or one
    /// tenant's keys, each bounded the same) cannot push other users out.
    pub fn start(&self, secret: String) -> Option<(String, String)> {
        let id = random_token();
        let csrf = random_token();
        let mut map = self.map.lock().expect("session lock");
        map.retain(|_, s| s.created.elapsed() < SESSION_TTL);
        let mut own: Vec<(String, Instant)> =
            map.iter().filter(|(_, s)| s.secret == secret).map(|(k, s)| (k.clone(), s.created)).collect();
        if own.len() >= MAX_SESSIONS_PER_KEY {
            own.sort_by_key(|(_, created)| *created);
            for (k, _) in own.iter().take(own.len() + 1 - MAX_SESSIONS_PER_KEY) {
                map.remove(k);
            }
        }
        if map.len() >= MAX_SESSIONS {
            return None;
        }
        map.insert(id.clone(), Session { secret, csrf: csrf.clone(), created: Instant::now() });
        Some((id, csrf))
    }

    /// The API key and CSRF token of a live session.
    fn get(&self, id: &str) -> Option<(String, String)> {
        let mut map = self.map.lock().expect("session lock");
        match map.get(id) {
            Some(s) if s.created.elapsed() < SESSION_TTL => Some((s.secret.clone(), s.csrf.clone())),
            Some(_) => {
                map.remove(id);
                None
            }
            None => None,
        }
    }

    /// Ends a session.
    pub fn end(&self, id: &str) {
        self.map.lock().expect("session lock").remove(id);
    }
}

/// The value of cookie `name` in the request's `Cookie` headers (RFC 6265 §5.4).
pub fn cookie<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v)
}

/// Whether the browser reached this server over HTTPS: a proxy in front says so with
/// `X-Forwarded-Proto: https`; idem itself serves plain HTTP.
pub fn via_https(headers: &HeaderMap) -> bool {
    headers.get("x-forwarded-proto").is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"https"))
}

/// A `Set-Cookie` value for `name=value` on `/ui`, HttpOnly and SameSite=Strict, living
/// `max_age` seconds (0 deletes it).
pub fn set_cookie(headers: &HeaderMap, name: &str, value: &str, max_age: u64) -> HeaderValue {
    let secure = if via_https(headers) { "; Secure" } else { "" };
    HeaderValue::from_str(&format!("{name}={value}; Path=/ui; HttpOnly; SameSite=Strict; Max-Age={max_age}{secure}"))
        .expect("tokens and names are header-safe")
}

/// A signed-in admin-page user: the API caller of the session's key, and the session's
/// CSRF token. Without a live session (or with a revoked key) the request is redirected to
/// the sign-in page.
pub struct UiUser {
    /// The caller, exactly as the API would see the session's key.
    pub caller: Caller,
    /// The session's CSRF token, for forms.
    pub csrf: String,
    /// The session id.
    pub session: String,
}

impl UiUser {
    /// Refuses with 403 unless `posted` is the session's CSRF token.
    ///
    /// # Errors
    /// A 403 page.
    pub fn check_csrf(&self, posted: &str) -> Result<(), Response> {
        if same_token(posted, &self.csrf) {
            Ok(())
        } else {
            Err(super::error_page(
                Some(self),
                StatusCode::FORBIDDEN,
                "The form's CSRF token does not match this session. Reload the page and try again.",
            ))
        }
    }
}

impl FromRequestParts<AppState> for UiUser {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, Self::Rejection> {
        let to_login = || Redirect::to("/ui/login").into_response();
        let Some(id) = cookie(&parts.headers, SESSION_COOKIE) else {
            return Err(to_login());
        };
        let Some((secret, csrf)) = state.ui.sessions.get(id) else {
            return Err(to_login());
        };
        match state.store.authenticate(&secret).await {
            Ok(Some(info)) => {
                tracing::Span::current().record("tenant", info.tenant.as_str());
                Ok(UiUser {
                    caller: Caller {
                        tenant: info.tenant,
                        principal: info.principal,
                        role: info.role,
                        request_id: crate::auth::request_id(&parts.headers).map(str::to_owned),
                        request_id_from_client: parts.extensions.get::<crate::logging::ClientRequestId>().is_some(),
                    },
                    csrf,
                    session: id.to_owned(),
                })
            }
            Ok(None) => {
                state.ui.sessions.end(id);
                Err(to_login())
            }
            Err(e) => {
                let p = crate::operations::store_problem(e);
                let status = p.status_code();
                Err(super::error_page(None, status, &p.detail))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_key_cannot_push_other_users_out() {
        let s = Sessions::default();
        let (alice, _) = s.start("alice-key".into()).unwrap();
        for _ in 0..10 * MAX_SESSIONS_PER_KEY {
            s.start("mallory-key".into()).unwrap();
        }
        assert!(s.get(&alice).is_some(), "alice's session survives mallory's sign-ins");
        let mallory = s.map.lock().unwrap().values().filter(|v| v.secret == "mallory-key").count();
        assert_eq!(mallory, MAX_SESSIONS_PER_KEY);
    }

    #[test]
    fn a_full_table_refuses_new_sign_ins_instead_of_evicting() {
        let s = Sessions::default();
        let (alice, _) = s.start("alice-key".into()).unwrap();
        {
            let mut map = s.map.lock().unwrap();
            for i in 0..MAX_SESSIONS {
                map.insert(
                    format!("s{i}"),
                    Session { secret: format!("k{i}"), csrf: String::new(), created: Instant::now() },
                );
            }
        }
        assert!(s.start("bob-key".into()).is_none());
        assert!(s.get(&alice).is_some());
    }

    #[test]
    fn tokens_compare_in_full() {
        assert!(same_token("abc", "abc"));
        assert!(!same_token("abc", "abd") && !same_token("abc", "ab") && !same_token("", "a"));
    }
}
