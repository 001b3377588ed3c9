//! Kafka consumer-group runner feeding an [`Inbox`] (feature `kafka`).
//!
//! # Flow
//! 1. Fetch a batch: wait for one record, then take whatever else arrives within `batch_wait`,
//!    up to `batch` records (librdkafka prefetches in the background).
//! 2. Decode each record with [`InboundMessage::from_wire`] from its headers (`outbox-message-id`,
//!    `outbox-topic`, …). A record without them is **malformed**: logged with its topic,
//!    partition and offset, counted in [`ConsumerMetrics::malformed`], and skipped (its offset is
//!    committed like an acknowledged record, so it never blocks its partition).
//! 3. Apply the batch with [`deliver_batch`](crate::consumer::deliver_batch) in `concurrency` lanes by partition key: different
//!    keys in parallel, one key's records in offset order.
//! 4. Commit offsets **only after** the inbox transactions committed. Kafka commits one offset per
//!    partition ("everything below this is done"), so a partition's commit stops at its lowest
//!    record that was not acknowledged: records after it that were applied are delivered again
//!    later and recognised by the inbox as duplicates (acknowledged without running the handler).
//!    Commits are asynchronous (a lost commit only means such a redelivery); on shutdown the last
//!    offsets are committed synchronously.
//!
//! # Redelivery with backoff, in order
//! Kafka has no per-record negative acknowledgement. When a record's disposition is
//! [`Settle::Retry`] (transient handler failure, inbox database down), the runner **pauses
//! its partition**, seeks it back to that record's offset, and resumes it when the record's
//! backoff delay has passed ([`DeliveryPolicy::retry`] by delivery count); the record and
//! everything after it in that partition are then fetched again. Other partitions keep flowing
//! meanwhile. The cost: other keys of the paused partition wait for the delay too (Kafka's order
//! unit is the partition). Delivery counts are kept in the runner's memory per
//! (topic, partition, offset): a restart or a rebalance gives the record a fresh count. After
//! `max_deliveries` the record goes to the consumer's dead-letter table (see
//! [`deliver`](crate::consumer::deliver)) and the partition moves on.
//!
//! A record fetched for a partition that is still paused (prefetched before the pause; librdkafka
//! normally purges these on seek) is dropped without being applied or committed, and a resumed
//! partition whose first record is not the one it was sought back to is sought again, so a seek
//! that librdkafka lost cannot skip a record.
//!
//! # Settings forced on the consumer
//! `enable.auto.commit=false`, `enable.auto.offset.store=false`, `enable.partition.eof=false`,
//! `group.id`, `auto.offset.reset` from the config; `session.timeout.ms` from the config unless the
//! properties set it. Rebalances use librdkafka's default
//! (eager) protocol; partitions revoked in the middle of a batch lose their commit, and their
//! records are redelivered to the new owner (the inbox absorbs the copies).
//!
//! The runner is the generic one ([`consume`]) over a [`KafkaSource`]; it also performs the
//! consumer's [`maintenance`](crate::consumer::maintenance) (operator replays, inbox retention).

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;

use rdkafka::consumer::{
    BaseConsumer, CommitMode, Consumer, ConsumerContext, Rebalance, StreamConsumer,
};
use rdkafka::error::{KafkaError, KafkaResult};
use rdkafka::message::{Headers as _, Message as _, OwnedMessage};
use rdkafka::{ClientContext, Offset, TopicPartitionList};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::consumer::source::{
    ConsumeOptions, Delivery, Envelope, Settle, Source, SourceConfig, SourceError,
};
use crate::consumer::{ConsumerMetrics, RunnerSettings};
use crate::error::ConfigError;
use crate::message::Headers;
use crate::transport::kafka::{KafkaConfig, config_error};

/// Default `session.timeout.ms` of the runner and the confirmation listener: 10 s.
pub const DEFAULT_SESSION_TIMEOUT: Duration = Duration::from_secs(10);

/// Settings of a Kafka consumer runner.
#[derive(Clone, derive_more::Debug)]
pub struct KafkaConsumerConfig {
    /// Connection settings (bootstrap servers, SASL, TLS, shared librdkafka properties). Required.
    pub client: KafkaConfig,
    /// `group.id`: instances with the same group share the partitions. Required.
    pub group_id: String,
    /// Topics to subscribe to; each must exist when the runner starts. Required.
    pub topics: Vec<String>,
    /// Most records per batch. Default 100.
    pub batch: usize,
    /// After the first record of a batch, how long to wait for more before applying it.
    /// Default 20 ms.
    #[debug(skip)]
    pub batch_wait: Duration,
    /// Lanes, retries, dead letters, confirmations and inbox upkeep: the settings every
    /// runner shares ([`RunnerSettings`], with its defaults).
    /// Here `retry` pauses the record's partition for the delay.
    pub runner: RunnerSettings,
    /// `auto.offset.reset` for a group without committed offsets: `earliest` or `latest`.
    /// Default `earliest` (a new group starts from the oldest record, so nothing published
    /// before its first start is skipped).
    #[debug(skip)]
    pub auto_offset_reset: String,
    /// `session.timeout.ms`: how long the group coordinator waits for a silent member before it
    /// moves its partitions to the others. Default 10 s ([`DEFAULT_SESSION_TIMEOUT`]; librdkafka's
    /// own default is 45 s). Shorter means faster failover after a crash, and a faster first join
    /// on Tansu, whose coordinator holds a new group's first join for about half of it.
    #[debug(skip)]
    pub session_timeout: Duration,
    /// Extra librdkafka properties for this consumer only (e.g. `session.timeout.ms`), applied
    /// after [`KafkaConfig::properties`]. The forced settings above cannot be overridden.
    /// Default empty.
    #[debug(skip)]
    pub properties: BTreeMap<String, String>,
}

crate::consumer::with_confirmations!(KafkaConsumerConfig);

impl KafkaConsumerConfig {
    /// Settings for group `group_id` on `topics` with the defaults.
    pub fn new(
        client: KafkaConfig,
        group_id: impl Into<String>,
        topics: impl IntoIterator<Item = impl Into<String>>,
    ) -> Self {
        KafkaConsumerConfig {
            client,
            group_id: group_id.into(),
            topics: topics.into_iter().map(Into::into).collect(),
            batch: 100,
            batch_wait: Duration::from_millis(20),
            runner: RunnerSettings::default(),
            auto_offset_reset: "earliest".into(),
            session_timeout: DEFAULT_SESSION_TIMEOUT,
            properties: BTreeMap::new(),
        }
    }

    /// Check the fields without connecting.
    ///
    /// # Errors
    /// [`ConfigError`] naming the first bad field (`group_id`, `topics`, `batch`, …).
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.client.validate()?;
        ConfigError::invalid_if(self.group_id.is_empty(), "group_id", "must not be empty")?;
        ConfigError::invalid_if(
            self.topics.is_empty(),
            "topics",
            "at least one topic is needed",
        )?;
        if let Some(t) = self
            .topics
            .iter()
            .find(|t| !crate::transport::kafka::valid_topic(t))
        {
            return Err(ConfigError::new(
                "topics",
                format!("{t:?} is not a Kafka topic name (1 to 249 of A-Z a-z 0-9 . _ -)"),
            ));
        }
        ConfigError::invalid_if(
            !(1..=100_000).contains(&self.batch),
            "batch",
            "must be 1 to 100000",
        )?;
        self.runner.validate()?;
        ConfigError::invalid_if(
            self.session_timeout < Duration::from_millis(1),
            "session_timeout",
            "must be at least 1 ms (brokers usually require 6 s to 300 s)",
        )?;
        ConfigError::invalid_if(
            !matches!(self.auto_offset_reset.as_str(), "earliest" | "latest"),
            "auto_offset_reset",
            "must be \"earliest\" or \"latest\"",
        )?;
        Ok(())
    }
}

/// A topic partition: topic name and partition number.
pub type Partition = (String, i32);

/// Per partition of a batch: its highest offset, and its lowest record to redeliver with the delay.
type BatchEnd = (i64, Option<(i64, Duration)>);

/// Client context of the runners: logs commit failures and records the partitions of every
/// rebalance, so the runner forgets its pause and delivery-count state for them.
#[derive(Default)]
pub(crate) struct RunnerContext {
    rebalanced: Mutex<Vec<Partition>>,
}

impl RunnerContext {
    pub(crate) fn take_rebalanced(&self) -> Vec<Partition> {
        std::mem::take(&mut *self.rebalanced.lock().expect("rebalance lock"))
    }
}

impl ClientContext for RunnerContext {}

impl ConsumerContext for RunnerContext {
    fn post_rebalance(&self, _consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        match rebalance {
            Rebalance::Assign(tpl) | Rebalance::Revoke(tpl) => {
                let parts: Vec<Partition> = tpl
                    .elements()
                    .iter()
                    .map(|e| (e.topic().to_owned(), e.partition()))
                    .collect();
                tracing::info!(
                    assigned = matches!(rebalance, Rebalance::Assign(_)),
                    partitions = ?parts,
                    "Kafka consumer group rebalance"
                );
                self.rebalanced
                    .lock()
                    .expect("rebalance lock")
                    .extend(parts);
            }
            Rebalance::Error(e) => tracing::warn!(error = %e, "Kafka rebalance failed"),
        }
    }

    fn commit_callback(&self, result: KafkaResult<()>, offsets: &TopicPartitionList) {
        if let Err(e) = result {
            // The records are delivered again and recognised by the inbox.
            tracing::warn!(error = %e, ?offsets, "Kafka offset commit failed");
        }
    }
}

pub(crate) type RunnerConsumer = StreamConsumer<RunnerContext>;

/// Build a consumer in group `group_id` subscribed to `topics`, after checking that the topics
/// exist (a metadata request within `connect_timeout`). `session_timeout` applies unless the
/// properties set `session.timeout.ms`.
pub(crate) async fn subscribe(
    client: &KafkaConfig,
    group_id: &str,
    topics: &[String],
    auto_offset_reset: &str,
    session_timeout: Duration,
    extra: &BTreeMap<String, String>,
) -> Result<Arc<RunnerConsumer>, ConfigError> {
    client.check_features()?;
    let mut c = client.client_config();
    if c.get("session.timeout.ms").is_none() && !extra.contains_key("session.timeout.ms") {
        c.set(
            "session.timeout.ms",
            session_timeout.as_millis().max(1).to_string(),
        );
    }
    for (k, v) in extra {
        c.set(k, v);
    }
    c.set("group.id", group_id)
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set("enable.partition.eof", "false")
        .set("auto.offset.reset", auto_offset_reset);
    let consumer: RunnerConsumer = c
        .create_with_context(RunnerContext::default())
        .map_err(config_error)?;
    let consumer = Arc::new(consumer);
    let timeout = client.connect_timeout;
    let (c2, wanted) = (consumer.clone(), topics.to_vec());
    let missing = tokio::task::spawn_blocking(move || -> Result<Vec<String>, KafkaError> {
        let md = c2.fetch_metadata(None, timeout)?;
        Ok(wanted
            .into_iter()
            .filter(|t| {
                !md.topics()
                    .iter()
                    .any(|m| m.name() == t && m.error().is_none() && !m.partitions().is_empty())
            })
            .collect())
    })
    .await
    .unwrap_or(Err(KafkaError::Canceled))
    .map_err(|e| {
        ConfigError::new(
            "bootstrap_servers",
            format!("cannot reach Kafka at {}: {e}", client.bootstrap_servers),
        )
    })?;
    ConfigError::invalid_if(
        !missing.is_empty(),
        "topics",
        format!("topics {missing:?} do not exist; create them first"),
    )?;
    let names: Vec<&str> = topics.iter().map(String::as_str).collect();
    consumer
        .subscribe(&names)
        .map_err(|e| ConfigError::new("topics", format!("cannot subscribe: {e}")))?;
    Ok(consumer)
}

/// Wait for the first record (until `wake_at` or `cancel`), then collect up to `max` records
/// arriving within `wait`. `None` when cancelled; an empty batch when `wake_at` came first.
///
/// # Errors
/// A consumer error on the first record (the runner backs off).
pub(crate) async fn next_batch(
    consumer: &RunnerConsumer,
    max: usize,
    wait: Duration,
    wake_at: Option<Instant>,
    cancel: &CancellationToken,
) -> Option<Result<Vec<OwnedMessage>, KafkaError>> {
    let first = tokio::select! {
        _ = cancel.cancelled() => return None,
        _ = sleep_until(wake_at) => return Some(Ok(Vec::new())),
        m = consumer.recv() => m,
    };
    let first = match first {
        Ok(m) => m.detach(),
        Err(e) => return Some(Err(e)),
    };
    let mut batch = vec![first];
    let deadline = Instant::now() + wait;
    while batch.len() < max {
        let next = tokio::select! {
            _ = cancel.cancelled() => break,
            _ = tokio::time::sleep_until(deadline) => break,
            m = consumer.recv() => m,
        };
        match next {
            Ok(m) => batch.push(m.detach()),
            Err(e) => {
                tracing::warn!(error = %e, "Kafka consumer error");
                break;
            }
        }
    }
    Some(Ok(batch))
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Commit `offsets` (topic, partition → next offset to read).
pub(crate) fn commit(
    consumer: &RunnerConsumer,
    offsets: &HashMap<Partition, i64>,
    mode: CommitMode,
) -> KafkaResult<()> {
    if offsets.is_empty() {
        return Ok(());
    }
    let mut tpl = TopicPartitionList::new();
    for ((topic, partition), offset) in offsets {
        tpl.add_partition_offset(topic, *partition, Offset::Offset(*offset))?;
    }
    consumer.commit(&tpl, mode)
}

/// Commit `offsets` synchronously off the runtime, then close the consumer (leaving the group)
/// off the runtime too: both block on broker round trips.
pub(crate) async fn close(consumer: Arc<RunnerConsumer>, offsets: HashMap<Partition, i64>) {
    let _ = tokio::task::spawn_blocking(move || {
        if let Err(e) = commit(&consumer, &offsets, CommitMode::Sync) {
            tracing::warn!(error = %e, "final Kafka offset commit failed; records will be redelivered");
        }
        drop(consumer);
    })
    .await;
}

/// The record's headers as UTF-8 strings (invalid UTF-8 replaced); a header without a value is
/// read as empty.
pub fn record_headers(m: &OwnedMessage) -> Headers {
    let mut out = Headers::new();
    if let Some(h) = m.headers() {
        for header in h.iter() {
            let v = header
                .value
                .map(|v| String::from_utf8_lossy(v).into_owned())
                .unwrap_or_default();
            out.insert(header.key.to_owned(), v);
        }
    }
    out
}

/// A partition paused after a failed record: when to resume, and the offset it was sought
/// back to.
pub(crate) struct Held {
    resume_at: Instant,
    offset: i64,
    resumed: bool,
    /// Whether the partition was already sought again because it restarted elsewhere.
    sought_again: bool,
}

/// What the runner remembers per partition between batches.
#[derive(Default)]
pub(crate) struct PartitionState {
    held: HashMap<Partition, Held>,
    /// Deliveries so far of records that were not acknowledged, by offset.
    deliveries: HashMap<Partition, BTreeMap<i64, u32>>,
    /// Offsets committed (next offset to read).
    pub(crate) committed: HashMap<Partition, i64>,
}

fn tpl_of(topic: &str, partition: i32) -> TopicPartitionList {
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition(topic, partition);
    tpl
}

impl PartitionState {
    /// Forget pauses and counts of partitions that were assigned or revoked.
    pub(crate) fn forget(&mut self, parts: Vec<Partition>) {
        for p in parts {
            self.held.remove(&p);
            self.deliveries.remove(&p);
            self.committed.remove(&p);
        }
    }

    /// Resume the partitions whose delay has passed; the earliest pending resume time.
    pub(crate) fn resume_due(&mut self, consumer: &RunnerConsumer) -> Option<Instant> {
        let now = Instant::now();
        let mut next: Option<Instant> = None;
        for ((topic, partition), h) in self.held.iter_mut().filter(|(_, h)| !h.resumed) {
            if h.resume_at <= now {
                if let Err(e) = consumer.resume(&tpl_of(topic, *partition)) {
                    tracing::warn!(error = %e, topic, partition, "Kafka resume failed");
                }
                h.resumed = true;
            } else {
                next = Some(next.map_or(h.resume_at, |n| n.min(h.resume_at)));
            }
        }
        next
    }

    /// Pause the partition and seek it back to `offset`, to be resumed at `resume_at`.
    /// Pause first: librdkafka records the position on pause, which would undo an earlier seek.
    pub(crate) fn hold(
        &mut self,
        consumer: &RunnerConsumer,
        topic: &str,
        partition: i32,
        offset: i64,
        resume_at: Instant,
    ) -> &mut Held {
        if let Err(e) = consumer.pause(&tpl_of(topic, partition)) {
            tracing::warn!(error = %e, topic, partition, "Kafka pause failed");
        }
        if let Err(e) = consumer.seek(topic, partition, Offset::Offset(offset), Duration::ZERO) {
            tracing::warn!(error = %e, topic, partition, offset, "Kafka seek failed");
        }
        let key = (topic.to_owned(), partition);
        self.held.insert(
            key.clone(),
            Held {
                resume_at,
                offset,
                resumed: false,
                sought_again: false,
            },
        );
        self.held.get_mut(&key).expect("just inserted")
    }

    /// Record the outcome of a batch: `done` holds (partition, offset, retry delay) for every
    /// record applied or skipped (`None`) or to be redelivered (`Some(delay)`). A partition with
    /// a record to redeliver is held at its lowest such record and committed up to it; the others
    /// are committed past their highest record (asynchronously).
    pub(crate) fn settle(
        &mut self,
        consumer: &RunnerConsumer,
        done: Vec<(Partition, i64, Option<Duration>)>,
    ) {
        // Per partition: the lowest record to retry (with its delay), else the highest offset done.
        let mut per_partition: HashMap<Partition, BatchEnd> = HashMap::new();
        for (key, offset, retry) in done {
            let e = per_partition.entry(key).or_insert((offset, None));
            e.0 = e.0.max(offset);
            if let Some(delay) = retry
                && e.1.is_none_or(|(o, _)| offset < o)
            {
                e.1 = Some((offset, delay));
            }
        }
        let mut to_commit = HashMap::new();
        for ((topic, partition), (highest, retry)) in per_partition {
            let next = match retry {
                Some((offset, delay)) => {
                    self.hold(consumer, &topic, partition, offset, Instant::now() + delay);
                    offset
                }
                None => highest + 1,
            };
            let key = (topic, partition);
            if let Some(counts) = self.deliveries.get_mut(&key) {
                *counts = counts.split_off(&next);
            }
            if self.committed.get(&key).is_none_or(|c| *c < next) {
                self.committed.insert(key.clone(), next);
                to_commit.insert(key, next);
            }
        }
        if let Err(e) = commit(consumer, &to_commit, CommitMode::Async) {
            tracing::warn!(error = %e, "Kafka offset commit failed; records will be redelivered");
        }
    }

    /// Whether a fetched record may be applied now (see the module docs on held partitions).
    pub(crate) fn admit(&mut self, consumer: &RunnerConsumer, m: &OwnedMessage) -> bool {
        let key = (m.topic().to_owned(), m.partition());
        let Some(h) = self.held.get(&key) else {
            return true;
        };
        if !h.resumed {
            return false;
        }
        if m.offset() == h.offset {
            self.held.remove(&key);
            return true;
        }
        if h.sought_again {
            // The held record is gone (retention or compaction removed it): move on.
            tracing::warn!(
                topic = m.topic(),
                partition = m.partition(),
                offset = m.offset(),
                held = h.offset,
                "held record no longer in the partition; continuing from the next one"
            );
            self.held.remove(&key);
            return true;
        }
        tracing::debug!(
            topic = m.topic(),
            partition = m.partition(),
            got = m.offset(),
            expected = h.offset,
            "resumed partition did not restart at its held record; seeking again"
        );
        let offset = h.offset;
        let again = self.hold(consumer, m.topic(), m.partition(), offset, Instant::now());
        again.sought_again = true;
        false
    }
}

/// The Kafka [`Source`]: a consumer-group member with manual offset commits; a record to retry
/// pauses its partition and seeks it back (see the module docs).
pub struct KafkaSource {
    config: KafkaConsumerConfig,
    consumer: Option<Arc<RunnerConsumer>>,
    state: PartitionState,
    /// Never cancelled: [`run`](crate::consumer::source::run) stops fetches itself.
    idle: CancellationToken,
}

impl KafkaSource {
    /// A source for `config` (validated; nothing is contacted until [`Source::open`]).
    ///
    /// # Errors
    /// [`ConfigError`] naming the invalid field.
    pub fn new(config: KafkaConsumerConfig) -> Result<Self, ConfigError> {
        config.validate()?;
        Ok(KafkaSource {
            config,
            consumer: None,
            state: PartitionState::default(),
            idle: CancellationToken::new(),
        })
    }
}

/// A record's place: its partition and offset.
pub type KafkaToken = (Partition, i64);

#[async_trait]
impl Source for KafkaSource {
    type Token = KafkaToken;

    fn describe(&self) -> String {
        format!(
            "Kafka topics {:?}, group {}",
            self.config.topics, self.config.group_id
        )
    }

    /// Subscribe once: librdkafka reconnects by itself, and subscribing again would only cost a
    /// rebalance.
    async fn open(&mut self) -> Result<(), SourceError> {
        if self.consumer.is_some() {
            return Ok(());
        }
        let c = &self.config;
        let consumer = subscribe(
            &c.client,
            &c.group_id,
            &c.topics,
            &c.auto_offset_reset,
            c.session_timeout,
            &c.properties,
        )
        .await?;
        self.consumer = Some(consumer);
        Ok(())
    }

    async fn fetch(&mut self, max: usize) -> Result<Vec<Delivery<KafkaToken>>, SourceError> {
        let consumer = self
            .consumer
            .clone()
            .ok_or_else(|| SourceError::Lost("not subscribed".into()))?;
        let wake_at = self.state.resume_due(&consumer);
        let max = max.min(self.config.batch);
        let records =
            match next_batch(&consumer, max, self.config.batch_wait, wake_at, &self.idle).await {
                None => Vec::new(),
                Some(Ok(r)) => r,
                Some(Err(e)) => return Err(SourceError::Lost(format!("Kafka fetch failed: {e}"))),
            };
        self.state.forget(consumer.context().take_rebalanced());
        let mut out = Vec::with_capacity(records.len());
        for m in records {
            if !self.state.admit(&consumer, &m) {
                continue;
            }
            let key = (m.topic().to_owned(), m.partition());
            let counts = self.state.deliveries.entry(key.clone()).or_default();
            let count = counts.entry(m.offset()).or_insert(0);
            *count += 1;
            out.push(Delivery {
                envelope: Envelope {
                    headers: record_headers(&m),
                    payload: m.payload().map(<[u8]>::to_vec).unwrap_or_default(),
                    delivery_count: *count,
                    origin: format!(
                        "topic {}, partition {}, offset {}",
                        m.topic(),
                        m.partition(),
                        m.offset()
                    ),
                },
                token: (key, m.offset()),
            });
        }
        Ok(out)
    }

    async fn settle(
        &mut self,
        batch: Vec<(Delivery<KafkaToken>, Settle)>,
    ) -> Result<(), SourceError> {
        let consumer = self
            .consumer
            .clone()
            .ok_or_else(|| SourceError::Lost("not subscribed".into()))?;
        let done = batch
            .into_iter()
            .map(|(d, s)| {
                let (key, offset) = d.token;
                let retry = match s {
                    Settle::Retry(delay) => Some(delay),
                    // A malformed record is skipped: committed like an acknowledged one.
                    Settle::Ack | Settle::Reject(_) => None,
                };
                (key, offset, retry)
            })
            .collect();
        self.state.settle(&consumer, done);
        Ok(())
    }

    /// Commit the last offsets synchronously and leave the group.
    async fn close(&mut self) {
        if let Some(consumer) = self.consumer.take() {
            close(consumer, std::mem::take(&mut self.state.committed)).await;
        }
    }
}

// This broker's consumer is the generic runner over its source: `kafka::run(config, …)`.
pub use crate::consumer::run;

/// [`run`] consumes with a [`KafkaSource`] built from these settings.
///
/// # Errors of `run`
/// [`ConfigError`] naming the field when the settings are invalid, a topic does not exist or the
/// cluster does not answer at start. Later errors (fetch, commit) are logged and retried with
/// backoff.
///
/// # Cancel safety
/// Cancelling `cancel` stops after the batch in flight, commits its offsets and leaves the group.
impl SourceConfig for KafkaConsumerConfig {
    type Source = KafkaSource;

    fn options(&self) -> ConsumeOptions {
        ConsumeOptions::new(&self.runner, self.batch)
    }

    fn into_source(self, _metrics: &Arc<ConsumerMetrics>) -> Result<KafkaSource, ConfigError> {
        KafkaSource::new(self)
    }
}
