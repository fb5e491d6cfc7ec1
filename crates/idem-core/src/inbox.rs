//! The inbox's pure half (DESIGN.md §8): what a consumer does with a message it may have
//! seen before.
//!
//! A consumer claims the message id in the same database transaction as its business
//! update. [`decide_inbox`] answers from the claim found under that id (if any):
//!
//! | recorded claim | same fingerprint | another fingerprint |
//! |---|---|---|
//! | none | [`InboxDecision::Apply`] (the claim is inserted) | — |
//! | present | [`InboxDecision::Duplicate`] with the recorded outcome: a no-op | [`InboxDecision::Conflict`]: recorded on the claim, reported, never applied |
//!
//! The fingerprint covers what the producer declares as the message's content (for an
//! idem event or a Standard Webhooks message: SHA-256 of the RFC 8785 form of its JSON
//! payload), never transport headers that change on redelivery (`webhook-timestamp`,
//! `webhook-signature`, a broker's delivery count).
//!
//! The same decision serves a key claimed inside the application's transaction (the
//! "one atomic boundary": claim a key, write business rows, store the result): the key is
//! the message id, and the fingerprint covers the action and the payload.
//!
//! The SQL functions `idem.inbox_claim` and `idem.key_claim` (idem-outbox's schema) decide
//! the same way; a parity test runs one table of cases through all of them.

use serde_json::Value;

/// Longest consumer name or message id, in bytes.
pub const MAX_MESSAGE_ID_LEN: usize = 255;

/// A claim already recorded under a message id.
#[derive(Debug, Clone, PartialEq)]
pub struct InboxRecord {
    /// The fingerprint the message was first claimed with (64 hex digits for idem's own).
    pub fingerprint: String,
    /// What the consumer recorded when it finished (`inbox_finish`); `None` when it did
    /// not record one.
    pub outcome: Option<Value>,
}

/// What the consumer does with the message.
#[derive(Debug, Clone, PartialEq)]
pub enum InboxDecision {
    /// First time: apply it (in this transaction), then finish with an outcome.
    Apply,
    /// Seen before with the same content: do nothing; here is what was recorded.
    Duplicate {
        /// The recorded outcome, if one was stored.
        outcome: Option<Value>,
    },
    /// Seen before with other content under the same id: do not apply; report it. The
    /// conflict is recorded on the claim (commit to keep that record).
    Conflict {
        /// The fingerprint the id was first claimed with.
        recorded_fingerprint: String,
    },
}

impl InboxDecision {
    /// The decision's name as the SQL functions return it: `apply`, `duplicate`, `conflict`.
    pub fn as_str(&self) -> &'static str {
        match self {
            InboxDecision::Apply => "apply",
            InboxDecision::Duplicate { .. } => "duplicate",
            InboxDecision::Conflict { .. } => "conflict",
        }
    }
}

/// The decision for a message whose content has `fingerprint`, given the claim recorded
/// under its id (see the module's table).
pub fn decide_inbox(existing: Option<&InboxRecord>, fingerprint: &str) -> InboxDecision {
    match existing {
        None => InboxDecision::Apply,
        Some(r) if r.fingerprint == fingerprint => InboxDecision::Duplicate { outcome: r.outcome.clone() },
        Some(r) => InboxDecision::Conflict { recorded_fingerprint: r.fingerprint.clone() },
    }
}

/// Why a consumer name, message id or fingerprint was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InboxError {
    /// Breaks the rule every stored identifier follows ([`crate::ident`]): empty, longer
    /// than [`MAX_MESSAGE_ID_LEN`] bytes, blank, padded with whitespace, a control
    /// character.
    #[error("{0}")]
    Id(crate::ident::IdError),
    /// A character outside printable ASCII.
    #[error("{0} must be 1-255 printable ASCII characters")]
    BadId(&'static str),
    /// A consumer name starting with `idem.`: idem's own (the claimed idempotency keys).
    #[error("consumer names starting with idem. are reserved")]
    Reserved,
}

/// Checks a consumer name, message id or fingerprint (`what` names it in the error).
///
/// # Errors
/// [`InboxError::BadId`].
pub fn check_id(what: &'static str, id: &str) -> Result<(), InboxError> {
    crate::ident::check_identifier(what, id, MAX_MESSAGE_ID_LEN).map_err(InboxError::Id)?;
    if !id.bytes().all(|b| (0x20..=0x7e).contains(&b)) {
        return Err(InboxError::BadId(what));
    }
    Ok(())
}

/// The parity table: `(recorded claim, fingerprint presented, expected decision)`. The
/// idem-outbox tests run it through the Rust claim on both databases and through the SQL
/// function.
#[doc(hidden)]
pub fn parity_cases() -> Vec<(Option<InboxRecord>, &'static str, InboxDecision)> {
    let rec = |fp: &str, outcome: Option<Value>| Some(InboxRecord { fingerprint: fp.into(), outcome });
    let done = serde_json::json!({"applied": "job-42"});
    vec![
        (None, "fp-a", InboxDecision::Apply),
        (rec("fp-a", Some(done.clone())), "fp-a", InboxDecision::Duplicate { outcome: Some(done.clone()) }),
        (rec("fp-a", None), "fp-a", InboxDecision::Duplicate { outcome: None }),
        (rec("fp-a", Some(done)), "fp-b", InboxDecision::Conflict { recorded_fingerprint: "fp-a".into() }),
        (rec("fp-a", None), "FP-A", InboxDecision::Conflict { recorded_fingerprint: "fp-a".into() }),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_of_the_module_docs() {
        for (existing, fp, expected) in parity_cases() {
            assert_eq!(decide_inbox(existing.as_ref(), fp), expected, "{existing:?} {fp}");
        }
    }

    #[test]
    fn ids_are_bounded_printable_ascii() {
        assert!(check_id("message id", "evt-1").is_ok());
        assert!(check_id("message id", &"x".repeat(255)).is_ok());
        assert_eq!(check_id("message id", "é"), Err(InboxError::BadId("message id")));
        for (bad, _) in crate::ident::BAD_IDS {
            assert!(matches!(check_id("message id", bad), Err(InboxError::Id(_))), "{bad:?}");
        }
        assert!(check_id("consumer", &"x".repeat(256)).is_err());
        // Issue 28 §3, as reported: a blank id, and a padded one that named another message.
        assert!(check_id("message id", "    ").is_err() && check_id("message id", " evt-7").is_err());
    }
}
