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
//! What a payload may hold at all (no duplicate member names, no number a double does not
//! carry exactly) is checked when it is parsed: [`crate::Payload`].

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
    /// A value RFC 8785 cannot express (none arise from parsed JSON).
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

#[cfg(test)]
mod tests {
    #[test]
    fn hex_is_two_lowercase_digits_per_byte() {
        assert_eq!(super::hex(&[0x00, 0x0f, 0xa5, 0xff]), "000fa5ff");
        assert_eq!(super::hex(&[]), "");
    }

    use super::*;
    use crate::Payload;
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
    fn rejects_bad_fields() {
        let v = json!({"a": 1});
        assert!(matches!(fingerprint(&v, Some(&["to".into()])), Err(FingerprintError::BadPointer(_))));
        assert!(matches!(fingerprint(&v, Some(&["/a".into(), "/a".into()])), Err(FingerprintError::DuplicateField(_))));
        let many: Vec<String> = (0..65).map(|i| format!("/f{i}")).collect();
        assert!(matches!(fingerprint(&v, Some(&many)), Err(FingerprintError::TooManyFields(65))));
    }

    #[test]
    fn zero_and_minus_zero_are_one_number() {
        assert_eq!(fp(r#"{"n":0}"#), fp(r#"{"n":-0}"#));
        assert_eq!(fp(r#"{"n":0}"#), fp(r#"{"n":-0.0e5}"#));
        assert_ne!(fp(r#"{"n":0}"#), fp(r#"{"n":5e-324}"#));
    }
}
