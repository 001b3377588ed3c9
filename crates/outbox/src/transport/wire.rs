//! What a broker can carry: the header names each broker reserves for itself, and the
//! machinery a transport's [`Transport::check`](super::Transport::check) uses to refuse, before
//! anything is sent, a message its broker's client cannot put on the wire.
//!
//! # Why
//! Rows written by plain SQL (the public table contract) skip the enqueue checks of
//! [`Limits::validate`](crate::Limits::validate). A header name with a space or a CR/LF in a
//! header value or partition key makes some clients panic (async-nats asserts on them), others
//! write a malformed frame the broker answers by closing the connection (an MQTT string over
//! 65,535 bytes), and a header the broker interprets (`Nats-Msg-Id`, RabbitMQ's `BCC`, RocketMQ's
//! `DELAY`) silently changes what happens to the message. Each transport checks what it is about to
//! send and refuses what its broker cannot carry with a permanent
//! [`TransportError`](crate::TransportError) whose source is a [`WireError`] naming the header or
//! key and the rule it breaks; the relay dead-letters that message (FAILED with that reason) and
//! publishes the rest of its batch.
//!
//! # Reserved header names
//! [`RESERVED`] (from [`crate::reserved`], re-exported here) lists the names each broker
//! reserves; each transport's check refuses its own broker's names in rows written by SQL.

// Each broker transport uses its own part of these checks; a build without every one of
// them (a store-only build, `--no-default-features --features postgres`, or one broker) leaves
// the others' parts unused.
#![cfg_attr(
    not(all(
        feature = "webhook",
        feature = "nats",
        feature = "rabbitmq",
        feature = "mqtt",
        feature = "rocketmq"
    )),
    allow(dead_code)
)]

use std::fmt;

use crate::error::TransportError;
use crate::message::{HEADER_PARTITION_KEY, HEADER_TOPIC, Message};

pub use crate::reserved::{Broker, NameMatch, RESERVED, Reserved, reserved_by, reserved_on};

/// The part of a message a [`WireError`] is about.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Field {
    /// A header, by name.
    Header(String),
    /// The partition key (it travels as header `outbox-partition-key` and, on some brokers, as
    /// the record key), shown escaped and cut to 64 characters.
    PartitionKey(String),
    /// The topic (it travels as header `outbox-topic`), shown escaped and cut to 64 characters.
    Topic(String),
    /// The destination the route resolved to.
    Destination(String),
    /// The payload.
    Payload,
}

impl fmt::Display for Field {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Field::Header(n) => write!(f, "header {n:?}"),
            Field::PartitionKey(k) => {
                write!(f, "partition key {k} (header {HEADER_PARTITION_KEY})")
            }
            Field::Topic(t) => write!(f, "topic {t} (header {HEADER_TOPIC})"),
            Field::Destination(d) => write!(f, "destination {d:?}"),
            Field::Payload => f.write_str("the payload"),
        }
    }
}

/// `s` escaped as a Rust string literal, cut to 64 characters (for keys and topics in errors).
fn shown(s: &str) -> String {
    const MAX: usize = 64;
    if s.chars().count() <= MAX {
        format!("{s:?}")
    } else {
        let cut: String = s.chars().take(MAX).collect();
        format!("{cut:?}… ({} bytes)", s.len())
    }
}

/// Why a transport refuses to put a message on the wire. It is the source of the permanent
/// [`TransportError`] the transport's [`check`](super::Transport::check) returns, so the row's
/// `last_error` reads `refused before publishing to <broker>: <this>`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WireError {
    /// A user header whose name the broker reserves.
    Reserved {
        /// The header name as written in the message.
        name: String,
        /// The reservation it falls under.
        reserved: &'static Reserved,
    },
    /// A value the broker's client cannot carry.
    Unsupported {
        /// The broker.
        broker: Broker,
        /// What is refused.
        field: Field,
        /// The rule it breaks.
        rule: &'static str,
    },
}

impl fmt::Display for WireError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WireError::Reserved { name, reserved } => write!(
                f,
                "header {name:?} is reserved by {} ({}): {}",
                reserved.broker,
                reserved.pattern(),
                reserved.why
            ),
            WireError::Unsupported {
                broker,
                field,
                rule,
            } => write!(f, "{broker} cannot carry {field}: {rule}"),
        }
    }
}

impl WireError {
    /// An [`Unsupported`](WireError::Unsupported) error.
    pub fn unsupported(broker: Broker, field: Field, rule: &'static str) -> WireError {
        WireError::Unsupported {
            broker,
            field,
            rule,
        }
    }

    /// The broker concerned.
    pub fn broker(&self) -> Broker {
        match self {
            WireError::Reserved { reserved, .. } => reserved.broker,
            WireError::Unsupported { broker, .. } => *broker,
        }
    }
}

impl From<WireError> for TransportError {
    /// A permanent transport error with `e` as its source.
    fn from(e: WireError) -> TransportError {
        TransportError::permanent(format!("refused before publishing to {}", e.broker()))
            .with_source(e)
    }
}

/// The character and length rules of one broker's headers, for [`check_headers`].
pub(crate) struct HeaderRules {
    /// The broker.
    pub broker: Broker,
    /// `Err(rule)` for a header name the client cannot carry.
    pub name: fn(&str) -> Result<(), &'static str>,
    /// `Err(rule)` for a header value the client cannot carry.
    pub value: fn(&str) -> Result<(), &'static str>,
}

/// Check the headers `m` puts on the wire ([`Message::wire_headers`]): each user header name
/// against the broker's reserved names, then every name and value (the topic and the partition
/// key included, which travel as `outbox-topic` and `outbox-partition-key`) against `rules`.
///
/// # Errors
/// The first [`WireError`] found, naming the header (or the key, or the topic).
pub(crate) fn check_headers(m: &Message, rules: &HeaderRules) -> Result<(), WireError> {
    for name in m.headers.keys() {
        if let Some(reserved) = reserved_on(rules.broker, name) {
            return Err(WireError::Reserved {
                name: name.clone(),
                reserved,
            });
        }
    }
    let header = |name: &str| Field::Header(name.to_owned());
    for (name, value) in &m.headers {
        (rules.name)(name)
            .map_err(|rule| WireError::unsupported(rules.broker, header(name), rule))?;
        (rules.value)(value)
            .map_err(|rule| WireError::unsupported(rules.broker, header(name), rule))?;
    }
    (rules.value)(&m.topic).map_err(|rule| {
        WireError::unsupported(rules.broker, Field::Topic(shown(&m.topic)), rule)
    })?;
    if let Some(key) = &m.partition_key {
        (rules.value)(key).map_err(|rule| {
            WireError::unsupported(rules.broker, Field::PartitionKey(shown(key)), rule)
        })?;
    }
    Ok(())
}

/// Whether `c` is a Unicode noncharacter (U+FDD0..U+FDEF, and the last two code points of
/// every plane).
pub(crate) fn is_noncharacter(c: char) -> bool {
    let n = c as u32;
    (0xFDD0..=0xFDEF).contains(&n) || (n & 0xFFFE) == 0xFFFE
}

/// A claimed message with these headers and partition key (topic `orders.created`, payload
/// `p`), for the transports' unit tests of `check`.
/// Assert that `check` refuses each `(message, text)` of `cases`, sent to `destination`, as
/// permanent with an error whose report contains `text`: the transports' unit tests of `check`.
#[cfg(test)]
pub(crate) fn assert_refused<'t>(
    check: impl Fn(&super::Outgoing<'_>) -> Result<(), TransportError>,
    destination: &str,
    cases: impl IntoIterator<Item = (Message, &'t str)>,
) {
    for (message, named) in cases {
        let e = check(&super::Outgoing {
            message: &message,
            destination,
        })
        .unwrap_err();
        assert_eq!(e.kind(), crate::TransportErrorKind::Permanent, "{named}");
        assert!(e.report().contains(named), "{named}: {}", e.report());
    }
}

#[cfg(test)]
pub(crate) fn test_message(headers: &[(&str, &str)], key: Option<&str>) -> Message {
    Message {
        id: 1,
        message_id: uuid::Uuid::now_v7(),
        topic: "orders.created".into(),
        partition_key: key.map(str::to_owned),
        headers: headers
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect(),
        payload: b"p".to_vec(),
        attempts: 1,
        max_attempts: 5,
        redelivery: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::test_message as message;
    use super::*;
    #[test]
    fn errors_name_the_header_the_key_and_the_rule() {
        let rules = HeaderRules {
            broker: Broker::Nats,
            name: |n| {
                if n.contains(' ') {
                    Err("no spaces in names")
                } else {
                    Ok(())
                }
            },
            value: |v| {
                if v.contains('\n') {
                    Err("no LF in values")
                } else {
                    Ok(())
                }
            },
        };
        let e = check_headers(&message(&[("a b", "v")], None), &rules).unwrap_err();
        assert_eq!(
            e.to_string(),
            "NATS JetStream cannot carry header \"a b\": no spaces in names"
        );
        let e = check_headers(&message(&[("a", "x\ny")], None), &rules).unwrap_err();
        assert!(e.to_string().contains("header \"a\""), "{e}");
        let e = check_headers(&message(&[], Some("k\n1")), &rules).unwrap_err();
        assert!(e.to_string().contains("partition key \"k\\n1\""), "{e}");
        let e = check_headers(&message(&[("Nats-Msg-Id", "x")], None), &rules).unwrap_err();
        assert!(matches!(e, WireError::Reserved { .. }));
        assert!(
            e.to_string()
                .contains("\"Nats-Msg-Id\" is reserved by NATS JetStream"),
            "{e}"
        );
        let t: TransportError = e.into();
        assert_eq!(t.kind(), crate::TransportErrorKind::Permanent);
        assert!(t.report().contains("Nats-Msg-Id"), "{}", t.report());
        assert!(check_headers(&message(&[("ok", "fine")], Some("k")), &rules).is_ok());
        let long = "k".repeat(100);
        let e = check_headers(&message(&[], Some(&format!("{long}\n"))), &rules).unwrap_err();
        assert!(e.to_string().contains("(101 bytes)"), "{e}");
    }

    #[test]
    fn noncharacters() {
        for c in [
            '\u{FDD0}',
            '\u{FDEF}',
            '\u{FFFE}',
            '\u{FFFF}',
            '\u{1FFFF}',
            '\u{10FFFF}',
        ] {
            assert!(is_noncharacter(c), "{c:?}");
        }
        for c in ['a', '\u{FDCF}', '\u{FFFD}', '😀'] {
            assert!(!is_noncharacter(c), "{c:?}");
        }
    }
}
