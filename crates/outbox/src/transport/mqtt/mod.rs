//! MQTT 5 transport (rumqttc's `v5` client): publish each message at QoS 1 to the topic named by
//! its destination and report `Ok` only on the broker's PUBACK with a success reason code.
//!
//! # What travels where
//! - topic: the route's destination (a topic name: no `+` or `#` wildcards, not starting with
//!   `$`, no NUL, at most 65,535 bytes);
//! - payload: the message payload, byte-exact;
//! - MQTT 5 user properties: every header of [`Message::wire_headers`] (user headers such as
//!   `traceparent`, `outbox-message-id`, `outbox-topic`, `outbox-attempt`,
//!   `outbox-partition-key`); MQTT has no native message-id field, so `outbox-message-id` is the
//!   id, and the correlation data carries the same id as 16 bytes (the UUID) for tools that
//!   correlate by it. The `content-type` header, when present, also sets the MQTT 5 content type.
//! - no retain flag (a retained message would be delivered again to every new subscriber).
//!
//! # What MQTT 5 can carry
//! User property names and values, the content type and the topic are MQTT UTF-8 strings
//! (MQTT 5 §1.5.4): at most 65,535 bytes, no U+0000, and a receiver may treat U+0001..U+001F,
//! U+007F..U+009F and the Unicode noncharacters as a malformed packet and close the connection.
//! rumqttc writes a longer string with a truncated length prefix (a malformed packet) and sends
//! the others as they are, so one such message would make the broker drop the publisher's
//! connection again and again. [`MqttTransport::check`](Transport::check) refuses, as permanent,
//! before anything is sent: a header name or value, topic or partition key (they travel as the
//! `outbox-topic` and `outbox-partition-key` user properties) over 65,535 bytes or with a control
//! character (tab included) or a noncharacter, and an invalid publish topic. MQTT 5 user
//! properties are free-form: no header name is reserved (the properties the transport sets,
//! content type and correlation data, are not user properties).
//!
//! # Acknowledgement and its correlation
//! rumqttc 0.25 has no per-publish ack future: its event loop reports `Outgoing::Publish(pkid)`
//! when it writes a publish (packet ids are assigned in request order) and `Incoming::PubAck`
//! when the broker answers. The transport owns its client: it records a waiter per publish in
//! request order, binds it to the packet id when the event loop reports the write, and completes
//! it with the PUBACK of that packet id. The whole batch is queued first and the PUBACKs awaited
//! afterwards (pipelined, up to the broker's Receive Maximum in flight). When the connection is
//! lost, every publish still waiting is reported `Unavailable` and dropped from the client's
//! queue (the relay publishes it again: at-least-once, the inbox absorbs copies); the client
//! reconnects by itself with a clean session.
//!
//! A PUBACK with a reason code ≥ 0x80 (not authorized, topic name invalid, quota exceeded,
//! payload format invalid, …) is not a success: `Unavailable` for 0x87 *Not authorized* (the
//! broker's ACL refuses this client the topic: a configuration fault that pauses the transport
//! and burns no attempt), permanent for 0x90/0x99 and retryable for the others. Reason 0x10 *No matching subscribers* means the broker accepted the message and
//! discarded it: MQTT keeps nothing for a topic nobody subscribes to (a consumer's persistent
//! session subscription counts, even offline). By default ([`NoSubscribers::Retry`]) it is a
//! retryable error, so nothing is marked SENT that no consumer can receive (the counterpart of
//! RabbitMQ's mandatory flag); [`NoSubscribers::Accept`] takes it as success.
//!
//! # MQTT 3.1.1
//! MQTT 3.1.1 has no user properties, so the message id and headers would have nowhere to go.
//! This transport speaks only MQTT 5 and refuses a broker that does not: `connect` fails with a
//! [`ConfigError`] on `url` saying so (an envelope encoding for 3.1.1 brokers is not provided).
//!
//! Broker reference: MQTT 5.0, OASIS Standard, §3.3 PUBLISH, §3.4 PUBACK
//! (<https://docs.oasis-open.org/mqtt/mqtt/v5.0/mqtt-v5.0.html>).

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use rumqttc::Outgoing as Written;
use rumqttc::v5::mqttbytes::QoS;
use rumqttc::v5::mqttbytes::v5::{
    ConnectReturnCode, Packet, PubAck, PubAckReason, Publish, PublishProperties,
};
use rumqttc::v5::{AsyncClient, ConnectionError, Event, EventLoop};
use tokio::sync::oneshot;

use super::wire::{self, Broker, Field, HeaderRules, WireError};
use super::{Acks, Outgoing, Transport};
use crate::error::{ConfigError, TransportError, TransportErrorKind};
use crate::message::{Headers, Message};

mod config;
pub use config::{BrokerAddress, MqttConfig, NoSubscribers, options, parse_url};

/// Explain a connection error, naming MQTT 3.1.1 when the broker refused the protocol version.
pub fn explain(e: &ConnectionError) -> String {
    match e {
        ConnectionError::ConnectionRefused(
            ConnectReturnCode::UnsupportedProtocolVersion
            | ConnectReturnCode::RefusedProtocolVersion,
        ) => format!(
            "the broker refused MQTT 5 ({e}); it probably speaks only MQTT 3.1.1, which has no \
             user properties for the message id and headers: outbox needs an MQTT 5 broker"
        ),
        ConnectionError::ConnectionRefused(
            ConnectReturnCode::BadUserNamePassword | ConnectReturnCode::NotAuthorized,
        ) => format!("the broker refused the credentials ({e})"),
        other => other.to_string(),
    }
}

/// Poll `eventloop` until the first CONNACK (success) or `timeout`.
///
/// # Errors
/// [`ConfigError`] naming `url` (or `password` for refused credentials), with [`explain`]'s text.
pub async fn first_connack(
    eventloop: &mut EventLoop,
    url: &str,
    timeout: Duration,
) -> Result<bool, ConfigError> {
    let wait = async {
        loop {
            match eventloop.poll().await {
                Ok(Event::Incoming(Packet::ConnAck(ack))) => return Ok(ack.session_present),
                Ok(_) => {}
                Err(e) => return Err(e),
            }
        }
    };
    match tokio::time::timeout(timeout + Duration::from_secs(1), wait).await {
        Ok(Ok(present)) => Ok(present),
        Ok(Err(e)) => {
            let field = match &e {
                ConnectionError::ConnectionRefused(
                    ConnectReturnCode::BadUserNamePassword | ConnectReturnCode::NotAuthorized,
                ) => "password",
                _ => "url",
            };
            let why = match &e {
                ConnectionError::MqttState(_) | ConnectionError::NotConnAck(_) => format!(
                    "{e}: the answer to the MQTT 5 CONNECT is not an MQTT 5 CONNACK; a broker \
                     that speaks only MQTT 3.1.1 answers this way, and outbox needs MQTT 5 (user \
                     properties carry the message id and headers)"
                ),
                other => explain(other),
            };
            Err(ConfigError::new(
                field,
                format!("cannot connect to the MQTT broker at {url}: {why}"),
            ))
        }
        Err(_) => Err(ConfigError::new(
            "url",
            format!("the MQTT broker at {url} did not answer within {timeout:?}"),
        )),
    }
}

/// The user properties for `m`: every wire header.
pub fn user_properties(m: &Message) -> Vec<(String, String)> {
    m.wire_headers().into_iter().collect()
}

/// Headers from received user properties (the last value of a repeated name wins).
pub fn headers_from(properties: Option<&PublishProperties>) -> Headers {
    properties
        .map(|p| p.user_properties.iter().cloned().collect())
        .unwrap_or_default()
}

/// Check a topic name for publishing (MQTT 5 §4.7): 1 to 65,535 bytes, no `+` or `#`, no NUL,
/// not starting with `$` (reserved for the broker).
pub fn validate_topic(topic: &str) -> Result<(), String> {
    if topic.is_empty()
        || topic.len() > 65535
        || topic.contains(['+', '#', '\0'])
        || topic.starts_with('$')
    {
        Err(format!(
            "invalid MQTT topic {topic:?}: 1 to 65,535 bytes, no wildcards (+ #) or NUL, not starting with $"
        ))
    } else {
        Ok(())
    }
}

/// An MQTT UTF-8 string as every receiver accepts it (MQTT 5 §1.5.4; see the module docs).
fn mqtt_string(s: &str) -> Result<(), &'static str> {
    if s.len() > 65_535 {
        Err("an MQTT string is at most 65,535 bytes")
    } else if s
        .chars()
        .any(|c| c.is_control() || wire::is_noncharacter(c))
    {
        Err(
            "an MQTT string has no control character (U+0000..U+001F, U+007F..U+009F, tab included) or Unicode noncharacter",
        )
    } else {
        Ok(())
    }
}

/// User properties are pairs of MQTT UTF-8 strings.
const MQTT_PROPERTIES: HeaderRules = HeaderRules {
    broker: Broker::Mqtt,
    name: mqtt_string,
    value: mqtt_string,
};

/// What MQTT 5 cannot carry (see the module docs): a pure function of the message.
///
/// # Errors
/// A permanent error whose source is a [`WireError`] naming the topic, header or key.
pub(crate) fn check_message(out: &Outgoing<'_>) -> Result<(), TransportError> {
    if validate_topic(out.destination).is_err() || mqtt_string(out.destination).is_err() {
        return Err(WireError::unsupported(
            Broker::Mqtt,
            Field::Destination(out.destination.to_owned()),
            "an MQTT publish topic is 1 to 65,535 bytes without wildcards (+ #), control characters or noncharacters, not starting with $",
        )
        .into());
    }
    wire::check_headers(out.message, &MQTT_PROPERTIES)?;
    Ok(())
}

/// Success or the classified error of a PUBACK.
fn puback_result(ack: &PubAck, no_subscribers: NoSubscribers) -> Result<(), TransportError> {
    let reason = ack
        .properties
        .as_ref()
        .and_then(|p| p.reason_string.clone())
        .map(|s| format!(": {s}"))
        .unwrap_or_default();
    match ack.reason {
        PubAckReason::Success => Ok(()),
        PubAckReason::NoMatchingSubscribers => match no_subscribers {
            NoSubscribers::Accept => Ok(()),
            NoSubscribers::Retry => Err(TransportError::retryable(format!(
                "PUBACK 0x10 no matching subscribers{reason}: the broker discarded the message \
                 (no consumer session subscribes to the topic)"
            ))),
        },
        // The broker's ACL refuses this client the topic: the transport's configuration, not the
        // message; the relay pauses the transport and publishes once the ACL allows it.
        PubAckReason::NotAuthorized => Err(TransportError::unavailable(format!(
            "PUBACK refused: NotAuthorized{reason} (the broker's ACL refuses this client the topic)"
        ))),
        PubAckReason::TopicNameInvalid | PubAckReason::PayloadFormatInvalid => Err(
            TransportError::permanent(format!("PUBACK refused: {:?}{reason}", ack.reason)),
        ),
        other => Err(TransportError::retryable(format!(
            "PUBACK refused: {other:?}{reason}"
        ))),
    }
}

type Waiter = oneshot::Sender<Result<(), TransportError>>;

/// Publishes waiting for their packet id (in request order) or their PUBACK.
#[derive(Default)]
struct Waiters {
    queued: VecDeque<Waiter>,
    collided: Option<Waiter>,
    inflight: HashMap<u16, Waiter>,
    connected: bool,
}

impl Waiters {
    fn fail_all(&mut self, why: &str) {
        let err = || Err(TransportError::unavailable(why.to_owned()));
        for w in self.queued.drain(..) {
            let _ = w.send(err());
        }
        if let Some(w) = self.collided.take() {
            let _ = w.send(err());
        }
        for (_, w) in self.inflight.drain() {
            let _ = w.send(err());
        }
    }
}

/// A QoS 1 publisher with PUBACK correlation (see the module docs), shared by the transport and
/// the confirmation sender.
pub struct Publisher {
    client: AsyncClient,
    waiters: Arc<Mutex<Waiters>>,
    driver: tokio::task::JoinHandle<()>,
    ack_timeout: Duration,
    no_subscribers: NoSubscribers,
    url: String,
}

impl Drop for Publisher {
    fn drop(&mut self) {
        self.driver.abort();
    }
}

impl Publisher {
    /// Connect with a clean session and start the event-loop task.
    ///
    /// # Errors
    /// [`ConfigError`] naming `url`, `client_id` or `password`.
    pub async fn connect(config: &MqttConfig) -> Result<Publisher, ConfigError> {
        let mut o = options(
            &config.url,
            &config.client_id,
            config.username.as_deref(),
            config.password.as_deref(),
            config.keep_alive,
            config.connect_timeout,
        )?;
        o.set_clean_start(true);
        o.set_outgoing_inflight_upper_limit(config.max_inflight.max(1));
        let (client, mut eventloop) = AsyncClient::new(o, 65_536);
        first_connack(&mut eventloop, &config.url, config.connect_timeout).await?;
        let waiters = Arc::new(Mutex::new(Waiters {
            connected: true,
            ..Default::default()
        }));
        let driver = tokio::spawn(drive(eventloop, waiters.clone(), config.no_subscribers));
        Ok(Publisher {
            client,
            waiters,
            driver,
            ack_timeout: config.ack_timeout,
            no_subscribers: config.no_subscribers,
            url: config.url.clone(),
        })
    }

    /// Queue a QoS 1 publish and return the receiver of its PUBACK result.
    fn send(
        &self,
        topic: &str,
        payload: Bytes,
        properties: PublishProperties,
    ) -> oneshot::Receiver<Result<(), TransportError>> {
        let (tx, rx) = oneshot::channel();
        if let Err(reason) = validate_topic(topic) {
            let _ = tx.send(Err(TransportError::permanent(reason)));
            return rx;
        }
        let mut w = self.waiters.lock().expect("poisoned");
        if !w.connected {
            let _ = tx.send(Err(TransportError::unavailable(format!(
                "not connected to the MQTT broker at {}",
                self.url
            ))));
            return rx;
        }
        // Waiter first, then the request, under the lock: the event loop binds packet ids to
        // waiters in this order.
        w.queued.push_back(tx);
        if let Err(e) = self.client.try_publish_with_properties(
            topic,
            QoS::AtLeastOnce,
            false,
            payload,
            properties,
        ) {
            let tx = w.queued.pop_back().expect("just pushed");
            let _ = tx.send(Err(TransportError::retryable(format!(
                "MQTT client queue refused the publish: {e}"
            ))));
        }
        rx
    }

    /// Await `pending` PUBACKs until the ack timeout.
    async fn wait(
        &self,
        pending: Vec<oneshot::Receiver<Result<(), TransportError>>>,
    ) -> Vec<Result<(), TransportError>> {
        let acks = Acks::new(pending.len());
        self.wait_each(pending, &acks).await;
        acks.into_results()
    }

    /// As `wait`, recording each PUBACK's result in `acks` (in order) as it arrives.
    async fn wait_each(
        &self,
        pending: Vec<oneshot::Receiver<Result<(), TransportError>>>,
        acks: &Acks,
    ) {
        let deadline = tokio::time::Instant::now() + self.ack_timeout;
        for rx in pending {
            acks.push(match tokio::time::timeout_at(deadline, rx).await {
                Ok(Ok(r)) => r,
                Ok(Err(_)) => Err(TransportError::unavailable("MQTT event loop stopped")),
                Err(_) => Err(TransportError::retryable(format!(
                    "no PUBACK within {:?}",
                    self.ack_timeout
                ))),
            });
        }
    }

    /// Publish one message at QoS 1 and wait for its PUBACK.
    ///
    /// # Errors
    /// As [`MqttTransport`] classifies them.
    pub async fn publish_one(
        &self,
        topic: &str,
        payload: Bytes,
        properties: PublishProperties,
    ) -> Result<(), TransportError> {
        let rx = self.send(topic, payload, properties);
        self.wait(vec![rx]).await.pop().expect("one result")
    }

    /// Whether the event loop is connected.
    pub fn is_connected(&self) -> bool {
        self.waiters.lock().expect("poisoned").connected
    }

    /// What a PUBACK *No matching subscribers* means for this publisher.
    pub fn no_subscribers(&self) -> NoSubscribers {
        self.no_subscribers
    }
}

/// The publisher's event loop: bind packet ids, complete PUBACKs, fail everything on a lost
/// connection and reconnect with backoff.
async fn drive(
    mut eventloop: EventLoop,
    waiters: Arc<Mutex<Waiters>>,
    no_subscribers: NoSubscribers,
) {
    let mut failures = 0u32;
    loop {
        match eventloop.poll().await {
            Ok(event) => {
                failures = 0;
                let mut w = waiters.lock().expect("poisoned");
                match event {
                    Event::Outgoing(Written::Publish(pkid)) => {
                        let waiter = w.collided.take().or_else(|| w.queued.pop_front());
                        if let Some(waiter) = waiter {
                            w.inflight.insert(pkid, waiter);
                        }
                    }
                    Event::Outgoing(Written::AwaitAck(_)) => {
                        w.collided = w.queued.pop_front();
                    }
                    Event::Incoming(Packet::PubAck(ack)) => {
                        if let Some(waiter) = w.inflight.remove(&ack.pkid) {
                            let _ = waiter.send(puback_result(&ack, no_subscribers));
                        }
                    }
                    Event::Incoming(Packet::ConnAck(_)) => {
                        if !w.connected {
                            tracing::info!("MQTT publisher reconnected");
                        }
                        w.connected = true;
                    }
                    Event::Incoming(Packet::Disconnect(d)) => {
                        tracing::warn!(reason = ?d.reason_code, "the MQTT broker disconnected the publisher");
                    }
                    _ => {}
                }
            }
            Err(e) => {
                failures += 1;
                {
                    let mut w = waiters.lock().expect("poisoned");
                    // Drop every queued request and buffered event: nothing of the old
                    // connection may bind to a new waiter; the relay publishes them again.
                    eventloop.clean();
                    eventloop.pending.clear();
                    eventloop.state.events.clear();
                    eventloop.state.collision = None;
                    let was = w.connected;
                    w.connected = false;
                    w.fail_all(&format!("MQTT connection lost: {}", explain(&e)));
                    if was {
                        tracing::warn!(error = %explain(&e), "MQTT publisher connection lost; reconnecting");
                    }
                }
                let delay = Duration::from_millis(100 * 2u64.pow(failures.min(5)));
                tokio::time::sleep(delay).await;
            }
        }
    }
}

/// Publishes to an MQTT 5 broker (see the module docs).
pub struct MqttTransport {
    publisher: Publisher,
}

impl std::fmt::Debug for MqttTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MqttTransport")
            .field("url", &crate::redact::url(&self.publisher.url))
            .finish_non_exhaustive()
    }
}

impl MqttTransport {
    /// Connect (MQTT 5, clean session) and start the event loop.
    ///
    /// # Errors
    /// [`ConfigError`] naming `url` (unreachable broker, a broker that does not speak MQTT 5),
    /// `client_id`, or `password` (refused credentials).
    pub async fn connect(config: MqttConfig) -> Result<Self, ConfigError> {
        Ok(MqttTransport {
            publisher: Publisher::connect(&config).await?,
        })
    }

    /// The publisher (for the confirmation sender).
    pub fn publisher(&self) -> &Publisher {
        &self.publisher
    }
}

/// The publish properties of `m` (see the module docs).
pub fn publish_properties(m: &Message) -> PublishProperties {
    PublishProperties {
        user_properties: user_properties(m),
        correlation_data: Some(Bytes::copy_from_slice(m.message_id.as_bytes())),
        content_type: m.headers.get("content-type").cloned(),
        ..Default::default()
    }
}

#[async_trait]
impl Transport for MqttTransport {
    fn name(&self) -> &str {
        "mqtt"
    }

    fn check(&self, out: &Outgoing<'_>) -> Result<(), TransportError> {
        check_message(out)
    }

    async fn publish_each(&self, batch: &[Outgoing<'_>], acks: &Acks) {
        let pending: Vec<_> = batch
            .iter()
            .map(|o| {
                if let Err(refused) = self.check(o) {
                    let (tx, rx) = oneshot::channel();
                    let _ = tx.send(Err(refused));
                    return rx;
                }
                self.publisher.send(
                    o.destination,
                    Bytes::from(o.message.payload.clone()),
                    publish_properties(o.message),
                )
            })
            .collect();
        self.publisher.wait_each(pending, acks).await
    }

    async fn probe(&self) -> Result<(), TransportError> {
        if self.publisher.is_connected() {
            Ok(())
        } else {
            Err(TransportError::unavailable(format!(
                "not connected to the MQTT broker at {}",
                self.publisher.url
            )))
        }
    }
}

/// The [`TransportErrorKind`] of a PUBACK reason (for tests and tools).
pub fn puback_kind(reason: PubAckReason) -> Option<TransportErrorKind> {
    puback_result(
        &PubAck {
            pkid: 1,
            reason,
            properties: None,
        },
        NoSubscribers::Retry,
    )
    .err()
    .map(|e| e.kind())
}

/// Build a received publish's headers and payload (for the consumer and tests).
pub fn decode(p: &Publish) -> (Headers, Vec<u8>) {
    (headers_from(p.properties.as_ref()), p.payload.to_vec())
}

#[cfg(test)]
mod tests;
