//! What a provider or a receiver sent, as text that every store accepts and a person can
//! read.
//!
//! idem keeps the start of an error answer (a webhook receiver's 500 page, a provider's
//! refusal, an SMTP server's reply) as the attempt's error message. Those bytes are not
//! ours: a gzip-compressed or UTF-16 error page, or any body with a zero byte, is not
//! text. PostgreSQL refuses a `text` value holding U+0000 (`invalid byte sequence for
//! encoding "UTF8": 0x00`) and refuses the whole statement with it, so a relay that
//! records a pass's outcomes in one statement lost every outcome of the pass (issue 28
//! §8). [`snippet`] and [`storable`] turn such input into text that:
//! - is valid UTF-8 (an invalid sequence becomes U+FFFD, as `String::from_utf8_lossy`);
//! - holds no control character but TAB and LF: every other C0 character, DEL and the C1
//!   characters are written as `\u{XX}` (so `\u{0}` for NUL), visible in logs and on the
//!   admin page, and storable in PostgreSQL and SQLite alike;
//! - is at most `max_chars` characters (Unicode scalar values) of the input, with `…`
//!   appended when cut.

use std::borrow::Cow;

/// Characters of a receiver's or provider's answer kept as an error message (a webhook
/// sink's or an HTTP connector's error snippet).
pub const SNIPPET_CHARS: usize = 300;

/// The start of `bytes` (a body a receiver or provider sent) as storable text: at most
/// `max_chars` characters, control characters escaped (see the module docs).
pub fn snippet(bytes: &[u8], max_chars: usize) -> String {
    cut(&String::from_utf8_lossy(bytes), max_chars)
}

/// `text` (an error message from a library, a server's reply line, a provider's reference)
/// with its control characters but TAB and LF escaped, so a store accepts it; borrowed
/// when there is nothing to escape (the usual case).
pub fn storable(text: &str) -> Cow<'_, str> {
    if text.chars().any(needs_escape) { Cow::Owned(cut(text, usize::MAX)) } else { Cow::Borrowed(text) }
}

fn needs_escape(c: char) -> bool {
    c.is_control() && c != '\t' && c != '\n'
}

fn cut(text: &str, max_chars: usize) -> String {
    let mut out = String::with_capacity(text.len().min(max_chars.saturating_mul(4)));
    for (i, c) in text.chars().enumerate() {
        if i == max_chars {
            out.push('…');
            break;
        }
        if needs_escape(c) {
            out.push_str(&format!("\\u{{{:x}}}", u32::from(c)));
        } else {
            out.push(c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn binary_bodies_become_storable_text() {
        // The start of a gzip stream: magic, method, flags, a zero byte, and invalid UTF-8.
        let gzip = [0x1f, 0x8b, 0x08, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x03, 0xcb, 0x48];
        let s = snippet(&gzip, 300);
        assert_eq!(s, "\\u{1f}\u{fffd}\\u{8}\\u{0}\\u{0}\\u{0}\\u{0}\\u{0}\\u{0}\\u{3}\u{fffd}H");
        assert!(!s.contains('\0'));
        // UTF-16LE "error": every other byte is zero.
        assert_eq!(snippet(&[b'e', 0, b'r', 0], 300), "e\\u{0}r\\u{0}");
        // DEL and a C1 control are escaped too; TAB and LF are kept.
        assert_eq!(snippet("a\tb\nc\u{7f}d\u{85}".as_bytes(), 300), "a\tb\nc\\u{7f}d\\u{85}");
    }

    #[test]
    fn cut_counts_characters_and_marks_the_cut() {
        assert_eq!(snippet("ab".as_bytes(), 2), "ab");
        assert_eq!(snippet("abc".as_bytes(), 2), "ab…");
        assert_eq!(snippet("ééé".as_bytes(), 2), "éé…");
        assert_eq!(snippet(b"", 2), "");
    }

    #[test]
    fn storable_borrows_clean_text_and_escapes_the_rest() {
        assert!(matches!(storable("connection reset\tby peer\n"), Cow::Borrowed(_)));
        assert_eq!(storable("ref\0x"), "ref\\u{0}x");
        assert_eq!(storable("a\r\nb"), "a\\u{d}\nb");
    }
}
