//! Kafka against a real Kafka-protocol broker (Tansu in CI, `OUTBOX_TEST_KAFKA_URL`): record
//! key and partition, classification (too large, unknown topic, broker down), the idempotent
//! producer, shared case C07 through a real relay and PostgreSQL store, and the consumer runner
//! end to end (inbox, confirmations over Kafka, redelivery with backoff in order, per-key order
//! with concurrency, malformed records).
//!
//! Tansu's consumer groups can take many seconds for their first read (5 to 23 s seen on its
//! memory engine), so the consumer tests wait up to 90 s for the first deliveries.

use outbox_testkit_macros::suite_test;
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use outbox::confirm::kafka::KafkaConfirmationSender;
use outbox::consumer::ConsumerMetrics;
use outbox::consumer::kafka::KafkaConsumerConfig;
use outbox::store::Store;
use outbox::transport::Transport;
use outbox::transport::kafka::KafkaTopic;
use outbox::{
    ConfirmPolicy, HandlerError, InboundMessage, Inbox, KafkaConfig, KafkaTransport, Limits,
    NewMessage, PgStore, Relay, RelayConfig, RelayHandle, Router, Status, StoreOptions,
    TransportErrorKind,
};
use outbox_testkit::kafka::{kafka_config, read_keyed, read_partition};
use outbox_testkit::{
    Concurrent, ConfirmFixture, HookControl, KafkaFixture, PgFixture, StoreFixture,
    TransportFixture as _, claimed_message, publish_all, unique, wait_until,
};
use sqlx::{AssertSqlSafe, PgConnection};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::broker_support::{Listener, Running, pg_effects, pg_inbox};
use crate::confirm::{ScriptedHandler, confirm_config, fast_retry, pg_count, wait_status};

/// First deliveries through a consumer group on Tansu can take this long.
const GROUP_START: Duration = Duration::from_secs(90);

/// The relay settings of these tests: a publish timeout above the transport's 5 s delivery
/// timeout (librdkafka reports every record before the relay gives up on a batch).
fn kafka_relay_config(name: &str) -> RelayConfig {
    RelayConfig {
        publish_timeout: Duration::from_secs(7),
        lease: Duration::from_secs(21),
        ..confirm_config(name)
    }
}

/// The record key is the partition key, or the message id for a message without one; every
/// record of one key lands in one partition (of four), in publish order.
#[suite_test]
async fn kafka_partition_key_is_the_record_key(fx: KafkaFixture) {
    let topic = fx.topic("keyed", 4).await;
    let mut msgs: Vec<_> = (0..12)
        .map(|i| {
            let mut m = claimed_message("orders", format!("{i}"));
            m.partition_key = Some("order-7".into());
            m
        })
        .collect();
    msgs.push(claimed_message("orders", "unkeyed"));
    for r in publish_all(fx.transport().as_ref(), &msgs, &topic).await {
        r.expect("acknowledged");
    }
    let mut keyed_partitions = Vec::new();
    let mut unkeyed = None;
    for p in 0..4 {
        let records = read_keyed(&topic, p).await;
        let payloads: Vec<String> = records
            .iter()
            .filter(|(k, _)| k.as_deref() == Some(b"order-7".as_slice()))
            .map(|(_, r)| String::from_utf8(r.payload.clone()).unwrap())
            .collect();
        if !payloads.is_empty() {
            keyed_partitions.push(p);
            let expected: Vec<String> = (0..12).map(|i| i.to_string()).collect();
            assert_eq!(payloads, expected, "one key's records in publish order");
        }
        if let Some((k, r)) = records.iter().find(|(_, r)| r.payload == b"unkeyed") {
            unkeyed = Some((k.clone(), r.clone()));
        }
    }
    assert_eq!(keyed_partitions.len(), 1, "one key, one partition");
    let (key, r) = unkeyed.expect("unkeyed record stored");
    let id = msgs[12].message_id.to_string();
    assert_eq!(
        key.as_deref(),
        Some(id.as_bytes()),
        "no partition key: keyed by message id"
    );
    assert_eq!(r.native_id.as_deref(), Some(id.as_str()));
    assert!(!r.headers.contains_key("outbox-partition-key"));
}

/// A record over `message.max.bytes` is permanent and does not affect the next record of the
/// same batch and partition; an unknown topic is a missing destination (`Unavailable`: the
/// relay pauses the transport and dead-letters only after `missing_destination_grace`; topics
/// are created by deployments, see `outbox::transport::kafka`).
#[suite_test]
async fn kafka_too_large_is_permanent_and_unknown_topic_a_missing_destination(fx: KafkaFixture) {
    let dest = fx.good_destination();
    let big = claimed_message("t", vec![7u8; 1_100_000]);
    let small = claimed_message("t", "small");
    let r = publish_all(fx.transport().as_ref(), &[big, small], &dest).await;
    let e = r[0].as_ref().unwrap_err();
    assert_eq!(e.kind(), TransportErrorKind::Permanent, "{e:?}");
    assert!(e.report().contains("too large"), "{}", e.report());
    assert!(r[1].is_ok(), "the next record is unaffected: {:?}", r[1]);
    assert_eq!(fx.received().await.len(), 1);

    let unknown = format!("{}.never_created", fx.prefix);
    let r = publish_all(
        fx.transport().as_ref(),
        &[claimed_message("t", "x")],
        &unknown,
    )
    .await;
    let e = r[0].as_ref().unwrap_err();
    assert_eq!(e.kind(), TransportErrorKind::Unavailable, "{e:?}");
    assert!(e.is_missing_destination(), "{e:?}");
}

/// Nothing listening at the bootstrap address: publishes fail `Unavailable` (not a burned
/// attempt) and so does the probe; `connect` names `bootstrap_servers`.
#[suite_test]
async fn kafka_broker_down_is_unavailable() {
    let port = outbox_testkit::free_port();
    let mut config = KafkaConfig::new(format!("127.0.0.1:{port}"));
    config.delivery_timeout = Duration::from_millis(1500);
    config.connect_timeout = Duration::from_secs(1);
    let e = KafkaTransport::connect(config.clone()).await.unwrap_err();
    assert_eq!(e.field, "bootstrap_servers", "{e}");
    let t = KafkaTransport::new(config).unwrap();
    let r = publish_all(&t, &[claimed_message("t", "x")], "orders").await;
    let e = r[0].as_ref().unwrap_err();
    assert_eq!(e.kind(), TransportErrorKind::Unavailable, "{e:?}");
    let e = t.probe().await.unwrap_err();
    assert_eq!(e.kind(), TransportErrorKind::Unavailable, "{e:?}");
}

/// The producer is idempotent: librdkafka's statistics show the producer id the broker assigned
/// (InitProducerId), which only an idempotent producer asks for.
#[suite_test]
async fn kafka_idempotent_producer_is_on() {
    let mut config = kafka_config();
    config
        .properties
        .insert("statistics.interval.ms".into(), "100".into());
    let fx = KafkaFixture::with_config(config).await;
    let r = publish_all(
        fx.transport().as_ref(),
        &[claimed_message("t", "x")],
        &fx.good_destination(),
    )
    .await;
    r[0].as_ref().expect("acknowledged");
    let state = fx.transport.state().clone();
    wait_until(
        "the idempotent producer's id in the statistics",
        Duration::from_secs(10),
        || {
            let state = state.idempotence();
            async move { matches!(state, Some((ref s, id)) if s == "Assigned" && id >= 0) }
        },
    )
    .await;
    fx.cleanup().await;
}

/// Shared case C07 through a real relay, PostgreSQL store and broker: one transaction enqueues
/// M1 (2 MiB, key K1), M2 (1 KiB, key K2) and M3 (1 KiB, key K1) for a topic whose
/// `max.message.bytes` is 1 MiB. M2 is delivered; M1 is FAILED after one attempt with the reason
/// stored; M3 is released: topics are unordered (docs/architecture.md, "Ordering"), so a dead
/// M1 does not hold back the later message of its key, which is delivered. The relay keeps
/// running: a message enqueued afterwards is delivered too.
#[suite_test]
async fn c07_kafka_oversize_record_dead_letters_only_itself(fx: PgFixture) {
    let mut config = kafka_config();
    config.max_message_bytes = 1024 * 1024;
    let kafka = KafkaFixture::with_config(config).await;
    let topic = kafka
        .topic_with(
            KafkaTopic::new(format!("{}.c07", kafka.prefix)).config("max.message.bytes", "1048576"),
        )
        .await;
    // The producer's store accepts payloads up to 4 MiB, so the 2 MiB message reaches the broker.
    let store = PgStore::from_pool(
        fx.store.pool().clone(),
        StoreOptions {
            limits: Limits {
                max_payload_bytes: 4 * 1024 * 1024,
                ..Limits::default()
            },
            ..StoreOptions::table(fx.table())
        },
    )
    .unwrap();
    let m1 = NewMessage::new("c07", vec![1u8; 2 * 1024 * 1024]).with_partition_key("K1");
    let m2 = NewMessage::new("c07", vec![2u8; 1024]).with_partition_key("K2");
    let m3 = NewMessage::new("c07", vec![3u8; 1024]).with_partition_key("K1");
    let ids = [m1.message_id(), m2.message_id(), m3.message_id()];
    let mut tx = store.pool().begin().await.unwrap();
    for m in [m1, m2, m3] {
        store.enqueue(&mut tx, m).await.unwrap();
    }
    tx.commit().await.unwrap();
    let relay = Relay::builder(Arc::new(store.clone()))
        .router(Router::new().route("*", kafka.transport.clone(), topic.clone()))
        .config(kafka_relay_config("c07"))
        .build()
        .unwrap()
        .spawn();
    wait_status(&fx, &ids[1..], Status::Sent, Duration::from_secs(20)).await;
    wait_status(&fx, &ids[..1], Status::Failed, Duration::from_secs(20)).await;
    let r1 = fx.row(ids[0]).await;
    assert_eq!(r1.attempts, 1, "one attempt, no retry: {r1:?}");
    let reason = r1.last_error.unwrap_or_default();
    assert!(reason.contains("too large"), "reason stored: {reason}");
    let failed = store.failed(10).await.unwrap();
    assert_eq!(failed.len(), 1);
    assert_eq!(failed[0].message_id, ids[0].to_string());
    for id in &ids[1..] {
        assert_eq!(fx.row(*id).await.attempts, 1);
    }
    let received = read_partition(&topic, 0).await;
    let got: Vec<Uuid> = received
        .iter()
        .filter_map(outbox_testkit::header_message_id)
        .collect();
    assert_eq!(got, vec![ids[1], ids[2]], "M2 and M3 delivered, M1 not");
    // The poll loop keeps running.
    let later = fx
        .enqueue_commit(vec![NewMessage::new("c07", "later")])
        .await
        .unwrap();
    wait_status(&fx, &later, Status::Sent, Duration::from_secs(20)).await;
    relay.shutdown().await.unwrap();
    kafka.cleanup().await;
}

/// A handler that records each application as a row `(n bigserial, key, payload, delivery)`,
/// pauses `pause` after it, and fails transiently for the payloads in `failures` as many times as
/// given.
struct KeyedHandler {
    effects: String,
    failures: Mutex<HashMap<String, u32>>,
    pause: Duration,
}

impl KeyedHandler {
    fn new(effects: &str, pause: Duration) -> Self {
        KeyedHandler {
            effects: effects.into(),
            failures: Mutex::default(),
            pause,
        }
    }
}

#[async_trait]
impl outbox::Handler<sqlx::Postgres> for KeyedHandler {
    async fn handle(
        &self,
        conn: &mut PgConnection,
        msg: &InboundMessage,
    ) -> Result<(), HandlerError> {
        let payload = String::from_utf8_lossy(&msg.payload).into_owned();
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {} (message_id, key, payload, delivery) VALUES ($1, $2, $3, $4)",
            self.effects
        )))
        .bind(msg.message_id.to_string())
        .bind(msg.partition_key.clone())
        .bind(&payload)
        .bind(msg.delivery_count as i32)
        .execute(&mut *conn)
        .await
        .map_err(HandlerError::transient)?;
        if !self.pause.is_zero() {
            tokio::time::sleep(self.pause).await;
        }
        let mut failures = self.failures.lock().unwrap();
        if let Some(n) = failures.get_mut(&payload)
            && *n > 0
        {
            *n -= 1;
            return Err(HandlerError::transient(format!("{payload} failed (test)")));
        }
        Ok(())
    }
}

/// The consumer side of a test: PostgreSQL producer with a compensation hook, a relay routing
/// every topic to one Kafka topic with confirmations over a reply topic, the producer's Kafka
/// confirmation listener, and an inbox plus an effects table in the same database.
struct KafkaSetup {
    fx: PgFixture,
    kafka: KafkaFixture,
    ctl: Arc<HookControl>,
    relay: RelayHandle,
    inbox: Inbox<sqlx::Postgres>,
    effects: String,
    topic: String,
    listener: Listener,
}

impl KafkaSetup {
    async fn new(partitions: i32) -> KafkaSetup {
        let fx = PgFixture::new().await;
        let kafka = KafkaFixture::new().await;
        let topic = kafka.topic("orders", partitions).await;
        let reply = kafka.topic("confirm", 2).await;
        let ctl = Arc::new(HookControl::default());
        let store = fx.store_with_hook(ctl.clone()).await;
        let effects = pg_effects(
            &fx,
            "n bigserial PRIMARY KEY, message_id text NOT NULL, key text, payload text, \
             delivery int",
        )
        .await;
        // Long enough that a slow consumer-group start is not mistaken for a lost confirmation.
        let policy = ConfirmPolicy {
            reply_to: reply.clone(),
            timeout: Duration::from_secs(180),
        };
        let relay = Relay::builder(store.clone())
            .router(Router::new().route_confirmed(
                "*",
                kafka.transport.clone(),
                topic.clone(),
                policy,
            ))
            .config(kafka_relay_config("r1"))
            .build()
            .expect("relay")
            .spawn();
        let listener = Listener::spawn(|stop| {
            outbox::confirm::kafka::listen(kafka_config(), reply, unique("producer"), store, stop)
        });
        let inbox = pg_inbox(&fx).await;
        KafkaSetup {
            fx,
            kafka,
            ctl,
            relay,
            inbox,
            effects,
            topic,
            listener,
        }
    }

    fn consumer_config(&self, concurrency: usize) -> KafkaConsumerConfig {
        let sender = KafkaConfirmationSender::from_transport(&self.kafka.transport);
        let mut c =
            KafkaConsumerConfig::new(kafka_config(), unique("billing"), [self.topic.clone()])
                .with_confirmations(Arc::new(sender));
        c.runner.concurrency = concurrency;
        // The broker minimum: Tansu holds a new group's first join for about half of it.
        c.session_timeout = Duration::from_secs(6);
        c.runner.retry = fast_retry();
        c.runner.maintenance_interval = Duration::from_millis(200);
        c
    }

    fn spawn_consumer<H: outbox::Handler<sqlx::Postgres>>(
        &self,
        config: KafkaConsumerConfig,
        handler: Arc<H>,
    ) -> Running {
        Running::spawn(config, &self.inbox, handler).stopping_within(Duration::from_secs(15))
    }

    /// Effects rows `(key, payload, delivery)` in application order.
    async fn effects(&self) -> Vec<(Option<String>, String, i32)> {
        sqlx::query_as(AssertSqlSafe(format!(
            "SELECT key, payload, delivery FROM {} ORDER BY n",
            self.effects
        )))
        .fetch_all(self.fx.store.pool())
        .await
        .unwrap()
    }

    /// Stop the consumer (it must stop cleanly), the listener and the relay; drop the topics and
    /// the schema.
    async fn finish(self, consumer: Running) {
        consumer.stop().await;
        self.listener.stop().await;
        self.relay.shutdown().await.unwrap();
        self.kafka.cleanup().await;
        self.fx.cleanup().await;
    }
}

/// PostgreSQL → relay → Kafka → consumer runner (4 lanes) → inbox → confirmations over Kafka →
/// producer: processed messages end CONFIRMED with their effect once; rejected ones end REJECTED
/// with the compensation run once and no effect; a record without outbox headers is counted as
/// malformed and skipped without blocking its partition.
#[suite_test(workers = 4)]
async fn kafka_consumer_end_to_end_with_confirmations() {
    let s = KafkaSetup::new(3).await;
    // A foreign record without outbox headers, before the real ones.
    let raw = s.kafka.transport.producer();
    raw.send(
        rdkafka::producer::FutureRecord::<str, str>::to(&s.topic)
            .payload("not an outbox message")
            .partition(0),
        Duration::from_secs(5),
    )
    .await
    .map_err(|(e, _)| e)
    .expect("raw record");
    let mut msgs: Vec<NewMessage> = (0..12)
        .map(|i| {
            NewMessage::new("orders", format!("ok-{i}")).with_partition_key(format!("k{}", i % 4))
        })
        .collect();
    msgs.extend((0..3).map(|i| NewMessage::new("orders", format!("reject-{i}"))));
    let handler = ScriptedHandler::new(&format!("{}.scripted", s.fx.schema));
    s.fx.exec(&format!(
        "CREATE TABLE {}.scripted (message_id text NOT NULL, payload bytea)",
        s.fx.schema
    ))
    .await;
    let consumer = s.spawn_consumer(s.consumer_config(4), handler.clone());
    let metrics = consumer.metrics.clone();
    let ids = s.fx.enqueue_commit(msgs).await.unwrap();
    let (ok, rejected) = (&ids[..12], &ids[12..]);
    wait_status(&s.fx, ok, Status::Confirmed, GROUP_START).await;
    wait_status(&s.fx, rejected, Status::Rejected, Duration::from_secs(30)).await;
    for id in rejected {
        assert_eq!(s.fx.compensations(*id).await, 1, "compensation ran once");
        let err = s.fx.row(*id).await.last_error.unwrap_or_default();
        assert!(err.contains("refused reject-"), "{err}");
    }
    assert_eq!(s.ctl.calls.load(Ordering::SeqCst), 3);
    for id in ok {
        let n = pg_count(
            &s.fx,
            &format!(
                "SELECT COUNT(*) FROM {}.scripted WHERE message_id = '{id}'",
                s.fx.schema
            ),
        )
        .await;
        assert_eq!(n, 1, "effect exactly once");
    }
    assert_eq!(metrics.applied.load(Ordering::Relaxed), 12);
    assert_eq!(metrics.rejected.load(Ordering::Relaxed), 3);
    assert_eq!(metrics.malformed.load(Ordering::Relaxed), 1);
    assert!(metrics.confirmations_sent.load(Ordering::Relaxed) >= 15);
    assert_eq!(s.fx.store().stats().await.unwrap().awaiting_confirmation, 0);
    s.finish(consumer).await;
}

/// A transient handler failure is redelivered with backoff (the partition is paused and sought
/// back) until it passes, and the later messages of its key are applied after it, in order, each
/// once; the failing record's delivery count grows with each redelivery.
#[suite_test(workers = 4)]
async fn kafka_transient_failure_is_retried_then_applied_in_order() {
    let s = KafkaSetup::new(2).await;
    let handler = Arc::new(KeyedHandler::new(&s.effects, Duration::ZERO));
    handler.failures.lock().unwrap().insert("K-1".into(), 2);
    let msgs: Vec<NewMessage> = ["K-1", "K-2", "K-3"]
        .iter()
        .map(|p| NewMessage::new("orders", *p).with_partition_key("K"))
        .chain(
            ["J-1", "J-2"]
                .iter()
                .map(|p| NewMessage::new("orders", *p).with_partition_key("J")),
        )
        .collect();
    let consumer = s.spawn_consumer(s.consumer_config(2), handler.clone());
    let metrics = consumer.metrics.clone();
    // One transaction, one claim, one batch: the relay publishes them in this order.
    let ids = s.fx.enqueue_commit(msgs).await.unwrap();
    wait_status(&s.fx, &ids, Status::Confirmed, GROUP_START).await;
    let effects = s.effects().await;
    let of = |k: &str| -> Vec<(String, i32)> {
        effects
            .iter()
            .filter(|(key, _, _)| key.as_deref() == Some(k))
            .map(|(_, p, d)| (p.clone(), *d))
            .collect()
    };
    let k = of("K");
    assert_eq!(
        k.iter().map(|(p, _)| p.as_str()).collect::<Vec<_>>(),
        ["K-1", "K-2", "K-3"],
        "key K applied once each, in order: {effects:?}"
    );
    assert_eq!(k[0].1, 3, "K-1 applied on its third delivery");
    assert_eq!(
        of("J").iter().map(|(p, _)| p.as_str()).collect::<Vec<_>>(),
        ["J-1", "J-2"]
    );
    assert!(metrics.failures.load(Ordering::Relaxed) >= 2);
    assert_eq!(metrics.applied.load(Ordering::Relaxed), 5);
    assert_eq!(metrics.dead_lettered.load(Ordering::Relaxed), 0);
    s.finish(consumer).await;
}

/// With 4 lanes over 3 partitions, 240 messages of 12 keys are applied concurrently (more than
/// one application at a time) and each key's messages in publish order, each once.
#[suite_test(workers = 4)]
async fn kafka_per_key_order_with_concurrency() {
    let s = KafkaSetup::new(3).await;
    let handler = Arc::new(Concurrent::new(KeyedHandler::new(
        &s.effects,
        Duration::from_millis(3),
    )));
    let mut config = s.consumer_config(4);
    config.batch = 60;
    config.runner.confirmations = None;
    let consumer = s.spawn_consumer(config, handler.clone());
    let metrics = consumer.metrics.clone();
    // Published straight through the transport, batch after batch, so the topic holds each key's
    // messages in sequence order.
    let msgs: Vec<outbox::Message> = (0..240)
        .map(|i| {
            let mut m = claimed_message("orders", format!("{}", i / 12));
            m.partition_key = Some(format!("key-{}", i % 12));
            m
        })
        .collect();
    for chunk in msgs.chunks(80) {
        for r in publish_all(s.kafka.transport().as_ref(), chunk, &s.topic).await {
            r.expect("acknowledged");
        }
    }
    wait_until("240 applications", GROUP_START, || async {
        s.effects().await.len() >= 240
    })
    .await;
    let effects = s.effects().await;
    assert_eq!(effects.len(), 240, "each message once");
    for k in 0..12 {
        let key = format!("key-{k}");
        let seq: Vec<u32> = effects
            .iter()
            .filter(|(kk, _, _)| kk.as_deref() == Some(key.as_str()))
            .map(|(_, p, _)| p.parse().unwrap())
            .collect();
        assert_eq!(seq, (0..20).collect::<Vec<u32>>(), "order of {key}");
    }
    assert!(handler.most() > 1, "applications ran concurrently");
    assert_eq!(metrics.applied.load(Ordering::Relaxed), 240);
    s.finish(consumer).await;
}

/// Compile-time check: the Kafka transport, runner and listener futures are `Send`.
#[test]
fn kafka_futures_are_send() {
    fn send<T: Send>(_: &T) {}
    #[allow(dead_code)]
    fn check(
        t: KafkaTransport,
        inbox: Inbox<sqlx::Postgres>,
        handler: Arc<crate::inbox::EffectHandler>,
        store: Arc<dyn Store>,
    ) {
        send(&t.publish(&[]));
        send(&outbox::consumer::kafka::run(
            KafkaConsumerConfig::new(kafka_config(), "g", ["t"]),
            inbox,
            handler,
            Arc::new(ConsumerMetrics::default()),
            CancellationToken::new(),
        ));
        send(&outbox::confirm::kafka::listen(
            kafka_config(),
            "t".into(),
            "g".into(),
            store,
            CancellationToken::new(),
        ));
    }
    let _ = check;
}
