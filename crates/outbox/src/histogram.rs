//! Fixed-bucket histograms kept with atomics, read while the relay or a consumer runs: the
//! distributions behind `outbox_relay_publish_duration_seconds`, `…_enqueue_to_ack_seconds`,
//! `outbox_relay_publish_batch_messages` and `outbox_consumer_handler_duration_seconds`
//! (docs/operations.md). The bounds are fixed per unit ([`Seconds`], [`Messages`]), as
//! Prometheus classic histograms need, so recording is two relaxed atomic additions and no lock.

use std::marker::PhantomData;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// The upper bounds of a histogram's buckets, ascending; an implicit last bucket (`+Inf`) takes
/// what is above the last bound.
pub trait Bounds: Send + Sync + 'static {
    /// Upper bounds, ascending, inclusive (a value equal to a bound falls in its bucket, as in
    /// Prometheus' `le`).
    const BOUNDS: &'static [f64];
}

/// Durations in seconds: 0.5 ms to 60 s in 1-2.5-5 steps (16 bounds). Sub-millisecond first
/// buckets because a healthy relay acknowledges in about a millisecond.
#[derive(Debug)]
pub struct Seconds;

impl Bounds for Seconds {
    const BOUNDS: &'static [f64] = &[
        0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
        60.0,
    ];
}

/// Message counts (batch sizes): 1 to 5,000 in 1-2.5-5 steps (12 bounds).
#[derive(Debug)]
pub struct Messages;

impl Bounds for Messages {
    const BOUNDS: &'static [f64] = &[
        1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 2500.0, 5000.0,
    ];
}

/// A histogram over the bounds `B`: one counter per bucket and the sum of what was observed.
/// `Default` is empty.
pub struct Histogram<B: Bounds = Seconds> {
    /// One per bound, then `+Inf`; not cumulative.
    counts: Box<[AtomicU64]>,
    /// The sum of observations, as `f64` bits.
    sum: AtomicU64,
    bounds: PhantomData<B>,
}

impl<B: Bounds> Default for Histogram<B> {
    fn default() -> Self {
        Histogram {
            counts: (0..=B::BOUNDS.len()).map(|_| AtomicU64::new(0)).collect(),
            sum: AtomicU64::new(0f64.to_bits()),
            bounds: PhantomData,
        }
    }
}

impl<B: Bounds> std::fmt::Debug for Histogram<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = self.snapshot();
        f.debug_struct("Histogram")
            .field("count", &s.count)
            .field("sum", &s.sum)
            .finish()
    }
}

impl<B: Bounds> Histogram<B> {
    /// Record one value (in the unit of `B`). A NaN or negative value counts as 0.
    pub fn observe(&self, value: f64) {
        let v = if value.is_nan() || value < 0.0 {
            0.0
        } else {
            value
        };
        let i = B::BOUNDS.partition_point(|b| *b < v);
        self.counts[i].fetch_add(1, Ordering::Relaxed);
        let _ = self
            .sum
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |bits| {
                Some((f64::from_bits(bits) + v).to_bits())
            });
    }

    /// What was recorded so far. Read while others record, the count and the sum may be one
    /// observation apart.
    pub fn snapshot(&self) -> HistogramSnapshot {
        let buckets: Vec<(f64, u64)> = B::BOUNDS
            .iter()
            .copied()
            .chain(std::iter::once(f64::INFINITY))
            .zip(self.counts.iter().map(|c| c.load(Ordering::Relaxed)))
            .collect();
        HistogramSnapshot {
            count: buckets.iter().map(|(_, n)| n).sum(),
            sum: f64::from_bits(self.sum.load(Ordering::Relaxed)),
            buckets,
        }
    }
}

impl Histogram<Seconds> {
    /// Record a duration, in seconds.
    pub fn observe_duration(&self, d: Duration) {
        self.observe(d.as_secs_f64());
    }
}

/// A point-in-time copy of a [`Histogram`].
#[derive(Debug, Clone, PartialEq)]
pub struct HistogramSnapshot {
    /// Observations recorded.
    pub count: u64,
    /// Their sum, in the histogram's unit.
    pub sum: f64,
    /// `(upper bound, observations in this bucket)`, ascending, the last bound `f64::INFINITY`;
    /// not cumulative (Prometheus' `le` buckets are the running sums).
    pub buckets: Vec<(f64, u64)>,
}

impl HistogramSnapshot {
    /// The value under which a fraction `q` (0–1) of the observations fall, as Prometheus'
    /// `histogram_quantile` estimates it (linear within the bucket; the last finite bound when
    /// it falls in `+Inf`). `None` when nothing was recorded.
    pub fn quantile(&self, q: f64) -> Option<f64> {
        if self.count == 0 {
            return None;
        }
        let rank = q.clamp(0.0, 1.0) * self.count as f64;
        let mut below = 0u64;
        let mut lower = 0.0;
        for &(upper, n) in &self.buckets {
            if n > 0 && (below + n) as f64 >= rank {
                if upper.is_infinite() {
                    return Some(lower);
                }
                let within = (rank - below as f64) / n as f64;
                return Some(lower + (upper - lower) * within);
            }
            below += n;
            if upper.is_finite() {
                lower = upper;
            }
        }
        Some(lower)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_fall_in_the_bucket_of_their_upper_bound() {
        let h = Histogram::<Messages>::default();
        for v in [1.0, 1.0, 2.0, 2.5, 3.0, 6000.0, -4.0, f64::NAN] {
            h.observe(v);
        }
        let s = h.snapshot();
        assert_eq!(s.count, 8);
        assert_eq!(s.sum, 1.0 + 1.0 + 2.0 + 2.5 + 3.0 + 6000.0);
        let n = |bound: f64| s.buckets.iter().find(|(b, _)| *b == bound).unwrap().1;
        assert_eq!(n(1.0), 4, "1, 1 and the two clamped to 0");
        assert_eq!(n(2.5), 2);
        assert_eq!(n(5.0), 1);
        assert_eq!(n(f64::INFINITY), 1);
        assert_eq!(s.buckets.len(), Messages::BOUNDS.len() + 1);
    }

    #[test]
    fn quantiles_interpolate_within_a_bucket() {
        let h = Histogram::<Seconds>::default();
        assert_eq!(h.snapshot().quantile(0.5), None);
        for _ in 0..100 {
            h.observe_duration(Duration::from_micros(700));
        }
        // All 100 in (0.5 ms, 1 ms]: the median is halfway through that bucket.
        let q = h.snapshot().quantile(0.5).unwrap();
        assert!((q - 0.00075).abs() < 1e-9, "{q}");
        h.observe(1000.0);
        assert_eq!(h.snapshot().quantile(1.0), Some(60.0));
    }
}
