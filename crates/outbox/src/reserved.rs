//! The header names each broker reserves for itself: a contract of the message, below every
//! transport. [`RESERVED`] lists them (checked against the brokers' documentation; see
//! `docs/transports/*.md`). [`Limits::validate`](crate::Limits::validate) refuses the union at
//! enqueue ([`EnqueueError::ReservedHeader`](crate::EnqueueError)), so a message enqueued through
//! the library can travel on every transport; each transport's check
//! ([`transport::wire`](crate::transport::wire)) refuses its own broker's names in rows written
//! by SQL. Names are compared as the broker does: HTTP header names and the NATS `Nats-`
//! namespace ignoring ASCII case, AMQP table keys and RocketMQ property names exactly.

use std::fmt;
use std::sync::LazyLock;

use Broker::*;
use NameMatch::*;

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

/// One family of reserved names: a broker, how the names match, why they are reserved, and the
/// names (or prefixes), separated by white space.
struct Family {
    broker: Broker,
    matching: NameMatch,
    names: &'static str,
    why: &'static str,
}

const fn f(broker: Broker, matching: NameMatch, names: &'static str, why: &'static str) -> Family {
    Family {
        broker,
        matching,
        names,
        why,
    }
}

const HOP: &str = "an HTTP connection or framing header the HTTP client sets";
const AMQP_DLX: &str = "dead-lettering information RabbitMQ records and interprets";
const RMQ: &str =
    "a RocketMQ system property (MessageConst) the client or broker sets or interprets";

/// The reserved names by broker and reason; [`RESERVED`] is this table, one entry a name.
const FAMILIES: &[Family] = &[
    f(
        Nats,
        PrefixIgnoreCase,
        "Nats-",
        "the Nats- namespace is reserved by the NATS server (Nats-Msg-Id is the relay's duplicate-detection id; Nats-Expected-*, Nats-Rollup, Nats-TTL and Nats-Schedule* steer JetStream)",
    ),
    f(
        Webhook,
        IgnoreCase,
        "host content-length transfer-encoding connection keep-alive proxy-connection \
         proxy-authenticate proxy-authorization te trailer upgrade expect",
        HOP,
    ),
    f(
        Webhook,
        PrefixIgnoreCase,
        "webhook-",
        "the Standard Webhooks headers (webhook-id, webhook-timestamp, webhook-signature) the transport sets and signs",
    ),
    f(
        RabbitMq,
        Exact,
        "CC",
        "sender-selected distribution: extra routing keys",
    ),
    f(
        RabbitMq,
        Exact,
        "BCC",
        "sender-selected distribution: extra routing keys, removed before delivery",
    ),
    f(RabbitMq, Exact, "x-death", AMQP_DLX),
    f(RabbitMq, Prefix, "x-first-death- x-last-death-", AMQP_DLX),
    f(
        RabbitMq,
        Exact,
        "x-delivery-count",
        "the delivery count quorum queues set",
    ),
    f(
        RabbitMq,
        Exact,
        "x-delay",
        "the delay of the delayed message exchange plugin",
    ),
    f(
        RabbitMq,
        Exact,
        "x-match",
        "the matching mode of a headers exchange",
    ),
    f(
        RabbitMq,
        Exact,
        "x-received-from",
        "the hop list federation uses to detect cycles",
    ),
    f(
        RabbitMq,
        Exact,
        "x-shovelled",
        "the forwarding record the shovel adds",
    ),
    f(
        RabbitMq,
        Exact,
        "x-shovelled-timestamp",
        "the forwarding time the shovel adds",
    ),
    f(
        RabbitMq,
        Exact,
        "x-stream-offset",
        "the stream offset RabbitMQ streams set",
    ),
    f(
        RabbitMq,
        Exact,
        "x-stream-filter-value",
        "the filter value of RabbitMQ stream filtering",
    ),
    f(
        RabbitMq,
        Exact,
        "x-mqtt-publish-qos",
        "the MQTT QoS RabbitMQ records when converting",
    ),
    f(
        RabbitMq,
        Prefix,
        "x-amqp-1.0-",
        "the AMQP 1.0 sections RabbitMQ records when converting",
    ),
    f(
        RocketMq,
        Exact,
        "TRACE_ON MSG_REGION KEYS TAGS WAIT DELAY RETRY_TOPIC ORIGIN_GROUP REAL_TOPIC REAL_QID \
         TRAN_MSG PGROUP MIN_OFFSET MAX_OFFSET BUYER_ID ORIGIN_MESSAGE_ID TRANSFER_FLAG \
         CORRECTION_FLAG MQ2_FLAG RECONSUME_TIME UNIQ_KEY MAX_RECONSUME_TIMES CONSUME_START_TIME \
         POP_CK POP_CK_OFFSET 1ST_POP_TIME TRAN_PREPARED_QUEUE_OFFSET DUP_INFO EXTEND_UNIQ_INFO \
         INSTANCE_ID CORRELATION_ID REPLY_TO_CLIENT TTL ARRIVE_TIME PUSH_REPLY_TIME CLUSTER \
         MSG_TYPE INNER_MULTI_QUEUE_OFFSET INNER_MULTI_DISPATCH INNER_NUM INNER_BASE E_T \
         __BORNHOST BORN_TIMESTAMP DLQ_ORIGIN_TOPIC DLQ_ORIGIN_MESSAGE_ID __CRC32# \
         _SYS_MSG_PRIORITY_ __LITE_TOPIC __STARTDELIVERTIME __SHARDINGKEY __transactionId__ \
         CHECK_IMMUNITY_TIME_IN_SECONDS TRANSACTION_CHECK_TIMES TRANS_OFFSET TRACE_CONTEXT \
         REDIRECT PROPERTY_FORWARD_QUEUE_ID",
        RMQ,
    ),
    f(RocketMq, Prefix, "TIMER_ __RMQ.TRANSIENT.", RMQ),
];

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
///
/// Built once from a table of families, one entry a name, in the order of the module's table.
pub static RESERVED: LazyLock<Vec<Reserved>> = LazyLock::new(|| {
    FAMILIES
        .iter()
        .flat_map(|family| {
            family.names.split_whitespace().map(|name| Reserved {
                broker: family.broker,
                name,
                matching: family.matching,
                why: family.why,
            })
        })
        .collect()
});

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
    fn the_table_lists_each_name_once() {
        let mut seen = std::collections::HashSet::new();
        for r in RESERVED.iter() {
            assert!(!r.name.is_empty());
            assert!(seen.insert((r.broker, r.name)), "{} listed twice", r.name);
        }
        assert_eq!(
            RESERVED.len(),
            89,
            "the table of the last release had 89 entries"
        );
    }

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
