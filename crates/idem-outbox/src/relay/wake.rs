//! Waking the relay on commit: PostgreSQL `LISTEN idem_outbox` (`idem.outbox_append`
//! NOTIFYs at commit). A notification is only a hint — at most one is kept, and a lost one
//! costs one poll interval — the poll is what the relay relies on.

use sqlx::PgPool;
use sqlx::postgres::PgListener;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Notify;

/// Listens on `pool`'s database in a background task (reconnecting after a failure) and
/// returns the hint to wait on.
pub fn listen(pool: PgPool) -> Arc<Notify> {
    let hint = Arc::new(Notify::new());
    let h = hint.clone();
    tokio::spawn(async move {
        loop {
            match PgListener::connect_with(&pool).await {
                Ok(mut l) => match l.listen("idem_outbox").await {
                    Ok(()) => {
                        // Events committed while not listening are found by the next poll.
                        h.notify_one();
                        while l.recv().await.is_ok() {
                            h.notify_one();
                        }
                        tracing::warn!("the relay's LISTEN connection dropped; polling until it is back");
                    }
                    Err(e) => tracing::warn!(error = %e, "LISTEN idem_outbox failed; polling"),
                },
                Err(e) => tracing::warn!(error = %e, "cannot open the relay's LISTEN connection; polling"),
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    });
    hint
}
