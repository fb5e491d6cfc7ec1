//! A per-node cache of API keys, so that authenticating a request costs no database read
//! (on the hot path it was half of a pair's round trips on PostgreSQL, and a hop to a
//! SQLite reader thread per request on SQLite).
//!
//! Revocation still takes effect promptly, whoever makes it:
//! - every change to `api_keys` other than an insert (a revocation by idem, by another
//!   node or by the CLI on the same database, or an `UPDATE` or `DELETE` by hand) fires a
//!   trigger: on PostgreSQL it sends `NOTIFY idem_api_keys` at commit (migration 0004),
//!   which every node `LISTEN`s for (`postgres/key_listener.rs`); on SQLite it bumps
//!   `api_key_epoch` (migration 0007), which the node reads every
//!   [`crate::sqlite::KEY_EPOCH_POLL`]. Either way the node then empties its cache;
//! - the node that revokes empties its own cache before it answers;
//! - the cache is used only while that watch is known to work (`live`): from the
//!   moment it fails until it works again, every request reads the database;
//! - an entry is used for at most [`KEY_TTL`], which bounds how long a revoked key can
//!   still work if the watch breaks without the node noticing (a silent network
//!   partition from PostgreSQL).
//!
//! Only found, unrevoked keys are cached (never "unknown key"), at most [`KEY_ENTRIES`]
//! of them; a generation counter keeps a lookup that raced an invalidation from caching
//! what it read before it.

use crate::keys::ApiKeyInfo;
use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// Longest time a cached key is used without reading it again.
pub const KEY_TTL: Duration = Duration::from_secs(10);
/// Most keys a node caches (each under 300 bytes).
pub const KEY_ENTRIES: usize = 1024;

#[derive(Debug, Default)]
struct Entries {
    /// Bumped by every invalidation.
    generation: u64,
    /// By key digest: the key and when it was read.
    by_hash: HashMap<String, (ApiKeyInfo, Instant)>,
}

/// See the module docs.
#[derive(Debug, Default)]
pub(crate) struct KeyCache {
    entries: Mutex<Entries>,
    /// Whether the watch on key changes works (the cache may be used).
    live: AtomicBool,
}

impl KeyCache {
    /// The key whose secret is `secret`: from the cache, or else from `read` (the database
    /// lookup of a digest, given the digest), cached if found and unrevoked.
    ///
    /// # Errors
    /// What `read` returns.
    pub(crate) async fn authenticate<Fut>(
        &self,
        secret: &str,
        read: impl FnOnce(String) -> Fut,
    ) -> Result<Option<ApiKeyInfo>, crate::StoreError>
    where
        Fut: std::future::Future<Output = Result<Option<ApiKeyInfo>, crate::StoreError>>,
    {
        let hash = crate::keys::hash_secret(secret);
        if let Some(info) = self.get(&hash) {
            return Ok(Some(info));
        }
        let generation = self.generation();
        let found = read(hash.clone()).await?;
        if let Some(info) = &found {
            self.put(hash, info, generation);
        }
        Ok(found)
    }

    /// The cached key for `hash`, if the cache may be used and the entry is fresh.
    pub(crate) fn get(&self, hash: &str) -> Option<ApiKeyInfo> {
        if !self.live.load(Ordering::Acquire) {
            return None;
        }
        let entries = self.entries.lock().expect("key cache lock");
        entries.by_hash.get(hash).filter(|(_, at)| at.elapsed() < KEY_TTL).map(|(info, _)| info.clone())
    }

    /// The generation to pass to [`KeyCache::put`] after a database read begun now.
    pub(crate) fn generation(&self) -> u64 {
        self.entries.lock().expect("key cache lock").generation
    }

    /// Caches `info`, read from the database after [`KeyCache::generation`] returned
    /// `generation`, unless the cache was emptied since (the read may predate a revocation).
    pub(crate) fn put(&self, hash: String, info: &ApiKeyInfo, generation: u64) {
        if info.revoked_at.is_some() || !self.live.load(Ordering::Acquire) {
            return;
        }
        let mut entries = self.entries.lock().expect("key cache lock");
        if entries.generation != generation {
            return;
        }
        if entries.by_hash.len() >= KEY_ENTRIES {
            entries.by_hash.clear();
        }
        entries.by_hash.insert(hash, (info.clone(), Instant::now()));
    }

    /// Empties the cache (a key changed somewhere, or notifications may have been missed).
    pub(crate) fn invalidate(&self) {
        let mut entries = self.entries.lock().expect("key cache lock");
        entries.generation += 1;
        entries.by_hash.clear();
    }

    /// Whether the watch on key changes works (the cache is in use).
    pub(crate) fn is_live(&self) -> bool {
        self.live.load(Ordering::Acquire)
    }

    /// Marks the watch on key changes as working or not; either way the cache starts
    /// empty, since nothing cached before a gap in watching may be used after it.
    pub(crate) fn set_live(&self, live: bool) {
        self.invalidate();
        self.live.store(live, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::keys::Role;

    fn info() -> ApiKeyInfo {
        ApiKeyInfo {
            id: "k1".into(),
            tenant: "t".into(),
            principal: "p".into(),
            role: Role::Client,
            created_at: 1,
            revoked_at: None,
        }
    }

    #[test]
    fn nothing_is_cached_or_served_while_not_listening() {
        let c = KeyCache::default();
        c.put("h".into(), &info(), c.generation());
        assert_eq!(c.get("h"), None);
        c.set_live(true);
        c.put("h".into(), &info(), c.generation());
        assert_eq!(c.get("h"), Some(info()));
        c.set_live(false);
        assert_eq!(c.get("h"), None);
    }

    #[test]
    fn a_read_that_raced_an_invalidation_is_not_cached() {
        let c = KeyCache::default();
        c.set_live(true);
        let before = c.generation();
        c.invalidate();
        c.put("h".into(), &info(), before);
        assert_eq!(c.get("h"), None);
    }

    #[test]
    fn revoked_keys_are_never_cached() {
        let c = KeyCache::default();
        c.set_live(true);
        c.put("h".into(), &ApiKeyInfo { revoked_at: Some(2), ..info() }, c.generation());
        assert_eq!(c.get("h"), None);
    }
}
