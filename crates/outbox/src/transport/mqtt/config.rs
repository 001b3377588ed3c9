//! The MQTT transport's settings, broker URL parsing and the client options built from them.

use std::time::Duration;

use rumqttc::v5::MqttOptions;

use crate::error::ConfigError;
use crate::transport::settings::fill_secret;

/// What a PUBACK with reason 0x10 (*No matching subscribers*) means; `"retry"` or `"accept"`
/// in a configuration file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum NoSubscribers {
    /// A retryable error: the broker discarded the message. Default.
    #[default]
    Retry,
    /// Success: publishing to nobody is fine for this deployment.
    Accept,
}

/// MQTT transport settings; the `[transports.<name>] kind = "mqtt"` table of the configuration
/// file (see [`TransportConfig`](crate::transport::config::TransportConfig)). Durations are written
/// `"5s"`; every field but `url` may be left out.
#[derive(Clone, serde::Deserialize, serde::Serialize, derive_more::Debug)]
#[serde(default, deny_unknown_fields)]
pub struct MqttConfig {
    /// Broker URL: `mqtt://[user[:password]@]host[:port]` (TCP, default port 1883) or
    /// `mqtts://…` (TLS with rustls and the platform's root certificates, default port 8883).
    /// Required.
    #[debug("{:?}", crate::redact::url(url))]
    pub url: String,
    /// Client identifier. Default `outbox-relay-<16 hex digits>`, random per transport (the
    /// publisher uses a clean session, so it needs no stable identity).
    pub client_id: String,
    /// User name, overriding one in the URL. Default none.
    pub username: Option<String>,
    /// Password, overriding one in the URL. Default none. Never read from nor written to a
    /// file: see `password_env`.
    #[serde(skip)]
    #[debug("{:?}", crate::redact::secret(password))]
    pub password: Option<String>,
    /// Name of the environment variable holding the password, read by
    /// [`MqttConfig::resolve_secrets`] when `password` is none. Default none.
    pub password_env: Option<String>,
    /// How long to wait for the PUBACKs of a batch. Default 5 s.
    #[serde(with = "humantime_serde")]
    pub ack_timeout: Duration,
    /// How long to wait for the broker's CONNACK. Default 5 s.
    #[serde(with = "humantime_serde")]
    pub connect_timeout: Duration,
    /// Keep-alive interval. Default 30 s.
    #[serde(with = "humantime_serde")]
    pub keep_alive: Duration,
    /// Publishes in flight at most (the broker's Receive Maximum lowers it), at least 1.
    /// Default 1,000.
    pub max_inflight: u16,
    /// What a PUBACK *No matching subscribers* means. Default [`NoSubscribers::Retry`].
    #[serde(deserialize_with = "de_no_subscribers")]
    pub no_subscribers: NoSubscribers,
}

/// `no_subscribers`, with an error that names the key (an internally tagged
/// [`TransportConfig`](crate::transport::config::TransportConfig) loses the key's path).
fn de_no_subscribers<'de, D: serde::Deserializer<'de>>(d: D) -> Result<NoSubscribers, D::Error> {
    match <String as serde::Deserialize>::deserialize(d)?.as_str() {
        "retry" => Ok(NoSubscribers::Retry),
        "accept" => Ok(NoSubscribers::Accept),
        other => Err(serde::de::Error::custom(format!(
            "no_subscribers: {other:?} is neither \"retry\" nor \"accept\""
        ))),
    }
}

impl Default for MqttConfig {
    /// [`MqttConfig::new`] with an empty URL.
    fn default() -> Self {
        MqttConfig::new("")
    }
}

impl MqttConfig {
    /// Settings for `url` with the defaults.
    pub fn new(url: impl Into<String>) -> Self {
        MqttConfig {
            url: url.into(),
            client_id: format!("outbox-relay-{:016x}", rand::random::<u64>()),
            username: None,
            password: None,
            password_env: None,
            ack_timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(5),
            keep_alive: Duration::from_secs(30),
            max_inflight: 1000,
            no_subscribers: NoSubscribers::Retry,
        }
    }

    /// Check the settings without connecting, the variable named by `password_env` included.
    ///
    /// # Errors
    /// [`ConfigError`] naming `url`, `client_id`, `password_env`, `max_inflight`, `ack_timeout`
    /// or `connect_timeout`.
    pub fn validate(&self) -> Result<(), ConfigError> {
        parse_url(&self.url)?;
        ConfigError::invalid_if(self.client_id.is_empty(), "client_id", "must not be empty")?;
        self.resolve_secrets()?;
        ConfigError::invalid_if(self.max_inflight == 0, "max_inflight", "must be at least 1")?;
        for (field, d) in [
            ("ack_timeout", self.ack_timeout),
            ("connect_timeout", self.connect_timeout),
        ] {
            ConfigError::zero_if(d.is_zero(), field)?;
        }
        Ok(())
    }

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

/// A parsed `mqtt://` / `mqtts://` URL.
#[derive(Clone, PartialEq, Eq, derive_more::Debug)]
pub struct BrokerAddress {
    /// Host name or address.
    pub host: String,
    /// Port.
    pub port: u16,
    /// Whether to use TLS (`mqtts`).
    pub tls: bool,
    /// User name from the URL.
    pub username: Option<String>,
    /// Password from the URL.
    #[debug("{:?}", crate::redact::secret(password))]
    pub password: Option<String>,
}

/// Parse a broker URL (see [`MqttConfig::url`]).
///
/// # Errors
/// [`ConfigError`] naming `url`.
pub fn parse_url(url: &str) -> Result<BrokerAddress, ConfigError> {
    let bad = |why: &str| ConfigError::new("url", format!("{url:?} {why}"));
    let (scheme, rest) = url
        .split_once("://")
        .ok_or_else(|| bad("is not a URL (expected mqtt://host:port)"))?;
    let (tls, default_port) = match scheme {
        "mqtt" | "tcp" => (false, 1883),
        "mqtts" | "ssl" => (true, 8883),
        _ => return Err(bad("must start with mqtt:// or mqtts://")),
    };
    let rest = rest.split(['/', '?']).next().unwrap_or_default();
    let (userinfo, hostport) = match rest.rsplit_once('@') {
        Some((u, h)) => (Some(u), h),
        None => (None, rest),
    };
    let (username, password) = match userinfo {
        Some(u) => match u.split_once(':') {
            Some((n, p)) => (Some(n.to_owned()), Some(p.to_owned())),
            None => (Some(u.to_owned()), None),
        },
        None => (None, None),
    };
    let (host, port) = match hostport.rsplit_once(':') {
        Some((h, p)) if !h.ends_with(']') || h.starts_with('[') => {
            (h, p.parse::<u16>().map_err(|_| bad("has an invalid port"))?)
        }
        _ => (hostport, default_port),
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host.is_empty() {
        return Err(bad("has no host"));
    }
    Ok(BrokerAddress {
        host: host.to_owned(),
        port,
        tls,
        username,
        password,
    })
}

/// The rumqttc options for a session: MQTT 5, `client_id`, credentials (explicit ones override
/// the URL's), TLS for `mqtts`.
///
/// # Errors
/// [`ConfigError`] naming `url` or `client_id`.
pub fn options(
    url: &str,
    client_id: &str,
    username: Option<&str>,
    password: Option<&str>,
    keep_alive: Duration,
    connect_timeout: Duration,
) -> Result<MqttOptions, ConfigError> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let addr = parse_url(url)?;
    ConfigError::invalid_if(
        client_id.is_empty() || client_id.len() > 65535,
        "client_id",
        "must be 1 to 65,535 bytes",
    )?;
    let mut o = MqttOptions::new(client_id, addr.host, addr.port);
    o.set_keep_alive(keep_alive.max(Duration::from_secs(5)));
    o.set_connection_timeout(connect_timeout.as_secs().max(1));
    let user = username.map(str::to_owned).or(addr.username);
    let pass = password.map(str::to_owned).or(addr.password);
    if let Some(u) = user {
        o.set_credentials(u, pass.unwrap_or_default());
    }
    if addr.tls {
        o.set_transport(rumqttc::Transport::tls_with_default_config());
    }
    Ok(o)
}
