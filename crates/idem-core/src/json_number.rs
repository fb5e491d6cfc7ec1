//! Which JSON number literals idem accepts: exactly those an IEEE 754 double carries
//! without change.
//!
//! RFC 8785 (§3.2.2.3) writes every number as the shortest ECMAScript form of the IEEE 754
//! double it parses to, and the stored payload is kept as such a double too. A literal that
//! is not exactly its double would be fingerprinted, stored and replayed as another number:
//! `1e-400` as `0`, `4e-324` as `5e-324`, `1.00000000000000000001` as `1`,
//! `9007199254740993` as `9007199254740992`. So the rule is:
//!
//! > A number literal is accepted only if it denotes exactly the same decimal value as the
//! > shortest representation of the IEEE 754 double it parses to (what RFC 8785 prints for
//! > it), and its magnitude is at most 2^53 (I-JSON, RFC 7493 §2.2).
//!
//! Spelling does not matter: `1`, `1.0`, `1e0` and `10e-1` are one number, and `-0` is `0`
//! (RFC 8785 writes both as `0`). `0.1` and `5e-324` (the smallest subnormal) are accepted.
//! Refused literals are overflow (`1e400`), underflow to zero (`1e-400`), rounding to
//! another double (`4e-324`, `1.00000000000000000001`) and integers beyond ±2^53
//! (`9007199254740993`); the error names the literal and says to send it as a string.
//!
//! serde_json hands a visitor only the parsed `f64`, never the literal (short of its
//! `arbitrary_precision` feature, which changes every `Value`), so [`check_numbers`]
//! scans the JSON text itself for number tokens.

/// Largest integer magnitude a double holds exactly: 2^53 (I-JSON, RFC 7493 §2.2).
pub const MAX_EXACT_INTEGER: u64 = 1 << 53;

/// Longest piece of a literal an error message repeats, in bytes.
const SHOWN_LEN: usize = 40;

/// Why a number literal is refused. Each names the literal (its first 40 bytes).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NumberError {
    /// Beyond the double range: it would be read as infinity, which JSON cannot express.
    #[error(
        "the number {0} is beyond the range of an IEEE 754 double (RFC 8785 numbers are doubles) and beyond ±2^53 (I-JSON, RFC 7493 §2.2); send it as a string"
    )]
    Overflow(String),
    /// Magnitude above 2^53, where doubles stop holding every integer.
    #[error(
        "the number {0} is beyond ±2^53, which JSON numbers cannot carry exactly (I-JSON, RFC 7493 §2.2); send it as a string"
    )]
    BeyondExactIntegers(String),
    /// Not zero, but closer to zero than the smallest double (`5e-324`).
    #[error(
        "the number {0} is too small for an IEEE 754 double: it would be read as 0 (RFC 8785 numbers are doubles); send it as a string"
    )]
    Underflow(String),
    /// Rounds to a double of another value.
    #[error(
        "the number {literal} is not exactly an IEEE 754 double: it would be read as {read_as} (RFC 8785 numbers are doubles); send it as a string"
    )]
    Inexact {
        /// The literal as sent.
        literal: String,
        /// The double it parses to, as RFC 8785 writes it.
        read_as: String,
    },
    /// Not a number literal of RFC 8259 §6 at all (only when called on text that was not
    /// parsed as JSON first).
    #[error("{0} is not a JSON number (RFC 8259 §6)")]
    Malformed(String),
}

/// Checks one number literal (RFC 8259 §6 grammar) against the rule in the module docs.
///
/// # Errors
/// A [`NumberError`] naming the literal when a double does not carry it exactly.
pub fn check_literal(literal: &str) -> Result<(), NumberError> {
    let Some(value) = Significand::of(literal) else {
        return Ok(()); // zero in any spelling (`0`, `-0`, `0.0e9`) is exactly 0
    };
    // Fast path. A decimal of at most 15 significant digits in the normal range of doubles
    // survives decimal → double → 15 digits unchanged (DBL_DIG = 15, C17 §5.2.4.2.2), so no
    // shorter decimal of another value can be the double's shortest form; below 10^15 it is
    // also within ±2^53.
    if value.digits <= 15 && (-307..=14).contains(&value.exp10) {
        return Ok(());
    }
    let shown = || shorten(literal);
    let Ok(double) = literal.parse::<f64>() else {
        return Err(NumberError::Malformed(shown()));
    };
    if !double.is_finite() {
        return Err(NumberError::Overflow(shown()));
    }
    if double.abs() > MAX_EXACT_INTEGER as f64 {
        return Err(NumberError::BeyondExactIntegers(shown()));
    }
    // What RFC 8785 prints for the double (ECMAScript Number::toString, shortest digits).
    let printed = serde_json_canonicalizer::to_string(&double.abs()).unwrap_or_default();
    if Significand::of(&printed) == Some(value) {
        return Ok(());
    }
    Err(if double.abs() == MAX_EXACT_INTEGER as f64 {
        NumberError::BeyondExactIntegers(shown()) // 9007199254740993 reads as 2^53
    } else if double == 0.0 {
        NumberError::Underflow(shown())
    } else {
        NumberError::Inexact { literal: shown(), read_as: if double < 0.0 { format!("-{printed}") } else { printed } }
    })
}

/// Checks every number literal of the JSON text `json` with [`check_literal`], skipping
/// string contents. `json` should be valid JSON (parse it first): the scan only tells
/// strings from number tokens, it does not check the grammar. One pass, no allocation.
///
/// # Errors
/// The [`NumberError`] of the first literal refused.
pub fn check_numbers(json: &str) -> Result<(), NumberError> {
    let bytes = json.as_bytes();
    let mut i = 0;
    while let Some(&b) = bytes.get(i) {
        match b {
            b'"' => {
                i += 1;
                while let Some(&c) = bytes.get(i) {
                    match c {
                        b'"' => break,
                        b'\\' => i += 2, // the escaped byte is never the closing quote
                        _ => i += 1,
                    }
                }
                i += 1;
            }
            b'-' | b'0'..=b'9' => {
                let start = i;
                while bytes.get(i).is_some_and(|c| matches!(c, b'0'..=b'9' | b'-' | b'+' | b'.' | b'e' | b'E')) {
                    i += 1;
                }
                check_literal(&json[start..i])?;
            }
            _ => i += 1,
        }
    }
    Ok(())
}

/// The first [`SHOWN_LEN`] bytes of a literal (a literal is ASCII), marked when cut.
fn shorten(literal: &str) -> String {
    match literal.get(..SHOWN_LEN) {
        Some(head) if head.len() < literal.len() => format!("{head}…"),
        _ => literal.to_owned(),
    }
}

/// The value of a nonzero number literal, without its sign: its significant digits and the
/// power of ten of the first of them (`0.0120e3` → digits `12`, exp10 `1`).
#[derive(Clone, Copy)]
struct Significand<'a> {
    /// From the first to the last nonzero digit; may hold the decimal point.
    mantissa: &'a [u8],
    /// Number of digits in `mantissa`.
    digits: usize,
    /// Power of ten of the first digit.
    exp10: i64,
}

impl<'a> Significand<'a> {
    /// `None` for zero (and for text with no nonzero digit before its exponent).
    fn of(literal: &'a str) -> Option<Self> {
        let b = literal.as_bytes();
        let b = b.strip_prefix(b"-").unwrap_or(b);
        let (m, exp) = match b.iter().position(|&c| c == b'e' || c == b'E') {
            Some(i) => (&b[..i], exponent(&b[i + 1..])),
            None => (b, 0),
        };
        let point = m.iter().position(|&c| c == b'.').unwrap_or(m.len());
        let first = m.iter().position(|c| matches!(c, b'1'..=b'9'))?;
        let last = m.iter().rposition(|c| matches!(c, b'1'..=b'9'))?;
        let digits = last - first + 1 - usize::from(first < point && point < last);
        // Both offsets are at most the literal's length, far inside i64.
        let exp10 = if first < point { exp + (point - first - 1) as i64 } else { exp - (first - point) as i64 };
        Some(Significand { mantissa: &m[first..=last], digits, exp10 })
    }

    fn digit_bytes(&self) -> impl Iterator<Item = &u8> {
        self.mantissa.iter().filter(|c| c.is_ascii_digit())
    }
}

impl PartialEq for Significand<'_> {
    fn eq(&self, other: &Self) -> bool {
        self.digits == other.digits && self.exp10 == other.exp10 && self.digit_bytes().eq(other.digit_bytes())
    }
}

/// An exponent's value (`+12`, `-400`, `7`), saturating far beyond any double's range so
/// that a literal like `1e99999999999999999999` cannot overflow the arithmetic.
fn exponent(b: &[u8]) -> i64 {
    const LIMIT: i64 = 1_000_000_000_000;
    let (negative, digits) = match b.first() {
        Some(b'-') => (true, &b[1..]),
        Some(b'+') => (false, &b[1..]),
        _ => (false, b),
    };
    let magnitude = digits.iter().fold(0_i64, |acc, &c| (acc * 10 + i64::from(c.wrapping_sub(b'0'))).min(LIMIT));
    if negative { -magnitude } else { magnitude }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(literal: &str) -> NumberError {
        check_literal(literal).expect_err(literal)
    }

    #[test]
    fn exact_literals_are_accepted_in_any_spelling() {
        for ok in [
            "0",
            "-0",
            "0.0",
            "-0.0e-5",
            "0e999999999999999999999",
            "0.1",
            "1.0",
            "1e0",
            "10e-1",
            "0.1e1",
            "5e-324",
            "-5e-324",
            "2.2250738585072014e-308",
            "2.225073858507201e-308",
            "0.30000000000000004",
            "123456789012345",
            "9007199254740991",
            "9007199254740992",
            "-9007199254740992",
            "9007199254740992.0",
            "1e15",
            "1.5",
            "100",
            "1E2",
            "1e+2",
        ] {
            assert_eq!(check_literal(ok), Ok(()), "{ok}");
        }
    }

    #[test]
    fn underflow_overflow_and_rounding_are_refused_naming_the_literal() {
        assert_eq!(refused("1e-400"), NumberError::Underflow("1e-400".into()));
        assert_eq!(refused("-1e-400"), NumberError::Underflow("-1e-400".into()));
        assert_eq!(refused("2e-324"), NumberError::Underflow("2e-324".into()), "below half the smallest subnormal");
        assert_eq!(refused("1e400"), NumberError::Overflow("1e400".into()));
        assert_eq!(refused("-1E+400"), NumberError::Overflow("-1E+400".into()));
        for (literal, read_as) in [
            ("4e-324", "5e-324"),
            ("2.5e-324", "5e-324"),
            ("1.00000000000000000001", "1"),
            ("-0.1000000000000000000000000001", "-0.1"),
            ("0.30000000000000001", "0.3"),
            // A tie between two shortest forms goes to the even digit, as in ECMAScript
            // Number::toString: the double 1077018851474369.25 prints as …369.2, so …369.3
            // (Rust's `{:e}` picks it) is refused.
            ("-1077018851474369.3", "-1077018851474369.2"),
            // 17 significant digits (C's %.17g) that are not the shortest form: refused
            // too, as the rule says; shortest round-trip printers (ECMAScript, Python 3,
            // Go, ryu) never write them.
            ("4.9406564584124654e-324", "5e-324"),
            ("0.10000000000000001", "0.1"),
        ] {
            assert_eq!(refused(literal), NumberError::Inexact { literal: literal.into(), read_as: read_as.into() });
        }
        assert_eq!(check_literal("1077018851474369.2"), Ok(()));
        let e = refused("1e-400").to_string();
        assert!(e.contains("1e-400") && e.contains("send it as a string"), "{e}");
    }

    #[test]
    fn integers_beyond_2_pow_53_are_refused() {
        for big in [
            "9007199254740993",
            "-9007199254740993",
            "9007199254740994",
            "1795999717611524801",
            "1e16",
            "1e300",
            "9007199254740993.0",
            "9007199254740992.5",
            "123456789012345678901234567890",
        ] {
            assert!(matches!(refused(big), NumberError::BeyondExactIntegers(_)), "{big}: {:?}", refused(big));
        }
    }

    #[test]
    fn long_literals_are_cut_in_messages() {
        let long = format!("1.{}1", "0".repeat(100));
        let NumberError::Inexact { literal, read_as } = refused(&long) else { panic!() };
        assert_eq!((literal.len(), read_as.as_str()), (SHOWN_LEN + "…".len(), "1"));
    }

    #[test]
    fn the_scan_checks_numbers_and_skips_strings() {
        assert_eq!(check_numbers(r#"{"n":[1,{"m":1e-400}]}"#), Err(NumberError::Underflow("1e-400".into())));
        assert_eq!(check_numbers(r#"{"1e-400":"1e-400","s":"a\"1e-400\\","t":"\\"}"#), Ok(()));
        assert_eq!(check_numbers(r#"[0.1,-0,5e-324,true,null,"x"]"#), Ok(()));
        assert_eq!(
            check_numbers("4e-324"),
            Err(NumberError::Inexact { literal: "4e-324".into(), read_as: "5e-324".into() })
        );
        assert_eq!(check_numbers(" [ 1 , 2e400 ] "), Err(NumberError::Overflow("2e400".into())));
        // Not JSON: no panic, whatever the answer.
        for junk in ["\"", "\"\\", "[-", "-", "1e", "."] {
            let _ = check_numbers(junk);
        }
    }

    mod properties {
        use super::super::*;
        use proptest::prelude::*;

        /// The rule itself, the slow way: parse, print as RFC 8785 does, compare values.
        fn exact_by_definition(literal: &str) -> bool {
            let d: f64 = literal.parse().unwrap();
            if Significand::of(literal).is_none() {
                return true;
            }
            d.is_finite()
                && d.abs() <= MAX_EXACT_INTEGER as f64
                && Significand::of(&serde_json_canonicalizer::to_string(&d.abs()).unwrap()) == Significand::of(literal)
        }

        proptest! {
            /// The fast path agrees with the definition on literals of every shape.
            #[test]
            fn check_literal_is_the_definition(
                neg in any::<bool>(),
                // Short literals (the fast path) and long ones (the slow path) alike.
                int in prop_oneof!["(0|[1-9][0-9]{0,6})", "[1-9][0-9]{0,19}"],
                frac in proptest::option::of(prop_oneof!["[0-9]{1,8}", "[0-9]{1,22}"]),
                exp in proptest::option::of(prop_oneof![-20_i32..20, -330_i32..330]),
            ) {
                let mut lit = format!("{}{int}", if neg { "-" } else { "" });
                if let Some(f) = frac {
                    lit = format!("{lit}.{f}");
                }
                if let Some(e) = exp {
                    lit = format!("{lit}e{e}");
                }
                prop_assert_eq!(check_literal(&lit).is_ok(), exact_by_definition(&lit), "{}", lit);
            }

            /// Every finite double within ±2^53, as RFC 8785 prints it, is accepted, also
            /// respelled with an exponent.
            #[test]
            fn every_printed_double_is_accepted(negative in any::<bool>(), exp in 0_u64..1076, frac in any::<u64>()) {
                // Biased exponent below 1076: subnormals up to magnitudes below 2^53.
                let d = f64::from_bits(u64::from(negative) << 63 | exp << 52 | frac & ((1 << 52) - 1));
                let printed = serde_json_canonicalizer::to_string(&d).unwrap();
                prop_assert_eq!(check_literal(&printed), Ok(()), "{}", printed);
                // The same value with a trailing zero and an explicit exponent.
                let (m, x) = printed.split_once('e').unwrap_or((&printed, "0"));
                let respelled = if m.contains('.') { format!("{m}0E{x}") } else { format!("{m}.0E{x}") };
                prop_assert_eq!(check_literal(&respelled), Ok(()), "{}", respelled);
            }
        }
    }
}
