//! One batch: attempts of a takeover, hooks, routes, ordered generations, publish, and the
//! single completion statement.

use super::*;

/// One message of a batch being published.
pub(super) struct Work {
    pub(super) bucket: Bucket,
    pub(super) token: LeaseToken,
    pub(super) message: Message,
    /// Resolved route index and destination; `None`: no route.
    pub(super) route: Option<(usize, String)>,
    /// The attempts already recorded in the row (this attempt included once `counted`).
    pub(super) stored_attempts: u32,
    /// This attempt was recorded before publishing (takeover batch).
    pub(super) counted: bool,
    /// How long the row had been due when read (database clock;
    /// [`BucketRow::due_age`](crate::store::BucketRow::due_age)).
    pub(super) due_age: Option<Duration>,
    pub(super) outcome: Option<Outcome>,
}

impl Work {
    /// The attempt number of this publish.
    pub(super) fn attempt(&self) -> u32 {
        if self.counted {
            self.stored_attempts
        } else {
            self.stored_attempts + 1
        }
    }

    /// The `attempts` value to store with `outcome` ([`decide::attempts_to_store`]).
    pub(super) fn attempts_to_store(&self, outcome: &Outcome) -> u32 {
        decide::attempts_to_store(self.stored_attempts, self.attempt(), outcome)
    }
}

/// The outcome of a message `transport` refuses to put on the wire ([`Transport::check`]): a
/// dead letter naming the header or key and the rule it breaks. `None` when it may be sent.
pub(super) fn refused_by_transport(transport: &dyn Transport, w: &Work) -> Option<Outcome> {
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
    /// Publish and complete one batch. Its buckets leave `in_flight` however it ends (done,
    /// panicked, aborted). A panic outside the transport's publish (a hook, the completion) is
    /// contained and logged: its rows stay PENDING, and its buckets are treated like taken-over
    /// ones (each later read of them records an attempt first) and isolated (their rows are
    /// then processed one at a time), so only a row that panics alone every time is
    /// dead-lettered after `max_attempts` ("batch panicked: …").
    pub(super) async fn process(
        &self,
        work: Vec<Work>,
        read_at: Instant,
        background: &CancellationToken,
    ) {
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

    pub(super) async fn process_inner(
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
                            crate::verdict::HEADER_REPLY_TO.into(),
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
                    inner.metrics.store_error(&e);
                    tracing::warn!(error = %e.report(), "key_heads failed; ordered rows of this batch wait");
                    keys.clear();
                    Vec::new()
                }
            };
            let heads: HashMap<String, _> = heads.into_iter().map(|h| (h.key.clone(), h)).collect();
            for (slot, (key, policy, rows)) in keys.iter().enumerate() {
                let first = &work[rows[0]].message;
                match decide::key_start(first.id, heads.get(key), *policy) {
                    decide::KeyStart::HeldBack { behind_dead } => {
                        add(&inner.metrics.held_back, rows.len() as u64);
                        tracing::debug!(
                            key,
                            behind_dead,
                            "ordered key held back by an earlier message"
                        );
                        self.hold_back(key, cfg.poll_interval);
                    }
                    decide::KeyStart::Go { past_dead } => {
                        if past_dead {
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
                let step = decide::key_step(w.outcome.as_ref(), *policy);
                if let decide::KeyStep::HoldBack(delay) = step {
                    self.hold_back(key, delay);
                }
                let go_on = step == decide::KeyStep::Next;
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
    pub(super) async fn route_elsewhere(&self, work: &mut [Work], idx: &[usize]) {
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
                inner.metrics.store_error(&e);
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
    pub(super) async fn publish(
        &self,
        work: &mut [Work],
        idx: &[usize],
        read_at: Instant,
        background: &CancellationToken,
    ) {
        let inner = &self.inner;
        let cfg = &inner.config;
        let mut groups: Vec<Vec<usize>> = vec![Vec::new(); inner.transports.len()];
        let mut traced: Vec<(usize, tracing::Span)> = Vec::new();
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
                // A traced message (feature `otel`) gets its `outbox.publish` span, which
                // becomes the parent the consumer sees (crate::otel).
                let attempt = work[i].attempt();
                let w = &mut work[i];
                let dest = w.route.as_ref().expect("routed").1.as_str();
                if let Some(span) = crate::otel::publish_span(&mut w.message, attempt, dest) {
                    traced.push((i, span));
                }
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
            // Destinations that refused messages for now: how many, and the last reason.
            let mut busy: HashMap<String, (u64, String)> = HashMap::new();
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
                if let (Ok(()), 1, Some(age)) = (&r, attempt, w.due_age) {
                    inner
                        .metrics
                        .enqueue_to_ack
                        .observe_duration(age + read_at.elapsed());
                }
                let (route, dest) = w.route.as_ref().expect("routed");
                let at = decide::Attempt {
                    number: attempt,
                    max: w.message.max_attempts,
                    confirm: inner.router.routes()[*route]
                        .confirm
                        .as_ref()
                        .map(|p| p.timeout),
                };
                let (outcome, signal) = decide::after_publish(
                    r,
                    at,
                    || self.missing_too_long(ti, dest),
                    || self.busy_delay(ti, dest),
                    cfg,
                );
                match signal {
                    decide::Signal::Accepted => {
                        accepted = true;
                        self.destination_found(ti, dest);
                    }
                    decide::Signal::Unavailable(reason) => unavailable = Some(reason),
                    decide::Signal::Busy(reason) => {
                        let b = busy.entry(dest.clone()).or_insert((0, String::new()));
                        b.0 += 1;
                        b.1 = reason;
                    }
                    decide::Signal::Nothing => {}
                }
                work[i].outcome = Some(outcome);
            }
            for (dest, (refused, reason)) in busy {
                self.destination_busy(ti, &dest, refused, &reason);
            }
            if let Some(reason) = unavailable {
                self.mark_down(ti, reason, background.clone());
            } else if accepted {
                self.mark_up(ti);
            }
        }
        for (i, span) in traced {
            let (outcome, error) = match &work[i].outcome {
                Some(Outcome::Sent | Outcome::SentAwaitingConfirmation { .. }) => ("sent", false),
                Some(Outcome::Failed { .. }) => ("dead_lettered", true),
                Some(Outcome::Retry { .. }) => ("retry", true),
                Some(Outcome::Release { .. }) | None => ("released", false),
            };
            crate::otel::record_outcome(&span, outcome, error);
        }
    }
}

impl Relay {
    /// Record outcomes in one statement, retrying transient database errors until the lease
    /// would have expired. Returns whether the statement ran (rows of lost buckets excepted).
    pub(super) async fn complete(
        &self,
        completions: &[BucketCompletion],
        read_at: Instant,
    ) -> bool {
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
                    inner.metrics.store_error(&e);
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
}
