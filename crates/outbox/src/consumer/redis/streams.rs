//! Redis Streams commands and their replies (`XREADGROUP`, `XGROUP CREATE`, `XACK`, `XPENDING`,
//! `XCLAIM`/`XAUTOCLAIM` entries), shared by the consumer runner and the confirmation listener.
//! Replies are parsed from raw [`Value`]s so a nil (trimmed) entry is seen, not an error.

use std::time::Duration;

use crate::transport::redis::RedisConnection;
use redis::{RedisError, Value};

/// One stream entry as read: its id and fields, `None` when the entry was trimmed away (a nil
/// entry in a reply).
#[derive(Debug, Clone)]
pub(crate) struct RawEntry {
    pub(crate) id: String,
    pub(crate) fields: Option<Vec<(Vec<u8>, Vec<u8>)>>,
}

pub(crate) fn text(v: &Value) -> Option<String> {
    match v {
        Value::BulkString(b) => Some(String::from_utf8_lossy(b).into_owned()),
        Value::SimpleString(s) => Some(s.clone()),
        Value::Int(n) => Some(n.to_string()),
        _ => None,
    }
}

fn int(v: &Value) -> Option<i64> {
    match v {
        Value::Int(n) => Some(*n),
        other => text(other)?.parse().ok(),
    }
}

fn bytes(v: Value) -> Vec<u8> {
    match v {
        Value::BulkString(b) => b,
        Value::SimpleString(s) => s.into_bytes(),
        other => text(&other).unwrap_or_default().into_bytes(),
    }
}

/// Parse one entry `[id, [field, value, …] | nil]`.
fn parse_entry(v: Value) -> Option<RawEntry> {
    let Value::Array(mut parts) = v else {
        return None;
    };
    if parts.is_empty() {
        return None;
    }
    let fields = if parts.len() > 1 {
        parts.remove(1)
    } else {
        Value::Nil
    };
    let id = text(&parts[0])?;
    let fields = match fields {
        Value::Array(kv) => {
            let mut out = Vec::with_capacity(kv.len() / 2);
            let mut it = kv.into_iter();
            while let (Some(k), Some(v)) = (it.next(), it.next()) {
                out.push((bytes(k), bytes(v)));
            }
            Some(out)
        }
        Value::Map(kv) => Some(kv.into_iter().map(|(k, v)| (bytes(k), bytes(v))).collect()),
        _ => None,
    };
    Some(RawEntry { id, fields })
}

/// Parse a list of entries (`XRANGE`, `XCLAIM`, the middle of `XAUTOCLAIM`).
pub(crate) fn parse_entries(v: Value) -> Vec<RawEntry> {
    match v {
        Value::Array(items) => items.into_iter().filter_map(parse_entry).collect(),
        _ => Vec::new(),
    }
}

/// Parse an `XREADGROUP` reply for one stream (nil on timeout).
pub(crate) fn parse_read(v: Value) -> Vec<RawEntry> {
    let streams = match v {
        Value::Array(s) => s,
        Value::Map(m) => m
            .into_iter()
            .map(|(k, v)| Value::Array(vec![k, v]))
            .collect(),
        _ => return Vec::new(),
    };
    streams
        .into_iter()
        .flat_map(|s| match s {
            Value::Array(mut kv) if kv.len() == 2 => parse_entries(kv.remove(1)),
            _ => Vec::new(),
        })
        .collect()
}

/// `XREADGROUP GROUP group consumer COUNT count [BLOCK ms] STREAMS stream id`.
pub(crate) async fn read_group(
    conn: &mut RedisConnection,
    stream: &str,
    group: &str,
    consumer: &str,
    count: usize,
    block: Option<Duration>,
    id: &str,
) -> Result<Vec<RawEntry>, RedisError> {
    let mut cmd = redis::cmd("XREADGROUP");
    cmd.arg("GROUP")
        .arg(group)
        .arg(consumer)
        .arg("COUNT")
        .arg(count);
    if let Some(b) = block {
        cmd.arg("BLOCK").arg(b.as_millis().max(1) as u64);
    }
    cmd.arg("STREAMS").arg(stream).arg(id);
    let v: Value = cmd.query_async(conn).await?;
    Ok(parse_read(v))
}

/// `XGROUP CREATE stream group start MKSTREAM`; an existing group (`BUSYGROUP`) is fine.
pub(crate) async fn ensure_group(
    conn: &mut RedisConnection,
    stream: &str,
    group: &str,
    start: &str,
) -> Result<(), RedisError> {
    let r: Result<Value, RedisError> = redis::cmd("XGROUP")
        .arg("CREATE")
        .arg(stream)
        .arg(group)
        .arg(start)
        .arg("MKSTREAM")
        .query_async(conn)
        .await;
    match r {
        Ok(_) => Ok(()),
        Err(e) if e.code() == Some("BUSYGROUP") => Ok(()),
        Err(e) => Err(e),
    }
}

/// `XACK stream group ids…`.
pub(crate) async fn ack(
    conn: &mut RedisConnection,
    stream: &str,
    group: &str,
    ids: &[String],
) -> Result<(), RedisError> {
    if ids.is_empty() {
        return Ok(());
    }
    redis::cmd("XACK")
        .arg(stream)
        .arg(group)
        .arg(ids)
        .query_async::<Value>(conn)
        .await
        .map(|_| ())
}

/// One pending entry as `XPENDING … - + n [consumer]` reports it.
pub(crate) struct Pending {
    pub(crate) id: String,
    pub(crate) consumer: String,
    pub(crate) deliveries: u32,
}

pub(crate) fn parse_pending(v: Value) -> Vec<Pending> {
    let Value::Array(rows) = v else {
        return Vec::new();
    };
    rows.into_iter()
        .filter_map(|r| {
            let Value::Array(f) = r else { return None };
            if f.len() < 4 {
                return None;
            }
            Some(Pending {
                id: text(&f[0])?,
                consumer: text(&f[1])?,
                deliveries: u32::try_from(int(&f[3])?).unwrap_or(u32::MAX),
            })
        })
        .collect()
}

pub(crate) fn parse_ids(v: Value) -> Vec<String> {
    match v {
        Value::Array(ids) => ids.iter().filter_map(text).collect(),
        _ => Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::consumer::redis::fields_map;

    fn b(s: &str) -> Value {
        Value::BulkString(s.as_bytes().to_vec())
    }

    #[test]
    fn replies_parse_with_nil_entries() {
        let read = Value::Array(vec![Value::Array(vec![
            b("s"),
            Value::Array(vec![
                Value::Array(vec![b("1-0"), Value::Nil]),
                Value::Array(vec![b("2-0"), Value::Array(vec![b("id"), b("x")])]),
            ]),
        ])]);
        let e = parse_read(read);
        assert_eq!(e.len(), 2);
        assert!(e[0].fields.is_none());
        assert_eq!(
            fields_map(e[1].fields.as_ref().unwrap())["id"],
            b"x".to_vec()
        );
        assert!(parse_read(Value::Nil).is_empty());
        let p = parse_pending(Value::Array(vec![Value::Array(vec![
            b("1-0"),
            b("c"),
            Value::Int(5),
            Value::Int(3),
        ])]));
        assert_eq!((p[0].id.as_str(), p[0].deliveries), ("1-0", 3));
    }
}
