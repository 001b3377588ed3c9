//! Confirmations, check-back and retention (docs/design/DESIGN.md §4, §9).

use super::*;
use outbox::retention::{Finished, RetentionAction};

/// `Processed` confirmations move SENT → CONFIRMED in one batch with the counts reported;
/// duplicates (also within one batch) and unknown ids are counted, never errors, and every
/// confirmation of a batch is accounted for exactly once.
pub async fn confirmations_apply_in_batches<F: ConfirmFixture>(fx: &F) {
    let ctl = Arc::new(HookControl::default());
    let store = fx.store_with_hook(ctl.clone()).await;
    let ids = fx.enqueue_numbered(5).await;
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
    let ids = fx.enqueue_numbered(3).await;
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

/// SENT past its deadline is checked back: PENDING, due now, `check_backs + 1`, `attempts` 0; after
/// `max_check_backs` check-backs it goes to FAILED "unconfirmed…". SENT without a deadline, and
/// SENT before its deadline, are never checked back. A late confirmation of a checked-back
/// message still confirms it.
pub async fn check_back_then_unconfirmed<F: ConfirmFixture>(fx: &F) {
    let store = fx.store();
    // Long enough that the setup below (four enqueues and relay rounds) cannot outlast it on a
    // loaded machine: at 300 ms the first "not before the deadline" check failed once in CI
    // (PostgreSQL, 2 cores, the whole suite running).
    let short = Duration::from_millis(1500);
    let awaiting_id = fx.commit_one(NewMessage::new("t", "awaiting")).await;
    send_all(&store, awaiting(short)).await;
    let plain = fx.commit_one(NewMessage::new("t", "plain")).await;
    send_all(&store, Outcome::Sent).await;
    let later = fx.commit_one(NewMessage::new("t", "later")).await;
    send_all(&store, awaiting(LONG)).await;
    let late = fx.commit_one(NewMessage::new("t", "late")).await;
    send_all(&store, awaiting(short)).await;
    // A SENT row without a deadline, made long ago: still never checked back.
    fx.backdate(plain, Duration::from_secs(3600)).await;

    let max = 2;
    for round in 1..=max {
        // Not before the deadline.
        assert_eq!(store.check_back(100, max).await.unwrap(), 0);
        tokio::time::sleep(short * 2).await;
        let expected = if round == 1 { 2 } else { 1 };
        assert_eq!(store.check_back(100, max).await.unwrap(), expected);
        let r = fx.row(awaiting_id).await;
        assert_eq!(r.status, Status::Pending.as_i16(), "round {round}");
        assert!(r.due_in_ms <= 0, "checked back rows are due now");
        assert!(r.last_error.is_some());
        assert_eq!(r.attempts, 0, "a check-back starts a new round of attempts");
        let st = fx.confirm_state(awaiting_id).await;
        assert_eq!(st.check_backs, i64::from(round));
        assert!(st.deadline_in_ms.is_none());
        if round == 1 {
            // The late one was checked back in the same statement; its confirmation arrives now.
            assert_eq!(fx.row(late).await.status, Status::Pending.as_i16());
            let rep = store.apply_confirmations(&[processed(late)]).await.unwrap();
            assert_eq!(
                rep.confirmed, 1,
                "a late confirmation confirms a checked-back row"
            );
            assert_eq!(fx.row(late).await.status, Status::Confirmed.as_i16());
        }
        // Published again: SENT with a new deadline.
        assert_eq!(send_all(&store, awaiting(short)).await, 1);
        assert_eq!(fx.row(awaiting_id).await.status, Status::Sent.as_i16());
    }
    tokio::time::sleep(short * 2).await;
    assert_eq!(store.check_back(100, max).await.unwrap(), 1);
    let r = fx.row(awaiting_id).await;
    assert_eq!(r.status, Status::Failed.as_i16());
    let err = r.last_error.unwrap_or_default();
    assert!(err.starts_with("unconfirmed"), "{err}");
    assert_eq!(
        fx.confirm_state(awaiting_id).await.check_backs,
        i64::from(max)
    );
    assert_eq!(store.check_back(100, max).await.unwrap(), 0);
    assert_eq!(fx.row(plain).await.status, Status::Sent.as_i16());
    assert_eq!(fx.confirm_state(plain).await.check_backs, 0);
    assert_eq!(fx.row(later).await.status, Status::Sent.as_i16());
    assert_eq!(fx.confirm_state(later).await.check_backs, 0);
}

/// Retention ([`Store::retire`], what the relay's maintenance runs) deletes only old CONFIRMED and REJECTED rows (and old SENT rows that await no
/// confirmation), at most `limit` per call; never PENDING rows (one read by a relay and not
/// completed yet included), SENT awaiting confirmation or FAILED rows, and never recent
/// finished ones.
pub async fn retention_removes_only_old_finished_rows<F: ConfirmFixture>(fx: &F) {
    let store = fx.store();
    let mk = |p: &'static str| fx.enqueue_commit(vec![NewMessage::new("t", p)]);
    let hour = Duration::from_secs(3600);
    // CONFIRMED ×3 and REJECTED.
    let fin = fx.commit_numbered("t", "f", 4).await;
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
    for state in [Finished::Sent, Finished::Confirmed, Finished::Rejected] {
        loop {
            let n = store
                .retire(state, window, RetentionAction::Delete, 2)
                .await
                .expect("retention");
            assert!(n <= 2, "retention is bounded by its limit: {n}");
            batches.push(n);
            if n < 2 {
                break;
            }
            assert!(batches.len() < 10, "retention does not end: {batches:?}");
        }
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
