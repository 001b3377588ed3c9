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
//!
//! **Group commit** ([`DeliveryPolicy::inbox_batch`] above 1): each request carries one message,
//! so the router groups the requests that arrive while an inbox transaction runs and applies
//! them in the next one ([`deliver_batch`], one lane, up to `inbox_batch` messages per
//! transaction), then answers each request with its own message's outcome. A lone request is
//! applied at once, as without grouping; under load one transaction serves many requests (on
//! SQLite's single writer, one transaction per request is what bounds a webhook receiver). The
//! batch's rules apply: a message whose handler fails, rejects or panics costs the others nothing
//! (they commit without it and it ends as it would alone), and a later message of a key whose
//! earlier message must be retried is answered `503` with it. Handlers of one group run one after
//! another in one transaction: a handler that waits on a remote call waits for the whole group,
//! so keep `inbox_batch` at 1 (every request in its own transaction, concurrently) for such
//! handlers. A request whose client hangs up is still applied; a panic outside the handlers (a
//! confirmation sender, say) answers `500` to the requests of its group, which the relay retries.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;

use futures::FutureExt as _;
use tokio::sync::oneshot;

use crate::consumer::{ConsumerMetrics, DeliveryPolicy, Disposition, deliver, deliver_batch};
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
    /// Requests waiting for the next inbox transaction (group commit).
    pending: Mutex<Pending>,
}

/// The requests of the next group: each message with where its outcome goes, and whether a
/// task is applying groups now (it takes the next group when its transaction ends, and stops
/// when none is waiting).
#[derive(Default)]
struct Pending {
    queue: Vec<(InboundMessage, oneshot::Sender<Disposition>)>,
    draining: bool,
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
        pending: Mutex::default(),
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
    let disposition = if state.policy.inbox_batch > 1 {
        grouped(&state, msg).await
    } else {
        // Processed on its own task: a client that hangs up mid-request (a relay crash, a
        // timeout) must not cancel the inbox transaction or the counters half-way.
        let state = state.clone();
        tokio::spawn(async move {
            deliver(
                &state.inbox,
                state.handler.as_ref(),
                &msg,
                &state.policy,
                &state.metrics,
            )
            .await
        })
        .await
        .map_err(|e| format!("handler task failed: {e}"))
    };
    match disposition {
        Ok(Disposition::Ack(Verdict::Processed)) => (StatusCode::OK, "processed".to_owned()),
        Ok(Disposition::Ack(Verdict::Rejected { reason })) => {
            (StatusCode::OK, format!("rejected: {reason}"))
        }
        Ok(Disposition::Retry(delay)) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not applied; retry in {} ms", delay.as_millis()),
        ),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e),
    }
}

/// Queue `msg` for the next group and wait for its outcome, starting the task that applies
/// groups when none runs (see the module docs).
///
/// # Errors
/// The reason when the group's task failed before deciding (a panic outside the handlers).
async fn grouped<DB, H>(
    state: &Arc<AppState<DB, H>>,
    msg: InboundMessage,
) -> Result<Disposition, String>
where
    DB: InboxBackend,
    H: Handler<DB> + ?Sized,
{
    let (tx, rx) = oneshot::channel();
    let start = {
        let mut p = state.pending.lock().unwrap_or_else(PoisonError::into_inner);
        p.queue.push((msg, tx));
        !std::mem::replace(&mut p.draining, true)
    };
    if start {
        tokio::spawn(drain(state.clone()));
    }
    rx.await
        .map_err(|_| "the inbox group failed before deciding this message".to_owned())
}

/// Apply the waiting requests group by group (up to `inbox_batch` each, in arrival order) until
/// none waits. Runs on its own task, so a client that hangs up cancels nothing.
async fn drain<DB, H>(state: Arc<AppState<DB, H>>)
where
    DB: InboxBackend,
    H: Handler<DB> + ?Sized,
{
    loop {
        let group: Vec<_> = {
            let mut p = state.pending.lock().unwrap_or_else(PoisonError::into_inner);
            if p.queue.is_empty() {
                p.draining = false;
                return;
            }
            let n = p.queue.len().min(state.policy.inbox_batch);
            p.queue.drain(..n).collect()
        };
        let (msgs, replies): (Vec<InboundMessage>, Vec<_>) = group.into_iter().unzip();
        let decided = std::panic::AssertUnwindSafe(deliver_batch(
            &state.inbox,
            state.handler.as_ref(),
            &msgs,
            1,
            &state.policy,
            &state.metrics,
        ))
        .catch_unwind()
        .await;
        match decided {
            Ok(dispositions) => {
                for (reply, d) in replies.into_iter().zip(dispositions) {
                    // A client that hung up no longer waits; its message is decided all the same.
                    let _ = reply.send(d);
                }
            }
            // Dropping the replies answers 500 to the group's requests; the relay retries them.
            Err(panic) => tracing::error!(
                panic = %crate::inbox::panic_text(panic.as_ref()),
                group = msgs.len(),
                "an inbox group panicked outside its handlers; its requests are answered 500"
            ),
        }
    }
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
