use super::*;

#[test]
fn topic_names_are_validated() {
    for ok in ["a", "orders.created", "a-b_c.D9", &"x".repeat(249)] {
        assert!(valid_topic(ok), "{ok}");
    }
    for bad in ["", ".", "..", "a b", "a/b", "ä", &"x".repeat(250), "a*"] {
        assert!(!valid_topic(bad), "{bad:?}");
    }
}

/// Kafka carries any header and key; only the topic is checked, and a bad one is named.
#[test]
fn check_refuses_only_bad_topics() {
    use crate::transport::wire::test_message as message;
    let m = message(
        &[
            ("a b", "x\r\ny"),
            ("Nats-Msg-Id", "1"),
            ("BCC", "q"),
            ("", ""),
        ],
        Some("k\r\n\u{0}"),
    );
    let out = |destination| Outgoing {
        message: &m,
        destination,
    };
    assert!(check_message(&out("orders.created")).is_ok());
    let e = check_message(&out("a b")).unwrap_err();
    assert_eq!(e.kind(), TransportErrorKind::Permanent);
    assert!(e.report().contains("destination \"a b\""), "{}", e.report());
}

#[test]
fn config_validation_names_the_field() {
    let c = KafkaConfig::new("kafka://127.0.0.1:19092/");
    assert_eq!(c.bootstrap_servers, "127.0.0.1:19092");
    c.validate().unwrap();
    let field = |f: &dyn Fn(&mut KafkaConfig)| {
        let mut c = KafkaConfig::new("h:1,k:2");
        f(&mut c);
        c.validate().unwrap_err().field
    };
    assert_eq!(field(&|c| c.bootstrap_servers.clear()), "bootstrap_servers");
    assert_eq!(
        field(&|c| c.bootstrap_servers = "h:1,nohost".into()),
        "bootstrap_servers"
    );
    assert_eq!(
        field(&|c| c.delivery_timeout = Duration::ZERO),
        "delivery_timeout"
    );
    assert_eq!(field(&|c| c.max_message_bytes = 10), "max_message_bytes");
    assert_eq!(
        field(&|c| {
            c.properties.insert("acks".into(), "1".into());
        }),
        "properties.acks"
    );
    assert_eq!(
        field(&|c| {
            c.properties
                .insert("enable.idempotence".into(), "false".into());
        }),
        "properties.enable.idempotence"
    );
    assert_eq!(
        field(&|c| {
            c.sasl = Some(KafkaSasl {
                mechanism: "GSSAPI".into(),
                username: "u".into(),
                password: "p".into(),
                ..KafkaSasl::default()
            })
        }),
        "sasl.mechanism"
    );
}

#[test]
fn producer_settings_keep_the_promises() {
    let mut c = KafkaConfig::new("h:1");
    c.properties.insert("linger.ms".into(), "20".into());
    c.properties
        .insert("sasl.password".into(), "hunter2".into());
    let p = c.producer_config();
    assert_eq!(p.get("acks"), Some("all"));
    assert_eq!(p.get("enable.idempotence"), Some("true"));
    assert_eq!(p.get("message.timeout.ms"), Some("5000"));
    assert_eq!(p.get("linger.ms"), Some("20"));
    assert_eq!(p.get("partitioner"), Some("murmur2_random"));
    assert_eq!(p.get("allow.auto.create.topics"), Some("false"));
    assert!(!format!("{c:?}").contains("hunter2"));
    let e = KafkaTransport::new({
        let mut c = KafkaConfig::new("h:1");
        c.properties.insert("no.such.property".into(), "1".into());
        c
    })
    .unwrap_err();
    assert_eq!(e.field, "properties.no.such.property");
}

#[test]
fn errors_are_classified() {
    use RDKafkaErrorCode as C;
    use TransportErrorKind::{Permanent, Retryable, Unavailable};
    let k = |c| KafkaError::MessageProduction(c);
    // (error code, all brokers down, kind)
    for (code, brokers_down, kind) in [
        (C::MessageSizeTooLarge, false, Permanent),
        (C::QueueFull, false, Retryable),
        (C::UnknownTopicOrPartition, false, Unavailable),
        (C::Fatal, false, Unavailable),
        (C::ProducerFenced, false, Unavailable),
        (C::TopicAuthorizationFailed, false, Unavailable),
        (C::SaslAuthenticationFailed, false, Unavailable),
        (C::MessageTimedOut, false, Retryable),
        (C::MessageTimedOut, true, Unavailable),
        (C::AllBrokersDown, false, Unavailable),
    ] {
        assert_eq!(
            classify(&k(code), brokers_down),
            kind,
            "{code:?}, brokers down: {brokers_down}"
        );
    }
    assert!(produce_error(k(C::UnknownTopicOrPartition), false, "t").is_missing_destination());
}
