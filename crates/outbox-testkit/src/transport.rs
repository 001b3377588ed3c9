//! What the transport suite needs of a broker ([`TransportFixture`]) and the webhook receiver.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use outbox::Message;
use outbox::TransportError;
use outbox::message::HEADER_MESSAGE_ID;
use outbox::transport::{Outgoing, Transport};
use uuid::Uuid;

/// What a test broker received: message id, headers and payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Received {
    /// The message id as carried by the broker's native field (`webhook-id`, `Nats-Msg-Id`).
    pub native_id: Option<String>,
    /// Every header, lower-cased names for HTTP.
    pub headers: BTreeMap<String, String>,
    /// The body.
    pub payload: Vec<u8>,
    /// The destination (URL path or subject).
    pub destination: String,
}

/// A transport under test with a view of what its broker received.
#[async_trait]
pub trait TransportFixture: Send + Sync {
    /// The transport.
    fn transport(&self) -> Arc<dyn Transport>;
    /// A destination that acknowledges.
    fn good_destination(&self) -> String;
    /// A destination the broker refuses permanently (no stream, 400).
    fn rejecting_destination(&self) -> String;
    /// Everything the broker stored or received at `good_destination`, in arrival order.
    async fn received(&self) -> Vec<Received>;
    /// Drop what the fixture created.
    async fn cleanup(&self);
}

/// A [`Message`] as a relay would claim it.
pub fn claimed_message(topic: &str, payload: impl Into<Vec<u8>>) -> Message {
    Message {
        id: 1,
        message_id: Uuid::now_v7(),
        topic: topic.into(),
        partition_key: None,
        headers: BTreeMap::new(),
        payload: payload.into(),
        attempts: 1,
        max_attempts: 5,
        redelivery: 0,
    }
}

/// Publish `msgs` through `t` in one batch, message `i` to `destination(i)`; one result per
/// message, in order.
pub async fn publish_to<'a>(
    t: &dyn Transport,
    msgs: &'a [Message],
    destination: impl Fn(usize) -> &'a str,
) -> Vec<Result<(), TransportError>> {
    let batch: Vec<Outgoing<'a>> = msgs
        .iter()
        .enumerate()
        .map(|(i, m)| Outgoing {
            message: m,
            destination: destination(i),
        })
        .collect();
    t.publish(&batch).await
}

/// Publish five claimed messages, payloads `m0` to `m4`, through `transport` in one batch: message
/// `odd` to `elsewhere`, the others to `good`. The messages and one result per message, in order.
pub async fn publish_one_elsewhere(
    transport: &dyn Transport,
    good: &str,
    odd: usize,
    elsewhere: &str,
) -> (Vec<Message>, Vec<Result<(), TransportError>>) {
    let msgs: Vec<Message> = (0..5)
        .map(|i| claimed_message("t", format!("m{i}")))
        .collect();
    let results = publish_to(
        transport,
        &msgs,
        |i| if i == odd { elsewhere } else { good },
    )
    .await;
    (msgs, results)
}

/// Publish `msgs` in one batch, every one to `destination`.
pub async fn publish_all(
    t: &dyn Transport,
    msgs: &[Message],
    destination: &str,
) -> Vec<Result<(), TransportError>> {
    publish_to(t, msgs, |_| destination).await
}

/// Wait until `t`'s probe succeeds: the transport reconnected after a fault.
///
/// # Panics
/// After `timeout`, with `what` in the message.
pub async fn wait_probe_ok(what: &str, timeout: Duration, t: &dyn Transport) {
    crate::wait_until(what, timeout, || async { t.probe().await.is_ok() }).await;
}

/// Wait until `t`'s probe fails: the transport noticed a fault.
///
/// # Panics
/// After `timeout`, with `what` in the message.
pub async fn wait_probe_fails(what: &str, timeout: Duration, t: &dyn Transport) {
    crate::wait_until(what, timeout, || async { t.probe().await.is_err() }).await;
}

/// The message id header of a received message (`outbox-message-id`).
pub fn header_message_id(r: &Received) -> Option<Uuid> {
    r.headers
        .get(HEADER_MESSAGE_ID)
        .and_then(|v| Uuid::parse_str(v).ok())
}

/// One webhook delivery as received: headers, body, URL path.
pub type RawDelivery = (axum::http::HeaderMap, Vec<u8>, String);

/// An axum server that records webhook deliveries and answers by path:
/// `/ok` 200, `/unavailable` 503, `/busy` 429, `/bad` 400, anything else 404.
pub struct WebhookReceiver {
    /// Where it listens.
    pub addr: SocketAddr,
    received: Arc<Mutex<Vec<RawDelivery>>>,
    shutdown: tokio_util::sync::CancellationToken,
}

impl WebhookReceiver {
    /// Start on `127.0.0.1:0`.
    ///
    /// # Panics
    /// When it cannot bind.
    pub async fn start() -> WebhookReceiver {
        use axum::http::{StatusCode, Uri};
        let received: Arc<Mutex<Vec<RawDelivery>>> = Arc::default();
        let rec = received.clone();
        let app = axum::Router::new().fallback(
            move |uri: Uri, headers: axum::http::HeaderMap, body: axum::body::Bytes| {
                let rec = rec.clone();
                async move {
                    let path = uri.path().to_owned();
                    rec.lock()
                        .expect("poisoned")
                        .push((headers, body.to_vec(), path.clone()));
                    match path.as_str() {
                        "/ok" => (StatusCode::OK, "ok"),
                        "/unavailable" => (StatusCode::SERVICE_UNAVAILABLE, "try later"),
                        "/busy" => (StatusCode::TOO_MANY_REQUESTS, "slow down"),
                        "/bad" => (StatusCode::BAD_REQUEST, "refused"),
                        _ => (StatusCode::NOT_FOUND, "no such endpoint"),
                    }
                }
            },
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind webhook receiver");
        let addr = listener.local_addr().expect("local addr");
        let shutdown = tokio_util::sync::CancellationToken::new();
        let s = shutdown.clone();
        tokio::spawn(async move {
            let _ = axum::serve(listener, app)
                .with_graceful_shutdown(async move { s.cancelled().await })
                .await;
        });
        WebhookReceiver {
            addr,
            received,
            shutdown,
        }
    }

    /// `http://addr{path}`.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// Raw deliveries: headers, body, path.
    pub fn raw(&self) -> Vec<RawDelivery> {
        self.received.lock().expect("poisoned").clone()
    }
}

impl Drop for WebhookReceiver {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

/// [`TransportFixture`] for [`outbox::WebhookTransport`] against a [`WebhookReceiver`].
pub struct WebhookFixture {
    /// The receiver.
    pub receiver: WebhookReceiver,
    /// The transport (signing with [`WebhookFixture::secret`]).
    pub transport: Arc<outbox::WebhookTransport>,
    /// The `whsec_` secret.
    pub secret: String,
}

impl WebhookFixture {
    /// Start a receiver and build a signing transport for it.
    ///
    /// # Panics
    /// When the receiver cannot bind.
    pub async fn new() -> WebhookFixture {
        use base64::Engine as _;
        let receiver = WebhookReceiver::start().await;
        let secret = format!(
            "whsec_{}",
            base64::engine::general_purpose::STANDARD.encode(rand::random::<[u8; 24]>())
        );
        let mut config = outbox::WebhookConfig::new(receiver.url("/ok"));
        config.secret = Some(secret.clone());
        config.timeout = Duration::from_secs(5);
        let transport = Arc::new(outbox::WebhookTransport::new(config).expect("webhook config"));
        WebhookFixture {
            receiver,
            transport,
            secret,
        }
    }
}

#[async_trait]
impl TransportFixture for WebhookFixture {
    fn transport(&self) -> Arc<dyn Transport> {
        self.transport.clone()
    }

    fn good_destination(&self) -> String {
        self.receiver.url("/ok")
    }

    fn rejecting_destination(&self) -> String {
        self.receiver.url("/bad")
    }

    async fn received(&self) -> Vec<Received> {
        self.receiver
            .raw()
            .into_iter()
            .filter(|(_, _, path)| path == "/ok")
            .map(|(h, body, path)| Received {
                native_id: h
                    .get("webhook-id")
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_owned),
                headers: h
                    .iter()
                    .filter_map(|(k, v)| Some((k.as_str().to_owned(), v.to_str().ok()?.to_owned())))
                    .collect(),
                payload: body,
                destination: path,
            })
            .collect()
    }

    async fn cleanup(&self) {}
}
