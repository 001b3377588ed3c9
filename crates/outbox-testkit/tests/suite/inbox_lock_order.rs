//! Two consumer instances that receive overlapping batches (a redelivery, a duplicate: the
//! demo's `--duplicate` fault with `--inbox-batch 100`) apply them through `deliver_batch`, the
//! function every runner calls, on PostgreSQL. Their multi-row inbox inserts must take the
//! rows' locks in one order: inserted in the batches' own orders, `[b, a]` and `[a, b]` could
//! each hold one row the other waits for, and PostgreSQL broke the cycle after its 1 s
//! `deadlock_timeout` by failing one transaction ("deadlock detected"), whose batch was then
//! applied again message by message.

use outbox_testkit_macros::suite_test;
use std::time::Duration;

use async_trait::async_trait;
use outbox::consumer::{ConsumerMetrics, DeliveryPolicy, Disposition, deliver_batch};
use outbox::{HandlerError, InboundMessage, Inbox, Verdict};
use outbox_testkit::{PgFixture, StoreFixture as _, wait_until};
use sqlx::{AssertSqlSafe, PgConnection};
use uuid::Uuid;

use crate::inbox::inbound;

/// Applies every message (the inbox row is the only write).
struct Accept;

#[async_trait]
impl outbox::Handler<sqlx::Postgres> for Accept {
    async fn handle(&self, _: &mut PgConnection, _: &InboundMessage) -> Result<(), HandlerError> {
        Ok(())
    }
}

#[suite_test]
async fn overlapping_inbox_batches_take_row_locks_in_one_order(fx: PgFixture) {
    let pool = fx.store.pool().clone();
    let table = fx.inbox_table();
    let inbox = Inbox::<sqlx::Postgres>::new(pool.clone(), &table, "overlap").unwrap();
    inbox.migrate().await.unwrap();
    let policy = DeliveryPolicy {
        inbox_batch: 10,
        ..DeliveryPolicy::default()
    };
    let metrics = ConsumerMetrics::default();
    // Without one order, each round deadlocks about half the time (whichever batch gets `a`
    // first after the holder lets go); six rounds all pass by luck once in 64.
    for round in 0..6 {
        let (a, b) = (inbound(Uuid::now_v7()), inbound(Uuid::now_v7()));
        // A third transaction holds `a`'s inbox row, so both batches queue behind it: the
        // second one with `b` already inserted.
        let mut holder = pool.begin().await.unwrap();
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {table} (consumer, message_id, topic, outcome, reason) \
             VALUES ('overlap', $1, 'orders.created', 0, NULL)"
        )))
        .bind(a.message_id)
        .execute(&mut *holder)
        .await
        .unwrap();
        let first = [a.clone(), b.clone()];
        let second = [b.clone(), a.clone()];
        let one = deliver_batch(&inbox, &Accept, &first, 1, &policy, &metrics);
        let two = deliver_batch(&inbox, &Accept, &second, 1, &policy, &metrics);
        let both = async { tokio::join!(one, two) };
        let release = async {
            wait_until(
                "both batches wait for the held row",
                Duration::from_secs(10),
                || async {
                    let waiting: i64 = sqlx::query_scalar(
                        "SELECT count(*) FROM pg_stat_activity \
                         WHERE wait_event_type = 'Lock' AND datname = current_database() \
                         AND query LIKE '%unnest%'",
                    )
                    .fetch_one(&pool)
                    .await
                    .unwrap();
                    waiting >= 2
                },
            )
            .await;
            holder.rollback().await.unwrap();
        };
        let ((d1, d2), ()) = tokio::join!(both, release);
        for (name, d) in [("[a, b]", d1), ("[b, a]", d2)] {
            for (m, d) in [&a, &b].iter().zip(&d) {
                assert!(
                    matches!(d, Disposition::Ack(Verdict::Processed)),
                    "round {round}, batch {name}, message {}: {d:?}",
                    m.message_id
                );
            }
        }
    }
    // Every batch committed as one transaction: a batch that PostgreSQL failed as a deadlock
    // victim is applied again message by message (so nothing is lost, but the batch paid the
    // 1 s deadlock timeout and logged "inbox batch failed") and not counted here.
    assert_eq!(
        metrics
            .inbox_batches
            .load(std::sync::atomic::Ordering::Relaxed),
        12,
        "inbox batches committed whole"
    );
    // Each message applied once: one inbox row each, every one of them processed.
    let rows: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT count(*) FROM {table} WHERE consumer = 'overlap' AND outcome = 0"
    )))
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(rows, 12);
}
