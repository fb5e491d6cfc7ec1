//! Idempotency keys: the caller's stable name for one business intent.
//!
//! Rules (checked by [`IdempotencyKey::parse`]):
//! - 1 to 255 characters ([`MAX_KEY_LEN`]), each printable ASCII (0x20–0x7E). This is the
//!   character set of an RFC 8941 sf-string, which the IETF httpapi Idempotency-Key draft
//!   (draft-ietf-httpapi-idempotency-key-header-07 §2) uses for the header value, so a key
//!   taken here can also travel in that header.
//! - No leading or trailing space (they would be invisible in logs and the UI).
//! - Not `.` or `..`: URLs treat those path segments as "this/parent directory" (RFC 3986
//!   §5.2.4), so `/v1/operations/{key}` could never address them.
//! - No personal data: a key is logged, shown to operators and kept in tombstones long
//!   after the payload is gone, so keys that contain an e-mail address or a phone number
//!   are refused. Derive keys from business identifiers (`INQ-001:confirmation:v1`), not
//!   from a person's contact data.
//!
//! The personal-data check is a conservative detector, not a proof:
//! - e-mail: `local@domain.tld` (or `local%40domain.tld`) with a non-empty local part, a
//!   dotted domain and a top-level label that starts with at least two letters (so
//!   `jane@example.com-2` is caught, `build@host.x86` is not);
//! - phone: a `+` that does not follow a letter, digit or dot, followed by 8–15 digits
//!   (E.164, separators ` .-()` allowed; so `release-1.2.3+20261130` is fine), or the North
//!   American grouping `(ddd) ddd-dddd` / `ddd-ddd-dddd` / `ddd.ddd.dddd` standing alone.
//!   Plain runs of digits are *not* flagged, because order numbers and dates look like that.

use serde::{Deserialize, Serialize};
use std::fmt;

/// Longest accepted key, in bytes (= characters, keys are ASCII).
pub const MAX_KEY_LEN: usize = 255;

/// Why a key was refused. Each variant renders as a one-line message for the caller.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    /// No characters.
    #[error("the idempotency key is empty; it must have 1 to {MAX_KEY_LEN} characters")]
    Empty,
    /// More than [`MAX_KEY_LEN`] characters (the count).
    #[error("the idempotency key has {0} characters; at most {MAX_KEY_LEN} are allowed")]
    TooLong(usize),
    /// A byte outside 0x20–0x7E (its position).
    #[error("the idempotency key has a character outside printable ASCII (0x20-0x7E) at position {0}")]
    NotPrintableAscii(usize),
    /// Leading or trailing space.
    #[error("the idempotency key starts or ends with a space")]
    SurroundingSpace,
    /// `.` or `..`, which URLs resolve as path steps.
    #[error("the idempotency key cannot be \".\" or \"..\": URLs treat those as directory steps")]
    DotSegment,
    /// Looks like it holds an e-mail address (personal data).
    #[error(
        "the idempotency key contains an e-mail address; keys are logged and kept after the payload expires, so derive them from business ids, not personal data"
    )]
    ContainsEmail,
    /// Looks like it holds a phone number (personal data).
    #[error(
        "the idempotency key contains a phone number; keys are logged and kept after the payload expires, so derive them from business ids, not personal data"
    )]
    ContainsPhone,
}

/// A validated idempotency key (see the module docs for the rules).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct IdempotencyKey(String);

impl IdempotencyKey {
    /// Validates `raw` and wraps it.
    ///
    /// # Errors
    /// A [`KeyError`] naming the first rule the key breaks.
    pub fn parse(raw: &str) -> Result<Self, KeyError> {
        if raw.is_empty() {
            return Err(KeyError::Empty);
        }
        if raw.len() > MAX_KEY_LEN {
            return Err(KeyError::TooLong(raw.chars().count()));
        }
        if let Some(pos) = raw.bytes().position(|b| !(0x20..=0x7e).contains(&b)) {
            return Err(KeyError::NotPrintableAscii(pos));
        }
        if raw.starts_with(' ') || raw.ends_with(' ') {
            return Err(KeyError::SurroundingSpace);
        }
        if raw == "." || raw == ".." {
            return Err(KeyError::DotSegment);
        }
        if contains_email(raw) {
            return Err(KeyError::ContainsEmail);
        }
        if contains_phone(raw) {
            return Err(KeyError::ContainsPhone);
        }
        Ok(Self(raw.to_owned()))
    }

    /// The key as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl TryFrom<String> for IdempotencyKey {
    type Error = KeyError;
    fn try_from(value: String) -> Result<Self, Self::Error> {
        Self::parse(&value)
    }
}

impl From<IdempotencyKey> for String {
    fn from(k: IdempotencyKey) -> String {
        k.0
    }
}

impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

fn is_local_char(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"._%+-".contains(&b)
}

fn is_domain_char(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'-' || b == b'.'
}

/// True when `s` holds something shaped like `local@domain.tld`, also with the `@`
/// percent-encoded (`%40`) and with anything glued to the top-level label
/// (`jane@example.com-2`, `jane@example.com2`).
fn contains_email(s: &str) -> bool {
    let decoded;
    let s = if s.contains("%40") {
        decoded = s.replace("%40", "@");
        decoded.as_str()
    } else {
        s
    };
    let b = s.as_bytes();
    b.iter().enumerate().any(|(at, &c)| {
        if c != b'@' || at == 0 || !is_local_char(b[at - 1]) {
            return false;
        }
        let domain_end = b[at + 1..].iter().position(|&c| !is_domain_char(c)).map_or(b.len(), |p| at + 1 + p);
        let domain = s[at + 1..domain_end].trim_end_matches('.');
        let mut labels = domain.split('.');
        let first = labels.next().unwrap_or("");
        // The top-level label's leading letters: `com` in `com`, `com-2` and `com2`.
        let last = domain.rsplit('.').next().unwrap_or("");
        let tld = last.bytes().take_while(u8::is_ascii_alphabetic).count();
        !first.is_empty() && domain.contains('.') && tld >= 2
    })
}

/// True when `s` holds an E.164 number (`+` and 8–15 digits) or a North American
/// grouped number (3-3-4 digits with separators) that stands alone.
fn contains_phone(s: &str) -> bool {
    let b = s.as_bytes();
    let is_sep = |c: u8| b" .-()".contains(&c);
    // E.164: '+' then digits with optional separators.
    for (i, &c) in b.iter().enumerate() {
        let after_word = i > 0 && (b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'.');
        if c == b'+' && !after_word {
            let digits = b[i + 1..]
                .iter()
                .take_while(|&&c| c.is_ascii_digit() || is_sep(c))
                .filter(|c| c.is_ascii_digit())
                .count();
            if (8..=15).contains(&digits) {
                return true;
            }
        }
    }
    // North American grouping: ddd SEP ddd SEP dddd, optional parentheses round the area code.
    let groups = |start: usize| -> Option<usize> {
        let mut i = start;
        let take_digits = |n: usize, i: &mut usize| -> bool {
            let ok = b.len() >= *i + n && b[*i..*i + n].iter().all(u8::is_ascii_digit);
            if ok {
                *i += n;
            }
            ok
        };
        let paren = b.get(i) == Some(&b'(');
        if paren {
            i += 1;
        }
        if !take_digits(3, &mut i) {
            return None;
        }
        if paren {
            if b.get(i) != Some(&b')') {
                return None;
            }
            i += 1;
            if b.get(i) == Some(&b' ') {
                i += 1;
            }
        } else if matches!(b.get(i), Some(b'-' | b'.' | b' ')) {
            i += 1;
        } else {
            return None;
        }
        if !take_digits(3, &mut i) {
            return None;
        }
        if !matches!(b.get(i), Some(b'-' | b'.' | b' ')) {
            return None;
        }
        i += 1;
        if !take_digits(4, &mut i) {
            return None;
        }
        Some(i)
    };
    (0..b.len()).any(|start| {
        let alone_before = start == 0 || !b[start - 1].is_ascii_alphanumeric();
        alone_before && groups(start).is_some_and(|end| end == b.len() || !b[end].is_ascii_alphanumeric())
    })
}

/// What logs carry instead of a raw key: the first 16 hex digits (64 bits) of the key's
/// SHA-256. Enough to find one operation's lines (and to match `idem` output computed the
/// same way), without writing the key, which may hold customer data, into logs.
pub fn log_hash(key: &str) -> String {
    let mut h = crate::fingerprint::sha256_hex(key.as_bytes());
    h.truncate(16);
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_business_keys() {
        for k in [
            "INQ-001:confirmation:v1",
            "ORD-101:create-order",
            "batch 2026-11-30 export",
            "a",
            "ORD-20261130123456",
            "invoice/2026/000123",
            "user@",
            "x@y",
            "v1.2.3-rc.4",
            "release-1.2.3+20261130",
            "build@host.x86-64",
            "50%40off",
        ] {
            assert!(IdempotencyKey::parse(k).is_ok(), "{k} should be accepted");
        }
        assert!(IdempotencyKey::parse(&"k".repeat(255)).is_ok());
    }

    #[test]
    fn rejects_bad_shapes() {
        assert_eq!(IdempotencyKey::parse(""), Err(KeyError::Empty));
        assert_eq!(IdempotencyKey::parse(&"k".repeat(256)), Err(KeyError::TooLong(256)));
        assert_eq!(IdempotencyKey::parse("abc\ndef"), Err(KeyError::NotPrintableAscii(3)));
        assert_eq!(IdempotencyKey::parse("café"), Err(KeyError::NotPrintableAscii(3)));
        assert_eq!(IdempotencyKey::parse(" abc"), Err(KeyError::SurroundingSpace));
        assert_eq!(IdempotencyKey::parse(".."), Err(KeyError::DotSegment));
        assert!(IdempotencyKey::parse("...").is_ok());
    }

    #[test]
    fn rejects_personal_data() {
        for k in [
            "welcome:jane.doe@example.com",
            "jane@example.co.uk:v1",
            "confirm-j_d+tag@mail.example.org",
            "user@example.com-1",
            "jane.doe@gmail.com2",
            "mail:jane%40example.com",
            "mail:jane%40Example.COM2",
        ] {
            assert_eq!(IdempotencyKey::parse(k), Err(KeyError::ContainsEmail), "{k}");
        }
        for k in [
            "sms:+4915112345678",
            "call:+1 (555) 123-4567",
            "sms:555-123-4567:v1",
            "sms:(555) 123-4567",
            "sms:555.123.4567",
        ] {
            assert_eq!(IdempotencyKey::parse(k), Err(KeyError::ContainsPhone), "{k}");
        }
    }
}
