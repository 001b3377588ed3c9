//! MQTT 5 against the real broker (`OUTBOX_TEST_MQTT_URL`, default `mqtt://127.0.0.1:1883`,
//! Mosquitto 2.0) with PostgreSQL stores and inboxes: the consumer runner end to end with
//! confirmations over MQTT, a failing handler retried with backoff and dead-lettered, user
//! properties and correlation data carried, PUBACK *No matching subscribers* not taken for
//! success, the broker cut through a `FaultProxy` (Unavailable, then recovery), the persistent
//! session keeping messages for an offline consumer, and the refusal of a broker that does not
//! speak MQTT 5.

use outbox_testkit_macros::suite_test;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use outbox::confirm::mqtt::{MqttConfirmationSender, MqttListenConfig};
use outbox::consumer::ConsumerMetrics;
use outbox::consumer::mqtt::MqttConsumerConfig;
use outbox::transport::Transport;
use outbox::{MqttConfig, NoSubscribers, TransportErrorKind};
use outbox_testkit::mqtt::mqtt_transport;
use outbox_testkit::{
    FaultProxy, MqttFixture, PgFixture, StoreFixture as _, TransportFixture as _, claimed_message,
    host_port, mqtt_url, publish_all, unique, wait_probe_fails, wait_probe_ok, wait_until, within,
};
use tokio_util::sync::CancellationToken;

use crate::broker_support::{Listener, Running, pg_inbox, spawn_consumer, stop_consumer};
use crate::confirm::{PgProducer, ScriptedHandler, fast_retry};
use crate::redis::{Recorder, Recording};
use crate::redis_consumer::{
    check_retried_and_dead_lettered, orders_confirmed_and_rejected, retry_messages,
};

fn consumer_config(client_id: &str, filter: &str) -> MqttConsumerConfig {
    let mut c = MqttConsumerConfig::new(mqtt_url(), client_id, filter);
    c.runner.retry = fast_retry();
    c.session_expiry = Duration::from_secs(60);
    c.runner.maintenance_interval = Duration::from_millis(200);
    c.runner.dedup_window = None;
    c
}

async fn publish(
    t: &dyn Transport,
    topic: &str,
    msgs: &[outbox::Message],
) -> Vec<Result<(), outbox::TransportError>> {
    publish_all(t, msgs, topic).await
}

/// Publish until the broker routes to a subscriber (the consumer's subscription may still be on
/// its way): retry while the PUBACK says *No matching subscribers*.
async fn publish_when_subscribed(t: &dyn Transport, topic: &str, msgs: &[outbox::Message]) {
    wait_until(
        "a subscriber for the topic",
        Duration::from_secs(10),
        || async {
            let probe = claimed_message("probe", "probe");
            publish(t, topic, &[probe]).await[0].is_ok()
        },
    )
    .await;
    for r in publish(t, topic, msgs).await {
        r.expect("published");
    }
}

/// The runner end to end with PostgreSQL on both sides and confirmations over MQTT: processed
/// messages end CONFIRMED with their effect once, rejected ones REJECTED with the compensation
/// once; two runners share the work through a shared subscription.
#[suite_test(workers = 4)]
async fn consumer_end_to_end_with_confirmations() {
    let prefix = unique("obx");
    let reply = format!("{prefix}/confirmations");
    let transport = Arc::new(mqtt_transport(MqttConfig::new(mqtt_url())).await);
    let p = PgProducer::start_with_timeout(
        transport,
        format!("{prefix}/orders/{{topic}}"),
        reply.clone(),
        Duration::from_secs(5),
    )
    .await;
    let mut lc = MqttListenConfig::new(mqtt_url(), &reply);
    lc.group = prefix.clone();
    lc.session_expiry = Duration::from_secs(60);
    let listener = Listener::spawn(|stop| outbox::confirm::mqtt::listen(lc, p.store.clone(), stop));
    let handler = ScriptedHandler::new(&p.effects);
    let metrics = Arc::new(ConsumerMetrics::default());
    let cancel = CancellationToken::new();
    let sender = Arc::new(
        MqttConfirmationSender::connect(MqttConfig::new(mqtt_url()))
            .await
            .expect("sender"),
    );
    let mut consumers = Vec::new();
    for i in 0..2 {
        let mut config = consumer_config(&format!("{prefix}-c{i}"), &format!("{prefix}/orders/#"))
            .with_confirmations(sender.clone());
        config.group = Some(prefix.clone());
        config.runner.concurrency = 3;
        consumers.push(spawn_consumer(
            config,
            &p.inbox,
            handler.clone(),
            metrics.clone(),
            cancel.clone(),
        ));
    }
    orders_confirmed_and_rejected(&p.fx, &p.effects, &metrics).await;
    for c in consumers {
        stop_consumer(cancel.clone(), c, Duration::from_secs(10)).await;
    }
    let report = listener.report().await;
    assert_eq!((report.confirmed, report.rejected), (20, 3), "{report:?}");
    p.finish().await;
}

/// A failing handler: MQTT has no negative ack, so the runner applies the unacknowledged message
/// again after the backoff, counting deliveries (1, 2, 3) until it succeeds; a message that always
/// fails is dead-lettered at `max_deliveries`; other keys flow meanwhile.
#[suite_test(workers = 4)]
async fn failing_handler_retried_then_applied_or_dead_lettered(fx: PgFixture) {
    let prefix = unique("obx");
    let inbox = pg_inbox(&fx).await;
    let mut config = consumer_config(&format!("{prefix}-c"), &format!("{prefix}/#"));
    config.runner.max_deliveries = 3;
    config.runner.concurrency = 2;
    let consumer = Recording::spawn(config, &inbox);
    let transport = mqtt_transport(MqttConfig::new(mqtt_url())).await;
    let msgs = retry_messages();
    publish_when_subscribed(&transport, &format!("{prefix}/flaky"), &msgs).await;
    check_retried_and_dead_lettered(&inbox, &consumer, &msgs).await;
    consumer.runner.stop().await;
}

/// User properties carry every header (traceparent included) and the partition key; the
/// correlation data is the message id's 16 bytes; `content-type` sets the MQTT content type; the
/// message is not retained.
#[suite_test]
async fn user_properties_and_correlation_data_are_carried(fx: MqttFixture) {
    let mut m = claimed_message("orders.created", "{}");
    m.partition_key = Some("order-7".into());
    m.headers.insert(
        "traceparent".into(),
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".into(),
    );
    m.headers
        .insert("content-type".into(), "application/json".into());
    let dest = fx.good_destination();
    publish(fx.transport.as_ref(), &dest, std::slice::from_ref(&m))
        .await
        .pop()
        .unwrap()
        .expect("acknowledged");
    let got = fx.received_on(&dest).await;
    assert_eq!(got.len(), 1);
    let p = &got[0];
    assert!(!p.retain);
    let props = p.properties.as_ref().expect("properties");
    let up: BTreeMap<_, _> = props.user_properties.iter().cloned().collect();
    assert_eq!(up, m.wire_headers());
    assert_eq!(
        props.correlation_data.as_deref(),
        Some(m.message_id.as_bytes().as_slice())
    );
    assert_eq!(props.content_type.as_deref(), Some("application/json"));
}

/// A topic nobody subscribes to: the broker answers PUBACK 0x10 and discards the message, so it
/// is not a success by default (retryable), and is with `NoSubscribers::Accept`. A wildcard
/// topic is refused before it reaches the broker.
#[suite_test]
async fn no_matching_subscribers_is_not_success() {
    let topic = format!("{}/nobody", unique("obx"));
    let t = mqtt_transport(MqttConfig::new(mqtt_url())).await;
    let m = claimed_message("t", "x");
    let r = publish(&t, &topic, std::slice::from_ref(&m)).await;
    let e = r[0].as_ref().unwrap_err();
    assert_eq!(e.kind(), TransportErrorKind::Retryable, "{e:?}");
    assert!(e.message().contains("no matching subscribers"), "{e:?}");
    let mut config = MqttConfig::new(mqtt_url());
    config.no_subscribers = NoSubscribers::Accept;
    let t = mqtt_transport(config).await;
    assert!(publish(&t, &topic, std::slice::from_ref(&m)).await[0].is_ok());
    let r = publish(&t, "a/#", std::slice::from_ref(&m)).await;
    let e = r[0].as_ref().unwrap_err();
    assert_eq!(e.kind(), TransportErrorKind::Permanent, "{e:?}");
}

/// The broker cut through a FaultProxy: the probe and the publishes report `Unavailable`; once
/// the proxy lets connections through again, the client reconnects and publishes are
/// acknowledged.
#[suite_test]
async fn broker_cut_is_unavailable_then_recovers(fx: MqttFixture) {
    let proxy = FaultProxy::start(host_port(&mqtt_url())).await;
    let mut config = MqttConfig::new(format!("mqtt://{}", proxy.addr));
    config.keep_alive = Duration::from_secs(5);
    let t = mqtt_transport(config).await;
    let dest = fx.good_destination();
    let m = claimed_message("t", "before");
    assert!(publish(&t, &dest, std::slice::from_ref(&m)).await[0].is_ok());
    t.probe().await.expect("connected");
    proxy.set_blocked(true);
    wait_probe_fails("the cut to be noticed", Duration::from_secs(20), &t).await;
    assert_eq!(
        t.probe().await.unwrap_err().kind(),
        TransportErrorKind::Unavailable
    );
    let during = claimed_message("t", "during");
    let r = publish(&t, &dest, std::slice::from_ref(&during)).await;
    let e = r[0].as_ref().unwrap_err();
    assert_eq!(e.kind(), TransportErrorKind::Unavailable, "{e:?}");
    proxy.set_blocked(false);
    wait_probe_ok("the client to reconnect", Duration::from_secs(20), &t).await;
    let after = claimed_message("t", "after");
    assert!(publish(&t, &dest, std::slice::from_ref(&after)).await[0].is_ok());
    let got: Vec<Vec<u8>> = fx
        .received_on(&dest)
        .await
        .into_iter()
        .map(|p| p.payload.to_vec())
        .collect();
    assert!(
        got.contains(&b"before".to_vec()) && got.contains(&b"after".to_vec()),
        "{got:?}"
    );
}

/// The persistent session: a consumer that is offline keeps its subscription at the broker
/// (publishes are acknowledged with success and queued), and receives the messages when it comes
/// back under the same client id.
#[suite_test(workers = 4)]
async fn persistent_session_keeps_messages_for_an_offline_consumer(fx: PgFixture) {
    let prefix = unique("obx");
    let inbox = pg_inbox(&fx).await;
    let topic = format!("{prefix}/orders");
    let config = consumer_config(&format!("{prefix}-c"), &topic);
    let handler = Arc::new(Recorder::default());
    let consumer = Running::spawn(config.clone(), &inbox, handler.clone())
        .stopping_within(Duration::from_secs(10));
    let t = mqtt_transport(MqttConfig::new(mqtt_url())).await;
    let first = claimed_message("t", "first");
    publish_when_subscribed(&t, &topic, std::slice::from_ref(&first)).await;
    wait_until("the first message", Duration::from_secs(10), || async {
        consumer.metrics.applied.load(Ordering::Relaxed) >= 1
    })
    .await;
    consumer.stop().await;
    // Offline: the session's subscription still matches.
    let msgs: Vec<_> = (0..5)
        .map(|i| claimed_message("t", format!("offline-{i}")))
        .collect();
    for r in publish(&t, &topic, &msgs).await {
        r.expect("acknowledged for the offline session");
    }
    let consumer =
        Running::spawn(config, &inbox, handler.clone()).stopping_within(Duration::from_secs(10));
    wait_until("the offline messages", Duration::from_secs(15), || async {
        consumer.metrics.applied.load(Ordering::Relaxed) == 5
    })
    .await;
    let applied: Vec<String> = handler
        .seen()
        .into_iter()
        .filter(|s| s.payload.starts_with("offline-"))
        .map(|s| s.payload)
        .collect();
    assert_eq!(
        applied,
        (0..5).map(|i| format!("offline-{i}")).collect::<Vec<_>>()
    );
    consumer.stop().await;
}

/// The source the runners use, closed right after settling a batch (as a runner does when it
/// is stopped): the PUBACKs it queued are written before it leaves, so the next session of the
/// same client gets nothing of that batch again. (They used to be dropped with the event loop,
/// and the broker delivered the whole batch again; a current-thread runtime gives the loop no
/// turn between the settle and the close, so this fails every time without the flush.)
#[tokio::test]
async fn closing_right_after_settling_writes_the_acknowledgements() {
    use outbox::consumer::mqtt::MqttSource;
    use outbox::consumer::source::{Settle, Source};
    let prefix = unique("obx");
    let topic = format!("{prefix}/orders");
    let config = consumer_config(&format!("{prefix}-c"), &topic);
    let t = mqtt_transport(MqttConfig::new(mqtt_url())).await;
    let mut source = MqttSource::new(config.clone()).expect("config");
    source
        .open()
        .await
        .expect("the MQTT broker accepts the session");
    let msgs: Vec<_> = (0..20)
        .map(|i| claimed_message("t", format!("batch-{i}")))
        .collect();
    publish_when_subscribed(&t, &topic, &msgs).await;
    let mut batch = Vec::new();
    within("the 20 messages", Duration::from_secs(10), async {
        while batch
            .iter()
            .filter(|d: &&outbox::consumer::source::Delivery<_>| {
                d.envelope.payload.starts_with(b"batch-")
            })
            .count()
            < 20
        {
            batch.extend(source.fetch(100).await.expect("fetch"));
        }
    })
    .await;
    source
        .settle(batch.into_iter().map(|d| (d, Settle::Ack)).collect())
        .await
        .expect("settle");
    source.close().await;
    drop(source);

    let mut again = MqttSource::new(config).expect("config");
    again.open().await.expect("the session resumes");
    let marker = claimed_message("t", "marker");
    publish(&t, &topic, std::slice::from_ref(&marker)).await[0]
        .as_ref()
        .expect("published");
    let mut redelivered = Vec::new();
    within("the marker", Duration::from_secs(10), async {
        loop {
            let got = again.fetch(100).await.expect("fetch");
            let done = got.iter().any(|d| d.envelope.payload == b"marker");
            redelivered.extend(
                got.iter()
                    .filter(|d| d.envelope.payload.starts_with(b"batch-"))
                    .map(|d| String::from_utf8_lossy(&d.envelope.payload).into_owned()),
            );
            if done {
                break;
            }
        }
    })
    .await;
    again.close().await;
    assert!(
        redelivered.is_empty(),
        "acknowledged before the close, delivered again: {redelivered:?}"
    );
}

/// A broker that does not speak MQTT 5: `connect` fails naming `url`, saying that outbox needs
/// MQTT 5. Two fakes answer the CONNECT: one with MQTT 5's *Unsupported Protocol Version*
/// (0x84), one as an MQTT 3.1.1 broker does (CONNACK return code 0x01).
#[suite_test]
async fn mqtt_3_1_1_broker_is_refused_with_a_clear_error() {
    for answer in [
        vec![0x20u8, 0x03, 0x00, 0x84, 0x00],
        vec![0x20, 0x02, 0x00, 0x01],
    ] {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let fake = tokio::spawn(async move {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let (mut s, _) = listener.accept().await.unwrap();
            let mut buf = [0u8; 512];
            let _ = s.read(&mut buf).await;
            s.write_all(&answer).await.unwrap();
            s.flush().await.unwrap();
            // A broker that refuses a protocol version closes the connection (MQTT 3.1.1
            // §3.2.2.3, MQTT 5 §3.2.2.2).
            drop(s);
        });
        let mut config = MqttConfig::new(format!("mqtt://{addr}"));
        config.connect_timeout = Duration::from_secs(2);
        let e = outbox::MqttTransport::connect(config).await.unwrap_err();
        assert_eq!(e.field, "url");
        assert!(
            e.reason.contains("3.1.1") && e.reason.contains("MQTT 5"),
            "{e}"
        );
        fake.abort();
    }
}
