//! Consumer runners: receive from a broker, apply through an [`Inbox`](crate::Inbox), acknowledge
//! only after the inbox transaction committed, and confirm the verdict to the producer.
//!
//! # One runner, a source per broker
//! Each broker module implements a [`Source`](source::Source) (open, fetch a batch, settle each
//! delivery: ack, retry after a delay, reject) and its `run` is the one generic runner,
//! [`source::consume`], over it: reconnection with backoff, decoding (malformed input rejected
//! and counted), lanes by partition key, the inbox transaction, retries, dead letters,
//! confirmations, and the maintenance task (operator replays, inbox retention), joined when the
//! runner stops. The producer's confirmation listeners are the same runner over the same
//! sources with [`ConfirmationHandler`](crate::confirm::ConfirmationHandler) as the batch
//! handler. The webhook receiver is the one exception: HTTP is request/response, so each request
//! goes through [`deliver`] and the answer is the settlement (`200`/`503`/`400`).
//!
//! Every runner treats a delivery the same way ([`deliver`]):
//! - applied, rejected by the handler, or a duplicate → acknowledge, and send the recorded
//!   verdict as a confirmation when the message names a reply destination (`outbox-reply-to`);
//! - transient handler failure → do not acknowledge; redeliver after a backoff by delivery count
//!   (the broker's own mechanism where it has one), until `max_deliveries`;
//! - permanent handler failure, or a transient one at `max_deliveries` → the consumer's
//!   dead-letter table, a `Rejected` confirmation, acknowledge, move on;
//! - a handler that panics → contained, counted as a transient failure (so it is dead-lettered at
//!   `max_deliveries`), the runner goes on;
//! - the inbox's own database failing → do not acknowledge, redeliver later; a database outage
//!   never dead-letters a message (shared case C27).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use futures::FutureExt;
use tracing::Instrument;

use crate::error::{HandlerError, InboxError, TransportError};
use crate::histogram::{Histogram, Seconds};
use crate::inbox::{BatchOutcome, Handler, Inbox, InboxBackend, Processed};
use crate::message::InboundMessage;
use crate::retry::Backoff;
use crate::verdict::{Confirmation, ConfirmationSender, HEADER_REPLY_TO, Verdict};

#[cfg(feature = "kafka")]
pub mod kafka;
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
pub mod source;
#[cfg(feature = "webhook")]
pub mod webhook;

/// Run a consumer until `cancel`: the generic runner ([`source::consume`]: lanes, the inbox
/// transaction, retries, dead letters, confirmations, maintenance) over the source that
/// `config` builds; the config's type picks the broker (`KafkaConsumerConfig`,
/// `RabbitMqConsumerConfig`, `RedisConsumerConfig`, `MqttConsumerConfig`,
/// `RocketMqConsumerConfig`; each broker module re-exports this as its `run`).
///
/// # Errors
/// [`ConfigError`](crate::ConfigError) naming the field when the settings are invalid or the
/// first set-up fails (each config's [`SourceConfig`](source::SourceConfig) implementation says
/// which). Later errors are logged and the runner reconnects with backoff.
pub async fn run<C, DB, H>(
    config: C,
    inbox: Inbox<DB>,
    handler: Arc<H>,
    metrics: Arc<ConsumerMetrics>,
    cancel: CancellationToken,
) -> Result<(), crate::error::ConfigError>
where
    C: source::SourceConfig,
    DB: InboxBackend,
    H: Handler<DB> + ?Sized,
{
    let options = config.options();
    let source = config.into_source(&metrics)?;
    source::consume(source, inbox, handler, options, metrics, cancel).await
}

/// Counters of a consumer runner.
#[derive(Debug, Default)]
pub struct ConsumerMetrics {
    /// Messages applied (first delivery).
    pub applied: AtomicU64,
    /// Messages the handler rejected (business refusal), recorded and confirmed as rejected.
    pub rejected: AtomicU64,
    /// Copies recognised by the inbox and acknowledged without running the handler.
    pub duplicates: AtomicU64,
    /// Handler or inbox failures (message not acknowledged, redelivered).
    pub failures: AtomicU64,
    /// Messages moved to the consumer's dead-letter table.
    pub dead_lettered: AtomicU64,
    /// Messages without a readable message id, terminated and logged.
    pub malformed: AtomicU64,
    /// Confirmations sent.
    pub confirmations_sent: AtomicU64,
    /// Confirmations that could not be sent (the producer's check-back recovers them).
    pub confirmation_failures: AtomicU64,
    /// Dead letters replayed on an operator's request.
    pub replayed: AtomicU64,
    /// Deliveries whose message was gone from the broker (e.g. a Redis stream entry trimmed
    /// while pending, shared case C38): logged, acknowledged and counted here.
    pub lost: AtomicU64,
    /// Inbox transactions that committed a batch of several messages together
    /// ([`RunnerSettings::inbox_batch`] above 1).
    pub inbox_batches: AtomicU64,
    /// Batches rolled back because one message's handler failed, rejected or panicked; the
    /// messages before it were applied again as a batch and it alone.
    pub inbox_batch_splits: AtomicU64,
    /// Times the runner lost its broker connection or consumer (or had its set-up refused
    /// after the first) and opened it again after a backoff.
    pub reconnects: AtomicU64,
    /// Seconds each delivery spent in the inbox: the duplicate check, the handler and the
    /// commit of the inbox transaction (a panicking handler included; for a batch, the whole
    /// batch's transaction, once per message).
    pub handler_duration: Histogram<Seconds>,
}

/// Settings every broker's consumer runner shares: the `runner` field of each broker's config
/// ([`NatsConsumerConfig`](nats::NatsConsumerConfig) and the others). [`Default`] gives the
/// defaults listed on each field.
#[derive(Clone, derive_more::Debug)]
pub struct RunnerSettings {
    /// Messages of one fetched batch applied concurrently, in lanes by partition key so each
    /// key's messages stay in order ([`deliver_batch`]). Default 1; at least 1.
    pub concurrency: usize,
    /// Most messages of a lane applied in one inbox transaction ([`Inbox::process_batch`]):
    /// one commit for the batch instead of one per message. Default 1 (a transaction per
    /// message); at least 1. Above 1, a message whose handler fails, rejects or panics rolls
    /// its batch back, and the messages before it are applied again as a batch (their handlers
    /// run a second time, the first run's effects rolled back), then it alone, then the rest:
    /// each message's outcome is the same as with 1, and per-key order is kept.
    pub inbox_batch: usize,
    /// Delay before a message whose handler failed is delivered again, by delivery count (each
    /// broker's own redelivery where it has one); also paces reconnections. Default 500 ms, ×2,
    /// ≤ 60 s, jitter 0.2.
    pub retry: Backoff,
    /// Deliveries before a transiently failing message is dead-lettered. Default 5; at least 1.
    pub max_deliveries: u32,
    /// Where confirmations go out (to the `outbox-reply-to` of each message); `None` sends none.
    /// Default none.
    #[debug("{}", confirmations.is_some())]
    pub confirmations: Option<Arc<dyn ConfirmationSender>>,
    /// Inbox records older than this are deleted by the maintenance task. Default 7 days;
    /// `None` keeps them.
    pub dedup_window: Option<Duration>,
    /// Period of the maintenance task (operator replays, inbox retention). Default 2 s.
    pub maintenance_interval: Duration,
}

impl Default for RunnerSettings {
    fn default() -> Self {
        let d = DeliveryPolicy::default();
        RunnerSettings {
            concurrency: 1,
            inbox_batch: d.inbox_batch,
            retry: d.retry,
            max_deliveries: d.max_deliveries,
            confirmations: None,
            dedup_window: Some(Duration::from_secs(7 * 24 * 3600)),
            maintenance_interval: Duration::from_secs(2),
        }
    }
}

impl RunnerSettings {
    /// What [`deliver`] needs of these settings.
    pub fn policy(&self) -> DeliveryPolicy {
        DeliveryPolicy {
            max_deliveries: self.max_deliveries,
            retry: self.retry,
            confirmations: self.confirmations.clone(),
            inbox_batch: self.inbox_batch,
        }
    }

    /// Check the settings.
    ///
    /// # Errors
    /// [`ConfigError`](crate::ConfigError) naming `runner.concurrency`, `runner.inbox_batch`,
    /// `runner.max_deliveries` or `runner.maintenance_interval` when zero.
    pub fn validate(&self) -> Result<(), crate::error::ConfigError> {
        use crate::error::ConfigError;
        ConfigError::invalid_if(
            self.concurrency == 0,
            "runner.concurrency",
            "must be at least 1",
        )?;
        ConfigError::invalid_if(
            self.inbox_batch == 0,
            "runner.inbox_batch",
            "must be at least 1",
        )?;
        ConfigError::invalid_if(
            self.max_deliveries == 0,
            "runner.max_deliveries",
            "must be at least 1",
        )?;
        ConfigError::invalid_if(
            self.maintenance_interval.is_zero(),
            "runner.maintenance_interval",
            "must be more than 0 s",
        )?;
        Ok(())
    }
}

/// The builder method every broker's consumer config has: `with_confirmations(sender)` sets
/// its `runner.confirmations` ([`RunnerSettings::confirmations`]).
// Used by the broker consumers: unused when no broker feature is on.
#[allow(unused_macros)]
macro_rules! with_confirmations {
    ($config:ty) => {
        impl $config {
            /// Send confirmations through `sender`.
            pub fn with_confirmations(
                mut self,
                sender: ::std::sync::Arc<dyn $crate::verdict::ConfirmationSender>,
            ) -> Self {
                self.runner.confirmations = Some(sender);
                self
            }
        }
    };
}
#[allow(unused_imports)]
pub(crate) use with_confirmations;

/// What [`deliver`] needs: dead letters, retries and confirmations ([`RunnerSettings::policy`]
/// of a runner; the webhook receiver takes one directly).
#[derive(Clone, derive_more::Debug)]
pub struct DeliveryPolicy {
    /// Deliveries before a transiently failing message is dead-lettered. Default 5.
    pub max_deliveries: u32,
    /// Delay before redelivering a failed message, by delivery count. Default 500 ms, ×2, ≤ 60 s.
    pub retry: Backoff,
    /// Where confirmations go out; `None` sends none. Default none.
    #[debug("{}", confirmations.is_some())]
    pub confirmations: Option<Arc<dyn ConfirmationSender>>,
    /// Most messages of a lane in one inbox transaction ([`deliver_batch`];
    /// [`RunnerSettings::inbox_batch`]); for the webhook receiver, above 1 turns on group
    /// commit of concurrent requests ([`webhook`]). Default 1; 0 is treated as 1.
    pub inbox_batch: usize,
}

impl Default for DeliveryPolicy {
    fn default() -> Self {
        DeliveryPolicy {
            max_deliveries: 5,
            retry: Backoff {
                base: Duration::from_millis(500),
                factor: 2.0,
                max: Duration::from_secs(60),
                jitter: 0.2,
            },
            confirmations: None,
            inbox_batch: 1,
        }
    }
}

/// What a runner does with the broker's copy of a message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Disposition {
    /// Acknowledge: the verdict is recorded (and was confirmed when asked for).
    Ack(Verdict),
    /// Do not acknowledge; redeliver after this delay.
    Retry(Duration),
}

/// Process one delivery of `msg` (its `delivery_count`-th) through `inbox` and `handler` and
/// decide its disposition, as the module docs describe. Sends the confirmation when the message
/// asks for one and `policy.confirmations` is set.
pub async fn deliver<DB, H>(
    inbox: &Inbox<DB>,
    handler: &H,
    msg: &InboundMessage,
    policy: &DeliveryPolicy,
    metrics: &ConsumerMetrics,
) -> Disposition
where
    DB: InboxBackend,
    H: Handler<DB> + ?Sized,
{
    // A traced message (feature `otel`): the handler, the inbox and the confirmation run in
    // its `outbox.consume` span (crate::otel).
    let span = crate::otel::consume_span(msg, inbox.consumer());
    let d = async {
        let count = |c: &AtomicU64| {
            c.fetch_add(1, Ordering::Relaxed);
        };
        let deliveries = msg.delivery_count.max(1);
        // A panicking handler (or a client it calls) is contained: its transaction is rolled
        // back as the future unwinds, and the panic counts as a transient failure of this
        // message, so it is redelivered and dead-lettered at `max_deliveries` while the runner
        // and the other messages go on.
        let started = std::time::Instant::now();
        let processed = std::panic::AssertUnwindSafe(inbox.process(msg, handler))
            .catch_unwind()
            .await
            .unwrap_or_else(|panic| {
                Err(InboxError::Handler(HandlerError::transient(format!(
                    "the handler panicked: {}",
                    crate::inbox::panic_text(panic.as_ref())
                ))))
            });
        metrics.handler_duration.observe_duration(started.elapsed());
        let verdict = match processed {
            Ok(Processed::Applied) => {
                count(&metrics.applied);
                Verdict::Processed
            }
            Ok(Processed::Rejected { reason }) => {
                count(&metrics.rejected);
                Verdict::Rejected { reason }
            }
            Ok(Processed::Duplicate) => {
                count(&metrics.duplicates);
                match inbox.verdict(msg.message_id).await {
                    Ok(Some(v)) => v,
                    Ok(None) => Verdict::Processed,
                    Err(e) => {
                        tracing::warn!(error = %e, "verdict lookup failed; redelivering");
                        return Disposition::Retry(policy.retry.delay(deliveries));
                    }
                }
            }
            Err(InboxError::Handler(e)) if !e.is_permanent() && deliveries < policy.max_deliveries => {
                count(&metrics.failures);
                tracing::warn!(error = %e, message_id = %msg.message_id, deliveries, "handler failed; redelivering later");
                return Disposition::Retry(policy.retry.delay(deliveries));
            }
            Err(InboxError::Handler(e)) => {
                count(&metrics.failures);
                match inbox.dead_letter(msg, &e.to_string(), deliveries).await {
                    Ok(v) => {
                        count(&metrics.dead_lettered);
                        tracing::error!(error = %e, message_id = %msg.message_id, deliveries, "message dead-lettered by the consumer");
                        v
                    }
                    Err(db) => {
                        tracing::warn!(error = %db, "dead-lettering failed; redelivering later");
                        return Disposition::Retry(policy.retry.delay(deliveries));
                    }
                }
            }
            Err(e) => {
                count(&metrics.failures);
                tracing::warn!(error = %e, message_id = %msg.message_id, "inbox failed; not acknowledging");
                return Disposition::Retry(policy.retry.delay(deliveries));
            }
        };
        confirm(inbox.consumer(), msg, &verdict, policy, metrics).await;
        Disposition::Ack(verdict)
    }
    .instrument(span.clone())
    .await;
    if !span.is_disabled() {
        let (outcome, error) = match &d {
            Disposition::Ack(Verdict::Processed) => ("processed", false),
            Disposition::Ack(Verdict::Rejected { .. }) => ("rejected", false),
            Disposition::Retry(_) => ("retry", true),
        };
        crate::otel::record_outcome(&span, outcome, error);
    }
    d
}

/// The lane of `msg` among `lanes` concurrent lanes: messages with the same partition key always
/// share a lane (so they are applied in the order the broker delivered them); messages without
/// one are spread by message id. `lanes` of 0 is treated as 1.
pub fn lane_of(msg: &InboundMessage, lanes: usize) -> usize {
    use std::hash::{Hash, Hasher};
    let lanes = lanes.max(1);
    let mut h = std::collections::hash_map::DefaultHasher::new();
    match &msg.partition_key {
        Some(k) => k.hash(&mut h),
        None => msg.message_id.hash(&mut h),
    }
    (h.finish() % lanes as u64) as usize
}

/// Deliver a fetched batch through up to `lanes` concurrent lanes, keeping per-key order, and
/// return one [`Disposition`] per message, in input order.
///
/// Messages are assigned to lanes by [`lane_of`]; each lane delivers its messages in order, the
/// lanes run concurrently. With `policy.inbox_batch` of 1 each message is one [`deliver`]; above
/// 1 a lane applies up to that many messages in one inbox transaction
/// ([`Inbox::process_batch`]), and a batch whose handler failed at one message is applied again
/// up to that message, then the message alone through [`deliver`] (retries, dead letters and
/// rejections as for a single message), then the rest. When a message with a partition key is
/// not applied (its disposition is [`Disposition::Retry`]), the later messages of the same key in
/// the batch are not delivered either and get the same retry delay, so a failing head never lets
/// a later message of its key overtake it. Runners use `lanes` = their configured consumer
/// concurrency (the seeds raise consumer threads to work off a backlog); `lanes` = 1 is strictly
/// sequential.
pub async fn deliver_batch<DB, H>(
    inbox: &Inbox<DB>,
    handler: &H,
    batch: &[InboundMessage],
    lanes: usize,
    policy: &DeliveryPolicy,
    metrics: &ConsumerMetrics,
) -> Vec<Disposition>
where
    DB: InboxBackend,
    H: Handler<DB> + ?Sized,
{
    let lanes = lanes.max(1).min(batch.len().max(1));
    let mut by_lane: Vec<Vec<usize>> = vec![Vec::new(); lanes];
    for (i, m) in batch.iter().enumerate() {
        by_lane[lane_of(m, lanes)].push(i);
    }
    let runs = by_lane.into_iter().map(|indices| async move {
        let mut out = Vec::with_capacity(indices.len());
        // Keys whose earlier message in this batch was not applied, with its retry delay.
        let mut held: Vec<(&str, Duration)> = Vec::new();
        let mut queue: std::collections::VecDeque<usize> = indices.into();
        // Lengths of the next chunks when a batch was split (else `inbox_batch`).
        let mut plan: std::collections::VecDeque<usize> = std::collections::VecDeque::new();
        loop {
            let len = plan.pop_front().unwrap_or(policy.inbox_batch.max(1));
            let mut chunk = Vec::with_capacity(len.min(queue.len()));
            while chunk.len() < len
                && let Some(i) = queue.pop_front()
            {
                let m = &batch[i];
                match m
                    .partition_key
                    .as_deref()
                    .and_then(|k| held.iter().find(|(h, _)| *h == k).map(|(_, delay)| *delay))
                {
                    Some(delay) => out.push((i, Disposition::Retry(delay))),
                    None => chunk.push(i),
                }
            }
            let decided: Vec<(usize, Disposition)> = match chunk[..] {
                [] => break,
                [i] => vec![(i, deliver(inbox, handler, &batch[i], policy, metrics).await)],
                _ => {
                    let msgs: Vec<&InboundMessage> = chunk.iter().map(|&i| &batch[i]).collect();
                    match deliver_together(inbox, handler, &msgs, policy, metrics).await {
                        Ok(ds) => chunk.iter().copied().zip(ds).collect(),
                        Err(split) => {
                            // Back to the front of the queue, to go as `split` says.
                            for &i in chunk.iter().rev() {
                                queue.push_front(i);
                            }
                            for n in split.into_iter().rev() {
                                plan.push_front(n);
                            }
                            continue;
                        }
                    }
                }
            };
            for (i, d) in decided {
                if let (Disposition::Retry(delay), Some(k)) =
                    (&d, batch[i].partition_key.as_deref())
                {
                    held.push((k, *delay));
                }
                out.push((i, d));
            }
        }
        out
    });
    let mut all: Vec<(usize, Disposition)> = futures::future::join_all(runs)
        .await
        .into_iter()
        .flatten()
        .collect();
    all.sort_by_key(|(i, _)| *i);
    all.into_iter().map(|(_, d)| d).collect()
}

/// Apply `msgs` (two or more, in order, none of a held key) in one inbox transaction and decide
/// each one's disposition; or, when the batch did not commit, how to go on: the lengths of the
/// next chunks (the messages before a failing handler's as a batch, then it alone; each alone
/// after a database error, which [`deliver`] retries or redelivers one by one).
async fn deliver_together<DB, H>(
    inbox: &Inbox<DB>,
    handler: &H,
    msgs: &[&InboundMessage],
    policy: &DeliveryPolicy,
    metrics: &ConsumerMetrics,
) -> Result<Vec<Disposition>, Vec<usize>>
where
    DB: InboxBackend,
    H: Handler<DB> + ?Sized,
{
    let started = std::time::Instant::now();
    let processed = match inbox.process_batch(msgs, handler).await {
        Ok(BatchOutcome::Committed(processed)) => processed,
        Ok(BatchOutcome::HandlerFailed { at, error }) => {
            metrics.inbox_batch_splits.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(error = %error, message_id = %msgs[at].message_id, at, batch = msgs.len(), "a handler failed in an inbox batch; applying around it");
            return Err([at, 1].into_iter().filter(|&n| n > 0).collect());
        }
        Err(e) => {
            tracing::warn!(error = %e, batch = msgs.len(), "inbox batch failed; delivering its messages one by one");
            return Err(vec![1; msgs.len()]);
        }
    };
    metrics.inbox_batches.fetch_add(1, Ordering::Relaxed);
    let elapsed = started.elapsed();
    let mut out = Vec::with_capacity(msgs.len());
    let mut to_confirm = Vec::new();
    for (msg, p) in msgs.iter().zip(processed) {
        metrics.handler_duration.observe_duration(elapsed);
        let verdict = match p {
            Processed::Duplicate => {
                metrics.duplicates.fetch_add(1, Ordering::Relaxed);
                match inbox.verdict(msg.message_id).await {
                    Ok(Some(v)) => v,
                    Ok(None) => Verdict::Processed,
                    Err(e) => {
                        tracing::warn!(error = %e, "verdict lookup failed; redelivering");
                        out.push(Disposition::Retry(
                            policy.retry.delay(msg.delivery_count.max(1)),
                        ));
                        continue;
                    }
                }
            }
            Processed::Applied => {
                metrics.applied.fetch_add(1, Ordering::Relaxed);
                Verdict::Processed
            }
            Processed::Rejected { reason } => {
                metrics.rejected.fetch_add(1, Ordering::Relaxed);
                Verdict::Rejected { reason }
            }
        };
        to_confirm.push((*msg, verdict.clone()));
        out.push(Disposition::Ack(verdict));
    }
    confirm_all(inbox.consumer(), &to_confirm, policy, metrics).await;
    Ok(out)
}

/// Send the confirmations of a committed batch that ask for one, with one
/// [`ConfirmationSender::send_all`] per reply destination, concurrently (a batch's messages
/// usually share one: one request or publish round instead of one per message).
async fn confirm_all(
    consumer: &str,
    verdicts: &[(&InboundMessage, Verdict)],
    policy: &DeliveryPolicy,
    metrics: &ConsumerMetrics,
) {
    let Some(sender) = &policy.confirmations else {
        return;
    };
    let mut by_reply_to: Vec<(&str, Vec<Confirmation>)> = Vec::new();
    for (msg, verdict) in verdicts {
        let Some(reply_to) = msg.headers.get(HEADER_REPLY_TO) else {
            continue;
        };
        let mut c = Confirmation::new(msg.message_id, consumer, verdict.clone());
        (c.traceparent, c.tracestate) = crate::otel::current_context();
        match by_reply_to.iter_mut().find(|(r, _)| r == reply_to) {
            Some((_, cs)) => cs.push(c),
            None => by_reply_to.push((reply_to, vec![c])),
        }
    }
    let sends = by_reply_to
        .iter()
        .map(|(reply_to, cs)| async move { (*reply_to, sender.send_all(reply_to, cs).await) });
    for (reply_to, results) in futures::future::join_all(sends).await {
        for r in results {
            count_sent(r, reply_to, metrics);
        }
    }
}

/// Count a confirmation's send in `metrics`, logging a failure (the producer's check-back
/// recovers the confirmation).
fn count_sent(r: Result<(), TransportError>, reply_to: &str, metrics: &ConsumerMetrics) {
    match r {
        Ok(()) => metrics.confirmations_sent.fetch_add(1, Ordering::Relaxed),
        Err(e) => {
            tracing::warn!(error = %e.report(), reply_to, "confirmation not sent; the producer's check-back will ask again");
            metrics
                .confirmation_failures
                .fetch_add(1, Ordering::Relaxed)
        }
    };
}

/// Send `msg`'s confirmation when it asks for one and `policy` has a sender: one
/// [`ConfirmationSender::send`] (a single JSON object on the webhook sender).
async fn confirm(
    consumer: &str,
    msg: &InboundMessage,
    verdict: &Verdict,
    policy: &DeliveryPolicy,
    metrics: &ConsumerMetrics,
) {
    let (Some(sender), Some(reply_to)) = (&policy.confirmations, msg.headers.get(HEADER_REPLY_TO))
    else {
        return;
    };
    let mut c = Confirmation::new(msg.message_id, consumer, verdict.clone());
    (c.traceparent, c.tracestate) = crate::otel::current_context();
    count_sent(sender.send(reply_to, &c).await, reply_to, metrics);
}

/// Consumer maintenance until `cancel`: every `interval`, run the dead letters an operator asked
/// to replay (confirming their new verdict) and delete inbox records older than `dedup_window`
/// (`None` keeps them) in bounded batches. The NATS runner starts it itself; a webhook receiver
/// runs it beside its server.
pub async fn maintenance<DB, H>(
    inbox: Inbox<DB>,
    handler: Arc<H>,
    policy: DeliveryPolicy,
    dedup_window: Option<Duration>,
    interval: Duration,
    metrics: Arc<ConsumerMetrics>,
    cancel: CancellationToken,
) where
    DB: InboxBackend,
    H: Handler<DB> + ?Sized,
{
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(interval) => {}
        }
        match inbox.replay_requested(handler.as_ref(), 100).await {
            Ok(done) => {
                for r in done {
                    metrics.replayed.fetch_add(1, Ordering::Relaxed);
                    match r.result {
                        Ok(v) => confirm(inbox.consumer(), &r.message, &v, &policy, &metrics).await,
                        Err(e) => {
                            tracing::warn!(error = e, message_id = %r.message.message_id, "replay failed again")
                        }
                    }
                }
            }
            Err(e) => tracing::warn!(error = %e, "loading replay requests failed"),
        }
        if let Some(window) = dedup_window {
            loop {
                match inbox.purge(window, 1000).await {
                    Ok(n) if n >= 1000 => continue,
                    Ok(_) => break,
                    Err(e) => {
                        tracing::warn!(error = %e, "inbox purge failed");
                        break;
                    }
                }
            }
        }
    }
}
