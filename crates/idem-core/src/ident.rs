//! The one rule every identifier idem stores follows, whatever the entry point.
//!
//! Operation keys, workflow instance ids, inbox consumer names and message ids, outbox
//! event ids and aggregates, fingerprints of the inbox, holders and tenant names are
//! compared byte for byte. An id that is empty, made only of whitespace, or carries
//! whitespace at either end is almost always a transport's accident (an unset field, a
//! padded column, a BOM at the start of a file): taken as it is, two copies of one message
//! become two messages (`" evt-7"` and `"evt-7"`), and every message whose id was lost
//! becomes one (`"    "`), so the second is never applied. So [`check_identifier`] refuses,
//! in this order:
//! - an empty id ([`IdError::Empty`]);
//! - one longer than the kind allows, in bytes of UTF-8 ([`IdError::TooLong`]);
//! - one made only of padding ([`IdError::Blank`]): Unicode `White_Space` (Unicode
//!   Standard Annex #44: TAB, LF, VT, FF, CR, space, U+0085, NO-BREAK SPACE U+00A0,
//!   U+1680, U+2000–U+200A, U+2028, U+2029, U+202F, U+205F, IDEOGRAPHIC SPACE U+3000) and
//!   the invisible format characters that pad text the same way (MONGOLIAN VOWEL
//!   SEPARATOR U+180E, ZERO WIDTH SPACE U+200B, ZWNJ U+200C, ZWJ U+200D, WORD JOINER
//!   U+2060, the byte order mark U+FEFF);
//! - one that starts or ends with padding ([`IdError::Padded`]);
//! - one with a control character, C0, DEL or C1 (Unicode general category Cc,
//!   [`IdError::Control`]): invisible in logs and on the admin page, and NUL cannot be
//!   stored in a PostgreSQL text column at all.
//!
//! Each kind of id adds its own character set on top (printable ASCII for keys and
//! message ids, `[A-Za-z0-9._-]` for tenant names, a UUID for holders, …): those checks
//! stay with the kind. The HTTP API, the CLI, the Rust libraries and the SQL functions of
//! the `idem` schema (`idem.check_identifier`, the same rule and the same messages) all
//! apply this one; [`BAD_IDS`] is the table every entry point's tests run.

use std::fmt;

/// Why an identifier was refused; renders as a one-line message naming the id's kind.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdError {
    /// The id's kind as the caller knows it (`"message id"`, `"idempotency key"`, …).
    pub what: String,
    /// Which rule it breaks.
    pub kind: IdErrorKind,
}

/// The rule an identifier breaks (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IdErrorKind {
    /// No characters.
    Empty,
    /// More bytes than the kind allows (the count, the limit).
    TooLong(usize, usize),
    /// Only whitespace or invisible padding.
    Blank,
    /// Whitespace or invisible padding at the start or the end.
    Padded,
    /// A control character (Cc) at this byte offset.
    Control(usize),
}

impl fmt::Display for IdError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let what = &self.what;
        match self.kind {
            IdErrorKind::Empty => write!(f, "{what} is empty"),
            IdErrorKind::TooLong(n, max) => write!(f, "{what} has {n} bytes; at most {max} are allowed"),
            IdErrorKind::Blank => {
                write!(f, "{what} is blank: it has only whitespace (a lost or unset id?); send the real id")
            }
            IdErrorKind::Padded => write!(
                f,
                "{what} starts or ends with whitespace; ids are compared exactly, so trim it where it is made (\" evt-7\" and \"evt-7\" would be two)"
            ),
            IdErrorKind::Control(at) => write!(f, "{what} has a control character at byte {at}"),
        }
    }
}

impl std::error::Error for IdError {}

/// Whether `c` pads text invisibly: Unicode `White_Space`, or one of the invisible format
/// characters U+180E, U+200B–U+200D, U+2060, U+FEFF (see the module docs).
pub fn is_padding(c: char) -> bool {
    c.is_whitespace() || matches!(c, '\u{180E}' | '\u{200B}'..='\u{200D}' | '\u{2060}' | '\u{FEFF}')
}

/// Checks `id`, an identifier of kind `what`, against the shared rule, allowing at most
/// `max_bytes` bytes of UTF-8.
///
/// # Errors
/// An [`IdError`] naming the first rule broken, in the order of the module docs.
pub fn check_identifier(what: &str, id: &str, max_bytes: usize) -> Result<(), IdError> {
    let err = |kind| Err(IdError { what: what.to_owned(), kind });
    if id.is_empty() {
        return err(IdErrorKind::Empty);
    }
    if id.len() > max_bytes {
        return err(IdErrorKind::TooLong(id.len(), max_bytes));
    }
    if id.chars().all(is_padding) {
        return err(IdErrorKind::Blank);
    }
    if id.starts_with(is_padding) || id.ends_with(is_padding) {
        return err(IdErrorKind::Padded);
    }
    if let Some((at, _)) = id.char_indices().find(|(_, c)| c.is_control()) {
        return err(IdErrorKind::Control(at));
    }
    Ok(())
}

/// Identifiers every entry point must refuse, with the rule each breaks: the table the
/// tests of the HTTP API, the CLI, the Rust libraries and the SQL functions run (issue
/// 28 §3: `idem.inbox_claim('payments', '    ', …)` was applied, `' evt-7'` and `'evt-7'`
/// were two messages). Over-long ids are checked per kind, since limits differ.
#[doc(hidden)]
pub const BAD_IDS: &[(&str, IdErrorKind)] = &[
    ("", IdErrorKind::Empty),
    (" ", IdErrorKind::Blank),
    ("    ", IdErrorKind::Blank),
    ("\t", IdErrorKind::Blank),
    ("\u{3000}", IdErrorKind::Blank),
    ("\u{FEFF}", IdErrorKind::Blank),
    (" evt-7", IdErrorKind::Padded),
    ("evt-7 ", IdErrorKind::Padded),
    ("evt-7\n", IdErrorKind::Padded),
    ("\tevt-7", IdErrorKind::Padded),
    ("\u{A0}evt-7", IdErrorKind::Padded),
    ("evt-7\u{3000}", IdErrorKind::Padded),
    ("\u{FEFF}evt-7", IdErrorKind::Padded),
    ("evt-7\u{200B}", IdErrorKind::Padded),
    ("evt\u{7}-7", IdErrorKind::Control(3)),
    ("evt\u{1b}[2J-7", IdErrorKind::Control(3)),
    ("evt\u{7f}-7", IdErrorKind::Control(3)),
    ("evt\u{85}-7", IdErrorKind::Control(3)),
];

/// Ids every entry point must accept (where its character set allows them): inner spaces
/// are part of an id.
#[doc(hidden)]
pub const GOOD_IDS: &[&str] = &["evt-7", "a", "evt 7", "msg_2KWPBgLlAfxdpx2AI54pPJ85f4W", "<a.b@mail.example>"];

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn the_table_is_what_the_rule_says() {
        for (id, kind) in BAD_IDS {
            assert_eq!(check_identifier("message id", id, 255).map_err(|e| e.kind), Err(*kind), "{id:?}");
        }
        for id in GOOD_IDS {
            assert_eq!(check_identifier("message id", id, 255), Ok(()), "{id:?}");
        }
        assert_eq!(
            check_identifier("x", &"a".repeat(256), 255).map_err(|e| e.kind),
            Err(IdErrorKind::TooLong(256, 255))
        );
        assert_eq!(
            check_identifier("x", &"é".repeat(128), 255).map_err(|e| e.kind),
            Err(IdErrorKind::TooLong(256, 255))
        );
    }

    #[test]
    fn messages_name_the_kind_and_the_fix() {
        let e = check_identifier("message id", "    ", 255).unwrap_err();
        assert_eq!(
            e.to_string(),
            "message id is blank: it has only whitespace (a lost or unset id?); send the real id"
        );
        let e = check_identifier("consumer", " billing", 255).unwrap_err();
        assert!(e.to_string().starts_with("consumer starts or ends with whitespace"), "{e}");
    }

    proptest! {
        /// Trimming padding off an accepted id changes nothing; adding it to either end of
        /// any id makes it refused.
        #[test]
        fn padding_at_either_end_is_always_refused(core in "[a-z0-9 ._-]{0,8}", pad in prop::sample::select(vec![' ', '\t', '\u{a0}', '\u{3000}', '\u{feff}', '\u{200b}', '\n'])) {
            for id in [format!("{pad}{core}"), format!("{core}{pad}")] {
                prop_assert!(check_identifier("id", &id, 255).is_err(), "{id:?}");
            }
            if check_identifier("id", &core, 255).is_ok() {
                prop_assert_eq!(core.trim_matches(is_padding), core.as_str());
            }
        }
    }
}
