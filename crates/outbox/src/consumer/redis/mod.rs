//! Redis Streams consumer-group runner feeding an [`Inbox`].
//!
//! Commands (<https://redis.io/docs/latest/develop/data-types/streams/>):
//! - at start, `XGROUP CREATE <stream> <group> <start_id> MKSTREAM` (an existing group is kept);
//!   then this consumer's own pending entries, left by an earlier run under the same consumer
//!   name (`XPENDING <stream> <group> - + n <consumer>`), are delivered again first;
//! - `XREADGROUP GROUP <group> <consumer> COUNT <batch> BLOCK <block> STREAMS <stream> >` for new
//!   entries (delivery count 1);
//! - each fetched batch goes through [`deliver_batch`](crate::consumer::deliver_batch) in `concurrency` lanes by partition key;
//!   `XACK` follows only after the inbox transaction committed (applied, rejected, duplicate or
//!   dead-lettered); nothing is acknowledged that was not stored (shared case C27);
//! - **retry with backoff**: Redis has no negative acknowledgement or delayed redelivery, so a
//!   message whose handler failed transiently is left pending (not acknowledged) and the runner
//!   keeps its id with a due time from [`Backoff`](crate::Backoff) by delivery count; when it is due, the runner
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
//! The runner is the generic one ([`consume`]) over this module's source; it also performs the
//! consumer's [`maintenance`](crate::consumer::maintenance) (operator replays, inbox retention).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use async_trait::async_trait;
use redis::{RedisError, Value};
use tokio::time::Instant;

use crate::consumer::source::{
    ConsumeOptions, Delivery, Envelope, Settle, Source, SourceConfig, SourceError,
};
use crate::consumer::{ConsumerMetrics, RunnerSettings};
use crate::error::ConfigError;
use crate::transport::redis::{FIELD_PAYLOAD, RedisConnection, connect_redis, decode_fields_with};

mod streams;
use streams::{
    RawEntry, ack, ensure_group, parse_entries, parse_ids, parse_pending, read_group, text,
};

/// Settings of a Redis Streams consumer runner.
#[derive(Clone, derive_more::Debug)]
pub struct RedisConsumerConfig {
    /// Server URL, `redis://…` or `rediss://…`; for a Redis Cluster, a seed list or one node
    /// with `cluster` (as [`RedisConfig::url`](crate::transport::redis::RedisConfig::url)).
    /// Required.
    #[debug("{:?}", crate::redact::url(url))]
    pub url: String,
    /// Connect to a Redis Cluster; implied by a seed list in `url`. Default false.
    pub cluster: bool,
    /// Password, overriding one in the URL. Default none.
    #[debug("{:?}", crate::redact::secret(password))]
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
    /// Lanes, retries, dead letters, confirmations and inbox upkeep: the settings every
    /// runner shares ([`RunnerSettings`], with its defaults).
    /// Here a failed message is claimed back after the `retry` delay, capped in effect by
    /// `claim_idle`.
    pub runner: RunnerSettings,
    /// Idle time after which a pending entry of any consumer is taken over by `XAUTOCLAIM`.
    /// Default 30 s.
    pub claim_idle: Duration,
    /// How often the runner looks for stuck entries with `XAUTOCLAIM`. Default 5 s.
    pub claim_interval: Duration,
    /// How long to wait for the first connection. Default 5 s.
    pub connect_timeout: Duration,
}

crate::consumer::with_confirmations!(RedisConsumerConfig);

impl RedisConsumerConfig {
    /// Settings with the defaults.
    pub fn new(
        url: impl Into<String>,
        stream: impl Into<String>,
        group: impl Into<String>,
    ) -> Self {
        RedisConsumerConfig {
            url: url.into(),
            cluster: false,
            password: None,
            stream: stream.into(),
            group: group.into(),
            consumer: format!("outbox-{:016x}", rand::random::<u64>()),
            start_id: "0".into(),
            batch: 100,
            block: Duration::from_secs(1),
            runner: RunnerSettings::default(),
            claim_idle: Duration::from_secs(30),
            claim_interval: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(5),
        }
    }

    /// Check the settings without connecting.
    ///
    /// # Errors
    /// [`ConfigError`] naming `stream`, `group`, `consumer`, `batch`, `block`, `claim_idle` or a
    /// `runner.*` field.
    pub fn validate(&self) -> Result<(), ConfigError> {
        for (field, v) in [
            ("stream", &self.stream),
            ("group", &self.group),
            ("consumer", &self.consumer),
        ] {
            ConfigError::invalid_if(
                v.is_empty() || v.chars().any(|c| c.is_whitespace() || c.is_control()),
                field,
                "must be non-empty, without whitespace or control characters",
            )?;
        }
        ConfigError::invalid_if(self.batch == 0, "batch", "must be at least 1")?;
        ConfigError::zero_if(self.block.is_zero(), "block")?;
        ConfigError::invalid_if(
            self.claim_idle.is_zero() || self.claim_interval.is_zero(),
            "claim_idle",
            "claim_idle and claim_interval must be greater than zero",
        )?;
        self.runner.validate()
    }
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

/// The Redis Streams [`Source`]: a consumer group member with retries by `XCLAIM` and takeover
/// of stuck entries by `XAUTOCLAIM` (see the module docs).
pub struct RedisSource {
    conn: Option<RedisConnection>,
    config: RedisConsumerConfig,
    /// The field holding the payload; the others named `h:…` are headers.
    payload_field: String,
    metrics: Arc<ConsumerMetrics>,
    retries: Vec<RetryDue>,
    claim_cursor: String,
    resumed: bool,
    next_claim: Instant,
}

impl RedisSource {
    /// A source for `config` (validated; nothing is contacted until [`Source::open`]) counting
    /// entries lost to trimming in `metrics`.
    ///
    /// # Errors
    /// [`ConfigError`] naming the invalid field.
    pub fn new(
        config: RedisConsumerConfig,
        metrics: Arc<ConsumerMetrics>,
    ) -> Result<Self, ConfigError> {
        config.validate()?;
        Ok(RedisSource {
            conn: None,
            config,
            payload_field: FIELD_PAYLOAD.to_owned(),
            metrics,
            retries: Vec::new(),
            claim_cursor: "0-0".into(),
            resumed: false,
            next_claim: Instant::now(),
        })
    }

    /// Read the payload from `field` instead of the transport's payload field (the producer's
    /// confirmation listener reads confirmation entries this way).
    pub fn with_payload_field(mut self, field: impl Into<String>) -> Self {
        self.payload_field = field.into();
        self
    }

    fn cfg(&self) -> (String, String, String) {
        let c = &self.config;
        (c.stream.clone(), c.group.clone(), c.consumer.clone())
    }

    fn conn(&mut self) -> Result<&mut RedisConnection, RedisError> {
        self.conn
            .as_mut()
            .ok_or_else(|| RedisError::from((redis::ErrorKind::Io, "not connected")))
    }

    /// Schedule this consumer's pending entries from an earlier run for delivery now.
    async fn resume_own_pending(&mut self) -> Result<(), RedisError> {
        let (stream, group, me) = self.cfg();
        let mut start = "-".to_owned();
        loop {
            let v: Value = redis::cmd("XPENDING")
                .arg(&stream)
                .arg(&group)
                .arg(&start)
                .arg("+")
                .arg(1000)
                .arg(&me)
                .query_async(self.conn()?)
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
                .arg(&stream)
                .arg(&group)
                .arg(id)
                .arg(id)
                .arg(1);
        }
        let replies: Vec<Value> = pipe.query_async(self.conn()?).await?;
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
        let (stream, group) = (stream.as_str(), group.as_str());
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
                .arg(&me)
                .arg(r.min_idle_ms)
                .arg(&r.id);
        }
        let replies: Vec<Value> = match tx.query_async(self.conn()?).await {
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
        let (idle, cursor, count) = (
            self.config.claim_idle.as_millis() as u64,
            self.claim_cursor.clone(),
            self.config.batch,
        );
        let v: Value = redis::cmd("XAUTOCLAIM")
            .arg(stream)
            .arg(group)
            .arg(me)
            .arg(idle)
            .arg(cursor)
            .arg("COUNT")
            .arg(count)
            .query_async(self.conn()?)
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
        let acked = match self.conn() {
            Ok(conn) => ack(conn, &stream, &group, &ids).await,
            Err(e) => Err(e),
        };
        if let Err(e) = acked {
            tracing::warn!(error = %e, "acknowledging lost entries failed");
        }
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

/// Map a Redis error of a running source: a deleted group is created again on the next open.
fn lost(e: RedisError) -> SourceError {
    if e.code() == Some("NOGROUP") {
        SourceError::Lost(format!("consumer group missing ({e}); creating it again"))
    } else {
        SourceError::Lost(format!("Redis consumer step failed: {e}"))
    }
}

#[async_trait]
impl Source for RedisSource {
    /// The entry id.
    type Token = String;

    fn describe(&self) -> String {
        format!(
            "Redis stream {}, group {}, consumer {}",
            self.config.stream, self.config.group, self.config.consumer
        )
    }

    async fn open(&mut self) -> Result<(), SourceError> {
        let c = &self.config;
        if self.conn.is_none() {
            // The blocking read needs replies later than `block`.
            self.conn = Some(
                connect_redis(
                    &c.url,
                    c.password.as_deref(),
                    c.cluster,
                    c.connect_timeout,
                    c.block + Duration::from_secs(5),
                )
                .await?,
            );
        }
        let (stream, group, start) = (c.stream.clone(), c.group.clone(), c.start_id.clone());
        ensure_group(self.conn().map_err(lost)?, &stream, &group, &start)
            .await
            .map_err(|e| {
                ConfigError::new(
                    "stream",
                    format!("cannot create consumer group {group} on {stream}: {e}"),
                )
            })?;
        Ok(())
    }

    async fn fetch(&mut self, max: usize) -> Result<Vec<Delivery<String>>, SourceError> {
        if !self.resumed {
            self.resume_own_pending().await.map_err(lost)?;
            self.resumed = true;
        }
        let mut fetched = self.claim_due().await.map_err(lost)?;
        if fetched.is_empty() && Instant::now() >= self.next_claim {
            self.next_claim = Instant::now() + self.config.claim_interval;
            fetched = self.claim_stuck().await.map_err(lost)?;
        }
        if fetched.is_empty() {
            let block = self.block_for();
            let (s, g, c) = self.cfg();
            let count = max.min(self.config.batch);
            let entries = read_group(
                self.conn().map_err(lost)?,
                &s,
                &g,
                &c,
                count,
                Some(block),
                ">",
            )
            .await
            .map_err(lost)?;
            fetched = entries
                .into_iter()
                .map(|entry| Fetched {
                    entry,
                    deliveries: 1,
                })
                .collect();
        }
        let mut gone = Vec::new();
        let mut out = Vec::with_capacity(fetched.len());
        for f in fetched {
            let Some(fields) = f.entry.fields else {
                gone.push(f.entry.id);
                continue;
            };
            let (headers, payload) = decode_fields_with(fields, &self.payload_field);
            out.push(Delivery {
                envelope: Envelope {
                    headers,
                    payload,
                    delivery_count: f.deliveries,
                    origin: format!("stream {}, entry {}", self.config.stream, f.entry.id),
                },
                token: f.entry.id,
            });
        }
        self.record_lost(gone, "a nil entry (trimmed while pending)")
            .await;
        Ok(out)
    }

    async fn settle(&mut self, batch: Vec<(Delivery<String>, Settle)>) -> Result<(), SourceError> {
        let now = Instant::now();
        let mut to_ack = Vec::with_capacity(batch.len());
        for (d, s) in batch {
            match s {
                Settle::Ack | Settle::Reject(_) => to_ack.push(d.token),
                Settle::Retry(delay) => self.retries.push(RetryDue {
                    due: now + delay,
                    id: d.token,
                    min_idle_ms: delay.min(self.config.claim_idle).as_millis() as u64,
                }),
            }
        }
        let (stream, group, _) = self.cfg();
        // The verdicts are committed; an ack that fails leaves the entries pending, and their
        // redelivery is recognised by the inbox.
        ack(self.conn().map_err(lost)?, &stream, &group, &to_ack)
            .await
            .map_err(lost)
    }
}

// This broker's consumer is the generic runner over its source: `redis::run(config, …)`.
pub use crate::consumer::run;

/// [`run`] consumes with a [`RedisSource`] built from these settings.
///
/// # Errors of `run`
/// [`ConfigError`] naming the field ([`RedisConsumerConfig::validate`]), `url` when Redis cannot
/// be reached at start, `stream` when the group cannot be created (e.g. the key is not a
/// stream). Later errors (reads, claims, acks) are logged and retried with backoff; a deleted
/// group is created again.
impl SourceConfig for RedisConsumerConfig {
    type Source = RedisSource;

    fn options(&self) -> ConsumeOptions {
        ConsumeOptions::new(&self.runner, self.batch)
    }

    fn into_source(self, metrics: &Arc<ConsumerMetrics>) -> Result<RedisSource, ConfigError> {
        RedisSource::new(self, metrics.clone())
    }
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
