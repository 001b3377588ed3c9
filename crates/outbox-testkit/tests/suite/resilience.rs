//! Issue 11, items 4 and 9, against the real brokers through a real relay: a dead client is
//! rebuilt without burning attempts (Kafka producer fenced), and configuration faults (RabbitMQ
//! 403, an exchange deleted and re-created under load, an untrusted TLS certificate) pause the
//! transport instead of dead-lettering, with one log line per state change.
//!
//! The tests that count log lines run on a current-thread runtime with a thread-local capturing
//! subscriber, so they see exactly the relay's own events (every task of the runtime runs on the
//! test's thread).

use outbox_testkit_macros::suite_test;
use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use outbox::transport::Transport;
use outbox::{RabbitMqTransport, RelayConfig, Router, Status, WebhookConfig, WebhookTransport};
use outbox_testkit::store_suite::relay_routed;
use outbox_testkit::{
    KafkaFixture, RabbitMqFixture, SqliteFixture, StoreFixture, TransportFixture as _,
    rabbitmq_config, rabbitmq_host_port, unique, wait_listening, wait_metrics, wait_until,
};

use crate::confirm::wait_status;
use crate::logs::Logs;
use crate::relay::fast_config;

/// Lines from the relay's outage handling: warnings that the transport is unavailable and
/// notices that it is available again.
fn state_changes(logs: &Logs) -> usize {
    logs.count("WARN", "transport unavailable") + logs.count("INFO", "available again")
}

/// Asserts that the relay warned once that the transport is unavailable.
///
/// # Panics
/// When it warned more or less often, with the last log lines.
fn assert_one_outage_warning(logs: &Logs) {
    assert_eq!(
        logs.count("WARN", "transport unavailable"),
        1,
        "one warning per outage:\n{}",
        logs.dump()
    );
}

/// Run `rabbitmqctl` (the tests run as root beside the broker).
///
/// # Panics
/// When it fails, with its output.
async fn rabbitmqctl(args: &[&str]) {
    let args: Vec<String> = args.iter().map(|s| (*s).to_owned()).collect();
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new("rabbitmqctl")
            .args(&args)
            .output()
            .map(|o| (o, args))
    })
    .await
    .unwrap()
    .expect("rabbitmqctl is needed for this test (run as root beside RabbitMQ)");
    let (o, args) = out;
    assert!(
        o.status.success(),
        "rabbitmqctl {args:?} failed: {}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
}

/// A RabbitMQ user that may connect and read but not write, deleted on drop.
struct ReadOnlyUser {
    name: String,
}

impl ReadOnlyUser {
    async fn create() -> ReadOnlyUser {
        let name = unique("obxu");
        rabbitmqctl(&["add_user", &name, "pw"]).await;
        // configure, write, read: no write permission on any resource.
        rabbitmqctl(&["set_permissions", "-p", "/", &name, ".*", "^$", ".*"]).await;
        ReadOnlyUser { name }
    }

    fn url(&self) -> String {
        format!("amqp://{}:pw@{}/%2f", self.name, rabbitmq_host_port())
    }

    async fn grant_write(&self) {
        rabbitmqctl(&["set_permissions", "-p", "/", &self.name, ".*", ".*", ".*"]).await;
    }
}

impl Drop for ReadOnlyUser {
    fn drop(&mut self) {
        let _ = std::process::Command::new("rabbitmqctl")
            .args(["delete_user", &self.name])
            .output();
    }
}

/// Take every message from `fx`'s queue: their AMQP message ids (the outbox message ids).
async fn taken_message_ids(fx: &RabbitMqFixture) -> HashSet<String> {
    fx.take_all(&fx.queue)
        .await
        .into_iter()
        .filter_map(|s| s.received.native_id)
        .collect()
}

/// [`fast_config`] named `name` for a broker that refuses publishes: a refused publish gives up
/// after 2 s, well within the 6 s lease.
fn refusal_config(name: &str) -> RelayConfig {
    RelayConfig {
        publish_timeout: Duration::from_secs(2),
        lease: Duration::from_secs(6),
        ..fast_config(name)
    }
}

/// Wait (at most 60 s) until the relay released `released` refused publishes (`what`), or
/// dead-lettered one; then nothing is dead-lettered, no attempt was counted, and every row of
/// `db` is PENDING with no attempt spent.
async fn refusals_released_at_no_cost(
    db: &SqliteFixture,
    metrics: &Arc<outbox::RelayMetrics>,
    what: &str,
    released: u64,
) {
    wait_metrics(metrics, 60, what, |m| {
        m.released >= released || m.failed > 0
    })
    .await;
    let snap = metrics.snapshot();
    assert_eq!(snap.failed, 0, "refusals dead-lettered rows: {snap:?}");
    assert_eq!(snap.retried, 0, "refusals burned attempts: {snap:?}");
    for r in db.rows().await {
        assert_eq!(r.status, Status::Pending as i16, "{r:?}");
        assert_eq!(r.attempts, 0, "an attempt was burned: {r:?}");
    }
}

/// Issue 11 item 9: RabbitMQ `403 ACCESS_REFUSED` (a user without write permission) used to
/// dead-letter every row after one attempt. Now the transport is paused: nothing is FAILED, no
/// attempt is counted, the probe (which needs no permission) succeeds while publishes are still
/// refused without a log storm (one warning), and once the permission is granted every row is
/// delivered with one attempt and one "available again" line.
#[tokio::test]
async fn defect_09_rabbitmq_access_refused_pauses_without_dead_letters() {
    let (logs, _guard) = Logs::capture(tracing::Level::DEBUG);
    let fx = RabbitMqFixture::new().await;
    let user = ReadOnlyUser::create().await;
    let transport = Arc::new(
        RabbitMqTransport::connect(rabbitmq_config(&user.url()))
            .await
            .expect("the read-only user may connect"),
    );
    let db = SqliteFixture::new().await;
    let router = Router::new().route("*", transport, fx.topic_destination());
    let relay = relay_routed(db.store(), router, refusal_config("d09-403")).spawn();
    let ids = db.commit_numbered("perm", "m", 100).await;
    refusals_released_at_no_cost(&db, relay.metrics(), "three refusals (300 releases)", 300).await;
    assert_one_outage_warning(&logs);
    assert_eq!(logs.count("INFO", "available again"), 0, "{}", logs.dump());
    assert!(
        logs.count("DEBUG", "still unavailable after a successful probe") >= 2,
        "relapses are logged at debug:\n{}",
        logs.dump()
    );
    user.grant_write().await;
    wait_status(&db, &ids, Status::Sent, Duration::from_secs(30)).await;
    for r in db.rows().await {
        assert_eq!(r.attempts, 1, "{r:?}");
    }
    assert_eq!(state_changes(&logs), 2, "{}", logs.dump());
    let stored = taken_message_ids(&fx).await;
    let expected: HashSet<String> = ids.iter().map(|u| u.to_string()).collect();
    assert_eq!(stored, expected);
    relay.shutdown().await.unwrap();
    fx.cleanup().await;
}

/// Issue 11 item 9: an exchange deleted and re-created while messages flow used to dead-letter
/// the messages that met the gap (`404 NOT_FOUND`, permanent). Now they wait: nothing is FAILED
/// and every message is delivered once the exchange is back.
#[suite_test]
async fn defect_09_rabbitmq_exchange_recreated_under_load_dead_letters_nothing() {
    let fx = Arc::new(RabbitMqFixture::new().await);
    let db = Arc::new(SqliteFixture::new().await);
    let router = Router::new().route("*", fx.transport.clone(), fx.topic_destination());
    let relay = relay_routed(db.store(), router, fast_config("d09-404")).spawn();
    let stop = tokio_util::sync::CancellationToken::new();
    let producer = {
        let (db, stop) = (db.clone(), stop.clone());
        tokio::spawn(async move {
            let mut ids = Vec::new();
            let mut round = 0;
            while !stop.is_cancelled() || round < 4 {
                ids.extend(db.commit_numbered("load", &format!("r{round}m"), 20).await);
                round += 1;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            ids
        })
    };
    let metrics = relay.metrics().clone();
    wait_metrics(&metrics, 20, "messages flowing", |m| m.sent >= 60).await;
    fx.delete_exchange(&fx.exchange).await;
    wait_metrics(
        &metrics,
        20,
        "the relay to meet the missing exchange",
        |m| m.outages >= 1 || m.failed > 0,
    )
    .await;
    fx.declare_exchange(&fx.exchange).await;
    fx.declare_queue(&fx.queue, &[(&fx.exchange, "#")]).await;
    stop.cancel();
    let ids = producer.await.unwrap();
    wait_status(db.as_ref(), &ids, Status::Sent, Duration::from_secs(30)).await;
    let snap = relay.metrics().snapshot();
    assert_eq!(snap.failed, 0, "{snap:?}");
    assert!(snap.released > 0, "the gap was met: {snap:?}");
    let stored = taken_message_ids(&fx).await;
    for id in &ids {
        assert!(stored.contains(&id.to_string()), "{id} not delivered");
    }
    relay.shutdown().await.unwrap();
    fx.cleanup().await;
}

/// An `openssl s_server` with a fresh self-signed certificate on a loopback port: TLS in front of
/// nothing. Killed on drop.
struct SelfSignedTls {
    port: u16,
    child: std::process::Child,
    _dir: std::path::PathBuf,
}

impl SelfSignedTls {
    async fn start() -> SelfSignedTls {
        let dir = std::env::temp_dir().join(unique("obx-tls"));
        std::fs::create_dir_all(&dir).unwrap();
        let (key, cert) = (dir.join("key.pem"), dir.join("cert.pem"));
        let out = std::process::Command::new("openssl")
            .args([
                "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
            ])
            .args(["-subj", "/CN=localhost", "-keyout"])
            .arg(&key)
            .arg("-out")
            .arg(&cert)
            .output()
            .expect("openssl is needed for this test");
        assert!(out.status.success(), "{out:?}");
        let port = outbox_testkit::free_port();
        let child = std::process::Command::new("openssl")
            .args(["s_server", "-quiet", "-www", "-accept"])
            .arg(format!("127.0.0.1:{port}"))
            .arg("-cert")
            .arg(&cert)
            .arg("-key")
            .arg(&key)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("start openssl s_server");
        wait_listening("the TLS listener", port, Duration::from_secs(10)).await;
        SelfSignedTls {
            port,
            child,
            _dir: dir,
        }
    }
}

impl Drop for SelfSignedTls {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Issue 11 item 9: a webhook behind a self-signed certificate used to flap down/up (the probe
/// was a TCP connect, which succeeds; every publish then failed the TLS handshake again), with
/// two log lines per cycle. Now the probe makes the TLS handshake too: the transport stays
/// paused, one warning is logged, nothing is dead-lettered and no attempt is counted.
#[tokio::test]
async fn defect_09_webhook_untrusted_certificate_pauses_without_flapping() {
    let (logs, _guard) = Logs::capture(tracing::Level::DEBUG);
    let tls = SelfSignedTls::start().await;
    let mut config = WebhookConfig::new(format!("https://127.0.0.1:{}/hook", tls.port));
    config.timeout = Duration::from_secs(2);
    let transport = Arc::new(WebhookTransport::new(config).unwrap());
    let db = SqliteFixture::new().await;
    let relay = relay_routed(
        db.store(),
        Router::new().route("*", transport.clone(), ""),
        fast_config("d09-tls"),
    )
    .spawn();
    db.commit_numbered("tls", "m", 20).await;
    let l = logs.clone();
    wait_until(
        "eight failed probes (or eight flaps)",
        Duration::from_secs(60),
        move || {
            let l = l.clone();
            async move {
                l.count("DEBUG", "probe failed") >= 8 || l.count("INFO", "available again") >= 8
            }
        },
    )
    .await;
    assert_eq!(
        logs.count("INFO", "available again"),
        0,
        "the transport flapped:\n{}",
        logs.dump()
    );
    assert_one_outage_warning(&logs);
    assert!(
        transport.probe().await.is_err(),
        "the probe sees the TLS fault"
    );
    let snap = relay.metrics().snapshot();
    assert_eq!(snap.failed, 0, "{snap:?}");
    assert_eq!(snap.outages, 1, "{snap:?}");
    for r in db.rows().await {
        assert_eq!(r.attempts, 0, "{r:?}");
        assert_eq!(r.status, Status::Pending as i16, "{r:?}");
    }
    relay.shutdown().await.unwrap();
}

/// Issue 11 item 4: a Kafka producer that librdkafka declares dead (a fatal error, as for a
/// producer fenced by the broker) used to fail its batch as retryable (attempts burned) and was
/// rebuilt only as a side effect of that failure. Now every failure of a dead producer is
/// `Unavailable` (no attempt counted), the producer is rebuilt, and every message is delivered
/// with one attempt, without a restart.
#[suite_test]
async fn defect_04_kafka_fenced_producer_is_rebuilt_without_burning_attempts(fx: KafkaFixture) {
    let db = SqliteFixture::new().await;
    // Fence the producer before the relay publishes anything.
    let fenced = fx.transport.producer();
    {
        use rdkafka::producer::Producer as _;
        let reason = std::ffi::CString::new("fenced by the test").unwrap();
        // SAFETY: the client pointer is valid while `fenced` is alive; librdkafka copies the
        // reason.
        unsafe {
            rdkafka::bindings::rd_kafka_test_fatal_error(
                fenced.client().native_ptr(),
                rdkafka::bindings::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_PRODUCER_FENCED,
                reason.as_ptr(),
            );
        }
        assert!(
            fenced.client().fatal_error().is_some(),
            "the producer is dead"
        );
    }
    let relay = relay_routed(
        db.store(),
        Router::new().route("*", fx.transport.clone(), fx.good_destination()),
        fast_config("d04-kafka"),
    )
    .spawn();
    let ids = db.commit_numbered("fenced", "m", 100).await;
    wait_status(&db, &ids, Status::Sent, Duration::from_secs(60)).await;
    let snap = relay.metrics().snapshot();
    assert_eq!(snap.failed, 0, "{snap:?}");
    assert_eq!(
        snap.retried, 0,
        "the dead producer burned attempts: {snap:?}"
    );
    for r in db.rows().await {
        assert_eq!(r.attempts, 1, "{r:?}");
    }
    {
        use rdkafka::producer::Producer as _;
        let current = fx.transport.producer();
        assert!(!Arc::ptr_eq(&current, &fenced), "the producer was rebuilt");
        assert!(current.client().fatal_error().is_none());
    }
    let got: HashSet<uuid::Uuid> = fx
        .received()
        .await
        .iter()
        .filter_map(outbox_testkit::header_message_id)
        .collect();
    assert_eq!(got, ids.iter().copied().collect::<HashSet<_>>());
    relay.shutdown().await.unwrap();
}

/// A private `nats-server` with JetStream and two users, on a free loopback port: `admin` may do
/// anything; `relay` may do anything but publish to `denied.>` until [`PrivateNats::grant`]
/// rewrites the configuration and reloads it (SIGHUP). Killed on drop.
struct PrivateNats {
    port: u16,
    conf: std::path::PathBuf,
    child: std::process::Child,
    _dir: std::path::PathBuf,
}

impl PrivateNats {
    fn config(port: u16, store: &std::path::Path, deny: bool) -> String {
        let relay_perms = if deny {
            r#"permissions: { publish: { deny: ["denied.>"] } }"#
        } else {
            ""
        };
        format!(
            "listen: \"127.0.0.1:{port}\"\njetstream {{ store_dir: \"{}\" }}\n\
             authorization {{\n  users = [\n    {{ user: admin, password: pw }}\n    \
             {{ user: relay, password: pw, {relay_perms} }}\n  ]\n}}\n",
            store.display()
        )
    }

    async fn start() -> PrivateNats {
        let dir = std::env::temp_dir().join(unique("obx-nats"));
        std::fs::create_dir_all(dir.join("js")).unwrap();
        let port = outbox_testkit::free_port();
        let conf = dir.join("nats.conf");
        std::fs::write(&conf, Self::config(port, &dir.join("js"), true)).unwrap();
        let child = std::process::Command::new("nats-server")
            .arg("-c")
            .arg(&conf)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("nats-server is needed for this test (it runs a private server with users)");
        wait_listening(
            &format!("the private nats-server on 127.0.0.1:{port}"),
            port,
            Duration::from_secs(20),
        )
        .await;
        PrivateNats {
            port,
            conf,
            child,
            _dir: dir,
        }
    }

    fn url(&self, user: &str) -> String {
        format!("nats://{user}:pw@127.0.0.1:{}", self.port)
    }

    /// Lift the deny rule and reload the server's configuration.
    fn grant(&self) {
        let store = self._dir.join("js");
        std::fs::write(&self.conf, Self::config(self.port, &store, false)).unwrap();
        let out = std::process::Command::new("kill")
            .args(["-HUP", &self.child.id().to_string()])
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
    }
}

impl Drop for PrivateNats {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self._dir);
    }
}

/// Issue 11 item 9 on NATS: a publish the server refuses for lack of permission gets no PubAck
/// (the server reports the violation on the connection only), so it used to surface as an ack
/// timeout: retryable, an attempt burned per try, and the rows dead-lettered after
/// `max_attempts`. Now the transport watches the connection's permission errors: the refused
/// rows are released without an attempt while the transport pauses (one warning), the rows of a
/// permitted subject are published meanwhile, and once the permission is granted (the server
/// reloads its configuration) every refused row is delivered with one attempt.
#[tokio::test]
async fn defect_09_nats_permission_violation_pauses_without_dead_letters() {
    use outbox::{NatsConfig, NatsTransport, transport::nats::StreamSetup};
    let (logs, _guard) = Logs::capture(tracing::Level::DEBUG);
    let server = PrivateNats::start().await;
    let admin = outbox_testkit::nats_client_at(&server.url("admin")).await;
    let js = async_nats::jetstream::new(admin);
    js.create_stream(async_nats::jetstream::stream::Config {
        name: "PERM".into(),
        subjects: vec!["denied.>".into(), "allowed.>".into()],
        ..Default::default()
    })
    .await
    .expect("create the stream as admin");
    let mut config = NatsConfig::new(server.url("relay"));
    config.ack_timeout = Duration::from_millis(500);
    config.stream = Some(StreamSetup {
        name: "PERM".into(),
        subjects: vec![],
        create: false,
        replicas: 1,
    });
    let transport = Arc::new(
        NatsTransport::connect(config)
            .await
            .expect("relay connects"),
    );
    let db = SqliteFixture::new().await;
    let router = Router::new()
        .route("denied", transport.clone(), "denied.{topic}")
        .route("allowed", transport.clone(), "allowed.{topic}");
    let relay = relay_routed(
        db.store(),
        router,
        RelayConfig {
            max_attempts: 2,
            ..refusal_config("d09-nats-perm")
        },
    )
    .spawn();
    let denied = db.commit_numbered("denied", "d", 20).await;
    refusals_released_at_no_cost(
        &db,
        relay.metrics(),
        "the refused rows released three times",
        60,
    )
    .await;
    assert_one_outage_warning(&logs);
    assert!(
        logs.count("WARN", "permissions violation") >= 1,
        "the warning names the cause:\n{}",
        logs.dump()
    );
    let allowed = db.commit_numbered("allowed", "a", 20).await;
    wait_status(&db, &allowed, Status::Sent, Duration::from_secs(60)).await;
    server.grant();
    wait_status(&db, &denied, Status::Sent, Duration::from_secs(60)).await;
    for r in db.rows().await {
        assert_eq!(r.attempts, 1, "{r:?}");
    }
    let snap = relay.metrics().snapshot();
    assert_eq!(snap.failed, 0, "{snap:?}");
    let stream = outbox_testkit::nats_stream_info(&js, "PERM").await;
    assert_eq!(stream.state.messages, 40, "{stream:?}");
    relay.shutdown().await.unwrap();
}
