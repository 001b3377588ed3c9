//! The header names each broker reserves for itself: a contract of the message, below every
//! transport. [`RESERVED`] lists them (checked against the brokers' documentation; see
//! `docs/transports/*.md`). [`Limits::validate`](crate::Limits::validate) refuses the union at
//! enqueue ([`EnqueueError::ReservedHeader`](crate::EnqueueError)), so a message enqueued through
//! the library can travel on every transport; each transport's check
//! ([`transport::wire`](crate::transport::wire)) refuses its own broker's names in rows written
//! by SQL. Names are compared as the broker does: HTTP header names and the NATS `Nats-`
//! namespace ignoring ASCII case, AMQP table keys and RocketMQ property names exactly.

use std::fmt;

/// A broker, to name the one that reserves a header or cannot carry a value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Broker {
    /// NATS JetStream (`nats` transport).
    Nats,
    /// HTTP webhooks (`webhook` transport).
    Webhook,
    /// RabbitMQ, AMQP 0-9-1 (`rabbitmq` transport).
    RabbitMq,
    /// Kafka (`kafka` transport).
    Kafka,
    /// Redis Streams (`redis` transport).
    Redis,
    /// MQTT 5 (`mqtt` transport).
    Mqtt,
    /// Apache RocketMQ (`rocketmq` transport).
    RocketMq,
}

impl Broker {
    /// The broker's name as written in errors (`"NATS JetStream"`, `"RabbitMQ"`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Broker::Nats => "NATS JetStream",
            Broker::Webhook => "HTTP (webhook)",
            Broker::RabbitMq => "RabbitMQ",
            Broker::Kafka => "Kafka",
            Broker::Redis => "Redis",
            Broker::Mqtt => "MQTT 5",
            Broker::RocketMq => "RocketMQ",
        }
    }
}

impl fmt::Display for Broker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// How a [`Reserved`] entry matches a header name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NameMatch {
    /// Exactly this name (the broker compares names case-sensitively).
    Exact,
    /// This name, ignoring ASCII case.
    IgnoreCase,
    /// Every name starting with this prefix (case-sensitively).
    Prefix,
    /// Every name starting with this prefix, ignoring ASCII case.
    PrefixIgnoreCase,
}

/// A header name, or a family of names, that a broker reserves: a user header of that name would
/// change what the broker does with the message, or be replaced by the transport.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reserved {
    /// The broker that reserves it.
    pub broker: Broker,
    /// The name or prefix.
    pub name: &'static str,
    /// How [`Reserved::name`] matches.
    pub matching: NameMatch,
    /// What the broker or the transport does with it.
    pub why: &'static str,
}

impl Reserved {
    /// Whether header `name` is covered by this entry.
    pub fn matches(&self, name: &str) -> bool {
        let n = self.name;
        match self.matching {
            NameMatch::Exact => name == n,
            NameMatch::IgnoreCase => name.eq_ignore_ascii_case(n),
            NameMatch::Prefix => name.starts_with(n),
            NameMatch::PrefixIgnoreCase => {
                name.len() >= n.len()
                    && name.as_bytes()[..n.len()].eq_ignore_ascii_case(n.as_bytes())
            }
        }
    }

    /// The name as written in errors: `Nats-*` for a prefix.
    pub(crate) fn pattern(&self) -> String {
        match self.matching {
            NameMatch::Exact | NameMatch::IgnoreCase => self.name.to_owned(),
            NameMatch::Prefix | NameMatch::PrefixIgnoreCase => format!("{}*", self.name),
        }
    }
}

const fn r(broker: Broker, name: &'static str, matching: NameMatch, why: &'static str) -> Reserved {
    Reserved {
        broker,
        name,
        matching,
        why,
    }
}

const HOP: &str = "an HTTP connection or framing header the HTTP client sets";
const AMQP_DLX: &str = "dead-lettering information RabbitMQ records and interprets";
const RMQ: &str =
    "a RocketMQ system property (MessageConst) the client or broker sets or interprets";

/// Every header name a broker reserves (see the module docs and `docs/transports/*.md`).
///
/// - NATS JetStream: the whole `Nats-` namespace (<https://docs.nats.io/nats-concepts/jetstream/headers>:
///   "Nats- is a reserved namespace"): `Nats-Msg-Id` would replace the relay's duplicate-detection
///   id, `Nats-Expected-*` make the server refuse the publish, `Nats-Rollup` purges the stream,
///   `Nats-TTL` expires the message, `Nats-Schedule*` schedule it.
/// - HTTP webhooks: the connection and framing headers (`Host`, `Content-Length`,
///   `Transfer-Encoding`, `Connection`, `Keep-Alive`, `Proxy-Connection`, `Proxy-Authenticate`,
///   `Proxy-Authorization`, `TE`, `Trailer`, `Upgrade`, `Expect`; RFC 9110 §7.6.1, RFC 9112) and
///   the Standard Webhooks headers `webhook-*` the transport sets and signs. `Content-Type` and
///   the other `Content-*` representation headers stay free: they describe the payload.
/// - RabbitMQ: `CC` and `BCC` (sender-selected distribution: extra routing keys, `BCC` removed
///   before delivery), the dead-lettering headers `x-death`, `x-first-death-*`, `x-last-death-*`,
///   `x-delivery-count` (quorum queues), `x-delay` (delayed message exchange), `x-match` (headers
///   exchange), `x-received-from` (federation), `x-shovelled`, `x-shovelled-timestamp` (shovel),
///   `x-stream-offset`, `x-stream-filter-value` (streams), `x-mqtt-publish-qos` and `x-amqp-1.0-*`
///   (protocol conversion). Other `x-` names (such as `x-request-id`) stay free.
/// - RocketMQ: the system property names of `MessageConst` (`KEYS`, `TAGS`, `DELAY`, `UNIQ_KEY`,
///   `TRAN_MSG`, `WAIT`, `TIMER_*`, ...) and the `__RMQ.TRANSIENT.` prefix, case-sensitively.
/// - Kafka, Redis Streams and MQTT 5 reserve no header name: Kafka record headers and MQTT 5 user
///   properties are free-form and the broker interprets none; the Redis transport writes headers
///   as `h:<name>` fields, which cannot collide with its `id` and `payload` fields.
pub const RESERVED: &[Reserved] = &[
    r(
        Broker::Nats,
        "Nats-",
        NameMatch::PrefixIgnoreCase,
        "the Nats- namespace is reserved by the NATS server (Nats-Msg-Id is the relay's duplicate-detection id; Nats-Expected-*, Nats-Rollup, Nats-TTL and Nats-Schedule* steer JetStream)",
    ),
    r(Broker::Webhook, "host", NameMatch::IgnoreCase, HOP),
    r(
        Broker::Webhook,
        "content-length",
        NameMatch::IgnoreCase,
        HOP,
    ),
    r(
        Broker::Webhook,
        "transfer-encoding",
        NameMatch::IgnoreCase,
        HOP,
    ),
    r(Broker::Webhook, "connection", NameMatch::IgnoreCase, HOP),
    r(Broker::Webhook, "keep-alive", NameMatch::IgnoreCase, HOP),
    r(
        Broker::Webhook,
        "proxy-connection",
        NameMatch::IgnoreCase,
        HOP,
    ),
    r(
        Broker::Webhook,
        "proxy-authenticate",
        NameMatch::IgnoreCase,
        HOP,
    ),
    r(
        Broker::Webhook,
        "proxy-authorization",
        NameMatch::IgnoreCase,
        HOP,
    ),
    r(Broker::Webhook, "te", NameMatch::IgnoreCase, HOP),
    r(Broker::Webhook, "trailer", NameMatch::IgnoreCase, HOP),
    r(Broker::Webhook, "upgrade", NameMatch::IgnoreCase, HOP),
    r(Broker::Webhook, "expect", NameMatch::IgnoreCase, HOP),
    r(
        Broker::Webhook,
        "webhook-",
        NameMatch::PrefixIgnoreCase,
        "the Standard Webhooks headers (webhook-id, webhook-timestamp, webhook-signature) the transport sets and signs",
    ),
    r(
        Broker::RabbitMq,
        "CC",
        NameMatch::Exact,
        "sender-selected distribution: extra routing keys",
    ),
    r(
        Broker::RabbitMq,
        "BCC",
        NameMatch::Exact,
        "sender-selected distribution: extra routing keys, removed before delivery",
    ),
    r(Broker::RabbitMq, "x-death", NameMatch::Exact, AMQP_DLX),
    r(
        Broker::RabbitMq,
        "x-first-death-",
        NameMatch::Prefix,
        AMQP_DLX,
    ),
    r(
        Broker::RabbitMq,
        "x-last-death-",
        NameMatch::Prefix,
        AMQP_DLX,
    ),
    r(
        Broker::RabbitMq,
        "x-delivery-count",
        NameMatch::Exact,
        "the delivery count quorum queues set",
    ),
    r(
        Broker::RabbitMq,
        "x-delay",
        NameMatch::Exact,
        "the delay of the delayed message exchange plugin",
    ),
    r(
        Broker::RabbitMq,
        "x-match",
        NameMatch::Exact,
        "the matching mode of a headers exchange",
    ),
    r(
        Broker::RabbitMq,
        "x-received-from",
        NameMatch::Exact,
        "the hop list federation uses to detect cycles",
    ),
    r(
        Broker::RabbitMq,
        "x-shovelled",
        NameMatch::Exact,
        "the forwarding record the shovel adds",
    ),
    r(
        Broker::RabbitMq,
        "x-shovelled-timestamp",
        NameMatch::Exact,
        "the forwarding time the shovel adds",
    ),
    r(
        Broker::RabbitMq,
        "x-stream-offset",
        NameMatch::Exact,
        "the stream offset RabbitMQ streams set",
    ),
    r(
        Broker::RabbitMq,
        "x-stream-filter-value",
        NameMatch::Exact,
        "the filter value of RabbitMQ stream filtering",
    ),
    r(
        Broker::RabbitMq,
        "x-mqtt-publish-qos",
        NameMatch::Exact,
        "the MQTT QoS RabbitMQ records when converting",
    ),
    r(
        Broker::RabbitMq,
        "x-amqp-1.0-",
        NameMatch::Prefix,
        "the AMQP 1.0 sections RabbitMQ records when converting",
    ),
    r(Broker::RocketMq, "TRACE_ON", NameMatch::Exact, RMQ),
    r(Broker::RocketMq, "MSG_REGION", NameMatch::Exact, RMQ),
    r(Broker::RocketMq, "KEYS", NameMatch::Exact, RMQ),
    r(Broker::RocketMq, "TAGS", NameMatch::Exact, RMQ),
    r(Broker::RocketMq, "WAIT", NameMatch::Exact, RMQ),
    r(Broker::RocketMq, "DELAY", NameMatch::Exact, RMQ),
    r(Broker::RocketMq, "RETRY_TOPIC", NameMatch::Exact, RMQ),
    r(Broker::RocketMq, "ORIGIN_GROUP", NameMatch::Exact, RMQ),
    r(Broker::RocketMq, "REAL_TOPIC", NameMatch::Exact, RMQ),
    r(Broker::RocketMq, "REAL_QID", NameMatch::Exact, RMQ),
    r(Broker::RocketMq, "TRAN_MSG", NameMatch::Exact, RMQ),
    r(Broker::RocketMq, "PGROUP", NameMatch::Exact, RMQ),
    r(Broker::RocketMq, "MIN_OFFSET", NameMatch::Exact, RMQ),
    r(Broker::RocketMq, "MAX_OFFSET", NameMatch::Exact, RMQ),
    r(Broker::RocketMq, "BUYER_ID", NameMatch::Exact, RMQ),
    r(Broker::RocketMq, "ORIGIN_MESSAGE_ID", NameMatch::Exact, RMQ),
    r(Broker::RocketMq, "TRANSFER_FLAG", NameMatch::Exact, RMQ),
    r(Broker::RocketMq, "CORRECTION_FLAG", NameMatch::Exact, RMQ),
    r(Broker::RocketMq, "MQ2_FLAG", NameMatch::Exact, RMQ),
    r(Broker::RocketMq, "RECONSUME_TIME", NameMatch::Exact, RMQ),
    r(Broker::RocketMq, "UNIQ_KEY", NameMatch::Exact, RMQ),
    r(
        Broker::RocketMq,
        "MAX_RECONSUME_TIMES",
        NameMatch::Exact,
        RMQ,
    ),
    r(
        Broker::RocketMq,
        "CONSUME_START_TIME",
        NameMatch::Exact,
        RMQ,
    ),
    r(Broker::RocketMq, "POP_CK", NameMatch::Exact, RMQ),
    r(Broker::RocketMq, "POP_CK_OFFSET", NameMatch::Exact, RMQ),
    r(Broker::RocketMq, "1ST_POP_TIME", NameMatch::Exact, RMQ),
    r(
        Broker::RocketMq,
        "TRAN_PREPARED_QUEUE_OFFSET",
        NameMatch::Exact,
        RMQ,
    ),
    r(Broker::RocketMq, "DUP_INFO", NameMatch::Exact, RMQ),
    r(Broker::RocketMq, "EXTEND_UNIQ_INFO", NameMatch::Exact, RMQ),
    r(Broker::RocketMq, "INSTANCE_ID", NameMatch::Exact, RMQ),
    r(Broker::RocketMq, "CORRELATION_ID", NameMatch::Exact, RMQ),
    r(Broker::RocketMq, "REPLY_TO_CLIENT", NameMatch::Exact, RMQ),
    r(Broker::RocketMq, "TTL", NameMatch::Exact, RMQ),
    r(Broker::RocketMq, "ARRIVE_TIME", NameMatch::Exact, RMQ),
    r(Broker::RocketMq, "PUSH_REPLY_TIME", NameMatch::Exact, RMQ),
    r(Broker::RocketMq, "CLUSTER", NameMatch::Exact, RMQ),
    r(Broker::RocketMq, "MSG_TYPE", NameMatch::Exact, RMQ),
    r(
        Broker::RocketMq,
        "INNER_MULTI_QUEUE_OFFSET",
        NameMatch::Exact,
        RMQ,
    ),
    r(
        Broker::RocketMq,
        "INNER_MULTI_DISPATCH",
        NameMatch::Exact,
        RMQ,
    ),
    r(Broker::RocketMq, "INNER_NUM", NameMatch::Exact, RMQ),
    r(Broker::RocketMq, "INNER_BASE", NameMatch::Exact, RMQ),
    r(Broker::RocketMq, "TIMER_", NameMatch::Prefix, RMQ),
    r(Broker::RocketMq, "E_T", NameMatch::Exact, RMQ),
    r(Broker::RocketMq, "__BORNHOST", NameMatch::Exact, RMQ),
    r(Broker::RocketMq, "BORN_TIMESTAMP", NameMatch::Exact, RMQ),
    r(Broker::RocketMq, "DLQ_ORIGIN_TOPIC", NameMatch::Exact, RMQ),
    r(
        Broker::RocketMq,
        "DLQ_ORIGIN_MESSAGE_ID",
        NameMatch::Exact,
        RMQ,
    ),
    r(Broker::RocketMq, "__CRC32#", NameMatch::Exact, RMQ),
    r(
        Broker::RocketMq,
        "_SYS_MSG_PRIORITY_",
        NameMatch::Exact,
        RMQ,
    ),
    r(Broker::RocketMq, "__LITE_TOPIC", NameMatch::Exact, RMQ),
    r(
        Broker::RocketMq,
        "__STARTDELIVERTIME",
        NameMatch::Exact,
        RMQ,
    ),
    r(Broker::RocketMq, "__SHARDINGKEY", NameMatch::Exact, RMQ),
    r(Broker::RocketMq, "__transactionId__", NameMatch::Exact, RMQ),
    r(Broker::RocketMq, "__RMQ.TRANSIENT.", NameMatch::Prefix, RMQ),
    r(
        Broker::RocketMq,
        "CHECK_IMMUNITY_TIME_IN_SECONDS",
        NameMatch::Exact,
        RMQ,
    ),
    r(
        Broker::RocketMq,
        "TRANSACTION_CHECK_TIMES",
        NameMatch::Exact,
        RMQ,
    ),
    r(Broker::RocketMq, "TRANS_OFFSET", NameMatch::Exact, RMQ),
    r(Broker::RocketMq, "TRACE_CONTEXT", NameMatch::Exact, RMQ),
    r(Broker::RocketMq, "REDIRECT", NameMatch::Exact, RMQ),
    r(
        Broker::RocketMq,
        "PROPERTY_FORWARD_QUEUE_ID",
        NameMatch::Exact,
        RMQ,
    ),
];

/// The first [`RESERVED`] entry, of any broker, covering header `name`.
pub fn reserved_by(name: &str) -> Option<&'static Reserved> {
    RESERVED.iter().find(|r| r.matches(name))
}

/// The [`RESERVED`] entry of `broker` covering header `name`, if any.
pub fn reserved_on(broker: Broker, name: &str) -> Option<&'static Reserved> {
    RESERVED
        .iter()
        .find(|r| r.broker == broker && r.matches(name))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reserved_names_match_as_each_broker_compares() {
        assert_eq!(reserved_by("Nats-Msg-Id").unwrap().broker, Broker::Nats);
        assert_eq!(
            reserved_by("nats-expected-stream").unwrap().broker,
            Broker::Nats
        );
        assert_eq!(
            reserved_by("Content-Length").unwrap().broker,
            Broker::Webhook
        );
        assert_eq!(
            reserved_by("webhook-signature").unwrap().broker,
            Broker::Webhook
        );
        assert_eq!(reserved_by("BCC").unwrap().broker, Broker::RabbitMq);
        assert_eq!(
            reserved_by("x-first-death-queue").unwrap().broker,
            Broker::RabbitMq
        );
        assert_eq!(reserved_by("DELAY").unwrap().broker, Broker::RocketMq);
        assert_eq!(
            reserved_by("TIMER_DELIVER_MS").unwrap().broker,
            Broker::RocketMq
        );
        // Case-sensitive brokers: other spellings are free.
        for free in [
            "bcc",
            "X-Death",
            "delay",
            "keys",
            "ttl",
            "x-request-id",
            "content-type",
            "Content-Encoding",
            "traceparent",
            "nats",
            "natsfoo",
        ] {
            assert!(reserved_by(free).is_none(), "{free}");
        }
        assert!(reserved_on(Broker::Kafka, "Nats-Msg-Id").is_none());
        assert!(reserved_on(Broker::Mqtt, "BCC").is_none());
    }
}
