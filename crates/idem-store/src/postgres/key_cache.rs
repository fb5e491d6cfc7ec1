//! A per-node cache of API keys for the PostgreSQL store, so that authenticating a request
//! costs no round trip to the database (on the hot path it was two of a pair's four).
//!
//! Revocation still takes effect everywhere:
//! - every change to `api_keys` other than an insert (a revocation by idem, or an `UPDATE`
//!   or `DELETE` by hand) fires the statement trigger of migration
//!   `0004_api_key_notify.sql`, which sends `NOTIFY idem_api_keys` at commit; every node
//!   `LISTEN`s on that channel on a connection of its own and empties its cache when a
//!   notification arrives (milliseconds after the commit);
//! - the node that revokes empties its own cache before it answers;
//! - the cache is used only while that listening connection is known to be up; from the
//!   moment it is lost until a new one listens again, every request reads the database;
//! - an entry is used for at most [`KEY_TTL`], which bounds how long a revoked key can
//!   still work if the listening connection dies without the node noticing (a silent
//!   network partition).
//!
//! Only found, unrevoked keys are cached (never "unknown key"), at most [`KEY_ENTRIES`]
//! of them; a generation counter keeps a lookup that raced a notification from caching
//! what it read before it.

use crate::keys::ApiKeyInfo;
use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// The channel migration 0004's trigger notifies.
pub(super) const CHANNEL: &str = "idem_api_keys";
/// Longest time a cached key is used without reading it again.
pub const KEY_TTL: Duration = Duration::from_secs(10);
/// Most keys a node caches (each under 300 bytes).
pub const KEY_ENTRIES: usize = 1024;
/// Wait before listening again after the listening connection failed.
const RELISTEN_AFTER: Duration = Duration::from_secs(1);

#[derive(Debug, Default)]
struct Entries {
    /// Bumped by every invalidation.
    generation: u64,
    /// By key digest: the key and when it was read.
    by_hash: HashMap<String, (ApiKeyInfo, Instant)>,
}

/// See the module docs.
#[derive(Debug, Default)]
pub(super) struct KeyCache {
    entries: Mutex<Entries>,
    /// Whether a connection is listening on [`CHANNEL`].
    live: AtomicBool,
}

impl KeyCache {
    /// The cached key for `hash`, if the cache may be used and the entry is fresh.
    pub(super) fn get(&self, hash: &str) -> Option<ApiKeyInfo> {
        if !self.live.load(Ordering::Acquire) {
            return None;
        }
        let entries = self.entries.lock().expect("key cache lock");
        entries.by_hash.get(hash).filter(|(_, at)| at.elapsed() < KEY_TTL).map(|(info, _)| info.clone())
    }

    /// The generation to pass to [`KeyCache::put`] after a database read begun now.
    pub(super) fn generation(&self) -> u64 {
        self.entries.lock().expect("key cache lock").generation
    }

    /// Caches `info`, read from the database after [`KeyCache::generation`] returned
    /// `generation`, unless the cache was emptied since (the read may predate a revocation).
    pub(super) fn put(&self, hash: String, info: &ApiKeyInfo, generation: u64) {
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
    pub(super) fn invalidate(&self) {
        let mut entries = self.entries.lock().expect("key cache lock");
        entries.generation += 1;
        entries.by_hash.clear();
    }

    /// Whether a connection is listening for key changes (the cache is in use).
    pub(super) fn is_live(&self) -> bool {
        self.live.load(Ordering::Acquire)
    }

    fn set_live(&self, live: bool) {
        // Empty first: nothing cached before a gap in listening may be used after it.
        self.invalidate();
        self.live.store(live, Ordering::Release);
    }

    /// Listens on [`CHANNEL`] for as long as the process runs, keeping `live` true only
    /// while a listening connection is up. `url` is the store's database URL; the
    /// connection is its own, outside the store's pool.
    pub(super) fn spawn_listener(self: std::sync::Arc<Self>, url: String) {
        tokio::spawn(async move {
            loop {
                match listen(&url).await {
                    Ok(mut listener) => {
                        self.set_live(true);
                        loop {
                            match listener.try_recv().await {
                                Ok(Some(_)) => self.invalidate(),
                                // The connection was lost (and has been re-established):
                                // notifications in the gap are gone.
                                Ok(None) => self.invalidate(),
                                Err(e) => {
                                    tracing::warn!(error = %e, "API key notifications lost; reading keys from the database");
                                    break;
                                }
                            }
                        }
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "cannot listen for API key changes; reading keys from the database")
                    }
                }
                self.set_live(false);
                tokio::time::sleep(RELISTEN_AFTER).await;
            }
        });
    }
}

async fn listen(url: &str) -> Result<sqlx::postgres::PgListener, sqlx::Error> {
    let mut listener = sqlx::postgres::PgListener::connect(url).await?;
    listener.listen(CHANNEL).await?;
    Ok(listener)
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
