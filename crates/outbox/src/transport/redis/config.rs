//! The Redis Streams transport's settings ([`RedisConfig`]) and the connection they describe.

use super::*;
use crate::transport::settings::fill_secret;

/// Redis Streams transport settings; the `[transports.<name>] kind = "redis"` table of the
/// configuration file (see [`TransportConfig`](crate::transport::config::TransportConfig)), where the
/// replica wait is written flat: `url`, `cluster`, `password_env`, `max_len`, `wait_replicas` (a count),
/// `wait_timeout` (default `"1s"`, only with `wait_replicas`), `response_timeout`,
/// `connect_timeout`.
#[derive(Clone, serde::Deserialize, serde::Serialize, derive_more::Debug)]
#[serde(try_from = "RedisFile", into = "RedisFile")]
pub struct RedisConfig {
    /// Server URL: `redis://[user[:password]@]host[:port][/db]`, or `rediss://…` for TLS
    /// (rustls with the platform's root certificates). For a Redis Cluster, the URLs of some of
    /// its nodes separated by commas (a seed list, which implies `cluster`), or one node's URL
    /// with `cluster = true`. Required.
    #[debug("{:?}", crate::redact::url(url))]
    pub url: String,
    /// Connect to a Redis Cluster ([`RedisConnection::Cluster`]) instead of one server. Implied
    /// by a seed list in `url`. Default false.
    pub cluster: bool,
    /// Password (ACL or `requirepass`), overriding one in the URL. Default: none (the URL's).
    /// Never read from nor written to a file: see `password_env`.
    #[debug("{:?}", crate::redact::secret(password))]
    pub password: Option<String>,
    /// Name of the environment variable holding the password, read by
    /// [`RedisConfig::resolve_secrets`] when `password` is none. Default none.
    pub password_env: Option<String>,
    /// Approximate length cap: `XADD key MAXLEN ~ n *`. Default `None` (no trimming). Trimming
    /// drops entries whatever the consumer groups have read (shared case C38): see
    /// [`RedisConfig::warnings`].
    pub max_len: Option<u64>,
    /// Wait for this many replicas after each batch (`WAIT`). Default `None` (the primary's reply
    /// acknowledges).
    pub wait_replicas: Option<WaitReplicas>,
    /// How long to wait for a reply (the batch's pipeline, a probe). Default 5 s.
    pub response_timeout: Duration,
    /// How long to wait for a connection. Default 5 s.
    pub connect_timeout: Duration,
}

/// `WAIT numreplicas timeout` after each batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WaitReplicas {
    /// Replicas that must have the batch. At least 1.
    pub replicas: u32,
    /// How long the server waits for them (`WAIT`'s timeout, milliseconds on the wire). Must be
    /// shorter than [`RedisConfig::response_timeout`].
    pub timeout: Duration,
}

impl RedisConfig {
    /// Settings for `url` with the defaults.
    pub fn new(url: impl Into<String>) -> Self {
        RedisConfig {
            url: url.into(),
            cluster: false,
            password: None,
            password_env: None,
            max_len: None,
            wait_replicas: None,
            response_timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(5),
        }
    }

    /// The start-up warnings these settings deserve, one sentence each; empty when none.
    /// [`RedisTransport::connect`] logs each at `warn` level. Today: a [`max_len`](Self::max_len)
    /// cap, because trimming can drop entries no consumer group has received or acknowledged
    /// (shared case C38).
    pub fn warnings(&self) -> Vec<String> {
        let mut w = Vec::new();
        if let Some(n) = self.max_len {
            w.push(format!(
                "max_len = {n}: every XADD trims the stream to about {n} entries (MAXLEN ~), \
                 whatever the consumer groups have read; entries not yet delivered are lost and \
                 pending ones lose their payload (shared case C38). Leave max_len unset and trim \
                 with RedisTransport::trim_delivered (XTRIM MINID below every group's progress) \
                 instead"
            ));
        }
        w
    }

    /// Check the settings without connecting.
    ///
    /// # Errors
    /// [`ConfigError`] naming `url`, `password_env`, `max_len`, `wait_replicas` or
    /// `response_timeout`.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let resolved = self.resolve_secrets()?;
        for url in self.url.split(',') {
            connection_info(url.trim(), resolved.password.as_deref())?;
        }
        ConfigError::invalid_if(
            self.max_len == Some(0),
            "max_len",
            "must be at least 1 (leave it unset for no trimming)",
        )?;
        if let Some(w) = self.wait_replicas {
            ConfigError::invalid_if(
                w.replicas == 0,
                "wait_replicas",
                "replicas must be at least 1",
            )?;
            ConfigError::invalid_if(
                w.timeout.is_zero() || w.timeout >= self.response_timeout,
                "wait_replicas",
                "timeout must be greater than zero and shorter than response_timeout",
            )?;
        }
        ConfigError::zero_if(self.response_timeout.is_zero(), "response_timeout")?;
        Ok(())
    }
}

impl RedisConfig {
    /// A copy with `password` read from the variable named by `password_env` (when `password`
    /// is none).
    ///
    /// # Errors
    /// [`ConfigError`] naming `password_env` when the variable is not set.
    pub fn resolve_secrets(&self) -> Result<Self, ConfigError> {
        let mut c = self.clone();
        fill_secret(&mut c.password, "password_env", c.password_env.as_deref())?;
        Ok(c)
    }
}

/// The file form of [`RedisConfig`]: the replica wait written flat.
#[derive(serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
struct RedisFile {
    #[serde(default)]
    url: String,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    cluster: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    password_env: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    max_len: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    wait_replicas: Option<u32>,
    #[serde(
        default,
        with = "humantime_serde",
        skip_serializing_if = "Option::is_none"
    )]
    wait_timeout: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    response_timeout: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    connect_timeout: Option<Duration>,
}

impl TryFrom<RedisFile> for RedisConfig {
    type Error = String;

    fn try_from(f: RedisFile) -> Result<Self, String> {
        let mut c = RedisConfig::new(f.url);
        c.cluster = f.cluster;
        c.password_env = f.password_env;
        c.max_len = f.max_len;
        c.wait_replicas = match (f.wait_replicas, f.wait_timeout) {
            (Some(replicas), timeout) => Some(WaitReplicas {
                replicas,
                timeout: timeout.unwrap_or(Duration::from_secs(1)),
            }),
            (None, Some(_)) => return Err("wait_timeout is set only with wait_replicas".into()),
            (None, None) => None,
        };
        c.response_timeout = f.response_timeout.unwrap_or(c.response_timeout);
        c.connect_timeout = f.connect_timeout.unwrap_or(c.connect_timeout);
        Ok(c)
    }
}

impl From<RedisConfig> for RedisFile {
    fn from(c: RedisConfig) -> Self {
        RedisFile {
            url: c.url,
            cluster: c.cluster,
            password_env: c.password_env,
            max_len: c.max_len,
            wait_replicas: c.wait_replicas.map(|w| w.replicas),
            wait_timeout: c.wait_replicas.map(|w| w.timeout),
            response_timeout: Some(c.response_timeout),
            connect_timeout: Some(c.connect_timeout),
        }
    }
}

/// Parse `url` (and an overriding password) into the client's connection settings.
pub(super) fn connection_info(
    url: &str,
    password: Option<&str>,
) -> Result<redis::ConnectionInfo, ConfigError> {
    ConfigError::invalid_if(
        !(url.starts_with("redis://") || url.starts_with("rediss://")),
        "url",
        format!("{url:?} is not a redis:// or rediss:// URL"),
    )?;
    let info = url
        .into_connection_info()
        .map_err(|e| ConfigError::new("url", format!("invalid Redis URL {url:?}: {e}")))?;
    Ok(match password {
        Some(p) => {
            let settings = info.redis_settings().clone().set_password(p);
            info.set_redis_settings(settings)
        }
        None => info,
    })
}
