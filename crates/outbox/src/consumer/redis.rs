//! Redis Streams consumer-group runner feeding an [`Inbox`].
//!
//! Commands (<https://redis.io/docs/latest/develop/data-types/streams/>):
//! - at start, `XGROUP CREATE <stream> <group> <start_id> MKSTREAM` (an existing group is kept);
//!   then this consumer's own pending entries, left by an earlier run under the same consumer
//!   name (`XPENDING <stream> <group> - + n <consumer>`), are delivered again first;
//! - `XREADGROUP GROUP <group> <consumer> COUNT <batch> BLOCK <block> STREAMS <stream> >` for new
//!   entries (delivery count 1);
//! - each fetched batch goes through [`deliver_batch`] in `concurrency` lanes by partition key;
//!   `XACK` follows only after the inbox transaction committed (applied, rejected, duplicate or
//!   dead-lettered); nothing is acknowledged that was not stored (shared case C27);
//! - **retry with backoff**: Redis has no negative acknowledgement or delayed redelivery, so a
//!   message whose handler failed transiently is left pending (not acknowledged) and the runner
//!   keeps its id with a due time from [`Backoff`] by delivery count; when it is due, the runner
//!   claims it back with `XCLAIM <stream> <group> <consumer> <delay> <id>` (which increments the
//!   entry's delivery count; the guard `min-idle-time = delay` leaves it alone if another
//!   consumer has claimed it meanwhile) and delivers it again with the delivery count read from
//!   `XPENDING`, so [`DeliveryPolicy::max_deliveries`] dead-letters a message that keeps failing;
//! - **stuck deliveries** (a crashed consumer's pending entries, also this runner's own retries
//!   whose delay is longer than `claim_idle`): every `claim_interval`, `XAUTOCLAIM <stream>
//!   <group> <consumer> <claim_idle> <cursor> COUNT <batch>` takes over entries idle for at least
//!   `claim_idle`, with their delivery count from `XPENDING`;
//! - **trimmed entries** (shared case C38): an id whose entry was trimmed away (`XAUTOCLAIM`'s
//!   deleted ids, a nil entry, an id `XCLAIM` could not return because the entry is gone) is
//!   logged, acknowledged as lost and counted in [`ConsumerMetrics::lost`]; the runner never
//!   stops because of it.
//!
//! `claim_idle` must exceed the time a batch can take to apply (an entry waits pending while its
//! batch is applied), or a live consumer's entries are claimed by another one and applied twice
//! at the broker level (the inbox absorbs the copy). Per-key order holds within a fetched batch
//! and for first deliveries; a retried message can be overtaken by later messages of its key that
//! were fetched before its retry (as with any redelivery after a delay).
//!
//! The runner also performs the consumer's [`maintenance`] (operator replays, inbox retention).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use redis::aio::ConnectionManager;
use redis::{RedisError, Value};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::consumer::{ConsumerMetrics, DeliveryPolicy, Disposition, deliver_batch, maintenance};
use crate::error::ConfigError;
use crate::inbox::{Handler, Inbox, InboxBackend};
use crate::message::InboundMessage;
use crate::retry::Backoff;
use crate::transport::redis::{connect_manager, decode_fields};
use crate::verdict::ConfirmationSender;

/// Settings of a Redis Streams consumer runner.
#[derive(Clone)]
pub struct RedisConsumerConfig {
    /// Server URL, `redis://…` or `rediss://…`. Required.
    pub url: String,
    /// Password, overriding one in the URL. Default none.
    pub password: Option<String>,
    /// Stream key to consume. Required.
    pub stream: String,
    /// Consumer group; instances in the same group share the work. Required.
    pub group: String,
    /// This instance's consumer name within the group. Give each instance a stable name so a
    /// restart resumes its own pending entries at once; a new name leaves them to `XAUTOCLAIM`
    /// after `claim_idle`. Default `outbox-<16 hex digits>` (random per runner).
    pub consumer: String,
    /// Where a newly created group starts: `0` (every entry already in the stream) or `$`
    /// (only new entries). Default `0`, so messages published before the first start are not
    /// missed.
    pub start_id: String,
    /// Entries fetched per read (`COUNT`). Default 100.
    pub batch: usize,
    /// How long a read waits for new entries (`BLOCK`). Default 1 s.
    pub block: Duration,
    /// Messages of one batch applied concurrently, in lanes by partition key
    /// ([`deliver_batch`]). Default 1.
    pub concurrency: usize,
    /// Idle time after which a pending entry of any consumer is taken over by `XAUTOCLAIM`.
    /// Default 30 s.
    pub claim_idle: Duration,
    /// How often the runner looks for stuck entries with `XAUTOCLAIM`. Default 5 s.
    pub claim_interval: Duration,
    /// Delay before a failed message is claimed back and delivered again, by delivery count.
    /// Default 500 ms, ×2, ≤ 60 s (capped in effect by `claim_idle`).
    pub retry: Backoff,
    /// Deliveries before a transiently failing message is dead-lettered. Default 5.
    pub max_deliveries: u32,
    /// Where confirmations go out (`outbox-reply-to` of each message). Default none.
    pub confirmations: Option<Arc<dyn ConfirmationSender>>,
    /// Inbox records older than this are deleted. Default 7 days; `None` keeps them.
    pub dedup_window: Option<Duration>,
    /// Period of the maintenance (replays, retention). Default 2 s.
    pub maintenance_interval: Duration,
    /// How long to wait for the first connection. Default 5 s.
    pub connect_timeout: Duration,
}

impl std::fmt::Debug for RedisConsumerConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisConsumerConfig")
            .field("url", &self.url)
            .field("stream", &self.stream)
            .field("group", &self.group)
            .field("consumer", &self.consumer)
            .field("batch", &self.batch)
            .field("concurrency", &self.concurrency)
            .field("claim_idle", &self.claim_idle)
            .field("max_deliveries", &self.max_deliveries)
            .field("confirmations", &self.confirmations.is_some())
            .finish_non_exhaustive()
    }
}

impl RedisConsumerConfig {
    /// Settings with the defaults.
    pub fn new(
        url: impl Into<String>,
        stream: impl Into<String>,
        group: impl Into<String>,
    ) -> Self {
        let d = DeliveryPolicy::default();
        RedisConsumerConfig {
            url: url.into(),
            password: None,
            stream: stream.into(),
            group: group.into(),
            consumer: format!("outbox-{:016x}", rand::random::<u64>()),
            start_id: "0".into(),
            batch: 100,
            block: Duration::from_secs(1),
            concurrency: 1,
            claim_idle: Duration::from_secs(30),
            claim_interval: Duration::from_secs(5),
            retry: d.retry,
            max_deliveries: d.max_deliveries,
            confirmations: None,
            dedup_window: Some(Duration::from_secs(7 * 24 * 3600)),
            maintenance_interval: Duration::from_secs(2),
            connect_timeout: Duration::from_secs(5),
        }
    }

    /// Send confirmations through `sender`.
    pub fn with_confirmations(mut self, sender: Arc<dyn ConfirmationSender>) -> Self {
        self.confirmations = Some(sender);
        self
    }

    /// Check the settings without connecting.
    ///
    /// # Errors
    /// [`ConfigError`] naming `stream`, `group`, `consumer`, `batch`, `block` or `claim_idle`.
    pub fn validate(&self) -> Result<(), ConfigError> {
        for (field, v) in [
            ("stream", &self.stream),
            ("group", &self.group),
            ("consumer", &self.consumer),
        ] {
            if v.is_empty() || v.chars().any(|c| c.is_whitespace() || c.is_control()) {
                return Err(ConfigError::new(
                    field,
                    "must be non-empty, without whitespace or control characters",
                ));
            }
        }
        if self.batch == 0 {
            return Err(ConfigError::new("batch", "must be at least 1"));
        }
        if self.block.is_zero() {
            return Err(ConfigError::new("block", "must be greater than zero"));
        }
        if self.claim_idle.is_zero() || self.claim_interval.is_zero() {
            return Err(ConfigError::new(
                "claim_idle",
                "claim_idle and claim_interval must be greater than zero",
            ));
        }
        Ok(())
    }
}

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
    conn: &mut ConnectionManager,
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
    conn: &mut ConnectionManager,
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
    conn: &mut ConnectionManager,
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
struct Pending {
    id: String,
    consumer: String,
    deliveries: u32,
}

fn parse_pending(v: Value) -> Vec<Pending> {
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

/// A failed message waiting for its retry.
#[derive(Debug)]
struct RetryDue {
    due: Instant,
    id: String,
    /// `XCLAIM`'s min-idle-time guard, milliseconds.
    min_idle_ms: u64,
}

/// A fetched entry with its delivery count.
struct Fetched {
    entry: RawEntry,
    deliveries: u32,
}

struct Runner<'a, DB: InboxBackend, H: Handler<DB> + ?Sized> {
    conn: ConnectionManager,
    config: &'a RedisConsumerConfig,
    inbox: &'a Inbox<DB>,
    handler: &'a H,
    policy: DeliveryPolicy,
    metrics: &'a ConsumerMetrics,
    retries: Vec<RetryDue>,
    claim_cursor: String,
}

impl<'a, DB: InboxBackend, H: Handler<DB> + ?Sized> Runner<'a, DB, H> {
    fn cfg(&self) -> (&'a str, &'a str, &'a str) {
        let c: &'a RedisConsumerConfig = self.config;
        (c.stream.as_str(), c.group.as_str(), c.consumer.as_str())
    }

    /// Schedule this consumer's pending entries from an earlier run for delivery now.
    async fn resume_own_pending(&mut self) -> Result<(), RedisError> {
        let (stream, group, me) = self.cfg();
        let (stream, group, me) = (stream.to_owned(), group.to_owned(), me.to_owned());
        let mut start = "-".to_owned();
        loop {
            let v: Value = redis::cmd("XPENDING")
                .arg(&stream)
                .arg(&group)
                .arg(&start)
                .arg("+")
                .arg(1000)
                .arg(&me)
                .query_async(&mut self.conn)
                .await?;
            let rows = parse_pending(v);
            let Some(last) = rows.last() else { break };
            start = format!("({}", last.id);
            let n = rows.len();
            let now = Instant::now();
            self.retries.extend(rows.into_iter().map(|p| RetryDue {
                due: now,
                id: p.id,
                min_idle_ms: 0,
            }));
            if n < 1000 {
                break;
            }
        }
        if !self.retries.is_empty() {
            tracing::info!(
                pending = self.retries.len(),
                consumer = me,
                "resuming this consumer's pending entries"
            );
        }
        Ok(())
    }

    /// Delivery counts of `ids` from `XPENDING stream group id id 1` (pipelined).
    async fn deliveries(&mut self, ids: &[String]) -> Result<Vec<u32>, RedisError> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let (stream, group, _) = self.cfg();
        let mut pipe = redis::pipe();
        for id in ids {
            pipe.cmd("XPENDING")
                .arg(stream)
                .arg(group)
                .arg(id)
                .arg(id)
                .arg(1);
        }
        let replies: Vec<Value> = pipe.query_async(&mut self.conn).await?;
        Ok(replies
            .into_iter()
            .map(|v| parse_pending(v).first().map_or(1, |p| p.deliveries.max(1)))
            .collect())
    }

    /// Claim the due retries back (atomically per id: who holds it, does the entry still exist,
    /// `XCLAIM` with the min-idle guard).
    async fn claim_due(&mut self) -> Result<Vec<Fetched>, RedisError> {
        let now = Instant::now();
        self.retries.sort_by_key(|r| r.due);
        let n = self
            .retries
            .iter()
            .take(self.config.batch)
            .take_while(|r| r.due <= now)
            .count();
        if n == 0 {
            return Ok(Vec::new());
        }
        let due: Vec<RetryDue> = self.retries.drain(..n).collect();
        let (stream, group, me) = self.cfg();
        let mut tx = redis::pipe();
        tx.atomic();
        for r in &due {
            tx.cmd("XPENDING")
                .arg(stream)
                .arg(group)
                .arg(&r.id)
                .arg(&r.id)
                .arg(1);
            tx.cmd("XRANGE").arg(stream).arg(&r.id).arg(&r.id);
            tx.cmd("XCLAIM")
                .arg(stream)
                .arg(group)
                .arg(me)
                .arg(r.min_idle_ms)
                .arg(&r.id);
        }
        let me = me.to_owned();
        let replies: Vec<Value> = match tx.query_async(&mut self.conn).await {
            Ok(r) => r,
            Err(e) => {
                // Put them back; they are still pending.
                self.retries.extend(due);
                return Err(e);
            }
        };
        let mut out = Vec::new();
        let mut lost = Vec::new();
        let mut replies = replies.into_iter();
        for r in due {
            let (Some(pending), Some(range), Some(claimed)) =
                (replies.next(), replies.next(), replies.next())
            else {
                break;
            };
            let pending = parse_pending(pending);
            let exists = !parse_entries(range).is_empty();
            let claimed = parse_entries(claimed);
            match (pending.first(), claimed.into_iter().next()) {
                (Some(p), Some(entry)) => out.push(Fetched {
                    entry,
                    deliveries: p.deliveries.saturating_add(1),
                }),
                (Some(p), None) if !exists && p.consumer == me => lost.push(r.id),
                // Acknowledged meanwhile, or another consumer holds it now.
                _ => {}
            }
        }
        self.record_lost(lost, "its entry was trimmed before its retry")
            .await;
        Ok(out)
    }

    /// `XAUTOCLAIM` entries idle for `claim_idle` (a crashed consumer's, or long retries).
    async fn claim_stuck(&mut self) -> Result<Vec<Fetched>, RedisError> {
        let (stream, group, me) = self.cfg();
        let v: Value = redis::cmd("XAUTOCLAIM")
            .arg(stream)
            .arg(group)
            .arg(me)
            .arg(self.config.claim_idle.as_millis() as u64)
            .arg(&self.claim_cursor)
            .arg("COUNT")
            .arg(self.config.batch)
            .query_async(&mut self.conn)
            .await?;
        let Value::Array(mut parts) = v else {
            return Ok(Vec::new());
        };
        let deleted = if parts.len() > 2 {
            parse_ids(parts.remove(2))
        } else {
            Vec::new()
        };
        let claimed = if parts.len() > 1 {
            parse_entries(parts.remove(1))
        } else {
            Vec::new()
        };
        self.claim_cursor = parts.first().and_then(text).unwrap_or_else(|| "0-0".into());
        self.record_lost(deleted, "its entry was trimmed while pending (XAUTOCLAIM)")
            .await;
        if claimed.is_empty() {
            return Ok(Vec::new());
        }
        let ids: Vec<String> = claimed.iter().map(|e| e.id.clone()).collect();
        self.retries.retain(|r| !ids.contains(&r.id));
        tracing::info!(n = ids.len(), "claimed stuck entries");
        let counts = self.deliveries(&ids).await?;
        Ok(claimed
            .into_iter()
            .zip(counts)
            .map(|(entry, deliveries)| Fetched { entry, deliveries })
            .collect())
    }

    /// Log, acknowledge and count ids whose entries are gone.
    async fn record_lost(&mut self, ids: Vec<String>, why: &str) {
        if ids.is_empty() {
            return;
        }
        for id in &ids {
            tracing::error!(entry_id = %id, stream = %self.config.stream, "message lost: {why}; acknowledging it");
        }
        self.metrics
            .lost
            .fetch_add(ids.len() as u64, Ordering::Relaxed);
        let (stream, group, _) = self.cfg();
        let (stream, group) = (stream.to_owned(), group.to_owned());
        if let Err(e) = ack(&mut self.conn, &stream, &group, &ids).await {
            tracing::warn!(error = %e, "acknowledging lost entries failed");
        }
    }

    /// Apply fetched entries and acknowledge or schedule their retries.
    async fn process(&mut self, fetched: Vec<Fetched>) -> Result<(), RedisError> {
        let mut to_ack = Vec::new();
        let mut lost = Vec::new();
        let mut ids = Vec::with_capacity(fetched.len());
        let mut inbound = Vec::with_capacity(fetched.len());
        for f in fetched {
            let Some(fields) = f.entry.fields else {
                lost.push(f.entry.id);
                continue;
            };
            let (headers, payload) = decode_fields(fields);
            match InboundMessage::from_wire(headers, payload, f.deliveries) {
                Ok(m) => {
                    ids.push(f.entry.id);
                    inbound.push(m);
                }
                Err(reason) => {
                    self.metrics.malformed.fetch_add(1, Ordering::Relaxed);
                    tracing::error!(entry_id = %f.entry.id, stream = %self.config.stream, reason, "entry without outbox fields; acknowledging it");
                    to_ack.push(f.entry.id);
                }
            }
        }
        self.record_lost(lost, "a nil entry (trimmed while pending)")
            .await;
        let dispositions = deliver_batch(
            self.inbox,
            self.handler,
            &inbound,
            self.config.concurrency,
            &self.policy,
            self.metrics,
        )
        .await;
        let now = Instant::now();
        for (id, d) in ids.into_iter().zip(dispositions) {
            match d {
                Disposition::Ack(_) => to_ack.push(id),
                Disposition::Retry(delay) => self.retries.push(RetryDue {
                    due: now + delay,
                    id,
                    min_idle_ms: delay.min(self.config.claim_idle).as_millis() as u64,
                }),
            }
        }
        let (stream, group, _) = self.cfg();
        let (stream, group) = (stream.to_owned(), group.to_owned());
        // The verdicts are committed; an ack that fails leaves the entries pending, and their
        // redelivery is recognised by the inbox.
        ack(&mut self.conn, &stream, &group, &to_ack).await
    }

    /// How long the next read may block: until the next retry is due, at most `block`.
    fn block_for(&self) -> Duration {
        let now = Instant::now();
        self.retries
            .iter()
            .map(|r| r.due.saturating_duration_since(now))
            .min()
            .map_or(self.config.block, |d| d.min(self.config.block))
            .max(Duration::from_millis(1))
    }
}

fn parse_ids(v: Value) -> Vec<String> {
    match v {
        Value::Array(ids) => ids.iter().filter_map(text).collect(),
        _ => Vec::new(),
    }
}

/// Run the consumer until `cancel`.
///
/// # Errors
/// [`ConfigError`] naming the field ([`RedisConsumerConfig::validate`]), `url` when Redis cannot
/// be reached at start, `stream` when the group cannot be created (e.g. the key is not a
/// stream). Later errors (reads, claims, acks) are logged and retried with backoff; a deleted
/// group is created again.
pub async fn run<DB, H>(
    config: RedisConsumerConfig,
    inbox: Inbox<DB>,
    handler: Arc<H>,
    metrics: Arc<ConsumerMetrics>,
    cancel: CancellationToken,
) -> Result<(), ConfigError>
where
    DB: InboxBackend,
    H: Handler<DB> + ?Sized,
{
    config.validate()?;
    // The blocking read needs replies later than `block`: a connection of its own.
    let mut conn = connect_manager(
        &config.url,
        config.password.as_deref(),
        config.connect_timeout,
        config.block + Duration::from_secs(5),
    )
    .await?;
    ensure_group(&mut conn, &config.stream, &config.group, &config.start_id)
        .await
        .map_err(|e| {
            ConfigError::new(
                "stream",
                format!(
                    "cannot create consumer group {} on {}: {e}",
                    config.group, config.stream
                ),
            )
        })?;
    let policy = DeliveryPolicy {
        max_deliveries: config.max_deliveries,
        retry: config.retry,
        confirmations: config.confirmations.clone(),
    };
    let background = cancel.child_token();
    let _stop_maintenance = background.clone().drop_guard();
    tokio::spawn(maintenance(
        inbox.clone(),
        handler.clone(),
        policy.clone(),
        config.dedup_window,
        config.maintenance_interval,
        metrics.clone(),
        background,
    ));
    let mut r = Runner {
        conn,
        config: &config,
        inbox: &inbox,
        handler: handler.as_ref(),
        policy,
        metrics: &metrics,
        retries: Vec::new(),
        claim_cursor: "0-0".into(),
    };
    let mut resumed = false;
    let mut next_claim = Instant::now();
    let mut failures = 0u32;
    while !cancel.is_cancelled() {
        let step: Result<(), RedisError> = async {
            if !resumed {
                r.resume_own_pending().await?;
                resumed = true;
            }
            let mut fetched = r.claim_due().await?;
            if fetched.is_empty() && Instant::now() >= next_claim {
                next_claim = Instant::now() + config.claim_interval;
                fetched = r.claim_stuck().await?;
            }
            if fetched.is_empty() {
                let block = r.block_for();
                let (s, g, c) = r.cfg();
                let (s, g, c) = (s.to_owned(), g.to_owned(), c.to_owned());
                let mut conn = r.conn.clone();
                let read = read_group(&mut conn, &s, &g, &c, config.batch, Some(block), ">");
                let entries = tokio::select! {
                    _ = cancel.cancelled() => return Ok(()),
                    e = read => e?,
                };
                fetched = entries
                    .into_iter()
                    .map(|entry| Fetched {
                        entry,
                        deliveries: 1,
                    })
                    .collect();
            }
            if fetched.is_empty() {
                return Ok(());
            }
            r.process(fetched).await
        }
        .await;
        match step {
            Ok(()) => failures = 0,
            Err(e) => {
                failures += 1;
                if e.code() == Some("NOGROUP") {
                    tracing::warn!(error = %e, "consumer group missing; creating it again");
                    let _ =
                        ensure_group(&mut r.conn, &config.stream, &config.group, &config.start_id)
                            .await;
                } else {
                    tracing::warn!(error = %e, "Redis consumer step failed; backing off");
                }
                tokio::select! {
                    _ = cancel.cancelled() => break,
                    _ = tokio::time::sleep(config.retry.delay(failures)) => {}
                }
            }
        }
    }
    Ok(())
}

/// Group `fields` by name (for tests and tools): the last value of each field.
pub fn fields_map(fields: &[(Vec<u8>, Vec<u8>)]) -> BTreeMap<String, Vec<u8>> {
    fields
        .iter()
        .map(|(k, v)| (String::from_utf8_lossy(k).into_owned(), v.clone()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn config_is_validated() {
        let c = RedisConsumerConfig::new("redis://x", "s", "g");
        c.validate().unwrap();
        let bad = RedisConsumerConfig {
            group: "a b".into(),
            ..c.clone()
        };
        assert_eq!(bad.validate().unwrap_err().field, "group");
        let bad = RedisConsumerConfig { batch: 0, ..c };
        assert_eq!(bad.validate().unwrap_err().field, "batch");
    }
}
