//! RabbitMQ consumer runner feeding an [`Inbox`]: `basic.consume` with manual acknowledgement and
//! a prefetch of [`RabbitMqConsumerConfig::batch`].
//!
//! Deliveries are gathered into a batch (the first one, then whatever else arrives within
//! [`RabbitMqConsumerConfig::batch_wait`], up to `batch`) and applied through
//! [`deliver_batch`](crate::consumer::deliver_batch) in `concurrency` lanes by partition key:
//! different keys in parallel, one key's messages in queue order. Each message is acknowledged
//! (`basic.ack`) only after its inbox transaction committed and its verdict was confirmed to the
//! producer (shared case C27: nothing is acknowledged that was not stored). A message whose ack was
//! lost (the connection dropped after the commit) is redelivered by RabbitMQ and recognised by the
//! inbox as a duplicate.
//!
//! # Redelivery with backoff (RabbitMQ 3.10 and later)
//! RabbitMQ has no delayed redelivery of its own (`basic.nack` with `requeue` redelivers at once),
//! so a message whose handler failed transiently is moved to a **retry queue** that dead-letters
//! it back (<https://www.rabbitmq.com/docs/ttl>, <https://www.rabbitmq.com/docs/dlx>):
//! - the delay from [`Backoff`](crate::Backoff) (by delivery count) is rounded to the nearest step of the
//!   1-2-5 series (10 ms, 20 ms, 50 ms, 100 ms, … 1 s, 2 s, 5 s, 10 s, …), see [`retry_tier`];
//! - each step has its own durable queue `<queue>.retry.<ms>` with `x-message-ttl = <ms>`,
//!   `x-dead-letter-exchange = ""` and `x-dead-letter-routing-key = <queue>`, declared by the
//!   runner when first needed. One TTL per queue means messages expire in arrival order: a long
//!   delay never holds a short one back (the trap of per-message TTL, which only expires messages
//!   at the head of a queue);
//! - the runner publishes a copy to the retry queue (publisher confirm, same properties, header
//!   [`HEADER_DELIVERY_COUNT`] incremented) and acknowledges the original only after the broker
//!   confirmed the copy. If the copy cannot be published, the original is rejected with
//!   `requeue` after a pause of the delay (at most 5 s), so it comes back at once.
//!
//! The delivery count handed to the inbox is `outbox-delivery-count` (1 when absent) plus
//! RabbitMQ's own count of failed deliveries: the quorum queues' `x-delivery-count` header, or 1
//! when a classic queue marks the delivery `redelivered` (a consumer died before its ack). So a
//! handler that keeps failing reaches `max_deliveries` and the message goes to the consumer's
//! dead-letter table ([`deliver`](crate::consumer::deliver)), acknowledged.
//!
//! Per-key order: messages held behind a failing message of their key in a batch take the same
//! retry queue, in order, so they come back in order; messages of that key arriving later may
//! overtake them (as with any broker's delayed redelivery).
//!
//! A message without the outbox headers (`outbox-message-id`, `outbox-topic`) is logged, counted in
//! [`ConsumerMetrics::malformed`] and rejected without requeue (to the queue's own dead-letter
//! exchange, if it has one); it never blocks the queue.
//!
//! The runner reconnects with backoff when the connection or channel is lost (the broker
//! redelivers what was not acknowledged), and performs the consumer's
//! [`maintenance`](crate::consumer::maintenance) (operator replays, inbox retention).

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use futures::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicQosOptions, BasicRejectOptions, QueueBindOptions,
    QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel};

use crate::consumer::source::{
    ConsumeOptions, Delivery, Envelope, Settle, Source, SourceConfig, SourceError,
};
use crate::consumer::{ConsumerMetrics, RunnerSettings};
use crate::error::ConfigError;
use crate::message::Headers;
use crate::transport::rabbitmq::{
    Link, Publication, RabbitMqConfig, Session, connection_lost, received_headers,
};

/// Header the runner sets on the copy it moves to a retry queue: the number of the next delivery
/// (2 for the first retry).
pub const HEADER_DELIVERY_COUNT: &str = "outbox-delivery-count";

/// The queue to declare (durable) and bind at start, when the runner owns it.
#[derive(Debug, Clone, Default)]
pub struct QueueSetup {
    /// `(exchange, binding key)` pairs to bind the queue to. Default: none.
    pub bindings: Vec<(String, String)>,
    /// Declare a quorum queue (`x-queue-type = quorum`, replicated; RabbitMQ counts redeliveries
    /// in `x-delivery-count`) instead of a classic one. Default false.
    pub quorum: bool,
}

/// Settings of a RabbitMQ consumer runner.
#[derive(Debug, Clone)]
pub struct RabbitMqConsumerConfig {
    /// Connection settings (URL, credentials, TLS, timeouts). Required.
    pub connection: RabbitMqConfig,
    /// Queue to consume. Required; at most 230 bytes (its retry queues add `.retry.<ms>`).
    pub queue: String,
    /// Declare and bind the queue at start; `None` (default) only checks that it exists.
    pub declare: Option<QueueSetup>,
    /// Prefetch (`basic.qos`) and largest batch applied at once. Default 100.
    pub batch: u16,
    /// After the first delivery of a batch, how long at most to wait for more (the batch is
    /// applied at this deadline or when full, whichever comes first). Default 10 ms.
    pub batch_wait: Duration,
    /// Lanes, retries, dead letters, confirmations and inbox upkeep: the settings every
    /// runner shares ([`RunnerSettings`], with its defaults).
    /// Here `retry` delays are rounded by [`retry_tier`] (one retry queue per tier).
    pub runner: RunnerSettings,
}

crate::consumer::with_confirmations!(RabbitMqConsumerConfig);

impl RabbitMqConsumerConfig {
    /// Settings consuming `queue` over `connection`, with the defaults.
    pub fn new(connection: RabbitMqConfig, queue: impl Into<String>) -> Self {
        RabbitMqConsumerConfig {
            connection,
            queue: queue.into(),
            declare: None,
            batch: 100,
            batch_wait: Duration::from_millis(10),
            runner: RunnerSettings::default(),
        }
    }

    /// Check the settings without connecting.
    ///
    /// # Errors
    /// [`ConfigError`] naming `queue`, `batch`, a `runner.*` or a `connection.*` field.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.connection
            .validate()
            .map_err(|e| ConfigError::new(format!("connection.{}", e.field), e.reason))?;
        ConfigError::invalid_if(
            self.queue.is_empty() || self.queue.len() > 230,
            "queue",
            "must be 1 to 230 bytes (its retry queues add .retry.<ms>)",
        )?;
        ConfigError::invalid_if(
            self.queue.chars().any(char::is_control),
            "queue",
            "must not have control characters",
        )?;
        ConfigError::invalid_if(self.batch == 0, "batch", "must be at least 1")?;
        self.runner.validate()?;
        Ok(())
    }
}

/// The retry delay actually used for `delay`: the nearest (in ratio) step of the 1-2-5 series in
/// milliseconds, at least 10 ms and at most `u32::MAX` ms (RabbitMQ's largest TTL). Each step is
/// one retry queue, so the number of retry queues stays small whatever the jitter.
pub fn retry_tier(delay: Duration) -> Duration {
    let ms = (delay.as_secs_f64() * 1000.0).clamp(10.0, f64::from(u32::MAX));
    let decade = 10f64.powf(ms.log10().floor());
    let best = [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|c| c * decade)
        .min_by(|a, b| {
            let da = (a.ln() - ms.ln()).abs();
            let db = (b.ln() - ms.ln()).abs();
            da.total_cmp(&db)
        })
        .unwrap_or(ms);
    Duration::from_millis(best.min(f64::from(u32::MAX)).round() as u64)
}

/// The name of the retry queue of `queue` for `tier`.
pub fn retry_queue(queue: &str, tier: Duration) -> String {
    format!("{queue}.retry.{}", tier.as_millis())
}

/// The delivery count of a delivery (see the module docs).
fn delivery_count(headers: &Headers, redelivered: bool) -> u32 {
    let num = |k: &str| headers.get(k).and_then(|v| v.parse::<u32>().ok());
    let ours = num(HEADER_DELIVERY_COUNT).unwrap_or(1).max(1);
    let broker = num("x-delivery-count").unwrap_or(u32::from(redelivered));
    ours.saturating_add(broker)
}

/// Headers RabbitMQ adds when dead-lettering or redelivering, left out of a retry copy.
fn broker_header(name: &str) -> bool {
    name == "x-delivery-count"
        || name == "x-death"
        || name.starts_with("x-first-death-")
        || name.starts_with("x-last-death-")
}

/// The properties of the retry copy of `p`: the same, with the next delivery count.
fn retry_properties(p: &BasicProperties, next: u32) -> BasicProperties {
    let mut t = FieldTable::default();
    if let Some(h) = p.headers() {
        for (k, v) in h.inner() {
            if !broker_header(k.as_str()) {
                t.insert(k.clone(), v.clone());
            }
        }
    }
    t.insert(
        ShortString::from(HEADER_DELIVERY_COUNT),
        AMQPValue::LongString(LongString::from(next.to_string())),
    );
    p.clone().with_headers(t)
}

/// The open session of a [`RabbitMqSource`]: the connection, the consuming channel and its
/// consumer.
struct Open {
    session: Arc<Session>,
    consumer: lapin::Consumer,
    /// Retry queues declared in this session, by TTL in ms.
    tiers: HashSet<u128>,
}

/// The RabbitMQ [`Source`]: `basic.consume` on `config.queue` with manual acknowledgement;
/// redelivery with backoff through retry queues (see the module docs).
pub struct RabbitMqSource {
    link: Link,
    config: RabbitMqConsumerConfig,
    open: Option<Open>,
    /// Why the consumer ended while a batch was being gathered: returned by the next fetch.
    lost: Option<String>,
}

/// What settling a RabbitMQ delivery needs: its acker and its properties (for a retry copy).
pub struct RabbitMqToken {
    acker: lapin::Acker,
    properties: BasicProperties,
}

impl RabbitMqSource {
    /// A source for `config` (validated; nothing is contacted until [`Source::open`]).
    ///
    /// # Errors
    /// [`ConfigError`] naming the invalid field.
    pub fn new(config: RabbitMqConsumerConfig) -> Result<Self, ConfigError> {
        config.validate()?;
        let link = Link::new(config.connection.clone())
            .map_err(|e| ConfigError::new(format!("connection.{}", e.field), e.reason))?;
        Ok(RabbitMqSource {
            link,
            config,
            open: None,
            lost: None,
        })
    }
}

/// Map a set-up error: a lost connection is reconnected, anything else is a configuration problem
/// of `field`.
fn refusal(e: &lapin::Error, field: &str, text: String) -> SourceError {
    if connection_lost(e) {
        SourceError::Lost(format!("{text}: {e}"))
    } else {
        SourceError::Config(ConfigError::new(field, format!("{text}: {e}")))
    }
}

/// Declare and bind the queue, or check that it exists.
async fn set_up(ch: &Channel, config: &RabbitMqConsumerConfig) -> Result<(), SourceError> {
    let name = |s: &str, field: &str| {
        ShortString::try_new(s).map_err(|_| {
            SourceError::Config(ConfigError::new(
                field,
                format!("{s:?} is longer than 255 bytes"),
            ))
        })
    };
    let queue = name(&config.queue, "queue")?;
    match &config.declare {
        Some(setup) => {
            let mut args = FieldTable::default();
            if setup.quorum {
                args.insert(
                    "x-queue-type".into(),
                    AMQPValue::LongString(LongString::from("quorum")),
                );
            }
            ch.queue_declare(queue.clone(), QueueDeclareOptions::durable(), args)
                .await
                .map_err(|e| refusal(&e, "queue", format!("cannot declare queue {queue:?}")))?;
            for (exchange, key) in &setup.bindings {
                ch.queue_bind(
                    queue.clone(),
                    name(exchange, "declare.bindings")?,
                    name(key, "declare.bindings")?,
                    QueueBindOptions::default(),
                    FieldTable::default(),
                )
                .await
                .map_err(|e| {
                    refusal(
                        &e,
                        "declare.bindings",
                        format!(
                            "cannot bind queue {queue:?} to exchange {exchange:?} with key {key:?}"
                        ),
                    )
                })?;
            }
        }
        None => {
            let passive = QueueDeclareOptions {
                passive: true,
                ..QueueDeclareOptions::default()
            };
            ch.queue_declare(queue.clone(), passive, FieldTable::default())
                .await
                .map_err(|e| {
                    refusal(
                        &e,
                        "queue",
                        format!("queue {queue:?} does not exist (declare it, or set `declare`)"),
                    )
                })?;
        }
    }
    Ok(())
}

#[async_trait]
impl Source for RabbitMqSource {
    type Token = RabbitMqToken;

    fn describe(&self) -> String {
        format!(
            "RabbitMQ queue {} at {}",
            self.config.queue,
            self.link.describe()
        )
    }

    async fn open(&mut self) -> Result<(), SourceError> {
        self.open = None;
        self.lost = None;
        let config = &self.config;
        let session = self
            .link
            .session()
            .await
            .map_err(|e| ConfigError::new("connection.url", e.report()))?;
        let ch = session
            .conn
            .create_channel()
            .await
            .map_err(|e| SourceError::Lost(format!("cannot open a channel: {e}")))?;
        set_up(&ch, config).await?;
        ch.basic_qos(config.batch, BasicQosOptions::default())
            .await
            .map_err(|e| SourceError::Lost(format!("basic.qos failed: {e}")))?;
        let consumer = ch
            .basic_consume(
                config.queue.as_str().into(),
                "".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(|e| {
                refusal(
                    &e,
                    "queue",
                    format!("cannot consume queue {:?}", config.queue),
                )
            })?;
        self.open = Some(Open {
            session,
            consumer,
            tiers: HashSet::new(),
        });
        Ok(())
    }

    async fn fetch(&mut self, max: usize) -> Result<Vec<Delivery<Self::Token>>, SourceError> {
        if let Some(reason) = self.lost.take() {
            return Err(SourceError::Lost(reason));
        }
        let open = self
            .open
            .as_mut()
            .ok_or_else(|| SourceError::Lost("not open".into()))?;
        let ended = |e: Option<lapin::Error>| match e {
            Some(e) => format!("consumer failed: {e}"),
            None => "the broker cancelled the consumer".to_owned(),
        };
        let first = match open.consumer.next().await {
            Some(Ok(d)) => d,
            Some(Err(e)) => return Err(SourceError::Lost(ended(Some(e)))),
            None => return Err(SourceError::Lost(ended(None))),
        };
        let mut batch = vec![first];
        // At most `batch_wait` after the first delivery, whatever the arrival pace.
        let deadline = tokio::time::Instant::now() + self.config.batch_wait;
        let max = max.min(usize::from(self.config.batch));
        while batch.len() < max {
            match tokio::time::timeout_at(deadline, open.consumer.next()).await {
                Ok(Some(Ok(d))) => batch.push(d),
                Ok(Some(Err(e))) => {
                    self.lost = Some(ended(Some(e)));
                    break;
                }
                Ok(None) => {
                    self.lost = Some(ended(None));
                    break;
                }
                Err(_) => break,
            }
        }
        let queue = &self.config.queue;
        Ok(batch
            .into_iter()
            .map(|d| {
                let headers = received_headers(d.properties.headers().as_ref());
                let delivery_count = delivery_count(&headers, d.redelivered);
                Delivery {
                    envelope: Envelope {
                        headers,
                        payload: d.data,
                        delivery_count,
                        origin: format!(
                            "queue {queue}, exchange {}, routing key {}",
                            d.exchange, d.routing_key
                        ),
                    },
                    token: RabbitMqToken {
                        acker: d.acker,
                        properties: d.properties,
                    },
                }
            })
            .collect())
    }

    async fn settle(
        &mut self,
        batch: Vec<(Delivery<Self::Token>, Settle)>,
    ) -> Result<(), SourceError> {
        let mut retries = Vec::new();
        for (d, s) in batch {
            match s {
                Settle::Ack => {
                    if let Err(e) = d.token.acker.ack(BasicAckOptions::default()).await {
                        // The verdict is committed; a redelivery will be recognised as a duplicate.
                        tracing::warn!(error = %e, origin = %d.envelope.origin, "ack failed after commit");
                    }
                }
                Settle::Reject(_) => {
                    let reject = BasicRejectOptions { requeue: false };
                    if let Err(e) = d.token.acker.reject(reject).await {
                        tracing::warn!(error = %e, "reject failed; the broker will redeliver it");
                    }
                }
                Settle::Retry(delay) => retries.push((d, delay)),
            }
        }
        if retries.is_empty() {
            return Ok(());
        }
        let open = self
            .open
            .as_mut()
            .ok_or_else(|| SourceError::Lost("not open".into()))?;
        // Move each failed message to the retry queue of its delay, then acknowledge the original.
        let queue = &self.config.queue;
        let mut destinations = Vec::with_capacity(retries.len());
        let mut declared = Vec::with_capacity(retries.len());
        for (_, delay) in &retries {
            let tier = retry_tier(*delay);
            declared.push(ensure_tier(&open.session, queue, tier, &mut open.tiers).await);
            destinations.push(format!("/{}", retry_queue(queue, tier)));
        }
        let pubs: Vec<Publication<'_>> = retries
            .iter()
            .zip(&destinations)
            .map(|((d, _), dest)| Publication {
                destination: dest,
                payload: &d.envelope.payload,
                properties: retry_properties(&d.token.properties, d.envelope.delivery_count + 1),
            })
            .collect();
        let published = self.link.publish(&pubs).await;
        let mut paused = false;
        for (((d, delay), r), declared) in retries.iter().zip(published).zip(declared) {
            match declared.and(r.map_err(|e| e.report())) {
                Ok(()) => {
                    if let Err(e) = d.token.acker.ack(BasicAckOptions::default()).await {
                        tracing::warn!(error = %e, origin = %d.envelope.origin, "ack of a message moved to its retry queue failed; it will be delivered again");
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, origin = %d.envelope.origin, "cannot move the message to its retry queue; requeueing it");
                    if !paused {
                        tokio::time::sleep((*delay).min(Duration::from_secs(5))).await;
                        paused = true;
                    }
                    let _ = d
                        .token
                        .acker
                        .reject(BasicRejectOptions { requeue: true })
                        .await;
                }
            }
        }
        Ok(())
    }
}

// This broker's consumer is the generic runner over its source: `rabbitmq::run(config, …)`.
pub use crate::consumer::run;

/// [`run`] consumes with a [`RabbitMqSource`] built from these settings.
///
/// # Errors of `run`
/// [`ConfigError`] naming the field when the settings are invalid, or when the first connection
/// fails (`connection.url`) or the queue is missing or cannot be declared (`queue`). Later errors
/// (connection lost, channel closed) are logged and the runner reconnects with backoff.
impl SourceConfig for RabbitMqConsumerConfig {
    type Source = RabbitMqSource;

    fn options(&self) -> ConsumeOptions {
        ConsumeOptions::new(&self.runner, usize::from(self.batch))
    }

    fn into_source(self, _metrics: &Arc<ConsumerMetrics>) -> Result<RabbitMqSource, ConfigError> {
        RabbitMqSource::new(self)
    }
}

/// Declare the retry queue of `queue` for `tier` once per session.
async fn ensure_tier(
    s: &Session,
    queue: &str,
    tier: Duration,
    declared: &mut HashSet<u128>,
) -> Result<(), String> {
    let ms = tier.as_millis();
    if declared.contains(&ms) {
        return Ok(());
    }
    let name = retry_queue(queue, tier);
    let ch = s
        .conn
        .create_channel()
        .await
        .map_err(|e| format!("cannot open a channel to declare {name:?}: {e}"))?;
    let mut args = FieldTable::default();
    args.insert(
        "x-message-ttl".into(),
        AMQPValue::LongLongInt(i64::try_from(ms).unwrap_or(i64::MAX)),
    );
    args.insert(
        "x-dead-letter-exchange".into(),
        AMQPValue::LongString(LongString::from("")),
    );
    args.insert(
        "x-dead-letter-routing-key".into(),
        AMQPValue::LongString(LongString::from(queue)),
    );
    ch.queue_declare(name.as_str().into(), QueueDeclareOptions::durable(), args)
        .await
        .map_err(|e| format!("cannot declare retry queue {name:?}: {e}"))?;
    let _ = ch.close(200, "declared".into()).await;
    declared.insert(ms);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_tiers_follow_the_1_2_5_series() {
        let ms = |m: u64| retry_tier(Duration::from_millis(m)).as_millis();
        assert_eq!(ms(0), 10);
        assert_eq!(ms(50), 50);
        assert_eq!(ms(400), 500);
        assert_eq!(ms(500), 500);
        assert_eq!(ms(800), 1000);
        assert_eq!(ms(1000), 1000);
        assert_eq!(ms(1300), 1000);
        assert_eq!(ms(1600), 2000);
        assert_eq!(ms(4000), 5000);
        assert_eq!(ms(60_000), 50_000);
        // Jittered delays of one backoff step share one or two queues.
        let tiers: HashSet<u128> = (0..100).map(|j| ms(400 + j)).collect();
        assert!(tiers.len() <= 2, "{tiers:?}");
        assert_eq!(retry_queue("q", Duration::from_millis(500)), "q.retry.500");
    }

    #[test]
    fn delivery_count_adds_broker_redeliveries() {
        let mut h = Headers::new();
        assert_eq!(delivery_count(&h, false), 1);
        assert_eq!(delivery_count(&h, true), 2);
        h.insert(HEADER_DELIVERY_COUNT.into(), "3".into());
        assert_eq!(delivery_count(&h, false), 3);
        assert_eq!(delivery_count(&h, true), 4);
        h.insert("x-delivery-count".into(), "2".into());
        assert_eq!(delivery_count(&h, true), 5);
        h.insert(HEADER_DELIVERY_COUNT.into(), "junk".into());
        assert_eq!(delivery_count(&h, false), 3);
    }

    #[test]
    fn retry_copies_drop_broker_headers_and_count_up() {
        let mut t = FieldTable::default();
        t.insert("traceparent".into(), AMQPValue::LongString("tp".into()));
        t.insert("x-death".into(), AMQPValue::FieldArray(Default::default()));
        t.insert("x-delivery-count".into(), AMQPValue::LongLongInt(1));
        let p = BasicProperties::default()
            .with_headers(t)
            .with_message_id("m".into());
        let r = retry_properties(&p, 2);
        let h = received_headers(r.headers().as_ref());
        assert_eq!(h.get("traceparent").map(String::as_str), Some("tp"));
        assert_eq!(h.get(HEADER_DELIVERY_COUNT).map(String::as_str), Some("2"));
        assert!(!h.contains_key("x-delivery-count"));
        assert_eq!(r.message_id().as_ref().map(|s| s.as_str()), Some("m"));
        let mut c = RabbitMqConsumerConfig::new(RabbitMqConfig::new("amqp://h"), "");
        assert_eq!(c.validate().unwrap_err().field, "queue");
        c.queue = "q".into();
        c.batch = 0;
        assert_eq!(c.validate().unwrap_err().field, "batch");
        c.batch = 1;
        c.connection.url = "http://x".into();
        assert_eq!(c.validate().unwrap_err().field, "connection.url");
    }
}
