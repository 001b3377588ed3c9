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
use rumqttc::v5::mqttbytes::v5::{Publish, PublishProperties};
use tokio_util::sync::CancellationToken;

use super::{
    ConfirmReport, Confirmation, ConfirmationSender, apply_with_retry, parse_confirmations,
};
use crate::Store;
use crate::consumer::mqtt::{next_publish, open_session};
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
#[derive(Debug, Clone)]
pub struct MqttListenConfig {
    /// Broker URL, `mqtt://…` or `mqtts://…`. Required.
    pub url: String,
    /// Client id of the listener's persistent session; stable per producer instance. Default
    /// `outbox-confirmations-<16 hex digits>`.
    pub client_id: String,
    /// User name, overriding one in the URL. Default none.
    pub username: Option<String>,
    /// Password, overriding one in the URL. Default none.
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
/// acknowledging after the commit, until `cancel`. Returns the totals.
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
    let subscription = format!("$share/{}/{}", config.group, config.topic);
    let (client, mut eventloop) = open_session(
        &config.url,
        &config.client_id,
        config.username.as_deref(),
        config.password.as_deref(),
        Duration::from_secs(30),
        Duration::from_secs(5),
        config.session_expiry,
        1000,
        &subscription,
    )
    .await?;
    let backoff = crate::Backoff {
        base: Duration::from_millis(100),
        max: Duration::from_secs(5),
        ..Default::default()
    };
    let mut total = ConfirmReport::default();
    let mut failures = 0u32;
    let mut apply_failures = 0u32;
    loop {
        let Some(first) = next_publish(
            &mut eventloop,
            &client,
            &subscription,
            &mut failures,
            &cancel,
        )
        .await
        else {
            return Ok(total);
        };
        let mut received: Vec<Publish> = vec![first];
        // Take whatever else arrives at once, up to 500.
        while received.len() < 500 {
            let quick = tokio::time::timeout(
                Duration::from_millis(2),
                next_publish(
                    &mut eventloop,
                    &client,
                    &subscription,
                    &mut failures,
                    &cancel,
                ),
            )
            .await;
            match quick {
                Ok(Some(p)) => received.push(p),
                _ => break,
            }
        }
        let mut batch = Vec::with_capacity(received.len());
        for p in &received {
            match parse_confirmations(&p.payload) {
                Ok(cs) => batch.extend(cs),
                Err(e) => tracing::warn!(error = %e, "malformed confirmation ignored"),
            }
        }
        loop {
            let applied = if batch.is_empty() {
                Ok(ConfirmReport::default())
            } else {
                apply_with_retry(&store, &batch, 5).await
            };
            match applied {
                Ok(r) => {
                    apply_failures = 0;
                    super::record(&mut total, r);
                    for p in &received {
                        if let Err(e) = client.ack(p).await {
                            tracing::warn!(error = %e, "acknowledging a confirmation failed");
                        }
                    }
                    break;
                }
                Err(e) => {
                    // Not acknowledged: try again after a backoff (the broker would only send
                    // them again after a reconnect).
                    apply_failures += 1;
                    tracing::error!(error = %e, n = batch.len(), "confirmations not applied; retrying");
                    tokio::select! {
                        _ = cancel.cancelled() => return Ok(total),
                        _ = tokio::time::sleep(backoff.delay(apply_failures)) => {}
                    }
                }
            }
        }
    }
}
