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

/// Apply `batch` with [`apply_with_retry`] (5 tries), add the counts to `total` and log unknown
/// ids; on failure log that the confirmations were not applied (`then` says what recovers them).
#[cfg(any(feature = "nats", feature = "rocketmq"))]
pub(crate) async fn apply_counted(
    store: &std::sync::Arc<dyn crate::Store>,
    batch: &[Confirmation],
    total: &mut ConfirmReport,
    then: &str,
) -> Result<(), crate::StoreError> {
    match apply_with_retry(store, batch, 5).await {
        Ok(r) => {
            record(total, r);
            Ok(())
        }
        Err(e) => {
            tracing::error!(error = %e.report(), n = batch.len(), "confirmations not applied; {then}");
            Err(e)
        }
    }
}

/// Apply with retries: transient database errors are retried with backoff up to `tries` times.
#[cfg(any(
    feature = "nats",
    feature = "rocketmq",
    feature = "rabbitmq",
    feature = "redis",
    feature = "mqtt",
    feature = "kafka",
    feature = "webhook"
))]
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
    let mut n = 0;
    loop {
        match store.apply_confirmations(batch).await {
            Ok(r) => return Ok(r),
            Err(e) if e.is_retryable() && n + 1 < tries => {
                n += 1;
                tracing::warn!(error = %e.report(), "applying confirmations failed; retrying");
                tokio::time::sleep(backoff.delay(n)).await;
            }
            Err(e) => return Err(e),
        }
    }
}

/// Add a listener's applied batch to its totals, warning about unknown message ids.
#[cfg(any(
    feature = "nats",
    feature = "rocketmq",
    feature = "redis",
    feature = "mqtt"
))]
pub(crate) fn record(total: &mut ConfirmReport, r: ConfirmReport) {
    if r.unknown > 0 {
        tracing::warn!(unknown = r.unknown, "confirmations for unknown message ids");
    }
    total.add(r);
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

    use super::{
        ConfirmReport, Confirmation, ConfirmationSender, apply_counted, parse_confirmations,
    };
    use crate::Store;
    use crate::error::TransportError;

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

    fn push(batch: &mut Vec<Confirmation>, payload: &[u8]) {
        match parse_confirmations(payload) {
            Ok(cs) => batch.extend(cs),
            Err(e) => tracing::warn!(error = %e, "malformed confirmation ignored"),
        }
    }

    /// Listen on `subject` (queue group `queue`) and apply confirmations to `store` in batches of
    /// up to 500, until `cancel`. Returns the totals.
    ///
    /// # Errors
    /// The subscription error at start.
    pub async fn listen(
        client: async_nats::Client,
        subject: String,
        queue: String,
        store: Arc<dyn Store>,
        cancel: CancellationToken,
    ) -> Result<ConfirmReport, async_nats::SubscribeError> {
        let mut sub = client.queue_subscribe(subject, queue).await?;
        let mut total = ConfirmReport::default();
        loop {
            let first = tokio::select! {
                _ = cancel.cancelled() => return Ok(total),
                m = sub.next() => match m { Some(m) => m, None => return Ok(total) },
            };
            let mut batch = Vec::new();
            push(&mut batch, &first.payload);
            // Take whatever else is already here, without waiting, up to 500.
            while batch.len() < 500 {
                match tokio::time::timeout(Duration::from_millis(2), sub.next()).await {
                    Ok(Some(m)) => push(&mut batch, &m.payload),
                    _ => break,
                }
            }
            if batch.is_empty() {
                continue;
            }
            let _ = apply_counted(
                &store,
                &batch,
                &mut total,
                "the check-back will bring them again",
            )
            .await;
        }
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

    #[async_trait]
    impl ConfirmationSender for WebhookConfirmationSender {
        async fn send(&self, reply_to: &str, c: &Confirmation) -> Result<(), TransportError> {
            let resp = self
                .client
                .post(reply_to)
                .header("content-type", "application/json")
                .body(serde_json::to_vec(c).expect("confirmation serializes"))
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
        let c = Confirmation {
            message_id: id,
            consumer: "inventory".into(),
            verdict: Verdict::Rejected {
                reason: "insufficient stock".into(),
            },
        };
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
