//! Fault injection: a transport that hangs after the broker's ack, relay hooks that pause the
//! first batch at one step, a TCP proxy that cuts, stalls or drops replies on command.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use outbox::transport::{Outgoing, Transport};
use outbox::{Message, RelayHooks, TransportError};
use tokio::sync::Notify;

/// Where [`PauseFirst`] pauses a relay's first batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PauseAt {
    /// [`RelayHooks::before_publish`]: after the batch was read, before it is published (a
    /// relay that "dies" holding rows it read).
    Publish,
    /// [`RelayHooks::before_complete`]: after the broker acknowledged, before the outcome is
    /// recorded (a relay that "dies" between the ack and SENT).
    Complete,
}

/// Relay hooks that pause the first batch to reach one step ([`PauseAt`]): they notify
/// [`entered`](Self::entered) and wait for [`resume`](Self::resume) (forever, when the test
/// never resumes it). Later batches pass. Both are [`Notify`]s, so a notification sent before
/// the other side waits is kept.
pub struct PauseFirst {
    at: PauseAt,
    armed: AtomicBool,
    /// Notified when the first batch reached the step and paused.
    pub entered: Notify,
    /// Notify once to let the paused batch go on.
    pub resume: Notify,
}

impl PauseFirst {
    /// Hooks pausing the first batch at `at`.
    pub fn new(at: PauseAt) -> Arc<PauseFirst> {
        Arc::new(PauseFirst {
            at,
            armed: AtomicBool::new(true),
            entered: Notify::new(),
            resume: Notify::new(),
        })
    }

    async fn reached(&self, at: PauseAt) {
        if at == self.at && self.armed.swap(false, Ordering::AcqRel) {
            self.entered.notify_one();
            self.resume.notified().await;
        }
    }
}

#[async_trait]
impl RelayHooks for PauseFirst {
    async fn before_publish(&self, _messages: &[Message]) {
        self.reached(PauseAt::Publish).await;
    }

    async fn before_complete(&self, _messages: &[Message]) {
        self.reached(PauseAt::Complete).await;
    }
}

/// A transport that publishes through `inner` and, once the broker acknowledged, signals
/// [`AckThenHang::acked`] and never returns: the relay looks like it died between the broker's ack
/// and recording SENT. Only the first `hang_batches` batches hang; later ones pass through.
pub struct AckThenHang {
    inner: Arc<dyn Transport>,
    hang_batches: Mutex<usize>,
    /// Notified (permit stored) when a hung batch was acknowledged by the broker.
    pub acked: Notify,
}

impl AckThenHang {
    /// Wrap `inner`; the first `hang_batches` batches hang after their ack.
    pub fn new(inner: Arc<dyn Transport>, hang_batches: usize) -> Self {
        AckThenHang {
            inner,
            hang_batches: Mutex::new(hang_batches),
            acked: Notify::new(),
        }
    }

    /// Wait until a hung batch was acknowledged by the broker (the moment to kill the relay).
    ///
    /// # Panics
    /// When no batch was acknowledged within 10 s.
    pub async fn wait_acked(&self) {
        let timeout = std::time::Duration::from_secs(10);
        crate::within("the broker ack", timeout, self.acked.notified()).await;
    }
}

#[async_trait]
impl Transport for AckThenHang {
    fn name(&self) -> &str {
        "ack-then-hang"
    }

    async fn publish(&self, batch: &[Outgoing<'_>]) -> Vec<Result<(), TransportError>> {
        let results = self.inner.publish(batch).await;
        let hang = {
            let mut n = self.hang_batches.lock().expect("poisoned");
            if *n > 0 {
                *n -= 1;
                true
            } else {
                false
            }
        };
        if hang {
            assert!(results.iter().all(Result::is_ok), "inner publish failed");
            self.acked.notify_one();
            std::future::pending::<()>().await;
        }
        results
    }

    async fn probe(&self) -> Result<(), TransportError> {
        self.inner.probe().await
    }
}

/// Copy `from` to `to` chunk by chunk until end of stream or until `blocked` is set (checked
/// after every read); a chunk read while `discard` is set is dropped instead of written.
async fn pump(
    from: &mut (impl tokio::io::AsyncRead + Unpin),
    to: &mut (impl tokio::io::AsyncWrite + Unpin),
    blocked: &AtomicBool,
    discard: Option<&AtomicBool>,
    stalled: &AtomicBool,
    delay_ms: &AtomicU64,
) -> std::io::Result<()> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = from.read(&mut buf).await?;
        if n == 0 || blocked.load(Ordering::SeqCst) {
            return Ok(());
        }
        let delay = delay_ms.load(Ordering::SeqCst);
        if delay > 0 {
            tokio::time::sleep(std::time::Duration::from_millis(delay)).await;
        }
        if !discard.is_some_and(|d| d.load(Ordering::SeqCst)) && !stalled.load(Ordering::SeqCst) {
            to.write_all(&buf[..n]).await?;
        }
    }
}

/// Per open connection of a [`FaultProxy`]: the local port of its upstream socket and its stall
/// flag.
type Stalls = Arc<std::sync::Mutex<Vec<(u16, Arc<AtomicBool>)>>>;

/// A TCP proxy that forwards to `upstream` and, while blocked, cuts every connection and refuses
/// new ones (accepts and closes them at once).
pub struct FaultProxy {
    /// Where it listens.
    pub addr: SocketAddr,
    blocked: Arc<AtomicBool>,
    replies_dropped: Arc<AtomicBool>,
    delay_ms: Arc<AtomicU64>,
    cut: Arc<tokio::sync::watch::Sender<u64>>,
    shutdown: tokio_util::sync::CancellationToken,
    /// Per open connection: the local port of its upstream socket and its stall flag.
    stalls: Stalls,
}

impl FaultProxy {
    /// Start on `127.0.0.1:0`, forwarding to `upstream` (`host:port`).
    ///
    /// # Panics
    /// When it cannot bind.
    pub async fn start(upstream: String) -> FaultProxy {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind proxy");
        let addr = listener.local_addr().expect("local addr");
        let blocked = Arc::new(AtomicBool::new(false));
        let replies_dropped = Arc::new(AtomicBool::new(false));
        let delay_ms = Arc::new(AtomicU64::new(0));
        let (cut, _) = tokio::sync::watch::channel(0u64);
        let cut = Arc::new(cut);
        let shutdown = tokio_util::sync::CancellationToken::new();
        let (b, c, s) = (blocked.clone(), cut.clone(), shutdown.clone());
        let dropped = replies_dropped.clone();
        let delay = delay_ms.clone();
        let stalls: Stalls = Arc::default();
        let all_stalls = stalls.clone();
        tokio::spawn(async move {
            loop {
                let (mut client, _) = tokio::select! {
                    _ = s.cancelled() => return,
                    a = listener.accept() => match a { Ok(a) => a, Err(_) => continue },
                };
                if b.load(Ordering::SeqCst) {
                    drop(client);
                    continue;
                }
                let mut cut_rx = c.subscribe();
                let upstream = upstream.clone();
                let s = s.clone();
                let dropped = dropped.clone();
                let delay = delay.clone();
                let blocked = b.clone();
                let all_stalls = all_stalls.clone();
                tokio::spawn(async move {
                    let Ok(server) = tokio::net::TcpStream::connect(&upstream).await else {
                        return;
                    };
                    let stalled = Arc::new(AtomicBool::new(false));
                    if let Ok(local) = server.local_addr() {
                        let mut all = all_stalls.lock().expect("stalls");
                        all.retain(|(_, s)| Arc::strong_count(s) > 1);
                        all.push((local.port(), stalled.clone()));
                    }
                    let (mut client_rx, mut client_tx) = client.split();
                    let (mut server_rx, mut server_tx) = server.into_split();
                    // Both directions check the flag on every chunk, so that nothing passes
                    // once `set_blocked(true)` has returned, even before this task has seen
                    // the cut (a test that publishes right after blocking must not race it).
                    let up = pump(
                        &mut client_rx,
                        &mut server_tx,
                        &blocked,
                        None,
                        &stalled,
                        &delay,
                    );
                    // Server to client, discarding while replies are dropped.
                    let down = pump(
                        &mut server_rx,
                        &mut client_tx,
                        &blocked,
                        Some(&dropped),
                        &stalled,
                        &delay,
                    );
                    tokio::select! {
                        _ = s.cancelled() => {}
                        _ = cut_rx.changed() => {}
                        _ = up => {}
                        _ = down => {}
                    }
                });
            }
        });
        FaultProxy {
            addr,
            blocked,
            replies_dropped,
            delay_ms,
            cut,
            shutdown,
            stalls,
        }
    }

    /// Make one open connection half-open: the one whose socket towards the upstream has local
    /// port `upstream_port` (what the server sees as the client's port, e.g. PostgreSQL's
    /// `pg_stat_activity.client_port`). From now on nothing passes in either direction and
    /// nothing is closed, as when a NAT or firewall forgets a connection; other connections are
    /// unaffected. Returns whether such a connection was open.
    pub fn stall_connection(&self, upstream_port: u16) -> bool {
        let all = self.stalls.lock().expect("stalls");
        let mut found = false;
        for (port, stalled) in all.iter() {
            if *port == upstream_port {
                stalled.store(true, Ordering::SeqCst);
                found = true;
            }
        }
        found
    }

    /// Make the `n`-th open connection (modulo how many are open) half-open, as
    /// [`FaultProxy::stall_connection`] does; returns the upstream local port of the connection
    /// stalled, or `None` when none is open.
    pub fn stall_nth(&self, n: usize) -> Option<u16> {
        let mut all = self.stalls.lock().expect("stalls");
        all.retain(|(_, s)| Arc::strong_count(s) > 1);
        let open: Vec<&(u16, Arc<AtomicBool>)> = all
            .iter()
            .filter(|(_, s)| !s.load(Ordering::SeqCst))
            .collect();
        if open.is_empty() {
            return None;
        }
        let (port, stalled) = open[n % open.len()];
        stalled.store(true, Ordering::SeqCst);
        Some(*port)
    }

    /// Delay every chunk forwarded, in both directions, by `delay` (zero: none), as a slow
    /// network or an overloaded server would.
    pub fn set_delay(&self, delay: std::time::Duration) {
        self.delay_ms.store(
            u64::try_from(delay.as_millis()).unwrap_or(u64::MAX),
            Ordering::SeqCst,
        );
    }

    /// While set, forward client → server but discard everything the server sends back (the
    /// client's requests arrive, their answers are lost, as behind a one-way network fault);
    /// [`FaultProxy::set_blocked`] then cuts the connections.
    pub fn set_replies_dropped(&self, dropped: bool) {
        self.replies_dropped.store(dropped, Ordering::SeqCst);
    }

    /// Block (cut every open connection, refuse new ones) or unblock.
    pub fn set_blocked(&self, blocked: bool) {
        self.blocked.store(blocked, Ordering::SeqCst);
        if blocked {
            self.cut.send_modify(|n| *n += 1);
        }
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

/// The `host:port` of a `nats://host:port` URL.
pub fn host_port(url: &str) -> String {
    url.split("://")
        .nth(1)
        .unwrap_or(url)
        .trim_end_matches('/')
        .to_owned()
}
