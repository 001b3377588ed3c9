//! Throughput and latency over the last hour, for the dashboard's charts: a [`Series`] samples a
//! relay's [`RelayMetrics`] at a fixed interval and keeps one hour of points in memory. Each point
//! holds the interval's deltas: messages published (acknowledged by the broker), retried and
//! dead-lettered, and the commit → ack latency quantiles of the messages acknowledged in it
//! (from [`RelayMetrics::enqueue_to_ack`], the same histogram `/metrics` exports).
//!
//! The series belongs to the process that runs the relay (the daemon); `outbox admin`, which runs
//! none, serves no series (`GET /api/series` answers 404 and the dashboard says why).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

use crate::histogram::HistogramSnapshot;
use crate::relay::RelayMetrics;

/// How long a [`Series`] keeps points.
pub const SERIES_SPAN: Duration = Duration::from_secs(3600);

/// One interval's figures.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Point {
    /// The end of the interval (the sample's time, UTC).
    pub at: DateTime<Utc>,
    /// The interval's length in seconds (the sampling interval, or less for the first point).
    pub seconds: f64,
    /// Messages the broker acknowledged.
    pub published: u64,
    /// Messages rescheduled after a retryable error.
    pub retried: u64,
    /// Messages dead-lettered.
    pub dead_lettered: u64,
    /// Commit → ack, median, in seconds; `None` when nothing was acknowledged.
    pub latency_p50: Option<f64>,
    /// Commit → ack, 99th percentile, in seconds.
    pub latency_p99: Option<f64>,
}

/// The last hour of [`Point`]s of one relay. Cheap to share (`Arc`).
#[derive(Debug)]
pub struct Series {
    interval: Duration,
    points: Mutex<VecDeque<Point>>,
}

impl Series {
    /// An empty series sampled every `interval` (at least 1 s; the dashboard uses 10 s).
    pub fn new(interval: Duration) -> Arc<Self> {
        Arc::new(Series {
            interval: interval.max(Duration::from_secs(1)),
            points: Mutex::new(VecDeque::new()),
        })
    }

    /// The sampling interval.
    pub fn interval(&self) -> Duration {
        self.interval
    }

    /// The points, oldest first.
    pub fn points(&self) -> Vec<Point> {
        self.points
            .lock()
            .expect("series lock")
            .iter()
            .cloned()
            .collect()
    }

    /// Sample `metrics` every interval until `cancel`, on a new task.
    pub fn spawn_sampler(
        self: &Arc<Self>,
        metrics: Arc<RelayMetrics>,
        cancel: CancellationToken,
    ) -> tokio::task::JoinHandle<()> {
        let series = self.clone();
        tokio::spawn(async move {
            let mut last = Sample::of(&metrics);
            let mut tick = tokio::time::interval(series.interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            tick.tick().await;
            loop {
                tokio::select! {
                    _ = cancel.cancelled() => return,
                    _ = tick.tick() => {}
                }
                let now = Sample::of(&metrics);
                series.push(now.since(&last));
                last = now;
            }
        })
    }

    /// Add a point and drop those older than [`SERIES_SPAN`].
    pub fn push(&self, p: Point) {
        let mut points = self.points.lock().expect("series lock");
        let horizon = p.at - chrono::Duration::from_std(SERIES_SPAN).unwrap_or_default();
        points.push_back(p);
        while points.front().is_some_and(|f| f.at < horizon) {
            points.pop_front();
        }
    }
}

/// The counters a point is the difference of.
struct Sample {
    at: DateTime<Utc>,
    clock: tokio::time::Instant,
    published: u64,
    retried: u64,
    failed: u64,
    latency: HistogramSnapshot,
}

impl Sample {
    fn of(m: &RelayMetrics) -> Self {
        let s = m.snapshot();
        Sample {
            at: Utc::now(),
            clock: tokio::time::Instant::now(),
            published: s.sent,
            retried: s.retried,
            failed: s.failed,
            latency: m.enqueue_to_ack.snapshot(),
        }
    }

    /// The point from `before` to this sample.
    fn since(&self, before: &Sample) -> Point {
        let buckets = self
            .latency
            .buckets
            .iter()
            .zip(&before.latency.buckets)
            .map(|(&(bound, n), &(_, m))| (bound, n.saturating_sub(m)))
            .collect();
        let delta = HistogramSnapshot {
            count: self.latency.count.saturating_sub(before.latency.count),
            sum: self.latency.sum - before.latency.sum,
            buckets,
        };
        Point {
            at: self.at,
            seconds: (self.clock - before.clock).as_secs_f64(),
            published: self.published.saturating_sub(before.published),
            retried: self.retried.saturating_sub(before.retried),
            dead_lettered: self.failed.saturating_sub(before.failed),
            latency_p50: delta.quantile(0.5),
            latency_p99: delta.quantile(0.99),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering;

    #[test]
    fn a_point_holds_the_interval_s_deltas_and_quantiles() {
        let m = RelayMetrics::default();
        m.sent.store(10, Ordering::Relaxed);
        m.enqueue_to_ack.observe(0.5);
        let before = Sample::of(&m);
        m.sent.store(25, Ordering::Relaxed);
        m.failed.store(2, Ordering::Relaxed);
        for _ in 0..100 {
            m.enqueue_to_ack.observe(0.002);
        }
        let p = Sample::of(&m).since(&before);
        assert_eq!((p.published, p.dead_lettered, p.retried), (15, 2, 0));
        let p50 = p.latency_p50.unwrap();
        assert!(
            p50 > 0.0 && p50 <= 0.0025,
            "the earlier 0.5 s is not in this interval: {p50}"
        );
        let quiet = Sample::of(&m).since(&Sample::of(&m));
        assert_eq!((quiet.published, quiet.latency_p50), (0, None));
    }

    #[test]
    fn points_older_than_an_hour_are_dropped() {
        let s = Series::new(Duration::from_secs(10));
        let t0 = Utc::now();
        for minutes in [0, 30, 61, 62] {
            s.push(Point {
                at: t0 + chrono::Duration::minutes(minutes),
                seconds: 10.0,
                published: 1,
                retried: 0,
                dead_lettered: 0,
                latency_p50: None,
                latency_p99: None,
            });
        }
        let at: Vec<_> = s.points().iter().map(|p| p.at).collect();
        assert_eq!(
            at.len(),
            3,
            "the point of minute 0 is more than an hour before minute 62"
        );
        assert_eq!(at[0], t0 + chrono::Duration::minutes(30));
    }
}
