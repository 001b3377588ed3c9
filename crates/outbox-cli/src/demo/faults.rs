//! Fault injection: a transport wrapper that loses deliveries and acknowledgements and
//! duplicates deliveries, a confirmation sender that drops confirmations, and the supervisor that
//! kills the embedded relay without cleanup and starts a new one.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use outbox::{
    Backoff, ConfirmPolicy, Confirmation, ConfirmationSender, Outgoing, Relay, RelayConfig,
    RelayHandle, RelayMetrics, Router, Store, Transport, TransportError,
};
use rand::Rng;

use super::delivery::{Delivery, Endpoint};
use super::{CANCELLED_TOPIC, TOPIC};

/// Fault rates of the [`FaultyTransport`].
#[derive(Debug, Clone, Copy)]
pub(super) struct Faults {
    /// Fraction of deliveries lost before the consumer.
    pub(super) loss_before: f64,
    /// Fraction of acknowledgements lost after the consumer committed.
    pub(super) loss_after: f64,
    /// Fraction of deliveries sent twice.
    pub(super) duplicate: f64,
}

/// What the fault injector did.
#[derive(Debug, Default)]
pub(super) struct FaultStats {
    /// Deliveries lost before the consumer.
    pub(super) lost_before: AtomicU64,
    /// Acknowledgements lost after the consumer committed.
    pub(super) acks_lost: AtomicU64,
    /// Deliveries sent twice.
    pub(super) duplicated: AtomicU64,
    /// Copies handed to the real transport.
    pub(super) copies_sent: AtomicU64,
    /// Confirmations dropped on the way to the order service.
    pub(super) confirmations_lost: AtomicU64,
}

/// The demos' relay settings: batches of 100, a 3 s lease, 1 s publish timeout, a poll every
/// 500 ms, retries from 100 ms doubling to 2 s, maintenance every second, and every finished row
/// kept (the report and the checks read them).
pub(super) fn demo_relay_config(name: String) -> RelayConfig {
    RelayConfig {
        name,
        batch_size: 100,
        lease: Duration::from_secs(3),
        publish_timeout: Duration::from_secs(1),
        poll_interval: Duration::from_millis(500),
        backoff: Backoff {
            base: Duration::from_millis(100),
            factor: 2.0,
            max: Duration::from_secs(2),
            jitter: 0.2,
        },
        maintenance_interval: Duration::from_secs(1),
        retention: outbox::retention::Retention::keep_all(),
        ..RelayConfig::default()
    }
}

/// A confirmation sender that drops a share of the consumer's confirmations silently, as a
/// network would (the consumer believes it sent them); the producer's check-back recovers them.
pub(super) struct LossyConfirmations {
    /// The real sender.
    pub(super) inner: Arc<dyn ConfirmationSender>,
    /// Fraction of confirmations dropped.
    pub(super) rate: f64,
    /// Where the drops are counted.
    pub(super) stats: Arc<FaultStats>,
}

#[async_trait]
impl ConfirmationSender for LossyConfirmations {
    async fn send(
        &self,
        reply_to: &str,
        confirmation: &Confirmation,
    ) -> Result<(), TransportError> {
        if rand::rng().random_bool(self.rate) {
            self.stats
                .confirmations_lost
                .fetch_add(1, Ordering::Relaxed);
            return Ok(());
        }
        self.inner.send(reply_to, confirmation).await
    }

    /// As [`LossyConfirmations::send`] for each, the kept ones through the real sender's
    /// `send_all` (one request for a batch on the webhook sender).
    async fn send_all(
        &self,
        reply_to: &str,
        confirmations: &[Confirmation],
    ) -> Vec<Result<(), TransportError>> {
        let lost: Vec<bool> = confirmations
            .iter()
            .map(|_| rand::rng().random_bool(self.rate))
            .collect();
        let kept: Vec<Confirmation> = confirmations
            .iter()
            .zip(&lost)
            .filter(|(_, lost)| !**lost)
            .map(|(c, _)| c.clone())
            .collect();
        let mut sent = self.inner.send_all(reply_to, &kept).await.into_iter();
        lost.iter()
            .map(|lost| {
                if *lost {
                    self.stats
                        .confirmations_lost
                        .fetch_add(1, Ordering::Relaxed);
                    Ok(())
                } else {
                    sent.next().unwrap_or(Ok(()))
                }
            })
            .collect()
    }
}

/// A transport wrapper that injects faults: a delivery lost before the broker (a retryable
/// error, nothing sent), an acknowledgement lost after the broker accepted (sent, then a
/// retryable error), a duplicated delivery (sent twice).
struct FaultyTransport {
    /// The real transport.
    inner: Arc<dyn Transport>,
    /// The fault rates.
    faults: Faults,
    /// Where the faults are counted.
    stats: Arc<FaultStats>,
}

/// The fault drawn for one message of a batch.
#[derive(Debug, Clone, Copy, Default)]
struct Fate {
    /// Not sent at all; the relay sees a retryable error.
    lost_before: bool,
    /// Sent, then reported to the relay as a retryable error.
    ack_lost: bool,
    /// Sent twice.
    duplicated: bool,
}

#[async_trait]
impl Transport for FaultyTransport {
    fn name(&self) -> &str {
        self.inner.name()
    }

    async fn publish(&self, batch: &[Outgoing<'_>]) -> Vec<Result<(), TransportError>> {
        let fates: Vec<Fate> = {
            let mut rng = rand::rng();
            batch
                .iter()
                .map(|_| {
                    let lost_before = rng.random_bool(self.faults.loss_before);
                    Fate {
                        lost_before,
                        ack_lost: !lost_before && rng.random_bool(self.faults.loss_after),
                        duplicated: !lost_before && rng.random_bool(self.faults.duplicate),
                    }
                })
                .collect()
        };
        let mut sends = Vec::with_capacity(batch.len());
        let mut origin = Vec::with_capacity(batch.len());
        for (i, (out, fate)) in batch.iter().zip(&fates).enumerate() {
            let copies = match fate {
                Fate {
                    lost_before: true, ..
                } => 0,
                Fate {
                    duplicated: true, ..
                } => 2,
                _ => 1,
            };
            for _ in 0..copies {
                sends.push(*out);
                origin.push(i);
            }
        }
        let stats = &self.stats;
        let count = |a: &AtomicU64, n: usize| a.fetch_add(n as u64, Ordering::Relaxed);
        count(&stats.copies_sent, sends.len());
        let results = if sends.is_empty() {
            Vec::new()
        } else {
            self.inner.publish(&sends).await
        };

        // One result per input: a message is acknowledged when any of its copies was.
        let mut merged: Vec<Option<Result<(), TransportError>>> =
            (0..batch.len()).map(|_| None).collect();
        for (i, r) in origin.into_iter().zip(results) {
            if !matches!(merged[i], Some(Ok(()))) {
                merged[i] = Some(r);
            }
        }
        merged
            .into_iter()
            .zip(fates)
            .map(|(result, fate)| {
                if fate.lost_before {
                    count(&stats.lost_before, 1);
                    return Err(TransportError::retryable(
                        "injected fault: delivery lost before the consumer",
                    ));
                }
                if fate.duplicated {
                    count(&stats.duplicated, 1);
                }
                match result {
                    Some(Ok(())) if fate.ack_lost => {
                        count(&stats.acks_lost, 1);
                        Err(TransportError::retryable(
                            "injected fault: acknowledgement lost after the consumer committed",
                        ))
                    }
                    Some(r) => r,
                    None => Err(TransportError::retryable("transport returned no result")),
                }
            })
            .collect()
    }

    async fn probe(&self) -> Result<(), TransportError> {
        self.inner.probe().await
    }
}

/// Starts, kills and restarts the embedded relay.
pub(super) struct RelaySupervisor<'a> {
    /// The order service's outbox.
    pub(super) store: Arc<dyn Store>,
    /// Where each incarnation's transport comes from.
    pub(super) delivery: &'a Delivery,
    /// Where the relay delivers.
    pub(super) endpoint: &'a Endpoint,
    /// The fault rates of each incarnation's transport.
    pub(super) faults: Faults,
    /// Where the faults are counted.
    pub(super) fault_stats: Arc<FaultStats>,
    /// Confirmation policy of the `order-created` route.
    pub(super) confirm: ConfirmPolicy,
    /// Check-backs before an unconfirmed message is dead-lettered.
    pub(super) max_check_backs: u32,
    /// The running incarnation.
    pub(super) current: Option<RelayHandle>,
    /// The metrics of every incarnation so far.
    pub(super) metrics: Vec<Arc<RelayMetrics>>,
    /// The registry the demo serves at `/metrics`: each incarnation's counters are added to it,
    /// labelled with its name.
    pub(super) registry: Arc<std::sync::Mutex<prometheus_client::registry::Registry>>,
}

impl RelaySupervisor<'_> {
    /// Start a new relay incarnation (a fresh transport, as after a process restart).
    pub(super) async fn start(&mut self) -> anyhow::Result<()> {
        let (transport, destination) = self.delivery.transport(self.endpoint).await?;
        let faulty: Arc<dyn Transport> = Arc::new(FaultyTransport {
            inner: transport,
            faults: self.faults,
            stats: self.fault_stats.clone(),
        });
        let config = RelayConfig {
            max_attempts: 50,
            in_flight_batches: 4,
            max_check_backs: self.max_check_backs,
            ..demo_relay_config(format!("demo-relay-{}", self.metrics.len() + 1))
        };
        // Orders need the consumer's verdict; cancellations are plain notifications (SENT is
        // final) over the same faulty transport.
        let router = Router::new()
            .route_confirmed(
                TOPIC,
                faulty.clone(),
                destination.clone(),
                self.confirm.clone(),
            )
            .route(CANCELLED_TOPIC, faulty, destination);
        let relay = Relay::builder(self.store.clone())
            .router(router)
            .config(config)
            .build()?;
        self.metrics.push(relay.metrics().clone());
        self.registry
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .sub_registry_with_label(("relay".into(), relay.config().name.clone().into()))
            .register_collector(Box::new(outbox::prometheus::RelayCollector::new(
                relay.metrics().clone(),
            )));
        self.current = Some(relay.spawn());
        Ok(())
    }

    /// Crash the relay (claimed rows stay SENDING until their lease expires) and start another.
    pub(super) async fn kill_and_restart(&mut self) -> anyhow::Result<()> {
        if let Some(relay) = self.current.take() {
            relay.abort();
        }
        self.start().await
    }

    /// Stop the relay gracefully.
    pub(super) async fn shutdown(&mut self) -> anyhow::Result<()> {
        if let Some(relay) = self.current.take() {
            relay.shutdown().await?;
        }
        Ok(())
    }
}
