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

/// One test (`#[suite_test]`, crates/outbox-testkit-macros) per fixture and case, in a module per fixture: `<module>::<name>` runs
/// `<suite>::<function>(&fx)` on a fresh `<Fixture>::new()`, then `fx.cleanup()`. A case is
/// `name = function`, or `name` alone when the function has the test's name. The fixtures are
/// a list of `module: Fixture`, or `stores` (SQLite, PostgreSQL and MySQL/MariaDB in modules
/// `sqlite`, `postgres`, `mysql`), or `stores_and_partitioned` (those and a time-partitioned
/// PostgreSQL table, `postgres_partitioned`).
macro_rules! fixture_tests {
    (stores, $suite:tt, $cases:tt $(,)?) => {
        fixture_tests!(
            [
                sqlite: outbox_testkit::SqliteFixture,
                postgres: outbox_testkit::PgFixture,
                mysql: outbox_testkit::MySqlFixture,
            ],
            $suite,
            $cases
        );
    };
    (stores_and_partitioned, $suite:tt, $cases:tt $(,)?) => {
        fixture_tests!(
            [
                sqlite: outbox_testkit::SqliteFixture,
                postgres: outbox_testkit::PgFixture,
                postgres_partitioned: outbox_testkit::PgPartitionedFixture,
                mysql: outbox_testkit::MySqlFixture,
            ],
            $suite,
            $cases
        );
    };
    ([$($(#[$attr:meta])* $module:ident: $fixture:ty),+ $(,)?], $suite:tt, $cases:tt $(,)?) => {
        $(fixture_tests!(@module $(#[$attr])* $module, $fixture, $suite, $cases);)+
    };
    (@module $(#[$attr:meta])* $module:ident, $fixture:ty, $suite:tt,
     [$($name:ident $(= $func:ident)?),* $(,)?]) => {
        $(#[$attr])*
        mod $module {
            #[allow(unused_imports)]
            use super::*;
            #[allow(unused_imports)]
            use outbox_testkit::{StoreFixture as _, TransportFixture as _};
            $(fixture_tests!(@case $fixture, $suite, $name $(= $func)?);)*
        }
    };
    (@case $fixture:ty, $suite:tt, $name:ident) => {
        fixture_tests!(@case $fixture, $suite, $name = $name);
    };
    (@case $fixture:ty, [$($suite:tt)+], $name:ident = $func:ident) => {
        #[outbox_testkit_macros::suite_test]
        async fn $name(fx: $fixture) {
            $($suite)+::$func(&fx).await;
        }
    };
}

/// `outbox::Handler<$db>` for a test handler with `effects: String` and `calls` fields: count
/// the call, insert the message's `(message_id, payload)` into `effects` on the handler's
/// connection (placeholders `$values`, the id bound as `$id`), then evaluate `$then`, with the
/// handler as `$this` and the message as `$msg`.
macro_rules! effect_handler {
    ($handler:ty, $db:ty, $conn:ty, $values:literal,
     |$this:ident, $msg:ident| id: $id:expr, then: $then:expr) => {
        #[async_trait::async_trait]
        impl outbox::Handler<$db> for $handler {
            async fn handle(
                &self,
                conn: &mut $conn,
                $msg: &outbox::InboundMessage,
            ) -> Result<(), outbox::HandlerError> {
                let $this = self;
                $this
                    .calls
                    .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                sqlx::query(sqlx::AssertSqlSafe(format!(
                    "INSERT INTO {} (message_id, payload) VALUES {}",
                    $this.effects, $values
                )))
                .bind($id)
                .bind(&$msg.payload)
                .execute(&mut *conn)
                .await
                .map_err(outbox::HandlerError::transient)?;
                $then
            }
        }
    };
}

mod admin;
mod admin_auth;
mod admin_inbox;
mod broker_support;
mod cases;
mod cases_faults;
mod cases_fencing;
mod cases_mysql;
mod cases_mysql_locks;
mod clusters;
mod confirm;
mod confirm_upgrade;
mod confirm_webhook;
mod consumer_suite;
mod crash;
mod crash_mysql;
mod db_roles;
mod dead_client;
mod group;
mod inbox;
mod inbox_batch;
mod inbox_lock_order;
mod kafka;
mod lanes;
mod logs;
mod model;
mod mqtt;
mod ordering;
mod otel;
mod rabbitmq;
mod rabbitmq_consumer;
mod readme;
mod redis;
mod redis_consumer;
mod relay;
mod relay_faults;
mod resilience;
mod retention;
#[cfg(feature = "rocketmq")]
mod rocketmq;
mod store;
mod transport;
mod two_phase;
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
