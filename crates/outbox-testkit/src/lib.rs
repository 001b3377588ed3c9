//! # outbox-testkit: conformance suites and fault helpers for `outbox`
//!
//! - Service URLs from the environment ([`postgres_url`], [`nats_url`]) and connect helpers that
//!   **panic** with a message naming the service and the variable when it does not answer: a test
//!   enabled for a service never passes silently without it.
//! - Unique names ([`unique`]) so tests run in parallel, each with its own schema, table or stream.
//! - The store conformance suite ([`store_suite`]), written once against [`StoreFixture`] and run
//!   against [`SqliteFixture`], [`PgFixture`] and [`MySqlFixture`].
//! - The transport conformance suite ([`transport_suite`]), written once against
//!   [`TransportFixture`] and run against a webhook receiver ([`WebhookReceiver`]) and NATS
//!   JetStream ([`NatsFixture`]).
//! - Fault injection: [`AckThenHang`] (a transport that gets the broker's ack and then never
//!   reports it, as a relay that dies between ack and completion) and [`FaultProxy`] (a TCP proxy
//!   that cuts connections on command).
//!
//! # The enqueue borrow (shared case C10)
//! `enqueue` borrows the caller's transaction mutably until its future completes, so a
//! transaction cannot be committed while an enqueue is still pending: the late-insert race of
//! case C10 is a compile error. This compiles (the enqueue is awaited before the commit):
//! ```no_run
//! async fn ok(store: outbox::PgStore) {
//!     let mut tx = store.pool().begin().await.unwrap();
//!     let pending = store.enqueue(&mut tx, outbox::NewMessage::new("t", "x"));
//!     pending.await.unwrap();
//!     tx.commit().await.unwrap();
//! }
//! ```
//! and this does not (the commit moves `tx` while `pending` still borrows it). The two
//! examples differ only in the order of those two lines, so the compile error is the borrow
//! (stable rustdoc does not check the error code itself):
//! ```compile_fail,E0505
//! async fn racy(store: outbox::PgStore) {
//!     let mut tx = store.pool().begin().await.unwrap();
//!     let pending = store.enqueue(&mut tx, outbox::NewMessage::new("t", "x"));
//!     tx.commit().await.unwrap();
//!     pending.await.unwrap();
//! }
//! ```

// The RocketMQ client's futures are deep types; proving them `Send` needs more than the default.
#![cfg_attr(feature = "rocketmq", recursion_limit = "256")]

use std::time::Duration;

mod faults;
mod fixture;
mod handlers;
pub mod kafka;
pub mod mqtt;
mod nats;
pub mod rabbitmq;
pub mod redis;
#[cfg(feature = "rocketmq")]
pub mod rocketmq;
pub mod store_suite;
mod stores;
mod transport;
pub mod transport_suite;

pub use faults::{AckThenHang, FaultProxy, PauseAt, PauseFirst, host_port};
pub use fixture::{
    ConfirmFixture, ConfirmState, HookControl, RecordingHook, RowState, StoreFixture,
};
pub use handlers::Concurrent;
pub use kafka::KafkaFixture;
pub use mqtt::{MqttFixture, mqtt_url};
pub use nats::{NatsFixture, nats_client, nats_client_at, nats_stream_info};
pub use rabbitmq::{RabbitMqFixture, rabbitmq_config, rabbitmq_host_port, rabbitmq_url};
pub use redis::{RedisFixture, redis_url};
#[cfg(feature = "rocketmq")]
pub use rocketmq::RocketMqFixture;
pub use stores::{
    DEFAULT_MYSQL_URL, MySqlFixture, PgFixture, PgPartitionedFixture, Producer, SqliteFixture,
    mysql_pool, mysql_url, pg_pool,
};
pub use transport::{
    RawDelivery, Received, TransportFixture, WebhookFixture, WebhookReceiver, claimed_message,
    header_message_id, publish_all, publish_one_elsewhere, publish_to, wait_probe_fails,
    wait_probe_ok,
};

/// Default PostgreSQL URL when `OUTBOX_TEST_POSTGRES_URL` is unset.
pub const DEFAULT_POSTGRES_URL: &str = "postgres://postgres@127.0.0.1:5432/test";
/// Default NATS URL when `OUTBOX_TEST_NATS_URL` is unset.
pub const DEFAULT_NATS_URL: &str = "nats://127.0.0.1:4222";

/// `OUTBOX_TEST_POSTGRES_URL`, or [`DEFAULT_POSTGRES_URL`].
pub fn postgres_url() -> String {
    std::env::var("OUTBOX_TEST_POSTGRES_URL").unwrap_or_else(|_| DEFAULT_POSTGRES_URL.into())
}

/// `OUTBOX_TEST_NATS_URL`, or [`DEFAULT_NATS_URL`].
pub fn nats_url() -> String {
    std::env::var("OUTBOX_TEST_NATS_URL").unwrap_or_else(|_| DEFAULT_NATS_URL.into())
}

/// A loopback port that was free a moment ago (bound, then let go): for a server the test
/// starts on it, or as an address where nothing listens (connection refused).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free loopback port")
        .port()
}

/// Wait until something accepts TCP connections on `127.0.0.1:port` (a server the test started
/// there, for example on a [`free_port`]).
///
/// # Panics
/// After `timeout`, with `what` in the message.
pub async fn wait_listening(what: &str, port: u16, timeout: Duration) {
    wait_until(what, timeout, || async move {
        tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_ok()
    })
    .await;
}

/// A lower-case name `prefix_<16 hex digits>`, unique per call: a valid SQL identifier and NATS
/// stream name.
pub fn unique(prefix: &str) -> String {
    format!("{prefix}_{:016x}", rand::random::<u64>())
}

/// Read `metrics` every 20 ms until `cond` holds for the snapshot
/// ([`RelayMetrics::snapshot`](outbox::RelayMetrics::snapshot)), for at most `seconds`, e.g.
/// `wait_metrics(relay.metrics(), 5, "the outage", |m| m.outages >= 1)`.
///
/// # Panics
/// After `seconds`, with `what` and the last snapshot in the message.
pub async fn wait_metrics(
    metrics: &outbox::RelayMetrics,
    seconds: u64,
    what: &str,
    cond: impl Fn(&outbox::MetricsSnapshot) -> bool,
) {
    let timeout = Duration::from_secs(seconds);
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let snapshot = metrics.snapshot();
        if cond(&snapshot) {
            return;
        }
        if tokio::time::Instant::now() >= deadline {
            panic!("timed out after {timeout:?} waiting for {what}: {snapshot:?}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Poll `cond` every 20 ms until it is true.
///
/// # Panics
/// After `timeout`, with `what` in the message.
pub async fn wait_until<F, Fut>(what: &str, timeout: Duration, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if cond().await {
            return;
        }
        if tokio::time::Instant::now() >= deadline {
            panic!("timed out after {timeout:?} waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Await `fut`, panicking with `what` after `timeout`.
///
/// # Panics
/// After `timeout`.
pub async fn within<T>(
    what: &str,
    timeout: Duration,
    fut: impl std::future::Future<Output = T>,
) -> T {
    match tokio::time::timeout(timeout, fut).await {
        Ok(v) => v,
        Err(_) => panic!("timed out after {timeout:?} waiting for {what}"),
    }
}
