//! What the agent is told, word for word (the book's docs/src/guides/ai-agents-mcp.md quotes these).
//!
//! Agents read tool results, not transport headers, so every answer the guard gives instead
//! of the server's is a `CallToolResult`: one text block that starts with `idem:` (prepended
//! to a replayed result), and `_meta` entries under `io.idem/` (MCP 2025-06-18 §_meta: a
//! reverse-DNS prefix of the implementer's own). Only a replay of a successful call has
//! `isError: false`; every refusal, "in progress" and "outcome unknown" is a tool error the
//! agent can act on. A call settled without a recorded result (by the lookup tool or an
//! operator) is replayed as a tool error too: the server's result is not there to give, and
//! a tool with an `outputSchema` must not get content that does not follow it.

use serde_json::{Map, Value, json};

/// The request `_meta` member that names the task (a string): `io.idem/task-id`.
pub const META_TASK_ID: &str = "io.idem/task-id";
/// Result `_meta`: `true` on a replay of a finished call.
pub const META_REPLAYED: &str = "io.idem/replayed";
/// Result `_meta`: the operation key.
pub const META_OPERATION: &str = "io.idem/operation";
/// Result `_meta`: the operation's state (`SUCCEEDED`, `FAILED`, `UNKNOWN`, `EXECUTING`).
pub const META_STATE: &str = "io.idem/state";
/// Result `_meta`: when it finished (a replay) or started (in progress, unknown), RFC 3339.
pub const META_AT: &str = "io.idem/at";
/// Result `_meta`: what the guard decided (`replayed`, `in_progress`, `mismatch`,
/// `outcome_unknown`, `late`, `refused`).
pub const META_DECISION: &str = "io.idem/decision";

/// An epoch-ms instant as RFC 3339 (UTC, milliseconds).
pub fn rfc3339(ms: i64) -> String {
    jiff::Timestamp::from_millisecond(ms).map_or_else(|_| ms.to_string(), |t| t.to_string())
}

/// The first line of a replay of a call that SUCCEEDED with a recorded result.
pub fn replayed(at: &str, op: &str) -> String {
    format!("idem: already done at {at} (operation {op}); this is its recorded result, the tool was not called again.")
}

/// The first line of a replay of a call whose recorded answer was a tool error (FAILED).
pub fn replayed_error(at: &str, op: &str) -> String {
    format!(
        "idem: already done at {at} (operation {op}): the tool answered with this error then; the tool was not called again."
    )
}

/// A replay of a call whose result was too large to keep.
pub fn replayed_omitted(at: &str, op: &str, bytes: u64) -> String {
    format!(
        "idem: already done at {at} (operation {op}); its result was too large to keep ({bytes} bytes), so only this note is returned. The tool was not called again."
    )
}

/// A replay of a call settled without a recorded result: by the lookup tool (`source` =
/// `lookup`) or an operator, to SUCCEEDED with `evidence`.
pub fn settled_done(at: &str, op: &str, source: &str, evidence: &str) -> String {
    let who = if source == "lookup" { "the lookup tool found it" } else { "an operator recorded it as done" };
    format!(
        "idem: already done: {who} at {at} (evidence {evidence}, operation {op}); the first answer was lost, so there is no recorded result. The tool was not called again."
    )
}

/// A replay of a call an operator settled as FAILED, with the operator's `reason`.
pub fn settled_failed(at: &str, op: &str, reason: &str) -> String {
    format!(
        "idem: not done: an operator recorded it as failed at {at} ({reason}, operation {op}). The tool will not be called again for this call."
    )
}

/// A repeat while the first call runs, after waiting `wait_ms`.
pub fn in_progress(at: &str, op: &str, wait_ms: u64) -> String {
    format!(
        "idem: not performed: the same call is in progress since {at} (operation {op}) and did not finish within {wait_ms} ms. Do not call it again while it runs; once it has finished, the same call returns its result."
    )
}

/// The same intent with other arguments: `differing` names the arguments, `intent` the
/// intent fields (JSON pointers) of the tool.
pub fn mismatch(op: &str, differing: &[String], intent: &[String]) -> String {
    let names = if differing.is_empty() { "their canonical form".to_owned() } else { differing.join(", ") };
    let fields: Vec<&str> = intent.iter().map(|p| p.trim_start_matches('/')).collect();
    format!(
        "idem: not performed: this task already made this call with other arguments (operation {op}; differing: {names}). One intent, one effect: call it with the first arguments to get that call's result, or, if a second effect is really wanted, make it a new intent (other values of {}).",
        fields.join(", ")
    )
}

/// How an unknown outcome will be settled: by the lookup tool `lookup`, or by an operator.
pub fn settled_by(lookup: Option<&str>) -> String {
    match lookup {
        Some(t) => format!(
            "idem asks the tool {t} what became of it and records what it finds, or an operator settles it in idem's review queue"
        ),
        None => "an operator settles it in idem's review queue (idem ops list --needs-review)".to_owned(),
    }
}

/// The outcome is unknown: `why` says what happened (for a repeat: what happened to the
/// first call), `settle` is [`settled_by`].
pub fn outcome_unknown(why: &str, op: &str, settle: &str) -> String {
    format!(
        "idem: outcome unknown: {why} (operation {op}). The call may or may not have taken effect. It will not be performed again automatically; {settle}. Until then every repeat of this call gets this answer."
    )
}

/// `why` of a repeat of an unknown call first made at `at`.
pub fn earlier_call_unknown(at: &str, reason: &str) -> String {
    format!("an identical call was first made at {at} and its outcome is unknown ({reason})")
}

/// `why` of a call whose answer did not come within `timeout_ms`.
pub fn timed_out(timeout_ms: u64) -> String {
    format!("the server did not answer within {timeout_ms} ms")
}

/// A call past retention.
pub fn late(op: &str) -> String {
    format!(
        "idem: not performed: this call finished long ago and its record is past retention (operation {op}); it will not be performed again."
    )
}

/// No task id anywhere.
pub const NO_TASK_ID: &str = "idem: not performed: no task id. The guard needs a stable task id to tell a repeat from a new call: send it in the call's _meta as \"io.idem/task-id\", or start idem mcp with --task-id ID (IDEM_MCP_TASK_ID) or --task-per-process. Nothing was sent.";

/// A refusal before anything was recorded or sent (`why` ends without a full stop).
pub fn refused(why: &str) -> String {
    format!("idem: not performed: {why}. Nothing was sent.")
}

/// The call reached no server: nothing happened, the same call may be made again.
pub fn not_sent(why: &str) -> String {
    format!(
        "idem: not performed: the call could not be sent to the tool server ({why}); nothing happened, so the same call may be made again."
    )
}

/// A `CallToolResult` (as JSON) with one text block, `isError`, and `_meta`.
pub fn result(text: &str, is_error: bool, meta: Map<String, Value>) -> Value {
    let mut r = json!({"content": [{"type": "text", "text": text}], "isError": is_error});
    if !meta.is_empty() {
        r["_meta"] = Value::Object(meta);
    }
    r
}

/// The `_meta` of a guard's answer about operation `op`.
pub fn meta(decision: &str, op: Option<&str>, state: Option<&str>, at: Option<&str>) -> Map<String, Value> {
    let mut m = Map::new();
    m.insert(META_DECISION.into(), decision.into());
    if decision == "replayed" {
        m.insert(META_REPLAYED.into(), true.into());
    }
    for (k, v) in [(META_OPERATION, op), (META_STATE, state), (META_AT, at)] {
        if let Some(v) = v {
            m.insert(k.into(), v.into());
        }
    }
    m
}

/// A recorded result replayed: `line` first, then the recorded content; `_meta` merged
/// (the guard's entries win).
pub fn prepend(mut recorded: Value, line: &str, meta: Map<String, Value>) -> Value {
    let mut content = vec![json!({"type": "text", "text": line})];
    if let Some(Value::Array(old)) = recorded.get_mut("content").map(Value::take) {
        content.extend(old);
    }
    recorded["content"] = Value::Array(content);
    let mut m = recorded.get("_meta").and_then(Value::as_object).cloned().unwrap_or_default();
    m.extend(meta);
    recorded["_meta"] = Value::Object(m);
    recorded
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_replay_keeps_the_recorded_result_after_one_line() {
        let rec = json!({"content": [{"type": "text", "text": "{\"id\":\"T-1\"}"}], "structuredContent": {"id": "T-1"},
                         "isError": false, "_meta": {"x": 1}});
        let r = prepend(
            rec,
            &replayed("2026-12-04T10:00:00Z", "mcp:s:t:x:1"),
            meta("replayed", Some("mcp:s:t:x:1"), Some("SUCCEEDED"), None),
        );
        assert_eq!(
            r["content"][0]["text"],
            "idem: already done at 2026-12-04T10:00:00Z (operation mcp:s:t:x:1); this is its recorded result, the tool was not called again."
        );
        assert_eq!(r["content"][1]["text"], "{\"id\":\"T-1\"}");
        assert_eq!(r["structuredContent"], json!({"id": "T-1"}));
        assert_eq!(
            r["_meta"],
            json!({"x": 1, "io.idem/decision": "replayed", "io.idem/replayed": true,
                                      "io.idem/operation": "mcp:s:t:x:1", "io.idem/state": "SUCCEEDED"})
        );
        assert_eq!(rfc3339(1_796_000_000_000), "2026-11-30T00:53:20Z");
    }
}
