//! Confirmations over Redis Streams: consumers `XADD` each confirmation to the reply stream (the
//! route's `reply_to`, a stream key) as one entry with the field `confirmation` holding the JSON
//! of [`Confirmation`]; the producer reads that stream with a consumer group (several producer
//! instances share the work), applies batches of up to 500 to its [`Store`] and `XACK`s them after
//! the commit.
//!
//! A batch whose application failed stays pending and is read again from this listener's own
//! pending list (`XREADGROUP … 0`) after a backoff; a listener instance that dies leaves its
//! pending confirmations to a restart under the same consumer name, and the producer's check-back
//! recovers any confirmation that never arrives. A malformed entry is logged and acknowledged.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use tokio_util::sync::CancellationToken;

use super::{ConfirmReport, Confirmation, ConfirmationSender};
use crate::Store;
use crate::consumer::redis::{RedisConsumerConfig, RedisSource};
use crate::consumer::source::RunOptions;
use crate::error::{ConfigError, TransportError};
use crate::transport::redis::{RedisConnection, classify};

/// Entry field holding a confirmation's JSON.
pub const FIELD_CONFIRMATION: &str = "confirmation";

/// `XADD`s confirmations to the reply stream and waits for the server's reply.
#[derive(Clone)]
pub struct RedisConfirmationSender {
    conn: RedisConnection,
}

impl std::fmt::Debug for RedisConfirmationSender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisConfirmationSender")
            .finish_non_exhaustive()
    }
}

impl RedisConfirmationSender {
    /// A sender over `conn` (for example [`RedisTransport::connection`](crate::RedisTransport::connection),
    /// or a [`ConnectionManager`](redis::aio::ConnectionManager)).
    pub fn new(conn: impl Into<RedisConnection>) -> Self {
        RedisConfirmationSender { conn: conn.into() }
    }
}

#[async_trait]
impl ConfirmationSender for RedisConfirmationSender {
    async fn send(&self, reply_to: &str, c: &Confirmation) -> Result<(), TransportError> {
        let body = serde_json::to_vec(c).expect("confirmation serializes");
        let mut conn = self.conn.clone();
        redis::cmd("XADD")
            .arg(reply_to)
            .arg("*")
            .arg(FIELD_CONFIRMATION)
            .arg(body)
            .query_async::<redis::Value>(&mut conn)
            .await
            .map(|_| ())
            .map_err(|e| {
                TransportError::new(
                    classify(&e),
                    format!("confirmation XADD to {reply_to} failed"),
                )
                .with_source(e)
            })
    }
}

/// Where [`listen`] reads confirmations.
#[derive(Clone, derive_more::Debug)]
pub struct RedisListenConfig {
    /// Server URL, `redis://…` or `rediss://…`. Required.
    #[debug("{:?}", crate::redact::url(url))]
    pub url: String,
    /// Password, overriding one in the URL. Default none.
    #[debug("{:?}", crate::redact::secret(password))]
    pub password: Option<String>,
    /// The reply stream (the routes' `reply_to`). Required.
    pub stream: String,
    /// Consumer group shared by the producer's instances. Default `outbox-confirmations`.
    pub group: String,
    /// This instance's name in the group; keep it stable across restarts. Default
    /// `outbox-<16 hex digits>`.
    pub consumer: String,
    /// How long one read waits for confirmations. Default 1 s.
    pub block: Duration,
}

impl RedisListenConfig {
    /// Settings for `stream` at `url` with the defaults.
    pub fn new(url: impl Into<String>, stream: impl Into<String>) -> Self {
        RedisListenConfig {
            url: url.into(),
            password: None,
            stream: stream.into(),
            group: "outbox-confirmations".into(),
            consumer: format!("outbox-{:016x}", rand::random::<u64>()),
            block: Duration::from_secs(1),
        }
    }
}

/// Read confirmations from `config.stream` and apply them to `store` in batches of up to 500,
/// acknowledging after the commit, until `cancel`: the generic runner over a
/// [`RedisSource`] reading the `confirmation` field, with a
/// [`ConfirmationHandler`](super::ConfirmationHandler). Returns the totals.
///
/// # Errors
/// [`ConfigError`] naming `url` when Redis cannot be reached at start, or `stream` when the
/// group cannot be created. Later read errors are logged and retried.
pub async fn listen(
    config: RedisListenConfig,
    store: Arc<dyn Store>,
    cancel: CancellationToken,
) -> Result<ConfirmReport, ConfigError> {
    let mut c = RedisConsumerConfig::new(config.url, config.stream, config.group);
    c.password = config.password;
    c.consumer = config.consumer;
    c.block = config.block;
    c.batch = 500;
    let source = RedisSource::new(c, Arc::default())?.with_payload_field(FIELD_CONFIRMATION);
    super::listen(source, store, &RunOptions::default(), &cancel).await
}
