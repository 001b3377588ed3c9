//! NATS JetStream transport: publish with `Nats-Msg-Id` = message id and await the PubAck.
//!
//! The whole batch is sent first and the acknowledgements are awaited afterwards (pipelined).
//! JetStream's duplicate window (default 2 minutes) drops a re-publish of the same message id,
//! so a relay that dies after the broker acknowledged but before it recorded SENT does not put
//! a second copy in the stream if it comes back within the window; past it, the consumer's inbox
//! absorbs the copy.
//!
//! Classification: not connected → `Unavailable`; no stream captures the subject (JetStream's
//! "no responders") → `Unavailable`, marked as a missing destination (the transport pauses until
//! the stream exists; the relay dead-letters after its `missing_destination_grace`, default
//! 5 min); ack timeout, broken pipe, too many pending acks → retryable; message over the server's
//! `max_payload` → permanent. A publish the server refuses for lack of permission gets no
//! acknowledgement and surfaces as an ack timeout (retryable): async-nats reports the permission
//! violation only as a connection event.
//!
//! [`NatsTransport::connect`] fails when the server cannot be reached, with the client's reason;
//! once connected, the client reconnects by itself, forever, after a lost connection (the relay
//! pauses the transport meanwhile).

use std::time::Duration;

use async_nats::connection::State;
use async_nats::jetstream::context::PublishErrorKind;
use async_nats::jetstream::message::PublishMessage;
use async_nats::jetstream::{self, stream};
use async_trait::async_trait;

use super::{Outgoing, Transport};
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
        // No `retry_on_initial_connect`: a failed first connection is reported now, with the
        // client's reason (connection refused, TLS, authorization).
        let client = async_nats::ConnectOptions::new()
            .connection_timeout(Duration::from_secs(5))
            .connect(config.url.as_str())
            .await
            .map_err(|e| {
                let mut reason = format!("cannot connect to NATS at {}: {e}", config.url);
                let mut src = std::error::Error::source(&e);
                while let Some(s) = src {
                    reason.push_str(&format!(": {s}"));
                    src = s.source();
                }
                ConfigError::new("url", reason)
            })?;
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
        PublishErrorKind::StreamNotFound => TransportErrorKind::Unavailable,
        PublishErrorKind::MaxPayloadExceeded => TransportErrorKind::Permanent,
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
        let mut results = Vec::with_capacity(batch.len());
        for p in pending {
            let r = match p {
                Err(invalid) => {
                    results.push(Err(invalid));
                    continue;
                }
                Ok(Ok(ack)) => ack.await,
                Ok(Err(e)) => Err(e),
            };
            results.push(r.map(|_| ()).map_err(|e| {
                let connected = self.client.connection_state() == State::Connected;
                if e.kind() == PublishErrorKind::StreamNotFound {
                    return TransportError::missing_destination(
                        "JetStream publish failed: no stream captures the subject",
                    )
                    .with_source(e);
                }
                TransportError::new(classify(&e, connected), "JetStream publish failed")
                    .with_source(e)
            }));
        }
        results
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
