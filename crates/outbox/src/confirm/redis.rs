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
use redis::aio::ConnectionManager;
use tokio_util::sync::CancellationToken;

use super::{
    ConfirmReport, Confirmation, ConfirmationSender, apply_with_retry, parse_confirmations,
};
use crate::Store;
use crate::consumer::redis::{ack, ensure_group, read_group};
use crate::error::{ConfigError, TransportError};
use crate::transport::redis::{classify, connect_manager};

/// Entry field holding a confirmation's JSON.
pub const FIELD_CONFIRMATION: &str = "confirmation";

/// `XADD`s confirmations to the reply stream and waits for the server's reply.
#[derive(Clone)]
pub struct RedisConfirmationSender {
    conn: ConnectionManager,
}

impl std::fmt::Debug for RedisConfirmationSender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisConfirmationSender")
            .finish_non_exhaustive()
    }
}

impl RedisConfirmationSender {
    /// A sender over `conn` (for example [`RedisTransport::connection`](crate::RedisTransport::connection)).
    pub fn new(conn: ConnectionManager) -> Self {
        RedisConfirmationSender { conn }
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
#[derive(Debug, Clone)]
pub struct RedisListenConfig {
    /// Server URL, `redis://…` or `rediss://…`. Required.
    pub url: String,
    /// Password, overriding one in the URL. Default none.
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
/// acknowledging after the commit, until `cancel`. Returns the totals.
///
/// # Errors
/// [`ConfigError`] naming `url` when Redis cannot be reached at start, or `stream` when the
/// group cannot be created. Later read errors are logged and retried.
pub async fn listen(
    config: RedisListenConfig,
    store: Arc<dyn Store>,
    cancel: CancellationToken,
) -> Result<ConfirmReport, ConfigError> {
    let mut conn = connect_manager(
        &config.url,
        config.password.as_deref(),
        Duration::from_secs(5),
        config.block + Duration::from_secs(5),
    )
    .await?;
    ensure_group(&mut conn, &config.stream, &config.group, "0")
        .await
        .map_err(|e| {
            ConfigError::new(
                "stream",
                format!(
                    "cannot create group {} on {}: {e}",
                    config.group, config.stream
                ),
            )
        })?;
    let backoff = crate::Backoff {
        base: Duration::from_millis(100),
        max: Duration::from_secs(5),
        ..Default::default()
    };
    let mut total = ConfirmReport::default();
    // Start with this consumer's own pending entries (an earlier run's, or a failed batch).
    let mut from_history = true;
    let mut failures = 0u32;
    loop {
        let id = if from_history { "0" } else { ">" };
        let block = (!from_history).then_some(config.block);
        let read = read_group(
            &mut conn,
            &config.stream,
            &config.group,
            &config.consumer,
            500,
            block,
            id,
        );
        let entries = tokio::select! {
            _ = cancel.cancelled() => return Ok(total),
            r = read => r,
        };
        let entries = match entries {
            Ok(e) => e,
            Err(e) => {
                failures += 1;
                tracing::warn!(error = %e, "reading confirmations failed; retrying");
                if e.code() == Some("NOGROUP") {
                    let _ = ensure_group(&mut conn, &config.stream, &config.group, "0").await;
                }
                tokio::select! {
                    _ = cancel.cancelled() => return Ok(total),
                    _ = tokio::time::sleep(backoff.delay(failures)) => continue,
                }
            }
        };
        if entries.is_empty() {
            from_history = false;
            continue;
        }
        let mut batch = Vec::with_capacity(entries.len());
        let mut ids = Vec::with_capacity(entries.len());
        for e in entries {
            ids.push(e.id.clone());
            let body = e.fields.as_ref().and_then(|f| {
                f.iter()
                    .find(|(k, _)| k == FIELD_CONFIRMATION.as_bytes())
                    .map(|(_, v)| v)
            });
            match body.map(|b| parse_confirmations(b)) {
                Some(Ok(cs)) => batch.extend(cs),
                Some(Err(err)) => {
                    tracing::warn!(error = %err, entry_id = %e.id, "malformed confirmation ignored")
                }
                None => {
                    tracing::warn!(entry_id = %e.id, "confirmation entry without a confirmation field (or trimmed) ignored")
                }
            }
        }
        let applied = if batch.is_empty() {
            Ok(ConfirmReport::default())
        } else {
            apply_with_retry(&store, &batch, 5).await
        };
        match applied {
            Ok(r) => {
                super::record(&mut total, r);
                if let Err(e) = ack(&mut conn, &config.stream, &config.group, &ids).await {
                    // Applied; read again later and recognised as duplicates.
                    tracing::warn!(error = %e, "acknowledging confirmations failed");
                }
                failures = 0;
            }
            Err(e) => {
                failures += 1;
                tracing::error!(error = %e, n = batch.len(), "confirmations not applied; reading them again later");
                from_history = true;
                tokio::select! {
                    _ = cancel.cancelled() => return Ok(total),
                    _ = tokio::time::sleep(backoff.delay(failures)) => {}
                }
            }
        }
    }
}
