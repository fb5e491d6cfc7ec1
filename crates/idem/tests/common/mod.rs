//! Test support: run the real `idem serve` binary on loopback and talk to it over HTTP.
#![allow(dead_code)] // each test file uses a different subset

pub mod book;
pub mod mail;
pub mod nats;
pub mod netns;
pub mod pg_cluster;
pub mod pg_ha;
pub mod proxy;
pub mod webdriver;

use reqwest::StatusCode;
use serde_json::{Value, json};
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

/// The admin key every test server is bootstrapped with (tenant "default").
pub const ADMIN_KEY: &str = "test-admin-key-0123456789abcdef0123456789";

/// A database for a test: an SQLite file in a temp dir, or a fresh PostgreSQL database.
pub struct Db {
    pub url: String,
    _dir: Option<tempfile::TempDir>,
    /// A PostgreSQL database is dropped with this guard.
    _pg: Option<idem_store::testing::TestDatabase>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Sqlite,
    Postgres,
}

pub const BACKENDS: [Backend; 2] = [Backend::Sqlite, Backend::Postgres];

impl Db {
    pub async fn new(backend: Backend) -> Db {
        match backend {
            Backend::Sqlite => {
                let dir = tempfile::tempdir().unwrap();
                let url = format!("sqlite://{}", dir.path().join("idem.db").display());
                Db { url, _dir: Some(dir), _pg: None }
            }
            Backend::Postgres => {
                let pg = idem_store::testing::fresh_pg_database("idem_http").await;
                Db { url: pg.url.clone(), _dir: None, _pg: Some(pg) }
            }
        }
    }
}

/// A running `idem serve` process; killed (SIGKILL) when dropped.
pub struct Server {
    child: Child,
    pub base: String,
    pub http: reqwest::Client,
    pub db_url: String,
    config: Option<PathBuf>,
    _config_dir: Option<tempfile::TempDir>,
    sub: Vec<String>,
    env: Vec<(String, String)>,
}

/// The environment entry that carries a server's network namespace and address through
/// a restart (`Server::start_in_netns`); `idem` ignores it.
const NETNS_ENV: &str = "IDEM_TEST_NETNS";

pub fn idem_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_idem"))
}

impl Server {
    /// Starts a server on a free loopback port and waits until it listens (at most 30 s).
    pub fn start(db_url: &str) -> Server {
        Server::spawn(db_url, None, None)
    }

    /// As [`Server::start`], with a connector configuration (TOML text).
    pub fn start_with_config(db_url: &str, config_toml: &str) -> Server {
        Server::start_with_config_env(db_url, config_toml, &[])
    }

    /// As [`Server::start_with_config`], with extra environment variables (a restart keeps
    /// them), e.g. `IDEM_TEST_CRASH_AT`.
    pub fn start_with_config_env(db_url: &str, config_toml: &str, env: &[(&str, &str)]) -> Server {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("idem.toml");
        std::fs::write(&path, config_toml).unwrap();
        let env = env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        Server::spawn_env(&["serve".to_string()], db_url, Some(path), Some(dir), env)
    }

    /// A new server process on the same database and configuration (after a crash).
    pub fn restart(self) -> Server {
        let (db, config, sub, env) = (self.db_url.clone(), self.config.clone(), self.sub.clone(), self.env.clone());
        let mut old = self;
        let dir = old._config_dir.take();
        old.kill9_in_place();
        Server::spawn_env(&sub, &db, config, dir, env)
    }

    /// `idem serve` with extra flags and extra environment variables (e.g. `LD_PRELOAD`).
    pub fn start_with_env(db_url: &str, extra: &[&str], env: &[(&str, &str)]) -> Server {
        let mut args = vec!["serve".to_string()];
        args.extend(extra.iter().map(|s| s.to_string()));
        let env = env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        Server::spawn_env(&args, db_url, None, None, env)
    }

    /// `idem serve` with extra flags inside network namespace `ns` (`ip netns exec`),
    /// listening on `ip` there.
    pub fn start_in_netns(ns: &str, ip: &str, db_url: &str, extra: &[&str]) -> Server {
        let mut args = vec!["serve".to_string()];
        args.extend(extra.iter().map(|s| s.to_string()));
        let env = vec![(NETNS_ENV.to_string(), format!("{ns} {ip}"))];
        Server::spawn_env(&args, db_url, None, None, env)
    }

    /// `idem serve` with extra flags.
    pub fn start_with_args(db_url: &str, extra: &[&str]) -> Server {
        let mut args = vec!["serve".to_string()];
        args.extend(extra.iter().map(|s| s.to_string()));
        Server::spawn_args(&args, db_url, None, None)
    }

    /// `idem proxy` in front of `upstream`, with extra flags; the same harness as `serve`.
    pub fn start_proxy(db_url: &str, upstream: &str, extra: &[&str]) -> Server {
        let mut args = vec!["proxy".to_string(), "--upstream".into(), upstream.into()];
        args.extend(extra.iter().map(|s| s.to_string()));
        Server::spawn_args(&args, db_url, None, None)
    }

    fn spawn(db_url: &str, config: Option<PathBuf>, config_dir: Option<tempfile::TempDir>) -> Server {
        Server::spawn_args(&["serve".to_string()], db_url, config, config_dir)
    }

    fn spawn_args(
        sub: &[String],
        db_url: &str,
        config: Option<PathBuf>,
        config_dir: Option<tempfile::TempDir>,
    ) -> Server {
        Server::spawn_env(sub, db_url, config, config_dir, Vec::new())
    }

    fn spawn_env(
        sub: &[String],
        db_url: &str,
        config: Option<PathBuf>,
        config_dir: Option<tempfile::TempDir>,
        env: Vec<(String, String)>,
    ) -> Server {
        // In a network namespace (`start_in_netns`): `ip netns exec NS idem …`, listening on
        // the namespace's address.
        let netns = env.iter().find(|(k, _)| k == NETNS_ENV).and_then(|(_, v)| v.split_once(' '));
        let mut cmd = match netns {
            Some((ns, _)) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns]).arg(idem_bin());
                c
            }
            None => Command::new(idem_bin()),
        };
        let listen = netns.map_or_else(|| "127.0.0.1:0".to_string(), |(_, ip)| format!("{ip}:0"));
        cmd.args(sub)
            .args(["--listen", &listen, "--sweep-interval-ms", "50", "--database-url", db_url])
            .env("IDEM_BOOTSTRAP_KEY", ADMIN_KEY)
            .env("RUST_LOG", "warn")
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        if let Some(c) = &config {
            cmd.arg("--config").arg(c);
        }
        let mut child = cmd.spawn().expect("spawn idem serve");
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Some(addr) = line.strip_prefix("idem: listening on ") {
                    let _ = tx.send(addr.to_string());
                }
            }
        });
        let base = rx.recv_timeout(Duration::from_secs(30)).expect("idem serve did not start within 30 s");
        Server {
            child,
            base,
            http: reqwest::Client::builder().timeout(Duration::from_secs(30)).build().unwrap(),
            db_url: db_url.to_string(),
            config,
            _config_dir: config_dir,
            sub: sub.to_vec(),
            env,
        }
    }

    fn kill9_in_place(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Polls the record until `done` holds (at most `secs` seconds); returns it.
    pub async fn wait_for(&self, key: &str, secs: u64, done: impl Fn(&Value) -> bool) -> Value {
        let start = std::time::Instant::now();
        loop {
            let r = self.record(key).await.body;
            if done(&r) {
                return r;
            }
            assert!(start.elapsed() < Duration::from_secs(secs), "gave up waiting on {key}: {r}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// kill -9: no shutdown hook runs.
    pub fn kill9(mut self) {
        self.kill9_in_place();
    }

    /// The server's process id (for its memory in `/proc/PID/status`).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// Creates an API key with the CLI against the server's database; returns the secret.
    pub fn create_key(&self, tenant: &str, role: &str) -> String {
        let out = Command::new(idem_bin())
            .args(["keys", "create", "--tenant", tenant, "--role", role, "--database-url", &self.db_url])
            .output()
            .unwrap();
        assert!(out.status.success(), "keys create failed: {}", String::from_utf8_lossy(&out.stderr));
        let secret = String::from_utf8(out.stdout).unwrap().trim().to_string();
        assert!(secret.starts_with("idem_") && !secret.contains('\n'), "stdout holds only the key: {secret:?}");
        secret
    }

    pub async fn post(&self, api_key: &str, path: &str, body: &Value) -> Resp {
        let r = self.http.post(self.url(path)).bearer_auth(api_key).json(body).send().await.unwrap();
        Resp::read(r).await
    }

    /// POST of `body` exactly as given (`Content-Type: application/json`): for JSON text a
    /// `Value` cannot carry, such as the number literal `1e-400`.
    pub async fn post_raw(&self, api_key: &str, path: &str, body: &str) -> Resp {
        let r = self
            .http
            .post(self.url(path))
            .bearer_auth(api_key)
            .header("content-type", "application/json")
            .body(body.to_owned())
            .send()
            .await
            .unwrap();
        Resp::read(r).await
    }

    pub async fn get(&self, api_key: &str, path: &str) -> Resp {
        let r = self.http.get(self.url(path)).bearer_auth(api_key).send().await.unwrap();
        Resp::read(r).await
    }

    /// `POST /v1/operations` with the admin key.
    pub async fn acquire(&self, key: &str, payload: Value) -> Resp {
        self.acquire_as(ADMIN_KEY, key, payload).await
    }

    pub async fn acquire_as(&self, api_key: &str, key: &str, payload: Value) -> Resp {
        let body = json!({"key": key, "action": "send_confirmation", "payload": payload});
        self.post(api_key, "/v1/operations", &body).await
    }

    /// `POST /v1/operations/{key}/complete` with the admin key.
    pub async fn complete(&self, key: &str, body: Value) -> Resp {
        self.post(ADMIN_KEY, &format!("/v1/operations/{}/complete", enc(key)), &body).await
    }

    /// `GET /v1/operations/{key}` with the admin key.
    pub async fn record(&self, key: &str) -> Resp {
        self.get(ADMIN_KEY, &format!("/v1/operations/{}", enc(key))).await
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Percent-encodes a key for a path segment.
pub fn enc(key: &str) -> String {
    let mut u = reqwest::Url::parse("http://x/").unwrap();
    u.path_segments_mut().unwrap().push(key);
    u.path()[1..].to_string()
}

/// A response: status, headers, JSON body (or the text as a JSON string).
#[derive(Debug)]
pub struct Resp {
    pub status: StatusCode,
    pub headers: reqwest::header::HeaderMap,
    pub body: Value,
}

impl Resp {
    pub async fn read(r: reqwest::Response) -> Resp {
        let status = r.status();
        let headers = r.headers().clone();
        let text = r.text().await.unwrap();
        let body = serde_json::from_str(&text).unwrap_or(Value::String(text));
        Resp { status, headers, body }
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    /// The problem type's slug (`/problems/<slug>`).
    pub fn problem(&self) -> &str {
        assert_eq!(self.header("content-type"), Some("application/problem+json"), "{self:?}");
        self.body["type"].as_str().unwrap().trim_start_matches("/problems/")
    }

    pub fn token(&self) -> i64 {
        self.body["fencing_token"].as_i64().unwrap()
    }
}

/// The record's events, without the request-specific fields.
pub fn event_kinds(record: &Value) -> Vec<String> {
    record["events"].as_array().unwrap().iter().map(|e| e["kind"].as_str().unwrap().to_string()).collect()
}

/// The provider double of `idem scenarios provider`, served in this test's runtime.
pub async fn start_provider() -> (idem::acceptance::provider::Provider, std::net::SocketAddr) {
    let provider = idem::acceptance::provider::Provider::new();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(provider.clone().serve(listener));
    (provider, addr)
}

/// A connector config for the provider double at `addr` (short timeouts for tests).
pub fn orders_config(addr: std::net::SocketAddr, extra_retry: &str) -> String {
    format!(
        "[executor]\npoll_interval_ms = 50\n[reconciler]\ninterval_ms = 100\n\n\
         [connectors.orders]\nkind = \"http\"\nurl = \"http://{addr}/orders\"\ntimeout_ms = 800\nconnect_timeout_ms = 500\n\
         provider_ref = {{ json_pointer = \"/id\" }}\n\
         lookup = {{ url = \"http://{addr}/orders?client_reference={{idempotency_key}}\", found_pointer = \"/0/id\", absent_after_ms = 300 }}\n\
         retry = {{ base_ms = 100, cap_ms = 400, max_attempts = 4{extra_retry} }}\n"
    )
}

/// Signs in to the admin page with `api_key` over HTTP; the session cookie
/// (`idem_session=…`) to send with page requests.
pub async fn ui_session(s: &Server, api_key: &str) -> String {
    let http = reqwest::Client::builder().redirect(reqwest::redirect::Policy::none()).build().unwrap();
    let cookie_of = |r: &reqwest::Response, name: &str| -> String {
        let set = r
            .headers()
            .get_all("set-cookie")
            .iter()
            .filter_map(|v| v.to_str().ok())
            .find(|v| v.starts_with(&format!("{name}=")))
            .unwrap_or_else(|| panic!("no {name} cookie"))
            .to_string();
        set.split(';').next().unwrap().to_string()
    };
    let login = cookie_of(&http.get(s.url("/ui/login")).send().await.unwrap(), "idem_login");
    let token = login.split_once('=').unwrap().1.to_string();
    let body = reqwest::Url::parse_with_params("http://x/", [("api_key", api_key), ("csrf", token.as_str())])
        .unwrap()
        .query()
        .unwrap()
        .to_string();
    let r = http
        .post(s.url("/ui/login"))
        .header("cookie", login)
        .header("content-type", "application/x-www-form-urlencoded")
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 303, "signed in");
    cookie_of(&r, "idem_session")
}

/// The sum of the samples of `name` in the Prometheus text `text` whose labels include all
/// of `labels`.
pub fn metric(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.rsplit_once(' '))
        .filter(|(series, _)| {
            let (n, rest) = series.split_once('{').unwrap_or((series, ""));
            n == name && labels.iter().all(|(k, v)| rest.contains(&format!("{k}=\"{v}\"")))
        })
        .map(|(_, v)| v.parse::<f64>().unwrap())
        .sum()
}

/// `GET /v1/workflows/{id}` as the admin: the instance with its steps, groups and events.
pub async fn instance(s: &Server, id: &str) -> Value {
    s.get(ADMIN_KEY, &format!("/v1/workflows/{}", enc(id))).await.body
}

/// Polls workflow instance `id` until `done` holds (at most `secs` seconds); returns it.
pub async fn wait_instance(s: &Server, id: &str, secs: u64, done: impl Fn(&Value) -> bool) -> Value {
    let start = std::time::Instant::now();
    loop {
        let v = instance(s, id).await;
        if done(&v) {
            return v;
        }
        assert!(start.elapsed() < Duration::from_secs(secs), "gave up waiting on instance {id}: {v:#}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Starts `idem serve` on `db_url` with `config` and `IDEM_TEST_CRASH_AT=crash_at`, starts
/// a workflow instance with `body` (201 expected), waits until the process aborted at its
/// crash point (at most 20 s), then starts `idem serve` again normally and returns it.
pub async fn crash_at_then_restart(db_url: &str, config: &str, crash_at: &str, body: &Value) -> Server {
    let crashing = Server::start_with_config_env(db_url, config, &[("IDEM_TEST_CRASH_AT", crash_at)]);
    let r = crashing.post(ADMIN_KEY, "/v1/workflows", body).await;
    assert_eq!(r.status, 201, "{crash_at}: {r:?}");
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while crashing.http.get(crashing.url("/healthz")).send().await.is_ok() {
        assert!(std::time::Instant::now() < deadline, "{crash_at}: the server never reached its crash point");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    drop(crashing);
    Server::start_with_config(db_url, config)
}
