//! AMQP message properties: built from an outbox message, sized against the frame limit, and
//! headers read back from a delivery.

use super::*;

/// An estimate (from above) of the encoded size of `p` in a content header frame.
pub(super) fn properties_size(p: &BasicProperties) -> usize {
    let short = |s: &Option<ShortString>| s.as_ref().map_or(0, |s| 1 + s.as_str().len());
    let mut n = 2 + 8 + 2 + 14;
    n += short(p.content_type()) + short(p.content_encoding()) + short(p.message_id());
    n += short(p.kind()) + short(p.app_id()) + short(p.correlation_id());
    n += short(p.reply_to()) + short(p.expiration()) + short(p.user_id());
    if let Some(h) = p.headers() {
        n += 4 + table_size(h);
    }
    n
}

pub(super) fn table_size(t: &FieldTable) -> usize {
    t.inner()
        .iter()
        .map(|(k, v)| 1 + k.as_str().len() + 1 + value_size(v))
        .sum()
}

pub(super) fn value_size(v: &AMQPValue) -> usize {
    match v {
        AMQPValue::LongString(s) => 4 + s.len(),
        AMQPValue::ShortString(s) => 1 + s.as_str().len(),
        AMQPValue::FieldTable(t) => 4 + table_size(t),
        AMQPValue::FieldArray(a) => {
            4 + a
                .as_slice()
                .iter()
                .map(|v| 1 + value_size(v))
                .sum::<usize>()
        }
        AMQPValue::ByteArray(b) => 4 + b.len(),
        _ => 9,
    }
}

/// The `message_id` property: the message id, suffixed `-r<n>` on the n-th intentional
/// redelivery (check-back or requeue), as on NATS.
pub(super) fn dedup_id(m: &Message) -> String {
    if m.redelivery == 0 {
        m.message_id.to_string()
    } else {
        format!("{}-r{}", m.message_id, m.redelivery)
    }
}

/// `headers` as an AMQP table of long strings.
pub(crate) fn headers_table(headers: &Headers) -> Result<FieldTable, String> {
    let mut t = FieldTable::default();
    for (k, v) in headers {
        let name = ShortString::try_new(k.as_str())
            .map_err(|_| format!("header name {k:?} is longer than 255 bytes"))?;
        t.insert(name, AMQPValue::LongString(LongString::from(v.as_bytes())));
    }
    Ok(t)
}

/// The headers of a received AMQP message as strings: long and short strings as text (invalid
/// UTF-8 replaced), numbers, booleans and timestamps in decimal; arrays, tables (such as
/// RabbitMQ's `x-death`) and byte arrays are left out. What the consumer runner hands to
/// [`InboundMessage::from_wire`](crate::InboundMessage::from_wire).
pub fn received_headers(t: Option<&FieldTable>) -> Headers {
    let mut h = Headers::new();
    let Some(t) = t else { return h };
    for (k, v) in t.inner() {
        let s = match v {
            AMQPValue::LongString(s) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
            AMQPValue::ShortString(s) => s.as_str().to_owned(),
            AMQPValue::Boolean(b) => b.to_string(),
            AMQPValue::ShortShortInt(n) => n.to_string(),
            AMQPValue::ShortShortUInt(n) => n.to_string(),
            AMQPValue::ShortInt(n) => n.to_string(),
            AMQPValue::ShortUInt(n) => n.to_string(),
            AMQPValue::LongInt(n) => n.to_string(),
            AMQPValue::LongUInt(n) => n.to_string(),
            AMQPValue::LongLongInt(n) => n.to_string(),
            AMQPValue::Timestamp(n) => n.to_string(),
            AMQPValue::Float(n) => n.to_string(),
            AMQPValue::Double(n) => n.to_string(),
            _ => continue,
        };
        h.insert(k.as_str().to_owned(), s);
    }
    h
}

/// Seconds since the Unix epoch, for the `timestamp` property.
pub(crate) fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The AMQP properties of an outbox message (see the module docs).
pub(crate) fn message_properties(m: &Message) -> Result<BasicProperties, String> {
    let mut p = BasicProperties::default()
        .with_delivery_mode(2)
        .with_message_id(dedup_id(m).into())
        .with_timestamp(now_secs())
        .with_app_id("outbox".into())
        .with_headers(headers_table(&m.wire_headers())?);
    if let Ok(kind) = ShortString::try_new(m.topic.as_str()) {
        p = p.with_type(kind);
    }
    if let Some(ct) = m.headers.get("content-type") {
        let ct = ShortString::try_new(ct.as_str())
            .map_err(|_| "content-type header is longer than 255 bytes".to_owned())?;
        p = p.with_content_type(ct);
    }
    Ok(p)
}
