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

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use outbox::message::HEADER_MESSAGE_ID;
use outbox::store::Store;
use outbox::transport::{Outgoing, Transport};
use outbox::{
    EnqueueError, Message, MySqlStore, NatsConfig, NatsTransport, NewMessage, PgStore, SqliteStore,
    StoreOptions, StreamSetup, TransportError,
};
use sqlx::{AssertSqlSafe, MySqlPool, PgPool, Row};
use tokio::sync::Notify;
use uuid::Uuid;

pub mod mqtt;
pub mod redis;
#[cfg(feature = "rocketmq")]
pub mod rocketmq;
#[cfg(feature = "rocketmq")]
pub use rocketmq::RocketMqFixture;
pub mod store_suite;
pub mod transport_suite;

pub use mqtt::{MqttFixture, mqtt_url};
pub use redis::{RedisFixture, redis_url};
pub mod kafka;

pub use kafka::KafkaFixture;
pub mod rabbitmq;

pub use rabbitmq::{RabbitMqFixture, rabbitmq_config, rabbitmq_host_port, rabbitmq_url};

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

/// A lower-case name `prefix_<16 hex digits>`, unique per call: a valid SQL identifier and NATS
/// stream name.
pub fn unique(prefix: &str) -> String {
    format!("{prefix}_{:016x}", rand::random::<u64>())
}

/// Connect a pool of up to `max` connections to the test PostgreSQL.
///
/// # Panics
/// When PostgreSQL does not answer, naming the URL and `OUTBOX_TEST_POSTGRES_URL`.
pub async fn pg_pool(max: u32) -> PgPool {
    let url = postgres_url();
    // Fail fast, naming the service, when nothing answers (the pool itself would wait 20 s).
    let probe = tokio::time::timeout(
        Duration::from_secs(5),
        <sqlx::PgConnection as sqlx::Connection>::connect(&url),
    )
    .await;
    match probe {
        Ok(Ok(conn)) => drop(conn),
        Ok(Err(e)) => panic!(
            "PostgreSQL is not reachable at {url} ({e}); start it or set OUTBOX_TEST_POSTGRES_URL"
        ),
        Err(_) => panic!(
            "PostgreSQL at {url} did not answer within 5 s; start it or set OUTBOX_TEST_POSTGRES_URL"
        ),
    }
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(max)
        .acquire_timeout(Duration::from_secs(20))
        .connect(&url)
        .await
        .unwrap_or_else(|e| {
            panic!(
                "PostgreSQL is not reachable at {url} ({e}); start it or set OUTBOX_TEST_POSTGRES_URL"
            )
        })
}

/// Connect to the test NATS server and wait until connected.
///
/// # Panics
/// When NATS does not answer within 5 s, naming the URL and `OUTBOX_TEST_NATS_URL`.
pub async fn nats_client() -> async_nats::Client {
    nats_client_at(&nats_url()).await
}

/// Connect to NATS at `url` (for example through a [`FaultProxy`]).
///
/// # Panics
/// As [`nats_client`].
pub async fn nats_client_at(url: &str) -> async_nats::Client {
    let connect = outbox::transport::nats::connect_options(url)
        .connection_timeout(Duration::from_secs(5))
        .connect(url);
    match tokio::time::timeout(Duration::from_secs(5), connect).await {
        Ok(Ok(c)) => c,
        Ok(Err(e)) => panic!(
            "NATS is not reachable at {url} ({e}); start nats-server -js or set OUTBOX_TEST_NATS_URL"
        ),
        Err(_) => panic!(
            "NATS at {url} did not answer within 5 s; start nats-server -js or set OUTBOX_TEST_NATS_URL"
        ),
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

/// One outbox row as the tests see it, times measured on the database clock.
#[derive(Debug, Clone, PartialEq)]
pub struct RowState {
    /// Row id.
    pub id: i64,
    /// Message id.
    pub message_id: Uuid,
    /// Status number.
    pub status: i16,
    /// Attempts so far.
    pub attempts: i64,
    /// Last error.
    pub last_error: Option<String>,
    /// `available_at - now()` in milliseconds (negative when due).
    pub due_in_ms: i64,
    /// Lease token, if leased.
    pub lease_token: Option<i64>,
    /// Whether `sent_at` is set.
    pub sent: bool,
    /// Payload bytes.
    pub payload: Vec<u8>,
}

/// A store under test plus the dialect-specific operations the conformance suite needs (enqueue
/// through the caller's transaction is per dialect, not on [`Store`]).
#[async_trait]
pub trait StoreFixture: Send + Sync + 'static {
    /// The store as the relay sees it.
    fn store(&self) -> Arc<dyn Store>;
    /// Enqueue in one transaction, then commit.
    async fn enqueue_commit(&self, msgs: Vec<NewMessage>) -> Result<Vec<Uuid>, EnqueueError>;
    /// Enqueue in one transaction, then roll back; the enqueue result is returned.
    async fn enqueue_rollback(&self, msgs: Vec<NewMessage>) -> Result<Vec<Uuid>, EnqueueError>;
    /// Insert a row with plain SQL giving only the columns a foreign producer must give.
    async fn insert_plain_sql(&self, topic: &str, payload: &[u8]) -> Uuid;
    /// Every row, by id.
    async fn rows(&self) -> Vec<RowState>;
    /// Put the row of `message_id` where a 0.1 relay's row claim left it when that relay
    /// stopped: status 1 (SENDING), one more attempt, a lease owner and token, a lease that
    /// expires in an hour.
    async fn leave_sending(&self, message_id: Uuid);
    /// Validate `table` as this dialect would (the error for an invalid name).
    async fn open_with_table(&self, table: &str) -> Result<(), outbox::StoreError>;
    /// Drop what the fixture created.
    async fn cleanup(&self);

    /// The row of `message_id`.
    async fn row(&self, message_id: Uuid) -> RowState {
        self.rows()
            .await
            .into_iter()
            .find(|r| r.message_id == message_id)
            .unwrap_or_else(|| panic!("no row for message {message_id}"))
    }
}

/// SQLite in a temporary file.
pub struct SqliteFixture {
    /// The store.
    pub store: SqliteStore,
    path: std::path::PathBuf,
}

impl SqliteFixture {
    /// A fresh database file with migrated tables.
    ///
    /// # Panics
    /// When the file cannot be created or migrated.
    pub async fn new() -> SqliteFixture {
        let path = std::env::temp_dir().join(format!("{}.db", unique("outbox_test")));
        let url = format!("sqlite://{}", path.display());
        let store = SqliteStore::connect(&url, StoreOptions::default())
            .await
            .expect("open SQLite");
        store.migrate().await.expect("migrate SQLite");
        SqliteFixture { store, path }
    }
}

impl Drop for SqliteFixture {
    fn drop(&mut self) {
        for suffix in ["", "-wal", "-shm"] {
            let mut p = self.path.clone().into_os_string();
            p.push(suffix);
            let _ = std::fs::remove_file(p);
        }
    }
}

#[async_trait]
impl StoreFixture for SqliteFixture {
    fn store(&self) -> Arc<dyn Store> {
        Arc::new(self.store.clone())
    }

    async fn enqueue_commit(&self, msgs: Vec<NewMessage>) -> Result<Vec<Uuid>, EnqueueError> {
        let mut tx = self.store.pool().begin().await.expect("begin");
        let ids = self.store.enqueue_many(&mut tx, msgs).await?;
        self.store.commit(tx).await.expect("commit");
        Ok(ids)
    }

    async fn enqueue_rollback(&self, msgs: Vec<NewMessage>) -> Result<Vec<Uuid>, EnqueueError> {
        let mut tx = self.store.pool().begin().await.expect("begin");
        let r = self.store.enqueue_many(&mut tx, msgs).await;
        tx.rollback().await.expect("rollback");
        r
    }

    async fn insert_plain_sql(&self, topic: &str, payload: &[u8]) -> Uuid {
        let id = Uuid::now_v7();
        sqlx::query("INSERT INTO outbox (message_id, topic, payload) VALUES (?1, ?2, ?3)")
            .bind(id.to_string())
            .bind(topic)
            .bind(payload)
            .execute(self.store.pool())
            .await
            .expect("plain SQL insert");
        id
    }

    async fn leave_sending(&self, message_id: Uuid) {
        sqlx::query(
            "UPDATE outbox SET status = 1, attempts = attempts + 1, lease_owner = 'relay-0.1', \
             lease_token = 7, lease_expires_at = CAST(ROUND((julianday('now') - 2440587.5) * 86400000) AS INTEGER) + 3600000 \
             WHERE message_id = ?1",
        )
        .bind(message_id.to_string())
        .execute(self.store.pool())
        .await
        .expect("leave the row SENDING");
    }

    async fn rows(&self) -> Vec<RowState> {
        let rows = sqlx::query(
            "SELECT id, message_id, status, attempts, last_error, \
             available_at - CAST(ROUND((julianday('now') - 2440587.5) * 86400000) AS INTEGER), lease_token, sent_at IS NOT NULL, payload \
             FROM outbox ORDER BY id",
        )
        .fetch_all(self.store.pool())
        .await
        .expect("read rows");
        rows.into_iter()
            .map(|r| RowState {
                id: r.get(0),
                message_id: Uuid::parse_str(&r.get::<String, _>(1)).expect("uuid"),
                status: r.get::<i64, _>(2) as i16,
                attempts: r.get(3),
                last_error: r.get(4),
                due_in_ms: r.get(5),
                lease_token: r.get(6),
                sent: r.get(7),
                payload: r.get(8),
            })
            .collect()
    }

    async fn open_with_table(&self, table: &str) -> Result<(), outbox::StoreError> {
        SqliteStore::from_pool(self.store.pool().clone(), StoreOptions::table(table)).map(|_| ())
    }

    async fn cleanup(&self) {}
}

/// PostgreSQL with the outbox in its own schema (`<schema>.outbox`, `<schema>.outbox_inbox`).
pub struct PgFixture {
    /// The store.
    pub store: PgStore,
    /// The schema holding the tables.
    pub schema: String,
}

impl PgFixture {
    /// A fresh schema with migrated tables.
    ///
    /// # Panics
    /// When PostgreSQL does not answer (naming `OUTBOX_TEST_POSTGRES_URL`) or migration fails.
    pub async fn new() -> PgFixture {
        Self::with_pool(pg_pool(10).await).await
    }

    /// As [`PgFixture::new`] on an existing pool.
    ///
    /// # Panics
    /// When migration fails.
    pub async fn with_pool(pool: PgPool) -> PgFixture {
        let schema = unique("obx");
        let store = PgStore::from_pool(pool, StoreOptions::table(format!("{schema}.outbox")))
            .expect("valid table name");
        store.migrate().await.expect("migrate PostgreSQL");
        PgFixture { store, schema }
    }

    /// The outbox table, schema-qualified.
    pub fn table(&self) -> String {
        format!("{}.outbox", self.schema)
    }

    /// The inbox table created beside the outbox, schema-qualified.
    pub fn inbox_table(&self) -> String {
        format!("{}.outbox_inbox", self.schema)
    }

    /// Run one statement.
    ///
    /// # Panics
    /// On a database error.
    pub async fn exec(&self, sql: &str) {
        sqlx::raw_sql(AssertSqlSafe(sql.to_owned()))
            .execute(self.store.pool())
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
    }

    /// Count rows of `table` (schema-qualified by the caller) with an optional `WHERE` clause.
    ///
    /// # Panics
    /// On a database error.
    pub async fn count(&self, table_and_where: &str) -> i64 {
        sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT COUNT(*) FROM {table_and_where}"
        )))
        .fetch_one(self.store.pool())
        .await
        .unwrap_or_else(|e| panic!("count {table_and_where}: {e}"))
    }
}

#[async_trait]
impl StoreFixture for PgFixture {
    fn store(&self) -> Arc<dyn Store> {
        Arc::new(self.store.clone())
    }

    async fn enqueue_commit(&self, msgs: Vec<NewMessage>) -> Result<Vec<Uuid>, EnqueueError> {
        let mut tx = self.store.pool().begin().await.expect("begin");
        let ids = self.store.enqueue_many(&mut tx, msgs).await?;
        self.store.commit(tx).await.expect("commit");
        Ok(ids)
    }

    async fn enqueue_rollback(&self, msgs: Vec<NewMessage>) -> Result<Vec<Uuid>, EnqueueError> {
        let mut tx = self.store.pool().begin().await.expect("begin");
        let r = self.store.enqueue_many(&mut tx, msgs).await;
        tx.rollback().await.expect("rollback");
        r
    }

    async fn insert_plain_sql(&self, topic: &str, payload: &[u8]) -> Uuid {
        sqlx::query_scalar(AssertSqlSafe(format!(
            "INSERT INTO {} (topic, payload) VALUES ($1, $2) RETURNING message_id",
            self.table()
        )))
        .bind(topic)
        .bind(payload)
        .fetch_one(self.store.pool())
        .await
        .expect("plain SQL insert")
    }

    async fn leave_sending(&self, message_id: Uuid) {
        sqlx::query(AssertSqlSafe(format!(
            "UPDATE {} SET status = 1, attempts = attempts + 1, lease_owner = 'relay-0.1', \
             lease_token = 7, lease_expires_at = now() + interval '1 hour' WHERE message_id = $1",
            self.table()
        )))
        .bind(message_id)
        .execute(self.store.pool())
        .await
        .expect("leave the row SENDING");
    }

    async fn rows(&self) -> Vec<RowState> {
        let rows = sqlx::query(AssertSqlSafe(format!(
            "SELECT id, message_id, status, attempts, last_error, \
             (EXTRACT(EPOCH FROM available_at - now()) * 1000)::bigint, lease_token, sent_at IS NOT NULL, payload \
             FROM {} ORDER BY id",
            self.table()
        )))
        .fetch_all(self.store.pool())
        .await
        .expect("read rows");
        rows.into_iter()
            .map(|r| RowState {
                id: r.get(0),
                message_id: r.get(1),
                status: r.get(2),
                attempts: i64::from(r.get::<i32, _>(3)),
                last_error: r.get(4),
                due_in_ms: r.get(5),
                lease_token: r.get(6),
                sent: r.get(7),
                payload: r.get(8),
            })
            .collect()
    }

    async fn open_with_table(&self, table: &str) -> Result<(), outbox::StoreError> {
        PgStore::from_pool(self.store.pool().clone(), StoreOptions::table(table)).map(|_| ())
    }

    async fn cleanup(&self) {
        let s = &self.schema;
        self.exec(&format!(
            "DROP SCHEMA IF EXISTS {s} CASCADE; \
             DELETE FROM outbox_migrations WHERE table_name LIKE '{s}.%';"
        ))
        .await;
    }
}

/// What a test broker received: message id, headers and payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Received {
    /// The message id as carried by the broker's native field (`webhook-id`, `Nats-Msg-Id`).
    pub native_id: Option<String>,
    /// Every header, lower-cased names for HTTP.
    pub headers: BTreeMap<String, String>,
    /// The body.
    pub payload: Vec<u8>,
    /// The destination (URL path or subject).
    pub destination: String,
}

/// A transport under test with a view of what its broker received.
#[async_trait]
pub trait TransportFixture: Send + Sync {
    /// The transport.
    fn transport(&self) -> Arc<dyn Transport>;
    /// A destination that acknowledges.
    fn good_destination(&self) -> String;
    /// A destination the broker refuses permanently (no stream, 400).
    fn rejecting_destination(&self) -> String;
    /// Everything the broker stored or received at `good_destination`, in arrival order.
    async fn received(&self) -> Vec<Received>;
    /// Drop what the fixture created.
    async fn cleanup(&self);
}

/// A [`Message`] as a relay would claim it.
pub fn claimed_message(topic: &str, payload: impl Into<Vec<u8>>) -> Message {
    Message {
        id: 1,
        message_id: Uuid::now_v7(),
        topic: topic.into(),
        partition_key: None,
        headers: BTreeMap::new(),
        payload: payload.into(),
        attempts: 1,
        max_attempts: 5,
        redelivery: 0,
    }
}

/// Publish `msgs` through `t` in one batch, message `i` to `destination(i)`; one result per
/// message, in order.
pub async fn publish_to<'a>(
    t: &dyn Transport,
    msgs: &'a [Message],
    destination: impl Fn(usize) -> &'a str,
) -> Vec<Result<(), TransportError>> {
    let batch: Vec<Outgoing<'a>> = msgs
        .iter()
        .enumerate()
        .map(|(i, m)| Outgoing {
            message: m,
            destination: destination(i),
        })
        .collect();
    t.publish(&batch).await
}

/// One webhook delivery as received: headers, body, URL path.
pub type RawDelivery = (axum::http::HeaderMap, Vec<u8>, String);

/// An axum server that records webhook deliveries and answers by path:
/// `/ok` 200, `/unavailable` 503, `/bad` 400, anything else 404.
pub struct WebhookReceiver {
    /// Where it listens.
    pub addr: SocketAddr,
    received: Arc<Mutex<Vec<RawDelivery>>>,
    shutdown: tokio_util::sync::CancellationToken,
}

impl WebhookReceiver {
    /// Start on `127.0.0.1:0`.
    ///
    /// # Panics
    /// When it cannot bind.
    pub async fn start() -> WebhookReceiver {
        use axum::http::{StatusCode, Uri};
        let received: Arc<Mutex<Vec<RawDelivery>>> = Arc::default();
        let rec = received.clone();
        let app = axum::Router::new().fallback(
            move |uri: Uri, headers: axum::http::HeaderMap, body: axum::body::Bytes| {
                let rec = rec.clone();
                async move {
                    let path = uri.path().to_owned();
                    rec.lock()
                        .expect("poisoned")
                        .push((headers, body.to_vec(), path.clone()));
                    match path.as_str() {
                        "/ok" => (StatusCode::OK, "ok"),
                        "/unavailable" => (StatusCode::SERVICE_UNAVAILABLE, "try later"),
                        "/bad" => (StatusCode::BAD_REQUEST, "refused"),
                        _ => (StatusCode::NOT_FOUND, "no such endpoint"),
                    }
                }
            },
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind webhook receiver");
        let addr = listener.local_addr().expect("local addr");
        let shutdown = tokio_util::sync::CancellationToken::new();
        let s = shutdown.clone();
        tokio::spawn(async move {
            let _ = axum::serve(listener, app)
                .with_graceful_shutdown(async move { s.cancelled().await })
                .await;
        });
        WebhookReceiver {
            addr,
            received,
            shutdown,
        }
    }

    /// `http://addr{path}`.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// Raw deliveries: headers, body, path.
    pub fn raw(&self) -> Vec<RawDelivery> {
        self.received.lock().expect("poisoned").clone()
    }
}

impl Drop for WebhookReceiver {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

/// [`TransportFixture`] for [`outbox::WebhookTransport`] against a [`WebhookReceiver`].
pub struct WebhookFixture {
    /// The receiver.
    pub receiver: WebhookReceiver,
    /// The transport (signing with [`WebhookFixture::secret`]).
    pub transport: Arc<outbox::WebhookTransport>,
    /// The `whsec_` secret.
    pub secret: String,
}

impl WebhookFixture {
    /// Start a receiver and build a signing transport for it.
    ///
    /// # Panics
    /// When the receiver cannot bind.
    pub async fn new() -> WebhookFixture {
        use base64::Engine as _;
        let receiver = WebhookReceiver::start().await;
        let secret = format!(
            "whsec_{}",
            base64::engine::general_purpose::STANDARD.encode(rand::random::<[u8; 24]>())
        );
        let mut config = outbox::WebhookConfig::new(receiver.url("/ok"));
        config.secret = Some(secret.clone());
        config.timeout = Duration::from_secs(5);
        let transport = Arc::new(outbox::WebhookTransport::new(config).expect("webhook config"));
        WebhookFixture {
            receiver,
            transport,
            secret,
        }
    }
}

#[async_trait]
impl TransportFixture for WebhookFixture {
    fn transport(&self) -> Arc<dyn Transport> {
        self.transport.clone()
    }

    fn good_destination(&self) -> String {
        self.receiver.url("/ok")
    }

    fn rejecting_destination(&self) -> String {
        self.receiver.url("/bad")
    }

    async fn received(&self) -> Vec<Received> {
        self.receiver
            .raw()
            .into_iter()
            .filter(|(_, _, path)| path == "/ok")
            .map(|(h, body, path)| Received {
                native_id: h
                    .get("webhook-id")
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_owned),
                headers: h
                    .iter()
                    .filter_map(|(k, v)| Some((k.as_str().to_owned(), v.to_str().ok()?.to_owned())))
                    .collect(),
                payload: body,
                destination: path,
            })
            .collect()
    }

    async fn cleanup(&self) {}
}

/// A JetStream stream `<NAME>` capturing `<name>.>` for one test.
pub struct NatsFixture {
    /// The transport.
    pub transport: Arc<NatsTransport>,
    /// Stream name.
    pub stream: String,
    /// Subject prefix captured by the stream (`prefix.>`).
    pub prefix: String,
}

impl NatsFixture {
    /// Connect and create the stream.
    ///
    /// # Panics
    /// When NATS does not answer (naming `OUTBOX_TEST_NATS_URL`) or the stream cannot be created.
    pub async fn new() -> NatsFixture {
        let client = nats_client().await;
        Self::with_client(client).await
    }

    /// As [`NatsFixture::new`] with an existing client (for example through a [`FaultProxy`]).
    ///
    /// # Panics
    /// When the stream cannot be created.
    pub async fn with_client(client: async_nats::Client) -> NatsFixture {
        let prefix = unique("obx");
        let stream = prefix.to_ascii_uppercase();
        let mut config = NatsConfig::new(nats_url());
        config.ack_timeout = Duration::from_secs(2);
        config.stream = Some(StreamSetup {
            name: stream.clone(),
            subjects: vec![format!("{prefix}.>")],
            create: true,
        });
        let transport = NatsTransport::from_client(client, config)
            .await
            .unwrap_or_else(|e| panic!("NATS JetStream stream setup failed: {e}; is JetStream enabled (nats-server -js)?"));
        NatsFixture {
            transport: Arc::new(transport),
            stream,
            prefix,
        }
    }

    /// Messages stored in the stream.
    ///
    /// # Panics
    /// When the stream cannot be read.
    pub async fn stored(&self) -> u64 {
        let mut s = self
            .transport
            .jetstream()
            .get_stream(&self.stream)
            .await
            .expect("get stream");
        s.info().await.expect("stream info").state.messages
    }
}

#[async_trait]
impl TransportFixture for NatsFixture {
    fn transport(&self) -> Arc<dyn Transport> {
        self.transport.clone()
    }

    fn good_destination(&self) -> String {
        format!("{}.ok", self.prefix)
    }

    /// A subject with a space: refused before sending (a subject no stream captures is not a
    /// permanent refusal: it pauses the transport until a stream exists).
    fn rejecting_destination(&self) -> String {
        format!("{}.no stream", self.prefix)
    }

    async fn received(&self) -> Vec<Received> {
        use futures::StreamExt as _;
        let stream = self
            .transport
            .jetstream()
            .get_stream(&self.stream)
            .await
            .expect("get stream");
        let consumer = stream
            .create_consumer(async_nats::jetstream::consumer::pull::OrderedConfig {
                ..Default::default()
            })
            .await
            .expect("ordered consumer");
        let n = self.stored().await as usize;
        let mut out = Vec::with_capacity(n);
        if n == 0 {
            return out;
        }
        let mut msgs = consumer.messages().await.expect("messages");
        while out.len() < n {
            let m = within("stream messages", Duration::from_secs(5), msgs.next())
                .await
                .expect("stream ended")
                .expect("stream message");
            let headers: BTreeMap<String, String> = m
                .headers
                .as_ref()
                .map(|h| {
                    h.iter()
                        .filter_map(|(k, v)| Some((k.to_string(), v.first()?.to_string())))
                        .collect()
                })
                .unwrap_or_default();
            out.push(Received {
                native_id: headers.get("Nats-Msg-Id").cloned(),
                headers,
                payload: m.payload.to_vec(),
                destination: m.subject.to_string(),
            });
        }
        out
    }

    async fn cleanup(&self) {
        let _ = self.transport.jetstream().delete_stream(&self.stream).await;
    }
}

/// A transport that publishes through `inner` and, once the broker acknowledged, signals
/// [`AckThenHang::acked`] and never returns: the relay looks like it died between the broker's ack
/// and recording SENT. Only the first `hang_batches` batches hang; later ones pass through.
pub struct AckThenHang {
    inner: Arc<dyn Transport>,
    hang_batches: Mutex<usize>,
    /// Notified (permit stored) when a hung batch was acknowledged by the broker.
    pub acked: Notify,
}

impl AckThenHang {
    /// Wrap `inner`; the first `hang_batches` batches hang after their ack.
    pub fn new(inner: Arc<dyn Transport>, hang_batches: usize) -> Self {
        AckThenHang {
            inner,
            hang_batches: Mutex::new(hang_batches),
            acked: Notify::new(),
        }
    }
}

#[async_trait]
impl Transport for AckThenHang {
    fn name(&self) -> &str {
        "ack-then-hang"
    }

    async fn publish(&self, batch: &[Outgoing<'_>]) -> Vec<Result<(), TransportError>> {
        let results = self.inner.publish(batch).await;
        let hang = {
            let mut n = self.hang_batches.lock().expect("poisoned");
            if *n > 0 {
                *n -= 1;
                true
            } else {
                false
            }
        };
        if hang {
            assert!(results.iter().all(Result::is_ok), "inner publish failed");
            self.acked.notify_one();
            std::future::pending::<()>().await;
        }
        results
    }

    async fn probe(&self) -> Result<(), TransportError> {
        self.inner.probe().await
    }
}

/// Copy `from` to `to` chunk by chunk until end of stream or until `blocked` is set (checked
/// after every read); a chunk read while `discard` is set is dropped instead of written.
async fn pump(
    from: &mut (impl tokio::io::AsyncRead + Unpin),
    to: &mut (impl tokio::io::AsyncWrite + Unpin),
    blocked: &AtomicBool,
    discard: Option<&AtomicBool>,
    stalled: &AtomicBool,
) -> std::io::Result<()> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = from.read(&mut buf).await?;
        if n == 0 || blocked.load(Ordering::SeqCst) {
            return Ok(());
        }
        if !discard.is_some_and(|d| d.load(Ordering::SeqCst)) && !stalled.load(Ordering::SeqCst) {
            to.write_all(&buf[..n]).await?;
        }
    }
}

/// Per open connection of a [`FaultProxy`]: the local port of its upstream socket and its stall
/// flag.
type Stalls = Arc<std::sync::Mutex<Vec<(u16, Arc<AtomicBool>)>>>;

/// A TCP proxy that forwards to `upstream` and, while blocked, cuts every connection and refuses
/// new ones (accepts and closes them at once).
pub struct FaultProxy {
    /// Where it listens.
    pub addr: SocketAddr,
    blocked: Arc<AtomicBool>,
    replies_dropped: Arc<AtomicBool>,
    cut: Arc<tokio::sync::watch::Sender<u64>>,
    shutdown: tokio_util::sync::CancellationToken,
    /// Per open connection: the local port of its upstream socket and its stall flag.
    stalls: Stalls,
}

impl FaultProxy {
    /// Start on `127.0.0.1:0`, forwarding to `upstream` (`host:port`).
    ///
    /// # Panics
    /// When it cannot bind.
    pub async fn start(upstream: String) -> FaultProxy {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind proxy");
        let addr = listener.local_addr().expect("local addr");
        let blocked = Arc::new(AtomicBool::new(false));
        let replies_dropped = Arc::new(AtomicBool::new(false));
        let (cut, _) = tokio::sync::watch::channel(0u64);
        let cut = Arc::new(cut);
        let shutdown = tokio_util::sync::CancellationToken::new();
        let (b, c, s) = (blocked.clone(), cut.clone(), shutdown.clone());
        let dropped = replies_dropped.clone();
        let stalls: Stalls = Arc::default();
        let all_stalls = stalls.clone();
        tokio::spawn(async move {
            loop {
                let (mut client, _) = tokio::select! {
                    _ = s.cancelled() => return,
                    a = listener.accept() => match a { Ok(a) => a, Err(_) => continue },
                };
                if b.load(Ordering::SeqCst) {
                    drop(client);
                    continue;
                }
                let mut cut_rx = c.subscribe();
                let upstream = upstream.clone();
                let s = s.clone();
                let dropped = dropped.clone();
                let blocked = b.clone();
                let all_stalls = all_stalls.clone();
                tokio::spawn(async move {
                    let Ok(server) = tokio::net::TcpStream::connect(&upstream).await else {
                        return;
                    };
                    let stalled = Arc::new(AtomicBool::new(false));
                    if let Ok(local) = server.local_addr() {
                        let mut all = all_stalls.lock().expect("stalls");
                        all.retain(|(_, s)| Arc::strong_count(s) > 1);
                        all.push((local.port(), stalled.clone()));
                    }
                    let (mut client_rx, mut client_tx) = client.split();
                    let (mut server_rx, mut server_tx) = server.into_split();
                    // Both directions check the flag on every chunk, so that nothing passes
                    // once `set_blocked(true)` has returned, even before this task has seen
                    // the cut (a test that publishes right after blocking must not race it).
                    let up = pump(&mut client_rx, &mut server_tx, &blocked, None, &stalled);
                    // Server to client, discarding while replies are dropped.
                    let down = pump(
                        &mut server_rx,
                        &mut client_tx,
                        &blocked,
                        Some(&dropped),
                        &stalled,
                    );
                    tokio::select! {
                        _ = s.cancelled() => {}
                        _ = cut_rx.changed() => {}
                        _ = up => {}
                        _ = down => {}
                    }
                });
            }
        });
        FaultProxy {
            addr,
            blocked,
            replies_dropped,
            cut,
            shutdown,
            stalls,
        }
    }

    /// Make one open connection half-open: the one whose socket towards the upstream has local
    /// port `upstream_port` (what the server sees as the client's port, e.g. PostgreSQL's
    /// `pg_stat_activity.client_port`). From now on nothing passes in either direction and
    /// nothing is closed, as when a NAT or firewall forgets a connection; other connections are
    /// unaffected. Returns whether such a connection was open.
    pub fn stall_connection(&self, upstream_port: u16) -> bool {
        let all = self.stalls.lock().expect("stalls");
        let mut found = false;
        for (port, stalled) in all.iter() {
            if *port == upstream_port {
                stalled.store(true, Ordering::SeqCst);
                found = true;
            }
        }
        found
    }

    /// While set, forward client → server but discard everything the server sends back (the
    /// client's requests arrive, their answers are lost, as behind a one-way network fault);
    /// [`FaultProxy::set_blocked`] then cuts the connections.
    pub fn set_replies_dropped(&self, dropped: bool) {
        self.replies_dropped.store(dropped, Ordering::SeqCst);
    }

    /// Block (cut every open connection, refuse new ones) or unblock.
    pub fn set_blocked(&self, blocked: bool) {
        self.blocked.store(blocked, Ordering::SeqCst);
        if blocked {
            self.cut.send_modify(|n| *n += 1);
        }
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

/// The `host:port` of a `nats://host:port` URL.
pub fn host_port(url: &str) -> String {
    url.split("://")
        .nth(1)
        .unwrap_or(url)
        .trim_end_matches('/')
        .to_owned()
}

/// The message id header of a received message (`outbox-message-id`).
pub fn header_message_id(r: &Received) -> Option<Uuid> {
    r.headers
        .get(HEADER_MESSAGE_ID)
        .and_then(|v| Uuid::parse_str(v).ok())
}

/// Controls a [`RecordingHook`]: make it fail, slow it down, count its runs.
#[derive(Debug, Default)]
pub struct HookControl {
    /// When set, the hook writes its row and then fails (so the write must roll back).
    pub fail: AtomicBool,
    /// Milliseconds the hook waits after writing (holding the producer transaction open).
    pub delay_ms: std::sync::atomic::AtomicU64,
    /// Runs, including failed ones.
    pub calls: std::sync::atomic::AtomicU64,
}

/// A rejection hook that records each compensation as a row `(message_id, reason)` of its table
/// (no unique key, so a second run shows as a second row), controlled by a [`HookControl`].
pub struct RecordingHook {
    /// The compensations table.
    pub table: String,
    /// The control.
    pub ctl: Arc<HookControl>,
}

impl RecordingHook {
    async fn after_write(&self) -> Result<(), outbox::BoxError> {
        let delay = self.ctl.delay_ms.load(Ordering::SeqCst);
        if delay > 0 {
            tokio::time::sleep(Duration::from_millis(delay)).await;
        }
        if self.ctl.fail.load(Ordering::SeqCst) {
            return Err("compensation refused (test)".into());
        }
        Ok(())
    }
}

#[async_trait]
impl outbox::RejectionHook<sqlx::Postgres> for RecordingHook {
    async fn on_rejected(
        &self,
        conn: &mut sqlx::PgConnection,
        rejected: &outbox::RejectedMessage,
    ) -> Result<(), outbox::BoxError> {
        self.ctl.calls.fetch_add(1, Ordering::SeqCst);
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {} (message_id, reason) VALUES ($1, $2)",
            self.table
        )))
        .bind(rejected.message_id.to_string())
        .bind(&rejected.reason)
        .execute(&mut *conn)
        .await?;
        self.after_write().await
    }
}

#[async_trait]
impl outbox::RejectionHook<sqlx::Sqlite> for RecordingHook {
    async fn on_rejected(
        &self,
        conn: &mut sqlx::SqliteConnection,
        rejected: &outbox::RejectedMessage,
    ) -> Result<(), outbox::BoxError> {
        self.ctl.calls.fetch_add(1, Ordering::SeqCst);
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {} (message_id, reason) VALUES (?1, ?2)",
            self.table
        )))
        .bind(rejected.message_id.to_string())
        .bind(&rejected.reason)
        .execute(&mut *conn)
        .await?;
        self.after_write().await
    }
}

/// Confirmation columns of one outbox row.
#[derive(Debug, Clone, PartialEq)]
pub struct ConfirmState {
    /// `confirm_deadline - now()` in milliseconds, when a deadline is set.
    pub deadline_in_ms: Option<i64>,
    /// Check-backs so far.
    pub check_backs: i64,
    /// Whether `confirmed_at` is set.
    pub confirmed: bool,
}

/// The dialect-specific operations the confirmation part of the store suite needs.
#[async_trait]
pub trait ConfirmFixture: StoreFixture {
    /// The store with a [`RecordingHook`] controlled by `ctl` (its table is created if missing).
    async fn store_with_hook(&self, ctl: Arc<HookControl>) -> Arc<dyn Store>;
    /// Compensation rows written for `message_id`.
    async fn compensations(&self, message_id: Uuid) -> i64;
    /// The confirmation columns of `message_id`.
    async fn confirm_state(&self, message_id: Uuid) -> ConfirmState;
    /// Move every timestamp of `message_id` except the confirmation deadline `by` into the past.
    async fn backdate(&self, message_id: Uuid, by: Duration);
}

#[async_trait]
impl ConfirmFixture for SqliteFixture {
    async fn store_with_hook(&self, ctl: Arc<HookControl>) -> Arc<dyn Store> {
        sqlx::query(
            "CREATE TABLE IF NOT EXISTS compensations (message_id TEXT NOT NULL, reason TEXT)",
        )
        .execute(self.store.pool())
        .await
        .expect("create compensations");
        let hook = RecordingHook {
            table: "compensations".into(),
            ctl,
        };
        Arc::new(self.store.clone().with_rejection_hook(Arc::new(hook)))
    }

    async fn compensations(&self, message_id: Uuid) -> i64 {
        sqlx::query_scalar("SELECT COUNT(*) FROM compensations WHERE message_id = ?1")
            .bind(message_id.to_string())
            .fetch_one(self.store.pool())
            .await
            .unwrap_or(0)
    }

    async fn confirm_state(&self, message_id: Uuid) -> ConfirmState {
        let (deadline_in_ms, check_backs, confirmed): (Option<i64>, i64, bool) = sqlx::query_as(
            "SELECT confirm_deadline - CAST(ROUND((julianday('now') - 2440587.5) * 86400000) AS INTEGER), \
             check_backs, confirmed_at IS NOT NULL FROM outbox WHERE message_id = ?1",
        )
        .bind(message_id.to_string())
        .fetch_one(self.store.pool())
        .await
        .expect("confirm state");
        ConfirmState {
            deadline_in_ms,
            check_backs,
            confirmed,
        }
    }

    async fn backdate(&self, message_id: Uuid, by: Duration) {
        let ms = i64::try_from(by.as_millis()).expect("duration");
        sqlx::query(
            "UPDATE outbox SET created_at = created_at - ?1, updated_at = updated_at - ?1, \
             sent_at = sent_at - ?1, confirmed_at = confirmed_at - ?1 WHERE message_id = ?2",
        )
        .bind(ms)
        .bind(message_id.to_string())
        .execute(self.store.pool())
        .await
        .expect("backdate");
    }
}

#[async_trait]
impl ConfirmFixture for PgFixture {
    async fn store_with_hook(&self, ctl: Arc<HookControl>) -> Arc<dyn Store> {
        let table = format!("{}.compensations", self.schema);
        self.exec(&format!(
            "CREATE TABLE IF NOT EXISTS {table} (message_id text NOT NULL, reason text)"
        ))
        .await;
        let hook = RecordingHook { table, ctl };
        Arc::new(self.store.clone().with_rejection_hook(Arc::new(hook)))
    }

    async fn compensations(&self, message_id: Uuid) -> i64 {
        sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT COUNT(*) FROM {}.compensations WHERE message_id = $1",
            self.schema
        )))
        .bind(message_id.to_string())
        .fetch_one(self.store.pool())
        .await
        .unwrap_or(0)
    }

    async fn confirm_state(&self, message_id: Uuid) -> ConfirmState {
        let (deadline_in_ms, check_backs, confirmed): (Option<i64>, i32, bool) =
            sqlx::query_as(AssertSqlSafe(format!(
                "SELECT (EXTRACT(EPOCH FROM confirm_deadline - now()) * 1000)::bigint, check_backs, \
                 confirmed_at IS NOT NULL FROM {} WHERE message_id = $1",
                self.table()
            )))
            .bind(message_id)
            .fetch_one(self.store.pool())
            .await
            .expect("confirm state");
        ConfirmState {
            deadline_in_ms,
            check_backs: i64::from(check_backs),
            confirmed,
        }
    }

    async fn backdate(&self, message_id: Uuid, by: Duration) {
        sqlx::query(AssertSqlSafe(format!(
            "UPDATE {} SET created_at = created_at - make_interval(secs => $1), \
             updated_at = updated_at - make_interval(secs => $1), \
             sent_at = sent_at - make_interval(secs => $1), \
             confirmed_at = confirmed_at - make_interval(secs => $1) WHERE message_id = $2",
            self.table()
        )))
        .bind(by.as_secs_f64())
        .bind(message_id)
        .execute(self.store.pool())
        .await
        .expect("backdate");
    }
}

/// Default MySQL/MariaDB URL when `OUTBOX_TEST_MYSQL_URL` is unset.
pub const DEFAULT_MYSQL_URL: &str = "mysql://root@127.0.0.1:3306/test";

/// `OUTBOX_TEST_MYSQL_URL`, or [`DEFAULT_MYSQL_URL`].
pub fn mysql_url() -> String {
    std::env::var("OUTBOX_TEST_MYSQL_URL").unwrap_or_else(|_| DEFAULT_MYSQL_URL.into())
}

/// Connect a pool of up to `max` connections to the test MySQL/MariaDB.
///
/// # Panics
/// When the server does not answer, naming the URL and `OUTBOX_TEST_MYSQL_URL`.
pub async fn mysql_pool(max: u32) -> MySqlPool {
    let url = mysql_url();
    let probe = tokio::time::timeout(
        Duration::from_secs(5),
        <sqlx::MySqlConnection as sqlx::Connection>::connect(&url),
    )
    .await;
    match probe {
        Ok(Ok(conn)) => drop(conn),
        Ok(Err(e)) => panic!(
            "MySQL/MariaDB is not reachable at {url} ({e}); start it or set OUTBOX_TEST_MYSQL_URL"
        ),
        Err(_) => panic!(
            "MySQL/MariaDB at {url} did not answer within 5 s; start it or set OUTBOX_TEST_MYSQL_URL"
        ),
    }
    sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(max)
        .acquire_timeout(Duration::from_secs(20))
        .connect(&url)
        .await
        .unwrap_or_else(|e| {
            panic!(
                "MySQL/MariaDB is not reachable at {url} ({e}); start it or set OUTBOX_TEST_MYSQL_URL"
            )
        })
}

/// MySQL/MariaDB with the outbox in tables of its own (`<prefix>`, `<prefix>_inbox`).
pub struct MySqlFixture {
    /// The store.
    pub store: MySqlStore,
    /// The outbox table.
    pub table: String,
}

impl MySqlFixture {
    /// Fresh tables, migrated.
    ///
    /// # Panics
    /// When MySQL/MariaDB does not answer (naming `OUTBOX_TEST_MYSQL_URL`) or migration fails.
    pub async fn new() -> MySqlFixture {
        Self::with_pool(mysql_pool(10).await).await
    }

    /// As [`MySqlFixture::new`] on an existing pool.
    ///
    /// # Panics
    /// When migration fails.
    pub async fn with_pool(pool: MySqlPool) -> MySqlFixture {
        let table = unique("obx");
        let store =
            MySqlStore::from_pool(pool, StoreOptions::table(&table)).expect("valid table name");
        store.migrate().await.expect("migrate MySQL");
        MySqlFixture { store, table }
    }

    /// The inbox table created beside the outbox.
    pub fn inbox_table(&self) -> String {
        format!("{}_inbox", self.table)
    }

    /// Run one statement (or several, `;`-separated).
    ///
    /// # Panics
    /// On a database error.
    pub async fn exec(&self, sql: &str) {
        sqlx::raw_sql(AssertSqlSafe(sql.to_owned()))
            .execute(self.store.pool())
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
    }

    /// Count rows of `table` with an optional `WHERE` clause.
    ///
    /// # Panics
    /// On a database error.
    pub async fn count(&self, table_and_where: &str) -> i64 {
        sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT COUNT(*) FROM {table_and_where}"
        )))
        .fetch_one(self.store.pool())
        .await
        .unwrap_or_else(|e| panic!("count {table_and_where}: {e}"))
    }
}

#[async_trait]
impl StoreFixture for MySqlFixture {
    fn store(&self) -> Arc<dyn Store> {
        Arc::new(self.store.clone())
    }

    async fn enqueue_commit(&self, msgs: Vec<NewMessage>) -> Result<Vec<Uuid>, EnqueueError> {
        let mut tx = self.store.pool().begin().await.expect("begin");
        let ids = self.store.enqueue_many(&mut tx, msgs).await?;
        self.store.commit(tx).await.expect("commit");
        Ok(ids)
    }

    async fn enqueue_rollback(&self, msgs: Vec<NewMessage>) -> Result<Vec<Uuid>, EnqueueError> {
        let mut tx = self.store.pool().begin().await.expect("begin");
        let r = self.store.enqueue_many(&mut tx, msgs).await;
        tx.rollback().await.expect("rollback");
        r
    }

    async fn insert_plain_sql(&self, topic: &str, payload: &[u8]) -> Uuid {
        let id = Uuid::now_v7();
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {} (message_id, topic, payload) VALUES (?, ?, ?)",
            self.table
        )))
        .bind(id.to_string())
        .bind(topic)
        .bind(payload)
        .execute(self.store.pool())
        .await
        .expect("plain SQL insert");
        id
    }

    async fn leave_sending(&self, message_id: Uuid) {
        sqlx::query(AssertSqlSafe(format!(
            "UPDATE {} SET status = 1, attempts = attempts + 1, lease_owner = 'relay-0.1', \
             lease_token = 7, lease_expires_at = UTC_TIMESTAMP(6) + INTERVAL 1 HOUR WHERE message_id = ?",
            self.table
        )))
        .bind(message_id.to_string())
        .execute(self.store.pool())
        .await
        .expect("leave the row SENDING");
    }

    async fn rows(&self) -> Vec<RowState> {
        let rows = sqlx::query(AssertSqlSafe(format!(
            "SELECT id, message_id, status, attempts, last_error, \
             CAST(TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), available_at) DIV 1000 AS SIGNED), \
             lease_token, CASE WHEN sent_at IS NULL THEN 0 ELSE 1 END, payload \
             FROM {} ORDER BY id",
            self.table
        )))
        .fetch_all(self.store.pool())
        .await
        .expect("read rows");
        rows.into_iter()
            .map(|r| RowState {
                id: r.get(0),
                message_id: Uuid::parse_str(&r.get::<String, _>(1)).expect("uuid"),
                status: r.get::<i64, _>(2) as i16,
                attempts: r.get(3),
                last_error: r.get(4),
                due_in_ms: r.get(5),
                lease_token: r.get(6),
                sent: r.get::<i64, _>(7) != 0,
                payload: r.get(8),
            })
            .collect()
    }

    async fn open_with_table(&self, table: &str) -> Result<(), outbox::StoreError> {
        MySqlStore::from_pool(self.store.pool().clone(), StoreOptions::table(table)).map(|_| ())
    }

    async fn cleanup(&self) {
        let t = &self.table;
        self.exec(&format!(
            "DROP TABLE IF EXISTS {t}, {t}_inbox, {t}_inbox_dlq, {t}_compensations, {t}_buckets, {t}_relays; \
             DELETE FROM outbox_migrations WHERE table_name IN ('{t}', '{t}_inbox');"
        ))
        .await;
    }
}

#[async_trait]
impl outbox::RejectionHook<sqlx::MySql> for RecordingHook {
    async fn on_rejected(
        &self,
        conn: &mut sqlx::MySqlConnection,
        rejected: &outbox::RejectedMessage,
    ) -> Result<(), outbox::BoxError> {
        self.ctl.calls.fetch_add(1, Ordering::SeqCst);
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {} (message_id, reason) VALUES (?, ?)",
            self.table
        )))
        .bind(rejected.message_id.to_string())
        .bind(&rejected.reason)
        .execute(&mut *conn)
        .await?;
        self.after_write().await
    }
}

#[async_trait]
impl ConfirmFixture for MySqlFixture {
    async fn store_with_hook(&self, ctl: Arc<HookControl>) -> Arc<dyn Store> {
        let table = format!("{}_compensations", self.table);
        self.exec(&format!(
            "CREATE TABLE IF NOT EXISTS {table} (message_id CHAR(36) NOT NULL, reason TEXT) \
             ENGINE=InnoDB DEFAULT CHARSET=utf8mb4"
        ))
        .await;
        let hook = RecordingHook { table, ctl };
        Arc::new(self.store.clone().with_rejection_hook(Arc::new(hook)))
    }

    async fn compensations(&self, message_id: Uuid) -> i64 {
        sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT COUNT(*) FROM {}_compensations WHERE message_id = ?",
            self.table
        )))
        .bind(message_id.to_string())
        .fetch_one(self.store.pool())
        .await
        .unwrap_or(0)
    }

    async fn confirm_state(&self, message_id: Uuid) -> ConfirmState {
        let (deadline_in_ms, check_backs, confirmed): (Option<i64>, i64, i64) =
            sqlx::query_as(AssertSqlSafe(format!(
                "SELECT CAST(TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), confirm_deadline) DIV 1000 AS SIGNED), \
                 check_backs, CASE WHEN confirmed_at IS NULL THEN 0 ELSE 1 END FROM {} WHERE message_id = ?",
                self.table
            )))
            .bind(message_id.to_string())
            .fetch_one(self.store.pool())
            .await
            .expect("confirm state");
        ConfirmState {
            deadline_in_ms,
            check_backs,
            confirmed: confirmed != 0,
        }
    }

    async fn backdate(&self, message_id: Uuid, by: Duration) {
        let us = i64::try_from(by.as_micros()).expect("duration");
        sqlx::query(AssertSqlSafe(format!(
            "UPDATE {} SET created_at = created_at - INTERVAL ? MICROSECOND, \
             updated_at = updated_at - INTERVAL ? MICROSECOND, \
             sent_at = sent_at - INTERVAL ? MICROSECOND, \
             confirmed_at = confirmed_at - INTERVAL ? MICROSECOND WHERE message_id = ?",
            self.table
        )))
        .bind(us)
        .bind(us)
        .bind(us)
        .bind(us)
        .bind(message_id.to_string())
        .execute(self.store.pool())
        .await
        .expect("backdate");
    }
}
