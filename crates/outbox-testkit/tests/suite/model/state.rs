//! The model: rows, buckets and what each relay believes.

use std::collections::{BTreeMap, BTreeSet};

use outbox::Status;
use outbox::store::{BUCKETS, Bucket, BucketCompletion, LeaseToken, Outcome};
use uuid::Uuid;

#[derive(Debug, Clone, PartialEq)]
pub(super) struct Row {
    pub(super) status: Status,
    pub(super) attempts: u32,
    pub(super) due: bool,
    pub(super) bucket: Bucket,
    pub(super) message_id: Uuid,
    pub(super) key: Option<usize>,
    /// `Some(expired)` while SENT awaiting a confirmation.
    pub(super) confirm: Option<bool>,
    pub(super) check_backs: u32,
    /// The clock epoch (count of [`Op::Advance`]) at which `sent_at` / `confirmed_at` was set.
    pub(super) sent_at: Option<u32>,
    pub(super) confirmed_at: Option<u32>,
}

/// A bucket as the database holds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(super) struct BucketState {
    pub(super) owner: Option<usize>,
    pub(super) token: Option<LeaseToken>,
    pub(super) expired: bool,
}

/// One message of a batch read by a relay (relay.rs `Work`).
#[derive(Debug, Clone)]
pub(super) struct Work {
    pub(super) id: i64,
    pub(super) bucket: Bucket,
    pub(super) token: LeaseToken,
    pub(super) stored_attempts: u32,
    pub(super) counted: bool,
}

/// What a relay believes (relay.rs `Ownership`), and its batches read but not completed.
#[derive(Debug, Default)]
pub(super) struct Relay {
    pub(super) held: BTreeMap<Bucket, LeaseToken>,
    pub(super) suspect: BTreeSet<Bucket>,
    pub(super) batches: Vec<Vec<Work>>,
    /// Its heartbeat is within the liveness window.
    pub(super) live: bool,
}

impl Relay {
    pub(super) fn in_flight(&self) -> BTreeSet<Bucket> {
        self.batches.iter().flatten().map(|w| w.bucket).collect()
    }
}

pub(super) struct Model {
    pub(super) rows: BTreeMap<i64, Row>,
    pub(super) buckets: BTreeMap<Bucket, BucketState>,
    pub(super) relays: [Relay; 2],
    /// Clock advances so far.
    pub(super) epoch: u32,
}

impl Model {
    pub(super) fn new() -> Model {
        Model {
            rows: BTreeMap::new(),
            buckets: (0..BUCKETS as Bucket)
                .map(|b| (b, BucketState::default()))
                .collect(),
            relays: Default::default(),
            epoch: 0,
        }
    }

    /// Whether a completion by `relay` under `token` for `bucket` passes the fence.
    pub(super) fn fenced_ok(&self, relay: usize, bucket: Bucket, token: LeaseToken) -> bool {
        let b = self.buckets[&bucket];
        b.owner == Some(relay) && b.token == Some(token) && !b.expired
    }

    /// Apply one completion to the model; whether it matches a row.
    pub(super) fn apply(&mut self, relay: usize, c: &BucketCompletion) -> bool {
        if !self.fenced_ok(relay, c.bucket, c.token) {
            return false;
        }
        let epoch = self.epoch;
        // Purged meanwhile (confirmed, then purged): nothing to update.
        let Some(r) = self.rows.get_mut(&c.id) else {
            return false;
        };
        let sent = matches!(
            c.outcome,
            Outcome::Sent | Outcome::SentAwaitingConfirmation { .. }
        );
        match r.status {
            // Confirmed or rejected meanwhile: matched, verdict kept.
            Status::Confirmed | Status::Rejected => {
                if sent {
                    r.sent_at = Some(epoch);
                }
                r.confirm = None;
                true
            }
            Status::Pending => {
                r.attempts = c.attempts;
                r.confirm = None;
                match &c.outcome {
                    Outcome::Sent => r.status = Status::Sent,
                    Outcome::SentAwaitingConfirmation { .. } => {
                        r.status = Status::Sent;
                        r.confirm = Some(false);
                    }
                    Outcome::Retry { delay, .. } | Outcome::Release { delay } => {
                        r.due = delay.is_zero();
                    }
                    Outcome::Failed { .. } => r.status = Status::Failed,
                }
                if sent {
                    r.sent_at = Some(epoch);
                }
                true
            }
            _ => false,
        }
    }

    /// Rows by position, for index picks.
    pub(super) fn pick(&self, i: usize) -> Option<i64> {
        if self.rows.is_empty() {
            return None;
        }
        self.rows.keys().nth(i % self.rows.len()).copied()
    }
}
