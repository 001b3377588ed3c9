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
//!   failing, the batch is sent back for the broker's retry (delay level 1, 1 s), unlike
//!   confirmations over core NATS, which are lost then and recovered by the check-back.
//!
//! A body that is not a confirmation is logged and consumed.

use std::sync::Arc;

use async_trait::async_trait;
use rocketmq_client_rust::ClientRuntime;
use tokio_util::sync::CancellationToken;

use super::{ConfirmReport, Confirmation, ConfirmationSender};
use crate::Store;
use crate::consumer::rocketmq::{
    RocketMqConsumerConfig, RocketMqSource, validate_batch, validate_route_refresh,
};
use crate::consumer::source::RunOptions;
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
#[derive(Clone, derive_more::Debug)]
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
    #[debug(skip)]
    pub route_refresh: std::time::Duration,
    /// ACL credentials. Default none.
    pub credentials: Option<Credentials>,
    /// The client runtime. Default none: the process-wide
    /// [`client_runtime`](crate::transport::rocketmq::client_runtime).
    #[debug(skip)]
    pub runtime: Option<Arc<ClientRuntime>>,
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
        validate_batch(self.batch)?;
        validate_route_refresh(self.route_refresh)
    }
}

/// Consume confirmations from `config.destination` in group `config.group` and apply them to
/// `store`, until `cancel`: the generic runner over a [`RocketMqSource`] with a
/// [`ConfirmationHandler`](super::ConfirmationHandler). Returns the totals.
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
    let mut c = RocketMqConsumerConfig::new(config.name_server, config.group, dest.topic);
    c.tags = dest.tag.unwrap_or_else(|| "*".into());
    c.batch = config.batch;
    c.route_refresh = config.route_refresh;
    c.credentials = config.credentials;
    c.runtime = config.runtime;
    let options = RunOptions {
        batch: c.batch,
        ..RunOptions::default()
    };
    let source = RocketMqSource::unchecked(c, "confirmations");
    super::listen(source, store, &options, &cancel).await
}
