//! Consumer runners: receive from a broker, apply through an [`Inbox`](crate::Inbox), and
//! acknowledge only after the inbox transaction committed.

use std::sync::atomic::AtomicU64;

#[cfg(feature = "nats")]
pub mod nats;
#[cfg(feature = "webhook")]
pub mod webhook;

/// Counters of a consumer runner.
#[derive(Debug, Default)]
pub struct ConsumerMetrics {
    /// Messages applied (first delivery).
    pub applied: AtomicU64,
    /// Copies recognised by the inbox and acknowledged without running the handler.
    pub duplicates: AtomicU64,
    /// Handler or inbox failures (message negatively acknowledged).
    pub failures: AtomicU64,
    /// Messages without a readable message id, terminated and logged.
    pub malformed: AtomicU64,
}
