//! The drain scenarios of `outbox bench`: the raw broker rate, the raw-SQL baselines and the
//! relay draining a backlog (one relay, then `--relays` of them), with the database's cost.

use super::*;

impl Bench {
    /// Create outbox table `table` and fill it with `--messages` messages.
    pub(super) async fn backlog(&self, table: &str) -> anyhow::Result<()> {
        self.backlog_in(&self.db, table).await
    }

    /// Create outbox table `table` in `db` and fill it with `--messages` messages.
    pub(super) async fn backlog_in(&self, db: &Db, table: &str) -> anyhow::Result<()> {
        db.migrate(table).await?;
        let bar = self.bar(self.args.messages, &format!("load {table}"));
        db.load(table, self.args.messages, &self.payload, TOPIC, false, &bar)
            .await?;
        bar.finish_and_clear();
        Ok(())
    }

    /// Sample `progress` every [`TICK`] until `work` ends; at each tenth of `n`, read the
    /// table's statistics (PostgreSQL).
    pub(super) async fn watch(
        &self,
        bar: &ProgressBar,
        n: u64,
        table: Option<&str>,
        progress: impl Fn() -> u64,
        work: JoinHandle<anyhow::Result<()>>,
    ) -> anyhow::Result<Watched> {
        let start = Instant::now();
        let cpu_before = databases::cpu_now();
        let mut work = work;
        let mut tick = tokio::time::interval(TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut samples = Vec::new();
        let mut at_decile = Vec::new();
        let mut next = 1u64;
        let result = loop {
            tokio::select! {
                r = &mut work => break r,
                _ = tick.tick() => {
                    let c = progress();
                    samples.push((start.elapsed().as_secs_f64(), c));
                    bar.set_position(c.min(n));
                    while next <= 9 && c >= n * next / 10 {
                        next += 1;
                        if let Some(t) = table
                            && let Some(s) = self.db.table_stats(t).await?
                        {
                            at_decile.push(s);
                        }
                        bar.set_message(format!("load {}", fmt_load(loadavg())));
                    }
                }
            }
        };
        let seconds = start.elapsed().as_secs_f64();
        // The servers' CPU is read before their backends exit with the caller's pools.
        let cpu_seconds = databases::cpu_now()
            .into_iter()
            .map(|(side, after)| {
                let spent = after - cpu_before.get(&side).copied().unwrap_or(0.0);
                (side, spent.max(0.0))
            })
            .collect();
        result.context("drain task panicked")??;
        samples.push((seconds, progress()));
        bar.finish_and_clear();
        Ok(Watched {
            seconds,
            samples,
            at_decile,
            cpu_seconds,
        })
    }

    /// Check a drain of `table` left nothing behind and the broker holds every message.
    pub(super) async fn verify(&self, name: &str, table: &str) -> anyhow::Result<Option<u64>> {
        let n = self.args.messages;
        self.verify_in(&self.db, name, table).await?;
        let stored = self.broker.stored().await?;
        if let Some(s) = stored
            && s < n
        {
            bail!("{name}: the broker holds {s} of the {n} messages published");
        }
        Ok(stored)
    }

    /// Check a drain of `table` in `db` left nothing pending, sending or failed.
    pub(super) async fn verify_in(&self, db: &Db, name: &str, table: &str) -> anyhow::Result<()> {
        let stats = Outbox::open(&db.control, table)?.store().stats().await?;
        let count = |s| stats.counts.get(&s).copied().unwrap_or(0);
        let left = count(Status::Pending) + count(Status::Sending);
        let failed = count(Status::Failed);
        if left > 0 || failed > 0 {
            bail!(
                "{name}: {left} message(s) still pending or sending and {failed} failed after the drain"
            );
        }
        Ok(())
    }

    /// The raw broker publish run: `--messages` through the transport, no database.
    pub(super) async fn broker_run(&mut self) -> anyhow::Result<Drain> {
        self.broker.reset().await?;
        let load_start = loadavg();
        let (w, stored) = self.publish_backlog("broker publish (no database)").await?;
        Ok(self.drain_result("broker", 1, &w, load_start, stored, None, None))
    }

    /// Publish `--messages` messages (outbox headers, no partition key) straight through the
    /// transport, `--broker-window` in flight; check the broker holds them all where it can
    /// tell. Returns the timing and what the broker holds.
    pub(super) async fn publish_backlog(
        &self,
        label: &str,
    ) -> anyhow::Result<(Watched, Option<u64>)> {
        let n = self.args.messages;
        let done = Arc::new(AtomicU64::new(0));
        let transport = self.broker.transport();
        let destination = self.broker.destination().replace("{topic}", TOPIC);
        let (batch, window) = (u64::from(self.args.batch_size), self.args.broker_window);
        let payload = self.payload.clone();
        let counter = done.clone();
        let work = tokio::spawn(async move {
            let batches = n.div_ceil(batch);
            let mut publishes = futures::stream::iter(0..batches)
                .map(|b| {
                    let size = batch.min(n - b * batch);
                    let messages: Vec<Message> = (0..size)
                        .map(|i| Message {
                            id: (b * batch + i) as i64,
                            message_id: Uuid::now_v7(),
                            topic: TOPIC.into(),
                            partition_key: None,
                            headers: Default::default(),
                            payload: payload.clone(),
                            attempts: 1,
                            max_attempts: 1,
                            redelivery: 0,
                        })
                        .collect();
                    let (transport, destination, counter) = (&transport, &destination, &counter);
                    async move {
                        let out: Vec<Outgoing<'_>> = messages
                            .iter()
                            .map(|m| Outgoing {
                                message: m,
                                destination,
                            })
                            .collect();
                        let results = transport.publish(&out).await;
                        if let Some(e) = results.iter().find_map(|r| r.as_ref().err()) {
                            bail!("raw broker run: a publish failed: {}", e.report());
                        }
                        counter.fetch_add(size, Ordering::Relaxed);
                        Ok(())
                    }
                })
                .buffer_unordered((window / batch as usize).max(1));
            while let Some(r) = publishes.next().await {
                r?;
            }
            Ok(())
        });
        let bar = self.bar(n, label);
        let w = self
            .watch(&bar, n, None, || done.load(Ordering::Relaxed), work)
            .await?;
        let stored = self.broker.stored().await?;
        if let Some(s) = stored
            && s < n
        {
            bail!("{label}: the broker holds {s} of the {n} messages published");
        }
        Ok((w, stored))
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn drain_result(
        &self,
        name: &str,
        relays: usize,
        w: &Watched,
        load_start: Option<[f64; 3]>,
        broker_stored: Option<u64>,
        cost: Option<Cost>,
        table: Option<TableGrowth>,
    ) -> Drain {
        let n = self.args.messages;
        let deciles = report::decile_rates(&w.samples, n);
        Drain {
            name: name.into(),
            relays,
            messages: n,
            seconds: w.seconds,
            rate: n as f64 / w.seconds.max(1e-9),
            flatness: report::flatness(&deciles),
            deciles,
            load_start,
            load: loadavg(),
            broker_stored,
            cost,
            table,
            cpu_us_per_message: w
                .working_sides()
                .map(|(side, s)| (side.to_owned(), s * 1e6 / n.max(1) as f64))
                .collect(),
            ..Drain::default()
        }
    }

    /// The backlog shared by the baselines and the drain: loaded once, copied for each loop.
    pub(super) async fn baselines_and_drain(&mut self) -> anyhow::Result<()> {
        let table = self.db.table("drain");
        self.backlog(&table).await?;
        if self.args.runs(Scenario::Baseline) {
            for index in [
                raw::Index::Naive,
                raw::Index::Tuned,
                raw::Index::RelayIndexes,
            ] {
                let copy = self.db.table(&index.name().replace('-', "_"));
                if !raw::prepare(&self.db, &table, &copy, index).await? {
                    if index == raw::Index::Tuned {
                        self.report.notes.push(format!(
                            "{}: not run on {} (no partial indexes)",
                            index.name(),
                            self.db.dialect.name()
                        ));
                    }
                    continue;
                }
                let d = self.raw_drain(&copy, index).await?;
                self.db.drop_table(&copy).await?;
                match index {
                    raw::Index::Naive => self.report.baseline_naive = Some(d),
                    raw::Index::Tuned => self.report.baseline_tuned = Some(d),
                    raw::Index::RelayIndexes => self.report.baseline_relay_indexes = Some(d),
                }
            }
        }
        if self.args.runs(Scenario::Drain) {
            self.report.drain = Some(self.relay_drain(&table, 1).await?);
        }
        self.db.drop_outbox(&table).await
    }

    /// One raw-SQL loop drains `table`.
    pub(super) async fn raw_drain(&self, table: &str, index: raw::Index) -> anyhow::Result<Drain> {
        self.db.settle(table).await?;
        self.broker.reset().await?;
        let before = self.db.table_stats(table).await?;
        let counters = self.db.pg_counters(table).await?;
        let load_start = loadavg();
        // Statement log on: the loop's statements are counted like a relay's.
        let pool = self.db.pool(index.name(), true, 2).await?;
        let done = Arc::new(AtomicU64::new(0));
        let work = {
            let (pool, table) = (pool.pool.clone(), table.to_owned());
            let (transport, destination) = (self.broker.transport(), self.broker.destination());
            let (batch, done) = (self.args.batch_size, done.clone());
            tokio::spawn(async move {
                raw::run(&pool, &table, batch, &*transport, &destination, &done).await
            })
        };
        let bar = self.bar(self.args.messages, &format!("{} loop", index.name()));
        let s0 = StatementCounter::read();
        let w = self
            .watch(
                &bar,
                self.args.messages,
                Some(table),
                || done.load(Ordering::Relaxed),
                work,
            )
            .await?;
        let s1 = StatementCounter::read();
        self.db.retire(pool).await?;
        let stored = self.verify(index.name(), table).await?;
        let cost = self
            .pg_cost(table, counters, Some((s1.0 - s0.0, s1.1 - s0.1)))
            .await?;
        let growth = self.growth(table, before, &w).await?;
        Ok(self.drain_result(index.name(), 1, &w, load_start, stored, cost, growth))
    }

    /// The relay-side cost from PostgreSQL's counters (and the statement log when `statements`
    /// is given: `(statements, rows affected)` deltas).
    pub(super) async fn pg_cost(
        &self,
        table: &str,
        before: Option<db::PgCounters>,
        statements: Option<(u64, u64)>,
    ) -> anyhow::Result<Option<Cost>> {
        let n = self.args.messages.max(1) as f64;
        let pg = match (before, self.db.pg_counters(table).await?) {
            (Some(b), Some(a)) => Some(b.writes_until(&a, self.args.messages)),
            _ => None,
        };
        Ok(match (statements, pg) {
            (None, None) => None,
            (s, pg) => Some(Cost {
                statements: s.map_or(0, |s| s.0),
                statements_per_message: s.map_or(0.0, |s| s.0 as f64 / n),
                rows_affected_per_message: s.map_or(0.0, |s| s.1 as f64 / n),
                pg,
            }),
        })
    }

    pub(super) async fn growth(
        &self,
        table: &str,
        before: Option<report::TableStats>,
        w: &Watched,
    ) -> anyhow::Result<Option<TableGrowth>> {
        Ok(match (before, self.db.table_stats(table).await?) {
            (Some(before), Some(after)) => Some(TableGrowth {
                before,
                after,
                at_decile: w.at_decile.clone(),
            }),
            _ => None,
        })
    }

    /// The `metrics` scenario: one relay drains a fresh backlog four times, its Prometheus
    /// metrics exported in the second and third (off, on, on, off: a drift in the machine's
    /// speed over the four weighs on both sides alike).
    pub(super) async fn metrics_cost(&self) -> anyhow::Result<MetricsCost> {
        let mut off = Vec::new();
        let mut on = Vec::new();
        let mut scrapes = 0;
        // A table per round: a dropped table's name is not reused within a run.
        for (round, export) in [false, true, true, false].into_iter().enumerate() {
            let table = self.db.table(&format!("metrics{round}"));
            self.backlog(&table).await?;
            let (d, n) = self.relay_drain_with(&table, 1, export).await?;
            self.db.drop_outbox(&table).await?;
            scrapes += n;
            if export { on.push(d) } else { off.push(d) }
        }
        Ok(MetricsCost::new(off, on, scrapes))
    }

    /// `relays` relay instances drain `table` (already loaded).
    pub(super) async fn relay_drain(&self, table: &str, relays: usize) -> anyhow::Result<Drain> {
        Ok(self.relay_drain_with(table, relays, false).await?.0)
    }

    /// [`Bench::relay_drain`]; with `export`, the relays' Prometheus metrics are registered
    /// and scraped meanwhile (the `metrics` scenario): the drain and the number of scrapes.
    async fn relay_drain_with(
        &self,
        table: &str,
        relays: usize,
        export: bool,
    ) -> anyhow::Result<(Drain, u64)> {
        let n = self.args.messages;
        self.db.settle(table).await?;
        self.broker.reset().await?;
        let before = self.db.table_stats(table).await?;
        let counters = self.db.pg_counters(table).await?;
        let load_start = loadavg();
        let mut pools = Vec::new();
        let mut instances = Vec::new();
        let mut stores = Vec::new();
        for i in 0..relays {
            let pool = self.db.pool(&format!("relay{i}"), true, 10).await?;
            let store = Outbox::open(&pool.pool, table)?.store();
            stores.push(store.clone());
            let relay = Relay::builder(store)
                .router(self.router(self.broker.transport()))
                .config(self.relay_config(format!("bench-{}-r{i}", self.run_id)))
                .build()?;
            pools.push(pool);
            instances.push(relay);
        }
        let metrics: Vec<Arc<RelayMetrics>> =
            instances.iter().map(|r| r.metrics().clone()).collect();
        // The export: every relay on one registry, the backlog sampled every second and the
        // text format encoded every 100 ms (a scrape far more frequent than Prometheus makes).
        let scraping = CancellationToken::new();
        let scraper = export.then(|| {
            let mut registry = prometheus_client::registry::Registry::default();
            for (r, store) in instances.iter().zip(&stores) {
                outbox::prometheus::register(
                    &mut registry,
                    r,
                    store.clone(),
                    Duration::from_secs(1),
                    scraping.clone(),
                );
            }
            let stop = scraping.clone();
            tokio::spawn(async move {
                let mut scrapes = 0u64;
                let mut tick = tokio::time::interval(Duration::from_millis(100));
                loop {
                    tokio::select! {
                        _ = stop.cancelled() => return scrapes,
                        _ = tick.tick() => {
                            let mut text = String::new();
                            if prometheus_client::encoding::text::encode(&mut text, &registry).is_ok() {
                                scrapes += 1;
                            }
                        }
                    }
                }
            })
        });
        let finished = |m: &[Arc<RelayMetrics>]| -> u64 {
            m.iter()
                .map(|m| {
                    let s = m.snapshot();
                    s.sent + s.failed
                })
                .sum()
        };
        let s0 = StatementCounter::read();
        let handles: Vec<_> = instances.iter().map(Relay::spawn).collect();
        let work = {
            let metrics = metrics.clone();
            tokio::spawn(async move {
                let mut tick = tokio::time::interval(TICK);
                let (mut last, mut since) = (0, Instant::now());
                loop {
                    tick.tick().await;
                    let c = finished(&metrics);
                    if c >= n {
                        break;
                    }
                    if c > last {
                        (last, since) = (c, Instant::now());
                    } else if since.elapsed() > STALL {
                        handles.into_iter().for_each(|h| h.abort());
                        bail!("the drain made no progress for {STALL:?} at {c} of {n} messages");
                    }
                }
                for r in futures::future::join_all(handles.into_iter().map(|h| h.shutdown())).await
                {
                    r?;
                }
                Ok(())
            })
        };
        let bar = self.bar(n, &format!("relay drain x{relays}"));
        let w = self
            .watch(&bar, n, Some(table), || finished(&metrics), work)
            .await;
        scraping.cancel();
        let scrapes = match scraper {
            Some(t) => t.await.context("the scraper panicked")?,
            None => 0,
        };
        let w = w?;
        let s1 = StatementCounter::read();
        for p in pools {
            self.db.retire(p).await?;
        }
        let stored = self.verify(&format!("relay x{relays}"), table).await?;
        let cost = self
            .pg_cost(table, counters, Some((s1.0 - s0.0, s1.1 - s0.1)))
            .await?;
        let growth = self.growth(table, before, &w).await?;
        let d = self.drain_result("relay", relays, &w, load_start, stored, cost, growth);
        Ok((d, scrapes))
    }
}
