//! RabbitMQ transport settings: the connection configuration, destinations and what an unroutable message counts as.

use super::*;
use crate::transport::settings::fill_secret;

/// What a message returned as unroutable (`basic.return` with `312 NO_ROUTE`: the exchange exists
/// but no queue is bound for the routing key) counts as; `"retry"` or `"fail"` in a
/// configuration file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Unroutable {
    /// `Retryable` (default): retried with backoff, FAILED after `max_attempts` with the reason.
    #[default]
    Retry,
    /// `Permanent`: FAILED at once with the reason.
    Fail,
}

/// RabbitMQ connection and publishing settings, shared by the transport, the consumer runner
/// ([`crate::consumer::rabbitmq`]) and the confirmation sender and listener
/// ([`crate::confirm::rabbitmq`]); the `[transports.<name>] kind = "rabbitmq"` table of the
/// configuration file (see [`TransportConfig`](crate::transport::config::TransportConfig)). Durations are
/// written `"10s"`; every field but `url` may be left out.
#[derive(Clone, serde::Deserialize, serde::Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct RabbitMqConfig {
    /// `amqp://user:password@host:5672/vhost` or `amqps://…` (TLS); the vhost is percent-encoded
    /// (`%2f` is `/`). Query parameters of the AMQP URI spec (`heartbeat`, `frame_max`,
    /// `channel_max`, `connection_timeout`) are honoured. A cluster's nodes may be given as a seed
    /// list, URIs separated by commas: a connection goes to the node that answered last, and
    /// when it is lost (or cannot be opened) the next nodes are tried in turn, each within
    /// `connect_timeout` (RabbitMQ's clients take a list of endpoints the same way; see the
    /// RabbitMQ documentation, "Clustering and client connections"). Required.
    pub url: String,
    /// User name, overriding the one in the URL. Default: the URL's (`guest` without one).
    pub username: Option<String>,
    /// Password, overriding the one in the URL (read it from the environment, never a file).
    /// Default: the URL's. Never read from nor written to a file: see `password_env`.
    #[serde(skip)]
    pub password: Option<String>,
    /// Name of the environment variable holding the password, read by
    /// [`RabbitMqConfig::resolve_secrets`] when `password` is none. Default: none.
    pub password_env: Option<String>,
    /// PEM certificates of the certificate authorities trusted for `amqps://` (the client has no
    /// built-in roots). Default: none (or read from `tls_ca_file`).
    #[serde(skip)]
    pub tls_ca_pem: Option<String>,
    /// PEM file of the certificate authorities trusted for `amqps://`, read into `tls_ca_pem` by
    /// [`RabbitMqConfig::resolve_secrets`]. Set only with an `amqps://` URL. Default: none.
    /// (Boxed, as `exchange`, to keep the config small: it is moved around by value.)
    pub tls_ca_file: Option<Box<std::path::Path>>,
    /// How long to wait for the publisher confirms of a batch once it is written. Default 10 s.
    #[serde(with = "humantime_serde")]
    pub confirm_timeout: Duration,
    /// How long to wait for the connection (TCP, TLS and AMQP handshake) and for a probe.
    /// Default 5 s.
    #[serde(with = "humantime_serde")]
    pub connect_timeout: Duration,
    /// Heartbeat interval asked for when the URL does not set `heartbeat`; a dead peer is noticed
    /// after about two intervals. Default 10 s.
    #[serde(with = "humantime_serde")]
    pub heartbeat: Duration,
    /// How long a positive exchange check is trusted. Default 60 s.
    #[serde(with = "humantime_serde")]
    pub exchange_check_ttl: Duration,
    /// What an unroutable message counts as. Default [`Unroutable::Retry`].
    pub unroutable: Unroutable,
    /// Largest payload published, in bytes; larger ones fail `Permanent` without being sent.
    /// Default 128 MiB, RabbitMQ's default `max_message_size`; set it to the server's value.
    pub max_message_bytes: usize,
    /// Connection name shown in the management UI. Default `outbox`.
    pub connection_name: String,
    /// Exchange of the routes that name no destination: they publish to `<exchange>/{topic}`
    /// ([`TransportConfig::default_destination`](crate::transport::config::TransportConfig::default_destination)).
    /// Default: none (`{topic}`, the queue named after the topic, through the default exchange).
    pub exchange: Option<Box<str>>,
}

impl Default for RabbitMqConfig {
    /// [`RabbitMqConfig::new`] with an empty URL.
    fn default() -> Self {
        RabbitMqConfig::new("")
    }
}

impl std::fmt::Debug for RabbitMqConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RabbitMqConfig")
            .field("url", &redact(&self.url))
            .field("username", &self.username)
            .field("password", &self.password.as_ref().map(|_| "***"))
            .field("password_env", &self.password_env)
            .field("tls_ca_pem", &self.tls_ca_pem.is_some())
            .field("tls_ca_file", &self.tls_ca_file)
            .field("confirm_timeout", &self.confirm_timeout)
            .field("connect_timeout", &self.connect_timeout)
            .field("heartbeat", &self.heartbeat)
            .field("exchange_check_ttl", &self.exchange_check_ttl)
            .field("unroutable", &self.unroutable)
            .field("max_message_bytes", &self.max_message_bytes)
            .field("connection_name", &self.connection_name)
            .field("exchange", &self.exchange)
            .finish()
    }
}

impl RabbitMqConfig {
    /// Settings for `url` with the defaults.
    pub fn new(url: impl Into<String>) -> Self {
        RabbitMqConfig {
            url: url.into(),
            username: None,
            password: None,
            password_env: None,
            tls_ca_pem: None,
            tls_ca_file: None,
            confirm_timeout: Duration::from_secs(10),
            connect_timeout: Duration::from_secs(5),
            heartbeat: Duration::from_secs(10),
            exchange_check_ttl: Duration::from_secs(60),
            unroutable: Unroutable::Retry,
            max_message_bytes: 128 * 1024 * 1024,
            connection_name: "outbox".into(),
            exchange: None,
        }
    }

    /// A copy with `password` read from the variable named by `password_env` (when `password`
    /// is none) and `tls_ca_pem` from `tls_ca_file` (when `tls_ca_pem` is none).
    ///
    /// # Errors
    /// [`ConfigError`] naming `password_env` when the variable is not set, or `tls_ca_file` when
    /// the file cannot be read or holds no PEM certificate.
    pub fn resolve_secrets(&self) -> Result<Self, ConfigError> {
        let mut c = self.clone();
        fill_secret(&mut c.password, "password_env", c.password_env.as_deref())?;
        if let (None, Some(path)) = (&c.tls_ca_pem, &c.tls_ca_file) {
            let pem = std::fs::read_to_string(path).map_err(|e| {
                ConfigError::new(
                    "tls_ca_file",
                    format!("cannot read {}: {e}", path.display()),
                )
            })?;
            ConfigError::invalid_if(
                !pem.contains("-----BEGIN CERTIFICATE-----"),
                "tls_ca_file",
                format!("{} holds no PEM certificate", path.display()),
            )?;
            c.tls_ca_pem = Some(pem);
        }
        Ok(c)
    }

    /// Check the settings without connecting.
    ///
    /// # Errors
    /// [`ConfigError`] naming `url` (not an `amqp://` or `amqps://` URI), `password_env` (not
    /// set), `tls_ca_file` (missing for `amqps://`, set for `amqp://`, or unreadable),
    /// `confirm_timeout`, `connect_timeout`, `max_message_bytes` (zero) or `exchange` (not an
    /// exchange name).
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.uris().map(|_| ())?;
        let resolved = self.resolve_secrets()?;
        match (
            self.url.starts_with("amqps://"),
            resolved.tls_ca_pem.is_some(),
        ) {
            (true, false) => {
                return Err(ConfigError::new(
                    "tls_ca_file",
                    "amqps:// needs the PEM file of the trusted certificate authorities",
                ));
            }
            (false, _) if self.tls_ca_file.is_some() => {
                return Err(ConfigError::new(
                    "tls_ca_file",
                    "set only with an amqps:// url",
                ));
            }
            _ => {}
        }
        if let Some(e) = &self.exchange
            && (e.is_empty() || e.len() > 255 || e.contains('/') || e.chars().any(char::is_control))
        {
            return Err(ConfigError::new(
                "exchange",
                format!("{e:?} is not an exchange name (1 to 255 bytes, no '/')"),
            ));
        }
        ConfigError::zero_if(self.confirm_timeout.is_zero(), "confirm_timeout")?;
        ConfigError::zero_if(self.connect_timeout.is_zero(), "connect_timeout")?;
        ConfigError::zero_if(self.max_message_bytes == 0, "max_message_bytes")?;
        Ok(())
    }

    /// The parsed URIs of `url` (one, or each of a seed list), with the credentials and heartbeat
    /// applied.
    pub(super) fn uris(&self) -> Result<Vec<AMQPUri>, ConfigError> {
        self.url
            .split(',')
            .map(|u| self.one_uri(u.trim()))
            .collect()
    }

    fn one_uri(&self, url: &str) -> Result<AMQPUri, ConfigError> {
        let scheme_ok = url.starts_with("amqp://") || url.starts_with("amqps://");
        ConfigError::invalid_if(
            !scheme_ok,
            "url",
            format!(
                "{:?} is not an AMQP URI (amqp://user:password@host:5672/vhost or amqps://…; several separated by commas)",
                redact(url)
            ),
        )?;
        let mut uri: AMQPUri = url.parse().map_err(|e| {
            ConfigError::new(
                "url",
                format!("{:?} is not a valid AMQP URI: {e}", redact(url)),
            )
        })?;
        if let Some(u) = &self.username {
            uri.authority.userinfo.username = u.clone();
        }
        if let Some(p) = &self.password {
            uri.authority.userinfo.password = p.clone();
        }
        if uri.query.heartbeat.is_none() {
            uri.query.heartbeat = Some(u16::try_from(self.heartbeat.as_secs()).unwrap_or(u16::MAX));
        }
        Ok(uri)
    }
}

pub(crate) use crate::redact::url as redact;

/// A parsed destination: exchange (empty for the default exchange) and routing key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Destination {
    /// Exchange name; `""` is the default exchange, which routes to the queue named by the
    /// routing key.
    pub exchange: String,
    /// Routing key.
    pub routing_key: String,
}

impl Destination {
    /// Parse `exchange/routing-key`, `/queue` or `queue` (see the module docs).
    ///
    /// # Errors
    /// A text naming the problem: empty, a part over 255 bytes, or control characters.
    pub fn parse(s: &str) -> Result<Destination, String> {
        let (exchange, routing_key) = s.split_once('/').unwrap_or(("", s));
        if exchange.is_empty() && routing_key.is_empty() {
            return Err(format!(
                "invalid RabbitMQ destination {s:?}: expected exchange/routing-key or a queue name"
            ));
        }
        for (what, part) in [("exchange", exchange), ("routing key", routing_key)] {
            if part.len() > 255 {
                return Err(format!(
                    "invalid RabbitMQ destination {s:?}: the {what} is {} bytes, at most 255",
                    part.len()
                ));
            }
            if part.chars().any(char::is_control) {
                return Err(format!(
                    "invalid RabbitMQ destination {s:?}: the {what} has control characters"
                ));
            }
        }
        Ok(Destination {
            exchange: exchange.to_owned(),
            routing_key: routing_key.to_owned(),
        })
    }
}

impl std::fmt::Display for Destination {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.exchange.is_empty() {
            write!(f, "queue {:?} (default exchange)", self.routing_key)
        } else {
            write!(
                f,
                "exchange {:?}, routing key {:?}",
                self.exchange, self.routing_key
            )
        }
    }
}
