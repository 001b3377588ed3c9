//! The transport seam: publish a batch to a broker, `Ok` only after the broker acknowledged
//! (DESIGN.md §1.4: publisher confirm, JetStream PubAck, webhook 2xx; never "handed to the
//! socket").
//!
//! Transports: [`MemoryTransport`] (tests, demos), [`WebhookTransport`](crate::WebhookTransport)
//! (feature `webhook`), [`NatsTransport`](crate::NatsTransport) (feature `nats`), `RedisTransport`
//! (feature `redis`, module `redis`), `MqttTransport` (feature `mqtt`, module `mqtt`). A [`Router`]
//! maps topics to transports and destinations.

use std::sync::Arc;

use async_trait::async_trait;

use crate::error::TransportError;
use crate::message::Message;

#[cfg(feature = "kafka")]
pub mod kafka;
pub mod lazy;
pub mod memory;
#[cfg(feature = "mqtt")]
pub mod mqtt;
#[cfg(feature = "nats")]
pub mod nats;
#[cfg(feature = "rabbitmq")]
pub mod rabbitmq;
#[cfg(feature = "redis")]
pub mod redis;
#[cfg(feature = "rocketmq")]
pub mod rocketmq;
#[cfg(feature = "webhook")]
pub mod webhook;

pub use memory::MemoryTransport;

/// One message to publish and where to: the destination is the route's (a NATS subject, a
/// webhook URL), already resolved from the topic.
#[derive(Debug, Clone, Copy)]
pub struct Outgoing<'a> {
    /// The claimed message.
    pub message: &'a Message,
    /// Broker destination.
    pub destination: &'a str,
}

/// A broker client that publishes with acknowledgement.
///
/// # Contract
/// - [`Transport::publish`] returns one result per input, in input order. `Ok` means the broker
///   acknowledged that message durably. Implementations pipeline: send the whole batch, then await
///   the acknowledgements.
/// - Errors are classified where they are born ([`TransportErrorKind`](crate::TransportErrorKind)):
///   `Unavailable` when the broker cannot be reached, `Permanent` when the message can never be
///   accepted as it is, `Retryable` otherwise.
/// - The message id travels in the broker's native id field where there is one, so a re-publish
///   after a crash is recognisable as a duplicate downstream.
#[async_trait]
pub trait Transport: Send + Sync + 'static {
    /// A short name for logs and metrics (`"nats"`, `"webhook"`, `"memory"`).
    fn name(&self) -> &str;

    /// Publish the batch, pipelined; one result per message, in order.
    async fn publish(&self, batch: &[Outgoing<'_>]) -> Vec<Result<(), TransportError>>;

    /// Check that the broker is reachable, cheaply. Called while the transport is considered down.
    ///
    /// # Errors
    /// An [`Unavailable`](crate::TransportErrorKind::Unavailable) error while it is not.
    async fn probe(&self) -> Result<(), TransportError>;
}

/// Which topics a route matches: `*` every topic, `prefix.*` (any topic starting with `prefix.`),
/// or one exact topic.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TopicPattern {
    /// Every topic.
    Any,
    /// Topics starting with this prefix (the pattern without its trailing `*`).
    Prefix(String),
    /// Exactly this topic.
    Exact(String),
}

impl TopicPattern {
    /// Parse `*`, `prefix*` or an exact topic.
    pub fn parse(s: &str) -> TopicPattern {
        if s == "*" {
            TopicPattern::Any
        } else if let Some(p) = s.strip_suffix('*') {
            TopicPattern::Prefix(p.to_owned())
        } else {
            TopicPattern::Exact(s.to_owned())
        }
    }

    /// Whether `topic` matches.
    pub fn matches(&self, topic: &str) -> bool {
        match self {
            TopicPattern::Any => true,
            TopicPattern::Prefix(p) => topic.starts_with(p.as_str()),
            TopicPattern::Exact(t) => topic == t,
        }
    }
}

/// A route: topics matching `pattern` go to `transport` at `destination`, where `{topic}` in the
/// destination is replaced by the message's topic.
#[derive(Clone)]
pub struct Route {
    /// Which topics.
    pub pattern: TopicPattern,
    /// Where they go.
    pub transport: Arc<dyn Transport>,
    /// Destination template; `{topic}` is replaced by the topic. For NATS a subject, for webhooks
    /// a URL (or empty for the transport's own URL).
    pub destination: String,
    /// Whether the consumer must confirm messages of this route, where to and by when. Default:
    /// none (SENT is final).
    pub confirm: Option<crate::confirm::ConfirmPolicy>,
    /// Per-partition-key FIFO: `Some(policy)` publishes the messages of one partition key one
    /// after another in id (commit) order, and a message never overtakes an earlier one of its
    /// key that is still pending or backing off; `policy` says what a dead-lettered message does
    /// to the rest of its key. Messages without a partition key are unordered. Default `None`:
    /// messages are published as soon as they are due, in any order (see docs/ordering.md).
    pub ordered: Option<DeadLetterPolicy>,
}

/// What a dead-lettered (FAILED) message does to the later messages of its partition key on an
/// ordered route ([`Route::ordered`]). Follows DESIGN.md §6 (poison isolation): either way only
/// that key is affected.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeadLetterPolicy {
    /// The next message of the key is published once the head is dead-lettered (a warning is
    /// logged). Default: one poison message does not stop its key for good.
    #[default]
    Skip,
    /// The key stays blocked while a dead letter is ahead of it, until an operator requeues
    /// (`outbox requeue`) or deletes it. For consumers that must never see a gap.
    Block,
}

impl std::fmt::Debug for Route {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Route")
            .field("pattern", &self.pattern)
            .field("transport", &self.transport.name())
            .field("destination", &self.destination)
            .field("confirm", &self.confirm)
            .field("ordered", &self.ordered)
            .finish()
    }
}

/// Ordered list of routes; the first match wins. A topic with no route is a permanent error
/// for that message (it goes to FAILED with reason `no route for topic …`).
#[derive(Debug, Clone, Default)]
pub struct Router {
    routes: Vec<Route>,
}

impl Router {
    /// An empty router.
    pub fn new() -> Self {
        Router::default()
    }

    /// A router sending every topic to `transport`, destination = the topic.
    pub fn single(transport: Arc<dyn Transport>) -> Self {
        Router::new().route("*", transport, "{topic}")
    }

    /// Add a route (see [`TopicPattern::parse`] and [`Route::destination`]).
    pub fn route(
        mut self,
        pattern: &str,
        transport: Arc<dyn Transport>,
        destination: impl Into<String>,
    ) -> Self {
        self.routes.push(Route {
            pattern: TopicPattern::parse(pattern),
            transport,
            destination: destination.into(),
            confirm: None,
            ordered: None,
        });
        self
    }

    /// Make the most recently added route ordered per partition key, with `policy` for dead
    /// letters (see [`Route::ordered`]). Does nothing on an empty router.
    ///
    /// ```
    /// # use std::sync::Arc;
    /// use outbox::{DeadLetterPolicy, MemoryTransport, Router};
    /// let t = Arc::new(MemoryTransport::new());
    /// let router = Router::new()
    ///     .route("orders.*", t.clone(), "{topic}")
    ///     .ordered(DeadLetterPolicy::Skip)
    ///     .route("*", t, "{topic}");
    /// assert!(router.routes()[0].ordered.is_some() && router.routes()[1].ordered.is_none());
    /// ```
    pub fn ordered(mut self, policy: DeadLetterPolicy) -> Self {
        if let Some(r) = self.routes.last_mut() {
            r.ordered = Some(policy);
        }
        self
    }

    /// Add a route whose messages the consumer must confirm (see [`crate::confirm`]): the relay
    /// puts `policy.reply_to` in the `outbox-reply-to` header and, once the broker acknowledged,
    /// records a confirmation deadline of `policy.timeout`.
    pub fn route_confirmed(
        mut self,
        pattern: &str,
        transport: Arc<dyn Transport>,
        destination: impl Into<String>,
        policy: crate::confirm::ConfirmPolicy,
    ) -> Self {
        self = self.route(pattern, transport, destination);
        self.routes.last_mut().expect("just pushed").confirm = Some(policy);
        self
    }

    /// The routes, in match order.
    pub fn routes(&self) -> &[Route] {
        &self.routes
    }

    /// The index of the first route matching `topic` and its resolved destination.
    pub fn resolve(&self, topic: &str) -> Option<(usize, String)> {
        self.routes
            .iter()
            .position(|r| r.pattern.matches(topic))
            .map(|i| (i, self.routes[i].destination.replace("{topic}", topic)))
    }

    /// The distinct transports, by route index of their first use.
    pub fn transports(&self) -> Vec<Arc<dyn Transport>> {
        let mut out: Vec<Arc<dyn Transport>> = Vec::new();
        for r in &self.routes {
            if !out.iter().any(|t| Arc::ptr_eq(t, &r.transport)) {
                out.push(r.transport.clone());
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_and_first_match() {
        let t: Arc<dyn Transport> = Arc::new(MemoryTransport::new());
        let r = Router::new()
            .route("orders.created", t.clone(), "exact")
            .route("orders.*", t.clone(), "o.{topic}")
            .route("*", t, "all");
        assert_eq!(r.resolve("orders.created"), Some((0, "exact".into())));
        assert_eq!(r.resolve("orders.paid"), Some((1, "o.orders.paid".into())));
        assert_eq!(r.resolve("x"), Some((2, "all".into())));
        assert_eq!(Router::new().resolve("x"), None);
        assert_eq!(r.transports().len(), 1);
    }
}
