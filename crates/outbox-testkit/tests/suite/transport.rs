//! The transport conformance suite against a webhook receiver and NATS JetStream, plus each
//! transport's own classification rules.

use outbox_testkit_macros::suite_test;
use std::time::Duration;

use outbox::transport::Transport;
use outbox::{Message, TransportErrorKind, WebhookConfig, WebhookTransport};
use outbox_testkit::{NatsFixture, TransportFixture, WebhookFixture, claimed_message, publish_all};

fixture_tests!(
    [
        webhook: outbox_testkit::WebhookFixture,
        nats: outbox_testkit::NatsFixture,
        redis: outbox_testkit::RedisFixture,
        mqtt: outbox_testkit::MqttFixture,
        kafka: outbox_testkit::KafkaFixture,
        #[cfg(feature = "rocketmq")] rocketmq: outbox_testkit::RocketMqFixture,
        rabbitmq: outbox_testkit::RabbitMqFixture,
    ],
    [outbox_testkit::transport_suite],
    [
        publish_is_acked_and_carries_id_headers_payload,
        c08_binary_payload_is_byte_exact = binary_payload_is_byte_exact,
        results_are_in_input_order,
    ],
);

/// Publish `m` alone to `dest`.
async fn publish(t: &dyn Transport, m: &Message, dest: &str) -> Result<(), outbox::TransportError> {
    publish_all(t, std::slice::from_ref(m), dest)
        .await
        .pop()
        .expect("one result")
}

async fn publish_one(t: &dyn Transport, dest: &str) -> Result<(), outbox::TransportError> {
    publish(t, &claimed_message("t", "{}"), dest).await
}

#[suite_test]
async fn webhook_classifies_answers(fx: WebhookFixture) {
    let t = fx.transport();
    let t = t.as_ref();
    let answer = |path: &str| {
        let url = fx.receiver.url(path);
        async move { publish_one(t, &url).await }
    };
    answer("/ok").await.expect("2xx acknowledges");
    let e = answer("/unavailable").await.unwrap_err();
    // Not a busy destination: a receiver answers 503 for one message's transient failure too.
    assert_eq!(e.kind(), TransportErrorKind::Retryable, "503: {e:?}");
    let e = answer("/busy").await.unwrap_err();
    assert!(e.is_destination_busy(), "429 is a busy destination: {e:?}");
    let e = answer("/bad").await.unwrap_err();
    assert_eq!(e.kind(), TransportErrorKind::Permanent, "400: {e:?}");
    let e = answer("/missing").await.unwrap_err();
    assert_eq!(e.kind(), TransportErrorKind::Unavailable, "404: {e:?}");
    assert!(
        e.is_missing_destination(),
        "404 is a missing destination: {e:?}"
    );
}

#[suite_test]
async fn webhook_connection_refused_is_unavailable() {
    let port = outbox_testkit::free_port();
    let url = format!("http://127.0.0.1:{port}/hook");
    let mut config = WebhookConfig::new(url.clone());
    config.timeout = Duration::from_secs(2);
    let t = WebhookTransport::new(config).unwrap();
    let e = publish_one(&t, &url).await.unwrap_err();
    assert_eq!(e.kind(), TransportErrorKind::Unavailable, "{e:?}");
    let e = t.probe().await.unwrap_err();
    assert_eq!(e.kind(), TransportErrorKind::Unavailable, "{e:?}");
}

/// Deliveries verify with the Standard Webhooks reference library; the message id is in
/// `webhook-id` and `outbox-message-id`.
#[suite_test]
async fn webhook_signature_verifies_with_standardwebhooks(fx: WebhookFixture) {
    let mut m = claimed_message("orders.created", "{\"order\":42,\"note\":\"héllo 😀\"}");
    m.headers
        .insert("content-type".into(), "application/json".into());
    let r = publish(fx.transport().as_ref(), &m, &fx.good_destination()).await;
    assert!(r.is_ok(), "{r:?}");
    let raw = fx.receiver.raw();
    assert_eq!(raw.len(), 1);
    let (headers, body, _) = &raw[0];
    let wh = standardwebhooks::Webhook::new(&fx.secret).unwrap();
    wh.verify(body, headers).expect("signature verifies");
    assert_eq!(headers["webhook-id"], m.message_id.to_string().as_str());
    assert_eq!(
        headers["outbox-message-id"],
        m.message_id.to_string().as_str()
    );
    assert_eq!(headers["content-type"], "application/json");
    // A tampered body does not verify.
    let mut tampered = body.clone();
    tampered.push(b' ');
    assert!(wh.verify(&tampered, headers).is_err());
}

/// Publishing the same message twice stores it once: `Nats-Msg-Id` is the message id and the
/// stream's duplicate window drops the copy.
#[suite_test]
async fn nats_same_message_twice_is_stored_once(fx: NatsFixture) {
    let dest = fx.good_destination();
    let m = claimed_message("t", "once");
    for _ in 0..2 {
        let r = publish(fx.transport().as_ref(), &m, &dest).await;
        assert!(r.is_ok(), "{r:?}");
    }
    assert_eq!(fx.stored().await, 1);
    let received = fx.received().await;
    assert_eq!(
        received[0].native_id.as_deref(),
        Some(m.message_id.to_string().as_str())
    );
}

#[suite_test]
async fn nats_subject_without_stream_is_a_missing_destination(fx: NatsFixture) {
    let e = publish_one(
        fx.transport().as_ref(),
        &format!("{}_nostream.x", fx.prefix),
    )
    .await
    .unwrap_err();
    assert_eq!(e.kind(), TransportErrorKind::Unavailable, "{e:?}");
    assert!(e.is_missing_destination(), "{e:?}");
}

#[suite_test]
async fn nats_payload_over_max_payload_is_permanent(fx: NatsFixture) {
    let max = fx.transport.client().server_info().max_payload;
    let m = claimed_message("t", vec![7u8; max + 1]);
    let dest = fx.good_destination();
    let small = claimed_message("t", "small");
    let r = publish_all(fx.transport().as_ref(), &[m, small], &dest).await;
    let e = r[0].as_ref().unwrap_err();
    assert_eq!(e.kind(), TransportErrorKind::Permanent, "{e:?}");
    assert!(r[1].is_ok(), "the next message is unaffected: {:?}", r[1]);
    assert_eq!(fx.stored().await, 1);
}

/// NATS behind a proxy that cuts the connection: publishes fail `Unavailable` (not permanent, not
/// a burned attempt), the probe says unavailable, and both recover when the network does.
#[suite_test]
async fn nats_cut_connection_is_unavailable_then_recovers() {
    let (proxy, fx) = NatsFixture::behind_proxy().await;
    let dest = fx.good_destination();
    let t = fx.transport.as_ref();
    publish_one(t, &dest)
        .await
        .expect("publish through the proxy");
    proxy.set_blocked(true);
    outbox_testkit::wait_probe_fails("the client to notice the cut", Duration::from_secs(10), t)
        .await;
    let e = publish_one(t, &dest).await.unwrap_err();
    assert_ne!(e.kind(), TransportErrorKind::Permanent, "{e:?}");
    assert_eq!(e.kind(), TransportErrorKind::Unavailable, "{e:?}");
    proxy.set_blocked(false);
    outbox_testkit::wait_probe_ok("the client to reconnect", Duration::from_secs(15), t).await;
    publish_one(t, &dest)
        .await
        .expect("publish after reconnect");
    fx.cleanup().await;
}
