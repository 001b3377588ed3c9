//! Membership rounds: heartbeat, renew, acquire, rebalance, hand-over and route-set checks.

use super::*;

/// Membership, on every relay: heartbeat, renew the held bucket leases, acquire free or expired
/// buckets up to the fair share and give back the buckets above it (those not in flight).
/// Every `lease / 3`; every `lease / 10` while below the fair share, so a joining relay gets its
/// share quickly.
pub(super) async fn membership_loop(relay: Relay, cancel: CancellationToken) {
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
                *inner
                    .last_membership
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(Instant::now());
                *inner
                    .last_membership_sent
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(started);
                let change = {
                    let mut own = inner.ownership.lock().expect("ownership lock");
                    own.apply_round(
                        &held,
                        &round,
                        started,
                        Instant::now(),
                        cfg.lease,
                        cfg.publish_timeout,
                    )
                };
                for b in &change.lost {
                    add(&inner.metrics.buckets_lost, 1);
                    tracing::warn!(bucket = b, "bucket lease lost to another relay");
                }
                for &(bucket, takeover, handed) in &change.acquired {
                    add(&inner.metrics.buckets_acquired, 1);
                    if handed {
                        tracing::info!(
                            bucket,
                            "took a bucket another relay handed over: it holds messages only this relay routes"
                        );
                    }
                    if takeover {
                        add(&inner.metrics.takeovers, 1);
                        tracing::info!(bucket, "took over a bucket whose lease expired");
                    }
                }
                below_share = change.below_share;
                let release = change.release;
                let acquired = change.usable;
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
                            inner.metrics.store_error(&e);
                            tracing::warn!(error = %e.report(), "could not give buckets back; they return by lease expiry");
                        }
                    }
                }
                hand_off(&relay).await;
                check_route_sets(&relay, &mut route_sets).await;
            }
            Err(e) => {
                failures += 1;
                inner.metrics.store_error(&e);
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
        let h = HandOff {
            relay: &cfg.name,
            buckets: &buckets,
            to: &peer,
            lease: cfg.lease,
        };
        match inner.store.hand_off_buckets(&h).await {
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
                inner.metrics.store_error(&e);
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

impl Relay {
    /// Give every held bucket back and leave the membership (graceful shutdown).
    pub(super) async fn leave(&self) {
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
}
