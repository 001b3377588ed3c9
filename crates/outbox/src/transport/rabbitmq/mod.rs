//! RabbitMQ transport (AMQP 0-9-1 through `lapin`): publish with publisher confirms, `Ok` only
//! after the broker's `basic.ack` for a message that was routed.
//!
//! # Destinations
//! A route destination is `exchange/routing-key` (split at the first `/`, so the routing key may
//! contain `/`; exchange names with a `/` are not supported), or a bare queue name, which is
//! published through the default exchange (`""`) with the queue name as routing key (also written
//! `/queue`). Both parts are AMQP short strings: at most 255 bytes. Example: `orders/{topic}` sends
//! topic `order-created` to exchange `orders` with routing key `order-created`.
//!
//! # What is sent
//! Every message is published on a channel in confirm mode (RabbitMQ publisher confirms,
//! <https://www.rabbitmq.com/docs/confirms#publisher-confirms>), with:
//! - `delivery_mode` 2 (persistent) and the `mandatory` flag, so a message no queue is bound for
//!   comes back as `basic.return` (`312 NO_ROUTE`) instead of being dropped silently;
//! - `message_id` = the outbox message id, suffixed `-r<n>` on the n-th intentional redelivery
//!   (check-back or requeue), as `Nats-Msg-Id` on NATS;
//! - the AMQP `headers` table = [`Message::wire_headers`] (`outbox-message-id`, `outbox-topic`,
//!   `outbox-attempt`, `outbox-partition-key`, user headers such as `traceparent`), each value a
//!   long string;
//! - `content_type` from the message's `content-type` header when it has one, `type` = the topic,
//!   `timestamp` = the publish time (seconds since the Unix epoch), `app_id` = `outbox`.
//!
//! # What AMQP can carry
//! [`RabbitMqTransport::check`](Transport::check) refuses, as permanent, before anything is sent:
//! a header name over 255 bytes (table keys are AMQP short strings), a `content-type` header over
//! 255 bytes (it also sets the `content_type` property, a short string), a user header RabbitMQ
//! interprets (`CC`, `BCC`: extra routing keys, RabbitMQ closes the channel when they are not
//! arrays; `x-death`, `x-first-death-*`, `x-last-death-*`, `x-delivery-count`, `x-delay`,
//! `x-match`, `x-received-from`, `x-shovelled*`, `x-stream-offset`, `x-stream-filter-value`,
//! `x-mqtt-publish-qos`, `x-amqp-1.0-*`; case-sensitive, as RabbitMQ compares them; other `x-`
//! names stay free), and an invalid destination. Header values are long strings: any bytes.
//! The AMQP properties the transport sets (`message_id`, `type`, `timestamp`, `app_id`,
//! `delivery_mode`, `content_type`) are not headers, so no user header can replace them.
//!
//! The batch is pipelined: every message is written, then the confirms are awaited (for at most
//! [`RabbitMqConfig::confirm_timeout`]). RabbitMQ has no broker-side deduplication: a re-publish
//! after a lost confirm is a second copy with the same `message_id`, which the consumer's inbox
//! absorbs.
//!
//! # A missing exchange does not poison the batch
//! Publishing to a missing exchange makes RabbitMQ close the channel (`404 NOT_FOUND`), which
//! fails every confirm still pending on it. So the exchanges of a batch are checked first with a
//! passive `exchange.declare` on a channel of their own (a positive answer is cached for
//! [`RabbitMqConfig::exchange_check_ttl`]); the messages for a missing exchange fail with the
//! broker's reply text (a missing destination: the transport pauses until it exists, up to the
//! relay's `missing_destination_grace`), the others are published. If a channel is nevertheless closed
//! by the broker during a batch (an exchange deleted after the check, a message over the server's
//! `max_message_size`), the messages it took down are published again one at a time on fresh
//! channels so each gets its own result (the ones the broker had already routed may then be in
//! the queue twice, with the same `message_id`).
//!
//! # Classification
//! - connection refused, lost or closed by the broker, no answer to the connection handshake,
//!   refused credentials or TLS certificate → `Unavailable` (the relay pauses and probes;
//!   [`RabbitMqTransport::probe`] reconnects);
//! - access refused (`403 ACCESS_REFUSED`: the user has no write permission on the exchange) →
//!   `Unavailable`: a configuration fault, not the message's; the transport pauses (the probe,
//!   which needs no permission, succeeds, and the relay keeps backing off while publishes are
//!   refused) and publishes once the permission is granted, without counting attempts;
//! - missing exchange (`404 NOT_FOUND`) → `Unavailable`, marked as a missing destination: the
//!   transport pauses until the exchange exists again (deleted and re-created under load loses
//!   nothing), and the relay dead-letters its messages only after `missing_destination_grace`
//!   (default 5 min);
//! - `basic.nack` → a busy destination ([`TransportError::destination_busy`]): RabbitMQ nacks
//!   when a queue cannot take messages now (a quorum queue without a leader, for over a minute
//!   after its leader's node died under a large backlog; a full queue with
//!   `x-overflow = reject-publish`; an internal error), never for the message itself, so the
//!   relay backs that destination off without counting attempts and never dead-letters for it;
//! - no confirm within `confirm_timeout`, a channel closed for another reason → `Retryable`; a
//!   timeout while the
//!   broker blocks the connection (`connection.blocked`: memory or disk alarm) → `Unavailable`,
//!   so an alarm pauses the relay instead of burning attempts;
//! - precondition failed (`406`, e.g. over the server's `max_message_size`), a payload over [`RabbitMqConfig::max_message_bytes`], headers
//!   that do not fit in one frame (`frame_max`), an invalid destination → `Permanent`;
//! - returned as unroutable (`312 NO_ROUTE`, the exchange exists but no queue is bound for the
//!   routing key) → [`Unroutable`]: `Retryable` by default (a consumer that has not declared its
//!   queue yet is a deployment-order problem that passes; after `max_attempts` the message is
//!   FAILED with the reason), or `Permanent`.
//!
//! Every error text carries the broker's reply code and text, so it is recorded as the row's
//! `last_error`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions};
use lapin::protocol::{AMQPErrorKind, AMQPSoftError};
use lapin::tcp::OwnedTLSConfig;
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::uri::AMQPUri;
use lapin::{BasicProperties, Channel, Confirmation, Connection, ConnectionProperties, ErrorKind};

use super::wire::{self, Broker, Field, HeaderRules, WireError};
use super::{Acks, Outgoing, Transport};
use crate::error::{ConfigError, TransportError, TransportErrorKind};
use crate::message::{Headers, Message};

mod config;
pub use config::*;
mod properties;
pub use properties::*;
mod link;
pub(crate) use link::*;

/// The header rules of AMQP 0-9-1 tables as lapin encodes them: a key is a short string (at most
/// 255 bytes), a value a long string (any bytes).
const AMQP_HEADERS: HeaderRules = HeaderRules {
    broker: Broker::RabbitMq,
    name: |n| {
        if n.len() > 255 {
            Err("an AMQP header name is a short string of at most 255 bytes")
        } else {
            Ok(())
        }
    },
    value: |_| Ok(()),
};

/// What RabbitMQ cannot carry (see the module docs): a pure function of the message.
///
/// # Errors
/// A permanent error whose source is a [`WireError`] naming the destination or header.
pub(crate) fn check_message(out: &Outgoing<'_>) -> Result<(), TransportError> {
    if let Err(reason) = Destination::parse(out.destination) {
        return Err(TransportError::permanent(reason));
    }
    wire::check_headers(out.message, &AMQP_HEADERS)?;
    if let Some(ct) = out.message.headers.get("content-type")
        && ct.len() > 255
    {
        return Err(WireError::unsupported(
            Broker::RabbitMq,
            Field::Header("content-type".into()),
            "the content-type header sets the AMQP content_type property, a short string of at most 255 bytes",
        )
        .into());
    }
    Ok(())
}

/// Whether the error means the connection is gone (as opposed to one channel).
pub(crate) fn connection_lost(e: &lapin::Error) -> bool {
    match e.kind() {
        ErrorKind::IOError(_)
        | ErrorKind::InvalidConnectionState(_)
        | ErrorKind::MissingHeartbeatError
        | ErrorKind::RuntimeShutdownError(_) => true,
        ErrorKind::ProtocolError(p) => matches!(p.kind(), AMQPErrorKind::Hard(_)),
        _ => false,
    }
}

/// The broker's soft error, when the channel was closed by the broker.
fn soft_error(e: &lapin::Error) -> Option<(AMQPSoftError, String)> {
    match e.kind() {
        ErrorKind::ProtocolError(p) => match p.kind() {
            AMQPErrorKind::Soft(s) => Some((s.clone(), p.get_message().to_string())),
            AMQPErrorKind::Hard(_) => None,
        },
        _ => None,
    }
}

/// Classify a lapin error raised for one message (see the module docs): `403 ACCESS_REFUSED`
/// (the user may not write to the exchange) and `404 NOT_FOUND` (the exchange does not exist)
/// concern the transport's configuration, not the message: `Unavailable`.
fn classify(e: &lapin::Error, connected: bool) -> TransportErrorKind {
    if connection_lost(e) || !connected {
        return TransportErrorKind::Unavailable;
    }
    match soft_error(e) {
        Some((AMQPSoftError::NOTFOUND | AMQPSoftError::ACCESSREFUSED, _)) => {
            TransportErrorKind::Unavailable
        }
        Some((AMQPSoftError::PRECONDITIONFAILED | AMQPSoftError::CONTENTTOOLARGE, _)) => {
            TransportErrorKind::Permanent
        }
        _ if matches!(e.kind(), ErrorKind::SerialisationError(_)) => TransportErrorKind::Permanent,
        _ => TransportErrorKind::Retryable,
    }
}

/// The error for `e` with `reason`: classified by [`classify`], and marked
/// [`missing_destination`](TransportError::missing_destination) for a `404 NOT_FOUND` (a missing
/// exchange) on a live connection.
fn error_for(e: &lapin::Error, connected: bool, reason: String) -> TransportError {
    let missing = connected
        && !connection_lost(e)
        && matches!(soft_error(e), Some((AMQPSoftError::NOTFOUND, _)));
    if missing {
        TransportError::missing_destination(reason)
    } else {
        TransportError::new(classify(e, connected), reason)
    }
}

/// Publishes to RabbitMQ with publisher confirms (see the module docs).
#[derive(Clone)]
pub struct RabbitMqTransport {
    link: Arc<Link>,
}

impl std::fmt::Debug for RabbitMqTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RabbitMqTransport")
            .field("url", &self.link.describe())
            .finish()
    }
}

impl RabbitMqTransport {
    /// Validate `config` and connect, so a wrong address or credentials are reported now.
    ///
    /// # Errors
    /// [`ConfigError`] naming the invalid field, or `url` when the broker cannot be reached or
    /// refuses the credentials.
    pub async fn connect(config: RabbitMqConfig) -> Result<Self, ConfigError> {
        let t = Self::lazy(config)?;
        t.link
            .probe()
            .await
            .map_err(|e| ConfigError::new("url", e.report()))?;
        Ok(t)
    }

    /// Validate `config` without connecting; the first publish or probe connects.
    ///
    /// # Errors
    /// [`ConfigError`] naming the invalid field.
    pub fn lazy(config: RabbitMqConfig) -> Result<Self, ConfigError> {
        Ok(RabbitMqTransport {
            link: Arc::new(Link::new(config)?),
        })
    }

    /// The settings.
    pub fn config(&self) -> &RabbitMqConfig {
        self.link.config()
    }

    /// The shared connection, for a confirmation sender on the same connection.
    pub(crate) fn link(&self) -> Arc<Link> {
        self.link.clone()
    }
}

#[async_trait]
impl Transport for RabbitMqTransport {
    fn name(&self) -> &str {
        "rabbitmq"
    }

    fn check(&self, out: &Outgoing<'_>) -> Result<(), TransportError> {
        check_message(out)
    }

    async fn publish_each(&self, batch: &[Outgoing<'_>], acks: &Acks) {
        let mut props: Vec<Result<BasicProperties, String>> = batch
            .iter()
            .map(|o| {
                self.check(o).map_err(|e| e.report())?;
                message_properties(o.message)
            })
            .collect();
        let mut pubs = Vec::with_capacity(batch.len());
        let mut index = Vec::with_capacity(batch.len());
        for (i, o) in batch.iter().enumerate() {
            if let Ok(p) = &mut props[i] {
                pubs.push(Publication {
                    destination: o.destination,
                    payload: &o.message.payload,
                    properties: std::mem::take(p),
                });
                index.push(i);
            }
        }
        // Confirms are recorded as they arrive; the other results when the batch is done.
        let on_ack = |p: usize| acks.record(index[p], Ok(()));
        let mut published = self.link.publish_observed(&pubs, &on_ack).await.into_iter();
        for p in props {
            acks.push(match p {
                Err(reason) => Err(TransportError::permanent(reason)),
                Ok(_) => published.next().unwrap_or_else(|| {
                    Err(TransportError::retryable(
                        "RabbitMQ publish produced no result",
                    ))
                }),
            });
        }
    }

    async fn probe(&self) -> Result<(), TransportError> {
        self.link.probe().await
    }
}

#[cfg(test)]
mod tests;
