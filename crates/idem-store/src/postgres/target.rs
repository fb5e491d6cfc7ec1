//! Where the ledger's database is: one PostgreSQL server, or a cluster (a primary and its
//! standbys under an HA manager) named by a libpq multi-host URL.
//!
//! sqlx 0.9 reads one host from a URL (`PgConnectOptions::parse_from_url` takes the
//! `url` crate's host and port: `postgres://h1:5432,h2:5433/db` does not parse) and has
//! no `target_session_attrs`. libpq's rule (PostgreSQL docs, "Connection Strings" §34.1.1
//! multiple hosts, and `target_session_attrs`) is: try the hosts in order, keep the first
//! that accepts the connection and whose session has the wanted attributes. This module
//! is that rule for idem, which only writes: a host counts when its session accepts
//! writes.
//!
//! - [`parse`] splits a multi-host URL into one URL per host (the rest of the URL, user,
//!   password, database and parameters, is each host's), so sqlx parses each as usual;
//!   a URL naming one host without `target_session_attrs` is left exactly as it was.
//! - [`Target`] keeps the host it last found writable (the *primary*). Pools made by
//!   [`Target::pool`] connect there and check each new connection (`after_connect`);
//!   connections of idem's own ([`Target::connect`]) try it first, then the other hosts.
//!   With several hosts a watcher checks the primary every [`WATCH_INTERVAL`] on a
//!   connection of its own; when it stops answering or stops accepting writes the watcher
//!   asks every host at once and points every pool at the one that accepts writes
//!   (`Pool::set_connect_options`). A pooled connection opened before that move is
//!   closed instead of used ([`Target::opened_before_move`]), so nothing keeps writing to
//!   a demoted server, and [`Target::moves`] tells the database clock to read the new
//!   primary's time.
//!
//! Every user of one URL in a process shares one [`Target`] ([`Target::shared`]): the
//! store's pool, the batch writers' connections, the listener for API key changes, the
//! database clock and the outbox relay move together.

use sqlx::postgres::{PgConnectOptions, PgConnection, PgPool, PgPoolOptions};
use sqlx::{ConnectOptions, Connection};
use std::str::FromStr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

/// How often the watcher checks that the primary still accepts writes (several hosts
/// only): 250 ms, as the server's health prober.
pub const WATCH_INTERVAL: Duration = Duration::from_millis(250);
/// The longest one host may take to accept a connection and answer whether it takes
/// writes, when the hosts are asked where the primary is.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// What a session must offer, from the URL's `target_session_attrs` (libpq's names).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SessionAttrs {
    /// No check (one host, no `target_session_attrs`): today's single-server behaviour.
    Any,
    /// `read-write` (also what several hosts without the parameter mean to idem): the
    /// session's `transaction_read_only` is `off`.
    ReadWrite,
    /// `primary`: the server is not in recovery (`pg_is_in_recovery()` is false).
    Primary,
}

/// A database URL split by host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Parsed {
    /// One URL per host, in the URL's order, each with the URL's user, password,
    /// database and parameters (`target_session_attrs` taken out).
    pub hosts: Vec<String>,
    /// What a session must offer.
    pub attrs: SessionAttrs,
}

/// Splits `url` (`postgres://` or `postgresql://`) by host, as libpq reads a multi-host
/// URL: `postgres://user:pw@h1:5432,h2:5433,[::1]:5434/db?sslmode=disable&target_session_attrs=read-write`.
/// A host without a port gets 5432. A URL with one host and no `target_session_attrs` comes
/// back unchanged.
///
/// # Errors
/// A message naming the problem: an empty host in the list, a port that is not a number,
/// a host list in the `host=` parameter (name them in the URL instead), or a
/// `target_session_attrs` idem cannot work with (`read-only`, `standby`,
/// `prefer-standby`: idem writes; `any` with several hosts: it could land on a standby).
pub fn parse(url: &str) -> Result<Parsed, String> {
    let Some(scheme_end) = url.find("://").map(|i| i + 3) else {
        return Err("a PostgreSQL URL starts with postgres:// or postgresql://".into());
    };
    let rest = &url[scheme_end..];
    let authority_end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(authority_end);
    let (userinfo, hostlist) = match authority.rfind('@') {
        Some(at) => (&authority[..=at], &authority[at + 1..]),
        None => ("", authority),
    };
    let (path, query) = match tail.split_once('?') {
        Some((p, q)) => (p, Some(q)),
        None => (tail, None),
    };
    let mut attrs = None;
    let mut kept: Vec<&str> = Vec::new();
    for pair in query.into_iter().flat_map(|q| q.split('&')).filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        match k {
            "target_session_attrs" => attrs = Some(v.to_owned()),
            "host" | "hostaddr" | "port" if v.contains(',') || v.contains("%2C") || v.contains("%2c") => {
                return Err(format!(
                    "the {k}= parameter lists several values: name the hosts in the URL instead, \
                     postgres://user@host1:5432,host2:5432/db"
                ));
            }
            _ => kept.push(pair),
        }
    }
    let hosts: Vec<&str> = hostlist.split(',').collect();
    let several = hosts.len() > 1;
    let attrs = match attrs.as_deref() {
        None if !several => return Ok(Parsed { hosts: vec![url.to_owned()], attrs: SessionAttrs::Any }),
        None | Some("read-write") => SessionAttrs::ReadWrite,
        Some("primary") => SessionAttrs::Primary,
        Some("any") if !several => SessionAttrs::Any,
        Some("any") => {
            return Err("target_session_attrs=any with several hosts could connect to a standby, \
                 and idem writes: use read-write or primary (or leave it out)"
                .into());
        }
        Some(other) => {
            return Err(format!(
                "target_session_attrs={other} is not supported: idem writes to its database, \
                 so use read-write or primary (or leave it out)"
            ));
        }
    };
    let query = if kept.is_empty() { String::new() } else { format!("?{}", kept.join("&")) };
    let mut out = Vec::with_capacity(hosts.len());
    for host in hosts {
        let (name, port) = split_host_port(host)?;
        out.push(format!("{}{userinfo}{name}:{port}{path}{query}", &url[..scheme_end]));
    }
    Ok(Parsed { hosts: out, attrs })
}

/// `host[:port]` or `[v6][:port]` → (host as written, port; 5432 when left out).
fn split_host_port(host: &str) -> Result<(&str, u16), String> {
    if host.is_empty() {
        return Err("the URL's host list has an empty entry (two commas, or a comma at an end)".into());
    }
    let (name, port) = if host.starts_with('[') {
        match host.find(']') {
            Some(end) => match &host[end + 1..] {
                "" => (&host[..=end], None),
                p => (&host[..=end], Some(p.strip_prefix(':').ok_or_else(|| format!("bad host {host:?}"))?)),
            },
            None => return Err(format!("bad host {host:?}: an IPv6 address needs its closing ]")),
        }
    } else {
        match host.rsplit_once(':') {
            Some((n, p)) => (n, Some(p)),
            None => (host, None),
        }
    };
    let port = match port {
        None | Some("") => 5432,
        Some(p) => p.parse().map_err(|_| format!("bad port {p:?} for host {name:?}: a number up to 65535"))?,
    };
    if name.is_empty() {
        return Err(format!("the URL's host list has an entry without a host ({host:?})"));
    }
    Ok((name, port))
}

/// The database's hosts and which of them this process writes to (see the module's
/// documentation).
pub struct Target {
    /// What the URL names, to share one target per URL.
    url: String,
    hosts: Vec<PgConnectOptions>,
    attrs: SessionAttrs,
    /// Index into `hosts` of the one believed to accept writes.
    primary: AtomicUsize,
    /// The moves of the primary: how many, and when the last one happened.
    moved: tokio::sync::watch::Sender<(u64, Option<Instant>)>,
    /// The pools to point at a new primary, with how each tunes a host's options.
    pools: Mutex<Vec<(PgPool, Tune)>>,
}

/// How a user tunes a host's connect options (session parameters, its own limits).
pub type Tune = fn(PgConnectOptions) -> PgConnectOptions;

impl std::fmt::Debug for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Target")
            .field("hosts", &self.hosts.len())
            .field("attrs", &self.attrs)
            .field("primary", &self.primary.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

/// The targets of this process, one per URL.
static SHARED: Mutex<Vec<(String, Weak<Target>)>> = Mutex::new(Vec::new());

impl Target {
    /// The process's target for `url`, made on first use (a watcher starts with it when
    /// the URL names several hosts); it lives while anyone holds it.
    ///
    /// # Errors
    /// [`sqlx::Error::Configuration`] for a URL [`parse`] or sqlx refuses.
    pub fn shared(url: &str) -> Result<Arc<Target>, sqlx::Error> {
        let mut shared = SHARED.lock().expect("targets lock");
        shared.retain(|(_, t)| t.strong_count() > 0);
        if let Some(t) = shared.iter().find(|(u, _)| u == url).and_then(|(_, t)| t.upgrade()) {
            return Ok(t);
        }
        let target = Arc::new(Target::new(url)?);
        shared.push((url.to_owned(), Arc::downgrade(&target)));
        if target.hosts.len() > 1 {
            watch(Arc::downgrade(&target));
        }
        Ok(target)
    }

    fn new(url: &str) -> Result<Target, sqlx::Error> {
        let parsed = parse(url).map_err(|e| sqlx::Error::Configuration(e.into()))?;
        let hosts = parsed.hosts.iter().map(|h| PgConnectOptions::from_str(h)).collect::<Result<Vec<_>, _>>()?;
        Ok(Target {
            url: url.to_owned(),
            hosts,
            attrs: parsed.attrs,
            primary: AtomicUsize::new(0),
            moved: tokio::sync::watch::channel((0, None)).0,
            pools: Mutex::new(Vec::new()),
        })
    }

    /// The URL this target was made from.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// How many hosts the URL names.
    pub fn host_count(&self) -> usize {
        self.hosts.len()
    }

    /// `host:port` of the host believed to accept writes.
    pub fn primary(&self) -> String {
        let h = &self.hosts[self.primary.load(Ordering::Relaxed)];
        format!("{}:{}", h.get_host(), h.get_port())
    }

    /// The options of the host believed to accept writes.
    pub fn options(&self) -> PgConnectOptions {
        self.hosts[self.primary.load(Ordering::Relaxed)].clone()
    }

    /// The primary's moves: a counter and the instant of the last one.
    pub fn moves(&self) -> tokio::sync::watch::Receiver<(u64, Option<Instant>)> {
        self.moved.subscribe()
    }

    /// Whether a connection `age` old was opened before the primary last moved (then it
    /// may point at a server that no longer takes writes: close it).
    pub fn opened_before_move(&self, age: Duration) -> bool {
        match self.moved.borrow().1 {
            Some(at) => Instant::now().checked_sub(age).is_none_or(|opened| opened < at),
            None => false,
        }
    }

    /// Opens a connection of its own to the primary, tuned by `tune`: the host believed
    /// to be the primary first, then the others in the URL's order (libpq's order), each
    /// checked for the session attributes. Finding another host moves the primary.
    ///
    /// # Errors
    /// The last host's error; [`sqlx::Error::Io`] when hosts answered but none accepts
    /// writes.
    pub async fn connect(&self, tune: Tune) -> Result<PgConnection, sqlx::Error> {
        let first = self.primary.load(Ordering::Relaxed);
        let order = std::iter::once(first).chain((0..self.hosts.len()).filter(|i| *i != first));
        let mut last = None;
        for i in order {
            let attempt = async {
                let mut conn = tune(self.hosts[i].clone()).connect().await?;
                if accepts(&mut conn, self.attrs).await? {
                    Ok(Some(conn))
                } else {
                    let _ = conn.close().await;
                    Ok(None)
                }
            };
            let timeout = if self.hosts.len() > 1 { Some(PROBE_TIMEOUT) } else { None };
            let result = match timeout {
                Some(t) => tokio::time::timeout(t, attempt).await.unwrap_or(Err(sqlx::Error::PoolTimedOut)),
                None => attempt.await,
            };
            match result {
                Ok(Some(conn)) => {
                    self.set_primary(i);
                    return Ok(conn);
                }
                Ok(None) => last = Some(self.no_writable_host()),
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| self.no_writable_host()))
    }

    fn no_writable_host(&self) -> sqlx::Error {
        sqlx::Error::Io(std::io::Error::new(
            std::io::ErrorKind::NotConnected,
            format!("none of the {} hosts accepts writes (all are standbys or read-only)", self.hosts.len()),
        ))
    }

    /// A pool on the primary, its connections tuned by `tune` and checked for the session
    /// attributes; it follows the primary when it moves. `options` are the pool's limits;
    /// `idle_check` pings a connection idle longer than that before it is used.
    ///
    /// Like a plain pool, it keeps trying to connect until its acquire timeout (a server
    /// still starting), then fails naming the cause ([`super::connect_pool`]).
    ///
    /// # Errors
    /// The cause of the last failed connection.
    pub async fn pool(
        self: &Arc<Self>,
        options: PgPoolOptions,
        tune: Tune,
        idle_check: Option<Duration>,
    ) -> Result<PgPool, sqlx::Error> {
        let options = self.checked(options, idle_check);
        if self.attrs != SessionAttrs::Any {
            // Find the primary first, within the pool's patience.
            let deadline = Instant::now() + options.get_acquire_timeout();
            loop {
                match self.connect(tune).await {
                    Ok(conn) => {
                        let _ = conn.close().await;
                        break;
                    }
                    Err(e) if Instant::now() >= deadline => return Err(e),
                    Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
                }
            }
        }
        let pool = super::connect_pool(options, tune(self.options())).await?;
        self.keep(&pool, tune);
        Ok(pool)
    }

    /// Keeps `pool` to point it at the next primary (closed pools are let go).
    fn keep(&self, pool: &PgPool, tune: Tune) {
        let mut pools = self.pools.lock().expect("pools lock");
        pools.retain(|(p, _)| !p.is_closed());
        pools.push((pool.clone(), tune));
    }

    /// [`Target::pool`] without connecting now (the first use connects).
    pub fn pool_lazy(self: &Arc<Self>, options: PgPoolOptions, tune: Tune) -> PgPool {
        let pool = self.checked(options, None).connect_lazy_with(tune(self.options()));
        self.keep(&pool, tune);
        pool
    }

    /// `options` with the checks every connection of a pool gets: on several hosts (or a
    /// `target_session_attrs`), a new connection must offer the session attributes and a
    /// connection opened before the primary moved is closed; `idle_check` as
    /// [`Target::pool`] says.
    fn checked(self: &Arc<Self>, options: PgPoolOptions, idle_check: Option<Duration>) -> PgPoolOptions {
        let attrs = self.attrs;
        let options = if attrs == SessionAttrs::Any {
            options
        } else {
            options.after_connect(move |conn, _meta| {
                Box::pin(async move {
                    if accepts(conn, attrs).await? {
                        Ok(())
                    } else {
                        Err(sqlx::Error::Io(std::io::Error::new(
                            std::io::ErrorKind::NotConnected,
                            "this host does not accept writes (a standby): waiting for the new primary",
                        )))
                    }
                })
            })
        };
        let target = Arc::downgrade(self);
        options.before_acquire(move |conn, meta| {
            let stale = target.upgrade().is_some_and(|t| t.opened_before_move(meta.age));
            Box::pin(async move {
                if stale {
                    return Ok(false);
                }
                if idle_check.is_some_and(|d| meta.idle_for > d) {
                    conn.ping().await?;
                }
                Ok(true)
            })
        })
    }

    /// Records host `i` as the primary; when that is a move, points every pool there.
    fn set_primary(&self, i: usize) {
        let was = self.primary.swap(i, Ordering::SeqCst);
        if was == i {
            return;
        }
        tracing::warn!(
            from = %format_args!("{}:{}", self.hosts[was].get_host(), self.hosts[was].get_port()),
            to = %format_args!("{}:{}", self.hosts[i].get_host(), self.hosts[i].get_port()),
            "the database's primary moved: reconnecting there"
        );
        metrics::counter!("idem_database_primary_moves_total").increment(1);
        self.moved.send_modify(|(n, at)| {
            *n += 1;
            *at = Some(Instant::now());
        });
        let mut pools = self.pools.lock().expect("pools lock");
        pools.retain(|(p, _)| !p.is_closed());
        for (pool, tune) in pools.iter() {
            pool.set_connect_options(tune(self.hosts[i].clone()));
        }
    }

    /// Asks every host at once which accepts writes and moves the primary there (the
    /// current one kept when it still does). `false` when none does.
    async fn locate(&self) -> bool {
        let probes = self.hosts.iter().map(|h| async move {
            let attempt = async {
                let mut conn = h.clone().connect().await?;
                let ok = accepts(&mut conn, self.attrs).await;
                let _ = conn.close().await;
                ok
            };
            matches!(tokio::time::timeout(PROBE_TIMEOUT, attempt).await, Ok(Ok(true)))
        });
        let writable = futures_util::future::join_all(probes).await;
        let current = self.primary.load(Ordering::Relaxed);
        let found = if writable[current] { Some(current) } else { writable.iter().position(|w| *w) };
        match found {
            Some(i) => {
                self.set_primary(i);
                true
            }
            None => false,
        }
    }
}

/// Whether `conn`'s session offers `attrs` (one round trip unless `Any`).
async fn accepts(conn: &mut PgConnection, attrs: SessionAttrs) -> Result<bool, sqlx::Error> {
    if attrs == SessionAttrs::Any {
        return Ok(true);
    }
    let (recovery, read_only): (bool, String) =
        sqlx::query_as("SELECT pg_is_in_recovery(), current_setting('transaction_read_only')")
            .fetch_one(&mut *conn)
            .await?;
    Ok(match attrs {
        SessionAttrs::Primary => !recovery,
        _ => !recovery && read_only == "off",
    })
}

/// The watcher of a target with several hosts: checks the primary every
/// [`WATCH_INTERVAL`] on a connection of its own and, when it fails or stops accepting
/// writes, looks for the new primary ([`Target::locate`]) until one is found. Ends when
/// the target is dropped.
fn watch(target: Weak<Target>) {
    tokio::spawn(async move {
        let mut conn: Option<PgConnection> = None;
        let mut tick = tokio::time::interval(WATCH_INTERVAL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let Some(t) = target.upgrade() else { return };
            let healthy = match conn.as_mut() {
                Some(c) => {
                    matches!(tokio::time::timeout(PROBE_TIMEOUT, accepts(c, t.attrs)).await, Ok(Ok(true)))
                }
                None => false,
            };
            if healthy {
                continue;
            }
            if let Some(c) = conn.take() {
                drop(c);
            }
            if !t.locate().await {
                continue;
            }
            let options = t.options();
            conn = tokio::time::timeout(PROBE_TIMEOUT, options.connect()).await.ok().and_then(Result::ok);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hosts(url: &str) -> Vec<String> {
        parse(url).unwrap().hosts
    }

    #[test]
    fn one_host_without_attributes_is_left_as_it_was() {
        for url in [
            "postgres://u:p@db:5432/idem?sslmode=disable",
            "postgresql://db/idem",
            "postgres://u@[::1]:5433/idem",
            "postgres:///idem?host=/var/run/postgresql",
        ] {
            assert_eq!(parse(url).unwrap(), Parsed { hosts: vec![url.into()], attrs: SessionAttrs::Any });
        }
    }

    #[test]
    fn several_hosts_become_one_url_each_with_the_rest_of_the_url() {
        let p = parse("postgres://u:p%40w@h1:5432,h2:5433,[::1]/idem?sslmode=disable&target_session_attrs=read-write")
            .unwrap();
        assert_eq!(p.attrs, SessionAttrs::ReadWrite);
        assert_eq!(
            p.hosts,
            [
                "postgres://u:p%40w@h1:5432/idem?sslmode=disable",
                "postgres://u:p%40w@h2:5433/idem?sslmode=disable",
                "postgres://u:p%40w@[::1]:5432/idem?sslmode=disable",
            ]
        );
        // Every per-host URL is one sqlx reads, with the host and port of its entry.
        let o = PgConnectOptions::from_str(&p.hosts[1]).unwrap();
        assert_eq!((o.get_host(), o.get_port(), o.get_database()), ("h2", 5433, Some("idem")));
        assert_eq!(o.get_username(), "u");
    }

    #[test]
    fn several_hosts_without_attributes_mean_read_write_and_primary_is_kept() {
        assert_eq!(parse("postgres://a,b/x").unwrap().attrs, SessionAttrs::ReadWrite);
        assert_eq!(hosts("postgres://a,b/x"), ["postgres://a:5432/x", "postgres://b:5432/x"]);
        assert_eq!(parse("postgres://a:1,b:2/x?target_session_attrs=primary").unwrap().attrs, SessionAttrs::Primary);
        assert_eq!(hosts("postgres://a:1,b:2?target_session_attrs=primary"), ["postgres://a:1", "postgres://b:2"]);
        // One host with read-write is checked too (a standby named alone is refused).
        let one = parse("postgres://a:1/x?target_session_attrs=read-write").unwrap();
        assert_eq!((one.hosts, one.attrs), (vec!["postgres://a:1/x".to_owned()], SessionAttrs::ReadWrite));
    }

    #[test]
    fn what_idem_cannot_use_is_refused_naming_why() {
        for (url, says) in [
            ("postgres://a,b/x?target_session_attrs=read-only", "read-only is not supported"),
            ("postgres://a/x?target_session_attrs=standby", "standby is not supported"),
            ("postgres://a,b/x?target_session_attrs=prefer-standby", "prefer-standby is not supported"),
            ("postgres://a,b/x?target_session_attrs=any", "could connect to a standby"),
            ("postgres://a,,b/x", "empty entry"),
            ("postgres://a:5432,b:port/x", "bad port \"port\""),
            ("postgres://a:1,b:99999/x", "bad port \"99999\""),
            ("postgres://a,:5/x", "without a host"),
            ("postgres:///x?host=a,b", "name the hosts in the URL"),
            ("postgres:///x?port=1%2C2", "name the hosts in the URL"),
            ("postgres://a,[::1/x", "closing ]"),
            ("db:5432", "starts with postgres://"),
        ] {
            let e = parse(url).expect_err(url);
            assert!(e.contains(says), "{url}: {e}");
        }
    }

    #[tokio::test]
    async fn a_target_is_shared_per_url_and_knows_no_move_at_first() {
        let a = Target::shared("postgres://h1:1,h2:2/x").unwrap();
        let b = Target::shared("postgres://h1:1,h2:2/x").unwrap();
        assert!(Arc::ptr_eq(&a, &b));
        assert_eq!((a.host_count(), a.primary()), (2, "h1:1".to_owned()));
        assert!(!a.opened_before_move(Duration::from_secs(3600)));
        a.set_primary(1);
        assert_eq!(a.primary(), "h2:2");
        assert_eq!(a.moves().borrow().0, 1);
        assert!(a.opened_before_move(Duration::from_secs(1)), "opened before the move");
        assert!(!a.opened_before_move(Duration::ZERO), "opened now");
        let other = Target::shared("postgres://h1:1/x").unwrap();
        assert!(!Arc::ptr_eq(&a, &other));
    }
}
