//! MQTT 5 consumer runner feeding an [`Inbox`].
//!
//! - **Session**: MQTT 5 with a stable `client_id`, `clean_start = false` and a session expiry
//!   (default 1 day), so the broker keeps the subscription and the QoS 1 messages not yet
//!   acknowledged while the consumer is away, and sends them again (DUP) when it reconnects
//!   (MQTT 5 §4.4). The broker holds at most `receive_maximum` unacknowledged messages in flight
//!   to this client.
//! - **Subscription**: QoS 1 to `filter`, or to `$share/<group>/<filter>` when `group` is set, so
//!   instances with the same group share the messages (MQTT 5 §4.8.2, shared subscriptions).
//! - **Acknowledgement**: manual; the PUBACK is sent only after the inbox transaction committed
//!   (applied, rejected, duplicate or dead-lettered), so nothing is acknowledged that was not
//!   stored (shared case C27).
//! - **Concurrency**: `concurrency` lanes by partition key
//!   ([`lane_of`](crate::consumer::lane_of)): one key's messages are applied one after the other
//!   in arrival order, different lanes in parallel.
//! - **Retry with backoff**: MQTT has no negative acknowledgement and no delayed redelivery. A
//!   message whose handler failed transiently stays unacknowledged (the broker still holds it for
//!   this session) and the [`MqttSource`] delivers it again after the [`Backoff`](crate::Backoff) delay for its
//!   delivery count, counting deliveries itself (1, then 2, …; a copy the broker redelivered
//!   with the DUP flag starts at 2), until [`DeliveryPolicy::max_deliveries`] dead-letters it.
//!   While it waits, later messages of its partition key wait behind it, so they never overtake
//!   it. If the consumer dies meanwhile, the broker redelivers the unacknowledged message when
//!   the session reconnects.
//! - **Malformed** messages (no `outbox-message-id` user property, e.g. published by a plain
//!   MQTT client or over MQTT 3.1.1) are logged, counted in [`ConsumerMetrics::malformed`] and
//!   acknowledged.
//!
//! Traps: Mosquitto queues at most `max_queued_messages` (default 1,000) QoS 1 messages per
//! offline session and drops the rest; raise it for consumers that may fall behind. A message
//! published while no session subscribes to its topic is discarded by the broker (the
//! transport's [`NoSubscribers`](crate::transport::mqtt::NoSubscribers) default makes the relay
//! retry it).

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;

use rumqttc::v5::mqttbytes::QoS;
use rumqttc::v5::mqttbytes::v5::{Packet, Publish};
use rumqttc::v5::{AsyncClient, Event, EventLoop};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::{CancellationToken, DropGuard};

use crate::consumer::source::{
    ConsumeOptions, Delivery, Envelope, Settle, Source, SourceConfig, SourceError,
};
use crate::consumer::{ConsumerMetrics, RunnerSettings};
use crate::error::ConfigError;
use crate::message::HEADER_PARTITION_KEY;
use crate::transport::mqtt::{decode, explain, first_connack, options};

/// Settings of an MQTT consumer runner.
#[derive(Clone, derive_more::Debug)]
pub struct MqttConsumerConfig {
    /// Broker URL, `mqtt://…` or `mqtts://…`. Required.
    #[debug("{:?}", crate::redact::url(url))]
    pub url: String,
    /// Client identifier of the persistent session; stable per instance (the broker keeps the
    /// session's unacknowledged messages under it). Required.
    pub client_id: String,
    /// User name, overriding one in the URL. Default none.
    pub username: Option<String>,
    /// Password, overriding one in the URL. Default none.
    #[debug("{:?}", crate::redact::secret(password))]
    pub password: Option<String>,
    /// Topic filter, e.g. `orders/#`. Required.
    pub filter: String,
    /// Shared-subscription group: subscribe to `$share/<group>/<filter>` so instances share the
    /// work. Default none (every instance gets every message).
    pub group: Option<String>,
    /// How long the broker keeps the session after a disconnect. Default 1 day.
    pub session_expiry: Duration,
    /// Unacknowledged messages the broker may have in flight to this consumer (MQTT 5 Receive
    /// Maximum): the batch the consumer works on. Default 100.
    pub receive_maximum: u16,
    /// After the first message of a fetch, how long to wait for more before the batch is
    /// handed to the runner (each arrival ends the wait early once `receive_maximum` or the
    /// runner's batch is full). With `runner.inbox_batch` above 1, messages that arrive a few
    /// milliseconds apart then share one inbox transaction. Default 0: the batch is the first
    /// message and whatever has already arrived (as Kafka's `batch_wait`, whose default is
    /// 20 ms).
    pub batch_wait: Duration,
    /// Lanes, retries, dead letters, confirmations and inbox upkeep: the settings every
    /// runner shares ([`RunnerSettings`], with its defaults).
    pub runner: RunnerSettings,
    /// Keep-alive interval. Default 30 s.
    pub keep_alive: Duration,
    /// How long to wait for the first CONNACK. Default 5 s.
    pub connect_timeout: Duration,
}

crate::consumer::with_confirmations!(MqttConsumerConfig);

impl MqttConsumerConfig {
    /// Settings with the defaults.
    pub fn new(
        url: impl Into<String>,
        client_id: impl Into<String>,
        filter: impl Into<String>,
    ) -> Self {
        MqttConsumerConfig {
            url: url.into(),
            client_id: client_id.into(),
            username: None,
            password: None,
            filter: filter.into(),
            group: None,
            session_expiry: Duration::from_secs(24 * 3600),
            receive_maximum: 100,
            batch_wait: Duration::ZERO,
            runner: RunnerSettings::default(),
            keep_alive: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(5),
        }
    }

    /// The subscription's topic filter: `$share/<group>/<filter>` or `filter`.
    pub fn subscription(&self) -> String {
        match &self.group {
            Some(g) => format!("$share/{g}/{}", self.filter),
            None => self.filter.clone(),
        }
    }

    /// Check the settings without connecting.
    ///
    /// # Errors
    /// [`ConfigError`] naming `filter`, `group`, `client_id`, `receive_maximum` or a `runner.*`
    /// field.
    pub fn validate(&self) -> Result<(), ConfigError> {
        validate_filter(&self.filter).map_err(|r| ConfigError::new("filter", r))?;
        if let Some(g) = &self.group
            && (g.is_empty() || g.contains(['/', '+', '#']))
        {
            return Err(ConfigError::new(
                "group",
                "a shared-subscription group is non-empty, without / + #",
            ));
        }
        ConfigError::invalid_if(
            self.client_id.is_empty(),
            "client_id",
            "a persistent session needs a stable, non-empty client id",
        )?;
        ConfigError::invalid_if(
            self.receive_maximum == 0,
            "receive_maximum",
            "must be at least 1",
        )?;
        self.runner.validate()
    }
}

/// Check a topic filter (MQTT 5 §4.7.1): non-empty, `#` only as the last level, `+` only as a
/// whole level, no NUL.
pub fn validate_filter(filter: &str) -> Result<(), String> {
    let levels: Vec<&str> = filter.split('/').collect();
    let ok = !filter.is_empty()
        && !filter.contains('\0')
        && levels.iter().enumerate().all(|(i, l)| {
            (!l.contains('#') || (*l == "#" && i == levels.len() - 1))
                && (!l.contains('+') || *l == "+")
        });
    if ok {
        Ok(())
    } else {
        Err(format!(
            "invalid MQTT topic filter {filter:?}: `+` only as a whole level, `#` only as the last level"
        ))
    }
}

/// Start the persistent session of `c` (its event loop) and subscribe to `subscription`:
/// returns the client and the event loop.
///
/// # Errors
/// [`ConfigError`] naming `url`, `client_id`, `password` or `filter`.
pub(crate) async fn open_session(
    c: &MqttConsumerConfig,
    subscription: &str,
) -> Result<(AsyncClient, EventLoop), ConfigError> {
    let mut o = options(
        &c.url,
        &c.client_id,
        c.username.as_deref(),
        c.password.as_deref(),
        c.keep_alive,
        c.connect_timeout,
    )?;
    o.set_clean_start(false);
    o.set_session_expiry_interval(Some(
        u32::try_from(c.session_expiry.as_secs()).unwrap_or(u32::MAX),
    ));
    o.set_manual_acks(true);
    o.set_receive_maximum(Some(c.receive_maximum.max(1)));
    let (client, mut eventloop) = AsyncClient::new(o, 10_000);
    first_connack(&mut eventloop, &c.url, c.connect_timeout).await?;
    client
        .subscribe(subscription, QoS::AtLeastOnce)
        .await
        .map_err(|e| {
            ConfigError::new("filter", format!("cannot subscribe to {subscription}: {e}"))
        })?;
    Ok((client, eventloop))
}

/// Poll `eventloop` for the next received publish until `cancel`, re-subscribing after a
/// reconnection without the session, logging errors and backing off; `None` once cancelled or
/// once the client's DISCONNECT was written and the broker closed the connection.
pub(crate) async fn next_publish(
    eventloop: &mut EventLoop,
    client: &AsyncClient,
    subscription: &str,
    failures: &mut u32,
    cancel: &CancellationToken,
) -> Option<Publish> {
    // Set once our DISCONNECT is written: from then on, wait for the broker to close the
    // connection. It closes it after it has read the DISCONNECT, so after every PUBACK written
    // before it; a new session of the same client id opened earlier could take the session over
    // while those PUBACKs were still unread, and get the messages again.
    let mut disconnecting = false;
    loop {
        let polled = tokio::select! {
            _ = cancel.cancelled() => return None,
            p = eventloop.poll() => p,
        };
        if disconnecting {
            match polled {
                Err(_) => return None,
                // A publish arriving now is not acknowledged: it comes again.
                Ok(_) => continue,
            }
        }
        match polled {
            Ok(Event::Incoming(Packet::Publish(p))) => {
                *failures = 0;
                return Some(p);
            }
            Ok(Event::Incoming(Packet::ConnAck(ack))) => {
                *failures = 0;
                tracing::info!(
                    session_present = ack.session_present,
                    "MQTT consumer reconnected"
                );
                if !ack.session_present
                    && let Err(e) = client.try_subscribe(subscription, QoS::AtLeastOnce)
                {
                    tracing::warn!(error = %e, "re-subscribing failed");
                }
            }
            Ok(Event::Incoming(Packet::SubAck(ack))) => {
                tracing::debug!(codes = ?ack.return_codes, "subscribed");
            }
            // Our own DISCONNECT is written (after every request queued before it): the end,
            // once the broker has closed the connection.
            Ok(Event::Outgoing(rumqttc::Outgoing::Disconnect)) => disconnecting = true,
            Ok(_) => {}
            Err(e) => {
                *failures += 1;
                tracing::warn!(error = %explain(&e), "MQTT consumer connection failed; reconnecting");
                let delay = Duration::from_millis(100 * 2u64.pow((*failures).min(5)));
                tokio::select! {
                    _ = cancel.cancelled() => return None,
                    _ = tokio::time::sleep(delay) => {}
                }
            }
        }
    }
}

/// A message held by the [`MqttSource`] for a later delivery: a retry, or a later message of a
/// key whose earlier message waits for its retry.
struct Parked {
    due: Instant,
    publish: Publish,
    delivery_count: u32,
    key: Option<String>,
}

/// The MQTT 5 [`Source`]: a persistent session with manual acknowledgement (see the module docs).
///
/// A task polls the session's event loop all the time (keep-alives, reconnections, PUBACKs) and
/// hands received publishes over; retries are kept here until due, in order, and a message of a
/// key with a retry pending waits behind it.
pub struct MqttSource {
    config: MqttConsumerConfig,
    client: Option<AsyncClient>,
    received: Option<mpsc::Receiver<Publish>>,
    /// Stops the event-loop task when the source is dropped or reopened.
    pump: Option<DropGuard>,
    /// The event-loop task, awaited by [`Source::close`] until its DISCONNECT is written.
    pump_task: Option<tokio::task::JoinHandle<()>>,
    parked: VecDeque<Parked>,
}

impl MqttSource {
    /// A source for `config` (validated; nothing is contacted until [`Source::open`]).
    ///
    /// # Errors
    /// [`ConfigError`] naming the invalid field.
    pub fn new(config: MqttConsumerConfig) -> Result<Self, ConfigError> {
        config.validate()?;
        Ok(MqttSource {
            config,
            client: None,
            received: None,
            pump: None,
            pump_task: None,
            parked: VecDeque::new(),
        })
    }

    fn delivery(&self, publish: Publish, delivery_count: u32) -> Delivery<Publish> {
        let (headers, payload) = decode(&publish);
        Delivery {
            envelope: Envelope {
                headers,
                payload,
                delivery_count,
                origin: format!("topic {}", String::from_utf8_lossy(&publish.topic)),
            },
            token: publish,
        }
    }

    /// Park `publish` behind the last parked message of its key; `false` when its key has none.
    fn hold(&mut self, publish: &Publish, count: u32) -> bool {
        let (headers, _) = decode(publish);
        let Some(key) = headers.get(HEADER_PARTITION_KEY).cloned() else {
            return false;
        };
        let Some(due) = self
            .parked
            .iter()
            .filter(|p| p.key.as_deref() == Some(key.as_str()))
            .map(|p| p.due)
            .max()
        else {
            return false;
        };
        self.park(Parked {
            due,
            publish: publish.clone(),
            delivery_count: count,
            key: Some(key),
        });
        true
    }

    /// Insert in due order, after those due at the same time (keeps a key's order).
    fn park(&mut self, p: Parked) {
        let at = self.parked.partition_point(|q| q.due <= p.due);
        self.parked.insert(at, p);
    }
}

#[async_trait]
impl Source for MqttSource {
    type Token = Publish;

    fn describe(&self) -> String {
        format!(
            "MQTT subscription {} as {}",
            self.config.subscription(),
            self.config.client_id
        )
    }

    async fn open(&mut self) -> Result<(), SourceError> {
        self.pump = None;
        self.pump_task = None;
        let c = &self.config;
        let subscription = c.subscription();
        let (client, mut eventloop) = open_session(c, &subscription).await?;
        let (tx, rx) = mpsc::channel(usize::from(c.receive_maximum.max(1)));
        let stop = CancellationToken::new();
        let pump = {
            let (client, stop) = (client.clone(), stop.clone());
            async move {
                let mut failures = 0u32;
                let mut forwarding = true;
                while let Some(p) =
                    next_publish(&mut eventloop, &client, &subscription, &mut failures, &stop).await
                {
                    if forwarding && tx.send(p).await.is_err() {
                        // The source is closing: keep polling so that the PUBACKs queued
                        // before its DISCONNECT are written; what arrives now is not
                        // acknowledged and comes again.
                        forwarding = false;
                    }
                }
            }
        };
        self.pump_task = Some(tokio::spawn(pump));
        self.pump = Some(stop.drop_guard());
        self.client = Some(client);
        self.received = Some(rx);
        Ok(())
    }

    async fn fetch(&mut self, max: usize) -> Result<Vec<Delivery<Publish>>, SourceError> {
        let max = max.min(usize::from(self.config.receive_maximum)).max(1);
        let now = Instant::now();
        let mut out = Vec::new();
        while out.len() < max && self.parked.front().is_some_and(|p| p.due <= now) {
            let p = self.parked.pop_front().expect("front exists");
            out.push(self.delivery(p.publish, p.delivery_count));
        }
        if !out.is_empty() {
            return Ok(out);
        }
        let next_due = self.parked.front().map(|p| p.due);
        let rx = self
            .received
            .as_mut()
            .ok_or_else(|| SourceError::Lost("not open".into()))?;
        let first = tokio::select! {
            r = rx.recv() => r.ok_or_else(|| SourceError::Lost("the session's event loop ended".into()))?,
            _ = tokio::time::sleep_until(next_due.unwrap_or(now + Duration::from_secs(3600))), if next_due.is_some() => {
                return Ok(Vec::new());
            }
        };
        let mut fresh = vec![first];
        let linger_until = tokio::time::Instant::now() + self.config.batch_wait;
        while fresh.len() < max {
            match rx.try_recv() {
                Ok(p) => fresh.push(p),
                Err(_) if self.config.batch_wait.is_zero() => break,
                Err(_) => match tokio::time::timeout_at(linger_until, rx.recv()).await {
                    Ok(Some(p)) => fresh.push(p),
                    // The wait is over, or the event loop ended (the next fetch reports it).
                    Ok(None) | Err(_) => break,
                },
            }
        }
        for p in fresh {
            let count = if p.dup { 2 } else { 1 };
            if !self.hold(&p, count) {
                out.push(self.delivery(p, count));
            }
        }
        Ok(out)
    }

    /// Flush before leaving: `settle` only queues each PUBACK for the event loop, so stopping
    /// the loop at once could drop the last batch's acknowledgements and have the broker deliver
    /// it again to the next session (the inbox would recognise the copies, but the work is
    /// wasted). Queue a DISCONNECT behind them and keep the loop running until it is written and
    /// the broker has closed the connection (so it has read every PUBACK before a next session
    /// of this client id can take the session over), at most 2 s.
    async fn close(&mut self) {
        self.received = None;
        if let (Some(client), Some(task)) = (self.client.take(), self.pump_task.take()) {
            let flushed = tokio::time::timeout(Duration::from_secs(2), async move {
                let _ = client.disconnect().await;
                let _ = task.await;
            });
            if flushed.await.is_err() {
                tracing::warn!(
                    "MQTT consumer: the broker did not close the session within 2 s of the DISCONNECT; \
                     acknowledgements not yet read by it come again"
                );
            }
        }
        self.pump = None;
    }

    async fn settle(&mut self, batch: Vec<(Delivery<Publish>, Settle)>) -> Result<(), SourceError> {
        let client = self
            .client
            .clone()
            .ok_or_else(|| SourceError::Lost("not open".into()))?;
        let now = Instant::now();
        for (d, s) in batch {
            match s {
                Settle::Ack | Settle::Reject(_) => {
                    // Committed (or unusable); a lost PUBACK means a redelivery the inbox
                    // recognises.
                    if let Err(e) = client.ack(&d.token).await {
                        tracing::warn!(error = %e, origin = %d.envelope.origin, "PUBACK failed");
                    }
                }
                Settle::Retry(delay) => self.park(Parked {
                    due: now + delay,
                    key: d.envelope.headers.get(HEADER_PARTITION_KEY).cloned(),
                    delivery_count: d.envelope.delivery_count.saturating_add(1),
                    publish: d.token,
                }),
            }
        }
        Ok(())
    }
}

// This broker's consumer is the generic runner over its source: `mqtt::run(config, …)`.
pub use crate::consumer::run;

/// [`run`] consumes with a [`MqttSource`] built from these settings.
///
/// # Errors of `run`
/// [`ConfigError`] naming the field ([`MqttConsumerConfig::validate`]), `url` when the broker
/// cannot be reached at start (or does not speak MQTT 5), `password` for refused credentials.
/// Later connection errors are logged and the session reconnects with backoff.
impl SourceConfig for MqttConsumerConfig {
    type Source = MqttSource;

    fn options(&self) -> ConsumeOptions {
        ConsumeOptions::new(&self.runner, usize::from(self.receive_maximum))
    }

    fn into_source(self, _metrics: &Arc<ConsumerMetrics>) -> Result<MqttSource, ConfigError> {
        MqttSource::new(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filters_and_config_are_validated() {
        for ok in ["a/b", "a/+/c", "a/#", "#", "+"] {
            assert!(validate_filter(ok).is_ok(), "{ok}");
        }
        for bad in ["", "a/#/b", "a/b#", "a+/b"] {
            assert!(validate_filter(bad).is_err(), "{bad:?}");
        }
        let mut c = MqttConsumerConfig::new("mqtt://x", "c1", "orders/#");
        c.validate().unwrap();
        assert_eq!(c.subscription(), "orders/#");
        c.group = Some("billing".into());
        assert_eq!(c.subscription(), "$share/billing/orders/#");
        c.group = Some("a/b".into());
        assert_eq!(c.validate().unwrap_err().field, "group");
        let c = MqttConsumerConfig::new("mqtt://x", "", "t");
        assert_eq!(c.validate().unwrap_err().field, "client_id");
    }
}
