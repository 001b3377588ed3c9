//! Message types: what a producer enqueues ([`NewMessage`]), what the relay reads and publishes
//! ([`Message`]), what a consumer receives ([`InboundMessage`]), and the public status numbers
//! ([`Status`]).

use std::collections::BTreeMap;
use std::time::Duration;

use uuid::Uuid;

use crate::error::EnqueueError;

/// Message headers: header name to value, both UTF-8 strings, kept in name order.
///
/// Names are validated at enqueue ([`Limits::validate`]): 1 to 128 characters from `A-Z a-z 0-9 - _ .`,
/// so they travel unchanged as HTTP, NATS, AMQP and MQTT 5 headers. Names starting with `outbox-`
/// and `webhook-` are reserved for the values the relay sets itself.
pub type Headers = BTreeMap<String, String>;

/// Header that carries the message id on transports without a native message-id field.
pub const HEADER_MESSAGE_ID: &str = "outbox-message-id";
/// Header that carries the logical topic.
pub const HEADER_TOPIC: &str = "outbox-topic";
/// Header that carries the partition key, when the message has one.
pub const HEADER_PARTITION_KEY: &str = "outbox-partition-key";
/// Header that carries the publish attempt number (1 for the first attempt).
pub const HEADER_ATTEMPT: &str = "outbox-attempt";

/// Status of an outbox row. The numbers are part of the public schema and never change
/// (docs/design/DESIGN.md §4).
///
/// | value | status | meaning |
/// |---|---|---|
/// | 0 | `Pending` | committed, waiting for `available_at` and a relay |
/// | 1 | `Sending` | retired: a row claimed by a relay of an earlier version (`migrate` releases it) |
/// | 2 | `Sent` | the broker acknowledged it |
/// | 3 | `Confirmed` | the consumer confirmed it |
/// | 4 | `Failed` | dead letter: attempts exhausted or permanent error; `last_error` says why |
/// | 5 | `Prepared` | a two-phase message waiting for commit or rollback |
/// | 6 | `Rejected` | the consumer processed and refused it |
/// | 7 | `RolledBack` | a two-phase message rolled back: never published ([`crate::two_phase`]) |
/// | 8 | `Undecided` | a two-phase message whose check-backs gave no decision: parked for an operator |
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(i16)]
pub enum Status {
    /// 0: waiting for `available_at` and the relay holding its bucket.
    Pending = 0,
    /// 1: retired. Rows claimed by a relay of the row-claim protocol of earlier versions;
    /// [`Store::migrate`](crate::Store::migrate) releases them (PENDING again). No relay of this
    /// version writes it.
    Sending = 1,
    /// 2: acknowledged by the broker.
    Sent = 2,
    /// 3: confirmed by the consumer.
    Confirmed = 3,
    /// 4: dead letter.
    Failed = 4,
    /// 5: two-phase message, not yet committed.
    Prepared = 5,
    /// 6: refused by the consumer.
    Rejected = 6,
    /// 7: a two-phase message rolled back, by the producer or a check-back answer; final, never
    /// published ([`crate::two_phase`]).
    RolledBack = 7,
    /// 8: a two-phase message still undecided after `max_checks` answered check-backs or past
    /// its deadline; parked until the producer or an operator decides it, or an operator resumes
    /// the check-backs ([`crate::two_phase`]).
    Undecided = 8,
}

impl Status {
    /// Every status, in number order.
    pub const ALL: [Status; 9] = [
        Status::Pending,
        Status::Sending,
        Status::Sent,
        Status::Confirmed,
        Status::Failed,
        Status::Prepared,
        Status::Rejected,
        Status::RolledBack,
        Status::Undecided,
    ];

    /// The status stored as `n`, or `None` for a number outside the schema.
    pub fn from_i16(n: i16) -> Option<Status> {
        Status::ALL.get(usize::try_from(n).ok()?).copied()
    }

    /// The stored number.
    pub fn as_i16(self) -> i16 {
        self as i16
    }

    /// Upper-case name used by the CLI and logs (`PENDING`, `SENDING`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Status::Pending => "PENDING",
            Status::Sending => "SENDING",
            Status::Sent => "SENT",
            Status::Confirmed => "CONFIRMED",
            Status::Failed => "FAILED",
            Status::Prepared => "PREPARED",
            Status::Rejected => "REJECTED",
            Status::RolledBack => "ROLLED_BACK",
            Status::Undecided => "UNDECIDED",
        }
    }
}

impl std::fmt::Display for Status {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A message to enqueue inside the caller's transaction.
///
/// Built with [`NewMessage::new`] (raw bytes) or [`NewMessage::json`] (any `serde::Serialize`),
/// then refined with the `with_*` methods. Nothing is checked until enqueue, which validates
/// against [`Limits`] and returns [`EnqueueError`] before anything is written.
///
/// # Examples
/// ```
/// use outbox::NewMessage;
/// use std::time::Duration;
///
/// let msg = NewMessage::json("order-created", &serde_json::json!({"order_id": 42}))
///     .unwrap()
///     .with_partition_key("order-42")
///     .with_header("tag", "created")
///     .with_delay(Duration::from_secs(5));
/// assert_eq!(msg.topic(), "order-created");
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewMessage {
    pub(crate) message_id: Uuid,
    pub(crate) topic: String,
    pub(crate) partition_key: Option<String>,
    pub(crate) headers: Headers,
    pub(crate) payload: Vec<u8>,
    pub(crate) delay: Option<Duration>,
    pub(crate) max_attempts: Option<u32>,
}

impl NewMessage {
    /// A message with an opaque byte payload and a fresh UUIDv7 message id.
    pub fn new(topic: impl Into<String>, payload: impl Into<Vec<u8>>) -> Self {
        NewMessage {
            message_id: Uuid::now_v7(),
            topic: topic.into(),
            partition_key: None,
            headers: Headers::new(),
            payload: payload.into(),
            delay: None,
            max_attempts: None,
        }
    }

    /// A message whose payload is `value` serialized as JSON, with header
    /// `content-type: application/json`.
    ///
    /// # Errors
    /// [`EnqueueError::Serialize`] when `value` cannot be serialized.
    pub fn json<T: serde::Serialize + ?Sized>(
        topic: impl Into<String>,
        value: &T,
    ) -> Result<Self, EnqueueError> {
        let payload = serde_json::to_vec(value).map_err(EnqueueError::Serialize)?;
        Ok(NewMessage::new(topic, payload).with_header("content-type", "application/json"))
    }

    /// Use `id` as the message id (idempotency key) instead of a fresh UUIDv7.
    pub fn with_message_id(mut self, id: Uuid) -> Self {
        self.message_id = id;
        self
    }

    /// Set the partition key (business key such as an order id; Kafka record key; ordering unit).
    pub fn with_partition_key(mut self, key: impl Into<String>) -> Self {
        self.partition_key = Some(key.into());
        self
    }

    /// Add or replace a header.
    pub fn with_header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.insert(name.into(), value.into());
        self
    }

    /// Do not publish before `delay` has passed, measured on the database clock from the
    /// enqueue statement. Default: publish as soon as the transaction commits.
    pub fn with_delay(mut self, delay: Duration) -> Self {
        self.delay = Some(delay);
        self
    }

    /// Override the relay's `max_attempts` for this message (at least 1).
    pub fn with_max_attempts(mut self, max_attempts: u32) -> Self {
        self.max_attempts = Some(max_attempts);
        self
    }

    /// The message id.
    pub fn message_id(&self) -> Uuid {
        self.message_id
    }

    /// The topic.
    pub fn topic(&self) -> &str {
        &self.topic
    }

    /// The payload bytes.
    pub fn payload(&self) -> &[u8] {
        &self.payload
    }
}

/// Limits checked at enqueue, before anything is written.
///
/// Defaults: payload at most 1 MiB (the NATS default `max_payload`), topic 1 to 255 characters
/// without whitespace or control characters, partition key at most 255 bytes, at most 64 headers
/// of at most 4 KiB each, delay at most 365 days.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    /// Largest payload in bytes. Default 1,048,576.
    pub max_payload_bytes: usize,
    /// Largest header value in bytes. Default 4,096.
    pub max_header_value_bytes: usize,
    /// Most headers per message. Default 64.
    pub max_headers: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_payload_bytes: 1024 * 1024,
            max_header_value_bytes: 4096,
            max_headers: 64,
        }
    }
}

impl Limits {
    /// Check `msg` against these limits and the naming rules, broker-reserved header names
    /// included ([`EnqueueError::ReservedHeader`]).
    ///
    /// # Errors
    /// The first problem found, as an [`EnqueueError`] variant that names it.
    pub fn validate(&self, msg: &NewMessage) -> Result<(), EnqueueError> {
        validate_topic(&msg.topic)?;
        if let Some(key) = &msg.partition_key
            && (key.is_empty() || key.len() > 255 || key.chars().any(char::is_control))
        {
            return Err(EnqueueError::InvalidPartitionKey(key.clone()));
        }
        if msg.payload.len() > self.max_payload_bytes {
            return Err(EnqueueError::PayloadTooLarge {
                size: msg.payload.len(),
                limit: self.max_payload_bytes,
            });
        }
        if msg.headers.len() > self.max_headers {
            return Err(EnqueueError::TooManyHeaders {
                count: msg.headers.len(),
                limit: self.max_headers,
            });
        }
        for (name, value) in &msg.headers {
            validate_header_name(name)?;
            if let Some(r) = crate::reserved::reserved_by(name) {
                return Err(EnqueueError::ReservedHeader {
                    name: name.clone(),
                    broker: r.broker.name(),
                    why: r.why,
                });
            }
            if value.len() > self.max_header_value_bytes
                || value.chars().any(|c| c.is_control() && c != '\t')
            {
                return Err(EnqueueError::InvalidHeaderValue(name.clone()));
            }
        }
        if msg.max_attempts == Some(0) {
            return Err(EnqueueError::InvalidMaxAttempts);
        }
        if let Some(delay) = msg.delay
            && delay > Duration::from_secs(365 * 24 * 3600)
        {
            return Err(EnqueueError::DelayTooLong(delay));
        }
        Ok(())
    }
}

/// Check a topic name: 1 to 255 characters, none of them whitespace or control characters.
///
/// # Errors
/// [`EnqueueError::InvalidTopic`] naming the topic.
pub fn validate_topic(topic: &str) -> Result<(), EnqueueError> {
    if topic.is_empty()
        || topic.len() > 255
        || topic.chars().any(|c| c.is_whitespace() || c.is_control())
    {
        return Err(EnqueueError::InvalidTopic(topic.to_owned()));
    }
    Ok(())
}

fn validate_header_name(name: &str) -> Result<(), EnqueueError> {
    let ok = !name.is_empty()
        && name.len() <= 128
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.');
    let lower = name.to_ascii_lowercase();
    if !ok || lower.starts_with("outbox-") || lower.starts_with("webhook-") {
        return Err(EnqueueError::InvalidHeaderName(name.to_owned()));
    }
    Ok(())
}

/// Buckets per outbox table: a constant of the schema (migration v4). Every row's `bucket`
/// column is a stored generated column, a hash of its partition key (of its message id when it
/// has none) modulo this number, so plain-SQL producers get it for free and every message of one
/// key lands in one bucket.
pub const BUCKETS: u16 = 64;

/// A bucket number, `0..BUCKETS`.
pub type Bucket = i16;

/// A message read by a relay, as handed to a [`Transport`](crate::transport::Transport).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// Internal row id (table order).
    pub id: i64,
    /// Idempotency key, carried to the broker and the consumer.
    pub message_id: Uuid,
    /// Logical topic.
    pub topic: String,
    /// Partition key, if any.
    pub partition_key: Option<String>,
    /// User headers (never the reserved `outbox-*` ones).
    pub headers: Headers,
    /// Payload bytes, byte-exact as enqueued.
    pub payload: Vec<u8>,
    /// As read from the table: the publish attempts recorded so far (0 before the first).
    /// As the relay hands it to a transport: the number of this publish attempt (1 on the
    /// first, as the row records it once the attempt completes), sent as `outbox-attempt`.
    pub attempts: u32,
    /// Attempts allowed before the message is dead-lettered.
    pub max_attempts: u32,
    /// Intentional redeliveries so far: 0 until a check-back or an operator requeue sends the
    /// message again, then 1, 2, … . Brokers that drop duplicates by id (JetStream) get an id that
    /// varies with it, so an intentional redelivery is not dropped as a duplicate, while a relay's
    /// crash re-publish (same value) still is.
    pub redelivery: u32,
}

impl Message {
    /// All headers a transport should send: the user headers plus `outbox-message-id`,
    /// `outbox-topic`, `outbox-attempt` and, when present, `outbox-partition-key`.
    pub fn wire_headers(&self) -> Headers {
        let mut h = self.headers.clone();
        h.insert(HEADER_MESSAGE_ID.into(), self.message_id.to_string());
        h.insert(HEADER_TOPIC.into(), self.topic.clone());
        // An attempt is numbered from 1 (a stored message not yet attempted is on its first).
        h.insert(HEADER_ATTEMPT.into(), self.attempts.max(1).to_string());
        if let Some(k) = &self.partition_key {
            h.insert(HEADER_PARTITION_KEY.into(), k.clone());
        }
        h
    }
}

/// A message as a consumer receives it from a transport.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InboundMessage {
    /// The producer's message id: the inbox's idempotency key.
    pub message_id: Uuid,
    /// Logical topic.
    pub topic: String,
    /// Partition key, if the producer set one.
    pub partition_key: Option<String>,
    /// Headers as received, reserved ones included.
    pub headers: Headers,
    /// Payload bytes.
    pub payload: Vec<u8>,
    /// How many times the broker has delivered this message to this consumer (1 the first time),
    /// where the transport knows it.
    pub delivery_count: u32,
}

impl InboundMessage {
    /// Decode the payload as JSON.
    ///
    /// # Errors
    /// The `serde_json` error for a payload that is not valid JSON for `T`.
    pub fn json<T: serde::de::DeserializeOwned>(&self) -> Result<T, serde_json::Error> {
        serde_json::from_slice(&self.payload)
    }

    /// Build an inbound message from wire headers that carry `outbox-message-id` and
    /// `outbox-topic` (as [`Message::wire_headers`] writes them).
    ///
    /// # Errors
    /// A text naming the missing or malformed header.
    pub fn from_wire(
        headers: Headers,
        payload: Vec<u8>,
        delivery_count: u32,
    ) -> Result<Self, String> {
        let id = headers
            .get(HEADER_MESSAGE_ID)
            .ok_or_else(|| format!("missing header {HEADER_MESSAGE_ID}"))?;
        let message_id = Uuid::parse_str(id)
            .map_err(|e| format!("header {HEADER_MESSAGE_ID} is not a UUID: {e}"))?;
        let topic = headers
            .get(HEADER_TOPIC)
            .cloned()
            .ok_or_else(|| format!("missing header {HEADER_TOPIC}"))?;
        let partition_key = headers.get(HEADER_PARTITION_KEY).cloned();
        Ok(InboundMessage {
            message_id,
            topic,
            partition_key,
            headers,
            payload,
            delivery_count,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_numbers_are_stable() {
        for (n, s) in Status::ALL.iter().enumerate() {
            assert_eq!(s.as_i16() as usize, n);
            assert_eq!(Status::from_i16(n as i16), Some(*s));
        }
        assert_eq!(Status::from_i16(9), None);
        assert_eq!(Status::from_i16(-1), None);
    }

    #[test]
    fn validation_names_the_problem() {
        let l = Limits::default();
        assert!(matches!(
            l.validate(&NewMessage::new("", "x")),
            Err(EnqueueError::InvalidTopic(_))
        ));
        assert!(matches!(
            l.validate(&NewMessage::new("a b", "x")),
            Err(EnqueueError::InvalidTopic(_))
        ));
        let big = NewMessage::new("t", vec![0u8; l.max_payload_bytes + 1]);
        assert!(matches!(
            l.validate(&big),
            Err(EnqueueError::PayloadTooLarge { .. })
        ));
        let bad = NewMessage::new("t", "x").with_header("bad name", "v");
        assert!(matches!(
            l.validate(&bad),
            Err(EnqueueError::InvalidHeaderName(_))
        ));
        let reserved = NewMessage::new("t", "x").with_header("Outbox-Topic", "v");
        assert!(matches!(
            l.validate(&reserved),
            Err(EnqueueError::InvalidHeaderName(_))
        ));
        let ctl = NewMessage::new("t", "x").with_header("a", "line\nbreak");
        assert!(matches!(
            l.validate(&ctl),
            Err(EnqueueError::InvalidHeaderValue(_))
        ));
        for name in [
            "Nats-Msg-Id",
            "nats-expected-last-sequence",
            "BCC",
            "x-delay",
            "DELAY",
            "Content-Length",
        ] {
            let reserved = NewMessage::new("t", "x").with_header(name, "v");
            let e = l.validate(&reserved).unwrap_err();
            assert!(
                matches!(&e, EnqueueError::ReservedHeader { name: n, .. } if n == name),
                "{name}: {e:?}"
            );
            assert!(e.to_string().contains(name), "{e}");
        }
        let e = l
            .validate(&NewMessage::new("t", "x").with_header("Nats-Msg-Id", "dup"))
            .unwrap_err();
        assert!(e.to_string().contains("NATS JetStream"), "{e}");
        for free in ["x-request-id", "delay", "content-type", "traceparent"] {
            assert!(
                l.validate(&NewMessage::new("t", "x").with_header(free, "v"))
                    .is_ok(),
                "{free}"
            );
        }
        let zero = NewMessage::new("t", "x").with_max_attempts(0);
        assert!(matches!(
            l.validate(&zero),
            Err(EnqueueError::InvalidMaxAttempts)
        ));
        assert!(
            l.validate(&NewMessage::new("orders.created", vec![0xff, 0xfe]))
                .is_ok()
        );
    }

    #[test]
    fn wire_headers_round_trip() {
        let m = Message {
            id: 1,
            message_id: Uuid::now_v7(),
            topic: "t".into(),
            partition_key: Some("k".into()),
            headers: Headers::from([("tag".into(), "x".into())]),
            payload: b"p".to_vec(),
            attempts: 2,
            max_attempts: 5,
            redelivery: 0,
        };
        let inbound = InboundMessage::from_wire(m.wire_headers(), m.payload.clone(), 1).unwrap();
        assert_eq!(inbound.message_id, m.message_id);
        assert_eq!(inbound.topic, "t");
        assert_eq!(inbound.partition_key.as_deref(), Some("k"));
        assert!(InboundMessage::from_wire(Headers::new(), vec![], 1).is_err());
    }
}
