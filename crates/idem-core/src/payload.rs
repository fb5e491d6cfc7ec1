//! [`Payload`]: a client's JSON value (an operation's payload, a completion's `result`, a
//! proxied JSON body), parsed so that what is stored and fingerprinted is exactly what
//! was sent.
//!
//! Two payloads that differ must never share a fingerprint, and a stored value must not
//! silently differ from the one sent, so parsing refuses what I-JSON (RFC 7493) calls
//! non-interoperable:
//! - duplicate member names (§2.3): `serde_json` would keep the last one silently;
//! - number literals an IEEE 754 double does not carry exactly, and integers beyond
//!   ±2^53 (§2.2): see [`crate::json_number`] for the rule (`1e-400` would be stored and
//!   fingerprinted as `0`, `9007199254740993` as `9007199254740992`). Send such numbers
//!   as strings.
//!
//! A value nested deeper than [`MAX_JSON_DEPTH`] levels of arrays and objects is refused
//! too: idem stores it inside wrappers and must always be able to read it back.
//!
//! Member names that are equal only after Unicode normalization (NFC) are refused where
//! the fingerprint is taken ([`crate::fingerprint()`]), since only the fingerprint's
//! input is normalized: the payload is stored as received.

use crate::json_number;
use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use serde_json::{Map, Value};
use std::fmt;

/// Deepest nesting of arrays and objects in a JSON value idem keeps (a payload, a result, a
/// workflow input, a provider's answer): 64 levels. `serde_json` reads at most 128 levels
/// back, and what idem stores sits inside wrappers (a provider's answer two levels down in
/// a result, a record three more in an API list), so a value accepted at this depth is
/// always readable back — by the server, and by the CLI from the API's answers.
pub const MAX_JSON_DEPTH: usize = 64;

/// The nesting depth of `v`: 0 for a scalar, 1 for `[]` or `{}` or an array of scalars,
/// and so on. Iterative: any depth is measured without deep recursion.
pub fn json_depth(v: &Value) -> usize {
    let mut deepest = 0;
    let mut stack = vec![(v, 0usize)];
    while let Some((v, d)) = stack.pop() {
        match v {
            Value::Array(items) => stack.extend(items.iter().map(|i| (i, d + 1))),
            Value::Object(members) => stack.extend(members.values().map(|i| (i, d + 1))),
            _ => {}
        }
        let here = if v.is_array() || v.is_object() { d + 1 } else { d };
        deepest = deepest.max(here);
    }
    deepest
}

/// Checks `v` against [`MAX_JSON_DEPTH`].
///
/// # Errors
/// A one-line message saying how deep it is and the limit.
pub fn check_depth(v: &Value) -> Result<(), String> {
    match json_depth(v) {
        d if d > MAX_JSON_DEPTH => Err(format!(
            "the value is nested {d} levels deep; idem keeps at most {MAX_JSON_DEPTH} levels of arrays and objects"
        )),
        _ => Ok(()),
    }
}

/// A JSON value parsed with duplicate member names and inexact numbers refused (I-JSON,
/// RFC 7493 §2.2–2.3; the number rule is [`crate::json_number`]).
///
/// Its `Deserialize` reads the value's JSON text (a `serde_json` `RawValue`) to see the
/// number literals as written, so it deserializes from `serde_json` only. An error's text
/// says what was refused and names the member or the literal.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(transparent)]
pub struct Payload(pub Value);

impl<'de> Deserialize<'de> for Payload {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let raw = Box::<RawValue>::deserialize(d)?;
        let text = raw.get();
        json_number::check_numbers(text).map_err(de::Error::custom)?;
        let mut inner = serde_json::Deserializer::from_str(text);
        let value = StrictValue.deserialize(&mut inner).map_err(|e| de::Error::custom(without_position(&e)))?;
        check_depth(&value).map_err(de::Error::custom)?;
        Ok(Payload(value))
    }
}

/// A `serde_json` error's message without its " at line L column C": the position is
/// within the payload's own text, and the outer parser adds the position in the body.
fn without_position(e: &serde_json::Error) -> String {
    let text = e.to_string();
    let suffix = format!(" at line {} column {}", e.line(), e.column());
    text.strip_suffix(&suffix).map_or_else(|| text.clone(), str::to_owned)
}

/// Builds a `serde_json::Value`, failing on a repeated member name.
struct StrictValue;

impl<'de> DeserializeSeed<'de> for StrictValue {
    type Value = Value;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for StrictValue {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::from(v))
    }
    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::from(v))
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Value, E> {
        serde_json::Number::from_f64(v).map(Value::Number).ok_or_else(|| E::custom("a number that is not finite"))
    }
    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_owned()))
    }
    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }
    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_none<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        d.deserialize_any(StrictValue)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut items = Vec::new();
        while let Some(v) = seq.next_element_seed(StrictValue)? {
            items.push(v);
        }
        Ok(Value::Array(items))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut out = Map::new();
        while let Some(k) = map.next_key::<String>()? {
            if out.contains_key(&k) {
                return Err(de::Error::custom(format_args!(
                    "duplicate member name {k:?} in the payload (I-JSON, RFC 7493 §2.3)"
                )));
            }
            let v = map.next_value_seed(StrictValue)?;
            out.insert(k, v);
        }
        Ok(Value::Object(out))
    }
}

/// A hint for serde_json's parse error `text` where its own words do not say what is wrong
/// to someone who wrote JSON by hand (empty when they do): used by the server's 400s and
/// the CLI's one-line errors alike. serde's "key must be a string" means an object member
/// name, not the idempotency key.
#[must_use]
pub fn json_error_hint(text: &str) -> &'static str {
    if text.contains("hex escape") || text.contains("surrogate") {
        " (a \\uD800-\\uDFFF escape must be one half of a surrogate pair, followed or preceded by the other: a string must be Unicode text)"
    } else if text.contains("recursion limit") {
        " (idem keeps at most 64 levels of arrays and objects)"
    } else if text.contains("key must be a string") {
        " (that is an object's member name: member names are strings in double quotes, as in {\"to\": \"c-1\"})"
    } else {
        ""
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(text: &str) -> Result<Value, String> {
        serde_json::from_str::<Payload>(text).map(|p| p.0).map_err(|e| e.to_string())
    }

    fn nested(depth: usize) -> String {
        format!("{}{}", "[".repeat(depth), "]".repeat(depth))
    }

    #[test]
    fn depth_is_counted_and_bounded_so_what_is_kept_reads_back() {
        assert_eq!(json_depth(&json!(1)), 0);
        assert_eq!(json_depth(&json!([])), 1);
        assert_eq!(json_depth(&json!({"a": [1, {"b": {}}], "c": 2})), 4);
        for d in [1, MAX_JSON_DEPTH - 1, MAX_JSON_DEPTH] {
            let v = parse(&nested(d)).unwrap();
            assert_eq!(json_depth(&v), d);
            // What idem stores around it (a result's body, an API list) still reads back.
            let wrapped = json!({"items": [{"result": {"status": 200, "body": v}}]});
            serde_json::from_str::<Value>(&wrapped.to_string()).unwrap();
        }
        for d in [MAX_JSON_DEPTH + 1, 100, 126] {
            let e = parse(&nested(d)).unwrap_err();
            assert!(e.contains(&format!("nested {d} levels deep")) && e.contains("at most 64"), "{e}");
        }
        let deep_object = format!("{}1{}", r#"{"a":"#.repeat(MAX_JSON_DEPTH + 1), "}".repeat(MAX_JSON_DEPTH + 1));
        assert!(parse(&deep_object).unwrap_err().contains("levels deep"));
    }

    #[test]
    fn duplicate_members_are_refused() {
        let e = parse(r#"{"a":1,"b":{"c":1,"c":2}}"#).unwrap_err();
        assert!(e.contains("duplicate member name \"c\""), "{e}");
        assert!(e.matches(" at line ").count() <= 1, "no position within the payload's own text: {e}");
    }

    #[test]
    fn numbers_beyond_2_pow_53_are_refused() {
        for text in [
            "9007199254740993",
            "-9007199254740993",
            "1795999717611524801",
            "1e300",
            "123456789012345678901234567890",
            "9007199254740993.0",
            "9007199254740992.5",
            "1e16",
        ] {
            let e = parse(&format!(r#"{{"id":{text}}}"#)).unwrap_err();
            assert!(e.contains("2^53") && e.contains(text), "{text}: {e}");
        }
        // 2^53 itself is exact in any spelling.
        for ok in ["9007199254740992", "-9007199254740992", "9007199254740992.0", "1.5", "0", "9007199254740991.0"] {
            assert!(parse(&format!(r#"{{"id":{ok}}}"#)).is_ok(), "{ok}");
        }
    }

    /// The issue's input and its neighbours: a literal a double does not carry exactly is
    /// refused, naming it, wherever it sits; exact ones are kept as their double.
    #[test]
    fn inexact_numbers_are_refused_wherever_they_are() {
        for (text, shown) in [
            (r#"{"n":1e-400}"#, "1e-400"),
            (r#"{"n":1e400}"#, "1e400"),
            (r#"{"n":4e-324}"#, "4e-324"),
            (r#"{"n":1.00000000000000000001}"#, "1.00000000000000000001"),
            (r#"[1,{"a":[{"b":-1e-400}]}]"#, "-1e-400"),
            ("1e-400", "1e-400"),
        ] {
            let e = parse(text).unwrap_err();
            assert!(e.contains(shown) && e.contains("send it as a string"), "{text}: {e}");
        }
        assert_eq!(parse(r#"{"n":5e-324,"z":-0,"t":"1e-400"}"#).unwrap(), json!({"n":5e-324,"z":-0.0,"t":"1e-400"}));
        assert_eq!(parse("[0.1,1.0,1e0]").unwrap(), json!([0.1, 1.0, 1.0]));
    }

    /// Inside a larger body (as the HTTP API and the CLI parse it), and from a `Value`.
    #[test]
    fn works_as_a_field_and_from_a_value() {
        #[derive(Deserialize)]
        struct Body {
            payload: Option<Payload>,
            #[allow(dead_code)]
            n: f64,
        }
        let b: Body = serde_json::from_str(r#"{"n":1e-400,"payload":{"to":"a"}}"#).unwrap();
        assert_eq!(b.payload.unwrap().0, json!({"to":"a"}), "only the payload follows the rule");
        let e = serde_json::from_str::<Body>(r#"{"n":1,"payload":{"n":1e-400}}"#).err().unwrap();
        assert!(e.to_string().contains("1e-400"), "{e}");
        assert!(serde_json::from_str::<Body>(r#"{"n":1,"payload":null}"#).unwrap().payload.is_none());
        assert_eq!(serde_json::from_value::<Payload>(json!({"a":[0.1]})).unwrap().0, json!({"a":[0.1]}));
        assert!(serde_json::from_reader::<_, Payload>(&b"{\"n\":4e-324}"[..]).is_err());
    }
}
