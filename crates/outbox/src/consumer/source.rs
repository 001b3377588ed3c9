//! The consuming seam: a [`Source`] per broker, one generic runner over it.
//!
//! A broker's part of consuming is small: connect and set up ([`Source::open`]), wait for a batch
//! of deliveries ([`Source::fetch`]) and settle each one ([`Source::settle`]: acknowledge,
//! redeliver after a delay, or reject a message that can never be applied). Everything else is
//! the same on every broker and lives here once, in [`run`]:
//! - reconnecting with backoff when the connection is lost (the broker redelivers what was not
//!   settled), and failing fast when the very first set-up is refused (a missing stream or
//!   queue is a configuration error, named by its field);
//! - handing each fetched batch to a [`BatchHandler`] and settling what it decided, in one call;
//! - stopping at `cancel` between batches (a batch being applied is finished and settled first).
//!
//! Two batch handlers exist: [`InboxHandler`] (decode, lanes by partition key, inbox
//! transaction, retries, dead letters, confirmations; see [`deliver`](super::deliver)) for the
//! consumer runners, and the producer's confirmation listeners, which apply a batch of
//! confirmations with [`Store::apply_confirmations`](crate::Store::apply_confirmations)
//! ([`crate::confirm`]). [`consume`] runs an [`InboxHandler`] with the consumer's maintenance
//! (operator replays, inbox retention) in a task that is stopped and joined when it returns.
//!
//! The design follows River's driver seam (a small interface per backend, one executor above it)
//! and vector's sources (a source yields events, acknowledgement flows back to it).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use async_trait::async_trait;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::{
    ConsumerMetrics, DeliveryPolicy, Disposition, RunnerSettings, deliver_batch, maintenance,
};
use crate::error::ConfigError;
use crate::inbox::{Handler, Inbox, InboxBackend};
use crate::message::{Headers, InboundMessage};
use crate::retry::Backoff;

/// One message as a broker delivered it, before it is decoded.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Envelope {
    /// The message's headers (the broker's header map, or a Redis entry's fields but the
    /// payload), values as UTF-8 text.
    pub headers: Headers,
    /// The payload bytes.
    pub payload: Vec<u8>,
    /// How many times the broker delivered this message to this consumer, 1 the first time
    /// (the broker's count where it keeps one, else the runner's own).
    pub delivery_count: u32,
    /// Where it came from, for logs: subject, queue, stream and entry id, topic and offset.
    pub origin: String,
}

/// A fetched message and the broker's handle to settle it.
#[derive(Debug)]
pub struct Delivery<T> {
    /// What [`Source::settle`] needs to acknowledge or redeliver this message (an acker, an
    /// entry id, an offset).
    pub token: T,
    /// The message.
    pub envelope: Envelope,
}

/// What to do with the broker's copy of a message once its batch was handled.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Settle {
    /// Acknowledge: the message is done (applied, recorded or dead-lettered).
    Ack,
    /// Do not acknowledge; have the broker deliver it again after this delay (by its own
    /// mechanism where it has one: a NAK with delay, a retry queue, a delay level, a paused
    /// partition, a pending entry claimed back).
    Retry(Duration),
    /// The message can never be applied (no readable outbox headers): take it out of the way
    /// without requeueing (terminate, reject to the queue's dead-letter exchange, acknowledge
    /// and log). The text says why.
    Reject(String),
}

/// Why a [`Source`] call failed.
#[derive(Debug)]
pub enum SourceError {
    /// The set-up was refused for a reason a retry does not fix by itself (a missing stream,
    /// queue or topic; a refused declaration; bad credentials): returned by [`run`] when it
    /// happens on the first [`Source::open`], logged and retried with backoff afterwards.
    Config(ConfigError),
    /// The connection or the consumer was lost; [`run`] reconnects with backoff.
    Lost(String),
}

impl std::fmt::Display for SourceError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SourceError::Config(e) => write!(f, "{e}"),
            SourceError::Lost(reason) => write!(f, "connection lost: {reason}"),
        }
    }
}

impl From<ConfigError> for SourceError {
    fn from(e: ConfigError) -> Self {
        SourceError::Config(e)
    }
}

/// A broker's consuming side: what [`run`] needs from it.
///
/// Implemented per broker in [`crate::consumer`] (one module each). A source owns its connection;
/// [`run`] calls [`open`](Source::open) before the first fetch and again after any
/// [`SourceError::Lost`].
#[async_trait]
pub trait Source: Send {
    /// What settling one delivery needs.
    type Token: Send + Sync;

    /// What this source consumes, for logs (`stream orders, durable inventory`).
    fn describe(&self) -> String;

    /// Connect (or reconnect) and set up: declare or check the stream, queue, group or
    /// subscription.
    ///
    /// # Errors
    /// [`SourceError::Config`] naming the field when the set-up is refused;
    /// [`SourceError::Lost`] when the broker cannot be reached.
    async fn open(&mut self) -> Result<(), SourceError>;

    /// Wait for deliveries and return up to `max` of them; an empty batch after the source's
    /// own wait (a fetch expiry, a block timeout) lets [`run`] check for cancellation.
    ///
    /// # Errors
    /// [`SourceError::Lost`] when the connection or consumer is gone.
    async fn fetch(&mut self, max: usize) -> Result<Vec<Delivery<Self::Token>>, SourceError>;

    /// Settle a handled batch, each delivery with its decision, in the order fetched.
    ///
    /// # Errors
    /// [`SourceError::Lost`] when the connection broke while settling: what was not settled
    /// is delivered again by the broker (recognised by the inbox).
    async fn settle(
        &mut self,
        batch: Vec<(Delivery<Self::Token>, Settle)>,
    ) -> Result<(), SourceError>;

    /// Called once when [`run`] stops: commit what is pending, leave the group, shut the
    /// client down. Default: nothing (dropping the source closes its connection).
    async fn close(&mut self) {}
}

/// Decides what becomes of each message of a fetched batch.
#[async_trait]
pub trait BatchHandler: Send + Sync {
    /// Handle `batch` and return one [`Settle`] per message, in the same order.
    async fn handle(&self, batch: &[&Envelope]) -> Vec<Settle>;

    /// Called by [`run`] each time the source was lost (or its set-up refused, once it had
    /// started), before the backoff and the new [`Source::open`]. Default: nothing (the consumer
    /// runners' [`InboxHandler`] counts it in [`ConsumerMetrics::reconnects`]).
    fn lost(&self) {}
}

/// How [`run`] drives a source.
#[derive(Debug, Clone)]
pub struct RunOptions {
    /// Most messages per fetch. Default 100.
    pub batch: usize,
    /// Delay before reconnecting after a lost connection or a refused set-up, by consecutive
    /// failures (capped at the 8th step). Default 200 ms, ×2, ≤ 10 s.
    pub reconnect: Backoff,
}

impl Default for RunOptions {
    fn default() -> Self {
        RunOptions {
            batch: 100,
            reconnect: Backoff {
                base: Duration::from_millis(200),
                factor: 2.0,
                max: Duration::from_secs(10),
                jitter: 0.2,
            },
        }
    }
}

/// Drive `source` until `cancel`: open, fetch a batch, have `handler` decide, settle; reconnect
/// with backoff when the connection is lost.
///
/// # Errors
/// The [`ConfigError`] of a [`SourceError::Config`] returned by the first
/// [`Source::open`]. After the source was open once, every error is logged and retried.
pub async fn run<S, B>(
    mut source: S,
    handler: &B,
    options: &RunOptions,
    cancel: &CancellationToken,
) -> Result<(), ConfigError>
where
    S: Source,
    B: BatchHandler + ?Sized,
{
    let mut started = false;
    let mut open = false;
    let mut failures = 0u32;
    let what = source.describe();
    while !cancel.is_cancelled() {
        let step = async {
            if !open {
                source.open().await?;
                open = true;
                if !started {
                    tracing::info!(source = %what, "consumer started");
                }
                started = true;
            }
            let batch = source.fetch(options.batch.max(1)).await?;
            Ok::<_, SourceError>(batch)
        };
        let fetched = tokio::select! {
            _ = cancel.cancelled() => break,
            r = step => r,
        };
        let error = match fetched {
            Ok(batch) if batch.is_empty() => continue,
            Ok(batch) => {
                failures = 0;
                let envelopes: Vec<&Envelope> = batch.iter().map(|d| &d.envelope).collect();
                let decisions = handler.handle(&envelopes).await;
                debug_assert_eq!(decisions.len(), batch.len());
                let settled = batch.into_iter().zip(decisions).collect();
                match source.settle(settled).await {
                    Ok(()) => continue,
                    Err(e) => e,
                }
            }
            Err(e) => e,
        };
        match error {
            SourceError::Config(e) if !started => {
                source.close().await;
                return Err(e);
            }
            SourceError::Config(e) => {
                tracing::error!(error = %e, source = %what, "consumer set-up refused; retrying")
            }
            SourceError::Lost(reason) => {
                tracing::warn!(reason, source = %what, "consumer lost its connection; reconnecting")
            }
        }
        handler.lost();
        open = false;
        failures = failures.saturating_add(1);
        tokio::select! {
            _ = cancel.cancelled() => break,
            _ = tokio::time::sleep(options.reconnect.delay(failures.min(8))) => {}
        }
    }
    source.close().await;
    Ok(())
}

/// The consumer runners' [`BatchHandler`]: decode each message (one without readable outbox
/// headers is rejected and counted in [`ConsumerMetrics::malformed`]), apply the batch through
/// the inbox in `lanes` by partition key ([`deliver_batch`]), and map each
/// [`Disposition`] to a [`Settle`].
pub struct InboxHandler<DB: InboxBackend, H: Handler<DB> + ?Sized> {
    /// The consumer's inbox.
    pub inbox: Inbox<DB>,
    /// The application's handler.
    pub handler: Arc<H>,
    /// Concurrent lanes by partition key (1 = sequential).
    pub lanes: usize,
    /// Retries, dead letters and confirmations.
    pub policy: DeliveryPolicy,
    /// The runner's counters.
    pub metrics: Arc<ConsumerMetrics>,
}

#[async_trait]
impl<DB, H> BatchHandler for InboxHandler<DB, H>
where
    DB: InboxBackend,
    H: Handler<DB> + ?Sized,
{
    fn lost(&self) {
        self.metrics.reconnects.fetch_add(1, Ordering::Relaxed);
    }

    async fn handle(&self, batch: &[&Envelope]) -> Vec<Settle> {
        let mut out: Vec<Option<Settle>> = vec![None; batch.len()];
        let mut inbound = Vec::with_capacity(batch.len());
        let mut at = Vec::with_capacity(batch.len());
        for (i, e) in batch.iter().enumerate() {
            match InboundMessage::from_wire(
                e.headers.clone(),
                e.payload.clone(),
                e.delivery_count.max(1),
            ) {
                Ok(m) => {
                    inbound.push(m);
                    at.push(i);
                }
                Err(reason) => {
                    self.metrics.malformed.fetch_add(1, Ordering::Relaxed);
                    tracing::error!(origin = %e.origin, reason, "message without outbox headers; rejecting it");
                    out[i] = Some(Settle::Reject(reason));
                }
            }
        }
        if !inbound.is_empty() {
            let decided = deliver_batch(
                &self.inbox,
                self.handler.as_ref(),
                &inbound,
                self.lanes,
                &self.policy,
                &self.metrics,
            )
            .await;
            for (i, d) in at.into_iter().zip(decided) {
                out[i] = Some(match d {
                    Disposition::Ack(_) => Settle::Ack,
                    Disposition::Retry(delay) => Settle::Retry(delay),
                });
            }
        }
        out.into_iter()
            .map(|s| s.unwrap_or(Settle::Retry(Duration::ZERO)))
            .collect()
    }
}

/// How [`consume`] drives a source: the fetch and reconnection settings, and the settings every
/// runner shares.
#[derive(Debug, Clone, Default)]
pub struct ConsumeOptions {
    /// Driving the source: batch size and reconnect backoff.
    pub run: RunOptions,
    /// Lanes, retries, dead letters, confirmations, retention and maintenance.
    pub runner: RunnerSettings,
}

impl ConsumeOptions {
    /// The options of a broker config's `runner` settings and batch size (messages per fetch):
    /// its `retry` backoff also paces reconnections.
    pub fn new(runner: &RunnerSettings, batch: usize) -> Self {
        ConsumeOptions {
            run: RunOptions {
                batch,
                reconnect: runner.retry,
            },
            runner: runner.clone(),
        }
    }
}

/// A broker's consumer settings: what [`run`](crate::consumer::run) needs to build that
/// broker's [`Source`] and drive it. Implemented by each broker's consumer config
/// (`KafkaConsumerConfig`, `RabbitMqConsumerConfig`, …; NATS JetStream's runner takes the
/// caller's client: `consumer::nats::run(js, config, …)`).
pub trait SourceConfig: Send + Sized {
    /// The broker's source.
    type Source: Source;

    /// The runner settings and the batch size (messages per fetch) of these settings.
    fn options(&self) -> ConsumeOptions;

    /// Build the source from these settings, without connecting (the runner connects and
    /// reconnects).
    ///
    /// # Errors
    /// [`ConfigError`] naming the first invalid field.
    fn into_source(self, metrics: &Arc<ConsumerMetrics>) -> Result<Self::Source, ConfigError>;
}

/// The generic consumer runner: drive `source` with an [`InboxHandler`] until `cancel`, with
/// the consumer's [`maintenance`] in a task that is stopped and joined before this returns.
///
/// # Errors
/// [`ConfigError`] naming a `runner.*` field ([`RunnerSettings::validate`]) before anything
/// starts; else as [`run`]: the first set-up's [`ConfigError`].
pub async fn consume<S, DB, H>(
    source: S,
    inbox: Inbox<DB>,
    handler: Arc<H>,
    options: ConsumeOptions,
    metrics: Arc<ConsumerMetrics>,
    cancel: CancellationToken,
) -> Result<(), ConfigError>
where
    S: Source,
    DB: InboxBackend,
    H: Handler<DB> + ?Sized,
{
    options.runner.validate()?;
    let tasks = TaskTracker::new();
    let background = cancel.child_token();
    let policy = options.runner.policy();
    tasks.spawn(maintenance(
        inbox.clone(),
        handler.clone(),
        policy.clone(),
        options.runner.dedup_window,
        options.runner.maintenance_interval,
        metrics.clone(),
        background.clone(),
    ));
    tasks.close();
    let handler = InboxHandler {
        inbox,
        handler,
        lanes: options.runner.concurrency,
        policy,
        metrics,
    };
    let result = run(source, &handler, &options.run, &cancel).await;
    background.cancel();
    tasks.wait().await;
    result
}
