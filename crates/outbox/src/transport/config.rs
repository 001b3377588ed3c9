//! [`TransportConfig`]: any transport's settings as one serde type, tagged by `kind`.
//!
//! Every transport's config ([`WebhookConfig`](super::webhook::WebhookConfig),
//! [`NatsConfig`](super::nats::NatsConfig), [`RedisConfig`](super::redis::RedisConfig),
//! [`MqttConfig`](super::mqtt::MqttConfig), [`RabbitMqConfig`](super::rabbitmq::RabbitMqConfig),
//! [`KafkaConfig`](super::kafka::KafkaConfig), [`RocketMqConfig`](super::rocketmq::RocketMqConfig))
//! is a serde type: it reads from a table of a configuration file (TOML, JSON, YAML, environment
//! through figment, …) and writes back to one. The rules they share:
//!
//! - durations are strings in [humantime](https://docs.rs/humantime) form: `"500ms"`, `"30s"`,
//!   `"5m"`;
//! - every field but the address (`url`, or `bootstrap_servers` for Kafka) may be left out and
//!   takes the default its documentation gives; unknown fields are errors;
//! - secrets are never read from nor written to a file: a file names the environment variable
//!   that holds each one (`password_env`, `secret_env`, `secret_key_env`, `sasl.username_env`,
//!   …), read by the config's `resolve_secrets` (called by `validate` to check it is set, and by
//!   [`TransportConfig::build`] and [`TransportConfig::connect`]).
//!
//! ```toml
//! kind = "nats"
//! url = "nats://127.0.0.1:4222"
//! stream = "ORDERS"
//! ack_timeout = "5s"
//! ```
//!
//! A `kind` whose transport is not compiled in (its cargo feature is off) is read, so a file
//! written for a fuller build still parses, and refused by [`TransportConfig::validate`] with
//! the feature to enable; an unknown `kind` is a deserialization error that lists the known
//! kinds.

use std::sync::Arc;

use super::Transport;
use crate::error::{ConfigError, TransportError};

/// The settings of one transport, tagged by `kind`: `"webhook"`, `"nats"`, `"redis"`, `"mqtt"`,
/// `"rabbitmq"`, `"kafka"` or `"rocketmq"`. Each variant is the transport's own config; see the
/// [module docs](self) for the shared rules.
#[derive(Debug, Clone, serde::Deserialize, serde::Serialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum TransportConfig {
    /// `kind = "webhook"`: [`WebhookConfig`](super::webhook::WebhookConfig).
    #[cfg(feature = "webhook")]
    Webhook(super::webhook::WebhookConfig),
    /// `kind = "webhook"` in a build without the `webhook` feature.
    #[cfg(not(feature = "webhook"))]
    Webhook(NotCompiled),
    /// `kind = "nats"`: [`NatsConfig`](super::nats::NatsConfig).
    #[cfg(feature = "nats")]
    Nats(super::nats::NatsConfig),
    /// `kind = "nats"` in a build without the `nats` feature.
    #[cfg(not(feature = "nats"))]
    Nats(NotCompiled),
    /// `kind = "redis"`: [`RedisConfig`](super::redis::RedisConfig), Redis Streams.
    #[cfg(feature = "redis")]
    Redis(super::redis::RedisConfig),
    /// `kind = "redis"` in a build without the `redis` feature.
    #[cfg(not(feature = "redis"))]
    Redis(NotCompiled),
    /// `kind = "mqtt"`: [`MqttConfig`](super::mqtt::MqttConfig), an MQTT 5 broker.
    #[cfg(feature = "mqtt")]
    Mqtt(super::mqtt::MqttConfig),
    /// `kind = "mqtt"` in a build without the `mqtt` feature.
    #[cfg(not(feature = "mqtt"))]
    Mqtt(NotCompiled),
    /// `kind = "rabbitmq"`: [`RabbitMqConfig`](super::rabbitmq::RabbitMqConfig).
    #[cfg(feature = "rabbitmq")]
    Rabbitmq(super::rabbitmq::RabbitMqConfig),
    /// `kind = "rabbitmq"` in a build without the `rabbitmq` feature.
    #[cfg(not(feature = "rabbitmq"))]
    Rabbitmq(NotCompiled),
    /// `kind = "kafka"`: [`KafkaConfig`](super::kafka::KafkaConfig).
    #[cfg(feature = "kafka")]
    Kafka(Box<super::kafka::KafkaConfig>),
    /// `kind = "kafka"` in a build without the `kafka` feature.
    #[cfg(not(feature = "kafka"))]
    Kafka(NotCompiled),
    /// `kind = "rocketmq"`: [`RocketMqConfig`](super::rocketmq::RocketMqConfig).
    #[cfg(feature = "rocketmq")]
    Rocketmq(Box<super::rocketmq::RocketMqConfig>),
    /// `kind = "rocketmq"` in a build without the `rocketmq` feature.
    #[cfg(not(feature = "rocketmq"))]
    Rocketmq(NotCompiled),
}

/// The settings of a transport whose cargo feature is off: any table is accepted and ignored,
/// and [`TransportConfig::validate`] refuses it, naming `kind` and the feature to enable.
#[derive(Debug, Clone, Default, serde::Deserialize, serde::Serialize)]
pub struct NotCompiled {}

impl TransportConfig {
    /// The `kind` tag: `"webhook"`, `"nats"`, `"redis"`, `"mqtt"`, `"rabbitmq"`, `"kafka"` or
    /// `"rocketmq"`.
    pub fn kind(&self) -> &'static str {
        match self {
            TransportConfig::Webhook(_) => "webhook",
            TransportConfig::Nats(_) => "nats",
            TransportConfig::Redis(_) => "redis",
            TransportConfig::Mqtt(_) => "mqtt",
            TransportConfig::Rabbitmq(_) => "rabbitmq",
            TransportConfig::Kafka(_) => "kafka",
            TransportConfig::Rocketmq(_) => "rocketmq",
        }
    }

    /// The default settings of the transport a URL names, by its scheme: `http`/`https` →
    /// webhook, `nats`/`tls` → NATS, `redis`/`rediss` → Redis, `mqtt`/`mqtts` → MQTT,
    /// `amqp`/`amqps` → RabbitMQ, `kafka` → Kafka (`kafka://host:port[,host:port…]`),
    /// `rocketmq` → RocketMQ. For programs that take a broker URL on the command line.
    ///
    /// # Errors
    /// [`ConfigError`] naming `url` when the scheme is unknown or its transport is not compiled
    /// in (the reason names the scheme; the URL, which may hold a password, is not echoed).
    pub fn from_url(url: &str) -> Result<TransportConfig, ConfigError> {
        let scheme = url.split_once("://").map_or("", |(s, _)| s);
        let kind = match scheme {
            "http" | "https" => "webhook",
            "nats" | "tls" => "nats",
            "redis" | "rediss" => "redis",
            "mqtt" | "mqtts" => "mqtt",
            "amqp" | "amqps" => "rabbitmq",
            "kafka" => "kafka",
            "rocketmq" => "rocketmq",
            _ => {
                return Err(ConfigError::new(
                    "url",
                    format!(
                        "unknown transport URL scheme {scheme:?}: expected http(s), nats, tls, \
                         redis(s), mqtt(s), amqp(s), kafka or rocketmq"
                    ),
                ));
            }
        };
        match kind {
            #[cfg(feature = "webhook")]
            "webhook" => Ok(TransportConfig::Webhook(
                super::webhook::WebhookConfig::new(url),
            )),
            #[cfg(feature = "nats")]
            "nats" => Ok(TransportConfig::Nats(super::nats::NatsConfig::new(url))),
            #[cfg(feature = "redis")]
            "redis" => Ok(TransportConfig::Redis(super::redis::RedisConfig::new(url))),
            #[cfg(feature = "mqtt")]
            "mqtt" => Ok(TransportConfig::Mqtt(super::mqtt::MqttConfig::new(url))),
            #[cfg(feature = "rabbitmq")]
            "rabbitmq" => Ok(TransportConfig::Rabbitmq(
                super::rabbitmq::RabbitMqConfig::new(url),
            )),
            #[cfg(feature = "kafka")]
            "kafka" => Ok(TransportConfig::Kafka(Box::new(
                super::kafka::KafkaConfig::new(url),
            ))),
            #[cfg(feature = "rocketmq")]
            "rocketmq" => Ok(TransportConfig::Rocketmq(Box::new(
                super::rocketmq::RocketMqConfig::from_url(url)?,
            ))),
            _ => Err(ConfigError::new(
                "url",
                format!(
                    "URL scheme {scheme:?} needs the {kind} transport, which is not compiled \
                     in: build with --features {kind}"
                ),
            )),
        }
    }

    /// Check the settings without connecting: the transport's own `validate`, which also checks
    /// that the environment variables named for secrets are set.
    ///
    /// # Errors
    /// [`ConfigError`] naming the field as written in the file (`url`, `password_env`,
    /// `sasl.username_env`, …), or `kind` when the transport is not compiled in (the reason
    /// names the cargo feature).
    pub fn validate(&self) -> Result<(), ConfigError> {
        match self {
            #[cfg(feature = "webhook")]
            TransportConfig::Webhook(c) => c.validate(),
            #[cfg(feature = "nats")]
            TransportConfig::Nats(c) => c.validate(),
            #[cfg(feature = "redis")]
            TransportConfig::Redis(c) => c.validate(),
            #[cfg(feature = "mqtt")]
            TransportConfig::Mqtt(c) => c.validate(),
            #[cfg(feature = "rabbitmq")]
            TransportConfig::Rabbitmq(c) => c.validate(),
            #[cfg(feature = "kafka")]
            TransportConfig::Kafka(c) => {
                c.validate()?;
                c.check_features()
            }
            #[cfg(feature = "rocketmq")]
            TransportConfig::Rocketmq(c) => c.validate().map_err(|e| match e.field.as_str() {
                "name_server" => ConfigError::new("url", e.reason),
                _ => e,
            }),
            #[allow(unreachable_patterns)]
            other => Err(not_compiled(other.kind())),
        }
    }

    /// The destination of a route that names none: the webhook's own URL (empty), the topic as
    /// NATS subject, Redis stream key, MQTT topic or Kafka topic (`{topic}`),
    /// `<exchange>/{topic}` for RabbitMQ with an [`exchange`](super::rabbitmq::RabbitMqConfig::exchange)
    /// (else `{topic}`, the queue named after the topic), `<default_topic>:{topic}` for RocketMQ
    /// with a [`default_topic`](super::rocketmq::RocketMqConfig::default_topic) (else `{topic}`).
    pub fn default_destination(&self) -> String {
        match self {
            TransportConfig::Webhook(_) => String::new(),
            #[cfg(feature = "rabbitmq")]
            TransportConfig::Rabbitmq(c) => match &c.exchange {
                Some(e) => format!("{e}/{{topic}}"),
                None => "{topic}".into(),
            },
            #[cfg(feature = "rocketmq")]
            TransportConfig::Rocketmq(c) => match &c.default_topic {
                Some(t) => format!("{t}:{{topic}}"),
                None => "{topic}".into(),
            },
            _ => "{topic}".into(),
        }
    }

    /// The transport, validated, secrets read from the environment, not connected yet: a
    /// webhook transport as is, a broker transport as a
    /// [`LazyTransport`](super::lazy::LazyTransport) whose first successful probe connects it
    /// (a Kafka transport creates its [`create_topics`](super::kafka::KafkaConfig::create_topics)
    /// first). A broker that is down at start-up so pauses its transport, which the relay probes
    /// with backoff, instead of failing here.
    ///
    /// # Errors
    /// As [`TransportConfig::validate`].
    pub fn build(&self) -> Result<Arc<dyn Transport>, ConfigError> {
        self.validate()?;
        match self {
            #[cfg(feature = "webhook")]
            TransportConfig::Webhook(c) => Ok(Arc::new(c.build()?)),
            #[cfg(feature = "nats")]
            TransportConfig::Nats(c) => {
                let c = c.clone();
                Ok(lazy("nats", move || {
                    super::nats::NatsTransport::connect(c.clone())
                }))
            }
            #[cfg(feature = "redis")]
            TransportConfig::Redis(c) => {
                let c = c.resolve_secrets()?;
                Ok(lazy("redis", move || {
                    super::redis::RedisTransport::connect(c.clone())
                }))
            }
            #[cfg(feature = "mqtt")]
            TransportConfig::Mqtt(c) => {
                let c = c.resolve_secrets()?;
                Ok(lazy("mqtt", move || {
                    super::mqtt::MqttTransport::connect(c.clone())
                }))
            }
            #[cfg(feature = "rabbitmq")]
            TransportConfig::Rabbitmq(c) => {
                let c = c.resolve_secrets()?;
                Ok(lazy("rabbitmq", move || {
                    super::rabbitmq::RabbitMqTransport::connect(c.clone())
                }))
            }
            #[cfg(feature = "kafka")]
            TransportConfig::Kafka(c) => {
                let c = c.resolve_secrets()?;
                Ok(lazy("kafka", move || {
                    let c = c.clone();
                    async move {
                        let topics = c.topics();
                        if !topics.is_empty() {
                            super::kafka::create_topics(&c, &topics).await?;
                        }
                        super::kafka::KafkaTransport::connect(c).await
                    }
                }))
            }
            #[cfg(feature = "rocketmq")]
            TransportConfig::Rocketmq(c) => {
                let c = c.resolve_secrets()?;
                Ok(lazy("rocketmq", move || {
                    super::rocketmq::RocketMqTransport::connect(c.clone())
                }))
            }
            #[allow(unreachable_patterns)]
            other => Err(not_compiled(other.kind())),
        }
    }

    /// [`TransportConfig::build`], then the first probe, so a broker that cannot be reached is
    /// reported here rather than by the relay.
    ///
    /// # Errors
    /// As [`TransportConfig::validate`]; a transport that cannot connect as a [`ConfigError`]
    /// naming `url` with the broker's reason.
    pub async fn connect(&self) -> Result<Arc<dyn Transport>, ConfigError> {
        let t = self.build()?;
        t.probe()
            .await
            .map_err(|e| ConfigError::new("url", e.to_string()))?;
        Ok(t)
    }
}

/// One `[[routes]]` entry of a configuration file: which topics go to which named transport.
/// See [`Router::from_config`](super::Router::from_config).
///
/// ```toml
/// [[routes]]
/// topics = "order-*"
/// transport = "bus"
/// destination = "orders.{topic}"
/// confirm = { reply_to = "orders.confirm", timeout = "2m" }
/// ordered = true
/// on_dead_letter = "block"
/// ```
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct RouteConfig {
    /// `*`, `prefix*` or an exact topic (a `*` only at the end). Required.
    pub topics: String,
    /// Name of the transport (a key of the transports given to
    /// [`Router::from_config`](super::Router::from_config)). Required.
    pub transport: String,
    /// Destination template, `{topic}` replaced by the message's topic. Default: the
    /// transport's [`TransportConfig::default_destination`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub destination: Option<String>,
    /// Require the consumer's confirmation. Default: none (SENT is final).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub confirm: Option<crate::verdict::ConfirmPolicy>,
    /// Publish each partition key's messages in commit order, one after another (a failing
    /// message holds back only its own key). Default false: unordered.
    #[serde(default)]
    pub ordered: bool,
    /// On an ordered route, what a dead-lettered message does to the rest of its key. Default
    /// [`DeadLetterPolicy::Skip`](super::DeadLetterPolicy::Skip); set only with `ordered`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub on_dead_letter: Option<super::DeadLetterPolicy>,
}

impl RouteConfig {
    /// Check the route by itself (not that its transport exists).
    ///
    /// # Errors
    /// [`ConfigError`] naming `topics`, `on_dead_letter` (without `ordered`),
    /// `confirm.reply_to` (empty) or `confirm.timeout` (zero).
    pub fn validate(&self) -> Result<(), ConfigError> {
        ConfigError::invalid_if(
            self.topics.is_empty() || self.topics.trim_end_matches('*').contains('*'),
            "topics",
            "must be \"*\", \"prefix*\" or an exact topic (a '*' only at the end)",
        )?;
        ConfigError::invalid_if(
            self.on_dead_letter.is_some() && !self.ordered,
            "on_dead_letter",
            "applies to ordered routes only: set `ordered = true` or remove it",
        )?;
        if let Some(c) = &self.confirm {
            ConfigError::invalid_if(
                c.reply_to.is_empty(),
                "confirm.reply_to",
                "must not be empty",
            )?;
            ConfigError::zero_if(c.timeout.is_zero(), "confirm.timeout")?;
        }
        Ok(())
    }
}

impl super::Router {
    /// The router of `routes` (first match wins) over the named `transports`: each transport a
    /// route uses is built once ([`TransportConfig::build`]: not connected yet); transports no
    /// route uses are validated but not built.
    ///
    /// # Errors
    /// [`ConfigError`] naming the field as a configuration file spells it: `routes`
    /// (empty), `routes[i].<field>` (a bad route, a transport that is not in `transports`, a
    /// destination the transport cannot take), `transports.<name>.<field>` (a bad transport).
    pub fn from_config<'a>(
        routes: &[RouteConfig],
        transports: impl IntoIterator<Item = (&'a str, &'a TransportConfig)>,
    ) -> Result<super::Router, ConfigError> {
        Self::from_config_sharing(routes, transports, &mut Default::default())
    }

    /// [`Router::from_config`](super::Router::from_config), reusing the transports already in
    /// `built` (by name) and adding those it builds: the routers of several databases relayed by
    /// one process ([`RelayGroup`](crate::RelayGroup)) then share one connection per broker.
    ///
    /// # Errors
    /// As [`Router::from_config`](super::Router::from_config).
    pub fn from_config_sharing<'a>(
        routes: &[RouteConfig],
        transports: impl IntoIterator<Item = (&'a str, &'a TransportConfig)>,
        built: &mut std::collections::BTreeMap<String, Arc<dyn Transport>>,
    ) -> Result<super::Router, ConfigError> {
        let transports: std::collections::BTreeMap<&str, &TransportConfig> =
            transports.into_iter().collect();
        check_routes(routes, &transports)?;
        for r in routes {
            if !built.contains_key(r.transport.as_str()) {
                let t = transports[r.transport.as_str()];
                let named = |e: ConfigError| {
                    ConfigError::new(format!("transports.{}.{}", r.transport, e.field), e.reason)
                };
                built.insert(r.transport.clone(), t.build().map_err(named)?);
            }
        }
        let mut router = super::Router::new();
        for r in routes {
            let t = built[r.transport.as_str()].clone();
            let dest = r
                .destination
                .clone()
                .unwrap_or_else(|| transports[r.transport.as_str()].default_destination());
            router = match &r.confirm {
                Some(policy) => router.route_confirmed(&r.topics, t, dest, policy.clone()),
                None => router.route(&r.topics, t, dest),
            };
            if r.ordered {
                router = router.ordered(r.on_dead_letter.unwrap_or_default());
            }
        }
        Ok(router)
    }
}

/// Check `routes` against `transports` (every transport validated, used or not); errors named as
/// in [`Router::from_config`](super::Router::from_config).
///
/// # Errors
/// The first bad field.
pub fn check_routes(
    routes: &[RouteConfig],
    transports: &std::collections::BTreeMap<&str, &TransportConfig>,
) -> Result<(), ConfigError> {
    ConfigError::invalid_if(
        routes.is_empty(),
        "routes",
        "at least one [[routes]] entry is needed",
    )?;
    for (i, r) in routes.iter().enumerate() {
        let named = |e: ConfigError| ConfigError::new(format!("routes[{i}].{}", e.field), e.reason);
        let Some(t) = transports.get(r.transport.as_str()) else {
            return Err(named(ConfigError::new(
                "transport",
                format!("no [transports.{}] section", r.transport),
            )));
        };
        r.validate().map_err(named)?;
        #[cfg(feature = "rocketmq")]
        if let (TransportConfig::Rocketmq(_), Some(d)) = (t, &r.destination) {
            super::rocketmq::Destination::parse(&d.replace("{topic}", "t"))
                .map_err(|e| named(ConfigError::new("destination", e)))?;
        }
        let _ = t;
    }
    for (name, t) in transports {
        t.validate()
            .map_err(|e| ConfigError::new(format!("transports.{name}.{}", e.field), e.reason))?;
    }
    Ok(())
}

/// The error for a `kind` whose transport is not compiled in.
fn not_compiled(kind: &str) -> ConfigError {
    ConfigError::new(
        "kind",
        format!(
            "the {kind} transport is not compiled in: build with --features {kind} (the cargo \
             feature of the `outbox` library, or of `outbox-cli`)"
        ),
    )
}

/// A [`LazyTransport`](super::lazy::LazyTransport) named `kind` whose probe runs `connect`; a
/// connection error becomes an `Unavailable` error carrying its reason (the relay logs it when
/// it pauses the transport, and keeps probing with backoff).
#[allow(dead_code)] // Unused in a build without any broker transport.
fn lazy<T, F, Fut>(kind: &'static str, connect: F) -> Arc<dyn Transport>
where
    T: Transport,
    F: Fn() -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = Result<T, ConfigError>> + Send + 'static,
{
    Arc::new(super::lazy::LazyTransport::new(kind, move || {
        let connecting = connect();
        Box::pin(async move {
            match connecting.await {
                Ok(t) => Ok(Arc::new(t) as Arc<dyn Transport>),
                Err(e) => Err(TransportError::unavailable(format!(
                    "cannot connect the {kind} transport ({}): {}",
                    e.field, e.reason
                ))),
            }
        })
    }))
}

pub use super::settings::{check_url, env_secret};

#[cfg(test)]
mod tests;
