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
use futures::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicQosOptions, QueueDeclareOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel};
use tokio_util::sync::CancellationToken;

use super::{
    ConfirmReport, Confirmation, ConfirmationSender, apply_with_retry, parse_confirmations,
};
use crate::Store;
use crate::error::{ConfigError, TransportError};
use crate::transport::rabbitmq::{Link, Publication, RabbitMqConfig, RabbitMqTransport, now_secs};

/// Largest batch of confirmations applied in one producer transaction.
const BATCH: usize = 500;

/// Publishes confirmations to RabbitMQ with publisher confirms.
#[derive(Clone)]
pub struct RabbitMqConfirmationSender {
    link: Arc<Link>,
}

impl std::fmt::Debug for RabbitMqConfirmationSender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RabbitMqConfirmationSender")
            .field("url", &self.link.describe())
            .finish()
    }
}

impl RabbitMqConfirmationSender {
    /// A sender with its own connection, opened on the first confirmation.
    ///
    /// # Errors
    /// [`ConfigError`] naming the invalid field of `config`.
    pub fn new(config: RabbitMqConfig) -> Result<Self, ConfigError> {
        Ok(RabbitMqConfirmationSender {
            link: Arc::new(Link::new(config)?),
        })
    }

    /// A sender sharing the connection of `transport`.
    pub fn from_transport(transport: &RabbitMqTransport) -> Self {
        RabbitMqConfirmationSender {
            link: transport.link(),
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
        self.link
            .publish(std::slice::from_ref(&p))
            .await
            .pop()
            .unwrap_or_else(|| Err(TransportError::retryable("no result")))
    }
}

/// Consume `queue` (declared durable if missing) and apply the confirmations to `store` in
/// batches of up to 500, acknowledging a batch after it committed, until `cancel`. A batch the
/// database refuses (after retries) is rejected with `requeue` after a 1 s pause and comes back; a
/// message that is not a confirmation is logged and acknowledged (dropped). The listener
/// reconnects with backoff when the connection is lost. Returns the totals.
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
    if queue.is_empty() || queue.len() > 255 {
        return Err(ConfigError::new("queue", "must be 1 to 255 bytes"));
    }
    let link = Link::new(config)?;
    let mut total = ConfirmReport::default();
    let mut started = false;
    let mut failures = 0u32;
    let backoff = crate::Backoff {
        base: Duration::from_millis(200),
        max: Duration::from_secs(10),
        ..Default::default()
    };
    loop {
        let session = tokio::select! {
            _ = cancel.cancelled() => return Ok(total),
            s = open(&link, &queue) => s,
        };
        match session {
            Ok(ch) => {
                started = true;
                failures = 0;
                match consume(&ch, &queue, &store, &cancel, &mut total).await {
                    Ok(()) => return Ok(total),
                    Err(reason) => tracing::warn!(
                        reason,
                        queue,
                        "confirmation listener lost its connection; reconnecting"
                    ),
                }
            }
            Err(e) if !started => return Err(e),
            Err(e) => tracing::warn!(error = %e, queue, "confirmation listener cannot reconnect"),
        }
        failures = failures.saturating_add(1);
        tokio::select! {
            _ = cancel.cancelled() => return Ok(total),
            _ = tokio::time::sleep(backoff.delay(failures.min(8))) => {}
        }
    }
}

/// Connect, declare the queue and set the prefetch.
async fn open(link: &Link, queue: &str) -> Result<Channel, ConfigError> {
    let s = link
        .session()
        .await
        .map_err(|e| ConfigError::new("url", e.report()))?;
    let ch = s
        .conn
        .create_channel()
        .await
        .map_err(|e| ConfigError::new("url", format!("cannot open a channel: {e}")))?;
    ch.queue_declare(
        queue.into(),
        QueueDeclareOptions::durable(),
        FieldTable::default(),
    )
    .await
    .map_err(|e| ConfigError::new("queue", format!("cannot declare queue {queue:?}: {e}")))?;
    ch.basic_qos(2 * BATCH as u16, BasicQosOptions::default())
        .await
        .map_err(|e| ConfigError::new("url", format!("basic.qos failed: {e}")))?;
    Ok(ch)
}

/// Consume until `cancel` (`Ok`) or the channel is lost (`Err` with the reason).
async fn consume(
    ch: &Channel,
    queue: &str,
    store: &Arc<dyn Store>,
    cancel: &CancellationToken,
    total: &mut ConfirmReport,
) -> Result<(), String> {
    let mut consumer = ch
        .basic_consume(
            queue.into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .map_err(|e| format!("cannot consume {queue:?}: {e}"))?;
    loop {
        let first = tokio::select! {
            _ = cancel.cancelled() => return Ok(()),
            n = consumer.next() => n,
        };
        let first = match first {
            Some(Ok(d)) => d,
            Some(Err(e)) => return Err(e.to_string()),
            None => return Err("the broker cancelled the consumer".into()),
        };
        let mut deliveries = vec![first];
        // Take whatever else arrives within 5 ms of the first, up to the batch size.
        let deadline = tokio::time::Instant::now() + Duration::from_millis(5);
        while deliveries.len() < BATCH {
            match tokio::time::timeout_at(deadline, consumer.next()).await {
                Ok(Some(Ok(d))) => deliveries.push(d),
                _ => break,
            }
        }
        let mut batch = Vec::with_capacity(deliveries.len());
        for d in &deliveries {
            match parse_confirmations(&d.data) {
                Ok(cs) => batch.extend(cs),
                Err(e) => tracing::warn!(error = %e, "malformed confirmation dropped"),
            }
        }
        let last = deliveries.last().expect("at least one delivery");
        let applied = if batch.is_empty() {
            Ok(ConfirmReport::default())
        } else {
            apply_with_retry(store, &batch, 5).await
        };
        match applied {
            Ok(r) => {
                if r.unknown > 0 {
                    tracing::warn!(unknown = r.unknown, "confirmations for unknown message ids");
                }
                total.add(r);
                let all = BasicAckOptions { multiple: true };
                if let Err(e) = last.acker.ack(all).await {
                    tracing::warn!(error = %e, "ack of applied confirmations failed; they will be applied again (harmless duplicates)");
                }
            }
            Err(e) => {
                tracing::error!(error = %e, n = batch.len(), "confirmations not applied; requeueing them");
                tokio::time::sleep(Duration::from_secs(1)).await;
                let _ = last
                    .acker
                    .nack(BasicNackOptions {
                        multiple: true,
                        requeue: true,
                    })
                    .await;
            }
        }
    }
}
