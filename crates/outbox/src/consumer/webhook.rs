//! Webhook receiver feeding an [`Inbox`]: an axum [`Router`] whose `POST` handler answers `2xx`
//! only after the inbox transaction committed.
//!
//! Each delivery goes through [`deliver`](crate::consumer::deliver); the delivery count is the
//! relay's `outbox-attempt` header. Answers: `200` when the verdict is recorded (processed,
//! rejected by the handler, dead-lettered by the consumer, or a duplicate; the confirmation is
//! sent when the message asks for one); `503` when it must be delivered again (transient handler
//! failure below `max_deliveries`, or the inbox database failing: the relay retries with
//! backoff); `401` bad or missing signature (when a secret is set); `400` no usable message id
//! (neither `outbox-message-id` nor `webhook-id`).
//!
//! Run [`maintenance`](crate::consumer::maintenance) beside the server for operator replays and
//! inbox retention.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;

use crate::consumer::{ConsumerMetrics, DeliveryPolicy, Disposition, deliver};
use crate::error::ConfigError;
use crate::inbox::{Handler, Inbox, InboxBackend};
use crate::message::{HEADER_MESSAGE_ID, HEADER_TOPIC, Headers, InboundMessage};
use crate::transport::webhook::WebhookSigner;
use crate::verdict::Verdict;

struct AppState<DB: InboxBackend, H: ?Sized + 'static> {
    inbox: Inbox<DB>,
    handler: Arc<H>,
    signer: Option<WebhookSigner>,
    metrics: Arc<ConsumerMetrics>,
    policy: DeliveryPolicy,
}

/// An axum router that accepts deliveries at `path` (see the module docs).
///
/// # Errors
/// [`ConfigError`] naming `secret` when it is not a `whsec_` + base64 secret.
pub fn router<DB, H>(
    path: &str,
    inbox: Inbox<DB>,
    handler: Arc<H>,
    secret: Option<&str>,
    metrics: Arc<ConsumerMetrics>,
) -> Result<Router, ConfigError>
where
    DB: InboxBackend,
    H: Handler<DB> + ?Sized,
{
    router_with(
        path,
        inbox,
        handler,
        secret,
        metrics,
        DeliveryPolicy::default(),
    )
}

/// As [`router`] with a [`DeliveryPolicy`] (confirmations, `max_deliveries`, retry delays).
///
/// # Errors
/// [`ConfigError`] naming `secret` when it is not a `whsec_` + base64 secret.
pub fn router_with<DB, H>(
    path: &str,
    inbox: Inbox<DB>,
    handler: Arc<H>,
    secret: Option<&str>,
    metrics: Arc<ConsumerMetrics>,
    policy: DeliveryPolicy,
) -> Result<Router, ConfigError>
where
    DB: InboxBackend,
    H: Handler<DB> + ?Sized,
{
    let signer = secret.map(WebhookSigner::new).transpose()?;
    let state = Arc::new(AppState {
        inbox,
        handler,
        signer,
        metrics,
        policy,
    });
    Ok(Router::new()
        .route(path, post(receive::<DB, H>))
        .with_state(state))
}

async fn receive<DB, H>(
    State(state): State<Arc<AppState<DB, H>>>,
    headers: HeaderMap,
    body: Bytes,
) -> (StatusCode, String)
where
    DB: InboxBackend,
    H: Handler<DB> + ?Sized,
{
    let now = chrono::Utc::now().timestamp();
    let msg = match inbound(state.signer.as_ref(), &headers, &body, now) {
        Ok(m) => m,
        Err((status, reason)) => {
            if status == StatusCode::BAD_REQUEST {
                state.metrics.malformed.fetch_add(1, Ordering::Relaxed);
            }
            return (status, reason);
        }
    };
    // Processed on its own task: a client that hangs up mid-request (a relay crash, a timeout)
    // must not cancel the inbox transaction or the counters half-way.
    let task = tokio::spawn(async move {
        match deliver(
            &state.inbox,
            state.handler.as_ref(),
            &msg,
            &state.policy,
            &state.metrics,
        )
        .await
        {
            Disposition::Ack(Verdict::Processed) => (StatusCode::OK, "processed".to_owned()),
            Disposition::Ack(Verdict::Rejected { reason }) => {
                (StatusCode::OK, format!("rejected: {reason}"))
            }
            Disposition::Retry(delay) => (
                StatusCode::SERVICE_UNAVAILABLE,
                format!("not applied; retry in {} ms", delay.as_millis()),
            ),
        }
    });
    task.await.unwrap_or_else(|e| {
        (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("handler task failed: {e}"),
        )
    })
}

/// The message of a delivery request, before the inbox: the signature checked when `signer` is
/// set (against `now`, Unix seconds, with 5 minutes of tolerance), every header readable as
/// text, the message id from `outbox-message-id` or else `webhook-id`, the topic `webhook` when
/// none came, the delivery count from `outbox-attempt` (1 when missing).
///
/// # Errors
/// `401` with the reason for a missing or bad signature, `400` with the reason for a request
/// that is not a message ([`InboundMessage::from_wire`]).
pub(crate) fn inbound(
    signer: Option<&WebhookSigner>,
    headers: &HeaderMap,
    body: &Bytes,
    now: i64,
) -> Result<InboundMessage, (StatusCode, String)> {
    let get = |k: &str| {
        headers
            .get(k)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    if let Some(signer) = signer {
        let (Some(id), Some(ts), Some(sig)) = (
            get("webhook-id"),
            get("webhook-timestamp"),
            get("webhook-signature"),
        ) else {
            return Err((
                StatusCode::UNAUTHORIZED,
                "missing webhook-id, webhook-timestamp or webhook-signature".into(),
            ));
        };
        let Ok(ts) = ts.parse::<i64>() else {
            return Err((
                StatusCode::UNAUTHORIZED,
                "webhook-timestamp is not an integer".into(),
            ));
        };
        if let Err(e) = signer.verify(&id, ts, body, &sig, now, Duration::from_secs(300)) {
            return Err((StatusCode::UNAUTHORIZED, e));
        }
    }
    let mut map = Headers::new();
    for (k, v) in headers {
        if let Ok(v) = v.to_str() {
            map.insert(k.as_str().to_owned(), v.to_owned());
        }
    }
    if !map.contains_key(HEADER_MESSAGE_ID)
        && let Some(id) = map.get("webhook-id").cloned()
    {
        map.insert(HEADER_MESSAGE_ID.into(), id);
    }
    map.entry(HEADER_TOPIC.into())
        .or_insert_with(|| "webhook".into());
    let attempt = map
        .get("outbox-attempt")
        .and_then(|a| a.parse().ok())
        .unwrap_or(1);
    InboundMessage::from_wire(map, body.to_vec(), attempt)
        .map_err(|reason| (StatusCode::BAD_REQUEST, reason))
}
