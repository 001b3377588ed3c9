//! JetStream pull consumer feeding an [`Inbox`].
//!
//! Each message goes through [`deliver`]: after the inbox transaction commits it is acknowledged
//! with a double ack (the server confirms the ack) and its verdict is confirmed to the producer; a
//! transient failure is negatively acknowledged with a delay from [`Backoff`](crate::Backoff) by delivery count
//! (JetStream's own redelivery), so nothing is acknowledged that was not stored (shared case
//! C27); a message that keeps failing goes to the consumer's dead-letter table. A message whose
//! ack was lost is delivered again and recognised by the inbox.
//!
//! A fetched batch is applied in `concurrency` lanes by partition key
//! ([`deliver_batch`](crate::consumer::deliver_batch)): different keys in parallel, one key's
//! messages in stream order.
//!
//! The runner is the generic one ([`consume`]) over a [`NatsSource`]; it also performs the
//! consumer's [`maintenance`](crate::consumer::maintenance) (operator replays, inbox retention).

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;

use async_nats::jetstream::consumer::{AckPolicy, pull};
use async_nats::jetstream::{self, AckKind};
use futures::StreamExt;
use tokio_util::sync::CancellationToken;

use crate::consumer::source::{
    ConsumeOptions, Delivery, Envelope, Settle, Source, SourceError, consume,
};
use crate::consumer::{ConsumerMetrics, RunnerSettings};
use crate::error::ConfigError;
use crate::inbox::{Handler, Inbox, InboxBackend};
use crate::message::Headers;

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
    /// Lanes, retries, dead letters, confirmations and inbox upkeep: the settings every
    /// runner shares ([`RunnerSettings`], with its defaults).
    pub runner: RunnerSettings,
    /// How long the server waits for an ack before redelivering. Default 30 s.
    pub ack_wait: Duration,
}

crate::consumer::with_confirmations!(NatsConsumerConfig);

impl NatsConsumerConfig {
    /// Settings with the defaults.
    pub fn new(stream: impl Into<String>, durable: impl Into<String>) -> Self {
        NatsConsumerConfig {
            stream: stream.into(),
            durable: durable.into(),
            filter_subject: None,
            batch: 100,
            runner: RunnerSettings::default(),
            ack_wait: Duration::from_secs(30),
        }
    }
}

/// Acknowledgements of one settled batch in flight at once.
const SETTLE_IN_FLIGHT: usize = 256;

/// How long the server holds a pull request open when it has no message for it.
const FETCH_EXPIRES: Duration = Duration::from_millis(500);

/// Whether a JetStream API error is a passing state of the cluster (no meta or stream leader,
/// placement in progress, a member change) rather than a refusal of the set-up: the consumer
/// retries it with backoff instead of stopping with a [`ConfigError`]. Codes from the server's
/// `server/errors.json` (as named by async-nats' `ErrorCode`).
fn transient(error: &async_nats::jetstream::Error) -> bool {
    use async_nats::jetstream::ErrorCode;
    [
        ErrorCode::CLUSTER_INCOMPLETE,
        ErrorCode::CLUSTER_NO_PEERS,
        ErrorCode::CLUSTER_NOT_ASSIGNED,
        ErrorCode::CLUSTER_NOT_AVAILABLE,
        ErrorCode::CLUSTER_NOT_LEADER,
        ErrorCode::CLUSTER_PEER_NOT_MEMBER,
        ErrorCode::CLUSTER_SERVER_NOT_MEMBER,
        ErrorCode::CLUSTER_SERVER_MEMBER_CHANGE_INFLIGHT,
        ErrorCode::INSUFFICIENT_RESOURCES,
    ]
    .contains(&error.error_code())
        || error.code() >= 500
}

/// A set-up error: refused by the server (`refused`) → a [`ConfigError`] naming `field`, which
/// stops a runner at its first set-up; otherwise lost, retried with backoff.
fn set_up_error(refused: bool, field: &str, reason: String) -> SourceError {
    if refused {
        ConfigError::new(field, reason).into()
    } else {
        SourceError::Lost(reason)
    }
}

/// The JetStream [`Source`]: a durable pull consumer on `config.stream`.
pub struct NatsSource {
    js: jetstream::Context,
    config: NatsConsumerConfig,
    consumer: Option<jetstream::consumer::Consumer<pull::Config>>,
}

impl NatsSource {
    /// A source for `config` over `js` (nothing is contacted until [`Source::open`]).
    pub fn new(js: jetstream::Context, config: NatsConsumerConfig) -> Self {
        NatsSource {
            js,
            config,
            consumer: None,
        }
    }
}

#[async_trait]
impl Source for NatsSource {
    type Token = jetstream::Message;

    fn describe(&self) -> String {
        format!(
            "JetStream stream {}, durable {}",
            self.config.stream, self.config.durable
        )
    }

    async fn open(&mut self) -> Result<(), SourceError> {
        use async_nats::jetstream::context::GetStreamErrorKind;
        use async_nats::jetstream::stream::ConsumerErrorKind;
        let c = &self.config;
        let stream = self.js.get_stream(&c.stream).await.map_err(|e| {
            let refused = match e.kind() {
                GetStreamErrorKind::JetStream(api) => !transient(&api),
                GetStreamErrorKind::EmptyName | GetStreamErrorKind::InvalidStreamName => true,
                _ => false,
            };
            set_up_error(
                refused,
                "stream",
                format!("cannot look up stream {}: {e}", c.stream),
            )
        })?;
        let consumer = stream
            .get_or_create_consumer(
                &c.durable,
                pull::Config {
                    durable_name: Some(c.durable.clone()),
                    ack_policy: AckPolicy::Explicit,
                    ack_wait: c.ack_wait,
                    filter_subject: c.filter_subject.clone().unwrap_or_default(),
                    max_ack_pending: 10_000,
                    ..Default::default()
                },
            )
            .await
            .map_err(|e| {
                let refused = match e.kind() {
                    ConsumerErrorKind::JetStream(api) => !transient(&api),
                    ConsumerErrorKind::InvalidConsumerType | ConsumerErrorKind::InvalidName => true,
                    _ => false,
                };
                set_up_error(
                    refused,
                    "durable",
                    format!("cannot create consumer {}: {e}", c.durable),
                )
            })?;
        self.consumer = Some(consumer);
        Ok(())
    }

    async fn fetch(&mut self, max: usize) -> Result<Vec<Delivery<Self::Token>>, SourceError> {
        let consumer = self
            .consumer
            .as_ref()
            .ok_or_else(|| SourceError::Lost("not open".into()))?;
        let mut messages = consumer
            .fetch()
            .max_messages(max)
            .expires(FETCH_EXPIRES)
            .messages()
            .await
            .map_err(|e| SourceError::Lost(format!("JetStream fetch failed: {e}")))?;
        let mut out = Vec::with_capacity(max);
        while let Some(msg) = messages.next().await {
            let msg = match msg {
                Ok(m) => m,
                // A status in place of messages: the consumer has no leader (503), was deleted
                // (409), ... With nothing fetched it is a lost consumer, opened again after a
                // backoff; otherwise the batch is delivered and the next pull will tell.
                Err(e) if out.is_empty() => {
                    return Err(SourceError::Lost(format!("JetStream pull failed: {e}")));
                }
                Err(e) => {
                    tracing::warn!(error = %e, "JetStream pull ended with an error");
                    break;
                }
            };
            let delivered = msg.info().map(|i| i.delivered).unwrap_or(1).max(1) as u32;
            let envelope = Envelope {
                headers: received_headers(msg.headers.as_ref()),
                payload: msg.payload.to_vec(),
                delivery_count: delivered,
                origin: format!("subject {}", msg.subject),
            };
            out.push(Delivery {
                token: msg,
                envelope,
            });
        }
        Ok(out)
    }

    async fn settle(
        &mut self,
        batch: Vec<(Delivery<Self::Token>, Settle)>,
    ) -> Result<(), SourceError> {
        // Each acknowledgement waits for the server's confirmation (`double_ack`, a round
        // trip): up to SETTLE_IN_FLIGHT of them at once, not one after the other (one by one,
        // the round trips bounded a consumer to ~8,000 messages/s on loopback).
        futures::stream::iter(batch)
            .map(|(d, s)| async move {
                let msg = d.token;
                match s {
                    Settle::Ack => {
                        if let Err(e) = msg.double_ack().await {
                            // The verdict is committed; a redelivery will be recognised as a
                            // duplicate.
                            tracing::warn!(error = %e, origin = %d.envelope.origin, "ack failed after commit");
                        }
                    }
                    Settle::Retry(delay) => {
                        let _ = msg.ack_with(AckKind::Nak(Some(delay))).await;
                    }
                    Settle::Reject(_) => {
                        let _ = msg.ack_with(AckKind::Term).await;
                    }
                }
            })
            .buffer_unordered(SETTLE_IN_FLIGHT)
            .collect::<Vec<()>>()
            .await;
        Ok(())
    }
}

/// The headers of a received JetStream message: each name with its first value (a name the
/// server delivered several times keeps the first, as the relay writes each once).
pub(crate) fn received_headers(h: Option<&async_nats::HeaderMap>) -> Headers {
    let mut headers = Headers::new();
    if let Some(h) = h {
        for (k, vs) in h.iter() {
            if let Some(v) = vs.first() {
                headers.insert(k.to_string(), v.to_string());
            }
        }
    }
    headers
}

/// Run the consumer until `cancel`: [`consume`] over a [`NatsSource`].
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
    let options = ConsumeOptions::new(&config.runner, config.batch);
    consume(
        NatsSource::new(js, config),
        inbox,
        handler,
        options,
        metrics,
        cancel,
    )
    .await
}
