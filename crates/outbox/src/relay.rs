//! The relay: claims committed outbox rows and publishes them, at least once, with broker
//! acknowledgement.
//!
//! # Loop
//! ```text
//! wake-up (in-process Store::wake | PostgreSQL NOTIFY | poll timer | next due time)
//!   └─▶ claim a batch under a lease (fencing token) ─▶ publish, pipelined per transport
//!         ─▶ one fenced completion statement: SENT / PENDING + backoff / FAILED / released
//! maintenance: reap expired leases (any relay), probe unavailable transports with backoff
//! ```
//! A full batch claims again at once; an empty one sleeps until the earliest `available_at`,
//! capped by `poll_interval`. Up to `in_flight_batches` batches are published concurrently.
//!
//! # Failure handling
//! - `Retryable` publish error: PENDING again after [`Backoff`] on the database clock, or FAILED
//!   ("attempts exhausted") after `max_attempts`.
//! - `Permanent` error or no route: FAILED at once with the reason (shared case C07).
//! - `Unavailable`: the message is released without counting the attempt, the transport is
//!   marked down, and a prober checks it with backoff; while every transport is down the relay
//!   does not claim at all (shared case C05).
//! - A completion that fails (deadlock, lost connection) is retried with backoff until the lease
//!   runs out; the relay loop never dies of it (shared case C21). After that the lease expires and
//!   the rows are published again (same message id; the consumer's inbox absorbs the copy).
//! - Before publishing, a batch whose lease cannot outlast the publish timeout any more (the
//!   process was paused) is not published (shared case C15); its rows come back by lease expiry.
//!
//! # Shutdown
//! Cancelling the token stops claiming; batches in flight finish (bounded by `publish_timeout`)
//! and record their outcome, up to `shutdown_timeout`; whatever is still in flight then is
//! dropped and its lease expires. No row stays SENDING longer than its lease.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::{Notify, Semaphore};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::error::{ConfigError, StoreError, StoreErrorKind, TransportError, TransportErrorKind};
use crate::retry::Backoff;
use crate::store::{Claim, ClaimRequest, Completion, Outcome, Store};
use crate::transport::{Outgoing, Router, Transport};

/// Relay settings. Every field has a default ([`RelayConfig::default`]); [`RelayConfig::validate`]
/// names the first bad field.
#[derive(Debug, Clone)]
pub struct RelayConfig {
    /// Name stored as `lease_owner`. Default `relay-<pid>-<random>`.
    pub name: String,
    /// Rows per claim, 1 to 10,000. Default 500.
    pub batch_size: u32,
    /// Claim lease, at least 3 × `publish_timeout`. Default 30 s.
    pub lease: Duration,
    /// Longest time one batch may spend publishing. Default 10 s.
    pub publish_timeout: Duration,
    /// Longest idle sleep between claims (safety net behind the wake-ups). Default 1 s.
    pub poll_interval: Duration,
    /// Publish attempts before a message is dead-lettered, unless the message overrides it.
    /// Default 16.
    pub max_attempts: u32,
    /// Backoff between attempts of one message. Default [`Backoff::default`] (1 s, ×2, ≤ 5 min).
    pub backoff: Backoff,
    /// Backoff between probes of an unavailable transport and between retries of failed
    /// database calls. Default 200 ms, ×2, ≤ 10 s.
    pub probe_backoff: Backoff,
    /// How often expired leases are reaped. Default 5 s.
    pub reap_interval: Duration,
    /// Batches published concurrently. Default 2.
    pub in_flight_batches: usize,
    /// How long shutdown waits for batches in flight. Default 15 s.
    pub shutdown_timeout: Duration,
    /// Check-backs of an unconfirmed message before it goes to FAILED as `unconfirmed`.
    /// Default 3.
    pub max_check_backs: u32,
    /// How long CONFIRMED and REJECTED rows (and SENT rows that await no confirmation) are kept
    /// before the relay deletes them, in bounded batches. `None` keeps them. Default 7 days.
    pub retention: Option<Duration>,
}

impl Default for RelayConfig {
    fn default() -> Self {
        RelayConfig {
            name: format!("relay-{}-{:04x}", std::process::id(), rand::random::<u16>()),
            batch_size: 500,
            lease: Duration::from_secs(30),
            publish_timeout: Duration::from_secs(10),
            poll_interval: Duration::from_secs(1),
            max_attempts: 16,
            backoff: Backoff::default(),
            probe_backoff: Backoff {
                base: Duration::from_millis(200),
                factor: 2.0,
                max: Duration::from_secs(10),
                jitter: 0.2,
            },
            reap_interval: Duration::from_secs(5),
            in_flight_batches: 2,
            shutdown_timeout: Duration::from_secs(15),
            max_check_backs: 3,
            retention: Some(Duration::from_secs(7 * 24 * 3600)),
        }
    }
}

impl RelayConfig {
    /// Check every field; the error names the first bad one as `relay.<field>`.
    ///
    /// # Errors
    /// [`ConfigError`] naming the field and the rule it breaks.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let f = |n: &str, r: &str| Err(ConfigError::new(format!("relay.{n}"), r));
        if self.name.is_empty() {
            return f("name", "must not be empty");
        }
        if !(1..=10_000).contains(&self.batch_size) {
            return f("batch_size", "must be 1 to 10000");
        }
        if self.publish_timeout.is_zero() {
            return f("publish_timeout", "must be greater than zero");
        }
        if self.lease < self.publish_timeout * 3 {
            return f(
                "lease",
                "must be at least 3 x publish_timeout so a slow publish does not lose its lease",
            );
        }
        if self.poll_interval.is_zero() {
            return f("poll_interval", "must be greater than zero");
        }
        if self.max_attempts == 0 {
            return f("max_attempts", "must be at least 1");
        }
        if self.backoff.factor < 1.0 || !(0.0..=1.0).contains(&self.backoff.jitter) {
            return f("backoff", "factor must be >= 1 and jitter within 0..=1");
        }
        if self.reap_interval.is_zero() {
            return f("reap_interval", "must be greater than zero");
        }
        if self.in_flight_batches == 0 {
            return f("in_flight_batches", "must be at least 1");
        }
        Ok(())
    }
}

/// Counters of one relay, readable while it runs ([`Relay::metrics`]).
#[derive(Debug, Default)]
pub struct RelayMetrics {
    /// Rows claimed.
    pub claimed: AtomicU64,
    /// Messages the broker acknowledged and recorded SENT.
    pub sent: AtomicU64,
    /// Messages rescheduled after a retryable error.
    pub retried: AtomicU64,
    /// Messages dead-lettered (FAILED).
    pub failed: AtomicU64,
    /// Messages released without counting the attempt (transport down, shutdown).
    pub released: AtomicU64,
    /// Completion rows that no longer matched their lease token (the lease was lost).
    pub lost_leases: AtomicU64,
    /// Batches not published because their lease was about to expire.
    pub stale_batches: AtomicU64,
    /// Rows returned to PENDING (or FAILED) by this relay's reaper.
    pub reaped: AtomicU64,
    /// Unconfirmed SENT rows past their deadline sent back to PENDING (or FAILED `unconfirmed`).
    pub checked_back: AtomicU64,
    /// Finished rows deleted by retention.
    pub purged: AtomicU64,
    /// Failed database calls (claim, completion, reap), all retried.
    pub store_errors: AtomicU64,
    /// Times a transport was found unavailable.
    pub outages: AtomicU64,
}

/// A point-in-time copy of [`RelayMetrics`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MetricsSnapshot {
    /// See [`RelayMetrics::claimed`].
    pub claimed: u64,
    /// See [`RelayMetrics::sent`].
    pub sent: u64,
    /// See [`RelayMetrics::retried`].
    pub retried: u64,
    /// See [`RelayMetrics::failed`].
    pub failed: u64,
    /// See [`RelayMetrics::released`].
    pub released: u64,
    /// See [`RelayMetrics::lost_leases`].
    pub lost_leases: u64,
    /// See [`RelayMetrics::stale_batches`].
    pub stale_batches: u64,
    /// See [`RelayMetrics::reaped`].
    pub reaped: u64,
    /// See [`RelayMetrics::checked_back`].
    pub checked_back: u64,
    /// See [`RelayMetrics::purged`].
    pub purged: u64,
    /// See [`RelayMetrics::store_errors`].
    pub store_errors: u64,
    /// See [`RelayMetrics::outages`].
    pub outages: u64,
}

impl RelayMetrics {
    /// Read every counter.
    pub fn snapshot(&self) -> MetricsSnapshot {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        MetricsSnapshot {
            claimed: g(&self.claimed),
            sent: g(&self.sent),
            retried: g(&self.retried),
            failed: g(&self.failed),
            released: g(&self.released),
            lost_leases: g(&self.lost_leases),
            stale_batches: g(&self.stale_batches),
            reaped: g(&self.reaped),
            checked_back: g(&self.checked_back),
            purged: g(&self.purged),
            store_errors: g(&self.store_errors),
            outages: g(&self.outages),
        }
    }
}

fn add(a: &AtomicU64, n: u64) {
    a.fetch_add(n, Ordering::Relaxed);
}

/// Test and instrumentation hooks, called at fixed points of the relay loop.
#[async_trait]
pub trait RelayHooks: Send + Sync + 'static {
    /// After a claim committed and before anything is published (shared case C15 pauses here).
    async fn after_claim(&self, claim: &Claim) {
        let _ = claim;
    }
}

struct Health {
    down: AtomicBool,
}

struct Inner {
    store: Arc<dyn Store>,
    router: Router,
    transports: Vec<Arc<dyn Transport>>,
    health: Vec<Health>,
    config: RelayConfig,
    metrics: Arc<RelayMetrics>,
    hooks: Option<Arc<dyn RelayHooks>>,
    health_changed: Notify,
}

/// The relay (see the module docs). Build with [`Relay::builder`], run with [`Relay::run`] or
/// [`Relay::spawn`].
///
/// # Examples
/// ```no_run
/// # async fn example() -> Result<(), Box<dyn std::error::Error>> {
/// use std::sync::Arc;
/// use outbox::{Relay, Router, SqliteStore, StoreOptions, WebhookConfig, WebhookTransport};
///
/// let store = SqliteStore::connect("sqlite://orders.db", StoreOptions::default()).await?;
/// let webhook = Arc::new(WebhookTransport::new(WebhookConfig::new("http://127.0.0.1:8080/events"))?);
/// let relay = Relay::builder(Arc::new(store)).router(Router::single(webhook)).build()?;
/// let handle = relay.spawn();
/// // ... on shutdown:
/// handle.shutdown().await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Relay {
    inner: Arc<Inner>,
}

/// Builder of a [`Relay`].
pub struct RelayBuilder {
    store: Arc<dyn Store>,
    router: Router,
    config: RelayConfig,
    hooks: Option<Arc<dyn RelayHooks>>,
}

impl RelayBuilder {
    /// Set the routes (required: at least one).
    pub fn router(mut self, router: Router) -> Self {
        self.router = router;
        self
    }

    /// Set the configuration (default [`RelayConfig::default`]).
    pub fn config(mut self, config: RelayConfig) -> Self {
        self.config = config;
        self
    }

    /// Install hooks.
    pub fn hooks(mut self, hooks: Arc<dyn RelayHooks>) -> Self {
        self.hooks = Some(hooks);
        self
    }

    /// Validate and build.
    ///
    /// # Errors
    /// [`ConfigError`] for an invalid configuration field or an empty router (`routes`).
    pub fn build(self) -> Result<Relay, ConfigError> {
        self.config.validate()?;
        if self.router.routes().is_empty() {
            return Err(ConfigError::new("routes", "at least one route is needed"));
        }
        let transports = self.router.transports();
        let health = transports
            .iter()
            .map(|_| Health {
                down: AtomicBool::new(false),
            })
            .collect();
        Ok(Relay {
            inner: Arc::new(Inner {
                store: self.store,
                router: self.router,
                transports,
                health,
                config: self.config,
                metrics: Arc::new(RelayMetrics::default()),
                hooks: self.hooks,
                health_changed: Notify::new(),
            }),
        })
    }
}

/// A relay running on its own task ([`Relay::spawn`]).
pub struct RelayHandle {
    cancel: CancellationToken,
    join: tokio::task::JoinHandle<Result<(), StoreError>>,
    metrics: Arc<RelayMetrics>,
}

impl RelayHandle {
    /// Stop gracefully (see the module docs) and wait for the relay to finish.
    ///
    /// # Errors
    /// The start-up error the relay stopped with, if any.
    pub async fn shutdown(self) -> Result<(), StoreError> {
        self.cancel.cancel();
        self.join.await.unwrap_or(Ok(()))
    }

    /// Simulate a crash: abort the task at whatever point it is, leaving claimed rows SENDING
    /// until their lease expires. For tests and the demo.
    pub fn abort(self) {
        self.join.abort();
    }

    /// The relay's counters.
    pub fn metrics(&self) -> &Arc<RelayMetrics> {
        &self.metrics
    }

    /// Whether the relay task has ended.
    pub fn is_finished(&self) -> bool {
        self.join.is_finished()
    }
}

impl Relay {
    /// A builder for a relay over `store`.
    pub fn builder(store: Arc<dyn Store>) -> RelayBuilder {
        RelayBuilder {
            store,
            router: Router::new(),
            config: RelayConfig::default(),
            hooks: None,
        }
    }

    /// The relay's counters.
    pub fn metrics(&self) -> &Arc<RelayMetrics> {
        &self.inner.metrics
    }

    /// The configuration.
    pub fn config(&self) -> &RelayConfig {
        &self.inner.config
    }

    /// Run on a new task until [`RelayHandle::shutdown`].
    pub fn spawn(&self) -> RelayHandle {
        let cancel = CancellationToken::new();
        let relay = self.clone();
        let c = cancel.clone();
        RelayHandle {
            cancel,
            join: tokio::spawn(async move { relay.run(c).await }),
            metrics: self.inner.metrics.clone(),
        }
    }

    /// Run until `cancel` is cancelled, then shut down gracefully.
    ///
    /// # Errors
    /// Only at start-up: [`StoreError::MissingTable`] (run `outbox migrate`) or a configuration
    /// error of the store. Later errors are logged, counted and retried.
    ///
    /// # Cancel safety
    /// Dropping the future instead of cancelling the token is a crash: claimed rows stay
    /// SENDING until their lease expires, then any relay publishes them again.
    pub async fn run(&self, cancel: CancellationToken) -> Result<(), StoreError> {
        let inner = &self.inner;
        if let Err(e) = inner.store.next_due_in().await {
            if matches!(
                e.kind(),
                StoreErrorKind::MissingTable | StoreErrorKind::Config
            ) {
                return Err(e);
            }
            tracing::warn!(error = %e, "store not ready at start; will retry");
        }
        let background = cancel.child_token();
        // A relay future dropped mid-run (a crash, `RelayHandle::abort`) must not leave its
        // reaper and listener running: the guard cancels them when `run` is dropped.
        let _stop_background_on_drop = background.clone().drop_guard();
        let _listener = inner.store.spawn_listener(background.clone());
        let reaper = tokio::spawn(reap_loop(self.clone(), background.clone()));
        let mut batches: JoinSet<()> = JoinSet::new();
        let permits = Arc::new(Semaphore::new(inner.config.in_flight_batches));
        let waker = inner.store.waker();
        let mut claim_failures = 0u32;
        tracing::info!(relay = %inner.config.name, store = inner.store.backend(), table = inner.store.table(), "relay started");

        while !cancel.is_cancelled() {
            while batches.try_join_next().is_some() {}
            if inner.health.iter().all(|h| h.down.load(Ordering::Acquire)) {
                tokio::select! {
                    _ = cancel.cancelled() => break,
                    _ = inner.health_changed.notified() => continue,
                    _ = tokio::time::sleep(inner.config.poll_interval) => continue,
                }
            }
            let permit = tokio::select! {
                _ = cancel.cancelled() => break,
                p = permits.clone().acquire_owned() => p.expect("semaphore never closed"),
            };
            let req = ClaimRequest {
                owner: inner.config.name.clone(),
                batch_size: inner.config.batch_size,
                lease: inner.config.lease,
            };
            let claimed_at = Instant::now();
            let claim = match inner.store.claim(&req).await {
                Ok(c) => {
                    claim_failures = 0;
                    c
                }
                Err(e) => {
                    claim_failures += 1;
                    add(&inner.metrics.store_errors, 1);
                    tracing::warn!(error = %e, failures = claim_failures, "claim failed; backing off");
                    drop(permit);
                    tokio::select! {
                        _ = cancel.cancelled() => break,
                        _ = tokio::time::sleep(inner.config.probe_backoff.delay(claim_failures)) => continue,
                    }
                }
            };
            let n = claim.messages.len() + claim.malformed.len();
            if n > 0 {
                add(&inner.metrics.claimed, n as u64);
                let relay = self.clone();
                let background = background.clone();
                batches.spawn(async move {
                    relay.process(claim, claimed_at, &background).await;
                    drop(permit);
                });
            } else {
                drop(permit);
            }
            if n == inner.config.batch_size as usize {
                continue;
            }
            // Idle: sleep until woken, until the next row is due, or for poll_interval.
            let mut sleep_for = inner.config.poll_interval;
            if n == 0 {
                match inner.store.next_due_in().await {
                    Ok(Some(d)) => sleep_for = sleep_for.min(d),
                    Ok(None) => {}
                    Err(e) => tracing::debug!(error = %e, "next_due_in failed"),
                }
                if sleep_for.is_zero() {
                    // Due rows exist but another relay holds them or a batch is in flight; yield briefly.
                    sleep_for = Duration::from_millis(5);
                }
            }
            tokio::select! {
                _ = cancel.cancelled() => break,
                _ = waker.notified() => {}
                _ = tokio::time::sleep(sleep_for) => {}
            }
        }

        // Phase 1: stop claiming, let batches in flight finish. Phase 2: drop the rest.
        tracing::info!(relay = %inner.config.name, in_flight = batches.len(), "relay stopping");
        let drained = tokio::time::timeout(inner.config.shutdown_timeout, async {
            while batches.join_next().await.is_some() {}
        })
        .await;
        if drained.is_err() {
            tracing::warn!(
                "shutdown timeout: abandoning batches in flight; their leases will expire"
            );
            batches.abort_all();
        }
        background.cancel();
        let _ = reaper.await;
        tracing::info!(relay = %inner.config.name, "relay stopped");
        Ok(())
    }

    async fn process(&self, claim: Claim, claimed_at: Instant, background: &CancellationToken) {
        let inner = &self.inner;
        let cfg = &inner.config;
        if let Some(h) = &inner.hooks {
            h.after_claim(&claim).await;
        }
        let mut outcomes: Vec<Option<Outcome>> = vec![None; claim.messages.len()];
        if claimed_at.elapsed() + cfg.publish_timeout >= cfg.lease {
            // Paused or starved past the point where the publish could finish inside the lease.
            add(&inner.metrics.stale_batches, 1);
            tracing::warn!(
                rows = claim.messages.len(),
                "lease nearly expired before publishing; leaving the batch to lease expiry"
            );
            return;
        }
        let mut messages = claim.messages;
        for m in &mut messages {
            if m.max_attempts == 0 {
                m.max_attempts = cfg.max_attempts;
            }
        }
        // Group by transport; remember which route asks for a confirmation.
        let mut groups: Vec<Vec<(usize, String)>> = vec![Vec::new(); inner.transports.len()];
        let mut confirm_within: Vec<Option<Duration>> = vec![None; messages.len()];
        for (i, m) in messages.iter_mut().enumerate() {
            match inner.router.resolve(&m.topic) {
                Some((route, dest)) => {
                    if let Some(policy) = &inner.router.routes()[route].confirm {
                        m.headers.insert(
                            crate::confirm::HEADER_REPLY_TO.into(),
                            policy.reply_to.clone(),
                        );
                        confirm_within[i] = Some(policy.timeout);
                    }
                    let t = &inner.router.routes()[route].transport;
                    let ti = inner
                        .transports
                        .iter()
                        .position(|x| Arc::ptr_eq(x, t))
                        .expect("transport listed");
                    if inner.health[ti].down.load(Ordering::Acquire) {
                        outcomes[i] = Some(Outcome::Release {
                            delay: cfg.probe_backoff.max.min(Duration::from_secs(1)),
                        });
                    } else {
                        groups[ti].push((i, dest));
                    }
                }
                None => {
                    outcomes[i] = Some(Outcome::Failed {
                        reason: format!("no route for topic {:?}", m.topic),
                    });
                }
            }
        }
        let publishes = groups
            .iter()
            .enumerate()
            .filter(|(_, g)| !g.is_empty())
            .map(|(ti, g)| {
                let batch: Vec<Outgoing<'_>> = g
                    .iter()
                    .map(|(i, dest)| Outgoing {
                        message: &messages[*i],
                        destination: dest.as_str(),
                    })
                    .collect();
                let transport = inner.transports[ti].clone();
                async move {
                    let results =
                        match tokio::time::timeout(cfg.publish_timeout, transport.publish(&batch))
                            .await
                        {
                            Ok(r) if r.len() == batch.len() => r,
                            Ok(r) => {
                                let msg = format!(
                                    "transport {} returned {} results for {} messages",
                                    transport.name(),
                                    r.len(),
                                    batch.len()
                                );
                                batch
                                    .iter()
                                    .map(|_| Err(TransportError::retryable(msg.clone())))
                                    .collect()
                            }
                            Err(_) => {
                                // A timeout while the broker is unreachable is an outage, not a
                                // failed attempt: ask the transport which it was.
                                let reason =
                                    format!("publish timed out after {:?}", cfg.publish_timeout);
                                let kind = match transport.probe().await {
                                    Err(e) if e.kind() == TransportErrorKind::Unavailable => {
                                        TransportErrorKind::Unavailable
                                    }
                                    _ => TransportErrorKind::Retryable,
                                };
                                batch
                                    .iter()
                                    .map(|_| Err(TransportError::new(kind, reason.clone())))
                                    .collect()
                            }
                        };
                    (ti, results)
                }
            });
        let results = futures::future::join_all(publishes).await;
        for (ti, res) in results {
            let mut unavailable = None;
            for ((i, _), r) in groups[ti].iter().zip(res) {
                let m = &messages[*i];
                outcomes[*i] = Some(match r {
                    Ok(()) => match confirm_within[*i] {
                        Some(within) => Outcome::SentAwaitingConfirmation { within },
                        None => Outcome::Sent,
                    },
                    Err(e) => match e.kind() {
                        TransportErrorKind::Unavailable => {
                            unavailable = Some(e.report());
                            Outcome::Release {
                                delay: Duration::from_millis(500),
                            }
                        }
                        TransportErrorKind::Permanent => Outcome::Failed { reason: e.report() },
                        TransportErrorKind::Retryable if m.attempts >= m.max_attempts => {
                            Outcome::Failed {
                                reason: format!(
                                    "attempts exhausted ({}): {}",
                                    m.attempts,
                                    e.report()
                                ),
                            }
                        }
                        TransportErrorKind::Retryable => Outcome::Retry {
                            delay: cfg.backoff.delay(m.attempts),
                            error: e.report(),
                        },
                    },
                });
            }
            if let Some(reason) = unavailable {
                self.mark_down(ti, reason, background.clone());
            }
        }
        let mut completions: Vec<Completion> = messages
            .iter()
            .zip(outcomes)
            .filter_map(|(m, o)| o.map(|outcome| Completion { id: m.id, outcome }))
            .collect();
        completions.extend(claim.malformed.into_iter().map(|(id, reason)| Completion {
            id,
            outcome: Outcome::Failed {
                reason: format!("malformed row: {reason}"),
            },
        }));
        for c in &completions {
            let counter = match c.outcome {
                Outcome::Sent | Outcome::SentAwaitingConfirmation { .. } => &inner.metrics.sent,
                Outcome::Retry { .. } => &inner.metrics.retried,
                Outcome::Failed { ref reason } => {
                    tracing::warn!(id = c.id, reason, "message dead-lettered");
                    &inner.metrics.failed
                }
                Outcome::Release { .. } => &inner.metrics.released,
            };
            add(counter, 1);
        }
        self.complete(claim.token, &completions, claimed_at).await;
    }

    /// Record outcomes, retrying transient database errors until the lease would have expired.
    async fn complete(&self, token: i64, completions: &[Completion], claimed_at: Instant) {
        let inner = &self.inner;
        let mut failures = 0u32;
        loop {
            match inner.store.complete(token, completions).await {
                Ok(matched) => {
                    let lost = completions.len() as u64 - matched.min(completions.len() as u64);
                    if lost > 0 {
                        add(&inner.metrics.lost_leases, lost);
                        tracing::warn!(
                            lost,
                            "completion refused for rows whose lease was lost; they will be published again"
                        );
                    }
                    return;
                }
                Err(e) => {
                    failures += 1;
                    add(&inner.metrics.store_errors, 1);
                    let wait = inner.config.probe_backoff.delay(failures);
                    if claimed_at.elapsed() + wait >= inner.config.lease {
                        tracing::error!(error = %e, "completion failed until the lease ran out; rows return by lease expiry");
                        return;
                    }
                    tracing::warn!(error = %e, failures, "completion failed; retrying");
                    tokio::time::sleep(wait).await;
                }
            }
        }
    }

    fn mark_down(&self, ti: usize, reason: String, stop: CancellationToken) {
        let inner = &self.inner;
        if inner.health[ti].down.swap(true, Ordering::AcqRel) {
            return;
        }
        add(&inner.metrics.outages, 1);
        let transport = inner.transports[ti].clone();
        tracing::warn!(
            transport = transport.name(),
            reason,
            "transport unavailable; pausing it and probing"
        );
        let relay = self.clone();
        tokio::spawn(async move {
            let inner = &relay.inner;
            let mut n = 0u32;
            loop {
                n += 1;
                tokio::select! {
                    // The relay stopped or crashed: nobody needs the answer any more. A later
                    // run starts with the transport presumed up and finds out again.
                    _ = stop.cancelled() => {
                        inner.health[ti].down.store(false, Ordering::Release);
                        return;
                    }
                    _ = tokio::time::sleep(inner.config.probe_backoff.delay(n)) => {}
                }
                match transport.probe().await {
                    Ok(()) => break,
                    Err(e) => {
                        tracing::debug!(transport = transport.name(), error = %e.report(), "probe failed")
                    }
                }
            }
            inner.health[ti].down.store(false, Ordering::Release);
            inner.health_changed.notify_waiters();
            inner.store.wake();
            tracing::info!(
                transport = transport.name(),
                probes = n,
                "transport available again"
            );
        });
    }
}

/// Maintenance, on every relay, each step one bounded conditional statement so relays never
/// do the same work twice: reap expired leases, check back unconfirmed messages past their
/// deadline, and delete finished rows past the retention period. A step that fills a whole
/// batch runs again at once.
async fn reap_loop(relay: Relay, cancel: CancellationToken) {
    let inner = &relay.inner;
    let cfg = &inner.config;
    let mut failures = 0u32;
    let mut full = false;
    loop {
        let wait = if failures > 0 {
            cfg.probe_backoff.delay(failures)
        } else if full {
            Duration::ZERO
        } else {
            cfg.reap_interval
        };
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(wait) => {}
        }
        let limit = cfg.batch_size;
        let steps = async {
            let reaped = inner
                .store
                .reap_expired_leases(limit, cfg.max_attempts)
                .await?;
            let checked = inner.store.check_back(limit, cfg.max_check_backs).await?;
            let purged = match cfg.retention {
                Some(r) => inner.store.purge_finished(r, limit).await?,
                None => 0,
            };
            Ok::<_, StoreError>((reaped, checked, purged))
        };
        match steps.await {
            Ok((reaped, checked, purged)) => {
                failures = 0;
                full = [reaped, checked, purged]
                    .iter()
                    .any(|n| *n >= u64::from(limit));
                if reaped > 0 {
                    add(&inner.metrics.reaped, reaped);
                    tracing::info!(rows = reaped, "reaped expired leases");
                }
                if checked > 0 {
                    add(&inner.metrics.checked_back, checked);
                    tracing::info!(rows = checked, "checked back unconfirmed messages");
                }
                if purged > 0 {
                    add(&inner.metrics.purged, purged);
                    tracing::debug!(rows = purged, "purged finished rows past retention");
                }
                if reaped + checked > 0 {
                    inner.store.wake();
                }
            }
            Err(e) => {
                failures += 1;
                add(&inner.metrics.store_errors, 1);
                tracing::warn!(error = %e, "relay maintenance failed");
            }
        }
    }
}
