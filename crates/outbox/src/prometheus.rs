//! Prometheus metrics (feature `prometheus`; issue 14, docs/operations.md): a relay's counters,
//! histograms and state read at scrape time ([`register`]), the outbox backlog sampled from the
//! store, a consumer runner's counters ([`register_consumer`]) and the confirmations applied by
//! the listeners of the process ([`ConfirmationCollector`]).
//!
//! ```no_run
//! # async fn f(relay: outbox::Relay, store: std::sync::Arc<dyn outbox::Store>) {
//! let mut registry = prometheus_client::registry::Registry::default();
//! let cancel = tokio_util::sync::CancellationToken::new();
//! outbox::prometheus::register(&mut registry, &relay, store, std::time::Duration::from_secs(15), cancel);
//! let mut text = String::new();
//! prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
//! # }
//! ```
//!
//! Names follow the Prometheus conventions (<https://prometheus.io/docs/practices/naming/>):
//! `outbox_` prefix, base units (`_seconds`), `_total` on counters (added by the encoder).
//! Labels are bounded: `relay` (the relay's membership name, added by [`register`]) on the
//! relay's metrics, plus `transport` (the transport's [`Transport::name`], its kind: `nats`,
//! `webhook`, …) on `outbox_relay_transport_up` and `kind` (7 values) on
//! `outbox_relay_store_errors_total`; `consumer` (the inbox's consumer name) on a consumer's;
//! none on the backlog (it is the table's, whichever relay samples it) or the confirmations.
//! Two relays or consumers registered under one name would give duplicate series. Every metric
//! is listed in docs/operations.md.
//!
//! [`Transport::name`]: crate::transport::Transport::name

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric, NoLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;

use crate::consumer::ConsumerMetrics;
use crate::histogram::HistogramSnapshot;
use crate::message::Status;
use crate::relay::group::RelayGroup;
use crate::relay::{Relay, RelayMetrics};
use crate::store::{Stats, Store};

/// One exported counter: name (without `_total`), help, and how to read it.
type CounterSpec = (&'static str, &'static str, fn(&RelayMetrics) -> u64);

/// The relay's counters ([`RelayMetrics`]), read at each scrape.
const COUNTERS: &[CounterSpec] = &[
    (
        "outbox_relay_messages_read",
        "Rows read from held buckets to publish.",
        |m| m.claimed.load(Ordering::Relaxed),
    ),
    (
        "outbox_relay_messages_published",
        "Messages the broker acknowledged, recorded SENT.",
        |m| m.sent.load(Ordering::Relaxed),
    ),
    (
        "outbox_relay_messages_retried",
        "Messages rescheduled with backoff after a retryable error.",
        |m| m.retried.load(Ordering::Relaxed),
    ),
    (
        "outbox_relay_messages_dead_lettered",
        "Messages moved to FAILED (dead letter).",
        |m| m.failed.load(Ordering::Relaxed),
    ),
    (
        "outbox_relay_messages_released",
        "Messages given back unpublished (transport paused, shutdown).",
        |m| m.released.load(Ordering::Relaxed),
    ),
    (
        "outbox_relay_messages_held_back",
        "Messages held back behind an earlier message of their key (ordered routes).",
        |m| m.held_back.load(Ordering::Relaxed),
    ),
    (
        "outbox_relay_checked_back",
        "Unconfirmed messages checked back (to PENDING or FAILED).",
        |m| m.checked_back.load(Ordering::Relaxed),
    ),
    (
        "outbox_relay_prepared_committed",
        "Two-phase messages committed by a check-back's COMMIT answer.",
        |m| m.prepared_committed.load(Ordering::Relaxed),
    ),
    (
        "outbox_relay_prepared_rolled_back",
        "Two-phase messages rolled back by a check-back's ROLLBACK answer.",
        |m| m.prepared_rolled_back.load(Ordering::Relaxed),
    ),
    (
        "outbox_relay_prepared_unknown",
        "Check-backs of two-phase messages answered UNKNOWN (counted toward max_checks).",
        |m| m.prepared_unknown.load(Ordering::Relaxed),
    ),
    (
        "outbox_relay_prepared_check_errors",
        "Check-backs of two-phase messages without an answer (errors, garbled answers; not counted).",
        |m| m.prepared_check_errors.load(Ordering::Relaxed),
    ),
    (
        "outbox_relay_prepared_undecided",
        "Two-phase messages parked as UNDECIDED for an operator.",
        |m| m.prepared_undecided.load(Ordering::Relaxed),
    ),
    (
        "outbox_relay_purged",
        "Finished rows deleted by retention.",
        |m| m.purged.load(Ordering::Relaxed),
    ),
    (
        "outbox_relay_archived",
        "Finished rows moved to the archive table by retention.",
        |m| m.archived.load(Ordering::Relaxed),
    ),
    (
        "outbox_relay_buckets_acquired",
        "Bucket leases acquired.",
        |m| m.buckets_acquired.load(Ordering::Relaxed),
    ),
    (
        "outbox_relay_bucket_takeovers",
        "Buckets taken over from a relay whose lease expired.",
        |m| m.takeovers.load(Ordering::Relaxed),
    ),
    (
        "outbox_relay_buckets_lost",
        "Bucket leases lost (not renewed in time).",
        |m| m.buckets_lost.load(Ordering::Relaxed),
    ),
    (
        "outbox_relay_buckets_released",
        "Bucket leases given back.",
        |m| m.buckets_released.load(Ordering::Relaxed),
    ),
    (
        "outbox_relay_lost_leases",
        "Completion rows refused by the lease fence (their bucket was taken over).",
        |m| m.lost_leases.load(Ordering::Relaxed),
    ),
    (
        "outbox_relay_stale_batches",
        "Batches not published because a bucket lease was lost or about to expire; their rows are left to the next owner.",
        |m| m.stale_batches.load(Ordering::Relaxed),
    ),
    (
        "outbox_relay_completion_writes",
        "Completion statements written.",
        |m| m.completion_writes.load(Ordering::Relaxed),
    ),
    (
        "outbox_relay_transport_outages",
        "Transport outages (paused, then probed).",
        |m| m.outages.load(Ordering::Relaxed),
    ),
    (
        "outbox_relay_destination_busy",
        "Publishes a destination refused for now (a RabbitMQ nack, an HTTP 429), released without counting the attempt.",
        |m| m.busy.load(Ordering::Relaxed),
    ),
    (
        "outbox_relay_publish_timeouts",
        "Batches whose publish exceeded publish_timeout.",
        |m| m.publish_timeouts.load(Ordering::Relaxed),
    ),
    (
        "outbox_relay_stalled_batches",
        "Times a batch was found in flight past lease - publish_timeout (the relay stops renewing its buckets).",
        |m| m.stalled_batches.load(Ordering::Relaxed),
    ),
    (
        "outbox_relay_panics",
        "Panics contained (in a transport or a hook).",
        |m| m.panics.load(Ordering::Relaxed),
    ),
];

/// A relay's counters and histograms ([`RelayMetrics`]) as a Prometheus [`Collector`], read at
/// each scrape: 19 monotonic counters named `outbox_relay_…` (the encoder appends `_total`),
/// `outbox_relay_store_errors_total{kind}` (one series per [`StoreErrorKind`](crate::StoreErrorKind)
/// label, [`StoreErrorKind::as_str`](crate::StoreErrorKind::as_str)), and the histograms
/// `outbox_relay_publish_duration_seconds`, `outbox_relay_publish_batch_messages` and
/// `outbox_relay_enqueue_to_ack_seconds`. It adds no label itself: [`register`] puts it in a
/// sub-registry labelled `relay="<name>"`.
#[derive(Debug)]
pub struct RelayCollector {
    metrics: Arc<RelayMetrics>,
}

impl RelayCollector {
    /// The counters of `metrics`.
    pub fn new(metrics: Arc<RelayMetrics>) -> Self {
        RelayCollector { metrics }
    }
}

impl Collector for RelayCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let m = &self.metrics;
        for (name, help, read) in COUNTERS {
            let c = ConstCounter::new(read(m));
            c.encode(encoder.encode_descriptor(name, help, None, c.metric_type())?)?;
        }
        let (name, help) = STORE_ERRORS;
        let mut family = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
        for (kind, n) in m.store_errors_by_kind() {
            let labels = [("kind", kind.as_str())];
            ConstCounter::new(n).encode(family.encode_family(&labels)?)?;
        }
        for (name, help, read) in HISTOGRAMS {
            histogram(&mut encoder, name, help, read(m))?;
        }
        Ok(())
    }
}

/// The family of database errors by kind: name, help.
const STORE_ERRORS: (&str, &str) = (
    "outbox_relay_store_errors",
    "Database errors of the relay's statements (all retried), by kind.",
);

/// One exported histogram: name, help, and how to read it.
type HistogramSpec = (
    &'static str,
    &'static str,
    fn(&RelayMetrics) -> HistogramSnapshot,
);

/// The relay's histograms ([`RelayMetrics`]), read at each scrape.
const HISTOGRAMS: [HistogramSpec; 3] = [
    (
        "outbox_relay_publish_duration_seconds",
        "Time one transport's share of a batch took to publish: handed over to last acknowledgement (or publish_timeout).",
        |m| m.publish_duration.snapshot(),
    ),
    (
        "outbox_relay_publish_batch_messages",
        "Messages per publish (one transport's share of a batch).",
        |m| m.publish_batch.snapshot(),
    ),
    (
        "outbox_relay_enqueue_to_ack_seconds",
        "From a message becoming due (its row's creation, database clock, or the end of its delay) to the broker's acknowledgement; first attempts only.",
        |m| m.enqueue_to_ack.snapshot(),
    ),
];

/// Encode one histogram without labels of its own.
fn histogram(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    s: HistogramSnapshot,
) -> Result<(), std::fmt::Error> {
    encoder
        .encode_descriptor(name, help, None, MetricType::Histogram)?
        .encode_histogram::<NoLabelSet>(s.sum, s.count, &s.buckets, None)
}

/// The counters of a consumer runner ([`ConsumerMetrics`], shared with the runner) as
/// `outbox_consumer_…` counters and the `outbox_consumer_handler_duration_seconds` histogram.
/// [`register_consumer`] labels them `consumer="<name>"` (the inbox's consumer name).
#[derive(Debug)]
pub struct ConsumerCollector {
    metrics: Arc<ConsumerMetrics>,
}

impl ConsumerCollector {
    /// The counters of `metrics`.
    pub fn new(metrics: Arc<ConsumerMetrics>) -> Self {
        ConsumerCollector { metrics }
    }
}

/// One exported consumer counter: name (without `_total`), help, and how to read it.
type ConsumerCounterSpec = (
    &'static str,
    &'static str,
    fn(&ConsumerMetrics) -> &AtomicU64,
);

const CONSUMER_COUNTERS: &[ConsumerCounterSpec] = &[
    (
        "outbox_consumer_messages_applied",
        "Messages applied by the handler in the inbox transaction.",
        |m| &m.applied,
    ),
    (
        "outbox_consumer_messages_rejected",
        "Messages the handler rejected (business refusal), recorded and confirmed as rejected.",
        |m| &m.rejected,
    ),
    (
        "outbox_consumer_messages_duplicate",
        "Copies recognised by the inbox and acknowledged without running the handler.",
        |m| &m.duplicates,
    ),
    (
        "outbox_consumer_messages_failed",
        "Handler or inbox failures: not acknowledged, redelivered after a backoff.",
        |m| &m.failures,
    ),
    (
        "outbox_consumer_messages_dead_lettered",
        "Messages moved to the consumer's dead-letter table.",
        |m| &m.dead_lettered,
    ),
    (
        "outbox_consumer_messages_malformed",
        "Messages without readable outbox headers, rejected.",
        |m| &m.malformed,
    ),
    (
        "outbox_consumer_messages_replayed",
        "Dead letters replayed on an operator's request.",
        |m| &m.replayed,
    ),
    (
        "outbox_consumer_messages_lost",
        "Deliveries whose message was gone from the broker (acknowledged and logged).",
        |m| &m.lost,
    ),
    (
        "outbox_consumer_inbox_batches",
        "Inbox transactions that committed a batch of several messages together.",
        |m| &m.inbox_batches,
    ),
    (
        "outbox_consumer_inbox_batch_splits",
        "Inbox batches rolled back at a failing handler and applied again around it.",
        |m| &m.inbox_batch_splits,
    ),
    (
        "outbox_consumer_reconnects",
        "Times the runner lost its broker connection or consumer and opened it again.",
        |m| &m.reconnects,
    ),
    (
        "outbox_consumer_confirmations_sent",
        "Confirmations sent to the producer.",
        |m| &m.confirmations_sent,
    ),
    (
        "outbox_consumer_confirmations_failed",
        "Confirmations that could not be sent (the producer's check-back asks again).",
        |m| &m.confirmation_failures,
    ),
];

impl Collector for ConsumerCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        for (name, help, read) in CONSUMER_COUNTERS {
            let c = ConstCounter::new(read(&self.metrics).load(Ordering::Relaxed));
            c.encode(encoder.encode_descriptor(name, help, None, c.metric_type())?)?;
        }
        histogram(
            &mut encoder,
            "outbox_consumer_handler_duration_seconds",
            "Time each delivery spent in the inbox: duplicate check, handler and commit.",
            self.metrics.handler_duration.snapshot(),
        )
    }
}

/// The confirmations applied by every listener of this process
/// ([`confirm::process_totals`]) as `outbox_confirmations_{confirmed,rejected,duplicate,
/// unknown,failed_hooks}_total`. No label: register it once per registry.
#[derive(Debug, Default)]
pub struct ConfirmationCollector;

impl Collector for ConfirmationCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let t = crate::confirm::process_totals();
        let counters = [
            (
                "outbox_confirmations_confirmed",
                "Messages moved to CONFIRMED by a consumer's confirmation.",
                t.confirmed,
            ),
            (
                "outbox_confirmations_rejected",
                "Messages moved to REJECTED (their rejection hook ran).",
                t.rejected,
            ),
            (
                "outbox_confirmations_duplicate",
                "Confirmations for messages already CONFIRMED or REJECTED.",
                t.duplicates,
            ),
            (
                "outbox_confirmations_unknown",
                "Confirmations for message ids this outbox does not have.",
                t.unknown,
            ),
            (
                "outbox_confirmations_failed_hooks",
                "Rejections whose hook failed (rolled back; applied when the rejection comes again).",
                t.failed_hooks,
            ),
        ];
        for (name, help, n) in counters {
            let c = ConstCounter::new(n);
            c.encode(encoder.encode_descriptor(name, help, None, c.metric_type())?)?;
        }
        Ok(())
    }
}

/// Register a consumer runner's counters ([`ConsumerCollector`]) on `registry`, labelled
/// `consumer="<consumer>"` (use the inbox's consumer name; one registration per runner).
pub fn register_consumer(registry: &mut Registry, consumer: &str, metrics: Arc<ConsumerMetrics>) {
    registry
        .sub_registry_with_label(("consumer".into(), consumer.to_owned().into()))
        .register_collector(Box::new(ConsumerCollector::new(metrics)));
}

/// Gauges of a relay's state: `outbox_relay_transport_up{transport="<kind>"}` 1 when up, 0
/// while it is paused after an `Unavailable` error and probed (one series per transport of the
/// router; the label is [`Relay::transports_up`]'s name, the transport's kind), and
/// `outbox_relay_healthy` 1 or 0 as [`Relay::health`] says.
pub struct RelayStateCollector {
    relay: Relay,
}

impl std::fmt::Debug for RelayStateCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RelayStateCollector")
            .field("relay", &self.relay.config().name)
            .finish()
    }
}

impl RelayStateCollector {
    /// The state of `relay`.
    pub fn new(relay: Relay) -> Self {
        RelayStateCollector { relay }
    }
}

impl Collector for RelayStateCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let up = ConstGauge::new(0i64);
        let mut family = encoder.encode_descriptor(
            "outbox_relay_transport_up",
            "Whether the transport is up (0 while paused after an Unavailable error and probed).",
            None,
            up.metric_type(),
        )?;
        for (name, is_up) in self.relay.transports_up() {
            let labels = [("transport".to_owned(), name)];
            ConstGauge::new(i64::from(is_up)).encode(family.encode_family(&labels)?)?;
        }
        let healthy = ConstGauge::new(i64::from(self.relay.health().is_ok()));
        healthy.encode(encoder.encode_descriptor(
            "outbox_relay_healthy",
            "Whether the relay makes progress (1) or /healthz fails (0).",
            None,
            healthy.metric_type(),
        )?)
    }
}

/// The outbox backlog, sampled from [`Store::stats`] every `interval` by a task, so a scrape
/// costs no query: gauges `outbox_backlog_pending_messages`, `…_failed_messages`,
/// `…_awaiting_confirmation_messages`, `…_prepared_messages`, `…_undecided_messages` (rows),
/// `…_oldest_pending_age_seconds`,
/// `…_oldest_unconfirmed_age_seconds` (0 when none) and `outbox_backlog_sample_age_seconds`.
/// Nothing is exported before the first successful sample (alert on the series' absence too).
#[derive(Debug, Default)]
pub struct BacklogCollector {
    sample: Mutex<Option<(std::time::SystemTime, Stats)>>,
}

impl BacklogCollector {
    /// Sample `store` now and then every `interval` (at least 100 ms) until `cancel`; a failed
    /// sample keeps the previous one (its age grows, which is what to alert on).
    ///
    /// # Panics
    /// Outside a Tokio runtime (it spawns the sampling task).
    pub fn spawn(
        store: Arc<dyn Store>,
        interval: Duration,
        cancel: CancellationToken,
    ) -> Arc<BacklogCollector> {
        let this = Arc::new(BacklogCollector::default());
        let me = this.clone();
        tokio::spawn(async move {
            loop {
                match store.stats().await {
                    Ok(s) => {
                        *me.sample.lock().unwrap_or_else(|e| e.into_inner()) =
                            Some((std::time::SystemTime::now(), s));
                    }
                    Err(e) => tracing::warn!(error = %e, "backlog sample failed"),
                }
                tokio::select! {
                    _ = cancel.cancelled() => return,
                    _ = tokio::time::sleep(interval.max(Duration::from_millis(100))) => {}
                }
            }
        });
        this
    }
}

fn gauge(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    value: f64,
) -> Result<(), std::fmt::Error> {
    let g = ConstGauge::new(value);
    g.encode(encoder.encode_descriptor(name, help, None, g.metric_type())?)
}

impl Collector for BacklogCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let sample = self
            .sample
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let Some((at, s)) = sample else {
            return Ok(());
        };
        for (name, help, value) in backlog_gauges(&s, at) {
            gauge(&mut encoder, name, help, value)?;
        }
        Ok(())
    }
}

/// The backlog gauges of one sample: name, help, value.
type BacklogGauges = [(&'static str, &'static str, f64); 8];

/// The backlog gauges of one sample taken at `at`: name, help, value.
fn backlog_gauges(s: &Stats, at: std::time::SystemTime) -> BacklogGauges {
    let count = |st: Status| s.counts.get(&st).copied().unwrap_or(0) as f64;
    let age = |d: Option<Duration>| d.map_or(0.0, |d| d.as_secs_f64());
    [
        (
            "outbox_backlog_pending_messages",
            "PENDING rows (due or delayed).",
            count(Status::Pending),
        ),
        (
            "outbox_backlog_oldest_pending_age_seconds",
            "Age of the oldest PENDING row (0 when none).",
            age(s.oldest_pending_age),
        ),
        (
            "outbox_backlog_awaiting_confirmation_messages",
            "SENT rows awaiting a consumer confirmation.",
            s.awaiting_confirmation as f64,
        ),
        (
            "outbox_backlog_oldest_unconfirmed_age_seconds",
            "Age of the oldest SENT row awaiting confirmation (0 when none).",
            age(s.oldest_unconfirmed_age),
        ),
        (
            "outbox_backlog_failed_messages",
            "FAILED rows (dead letters).",
            count(Status::Failed),
        ),
        (
            "outbox_backlog_prepared_messages",
            "PREPARED rows: two-phase messages not decided yet (docs/two-phase.md).",
            count(Status::Prepared),
        ),
        (
            "outbox_backlog_undecided_messages",
            "UNDECIDED rows: two-phase messages parked for an operator (alert when above 0).",
            count(Status::Undecided),
        ),
        (
            "outbox_backlog_sample_age_seconds",
            "Time since the backlog figures were sampled.",
            at.elapsed().unwrap_or_default().as_secs_f64(),
        ),
    ]
}

/// Register on `registry`: `relay`'s counters ([`RelayCollector`]) and state gauges
/// ([`RelayStateCollector`]), labelled `relay="<name>"`, and the backlog of `store`
/// ([`BacklogCollector`]) sampled every `sample_interval` until `cancel` (the daemon's default:
/// 15 s, `[admin] backlog_sample_interval`).
///
/// # Panics
/// Outside a Tokio runtime (the backlog sampler is a task).
pub fn register(
    registry: &mut Registry,
    relay: &Relay,
    store: Arc<dyn Store>,
    sample_interval: Duration,
    cancel: CancellationToken,
) {
    let labelled =
        registry.sub_registry_with_label(("relay".into(), relay.config().name.clone().into()));
    labelled.register_collector(Box::new(RelayCollector::new(relay.metrics().clone())));
    labelled.register_collector(Box::new(RelayStateCollector::new(relay.clone())));
    registry.register_collector(Box::new(BacklogCollector::spawn(
        store,
        sample_interval,
        cancel,
    )));
}

/// Labels of one series: name, value.
type Labels = Vec<(&'static str, String)>;

/// Every member of a [`RelayGroup`] as Prometheus series, read at each scrape: the relay
/// metrics of [`RelayCollector`] and [`RelayStateCollector`] of each running member labelled
/// `database="<member>", relay="<relay name>"`; `outbox_database_ready{database}` (1 when the
/// member runs and [`RelayGroup::member_readiness`] finds nothing, else 0; one series per
/// member, running or not); and the backlog gauges of [`BacklogCollector`] per member labelled
/// `database`, sampled every `sample_interval` by one task (each member's sample on its own,
/// bounded by the interval, so a database that does not answer keeps its last sample, whose age
/// grows, and delays no other). Each family is written once with every member's series, as
/// OpenMetrics requires (registering one collector per member in labelled sub-registries would
/// repeat the families).
pub struct GroupCollector {
    group: RelayGroup,
    samples: Arc<Mutex<std::collections::BTreeMap<String, (std::time::SystemTime, Stats)>>>,
}

impl std::fmt::Debug for GroupCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GroupCollector")
            .field("group", &self.group)
            .finish()
    }
}

impl GroupCollector {
    /// The series of `group`'s members; the backlog sampled every `sample_interval` (at least
    /// 100 ms) until `cancel`.
    ///
    /// # Panics
    /// Outside a Tokio runtime (it spawns the sampling task).
    pub fn spawn(
        group: RelayGroup,
        sample_interval: Duration,
        cancel: CancellationToken,
    ) -> GroupCollector {
        let samples: Arc<Mutex<std::collections::BTreeMap<_, _>>> = Arc::default();
        let (g, out) = (group.clone(), samples.clone());
        let every = sample_interval.max(Duration::from_millis(100));
        tokio::spawn(async move {
            loop {
                let relays = g.relays();
                let taken = futures::future::join_all(relays.iter().map(|(name, relay)| {
                    let store = relay.store().clone();
                    async move {
                        match tokio::time::timeout(every, store.stats()).await {
                            Ok(Ok(s)) => Some((name.clone(), s)),
                            Ok(Err(e)) => {
                                tracing::warn!(database = %name, error = %e, "backlog sample failed");
                                None
                            }
                            Err(_) => {
                                tracing::warn!(database = %name, "backlog sample timed out");
                                None
                            }
                        }
                    }
                }))
                .await;
                {
                    let mut out = out.lock().unwrap_or_else(|e| e.into_inner());
                    let names = g.names();
                    out.retain(|n, _| names.contains(n));
                    for (name, s) in taken.into_iter().flatten() {
                        out.insert(name, (std::time::SystemTime::now(), s));
                    }
                }
                tokio::select! {
                    _ = cancel.cancelled() => return,
                    _ = tokio::time::sleep(every) => {}
                }
            }
        });
        GroupCollector { group, samples }
    }
}

impl Collector for GroupCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let relays: Vec<(Labels, Relay)> = self
            .group
            .relays()
            .into_iter()
            .map(|(db, r)| {
                (
                    vec![("database", db), ("relay", r.config().name.clone())],
                    r,
                )
            })
            .collect();
        for (name, help, read) in COUNTERS {
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
            for (labels, r) in &relays {
                ConstCounter::new(read(r.metrics())).encode(family.encode_family(labels)?)?;
            }
        }
        let (name, help) = STORE_ERRORS;
        let mut family = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
        for (labels, r) in &relays {
            for (kind, n) in r.metrics().store_errors_by_kind() {
                let mut l = labels.clone();
                l.push(("kind", kind.as_str().to_owned()));
                ConstCounter::new(n).encode(family.encode_family(&l)?)?;
            }
        }
        for (name, help, read) in HISTOGRAMS {
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Histogram)?;
            for (labels, r) in &relays {
                let s = read(r.metrics());
                family
                    .encode_family(labels)?
                    .encode_histogram::<NoLabelSet>(s.sum, s.count, &s.buckets, None)?;
            }
        }
        let mut family = encoder.encode_descriptor(
            "outbox_relay_transport_up",
            "Whether the transport is up (0 while paused after an Unavailable error and probed).",
            None,
            MetricType::Gauge,
        )?;
        for (labels, r) in &relays {
            for (name, is_up) in r.transports_up() {
                let mut l = labels.clone();
                l.push(("transport", name));
                ConstGauge::new(i64::from(is_up)).encode(family.encode_family(&l)?)?;
            }
        }
        let mut family = encoder.encode_descriptor(
            "outbox_relay_healthy",
            "Whether the relay makes progress (1) or /healthz fails (0).",
            None,
            MetricType::Gauge,
        )?;
        for (labels, r) in &relays {
            let healthy = r.wedged().is_none();
            ConstGauge::new(i64::from(healthy)).encode(family.encode_family(labels)?)?;
        }
        let mut family = encoder.encode_descriptor(
            "outbox_database_ready",
            "Whether the database's relay runs and is ready (1), or is being opened, or not ready (0).",
            None,
            MetricType::Gauge,
        )?;
        for name in self.group.names() {
            let ready = self
                .group
                .member_readiness(&name)
                .is_some_and(|h| h.is_ok());
            let labels: Labels = vec![("database", name)];
            ConstGauge::new(i64::from(ready)).encode(family.encode_family(&labels)?)?;
        }
        let samples = self
            .samples
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let per_member: Vec<(Labels, BacklogGauges)> = samples
            .iter()
            .map(|(name, (at, s))| (vec![("database", name.clone())], backlog_gauges(s, *at)))
            .collect();
        for i in 0..8 {
            let Some((_, first)) = per_member.first() else {
                break;
            };
            let (name, help, _) = first[i];
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
            for (labels, gauges) in &per_member {
                ConstGauge::new(gauges[i].2).encode(family.encode_family(labels)?)?;
            }
        }
        Ok(())
    }
}
