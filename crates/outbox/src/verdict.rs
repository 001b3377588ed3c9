//! The confirmation contract, below the stores, transports and consumers that use it: what a
//! consumer answers ([`Confirmation`], [`Verdict`]), how it travels ([`ConfirmationSender`],
//! header [`HEADER_REPLY_TO`], [`parse_confirmations`]), what a route asks for
//! ([`ConfirmPolicy`]) and what the producer runs on a rejection ([`RejectionHook`]). The
//! broker listeners and senders are in [`crate::confirm`], which re-exports these names.

use std::time::Duration;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::error::{BoxError, TransportError};
use crate::message::Headers;

/// Header naming where confirmations of this message go (a NATS subject or a URL).
pub const HEADER_REPLY_TO: &str = "outbox-reply-to";

/// The consumer's verdict on a message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum Verdict {
    /// The effect was applied.
    Processed,
    /// The consumer processed the message and refused it (a business rule, or its dead letter).
    Rejected {
        /// Why, for the producer's compensation and for operators.
        reason: String,
    },
}

/// A confirmation as it travels: JSON `{"message_id": "…", "consumer": "…", "outcome":
/// "processed"}` or `{…, "outcome": "rejected", "reason": "…"}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Confirmation {
    /// The producer's message id.
    pub message_id: Uuid,
    /// The consumer's name (its inbox consumer name).
    pub consumer: String,
    /// The verdict.
    #[serde(flatten)]
    pub verdict: Verdict,
    /// W3C `traceparent` of the consumer's span that sent it (feature `otel`, see
    /// [`crate::otel`]): the producer's confirmation span continues it. Absent when the consumer
    /// was not traced; ignored by producers without the feature.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traceparent: Option<String>,
    /// W3C `tracestate` going with [`Confirmation::traceparent`], when not empty.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tracestate: Option<String>,
}

impl Confirmation {
    /// A confirmation of `message_id` by `consumer`, without a trace context.
    pub fn new(message_id: Uuid, consumer: impl Into<String>, verdict: Verdict) -> Self {
        Confirmation {
            message_id,
            consumer: consumer.into(),
            verdict,
            traceparent: None,
            tracestate: None,
        }
    }
}

impl Verdict {
    /// The verdict's `outcome` as it travels: `processed` or `rejected`.
    pub fn outcome(&self) -> &'static str {
        match self {
            Verdict::Processed => "processed",
            Verdict::Rejected { .. } => "rejected",
        }
    }
}

/// What [`Store::apply_confirmations`](crate::Store::apply_confirmations) did with a batch.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ConfirmReport {
    /// Messages moved to CONFIRMED.
    pub confirmed: u64,
    /// Messages moved to REJECTED (their hook ran once).
    pub rejected: u64,
    /// Confirmations for messages already CONFIRMED or REJECTED: harmless duplicates.
    pub duplicates: u64,
    /// Confirmations for message ids this outbox does not have (counted and logged).
    pub unknown: u64,
    /// Rejections whose hook failed: rolled back, the message unchanged; applied when the
    /// rejection comes again (logged at error level).
    pub failed_hooks: u64,
}

impl ConfirmReport {
    /// Add another report's counts.
    pub fn add(&mut self, o: ConfirmReport) {
        self.confirmed += o.confirmed;
        self.rejected += o.rejected;
        self.duplicates += o.duplicates;
        self.unknown += o.unknown;
        self.failed_hooks += o.failed_hooks;
    }
}

/// A message the consumer rejected, as the [`RejectionHook`] sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RejectedMessage {
    /// Outbox row id.
    pub id: i64,
    /// Message id.
    pub message_id: Uuid,
    /// Topic.
    pub topic: String,
    /// Partition key.
    pub partition_key: Option<String>,
    /// Headers as enqueued.
    pub headers: Headers,
    /// Payload as enqueued.
    pub payload: Vec<u8>,
    /// The consumer that rejected it.
    pub consumer: String,
    /// Its reason.
    pub reason: String,
}

/// The producer's compensation for a rejected message, run inside the producer-database
/// transaction that records REJECTED, so it runs exactly once per message: write through `conn`
/// (and enqueue follow-up messages through it) and the writes commit with the status change.
///
/// To enqueue follow-up messages, the hook holds its own clone of the store, taken before the
/// hook is attached: `let hook = Cancel { outbox: store.clone() }; let store =
/// store.with_rejection_hook(Arc::new(hook));` and calls `self.outbox.enqueue(conn, …)`.
///
/// # Errors
/// Any error rolls the transaction back: the message stays as it was and the rejection is applied
/// again when the confirmation comes again (the check-back makes it come again).
#[async_trait]
pub trait RejectionHook<DB: sqlx::Database>: Send + Sync + 'static {
    /// Compensate for `rejected`.
    async fn on_rejected(
        &self,
        conn: &mut DB::Connection,
        rejected: &RejectedMessage,
    ) -> Result<(), BoxError>;
}

/// Confirmation policy of a route: where confirmations go and how long to wait for one. In a
/// configuration file, a route's `confirm = { reply_to = "…", timeout = "5m" }`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ConfirmPolicy {
    /// Reply destination put in `outbox-reply-to` (a NATS subject or a URL the producer serves).
    pub reply_to: String,
    /// Deadline after SENT; past it the message is checked back. Default 5 min (the seeds').
    #[serde(default = "default_confirm_timeout", with = "humantime_serde")]
    pub timeout: Duration,
}

fn default_confirm_timeout() -> Duration {
    ConfirmPolicy::new("").timeout
}

impl ConfirmPolicy {
    /// A policy replying to `reply_to` with the default 5-minute deadline.
    pub fn new(reply_to: impl Into<String>) -> Self {
        ConfirmPolicy {
            reply_to: reply_to.into(),
            timeout: Duration::from_secs(300),
        }
    }
}

/// Sends confirmations from the consumer side.
#[async_trait]
pub trait ConfirmationSender: Send + Sync + 'static {
    /// Send `confirmation` to `reply_to`.
    ///
    /// # Errors
    /// A [`TransportError`]; the runner logs and counts it, and the producer's check-back recovers.
    async fn send(&self, reply_to: &str, confirmation: &Confirmation)
    -> Result<(), TransportError>;

    /// Send `confirmations`, all to `reply_to`: one result per confirmation, in order. The
    /// batched inbox (`runner.inbox_batch` above 1, the webhook receiver's group commit) sends a
    /// committed batch's confirmations through this. Default: [`ConfirmationSender::send`] for
    /// each, one after another; the webhook sender posts them as one JSON array (one request, and one
    /// transaction on the producer's side).
    async fn send_all(
        &self,
        reply_to: &str,
        confirmations: &[Confirmation],
    ) -> Vec<Result<(), TransportError>> {
        let mut results = Vec::with_capacity(confirmations.len());
        for c in confirmations {
            results.push(self.send(reply_to, c).await);
        }
        results
    }
}

/// Parse a confirmation body: one JSON object or an array of them.
///
/// # Errors
/// The JSON error, for a `400` answer or a log line.
pub fn parse_confirmations(body: &[u8]) -> Result<Vec<Confirmation>, serde_json::Error> {
    match serde_json::from_slice::<Vec<Confirmation>>(body) {
        Ok(v) => Ok(v),
        Err(_) => serde_json::from_slice::<Confirmation>(body).map(|c| vec![c]),
    }
}
