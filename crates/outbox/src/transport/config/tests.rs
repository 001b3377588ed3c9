//! Each transport config from a TOML-shaped table and back; `validate` names the bad field;
//! an unknown `kind` is refused. The tables are written as JSON values (serde_json is a
//! dependency; the shapes are those of the TOML tables).

use std::time::Duration;

use serde_json::{Value, json};

use super::*;

fn parse(v: Value) -> Result<TransportConfig, String> {
    serde_json::from_value(v).map_err(|e| e.to_string())
}

/// Parse, write back, parse again: the second reading prints as the first.
fn round_trip(v: Value) -> TransportConfig {
    let c = parse(v.clone()).unwrap_or_else(|e| panic!("{v}: {e}"));
    let written = serde_json::to_value(&c).unwrap();
    let again = parse(written.clone()).unwrap_or_else(|e| panic!("{written}: {e}"));
    assert_eq!(format!("{c:?}"), format!("{again:?}"), "{written}");
    assert_eq!(written["kind"], v["kind"]);
    c
}

fn field(v: Value) -> String {
    parse(v).unwrap().validate().unwrap_err().field
}

#[test]
fn unknown_kind_is_refused_with_the_known_ones() {
    let e = parse(json!({"kind": "carrier-pigeon", "url": "x"})).unwrap_err();
    assert!(e.contains("carrier-pigeon"), "{e}");
    assert!(e.contains("nats") && e.contains("webhook"), "{e}");
    let e = parse(json!({"url": "x"})).unwrap_err();
    assert!(e.contains("kind"), "{e}");
}

#[test]
fn unknown_field_is_named() {
    let e = parse(json!({"kind": "webhook", "url": "http://h/", "timeuot": "1s"})).unwrap_err();
    assert!(e.contains("timeuot"), "{e}");
}

#[test]
fn env_secret_names_the_field() {
    assert_eq!(env_secret("password_env", None).unwrap(), None);
    let e = env_secret("password_env", Some("OUTBOX_TEST_UNSET_VARIABLE_4711")).unwrap_err();
    assert_eq!(e.field, "password_env");
    assert!(e.reason.contains("OUTBOX_TEST_UNSET_VARIABLE_4711"));
}

#[cfg(feature = "webhook")]
#[test]
fn webhook_round_trips_and_names_bad_fields() {
    let c = round_trip(json!({
        "kind": "webhook", "url": "https://h/hook", "timeout": "2s", "concurrency": 8,
        "secret_env": "OUTBOX_TEST_UNSET_VARIABLE_4711"
    }));
    let TransportConfig::Webhook(w) = &c else {
        panic!("{c:?}")
    };
    assert_eq!(w.timeout, Duration::from_secs(2));
    assert_eq!(w.concurrency, 8);
    assert_eq!(c.default_destination(), "");
    assert_eq!(c.validate().unwrap_err().field, "secret_env");
    let ok = json!({"kind": "webhook", "url": "http://h/"});
    parse(ok.clone()).unwrap().validate().unwrap();
    assert_eq!(field(json!({"kind": "webhook", "url": "ftp://h/"})), "url");
    assert_eq!(
        field(json!({"kind": "webhook", "url": "http://h/", "concurrency": 0})),
        "concurrency"
    );
    // A secret given in the configuration is never written back.
    let mut w = crate::transport::webhook::WebhookConfig::new("http://h/");
    w.secret = Some("whsec_c2VjcmV0".into());
    let text = serde_json::to_string(&TransportConfig::Webhook(w)).unwrap();
    assert!(!text.contains("whsec"), "{text}");
}

#[cfg(feature = "nats")]
#[test]
fn nats_round_trips_and_names_bad_fields() {
    let c = round_trip(json!({
        "kind": "nats", "url": "nats://127.0.0.1:4222", "stream": "ORDERS", "ack_timeout": "500ms"
    }));
    let TransportConfig::Nats(n) = &c else {
        panic!("{c:?}")
    };
    let s = n.stream.as_ref().unwrap();
    assert_eq!((s.name.as_str(), s.create), ("ORDERS", true));
    assert_eq!(s.subjects, ["orders.>"]);
    assert_eq!(n.ack_timeout, Duration::from_millis(500));
    assert_eq!(c.default_destination(), "{topic}");
    c.validate().unwrap();
    assert_eq!(field(json!({"kind": "nats", "url": "http://h"})), "url");
    assert_eq!(
        field(json!({"kind": "nats", "url": "nats://h", "ack_timeout": "0s"})),
        "ack_timeout"
    );
}

#[cfg(feature = "redis")]
#[test]
fn redis_round_trips_and_names_bad_fields() {
    let c = round_trip(json!({
        "kind": "redis", "url": "redis://127.0.0.1:6379", "max_len": 10,
        "wait_replicas": 1, "wait_timeout": "200ms"
    }));
    let TransportConfig::Redis(r) = &c else {
        panic!("{c:?}")
    };
    assert_eq!(r.wait_replicas.unwrap().timeout, Duration::from_millis(200));
    c.validate().unwrap();
    assert_eq!(
        field(json!({"kind": "redis", "url": "redis://h", "max_len": 0})),
        "max_len"
    );
    assert_eq!(
        field(json!({"kind": "redis", "url": "redis://h",
                      "password_env": "OUTBOX_TEST_UNSET_VARIABLE_4711"})),
        "password_env"
    );
    let e = parse(json!({"kind": "redis", "url": "redis://h", "wait_timeout": "1s"})).unwrap_err();
    assert!(e.contains("wait_timeout"), "{e}");
}

#[cfg(feature = "mqtt")]
#[test]
fn mqtt_round_trips_and_names_bad_fields() {
    let c = round_trip(json!({
        "kind": "mqtt", "url": "mqtt://127.0.0.1:1883", "client_id": "relay-1",
        "keep_alive": "10s", "no_subscribers": "accept"
    }));
    let TransportConfig::Mqtt(m) = &c else {
        panic!("{c:?}")
    };
    assert_eq!(
        m.no_subscribers,
        crate::transport::mqtt::NoSubscribers::Accept
    );
    assert_eq!(m.keep_alive, Duration::from_secs(10));
    c.validate().unwrap();
    assert_eq!(
        field(json!({"kind": "mqtt", "url": "mqtt://h", "max_inflight": 0})),
        "max_inflight"
    );
    assert_eq!(
        field(json!({"kind": "mqtt", "url": "mqtt://h", "client_id": ""})),
        "client_id"
    );
    let e =
        parse(json!({"kind": "mqtt", "url": "mqtt://h", "no_subscribers": "drop"})).unwrap_err();
    assert!(e.contains("drop"), "{e}");
}

#[cfg(feature = "rabbitmq")]
#[test]
fn rabbitmq_round_trips_and_names_bad_fields() {
    let c = round_trip(json!({
        "kind": "rabbitmq", "url": "amqp://127.0.0.1:5672/%2f", "confirm_timeout": "3s",
        "unroutable": "fail", "exchange": "orders"
    }));
    let TransportConfig::Rabbitmq(r) = &c else {
        panic!("{c:?}")
    };
    assert_eq!(r.unroutable, crate::transport::rabbitmq::Unroutable::Fail);
    assert_eq!(c.default_destination(), "orders/{topic}");
    c.validate().unwrap();
    let url = "amqp://127.0.0.1:5672/%2f";
    assert_eq!(
        field(json!({"kind": "rabbitmq", "url": url, "exchange": "a/b"})),
        "exchange"
    );
    assert_eq!(
        field(json!({"kind": "rabbitmq", "url": "amqps://h/%2f"})),
        "tls_ca_file"
    );
    assert_eq!(
        field(json!({"kind": "rabbitmq", "url": url, "max_message_bytes": 0})),
        "max_message_bytes"
    );
}

#[cfg(feature = "kafka")]
#[test]
fn kafka_round_trips_and_names_bad_fields() {
    let c = round_trip(json!({
        "kind": "kafka", "bootstrap_servers": "kafka://127.0.0.1:9092", "linger": "1ms",
        "create_topics": ["orders"], "partitions": 3,
        "sasl": {"username_env": "U", "password_env": "P"},
        "tls": {"ca_file": "/ca.pem"},
        "properties": {"compression.type": "lz4"}
    }));
    let TransportConfig::Kafka(k) = &c else {
        panic!("{c:?}")
    };
    assert_eq!(k.bootstrap_servers, "127.0.0.1:9092");
    assert_eq!(k.sasl.as_ref().unwrap().mechanism, "PLAIN");
    assert_eq!(
        k.tls.as_ref().unwrap().ca_location.as_deref(),
        Some("/ca.pem")
    );
    assert_eq!(k.topics()[0].partitions, 3);
    let b = "127.0.0.1:9092";
    assert_eq!(
        field(json!({"kind": "kafka", "bootstrap_servers": "nohostport"})),
        "bootstrap_servers"
    );
    assert_eq!(
        field(json!({"kind": "kafka", "bootstrap_servers": b, "partitions": 0})),
        "partitions"
    );
    assert_eq!(
        field(json!({"kind": "kafka", "bootstrap_servers": b,
                      "sasl": {"username_env": "OUTBOX_TEST_UNSET_VARIABLE_4711", "password_env": "P"}})),
        "sasl.username_env"
    );
}

#[cfg(feature = "rocketmq")]
#[test]
fn rocketmq_round_trips_and_names_bad_fields() {
    let c = round_trip(json!({
        "kind": "rocketmq", "url": "rocketmq://127.0.0.1:9876", "default_topic": "Orders",
        "send_timeout": "5s", "access_key": "ak", "secret_key_env": "OUTBOX_TEST_UNSET_VARIABLE_4711"
    }));
    assert_eq!(c.default_destination(), "Orders:{topic}");
    assert_eq!(c.validate().unwrap_err().field, "secret_key_env");
    let url = "rocketmq://127.0.0.1:9876";
    assert_eq!(
        field(json!({"kind": "rocketmq", "url": "nats://h:1"})),
        "url"
    );
    assert_eq!(
        field(json!({"kind": "rocketmq", "url": url, "default_topic": "a.b"})),
        "default_topic"
    );
    assert_eq!(
        field(json!({"kind": "rocketmq", "url": url, "access_key": "ak"})),
        "secret_key_env"
    );
}

#[cfg(not(feature = "rocketmq"))]
#[test]
fn a_kind_not_compiled_in_parses_and_is_refused_naming_the_feature() {
    let c = parse(json!({"kind": "rocketmq", "url": "rocketmq://h:9876"})).unwrap();
    let e = c.validate().unwrap_err();
    assert_eq!(e.field, "kind");
    assert!(e.reason.contains("--features rocketmq"), "{}", e.reason);
}

#[test]
fn from_url_chooses_the_transport_by_scheme() {
    for (url, kind) in [
        ("http://h/hook", "webhook"),
        ("nats://h:4222", "nats"),
        ("redis://h:6379", "redis"),
        ("mqtts://h", "mqtt"),
        ("amqp://h/%2f", "rabbitmq"),
        ("kafka://h:9092", "kafka"),
        ("rocketmq://h:9876", "rocketmq"),
    ] {
        match TransportConfig::from_url(url) {
            Ok(c) => assert_eq!(c.kind(), kind, "{url}"),
            Err(e) => assert!(e.reason.contains("--features"), "{url}: {}", e.reason),
        }
    }
    let e = TransportConfig::from_url("gopher://u:secret@h").unwrap_err();
    assert_eq!(e.field, "url");
    assert!(
        e.reason.contains("\"gopher\"") && !e.reason.contains("secret"),
        "{}",
        e.reason
    );
}
