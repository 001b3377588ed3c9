//! Inbox handlers shared by the consumer tests.

use std::sync::atomic::{AtomicUsize, Ordering};

use async_trait::async_trait;
use outbox::{HandlerError, InboundMessage};

/// A handler that runs `inner` and counts how many of its calls run at once, for the tests of a
/// consumer's parallel lanes: [`Concurrent::most`] is the most that ever ran together.
pub struct Concurrent<H> {
    inner: H,
    running: AtomicUsize,
    most: AtomicUsize,
}

impl<H> Concurrent<H> {
    /// `inner`, counted; nothing has run yet.
    pub fn new(inner: H) -> Self {
        Concurrent {
            inner,
            running: AtomicUsize::new(0),
            most: AtomicUsize::new(0),
        }
    }

    /// The handler it runs.
    pub fn inner(&self) -> &H {
        &self.inner
    }

    /// The most calls that ran at once so far.
    pub fn most(&self) -> usize {
        self.most.load(Ordering::SeqCst)
    }
}

#[async_trait]
impl<DB: sqlx::Database, H: outbox::Handler<DB>> outbox::Handler<DB> for Concurrent<H> {
    async fn handle(
        &self,
        conn: &mut DB::Connection,
        msg: &InboundMessage,
    ) -> Result<(), HandlerError> {
        let now = self.running.fetch_add(1, Ordering::SeqCst) + 1;
        self.most.fetch_max(now, Ordering::SeqCst);
        let result = self.inner.handle(conn, msg).await;
        self.running.fetch_sub(1, Ordering::SeqCst);
        result
    }
}
