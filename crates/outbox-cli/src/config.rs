//! The `outbox relay` configuration file (TOML), with environment overrides.
//!
//! Every field is documented in `docs/configuration.md`. The file maps onto the library's own
//! configuration types and nothing more: `[relay]` is [`RelayConfig`], each
//! `[transports.<name>]` a [`TransportConfig`] (tagged by `kind`), each `[[routes]]` a
//! [`RouteConfig`]; they define the keys, defaults, durations (`"30s"`, `"500ms"`, `"5m"`) and
//! validation. Only `[database]` (a URL and table names) and `[confirmations]` (the listeners,
//! whose settings are not serde types) are declared here. Unknown fields are errors.
//! Environment variables override the file: `OUTBOX_<SECTION>__<FIELD>` (double underscore
//! between levels), for example `OUTBOX_DATABASE__URL=postgres://…` or
//! `OUTBOX_RELAY__BATCH_SIZE=1000`. Secrets are never written in the file: a transport names the
//! environment variable that holds them.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::bail;
use figment::Figment;
use figment::providers::{Env, Format, Toml};
use outbox::transport::config::{check_routes, env_secret};
use outbox::{ConfigError, RelayConfig, RouteConfig, Router, StoreOptions, TransportConfig};
use serde::Deserialize;

/// The whole file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    /// `[database]`; may be left out when `--database` or `OUTBOX_DATABASE_URL` gives the URL.
    #[serde(default)]
    pub database: DatabaseSection,
    /// `[[databases]]`: several databases relayed by this daemon, each on its own
    /// ([`outbox::RelayGroup`], docs/scaling.md); instead of `[database]`. Default: none.
    #[serde(default)]
    pub databases: Vec<DatabasesEntry>,
    /// `[relay]`; every field optional.
    #[serde(default)]
    pub relay: RelayConfig,
    /// `[transports.<name>]`: named transports.
    #[serde(default)]
    pub transports: BTreeMap<String, TransportConfig>,
    /// `[[routes]]`: topic patterns to transports, first match wins.
    #[serde(default)]
    pub routes: Vec<RouteConfig>,
    /// `[confirmations]`: where consumer confirmations are received. Default: none.
    pub confirmations: Option<ConfirmationsSection>,
    /// `[admin]`: the HTTP listener for `/metrics`. Default: none (no listener).
    pub admin: Option<AdminSection>,
    /// `[logging]`: the periodic summary line.
    #[serde(default)]
    pub logging: LoggingSection,
}

/// `[logging]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoggingSection {
    /// Every this long the daemon logs one summary line at INFO: published, retried and
    /// dead-lettered since the last one, pending rows, oldest pending age, dead letters (one
    /// `outbox status` query). `"0s"` turns it off. Default `"60s"`.
    #[serde(default = "default_summary", with = "humantime_serde")]
    pub summary_interval: std::time::Duration,
}

impl Default for LoggingSection {
    fn default() -> Self {
        LoggingSection {
            summary_interval: default_summary(),
        }
    }
}

fn default_summary() -> std::time::Duration {
    std::time::Duration::from_secs(60)
}

/// `[admin]`: where the daemon serves its Prometheus metrics (`GET /metrics`), health checks and
/// the admin API (`/api/…`, [`outbox::admin::http`]) (docs/operations.md).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdminSection {
    /// Socket address, e.g. `127.0.0.1:9464` (Prometheus' default exporter port range); port 0
    /// picks a free port (logged). Required.
    pub listen: std::net::SocketAddr,
    /// How often the backlog gauges are sampled from the database (one `outbox status` query).
    /// Default 15 s.
    #[serde(default = "default_backlog_sample", with = "humantime_serde")]
    pub backlog_sample_interval: std::time::Duration,
    /// The environment variable holding the admin API's bearer token. Without one (or when the
    /// variable is unset or empty) the API only reads. Default: none.
    #[serde(default)]
    pub token_env: Option<String>,
    /// Reads of the admin API need the token too. Default `false`.
    #[serde(default)]
    pub protect_reads: bool,
}

impl AdminSection {
    /// The admin API's authentication: the token read from `token_env`.
    ///
    /// # Errors
    /// `protect_reads` without a token (every read would be refused), naming the setting.
    pub fn auth(&self) -> anyhow::Result<outbox::admin::http::AdminAuth> {
        crate::messages::admin_auth(self.token_env.as_deref(), self.protect_reads)
            .map_err(|e| anyhow::anyhow!("admin.{e}"))
    }
}

fn default_backlog_sample() -> std::time::Duration {
    std::time::Duration::from_secs(15)
}

/// `[database]`: the store's URL ([`outbox::store::connect`]) and its [`StoreOptions`] tables.
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
    /// Build the optional search indexes at start, in the background, where they are missing
    /// ([`outbox::Store::create_search_indexes`], docs/operations.md "Search indexes"). Default
    /// `false`.
    #[serde(default)]
    pub search_indexes: bool,
}

impl Default for DatabaseSection {
    fn default() -> Self {
        DatabaseSection {
            url: String::new(),
            table: default_table(),
            inbox_table: default_inbox_table(),
            search_indexes: false,
        }
    }
}

fn default_table() -> String {
    StoreOptions::default().table
}

fn default_inbox_table() -> String {
    StoreOptions::default().inbox_table
}

/// One `[[databases]]` entry: a database the daemon relays beside the others, with its own
/// pool, membership and bucket leases (a member of the daemon's [`outbox::RelayGroup`]), or, with
/// `schemas` or `schemas_query` (PostgreSQL), one member per tenant schema of that database.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DatabasesEntry {
    /// The database's name in logs, metrics (`database="<name>"`), health and the admin
    /// surface (`/databases/<name>/`): 1 to 64 ASCII letters, digits, `_`, `-` or `.`; unique.
    /// A tenant schema's member is named `<name>/<schema>`. Required.
    pub name: String,
    /// `postgres://…`, `mysql://…` (`mariadb://…`) or `sqlite://path`. Required.
    pub url: String,
    /// Outbox table (unqualified with `schemas`: each tenant's is `<schema>.<table>`). Default
    /// `outbox`.
    #[serde(default = "default_table")]
    pub table: String,
    /// Inbox table (with `schemas`: `<schema>.<inbox_table>`). Default `outbox_inbox`.
    #[serde(default = "default_inbox_table")]
    pub inbox_table: String,
    /// As `[database] search_indexes`. Default `false`.
    #[serde(default)]
    pub search_indexes: bool,
    /// Routes of this database instead of the file's `[[routes]]` (same form, over the same
    /// `[transports]`). Default: the file's.
    #[serde(default)]
    pub routes: Option<Vec<RouteConfig>>,
    /// PostgreSQL: relay every schema whose name matches this SQL `LIKE` pattern (`tenant_%`)
    /// and that holds `table`, each as its own member; the list is read again every
    /// `rediscover_interval`, so tenants added (and migrated) or dropped are picked up without a
    /// restart. The schemas share one pool of the database. Default: none (the database's own
    /// `table`).
    #[serde(default)]
    pub schemas: Option<String>,
    /// PostgreSQL: as `schemas`, the schemas being the first column (text) of this query's rows,
    /// e.g. `SELECT schema_name FROM tenants WHERE active`. Default: none.
    #[serde(default)]
    pub schemas_query: Option<String>,
    /// How often the tenant schemas are listed again. Default `"30s"`.
    #[serde(default = "default_rediscover", with = "humantime_serde")]
    pub rediscover_interval: std::time::Duration,
}

fn default_rediscover() -> std::time::Duration {
    std::time::Duration::from_secs(30)
}

impl DatabasesEntry {
    /// Whether its members are discovered tenant schemas.
    pub fn discovers(&self) -> bool {
        self.schemas.is_some() || self.schemas_query.is_some()
    }

    /// The routes this database uses: its own or the file's.
    pub fn routes<'a>(&'a self, file: &'a FileConfig) -> &'a [RouteConfig] {
        self.routes.as_deref().unwrap_or(&file.routes)
    }

    fn validate(&self, i: usize, file: &FileConfig) -> Result<(), ConfigError> {
        let field = |f: &str| format!("databases[{i}].{f}");
        let name_ok = !self.name.is_empty()
            && self.name.len() <= 64
            && self
                .name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"_-.".contains(&b));
        ConfigError::invalid_if(
            !name_ok,
            field("name"),
            format!(
                "{:?} is not a name: 1 to 64 ASCII letters, digits, _, - or .",
                self.name
            ),
        )?;
        let dialect = outbox::store::Dialect::of_url(&self.url)
            .map_err(|e| ConfigError::new(field("url"), e.to_string()))?;
        for (f, t) in [("table", &self.table), ("inbox_table", &self.inbox_table)] {
            outbox::TableName::new(t).map_err(|e| ConfigError::new(field(f), e.to_string()))?;
        }
        if self.discovers() {
            ConfigError::invalid_if(
                dialect != outbox::store::Dialect::Postgres,
                field("schemas"),
                "tenant schemas are discovered on PostgreSQL only",
            )?;
            ConfigError::invalid_if(
                self.schemas.is_some() && self.schemas_query.is_some(),
                field("schemas_query"),
                "give schemas (a LIKE pattern) or schemas_query, not both",
            )?;
            if self.schemas.as_ref().is_some_and(String::is_empty)
                || self
                    .schemas_query
                    .as_ref()
                    .is_some_and(|q| q.trim().is_empty())
            {
                return Err(ConfigError::new(field("schemas"), "must not be empty"));
            }
            for (f, t) in [("table", &self.table), ("inbox_table", &self.inbox_table)] {
                ConfigError::invalid_if(
                    t.contains('.'),
                    field(f),
                    "must be unqualified with schemas: each tenant's is <schema>.<table>",
                )?;
            }
            ConfigError::invalid_if(
                self.rediscover_interval < std::time::Duration::from_secs(1),
                field("rediscover_interval"),
                "must be at least 1s",
            )?;
        }
        let transports = file.transports.iter().map(|(k, v)| (k.as_str(), v));
        check_routes(self.routes(file), &transports.collect()).map_err(|e| {
            if self.routes.is_some() {
                ConfigError::new(field(&e.field), e.reason)
            } else {
                e
            }
        })
    }
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
    /// `rocketmq` cargo feature; without it the section is parsed only to say so).
    #[cfg_attr(not(feature = "rocketmq"), allow(dead_code))]
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
    pub sasl: Option<outbox::transport::kafka::KafkaSasl>,
    /// TLS, as for a Kafka transport.
    pub tls: Option<outbox::transport::kafka::KafkaTls>,
    /// Extra librdkafka properties. Default none.
    #[serde(default)]
    pub properties: BTreeMap<String, String>,
}

#[cfg(feature = "kafka")]
impl KafkaConfirmationsSection {
    /// The listener's connection settings, validated, secrets read; errors name
    /// `confirmations.<field>`.
    ///
    /// # Errors
    /// [`ConfigError`] naming the field.
    pub fn kafka_config(&self) -> Result<outbox::KafkaConfig, ConfigError> {
        let mut c = outbox::KafkaConfig::new(&self.bootstrap_servers);
        c.sasl = self.sasl.clone();
        c.tls = self.tls.clone();
        c.properties = self.properties.clone();
        let named = confirmations_field;
        c.validate().map_err(named)?;
        c.check_features().map_err(named)?;
        ConfigError::invalid_if(
            !outbox::transport::kafka::valid_topic(&self.topic),
            "confirmations.topic",
            format!("{:?} is not a Kafka topic name", self.topic),
        )?;
        ConfigError::invalid_if(
            self.group.is_empty(),
            "confirmations.group",
            "must not be empty",
        )?;
        c.resolve_secrets().map_err(named)
    }
}

/// The Kafka connection, RabbitMQ connection and RocketMQ listener settings of `[confirmations]`.
fn confirmations_field(e: ConfigError) -> ConfigError {
    ConfigError::new(format!("confirmations.{}", e.field), e.reason)
}

impl ConfirmationsSection {
    /// The connection settings of a `kind = "rabbitmq"` section (`None` for other kinds),
    /// validated, the password and CA file read.
    ///
    /// # Errors
    /// [`ConfigError`] naming `confirmations.<field>`.
    #[cfg(feature = "rabbitmq")]
    pub fn rabbitmq(&self) -> Result<Option<outbox::RabbitMqConfig>, ConfigError> {
        let ConfirmationsSection::Rabbitmq {
            url,
            username,
            password_env,
            tls_ca_file,
            ..
        } = self
        else {
            return Ok(None);
        };
        let mut c = outbox::RabbitMqConfig::new(url);
        c.username = username.clone();
        c.password_env = password_env.clone();
        c.tls_ca_file = tls_ca_file.clone().map(Into::into);
        c.validate().map_err(confirmations_field)?;
        c.resolve_secrets().map(Some).map_err(confirmations_field)
    }

    /// The listener settings of a `kind = "rocketmq"` section (`None` for other kinds),
    /// validated, the secret key read.
    ///
    /// # Errors
    /// [`ConfigError`] naming `confirmations.<field>`.
    #[cfg(feature = "rocketmq")]
    pub fn rocketmq(&self) -> Result<Option<outbox::confirm::rocketmq::ListenConfig>, ConfigError> {
        use outbox::transport::rocketmq::{Credentials, name_server_of_url};
        let ConfirmationsSection::Rocketmq {
            url,
            destination,
            group,
            access_key,
            secret_key_env,
        } = self
        else {
            return Ok(None);
        };
        let ns = name_server_of_url(url).map_err(confirmations_field)?;
        let mut c = outbox::confirm::rocketmq::ListenConfig::new(ns, destination, group);
        if access_key.is_some() || secret_key_env.is_some() {
            let k = Credentials {
                access_key: access_key.clone().unwrap_or_default(),
                secret_key_env: secret_key_env.clone(),
                ..Credentials::default()
            };
            c.credentials = Some(k.resolved().map_err(confirmations_field)?);
        }
        c.validate().map_err(|e| match e.field.as_str() {
            "name_server" => ConfigError::new("confirmations.url", e.reason),
            _ => confirmations_field(e),
        })?;
        Ok(Some(c))
    }

    /// The listener settings of a `kind = "redis"` section (`None` for other kinds), the
    /// password read; without `consumer`, the listener's random consumer name.
    ///
    /// # Errors
    /// [`ConfigError`] naming `confirmations.password_env` when its variable is not set.
    #[cfg(feature = "redis")]
    pub fn redis(&self) -> Result<Option<outbox::confirm::redis::RedisListenConfig>, ConfigError> {
        let ConfirmationsSection::Redis {
            url,
            password_env,
            stream,
            group,
            consumer,
        } = self
        else {
            return Ok(None);
        };
        let mut c = outbox::confirm::redis::RedisListenConfig::new(url, stream);
        c.password = env_secret("confirmations.password_env", password_env.as_deref())?;
        c.group = group.clone();
        if let Some(consumer) = consumer {
            c.consumer = consumer.clone();
        }
        Ok(Some(c))
    }

    /// The listener settings of a `kind = "mqtt"` section (`None` for other kinds), the
    /// password read; without `client_id`, the listener's random client id.
    ///
    /// # Errors
    /// [`ConfigError`] naming `confirmations.password_env` when its variable is not set.
    #[cfg(feature = "mqtt")]
    pub fn mqtt(&self) -> Result<Option<outbox::confirm::mqtt::MqttListenConfig>, ConfigError> {
        let ConfirmationsSection::Mqtt {
            url,
            topic,
            group,
            client_id,
            username,
            password_env,
        } = self
        else {
            return Ok(None);
        };
        let mut c = outbox::confirm::mqtt::MqttListenConfig::new(url, topic);
        c.password = env_secret("confirmations.password_env", password_env.as_deref())?;
        c.username = username.clone();
        c.group = group.clone();
        if let Some(client_id) = client_id {
            c.client_id = client_id.clone();
        }
        Ok(Some(c))
    }
}

fn default_queue() -> String {
    "outbox-confirmations".into()
}

fn default_confirm_path() -> String {
    "/confirmations".into()
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
        self.relay.validate()?;
        Ok(self.relay.clone())
    }

    /// Check routes and transports without connecting.
    ///
    /// # Errors
    /// A [`ConfigError`] naming the field (`routes[0].transport`, `transports.x.url`, …).
    pub fn validate(&self) -> Result<(), ConfigError> {
        let relay = self.relay_config()?;
        if !self.databases.is_empty() {
            ConfigError::invalid_if(
                !self.database.url.is_empty(),
                "database.url",
                "give either [database] or [[databases]], not both (--database and \
                     OUTBOX_DATABASE_URL set [database])",
            )?;
            let mut names = std::collections::BTreeSet::new();
            for (i, d) in self.databases.iter().enumerate() {
                d.validate(i, self)?;
                ConfigError::invalid_if(
                    !names.insert(d.name.as_str()),
                    format!("databases[{i}].name"),
                    format!("{:?} names two databases", d.name),
                )?;
            }
            ConfigError::invalid_if(
                self.confirmations.is_some(),
                "confirmations",
                "not supported with [[databases]] yet: run one daemon per database ([database]) \
                     for routes that require confirmation",
            )?;
        } else if self.database.url.is_empty() {
            return Err(ConfigError::new(
                "database.url",
                "missing: set it in [database], with --database, or in OUTBOX_DATABASE_URL",
            ));
        }
        if self.databases.is_empty() || !self.routes.is_empty() {
            let transports = self.transports.iter().map(|(k, v)| (k.as_str(), v));
            check_routes(&self.routes, &transports.collect())?;
        }
        // librdkafka must report every record before the relay gives up on a batch.
        #[cfg(feature = "kafka")]
        for (name, t) in &self.transports {
            if let TransportConfig::Kafka(k) = t
                && k.delivery_timeout >= relay.publish_timeout
            {
                return Err(ConfigError::new(
                    format!("transports.{name}.delivery_timeout"),
                    format!(
                        "must be below relay.publish_timeout ({:?}), so librdkafka reports every \
                         record before the relay gives up on a batch",
                        relay.publish_timeout
                    ),
                ));
            }
        }
        let _ = relay;
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
                ConfigError::invalid_if(
                    bad(subject),
                    "confirmations.subject",
                    format!(
                        "{subject:?} is not a NATS subject (dot-separated non-empty tokens, no whitespace)"
                    ),
                )?;
                ConfigError::invalid_if(
                    queue.is_empty() || queue.chars().any(|c| c.is_whitespace()),
                    "confirmations.queue",
                    "must be a non-empty name without whitespace",
                )?;
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
                env_secret("confirmations.password_env", password_env.as_deref())?;
                for (field, v) in [
                    ("confirmations.stream", Some(stream)),
                    ("confirmations.group", Some(group)),
                    ("confirmations.consumer", consumer.as_ref()),
                ] {
                    ConfigError::invalid_if(
                        v.is_some_and(|v| v.is_empty() || v.chars().any(char::is_whitespace)),
                        field,
                        "must be non-empty, without whitespace",
                    )?;
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
                ConfigError::invalid_if(
                    group.is_empty() || group.contains(['/', '+', '#']),
                    "confirmations.group",
                    "must be non-empty, without / + #",
                )?;
                ConfigError::invalid_if(
                    client_id.as_ref().is_some_and(String::is_empty),
                    "confirmations.client_id",
                    "must not be empty",
                )?;
                env_secret("confirmations.password_env", password_env.as_deref())?;
            }
            #[cfg(feature = "rocketmq")]
            Some(c @ ConfirmationsSection::Rocketmq { .. }) => {
                c.rocketmq()?;
            }
            #[cfg(not(feature = "rocketmq"))]
            Some(ConfirmationsSection::Rocketmq { .. }) => {
                return Err(ConfigError::new(
                    "confirmations.kind",
                    "RocketMQ support is not compiled in: build outbox-cli with --features rocketmq",
                ));
            }
            #[cfg(feature = "rabbitmq")]
            Some(c @ ConfirmationsSection::Rabbitmq { queue, .. }) => {
                c.rabbitmq()?;
                ConfigError::invalid_if(
                    queue.is_empty() || queue.len() > 255,
                    "confirmations.queue",
                    "must be a queue name of 1 to 255 bytes",
                )?;
            }
            #[cfg(feature = "kafka")]
            Some(ConfirmationsSection::Kafka(k)) => {
                k.kafka_config()?;
            }
            Some(ConfirmationsSection::Http { listen, path }) => {
                ConfigError::invalid_if(
                    listen.parse::<std::net::SocketAddr>().is_err(),
                    "confirmations.listen",
                    format!("{listen:?} is not a socket address such as 127.0.0.1:8081"),
                )?;
                ConfigError::invalid_if(
                    !path.starts_with('/'),
                    "confirmations.path",
                    "must start with /",
                )?;
            }
            None => {}
        }
        Ok(())
    }

    /// Build every transport a route uses, and the router ([`Router::from_config`]). The broker
    /// transports (everything but webhooks) are
    /// [`LazyTransport`](outbox::transport::lazy::LazyTransport)s: their settings are validated
    /// here, their connection is made by their first successful probe, so a broker that is down
    /// at start-up pauses its transport (the relay probes it with backoff) instead of stopping
    /// the daemon.
    ///
    /// # Errors
    /// A transport whose settings are invalid, named (`transports.<name>.<field>`).
    pub fn router(&self) -> Result<Router, ConfigError> {
        self.validate()?;
        Router::from_config(
            &self.routes,
            self.transports.iter().map(|(k, v)| (k.as_str(), v)),
        )
    }
}

fn url_ok(url: &str, schemes: &[&str]) -> Result<(), String> {
    outbox::transport::config::check_url(url, schemes).map_err(|e| e.reason)
}

#[cfg(test)]
mod tests;
