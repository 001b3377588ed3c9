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
//! around the library's transport for it (a module of its own under `broker/`, as the Redis,
//! RabbitMQ and Kafka arms), and add one arm to [`open`].

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

use super::consume::{ConsumerRun, ConsumerTask};
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
    /// the destination from the first, `run.fetch` per fetch), applying through `run.apply` with
    /// `run.runner`, in a task that ends at `run.cancel` (the `consume` scenario).
    ///
    /// # Errors
    /// A broker the scenario has no consumer for (the default), or a failed set-up.
    async fn consume(&self, _group: &str, _run: ConsumerRun) -> anyhow::Result<ConsumerTask> {
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

/// The library transport `connect` makes, its error naming `--transport <url>`.
async fn connect<T, E>(
    url: impl std::fmt::Display,
    connect: impl std::future::Future<Output = Result<T, E>>,
) -> anyhow::Result<Arc<T>>
where
    E: std::error::Error + Send + Sync + 'static,
{
    let transport = connect
        .await
        .with_context(|| format!("--transport {url}"))?;
    Ok(Arc::new(transport))
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
        Ok(Nats {
            url: url.to_owned(),
            transport: connect(url, NatsTransport::connect(config)).await?,
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

    async fn consume(&self, group: &str, run: ConsumerRun) -> anyhow::Result<ConsumerTask> {
        use outbox::consumer::nats::{NatsConsumerConfig, NatsSource};
        let mut config = NatsConsumerConfig::new(&self.stream, group);
        config.batch = run.fetch;
        config.runner = run.runner.clone();
        let options = outbox::consumer::source::ConsumeOptions::new(&config.runner, run.fetch);
        let source = NatsSource::new(self.transport.jetstream().clone(), config);
        Ok(run.run(source, options))
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

#[cfg(feature = "redis")]
mod redis_arm;

#[cfg(feature = "rabbitmq")]
mod rabbitmq_arm;

#[cfg(feature = "kafka")]
mod kafka_arm;

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
