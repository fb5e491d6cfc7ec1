//! Retention and late arrivals (DESIGN.md §6).
//!
//! A final record (SUCCEEDED or FAILED) is kept for its action's retention window,
//! counted from `completed_at` (default 24 h; `forever` for permanent business keys), then
//! removed by the sweeper, which leaves a compact [`Tombstone`]: the key's SHA-256, the
//! fingerprint, the final state and `completed_at`. The tombstone is kept until
//! `completed_at` + the tombstone window (default 30 days, never shorter than the
//! retention). A trigger that finds only a live tombstone is a *late arrival*: HTTP 410,
//! nothing executes. Once the tombstone is gone too, the key is new again.
//!
//! Records that are not final (PENDING, EXECUTING, UNKNOWN, flagged for review) never
//! expire: `expires_at` is set only when a record becomes final.

use crate::State;
use crate::decision::{AcquireInput, AcquirePlan, Decision};
use crate::fingerprint::sha256_hex;
use crate::record::OperationRecord;
use std::collections::BTreeMap;

/// One day, in ms.
pub const DAY_MS: i64 = 86_400_000;

/// How long final records and their tombstones are kept.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Retention {
    /// Retention of actions without their own (ms); `None` = forever.
    pub default_ms: Option<i64>,
    /// Per-action retention (ms); `None` = forever.
    pub per_action: BTreeMap<String, Option<i64>>,
    /// How long a tombstone outlives completion (ms); at least the retention.
    pub tombstone_ms: i64,
}

impl Default for Retention {
    /// 24 h for records, 30 days for tombstones.
    fn default() -> Self {
        Retention { default_ms: Some(DAY_MS), per_action: BTreeMap::new(), tombstone_ms: 30 * DAY_MS }
    }
}

impl Retention {
    /// The retention of `action` (ms), `None` = forever.
    pub fn of(&self, action: &str) -> Option<i64> {
        self.per_action.get(action).copied().unwrap_or(self.default_ms)
    }

    /// Sets `expires_at` on a record that just became final (and never on any other).
    pub fn apply(&self, rec: &mut OperationRecord) {
        rec.expires_at = match (rec.state.is_final(), rec.completed_at) {
            (true, Some(done)) => self.of(&rec.action).map(|r| done.saturating_add(r)),
            _ => None,
        };
    }

    /// When the tombstone of `rec` (final, completed) may go.
    pub fn tombstone_until(&self, rec: &OperationRecord) -> i64 {
        let done = rec.completed_at.unwrap_or(rec.updated_at);
        let kept = self.of(&rec.action).unwrap_or(0).max(self.tombstone_ms);
        done.saturating_add(kept)
    }
}

/// Whether the sweeper may remove `rec` at `now_ms`: only final records past `expires_at`.
pub fn is_expired(rec: &OperationRecord, now_ms: i64) -> bool {
    rec.state.is_final() && rec.expires_at.is_some_and(|t| t <= now_ms)
}

/// What is left of a removed record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tombstone {
    /// Tenant.
    pub tenant: String,
    /// SHA-256 hex of the key (the key itself is not kept).
    pub key_hash: String,
    /// Fingerprint of the intent.
    pub fingerprint: String,
    /// SUCCEEDED or FAILED.
    pub final_state: State,
    /// When the operation completed (epoch ms).
    pub completed_at: i64,
    /// When the tombstone may go (epoch ms).
    pub expires_at: i64,
}

/// The hash a tombstone is found by.
pub fn key_hash(key: &str) -> String {
    sha256_hex(key.as_bytes())
}

impl Tombstone {
    /// The tombstone the sweeper leaves for `rec`.
    pub fn of(rec: &OperationRecord, retention: &Retention) -> Tombstone {
        Tombstone {
            tenant: rec.tenant.clone(),
            key_hash: key_hash(&rec.key),
            fingerprint: rec.fingerprint.clone(),
            final_state: rec.state,
            completed_at: rec.completed_at.unwrap_or(rec.updated_at),
            expires_at: retention.tombstone_until(rec),
        }
    }
}

/// The plan for a trigger that finds no record but a tombstone: a late arrival (410) while
/// the tombstone lives, whatever the fingerprint; `None` once it expired (the key is new).
/// Nothing is written: the record it would belong to is gone.
pub fn plan_late_arrival(t: &Tombstone, input: &AcquireInput, now_ms: i64) -> Option<AcquirePlan> {
    if t.expires_at <= now_ms {
        return None;
    }
    // A view of what the tombstone remembers (nothing is written).
    let mut stub = input.new_record(t.completed_at);
    stub.fingerprint = t.fingerprint.clone();
    stub.payload = serde_json::Value::Null;
    stub.state = t.final_state;
    stub.redo_safe = false;
    stub.connector = None;
    stub.completed_at = Some(t.completed_at);
    stub.expires_at = Some(t.expires_at);
    Some(AcquirePlan { decision: Decision::Late, record: stub, changed: false, events: Vec::new() })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decision::plan_acquire;
    use crate::record::Actor;
    use serde_json::json;

    fn input() -> AcquireInput {
        AcquireInput {
            tenant: "t".into(),
            key: "INQ-007".into(),
            action: "send".into(),
            payload: json!({}),
            fingerprint: "f".into(),
            lease_ms: 1000,
            redo_safe: false,
            connector: None,
            holder: None,
            actor: Actor::default(),
        }
    }

    #[test]
    fn only_final_records_get_an_expiry() {
        let r = Retention {
            default_ms: Some(1000),
            per_action: [("forever-action".to_string(), None)].into(),
            tombstone_ms: 5000,
        };
        let mut rec = plan_acquire(None, &input(), 0).record;
        r.apply(&mut rec);
        assert_eq!(rec.expires_at, None, "EXECUTING never expires");
        for s in [State::Pending, State::Unknown, State::Executing] {
            rec.state = s;
            rec.completed_at = Some(10);
            r.apply(&mut rec);
            assert!(!is_expired(&rec, i64::MAX), "{s} must never expire");
        }
        rec.state = State::Succeeded;
        r.apply(&mut rec);
        assert_eq!(rec.expires_at, Some(1010));
        assert!(!is_expired(&rec, 1009) && is_expired(&rec, 1010));
        rec.action = "forever-action".into();
        r.apply(&mut rec);
        assert_eq!(rec.expires_at, None);
    }

    #[test]
    fn a_live_tombstone_makes_a_late_arrival_then_the_key_is_new() {
        let r = Retention { default_ms: Some(1000), per_action: BTreeMap::new(), tombstone_ms: 5000 };
        let mut rec = plan_acquire(None, &input(), 0).record;
        rec.state = State::Succeeded;
        rec.completed_at = Some(100);
        let t = Tombstone::of(&rec, &r);
        assert_eq!(t.expires_at, 5100);
        assert_ne!(t.key_hash, rec.key, "the key itself is not kept");
        let mut other = input();
        other.fingerprint = "different".into();
        assert_eq!(plan_late_arrival(&t, &other, 2000).unwrap().decision, Decision::Late);
        assert!(plan_late_arrival(&t, &input(), 5100).is_none());
    }
}
