//! Confirmations over RabbitMQ: consumers publish each [`Confirmation`] (JSON) to the reply
//! destination named in `outbox-reply-to`, with a publisher confirm; the producer consumes its
//! confirmation queue and applies the confirmations to its [`Store`] in batches, acknowledging
//! them only after the batch committed.
//!
//! The reply destination uses the transport's format
//! ([`Destination`](crate::transport::rabbitmq::Destination)): a bare queue name (through the
//! default exchange, the usual choice: `reply_to = "orders.confirmations"`) or
//! `exchange/routing-key`. [`listen`] declares its queue (durable), so confirmations published
//! while the producer is down wait for it. A confirmation that cannot be published (broker down,
//! queue missing: `312 NO_ROUTE` with the mandatory flag) is an error for the runner, which counts
//! it; the producer's check-back recovers it.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use lapin::BasicProperties;
use tokio_util::sync::CancellationToken;

use super::{ConfirmReport, Confirmation, ConfirmationSender};
use crate::Store;
use crate::consumer::rabbitmq::{QueueSetup, RabbitMqConsumerConfig, RabbitMqSource};
use crate::consumer::source::RunOptions;
use crate::error::{ConfigError, TransportError};
use crate::transport::rabbitmq::{Publication, RabbitMqConfig, RabbitMqTransport, now_secs};

/// Largest batch of confirmations applied in one producer transaction.
const BATCH: u16 = 500;

/// Publishes confirmations to RabbitMQ with publisher confirms, through a transport's
/// connection (its own, or one shared with the relay's transport).
#[derive(Debug, Clone)]
pub struct RabbitMqConfirmationSender {
    transport: RabbitMqTransport,
}

impl RabbitMqConfirmationSender {
    /// A sender with its own connection, opened on the first confirmation.
    ///
    /// # Errors
    /// [`ConfigError`] naming the invalid field of `config`.
    pub fn new(config: RabbitMqConfig) -> Result<Self, ConfigError> {
        Ok(RabbitMqConfirmationSender {
            transport: RabbitMqTransport::lazy(config)?,
        })
    }

    /// A sender sharing the connection of `transport`.
    pub fn from_transport(transport: &RabbitMqTransport) -> Self {
        RabbitMqConfirmationSender {
            transport: transport.clone(),
        }
    }
}

#[async_trait]
impl ConfirmationSender for RabbitMqConfirmationSender {
    /// Publish `c` as JSON to `reply_to` (persistent, `content_type` `application/json`,
    /// `message_id` `<message id>/<consumer>`) and await the publisher confirm.
    async fn send(&self, reply_to: &str, c: &Confirmation) -> Result<(), TransportError> {
        let body = serde_json::to_vec(c).expect("confirmation serializes");
        let id = format!("{}/{}", c.message_id, c.consumer);
        let properties = BasicProperties::default()
            .with_delivery_mode(2)
            .with_content_type("application/json".into())
            .with_app_id("outbox".into())
            .with_timestamp(now_secs())
            .with_message_id(lapin::types::ShortString::try_new(id).unwrap_or_default());
        let p = Publication {
            destination: reply_to,
            payload: &body,
            properties,
        };
        self.transport
            .link()
            .publish(std::slice::from_ref(&p))
            .await
            .pop()
            .unwrap_or_else(|| Err(TransportError::retryable("no result")))
    }
}

/// Consume `queue` (declared durable if missing) and apply the confirmations to `store` in
/// batches of up to 500, acknowledging a batch after it committed, until `cancel`: the generic
/// runner over a [`RabbitMqSource`] with a [`ConfirmationHandler`](super::ConfirmationHandler).
/// A batch the database refuses (after retries) goes through the queue's 1 s retry queue and
/// comes back; a message that is not a confirmation is logged and rejected (dropped). The
/// listener reconnects with backoff when the connection is lost. Returns the totals.
///
/// # Errors
/// [`ConfigError`] naming the field when `config` is invalid, the first connection fails (`url`)
/// or the queue cannot be declared (`queue`).
pub async fn listen(
    config: RabbitMqConfig,
    queue: String,
    store: Arc<dyn Store>,
    cancel: CancellationToken,
) -> Result<ConfirmReport, ConfigError> {
    let mut c = RabbitMqConsumerConfig::new(config, queue);
    c.declare = Some(QueueSetup::default());
    c.batch = BATCH;
    c.batch_wait = Duration::from_millis(5);
    // The listener's fields are the connection's own (`url`, not `connection.url`).
    let unnest = |e: ConfigError| {
        let field = e.field.strip_prefix("connection.").unwrap_or(&e.field);
        ConfigError::new(field.to_owned(), e.reason)
    };
    let source = RabbitMqSource::new(c).map_err(unnest)?;
    super::listen(source, store, &RunOptions::default(), &cancel)
        .await
        .map_err(unnest)
}
