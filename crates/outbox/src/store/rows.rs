//! The rows the dialects read, turned into the library's types: one definition for all three
//! databases. Each dialect selects the columns in the order given here (integers as 64-bit,
//! message ids as text where the column is not a native UUID), so only its SQL differs.

use sqlx::{ColumnIndex, Decode, Row, Type};
use uuid::Uuid;

use super::{FailedMessage, KeyHead, RelayInfo};
use crate::message::Message;

/// `id, message_id, topic, attempts, last_error` of a FAILED row (`Store::failed`).
pub(crate) type FailedRow = (i64, String, String, i64, Option<String>);

/// [`FailedMessage`]s from [`FailedRow`]s; a negative attempt count (a row written by hand)
/// reads as 0.
pub(crate) fn failed_messages(rows: Vec<FailedRow>) -> Vec<FailedMessage> {
    rows.into_iter()
        .map(
            |(id, message_id, topic, attempts, last_error)| FailedMessage {
                id,
                message_id,
                topic,
                attempts: attempt_count(attempts),
                last_error,
            },
        )
        .collect()
}

/// `key, first_open, first_failed` of one partition key (`Store::key_heads`).
pub(crate) type KeyHeadRow = (String, Option<i64>, Option<i64>);

/// [`KeyHead`]s from [`KeyHeadRow`]s.
pub(crate) fn key_heads(rows: Vec<KeyHeadRow>) -> Vec<KeyHead> {
    rows.into_iter()
        .map(|(key, first_open, first_failed)| KeyHead {
            key,
            first_open,
            first_failed,
        })
        .collect()
}

/// `name, routes, routes_hash` of a live membership row (`Store::relays`).
pub(crate) type RelayRow = (String, Option<String>, Option<String>);

/// [`RelayInfo`]s from [`RelayRow`]s.
pub(crate) fn relays(rows: Vec<RelayRow>) -> Vec<RelayInfo> {
    rows.into_iter()
        .map(|(name, routes, hash)| super::relay_info(name, routes, hash))
        .collect()
}

/// An attempt count as stored (a signed integer) as a count: negative reads as 0, beyond
/// `u32::MAX` as `u32::MAX`.
fn attempt_count(n: i64) -> u32 {
    u32::try_from(n.max(0)).unwrap_or(u32::MAX)
}

/// Decode one row the relay read (`Store::read_buckets`): columns `id, message_id, topic,
/// partition_key, headers, payload, attempts, max_attempts, redelivery` in this order, the
/// integers 64-bit and the message id text. The error names the column and what a producer
/// writing by SQL got wrong; the relay dead-letters that row alone.
pub(crate) fn decode_message<'r, R>(id: i64, row: &'r R) -> Result<Message, String>
where
    R: Row,
    usize: ColumnIndex<R>,
    String: Decode<'r, R::Database> + Type<R::Database>,
    i64: Decode<'r, R::Database> + Type<R::Database>,
    Vec<u8>: Decode<'r, R::Database> + Type<R::Database>,
{
    let message_id: String = row.try_get(1).map_err(column("message_id"))?;
    let message_id = Uuid::parse_str(&message_id)
        .map_err(|e| format!("message_id {message_id:?} is not a UUID: {e}"))?;
    let headers: String = row.try_get(4).map_err(column("headers"))?;
    let max_attempts: Option<i64> = row.try_get(7).map_err(column("max_attempts"))?;
    Ok(Message {
        id,
        message_id,
        topic: row.try_get(2).map_err(column("topic"))?,
        partition_key: row.try_get(3).map_err(column("partition_key"))?,
        headers: super::parse_headers(id, &headers).map_err(|e| e.to_string())?,
        payload: row.try_get(5).map_err(column("payload"))?,
        attempts: attempt_count(row.try_get(6).map_err(column("attempts"))?),
        max_attempts: max_attempts
            .and_then(|m| u32::try_from(m).ok())
            .unwrap_or(0),
        redelivery: attempt_count(row.try_get(8).map_err(column("redelivery"))?),
    })
}

/// The due age of a row the relay read (column 10 of `Store::read_buckets`'s statements, in
/// microseconds): the database clock at the read minus the later of `created_at` and
/// `available_at`, so the time since the row could first be published (its creation, or the end
/// of its delay or retry backoff). Read leniently: a row whose timestamps hold garbage (written
/// by plain SQL) has no due age, and that alone never makes it malformed; a negative age (a
/// clock step) reads as zero.
pub(crate) fn due_age<R>(row: &R) -> Option<std::time::Duration>
where
    R: Row,
    usize: ColumnIndex<R>,
    for<'r> i64: Decode<'r, R::Database> + Type<R::Database>,
{
    let us: Option<i64> = row.try_get(10).ok().flatten();
    us.map(|us| std::time::Duration::from_micros(u64::try_from(us).unwrap_or(0)))
}

/// Name the column a decoding error is about.
fn column(name: &'static str) -> impl Fn(sqlx::Error) -> String {
    move |e| format!("column {name}: {e}")
}
