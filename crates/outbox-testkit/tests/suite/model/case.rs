//! One generated sequence run on one database, checked step by step against the model.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use outbox::retention::{Finished, RetentionAction};
use outbox::store::{
    BUCKETS, Bucket, BucketCompletion, KeyHead, LeaseToken, MembershipRequest, Outcome,
};
use outbox::{ConfirmReport, Confirmation, NewMessage, Status, Verdict};
use outbox_testkit::store_suite::keep_after_round;
use uuid::Uuid;

use super::db::{ModelDb, RowView};
use super::ops::{Choice, Op};
use super::state::{BucketState, Model, Relay, Row, Work};
use super::{HOUR, KEYS, LEASE, MAX_ATTEMPTS, MAX_CHECK_BACKS, NAMES};

/// Runs one sequence on one database, checking after every step.
pub(super) struct Case<'a, F> {
    pub(super) fx: &'a F,
    pub(super) model: Model,
}

impl<F: ModelDb> Case<'_, F> {
    async fn check(&self, step: usize) {
        let actual: BTreeMap<i64, RowView> = self
            .fx
            .snapshot()
            .await
            .into_iter()
            .map(|(id, (v, _))| (id, v))
            .collect();
        let expected: BTreeMap<i64, RowView> = self
            .model
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
        assert_eq!(actual, expected, "step {step}: rows differ from the model");
        let buckets = self.fx.buckets().await;
        assert_eq!(buckets.len(), usize::from(BUCKETS));
        for (b, owner, token, expired) in buckets {
            let m = self.model.buckets[&b];
            let owner = owner.map(|o| NAMES.iter().position(|n| *n == o).expect("a known relay"));
            assert_eq!(
                (owner, token),
                (m.owner, m.token),
                "step {step}: bucket {b} differs from the model"
            );
            if m.owner.is_some() {
                assert_eq!(
                    expired, m.expired,
                    "step {step}: bucket {b} expiry differs from the model"
                );
            }
        }
        // At most one relay holds a bucket's current lease: the owner.
        for (b, m) in &self.model.buckets {
            let holders: Vec<usize> = (0..2)
                .filter(|&r| {
                    self.model.relays[r].held.get(b).copied() == m.token
                        && m.token.is_some()
                        && !m.expired
                })
                .collect();
            assert!(
                holders.len() <= 1 && holders.iter().all(|r| Some(*r) == m.owner),
                "step {step}: bucket {b} held by {holders:?}, owner {:?}",
                m.owner
            );
        }
        for (id, r) in &self.model.rows {
            assert!(
                r.attempts <= MAX_ATTEMPTS + 1,
                "step {step}: row {id} took {} attempts in one round",
                r.attempts
            );
        }
    }

    /// One completion statement of relay `r`, checked against the model's fence.
    async fn complete(&mut self, r: usize, completions: &[BucketCompletion], step: usize) {
        let expected = completions
            .iter()
            .filter(|c| self.model.apply(r, c))
            .count() as u64;
        let matched = self
            .fx
            .store()
            .complete_in_buckets(NAMES[r], completions)
            .await
            .expect("complete");
        assert_eq!(matched, expected, "step {step}: fenced completion count");
    }

    /// Give back `spare` buckets of relay `r`; a stale token changes nothing.
    async fn give_back(&mut self, r: usize, spare: &[(Bucket, LeaseToken)]) {
        let relay = &mut self.model.relays[r];
        for (b, _) in spare {
            relay.held.remove(b);
            relay.suspect.remove(b);
        }
        self.fx
            .store()
            .release_buckets(NAMES[r], spare, false)
            .await
            .expect("release buckets");
        for (b, t) in spare {
            let s = self.model.buckets.get_mut(b).expect("a bucket");
            if s.owner == Some(r) && s.token == Some(*t) {
                *s = BucketState::default();
            }
        }
    }

    /// Relay `r`'s leases and heartbeat run out.
    async fn expire(&mut self, r: usize) {
        self.fx.expire(NAMES[r], LEASE * 2).await;
        for b in self.model.buckets.values_mut() {
            if b.owner == Some(r) {
                b.expired = true;
            }
        }
        self.model.relays[r].live = false;
    }

    async fn enqueue(&mut self, keys: &[Option<usize>], commit: bool, step: usize) {
        let msgs = keys
            .iter()
            .map(|k| {
                let m = NewMessage::new("t", vec![1, 2, 3]);
                match k {
                    Some(k) => m.with_partition_key(KEYS[*k]),
                    None => m,
                }
            })
            .collect();
        let ids = if commit {
            self.fx.enqueue_commit(msgs).await
        } else {
            self.fx.enqueue_rollback(msgs).await
        }
        .expect("enqueue");
        let keyed: BTreeMap<Uuid, Option<usize>> =
            ids.iter().copied().zip(keys.iter().copied()).collect();
        let mut added = BTreeSet::new();
        for (id, ((_, _, _, _, bucket), message_id)) in self.fx.snapshot().await {
            if self.model.rows.contains_key(&id) {
                continue;
            }
            assert!(commit, "step {step}: a rolled-back message is visible");
            let key = *keyed
                .get(&message_id)
                .unwrap_or_else(|| panic!("step {step}: row {id} was never enqueued"));
            added.insert(message_id);
            self.model.rows.insert(
                id,
                Row {
                    status: Status::Pending,
                    attempts: 0,
                    due: true,
                    bucket,
                    message_id,
                    key,
                    confirm: None,
                    check_backs: 0,
                    sent_at: None,
                    confirmed_at: None,
                },
            );
        }
        if commit {
            assert_eq!(
                added.len(),
                ids.len(),
                "step {step}: a committed message is missing"
            );
        }
    }

    /// A membership round of relay `r`, then (as the relay) give back what is above the fair
    /// share, buckets in flight excepted.
    async fn membership(&mut self, r: usize, step: usize) {
        let held: Vec<(Bucket, LeaseToken)> = self.model.relays[r]
            .held
            .iter()
            .map(|(b, t)| (*b, *t))
            .collect();
        let round = self
            .fx
            .store()
            .membership(&MembershipRequest {
                relay: NAMES[r].into(),
                lease: LEASE,
                held: held.clone(),
                acquire: true,
                routes: vec!["*".into()],
            })
            .await
            .expect("membership");
        let model = &mut self.model;
        model.relays[r].live = true;
        let live = model.relays.iter().filter(|x| x.live).count() as u32;
        assert_eq!(round.live_relays, live, "step {step}: live relays");
        let share = u32::from(BUCKETS).div_ceil(live);
        assert_eq!(round.fair_share, share, "step {step}: fair share");
        let renewable: Vec<Bucket> = held
            .iter()
            .filter(|(b, t)| model.fenced_ok(r, *b, *t))
            .map(|(b, _)| *b)
            .collect();
        assert_eq!(round.renewed, renewable, "step {step}: renewed buckets");
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
            "step {step}: acquired {round:?}, available {available:?}"
        );
        assert!(round.handed_over.is_empty());
        for l in &round.acquired {
            assert!(
                available.contains(&l.bucket),
                "step {step}: bucket {} granted while held",
                l.bucket
            );
            let b = model.buckets.get_mut(&l.bucket).expect("a bucket");
            assert_eq!(
                l.takeover,
                b.owner.is_some(),
                "step {step}: takeover flag of bucket {}",
                l.bucket
            );
            *b = BucketState {
                owner: Some(r),
                token: Some(l.token),
                expired: false,
            };
        }
        let relay = &mut model.relays[r];
        keep_after_round(&mut relay.held, &mut relay.suspect, &round);
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
            self.give_back(r, &spare).await;
        }
    }

    /// Relay `r` reads its held buckets not in flight (as it believes them: a stalled relay
    /// reads buckets it has lost), `held_back` keys left out.
    async fn read(&mut self, r: usize, limit: u32, held_back: &[usize], step: usize) {
        let relay = &self.model.relays[r];
        let in_flight = relay.in_flight();
        let free: Vec<Bucket> = relay
            .held
            .keys()
            .filter(|b| !in_flight.contains(b))
            .copied()
            .collect();
        let keys: Vec<String> = held_back.iter().map(|k| KEYS[*k].to_owned()).collect();
        let batch = self
            .fx
            .store()
            .read_buckets(&free, &keys, limit)
            .await
            .expect("read");
        assert!(batch.malformed.is_empty());
        let mut due: BTreeMap<Bucket, Vec<i64>> = BTreeMap::new();
        for (id, row) in &self.model.rows {
            if row.status == Status::Pending
                && row.due
                && free.contains(&row.bucket)
                && !row.key.is_some_and(|k| held_back.contains(&k))
            {
                due.entry(row.bucket).or_default().push(*id);
            }
        }
        let total: usize = due.values().map(Vec::len).sum();
        assert_eq!(
            batch.rows.len(),
            total.min(limit as usize),
            "step {step}: read size"
        );
        let mut got: BTreeMap<Bucket, Vec<i64>> = BTreeMap::new();
        for row in &batch.rows {
            let m = &self.model.rows[&row.message.id];
            assert_eq!(row.bucket, m.bucket);
            assert_eq!(row.message.attempts, m.attempts);
            assert_eq!(row.message.message_id, m.message_id);
            got.entry(row.bucket).or_default().push(row.message.id);
        }
        for (b, ids) in &got {
            let d = due.get(b).map(Vec::as_slice).unwrap_or_default();
            assert!(
                d.len() >= ids.len() && d[..ids.len()] == ids[..],
                "step {step}: bucket {b} read {ids:?}, due {d:?}"
            );
        }
        let relay = &mut self.model.relays[r];
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

    /// Relay `r` completes one of its batches as the relay does: a takeover batch records its
    /// attempt first (or dead-letters a row whose attempts are exhausted), then one completion
    /// with every row's outcome.
    async fn complete_batch(&mut self, r: usize, batch: usize, outcomes: &[Choice], step: usize) {
        let batches = &mut self.model.relays[r].batches;
        if batches.is_empty() {
            return;
        }
        let mut work = batches.remove(batch % batches.len());
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
            self.complete(r, &pre, step).await;
        }
        let completions: Vec<BucketCompletion> = work
            .iter()
            .enumerate()
            .map(|(i, w)| {
                let outcome = decided
                    .remove(&w.id)
                    .unwrap_or_else(|| outcomes[i % outcomes.len()].outcome());
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
        self.complete(r, &completions, step).await;
    }

    async fn check_back(&mut self, step: usize) {
        let moved = self
            .fx
            .store()
            .check_back(1000, MAX_CHECK_BACKS)
            .await
            .expect("check back");
        let mut expected = 0;
        for row in self.model.rows.values_mut() {
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
        assert_eq!(moved, expected, "step {step}: checked back rows");
    }

    async fn confirm(&mut self, picks: &[(usize, bool)], step: usize) {
        let mut batch = Vec::new();
        let mut expected = ConfirmReport::default();
        let epoch = self.model.epoch;
        let mut seen = BTreeSet::new();
        for (i, processed) in picks {
            let Some(id) = self.model.pick(*i) else {
                break;
            };
            if !seen.insert(id) {
                continue;
            }
            let row = self.model.rows.get_mut(&id).expect("a row");
            let verdict = if *processed {
                Verdict::Processed
            } else {
                Verdict::Rejected {
                    reason: "no".into(),
                }
            };
            if matches!(row.status, Status::Pending | Status::Sent | Status::Failed) {
                row.confirm = None;
                row.confirmed_at = Some(epoch);
                if verdict == Verdict::Processed {
                    expected.confirmed += 1;
                    row.status = Status::Confirmed;
                } else {
                    expected.rejected += 1;
                    row.status = Status::Rejected;
                }
            } else {
                expected.duplicates += 1;
            }
            batch.push(Confirmation::new(row.message_id, "c", verdict));
        }
        batch.push(Confirmation::new(Uuid::now_v7(), "c", Verdict::Processed));
        expected.unknown += 1;
        let report = self
            .fx
            .store()
            .apply_confirmations(&batch)
            .await
            .expect("apply confirmations");
        assert_eq!(report, expected, "step {step}: confirmation report");
    }

    async fn key_heads(&self, step: usize) {
        let keys: Vec<String> = KEYS.iter().map(|k| (*k).to_owned()).collect();
        let mut actual = self.fx.store().key_heads(&keys).await.expect("key heads");
        actual.sort_by(|a, b| a.key.cmp(&b.key));
        let mut expected: BTreeMap<usize, KeyHead> = BTreeMap::new();
        for (id, row) in &self.model.rows {
            let Some(k) = row.key else { continue };
            let open = matches!(row.status, Status::Pending | Status::Sending);
            let failed = row.status == Status::Failed;
            if !open && !failed {
                continue;
            }
            let head = expected.entry(k).or_insert_with(|| KeyHead {
                key: KEYS[k].to_owned(),
                first_open: None,
                first_failed: None,
            });
            let slot = if open {
                &mut head.first_open
            } else {
                &mut head.first_failed
            };
            slot.get_or_insert(*id);
        }
        let expected: Vec<KeyHead> = expected.into_values().collect();
        assert_eq!(actual, expected, "step {step}: key heads");
    }

    async fn purge(&mut self, step: usize) {
        let store = self.fx.store();
        let mut purged = 0;
        for state in [Finished::Sent, Finished::Confirmed, Finished::Rejected] {
            purged += store
                .retire(state, HOUR, RetentionAction::Delete, 500)
                .await
                .expect("retention");
        }
        let epoch = self.model.epoch;
        let aged = |t: Option<u32>| t.is_some_and(|t| t < epoch);
        let before = self.model.rows.len();
        self.model.rows.retain(|_, r| {
            let finished = match r.status {
                Status::Confirmed | Status::Rejected => aged(r.confirmed_at),
                Status::Sent => r.confirm.is_none() && aged(r.sent_at),
                _ => false,
            };
            !finished
        });
        assert_eq!(
            purged,
            (before - self.model.rows.len()) as u64,
            "step {step}: purged rows"
        );
    }

    async fn requeue(&mut self, picks: Option<&[usize]>, step: usize) {
        let ids: Option<Vec<i64>> =
            picks.map(|p| p.iter().filter_map(|i| self.model.pick(*i)).collect());
        let moved = self
            .fx
            .store()
            .requeue_failed(ids.as_deref())
            .await
            .expect("requeue");
        let mut expected = 0;
        for (id, row) in &mut self.model.rows {
            if row.status == Status::Failed && ids.as_ref().is_none_or(|ids| ids.contains(id)) {
                expected += 1;
                row.status = Status::Pending;
                row.attempts = 0;
                row.check_backs = 0;
                row.due = true;
                row.confirm = None;
            }
        }
        assert_eq!(moved, expected, "step {step}: requeued rows");
    }

    pub(super) async fn step(&mut self, op: &Op, step: usize) {
        match op {
            Op::Enqueue { keys, commit } => self.enqueue(keys, *commit, step).await,
            Op::Membership { relay } => self.membership(*relay, step).await,
            Op::Read {
                relay,
                limit,
                held_back,
            } => self.read(*relay, *limit, held_back, step).await,
            Op::Complete {
                relay,
                batch,
                outcomes,
            } => self.complete_batch(*relay, *batch, outcomes, step).await,
            Op::GiveBack { relay, mask } => {
                let r = *relay;
                let in_flight = self.model.relays[r].in_flight();
                let give: Vec<(Bucket, LeaseToken)> = self.model.relays[r]
                    .held
                    .iter()
                    .filter(|(b, _)| !in_flight.contains(b) && mask & (1 << (**b % 64)) != 0)
                    .map(|(b, t)| (*b, *t))
                    .collect();
                self.give_back(r, &give).await;
            }
            Op::Stall { relay } => self.expire(*relay).await,
            Op::Crash { relay } => {
                self.expire(*relay).await;
                self.model.relays[*relay] = Relay::default();
            }
            Op::Advance => {
                self.fx.advance(HOUR * 2).await;
                self.model.epoch += 1;
                for row in self.model.rows.values_mut() {
                    row.due = true;
                    if row.confirm.is_some() {
                        row.confirm = Some(true);
                    }
                }
            }
            Op::CheckBack => self.check_back(step).await,
            Op::Confirm { picks } => self.confirm(picks, step).await,
            Op::KeyHeads => self.key_heads(step).await,
            Op::Purge => self.purge(step).await,
            Op::Requeue { picks } => self.requeue(picks.as_deref(), step).await,
        }
        self.check(step).await;
    }
}
