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
    /// `kind = "rabbitmq"`.
    #[cfg(feature = "rabbitmq")]
    Rabbitmq(RabbitMqSection),
}

impl TransportSection {
    /// The destination of a route that names none: the webhook's own URL (empty), the topic as
    /// NATS subject, `<exchange>/{topic}` or the queue named after the topic for RabbitMQ.
    pub fn default_destination(&self) -> String {
        match self {
            TransportSection::Webhook(_) => String::new(),
            TransportSection::Nats(_) => "{topic}".into(),
            #[cfg(feature = "rabbitmq")]
            TransportSection::Rabbitmq(m) => match &m.exchange {
                Some(e) => format!("{e}/{{topic}}"),
                None => "{topic}".into(),
            },
        }
    }
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

fn yes() -> bool {
    true
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
    /// `kind = "http"`: serve `POST path` on `listen`.
    Http {
        /// Socket address, e.g. `127.0.0.1:8081`.
        listen: String,
        /// Path. Default `/confirmations`.
        #[serde(default = "default_confirm_path")]
        path: String,
    },
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
                #[cfg(feature = "rabbitmq")]
                TransportSection::Rabbitmq(r) => {
                    r.config(name)?;
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
                #[cfg(feature = "rabbitmq")]
                TransportSection::Rabbitmq(r) => Arc::new(
                    outbox::RabbitMqTransport::connect(r.config(name)?)
                        .await
                        .map_err(|e| prefix(e, name))?,
                ),
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

    #[cfg(feature = "rabbitmq")]
    #[test]
    fn rabbitmq_sections_validate_and_name_the_field() {
        let mq = "[transports.mq]\nkind = \"rabbitmq\"\nurl = \"amqp://127.0.0.1:5672/%2f\"\n\
                  exchange = \"orders\"\nconfirm_timeout = \"3s\"\nunroutable = \"fail\"\n";
        let base = format!("{GOOD}\n{mq}");
        let c = parse(&base).unwrap();
        c.validate().unwrap();
        let t = &c.transports["mq"];
        assert_eq!(t.default_destination(), "orders/{topic}");
        let TransportSection::Rabbitmq(m) = t else {
            panic!("not rabbitmq")
        };
        let cfg = m.config("mq").unwrap();
        assert_eq!(cfg.confirm_timeout, Duration::from_secs(3));
        assert_eq!(cfg.unroutable, outbox::Unroutable::Fail);
        assert_eq!(cfg.url, "amqp://127.0.0.1:5672/%2f");
        let field = |toml: &str| parse(toml).unwrap().validate().unwrap_err().field;
        let with = |extra: &str| base.replace("exchange = \"orders\"", extra);
        assert_eq!(
            field(&base.replace("amqp://127.0.0.1:5672/%2f", "http://x")),
            "transports.mq.url"
        );
        assert_eq!(
            field(&with(
                "password_env = \"OUTBOX_TEST_SURELY_UNSET_VARIABLE\""
            )),
            "transports.mq.password_env"
        );
        let c = parse(&with("password_env = \"PATH\"\nusername = \"app\"")).unwrap();
        let TransportSection::Rabbitmq(m) = &c.transports["mq"] else {
            panic!("not rabbitmq")
        };
        let cfg = m.config("mq").unwrap();
        assert_eq!(cfg.password, std::env::var("PATH").ok());
        assert_eq!(cfg.username.as_deref(), Some("app"));
        assert_eq!(
            field(&base.replace("amqp://", "amqps://")),
            "transports.mq.tls_ca_file"
        );
        assert_eq!(
            field(&with("tls_ca_file = \"/etc/hostname\"")),
            "transports.mq.tls_ca_file"
        );
        assert_eq!(field(&with("exchange = \"a/b\"")), "transports.mq.exchange");
        assert_eq!(
            field(&base.replace("\"3s\"", "\"0s\"")),
            "transports.mq.confirm_timeout"
        );
        assert_eq!(
            field(&with("max_message_bytes = 0")),
            "transports.mq.max_message_bytes"
        );
        let e = parse(&with("exchang = \"x\"")).unwrap_err().to_string();
        assert!(e.contains("exchang"), "{e}");
        let e = parse(&base.replace("\"fail\"", "\"maybe\""))
            .unwrap_err()
            .to_string();
        assert!(e.contains("maybe"), "{e}");
        // [confirmations] kind = "rabbitmq".
        let confirm = format!(
            "{base}\n[confirmations]\nkind = \"rabbitmq\"\nurl = \"amqp://127.0.0.1/%2f\"\nqueue = \"orders.confirmations\"\n"
        );
        let c = parse(&confirm).unwrap();
        c.validate().unwrap();
        let cfg = c
            .confirmations
            .as_ref()
            .unwrap()
            .rabbitmq()
            .unwrap()
            .unwrap();
        assert_eq!(cfg.url, "amqp://127.0.0.1/%2f");
        assert_eq!(
            field(&confirm.replace("queue = \"orders.confirmations\"", "queue = \"\"")),
            "confirmations.queue"
        );
        assert_eq!(
            field(&confirm.replace("amqp://127.0.0.1/%2f", "nats://x")),
            "confirmations.url"
        );
    }

    #[test]
    fn unknown_field_is_named() {
        let e = parse(&GOOD.replace("batch_size = 100", "batch_sise = 100"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("batch_sise"), "{e}");
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
