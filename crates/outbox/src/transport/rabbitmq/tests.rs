use super::*;

/// Header names over a short string, a long content-type and the headers RabbitMQ
/// interprets are refused as permanent, naming the header; the rest passes.
#[test]
fn check_refuses_what_amqp_cannot_carry() {
    use crate::transport::wire::test_message as message;
    let long = "n".repeat(256);
    let long_ct = format!("application/{}", "x".repeat(250));
    crate::transport::wire::assert_refused(
        check_message,
        "orders/created",
        [
            (message(&[(long.as_str(), "v")], None), "at most 255 bytes"),
            (
                message(&[("content-type", long_ct.as_str())], None),
                "content_type",
            ),
            (
                message(&[("CC", "other-queue")], None),
                "\"CC\" is reserved by RabbitMQ",
            ),
            (message(&[("BCC", "q")], None), "\"BCC\""),
            (message(&[("x-death", "x")], None), "x-death"),
            (
                message(&[("x-first-death-queue", "q")], None),
                "x-first-death-queue",
            ),
            (message(&[("x-delay", "1000")], None), "x-delay"),
        ],
    );
    let ok = message(
        &[
            ("a b", "x\r\ny"),
            ("x-request-id", "1"),
            ("cc", "lower case is free"),
        ],
        Some("k\n"),
    );
    assert!(
        check_message(&Outgoing {
            message: &ok,
            destination: "orders/created",
        })
        .is_ok()
    );
    assert!(
        check_message(&Outgoing {
            message: &ok,
            destination: "",
        })
        .is_err()
    );
}

#[test]
fn destinations_parse() {
    let d = Destination::parse("orders/order.created").unwrap();
    assert_eq!(
        (d.exchange.as_str(), d.routing_key.as_str()),
        ("orders", "order.created")
    );
    let d = Destination::parse("orders/a/b").unwrap();
    assert_eq!(
        (d.exchange.as_str(), d.routing_key.as_str()),
        ("orders", "a/b")
    );
    let d = Destination::parse("jobs").unwrap();
    assert_eq!((d.exchange.as_str(), d.routing_key.as_str()), ("", "jobs"));
    let d = Destination::parse("/jobs").unwrap();
    assert_eq!((d.exchange.as_str(), d.routing_key.as_str()), ("", "jobs"));
    let d = Destination::parse("fanout/").unwrap();
    assert_eq!(
        (d.exchange.as_str(), d.routing_key.as_str()),
        ("fanout", "")
    );
    for bad in [
        "",
        "/",
        "a\nb",
        &"x".repeat(256),
        &format!("e/{}", "k".repeat(256)),
    ] {
        assert!(Destination::parse(bad).is_err(), "{bad:?}");
    }
}

#[test]
fn config_is_validated_and_redacted() {
    let c = RabbitMqConfig::new("amqp://u:secret@h:5672/%2f");
    c.validate().unwrap();
    assert!(!format!("{c:?}").contains("secret"));
    assert_eq!(c.uris().unwrap()[0].query.heartbeat, Some(10));
    // A seed list: every node parsed, with the same overrides; a bad entry is named.
    let mut seeds = RabbitMqConfig::new("amqp://u:s1@a:5681/%2f, amqp://u:s2@b:5682/%2f");
    seeds.username = Some("app".into());
    let uris = seeds.uris().unwrap();
    assert_eq!(uris.len(), 2);
    assert_eq!(uris[1].authority.port, 5682);
    assert_eq!(uris[1].authority.userinfo.username, "app");
    assert!(!format!("{seeds:?}").contains("s2"));
    let bad = RabbitMqConfig::new("amqp://a:5681/%2f,nats://b:4222")
        .validate()
        .unwrap_err();
    assert_eq!(bad.field, "url");
    assert!(bad.reason.contains("nats://b:4222"), "{}", bad.reason);
    let mut c = RabbitMqConfig::new("amqp://h/%2f?heartbeat=3");
    c.username = Some("app".into());
    c.password = Some("pw".into());
    let uri = c.uris().unwrap().remove(0);
    assert_eq!(uri.query.heartbeat, Some(3));
    assert_eq!(uri.authority.userinfo.username, "app");
    assert_eq!(uri.authority.userinfo.password, "pw");
    assert_eq!(
        RabbitMqConfig::new("nats://h")
            .validate()
            .unwrap_err()
            .field,
        "url"
    );
    let mut c = RabbitMqConfig::new("amqp://h");
    c.confirm_timeout = Duration::ZERO;
    assert_eq!(c.validate().unwrap_err().field, "confirm_timeout");
}

#[test]
fn headers_round_trip_and_sizes() {
    let mut h = Headers::new();
    h.insert("traceparent".into(), "00-abc-def-01".into());
    h.insert("outbox-topic".into(), "t".into());
    let t = headers_table(&h).unwrap();
    assert_eq!(received_headers(Some(&t)), h);
    let p = BasicProperties::default().with_headers(t);
    assert!(properties_size(&p) > 2 * (4 + 11 + 13));
    let mut t = FieldTable::default();
    t.insert("n".into(), AMQPValue::LongLongInt(7));
    t.insert("x-death".into(), AMQPValue::FieldArray(Default::default()));
    let h = received_headers(Some(&t));
    assert_eq!(h.get("n").map(String::as_str), Some("7"));
    assert!(!h.contains_key("x-death"));
}
