//! RabbitMQ against the real broker (`OUTBOX_TEST_RABBITMQ_URL`): shared case C04 (a) missing
//! exchange, (b) unroutable with the mandatory flag, (c) connection cut after the publish frame and
//! before the confirm, through a real relay and store; the transport's own traps (an exchange
//! deleted after its check, size limits, unroutable policy, connection refused); the consumer
//! runner end to end with confirmations over RabbitMQ, redelivery with backoff through the retry
//! queues, dead letters, malformed messages, and per-key order with concurrency 4.

use outbox_testkit_macros::suite_test;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use outbox::consumer::rabbitmq::RabbitMqConsumerConfig;
use outbox::transport::Transport;
use outbox::{Inbox, NewMessage, RelayConfig, Router, Status, TransportErrorKind, Unroutable};
use outbox_testkit::store_suite::relay_routed;
use outbox_testkit::{
    FaultProxy, RabbitMqFixture, SqliteFixture, StoreFixture, TransportFixture as _,
    claimed_message, publish_one_elsewhere, publish_to, rabbitmq_config, rabbitmq_host_port,
    rabbitmq_url, wait_metrics, wait_probe_fails, wait_probe_ok, wait_until, within,
};
use uuid::Uuid;

use crate::broker_support::Running;
use crate::confirm::{fast_retry, wait_status};
use crate::inbox::EffectHandler;
use crate::relay::fast_config;

/// A consumer database (SQLite) with an inbox `consumer_inbox` and an `effects` table.
pub(crate) async fn sqlite_consumer(name: &str) -> (SqliteFixture, Inbox<sqlx::Sqlite>) {
    let db = SqliteFixture::new().await;
    crate::inbox::sqlite_effects_table(db.store.pool()).await;
    let inbox =
        Inbox::<sqlx::Sqlite>::new(db.store.pool().clone(), "consumer_inbox", name).unwrap();
    inbox.migrate().await.unwrap();
    (db, inbox)
}

pub(crate) async fn sqlite_effects(db: &SqliteFixture, id: Uuid) -> i64 {
    sqlx::query_scalar("SELECT COUNT(*) FROM effects WHERE message_id = ?1")
        .bind(id.to_string())
        .fetch_one(db.store.pool())
        .await
        .unwrap()
}

pub(crate) fn consumer_config(fx: &RabbitMqFixture) -> RabbitMqConsumerConfig {
    let mut c = RabbitMqConsumerConfig::new(rabbitmq_config(&rabbitmq_url()), fx.queue.clone());
    c.runner.retry = fast_retry();
    c.runner.maintenance_interval = Duration::from_millis(200);
    c.runner.dedup_window = None;
    c
}

/// C04 (a): a message routed to an exchange that does not exist is not SENT: it is FAILED at once
/// (permanent) with the broker's reason recorded; the other messages of the same relay batch are
/// published and SENT (a 404 closing a channel does not take them down).
#[suite_test]
async fn c04a_missing_exchange_not_sent_reason_recorded(fx: RabbitMqFixture) {
    let db = SqliteFixture::new().await;
    let missing = format!("{}_missing", fx.exchange);
    let router = Router::new()
        .route("bad", fx.transport.clone(), format!("{missing}/{{topic}}"))
        .route("*", fx.transport.clone(), fx.topic_destination());
    // A missing exchange pauses the transport (issue 11 item 9) and is dead-lettered only after
    // its grace period: short here.
    let relay = relay_routed(
        db.store(),
        router,
        RelayConfig {
            missing_destination_grace: Duration::from_millis(500),
            ..fast_config("c04a")
        },
    )
    .spawn();
    let mut msgs: Vec<NewMessage> = (0..3)
        .map(|i| NewMessage::new("good", format!("g{i}")))
        .collect();
    msgs.insert(1, NewMessage::new("bad", "b"));
    let ids = db.enqueue_commit(msgs).await.unwrap();
    let bad = ids[1];
    wait_status(&db, &[bad], Status::Failed, Duration::from_secs(10)).await;
    let good: Vec<Uuid> = ids.iter().copied().filter(|id| *id != bad).collect();
    wait_status(&db, &good, Status::Sent, Duration::from_secs(10)).await;
    let row = db.row(bad).await;
    assert!(!row.sent, "never marked sent");
    assert_eq!(
        row.attempts, 1,
        "dead-lettered after its grace: one attempt"
    );
    let err = row.last_error.unwrap_or_default();
    assert!(err.contains("404") && err.contains("NOT_FOUND"), "{err}");
    assert!(err.contains("missing_destination_grace"), "{err}");
    assert!(err.contains(&missing), "{err}");
    let stored = fx.take_all(&fx.queue).await;
    assert_eq!(stored.len(), 3);
    for id in &good {
        assert!(
            stored
                .iter()
                .any(|s| s.received.native_id == Some(id.to_string()))
        );
    }
    relay.shutdown().await.unwrap();
}

/// C04 (b): the exchange exists but no queue is bound: with the mandatory flag the broker returns
/// the message (`312 NO_ROUTE`), which is not a success: the row is retried, never SENT, and ends
/// FAILED after its attempts with the broker's reason recorded.
#[suite_test]
async fn c04b_unroutable_with_mandatory_not_success(fx: RabbitMqFixture) {
    let unbound = fx.extra_exchange("unbound").await;
    let db = SqliteFixture::new().await;
    let router = Router::new().route("*", fx.transport.clone(), format!("{unbound}/{{topic}}"));
    let relay = relay_routed(db.store(), router, fast_config("c04b")).spawn();
    let ids = db
        .enqueue_commit(vec![
            NewMessage::new("orders", "nobody listens").with_max_attempts(2),
        ])
        .await
        .unwrap();
    wait_status(&db, &ids, Status::Failed, Duration::from_secs(15)).await;
    let row = db.row(ids[0]).await;
    assert!(!row.sent, "an unroutable message is never SENT");
    assert_eq!(
        row.attempts, 2,
        "retried (Unroutable::Retry) up to max_attempts"
    );
    let err = row.last_error.unwrap_or_default();
    assert!(
        err.contains("312 NO_ROUTE") && err.contains(&unbound),
        "{err}"
    );
    relay.shutdown().await.unwrap();
}

/// C04 (c): the connection is cut after the publish frame reached the broker but before its
/// confirm came back (a proxy drops the server's replies, then cuts): the transport reports the
/// broker unavailable, the row is not SENT; after reconnecting the relay publishes it again with
/// the same `message_id`, so the queue holds two copies sharing it, and the consumer's inbox
/// applies it once.
#[suite_test(workers = 4)]
async fn c04c_cut_before_confirm_republished_with_same_id_applied_once() {
    let proxy = FaultProxy::start(rabbitmq_host_port()).await;
    let mut config = rabbitmq_config(&format!("amqp://guest:guest@{}/%2f", proxy.addr));
    config.confirm_timeout = Duration::from_secs(30);
    let fx = RabbitMqFixture::with_config(config).await;
    let dest = format!("{}/orders", fx.exchange);
    // Warm up: a channel is open and the exchange checked before the replies are dropped.
    let warm = claimed_message("orders", "warm-up");
    let r = publish_to(fx.transport.as_ref(), std::slice::from_ref(&warm), |_| {
        &dest
    })
    .await;
    assert!(r[0].is_ok(), "{r:?}");
    assert_eq!(fx.take_all(&fx.queue).await.len(), 1);

    let db = SqliteFixture::new().await;
    let relay = relay_routed(
        db.store(),
        Router::new().route("*", fx.transport.clone(), fx.topic_destination()),
        RelayConfig {
            publish_timeout: Duration::from_secs(20),
            lease: Duration::from_secs(60),
            ..fast_config("c04c")
        },
    )
    .spawn();
    proxy.set_replies_dropped(true);
    let ids = db
        .enqueue_commit(vec![NewMessage::new("orders", "cut before confirm")])
        .await
        .unwrap();
    let id = ids[0];
    wait_until(
        "the broker to hold the message",
        Duration::from_secs(10),
        || async { fx.ready(&fx.queue).await >= 1 },
    )
    .await;
    assert!(!db.row(id).await.sent, "no confirm, not SENT");
    proxy.set_blocked(true);
    // Unavailable: released unsent, the attempt not counted, the transport marked down.
    // The row stays PENDING while it is in flight (no claim write), so wait for the release.
    wait_metrics(relay.metrics(), 10, "the row to be released unsent", |m| {
        m.released >= 1 && m.outages >= 1
    })
    .await;
    let r = db.row(id).await;
    assert!(r.status == Status::Pending.as_i16() && !r.sent, "{r:?}");
    let m = relay.metrics().snapshot();
    assert!(m.released >= 1 && m.outages >= 1, "{m:?}");
    assert_eq!(m.sent, 0);
    proxy.set_replies_dropped(false);
    proxy.set_blocked(false);
    wait_status(&db, &ids, Status::Sent, Duration::from_secs(20)).await;
    relay.shutdown().await.unwrap();

    let copies = fx.take_all(&fx.queue).await;
    assert!(
        copies.len() >= 2,
        "re-published after reconnect: {} copies",
        copies.len()
    );
    for c in &copies {
        assert_eq!(
            c.received.native_id,
            Some(id.to_string()),
            "same message_id"
        );
        assert_eq!(c.properties.delivery_mode(), &Some(2));
    }
    for c in &copies {
        fx.publish_stored(&fx.queue, c).await;
    }
    let (consumer_db, inbox) = sqlite_consumer("c04c").await;
    let handler = Arc::new(EffectHandler::new("effects"));
    let runner = Running::spawn(consumer_config(&fx), &inbox, handler.clone())
        .stopping_within(Duration::from_secs(10));
    let metrics = runner.metrics.clone();
    let n = copies.len() as u64;
    wait_until("every copy consumed", Duration::from_secs(10), || async {
        metrics.applied.load(Ordering::Relaxed) + metrics.duplicates.load(Ordering::Relaxed) == n
    })
    .await;
    assert_eq!(metrics.applied.load(Ordering::Relaxed), 1);
    assert_eq!(sqlite_effects(&consumer_db, id).await, 1, "applied once");
    runner.stop().await;
    fx.cleanup().await;
}

/// Native fields: `message_id` (with the `-r<n>` suffix on an intentional redelivery),
/// persistent delivery mode, `content_type`, `type` = topic, `timestamp`, `app_id`, and every
/// header (traceparent included) in the AMQP headers table.
#[suite_test]
async fn native_properties_and_headers(fx: RabbitMqFixture) {
    let mut m = claimed_message("orders.created", "{\"order\":1}");
    m.headers
        .insert("content-type".into(), "application/json".into());
    m.headers.insert(
        "traceparent".into(),
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".into(),
    );
    m.partition_key = Some("order-1".into());
    let mut again = claimed_message("orders.created", "again");
    again.redelivery = 2;
    let good = fx.good_destination();
    let r = publish_to(fx.transport.as_ref(), &[m.clone(), again.clone()], |_| {
        &good
    })
    .await;
    assert!(r.iter().all(Result::is_ok), "{r:?}");
    let stored = fx.take_all(&fx.queue).await;
    assert_eq!(stored.len(), 2);
    let p = &stored[0].properties;
    assert_eq!(stored[0].received.native_id, Some(m.message_id.to_string()));
    assert_eq!(p.delivery_mode(), &Some(2));
    assert_eq!(
        p.content_type().as_ref().map(|s| s.as_str()),
        Some("application/json")
    );
    assert_eq!(
        p.kind().as_ref().map(|s| s.as_str()),
        Some("orders.created")
    );
    assert_eq!(p.app_id().as_ref().map(|s| s.as_str()), Some("outbox"));
    assert!(p.timestamp().is_some_and(|t| t > 1_600_000_000));
    let h = &stored[0].received.headers;
    assert_eq!(h.get("traceparent"), m.headers.get("traceparent"));
    assert_eq!(
        h.get("outbox-partition-key").map(String::as_str),
        Some("order-1")
    );
    assert_eq!(h.get("outbox-message-id"), Some(&m.message_id.to_string()));
    assert_eq!(
        stored[0].received.destination,
        format!("{}/ok", fx.exchange)
    );
    assert_eq!(
        stored[1].received.native_id,
        Some(format!("{}-r2", again.message_id)),
        "an intentional redelivery carries its own message_id"
    );
}

/// An exchange deleted after the transport checked it: the publish closes the channel (404);
/// the other messages of the batch still get their own results (acknowledged, or `Unavailable`
/// when their confirm was cut by the closing channel, never permanent), the one for the deleted
/// exchange is a missing destination with the broker's reason, and the next batch checks again.
#[suite_test]
async fn exchange_deleted_after_check_fails_only_its_message(fx: RabbitMqFixture) {
    let gone = fx.extra_exchange("gone").await;
    let gone_dest = format!("{gone}/x");
    // Checked and cached (unroutable: no queue bound to it, which is not the point here).
    let _ = publish_to(fx.transport.as_ref(), &[claimed_message("t", "0")], |_| {
        &gone_dest
    })
    .await;
    fx.delete_exchange(&gone).await;
    let good = fx.good_destination();
    let (msgs, results) =
        publish_one_elsewhere(fx.transport().as_ref(), &good, 1, &gone_dest).await;
    let mut again = Vec::new();
    for (i, r) in results.iter().enumerate() {
        if i == 1 {
            let e = r.as_ref().unwrap_err();
            assert_eq!(e.kind(), TransportErrorKind::Unavailable, "{e:?}");
            // Usually the broker's 404 reaches this message. Rarely (seen once in CI) lapin
            // writes on the closed channel, the broker escalates to a connection error (504
            // "expected 'channel.open'") and the message meets the closing connection instead:
            // still `Unavailable` (the relay releases it, no attempt counted), and the next
            // batch below finds the exchange missing at its check.
            if e.is_missing_destination() {
                assert!(e.message().contains("404"), "{e:?}");
            } else {
                assert!(e.message().contains("connection state"), "{e:?}");
            }
        } else if let Err(e) = r {
            // A neighbour whose confirm was still outstanding when the broker closed the channel
            // may meet the reopening channel or connection (lapin: "invalid channel state:
            // Closing"): `Unavailable`, so the relay releases it without an attempt. It is
            // never permanent and never a missing destination, and it goes through next time.
            assert_eq!(
                e.kind(),
                TransportErrorKind::Unavailable,
                "message {i}: {e:?}"
            );
            assert!(!e.is_missing_destination(), "message {i}: {e:?}");
            again.push(msgs[i].clone());
        }
    }
    if !again.is_empty() {
        let retried = publish_to(fx.transport().as_ref(), &again, |_| &good).await;
        assert!(retried.iter().all(Result::is_ok), "{retried:?}");
    }
    let received = fx.received().await;
    for (i, m) in msgs.iter().enumerate() {
        let n = received
            .iter()
            .filter(|r| r.native_id == Some(m.message_id.to_string()))
            .count();
        if i == 1 {
            assert_eq!(n, 0);
        } else {
            assert!(n >= 1, "message {i} in the queue");
        }
    }
    // The next batch finds the exchange missing at its check.
    let e = publish_to(
        fx.transport.as_ref(),
        &[claimed_message("t", "late")],
        |_| &gone_dest,
    )
    .await
    .remove(0)
    .unwrap_err();
    assert_eq!(e.kind(), TransportErrorKind::Unavailable);
    assert!(e.is_missing_destination(), "{e:?}");
    assert!(e.message().contains("does not exist"), "{e:?}");
}

/// Size limits and bad destinations are permanent and do not affect their neighbours: a payload
/// over `max_message_bytes`, headers that do not fit in one frame, an empty destination; an
/// unroutable message is permanent under [`Unroutable::Fail`].
#[suite_test]
async fn limits_destinations_and_unroutable_policy() {
    let mut config = rabbitmq_config(&rabbitmq_url());
    config.max_message_bytes = 1024;
    config.unroutable = Unroutable::Fail;
    let fx = RabbitMqFixture::with_config(config).await;
    let good = fx.good_destination();
    let big = claimed_message("t", vec![1u8; 1025]);
    let mut wide = claimed_message("t", "wide");
    for i in 0..40 {
        wide.headers.insert(format!("h{i}"), "v".repeat(4000));
    }
    let unbound = fx.extra_exchange("unbound").await;
    let unbound_dest = format!("{unbound}/k");
    let msgs = [
        big,
        wide,
        claimed_message("t", "small"),
        claimed_message("t", "nowhere"),
        claimed_message("t", "empty"),
    ];
    let dests = [good.as_str(), &good, &good, &unbound_dest, ""];
    let r = publish_to(fx.transport.as_ref(), &msgs, |i| dests[i]).await;
    let kind = |i: usize| r[i].as_ref().unwrap_err().kind();
    assert_eq!(kind(0), TransportErrorKind::Permanent, "{:?}", r[0]);
    assert!(
        r[0].as_ref()
            .unwrap_err()
            .message()
            .contains("max_message_bytes")
    );
    assert_eq!(kind(1), TransportErrorKind::Permanent, "{:?}", r[1]);
    assert!(r[1].as_ref().unwrap_err().message().contains("frame_max"));
    assert!(r[2].is_ok(), "{:?}", r[2]);
    assert_eq!(kind(3), TransportErrorKind::Permanent, "{:?}", r[3]);
    assert!(r[3].as_ref().unwrap_err().message().contains("NO_ROUTE"));
    assert_eq!(kind(4), TransportErrorKind::Permanent, "{:?}", r[4]);
    let received = fx.received().await;
    assert_eq!(received.len(), 1);
    assert_eq!(received[0].payload, b"small");
    fx.transport.probe().await.expect("the connection survived");
    fx.cleanup().await;
}

/// A queue that cannot take messages now nacks them (here a full queue with
/// `x-overflow = reject-publish`; in a cluster, a quorum queue electing a leader, which nacked
/// for over a minute in the full-size cluster run): through the production relay, its messages
/// are released without spending attempts (`max_attempts = 2` would dead-letter them after two
/// refusals), the transport is not paused (another exchange on the same transport goes on), and
/// once the queue has room every message arrives once.
#[suite_test]
async fn a_nacking_queue_is_backed_off_alone_without_spending_attempts(fx: RabbitMqFixture) {
    let full = fx.extra_exchange("full").await;
    let full_queue = format!("{full}_q");
    fx.declare_bounded_queue(&full_queue, &[(&full, "#")], 5)
        .await;
    let db = SqliteFixture::new().await;
    let transport: Arc<dyn Transport> = fx.transport.clone();
    let router = Router::new()
        .route("full.*", transport.clone(), format!("{full}/{{topic}}"))
        .route("*", transport, fx.topic_destination());
    let relay = relay_routed(
        db.store(),
        router,
        RelayConfig {
            max_attempts: 2,
            probe_backoff: outbox::Backoff {
                base: Duration::from_millis(20),
                factor: 2.0,
                max: Duration::from_millis(200),
                jitter: 0.0,
            },
            ..fast_config("nack")
        },
    )
    .spawn();
    let full_ids = db.commit_numbered("full.orders", "full ", 20).await;
    // Refused several times over: with attempts counted, every refused row would be FAILED.
    wait_metrics(
        relay.metrics(),
        20,
        "the full queue to refuse 15 messages 4 times",
        |m| m.busy >= 60,
    )
    .await;
    let open_ids = db.commit_numbered("orders", "open ", 10).await;
    wait_status(&db, &open_ids, Status::Sent, Duration::from_secs(10)).await;
    assert_eq!(fx.ready(&full_queue).await, 5);
    let rows = db.rows().await;
    let refused: Vec<_> = rows
        .iter()
        .filter(|r| full_ids.contains(&r.message_id) && r.status == Status::Pending.as_i16())
        .collect();
    assert_eq!(refused.len(), 15, "{rows:?}");
    for r in &refused {
        assert_eq!(r.attempts, 0, "a refusal spends no attempt: {r:?}");
    }
    let m = relay.metrics().snapshot();
    assert_eq!((m.failed, m.outages), (0, 0), "{m:?}");

    // Room again: a consumer takes what the queue holds until all twenty arrived.
    let mut got = Vec::new();
    within(
        "every refused message to arrive",
        Duration::from_secs(30),
        async {
            while got.len() < 20 {
                got.extend(fx.take_all(&full_queue).await);
                if got.len() < 20 {
                    wait_until(
                        "more messages in the queue",
                        Duration::from_secs(10),
                        || async { fx.ready(&full_queue).await > 0 },
                    )
                    .await;
                }
            }
        },
    )
    .await;
    wait_status(&db, &full_ids, Status::Sent, Duration::from_secs(10)).await;
    let mut ids: Vec<String> = got
        .iter()
        .filter_map(|s| s.received.native_id.clone())
        .collect();
    ids.sort();
    ids.dedup();
    let mut want: Vec<String> = full_ids.iter().map(Uuid::to_string).collect();
    want.sort();
    assert_eq!((got.len(), ids), (20, want), "each message once");
    assert_eq!(relay.metrics().snapshot().failed, 0);
    relay.shutdown().await.unwrap();
}

/// Connection refused or cut: publishes fail `Unavailable` (not permanent, no burned attempt),
/// the probe says unavailable, and both recover when the broker is reachable again.
#[suite_test]
async fn cut_connection_is_unavailable_then_reconnects() {
    let proxy = FaultProxy::start(rabbitmq_host_port()).await;
    let fx = RabbitMqFixture::with_config(rabbitmq_config(&format!(
        "amqp://guest:guest@{}/%2f",
        proxy.addr
    )))
    .await;
    let dest = fx.good_destination();
    let t = fx.transport.as_ref();
    let one = || claimed_message("t", "x");
    let r = publish_to(t, &[one()], |_| &dest).await;
    assert!(r[0].is_ok(), "{r:?}");
    proxy.set_blocked(true);
    wait_probe_fails("the probe to fail", Duration::from_secs(10), t).await;
    let e = t.probe().await.unwrap_err();
    assert_eq!(e.kind(), TransportErrorKind::Unavailable, "{e:?}");
    let e = publish_to(t, &[one()], |_| &dest)
        .await
        .remove(0)
        .unwrap_err();
    assert_eq!(e.kind(), TransportErrorKind::Unavailable, "{e:?}");
    proxy.set_blocked(false);
    wait_probe_ok("the transport to reconnect", Duration::from_secs(10), t).await;
    let r = publish_to(t, &[one()], |_| &dest).await;
    assert!(r[0].is_ok(), "{r:?}");
    // Connection refused outright.
    let port = outbox_testkit::free_port();
    let closed = outbox::RabbitMqTransport::lazy(rabbitmq_config(&format!(
        "amqp://guest:guest@127.0.0.1:{port}/%2f"
    )))
    .unwrap();
    let e = publish_to(&closed, &[one()], |_| &dest)
        .await
        .remove(0)
        .unwrap_err();
    assert_eq!(e.kind(), TransportErrorKind::Unavailable, "{e:?}");
    assert_eq!(
        closed.probe().await.unwrap_err().kind(),
        TransportErrorKind::Unavailable
    );
    let e = outbox::RabbitMqTransport::connect(rabbitmq_config(&format!(
        "amqp://guest:guest@127.0.0.1:{port}/%2f"
    )))
    .await
    .unwrap_err();
    assert_eq!(e.field, "url");
    fx.cleanup().await;
}
