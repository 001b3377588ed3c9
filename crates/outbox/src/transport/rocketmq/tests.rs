use super::*;

#[test]
fn destinations_parse() {
    assert_eq!(
        Destination::parse("Orders").unwrap(),
        Destination {
            topic: "Orders".into(),
            tag: None
        }
    );
    assert_eq!(
        Destination::parse("order_topic:order-created.v1").unwrap(),
        Destination {
            topic: "order_topic".into(),
            tag: Some("order-created.v1".into())
        }
    );
    for bad in [
        "",
        "a.b",
        "a b",
        ":tag",
        "t:",
        "t:a b",
        "t:a||b",
        "SCHEDULE_TOPIC_XXXX",
        &"x".repeat(128),
    ] {
        assert!(Destination::parse(bad).is_err(), "{bad:?}");
    }
}

#[test]
fn urls_and_config_validate() {
    assert_eq!(
        name_server_of_url("rocketmq://127.0.0.1:9876").unwrap(),
        "127.0.0.1:9876"
    );
    assert_eq!(
        name_server_of_url("rocketmq://a:1;b:2/").unwrap(),
        "a:1;b:2"
    );
    for bad in [
        "nats://x:1",
        "rocketmq://",
        "rocketmq://host",
        "rocketmq://h:0",
    ] {
        assert_eq!(name_server_of_url(bad).unwrap_err().field, "url", "{bad}");
    }
    let mut c = RocketMqConfig::new("127.0.0.1:9876");
    c.validate().unwrap();
    c.producer_group = "bad group".into();
    assert_eq!(c.validate().unwrap_err().field, "producer_group");
    let mut c = RocketMqConfig::new("127.0.0.1:9876");
    c.max_in_flight = 0;
    assert_eq!(c.validate().unwrap_err().field, "max_in_flight");
    let mut c = RocketMqConfig::new("127.0.0.1:9876");
    c.credentials = Some(Credentials {
        access_key: "ak".into(),
        secret_key: String::new(),
        secret_key_env: None,
    });
    assert_eq!(c.validate().unwrap_err().field, "secret_key_env");
}

#[test]
fn key_selects_java_hash_queue() {
    let mqs: Vec<MessageQueue> = (0..4)
        .map(|i| MessageQueue::from_parts("T", "b", i))
        .collect();
    let m = MqMessage::builder()
        .topic("T")
        .body_slice(b"x")
        .build()
        .unwrap();
    // Java: "order-7".hashCode() = -1_207_227_853 (computed with String.hashCode); % 4 = -1 → 1.
    let q = select_by_key(&mqs, &m, &"order-7".to_string()).unwrap();
    let h = "order-7".java_hash_code();
    assert_eq!(q.queue_id(), (h % 4).abs());
    assert!(select_by_key(&[], &m, &"k".to_string()).is_none());
}

/// Every name of the client's system property list is in `wire::RESERVED`, so the enqueue
/// check refuses it without the `rocketmq` feature.
#[test]
fn reserved_list_covers_the_clients_system_properties() {
    for name in STRING_HASH_SET.iter() {
        assert!(
            crate::transport::wire::reserved_on(Broker::RocketMq, name).is_some(),
            "{name} is missing from wire::RESERVED"
        );
    }
}

/// Property separators, system property names, an empty body and a bad destination are
/// refused as permanent, naming the header, key or destination.
#[test]
fn check_refuses_what_rocketmq_cannot_carry() {
    use crate::transport::wire::test_message as message;
    let mut empty = message(&[], None);
    empty.payload.clear();
    crate::transport::wire::assert_refused(
        |o| check_message(o, 1024),
        "Orders:created",
        [
            (message(&[("a\u{1}b", "v")], None), "U+0001 or U+0002"),
            (message(&[("a", "x\u{2}y")], None), "header \"a\""),
            (message(&[], Some("k\u{1}")), "partition key"),
            (
                message(&[("DELAY", "3")], None),
                "\"DELAY\" is reserved by RocketMQ",
            ),
            (message(&[("UNIQ_KEY", "x")], None), "UNIQ_KEY"),
            (empty, "empty message body"),
        ],
    );
    let ok = message(&[("delay", "3"), ("a b", "x\r\ny")], Some("order 7"));
    let out = |destination| Outgoing {
        message: &ok,
        destination,
    };
    assert!(check_message(&out("Orders:created"), 1024).is_ok());
    assert!(check_message(&out("orders.created"), 1024).is_err());
}

#[test]
fn system_property_names_cannot_be_headers() {
    let d = Destination::parse("T:tag").unwrap();
    let mut h = crate::message::Headers::new();
    h.insert("KEYS".into(), "x".into());
    let e = build_raw(&d, bytes::Bytes::from_static(b"x"), None, vec![], h).unwrap_err();
    assert!(e.contains("KEYS"), "{e}");
    let mut h = crate::message::Headers::new();
    h.insert("traceparent".into(), "00-abc-def-01".into());
    let m = build_raw(
        &d,
        bytes::Bytes::from_static(b"x"),
        Some("id-1"),
        vec!["id-1".into(), "k".into()],
        h,
    )
    .unwrap();
    assert_eq!(m.property("UNIQ_KEY"), Some("id-1"));
    assert_eq!(m.property("KEYS"), Some("id-1 k"));
    assert_eq!(m.property("TAGS"), Some("tag"));
    assert_eq!(m.property("traceparent"), Some("00-abc-def-01"));
}

#[test]
fn client_errors_are_classified() {
    let illegal = ClientError::from(MQClientException::new_with_code(13, "too big"));
    assert_eq!(class_of(&illegal), Class::Permanent);
    let route = ClientError::from(MQClientException::new_with_code(
        10005,
        "No route info of this topic:x",
    ));
    assert_eq!(class_of(&route), Class::NoRoute);
    let text = ClientError::from(MQClientException::new("No route info for this topic, x"));
    assert_eq!(class_of(&text), Class::NoRoute);
    let busy = ClientError::from(MQClientException::new_with_code(2, "busy"));
    assert_eq!(class_of(&busy), Class::Retryable);
    let timeout = ClientError::timeout("send", 10);
    assert_eq!(class_of(&timeout), Class::Retryable);
}
