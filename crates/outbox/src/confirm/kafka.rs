//! Confirmations over Kafka (feature `kafka`): consumers produce each [`Confirmation`] as a JSON
//! record to the reply topic named in `outbox-reply-to` (record key = the message id, so the
//! confirmations of one message stay in order in one partition), with `acks=all` and the
//! delivery report awaited; the producer side runs [`listen`] in a consumer group (several relay
//! instances share the partitions) and applies the confirmations to its [`Store`] in batches of
//! up to 500.
//!
//! The listener commits a batch's offsets only after the store applied it. When the store fails
//! with a transient error (after 5 tries), the partitions of the batch are
//! paused and sought back, and the batch is applied again after a backoff, so a database outage
//! loses no confirmation. A record that is not a confirmation is logged and skipped; a batch the
//! store refuses for good (a non-transient error) is logged and skipped too: the relay's
//! check-back redelivers those messages and the consumer confirms them again.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use tokio_util::sync::CancellationToken;

use super::{ConfirmReport, Confirmation, ConfirmationSender};
use crate::Store;
use crate::consumer::kafka::{DEFAULT_SESSION_TIMEOUT, KafkaConsumerConfig, KafkaSource};
use crate::consumer::source::RunOptions;
use crate::error::{ConfigError, TransportError};
use crate::retry::Backoff;
use crate::transport::kafka::{
    KafkaConfig, KafkaTransport, OutageContext, ProducerState, classify, valid_topic,
};

/// Produces confirmations to the reply topic (see the module docs).
#[derive(Clone)]
pub struct KafkaConfirmationSender {
    producer: Arc<FutureProducer<OutageContext>>,
    state: Arc<ProducerState>,
}

impl std::fmt::Debug for KafkaConfirmationSender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaConfirmationSender")
            .finish_non_exhaustive()
    }
}

impl KafkaConfirmationSender {
    /// A sender with its own idempotent producer built from `config` (librdkafka connects in the
    /// background).
    ///
    /// # Errors
    /// As [`KafkaTransport::new`].
    pub fn new(config: KafkaConfig) -> Result<Self, ConfigError> {
        Ok(Self::from_transport(&KafkaTransport::new(config)?))
    }

    /// A sender sharing `transport`'s producer.
    pub fn from_transport(transport: &KafkaTransport) -> Self {
        KafkaConfirmationSender {
            producer: transport.producer(),
            state: transport.state().clone(),
        }
    }
}

#[async_trait]
impl ConfirmationSender for KafkaConfirmationSender {
    async fn send(&self, reply_to: &str, c: &Confirmation) -> Result<(), TransportError> {
        if !valid_topic(reply_to) {
            return Err(TransportError::permanent(format!(
                "reply-to {reply_to:?} is not a Kafka topic name"
            )));
        }
        let body = serde_json::to_vec(c).expect("confirmation serializes");
        let key = c.message_id.to_string();
        let record = FutureRecord::to(reply_to).key(&key).payload(&body).headers(
            OwnedHeaders::new().insert(Header {
                key: "content-type",
                value: Some("application/json"),
            }),
        );
        let down = || self.state.brokers_down();
        let delivery = self.producer.send_result(record).map_err(|(e, _)| {
            TransportError::new(classify(&e, down()), "confirmation produce failed").with_source(e)
        })?;
        match delivery.await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err((e, _))) => Err(TransportError::new(
                classify(&e, down()),
                "confirmation not acknowledged by Kafka",
            )
            .with_source(e)),
            Err(_) => Err(TransportError::retryable(
                "the Kafka producer was dropped before the delivery report",
            )),
        }
    }
}

/// Consume `topic` in consumer group `group_id` and apply confirmations to `store` in batches of
/// up to 500, until `cancel`: the generic runner over a [`KafkaSource`] with a
/// [`ConfirmationHandler`](super::ConfirmationHandler). Returns the totals. The group's
/// `session.timeout.ms` is [`DEFAULT_SESSION_TIMEOUT`] unless `config.properties` sets it.
///
/// # Errors
/// [`ConfigError`] at start: invalid settings, the topic missing, or the cluster not answering.
/// Later errors are logged and retried with backoff.
pub async fn listen(
    config: KafkaConfig,
    topic: String,
    group_id: String,
    store: Arc<dyn Store>,
    cancel: CancellationToken,
) -> Result<ConfirmReport, ConfigError> {
    ConfigError::invalid_if(
        !valid_topic(&topic),
        "topic",
        format!("{topic:?} is not a Kafka topic name"),
    )?;
    let mut c = KafkaConsumerConfig::new(config, group_id, [topic]);
    c.batch = 500;
    c.batch_wait = Duration::from_millis(5);
    c.session_timeout = DEFAULT_SESSION_TIMEOUT;
    let options = RunOptions {
        batch: 500,
        reconnect: Backoff {
            base: Duration::from_millis(500),
            max: Duration::from_secs(30),
            ..Backoff::default()
        },
    };
    super::listen(KafkaSource::new(c)?, store, &options, &cancel).await
}
