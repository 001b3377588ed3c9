//! RabbitMQ for the tests: the server URL from `OUTBOX_TEST_RABBITMQ_URL`, an administrative
//! connection that panics naming the variable when the broker does not answer, and
//! [`RabbitMqFixture`]: a topic exchange and a queue bound to it (`#`) of its own per test.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use lapin::options::{
    BasicAckOptions, BasicGetOptions, BasicPublishOptions, ExchangeDeclareOptions,
    ExchangeDeleteOptions, QueueBindOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties, ExchangeKind};
use outbox::transport::Transport;
use outbox::{RabbitMqConfig, RabbitMqTransport};

use crate::{Received, TransportFixture, unique};

/// Default RabbitMQ URL when `OUTBOX_TEST_RABBITMQ_URL` is unset.
pub const DEFAULT_RABBITMQ_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

/// `OUTBOX_TEST_RABBITMQ_URL`, or [`DEFAULT_RABBITMQ_URL`].
pub fn rabbitmq_url() -> String {
    std::env::var("OUTBOX_TEST_RABBITMQ_URL").unwrap_or_else(|_| DEFAULT_RABBITMQ_URL.into())
}

/// Connect to the test RabbitMQ.
///
/// # Panics
/// When RabbitMQ does not answer within 5 s, naming the URL and `OUTBOX_TEST_RABBITMQ_URL`.
pub async fn rabbitmq_connection() -> Connection {
    let url = rabbitmq_url();
    let connect = Connection::connect(&url, ConnectionProperties::default());
    match tokio::time::timeout(Duration::from_secs(5), connect).await {
        Ok(Ok(c)) => c,
        Ok(Err(e)) => panic!(
            "RabbitMQ is not reachable at {url} ({e}); start it (rabbitmq-server -detached) or set OUTBOX_TEST_RABBITMQ_URL"
        ),
        Err(_) => panic!(
            "RabbitMQ at {url} did not answer within 5 s; start it (rabbitmq-server -detached) or set OUTBOX_TEST_RABBITMQ_URL"
        ),
    }
}

/// The `host:port` of [`rabbitmq_url`] (for a [`FaultProxy`](crate::FaultProxy) in front of it).
pub fn rabbitmq_host_port() -> String {
    let url = rabbitmq_url();
    let rest = url.split_once("://").map_or(url.as_str(), |(_, r)| r);
    let rest = rest.rsplit_once('@').map_or(rest, |(_, r)| r);
    rest.split(['/', '?']).next().unwrap_or(rest).to_owned()
}

/// Transport settings for the tests: `url`, confirm timeout 5 s, connect timeout 2 s.
pub fn rabbitmq_config(url: &str) -> RabbitMqConfig {
    let mut c = RabbitMqConfig::new(url);
    c.confirm_timeout = Duration::from_secs(5);
    c.connect_timeout = Duration::from_secs(2);
    c
}

/// A message read back from a queue.
#[derive(Debug, Clone)]
pub struct Stored {
    /// As the transport suite compares it (native id = the `message_id` property).
    pub received: Received,
    /// The AMQP properties.
    pub properties: BasicProperties,
}

/// A topic exchange `<name>` and a durable queue `<name>` bound to it with `#`, for one test;
/// [`TransportFixture::cleanup`] deletes them, the queues made with
/// [`RabbitMqFixture::declare_queue`] and the consumer runner's retry queues of each.
pub struct RabbitMqFixture {
    /// The transport under test.
    pub transport: Arc<RabbitMqTransport>,
    /// The exchange (topic).
    pub exchange: String,
    /// The queue bound to the exchange with `#`.
    pub queue: String,
    admin: Connection,
    queues: Mutex<Vec<String>>,
    exchanges: Mutex<Vec<String>>,
    seen: Mutex<Vec<Received>>,
}

impl RabbitMqFixture {
    /// Connect to the test broker and create the exchange and queue.
    ///
    /// # Panics
    /// When RabbitMQ does not answer (naming `OUTBOX_TEST_RABBITMQ_URL`).
    pub async fn new() -> RabbitMqFixture {
        Self::with_config(rabbitmq_config(&rabbitmq_url())).await
    }

    /// As [`RabbitMqFixture::new`] with the transport connecting with `config` (for example
    /// through a [`FaultProxy`](crate::FaultProxy)); the fixture's own administrative connection
    /// goes to the broker directly.
    ///
    /// # Panics
    /// When RabbitMQ does not answer or the transport cannot connect.
    pub async fn with_config(config: RabbitMqConfig) -> RabbitMqFixture {
        let admin = rabbitmq_connection().await;
        let name = unique("obx");
        let transport = RabbitMqTransport::connect(config)
            .await
            .unwrap_or_else(|e| {
                panic!("RabbitMQ transport: {e}; is OUTBOX_TEST_RABBITMQ_URL right?")
            });
        let fx = RabbitMqFixture {
            transport: Arc::new(transport),
            exchange: name.clone(),
            queue: name.clone(),
            admin,
            queues: Mutex::new(Vec::new()),
            exchanges: Mutex::new(Vec::new()),
            seen: Mutex::new(Vec::new()),
        };
        fx.declare_exchange(&name).await;
        fx.declare_queue(&name, &[(&name, "#")]).await;
        fx
    }

    /// The destination template that publishes each topic to the fixture's exchange with the
    /// topic as routing key: `<exchange>/{topic}`.
    pub fn topic_destination(&self) -> String {
        format!("{}/{{topic}}", self.exchange)
    }

    /// A fresh channel on the administrative connection (a refused operation closes only it).
    ///
    /// # Panics
    /// When the connection is gone.
    pub async fn channel(&self) -> Channel {
        self.admin.create_channel().await.expect("admin channel")
    }

    /// Declare a durable topic exchange, deleted at cleanup.
    ///
    /// # Panics
    /// When the broker refuses.
    pub async fn declare_exchange(&self, name: &str) {
        let ch = self.channel().await;
        ch.exchange_declare(
            name.into(),
            ExchangeKind::Topic,
            ExchangeDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap_or_else(|e| panic!("declare exchange {name}: {e}"));
        self.exchanges.lock().unwrap().push(name.to_owned());
    }

    /// Declare a durable topic exchange `<exchange>_<suffix>`, deleted at cleanup; its name.
    ///
    /// # Panics
    /// When the broker refuses.
    pub async fn extra_exchange(&self, suffix: &str) -> String {
        let name = format!("{}_{suffix}", self.exchange);
        self.declare_exchange(&name).await;
        name
    }

    /// Declare a durable queue bound to each `(exchange, key)`, deleted at cleanup with its
    /// retry queues.
    ///
    /// # Panics
    /// When the broker refuses.
    pub async fn declare_queue(&self, name: &str, bindings: &[(&str, &str)]) {
        self.declare_queue_with(name, bindings, FieldTable::default())
            .await;
    }

    /// Declare a durable queue that holds at most `max_length` messages and nacks publishes
    /// beyond that (`x-max-length`, `x-overflow = reject-publish`), bound to each
    /// `(exchange, key)`, deleted at cleanup.
    ///
    /// # Panics
    /// When the broker refuses.
    pub async fn declare_bounded_queue(
        &self,
        name: &str,
        bindings: &[(&str, &str)],
        max_length: i64,
    ) {
        let mut args = FieldTable::default();
        args.insert("x-max-length".into(), AMQPValue::LongLongInt(max_length));
        args.insert(
            "x-overflow".into(),
            AMQPValue::LongString("reject-publish".into()),
        );
        self.declare_queue_with(name, bindings, args).await;
    }

    async fn declare_queue_with(&self, name: &str, bindings: &[(&str, &str)], args: FieldTable) {
        let ch = self.channel().await;
        ch.queue_declare(name.into(), QueueDeclareOptions::durable(), args)
            .await
            .unwrap_or_else(|e| panic!("declare queue {name}: {e}"));
        for (exchange, key) in bindings {
            ch.queue_bind(
                name.into(),
                (*exchange).into(),
                (*key).into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap_or_else(|e| panic!("bind {name} to {exchange}: {e}"));
        }
        self.queues.lock().unwrap().push(name.to_owned());
    }

    /// Delete `queue` (and its retry queues) at cleanup, for a queue declared by the code under
    /// test.
    pub fn delete_at_cleanup(&self, queue: &str) {
        self.queues.lock().unwrap().push(queue.to_owned());
    }

    /// Whether `queue` exists (a passive declare on a channel of its own).
    pub async fn queue_exists(&self, queue: &str) -> bool {
        self.passive(queue).await.is_ok()
    }

    async fn passive(&self, queue: &str) -> Result<lapin::Queue, lapin::Error> {
        self.channel()
            .await
            .queue_declare(
                queue.into(),
                QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
    }

    /// Consumers of `queue`.
    ///
    /// # Panics
    /// When the queue does not exist.
    pub async fn consumers(&self, queue: &str) -> u32 {
        self.passive(queue)
            .await
            .unwrap_or_else(|e| panic!("queue {queue}: {e}"))
            .consumer_count()
    }

    /// Delete an exchange now (e.g. after the transport checked it).
    ///
    /// # Panics
    /// When the broker refuses.
    pub async fn delete_exchange(&self, name: &str) {
        self.channel()
            .await
            .exchange_delete(name.into(), ExchangeDeleteOptions::default())
            .await
            .unwrap_or_else(|e| panic!("delete exchange {name}: {e}"));
    }

    /// Messages ready in `queue` (not counting unacknowledged ones).
    ///
    /// # Panics
    /// When the queue does not exist.
    pub async fn ready(&self, queue: &str) -> u32 {
        self.passive(queue)
            .await
            .unwrap_or_else(|e| panic!("queue {queue}: {e}"))
            .message_count()
    }

    /// Take every message ready in `queue` (acknowledged, so they are gone from it).
    ///
    /// # Panics
    /// When the queue cannot be read.
    pub async fn take_all(&self, queue: &str) -> Vec<Stored> {
        let ch = self.channel().await;
        let mut out = Vec::new();
        while let Some(m) = ch
            .basic_get(queue.into(), BasicGetOptions::default())
            .await
            .unwrap_or_else(|e| panic!("basic.get {queue}: {e}"))
        {
            let d = m.delivery;
            d.acker
                .ack(BasicAckOptions::default())
                .await
                .expect("ack basic.get");
            let headers: BTreeMap<String, String> =
                outbox::transport::rabbitmq::received_headers(d.properties.headers().as_ref());
            out.push(Stored {
                received: Received {
                    native_id: d.properties.message_id().as_ref().map(|s| s.to_string()),
                    headers,
                    payload: d.data,
                    destination: format!("{}/{}", d.exchange, d.routing_key),
                },
                properties: d.properties,
            });
        }
        out
    }

    /// Publish raw bytes with no outbox headers (a foreign or malformed message) to `queue`
    /// through the default exchange.
    ///
    /// # Panics
    /// When the broker does not confirm.
    pub async fn publish_raw(&self, queue: &str, payload: &[u8]) {
        self.publish_with(queue, payload, BasicProperties::default())
            .await;
    }

    /// Put a message taken with [`RabbitMqFixture::take_all`] back into `queue`, byte for byte
    /// with its properties.
    ///
    /// # Panics
    /// When the broker does not confirm.
    pub async fn publish_stored(&self, queue: &str, m: &Stored) {
        self.publish_with(queue, &m.received.payload, m.properties.clone())
            .await;
    }

    async fn publish_with(&self, queue: &str, payload: &[u8], properties: BasicProperties) {
        let ch = self.channel().await;
        ch.confirm_select(Default::default())
            .await
            .expect("confirm mode");
        let confirm = ch
            .basic_publish(
                "".into(),
                queue.into(),
                BasicPublishOptions::default(),
                payload,
                properties,
            )
            .await
            .expect("publish")
            .await
            .expect("confirm");
        assert!(confirm.is_ack(), "{confirm:?}");
    }
}

#[async_trait]
impl TransportFixture for RabbitMqFixture {
    fn transport(&self) -> Arc<dyn Transport> {
        self.transport.clone()
    }

    fn good_destination(&self) -> String {
        format!("{}/ok", self.exchange)
    }

    /// A routing key over AMQP's 255 bytes: refused before sending (a missing exchange is not a
    /// permanent refusal: it pauses the transport until the exchange exists).
    fn rejecting_destination(&self) -> String {
        format!("{}/{}", self.exchange, "k".repeat(256))
    }

    async fn received(&self) -> Vec<Received> {
        let new = self.take_all(&self.queue).await;
        let mut seen = self.seen.lock().unwrap();
        seen.extend(new.into_iter().map(|s| s.received));
        seen.clone()
    }

    async fn cleanup(&self) {
        let ch = self.channel().await;
        let queues = self.queues.lock().unwrap().clone();
        for q in queues {
            let mut names = vec![q.clone()];
            // The consumer runner's retry queues (1-2-5 series, 10 ms to 10 min).
            let mut decade = 10u64;
            while decade <= 100_000 {
                for step in [1, 2, 5] {
                    names.push(format!("{q}.retry.{}", step * decade));
                }
                decade *= 10;
            }
            names.push(format!("{q}.retry.1000000"));
            for n in names {
                let _ = ch
                    .queue_delete(n.as_str().into(), QueueDeleteOptions::default())
                    .await;
            }
        }
        let exchanges = self.exchanges.lock().unwrap().clone();
        for e in exchanges {
            let _ = ch
                .exchange_delete(e.as_str().into(), ExchangeDeleteOptions::default())
                .await;
        }
        let _ = self.admin.close(200, "test done".into()).await;
    }
}
