//! The transport seam: publish a batch to a broker, `Ok` only after the broker acknowledged
//! (docs/design/DESIGN.md §1.4: publisher confirm, JetStream PubAck, webhook 2xx; never "handed to the
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

pub mod config;
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
mod settings;
#[cfg(feature = "webhook")]
pub mod webhook;
pub mod wire;

pub use config::{RouteConfig, TransportConfig};
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

/// The per-batch results slot of [`Transport::publish_each`]: one slot per message of the batch,
/// filled by the transport as each message's result becomes known.
///
/// The relay owns it and keeps what was recorded when the batch's `publish_timeout` runs out, so a
/// message the broker acknowledged is recorded SENT even if another message of its batch hangs;
/// only the messages without a result get the timeout error.
///
/// A slot may be written more than once (the last result counts); an index outside the batch is
/// ignored. A transport that hands messages to the broker one by one calls [`Acks::sending`] for
/// each as it goes out: at a timeout, the messages it never marked (while it marked others) were
/// never sent and are released without counting an attempt.
#[derive(Debug)]
pub struct Acks {
    slots: std::sync::Mutex<AckSlots>,
}

#[derive(Debug)]
struct AckSlots {
    results: Vec<AckSlot>,
    /// Next index [`Acks::push`] records.
    cursor: usize,
    /// Whether [`Acks::sending`] was called for any message.
    tracks_sending: bool,
}

#[derive(Debug)]
enum AckSlot {
    Untouched,
    Sending,
    Done(Result<(), TransportError>),
}

/// What [`Acks::take`] says of one message.
#[derive(Debug)]
pub enum AckState {
    /// The transport recorded this result.
    Done(Result<(), TransportError>),
    /// Handed to the broker (or not known otherwise) and no result yet: in doubt.
    InDoubt,
    /// Never handed to the broker (the transport marked others with [`Acks::sending`], not this
    /// one).
    NotSent,
}

impl Acks {
    /// A slot for a batch of `len` messages, every result missing.
    pub fn new(len: usize) -> Self {
        Acks {
            slots: std::sync::Mutex::new(AckSlots {
                results: (0..len).map(|_| AckSlot::Untouched).collect(),
                cursor: 0,
                tracks_sending: false,
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, AckSlots> {
        // A panic while the lock was held cannot leave a slot half-written: keep going.
        self.slots
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The number of messages in the batch.
    pub fn len(&self) -> usize {
        self.lock().results.len()
    }

    /// Whether the batch is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Record the result of message `index` (its position in the batch).
    pub fn record(&self, index: usize, result: Result<(), TransportError>) {
        let mut s = self.lock();
        if let Some(slot) = s.results.get_mut(index) {
            *slot = AckSlot::Done(result);
        }
    }

    /// Record the result of the next message in batch order (the first `push` records message
    /// 0, the next message 1, …), for transports that learn results in batch order. Its cursor
    /// counts pushes only: a [`Acks::record`] in between does not move it (and is overwritten
    /// when the cursor reaches that message).
    pub fn push(&self, result: Result<(), TransportError>) {
        let mut s = self.lock();
        let i = s.cursor;
        s.cursor += 1;
        if let Some(slot) = s.results.get_mut(i) {
            *slot = AckSlot::Done(result);
        }
    }

    /// Record the results of the whole batch, in order (the adapter for transports that learn
    /// every result at once).
    pub fn record_all(&self, results: Vec<Result<(), TransportError>>) {
        let mut s = self.lock();
        for (slot, r) in s.results.iter_mut().zip(results) {
            *slot = AckSlot::Done(r);
        }
    }

    /// Mark message `index` as handed to the broker, its result still unknown (see the type's
    /// docs). Does nothing once its result is recorded.
    pub fn sending(&self, index: usize) {
        let mut s = self.lock();
        s.tracks_sending = true;
        if let Some(slot @ AckSlot::Untouched) = s.results.get_mut(index) {
            *slot = AckSlot::Sending;
        }
    }

    /// How many results were recorded so far.
    pub fn recorded(&self) -> usize {
        self.lock()
            .results
            .iter()
            .filter(|s| matches!(s, AckSlot::Done(_)))
            .count()
    }

    /// Take every message's state, in batch order, leaving the slots empty.
    pub fn take(&self) -> Vec<AckState> {
        let mut s = self.lock();
        let tracks = s.tracks_sending;
        s.results
            .iter_mut()
            .map(|slot| match std::mem::replace(slot, AckSlot::Untouched) {
                AckSlot::Done(r) => AckState::Done(r),
                AckSlot::Sending => AckState::InDoubt,
                AckSlot::Untouched if tracks => AckState::NotSent,
                AckSlot::Untouched => AckState::InDoubt,
            })
            .collect()
    }

    /// One result per message, in batch order; a message without a recorded result gets a
    /// retryable error saying so.
    pub fn into_results(self) -> Vec<Result<(), TransportError>> {
        self.take()
            .into_iter()
            .map(|s| match s {
                AckState::Done(r) => r,
                AckState::InDoubt | AckState::NotSent => Err(TransportError::retryable(
                    "the transport returned no result for this message",
                )),
            })
            .collect()
    }
}

/// A broker client that publishes with acknowledgement.
///
/// # Contract
/// - [`Transport::publish_each`] records one result per message in its [`Acks`] as soon as it
///   is known (the relay calls it, under its `publish_timeout`, and keeps what was recorded when
///   the time runs out); [`Transport::publish`] returns one result per input, in input order.
///   `Ok` means the broker acknowledged that message durably. Implementations pipeline: send the
///   whole batch, then await the acknowledgements.
/// - A panic inside a publish is contained by the relay: the messages of the batch are published
///   again one at a time, and the one that panics alone is dead-lettered with the panic message.
/// - Errors are classified where they are born ([`TransportErrorKind`](crate::TransportErrorKind)):
///   `Unavailable` when the broker cannot be reached, `Permanent` when the message can never be
///   accepted as it is, `Retryable` otherwise.
/// - The message id travels in the broker's native id field where there is one, so a re-publish
///   after a crash is recognisable as a duplicate downstream.
/// - [`Transport::check`] refuses, before anything is sent, what the broker cannot carry; the
///   relay calls it for every message and dead-letters the refused ones, and `publish` calls it
///   again for each message so that nothing reaching the client can make it panic or write a
///   malformed frame.
#[async_trait]
pub trait Transport: Send + Sync + 'static {
    /// A short name for logs and metrics (`"nats"`, `"webhook"`, `"memory"`).
    fn name(&self) -> &str;

    /// Check that the broker can carry `out` as it is: the destination, header names and values,
    /// the partition key, reserved header names ([`wire::RESERVED`]), sizes the transport knows.
    /// A pure function of the message and the transport's settings: no I/O. Default: `Ok`.
    ///
    /// # Errors
    /// A [`Permanent`](crate::TransportErrorKind::Permanent) error whose source is a
    /// [`wire::WireError`] naming the header, key or destination and the rule it breaks. The
    /// relay dead-letters the message with it (FAILED, reason in `last_error`) and publishes the
    /// rest of the batch.
    fn check(&self, out: &Outgoing<'_>) -> Result<(), TransportError> {
        let _ = out;
        Ok(())
    }

    /// Publish the batch, pipelined; one result per message, in order.
    ///
    /// Implement this or [`Transport::publish_each`]; each one's default is written over the
    /// other (like `PartialEq`'s `eq` and `ne`), so a transport that implements neither never
    /// returns. Default: [`Transport::publish_each`] into fresh [`Acks`], then their results.
    async fn publish(&self, batch: &[Outgoing<'_>]) -> Vec<Result<(), TransportError>> {
        let acks = Acks::new(batch.len());
        self.publish_each(batch, &acks).await;
        acks.into_results()
    }

    /// Publish the batch, pipelined, recording each message's result in `acks` (index = position
    /// in `batch`) as soon as it is known: what the relay calls. The future may be dropped at any
    /// point (the relay's `publish_timeout`); what was recorded by then counts.
    ///
    /// Default: [`Transport::publish`], then every result at once. A transport that learns
    /// results one by one (every broker transport here) implements this instead of `publish`.
    async fn publish_each(&self, batch: &[Outgoing<'_>], acks: &Acks) {
        acks.record_all(self.publish(batch).await);
    }

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

impl std::fmt::Display for TopicPattern {
    /// The pattern as [`TopicPattern::parse`] reads it: `*`, `prefix*` or the exact topic.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TopicPattern::Any => f.write_str("*"),
            TopicPattern::Prefix(p) => write!(f, "{p}*"),
            TopicPattern::Exact(t) => f.write_str(t),
        }
    }
}

/// A route: topics matching `pattern` go to `transport` at `destination`, where `{topic}` in the
/// destination is replaced by the message's topic.
#[derive(Clone, derive_more::Debug)]
pub struct Route {
    /// Which topics.
    pub pattern: TopicPattern,
    /// Where they go.
    #[debug("{:?}", transport.name())]
    pub transport: Arc<dyn Transport>,
    /// Destination template; `{topic}` is replaced by the topic. For NATS a subject, for webhooks
    /// a URL (or empty for the transport's own URL).
    pub destination: String,
    /// Whether the consumer must confirm messages of this route, where to and by when. Default:
    /// none (SENT is final).
    pub confirm: Option<crate::verdict::ConfirmPolicy>,
    /// Per-partition-key FIFO: `Some(policy)` publishes the messages of one partition key one
    /// after another in id (commit) order, and a message never overtakes an earlier one of its
    /// key that is still pending or backing off; `policy` says what a dead-lettered message does
    /// to the rest of its key. Messages without a partition key are unordered. Default `None`:
    /// messages are published as soon as they are due, in any order (see docs/ordering.md).
    pub ordered: Option<DeadLetterPolicy>,
}

/// What a dead-lettered (FAILED) message does to the later messages of its partition key on an
/// ordered route ([`Route::ordered`]). Follows docs/design/DESIGN.md §6 (poison isolation): either way only
/// that key is affected.
/// In a configuration file: `on_dead_letter = "skip"` or `"block"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum DeadLetterPolicy {
    /// The next message of the key is published once the head is dead-lettered (a warning is
    /// logged). Default: one poison message does not stop its key for good.
    #[default]
    Skip,
    /// The key stays blocked while a dead letter is ahead of it, until an operator requeues
    /// (`outbox requeue`) or deletes it. For consumers that must never see a gap.
    Block,
}

/// Ordered list of routes; the first match wins. A topic with no route is a permanent error
/// for that message (it goes to FAILED with reason `no route for topic …`), unless another live
/// relay on the same table routes it: then the relay hands the message's bucket over to that
/// relay (see [`crate::relay`], "Failure handling").
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
        policy: crate::verdict::ConfirmPolicy,
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

    #[test]
    fn patterns_print_as_parsed() {
        for p in ["*", "orders.*", "a-*", "exact.topic"] {
            assert_eq!(TopicPattern::parse(p).to_string(), p);
        }
    }
}
