//! Model-based test of the store's state machine under the protocol the relay runs (docs/design/STYLE.md
//! "Tests"; vector tests its disk buffer the same way): random sequences of enqueue with commit
//! or rollback, membership rounds of two relays, reads of the buckets each believes it holds,
//! completions of read batches with every outcome (a taken-over bucket's first batch recording
//! its attempt first, as the relay does), bucket give-backs (current and stale tokens), relays
//! that stall past their lease and relays that crash, checked after every step against a model.
//!
//! Invariants: nothing committed is lost, nothing rolled back is ever visible, a relay reads only
//! due PENDING rows of the buckets it asks for (each bucket's rows a prefix of its due rows), at
//! most one relay holds a bucket's current lease, a membership round renews exactly the live
//! leases a relay still owns and grants only free or expired buckets up to the fair share (a
//! takeover exactly for an expired owned one), a completion applies only under the bucket's
//! current, unexpired lease (no stale write), and every row and bucket is in exactly the state the
//! protocol says.
//!
//! Confirmations are part of the model: SENT with a confirmation deadline, check-back of expired
//! deadlines (back to PENDING, then FAILED `unconfirmed`), and consumer confirmations (processed
//! or rejected, duplicates and unknown ids), also overtaking a completion.
//!
//! Lease expiry is made by moving a relay's bucket leases and heartbeat into the past in the
//! database (what time does to a relay that stopped renewing), so every step's outcome is
//! determined. Runs on SQLite (a temp file); the conformance suite in `outbox-testkit` covers
//! PostgreSQL and MySQL/MariaDB.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use outbox::store::{BUCKETS, Bucket, BucketCompletion, LeaseToken, MembershipRequest, Outcome};
use outbox::{NewMessage, SqliteStore, Status, Store, StoreOptions};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

#[derive(Debug, Clone, PartialEq)]
struct Row {
    status: Status,
    attempts: u32,
    due: bool,
    bucket: Bucket,
    message_id: uuid::Uuid,
    /// `Some(expired)` while SENT awaiting a confirmation.
    confirm: Option<bool>,
    check_backs: u32,
}

/// A bucket as the database holds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
struct BucketState {
    owner: Option<usize>,
    token: Option<LeaseToken>,
    expired: bool,
}

/// One message of a batch read by a relay (relay.rs `Work`).
#[derive(Debug, Clone)]
struct Work {
    id: i64,
    bucket: Bucket,
    token: LeaseToken,
    stored_attempts: u32,
    counted: bool,
}

/// What a relay believes (relay.rs `Ownership`), and its batches read but not completed.
#[derive(Debug, Default)]
struct Relay {
    held: BTreeMap<Bucket, LeaseToken>,
    suspect: BTreeSet<Bucket>,
    batches: Vec<Vec<Work>>,
    /// Its heartbeat is within the liveness window.
    live: bool,
}

impl Relay {
    fn in_flight(&self) -> BTreeSet<Bucket> {
        self.batches.iter().flatten().map(|w| w.bucket).collect()
    }
}

const MAX_ATTEMPTS: u32 = 3;
const MAX_CHECK_BACKS: u32 = 2;
const LEASE: Duration = Duration::from_secs(3600);
const NAMES: [&str; 2] = ["relay-a", "relay-b"];

struct Model {
    rows: BTreeMap<i64, Row>,
    buckets: BTreeMap<Bucket, BucketState>,
    relays: [Relay; 2],
}

impl Model {
    /// Whether a completion by `relay` under `token` for `bucket` passes the fence.
    fn fenced_ok(&self, relay: usize, bucket: Bucket, token: LeaseToken) -> bool {
        let b = self.buckets[&bucket];
        b.owner == Some(relay) && b.token == Some(token) && !b.expired
    }

    /// Apply one completion to the model; whether it matches a row.
    fn apply(&mut self, relay: usize, c: &BucketCompletion) -> bool {
        if !self.fenced_ok(relay, c.bucket, c.token) {
            return false;
        }
        let r = self.rows.get_mut(&c.id).unwrap();
        match r.status {
            // Confirmed or rejected meanwhile: matched, verdict kept.
            Status::Confirmed | Status::Rejected => true,
            Status::Pending => {
                r.attempts = c.attempts;
                match &c.outcome {
                    Outcome::Sent => r.status = Status::Sent,
                    Outcome::SentAwaitingConfirmation { within } => {
                        r.status = Status::Sent;
                        r.confirm = Some(*within < Duration::from_secs(1));
                    }
                    Outcome::Retry { delay, .. } | Outcome::Release { delay } => {
                        r.due = delay.is_zero();
                    }
                    Outcome::Failed { .. } => r.status = Status::Failed,
                }
                true
            }
            _ => false,
        }
    }
}

async fn check(store: &SqliteStore, model: &Model, step: usize, seed: u64) {
    type State = (Status, u32, u32, bool, Bucket);
    let rows: Vec<(i64, i64, i64, i64, bool, i64)> = sqlx::query_as(
        "SELECT id, status, attempts, check_backs, confirm_deadline IS NOT NULL, bucket \
         FROM outbox ORDER BY id",
    )
    .fetch_all(store.pool())
    .await
    .unwrap();
    let actual: BTreeMap<i64, State> = rows
        .into_iter()
        .map(|(id, s, a, c, d, b)| {
            (
                id,
                (
                    Status::from_i16(s as i16).unwrap(),
                    a as u32,
                    c as u32,
                    d,
                    b as Bucket,
                ),
            )
        })
        .collect();
    let expected: BTreeMap<i64, State> = model
        .rows
        .iter()
        .map(|(id, r)| {
            (
                *id,
                (
                    r.status,
                    r.attempts,
                    r.check_backs,
                    r.confirm.is_some(),
                    r.bucket,
                ),
            )
        })
        .collect();
    assert_eq!(
        actual, expected,
        "seed {seed} step {step}: rows differ from the model"
    );
    let buckets: Vec<(i64, Option<String>, Option<i64>, bool)> = sqlx::query_as(
        "SELECT bucket, owner, token, expires_at <= CAST(ROUND((julianday('now') - 2440587.5) * 86400000) AS INTEGER) \
         FROM outbox_buckets ORDER BY bucket",
    )
    .fetch_all(store.pool())
    .await
    .unwrap();
    assert_eq!(buckets.len(), usize::from(BUCKETS));
    for (b, owner, token, expired) in buckets {
        let m = model.buckets[&(b as Bucket)];
        let owner = owner.map(|o| NAMES.iter().position(|n| *n == o).expect("a known relay"));
        assert_eq!(
            (owner, token),
            (m.owner, m.token),
            "seed {seed} step {step}: bucket {b} differs from the model"
        );
        if m.owner.is_some() {
            assert_eq!(
                expired, m.expired,
                "seed {seed} step {step}: bucket {b} expiry differs from the model"
            );
        }
    }
    // At most one relay holds a bucket's current lease: the owner.
    for (b, m) in &model.buckets {
        let holders: Vec<usize> = (0..2)
            .filter(|&r| {
                model.relays[r].held.get(b).copied() == m.token && m.token.is_some() && !m.expired
            })
            .collect();
        assert!(
            holders.len() <= 1 && holders.iter().all(|r| Some(*r) == m.owner),
            "seed {seed} step {step}: bucket {b} held by {holders:?}, owner {:?}",
            m.owner
        );
    }
}

/// Move relay `r`'s bucket leases and heartbeat two leases into the past: the state a relay
/// that stopped renewing is in once its lease ran out.
async fn expire(store: &SqliteStore, model: &mut Model, r: usize) {
    let past = i64::try_from(LEASE.as_millis()).unwrap() * 2;
    sqlx::query("UPDATE outbox_buckets SET expires_at = expires_at - ?1 WHERE owner = ?2")
        .bind(past)
        .bind(NAMES[r])
        .execute(store.pool())
        .await
        .unwrap();
    sqlx::query("UPDATE outbox_relays SET heartbeat_at = heartbeat_at - ?1 WHERE name = ?2")
        .bind(past)
        .bind(NAMES[r])
        .execute(store.pool())
        .await
        .unwrap();
    for b in model.buckets.values_mut() {
        if b.owner == Some(r) {
            b.expired = true;
        }
    }
    model.relays[r].live = false;
}

/// One completion statement of relay `r`, checked against the model's fence.
async fn complete(
    store: &SqliteStore,
    model: &mut Model,
    r: usize,
    completions: &[BucketCompletion],
    step: usize,
    seed: u64,
) {
    let expected = completions.iter().filter(|c| model.apply(r, c)).count() as u64;
    let matched = store
        .complete_in_buckets(NAMES[r], completions)
        .await
        .unwrap();
    assert_eq!(
        matched, expected,
        "seed {seed} step {step}: fenced completion count"
    );
}

fn random_outcome(rng: &mut StdRng) -> Outcome {
    match rng.random_range(0..5) {
        0 => Outcome::Sent,
        1 => Outcome::SentAwaitingConfirmation {
            within: if rng.random_bool(0.5) {
                Duration::from_millis(1)
            } else {
                Duration::from_secs(3600)
            },
        },
        2 => Outcome::Retry {
            delay: if rng.random_bool(0.5) {
                Duration::ZERO
            } else {
                Duration::from_secs(3600)
            },
            error: "boom".into(),
        },
        3 => Outcome::Failed {
            reason: "poison".into(),
        },
        _ => Outcome::Release {
            delay: Duration::ZERO,
        },
    }
}

async fn run(seed: u64, steps: usize) {
    let mut rng = StdRng::seed_from_u64(seed);
    let dir = std::env::temp_dir().join(format!("outbox-model-{seed}-{}", rand::random::<u32>()));
    std::fs::create_dir_all(&dir).unwrap();
    let url = format!("sqlite://{}", dir.join("model.db").display());
    let store = SqliteStore::connect(&url, StoreOptions::default())
        .await
        .unwrap();
    store.migrate().await.unwrap();
    let mut model = Model {
        rows: BTreeMap::new(),
        buckets: (0..BUCKETS as Bucket)
            .map(|b| (b, BucketState::default()))
            .collect(),
        relays: Default::default(),
    };

    for step in 0..steps {
        let r = rng.random_range(0..2usize);
        match rng.random_range(0..100) {
            // Enqueue 1..4 messages in one transaction (some with a partition key), commit or
            // roll back.
            0..=19 => {
                let n = rng.random_range(1..=4);
                let commit = rng.random_bool(0.7);
                let mut tx = store.pool().begin().await.unwrap();
                for _ in 0..n {
                    let mut m = NewMessage::new("t", vec![1, 2, 3]);
                    if rng.random_bool(0.5) {
                        m = m.with_partition_key(format!("k{}", rng.random_range(0..4)));
                    }
                    store.enqueue(&mut tx, m).await.unwrap();
                }
                if commit {
                    tx.commit().await.unwrap();
                } else {
                    tx.rollback().await.unwrap();
                }
                let ids: Vec<(i64, String, i64)> =
                    sqlx::query_as("SELECT id, message_id, bucket FROM outbox ORDER BY id")
                        .fetch_all(store.pool())
                        .await
                        .unwrap();
                for (id, message_id, bucket) in ids {
                    if let std::collections::btree_map::Entry::Vacant(e) = model.rows.entry(id) {
                        assert!(
                            commit,
                            "seed {seed} step {step}: a rolled-back message is visible"
                        );
                        e.insert(Row {
                            status: Status::Pending,
                            attempts: 0,
                            due: true,
                            bucket: bucket as Bucket,
                            message_id: message_id.parse().unwrap(),
                            confirm: None,
                            check_backs: 0,
                        });
                    }
                }
            }
            // A membership round of relay r, then (as the relay) give back what is above the
            // fair share, buckets in flight excepted.
            20..=34 => {
                let held: Vec<(Bucket, LeaseToken)> =
                    model.relays[r].held.iter().map(|(b, t)| (*b, *t)).collect();
                let round = store
                    .membership(&MembershipRequest {
                        relay: NAMES[r].into(),
                        lease: LEASE,
                        held: held.clone(),
                        acquire: true,
                        routes: vec!["*".into()],
                    })
                    .await
                    .unwrap();
                model.relays[r].live = true;
                let live = model.relays.iter().filter(|x| x.live).count() as u32;
                assert_eq!(round.live_relays, live, "seed {seed} step {step}: live");
                let share = u32::from(BUCKETS).div_ceil(live);
                assert_eq!(round.fair_share, share, "seed {seed} step {step}: share");
                let renewable: Vec<Bucket> = held
                    .iter()
                    .filter(|(b, t)| model.fenced_ok(r, *b, *t))
                    .map(|(b, _)| *b)
                    .collect();
                assert_eq!(
                    round.renewed, renewable,
                    "seed {seed} step {step}: renewed buckets"
                );
                let available: BTreeSet<Bucket> = model
                    .buckets
                    .iter()
                    .filter(|(_, s)| s.owner.is_none() || s.expired)
                    .map(|(b, _)| *b)
                    .collect();
                let need = (share as usize).saturating_sub(renewable.len());
                assert_eq!(
                    round.acquired.len(),
                    need.min(available.len()),
                    "seed {seed} step {step}: acquired {round:?}, available {available:?}"
                );
                assert!(round.handed_over.is_empty());
                for l in &round.acquired {
                    assert!(
                        available.contains(&l.bucket),
                        "seed {seed} step {step}: bucket {} granted while held",
                        l.bucket
                    );
                    let b = model.buckets.get_mut(&l.bucket).unwrap();
                    assert_eq!(
                        l.takeover,
                        b.owner.is_some(),
                        "seed {seed} step {step}: takeover flag of bucket {}",
                        l.bucket
                    );
                    *b = BucketState {
                        owner: Some(r),
                        token: Some(l.token),
                        expired: false,
                    };
                }
                let relay = &mut model.relays[r];
                relay.held.retain(|b, _| round.renewed.contains(b));
                relay.suspect.retain(|b| round.renewed.contains(b));
                for l in &round.acquired {
                    relay.held.insert(l.bucket, l.token);
                    if l.takeover {
                        relay.suspect.insert(l.bucket);
                    }
                }
                let in_flight = relay.in_flight();
                let excess = relay.held.len().saturating_sub(share as usize);
                let spare: Vec<(Bucket, LeaseToken)> = relay
                    .held
                    .iter()
                    .rev()
                    .filter(|(b, _)| !in_flight.contains(b))
                    .take(excess)
                    .map(|(b, t)| (*b, *t))
                    .collect();
                if !spare.is_empty() {
                    for (b, _) in &spare {
                        relay.held.remove(b);
                        relay.suspect.remove(b);
                    }
                    store
                        .release_buckets(NAMES[r], &spare, false)
                        .await
                        .unwrap();
                    for (b, t) in &spare {
                        let s = model.buckets.get_mut(b).unwrap();
                        if s.owner == Some(r) && s.token == Some(*t) {
                            *s = BucketState::default();
                        }
                    }
                }
            }
            // Relay r reads its held buckets not in flight (as it believes them: a stalled relay
            // reads buckets it has lost).
            35..=54 => {
                let relay = &model.relays[r];
                let in_flight = relay.in_flight();
                let free: Vec<Bucket> = relay
                    .held
                    .keys()
                    .filter(|b| !in_flight.contains(b))
                    .copied()
                    .collect();
                let limit = rng.random_range(1..=6u32);
                let batch = store.read_buckets(&free, &[], limit).await.unwrap();
                assert!(batch.malformed.is_empty());
                let mut due: BTreeMap<Bucket, Vec<i64>> = BTreeMap::new();
                for (id, row) in &model.rows {
                    if row.status == Status::Pending && row.due && free.contains(&row.bucket) {
                        due.entry(row.bucket).or_default().push(*id);
                    }
                }
                let total: usize = due.values().map(Vec::len).sum();
                assert_eq!(
                    batch.rows.len(),
                    total.min(limit as usize),
                    "seed {seed} step {step}: read size"
                );
                let mut got: BTreeMap<Bucket, Vec<i64>> = BTreeMap::new();
                for row in &batch.rows {
                    let m = &model.rows[&row.message.id];
                    assert_eq!(row.bucket, m.bucket);
                    assert_eq!(row.message.attempts, m.attempts);
                    assert_eq!(row.message.message_id, m.message_id);
                    got.entry(row.bucket).or_default().push(row.message.id);
                }
                for (b, ids) in &got {
                    let d = due.get(b).map(Vec::as_slice).unwrap_or_default();
                    assert!(
                        d.len() >= ids.len() && d[..ids.len()] == ids[..],
                        "seed {seed} step {step}: bucket {b} read {ids:?}, due {d:?}"
                    );
                }
                let relay = &mut model.relays[r];
                let suspects: BTreeSet<Bucket> = got
                    .keys()
                    .filter(|b| relay.suspect.contains(b))
                    .copied()
                    .collect();
                relay.suspect.retain(|b| !suspects.contains(b));
                if !batch.rows.is_empty() {
                    let work = batch
                        .rows
                        .iter()
                        .map(|row| Work {
                            id: row.message.id,
                            bucket: row.bucket,
                            token: relay.held[&row.bucket],
                            stored_attempts: row.message.attempts,
                            counted: suspects.contains(&row.bucket),
                        })
                        .collect();
                    relay.batches.push(work);
                }
            }
            // Relay r completes one of its batches as the relay does: a takeover batch records
            // its attempt first (or dead-letters a row whose attempts are exhausted), then one
            // completion with every row's outcome.
            55..=74 if !model.relays[r].batches.is_empty() => {
                let i = rng.random_range(0..model.relays[r].batches.len());
                let mut work = model.relays[r].batches.remove(i);
                let mut decided: BTreeMap<i64, Outcome> = BTreeMap::new();
                let mut pre = Vec::new();
                for w in work.iter_mut().filter(|w| w.counted) {
                    if w.stored_attempts + 1 > MAX_ATTEMPTS {
                        decided.insert(
                            w.id,
                            Outcome::Failed {
                                reason: format!(
                                    "relay stopped while publishing it ({} attempts)",
                                    w.stored_attempts
                                ),
                            },
                        );
                    } else {
                        w.stored_attempts += 1;
                        pre.push(BucketCompletion {
                            id: w.id,
                            bucket: w.bucket,
                            token: w.token,
                            attempts: w.stored_attempts,
                            outcome: Outcome::Release {
                                delay: Duration::ZERO,
                            },
                        });
                    }
                }
                if !pre.is_empty() {
                    complete(&store, &mut model, r, &pre, step, seed).await;
                }
                let completions: Vec<BucketCompletion> = work
                    .iter()
                    .map(|w| {
                        let outcome = decided
                            .remove(&w.id)
                            .unwrap_or_else(|| random_outcome(&mut rng));
                        let attempt = if w.counted {
                            w.stored_attempts
                        } else {
                            w.stored_attempts + 1
                        };
                        BucketCompletion {
                            id: w.id,
                            bucket: w.bucket,
                            token: w.token,
                            attempts: match outcome {
                                Outcome::Release { .. } => w.stored_attempts,
                                _ => attempt,
                            },
                            outcome,
                        }
                    })
                    .collect();
                complete(&store, &mut model, r, &completions, step, seed).await;
            }
            // Relay r gives some held buckets back (not in flight), as after a rebalance; its
            // tokens may be stale (a bucket it lost): those change nothing.
            75..=79 => {
                let relay = &mut model.relays[r];
                let in_flight = relay.in_flight();
                let give: Vec<(Bucket, LeaseToken)> = relay
                    .held
                    .iter()
                    .filter(|(b, _)| !in_flight.contains(b))
                    .filter(|_| rng.random_bool(0.3))
                    .map(|(b, t)| (*b, *t))
                    .collect();
                for (b, _) in &give {
                    relay.held.remove(b);
                    relay.suspect.remove(b);
                }
                store.release_buckets(NAMES[r], &give, false).await.unwrap();
                for (b, t) in &give {
                    let s = model.buckets.get_mut(b).unwrap();
                    if s.owner == Some(r) && s.token == Some(*t) {
                        *s = BucketState::default();
                    }
                }
            }
            // Relay r stalls past its lease: its leases expire, it keeps believing it holds
            // them, and its batches are still to complete (their completions are refused).
            80..=83 => expire(&store, &mut model, r).await,
            // Relay r crashes: its batches are lost, its leases expire, and it restarts with
            // the same name, holding nothing.
            84..=85 => {
                expire(&store, &mut model, r).await;
                model.relays[r] = Relay::default();
            }
            // Let short confirmation deadlines pass, then check back.
            86..=91 => {
                tokio::time::sleep(Duration::from_millis(3)).await;
                let moved = store.check_back(1000, MAX_CHECK_BACKS).await.unwrap();
                let mut expected = 0;
                for row in model.rows.values_mut() {
                    if row.status == Status::Sent && row.confirm == Some(true) {
                        expected += 1;
                        row.confirm = None;
                        row.due = true;
                        if row.check_backs >= MAX_CHECK_BACKS {
                            row.status = Status::Failed;
                        } else {
                            // A new round of attempts (docs/lease-model.md, D2).
                            row.status = Status::Pending;
                            row.check_backs += 1;
                            row.attempts = 0;
                        }
                    }
                }
                assert_eq!(
                    moved, expected,
                    "seed {seed} step {step}: checked back rows"
                );
            }
            // Consumer confirmations for random messages (any state), plus an unknown id.
            _ => {
                let mut batch = Vec::new();
                let mut expected = outbox::ConfirmReport::default();
                for row in model.rows.values_mut() {
                    if !rng.random_bool(0.2) {
                        continue;
                    }
                    let verdict = if rng.random_bool(0.7) {
                        outbox::Verdict::Processed
                    } else {
                        outbox::Verdict::Rejected {
                            reason: "no".into(),
                        }
                    };
                    if matches!(row.status, Status::Pending | Status::Sent | Status::Failed) {
                        row.confirm = None;
                        if verdict == outbox::Verdict::Processed {
                            expected.confirmed += 1;
                            row.status = Status::Confirmed;
                        } else {
                            expected.rejected += 1;
                            row.status = Status::Rejected;
                        }
                    } else {
                        expected.duplicates += 1;
                    }
                    batch.push(outbox::Confirmation {
                        message_id: row.message_id,
                        consumer: "c".into(),
                        verdict,
                    });
                }
                batch.push(outbox::Confirmation {
                    message_id: uuid::Uuid::now_v7(),
                    consumer: "c".into(),
                    verdict: outbox::Verdict::Processed,
                });
                expected.unknown += 1;
                let report = store.apply_confirmations(&batch).await.unwrap();
                assert_eq!(
                    report, expected,
                    "seed {seed} step {step}: confirmation report"
                );
            }
        }
        check(&store, &model, step, seed).await;
    }
    // Nothing lost: every committed message is in the table, in a state the model explains.
    assert!(
        model.rows.values().all(|r| r.status != Status::Sending),
        "seed {seed}: no relay of this protocol writes SENDING"
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test]
async fn store_state_machine_matches_the_model() {
    for seed in 0..12 {
        run(seed, 200).await;
    }
}
