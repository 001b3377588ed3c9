//! RocketMQ transport settings: credentials, the configuration, name servers, topic and group names, destinations.

use super::*;

/// ACL credentials (RocketMQ ACL 1.0 `AccessKey`/`SecretKey`, signed on every request by the
/// client's `AclClientRPCHook`).
#[derive(Clone, Default, derive_more::Debug)]
pub struct Credentials {
    /// The access key.
    pub access_key: String,
    /// The secret key (never logged, never read from nor written to a file).
    #[debug("***")]
    pub secret_key: String,
    /// Name of the environment variable holding the secret key, read by
    /// [`RocketMqConfig::resolve_secrets`] when `secret_key` is empty. Default none.
    pub secret_key_env: Option<String>,
}

impl Credentials {
    /// A copy with `secret_key` read from the variable named by `secret_key_env` (when
    /// `secret_key` is empty), checked.
    ///
    /// # Errors
    /// [`ConfigError`] naming `access_key` (empty) or `secret_key_env` (the variable is not
    /// set, or no secret key is given at all).
    pub fn resolved(&self) -> Result<Credentials, ConfigError> {
        let mut k = self.clone();
        if k.secret_key.is_empty()
            && let Some(v) = crate::transport::settings::env_secret(
                "secret_key_env",
                k.secret_key_env.as_deref(),
            )?
        {
            k.secret_key = v;
        }
        ConfigError::invalid_if(k.access_key.is_empty(), "access_key", "must not be empty")?;
        ConfigError::invalid_if(
            k.secret_key.is_empty(),
            "secret_key_env",
            "the secret key is empty: name the environment variable holding it",
        )?;
        Ok(k)
    }
}

/// RocketMQ transport settings; the `[transports.<name>] kind = "rocketmq"` table of the
/// configuration file (see [`TransportConfig`](crate::transport::config::TransportConfig)), written
/// `url = "rocketmq://host:port[;host:port…]"`, `producer_group`, `default_topic`, `access_key`,
/// `secret_key_env`, `send_timeout` (`"3s"`), `retries`, `max_message_size`, `max_in_flight`,
/// `order_by_partition_key`, `create_topic_key`; every field but `url` may be left out.
#[derive(Clone, serde::Deserialize, serde::Serialize, derive_more::Debug)]
#[serde(from = "RocketMqFile", into = "RocketMqFile")]
pub struct RocketMqConfig {
    /// Name server address list, `host:port` separated by `;` (RocketMQ's `namesrvAddr`), e.g.
    /// `127.0.0.1:9876`. Required; [`RocketMqConfig::from_url`] reads it from
    /// `rocketmq://host:port[;host:port…]`.
    pub name_server: String,
    /// Producer group (`producerGroup`; letters, digits, `%|_-`, at most 120 characters).
    /// Default `outbox-relay`.
    pub producer_group: String,
    /// How long one send may take, client retries included (`sendMsgTimeout`; 100 ms to 60 s).
    /// Default 3 s.
    pub send_timeout: Duration,
    /// Client retries of a failed send on another queue or broker (`retryTimesWhenSendFailed`).
    /// Default 2.
    pub retries: u32,
    /// Largest body in bytes (`maxMessageSize`); larger payloads fail as permanent before they are
    /// sent. Keep it at most the broker's `maxMessageSize`. Default 4 MiB.
    pub max_message_size: usize,
    /// Sends of one batch in flight at once (a partition key's messages count as one, being
    /// sent one after the other). Default 256.
    pub max_in_flight: usize,
    /// Send messages with a partition key to the queue chosen by the key's hash (see the module
    /// docs), so one key's messages stay in one queue. Default true.
    pub order_by_partition_key: bool,
    /// ACL credentials. Default none.
    pub credentials: Option<Credentials>,
    /// The topic whose route the client borrows for a topic the name server does not know yet
    /// (`createTopicKey`, RocketMQ's default `TBW102`, which a broker with
    /// `autoCreateTopicEnable=true` registers). Default none (the client's default).
    pub create_topic_key: Option<String>,
    /// The client runtime to run on. Default none: the process-wide [`client_runtime`].
    #[debug("{}", runtime.is_some())]
    pub runtime: Option<Arc<ClientRuntime>>,
    /// RocketMQ topic of the routes that name no destination: they send to
    /// `<default_topic>:{topic}`, the outbox topic as the tag
    /// ([`TransportConfig::default_destination`](crate::transport::config::TransportConfig::default_destination)).
    /// Default: none, the destination is `{topic}` itself (then outbox topics must be valid
    /// RocketMQ topic names).
    pub default_topic: Option<String>,
}

/// The file form of [`RocketMqConfig`]: the name servers as a URL, the credentials flat.
#[derive(serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RocketMqFile {
    #[serde(default)]
    url: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    producer_group: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    default_topic: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    access_key: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    secret_key_env: Option<String>,
    #[serde(default, with = "humantime_serde")]
    send_timeout: Option<Duration>,
    #[serde(default)]
    retries: Option<u32>,
    #[serde(default)]
    max_message_size: Option<usize>,
    #[serde(default)]
    max_in_flight: Option<usize>,
    #[serde(default)]
    order_by_partition_key: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    create_topic_key: Option<String>,
}

impl From<RocketMqFile> for RocketMqConfig {
    fn from(f: RocketMqFile) -> Self {
        // A URL of another scheme is kept whole, for `validate` to refuse.
        let ns = f.url.strip_prefix("rocketmq://").unwrap_or(&f.url);
        let mut c = RocketMqConfig::new(ns.trim_end_matches('/'));
        c.producer_group = f.producer_group.unwrap_or(c.producer_group);
        c.default_topic = f.default_topic;
        if f.access_key.is_some() || f.secret_key_env.is_some() {
            c.credentials = Some(Credentials {
                access_key: f.access_key.unwrap_or_default(),
                secret_key: String::new(),
                secret_key_env: f.secret_key_env,
            });
        }
        c.send_timeout = f.send_timeout.unwrap_or(c.send_timeout);
        c.retries = f.retries.unwrap_or(c.retries);
        c.max_message_size = f.max_message_size.unwrap_or(c.max_message_size);
        c.max_in_flight = f.max_in_flight.unwrap_or(c.max_in_flight);
        c.order_by_partition_key = f.order_by_partition_key.unwrap_or(c.order_by_partition_key);
        c.create_topic_key = f.create_topic_key;
        c
    }
}

impl From<RocketMqConfig> for RocketMqFile {
    fn from(c: RocketMqConfig) -> Self {
        let (access_key, secret_key_env) = match c.credentials {
            Some(k) => (Some(k.access_key), k.secret_key_env),
            None => (None, None),
        };
        RocketMqFile {
            url: format!("rocketmq://{}", c.name_server),
            producer_group: Some(c.producer_group),
            default_topic: c.default_topic,
            access_key,
            secret_key_env,
            send_timeout: Some(c.send_timeout),
            retries: Some(c.retries),
            max_message_size: Some(c.max_message_size),
            max_in_flight: Some(c.max_in_flight),
            order_by_partition_key: Some(c.order_by_partition_key),
            create_topic_key: c.create_topic_key,
        }
    }
}

impl RocketMqConfig {
    /// Settings for the name server list `name_server` (`host:port[;host:port…]`) with the
    /// defaults.
    pub fn new(name_server: impl Into<String>) -> Self {
        RocketMqConfig {
            name_server: name_server.into(),
            producer_group: "outbox-relay".into(),
            send_timeout: Duration::from_secs(3),
            retries: 2,
            max_message_size: DEFAULT_MAX_MESSAGE_SIZE,
            max_in_flight: 256,
            order_by_partition_key: true,
            credentials: None,
            create_topic_key: None,
            runtime: None,
            default_topic: None,
        }
    }

    /// A copy with the credentials' secret key read from the variable named by
    /// `secret_key_env` (when the secret key is empty): [`Credentials::resolved`].
    ///
    /// # Errors
    /// As [`Credentials::resolved`].
    pub fn resolve_secrets(&self) -> Result<Self, ConfigError> {
        let mut c = self.clone();
        c.credentials = c
            .credentials
            .as_ref()
            .map(Credentials::resolved)
            .transpose()?;
        Ok(c)
    }

    /// Settings from a `rocketmq://host:port[;host:port…]` URL with the defaults.
    ///
    /// # Errors
    /// [`ConfigError`] naming `url` for another scheme or a malformed address list.
    pub fn from_url(url: &str) -> Result<Self, ConfigError> {
        Ok(Self::new(name_server_of_url(url)?))
    }

    /// Check the settings without connecting.
    ///
    /// # Errors
    /// [`ConfigError`] naming the field: `name_server` (`url` in a file), `producer_group`,
    /// `default_topic`, `send_timeout`, `max_message_size`, `max_in_flight`, `access_key`,
    /// `secret_key_env`, `create_topic_key`.
    pub fn validate(&self) -> Result<(), ConfigError> {
        ConfigError::invalid_if(
            self.name_server.contains("://"),
            "name_server",
            format!(
                "{:?} is not a rocketmq://host:port[;host:port…] URL",
                self.name_server
            ),
        )?;
        parse_name_servers(&self.name_server).map_err(|r| ConfigError::new("name_server", r))?;
        validate_group(&self.producer_group).map_err(|r| ConfigError::new("producer_group", r))?;
        ConfigError::invalid_if(
            !(Duration::from_millis(100)..=Duration::from_secs(60)).contains(&self.send_timeout),
            "send_timeout",
            "must be between 100 ms and 60 s (the client's request timeout bounds)",
        )?;
        ConfigError::invalid_if(
            self.max_message_size == 0 || self.max_message_size > u32::MAX as usize,
            "max_message_size",
            "must be between 1 and 4294967295 bytes",
        )?;
        ConfigError::invalid_if(
            self.max_in_flight == 0,
            "max_in_flight",
            "must be at least 1",
        )?;
        if let Some(t) = &self.default_topic {
            validate_topic(t).map_err(|r| ConfigError::new("default_topic", r))?;
        }
        self.resolve_secrets()?;
        if let Some(t) = &self.create_topic_key {
            validate_topic(t).map_err(|r| ConfigError::new("create_topic_key", r))?;
        }
        Ok(())
    }
}

/// The name server list of a `rocketmq://host:port[;host:port…]` URL.
///
/// # Errors
/// [`ConfigError`] naming `url`.
pub fn name_server_of_url(url: &str) -> Result<String, ConfigError> {
    let rest = url.strip_prefix("rocketmq://").ok_or_else(|| {
        ConfigError::new(
            "url",
            format!("{url:?} is not a rocketmq://host:port[;host:port…] URL"),
        )
    })?;
    let rest = rest.trim_end_matches('/');
    parse_name_servers(rest).map_err(|r| ConfigError::new("url", r))?;
    Ok(rest.to_owned())
}

/// Split and check a `host:port;host:port` name server list.
pub(crate) fn parse_name_servers(list: &str) -> Result<Vec<String>, String> {
    let addrs: Vec<String> = list
        .split(';')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
        .collect();
    if addrs.is_empty() {
        return Err("no name server address (expected host:port[;host:port…])".into());
    }
    for a in &addrs {
        let ok = a
            .rsplit_once(':')
            .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok_and(|p| p > 0));
        if !ok {
            return Err(format!("{a:?} is not a host:port name server address"));
        }
    }
    Ok(addrs)
}

/// Check a topic name as RocketMQ does (`Validators.checkTopic`): 1 to 127 characters from
/// `%|a-zA-Z0-9_-`.
pub(crate) fn validate_topic(topic: &str) -> Result<(), String> {
    validate_name("RocketMQ topic", topic, 127)
}

/// Check a producer or consumer group name as RocketMQ does (`Validators.checkGroup`): 1 to 120
/// characters from `%|a-zA-Z0-9_-`.
pub(crate) fn validate_group(group: &str) -> Result<(), String> {
    validate_name("group", group, 120)
}

/// Check a RocketMQ name (a topic, a group): 1 to `max` characters from `%|a-zA-Z0-9_-`. The
/// error names it as `what`.
fn validate_name(what: &str, name: &str, max: usize) -> Result<(), String> {
    if name.is_empty() || name.len() > max {
        return Err(format!("{what} {name:?} must have 1 to {max} characters"));
    }
    if !name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'%' | b'|' | b'_' | b'-'))
    {
        return Err(format!(
            "{what} {name:?} may only contain letters, digits and %|_-"
        ));
    }
    Ok(())
}

/// A parsed destination: RocketMQ topic and optional tag.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Destination {
    /// The RocketMQ topic.
    pub topic: String,
    /// The tag, if the destination names one.
    pub tag: Option<String>,
}

impl Destination {
    /// Parse `Topic` or `Topic:Tag` (see the module docs for the rules).
    ///
    /// # Errors
    /// A text naming the rule that `s` breaks.
    pub fn parse(s: &str) -> Result<Destination, String> {
        let (topic, tag) = match s.split_once(':') {
            Some((t, tag)) => (t, Some(tag)),
            None => (s, None),
        };
        validate_topic(topic).map_err(|r| format!("invalid destination {s:?}: {r}"))?;
        if TopicValidator::is_not_allowed_send_topic(topic) {
            return Err(format!(
                "invalid destination {s:?}: {topic} is a RocketMQ system topic that producers may not send to"
            ));
        }
        if let Some(tag) = tag {
            let bad = tag.is_empty()
                || tag.contains("||")
                || tag.chars().any(|c| c.is_whitespace() || c.is_control());
            if bad {
                return Err(format!(
                    "invalid destination {s:?}: the tag after ':' must be non-empty, without whitespace, control characters or \"||\""
                ));
            }
        }
        Ok(Destination {
            topic: topic.to_owned(),
            tag: tag.map(str::to_owned),
        })
    }
}
