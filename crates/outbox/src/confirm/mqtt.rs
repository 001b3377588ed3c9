//! Confirmations over MQTT 5: consumers publish each confirmation's JSON at QoS 1 to the reply
//! topic (the route's `reply_to`) and wait for the PUBACK; the producer subscribes with a
//! persistent session to `$share/<group>/<topic>` (several producer instances share the work),
//! applies batches of up to 500 to its [`Store`] and acknowledges them (manual PUBACK) after the
//! commit. Confirmations not acknowledged are sent again by the broker when the listener's
//! session reconnects; the producer's check-back recovers any that never arrive (e.g. sent while
//! no listener session existed: the sender reports that PUBACK *No matching subscribers* as a
//! retryable error, logged by the consumer runner).

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use rumqttc::v5::mqttbytes::v5::PublishProperties;
use tokio_util::sync::CancellationToken;

use super::{ConfirmReport, Confirmation, ConfirmationSender};
use crate::Store;
use crate::consumer::mqtt::{MqttConsumerConfig, MqttSource};
use crate::consumer::source::RunOptions;
use crate::error::{ConfigError, TransportError};
use crate::transport::mqtt::{MqttConfig, Publisher};

/// Publishes confirmations at QoS 1 and waits for the PUBACK.
pub struct MqttConfirmationSender {
    publisher: Publisher,
}

impl std::fmt::Debug for MqttConfirmationSender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MqttConfirmationSender")
            .finish_non_exhaustive()
    }
}

impl MqttConfirmationSender {
    /// Connect a publisher with `config` (a clean session of its own).
    ///
    /// # Errors
    /// As [`MqttTransport::connect`](crate::transport::mqtt::MqttTransport::connect).
    pub async fn connect(config: MqttConfig) -> Result<Self, ConfigError> {
        Ok(MqttConfirmationSender {
            publisher: Publisher::connect(&config).await?,
        })
    }
}

#[async_trait]
impl ConfirmationSender for MqttConfirmationSender {
    async fn send(&self, reply_to: &str, c: &Confirmation) -> Result<(), TransportError> {
        let body = serde_json::to_vec(c).expect("confirmation serializes");
        let props = PublishProperties {
            content_type: Some("application/json".into()),
            ..Default::default()
        };
        self.publisher
            .publish_one(reply_to, Bytes::from(body), props)
            .await
    }
}

/// Where [`listen`] receives confirmations.
#[derive(Clone, derive_more::Debug)]
pub struct MqttListenConfig {
    /// Broker URL, `mqtt://…` or `mqtts://…`. Required.
    #[debug("{:?}", crate::redact::url(url))]
    pub url: String,
    /// Client id of the listener's persistent session; stable per producer instance. Default
    /// `outbox-confirmations-<16 hex digits>`.
    pub client_id: String,
    /// User name, overriding one in the URL. Default none.
    pub username: Option<String>,
    /// Password, overriding one in the URL. Default none.
    #[debug("{:?}", crate::redact::secret(password))]
    pub password: Option<String>,
    /// The reply topic (the routes' `reply_to`). Required.
    pub topic: String,
    /// Shared-subscription group of the producer's instances. Default `outbox-confirmations`.
    pub group: String,
    /// How long the broker keeps the session after a disconnect. Default 1 day.
    pub session_expiry: Duration,
}

impl MqttListenConfig {
    /// Settings for `topic` at `url` with the defaults.
    pub fn new(url: impl Into<String>, topic: impl Into<String>) -> Self {
        MqttListenConfig {
            url: url.into(),
            client_id: format!("outbox-confirmations-{:016x}", rand::random::<u64>()),
            username: None,
            password: None,
            topic: topic.into(),
            group: "outbox-confirmations".into(),
            session_expiry: Duration::from_secs(24 * 3600),
        }
    }
}

/// Receive confirmations on `config.topic` and apply them to `store` in batches of up to 500,
/// acknowledging after the commit, until `cancel`: the generic runner over an [`MqttSource`]
/// with a [`ConfirmationHandler`](super::ConfirmationHandler). Returns the totals.
///
/// # Errors
/// [`ConfigError`] naming `url`, `client_id` or `password` when the session cannot be opened.
/// Later connection errors are logged and the session reconnects.
pub async fn listen(
    config: MqttListenConfig,
    store: Arc<dyn Store>,
    cancel: CancellationToken,
) -> Result<ConfirmReport, ConfigError> {
    crate::transport::mqtt::validate_topic(&config.topic)
        .map_err(|r| ConfigError::new("topic", r))?;
    let mut c = MqttConsumerConfig::new(config.url, config.client_id, config.topic);
    c.username = config.username;
    c.password = config.password;
    c.group = Some(config.group);
    c.session_expiry = config.session_expiry;
    c.receive_maximum = 1000;
    let options = RunOptions {
        batch: 500,
        ..RunOptions::default()
    };
    super::listen(MqttSource::new(c)?, store, &options, &cancel).await
}
