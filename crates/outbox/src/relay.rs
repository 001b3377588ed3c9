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
//! maintenance: reap legacy SENDING rows, check back unconfirmed, purge (every reap_interval)
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
    Bucket, BucketBatch, BucketCompletion, LeaseToken, MembershipRequest, Outcome, Store,
};
use crate::transport::{AckState, Acks, DeadLetterPolicy, Outgoing, Router, Transport};

/// Relay settings. Every field has a default ([`RelayConfig::default`]); [`RelayConfig::validate`]
/// names the first bad field.
#[derive(Debug, Clone)]
pub struct RelayConfig {
    /// The relay's name: its membership row and the owner of its buckets. Default
    /// `relay-<pid>-<random>`. A stable name lets a restarted relay find its own expired
    /// buckets (still counted as a takeover: the previous run may have died mid-publish).
    pub name: String,
    /// Rows per read (one batch), 1 to 10,000. Default 500.
    pub batch_size: u32,
    /// Bucket lease, at least 3 × `publish_timeout`: how long a relay keeps its buckets without
    /// renewing them (renewed every `lease / 3`), and so how long the buckets of a relay that
    /// died wait before another relay takes them over. Default 30 s.
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
    /// database calls. Default 200 ms, ×2, ≤ 10 s. During one outage the probe delay keeps
    /// growing across relapses (a probe that succeeds while the next publish fails again in the
    /// same way, as with a refused permission): only a publish the broker accepts ends the outage.
    pub probe_backoff: Backoff,
    /// How long a destination may be missing (a RabbitMQ exchange, a Kafka topic, a JetStream
    /// stream, a webhook answering 404: [`TransportError::is_missing_destination`]) before its
    /// messages are dead-lettered. Until then the transport is paused and probed and no attempt
    /// is counted (a missing destination is usually a deployment step not taken yet). Counted
    /// from the first publish that found it missing, per transport and destination; a publish
    /// the broker accepts for it resets it. Default 5 min; zero dead-letters at once.
    pub missing_destination_grace: Duration,
    /// How often maintenance runs (reap expired row leases of the legacy claim protocol, check
    /// back, retention). Default 5 s.
    pub reap_interval: Duration,
    /// Batches published concurrently (each of different buckets). Default 2.
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
            missing_destination_grace: Duration::from_secs(300),
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
    /// Rows read from held buckets to publish.
    pub claimed: AtomicU64,
    /// Messages the broker acknowledged and recorded SENT.
    pub sent: AtomicU64,
    /// Messages rescheduled after a retryable error.
    pub retried: AtomicU64,
    /// Messages dead-lettered (FAILED).
    pub failed: AtomicU64,
    /// Messages released without counting the attempt (transport down, shutdown).
    pub released: AtomicU64,
    /// Completion rows refused because their bucket lease was lost (taken over).
    pub lost_leases: AtomicU64,
    /// Batches not published because a bucket lease was about to expire.
    pub stale_batches: AtomicU64,
    /// Rows returned to PENDING (or FAILED) by this relay's reaper (legacy SENDING rows).
    pub reaped: AtomicU64,
    /// Unconfirmed SENT rows past their deadline sent back to PENDING (or FAILED `unconfirmed`).
    pub checked_back: AtomicU64,
    /// Finished rows deleted by retention.
    pub purged: AtomicU64,
    /// Failed database calls (read, completion, membership, maintenance), all retried.
    pub store_errors: AtomicU64,
    /// Times a transport was found unavailable.
    pub outages: AtomicU64,
    /// Messages of ordered routes held back because an earlier message of their key is unfinished.
    pub held_back: AtomicU64,
    /// Buckets acquired (free or taken over).
    pub buckets_acquired: AtomicU64,
    /// Buckets taken over from a relay whose lease had expired.
    pub takeovers: AtomicU64,
    /// Held buckets found taken over by another relay at renewal.
    pub buckets_lost: AtomicU64,
    /// Buckets given back (above the fair share, or on shutdown).
    pub buckets_released: AtomicU64,
    /// Completion statements executed (each writes the rows of one batch once).
    pub completion_writes: AtomicU64,
    /// Panics contained: a transport's publish (of a batch or of one message), or a whole batch
    /// task. Each is logged at error level.
    pub panics: AtomicU64,
    /// Publishes cut short by `publish_timeout` (each logged with its counts).
    pub publish_timeouts: AtomicU64,
    /// Times a batch was found in flight past `lease - publish_timeout`: the relay stops renewing
    /// its buckets until it returns and logs an error every lease meanwhile.
    pub stalled_batches: AtomicU64,
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
    /// See [`RelayMetrics::held_back`].
    pub held_back: u64,
    /// See [`RelayMetrics::buckets_acquired`].
    pub buckets_acquired: u64,
    /// See [`RelayMetrics::takeovers`].
    pub takeovers: u64,
    /// See [`RelayMetrics::buckets_lost`].
    pub buckets_lost: u64,
    /// See [`RelayMetrics::buckets_released`].
    pub buckets_released: u64,
    /// See [`RelayMetrics::completion_writes`].
    pub completion_writes: u64,
    /// See [`RelayMetrics::panics`].
    pub panics: u64,
    /// See [`RelayMetrics::publish_timeouts`].
    pub publish_timeouts: u64,
    /// See [`RelayMetrics::stalled_batches`].
    pub stalled_batches: u64,
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
            held_back: g(&self.held_back),
            buckets_acquired: g(&self.buckets_acquired),
            takeovers: g(&self.takeovers),
            buckets_lost: g(&self.buckets_lost),
            buckets_released: g(&self.buckets_released),
            completion_writes: g(&self.completion_writes),
            panics: g(&self.panics),
            publish_timeouts: g(&self.publish_timeouts),
            stalled_batches: g(&self.stalled_batches),
        }
    }
}

fn add(a: &AtomicU64, n: u64) {
    a.fetch_add(n, Ordering::Relaxed);
}

/// Test and instrumentation hooks, called at fixed points of the relay loop.
#[async_trait]
pub trait RelayHooks: Send + Sync + 'static {
    /// After a batch was read (and, after a takeover, its attempt recorded) and before anything
    /// is published; the stale-lease check runs after this hook (shared case C15 pauses here).
    /// `messages`: the rows of the batch still to publish (not those already dead-lettered).
    async fn before_publish(&self, messages: &[Message]) {
        let _ = messages;
    }

    /// After publishing and before the completion statement (a test pauses here to let the
    /// bucket lease expire and another relay take the bucket over).
    async fn before_complete(&self, messages: &[Message]) {
        let _ = messages;
    }
}

/// Availability of one transport (see [`Relay::mark_down`]).
#[derive(Default)]
struct Health {
    /// Paused: publishes release their messages, a prober runs.
    down: AtomicBool,
    /// A probe succeeded after an outage, but no publish has been accepted since: a failure now
    /// is the same outage going on (a relapse), not a new one.
    recovering: AtomicBool,
    /// Probes since the outage began, across relapses: the probe backoff's attempt number.
    probes: AtomicU32,
    /// Relapses of the current outage.
    relapses: AtomicU32,
    /// Bumped by every outage and relapse, so a prober knows whether the transport failed again
    /// after its successful probe.
    epoch: AtomicU64,
}

/// A held bucket lease, as this relay knows it.
#[derive(Debug, Clone, Copy)]
struct Held {
    token: LeaseToken,
    /// Local estimate of the lease end: the start of the round that renewed it + lease.
    valid_until: Instant,
    /// Taken over from an expired lease and not read since: the first batch records an
    /// attempt before publishing (crash-loop protection).
    suspect: bool,
    /// Handed over by a relay that could not route some of its messages: until this time (one
    /// lease after the hand-over) the bucket is not given back above the fair share, so this
    /// relay publishes its messages before it can bounce back to the relay that gave it.
    handed_until: Option<Instant>,
}

#[derive(Debug, Default)]
struct Ownership {
    held: BTreeMap<Bucket, Held>,
    /// Buckets in a batch in flight, with the time the batch was read.
    in_flight: BTreeMap<Bucket, Instant>,
    /// Buckets whose last batch panicked, with the panic message (the dead-letter reason of a
    /// row that reaches `max_attempts` this way).
    panicked: BTreeMap<Bucket, String>,
    fair_share: u32,
    /// Rotates the bucket order of reads so no bucket is always read first.
    rotate: usize,
}

/// Cap on the keys held back in memory (rows of further held-back keys are simply read again).
const MAX_HELD_BACK_KEYS: usize = 1000;

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
    held_back: Mutex<HashMap<String, Instant>>,
    /// Destinations found missing, by transport index and destination: since when.
    missing: Mutex<HashMap<(usize, String), Instant>>,
    /// Buckets acquired or batches finished: the reader may have work.
    changed: Notify,
    /// A completion was refused: run a membership round now to learn which buckets were lost.
    renew_now: Notify,
    /// The topic patterns of this relay's routes, normalised: advertised in the membership.
    routes: Vec<String>,
    /// Held buckets with messages only another live relay routes, and that relay: handed over
    /// to it at the next membership round ([`Store::hand_off_buckets`]).
    handoffs: Mutex<BTreeMap<Bucket, String>>,
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
        let health = transports.iter().map(|_| Health::default()).collect();
        let patterns: Vec<String> = self
            .router
            .routes()
            .iter()
            .map(|r| r.pattern.to_string())
            .collect();
        let routes = crate::store::normalise_routes(&patterns);
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
                held_back: Mutex::new(HashMap::new()),
                missing: Mutex::new(HashMap::new()),
                changed: Notify::new(),
                renew_now: Notify::new(),
                routes,
                handoffs: Mutex::new(BTreeMap::new()),
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

/// Takes a batch's buckets out of `in_flight` when the batch ends, however it ends.
struct InFlight<'a> {
    relay: &'a Relay,
    buckets: &'a BTreeSet<Bucket>,
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        let inner = &self.relay.inner;
        let mut own = inner
            .ownership
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for b in self.buckets {
            own.in_flight.remove(b);
        }
        drop(own);
        inner.changed.notify_one();
    }
}

/// What publishing did with one message.
enum Published {
    /// The transport's result (or the relay's: timeout, panic).
    Done(Result<(), TransportError>),
    /// Never handed to the broker: released without counting an attempt.
    NotSent,
}

/// The text of a panic payload (`&str` or `String`; other payloads are not described).
fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic without a message".to_owned()
    }
}

/// One message of a batch being published.
struct Work {
    bucket: Bucket,
    token: LeaseToken,
    message: Message,
    /// Resolved route index and destination; `None`: no route.
    route: Option<(usize, String)>,
    /// The attempts already recorded in the row (this attempt included once `counted`).
    stored_attempts: u32,
    /// This attempt was recorded before publishing (takeover batch).
    counted: bool,
    outcome: Option<Outcome>,
}

impl Work {
    /// The attempt number of this publish.
    fn attempt(&self) -> u32 {
        if self.counted {
            self.stored_attempts
        } else {
            self.stored_attempts + 1
        }
    }

    /// The `attempts` value to store with `outcome`.
    fn attempts_to_store(&self, outcome: &Outcome) -> u32 {
        match outcome {
            Outcome::Release { .. } => self.stored_attempts,
            _ => self.attempt(),
        }
    }
}

/// The outcome of a message `transport` refuses to put on the wire ([`Transport::check`]): a
/// dead letter naming the header or key and the rule it breaks. `None` when it may be sent.
fn refused_by_transport(transport: &dyn Transport, w: &Work) -> Option<Outcome> {
    let (_, destination) = w.route.as_ref()?;
    let out = Outgoing {
        message: &w.message,
        destination,
    };
    transport
        .check(&out)
        .err()
        .map(|e| Outcome::Failed { reason: e.report() })
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

    /// The buckets this relay holds now, in order.
    pub fn held_buckets(&self) -> Vec<Bucket> {
        let own = self.inner.ownership.lock().expect("ownership lock");
        own.held.keys().copied().collect()
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
        let mut reaper = tokio::spawn(reap_loop(self.clone(), background.clone()));
        let mut membership = tokio::spawn(membership_loop(self.clone(), background.clone()));
        let mut batches: JoinSet<()> = JoinSet::new();
        let waker = inner.store.waker();
        let cfg = &inner.config;
        let mut read_failures = 0u32;
        // Something may be due now: read before asking when the next row is due.
        let mut read_first = true;
        // The last read found nothing: due rows the database still reports are held back.
        let mut last_read_empty = false;
        tracing::info!(relay = %cfg.name, store = inner.store.backend(), table = inner.store.table(), "relay started");

        while !cancel.is_cancelled() {
            while let Some(r) = batches.try_join_next() {
                self.batch_ended(r);
            }
            // Membership and maintenance only end when cancelled: one that ended otherwise
            // panicked, and a relay without it cannot renew its buckets (it would idle alive).
            for (task, name) in [
                (&mut membership, "membership"),
                (&mut reaper, "maintenance"),
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
                self.free_buckets()
            } else {
                Vec::new()
            };
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
                match inner.store.next_due_in_buckets(&free).await {
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
                        add(&inner.metrics.store_errors, 1);
                        tracing::debug!(error = %e.report(), "next_due_in failed");
                    }
                }
            } else {
                let skip = self.held_back_keys();
                let read_at = Instant::now();
                match inner.store.read_buckets(&free, &skip, cfg.batch_size).await {
                    Ok(batch) => {
                        read_failures = 0;
                        let n = batch.rows.len() + batch.malformed.len();
                        last_read_empty = n == 0;
                        if n > 0 {
                            add(&inner.metrics.claimed, n as u64);
                            if let Some(work) = self.take_batch(batch, read_at) {
                                let relay = self.clone();
                                let background = background.clone();
                                batches.spawn(async move {
                                    relay.process(work, read_at, &background).await;
                                });
                            }
                            continue;
                        }
                        read_first = false;
                        continue;
                    }
                    Err(e) => {
                        read_failures += 1;
                        add(&inner.metrics.store_errors, 1);
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
        let _ = reaper.await;
        let _ = membership.await;
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

    /// Held buckets not in flight whose lease outlasts a publish, in rotated order.
    fn free_buckets(&self) -> Vec<Bucket> {
        let mut own = self.inner.ownership.lock().expect("ownership lock");
        let horizon = Instant::now() + self.inner.config.publish_timeout;
        // A bucket about to be handed over to another relay is not read again.
        let handoffs = self.inner.handoffs.lock().expect("handoffs lock");
        let mut free: Vec<Bucket> = own
            .held
            .iter()
            .filter(|(b, h)| {
                h.valid_until > horizon
                    && !own.in_flight.contains_key(b)
                    && !handoffs.contains_key(b)
            })
            .map(|(b, _)| *b)
            .collect();
        drop(handoffs);
        if !free.is_empty() {
            own.rotate = own.rotate.wrapping_add(1);
            let k = own.rotate % free.len();
            free.rotate_left(k);
        }
        free
    }

    /// Mark the buckets of a read batch in flight and turn it into work; `None` when every
    /// bucket of it was lost meanwhile.
    fn take_batch(&self, batch: BucketBatch, read_at: Instant) -> Option<Vec<Work>> {
        let max_attempts = self.inner.config.max_attempts;
        let mut own = self.inner.ownership.lock().expect("ownership lock");
        let mut work = Vec::with_capacity(batch.rows.len() + batch.malformed.len());
        let mut suspects = BTreeSet::new();
        let mut push = |own: &mut Ownership, bucket: Bucket, message: Message, outcome| {
            let Some(h) = own.held.get(&bucket).copied() else {
                return;
            };
            own.in_flight.insert(bucket, read_at);
            if h.suspect {
                suspects.insert(bucket);
            }
            let stored_attempts = message.attempts;
            work.push(Work {
                bucket,
                token: h.token,
                message,
                route: None,
                stored_attempts,
                counted: false,
                outcome,
            });
        };
        for row in batch.rows {
            let mut m = row.message;
            if m.max_attempts == 0 {
                m.max_attempts = max_attempts;
            }
            push(&mut own, row.bucket, m, None);
        }
        for (bucket, id, reason) in batch.malformed {
            let m = Message {
                id,
                message_id: uuid::Uuid::nil(),
                topic: String::new(),
                partition_key: None,
                headers: Default::default(),
                payload: Vec::new(),
                attempts: 0,
                max_attempts,
                redelivery: 0,
            };
            let outcome = Outcome::Failed {
                reason: format!("malformed row: {reason}"),
            };
            push(&mut own, bucket, m, Some(outcome));
        }
        // The first batch of a taken-over bucket is the one that records its attempt.
        for b in &suspects {
            if let Some(h) = own.held.get_mut(b) {
                h.suspect = false;
            }
        }
        for w in &mut work {
            w.counted = suspects.contains(&w.bucket) && w.outcome.is_none();
        }
        if work.is_empty() { None } else { Some(work) }
    }

    /// Keys held back now (expired entries dropped).
    fn held_back_keys(&self) -> Vec<String> {
        let mut held = self.inner.held_back.lock().expect("held-back lock");
        if held.is_empty() {
            return Vec::new();
        }
        let now = Instant::now();
        held.retain(|_, until| *until > now);
        held.keys().cloned().collect()
    }

    /// Time until the first held-back key is read again.
    fn next_key_release(&self) -> Option<Duration> {
        let held = self.inner.held_back.lock().expect("held-back lock");
        let now = Instant::now();
        held.values().min().map(|t| {
            t.saturating_duration_since(now)
                .max(Duration::from_millis(1))
        })
    }

    fn hold_back(&self, key: &str, for_: Duration) {
        let mut held = self.inner.held_back.lock().expect("held-back lock");
        if held.len() < MAX_HELD_BACK_KEYS || held.contains_key(key) {
            held.insert(key.to_owned(), Instant::now() + for_);
        }
    }

    /// Whether every bucket of `work` is still held with its token for longer than a publish.
    fn leases_fresh(&self, work: &[Work]) -> bool {
        let own = self.inner.ownership.lock().expect("ownership lock");
        let horizon = Instant::now() + self.inner.config.publish_timeout;
        work.iter().all(|w| {
            own.held
                .get(&w.bucket)
                .is_some_and(|h| h.token == w.token && h.valid_until > horizon)
        })
    }

    /// Publish and complete one batch. Its buckets leave `in_flight` however it ends (done,
    /// panicked, aborted). A panic outside the transport's publish (a hook, the completion) is
    /// contained and logged: its rows stay PENDING, and its buckets are treated like taken-over
    /// ones (each later read of them records an attempt first) and isolated (their rows are
    /// then processed one at a time), so only a row that panics alone every time is
    /// dead-lettered after `max_attempts` ("batch panicked: …").
    async fn process(&self, work: Vec<Work>, read_at: Instant, background: &CancellationToken) {
        let inner = &self.inner;
        let buckets: BTreeSet<Bucket> = work.iter().map(|w| w.bucket).collect();
        let _in_flight = InFlight {
            relay: self,
            buckets: &buckets,
        };
        let isolated: BTreeSet<Bucket> = {
            let own = inner.ownership.lock().expect("ownership lock");
            buckets
                .iter()
                .filter(|b| own.panicked.contains_key(b))
                .copied()
                .collect()
        };
        let mut parts: Vec<Vec<Work>> = Vec::new();
        if isolated.is_empty() || work.len() == 1 {
            parts.push(work);
        } else {
            let (singles, rest): (Vec<Work>, Vec<Work>) =
                work.into_iter().partition(|w| isolated.contains(&w.bucket));
            tracing::warn!(
                relay = %inner.config.name,
                rows = singles.len(),
                "a batch of these buckets panicked before: processing their rows one at a time"
            );
            if !rest.is_empty() {
                parts.push(rest);
            }
            parts.extend(singles.into_iter().map(|w| vec![w]));
        }
        let mut panics: BTreeMap<Bucket, String> = BTreeMap::new();
        for mut part in parts {
            let ran = AssertUnwindSafe(self.process_inner(&mut part, read_at, background))
                .catch_unwind()
                .await;
            if let Err(panic) = ran {
                let reason = panic_message(panic.as_ref());
                add(&inner.metrics.panics, 1);
                let ids: Vec<i64> = part.iter().map(|w| w.message.id).collect();
                tracing::error!(
                    relay = %inner.config.name,
                    ids = ?ids,
                    panic = reason,
                    "a batch panicked; its rows are read again, each time recording an attempt, until they succeed or are dead-lettered"
                );
                for w in &part {
                    panics.insert(w.bucket, reason.clone());
                }
            }
        }
        let mut own = inner
            .ownership
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for b in &buckets {
            match panics.remove(b) {
                Some(reason) => {
                    if let Some(h) = own.held.get_mut(b) {
                        h.suspect = true;
                    }
                    own.panicked.insert(*b, reason);
                }
                None => {
                    own.panicked.remove(b);
                }
            }
        }
        drop(own);
        let hand_off = {
            let handoffs = self.inner.handoffs.lock().expect("handoffs lock");
            buckets.iter().any(|b| handoffs.contains_key(b))
        };
        if hand_off {
            // Hand those buckets over now rather than at the next regular round.
            self.inner.renew_now.notify_one();
        }
    }

    async fn process_inner(
        &self,
        work: &mut [Work],
        read_at: Instant,
        background: &CancellationToken,
    ) {
        let inner = &self.inner;
        let cfg = &inner.config;
        // Takeover batch: record this attempt before publishing anything (crash loops).
        if work.iter().any(|w| w.counted) {
            let mut pre = Vec::new();
            for w in work.iter_mut().filter(|w| w.counted) {
                w.stored_attempts += 1;
                if w.stored_attempts > w.message.max_attempts {
                    // Not attempted again: `attempts` stays at the attempts made.
                    w.stored_attempts -= 1;
                    let panicked = inner
                        .ownership
                        .lock()
                        .expect("ownership lock")
                        .panicked
                        .get(&w.bucket)
                        .cloned();
                    w.outcome = Some(Outcome::Failed {
                        reason: match panicked {
                            Some(p) => {
                                format!("batch panicked: {p} ({} attempts)", w.stored_attempts)
                            }
                            None => format!(
                                "relay stopped while publishing it ({} attempts)",
                                w.stored_attempts
                            ),
                        },
                    });
                } else {
                    pre.push(BucketCompletion {
                        id: w.message.id,
                        bucket: w.bucket,
                        token: w.token,
                        attempts: w.stored_attempts,
                        outcome: Outcome::Release {
                            delay: Duration::ZERO,
                        },
                    });
                }
            }
            if !self.complete(&pre, read_at).await {
                return;
            }
        }
        // The messages carry the number of this attempt (1 on the first publish), as the row
        // records it once the attempt completes: the `outbox-attempt` header.
        for w in work.iter_mut() {
            w.message.attempts = w.attempt();
        }
        // Copies for the hooks only: no per-message clone on the hot path without them. Rows
        // whose outcome is already known (malformed, attempts exhausted) are not published and
        // not shown: a hook that panics on a message cannot keep its dead letter from landing.
        let messages: Vec<Message> = match &inner.hooks {
            Some(_) => work
                .iter()
                .filter(|w| w.outcome.is_none())
                .map(|w| w.message.clone())
                .collect(),
            None => Vec::new(),
        };
        if let Some(h) = &inner.hooks {
            h.before_publish(&messages).await;
        }
        // Routes; no route is a permanent error unless another live relay routes the topic.
        let mut unrouted = Vec::new();
        for (i, w) in work.iter_mut().enumerate() {
            if w.outcome.is_some() {
                continue;
            }
            match inner.router.resolve(&w.message.topic) {
                Some((route, dest)) => {
                    if let Some(policy) = &inner.router.routes()[route].confirm {
                        w.message.headers.insert(
                            crate::confirm::HEADER_REPLY_TO.into(),
                            policy.reply_to.clone(),
                        );
                    }
                    w.route = Some((route, dest));
                }
                None => unrouted.push(i),
            }
        }
        if !unrouted.is_empty() {
            self.route_elsewhere(work, &unrouted).await;
        }
        // Ordered routes: per key, the indexes of its rows in id order (work is in id order
        // within each bucket, and a key lives in one bucket).
        let mut keys: Vec<(String, DeadLetterPolicy, Vec<usize>)> = Vec::new();
        let mut key_index: HashMap<String, usize> = HashMap::new();
        for (i, w) in work.iter().enumerate() {
            let (Some((route, _)), None) = (&w.route, &w.outcome) else {
                continue;
            };
            let (Some(policy), Some(key)) = (
                inner.router.routes()[*route].ordered,
                &w.message.partition_key,
            ) else {
                continue;
            };
            match key_index.get(key) {
                Some(&k) => keys[k].2.push(i),
                None => {
                    key_index.insert(key.clone(), keys.len());
                    keys.push((key.clone(), policy, vec![i]));
                }
            }
        }
        let ordered_rows: BTreeSet<usize> = keys.iter().flat_map(|k| k.2.iter().copied()).collect();
        let mut generation: Vec<usize> = work
            .iter()
            .enumerate()
            .filter(|(i, w)| w.outcome.is_none() && w.route.is_some() && !ordered_rows.contains(i))
            .map(|(i, _)| i)
            .collect();
        // Keys whose head in this batch is the first unfinished message of the key.
        let mut live_keys: Vec<(usize, usize)> = Vec::new(); // (key slot, next position)
        if !keys.is_empty() {
            let names: Vec<String> = keys.iter().map(|k| k.0.clone()).collect();
            let heads = match inner.store.key_heads(&names).await {
                Ok(h) => h,
                Err(e) => {
                    // The ordered rows of this batch are not published (no write); read again.
                    add(&inner.metrics.store_errors, 1);
                    tracing::warn!(error = %e.report(), "key_heads failed; ordered rows of this batch wait");
                    keys.clear();
                    Vec::new()
                }
            };
            let heads: HashMap<String, _> = heads.into_iter().map(|h| (h.key.clone(), h)).collect();
            for (slot, (key, policy, rows)) in keys.iter().enumerate() {
                let first = &work[rows[0]].message;
                let head = heads.get(key);
                let behind_open = head
                    .and_then(|h| h.first_open)
                    .is_some_and(|open| open < first.id);
                let behind_dead = *policy == DeadLetterPolicy::Block
                    && head
                        .and_then(|h| h.first_failed)
                        .is_some_and(|failed| failed < first.id);
                if behind_open || behind_dead {
                    add(&inner.metrics.held_back, rows.len() as u64);
                    tracing::debug!(
                        key,
                        behind_dead,
                        "ordered key held back by an earlier message"
                    );
                    self.hold_back(key, cfg.poll_interval);
                } else {
                    if head
                        .and_then(|h| h.first_failed)
                        .is_some_and(|f| f < first.id)
                    {
                        tracing::warn!(
                            key,
                            id = first.id,
                            "publishing past a dead-lettered message of the same key (on_dead_letter = skip)"
                        );
                    }
                    live_keys.push((slot, 0));
                }
            }
        }
        loop {
            for (slot, pos) in &live_keys {
                generation.push(keys[*slot].2[*pos]);
            }
            if generation.is_empty() {
                break;
            }
            if !self.leases_fresh(work) || read_at.elapsed() + cfg.publish_timeout >= cfg.lease {
                add(&inner.metrics.stale_batches, 1);
                tracing::warn!(
                    rows = generation.len(),
                    "bucket lease nearly expired before publishing; leaving the rows to the next owner"
                );
                break;
            }
            self.publish(work, &generation, read_at, background).await;
            // Advance the keys whose message was acknowledged (or dead-lettered under skip).
            let mut next = Vec::new();
            for (slot, pos) in live_keys {
                let (key, policy, rows) = &keys[slot];
                let w = &work[rows[pos]];
                let go_on = match &w.outcome {
                    Some(Outcome::Sent | Outcome::SentAwaitingConfirmation { .. }) => true,
                    Some(Outcome::Failed { .. }) => *policy == DeadLetterPolicy::Skip,
                    Some(Outcome::Retry { delay, .. }) | Some(Outcome::Release { delay }) => {
                        self.hold_back(key, *delay);
                        false
                    }
                    None => false,
                };
                let remaining = rows.len() - pos - 1;
                if go_on && remaining > 0 {
                    next.push((slot, pos + 1));
                } else if !go_on && remaining > 0 {
                    add(&inner.metrics.held_back, remaining as u64);
                    if *policy == DeadLetterPolicy::Block {
                        self.hold_back(key, cfg.poll_interval);
                    }
                }
            }
            live_keys = next;
            generation = Vec::new();
        }
        if let Some(h) = &inner.hooks {
            h.before_complete(&messages).await;
        }
        let completions: Vec<BucketCompletion> = work
            .iter()
            .filter_map(|w| {
                let outcome = w.outcome.clone()?;
                Some(BucketCompletion {
                    id: w.message.id,
                    bucket: w.bucket,
                    token: w.token,
                    attempts: w.attempts_to_store(&outcome),
                    outcome,
                })
            })
            .collect();
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
        self.complete(&completions, read_at).await;
    }

    /// Decide the rows `idx` of `work`, which no route of this relay matches: a row whose topic
    /// a live peer relay routes (by the route set it advertised) is released untouched (no
    /// attempt counted, due again after `poll_interval`) and its bucket is marked for hand-over
    /// to that peer; a row no live relay routes is dead-lettered `no route for topic …`. When
    /// the membership cannot be read, the rows are released (a database error is no reason to
    /// dead-letter).
    async fn route_elsewhere(&self, work: &mut [Work], idx: &[usize]) {
        let inner = &self.inner;
        let cfg = &inner.config;
        let release = Outcome::Release {
            delay: cfg.poll_interval,
        };
        let peers: Vec<(String, Vec<crate::transport::TopicPattern>)> = match inner
            .store
            .relays(cfg.lease)
            .await
        {
            Ok(relays) => relays
                .into_iter()
                .filter(|r| r.name != cfg.name)
                .filter_map(|r| {
                    let patterns = r
                        .routes?
                        .iter()
                        .map(|p| crate::transport::TopicPattern::parse(p))
                        .collect();
                    Some((r.name, patterns))
                })
                .collect(),
            Err(e) => {
                add(&inner.metrics.store_errors, 1);
                tracing::warn!(error = %e.report(), rows = idx.len(), "no local route and the membership could not be read; releasing the rows");
                for &i in idx {
                    work[i].outcome = Some(release.clone());
                }
                return;
            }
        };
        let mut handed: BTreeMap<String, (usize, String)> = BTreeMap::new();
        for &i in idx {
            let w = &mut work[i];
            let peer = peers
                .iter()
                .find(|(_, patterns)| patterns.iter().any(|p| p.matches(&w.message.topic)));
            match peer {
                Some((name, _)) => {
                    w.outcome = Some(release.clone());
                    inner
                        .handoffs
                        .lock()
                        .expect("handoffs lock")
                        .entry(w.bucket)
                        .or_insert_with(|| name.clone());
                    let e = handed
                        .entry(name.clone())
                        .or_insert_with(|| (0, w.message.topic.clone()));
                    e.0 += 1;
                }
                None => {
                    w.outcome = Some(Outcome::Failed {
                        reason: format!(
                            "no route for topic {:?} (on this relay nor on any live relay)",
                            w.message.topic
                        ),
                    })
                }
            }
        }
        for (peer, (rows, topic)) in handed {
            tracing::warn!(
                relay = %cfg.name,
                peer,
                rows,
                topic,
                "no local route for these messages but the live relay {peer} routes them: released \
                 untouched, their buckets are handed over to it"
            );
        }
    }

    /// Publish the rows `idx` of `work`, pipelined per transport, and set their outcomes.
    async fn publish(
        &self,
        work: &mut [Work],
        idx: &[usize],
        read_at: Instant,
        background: &CancellationToken,
    ) {
        let inner = &self.inner;
        let cfg = &inner.config;
        let mut groups: Vec<Vec<usize>> = vec![Vec::new(); inner.transports.len()];
        for &i in idx {
            let (route, _) = work[i].route.as_ref().expect("routed");
            let t = &inner.router.routes()[*route].transport;
            let ti = inner
                .transports
                .iter()
                .position(|x| Arc::ptr_eq(x, t))
                .expect("transport listed");
            // What the broker cannot carry (a header from plain SQL) is dead-lettered, never sent.
            if let Some(refused) = refused_by_transport(t.as_ref(), &work[i]) {
                work[i].outcome = Some(refused);
                continue;
            }
            if inner.health[ti].down.load(Ordering::Acquire) {
                work[i].outcome = Some(Outcome::Release {
                    delay: cfg.probe_backoff.max.min(Duration::from_secs(1)),
                });
            } else {
                groups[ti].push(i);
            }
        }
        let shared: &[Work] = work;
        let publishes = groups
            .iter()
            .enumerate()
            .filter(|(_, g)| !g.is_empty())
            .map(|(ti, g)| {
                let batch: Vec<Outgoing<'_>> = g
                    .iter()
                    .map(|&i| Outgoing {
                        message: &shared[i].message,
                        destination: shared[i].route.as_ref().expect("routed").1.as_str(),
                    })
                    .collect();
                async move {
                    let results = self.publish_group(ti, &batch, shared, read_at).await;
                    (ti, results)
                }
            });
        let results = futures::future::join_all(publishes).await;
        for (ti, res) in results {
            let mut unavailable = None;
            let mut accepted = false;
            for (&i, r) in groups[ti].iter().zip(res) {
                let r = match r {
                    Published::Done(r) => r,
                    Published::NotSent => {
                        // Never handed to the broker: no attempt made.
                        work[i].outcome = Some(Outcome::Release {
                            delay: Duration::ZERO,
                        });
                        continue;
                    }
                };
                let w = &work[i];
                let attempt = w.attempt();
                let max = w.message.max_attempts;
                let confirm = inner.router.routes()[w.route.as_ref().expect("routed").0]
                    .confirm
                    .as_ref()
                    .map(|p| p.timeout);
                let dest = &w.route.as_ref().expect("routed").1;
                let outcome = match r {
                    Ok(()) => {
                        accepted = true;
                        self.destination_found(ti, dest);
                        match confirm {
                            Some(within) => Outcome::SentAwaitingConfirmation { within },
                            None => Outcome::Sent,
                        }
                    }
                    Err(e) => match e.kind() {
                        TransportErrorKind::Unavailable
                            if e.is_missing_destination() && self.missing_too_long(ti, dest) =>
                        {
                            Outcome::Failed {
                                reason: format!(
                                    "destination missing for longer than missing_destination_grace ({:?}): {}",
                                    cfg.missing_destination_grace,
                                    e.report()
                                ),
                            }
                        }
                        TransportErrorKind::Unavailable => {
                            unavailable = Some(e.report());
                            Outcome::Release {
                                delay: Duration::from_millis(500),
                            }
                        }
                        TransportErrorKind::Permanent => Outcome::Failed { reason: e.report() },
                        TransportErrorKind::Retryable if attempt >= max => Outcome::Failed {
                            reason: format!("attempts exhausted ({attempt}): {}", e.report()),
                        },
                        TransportErrorKind::Retryable => Outcome::Retry {
                            delay: cfg.backoff.delay(attempt),
                            error: e.report(),
                        },
                    },
                };
                work[i].outcome = Some(outcome);
            }
            if let Some(reason) = unavailable {
                self.mark_down(ti, reason, background.clone());
            } else if accepted {
                self.mark_up(ti);
            }
        }
    }

    /// Publish one transport's share of a batch under `publish_timeout`, containing panics: one
    /// result per message of `batch`, in order.
    ///
    /// - The transport records each message's result as it is known ([`Acks`]); when the time
    ///   runs out, the recorded results stand, the messages in doubt get a timeout error
    ///   (`Unavailable` when a probe says the broker is unreachable, else retryable) and those
    ///   never sent are released untouched. A warning gives the counts.
    /// - A panic is contained: the messages without a result are published again one at a time;
    ///   the one that panics alone is dead-lettered (`transport panicked: …`), the others get
    ///   their own outcomes. When every message panics alone the transport itself is broken:
    ///   they are retried with backoff instead.
    async fn publish_group(
        &self,
        ti: usize,
        batch: &[Outgoing<'_>],
        work: &[Work],
        read_at: Instant,
    ) -> Vec<Published> {
        let inner = &self.inner;
        let transport = &inner.transports[ti];
        let acks = Acks::new(batch.len());
        let run = AssertUnwindSafe(transport.publish_each(batch, &acks)).catch_unwind();
        let ran = tokio::time::timeout(inner.config.publish_timeout, run).await;
        let states = acks.take();
        match ran {
            Ok(Ok(())) => states
                .into_iter()
                .map(|s| match s {
                    AckState::Done(r) => Published::Done(r),
                    AckState::InDoubt | AckState::NotSent => {
                        Published::Done(Err(TransportError::retryable(format!(
                            "transport {} returned no result for this message",
                            transport.name()
                        ))))
                    }
                })
                .collect(),
            Err(_) => self.timed_out(transport, states).await,
            Ok(Err(panic)) => {
                let reason = format!("transport panicked: {}", panic_message(panic.as_ref()));
                add(&inner.metrics.panics, 1);
                let mut out: Vec<Option<Published>> = Vec::with_capacity(batch.len());
                let mut todo = Vec::new();
                for (i, s) in states.into_iter().enumerate() {
                    match s {
                        AckState::Done(r) => out.push(Some(Published::Done(r))),
                        AckState::InDoubt | AckState::NotSent => {
                            out.push(None);
                            todo.push(i);
                        }
                    }
                }
                if batch.len() == 1 {
                    tracing::error!(
                        transport = transport.name(),
                        id = batch[0].message.id,
                        reason,
                        "the transport panicked publishing this message alone; dead-lettering it"
                    );
                    if out[0].is_none() {
                        out[0] = Some(Published::Done(Err(TransportError::permanent(reason))));
                    }
                    return out.into_iter().map(|o| o.expect("set")).collect();
                }
                tracing::error!(
                    transport = transport.name(),
                    messages = batch.len(),
                    without_result = todo.len(),
                    reason,
                    "the transport panicked publishing a batch; publishing its messages one at a time to find the poison message"
                );
                let cfg = &inner.config;
                let (mut panicked, mut succeeded) = (Vec::new(), 0usize);
                for &i in &todo {
                    if read_at.elapsed() + cfg.publish_timeout >= cfg.lease
                        || !self.leases_fresh(work)
                    {
                        // Out of time for this batch: the rest is read again.
                        break;
                    }
                    let one = Acks::new(1);
                    let single = std::slice::from_ref(&batch[i]);
                    let run = AssertUnwindSafe(transport.publish_each(single, &one)).catch_unwind();
                    let r = match tokio::time::timeout(cfg.publish_timeout, run).await {
                        Ok(Ok(())) => match one.take().pop() {
                            Some(AckState::Done(r)) => Published::Done(r),
                            _ => Published::Done(Err(TransportError::retryable(format!(
                                "transport {} returned no result for this message",
                                transport.name()
                            )))),
                        },
                        Err(_) => self
                            .timed_out(transport, one.take())
                            .await
                            .pop()
                            .expect("one"),
                        Ok(Err(panic)) => {
                            add(&inner.metrics.panics, 1);
                            let reason =
                                format!("transport panicked: {}", panic_message(panic.as_ref()));
                            tracing::error!(
                                transport = transport.name(),
                                id = batch[i].message.id,
                                reason,
                                "the transport panicked publishing this message alone"
                            );
                            panicked.push(i);
                            Published::Done(Err(TransportError::permanent(reason)))
                        }
                    };
                    if matches!(r, Published::Done(Ok(()))) {
                        succeeded += 1;
                    }
                    out[i] = Some(r);
                }
                if panicked.len() > 1 && succeeded == 0 {
                    // Every message panicked alone: the transport is broken, not the messages.
                    tracing::error!(
                        transport = transport.name(),
                        messages = panicked.len(),
                        "the transport panics on every message; retrying them with backoff instead of dead-lettering"
                    );
                    for &i in &panicked {
                        if let Some(Published::Done(Err(e))) = out[i].take() {
                            out[i] =
                                Some(Published::Done(Err(TransportError::retryable(e.message()))));
                        }
                    }
                }
                out.into_iter()
                    .map(|o| o.unwrap_or(Published::NotSent))
                    .collect()
            }
        }
    }

    /// The results of a publish whose `publish_timeout` ran out, from what the transport had
    /// recorded by then; logs the counts.
    async fn timed_out(
        &self,
        transport: &Arc<dyn Transport>,
        states: Vec<AckState>,
    ) -> Vec<Published> {
        let cfg = &self.inner.config;
        let (mut acked, mut failed, mut in_doubt, mut not_sent) = (0usize, 0usize, 0usize, 0usize);
        for s in &states {
            match s {
                AckState::Done(Ok(())) => acked += 1,
                AckState::Done(Err(_)) => failed += 1,
                AckState::InDoubt => in_doubt += 1,
                AckState::NotSent => not_sent += 1,
            }
        }
        // A timeout while the broker is unreachable is an outage, not a failed attempt: ask
        // the transport which it was.
        let reason = format!("publish timed out after {:?}", cfg.publish_timeout);
        let kind = if in_doubt == 0 {
            TransportErrorKind::Retryable
        } else {
            match transport.probe().await {
                Err(e) if e.kind() == TransportErrorKind::Unavailable => {
                    TransportErrorKind::Unavailable
                }
                _ => TransportErrorKind::Retryable,
            }
        };
        tracing::warn!(
            transport = transport.name(),
            timeout = ?cfg.publish_timeout,
            acknowledged = acked,
            failed,
            timed_out = in_doubt,
            not_sent,
            "publish timed out: acknowledged messages are recorded, the unanswered ones retried, the unsent ones released"
        );
        add(&self.inner.metrics.publish_timeouts, 1);
        states
            .into_iter()
            .map(|s| match s {
                AckState::Done(r) => Published::Done(r),
                AckState::InDoubt => {
                    Published::Done(Err(TransportError::new(kind, reason.clone())))
                }
                AckState::NotSent => Published::NotSent,
            })
            .collect()
    }

    /// Record outcomes in one statement, retrying transient database errors until the lease
    /// would have expired. Returns whether the statement ran (rows of lost buckets excepted).
    async fn complete(&self, completions: &[BucketCompletion], read_at: Instant) -> bool {
        let inner = &self.inner;
        if completions.is_empty() {
            return true;
        }
        let mut failures = 0u32;
        loop {
            match inner
                .store
                .complete_in_buckets(&inner.config.name, completions)
                .await
            {
                Ok(matched) => {
                    add(&inner.metrics.completion_writes, 1);
                    let lost = completions.len() as u64 - matched.min(completions.len() as u64);
                    if lost > 0 {
                        // Stop using these buckets until a membership round confirms which of
                        // them are still held (the others were taken over).
                        {
                            let mut own = inner.ownership.lock().expect("ownership lock");
                            let now = Instant::now();
                            for c in completions {
                                for h in own.held.values_mut().filter(|h| h.token == c.token) {
                                    h.valid_until = h.valid_until.min(now);
                                }
                            }
                        }
                        inner.renew_now.notify_one();
                        add(&inner.metrics.lost_leases, lost);
                        tracing::warn!(
                            lost,
                            "completion refused for rows of buckets taken over; the new owner publishes them again"
                        );
                    }
                    return true;
                }
                Err(e) => {
                    failures += 1;
                    add(&inner.metrics.store_errors, 1);
                    let wait = inner.config.probe_backoff.delay(failures);
                    if read_at.elapsed() + wait >= inner.config.lease {
                        tracing::error!(error = %e.report(), "completion failed until the lease ran out; the rows are published again");
                        return false;
                    }
                    tracing::warn!(error = %e.report(), failures, "completion failed; retrying");
                    tokio::time::sleep(wait).await;
                }
            }
        }
    }

    /// Give every held bucket back and leave the membership (graceful shutdown).
    async fn leave(&self) {
        let held: Vec<(Bucket, LeaseToken)> = {
            let mut own = self.inner.ownership.lock().expect("ownership lock");
            let held = own.held.iter().map(|(b, h)| (*b, h.token)).collect();
            own.held.clear();
            held
        };
        let n = held.len() as u64;
        match self
            .inner
            .store
            .release_buckets(&self.inner.config.name, &held, true)
            .await
        {
            Ok(()) => add(&self.inner.metrics.buckets_released, n),
            Err(e) => {
                tracing::warn!(error = %e.report(), "could not give the buckets back; they return by lease expiry")
            }
        }
    }

    /// Pause transport `ti` after an `Unavailable` error and probe it with backoff.
    ///
    /// One outage logs one warning when it begins and one info line when it truly ends (a
    /// publish the broker accepted, [`Relay::mark_up`]). A probe that succeeds only lets publishes
    /// try again: when they fail again (a refused permission, a TLS certificate the probe cannot
    /// see, a missing exchange), that is a relapse of the same outage: logged at debug with its
    /// count, and the probe backoff goes on growing from where it was instead of starting over,
    /// so a transport that answers its probe but refuses every publish costs a few publishes per
    /// `probe_backoff.max` and no log storm.
    fn mark_down(&self, ti: usize, reason: String, stop: CancellationToken) {
        let inner = &self.inner;
        let health = &inner.health[ti];
        if health.down.swap(true, Ordering::AcqRel) {
            return;
        }
        let transport = inner.transports[ti].clone();
        let epoch = health.epoch.fetch_add(1, Ordering::AcqRel) + 1;
        if health.recovering.swap(false, Ordering::AcqRel) {
            let relapses = health.relapses.fetch_add(1, Ordering::AcqRel) + 1;
            tracing::debug!(
                transport = transport.name(),
                reason,
                relapses,
                "transport still unavailable after a successful probe; pausing it again"
            );
        } else {
            add(&inner.metrics.outages, 1);
            health.probes.store(0, Ordering::Release);
            health.relapses.store(0, Ordering::Release);
            tracing::warn!(
                transport = transport.name(),
                reason,
                "transport unavailable; pausing it and probing"
            );
        }
        let relay = self.clone();
        tokio::spawn(async move {
            let inner = &relay.inner;
            let health = &inner.health[ti];
            loop {
                let n = health.probes.fetch_add(1, Ordering::AcqRel) + 1;
                tokio::select! {
                    // The relay stopped or crashed: nobody needs the answer any more. A later
                    // run starts with the transport presumed up and finds out again.
                    _ = stop.cancelled() => {
                        health.recovering.store(false, Ordering::Release);
                        health.down.store(false, Ordering::Release);
                        return;
                    }
                    _ = tokio::time::sleep(inner.config.probe_backoff.delay(n)) => {}
                }
                match transport.probe().await {
                    Ok(()) => {
                        tracing::debug!(
                            transport = transport.name(),
                            probes = n,
                            "probe succeeded; publishing again"
                        );
                        break;
                    }
                    Err(e) => {
                        tracing::debug!(transport = transport.name(), error = %e.report(), probes = n, "probe failed")
                    }
                }
            }
            health.recovering.store(true, Ordering::Release);
            health.down.store(false, Ordering::Release);
            inner.health_changed.notify_waiters();
            inner.store.wake();
            // No publish within a lease after the probe (nothing to send) and no relapse: the
            // outage is over all the same.
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(inner.config.lease) => {}
            }
            if health.epoch.load(Ordering::Acquire) == epoch {
                relay.mark_up(ti);
            }
        });
    }

    /// A publish on transport `ti` was accepted: the outage, if one was going on, is over.
    fn mark_up(&self, ti: usize) {
        let health = &self.inner.health[ti];
        if health.recovering.swap(false, Ordering::AcqRel) {
            tracing::info!(
                transport = self.inner.transports[ti].name(),
                probes = health.probes.swap(0, Ordering::AcqRel),
                relapses = health.relapses.swap(0, Ordering::AcqRel),
                "transport available again"
            );
        }
    }

    /// Whether `destination` of transport `ti` has been missing for longer than
    /// `missing_destination_grace`, counting from the first time it was found missing (now, if
    /// this is the first).
    fn missing_too_long(&self, ti: usize, destination: &str) -> bool {
        let grace = self.inner.config.missing_destination_grace;
        let mut missing = self.inner.missing.lock().expect("missing lock");
        if missing.len() >= 10_000 {
            // Bounded: a flood of distinct missing destinations restarts their grace.
            missing.clear();
        }
        let since = *missing
            .entry((ti, destination.to_owned()))
            .or_insert_with(Instant::now);
        since.elapsed() >= grace
    }

    /// `destination` of transport `ti` accepted a message: it exists (again).
    fn destination_found(&self, ti: usize, destination: &str) {
        let mut missing = self.inner.missing.lock().expect("missing lock");
        if !missing.is_empty() {
            missing.remove(&(ti, destination.to_owned()));
        }
    }
}

/// Membership, on every relay: heartbeat, renew the held bucket leases, acquire free or expired
/// buckets up to the fair share and give back the buckets above it (those not in flight).
/// Every `lease / 3`; every `lease / 10` while below the fair share, so a joining relay gets its
/// share quickly.
async fn membership_loop(relay: Relay, cancel: CancellationToken) {
    let inner = &relay.inner;
    let cfg = &inner.config;
    let mut failures = 0u32;
    // A batch in flight for longer than `lease - publish_timeout` means this relay is stuck
    // (or paused): it stops its heartbeat and renewals like a paused process would, so its
    // buckets expire and another relay takes them over; the stuck batch's completion is then
    // refused by the fence.
    // Logged at error level when found and again every lease while it lasts: a relay that
    // cannot make progress says so ([`Relay::stalled`], `stalled_batches`).
    let mut stuck_logged: Option<Instant> = None;
    // The peers' route sets (hashes) last compared with this relay's.
    let mut route_sets: BTreeMap<String, Option<String>> = BTreeMap::new();
    loop {
        let held: Vec<(Bucket, LeaseToken)> = {
            let own = inner.ownership.lock().expect("ownership lock");
            own.held.iter().map(|(b, h)| (*b, h.token)).collect()
        };
        if let Some(age) = relay.stalled() {
            if stuck_logged.is_none() {
                add(&inner.metrics.stalled_batches, 1);
            }
            if stuck_logged.is_none_or(|t| t.elapsed() >= cfg.lease) {
                tracing::error!(
                    relay = %cfg.name,
                    stalled_for = ?age,
                    lease = ?cfg.lease,
                    "a batch is stuck past its lease: this relay makes no progress; not renewing any bucket until it returns (other relays take them over)"
                );
                stuck_logged = Some(Instant::now());
            }
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tokio::time::sleep(cfg.lease / 10) => continue,
            }
        }
        if stuck_logged.take().is_some() {
            tracing::info!(relay = %cfg.name, "the stuck batch returned; renewing buckets again");
        }
        let req = MembershipRequest {
            relay: cfg.name.clone(),
            lease: cfg.lease,
            held: held.clone(),
            acquire: true,
            routes: inner.routes.clone(),
        };
        let started = Instant::now();
        let mut below_share = false;
        match inner.store.membership(&req).await {
            Ok(round) => {
                failures = 0;
                let valid_until = started + cfg.lease;
                let mut release = Vec::new();
                let mut acquired = !round.acquired.is_empty();
                {
                    let mut own = inner.ownership.lock().expect("ownership lock");
                    let renewed: BTreeSet<Bucket> = round.renewed.iter().copied().collect();
                    for (b, token) in &held {
                        if renewed.contains(b) {
                            if let Some(h) = own.held.get_mut(b) {
                                // A bucket suspended after a refused completion is usable again.
                                acquired |= h.valid_until <= Instant::now() + cfg.publish_timeout;
                                h.valid_until = valid_until;
                            }
                        } else if own.held.get(b).is_some_and(|h| h.token == *token) {
                            own.held.remove(b);
                            add(&inner.metrics.buckets_lost, 1);
                            tracing::warn!(bucket = b, "bucket lease lost to another relay");
                        }
                    }
                    for l in &round.acquired {
                        let handed = round.handed_over.contains(&l.bucket);
                        own.held.insert(
                            l.bucket,
                            Held {
                                token: l.token,
                                valid_until,
                                suspect: l.takeover,
                                handed_until: handed.then(|| started + cfg.lease),
                            },
                        );
                        add(&inner.metrics.buckets_acquired, 1);
                        if handed {
                            tracing::info!(
                                bucket = l.bucket,
                                "took a bucket another relay handed over: it holds messages only this relay routes"
                            );
                        }
                        if l.takeover {
                            add(&inner.metrics.takeovers, 1);
                            tracing::info!(
                                bucket = l.bucket,
                                "took over a bucket whose lease expired"
                            );
                        }
                    }
                    own.fair_share = round.fair_share;
                    let share = round.fair_share as usize;
                    below_share = own.held.len() < share;
                    let excess = own.held.len().saturating_sub(share);
                    if excess > 0 {
                        // Buckets handed over to this relay within the last lease are kept
                        // (above the share if need be): they hold messages only it routes.
                        let now = Instant::now();
                        let spare: Vec<(Bucket, LeaseToken)> = own
                            .held
                            .iter()
                            .rev()
                            .filter(|(b, h)| {
                                !own.in_flight.contains_key(b)
                                    && h.handed_until.is_none_or(|t| t <= now)
                            })
                            .take(excess)
                            .map(|(b, h)| (*b, h.token))
                            .collect();
                        for (b, _) in &spare {
                            own.held.remove(b);
                        }
                        release = spare;
                    }
                }
                if acquired {
                    tracing::debug!(
                        relay = %cfg.name,
                        acquired = round.acquired.len(),
                        live = round.live_relays,
                        share = round.fair_share,
                        "buckets acquired"
                    );
                    inner.changed.notify_one();
                }
                if !release.is_empty() {
                    let n = release.len() as u64;
                    match inner
                        .store
                        .release_buckets(&cfg.name, &release, false)
                        .await
                    {
                        Ok(()) => {
                            add(&inner.metrics.buckets_released, n);
                            tracing::debug!(relay = %cfg.name, released = n, live = round.live_relays, "buckets above the fair share given back");
                        }
                        Err(e) => {
                            add(&inner.metrics.store_errors, 1);
                            tracing::warn!(error = %e.report(), "could not give buckets back; they return by lease expiry");
                        }
                    }
                }
                hand_off(&relay).await;
                check_route_sets(&relay, &mut route_sets).await;
            }
            Err(e) => {
                failures += 1;
                add(&inner.metrics.store_errors, 1);
                tracing::warn!(error = %e.report(), failures, "membership round failed; retrying");
            }
        }
        let wait = if failures > 0 {
            cfg.probe_backoff.delay(failures).min(cfg.lease / 3)
        } else if below_share {
            cfg.lease / 10
        } else {
            cfg.lease / 3
        };
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = inner.renew_now.notified() => {}
            _ = tokio::time::sleep(wait) => {}
        }
    }
}

/// Hand the buckets marked by [`Relay::route_elsewhere`] over to the relays that route their
/// messages: those held and not in flight (the others wait for the next round).
async fn hand_off(relay: &Relay) {
    let inner = &relay.inner;
    let cfg = &inner.config;
    let mut to: BTreeMap<String, Vec<(Bucket, LeaseToken)>> = BTreeMap::new();
    {
        let mut own = inner.ownership.lock().expect("ownership lock");
        let mut handoffs = inner.handoffs.lock().expect("handoffs lock");
        handoffs.retain(|b, peer| {
            if own.in_flight.contains_key(b) {
                return true;
            }
            if let Some(h) = own.held.remove(b) {
                to.entry(peer.clone()).or_default().push((*b, h.token));
            }
            false
        });
    }
    for (peer, buckets) in to {
        let n = buckets.len() as u64;
        match inner
            .store
            .hand_off_buckets(&cfg.name, &buckets, &peer, cfg.lease)
            .await
        {
            Ok(()) => {
                add(&inner.metrics.buckets_released, n);
                tracing::info!(
                    relay = %cfg.name,
                    peer,
                    buckets = ?buckets.iter().map(|(b, _)| *b).collect::<Vec<_>>(),
                    "buckets handed over to the relay that routes their messages"
                );
            }
            Err(e) => {
                add(&inner.metrics.store_errors, 1);
                tracing::warn!(error = %e.report(), peer, "could not hand buckets over; they return by lease expiry");
            }
        }
    }
}

/// Compare the live peers' advertised route sets with this relay's and log an error naming
/// both relays and the difference, at the first round and whenever a peer's set changes.
/// `seen` keeps the peers' hashes last compared.
async fn check_route_sets(relay: &Relay, seen: &mut BTreeMap<String, Option<String>>) {
    let inner = &relay.inner;
    let cfg = &inner.config;
    let relays = match inner.store.relays(cfg.lease).await {
        Ok(r) => r,
        Err(e) => {
            tracing::debug!(error = %e.report(), "could not read the membership's route sets");
            return;
        }
    };
    let mine = crate::store::routes_hash(&inner.routes);
    let now: BTreeMap<String, Option<String>> = relays
        .iter()
        .filter(|r| r.name != cfg.name)
        .map(|r| (r.name.clone(), r.routes_hash.clone()))
        .collect();
    for r in relays.iter().filter(|r| r.name != cfg.name) {
        if seen.get(&r.name) == Some(&r.routes_hash) {
            continue;
        }
        match &r.routes {
            Some(theirs) if r.routes_hash.as_deref() == Some(mine.as_str()) => {
                tracing::debug!(peer = r.name, routes = ?theirs, "peer relay routes the same topics");
            }
            Some(theirs) => {
                let only_here: Vec<&String> = inner
                    .routes
                    .iter()
                    .filter(|p| !theirs.contains(p))
                    .collect();
                let only_there: Vec<&String> = theirs
                    .iter()
                    .filter(|p| !inner.routes.contains(p))
                    .collect();
                tracing::error!(
                    relay = %cfg.name,
                    peer = r.name,
                    ?only_here,
                    ?only_there,
                    "relays {} and {} on one table route different topics (only {}: {:?}; only {}: {:?}): \
                     a message only one of them routes is handed over to it, never dead-lettered while it \
                     is live, but it waits for the hand-over; give every relay the same routes (docs/ordering.md)",
                    cfg.name, r.name, cfg.name, only_here, r.name, only_there
                );
            }
            None => {
                tracing::error!(
                    relay = %cfg.name,
                    peer = r.name,
                    "relay {} advertises no route set (a version before schema v6): messages it cannot \
                     route are dead-lettered by it; upgrade every relay (docs/ordering.md)",
                    r.name
                );
            }
        }
    }
    *seen = now;
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
                tracing::warn!(error = %e.report(), "relay maintenance failed");
            }
        }
    }
}
