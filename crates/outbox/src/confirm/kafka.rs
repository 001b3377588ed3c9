//! Confirmations over Kafka (feature `kafka`): consumers produce each [`Confirmation`] as a JSON
//! record to the reply topic named in `outbox-reply-to` (record key = the message id, so the
//! confirmations of one message stay in order in one partition), with `acks=all` and the
//! delivery report awaited; the producer side runs [`listen`] in a consumer group (several relay
//! instances share the partitions) and applies the confirmations to its [`Store`] in batches of
//! up to 500.
//!
//! The listener commits a batch's offsets only after the store applied it. When the store fails
//! with a transient error (after [`apply_with_retry`]'s retries), the partitions of the batch are
//! paused and sought back, and the batch is applied again after a backoff, so a database outage
//! loses no confirmation. A record that is not a confirmation is logged and skipped; a batch the
//! store refuses for good (a non-transient error) is logged and skipped too: the relay's
//! check-back redelivers those messages and the consumer confirms them again.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use rdkafka::consumer::Consumer as _;
use rdkafka::message::{Header, Message as _, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use tokio_util::sync::CancellationToken;

use super::{
    ConfirmReport, Confirmation, ConfirmationSender, apply_with_retry, parse_confirmations,
};
use crate::Store;
use crate::consumer::kafka::{
    DEFAULT_SESSION_TIMEOUT, PartitionState, close, next_batch, subscribe,
};
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
/// up to 500, until `cancel`. Returns the totals. The group's `session.timeout.ms` is
/// [`DEFAULT_SESSION_TIMEOUT`] unless `config.properties` sets it.
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
    config.validate()?;
    if !valid_topic(&topic) {
        return Err(ConfigError::new(
            "topic",
            format!("{topic:?} is not a Kafka topic name"),
        ));
    }
    if group_id.is_empty() {
        return Err(ConfigError::new("group_id", "must not be empty"));
    }
    let consumer = subscribe(
        &config,
        &group_id,
        std::slice::from_ref(&topic),
        "earliest",
        DEFAULT_SESSION_TIMEOUT,
        &Default::default(),
    )
    .await?;
    let backoff = Backoff {
        base: Duration::from_millis(500),
        max: Duration::from_secs(30),
        ..Backoff::default()
    };
    let mut total = ConfirmReport::default();
    let mut state = PartitionState::default();
    let mut failures = 0u32;
    loop {
        let wake_at = state.resume_due(&consumer);
        let records =
            match next_batch(&consumer, 500, Duration::from_millis(5), wake_at, &cancel).await {
                None => break,
                Some(Ok(r)) => r,
                Some(Err(e)) => {
                    failures += 1;
                    tracing::warn!(error = %e, "Kafka confirmation fetch failed; backing off");
                    tokio::select! {
                        _ = cancel.cancelled() => break,
                        _ = tokio::time::sleep(backoff.delay(failures)) => continue,
                    }
                }
            };
        state.forget(consumer.context().take_rebalanced());
        let records: Vec<_> = records
            .into_iter()
            .filter(|m| state.admit(&consumer, m))
            .collect();
        if records.is_empty() {
            continue;
        }
        let mut batch = Vec::with_capacity(records.len());
        for m in &records {
            match parse_confirmations(m.payload().unwrap_or_default()) {
                Ok(cs) => batch.extend(cs),
                Err(e) => tracing::warn!(
                    error = %e,
                    partition = m.partition(),
                    offset = m.offset(),
                    "malformed confirmation skipped"
                ),
            }
        }
        let retry = match apply_with_retry(&store, &batch, 5).await {
            Ok(r) => {
                failures = 0;
                if r.unknown > 0 {
                    tracing::warn!(unknown = r.unknown, "confirmations for unknown message ids");
                }
                total.add(r);
                None
            }
            Err(e) if e.is_retryable() => {
                failures += 1;
                let delay = backoff.delay(failures);
                tracing::error!(error = %e, n = batch.len(), ?delay, "confirmations not applied; trying again after a backoff");
                Some(delay)
            }
            Err(e) => {
                tracing::error!(error = %e, n = batch.len(), "confirmations refused by the store; skipped (the check-back will bring them again)");
                None
            }
        };
        let done = records
            .iter()
            .map(|m| ((m.topic().to_owned(), m.partition()), m.offset(), retry))
            .collect();
        state.settle(&consumer, done);
    }
    close(consumer, std::mem::take(&mut state.committed)).await;
    Ok(total)
}
