//! Issue 11, items 1 and 8: rows written by plain SQL (the public table contract) with header
//! names, header values or partition keys a broker's client cannot carry, or with headers the
//! broker reserves (`Nats-Msg-Id`, RabbitMQ's `CC`, HTTP's `Content-Length`, ...), mixed with
//! good rows, run through the real `Relay` on PostgreSQL against each real broker.
//!
//! Each test checks: every bad row is FAILED with a reason naming the header or key, every good
//! row is SENT and the broker holds it exactly once, no bad row reached the broker, and the relay
//! goes on (a message enqueued afterwards is published). Before the fix a NATS header name with a
//! space made async-nats panic inside the batch task and every relay stopped publishing; a
//! `Nats-Msg-Id` header replaced the duplicate-detection id, so JetStream dropped distinct
//! messages while their rows were marked SENT.

use outbox_testkit_macros::suite_test;
use std::collections::HashMap;
use std::time::Duration;

use outbox::{EnqueueError, NewMessage, Relay, Router, Status};
use outbox_testkit::{
    NatsFixture, PgFixture, Received, SqliteFixture, StoreFixture as _, TransportFixture,
    WebhookFixture, header_message_id, wait_until,
};
use serde_json::{Value, json};
use sqlx::AssertSqlSafe;
use uuid::Uuid;

use crate::relay::fast_config;

/// A row written by plain SQL.
struct Row {
    /// Topic (also the destination when the route's destination is `{topic}`).
    topic: String,
    /// Partition key.
    key: Option<String>,
    /// The `headers` JSON object.
    headers: Value,
}

impl Row {
    fn new(topic: &str, key: Option<&str>, headers: Value) -> Row {
        Row {
            topic: topic.to_owned(),
            key: key.map(str::to_owned),
            headers,
        }
    }
}

/// A bad row and the text its `last_error` must contain (the header or key it names).
struct Bad {
    row: Row,
    named: &'static str,
}

fn bad(row: Row, named: &'static str) -> Bad {
    Bad { row, named }
}

/// Rows with one header `name: value` each, bad with a reason that names `named`.
fn bad_headers(headers: &[(&str, &str, &'static str)]) -> Vec<Bad> {
    headers
        .iter()
        .map(|&(name, value, named)| bad(Row::new(TOPIC, None, json!({ name: value })), named))
        .collect()
}

async fn insert(db: &PgFixture, row: &Row, payload: &[u8]) -> Uuid {
    sqlx::query_scalar(AssertSqlSafe(format!(
        "INSERT INTO {} (topic, partition_key, headers, payload) VALUES ($1, $2, $3::jsonb, $4) \
         RETURNING message_id",
        db.table()
    )))
    .bind(&row.topic)
    .bind(&row.key)
    .bind(row.headers.to_string())
    .bind(payload)
    .fetch_one(db.store.pool())
    .await
    .expect("plain SQL insert")
}

/// What the broker received, counted by `outbox-message-id`.
fn counts(received: &[Received]) -> HashMap<Uuid, usize> {
    let mut m = HashMap::new();
    for r in received {
        if let Some(id) = header_message_id(r) {
            *m.entry(id).or_insert(0) += 1;
        }
    }
    m
}

/// [`bad_rows_dead_lettered_rest_published`] routing every topic to `fx`'s good destination.
async fn bad_rows_at_good_destination<F: TransportFixture>(
    fx: &F,
    good: Vec<Row>,
    bad: Vec<Bad>,
) -> Vec<Received> {
    bad_rows_dead_lettered_rest_published(fx, &fx.good_destination(), good, bad).await
}

/// Insert `good` and `bad` rows interleaved (so they share batches), run a relay routing every
/// topic to `fx` at `destination` (`{topic}` allowed), and check the outcome (see the module
/// docs). Returns what the broker received, for broker-specific checks; `fx` is the test's
/// fixture, cleaned up by `#[suite_test]`.
async fn bad_rows_dead_lettered_rest_published<F: TransportFixture>(
    fx: &F,
    destination: &str,
    good: Vec<Row>,
    bad: Vec<Bad>,
) -> Vec<Received> {
    crate::init_tracing();
    let db = PgFixture::new().await;
    let mut good_ids = Vec::new();
    let mut bad_ids = Vec::new();
    let (mut g, mut b) = (good.iter(), bad.iter());
    loop {
        let (next_g, next_b) = (g.next(), b.next());
        if next_g.is_none() && next_b.is_none() {
            break;
        }
        if let Some(row) = next_g {
            good_ids.push(insert(&db, row, format!("good {}", good_ids.len()).as_bytes()).await);
        }
        if let Some(x) = next_b {
            bad_ids.push((insert(&db, &x.row, b"bad").await, x.named));
        }
    }
    let relay = Relay::builder(db.store())
        .router(Router::new().route("*", fx.transport(), destination))
        .config(fast_config("wire"))
        .build()
        .expect("relay");
    let handle = relay.spawn();
    wait_until(
        "every bad row FAILED and every good row SENT (a relay that stopped publishing leaves them PENDING)",
        Duration::from_secs(30),
        || async {
            let rows = db.rows().await;
            let status = |id: &Uuid| rows.iter().find(|r| r.message_id == *id).map(|r| r.status);
            good_ids
                .iter()
                .all(|id| status(id) == Some(Status::Sent.as_i16()))
                && bad_ids
                    .iter()
                    .all(|(id, _)| status(id) == Some(Status::Failed.as_i16()))
        },
    )
    .await;
    for (id, named) in &bad_ids {
        let row = db.row(*id).await;
        let reason = row.last_error.unwrap_or_default();
        assert!(
            reason.contains(named),
            "row {id}: last_error should name {named:?}: {reason:?}"
        );
        assert_eq!(
            row.attempts, 1,
            "dead-lettered at the first attempt: {reason}"
        );
    }
    // The relay goes on: a message enqueued now is published.
    let after = db
        .commit_one(NewMessage::new(good[0].topic.clone(), "after").with_header("tag", "after"))
        .await;
    wait_until(
        "the message enqueued afterwards SENT",
        Duration::from_secs(15),
        || async { db.row(after).await.status == Status::Sent.as_i16() },
    )
    .await;
    good_ids.push(after);
    wait_until(
        "the broker holds every good message",
        Duration::from_secs(10),
        || async {
            let c = counts(&fx.received().await);
            good_ids.iter().all(|id| c.contains_key(id))
        },
    )
    .await;
    let received = fx.received().await;
    let c = counts(&received);
    for id in &good_ids {
        assert_eq!(c.get(id), Some(&1), "good message {id} received once");
    }
    for (id, _) in &bad_ids {
        assert!(!c.contains_key(id), "bad message {id} reached the broker");
    }
    handle.shutdown().await.expect("shutdown");
    db.cleanup().await;
    received
}

const TOPIC: &str = "orders.created";

/// Good rows on `topic`: ordinary headers, keys, non-ASCII values.
fn ordinary_rows_on(topic: &str) -> Vec<Row> {
    vec![
        Row::new(topic, None, json!({})),
        Row::new(
            topic,
            Some("order-1"),
            json!({"tag": "a", "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}),
        ),
        Row::new(
            topic,
            Some("order 2 é"),
            json!({"note": "café ✅", "x-request-id": "r-1"}),
        ),
        Row::new(topic, None, json!({"content-type": "application/json"})),
        Row::new(topic, Some("order-3"), json!({"tag": "b"})),
    ]
}

fn ordinary_rows() -> Vec<Row> {
    ordinary_rows_on(TOPIC)
}

/// Rows whose header names, values or keys the HTTP and NATS clients cannot carry, but AMQP,
/// Kafka and Redis can.
fn crlf_and_space_rows_on(topic: &str) -> Vec<Row> {
    vec![
        Row::new(topic, None, json!({"a b": "v"})),
        Row::new(topic, None, json!({"note": "x\r\ny"})),
        Row::new(topic, Some("k\r\n1"), json!({})),
        Row::new(topic, None, json!({"a:b": "v"})),
    ]
}

/// [`crlf_and_space_rows_on`] as bad rows, with what their reasons name.
fn crlf_and_space_rows() -> Vec<Bad> {
    let named = [
        "header \"a b\"",
        "header \"note\"",
        "partition key \"k\\r\\n1\"",
        "header \"a:b\"",
    ];
    crlf_and_space_rows_on(TOPIC)
        .into_iter()
        .zip(named)
        .map(|(row, named)| bad(row, named))
        .collect()
}

/// Rows with headers other brokers reserve (free on the broker under test when it reserves none).
fn other_brokers_reserved_on(topic: &str) -> Vec<Row> {
    vec![
        Row::new(
            topic,
            None,
            json!({"Nats-Msg-Id": "same", "BCC": "q", "DELAY": "3"}),
        ),
        Row::new(
            topic,
            None,
            json!({"Nats-Msg-Id": "same", "Content-Length": "0"}),
        ),
    ]
}

/// Every received message carries the headers of its row as written (the broker can carry them).
fn assert_headers_intact(received: &[Received], rows: &[Row]) {
    for row in rows {
        let Value::Object(h) = &row.headers else {
            continue;
        };
        if h.is_empty() {
            continue;
        }
        assert!(
            received.iter().any(|r| h
                .iter()
                .all(|(k, v)| r.headers.get(k).map(String::as_str) == v.as_str())),
            "no received message carries {h:?} intact"
        );
    }
}

#[suite_test]
async fn defect_01_nats_unsendable_header_or_key_is_dead_lettered_and_the_relay_goes_on(
    fx: NatsFixture,
) {
    bad_rows_at_good_destination(&fx, ordinary_rows(), crlf_and_space_rows()).await;
}

#[suite_test]
async fn defect_08_nats_reserved_headers_from_sql_are_dead_lettered_not_deduplicated(
    fx: NatsFixture,
) {
    // Two distinct messages with the same user Nats-Msg-Id: before the fix JetStream kept one and
    // both rows were SENT.
    let bad = bad_headers(&[
        (
            "Nats-Msg-Id",
            "same",
            "\"Nats-Msg-Id\" is reserved by NATS JetStream",
        ),
        (
            "Nats-Msg-Id",
            "same",
            "\"Nats-Msg-Id\" is reserved by NATS JetStream",
        ),
        (
            "nats-expected-last-sequence",
            "0",
            "nats-expected-last-sequence",
        ),
        ("Nats-TTL", "1s", "Nats-TTL"),
    ]);
    bad_rows_at_good_destination(&fx, ordinary_rows(), bad).await;
}

#[suite_test]
async fn defect_01_webhook_unsendable_header_or_key_is_dead_lettered(fx: WebhookFixture) {
    bad_rows_at_good_destination(&fx, ordinary_rows(), crlf_and_space_rows()).await;
}

#[suite_test]
async fn defect_08_webhook_connection_and_signature_headers_from_sql_are_dead_lettered(
    fx: WebhookFixture,
) {
    let bad = bad_headers(&[
        ("Content-Length", "0", "\"Content-Length\" is reserved"),
        ("Host", "evil.example", "\"Host\" is reserved"),
        ("Transfer-Encoding", "chunked", "Transfer-Encoding"),
        ("webhook-signature", "v1,forged", "webhook-signature"),
        ("Connection", "close", "\"Connection\""),
    ]);
    let received = bad_rows_at_good_destination(&fx, ordinary_rows(), bad).await;
    // The signature of every delivery is the transport's own.
    for r in &received {
        let sig = r
            .headers
            .get("webhook-signature")
            .cloned()
            .unwrap_or_default();
        assert!(sig.starts_with("v1,") && sig != "v1,forged", "{sig}");
    }
}

/// Enqueue refuses a broker-reserved header with an error naming it and the broker, before
/// anything is written.
#[suite_test]
async fn defect_08_enqueue_refuses_broker_reserved_headers(fx: SqliteFixture) {
    for (name, broker) in [
        ("Nats-Msg-Id", "NATS JetStream"),
        ("BCC", "RabbitMQ"),
        ("x-delay", "RabbitMQ"),
        ("DELAY", "RocketMQ"),
        ("Content-Length", "HTTP"),
    ] {
        let e = fx
            .enqueue_commit(vec![
                NewMessage::new("t", "ok"),
                NewMessage::new("t", "x").with_header(name, "v"),
            ])
            .await
            .unwrap_err();
        assert!(
            matches!(&e, EnqueueError::ReservedHeader { name: n, .. } if n == name),
            "{name}: {e:?}"
        );
        let text = e.to_string();
        assert!(text.contains(name) && text.contains(broker), "{text}");
    }
    assert!(fx.rows().await.is_empty(), "nothing was written");
}

#[suite_test]
async fn defect_01_rabbitmq_unsendable_header_is_dead_lettered_and_what_amqp_carries_travels(
    fx: outbox_testkit::RabbitMqFixture,
) {
    let long = "n".repeat(256);
    let bad = vec![
        bad(
            Row::new(TOPIC, None, json!({ long.clone(): "v" })),
            "at most 255 bytes",
        ),
        bad(
            Row::new(
                TOPIC,
                None,
                json!({"content-type": format!("text/{}", "x".repeat(260))}),
            ),
            "header \"content-type\"",
        ),
    ];
    // AMQP table keys and long strings carry spaces, CR/LF and other brokers' reserved names.
    // (BCC, reserved by RabbitMQ itself, is in the defect_08 test.)
    let others = vec![Row::new(
        TOPIC,
        None,
        json!({"Nats-Msg-Id": "same", "DELAY": "3", "Content-Length": "0"}),
    )];
    let mut good = ordinary_rows();
    good.extend(crlf_and_space_rows_on(TOPIC));
    good.extend(
        others
            .iter()
            .map(|r| Row::new(&r.topic, None, r.headers.clone())),
    );
    let received = bad_rows_at_good_destination(&fx, good, bad).await;
    assert_headers_intact(&received, &crlf_and_space_rows_on(TOPIC));
    assert_headers_intact(&received, &others);
}

#[suite_test]
async fn defect_08_rabbitmq_headers_rabbitmq_interprets_are_dead_lettered(
    fx: outbox_testkit::RabbitMqFixture,
) {
    let bad = bad_headers(&[
        ("CC", "elsewhere", "\"CC\" is reserved by RabbitMQ"),
        ("BCC", "elsewhere", "\"BCC\" is reserved by RabbitMQ"),
        ("x-death", "forged", "\"x-death\" is reserved by RabbitMQ"),
        ("x-delay", "60000", "\"x-delay\" is reserved by RabbitMQ"),
    ]);
    let mut good = ordinary_rows();
    good.push(Row::new(
        TOPIC,
        None,
        json!({"cc": "lower case is not interpreted"}),
    ));
    bad_rows_at_good_destination(&fx, good, bad).await;
}

#[suite_test]
async fn defect_01_kafka_every_header_and_key_travels_bad_topic_is_dead_lettered(
    fx: outbox_testkit::KafkaFixture,
) {
    every_header_travels_bad_topic_dead_lettered(&fx, "is 1 to 249 of A-Z a-z 0-9 . _ -").await;
}

#[suite_test]
async fn defect_01_redis_every_header_and_key_travels_bad_stream_key_is_dead_lettered(
    fx: outbox_testkit::RedisFixture,
) {
    every_header_travels_bad_topic_dead_lettered(&fx, "invalid Redis stream key").await;
}

/// On a broker whose destination is the topic (Kafka, Redis) and which carries any header: the
/// ordinary rows, the CR/LF and space rows and other brokers' reserved names all travel intact;
/// a row whose topic is no valid destination is dead-lettered with a reason naming `invalid`.
async fn every_header_travels_bad_topic_dead_lettered<F: TransportFixture>(
    fx: &F,
    invalid: &'static str,
) {
    let topic = fx.good_destination();
    let mut good = ordinary_rows_on(&topic);
    good.extend(crlf_and_space_rows_on(&topic));
    good.extend(other_brokers_reserved_on(&topic));
    let bad = vec![bad(
        Row::new(&format!("{topic} bad"), None, json!({})),
        invalid,
    )];
    let received = bad_rows_dead_lettered_rest_published(fx, "{topic}", good, bad).await;
    assert_headers_intact(&received, &crlf_and_space_rows_on(&topic));
    assert_headers_intact(&received, &other_brokers_reserved_on(&topic));
}

#[suite_test]
async fn defect_01_mqtt_malformed_strings_are_dead_lettered_and_the_relay_goes_on(
    fx: outbox_testkit::MqttFixture,
) {
    let long = "v".repeat(70_000);
    // Mosquitto closes the connection on a user property with a control character; rumqttc
    // writes a string over 65,535 bytes with a truncated length (a malformed packet).
    let bad = vec![
        bad(
            Row::new(TOPIC, None, json!({"note": "x\ty"})),
            "header \"note\"",
        ),
        bad(
            Row::new(TOPIC, Some("k\r\n1"), json!({})),
            "partition key \"k\\r\\n1\"",
        ),
        bad(
            Row::new(TOPIC, None, json!({"big": long})),
            "at most 65,535 bytes",
        ),
        bad(
            Row::new(TOPIC, None, json!({"odd": "x\u{FFFF}"})),
            "noncharacter",
        ),
    ];
    // User property names may have spaces and colons; MQTT reserves no name.
    let mut good = ordinary_rows();
    good.push(Row::new(TOPIC, None, json!({"a b": "v", "a:b": "w"})));
    good.extend(other_brokers_reserved_on(TOPIC));
    let received = bad_rows_at_good_destination(&fx, good, bad).await;
    assert_headers_intact(&received, &other_brokers_reserved_on(TOPIC));
}

#[cfg(feature = "rocketmq")]
#[suite_test]
async fn defect_01_and_08_rocketmq_separators_and_system_properties_are_dead_lettered(
    fx: outbox_testkit::rocketmq::RocketMqFixture,
) {
    let mut bad = bad_headers(&[
        ("note", "x\u{1}y", "header \"note\""),
        ("DELAY", "3", "\"DELAY\" is reserved by RocketMQ"),
        ("UNIQ_KEY", "forged", "\"UNIQ_KEY\" is reserved by RocketMQ"),
    ]);
    bad.insert(
        1,
        Bad {
            row: Row::new(TOPIC, Some("k\u{2}1"), json!({})),
            named: "partition key",
        },
    );
    let mut good = ordinary_rows();
    good.push(Row::new(
        TOPIC,
        None,
        json!({"delay": "lower case is free", "a b": "x\r\ny"}),
    ));
    bad_rows_at_good_destination(&fx, good, bad).await;
}
