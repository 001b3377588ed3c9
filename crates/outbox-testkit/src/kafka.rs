//! Kafka-protocol test helpers: [`KafkaFixture`] (a [`TransportFixture`] with its own topics) and
//! [`kafka_url`] / [`kafka_config`].
//!
//! The tests run against any Kafka-protocol broker at `OUTBOX_TEST_KAFKA_URL` (default
//! [`DEFAULT_KAFKA_URL`]); CI starts Tansu there (`.ci/services/kafka.sh`). Topics are created per
//! test with unique names (Tansu does not auto-create topics) and deleted at cleanup. A broker that
//! does not answer makes the fixture panic with a message naming the variable.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use outbox::transport::Transport;
use outbox::transport::kafka::{KafkaTopic, create_topics};
use outbox::{KafkaConfig, KafkaTransport};
use rdkafka::admin::{AdminClient, AdminOptions};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Header, Headers as _, Message as _, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{Offset, TopicPartitionList};

use crate::{Received, TransportFixture, unique};

/// Default Kafka URL when `OUTBOX_TEST_KAFKA_URL` is unset (Tansu as `.ci/services/kafka.sh`
/// starts it).
pub const DEFAULT_KAFKA_URL: &str = "kafka://127.0.0.1:19092";

/// `OUTBOX_TEST_KAFKA_URL`, or [`DEFAULT_KAFKA_URL`]; `kafka://host:port[,host:port]` or a plain
/// bootstrap list.
pub fn kafka_url() -> String {
    std::env::var("OUTBOX_TEST_KAFKA_URL").unwrap_or_else(|_| DEFAULT_KAFKA_URL.into())
}

/// Transport settings for the test broker: delivery timeout 5 s, connect timeout 10 s; with
/// `OUTBOX_TEST_KAFKA_DEBUG` set (e.g. `cgrp,fetch`), librdkafka's `debug` contexts, logged
/// through `RUST_LOG=rdkafka=debug`.
pub fn kafka_config() -> KafkaConfig {
    let mut c = KafkaConfig::new(kafka_url());
    c.connect_timeout = Duration::from_secs(10);
    if let Ok(debug) = std::env::var("OUTBOX_TEST_KAFKA_DEBUG") {
        c.properties.insert("debug".into(), debug);
    }
    c
}

/// Create `topics` on the test broker.
///
/// # Panics
/// When the broker does not answer (naming `OUTBOX_TEST_KAFKA_URL`) or refuses a topic.
pub async fn create_test_topics(topics: &[KafkaTopic]) {
    if let Err(e) = create_topics(&kafka_config(), topics).await {
        if e.field == "bootstrap_servers" {
            panic!(
                "Kafka is not reachable at {} ({}); start it (bash .ci/services/kafka.sh starts \
                 Tansu) or set OUTBOX_TEST_KAFKA_URL",
                kafka_url(),
                e.reason
            );
        }
        panic!("cannot create Kafka topics {topics:?}: {e}");
    }
}

/// Every record of partition `partition` of `topic` as [`Received`] (see [`read_keyed`]).
///
/// # Panics
/// As [`read_keyed`].
pub async fn read_partition(topic: &str, partition: i32) -> Vec<Received> {
    read_keyed(topic, partition)
        .await
        .into_iter()
        .map(|(_, r)| r)
        .collect()
}

/// Header of the end marker [`read_keyed`] appends; records carrying it are not returned.
pub const END_MARKER_HEADER: &str = "outbox-testkit-end-marker";

/// Every record of partition `partition` of `topic` from the beginning, read without a consumer
/// group (assign + seek): its key and the record as [`Received`] (`native_id` is the
/// `outbox-message-id` header, as Kafka records have no id field; `destination` is the topic).
///
/// The end is found with a marker: an end-marker record (header [`END_MARKER_HEADER`]) is produced
/// to the partition first, its delivery report gives its exact offset, and the partition is read up
/// to it. The high watermark is not used: Tansu 0.6 reports it as the last batch's base offset + 1,
/// which is short by the size of the last batch minus one. Marker records are skipped.
///
/// # Panics
/// When the broker does not answer, or the records cannot be read within 30 s.
pub async fn read_keyed(topic: &str, partition: i32) -> Vec<(Option<Vec<u8>>, Received)> {
    let config = kafka_config();
    let producer: FutureProducer = config.producer_config().create().expect("Kafka producer");
    let marker = FutureRecord::<str, str>::to(topic)
        .partition(partition)
        .payload("end")
        .headers(OwnedHeaders::new().insert(Header {
            key: END_MARKER_HEADER,
            value: Some("1"),
        }));
    let end = producer
        .send(marker, Duration::from_secs(10))
        .await
        .unwrap_or_else(|(e, _)| {
            panic!(
                "cannot write the end marker to {topic}[{partition}] at {} ({e}); is Kafka up \
                 (OUTBOX_TEST_KAFKA_URL)?",
                kafka_url()
            )
        })
        .offset;
    let topic = topic.to_owned();
    tokio::task::spawn_blocking(move || {
        let consumer: BaseConsumer = config
            .client_config()
            .set("group.id", unique("obx_reader"))
            .set("enable.auto.commit", "false")
            .create()
            .expect("Kafka reader");
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition_offset(&topic, partition, Offset::Beginning)
            .expect("partition offset");
        consumer.assign(&tpl).expect("assign");
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        let mut out = Vec::new();
        loop {
            assert!(
                std::time::Instant::now() < deadline,
                "timed out reading {topic}[{partition}] up to offset {end}"
            );
            let Some(m) = consumer.poll(Duration::from_millis(200)) else {
                continue;
            };
            let m = m.unwrap_or_else(|e| panic!("reading {topic}: {e}"));
            let headers: BTreeMap<String, String> = m
                .headers()
                .map(|h| {
                    h.iter()
                        .map(|h| {
                            let v = h.value.map(String::from_utf8_lossy).unwrap_or_default();
                            (h.key.to_owned(), v.into_owned())
                        })
                        .collect()
                })
                .unwrap_or_default();
            if !headers.contains_key(END_MARKER_HEADER) {
                let received = Received {
                    native_id: headers.get(outbox::message::HEADER_MESSAGE_ID).cloned(),
                    headers,
                    payload: m.payload().unwrap_or_default().to_vec(),
                    destination: topic.clone(),
                };
                out.push((m.key().map(<[u8]>::to_vec), received));
            }
            if m.offset() >= end {
                return out;
            }
        }
    })
    .await
    .expect("reader task")
}

/// Delete `topics` (best effort).
pub async fn delete_test_topics(topics: &[String]) {
    let Ok(admin) = kafka_config()
        .client_config()
        .create::<AdminClient<DefaultClientContext>>()
    else {
        return;
    };
    let names: Vec<&str> = topics.iter().map(String::as_str).collect();
    let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(5)));
    let _ = tokio::time::timeout(Duration::from_secs(10), admin.delete_topics(&names, &opts)).await;
}

/// One test's Kafka topic `<prefix>.ok` (one partition) and a transport publishing to it.
pub struct KafkaFixture {
    /// The transport.
    pub transport: Arc<KafkaTransport>,
    /// Unique prefix of this fixture's topics (`obx_<hex>`).
    pub prefix: String,
    /// Topics created by the fixture (deleted at cleanup).
    pub topics: std::sync::Mutex<Vec<String>>,
}

impl KafkaFixture {
    /// Create the topic and connect the transport.
    ///
    /// # Panics
    /// When the broker does not answer (naming `OUTBOX_TEST_KAFKA_URL`).
    pub async fn new() -> KafkaFixture {
        Self::with_config(kafka_config()).await
    }

    /// As [`KafkaFixture::new`] with transport settings `config`.
    ///
    /// # Panics
    /// As [`KafkaFixture::new`], or when `config` is refused.
    pub async fn with_config(config: KafkaConfig) -> KafkaFixture {
        let prefix = unique("obx");
        let fx = KafkaFixture {
            transport: Arc::new(
                KafkaTransport::new(config).unwrap_or_else(|e| panic!("Kafka transport: {e}")),
            ),
            prefix,
            topics: std::sync::Mutex::default(),
        };
        fx.topic("ok", 1).await;
        fx.transport.probe().await.unwrap_or_else(|e| {
            panic!(
                "Kafka is not reachable at {} ({}); set OUTBOX_TEST_KAFKA_URL",
                kafka_url(),
                e.report()
            )
        });
        fx
    }

    /// Create topic `<prefix>.<suffix>` with `partitions` partitions and return its name.
    ///
    /// # Panics
    /// As [`create_test_topics`].
    pub async fn topic(&self, suffix: &str, partitions: i32) -> String {
        self.topic_with(KafkaTopic::new(format!("{}.{suffix}", self.prefix)).partitions(partitions))
            .await
    }

    /// Create `topic` (its name should start with the prefix) and return its name.
    ///
    /// # Panics
    /// As [`create_test_topics`].
    pub async fn topic_with(&self, topic: KafkaTopic) -> String {
        create_test_topics(std::slice::from_ref(&topic)).await;
        self.topics
            .lock()
            .expect("topics lock")
            .push(topic.name.clone());
        topic.name
    }
}

#[async_trait]
impl TransportFixture for KafkaFixture {
    fn transport(&self) -> Arc<dyn Transport> {
        self.transport.clone()
    }

    fn good_destination(&self) -> String {
        format!("{}.ok", self.prefix)
    }

    /// An invalid topic name: refused before sending, as a permanent error (an unknown topic is
    /// retryable by design, see `outbox::transport::kafka`).
    fn rejecting_destination(&self) -> String {
        format!("{}/invalid topic", self.prefix)
    }

    async fn received(&self) -> Vec<Received> {
        read_partition(&self.good_destination(), 0).await
    }

    async fn cleanup(&self) {
        let topics = self.topics.lock().expect("topics lock").clone();
        delete_test_topics(&topics).await;
    }
}
