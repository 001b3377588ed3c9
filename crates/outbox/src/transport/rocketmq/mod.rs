//! Apache RocketMQ transport (the seeds' broker): normal messages sent through the name server
//! with the remoting protocol of [`rocketmq-client-rust`](https://docs.rs/rocketmq-client-rust)
//! 1.0, `Ok` only on the broker's `SEND_OK`.
//!
//! # Destination: `Topic` or `Topic:Tag`
//! A route destination is a RocketMQ topic, optionally followed by `:` and a tag, the format of
//! Spring's `RocketMQTemplate` that the seeds use (`"order-topic:created"`). `{topic}` is replaced
//! by the outbox topic before parsing, so `Orders:{topic}` sends every outbox topic to the topic
//! `Orders` with the outbox topic as the tag (a consumer subscribes with
//! `order-created || order-cancelled`). RocketMQ topic names allow only `%|a-zA-Z0-9_-`, at most
//! 127 characters (`TopicValidator`): an outbox topic with a dot cannot be a RocketMQ topic and
//! such a destination is refused as permanent before anything is sent, as is a system topic
//! producers may not send to (`TopicValidator.isNotAllowedSendTopic`: `SCHEDULE_TOPIC_XXXX`,
//! `RMQ_SYS_TRANS_HALF_TOPIC`, …). A tag must be non-empty, without whitespace, control
//! characters or `||` (the subscription expression separator).
//!
//! # What the message carries
//! - **Message id**: `UNIQ_KEY` (the client message id, `MessageExt.msgId` on the consumer side,
//!   kept across the broker's retries) is the outbox message id, and it is the first of the
//!   message's `KEYS` (space-separated, indexed by the broker for "query by key"); the partition
//!   key, when present, is the second key. A partition key containing spaces is indexed as
//!   several keys; the exact value travels in `outbox-partition-key`.
//! - **Tag**: the destination's tag.
//! - **Headers**: every [`Message::wire_headers`](crate::Message::wire_headers) entry (user
//!   headers such as `traceparent`, plus `outbox-message-id`, `outbox-topic`, `outbox-attempt`,
//!   `outbox-partition-key`, `outbox-reply-to`) as a user property. A user header whose name is a
//!   RocketMQ system property (`KEYS`, `TAGS`, `DELAY`, `UNIQ_KEY`, …, see
//!   `MessageConst`/`STRING_HASH_SET`) cannot travel and the message fails as permanent.
//! - **Body**: the payload, byte-exact (the client compresses bodies over 4 KiB and the consumer
//!   decompresses them). RocketMQ refuses an empty body (`MESSAGE_ILLEGAL`, "the message body
//!   length is zero"): an empty payload fails as permanent.
//!
//! # Acknowledgement
//! Each message is sent synchronously with `WAIT=true` (the broker answers after storing it, and
//! after the flush or the replication when the broker is configured `SYNC_FLUSH` /
//! `SYNC_MASTER`); the batch is pipelined: up to [`RocketMqConfig::max_in_flight`] sends (of
//! different partition keys, see below) run concurrently and the results come back in input
//! order. Only `SEND_OK` is a success.
//! `FLUSH_DISK_TIMEOUT`, `FLUSH_SLAVE_TIMEOUT` and `SLAVE_NOT_AVAILABLE` mean the broker holds
//! the message but could not make it as durable as it is configured to: they are reported as
//! retryable, so the relay publishes again (a second copy may then be delivered; the consumer's
//! inbox absorbs it). RocketMQ has no broker-side duplicate filter for normal messages, so every
//! re-publish is a copy downstream: the message id in `UNIQ_KEY` is what the inbox deduplicates.
//!
//! # Per-key order
//! With [`RocketMqConfig::order_by_partition_key`] (default), a message with a partition key is
//! sent to the queue `|javaHashCode(key) % queues|` (the queue Java's `SelectMessageQueueByHash`
//! picks for a `String` argument), so one key's messages share a queue and a consumer sees them
//! in send order; messages without a key are spread by the client's latency-aware round robin.
//! Within a batch, the messages of one key are sent one after the other (the next after the
//! previous one's `SEND_OK`) while different keys are sent concurrently; when one is not
//! acknowledged (other than a permanent refusal), the later messages of its key in the batch are
//! not sent and fail as retryable, so a retry never lets a later message of a key overtake an
//! earlier one. The queue count of a topic must not change while order matters (the hash is
//! taken modulo the count).
//!
//! # Classification
//! - permanent: invalid destination (topic or tag), system property name used as a header, empty
//!   or oversized body (over [`RocketMqConfig::max_message_size`], checked before sending, or the
//!   broker's `maxMessageSize`: response `MESSAGE_ILLEGAL` 13);
//! - unavailable: no name server answers a route query (the client's request fails, is cut or
//!   times out), connection to the broker refused or lost (condition `unavailable` of the
//!   client's error), `NO_PERMISSION` 16 (the topic or broker refuses writes: a configuration
//!   fault that pauses the transport and burns no attempt); the probe asks a name server for the
//!   default topic's route. A send already awaiting its answer when its connection is reset is
//!   not failed by the client (`rocketmq-transport` 1.0.0 keeps it pending until its deadline):
//!   it ends as a timeout when [`RocketMqConfig::send_timeout`] or the relay's `publish_timeout`
//!   runs out, retryable while a name server answers, so it spends one attempt;
//! - retryable: `TOPIC_NOT_EXIST` 17 and "no route info of this topic" while a name server
//!   answers, and everything else
//!   (timeouts, `SYSTEM_BUSY` 2, `SYSTEM_ERROR` 1, the non-`SEND_OK` statuses above). A missing
//!   route is what a topic that does not exist on a broker without `autoCreateTopicEnable`
//!   looks like, but the client reports the same when its own route lookup failed (seen: its
//!   request queue saturated under load, then "No route info" although the topic existed), so
//!   it cannot be told from a transient failure. Like Kafka's unknown topic, it is retried with
//!   backoff and dead-lettered after the last attempt with this reason; creating topics is the
//!   deployment's job.
//!
//! # Client runtime
//! The client needs an explicitly owned runtime (`ClientRuntime`, derived from a
//! `rocketmq_runtime::RuntimeOwner`). Unless one is given ([`RocketMqConfig::runtime`]),
//! [`client_runtime`] creates one for the process, shared by every RocketMQ transport, consumer
//! runner and confirmation sender: a dedicated Tokio runtime (at least 4 worker threads) that lives
//! as long as the process. Each producer and consumer gets its own client instance name, so
//! several of them (even of one group) can live in one process.
//!
//! Sources: RocketMQ 5 "Normal message", "Message sending retry", "Message keys/tags" and
//! `SendStatus` documentation (<https://rocketmq.apache.org/docs/>), and the Java client's
//! `Validators`, `SelectMessageQueueByHash` and `MessageClientIDSetter`.

use std::net::ToSocketAddrs;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use async_trait::async_trait;
use futures::StreamExt;
use rocketmq_client_rust::{
    AclClientRPCHook, ClientConfig, ClientError, ClientRpcHook, ClientRuntime, ClientRuntimeConfig,
    DefaultMQProducer, JavaHashCode, MQBrokerException, MQClientException, SessionCredentials,
};
use rocketmq_model::common::message::message_queue::MessageQueue;
use rocketmq_model::common::message::message_single::Message as MqMessage;
use rocketmq_model::common::message::{MessageConst, MessageTrait, STRING_HASH_SET};
use rocketmq_model::common::topic::TopicValidator;
use rocketmq_model::result::SendStatus;

use super::wire::{self, Broker, Field, HeaderRules, WireError};
use super::{Acks, Outgoing, Transport};
use crate::error::{ConfigError, TransportError, TransportErrorKind};
use crate::message::Message;

mod config;
pub use config::*;

/// Broker response codes (`org.apache.rocketmq.remoting.protocol.ResponseCode`) the transport
/// classifies.
mod code {
    /// `SYSTEM_ERROR`.
    pub const SYSTEM_ERROR: i32 = 1;
    /// `SYSTEM_BUSY`.
    pub const SYSTEM_BUSY: i32 = 2;
    /// `MESSAGE_ILLEGAL`: too large, bad topic or properties.
    pub const MESSAGE_ILLEGAL: i32 = 13;
    /// `NO_PERMISSION`: the topic or broker refuses writes.
    pub const NO_PERMISSION: i32 = 16;
    /// `TOPIC_NOT_EXIST`.
    pub const TOPIC_NOT_EXIST: i32 = 17;
    /// The client's `ClientErrorCode.NOT_FOUND_TOPIC_EXCEPTION` ("No route info of this topic").
    pub const NOT_FOUND_TOPIC: i32 = 10005;
    /// The client's `ClientErrorCode.NO_NAME_SERVER_EXCEPTION`.
    pub const NO_NAME_SERVER: i32 = 10004;
    /// The client's `ClientErrorCode.CONNECT_BROKER_EXCEPTION`.
    pub const CONNECT_BROKER: i32 = 10001;
}

/// How long a push consumer's listener may take for one batch before the client gives up on it
/// and sends the batch back for a retry: RocketMQ's `consumeTimeout` default, 15 min.
pub const LISTENER_TIMEOUT: Duration = Duration::from_secs(15 * 60);

/// RocketMQ's default maximum message size, 4 MiB (`maxMessageSize` of the broker and the
/// producer).
pub const DEFAULT_MAX_MESSAGE_SIZE: usize = 4 * 1024 * 1024;

struct SharedRuntime {
    _owner: rocketmq_runtime::RuntimeOwner,
    _telemetry: rocketmq_observability::TelemetryRuntimeGuard,
    client: Arc<ClientRuntime>,
}

/// The process-wide RocketMQ client runtime, created on first use: a dedicated Tokio runtime
/// (`outbox-rocketmq` threads, at least 4 workers, or the available parallelism; 64 blocking
/// threads, of which 32 may run push-consumer listeners, each for up to [`LISTENER_TIMEOUT`])
/// owned by a `rocketmq_runtime::RuntimeOwner` with a no-op telemetry handle. It lives as long as
/// the process.
///
/// # Errors
/// [`ConfigError`] naming `runtime` when the runtime cannot be built (thread creation, memory
/// budget discovery); the same error on every later call.
pub fn client_runtime() -> Result<Arc<ClientRuntime>, ConfigError> {
    static SHARED: OnceLock<Result<SharedRuntime, String>> = OnceLock::new();
    let shared = SHARED.get_or_init(|| {
        let parallelism = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(4)
            .max(4);
        let mut config =
            rocketmq_runtime::RuntimeConfig::for_parallelism("outbox-rocketmq", parallelism)
                .with_max_blocking_threads(64)
                .map_err(|e| format!("invalid RocketMQ runtime configuration: {e}"))?;
        // The push consumer calls its listener on this lane; the consumer runners' listeners
        // wait there until the inbox committed, so give the lane room and RocketMQ's own
        // consume timeout (15 min) instead of the lane's 30 s default.
        let lane = &mut config.blocking_lane_policies.metadata_io;
        lane.max_concurrency = 32;
        lane.max_queue_depth = 256;
        lane.queue_timeout = Duration::from_secs(60);
        lane.task_timeout = LISTENER_TIMEOUT;
        let owner = rocketmq_runtime::RuntimeOwner::plan(config)
            .map_err(|e| format!("invalid RocketMQ runtime configuration: {e}"))?
            .build()
            .map_err(|e| format!("cannot build the RocketMQ client runtime: {e}"))?;
        let telemetry = rocketmq_observability::TelemetryRuntimeGuard::noop();
        let client = ClientRuntime::try_new(
            owner.root_context().component("outbox"),
            ClientRuntimeConfig::default(),
            telemetry.handle(),
        )
        .map_err(|e| format!("cannot create the RocketMQ client runtime: {e}"))?;
        Ok(SharedRuntime {
            _owner: owner,
            _telemetry: telemetry,
            client,
        })
    });
    match shared {
        Ok(s) => Ok(s.client.clone()),
        Err(e) => Err(ConfigError::new("runtime", e.clone())),
    }
}

/// A client configuration for the name server list `name_server` with a process-unique instance
/// name (`outbox-<pid>-<role>-<n>`), so every producer and consumer has its own client instance,
/// and a request timeout of `send_timeout` (clamped to the client's 100 ms to 60 s).
pub fn client_config(name_server: &str, role: &str, send_timeout: Duration) -> ClientConfig {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    ClientConfig {
        namesrv_addr: Some(name_server.into()),
        instance_name: format!(
            "outbox-{}-{role}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        )
        .into(),
        // The client accepts 100 ms to 60 s.
        mq_client_api_timeout: send_timeout.as_millis().clamp(100, 60_000) as u64,
        ..ClientConfig::default()
    }
}

/// The ACL hook for `credentials` (it signs every request).
pub(crate) fn acl_hook(credentials: &Credentials) -> Arc<ClientRpcHook> {
    Arc::new(AclClientRPCHook::new(SessionCredentials::with_keys(
        credentials.access_key.as_str(),
        credentials.secret_key.as_str(),
    )))
}

/// Publishes normal messages to RocketMQ (see the module docs).
#[derive(Clone, derive_more::Debug)]
pub struct RocketMqTransport {
    #[debug(skip)]
    producer: DefaultMQProducer,
    config: Arc<RocketMqConfig>,
}

impl RocketMqTransport {
    /// Validate the settings, start a producer and check that a name server answers.
    ///
    /// # Errors
    /// [`ConfigError`] naming the invalid field (see [`RocketMqConfig::validate`]), `runtime`
    /// when the client runtime cannot be created, `name_server` when no name server accepts a
    /// connection, `producer_group` when the producer cannot start (for example a group already
    /// started in this client instance).
    pub async fn connect(config: RocketMqConfig) -> Result<Self, ConfigError> {
        config.validate()?;
        let runtime = match &config.runtime {
            Some(r) => r.clone(),
            None => client_runtime()?,
        };
        let name_servers = parse_name_servers(&config.name_server)
            .map_err(|r| ConfigError::new("name_server", r))?;
        ConfigError::invalid_if(
            !any_reachable(&name_servers, Duration::from_secs(3)).await,
            "name_server",
            format!(
                "no RocketMQ name server accepts connections at {}",
                config.name_server
            ),
        )?;
        let mut builder = DefaultMQProducer::builder(runtime)
            .client_config(client_config(
                &config.name_server,
                "producer",
                config.send_timeout,
            ))
            .producer_group(config.producer_group.as_str())
            .send_msg_timeout(config.send_timeout.as_millis().clamp(1, u32::MAX as u128) as u32)
            .retry_times_when_send_failed(config.retries)
            .max_message_size(config.max_message_size as u32);
        if let Some(t) = &config.create_topic_key {
            builder = builder.create_topic_key(t.as_str());
        }
        if let Some(c) = &config.credentials {
            builder = builder.rpc_hook(acl_hook(c));
        }
        let mut producer = builder.build();
        producer.start().await.map_err(|e| {
            ConfigError::new(
                "producer_group",
                format!(
                    "cannot start the RocketMQ producer of group {}: {e:?}",
                    config.producer_group
                ),
            )
        })?;
        Ok(RocketMqTransport {
            producer,
            config: Arc::new(config),
        })
    }

    /// The started producer (a clone shares it), for sends the transport does not make, such as
    /// [confirmations](crate::confirm::rocketmq).
    pub fn producer(&self) -> &DefaultMQProducer {
        &self.producer
    }

    /// The settings.
    pub fn config(&self) -> &RocketMqConfig {
        &self.config
    }

    /// Create `topic` with `queues` read and write queues on the brokers that serve RocketMQ's
    /// default topic `TBW102` (the client's `createTopic`, an administrative request the broker
    /// must allow), so consumers can find its route before anything was published to it.
    ///
    /// # Errors
    /// A permanent [`TransportError`] for an invalid topic name, otherwise the client's error
    /// classified as for a send.
    pub async fn create_topic(&self, topic: &str, queues: u32) -> Result<(), TransportError> {
        validate_topic(topic).map_err(TransportError::permanent)?;
        let key = self.config.create_topic_key.as_deref().unwrap_or("TBW102");
        let queues = i32::try_from(queues.max(1)).unwrap_or(i32::MAX);
        match self
            .producer
            .clone()
            .create_topic(key, topic, queues, std::collections::HashMap::new())
            .await
        {
            Ok(()) => Ok(()),
            Err(e) => Err(self.classify(e).await),
        }
    }

    /// Stop the producer (unregister it from the brokers and close its client instance). Later
    /// publishes fail.
    pub async fn shutdown(&self) {
        self.producer.clone().shutdown().await;
    }

    /// [`build_message`] with this transport's `max_message_size`.
    pub(crate) fn build_message(
        &self,
        m: &Message,
        dest: &Destination,
    ) -> Result<MqMessage, String> {
        build_message(m, dest, self.config.max_message_size)
    }

    /// Send one built message and map the outcome.
    pub(crate) async fn send_one(
        &self,
        msg: MqMessage,
        partition_key: Option<&str>,
    ) -> Result<(), TransportError> {
        let timeout = self.config.send_timeout.as_millis().max(1) as u64;
        let sent = match partition_key {
            Some(key) if self.config.order_by_partition_key => {
                self.producer
                    .send_with_selector_timeout(msg, select_by_key, key.to_owned(), timeout)
                    .await
            }
            _ => self.producer.send_with_timeout(msg, timeout).await,
        };
        match sent {
            Ok(Some(r)) if r.send_status == SendStatus::SendOk => Ok(()),
            Ok(Some(r)) => Err(TransportError::retryable(format!(
                "RocketMQ broker answered {:?}: stored but not flushed or replicated as configured",
                r.send_status
            ))),
            Ok(None) => Err(TransportError::retryable(
                "RocketMQ send returned no result",
            )),
            Err(e) => Err(self.classify(e).await),
        }
    }

    /// Whether a name server answers a route query (RocketMQ's `GET_ROUTEINFO_BY_TOPIC` for the
    /// default topic, through the client's `fetchPublishMessageQueues`, which always asks the
    /// name server). Any answer counts, "no such topic" included; a connection that fails, is
    /// closed or times out (5 s) does not.
    pub async fn name_server_answers(&self) -> bool {
        let topic = self.config.create_topic_key.as_deref().unwrap_or("TBW102");
        let mut p = self.producer.clone();
        match tokio::time::timeout(
            Duration::from_secs(5),
            p.fetch_publish_message_queues(topic),
        )
        .await
        {
            Err(_) => false,
            Ok(Ok(_)) => true,
            Ok(Err(e)) => !is_transport_failure(&e),
        }
    }

    /// Turn a client error into a classified transport error (see the module docs).
    async fn classify(&self, e: ClientError) -> TransportError {
        let kind = match class_of(&e) {
            Class::Permanent => TransportErrorKind::Permanent,
            Class::Unavailable => TransportErrorKind::Unavailable,
            Class::NoRoute | Class::Retryable => {
                if self.name_server_answers().await {
                    TransportErrorKind::Retryable
                } else {
                    TransportErrorKind::Unavailable
                }
            }
        };
        let what = match (kind, class_of(&e)) {
            (TransportErrorKind::Retryable, Class::NoRoute) => {
                "RocketMQ has no such topic or no route for it (it does not exist and is not \
                 auto-created, or the client's route lookup failed); retried with backoff"
            }
            (TransportErrorKind::Unavailable, _) => "RocketMQ is unreachable",
            (TransportErrorKind::Permanent, _) => "RocketMQ refused the message",
            _ => "RocketMQ send failed",
        };
        let what = match response_code(&e) {
            Some(c) => format!("{what} (response code {c})"),
            None => what.to_owned(),
        };
        TransportError::new(kind, what).with_source(e)
    }
}

/// RocketMQ's property encoding (`MessageDecoder.messageProperties2String`): `name` U+0001
/// `value` U+0002 per property, unescaped, so neither character may appear in a name or value.
const ROCKETMQ_PROPERTIES: HeaderRules = HeaderRules {
    broker: Broker::RocketMq,
    name: without_separators,
    value: without_separators,
};

/// `Err(rule)` for a property name or value holding a property separator (U+0001, U+0002).
fn without_separators(s: &str) -> Result<(), &'static str> {
    if s.contains(['\u{1}', '\u{2}']) {
        Err(
            "a RocketMQ property name or value cannot contain U+0001 or U+0002 (the property separators)",
        )
    } else {
        Ok(())
    }
}

/// What RocketMQ cannot carry (see the module docs): an invalid destination, an empty payload or
/// one over `max_message_size` bytes, a header named as a system property, a property separator
/// (U+0001, U+0002) in a header name or value, the topic or the partition key (which also
/// travels in `KEYS`). A pure function of the message.
///
/// # Errors
/// A permanent error naming the destination, payload, header or key and the rule it breaks.
pub(crate) fn check_message(
    out: &Outgoing<'_>,
    max_message_size: usize,
) -> Result<(), TransportError> {
    Destination::parse(out.destination).map_err(TransportError::permanent)?;
    let m = out.message;
    if m.payload.is_empty() {
        return Err(WireError::unsupported(
            Broker::RocketMq,
            Field::Payload,
            "RocketMQ refuses an empty message body (MESSAGE_ILLEGAL: the message body length is zero)",
        )
        .into());
    }
    if m.payload.len() > max_message_size {
        return Err(TransportError::permanent(format!(
            "payload of {} bytes exceeds the RocketMQ max_message_size of {max_message_size} bytes",
            m.payload.len()
        )));
    }
    wire::check_headers(m, &ROCKETMQ_PROPERTIES)?;
    if let Some(name) = m
        .headers
        .keys()
        .find(|k| STRING_HASH_SET.contains(k.as_str()))
    {
        // The client's own list, in case it knows a name `wire::RESERVED` does not yet.
        return Err(TransportError::permanent(format!(
            "header {name:?} is a RocketMQ system property name and cannot travel as a user property"
        )));
    }
    Ok(())
}

/// Build the RocketMQ message for `m` to `dest`: id in `UNIQ_KEY` and `KEYS` (with the partition
/// key), tag, headers as user properties.
///
/// # Errors
/// An empty payload, one over `max_message_size` bytes, or a header named like a system property.
pub(crate) fn build_message(
    m: &Message,
    dest: &Destination,
    max_message_size: usize,
) -> Result<MqMessage, String> {
    if m.payload.is_empty() {
        return Err(
            "RocketMQ refuses an empty message body (MESSAGE_ILLEGAL: the message body length is zero)"
                .into(),
        );
    }
    if m.payload.len() > max_message_size {
        return Err(format!(
            "payload of {} bytes exceeds the RocketMQ max_message_size of {} bytes",
            m.payload.len(),
            max_message_size
        ));
    }
    let mut keys = vec![m.message_id.to_string()];
    if let Some(k) = &m.partition_key {
        keys.push(k.clone());
    }
    build_raw(
        dest,
        bytes::Bytes::from(m.payload.clone()),
        Some(&m.message_id.to_string()),
        keys,
        m.wire_headers(),
    )
}

/// Build a RocketMQ message: `UNIQ_KEY` = `uniq_key` (when given; otherwise the client
/// generates one), `KEYS` = `keys` joined by spaces, the destination's tag, and `properties` as
/// user properties.
pub(crate) fn build_raw(
    dest: &Destination,
    body: bytes::Bytes,
    uniq_key: Option<&str>,
    keys: Vec<String>,
    properties: crate::message::Headers,
) -> Result<MqMessage, String> {
    let mut b = MqMessage::builder()
        .topic(dest.topic.as_str())
        .body(body)
        .keys(keys);
    if let Some(tag) = &dest.tag {
        b = b.tags(tag.as_str());
    }
    let mut msg = b
        .build()
        .map_err(|e| format!("cannot build the RocketMQ message: {e}"))?;
    if let Some(id) = uniq_key {
        msg.put_property(
            MessageConst::PROPERTY_UNIQ_CLIENT_MESSAGE_ID_KEYIDX.into(),
            id.into(),
        );
    }
    for (k, v) in properties {
        if STRING_HASH_SET.contains(k.as_str()) {
            return Err(format!(
                "header {k:?} is a RocketMQ system property name and cannot travel as a user property"
            ));
        }
        msg.put_property(k.into(), v.into());
    }
    Ok(msg)
}

/// The queue of `key`: `|javaHashCode(key) % queues|`, as Java's `SelectMessageQueueByHash`.
/// (`&String`: the client's selector receives its argument type by reference.)
#[allow(clippy::ptr_arg)]
fn select_by_key(mqs: &[MessageQueue], _msg: &MqMessage, key: &String) -> Option<MessageQueue> {
    if mqs.is_empty() {
        return None;
    }
    let n = i32::try_from(mqs.len()).unwrap_or(i32::MAX);
    let i = (key.as_str().java_hash_code() % n).unsigned_abs() as usize;
    mqs.get(i).cloned()
}

/// How the transport reads a client error before checking the name servers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Class {
    /// No route for the topic, or the broker says it does not exist (`TOPIC_NOT_EXIST`):
    /// retryable when a name server answers, unavailable otherwise.
    NoRoute,
    /// The message can never be accepted as it is.
    Permanent,
    /// The broker or name server cannot be reached.
    Unavailable,
    /// Anything else: try again.
    Retryable,
}

/// The response code a client error carries: the broker's, or the client's own code.
fn response_code(e: &ClientError) -> Option<i32> {
    e.broker_response_code()
        .or_else(|| {
            e.source_ref::<MQBrokerException>()
                .map(|b| b.response_code())
        })
        .or_else(|| {
            e.source_ref::<MQClientException>()
                .map(|c| c.response_code())
                .filter(|c| *c >= 0)
        })
}

/// Classify a client error by its response code and canonical condition.
pub(crate) fn class_of(e: &ClientError) -> Class {
    use rocketmq_error::CanonicalCondition as C;
    match response_code(e) {
        Some(code::NOT_FOUND_TOPIC | code::TOPIC_NOT_EXIST) => return Class::NoRoute,
        Some(code::MESSAGE_ILLEGAL) => return Class::Permanent,
        // The topic or broker refuses writes: the deployment's configuration, not the message.
        Some(code::NO_NAME_SERVER | code::CONNECT_BROKER | code::NO_PERMISSION) => {
            return Class::Unavailable;
        }
        Some(code::SYSTEM_ERROR | code::SYSTEM_BUSY) => return Class::Retryable,
        _ => {}
    }
    if e.is(&rocketmq_error::ROUTE_TOPIC_NOT_FOUND) || is_no_route_text(e) {
        return Class::NoRoute;
    }
    match e.condition() {
        C::Unavailable => Class::Unavailable,
        _ => Class::Retryable,
    }
}

/// Whether `e` is a failure to reach or hear from the peer (connection refused, closed, timed
/// out) rather than an answer.
fn is_transport_failure(e: &ClientError) -> bool {
    use rocketmq_error::CanonicalCondition as C;
    matches!(
        response_code(e),
        Some(code::NO_NAME_SERVER | code::CONNECT_BROKER)
    ) || matches!(e.condition(), C::Unavailable | C::DeadlineExceeded)
}

/// The client reports a missing route on its selector path without a code ("No route info for
/// this topic"); recognised by its text, the only signal it carries.
fn is_no_route_text(e: &ClientError) -> bool {
    e.source_ref::<MQClientException>()
        .and_then(|c| c.error_message())
        .is_some_and(|m| m.starts_with("No route info"))
}

/// Whether any of `addrs` accepts a TCP connection within `timeout`.
pub(crate) async fn any_reachable(addrs: &[String], timeout: Duration) -> bool {
    for a in addrs {
        let resolved = a.to_socket_addrs().ok().and_then(|mut i| i.next());
        let Some(sa) = resolved else { continue };
        if let Ok(Ok(_)) = tokio::time::timeout(timeout, tokio::net::TcpStream::connect(sa)).await {
            return true;
        }
    }
    false
}

#[async_trait]
impl Transport for RocketMqTransport {
    fn name(&self) -> &str {
        "rocketmq"
    }

    fn check(&self, out: &Outgoing<'_>) -> Result<(), TransportError> {
        check_message(out, self.config.max_message_size)
    }

    async fn publish_each(&self, batch: &[Outgoing<'_>], acks: &Acks) {
        // Chains: the messages of one partition key in batch order (sent one after the other to
        // the key's queue); every message without a key (or with key order off) is a chain of
        // its own. Chains run concurrently.
        let mut chains: Vec<Vec<usize>> = Vec::new();
        let mut chain_of: std::collections::HashMap<&str, usize> = Default::default();
        for (i, o) in batch.iter().enumerate() {
            match o.message.partition_key.as_deref() {
                Some(k) if self.config.order_by_partition_key => {
                    let c = *chain_of.entry(k).or_insert_with(|| {
                        chains.push(Vec::new());
                        chains.len() - 1
                    });
                    chains[c].push(i);
                }
                _ => chains.push(vec![i]),
            }
        }
        // Each send's result is recorded as it is known: acknowledged messages count even if the
        // relay's publish timeout cuts the rest short.
        let runs = chains.into_iter().map(|indices| async move {
            let mut held: Option<String> = None;
            for i in indices {
                let o = &batch[i];
                let key = o.message.partition_key.as_deref();
                let r = if let Some(reason) = &held {
                    Err(TransportError::retryable(reason.clone()))
                } else {
                    match self
                        .check(o)
                        .map_err(|e| e.report())
                        .and_then(|()| Destination::parse(o.destination))
                        .and_then(|d| self.build_message(o.message, &d))
                    {
                        Ok(msg) => self.send_one(msg, key).await,
                        Err(reason) => Err(TransportError::permanent(reason)),
                    }
                };
                if let (Err(e), Some(k)) = (&r, key)
                    && e.kind() != TransportErrorKind::Permanent
                {
                    held = Some(format!(
                        "not sent: an earlier message of partition key {k:?} in this batch was not acknowledged"
                    ));
                }
                acks.record(i, r);
            }
        });
        futures::stream::iter(runs)
            .buffer_unordered(self.config.max_in_flight)
            .collect::<Vec<()>>()
            .await;
    }

    async fn probe(&self) -> Result<(), TransportError> {
        if self.name_server_answers().await {
            Ok(())
        } else {
            Err(TransportError::unavailable(format!(
                "no RocketMQ name server answers at {}",
                self.config.name_server
            )))
        }
    }
}

#[cfg(test)]
mod tests;
