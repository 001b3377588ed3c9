//! The outbox test suite against real PostgreSQL, MySQL/MariaDB, NATS JetStream and SQLite (one
//! test binary).
//!
//! Services: `OUTBOX_TEST_POSTGRES_URL` (default `postgres://postgres@127.0.0.1:5432/test`),
//! `OUTBOX_TEST_RABBITMQ_URL` (default `amqp://guest:guest@127.0.0.1:5672/%2f`),
//! `OUTBOX_TEST_MYSQL_URL` (default `mysql://root@127.0.0.1:3306/test`) and
//! `OUTBOX_TEST_NATS_URL` (default `nats://127.0.0.1:4222`), `OUTBOX_TEST_REDIS_URL` (default
//! `redis://127.0.0.1:6379`) and `OUTBOX_TEST_MQTT_URL` (default `mqtt://127.0.0.1:1883`). A test whose service does not answer
//! fails with a message naming it.

// The RocketMQ client's futures are deep types; proving them `Send` needs more than the default.
#![cfg_attr(feature = "rocketmq", recursion_limit = "256")]

mod cases;
mod cases_fencing;
mod cases_mysql;
mod confirm;
mod consumer_suite;
mod crash;
mod crash_mysql;
mod db_roles;
mod dead_client;
mod inbox;
mod kafka;
mod mqtt;
mod ordering;
mod rabbitmq;
mod readme;
mod redis;
mod relay;
mod relay_faults;
mod resilience;
#[cfg(feature = "rocketmq")]
mod rocketmq;
mod store;
mod transport;
mod wire;

/// Log to the test output with `RUST_LOG=outbox=debug`.
pub fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
}

/// Compile-time check (docs/design/STYLE.md): the futures of the stores, transports, relay and inbox are
/// `Send`, so they can run on a multi-threaded runtime. Nothing is awaited.
#[test]
fn futures_are_send() {
    use outbox::store::Store;
    use outbox::transport::Transport;
    fn send<T: Send>(_: &T) {}
    #[allow(dead_code, clippy::too_many_arguments)]
    fn check(
        pg: outbox::PgStore,
        my: outbox::MySqlStore,
        my_conn: &mut sqlx::MySqlConnection,
        sqlite: outbox::SqliteStore,
        pg_conn: &mut sqlx::PgConnection,
        sqlite_conn: &mut sqlx::SqliteConnection,
        nats: outbox::NatsTransport,
        webhook: outbox::WebhookTransport,
        relay: outbox::Relay,
        inbox: outbox::Inbox<sqlx::Postgres>,
        msg: outbox::InboundMessage,
        handler: &inbox::EffectHandler,
    ) {
        send(&pg.enqueue(pg_conn, outbox::NewMessage::new("t", "x")));
        send(&sqlite.enqueue(sqlite_conn, outbox::NewMessage::new("t", "x")));
        send(&my.enqueue(my_conn, outbox::NewMessage::new("t", "x")));
        send(&my.membership(&outbox::store::MembershipRequest {
            relay: "t".into(),
            lease: std::time::Duration::from_secs(1),
            held: Vec::new(),
            acquire: true,
            routes: Vec::new(),
        }));
        send(&pg.read_buckets(&[0], &[], 1));
        send(&sqlite.complete_in_buckets("t", &[]));
        send(&pg.migrate());
        send(&sqlite.stats());
        send(&nats.publish(&[]));
        send(&webhook.publish(&[]));
        send(&relay.run(tokio_util::sync::CancellationToken::new()));
        send(&inbox.process(&msg, handler));
    }
    let _ = check;
}
