//! # outbox: the transactional outbox (本地消息表) for Rust
//!
//! Write a message as a row of an outbox table **in the same local transaction** as the business
//! change; a [`Relay`] publishes committed rows to a broker, retrying with backoff until the
//! broker acknowledges; the consumer applies each message **once** through an [`Inbox`] in its
//! own transaction.
//!
//! Promises (docs/design/DESIGN.md §1): a committed message is published at least once whatever crashes;
//! a rolled-back one never; an inbox consumer applies each message's effect once; SENT only after
//! the broker's acknowledgement; every time decision on the database clock; a poison message ends
//! in FAILED with its reason without blocking others.
//!
//! ## Parts
//! - Contracts: [`NewMessage`], [`Message`], [`InboundMessage`], [`Status`], errors ([`error`]),
//!   [`Backoff`].
//! - Stores ([`store::Store`]): [`PgStore`] (feature `postgres`), [`SqliteStore`] (feature `sqlite`),
//!   [`MySqlStore`] (feature `mysql`: MySQL 8.0.1+, MariaDB 10.6+).
//! - Transports ([`transport::Transport`]): [`MemoryTransport`], [`WebhookTransport`] (feature
//!   `webhook`), [`NatsTransport`] (feature `nats`), `RedisTransport` (feature `redis`, Redis
//!   Streams), `MqttTransport` (feature `mqtt`, MQTT 5); [`Router`] maps topics to them.
//! - [`Relay`]: bucket leases, read, publish, complete (one write per message), maintenance, probe.
//! - [`Inbox`] and the [`consumer`] runners.
//! - [`confirm`]: consumer confirmations, rejection hooks (compensation), check-back.
//!
//! See `docs/architecture.md` for the flow and the state diagram.
#![warn(missing_docs)]
// The RocketMQ client's futures are deep types; proving them `Send` needs more than the default.
#![cfg_attr(feature = "rocketmq", recursion_limit = "256")]

pub mod admin;
mod admin_model;
pub mod confirm;
pub mod consumer;
pub mod error;
#[cfg(any(fuzzing, test))]
#[doc(hidden)]
pub mod fuzzing;
pub mod histogram;
pub mod ident;
pub mod inbox;
pub mod message;
pub mod otel;
#[cfg(feature = "prometheus")]
pub mod prometheus;
mod redact;
pub mod relay;
pub mod reserved;
pub mod retention;
pub mod retry;
pub mod store;
pub mod transport;
pub mod two_phase;
mod two_phase_model;
pub mod verdict;

pub use confirm::{
    ConfirmPolicy, ConfirmReport, Confirmation, ConfirmationSender, RejectedMessage, RejectionHook,
    Verdict,
};
pub use error::{
    BoxError, ConfigError, DbErrorClass, EnqueueError, HandlerError, InboxError, StoreError,
    StoreErrorKind, TransportError, TransportErrorKind,
};
pub use ident::TableName;
pub use inbox::{BatchOutcome, DeadLetter, Handler, Inbox, InboxBackend, Processed, Replayed};
pub use message::{Headers, InboundMessage, Limits, Message, NewMessage, Status};
pub use relay::group::RelayGroup;
pub use relay::{
    MetricsSnapshot, Relay, RelayBuilder, RelayConfig, RelayHandle, RelayHealth, RelayHooks,
    RelayMetrics,
};
pub use retry::Backoff;
#[cfg(feature = "mysql")]
pub use store::mysql::MySqlStore;
#[cfg(feature = "postgres")]
pub use store::postgres::PgStore;
#[cfg(feature = "sqlite")]
pub use store::sqlite::SqliteStore;
pub use store::{FailedMessage, Outcome, Stats, Store, StoreOptions};
#[cfg(feature = "kafka")]
pub use transport::kafka::{KafkaConfig, KafkaTransport};
#[cfg(feature = "mqtt")]
pub use transport::mqtt::{MqttConfig, MqttTransport, NoSubscribers};
#[cfg(feature = "nats")]
pub use transport::nats::{NatsConfig, NatsTransport, StreamSetup};
#[cfg(feature = "rabbitmq")]
pub use transport::rabbitmq::{RabbitMqConfig, RabbitMqTransport, Unroutable};
#[cfg(feature = "redis")]
pub use transport::redis::{RedisConfig, RedisTransport, WaitReplicas};
#[cfg(feature = "rocketmq")]
pub use transport::rocketmq::{RocketMqConfig, RocketMqTransport};
#[cfg(feature = "webhook")]
pub use transport::webhook::{WebhookConfig, WebhookSigner, WebhookTransport};
pub use transport::{
    AckState, Acks, DeadLetterPolicy, MemoryTransport, Outgoing, Route, RouteConfig, Router,
    TopicPattern, Transport, TransportConfig,
};

/// The README's examples, compiled as doc tests so they stay true.
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
pub struct ReadmeExamples;
