//! Issue 11 item 4, for every transport but Kafka (see `resilience.rs` for the fenced Kafka
//! producer): a client whose connection the broker side kills while the relay works is rebuilt
//! with backoff, without a restart and without counting attempts.
//!
//! Each test drives a real [`Relay`] against the real broker. A producer enqueues messages in
//! small rounds; once the relay has sent the first 100, the broker side kills the transport's
//! connection (RabbitMQ: `rabbitmqctl close_connection` on the relay's connection, found by its
//! name; Redis: `CLIENT KILL ID` on the transport's connection; NATS, MQTT and RocketMQ: a
//! [`FaultProxy`] between the client and the broker cuts every connection) while the producer
//! goes on for 100 more. Then every message must be in the broker, none FAILED, no retry counted
//! (`retried == 0`) and every row SENT with `attempts == 1`: a publish that met the dead
//! connection is an outage (`Unavailable`: released, attempt given back), never a failed attempt.

use outbox_testkit_macros::suite_test;
use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use outbox::transport::Transport;
use outbox::{NewMessage, Relay, RelayConfig, RelayHandle, Router, Status};
use outbox_testkit::{
    FaultProxy, SqliteFixture, StoreFixture as _, TransportFixture as _, unique, wait_metrics,
};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::relay::fast_config;

/// Messages enqueued before the kill (the relay has sent them all when it happens).
const BEFORE: usize = 100;
/// Messages enqueued after the kill.
const AFTER: usize = 100;
/// Messages per producer round (one transaction).
const ROUND: usize = 10;

/// A relay over a fresh SQLite outbox routing every topic to `transport` at `destination`, with
/// a publish timeout long enough that a loaded machine does not turn into timeouts (only the
/// kill may disturb a publish) and small batches so that several are in flight at the kill.
fn relay(
    db: &SqliteFixture,
    transport: Arc<dyn Transport>,
    destination: &str,
    name: &str,
) -> RelayHandle {
    Relay::builder(db.store())
        .router(Router::new().route("*", transport, destination))
        .config(RelayConfig {
            batch_size: 20,
            publish_timeout: Duration::from_secs(3),
            lease: Duration::from_secs(10),
            ..fast_config(name)
        })
        .build()
        .unwrap()
        .spawn()
}

/// Enqueue rounds of [`ROUND`] messages until `stop` is set and at least `at_least` were
/// enqueued; returns their ids.
fn produce(
    db: Arc<SqliteFixture>,
    topic: &'static str,
    at_least: usize,
    stop: CancellationToken,
) -> tokio::task::JoinHandle<Vec<Uuid>> {
    tokio::spawn(async move {
        let mut ids = Vec::new();
        let mut round = 0;
        while !stop.is_cancelled() || ids.len() < at_least {
            let msgs: Vec<NewMessage> = (0..ROUND)
                .map(|i| NewMessage::new(topic, format!("r{round}m{i}")))
                .collect();
            ids.extend(db.enqueue_commit(msgs).await.unwrap());
            round += 1;
            // Pacing, not synchronisation: spread the messages over the kill.
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        ids
    })
}

/// What the scenario observed.
struct Outcome {
    db: Arc<SqliteFixture>,
    relay: RelayHandle,
    ids: Vec<Uuid>,
}

/// Run the scenario: a producer, the relay, `kill` once the relay has sent [`BEFORE`] messages,
/// [`AFTER`] more messages after it; wait until every row is SENT (60 s) and check the relay's
/// counters and the rows (see the module docs).
async fn kill_while_relaying<K, Fut>(
    name: &str,
    transport: Arc<dyn Transport>,
    destination: &str,
    kill: K,
) -> Outcome
where
    K: FnOnce() -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    kill_while_relaying_with(name, transport, destination, kill, 0).await
}

/// As [`kill_while_relaying`], allowing up to `burn_allowed` rows to have spent one more attempt
/// (messages in flight at the kill whose publish timed out), never more than one each.
async fn kill_while_relaying_with<K, Fut>(
    name: &str,
    transport: Arc<dyn Transport>,
    destination: &str,
    kill: K,
    burn_allowed: usize,
) -> Outcome
where
    K: FnOnce() -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let db = Arc::new(SqliteFixture::new().await);
    let relay = relay(&db, transport, destination, name);
    let stop_before = CancellationToken::new();
    let before = produce(db.clone(), "before", BEFORE, stop_before.clone());
    let metrics = relay.metrics().clone();
    wait_metrics(&metrics, 30, "the relay to send the first messages", |m| {
        m.sent >= BEFORE as u64
    })
    .await;
    // The producer is still going: messages are in flight while the connection dies.
    kill().await;
    stop_before.cancel();
    let mut ids = before.await.unwrap();
    let stop_after = CancellationToken::new();
    stop_after.cancel();
    ids.extend(
        produce(db.clone(), "after", AFTER, stop_after)
            .await
            .unwrap(),
    );
    let d = db.clone();
    let waited = wait_until_sent(&d, &ids).await;
    let snap = relay.metrics().snapshot();
    let rows = db.rows().await;
    let not_sent: Vec<_> = rows
        .iter()
        .filter(|r| r.status != Status::Sent.as_i16())
        .collect();
    assert!(
        waited && not_sent.is_empty(),
        "{} of {} rows not SENT within 60 s without a restart: {:?}; {snap:?}",
        not_sent.len(),
        rows.len(),
        not_sent.iter().take(3).collect::<Vec<_>>()
    );
    assert_eq!(snap.failed, 0, "dead-lettered: {snap:?}");
    let burned: Vec<_> = rows.iter().filter(|r| r.attempts != 1).collect();
    assert!(
        snap.retried as usize <= burn_allowed && burned.len() <= burn_allowed,
        "the dead client burned attempts ({} rows with attempts != 1, e.g. {:?}): {snap:?}",
        burned.len(),
        burned.first()
    );
    assert!(
        rows.iter().all(|r| r.attempts <= 2),
        "a row spent more than one extra attempt: {:?}",
        rows.iter().find(|r| r.attempts > 2)
    );
    Outcome { db, relay, ids }
}

/// Wait up to 60 s for every row of `ids` to be SENT; whether they all were.
async fn wait_until_sent(db: &SqliteFixture, ids: &[Uuid]) -> bool {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let rows = db.rows().await;
        let sent: HashSet<Uuid> = rows
            .iter()
            .filter(|r| r.status == Status::Sent.as_i16())
            .map(|r| r.message_id)
            .collect();
        if ids.iter().all(|id| sent.contains(id)) {
            return true;
        }
        if tokio::time::Instant::now() > deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Every id of `ids` is among `got` (copies of a message in doubt at the kill are allowed: the
/// consumer's inbox absorbs them).
fn assert_delivered(ids: &[Uuid], got: &HashSet<Uuid>) {
    let missing: Vec<_> = ids.iter().filter(|id| !got.contains(id)).collect();
    assert!(
        missing.is_empty(),
        "{} of {} messages not in the broker, e.g. {:?}",
        missing.len(),
        ids.len(),
        missing.first()
    );
}

/// Redis: `CLIENT KILL ID` on the transport's connection while the relay works. The
/// `ConnectionManager` reconnects; a pipeline that met the dead connection is `Unavailable`.
#[suite_test]
async fn defect_04_redis_killed_connection_is_rebuilt_without_burning_attempts(
    fx: outbox_testkit::RedisFixture,
) {
    let stream = fx.key("dead");
    let client_id = || {
        let mut conn = fx.transport.connection();
        async move {
            redis::cmd("CLIENT")
                .arg("ID")
                .query_async::<i64>(&mut conn)
                .await
                .expect("CLIENT ID")
        }
    };
    let before = client_id().await;
    let out = kill_while_relaying("d04-redis", fx.transport.clone(), &stream, || async {
        let killed: i64 = fx
            .query(redis::cmd("CLIENT").arg("KILL").arg("ID").arg(before))
            .await;
        assert_eq!(killed, 1, "the transport's connection was killed");
    })
    .await;
    assert_ne!(
        client_id().await,
        before,
        "a new connection serves the transport"
    );
    let got: HashSet<Uuid> = fx
        .entries(&stream)
        .await
        .into_iter()
        .filter_map(|(_, f)| Uuid::parse_str(std::str::from_utf8(f.get("id")?).ok()?).ok())
        .collect();
    assert_delivered(&out.ids, &got);
    out.relay.shutdown().await.unwrap();
    drop(out.db);
}

/// RabbitMQ: `rabbitmqctl close_connection` on the relay's connection (found by its connection
/// name) while the relay works. The transport reconnects (its probe or its next publish); a
/// publish that met the closed connection is `Unavailable`.
#[suite_test]
async fn defect_04_rabbitmq_closed_connection_is_rebuilt_without_burning_attempts(
    fx: outbox_testkit::RabbitMqFixture,
) {
    let conn_name = unique("obx-d04");
    let mut config = outbox_testkit::rabbitmq_config(&outbox_testkit::rabbitmq_url());
    config.connection_name = conn_name.clone();
    let transport = Arc::new(
        outbox::RabbitMqTransport::connect(config)
            .await
            .expect("connect"),
    );
    let destination = fx.topic_destination();
    let out = kill_while_relaying("d04-rabbitmq", transport, &destination, || async {
        let closed = close_rabbitmq_connections(&conn_name).await;
        assert!(closed >= 1, "no connection named {conn_name} to close");
    })
    .await;
    let got: HashSet<Uuid> = fx
        .take_all(&fx.queue)
        .await
        .into_iter()
        .filter_map(|s| Uuid::parse_str(&s.received.native_id?).ok())
        .collect();
    assert_delivered(&out.ids, &got);
    out.relay.shutdown().await.unwrap();
}

/// Close every RabbitMQ connection whose client-given name is `name` (`rabbitmqctl`, run as root
/// beside the broker); returns how many.
async fn close_rabbitmq_connections(name: &str) -> usize {
    let name = name.to_owned();
    tokio::task::spawn_blocking(move || {
        let list = std::process::Command::new("rabbitmqctl")
            .args([
                "list_connections",
                "-q",
                "--no-table-headers",
                "pid",
                "client_properties",
            ])
            .output()
            .expect("rabbitmqctl is needed for this test (run as root beside RabbitMQ)");
        assert!(list.status.success(), "{list:?}");
        let text = String::from_utf8_lossy(&list.stdout).into_owned();
        let mut closed = 0;
        for line in text.lines().filter(|l| l.contains(&name)) {
            let pid = line.split_whitespace().next().expect("pid");
            let out = std::process::Command::new("rabbitmqctl")
                .args(["close_connection", pid, "issue 11 item 4 test"])
                .output()
                .expect("rabbitmqctl close_connection");
            assert!(out.status.success(), "{out:?}");
            closed += 1;
        }
        closed
    })
    .await
    .unwrap()
}

/// NATS: a [`FaultProxy`] between the client and the server cuts the connection while the relay
/// works (and lets the client reconnect at once). async-nats reconnects by itself; a PubAck
/// lost with the connection is `Unavailable` (JetStream deduplicates the re-publish by
/// `Nats-Msg-Id`).
#[suite_test]
async fn defect_04_nats_cut_connection_is_rebuilt_without_burning_attempts() {
    let (proxy, fx) = outbox_testkit::NatsFixture::behind_proxy().await;
    let destination = fx.topic_destination();
    let out = kill_while_relaying("d04-nats", fx.transport.clone(), &destination, || async {
        proxy.set_blocked(true);
        proxy.set_blocked(false);
    })
    .await;
    assert!(
        fx.transport
            .client()
            .statistics()
            .connects
            .load(std::sync::atomic::Ordering::Relaxed)
            >= 2,
        "the client reconnected"
    );
    let got: HashSet<Uuid> = fx
        .received()
        .await
        .iter()
        .filter_map(outbox_testkit::header_message_id)
        .collect();
    assert_delivered(&out.ids, &got);
    out.relay.shutdown().await.unwrap();
    fx.cleanup().await;
}

/// MQTT: a [`FaultProxy`] between the transport and the broker cuts the connection while the
/// relay works. The transport's event loop reconnects; publishes waiting for their PUBACK when
/// the connection dies are `Unavailable`.
#[suite_test]
async fn defect_04_mqtt_cut_connection_is_rebuilt_without_burning_attempts(
    fx: outbox_testkit::MqttFixture,
) {
    let upstream = outbox::transport::mqtt::parse_url(&outbox_testkit::mqtt_url()).unwrap();
    let proxy = FaultProxy::start(format!("{}:{}", upstream.host, upstream.port)).await;
    let transport = Arc::new(
        outbox_testkit::mqtt::mqtt_transport(outbox::MqttConfig::new(format!(
            "mqtt://{}",
            proxy.addr
        )))
        .await,
    );
    let topic = fx.topic("dead");
    let out = kill_while_relaying("d04-mqtt", transport, &topic, || async {
        proxy.set_blocked(true);
        proxy.set_blocked(false);
    })
    .await;
    let got: HashSet<Uuid> = fx
        .received_on(&topic)
        .await
        .iter()
        .filter_map(|p| {
            p.properties
                .as_ref()?
                .user_properties
                .iter()
                .find_map(|(k, v)| {
                    (k == outbox::message::HEADER_MESSAGE_ID).then(|| Uuid::parse_str(v).ok())?
                })
        })
        .collect();
    assert_delivered(&out.ids, &got);
    out.relay.shutdown().await.unwrap();
}

/// RocketMQ: every TCP connection of this test process to the RocketMQ name server and broker is
/// reset (`ss -K`, run as root) while the relay works. The client reconnects by itself and every
/// message is delivered without a restart and without a dead letter. Known gap, in the client
/// (`rocketmq-transport` 1.0.0): when a connection's reader ends, the requests still awaiting an
/// answer on it are not failed (the session's pending requests are completed only when its last
/// handle is dropped, and each waiting request holds one), and the client offers no
/// connection-closed event or connection identity the transport could watch instead. So a send
/// in flight on the reset connection waits for the client's `send_timeout` or the relay's
/// `publish_timeout`, whichever ends first (both 3 s here), and spends one attempt: 1 to 17 rows
/// of 250 in seven runs. Bounded here by what can be in flight at the reset: at most 40 rows (2
/// batches of 20), one extra attempt each.
///
/// Not covered: a broker restart (the shared broker must stay up for the other tests).
#[cfg(feature = "rocketmq")]
#[suite_test]
async fn defect_04_rocketmq_reset_connections_are_rebuilt_and_nothing_is_dead_lettered(
    fx: outbox_testkit::RocketMqFixture,
) {
    let out = kill_while_relaying_with(
        "d04-rocketmq",
        fx.transport.clone(),
        &fx.topic,
        || async {
            let reset = reset_own_connections("rocketmq").await;
            assert!(reset >= 1, "no connection to RocketMQ to reset");
        },
        40,
    )
    .await;
    let got: HashSet<Uuid> = fx
        .messages()
        .await
        .iter()
        .filter_map(|m| {
            outbox_testkit::header_message_id(&outbox_testkit::rocketmq::received_of(m))
        })
        .collect();
    assert_delivered(&out.ids, &got);
    out.relay.shutdown().await.unwrap();
}

/// Reset (`ss -K`) every established TCP connection of this process to a port on which a process
/// whose name contains `server` listens; returns how many. Needs root (`CAP_NET_ADMIN`) and a
/// kernel with `CONFIG_INET_DIAG_DESTROY`.
#[cfg(feature = "rocketmq")]
async fn reset_own_connections(server: &str) -> usize {
    let server = server.to_owned();
    tokio::task::spawn_blocking(move || {
        let ss = |args: &[&str]| {
            let o = std::process::Command::new("ss")
                .args(args)
                .output()
                .expect("ss (iproute2) is needed for this test");
            assert!(o.status.success(), "ss {args:?}: {o:?}");
            String::from_utf8_lossy(&o.stdout).into_owned()
        };
        // "LISTEN 0 128 127.0.0.1:19876 0.0.0.0:* users:(("rocketmq-namesr",pid=…))"
        let ports: HashSet<String> = ss(&["-tlnpH"])
            .lines()
            .filter(|l| l.contains(&server))
            .filter_map(|l| Some(l.split_whitespace().nth(3)?.rsplit(':').next()?.to_owned()))
            .collect();
        assert!(!ports.is_empty(), "no {server} process listens here");
        let me = format!("pid={},", std::process::id());
        let mut reset = 0;
        for l in ss(&["-tnpH", "state", "established"]).lines() {
            if !l.contains(&me) {
                continue;
            }
            // "0 0 127.0.0.1:40000 127.0.0.1:10911 users:(…)"
            let cols: Vec<&str> = l.split_whitespace().collect();
            let (Some(local), Some(peer)) = (cols.get(2), cols.get(3)) else {
                continue;
            };
            let peer_port = peer.rsplit(':').next().unwrap_or_default();
            if !ports.contains(peer_port) {
                continue;
            }
            let local_port = local.rsplit(':').next().unwrap_or_default();
            ss(&["-K", "dst", peer, "sport", "=", &format!(":{local_port}")]);
            reset += 1;
        }
        reset
    })
    .await
    .unwrap()
}
