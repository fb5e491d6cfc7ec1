//! The durable retry schedule: exponential backoff with full jitter.
//!
//! Source: AWS Architecture Blog, "Exponential Backoff and Jitter" (Marc Brooker, 2015):
//! `sleep = random_between(0, min(cap, base · 2^attempt))` ("full jitter"). A provider's
//! `Retry-After` (RFC 9110 §10.2.3) is a floor: idem never retries sooner than it says.
//! The result is stored as `next_attempt_at`, so the schedule survives restarts.

/// Retry policy of an action or connector.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Backoff base (ms).
    pub base_ms: i64,
    /// Backoff cap (ms).
    pub cap_ms: i64,
    /// Attempts after which a retryable failure becomes final (FAILED).
    pub max_attempts: i64,
    /// Time since the operation was created after which no further attempt is scheduled
    /// (ms); `None` = no limit.
    pub max_elapsed_ms: Option<i64>,
}

impl Default for RetryPolicy {
    /// base 1 000 ms, cap 60 000 ms, 8 attempts, no elapsed-time limit.
    fn default() -> Self {
        RetryPolicy { base_ms: 1_000, cap_ms: 60_000, max_attempts: 8, max_elapsed_ms: None }
    }
}

impl RetryPolicy {
    /// Wait before the attempt after attempt number `attempt` (1-based) failed, in ms.
    ///
    /// `jitter` is uniform in `[0, 1)`; `retry_after_ms` is the provider's floor, if any.
    pub fn delay_ms(&self, attempt: i64, jitter: f64, retry_after_ms: Option<i64>) -> i64 {
        let exp = (attempt - 1).clamp(0, 62) as u32;
        let ceiling = self.base_ms.saturating_mul(1i64.checked_shl(exp).unwrap_or(i64::MAX)).min(self.cap_ms);
        let jittered = (ceiling as f64 * jitter.clamp(0.0, 1.0)) as i64;
        jittered.max(retry_after_ms.unwrap_or(0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_jitter_stays_under_the_capped_exponential() {
        let p = RetryPolicy::default();
        assert_eq!(p.delay_ms(1, 0.999_999, None), 999);
        assert_eq!(p.delay_ms(3, 0.5, None), 2_000);
        assert_eq!(p.delay_ms(40, 0.5, None), 30_000);
        assert_eq!(p.delay_ms(200, 0.0, None), 0);
    }

    #[test]
    fn retry_after_is_a_floor() {
        let p = RetryPolicy::default();
        assert_eq!(p.delay_ms(1, 0.1, Some(5_000)), 5_000);
        assert_eq!(p.delay_ms(10, 0.9, Some(5)), 54_000);
    }
}
