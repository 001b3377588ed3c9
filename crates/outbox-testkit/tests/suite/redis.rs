//! Redis Streams against the real server (`OUTBOX_TEST_REDIS_URL`, default
//! `redis://127.0.0.1:6379`) with PostgreSQL stores and inboxes: shared case C38 (no trimming by
//! default, a crashed slow consumer's pending entries recovered), trimmed pending ids tolerated
//! and counted, the length-cap warning, the consumer runner end to end with confirmations over
//! Redis, transient failures retried with delivery counts from the server, and per-key order with
//! concurrency > 1.

use outbox_testkit_macros::suite_test;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use outbox::consumer::redis::RedisConsumerConfig;
use outbox::consumer::source::SourceConfig;
use outbox::transport::{Outgoing, Transport};
use outbox::{
    HandlerError, InboundMessage, Inbox, NewMessage, RedisConfig, Relay, Router,
    TransportErrorKind, WaitReplicas,
};
use outbox_testkit::{
    PgFixture, RedisFixture, StoreFixture as _, TransportFixture as _, claimed_message,
    publish_all, redis_url, wait_probe_ok, wait_until,
};
use sqlx::PgConnection;
use uuid::Uuid;

use crate::broker_support::{EFFECTS, Running, pg_effects, pg_inbox};
use crate::confirm::{ScriptedHandler, fast_retry, pg_count};
use crate::relay::fast_config;

/// What a [`Recorder`] saw of one delivery.
#[derive(Debug, Clone)]
pub(crate) struct Seen {
    pub(crate) id: Uuid,
    pub(crate) key: Option<String>,
    pub(crate) payload: String,
    pub(crate) deliveries: u32,
}

/// A handler that records every call; payloads starting `fail<n>-` fail transiently on their
/// first `n` deliveries, `always-fail` every time; `gate_at` makes the n-th call hang after
/// notifying `gate` (a consumer that dies in the middle of a batch).
#[derive(Default)]
pub(crate) struct Recorder {
    seen: Mutex<Vec<Seen>>,
    calls: AtomicU64,
    gate_at: Option<u64>,
    pub(crate) gate: tokio::sync::Notify,
}

impl Recorder {
    pub(crate) fn gated(at: u64) -> Arc<Self> {
        Arc::new(Recorder {
            gate_at: Some(at),
            ..Default::default()
        })
    }

    pub(crate) fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }
}

#[async_trait]
impl outbox::Handler<sqlx::Postgres> for Recorder {
    async fn handle(
        &self,
        _conn: &mut PgConnection,
        msg: &InboundMessage,
    ) -> Result<(), HandlerError> {
        let n = self.calls.fetch_add(1, Ordering::SeqCst) + 1;
        if self.gate_at == Some(n) {
            self.gate.notify_one();
            std::future::pending::<()>().await;
        }
        let payload = String::from_utf8_lossy(&msg.payload).into_owned();
        self.seen.lock().unwrap().push(Seen {
            id: msg.message_id,
            key: msg.partition_key.clone(),
            payload: payload.clone(),
            deliveries: msg.delivery_count,
        });
        if payload == "always-fail" {
            return Err(HandlerError::transient("still failing"));
        }
        if let Some(rest) = payload.strip_prefix("fail")
            && let Some((n, _)) = rest.split_once('-')
            && msg.delivery_count <= n.parse::<u32>().unwrap_or(0)
        {
            return Err(HandlerError::transient(format!(
                "failing delivery {}",
                msg.delivery_count
            )));
        }
        Ok(())
    }
}

/// A consumer config for `stream` with quick retries.
pub(crate) fn consumer_config(stream: &str, consumer: &str) -> RedisConsumerConfig {
    let mut c = RedisConsumerConfig::new(redis_url(), stream, "billing");
    c.consumer = consumer.into();
    c.runner.retry = fast_retry();
    c.block = Duration::from_millis(200);
    c.runner.maintenance_interval = Duration::from_millis(200);
    c.runner.dedup_window = None;
    c
}

/// A consumer [`Running`] with a fresh [`Recorder`].
pub(crate) struct Recording {
    pub(crate) handler: Arc<Recorder>,
    pub(crate) runner: Running,
}

impl Recording {
    /// Run `config`'s broker runner over `inbox`.
    pub(crate) fn spawn<C: SourceConfig + 'static>(
        config: C,
        inbox: &Inbox<sqlx::Postgres>,
    ) -> Recording {
        let handler = Arc::new(Recorder::default());
        Recording {
            runner: Running::spawn(config, inbox, handler.clone())
                .stopping_within(Duration::from_secs(10)),
            handler,
        }
    }
}

pub(crate) async fn publish(rx: &RedisFixture, stream: &str, msgs: &[outbox::Message]) {
    for r in publish_all(rx.transport.as_ref(), msgs, stream).await {
        r.expect("published");
    }
}

pub(crate) async fn pending(rx: &RedisFixture, stream: &str) -> i64 {
    let v: redis::Value = rx
        .query(redis::cmd("XPENDING").arg(stream).arg("billing"))
        .await;
    match v {
        redis::Value::Array(parts) => match parts.first() {
            Some(redis::Value::Int(n)) => *n,
            other => panic!("XPENDING summary {other:?}"),
        },
        other => panic!("XPENDING {other:?}"),
    }
}

/// Shared case C38 with the product's default (no length cap): 5,000 messages through a real
/// relay and PostgreSQL store; a slow consumer (concurrency 1) crashes once in the middle of a
/// batch, leaving pending entries; after a restart under the same consumer name every one of the
/// 5,000 is applied exactly once (the stream kept every entry), nothing is lost or left pending.
#[suite_test(workers = 4)]
async fn c38_no_trimming_by_default_crashed_consumer_recovers_all_5000(fx: PgFixture) {
    let rx = RedisFixture::new().await;
    assert!(
        rx.transport.warnings().is_empty(),
        "default: no cap, no warning"
    );
    let stream = rx.key("orders");
    let effects = pg_effects(&fx, EFFECTS).await;
    let relay = Relay::builder(fx.store())
        .router(Router::new().route("*", rx.transport.clone(), &stream))
        .config(fast_config("c38"))
        .build()
        .expect("relay")
        .spawn();
    let msgs: Vec<NewMessage> = (0..5000)
        .map(|i| {
            NewMessage::new("orders", format!("ok-{i}")).with_partition_key(format!("k{}", i % 50))
        })
        .collect();
    fx.enqueue_commit(msgs).await.unwrap();
    let inbox = pg_inbox(&fx).await;

    // A slow consumer that dies at its 1,200th message, in the middle of a batch of 100.
    let scripted = ScriptedHandler::new(&effects);
    let gate = Arc::new(Gate {
        inner: scripted.clone(),
        at: 1200,
        calls: AtomicU64::new(0),
        reached: tokio::sync::Notify::new(),
    });
    let mut config = consumer_config(&stream, "slow-1");
    config.claim_idle = Duration::from_secs(600);
    let m1 = Running::spawn(config.clone(), &inbox, gate.clone())
        .crash_at(
            "the consumer to reach its crash point",
            Duration::from_secs(120),
            gate.reached.notified(),
        )
        .await;
    let left = pending(&rx, &stream).await;
    assert!(left > 0, "the crash left pending entries");
    let applied_before = m1.applied.load(Ordering::Relaxed);
    assert!(applied_before < 5000);

    // Restart under the same name: its pending entries first, then the rest.
    let c2 =
        Running::spawn(config, &inbox, scripted.clone()).stopping_within(Duration::from_secs(10));
    wait_until("all 5,000 applied", Duration::from_secs(180), || async {
        pg_count(
            &fx,
            &format!("SELECT COUNT(DISTINCT message_id) FROM {effects}"),
        )
        .await
            == 5000
    })
    .await;
    wait_until("nothing pending", Duration::from_secs(20), || async {
        pending(&rx, &stream).await == 0
    })
    .await;
    assert_eq!(
        pg_count(&fx, &format!("SELECT COUNT(*) FROM {effects}")).await,
        5000,
        "each message applied exactly once"
    );
    assert_eq!(c2.metrics.lost.load(Ordering::Relaxed), 0);
    let xlen: i64 = rx.query(redis::cmd("XLEN").arg(&stream)).await;
    assert!(xlen >= 5000, "no entry was trimmed: {xlen}");
    assert_eq!(
        applied_before + c2.metrics.applied.load(Ordering::Relaxed),
        5000,
        "applied once each across the crash"
    );
    c2.stop().await;
    relay.shutdown().await.unwrap();
    rx.cleanup().await;
}

/// Wraps a handler and hangs at its `at`-th call (after notifying `reached`).
struct Gate {
    inner: Arc<ScriptedHandler>,
    at: u64,
    calls: AtomicU64,
    reached: tokio::sync::Notify,
}

#[async_trait]
impl outbox::Handler<sqlx::Postgres> for Gate {
    async fn handle(
        &self,
        conn: &mut PgConnection,
        msg: &InboundMessage,
    ) -> Result<(), HandlerError> {
        if self.calls.fetch_add(1, Ordering::SeqCst) + 1 == self.at {
            self.reached.notify_one();
            std::future::pending::<()>().await;
        }
        outbox::Handler::<sqlx::Postgres>::handle(self.inner.as_ref(), conn, msg).await
    }
}

/// Entries trimmed while pending (C38 with a cap, or an operator's XTRIM): a consumer crashes
/// holding 20 pending entries, the stream is trimmed to its newest 5, and the restarted consumer
/// (same name, so its own pending list is resumed) logs, acknowledges and counts the 15 lost ids,
/// applies the 5 others, and keeps running; nothing stays pending.
#[suite_test(workers = 4)]
async fn trimmed_pending_ids_are_counted_lost_on_resume() {
    trimmed_pending(false).await;
}

/// The same through `XAUTOCLAIM`: a new consumer name takes the crashed one's entries over after
/// `claim_idle`; the trimmed ids come back as `XAUTOCLAIM`'s deleted ids.
#[suite_test(workers = 4)]
async fn trimmed_pending_ids_are_counted_lost_on_autoclaim() {
    trimmed_pending(true).await;
}

async fn trimmed_pending(other_consumer: bool) {
    crate::init_tracing();
    let fx = PgFixture::new().await;
    let rx = RedisFixture::new().await;
    let stream = rx.key("trimmed");
    let inbox = pg_inbox(&fx).await;
    let msgs: Vec<_> = (0..20)
        .map(|i| claimed_message("orders", format!("m{i}")))
        .collect();
    publish(&rx, &stream, &msgs).await;
    let crashing = Recorder::gated(1);
    let mut config = consumer_config(&stream, "c1");
    config.batch = 20;
    Running::spawn(config.clone(), &inbox, crashing.clone())
        .crash_at(
            "the first delivery",
            Duration::from_secs(10),
            crashing.gate.notified(),
        )
        .await;
    assert_eq!(pending(&rx, &stream).await, 20);
    let _: i64 = rx
        .query(redis::cmd("XTRIM").arg(&stream).arg("MAXLEN").arg(5))
        .await;

    if other_consumer {
        config.consumer = "c2".into();
        config.claim_idle = Duration::from_millis(300);
        config.claim_interval = Duration::from_millis(100);
    }
    let Recording {
        handler,
        runner: c2,
    } = Recording::spawn(config, &inbox);
    let metrics = &c2.metrics;
    wait_until("15 lost and 5 applied", Duration::from_secs(20), || async {
        metrics.lost.load(Ordering::Relaxed) == 15 && metrics.applied.load(Ordering::Relaxed) == 5
    })
    .await;
    wait_until("nothing pending", Duration::from_secs(10), || async {
        pending(&rx, &stream).await == 0
    })
    .await;
    let applied: Vec<String> = handler.seen().into_iter().map(|s| s.payload).collect();
    assert_eq!(
        applied,
        (15..20).map(|i| format!("m{i}")).collect::<Vec<_>>()
    );
    // Still running: a new message is applied.
    publish(&rx, &stream, &[claimed_message("orders", "after")]).await;
    wait_until("the runner to go on", Duration::from_secs(10), || async {
        metrics.applied.load(Ordering::Relaxed) == 6
    })
    .await;
    assert!(!c2.task.is_finished());
    c2.stop().await;
    rx.cleanup().await;
    fx.cleanup().await;
}

/// A length cap is opt-in and warned about: `warnings()` names C38, and the cap really trims
/// (the hazard the warning is about), while the default keeps every entry.
#[suite_test]
async fn length_cap_is_warned_about_and_trims() {
    let mut config = RedisConfig::new(redis_url());
    config.max_len = Some(100);
    let rx = RedisFixture::with_config(config).await;
    let w = rx.transport.warnings();
    assert_eq!(w.len(), 1, "{w:?}");
    assert!(
        w[0].contains("C38") && w[0].contains("max_len = 100"),
        "{w:?}"
    );
    let stream = rx.key("capped");
    let msgs: Vec<_> = (0..1000)
        .map(|i| claimed_message("t", format!("m{i}")))
        .collect();
    publish(&rx, &stream, &msgs).await;
    let xlen: i64 = rx.query(redis::cmd("XLEN").arg(&stream)).await;
    assert!(xlen < 1000, "MAXLEN ~ 100 trimmed the stream: {xlen}");
    rx.cleanup().await;

    let rx = RedisFixture::new().await;
    let stream = rx.key("uncapped");
    publish(&rx, &stream, &msgs).await;
    let xlen: i64 = rx.query(redis::cmd("XLEN").arg(&stream)).await;
    assert_eq!(xlen, 1000);
    rx.cleanup().await;
}

/// `WAIT` for a replica this server does not have: the entries were added, but the batch is not
/// acknowledged (`Unavailable`: the cluster's state, no attempt counted), so the relay publishes
/// it again rather than calling it durable, and dead-letters nothing while the replica is away.
#[suite_test]
async fn wait_for_missing_replicas_is_unavailable() {
    let mut config = RedisConfig::new(redis_url());
    config.wait_replicas = Some(WaitReplicas {
        replicas: 1,
        timeout: Duration::from_millis(100),
    });
    let rx = RedisFixture::with_config(config).await;
    let stream = rx.key("replicated");
    let m = claimed_message("t", "x");
    let bad = rx.rejecting_destination();
    let results = rx
        .transport
        .publish(&[
            Outgoing {
                message: &m,
                destination: &stream,
            },
            Outgoing {
                message: &m,
                destination: &bad,
            },
        ])
        .await;
    let e = results[0].as_ref().unwrap_err();
    assert_eq!(e.kind(), TransportErrorKind::Unavailable, "{e:?}");
    assert!(e.message().contains("replicas"), "{e:?}");
    let e = results[1].as_ref().unwrap_err();
    assert_eq!(e.kind(), TransportErrorKind::Permanent, "WRONGTYPE: {e:?}");
    rx.cleanup().await;
}

/// A server that does not answer: connect names the URL; a transport whose server went away
/// reports `Unavailable` from publish and probe.
#[suite_test]
async fn unreachable_server_is_unavailable() {
    let proxy = outbox_testkit::FaultProxy::start(outbox_testkit::host_port(&redis_url())).await;
    let mut config = RedisConfig::new(format!("redis://{}", proxy.addr));
    config.response_timeout = Duration::from_secs(1);
    config.connect_timeout = Duration::from_secs(1);
    let t = outbox::RedisTransport::connect(config.clone())
        .await
        .unwrap();
    t.probe().await.unwrap();
    proxy.set_blocked(true);
    let m = claimed_message("t", "x");
    let key = outbox_testkit::unique("obx");
    let r = t
        .publish(&[Outgoing {
            message: &m,
            destination: &key,
        }])
        .await;
    let e = r[0].as_ref().unwrap_err();
    assert_eq!(e.kind(), TransportErrorKind::Unavailable, "{e:?}");
    let e = t.probe().await.unwrap_err();
    assert_eq!(e.kind(), TransportErrorKind::Unavailable, "{e:?}");
    let e = outbox::RedisTransport::connect(config).await.unwrap_err();
    assert_eq!(e.field, "url");
    proxy.set_blocked(false);
    wait_probe_ok("the transport to reconnect", Duration::from_secs(20), &t).await;
    let r = t
        .publish(&[Outgoing {
            message: &m,
            destination: &key,
        }])
        .await;
    assert!(r[0].is_ok(), "{r:?}");
    let rx = RedisFixture::new().await;
    let _: i64 = rx.query(redis::cmd("DEL").arg(&key)).await;
}
