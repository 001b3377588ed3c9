//! Availability of each transport: pause on `Unavailable`, probe with backoff, one log line
//! per state change; missing destinations and their grace period.

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

impl Relay {
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

    /// `destination` of transport `ti` accepted a message: it exists (again).
    pub(super) fn destination_found(&self, ti: usize, destination: &str) {
        let mut missing = self.inner.missing.lock().expect("missing lock");
        if !missing.is_empty() {
            missing.remove(&(ti, destination.to_owned()));
        }
    }
}
