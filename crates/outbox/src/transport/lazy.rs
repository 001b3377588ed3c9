//! [`LazyTransport`]: a transport whose client is built by its first successful probe, so a
//! process can start while its broker is down.
//!
//! A transport that connects eagerly (`NatsTransport::connect`, `RedisTransport::connect`, …)
//! fails when the broker cannot be reached; a daemon built from such a constructor exits, and a
//! restart during an outage crash-loops. Wrapped in a [`LazyTransport`], the connection is made by
//! [`Transport::probe`]: until it succeeds, every publish reports
//! [`Unavailable`](crate::TransportErrorKind::Unavailable) with the last connection error, so the
//! relay releases the messages without counting an attempt, pauses the transport and probes it
//! with backoff; the probe connects. Configuration errors (a malformed URL, an unknown setting)
//! are still found before: validate the settings before building the wrapper.

use std::sync::{Arc, Mutex, RwLock};

use async_trait::async_trait;
use futures::future::BoxFuture;

use super::{Outgoing, Transport};
use crate::error::TransportError;

/// Builds the inner transport; called by the probe until it succeeds.
pub type Connect =
    Box<dyn Fn() -> BoxFuture<'static, Result<Arc<dyn Transport>, TransportError>> + Send + Sync>;

/// A transport connected by its first successful probe (see the module docs).
///
/// # Examples
/// ```
/// use std::sync::Arc;
/// use outbox::transport::lazy::LazyTransport;
/// use outbox::transport::Transport;
/// use outbox::MemoryTransport;
///
/// # tokio_test_block_on(async {
/// // In production the closure connects a broker client (`NatsTransport::connect`, …) and maps
/// // its error to `TransportError::unavailable(..).with_source(e)`.
/// let lazy = LazyTransport::new("memory", || {
///     Box::pin(async { Ok(Arc::new(MemoryTransport::new()) as Arc<dyn Transport>) })
/// });
/// assert!(!lazy.is_connected());
/// lazy.probe().await.unwrap();
/// assert!(lazy.is_connected());
/// # });
/// # fn tokio_test_block_on<F: std::future::Future>(f: F) -> F::Output {
/// #     tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(f)
/// # }
/// ```
pub struct LazyTransport {
    name: String,
    connect: Connect,
    inner: RwLock<Option<Arc<dyn Transport>>>,
    connecting: tokio::sync::Mutex<()>,
    last_error: Mutex<Option<String>>,
}

impl std::fmt::Debug for LazyTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LazyTransport")
            .field("name", &self.name)
            .field("connected", &self.is_connected())
            .finish_non_exhaustive()
    }
}

impl LazyTransport {
    /// A transport named `name` (for logs and metrics, e.g. `"nats"`) whose client `connect`
    /// builds. Nothing is connected yet: call [`Transport::probe`] (the relay does when a publish
    /// found the transport unavailable).
    pub fn new<F>(name: impl Into<String>, connect: F) -> LazyTransport
    where
        F: Fn() -> BoxFuture<'static, Result<Arc<dyn Transport>, TransportError>>
            + Send
            + Sync
            + 'static,
    {
        LazyTransport {
            name: name.into(),
            connect: Box::new(connect),
            inner: RwLock::new(None),
            connecting: tokio::sync::Mutex::new(()),
            last_error: Mutex::new(None),
        }
    }

    /// Whether the client has been built.
    pub fn is_connected(&self) -> bool {
        self.inner.read().expect("lazy transport lock").is_some()
    }

    /// The report of the last failed connection (message and source chain), if any.
    pub fn last_error(&self) -> Option<String> {
        self.last_error.lock().expect("lazy transport lock").clone()
    }

    fn current(&self) -> Option<Arc<dyn Transport>> {
        self.inner.read().expect("lazy transport lock").clone()
    }
}

#[async_trait]
impl Transport for LazyTransport {
    fn name(&self) -> &str {
        &self.name
    }

    async fn publish(&self, batch: &[Outgoing<'_>]) -> Vec<Result<(), TransportError>> {
        if let Some(t) = self.current() {
            return t.publish(batch).await;
        }
        let why = self
            .last_error()
            .unwrap_or_else(|| "not probed yet".to_owned());
        batch
            .iter()
            .map(|_| {
                Err(TransportError::unavailable(format!(
                    "{} is not connected: {why}",
                    self.name
                )))
            })
            .collect()
    }

    /// Connect when not connected yet (one connection attempt at a time), otherwise probe the
    /// client.
    ///
    /// # Errors
    /// The connection error (kind [`Unavailable`](crate::TransportErrorKind::Unavailable) as the
    /// builder reports it), or the client's probe error.
    async fn probe(&self) -> Result<(), TransportError> {
        if let Some(t) = self.current() {
            return t.probe().await;
        }
        let _one = self.connecting.lock().await;
        if let Some(t) = self.current() {
            return t.probe().await;
        }
        match (self.connect)().await {
            Ok(t) => {
                *self.inner.write().expect("lazy transport lock") = Some(t);
                *self.last_error.lock().expect("lazy transport lock") = None;
                tracing::info!(transport = %self.name, "transport connected");
                Ok(())
            }
            Err(e) => {
                *self.last_error.lock().expect("lazy transport lock") = Some(e.report());
                Err(e)
            }
        }
    }
}
