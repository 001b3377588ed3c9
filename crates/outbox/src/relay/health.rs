//! Availability of each transport: pause on `Unavailable`, probe with backoff, one log line
//! per state change; missing destinations and their grace period. And the relay's health and
//! readiness ([`Relay::health`], [`Relay::readiness`]: the daemon's `/healthz`, `/readyz`).

use super::*;

/// Availability of one transport (see [`Relay::mark_down`]).
#[derive(Default)]
pub(super) struct Health {
    /// Paused: publishes release their messages, a prober runs.
    pub(super) down: AtomicBool,
    /// A probe succeeded after an outage, but no publish has been accepted since: a failure now
    /// is the same outage going on (a relapse), not a new one.
    pub(super) recovering: AtomicBool,
    /// Probes since the outage began, across relapses: the probe backoff's attempt number.
    pub(super) probes: AtomicU32,
    /// Relapses of the current outage.
    pub(super) relapses: AtomicU32,
    /// Bumped by every outage and relapse, so a prober knows whether the transport failed again
    /// after its successful probe.
    pub(super) epoch: AtomicU64,
}

/// What [`Relay::health`] and [`Relay::readiness`] found: nothing when all is well, else one
/// sentence per problem, naming it and how long it has lasted.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RelayHealth {
    /// The problems; empty when healthy (ready).
    pub problems: Vec<String>,
}

impl RelayHealth {
    /// No problem.
    pub fn is_ok(&self) -> bool {
        self.problems.is_empty()
    }
}

impl Relay {
    /// Whether the relay's loops are making progress (the daemon's `/healthz`,
    /// docs/operations.md): a batch stuck past `lease - publish_timeout` ([`Relay::stalled`]),
    /// or no successful membership round for longer than a lease (the database does not answer
    /// the relay, or its membership loop stopped: its buckets are then taken over). A relay
    /// that just started has one lease of grace.
    pub fn health(&self) -> RelayHealth {
        let inner = &self.inner;
        let cfg = &inner.config;
        let mut problems = Vec::new();
        if let Some(age) = self.stalled() {
            problems.push(format!(
                "a batch has been in flight for {:.1} s, past lease - publish_timeout ({:.1} s): the relay makes no progress and renews no bucket",
                age.as_secs_f64(),
                cfg.lease.saturating_sub(cfg.publish_timeout).as_secs_f64()
            ));
        }
        let last = *inner
            .last_membership
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let since = last.unwrap_or(inner.created).elapsed();
        if since > cfg.lease {
            problems.push(match last {
                Some(_) => format!(
                    "no membership round succeeded for {:.1} s (lease {:.1} s): its buckets expire and are taken over",
                    since.as_secs_f64(),
                    cfg.lease.as_secs_f64()
                ),
                None => format!(
                    "no membership round has succeeded in the {:.1} s since the start (lease {:.1} s)",
                    since.as_secs_f64(),
                    cfg.lease.as_secs_f64()
                ),
            });
        }
        RelayHealth { problems }
    }

    /// Each transport's [`Transport::name`] (its kind: `nats`, `webhook`, …, not the
    /// configuration's key) and whether it is up (not paused after an `Unavailable` error), in
    /// the router's order.
    pub fn transports_up(&self) -> Vec<(String, bool)> {
        let inner = &self.inner;
        inner
            .transports
            .iter()
            .zip(&inner.health)
            .map(|(t, h)| (t.name().to_owned(), !h.down.load(Ordering::Acquire)))
            .collect()
    }

    /// Whether the relay can publish now (the daemon's `/readyz`): [`Relay::health`], a first
    /// membership round done (the database answered), and every transport up (a transport that
    /// is down is being probed: named with its reason in the logs).
    pub fn readiness(&self) -> RelayHealth {
        let inner = &self.inner;
        let mut h = self.health();
        if inner
            .last_membership
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .is_none()
            && h.is_ok()
        {
            h.problems
                .push("no membership round has succeeded yet".to_owned());
        }
        for (t, health) in inner.transports.iter().zip(&inner.health) {
            if health.down.load(Ordering::Acquire) {
                h.problems.push(format!(
                    "transport {} is down (probed with backoff)",
                    t.name()
                ));
            }
        }
        h
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
    pub(super) fn mark_down(&self, ti: usize, reason: String, stop: CancellationToken) {
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
        use tracing::Instrument;
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
        }.in_current_span());
    }

    /// A publish on transport `ti` was accepted: the outage, if one was going on, is over.
    pub(super) fn mark_up(&self, ti: usize) {
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
    pub(super) fn missing_too_long(&self, ti: usize, destination: &str) -> bool {
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

    /// `destination` of transport `ti` accepted a message: it exists (again), and takes
    /// messages (again, after refusing them: one info line).
    pub(super) fn destination_found(&self, ti: usize, destination: &str) {
        {
            let mut missing = self.inner.missing.lock().expect("missing lock");
            if !missing.is_empty() {
                missing.remove(&(ti, destination.to_owned()));
            }
        }
        let ended = {
            let mut busy = self.inner.busy.lock().expect("busy lock");
            if busy.is_empty() {
                return;
            }
            busy.remove(&(ti, destination.to_owned()))
        };
        if let Some(b) = ended {
            tracing::info!(
                transport = self.inner.transports[ti].name(),
                destination,
                busy_for = ?b.since.elapsed(),
                rounds = b.rounds,
                "destination accepts messages again"
            );
        }
    }

    /// How long a message that `destination` of transport `ti` refused for now waits before it
    /// is tried again: `probe_backoff` at the destination's next round (the first delay when it
    /// was not busy).
    pub(super) fn busy_delay(&self, ti: usize, destination: &str) -> Duration {
        let rounds = self
            .inner
            .busy
            .lock()
            .expect("busy lock")
            .get(&(ti, destination.to_owned()))
            .map_or(0, |b| b.rounds);
        self.inner.config.probe_backoff.delay(rounds + 1)
    }

    /// `destination` of transport `ti` refused `refused` messages of one batch for now
    /// (`reason`, the last one's error): one more round of its backoff, and a warning when it
    /// starts.
    pub(super) fn destination_busy(
        &self,
        ti: usize,
        destination: &str,
        refused: u64,
        reason: &str,
    ) {
        add(&self.inner.metrics.busy, refused);
        let started = {
            let mut busy = self.inner.busy.lock().expect("busy lock");
            if busy.len() >= 10_000 {
                // Bounded: a flood of distinct busy destinations restarts their backoff.
                busy.clear();
            }
            let b = busy
                .entry((ti, destination.to_owned()))
                .or_insert_with(|| Busy {
                    since: Instant::now(),
                    rounds: 0,
                });
            b.rounds = b.rounds.saturating_add(1);
            b.rounds == 1
        };
        if started {
            tracing::warn!(
                transport = self.inner.transports[ti].name(),
                destination,
                reason,
                "destination refuses messages for now; its messages are released and tried again with backoff, no attempt counted"
            );
        }
    }
}

/// A destination refusing messages for now ([`crate::TransportError::destination_busy`]).
#[derive(Debug)]
pub(super) struct Busy {
    /// Since the first refusal.
    since: Instant,
    /// Batches refused since then; the next delay is `probe_backoff.delay(rounds + 1)`.
    rounds: u32,
}
