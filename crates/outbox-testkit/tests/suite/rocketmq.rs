//! RocketMQ against the real name server and broker (`OUTBOX_TEST_ROCKETMQ_URL`, default
//! `rocketmq://127.0.0.1:19876`): what a message carries (keys, tag, properties, queue by
//! partition key), how refusals are classified, the consumer runner end to end through a relay
//! and PostgreSQL with confirmations over RocketMQ, the broker's retry of a failing handler,
//! a consumer group sharing the work, and per-key order with concurrency.

use outbox_testkit_macros::suite_test;
use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use outbox::confirm::rocketmq::{ListenConfig, RocketMqConfirmationSender};
use outbox::consumer::ConsumerMetrics;
use outbox::consumer::rocketmq::RocketMqConsumerConfig;
use outbox::transport::rocketmq::{RocketMqConfig, RocketMqTransport};
use outbox::transport::{Outgoing, Transport};
use outbox::{
    ConfirmationSender, HandlerError, InboundMessage, Inbox, Message, TransportErrorKind, Verdict,
};
use outbox_testkit::rocketmq::{
    RocketMqFixture, create_topic, rocketmq_name_server, rocketmq_transport,
};
use outbox_testkit::{
    FaultProxy, PgFixture, StoreFixture as _, TransportFixture as _, claimed_message, publish_all,
    unique, wait_until,
};
use rocketmq_client_rust::JavaHashCode;
use sqlx::{AssertSqlSafe, PgConnection};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::broker_support::{
    ConsumerTask, Listener, Running, pg_inbox, spawn_consumer, stop_consumer,
};
use crate::confirm::{
    FaultySender, PgProducer, ScriptedHandler, check_lost_confirmation_outcome_within, fast_retry,
    lost_confirmation_messages,
};

/// How long a RocketMQ consumer or listener may take to stop: 30 s (the client leaves its
/// rebalance and pull loops slowly).
const ROCKETMQ_STOPS_WITHIN: Duration = Duration::from_secs(30);

async fn publish(t: &dyn Transport, msgs: &[Message], dest: &str) -> Vec<outbox::TransportError> {
    publish_all(t, msgs, dest)
        .await
        .into_iter()
        .filter_map(Result::err)
        .collect()
}

/// Publish one message to `dest` through `t`: it fails alone, with an error of `kind`; that error.
async fn refused_as(
    t: &dyn Transport,
    dest: &str,
    kind: TransportErrorKind,
) -> outbox::TransportError {
    let mut e = publish(t, &[claimed_message("t", "x")], dest).await;
    assert_eq!(e.len(), 1);
    assert_eq!(e[0].kind(), kind, "{}", e[0].report());
    e.remove(0)
}

fn keyed(topic: &str, key: &str, payload: impl Into<Vec<u8>>) -> Message {
    let mut m = claimed_message(topic, payload);
    m.partition_key = Some(key.into());
    m
}

/// `UNIQ_KEY` and the first key are the message id, the partition key is the second key, the
/// destination's tag is the tag, every wire header is a user property (traceparent included),
/// the body is byte-exact, and one key's messages share the queue Java's hash selector picks,
/// in batch order.
#[suite_test]
async fn rocketmq_keys_tags_and_properties_are_carried(fx: RocketMqFixture) {
    let mut first = keyed("orders.created", "order-7", "{\"n\":1}");
    first.headers.insert(
        "traceparent".into(),
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".into(),
    );
    let second = keyed("orders.created", "order-7", "{\"n\":2}");
    let unkeyed = claimed_message("orders.created", vec![0u8, 0xff, 7]);
    let dest = format!("{}:created", fx.topic);
    let errors = publish(
        fx.transport.as_ref(),
        &[first.clone(), second.clone(), unkeyed.clone()],
        &dest,
    )
    .await;
    assert!(errors.is_empty(), "{errors:?}");
    let stored = fx.messages().await;
    assert_eq!(stored.len(), 3);
    let find = |id: Uuid| {
        stored
            .iter()
            .find(|m| m.properties().get("UNIQ_KEY").map(|v| v.as_str()) == Some(&id.to_string()))
            .unwrap_or_else(|| panic!("message {id} not stored with its UNIQ_KEY"))
    };
    let (a, b, c) = (
        find(first.message_id),
        find(second.message_id),
        find(unkeyed.message_id),
    );
    let prop = |m: &rocketmq_model::common::message::message_ext::MessageExt, k: &str| {
        m.properties().get(k).map(|v| v.to_string())
    };
    assert_eq!(
        prop(a, "KEYS"),
        Some(format!("{} order-7", first.message_id))
    );
    assert_eq!(prop(c, "KEYS"), Some(unkeyed.message_id.to_string()));
    assert_eq!(prop(a, "TAGS").as_deref(), Some("created"));
    assert_eq!(
        prop(a, "traceparent").as_deref(),
        Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
    );
    assert_eq!(
        prop(a, "outbox-message-id"),
        Some(first.message_id.to_string())
    );
    assert_eq!(prop(a, "outbox-topic").as_deref(), Some("orders.created"));
    assert_eq!(prop(a, "outbox-partition-key").as_deref(), Some("order-7"));
    assert_eq!(prop(a, "outbox-attempt").as_deref(), Some("1"));
    assert_eq!(a.body().unwrap().as_ref(), b"{\"n\":1}");
    assert_eq!(c.body().unwrap().as_ref(), &[0u8, 0xff, 7]);
    let queue = ("order-7".java_hash_code() % 4).abs();
    assert_eq!(a.queue_id(), queue, "the key's queue");
    assert_eq!(b.queue_id(), queue, "the key's queue");
    assert!(
        a.queue_offset() < b.queue_offset(),
        "one key's messages in batch order"
    );
    // The consumer side reads the same message back.
    let inbound = outbox::consumer::rocketmq::inbound(a).unwrap();
    assert_eq!(inbound.message_id, first.message_id);
    assert_eq!(inbound.partition_key.as_deref(), Some("order-7"));
    assert_eq!(inbound.delivery_count, 1);
    assert!(
        !inbound.headers.contains_key("KEYS"),
        "system properties are not headers"
    );
}

/// Refusals are permanent and reported at their own position, while the rest of the batch is
/// acknowledged: an empty body, a header named like a system property, a body over the
/// transport's `max_message_size`, a body over the broker's `maxMessageSize` (the broker's
/// `MESSAGE_ILLEGAL`, with the client's limit raised above it), a destination that is not a
/// topic name, a system topic.
#[suite_test]
async fn rocketmq_refusals_are_permanent_and_the_rest_goes_through() {
    let mut config = RocketMqConfig::new(rocketmq_name_server());
    config.max_message_size = 16 * 1024 * 1024;
    config.send_timeout = Duration::from_secs(10);
    let fx = RocketMqFixture::with_config(config).await;
    let dest = fx.topic.clone();
    let empty = claimed_message("t", Vec::<u8>::new());
    let mut system_header = claimed_message("t", "x");
    system_header.headers.insert("KEYS".into(), "mine".into());
    // Random bytes: the client compresses bodies over 4 KiB, so a repetitive body would shrink.
    let over_broker: Vec<u8> = (0..4 * 1024 * 1024 + 4096)
        .map(|_| rand::random())
        .collect();
    let over_broker = claimed_message("t", over_broker);
    let over_client = claimed_message("t", vec![1u8; 16 * 1024 * 1024 + 1]);
    let ok = claimed_message("t", "fine");
    let msgs = [empty, system_header, over_broker, over_client, ok];
    let mut batch: Vec<Outgoing<'_>> = msgs
        .iter()
        .map(|m| Outgoing {
            message: m,
            destination: &dest,
        })
        .collect();
    let bad_topic = format!("{}.x", fx.topic);
    let not_ours = claimed_message("t", "x");
    let system = claimed_message("t", "x");
    batch.push(Outgoing {
        message: &not_ours,
        destination: &bad_topic,
    });
    batch.push(Outgoing {
        message: &system,
        destination: "SCHEDULE_TOPIC_XXXX",
    });
    let results = fx.transport.publish(&batch).await;
    assert_eq!(results.len(), 7);
    for (i, r) in results.iter().enumerate() {
        if i == 4 {
            assert!(r.is_ok(), "the good message: {r:?}");
        } else {
            let e = r.as_ref().expect_err("refused message acknowledged");
            assert_eq!(
                e.kind(),
                TransportErrorKind::Permanent,
                "message {i}: {}",
                e.report()
            );
        }
    }
    let e = results[2].as_ref().unwrap_err().report();
    assert!(!e.is_empty());
    assert_eq!(fx.stored().await, 1, "only the good message is stored");
    fx.cleanup().await;
}

/// A topic the name server has no route for, while the name server answers, is retryable with
/// a reason that names the missing route: the client reports the same "No route info" when its
/// own route lookup failed under load, so it cannot be called permanent (the relay backs it off
/// and dead-letters it after the last attempt). The broker `.ci/run` starts creates topics
/// (`autoCreateTopicEnable`), so the test takes away the route the client borrows for unknown
/// topics (`createTopicKey`), which is what a broker without auto-creation looks like to it.
#[suite_test]
async fn rocketmq_unknown_topic_without_auto_create_is_retryable() {
    let mut config = RocketMqConfig::new(rocketmq_name_server());
    config.create_topic_key = Some("outbox_no_default_route".into());
    let t = RocketMqTransport::connect(config).await.unwrap();
    let e = refused_as(&t, &unique("obx_missing"), TransportErrorKind::Retryable).await;
    assert!(e.message().contains("no such topic"), "{}", e.report());
    t.probe().await.expect("the name server answers");
    t.shutdown().await;
}

/// The name server behind a proxy that cuts connections: a send that needs a route fails
/// `Unavailable` (not permanent, no attempt burned), the probe says unavailable, and both recover
/// when the network does.
#[suite_test]
async fn rocketmq_name_server_down_is_unavailable_then_recovers() {
    let ns = rocketmq_name_server();
    let upstream = ns.split(';').next().unwrap().to_owned();
    let proxy = FaultProxy::start(upstream).await;
    let mut config = RocketMqConfig::new(proxy.addr.to_string());
    config.send_timeout = Duration::from_secs(3);
    let t = rocketmq_transport(config).await;
    proxy.set_blocked(true);
    let e = t.probe().await.unwrap_err();
    assert_eq!(e.kind(), TransportErrorKind::Unavailable, "{e:?}");
    let fresh = unique("obx_unrouted");
    refused_as(&t, &fresh, TransportErrorKind::Unavailable).await;
    proxy.set_blocked(false);
    // The client reconnects by itself; on a loaded machine the first probe may still see the
    // old connection's failure.
    wait_until(
        "a probe after the network is back",
        Duration::from_secs(30),
        || {
            let t = t.clone();
            async move { t.probe().await.is_ok() }
        },
    )
    .await;
    wait_until(
        "a send after the network is back",
        Duration::from_secs(30),
        || {
            let t = t.clone();
            let m = claimed_message("t", "x");
            let fresh = fresh.clone();
            async move { publish(&t, &[m], &fresh).await.is_empty() }
        },
    )
    .await;
    t.shutdown().await;
}

/// A PostgreSQL handler recording each application as a row of `applied` (with a serial, the
/// consumer instance, the partition key and the delivery count), failing transiently while a
/// `flaky…` message's delivery count is below `succeed_at`; every attempt's delivery count is
/// kept in memory.
struct RecordingHandler {
    applied: String,
    instance: String,
    succeed_at: u32,
    attempts: Mutex<Vec<(Uuid, u32)>>,
}

impl RecordingHandler {
    fn new(applied: &str, instance: &str, succeed_at: u32) -> Arc<Self> {
        Arc::new(RecordingHandler {
            applied: applied.into(),
            instance: instance.into(),
            succeed_at,
            attempts: Mutex::default(),
        })
    }

    fn deliveries_of(&self, id: Uuid) -> Vec<u32> {
        self.attempts
            .lock()
            .unwrap()
            .iter()
            .filter(|(i, _)| *i == id)
            .map(|(_, d)| *d)
            .collect()
    }
}

#[async_trait]
impl outbox::Handler<sqlx::Postgres> for RecordingHandler {
    async fn handle(
        &self,
        conn: &mut PgConnection,
        msg: &InboundMessage,
    ) -> Result<(), HandlerError> {
        self.attempts
            .lock()
            .unwrap()
            .push((msg.message_id, msg.delivery_count));
        if msg.payload.starts_with(b"flaky") && msg.delivery_count < self.succeed_at {
            return Err(HandlerError::transient(format!(
                "not yet (delivery {})",
                msg.delivery_count
            )));
        }
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {} (instance, message_id, pkey, payload, deliveries) VALUES ($1, $2, $3, $4, $5)",
            self.applied
        )))
        .bind(&self.instance)
        .bind(msg.message_id)
        .bind(&msg.partition_key)
        .bind(&msg.payload)
        .bind(i32::try_from(msg.delivery_count).unwrap_or(i32::MAX))
        .execute(&mut *conn)
        .await
        .map_err(HandlerError::transient)?;
        Ok(())
    }
}

/// A consumer side on PostgreSQL: an inbox `billing` and an `applied` table in a fresh schema,
/// and a RocketMQ topic.
struct ConsumerSide {
    pg: PgFixture,
    mq: RocketMqFixture,
    inbox: Inbox<sqlx::Postgres>,
    applied: String,
}

impl ConsumerSide {
    async fn new() -> ConsumerSide {
        let pg = PgFixture::new().await;
        let mq = RocketMqFixture::new().await;
        let applied = format!("{}.applied", pg.schema);
        pg.exec(&format!(
            "CREATE TABLE {applied} (seq bigserial PRIMARY KEY, instance text NOT NULL, \
             message_id uuid NOT NULL, pkey text, payload bytea, deliveries int NOT NULL)"
        ))
        .await;
        let inbox = pg_inbox(&pg).await;
        ConsumerSide {
            pg,
            mq,
            inbox,
            applied,
        }
    }

    fn config(&self) -> RocketMqConsumerConfig {
        let mut c = RocketMqConsumerConfig::new(
            rocketmq_name_server(),
            format!("{}_billing", self.mq.topic),
            self.mq.topic.clone(),
        );
        c.runner.retry = fast_retry();
        c.route_refresh = Duration::from_secs(10);
        c.runner.maintenance_interval = Duration::from_millis(200);
        c
    }

    async fn count(&self, filter: &str) -> i64 {
        self.pg.count(&format!("{} {filter}", self.applied)).await
    }

    async fn finish(self) {
        self.mq.cleanup().await;
        self.pg.cleanup().await;
    }
}

/// Wait until `cond` holds; fail at once with the runner's error if a consumer runner ended.
async fn wait_running<F, Fut>(
    what: &str,
    timeout: Duration,
    runners: &mut [&mut ConsumerTask],
    mut cond: F,
) where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    wait_until(what, timeout, || {
        let ended = runners.iter().any(|r| r.is_finished());
        let fut = cond();
        async move { ended || fut.await }
    })
    .await;
    for r in runners.iter_mut() {
        if r.is_finished() {
            match r.await {
                Ok(Ok(())) => panic!("a consumer runner stopped before {what}"),
                Ok(Err(e)) => panic!("a consumer runner failed before {what}: {e}"),
                Err(e) => panic!("a consumer runner panicked before {what}: {e}"),
            }
        }
    }
}

/// A transiently failing handler is retried by the broker (`CONSUMER_SEND_MSG_BACK` to the
/// group's retry topic, delivery count from `reconsumeTimes`) until it passes at the third
/// delivery; it is applied once, and the other message of the batch once at its first delivery.
#[suite_test(workers = 4)]
async fn rocketmq_failing_handler_is_retried_by_the_broker_then_applied() {
    let s = ConsumerSide::new().await;
    let handler = RecordingHandler::new(&s.applied, "a", 3);
    let mut consumer = Running::spawn(s.config(), &s.inbox, handler.clone())
        .stopping_within(ROCKETMQ_STOPS_WITHIN);
    let metrics = consumer.metrics.clone();
    let flaky = claimed_message("orders", "flaky-1");
    let ok = claimed_message("orders", "ok-1");
    let errors = publish(
        s.mq.transport.as_ref(),
        &[flaky.clone(), ok.clone()],
        &s.mq.topic,
    )
    .await;
    assert!(errors.is_empty(), "{errors:?}");
    wait_running(
        "both messages applied",
        Duration::from_secs(60),
        &mut [&mut consumer.task],
        || async { s.count("").await == 2 },
    )
    .await;
    assert_eq!(handler.deliveries_of(flaky.message_id), vec![1, 2, 3]);
    assert_eq!(handler.deliveries_of(ok.message_id), vec![1]);
    assert_eq!(
        s.count(&format!(
            "WHERE message_id = '{}' AND deliveries = 3",
            flaky.message_id
        ))
        .await,
        1
    );
    assert_eq!(
        s.inbox.verdict(flaky.message_id).await.unwrap(),
        Some(Verdict::Processed)
    );
    assert_eq!(metrics.failures.load(Ordering::Relaxed), 2);
    assert_eq!(metrics.applied.load(Ordering::Relaxed), 2);
    assert_eq!(metrics.dead_lettered.load(Ordering::Relaxed), 0);
    consumer.stop().await;
    s.finish().await;
}

/// Two instances of one consumer group share the topic's queues: both apply messages, and every
/// message is applied exactly once.
#[suite_test(workers = 4)]
async fn rocketmq_group_members_share_the_work_and_apply_each_message_once() {
    let s = ConsumerSide::new().await;
    let (a, b) = (
        RecordingHandler::new(&s.applied, "a", 1),
        RecordingHandler::new(&s.applied, "b", 1),
    );
    let metrics = Arc::new(ConsumerMetrics::default());
    let cancel = CancellationToken::new();
    let mut first = spawn_consumer(s.config(), &s.inbox, a, metrics.clone(), cancel.clone());
    let mut second = spawn_consumer(s.config(), &s.inbox, b, metrics.clone(), cancel.clone());
    let mut sent = Vec::new();
    // Publish rounds (keys spread over the four queues) until both members applied some: the
    // second member gets its queues at the group's next rebalance.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
    loop {
        let round: Vec<Message> = (0..16)
            .map(|i| keyed("orders", &format!("k{i}"), format!("m{}", sent.len() + i)))
            .collect();
        let errors = publish(s.mq.transport.as_ref(), &round, &s.mq.topic).await;
        assert!(errors.is_empty(), "{errors:?}");
        sent.extend(round.iter().map(|m| m.message_id));
        let n = sent.len() as i64;
        wait_running(
            "the round applied",
            Duration::from_secs(60),
            &mut [&mut first, &mut second],
            || async { s.count("").await >= n },
        )
        .await;
        let both =
            s.count("WHERE instance = 'a'").await > 0 && s.count("WHERE instance = 'b'").await > 0;
        if both {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the second group member never received a share of the queues"
        );
    }
    let per_message: Vec<(Uuid, i64)> = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT message_id, COUNT(*) FROM {} GROUP BY message_id",
        s.applied
    )))
    .fetch_all(s.pg.store.pool())
    .await
    .unwrap();
    assert_eq!(per_message.len(), sent.len());
    assert!(per_message.iter().all(|(_, n)| *n == 1), "{per_message:?}");
    assert_eq!(metrics.applied.load(Ordering::Relaxed), sent.len() as u64);
    stop_consumer(cancel.clone(), first, ROCKETMQ_STOPS_WITHIN).await;
    stop_consumer(cancel, second, ROCKETMQ_STOPS_WITHIN).await;
    s.finish().await;
}

/// Batches of 16 applied in 4 lanes keep each partition key's order; a foreign message without
/// outbox properties is counted as malformed and consumed without blocking the others.
#[suite_test(workers = 4)]
async fn rocketmq_per_key_order_with_concurrency_and_malformed_consumed() {
    let s = ConsumerSide::new().await;
    let foreign = rocketmq_model::common::message::message_single::Message::builder()
        .topic(s.mq.topic.as_str())
        .body_slice(b"not an outbox message")
        .build()
        .unwrap();
    let r =
        s.mq.transport
            .producer()
            .send_with_timeout(foreign, 5000)
            .await
            .expect("foreign send");
    assert!(r.is_some());
    let keys = ["alpha", "bravo", "charlie", "delta", "echo"];
    let msgs: Vec<Message> = (0..20)
        .flat_map(|seq| {
            keys.iter()
                .map(move |k| keyed("orders", k, format!("{seq:03}")))
        })
        .collect();
    let errors = publish(s.mq.transport.as_ref(), &msgs, &s.mq.topic).await;
    assert!(errors.is_empty(), "{errors:?}");
    let handler = RecordingHandler::new(&s.applied, "a", 1);
    let mut config = s.config();
    config.batch = 16;
    config.runner.concurrency = 4;
    let mut consumer =
        Running::spawn(config, &s.inbox, handler).stopping_within(ROCKETMQ_STOPS_WITHIN);
    let metrics = consumer.metrics.clone();
    wait_running(
        "all applied",
        Duration::from_secs(60),
        &mut [&mut consumer.task],
        || async { s.count("").await == msgs.len() as i64 },
    )
    .await;
    wait_until(
        "the foreign message counted",
        Duration::from_secs(10),
        || async { metrics.malformed.load(Ordering::Relaxed) == 1 },
    )
    .await;
    let rows: Vec<(String, Vec<u8>)> = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT pkey, payload FROM {} ORDER BY seq",
        s.applied
    )))
    .fetch_all(s.pg.store.pool())
    .await
    .unwrap();
    let mut by_key: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (k, p) in rows {
        by_key
            .entry(k)
            .or_default()
            .push(String::from_utf8(p).unwrap());
    }
    for (k, seqs) in &by_key {
        let mut sorted = seqs.clone();
        sorted.sort();
        assert_eq!(seqs, &sorted, "key {k} applied out of order");
        assert_eq!(seqs.len(), 20);
    }
    assert_eq!(by_key.len(), keys.len());
    consumer.stop().await;
    s.finish().await;
}

/// End to end: PostgreSQL producer with a compensation hook, a relay publishing through RocketMQ
/// (`Topic:{topic}`), the consumer runner applying through a PostgreSQL inbox, confirmations back
/// over RocketMQ to the producer's listener. Processed messages end CONFIRMED with their effect
/// once; rejected ones REJECTED with the compensation run once; a lost confirmation is recovered
/// by the check-back (the copy is a duplicate at the inbox, its verdict is sent again).
#[suite_test(workers = 4)]
async fn rocketmq_postgres_confirmed_rejected_and_lost_confirmation() {
    let mq = RocketMqFixture::new().await;
    let ns = rocketmq_name_server();
    let reply_topic = format!("{}_confirm", mq.topic);
    create_topic(&mq.transport, &reply_topic).await;
    let reply = format!("{reply_topic}:producer");
    let p = PgProducer::start_with_timeout(
        mq.transport.clone(),
        format!("{}:{{topic}}", mq.topic),
        reply.clone(),
        Duration::from_secs(3),
    )
    .await;
    let mut listen = ListenConfig::new(ns.clone(), reply.clone(), format!("{}_producer", mq.topic));
    listen.route_refresh = Duration::from_secs(10);
    let listener =
        Listener::spawn(|stop| outbox::confirm::rocketmq::listen(listen, p.store.clone(), stop))
            .stopping_within(ROCKETMQ_STOPS_WITHIN);
    let mut sender_config = RocketMqConfig::new(ns.clone());
    sender_config.producer_group = format!("{}_confirmer", mq.topic);
    let real: Arc<dyn ConfirmationSender> = Arc::new(
        RocketMqConfirmationSender::connect(sender_config)
            .await
            .unwrap(),
    );
    let sender = FaultySender::new(real);
    let msgs = lost_confirmation_messages(&sender);
    let handler = ScriptedHandler::new(&p.effects);
    let mut config = RocketMqConsumerConfig::new(
        ns.clone(),
        format!("{}_billing", mq.topic),
        mq.topic.clone(),
    )
    .with_confirmations(sender.clone());
    config.tags = "orders".into();
    config.runner.retry = fast_retry();
    config.route_refresh = Duration::from_secs(10);
    config.runner.concurrency = 4;
    let consumer = Running::spawn(config, &p.inbox, handler).stopping_within(ROCKETMQ_STOPS_WITHIN);
    let ids = p.fx.enqueue_commit(msgs).await.unwrap();
    check_lost_confirmation_outcome_within(
        &p,
        &ids,
        &sender,
        &consumer.metrics,
        Duration::from_secs(60),
    )
    .await;
    consumer.stop().await;
    let report = listener.report().await;
    assert!(report.confirmed >= 11, "{report:?}");
    assert!(report.rejected >= 3, "{report:?}");
    mq.cleanup().await;
    p.finish().await;
}
