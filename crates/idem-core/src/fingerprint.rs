//! Payload fingerprints: SHA-256 over the RFC 8785 (JSON Canonicalization Scheme) form of
//! the payload, or of the caller-named subset of its fields, with every string in Unicode
//! Normalization Form C.
//!
//! The definition, so any client can recompute it:
//!
//! > NFC (Unicode Standard Annex #15) of every string — member names and string values, at
//! > any depth — then RFC 8785 canonical JSON, then SHA-256, printed as 64 lowercase hex
//! > digits.
//!
//! Field order, insignificant whitespace, number spelling (`1`, `1.0`, `1e0`; `-0` and
//! `0`) and canonically equivalent text (`ü` as U+00FC or as `u` + U+0308, Hangul
//! syllables or conjoining jamo, U+212B ANGSTROM SIGN or U+00C5) do not change it.
//! Compatibility equivalents (NFKC: `ﬁ` and `fi`, full-width digits) do: they are other
//! text. Only the fingerprint's input is normalized; the payload is stored and replayed as
//! received. Two member names of one object that are equal after NFC are duplicate members
//! (I-JSON, RFC 7493 §2.3): refused ([`FingerprintError::DuplicateMember`]), never one kept
//! silently. The normalization tables are those of the `unicode-normalization` crate
//! (Unicode 18.0 at 0.1.26); NFC of assigned characters is stable across Unicode versions
//! (Unicode Normalization Stability Policy).
//!
//! Subsets: `fingerprint_fields` is a non-empty list of JSON pointers (RFC 6901). The
//! fingerprint is then taken over the object `{pointer: value}` of the named fields. Every
//! pointer must name a value in the payload (send `null` for an optional field): a typo
//! must not silently switch the check off. Pointers are normalized to NFC too, so a pointer
//! written in either form names the member written in either form, and the subset's
//! member names are the NFC pointers.
//!
//! What a payload may hold at all (no duplicate member names, no number a double does not
//! carry exactly) is checked when it is parsed: [`crate::Payload`].

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use sha2::{Digest, Sha256};
use std::borrow::Cow;
use std::collections::BTreeSet;
use std::fmt;
use unicode_normalization::UnicodeNormalization;

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
    #[error("fingerprint field {0:?} is named twice (pointers are compared in NFC)")]
    DuplicateField(String),
    /// A field that names nothing in the payload (a typo would silently weaken the check).
    #[error(
        "fingerprint field {0:?} names nothing in the payload (pointers are case-sensitive; send null for an absent optional field)"
    )]
    FieldNotFound(String),
    /// An empty list.
    #[error("fingerprint_fields is empty: name at least one field, or leave it out to fingerprint the whole payload")]
    NoFields,
    /// Two member names of one object that are equal once normalized to NFC.
    #[error(
        "duplicate member name {0:?} in the payload once normalized to NFC (Unicode Standard Annex #15): names that differ only in composed or decomposed form are one name (I-JSON, RFC 7493 §2.3)"
    )]
    DuplicateMember(String),
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

/// The fingerprint of `payload`, or of the fields `fields` (JSON pointers, RFC 6901)
/// names: 64 lowercase hex digits of SHA-256 over RFC 8785 canonical JSON of the input with
/// every string in NFC (see the module docs).
///
/// An input whose strings are all NFC already (every ASCII text is) is hashed as it is,
/// without a copy.
///
/// # Errors
/// A [`FingerprintError`] for malformed, repeated (after NFC) or too many pointers, a
/// pointer that names nothing, or member names equal after NFC.
pub fn fingerprint(payload: &Value, fields: Option<&[String]>) -> Result<Fingerprint, FingerprintError> {
    let payload = nfc_value(payload)?;
    let canonical = match fields {
        None => canonical_json(&payload)?,
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
                let f = nfc(f);
                if !seen.insert(f.clone()) {
                    return Err(FingerprintError::DuplicateField(f.into_owned()));
                }
                let v = payload.pointer(&f).ok_or_else(|| FingerprintError::FieldNotFound(f.to_string()))?;
                subset.insert(f.into_owned(), v.clone());
            }
            canonical_json(&Value::Object(subset))?
        }
    };
    Ok(Fingerprint(sha256_hex(canonical.as_bytes())))
}

/// Whether `s` is in NFC. ASCII is checked a word at a time; other text by the quick check
/// of UAX #15 §9, which decides most text without normalizing it; neither allocates.
fn is_nfc(s: &str) -> bool {
    s.is_ascii() || unicode_normalization::is_nfc(s)
}

/// `s` in NFC, borrowed when it is already.
fn nfc(s: &str) -> Cow<'_, str> {
    if is_nfc(s) { Cow::Borrowed(s) } else { Cow::Owned(s.nfc().collect()) }
}

/// `v` with every string and member name in NFC: `v` itself when it is already, else a
/// normalized copy.
///
/// # Errors
/// [`FingerprintError::DuplicateMember`] for member names of one object equal after NFC.
fn nfc_value(v: &Value) -> Result<Cow<'_, Value>, FingerprintError> {
    fn all_nfc(v: &Value) -> bool {
        match v {
            Value::String(s) => is_nfc(s),
            Value::Array(items) => items.iter().all(all_nfc),
            Value::Object(members) => members.iter().all(|(k, v)| is_nfc(k) && all_nfc(v)),
            Value::Null | Value::Bool(_) | Value::Number(_) => true,
        }
    }
    fn normalized(v: &Value) -> Result<Value, FingerprintError> {
        Ok(match v {
            Value::String(s) => Value::String(nfc(s).into_owned()),
            Value::Array(items) => Value::Array(items.iter().map(normalized).collect::<Result<_, _>>()?),
            Value::Object(members) => {
                let mut out = Map::new();
                for (k, v) in members {
                    let k = nfc(k).into_owned();
                    if out.contains_key(&k) {
                        return Err(FingerprintError::DuplicateMember(k));
                    }
                    out.insert(k, normalized(v)?);
                }
                Value::Object(out)
            }
            Value::Null | Value::Bool(_) | Value::Number(_) => v.clone(),
        })
    }
    if all_nfc(v) { Ok(Cow::Borrowed(v)) } else { normalized(v).map(Cow::Owned) }
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

    /// The issue's pair, and its neighbours: canonically equivalent text is one fingerprint.
    #[test]
    fn canonically_equivalent_text_fingerprints_alike() {
        for (composed, decomposed) in [
            // ü as U+00FC, and as u + U+0308 COMBINING DIAERESIS.
            (r#"{"city":"Zürich"}"#, "{\"city\":\"Zu\u{0308}rich\"}"),
            // Precomposed Hangul syllables, and conjoining jamo.
            ("[\"\u{D55C}\u{AD6D}\"]", "[\"\u{1112}\u{1161}\u{11AB}\u{1100}\u{116E}\u{11A8}\"]"),
            // U+00C5, and U+212B ANGSTROM SIGN (a singleton: NFC never keeps it) or A + ring.
            ("\"\u{00C5}\"", "\"\u{212B}\""),
            ("\"\u{00C5}\"", "\"A\u{030A}\""),
            // Member names, at any depth, and values inside arrays.
            (
                "{\"Z\u{00FC}rich\":{\"caf\u{00E9}\":[\"\u{00E9}\"]}}",
                "{\"Zu\u{0308}rich\":{\"cafe\u{0301}\":[\"e\u{0301}\"]}}",
            ),
            // JSON escapes are decoded first.
            (r#"{"w":"caf\u00e9"}"#, r#"{"w":"cafe\u0301"}"#),
            // Combining marks in either order (canonical ordering by combining class).
            ("\"\u{1E0B}\u{0323}\"", "\"d\u{0307}\u{0323}\""),
        ] {
            assert_eq!(fp(composed), fp(decomposed), "{composed} vs {decomposed}");
        }
        // What a client computes: NFC, then RFC 8785, then SHA-256.
        assert_eq!(fp("{\"city\":\"Zu\u{0308}rich\"}").0, sha256_hex("{\"city\":\"Z\u{00FC}rich\"}".as_bytes()));
    }

    #[test]
    fn other_text_stays_other() {
        // Compatibility equivalents (NFKC) are not canonical equivalents.
        assert_ne!(fp("\"\u{FB01}le\""), fp("\"file\""));
        assert_ne!(fp("\"\u{FF11}\""), fp("\"1\""));
        assert_ne!(fp(r#"{"city":"Zürich"}"#), fp(r#"{"city":"Zurich"}"#));
        assert_ne!(fp(r#"{"city":"Zürich"}"#), fp(r#"{"City":"Zürich"}"#));
    }

    #[test]
    fn member_names_equal_after_nfc_are_duplicates() {
        for (text, name) in [
            ("{\"Z\u{00FC}rich\":1,\"Zu\u{0308}rich\":1}", "Z\u{00FC}rich"),
            ("[{\"a\":{\"\u{212B}\":1,\"\u{00C5}\":2}}]", "\u{00C5}"),
        ] {
            let v = serde_json::from_str::<Payload>(text).unwrap().0;
            assert_eq!(fingerprint(&v, None), Err(FingerprintError::DuplicateMember(name.into())), "{text}");
            // Also when only other fields are fingerprinted: never one kept silently.
            let e = fingerprint(&json!({"x": 1, "p": v}), Some(&["/x".to_string()]));
            assert_eq!(e, Err(FingerprintError::DuplicateMember(name.into())), "{text}");
        }
    }

    #[test]
    fn pointers_name_members_in_either_form() {
        let nfc_name = json!({"Z\u{00FC}rich": "x", "trace": 1});
        let nfd_name = json!({"Zu\u{0308}rich": "x", "trace": 2});
        let by_nfd = vec!["/Zu\u{0308}rich".to_string()];
        let by_nfc = vec!["/Z\u{00FC}rich".to_string()];
        let a = fingerprint(&nfc_name, Some(&by_nfd)).unwrap();
        assert_eq!(a, fingerprint(&nfd_name, Some(&by_nfc)).unwrap());
        assert_eq!(a, fingerprint(&nfc_name, Some(&by_nfc)).unwrap());
        assert_ne!(a, fingerprint(&json!({"Z\u{00FC}rich": "y"}), Some(&by_nfc)).unwrap());
        let twice = vec!["/Z\u{00FC}rich".to_string(), "/Zu\u{0308}rich".to_string()];
        assert_eq!(
            fingerprint(&nfc_name, Some(&twice)),
            Err(FingerprintError::DuplicateField("/Z\u{00FC}rich".into()))
        );
        // Nested: each reference token is normalized, escapes (~1 for '/') still apply.
        let nested = json!({"a/\u{00E9}": [{"\u{212B}": true}]});
        assert!(fingerprint(&nested, Some(&["/a~1e\u{0301}/0/\u{00C5}".to_string()])).is_ok());
    }

    /// The fast path: NFC input (all ASCII text is) is fingerprinted without a copy.
    #[test]
    fn nfc_input_is_not_copied() {
        for v in [json!({"to": "a", "n": [1, "b"]}), json!({"Z\u{00FC}rich": ["\u{D55C}\u{AD6D}", "\u{65E5}\u{672C}"]})]
        {
            assert!(matches!(nfc_value(&v), Ok(Cow::Borrowed(_))), "{v}");
        }
        assert!(matches!(nfc_value(&json!(["x", "Zu\u{0308}rich"])), Ok(Cow::Owned(_))));
        assert!(matches!(nfc_value(&json!({"\u{212B}": 1})), Ok(Cow::Owned(_))));
    }

    mod properties {
        use super::*;
        use proptest::prelude::*;
        use unicode_normalization::UnicodeNormalization;

        /// Text rich in what normalization changes: letters that compose, combining marks
        /// of several classes, Hangul, singletons, and anything else.
        fn text() -> impl Strategy<Value = String> {
            let pieces = prop_oneof![
                "[a-zA-Z0-9 ]",
                "[\u{00C0}-\u{017F}]",
                "[\u{0300}-\u{036F}]",
                "[\u{0591}-\u{05C7}]",
                "[\u{1100}-\u{11FF}]",
                "[\u{AC00}-\u{D7A3}]",
                "[\u{2126}\u{212A}\u{212B}\u{1E00}-\u{1EFF}]",
                any::<char>().prop_map(String::from),
            ];
            proptest::collection::vec(pieces, 0..12).prop_map(|v| v.concat())
        }

        proptest! {
            /// A string in NFC, NFD or as generated fingerprints alike, as a value and as a
            /// member name, at any depth.
            #[test]
            fn nfc_and_nfd_forms_fingerprint_alike(s in text(), t in text()) {
                let forms = |s: &str| [s.to_string(), s.nfc().collect::<String>(), s.nfd().collect::<String>()];
                let [a, b, c] = forms(&s);
                let [x, _, z] = forms(&t);
                let one = fingerprint(&json!({ a.clone(): [x.clone()], "k": {"v": b.clone()} }), None).unwrap();
                let two = fingerprint(&json!({ c.clone(): [z.clone()], "k": {"v": c.clone()} }), None).unwrap();
                prop_assert_eq!(one, two);
                // Pointers in any form name the member in any form.
                let field = vec![format!("/{}", c.replace('~', "~0").replace('/', "~1"))];
                let by_nfd = fingerprint(&json!({ a: x }), Some(&field)).unwrap();
                let field = vec![format!("/{}", b.replace('~', "~0").replace('/', "~1"))];
                prop_assert_eq!(by_nfd, fingerprint(&json!({ c: z }), Some(&field)).unwrap());
            }

            /// The fingerprint is the hash of the RFC 8785 text of the NFC input, and
            /// equal fingerprints mean equal NFC text.
            #[test]
            fn fingerprint_is_nfc_then_rfc8785_then_sha256(s in text(), t in text()) {
                let nfc_text = canonical_json(&json!([s.nfc().collect::<String>()])).unwrap();
                prop_assert_eq!(fingerprint(&json!([s.clone()]), None).unwrap().0, sha256_hex(nfc_text.as_bytes()));
                let same = fingerprint(&json!([s.clone()]), None) == fingerprint(&json!([t.clone()]), None);
                prop_assert_eq!(same, s.nfc().eq(t.nfc()));
            }
        }
    }
}
