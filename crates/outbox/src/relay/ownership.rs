//! The buckets this relay holds, which of them are in a batch, and turning a read into work.

use super::*;

#[derive(Debug, Clone, Copy)]
pub(super) struct Held {
    pub(super) token: LeaseToken,
    /// Local estimate of the lease end: the start of the round that renewed it + lease.
    pub(super) valid_until: Instant,
    /// Taken over from an expired lease and not read since: the first batch records an
    /// attempt before publishing (crash-loop protection).
    pub(super) suspect: bool,
    /// Handed over by a relay that could not route some of its messages: until this time (one
    /// lease after the hand-over) the bucket is not given back above the fair share, so this
    /// relay publishes its messages before it can bounce back to the relay that gave it.
    pub(super) handed_until: Option<Instant>,
}

#[derive(Debug, Default)]
pub(super) struct Ownership {
    pub(super) held: BTreeMap<Bucket, Held>,
    /// Buckets in a batch in flight, with the time the batch was read.
    pub(super) in_flight: BTreeMap<Bucket, Instant>,
    /// Buckets whose last batch panicked, with the panic message (the dead-letter reason of a
    /// row that reaches `max_attempts` this way).
    pub(super) panicked: BTreeMap<Bucket, String>,
    pub(super) fair_share: u32,
    /// Rotates the bucket order of reads so no bucket is always read first.
    pub(super) rotate: usize,
}

/// Takes a batch's buckets out of `in_flight` when the batch ends, however it ends.
pub(super) struct InFlight<'a> {
    pub(super) relay: &'a Relay,
    pub(super) buckets: &'a BTreeSet<Bucket>,
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        let inner = &self.relay.inner;
        let mut own = inner
            .ownership
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for b in self.buckets {
            own.in_flight.remove(b);
        }
        drop(own);
        inner.changed.notify_one();
    }
}

/// What one membership round changed ([`Ownership::apply_round`]).
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct RoundChange {
    /// Held buckets the round did not renew: taken over by another relay.
    pub(super) lost: Vec<Bucket>,
    /// Buckets acquired: `(bucket, taken over from an expired lease, handed over)`.
    pub(super) acquired: Vec<(Bucket, bool, bool)>,
    /// Buckets are usable that were not before (acquired, or renewed after a refused
    /// completion suspended them): the reader may have work.
    pub(super) usable: bool,
    /// Fewer buckets held than the fair share: the next round comes sooner.
    pub(super) below_share: bool,
    /// Buckets above the fair share to give back, already removed from `held`.
    pub(super) release: Vec<(Bucket, LeaseToken)>,
}

/// How many of `free` buckets one read takes while a backlog lasts (the last read filled a
/// whole batch) and `lanes` batches may still start: an even share, rounded up, so the free
/// lanes read disjoint buckets and one batch's publish and completion overlap the next one's
/// read. Without the split the first read takes a row from nearly every bucket (a batch of
/// 500 rows over 64 buckets) and the second lane finds none free (docs/benchmarks.md, "Lanes").
pub(super) fn lane_share(free: usize, lanes: usize) -> usize {
    free.div_ceil(lanes.max(1))
}

impl Ownership {
    /// Held buckets not in flight and not being handed over (`handing_over`) whose lease outlasts
    /// `horizon` (now + `publish_timeout`), rotated by one more place at each call so no bucket
    /// is always read first.
    pub(super) fn free(
        &mut self,
        horizon: Instant,
        handing_over: &BTreeMap<Bucket, String>,
    ) -> Vec<Bucket> {
        let mut free: Vec<Bucket> = self
            .held
            .iter()
            .filter(|(b, h)| {
                h.valid_until > horizon
                    && !self.in_flight.contains_key(b)
                    && !handing_over.contains_key(b)
            })
            .map(|(b, _)| *b)
            .collect();
        if !free.is_empty() {
            self.rotate = self.rotate.wrapping_add(1);
            let k = self.rotate % free.len();
            free.rotate_left(k);
        }
        free
    }

    /// Apply a membership round started at `started` for the leases `sent` (what the request
    /// carried): renewed leases are valid until `started + lease`; a sent lease not renewed and
    /// still held with the same token is lost; acquired leases are added (suspect when taken
    /// over, kept above the share for one lease when handed over); then the buckets above the
    /// fair share that are not in flight and not recently handed over are taken out to be given
    /// back, the highest first. `now` is the time the answer arrived.
    pub(super) fn apply_round(
        &mut self,
        sent: &[(Bucket, LeaseToken)],
        round: &MembershipRound,
        started: Instant,
        now: Instant,
        lease: Duration,
        publish_timeout: Duration,
    ) -> RoundChange {
        let valid_until = started + lease;
        let mut change = RoundChange {
            usable: !round.acquired.is_empty(),
            ..RoundChange::default()
        };
        let renewed: BTreeSet<Bucket> = round.renewed.iter().copied().collect();
        for (b, token) in sent {
            if renewed.contains(b) {
                if let Some(h) = self.held.get_mut(b) {
                    // A bucket suspended after a refused completion is usable again.
                    change.usable |= h.valid_until <= now + publish_timeout;
                    h.valid_until = valid_until;
                }
            } else if self.held.get(b).is_some_and(|h| h.token == *token) {
                self.held.remove(b);
                change.lost.push(*b);
            }
        }
        for l in &round.acquired {
            let handed = round.handed_over.contains(&l.bucket);
            self.held.insert(
                l.bucket,
                Held {
                    token: l.token,
                    valid_until,
                    suspect: l.takeover,
                    handed_until: handed.then(|| started + lease),
                },
            );
            change.acquired.push((l.bucket, l.takeover, handed));
        }
        self.fair_share = round.fair_share;
        let share = round.fair_share as usize;
        change.below_share = self.held.len() < share;
        let excess = self.held.len().saturating_sub(share);
        if excess > 0 {
            let spare: Vec<(Bucket, LeaseToken)> = self
                .held
                .iter()
                .rev()
                .filter(|(b, h)| {
                    !self.in_flight.contains_key(b) && h.handed_until.is_none_or(|t| t <= now)
                })
                .take(excess)
                .map(|(b, h)| (*b, h.token))
                .collect();
            for (b, _) in &spare {
                self.held.remove(b);
            }
            change.release = spare;
        }
        change
    }

    /// Whether every `(bucket, token)` is still held with that token beyond `horizon`.
    pub(super) fn fresh(
        &self,
        leases: impl IntoIterator<Item = (Bucket, LeaseToken)>,
        horizon: Instant,
    ) -> bool {
        leases.into_iter().all(|(b, token)| {
            self.held
                .get(&b)
                .is_some_and(|h| h.token == token && h.valid_until > horizon)
        })
    }
}

impl Relay {
    /// Held buckets not in flight whose lease outlasts a publish, in rotated order.
    pub(super) fn free_buckets(&self) -> Vec<(Bucket, LeaseToken)> {
        let mut own = self.inner.ownership.lock().expect("ownership lock");
        let horizon = Instant::now() + self.inner.config.publish_timeout;
        // A bucket about to be handed over to another relay is not read again.
        let handoffs = self.inner.handoffs.lock().expect("handoffs lock");
        let free = own.free(horizon, &handoffs);
        free.into_iter().map(|b| (b, own.held[&b].token)).collect()
    }

    /// Every held bucket whose lease outlasts `horizon`, with its token (in flight or not):
    /// the check-back of prepared messages writes only rows of these, fenced by the token.
    pub(super) fn held_leases(&self, horizon: Instant) -> Vec<(Bucket, LeaseToken)> {
        let own = self.inner.ownership.lock().expect("ownership lock");
        own.held
            .iter()
            .filter(|(_, h)| h.valid_until > horizon)
            .map(|(b, h)| (*b, h.token))
            .collect()
    }

    /// Mark the buckets of a read batch in flight and turn it into work ([`Ownership::take`]);
    /// `None` when every bucket of it was lost meanwhile.
    pub(super) fn take_batch(
        &self,
        batch: BucketBatch,
        read: &[(Bucket, LeaseToken)],
        read_at: Instant,
    ) -> Option<Vec<Work>> {
        let mut own = self.inner.ownership.lock().expect("ownership lock");
        let work = own.take(batch, read, read_at, self.inner.config.max_attempts);
        if work.is_empty() { None } else { Some(work) }
    }
}

impl Ownership {
    /// Mark the buckets of a read batch in flight and turn it into work. `read` holds the
    /// buckets read with the token each was held with when the read started: a row of a bucket no longer held with that token is
    /// dropped (the membership task runs while the read is in flight; a bucket lost and
    /// acquired again has a new token, and rows read under the old lease must not pass the new
    /// lease's fence: docs/lease-model.md, D3). A dropped row stays PENDING and is read again.
    pub(super) fn take(
        &mut self,
        batch: BucketBatch,
        read: &[(Bucket, LeaseToken)],
        read_at: Instant,
        max_attempts: u32,
    ) -> Vec<Work> {
        let own = self;
        let mut work = Vec::with_capacity(batch.rows.len() + batch.malformed.len());
        let mut suspects = BTreeSet::new();
        let read: BTreeMap<Bucket, LeaseToken> = read.iter().copied().collect();
        let mut push = |own: &mut Ownership,
                        bucket: Bucket,
                        message: Message,
                        due_age: Option<Duration>,
                        outcome| {
            let Some(h) = own.held.get(&bucket).copied() else {
                return;
            };
            if read.get(&bucket) != Some(&h.token) {
                return;
            }
            own.in_flight.insert(bucket, read_at);
            if h.suspect {
                suspects.insert(bucket);
            }
            let stored_attempts = message.attempts;
            work.push(Work {
                bucket,
                token: h.token,
                message,
                route: None,
                stored_attempts,
                counted: false,
                due_age,
                outcome,
            });
        };
        for row in batch.rows {
            let mut m = row.message;
            if m.max_attempts == 0 {
                m.max_attempts = max_attempts;
            }
            push(own, row.bucket, m, row.due_age, None);
        }
        for (bucket, id, reason) in batch.malformed {
            let m = Message {
                id,
                message_id: uuid::Uuid::nil(),
                topic: String::new(),
                partition_key: None,
                headers: Default::default(),
                payload: Vec::new(),
                attempts: 0,
                max_attempts,
                redelivery: 0,
            };
            let outcome = Outcome::Failed {
                reason: format!("malformed row: {reason}"),
            };
            push(own, bucket, m, None, Some(outcome));
        }
        // The first batch of a taken-over bucket is the one that records its attempt.
        for b in &suspects {
            if let Some(h) = own.held.get_mut(b) {
                h.suspect = false;
            }
        }
        for w in &mut work {
            w.counted = suspects.contains(&w.bucket) && w.outcome.is_none();
        }
        work
    }
}

impl Relay {
    /// Whether every bucket of `work` is still held with its token for longer than a publish.
    pub(super) fn leases_fresh(&self, work: &[Work]) -> bool {
        let own = self.inner.ownership.lock().expect("ownership lock");
        let horizon = Instant::now() + self.inner.config.publish_timeout;
        own.fresh(work.iter().map(|w| (w.bucket, w.token)), horizon)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::BucketLease;

    const LEASE: Duration = Duration::from_secs(30);
    const PUBLISH: Duration = Duration::from_secs(5);

    fn token(n: u8) -> LeaseToken {
        LeaseToken::from(n) + 1000
    }

    fn round(
        share: u32,
        renewed: &[Bucket],
        acquired: &[(Bucket, u8, bool)],
        handed: &[Bucket],
    ) -> MembershipRound {
        MembershipRound {
            live_relays: 1,
            fair_share: share,
            renewed: renewed.to_vec(),
            acquired: acquired
                .iter()
                .map(|&(bucket, t, takeover)| BucketLease {
                    bucket,
                    token: token(t),
                    takeover,
                })
                .collect(),
            handed_over: handed.to_vec(),
        }
    }

    /// [`Ownership::apply_round`] for a round sent and answered at `at`.
    fn apply(
        own: &mut Ownership,
        sent: &[(Bucket, LeaseToken)],
        round: &MembershipRound,
        at: Instant,
    ) -> RoundChange {
        own.apply_round(sent, round, at, at, LEASE, PUBLISH)
    }

    fn held(own: &Ownership) -> Vec<Bucket> {
        own.held.keys().copied().collect()
    }

    #[tokio::test(start_paused = true)]
    async fn a_round_renews_loses_and_acquires() {
        let mut own = Ownership::default();
        let t0 = Instant::now();
        let c = apply(
            &mut own,
            &[],
            &round(4, &[], &[(1, 1, false), (2, 2, true)], &[]),
            t0,
        );
        assert_eq!(c.acquired, vec![(1, false, false), (2, true, false)]);
        assert!(c.usable && c.below_share && c.lost.is_empty() && c.release.is_empty());
        assert!(own.held[&2].suspect, "a takeover records its attempt first");
        assert_eq!(own.held[&1].valid_until, t0 + LEASE);

        tokio::time::advance(Duration::from_secs(10)).await;
        let t1 = Instant::now();
        // Bucket 2 was taken over by another relay: not renewed.
        let sent = [(1, token(1)), (2, token(2))];
        let c = apply(&mut own, &sent, &round(2, &[1], &[], &[]), t1);
        assert_eq!(c.lost, vec![2]);
        assert!(!c.usable, "nothing new to read");
        assert_eq!(held(&own), vec![1]);
        assert_eq!(own.held[&1].valid_until, t1 + LEASE);
    }

    #[tokio::test(start_paused = true)]
    async fn a_lease_reacquired_under_a_new_token_is_not_lost() {
        let mut own = Ownership::default();
        let t0 = Instant::now();
        apply(&mut own, &[], &round(4, &[], &[(3, 1, false)], &[]), t0);
        // The round was sent with token 1; meanwhile the bucket was re-acquired (token 9).
        own.held.get_mut(&3).unwrap().token = token(9);
        let c = apply(&mut own, &[(3, token(1))], &round(4, &[], &[], &[]), t0);
        assert!(c.lost.is_empty());
        assert_eq!(held(&own), vec![3]);
    }

    /// docs/lease-model.md, D3: rows read under a lease that was lost and acquired again while
    /// the read was in flight must not be completed under the new token.
    #[tokio::test(start_paused = true)]
    async fn rows_read_under_a_lease_lost_and_reacquired_meanwhile_are_dropped() {
        let mut own = Ownership::default();
        let t0 = Instant::now();
        let first = round(4, &[], &[(3, 1, false)], &[]);
        apply(&mut own, &[], &first, t0);
        let read = [(3, token(1))];
        let batch = || BucketBatch {
            rows: Vec::new(),
            malformed: vec![(3, 42, "garbage".to_owned())],
        };
        // While the read is in flight: the lease is lost (not renewed), then acquired again.
        let lost = apply(&mut own, &read, &round(4, &[], &[], &[]), t0);
        assert_eq!(lost.lost, vec![3]);
        let again = round(4, &[], &[(3, 9, true)], &[]);
        apply(&mut own, &[], &again, t0);
        assert_eq!(own.held[&3].token, token(9));

        assert!(
            own.take(batch(), &read, t0, 3).is_empty(),
            "read under token 1"
        );
        assert!(
            !own.in_flight.contains_key(&3),
            "nothing of it is in flight"
        );
        assert!(own.held[&3].suspect, "the takeover batch is still to come");

        let work = own.take(batch(), &[(3, token(9))], t0, 3);
        assert_eq!(work.len(), 1);
        assert_eq!(work[0].token, token(9));
        assert!(own.in_flight.contains_key(&3));
    }

    #[tokio::test(start_paused = true)]
    async fn a_suspended_bucket_renewed_is_usable_again() {
        let mut own = Ownership::default();
        let t0 = Instant::now();
        apply(&mut own, &[], &round(1, &[], &[(5, 1, false)], &[]), t0);
        // A refused completion suspends the bucket (valid_until = now).
        own.held.get_mut(&5).unwrap().valid_until = t0;
        assert!(own.free(t0 + PUBLISH, &BTreeMap::new()).is_empty());
        let c = apply(&mut own, &[(5, token(1))], &round(1, &[5], &[], &[]), t0);
        assert!(c.usable);
        assert_eq!(own.free(t0 + PUBLISH, &BTreeMap::new()), vec![5]);
    }

    #[tokio::test(start_paused = true)]
    async fn above_the_share_the_highest_idle_buckets_go_back() {
        let mut own = Ownership::default();
        let t0 = Instant::now();
        let all: Vec<(Bucket, u8, bool)> = (0..6).map(|b| (b, b as u8, false)).collect();
        apply(&mut own, &[], &round(6, &[], &all, &[]), t0);
        own.in_flight.insert(5, t0);
        let sent: Vec<(Bucket, LeaseToken)> = own.held.iter().map(|(b, h)| (*b, h.token)).collect();
        let renewed: Vec<Bucket> = (0..6).collect();
        let c = apply(&mut own, &sent, &round(3, &renewed, &[], &[]), t0);
        // Bucket 5 is in flight: kept; 4 and 3 and 2 go back.
        assert_eq!(
            c.release.iter().map(|(b, _)| *b).collect::<Vec<_>>(),
            vec![4, 3, 2]
        );
        assert_eq!(held(&own), vec![0, 1, 5]);
        assert!(!c.below_share);
    }

    #[tokio::test(start_paused = true)]
    async fn a_handed_over_bucket_stays_above_the_share_for_one_lease() {
        let mut own = Ownership::default();
        let t0 = Instant::now();
        apply(
            &mut own,
            &[],
            &round(1, &[], &[(0, 0, false), (7, 7, false)], &[7]),
            t0,
        );
        // The round gave 0 back (7 was handed over): 7 stays.
        assert_eq!(held(&own), vec![7]);
        let sent = [(7, token(7))];
        let c = own.apply_round(
            &sent,
            &round(0, &[7], &[], &[]),
            t0,
            t0 + LEASE / 2,
            LEASE,
            PUBLISH,
        );
        assert!(c.release.is_empty(), "kept within a lease of the hand-over");
        let t1 = t0 + LEASE;
        let c = apply(&mut own, &sent, &round(0, &[7], &[], &[]), t1);
        assert_eq!(c.release, vec![(7, token(7))]);
    }

    #[test]
    fn lanes_share_the_free_buckets_rounded_up() {
        assert_eq!(lane_share(64, 2), 32);
        assert_eq!(lane_share(63, 2), 32);
        assert_eq!(lane_share(32, 1), 32);
        assert_eq!(lane_share(5, 4), 2);
        assert_eq!(lane_share(1, 3), 1);
        assert_eq!(lane_share(0, 2), 0);
        assert_eq!(lane_share(7, 0), 7);
    }

    #[tokio::test(start_paused = true)]
    async fn free_buckets_skip_busy_expiring_and_handed_off_ones_and_rotate() {
        let mut own = Ownership::default();
        let t0 = Instant::now();
        let all: Vec<(Bucket, u8, bool)> = (0..4).map(|b| (b, b as u8, false)).collect();
        apply(&mut own, &[], &round(4, &[], &all, &[]), t0);
        own.in_flight.insert(1, t0);
        own.held.get_mut(&2).unwrap().valid_until = t0 + PUBLISH; // expires within a publish
        let handing: BTreeMap<Bucket, String> = [(3, "peer".to_owned())].into();
        let horizon = t0 + PUBLISH;
        assert_eq!(own.free(horizon, &handing), vec![0]);
        let mut firsts = BTreeSet::new();
        for _ in 0..4 {
            firsts.insert(own.free(horizon, &BTreeMap::new())[0]);
        }
        assert_eq!(firsts, [0, 3].into(), "the read order rotates");
        assert!(own.fresh([(0, token(0))], horizon));
        assert!(!own.fresh([(0, token(9))], horizon), "another token");
        assert!(!own.fresh([(2, token(2))], horizon), "expiring");
    }
}
