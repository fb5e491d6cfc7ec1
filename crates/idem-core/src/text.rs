//! What a provider or a receiver sent, as text that every store accepts and a person can
//! read.
//!
//! idem keeps the start of an error answer (a webhook receiver's 500 page, a provider's
//! refusal, an SMTP server's reply) as the attempt's error message. Those bytes are not
//! ours: a gzip-compressed or UTF-16 error page, or any body with a zero byte, is not
//! text. PostgreSQL refuses a `text` value holding U+0000 (`invalid byte sequence for
//! encoding "UTF8": 0x00`) and refuses the whole statement with it, so a relay that
//! records a pass's outcomes in one statement lost every outcome of the pass (issue 28
//! §8). [`snippet`] describes a body that is not text (see there); it and [`storable`]
//! turn such input into text that:
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
/// `max_chars` characters, control characters escaped (see the module docs). A body that
/// is not text — not UTF-8, or holding a zero byte — is described instead of shown as
/// mojibake: UTF-16 text (with or without its byte order mark) is decoded, anything else
/// is "a binary body (gzip), starting 1f 8b 08 00 …" with its kind when its first bytes
/// tell it (gzip, zstd, zip, PNG, PDF) and its first 16 bytes in hex.
pub fn snippet(bytes: &[u8], max_chars: usize) -> String {
    match std::str::from_utf8(bytes) {
        Ok(text) if !text.contains('\0') => cut(text, max_chars),
        _ => match utf16(bytes) {
            Some(text) => format!("UTF-16 text: {}", cut(&text, max_chars)),
            None => binary(bytes),
        },
    }
}

/// `bytes` as UTF-16 text, if they read as such: a byte order mark, or (without one) an
/// even length whose every other byte, and not every byte, is zero, as ASCII text in
/// UTF-16 is.
fn utf16(bytes: &[u8]) -> Option<String> {
    let (body, little) = match bytes {
        [0xff, 0xfe, rest @ ..] => (rest, true),
        [0xfe, 0xff, rest @ ..] => (rest, false),
        _ if bytes.len() % 2 == 1 || bytes.iter().all(|b| *b == 0) => return None,
        _ if bytes.iter().skip(1).step_by(2).all(|b| *b == 0) => (bytes, true),
        _ if bytes.iter().step_by(2).all(|b| *b == 0) => (bytes, false),
        _ => return None,
    };
    let units = body.chunks(2).map(|c| {
        let pair = [c[0], *c.get(1).unwrap_or(&0)];
        if little { u16::from_le_bytes(pair) } else { u16::from_be_bytes(pair) }
    });
    Some(char::decode_utf16(units).map(|c| c.unwrap_or(char::REPLACEMENT_CHARACTER)).collect())
}

fn binary(bytes: &[u8]) -> String {
    let kind = match bytes {
        [0x1f, 0x8b, ..] => " (gzip)",
        [0x28, 0xb5, 0x2f, 0xfd, ..] => " (zstd)",
        [b'P', b'K', 3, 4, ..] => " (zip)",
        [0x89, b'P', b'N', b'G', ..] => " (PNG)",
        [b'%', b'P', b'D', b'F', ..] => " (PDF)",
        _ => "",
    };
    let head: Vec<String> = bytes.iter().take(16).map(|b| format!("{b:02x}")).collect();
    let more = if bytes.len() > 16 { " …" } else { "" };
    format!("a binary body{kind}, starting {}{more}", head.join(" "))
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
    fn binary_bodies_are_described_and_text_is_escaped() {
        // The start of a gzip stream: magic, method, flags, a zero byte, and invalid UTF-8.
        let gzip = [0x1f, 0x8b, 0x08, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x03, 0xcb, 0x48];
        assert_eq!(snippet(&gzip, 300), "a binary body (gzip), starting 1f 8b 08 00 00 00 00 00 00 03 cb 48");
        let long = [0x00u8; 20];
        assert!(snippet(&long, 300).ends_with("00 00 …"), "{}", snippet(&long, 300));
        assert_eq!(snippet(&[0xc3, 0x28, 0x41], 300), "a binary body, starting c3 28 41");
        // UTF-16, little- and big-endian, with and without a byte order mark.
        assert_eq!(snippet(b"e\0r\0r\0", 300), "UTF-16 text: err");
        assert_eq!(snippet(b"\0e\0r", 300), "UTF-16 text: er");
        assert_eq!(snippet(&[0xff, 0xfe, b'o', 0, b'k', 0], 300), "UTF-16 text: ok");
        // Text: DEL and a C1 control are escaped; TAB and LF are kept; a NUL is never stored.
        assert_eq!(snippet("a\tb\nc\u{7f}d\u{85}".as_bytes(), 300), "a\tb\nc\\u{7f}d\\u{85}");
        for body in [&gzip[..], b"e\0r\0", b"busy\0\0!", &[0xff, 0xfe, 0, 0]] {
            assert!(!snippet(body, 300).contains('\0'), "{body:?}");
        }
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
