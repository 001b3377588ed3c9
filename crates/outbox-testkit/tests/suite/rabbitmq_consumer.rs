//! The RabbitMQ consumer runner: end to end with confirmations, transient failures redelivered
//! with backoff, poison and malformed messages, per-key order with concurrency, set-up errors.

use outbox_testkit_macros::suite_test;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use outbox::confirm::rabbitmq::RabbitMqConfirmationSender;
use outbox::consumer::ConsumerMetrics;
use outbox::consumer::rabbitmq::{RabbitMqConsumerConfig, retry_queue, retry_tier};
use outbox::{HandlerError, InboundMessage, Inbox, NewMessage, Verdict};
use outbox_testkit::{
    Concurrent, PgFixture, RabbitMqFixture, StoreFixture, TransportFixture as _, claimed_message,
    publish_to, rabbitmq_config, rabbitmq_url, wait_until,
};
use sqlx::{AssertSqlSafe, PgConnection};
use tokio_util::sync::CancellationToken;

use crate::broker_support::Running;
use crate::confirm::{
    BrokerSetup, FaultySender, ScriptedHandler, check_lost_confirmation_outcome, fast_retry,
    lost_confirmation_messages, pg_count,
};
use crate::inbox::EffectHandler;
use crate::rabbitmq::{consumer_config, sqlite_consumer, sqlite_effects};

/// The RabbitMQ side of an end-to-end test: the fixture's exchange, and the producer's
/// confirmation listener on a queue of its own.
pub(crate) type RabbitSetup = BrokerSetup<RabbitMqFixture>;

impl RabbitSetup {
    pub(crate) async fn new() -> RabbitSetup {
        let mq = RabbitMqFixture::new().await;
        let reply = format!("{}.confirmations", mq.queue);
        let destination = mq.topic_destination();
        let queue = reply.clone();
        let s = BrokerSetup::start(mq, destination, &reply, |store, stop| {
            outbox::confirm::rabbitmq::listen(rabbitmq_config(&rabbitmq_url()), queue, store, stop)
        })
        .await;
        // The listener declares its queue; delete it at cleanup.
        wait_until(
            "the confirmation queue",
            Duration::from_secs(10),
            || async { s.broker.queue_exists(&reply).await },
        )
        .await;
        s.broker.delete_at_cleanup(&reply);
        s
    }
}

/// Relay → RabbitMQ → consumer runner (4 lanes) → inbox → confirmation over RabbitMQ →
/// producer, on PostgreSQL: processed messages end CONFIRMED with their effect once, rejected
/// ones REJECTED with the compensation once and no effect, and a lost confirmation is recovered
/// by the check-back (the redelivered copy is a duplicate at the inbox, its verdict is sent
/// again).
#[suite_test(workers = 4)]
async fn consumer_end_to_end_with_confirmations() {
    let s = RabbitSetup::new().await;
    let sender = FaultySender::new(Arc::new(
        RabbitMqConfirmationSender::new(rabbitmq_config(&rabbitmq_url())).unwrap(),
    ));
    let msgs: Vec<NewMessage> = lost_confirmation_messages(&sender)
        .into_iter()
        .enumerate()
        .map(|(i, m)| m.with_partition_key(format!("k{}", i % 3)))
        .collect();
    let handler = ScriptedHandler::new(&s.effects);
    let mut config = consumer_config(&s.broker).with_confirmations(sender.clone());
    config.runner.concurrency = 4;
    let runner =
        Running::spawn(config, &s.inbox, handler.clone()).stopping_within(Duration::from_secs(10));
    let metrics = runner.metrics.clone();
    let ids = s.fx.enqueue_commit(msgs).await.unwrap();
    check_lost_confirmation_outcome(&s, &ids, &sender, &metrics).await;
    runner.stop().await;
    s.finish().await;
}

/// A handler that fails transiently until the `fail_until`-th delivery and records the delivery
/// counts it saw.
struct Flaky {
    fail_until: u32,
    seen: Mutex<Vec<u32>>,
}

#[async_trait]
impl outbox::Handler<sqlx::Sqlite> for Flaky {
    async fn handle(
        &self,
        conn: &mut sqlx::SqliteConnection,
        msg: &InboundMessage,
    ) -> Result<(), HandlerError> {
        self.seen.lock().unwrap().push(msg.delivery_count);
        if msg.delivery_count < self.fail_until {
            return Err(HandlerError::transient(format!(
                "try {} timed out",
                msg.delivery_count
            )));
        }
        crate::inbox::sqlite_effect(conn, msg).await
    }
}

/// A transient handler failure is moved to the retry queue of its backoff step, dead-lettered
/// back by RabbitMQ after the TTL, and delivered again with the next delivery count (1, 2, 3)
/// until it applies; the other message is not held up.
#[suite_test]
async fn consumer_transient_failure_redelivered_with_backoff_then_applied(fx: RabbitMqFixture) {
    let (db, inbox) = sqlite_consumer("flaky").await;
    let handler = Arc::new(Flaky {
        fail_until: 3,
        seen: Mutex::new(Vec::new()),
    });
    let runner = Running::spawn(consumer_config(&fx), &inbox, handler.clone())
        .stopping_within(Duration::from_secs(10));
    let metrics = runner.metrics.clone();
    let m = claimed_message("orders", "flaky");
    let good = fx.good_destination();
    let r = publish_to(fx.transport.as_ref(), std::slice::from_ref(&m), |_| &good).await;
    assert!(r[0].is_ok());
    wait_until("the message to apply", Duration::from_secs(15), || async {
        metrics.applied.load(Ordering::Relaxed) == 1
    })
    .await;
    assert_eq!(*handler.seen.lock().unwrap(), vec![1, 2, 3]);
    assert_eq!(metrics.failures.load(Ordering::Relaxed), 2);
    assert_eq!(metrics.dead_lettered.load(Ordering::Relaxed), 0);
    assert_eq!(sqlite_effects(&db, m.message_id).await, 1);
    // It went through RabbitMQ's retry queues (TTL + dead-letter back), which are empty now.
    let first = retry_queue(&fx.queue, retry_tier(fast_retry().delay_with(1, 0.0)));
    assert!(fx.queue_exists(&first).await, "{first} was used");
    assert_eq!(fx.ready(&first).await, 0);
    runner.stop().await;
}

/// A permanent failure is dead-lettered at once; a message that keeps failing transiently after
/// `max_deliveries` deliveries (the count reaches the inbox through the retry copies); both are
/// acknowledged, the other messages flow.
#[suite_test]
async fn consumer_poison_messages_dead_lettered(fx: RabbitMqFixture) {
    let (_db, inbox) = sqlite_consumer("poison").await;
    let handler = ScriptedHandler::new("effects");
    let mut config = consumer_config(&fx);
    config.runner.max_deliveries = 3;
    let runner =
        Running::spawn(config, &inbox, handler.clone()).stopping_within(Duration::from_secs(10));
    let metrics = runner.metrics.clone();
    let mut msgs = vec![
        claimed_message("orders", "poison-1"),
        claimed_message("orders", "flaky-1"),
    ];
    msgs.extend((0..5).map(|i| claimed_message("orders", format!("ok-{i}"))));
    let good = fx.good_destination();
    let r = publish_to(fx.transport.as_ref(), &msgs, |_| &good).await;
    assert!(r.iter().all(Result::is_ok));
    wait_until(
        "two dead letters and five applied",
        Duration::from_secs(15),
        || async {
            metrics.dead_lettered.load(Ordering::Relaxed) == 2
                && metrics.applied.load(Ordering::Relaxed) == 5
        },
    )
    .await;
    let dlq = inbox.dead_letters(10).await.unwrap();
    assert_eq!(dlq.len(), 2, "{dlq:?}");
    let p = dlq
        .iter()
        .find(|d| d.message.message_id == msgs[0].message_id)
        .unwrap();
    assert_eq!(p.deliveries, 1, "permanent: dead-lettered at once");
    assert!(p.error.contains("cannot parse poison-1"), "{}", p.error);
    let f = dlq
        .iter()
        .find(|d| d.message.message_id == msgs[1].message_id)
        .unwrap();
    assert_eq!(f.deliveries, 3, "transient: after max_deliveries");
    assert!(matches!(
        inbox.verdict(msgs[1].message_id).await.unwrap(),
        Some(Verdict::Rejected { .. })
    ));
    wait_until("the queue to drain", Duration::from_secs(10), || async {
        fx.ready(&fx.queue).await == 0
    })
    .await;
    runner.stop().await;
}

/// A message without the outbox headers is logged, counted and rejected without requeue: it
/// neither blocks the message behind it nor comes back.
#[suite_test]
async fn consumer_malformed_message_rejected_without_blocking(fx: RabbitMqFixture) {
    let (db, inbox) = sqlite_consumer("malformed").await;
    fx.publish_raw(&fx.queue, b"not an outbox message").await;
    let m = claimed_message("orders", "fine");
    let good = fx.good_destination();
    let r = publish_to(fx.transport.as_ref(), std::slice::from_ref(&m), |_| &good).await;
    assert!(r[0].is_ok());
    let handler = Arc::new(EffectHandler::new("effects"));
    let runner = Running::spawn(consumer_config(&fx), &inbox, handler)
        .stopping_within(Duration::from_secs(10));
    let metrics = runner.metrics.clone();
    wait_until(
        "the good message to apply",
        Duration::from_secs(10),
        || async { metrics.applied.load(Ordering::Relaxed) == 1 },
    )
    .await;
    assert_eq!(metrics.malformed.load(Ordering::Relaxed), 1);
    assert_eq!(sqlite_effects(&db, m.message_id).await, 1);
    runner.stop().await;
    // With the consumer gone, anything unacknowledged would be ready again: nothing is.
    wait_until("the consumer to leave", Duration::from_secs(10), || async {
        fx.consumers(&fx.queue).await == 0
    })
    .await;
    assert_eq!(
        fx.ready(&fx.queue).await,
        0,
        "the malformed message was rejected, not requeued"
    );
    assert_eq!(
        metrics.malformed.load(Ordering::Relaxed),
        1,
        "and not delivered again"
    );
}

/// A PostgreSQL handler that records the order in which each key's messages were applied.
struct OrderHandler {
    effects: String,
    order: Mutex<HashMap<String, Vec<u32>>>,
    calls: AtomicU64,
}

#[async_trait]
impl outbox::Handler<sqlx::Postgres> for OrderHandler {
    async fn handle(
        &self,
        conn: &mut PgConnection,
        msg: &InboundMessage,
    ) -> Result<(), HandlerError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        let r = sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {} (message_id, payload) VALUES ($1, $2)",
            self.effects
        )))
        .bind(msg.message_id.to_string())
        .bind(&msg.payload)
        .execute(&mut *conn)
        .await;
        let seq: u32 = String::from_utf8_lossy(&msg.payload).parse().unwrap();
        self.order
            .lock()
            .unwrap()
            .entry(msg.partition_key.clone().unwrap())
            .or_default()
            .push(seq);
        r.map(|_| ()).map_err(HandlerError::transient)
    }
}

/// Per-key order with concurrency 4: 20 keys × 25 messages, published in order; the runner
/// applies different keys in parallel lanes and each key's messages in publish order.
#[suite_test(workers = 4)]
async fn consumer_per_key_order_with_concurrency_4(fx: RabbitMqFixture) {
    let db = PgFixture::new().await;
    let effects = format!("{}.effects", db.schema);
    db.exec(&format!(
        "CREATE TABLE {effects} (message_id text NOT NULL, payload bytea)"
    ))
    .await;
    let inbox = Inbox::<sqlx::Postgres>::new(db.store.pool().clone(), &db.inbox_table(), "ordered")
        .unwrap();
    inbox.migrate().await.unwrap();
    let (keys, per_key) = (20u32, 25u32);
    let mut msgs = Vec::new();
    for seq in 0..per_key {
        for k in 0..keys {
            let mut m = claimed_message("orders", seq.to_string());
            m.partition_key = Some(format!("key-{k}"));
            msgs.push(m);
        }
    }
    let good = fx.good_destination();
    for chunk in msgs.chunks(100) {
        let r = publish_to(fx.transport.as_ref(), chunk, |_| &good).await;
        assert!(r.iter().all(Result::is_ok), "{r:?}");
    }
    let handler = Arc::new(Concurrent::new(OrderHandler {
        effects: effects.clone(),
        order: Mutex::new(HashMap::new()),
        calls: AtomicU64::new(0),
    }));
    let mut config = consumer_config(&fx);
    config.runner.concurrency = 4;
    config.batch = 50;
    let runner =
        Running::spawn(config, &inbox, handler.clone()).stopping_within(Duration::from_secs(10));
    let metrics = runner.metrics.clone();
    let total = u64::from(keys * per_key);
    wait_until("every message applied", Duration::from_secs(30), || async {
        metrics.applied.load(Ordering::Relaxed) == total
    })
    .await;
    let order = handler.inner().order.lock().unwrap().clone();
    assert_eq!(order.len(), keys as usize);
    let expected: Vec<u32> = (0..per_key).collect();
    for (k, seqs) in &order {
        assert_eq!(seqs, &expected, "key {k} out of order");
    }
    assert!(handler.most() >= 2, "lanes ran concurrently");
    assert_eq!(handler.inner().calls.load(Ordering::SeqCst), total);
    assert_eq!(
        pg_count(
            &db,
            &format!("SELECT COUNT(DISTINCT message_id) FROM {effects}")
        )
        .await,
        total as i64
    );
    runner.stop().await;
    db.cleanup().await;
}

/// The runner reports a missing queue as a configuration error naming `queue`, and a broker it
/// cannot reach as `connection.url`.
#[suite_test]
async fn consumer_set_up_errors_name_the_field() {
    // Fails naming OUTBOX_TEST_RABBITMQ_URL when the broker is not there.
    drop(outbox_testkit::rabbitmq::rabbitmq_connection().await);
    let (_db, inbox) = sqlite_consumer("setup").await;
    let handler = Arc::new(EffectHandler::new("effects"));
    let metrics = Arc::new(ConsumerMetrics::default());
    let config = RabbitMqConsumerConfig::new(
        rabbitmq_config(&rabbitmq_url()),
        outbox_testkit::unique("obx_none"),
    );
    let e = outbox::consumer::rabbitmq::run(
        config,
        inbox.clone(),
        handler.clone(),
        metrics.clone(),
        CancellationToken::new(),
    )
    .await
    .unwrap_err();
    assert_eq!(e.field, "queue", "{e}");
    assert!(e.reason.contains("does not exist"), "{e}");
    let port = outbox_testkit::free_port();
    let config = RabbitMqConsumerConfig::new(
        rabbitmq_config(&format!("amqp://guest:guest@127.0.0.1:{port}/%2f")),
        "q",
    );
    let e =
        outbox::consumer::rabbitmq::run(config, inbox, handler, metrics, CancellationToken::new())
            .await
            .unwrap_err();
    assert_eq!(e.field, "connection.url", "{e}");
}
