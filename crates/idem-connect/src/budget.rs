//! The retry budget: a token bucket per connector, so an outage cannot become a retry
//! storm (DESIGN.md §4). First attempts are not charged; every retry takes one token.
//! The bucket holds at most `burst` tokens and refills at `per_s` tokens per second.

use std::sync::Mutex;
use std::time::Instant;

/// A token bucket.
#[derive(Debug)]
pub struct RetryBudget {
    per_s: f64,
    burst: f64,
    state: Mutex<(f64, Instant)>,
}

impl RetryBudget {
    /// A full bucket of `burst` tokens refilling at `per_s` per second.
    pub fn new(per_s: f64, burst: f64) -> Self {
        RetryBudget { per_s, burst, state: Mutex::new((burst, Instant::now())) }
    }

    /// Takes one token if there is one.
    pub fn try_take(&self) -> bool {
        self.try_take_at(Instant::now())
    }

    fn try_take_at(&self, now: Instant) -> bool {
        let mut guard = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let (tokens, last) = *guard;
        let refilled = (tokens + now.saturating_duration_since(last).as_secs_f64() * self.per_s).min(self.burst);
        if refilled >= 1.0 {
            *guard = (refilled - 1.0, now);
            true
        } else {
            *guard = (refilled, now);
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_burst_then_the_refill_rate() {
        let b = RetryBudget::new(2.0, 3.0);
        let t0 = Instant::now();
        assert_eq!((0..10).filter(|_| b.try_take_at(t0)).count(), 3);
        assert!(!b.try_take_at(t0 + Duration::from_millis(400)));
        assert!(b.try_take_at(t0 + Duration::from_millis(500)));
        // A long pause refills only up to the burst.
        let later = t0 + Duration::from_secs(60);
        assert_eq!((0..10).filter(|_| b.try_take_at(later)).count(), 3);
    }
}
