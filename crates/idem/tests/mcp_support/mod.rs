//! Shared by the `idem mcp` tests: the official MCP Python SDK (scripts/requirements-mcp.txt,
//! installed by scripts/test.sh into `IDEM_MCP_VENV`) as the agent (tests/mcp/agent.py) and
//! as the downstream tool server (tests/mcp/tickets_server.py), which counts every ticket it
//! creates in an SQLite file, so effects are counted across processes.
#![allow(dead_code)] // each test file uses a different subset

use serde_json::Value;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub fn python() -> PathBuf {
    let venv = std::env::var("IDEM_MCP_VENV")
        .expect("IDEM_MCP_VENV (the venv of scripts/requirements-mcp.txt): run ./scripts/test.sh, which makes it");
    let bin = PathBuf::from(venv).join("bin/python");
    assert!(bin.exists(), "{} is missing: run ./scripts/test.sh", bin.display());
    bin
}

pub fn script(name: &str) -> String {
    format!("{}/tests/mcp/{name}", env!("CARGO_MANIFEST_DIR"))
}

pub fn idem_bin() -> String {
    env!("CARGO_BIN_EXE_idem").to_owned()
}

/// One test's files: the ledger (SQLite), the tickets file, the guard's config.
pub struct Env {
    pub dir: tempfile::TempDir,
    pub ledger: String,
    pub tickets: String,
    pub config: String,
}

/// The guard's config the tests share (`extra` is appended).
pub const CONFIG: &str = r#"
server = "tickets"
lookup_interval_ms = 200

[tools.create_ticket]
idempotency_key_argument = "request_id"
timeout_ms = 1500
wait_ms = 3000
lookup = { tool = "find_ticket", arguments = { request_id = "{idempotency_key}" }, evidence_pointer = "/structuredContent/id", absent_after_ms = 0 }
"#;

impl Env {
    pub fn new(config: &str) -> Env {
        let dir = tempfile::tempdir().unwrap();
        let p = |n: &str| dir.path().join(n).to_str().unwrap().to_owned();
        let (ledger, tickets, config_path) = (p("ledger.db"), p("tickets.db"), p("guard.toml"));
        std::fs::write(&config_path, config).unwrap();
        Env { ledger: format!("sqlite://{ledger}"), tickets, config: config_path, dir }
    }

    /// `idem mcp` arguments: this env's ledger and config, `extra`, then the tickets server
    /// in `mode` after `--`.
    pub fn guard_args(&self, extra: &[&str], mode: &str) -> Vec<String> {
        let mut a: Vec<String> =
            ["mcp", "--database-url", &self.ledger, "--config", &self.config].iter().map(|s| s.to_string()).collect();
        a.extend(extra.iter().map(|s| s.to_string()));
        a.push("--".into());
        a.push(python().to_str().unwrap().to_owned());
        a.extend([script("tickets_server.py"), "--db".into(), self.tickets.clone(), "--mode".into(), mode.into()]);
        a
    }

    /// Runs the agent with `steps` against a guard it starts over stdio with `guard_args`;
    /// one JSON value per answer.
    pub fn agent_stdio(&self, steps: &Value, guard_args: &[String]) -> Vec<Value> {
        let mut cmd = Command::new(python());
        cmd.arg(script("agent.py")).arg(steps.to_string()).arg("--stdio").arg(idem_bin()).args(guard_args);
        run_agent(cmd)
    }

    /// The agent against the tickets server itself, without the guard.
    pub fn agent_direct(&self, steps: &Value) -> Vec<Value> {
        let mut cmd = Command::new(python());
        cmd.arg(script("agent.py")).arg(steps.to_string()).arg("--stdio").arg(python());
        cmd.args([script("tickets_server.py"), "--db".into(), self.tickets.clone()]);
        run_agent(cmd)
    }

    /// The agent against a guard (or server) at `url`.
    pub fn agent_http(&self, steps: &Value, url: &str) -> Vec<Value> {
        let mut cmd = Command::new(python());
        cmd.arg(script("agent.py")).arg(steps.to_string()).arg("--url").arg(url);
        run_agent(cmd)
    }

    /// Tickets the server created (rows in its file; 0 before the server made it).
    pub fn tickets(&self) -> i64 {
        if self.query(&self.tickets, "SELECT count(*) FROM sqlite_master WHERE name = 'tickets'") == "0" {
            return 0;
        }
        self.query(&self.tickets, "SELECT count(*) FROM tickets").parse().unwrap()
    }

    /// One value from an SQLite file (through Python's sqlite3: no second SQLite in Rust).
    pub fn query(&self, file: &str, sql: &str) -> String {
        let code =
            format!("import sqlite3,sys\nc=sqlite3.connect(sys.argv[1])\nprint(c.execute(sys.argv[2]).fetchone()[0])");
        let out = Command::new(python()).args(["-c", &code, file, sql]).output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap().trim().to_owned()
    }

    /// A value of the ledger (the operations table of the store the guard wrote).
    pub fn ledger(&self, sql: &str) -> String {
        self.query(self.ledger.strip_prefix("sqlite://").unwrap(), sql)
    }

    /// Starts `idem mcp` serving the host over Streamable HTTP on a free port.
    pub fn guard_http(&self, extra: &[&str], mode: &str) -> (Killed, String) {
        let port = free_port();
        let listen = format!("127.0.0.1:{port}");
        let mut args = vec!["--listen", listen.as_str()];
        args.extend_from_slice(extra);
        let child = Command::new(idem_bin())
            .args(self.guard_args(&args, mode))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        wait_port(port);
        (Killed(child), format!("http://127.0.0.1:{port}/mcp"))
    }
}

/// A child process killed (SIGKILL) when dropped, also when a test fails.
pub struct Killed(pub Child);

impl Killed {
    /// kill -9 now.
    pub fn kill9(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Drop for Killed {
    fn drop(&mut self) {
        self.kill9();
    }
}

fn run_agent(mut cmd: Command) -> Vec<Value> {
    let out = cmd.stderr(Stdio::inherit()).output().unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(out.status.success(), "the agent failed ({}): {text}", out.status);
    text.lines().map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}"))).collect()
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

pub fn wait_port(port: u16) {
    let start = Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(start.elapsed() < Duration::from_secs(30), "nothing listens on {port}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The first text block of a result.
pub fn text(r: &Value) -> &str {
    r["content"][0]["text"].as_str().unwrap_or_else(|| panic!("no text in {r}"))
}

/// Whether a result is the server's own answer (no `idem:` line, no `io.idem/` _meta).
pub fn from_server(r: &Value) -> bool {
    !text(r).starts_with("idem:") && r.get("_meta").is_none_or(|m| !m.to_string().contains("io.idem/"))
}

pub fn task(id: &str) -> Value {
    serde_json::json!({"io.idem/task-id": id})
}
