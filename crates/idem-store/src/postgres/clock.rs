//! The ledger's clock on PostgreSQL: the database's time, carried forward on this node's
//! monotonic clock (DESIGN.md §2 invariant 7).
//!
//! Several `idem serve` nodes share one database, and each judges leases, retry times and
//! retention windows against "now". If each used its own wall clock, a node whose clock
//! runs 20 s ahead would see a 15 s lease granted by another node as expired at once:
//! it would grant a second holder (`redo_safe`) or turn live leases UNKNOWN. So every
//! node reads the *database's* clock (`clock_timestamp()`), a few times, keeps the
//! reading with the shortest round trip, and anchors it to [`Instant`] (`CLOCK_MONOTONIC`):
//! `now = database time at the anchor + monotonic time elapsed since`. A wrong or stepped
//! wall clock on the node changes nothing. The reading is renewed every
//! [`RESYNC_INTERVAL`] in the background, and at once when the database's primary moves
//! (a failover: the new primary's clock is the ledger's from then on; the reading never
//! moves time back).
//!
//! How far this can be from the database's clock (the *uncertainty*): half the anchor
//! reading's round trip (the reply could have been read anywhere within it) plus a drift
//! allowance of [`DRIFT_PPM`] of the time since the anchor (quartz oscillators stay
//! within about 100 ppm). A node whose uncertainty exceeds its bound
//! (`--max-clock-uncertainty-ms`, [`DEFAULT_MAX_UNCERTAINTY_MS`]) logs a warning, and
//! `idem serve` reports it not ready (`/readyz`). An offset between the database and this
//! node's wall clock above [`LARGE_OFFSET_MS`] is logged once: harmless to idem, but
//! worth fixing for the node's other software.

use crate::StoreError;
use idem_core::Clock;
use sqlx::postgres::{PgPool, PgPoolOptions};
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// How often the database's clock is read again.
pub const RESYNC_INTERVAL: Duration = Duration::from_secs(15);
/// Drift allowed between this node's monotonic clock and the database's clock, in parts
/// per million (100 ppm: 0.1 ms per second, 360 ms per hour without a new reading).
pub const DRIFT_PPM: i64 = 100;
/// Default bound on the uncertainty (ms), beyond which the node is not ready.
pub const DEFAULT_MAX_UNCERTAINTY_MS: i64 = 500;
/// An offset (database minus this node's wall clock) beyond this (ms) is logged, once.
pub const LARGE_OFFSET_MS: i64 = 1_000;
/// Readings per synchronisation; the one with the shortest round trip is kept.
const SAMPLES: usize = 5;

/// One reading of the database's clock, anchored to this node's monotonic clock.
#[derive(Debug, Clone, Copy)]
struct Anchor {
    /// The database's time at `at`, in epoch microseconds.
    db_us: i64,
    /// The monotonic instant of the reading (the middle of its round trip).
    at: Instant,
    /// Half the reading's round trip, in microseconds.
    half_rtt_us: i64,
    /// The database's time minus this node's wall clock at the reading, in ms.
    offset_ms: i64,
}

/// What a node knows about its clock, for `/metrics` and `/readyz`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClockStatus {
    /// The database's clock minus this node's wall clock at the last reading (ms):
    /// negative when the node's wall clock runs ahead.
    pub offset_ms: i64,
    /// How far `now_ms` may be from the database's clock right now (ms): half the last
    /// reading's round trip plus [`DRIFT_PPM`] of the time since it.
    pub uncertainty_ms: i64,
    /// The bound the uncertainty must stay within (ms).
    pub max_uncertainty_ms: i64,
    /// How long ago the last reading was taken (ms).
    pub since_reading_ms: i64,
}

impl ClockStatus {
    /// Whether the uncertainty is within its bound.
    pub fn within_bound(&self) -> bool {
        self.uncertainty_ms <= self.max_uncertainty_ms
    }
}

/// The uncertainty (ms, rounded up) of a reading whose round trip was `2 × half_rtt_us`
/// µs, `since` after it was taken.
pub fn uncertainty_ms(half_rtt_us: i64, since: Duration) -> i64 {
    let drift_us = i64::try_from(since.as_micros() * DRIFT_PPM as u128 / 1_000_000).unwrap_or(i64::MAX / 2);
    half_rtt_us.saturating_add(drift_us).saturating_add(999) / 1000
}

/// The database's clock, read through a connection of its own: a [`Clock`] for every
/// part of an `idem serve` process on PostgreSQL (store, executor, reconciler, sweepers,
/// admin page). Never goes backwards within the process.
pub struct DatabaseClock {
    pool: PgPool,
    /// Where the database is: kept so that the pool follows its primary.
    _target: Arc<super::target::Target>,
    anchor: RwLock<Anchor>,
    /// The latest instant handed out (epoch ms): a new reading never moves time back.
    last_ms: AtomicI64,
    max_uncertainty_ms: i64,
    warned_offset: AtomicBool,
    warned_uncertain: AtomicBool,
}

impl std::fmt::Debug for DatabaseClock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DatabaseClock").field("status", &self.status()).finish_non_exhaustive()
    }
}

impl Clock for DatabaseClock {
    fn now_ms(&self) -> i64 {
        let a = *self.anchor.read().unwrap_or_else(std::sync::PoisonError::into_inner);
        let since_us = i64::try_from(a.at.elapsed().as_micros()).unwrap_or(i64::MAX / 2);
        let now = (a.db_us + since_us).div_euclid(1000);
        self.last_ms.fetch_max(now, Ordering::SeqCst).max(now)
    }
}

impl DatabaseClock {
    /// Connects to `url` (one connection of its own), reads the database's clock and starts
    /// re-reading it every [`RESYNC_INTERVAL`] until the clock is dropped.
    /// `max_uncertainty_ms` is the bound [`ClockStatus::within_bound`] checks.
    ///
    /// # Errors
    /// [`StoreError::Database`] if the database cannot be reached or read.
    pub async fn connect(url: &str, max_uncertainty_ms: i64) -> Result<Arc<Self>, StoreError> {
        let target = super::target::Target::shared(url)?;
        let pool = target
            .pool(
                PgPoolOptions::new().max_connections(1).acquire_timeout(Duration::from_secs(10)),
                super::pool_options,
                None,
            )
            .await?;
        let anchor = read(&pool).await?;
        let mut moves = target.moves();
        let clock = Arc::new(DatabaseClock {
            pool,
            _target: target,
            anchor: RwLock::new(anchor),
            last_ms: AtomicI64::new(i64::MIN),
            max_uncertainty_ms,
            warned_offset: AtomicBool::new(false),
            warned_uncertain: AtomicBool::new(false),
        });
        clock.check();
        let weak = Arc::downgrade(&clock);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(RESYNC_INTERVAL);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            tick.tick().await;
            loop {
                tokio::select! {
                    _ = tick.tick() => {}
                    // The primary moved: read the new one's clock now.
                    Ok(()) = moves.changed() => {}
                }
                let Some(clock) = weak.upgrade() else { return };
                clock.resync().await;
            }
        });
        Ok(clock)
    }

    /// Reads the database's clock again now. On failure the last reading stays (its
    /// uncertainty keeps growing by the drift allowance) and a warning is logged.
    pub async fn resync(&self) {
        match read(&self.pool).await {
            Ok(a) => *self.anchor.write().unwrap_or_else(std::sync::PoisonError::into_inner) = a,
            Err(e) => tracing::warn!(error = %e, "cannot read the database's clock; going on with the last reading"),
        }
        self.check();
    }

    /// The offset and uncertainty as of now.
    pub fn status(&self) -> ClockStatus {
        let a = *self.anchor.read().unwrap_or_else(std::sync::PoisonError::into_inner);
        let since = a.at.elapsed();
        ClockStatus {
            offset_ms: a.offset_ms,
            uncertainty_ms: uncertainty_ms(a.half_rtt_us, since),
            max_uncertainty_ms: self.max_uncertainty_ms,
            since_reading_ms: i64::try_from(since.as_millis()).unwrap_or(i64::MAX),
        }
    }

    /// Logs a large offset (once) and an uncertainty beyond its bound (when it starts and
    /// when it ends).
    fn check(&self) {
        let s = self.status();
        if s.offset_ms.abs() > LARGE_OFFSET_MS && !self.warned_offset.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                offset_ms = s.offset_ms,
                "this node's wall clock differs from the database's by more than {LARGE_OFFSET_MS} ms; \
                 idem judges leases on the database's clock, but fix the node's time (NTP)"
            );
        }
        let beyond = !s.within_bound();
        if beyond && !self.warned_uncertain.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                uncertainty_ms = s.uncertainty_ms,
                max_uncertainty_ms = s.max_uncertainty_ms,
                "the database's time is known only within {} ms here, beyond --max-clock-uncertainty-ms: not ready",
                s.uncertainty_ms
            );
        } else if !beyond && self.warned_uncertain.swap(false, Ordering::Relaxed) {
            tracing::info!(uncertainty_ms = s.uncertainty_ms, "the database's clock is within its bound again");
        }
    }
}

/// Reads the database's clock [`SAMPLES`] times and keeps the reading with the shortest
/// round trip.
async fn read(pool: &PgPool) -> Result<Anchor, StoreError> {
    let mut conn = pool.acquire().await?;
    let mut best: Option<Anchor> = None;
    for _ in 0..SAMPLES {
        let wall_before = SystemTime::now();
        let before = Instant::now();
        let (db_us,): (i64,) = sqlx::query_as("SELECT CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000000 AS BIGINT)")
            .fetch_one(&mut *conn)
            .await?;
        let rtt = before.elapsed();
        let half = rtt / 2;
        let wall_us = (wall_before + half).duration_since(UNIX_EPOCH).map_or(0, |d| d.as_micros() as i64);
        let a = Anchor {
            db_us,
            at: before + half,
            half_rtt_us: i64::try_from(half.as_micros()).unwrap_or(i64::MAX / 2),
            offset_ms: (db_us - wall_us).div_euclid(1000),
        };
        if best.is_none_or(|b| a.half_rtt_us < b.half_rtt_us) {
            best = Some(a);
        }
    }
    best.ok_or_else(|| StoreError::Corrupt("no clock reading".into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uncertainty_is_half_the_round_trip_plus_the_drift_allowance() {
        assert_eq!(uncertainty_ms(0, Duration::ZERO), 0);
        assert_eq!(uncertainty_ms(1_500, Duration::ZERO), 2, "rounded up");
        // 100 ppm: 0.1 ms per second.
        assert_eq!(uncertainty_ms(0, Duration::from_secs(10)), 1);
        assert_eq!(uncertainty_ms(500, Duration::from_secs(3600)), 361);
        assert_eq!(uncertainty_ms(0, Duration::from_millis(1_500)), 1);
    }
}
