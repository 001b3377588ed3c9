//! The types of the bucket-lease protocol (see the [`store`](super) module docs): buckets and
//! their leases, membership rounds, the rows read from owned buckets and their fenced
//! completions, and the route sets relays advertise.

use std::time::Duration;

use super::{LeaseToken, Outcome, millis};
use crate::message::{Message, Status};

pub use crate::message::{BUCKETS, Bucket};

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

/// A hand-off of buckets from one relay to another
/// ([`Store::hand_off_buckets`](super::Store::hand_off_buckets)). Named fields, because the
/// two relays' names would otherwise be two `&str` arguments side by side.
#[derive(Debug, Clone, Copy)]
pub struct HandOff<'a> {
    /// The relay giving the buckets away (their `owner`).
    pub relay: &'a str,
    /// The buckets, each with the token of the relay's lease on it; a bucket whose owner or
    /// token no longer match is left as it is.
    pub buckets: &'a [(Bucket, LeaseToken)],
    /// The relay the buckets are reserved for.
    pub to: &'a str,
    /// How long the reservation lasts; after it anyone may acquire the buckets.
    pub lease: Duration,
}

/// A write to one row fenced by its bucket's lease: it applies only while `relay` owns
/// `bucket` with `token` under an unexpired lease
/// ([`TwoPhase::record_check`](crate::two_phase::TwoPhase::record_check)).
#[derive(Debug, Clone, Copy)]
pub struct FencedRow<'a> {
    /// The relay writing.
    pub relay: &'a str,
    /// The row's id.
    pub id: i64,
    /// The row's bucket.
    pub bucket: Bucket,
    /// The relay's lease token on the bucket.
    pub token: LeaseToken,
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

/// [`MembershipRound`] from the live count and the renewed buckets (fair share
/// `ceil(BUCKETS / live)`, at least one relay: this one).
pub(crate) fn membership_round(live: i64, renewed: Vec<Bucket>) -> MembershipRound {
    let live = u32::try_from(live.max(1)).unwrap_or(u32::MAX);
    MembershipRound {
        live_relays: live,
        fair_share: u32::from(BUCKETS).div_ceil(live),
        renewed,
        acquired: Vec::new(),
        handed_over: Vec::new(),
    }
}

impl MembershipRound {
    /// Record the buckets handed over to this relay and taken with `token`: acquired (not as
    /// takeovers), and listed, sorted, in [`MembershipRound::handed_over`].
    pub(crate) fn take_handed_over(&mut self, mut handed: Vec<Bucket>, token: LeaseToken) {
        handed.sort_unstable();
        self.acquire(token, handed.iter().map(|&bucket| (bucket, false)));
        self.handed_over = handed;
    }

    /// How many more buckets the relay may acquire: its fair share less the buckets renewed
    /// and handed over.
    pub(crate) fn need(&self) -> u32 {
        let held = self.renewed.len() + self.handed_over.len();
        self.fair_share
            .saturating_sub(u32::try_from(held).unwrap_or(u32::MAX))
    }

    /// Record buckets acquired with `token`, each with whether another relay held it (a
    /// takeover of an expired lease).
    pub(crate) fn acquire(
        &mut self,
        token: LeaseToken,
        buckets: impl IntoIterator<Item = (Bucket, bool)>,
    ) {
        self.acquired
            .extend(buckets.into_iter().map(|(bucket, takeover)| BucketLease {
                bucket,
                token,
                takeover,
            }));
    }
}

impl BucketBatch {
    /// Add one read row: decoded into [`BucketBatch::rows`] with its due age, or into
    /// [`BucketBatch::malformed`] with the reason it could not be decoded.
    pub(crate) fn push(
        &mut self,
        bucket: Bucket,
        id: i64,
        decoded: Result<Message, String>,
        due_age: Option<Duration>,
    ) {
        match decoded {
            Ok(message) => self.rows.push(BucketRow {
                bucket,
                message,
                due_age,
            }),
            Err(reason) => self.malformed.push((bucket, id, reason)),
        }
    }
}

/// [`BucketCompletion`]s as parallel arrays: ids, statuses, delays in ms, errors, attempts,
/// confirmation windows in ms and bucket tokens.
pub(crate) struct BucketColumns {
    pub ids: Vec<i64>,
    pub statuses: Vec<i16>,
    pub delays_ms: Vec<i64>,
    pub errors: Vec<Option<String>>,
    pub attempts: Vec<i32>,
    pub confirm_ms: Vec<Option<i64>>,
    pub tokens: Vec<LeaseToken>,
    pub buckets: Vec<Bucket>,
}

impl BucketColumns {
    pub(crate) fn from(completions: &[BucketCompletion]) -> Self {
        let mut c = BucketColumns {
            ids: Vec::with_capacity(completions.len()),
            statuses: Vec::with_capacity(completions.len()),
            delays_ms: Vec::with_capacity(completions.len()),
            errors: Vec::with_capacity(completions.len()),
            attempts: Vec::with_capacity(completions.len()),
            confirm_ms: Vec::with_capacity(completions.len()),
            tokens: Vec::with_capacity(completions.len()),
            buckets: Vec::with_capacity(completions.len()),
        };
        for comp in completions {
            let (status, delay, error, confirm) = outcome_columns(&comp.outcome);
            c.ids.push(comp.id);
            c.statuses.push(status.as_i16());
            c.delays_ms.push(delay);
            c.errors.push(error);
            c.attempts
                .push(i32::try_from(comp.attempts).unwrap_or(i32::MAX));
            c.confirm_ms.push(confirm);
            c.tokens.push(comp.token);
            c.buckets.push(comp.bucket);
        }
        c
    }
}

/// Rows per bucket one statement of a round-based [`Store::read_buckets`] asks for: four times
/// an even share of `limit` over `buckets` buckets, at least 32, at most `limit`.
#[cfg(any(feature = "mysql", feature = "sqlite"))]
pub(crate) fn per_bucket_limit(limit: u32, buckets: usize) -> u32 {
    let buckets = u32::try_from(buckets.max(1)).unwrap_or(u32::MAX);
    (limit / buckets).saturating_mul(4).max(32).min(limit)
}

/// One statement of a round-based [`Store::read_buckets`] ([`read_in_rounds`]): for each
/// `(bucket, after_id)` of `parts`, the first `per_bucket` due PENDING rows of the bucket with
/// `id > after_id` in id order (one index range scan per bucket) whose partition key is not in
/// `skip`, then the first `limit` of them all by id.
#[cfg(any(feature = "mysql", feature = "sqlite"))]
pub(crate) struct ReadRound {
    /// `(bucket, after_id)`: the buckets to read and the id each reads on from
    /// (`i64::MIN` in the first round).
    pub(crate) parts: Vec<(Bucket, i64)>,
    /// The partition keys to skip as a JSON array of strings; `None` when there are none.
    pub(crate) skip: Option<std::sync::Arc<str>>,
    /// Rows at most per bucket ([`per_bucket_limit`]).
    pub(crate) per_bucket: u32,
    /// Rows at most in all.
    pub(crate) limit: u32,
}

/// [`Store::read_buckets`] for dialects without `LATERAL` (MySQL/MariaDB, SQLite), in rounds of
/// one statement each: `fetch` reads a [`ReadRound`]; each row it returns has its id in
/// column 0 and its bucket in column 9 (`err` maps a column that does not read). A bucket that
/// filled its `per_bucket` rows may have more: while fewer than `limit` rows came,
/// the next round reads on from the last id of each such bucket. Every bucket's rows are
/// therefore a prefix of its due rows, in id order. The rows come back as the batch
/// ([`BucketBatch::push`]: a row that does not decode goes to its `malformed`).
#[cfg(any(feature = "mysql", feature = "sqlite"))]
pub(crate) async fn read_in_rounds<R, F, Fut>(
    buckets: &[Bucket],
    skip_keys: &[String],
    limit: u32,
    err: impl Fn(sqlx::Error) -> super::StoreError,
    mut fetch: F,
) -> Result<super::BucketBatch, super::StoreError>
where
    F: FnMut(ReadRound) -> Fut,
    Fut: std::future::Future<Output = Result<Vec<R>, super::StoreError>>,
    R: sqlx::Row,
    usize: sqlx::ColumnIndex<R>,
    for<'r> String: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> i64: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> i16: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> Vec<u8>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
{
    if buckets.is_empty() || limit == 0 {
        return Ok(super::BucketBatch::default());
    }
    let skip: Option<std::sync::Arc<str>> = (!skip_keys.is_empty()).then(|| {
        serde_json::to_string(skip_keys)
            .expect("keys serialize")
            .into()
    });
    let mut seen = std::collections::HashSet::new();
    let mut parts: Vec<(Bucket, i64)> = buckets
        .iter()
        .filter(|b| seen.insert(**b))
        .map(|b| (*b, i64::MIN))
        .collect();
    let mut out: Vec<(Bucket, i64, R)> = Vec::new();
    while !parts.is_empty() {
        let remaining = limit.saturating_sub(u32::try_from(out.len()).unwrap_or(u32::MAX));
        if remaining == 0 {
            break;
        }
        let k = per_bucket_limit(remaining, parts.len());
        let round = ReadRound {
            parts: parts.clone(),
            skip: skip.clone(),
            per_bucket: k,
            limit: remaining,
        };
        let rows = fetch(round)
            .await?
            .into_iter()
            .map(|row| {
                let id: i64 = row.try_get(0).map_err(&err)?;
                let bucket: Bucket = row.try_get(9).map_err(&err)?;
                Ok((bucket, id, row))
            })
            .collect::<Result<Vec<_>, super::StoreError>>()?;
        let full = u32::try_from(rows.len()).unwrap_or(u32::MAX) >= remaining;
        let mut last: std::collections::BTreeMap<Bucket, (u32, i64)> = Default::default();
        for (bucket, id, _) in &rows {
            let e = last.entry(*bucket).or_insert((0, i64::MIN));
            e.0 += 1;
            e.1 = e.1.max(*id);
        }
        out.extend(rows);
        if full {
            break;
        }
        parts = last
            .into_iter()
            .filter(|(_, (n, _))| *n >= k)
            .map(|(bucket, (_, id))| (bucket, id))
            .collect();
    }
    let mut batch = super::BucketBatch::default();
    for (bucket, id, row) in &out {
        batch.push(
            *bucket,
            *id,
            super::rows::decode_message(*id, row),
            super::rows::due_age(row),
        );
    }
    Ok(batch)
}

/// The status, delay (ms), error and confirmation window (ms) an outcome writes.
fn outcome_columns(outcome: &Outcome) -> (Status, i64, Option<String>, Option<i64>) {
    match outcome {
        Outcome::Sent => (Status::Sent, 0, None, None),
        Outcome::SentAwaitingConfirmation { within } => {
            (Status::Sent, 0, None, Some(millis(*within)))
        }
        Outcome::Retry { delay, error } => {
            (Status::Pending, millis(*delay), Some(error.clone()), None)
        }
        Outcome::Failed { reason } => (Status::Failed, 0, Some(reason.clone()), None),
        Outcome::Release { delay } => (Status::Pending, millis(*delay), None, None),
    }
}
