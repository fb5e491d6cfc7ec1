//! Building a step's input from the instance input and earlier steps' results.
//!
//! A template is any JSON value. Inside it:
//! - an object with exactly one member `from` whose value is a JSON pointer (RFC 6901) is a
//!   **reference**, replaced by the value the pointer names, with its type kept (a number
//!   stays a number, an object an object);
//! - an object with exactly one member `literal` is replaced by that member's value as it
//!   is (to write an object that itself has a single `from` member);
//! - everything else is copied.
//!
//! Pointers are taken in this document:
//! ```text
//! { "input":    <the instance input>,
//!   "instance": { "id": "ORD-7:intake", "workflow": "order-intake", "source_event": "evt_1" | null },
//!   "steps":    { "<step>": { "result": <its stored result>, "provider_ref": "<its evidence>" }, … } }
//! ```
//! so `{"from": "/input/customer"}`, `{"from": "/steps/create_order/result/id"}`,
//! `{"from": "/instance/id"}`. Only SUCCEEDED steps appear under `steps`. A pointer that
//! names nothing is an error naming the pointer — never a silent `null` (an explicit JSON
//! `null` at the pointer is a value and is kept). The whole template `null` means "the
//! instance input as it is".

use serde_json::{Map, Value};

/// A reference whose pointer names nothing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{pointer:?} names no value (at {at:?} of the input template){}", detail.as_deref().map(|d| format!(": {d}")).unwrap_or_default())]
pub struct InputError {
    /// Where the reference sits in the template (a JSON pointer; empty for the root).
    pub at: String,
    /// The pointer that named nothing.
    pub pointer: String,
    /// More about why, when known.
    pub detail: Option<String>,
}

/// The single member of `obj` if it is the only one and named `name`.
fn only<'a>(obj: &'a Map<String, Value>, name: &str) -> Option<&'a Value> {
    if obj.len() == 1 { obj.get(name) } else { None }
}

/// Escapes a member name for a JSON pointer (RFC 6901 §3: `~` → `~0`, `/` → `~1`).
fn escape(name: &str) -> String {
    name.replace('~', "~0").replace('/', "~1")
}

/// Every reference of `template`, as `(where in the template, pointer)`.
///
/// # Errors
/// A message when a `from` member is not a pointer string.
pub fn references(template: &Value) -> Result<Vec<(String, String)>, String> {
    fn walk(v: &Value, at: &str, out: &mut Vec<(String, String)>) -> Result<(), String> {
        match v {
            Value::Object(obj) => {
                if let Some(from) = only(obj, "from") {
                    match from {
                        Value::String(p) if p.is_empty() || p.starts_with('/') => out.push((at.to_owned(), p.clone())),
                        _ => {
                            return Err(format!(
                                "at {at:?}: a reference is {{\"from\": \"/json/pointer\"}}; write {{\"literal\": …}} for an object with one member named from"
                            ));
                        }
                    }
                } else if only(obj, "literal").is_none() {
                    for (k, v) in obj {
                        walk(v, &format!("{at}/{}", escape(k)), out)?;
                    }
                }
            }
            Value::Array(items) => {
                for (i, v) in items.iter().enumerate() {
                    walk(v, &format!("{at}/{i}"), out)?;
                }
            }
            _ => {}
        }
        Ok(())
    }
    let mut out = Vec::new();
    walk(template, "", &mut out)?;
    Ok(out)
}

/// Builds a step's input: `template` with every reference replaced from `context` (the
/// document of the module docs). `null` gives `context["input"]`.
///
/// # Errors
/// [`InputError`] for the first reference that names nothing.
pub fn build_step_input(template: &Value, context: &Value) -> Result<Value, InputError> {
    fn build(v: &Value, at: &str, ctx: &Value) -> Result<Value, InputError> {
        match v {
            Value::Object(obj) => {
                if let Some(from) = only(obj, "from") {
                    let pointer = from.as_str().unwrap_or_default();
                    return ctx.pointer(pointer).cloned().ok_or_else(|| InputError {
                        at: at.to_owned(),
                        pointer: pointer.to_owned(),
                        detail: missing_detail(pointer, ctx),
                    });
                }
                if let Some(lit) = only(obj, "literal") {
                    return Ok(lit.clone());
                }
                let mut out = Map::with_capacity(obj.len());
                for (k, v) in obj {
                    out.insert(k.clone(), build(v, &format!("{at}/{}", escape(k)), ctx)?);
                }
                Ok(Value::Object(out))
            }
            Value::Array(items) => items
                .iter()
                .enumerate()
                .map(|(i, v)| build(v, &format!("{at}/{i}"), ctx))
                .collect::<Result<Vec<_>, _>>()
                .map(Value::Array),
            other => Ok(other.clone()),
        }
    }
    if template.is_null() {
        return Ok(context.get("input").cloned().unwrap_or(Value::Null));
    }
    build(template, "", context)
}

/// Why `pointer` names nothing: a step that has not succeeded, or a member its result lacks.
fn missing_detail(pointer: &str, ctx: &Value) -> Option<String> {
    let mut parts = pointer.split('/').skip(1);
    if parts.next() == Some("steps") {
        let step = parts.next()?;
        if ctx.pointer(&format!("/steps/{step}")).is_none() {
            return Some(format!("step {step:?} has not succeeded"));
        }
        return Some(format!("the recorded result of step {step:?} has no such member"));
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn ctx() -> Value {
        json!({
            "input": {"customer": "C-1", "amount": 12.5, "lines": [{"sku": "A"}], "note": null},
            "instance": {"id": "ORD-7:intake", "workflow": "order-intake", "source_event": "evt_1"},
            "steps": {"create_order": {"result": {"id": 42, "status": "open"}, "provider_ref": "ord-42"}}
        })
    }

    #[test]
    fn references_keep_their_types() {
        let t = json!({
            "customer": {"from": "/input/customer"},
            "amount": {"from": "/input/amount"},
            "order_id": {"from": "/steps/create_order/result/id"},
            "ref": {"from": "/steps/create_order/provider_ref"},
            "lines": {"from": "/input/lines"},
            "note": {"from": "/input/note"},
            "fixed": ["x", 1, {"from": "/instance/id"}],
            "escaped": {"literal": {"from": "/input"}}
        });
        let out = build_step_input(&t, &ctx()).unwrap();
        assert_eq!(
            out,
            json!({
                "customer": "C-1", "amount": 12.5, "order_id": 42, "ref": "ord-42",
                "lines": [{"sku": "A"}], "note": null, "fixed": ["x", 1, "ORD-7:intake"],
                "escaped": {"from": "/input"}
            })
        );
    }

    #[test]
    fn null_template_is_the_instance_input() {
        assert_eq!(build_step_input(&Value::Null, &ctx()).unwrap(), ctx()["input"]);
    }

    #[test]
    fn a_missing_value_is_an_error_naming_the_pointer_never_a_null() {
        let e = build_step_input(&json!({"a": [{"from": "/input/absent"}]}), &ctx()).unwrap_err();
        assert_eq!((e.at.as_str(), e.pointer.as_str()), ("/a/0", "/input/absent"));
        let e = build_step_input(&json!({"from": "/steps/send/result"}), &ctx()).unwrap_err();
        assert!(e.to_string().contains("has not succeeded"), "{e}");
        let e = build_step_input(&json!({"from": "/steps/create_order/result/nope"}), &ctx()).unwrap_err();
        assert!(e.to_string().contains("no such member"), "{e}");
    }

    #[test]
    fn references_are_listed_with_where_they_sit() {
        let t =
            json!({"a/b": {"from": "/input/x"}, "l": [{"from": "/steps/s/result"}], "lit": {"literal": {"from": 3}}});
        let mut refs = references(&t).unwrap();
        refs.sort();
        assert_eq!(refs, [("/a~1b".into(), "/input/x".into()), ("/l/0".into(), "/steps/s/result".into())]);
        assert!(references(&json!({"from": 3})).is_err());
        assert!(references(&json!({"from": "input"})).is_err());
    }
}
