//! Relays sharing the buckets, lease expiry, fenced completions, retries, dead letters and releases.

use super::*;

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
    let id = fx.commit_one(NewMessage::new("t", "x")).await;
    // relay-a's lease (1 s) outlasts relay-b's liveness window (900 ms): once relay-a's buckets
    // expired, relay-a no longer counts as live and relay-b's share is every bucket.
    let mut a = sole_relay(&store, "relay-a", Duration::from_secs(1)).await;
    let read_by_a = a.read(&store, 10).await;
    assert_eq!(read_by_a.len(), 1);
    assert_eq!(read_by_a[0].row.message.message_id, id);
    // relay-a dies here, between read and completion.
    let mut b = ProtocolRelay::new("relay-b", Duration::from_millis(900));
    let r = b.round(&store).await;
    assert!(r.acquired.is_empty(), "a live lease was taken: {r:?}");
    assert!(b.read(&store, 10).await.is_empty());

    let taken = b.round_until_acquired(&store).await;
    assert_eq!(taken.live_relays, 1, "relay-a is no longer live");
    assert!(taken.acquired.iter().all(|l| l.takeover), "{taken:?}");
    assert_eq!(b.held.len(), usize::from(BUCKETS));
    let r = fx.row(id).await;
    assert_eq!((r.status, r.attempts), (Status::Pending.as_i16(), 0));

    let mut work = b.read(&store, 10).await;
    assert_eq!(work.len(), 1, "the row is read again after the takeover");
    assert_eq!(work[0].row.message.message_id, id);
    assert_eq!(work[0].row.message.attempts, 0);
    assert!(
        work[0].counted,
        "a takeover batch records its attempt first"
    );
    assert_eq!(b.record_takeover_attempts(&store, &mut work).await, 1);
    let r = fx.row(id).await;
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
    assert_eq!(fx.row(id).await.status, Status::Pending.as_i16());
    let n = b.complete_batch(&store, &[(&work[0], Outcome::Sent)]).await;
    assert_eq!(n, 1);
    let r = fx.row(id).await;
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
    let before = rows_at_rest(fx).await;
    let sent: Vec<BucketCompletion> = work.iter().map(|w| w.completion(Outcome::Sent)).collect();
    let stale = with_stale_tokens(&sent);
    assert_eq!(a.write_completions(&store, &stale).await, 0);
    assert_eq!(
        store.complete_in_buckets("relay-b", &sent).await.unwrap(),
        0,
        "a relay that does not own the bucket completed"
    );
    assert_eq!(
        rows_at_rest(fx).await,
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
    let id = fx.commit_one(NewMessage::new("t", "x")).await;
    let mut a = sole_relay(&store, "relay-a", LONG).await;
    let work = a.read(&store, 10).await;
    let delay = Duration::from_millis(1500);
    let retry = Outcome::Retry {
        delay,
        error: "broker said no".into(),
    };
    assert_eq!(a.complete_batch(&store, &[(&work[0], retry)]).await, 1);
    let started = tokio::time::Instant::now();
    let r = fx.row(id).await;
    assert_eq!(r.status, Status::Pending.as_i16());
    assert_eq!(r.attempts, 1);
    assert_eq!(r.last_error.as_deref(), Some("broker said no"));
    assert!(
        (1000..=1600).contains(&r.due_in_ms),
        "due in {} ms on the database clock",
        r.due_in_ms
    );
    assert!(a.read(&store, 10).await.is_empty());
    let due = a.next_due(&store).await.expect("a pending row");
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
    let r = fx.row(id).await;
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
    let id = fx.commit_one(NewMessage::new("t", "x")).await;
    let mut a = sole_relay(&store, "relay-a", LONG).await;
    let work = a.read(&store, 10).await;
    assert_eq!(work[0].attempt(), 1);
    let release = Outcome::Release {
        delay: Duration::ZERO,
    };
    assert_eq!(a.complete_batch(&store, &[(&work[0], release)]).await, 1);
    let r = fx.row(id).await;
    assert_eq!((r.status, r.attempts), (Status::Pending.as_i16(), 0));
    let work = a.read(&store, 10).await;
    assert_eq!(work.len(), 1);
    assert_eq!(work[0].row.message.attempts, 0);
    a.leave(&store).await;

    // The relay: broker unreachable, then back.
    let mem = Arc::new(MemoryTransport::new());
    mem.set_down(true);
    let handle = spawn_relay(fx, &mem);
    wait_metrics(
        handle.metrics(),
        10,
        "the relay to release the message",
        |m| m.released >= 1,
    )
    .await;
    let r = fx.row(id).await;
    assert_eq!(
        (r.status, r.attempts),
        (Status::Pending.as_i16(), 0),
        "an unreachable broker costs no attempt"
    );
    mem.set_down(false);
    wait_status(fx, id, Status::Sent).await;
    assert_eq!(fx.row(id).await.attempts, 1);
    let delivered = mem.delivered();
    assert_eq!(delivered.len(), 1);
    assert_eq!(delivered[0].message.attempts, 1);
    handle.shutdown().await.unwrap();
}
