//! RocketMQ push consumer feeding an [`Inbox`]: a consumer group in clustering mode (the
//! instances of a group share the topic's queues; each message goes to one of them).
//!
//! # Acknowledgement and retries
//! The client calls a concurrent listener (`MessageListenerConcurrently`) with up to
//! [`RocketMqConsumerConfig::batch`] messages of one queue (`consumeMessageBatchMaxSize`). The
//! listener hands the batch to the runner, which applies it with
//! [`deliver_batch`](crate::consumer::deliver_batch) and answers only afterwards, so a message
//! is consumed (`CONSUME_SUCCESS`, its offset committed) only after its inbox transaction
//! committed (shared case C27).
//!
//! A message whose delivery ends in [`Settle::Retry`] (a transient handler failure, the
//! inbox's own database failing, or a later message of a key whose earlier message failed) is
//! sent back to the broker (`CONSUMER_SEND_MSG_BACK`, the broker's own retry): the broker stores
//! it in the group's `%RETRY%<group>` topic with the delay level that is the smallest of
//! [`RocketMqConsumerConfig::delay_levels`] not shorter than the backoff's delay (RocketMQ's
//! levels `1s 5s 10s 30s 1m 2m … 2h`), and delivers it again with `reconsumeTimes + 1`: the
//! delivery count is `reconsumeTimes + 1`. The listener's context cannot carry a per-message
//! ack index or delay level in this client (it is passed by shared reference), so the runner
//! sends each failed message back itself and then answers `CONSUME_SUCCESS` for the batch; if
//! a send-back fails it answers `RECONSUME_LATER`, and the client sends the whole batch back
//! (messages already applied come back as duplicates and are acknowledged by the inbox).
//! The send-back carries `maxReconsumeTimes = i32::MAX`: the consumer's dead-letter table, at
//! [`RocketMqConsumerConfig::max_deliveries`], replaces RocketMQ's `%DLQ%` topic, so a database
//! outage never dead-letters a message.
//!
//! # Concurrency and per-key order
//! The client runs one listener call at a time for the runner (one consume thread,
//! `consumeThreadMin = consumeThreadMax = 1`): batches are applied one after the other in the
//! order the client pulled them, and within a batch (all from one queue) in
//! [`RocketMqConsumerConfig::concurrency`] lanes by partition key. With the transport's queue
//! selector, a key's messages share a queue, so per-key order holds across batches and lanes. A
//! message sent back for a retry is overtaken by later messages of its key that were not in
//! its batch (RocketMQ's concurrent consumption gives no order to retries); an application that
//! needs strict per-key order across failures should reject or dead-letter rather than fail
//! transiently. More throughput: run more instances of the group (each takes a share of the
//! queues), raise `batch` and `concurrency`.
//!
//! # Malformed messages
//! A message without `outbox-message-id` / `outbox-topic` properties (a foreign producer) is
//! logged, counted in [`ConsumerMetrics::malformed`] and consumed, never retried.
//!
//! A batch must be applied within [`LISTENER_TIMEOUT`] (RocketMQ's `consumeTimeout`, 15 min);
//! past it the client sends the batch back for a retry.
//!
//! The runner is the generic one ([`consume`]) over a [`RocketMqSource`]; it also performs the
//! consumer's [`maintenance`](crate::consumer::maintenance) (operator replays, inbox retention).

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;

use rocketmq_client_rust::{
    ClientResult, ClientRuntime, ConsumeConcurrentlyContext, ConsumeConcurrentlyStatus,
    DefaultMQPushConsumer, MQPushConsumer, MessageListenerConcurrently,
};
use rocketmq_model::common::consumer::consume_from_where::ConsumeFromWhere;
use rocketmq_model::common::message::STRING_HASH_SET;
use rocketmq_model::common::message::message_ext::MessageExt;
use tokio::sync::{Mutex, mpsc, oneshot};

use crate::consumer::source::{
    ConsumeOptions, Delivery, Envelope, Settle, Source, SourceConfig, SourceError,
};
use crate::consumer::{ConsumerMetrics, RunnerSettings};
use crate::error::ConfigError;
use crate::message::{Headers, InboundMessage};
use crate::transport::rocketmq::{
    Credentials, LISTENER_TIMEOUT, acl_hook, any_reachable, client_config, client_runtime,
    parse_name_servers, validate_group, validate_topic,
};

/// RocketMQ's default delay levels (`messageDelayLevel` of the broker):
/// `1s 5s 10s 30s 1m 2m 3m 4m 5m 6m 7m 8m 9m 10m 20m 30m 1h 2h`.
pub fn default_delay_levels() -> Vec<Duration> {
    [
        1, 5, 10, 30, 60, 120, 180, 240, 300, 360, 420, 480, 540, 600, 1200, 1800, 3600, 7200,
    ]
    .into_iter()
    .map(Duration::from_secs)
    .collect()
}

/// Settings of a RocketMQ consumer runner.
#[derive(Clone, derive_more::Debug)]
pub struct RocketMqConsumerConfig {
    /// Name server list `host:port[;host:port…]`. Required.
    pub name_server: String,
    /// Consumer group (clustering: the group's instances share the queues). Required; letters,
    /// digits, `%|_-`, at most 120 characters.
    pub group: String,
    /// Topic to subscribe to. Required.
    pub topic: String,
    /// Subscription expression: `*` or tags joined by `||` (`order-created || order-cancelled`).
    /// Default `*`.
    pub tags: String,
    /// Messages per listener call (`consumeMessageBatchMaxSize`, 1 to 1024). The client pulls
    /// `max(batch, 32)` messages per request. Default 32.
    pub batch: usize,
    /// Lanes, retries, dead letters, confirmations and inbox upkeep: the settings every
    /// runner shares ([`RunnerSettings`], with its defaults).
    /// Here `retry` delays are rounded up to a broker delay level (`delay_levels`).
    pub runner: RunnerSettings,
    /// Where a group that has no committed offset yet starts: `true` at the queues' first
    /// message (`CONSUME_FROM_FIRST_OFFSET`, nothing published before the group existed is
    /// missed), `false` at their end (`CONSUME_FROM_LAST_OFFSET`). Default true.
    pub from_first_offset: bool,
    /// The broker's delay levels (its `messageDelayLevel`), level 1 first. Default
    /// [`default_delay_levels`].
    #[debug(skip)]
    pub delay_levels: Vec<Duration>,
    /// How often the client refreshes topic routes from the name server
    /// (`pollNameServerInterval`, 10 s to 10 min); a consumer started before its topic exists
    /// receives nothing until the next refresh. Default 30 s (RocketMQ's).
    #[debug(skip)]
    pub route_refresh: Duration,
    /// ACL credentials. Default none.
    #[debug(skip)]
    pub credentials: Option<Credentials>,
    /// The client runtime. Default none: the process-wide
    /// [`client_runtime`](crate::transport::rocketmq::client_runtime).
    #[debug(skip)]
    pub runtime: Option<Arc<ClientRuntime>>,
}

crate::consumer::with_confirmations!(RocketMqConsumerConfig);

impl RocketMqConsumerConfig {
    /// Settings with the defaults.
    pub fn new(
        name_server: impl Into<String>,
        group: impl Into<String>,
        topic: impl Into<String>,
    ) -> Self {
        RocketMqConsumerConfig {
            name_server: name_server.into(),
            group: group.into(),
            topic: topic.into(),
            tags: "*".into(),
            batch: 32,
            runner: RunnerSettings::default(),
            from_first_offset: true,
            delay_levels: default_delay_levels(),
            route_refresh: Duration::from_secs(30),
            credentials: None,
            runtime: None,
        }
    }

    /// Check the settings without connecting.
    ///
    /// # Errors
    /// [`ConfigError`] naming the field: `name_server`, `group`, `topic`, `tags`, `batch`,
    /// `route_refresh`, `delay_levels`, or a `runner.*` field.
    pub fn validate(&self) -> Result<(), ConfigError> {
        parse_name_servers(&self.name_server).map_err(|r| ConfigError::new("name_server", r))?;
        validate_group(&self.group).map_err(|r| ConfigError::new("group", r))?;
        validate_topic(&self.topic).map_err(|r| ConfigError::new("topic", r))?;
        validate_tags(&self.tags).map_err(|r| ConfigError::new("tags", r))?;
        validate_batch(self.batch)?;
        self.runner.validate()?;
        validate_route_refresh(self.route_refresh)?;
        ConfigError::invalid_if(
            self.delay_levels.is_empty() || self.delay_levels.windows(2).any(|w| w[0] > w[1]),
            "delay_levels",
            "must be a non-empty list in increasing order (the broker's messageDelayLevel)",
        )?;
        Ok(())
    }
}

/// Check a push consumer's `batch` (`consumeMessageBatchMaxSize`): 1 to 1024 (the runner's and
/// the confirmation listener's).
///
/// # Errors
/// [`ConfigError`] naming `batch`.
pub(crate) fn validate_batch(batch: usize) -> Result<(), ConfigError> {
    ConfigError::invalid_if(
        !(1..=1024).contains(&batch),
        "batch",
        "must be between 1 and 1024",
    )?;
    Ok(())
}

/// Check a push consumer's `route_refresh` (`pollNameServerInterval`): 10 s to 10 min (the
/// runner's and the confirmation listener's).
///
/// # Errors
/// [`ConfigError`] naming `route_refresh`.
pub(crate) fn validate_route_refresh(route_refresh: Duration) -> Result<(), ConfigError> {
    ConfigError::invalid_if(
        !(Duration::from_secs(10)..=Duration::from_secs(600)).contains(&route_refresh),
        "route_refresh",
        "must be between 10 s and 10 min (the client's pollNameServerInterval bounds)",
    )?;
    Ok(())
}

/// Check a subscription expression: `*`, or non-empty tags without whitespace inside, joined by
/// `||`.
pub(crate) fn validate_tags(tags: &str) -> Result<(), String> {
    let t = tags.trim();
    if t == "*" {
        return Ok(());
    }
    let ok = !t.is_empty()
        && t.split("||").map(str::trim).all(|tag| {
            !tag.is_empty() && !tag.chars().any(|c| c.is_whitespace() || c.is_control())
        });
    if ok {
        Ok(())
    } else {
        Err(format!(
            "{tags:?} is not a tag expression: \"*\" or tags joined by \"||\""
        ))
    }
}

/// The 1-based delay level for `delay`: the first of `levels` not shorter than it, or the last.
pub fn delay_level(delay: Duration, levels: &[Duration]) -> i32 {
    let i = levels
        .iter()
        .position(|l| *l >= delay)
        .unwrap_or(levels.len().saturating_sub(1));
    i32::try_from(i + 1).unwrap_or(i32::MAX)
}

/// The user properties of `msg` (every property that is not a RocketMQ system property), as
/// headers.
pub fn user_properties(msg: &MessageExt) -> Headers {
    msg.properties()
        .iter()
        .filter(|(k, _)| !STRING_HASH_SET.contains(k.as_str()))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// The inbound message carried by `msg` (headers from its user properties, delivery count
/// `reconsumeTimes + 1`).
///
/// # Errors
/// The text of [`InboundMessage::from_wire`] for a message without the outbox properties.
pub fn inbound(msg: &MessageExt) -> Result<InboundMessage, String> {
    let delivered = u32::try_from(msg.reconsume_times().max(0))
        .unwrap_or(u32::MAX)
        .saturating_add(1);
    let body = msg.body().map(|b| b.to_vec()).unwrap_or_default();
    InboundMessage::from_wire(user_properties(msg), body, delivered)
}

/// One listener call handed to the runner: the batch and where to answer.
pub(crate) struct Job {
    pub(crate) messages: Vec<MessageExt>,
    pub(crate) reply: oneshot::Sender<ConsumeConcurrentlyStatus>,
}

/// The client's (synchronous) listener: it hands each batch to an async task and blocks its
/// blocking-lane thread until the task answers. If the task is gone, the batch is retried.
pub(crate) struct Bridge {
    tx: mpsc::Sender<Job>,
}

impl Bridge {
    /// A bridge and the receiving end of its batches.
    pub(crate) fn new() -> (Bridge, mpsc::Receiver<Job>) {
        let (tx, rx) = mpsc::channel(4);
        (Bridge { tx }, rx)
    }
}

impl MessageListenerConcurrently for Bridge {
    fn consume_message(
        &self,
        msgs: &[&MessageExt],
        _context: &ConsumeConcurrentlyContext,
    ) -> ClientResult<ConsumeConcurrentlyStatus> {
        let (reply, answer) = oneshot::channel();
        let job = Job {
            messages: msgs.iter().map(|m| (*m).clone()).collect(),
            reply,
        };
        if self.tx.blocking_send(job).is_err() {
            return Ok(ConsumeConcurrentlyStatus::ReconsumeLater);
        }
        Ok(answer
            .blocking_recv()
            .unwrap_or(ConsumeConcurrentlyStatus::ReconsumeLater))
    }
}

/// What a push consumer is started with.
pub(crate) struct PushSettings<'a> {
    pub(crate) name_server: &'a str,
    pub(crate) group: &'a str,
    pub(crate) topic: &'a str,
    pub(crate) tags: &'a str,
    pub(crate) batch: usize,
    pub(crate) from_first_offset: bool,
    pub(crate) route_refresh: Duration,
    pub(crate) credentials: Option<&'a Credentials>,
    pub(crate) runtime: Option<Arc<ClientRuntime>>,
    pub(crate) role: &'a str,
}

/// Start a push consumer (clustering, one consume thread) with `listener`.
///
/// # Errors
/// [`ConfigError`] naming `runtime`, `name_server` (no name server answers), `topic`/`tags` (the
/// subscription is refused) or `group` (the consumer cannot start).
pub(crate) async fn start_push_consumer(
    s: PushSettings<'_>,
    listener: Bridge,
) -> Result<DefaultMQPushConsumer, ConfigError> {
    let runtime = match s.runtime {
        Some(r) => r,
        None => client_runtime()?,
    };
    let servers =
        parse_name_servers(s.name_server).map_err(|r| ConfigError::new("name_server", r))?;
    ConfigError::invalid_if(
        !any_reachable(&servers, Duration::from_secs(3)).await,
        "name_server",
        format!(
            "no RocketMQ name server accepts connections at {}",
            s.name_server
        ),
    )?;
    let batch = u32::try_from(s.batch).unwrap_or(1024);
    let mut client = client_config(s.name_server, s.role, Duration::from_secs(3));
    client.poll_name_server_interval =
        u32::try_from(s.route_refresh.as_millis()).unwrap_or(u32::MAX);
    let mut builder = DefaultMQPushConsumer::builder(runtime)
        .client_config(client)
        .consumer_group(s.group)
        .consume_from_where(if s.from_first_offset {
            ConsumeFromWhere::ConsumeFromFirstOffset
        } else {
            ConsumeFromWhere::ConsumeFromLastOffset
        })
        .consume_thread_min(1)
        .consume_thread_max(1)
        .consume_message_batch_max_size(batch)
        .pull_batch_size(batch.max(32))
        .max_reconsume_times(i32::MAX)
        .consume_timeout(LISTENER_TIMEOUT.as_secs() / 60);
    if let Some(c) = s.credentials {
        builder = builder.rpc_hook(Some(acl_hook(c)));
    }
    let mut consumer = builder.build();
    consumer.subscribe(s.topic, s.tags).await.map_err(|e| {
        ConfigError::new(
            "topic",
            format!("cannot subscribe to {} with {:?}: {e}", s.topic, s.tags),
        )
    })?;
    consumer.register_message_listener_concurrently(listener);
    consumer.start().await.map_err(|e| {
        ConfigError::new(
            "group",
            format!(
                "cannot start the RocketMQ consumer of group {}: {e:?}",
                s.group
            ),
        )
    })?;
    Ok(consumer)
}

/// The RocketMQ [`Source`]: a push consumer whose listener hands each batch over and waits for
/// the answer (see the module docs). One fetch returns one listener call's batch; settling it
/// sends the failed messages back with their delay level and answers the listener.
pub struct RocketMqSource {
    settings: RocketMqConsumerConfig,
    role: &'static str,
    consumer: Option<Arc<Mutex<DefaultMQPushConsumer>>>,
    jobs: Option<mpsc::Receiver<Job>>,
    /// The answer of the batch fetched and not settled yet.
    reply: Option<oneshot::Sender<ConsumeConcurrentlyStatus>>,
}

impl RocketMqSource {
    /// A source for `config` (validated; nothing is contacted until [`Source::open`]).
    ///
    /// # Errors
    /// [`ConfigError`] naming the invalid field.
    pub fn new(config: RocketMqConsumerConfig) -> Result<Self, ConfigError> {
        config.validate()?;
        Ok(Self::unchecked(config, "consumer"))
    }

    /// A source for settings validated by the caller; `role` names the client in logs.
    pub(crate) fn unchecked(config: RocketMqConsumerConfig, role: &'static str) -> Self {
        RocketMqSource {
            settings: config,
            role,
            consumer: None,
            jobs: None,
            reply: None,
        }
    }
}

#[async_trait]
impl Source for RocketMqSource {
    type Token = MessageExt;

    fn describe(&self) -> String {
        format!(
            "RocketMQ topic {} ({}), group {}",
            self.settings.topic, self.settings.tags, self.settings.group
        )
    }

    /// Start the push consumer once: the client reconnects and rebalances by itself.
    async fn open(&mut self) -> Result<(), SourceError> {
        if self.consumer.is_some() {
            return Ok(());
        }
        let c = &self.settings;
        let (bridge, jobs) = Bridge::new();
        let consumer = start_push_consumer(
            PushSettings {
                name_server: &c.name_server,
                group: &c.group,
                topic: &c.topic,
                tags: &c.tags,
                batch: c.batch,
                from_first_offset: c.from_first_offset,
                route_refresh: c.route_refresh,
                credentials: c.credentials.as_ref(),
                runtime: c.runtime.clone(),
                role: self.role,
            },
            bridge,
        )
        .await?;
        self.consumer = Some(Arc::new(Mutex::new(consumer)));
        self.jobs = Some(jobs);
        Ok(())
    }

    async fn fetch(&mut self, _max: usize) -> Result<Vec<Delivery<MessageExt>>, SourceError> {
        let jobs = self
            .jobs
            .as_mut()
            .ok_or_else(|| SourceError::Lost("not started".into()))?;
        let Some(job) = jobs.recv().await else {
            return Err(SourceError::Lost("the push consumer stopped".into()));
        };
        if let Some(stale) = self.reply.replace(job.reply) {
            let _ = stale.send(ConsumeConcurrentlyStatus::ReconsumeLater);
        }
        Ok(job
            .messages
            .into_iter()
            .map(|m| {
                let delivery_count = u32::try_from(m.reconsume_times().max(0))
                    .unwrap_or(u32::MAX)
                    .saturating_add(1);
                Delivery {
                    envelope: Envelope {
                        headers: user_properties(&m),
                        payload: m.body().map(|b| b.to_vec()).unwrap_or_default(),
                        delivery_count,
                        origin: format!("topic {}, msg id {}", m.topic(), m.msg_id()),
                    },
                    token: m,
                }
            })
            .collect())
    }

    async fn settle(
        &mut self,
        batch: Vec<(Delivery<MessageExt>, Settle)>,
    ) -> Result<(), SourceError> {
        let mut status = ConsumeConcurrentlyStatus::ConsumeSuccess;
        if let Some(consumer) = &self.consumer {
            for (d, s) in batch {
                let Settle::Retry(delay) = s else { continue };
                let level = delay_level(delay, &self.settings.delay_levels);
                let m = d.token;
                let broker = m.broker_name().to_owned();
                if let Err(e) = consumer
                    .lock()
                    .await
                    .send_message_back(m, level, &broker)
                    .await
                {
                    tracing::warn!(error = %e, origin = %d.envelope.origin, "send-back for a retry failed; the client retries the batch");
                    status = ConsumeConcurrentlyStatus::ReconsumeLater;
                }
            }
        }
        if let Some(reply) = self.reply.take() {
            let _ = reply.send(status);
        }
        Ok(())
    }

    /// Stop pulling, answer the batches handed over meanwhile with "later" (the broker delivers
    /// them again), and shut the consumer down.
    async fn close(&mut self) {
        if let Some(reply) = self.reply.take() {
            let _ = reply.send(ConsumeConcurrentlyStatus::ReconsumeLater);
        }
        let Some(consumer) = self.consumer.take() else {
            return;
        };
        let mut shutdown = tokio::spawn(async move {
            let mut c = consumer.lock().await;
            c.suspend().await;
            c.shutdown().await;
        });
        let Some(mut jobs) = self.jobs.take() else {
            let _ = shutdown.await;
            return;
        };
        loop {
            tokio::select! {
                job = jobs.recv() => match job {
                    Some(job) => {
                        let _ = job.reply.send(ConsumeConcurrentlyStatus::ReconsumeLater);
                    }
                    None => {
                        let _ = (&mut shutdown).await;
                        return;
                    }
                },
                _ = &mut shutdown => return,
            }
        }
    }
}

// This broker's consumer is the generic runner over its source: `rocketmq::run(config, …)`.
pub use crate::consumer::run;

/// [`run`] consumes with a [`RocketMqSource`] built from these settings.
///
/// # Errors of `run`
/// [`ConfigError`] naming the invalid field ([`RocketMqConsumerConfig::validate`]), or
/// `name_server`, `topic` or `group` when the consumer cannot subscribe or start. Later errors
/// (pulls, send-backs) are logged; the client retries them.
impl SourceConfig for RocketMqConsumerConfig {
    type Source = RocketMqSource;

    fn options(&self) -> ConsumeOptions {
        ConsumeOptions::new(&self.runner, self.batch)
    }

    fn into_source(self, _metrics: &Arc<ConsumerMetrics>) -> Result<RocketMqSource, ConfigError> {
        RocketMqSource::new(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delay_levels_round_up() {
        let l = default_delay_levels();
        assert_eq!(delay_level(Duration::ZERO, &l), 1);
        assert_eq!(delay_level(Duration::from_millis(500), &l), 1);
        assert_eq!(delay_level(Duration::from_secs(1), &l), 1);
        assert_eq!(delay_level(Duration::from_millis(1001), &l), 2);
        assert_eq!(delay_level(Duration::from_secs(45), &l), 5);
        assert_eq!(delay_level(Duration::from_secs(99_999), &l), 18);
    }

    #[test]
    fn config_and_tags_validate() {
        let c = RocketMqConsumerConfig::new("127.0.0.1:9876", "billing", "Orders");
        c.validate().unwrap();
        let mut bad = c.clone();
        bad.topic = "orders.created".into();
        assert_eq!(bad.validate().unwrap_err().field, "topic");
        let mut bad = c.clone();
        bad.batch = 0;
        assert_eq!(bad.validate().unwrap_err().field, "batch");
        let mut bad = c.clone();
        bad.tags = "a || ".into();
        assert_eq!(bad.validate().unwrap_err().field, "tags");
        let mut bad = c;
        bad.delay_levels = vec![Duration::from_secs(5), Duration::from_secs(1)];
        assert_eq!(bad.validate().unwrap_err().field, "delay_levels");
        assert!(validate_tags("order-created || order-cancelled").is_ok());
        assert!(validate_tags("*").is_ok());
        assert!(validate_tags("").is_err());
    }
}
