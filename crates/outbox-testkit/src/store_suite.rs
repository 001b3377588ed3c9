//! The store conformance suite: one async function per property, generic over
//! [`StoreFixture`](crate::StoreFixture), run against every dialect on the real database.
//!
//! Each function panics on a violation (they are called from `#[tokio::test]`s).

use std::collections::HashSet;
use std::time::Duration;

use outbox::store::{ClaimRequest, Completion, Outcome};
use outbox::{EnqueueError, NewMessage, Status, StoreErrorKind};

use crate::{StoreFixture, wait_until};

fn req(batch: u32, lease: Duration) -> ClaimRequest {
    ClaimRequest {
        owner: "suite".into(),
        batch_size: batch,
        lease,
    }
}

const LONG: Duration = Duration::from_secs(60);

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

/// A rolled-back enqueue is never visible; a committed one is claimed.
pub async fn rollback_is_never_visible<F: StoreFixture>(fx: &F) {
    fx.enqueue_rollback(vec![NewMessage::new("t", "rolled-back")])
        .await
        .expect("enqueue inside the transaction works");
    let store = fx.store();
    let claim = store.claim(&req(10, LONG)).await.unwrap();
    assert!(claim.messages.is_empty(), "rolled back message claimed");
    assert!(fx.rows().await.is_empty());
    let ids = fx
        .enqueue_commit(vec![NewMessage::new("t", "committed")])
        .await
        .unwrap();
    let claim = store.claim(&req(10, LONG)).await.unwrap();
    assert_eq!(
        claim
            .messages
            .iter()
            .map(|m| m.message_id)
            .collect::<Vec<_>>(),
        ids
    );
}

/// Two claimers racing over 200 rows never get the same row, and together get them all.
pub async fn claims_are_exclusive<F: StoreFixture>(fx: &F) {
    let msgs: Vec<NewMessage> = (0..200)
        .map(|i| NewMessage::new("t", format!("{i}")))
        .collect();
    fx.enqueue_commit(msgs).await.unwrap();
    let run = |store: std::sync::Arc<dyn outbox::Store>| async move {
        let mut got = Vec::new();
        loop {
            let c = store.claim(&req(7, LONG)).await.expect("claim");
            if c.messages.is_empty() {
                return got;
            }
            got.extend(c.messages.into_iter().map(|m| (m.id, m.attempts)));
            tokio::task::yield_now().await;
        }
    };
    let (a, b) = tokio::join!(tokio::spawn(run(fx.store())), tokio::spawn(run(fx.store())));
    let (a, b) = (a.unwrap(), b.unwrap());
    let mut all = HashSet::new();
    for (id, attempts) in a.iter().chain(b.iter()) {
        assert!(all.insert(*id), "row {id} claimed twice");
        assert_eq!(*attempts, 1);
    }
    assert_eq!(all.len(), 200, "a: {}, b: {}", a.len(), b.len());
    assert!(
        fx.rows()
            .await
            .iter()
            .all(|r| r.status == Status::Sending.as_i16())
    );
}

/// A claim with a short lease expires; the reaper returns the row to PENDING, due now, attempts
/// kept; a live lease is not reaped; an expired last attempt goes to FAILED.
pub async fn lease_expiry_and_reaping<F: StoreFixture>(fx: &F) {
    let store = fx.store();
    let ids = fx
        .enqueue_commit(vec![NewMessage::new("t", "short")])
        .await
        .unwrap();
    let c = store
        .claim(&req(10, Duration::from_millis(300)))
        .await
        .unwrap();
    assert_eq!(c.messages.len(), 1);
    let live = fx
        .enqueue_commit(vec![NewMessage::new("t", "long")])
        .await
        .unwrap();
    let c2 = store.claim(&req(10, LONG)).await.unwrap();
    assert_eq!(c2.messages[0].message_id, live[0]);
    // Not yet expired: nothing to reap.
    assert_eq!(store.reap_expired_leases(100, 16).await.unwrap(), 0);
    wait_until(
        "the short lease to be reaped",
        Duration::from_secs(5),
        || {
            let store = store.clone();
            async move { store.reap_expired_leases(100, 16).await.unwrap() == 1 }
        },
    )
    .await;
    let r = fx.row(ids[0]).await;
    assert_eq!(r.status, Status::Pending.as_i16());
    assert_eq!(r.attempts, 1, "reaping keeps the attempt count");
    assert!(r.lease_token.is_none());
    assert!(r.due_in_ms <= 0, "reaped row is due now");
    assert!(r.last_error.is_some(), "reaping records why");
    assert_eq!(
        fx.row(live[0]).await.status,
        Status::Sending.as_i16(),
        "a live lease is not reaped"
    );
    let again = store.claim(&req(10, LONG)).await.unwrap();
    assert_eq!(again.messages.len(), 1);
    assert_eq!(again.messages[0].message_id, ids[0]);
    assert_eq!(again.messages[0].attempts, 2);

    // Last attempt expired: FAILED.
    let last = fx
        .enqueue_commit(vec![NewMessage::new("t", "last").with_max_attempts(1)])
        .await
        .unwrap();
    store
        .claim(&req(10, Duration::from_millis(200)))
        .await
        .unwrap();
    wait_until(
        "the last-attempt lease to be reaped",
        Duration::from_secs(5),
        || {
            let store = store.clone();
            async move { store.reap_expired_leases(100, 16).await.unwrap() == 1 }
        },
    )
    .await;
    let r = fx.row(last[0]).await;
    assert_eq!(r.status, Status::Failed.as_i16());
    assert!(r.last_error.is_some());
}

/// A completion with a stale token matches no row and changes nothing; the right token works.
pub async fn fenced_completion<F: StoreFixture>(fx: &F) {
    let store = fx.store();
    let ids = fx
        .enqueue_commit(vec![NewMessage::new("t", "a"), NewMessage::new("t", "b")])
        .await
        .unwrap();
    let c = store.claim(&req(10, LONG)).await.unwrap();
    assert_eq!(c.messages.len(), 2);
    let snapshot = |rows: Vec<crate::RowState>| {
        rows.into_iter()
            .map(|r| crate::RowState { due_in_ms: 0, ..r })
            .collect::<Vec<_>>()
    };
    let before = snapshot(fx.rows().await);
    let stale = c.token ^ 1;
    let done: Vec<Completion> = c
        .messages
        .iter()
        .map(|m| Completion {
            id: m.id,
            outcome: Outcome::Sent,
        })
        .collect();
    assert_eq!(store.complete(stale, &done).await.unwrap(), 0);
    assert_eq!(
        snapshot(fx.rows().await),
        before,
        "a stale token changed a row"
    );
    assert_eq!(store.complete(c.token, &done).await.unwrap(), 2);
    for id in &ids {
        let r = fx.row(*id).await;
        assert_eq!(r.status, Status::Sent.as_i16());
        assert!(r.sent);
        assert!(r.lease_token.is_none());
    }
    // A second completion with the same token is refused too (the lease is gone).
    assert_eq!(store.complete(c.token, &done).await.unwrap(), 0);
    let stats = store.stats().await.unwrap();
    assert_eq!(stats.counts[&Status::Sent], 2);
    assert_eq!(stats.counts[&Status::Sending], 0);
}

/// `Retry` puts the row back to PENDING due `delay` later on the database clock: not claimable
/// at once, claimable after the delay, attempts kept, error recorded.
pub async fn retry_backs_off_on_the_database_clock<F: StoreFixture>(fx: &F) {
    let store = fx.store();
    let ids = fx
        .enqueue_commit(vec![NewMessage::new("t", "x")])
        .await
        .unwrap();
    let c = store.claim(&req(10, LONG)).await.unwrap();
    let delay = Duration::from_millis(1500);
    let n = store
        .complete(
            c.token,
            &[Completion {
                id: c.messages[0].id,
                outcome: Outcome::Retry {
                    delay,
                    error: "broker said no".into(),
                },
            }],
        )
        .await
        .unwrap();
    assert_eq!(n, 1);
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
    assert!(
        store
            .claim(&req(10, LONG))
            .await
            .unwrap()
            .messages
            .is_empty()
    );
    let due = store.next_due_in().await.unwrap().expect("a pending row");
    assert!(due > Duration::from_millis(900) && due <= delay, "{due:?}");
    wait_until(
        "the retried row to be claimable",
        Duration::from_secs(5),
        || {
            let store = store.clone();
            async move {
                !store
                    .claim(&req(10, LONG))
                    .await
                    .unwrap()
                    .messages
                    .is_empty()
            }
        },
    )
    .await;
    assert!(started.elapsed() >= Duration::from_millis(900));
    assert_eq!(fx.row(ids[0]).await.attempts, 2);
}

/// `Failed` dead-letters with the reason; stats and `failed()` show it.
pub async fn dead_letter<F: StoreFixture>(fx: &F) {
    let store = fx.store();
    let ids = fx
        .enqueue_commit(vec![
            NewMessage::new("poison", "x"),
            NewMessage::new("t", "y"),
        ])
        .await
        .unwrap();
    let c = store.claim(&req(10, LONG)).await.unwrap();
    let comps = vec![
        Completion {
            id: c.messages[0].id,
            outcome: Outcome::Failed {
                reason: "too large for the broker".into(),
            },
        },
        Completion {
            id: c.messages[1].id,
            outcome: Outcome::Sent,
        },
    ];
    assert_eq!(store.complete(c.token, &comps).await.unwrap(), 2);
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
    assert!(
        store
            .claim(&req(10, LONG))
            .await
            .unwrap()
            .messages
            .is_empty()
    );
}

/// `Release` gives the attempt back.
pub async fn release_gives_the_attempt_back<F: StoreFixture>(fx: &F) {
    let store = fx.store();
    let ids = fx
        .enqueue_commit(vec![NewMessage::new("t", "x")])
        .await
        .unwrap();
    let c = store.claim(&req(10, LONG)).await.unwrap();
    assert_eq!(c.messages[0].attempts, 1);
    store
        .complete(
            c.token,
            &[Completion {
                id: c.messages[0].id,
                outcome: Outcome::Release {
                    delay: Duration::ZERO,
                },
            }],
        )
        .await
        .unwrap();
    let r = fx.row(ids[0]).await;
    assert_eq!(r.status, Status::Pending.as_i16());
    assert_eq!(r.attempts, 0);
    let c = store.claim(&req(10, LONG)).await.unwrap();
    assert_eq!(c.messages.len(), 1);
    assert_eq!(c.messages[0].attempts, 1);
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
    let c = fx.store().claim(&req(10, LONG)).await.unwrap();
    let by_id = |id| {
        c.messages
            .iter()
            .find(|m| m.message_id == id)
            .expect("claimed")
            .payload
            .clone()
    };
    assert_eq!(by_id(ids[0]), binary);
    assert_eq!(by_id(ids[1]), json_bytes);
    assert_eq!(by_id(ids[2]), raw_nul);
    assert_eq!(by_id(ids[3]), Vec::<u8>::new());
    let json_msg = c.messages.iter().find(|m| m.message_id == ids[1]).unwrap();
    assert_eq!(
        json_msg.headers.get("content-type").map(String::as_str),
        Some("application/json")
    );
}

/// A row inserted with plain SQL by a foreign producer, giving only the required columns, is
/// claimed with the defaults.
pub async fn plain_sql_insert_is_claimed<F: StoreFixture>(fx: &F) {
    let id = fx.insert_plain_sql("foreign.topic", b"from java").await;
    let c = fx.store().claim(&req(10, LONG)).await.unwrap();
    assert_eq!(c.messages.len(), 1);
    let m = &c.messages[0];
    assert_eq!(m.message_id, id);
    assert_eq!(m.topic, "foreign.topic");
    assert_eq!(m.payload, b"from java");
    assert!(m.headers.is_empty());
    assert_eq!(m.attempts, 1);
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

/// `next_due_in` and `stats` on an empty and a non-empty table; a delayed message is not
/// claimable before its delay.
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
    assert!(
        store
            .claim(&req(10, LONG))
            .await
            .unwrap()
            .messages
            .is_empty()
    );
    fx.enqueue_commit(vec![NewMessage::new("t", "now")])
        .await
        .unwrap();
    assert_eq!(store.next_due_in().await.unwrap(), Some(Duration::ZERO));
    let stats = store.stats().await.unwrap();
    assert_eq!(stats.counts[&Status::Pending], 2);
    assert!(stats.oldest_pending_age.is_some());
}

// ---------------------------------------------------------------------------------------------
// Confirmations, check-back and retention (DESIGN.md §4, §9).
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

/// Claim every due row and complete each with `outcome` (SENT, or SENT awaiting confirmation).
async fn send_all(store: &Arc<dyn outbox::Store>, outcome: Outcome) -> usize {
    let c = store.claim(&req(1000, LONG)).await.expect("claim");
    let completions: Vec<Completion> = c
        .messages
        .iter()
        .map(|m| Completion {
            id: m.id,
            outcome: outcome.clone(),
        })
        .collect();
    let n = store
        .complete(c.token, &completions)
        .await
        .expect("complete");
    assert_eq!(n as usize, completions.len());
    completions.len()
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
    let short = Duration::from_millis(300);
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
/// confirmation), at most `limit` per call; never PENDING, SENDING, SENT awaiting confirmation or
/// FAILED rows, and never recent finished ones.
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
    let c = store.claim(&req(10, LONG)).await.unwrap();
    store
        .complete(
            c.token,
            &[Completion {
                id: c.messages[0].id,
                outcome: Outcome::Failed { reason: "x".into() },
            }],
        )
        .await
        .unwrap();
    let sending = mk("sending").await.unwrap()[0];
    store.claim(&req(10, LONG)).await.unwrap();
    let pending = mk("pending").await.unwrap()[0];
    let old: Vec<Uuid> = fin.iter().copied().chain([plain]).collect();
    let kept_old = [waiting, failed, sending, pending];
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
