//! The brokers `outbox bench` can publish to, chosen by the scheme of `--transport`.
//!
//! Each arm gives the bench the library [`Transport`] under test (the one the relay uses) plus
//! what the bench needs around it: a fresh destination, a way to empty it between scenarios, a
//! count of what it holds (to check a drain lost nothing), and a consumer-side subscriber for the
//! latency figures.
//!
//! | `--transport` | transport | destination | stored | consumer side |
//! |---|---|---|---|---|
//! | `memory` | in-process sink | `{topic}` | acknowledged count | none |
//! | `nats://` | [`NatsTransport`] | stream `BENCH_<RUN>`, subjects `bench.<run>.{topic}` | stream messages | ordered push consumer |
//! | `redis://`, `rediss://` (feature `redis`) | `RedisTransport` | stream key `bench:<run>` | `XLEN` | `XREAD BLOCK` on a connection of its own |
//! | `amqp://`, `amqps://` (feature `rabbitmq`) | `RabbitMqTransport` | durable queue `bench.<run>` through the default exchange | queue message count | none for latency (a consumer would take messages off the counted queue); the queue's consumer for `consume` |
//! | `kafka://` (feature `kafka`) | `KafkaTransport` | topic `bench-<run>-<k>` (1 partition, a new one per scenario) | not counted | none for latency; a consumer group for `consume`; the topics are left on the broker |
//!
//! To add a broker: add its scheme to [`Kind::parse`], write a struct implementing [`Broker`]
//! around the library's transport for it, and add one arm to [`open`].

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use async_nats::jetstream::consumer::{DeliverPolicy, push};
use async_trait::async_trait;
use futures::StreamExt;
use outbox::{NatsConfig, NatsTransport, Outgoing, StreamSetup, Transport, TransportError};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::now_us;

/// The broker families the bench knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// `memory`: an in-process sink that acknowledges every message at once (it measures the
    /// relay and the database without a broker). Not the library's `MemoryTransport`, which
    /// keeps a copy of every message and would measure its own cloning.
    Memory,
    /// `nats://host:port`: NATS JetStream through [`NatsTransport`].
    Nats,
    /// `redis://host:port[/db]` or `rediss://…`: Redis Streams through `RedisTransport`
    /// (feature `redis`).
    Redis,
    /// `amqp://user:password@host:port/vhost` or `amqps://…`: RabbitMQ through
    /// `RabbitMqTransport` (feature `rabbitmq`).
    RabbitMq,
    /// `kafka://host:port[,host:port…]`: a Kafka-protocol broker through `KafkaTransport`
    /// (feature `kafka`).
    Kafka,
}

/// The accepted `--transport` forms, for error messages.
const ACCEPTED: &str = "`memory`, `nats://host:port`, `redis://host:port`, `amqp://user:password@host:port/vhost` or `kafka://host:port`";

impl Kind {
    /// The broker family of a `--transport` value.
    ///
    /// # Errors
    /// The value and the accepted forms, for anything else.
    /// A scheme whose feature this build lacks is refused with the feature to build with.
    pub fn parse(url: &str) -> Result<Kind, String> {
        let (kind, feature, enabled) = if url == "memory" || url == "memory://" {
            return Ok(Kind::Memory);
        } else if url.starts_with("nats://") {
            return Ok(Kind::Nats);
        } else if url.starts_with("redis://") || url.starts_with("rediss://") {
            (Kind::Redis, "redis", cfg!(feature = "redis"))
        } else if url.starts_with("amqp://") || url.starts_with("amqps://") {
            (Kind::RabbitMq, "rabbitmq", cfg!(feature = "rabbitmq"))
        } else if url.starts_with("kafka://") {
            (Kind::Kafka, "kafka", cfg!(feature = "kafka"))
        } else {
            return Err(format!(
                "unsupported transport {url:?}: expected {ACCEPTED}"
            ));
        };
        if enabled {
            Ok(kind)
        } else {
            Err(format!(
                "transport {url:?} needs the `{feature}` feature, which this build of outbox \
                 lacks (build outbox-cli with `--features {feature}`)"
            ))
        }
    }
}

/// Message ids and the moment (µs since the Unix epoch, this process's clock) something happened
/// to them: acknowledged, or received by a subscriber.
#[derive(Default)]
pub struct Receipts {
    seen: Mutex<Vec<(Uuid, i64)>>,
    count: AtomicU64,
}

impl Receipts {
    /// Record `id` at `at_us`.
    pub fn record(&self, id: Uuid, at_us: i64) {
        self.seen.lock().expect("poisoned").push((id, at_us));
        self.count.fetch_add(1, Ordering::Relaxed);
    }

    /// How many were recorded.
    pub fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }

    /// Everything recorded so far, in order; the first record of an id wins when it repeats.
    pub fn first_by_id(&self) -> std::collections::HashMap<Uuid, i64> {
        let seen = self.seen.lock().expect("poisoned");
        let mut out = std::collections::HashMap::with_capacity(seen.len());
        for (id, at) in seen.iter() {
            out.entry(*id).or_insert(*at);
        }
        out
    }
}

/// A broker arm (see the module docs).
#[async_trait]
pub trait Broker: Send + Sync {
    /// What the bench set up, for the report.
    fn describe(&self) -> String;

    /// The library transport under test.
    fn transport(&self) -> Arc<dyn Transport>;

    /// The route's destination template (`{topic}` is replaced by the message's topic), as of
    /// the last [`Broker::reset`].
    fn destination(&self) -> String;

    /// Forget what earlier scenarios published, so [`Broker::stored`] counts one scenario and a
    /// consumer reading the destination from the first sees only what comes after.
    async fn reset(&self) -> anyhow::Result<()>;

    /// Whether a consumer takes the messages off the destination (a queue), so that each
    /// consumer of the `consume` scenario needs the backlog published again. Default `false`
    /// (a log or stream every consumer group reads from the first).
    fn consuming_removes(&self) -> bool {
        false
    }

    /// Messages the broker holds now, `None` when it cannot tell.
    async fn stored(&self) -> anyhow::Result<Option<u64>>;

    /// Start a consumer-side subscriber that records each message's id and arrival in
    /// `receipts` until `cancel`; `None` (the default) when the broker has no consumer side to
    /// observe.
    async fn observe(
        &self,
        _receipts: Arc<Receipts>,
        _cancel: CancellationToken,
    ) -> anyhow::Result<Option<JoinHandle<()>>> {
        Ok(None)
    }

    /// Start this broker's consumer source as consumer group `group` (reading every message of
    /// the destination from the first, `fetch` per fetch), applying through `apply` with
    /// `runner`, in a task that ends at `cancel` (the `consume` scenario).
    ///
    /// # Errors
    /// A broker the scenario has no consumer for (the default), or a failed set-up.
    async fn consume(
        &self,
        _group: &str,
        _apply: super::consume::Apply,
        _runner: outbox::consumer::RunnerSettings,
        _fetch: usize,
        _metrics: Arc<outbox::consumer::ConsumerMetrics>,
        _cancel: CancellationToken,
    ) -> anyhow::Result<JoinHandle<anyhow::Result<()>>> {
        anyhow::bail!(
            "--only consume: no consumer for {} in the bench",
            self.describe()
        )
    }

    /// Remove what the bench created on the broker.
    async fn cleanup(&self) -> anyhow::Result<()>;
}

/// Open the broker of `url` for run `run_id`: the single place a broker arm is chosen.
///
/// # Errors
/// An unsupported URL or an unreachable broker, named.
pub async fn open(url: &str, run_id: &str) -> anyhow::Result<Box<dyn Broker>> {
    match Kind::parse(url).map_err(anyhow::Error::msg)? {
        Kind::Memory => Ok(Box::new(Sink::default())),
        Kind::Nats => Ok(Box::new(Nats::open(url, run_id).await?)),
        #[cfg(feature = "redis")]
        Kind::Redis => Ok(Box::new(redis_arm::Redis::open(url, run_id).await?)),
        #[cfg(feature = "rabbitmq")]
        Kind::RabbitMq => Ok(Box::new(rabbitmq_arm::Rabbit::open(url, run_id).await?)),
        #[cfg(feature = "kafka")]
        Kind::Kafka => Ok(Box::new(kafka_arm::Kafka::open(url, run_id).await?)),
        // Refused by `Kind::parse` when the feature is off.
        #[allow(unreachable_patterns)]
        other => anyhow::bail!("--transport {url}: {other:?} is not built in"),
    }
}

/// Wraps a transport and records when each message's acknowledgement came back to the caller
/// (the relay): the end of the commit → ack latency.
pub struct Stamped {
    inner: Arc<dyn Transport>,
    acks: Arc<Receipts>,
}

impl Stamped {
    /// Wrap `inner`, recording into `acks`.
    pub fn new(inner: Arc<dyn Transport>, acks: Arc<Receipts>) -> Stamped {
        Stamped { inner, acks }
    }
}

#[async_trait]
impl Transport for Stamped {
    fn name(&self) -> &str {
        self.inner.name()
    }

    async fn publish(&self, batch: &[Outgoing<'_>]) -> Vec<Result<(), TransportError>> {
        let results = self.inner.publish(batch).await;
        let at = now_us();
        for (o, r) in batch.iter().zip(&results) {
            if r.is_ok() {
                self.acks.record(o.message.message_id, at);
            }
        }
        results
    }

    async fn probe(&self) -> Result<(), TransportError> {
        self.inner.probe().await
    }
}

/// `memory`: acknowledges at once and counts.
#[derive(Default)]
struct Sink {
    transport: Arc<SinkTransport>,
}

#[derive(Default)]
struct SinkTransport {
    acked: AtomicU64,
}

#[async_trait]
impl Transport for SinkTransport {
    fn name(&self) -> &str {
        "memory"
    }

    async fn publish(&self, batch: &[Outgoing<'_>]) -> Vec<Result<(), TransportError>> {
        self.acked.fetch_add(batch.len() as u64, Ordering::Relaxed);
        batch.iter().map(|_| Ok(())).collect()
    }

    async fn probe(&self) -> Result<(), TransportError> {
        Ok(())
    }
}

#[async_trait]
impl Broker for Sink {
    fn describe(&self) -> String {
        "in-process sink (acknowledges every message at once; no broker)".into()
    }

    fn transport(&self) -> Arc<dyn Transport> {
        self.transport.clone()
    }

    fn destination(&self) -> String {
        "{topic}".into()
    }

    async fn reset(&self) -> anyhow::Result<()> {
        self.transport.acked.store(0, Ordering::Relaxed);
        Ok(())
    }

    async fn stored(&self) -> anyhow::Result<Option<u64>> {
        Ok(Some(self.transport.acked.load(Ordering::Relaxed)))
    }

    async fn cleanup(&self) -> anyhow::Result<()> {
        Ok(())
    }
}

/// `nats://`: a stream `BENCH_<RUN>` (file storage, 2-minute duplicate window, as
/// [`NatsTransport`] creates it) capturing `bench.<run>.>`; messages go to `bench.<run>.<topic>`.
struct Nats {
    url: String,
    transport: Arc<NatsTransport>,
    stream: String,
    subjects: String,
    destination: String,
}

impl Nats {
    async fn open(url: &str, run_id: &str) -> anyhow::Result<Nats> {
        let stream = format!("BENCH_{}", run_id.to_uppercase());
        let subjects = format!("bench.{run_id}.>");
        let config = NatsConfig {
            stream: Some(StreamSetup {
                name: stream.clone(),
                subjects: vec![subjects.clone()],
                create: true,
                replicas: 1,
            }),
            ..NatsConfig::new(url)
        };
        let transport = NatsTransport::connect(config)
            .await
            .with_context(|| format!("--transport {url}"))?;
        Ok(Nats {
            url: url.to_owned(),
            transport: Arc::new(transport),
            stream,
            subjects,
            destination: format!("bench.{run_id}.{{topic}}"),
        })
    }

    async fn get_stream(&self) -> anyhow::Result<async_nats::jetstream::stream::Stream> {
        self.transport
            .jetstream()
            .get_stream(&self.stream)
            .await
            .with_context(|| format!("JetStream stream {}", self.stream))
    }
}

#[async_trait]
impl Broker for Nats {
    fn describe(&self) -> String {
        format!(
            "NATS JetStream at {} (stream {}, file storage, duplicate window 2 min, subjects {})",
            self.url, self.stream, self.subjects
        )
    }

    fn transport(&self) -> Arc<dyn Transport> {
        self.transport.clone()
    }

    fn destination(&self) -> String {
        self.destination.clone()
    }

    async fn reset(&self) -> anyhow::Result<()> {
        self.get_stream()
            .await?
            .purge()
            .await
            .with_context(|| format!("purge stream {}", self.stream))?;
        Ok(())
    }

    async fn stored(&self) -> anyhow::Result<Option<u64>> {
        let mut s = self.get_stream().await?;
        Ok(Some(s.info().await?.state.messages))
    }

    async fn observe(
        &self,
        receipts: Arc<Receipts>,
        cancel: CancellationToken,
    ) -> anyhow::Result<Option<JoinHandle<()>>> {
        let consumer = self
            .get_stream()
            .await?
            .create_consumer(push::OrderedConfig {
                deliver_subject: self.transport.client().new_inbox(),
                filter_subject: self.subjects.clone(),
                deliver_policy: DeliverPolicy::New,
                ..Default::default()
            })
            .await
            .context("create the ordered push consumer")?;
        let mut messages = consumer.messages().await?;
        Ok(Some(tokio::spawn(async move {
            loop {
                let next = tokio::select! {
                    _ = cancel.cancelled() => return,
                    m = messages.next() => m,
                };
                match next {
                    Some(Ok(m)) => {
                        let at = now_us();
                        let id = m
                            .headers
                            .as_ref()
                            .and_then(|h| h.get(outbox::message::HEADER_MESSAGE_ID))
                            .and_then(|v| Uuid::parse_str(v.as_str()).ok());
                        if let Some(id) = id {
                            receipts.record(id, at);
                        }
                    }
                    Some(Err(e)) => {
                        tracing::warn!(error = %e, "latency subscriber: receive failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                    None => return,
                }
            }
        })))
    }

    async fn consume(
        &self,
        group: &str,
        apply: super::consume::Apply,
        runner: outbox::consumer::RunnerSettings,
        fetch: usize,
        metrics: Arc<outbox::consumer::ConsumerMetrics>,
        cancel: CancellationToken,
    ) -> anyhow::Result<JoinHandle<anyhow::Result<()>>> {
        use outbox::consumer::nats::{NatsConsumerConfig, NatsSource};
        let mut config = NatsConsumerConfig::new(&self.stream, group);
        config.batch = fetch;
        config.runner = runner;
        let options = outbox::consumer::source::ConsumeOptions::new(&config.runner, fetch);
        let source = NatsSource::new(self.transport.jetstream().clone(), config);
        Ok(tokio::spawn(apply.run(source, options, metrics, cancel)))
    }

    async fn cleanup(&self) -> anyhow::Result<()> {
        self.transport
            .jetstream()
            .delete_stream(&self.stream)
            .await
            .with_context(|| format!("delete stream {}", self.stream))?;
        Ok(())
    }
}

/// `redis://`: every message is `XADD`ed to the stream key `bench:<run>` by `RedisTransport`.
#[cfg(feature = "redis")]
mod redis_arm {
    use super::*;
    use outbox::transport::redis::{FIELD_ID, connect_manager};
    use outbox::{RedisConfig, RedisTransport};
    use redis::aio::ConnectionManager;
    use redis::streams::StreamReadReply;

    /// How long one `XREAD` of the latency subscriber blocks for new entries.
    const BLOCK: Duration = Duration::from_millis(500);

    /// The Redis Streams arm.
    pub(super) struct Redis {
        config: RedisConfig,
        transport: Arc<RedisTransport>,
        key: String,
    }

    impl Redis {
        /// Connect the transport and empty the run's stream key.
        pub(super) async fn open(url: &str, run_id: &str) -> anyhow::Result<Redis> {
            let config = RedisConfig::new(url);
            let transport = RedisTransport::connect(config.clone())
                .await
                .with_context(|| format!("--transport {url}"))?;
            let r = Redis {
                config,
                transport: Arc::new(transport),
                key: format!("bench:{run_id}"),
            };
            r.delete().await?;
            Ok(r)
        }

        async fn delete(&self) -> anyhow::Result<()> {
            redis::cmd("DEL")
                .arg(&self.key)
                .query_async::<i64>(&mut self.transport.connection())
                .await
                .with_context(|| format!("DEL {}", self.key))?;
            Ok(())
        }
    }

    #[async_trait]
    impl Broker for Redis {
        fn describe(&self) -> String {
            format!(
                "Redis Streams at {} (stream key {}, XADD without MAXLEN; durability as the \
                 server's persistence settings)",
                self.config.url, self.key
            )
        }

        fn transport(&self) -> Arc<dyn Transport> {
            self.transport.clone()
        }

        fn destination(&self) -> String {
            self.key.clone()
        }

        async fn reset(&self) -> anyhow::Result<()> {
            self.delete().await
        }

        async fn stored(&self) -> anyhow::Result<Option<u64>> {
            let n: u64 = redis::cmd("XLEN")
                .arg(&self.key)
                .query_async(&mut self.transport.connection())
                .await
                .with_context(|| format!("XLEN {}", self.key))?;
            Ok(Some(n))
        }

        async fn observe(
            &self,
            receipts: Arc<Receipts>,
            cancel: CancellationToken,
        ) -> anyhow::Result<Option<JoinHandle<()>>> {
            // A connection of its own: a blocking XREAD on the transport's multiplexed
            // connection would hold the relay's XADDs behind it.
            let mut conn: ConnectionManager = connect_manager(
                &self.config.url,
                self.config.password.as_deref(),
                self.config.connect_timeout,
                BLOCK + self.config.response_timeout,
            )
            .await
            .context("connect the latency subscriber")?;
            // Everything after the last entry there now (none right after `reset`), read from
            // that id on so no entry published before the first XREAD is missed.
            let last: Vec<(String, Vec<(String, Vec<u8>)>)> = redis::cmd("XREVRANGE")
                .arg(&self.key)
                .arg("+")
                .arg("-")
                .arg("COUNT")
                .arg(1)
                .query_async(&mut conn)
                .await
                .with_context(|| format!("XREVRANGE {}", self.key))?;
            let mut from = last
                .into_iter()
                .next()
                .map(|(id, _)| id)
                .unwrap_or_else(|| "0-0".into());
            let key = self.key.clone();
            Ok(Some(tokio::spawn(async move {
                loop {
                    let mut cmd = redis::cmd("XREAD");
                    cmd.arg("COUNT")
                        .arg(10_000)
                        .arg("BLOCK")
                        .arg(BLOCK.as_millis() as u64)
                        .arg("STREAMS")
                        .arg(&key)
                        .arg(&from);
                    let read = tokio::select! {
                        _ = cancel.cancelled() => return,
                        r = cmd.query_async::<Option<StreamReadReply>>(&mut conn) => r,
                    };
                    match read {
                        Ok(reply) => {
                            let at = now_us();
                            for entry in reply.into_iter().flat_map(|r| r.keys).flat_map(|k| k.ids)
                            {
                                let id = entry
                                    .get::<String>(FIELD_ID)
                                    .and_then(|v| Uuid::parse_str(&v).ok());
                                if let Some(id) = id {
                                    receipts.record(id, at);
                                }
                                from = entry.id;
                            }
                        }
                        Err(e) => {
                            tracing::warn!(error = %e, "latency subscriber: XREAD failed");
                            tokio::time::sleep(Duration::from_millis(50)).await;
                        }
                    }
                }
            })))
        }

        async fn consume(
            &self,
            group: &str,
            apply: crate::bench::consume::Apply,
            runner: outbox::consumer::RunnerSettings,
            fetch: usize,
            metrics: Arc<outbox::consumer::ConsumerMetrics>,
            cancel: CancellationToken,
        ) -> anyhow::Result<JoinHandle<anyhow::Result<()>>> {
            let mut config = outbox::consumer::redis::RedisConsumerConfig::new(
                &self.config.url,
                &self.key,
                group,
            );
            config.password = self.config.password.clone();
            config.batch = fetch;
            config.runner = runner;
            crate::bench::consume::spawn(config, apply, metrics, cancel)
        }

        async fn cleanup(&self) -> anyhow::Result<()> {
            self.delete().await
        }
    }
}

/// `amqp://`: a durable queue `bench.<run>`, published to through the default exchange by
/// `RabbitMqTransport` (destination = the bare queue name).
#[cfg(feature = "rabbitmq")]
mod rabbitmq_arm {
    use super::*;
    use lapin::options::{QueueDeclareOptions, QueueDeleteOptions, QueuePurgeOptions};
    use lapin::types::FieldTable;
    use outbox::{RabbitMqConfig, RabbitMqTransport};

    /// Close a channel the bench opened for one operation (a channel left open is closed with
    /// the connection, which lapin logs as an error when it was already closing).
    async fn close(ch: lapin::Channel) {
        if ch.status().connected() {
            let _ = ch.close(200, "done".into()).await;
        }
    }

    /// The RabbitMQ arm.
    pub(super) struct Rabbit {
        /// The URL redacted, for the report.
        url: String,
        /// The URL as given, for the consumer.
        raw_url: String,
        /// The bench's own connection, for declaring, purging, counting and deleting the queue.
        conn: lapin::Connection,
        transport: Arc<RabbitMqTransport>,
        queue: String,
    }

    impl Rabbit {
        /// Declare the run's queue (durable, classic) and connect the transport.
        pub(super) async fn open(url: &str, run_id: &str) -> anyhow::Result<Rabbit> {
            let redacted = crate::redact(url);
            let conn = lapin::Connection::connect(url, lapin::ConnectionProperties::default())
                .await
                .with_context(|| format!("cannot connect to RabbitMQ at {redacted}"))?;
            let queue = format!("bench.{run_id}");
            let ch = conn.create_channel().await?;
            let r = ch
                .queue_declare(
                    queue.as_str().into(),
                    QueueDeclareOptions::durable(),
                    FieldTable::default(),
                )
                .await;
            close(ch).await;
            r.with_context(|| format!("declare the queue {queue}"))?;
            let transport = RabbitMqTransport::connect(RabbitMqConfig::new(url))
                .await
                .with_context(|| format!("--transport {redacted}"))?;
            Ok(Rabbit {
                url: redacted.to_string(),
                raw_url: url.to_owned(),
                conn,
                transport: Arc::new(transport),
                queue,
            })
        }

        /// A fresh channel (a refused operation closes the channel it ran on).
        async fn channel(&self) -> anyhow::Result<lapin::Channel> {
            self.conn
                .create_channel()
                .await
                .context("open a RabbitMQ channel")
        }
    }

    #[async_trait]
    impl Broker for Rabbit {
        fn describe(&self) -> String {
            format!(
                "RabbitMQ at {} (durable classic queue {} through the default exchange, \
                 persistent messages, publisher confirms; no consumer, so the count stays \
                 exact)",
                self.url, self.queue
            )
        }

        fn transport(&self) -> Arc<dyn Transport> {
            self.transport.clone()
        }

        fn destination(&self) -> String {
            self.queue.clone()
        }

        async fn reset(&self) -> anyhow::Result<()> {
            let ch = self.channel().await?;
            let r = ch
                .queue_purge(self.queue.as_str().into(), QueuePurgeOptions::default())
                .await;
            close(ch).await;
            r.with_context(|| format!("purge the queue {}", self.queue))?;
            Ok(())
        }

        async fn stored(&self) -> anyhow::Result<Option<u64>> {
            let ch = self.channel().await?;
            let q = ch
                .queue_declare(
                    self.queue.as_str().into(),
                    QueueDeclareOptions {
                        passive: true,
                        ..Default::default()
                    },
                    FieldTable::default(),
                )
                .await;
            close(ch).await;
            let q = q.with_context(|| format!("count the queue {}", self.queue))?;
            Ok(Some(u64::from(q.message_count())))
        }

        // `observe` is the default (no subscriber): the default exchange routes a message to
        // the one queue named by its routing key, so a consumer could only read the queue that
        // `Broker::stored` counts, and would take the messages off it (the drain check would
        // then see a loss).

        fn consuming_removes(&self) -> bool {
            true
        }

        /// The queue's consumer (`group` does not apply: a queue is one group).
        async fn consume(
            &self,
            _group: &str,
            apply: crate::bench::consume::Apply,
            runner: outbox::consumer::RunnerSettings,
            fetch: usize,
            metrics: Arc<outbox::consumer::ConsumerMetrics>,
            cancel: CancellationToken,
        ) -> anyhow::Result<JoinHandle<anyhow::Result<()>>> {
            let mut config = outbox::consumer::rabbitmq::RabbitMqConsumerConfig::new(
                RabbitMqConfig::new(&self.raw_url),
                &self.queue,
            );
            config.batch = u16::try_from(fetch).context("--consumer-fetch above 65535")?;
            config.runner = runner;
            crate::bench::consume::spawn(config, apply, metrics, cancel)
        }

        async fn cleanup(&self) -> anyhow::Result<()> {
            let ch = self.channel().await?;
            let r = ch
                .queue_delete(self.queue.as_str().into(), QueueDeleteOptions::default())
                .await;
            close(ch).await;
            let _ = self.conn.close(200, "bench done".into()).await;
            r.with_context(|| format!("delete the queue {}", self.queue))?;
            Ok(())
        }
    }
}

/// `kafka://`: a topic `bench-<run>-<k>` (1 partition, replication 1) created with the library's
/// admin helper, as `outbox relay` does for `create_topics`; `KafkaTransport` never creates it.
/// Each [`Broker::reset`] creates the next topic (`k` + 1), so that a scenario's consumers
/// reading from the first record see only that scenario's messages.
#[cfg(feature = "kafka")]
mod kafka_arm {
    use super::*;
    use outbox::consumer::kafka::KafkaConsumerConfig;
    use outbox::transport::kafka::{KafkaTopic, create_topics};
    use outbox::{KafkaConfig, KafkaTransport};

    /// The Kafka arm.
    pub(super) struct Kafka {
        config: KafkaConfig,
        transport: Arc<KafkaTransport>,
        run_id: String,
        /// The current topic and how many were created.
        topic: Mutex<(String, u32)>,
    }

    impl Kafka {
        /// Create the run's first topic and connect the producer.
        pub(super) async fn open(url: &str, run_id: &str) -> anyhow::Result<Kafka> {
            let config = KafkaConfig::new(url);
            let transport = KafkaTransport::connect(config.clone())
                .await
                .with_context(|| format!("--transport {url}"))?;
            let kafka = Kafka {
                config,
                transport: Arc::new(transport),
                run_id: run_id.to_owned(),
                topic: Mutex::new((String::new(), 0)),
            };
            kafka.reset().await?;
            Ok(kafka)
        }
    }

    #[async_trait]
    impl Broker for Kafka {
        fn describe(&self) -> String {
            format!(
                "Kafka protocol at {} (topics {}, a new one per scenario, 1 partition, \
                 idempotent producer, acks=all, linger {:?}); the messages stored are not \
                 counted (the client's high watermarks are not trusted on Tansu) and the topics \
                 are left on the broker (the library has no topic deletion)",
                self.config.bootstrap_servers,
                self.topic.lock().expect("poisoned").0,
                self.config.linger
            )
        }

        fn transport(&self) -> Arc<dyn Transport> {
            self.transport.clone()
        }

        fn destination(&self) -> String {
            self.topic.lock().expect("poisoned").0.clone()
        }

        /// Create the next topic and publish to it from now on.
        async fn reset(&self) -> anyhow::Result<()> {
            let k = self.topic.lock().expect("poisoned").1 + 1;
            let topic = format!("bench-{}-{k}", self.run_id);
            create_topics(&self.config, &[KafkaTopic::new(topic.clone())])
                .await
                .with_context(|| {
                    format!(
                        "create the topic {topic} on Kafka at {}",
                        self.config.bootstrap_servers
                    )
                })?;
            *self.topic.lock().expect("poisoned") = (topic, k);
            Ok(())
        }

        async fn stored(&self) -> anyhow::Result<Option<u64>> {
            Ok(None)
        }

        async fn consume(
            &self,
            group: &str,
            apply: crate::bench::consume::Apply,
            runner: outbox::consumer::RunnerSettings,
            fetch: usize,
            metrics: Arc<outbox::consumer::ConsumerMetrics>,
            cancel: CancellationToken,
        ) -> anyhow::Result<JoinHandle<anyhow::Result<()>>> {
            let mut config =
                KafkaConsumerConfig::new(self.config.clone(), group, [self.destination()]);
            config.batch = fetch;
            config.runner = runner;
            crate::bench::consume::spawn(config, apply, metrics, cancel)
        }

        /// Leaves the topics: the library offers topic creation only, and the CLI does not
        /// depend on the Kafka client directly.
        async fn cleanup(&self) -> anyhow::Result<()> {
            let (topic, k) = self.topic.lock().expect("poisoned").clone();
            tracing::info!(last = %topic, topics = k, "the bench topics are left on the Kafka broker");
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transport_urls() {
        assert_eq!(Kind::parse("memory"), Ok(Kind::Memory));
        assert_eq!(Kind::parse("nats://127.0.0.1:4222"), Ok(Kind::Nats));
        let enabled = [
            (
                "redis://127.0.0.1:6379",
                Kind::Redis,
                cfg!(feature = "redis"),
            ),
            ("rediss://h:6380/0", Kind::Redis, cfg!(feature = "redis")),
            (
                "amqp://guest:guest@127.0.0.1:5672/%2f",
                Kind::RabbitMq,
                cfg!(feature = "rabbitmq"),
            ),
            ("amqps://h/v", Kind::RabbitMq, cfg!(feature = "rabbitmq")),
            (
                "kafka://127.0.0.1:19092",
                Kind::Kafka,
                cfg!(feature = "kafka"),
            ),
        ];
        for (url, kind, on) in enabled {
            match Kind::parse(url) {
                Ok(k) => assert!(on && k == kind, "{url}: {k:?}"),
                Err(e) => assert!(!on && e.contains("feature"), "{url}: {e}"),
            }
        }
        let e = Kind::parse("mqtt://localhost").unwrap_err();
        assert!(
            e.contains("mqtt://localhost")
                && ["nats://", "redis://", "amqp://", "kafka://"]
                    .iter()
                    .all(|s| e.contains(s)),
            "{e}"
        );
    }

    #[test]
    fn receipts_keep_the_first_sighting() {
        let r = Receipts::default();
        let (a, b) = (Uuid::now_v7(), Uuid::now_v7());
        r.record(a, 10);
        r.record(b, 20);
        r.record(a, 30);
        assert_eq!(r.count(), 3);
        let m = r.first_by_id();
        assert_eq!((m[&a], m[&b]), (10, 20));
    }
}
