//! The relay: publishes committed outbox rows at least once, with broker acknowledgement, and
//! records each message's outcome with ONE row write (docs/ordering.md).
//!
//! # Bucket leases
//! Every row has a `bucket` (a hash of its partition key, of its message id when it has none,
//! modulo [`BUCKETS`](crate::store::BUCKETS)). Relays share the buckets through the database: a
//! membership round every `lease / 3` heartbeats, renews the relay's bucket leases and acquires
//! free or expired buckets up to the fair share `ceil(BUCKETS / live relays)`; a relay above its
//! share gives the extra buckets back between batches. A relay reads only the buckets it holds,
//! so it needs no per-row claim.
//!
//! # Loop
//! ```text
//! wake-up (in-process Store::wake | PostgreSQL NOTIFY | poll timer | next due time)
//!   └─▶ read due rows of held buckets not in flight (no write)
//!         ─▶ per-key order check for ordered routes ─▶ publish, pipelined per transport
//!         ─▶ ONE completion statement, fenced by the bucket leases:
//!            SENT / PENDING + backoff / FAILED / released
//! membership: heartbeat, renew, acquire, rebalance (every lease / 3)
//! maintenance: check back unconfirmed, purge (every maintenance_interval)
//! ```
//! A bucket is in at most one batch at a time, so up to `in_flight_batches` batches of
//! different buckets are published concurrently and a key's messages never race each other.
//! A full read reads again at once; an empty one sleeps until the earliest due row of the held
//! buckets, capped by `poll_interval` (an idle relay costs one query per poll interval).
//!
//! # Fencing
//! A completion writes a row only while the relay still owns its bucket with the token it read
//! under and the lease has not expired (database clock). A relay that stalled past its lease
//! and lost the bucket writes nothing (counted in `lost_leases`); the new owner publishes those
//! rows again (same message id: the consumer's inbox absorbs the copy). Before each publish the
//! relay checks that every bucket of the batch is still held for longer than
//! `publish_timeout`; otherwise it does not publish (shared case C15).
//!
//! # Crash loops
//! Reading does not count an attempt, so a message that kills the relay would leave no trace.
//! When a relay takes over a bucket whose previous lease EXPIRED (its owner died or stalled),
//! it records one attempt for the rows of its first batch from that bucket BEFORE publishing
//! them; a message that kills every relay reaches `max_attempts` and is dead-lettered
//! (`relay stopped while publishing it`).
//!
//! # Ordered routes
//! On a route with [`Route::ordered`](crate::Route::ordered), a message is published only when it is the first
//! unfinished message of its partition key (one indexed statement, [`Store::key_heads`]); in one
//! batch a key's messages go in generations (the next only after the broker acknowledged the
//! previous). A failing head holds back its own key only (the relay skips that key's rows in its
//! reads until the head's backoff ends). A dead-lettered head lets the next message go
//! ([`DeadLetterPolicy::Skip`]) or blocks the key ([`DeadLetterPolicy::Block`]).
//!
//! # Failure handling
//! - `Retryable` publish error: PENDING again after [`Backoff`] on the database clock, or FAILED
//!   ("attempts exhausted") after `max_attempts`.
//! - `Permanent` error: FAILED at once with the reason (shared case C07).
//! - A message the route's transport refuses to put on the wire ([`Transport::check`]: a header
//!   name or value, a partition key its client cannot carry, a broker-reserved header such as
//!   `Nats-Msg-Id`, typically from a row written by plain SQL): FAILED at once with the reason
//!   naming the header or key; it is never handed to the broker's client, and the rest of the
//!   batch is published.
//! - No route on this relay: if a live peer relay advertises a route for the topic (relays
//!   advertise their route patterns in the membership, schema v6), the message is released
//!   untouched and its bucket handed over to that peer ([`Store::hand_off_buckets`]); only a
//!   topic no live relay routes is FAILED (`no route for topic …`). Relays whose route sets
//!   differ log an error naming both and the difference (docs/ordering.md).
//! - `Unavailable` (broker unreachable, dead client, refused credentials, permission or TLS, a
//!   missing destination): the message is released without counting the attempt, the transport
//!   is marked down, and a prober checks it with backoff (the transport's probe reconnects or
//!   rebuilds its client); while every transport is down the relay does not read at all (shared
//!   case C05). One warning when the outage begins, one info line when a publish is accepted
//!   again; a probe that succeeds while publishes keep failing is the same outage (debug lines,
//!   the probe backoff keeps growing). A destination missing for longer than
//!   [`RelayConfig::missing_destination_grace`] is dead-lettered.
//! - A destination that refuses messages for now ([`TransportError::destination_busy`]: a
//!   RabbitMQ nack while a quorum queue elects a leader, an HTTP 429): the message is released
//!   without counting the attempt, due again after the destination's own backoff
//!   ([`RelayConfig::probe_backoff`], one step per batch it refused); the transport is not
//!   paused, so other destinations go on. One warning when it starts refusing, one info line
//!   when it accepts again.
//! - A completion that fails (deadlock, lost connection) is retried with backoff until the lease
//!   runs out; the relay loop never dies of it (shared case C21).
//! - A publish cut by `publish_timeout`: each message keeps the result its transport recorded
//!   ([`Acks`]); unanswered ones get the timeout error, never-sent ones are released (warning
//!   with the counts).
//! - A panic in a transport's publish is contained: the messages are published again one at a
//!   time and the one that panics alone goes to FAILED (`transport panicked: …`). A panic
//!   elsewhere in a batch releases its buckets; its rows are read again like a takeover's
//!   (attempt recorded first) and one at a time (`batch panicked: …` after `max_attempts`).
//! - A batch stuck past its lease is reported: error log, [`Relay::stalled`],
//!   [`RelayMetrics::stalled_batches`].
//!
//! # Shutdown
//! Cancelling the token stops reading; batches in flight finish (bounded by `publish_timeout`)
//! and record their outcome, up to `shutdown_timeout`; then the relay gives its buckets back and
//! leaves, so the other relays take them over at their next membership round.

mod batch;
mod config;
mod decide;
pub mod group;
mod health;
mod keys;
mod maintenance;
mod membership;
mod metrics;
mod ownership;
mod prepared;
mod publish;

pub use config::RelayConfig;
pub use health::RelayHealth;
pub use metrics::{MetricsSnapshot, RelayHooks, RelayMetrics};

use batch::Work;
use health::Health;
use maintenance::maintenance_loop;
use membership::membership_loop;
use metrics::add;
use ownership::{InFlight, Ownership, lane_share};
use publish::{Published, panic_message};

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use futures::FutureExt;
use tokio::sync::Notify;
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::error::{ConfigError, StoreError, StoreErrorKind, TransportError, TransportErrorKind};
use crate::message::Message;
use crate::retry::Backoff;
use crate::store::{
    Bucket, BucketBatch, BucketCompletion, HandOff, LeaseToken, MembershipRequest, MembershipRound,
    Outcome, Store,
};
use crate::transport::{AckState, Acks, DeadLetterPolicy, Outgoing, Router, Transport};
struct Inner {
    store: Arc<dyn Store>,
    router: Router,
    transports: Vec<Arc<dyn Transport>>,
    health: Vec<Health>,
    config: RelayConfig,
    metrics: Arc<RelayMetrics>,
    hooks: Option<Arc<dyn RelayHooks>>,
    health_changed: Notify,
    ownership: Mutex<Ownership>,
    /// Keys of ordered routes held back, until when (their rows are left out of reads).
    held_back: Mutex<keys::KeyHolds>,
    /// Destinations found missing, by transport index and destination: since when.
    missing: Mutex<HashMap<(usize, String), Instant>>,
    /// Destinations refusing messages for now, by transport index and destination.
    busy: Mutex<HashMap<(usize, String), health::Busy>>,
    /// Buckets acquired or batches finished: the reader may have work.
    changed: Notify,
    /// A completion was refused: run a membership round now to learn which buckets were lost.
    renew_now: Notify,
    /// The topic patterns of this relay's routes, normalised: advertised in the membership.
    routes: Vec<String>,
    /// Held buckets with messages only another live relay routes, and that relay: handed over
    /// to it at the next membership round ([`Store::hand_off_buckets`]).
    handoffs: Mutex<BTreeMap<Bucket, String>>,
    /// When the relay was built, and when its last membership round succeeded.
    created: Instant,
    last_membership: Mutex<Option<Instant>>,
    /// When the last successful membership round was sent (the database answered a request
    /// made at that time): [`Relay::wedged`].
    last_membership_sent: Mutex<Option<Instant>>,
    /// In-process check-backs of two-phase messages, by name.
    check_back_hooks: crate::two_phase::Hooks,
    /// Asks HTTP check-backs.
    #[cfg(feature = "webhook")]
    http_checker: crate::two_phase::HttpChecker,
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
    check_back_hooks: crate::two_phase::Hooks,
}

impl RelayBuilder {
    /// Register the in-process check-back `name` for two-phase messages prepared with
    /// [`CheckBack::hook(name)`](crate::two_phase::CheckBack::hook). Register it on every relay
    /// of the table: the relay holding a message's bucket asks it (a relay without it records an
    /// error, not counted, and asks again with backoff).
    pub fn check_back_hook(
        mut self,
        name: impl Into<String>,
        hook: Arc<dyn crate::two_phase::CheckBackHook>,
    ) -> Self {
        self.check_back_hooks.insert(name.into(), hook);
        self
    }

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
        ConfigError::invalid_if(
            self.router.routes().is_empty(),
            "routes",
            "at least one route is needed",
        )?;
        let transports = self.router.transports();
        let health = transports.iter().map(|_| Health::default()).collect();
        let patterns: Vec<String> = self
            .router
            .routes()
            .iter()
            .map(|r| r.pattern.to_string())
            .collect();
        let routes = crate::store::normalise_routes(&patterns);
        #[cfg(feature = "webhook")]
        let http_checker = crate::two_phase::HttpChecker::new(&self.config.check_back)?;
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
                ownership: Mutex::new(Ownership::default()),
                held_back: Mutex::new(keys::KeyHolds::default()),
                missing: Mutex::new(HashMap::new()),
                busy: Mutex::new(HashMap::new()),
                changed: Notify::new(),
                renew_now: Notify::new(),
                routes,
                handoffs: Mutex::new(BTreeMap::new()),
                created: Instant::now(),
                last_membership: Mutex::new(None),
                last_membership_sent: Mutex::new(None),
                check_back_hooks: self.check_back_hooks,
                #[cfg(feature = "webhook")]
                http_checker,
            }),
        })
    }
}

/// A relay running on its own task ([`Relay::spawn`]).
pub struct RelayHandle {
    relay: Relay,
    cancel: CancellationToken,
    join: tokio::task::JoinHandle<Result<(), StoreError>>,
    metrics: Arc<RelayMetrics>,
}

impl RelayHandle {
    /// Stop gracefully (see the module docs) and wait for the relay to finish.
    ///
    /// # Errors
    /// The start-up error the relay stopped with, if any.
    ///
    /// # Panics
    /// When the relay task panicked (its membership or maintenance task died), the panic is
    /// resumed here rather than reported as a clean stop.
    pub async fn shutdown(self) -> Result<(), StoreError> {
        self.cancel.cancel();
        match self.join.await {
            Ok(r) => r,
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            Err(_) => Ok(()),
        }
    }

    /// See [`Relay::stalled`].
    pub fn stalled(&self) -> Option<Duration> {
        self.relay.stalled()
    }

    /// Simulate a crash: abort the task at whatever point it is. Its buckets stay owned until
    /// their lease expires, then another relay takes them over. For tests and the demo.
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
            check_back_hooks: Default::default(),
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

    /// The store it relays from.
    pub fn store(&self) -> &Arc<dyn Store> {
        &self.inner.store
    }

    /// The buckets this relay holds now, in order.
    pub fn held_buckets(&self) -> Vec<Bucket> {
        let own = self.inner.ownership.lock().expect("ownership lock");
        own.held.keys().copied().collect()
    }

    /// Whether this relay applies retention now: it holds bucket 0 and its lease has not
    /// expired (so at most one live relay does, apart from a lease's last moments).
    fn runs_retention(&self) -> bool {
        let own = self.inner.ownership.lock().expect("ownership lock");
        own.held
            .get(&0)
            .is_some_and(|h| h.valid_until > Instant::now())
    }

    /// Run on a new task until [`RelayHandle::shutdown`].
    pub fn spawn(&self) -> RelayHandle {
        let cancel = CancellationToken::new();
        let relay = self.clone();
        let c = cancel.clone();
        RelayHandle {
            relay: self.clone(),
            cancel,
            join: tokio::spawn(async move { relay.run(c).await }),
            metrics: self.inner.metrics.clone(),
        }
    }

    /// Run until `cancel` is cancelled, then shut down gracefully.
    ///
    /// # Errors
    /// Only at start-up: [`StoreError::MissingTable`] (run `outbox migrate`),
    /// [`StoreError::SchemaVersion`] (the table is at an older schema than this build needs, or
    /// a newer one than it knows; the error names both versions) or a configuration error of
    /// the store. Later errors are logged, counted and retried.
    ///
    /// # Cancel safety
    /// Dropping the future instead of cancelling the token is a crash: the relay's buckets stay
    /// owned until their lease expires, then another relay takes them over and publishes what
    /// was not recorded (again: the consumer's inbox absorbs copies).
    pub async fn run(&self, cancel: CancellationToken) -> Result<(), StoreError> {
        use tracing::Instrument;
        let inner = &self.inner;
        // A table at another schema version than this build's fails every statement later,
        // with errors that name the symptom (a missing table or column), not the cause.
        let ready = match inner.store.check_schema().await {
            Ok(()) => inner.store.next_due_in().await.map(|_| ()),
            Err(e) => Err(e),
        };
        if let Err(e) = ready {
            if matches!(
                e.kind(),
                StoreErrorKind::MissingTable
                    | StoreErrorKind::Config
                    | StoreErrorKind::SchemaVersion
            ) {
                tracing::error!(error = %e.report(), "relay cannot start");
                return Err(e);
            }
            tracing::warn!(error = %e.report(), "store not ready at start; will retry");
        }
        let background = cancel.child_token();
        // A relay future dropped mid-run (a crash, `RelayHandle::abort`) must not leave its
        // background tasks running: the guard cancels them when `run` is dropped.
        let _stop_background_on_drop = background.clone().drop_guard();
        let _listener = inner.store.spawn_listener(background.clone());
        let mut maintenance =
            tokio::spawn(maintenance_loop(self.clone(), background.clone()).in_current_span());
        let mut membership =
            tokio::spawn(membership_loop(self.clone(), background.clone()).in_current_span());
        let mut prepared = tokio::spawn(
            prepared::prepared_loop(self.clone(), background.clone()).in_current_span(),
        );
        let mut batches: JoinSet<()> = JoinSet::new();
        let waker = inner.store.waker();
        let cfg = &inner.config;
        let mut read_failures = 0u32;
        // Something may be due now: read before asking when the next row is due.
        let mut read_first = true;
        // The last read found nothing: due rows the database still reports are held back.
        let mut last_read_empty = false;
        // The last read filled a whole batch: a backlog, so the free lanes share the buckets.
        // Assumed at start (a relay usually starts on a backlog): otherwise the first read takes
        // a row from nearly every bucket and the other lanes wait for that batch to end. When
        // there is none, the first read finds its share empty and the next reads them all.
        let mut backlog = true;
        let split_lanes = inner.store.lanes_share_buckets();
        tracing::info!(relay = %cfg.name, store = inner.store.backend(), table = inner.store.table(), "relay started");

        while !cancel.is_cancelled() {
            while let Some(r) = batches.try_join_next() {
                self.batch_ended(r);
            }
            // Membership and maintenance only end when cancelled: one that ended otherwise
            // panicked, and a relay without it cannot renew its buckets (it would idle alive).
            for (task, name) in [
                (&mut membership, "membership"),
                (&mut maintenance, "maintenance"),
                (&mut prepared, "check-back of prepared messages"),
            ] {
                if task.is_finished() && !background.is_cancelled() {
                    if let Err(e) = task.await
                        && e.is_panic()
                    {
                        tracing::error!(relay = %cfg.name, task = name, "relay task panicked; the relay stops");
                        std::panic::resume_unwind(e.into_panic());
                    }
                    tracing::error!(relay = %cfg.name, task = name, "relay task ended; the relay stops");
                    panic!("the relay's {name} task ended unexpectedly");
                }
            }
            if inner.health.iter().all(|h| h.down.load(Ordering::Acquire)) {
                tokio::select! {
                    _ = cancel.cancelled() => break,
                    _ = inner.health_changed.notified() => continue,
                    _ = tokio::time::sleep(cfg.poll_interval) => continue,
                }
            }
            let free = if batches.len() < cfg.in_flight_batches {
                let mut free = self.free_buckets();
                if backlog && split_lanes {
                    free.truncate(lane_share(
                        free.len(),
                        cfg.in_flight_batches - batches.len(),
                    ));
                }
                free
            } else {
                Vec::new()
            };
            let buckets: Vec<Bucket> = free.iter().map(|&(b, _)| b).collect();
            if free.is_empty() {
                // Every lane busy or no bucket held: wait for a batch to finish or buckets.
                tokio::select! {
                    _ = cancel.cancelled() => break,
                    Some(r) = batches.join_next(), if !batches.is_empty() => self.batch_ended(r),
                    _ = inner.changed.notified() => {}
                    _ = waker.notified() => {}
                    _ = tokio::time::sleep(cfg.poll_interval) => {}
                }
                read_first = true;
                continue;
            }
            let mut sleep_for = cfg.poll_interval;
            if !read_first {
                match inner.store.next_due_in_buckets(&buckets).await {
                    Ok(Some(d)) if d.is_zero() && !last_read_empty => {
                        // Due now (a producer without a wake-up, or a backoff that ended).
                        read_first = true;
                        continue;
                    }
                    Ok(Some(d)) if d.is_zero() => {
                        // The last read left due rows out: they belong to held-back keys (read
                        // again when the first is released), or became due just after it.
                        sleep_for = self
                            .next_key_release()
                            .unwrap_or(Duration::from_millis(5))
                            .min(sleep_for);
                    }
                    Ok(Some(d)) => sleep_for = d.min(sleep_for),
                    Ok(None) => {}
                    Err(e) => {
                        inner.metrics.store_error(&e);
                        tracing::debug!(error = %e.report(), "next_due_in failed");
                    }
                }
            } else {
                let skip = self.held_back_keys();
                let read_at = Instant::now();
                match inner
                    .store
                    .read_buckets(&buckets, &skip, cfg.batch_size)
                    .await
                {
                    Ok(batch) => {
                        read_failures = 0;
                        let n = batch.rows.len() + batch.malformed.len();
                        last_read_empty = n == 0;
                        backlog = n >= cfg.batch_size as usize;
                        if n > 0 {
                            add(&inner.metrics.claimed, n as u64);
                            if let Some(work) = self.take_batch(batch, &free, read_at) {
                                let relay = self.clone();
                                let background = background.clone();
                                batches.spawn(
                                    async move {
                                        relay.process(work, read_at, &background).await;
                                    }
                                    .in_current_span(),
                                );
                            }
                            continue;
                        }
                        read_first = false;
                        continue;
                    }
                    Err(e) => {
                        read_failures += 1;
                        inner.metrics.store_error(&e);
                        tracing::warn!(error = %e.report(), failures = read_failures, "read failed; backing off");
                        sleep_for = cfg.probe_backoff.delay(read_failures);
                    }
                }
            }
            let slept_full = sleep_for >= cfg.poll_interval;
            tokio::select! {
                _ = cancel.cancelled() => break,
                _ = waker.notified() => read_first = true,
                _ = inner.changed.notified() => read_first = true,
                Some(r) = batches.join_next(), if !batches.is_empty() => {
                    self.batch_ended(r);
                    read_first = true;
                }
                // After a full poll interval ask cheaply whether anything is due (one query).
                _ = tokio::time::sleep(sleep_for) => {
                    read_first = !slept_full;
                    last_read_empty = false;
                }
            }
        }

        // Phase 1: stop reading, let batches in flight finish. Phase 2: drop the rest.
        tracing::info!(relay = %cfg.name, in_flight = batches.len(), "relay stopping");
        let drained = tokio::time::timeout(cfg.shutdown_timeout, async {
            while let Some(r) = batches.join_next().await {
                self.batch_ended(r);
            }
        })
        .await;
        if drained.is_err() {
            tracing::warn!(
                "shutdown timeout: abandoning batches in flight; their buckets return by lease expiry"
            );
            batches.abort_all();
        }
        background.cancel();
        let _ = maintenance.await;
        let _ = membership.await;
        let _ = prepared.await;
        if drained.is_ok() {
            self.leave().await;
        }
        tracing::info!(relay = %cfg.name, "relay stopped");
        Ok(())
    }

    /// A batch task ended: a panic that escaped `process` (its buckets already left
    /// `in_flight`) is logged and counted.
    fn batch_ended(&self, r: Result<(), tokio::task::JoinError>) {
        if let Err(e) = r
            && e.is_panic()
        {
            add(&self.inner.metrics.panics, 1);
            tracing::error!(relay = %self.inner.config.name, panic = panic_message(e.into_panic().as_ref()), "a batch task panicked");
        }
    }

    /// How long the oldest batch in flight has been, when that is past the point where the relay
    /// stops renewing its buckets (`lease - publish_timeout`): a stalled relay. `None` while it
    /// makes progress. [`RelayMetrics::stalled_batches`] counts these episodes and each is logged
    /// at error level.
    pub fn stalled(&self) -> Option<Duration> {
        let cfg = &self.inner.config;
        let own = self
            .inner
            .ownership
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        own.in_flight
            .values()
            .map(Instant::elapsed)
            .max()
            .filter(|age| *age > cfg.lease.saturating_sub(cfg.publish_timeout))
    }

    /// [`Relay::stalled`], but only when a membership round succeeded after the stalled batch
    /// began: the database answered the relay meanwhile, so the batch is stuck in the process
    /// (a hung hook or transport), which a restart cures. `None` when the relay makes progress
    /// or when its database stopped answering too (the batch waits for the database: a
    /// readiness problem, not a liveness one). What [`RelayGroup::health`](group::RelayGroup::health)
    /// reports, so one database going away does not fail the liveness of a process relaying
    /// several.
    pub fn wedged(&self) -> Option<Duration> {
        let age = self.stalled()?;
        let began = Instant::now().checked_sub(age)?;
        let sent = *self
            .inner
            .last_membership_sent
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        sent.filter(|s| *s > began).map(|_| age)
    }
}

/// Wait before the next round of a periodic loop (maintenance, check-back of prepared messages):
/// `probe_backoff` after `failures` failed rounds in a row, no wait after a full round (more to
/// do), else `interval`. `false` when `cancel` fired first.
async fn pause(
    cfg: &RelayConfig,
    failures: u32,
    full: bool,
    interval: Duration,
    cancel: &CancellationToken,
) -> bool {
    let wait = if failures > 0 {
        cfg.probe_backoff.delay(failures)
    } else if full {
        Duration::ZERO
    } else {
        interval
    };
    tokio::select! {
        _ = cancel.cancelled() => false,
        _ = tokio::time::sleep(wait) => true,
    }
}
