//! Settling an unknown call with a lookup tool of the same server (DESIGN.md §5: evidence
//! only), like the HTTP connector's lookup URL: the arguments template filled from the
//! operation, the tool called, its result read at the evidence pointer.
//!
//! - a non-empty string or a number there ⇒ [`Lookup::Found`] (SUCCEEDED, `evidence_source
//!   = "lookup"`);
//! - `null`, `[]` or `""` there ⇒ absent: [`Lookup::TooEarly`] until `absent_after_ms` has
//!   passed since the call (a server that timed out may still be working on it), then
//!   [`Lookup::Absent`] (PENDING: the next identical call is sent again);
//! - anything else — a missing member, a tool error, no answer — ⇒ [`Lookup::Inconclusive`]
//!   (asked again with backoff, to review after `max_lookups`): a wrong pointer never leads
//!   to a second attempt.

use crate::config::LookupConfig;
use idem_core::{Lookup, OperationRecord};
use serde_json::{Map, Value};

/// The lookup's arguments for `rec`: every string `{idempotency_key}` and `{task_id}` in
/// the template replaced, and a string that is exactly `{arguments.NAME}` replaced by that
/// argument's value (any JSON type; `null` when the call had none).
pub fn lookup_arguments(template: &Map<String, Value>, rec: &OperationRecord) -> Map<String, Value> {
    fn fill(v: &Value, rec: &OperationRecord) -> Value {
        match v {
            Value::String(s) => {
                if let Some(name) = s.strip_prefix("{arguments.").and_then(|r| r.strip_suffix('}')) {
                    return rec.payload.get("arguments").and_then(|a| a.get(name)).cloned().unwrap_or(Value::Null);
                }
                let task = rec.payload.get("task_id").and_then(Value::as_str).unwrap_or_default();
                Value::String(s.replace("{idempotency_key}", &rec.key).replace("{task_id}", task))
            }
            Value::Array(items) => Value::Array(items.iter().map(|i| fill(i, rec)).collect()),
            Value::Object(m) => Value::Object(m.iter().map(|(k, v)| (k.clone(), fill(v, rec))).collect()),
            other => other.clone(),
        }
    }
    template.iter().map(|(k, v)| (k.clone(), fill(v, rec))).collect()
}

/// What the lookup tool's answer (`answer`: its `CallToolResult` as JSON, or why there is
/// none) says about `rec`, judged at `now_ms` on the ledger's clock.
pub fn judge(cfg: &LookupConfig, rec: &OperationRecord, answer: Result<Value, String>, now_ms: i64) -> Lookup {
    let r = match answer {
        Ok(r) => r,
        Err(why) => {
            return Lookup::Inconclusive { why: format!("the lookup tool {} could not be asked: {why}", cfg.tool) };
        }
    };
    if r.get("isError").and_then(Value::as_bool) == Some(true) {
        let text = r.pointer("/content/0/text").and_then(Value::as_str).unwrap_or("");
        return Lookup::Inconclusive {
            why: idem_core::completion::clip_message(&format!(
                "the lookup tool {} answered with an error: {text}",
                cfg.tool
            )),
        };
    }
    let absent = |what: &str| {
        let waited = now_ms - rec.updated_at;
        if waited < cfg.absent_after_ms {
            Lookup::TooEarly {
                why: format!(
                    "{} found nothing ({what}), {waited} ms after the call: too early to prove absence",
                    cfg.tool
                ),
                retry_in_ms: cfg.absent_after_ms - waited,
            }
        } else {
            Lookup::Absent
        }
    };
    match r.pointer(&cfg.evidence_pointer) {
        Some(Value::String(s)) if s.is_empty() => absent("\"\""),
        Some(Value::String(s)) => Lookup::Found { provider_ref: idem_core::text::storable(s).into_owned() },
        Some(Value::Number(n)) => Lookup::Found { provider_ref: n.to_string() },
        Some(Value::Null) => absent("null"),
        Some(Value::Array(a)) if a.is_empty() => absent("[]"),
        Some(_) => Lookup::Inconclusive {
            why: format!("the lookup's {} is neither a reference nor empty", cfg.evidence_pointer),
        },
        None => Lookup::Inconclusive {
            why: format!("the lookup's answer has no {}: check evidence_pointer", cfg.evidence_pointer),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn rec() -> OperationRecord {
        let input = idem_core::AcquireInput {
            tenant: "default".into(),
            key: "mcp:s:t:create_ticket:0011".into(),
            action: "mcp:create_ticket".into(),
            payload: json!({"task_id": "t-1", "tool": "create_ticket", "arguments": {"customer": "c-9"}}),
            fingerprint: "f".into(),
            lease_ms: 1000,
            redo_safe: false,
            connector: None,
            holder: None,
            actor: idem_core::Actor::system(),
        };
        input.new_record(1_000)
    }

    fn cfg() -> LookupConfig {
        LookupConfig {
            tool: "find_ticket".into(),
            arguments: Map::new(),
            evidence_pointer: "/structuredContent/id".into(),
            max_lookups: 5,
            absent_after_ms: 500,
        }
    }

    #[test]
    fn the_template_is_filled_from_the_operation() {
        let t = json!({"request_id": "{idempotency_key}", "q": "task {task_id}", "customer": "{arguments.customer}",
                       "none": "{arguments.nope}", "n": 3});
        let a = lookup_arguments(t.as_object().unwrap(), &rec());
        assert_eq!(
            Value::Object(a),
            json!({"request_id": "mcp:s:t:create_ticket:0011", "q": "task t-1",
                                            "customer": "c-9", "none": null, "n": 3})
        );
    }

    #[test]
    fn only_evidence_is_found_only_an_empty_answer_is_absent_and_only_late_enough() {
        let r = rec();
        let ok = |v: Value| Ok(json!({"content": [], "structuredContent": {"id": v}}));
        assert_eq!(judge(&cfg(), &r, ok(json!("T-7")), 2_000), Lookup::Found { provider_ref: "T-7".into() });
        assert_eq!(judge(&cfg(), &r, ok(json!(7)), 2_000), Lookup::Found { provider_ref: "7".into() });
        assert_eq!(judge(&cfg(), &r, ok(Value::Null), 2_000), Lookup::Absent);
        assert!(matches!(judge(&cfg(), &r, ok(Value::Null), 1_200), Lookup::TooEarly { retry_in_ms: 300, .. }));
        assert!(matches!(judge(&cfg(), &r, ok(json!({"x": 1})), 2_000), Lookup::Inconclusive { .. }));
        let missing = Ok(json!({"content": []}));
        assert!(
            matches!(judge(&cfg(), &r, missing, 2_000), Lookup::Inconclusive { .. }),
            "a wrong pointer is not absence"
        );
        let error = Ok(json!({"content": [{"type": "text", "text": "db down"}], "isError": true}));
        assert!(matches!(judge(&cfg(), &r, error, 2_000), Lookup::Inconclusive { .. }));
        assert!(matches!(judge(&cfg(), &r, Err("timeout".into()), 2_000), Lookup::Inconclusive { .. }));
    }
}
