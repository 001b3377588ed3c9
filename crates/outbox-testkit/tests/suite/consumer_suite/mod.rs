//! The consumer conformance suite: the same properties, run against every broker's production
//! consumer runner (`outbox::consumer::<broker>::run`, the generic runner over that broker's
//! `Source`) on the real broker, as the store suite runs on every database.
//!
//! Properties:
//! - `applies_once_and_acks_after_commit`: every message is applied once; after a restart nothing
//!   acknowledged comes back;
//! - `redelivers_after_a_transient_error`: a handler failing twice sees the message a third time,
//!   with a delivery count of 3, and applies it once;
//! - `dead_letters_at_max_deliveries`: a message that keeps failing is in the consumer's
//!   dead-letter table after `max_deliveries` deliveries, acknowledged (not delivered again after
//!   a restart);
//! - `confirms_the_verdict`: applied and rejected messages are confirmed to their reply
//!   destination with their verdict;
//! - `keeps_per_key_order`: with 4 lanes, each key's messages are applied in publication order;
//! - `survives_a_crash_between_commit_and_ack`: the consumer dies (its task aborted and its
//!   connections cut) after the inbox commit and before the ack; the broker delivers the message
//!   again, the inbox recognises it, the effect stays single and the verdict is confirmed again;
//! - `survives_crashes_in_an_inbox_batch`: with `inbox_batch` 16, the consumer dies inside a
//!   batch's transaction (its handler hangs on the fifth message; what ran with it in that
//!   transaction leaves nothing), then again after a commit and before its acks; after the
//!   second restart every message is applied once, what was committed comes back as duplicates
//!   and each message's verdict is confirmed;
//! - `contains_a_panicking_handler`: a handler that panics on one message is contained: that
//!   message is dead-lettered at `max_deliveries` with the panic as its error, the runner goes on,
//!   and the messages behind it (its own key's included) are applied;
//! - `rejects_malformed_input`: a message without outbox headers is counted and taken out of the
//!   way; the messages behind it are applied.
//!
//! The consumer's connections go through a [`FaultProxy`], so a "crash" cuts them as a dying
//! process would.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use outbox::confirm::HEADER_REPLY_TO;
use outbox::consumer::ConsumerMetrics;
use outbox::error::TransportError;
use outbox::{
    ConfigError, Confirmation, ConfirmationSender, HandlerError, InboundMessage, Inbox, Message,
    Transport, Verdict,
};
use outbox_testkit::{FaultProxy, SqliteFixture, claimed_message, publish_to, wait_until, within};
use sqlx::SqliteConnection;
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::confirm::fast_retry;

type Runner = JoinHandle<Result<(), ConfigError>>;

/// What one broker contributes to the suite.
#[async_trait]
trait Broker: Send + Sync + Sized + 'static {
    /// Fresh broker resources (stream, queue, stream key) and a fault proxy for the consumer.
    async fn new() -> Self;
    /// The transport the relay would publish with, and the destination the runner consumes.
    fn transport(&self) -> Arc<dyn Transport>;
    fn destination(&self) -> String;
    /// Put a message without outbox headers where the runner consumes.
    async fn publish_garbage(&self);
    /// Start the broker's production runner.
    fn spawn(&self, c: Settings, inbox: Inbox<sqlx::Sqlite>, handler: Arc<Script>) -> Runner;
    /// The proxy in front of the broker for the consumer's connections, where the consumer's
    /// connections can go through one (a Kafka client connects to the brokers the cluster
    /// advertises, not to the proxy).
    fn proxy(&self) -> Option<&FaultProxy> {
        None
    }
}

/// The settings every runner takes.
struct Settings {
    max_deliveries: u32,
    concurrency: usize,
    inbox_batch: usize,
    confirmations: Option<Arc<dyn ConfirmationSender>>,
    metrics: Arc<ConsumerMetrics>,
    cancel: CancellationToken,
}

impl Settings {
    fn new() -> Settings {
        Settings {
            max_deliveries: 5,
            concurrency: 1,
            inbox_batch: 1,
            confirmations: None,
            metrics: Arc::default(),
            cancel: CancellationToken::new(),
        }
    }
}

/// A handler recording each application (message id, partition key, payload, delivery count) in
/// the consumer's transaction; scripted to fail transiently a number of times, or to reject.
#[derive(Default)]
struct Script {
    fail_times: Mutex<HashMap<Uuid, u32>>,
    reject: Mutex<Vec<Uuid>>,
    panic: Mutex<Vec<Uuid>>,
    seen: Mutex<HashMap<Uuid, Vec<u32>>>,
    /// Hang (for ever) in the handler of this message, once, after telling `hung`: the moment
    /// inside an inbox transaction, before its commit.
    hang: Mutex<Option<Uuid>>,
    hung: Notify,
}

impl Script {
    fn deliveries(&self, id: Uuid) -> Vec<u32> {
        self.seen
            .lock()
            .unwrap()
            .get(&id)
            .cloned()
            .unwrap_or_default()
    }
}

#[async_trait]
impl outbox::Handler<sqlx::Sqlite> for Script {
    async fn handle(
        &self,
        conn: &mut SqliteConnection,
        msg: &InboundMessage,
    ) -> Result<(), HandlerError> {
        self.seen
            .lock()
            .unwrap()
            .entry(msg.message_id)
            .or_default()
            .push(msg.delivery_count);
        let hang = {
            let mut hang = self.hang.lock().unwrap();
            *hang == Some(msg.message_id) && hang.take().is_some()
        };
        if hang {
            self.hung.notify_one();
            std::future::pending::<()>().await;
        }
        if self.panic.lock().unwrap().contains(&msg.message_id) {
            panic!("scripted panic in the handler");
        }
        if self.reject.lock().unwrap().contains(&msg.message_id) {
            return Err(HandlerError::reject("out of stock"));
        }
        if let Some(n) = self.fail_times.lock().unwrap().get_mut(&msg.message_id)
            && *n > 0
        {
            *n -= 1;
            return Err(HandlerError::transient("scripted failure"));
        }
        sqlx::query("INSERT INTO effects (message_id, key, payload) VALUES (?1, ?2, ?3)")
            .bind(msg.message_id.to_string())
            .bind(msg.partition_key.clone())
            .bind(&msg.payload)
            .execute(&mut *conn)
            .await
            .map_err(HandlerError::transient)?;
        Ok(())
    }
}

/// Records confirmations; optionally hangs on the first one after telling the test (the moment
/// between the inbox commit and the ack).
#[derive(Default)]
struct Recorder {
    sent: Mutex<Vec<(String, Confirmation)>>,
    hang_first: AtomicBool,
    reached: Notify,
}

#[async_trait]
impl ConfirmationSender for Recorder {
    async fn send(&self, reply_to: &str, c: &Confirmation) -> Result<(), TransportError> {
        if self.hang_first.swap(false, Ordering::SeqCst) {
            self.reached.notify_one();
            std::future::pending::<()>().await;
        }
        self.sent
            .lock()
            .unwrap()
            .push((reply_to.to_owned(), c.clone()));
        Ok(())
    }
}

impl Recorder {
    fn verdicts(&self, id: Uuid) -> Vec<Verdict> {
        self.sent
            .lock()
            .unwrap()
            .iter()
            .filter(|(_, c)| c.message_id == id)
            .map(|(_, c)| c.verdict.clone())
            .collect()
    }
}

/// The consumer's database: an inbox and an `effects` table.
struct Consumer {
    db: SqliteFixture,
    inbox: Inbox<sqlx::Sqlite>,
}

impl Consumer {
    async fn new() -> Consumer {
        let db = SqliteFixture::new().await;
        sqlx::query("CREATE TABLE effects (n INTEGER PRIMARY KEY AUTOINCREMENT, message_id TEXT NOT NULL, key TEXT, payload BLOB)")
            .execute(db.store.pool())
            .await
            .unwrap();
        let inbox =
            Inbox::<sqlx::Sqlite>::new(db.store.pool().clone(), "consumer_inbox", "conformance")
                .unwrap();
        inbox.migrate().await.unwrap();
        Consumer { db, inbox }
    }

    /// Effects in the order applied: (message id, key, payload).
    async fn effects(&self) -> Vec<(String, Option<String>, Vec<u8>)> {
        sqlx::query_as("SELECT message_id, key, payload FROM effects ORDER BY n")
            .fetch_all(self.db.store.pool())
            .await
            .unwrap()
    }

    async fn effects_of(&self, id: Uuid) -> usize {
        let id = id.to_string();
        self.effects().await.iter().filter(|e| e.0 == id).count()
    }
}

fn message(key: Option<&str>, payload: &str) -> Message {
    let mut m = claimed_message("orders", payload.as_bytes().to_vec());
    m.partition_key = key.map(str::to_owned);
    m
}

/// `message` with a reply destination.
fn replying(key: Option<&str>, payload: &str) -> Message {
    let mut m = message(key, payload);
    m.headers.insert(HEADER_REPLY_TO.into(), "replies".into());
    m
}

async fn stop(s: &Settings, runner: Runner) {
    s.cancel.cancel();
    within("the runner to stop", Duration::from_secs(15), runner)
        .await
        .expect("runner task")
        .expect("runner result");
}

const WAIT: Duration = Duration::from_secs(30);

/// One property's broker, consumer database and scripted handler.
struct Rig<B> {
    b: B,
    c: Consumer,
    script: Arc<Script>,
}

impl<B: Broker> Rig<B> {
    async fn new() -> Rig<B> {
        Rig {
            b: B::new().await,
            c: Consumer::new().await,
            script: Arc::default(),
        }
    }

    async fn publish(&self, msgs: &[Message]) {
        let dest = self.b.destination();
        let results = publish_to(self.b.transport().as_ref(), msgs, |_| dest.as_str()).await;
        for r in results {
            r.expect("publish to the broker");
        }
    }

    /// Start the broker's runner with `s` (sharing its metrics and cancel token).
    fn spawn(&self, s: &Settings) -> Runner {
        self.b.spawn(
            s.clone_settings(),
            self.c.inbox.clone(),
            self.script.clone(),
        )
    }

    /// Run the runner with `s` until `cond` holds, then stop it.
    async fn run_until<F, Fut>(&self, s: &Settings, what: &str, timeout: Duration, cond: F)
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = bool>,
    {
        let runner = self.spawn(s);
        wait_until(what, timeout, cond).await;
        stop(s, runner).await;
    }

    /// A restart: publish a marker, run fresh settings until the marker is applied, and return
    /// them (their metrics show what else came back).
    async fn restart_until_a_marker(&self) -> Settings {
        let s = Settings::new();
        let marker = message(None, "marker");
        self.publish(std::slice::from_ref(&marker)).await;
        self.run_until(&s, "the marker", WAIT, || async {
            self.c.effects_of(marker.message_id).await == 1
        })
        .await;
        s
    }

    /// The dead letters: `want` of them, each with `deliveries` deliveries.
    async fn dead_letters(&self, want: &[&Message], deliveries: u32) -> Vec<outbox::DeadLetter> {
        let dead = self.c.inbox.dead_letters(10).await.unwrap();
        assert_eq!(dead.len(), want.len());
        for (d, m) in dead.iter().zip(want) {
            assert_eq!(d.message.message_id, m.message_id);
            assert_eq!(d.deliveries, deliveries);
        }
        dead
    }
}

impl Settings {
    /// Fresh settings sending confirmations to `recorder`.
    fn confirming_to(recorder: &Arc<Recorder>) -> Settings {
        let mut s = Settings::new();
        s.confirmations = Some(recorder.clone() as Arc<dyn ConfirmationSender>);
        s
    }

    /// The runner settings of a broker's config: these, fast retries, no inbox retention.
    fn runner(&self) -> outbox::consumer::RunnerSettings {
        outbox::consumer::RunnerSettings {
            retry: fast_retry(),
            max_deliveries: self.max_deliveries,
            concurrency: self.concurrency,
            inbox_batch: self.inbox_batch,
            confirmations: self.confirmations.clone(),
            dedup_window: None,
            ..Default::default()
        }
    }

    /// The same settings sharing the metrics, cancel token and confirmations.
    fn clone_settings(&self) -> Settings {
        Settings {
            max_deliveries: self.max_deliveries,
            concurrency: self.concurrency,
            inbox_batch: self.inbox_batch,
            confirmations: self.confirmations.clone(),
            metrics: self.metrics.clone(),
            cancel: self.cancel.clone(),
        }
    }
}

/// One test per property named, for `$broker`: `<name>` runs `super::<name>::<$broker>()`.
macro_rules! property_tests {
    ($broker:ty: $($property:ident),+ $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $property() {
                crate::init_tracing();
                super::$property::<$broker>().await;
            }
        )+
    };
}

/// One test per property for `$broker`; `without crash` leaves the crash properties out.
macro_rules! conformance {
    (@module $module:ident, $broker:ty $(, $extra:ident)*) => {
        mod $module {
            use super::*;

            property_tests!($broker:
                applies_once_and_acks_after_commit,
                redelivers_after_a_transient_error,
                dead_letters_at_max_deliveries,
                confirms_the_verdict,
                keeps_per_key_order,
                contains_a_panicking_handler,
                applies_in_batches_around_failures,
                rejects_malformed_input,
                $($extra,)*
            );
        }
    };
    ($module:ident, $broker:ty) => {
        conformance!(@module $module, $broker, survives_a_crash_between_commit_and_ack,
            survives_crashes_in_an_inbox_batch);
    };
    ($module:ident, $broker:ty, without crash) => {
        conformance!(@module $module, $broker);
    };
}

/// The broker's production runner `$run(config, inbox, handler, metrics, cancel)` spawned with
/// `$config` (a `mut` binding) taking the settings `$c`'s runner settings.
macro_rules! spawn_runner {
    ($run:path, $config:ident, $c:ident, $inbox:ident, $handler:ident) => {{
        $config.runner = $c.runner();
        tokio::spawn($run($config, $inbox, $handler, $c.metrics, $c.cancel))
    }};
}

mod brokers;
mod properties;
#[cfg(feature = "rocketmq")]
use brokers::rocketmq;
use brokers::{kafka, mqtt, nats, rabbitmq, redis};
use properties::*;

conformance!(on_nats, nats::Nats);
conformance!(on_mqtt, mqtt::Mqtt);
conformance!(on_kafka, kafka::Kafka);
conformance!(on_rabbitmq, rabbitmq::Rabbit);
conformance!(on_redis, redis::Redis);
// A crash cannot be staged in-process on RocketMQ: the client keeps one instance per process, so
// the aborted runner's consumer would stay registered in the group beside its successor.
#[cfg(feature = "rocketmq")]
conformance!(on_rocketmq, rocketmq::RocketMq, without crash);
