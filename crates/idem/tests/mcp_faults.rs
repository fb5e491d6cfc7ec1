//! `idem mcp` when things break: the guard killed with SIGKILL mid-call, a server that
//! crashes at start-up or answers garbage, malformed JSON-RPC from the host — and the guard
//! over Streamable HTTP on both sides. Effects counted at the tool server (official MCP
//! Python SDK), as in tests/mcp.rs.

mod common;
mod mcp_support;

use mcp_support::{Env, from_server, task, text};
use serde_json::{Value, json};
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// No lookup tool: an unknown call goes to the review queue.
const NO_LOOKUP: &str = r#"
server = "tickets"
lookup_interval_ms = 200
[tools.create_ticket]
timeout_ms = 1000
lease_ms = 2000
wait_ms = 0
"#;

fn wait_until(what: &str, secs: u64, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(start.elapsed() < Duration::from_secs(secs), "gave up waiting: {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The guard (serving the agent over Streamable HTTP) is killed with SIGKILL while the
/// server works on a call it has already acted on; a new guard with the same task: its
/// lease ends into UNKNOWN and the repeat is told the outcome is unknown — not sent again,
/// one ticket — and the call waits in the review queue, which `idem serve` on the same
/// ledger shows. The guard's counters are at `--metrics-listen`.
#[test]
fn a_guard_killed_mid_call_leaves_an_unknown_call_never_a_second_one() {
    let env = Env::new(NO_LOOKUP);
    let (mut guard, url) = env.guard_http(&[], "normal");
    let call = json!({"call": "create_ticket", "args": {"customer": "c-8", "title": "hang up"}, "meta": task("task-8"), "timeout_s": 30});
    let agent = std::thread::scope(|s| {
        let agent = s.spawn(|| env.agent_http(&json!([call]), &url));
        wait_until("the server acted", 30, || env.tickets() == 1);
        guard.kill9();
        agent.join().unwrap()
    });
    assert!(agent[0].get("error").is_some(), "the agent lost its connection: {agent:?}");
    let mport = mcp_support::free_port();
    let metrics = format!("127.0.0.1:{mport}");
    let (mut guard, url) = env.guard_http(&["--metrics-listen", &metrics], "normal");
    let started = Instant::now();
    let first = env.agent_http(&json!([call]), &url);
    if started.elapsed() < Duration::from_millis(1500) && text(&first[0]).contains("in progress") {
        // Still within the dead guard's lease: in progress, not sent.
        std::thread::sleep(Duration::from_millis(2100));
    }
    let out = env.agent_http(&json!([call]), &url);
    let op = out[0]["_meta"]["io.idem/operation"].as_str().unwrap();
    let at = idem_mcp::texts::rfc3339(env.ledger("SELECT created_at FROM operations").parse().unwrap());
    assert!(
        text(&out[0]).starts_with(&format!(
            "idem: outcome unknown: an identical call was first made at {at} and its outcome is unknown (the guard stopped before the server answered) (operation {op})."
        )),
        "{}",
        out[0]
    );
    assert_eq!(env.tickets(), 1, "never sent again");
    wait_until("flagged for review", 10, || env.ledger("SELECT needs_review FROM operations") == "1");
    let rt = tokio::runtime::Runtime::new().unwrap();
    let scraped =
        rt.block_on(async { reqwest::get(format!("http://{metrics}/metrics")).await.unwrap().text().await.unwrap() });
    assert!(scraped.contains("idem_mcp_calls_total{tool=\"create_ticket\",decision=\"unknown\"}"), "{scraped}");
    guard.kill9();
    // An operator's view: the same ledger under idem serve.
    rt.block_on(async {
        let server = common::Server::start(&env.ledger);
        let r = server.get(common::ADMIN_KEY, "/v1/operations?needs_review=true").await;
        assert!(r.body.to_string().contains(op), "{}", r.body);
        let r = server.get(common::ADMIN_KEY, &format!("/v1/operations/{}", common::enc(op))).await;
        assert_eq!((r.body["state"].clone(), r.body["action"].clone()), (json!("UNKNOWN"), json!("mcp:create_ticket")));
    });
}

/// A server that crashes during start-up: the guard serves anyway; a guarded call is told
/// the server is not running, nothing recorded or sent, and the next call is told the
/// same (the guard tried again).
#[test]
fn a_server_that_crashes_at_start_is_a_clear_error_and_nothing_is_recorded() {
    let env = Env::new(NO_LOOKUP);
    let call = json!({"call": "create_ticket", "args": {"customer": "c-9", "title": "x"}, "meta": task("task-9")});
    let out = env.agent_stdio(&json!([call, {"list_tools": true}, call]), &env.guard_args(&[], "crash-on-start"));
    for r in [&out[0], &out[2]] {
        assert!(
            text(r).starts_with(
                "idem: not performed: the tool server is not running (it did not complete the MCP handshake"
            ),
            "{r}"
        );
        assert!(text(r).ends_with("Nothing was sent."), "{r}");
    }
    assert!(out[1]["error"].as_str().unwrap().contains("the tool server is not running"), "{}", out[1]);
    assert_eq!(env.tickets(), 0);
    assert_eq!(env.ledger("SELECT count(*) FROM operations"), "0");
}

/// A server that acts and then answers with something that is not a tool result (and a
/// line that is not JSON): the outcome is unknown — never "succeeded" — and in review;
/// the repeat is told the same; one ticket.
#[test]
fn a_server_answering_garbage_is_unknown_never_succeeded() {
    let env = Env::new(NO_LOOKUP);
    let call =
        json!({"call": "create_ticket", "args": {"customer": "c-10", "title": "garbage"}, "meta": task("task-10")});
    let out = env.agent_stdio(&json!([call, call]), &env.guard_args(&[], "garbage"));
    assert!(text(&out[0]).starts_with("idem: outcome unknown: "), "{}", out[0]);
    assert!(
        text(&out[0]).contains("an operator settles it in idem's review queue (idem ops list --needs-review)"),
        "{}",
        out[0]
    );
    assert!(text(&out[1]).starts_with("idem: outcome unknown: an identical call was first made at"), "{}", out[1]);
    assert_eq!(env.tickets(), 1);
    assert_eq!(env.ledger("SELECT state || ' ' || needs_review FROM operations"), "UNKNOWN 1");
}

/// Malformed JSON-RPC from the host (a line that is not JSON, a tools/call whose name is
/// not a string): an error or nothing, and the guard keeps serving the next request.
#[test]
fn malformed_json_rpc_from_the_host_does_not_stop_the_guard() {
    let env = Env::new(NO_LOOKUP);
    let mut child = Command::new(mcp_support::idem_bin())
        .args(env.guard_args(&["--task-id", "task-11"], "normal"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel::<Value>();
    let stdout = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            let _ = tx.send(serde_json::from_str(&line).unwrap_or(Value::String(line)));
        }
    });
    let mut send = |s: &str| writeln!(stdin, "{s}").unwrap();
    let answer = |id: i64| loop {
        let v = rx.recv_timeout(Duration::from_secs(20)).expect("an answer");
        if v["id"] == id {
            return v;
        }
    };
    // JSON-RPC 2.0 §5.1: a line that is not JSON, or nested past serde_json's 128 levels, is
    // answered -32700 with id null (rmcp alone skipped it and the host waited).
    let parse_error = || loop {
        let v = rx.recv_timeout(Duration::from_secs(20)).expect("an answer");
        if v["id"].is_null() {
            return v["error"]["code"].as_i64();
        }
    };
    send("this is not json");
    assert_eq!(parse_error(), Some(-32700));
    send(&format!("{}{}", "[".repeat(300), "]".repeat(300)));
    assert_eq!(parse_error(), Some(-32700));
    send(
        r#"{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-06-18","capabilities":{},"clientInfo":{"name":"raw","version":"0"}}}"#,
    );
    assert_eq!(answer(1)["result"]["serverInfo"]["name"], "tickets");
    send(r#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#);
    send(r#"{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":7}}"#);
    assert!(answer(2).get("error").is_some());
    // Arguments that are not an object: invalid params (-32602), not "method not found".
    send(r#"{"jsonrpc":"2.0","id":4,"method":"tools/call","params":{"name":"create_ticket","arguments":["c-11"]}}"#);
    assert_eq!(answer(4)["error"]["code"], -32602);
    // A task id in _meta that is not a string is refused, never replaced by the process's.
    send(
        r#"{"jsonrpc":"2.0","id":5,"method":"tools/call","params":{"name":"create_ticket","arguments":{"customer":"c-11","title":"t"},"_meta":{"io.idem/task-id":true}}}"#,
    );
    let refused = answer(5);
    assert!(
        refused["result"]["content"][0]["text"].as_str().is_some_and(|t| t.starts_with(
            r#"idem: not performed: the task id in _meta ("io.idem/task-id") must be a string; got true"#
        )),
        "{refused}"
    );
    send(
        r#"{"jsonrpc":"2.0","id":3,"method":"tools/call","params":{"name":"create_ticket","arguments":{"customer":"c-11","title":"ok"}}}"#,
    );
    assert_eq!(answer(3)["result"]["structuredContent"], json!({"id": "T-1"}));
    drop(send);
    drop(stdin);
    child.wait().unwrap();
    assert_eq!(env.tickets(), 1);
}

/// The real server over Streamable HTTP (`--server-url`): the same call twice is one
/// ticket, the second a replay.
#[test]
fn a_streamable_http_server_behind_the_guard() {
    let env = Env::new(NO_LOOKUP);
    let port = mcp_support::free_port();
    let mut server = mcp_support::Killed(
        Command::new(mcp_support::python())
            .args([mcp_support::script("tickets_server.py"), "--db".into(), env.tickets.clone()])
            .args(["--transport", "http", "--port", &port.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    mcp_support::wait_port(port);
    let mut args = env.guard_args(&["--server-url", &format!("http://127.0.0.1:{port}/mcp")], "normal");
    let dashes = args.iter().position(|a| a == "--").unwrap();
    args.truncate(dashes);
    let call = json!({"call": "create_ticket", "args": {"customer": "c-12", "title": "http"}, "meta": task("task-12")});
    let out = env.agent_stdio(&json!([call, call]), &args);
    server.kill9();
    assert!(from_server(&out[0]), "{}", out[0]);
    assert!(text(&out[1]).starts_with("idem: already done at "), "{}", out[1]);
    assert_eq!(env.tickets(), 1);
}

/// A Streamable HTTP server that is down refuses the connection: a new call is "not
/// performed … Nothing was sent" (never UNKNOWN, no Rust internals), and once the server is
/// back the same guard starts a new session and sends it. The call that killed the server
/// stays unknown. One ticket per intent.
#[test]
fn a_streamable_http_server_that_is_down_gets_nothing_sent_and_is_reached_again() {
    let env = Env::new(NO_LOOKUP);
    let port = mcp_support::free_port();
    let start = || {
        let child = Command::new(mcp_support::python())
            .args([mcp_support::script("tickets_server.py"), "--db".into(), env.tickets.clone()])
            .args(["--transport", "http", "--port", &port.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        mcp_support::Killed(child)
    };
    let first = start();
    mcp_support::wait_port(port);
    let mut args = env.guard_args(&["--server-url", &format!("http://127.0.0.1:{port}/mcp")], "normal");
    let dashes = args.iter().position(|a| a == "--").unwrap();
    args.truncate(dashes);
    let t = task("task-16");
    let crash = json!({"call": "create_ticket", "args": {"customer": "c-16", "title": "crash now"}, "meta": t});
    let next = json!({"call": "create_ticket", "args": {"customer": "c-16", "title": "after the crash"}, "meta": t});
    let steps = json!([crash, {"sleep_s": 1}, next, {"sleep_s": 6}, next]);
    let out = std::thread::scope(|s| {
        let restarted = s.spawn(|| {
            // The server exits inside the first call; it comes back while the agent sleeps.
            let mut first = first;
            let _ = first.0.wait();
            std::thread::sleep(Duration::from_secs(3));
            let again = start();
            mcp_support::wait_port(port);
            again
        });
        let out = env.agent_stdio(&steps, &args);
        drop(restarted.join().unwrap());
        out
    });
    assert!(text(&out[0]).starts_with("idem: outcome unknown: "), "{}", out[0]);
    assert_eq!(
        text(&out[1]),
        "idem: not performed: the call could not be sent to the tool server (no connection could be made to its URL: it is not running); nothing happened, so the same call may be made again.",
        "{}",
        out[1]
    );
    assert!(from_server(&out[2]), "the same call once the server is back is sent: {}", out[2]);
    assert_eq!(env.tickets(), 2, "the crashed call's ticket and the one sent after the restart");
}

/// Two guards (two agents, one task) on a shared PostgreSQL ledger: one ticket, the other
/// agent gets the replay.
#[test]
fn two_guards_on_one_postgresql_ledger_make_one_ticket() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let db = rt.block_on(common::Db::new(common::Backend::Postgres));
    let mut env = Env::new(mcp_support::CONFIG);
    env.ledger = db.url.clone();
    let steps =
        json!([{"call": "create_ticket", "args": {"customer": "c-13", "title": "slow pg"}, "meta": task("task-13")}]);
    let args = env.guard_args(&[], "normal");
    let (a, b) = std::thread::scope(|s| {
        let a = s.spawn(|| env.agent_stdio(&steps, &args));
        let b = s.spawn(|| env.agent_stdio(&steps, &args));
        (a.join().unwrap(), b.join().unwrap())
    });
    assert_eq!(env.tickets(), 1, "{a:?} {b:?}");
    assert_eq!([&a[0], &b[0]].iter().filter(|r| from_server(r)).count(), 1, "{a:?} {b:?}");
    rt.block_on(async move { drop(db) });
}

/// The server dies right after acting (the stream drops after sending): the outcome is
/// unknown and the repeat is not sent again; the guard starts the server again for the
/// next call, which is performed. One ticket per intent.
#[test]
fn a_server_that_dies_mid_call_is_unknown_and_started_again_for_the_next_call() {
    let env = Env::new(NO_LOOKUP);
    let t = task("task-15");
    let crash = json!({"call": "create_ticket", "args": {"customer": "c-15", "title": "crash now"}, "meta": t});
    let next = json!({"call": "create_ticket", "args": {"customer": "c-15", "title": "after the crash"}, "meta": t});
    let out = env.agent_stdio(&json!([crash, crash, next]), &env.guard_args(&[], "normal"));
    let op = out[0]["_meta"]["io.idem/operation"].as_str().unwrap();
    assert!(
        text(&out[0]).starts_with(&format!(
            "idem: outcome unknown: the connection to the server ended before its answer (operation {op})."
        )),
        "{}",
        out[0]
    );
    assert!(text(&out[1]).starts_with("idem: outcome unknown: an identical call was first made at"), "{}", out[1]);
    assert!(from_server(&out[2]), "{}", out[2]);
    assert_eq!(env.tickets(), 2);
}
