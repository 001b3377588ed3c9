//! JetStream pull consumer feeding an [`Inbox`].
//!
//! Each message is processed in the inbox transaction; after commit it is acknowledged with a
//! double ack (the server confirms the ack). A handler or inbox failure is negatively
//! acknowledged with a delay from [`Backoff`] by delivery count, JetStream's own redelivery
//! mechanism, so nothing is acknowledged that was not stored (shared case C27). A message whose
//! ack was lost is delivered again and reported as a duplicate by the inbox.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use async_nats::jetstream::consumer::{AckPolicy, pull};
use async_nats::jetstream::{self, AckKind};
use futures::StreamExt;
use tokio_util::sync::CancellationToken;

use crate::consumer::ConsumerMetrics;
use crate::error::ConfigError;
use crate::inbox::{Handler, Inbox, InboxBackend, Processed};
use crate::message::{Headers, InboundMessage};
use crate::retry::Backoff;

/// Settings of a JetStream consumer runner.
#[derive(Debug, Clone)]
pub struct NatsConsumerConfig {
    /// Stream to consume. Required.
    pub stream: String,
    /// Durable consumer name; instances with the same name share the work. Required.
    pub durable: String,
    /// Subject filter within the stream. Default: none (every subject).
    pub filter_subject: Option<String>,
    /// Messages fetched per pull. Default 100.
    pub batch: usize,
    /// How long the server waits for an ack before redelivering. Default 30 s.
    pub ack_wait: Duration,
    /// Delay before redelivering a message whose handler failed, by delivery count.
    /// Default 500 ms, ×2, ≤ 60 s.
    pub retry: Backoff,
}

impl NatsConsumerConfig {
    /// Settings with the defaults.
    pub fn new(stream: impl Into<String>, durable: impl Into<String>) -> Self {
        NatsConsumerConfig {
            stream: stream.into(),
            durable: durable.into(),
            filter_subject: None,
            batch: 100,
            ack_wait: Duration::from_secs(30),
            retry: Backoff {
                base: Duration::from_millis(500),
                factor: 2.0,
                max: Duration::from_secs(60),
                jitter: 0.2,
            },
        }
    }
}

/// Run the consumer until `cancel`.
///
/// # Errors
/// [`ConfigError`] naming `stream` or `durable` when the consumer cannot be created. Later
/// errors (fetch, ack) are logged and retried with backoff.
pub async fn run<DB, H>(
    js: jetstream::Context,
    config: NatsConsumerConfig,
    inbox: Inbox<DB>,
    handler: Arc<H>,
    metrics: Arc<ConsumerMetrics>,
    cancel: CancellationToken,
) -> Result<(), ConfigError>
where
    DB: InboxBackend,
    H: Handler<DB> + ?Sized,
{
    let stream = js.get_stream(&config.stream).await.map_err(|e| {
        ConfigError::new("stream", format!("stream {} not found: {e}", config.stream))
    })?;
    let consumer = stream
        .get_or_create_consumer(
            &config.durable,
            pull::Config {
                durable_name: Some(config.durable.clone()),
                ack_policy: AckPolicy::Explicit,
                ack_wait: config.ack_wait,
                filter_subject: config.filter_subject.clone().unwrap_or_default(),
                max_ack_pending: 10_000,
                ..Default::default()
            },
        )
        .await
        .map_err(|e| {
            ConfigError::new(
                "durable",
                format!("cannot create consumer {}: {e}", config.durable),
            )
        })?;
    let mut failures = 0u32;
    while !cancel.is_cancelled() {
        let fetched = consumer
            .fetch()
            .max_messages(config.batch)
            .expires(Duration::from_millis(500))
            .messages()
            .await;
        let mut messages = match fetched {
            Ok(m) => {
                failures = 0;
                m
            }
            Err(e) => {
                failures += 1;
                tracing::warn!(error = %e, "JetStream fetch failed; backing off");
                tokio::select! {
                    _ = cancel.cancelled() => break,
                    _ = tokio::time::sleep(config.retry.delay(failures)) => continue,
                }
            }
        };
        loop {
            let next = tokio::select! {
                _ = cancel.cancelled() => return Ok(()),
                n = messages.next() => n,
            };
            let Some(msg) = next else { break };
            let msg = match msg {
                Ok(m) => m,
                Err(e) => {
                    tracing::warn!(error = %e, "JetStream message error");
                    break;
                }
            };
            let delivered = msg.info().map(|i| i.delivered).unwrap_or(1).max(1) as u32;
            let mut headers = Headers::new();
            if let Some(h) = &msg.headers {
                for (k, vs) in h.iter() {
                    if let Some(v) = vs.first() {
                        headers.insert(k.to_string(), v.to_string());
                    }
                }
            }
            let inbound = match InboundMessage::from_wire(headers, msg.payload.to_vec(), delivered)
            {
                Ok(m) => m,
                Err(reason) => {
                    metrics.malformed.fetch_add(1, Ordering::Relaxed);
                    tracing::error!(subject = %msg.subject, reason, "message without outbox headers; terminating it");
                    let _ = msg.ack_with(AckKind::Term).await;
                    continue;
                }
            };
            match inbox.process(&inbound, handler.as_ref()).await {
                Ok(p) => {
                    let counter = if p == Processed::Applied {
                        &metrics.applied
                    } else {
                        &metrics.duplicates
                    };
                    counter.fetch_add(1, Ordering::Relaxed);
                    if let Err(e) = msg.double_ack().await {
                        // The effect is committed; a redelivery will be recognised as a duplicate.
                        tracing::warn!(error = %e, message_id = %inbound.message_id, "ack failed after commit");
                    }
                }
                Err(e) => {
                    metrics.failures.fetch_add(1, Ordering::Relaxed);
                    let delay = if e.is_retryable() {
                        config.retry.delay(delivered)
                    } else {
                        config.retry.max
                    };
                    if e.is_retryable() {
                        tracing::warn!(error = %e, message_id = %inbound.message_id, delivered, "handler failed; redelivering later");
                    } else {
                        tracing::error!(error = %e, message_id = %inbound.message_id, delivered, "handler failed permanently; redelivering with the longest backoff");
                    }
                    let _ = msg.ack_with(AckKind::Nak(Some(delay))).await;
                }
            }
        }
    }
    Ok(())
}
