//! NATS JetStream transport: publish with `Nats-Msg-Id` = message id and await the PubAck.
//!
//! The whole batch is sent first and the acknowledgements are awaited afterwards (pipelined).
//! JetStream's duplicate window (default 2 minutes) drops a re-publish of the same message id,
//! so a relay that dies after the broker acknowledged but before it recorded SENT does not put
//! a second copy in the stream if it comes back within the window; past it, the consumer's inbox
//! absorbs the copy.
//!
//! Classification: not connected → `Unavailable`; ack timeout, broken pipe, too many pending acks
//! → retryable; no stream for the subject, message over the server's `max_payload` → permanent.

use std::time::Duration;

use async_nats::connection::State;
use async_nats::jetstream::context::PublishErrorKind;
use async_nats::jetstream::message::PublishMessage;
use async_nats::jetstream::{self, stream};
use async_trait::async_trait;

use super::{Acks, Outgoing, Transport};
use crate::error::{ConfigError, TransportError, TransportErrorKind};

/// NATS transport settings.
#[derive(Debug, Clone)]
pub struct NatsConfig {
    /// Server URL, e.g. `nats://127.0.0.1:4222`. Required.
    pub url: String,
    /// The stream that captures the published subjects, if the transport should check or create it.
    /// Default: none (the stream is managed elsewhere).
    pub stream: Option<StreamSetup>,
    /// How long to wait for one PubAck. Default 5 s.
    pub ack_timeout: Duration,
}

impl NatsConfig {
    /// Settings for `url` with the defaults.
    pub fn new(url: impl Into<String>) -> Self {
        NatsConfig {
            url: url.into(),
            stream: None,
            ack_timeout: Duration::from_secs(5),
        }
    }
}

/// A stream to check (and create when `create` is true) at start-up.
#[derive(Debug, Clone)]
pub struct StreamSetup {
    /// Stream name.
    pub name: String,
    /// Subjects it captures, e.g. `["orders.>"]`.
    pub subjects: Vec<String>,
    /// Create the stream (file storage, duplicate window 2 min) when it does not exist. Default true.
    pub create: bool,
}

/// Publishes to JetStream (see the module docs).
#[derive(Debug, Clone)]
pub struct NatsTransport {
    client: async_nats::Client,
    js: jetstream::Context,
}

impl NatsTransport {
    /// Connect to the server and check or create the configured stream.
    ///
    /// # Errors
    /// [`ConfigError`] naming `url` when the server cannot be reached, or `stream` when the stream
    /// is missing and may not be created, or cannot be created.
    pub async fn connect(config: NatsConfig) -> Result<Self, ConfigError> {
        let client = async_nats::ConnectOptions::new()
            .retry_on_initial_connect()
            .connection_timeout(Duration::from_secs(5))
            .connect(config.url.as_str())
            .await
            .map_err(|e| {
                ConfigError::new(
                    "url",
                    format!("cannot connect to NATS at {}: {e}", config.url),
                )
            })?;
        // Wait for the first connection so a wrong address is reported now, not as unavailability.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while client.connection_state() != State::Connected {
            if tokio::time::Instant::now() > deadline {
                return Err(ConfigError::new(
                    "url",
                    format!("cannot connect to NATS at {}", config.url),
                ));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Self::from_client(client, config).await
    }

    /// Use an existing client.
    ///
    /// # Errors
    /// As [`NatsTransport::connect`] for the stream.
    pub async fn from_client(
        client: async_nats::Client,
        config: NatsConfig,
    ) -> Result<Self, ConfigError> {
        let js = jetstream::context::ContextBuilder::default()
            .timeout(config.ack_timeout)
            .max_ack_inflight(20_000)
            .backpressure_on_inflight(true)
            .build(client.clone());
        if let Some(s) = &config.stream {
            match js.get_stream(&s.name).await {
                Ok(_) => {}
                Err(_) if s.create => {
                    js.get_or_create_stream(stream::Config {
                        name: s.name.clone(),
                        subjects: s.subjects.clone(),
                        duplicate_window: Duration::from_secs(120),
                        ..Default::default()
                    })
                    .await
                    .map_err(|e| {
                        ConfigError::new("stream", format!("cannot create stream {}: {e}", s.name))
                    })?;
                }
                Err(e) => {
                    return Err(ConfigError::new(
                        "stream",
                        format!("stream {} not found: {e}", s.name),
                    ));
                }
            }
        }
        Ok(NatsTransport { client, js })
    }

    /// The JetStream context.
    pub fn jetstream(&self) -> &jetstream::Context {
        &self.js
    }

    /// The client.
    pub fn client(&self) -> &async_nats::Client {
        &self.client
    }
}

/// The `Nats-Msg-Id`: the message id, suffixed `-r<n>` on the n-th intentional redelivery
/// (check-back or requeue) so JetStream's duplicate window drops a relay's crash re-publishes but
/// not intentional redeliveries.
fn dedup_id(m: &crate::message::Message) -> String {
    if m.redelivery == 0 {
        m.message_id.to_string()
    } else {
        format!("{}-r{}", m.message_id, m.redelivery)
    }
}

/// Check a publish subject: dot-separated tokens, none empty, no whitespace, no wildcards
/// (<https://docs.nats.io/nats-concepts/subjects>).
fn validate_subject(subject: &str) -> Result<(), String> {
    let bad = subject.is_empty()
        || subject.chars().any(|c| c.is_whitespace() || c.is_control())
        || subject
            .split('.')
            .any(|t| t.is_empty() || t == "*" || t == ">");
    if bad {
        Err(format!(
            "invalid NATS subject {subject:?}: dot-separated non-empty tokens, no whitespace or wildcards"
        ))
    } else {
        Ok(())
    }
}

fn classify(e: &jetstream::context::PublishError, connected: bool) -> TransportErrorKind {
    match e.kind() {
        PublishErrorKind::StreamNotFound | PublishErrorKind::MaxPayloadExceeded => {
            TransportErrorKind::Permanent
        }
        _ if !connected => TransportErrorKind::Unavailable,
        _ => TransportErrorKind::Retryable,
    }
}

#[async_trait]
impl Transport for NatsTransport {
    fn name(&self) -> &str {
        "nats"
    }

    async fn publish(&self, batch: &[Outgoing<'_>]) -> Vec<Result<(), TransportError>> {
        let acks = Acks::new(batch.len());
        self.publish_each(batch, &acks).await;
        acks.into_results()
    }

    async fn publish_each(&self, batch: &[Outgoing<'_>], acks: &Acks) {
        let mut pending = Vec::with_capacity(batch.len());
        for o in batch {
            if let Err(reason) = validate_subject(o.destination) {
                pending.push(Err(TransportError::permanent(reason)));
                continue;
            }
            let m = o.message;
            let mut publish = PublishMessage::build()
                .payload(m.payload.clone().into())
                .message_id(dedup_id(m));
            for (k, v) in m.wire_headers() {
                publish = publish.header(k.as_str(), v.as_str());
            }
            pending.push(Ok(self
                .js
                .send_publish(o.destination.to_owned(), publish)
                .await));
        }
        // Each PubAck is recorded as it arrives: acknowledged messages count even if the
        // relay's publish timeout cuts the rest short.
        for p in pending {
            let r = match p {
                Err(invalid) => {
                    acks.push(Err(invalid));
                    continue;
                }
                Ok(Ok(ack)) => ack.await,
                Ok(Err(e)) => Err(e),
            };
            acks.push(r.map(|_| ()).map_err(|e| {
                let connected = self.client.connection_state() == State::Connected;
                TransportError::new(classify(&e, connected), "JetStream publish failed")
                    .with_source(e)
            }));
        }
    }

    async fn probe(&self) -> Result<(), TransportError> {
        if self.client.connection_state() != State::Connected {
            return Err(TransportError::unavailable("not connected to NATS"));
        }
        tokio::time::timeout(Duration::from_secs(5), self.client.flush())
            .await
            .map_err(|_| TransportError::unavailable("NATS flush timed out"))?
            .map_err(|e| TransportError::unavailable("NATS flush failed").with_source(e))
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn subjects_are_validated() {
        for ok in ["a", "orders.created", "a.b-c_d.e"] {
            assert!(super::validate_subject(ok).is_ok(), "{ok}");
        }
        for bad in ["", "a b", "a..b", ".a", "a.", "a.*", "a.>", "a\tb"] {
            assert!(super::validate_subject(bad).is_err(), "{bad:?}");
        }
    }
}
