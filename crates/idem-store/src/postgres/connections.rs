//! The connections the batch writers own, outside the store's pool.
//!
//! sqlx (0.9, `PoolConnection::return_to_pool`) sends a `Sync` and waits for PostgreSQL's
//! answer every time a pooled connection is released: one more round trip per statement,
//! which on the hot path cost as much as the statement itself. A batch statement runs to
//! completion in its own task (it is never cancelled half-way), so its connection is
//! clean afterwards and can be reused as is; one that failed other than with an error
//! PostgreSQL reported (I/O, protocol) is dropped, and a new one is opened when needed.
//! New connections go to the database's primary ([`Target::connect`]); an idle one opened
//! before the primary moved is closed instead of used.

use super::target::{Target, Tune};
use crate::StoreError;
use sqlx::Postgres;
use sqlx::postgres::{PgArguments, PgConnection, PgQueryResult, PgRow};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// An unbounded set of idle connections; the batchers' in-flight limits bound how many
/// exist (at most one per batch in flight).
#[derive(Debug)]
pub(super) struct Connections {
    target: Arc<Target>,
    tune: Tune,
    /// Idle connections and when each was opened.
    idle: Mutex<Vec<(Instant, PgConnection)>>,
    /// Longest wait for a new connection (the store's acquire timeout).
    connect_timeout: std::time::Duration,
}

impl Connections {
    pub(super) fn new(target: Arc<Target>, tune: Tune, connect_timeout: std::time::Duration) -> Self {
        Connections { target, tune, idle: Mutex::new(Vec::new()), connect_timeout }
    }

    async fn take(&self) -> Result<(Instant, PgConnection), StoreError> {
        loop {
            let idle = self.idle.lock().expect("connections lock").pop();
            match idle {
                Some((opened, _)) if self.target.opened_before_move(opened.elapsed()) => continue,
                Some(conn) => return Ok(conn),
                None => break,
            }
        }
        match tokio::time::timeout(self.connect_timeout, self.target.connect(self.tune)).await {
            Ok(conn) => Ok((Instant::now(), conn?)),
            Err(_) => Err(StoreError::Database(sqlx::Error::PoolTimedOut)),
        }
    }

    fn give<T>(&self, conn: (Instant, PgConnection), outcome: &Result<T, sqlx::Error>) {
        // A server-reported error leaves the connection in a known state; anything else
        // (a broken socket, a protocol error) may not.
        if matches!(outcome, Ok(_) | Err(sqlx::Error::Database(_))) {
            self.idle.lock().expect("connections lock").push(conn);
        }
    }

    /// Runs `q` on an owned connection and returns its rows.
    pub(super) async fn fetch_all(
        &self,
        q: sqlx::query::Query<'_, Postgres, PgArguments>,
    ) -> Result<Vec<PgRow>, StoreError> {
        let mut conn = self.take().await?;
        let out = q.fetch_all(&mut conn.1).await;
        self.give(conn, &out);
        Ok(out?)
    }

    /// Runs `q` on an owned connection.
    pub(super) async fn execute(
        &self,
        q: sqlx::query::Query<'_, Postgres, PgArguments>,
    ) -> Result<PgQueryResult, StoreError> {
        let mut conn = self.take().await?;
        let out = q.execute(&mut conn.1).await;
        self.give(conn, &out);
        Ok(out?)
    }
}
