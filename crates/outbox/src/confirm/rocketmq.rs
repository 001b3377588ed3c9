//! Confirmations over RocketMQ.
//!
//! - Consumer side: [`RocketMqConfirmationSender`] sends each confirmation as a normal message
//!   (JSON body, see [`Confirmation`]) to the reply destination named in `outbox-reply-to`, a
//!   `Topic` or `Topic:Tag` as for the [transport](crate::transport::rocketmq); its `KEYS` are the
//!   confirmed message id and the consumer name, and `Ok` means the broker answered `SEND_OK`.
//! - Producer side: [`listen`] runs a push consumer in a consumer group (clustering, so several
//!   relay instances share the confirmations) on that topic, applies each batch with
//!   [`Store::apply_confirmations`](crate::Store::apply_confirmations) (retrying transient
//!   database errors) and consumes the batch only after the commit. When the database keeps
//!   failing, the batch is left to the broker's retry (`RECONSUME_LATER`: redelivered after the
//!   broker's delay levels, 10 s, 30 s, 1 min, …), unlike confirmations over core NATS, which are
//!   lost then and recovered by the check-back.
//!
//! A body that is not a confirmation is logged and consumed.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use async_trait::async_trait;
use rocketmq_client_rust::{ClientRuntime, ConsumeConcurrentlyStatus};
use tokio_util::sync::CancellationToken;

use super::{ConfirmReport, Confirmation, ConfirmationSender, apply_counted, parse_confirmations};
use crate::Store;
use crate::consumer::rocketmq::{Bridge, PushSettings, start_push_consumer};
use crate::error::{ConfigError, TransportError};
use crate::message::Headers;
use crate::transport::rocketmq::{
    Credentials, Destination, RocketMqConfig, RocketMqTransport, build_raw, parse_name_servers,
    validate_group,
};

/// Sends confirmations as RocketMQ messages through a started producer.
#[derive(Debug, Clone)]
pub struct RocketMqConfirmationSender {
    transport: RocketMqTransport,
}

impl RocketMqConfirmationSender {
    /// A sender over an existing transport's producer.
    pub fn new(transport: RocketMqTransport) -> Self {
        RocketMqConfirmationSender { transport }
    }

    /// Start a producer with `config` (producer group e.g. `outbox-confirmations`) and send
    /// through it.
    ///
    /// # Errors
    /// As [`RocketMqTransport::connect`].
    pub async fn connect(config: RocketMqConfig) -> Result<Self, ConfigError> {
        Ok(Self::new(RocketMqTransport::connect(config).await?))
    }
}

#[async_trait]
impl ConfirmationSender for RocketMqConfirmationSender {
    async fn send(&self, reply_to: &str, c: &Confirmation) -> Result<(), TransportError> {
        let dest = Destination::parse(reply_to).map_err(TransportError::permanent)?;
        let body = serde_json::to_vec(c).expect("confirmation serializes");
        let headers = Headers::from([("content-type".to_owned(), "application/json".to_owned())]);
        let msg = build_raw(
            &dest,
            body.into(),
            None,
            vec![c.message_id.to_string(), c.consumer.clone()],
            headers,
        )
        .map_err(TransportError::permanent)?;
        self.transport.send_one(msg, None).await
    }
}

/// Settings of the confirmation listener.
#[derive(Clone)]
pub struct ListenConfig {
    /// Name server list `host:port[;host:port…]`. Required.
    pub name_server: String,
    /// The reply destination the routes name (`Topic` or `Topic:Tag`); the listener subscribes to
    /// the topic, and to the tag when there is one. Required.
    pub destination: String,
    /// Consumer group shared by the relay instances. Required.
    pub group: String,
    /// Confirmations per listener call (`consumeMessageBatchMaxSize`, 1 to 1024), applied in one
    /// store transaction. Default 256.
    pub batch: usize,
    /// How often the client refreshes topic routes from the name server
    /// (`pollNameServerInterval`, 10 s to 10 min); confirmations sent to a topic that did not
    /// exist when the listener started are received after the next refresh. Default 30 s.
    pub route_refresh: std::time::Duration,
    /// ACL credentials. Default none.
    pub credentials: Option<Credentials>,
    /// The client runtime. Default none: the process-wide
    /// [`client_runtime`](crate::transport::rocketmq::client_runtime).
    pub runtime: Option<Arc<ClientRuntime>>,
}

impl std::fmt::Debug for ListenConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ListenConfig")
            .field("name_server", &self.name_server)
            .field("destination", &self.destination)
            .field("group", &self.group)
            .field("batch", &self.batch)
            .field("credentials", &self.credentials)
            .finish_non_exhaustive()
    }
}

impl ListenConfig {
    /// Settings with the defaults.
    pub fn new(
        name_server: impl Into<String>,
        destination: impl Into<String>,
        group: impl Into<String>,
    ) -> Self {
        ListenConfig {
            name_server: name_server.into(),
            destination: destination.into(),
            group: group.into(),
            batch: 256,
            route_refresh: std::time::Duration::from_secs(30),
            credentials: None,
            runtime: None,
        }
    }

    /// Check the settings without connecting.
    ///
    /// # Errors
    /// [`ConfigError`] naming `name_server`, `destination`, `group`, `batch` or `route_refresh`.
    pub fn validate(&self) -> Result<(), ConfigError> {
        parse_name_servers(&self.name_server).map_err(|r| ConfigError::new("name_server", r))?;
        Destination::parse(&self.destination).map_err(|r| ConfigError::new("destination", r))?;
        validate_group(&self.group).map_err(|r| ConfigError::new("group", r))?;
        if !(1..=1024).contains(&self.batch) {
            return Err(ConfigError::new("batch", "must be between 1 and 1024"));
        }
        let refresh = std::time::Duration::from_secs(10)..=std::time::Duration::from_secs(600);
        if !refresh.contains(&self.route_refresh) {
            return Err(ConfigError::new(
                "route_refresh",
                "must be between 10 s and 10 min (the client's pollNameServerInterval bounds)",
            ));
        }
        Ok(())
    }
}

/// Consume confirmations from `config.destination` in group `config.group` and apply them to
/// `store`, until `cancel`. Returns the totals.
///
/// # Errors
/// [`ConfigError`] naming the invalid field, or `name_server`, `topic` or `group` when the
/// consumer cannot subscribe or start.
pub async fn listen(
    config: ListenConfig,
    store: Arc<dyn Store>,
    cancel: CancellationToken,
) -> Result<ConfirmReport, ConfigError> {
    config.validate()?;
    let dest =
        Destination::parse(&config.destination).map_err(|r| ConfigError::new("destination", r))?;
    let tags = dest.tag.clone().unwrap_or_else(|| "*".into());
    let (bridge, mut jobs) = Bridge::new();
    let mut consumer = start_push_consumer(
        PushSettings {
            name_server: &config.name_server,
            group: &config.group,
            topic: &dest.topic,
            tags: &tags,
            batch: config.batch,
            from_first_offset: true,
            route_refresh: config.route_refresh,
            credentials: config.credentials.as_ref(),
            runtime: config.runtime.clone(),
            role: "confirmations",
        },
        bridge,
    )
    .await?;
    let malformed = AtomicU64::new(0);
    let mut total = ConfirmReport::default();
    loop {
        let job = tokio::select! {
            job = jobs.recv() => job,
            _ = cancel.cancelled() => {
                // Stop pulling; batches handed over meanwhile are answered below.
                consumer.suspend().await;
                break;
            }
        };
        let Some(job) = job else { break };
        let mut batch = Vec::new();
        for m in &job.messages {
            let body = m.body().unwrap_or_default();
            match parse_confirmations(&body) {
                Ok(cs) => batch.extend(cs),
                Err(e) => {
                    malformed.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(error = %e, msg_id = %m.msg_id(), "malformed confirmation consumed");
                }
            }
        }
        let status = if batch.is_empty() {
            ConsumeConcurrentlyStatus::ConsumeSuccess
        } else {
            let then = "the broker redelivers them";
            match apply_counted(&store, &batch, &mut total, then).await {
                Ok(()) => ConsumeConcurrentlyStatus::ConsumeSuccess,
                Err(_) => ConsumeConcurrentlyStatus::ReconsumeLater,
            }
        };
        let _ = job.reply.send(status);
    }
    // Answer what is still queued as "later" (the broker redelivers it), then stop the consumer.
    jobs.close();
    while let Ok(job) = jobs.try_recv() {
        let _ = job.reply.send(ConsumeConcurrentlyStatus::ReconsumeLater);
    }
    consumer.shutdown().await;
    Ok(total)
}
