//! The relay's counters ([`RelayMetrics`]) and instrumentation hooks ([`RelayHooks`]).

use super::*;
use crate::histogram::{Histogram, Messages, Seconds};

/// Counters of one relay, readable while it runs ([`Relay::metrics`]).
#[derive(Debug, Default)]
pub struct RelayMetrics {
    /// Rows read from held buckets to publish.
    pub claimed: AtomicU64,
    /// Messages the broker acknowledged and recorded SENT.
    pub sent: AtomicU64,
    /// Messages rescheduled after a retryable error.
    pub retried: AtomicU64,
    /// Messages dead-lettered (FAILED).
    pub failed: AtomicU64,
    /// Messages released without counting the attempt (transport down, shutdown).
    pub released: AtomicU64,
    /// Completion rows refused because their bucket lease was lost (taken over).
    pub lost_leases: AtomicU64,
    /// Batches not published because a bucket lease was about to expire.
    pub stale_batches: AtomicU64,
    /// Unconfirmed SENT rows past their deadline sent back to PENDING (or FAILED `unconfirmed`).
    pub checked_back: AtomicU64,
    /// Two-phase messages committed by a check-back's COMMIT answer (PREPARED → PENDING).
    pub prepared_committed: AtomicU64,
    /// Two-phase messages rolled back by a check-back's ROLLBACK answer.
    pub prepared_rolled_back: AtomicU64,
    /// Check-backs answered UNKNOWN (counted toward `max_checks`).
    pub prepared_unknown: AtomicU64,
    /// Check-backs without an answer (error, garbled answer, timeout, unreachable; not counted
    /// toward `max_checks`).
    pub prepared_check_errors: AtomicU64,
    /// Two-phase messages parked as UNDECIDED (budget spent, deadline passed, or a malformed
    /// row).
    pub prepared_undecided: AtomicU64,
    /// Finished rows deleted by retention.
    pub purged: AtomicU64,
    /// Finished rows moved to `<table>_archive` by retention.
    pub archived: AtomicU64,
    /// Failed database calls (read, completion, membership, maintenance), all retried, by
    /// [`StoreErrorKind`], indexed by [`StoreErrorKind::index`]; their sum is
    /// [`MetricsSnapshot::store_errors`].
    pub store_errors_by_kind: [AtomicU64; StoreErrorKind::ALL.len()],
    /// Times a transport was found unavailable.
    pub outages: AtomicU64,
    /// Publishes a destination refused for now ([`crate::TransportError::destination_busy`]:
    /// a RabbitMQ nack, an HTTP 429); each message was released without counting the
    /// attempt.
    pub busy: AtomicU64,
    /// Messages of ordered routes held back because an earlier message of their key is unfinished.
    pub held_back: AtomicU64,
    /// Buckets acquired (free or taken over).
    pub buckets_acquired: AtomicU64,
    /// Buckets taken over from a relay whose lease had expired.
    pub takeovers: AtomicU64,
    /// Held buckets found taken over by another relay at renewal.
    pub buckets_lost: AtomicU64,
    /// Buckets given back (above the fair share, or on shutdown).
    pub buckets_released: AtomicU64,
    /// Completion statements executed (each writes the rows of one batch once).
    pub completion_writes: AtomicU64,
    /// Panics contained: a transport's publish (of a batch or of one message), or a whole batch
    /// task. Each is logged at error level.
    pub panics: AtomicU64,
    /// Publishes cut short by `publish_timeout` (each logged with its counts).
    pub publish_timeouts: AtomicU64,
    /// Times a batch was found in flight past `lease - publish_timeout`: the relay stops renewing
    /// its buckets until it returns and logs an error every lease meanwhile.
    pub stalled_batches: AtomicU64,
    /// Seconds one transport's share of a batch took to publish: from handing it to the
    /// transport to its last acknowledgement (or `publish_timeout`).
    pub publish_duration: Histogram<Seconds>,
    /// Messages per publish (one transport's share of a batch).
    pub publish_batch: Histogram<Messages>,
    /// Seconds from a message becoming due to the broker's acknowledgement, for messages
    /// acknowledged on their first attempt: the row's due age when read (database clock:
    /// [`BucketRow::due_age`](crate::store::BucketRow::due_age), from its creation in the
    /// producer's transaction, or the end of its delay) plus the time from the read to the ack
    /// (the relay's monotonic clock). What `outbox bench` reports as commit → ack, except that
    /// it starts at the row's creation: a producer's long transaction adds to it.
    pub enqueue_to_ack: Histogram<Seconds>,
}

/// A point-in-time copy of [`RelayMetrics`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MetricsSnapshot {
    /// See [`RelayMetrics::claimed`].
    pub claimed: u64,
    /// See [`RelayMetrics::sent`].
    pub sent: u64,
    /// See [`RelayMetrics::retried`].
    pub retried: u64,
    /// See [`RelayMetrics::failed`].
    pub failed: u64,
    /// See [`RelayMetrics::released`].
    pub released: u64,
    /// See [`RelayMetrics::lost_leases`].
    pub lost_leases: u64,
    /// See [`RelayMetrics::stale_batches`].
    pub stale_batches: u64,
    /// See [`RelayMetrics::checked_back`].
    pub checked_back: u64,
    /// See [`RelayMetrics::prepared_committed`].
    pub prepared_committed: u64,
    /// See [`RelayMetrics::prepared_rolled_back`].
    pub prepared_rolled_back: u64,
    /// See [`RelayMetrics::prepared_unknown`].
    pub prepared_unknown: u64,
    /// See [`RelayMetrics::prepared_check_errors`].
    pub prepared_check_errors: u64,
    /// See [`RelayMetrics::prepared_undecided`].
    pub prepared_undecided: u64,
    /// See [`RelayMetrics::purged`].
    pub purged: u64,
    /// See [`RelayMetrics::archived`].
    pub archived: u64,
    /// Failed database calls, all kinds ([`RelayMetrics::store_errors_by_kind`] summed).
    pub store_errors: u64,
    /// See [`RelayMetrics::outages`].
    pub outages: u64,
    /// See [`RelayMetrics::busy`].
    pub busy: u64,
    /// See [`RelayMetrics::held_back`].
    pub held_back: u64,
    /// See [`RelayMetrics::buckets_acquired`].
    pub buckets_acquired: u64,
    /// See [`RelayMetrics::takeovers`].
    pub takeovers: u64,
    /// See [`RelayMetrics::buckets_lost`].
    pub buckets_lost: u64,
    /// See [`RelayMetrics::buckets_released`].
    pub buckets_released: u64,
    /// See [`RelayMetrics::completion_writes`].
    pub completion_writes: u64,
    /// See [`RelayMetrics::panics`].
    pub panics: u64,
    /// See [`RelayMetrics::publish_timeouts`].
    pub publish_timeouts: u64,
    /// See [`RelayMetrics::stalled_batches`].
    pub stalled_batches: u64,
}

impl RelayMetrics {
    /// Count a failed database call under its kind.
    pub fn store_error(&self, e: &StoreError) {
        add(&self.store_errors_by_kind[e.kind().index()], 1);
    }

    /// [`RelayMetrics::store_errors_by_kind`] with each kind.
    pub fn store_errors_by_kind(&self) -> Vec<(StoreErrorKind, u64)> {
        StoreErrorKind::ALL
            .iter()
            .map(|k| {
                (
                    *k,
                    self.store_errors_by_kind[k.index()].load(Ordering::Relaxed),
                )
            })
            .collect()
    }

    /// Read every counter.
    pub fn snapshot(&self) -> MetricsSnapshot {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        MetricsSnapshot {
            claimed: g(&self.claimed),
            sent: g(&self.sent),
            retried: g(&self.retried),
            failed: g(&self.failed),
            released: g(&self.released),
            lost_leases: g(&self.lost_leases),
            stale_batches: g(&self.stale_batches),
            checked_back: g(&self.checked_back),
            prepared_committed: g(&self.prepared_committed),
            prepared_rolled_back: g(&self.prepared_rolled_back),
            prepared_unknown: g(&self.prepared_unknown),
            prepared_check_errors: g(&self.prepared_check_errors),
            prepared_undecided: g(&self.prepared_undecided),
            purged: g(&self.purged),
            archived: g(&self.archived),
            store_errors: self.store_errors_by_kind.iter().map(g).sum(),
            outages: g(&self.outages),
            busy: g(&self.busy),
            held_back: g(&self.held_back),
            buckets_acquired: g(&self.buckets_acquired),
            takeovers: g(&self.takeovers),
            buckets_lost: g(&self.buckets_lost),
            buckets_released: g(&self.buckets_released),
            completion_writes: g(&self.completion_writes),
            panics: g(&self.panics),
            publish_timeouts: g(&self.publish_timeouts),
            stalled_batches: g(&self.stalled_batches),
        }
    }
}

pub(super) fn add(a: &AtomicU64, n: u64) {
    a.fetch_add(n, Ordering::Relaxed);
}

/// Test and instrumentation hooks, called at fixed points of the relay loop.
#[async_trait]
pub trait RelayHooks: Send + Sync + 'static {
    /// After a batch was read (and, after a takeover, its attempt recorded) and before anything
    /// is published; the stale-lease check runs after this hook (shared case C15 pauses here).
    /// `messages`: the rows of the batch still to publish (not those already dead-lettered).
    async fn before_publish(&self, messages: &[Message]) {
        let _ = messages;
    }

    /// After publishing and before the completion statement (a test pauses here to let the
    /// bucket lease expire and another relay take the bucket over).
    async fn before_complete(&self, messages: &[Message]) {
        let _ = messages;
    }
}
