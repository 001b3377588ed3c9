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
    /// Rows per claim.
    pub batch_size: Option<u32>,
    /// Claim lease.
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
    /// Reaper period.
    #[serde(default, with = "humantime_serde")]
    pub reap_interval: Option<Duration>,
    /// Batches in flight.
    pub in_flight_batches: Option<usize>,
    /// Graceful shutdown limit.
    #[serde(default, with = "humantime_serde")]
    pub shutdown_timeout: Option<Duration>,
    /// Check-backs before an unconfirmed message is FAILED.
    pub max_check_backs: Option<u32>,
    /// Retention of finished rows (`"7d"` or `"forever"`).
    pub retention: Option<Retention>,
}

/// `[transports.<name>]`, tagged by `kind`.
#[derive(Debug, Clone, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum TransportSection {
    /// `kind = "webhook"`.
    Webhook(WebhookSection),
    /// `kind = "nats"`.
    Nats(NatsSection),
    /// `kind = "kafka"` (feature `kafka`).
    #[cfg(feature = "kafka")]
    Kafka(Box<KafkaSection>),
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
            reap_interval,
            in_flight_batches,
            shutdown_timeout,
            max_check_backs
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
                #[cfg(feature = "kafka")]
                TransportSection::Kafka(k) => {
                    k.kafka_config(name, self.relay_config()?.publish_timeout)?;
                }
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

    /// Connect every transport and build the router.
    ///
    /// # Errors
    /// A transport that cannot be built or reached, named.
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
                    Arc::new(
                        outbox::NatsTransport::connect(c)
                            .await
                            .map_err(|e| prefix(e, name))?,
                    )
                }
                #[cfg(feature = "kafka")]
                TransportSection::Kafka(k) => {
                    let c = k.kafka_config(name, self.relay_config()?.publish_timeout)?;
                    if !k.create_topics.is_empty() {
                        outbox::transport::kafka::create_topics(&c, &k.topics())
                            .await
                            .map_err(|e| prefix(e, name))?;
                    }
                    Arc::new(
                        outbox::KafkaTransport::connect(c)
                            .await
                            .map_err(|e| prefix(e, name))?,
                    )
                }
            };
            built.insert(name, transport);
        }
        let mut router = Router::new();
        for r in &self.routes {
            let t = built[r.transport.as_str()].clone();
            let default_dest = match &self.transports[&r.transport] {
                TransportSection::Webhook(_) => "",
                TransportSection::Nats(_) => "{topic}",
                #[cfg(feature = "kafka")]
                TransportSection::Kafka(_) => "{topic}",
            };
            let dest = r.destination.clone().unwrap_or_else(|| default_dest.into());
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
        }
        Ok(router)
    }
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
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<FileConfig, Box<figment::Error>> {
        Figment::from(Toml::string(s)).extract().map_err(Box::new)
    }

    const GOOD: &str = r#"
        [database]
        url = "sqlite://x.db"
        [relay]
        batch_size = 100
        lease = "30s"
        [transports.hooks]
        kind = "webhook"
        url = "http://127.0.0.1:9/"
        [transports.bus]
        kind = "nats"
        url = "nats://127.0.0.1:4222"
        stream = "ORDERS"
        [[routes]]
        topics = "order-*"
        transport = "bus"
        destination = "orders.{topic}"
        [[routes]]
        topics = "*"
        transport = "hooks"
    "#;

    #[test]
    fn good_file_parses_and_validates() {
        let c = parse(GOOD).unwrap();
        c.validate().unwrap();
        assert_eq!(c.relay_config().unwrap().batch_size, 100);
        assert_eq!(c.database.table, "outbox");
    }

    #[test]
    fn confirmations_and_retention_parse() {
        let with = GOOD.replace(
            "destination = \"orders.{topic}\"",
            "destination = \"orders.{topic}\"\nconfirm = { reply_to = \"orders.confirm\", timeout = \"2m\" }",
        ) + "\n[confirmations]\nkind = \"nats\"\nurl = \"nats://127.0.0.1:4222\"\nsubject = \"orders.confirm\"\n";
        let with = with.replace(
            "lease = \"30s\"",
            "lease = \"30s\"\nretention = \"forever\"\nmax_check_backs = 7",
        );
        let c = parse(&with).unwrap();
        c.validate().unwrap();
        let r = c.relay_config().unwrap();
        assert_eq!(r.retention, None);
        assert_eq!(r.max_check_backs, 7);
        assert_eq!(
            c.routes[0].confirm.as_ref().unwrap().timeout,
            Some(Duration::from_secs(120))
        );
        assert!(
            matches!(c.confirmations, Some(ConfirmationsSection::Nats { ref queue, .. }) if queue == "outbox-confirmations")
        );
        let e = parse(&with.replace("retention = \"forever\"", "retention = \"soon\""))
            .unwrap_err()
            .to_string();
        assert!(e.contains("retention"), "{e}");
        let e = parse(&with.replace("subject = \"orders.confirm\"", "subject = \"x\"\nbogus = 1"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("bogus"), "{e}");
        let c = parse(&with.replace("subject = \"orders.confirm\"", "subject = \"r c\"")).unwrap();
        assert_eq!(c.validate().unwrap_err().field, "confirmations.subject");
        let http = with.replace(
            "kind = \"nats\"\nurl = \"nats://127.0.0.1:4222\"\nsubject = \"orders.confirm\"",
            "kind = \"http\"\nlisten = \"127.0.0.1:8081\"\npath = \"confirm\"",
        );
        assert_eq!(
            parse(&http).unwrap().validate().unwrap_err().field,
            "confirmations.path"
        );
        let c = parse(&with.replace("retention = \"forever\"", "retention = \"3d\"")).unwrap();
        assert_eq!(
            c.relay_config().unwrap().retention,
            Some(Duration::from_secs(3 * 86400))
        );
    }

    #[test]
    fn unknown_field_is_named() {
        let e = parse(&GOOD.replace("batch_size = 100", "batch_sise = 100"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("batch_sise"), "{e}");
    }

    #[cfg(feature = "kafka")]
    const KAFKA: &str = r#"
        [transports.k]
        kind = "kafka"
        bootstrap_servers = "kafka://127.0.0.1:19092"
        delivery_timeout = "3s"
        max_message_bytes = 1048576
        create_topics = ["orders.created"]
        partitions = 3
        [transports.k.properties]
        "compression.type" = "lz4"
        [[routes]]
        topics = "kafka-*"
        transport = "k"
    "#;

    #[cfg(feature = "kafka")]
    #[test]
    fn kafka_section_parses_and_names_bad_fields() {
        let good = format!("{GOOD}{KAFKA}");
        let c = parse(&good).unwrap();
        c.validate().unwrap();
        let TransportSection::Kafka(k) = &c.transports["k"] else {
            panic!("kafka section");
        };
        let kc = k.kafka_config("k", Duration::from_secs(10)).unwrap();
        assert_eq!(kc.bootstrap_servers, "127.0.0.1:19092");
        assert_eq!(kc.delivery_timeout, Duration::from_secs(3));
        assert_eq!(kc.max_message_bytes, 1048576);
        assert_eq!(kc.properties["compression.type"], "lz4");
        assert_eq!(k.topics()[0].partitions, 3);
        let field = |from: &str, to: &str| {
            let c = parse(&good.replace(from, to)).unwrap();
            c.validate().unwrap_err().field
        };
        assert_eq!(
            field("kafka://127.0.0.1:19092", "nohostport"),
            "transports.k.bootstrap_servers"
        );
        // The relay's default publish timeout is 10 s.
        assert_eq!(
            field("delivery_timeout = \"3s\"", "delivery_timeout = \"10s\""),
            "transports.k.delivery_timeout"
        );
        assert_eq!(
            field("\"compression.type\" = \"lz4\"", "acks = \"1\""),
            "transports.k.properties.acks"
        );
        assert_eq!(
            field("[\"orders.created\"]", "[\"bad topic\"]"),
            "transports.k.create_topics"
        );
        assert_eq!(
            field("partitions = 3", "partitions = 0"),
            "transports.k.partitions"
        );
        assert_eq!(
            field(
                "partitions = 3",
                "sasl = { username_env = \"OUTBOX_TEST_SURELY_UNSET_USER\", password_env = \"OUTBOX_TEST_SURELY_UNSET_PASSWORD\" }"
            ),
            "transports.k.sasl.username_env"
        );
        if !outbox::transport::kafka::builtin_features()
            .split(',')
            .any(|f| f == "ssl")
        {
            assert_eq!(
                field("partitions = 3", "tls = { ca_file = \"/etc/ssl/ca.pem\" }"),
                "transports.k.tls"
            );
        }
        let e = parse(&good.replace("partitions = 3", "partitons = 3"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("partitons"), "{e}");
    }

    #[cfg(feature = "kafka")]
    #[test]
    fn kafka_confirmations_parse_and_validate() {
        let with = format!(
            "{GOOD}\n[confirmations]\nkind = \"kafka\"\nbootstrap_servers = \"127.0.0.1:19092\"\ntopic = \"orders.confirm\"\n"
        );
        let c = parse(&with).unwrap();
        c.validate().unwrap();
        let Some(ConfirmationsSection::Kafka(k)) = &c.confirmations else {
            panic!("kafka confirmations");
        };
        assert_eq!(k.group, "outbox-confirmations");
        let c = parse(&with.replace("orders.confirm", "orders confirm")).unwrap();
        assert_eq!(c.validate().unwrap_err().field, "confirmations.topic");
        let c = parse(&with.replace("127.0.0.1:19092", "")).unwrap();
        assert_eq!(
            c.validate().unwrap_err().field,
            "confirmations.bootstrap_servers"
        );
        let e = parse(&format!("{with}bogus = 1\n"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("bogus"), "{e}");
    }

    #[test]
    fn bad_values_name_the_field() {
        let c = parse(&GOOD.replace("lease = \"30s\"", "lease = \"1s\"")).unwrap();
        assert_eq!(c.validate().unwrap_err().field, "relay.lease");
        let c = parse(&GOOD.replace("transport = \"bus\"", "transport = \"nope\"")).unwrap();
        assert_eq!(c.validate().unwrap_err().field, "routes[0].transport");
        let c = parse(&GOOD.replace("http://127.0.0.1:9/", "ftp://x")).unwrap();
        assert_eq!(c.validate().unwrap_err().field, "transports.hooks.url");
        let e = parse(&GOOD.replace("batch_size = 100", "batch_size = \"many\""))
            .unwrap_err()
            .to_string();
        assert!(e.contains("batch_size"), "{e}");
    }
}
