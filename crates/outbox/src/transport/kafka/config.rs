//! Kafka transport settings: the connection configuration (SASL, TLS, librdkafka properties), topic names and topics to create.

use super::*;

/// Connection and producer settings of a Kafka cluster.
///
/// The connection part (bootstrap servers, client id, SASL, TLS, [`properties`](Self::properties))
/// is shared by the producer, the consumer runner ([`crate::consumer::kafka`]) and the
/// confirmation listener ([`crate::confirm::kafka`]).
///
/// Also the `[transports.<name>] kind = "kafka"` table of the configuration file (see
/// [`TransportConfig`](crate::transport::config::TransportConfig)): durations written `"5s"`, `sasl` and
/// `tls` as inline tables, `properties` as a table of strings; every field but
/// `bootstrap_servers` may be left out.
#[derive(Clone, serde::Deserialize, serde::Serialize, derive_more::Debug)]
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
    #[debug("{:?}", redacted(properties))]
    pub properties: BTreeMap<String, String>,
    /// Topics the transport built by
    /// [`TransportConfig::build`](crate::transport::config::TransportConfig::build) creates when missing
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

pub(super) fn de_bootstrap<'de, D: serde::Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    let s = <String as serde::Deserialize>::deserialize(d)?;
    Ok(KafkaConfig::new(s).bootstrap_servers)
}

/// `properties` as `Debug` prints them: the value of every secret property ([`is_secret`])
/// replaced by `***`.
// Called only from the derived `Debug`, which the dead-code lint does not count as a use.
#[allow(dead_code)]
fn redacted(properties: &BTreeMap<String, String>) -> BTreeMap<&str, &str> {
    properties
        .iter()
        .map(|(k, v)| (k.as_str(), if is_secret(k) { "***" } else { v }))
        .collect()
}

pub(super) fn plain() -> String {
    "PLAIN".into()
}

/// SASL authentication (`security.protocol=sasl_plaintext`, or `sasl_ssl` with [`KafkaTls`]).
///
/// In a configuration file: `sasl = { mechanism = "PLAIN", username_env = "…", password_env =
/// "…" }`, the credentials read from the named environment variables by
/// [`KafkaConfig::resolve_secrets`].
#[derive(Clone, Default, serde::Deserialize, serde::Serialize, derive_more::Debug)]
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
    #[debug("***")]
    pub password: String,
    /// Name of the environment variable holding the user name, read when `username` is empty.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub username_env: Option<String>,
    /// Name of the environment variable holding the password, read when `password` is empty.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub password_env: Option<String>,
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
pub(super) fn is_secret(key: &str) -> bool {
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
                s.username = crate::transport::settings::env_secret("sasl.username_env", var)?
                    .unwrap_or_default();
            }
            if s.password.is_empty() {
                let var = s.password_env.as_deref();
                s.password = crate::transport::settings::env_secret("sasl.password_env", var)?
                    .unwrap_or_default();
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
        ConfigError::invalid_if(self.partitions < 1, "partitions", "must be at least 1")?;
        ConfigError::invalid_if(self.replication < 1, "replication", "must be at least 1")?;
        Ok(())
    }

    /// [`KafkaConfig::validate`] of the settings themselves, secrets as they are.
    pub(super) fn check(&self) -> Result<(), ConfigError> {
        ConfigError::invalid_if(
            self.bootstrap_servers.is_empty(),
            "bootstrap_servers",
            "must not be empty",
        )?;
        for server in self.bootstrap_servers.split(',') {
            let ok = server
                .rsplit_once(':')
                .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok());
            ConfigError::invalid_if(
                !ok,
                "bootstrap_servers",
                format!("{server:?} is not host:port"),
            )?;
        }
        ConfigError::invalid_if(self.client_id.is_empty(), "client_id", "must not be empty")?;
        ConfigError::invalid_if(
            self.delivery_timeout < Duration::from_millis(1),
            "delivery_timeout",
            "must be at least 1 ms",
        )?;
        ConfigError::zero_if(self.connect_timeout.is_zero(), "connect_timeout")?;
        ConfigError::invalid_if(
            !(1000..=1_000_000_000).contains(&self.max_message_bytes),
            "max_message_bytes",
            "must be 1000 to 1000000000 (librdkafka's range)",
        )?;
        if let Some(s) = &self.sasl {
            ConfigError::invalid_if(
                !["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"].contains(&s.mechanism.as_str()),
                "sasl.mechanism",
                format!(
                    "{:?} is not PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512",
                    s.mechanism
                ),
            )?;
            ConfigError::invalid_if(s.username.is_empty(), "sasl.username", "must not be empty")?;
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
        ConfigError::invalid_if(
            self.tls.is_some() && !has("ssl"),
            "tls",
            format!(
                "this librdkafka build has no TLS support (builtin.features = {features}); \
                     build outbox with the rdkafka crate's `ssl` feature"
            ),
        )?;
        if let Some(s) = &self.sasl {
            let needed = if s.mechanism == "PLAIN" {
                "sasl_plain"
            } else {
                "sasl_scram"
            };
            ConfigError::invalid_if(
                !has(needed),
                "sasl.mechanism",
                format!(
                    "this librdkafka build cannot do {} (builtin.features = {features}); \
                         build outbox with the rdkafka crate's `ssl` feature for SCRAM",
                    s.mechanism
                ),
            )?;
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
/// A permanent error whose source is a [`WireError`](crate::transport::wire::WireError) naming the topic.
pub(crate) fn check_message(out: &Outgoing<'_>) -> Result<(), TransportError> {
    if valid_topic(out.destination) {
        Ok(())
    } else {
        Err(crate::transport::wire::WireError::unsupported(
            crate::transport::wire::Broker::Kafka,
            crate::transport::wire::Field::Destination(out.destination.to_owned()),
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
