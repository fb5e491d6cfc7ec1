//! Payload fingerprints: SHA-256 over the RFC 8785 (JSON Canonicalization Scheme) form of
//! the payload, or of the caller-named subset of its fields.
//!
//! Because the hash is taken over the canonical form, field order, insignificant
//! whitespace and number spelling (`1`, `1.0`, `1e0`) do not change it. Any client can
//! recompute it: canonicalize with RFC 8785, hash with SHA-256, print lowercase hex.
//!
//! Subsets: `fingerprint_fields` is a non-empty list of JSON pointers (RFC 6901). The
//! fingerprint is then taken over the object `{pointer: value}` of the named fields. Every
//! pointer must name a value in the payload (send `null` for an optional field): a typo
//! must not silently switch the check off.
//!
//! Two payloads that differ must never share a fingerprint, so [`Payload`]'s `Deserialize`
//! refuses, before hashing, what I-JSON (RFC 7493) calls non-interoperable:
//! - duplicate member names (§2.3): `serde_json` would keep the last one silently;
//! - numbers of magnitude above 2^53 (§2.2): RFC 8785 writes numbers as IEEE 754 doubles,
//!   so `9007199254740993` and `9007199254740992` would canonicalize alike. Send large
//!   identifiers as strings.

use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use sha2::{Digest, Sha256};
use std::collections::BTreeSet;
use std::fmt;

/// Most fingerprint fields a request may name.
pub const MAX_FINGERPRINT_FIELDS: usize = 64;

/// A fingerprint: 64 lowercase hex digits of a SHA-256 digest.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Fingerprint(pub String);

impl Fingerprint {
    /// The 64 hex digits.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Why a fingerprint could not be computed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FingerprintError {
    /// A field that is not a JSON pointer.
    #[error("fingerprint field {0:?} is not a JSON pointer (RFC 6901): it must be empty or start with '/'")]
    BadPointer(String),
    /// More fields than allowed.
    #[error("fingerprint_fields names {0} fields; at most {MAX_FINGERPRINT_FIELDS} are allowed")]
    TooManyFields(usize),
    /// The same field twice.
    #[error("fingerprint field {0:?} is named twice")]
    DuplicateField(String),
    /// A field that names nothing in the payload (a typo would silently weaken the check).
    #[error(
        "fingerprint field {0:?} names nothing in the payload (pointers are case-sensitive; send null for an absent optional field)"
    )]
    FieldNotFound(String),
    /// An empty list.
    #[error("fingerprint_fields is empty: name at least one field, or leave it out to fingerprint the whole payload")]
    NoFields,
    /// The payload is not I-JSON (RFC 7493): duplicate members, numbers beyond 2^53.
    #[error("the payload cannot be canonicalized (RFC 8785): {0}")]
    Canonicalize(String),
}

/// SHA-256 hex of `bytes`.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

/// `bytes` as lowercase hex, two digits per byte (a table lookup: this runs several times
/// per request, and `format!` per byte showed in profiles).
pub fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        out.push(char::from(DIGITS[usize::from(b >> 4)]));
        out.push(char::from(DIGITS[usize::from(b & 0x0f)]));
    }
    out
}

/// The RFC 8785 canonical text of `value`.
///
/// # Errors
/// [`FingerprintError::Canonicalize`] for values RFC 8785 cannot express (none arise from
/// parsed JSON, whose numbers are finite).
pub fn canonical_json(value: &Value) -> Result<String, FingerprintError> {
    serde_json_canonicalizer::to_string(value).map_err(|e| FingerprintError::Canonicalize(e.to_string()))
}

/// The fingerprint of `payload`, or of the fields `fields` (JSON pointers) names.
///
/// # Errors
/// A [`FingerprintError`] for malformed, repeated or too many pointers.
pub fn fingerprint(payload: &Value, fields: Option<&[String]>) -> Result<Fingerprint, FingerprintError> {
    let canonical = match fields {
        None => canonical_json(payload)?,
        Some(fields) => {
            if fields.is_empty() {
                return Err(FingerprintError::NoFields);
            }
            if fields.len() > MAX_FINGERPRINT_FIELDS {
                return Err(FingerprintError::TooManyFields(fields.len()));
            }
            let mut seen = BTreeSet::new();
            let mut subset = Map::new();
            for f in fields {
                if !(f.is_empty() || f.starts_with('/')) {
                    return Err(FingerprintError::BadPointer(f.clone()));
                }
                if !seen.insert(f.as_str()) {
                    return Err(FingerprintError::DuplicateField(f.clone()));
                }
                let v = payload.pointer(f).ok_or_else(|| FingerprintError::FieldNotFound(f.clone()))?;
                subset.insert(f.clone(), v.clone());
            }
            canonical_json(&Value::Object(subset))?
        }
    };
    Ok(Fingerprint(sha256_hex(canonical.as_bytes())))
}

/// A JSON payload parsed with duplicate member names refused (I-JSON, RFC 7493 §2.3).
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(transparent)]
pub struct Payload(pub Value);

impl<'de> Deserialize<'de> for Payload {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        StrictValue.deserialize(d).map(Payload)
    }
}

/// Largest integer magnitude a double holds exactly: 2^53 (I-JSON, RFC 7493 §2.2).
pub const MAX_EXACT_INTEGER: u64 = 1 << 53;

fn too_big<E: de::Error>(shown: impl fmt::Display) -> E {
    E::custom(format_args!(
        "the number {shown} is beyond ±2^53, which JSON numbers cannot carry exactly (I-JSON, RFC 7493 §2.2); send it as a string"
    ))
}

/// Builds a `serde_json::Value`, failing on a repeated member name or an inexact number.
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
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Value, E> {
        if v.unsigned_abs() > MAX_EXACT_INTEGER {
            return Err(too_big(v));
        }
        Ok(Value::from(v))
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Value, E> {
        if v > MAX_EXACT_INTEGER {
            return Err(too_big(v));
        }
        Ok(Value::from(v))
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Value, E> {
        // A literal with a fraction or exponent is parsed to the nearest double first:
        // 9007199254740993.0 arrives as 2^53 already, so 2^53 itself is refused here.
        if v.abs() >= MAX_EXACT_INTEGER as f64 {
            return Err(too_big(v));
        }
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

#[cfg(test)]
mod tests {
    #[test]
    fn hex_is_two_lowercase_digits_per_byte() {
        assert_eq!(super::hex(&[0x00, 0x0f, 0xa5, 0xff]), "000fa5ff");
        assert_eq!(super::hex(&[]), "");
    }

    use super::*;
    use serde_json::json;

    fn fp(s: &str) -> Fingerprint {
        let p: Payload = serde_json::from_str(s).unwrap();
        fingerprint(&p.0, None).unwrap()
    }

    #[test]
    fn order_whitespace_and_number_spelling_do_not_matter() {
        let a = fp(r#"{"to":"a","n":1,"x":[1,2]}"#);
        assert_eq!(a, fp(r#"{ "x" : [1, 2], "n": 1.0, "to": "a" }"#));
        assert_eq!(a, fp(r#"{"n":1e0,"to":"a","x":[1,2.0]}"#));
        assert_ne!(a, fp(r#"{"to":"b","n":1,"x":[1,2]}"#));
        assert_ne!(a, fp(r#"{"to":"a","n":1,"x":[2,1]}"#));
    }

    #[test]
    fn matches_rfc8785_hash_of_known_text() {
        // RFC 8785 sorts keys and writes numbers the ECMAScript way.
        let v = json!({"b": 2, "a": [1.5, "é", null]});
        assert_eq!(canonical_json(&v).unwrap(), r#"{"a":[1.5,"é",null],"b":2}"#);
        // sha256 of the empty object text "{}".
        assert_eq!(
            fingerprint(&json!({}), None).unwrap().0,
            "44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a"
        );
    }

    #[test]
    fn subset_ignores_other_fields_and_refuses_pointers_that_name_nothing() {
        let f = vec!["/to".to_string(), "/template".to_string()];
        let a = fingerprint(&json!({"to":"x","template":"t","trace":"1"}), Some(&f)).unwrap();
        let b = fingerprint(&json!({"template":"t","to":"x","trace":"2"}), Some(&f)).unwrap();
        assert_eq!(a, b);
        let c = fingerprint(&json!({"template":"t","to":"y","trace":"2"}), Some(&f)).unwrap();
        assert_ne!(a, c);
        assert_eq!(fingerprint(&json!({"to":"x"}), Some(&f)), Err(FingerprintError::FieldNotFound("/template".into())));
        assert!(fingerprint(&json!({"to":"x","template":null}), Some(&f)).is_ok());
        assert_eq!(fingerprint(&json!({}), Some(&[])), Err(FingerprintError::NoFields));
    }

    #[test]
    fn numbers_beyond_2_pow_53_are_refused() {
        for text in
            ["9007199254740993", "-9007199254740993", "1795999717611524801", "1e300", "123456789012345678901234567890"]
        {
            let e = serde_json::from_str::<Payload>(&format!(r#"{{"id":{text}}}"#)).unwrap_err();
            assert!(e.to_string().contains("2^53"), "{text}: {e}");
        }
        for text in ["9007199254740993.0", "9007199254740992.5", "9007199254740992.0", "1e16"] {
            let e = serde_json::from_str::<Payload>(&format!(r#"{{"id":{text}}}"#)).unwrap_err();
            assert!(e.to_string().contains("2^53"), "{text}: {e}");
        }
        for ok in ["9007199254740992", "-9007199254740992", "1.5", "0", "9007199254740991.0"] {
            assert!(serde_json::from_str::<Payload>(&format!(r#"{{"id":{ok}}}"#)).is_ok(), "{ok}");
        }
    }

    #[test]
    fn rejects_bad_fields() {
        let v = json!({"a": 1});
        assert!(matches!(fingerprint(&v, Some(&["to".into()])), Err(FingerprintError::BadPointer(_))));
        assert!(matches!(fingerprint(&v, Some(&["/a".into(), "/a".into()])), Err(FingerprintError::DuplicateField(_))));
        let many: Vec<String> = (0..65).map(|i| format!("/f{i}")).collect();
        assert!(matches!(fingerprint(&v, Some(&many)), Err(FingerprintError::TooManyFields(65))));
    }

    #[test]
    fn duplicate_members_are_refused() {
        let e = serde_json::from_str::<Payload>(r#"{"a":1,"b":{"c":1,"c":2}}"#).unwrap_err();
        assert!(e.to_string().contains("duplicate member name \"c\""), "{e}");
    }
}
