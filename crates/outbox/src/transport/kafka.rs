//! Kafka transport (feature `kafka`): an idempotent librdkafka producer (rdkafka 0.39, which
//! bundles librdkafka 2.12) with `acks=all`; `Ok` only after the partition leader reported the
//! record written to every in-sync replica (the delivery report).
//!
//! # What travels where
//! - **Topic**: the route's destination (default `{topic}`, the outbox topic itself). Kafka topic
//!   names are 1 to 249 characters of `A-Z a-z 0-9 . _ -` (and not `.` or `..`); any other name
//!   is refused before sending, as a permanent error.
//! - **Record key**: the message's partition key, so every message of one key goes to the same
//!   partition and keeps its order there. A message **without** a partition key is keyed by its
//!   message id (hyphenated UUID text): such messages spread over the partitions as if random,
//!   carry no order promise, and are accepted by compacted topics (which refuse null keys). The
//!   partitioner is `murmur2_random`, the Java client's default, so a key lands on the partition a
//!   Java producer (the seeds) would choose for it.
//! - **Record headers**: every [`Message::wire_headers`](crate::Message::wire_headers) entry
//!   (user headers, `traceparent` and `tracestate` included, plus `outbox-message-id`,
//!   `outbox-topic`, `outbox-attempt`, `outbox-partition-key`, `outbox-reply-to`). Kafka records
//!   have no message-id field: the id travels in the `outbox-message-id` header.
//! - **Value**: the payload, byte-exact.
//!
//! # Acknowledgement and duplicates
//! The whole batch is enqueued first (`produce`), then the delivery reports are awaited
//! (pipelined; librdkafka batches per partition behind the scenes). `enable.idempotence=true`
//! makes the broker drop the duplicates librdkafka's own retries would write and keeps per
//! partition order across those retries. It does not cover a relay that crashes after the ack and
//! before recording SENT: the next relay publishes the row again, as a new record with the same
//! `outbox-message-id`, and the consumer's inbox absorbs the copy (Kafka has no broker-side dedup
//! by an application id, unlike JetStream's `Nats-Msg-Id`).
//!
//! # Timeouts: librdkafka's retries versus the relay's
//! librdkafka retries a failed produce request by itself until `message.timeout.ms` (here
//! [`KafkaConfig::delivery_timeout`], default 5 s) has passed since the record was enqueued, then
//! reports `MessageTimedOut`. Keep `delivery_timeout` **below** the relay's `publish_timeout`
//! (default 10 s): then every record of a batch gets its delivery report before the relay gives
//! up on the batch, and no record stays queued inside librdkafka after the relay recorded a
//! failure (a record that the relay timed out but librdkafka later delivered would only be a
//! duplicate for the inbox, never a loss, but it would also be retried by the relay).
//!
//! # Classification (where the error is born)
//! | librdkafka error | kind |
//! |---|---|
//! | record larger than `message.max.bytes` (refused at `produce`, never put in a batch), `MSG_SIZE_TOO_LARGE` / `RECORD_LIST_TOO_LARGE` / `INVALID_RECORD` / `INVALID_TOPIC` from the broker, invalid topic name | Permanent |
//! | local queue full (`queue.buffering.max.messages` / `.kbytes`) | Retryable |
//! | unknown topic or partition (the producer does not ask the broker to create topics) | Unavailable, missing destination: see below |
//! | `MessageTimedOut` while librdkafka reports all brokers down, transport and resolve failures | Unavailable |
//! | fatal producer error, fenced producer (`_FATAL`, `_FENCED`, `PRODUCER_FENCED`, `INVALID_PRODUCER_EPOCH`) | Unavailable: the producer is rebuilt |
//! | authentication (`_AUTHENTICATION`, `SASL_AUTHENTICATION_FAILED`), TLS (`_SSL`), authorization (`TOPIC_AUTHORIZATION_FAILED`, `CLUSTER_AUTHORIZATION_FAILED`) | Unavailable: a configuration fault pauses the transport |
//! | `MessageTimedOut` otherwise, `NOT_ENOUGH_REPLICAS`, leader changes, anything else | Retryable |
//!
//! **Unknown topic pauses the transport**: on Kafka a missing topic is almost always a deployment
//! that has not created it yet (auto-creation is usually off), so no attempt is counted and the
//! message is published once the topic exists; after the relay's `missing_destination_grace`
//! (default 5 min) it is dead-lettered with the broker's reason. librdkafka waits `topic.metadata.propagation.max.ms` (here half the delivery
//! timeout, unless set in [`KafkaConfig::properties`]) for a new topic to appear before it reports
//! it unknown, and then learns of its creation at its next metadata refresh
//! (`topic.metadata.refresh.interval.ms`, 5 min by default).
//!
//! **Message too large** (shared case C07): librdkafka refuses a record larger than
//! `message.max.bytes` ([`KafkaConfig::max_message_bytes`]) when it is produced, so it never
//! joins a batch and cannot take the other records of a batch down with it. Set it to the topic's
//! `max.message.bytes` (broker default 1 MiB): a record the client lets through but the broker
//! refuses fails with `MSG_SIZE_TOO_LARGE`, also permanent.
//!
//! A fatal idempotent-producer error (a fenced producer, an out-of-order sequence after data loss
//! on the broker) makes the producer unusable: the transport reports every failure of the batch
//! `Unavailable` (no attempt counted) and builds a fresh producer at once; if that fails, the
//! relay's probe ([`Transport::probe`]) builds it, with backoff, without a restart.
//!
//! # Limits
//! - The producer never asks the broker to create a topic (`allow.auto.create.topics=false`,
//!   overridable in [`KafkaConfig::properties`]): a mistyped destination must not "deliver" into a
//!   topic no consumer reads. Create topics with [`create_topics`].
//! - This build of librdkafka has no TLS and no SCRAM/GSSAPI support unless the `rdkafka` crate is
//!   built with its `ssl` / `sasl` features (the workspace does not enable them); SASL/PLAIN
//!   works without them. [`KafkaTransport::connect`] checks librdkafka's `builtin.features` and
//!   names the field ([`KafkaConfig::tls`], [`KafkaConfig::sasl`]) that asks for a missing one.
//! - Kafka keeps order per partition only: the partition key must not change the partition count
//!   of a topic while keyed messages are in flight (adding partitions moves keys).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use async_trait::async_trait;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::{ClientContext, DefaultClientContext};
use rdkafka::config::ClientConfig;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};

use super::{Acks, Outgoing, Transport};
use crate::error::{ConfigError, TransportError, TransportErrorKind};

/// Connection and producer settings of a Kafka cluster.
///
/// The connection part (bootstrap servers, client id, SASL, TLS, [`properties`](Self::properties))
/// is shared by the producer, the consumer runner ([`crate::consumer::kafka`]) and the
/// confirmation listener ([`crate::confirm::kafka`]).
///
/// Also the `[transports.<name>] kind = "kafka"` table of the configuration file (see
/// [`TransportConfig`](super::config::TransportConfig)): durations written `"5s"`, `sasl` and
/// `tls` as inline tables, `properties` as a table of strings; every field but
/// `bootstrap_servers` may be left out.
#[derive(Clone, serde::Deserialize, serde::Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct KafkaConfig {
    /// `bootstrap.servers`: comma-separated `host:port` list, e.g. `127.0.0.1:9092` or
    /// `b1:9092,b2:9092`. A leading `kafka://` is accepted and removed by [`KafkaConfig::new`]
    /// (and when read from a file). Required.
    #[serde(deserialize_with = "de_bootstrap")]
    pub bootstrap_servers: String,
    /// `client.id`, shown in broker logs and quotas. Default `outbox`.
    pub client_id: String,
    /// SASL credentials. Default none (no authentication).
    pub sasl: Option<KafkaSasl>,
    /// TLS to the brokers. Default none (plaintext). Needs librdkafka built with SSL (the
    /// `rdkafka` crate's `ssl` feature), which this workspace does not enable.
    pub tls: Option<KafkaTls>,
    /// `message.timeout.ms`: how long librdkafka may keep retrying one record before it reports
    /// `MessageTimedOut`. Must stay below the relay's `publish_timeout` (see the module docs).
    /// Default 5 s.
    #[serde(with = "humantime_serde")]
    pub delivery_timeout: Duration,
    /// `linger.ms`: how long librdkafka waits to fill a batch. Default 5 ms (librdkafka's).
    #[serde(with = "humantime_serde")]
    pub linger: Duration,
    /// `message.max.bytes`: largest record librdkafka accepts; larger ones are refused as
    /// permanent errors at produce time. Set it to the topics' `max.message.bytes`.
    /// Default 1,000,000 (librdkafka's default; the broker's default is 1,048,588).
    pub max_message_bytes: usize,
    /// How long [`KafkaTransport::connect`] and [`Transport::probe`] wait for the cluster's
    /// metadata. Default 5 s.
    #[serde(with = "humantime_serde")]
    pub connect_timeout: Duration,
    /// Extra librdkafka properties (<https://github.com/confluentinc/librdkafka/blob/master/CONFIGURATION.md>),
    /// applied last to every client built from this config (producer, consumer, admin).
    /// `acks` other than `all`/`-1` and `enable.idempotence=false` are refused: they would break
    /// "SENT only after a durable acknowledgement". Default empty.
    pub properties: BTreeMap<String, String>,
    /// Topics the transport built by
    /// [`TransportConfig::build`](super::config::TransportConfig::build) creates when missing
    /// (Kafka topics are not auto-created everywhere), with `partitions` partitions and
    /// `replication` replicas: see [`KafkaConfig::topics`]. Default none.
    pub create_topics: Vec<String>,
    /// Partitions of the topics created from `create_topics`, at least 1. Default 1.
    pub partitions: i32,
    /// Replication factor of the topics created from `create_topics`, at least 1. Default 1.
    pub replication: i32,
}

impl Default for KafkaConfig {
    /// [`KafkaConfig::new`] with no bootstrap server.
    fn default() -> Self {
        KafkaConfig::new("")
    }
}

fn de_bootstrap<'de, D: serde::Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    let s = <String as serde::Deserialize>::deserialize(d)?;
    Ok(KafkaConfig::new(s).bootstrap_servers)
}

fn plain() -> String {
    "PLAIN".into()
}

impl std::fmt::Debug for KafkaConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaConfig")
            .field("bootstrap_servers", &self.bootstrap_servers)
            .field("client_id", &self.client_id)
            .field("sasl", &self.sasl)
            .field("tls", &self.tls)
            .field("delivery_timeout", &self.delivery_timeout)
            .field("linger", &self.linger)
            .field("max_message_bytes", &self.max_message_bytes)
            .field("connect_timeout", &self.connect_timeout)
            .field("create_topics", &self.create_topics)
            .field("partitions", &self.partitions)
            .field("replication", &self.replication)
            .field(
                "properties",
                &self
                    .properties
                    .iter()
                    .map(|(k, v)| (k.as_str(), if is_secret(k) { "<redacted>" } else { v }))
                    .collect::<BTreeMap<_, _>>(),
            )
            .finish()
    }
}

/// SASL authentication (`security.protocol=sasl_plaintext`, or `sasl_ssl` with [`KafkaTls`]).
///
/// In a configuration file: `sasl = { mechanism = "PLAIN", username_env = "…", password_env =
/// "…" }`, the credentials read from the named environment variables by
/// [`KafkaConfig::resolve_secrets`].
#[derive(Clone, Default, serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct KafkaSasl {
    /// `sasl.mechanism`: `PLAIN`, `SCRAM-SHA-256` or `SCRAM-SHA-512`. SCRAM needs librdkafka built
    /// with SSL. Default `PLAIN`.
    #[serde(default = "plain")]
    pub mechanism: String,
    /// `sasl.username`. Never read from nor written to a file: see `username_env`.
    #[serde(skip)]
    pub username: String,
    /// `sasl.password` (never printed). Never read from nor written to a file: see
    /// `password_env`.
    #[serde(skip)]
    pub password: String,
    /// Name of the environment variable holding the user name, read when `username` is empty.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub username_env: Option<String>,
    /// Name of the environment variable holding the password, read when `password` is empty.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub password_env: Option<String>,
}

impl std::fmt::Debug for KafkaSasl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaSasl")
            .field("mechanism", &self.mechanism)
            .field("username", &self.username)
            .field("password", &"<redacted>")
            .field("username_env", &self.username_env)
            .field("password_env", &self.password_env)
            .finish()
    }
}

/// TLS settings (`security.protocol=ssl`, or `sasl_ssl` with [`KafkaSasl`]). In a
/// configuration file: `tls = { ca_file = "…", cert_file = "…", key_file = "…" }`, every field
/// optional.
#[derive(Debug, Clone, Default, serde::Deserialize, serde::Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct KafkaTls {
    /// `ssl.ca.location` (`ca_file` in a file): CA certificate file. Default: the system's store.
    #[serde(rename = "ca_file")]
    pub ca_location: Option<String>,
    /// `ssl.certificate.location` (`cert_file` in a file): client certificate for mutual TLS.
    /// Default none.
    #[serde(rename = "cert_file")]
    pub certificate_location: Option<String>,
    /// `ssl.key.location` (`key_file` in a file): client private key for mutual TLS. Default
    /// none.
    #[serde(rename = "key_file")]
    pub key_location: Option<String>,
}

/// Property names whose values are secrets, redacted in `Debug` output.
fn is_secret(key: &str) -> bool {
    key.contains("password") || key.contains("secret") || key.ends_with(".pem")
}

impl KafkaConfig {
    /// Settings for `bootstrap` (`host:port[,host:port…]`, optionally prefixed `kafka://`) with
    /// the defaults.
    pub fn new(bootstrap: impl Into<String>) -> Self {
        let b: String = bootstrap.into();
        let b = b
            .strip_prefix("kafka://")
            .unwrap_or(&b)
            .trim_end_matches('/')
            .to_owned();
        KafkaConfig {
            bootstrap_servers: b,
            client_id: "outbox".into(),
            sasl: None,
            tls: None,
            delivery_timeout: Duration::from_secs(5),
            linger: Duration::from_millis(5),
            max_message_bytes: 1_000_000,
            connect_timeout: Duration::from_secs(5),
            properties: BTreeMap::new(),
            create_topics: Vec::new(),
            partitions: 1,
            replication: 1,
        }
    }

    /// A copy with the SASL user name and password read from the variables named by
    /// `sasl.username_env` and `sasl.password_env` (each when its value is empty).
    ///
    /// # Errors
    /// [`ConfigError`] naming `sasl.username_env` or `sasl.password_env` when the variable is not
    /// set.
    pub fn resolve_secrets(&self) -> Result<Self, ConfigError> {
        let mut c = self.clone();
        if let Some(s) = &mut c.sasl {
            if s.username.is_empty() {
                let var = s.username_env.as_deref();
                s.username =
                    super::config::env_secret("sasl.username_env", var)?.unwrap_or_default();
            }
            if s.password.is_empty() {
                let var = s.password_env.as_deref();
                s.password =
                    super::config::env_secret("sasl.password_env", var)?.unwrap_or_default();
            }
        }
        Ok(c)
    }

    /// The topics [`create_topics`](Self::create_topics) names, with `partitions` and
    /// `replication`, for [`create_topics`](fn@create_topics).
    pub fn topics(&self) -> Vec<KafkaTopic> {
        self.create_topics
            .iter()
            .map(|t| {
                let mut topic = KafkaTopic::new(t).partitions(self.partitions);
                topic.replication = self.replication;
                topic
            })
            .collect()
    }

    /// Check the fields without connecting, the SASL variables included; the error names the
    /// field as spelled here (`bootstrap_servers`, `delivery_timeout`, `properties.acks`,
    /// `sasl.username_env`, `create_topics`, …).
    ///
    /// # Errors
    /// [`ConfigError`] naming the first bad field.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.resolve_secrets()?.check()?;
        if let Some(t) = self.create_topics.iter().find(|t| !valid_topic(t)) {
            return Err(ConfigError::new(
                "create_topics",
                format!("{t:?} is not a Kafka topic name (1 to 249 of A-Z a-z 0-9 . _ -)"),
            ));
        }
        if self.partitions < 1 {
            return Err(ConfigError::new("partitions", "must be at least 1"));
        }
        if self.replication < 1 {
            return Err(ConfigError::new("replication", "must be at least 1"));
        }
        Ok(())
    }

    /// [`KafkaConfig::validate`] of the settings themselves, secrets as they are.
    fn check(&self) -> Result<(), ConfigError> {
        if self.bootstrap_servers.is_empty() {
            return Err(ConfigError::new("bootstrap_servers", "must not be empty"));
        }
        for server in self.bootstrap_servers.split(',') {
            let ok = server
                .rsplit_once(':')
                .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok());
            if !ok {
                return Err(ConfigError::new(
                    "bootstrap_servers",
                    format!("{server:?} is not host:port"),
                ));
            }
        }
        if self.client_id.is_empty() {
            return Err(ConfigError::new("client_id", "must not be empty"));
        }
        if self.delivery_timeout < Duration::from_millis(1) {
            return Err(ConfigError::new(
                "delivery_timeout",
                "must be at least 1 ms",
            ));
        }
        if self.connect_timeout.is_zero() {
            return Err(ConfigError::new(
                "connect_timeout",
                "must be greater than zero",
            ));
        }
        if !(1000..=1_000_000_000).contains(&self.max_message_bytes) {
            return Err(ConfigError::new(
                "max_message_bytes",
                "must be 1000 to 1000000000 (librdkafka's range)",
            ));
        }
        if let Some(s) = &self.sasl {
            if !["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"].contains(&s.mechanism.as_str()) {
                return Err(ConfigError::new(
                    "sasl.mechanism",
                    format!(
                        "{:?} is not PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512",
                        s.mechanism
                    ),
                ));
            }
            if s.username.is_empty() {
                return Err(ConfigError::new("sasl.username", "must not be empty"));
            }
        }
        if let Some(acks) = self.properties.get("acks")
            && !matches!(acks.as_str(), "all" | "-1")
        {
            return Err(ConfigError::new(
                "properties.acks",
                "must be \"all\": SENT means every in-sync replica has the record",
            ));
        }
        if self
            .properties
            .get("enable.idempotence")
            .is_some_and(|v| v != "true")
        {
            return Err(ConfigError::new(
                "properties.enable.idempotence",
                "must stay true: it keeps per-partition order across librdkafka's retries",
            ));
        }
        Ok(())
    }

    /// The connection part of a librdkafka configuration: bootstrap servers, client id, security
    /// and [`KafkaConfig::properties`]. The producer, the consumer runner and the admin client add
    /// their own settings to it.
    pub fn client_config(&self) -> ClientConfig {
        let mut c = ClientConfig::new();
        c.set("bootstrap.servers", &self.bootstrap_servers)
            .set("client.id", &self.client_id);
        let protocol = match (&self.sasl, &self.tls) {
            (None, None) => "plaintext",
            (Some(_), None) => "sasl_plaintext",
            (None, Some(_)) => "ssl",
            (Some(_), Some(_)) => "sasl_ssl",
        };
        c.set("security.protocol", protocol);
        if let Some(s) = &self.sasl {
            c.set("sasl.mechanism", &s.mechanism)
                .set("sasl.username", &s.username)
                .set("sasl.password", &s.password);
        }
        if let Some(t) = &self.tls {
            for (k, v) in [
                ("ssl.ca.location", &t.ca_location),
                ("ssl.certificate.location", &t.certificate_location),
                ("ssl.key.location", &t.key_location),
            ] {
                if let Some(v) = v {
                    c.set(k, v);
                }
            }
        }
        for (k, v) in &self.properties {
            c.set(k, v);
        }
        c
    }

    /// The producer configuration: [`KafkaConfig::client_config`] plus `acks=all`,
    /// `enable.idempotence=true`, `message.timeout.ms`, `message.max.bytes`, and the defaults
    /// `linger.ms`, `partitioner=murmur2_random`, `topic.metadata.propagation.max.ms` (half the
    /// delivery timeout) and `allow.auto.create.topics=false` (librdkafka's producer default is
    /// `true`: a route with a mistyped topic would create it on brokers that allow it), which
    /// [`KafkaConfig::properties`] may override.
    pub fn producer_config(&self) -> ClientConfig {
        let mut c = self.client_config();
        let mut default = |k: &str, v: String| {
            if !self.properties.contains_key(k) {
                c.set(k, v);
            }
        };
        default("partitioner", "murmur2_random".into());
        default(
            "topic.metadata.propagation.max.ms",
            (self.delivery_timeout.as_millis() / 2).max(1).to_string(),
        );
        default("linger.ms", self.linger.as_millis().to_string());
        // A route to a topic nobody created must not create it on first use (a typo would send
        // messages where no consumer looks): unknown topics are retryable errors instead.
        default("allow.auto.create.topics", "false".into());
        c.set("acks", "all")
            .set("enable.idempotence", "true")
            .set(
                "message.timeout.ms",
                self.delivery_timeout.as_millis().max(1).to_string(),
            )
            .set("message.max.bytes", self.max_message_bytes.to_string());
        c
    }

    /// Check that this librdkafka build supports the security settings asked for.
    ///
    /// # Errors
    /// [`ConfigError`] naming `tls` or `sasl.mechanism`.
    pub fn check_features(&self) -> Result<(), ConfigError> {
        let features = builtin_features();
        let has = |f: &str| features.split(',').any(|x| x == f);
        if self.tls.is_some() && !has("ssl") {
            return Err(ConfigError::new(
                "tls",
                format!(
                    "this librdkafka build has no TLS support (builtin.features = {features}); \
                     build outbox with the rdkafka crate's `ssl` feature"
                ),
            ));
        }
        if let Some(s) = &self.sasl {
            let needed = if s.mechanism == "PLAIN" {
                "sasl_plain"
            } else {
                "sasl_scram"
            };
            if !has(needed) {
                return Err(ConfigError::new(
                    "sasl.mechanism",
                    format!(
                        "this librdkafka build cannot do {} (builtin.features = {features}); \
                         build outbox with the rdkafka crate's `ssl` feature for SCRAM",
                        s.mechanism
                    ),
                ));
            }
        }
        Ok(())
    }
}

/// librdkafka's `builtin.features` of this build, e.g. `gzip,snappy,sasl,regex,lz4,sasl_plain,…`.
pub fn builtin_features() -> String {
    ClientConfig::new()
        .create_native_config()
        .and_then(|c| c.get("builtin.features"))
        .unwrap_or_default()
}

/// Turn a librdkafka configuration error into a [`ConfigError`] naming the property.
pub(crate) fn config_error(e: KafkaError) -> ConfigError {
    match &e {
        KafkaError::ClientConfig(_, desc, key, _) => {
            ConfigError::new(format!("properties.{key}"), desc.clone())
        }
        _ => ConfigError::new("properties", e.to_string()),
    }
}

/// What Kafka cannot carry: an invalid topic name (see [`valid_topic`]).
///
/// # Errors
/// A permanent error whose source is a [`WireError`](super::wire::WireError) naming the topic.
pub(crate) fn check_message(out: &Outgoing<'_>) -> Result<(), TransportError> {
    if valid_topic(out.destination) {
        Ok(())
    } else {
        Err(super::wire::WireError::unsupported(
            super::wire::Broker::Kafka,
            super::wire::Field::Destination(out.destination.to_owned()),
            "a Kafka topic name is 1 to 249 of A-Z a-z 0-9 . _ - (and not . or ..)",
        )
        .into())
    }
}

/// Whether `topic` is a valid Kafka topic name: 1 to 249 characters of `A-Z a-z 0-9 . _ -`, and
/// not `.` or `..` (Kafka's `Topic.validate`).
pub fn valid_topic(topic: &str) -> bool {
    !topic.is_empty()
        && topic.len() <= 249
        && topic != "."
        && topic != ".."
        && topic
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// A topic to create with [`create_topics`].
#[derive(Debug, Clone)]
pub struct KafkaTopic {
    /// Topic name.
    pub name: String,
    /// Partitions. Default 1.
    pub partitions: i32,
    /// Replication factor. Default 1.
    pub replication: i32,
    /// Topic configs, e.g. `max.message.bytes`. Default none.
    pub config: BTreeMap<String, String>,
}

impl KafkaTopic {
    /// One partition, replication factor 1, no configs.
    pub fn new(name: impl Into<String>) -> Self {
        KafkaTopic {
            name: name.into(),
            partitions: 1,
            replication: 1,
            config: BTreeMap::new(),
        }
    }

    /// With `partitions` partitions.
    pub fn partitions(mut self, partitions: i32) -> Self {
        self.partitions = partitions;
        self
    }

    /// With a topic config entry.
    pub fn config(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.config.insert(key.into(), value.into());
        self
    }
}

/// Create `topics` with the admin API; a topic that already exists is left as it is.
///
/// # Errors
/// [`ConfigError`] naming `topics` with the broker's reason when a topic cannot be created, or
/// `bootstrap_servers` when the cluster does not answer within `connect_timeout`.
pub async fn create_topics(config: &KafkaConfig, topics: &[KafkaTopic]) -> Result<(), ConfigError> {
    config.validate()?;
    config.check_features()?;
    let admin: AdminClient<DefaultClientContext> =
        config.client_config().create().map_err(config_error)?;
    let specs: Vec<NewTopic<'_>> = topics
        .iter()
        .map(|t| {
            t.config.iter().fold(
                NewTopic::new(
                    &t.name,
                    t.partitions,
                    TopicReplication::Fixed(t.replication),
                ),
                |n, (k, v)| n.set(k, v),
            )
        })
        .collect();
    let opts = AdminOptions::new().operation_timeout(Some(config.connect_timeout));
    let results = tokio::time::timeout(
        config.connect_timeout + Duration::from_secs(1),
        admin.create_topics(&specs, &opts),
    )
    .await
    .map_err(|_| {
        ConfigError::new(
            "bootstrap_servers",
            format!(
                "Kafka at {} did not answer within {:?}",
                config.bootstrap_servers, config.connect_timeout
            ),
        )
    })?
    .map_err(|e| {
        ConfigError::new(
            "bootstrap_servers",
            format!("cannot reach Kafka at {}: {e}", config.bootstrap_servers),
        )
    })?;
    for r in results {
        match r {
            Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
            Err((name, code)) => {
                return Err(ConfigError::new(
                    "topics",
                    format!("cannot create topic {name}: {code}"),
                ));
            }
        }
    }
    Ok(())
}

/// What the producer's client context learned from librdkafka's events, shared with the
/// transport (the context itself is wrapped by rdkafka's `FutureProducer` and out of reach):
/// whether librdkafka reported every broker down (its `ALL_BROKERS_DOWN` error event), so a
/// delivery timeout can be told apart from an outage, and the idempotent-producer state from
/// librdkafka's statistics when `statistics.interval.ms` is set in [`KafkaConfig::properties`].
#[derive(Debug, Default)]
pub struct ProducerState {
    all_brokers_down: AtomicBool,
    idempotence: std::sync::Mutex<Option<(String, i64)>>,
}

impl ProducerState {
    /// Whether librdkafka reported all brokers down since the last successful delivery or probe.
    pub fn brokers_down(&self) -> bool {
        self.all_brokers_down.load(Ordering::Acquire)
    }

    /// The idempotent producer's state and producer id from the latest statistics
    /// (`("Assigned", id)` once the broker gave the producer its id), or `None` before the first
    /// statistics (they are only emitted when `statistics.interval.ms` is set).
    pub fn idempotence(&self) -> Option<(String, i64)> {
        self.idempotence.lock().expect("stats lock").clone()
    }

    fn set_up(&self) {
        self.all_brokers_down.store(false, Ordering::Release);
    }
}

/// Client context of the producer, feeding a [`ProducerState`].
#[derive(Default)]
pub struct OutageContext(Arc<ProducerState>);

impl ClientContext for OutageContext {
    fn stats(&self, statistics: rdkafka::Statistics) {
        if let Some(eos) = statistics.eos {
            *self.0.idempotence.lock().expect("stats lock") =
                Some((eos.idemp_state, eos.producer_id));
        }
    }

    fn error(&self, error: KafkaError, reason: &str) {
        if matches!(
            error.rdkafka_error_code(),
            Some(RDKafkaErrorCode::AllBrokersDown)
        ) {
            self.0.all_brokers_down.store(true, Ordering::Release);
            tracing::warn!(reason, "Kafka: all brokers are down");
        } else {
            tracing::debug!(error = %error, reason, "librdkafka error event");
        }
    }
}

type KafkaProducer = FutureProducer<OutageContext>;

/// Publishes to Kafka (see the module docs).
pub struct KafkaTransport {
    config: KafkaConfig,
    state: Arc<ProducerState>,
    producer: RwLock<Arc<KafkaProducer>>,
}

impl std::fmt::Debug for KafkaTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaTransport")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl KafkaTransport {
    /// Build the producer and check that the cluster answers (a metadata request within
    /// `connect_timeout`).
    ///
    /// # Errors
    /// [`ConfigError`] naming the field: a [`KafkaConfig::validate`] failure, `tls` / `sasl.mechanism`
    /// for a feature this librdkafka lacks, `properties.<name>` for a property librdkafka refuses,
    /// `bootstrap_servers` when the cluster does not answer.
    pub async fn connect(config: KafkaConfig) -> Result<Self, ConfigError> {
        let transport = Self::new(config)?;
        transport.probe().await.map_err(|e| {
            ConfigError::new(
                "bootstrap_servers",
                format!(
                    "cannot reach Kafka at {}: {}",
                    transport.config.bootstrap_servers,
                    e.report()
                ),
            )
        })?;
        Ok(transport)
    }

    /// Build the producer without contacting the cluster (librdkafka connects in the background).
    ///
    /// # Errors
    /// As [`KafkaTransport::connect`], except for reachability.
    pub fn new(config: KafkaConfig) -> Result<Self, ConfigError> {
        config.validate()?;
        config.check_features()?;
        let state = Arc::new(ProducerState::default());
        let producer = Arc::new(build_producer(&config, &state)?);
        Ok(KafkaTransport {
            config,
            state,
            producer: RwLock::new(producer),
        })
    }

    /// The settings.
    pub fn config(&self) -> &KafkaConfig {
        &self.config
    }

    /// What the producer learned from librdkafka's events (outage, idempotence state).
    pub fn state(&self) -> &Arc<ProducerState> {
        &self.state
    }

    /// The current producer (replaced after a fatal error), e.g. to share it with a
    /// [`KafkaConfirmationSender`](crate::confirm::kafka::KafkaConfirmationSender).
    pub fn producer(&self) -> Arc<FutureProducer<OutageContext>> {
        self.producer.read().expect("producer lock").clone()
    }

    /// Replace a producer that hit a fatal error (fenced, idempotence state lost): `None` when
    /// `current` is healthy, otherwise the fatal error's description (the producer is replaced
    /// when a new one can be built; if not, the next probe tries again).
    fn renew_if_fatal(&self, current: &Arc<KafkaProducer>) -> Option<String> {
        let (code, reason) = current.client().fatal_error()?;
        let what = format!("the Kafka producer failed fatally ({code:?}: {reason})");
        tracing::warn!(
            ?code,
            reason,
            "Kafka producer fatal error; building a new producer"
        );
        match build_producer(&self.config, &self.state) {
            Ok(p) => {
                let mut slot = self.producer.write().expect("producer lock");
                if Arc::ptr_eq(&slot, current) {
                    *slot = Arc::new(p);
                }
            }
            Err(e) => tracing::warn!(error = %e, "cannot build a new Kafka producer"),
        }
        Some(what)
    }
}

fn build_producer(
    config: &KafkaConfig,
    state: &Arc<ProducerState>,
) -> Result<KafkaProducer, ConfigError> {
    config
        .producer_config()
        .create_with_context(OutageContext(state.clone()))
        .map_err(config_error)
}

/// Classify a produce or delivery error (see the module docs' table).
pub fn classify(e: &KafkaError, brokers_down: bool) -> TransportErrorKind {
    use RDKafkaErrorCode as C;
    let Some(code) = e.rdkafka_error_code() else {
        return TransportErrorKind::Retryable;
    };
    match code {
        C::MessageSizeTooLarge
        | C::MessageBatchTooLarge
        | C::InvalidMessageSize
        | C::InvalidRecord
        | C::InvalidTopic => TransportErrorKind::Permanent,
        C::AllBrokersDown | C::BrokerTransportFailure | C::Resolve => {
            TransportErrorKind::Unavailable
        }
        // A dead producer (fenced, fatal idempotence error): rebuilt, the message is not at fault.
        C::Fatal
        | C::Fenced
        | C::ProducerFenced
        | C::InvalidProducerEpoch
        | C::TransactionCoordinatorFenced => TransportErrorKind::Unavailable,
        // Credentials, TLS and permissions: the transport's configuration, not the message.
        C::Authentication
        | C::SaslAuthenticationFailed
        | C::SSL
        | C::TopicAuthorizationFailed
        | C::ClusterAuthorizationFailed
        | C::TransactionalIdAuthorizationFailed => TransportErrorKind::Unavailable,
        // A missing topic (see `produce_error`): the transport pauses until it exists.
        C::UnknownTopic | C::UnknownTopicOrPartition => TransportErrorKind::Unavailable,
        C::MessageTimedOut | C::RequestTimedOut | C::OperationTimedOut if brokers_down => {
            TransportErrorKind::Unavailable
        }
        _ => TransportErrorKind::Retryable,
    }
}

/// The error of a failed produce or delivery: [`classify`], with an unknown topic marked as a
/// [`missing destination`](TransportError::missing_destination).
fn produce_error(e: KafkaError, brokers_down: bool, destination: &str) -> TransportError {
    let reason = report(&e, destination);
    let missing = matches!(
        e.rdkafka_error_code(),
        Some(RDKafkaErrorCode::UnknownTopic | RDKafkaErrorCode::UnknownTopicOrPartition)
    );
    let err = if missing {
        TransportError::missing_destination(reason)
    } else {
        TransportError::new(classify(&e, brokers_down), reason)
    };
    err.with_source(e)
}

fn report(e: &KafkaError, destination: &str) -> String {
    match e.rdkafka_error_code() {
        Some(RDKafkaErrorCode::MessageSizeTooLarge) => {
            format!("Kafka refused the record for topic {destination}: message too large")
        }
        Some(RDKafkaErrorCode::UnknownTopic | RDKafkaErrorCode::UnknownTopicOrPartition) => {
            format!("Kafka topic {destination} does not exist (yet)")
        }
        _ => format!("Kafka publish to topic {destination} failed"),
    }
}

#[async_trait]
impl Transport for KafkaTransport {
    fn name(&self) -> &str {
        "kafka"
    }

    /// Kafka carries any header name and value (record header keys are UTF-8 strings, values
    /// bytes) and any partition key (the record key, bytes), and reserves no header name: only the
    /// topic name is checked.
    fn check(&self, out: &Outgoing<'_>) -> Result<(), TransportError> {
        check_message(out)
    }

    async fn publish(&self, batch: &[Outgoing<'_>]) -> Vec<Result<(), TransportError>> {
        let acks = Acks::new(batch.len());
        self.publish_each(batch, &acks).await;
        acks.into_results()
    }

    async fn publish_each(&self, batch: &[Outgoing<'_>], acks: &Acks) {
        let producer = self.producer();
        // Enqueue the whole batch, then await the delivery reports.
        let mut pending = Vec::with_capacity(batch.len());
        for o in batch {
            if let Err(refused) = self.check(o) {
                pending.push(Err(refused));
                continue;
            }
            let m = o.message;
            let id = m.message_id.to_string();
            let key = m.partition_key.as_deref().unwrap_or(&id);
            let wire = m.wire_headers();
            let headers =
                wire.iter()
                    .fold(OwnedHeaders::new_with_capacity(wire.len()), |h, (k, v)| {
                        h.insert(Header {
                            key: k,
                            value: Some(v.as_str()),
                        })
                    });
            let record = FutureRecord::to(o.destination)
                .key(key)
                .payload(&m.payload)
                .headers(headers);
            pending.push(match producer.send_result(record) {
                Ok(delivery) => Ok(delivery),
                Err((e, _)) => Err(produce_error(e, self.state.brokers_down(), o.destination)),
            });
        }
        // Each delivery report is recorded as it arrives: acknowledged messages count even if
        // the relay's publish timeout cuts the rest short.
        let mut any_error = false;
        for (p, o) in pending.into_iter().zip(batch) {
            let r = match p {
                Err(e) => Err(e),
                Ok(delivery) => match delivery.await {
                    Ok(Ok(_)) => {
                        self.state.set_up();
                        Ok(())
                    }
                    Ok(Err((e, _))) => {
                        Err(produce_error(e, self.state.brokers_down(), o.destination))
                    }
                    Err(_) => Err(TransportError::retryable(
                        "the Kafka producer was dropped before the delivery report",
                    )),
                },
            };
            // A fatal producer (fenced): no failure of this batch is the message's fault.
            let r = match r {
                Err(e) => match producer.client().fatal_error() {
                    Some((code, reason)) => Err(TransportError::unavailable(format!(
                        "the Kafka producer failed fatally ({code:?}: {reason}); it is rebuilt"
                    ))
                    .with_source(e)),
                    None => Err(e),
                },
                ok => ok,
            };
            any_error |= r.is_err();
            acks.push(r);
        }
        if any_error {
            self.renew_if_fatal(&producer);
        }
    }

    async fn probe(&self) -> Result<(), TransportError> {
        if let Some(fatal) = self.renew_if_fatal(&self.producer()) {
            tracing::debug!(fatal, "Kafka producer rebuilt by the probe");
        }
        let producer = self.producer();
        if let Some((code, reason)) = producer.client().fatal_error() {
            return Err(TransportError::unavailable(format!(
                "the Kafka producer failed fatally ({code:?}: {reason}) and could not be rebuilt"
            )));
        }
        let timeout = self.config.connect_timeout;
        let p = producer.clone();
        let fetched = tokio::task::spawn_blocking(move || {
            p.client().fetch_metadata(None, timeout).map(|_| ())
        })
        .await
        .unwrap_or(Err(KafkaError::Canceled));
        match fetched {
            Ok(()) => {
                self.state.set_up();
                Ok(())
            }
            Err(e) => Err(TransportError::unavailable(format!(
                "Kafka at {} did not answer a metadata request within {timeout:?}",
                self.config.bootstrap_servers
            ))
            .with_source(e)),
        }
    }
}

#[cfg(test)]
mod tests;
