//! Test support: run the real `idem serve` binary on loopback and talk to it over HTTP.
#![allow(dead_code)] // each test file uses a different subset

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
                Db {
                    url,
                    _dir: Some(dir),
                }
            }
            Backend::Postgres => Db {
                url: idem_store::testing::fresh_pg_database("idem_http").await,
                _dir: None,
            },
        }
    }
}

/// A running `idem serve` process; killed (SIGKILL) when dropped.
pub struct Server {
    child: Child,
    pub base: String,
    pub http: reqwest::Client,
    pub db_url: String,
}

pub fn idem_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_idem"))
}

impl Server {
    /// Starts a server on a free loopback port and waits until it listens (at most 30 s).
    pub fn start(db_url: &str) -> Server {
        let mut child = Command::new(idem_bin())
            .args([
                "serve",
                "--listen",
                "127.0.0.1:0",
                "--sweep-interval-ms",
                "50",
                "--database-url",
                db_url,
            ])
            .env("IDEM_BOOTSTRAP_KEY", ADMIN_KEY)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn idem serve");
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Some(addr) = line.strip_prefix("idem: listening on ") {
                    let _ = tx.send(addr.to_string());
                }
            }
        });
        let base = rx
            .recv_timeout(Duration::from_secs(30))
            .expect("idem serve did not start within 30 s");
        Server {
            child,
            base,
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(30))
                .build()
                .unwrap(),
            db_url: db_url.to_string(),
        }
    }

    /// kill -9: no shutdown hook runs.
    pub fn kill9(mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// Creates an API key with the CLI against the server's database; returns the secret.
    pub fn create_key(&self, tenant: &str, role: &str) -> String {
        let out = Command::new(idem_bin())
            .args([
                "keys",
                "create",
                "--tenant",
                tenant,
                "--role",
                role,
                "--database-url",
                &self.db_url,
            ])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "keys create failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let secret = String::from_utf8(out.stdout).unwrap().trim().to_string();
        assert!(
            secret.starts_with("idem_") && !secret.contains('\n'),
            "stdout holds only the key: {secret:?}"
        );
        secret
    }

    pub async fn post(&self, api_key: &str, path: &str, body: &Value) -> Resp {
        let r = self
            .http
            .post(self.url(path))
            .bearer_auth(api_key)
            .json(body)
            .send()
            .await
            .unwrap();
        Resp::read(r).await
    }

    pub async fn get(&self, api_key: &str, path: &str) -> Resp {
        let r = self
            .http
            .get(self.url(path))
            .bearer_auth(api_key)
            .send()
            .await
            .unwrap();
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
        self.post(
            ADMIN_KEY,
            &format!("/v1/operations/{}/complete", enc(key)),
            &body,
        )
        .await
    }

    /// `GET /v1/operations/{key}` with the admin key.
    pub async fn record(&self, key: &str) -> Resp {
        self.get(ADMIN_KEY, &format!("/v1/operations/{}", enc(key)))
            .await
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
    async fn read(r: reqwest::Response) -> Resp {
        let status = r.status();
        let headers = r.headers().clone();
        let text = r.text().await.unwrap();
        let body = serde_json::from_str(&text).unwrap_or(Value::String(text));
        Resp {
            status,
            headers,
            body,
        }
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    /// The problem type's slug (`/problems/<slug>`).
    pub fn problem(&self) -> &str {
        assert_eq!(
            self.header("content-type"),
            Some("application/problem+json"),
            "{self:?}"
        );
        self.body["type"]
            .as_str()
            .unwrap()
            .trim_start_matches("/problems/")
    }

    pub fn token(&self) -> i64 {
        self.body["fencing_token"].as_i64().unwrap()
    }
}

/// The record's events, without the request-specific fields.
pub fn event_kinds(record: &Value) -> Vec<String> {
    record["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["kind"].as_str().unwrap().to_string())
        .collect()
}
