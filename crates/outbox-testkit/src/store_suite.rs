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

use std::collections::{BTreeSet, HashSet};
use std::time::Duration;

use outbox::store::Outcome;
use outbox::{
    Backoff, EnqueueError, MemoryTransport, NewMessage, Relay, RelayConfig, Router, Status,
    StoreErrorKind, TransportErrorKind,
};

use crate::{StoreFixture, wait_until, within};

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
        self.held.retain(|b, _| r.renewed.contains(b));
        self.suspect.retain(|b| r.renewed.contains(b));
        for l in &r.acquired {
            self.held.insert(l.bucket, l.token);
            if l.takeover {
                self.suspect.insert(l.bucket);
            }
        }
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

/// A relay over `fx`'s store publishing every topic to `mem`, running.
fn spawn_relay<F: StoreFixture>(fx: &F, mem: &Arc<MemoryTransport>) -> outbox::RelayHandle {
    Relay::builder(fx.store())
        .router(Router::single(mem.clone()))
        .config(relay_config("suite-relay"))
        .build()
        .expect("relay config")
        .spawn()
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

/// `migrate` can run again (twice) without error or data loss.
pub async fn migrate_is_idempotent<F: StoreFixture>(fx: &F) {
    let ids = fx
        .enqueue_commit(vec![NewMessage::new("t", "x")])
        .await
        .unwrap();
    fx.store().migrate().await.expect("second migrate");
    fx.store().migrate().await.expect("third migrate");
    let rows = fx.rows().await;
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].message_id, ids[0]);
}

/// A rolled-back enqueue is never visible to the relay's read; a committed one is read.
pub async fn rollback_is_never_visible<F: StoreFixture>(fx: &F) {
    fx.enqueue_rollback(vec![NewMessage::new("t", "rolled-back")])
        .await
        .expect("enqueue inside the transaction works");
    let store = fx.store();
    let mut relay = sole_relay(&store, "relay-a", LONG).await;
    assert!(
        relay.read(&store, 10).await.is_empty(),
        "rolled back message read"
    );
    assert!(fx.rows().await.is_empty());
    let ids = fx
        .enqueue_commit(vec![NewMessage::new("t", "committed")])
        .await
        .unwrap();
    let work = relay.read(&store, 10).await;
    assert_eq!(
        work.iter()
            .map(|w| w.row.message.message_id)
            .collect::<Vec<_>>(),
        ids
    );
}

/// Which relay holds each bucket, as the relays themselves see it: a relay registers a bucket
/// after the store granted it and unregisters it before giving it back.
type Registry = std::sync::Mutex<BTreeMap<Bucket, String>>;

/// Register the buckets `r` granted to `relay`; none may be registered to another relay.
fn register(registry: &Registry, relay: &ProtocolRelay, r: &MembershipRound) {
    let mut reg = registry.lock().unwrap();
    for l in &r.acquired {
        if let Some(other) = reg.insert(l.bucket, relay.name.clone())
            && other != relay.name
        {
            panic!(
                "bucket {} granted to {} while {other} holds it",
                l.bucket, relay.name
            );
        }
    }
}

/// Two relays racing over 200 rows: at no time do both hold a bucket (each acquisition is of a
/// bucket the other gave back first), each reads only the buckets it holds, every row is read
/// and completed exactly once, by the relay holding its bucket, with one attempt.
pub async fn relays_never_share_a_bucket<F: StoreFixture>(fx: &F) {
    let msgs: Vec<NewMessage> = (0..200)
        .map(|i| NewMessage::new("t", format!("{i}")))
        .collect();
    fx.enqueue_commit(msgs).await.unwrap();
    let store = fx.store();
    let registry: Arc<Registry> = Arc::default();
    // relay-a joins alone (every bucket), then relay-b (nothing free yet).
    let mut a = ProtocolRelay::new("relay-a", LONG);
    let r = a.round(&store).await;
    register(&registry, &a, &r);
    let mut b = ProtocolRelay::new("relay-b", LONG);
    let r = b.round(&store).await;
    assert!(r.acquired.is_empty(), "held buckets granted twice: {r:?}");
    assert_eq!(r.live_relays, 2);

    let run = |mut relay: ProtocolRelay| {
        let store = store.clone();
        let registry = registry.clone();
        async move {
            // (id, attempts stored) of every row this relay read and completed.
            let mut done = Vec::new();
            loop {
                let r = relay.membership(&store).await;
                register(&registry, &relay, &r);
                let spare = relay.excess(r.fair_share);
                if !spare.is_empty() {
                    {
                        let mut reg = registry.lock().unwrap();
                        for (bucket, _) in &spare {
                            assert_eq!(reg.remove(bucket).as_deref(), Some(relay.name.as_str()));
                        }
                    }
                    relay.release(&store, &spare, false).await;
                }
                let work = relay.read(&store, 7).await;
                if work.is_empty() {
                    if store.next_due_in().await.expect("next_due_in").is_none() {
                        return done;
                    }
                    tokio::task::yield_now().await;
                    continue;
                }
                {
                    let reg = registry.lock().unwrap();
                    for w in &work {
                        assert_eq!(
                            reg.get(&w.row.bucket).map(String::as_str),
                            Some(relay.name.as_str()),
                            "{} read bucket {} it does not hold",
                            relay.name,
                            w.row.bucket
                        );
                    }
                }
                let outcomes: Vec<(&Work, Outcome)> =
                    work.iter().map(|w| (w, Outcome::Sent)).collect();
                let n = relay.complete_batch(&store, &outcomes).await;
                assert_eq!(n as usize, work.len(), "{}: completion refused", relay.name);
                done.extend(work.iter().map(|w| (w.row.message.id, w.attempt())));
                tokio::task::yield_now().await;
            }
        }
    };
    let (ra, rb) = within(
        "two relays to publish 200 rows",
        Duration::from_secs(60),
        async { tokio::join!(tokio::spawn(run(a)), tokio::spawn(run(b))) },
    )
    .await;
    let (ra, rb) = (ra.unwrap(), rb.unwrap());
    let mut all = HashSet::new();
    for (id, attempts) in ra.iter().chain(rb.iter()) {
        assert!(all.insert(*id), "row {id} read and completed twice");
        assert_eq!(*attempts, 1);
    }
    assert_eq!(all.len(), 200, "a: {}, b: {}", ra.len(), rb.len());
    assert!(
        !ra.is_empty() && !rb.is_empty(),
        "both relays published: a {}, b {}",
        ra.len(),
        rb.len()
    );
    let rows = fx.rows().await;
    assert!(
        rows.iter()
            .all(|r| r.status == Status::Sent.as_i16() && r.attempts == 1),
        "every row SENT once"
    );
}

/// A relay that read a row and died: while its lease is live no other relay can take its
/// buckets; once it expired (database clock) another relay takes them over, reads the row again
/// (still PENDING, attempts untouched), records the attempt before publishing, and completes
/// it; the dead relay's late completion is refused.
pub async fn lease_expiry_takeover_reads_again<F: StoreFixture>(fx: &F) {
    let store = fx.store();
    let ids = fx
        .enqueue_commit(vec![NewMessage::new("t", "x")])
        .await
        .unwrap();
    // relay-a's lease (1 s) outlasts relay-b's liveness window (900 ms): once relay-a's buckets
    // expired, relay-a no longer counts as live and relay-b's share is every bucket.
    let mut a = sole_relay(&store, "relay-a", Duration::from_secs(1)).await;
    let read_by_a = a.read(&store, 10).await;
    assert_eq!(read_by_a.len(), 1);
    assert_eq!(read_by_a[0].row.message.message_id, ids[0]);
    // relay-a dies here, between read and completion.
    let mut b = ProtocolRelay::new("relay-b", Duration::from_millis(900));
    let r = b.round(&store).await;
    assert!(r.acquired.is_empty(), "a live lease was taken: {r:?}");
    assert!(b.read(&store, 10).await.is_empty());

    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let taken = loop {
        let r = b.round(&store).await;
        if !r.acquired.is_empty() {
            break r;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "relay-a's leases never expired"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(taken.live_relays, 1, "relay-a is no longer live");
    assert!(taken.acquired.iter().all(|l| l.takeover), "{taken:?}");
    assert_eq!(b.held.len(), usize::from(BUCKETS));
    let r = fx.row(ids[0]).await;
    assert_eq!((r.status, r.attempts), (Status::Pending.as_i16(), 0));

    let mut work = b.read(&store, 10).await;
    assert_eq!(work.len(), 1, "the row is read again after the takeover");
    assert_eq!(work[0].row.message.message_id, ids[0]);
    assert_eq!(work[0].row.message.attempts, 0);
    assert!(
        work[0].counted,
        "a takeover batch records its attempt first"
    );
    assert_eq!(b.record_takeover_attempts(&store, &mut work).await, 1);
    let r = fx.row(ids[0]).await;
    assert_eq!(
        (r.status, r.attempts),
        (Status::Pending.as_i16(), 1),
        "the attempt is recorded before publishing"
    );
    assert!(r.due_in_ms <= 0);

    // relay-a comes back with its stale batch: refused, nothing written.
    let n = a
        .complete_batch(&store, &[(&read_by_a[0], Outcome::Sent)])
        .await;
    assert_eq!(n, 0, "a dead relay's completion was applied");
    assert_eq!(fx.row(ids[0]).await.status, Status::Pending.as_i16());
    let n = b.complete_batch(&store, &[(&work[0], Outcome::Sent)]).await;
    assert_eq!(n, 1);
    let r = fx.row(ids[0]).await;
    assert_eq!((r.status, r.attempts), (Status::Sent.as_i16(), 1));
}

/// A completion is fenced by the bucket lease: a stale token, another relay's name, or a bucket
/// the relay gave away match no row and change nothing; the holder's completion applies, and
/// applies once.
pub async fn stale_completion_writes_nothing<F: StoreFixture>(fx: &F) {
    let store = fx.store();
    let ids = fx
        .enqueue_commit(vec![
            NewMessage::new("t", "a").with_partition_key("key-a"),
            NewMessage::new("t", "b").with_partition_key("key-b"),
        ])
        .await
        .unwrap();
    let mut a = sole_relay(&store, "relay-a", LONG).await;
    let mut work = a.read(&store, 10).await;
    work.sort_by_key(|w| w.row.message.message_id);
    assert_eq!(work.len(), 2);
    assert_ne!(work[0].row.bucket, work[1].row.bucket, "two buckets");
    assert_eq!(
        work.iter()
            .map(|w| w.row.message.message_id)
            .collect::<Vec<_>>(),
        {
            let mut s = ids.clone();
            s.sort();
            s
        }
    );
    let snapshot = |rows: Vec<crate::RowState>| {
        rows.into_iter()
            .map(|r| crate::RowState { due_in_ms: 0, ..r })
            .collect::<Vec<_>>()
    };
    let before = snapshot(fx.rows().await);
    let sent: Vec<BucketCompletion> = work.iter().map(|w| w.completion(Outcome::Sent)).collect();
    let stale: Vec<BucketCompletion> = sent
        .iter()
        .map(|c| BucketCompletion {
            token: c.token ^ 1,
            ..c.clone()
        })
        .collect();
    assert_eq!(a.write_completions(&store, &stale).await, 0);
    assert_eq!(
        store.complete_in_buckets("relay-b", &sent).await.unwrap(),
        0,
        "a relay that does not own the bucket completed"
    );
    assert_eq!(
        snapshot(fx.rows().await),
        before,
        "a refused completion changed a row"
    );

    // relay-a gives the first row's bucket away (above its share) and relay-b takes it.
    let lost = work[0].row.bucket;
    let given = vec![(lost, a.held[&lost])];
    a.held.remove(&lost);
    a.release(&store, &given, false).await;
    let mut b = ProtocolRelay::new("relay-b", LONG);
    let r = b.round(&store).await;
    assert!(
        r.acquired.iter().any(|l| l.bucket == lost && !l.takeover),
        "{r:?}"
    );
    // relay-a's completion of its whole batch writes only the row whose bucket it still holds.
    assert_eq!(a.write_completions(&store, &sent).await, 1);
    let r0 = fx.row(work[0].row.message.message_id).await;
    assert_eq!((r0.status, r0.attempts), (Status::Pending.as_i16(), 0));
    let r1 = fx.row(work[1].row.message.message_id).await;
    assert_eq!((r1.status, r1.attempts), (Status::Sent.as_i16(), 1));
    assert!(r1.sent);
    // The new owner reads the row again and completes it.
    let again = b.read(&store, 10).await;
    assert_eq!(again.len(), 1);
    assert_eq!(again[0].row.message.id, work[0].row.message.id);
    assert_eq!(
        b.complete_batch(&store, &[(&again[0], Outcome::Sent)])
            .await,
        1
    );
    // A second completion of the same rows is refused (they are no longer PENDING).
    assert_eq!(
        b.complete_batch(&store, &[(&again[0], Outcome::Sent)])
            .await,
        0
    );
    assert_eq!(
        a.complete_batch(&store, &[(&work[1], Outcome::Sent)]).await,
        0
    );
    let stats = store.stats().await.unwrap();
    assert_eq!(stats.counts[&Status::Sent], 2);
    assert_eq!(stats.counts[&Status::Pending], 0);
}

/// `Retry` puts the row back to PENDING due `delay` later on the database clock: not read at
/// once, read after the delay (`next_due_in_buckets` says when), attempts kept, error recorded.
pub async fn retry_backs_off_on_the_database_clock<F: StoreFixture>(fx: &F) {
    let store = fx.store();
    let ids = fx
        .enqueue_commit(vec![NewMessage::new("t", "x")])
        .await
        .unwrap();
    let mut a = sole_relay(&store, "relay-a", LONG).await;
    let work = a.read(&store, 10).await;
    let delay = Duration::from_millis(1500);
    let retry = Outcome::Retry {
        delay,
        error: "broker said no".into(),
    };
    assert_eq!(a.complete_batch(&store, &[(&work[0], retry)]).await, 1);
    let started = tokio::time::Instant::now();
    let r = fx.row(ids[0]).await;
    assert_eq!(r.status, Status::Pending.as_i16());
    assert_eq!(r.attempts, 1);
    assert_eq!(r.last_error.as_deref(), Some("broker said no"));
    assert!(
        (1000..=1600).contains(&r.due_in_ms),
        "due in {} ms on the database clock",
        r.due_in_ms
    );
    assert!(a.read(&store, 10).await.is_empty());
    let due = store
        .next_due_in_buckets(&a.buckets())
        .await
        .unwrap()
        .expect("a pending row");
    assert!(due > Duration::from_millis(900) && due <= delay, "{due:?}");
    let buckets = a.buckets();
    wait_until(
        "the retried row to be read again",
        Duration::from_secs(5),
        || {
            let store = store.clone();
            let buckets = buckets.clone();
            async move {
                !store
                    .read_buckets(&buckets, &[], 10)
                    .await
                    .unwrap()
                    .rows
                    .is_empty()
            }
        },
    )
    .await;
    assert!(started.elapsed() >= Duration::from_millis(900));
    let work = a.read(&store, 10).await;
    assert_eq!(work[0].row.message.attempts, 1);
    assert_eq!(work[0].attempt(), 2);
    assert_eq!(
        a.complete_batch(&store, &[(&work[0], Outcome::Sent)]).await,
        1
    );
    let r = fx.row(ids[0]).await;
    assert_eq!((r.status, r.attempts), (Status::Sent.as_i16(), 2));
}

/// `Failed` dead-letters with the reason, in the same statement as the batch's other outcomes;
/// stats and `failed()` show it; it is never read again.
pub async fn dead_letter<F: StoreFixture>(fx: &F) {
    let store = fx.store();
    let ids = fx
        .enqueue_commit(vec![
            NewMessage::new("poison", "x"),
            NewMessage::new("t", "y"),
        ])
        .await
        .unwrap();
    let mut a = sole_relay(&store, "relay-a", LONG).await;
    let work = a.read(&store, 10).await;
    let poison = work
        .iter()
        .find(|w| w.row.message.message_id == ids[0])
        .unwrap();
    let other = work
        .iter()
        .find(|w| w.row.message.message_id == ids[1])
        .unwrap();
    let failed = Outcome::Failed {
        reason: "too large for the broker".into(),
    };
    assert_eq!(
        a.complete_batch(&store, &[(poison, failed), (other, Outcome::Sent)])
            .await,
        2
    );
    let r = fx.row(ids[0]).await;
    assert_eq!(r.status, Status::Failed.as_i16());
    assert_eq!(r.last_error.as_deref(), Some("too large for the broker"));
    let stats = store.stats().await.unwrap();
    assert_eq!(stats.counts[&Status::Failed], 1);
    assert_eq!(stats.counts[&Status::Sent], 1);
    let failed = store.failed(10).await.unwrap();
    assert_eq!(failed.len(), 1);
    assert_eq!(failed[0].message_id, ids[0].to_string());
    assert_eq!(failed[0].topic, "poison");
    assert_eq!(failed[0].attempts, 1);
    assert_eq!(
        failed[0].last_error.as_deref(),
        Some("too large for the broker")
    );
    assert!(a.read(&store, 10).await.is_empty());
}

/// The relay dead-letters a message whose every publish fails (retryable) after exactly its
/// `max_attempts` attempts, backing off between them; the other messages are delivered.
pub async fn relay_dead_letters_at_max_attempts<F: StoreFixture>(fx: &F) {
    let mem = Arc::new(MemoryTransport::new());
    let poison = NewMessage::new("t", "poison").with_max_attempts(3);
    let poison_id = poison.message_id();
    mem.fail_next(poison_id, vec![TransportErrorKind::Retryable; 10]);
    let ids = fx
        .enqueue_commit(vec![poison, NewMessage::new("t", "fine")])
        .await
        .unwrap();
    assert_eq!(ids[0], poison_id);
    let handle = spawn_relay(fx, &mem);
    wait_status(fx, ids[1], Status::Sent).await;
    wait_status(fx, poison_id, Status::Failed).await;
    let r = fx.row(poison_id).await;
    assert_eq!(r.attempts, 3, "dead-lettered after exactly max_attempts");
    assert!(r.last_error.is_some(), "the reason is kept");
    let delivered = mem.delivered();
    assert_eq!(delivered.len(), 1);
    assert_eq!(delivered[0].message.message_id, ids[1]);
    let m = handle.metrics().snapshot();
    assert_eq!((m.retried, m.failed, m.sent), (2, 1, 1), "{m:?}");
    handle.shutdown().await.unwrap();
    assert_eq!(fx.row(poison_id).await.status, Status::Failed.as_i16());
}

/// A release keeps the attempts as given (the attempt is given back): store level, then the
/// relay with an unreachable broker releases the message without counting an attempt, and
/// publishes it as its first attempt once the broker is back.
pub async fn release_gives_the_attempt_back<F: StoreFixture>(fx: &F) {
    let store = fx.store();
    let ids = fx
        .enqueue_commit(vec![NewMessage::new("t", "x")])
        .await
        .unwrap();
    let mut a = sole_relay(&store, "relay-a", LONG).await;
    let work = a.read(&store, 10).await;
    assert_eq!(work[0].attempt(), 1);
    let release = Outcome::Release {
        delay: Duration::ZERO,
    };
    assert_eq!(a.complete_batch(&store, &[(&work[0], release)]).await, 1);
    let r = fx.row(ids[0]).await;
    assert_eq!((r.status, r.attempts), (Status::Pending.as_i16(), 0));
    let work = a.read(&store, 10).await;
    assert_eq!(work.len(), 1);
    assert_eq!(work[0].row.message.attempts, 0);
    a.leave(&store).await;

    // The relay: broker unreachable, then back.
    let mem = Arc::new(MemoryTransport::new());
    mem.set_down(true);
    let handle = spawn_relay(fx, &mem);
    wait_until(
        "the relay to release the message",
        Duration::from_secs(10),
        || async { handle.metrics().snapshot().released >= 1 },
    )
    .await;
    let r = fx.row(ids[0]).await;
    assert_eq!(
        (r.status, r.attempts),
        (Status::Pending.as_i16(), 0),
        "an unreachable broker costs no attempt"
    );
    mem.set_down(false);
    wait_status(fx, ids[0], Status::Sent).await;
    assert_eq!(fx.row(ids[0]).await.attempts, 1);
    let delivered = mem.delivered();
    assert_eq!(delivered.len(), 1);
    assert_eq!(delivered[0].message.attempts, 1);
    handle.shutdown().await.unwrap();
}

/// Validation errors are typed and raised before anything is written, and a bad message in a
/// batch writes none of the batch.
pub async fn validation_errors_write_nothing<F: StoreFixture>(fx: &F) {
    let e = fx
        .enqueue_commit(vec![NewMessage::new("", "x")])
        .await
        .unwrap_err();
    assert!(matches!(e, EnqueueError::InvalidTopic(_)), "{e:?}");
    let e = fx
        .enqueue_commit(vec![NewMessage::new("t", vec![0u8; 1024 * 1024 + 1])])
        .await
        .unwrap_err();
    assert!(matches!(e, EnqueueError::PayloadTooLarge { .. }), "{e:?}");
    let e = fx
        .enqueue_commit(vec![NewMessage::new("t", "x").with_header("bad name", "v")])
        .await
        .unwrap_err();
    assert!(matches!(e, EnqueueError::InvalidHeaderName(_)), "{e:?}");
    let e = fx
        .enqueue_commit(vec![
            NewMessage::new("t", "good"),
            NewMessage::new("t", "x").with_header("outbox-topic", "spoof"),
        ])
        .await
        .unwrap_err();
    assert!(matches!(e, EnqueueError::InvalidHeaderName(_)), "{e:?}");
    assert!(fx.rows().await.is_empty(), "a refused enqueue wrote rows");
}

/// Payload bytes round-trip byte-exact: invalid UTF-8 (0xFF 0xFE), NUL bytes, and JSON with a
/// `\u0000` escape (shared case C08).
pub async fn payload_round_trips_byte_exact<F: StoreFixture>(fx: &F) {
    let binary = vec![0xFF, 0xFE, 0x00, 0x01, 0x80, 0xC3, 0x28];
    let json =
        NewMessage::json("t", &serde_json::json!({"s": "a\u{0000}b", "emoji": "😀"})).unwrap();
    let json_bytes = json.payload().to_vec();
    assert!(
        json_bytes.windows(6).any(|w| w == b"\\u0000"),
        "the JSON carries the \\u0000 escape"
    );
    let raw_nul = b"{\"s\":\"a\x00b\"}".to_vec();
    let ids = fx
        .enqueue_commit(vec![
            NewMessage::new("t", binary.clone()),
            json,
            NewMessage::new("t", raw_nul.clone()),
            NewMessage::new("t", Vec::new()),
        ])
        .await
        .unwrap();
    let store = fx.store();
    let mut a = sole_relay(&store, "relay-a", LONG).await;
    let work = a.read(&store, 10).await;
    let by_id = |id| {
        work.iter()
            .find(|w| w.row.message.message_id == id)
            .expect("read")
            .row
            .message
            .clone()
    };
    assert_eq!(by_id(ids[0]).payload, binary);
    assert_eq!(by_id(ids[1]).payload, json_bytes);
    assert_eq!(by_id(ids[2]).payload, raw_nul);
    assert_eq!(by_id(ids[3]).payload, Vec::<u8>::new());
    assert_eq!(
        by_id(ids[1])
            .headers
            .get("content-type")
            .map(String::as_str),
        Some("application/json")
    );
}

/// A row inserted with plain SQL by a foreign producer, giving only the required columns (the
/// README's public contract), is read with the defaults and delivered by the relay: SENT after
/// one attempt.
pub async fn plain_sql_insert_is_delivered<F: StoreFixture>(fx: &F) {
    let id = fx.insert_plain_sql("foreign.topic", b"from java").await;
    let store = fx.store();
    let mut a = sole_relay(&store, "relay-a", LONG).await;
    let work = a.read(&store, 10).await;
    assert_eq!(work.len(), 1);
    let m = &work[0].row.message;
    assert_eq!(m.message_id, id);
    assert_eq!(m.topic, "foreign.topic");
    assert_eq!(m.payload, b"from java");
    assert!(m.headers.is_empty());
    assert_eq!(m.attempts, 0);
    a.leave(&store).await;

    let mem = Arc::new(MemoryTransport::new());
    let handle = spawn_relay(fx, &mem);
    within("the delivery", Duration::from_secs(15), mem.wait_for(1)).await;
    wait_status(fx, id, Status::Sent).await;
    let delivered = mem.delivered();
    assert_eq!(delivered.len(), 1);
    let m = &delivered[0].message;
    assert_eq!(m.message_id, id);
    assert_eq!(m.topic, "foreign.topic");
    assert_eq!(m.payload, b"from java");
    assert_eq!(delivered[0].destination, "foreign.topic");
    assert_eq!(fx.row(id).await.attempts, 1);
    handle.shutdown().await.unwrap();
}

/// A row a 0.1 relay left SENDING (it claimed the row, then stopped) is not read by the relay,
/// which reads PENDING rows only; `migrate` releases it (PENDING, lease cleared, due now) and the
/// relay publishes it. Issue 12: the row-claim protocol and its reaper are gone.
pub async fn migrate_releases_sending_rows_of_an_older_relay<F: StoreFixture>(fx: &F) {
    let ids = fx
        .enqueue_commit(vec![
            NewMessage::new("upgrade", "left SENDING"),
            NewMessage::new("upgrade", "pending"),
        ])
        .await
        .expect("enqueue");
    fx.leave_sending(ids[0]).await;
    let store = fx.store();

    let mem = Arc::new(MemoryTransport::new());
    let handle = spawn_relay(fx, &mem);
    wait_status(fx, ids[1], Status::Sent).await;
    handle.shutdown().await.unwrap();
    let left = fx.row(ids[0]).await;
    assert_eq!(
        left.status,
        Status::Sending.as_i16(),
        "the relay reads PENDING rows only"
    );
    assert_eq!(mem.delivered().len(), 1);

    store.migrate().await.expect("migrate");
    let released = fx.row(ids[0]).await;
    assert_eq!(
        released.status,
        Status::Pending.as_i16(),
        "migrate releases SENDING rows"
    );
    assert_eq!(released.lease_token, None, "the row lease is cleared");
    assert!(
        released.due_in_ms <= 0,
        "due at once, not after the old lease: {} ms",
        released.due_in_ms
    );
    store
        .migrate()
        .await
        .expect("migrate again changes nothing");

    let handle = spawn_relay(fx, &mem);
    wait_status(fx, ids[0], Status::Sent).await;
    handle.shutdown().await.unwrap();
    let delivered: Vec<Uuid> = mem
        .delivered()
        .iter()
        .map(|d| d.message.message_id)
        .collect();
    assert_eq!(delivered, vec![ids[1], ids[0]]);
    let row = fx.row(ids[0]).await;
    assert_eq!(
        row.attempts, 2,
        "the 0.1 relay's attempt is kept and this one counted"
    );
}

/// Table names that are not plain identifiers are rejected before any SQL runs.
pub async fn invalid_table_identifiers_are_rejected<F: StoreFixture>(fx: &F) {
    for bad in [
        "outbox; DROP TABLE outbox",
        "",
        "1outbox",
        "out box",
        "\"outbox\"",
        "a.b.c",
    ] {
        let e = fx.open_with_table(bad).await.expect_err(bad);
        assert_eq!(e.kind(), StoreErrorKind::Config, "{bad:?}: {e:?}");
    }
}

/// `next_due_in` and `stats` on an empty and a non-empty table; a delayed message is not read
/// before its delay.
pub async fn delayed_message_and_stats<F: StoreFixture>(fx: &F) {
    let store = fx.store();
    assert_eq!(store.next_due_in().await.unwrap(), None);
    let stats = store.stats().await.unwrap();
    assert!(stats.counts.values().all(|n| *n == 0));
    assert_eq!(stats.oldest_pending_age, None);
    fx.enqueue_commit(vec![
        NewMessage::new("t", "later").with_delay(Duration::from_secs(30)),
    ])
    .await
    .unwrap();
    let due = store.next_due_in().await.unwrap().expect("pending row");
    assert!(
        due > Duration::from_secs(28) && due <= Duration::from_secs(30),
        "{due:?}"
    );
    let mut a = sole_relay(&store, "relay-a", LONG).await;
    assert!(a.read(&store, 10).await.is_empty());
    let due = store
        .next_due_in_buckets(&a.buckets())
        .await
        .unwrap()
        .expect("pending row");
    assert!(due > Duration::from_secs(28), "{due:?}");
    fx.enqueue_commit(vec![NewMessage::new("t", "now")])
        .await
        .unwrap();
    assert_eq!(store.next_due_in().await.unwrap(), Some(Duration::ZERO));
    assert_eq!(a.read(&store, 10).await.len(), 1);
    let stats = store.stats().await.unwrap();
    assert_eq!(stats.counts[&Status::Pending], 2);
    assert!(stats.oldest_pending_age.is_some());
}

// ---------------------------------------------------------------------------------------------
// Confirmations, check-back and retention (docs/design/DESIGN.md §4, §9).
// ---------------------------------------------------------------------------------------------

use std::sync::Arc;
use std::sync::atomic::Ordering;

use outbox::{ConfirmReport, Confirmation, Verdict};
use uuid::Uuid;

use crate::{ConfirmFixture, HookControl};

fn processed(id: Uuid) -> Confirmation {
    Confirmation {
        message_id: id,
        consumer: "suite".into(),
        verdict: Verdict::Processed,
    }
}

fn rejected(id: Uuid, reason: &str) -> Confirmation {
    Confirmation {
        message_id: id,
        consumer: "suite".into(),
        verdict: Verdict::Rejected {
            reason: reason.into(),
        },
    }
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

/// `Processed` confirmations move SENT → CONFIRMED in one batch with the counts reported;
/// duplicates (also within one batch) and unknown ids are counted, never errors, and every
/// confirmation of a batch is accounted for exactly once.
pub async fn confirmations_apply_in_batches<F: ConfirmFixture>(fx: &F) {
    let ctl = Arc::new(HookControl::default());
    let store = fx.store_with_hook(ctl.clone()).await;
    let ids = fx
        .enqueue_commit(
            (0..5)
                .map(|i| NewMessage::new("t", format!("{i}")))
                .collect(),
        )
        .await
        .unwrap();
    assert_eq!(send_all(&store, awaiting(LONG)).await, 5);
    let st = fx.confirm_state(ids[0]).await;
    assert!(
        st.deadline_in_ms.is_some_and(|ms| ms > 50_000),
        "SENT awaiting confirmation has a deadline: {st:?}"
    );
    assert_eq!(
        store.apply_confirmations(&[]).await.unwrap(),
        report(0, 0, 0, 0)
    );

    let r = store
        .apply_confirmations(&[processed(ids[0]), processed(ids[1]), processed(ids[2])])
        .await
        .expect("apply");
    assert_eq!(r, report(3, 0, 0, 0));
    for id in &ids[..3] {
        assert_eq!(fx.row(*id).await.status, Status::Confirmed.as_i16());
        let st = fx.confirm_state(*id).await;
        assert!(st.confirmed && st.deadline_in_ms.is_none(), "{st:?}");
    }
    for id in &ids[3..] {
        assert_eq!(fx.row(*id).await.status, Status::Sent.as_i16());
    }

    let unknown = [Uuid::now_v7(), Uuid::now_v7()];
    let batch = [
        processed(ids[0]),        // already confirmed
        processed(ids[0]),        // and again, in the same batch
        processed(unknown[0]),    // not ours
        processed(unknown[1]),    // not ours
        processed(unknown[1]),    // not ours, twice
        rejected(ids[1], "late"), // already confirmed: no rejection, no hook
        processed(ids[3]),        // fresh
        processed(ids[3]),        // fresh, and its copy in the same batch
    ];
    let r = store.apply_confirmations(&batch).await.expect("apply");
    assert_eq!(
        r.confirmed + r.rejected + r.duplicates + r.unknown,
        batch.len() as u64,
        "every confirmation of the batch is counted once: {r:?}"
    );
    assert_eq!(r, report(1, 0, 4, 3));
    assert_eq!(fx.row(ids[1]).await.status, Status::Confirmed.as_i16());
    assert_eq!(fx.row(ids[3]).await.status, Status::Confirmed.as_i16());
    assert_eq!(fx.compensations(ids[1]).await, 0);
    assert_eq!(ctl.calls.load(Ordering::SeqCst), 0);
    assert_eq!(fx.row(ids[4]).await.status, Status::Sent.as_i16());
}

/// `Rejected` moves SENT → REJECTED with the reason and runs the rejection hook exactly once, in
/// the same transaction: the hook's row exists iff the status is REJECTED. A repeated rejection
/// (in one batch, later, or concurrently) never runs it again; a failing hook rolls back (status
/// unchanged, its write gone) and the rejection applies when it comes again.
pub async fn rejection_runs_the_hook_once<F: ConfirmFixture>(fx: &F) {
    let ctl = Arc::new(HookControl::default());
    let store = fx.store_with_hook(ctl.clone()).await;
    let ids = fx
        .enqueue_commit(
            (0..3)
                .map(|i| NewMessage::new("t", format!("{i}")))
                .collect(),
        )
        .await
        .unwrap();
    send_all(&store, awaiting(LONG)).await;
    let (x, y, z) = (ids[0], ids[1], ids[2]);
    let check = |id: Uuid| async move {
        let status = fx.row(id).await.status;
        let comp = fx.compensations(id).await;
        assert!(comp <= 1, "hook ran {comp} times for {id}");
        assert_eq!(
            comp == 1,
            status == Status::Rejected.as_i16(),
            "compensation row exists iff REJECTED (status {status}, rows {comp})"
        );
        status
    };

    // Twice in one batch.
    let r = store
        .apply_confirmations(&[
            rejected(x, "insufficient stock"),
            rejected(x, "insufficient stock"),
        ])
        .await
        .unwrap();
    assert_eq!(r, report(0, 1, 1, 0));
    assert_eq!(check(x).await, Status::Rejected.as_i16());
    let row = fx.row(x).await;
    let err = row.last_error.unwrap_or_default();
    assert!(err.contains("insufficient stock"), "reason kept: {err}");
    assert!(fx.confirm_state(x).await.deadline_in_ms.is_none());
    // Later again, and a late Processed: duplicates, nothing changes.
    let r = store
        .apply_confirmations(&[rejected(x, "insufficient stock"), processed(x)])
        .await
        .unwrap();
    assert_eq!(r, report(0, 0, 2, 0));
    assert_eq!(check(x).await, Status::Rejected.as_i16());

    // Concurrently: the hook holds its transaction open for a while.
    ctl.delay_ms.store(300, Ordering::SeqCst);
    let tasks: Vec<_> = (0..4)
        .map(|_| {
            let store = store.clone();
            tokio::spawn(async move { store.apply_confirmations(&[rejected(y, "no")]).await })
        })
        .collect();
    let mut total = ConfirmReport::default();
    for t in tasks {
        total.add(t.await.unwrap().expect("concurrent apply"));
    }
    ctl.delay_ms.store(0, Ordering::SeqCst);
    assert_eq!(
        total,
        report(0, 1, 3, 0),
        "exactly one concurrent rejection applied"
    );
    assert_eq!(check(y).await, Status::Rejected.as_i16());

    // A failing hook: rolled back, status unchanged, applied later.
    let calls = ctl.calls.load(Ordering::SeqCst);
    ctl.fail.store(true, Ordering::SeqCst);
    let r = store.apply_confirmations(&[rejected(z, "no")]).await;
    assert!(
        r.is_ok(),
        "a failing hook is not an error of the batch: {r:?}"
    );
    let r = r.unwrap();
    assert_eq!((r.rejected, r.failed_hooks), (0, 1), "{r:?}");
    assert_eq!(ctl.calls.load(Ordering::SeqCst), calls + 1, "the hook ran");
    assert_eq!(check(z).await, Status::Sent.as_i16(), "rolled back");
    assert!(
        fx.confirm_state(z).await.deadline_in_ms.is_some(),
        "still awaiting its confirmation, so the check-back brings it again"
    );
    ctl.fail.store(false, Ordering::SeqCst);
    let r = store
        .apply_confirmations(&[rejected(z, "no")])
        .await
        .unwrap();
    assert_eq!(r, report(0, 1, 0, 0));
    assert_eq!(check(z).await, Status::Rejected.as_i16());
    assert_eq!(ctl.calls.load(Ordering::SeqCst), calls + 2);
}

/// SENT past its deadline is checked back: PENDING, due now, `check_backs + 1`; after
/// `max_check_backs` check-backs it goes to FAILED "unconfirmed…". SENT without a deadline, and
/// SENT before its deadline, are never checked back. A late confirmation of a checked-back
/// message still confirms it.
pub async fn check_back_then_unconfirmed<F: ConfirmFixture>(fx: &F) {
    let store = fx.store();
    // Long enough that the setup below (four enqueues and relay rounds) cannot outlast it on a
    // loaded machine: at 300 ms the first "not before the deadline" check failed once in CI
    // (PostgreSQL, 2 cores, the whole suite running).
    let short = Duration::from_millis(1500);
    let ids = fx
        .enqueue_commit(vec![NewMessage::new("t", "awaiting")])
        .await
        .unwrap();
    send_all(&store, awaiting(short)).await;
    let plain = fx
        .enqueue_commit(vec![NewMessage::new("t", "plain")])
        .await
        .unwrap();
    send_all(&store, Outcome::Sent).await;
    let later = fx
        .enqueue_commit(vec![NewMessage::new("t", "later")])
        .await
        .unwrap();
    send_all(&store, awaiting(LONG)).await;
    let late = fx
        .enqueue_commit(vec![NewMessage::new("t", "late")])
        .await
        .unwrap();
    send_all(&store, awaiting(short)).await;
    // A SENT row without a deadline, made long ago: still never checked back.
    fx.backdate(plain[0], Duration::from_secs(3600)).await;

    let max = 2;
    for round in 1..=max {
        // Not before the deadline.
        assert_eq!(store.check_back(100, max).await.unwrap(), 0);
        tokio::time::sleep(short * 2).await;
        let expected = if round == 1 { 2 } else { 1 };
        assert_eq!(store.check_back(100, max).await.unwrap(), expected);
        let r = fx.row(ids[0]).await;
        assert_eq!(r.status, Status::Pending.as_i16(), "round {round}");
        assert!(r.due_in_ms <= 0, "checked back rows are due now");
        assert!(r.last_error.is_some());
        let st = fx.confirm_state(ids[0]).await;
        assert_eq!(st.check_backs, i64::from(round));
        assert!(st.deadline_in_ms.is_none());
        if round == 1 {
            // The late one was checked back in the same statement; its confirmation arrives now.
            assert_eq!(fx.row(late[0]).await.status, Status::Pending.as_i16());
            let rep = store
                .apply_confirmations(&[processed(late[0])])
                .await
                .unwrap();
            assert_eq!(
                rep.confirmed, 1,
                "a late confirmation confirms a checked-back row"
            );
            assert_eq!(fx.row(late[0]).await.status, Status::Confirmed.as_i16());
        }
        // Published again: SENT with a new deadline.
        assert_eq!(send_all(&store, awaiting(short)).await, 1);
        assert_eq!(fx.row(ids[0]).await.status, Status::Sent.as_i16());
    }
    tokio::time::sleep(short * 2).await;
    assert_eq!(store.check_back(100, max).await.unwrap(), 1);
    let r = fx.row(ids[0]).await;
    assert_eq!(r.status, Status::Failed.as_i16());
    let err = r.last_error.unwrap_or_default();
    assert!(err.starts_with("unconfirmed"), "{err}");
    assert_eq!(fx.confirm_state(ids[0]).await.check_backs, i64::from(max));
    assert_eq!(store.check_back(100, max).await.unwrap(), 0);
    assert_eq!(fx.row(plain[0]).await.status, Status::Sent.as_i16());
    assert_eq!(fx.confirm_state(plain[0]).await.check_backs, 0);
    assert_eq!(fx.row(later[0]).await.status, Status::Sent.as_i16());
    assert_eq!(fx.confirm_state(later[0]).await.check_backs, 0);
}

/// Retention deletes only old CONFIRMED and REJECTED rows (and old SENT rows that await no
/// confirmation), at most `limit` per call; never PENDING rows (one read by a relay and not
/// completed yet included), SENT awaiting confirmation or FAILED rows, and never recent
/// finished ones.
pub async fn purge_finished_only_old<F: ConfirmFixture>(fx: &F) {
    let store = fx.store();
    let mk = |p: &'static str| fx.enqueue_commit(vec![NewMessage::new("t", p)]);
    let hour = Duration::from_secs(3600);
    // CONFIRMED ×3 and REJECTED.
    let fin = fx
        .enqueue_commit(
            (0..4)
                .map(|i| NewMessage::new("t", format!("f{i}")))
                .collect(),
        )
        .await
        .unwrap();
    send_all(&store, awaiting(LONG)).await;
    let r = store
        .apply_confirmations(&[
            processed(fin[0]),
            processed(fin[1]),
            processed(fin[2]),
            rejected(fin[3], "no"),
        ])
        .await
        .unwrap();
    assert_eq!(r, report(3, 1, 0, 0));
    let plain = mk("plain").await.unwrap()[0];
    send_all(&store, Outcome::Sent).await;
    let waiting = mk("waiting").await.unwrap()[0];
    send_all(&store, awaiting(LONG)).await;
    let failed = mk("failed").await.unwrap()[0];
    complete_all(&store, |_| Outcome::Failed { reason: "x".into() }).await;
    // Read by a relay that has not completed it yet: still PENDING.
    let in_flight = mk("in flight").await.unwrap()[0];
    let mut reader = sole_relay(&store, "suite-reader", LONG).await;
    assert_eq!(reader.read(&store, 10).await.len(), 1);
    reader.leave(&store).await;
    let pending = mk("pending").await.unwrap()[0];
    let old: Vec<Uuid> = fin.iter().copied().chain([plain]).collect();
    let kept_old = [waiting, failed, in_flight, pending];
    for id in old.iter().chain(kept_old.iter()) {
        fx.backdate(*id, hour).await;
    }
    // Recent finished rows are kept.
    let fresh = mk("fresh").await.unwrap()[0];
    send_all(&store, awaiting(LONG)).await;
    store
        .apply_confirmations(&[processed(fresh)])
        .await
        .unwrap();

    let window = Duration::from_secs(600);
    let mut batches = Vec::new();
    loop {
        let n = store.purge_finished(window, 2).await.expect("purge");
        assert!(n <= 2, "purge is bounded by its limit: {n}");
        batches.push(n);
        if n < 2 {
            break;
        }
        assert!(batches.len() < 10, "purge does not end: {batches:?}");
    }
    assert_eq!(batches.iter().sum::<u64>(), old.len() as u64, "{batches:?}");
    let left: HashSet<Uuid> = fx.rows().await.iter().map(|r| r.message_id).collect();
    for id in &old {
        assert!(!left.contains(id), "old finished row {id} purged");
    }
    for id in kept_old.iter().chain([&fresh]) {
        assert!(left.contains(id), "row {id} kept");
    }
    assert_eq!(left.len(), 5);
}

/// Stats count the SENT rows awaiting confirmation and the age of the oldest of them.
pub async fn stats_show_awaiting_confirmation<F: ConfirmFixture>(fx: &F) {
    let store = fx.store();
    let st = store.stats().await.unwrap();
    assert_eq!(st.awaiting_confirmation, 0);
    assert_eq!(st.oldest_unconfirmed_age, None);
    let ids = fx
        .enqueue_commit(vec![NewMessage::new("t", "a"), NewMessage::new("t", "b")])
        .await
        .unwrap();
    send_all(&store, awaiting(LONG)).await;
    fx.enqueue_commit(vec![NewMessage::new("t", "plain")])
        .await
        .unwrap();
    send_all(&store, Outcome::Sent).await;
    fx.backdate(ids[0], Duration::from_secs(600)).await;
    let st = store.stats().await.unwrap();
    assert_eq!(st.awaiting_confirmation, 2);
    assert_eq!(st.counts[&Status::Sent], 3);
    let age = st.oldest_unconfirmed_age.expect("an age");
    assert!(
        age >= Duration::from_secs(600) && age < Duration::from_secs(660),
        "{age:?}"
    );
    store
        .apply_confirmations(&[processed(ids[0]), rejected(ids[1], "no")])
        .await
        .unwrap();
    let st = store.stats().await.unwrap();
    assert_eq!(st.awaiting_confirmation, 0);
    assert_eq!(st.oldest_unconfirmed_age, None);
    assert_eq!(st.counts[&Status::Confirmed], 1);
    assert_eq!(st.counts[&Status::Rejected], 1);
}

// ---------------------------------------------------------------------------------------------
// Bucket leases, reads without claiming, bucket-fenced completion and key heads (migration v4,
// docs/design/one-write-and-ordering.md).
// ---------------------------------------------------------------------------------------------

use std::collections::BTreeMap;

use outbox::store::{
    BUCKETS, Bucket, BucketCompletion, BucketRow, LeaseToken, MembershipRequest, MembershipRound,
};

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

/// Membership takes the fair share: all 64 buckets for a lone relay; with a second relay
/// the share is 32, the first gives its extras back (`release_buckets`) and the second takes
/// exactly those, none as a takeover. Buckets still held are renewed, never acquired twice; a
/// relay that leaves is no longer counted.
pub async fn bucket_membership_fair_share<F: StoreFixture>(fx: &F) {
    let store = fx.store();
    let mut a = BTreeMap::new();
    let r = round(&store, "relay-a", LONG, &a).await;
    assert_eq!((r.live_relays, r.fair_share), (1, u32::from(BUCKETS)));
    assert!(r.renewed.is_empty());
    assert_eq!(r.acquired.len(), usize::from(BUCKETS));
    assert!(
        r.acquired.iter().all(|l| !l.takeover),
        "free buckets are no takeover"
    );
    hold(&mut a, &r);
    assert_eq!(a.keys().copied().collect::<Vec<_>>(), all_buckets());

    // A second relay: the share halves, but every bucket is held.
    let mut b = BTreeMap::new();
    let r = round(&store, "relay-b", LONG, &b).await;
    assert_eq!((r.live_relays, r.fair_share), (2, 32));
    assert!(
        r.acquired.is_empty(),
        "held buckets are not acquired: {r:?}"
    );

    // The first relay renews all, sees the share of 32 and releases its extras.
    let r = round(&store, "relay-a", LONG, &a).await;
    assert_eq!((r.live_relays, r.fair_share), (2, 32));
    assert_eq!(r.renewed.len(), usize::from(BUCKETS));
    assert!(r.acquired.is_empty());
    let extra: Vec<(Bucket, LeaseToken)> = a.iter().skip(32).map(|(b, t)| (*b, *t)).collect();
    store
        .release_buckets("relay-a", &extra, false)
        .await
        .expect("release");
    for (bucket, _) in &extra {
        a.remove(bucket);
    }
    // The second relay takes exactly the released ones.
    let r = round(&store, "relay-b", LONG, &b).await;
    assert_eq!(r.fair_share, 32);
    assert!(
        r.acquired.iter().all(|l| !l.takeover),
        "released buckets are no takeover"
    );
    hold(&mut b, &r);
    assert_eq!(
        b.keys().copied().collect::<Vec<_>>(),
        extra.iter().map(|(b, _)| *b).collect::<Vec<_>>()
    );
    // Both renew exactly their own; tokens of buckets given away renew nothing.
    let mut stale_a = a.clone();
    stale_a.extend(extra.iter().copied());
    let r = round(&store, "relay-a", LONG, &stale_a).await;
    assert_eq!(r.renewed, a.keys().copied().collect::<Vec<_>>());
    assert!(r.acquired.is_empty());
    let r = round(&store, "relay-b", LONG, &b).await;
    assert_eq!(r.renewed, b.keys().copied().collect::<Vec<_>>());

    // Releasing with a wrong token or as another relay changes nothing.
    let (b0, t0) = b.iter().next().map(|(b, t)| (*b, *t)).unwrap();
    store
        .release_buckets("relay-b", &[(b0, t0 ^ 1)], false)
        .await
        .unwrap();
    store
        .release_buckets("relay-a", &[(b0, t0)], false)
        .await
        .unwrap();
    let r = round(&store, "relay-b", LONG, &b).await;
    assert_eq!(r.renewed.len(), 32, "a stale release gave a bucket away");

    // The second relay leaves: the first is alone again and takes the rest.
    let all_b: Vec<(Bucket, LeaseToken)> = b.iter().map(|(b, t)| (*b, *t)).collect();
    store
        .release_buckets("relay-b", &all_b, true)
        .await
        .expect("leave");
    let r = round(&store, "relay-a", LONG, &a).await;
    assert_eq!((r.live_relays, r.fair_share), (1, u32::from(BUCKETS)));
    assert_eq!(r.renewed.len(), 32);
    assert_eq!(r.acquired.len(), 32);
    assert!(r.acquired.iter().all(|l| !l.takeover));
    hold(&mut a, &r);
    assert_eq!(a.len(), usize::from(BUCKETS));
}

/// Route sets and hand-over (migration v6): every live relay's advertised routes are listed by
/// `relays` with their hash; a bucket handed over to a relay is reserved for it (a third relay
/// below its share cannot take it) and the target acquires it at its next round even at its
/// full share, as `handed_over`, not a takeover. A stale hand-over (wrong token) changes nothing.
pub async fn bucket_hand_over_and_route_sets<F: StoreFixture>(fx: &F) {
    let store = fx.store();
    let mut a = hold_all(&store, "relay-a", LONG).await;
    let mut b = BTreeMap::new();
    let r = round(&store, "relay-b", LONG, &b).await;
    assert_eq!(r.live_relays, 2);
    let relays = store.relays(LONG).await.expect("relays");
    let names: Vec<&str> = relays.iter().map(|r| r.name.as_str()).collect();
    assert_eq!(names, ["relay-a", "relay-b"]);
    assert_eq!(relays[0].routes, Some(vec!["relay-a-*".to_owned()]));
    assert_eq!(relays[1].routes, Some(vec!["relay-b-*".to_owned()]));
    assert_eq!(
        relays[0].routes_hash.as_deref(),
        Some(outbox::store::routes_hash(&["relay-a-*".to_owned()]).as_str())
    );
    assert_ne!(relays[0].routes_hash, relays[1].routes_hash);

    // relay-a keeps 32 and gives the rest back; relay-b takes them: both at their share.
    let extra: Vec<(Bucket, LeaseToken)> = a.iter().skip(32).map(|(b, t)| (*b, *t)).collect();
    store
        .release_buckets("relay-a", &extra, false)
        .await
        .unwrap();
    a.retain(|bucket, _| !extra.iter().any(|(x, _)| x == bucket));
    let r = round(&store, "relay-b", LONG, &b).await;
    hold(&mut b, &r);
    assert_eq!(b.len(), 32);

    // relay-a hands bucket `h` to relay-b; a stale hand-over (wrong token) does nothing.
    let (h, th) = a.iter().next().map(|(b, t)| (*b, *t)).unwrap();
    store
        .hand_off_buckets("relay-a", &[(h, th ^ 1)], "relay-b", LONG)
        .await
        .unwrap();
    let r = round(&store, "relay-a", LONG, &a).await;
    assert!(
        r.renewed.contains(&h),
        "a stale hand-over gave the bucket away"
    );
    store
        .hand_off_buckets("relay-a", &[(h, th)], "relay-b", LONG)
        .await
        .unwrap();
    a.remove(&h);
    // A third relay (below its share) and relay-a itself cannot take the reserved bucket.
    let c = round(&store, "relay-c", LONG, &BTreeMap::new()).await;
    assert!(
        !c.acquired.iter().any(|l| l.bucket == h),
        "a bucket handed over to relay-b was taken by relay-c: {c:?}"
    );
    let ra = round(&store, "relay-a", LONG, &a).await;
    assert!(!ra.acquired.iter().any(|l| l.bucket == h));
    // relay-b takes it at its next round although it holds its full share.
    let r = round(&store, "relay-b", LONG, &b).await;
    assert_eq!(r.handed_over, vec![h]);
    let l = r
        .acquired
        .iter()
        .find(|l| l.bucket == h)
        .expect("handed over");
    assert!(!l.takeover, "a hand-over is no takeover");
    hold(&mut b, &r);
    assert!(b.contains_key(&h));
    let r = round(&store, "relay-b", LONG, &b).await;
    assert!(r.renewed.contains(&h));
    assert!(r.handed_over.is_empty(), "a hand-over is taken once");
}

/// A relay cannot take buckets whose lease is live; once the holder's lease expired (on the
/// database clock) it takes them over (`takeover`), and the old holder's renewal and
/// completions are refused (its batch stays PENDING, untouched).
pub async fn bucket_takeover_after_expiry<F: StoreFixture>(fx: &F) {
    let store = fx.store();
    fx.enqueue_commit(vec![NewMessage::new("t", "x").with_partition_key("k")])
        .await
        .unwrap();
    // relay-a's lease outlasts relay-b's liveness window (SHORT), so once relay-a's buckets
    // expired relay-a no longer counts and relay-b's share is every bucket.
    let a = hold_all(&store, "relay-a", Duration::from_secs(1)).await;
    let rows = read_all(&store).await;
    assert_eq!(rows.len(), 1);
    let r = round(&store, "relay-b", SHORT, &BTreeMap::new()).await;
    assert!(r.acquired.is_empty(), "a live lease was taken: {r:?}");

    // Poll on the database clock: relay-b's round acquires nothing until relay-a's leases
    // expired, then (relay-a no longer live either) takes every bucket over.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let taken = loop {
        let r = round(&store, "relay-b", SHORT, &BTreeMap::new()).await;
        if !r.acquired.is_empty() {
            break r;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "relay-a's leases never expired"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(taken.live_relays, 1, "relay-a is no longer live");
    assert_eq!(taken.acquired.len(), usize::from(BUCKETS), "{taken:?}");
    assert!(taken.acquired.iter().all(|l| l.takeover), "{taken:?}");
    let mut b = BTreeMap::new();
    hold(&mut b, &taken);
    // relay-b renews for long; nothing is left to acquire.
    let r = round(&store, "relay-b", LONG, &b).await;
    assert_eq!(r.renewed.len(), usize::from(BUCKETS));
    assert!(
        r.acquired.is_empty(),
        "taken over buckets acquired twice: {r:?}"
    );
    // relay-a's tokens are stale: no renewal, no completion, not even with relay-b's token.
    let r = round(&store, "relay-a", LONG, &a).await;
    assert!(r.renewed.is_empty(), "a lost lease was renewed: {r:?}");
    assert!(r.acquired.is_empty(), "{r:?}");
    let n = store
        .complete_in_buckets("relay-a", &[done(&a, &rows[0], 1, Outcome::Sent)])
        .await
        .unwrap();
    assert_eq!(n, 0, "a stale relay's completion was applied");
    let n = store
        .complete_in_buckets("relay-a", &[done(&b, &rows[0], 1, Outcome::Sent)])
        .await
        .unwrap();
    assert_eq!(n, 0, "a relay completed a bucket it does not own");
    let r = fx.rows().await;
    assert_eq!((r[0].status, r[0].attempts), (Status::Pending.as_i16(), 0));
    // The new owner completes.
    let n = store
        .complete_in_buckets("relay-b", &[done(&b, &rows[0], 1, Outcome::Sent)])
        .await
        .unwrap();
    assert_eq!(n, 1);
    assert_eq!(fx.rows().await[0].status, Status::Sent.as_i16());
}

/// `read_buckets` returns only due PENDING rows of the given buckets, in id order within each
/// bucket, never more than `limit` (each bucket's rows a prefix of its due rows), without the
/// rows of `skip_keys`; every message of one partition key is in one bucket.
pub async fn read_buckets_due_pending_in_order<F: StoreFixture>(fx: &F) {
    let store = fx.store();
    let mut msgs = Vec::new();
    for i in 0..40 {
        msgs.push(
            NewMessage::new("t", format!("k{i}")).with_partition_key(format!("key-{}", i % 4)),
        );
        msgs.push(NewMessage::new("t", format!("n{i}")));
    }
    for i in 0..100 {
        msgs.push(NewMessage::new("t", format!("hot{i}")).with_partition_key("hot"));
    }
    let ids = fx.enqueue_commit(msgs).await.unwrap();
    let delayed = fx
        .enqueue_commit(vec![
            NewMessage::new("t", "later")
                .with_partition_key("key-0")
                .with_delay(LONG),
        ])
        .await
        .unwrap();
    // One confirmed row (no longer PENDING) is never read.
    let confirmed = ids[1];
    store
        .apply_confirmations(&[processed(confirmed)])
        .await
        .unwrap();
    let _held = hold_all(&store, "relay-a", LONG).await;

    let rows = read_all(&store).await;
    assert_eq!(rows.len(), ids.len() - 1, "every due PENDING row, once");
    let read_ids: HashSet<Uuid> = rows.iter().map(|r| r.message.message_id).collect();
    assert!(!read_ids.contains(&confirmed), "a CONFIRMED row was read");
    assert!(
        !read_ids.contains(&delayed[0]),
        "a row not yet due was read"
    );
    let mut per_bucket: BTreeMap<Bucket, Vec<i64>> = BTreeMap::new();
    let mut key_bucket: BTreeMap<String, Bucket> = BTreeMap::new();
    for r in &rows {
        assert!((0..BUCKETS as Bucket).contains(&r.bucket));
        assert_eq!(r.message.attempts, 0);
        per_bucket.entry(r.bucket).or_default().push(r.message.id);
        if let Some(k) = &r.message.partition_key {
            let b = *key_bucket.entry(k.clone()).or_insert(r.bucket);
            assert_eq!(b, r.bucket, "key {k} in two buckets");
        }
    }
    for (b, ids) in &per_bucket {
        assert!(
            ids.windows(2).all(|w| w[0] < w[1]),
            "bucket {b} out of order: {ids:?}"
        );
    }
    assert!(
        per_bucket.len() > 4,
        "messages spread over buckets: {per_bucket:?}"
    );

    // Only the given buckets.
    let hot = key_bucket["hot"];
    let only = store.read_buckets(&[hot], &[], 10_000).await.unwrap().rows;
    assert!(only.iter().all(|r| r.bucket == hot));
    assert_eq!(
        only.iter().map(|r| r.message.id).collect::<Vec<_>>(),
        per_bucket[&hot]
    );

    // A limit: each bucket's rows are a prefix of its due rows, over several rounds.
    for limit in [1, 3, 50, 150, 170] {
        let part = store
            .read_buckets(&all_buckets(), &[], limit)
            .await
            .unwrap()
            .rows;
        assert_eq!(
            part.len(),
            (limit as usize).min(rows.len()),
            "limit {limit}"
        );
        let mut got: BTreeMap<Bucket, Vec<i64>> = BTreeMap::new();
        for r in &part {
            got.entry(r.bucket).or_default().push(r.message.id);
        }
        for (b, ids) in &got {
            assert_eq!(
                ids[..],
                per_bucket[b][..ids.len()],
                "limit {limit}: bucket {b} is not a prefix"
            );
        }
    }

    // Skipped keys.
    let skip = vec!["hot".to_string(), "key-1".to_string()];
    let rest = store
        .read_buckets(&all_buckets(), &skip, 10_000)
        .await
        .unwrap()
        .rows;
    assert_eq!(rest.len(), rows.len() - 100 - 10);
    assert!(
        rest.iter()
            .all(|r| !matches!(r.message.partition_key.as_deref(), Some("hot" | "key-1")))
    );
    assert!(rest.iter().any(|r| r.message.partition_key.is_none()));
    assert!(
        store
            .read_buckets(&[], &[], 10)
            .await
            .unwrap()
            .rows
            .is_empty()
    );
}

/// `complete_in_buckets` records every outcome in one statement (SENT; Retry → PENDING later
/// with the attempts given and the error; FAILED; Release → PENDING due now), keeps the
/// verdict of a row confirmed meanwhile, and refuses (matches nothing, changes nothing) a
/// stale token or a relay that does not own the bucket.
pub async fn bucket_fenced_completion<F: StoreFixture>(fx: &F) {
    let store = fx.store();
    let ids = fx
        .enqueue_commit(
            (0..5)
                .map(|i| NewMessage::new("t", format!("{i}")))
                .collect(),
        )
        .await
        .unwrap();
    let held = hold_all(&store, "relay-a", LONG).await;
    let mut rows = read_all(&store).await;
    rows.sort_by_key(|r| r.message.id);
    assert_eq!(rows.len(), 5);
    let outcomes = vec![
        (1, Outcome::Sent),
        (
            1,
            Outcome::Retry {
                delay: Duration::from_millis(1500),
                error: "broker said no".into(),
            },
        ),
        (
            3,
            Outcome::Failed {
                reason: "too large".into(),
            },
        ),
        (
            2,
            Outcome::Release {
                delay: Duration::ZERO,
            },
        ),
        (1, Outcome::Sent),
    ];
    let comps: Vec<BucketCompletion> = rows
        .iter()
        .zip(&outcomes)
        .map(|(r, (att, o))| done(&held, r, *att, o.clone()))
        .collect();

    let snapshot = |rows: Vec<crate::RowState>| {
        rows.into_iter()
            .map(|r| crate::RowState { due_in_ms: 0, ..r })
            .collect::<Vec<_>>()
    };
    let before = snapshot(fx.rows().await);
    let stale: Vec<BucketCompletion> = comps
        .iter()
        .map(|c| BucketCompletion {
            token: c.token ^ 1,
            ..c.clone()
        })
        .collect();
    assert_eq!(
        store.complete_in_buckets("relay-a", &stale).await.unwrap(),
        0
    );
    assert_eq!(
        store.complete_in_buckets("relay-b", &comps).await.unwrap(),
        0
    );
    assert_eq!(
        snapshot(fx.rows().await),
        before,
        "a refused completion changed a row"
    );

    // The consumer's confirmation overtakes the completion of the last row.
    store
        .apply_confirmations(&[processed(rows[4].message.message_id)])
        .await
        .unwrap();
    assert_eq!(
        store.complete_in_buckets("relay-a", &comps).await.unwrap(),
        5
    );

    let r = fx.row(ids[0]).await;
    assert_eq!(
        (r.status, r.attempts, r.sent),
        (Status::Sent.as_i16(), 1, true)
    );
    let r = fx.row(ids[1]).await;
    assert_eq!((r.status, r.attempts), (Status::Pending.as_i16(), 1));
    assert_eq!(r.last_error.as_deref(), Some("broker said no"));
    assert!(
        (1000..=1600).contains(&r.due_in_ms),
        "due in {} ms",
        r.due_in_ms
    );
    let r = fx.row(ids[2]).await;
    assert_eq!((r.status, r.attempts), (Status::Failed.as_i16(), 3));
    assert_eq!(r.last_error.as_deref(), Some("too large"));
    let r = fx.row(ids[3]).await;
    assert_eq!((r.status, r.attempts), (Status::Pending.as_i16(), 2));
    assert!(r.due_in_ms <= 0, "released row is due now");
    assert!(r.last_error.is_none());
    let r = fx.row(ids[4]).await;
    assert_eq!(
        r.status,
        Status::Confirmed.as_i16(),
        "the confirmation was overwritten"
    );

    // Only the released row is due; the retried one is not yet.
    let again = read_all(&store).await;
    assert_eq!(
        again
            .iter()
            .map(|r| r.message.message_id)
            .collect::<Vec<_>>(),
        vec![ids[3]]
    );
    assert_eq!(again[0].message.attempts, 2);
    // A SENT or FAILED row is not completed again.
    assert_eq!(
        store
            .complete_in_buckets("relay-a", &comps[..3])
            .await
            .unwrap(),
        1
    );
    assert_eq!(fx.row(ids[0]).await.status, Status::Sent.as_i16());
    assert_eq!(fx.row(ids[2]).await.status, Status::Failed.as_i16());
}

/// `key_heads` gives, per key, the first id still to publish (PENDING, due or not) and the
/// first dead-lettered id; keys with neither are left out.
pub async fn key_heads_first_open_and_failed<F: StoreFixture>(fx: &F) {
    let store = fx.store();
    let ids = fx
        .enqueue_commit(vec![
            NewMessage::new("t", "a1").with_partition_key("a"),
            NewMessage::new("t", "a2").with_partition_key("a"),
            NewMessage::new("t", "b1").with_partition_key("b"),
            NewMessage::new("t", "c1").with_partition_key("c"),
            NewMessage::new("t", "a3")
                .with_partition_key("a")
                .with_delay(LONG),
        ])
        .await
        .unwrap();
    let held = hold_all(&store, "relay-a", LONG).await;
    let rows = read_all(&store).await;
    let by_mid = |id: Uuid| rows.iter().find(|r| r.message.message_id == id).unwrap();
    let comps = vec![
        done(
            &held,
            by_mid(ids[0]),
            1,
            Outcome::Failed { reason: "x".into() },
        ),
        done(&held, by_mid(ids[3]), 1, Outcome::Sent),
    ];
    assert_eq!(
        store.complete_in_buckets("relay-a", &comps).await.unwrap(),
        2
    );
    let id_of = |i: usize| {
        rows.iter()
            .find(|r| r.message.message_id == ids[i])
            .map(|r| r.message.id)
    };
    let mut heads = store
        .key_heads(&["a".into(), "b".into(), "c".into(), "none".into()])
        .await
        .unwrap();
    heads.sort_by(|x, y| x.key.cmp(&y.key));
    assert_eq!(heads.len(), 2, "{heads:?}");
    assert_eq!(heads[0].key, "a");
    assert_eq!(heads[0].first_open, id_of(1));
    assert_eq!(heads[0].first_failed, id_of(0));
    assert_eq!(heads[1].key, "b");
    assert_eq!(heads[1].first_open, id_of(2));
    assert_eq!(heads[1].first_failed, None);
    assert!(store.key_heads(&[]).await.unwrap().is_empty());
}

/// `next_due_in_buckets`: `None` without a PENDING row in the buckets, the time until the
/// earliest one is due, zero when one is due now.
pub async fn next_due_in_buckets_is_per_bucket<F: StoreFixture>(fx: &F) {
    let store = fx.store();
    assert_eq!(
        store.next_due_in_buckets(&all_buckets()).await.unwrap(),
        None
    );
    fx.enqueue_commit(vec![NewMessage::new("t", "1").with_partition_key("nd")])
        .await
        .unwrap();
    let held = hold_all(&store, "relay-a", LONG).await;
    let rows = read_all(&store).await;
    let b = rows[0].bucket;
    let other = (b + 1) % BUCKETS as Bucket;
    assert_eq!(
        store.next_due_in_buckets(&[b]).await.unwrap(),
        Some(Duration::ZERO)
    );
    assert_eq!(store.next_due_in_buckets(&[other]).await.unwrap(), None);
    let retry = Outcome::Retry {
        delay: Duration::from_millis(2000),
        error: "later".into(),
    };
    assert_eq!(
        store
            .complete_in_buckets("relay-a", &[done(&held, &rows[0], 1, retry)])
            .await
            .unwrap(),
        1
    );
    let due = store
        .next_due_in_buckets(&[other, b])
        .await
        .unwrap()
        .unwrap();
    assert!(
        due > Duration::from_millis(1000) && due <= Duration::from_millis(2000),
        "{due:?}"
    );
    assert_eq!(store.next_due_in_buckets(&[other]).await.unwrap(), None);
    fx.enqueue_commit(vec![NewMessage::new("t", "2").with_partition_key("nd")])
        .await
        .unwrap();
    assert_eq!(
        store.next_due_in_buckets(&[b]).await.unwrap(),
        Some(Duration::ZERO)
    );
}
