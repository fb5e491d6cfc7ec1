//! What a lease holder identity may be: one attempt's own UUID (DESIGN.md §3 "Holders").
//!
//! While a lease is valid, a trigger that presents the lease's holder (and principal) gets
//! the grant back — the resend of a request whose `201` was lost. So whoever presents the
//! same holder *acts*: a holder that two attempts could share is a second effect. Worker
//! names (`worker-7`), a constant in a script, a webhook's event id, a request id that a
//! gateway or framework propagates along a chain are all shared by the attempts that
//! matter (a platform re-running a slow script, a redelivered webhook, two services on
//! one chain). A holder therefore must be a value generated for one attempt and reused
//! only to resend that attempt's request, and idem refuses what it can tell is not:
//! - anything but a UUID (RFC 9562 §4: 32 hex digits as 8-4-4-4-12, either case, the
//!   RFC 9562 variant) — names, event ids and counters are refused by their shape;
//! - a name-based UUID (version 3 or 5: the same name always gives the same UUID), the
//!   Nil and Max UUIDs, and versions other than 1, 4, 6 and 7 (version 8 is free-form);
//! - a time-based UUID (versions 1, 6, 7) made more than [`HOLDER_MAX_AGE_MS`] before
//!   the ledger's now or more than [`HOLDER_CLOCK_MARGIN_MS`] after it: a grant is only
//!   given back while its lease is valid (at most an hour), so such a holder is a constant
//!   pasted into a script;
//! - a holder that is, or is part of, the operation's idempotency key — the key is shared
//!   by every attempt of the intent by definition (an event id used as both).
//!
//! A random UUID (version 4) copied into a script once cannot be told apart from a fresh
//! one: the docs, the CLI (a new one per invocation) and the client libraries (a new one
//! per attempt) are what keep those unique.

use crate::decision::MAX_LEASE_MS;
use std::fmt;

/// The length of a holder identity: a UUID's hyphenated form (RFC 9562 §4), 36 bytes.
pub const HOLDER_LEN: usize = 36;

/// The oldest a time-based holder (UUID version 1, 6 or 7) may be, in ms before the
/// ledger's now: the longest lease (1 h) plus [`HOLDER_CLOCK_MARGIN_MS`] for the client's
/// clock.
pub const HOLDER_MAX_AGE_MS: i64 = MAX_LEASE_MS + HOLDER_CLOCK_MARGIN_MS;

/// How far a client's clock may be off the ledger's for a time-based holder, in ms (5 min).
pub const HOLDER_CLOCK_MARGIN_MS: i64 = 300_000;

/// Why a holder identity was refused; each renders as one line saying what to send.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HolderError {
    /// Not a UUID in its 8-4-4-4-12 hex form with the RFC 9562 variant.
    NotUuid,
    /// A UUID version that is not made fresh per attempt (3, 5: from a name; 2, 8 and the
    /// unassigned ones).
    NotPerAttempt(u8),
    /// The Nil or the Max UUID (RFC 9562 §5.9, §5.10): a constant.
    NilOrMax,
    /// A time-based UUID made at this instant (epoch ms), outside the window.
    OutOfWindow(i64),
    /// The holder is the operation's key or a part of it.
    PartOfKey,
}

impl fmt::Display for HolderError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const FIX: &str =
            "generate a new UUID (version 4 or 7) for each attempt and reuse it only to resend that attempt's request";
        match self {
            HolderError::NotUuid => write!(
                f,
                "holder must be a UUID (RFC 9562, 8-4-4-4-12 hex digits) that identifies one attempt, not a worker name, an event id or a request id, which other attempts share; {FIX}"
            ),
            HolderError::NilOrMax => write!(
                f,
                "holder is the Nil or the Max UUID (all zeros or all ones), a constant every attempt would share; {FIX}"
            ),
            HolderError::NotPerAttempt(v) => write!(
                f,
                "holder is a version {v} UUID, which is not made fresh per attempt (versions 3 and 5 are the same for the same name); {FIX}"
            ),
            HolderError::OutOfWindow(at) => write!(
                f,
                "holder is a time-based UUID made at {at} (epoch ms), more than an hour from now: a grant is given back only during its lease, so this is a value kept across attempts; {FIX}"
            ),
            HolderError::PartOfKey => write!(
                f,
                "holder is part of the idempotency key, which every attempt of the intent shares (an event id used as both?); {FIX}"
            ),
        }
    }
}

impl std::error::Error for HolderError {}

fn hex(b: u8) -> Option<u64> {
    (b as char).to_digit(16).map(u64::from)
}

/// The UUID's 128 bits, if `text` is the hyphenated form of RFC 9562 §4.
fn uuid_bits(text: &str) -> Option<u128> {
    let b = text.as_bytes();
    if b.len() != HOLDER_LEN {
        return None;
    }
    let mut v: u128 = 0;
    for (i, &c) in b.iter().enumerate() {
        if matches!(i, 8 | 13 | 18 | 23) {
            if c != b'-' {
                return None;
            }
            continue;
        }
        v = (v << 4) | u128::from(hex(c)?);
    }
    Some(v)
}

/// When a time-based UUID was made (epoch ms), by its version's layout (RFC 9562 §5.1,
/// §5.6, §5.7); `None` for other versions.
fn made_at_ms(bits: u128, version: u8) -> Option<i64> {
    /// 100 ns intervals from 1582-10-15 (the Gregorian epoch) to 1970-01-01.
    const GREGORIAN_TO_UNIX: u64 = 0x01B2_1DD2_1381_4000;
    let field = |shift: u32, width: u32| ((bits >> shift) as u64) & ((1u64 << width) - 1);
    let gregorian = |ticks: u64| ticks.checked_sub(GREGORIAN_TO_UNIX).map(|t| (t / 10_000) as i64);
    match version {
        7 => Some(field(80, 48) as i64),
        1 => gregorian((field(64, 12) << 48) | (field(80, 16) << 32) | field(96, 32)),
        6 => gregorian((field(96, 32) << 28) | (field(80, 16) << 12) | field(64, 12)),
        _ => None,
    }
}

/// Checks a holder identity a caller names for a trigger of `key`, at the ledger's
/// `now_ms` (see the module docs for the rules and why).
///
/// # Errors
/// A [`HolderError`] naming the rule broken.
pub fn validate_holder(holder: &str, key: &str, now_ms: i64) -> Result<(), HolderError> {
    let bits = uuid_bits(holder).ok_or(HolderError::NotUuid)?;
    let variant = (bits >> 62) & 0b11;
    let version = ((bits >> 76) & 0xf) as u8;
    if bits == 0 || bits == u128::MAX {
        return Err(HolderError::NilOrMax);
    }
    if variant != 0b10 {
        return Err(HolderError::NotUuid);
    }
    if !matches!(version, 1 | 4 | 6 | 7) {
        return Err(HolderError::NotPerAttempt(version));
    }
    if let Some(at) = made_at_ms(bits, version)
        && !(now_ms - HOLDER_MAX_AGE_MS..=now_ms + HOLDER_CLOCK_MARGIN_MS).contains(&at)
    {
        return Err(HolderError::OutOfWindow(at));
    }
    // In either written form: hyphenated, or the 32 hex digits alone (break-it finding:
    // `evt:<uuid without hyphens>:conf` took its own event id as holder).
    let key = key.to_ascii_lowercase();
    let holder = holder.to_ascii_lowercase();
    if key.contains(&holder) || key.contains(&holder.replace('-', "")) {
        return Err(HolderError::PartOfKey);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: i64 = 1_796_000_000_000;

    /// A version 7 UUID made at `ms` (the random bits fixed).
    fn v7(ms: i64) -> String {
        let hexed = format!("{ms:012x}");
        format!("{}-{}-7abc-8def-0123456789ab", &hexed[..8], &hexed[8..])
    }

    #[test]
    fn per_attempt_uuids_pass() {
        for ok in [
            "0b6f7a1e-3c2d-4e5f-8a9b-0c1d2e3f4a5b",
            "0B6F7A1E-3C2D-4E5F-AA9B-0C1D2E3F4A5B",
            &v7(NOW),
            &v7(NOW - HOLDER_MAX_AGE_MS),
            &v7(NOW + HOLDER_CLOCK_MARGIN_MS),
        ] {
            assert_eq!(validate_holder(ok, "INV-88:send", NOW), Ok(()), "{ok}");
        }
    }

    #[test]
    fn names_event_ids_and_request_ids_are_refused_by_shape() {
        for bad in [
            "worker-7",
            "evt_1PQ7-webhook-delivery",
            "w7-attempt-1",
            "",
            " 0b6f7a1e-3c2d-4e5f-8a9b-0c1d2e3f4a5b",
            "0b6f7a1e3c2d4e5f8a9b0c1d2e3f4a5b",
            "{0b6f7a1e-3c2d-4e5f-8a9b-0c1d2e3f4a5b}",
            "0b6f7a1e-3c2d-4e5f-8a9b-0c1d2e3f4a5g",
            "0b6f7a1e-3c2d-4e5f-ca9b-0c1d2e3f4a5b", // variant 110 (Microsoft)
            "0b6f7a1e-3c2d-4e5f-0a9b-0c1d2e3f4a5b", // variant 0 (NCS)
        ] {
            assert_eq!(validate_holder(bad, "k", NOW), Err(HolderError::NotUuid), "{bad:?}");
        }
    }

    #[test]
    fn uuids_that_are_not_made_per_attempt_are_refused() {
        assert_eq!(validate_holder("00000000-0000-0000-0000-000000000000", "k", NOW), Err(HolderError::NilOrMax));
        assert_eq!(validate_holder("ffffffff-ffff-ffff-ffff-ffffffffffff", "k", NOW), Err(HolderError::NilOrMax));
        for v in [2u8, 3, 5, 8] {
            let h = format!("0b6f7a1e-3c2d-{v}e5f-8a9b-0c1d2e3f4a5b");
            assert_eq!(validate_holder(&h, "k", NOW), Err(HolderError::NotPerAttempt(v)), "{h}");
        }
    }

    #[test]
    fn time_based_holders_must_be_recent() {
        let old = NOW - HOLDER_MAX_AGE_MS - 1;
        assert_eq!(validate_holder(&v7(old), "k", NOW), Err(HolderError::OutOfWindow(old)));
        let ahead = NOW + HOLDER_CLOCK_MARGIN_MS + 1;
        assert_eq!(validate_holder(&v7(ahead), "k", NOW), Err(HolderError::OutOfWindow(ahead)));
        // RFC 9562's test vectors (appendix A.1, A.5, A.6): versions 1, 6 and 7 made at
        // 2022-02-22T19:22:22Z, 1 645 557 742 000 ms.
        assert_eq!(
            validate_holder("017f22e2-79b0-7cc3-98c4-dc0c0c07398f", "k", NOW),
            Err(HolderError::OutOfWindow(1_645_557_742_000))
        );
        assert_eq!(
            validate_holder("c232ab00-9414-11ec-b3c8-9f6bdeced846", "k", NOW),
            Err(HolderError::OutOfWindow(1_645_557_742_000))
        );
        assert_eq!(
            validate_holder("1ec9414c-232a-6b00-b3c8-9f6bdeced846", "k", NOW),
            Err(HolderError::OutOfWindow(1_645_557_742_000))
        );
        for h in [
            "c232ab00-9414-11ec-b3c8-9f6bdeced846",
            "1ec9414c-232a-6b00-b3c8-9f6bdeced846",
            "017f22e2-79b0-7cc3-98c4-dc0c0c07398f",
        ] {
            assert_eq!(validate_holder(h, "k", 1_645_557_742_000), Ok(()), "{h}");
        }
    }

    #[test]
    fn a_holder_taken_from_the_key_is_refused() {
        let h = "0b6f7a1e-3c2d-4e5f-8a9b-0c1d2e3f4a5b";
        assert_eq!(validate_holder(h, h, NOW), Err(HolderError::PartOfKey));
        assert_eq!(
            validate_holder(h, &format!("evt-{}:confirmation", h.to_uppercase()), NOW),
            Err(HolderError::PartOfKey)
        );
        // The 32 hex digits alone, as an event id often carries a UUID.
        assert_eq!(validate_holder(h, &format!("evt:{}:conf", h.replace('-', "")), NOW), Err(HolderError::PartOfKey));
        assert!(validate_holder(h, "INV-88:send", NOW).is_ok());
    }

    #[test]
    fn messages_say_what_to_send() {
        let m = HolderError::NotUuid.to_string();
        assert!(m.contains("UUID") && m.contains("each attempt"), "{m}");
    }
}
