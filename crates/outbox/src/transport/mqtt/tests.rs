use super::*;

/// Strings a broker may treat as malformed, or rumqttc cannot encode, are refused as
/// permanent, naming the header or key; MQTT reserves no name.
#[test]
fn check_refuses_what_mqtt_cannot_carry() {
    use crate::transport::wire::test_message as message;
    let long = "v".repeat(65_536);
    crate::transport::wire::assert_refused(
        check_message,
        "orders/created",
        [
            (
                message(&[("a", long.as_str())], None),
                "header \"a\": an MQTT string is at most",
            ),
            (message(&[("a\u{0}b", "v")], None), "header \"a\\0b\""),
            (message(&[("a", "x\ty")], None), "tab included"),
            (message(&[("a", "x\u{85}y")], None), "header \"a\""),
            (message(&[("a", "x\u{FFFF}")], None), "noncharacter"),
            (message(&[], Some("k\r\n")), "partition key \"k\\r\\n\""),
        ],
    );
    let ok = message(
        &[("a b", "x y \u{e9}😀"), ("Nats-Msg-Id", "1"), ("BCC", "q")],
        Some("order 7"),
    );
    let out = |destination| Outgoing {
        message: &ok,
        destination,
    };
    assert!(check_message(&out("orders/created")).is_ok());
    assert!(check_message(&out("orders/+")).is_err());
    assert!(check_message(&out("a\nb")).is_err());
}

#[test]
fn urls_parse() {
    let a = parse_url("mqtt://127.0.0.1:1883").unwrap();
    assert_eq!((a.host.as_str(), a.port, a.tls), ("127.0.0.1", 1883, false));
    let a = parse_url("mqtts://u:p@broker.example").unwrap();
    assert_eq!((a.port, a.tls), (8883, true));
    assert_eq!(
        (a.username.as_deref(), a.password.as_deref()),
        (Some("u"), Some("p"))
    );
    for bad in ["http://x", "mqtt://", "mqtt://h:notaport", "x"] {
        assert_eq!(parse_url(bad).unwrap_err().field, "url", "{bad}");
    }
}

#[test]
fn topics_are_validated() {
    assert!(validate_topic("orders/created").is_ok());
    for bad in ["", "a/+", "a/#", "$SYS/x", "a\0b"] {
        assert!(validate_topic(bad).is_err(), "{bad:?}");
    }
}

#[test]
fn puback_reasons_are_classified() {
    assert_eq!(puback_kind(PubAckReason::Success), None);
    assert_eq!(
        puback_kind(PubAckReason::NoMatchingSubscribers),
        Some(TransportErrorKind::Retryable)
    );
    assert_eq!(
        puback_kind(PubAckReason::NotAuthorized),
        Some(TransportErrorKind::Unavailable)
    );
    assert_eq!(
        puback_kind(PubAckReason::QuotaExceeded),
        Some(TransportErrorKind::Retryable)
    );
    let accept = puback_result(
        &PubAck {
            pkid: 1,
            reason: PubAckReason::NoMatchingSubscribers,
            properties: None,
        },
        NoSubscribers::Accept,
    );
    assert!(accept.is_ok());
}
