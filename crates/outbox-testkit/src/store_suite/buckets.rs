//! Bucket leases, reads without claiming, bucket-fenced completion and key heads (migration v4,
//! docs/design/one-write-and-ordering.md).

use super::*;

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
        .hand_off_buckets(&HandOff {
            relay: "relay-a",
            buckets: &[(h, th ^ 1)],
            to: "relay-b",
            lease: LONG,
        })
        .await
        .unwrap();
    let r = round(&store, "relay-a", LONG, &a).await;
    assert!(
        r.renewed.contains(&h),
        "a stale hand-over gave the bucket away"
    );
    store
        .hand_off_buckets(&HandOff {
            relay: "relay-a",
            buckets: &[(h, th)],
            to: "relay-b",
            lease: LONG,
        })
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
    let mut relay_b = ProtocolRelay::new("relay-b", SHORT);
    let r = relay_b.round(&store).await;
    assert!(r.acquired.is_empty(), "a live lease was taken: {r:?}");

    // Poll on the database clock: relay-b's round acquires nothing until relay-a's leases
    // expired, then (relay-a no longer live either) takes every bucket over.
    let taken = relay_b.round_until_acquired(&store).await;
    assert_eq!(taken.live_relays, 1, "relay-a is no longer live");
    assert_eq!(taken.acquired.len(), usize::from(BUCKETS), "{taken:?}");
    assert!(taken.acquired.iter().all(|l| l.takeover), "{taken:?}");
    let b = relay_b.held.clone();
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
    let ids = fx.enqueue_numbered(5).await;
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

    let before = rows_at_rest(fx).await;
    let stale = with_stale_tokens(&comps);
    assert_eq!(
        store.complete_in_buckets("relay-a", &stale).await.unwrap(),
        0
    );
    assert_eq!(
        store.complete_in_buckets("relay-b", &comps).await.unwrap(),
        0
    );
    assert_eq!(
        rows_at_rest(fx).await,
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
