//! Keeps a node's API key cache ([`crate::key_cache`]) honest on PostgreSQL: a connection of
//! its own `LISTEN`s on the channel migration 0004's trigger notifies, and the cache is
//! emptied on every notification and used only while that connection is up.

use super::target::Target;
use crate::key_cache::KeyCache;
use sqlx::postgres::PgPoolOptions;
use std::sync::{Arc, Weak};
use std::time::Duration;

/// The channel migration 0004's trigger notifies.
const CHANNEL: &str = "idem_api_keys";
/// Wait before listening again after the listening connection failed.
const RELISTEN_AFTER: Duration = Duration::from_secs(1);
/// How often a waiting listener checks that its store still exists.
const ALIVE_CHECK: Duration = Duration::from_secs(1);

/// Listens for as long as `cache` (its store) exists, on the store's database (`target`:
/// after a failover on the new primary); the connection is outside the store's pool.
pub(super) fn spawn(cache: &Arc<KeyCache>, target: Arc<Target>) {
    let cache = Arc::downgrade(cache);
    tokio::spawn(async move {
        // A pool of one, as `PgListener::connect` makes, that follows the primary: the
        // listener reconnects through it after its connection was lost.
        let options = PgPoolOptions::new().max_connections(1).max_lifetime(None).idle_timeout(None);
        let pool = target.pool_lazy(options, |o| o);
        while cache.strong_count() > 0 {
            match listen(&pool).await {
                Ok(listener) => {
                    watch(&cache, listener).await;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "cannot listen for API key changes; reading keys from the database")
                }
            }
            if let Some(c) = cache.upgrade() {
                c.set_live(false);
            }
            tokio::time::sleep(RELISTEN_AFTER).await;
        }
        pool.close().await;
    });
}

/// Empties the cache on every notification until the connection fails or the store is
/// gone.
async fn watch(cache: &Weak<KeyCache>, mut listener: sqlx::postgres::PgListener) {
    match cache.upgrade() {
        Some(c) => c.set_live(true),
        None => return,
    }
    loop {
        let received = tokio::select! {
            r = listener.try_recv() => r,
            () = tokio::time::sleep(ALIVE_CHECK) => {
                if cache.strong_count() == 0 {
                    return;
                }
                continue;
            }
        };
        let Some(c) = cache.upgrade() else { return };
        match received {
            Ok(Some(_)) => c.invalidate(),
            // The connection was lost (and has been re-established): notifications in the
            // gap are gone.
            Ok(None) => c.invalidate(),
            Err(e) => {
                tracing::warn!(error = %e, "API key notifications lost; reading keys from the database");
                return;
            }
        }
    }
}

async fn listen(pool: &sqlx::PgPool) -> Result<sqlx::postgres::PgListener, sqlx::Error> {
    let mut listener = sqlx::postgres::PgListener::connect_with(pool).await?;
    listener.listen(CHANNEL).await?;
    Ok(listener)
}
