//! Entry points of the fuzz targets in `fuzz/` (issue 13, item 2): each drives the code that
//! parses input from outside the process, exactly as production calls it, and panics when a
//! property breaks. Not API: compiled only with `--cfg fuzzing` (cargo-fuzz sets it) and in this
//! crate's tests, which replay the committed corpus (`fuzz/corpus/<target>/`).

use std::collections::BTreeMap;
use std::sync::OnceLock;

use crate::message::{InboundMessage, Message};
use crate::transport::Outgoing;

/// A row as a producer writing plain SQL can leave it (the public table contract) through what
/// the relay does with it: the headers parsed as the store parses them (a row whose headers are
/// not a JSON object of strings is dead-lettered as malformed, nothing else happens to it); then,
/// for each broker compiled in, its check and, for a message the check accepts, its encoding
/// into the client's wire form.
///
/// # Panics
/// When an encoder panics (async-nats asserts on header names) or refuses a message its
/// broker's check accepted (the check is what keeps such a message from reaching the client).
pub fn row_to_wire(
    topic: &str,
    partition_key: Option<&str>,
    headers_json: &str,
    payload: &[u8],
    destination: &str,
) {
    let Ok(headers) = crate::store::parse_headers(1, headers_json) else {
        return;
    };
    let message = Message {
        id: 1,
        message_id: uuid::Uuid::from_u128(0x0123_4567_89ab_cdef_0123_4567_89ab_cdef),
        topic: topic.to_owned(),
        partition_key: partition_key.map(str::to_owned),
        headers,
        payload: payload.to_vec(),
        attempts: 0,
        max_attempts: 5,
        redelivery: 0,
    };
    let out = Outgoing {
        message: &message,
        destination,
    };
    // Used by every broker block below; a build with none of them has nothing to drive.
    let _ = &out;
    #[cfg(feature = "nats")]
    if crate::transport::nats::check_message(&out).is_ok() {
        drop(crate::transport::nats::publish_message(&message));
    }
    #[cfg(feature = "webhook")]
    {
        use crate::transport::Transport as _;
        let t = webhook();
        if t.check(&out).is_ok()
            && let Err(e) = t.request_headers(&message, 1_700_000_000)
        {
            panic!("webhook: checked, then refused: {e}");
        }
    }
    #[cfg(feature = "kafka")]
    if crate::transport::kafka::check_message(&out).is_ok() {
        drop(crate::transport::kafka::record_headers(&message));
    }
    #[cfg(feature = "rabbitmq")]
    if crate::transport::rabbitmq::check_message(&out).is_ok()
        && let Err(e) = crate::transport::rabbitmq::message_properties(&message)
    {
        panic!("rabbitmq: checked, then refused: {e}");
    }
    #[cfg(feature = "mqtt")]
    if crate::transport::mqtt::check_message(&out).is_ok() {
        use rumqttc::v5::mqttbytes::QoS;
        use rumqttc::v5::mqttbytes::v5::Packet;
        use rumqttc::v5::mqttbytes::v5::Publish;
        let props = crate::transport::mqtt::publish_properties(&message);
        let mut publish =
            Publish::new(destination, QoS::AtLeastOnce, payload.to_vec(), Some(props));
        publish.pkid = 1;
        let mut buf = bytes::BytesMut::new();
        if let Err(e) = publish.write(&mut buf) {
            panic!("mqtt: checked, then the packet could not be written: {e:?}");
        }
        // What the broker parses: the same packet, or the check let a malformed frame through.
        match Packet::read(&mut buf, None) {
            Ok(Packet::Publish(p)) => {
                let (headers, body) = crate::transport::mqtt::decode(&p);
                assert_eq!(body, payload, "mqtt: the payload read back differs");
                assert_eq!(
                    headers,
                    message.wire_headers(),
                    "mqtt: the headers read back differ"
                );
            }
            other => panic!("mqtt: checked, then the packet did not read back: {other:?}"),
        }
    }
    #[cfg(feature = "redis")]
    if crate::transport::redis::validate_key(destination).is_ok() {
        drop(crate::transport::redis::entry_fields(&message));
    }
    #[cfg(feature = "rocketmq")]
    {
        use crate::transport::rocketmq::{Destination, RocketMqConfig, build_message};
        let max = RocketMqConfig::new("127.0.0.1:9876").max_message_size;
        if crate::transport::rocketmq::check_message(&out, max).is_ok() {
            let dest = Destination::parse(destination).expect("the check parsed it");
            if let Err(e) = build_message(&message, &dest, max) {
                panic!("rocketmq: checked, then refused: {e}");
            }
        }
    }
}

#[cfg(feature = "webhook")]
fn webhook() -> &'static crate::transport::webhook::WebhookTransport {
    static T: OnceLock<crate::transport::webhook::WebhookTransport> = OnceLock::new();
    T.get_or_init(|| {
        let mut c = crate::transport::webhook::WebhookConfig::new("http://127.0.0.1:9/hooks/");
        c.secret = Some(SECRET.to_owned());
        c.build().expect("webhook transport")
    })
}

/// Split fuzz input into `n` fields at `0xFF` bytes (never valid UTF-8, so a separator cannot
/// come from text); missing fields are empty, text fields are read lossily.
fn fields(data: &[u8], n: usize) -> Vec<&[u8]> {
    let mut f: Vec<&[u8]> = data.splitn(n, |&b| b == 0xFF).collect();
    f.resize(n, &[]);
    f
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// [`row_to_wire`] on fuzz input `topic 0xFF key 0xFF headers-json 0xFF payload 0xFF
/// destination` (an empty key is none).
pub fn row_to_wire_bytes(data: &[u8]) {
    let f = fields(data, 5);
    let key = text(f[1]);
    row_to_wire(
        &text(f[0]),
        (!key.is_empty()).then_some(key.as_str()),
        &text(f[2]),
        f[3],
        &text(f[4]),
    );
}

/// [`inbound`] on fuzz input `body 0xFF name 0xFF value 0xFF name 0xFF value …`, at a fixed
/// `now`.
pub fn inbound_bytes(data: &[u8]) {
    let mut parts = data.split(|&b| b == 0xFF);
    let body = parts.next().unwrap_or_default();
    let rest: Vec<&[u8]> = parts.collect();
    let headers: Vec<(String, String)> = rest
        .chunks(2)
        .map(|kv| (text(kv[0]), text(kv.get(1).copied().unwrap_or_default())))
        .collect();
    inbound(&headers, body, 1_700_000_000);
}

/// The signing secret of the webhook targets.
pub const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";

/// A delivery as a consumer receives it: `headers` (name, value pairs as the broker carries
/// them) and `body`, through each consumer's decoding into an [`InboundMessage`]: the webhook
/// receiver (signature checked with [`SECRET`] against `now`), Redis Streams entry fields,
/// RabbitMQ header tables, JetStream header maps, Kafka record headers (some without a value),
/// RocketMQ user properties (any `reconsumeTimes`), and MQTT (the PUBLISH packet written, read back as the consumer's
/// client reads it, then decoded). Returns nothing; decoding errors are answers, not failures.
///
/// # Panics
/// When a decoder panics, or an MQTT packet written from these headers does not read back.
pub fn inbound(headers: &[(String, String)], body: &[u8], now: i64) {
    let _ = (headers, body, now);
    #[cfg(feature = "webhook")]
    {
        let signer = crate::transport::webhook::WebhookSigner::new(SECRET).expect("secret");
        let mut map = axum::http::HeaderMap::new();
        for (k, v) in headers {
            if let (Ok(k), Ok(v)) = (
                axum::http::HeaderName::try_from(k.as_str()),
                axum::http::HeaderValue::try_from(v.as_str()),
            ) {
                map.append(k, v);
            }
        }
        let body = bytes::Bytes::copy_from_slice(body);
        let _ = crate::consumer::webhook::inbound(Some(&signer), &map, &body, now);
        let _ = crate::consumer::webhook::inbound(None, &map, &body, now);
    }
    let pairs: BTreeMap<String, String> = headers.iter().cloned().collect();
    let _ = InboundMessage::from_wire(pairs, body.to_vec(), 1);
    #[cfg(feature = "redis")]
    {
        let mut fields: Vec<(Vec<u8>, Vec<u8>)> = headers
            .iter()
            .map(|(k, v)| (k.clone().into_bytes(), v.clone().into_bytes()))
            .collect();
        fields.push((b"payload".to_vec(), body.to_vec()));
        let (h, p) = crate::transport::redis::decode_fields(fields);
        let _ = InboundMessage::from_wire(h, p, 1);
    }
    #[cfg(feature = "rabbitmq")]
    {
        use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
        let mut t = FieldTable::default();
        for (k, v) in headers {
            if let Ok(k) = ShortString::try_new(k.as_str()) {
                t.insert(k, AMQPValue::LongString(LongString::from(v.as_bytes())));
            }
        }
        let h = crate::transport::rabbitmq::received_headers(Some(&t));
        let _ = InboundMessage::from_wire(h, body.to_vec(), 1);
    }
    #[cfg(feature = "nats")]
    {
        use std::str::FromStr as _;
        let mut map = async_nats::HeaderMap::new();
        for (k, v) in headers {
            if let (Ok(k), Ok(v)) = (
                async_nats::header::HeaderName::from_str(k),
                async_nats::header::HeaderValue::from_str(v),
            ) {
                map.append(k, v);
            }
        }
        let h = crate::consumer::nats::received_headers(Some(&map));
        let _ = InboundMessage::from_wire(h, body.to_vec(), 1);
    }
    #[cfg(feature = "kafka")]
    {
        use rdkafka::message::{Header, OwnedHeaders, OwnedMessage, Timestamp};
        let mut h = OwnedHeaders::new();
        for (i, (k, v)) in headers.iter().enumerate() {
            // A record header may come without a value.
            let value = (i % 5 != 4).then_some(v.as_bytes());
            h = h.insert(Header { key: k, value });
        }
        let m = OwnedMessage::new(
            Some(body.to_vec()),
            None,
            "t".into(),
            Timestamp::NotAvailable,
            0,
            0,
            Some(h),
        );
        let h = crate::consumer::kafka::record_headers(&m);
        let _ = InboundMessage::from_wire(h, body.to_vec(), 1);
    }
    #[cfg(feature = "rocketmq")]
    {
        use rocketmq_model::common::message::MessageTrait as _;
        use rocketmq_model::common::message::message_ext::MessageExt;
        let mut ext = MessageExt::default();
        let mut msg = rocketmq_model::common::message::message_single::Message::default();
        for (k, v) in headers {
            msg.put_property(k.as_str().into(), v.as_str().into());
        }
        msg.set_body(Some(bytes::Bytes::copy_from_slice(body)));
        ext.set_message_inner(msg);
        ext.set_reconsume_times(i32::from(body.first().copied().unwrap_or(0)) - 1);
        let _ = crate::consumer::rocketmq::inbound(&ext);
    }
    #[cfg(feature = "mqtt")]
    {
        use rumqttc::v5::mqttbytes::QoS;
        use rumqttc::v5::mqttbytes::v5::{Packet, Publish, PublishProperties};
        // A broker delivers MQTT strings of at most 65,535 bytes.
        let props = PublishProperties {
            user_properties: headers
                .iter()
                .filter(|(k, v)| k.len() <= 65_535 && v.len() <= 65_535)
                .cloned()
                .collect(),
            ..Default::default()
        };
        let mut publish = Publish::new("t/1", QoS::AtLeastOnce, body.to_vec(), Some(props));
        publish.pkid = 1;
        let mut buf = bytes::BytesMut::new();
        if publish.write(&mut buf).is_ok() {
            match Packet::read(&mut buf, None) {
                Ok(Packet::Publish(p)) => {
                    let (h, payload) = crate::transport::mqtt::decode(&p);
                    assert_eq!(payload, body, "mqtt: the payload read back differs");
                    let _ = InboundMessage::from_wire(h, payload, 1);
                }
                other => panic!("mqtt: a packet written did not read back: {other:?}"),
            }
        }
    }
}

/// A confirmation body as the producer's listeners receive it (NATS, HTTP).
///
/// # Panics
/// When parsing panics.
pub fn confirmations(body: &[u8]) {
    let _ = crate::verdict::parse_confirmations(body);
}

#[cfg(test)]
mod tests {
    /// The committed corpus of each target runs in the ordinary test suite: what the fuzzer
    /// found once stays tested without the fuzzer.
    fn replay(target: &str, run: fn(&[u8])) {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../fuzz/corpus")
            .join(target);
        let entries = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("the corpus {} cannot be read: {e}", dir.display()));
        let mut n = 0;
        for entry in entries {
            let path = entry.expect("corpus entry").path();
            let data = std::fs::read(&path).expect("corpus file");
            run(&data);
            n += 1;
        }
        assert!(n > 0, "the corpus {} is empty", dir.display());
    }

    #[test]
    fn row_to_wire_corpus() {
        replay("row_to_wire", super::row_to_wire_bytes);
    }

    #[test]
    fn inbound_corpus() {
        replay("inbound", super::inbound_bytes);
    }

    #[test]
    fn confirmations_corpus() {
        replay("confirmations", super::confirmations);
    }
}
