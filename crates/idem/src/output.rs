//! Human-readable renderings of the server's JSON (`--json` prints the JSON itself).

use serde_json::Value;

/// Whether `c` must not reach a terminal as is: control characters (ESC, CR, LF, NUL, C1,
/// DEL …, which move the cursor, clear the screen or forge lines), the line and paragraph
/// separators U+2028/U+2029, and the bidirectional controls of Unicode TR #9 (U+061C,
/// U+200E/F, U+202A–U+202E, U+2066–U+2069), which reorder what is shown after them
/// (CVE-2021-42574, "Trojan Source").
fn unsafe_for_terminal(c: char) -> bool {
    c.is_control()
        || matches!(c, '\u{2028}' | '\u{2029}' | '\u{061C}' | '\u{200E}' | '\u{200F}')
        || ('\u{202A}'..='\u{202E}').contains(&c)
        || ('\u{2066}'..='\u{2069}').contains(&c)
}

/// `text` with each character [`unsafe_for_terminal`] written as `\u{..}`.
pub fn printable_str(text: &str) -> String {
    text.chars().map(|c| if unsafe_for_terminal(c) { c.escape_unicode().to_string() } else { c.to_string() }).collect()
}

/// `v` with every character of its strings that could mislead a terminal
/// ([`unsafe_for_terminal`]) written as `\u{..}`, so data from the ledger cannot move the
/// cursor, clear the screen, forge lines or reorder what is shown. Human output only;
/// `--json` prints the JSON as is (escaped by JSON).
pub fn printable(v: &Value) -> Value {
    match v {
        Value::String(text) if text.chars().any(unsafe_for_terminal) => Value::String(printable_str(text)),
        Value::Array(items) => Value::Array(items.iter().map(printable).collect()),
        Value::Object(map) => Value::Object(map.iter().map(|(k, v)| (k.clone(), printable(v))).collect()),
        other => other.clone(),
    }
}

fn s<'a>(v: &'a Value, k: &str) -> &'a str {
    v.get(k).and_then(Value::as_str).unwrap_or("-")
}

fn n(v: &Value, k: &str) -> String {
    v.get(k).and_then(Value::as_i64).map_or_else(|| "-".into(), |x| x.to_string())
}

/// Appends one `name value` line of a detail view whose names take `width` columns.
fn field(out: &mut String, width: usize, name: &str, value: impl std::fmt::Display) {
    out.push_str(&format!("{name:<width$} {value}\n"));
}

/// [`field`] for each of `keys`, with the string at that key of `v` (`-` when absent).
fn fields(out: &mut String, width: usize, v: &Value, keys: &[&str]) {
    for k in keys {
        field(out, width, k, s(v, k));
    }
}

/// `409 operation-in-progress: another worker holds the lease (retry after 2 s)`.
pub fn problem_line(status: u16, body: &Value) -> String {
    let body = &printable(body);
    let slug = s(body, "type").trim_start_matches("/problems/");
    let detail = body
        .get("detail")
        .and_then(Value::as_str)
        .map(str::to_owned)
        .unwrap_or_else(|| body.as_str().unwrap_or("").trim().to_owned());
    let mut line = format!("{status} {slug}: {detail}");
    if let Some(ms) = body.get("retry_after_ms").and_then(Value::as_i64) {
        line.push_str(&format!(" (retry after {ms} ms)"));
    }
    line
}

/// One line per answer of `idem acquire` (`performed`: the answer's `Idem-Performed-By`).
pub fn acquire_summary(status: u16, performed: bool, v: &Value) -> String {
    let by_connector = v.get("connector").and_then(Value::as_str);
    match status {
        200 | 201 if by_connector.is_some() && (performed || status == 201) => format!(
            "performed {}: {} by connector {} {} — idem did it; do nothing",
            s(v, "key"),
            s(v, "state"),
            by_connector.unwrap_or("-"),
            evidence(v)
        ),
        202 if by_connector.is_some() => format!(
            "accepted {}: {} by connector {} {} — idem is on it; do nothing (`idem ops get {}` shows how it ends)",
            s(v, "key"),
            s(v, "state"),
            by_connector.unwrap_or("-"),
            evidence(v),
            s(v, "key"),
        ),
        201 => format!(
            "acquired {}: attempt {}, fencing token {}, lease until {} — perform the side effect, then `idem complete {} --token {} …`",
            s(v, "key"),
            n(v, "attempt"),
            n(v, "fencing_token"),
            s(v, "lease_expires_at"),
            s(v, "key"),
            n(v, "fencing_token"),
        ),
        200 => format!("replay {}: {} {} — already done, nothing to do", s(v, "key"), s(v, "state"), evidence(v)),
        202 => format!("unknown {}: outcome UNKNOWN — do not redo the side effect; {}", s(v, "key"), unknown_cause(v)),
        _ => operation_summary(v),
    }
}

/// Why an operation is UNKNOWN and what settles it, in words for a person on call: its
/// last error's message (the cause idem recorded: a lease that ended while the worker may
/// have acted, a call whose answer was lost) and whether it waits for review.
pub fn unknown_cause(v: &Value) -> String {
    let cause = v.get("error").and_then(|e| e.get("message")).and_then(Value::as_str);
    let settle = if v.get("needs_review").and_then(Value::as_bool) == Some(true) {
        "it waits for a person: `idem ops resolve` once you know what happened"
    } else {
        "idem asks the provider (reconciliation), or a person resolves it"
    };
    match cause {
        Some(c) => format!("{c}; {settle}"),
        None => settle.to_owned(),
    }
}

fn evidence(v: &Value) -> String {
    match (v.get("provider_ref").and_then(Value::as_str), v.get("error")) {
        (Some(r), _) => format!("(provider_ref {r})"),
        (None, Some(e)) if !e.is_null() => {
            format!("(error {}: {})", s(e, "class"), s(e, "message"))
        }
        _ => String::new(),
    }
}

/// `KEY  STATE  attempt N  token T  evidence`.
pub fn operation_summary(v: &Value) -> String {
    format!(
        "{}  {}  attempt {}  token {}  {}",
        s(v, "key"),
        s(v, "state"),
        n(v, "attempt"),
        n(v, "fencing_token"),
        evidence(v)
    )
    .trim_end()
    .to_owned()
}

/// `KEY  EXECUTING  token T  lease until 2026-11-30T09:00:30.000Z` (after a renewal).
pub fn renewal_summary(v: &Value) -> String {
    format!(
        "{}  {}  token {}  lease until {}",
        s(v, "key"),
        s(v, "state"),
        n(v, "fencing_token"),
        s(v, "lease_expires_at")
    )
}

/// The record's fields, then its event timeline.
pub fn operation_with_events(v: &Value) -> String {
    let mut out = String::new();
    fields(
        &mut out,
        17,
        v,
        &[
            "key",
            "action",
            "state",
            "fingerprint",
            "lease_owner",
            "lease_holder",
            "lease_expires_at",
            "next_attempt_at",
            "provider_ref",
            "verified_at",
            "evidence_source",
            "created_at",
            "updated_at",
            "completed_at",
        ],
    );
    field(&mut out, 17, "attempt", n(v, "attempt"));
    field(&mut out, 17, "fencing_token", n(v, "fencing_token"));
    field(&mut out, 17, "needs_review", v.get("needs_review").unwrap_or(&Value::Null));
    if let Some(e) = v.get("error").filter(|e| !e.is_null()) {
        field(&mut out, 17, "error", format!("{}: {}", s(e, "class"), s(e, "message")));
    }
    events(&mut out, v);
    out.trim_end().to_owned()
}

/// A table of a page of operations, with the next cursor.
pub fn operation_table(v: &Value) -> String {
    let mut out = format!("{:<40}  {:<24}  {:<9}  {:>7}  EVIDENCE\n", "KEY", "ACTION", "STATE", "ATTEMPT");
    for op in v.get("items").and_then(Value::as_array).into_iter().flatten() {
        out.push_str(&format!(
            "{:<40}  {:<24}  {:<9}  {:>7}  {}\n",
            s(op, "key"),
            s(op, "action"),
            s(op, "state"),
            n(op, "attempt"),
            evidence(op)
        ));
    }
    if let Some(c) = v.get("next_cursor").and_then(Value::as_str) {
        out.push_str(&format!("more: repeat the command (same filters) with --cursor {c}\n"));
    }
    out.trim_end().to_owned()
}

/// One line for `idem wf start`'s answer.
pub fn instance_summary(status: u16, v: &Value) -> String {
    let what = if status == 201 { "started" } else { "existing" };
    format!("{what} {} ({}): {}", s(v, "instance_id"), s(v, "workflow"), s(v, "state"))
}

/// A workflow instance (`idem wf get`): its fields, its steps (with compensations and, for a
/// step for each item, its items), its parallel groups with each branch's state, events.
pub fn instance_with_steps(v: &Value) -> String {
    let mut out = String::new();
    fields(
        &mut out,
        18,
        v,
        &[
            "instance_id",
            "workflow",
            "state",
            "last_good_step",
            "current_step",
            "stopped_step",
            "source_event",
            "definition_version",
            "input_fingerprint",
            "created_at",
            "updated_at",
            "completed_at",
        ],
    );
    if let Some(e) = v.get("error").filter(|e| !e.is_null()) {
        field(&mut out, 18, "error", format!("{}: {}", s(e, "class"), s(e, "message")));
    }
    out.push_str("steps:\n");
    for st in v.get("steps").and_then(Value::as_array).into_iter().flatten() {
        out.push_str(&format!(
            "  {:<2} {:<24} {:<11} {:<18} attempts {:<3} {}  key {}\n",
            n(st, "position"),
            s(st, "step"),
            s(st, "state"),
            s(st, "policy"),
            n(st, "attempts"),
            evidence(st),
            s(st, "operation_key"),
        ));
        if let Some(c) = st.get("compensation").filter(|c| !c.is_null()) {
            out.push_str(&format!(
                "     {:<24} {:<11} {:<18} attempts {:<3} {}\n",
                format!("↳ compensation {}", s(c, "action")),
                s(c, "state"),
                s(st, "compensation_key"),
                n(c, "attempts"),
                evidence(c)
            ));
        }
        for it in st.get("items").and_then(Value::as_array).into_iter().flatten() {
            out.push_str(&format!(
                "     {:<24} {:<11} {:<18} attempts {:<3} {}\n",
                format!("↳ item {}", s(it, "item")),
                s(it, "state"),
                s(it, "operation_key"),
                n(it, "attempts"),
                it.get("provider_ref").and_then(Value::as_str).map(|r| format!("ref {r}")).unwrap_or_default(),
            ));
        }
    }
    // Parallel groups: each with its state and its branches' (they are also among the steps).
    let groups = v.get("groups").and_then(Value::as_array).into_iter().flatten();
    for (i, g) in groups.enumerate() {
        if i == 0 {
            out.push_str("groups:\n");
        }
        let branches: Vec<String> = g
            .get("branches")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .map(|b| format!("{} {}", s(b, "step"), s(b, "state")))
            .collect();
        out.push_str(&format!(
            "  {:<24} {:<11} on_failure {:<10} {}\n",
            s(g, "name"),
            s(g, "state"),
            s(g, "on_failure"),
            branches.join(", ")
        ));
    }
    events(&mut out, v);
    out.trim_end().to_owned()
}

/// One line per outbox event (`idem outbox list`), from the event's JSON (escaped here,
/// see [`printable`]): `ID  STATE  AGGREGATE_TYPE/AGGREGATE_ID  TOPIC  attempts N[  CLASS:
/// MESSAGE]`.
pub fn outbox_line(raw: &Value) -> String {
    let v = &printable(raw);
    let error = v
        .get("error_class")
        .and_then(Value::as_str)
        .map(|c| format!("  {c}: {}", v.get("error_message").and_then(Value::as_str).unwrap_or("")))
        .unwrap_or_default();
    format!(
        "{}  {:<9}  {}/{}  {}  attempts {}{error}",
        s(v, "id"),
        s(v, "state"),
        s(v, "aggregate_type"),
        s(v, "aggregate_id"),
        s(v, "topic"),
        n(v, "attempts")
    )
}

/// An outbox event (`idem outbox get`), from its JSON (escaped here, see [`printable`]):
/// its fields, its headers and payload as compact JSON, then its attempts log
/// (deliveries, redrives, skips), oldest first.
pub fn outbox_event(raw: &Value) -> String {
    let v = &printable(raw);
    let mut out = String::new();
    fields(
        &mut out,
        15,
        v,
        &[
            "id",
            "state",
            "aggregate_type",
            "aggregate_id",
            "topic",
            "created_at",
            "next_attempt_at",
            "delivered_at",
            "sink",
        ],
    );
    field(&mut out, 15, "seq", n(v, "seq"));
    field(&mut out, 15, "attempts", n(v, "attempts"));
    if let Some(e) = v.get("evidence").and_then(Value::as_str) {
        field(&mut out, 15, "evidence", e);
    }
    if let Some(c) = v.get("error_class").and_then(Value::as_str) {
        field(&mut out, 15, "error", format!("{c}: {}", s(v, "error_message")));
    }
    // JSON as stored: serde_json escapes the control characters, printable_str the rest.
    for k in ["headers", "payload"] {
        field(&mut out, 15, k, printable_str(&raw.get(k).unwrap_or(&Value::Null).to_string()));
    }
    out.push_str("attempts log:\n");
    for a in v.get("attempts_log").and_then(Value::as_array).into_iter().flatten() {
        let detail = match s(a, "kind") {
            "attempt" => {
                let failure = a
                    .get("error_class")
                    .and_then(Value::as_str)
                    .map(|c| format!(" ({c}: {})", s(a, "message")))
                    .unwrap_or_default();
                let evidence = a.get("evidence").and_then(Value::as_str).map(|e| format!(" {e}")).unwrap_or_default();
                format!(
                    "{} by relay {} to {} -> {}{failure}{evidence}",
                    s(a, "trigger"),
                    s(a, "relay"),
                    s(a, "sink"),
                    s(a, "result")
                )
            }
            _ => format!("by {}: {}", s(a, "operator"), s(a, "reason")),
        };
        out.push_str(&format!("  {}  {:<8} {detail}\n", s(a, "at"), s(a, "kind")));
    }
    out.trim_end().to_owned()
}

/// The `events:` block of an operation or an instance: one line per event.
fn events(out: &mut String, v: &Value) {
    out.push_str("events:\n");
    for e in v.get("events").and_then(Value::as_array).into_iter().flatten() {
        out.push_str(&format!(
            "  #{:<4} {}  {:<15} {:>9} -> {:<9} by {} ({})\n",
            n(e, "seq"),
            s(e, "at"),
            s(e, "kind"),
            s(e, "from_state"),
            s(e, "to_state"),
            s(e, "principal"),
            s(e, "reason"),
        ));
    }
}

/// A re-run's plan: one line per step (and per item of a step for each item, under it), and
/// what to do next.
pub fn rerun_plan(v: &Value) -> String {
    let dry = v.get("dry_run").and_then(Value::as_bool).unwrap_or(true);
    let mut out = format!(
        "{} (resumes as {}), plan {}\n",
        if dry { "dry run: nothing changed" } else { "re-run started" },
        s(v, "resumes_as"),
        s(v, "plan_hash")
    );
    for st in v.get("steps").and_then(Value::as_array).into_iter().flatten() {
        let input = st.get("input").filter(|i| !i.is_null()).map(|i| format!(" input {i}")).unwrap_or_default();
        out.push_str(&format!(
            "  {:<24} {:<17} {} {}{}{}\n",
            s(st, "step"),
            s(st, "disposition"),
            s(st, "action"),
            s(st, "key"),
            st.get("connector").and_then(Value::as_str).map(|c| format!(" via {c}")).unwrap_or_default(),
            input
        ));
        // A step for each item: one line per item, under its step's.
        for it in st.get("items").and_then(Value::as_array).into_iter().flatten() {
            let input = it.get("input").filter(|i| !i.is_null()).map(|i| format!(" input {i}")).unwrap_or_default();
            out.push_str(&format!(
                "    item {:<19} {:<17} {} {}{}\n",
                s(it, "item"),
                s(it, "disposition"),
                s(it, "action"),
                s(it, "key"),
                input
            ));
        }
    }
    if dry {
        out.push_str(&format!("run it: idem wf rerun … --reason \"…\" --plan-hash {}\n", s(v, "plan_hash")));
    }
    out.trim_end().to_owned()
}

/// A table of a page of instances, with the next cursor.
pub fn instance_table(v: &Value) -> String {
    let mut out = format!("{:<40}  {:<24}  {:<12}  {}\n", "INSTANCE", "WORKFLOW", "STATE", "CREATED");
    for i in v.get("items").and_then(Value::as_array).into_iter().flatten() {
        out.push_str(&format!(
            "{:<40}  {:<24}  {:<12}  {}\n",
            s(i, "instance_id"),
            s(i, "workflow"),
            s(i, "state"),
            s(i, "created_at")
        ));
    }
    if let Some(c) = v.get("next_cursor").and_then(Value::as_str) {
        out.push_str(&format!("more: repeat the command (same filters) with --cursor {c}\n"));
    }
    out.trim_end().to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn control_characters_are_shown_not_obeyed() {
        let v = json!({"provider_ref": "ok\u{1b}[2J\r\nforged", "n": 1, "list": ["\u{7}"]});
        let p = printable(&v);
        assert_eq!(p["provider_ref"], "ok\\u{1b}[2J\\u{d}\\u{a}forged");
        assert_eq!(p["list"][0], "\\u{7}");
        assert_eq!(p["n"], 1);
        assert!(!operation_table(&json!({"items": [p]})).contains('\u{1b}'));
        // Bidirectional controls and Unicode line separators are shown, not obeyed.
        let p = printable(&json!({"reason": "ok\u{202E}gnp.exe\u{2028}x\u{2067}"}));
        assert_eq!(p["reason"], "ok\\u{202e}gnp.exe\\u{2028}x\\u{2067}");
    }

    #[test]
    fn an_outbox_event_reads_as_text_with_its_attempts_log() {
        let v = json!({
            "id": "order-42:created", "seq": 3, "aggregate_type": "order", "aggregate_id": "42",
            "topic": "orders.created", "state": "DELIVERED", "attempts": 2,
            "created_at": "2026-12-01T09:00:00.000Z", "next_attempt_at": null, "sink": "webhook",
            "evidence": "HTTP 204", "error_class": null, "error_message": null,
            "delivered_at": "2026-12-01T09:00:02.000Z", "payload": {"total": 12.5},
            "attempts_log": [
                {"at": "2026-12-01T09:00:00.100Z", "kind": "attempt", "trigger": "scheduled", "relay": "r1",
                 "result": "retry", "sink": "webhook", "error_class": "transient", "message": "HTTP 503",
                 "evidence": null, "operator": null, "reason": null},
                {"at": "2026-12-01T09:00:01.000Z", "kind": "redrive", "trigger": null, "relay": null,
                 "result": null, "sink": null, "error_class": null, "message": null, "evidence": null,
                 "operator": "alice", "reason": "receiver fixed"},
                {"at": "2026-12-01T09:00:02.000Z", "kind": "attempt", "trigger": "manual", "relay": "r2",
                 "result": "delivered", "sink": "webhook", "error_class": null, "message": null,
                 "evidence": "HTTP 204", "operator": null, "reason": null}
            ]
        });
        let text = outbox_event(&v);
        assert!(text.starts_with("id              order-42:created\n"), "{text}");
        for line in [
            "aggregate_type  order",
            "aggregate_id    42",
            "evidence        HTTP 204",
            "payload         {\"total\":12.5}",
            "  2026-12-01T09:00:00.100Z  attempt  scheduled by relay r1 to webhook -> retry (transient: HTTP 503)",
            "  2026-12-01T09:00:01.000Z  redrive  by alice: receiver fixed",
            "  2026-12-01T09:00:02.000Z  attempt  manual by relay r2 to webhook -> delivered HTTP 204",
        ] {
            assert!(text.lines().any(|l| l == line), "missing {line:?} in:\n{text}");
        }
        assert!(!text.contains("error "), "no error line for an event without one:\n{text}");
        assert_eq!(outbox_line(&v), "order-42:created  DELIVERED  order/42  orders.created  attempts 2",);
        let hostile = json!({"id": "x\u{1b}[2J", "aggregate_type": "a\nforged", "topic": "t\u{202E}txt.exe",
            "aggregate_id": "line\u{2028}break", "attempts_log": [], "payload": {"s": "\u{1b}[31mX\n\u{2066}"}});
        let (text, line) = (outbox_event(&hostile), outbox_line(&hostile));
        assert!(!line.chars().any(unsafe_for_terminal), "{line:?}");
        assert!(!text.chars().any(|c| c != '\n' && unsafe_for_terminal(c)), "{text:?}");
        assert_eq!(text.lines().count(), 14, "one line per field, none forged: {text}");
        // The payload reads as the JSON it is (one escape, not two).
        assert!(text.contains(r#"payload         {"s":"\u001b[31mX\n\u{2066}"}"#), "{text}");
    }

    #[test]
    fn a_workflow_step_line_names_the_operation_it_ran_under() {
        let v = json!({"instance_id": "i1", "steps": [
            {"position": 1, "step": "charge", "state": "SUCCEEDED", "policy": "lookup_before_redo",
             "attempts": 1, "provider_ref": "ch_1", "operation_key": "wf:i1:charge:rerun-1"}
        ], "events": []});
        let text = instance_with_steps(&v);
        assert!(text.lines().any(|l| l.contains("charge") && l.ends_with("key wf:i1:charge:rerun-1")), "{text}");
    }

    #[test]
    fn a_rerun_plan_shows_each_item_on_a_line_of_its_own() {
        let v = json!({"dry_run": true, "plan_hash": "ab12", "resumes_as": "RUNNING", "steps": [
            {"step": "send", "disposition": "redone", "action": "send", "key": "i1:send", "connector": "mail",
             "items": [
                {"item": "r1", "disposition": "kept", "action": "send", "key": "i1:send:r1"},
                {"item": "r2", "disposition": "redone", "action": "send", "key": "i1:send:r2:rerun-1",
                 "input": {"to": "b@example.org"}}
             ]},
            {"step": "close", "disposition": "runs", "action": "close", "key": "i1:close"}
        ]});
        let text = rerun_plan(&v);
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines[1].starts_with("  send ") && lines[1].contains("redone"), "{text}");
        assert!(
            lines[2].starts_with("    item r1 ") && lines[2].ends_with("kept              send i1:send:r1"),
            "{text}"
        );
        assert!(
            lines[3].starts_with("    item r2 ")
                && lines[3].ends_with(r#"send i1:send:r2:rerun-1 input {"to":"b@example.org"}"#),
            "{text}"
        );
        assert!(lines[4].starts_with("  close "), "the step after the items: {text}");
    }
}
