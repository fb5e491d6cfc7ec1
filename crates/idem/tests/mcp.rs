//! `idem mcp` with MCP software nobody here wrote: the official MCP Python SDK's
//! `ClientSession` as the agent (over stdio: it starts the guard as its server, as a host
//! does) and a tool server written with the SDK that counts the tickets it creates in a
//! file. Every case counts effects at that server: exactly one per intent.

mod mcp_support;

use mcp_support::{CONFIG, Env, from_server, task, text};
use serde_json::json;

/// The same call twice, then 50 more: one ticket; the first answer is the server's own,
/// every repeat the recorded result after one `idem:` line, with `_meta` io.idem/replayed.
/// A read-only tool passes through and is never recorded; lists, resources, prompts and the
/// server's progress notifications pass through unchanged.
#[test]
fn the_same_call_again_and_fifty_times_is_one_ticket() {
    let env = Env::new(CONFIG);
    let call =
        json!({"call": "create_ticket", "args": {"customer": "c-1", "title": "printer jam"}, "meta": task("task-1")});
    let mut with_progress = call.clone();
    with_progress["progress"] = json!(true);
    let mut steps = vec![with_progress, call.clone()];
    let mut fifty = call.clone();
    fifty["repeat"] = json!(50);
    steps.push(fifty);
    steps.push(json!({"call": "count_tickets", "meta": task("task-1")}));
    steps.push(json!({"list_tools": true}));
    steps.push(json!({"read_resource": "tickets://count"}));
    steps.push(json!({"get_prompt": "ticket_prompt", "args": {"customer": "c-1"}}));
    let out = env.agent_stdio(&json!(steps), &env.guard_args(&[], "normal"));
    assert_eq!(out.len(), 56, "{out:?}");
    let first = &out[0];
    assert!(from_server(first), "the first answer is the server's, unchanged: {first}");
    assert_eq!(first["structuredContent"], json!({"id": "T-1"}));
    assert_eq!(first["progress"], json!([[1.0, 2.0, "creating"]]), "the server's progress reaches the agent");
    let op = out[1]["_meta"]["io.idem/operation"].as_str().unwrap().to_owned();
    assert!(op.starts_with("mcp:tickets:task-1:create_ticket:"), "{op}");
    for r in &out[1..52] {
        let at = r["_meta"]["io.idem/at"].as_str().unwrap();
        assert_eq!(
            text(r),
            format!(
                "idem: already done at {at} (operation {op}); this is its recorded result, the tool was not called again."
            )
        );
        assert_eq!(r["_meta"]["io.idem/replayed"], true);
        assert_eq!(r["_meta"]["io.idem/state"], "SUCCEEDED");
        assert_eq!(r["isError"], false);
        assert_eq!(r["structuredContent"], first["structuredContent"], "the recorded result follows the line");
        assert_eq!(r["content"][1], first["content"][0]);
    }
    assert_eq!(env.tickets(), 1, "one intent, one effect");
    // The read-only tool passed through: the server's own answer, no operation recorded.
    assert!(from_server(&out[52]) && out[52]["structuredContent"]["result"] == 1, "{}", out[52]);
    assert_eq!(env.ledger("SELECT count(*) FROM operations"), "1");
    assert_eq!(env.ledger("SELECT count(*) FROM operations WHERE op_key LIKE '%count_tickets%'"), "0");
    assert_eq!(env.ledger("SELECT state FROM operations"), "SUCCEEDED");
    // Lists, resources and prompts: what the server itself answers.
    let direct = env.agent_direct(&json!([
        {"list_tools": true}, {"read_resource": "tickets://count"}, {"get_prompt": "ticket_prompt", "args": {"customer": "c-1"}}
    ]));
    let tools = |v: &serde_json::Value| v["tools"].clone();
    assert_eq!(tools(&out[53]), tools(&direct[0]), "tools/list passes through unchanged");
    assert_eq!(out[54]["contents"], direct[1]["contents"]);
    assert_eq!(out[55]["messages"], direct[2]["messages"]);
}

/// Two agent processes, each with its own guard and its own server process, one ledger and
/// one task, make the same call at the same moment: one ticket; one agent gets the
/// server's answer, the other (which waited for it) the replay.
#[test]
fn two_agents_with_one_task_at_once_make_one_ticket() {
    let env = Env::new(CONFIG);
    let steps = json!([{"call": "create_ticket", "args": {"customer": "c-2", "title": "slow printer"}, "meta": task("task-2")}]);
    let args = env.guard_args(&[], "normal");
    let (a, b) = std::thread::scope(|s| {
        let a = s.spawn(|| env.agent_stdio(&steps, &args));
        let b = s.spawn(|| env.agent_stdio(&steps, &args));
        (a.join().unwrap(), b.join().unwrap())
    });
    let answers = [&a[0], &b[0]];
    assert_eq!(env.tickets(), 1, "{answers:?}");
    assert_eq!(answers.iter().filter(|r| from_server(r)).count(), 1, "{answers:?}");
    let replay = answers.iter().find(|r| !from_server(r)).unwrap();
    assert!(text(replay).starts_with("idem: already done at "), "{replay}");
    assert_eq!(replay["structuredContent"], json!({"id": "T-1"}));
}

/// The server creates the ticket and then hangs past the timeout: the outcome is unknown —
/// said so, also to the repeat, and never sent again — until the lookup tool finds the
/// ticket; then the repeat gets "already done" with the lookup's evidence. One ticket.
#[test]
fn a_call_that_hangs_after_acting_is_unknown_until_the_lookup_finds_it() {
    let env = Env::new(CONFIG);
    let call =
        json!({"call": "create_ticket", "args": {"customer": "c-3", "title": "hang on"}, "meta": task("task-3")});
    let out = env.agent_stdio(&json!([call, call, {"sleep_s": 1.5}, call]), &env.guard_args(&[], "normal"));
    let op = out[0]["_meta"]["io.idem/operation"].as_str().unwrap();
    assert_eq!(
        text(&out[0]),
        format!(
            "idem: outcome unknown: the server did not answer within 1500 ms (operation {op}). The call may or may not have taken effect. It will not be performed again automatically; idem asks the tool find_ticket what became of it and records what it finds, or an operator settles it in idem's review queue. Until then every repeat of this call gets this answer."
        )
    );
    assert_eq!(
        (out[0]["isError"].clone(), out[0]["_meta"]["io.idem/decision"].clone()),
        (json!(true), json!("outcome_unknown"))
    );
    // The guard asks the lookup tool at once, so the repeat may already find it settled;
    // until then it is told the outcome is unknown (tests/mcp_faults.rs shows that answer
    // for calls without a lookup).
    let first_at = env.ledger("SELECT created_at FROM operations");
    let at = idem_mcp::texts::rfc3339(first_at.parse().unwrap());
    let unknown_repeat = format!(
        "idem: outcome unknown: an identical call was first made at {at} and its outcome is unknown (the server did not answer within 1500 ms) (operation {op})."
    );
    assert!(
        text(&out[1]).starts_with(&unknown_repeat)
            || text(&out[1]).starts_with("idem: already done: the lookup tool found it"),
        "{}",
        out[1]
    );
    let settled_at = out[2]["_meta"]["io.idem/at"].as_str().unwrap();
    assert_eq!(
        text(&out[2]),
        format!(
            "idem: already done: the lookup tool found it at {settled_at} (evidence T-1, operation {op}); the first answer was lost, so there is no recorded result. The tool was not called again."
        )
    );
    assert_eq!(env.tickets(), 1);
    assert_eq!(
        env.ledger("SELECT state || ' ' || evidence_source || ' ' || provider_ref FROM operations"),
        "SUCCEEDED lookup T-1"
    );
    // The guard filled the idempotency-key argument with the operation key: the lookup
    // found the ticket by it.
    assert_eq!(env.query(&env.tickets, "SELECT request_id FROM tickets"), op);
}

/// The same intent (configured: the customer) with another title: refused, naming the
/// argument that differs; nothing sent. One ticket.
#[test]
fn the_same_intent_with_other_arguments_is_refused_naming_them() {
    let env = Env::new(&format!("{CONFIG}intent = [\"customer\"]\n"));
    let a = json!({"call": "create_ticket", "args": {"customer": "c-4", "title": "first"}, "meta": task("task-4")});
    let b = json!({"call": "create_ticket", "args": {"customer": "c-4", "title": "second"}, "meta": task("task-4")});
    let out = env.agent_stdio(&json!([a, b]), &env.guard_args(&[], "normal"));
    assert!(from_server(&out[0]));
    let op = out[1]["_meta"]["io.idem/operation"].as_str().unwrap();
    assert_eq!(
        text(&out[1]),
        format!(
            "idem: not performed: this task already made this call with other arguments (operation {op}; differing: title). One intent, one effect: call it with the first arguments to get that call's result, or, if a second effect is really wanted, make it a new intent (other values of customer)."
        )
    );
    assert_eq!(
        (out[1]["isError"].clone(), out[1]["_meta"]["io.idem/decision"].clone()),
        (json!(true), json!("mismatch"))
    );
    assert_eq!(env.tickets(), 1);
}

/// Everything stops and starts again: the same task id (flag) replays; a new process under
/// --task-per-process is a new task (its own ticket); without any task id a guarded call
/// is refused with how to set one, and nothing happens.
#[test]
fn a_restart_with_the_same_task_replays_and_no_task_id_is_never_a_replay() {
    let env = Env::new(CONFIG);
    let call = json!([{"call": "create_ticket", "args": {"customer": "c-5", "title": "restart"}}]);
    let first = env.agent_stdio(&call, &env.guard_args(&["--task-id", "task-5"], "normal"));
    let again = env.agent_stdio(&call, &env.guard_args(&["--task-id", "task-5"], "normal"));
    assert!(from_server(&first[0]));
    assert!(text(&again[0]).starts_with("idem: already done at "), "{}", again[0]);
    assert_eq!(env.tickets(), 1);
    let p1 = env.agent_stdio(&call, &env.guard_args(&["--task-per-process"], "normal"));
    let p2 = env.agent_stdio(&call, &env.guard_args(&["--task-per-process"], "normal"));
    assert!(from_server(&p1[0]) && from_server(&p2[0]), "each start is a new task");
    assert_eq!(env.tickets(), 3);
    let none = env.agent_stdio(&call, &env.guard_args(&[], "normal"));
    assert_eq!(text(&none[0]), idem_mcp::texts::NO_TASK_ID);
    assert_eq!(none[0]["isError"], true);
    assert_eq!(env.tickets(), 3, "refused before anything was sent");
    // A per-call task id wins over the process's.
    let mut per_call = call.clone();
    per_call[0]["meta"] = task("task-5");
    let other_process_task = env.agent_stdio(&per_call, &env.guard_args(&["--task-id", "task-6"], "normal"));
    assert!(text(&other_process_task[0]).starts_with("idem: already done at "), "{}", other_process_task[0]);
    assert_eq!(env.tickets(), 3);
}

/// Bad input from the agent: an unknown tool, arguments the inputSchema refuses, oversized
/// arguments — each a tool error naming the problem, nothing recorded or sent — and the
/// guard keeps serving: the next good call is performed once.
#[test]
fn bad_calls_from_the_agent_are_refused_and_the_guard_keeps_serving() {
    let env = Env::new(&format!("{CONFIG}max_argument_bytes = 2000\n"));
    let t = task("task-7");
    let steps = json!([
        {"call": "delete_everything", "args": {}, "meta": t},
        {"call": "create_ticket", "args": {"customer": 5}, "meta": t},
        {"call": "create_ticket", "args": {"customer": "c-7", "title": "big", "body": "x".repeat(5000)}, "meta": t},
        {"call": "create_ticket", "args": {"customer": "c-7", "title": "fine"}, "meta": t},
    ]);
    let out = env.agent_stdio(&steps, &env.guard_args(&[], "normal"));
    assert_eq!(
        text(&out[0]),
        "idem: not performed: the server has no tool named \"delete_everything\" (its tools: count_tickets, create_ticket, find_ticket). Nothing was sent."
    );
    assert_eq!(
        text(&out[1]),
        "idem: not performed: the arguments do not match the tool's inputSchema (\"title\" is a required property; /customer: 5 is not of type \"string\"); correct them and call again. Nothing was sent."
    );
    assert!(
        text(&out[2]).starts_with("idem: not performed: the arguments have 5")
            && text(&out[2]).ends_with("this tool takes at most 2000. Nothing was sent."),
        "{}",
        out[2]
    );
    for r in &out[..3] {
        assert_eq!((r["isError"].clone(), r["_meta"]["io.idem/decision"].clone()), (json!(true), json!("refused")));
    }
    assert!(from_server(&out[3]), "{}", out[3]);
    assert_eq!(env.tickets(), 1);
    assert_eq!(env.ledger("SELECT count(*) FROM operations"), "1", "refused calls are never recorded");
}

/// `--task-per-process` over `--listen` would join every agent that connects into one task
/// (a second agent's legitimate call answered with the first one's result): refused at
/// start with one line, before anything is opened or started.
#[test]
fn task_per_process_over_listen_is_refused() {
    let out = std::process::Command::new(mcp_support::idem_bin())
        .args(["mcp", "--listen", "127.0.0.1:0", "--task-per-process", "--database-url", "sqlite::memory:"])
        .args(["--", "/nonexistent/server"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--task-per-process with --listen would make every agent that connects one task"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
}

/// `idem mcp --help` states the design a user must know: which calls are guarded, the task
/// id and its refusal without one, what the agent is told, the ledger, the host config.
#[test]
fn the_help_states_what_is_guarded_the_task_id_and_the_answers() {
    let out = std::process::Command::new(mcp_support::idem_bin()).args(["mcp", "--help"]).output().unwrap();
    let help = String::from_utf8(out.stdout).unwrap();
    for needle in [
        "readOnlyHint is not true",
        "\"io.idem/task-id\"",
        "--task-per-process",
        "a guarded call is refused",
        "idem: already done at",
        "io.idem/replayed: true",
        "idem: outcome unknown",
        "principal idem-mcp",
        "idem_mcp_calls_total{tool,decision}",
        "\"mcpServers\"",
    ] {
        assert!(help.contains(needle), "--help lacks {needle:?}:\n{help}");
    }
}

/// `idem mcp-ops`, idem's own read-only MCP server: the agent asks what became of a
/// guarded call by the operation key the guard gave it.
#[test]
fn the_ops_server_tells_the_agent_what_became_of_an_operation() {
    let env = Env::new(CONFIG);
    let call =
        json!({"call": "create_ticket", "args": {"customer": "c-14", "title": "asked about"}, "meta": task("task-14")});
    let out = env.agent_stdio(&json!([call, call]), &env.guard_args(&[], "normal"));
    let op = out[1]["_meta"]["io.idem/operation"].as_str().unwrap();
    let ops = ["mcp-ops".to_owned(), "--database-url".to_owned(), env.ledger.clone()];
    let steps = json!([
        {"list_tools": true},
        {"call": "get_operation", "args": {"key": op}},
        {"call": "list_operations", "args": {"key_prefix": "mcp:tickets:task-14:"}},
        {"call": "operation_events", "args": {"key": op}},
        {"call": "get_operation", "args": {"key": "mcp:tickets:nope"}},
        {"call": "list_operations", "args": {"limit": -1}},
        {"call": "list_operations", "args": {"limit": 1000}},
    ]);
    let r = env.agent_stdio(&steps, &ops);
    let tools = r[0]["tools"].as_array().unwrap();
    assert_eq!(tools.len(), 3);
    assert!(tools.iter().all(|t| t["annotations"]["readOnlyHint"] == true), "{tools:?}");
    let got = &r[1]["structuredContent"];
    assert_eq!((got["state"].clone(), got["provider_ref"].clone()), (json!("SUCCEEDED"), json!("T-1")));
    assert_eq!(got["result"]["structuredContent"], json!({"id": "T-1"}));
    assert_eq!(r[2]["structuredContent"]["operations"][0]["key"], op);
    let kinds: Vec<&str> =
        r[3]["structuredContent"]["events"].as_array().unwrap().iter().map(|e| e["kind"].as_str().unwrap()).collect();
    assert_eq!(kinds, ["acquired", "completed", "replayed"], "{}", r[3]);
    assert_eq!(r[4]["isError"], true);
    // A limit outside the schema's 1-100 is an error that says so, never clamped in silence.
    for bad in [&r[5], &r[6]] {
        assert_eq!(bad["isError"], true, "{bad}");
        assert!(
            bad["content"][0]["text"].as_str().unwrap().contains("limit must be an integer from 1 to 100"),
            "{bad}"
        );
    }
    assert_eq!(env.tickets(), 1);
}
