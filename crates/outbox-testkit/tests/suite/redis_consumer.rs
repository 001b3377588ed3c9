//! The Redis Streams consumer runner: end to end with confirmations, retries and dead letters,
//! per-key order with concurrency, and trimming only what every group delivered.

use outbox_testkit_macros::suite_test;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use outbox::confirm::redis::{RedisConfirmationSender, RedisListenConfig};
use outbox::consumer::ConsumerMetrics;
use outbox::{Inbox, NewMessage, Status};
use outbox_testkit::{
    ConfirmFixture, PgFixture, RedisFixture, StoreFixture as _, TransportFixture as _,
    claimed_message, redis_url, wait_until,
};
use uuid::Uuid;

use crate::broker_support::{Listener, Running, pg_inbox};
use crate::confirm::{PgProducer, ScriptedHandler, pg_count, wait_status};
use crate::redis::{Recording, consumer_config, pending, publish};

/// The runner end to end with PostgreSQL on both sides and confirmations over Redis Streams:
/// processed messages end CONFIRMED with their effect once, rejected ones REJECTED with the
/// producer's compensation run once; every entry is acknowledged.
#[suite_test(workers = 4)]
async fn consumer_end_to_end_with_confirmations() {
    let rx = RedisFixture::new().await;
    let stream = rx.key("orders");
    let reply = rx.key("confirmations");
    let p = PgProducer::start_with_timeout(
        rx.transport.clone(),
        stream.clone(),
        reply.clone(),
        Duration::from_secs(5),
    )
    .await;
    let listener = Listener::spawn(|stop| {
        outbox::confirm::redis::listen(
            RedisListenConfig::new(redis_url(), &reply),
            p.store.clone(),
            stop,
        )
    });
    let handler = ScriptedHandler::new(&p.effects);
    let sender = Arc::new(RedisConfirmationSender::new(rx.transport.connection()));
    let mut config = consumer_config(&stream, "e2e").with_confirmations(sender);
    config.runner.concurrency = 4;
    let consumer =
        Running::spawn(config, &p.inbox, handler).stopping_within(Duration::from_secs(10));
    orders_confirmed_and_rejected(&p.fx, &p.effects, &consumer.metrics).await;
    assert_eq!(
        consumer.metrics.confirmations_sent.load(Ordering::Relaxed),
        23
    );
    wait_until("nothing pending", Duration::from_secs(10), || async {
        pending(&rx, &stream).await == 0
    })
    .await;
    consumer.stop().await;
    let report = listener.report().await;
    assert_eq!(report.confirmed, 20);
    assert_eq!(report.rejected, 3);
    rx.cleanup().await;
    p.finish().await;
}

/// Enqueue 20 processable orders (3 partition keys) and 3 that the [`ScriptedHandler`] rejects,
/// wait until they end CONFIRMED and REJECTED, and check the compensation ran once per rejection
/// and each effect happened once.
pub(crate) async fn orders_confirmed_and_rejected(
    fx: &PgFixture,
    effects: &str,
    metrics: &ConsumerMetrics,
) {
    let mut msgs: Vec<NewMessage> = (0..20)
        .map(|i| {
            NewMessage::new("orders", format!("ok-{i}")).with_partition_key(format!("k{}", i % 3))
        })
        .collect();
    msgs.extend((0..3).map(|i| NewMessage::new("orders", format!("reject-{i}"))));
    let ids = fx.enqueue_commit(msgs).await.unwrap();
    let (ok, rejected) = (&ids[..20], &ids[20..]);
    wait_status(fx, ok, Status::Confirmed, Duration::from_secs(30)).await;
    wait_status(fx, rejected, Status::Rejected, Duration::from_secs(30)).await;
    for id in rejected {
        assert_eq!(fx.compensations(*id).await, 1, "compensation once");
    }
    for id in ok {
        let n = pg_count(
            fx,
            &format!("SELECT COUNT(*) FROM {effects} WHERE message_id = '{id}'"),
        )
        .await;
        assert_eq!(n, 1, "effect once");
    }
    assert_eq!(metrics.applied.load(Ordering::Relaxed), 20);
    assert_eq!(metrics.rejected.load(Ordering::Relaxed), 3);
}

/// Transient failures: a message failing its first two deliveries is claimed back after the
/// backoff and applied at its third, with the delivery count read from the server (1, 2, 3); a
/// message that always fails is dead-lettered at `max_deliveries` (3) with 3 deliveries; others
/// flow meanwhile.
#[suite_test(workers = 4)]
async fn transient_failure_retried_then_applied_or_dead_lettered(fx: PgFixture) {
    let rx = RedisFixture::new().await;
    let stream = rx.key("flaky");
    let inbox = pg_inbox(&fx).await;
    let msgs = retry_messages();
    publish(&rx, &stream, &msgs).await;
    let mut config = consumer_config(&stream, "flaky");
    config.runner.max_deliveries = 3;
    let consumer = Recording::spawn(config, &inbox);
    check_retried_and_dead_lettered(&inbox, &consumer, &msgs).await;
    wait_until("nothing pending", Duration::from_secs(10), || async {
        pending(&rx, &stream).await == 0
    })
    .await;
    consumer.runner.stop().await;
    rx.cleanup().await;
}

/// The messages of the retry tests: `fail2-a` (fails its first two deliveries), `always-fail`,
/// and `fine`, on keys `a`, `b`, `c`.
pub(crate) fn retry_messages() -> Vec<outbox::Message> {
    ["fail2-a", "always-fail", "fine"]
        .into_iter()
        .zip(["a", "b", "c"])
        .map(|(p, k)| {
            let mut m = claimed_message("t", p);
            m.partition_key = Some(k.into());
            m
        })
        .collect()
}

/// Wait until the [`retry_messages`] are applied (2) or dead-lettered (1, with `max_deliveries`
/// 3) and check the delivery counts the handler saw: 1, 2, 3 for the failing ones, 1 for `fine`.
pub(crate) async fn check_retried_and_dead_lettered(
    inbox: &Inbox<sqlx::Postgres>,
    consumer: &Recording,
    msgs: &[outbox::Message],
) {
    let metrics = &consumer.runner.metrics;
    wait_until(
        "two applied and one dead-lettered",
        Duration::from_secs(20),
        || async {
            metrics.dead_lettered.load(Ordering::Relaxed) == 1
                && inbox.verdict(msgs[0].message_id).await.unwrap().is_some()
                && inbox.verdict(msgs[2].message_id).await.unwrap().is_some()
        },
    )
    .await;
    let seen = consumer.handler.seen();
    let counts = |id: Uuid| -> Vec<u32> {
        seen.iter()
            .filter(|s| s.id == id)
            .map(|s| s.deliveries)
            .collect()
    };
    assert_eq!(counts(msgs[0].message_id), vec![1, 2, 3]);
    assert_eq!(counts(msgs[1].message_id), vec![1, 2, 3]);
    assert_eq!(counts(msgs[2].message_id), vec![1]);
    let dead = inbox.dead_letters(10).await.unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].message.message_id, msgs[1].message_id);
    assert_eq!(dead[0].deliveries, 3);
}

/// Per-key order with concurrency 4: 400 messages over 8 keys, applied in stream order per key,
/// while different keys run in parallel lanes.
#[suite_test(workers = 4)]
async fn per_key_order_with_concurrency(fx: PgFixture) {
    let rx = RedisFixture::new().await;
    let stream = rx.key("ordered");
    let inbox = pg_inbox(&fx).await;
    let msgs: Vec<_> = (0..400)
        .map(|i| {
            let mut m = claimed_message("t", format!("{i}"));
            m.partition_key = Some(format!("key-{}", i % 8));
            m
        })
        .collect();
    publish(&rx, &stream, &msgs).await;
    let mut config = consumer_config(&stream, "lanes");
    config.runner.concurrency = 4;
    config.batch = 50;
    let consumer = Recording::spawn(config, &inbox);
    wait_until("400 applied", Duration::from_secs(30), || async {
        consumer.runner.metrics.applied.load(Ordering::Relaxed) == 400
    })
    .await;
    let mut by_key: BTreeMap<String, Vec<u32>> = BTreeMap::new();
    for s in consumer.handler.seen() {
        by_key
            .entry(s.key.unwrap())
            .or_default()
            .push(s.payload.parse().unwrap());
    }
    assert_eq!(by_key.len(), 8);
    for (k, seq) in &by_key {
        assert_eq!(seq.len(), 50, "{k}");
        assert!(
            seq.windows(2).all(|w| w[0] < w[1]),
            "{k} out of order: {seq:?}"
        );
    }
    consumer.runner.stop().await;
    rx.cleanup().await;
}

/// Safe trimming (C38): `trim_delivered` removes only entries every group has received and
/// acknowledged; a group's pending entries and undelivered entries stay, and a stream without
/// groups is left alone.
#[suite_test]
async fn trim_delivered_keeps_pending_and_undelivered_entries(rx: RedisFixture) {
    let stream = rx.key("trim");
    let msgs: Vec<_> = (0..10)
        .map(|i| claimed_message("t", format!("m{i}")))
        .collect();
    publish(&rx, &stream, &msgs).await;
    assert_eq!(
        rx.transport.trim_delivered(&stream).await.unwrap(),
        0,
        "no group: no trim"
    );
    let ids: Vec<String> = rx
        .entries(&stream)
        .await
        .into_iter()
        .map(|(id, _)| id)
        .collect();
    let read = |group: &'static str, n: usize, create: bool| {
        let stream = stream.clone();
        let rx = &rx;
        async move {
            if create {
                let _: () = rx
                    .query(
                        redis::cmd("XGROUP")
                            .arg("CREATE")
                            .arg(&stream)
                            .arg(group)
                            .arg("0"),
                    )
                    .await;
            }
            let _: redis::Value = rx
                .query(
                    redis::cmd("XREADGROUP")
                        .arg("GROUP")
                        .arg(group)
                        .arg("c")
                        .arg("COUNT")
                        .arg(n)
                        .arg("STREAMS")
                        .arg(&stream)
                        .arg(">"),
                )
                .await;
        }
    };
    let ack = async |group: &str, ids: &[String]| {
        let _: i64 = rx
            .query(redis::cmd("XACK").arg(&stream).arg(group).arg(ids))
            .await;
    };
    let entry_ids = async || -> Vec<String> {
        rx.entries(&stream)
            .await
            .into_iter()
            .map(|(id, _)| id)
            .collect()
    };
    // Group g: 6 delivered, the first 3 acknowledged (3 pending); group h: 2 delivered and
    // acknowledged (8 undelivered).
    read("g", 6, true).await;
    ack("g", &ids[..3]).await;
    read("h", 2, true).await;
    ack("h", &ids[..2]).await;
    assert_eq!(rx.transport.trim_delivered(&stream).await.unwrap(), 2);
    let left = entry_ids().await;
    assert_eq!(left, ids[2..].to_vec(), "h's undelivered entries are kept");
    // h catches up: now g's oldest pending entry is the bound.
    read("h", 100, false).await;
    ack("h", &ids[2..]).await;
    assert_eq!(rx.transport.trim_delivered(&stream).await.unwrap(), 1);
    let left = entry_ids().await;
    assert_eq!(left, ids[3..].to_vec(), "g's pending entries are kept");
}
