//! The store conformance suite: one async function per property, generic over
//! [`StoreFixture`](crate::StoreFixture), run against every dialect on the real database.
//!
//! Every property drives the protocol production runs: the bucket leases of the
//! [`Relay`](outbox::Relay). Store-level properties make the store calls the relay makes, in its
//! order and with its arguments ([`ProtocolRelay`]): a membership round (renew, acquire, give
//! back what is above the fair share), a read of the held buckets, a takeover batch recording
//! its attempt first, and one completion per batch fenced by the bucket tokens the rows were
//! read under. Properties about the relay's own decisions (dead letter at `max_attempts`, an
//! unreachable broker giving the attempt back, a plain-SQL row delivered) run the `Relay` itself
//! over the store, publishing to a [`MemoryTransport`].
//!
//! Each function panics on a violation (they are called from `#[tokio::test]`s).

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use outbox::store::{
    BUCKETS, Bucket, BucketCompletion, BucketRow, HandOff, LeaseToken, MembershipRequest,
    MembershipRound, Outcome,
};
use outbox::{
    Backoff, ConfirmReport, Confirmation, EnqueueError, MemoryTransport, NewMessage, Relay,
    RelayConfig, Router, Status, StoreErrorKind, TransportErrorKind, Verdict,
};
use uuid::Uuid;

use crate::{ConfirmFixture, HookControl, StoreFixture, wait_metrics, wait_until, within};

mod basics;
mod buckets;
mod confirm;
mod relaying;

pub use basics::*;
pub use buckets::*;
pub use confirm::*;
pub use relaying::*;

const LONG: Duration = Duration::from_secs(60);

/// One message of a batch read by a [`ProtocolRelay`], as the relay keeps it: the bucket and
/// the token it was read under, the attempts stored in the row, and whether this attempt was
/// recorded before publishing (the first batch of a taken-over bucket).
#[derive(Debug, Clone)]
struct Work {
    row: BucketRow,
    token: LeaseToken,
    stored_attempts: u32,
    counted: bool,
}

impl Work {
    /// The attempt number of this publish.
    fn attempt(&self) -> u32 {
        if self.counted {
            self.stored_attempts
        } else {
            self.stored_attempts + 1
        }
    }

    /// The completion the relay writes for this message with `outcome`: `attempts` is this
    /// attempt's number, except for a release (the attempt is given back).
    fn completion(&self, outcome: Outcome) -> BucketCompletion {
        let attempts = match outcome {
            Outcome::Release { .. } => self.stored_attempts,
            _ => self.attempt(),
        };
        BucketCompletion {
            id: self.row.message.id,
            bucket: self.row.bucket,
            token: self.token,
            attempts,
            outcome,
        }
    }
}

/// What a relay believes it holds after membership `round`, as `outbox::Relay` keeps it: the
/// renewed buckets of `held` are kept and the lost ones dropped (from `suspect` too), the
/// acquired ones added with their tokens, and those taken over marked `suspect` (their first
/// batch not read yet).
pub fn keep_after_round(
    held: &mut BTreeMap<Bucket, LeaseToken>,
    suspect: &mut BTreeSet<Bucket>,
    round: &MembershipRound,
) {
    held.retain(|b, _| round.renewed.contains(b));
    suspect.retain(|b| round.renewed.contains(b));
    for l in &round.acquired {
        held.insert(l.bucket, l.token);
        if l.takeover {
            suspect.insert(l.bucket);
        }
    }
}

/// One relay's side of the bucket protocol, making the store calls `outbox::Relay` makes with
/// the same arguments (relay.rs: `membership_loop`, `read_buckets` in the main loop,
/// `process_inner`, `complete`, `leave`).
struct ProtocolRelay {
    name: String,
    lease: Duration,
    /// The buckets this relay believes it holds, with the token of each.
    held: BTreeMap<Bucket, LeaseToken>,
    /// Buckets taken over whose first batch was not read yet.
    suspect: BTreeSet<Bucket>,
}

impl ProtocolRelay {
    fn new(name: &str, lease: Duration) -> Self {
        ProtocolRelay {
            name: name.into(),
            lease,
            held: BTreeMap::new(),
            suspect: BTreeSet::new(),
        }
    }

    /// The held buckets, in order.
    fn buckets(&self) -> Vec<Bucket> {
        self.held.keys().copied().collect()
    }

    /// A membership round: heartbeat, renew the held buckets, acquire up to the fair share.
    /// Renewed buckets are kept, lost ones dropped, acquired ones added (taken-over ones
    /// suspect), as the relay does.
    async fn membership(&mut self, store: &Arc<dyn outbox::Store>) -> MembershipRound {
        let r = store
            .membership(&MembershipRequest {
                relay: self.name.clone(),
                lease: self.lease,
                held: self.held.iter().map(|(b, t)| (*b, *t)).collect(),
                acquire: true,
                routes: vec!["*".into()],
            })
            .await
            .expect("membership");
        keep_after_round(&mut self.held, &mut self.suspect, &r);
        r
    }

    /// Take the buckets above `fair_share` out of the held set (the last ones, as the relay
    /// does) and return them for [`ProtocolRelay::release`].
    fn excess(&mut self, fair_share: u32) -> Vec<(Bucket, LeaseToken)> {
        let n = self.held.len().saturating_sub(fair_share as usize);
        let spare: Vec<(Bucket, LeaseToken)> = self
            .held
            .iter()
            .rev()
            .take(n)
            .map(|(b, t)| (*b, *t))
            .collect();
        for (b, _) in &spare {
            self.held.remove(b);
            self.suspect.remove(b);
        }
        spare
    }

    /// Give `buckets` back (`leave`: and leave the membership).
    async fn release(
        &self,
        store: &Arc<dyn outbox::Store>,
        buckets: &[(Bucket, LeaseToken)],
        leave: bool,
    ) {
        store
            .release_buckets(&self.name, buckets, leave)
            .await
            .expect("release_buckets");
    }

    /// A membership round followed by giving back what is above the fair share.
    async fn round(&mut self, store: &Arc<dyn outbox::Store>) -> MembershipRound {
        let r = self.membership(store).await;
        let spare = self.excess(r.fair_share);
        if !spare.is_empty() {
            self.release(store, &spare, false).await;
        }
        r
    }

    /// Rounds until one acquires buckets: the first round after another relay's leases
    /// expired, on the database's clock (polled every 20 ms, for at most 10 s).
    ///
    /// # Panics
    /// When no round acquired a bucket within 10 s.
    async fn round_until_acquired(&mut self, store: &Arc<dyn outbox::Store>) -> MembershipRound {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            let r = self.round(store).await;
            if !r.acquired.is_empty() {
                return r;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "{}: the other relay's leases never expired",
                self.name
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// How long until the next PENDING row of the held buckets is due (`next_due_in_buckets`,
    /// as the relay asks before it idles); `None` without one.
    async fn next_due(&self, store: &Arc<dyn outbox::Store>) -> Option<Duration> {
        store
            .next_due_in_buckets(&self.buckets())
            .await
            .expect("next_due_in_buckets")
    }

    /// Read up to `limit` due rows of the held buckets. The rows of a taken-over bucket's first
    /// batch are `counted` (their attempt is recorded before publishing).
    async fn read(&mut self, store: &Arc<dyn outbox::Store>, limit: u32) -> Vec<Work> {
        let batch = store
            .read_buckets(&self.buckets(), &[], limit)
            .await
            .expect("read_buckets");
        assert!(batch.malformed.is_empty(), "{:?}", batch.malformed);
        let suspects: BTreeSet<Bucket> = batch
            .rows
            .iter()
            .map(|r| r.bucket)
            .filter(|b| self.suspect.contains(b))
            .collect();
        self.suspect.retain(|b| !suspects.contains(b));
        batch
            .rows
            .into_iter()
            .map(|row| {
                let token = *self.held.get(&row.bucket).unwrap_or_else(|| {
                    panic!("{} read bucket {} it does not hold", self.name, row.bucket)
                });
                Work {
                    token,
                    stored_attempts: row.message.attempts,
                    counted: suspects.contains(&row.bucket),
                    row,
                }
            })
            .collect()
    }

    /// A takeover batch records its attempt before publishing: one completion releasing each
    /// counted row with `attempts + 1`, due now. Returns the rows matched.
    async fn record_takeover_attempts(
        &self,
        store: &Arc<dyn outbox::Store>,
        work: &mut [Work],
    ) -> u64 {
        let mut pre = Vec::new();
        for w in work.iter_mut().filter(|w| w.counted) {
            w.stored_attempts += 1;
            pre.push(BucketCompletion {
                id: w.row.message.id,
                bucket: w.row.bucket,
                token: w.token,
                attempts: w.stored_attempts,
                outcome: Outcome::Release {
                    delay: Duration::ZERO,
                },
            });
        }
        self.write_completions(store, &pre).await
    }

    /// One completion statement for the batch, each message with its outcome.
    async fn complete_batch(
        &self,
        store: &Arc<dyn outbox::Store>,
        outcomes: &[(&Work, Outcome)],
    ) -> u64 {
        let completions: Vec<BucketCompletion> = outcomes
            .iter()
            .map(|(w, o)| w.completion(o.clone()))
            .collect();
        self.write_completions(store, &completions).await
    }

    async fn write_completions(
        &self,
        store: &Arc<dyn outbox::Store>,
        completions: &[BucketCompletion],
    ) -> u64 {
        store
            .complete_in_buckets(&self.name, completions)
            .await
            .expect("complete_in_buckets")
    }

    /// Give every held bucket back and leave (the relay's graceful shutdown).
    async fn leave(&mut self, store: &Arc<dyn outbox::Store>) {
        let all: Vec<(Bucket, LeaseToken)> = self.held.iter().map(|(b, t)| (*b, *t)).collect();
        self.held.clear();
        self.suspect.clear();
        self.release(store, &all, true).await;
    }
}

/// A relay holding every bucket (the only live one), with lease `lease`.
async fn sole_relay(store: &Arc<dyn outbox::Store>, name: &str, lease: Duration) -> ProtocolRelay {
    let mut r = ProtocolRelay::new(name, lease);
    r.round(store).await;
    assert_eq!(
        r.held.len(),
        usize::from(BUCKETS),
        "{name} alone holds every bucket"
    );
    r
}

/// Relay settings scaled down for tests: lease 2 s, publish timeout 500 ms, poll 100 ms,
/// maintenance every 200 ms, retry backoff from 100 ms (×2, ≤ 1 s), probes from 50 ms (≤ 300 ms);
/// the rest [`RelayConfig::default`]. The integration suite's `fast_config` is this.
pub fn relay_config(name: &str) -> RelayConfig {
    RelayConfig {
        name: name.into(),
        batch_size: 100,
        lease: Duration::from_secs(2),
        publish_timeout: Duration::from_millis(500),
        poll_interval: Duration::from_millis(100),
        max_attempts: 5,
        backoff: Backoff {
            base: Duration::from_millis(100),
            factor: 2.0,
            max: Duration::from_secs(1),
            jitter: 0.2,
        },
        probe_backoff: Backoff {
            base: Duration::from_millis(50),
            factor: 2.0,
            max: Duration::from_millis(300),
            jitter: 0.2,
        },
        maintenance_interval: Duration::from_millis(200),
        shutdown_timeout: Duration::from_secs(5),
        ..RelayConfig::default()
    }
}

/// A relay over `store` publishing every topic to `transport` (`Router::single`) with `config`.
///
/// # Panics
/// When `config` is invalid.
pub fn relay_over(
    store: Arc<dyn outbox::Store>,
    transport: Arc<dyn outbox::Transport>,
    config: RelayConfig,
) -> Relay {
    relay_routed(store, Router::single(transport), config)
}

/// A relay over `store` publishing by `router` with `config`.
///
/// # Panics
/// When `config` or `router` is invalid, naming the error.
pub fn relay_routed(store: Arc<dyn outbox::Store>, router: Router, config: RelayConfig) -> Relay {
    Relay::builder(store)
        .router(router)
        .config(config)
        .build()
        .unwrap_or_else(|e| panic!("relay config: {e}"))
}

/// A relay over `fx`'s store publishing every topic to `mem`, running.
fn spawn_relay<F: StoreFixture>(fx: &F, mem: &Arc<MemoryTransport>) -> outbox::RelayHandle {
    relay_over(fx.store(), mem.clone(), relay_config("suite-relay")).spawn()
}

/// Every row, its `due_in_ms` set to 0 (it moves with the clock): what a write that must change
/// nothing is compared by, before and after.
async fn rows_at_rest<F: StoreFixture>(fx: &F) -> Vec<crate::RowState> {
    fx.rows()
        .await
        .into_iter()
        .map(|r| crate::RowState { due_in_ms: 0, ..r })
        .collect()
}

/// `comps` under stale bucket tokens (each token with its lowest bit flipped).
fn with_stale_tokens(comps: &[BucketCompletion]) -> Vec<BucketCompletion> {
    comps
        .iter()
        .map(|c| BucketCompletion {
            token: c.token ^ 1,
            ..c.clone()
        })
        .collect()
}

/// Wait until the row of `id` has `status`.
async fn wait_status<F: StoreFixture>(fx: &F, id: Uuid, status: Status) {
    wait_until(
        &format!("message {id} to be {status}"),
        Duration::from_secs(15),
        || async move { fx.row(id).await.status == status.as_i16() },
    )
    .await;
}

// Confirmations (used by [`confirm`]).

fn processed(id: Uuid) -> Confirmation {
    Confirmation::new(id, "suite", Verdict::Processed)
}

fn rejected(id: Uuid, reason: &str) -> Confirmation {
    Confirmation::new(
        id,
        "suite",
        Verdict::Rejected {
            reason: reason.into(),
        },
    )
}

fn report(confirmed: u64, rejected: u64, duplicates: u64, unknown: u64) -> ConfirmReport {
    ConfirmReport {
        confirmed,
        rejected,
        duplicates,
        unknown,
        failed_hooks: 0,
    }
}

/// Publish every due row with `outcome` (SENT, or SENT awaiting confirmation) as a relay does:
/// join and take every bucket, read, one completion for the batch, leave. Returns the rows
/// completed.
async fn send_all(store: &Arc<dyn outbox::Store>, outcome: Outcome) -> usize {
    complete_all(store, |_| outcome.clone()).await
}

/// Like [`send_all`], each row's outcome chosen by `outcome`.
async fn complete_all(store: &Arc<dyn outbox::Store>, outcome: impl Fn(&Work) -> Outcome) -> usize {
    let mut relay = sole_relay(store, "suite-sender", LONG).await;
    let work = relay.read(store, 1000).await;
    let outcomes: Vec<(&Work, Outcome)> = work.iter().map(|w| (w, outcome(w))).collect();
    let n = relay.complete_batch(store, &outcomes).await;
    assert_eq!(n as usize, work.len());
    relay.leave(store).await;
    work.len()
}

fn awaiting(within: Duration) -> Outcome {
    Outcome::SentAwaitingConfirmation { within }
}

// Bucket leases (used by [`buckets`]).

const SHORT: Duration = Duration::from_millis(300);

fn all_buckets() -> Vec<Bucket> {
    (0..BUCKETS as Bucket).collect()
}

/// One membership round of `relay` holding `held`, acquiring up to its fair share.
async fn round(
    store: &Arc<dyn outbox::Store>,
    relay: &str,
    lease: Duration,
    held: &BTreeMap<Bucket, LeaseToken>,
) -> MembershipRound {
    store
        .membership(&MembershipRequest {
            relay: relay.into(),
            lease,
            held: held.iter().map(|(b, t)| (*b, *t)).collect(),
            acquire: true,
            routes: vec![format!("{relay}-*")],
        })
        .await
        .expect("membership")
}

/// Apply a round to what a relay holds: keep the renewed buckets, add the acquired ones.
fn hold(held: &mut BTreeMap<Bucket, LeaseToken>, r: &MembershipRound) {
    held.retain(|b, _| r.renewed.contains(b));
    for l in &r.acquired {
        held.insert(l.bucket, l.token);
    }
}

/// Membership of `relay` until it holds every bucket (lease `lease`).
async fn hold_all(
    store: &Arc<dyn outbox::Store>,
    relay: &str,
    lease: Duration,
) -> BTreeMap<Bucket, LeaseToken> {
    let mut held = BTreeMap::new();
    let r = round(store, relay, lease, &held).await;
    hold(&mut held, &r);
    assert_eq!(
        held.len(),
        usize::from(BUCKETS),
        "{relay} alone holds every bucket"
    );
    held
}

/// Everything due in every bucket, in the order read.
async fn read_all(store: &Arc<dyn outbox::Store>) -> Vec<BucketRow> {
    let b = store
        .read_buckets(&all_buckets(), &[], 10_000)
        .await
        .expect("read_buckets");
    assert!(b.malformed.is_empty());
    b.rows
}

/// A completion of row `r` with `outcome`, fenced by `held`'s token for its bucket.
fn done(
    held: &BTreeMap<Bucket, LeaseToken>,
    r: &BucketRow,
    attempts: u32,
    outcome: Outcome,
) -> BucketCompletion {
    BucketCompletion {
        id: r.message.id,
        bucket: r.bucket,
        token: held[&r.bucket],
        attempts,
        outcome,
    }
}
