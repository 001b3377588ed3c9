//! Shared case C17 (a recovery must never overwrite a completion) on the bucket-lease protocol
//! the relay runs: through two relays on PostgreSQL and SQLite, and at the store seam on
//! PostgreSQL with the race the case describes (a completion waiting on a row lock while its
//! lease runs out: no takeover until it commits; docs/lease-model.md, D1).

use outbox_testkit::{PauseAt, PauseFirst};
use outbox_testkit_macros::suite_test;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use outbox::store::{
    Bucket, BucketCompletion, BucketLease, BucketRow, LeaseToken, MembershipRequest, Outcome, Store,
};
use outbox::transport::memory::Delivered;
use outbox::{NewMessage, Status};
use outbox_testkit::{PgFixture, SqliteFixture, StoreFixture, wait_metrics, wait_until};
use sqlx::AssertSqlSafe;

use crate::crash::{apply_through_inbox, r1_paused, r2_takes_over};
use crate::inbox::pg_with_effects;

/// C17 through two relays: R1 publishes M1 and stalls before recording it, past its lease; R2
/// takes the bucket over (the recovery), counts the attempt, publishes M1 again and records
/// SENT. When R1 resumes, its completion (read under the old bucket token) is refused: M1 stays
/// SENT with R2's attempt count, error and send time, it is not published a third time, and the
/// consumer's inbox applies it once. `apply` feeds the deliveries through the store's inbox and
/// returns (applied, effect rows).
async fn c17_scenario(
    fx: &dyn StoreFixture,
    apply: impl AsyncFnOnce(Vec<Delivered>) -> (usize, i64),
) {
    let hooks = PauseFirst::new(PauseAt::Complete);
    let (mem1, r1, id) =
        r1_paused(fx, &hooks, "R1 to publish and stall before its completion").await;
    assert_eq!(mem1.count(), 1);
    let (mem2, r2) = r2_takes_over(fx).await;
    let sent = fx.row(id).await;
    assert_eq!(sent.attempts, 1, "R2's takeover counted one attempt");
    hooks.resume.notify_one();
    wait_metrics(r1.metrics(), 5, "R1's late completion to be refused", |m| {
        m.lost_leases >= 1
    })
    .await;
    r1.shutdown().await.unwrap();
    r2.shutdown().await.unwrap();
    let after = fx.row(id).await;
    assert_eq!(
        after.status,
        Status::Sent.as_i16(),
        "R1's late completion overwrote R2's"
    );
    assert_eq!(
        (after.attempts, &after.last_error, after.sent),
        (sent.attempts, &sent.last_error, sent.sent)
    );
    assert_eq!(
        (mem1.count(), mem2.count()),
        (1, 1),
        "published again after SENT"
    );
    let mut all = mem1.delivered();
    all.extend(mem2.delivered());
    assert_eq!(apply(all).await, (1, 1), "(applied, effects)");
}

/// C17 on PostgreSQL through two relays (see [`c17_scenario`]).
#[suite_test]
async fn c17_takeover_never_overwrites_a_completion() {
    let (fx, pool, effects) = pg_with_effects().await;
    c17_scenario(&fx, async |all| {
        let (applied, _) = apply_through_inbox(&pool, &fx.inbox_table(), &effects, &all).await;
        let n = fx.count(&effects).await;
        (applied, n)
    })
    .await;
    fx.cleanup().await;
}

/// C17 on SQLite through two relays (see [`c17_scenario`]).
#[suite_test]
async fn c17_sqlite_takeover_never_overwrites_a_completion(fx: SqliteFixture) {
    let pool = fx.store.pool().clone();
    crate::inbox::sqlite_effects_table(&pool).await;
    c17_scenario(&fx, async |all| {
        let (applied, _) = apply_through_inbox(&pool, "outbox_inbox", "effects", &all).await;
        let n: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM effects")
            .fetch_one(&pool)
            .await
            .unwrap();
        (applied, n)
    })
    .await;
}

/// One membership round of `relay` routing every topic.
fn round(relay: &str, lease: Duration, held: Vec<(Bucket, LeaseToken)>) -> MembershipRequest {
    MembershipRequest {
        relay: relay.into(),
        lease,
        held,
        acquire: true,
        routes: vec!["*".into()],
    }
}

/// Run membership rounds of `relay` (renewing what it got) until it holds `bucket`; the
/// bucket's lease.
async fn acquire_bucket(
    store: &Arc<dyn Store>,
    relay: &str,
    lease: Duration,
    bucket: Bucket,
) -> BucketLease {
    type State = (Vec<(Bucket, LeaseToken)>, Option<BucketLease>);
    let state: Arc<Mutex<State>> = Arc::default();
    wait_until(
        &format!("{relay} to acquire bucket {bucket}"),
        Duration::from_secs(10),
        || {
            let (store, state) = (store.clone(), state.clone());
            let relay = relay.to_owned();
            async move {
                let held = state.lock().unwrap().0.clone();
                let done = store.membership(&round(&relay, lease, held)).await.unwrap();
                let mut s = state.lock().unwrap();
                s.0.retain(|(b, _)| done.renewed.contains(b));
                s.0.extend(done.acquired.iter().map(|l| (l.bucket, l.token)));
                s.1 = done.acquired.into_iter().find(|l| l.bucket == bucket);
                s.1.is_some()
            }
        },
    )
    .await;
    let got = state.lock().unwrap().1;
    got.expect("acquired")
}

/// The bucket of a message, as its generated column holds it.
async fn bucket_of(fx: &PgFixture, id: uuid::Uuid) -> Bucket {
    sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT bucket FROM {} WHERE message_id = $1",
        fx.table()
    )))
    .bind(id)
    .fetch_one(fx.store.pool())
    .await
    .unwrap()
}

fn completion(
    row: &BucketRow,
    lease: &BucketLease,
    attempts: u32,
    outcome: Outcome,
) -> BucketCompletion {
    BucketCompletion {
        id: row.message.id,
        bucket: row.bucket,
        token: lease.token,
        attempts,
        outcome,
    }
}

/// Wait until the lease of `bucket` expired (by the database clock).
async fn lease_expired(fx: &PgFixture, bucket: Bucket) {
    let table = fx.table();
    wait_until("R1's lease to expire", Duration::from_secs(5), || async {
        fx.count(&format!(
            "{table}_buckets WHERE bucket = {bucket} AND expires_at <= now()"
        ))
        .await
            == 1
    })
    .await;
}

/// Wait until `n` statements on `fx`'s outbox table wait for a lock.
async fn lock_waiters(fx: &PgFixture, n: i64) {
    let sql = format!(
        "SELECT COUNT(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' \
         AND query LIKE '%UPDATE {} o SET%'",
        fx.table()
    );
    wait_until(
        &format!("{n} completions waiting on the row lock"),
        Duration::from_secs(5),
        || async { crate::inbox::pg_count(fx.store.pool(), &sql).await == n },
    )
    .await;
}

/// C17 on PostgreSQL at the store seam, with the store methods the relay calls, in its sequence
/// (membership, read_buckets, complete_in_buckets). Every write is conditional on the row being
/// PENDING and on the bucket lease it was read under.
/// (a) R1's completion issued after its lease expired is refused even before anyone took the
/// bucket over. (b) The race of the case and of finding D1 (docs/lease-model.md): R1's
/// completion passed its fence and waits on a row lock held by a third session; meanwhile R1's
/// lease expires. R2's membership rounds cannot take the bucket over while the completion is
/// open (the fence share-locks the bucket row until the completion commits; before the fix
/// R2 took it over, read M1 as PENDING and R1's write landed under R2's lease). When the lock
/// goes, R1's SENT lands; R2 then takes the bucket over and has nothing to read. (c) The other
/// order: R2's takeover write lands first; R1's late completion is refused; R2 publishes and
/// records SENT, which a further late completion of R1 does not change.
#[suite_test]
async fn c17_store_late_completion_and_takeover_are_fenced(fx: PgFixture) {
    let store = fx.store();
    let table = fx.table();
    let lease = Duration::from_millis(500);

    // (a)
    let a = fx.commit_one(NewMessage::new("t", "a")).await;
    let b = bucket_of(&fx, a).await;
    let l1 = acquire_bucket(&store, "r1", lease, b).await;
    let batch = store.read_buckets(&[b], &[], 100).await.unwrap();
    assert_eq!(batch.rows.len(), 1);
    lease_expired(&fx, b).await;
    let late = store
        .complete_in_buckets("r1", &[completion(&batch.rows[0], &l1, 1, Outcome::Sent)])
        .await
        .unwrap();
    assert_eq!(late, 0, "a completion after the lease expired was applied");
    assert_eq!(fx.row(a).await.status, Status::Pending.as_i16());
    // R2 takes over and finishes it.
    let l2 = acquire_bucket(&store, "r2", lease, b).await;
    assert!(l2.takeover);
    let batch = store.read_buckets(&[b], &[], 100).await.unwrap();
    let row = &batch.rows[0];
    assert_eq!(
        store
            .complete_in_buckets("r2", &[completion(row, &l2, 1, Outcome::Sent)])
            .await
            .unwrap(),
        1
    );
    assert_eq!(fx.row(a).await.status, Status::Sent.as_i16());

    // (b)
    let m = fx.commit_one(NewMessage::new("t", "m1")).await;
    let b = bucket_of(&fx, m).await;
    let l1 = acquire_bucket(&store, "r3", lease, b).await;
    let batch = store.read_buckets(&[b], &[], 100).await.unwrap();
    let r1_row = batch.rows[0].clone();
    assert_eq!(r1_row.message.message_id, m);
    let mut x = fx.store.pool().begin().await.unwrap();
    sqlx::query(AssertSqlSafe(format!(
        "SELECT id FROM {table} WHERE id = $1 FOR UPDATE"
    )))
    .bind(r1_row.message.id)
    .execute(&mut *x)
    .await
    .unwrap();
    let r1_completion = {
        let (store, c) = (store.clone(), completion(&r1_row, &l1, 1, Outcome::Sent));
        tokio::spawn(async move { store.complete_in_buckets("r3", &[c]).await })
    };
    lock_waiters(&fx, 1).await;
    lease_expired(&fx, b).await;
    for _ in 0..3 {
        let round = store
            .membership(&round("r4", lease, Vec::new()))
            .await
            .unwrap();
        assert!(
            round.acquired.iter().all(|l| l.bucket != b),
            "R2 took the bucket over while R1's completion was open (D1)"
        );
    }
    x.commit().await.unwrap();
    assert_eq!(r1_completion.await.unwrap().unwrap(), 1, "R1's SENT");
    let l2 = acquire_bucket(&store, "r4", lease, b).await;
    assert!(l2.takeover, "R1's lease expired");
    let row = fx.row(m).await;
    assert_eq!(row.status, Status::Sent.as_i16());
    assert_eq!((row.attempts, row.last_error.as_deref()), (1, None));
    assert!(
        store
            .read_buckets(&[b], &[], 100)
            .await
            .unwrap()
            .rows
            .is_empty(),
        "R2 would publish M1 again"
    );

    // (c)
    let m = fx.commit_one(NewMessage::new("t", "m2")).await;
    let b = bucket_of(&fx, m).await;
    let l1 = acquire_bucket(&store, "r5", lease, b).await;
    let r1_row = store.read_buckets(&[b], &[], 100).await.unwrap().rows[0].clone();
    let l2 = acquire_bucket(&store, "r6", lease, b).await;
    assert!(l2.takeover);
    let r2_row = store.read_buckets(&[b], &[], 100).await.unwrap().rows[0].clone();
    let pre = completion(
        &r2_row,
        &l2,
        1,
        Outcome::Release {
            delay: Duration::ZERO,
        },
    );
    assert_eq!(store.complete_in_buckets("r6", &[pre]).await.unwrap(), 1);
    let late = completion(&r1_row, &l1, 1, Outcome::Sent);
    assert_eq!(
        store
            .complete_in_buckets("r5", std::slice::from_ref(&late))
            .await
            .unwrap(),
        0,
        "a completion on a lease taken over was applied"
    );
    let row = fx.row(m).await;
    assert_eq!((row.status, row.attempts), (Status::Pending.as_i16(), 1));
    let sent = completion(&r2_row, &l2, 1, Outcome::Sent);
    assert_eq!(store.complete_in_buckets("r6", &[sent]).await.unwrap(), 1);
    let failed = completion(
        &r1_row,
        &l1,
        1,
        Outcome::Failed {
            reason: "late".into(),
        },
    );
    assert_eq!(store.complete_in_buckets("r5", &[failed]).await.unwrap(), 0);
    let row = fx.row(m).await;
    assert_eq!(
        (row.status, row.attempts, row.last_error.as_deref()),
        (Status::Sent.as_i16(), 1, None)
    );
}
