//! Consumer confirmations, result feedback and compensation (docs/design/DESIGN.md §4, §9).
//!
//! After its inbox transaction commits, a consumer sends a [`Confirmation`] (message id, consumer
//! name, [`Verdict`]) to the reply destination the relay put in the message's `outbox-reply-to`
//! header. The producer side applies confirmations in batches with
//! [`Store::apply_confirmations`](crate::Store::apply_confirmations): SENT → CONFIRMED, or SENT →
//! REJECTED with the consumer's reason, running the store's [`RejectionHook`] inside the same
//! producer-database transaction (the compensation: cancel the order and enqueue
//! `order-cancelled`). The status change is conditional, so a duplicate or late confirmation
//! changes nothing and never runs the hook twice.
//!
//! A confirmation that is lost is recovered by the check-back: a SENT message of a route that
//! requires confirmation and is still unconfirmed at its deadline is published again; the
//! consumer's inbox recognises the copy and sends the recorded verdict again.
//!
//! Transports for confirmations: [`ConfirmationSender`] on the consumer side
//! ([`NatsConfirmationSender`](crate::confirm::nats::NatsConfirmationSender),
//! [`WebhookConfirmationSender`](crate::confirm::webhook::WebhookConfirmationSender)); listeners on the producer side
//! ([`nats::listen`], [`webhook::router`]).

pub use crate::verdict::{
    ConfirmPolicy, ConfirmReport, Confirmation, ConfirmationSender, HEADER_REPLY_TO,
    RejectedMessage, RejectionHook, Verdict, parse_confirmations,
};

/// Apply with retries: transient database errors are retried with backoff up to `tries` times.
pub(crate) async fn apply_with_retry(
    store: &std::sync::Arc<dyn crate::Store>,
    batch: &[Confirmation],
    tries: u32,
) -> Result<ConfirmReport, crate::StoreError> {
    let backoff = crate::Backoff {
        base: std::time::Duration::from_millis(100),
        max: std::time::Duration::from_secs(5),
        ..Default::default()
    };
    // Traced confirmations (feature `otel`) get their `outbox.confirmation` spans, whose
    // contexts the rejection hooks' spans continue (crate::otel).
    let mut traced = Vec::new();
    let mut own;
    let batch = if batch.iter().any(|c| c.traceparent.is_some()) {
        own = batch.to_vec();
        traced = own
            .iter_mut()
            .filter_map(crate::otel::confirmation_span)
            .collect();
        &own[..]
    } else {
        batch
    };
    let mut n = 0;
    let result = loop {
        match store.apply_confirmations(batch).await {
            Ok(r) => break Ok(r),
            Err(e) if e.is_retryable() && n + 1 < tries => {
                n += 1;
                tracing::warn!(error = %e.report(), "applying confirmations failed; retrying");
                tokio::time::sleep(backoff.delay(n)).await;
            }
            Err(e) => break Err(e),
        }
    };
    for span in traced {
        match &result {
            Ok(_) => crate::otel::record_outcome(&span, "applied", false),
            Err(_) => crate::otel::record_outcome(&span, "not_applied", true),
        }
    }
    result
}

/// What every [`ConfirmationHandler`] of this process applied.
static PROCESS_TOTAL: std::sync::Mutex<ConfirmReport> = std::sync::Mutex::new(ConfirmReport {
    confirmed: 0,
    rejected: 0,
    duplicates: 0,
    unknown: 0,
    failed_hooks: 0,
});

/// The confirmations applied by every listener of this process since it started (each
/// listener's own totals are its [`ConfirmationHandler::total`], or what [`listen`] returns):
/// what `outbox_confirmations_…_total` exports (docs/operations.md). Process-wide because the
/// brokers' `listen` functions build their handler themselves.
pub fn process_totals() -> ConfirmReport {
    *PROCESS_TOTAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// The confirmation listeners' [`BatchHandler`](crate::consumer::source::BatchHandler): parse each message as confirmations (one that
/// is not is rejected and logged), apply the batch to the store in one transaction
/// ([`apply_with_retry`], 5 tries) and acknowledge it after the commit; when the database fails
/// transiently, have the whole batch delivered again after 1 s; when it refuses the batch for
/// good, skip it (the check-back brings those messages again). Keeps the totals.
///
/// A listener is the generic runner ([`consumer::source::run`](crate::consumer::source::run))
/// over a broker's [`Source`](crate::consumer::source::Source) with this handler; see [`listen`].
pub struct ConfirmationHandler {
    store: std::sync::Arc<dyn crate::Store>,
    retry_after: std::time::Duration,
    total: std::sync::Mutex<ConfirmReport>,
}

impl ConfirmationHandler {
    /// A handler applying to `store`, redelivering a refused batch after 1 s.
    pub fn new(store: std::sync::Arc<dyn crate::Store>) -> Self {
        ConfirmationHandler {
            store,
            retry_after: std::time::Duration::from_secs(1),
            total: std::sync::Mutex::new(ConfirmReport::default()),
        }
    }

    /// The totals applied so far.
    pub fn total(&self) -> ConfirmReport {
        self.total.lock().map(|t| *t).unwrap_or_default()
    }
}

#[async_trait::async_trait]
impl crate::consumer::source::BatchHandler for ConfirmationHandler {
    async fn handle(
        &self,
        batch: &[&crate::consumer::source::Envelope],
    ) -> Vec<crate::consumer::source::Settle> {
        use crate::consumer::source::Settle;
        let mut out = Vec::with_capacity(batch.len());
        let mut confirmations = Vec::with_capacity(batch.len());
        for e in batch {
            match parse_confirmations(&e.payload) {
                Ok(cs) => {
                    confirmations.extend(cs);
                    out.push(Settle::Ack);
                }
                Err(err) => {
                    tracing::warn!(error = %err, origin = %e.origin, "malformed confirmation dropped");
                    out.push(Settle::Reject(format!("not a confirmation: {err}")));
                }
            }
        }
        if confirmations.is_empty() {
            return out;
        }
        match apply_with_retry(&self.store, &confirmations, 5).await {
            Ok(r) => {
                if r.unknown > 0 {
                    tracing::warn!(unknown = r.unknown, "confirmations for unknown message ids");
                }
                if let Ok(mut t) = self.total.lock() {
                    t.add(r);
                }
                PROCESS_TOTAL
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .add(r);
                out
            }
            Err(e) if !e.is_retryable() => {
                tracing::error!(error = %e.report(), n = confirmations.len(), "confirmations refused by the store; skipped (the check-back will bring them again)");
                out
            }
            Err(e) => {
                tracing::error!(error = %e.report(), n = confirmations.len(), "confirmations not applied; they come again");
                out.into_iter()
                    .map(|s| match s {
                        Settle::Ack => Settle::Retry(self.retry_after),
                        other => other,
                    })
                    .collect()
            }
        }
    }
}

/// Run a confirmation listener: drive `source` with a [`ConfirmationHandler`] on `store`
/// until `cancel`, and return the totals.
///
/// # Errors
/// The [`ConfigError`](crate::ConfigError) of the source's first set-up.
pub async fn listen<S: crate::consumer::source::Source>(
    source: S,
    store: std::sync::Arc<dyn crate::Store>,
    options: &crate::consumer::source::RunOptions,
    cancel: &tokio_util::sync::CancellationToken,
) -> Result<ConfirmReport, crate::ConfigError> {
    let handler = ConfirmationHandler::new(store);
    crate::consumer::source::run(source, &handler, options, cancel).await?;
    Ok(handler.total())
}

#[cfg(feature = "kafka")]
pub mod kafka;
#[cfg(feature = "mqtt")]
pub mod mqtt;
#[cfg(feature = "rabbitmq")]
pub mod rabbitmq;
#[cfg(feature = "redis")]
pub mod redis;
#[cfg(feature = "rocketmq")]
pub mod rocketmq;

#[cfg(feature = "nats")]
pub mod nats {
    //! Confirmations over NATS: consumers publish to the reply subject; the producer listens on
    //! it (queue group, so several producer instances share the work) and applies batches.

    use std::sync::Arc;
    use std::time::Duration;

    use async_trait::async_trait;
    use futures::StreamExt;
    use tokio_util::sync::CancellationToken;

    use super::{ConfirmReport, Confirmation, ConfirmationSender};
    use crate::Store;
    use crate::consumer::source::{Delivery, Envelope, RunOptions, Settle, Source, SourceError};
    use crate::error::{ConfigError, TransportError};

    /// Publishes confirmations on core NATS (fire and forget; the check-back covers a loss).
    #[derive(Debug, Clone)]
    pub struct NatsConfirmationSender {
        client: async_nats::Client,
    }

    impl NatsConfirmationSender {
        /// A sender over `client`.
        pub fn new(client: async_nats::Client) -> Self {
            NatsConfirmationSender { client }
        }
    }

    #[async_trait]
    impl ConfirmationSender for NatsConfirmationSender {
        async fn send(&self, reply_to: &str, c: &Confirmation) -> Result<(), TransportError> {
            let body = serde_json::to_vec(c).expect("confirmation serializes");
            self.client
                .publish(reply_to.to_owned(), body.into())
                .await
                .map_err(|e| {
                    TransportError::retryable("confirmation publish failed").with_source(e)
                })
        }
    }

    /// A core NATS queue subscription as a [`Source`]: core NATS has no acknowledgement, so
    /// settling does nothing; a batch the database refused is lost here and recovered by the
    /// producer's check-back.
    pub struct SubscriptionSource {
        client: async_nats::Client,
        subject: String,
        queue: String,
        sub: Option<async_nats::Subscriber>,
    }

    impl SubscriptionSource {
        /// A source subscribing to `subject` in queue group `queue` (when opened).
        pub fn new(client: async_nats::Client, subject: String, queue: String) -> Self {
            SubscriptionSource {
                client,
                subject,
                queue,
                sub: None,
            }
        }
    }

    #[async_trait]
    impl Source for SubscriptionSource {
        type Token = ();

        fn describe(&self) -> String {
            format!("NATS subject {}, queue group {}", self.subject, self.queue)
        }

        async fn open(&mut self) -> Result<(), SourceError> {
            let sub = self
                .client
                .queue_subscribe(self.subject.clone(), self.queue.clone())
                .await
                .map_err(|e| {
                    ConfigError::new(
                        "subject",
                        format!("cannot subscribe to {}: {e}", self.subject),
                    )
                })?;
            self.sub = Some(sub);
            Ok(())
        }

        async fn fetch(&mut self, max: usize) -> Result<Vec<Delivery<()>>, SourceError> {
            let sub = self
                .sub
                .as_mut()
                .ok_or_else(|| SourceError::Lost("not subscribed".into()))?;
            let delivery = |m: async_nats::Message| Delivery {
                token: (),
                envelope: Envelope {
                    payload: m.payload.to_vec(),
                    delivery_count: 1,
                    origin: format!("subject {}", m.subject),
                    ..Envelope::default()
                },
            };
            let first = sub
                .next()
                .await
                .ok_or_else(|| SourceError::Lost("the subscription ended".into()))?;
            let mut out = vec![delivery(first)];
            // Take whatever else is already here, without waiting, up to `max`.
            while out.len() < max {
                match tokio::time::timeout(Duration::from_millis(2), sub.next()).await {
                    Ok(Some(m)) => out.push(delivery(m)),
                    _ => break,
                }
            }
            Ok(out)
        }

        async fn settle(&mut self, batch: Vec<(Delivery<()>, Settle)>) -> Result<(), SourceError> {
            let lost = batch
                .iter()
                .filter(|(_, s)| matches!(s, Settle::Retry(_)))
                .count();
            if lost > 0 {
                tracing::warn!(
                    lost,
                    "confirmations not applied; the check-back will bring them again"
                );
            }
            Ok(())
        }
    }

    /// Listen on `subject` (queue group `queue`) and apply confirmations to `store` in batches of
    /// up to 500, until `cancel`: the generic runner over a [`SubscriptionSource`] with a
    /// [`ConfirmationHandler`](super::ConfirmationHandler). Returns the totals.
    ///
    /// # Errors
    /// [`ConfigError`] naming `subject` when the first subscription fails.
    pub async fn listen(
        client: async_nats::Client,
        subject: String,
        queue: String,
        store: Arc<dyn Store>,
        cancel: CancellationToken,
    ) -> Result<ConfirmReport, ConfigError> {
        let options = RunOptions {
            batch: 500,
            ..RunOptions::default()
        };
        let source = SubscriptionSource::new(client, subject, queue);
        super::listen(source, store, &options, &cancel).await
    }
}

#[cfg(feature = "webhook")]
pub mod webhook {
    //! Confirmations over HTTP: consumers `POST` JSON to the producer's confirmation endpoint,
    //! an axum route that applies the batch and answers `200` after commit.

    use std::sync::Arc;

    use async_trait::async_trait;
    use axum::Router;
    use axum::body::Bytes;
    use axum::extract::State;
    use axum::http::StatusCode;
    use axum::routing::post;

    use super::{Confirmation, ConfirmationSender, apply_with_retry, parse_confirmations};
    use crate::Store;
    use crate::error::TransportError;

    /// `POST`s confirmations as JSON.
    #[derive(Debug, Clone)]
    pub struct WebhookConfirmationSender {
        client: reqwest::Client,
    }

    impl WebhookConfirmationSender {
        /// A sender with a 10 s timeout.
        pub fn new() -> Self {
            let _ = rustls::crypto::ring::default_provider().install_default();
            let client = reqwest::Client::builder()
                .timeout(std::time::Duration::from_secs(10))
                .build()
                .expect("HTTP client");
            WebhookConfirmationSender { client }
        }
    }

    impl Default for WebhookConfirmationSender {
        fn default() -> Self {
            Self::new()
        }
    }

    impl WebhookConfirmationSender {
        /// `POST` `body` (one confirmation or an array of them) to `reply_to`.
        async fn post(&self, reply_to: &str, body: Vec<u8>) -> Result<(), TransportError> {
            let resp = self
                .client
                .post(reply_to)
                .header("content-type", "application/json")
                .body(body)
                .send()
                .await
                .map_err(|e| {
                    TransportError::retryable(format!("POST {reply_to} failed")).with_source(e)
                })?;
            if resp.status().is_success() {
                Ok(())
            } else {
                Err(TransportError::retryable(format!(
                    "POST {reply_to} answered {}",
                    resp.status()
                )))
            }
        }
    }

    #[async_trait]
    impl ConfirmationSender for WebhookConfirmationSender {
        async fn send(&self, reply_to: &str, c: &Confirmation) -> Result<(), TransportError> {
            self.post(
                reply_to,
                serde_json::to_vec(c).expect("confirmation serializes"),
            )
            .await
        }

        /// One request with a JSON array ([`router`] applies it in one transaction): every
        /// confirmation shares its result.
        async fn send_all(
            &self,
            reply_to: &str,
            cs: &[Confirmation],
        ) -> Vec<Result<(), TransportError>> {
            if cs.is_empty() {
                return Vec::new();
            }
            let r = self
                .post(
                    reply_to,
                    serde_json::to_vec(cs).expect("confirmations serialize"),
                )
                .await
                .map_err(|e| e.report());
            cs.iter()
                .map(|_| r.clone().map_err(TransportError::retryable))
                .collect()
        }
    }

    /// An axum router accepting confirmations at `path` (one JSON object or an array) and
    /// applying them to `store`: `200` with the counts after commit, `400` for a body that is not
    /// a confirmation, `503` when the database failed (the consumer may retry; the check-back
    /// recovers otherwise).
    pub fn router(path: &str, store: Arc<dyn Store>) -> Router {
        Router::new().route(path, post(receive)).with_state(store)
    }

    async fn receive(State(store): State<Arc<dyn Store>>, body: Bytes) -> (StatusCode, String) {
        let batch: Vec<Confirmation> = match parse_confirmations(&body) {
            Ok(b) => b,
            Err(e) => return (StatusCode::BAD_REQUEST, format!("not a confirmation: {e}")),
        };
        // Own task: a client that hangs up must not cancel the transaction half-way.
        let task = tokio::spawn(async move { apply_with_retry(&store, &batch, 3).await });
        match task.await {
            Ok(Ok(r)) => (
                StatusCode::OK,
                format!(
                    "{{\"confirmed\":{},\"rejected\":{},\"duplicates\":{},\"unknown\":{}}}",
                    r.confirmed, r.rejected, r.duplicates, r.unknown
                ),
            ),
            Ok(Err(e)) => (StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
            Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use uuid::Uuid;

    #[test]
    fn wire_format_round_trips() {
        let id = Uuid::now_v7();
        let c = Confirmation::new(
            id,
            "inventory",
            Verdict::Rejected {
                reason: "insufficient stock".into(),
            },
        );
        let json = serde_json::to_string(&c).unwrap();
        assert!(json.contains("\"outcome\":\"rejected\""), "{json}");
        assert_eq!(
            parse_confirmations(json.as_bytes()).unwrap(),
            vec![c.clone()]
        );
        let arr = format!(
            "[{json},{{\"message_id\":\"{id}\",\"consumer\":\"x\",\"outcome\":\"processed\"}}]"
        );
        let parsed = parse_confirmations(arr.as_bytes()).unwrap();
        assert_eq!(parsed[1].verdict, Verdict::Processed);
        assert!(parse_confirmations(b"{\"message_id\":1}").is_err());
    }
}
