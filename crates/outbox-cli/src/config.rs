//! The `outbox relay` configuration file (TOML), with environment overrides.
//!
//! Every field is documented in `docs/configuration.md`. Unknown fields are errors; durations are
//! written like `"30s"`, `"500ms"`, `"5m"`. Environment variables override the file:
//! `OUTBOX_<SECTION>__<FIELD>` (double underscore between levels), for example
//! `OUTBOX_DATABASE__URL=postgres://…` or `OUTBOX_RELAY__BATCH_SIZE=1000`. Secrets are never
//! written in the file: a transport names the environment variable that holds them.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use figment::Figment;
use figment::providers::{Env, Format, Toml};
use outbox::{Backoff, ConfigError, RelayConfig, Router, Transport};
use serde::Deserialize;

/// The whole file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    /// `[database]`; may be left out when `--database` or `OUTBOX_DATABASE_URL` gives the URL.
    #[serde(default)]
    pub database: DatabaseSection,
    /// `[relay]`; every field optional.
    #[serde(default)]
    pub relay: RelaySection,
    /// `[transports.<name>]`: named transports.
    #[serde(default)]
    pub transports: BTreeMap<String, TransportSection>,
    /// `[[routes]]`: topic patterns to transports, first match wins.
    #[serde(default)]
    pub routes: Vec<RouteSection>,
    /// `[confirmations]`: where consumer confirmations are received. Default: none.
    pub confirmations: Option<ConfirmationsSection>,
}

/// `[database]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DatabaseSection {
    /// `postgres://…`, `mysql://…` (`mariadb://…`) or `sqlite://path` (required here or on the
    /// command line).
    #[serde(default)]
    pub url: String,
    /// Outbox table. Default `outbox`.
    #[serde(default = "default_table")]
    pub table: String,
    /// Inbox table created by `migrate`. Default `outbox_inbox`.
    #[serde(default = "default_inbox_table")]
    pub inbox_table: String,
}

impl Default for DatabaseSection {
    fn default() -> Self {
        DatabaseSection {
            url: String::new(),
            table: default_table(),
            inbox_table: default_inbox_table(),
        }
    }
}

fn default_table() -> String {
    "outbox".into()
}

fn default_inbox_table() -> String {
    "outbox_inbox".into()
}

/// `[relay]`: see [`RelayConfig`] for meanings and defaults.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RelaySection {
    /// Lease owner name.
    pub name: Option<String>,
    /// Rows per batch.
    pub batch_size: Option<u32>,
    /// Bucket lease.
    #[serde(default, with = "humantime_serde")]
    pub lease: Option<Duration>,
    /// Longest publish of one batch.
    #[serde(default, with = "humantime_serde")]
    pub publish_timeout: Option<Duration>,
    /// Longest idle sleep.
    #[serde(default, with = "humantime_serde")]
    pub poll_interval: Option<Duration>,
    /// Attempts before dead letter.
    pub max_attempts: Option<u32>,
    /// First retry delay.
    #[serde(default, with = "humantime_serde")]
    pub backoff_base: Option<Duration>,
    /// Largest retry delay.
    #[serde(default, with = "humantime_serde")]
    pub backoff_max: Option<Duration>,
    /// Maintenance period (check-back, retention); `reap_interval` is its name before 0.2.
    #[serde(default, with = "humantime_serde", alias = "reap_interval")]
    pub maintenance_interval: Option<Duration>,
    /// Batches in flight.
    pub in_flight_batches: Option<usize>,
    /// Graceful shutdown limit.
    #[serde(default, with = "humantime_serde")]
    pub shutdown_timeout: Option<Duration>,
    /// Check-backs before an unconfirmed message is FAILED.
    pub max_check_backs: Option<u32>,
    /// Retention of finished rows (`"7d"` or `"forever"`).
    pub retention: Option<Retention>,
    /// How long a destination may be missing before its messages are dead-lettered
    /// (`RelayConfig::missing_destination_grace`). Default `"5m"`.
    #[serde(default, with = "humantime_serde")]
    pub missing_destination_grace: Option<Duration>,
}

/// `[transports.<name>]`, tagged by `kind`.
#[derive(Debug, Clone, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum TransportSection {
    /// `kind = "webhook"`.
    Webhook(WebhookSection),
    /// `kind = "nats"`.
    Nats(NatsSection),
    /// `kind = "redis"`: Redis Streams.
    #[cfg(feature = "redis")]
    Redis(RedisSection),
    /// `kind = "mqtt"`: an MQTT 5 broker.
    #[cfg(feature = "mqtt")]
    Mqtt(MqttSection),
    /// `kind = "rocketmq"` (needs the `rocketmq` cargo feature of `outbox-cli`).
    Rocketmq(RocketMqSection),
    /// `kind = "rabbitmq"`.
    #[cfg(feature = "rabbitmq")]
    Rabbitmq(RabbitMqSection),
    /// `kind = "kafka"` (feature `kafka`).
    #[cfg(feature = "kafka")]
    Kafka(Box<KafkaSection>),
}

impl TransportSection {
    /// The destination of a route that names none: the webhook's own URL (empty), the topic as
    /// NATS subject, Redis stream key, MQTT topic or RocketMQ topic (`<default_topic>:{topic}`, the
    /// topic as tag, when a default topic is set), `<exchange>/{topic}` or the queue named after
    /// the topic for RabbitMQ.
    pub fn default_destination(&self) -> String {
        match self {
            TransportSection::Webhook(_) => String::new(),
            TransportSection::Nats(_) => "{topic}".into(),
            #[cfg(feature = "rabbitmq")]
            TransportSection::Rabbitmq(m) => match &m.exchange {
                Some(e) => format!("{e}/{{topic}}"),
                None => "{topic}".into(),
            },
            #[cfg(feature = "redis")]
            TransportSection::Redis(_) => "{topic}".into(),
            #[cfg(feature = "mqtt")]
            TransportSection::Mqtt(_) => "{topic}".into(),
            #[cfg(feature = "kafka")]
            TransportSection::Kafka(_) => "{topic}".into(),
            TransportSection::Rocketmq(m) => match &m.default_topic {
                Some(t) => format!("{t}:{{topic}}"),
                None => "{topic}".into(),
            },
        }
    }
}

/// Redis Streams transport settings (see `outbox::transport::redis`).
#[cfg(feature = "redis")]
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RedisSection {
    /// `redis://host:port[/db]`, or `rediss://…` for TLS (required).
    pub url: String,
    /// Name of the environment variable holding the password. Default: the URL's, or none.
    pub password_env: Option<String>,
    /// Approximate stream length cap (`MAXLEN ~`). Default none: no trimming (a cap can drop
    /// undelivered entries, shared case C38; a warning is logged at start-up).
    pub max_len: Option<u64>,
    /// Replicas that must have each batch (`WAIT`). Default none.
    pub wait_replicas: Option<u32>,
    /// How long `WAIT` waits for them. Default 1 s.
    #[serde(default, with = "humantime_serde")]
    pub wait_timeout: Option<Duration>,
    /// Reply timeout. Default 5 s.
    #[serde(default, with = "humantime_serde")]
    pub response_timeout: Option<Duration>,
    /// Connection timeout. Default 5 s.
    #[serde(default, with = "humantime_serde")]
    pub connect_timeout: Option<Duration>,
}

/// MQTT 5 transport settings (see `outbox::transport::mqtt`).
#[cfg(feature = "mqtt")]
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MqttSection {
    /// `mqtt://host:port`, or `mqtts://…` for TLS (required).
    pub url: String,
    /// Client identifier. Default `outbox-relay-<random>`.
    pub client_id: Option<String>,
    /// User name. Default: the URL's, or none.
    pub username: Option<String>,
    /// Name of the environment variable holding the password. Default: the URL's, or none.
    pub password_env: Option<String>,
    /// PUBACK timeout of a batch. Default 5 s.
    #[serde(default, with = "humantime_serde")]
    pub ack_timeout: Option<Duration>,
    /// CONNACK timeout. Default 5 s.
    #[serde(default, with = "humantime_serde")]
    pub connect_timeout: Option<Duration>,
    /// Keep-alive interval. Default 30 s.
    #[serde(default, with = "humantime_serde")]
    pub keep_alive: Option<Duration>,
    /// Publishes in flight at most. Default 1,000 (the broker's Receive Maximum lowers it).
    pub max_inflight: Option<u16>,
    /// `"retry"` (default) or `"accept"`: what a PUBACK *No matching subscribers* means.
    pub no_subscribers: Option<String>,
}

/// Webhook transport settings.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WebhookSection {
    /// Target URL (required).
    pub url: String,
    /// Name of the environment variable holding the `whsec_…` secret. Default: unsigned.
    pub secret_env: Option<String>,
    /// Request timeout. Default 10 s.
    #[serde(default, with = "humantime_serde")]
    pub timeout: Option<Duration>,
    /// Requests in flight per batch. Default 64.
    pub concurrency: Option<usize>,
}

/// NATS JetStream transport settings.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NatsSection {
    /// Server URL (required).
    pub url: String,
    /// Stream to check or create. Default: none.
    pub stream: Option<String>,
    /// Subjects of the stream when it is created. Default `["<stream>.>"]` lower-cased.
    #[serde(default)]
    pub subjects: Vec<String>,
    /// Create the stream when missing. Default true.
    #[serde(default = "yes")]
    pub create_stream: bool,
    /// PubAck timeout. Default 5 s.
    #[serde(default, with = "humantime_serde")]
    pub ack_timeout: Option<Duration>,
}

/// Kafka transport settings (see `docs/transports/kafka.md`).
#[cfg(feature = "kafka")]
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KafkaSection {
    /// `host:port[,host:port…]`, optionally prefixed `kafka://` (required).
    pub bootstrap_servers: String,
    /// `client.id`. Default `outbox`.
    pub client_id: Option<String>,
    /// SASL credentials, read from environment variables. Default: no authentication.
    pub sasl: Option<KafkaSaslSection>,
    /// TLS to the brokers (needs librdkafka built with SSL, which the default build is not).
    pub tls: Option<KafkaTlsSection>,
    /// `message.timeout.ms`: must be below `relay.publish_timeout`. Default 5 s.
    #[serde(default, with = "humantime_serde")]
    pub delivery_timeout: Option<Duration>,
    /// Metadata wait at start and in probes. Default 5 s.
    #[serde(default, with = "humantime_serde")]
    pub connect_timeout: Option<Duration>,
    /// `linger.ms`. Default 5 ms.
    #[serde(default, with = "humantime_serde")]
    pub linger: Option<Duration>,
    /// `message.max.bytes`: set it to the topics' `max.message.bytes`. Default 1,000,000.
    pub max_message_bytes: Option<usize>,
    /// Topics created at start when missing (Kafka topics are not auto-created everywhere).
    /// Default none.
    #[serde(default)]
    pub create_topics: Vec<String>,
    /// Partitions of the topics created from `create_topics`. Default 1.
    pub partitions: Option<i32>,
    /// Replication factor of the topics created from `create_topics`. Default 1.
    pub replication: Option<i32>,
    /// Extra librdkafka properties, e.g. `"compression.type" = "lz4"`. Default none.
    #[serde(default)]
    pub properties: BTreeMap<String, String>,
}

/// `sasl = { mechanism = "PLAIN", username_env = "…", password_env = "…" }`.
#[cfg(feature = "kafka")]
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KafkaSaslSection {
    /// `PLAIN` (default), `SCRAM-SHA-256` or `SCRAM-SHA-512` (SCRAM needs librdkafka with SSL).
    pub mechanism: Option<String>,
    /// Environment variable holding the user name.
    pub username_env: String,
    /// Environment variable holding the password.
    pub password_env: String,
}

/// `tls = { ca_file = "…", cert_file = "…", key_file = "…" }` (every field optional).
#[cfg(feature = "kafka")]
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KafkaTlsSection {
    /// CA certificate file. Default: the system's store.
    pub ca_file: Option<String>,
    /// Client certificate file (mutual TLS).
    pub cert_file: Option<String>,
    /// Client key file (mutual TLS).
    pub key_file: Option<String>,
}

/// `[confirmations] kind = "kafka"`: consume `topic` in consumer group `group`.
#[cfg(feature = "kafka")]
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KafkaConfirmationsSection {
    /// `host:port[,host:port…]`, optionally prefixed `kafka://` (required).
    pub bootstrap_servers: String,
    /// Topic the consumers reply to (the routes' `confirm.reply_to`).
    pub topic: String,
    /// Consumer group shared by relay instances. Default `outbox-confirmations`.
    #[serde(default = "default_queue")]
    pub group: String,
    /// SASL credentials from environment variables, as for a Kafka transport.
    pub sasl: Option<KafkaSaslSection>,
    /// TLS, as for a Kafka transport.
    pub tls: Option<KafkaTlsSection>,
    /// Extra librdkafka properties. Default none.
    #[serde(default)]
    pub properties: BTreeMap<String, String>,
}

/// The connection part of a Kafka client from the file: `prefix` is the section's path
/// (`transports.bus`, `confirmations`) for error messages; secrets are read from the environment.
#[cfg(feature = "kafka")]
fn kafka_client(
    prefix: &str,
    bootstrap: &str,
    sasl: &Option<KafkaSaslSection>,
    tls: &Option<KafkaTlsSection>,
    properties: &BTreeMap<String, String>,
) -> Result<outbox::KafkaConfig, ConfigError> {
    let mut c = outbox::KafkaConfig::new(bootstrap);
    if let Some(s) = sasl {
        let var = |field: &str, name: &str| {
            std::env::var(name).map_err(|_| {
                ConfigError::new(
                    format!("{prefix}.sasl.{field}"),
                    format!("environment variable {name} is not set"),
                )
            })
        };
        c.sasl = Some(outbox::transport::kafka::KafkaSasl {
            mechanism: s.mechanism.clone().unwrap_or_else(|| "PLAIN".into()),
            username: var("username_env", &s.username_env)?,
            password: var("password_env", &s.password_env)?,
        });
    }
    if let Some(t) = tls {
        c.tls = Some(outbox::transport::kafka::KafkaTls {
            ca_location: t.ca_file.clone(),
            certificate_location: t.cert_file.clone(),
            key_location: t.key_file.clone(),
        });
    }
    c.properties = properties.clone();
    Ok(c)
}

#[cfg(feature = "kafka")]
impl KafkaSection {
    /// The transport settings, validated; `publish_timeout` is the relay's, which the delivery
    /// timeout must stay below. Errors name `transports.<name>.<field>`.
    ///
    /// # Errors
    /// [`ConfigError`] naming the field.
    pub fn kafka_config(
        &self,
        name: &str,
        publish_timeout: Duration,
    ) -> Result<outbox::KafkaConfig, ConfigError> {
        let prefix = format!("transports.{name}");
        let mut c = kafka_client(
            &prefix,
            &self.bootstrap_servers,
            &self.sasl,
            &self.tls,
            &self.properties,
        )?;
        if let Some(v) = &self.client_id {
            c.client_id = v.clone();
        }
        if let Some(v) = self.delivery_timeout {
            c.delivery_timeout = v;
        }
        if let Some(v) = self.connect_timeout {
            c.connect_timeout = v;
        }
        if let Some(v) = self.linger {
            c.linger = v;
        }
        if let Some(v) = self.max_message_bytes {
            c.max_message_bytes = v;
        }
        let named = |e: ConfigError| ConfigError::new(format!("{prefix}.{}", e.field), e.reason);
        c.validate().map_err(named)?;
        c.check_features().map_err(named)?;
        if c.delivery_timeout >= publish_timeout {
            return Err(ConfigError::new(
                format!("{prefix}.delivery_timeout"),
                format!(
                    "must be below relay.publish_timeout ({publish_timeout:?}), so librdkafka \
                     reports every record before the relay gives up on a batch"
                ),
            ));
        }
        if let Some(t) = self
            .create_topics
            .iter()
            .find(|t| !outbox::transport::kafka::valid_topic(t))
        {
            return Err(ConfigError::new(
                format!("{prefix}.create_topics"),
                format!("{t:?} is not a Kafka topic name (1 to 249 of A-Z a-z 0-9 . _ -)"),
            ));
        }
        if self.partitions.is_some_and(|p| p < 1) {
            return Err(ConfigError::new(
                format!("{prefix}.partitions"),
                "must be at least 1",
            ));
        }
        if self.replication.is_some_and(|r| r < 1) {
            return Err(ConfigError::new(
                format!("{prefix}.replication"),
                "must be at least 1",
            ));
        }
        Ok(c)
    }

    /// The topics to create at start.
    pub fn topics(&self) -> Vec<outbox::transport::kafka::KafkaTopic> {
        self.create_topics
            .iter()
            .map(|t| {
                let mut topic = outbox::transport::kafka::KafkaTopic::new(t)
                    .partitions(self.partitions.unwrap_or(1));
                topic.replication = self.replication.unwrap_or(1);
                topic
            })
            .collect()
    }
}

#[cfg(feature = "kafka")]
impl KafkaConfirmationsSection {
    /// The listener's connection settings, validated; errors name `confirmations.<field>`.
    ///
    /// # Errors
    /// [`ConfigError`] naming the field.
    pub fn kafka_config(&self) -> Result<outbox::KafkaConfig, ConfigError> {
        let c = kafka_client(
            "confirmations",
            &self.bootstrap_servers,
            &self.sasl,
            &self.tls,
            &self.properties,
        )?;
        let named =
            |e: ConfigError| ConfigError::new(format!("confirmations.{}", e.field), e.reason);
        c.validate().map_err(named)?;
        c.check_features().map_err(named)?;
        if !outbox::transport::kafka::valid_topic(&self.topic) {
            return Err(ConfigError::new(
                "confirmations.topic",
                format!("{:?} is not a Kafka topic name", self.topic),
            ));
        }
        if self.group.is_empty() {
            return Err(ConfigError::new("confirmations.group", "must not be empty"));
        }
        Ok(c)
    }
}

fn yes() -> bool {
    true
}

/// RocketMQ transport settings (see `outbox::transport::rocketmq`). TLS is not available: the
/// RocketMQ client is built without its transport's `tls` feature.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
// Without the `rocketmq` feature the section is parsed and refused, never read.
#[cfg_attr(not(feature = "rocketmq"), allow(dead_code))]
pub struct RocketMqSection {
    /// Name server list as `rocketmq://host:port[;host:port…]` (required).
    pub url: String,
    /// Producer group. Default `outbox-relay`.
    pub producer_group: Option<String>,
    /// RocketMQ topic of routes that name no destination: they send to `<default_topic>:{topic}`
    /// (the outbox topic as the tag). Default: none, the destination is `{topic}` itself (then
    /// outbox topics must be valid RocketMQ topic names).
    pub default_topic: Option<String>,
    /// ACL access key. Default: none (no ACL).
    pub access_key: Option<String>,
    /// Name of the environment variable holding the ACL secret key (required with `access_key`).
    pub secret_key_env: Option<String>,
    /// Longest send, client retries included. Default 3 s.
    #[serde(default, with = "humantime_serde")]
    pub send_timeout: Option<Duration>,
    /// Client retries on another queue or broker. Default 2.
    pub retries: Option<u32>,
    /// Largest body in bytes; keep it at most the broker's `maxMessageSize`. Default 4 MiB.
    pub max_message_size: Option<usize>,
    /// Sends of one batch in flight. Default 256.
    pub max_in_flight: Option<usize>,
    /// Send a partition key's messages to one queue by its hash. Default true.
    pub order_by_partition_key: Option<bool>,
}

/// RabbitMQ transport settings (`kind = "rabbitmq"`); see `docs/transports/rabbitmq.md`.
#[cfg(feature = "rabbitmq")]
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RabbitMqSection {
    /// `amqp://host:5672/vhost` or `amqps://…` (TLS; needs `tls_ca_file`); required. The vhost is
    /// percent-encoded (`%2f` is `/`).
    pub url: String,
    /// User name, overriding the URL's. Default: the URL's.
    pub username: Option<String>,
    /// Name of the environment variable holding the password. Default: the URL's.
    pub password_env: Option<String>,
    /// PEM file of the certificate authorities trusted for `amqps://`.
    pub tls_ca_file: Option<std::path::PathBuf>,
    /// How long to wait for a batch's publisher confirms. Default 10 s.
    #[serde(default, with = "humantime_serde")]
    pub confirm_timeout: Option<Duration>,
    /// Connection and probe timeout. Default 5 s.
    #[serde(default, with = "humantime_serde")]
    pub connect_timeout: Option<Duration>,
    /// Heartbeat asked for when the URL has no `heartbeat`. Default 10 s.
    #[serde(default, with = "humantime_serde")]
    pub heartbeat: Option<Duration>,
    /// `"retry"` (default) or `"fail"`: what an unroutable (returned) message counts as.
    pub unroutable: Option<UnroutableSetting>,
    /// Largest payload in bytes, the server's `max_message_size`. Default 128 MiB.
    pub max_message_bytes: Option<usize>,
    /// Exchange of routes without a `destination`: they publish to `<exchange>/{topic}`.
    /// Default: none (`{topic}`, the queue named after the topic through the default exchange).
    pub exchange: Option<String>,
}

/// `unroutable = "retry" | "fail"`.
#[cfg(feature = "rabbitmq")]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum UnroutableSetting {
    /// Retryable (default).
    Retry,
    /// Permanent.
    Fail,
}

/// The RabbitMQ connection settings of `url`, `username`, `password_env` and `tls_ca_file`
/// (prefix names the section in errors, e.g. `transports.bus`). Reads the password variable and
/// the CA file.
#[cfg(feature = "rabbitmq")]
fn rabbitmq_connection(
    prefix: &str,
    url: &str,
    username: &Option<String>,
    password_env: &Option<String>,
    tls_ca_file: &Option<std::path::PathBuf>,
) -> Result<outbox::RabbitMqConfig, ConfigError> {
    let field = |f: &str| format!("{prefix}.{f}");
    url_ok(url, &["amqp", "amqps"]).map_err(|r| ConfigError::new(field("url"), r))?;
    let mut c = outbox::RabbitMqConfig::new(url);
    c.username = username.clone();
    if let Some(var) = password_env {
        c.password = Some(std::env::var(var).map_err(|_| {
            ConfigError::new(
                field("password_env"),
                format!("environment variable {var} is not set"),
            )
        })?);
    }
    match (url.starts_with("amqps://"), tls_ca_file) {
        (true, Some(path)) => {
            let pem = std::fs::read_to_string(path).map_err(|e| {
                ConfigError::new(
                    field("tls_ca_file"),
                    format!("cannot read {}: {e}", path.display()),
                )
            })?;
            if !pem.contains("-----BEGIN CERTIFICATE-----") {
                return Err(ConfigError::new(
                    field("tls_ca_file"),
                    format!("{} holds no PEM certificate", path.display()),
                ));
            }
            c.tls_ca_pem = Some(pem);
        }
        (true, None) => {
            return Err(ConfigError::new(
                field("tls_ca_file"),
                "amqps:// needs the PEM file of the trusted certificate authorities",
            ));
        }
        (false, Some(_)) => {
            return Err(ConfigError::new(
                field("tls_ca_file"),
                "set only with an amqps:// url",
            ));
        }
        (false, None) => {}
    }
    c.validate()
        .map_err(|e| ConfigError::new(field(&e.field), e.reason))?;
    Ok(c)
}

#[cfg(feature = "rabbitmq")]
impl RabbitMqSection {
    /// The transport settings, validated (`name` is the section's name).
    ///
    /// # Errors
    /// [`ConfigError`] naming `transports.<name>.<field>`.
    pub fn config(&self, name: &str) -> Result<outbox::RabbitMqConfig, ConfigError> {
        let prefix = format!("transports.{name}");
        let mut c = rabbitmq_connection(
            &prefix,
            &self.url,
            &self.username,
            &self.password_env,
            &self.tls_ca_file,
        )?;
        let field = |f: &str| format!("{prefix}.{f}");
        if let Some(t) = self.confirm_timeout {
            c.confirm_timeout = t;
        }
        if let Some(t) = self.connect_timeout {
            c.connect_timeout = t;
        }
        if let Some(t) = self.heartbeat {
            c.heartbeat = t;
        }
        if let Some(u) = self.unroutable {
            c.unroutable = match u {
                UnroutableSetting::Retry => outbox::Unroutable::Retry,
                UnroutableSetting::Fail => outbox::Unroutable::Fail,
            };
        }
        if let Some(n) = self.max_message_bytes {
            c.max_message_bytes = n;
        }
        if let Some(e) = &self.exchange
            && (e.is_empty() || e.len() > 255 || e.contains('/') || e.chars().any(char::is_control))
        {
            return Err(ConfigError::new(
                field("exchange"),
                format!("{e:?} is not an exchange name (1 to 255 bytes, no '/')"),
            ));
        }
        c.validate()
            .map_err(|e| ConfigError::new(field(&e.field), e.reason))?;
        Ok(c)
    }
}

/// `[[routes]]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteSection {
    /// `*`, `prefix*` or an exact topic.
    pub topics: String,
    /// Name of a `[transports.<name>]` section.
    pub transport: String,
    /// Destination template, `{topic}` replaced. Default `{topic}` (webhooks: the transport's URL).
    pub destination: Option<String>,
    /// Require the consumer's confirmation for this route. Default: none (SENT is final).
    pub confirm: Option<ConfirmSection>,
    /// Publish each partition key's messages in commit order, one after another (a failing
    /// message holds back only its own key). Default false: unordered.
    #[serde(default)]
    pub ordered: bool,
    /// On an ordered route, what a dead-lettered message does to the rest of its key: `"skip"`
    /// (default: the next message goes) or `"block"` (the key waits for `outbox requeue`).
    pub on_dead_letter: Option<DeadLetterSetting>,
}

/// `on_dead_letter = "skip" | "block"` on an ordered route.
#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum DeadLetterSetting {
    /// [`outbox::DeadLetterPolicy::Skip`].
    Skip,
    /// [`outbox::DeadLetterPolicy::Block`].
    Block,
}

/// `confirm = { reply_to = "…", timeout = "5m" }` on a route.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConfirmSection {
    /// Reply destination put in `outbox-reply-to`: the subject or URL of `[confirmations]`.
    pub reply_to: String,
    /// Deadline after SENT before a check-back. Default 5 min.
    #[serde(default, with = "humantime_serde")]
    pub timeout: Option<Duration>,
}

/// `[confirmations]`: the listener `outbox relay` runs for consumer confirmations.
#[derive(Debug, Clone, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase", deny_unknown_fields)]
pub enum ConfirmationsSection {
    /// `kind = "nats"`: subscribe to `subject` in queue group `queue`.
    Nats {
        /// Server URL.
        url: String,
        /// Subject the consumers reply to.
        subject: String,
        /// Queue group shared by relay instances. Default `outbox-confirmations`.
        #[serde(default = "default_queue")]
        queue: String,
    },
    /// `kind = "rocketmq"`: consume the reply destination in consumer group `group` (needs the
    /// `rocketmq` cargo feature).
    Rocketmq {
        /// Name server list, `rocketmq://host:port[;host:port…]`.
        url: String,
        /// The routes' `reply_to`: `Topic` or `Topic:Tag`.
        destination: String,
        /// Consumer group shared by relay instances. Default `outbox-confirmations`.
        #[serde(default = "default_queue")]
        group: String,
        /// ACL access key. Default none.
        access_key: Option<String>,
        /// Name of the environment variable holding the ACL secret key.
        secret_key_env: Option<String>,
    },
    /// `kind = "rabbitmq"`: consume `queue` (declared durable), acknowledging each batch after
    /// it is applied.
    #[cfg(feature = "rabbitmq")]
    Rabbitmq {
        /// Server URL (`amqp://…` or `amqps://…`).
        url: String,
        /// Queue the consumers reply to (the routes' `confirm.reply_to`).
        queue: String,
        /// User name, overriding the URL's.
        username: Option<String>,
        /// Name of the environment variable holding the password.
        password_env: Option<String>,
        /// PEM file of the certificate authorities trusted for `amqps://`.
        tls_ca_file: Option<std::path::PathBuf>,
    },
    /// `kind = "kafka"`: consume `topic` in consumer group `group` (feature `kafka`).
    #[cfg(feature = "kafka")]
    Kafka(KafkaConfirmationsSection),
    /// `kind = "http"`: serve `POST path` on `listen`.
    Http {
        /// Socket address, e.g. `127.0.0.1:8081`.
        listen: String,
        /// Path. Default `/confirmations`.
        #[serde(default = "default_confirm_path")]
        path: String,
    },
    /// `kind = "redis"`: read the reply stream `stream` with consumer group `group`.
    #[cfg(feature = "redis")]
    Redis {
        /// Server URL.
        url: String,
        /// Environment variable holding the password. Default none.
        password_env: Option<String>,
        /// Stream the consumers reply to.
        stream: String,
        /// Consumer group shared by relay instances. Default `outbox-confirmations`.
        #[serde(default = "default_queue")]
        group: String,
        /// This instance's consumer name (stable across restarts). Default: random.
        consumer: Option<String>,
    },
    /// `kind = "mqtt"`: subscribe to `$share/<group>/<topic>` with a persistent session.
    #[cfg(feature = "mqtt")]
    Mqtt {
        /// Broker URL.
        url: String,
        /// Topic the consumers reply to.
        topic: String,
        /// Shared-subscription group of relay instances. Default `outbox-confirmations`.
        #[serde(default = "default_queue")]
        group: String,
        /// Client id of the persistent session (stable across restarts). Default: random.
        client_id: Option<String>,
        /// User name. Default none.
        username: Option<String>,
        /// Environment variable holding the password. Default none.
        password_env: Option<String>,
    },
}

/// The value of the environment variable named by `field` (`Ok(None)` when no variable is
/// named).
///
/// # Errors
/// [`ConfigError`] naming `field` when the variable is not set.
// Only the Redis and MQTT sections take a password from the environment.
#[cfg_attr(not(any(feature = "redis", feature = "mqtt")), allow(dead_code))]
pub fn env_secret(field: &str, var: Option<&String>) -> Result<Option<String>, ConfigError> {
    match var {
        None => Ok(None),
        Some(v) => std::env::var(v)
            .map(Some)
            .map_err(|_| ConfigError::new(field, format!("environment variable {v} is not set"))),
    }
}

/// The Redis transport configuration of a section, validated.
///
/// # Errors
/// [`ConfigError`] naming `transports.<name>.<field>`.
#[cfg(feature = "redis")]
pub fn redis_config(name: &str, s: &RedisSection) -> Result<outbox::RedisConfig, ConfigError> {
    url_ok(&s.url, &["redis", "rediss"])
        .map_err(|r| ConfigError::new(format!("transports.{name}.url"), r))?;
    let mut c = outbox::RedisConfig::new(&s.url);
    c.password = env_secret(
        &format!("transports.{name}.password_env"),
        s.password_env.as_ref(),
    )?;
    c.max_len = s.max_len;
    if let Some(t) = s.response_timeout {
        c.response_timeout = t;
    }
    if let Some(t) = s.connect_timeout {
        c.connect_timeout = t;
    }
    if let Some(n) = s.wait_replicas {
        c.wait_replicas = Some(outbox::WaitReplicas {
            replicas: n,
            timeout: s.wait_timeout.unwrap_or(Duration::from_secs(1)),
        });
    } else if s.wait_timeout.is_some() {
        return Err(ConfigError::new(
            format!("transports.{name}.wait_timeout"),
            "set only with wait_replicas",
        ));
    }
    c.validate().map_err(|e| prefix(e, name))?;
    Ok(c)
}

/// The MQTT transport configuration of a section, validated.
///
/// # Errors
/// [`ConfigError`] naming `transports.<name>.<field>`.
#[cfg(feature = "mqtt")]
pub fn mqtt_config(name: &str, s: &MqttSection) -> Result<outbox::MqttConfig, ConfigError> {
    outbox::transport::mqtt::parse_url(&s.url).map_err(|e| prefix(e, name))?;
    let mut c = outbox::MqttConfig::new(&s.url);
    if let Some(id) = &s.client_id {
        if id.is_empty() {
            return Err(ConfigError::new(
                format!("transports.{name}.client_id"),
                "must not be empty",
            ));
        }
        c.client_id = id.clone();
    }
    c.username = s.username.clone();
    c.password = env_secret(
        &format!("transports.{name}.password_env"),
        s.password_env.as_ref(),
    )?;
    if let Some(t) = s.ack_timeout {
        c.ack_timeout = t;
    }
    if let Some(t) = s.connect_timeout {
        c.connect_timeout = t;
    }
    if let Some(t) = s.keep_alive {
        c.keep_alive = t;
    }
    if let Some(n) = s.max_inflight {
        if n == 0 {
            return Err(ConfigError::new(
                format!("transports.{name}.max_inflight"),
                "must be at least 1",
            ));
        }
        c.max_inflight = n;
    }
    c.no_subscribers = match s.no_subscribers.as_deref() {
        None | Some("retry") => outbox::NoSubscribers::Retry,
        Some("accept") => outbox::NoSubscribers::Accept,
        Some(other) => {
            return Err(ConfigError::new(
                format!("transports.{name}.no_subscribers"),
                format!("{other:?} is neither \"retry\" nor \"accept\""),
            ));
        }
    };
    Ok(c)
}

#[cfg(feature = "rabbitmq")]
impl ConfirmationsSection {
    /// The connection settings of a `kind = "rabbitmq"` section (`None` for other kinds).
    ///
    /// # Errors
    /// [`ConfigError`] naming `confirmations.<field>`.
    pub fn rabbitmq(&self) -> Result<Option<outbox::RabbitMqConfig>, ConfigError> {
        match self {
            ConfirmationsSection::Rabbitmq {
                url,
                username,
                password_env,
                tls_ca_file,
                ..
            } => rabbitmq_connection("confirmations", url, username, password_env, tls_ca_file)
                .map(Some),
            _ => Ok(None),
        }
    }
}

fn default_queue() -> String {
    "outbox-confirmations".into()
}

fn default_confirm_path() -> String {
    "/confirmations".into()
}

/// How long finished rows are kept: a duration (`"7d"`) or `"forever"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Retention {
    /// Delete finished rows older than this.
    For(Duration),
    /// Never delete.
    Forever,
}

impl<'de> Deserialize<'de> for Retention {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        if s == "forever" {
            return Ok(Retention::Forever);
        }
        humantime::parse_duration(&s)
            .map(Retention::For)
            .map_err(|e| {
                serde::de::Error::custom(format!(
                    "{s:?} is neither a duration nor \"forever\": {e}"
                ))
            })
    }
}

impl FileConfig {
    /// Read `path` (if given) and the `OUTBOX_*__*` environment overrides.
    ///
    /// # Errors
    /// The file is missing or not TOML, a field is unknown or has the wrong type (the error
    /// names the key).
    pub fn load(path: Option<&Path>) -> anyhow::Result<FileConfig> {
        let mut fig = Figment::new();
        if let Some(p) = path {
            if !p.exists() {
                bail!("configuration file {} does not exist", p.display());
            }
            fig = fig.merge(Toml::file(p));
        }
        fig = fig.merge(
            Env::prefixed("OUTBOX_")
                .filter(|k| {
                    let k = k.as_str().to_ascii_lowercase();
                    ["database__", "relay__", "transports__", "confirmations__"]
                        .iter()
                        .any(|s| k.starts_with(s))
                })
                .split("__"),
        );
        fig.extract()
            .map_err(|e| anyhow::anyhow!("invalid configuration: {e}"))
    }

    /// The relay configuration, validated.
    ///
    /// # Errors
    /// [`ConfigError`] naming the field.
    pub fn relay_config(&self) -> Result<RelayConfig, ConfigError> {
        let r = &self.relay;
        let mut c = RelayConfig::default();
        if let Some(v) = &r.name {
            c.name = v.clone();
        }
        macro_rules! set {
            ($($f:ident),*) => { $( if let Some(v) = r.$f { c.$f = v; } )* };
        }
        set!(
            batch_size,
            lease,
            publish_timeout,
            poll_interval,
            max_attempts,
            maintenance_interval,
            in_flight_batches,
            shutdown_timeout,
            max_check_backs,
            missing_destination_grace
        );
        match r.retention {
            Some(Retention::Forever) => c.retention = None,
            Some(Retention::For(d)) if d.is_zero() => {
                return Err(ConfigError::new(
                    "relay.retention",
                    "must be greater than zero, or \"forever\"",
                ));
            }
            Some(Retention::For(d)) => c.retention = Some(d),
            None => {}
        }
        c.backoff = Backoff {
            base: r.backoff_base.unwrap_or(c.backoff.base),
            max: r.backoff_max.unwrap_or(c.backoff.max),
            ..c.backoff
        };
        if c.backoff.base.is_zero() {
            return Err(ConfigError::new(
                "relay.backoff_base",
                "must be greater than zero",
            ));
        }
        if c.backoff.max < c.backoff.base {
            return Err(ConfigError::new(
                "relay.backoff_max",
                "must not be less than relay.backoff_base",
            ));
        }
        c.validate()?;
        Ok(c)
    }

    /// Check routes and transports without connecting.
    ///
    /// # Errors
    /// A [`ConfigError`] naming the field (`routes[0].transport`, `transports.x.url`, …).
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.relay_config()?;
        if self.database.url.is_empty() {
            return Err(ConfigError::new(
                "database.url",
                "missing: set it in [database], with --database, or in OUTBOX_DATABASE_URL",
            ));
        }
        if self.routes.is_empty() {
            return Err(ConfigError::new(
                "routes",
                "at least one [[routes]] entry is needed",
            ));
        }
        for (i, r) in self.routes.iter().enumerate() {
            if !self.transports.contains_key(&r.transport) {
                return Err(ConfigError::new(
                    format!("routes[{i}].transport"),
                    format!("no [transports.{}] section", r.transport),
                ));
            }
            if r.on_dead_letter.is_some() && !r.ordered {
                return Err(ConfigError::new(
                    format!("routes[{i}].on_dead_letter"),
                    "applies to ordered routes only: set `ordered = true` or remove it",
                ));
            }
            if let Some(c) = &r.confirm {
                if c.reply_to.is_empty() {
                    return Err(ConfigError::new(
                        format!("routes[{i}].confirm.reply_to"),
                        "must not be empty",
                    ));
                }
                if c.timeout.is_some_and(|t| t.is_zero()) {
                    return Err(ConfigError::new(
                        format!("routes[{i}].confirm.timeout"),
                        "must be greater than zero",
                    ));
                }
            }
            if r.topics.is_empty() || r.topics.trim_end_matches('*').contains('*') {
                return Err(ConfigError::new(
                    format!("routes[{i}].topics"),
                    "must be \"*\", \"prefix*\" or an exact topic (a '*' only at the end)",
                ));
            }
        }
        for (name, t) in &self.transports {
            match t {
                TransportSection::Webhook(w) => {
                    let url = url_ok(&w.url, &["http", "https"]);
                    url.map_err(|r| ConfigError::new(format!("transports.{name}.url"), r))?;
                    if let Some(var) = &w.secret_env
                        && std::env::var(var).is_err()
                    {
                        return Err(ConfigError::new(
                            format!("transports.{name}.secret_env"),
                            format!("environment variable {var} is not set"),
                        ));
                    }
                }
                TransportSection::Nats(n) => {
                    url_ok(&n.url, &["nats", "tls"])
                        .map_err(|r| ConfigError::new(format!("transports.{name}.url"), r))?;
                }
                #[cfg(feature = "redis")]
                TransportSection::Redis(r) => {
                    redis_config(name, r)?;
                }
                #[cfg(feature = "mqtt")]
                TransportSection::Mqtt(m) => {
                    mqtt_config(name, m)?;
                }
                TransportSection::Rocketmq(r) => {
                    rocketmq::transport_config(name, r)?;
                }
                #[cfg(feature = "rabbitmq")]
                TransportSection::Rabbitmq(r) => {
                    r.config(name)?;
                }
                #[cfg(feature = "kafka")]
                TransportSection::Kafka(k) => {
                    k.kafka_config(name, self.relay_config()?.publish_timeout)?;
                }
            }
        }
        for (i, r) in self.routes.iter().enumerate() {
            if let (Some(TransportSection::Rocketmq(_)), Some(d)) =
                (self.transports.get(&r.transport), &r.destination)
            {
                rocketmq::check_destination(d)
                    .map_err(|e| ConfigError::new(format!("routes[{i}].destination"), e))?;
            }
        }
        match &self.confirmations {
            Some(ConfirmationsSection::Nats {
                url,
                subject,
                queue,
            }) => {
                url_ok(url, &["nats", "tls"])
                    .map_err(|r| ConfigError::new("confirmations.url", r))?;
                let bad = |s: &str| {
                    s.is_empty()
                        || s.chars().any(|c| c.is_whitespace() || c.is_control())
                        || s.split('.').any(str::is_empty)
                };
                if bad(subject) {
                    return Err(ConfigError::new(
                        "confirmations.subject",
                        format!(
                            "{subject:?} is not a NATS subject (dot-separated non-empty tokens, no whitespace)"
                        ),
                    ));
                }
                if queue.is_empty() || queue.chars().any(|c| c.is_whitespace()) {
                    return Err(ConfigError::new(
                        "confirmations.queue",
                        "must be a non-empty name without whitespace",
                    ));
                }
            }
            #[cfg(feature = "redis")]
            Some(ConfirmationsSection::Redis {
                url,
                password_env,
                stream,
                group,
                consumer,
            }) => {
                url_ok(url, &["redis", "rediss"])
                    .map_err(|r| ConfigError::new("confirmations.url", r))?;
                env_secret("confirmations.password_env", password_env.as_ref())?;
                for (field, v) in [
                    ("confirmations.stream", Some(stream)),
                    ("confirmations.group", Some(group)),
                    ("confirmations.consumer", consumer.as_ref()),
                ] {
                    if v.is_some_and(|v| v.is_empty() || v.chars().any(char::is_whitespace)) {
                        return Err(ConfigError::new(
                            field,
                            "must be non-empty, without whitespace",
                        ));
                    }
                }
            }
            #[cfg(feature = "mqtt")]
            Some(ConfirmationsSection::Mqtt {
                url,
                topic,
                group,
                client_id,
                password_env,
                ..
            }) => {
                outbox::transport::mqtt::parse_url(url)
                    .map_err(|e| ConfigError::new("confirmations.url", e.reason))?;
                outbox::transport::mqtt::validate_topic(topic)
                    .map_err(|r| ConfigError::new("confirmations.topic", r))?;
                if group.is_empty() || group.contains(['/', '+', '#']) {
                    return Err(ConfigError::new(
                        "confirmations.group",
                        "must be non-empty, without / + #",
                    ));
                }
                if client_id.as_ref().is_some_and(String::is_empty) {
                    return Err(ConfigError::new(
                        "confirmations.client_id",
                        "must not be empty",
                    ));
                }
                env_secret("confirmations.password_env", password_env.as_ref())?;
            }
            Some(ConfirmationsSection::Rocketmq {
                url,
                destination,
                group,
                access_key,
                secret_key_env,
            }) => {
                rocketmq::listen_config(
                    url,
                    destination,
                    group,
                    access_key.as_deref(),
                    secret_key_env.as_deref(),
                )?;
            }
            #[cfg(feature = "rabbitmq")]
            Some(c @ ConfirmationsSection::Rabbitmq { queue, .. }) => {
                c.rabbitmq()?;
                if queue.is_empty() || queue.len() > 255 {
                    return Err(ConfigError::new(
                        "confirmations.queue",
                        "must be a queue name of 1 to 255 bytes",
                    ));
                }
            }
            #[cfg(feature = "kafka")]
            Some(ConfirmationsSection::Kafka(k)) => {
                k.kafka_config()?;
            }
            Some(ConfirmationsSection::Http { listen, path }) => {
                if listen.parse::<std::net::SocketAddr>().is_err() {
                    return Err(ConfigError::new(
                        "confirmations.listen",
                        format!("{listen:?} is not a socket address such as 127.0.0.1:8081"),
                    ));
                }
                if !path.starts_with('/') {
                    return Err(ConfigError::new("confirmations.path", "must start with /"));
                }
            }
            None => {}
        }
        Ok(())
    }

    /// Build every transport and the router. The broker transports (everything but webhooks) are
    /// [`LazyTransport`](outbox::transport::lazy::LazyTransport)s: their settings are validated
    /// here, their connection is made by their first successful probe, so a broker that is down
    /// at start-up pauses its transport (the relay probes it with backoff) instead of stopping
    /// the daemon.
    ///
    /// # Errors
    /// A transport whose settings are invalid, named (`transports.<name>.<field>`).
    pub async fn router(&self) -> anyhow::Result<Router> {
        self.validate()?;
        let mut built: BTreeMap<&str, Arc<dyn Transport>> = BTreeMap::new();
        for (name, t) in &self.transports {
            if !self.routes.iter().any(|r| &r.transport == name) {
                continue;
            }
            let transport: Arc<dyn Transport> = match t {
                TransportSection::Webhook(w) => {
                    let mut c = outbox::WebhookConfig::new(&w.url);
                    if let Some(var) = &w.secret_env {
                        c.secret = Some(
                            std::env::var(var)
                                .with_context(|| format!("transports.{name}.secret_env"))?,
                        );
                    }
                    if let Some(t) = w.timeout {
                        c.timeout = t;
                    }
                    if let Some(n) = w.concurrency {
                        c.concurrency = n;
                    }
                    Arc::new(outbox::WebhookTransport::new(c).map_err(|e| prefix(e, name))?)
                }
                #[cfg(feature = "rabbitmq")]
                TransportSection::Rabbitmq(r) => {
                    let c = r.config(name)?;
                    c.validate().map_err(|e| prefix(e, name))?;
                    lazy("rabbitmq", move || {
                        outbox::RabbitMqTransport::connect(c.clone())
                    })
                }
                TransportSection::Nats(n) => {
                    let mut c = outbox::NatsConfig::new(&n.url);
                    if let Some(s) = &n.stream {
                        let subjects = if n.subjects.is_empty() {
                            vec![format!("{}.>", s.to_lowercase())]
                        } else {
                            n.subjects.clone()
                        };
                        c.stream = Some(outbox::StreamSetup {
                            name: s.clone(),
                            subjects,
                            create: n.create_stream,
                        });
                    }
                    if let Some(t) = n.ack_timeout {
                        c.ack_timeout = t;
                    }
                    lazy("nats", move || outbox::NatsTransport::connect(c.clone()))
                }
                #[cfg(feature = "redis")]
                TransportSection::Redis(r) => {
                    let c = redis_config(name, r)?;
                    c.validate().map_err(|e| prefix(e, name))?;
                    lazy("redis", move || outbox::RedisTransport::connect(c.clone()))
                }
                #[cfg(feature = "mqtt")]
                TransportSection::Mqtt(m) => {
                    let c = mqtt_config(name, m)?;
                    lazy("mqtt", move || outbox::MqttTransport::connect(c.clone()))
                }
                TransportSection::Rocketmq(r) => rocketmq::connect(name, r).await?,
                #[cfg(feature = "kafka")]
                TransportSection::Kafka(k) => {
                    let c = k.kafka_config(name, self.relay_config()?.publish_timeout)?;
                    c.validate().map_err(|e| prefix(e, name))?;
                    c.check_features().map_err(|e| prefix(e, name))?;
                    let topics = k.topics();
                    lazy("kafka", move || {
                        let (c, topics) = (c.clone(), topics.clone());
                        async move {
                            if !topics.is_empty() {
                                outbox::transport::kafka::create_topics(&c, &topics).await?;
                            }
                            outbox::KafkaTransport::connect(c).await
                        }
                    })
                }
            };
            built.insert(name, transport);
        }
        let mut router = Router::new();
        for r in &self.routes {
            let t = built[r.transport.as_str()].clone();
            let default_dest = self.transports[&r.transport].default_destination();
            let dest = r.destination.clone().unwrap_or(default_dest);
            router = match &r.confirm {
                Some(c) => {
                    let mut policy = outbox::ConfirmPolicy::new(&c.reply_to);
                    if let Some(t) = c.timeout {
                        policy.timeout = t;
                    }
                    router.route_confirmed(&r.topics, t, dest, policy)
                }
                None => router.route(&r.topics, t, dest),
            };
            if r.ordered {
                router = router.ordered(match r.on_dead_letter {
                    Some(DeadLetterSetting::Block) => outbox::DeadLetterPolicy::Block,
                    Some(DeadLetterSetting::Skip) | None => outbox::DeadLetterPolicy::Skip,
                });
            }
        }
        Ok(router)
    }
}

/// `kind = "rocketmq"`: building the library's settings from the sections, with errors naming
/// the TOML fields. Without the `rocketmq` feature every use is an error saying so.
pub mod rocketmq {
    use super::*;

    /// The error for a RocketMQ section in a build without the feature.
    #[cfg(not(feature = "rocketmq"))]
    fn not_built(field: String) -> ConfigError {
        ConfigError::new(
            field,
            "RocketMQ support is not compiled in: build outbox-cli with --features rocketmq",
        )
    }

    /// The secret key named by `secret_key_env`, checked together with `access_key`.
    fn secret(
        prefix: &str,
        access_key: Option<&str>,
        secret_key_env: Option<&str>,
    ) -> Result<Option<(String, String)>, ConfigError> {
        match (access_key, secret_key_env) {
            (None, None) => Ok(None),
            (Some(ak), Some(var)) => {
                if ak.is_empty() {
                    return Err(ConfigError::new(
                        format!("{prefix}access_key"),
                        "must not be empty",
                    ));
                }
                let sk = std::env::var(var).map_err(|_| {
                    ConfigError::new(
                        format!("{prefix}secret_key_env"),
                        format!("environment variable {var} is not set"),
                    )
                })?;
                Ok(Some((ak.to_owned(), sk)))
            }
            (Some(_), None) => Err(ConfigError::new(
                format!("{prefix}secret_key_env"),
                "required with access_key: the environment variable holding the secret key",
            )),
            (None, Some(_)) => Err(ConfigError::new(
                format!("{prefix}access_key"),
                "required with secret_key_env",
            )),
        }
    }

    /// The transport settings of `[transports.<name>]`, validated.
    ///
    /// # Errors
    /// [`ConfigError`] naming `transports.<name>.<field>`.
    #[cfg(feature = "rocketmq")]
    pub fn transport_config(
        name: &str,
        s: &RocketMqSection,
    ) -> Result<outbox::RocketMqConfig, ConfigError> {
        use outbox::transport::rocketmq::{Credentials, Destination, RocketMqConfig};
        let field = |f: &str| format!("transports.{name}.{f}");
        let mut c = RocketMqConfig::from_url(&s.url)
            .map_err(|e| ConfigError::new(field("url"), e.reason))?;
        if let Some(g) = &s.producer_group {
            c.producer_group = g.clone();
        }
        if let Some(t) = s.send_timeout {
            c.send_timeout = t;
        }
        if let Some(n) = s.retries {
            c.retries = n;
        }
        if let Some(n) = s.max_message_size {
            c.max_message_size = n;
        }
        if let Some(n) = s.max_in_flight {
            c.max_in_flight = n;
        }
        if let Some(b) = s.order_by_partition_key {
            c.order_by_partition_key = b;
        }
        c.credentials = secret(
            &field(""),
            s.access_key.as_deref(),
            s.secret_key_env.as_deref(),
        )?
        .map(|(access_key, secret_key)| Credentials {
            access_key,
            secret_key,
        });
        if let Some(t) = &s.default_topic {
            Destination::parse(t)
                .ok()
                .filter(|d| d.tag.is_none())
                .ok_or_else(|| {
                    ConfigError::new(
                        field("default_topic"),
                        format!("{t:?} is not a RocketMQ topic name (letters, digits, %|_-, at most 127)"),
                    )
                })?;
        }
        c.validate().map_err(|e| {
            let f = match e.field.as_str() {
                "name_server" => "url",
                "credentials" => "access_key",
                other => other,
            };
            ConfigError::new(field(f), e.reason)
        })?;
        Ok(c)
    }

    /// As above, in a build without the feature: always an error.
    ///
    /// # Errors
    /// Always, naming `transports.<name>.kind`.
    #[cfg(not(feature = "rocketmq"))]
    pub fn transport_config(name: &str, _s: &RocketMqSection) -> Result<(), ConfigError> {
        Err(not_built(format!("transports.{name}.kind")))
    }

    /// Check a route destination template for a RocketMQ transport: `Topic` or `Topic:Tag` once
    /// `{topic}` is replaced (a sample topic `t` stands for it).
    ///
    /// # Errors
    /// The rule it breaks.
    pub fn check_destination(template: &str) -> Result<(), String> {
        #[cfg(feature = "rocketmq")]
        {
            outbox::transport::rocketmq::Destination::parse(&template.replace("{topic}", "t"))
                .map(|_| ())
        }
        #[cfg(not(feature = "rocketmq"))]
        {
            let _ = template;
            Ok(())
        }
    }

    /// The transport of `[transports.<name>]`, connected by its first probe
    /// ([`super::lazy`]).
    ///
    /// # Errors
    /// The section is invalid (named).
    pub async fn connect(name: &str, s: &RocketMqSection) -> anyhow::Result<Arc<dyn Transport>> {
        #[cfg(feature = "rocketmq")]
        {
            let c = transport_config(name, s)?;
            c.validate().map_err(|e| prefix(e, name))?;
            Ok(super::lazy("rocketmq", move || {
                outbox::RocketMqTransport::connect(c.clone())
            }))
        }
        #[cfg(not(feature = "rocketmq"))]
        {
            let _ = s;
            Err(not_built(format!("transports.{name}.kind")).into())
        }
    }

    /// The confirmation listener settings of `[confirmations] kind = "rocketmq"`, validated.
    ///
    /// # Errors
    /// [`ConfigError`] naming `confirmations.<field>`.
    #[cfg(feature = "rocketmq")]
    pub fn listen_config(
        url: &str,
        destination: &str,
        group: &str,
        access_key: Option<&str>,
        secret_key_env: Option<&str>,
    ) -> Result<outbox::confirm::rocketmq::ListenConfig, ConfigError> {
        let ns = outbox::transport::rocketmq::name_server_of_url(url)
            .map_err(|e| ConfigError::new("confirmations.url", e.reason))?;
        let mut c = outbox::confirm::rocketmq::ListenConfig::new(ns, destination, group);
        c.credentials = secret("confirmations.", access_key, secret_key_env)?.map(
            |(access_key, secret_key)| outbox::transport::rocketmq::Credentials {
                access_key,
                secret_key,
            },
        );
        c.validate().map_err(|e| {
            let f = if e.field == "name_server" {
                "url"
            } else {
                e.field.as_str()
            };
            ConfigError::new(format!("confirmations.{f}"), e.reason)
        })?;
        Ok(c)
    }

    /// As above, in a build without the feature: always an error.
    ///
    /// # Errors
    /// Always, naming `confirmations.kind`.
    #[cfg(not(feature = "rocketmq"))]
    pub fn listen_config(
        _url: &str,
        _destination: &str,
        _group: &str,
        access_key: Option<&str>,
        secret_key_env: Option<&str>,
    ) -> Result<(), ConfigError> {
        let _ = secret("confirmations.", access_key, secret_key_env);
        Err(not_built("confirmations.kind".into()))
    }
}

/// A [`LazyTransport`](outbox::transport::lazy::LazyTransport) named `kind` whose probe runs
/// `connect`; a connection error becomes an `Unavailable` error carrying its reason (the relay
/// logs it when it pauses the transport, and keeps probing with backoff).
fn lazy<T, F, Fut>(kind: &'static str, connect: F) -> Arc<dyn Transport>
where
    T: Transport,
    F: Fn() -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = Result<T, ConfigError>> + Send + 'static,
{
    Arc::new(outbox::transport::lazy::LazyTransport::new(
        kind,
        move || {
            let connecting = connect();
            Box::pin(async move {
                match connecting.await {
                    Ok(t) => Ok(Arc::new(t) as Arc<dyn Transport>),
                    Err(e) => Err(outbox::TransportError::unavailable(format!(
                        "cannot connect the {kind} transport ({}): {}",
                        e.field, e.reason
                    ))),
                }
            })
        },
    ))
}

fn prefix(e: ConfigError, name: &str) -> ConfigError {
    ConfigError::new(format!("transports.{name}.{}", e.field), e.reason)
}

fn url_ok(url: &str, schemes: &[&str]) -> Result<(), String> {
    let Some((scheme, rest)) = url.split_once("://") else {
        return Err(format!(
            "{url:?} is not a URL (expected {}://…)",
            schemes[0]
        ));
    };
    if !schemes.contains(&scheme) {
        return Err(format!("scheme {scheme:?} is not one of {schemes:?}"));
    }
    if rest.is_empty() {
        return Err("host is missing".into());
    }
    Ok(())
}

#[cfg(test)]
mod tests;
