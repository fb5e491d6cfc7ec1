//! Records a store wrote (or read) last, to skip the read before the next write of the
//! same key: a completion usually follows its acquire within milliseconds.
//!
//! Each store decides when a cached record may be trusted:
//! - PostgreSQL (several nodes): a cached record is only the base of a conditional write
//!   (`WHERE version = <cached version> AND created_at = <cached created_at>`; if another
//!   node changed the record since, or the key was reused for a new record after its
//!   tombstone expired, the write does nothing and the store re-reads), or the answer to a
//!   trigger when it is SUCCEEDED or FAILED (final records never change) and not past its
//!   retention (`expires_at`), so it cannot have been swept.
//! - SQLite (one writer connection per process, the write lock held per batch): the cache
//!   holds only what that connection committed or read, and is trusted while
//!   `PRAGMA data_version` shows no commit by any other connection and no command outside
//!   the hot path (sweeps, lease expiry, reconciliation, workflows) ran; see
//!   `sqlite_batch::run_batch`.
//!
//! Bounded: at most [`CACHE_ENTRIES`] records, each with a payload and result of at most
//! about [`CACHE_MAX_JSON_BYTES`] bytes ([`json_fits`]; larger ones are not cached); full,
//! it starts over. Worst case about 2048 × 16 KiB of JSON values, in practice a few MiB.

use idem_core::OperationRecord;
use std::collections::HashMap;
use std::sync::Mutex;

/// Records kept by [`RecordCache`].
pub(crate) const CACHE_ENTRIES: usize = 2048;
/// Largest payload (and result) of a cached record, in bytes as [`json_fits`] counts them.
pub(crate) const CACHE_MAX_JSON_BYTES: usize = 8 * 1024;

/// See the module docs.
#[derive(Debug)]
pub(crate) struct RecordCache {
    map: Mutex<Entries>,
    entries: usize,
}

/// The records by tenant, then key: a lookup by `&str` allocates nothing (a map keyed by
/// `(String, String)` needs both owned for every lookup).
#[derive(Debug, Default)]
struct Entries {
    by_tenant: HashMap<String, HashMap<String, OperationRecord>>,
    len: usize,
}

impl Entries {
    fn remove(&mut self, tenant: &str, key: &str) -> Option<OperationRecord> {
        let removed = self.by_tenant.get_mut(tenant)?.remove(key);
        self.len -= usize::from(removed.is_some());
        removed
    }
}

impl Default for RecordCache {
    fn default() -> Self {
        Self::new(CACHE_ENTRIES)
    }
}

impl RecordCache {
    /// A cache of at most `entries` records.
    pub(crate) fn new(entries: usize) -> Self {
        RecordCache { map: Mutex::default(), entries }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Entries> {
        self.map.lock().expect("record cache lock")
    }

    /// A copy of the cached record of `(tenant, key)`.
    pub(crate) fn get(&self, tenant: &str, key: &str) -> Option<OperationRecord> {
        self.lock().by_tenant.get(tenant)?.get(key).cloned()
    }

    /// The cached record of `(tenant, key)`, taken out of the cache: for a single owner
    /// (the SQLite writer) that puts it back, changed or not, once its batch committed.
    pub(crate) fn take(&self, tenant: &str, key: &str) -> Option<OperationRecord> {
        self.lock().remove(tenant, key)
    }

    /// Keeps `r` (or forgets its key when its payload or result is too large).
    pub(crate) fn put(&self, r: OperationRecord) {
        let small = |v: &serde_json::Value| json_fits(v, CACHE_MAX_JSON_BYTES);
        if !small(&r.payload) || r.result.as_ref().is_some_and(|v| !small(v)) {
            self.forget(&r.tenant, &r.key);
            return;
        }
        let mut map = self.lock();
        let replaces = map.by_tenant.get(&r.tenant).is_some_and(|keys| keys.contains_key(&r.key));
        if map.len >= self.entries && !replaces {
            map.by_tenant.clear();
            map.len = 0;
        }
        let keys = match map.by_tenant.get_mut(&r.tenant) {
            Some(keys) => keys,
            None => map.by_tenant.entry(r.tenant.clone()).or_default(),
        };
        let added = keys.insert(r.key.clone(), r).is_none();
        map.len += usize::from(added);
    }

    /// Drops the record of `(tenant, key)`.
    pub(crate) fn forget(&self, tenant: &str, key: &str) {
        self.lock().remove(tenant, key);
    }

    /// Drops every record.
    pub(crate) fn clear(&self) {
        let mut map = self.lock();
        map.by_tenant.clear();
        map.len = 0;
    }
}

/// Whether `v` is at most about `limit` bytes: the lengths of its strings (member names
/// included) plus 8 bytes for every value (a number counts 8), given up as soon as the limit is passed. A
/// bound on what a cached record holds, not its exact size: a walk, not a serialisation
/// (this runs on every write of the hot path; serialising cost ~4 000 instructions for a
/// three-field payload, callgrind).
pub(crate) fn json_fits(v: &serde_json::Value, limit: usize) -> bool {
    fn walk(v: &serde_json::Value, left: &mut usize) -> bool {
        use serde_json::Value;
        let own = match v {
            Value::String(s) => s.len(),
            _ => 0,
        } + 8;
        if own > *left {
            return false;
        }
        *left -= own;
        match v {
            Value::Array(items) => items.iter().all(|i| walk(i, left)),
            Value::Object(m) => m.iter().all(|(k, i)| {
                if k.len() > *left {
                    return false;
                }
                *left -= k.len();
                walk(i, left)
            }),
            _ => true,
        }
    }
    let mut left = limit;
    walk(v, &mut left)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn record(tenant: &str, key: &str) -> OperationRecord {
        let input = idem_core::AcquireInput {
            tenant: tenant.into(),
            key: key.into(),
            action: "a".into(),
            payload: json!({"n": 1}),
            fingerprint: "f".into(),
            lease_ms: 1000,
            redo_safe: false,
            connector: None,
            holder: None,
            actor: idem_core::Actor::default(),
        };
        idem_core::plan_acquire(None, &input, 1).record
    }

    #[test]
    fn take_removes_put_keeps_and_a_full_cache_starts_over() {
        let cache = RecordCache::new(3);
        cache.put(record("t1", "a"));
        cache.put(record("t1", "b"));
        cache.put(record("t2", "a"));
        assert_eq!(cache.get("t2", "a").map(|r| r.tenant), Some("t2".into()));
        assert_eq!(cache.take("t1", "a").map(|r| r.key), Some("a".into()));
        assert!(cache.take("t1", "a").is_none(), "taken out");
        assert!(cache.get("t1", "b").is_some());
        cache.put(record("t1", "a"));
        cache.put(record("t1", "a"));
        assert_eq!(cache.lock().len, 3, "putting a key twice keeps one entry");
        cache.put(record("t3", "c"));
        assert!(cache.get("t1", "b").is_none(), "full: started over");
        assert!(cache.get("t3", "c").is_some());
        assert_eq!(cache.lock().len, 1);
        cache.forget("t3", "c");
        assert_eq!(cache.lock().len, 0);
    }

    #[test]
    fn json_fits_counts_strings_names_and_values() {
        // 8 per value (object, string, number) + "to" + "customer-42" + "n".
        let v = json!({"to": "customer-42", "n": 42});
        let n = 3 * 8 + 2 + 11 + 1;
        assert!(json_fits(&v, n));
        assert!(!json_fits(&v, n - 1));
        assert!(!json_fits(&json!("x".repeat(10_000)), 8 * 1024));
        assert!(!json_fits(&json!([["x".repeat(5_000)], ["y".repeat(5_000)]]), 8 * 1024));
        assert!(json_fits(&json!(null), 8));
    }
}
