//! The types of the bucket-lease protocol (see the [`store`](super) module docs): buckets and
//! their leases, membership rounds, the rows read from owned buckets and their fenced
//! completions, and the route sets relays advertise.

use std::time::Duration;

use super::{LeaseToken, Outcome};
use crate::message::Message;

/// Buckets per outbox table: a constant of the schema (migration v4). Every row's `bucket`
/// column is a stored generated column, a hash of its partition key (of its message id when it
/// has none) modulo this number, so plain-SQL producers get it for free and every message of one
/// key lands in one bucket.
pub const BUCKETS: u16 = 64;

/// A bucket number, `0..BUCKETS`.
pub type Bucket = i16;

/// A bucket lease acquired in a [`Store::membership`](super::Store::membership) round.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BucketLease {
    /// The bucket.
    pub bucket: Bucket,
    /// The fencing token stamped on the bucket row; every completion for the bucket's rows must
    /// carry it.
    pub token: LeaseToken,
    /// The bucket had an owner whose lease expired (a relay died or stalled): rows of it may
    /// have been in flight. The relay counts an attempt for the first batch it reads from such
    /// a bucket before publishing, so a message that kills every relay still reaches its last
    /// attempt and is dead-lettered.
    pub takeover: bool,
}

/// One membership round of a relay ([`Store::membership`](super::Store::membership)).
#[derive(Debug, Clone)]
pub struct MembershipRequest {
    /// The relay's name (its row in `<table>_relays` and the `owner` of its buckets).
    pub relay: String,
    /// Bucket lease length and liveness window: a relay whose heartbeat is older than this is
    /// not counted, and a bucket whose lease is older may be taken over.
    pub lease: Duration,
    /// The buckets the relay believes it holds, with their tokens; they are renewed.
    pub held: Vec<(Bucket, LeaseToken)>,
    /// Acquire free or expired buckets up to the fair share (`ceil(BUCKETS / live relays)`),
    /// and the buckets another relay handed over to this one
    /// ([`Store::hand_off_buckets`](super::Store::hand_off_buckets)).
    /// False while shutting down.
    pub acquire: bool,
    /// The topic patterns this relay routes ([`TopicPattern`](crate::TopicPattern) syntax:
    /// `*`, `prefix*` or an exact topic), sorted and deduplicated
    /// ([`normalise_routes`]). Stored with the heartbeat (columns `routes`, a JSON array, and
    /// `routes_hash`, migration v6) so the other relays know which topics this one can publish
    /// ([`Store::relays`](super::Store::relays)).
    pub routes: Vec<String>,
}

/// What a membership round found and did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MembershipRound {
    /// Relays with a heartbeat within one lease, this one included.
    pub live_relays: u32,
    /// `ceil(BUCKETS / live_relays)`: how many buckets this relay should hold.
    pub fair_share: u32,
    /// Held buckets whose lease was renewed. A held bucket missing here was lost (another relay
    /// took it over after this relay's lease expired): the relay must stop using it at once.
    pub renewed: Vec<Bucket>,
    /// Buckets newly acquired in this round (handed-over ones included).
    pub acquired: Vec<BucketLease>,
    /// The buckets of `acquired` that another relay handed over to this one because it could
    /// not route some of their messages
    /// ([`Store::hand_off_buckets`](super::Store::hand_off_buckets)); acquired even above the
    /// fair share.
    pub handed_over: Vec<Bucket>,
}

/// A live relay as its membership row shows it ([`Store::relays`](super::Store::relays)).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RelayInfo {
    /// The relay's name.
    pub name: String,
    /// The topic patterns it routes ([`MembershipRequest::routes`]); `None` when its row has
    /// none (a relay of a version before migration v6) or an unreadable one: such a relay is
    /// not counted as routing anything.
    pub routes: Option<Vec<String>>,
    /// A hash of its route set (16 hex digits, [`routes_hash`]); equal hashes, equal sets.
    pub routes_hash: Option<String>,
}

/// Route patterns as advertised: sorted, without duplicates.
pub fn normalise_routes<S: AsRef<str>>(patterns: &[S]) -> Vec<String> {
    let set: std::collections::BTreeSet<String> =
        patterns.iter().map(|p| p.as_ref().to_owned()).collect();
    set.into_iter().collect()
}

/// The stable hash of a normalised route set: FNV-1a 64 of its JSON array, 16 hex digits.
pub fn routes_hash(routes: &[String]) -> String {
    let json = routes_json(routes);
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in json.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("{h:016x}")
}

/// The route set as stored: a JSON array of strings.
pub(crate) fn routes_json(routes: &[String]) -> String {
    serde_json::to_string(routes).expect("strings serialize")
}

/// A membership row's route set, `None` when absent or not a JSON array of strings.
pub(crate) fn relay_info(
    name: String,
    routes: Option<String>,
    routes_hash: Option<String>,
) -> RelayInfo {
    RelayInfo {
        name,
        routes: routes.and_then(|r| serde_json::from_str::<Vec<String>>(&r).ok()),
        routes_hash,
    }
}

/// A PENDING row read from an owned bucket ([`Store::read_buckets`](super::Store::read_buckets)).
#[derive(Debug, Clone)]
pub struct BucketRow {
    /// The row's bucket.
    pub bucket: Bucket,
    /// The message; `attempts` counts the attempts made so far (not this one).
    pub message: Message,
    /// How long the row had been due when it was read, by the database clock: the read's
    /// `now()` minus the later of its creation and its `available_at` (a delay or a retry
    /// backoff), 0 at the least. `None` when the timestamps could not be read (a row written by
    /// plain SQL with garbage in them). The relay's `outbox_relay_enqueue_to_ack_seconds`
    /// histogram adds the time from the read to the broker's ack.
    pub due_age: Option<Duration>,
}

/// The due rows of some buckets, read without writing anything.
#[derive(Debug, Clone, Default)]
pub struct BucketBatch {
    /// Decoded rows, in id order within each bucket.
    pub rows: Vec<BucketRow>,
    /// Rows that could not be decoded: bucket, id and the reason (dead-lettered by the relay).
    pub malformed: Vec<(Bucket, i64, String)>,
}

/// Where a partition key stands ([`Store::key_heads`](super::Store::key_heads)), for per-key
/// order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyHead {
    /// The partition key.
    pub key: String,
    /// Smallest id of the key's rows still to publish (PENDING, due or not).
    pub first_open: Option<i64>,
    /// Smallest id of the key's dead-lettered (FAILED) rows.
    pub first_failed: Option<i64>,
}

/// One row's outcome for [`Store::complete_in_buckets`](super::Store::complete_in_buckets),
/// fenced by its bucket's lease.
#[derive(Debug, Clone, PartialEq)]
pub struct BucketCompletion {
    /// Row id.
    pub id: i64,
    /// The row's bucket (as read): the lease checked is this bucket's.
    pub bucket: Bucket,
    /// The token of the row's bucket lease, as acquired.
    pub token: LeaseToken,
    /// The `attempts` value to store: attempts made, this one included when it was attempted.
    pub attempts: u32,
    /// What to record. [`Outcome::Release`](super::Outcome::Release) keeps the row PENDING with
    /// `available_at = now() + delay` (and `attempts` as given: the takeover batch records its
    /// attempt this way before publishing).
    pub outcome: Outcome,
}
