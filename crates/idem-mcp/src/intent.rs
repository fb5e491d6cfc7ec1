//! One operation per intent: the operation key and fingerprint of a guarded tool call.
//!
//! - The **key** is `mcp:{server}:{task}:{tool}:{h}`, where `h` is the first 16 hex digits
//!   of the fingerprint (NFC, RFC 8785, SHA-256: `idem_core::fingerprint`) of
//!   `{"task": task id, "tool": name, "intent": {pointer: value, …}}` — the intent fields'
//!   values (`null` for a missing one), or all arguments when the tool names none. A task
//!   id or tool name that is not 1–64 (task) or 1–96 (tool) characters of
//!   `[A-Za-z0-9._-]` is written as `t` + 16 hex digits of its SHA-256 instead, so the key
//!   stays a valid idempotency key (printable ASCII, at most 255 characters).
//! - The **fingerprint** covers all arguments but the idempotency-key argument the guard
//!   fills: the same key with other arguments is a mismatch (DESIGN.md §3, 422).
//!
//! Never a random value per attempt: a repeat of the same call in the same task is the
//! same key, whatever the transport's request id.

use idem_core::fingerprint::{fingerprint, sha256_hex};
use serde_json::{Map, Value, json};

/// A guarded call's identity in the ledger.
#[derive(Debug, Clone, PartialEq)]
pub struct Intent {
    /// The operation key.
    pub key: String,
    /// The fingerprint of the arguments (64 hex digits).
    pub fingerprint: String,
    /// What is kept with the record: `{"server", "task_id", "tool", "arguments"}` (the
    /// arguments as the agent sent them, without the idempotency-key argument).
    pub payload: Value,
}

/// Why a call cannot be given an operation (answered as a tool error, nothing recorded).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IntentError {
    /// The task id breaks the identifier rule (`idem_core::ident`) or is over 256 bytes.
    #[error("the task id is not usable: {0}")]
    TaskId(String),
    /// The arguments' JSON text is larger than allowed.
    #[error("the arguments have {0} bytes of JSON; this tool takes at most {1}")]
    TooLarge(usize, usize),
    /// The arguments cannot be fingerprinted (member names equal after NFC, too deep).
    #[error("the arguments cannot be fingerprinted: {0}")]
    Fingerprint(String),
    /// A number the fingerprint cannot tell from its neighbours: an integer beyond ±2^53
    /// (I-JSON, RFC 7493 §2.2), which RFC 8785 writes as the nearest double, so
    /// `9007199254740993` and `9007199254740992` would be one intent.
    #[error("{0}")]
    Number(String),
}

/// Longest task id, bytes.
pub const MAX_TASK_ID_BYTES: usize = 256;

fn plain(s: &str, max: usize) -> bool {
    !s.is_empty() && s.len() <= max && s.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
}

fn segment(s: &str, max: usize) -> String {
    if plain(s, max) { s.to_owned() } else { format!("t{}", &sha256_hex(s.as_bytes())[..16]) }
}

/// Checks a task id: the identifier rule every stored id follows (not empty or blank, no
/// padding at either end, no control character), at most [`MAX_TASK_ID_BYTES`].
///
/// # Errors
/// [`IntentError::TaskId`] naming the problem.
pub fn check_task_id(task: &str) -> Result<(), IntentError> {
    idem_core::ident::check_identifier("the task id", task, MAX_TASK_ID_BYTES)
        .map_err(|e| IntentError::TaskId(e.to_string()))
}

/// The operation of a call of `tool` with `arguments` in task `task` on `server`.
/// `intent` names the intent fields (JSON pointers), `key_argument` the argument the guard
/// fills with the key (left out here).
///
/// # Errors
/// An [`IntentError`]; nothing may be recorded then.
pub fn intent_of(
    server: &str,
    task: &str,
    tool: &str,
    arguments: &Map<String, Value>,
    intent: Option<&[String]>,
    key_argument: Option<&str>,
    max_argument_bytes: usize,
) -> Result<Intent, IntentError> {
    check_task_id(task)?;
    let mut args = arguments.clone();
    if let Some(k) = key_argument {
        args.remove(k);
    }
    let args = Value::Object(args);
    let text = args.to_string();
    let size = text.len();
    if size > max_argument_bytes {
        return Err(IntentError::TooLarge(size, max_argument_bytes));
    }
    idem_core::check_depth(&args).map_err(IntentError::Fingerprint)?;
    // The server receives the exact integer, the fingerprint its nearest double: refuse what
    // they would disagree on, as the HTTP API does (json_number).
    idem_core::json_number::check_numbers(&text).map_err(|e| IntentError::Number(e.to_string()))?;
    let named = match intent {
        None => args.clone(),
        Some(fields) => {
            Value::Object(fields.iter().map(|p| (p.clone(), args.pointer(p).cloned().unwrap_or(Value::Null))).collect())
        }
    };
    let fp = |v: &Value| fingerprint(v, None).map(|f| f.0).map_err(|e| IntentError::Fingerprint(e.to_string()));
    let h = fp(&json!({"task": task, "tool": tool, "intent": named}))?;
    let key = format!("mcp:{server}:{}:{}:{}", segment(task, 64), segment(tool, 96), &h[..16]);
    // A task id like 555-123-4567 reads as a phone number to the key rule: hashed then.
    let key = match idem_core::IdempotencyKey::parse(&key) {
        Ok(_) => key,
        Err(_) => format!("mcp:{server}:t{}:{}:{}", &sha256_hex(task.as_bytes())[..16], segment(tool, 96), &h[..16]),
    };
    let fingerprint = fp(&json!({"arguments": args}))?;
    let payload = json!({"server": server, "task_id": task, "tool": tool, "arguments": args});
    Ok(Intent { key, fingerprint, payload })
}

/// The top-level argument names whose values differ between the arguments a record was
/// made with (`stored`, its payload's `arguments`) and a refused call's (`now`), sorted.
pub fn differing_arguments(stored: &Value, now: &Value) -> Vec<String> {
    let empty = Map::new();
    let a = stored.get("arguments").and_then(Value::as_object).unwrap_or(&empty);
    let b = now.get("arguments").and_then(Value::as_object).unwrap_or(&empty);
    let same = |x: Option<&Value>, y: Option<&Value>| match (x, y) {
        (Some(x), Some(y)) => fingerprint(x, None).ok() == fingerprint(y, None).ok(),
        (None, None) => true,
        _ => false,
    };
    let mut names: Vec<String> = a.keys().chain(b.keys()).filter(|k| !same(a.get(*k), b.get(*k))).cloned().collect();
    names.sort();
    names.dedup();
    names
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(v: Value) -> Map<String, Value> {
        v.as_object().unwrap().clone()
    }

    #[test]
    fn the_key_is_task_tool_and_intent_and_never_random() {
        let a = args(json!({"customer": "c-1", "title": "printer", "request_id": "x"}));
        let i = intent_of("tickets", "task-42", "create_ticket", &a, None, Some("request_id"), 1000).unwrap();
        let again = intent_of("tickets", "task-42", "create_ticket", &a, None, Some("request_id"), 1000).unwrap();
        assert_eq!(i, again);
        assert!(i.key.starts_with("mcp:tickets:task-42:create_ticket:"), "{}", i.key);
        assert_eq!(i.payload["arguments"], json!({"customer": "c-1", "title": "printer"}));
        // The idempotency-key argument is left out of both key and fingerprint.
        let other_rid = args(json!({"customer": "c-1", "title": "printer", "request_id": "y"}));
        assert_eq!(
            intent_of("tickets", "task-42", "create_ticket", &other_rid, None, Some("request_id"), 1000).unwrap(),
            i
        );
        // Another task, tool or server is another operation.
        for (s, t, tool) in [
            ("tickets", "task-43", "create_ticket"),
            ("tickets", "task-42", "close"),
            ("b", "task-42", "create_ticket"),
        ] {
            assert_ne!(intent_of(s, t, tool, &a, None, Some("request_id"), 1000).unwrap().key, i.key);
        }
        // Canonically equal arguments (RFC 8785, NFC) are one intent.
        let nfd = args(json!({"title": "printer", "customer": "c-1"}));
        assert_eq!(intent_of("tickets", "task-42", "create_ticket", &nfd, None, None, 1000).unwrap().key, i.key);
    }

    #[test]
    fn intent_fields_decide_the_key_and_the_rest_the_fingerprint() {
        let f = ["/customer".to_owned()];
        let a = intent_of("s", "t", "x", &args(json!({"customer": "c", "title": "a"})), Some(&f), None, 1000).unwrap();
        let b = intent_of("s", "t", "x", &args(json!({"customer": "c", "title": "b"})), Some(&f), None, 1000).unwrap();
        assert_eq!(a.key, b.key);
        assert_ne!(a.fingerprint, b.fingerprint);
        assert_eq!(differing_arguments(&a.payload, &b.payload), ["title"]);
        let missing = intent_of("s", "t", "x", &args(json!({"title": "a"})), Some(&f), None, 1000).unwrap();
        let null = intent_of("s", "t", "x", &args(json!({"customer": null})), Some(&f), None, 1000).unwrap();
        assert_eq!(missing.key, null.key, "a missing intent field counts as null");
    }

    #[test]
    fn odd_task_ids_are_hashed_bad_ones_refused_and_size_is_bounded() {
        let a = args(json!({}));
        let k = intent_of("s", "555-123-4567", "x", &a, None, None, 100).unwrap().key;
        assert!(idem_core::IdempotencyKey::parse(&k).is_ok() && !k.contains("555-123"), "{k}");
        let k = intent_of("s", "Aufgabe für Zürich: 7", "x", &a, None, None, 100).unwrap().key;
        assert!(k.starts_with("mcp:s:t") && idem_core::IdempotencyKey::parse(&k).is_ok(), "{k}");
        let long_tool = "t".repeat(128);
        assert!(intent_of("s", &"a".repeat(256), &long_tool, &a, None, None, 100).unwrap().key.len() <= 255);
        for bad in ["", "   ", " t", "t\n"] {
            assert!(matches!(intent_of("s", bad, "x", &a, None, None, 100), Err(IntentError::TaskId(_))), "{bad:?}");
        }
        // Integers beyond ±2^53 would fingerprint as their nearest double: refused, the
        // neighbours on both sides and inside objects and arrays alike.
        for n in [json!(9_007_199_254_740_993u64), json!(-9_007_199_254_740_993i64), json!(u64::MAX)] {
            for v in [json!({"id": n}), json!({"order": {"id": n}}), json!({"ids": [1, n]})] {
                assert!(
                    matches!(intent_of("s", "t", "x", &args(v.clone()), None, None, 1000), Err(IntentError::Number(_))),
                    "{v}"
                );
            }
        }
        for fine in [
            json!({"id": 9_007_199_254_740_992u64}),
            json!({"id": -9_007_199_254_740_992i64}),
            json!({"id": "9007199254740993"}),
            json!({"x": 1.5}),
        ] {
            assert!(intent_of("s", "t", "x", &args(fine.clone()), None, None, 1000).is_ok(), "{fine}");
        }
        let big = args(json!({"body": "x".repeat(200)}));
        assert!(matches!(intent_of("s", "t", "x", &big, None, None, 100), Err(IntentError::TooLarge(_, 100))));
    }
}
