//! Redis Streams transport: `XADD` each message to its destination stream, pipelined over the
//! batch, `Ok` only on the server's reply (the new entry id).
//!
//! # Entry layout
//! One stream entry per message, its fields in this order (field names are ASCII; values are
//! binary-safe bulk strings):
//!
//! | field | value |
//! |---|---|
//! | `id` | the message id (UUID text): the idempotency key the inbox deduplicates on |
//! | `h:<name>` | one field per header of [`Message::wire_headers`]: the user headers (e.g. `traceparent`), `outbox-message-id`, `outbox-topic`, `outbox-attempt`, `outbox-partition-key` |
//! | `payload` | the payload bytes, byte-exact |
//!
//! Header names never contain `:` (they are validated at enqueue to `A-Z a-z 0-9 - _ .`), so
//! the `h:` prefix keeps a user header named `id` or `payload` from colliding with the fixed
//! fields. The entry id is Redis's own (`*`, time-ordered); Redis Streams have no duplicate
//! detection, so a relay that re-publishes after a crash adds a second entry with the same `id`
//! field and the consumer's inbox absorbs it.
//!
//! Every header name and value and every partition key can travel (fields and values are
//! binary-safe), and the transport reserves no header name: [`RedisTransport::check`](Transport::check)
//! checks only the destination stream key.
//!
//! # What the acknowledgement means (durability)
//! Redis replies to `XADD` once the entry is in the server's memory: that reply is the
//! acknowledgement the relay waits for. It survives a Redis restart only as far as persistence is
//! configured on the server (<https://redis.io/docs/latest/operate/oss_and_stack/management/persistence/>):
//! with `appendonly yes` and `appendfsync always` the entry is written and fsynced to the AOF
//! before the reply; with `appendfsync everysec` (the AOF default) up to about one second of
//! acknowledged entries can be lost on a crash of the host; with RDB snapshots only, everything
//! since the last snapshot. [`RedisConfig::wait_replicas`] adds `WAIT numreplicas timeout`
//! (<https://redis.io/docs/latest/commands/wait/>) after the batch: the batch counts as
//! acknowledged only when that many replicas have it in memory, otherwise every entry of the
//! batch is reported `Unavailable` (no attempt counted; re-published once replicas are back:
//! duplicates, absorbed by the inbox).
//! `WAITAOF` (Redis 7.2+) is not used: the supported server here is 7.0.
//!
//! # Trimming (shared case C38)
//! No trimming by default: a length cap (`MAXLEN`) removes the oldest entries whatever the
//! consumer groups have read, so entries not yet delivered are lost and entries delivered but not
//! acknowledged stay in the pending lists as bare ids. [`RedisConfig::max_len`] sets
//! `MAXLEN ~ n` on every `XADD` for users who accept that; [`RedisTransport::connect`] logs
//! [`RedisConfig::warnings`] at start-up when it is set. Trim after the consumers acknowledged
//! instead: [`RedisTransport::trim_delivered`] trims only below what every group has received
//! and acknowledged.
//!
//! # Classification
//! Connection refused, dropped or not established, and the transport's configuration refused
//! (`NOAUTH`, `WRONGPASS`, authentication failed, `NOPERM`: the ACL user may not `XADD` to the
//! key) → `Unavailable` (the relay pauses the transport, counts no attempt, and publishes once
//! the credentials or the ACL are fixed); response timeout, `OOM`, `LOADING`, `READONLY`, `BUSY`,
//! `MASTERDOWN`, `TRYAGAIN` → retryable; a `WAIT` short of replicas → `Unavailable`; `WRONGTYPE` (the destination
//! key exists and is not a stream), `ERR` (a command the server refuses as written), an invalid
//! stream key → permanent. One
//! refused entry does not fail the others: the pipeline reports one result per command.

use std::time::Duration;

use async_trait::async_trait;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{IntoConnectionInfo, RedisError, Value};

use super::{Outgoing, Transport};
use crate::error::{ConfigError, TransportError, TransportErrorKind};
use crate::message::{Headers, Message};

/// Entry field holding the message id.
pub const FIELD_ID: &str = "id";
/// Entry field holding the payload bytes.
pub const FIELD_PAYLOAD: &str = "payload";
/// Prefix of the entry fields holding headers: header `traceparent` is field `h:traceparent`.
pub const HEADER_FIELD_PREFIX: &str = "h:";

mod config;
pub use config::*;

/// Connect a [`ConnectionManager`] (it reconnects by itself after a lost connection) to `url`,
/// waiting at most `connect_timeout` for the first connection, with replies awaited at most
/// `response_timeout`. Shared by the transport, the consumer runner and the confirmations.
///
/// # Errors
/// [`ConfigError`] naming `url` when the URL is invalid or the server does not answer, or
/// `password` when it refuses the credentials.
pub async fn connect_manager(
    url: &str,
    password: Option<&str>,
    connect_timeout: Duration,
    response_timeout: Duration,
) -> Result<ConnectionManager, ConfigError> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let info = connection_info(url, password)?;
    let client = redis::Client::open(info)
        .map_err(|e| ConfigError::new("url", format!("invalid Redis URL {url:?}: {e}")))?;
    let config = ConnectionManagerConfig::new()
        .set_connection_timeout(Some(connect_timeout))
        .set_response_timeout(Some(response_timeout))
        .set_number_of_retries(2)
        .set_max_delay(Duration::from_secs(2));
    let connect = ConnectionManager::new_with_config(client, config);
    connect_within(&format!("Redis at {url}"), connect_timeout, connect).await
}

/// Await `connect` for `connect_timeout` and a second more, naming `what` (`Redis at <url>`)
/// in the error: refused credentials are a `password` error, anything else a `url` error.
async fn connect_within<C>(
    what: &str,
    connect_timeout: Duration,
    connect: impl std::future::Future<Output = redis::RedisResult<C>>,
) -> Result<C, ConfigError> {
    match tokio::time::timeout(connect_timeout + Duration::from_secs(1), connect).await {
        Ok(Ok(c)) => Ok(c),
        Ok(Err(e)) if e.kind() == redis::ErrorKind::AuthenticationFailed => Err(ConfigError::new(
            "password",
            format!("{what} refused the credentials: {e}"),
        )),
        Ok(Err(e)) => Err(ConfigError::new(
            "url",
            format!("cannot connect to {what}: {e}"),
        )),
        Err(_) => Err(ConfigError::new(
            "url",
            format!("{what} did not answer within {connect_timeout:?}"),
        )),
    }
}

/// A connection to one Redis server or to a Redis Cluster, shared by the transport, the consumer
/// runner and the confirmations (cheap to clone; it reconnects by itself).
///
/// A [`ClusterConnection`](redis::cluster_async::ClusterConnection) keeps a connection to every
/// primary, routes each command by the slot of its key, follows `MOVED`/`ASK` redirections and
/// reads the cluster's slot map again when a node goes away, so a replica promoted after its
/// primary died takes the stream's writes without a restart (see the Redis documentation,
/// "Scale with Redis Cluster"). A stream key lives in one slot, so each stream is on one primary.
#[derive(Clone)]
pub enum RedisConnection {
    /// One server, through a [`ConnectionManager`].
    Single(ConnectionManager),
    /// A Redis Cluster.
    Cluster(redis::cluster_async::ClusterConnection),
}

impl From<ConnectionManager> for RedisConnection {
    fn from(c: ConnectionManager) -> Self {
        RedisConnection::Single(c)
    }
}

impl redis::aio::ConnectionLike for RedisConnection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a redis::Cmd) -> redis::RedisFuture<'a, Value> {
        match self {
            RedisConnection::Single(c) => c.req_packed_command(cmd),
            RedisConnection::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> redis::RedisFuture<'a, Vec<Value>> {
        match self {
            RedisConnection::Single(c) => c.req_packed_commands(pipeline, offset, count),
            RedisConnection::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            RedisConnection::Single(c) => c.get_db(),
            RedisConnection::Cluster(c) => c.get_db(),
        }
    }
}

/// Whether `url` with `cluster` set means a Redis Cluster: `cluster` is true, or the URL is a
/// seed list (several URLs separated by commas).
pub fn is_cluster(url: &str, cluster: bool) -> bool {
    cluster || url.contains(',')
}

/// Connect to `url`: one server through [`connect_manager`], or, when [`is_cluster`], a Redis
/// Cluster through the seed list of `url` (each `redis://host:port`; one reachable node is
/// enough, the others are learnt from it), with the same timeouts.
///
/// # Errors
/// [`ConfigError`] naming `url` when a URL is invalid or no node answers, or `password` when the
/// server refuses the credentials.
pub async fn connect_redis(
    url: &str,
    password: Option<&str>,
    cluster: bool,
    connect_timeout: Duration,
    response_timeout: Duration,
) -> Result<RedisConnection, ConfigError> {
    if !is_cluster(url, cluster) {
        return connect_manager(url, password, connect_timeout, response_timeout)
            .await
            .map(RedisConnection::Single);
    }
    let _ = rustls::crypto::ring::default_provider().install_default();
    let seeds = url
        .split(',')
        .map(|u| connection_info(u.trim(), password))
        .collect::<Result<Vec<_>, _>>()?;
    let shown = crate::redact::url(url);
    // The client retries a command that meets a dead node or a moved slot, with a backoff from
    // 1.28 s growing to 655 s over 16 retries by default: a publish would hang for minutes while
    // a failover takes seconds. A few quick retries cover a redirection or a slot-map refresh;
    // beyond them the relay's own backoff takes over (with a classified error).
    let client = redis::cluster::ClusterClientBuilder::new(seeds)
        .connection_timeout(connect_timeout)
        .response_timeout(response_timeout)
        .retries(4)
        .min_retry_wait(100)
        .max_retry_wait(1000)
        .build()
        .map_err(|e| {
            ConfigError::new("url", format!("invalid Redis Cluster seeds {shown}: {e}"))
        })?;
    let what = format!("the Redis Cluster at {shown}");
    let c = connect_within(&what, connect_timeout, client.get_async_connection()).await?;
    Ok(RedisConnection::Cluster(c))
}

/// Publishes to Redis Streams (see the module docs).
#[derive(Clone)]
pub struct RedisTransport {
    /// The connection; in cluster mode replaced by a new one when a probe fails (see
    /// [`Transport::probe`]).
    conn: std::sync::Arc<std::sync::Mutex<RedisConnection>>,
    config: RedisConfig,
}

impl std::fmt::Debug for RedisTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisTransport")
            .field("url", &crate::redact::url(&self.config.url))
            .field("max_len", &self.config.max_len)
            .field("wait_replicas", &self.config.wait_replicas)
            .finish_non_exhaustive()
    }
}

impl RedisTransport {
    /// Validate the settings, connect, and log [`RedisConfig::warnings`].
    ///
    /// # Errors
    /// [`ConfigError`] naming the field ([`RedisConfig::validate`]), `url` when the server cannot
    /// be reached, `password` when it refuses the credentials.
    pub async fn connect(config: RedisConfig) -> Result<Self, ConfigError> {
        config.validate()?;
        let conn = connect_redis(
            &config.url,
            config.password.as_deref(),
            config.cluster,
            config.connect_timeout,
            config.response_timeout,
        )
        .await?;
        for w in config.warnings() {
            tracing::warn!(url = %crate::redact::url(&config.url), "{w}");
        }
        Ok(RedisTransport {
            conn: std::sync::Arc::new(std::sync::Mutex::new(conn)),
            config,
        })
    }

    /// The current connection.
    fn current(&self) -> RedisConnection {
        self.conn.lock().expect("poisoned").clone()
    }

    /// The start-up warnings of this transport's settings ([`RedisConfig::warnings`]).
    pub fn warnings(&self) -> Vec<String> {
        self.config.warnings()
    }

    /// A handle on the connection (cheap clone; it reconnects by itself).
    pub fn connection(&self) -> RedisConnection {
        self.current()
    }

    /// Trim `stream` only below what every consumer group is done with (shared case C38's safe
    /// trimming): `XTRIM <stream> MINID <bound>`, where the bound is, over the groups of
    /// `XINFO GROUPS`, the lowest of each group's oldest pending id (`XPENDING` summary) and the id
    /// just after its `last-delivered-id`. Entries not yet delivered to a group, and entries
    /// delivered but not acknowledged, are kept. A stream without groups is not trimmed (nobody
    /// has read it yet). Returns the number of entries removed. Run it periodically from one
    /// place (e.g. a maintenance job); a group created afterwards with start id `0` sees only what
    /// was kept.
    ///
    /// # Errors
    /// A classified [`TransportError`] when Redis fails.
    pub async fn trim_delivered(&self, stream: &str) -> Result<u64, TransportError> {
        let mut conn = self.current();
        let groups: Value = redis::cmd("XINFO")
            .arg("GROUPS")
            .arg(stream)
            .query_async(&mut conn)
            .await
            .map_err(|e| error(e, "XINFO GROUPS failed"))?;
        let mut bound: Option<(u64, u64)> = None;
        let groups = match groups {
            Value::Array(g) => g,
            _ => Vec::new(),
        };
        for g in groups {
            let fields = group_fields(g);
            let name = fields.get("name").cloned().unwrap_or_default();
            let last = fields
                .get("last-delivered-id")
                .and_then(|id| parse_id(id))
                .unwrap_or((0, 0));
            let mut group_bound = (last.0, last.1.saturating_add(1));
            let summary: Value = redis::cmd("XPENDING")
                .arg(stream)
                .arg(&name)
                .query_async(&mut conn)
                .await
                .map_err(|e| error(e, "XPENDING failed"))?;
            if let Value::Array(parts) = summary
                && let Some(Value::BulkString(min)) = parts.get(1)
                && let Some(min) = parse_id(&String::from_utf8_lossy(min))
            {
                group_bound = group_bound.min(min);
            }
            bound = Some(bound.map_or(group_bound, |b| b.min(group_bound)));
        }
        let Some((ms, seq)) = bound else {
            return Ok(0);
        };
        redis::cmd("XTRIM")
            .arg(stream)
            .arg("MINID")
            .arg(format!("{ms}-{seq}"))
            .query_async::<u64>(&mut conn)
            .await
            .map_err(|e| error(e, "XTRIM failed"))
    }
}

/// The fields of one `XINFO GROUPS` entry (RESP2 flat list or RESP3 map) as text.
fn group_fields(v: Value) -> std::collections::HashMap<String, String> {
    let pairs: Vec<(Value, Value)> = match v {
        Value::Map(m) => m,
        Value::Array(a) => {
            let mut it = a.into_iter();
            std::iter::from_fn(|| Some((it.next()?, it.next()?))).collect()
        }
        _ => Vec::new(),
    };
    let text = |v: &Value| match v {
        Value::BulkString(b) => Some(String::from_utf8_lossy(b).into_owned()),
        Value::SimpleString(s) => Some(s.clone()),
        Value::Int(n) => Some(n.to_string()),
        _ => None,
    };
    pairs
        .iter()
        .filter_map(|(k, v)| Some((text(k)?, text(v)?)))
        .collect()
}

/// Parse a stream id `ms-seq`.
fn parse_id(id: &str) -> Option<(u64, u64)> {
    let (ms, seq) = id.split_once('-')?;
    Some((ms.parse().ok()?, seq.parse().ok()?))
}

/// The fields of the entry for `m` (see the module docs), in order.
pub fn entry_fields(m: &Message) -> Vec<(String, Vec<u8>)> {
    let headers = m.wire_headers();
    let mut fields = Vec::with_capacity(headers.len() + 2);
    fields.push((FIELD_ID.to_owned(), m.message_id.to_string().into_bytes()));
    for (k, v) in headers {
        fields.push((format!("{HEADER_FIELD_PREFIX}{k}"), v.into_bytes()));
    }
    fields.push((FIELD_PAYLOAD.to_owned(), m.payload.clone()));
    fields
}

/// Headers and payload of an entry written by [`entry_fields`]: the `h:` fields as headers (a
/// non-UTF-8 header value is replaced lossily), `payload` as the payload (empty when missing).
/// Fields this layout does not know are ignored.
pub fn decode_fields(fields: Vec<(Vec<u8>, Vec<u8>)>) -> (Headers, Vec<u8>) {
    decode_fields_with(fields, FIELD_PAYLOAD)
}

/// [`decode_fields`] with the payload in `payload_field`.
pub fn decode_fields_with(
    fields: Vec<(Vec<u8>, Vec<u8>)>,
    payload_field: &str,
) -> (Headers, Vec<u8>) {
    let mut headers = Headers::new();
    let mut payload = Vec::new();
    for (k, v) in fields {
        if k == payload_field.as_bytes() {
            payload = v;
        } else if let Some(name) = k.strip_prefix(HEADER_FIELD_PREFIX.as_bytes()) {
            headers.insert(
                String::from_utf8_lossy(name).into_owned(),
                String::from_utf8_lossy(&v).into_owned(),
            );
        }
    }
    (headers, payload)
}

/// Check a destination stream key: 1 to 1,024 bytes, no whitespace or control characters (Redis
/// accepts any binary key; these rules keep a mistyped route template from creating odd keys).
pub(crate) fn validate_key(key: &str) -> Result<(), String> {
    if key.is_empty()
        || key.len() > 1024
        || key.chars().any(|c| c.is_whitespace() || c.is_control())
    {
        Err(format!(
            "invalid Redis stream key {key:?}: 1 to 1024 bytes, no whitespace or control characters"
        ))
    } else {
        Ok(())
    }
}

/// Classify a Redis error where it is born (see the module docs).
pub(crate) fn classify(e: &RedisError) -> TransportErrorKind {
    if e.is_connection_refusal() || e.is_connection_dropped() || e.is_io_error() {
        return TransportErrorKind::Unavailable;
    }
    if e.is_timeout() {
        return TransportErrorKind::Retryable;
    }
    if e.kind() == redis::ErrorKind::AuthenticationFailed {
        return TransportErrorKind::Unavailable;
    }
    match e.code() {
        Some("NOAUTH" | "WRONGPASS" | "NOPERM") => TransportErrorKind::Unavailable,
        Some("WRONGTYPE" | "ERR" | "NOSCRIPT") => TransportErrorKind::Permanent,
        _ => TransportErrorKind::Retryable,
    }
}

/// The reply to each command of `pipe` sent on its own over the cluster connection `conn`: the
/// commands before the trailing `WAIT` (when `ends_with_wait`) at once, then the `WAIT`.
async fn cluster_replies(
    conn: &RedisConnection,
    pipe: &redis::Pipeline,
    ends_with_wait: bool,
) -> Vec<redis::RedisResult<Value>> {
    let cmds: Vec<&redis::Cmd> = pipe.cmd_iter().collect();
    let (wait, writes) = match cmds.split_last() {
        Some((last, rest)) if ends_with_wait => (Some(*last), rest),
        _ => (None, &cmds[..]),
    };
    let mut replies = futures::future::join_all(writes.iter().map(|cmd| {
        let mut conn = conn.clone();
        async move { cmd.query_async::<Value>(&mut conn).await }
    }))
    .await;
    if let Some(wait) = wait {
        let mut conn = conn.clone();
        replies.push(wait.query_async::<Value>(&mut conn).await);
    }
    replies
}

fn error(e: RedisError, what: &str) -> TransportError {
    TransportError::new(classify(&e), format!("{what}: {e}")).with_source(e)
}

#[async_trait]
impl Transport for RedisTransport {
    fn name(&self) -> &str {
        "redis"
    }

    /// Redis stream fields are binary-safe and the header fields are prefixed `h:` (see the
    /// module docs), so every header name, value and partition key can travel and no header name
    /// is reserved: only the stream key is checked.
    fn check(&self, out: &Outgoing<'_>) -> Result<(), TransportError> {
        validate_key(out.destination).map_err(TransportError::permanent)
    }

    async fn publish(&self, batch: &[Outgoing<'_>]) -> Vec<Result<(), TransportError>> {
        let mut results: Vec<Option<Result<(), TransportError>>> = Vec::with_capacity(batch.len());
        let mut pipe = redis::pipe();
        pipe.ignore_errors();
        let mut sent = 0;
        for o in batch {
            if let Err(refused) = self.check(o) {
                results.push(Some(Err(refused)));
                continue;
            }
            let mut cmd = redis::cmd("XADD");
            cmd.arg(o.destination);
            if let Some(n) = self.config.max_len {
                cmd.arg("MAXLEN").arg("~").arg(n);
            }
            cmd.arg("*");
            for (k, v) in entry_fields(o.message) {
                cmd.arg(k).arg(v);
            }
            pipe.add_command(cmd);
            results.push(None);
            sent += 1;
        }
        if sent == 0 {
            return results.into_iter().flatten().collect();
        }
        if let Some(w) = self.config.wait_replicas {
            pipe.cmd("WAIT")
                .arg(w.replicas)
                .arg(w.timeout.as_millis() as u64);
        }
        let mut conn = self.current();
        let replies: Result<Vec<redis::RedisResult<Value>>, RedisError> = match &conn {
            RedisConnection::Single(_) => pipe.query_async(&mut conn).await,
            // A cluster pipeline must stay within one slot: each command is sent on its own,
            // all at once (the connection to each primary multiplexes them), and `WAIT` after
            // every XADD has its reply (it goes to every primary, the smallest count wins).
            RedisConnection::Cluster(_) => {
                Ok(cluster_replies(&conn, &pipe, self.config.wait_replicas.is_some()).await)
            }
        };
        let mut replies = match replies {
            Ok(r) => r.into_iter(),
            Err(e) => {
                let kind = classify(&e);
                let msg = format!("Redis pipeline failed: {e}");
                return results
                    .into_iter()
                    .map(|r| r.unwrap_or_else(|| Err(TransportError::new(kind, msg.clone()))))
                    .collect();
            }
        };
        let mut out: Vec<Result<(), TransportError>> = results
            .into_iter()
            .map(|r| match r {
                Some(done) => done,
                None => match replies.next() {
                    Some(Ok(Value::BulkString(_) | Value::SimpleString(_))) => Ok(()),
                    Some(Ok(other)) => Err(TransportError::retryable(format!(
                        "unexpected XADD reply {other:?}"
                    ))),
                    Some(Err(e)) => Err(error(e, "XADD refused")),
                    None => Err(TransportError::retryable("missing XADD reply")),
                },
            })
            .collect();
        if let Some(w) = self.config.wait_replicas {
            let reached = match replies.next() {
                Some(Ok(Value::Int(n))) => Ok(n),
                Some(Ok(other)) => Err(format!("unexpected WAIT reply {other:?}")),
                Some(Err(e)) => Err(format!("WAIT failed: {e}")),
                None => Err("missing WAIT reply".to_owned()),
            };
            let short = match reached {
                Ok(n) if n >= i64::from(w.replicas) => None,
                Ok(n) => Some(format!(
                    "only {n} of {} replicas acknowledged the batch within {:?}",
                    w.replicas, w.timeout
                )),
                Err(e) => Some(e),
            };
            // Too few replicas is the cluster's state, not the message's: `Unavailable` (the
            // relay pauses the transport and counts no attempt), so a primary left without its
            // replica after a failover dead-letters nothing while the replica is away.
            if let Some(reason) = short {
                for r in out.iter_mut().filter(|r| r.is_ok()) {
                    *r = Err(TransportError::unavailable(reason.clone()));
                }
            }
        }
        out
    }

    /// `PING` (in cluster mode, every primary). When it fails in cluster mode, a new cluster
    /// connection is made from the seed list: after a primary was killed and its replica
    /// promoted, redis 1.8's cluster connection was seen timing out every command for minutes
    /// (suite `clusters::redis_cluster_loses_nothing_when_the_stream_primary_dies_twice`).
    async fn probe(&self) -> Result<(), TransportError> {
        let mut conn = self.current();
        let pong: Result<String, RedisError> = redis::cmd("PING").query_async(&mut conn).await;
        let failed = match pong {
            Ok(_) => return Ok(()),
            Err(e) => TransportError::unavailable(format!("Redis PING failed: {e}")).with_source(e),
        };
        if matches!(conn, RedisConnection::Cluster(_)) {
            match connect_redis(
                &self.config.url,
                self.config.password.as_deref(),
                true,
                self.config.connect_timeout,
                self.config.response_timeout,
            )
            .await
            {
                Ok(fresh) => {
                    tracing::info!(
                        url = %crate::redact::url(&self.config.url),
                        "Redis Cluster: a new connection replaces the one that stopped answering"
                    );
                    *self.conn.lock().expect("poisoned") = fresh;
                }
                Err(e) => tracing::debug!(error = %e, "Redis Cluster: reconnection failed"),
            }
        }
        Err(failed)
    }
}

#[cfg(test)]
mod tests;
