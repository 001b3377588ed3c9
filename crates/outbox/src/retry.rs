//! Retry policy: exponential backoff with jitter and a cap (docs/design/DESIGN.md §8).

use std::time::Duration;

use rand::Rng;

/// Exponential backoff: attempt `n` (1-based) waits `base * factor^(n-1)`, capped at `max`, then
/// reduced by a random share of up to `jitter` so that retries of many messages spread out.
///
/// Defaults: `base` 1 s, `factor` 2, `max` 5 min, `jitter` 0.2, which gives about 1, 2, 4, 8 s ...
/// as in shared case C05. The delay is added to the database clock (`now()`), never the host's.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Backoff {
    /// Delay after the first failed attempt. Default 1 s.
    pub base: Duration,
    /// Growth per attempt, at least 1.0. Default 2.0.
    pub factor: f64,
    /// Largest delay. Default 300 s.
    pub max: Duration,
    /// Share of the delay, 0.0 to 1.0, that is randomly taken off. Default 0.2.
    pub jitter: f64,
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff {
            base: Duration::from_secs(1),
            factor: 2.0,
            max: Duration::from_secs(300),
            jitter: 0.2,
        }
    }
}

impl Backoff {
    /// The delay before the next try after `attempt` failed attempts (attempt 1 is the first).
    pub fn delay(&self, attempt: u32) -> Duration {
        self.delay_with(attempt, rand::rng().random::<f64>())
    }

    /// As [`Backoff::delay`] with the random draw `r` in `[0, 1)` given, for tests.
    pub fn delay_with(&self, attempt: u32, r: f64) -> Duration {
        let exp = attempt.saturating_sub(1).min(64) as i32;
        let raw = self.base.as_secs_f64() * self.factor.max(1.0).powi(exp);
        let capped = raw.min(self.max.as_secs_f64());
        let jittered = capped * (1.0 - self.jitter.clamp(0.0, 1.0) * r.clamp(0.0, 1.0));
        Duration::from_secs_f64(jittered.max(0.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn follows_the_schedule_and_caps() {
        let b = Backoff::default();
        let secs: Vec<f64> = (1..=5)
            .map(|a| b.delay_with(a, 0.0).as_secs_f64())
            .collect();
        assert_eq!(secs, vec![1.0, 2.0, 4.0, 8.0, 16.0]);
        assert_eq!(b.delay_with(40, 0.0), Duration::from_secs(300));
        assert_eq!(b.delay_with(u32::MAX, 0.0), Duration::from_secs(300));
    }

    #[test]
    fn jitter_only_shortens_within_bounds() {
        let b = Backoff::default();
        for i in 0..100 {
            let r = i as f64 / 100.0;
            let d = b.delay_with(3, r).as_secs_f64();
            assert!((3.2..=4.0).contains(&d), "{d}");
        }
    }
}
