//! NATS JetStream transport: publish with `Nats-Msg-Id` = message id and await the PubAck.
//!
//! The whole batch is sent first and the acknowledgements are awaited afterwards (pipelined).
//! JetStream's duplicate window (default 2 minutes) drops a re-publish of the same message id,
//! so a relay that dies after the broker acknowledged but before it recorded SENT does not put
//! a second copy in the stream if it comes back within the window; past it, the consumer's inbox
//! absorbs the copy.
//!
//! # What NATS can carry
//! [`NatsTransport::check`](Transport::check) refuses, as permanent, before anything is sent
//! (async-nats panics on the header names and values it cannot encode):
//! - a header name that is empty or has a character outside printable ASCII (`!` to `~`) or a
//!   `:` (a space, a control character, a non-ASCII letter);
//! - a header value, topic or partition key (they travel as `outbox-topic` and
//!   `outbox-partition-key`) with a CR or LF;
//! - a user header in the `Nats-` namespace, any case (`Nats-Msg-Id` would replace the relay's
//!   duplicate-detection id, so JetStream would drop distinct messages as duplicates while their
//!   rows are marked SENT; `Nats-Expected-*`, `Nats-Rollup`, `Nats-TTL`, ... steer the server);
//! - a subject that is not a valid publish subject.
//!
//! Classification: not connected, or the connection lost (or replaced by a reconnection) while
//! a PubAck was awaited (issue 11 item 4: async-nats would wait for the lost ack until its
//! timeout, a retryable error that burned an attempt; the message is in doubt and its re-publish
//! is deduplicated by `Nats-Msg-Id`) → `Unavailable`; no stream captures the subject (JetStream's
//! "no responders") → `Unavailable`, marked as a missing destination (the transport pauses until
//! the stream exists; the relay dead-letters after its `missing_destination_grace`, default
//! 5 min); ack timeout, broken pipe, too many pending acks → retryable; a message over the
//! server's `max_payload` or the stream's `max_msg_size`, a failed `Nats-Expected-*` condition
//! (wrong last sequence, wrong last message id, wrong stream), an invalid TTL or rollup →
//! permanent (the same message would fail the same way again).
//!
//! A publish the server refuses for lack of permission gets no acknowledgement: the server
//! answers `-ERR 'Permissions Violation for Publish to "<subject>"'` on the connection, which
//! async-nats reports only as a connection event, and the PubAck times out. A transport made by
//! [`NatsTransport::connect`] watches those events: an ack timeout on a subject the server
//! refused since the message was sent (or while the server refuses the reply subscription,
//! `Permissions Violation for Subscription to "_INBOX..."`) is `Unavailable`, a configuration
//! fault: the relay pauses the transport, counts no attempt and dead-letters nothing, and
//! publishes once the permission is granted. A transport made by [`NatsTransport::from_client`]
//! cannot see the events of a client it did not connect; there a refused publish stays an ack
//! timeout (retryable).
//!
//! [`NatsTransport::connect`] fails when the server cannot be reached, with the client's reason;
//! once connected, the client reconnects by itself, forever, after a lost connection (the relay
//! pauses the transport meanwhile).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_nats::connection::State;
use async_nats::jetstream::context::PublishErrorKind;
use async_nats::jetstream::message::PublishMessage;
use async_nats::jetstream::{self, stream};
use async_trait::async_trait;

use super::wire::{self, Broker, Field, HeaderRules, WireError};
use super::{Acks, Outgoing, Transport};
use crate::error::{ConfigError, TransportError, TransportErrorKind};

/// The servers of `url`: one server URL, or a seed list of several separated by commas
/// (`nats://a:4222,nats://b:4222,nats://c:4222`, the form of the NATS CLI's `--server`). The
/// client connects to one of them and, once connected, also learns the cluster's other servers
/// from the server it reached; after a lost connection it reconnects to any server it knows
/// (see the NATS documentation, "Connecting to a cluster").
///
/// # Errors
/// A message naming the first entry that is not a NATS server URL.
pub fn seeds(url: &str) -> Result<Vec<async_nats::ServerAddr>, String> {
    url.split(',')
        .map(str::trim)
        .map(|u| {
            u.parse::<async_nats::ServerAddr>()
                .map_err(|e| format!("{:?} is not a NATS server URL: {e}", crate::redact::url(u)))
        })
        .collect()
}

/// Connection options for `url` (one server or a seed list, see [`seeds`]) with the credentials
/// its first server carries: `nats://user:password@host` (user and password) or
/// `nats://token@host` (a token). async-nats 0.51 does not read credentials from the URL by
/// itself: a URL with credentials connected without them, and the server refused it with
/// "authorization violation".
///
/// # Errors
/// None: a URL that does not parse is left to `connect`, which names it.
pub fn connect_options(url: &str) -> async_nats::ConnectOptions {
    let options = async_nats::ConnectOptions::new();
    let Some(Ok(addr)) = url
        .split(',')
        .next()
        .map(|u| u.trim().parse::<async_nats::ServerAddr>())
    else {
        return options;
    };
    match (addr.username(), addr.password()) {
        (Some(user), Some(pass)) => options.user_and_password(user.to_owned(), pass.to_owned()),
        (Some(token), None) => options.token(token.to_owned()),
        _ => options,
    }
}

/// Connect a client to `url` (one server or a seed list, see [`seeds`]) with
/// [`connect_options`] and a 5 s connection timeout per server.
///
/// # Errors
/// A message naming the URL (without its password) and the client's reason, with its sources.
pub async fn connect_client(url: &str) -> Result<async_nats::Client, String> {
    let servers = seeds(url)?;
    connect_options(url)
        .connection_timeout(Duration::from_secs(5))
        .connect(servers)
        .await
        .map_err(|e| {
            format!(
                "cannot connect to NATS at {}: {}",
                crate::redact::url(url),
                crate::error::with_sources(e.to_string(), std::error::Error::source(&e))
            )
        })
}

/// NATS transport settings; the `[transports.<name>] kind = "nats"` table of the configuration
/// file (see [`TransportConfig`](super::config::TransportConfig)), where the stream is written
/// flat: `url`, `stream` (its name), `subjects` (default `["<stream lower-cased>.>"]`),
/// `create_stream` (default true), `replicas` (default 1), `ack_timeout` (`"5s"`).
#[derive(Clone, serde::Deserialize, serde::Serialize, derive_more::Debug)]
#[serde(from = "NatsFile", into = "NatsFile")]
pub struct NatsConfig {
    /// Server URL, e.g. `nats://127.0.0.1:4222`, or a seed list of a cluster's servers separated
    /// by commas (`nats://a:4222,nats://b:4222`, see [`seeds`]); credentials may be given in the
    /// first (`nats://user:password@host:4222`, `nats://token@host:4222`, see
    /// [`connect_options`]). Required.
    #[debug("{:?}", crate::redact::url(url))]
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

    /// Check the settings without connecting.
    ///
    /// # Errors
    /// [`ConfigError`] naming `url` (not `nats://` or `tls://`), `stream` (an empty name or
    /// subject list, or a subject that is not valid) or `ack_timeout` (zero).
    pub fn validate(&self) -> Result<(), ConfigError> {
        for url in self.url.split(',') {
            crate::transport::settings::check_url(url.trim(), &["nats", "tls"])?;
        }
        seeds(&self.url).map_err(|e| ConfigError::new("url", e))?;
        if let Some(s) = &self.stream {
            ConfigError::invalid_if(
                s.name.is_empty() || s.name.contains(['.', '*', '>', ' ']),
                "stream",
                format!(
                    "{:?} is not a stream name (non-empty, no . * > or space)",
                    s.name
                ),
            )?;
            ConfigError::invalid_if(s.subjects.is_empty(), "subjects", "must not be empty")?;
            ConfigError::invalid_if(
                !(1..=5).contains(&s.replicas),
                "replicas",
                format!("{} is not 1 to 5 (JetStream's range)", s.replicas),
            )?;
        }
        ConfigError::zero_if(self.ack_timeout.is_zero(), "ack_timeout")?;
        Ok(())
    }
}

/// The file form of [`NatsConfig`]: the stream written flat.
#[derive(serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
struct NatsFile {
    #[serde(default)]
    url: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    stream: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    subjects: Vec<String>,
    #[serde(default = "yes")]
    create_stream: bool,
    #[serde(default, with = "humantime_serde")]
    ack_timeout: Option<Duration>,
    #[serde(default = "one", skip_serializing_if = "is_one")]
    replicas: usize,
}

fn one() -> usize {
    1
}

fn is_one(n: &usize) -> bool {
    *n == 1
}

fn yes() -> bool {
    true
}

impl From<NatsFile> for NatsConfig {
    fn from(f: NatsFile) -> Self {
        let mut c = NatsConfig::new(f.url);
        c.stream = f.stream.map(|name| StreamSetup {
            subjects: if f.subjects.is_empty() {
                vec![format!("{}.>", name.to_lowercase())]
            } else {
                f.subjects
            },
            name,
            create: f.create_stream,
            replicas: f.replicas,
        });
        if let Some(t) = f.ack_timeout {
            c.ack_timeout = t;
        }
        c
    }
}

impl From<NatsConfig> for NatsFile {
    fn from(c: NatsConfig) -> Self {
        NatsFile {
            url: c.url,
            create_stream: c.stream.as_ref().is_none_or(|s| s.create),
            subjects: c
                .stream
                .as_ref()
                .map(|s| s.subjects.clone())
                .unwrap_or_default(),
            replicas: c.stream.as_ref().map_or(1, |s| s.replicas),
            stream: c.stream.map(|s| s.name),
            ack_timeout: Some(c.ack_timeout),
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
    /// Replicas of a stream it creates, 1 to 5: on a cluster, 3 keeps every acknowledged message
    /// through the loss of one server (JetStream acknowledges a publish once a majority of the
    /// replicas stored it; see the NATS documentation, "JetStream clustering"). Default 1.
    pub replicas: usize,
}

/// Publishes to JetStream (see the module docs).
#[derive(Debug, Clone)]
pub struct NatsTransport {
    client: async_nats::Client,
    js: jetstream::Context,
    refusals: Arc<Refusals>,
}

/// The permission violations the server reported on the transport's connection (see the module
/// docs): when each subject was last refused for publishing, and when the reply subscription was
/// last refused.
#[derive(Debug, Default)]
struct Refusals {
    state: Mutex<RefusalState>,
}

#[derive(Debug, Default)]
struct RefusalState {
    publish: HashMap<String, Instant>,
    subscribe: Option<(Instant, String)>,
}

/// Most subjects remembered; older entries are dropped first (a refusal matters only to the
/// acks that time out after it, within one `ack_timeout`).
const MAX_REFUSED_SUBJECTS: usize = 4096;

impl Refusals {
    /// Record a server error text, e.g. `Permissions Violation for Publish to "orders.x"`.
    fn record(&self, text: &str) {
        let lower = text.to_ascii_lowercase();
        let subject = || {
            let t = text.trim_matches(|c| c == '\'' || c == ' ');
            let start = t.find('"')? + 1;
            let end = t[start..].find('"')? + start;
            Some(t[start..end].to_owned())
        };
        let mut state = self.state.lock().expect("poisoned");
        let now = Instant::now();
        if lower.contains("permissions violation for publish to") {
            if let Some(s) = subject() {
                if state.publish.len() >= MAX_REFUSED_SUBJECTS {
                    let oldest = state
                        .publish
                        .iter()
                        .min_by_key(|(_, t)| **t)
                        .map(|(s, _)| s.clone());
                    if let Some(o) = oldest {
                        state.publish.remove(&o);
                    }
                }
                state.publish.insert(s, now);
            }
        } else if lower.contains("permissions violation for subscription to") {
            state.subscribe = Some((now, subject().unwrap_or_default()));
        }
    }

    /// Why an ack for `subject`, sent at `sent`, never came, if the server refused it.
    fn refused(&self, subject: &str, sent: Instant) -> Option<String> {
        let state = self.state.lock().expect("poisoned");
        if let Some(at) = state.publish.get(subject)
            && *at >= sent
        {
            return Some(format!(
                "NATS refused the publish to {subject:?}: permissions violation (grant the user publish permission on the subject)"
            ));
        }
        if let Some((at, inbox)) = &state.subscribe
            && *at >= sent
        {
            return Some(format!(
                "NATS refused the subscription to the reply subject {inbox:?}: permissions violation, so no PubAck can arrive (grant the user subscribe permission on _INBOX.>)"
            ));
        }
        None
    }
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
        let refusals = Arc::new(Refusals::default());
        let watcher = refusals.clone();
        let servers = seeds(&config.url).map_err(|e| ConfigError::new("url", e))?;
        let client = connect_options(&config.url)
            .connection_timeout(Duration::from_secs(5))
            .event_callback(move |event| {
                if let async_nats::Event::ServerError(async_nats::ServerError::Other(text)) = &event
                {
                    watcher.record(text);
                }
                async {}
            })
            .connect(servers)
            .await
            .map_err(|e| {
                ConfigError::new(
                    "url",
                    crate::error::with_sources(
                        format!(
                            "cannot connect to NATS at {}: {e}",
                            crate::redact::url(&config.url)
                        ),
                        std::error::Error::source(&e),
                    ),
                )
            })?;
        let mut transport = Self::from_client(client, config).await?;
        transport.refusals = refusals;
        Ok(transport)
    }

    /// Use an existing client. The transport cannot see the server errors of a client it did not
    /// connect, so a publish refused for lack of permission stays an ack timeout (retryable; see
    /// the module docs).
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
                        num_replicas: s.replicas,
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
        Ok(NatsTransport {
            client,
            js,
            refusals: Arc::default(),
        })
    }

    /// The JetStream context.
    pub fn jetstream(&self) -> &jetstream::Context {
        &self.js
    }

    /// The client.
    pub fn client(&self) -> &async_nats::Client {
        &self.client
    }

    /// The error of a failed publish to `destination`, sent at `sent` (see the module docs).
    fn publish_error(
        &self,
        e: jetstream::context::PublishError,
        destination: &str,
        sent: Instant,
    ) -> TransportError {
        if e.kind() == PublishErrorKind::StreamNotFound {
            return TransportError::missing_destination(
                "JetStream publish failed: no stream captures the subject",
            )
            .with_source(e);
        }
        if e.kind() == PublishErrorKind::TimedOut
            && let Some(why) = self.refusals.refused(destination, sent)
        {
            return TransportError::unavailable(why).with_source(e);
        }
        let connected = self.client.connection_state() == State::Connected;
        TransportError::new(classify(&e, connected), "JetStream publish failed").with_source(e)
    }

    /// How many times the client has connected (the first connection included).
    fn connects(&self) -> u64 {
        self.client
            .statistics()
            .connects
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Resolves once the connection that was current when the client had connected `connects`
    /// times is gone (disconnected, or replaced by a reconnection): a PubAck awaited on it is
    /// lost with it (async-nats keeps waiting until its ack timeout). Polled every 20 ms.
    async fn connection_lost_since(&self, connects: u64) {
        while self.client.connection_state() == State::Connected && self.connects() == connects {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
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

/// The header rules of async-nats 0.51 (`header.rs`): a name is printable ASCII without `:`
/// (`HeaderName`; the client panics on others), a value has no CR or LF (`HeaderValue`; the
/// client panics on them).
const NATS_HEADERS: HeaderRules = HeaderRules {
    broker: Broker::Nats,
    name: |n| {
        if n.is_empty() {
            Err("a NATS header name cannot be empty")
        } else if n.bytes().any(|b| !b.is_ascii_graphic() || b == b':') {
            Err(
                "a NATS header name is printable ASCII (! to ~) without ':' (no space, control or non-ASCII character)",
            )
        } else {
            Ok(())
        }
    },
    value: |v| {
        if v.contains(['\r', '\n']) {
            Err("a NATS header value cannot contain CR or LF")
        } else {
            Ok(())
        }
    },
};

/// What NATS cannot carry (see the module docs): a pure function of the message.
///
/// # Errors
/// A permanent error whose source is a [`WireError`] naming the subject, header or key.
pub(crate) fn check_message(out: &Outgoing<'_>) -> Result<(), TransportError> {
    if validate_subject(out.destination).is_err() {
        return Err(WireError::unsupported(
            Broker::Nats,
            Field::Destination(out.destination.to_owned()),
            "a NATS publish subject is dot-separated non-empty tokens, without whitespace or wildcards",
        )
        .into());
    }
    wire::check_headers(out.message, &NATS_HEADERS)?;
    Ok(())
}

/// The JetStream publish of `m`: payload, `Nats-Msg-Id` and every wire header. async-nats
/// panics on a header it cannot carry: call it only for a message [`check_message`] accepted.
pub(crate) fn publish_message(m: &crate::Message) -> PublishMessage {
    let mut publish = PublishMessage::build()
        .payload(m.payload.clone().into())
        .message_id(dedup_id(m));
    for (k, v) in m.wire_headers() {
        publish = publish.header(k.as_str(), v.as_str());
    }
    publish
}

/// JetStream API error codes that refuse this message as it is: publishing it again fails the
/// same way. `Nats-Expected-*` conditions (10060 expected stream, 10063 expected sequence, 10070
/// wrong last message id, 10071 / 10164 wrong last sequence, 10193 expected last subject sequence
/// invalid), 10054 over the stream's `max_msg_size`, 10111 rollup refused, 10165 / 10166 invalid or
/// disabled per-message TTL, 10190..10192 invalid schedule.
fn refused_as_is(e: &jetstream::context::PublishError) -> bool {
    use jetstream::ErrorCode;
    if matches!(
        e.kind(),
        PublishErrorKind::WrongLastMessageId | PublishErrorKind::WrongLastSequence
    ) {
        return true;
    }
    let Some(api) = std::error::Error::source(e).and_then(|s| s.downcast_ref::<jetstream::Error>())
    else {
        return false;
    };
    matches!(
        api.error_code(),
        ErrorCode(
            10054 | 10060 | 10063 | 10070 | 10071 | 10111 | 10164 | 10165 | 10166 | 10190..=10193
        )
    )
}

fn classify(e: &jetstream::context::PublishError, connected: bool) -> TransportErrorKind {
    match e.kind() {
        PublishErrorKind::StreamNotFound => TransportErrorKind::Unavailable,
        PublishErrorKind::MaxPayloadExceeded => TransportErrorKind::Permanent,
        _ if refused_as_is(e) => TransportErrorKind::Permanent,
        _ if !connected => TransportErrorKind::Unavailable,
        _ => TransportErrorKind::Retryable,
    }
}

#[async_trait]
impl Transport for NatsTransport {
    fn name(&self) -> &str {
        "nats"
    }

    fn check(&self, out: &Outgoing<'_>) -> Result<(), TransportError> {
        check_message(out)
    }

    async fn publish_each(&self, batch: &[Outgoing<'_>], acks: &Acks) {
        let connects = self.connects();
        let mut pending = Vec::with_capacity(batch.len());
        let sent = Instant::now();
        for o in batch {
            if let Err(refused) = self.check(o) {
                pending.push(Err(refused));
                continue;
            }
            pending.push(Ok(self
                .js
                .send_publish(o.destination.to_owned(), publish_message(o.message))
                .await));
        }
        // The acks are awaited together (each ack's timeout runs from its first poll, so awaiting
        // them one after another would add the timeouts up) and recorded in order as they
        // arrive: acknowledged messages count even if the relay's publish timeout cuts the rest
        // short.
        let mut waiting: futures::stream::FuturesOrdered<_> = pending
            .into_iter()
            .map(|p| async move {
                match p {
                    Err(invalid) => Err(Ok(invalid)),
                    Ok(Ok(ack)) => ack.await.map(|_| ()).map_err(Err),
                    Ok(Err(e)) => Err(Err(e)),
                }
            })
            .collect();
        let mut destinations = batch.iter().map(|o| o.destination);
        // A PubAck awaited on a connection that is lost (or replaced by a reconnection) never
        // comes: async-nats would wait for it until its timeout (retryable, an attempt burned).
        // The messages still unanswered then are in doubt: Unavailable, published again (the
        // copy is dropped by its `Nats-Msg-Id`).
        let lost = self.connection_lost_since(connects);
        tokio::pin!(lost);
        loop {
            tokio::select! {
                biased;
                r = futures::StreamExt::next(&mut waiting) => {
                    let Some(r) = r else { break };
                    let destination = destinations.next().unwrap_or_default();
                    acks.push(match r {
                        Ok(()) => Ok(()),
                        Err(Ok(invalid)) => Err(invalid),
                        Err(Err(e)) => Err(self.publish_error(e, destination, sent)),
                    });
                }
                () = &mut lost => {
                    for _ in destinations.by_ref() {
                        acks.push(Err(TransportError::unavailable(
                            "NATS connection lost while awaiting the PubAck: the message is in \
                             doubt and is published again (JetStream drops the copy by its \
                             Nats-Msg-Id)",
                        )));
                    }
                    break;
                }
            }
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
mod tests;
