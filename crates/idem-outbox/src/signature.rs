//! Standard Webhooks signatures (<https://www.standardwebhooks.com>, spec v1).
//!
//! A message is sent with three headers: `webhook-id` (its id: idem's event id, constant
//! across redeliveries, the receiver's dedupe key), `webhook-timestamp` (integer seconds
//! since the Unix epoch, when this attempt was signed) and `webhook-signature`: one or
//! more space-separated `v1,<base64 of HMAC-SHA256(key, "{id}.{timestamp}.{body}")>`.
//! During a secret rotation the sender signs with both secrets, so a receiver that knows
//! either one verifies.
//!
//! A secret is written `whsec_<base64>` (the prefix is optional); its key is the decoded
//! bytes, 24–64 of them as the specification recommends.

use base64::Engine;
use base64::engine::general_purpose::STANDARD as B64;
use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;
use std::fmt;

/// Oldest (and furthest in the future) a `webhook-timestamp` may be, in seconds: 5 min.
pub const DEFAULT_TOLERANCE_S: i64 = 300;

/// A signing secret. `Debug` never shows it.
#[derive(Clone, PartialEq, Eq)]
pub struct WebhookSecret(Vec<u8>);

impl fmt::Debug for WebhookSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("WebhookSecret(***)")
    }
}

/// Why a secret was refused (the message never contains the secret).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SecretError {
    /// Not base64.
    #[error("not a Standard Webhooks secret: expected whsec_ followed by base64")]
    NotBase64,
    /// Too short or too long.
    #[error("the secret decodes to {0} bytes; Standard Webhooks secrets are 24 to 64 bytes")]
    BadLength(usize),
}

impl WebhookSecret {
    /// Parses `whsec_<base64>` (or the bare base64).
    ///
    /// # Errors
    /// A [`SecretError`].
    pub fn parse(text: &str) -> Result<Self, SecretError> {
        let b64 = text.trim().strip_prefix("whsec_").unwrap_or(text.trim());
        let key = B64.decode(b64).map_err(|_| SecretError::NotBase64)?;
        if !(24..=64).contains(&key.len()) {
            return Err(SecretError::BadLength(key.len()));
        }
        Ok(WebhookSecret(key))
    }

    /// `v1,<base64 HMAC-SHA256>` of `{msg_id}.{timestamp_s}.{body}`.
    pub fn sign(&self, msg_id: &str, timestamp_s: i64, body: &[u8]) -> String {
        format!("v1,{}", B64.encode(self.mac(msg_id, timestamp_s, body).finalize().into_bytes()))
    }

    fn mac(&self, msg_id: &str, timestamp_s: i64, body: &[u8]) -> Hmac<Sha256> {
        let mut mac = <Hmac<Sha256> as KeyInit>::new_from_slice(&self.0).expect("HMAC takes keys of any length");
        mac.update(format!("{msg_id}.{timestamp_s}.").as_bytes());
        mac.update(body);
        mac
    }

    /// Whether `signature` (one `v1,…` entry) is this secret's for the message, compared in
    /// constant time.
    fn verifies(&self, msg_id: &str, timestamp_s: i64, body: &[u8], signature: &str) -> bool {
        let Some(b64) = signature.strip_prefix("v1,") else { return false };
        let Ok(sig) = B64.decode(b64) else { return false };
        self.mac(msg_id, timestamp_s, body).verify_slice(&sig).is_ok()
    }
}

/// The `webhook-signature` header value: one signature per secret, space-separated.
pub fn signature_header(secrets: &[WebhookSecret], msg_id: &str, timestamp_s: i64, body: &[u8]) -> String {
    secrets.iter().map(|s| s.sign(msg_id, timestamp_s, body)).collect::<Vec<_>>().join(" ")
}

/// Why a received message failed verification.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WebhookError {
    /// A required header is absent.
    #[error("missing header {0}")]
    MissingHeader(&'static str),
    /// `webhook-timestamp` is not an integer.
    #[error("webhook-timestamp is not an integer number of seconds")]
    BadTimestamp,
    /// Older than the tolerance (a replay of an old message, or a clock far behind).
    #[error("webhook-timestamp is more than {0} s old")]
    TimestampTooOld(i64),
    /// Further in the future than the tolerance.
    #[error("webhook-timestamp is more than {0} s in the future")]
    TimestampInFuture(i64),
    /// No `v1` signature matches any of the receiver's secrets.
    #[error("no webhook-signature matches (wrong secret, or the body was changed)")]
    NoMatchingSignature,
    /// The receiver has no secret configured.
    #[error("no secret to verify with")]
    NoSecret,
}

/// Verifies a message: the timestamp within `tolerance_s` of `now_s` (seconds since the
/// epoch, passed in), and at least one `v1` signature of the header made with one of
/// `secrets`.
///
/// # Errors
/// A [`WebhookError`] naming what failed.
pub fn verify(
    secrets: &[WebhookSecret],
    msg_id: &str,
    timestamp: &str,
    signature: &str,
    body: &[u8],
    now_s: i64,
    tolerance_s: i64,
) -> Result<(), WebhookError> {
    if secrets.is_empty() {
        return Err(WebhookError::NoSecret);
    }
    let ts: i64 = timestamp.trim().parse().map_err(|_| WebhookError::BadTimestamp)?;
    if ts < now_s - tolerance_s {
        return Err(WebhookError::TimestampTooOld(tolerance_s));
    }
    if ts > now_s + tolerance_s {
        return Err(WebhookError::TimestampInFuture(tolerance_s));
    }
    let ok = signature.split(' ').any(|sig| secrets.iter().any(|s| s.verifies(msg_id, ts, body, sig)));
    if ok { Ok(()) } else { Err(WebhookError::NoMatchingSignature) }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The example of the Standard Webhooks specification's reference libraries.
    #[test]
    fn the_specifications_test_vector() {
        let s = WebhookSecret::parse("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").unwrap();
        let body = br#"{"test": 2432232314}"#;
        let sig = s.sign("msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, body);
        assert_eq!(sig, "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=");
        assert!(verify(&[s], "msg_p5jXN8AQM9LWM0D4loKWxJek", "1614265330", &sig, body, 1614265330, 300).is_ok());
    }

    #[test]
    fn rotation_signs_with_both_and_either_verifies() {
        let old = WebhookSecret::parse(&format!("whsec_{}", B64.encode([1u8; 32]))).unwrap();
        let new = WebhookSecret::parse(&B64.encode([2u8; 32])).unwrap();
        let header = signature_header(&[old.clone(), new.clone()], "evt-1", 100, b"{}");
        assert_eq!(header.split(' ').count(), 2);
        for s in [&old, &new] {
            assert!(verify(std::slice::from_ref(s), "evt-1", "100", &header, b"{}", 100, 300).is_ok());
        }
        let other = WebhookSecret::parse(&B64.encode([3u8; 32])).unwrap();
        assert_eq!(verify(&[other], "evt-1", "100", &header, b"{}", 100, 300), Err(WebhookError::NoMatchingSignature));
        assert_eq!(
            verify(std::slice::from_ref(&old), "evt-1", "100", &header, b"{ }", 100, 300),
            Err(WebhookError::NoMatchingSignature)
        );
        assert_eq!(
            verify(std::slice::from_ref(&old), "evt-1", "100", &header, b"{}", 401, 300),
            Err(WebhookError::TimestampTooOld(300))
        );
        assert_eq!(
            verify(std::slice::from_ref(&old), "evt-1", "x", &header, b"{}", 100, 300),
            Err(WebhookError::BadTimestamp)
        );
        assert_eq!(verify(&[], "evt-1", "100", &header, b"{}", 100, 300), Err(WebhookError::NoSecret));
    }

    #[test]
    fn bad_secrets_are_refused_without_showing_them() {
        assert_eq!(WebhookSecret::parse("whsec_not base64!"), Err(SecretError::NotBase64));
        assert_eq!(WebhookSecret::parse(&B64.encode([0u8; 8])), Err(SecretError::BadLength(8)));
        assert_eq!(WebhookSecret::parse(&B64.encode([0u8; 65])), Err(SecretError::BadLength(65)));
        let s = WebhookSecret::parse(&B64.encode([7u8; 24])).unwrap();
        assert_eq!(format!("{s:?}"), "WebhookSecret(***)");
    }
}
