//! Kafka transport (feature `kafka`): an idempotent librdkafka producer (rdkafka 0.39, which
//! bundles librdkafka 2.12) with `acks=all`; `Ok` only after the partition leader reported the
//! record written to every in-sync replica (the delivery report).
//!
//! # What travels where
//! - **Topic**: the route's destination (default `{topic}`, the outbox topic itself). Kafka topic
//!   names are 1 to 249 characters of `A-Z a-z 0-9 . _ -` (and not `.` or `..`); any other name
//!   is refused before sending, as a permanent error.
//! - **Record key**: the message's partition key, so every message of one key goes to the same
//!   partition and keeps its order there. A message **without** a partition key is keyed by its
//!   message id (hyphenated UUID text): such messages spread over the partitions as if random,
//!   carry no order promise, and are accepted by compacted topics (which refuse null keys). The
//!   partitioner is `murmur2_random`, the Java client's default, so a key lands on the partition a
//!   Java producer (the seeds) would choose for it.
//! - **Record headers**: every [`Message::wire_headers`](crate::Message::wire_headers) entry
//!   (user headers, `traceparent` and `tracestate` included, plus `outbox-message-id`,
//!   `outbox-topic`, `outbox-attempt`, `outbox-partition-key`, `outbox-reply-to`). Kafka records
//!   have no message-id field: the id travels in the `outbox-message-id` header.
//! - **Value**: the payload, byte-exact.
//!
//! # Acknowledgement and duplicates
//! The whole batch is enqueued first (`produce`), then the delivery reports are awaited
//! (pipelined; librdkafka batches per partition behind the scenes). `enable.idempotence=true`
//! makes the broker drop the duplicates librdkafka's own retries would write and keeps per
//! partition order across those retries. It does not cover a relay that crashes after the ack and
//! before recording SENT: the next relay publishes the row again, as a new record with the same
//! `outbox-message-id`, and the consumer's inbox absorbs the copy (Kafka has no broker-side dedup
//! by an application id, unlike JetStream's `Nats-Msg-Id`).
//!
//! # Timeouts: librdkafka's retries versus the relay's
//! librdkafka retries a failed produce request by itself until `message.timeout.ms` (here
//! [`KafkaConfig::delivery_timeout`], default 5 s) has passed since the record was enqueued, then
//! reports `MessageTimedOut`. Keep `delivery_timeout` **below** the relay's `publish_timeout`
//! (default 10 s): then every record of a batch gets its delivery report before the relay gives
//! up on the batch, and no record stays queued inside librdkafka after the relay recorded a
//! failure (a record that the relay timed out but librdkafka later delivered would only be a
//! duplicate for the inbox, never a loss, but it would also be retried by the relay).
//!
//! # Classification (where the error is born)
//! | librdkafka error | kind |
//! |---|---|
//! | record larger than `message.max.bytes` (refused at `produce`, never put in a batch), `MSG_SIZE_TOO_LARGE` / `RECORD_LIST_TOO_LARGE` / `INVALID_RECORD` / `INVALID_TOPIC` from the broker, invalid topic name | Permanent |
//! | local queue full (`queue.buffering.max.messages` / `.kbytes`) | Retryable |
//! | unknown topic or partition (the producer does not ask the broker to create topics) | Unavailable, missing destination: see below |
//! | `MessageTimedOut` while librdkafka reports all brokers down, transport and resolve failures | Unavailable |
//! | fatal producer error, fenced producer (`_FATAL`, `_FENCED`, `PRODUCER_FENCED`, `INVALID_PRODUCER_EPOCH`) | Unavailable: the producer is rebuilt |
//! | authentication (`_AUTHENTICATION`, `SASL_AUTHENTICATION_FAILED`), TLS (`_SSL`), authorization (`TOPIC_AUTHORIZATION_FAILED`, `CLUSTER_AUTHORIZATION_FAILED`) | Unavailable: a configuration fault pauses the transport |
//! | `MessageTimedOut` otherwise, `NOT_ENOUGH_REPLICAS`, leader changes, anything else | Retryable |
//!
//! **Unknown topic pauses the transport**: on Kafka a missing topic is almost always a deployment
//! that has not created it yet (auto-creation is usually off), so no attempt is counted and the
//! message is published once the topic exists; after the relay's `missing_destination_grace`
//! (default 5 min) it is dead-lettered with the broker's reason. librdkafka waits `topic.metadata.propagation.max.ms` (here half the delivery
//! timeout, unless set in [`KafkaConfig::properties`]) for a new topic to appear before it reports
//! it unknown, and then learns of its creation at its next metadata refresh
//! (`topic.metadata.refresh.interval.ms`, 5 min by default).
//!
//! **Message too large** (shared case C07): librdkafka refuses a record larger than
//! `message.max.bytes` ([`KafkaConfig::max_message_bytes`]) when it is produced, so it never
//! joins a batch and cannot take the other records of a batch down with it. Set it to the topic's
//! `max.message.bytes` (broker default 1 MiB): a record the client lets through but the broker
//! refuses fails with `MSG_SIZE_TOO_LARGE`, also permanent.
//!
//! A fatal idempotent-producer error (a fenced producer, an out-of-order sequence after data loss
//! on the broker) makes the producer unusable: the transport reports every failure of the batch
//! `Unavailable` (no attempt counted) and builds a fresh producer at once; if that fails, the
//! relay's probe ([`Transport::probe`]) builds it, with backoff, without a restart.
//!
//! # Limits
//! - The producer never asks the broker to create a topic (`allow.auto.create.topics=false`,
//!   overridable in [`KafkaConfig::properties`]): a mistyped destination must not "deliver" into a
//!   topic no consumer reads. Create topics with [`create_topics`].
//! - This build of librdkafka has no TLS and no SCRAM/GSSAPI support unless the `rdkafka` crate is
//!   built with its `ssl` / `sasl` features (the workspace does not enable them); SASL/PLAIN
//!   works without them. [`KafkaTransport::connect`] checks librdkafka's `builtin.features` and
//!   names the field ([`KafkaConfig::tls`], [`KafkaConfig::sasl`]) that asks for a missing one.
//! - Kafka keeps order per partition only: the partition key must not change the partition count
//!   of a topic while keyed messages are in flight (adding partitions moves keys).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use async_trait::async_trait;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::{ClientContext, DefaultClientContext};
use rdkafka::config::ClientConfig;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};

use super::{Acks, Outgoing, Transport};
use crate::error::{ConfigError, TransportError, TransportErrorKind};

mod config;
pub use config::*;

/// What the producer's client context learned from librdkafka's events, shared with the
/// transport (the context itself is wrapped by rdkafka's `FutureProducer` and out of reach):
/// whether librdkafka reported every broker down (its `ALL_BROKERS_DOWN` error event), so a
/// delivery timeout can be told apart from an outage, and the idempotent-producer state from
/// librdkafka's statistics when `statistics.interval.ms` is set in [`KafkaConfig::properties`].
#[derive(Debug, Default)]
pub struct ProducerState {
    all_brokers_down: AtomicBool,
    idempotence: std::sync::Mutex<Option<(String, i64)>>,
}

impl ProducerState {
    /// Whether librdkafka reported all brokers down since the last successful delivery or probe.
    pub fn brokers_down(&self) -> bool {
        self.all_brokers_down.load(Ordering::Acquire)
    }

    /// The idempotent producer's state and producer id from the latest statistics
    /// (`("Assigned", id)` once the broker gave the producer its id), or `None` before the first
    /// statistics (they are only emitted when `statistics.interval.ms` is set).
    pub fn idempotence(&self) -> Option<(String, i64)> {
        self.idempotence.lock().expect("stats lock").clone()
    }

    fn set_up(&self) {
        self.all_brokers_down.store(false, Ordering::Release);
    }
}

/// Client context of the producer, feeding a [`ProducerState`].
#[derive(Default)]
pub struct OutageContext(Arc<ProducerState>);

impl ClientContext for OutageContext {
    fn stats(&self, statistics: rdkafka::Statistics) {
        if let Some(eos) = statistics.eos {
            *self.0.idempotence.lock().expect("stats lock") =
                Some((eos.idemp_state, eos.producer_id));
        }
    }

    fn error(&self, error: KafkaError, reason: &str) {
        if matches!(
            error.rdkafka_error_code(),
            Some(RDKafkaErrorCode::AllBrokersDown)
        ) {
            self.0.all_brokers_down.store(true, Ordering::Release);
            tracing::warn!(reason, "Kafka: all brokers are down");
        } else {
            tracing::debug!(error = %error, reason, "librdkafka error event");
        }
    }
}

type KafkaProducer = FutureProducer<OutageContext>;

/// Publishes to Kafka (see the module docs).
#[derive(derive_more::Debug)]
pub struct KafkaTransport {
    config: KafkaConfig,
    #[debug(skip)]
    state: Arc<ProducerState>,
    #[debug(skip)]
    producer: RwLock<Arc<KafkaProducer>>,
}

impl KafkaTransport {
    /// Build the producer and check that the cluster answers (a metadata request within
    /// `connect_timeout`).
    ///
    /// # Errors
    /// [`ConfigError`] naming the field: a [`KafkaConfig::validate`] failure, `tls` / `sasl.mechanism`
    /// for a feature this librdkafka lacks, `properties.<name>` for a property librdkafka refuses,
    /// `bootstrap_servers` when the cluster does not answer.
    pub async fn connect(config: KafkaConfig) -> Result<Self, ConfigError> {
        let transport = Self::new(config)?;
        transport.probe().await.map_err(|e| {
            ConfigError::new(
                "bootstrap_servers",
                format!(
                    "cannot reach Kafka at {}: {}",
                    transport.config.bootstrap_servers,
                    e.report()
                ),
            )
        })?;
        Ok(transport)
    }

    /// Build the producer without contacting the cluster (librdkafka connects in the background).
    ///
    /// # Errors
    /// As [`KafkaTransport::connect`], except for reachability.
    pub fn new(config: KafkaConfig) -> Result<Self, ConfigError> {
        config.validate()?;
        config.check_features()?;
        let state = Arc::new(ProducerState::default());
        let producer = Arc::new(build_producer(&config, &state)?);
        Ok(KafkaTransport {
            config,
            state,
            producer: RwLock::new(producer),
        })
    }

    /// The settings.
    pub fn config(&self) -> &KafkaConfig {
        &self.config
    }

    /// What the producer learned from librdkafka's events (outage, idempotence state).
    pub fn state(&self) -> &Arc<ProducerState> {
        &self.state
    }

    /// The current producer (replaced after a fatal error), e.g. to share it with a
    /// [`KafkaConfirmationSender`](crate::confirm::kafka::KafkaConfirmationSender).
    pub fn producer(&self) -> Arc<FutureProducer<OutageContext>> {
        self.producer.read().expect("producer lock").clone()
    }

    /// Replace a producer that hit a fatal error (fenced, idempotence state lost): `None` when
    /// `current` is healthy, otherwise the fatal error's description (the producer is replaced
    /// when a new one can be built; if not, the next probe tries again).
    fn renew_if_fatal(&self, current: &Arc<KafkaProducer>) -> Option<String> {
        let (code, reason) = current.client().fatal_error()?;
        let what = format!("the Kafka producer failed fatally ({code:?}: {reason})");
        tracing::warn!(
            ?code,
            reason,
            "Kafka producer fatal error; building a new producer"
        );
        match build_producer(&self.config, &self.state) {
            Ok(p) => {
                let mut slot = self.producer.write().expect("producer lock");
                if Arc::ptr_eq(&slot, current) {
                    *slot = Arc::new(p);
                }
            }
            Err(e) => tracing::warn!(error = %e, "cannot build a new Kafka producer"),
        }
        Some(what)
    }
}

fn build_producer(
    config: &KafkaConfig,
    state: &Arc<ProducerState>,
) -> Result<KafkaProducer, ConfigError> {
    config
        .producer_config()
        .create_with_context(OutageContext(state.clone()))
        .map_err(config_error)
}

/// Classify a produce or delivery error (see the module docs' table).
pub fn classify(e: &KafkaError, brokers_down: bool) -> TransportErrorKind {
    use RDKafkaErrorCode as C;
    let Some(code) = e.rdkafka_error_code() else {
        return TransportErrorKind::Retryable;
    };
    match code {
        C::MessageSizeTooLarge
        | C::MessageBatchTooLarge
        | C::InvalidMessageSize
        | C::InvalidRecord
        | C::InvalidTopic => TransportErrorKind::Permanent,
        C::AllBrokersDown | C::BrokerTransportFailure | C::Resolve => {
            TransportErrorKind::Unavailable
        }
        // A dead producer (fenced, fatal idempotence error): rebuilt, the message is not at fault.
        C::Fatal
        | C::Fenced
        | C::ProducerFenced
        | C::InvalidProducerEpoch
        | C::TransactionCoordinatorFenced => TransportErrorKind::Unavailable,
        // Credentials, TLS and permissions: the transport's configuration, not the message.
        C::Authentication
        | C::SaslAuthenticationFailed
        | C::SSL
        | C::TopicAuthorizationFailed
        | C::ClusterAuthorizationFailed
        | C::TransactionalIdAuthorizationFailed => TransportErrorKind::Unavailable,
        // A missing topic (see `produce_error`): the transport pauses until it exists.
        C::UnknownTopic | C::UnknownTopicOrPartition => TransportErrorKind::Unavailable,
        C::MessageTimedOut | C::RequestTimedOut | C::OperationTimedOut if brokers_down => {
            TransportErrorKind::Unavailable
        }
        _ => TransportErrorKind::Retryable,
    }
}

/// The error of a failed produce or delivery: [`classify`], with an unknown topic marked as a
/// [`missing destination`](TransportError::missing_destination).
fn produce_error(e: KafkaError, brokers_down: bool, destination: &str) -> TransportError {
    let reason = report(&e, destination);
    let missing = matches!(
        e.rdkafka_error_code(),
        Some(RDKafkaErrorCode::UnknownTopic | RDKafkaErrorCode::UnknownTopicOrPartition)
    );
    let err = if missing {
        TransportError::missing_destination(reason)
    } else {
        TransportError::new(classify(&e, brokers_down), reason)
    };
    err.with_source(e)
}

fn report(e: &KafkaError, destination: &str) -> String {
    match e.rdkafka_error_code() {
        Some(RDKafkaErrorCode::MessageSizeTooLarge) => {
            format!("Kafka refused the record for topic {destination}: message too large")
        }
        Some(RDKafkaErrorCode::UnknownTopic | RDKafkaErrorCode::UnknownTopicOrPartition) => {
            format!("Kafka topic {destination} does not exist (yet)")
        }
        _ => format!("Kafka publish to topic {destination} failed"),
    }
}

/// The record headers of `m`: every wire header.
pub(crate) fn record_headers(m: &crate::Message) -> OwnedHeaders {
    let wire = m.wire_headers();
    wire.iter()
        .fold(OwnedHeaders::new_with_capacity(wire.len()), |h, (k, v)| {
            h.insert(Header {
                key: k,
                value: Some(v.as_str()),
            })
        })
}

#[async_trait]
impl Transport for KafkaTransport {
    fn name(&self) -> &str {
        "kafka"
    }

    /// Kafka carries any header name and value (record header keys are UTF-8 strings, values
    /// bytes) and any partition key (the record key, bytes), and reserves no header name: only the
    /// topic name is checked.
    fn check(&self, out: &Outgoing<'_>) -> Result<(), TransportError> {
        check_message(out)
    }

    async fn publish_each(&self, batch: &[Outgoing<'_>], acks: &Acks) {
        let producer = self.producer();
        // Enqueue the whole batch, then await the delivery reports.
        let mut pending = Vec::with_capacity(batch.len());
        for o in batch {
            if let Err(refused) = self.check(o) {
                pending.push(Err(refused));
                continue;
            }
            let m = o.message;
            let id = m.message_id.to_string();
            let key = m.partition_key.as_deref().unwrap_or(&id);
            let record = FutureRecord::to(o.destination)
                .key(key)
                .payload(&m.payload)
                .headers(record_headers(m));
            pending.push(match producer.send_result(record) {
                Ok(delivery) => Ok(delivery),
                Err((e, _)) => Err(produce_error(e, self.state.brokers_down(), o.destination)),
            });
        }
        // Each delivery report is recorded as it arrives: acknowledged messages count even if
        // the relay's publish timeout cuts the rest short.
        let mut any_error = false;
        for (p, o) in pending.into_iter().zip(batch) {
            let r = match p {
                Err(e) => Err(e),
                Ok(delivery) => match delivery.await {
                    Ok(Ok(_)) => {
                        self.state.set_up();
                        Ok(())
                    }
                    Ok(Err((e, _))) => {
                        Err(produce_error(e, self.state.brokers_down(), o.destination))
                    }
                    Err(_) => Err(TransportError::retryable(
                        "the Kafka producer was dropped before the delivery report",
                    )),
                },
            };
            // A fatal producer (fenced): no failure of this batch is the message's fault.
            let r = match r {
                Err(e) => match producer.client().fatal_error() {
                    Some((code, reason)) => Err(TransportError::unavailable(format!(
                        "the Kafka producer failed fatally ({code:?}: {reason}); it is rebuilt"
                    ))
                    .with_source(e)),
                    None => Err(e),
                },
                ok => ok,
            };
            any_error |= r.is_err();
            acks.push(r);
        }
        if any_error {
            self.renew_if_fatal(&producer);
        }
    }

    async fn probe(&self) -> Result<(), TransportError> {
        if let Some(fatal) = self.renew_if_fatal(&self.producer()) {
            tracing::debug!(fatal, "Kafka producer rebuilt by the probe");
        }
        let producer = self.producer();
        if let Some((code, reason)) = producer.client().fatal_error() {
            return Err(TransportError::unavailable(format!(
                "the Kafka producer failed fatally ({code:?}: {reason}) and could not be rebuilt"
            )));
        }
        let timeout = self.config.connect_timeout;
        let p = producer.clone();
        let fetched = tokio::task::spawn_blocking(move || {
            p.client().fetch_metadata(None, timeout).map(|_| ())
        })
        .await
        .unwrap_or(Err(KafkaError::Canceled));
        match fetched {
            Ok(()) => {
                self.state.set_up();
                Ok(())
            }
            Err(e) => Err(TransportError::unavailable(format!(
                "Kafka at {} did not answer a metadata request within {timeout:?}",
                self.config.bootstrap_servers
            ))
            .with_source(e)),
        }
    }
}

#[cfg(test)]
mod tests;
