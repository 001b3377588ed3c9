//! The scenarios of `outbox bench` with producers: commit → ack latency while producers commit
//! business transactions (`latency`), the business transaction's own latency with and without
//! the outbox insert (`enqueue`), and the statements of a relay with nothing to do (`idle`).

use super::*;

impl Bench {
    /// Producers commit business transactions for `--latency-duration` while one relay
    /// publishes; commit → ack latencies of the messages committed after the warm-up.
    pub(super) async fn latency_run(
        &self,
        business: &str,
        wakeup: Wakeup,
        offered: Option<f64>,
    ) -> anyhow::Result<LatencyRun> {
        let label = match offered {
            Some(r) => format!("{}_{}", wakeup.name(), r as u64),
            None => format!("{}_max", wakeup.name()),
        };
        let table = self.db.table(&format!("lat_{label}"));
        let outbox = self.db.migrate(&table).await?;
        self.broker.reset().await?;
        let acks = Arc::new(Receipts::default());
        let received = Arc::new(Receipts::default());
        let cancel = CancellationToken::new();
        let observer = self
            .broker
            .observe(received.clone(), cancel.clone())
            .await?;
        let (pool, store, relay) = self
            .stamped_relay("latency-relay", &table, &acks, "latency")
            .await?;
        let s0 = StatementCounter::read();
        let handle = relay.spawn();

        let producers = self.args.producers;
        let (warm_us, txs) = self
            .produce(
                &outbox,
                &store,
                business,
                wakeup,
                offered,
                1,
                &format!("latency {label}"),
                || format!("{} acked", acks.count()),
            )
            .await?;
        let total = txs.len() as u64;
        // Wait for the last messages to be acknowledged (and received, when observed).
        let settle_deadline = Instant::now() + SETTLE;
        while acks.count() < total || (observer.is_some() && received.count() < total) {
            if Instant::now() > settle_deadline {
                tracing::warn!(
                    acked = acks.count(),
                    received = received.count(),
                    total,
                    "not every message was acknowledged within {SETTLE:?}"
                );
                break;
            }
            tokio::time::sleep(TICK).await;
        }
        handle.shutdown().await?;
        cancel.cancel();
        if let Some(o) = observer {
            let _ = o.await;
        }
        let s1 = StatementCounter::read();
        self.db.retire(pool).await?;
        self.db.drop_outbox(&table).await?;

        let acked = acks.first_by_id();
        let got = received.first_by_id();
        let offset = self.clock.offset_us;
        let measured: Vec<&TxTimes> = txs.iter().filter(|t| t.committed_us >= warm_us).collect();
        let lat = |from: i64, to: Option<&i64>| to.map(|to| (to - from).max(0) as u64);
        let series = |f: &dyn Fn(&TxTimes) -> Option<u64>| {
            Percentiles::of_micros(measured.iter().filter_map(|t| f(t)))
        };
        let id = |t: &TxTimes| t.message_ids[0];
        // From the end of the warm-up to the last commit: producers that fell behind during the
        // warm-up catch up after it, and the last ones may commit after the deadline.
        let last = measured
            .iter()
            .map(|t| t.committed_us)
            .max()
            .unwrap_or(warm_us);
        let seconds = ((last - warm_us) as f64 / 1e6).max(1e-3);
        Ok(LatencyRun {
            wakeup: wakeup.name().into(),
            offered_rate: offered,
            producers,
            seconds,
            commit_rate: measured.len() as f64 / seconds,
            messages: measured.len() as u64,
            commit_to_ack: series(&|t| lat(t.db_clock_us - offset, acked.get(&id(t)))),
            commit_to_received: series(&|t| lat(t.db_clock_us - offset, got.get(&id(t)))),
            committed_to_ack: series(&|t| lat(t.committed_us, acked.get(&id(t)))),
            transaction: series(&|t| Some(t.transaction_us)),
            relay_statements_per_message: (total > 0).then(|| (s1.0 - s0.0) as f64 / total as f64),
            load: loadavg(),
            slowest: {
                let mut slow: Vec<[f64; 2]> = measured
                    .iter()
                    .filter_map(|t| {
                        let l = lat(t.committed_us, acked.get(&id(t)))?;
                        Some([(t.committed_us - warm_us) as f64 / 1e6, l as f64 / 1e3])
                    })
                    .collect();
                slow.sort_by(|a, b| b[1].total_cmp(&a[1]));
                slow.truncate(10);
                slow
            },
            longest_commit_pause: {
                let mut at: Vec<i64> = measured.iter().map(|t| t.committed_us).collect();
                at.sort_unstable();
                at.windows(2)
                    .max_by_key(|w| w[1] - w[0])
                    .map(|w| [(w[1] - warm_us) as f64 / 1e6, (w[1] - w[0]) as f64 / 1e3])
            },
        })
    }

    /// A relay (not started) on `table` over a pool of its own (10 connections, statements
    /// counted, labelled `pool_label`), named `bench-<run>-<name>`, publishing to the broker
    /// through a transport that records each acknowledgement in `acks`; its pool and store.
    ///
    /// # Errors
    /// A failed connection, an invalid table name or relay configuration.
    pub(super) async fn stamped_relay(
        &self,
        pool_label: &str,
        table: &str,
        acks: &Arc<Receipts>,
        name: &str,
    ) -> anyhow::Result<(db::Labeled, Arc<dyn outbox::Store>, Relay)> {
        let pool = self.db.pool(pool_label, true, 10).await?;
        let store = Outbox::open(&pool.pool, table)?.store();
        let transport = Arc::new(Stamped::new(self.broker.transport(), acks.clone()));
        let relay = Relay::builder(store.clone())
            .router(self.router(transport))
            .config(self.relay_config(format!("bench-{}-{name}", self.run_id)))
            .build()?;
        Ok((pool, store, relay))
    }

    /// `--producers` producers commit business transactions of `per_transaction` messages each
    /// for `--latency-duration`, at `offered` transactions/s in total (open loop) or at their
    /// maximum, calling `store.wake()` after each commit with the in-process wake-up. A progress
    /// bar shows `label` and `status()`. Returns the end of the warm-up (µs since the Unix
    /// epoch, this process's clock: `--warmup` after the start) and every transaction's times.
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn produce(
        &self,
        outbox: &db::Outbox,
        store: &Arc<dyn outbox::Store>,
        business: &str,
        wakeup: Wakeup,
        offered: Option<f64>,
        per_transaction: usize,
        label: &str,
        status: impl Fn() -> String,
    ) -> anyhow::Result<(i64, Vec<TxTimes>)> {
        let warm_us = now_us() + self.args.warmup().as_micros() as i64;
        let duration = self.args.latency_duration;
        let producers = self.args.producers;
        let start = Instant::now();
        let deadline = start + duration;
        let mut tasks = Vec::new();
        for i in 0..producers {
            let (db, outbox, store) = (self.db.clone(), outbox.clone(), store.clone());
            let (business, payload) = (business.to_owned(), self.payload.clone());
            tasks.push(tokio::spawn(async move {
                let mut out: Vec<TxTimes> = Vec::new();
                for k in 0u64.. {
                    if !pace(start, deadline, offered, producers, i, k).await {
                        break;
                    }
                    let msgs = (0..per_transaction)
                        .map(|_| NewMessage::new(TOPIC, payload.clone()))
                        .collect();
                    let t = db
                        .business_tx(
                            &outbox,
                            &business,
                            &format!("customer-{i}"),
                            msgs,
                            wakeup.tx_mode(),
                        )
                        .await?;
                    if wakeup == Wakeup::Embedded {
                        store.wake();
                    }
                    out.push(t);
                }
                anyhow::Ok(out)
            }));
        }
        let bar = self.bar(duration.as_secs(), label);
        let mut tick = tokio::time::interval(Duration::from_millis(200));
        let all = futures::future::try_join_all(tasks);
        tokio::pin!(all);
        let results = loop {
            tokio::select! {
                r = &mut all => break r?,
                _ = tick.tick() => {
                    bar.set_position(start.elapsed().as_secs().min(duration.as_secs()));
                    bar.set_message(format!("{}, load {}", status(), fmt_load(loadavg())));
                }
            }
        };
        bar.finish_and_clear();
        let mut txs = Vec::new();
        for r in results {
            txs.extend(r?);
        }
        Ok((warm_us, txs))
    }

    /// Alternating rounds of business transactions without and with the outbox insert (with
    /// `store.begin()` / `store.commit(tx)`; on PostgreSQL also with a plain transaction, whose
    /// trigger NOTIFY is sent inside it).
    /// At `offered` transactions/s in total (open loop), or at the producers' maximum.
    pub(super) async fn enqueue_run(
        &self,
        business: &str,
        offered: Option<f64>,
    ) -> anyhow::Result<Enqueue> {
        const ROUNDS: usize = 4;
        // A table per run: migration records outlive a dropped table.
        let table = self.db.table(match offered {
            Some(_) => "enqueue_rate",
            None => "enqueue_max",
        });
        let outbox = self.db.migrate(&table).await?;
        // (enqueue, mode): without, with (store), with (trigger, PostgreSQL only).
        let mut variants = vec![(false, TxMode::Plain), (true, TxMode::Store)];
        if self.db.dialect == Dialect::Postgres {
            variants.push((true, TxMode::Plain));
        }
        let round = self.args.enqueue_duration / (variants.len() * ROUNDS) as u32;
        let label = match offered {
            Some(r) => format!("enqueue overhead at {r}/s (rounds)"),
            None => "enqueue overhead at max (rounds)".to_owned(),
        };
        let bar = self.bar((variants.len() * ROUNDS) as u64, &label);
        let producers = self.args.producers;
        let mut results: Vec<Vec<TxTimes>> = vec![Vec::new(); variants.len()];
        for r in 0..ROUNDS {
            // Rotate which variant goes first, so drift does not favour one.
            for k in 0..variants.len() {
                let v = (r + k) % variants.len();
                let (enqueue, mode) = variants[v];
                let start = Instant::now();
                let deadline = start + round;
                let tasks = (0..producers).map(|i| {
                    let (db, outbox) = (self.db.clone(), outbox.clone());
                    let (business, payload) = (business.to_owned(), self.payload.clone());
                    tokio::spawn(async move {
                        let mut out = Vec::new();
                        for k in 0u64.. {
                            if !pace(start, deadline, offered, producers, i, k).await {
                                break;
                            }
                            let msg: Vec<NewMessage> = enqueue
                                .then(|| NewMessage::new(TOPIC, payload.clone()))
                                .into_iter()
                                .collect();
                            let customer = format!("customer-{i}");
                            out.push(
                                db.business_tx(&outbox, &business, &customer, msg, mode)
                                    .await?,
                            );
                        }
                        anyhow::Ok(out)
                    })
                });
                for out in futures::future::try_join_all(tasks).await? {
                    results[v].extend(out?);
                }
                bar.inc(1);
                bar.set_message(format!("load {}", fmt_load(loadavg())));
            }
        }
        bar.finish_and_clear();
        self.db.drop_outbox(&table).await?;
        let secs = (round * ROUNDS as u32).as_secs_f64();
        let variant = |v: &[TxTimes]| EnqueueVariant {
            transactions: v.len() as u64,
            rate: v.len() as f64 / secs,
            transaction: Percentiles::of_micros(v.iter().map(|t| t.transaction_us)),
            commit: Percentiles::of_micros(v.iter().map(|t| t.commit_us)),
        };
        let without = variant(&results[0]);
        let with_outbox = variant(&results[1]);
        let with_trigger = results.get(2).map(|r| variant(r));
        let overhead = |with: &EnqueueVariant, f: fn(&Percentiles) -> f64| {
            report::ratio(
                with.transaction.as_ref().map(f),
                without.transaction.as_ref().map(f),
            )
            .map(|r| r - 1.0)
        };
        Ok(Enqueue {
            offered_rate: offered,
            producers: self.args.producers,
            rounds: ROUNDS,
            overhead_p50: overhead(&with_outbox, |p| p.p50_ms),
            overhead_p99: overhead(&with_outbox, |p| p.p99_ms),
            overhead_trigger_p50: with_trigger
                .as_ref()
                .and_then(|w| overhead(w, |p| p.p50_ms)),
            overhead_trigger_p99: with_trigger
                .as_ref()
                .and_then(|w| overhead(w, |p| p.p99_ms)),
            without,
            with_outbox,
            with_outbox_trigger: with_trigger,
            load: loadavg(),
        })
    }

    /// A relay on an empty outbox, watched for `--idle-duration` after one poll interval of
    /// start-up.
    pub(super) async fn idle_run(&self) -> anyhow::Result<Idle> {
        let table = self.db.table("idle");
        self.db.migrate(&table).await?;
        let counters = self.db.pg_counters(&table).await?;
        let pool = self.db.pool("idle-relay", true, 10).await?;
        let config = self.relay_config(format!("bench-{}-idle", self.run_id));
        let poll = config.poll_interval;
        let relay = Relay::builder(Outbox::open(&pool.pool, &table)?.store())
            .router(self.router(self.broker.transport()))
            .config(config)
            .build()?;
        let started = Instant::now();
        let handle = relay.spawn();
        // Start-up (LISTEN, first claim) is not idling: leave one poll interval out.
        tokio::time::sleep(poll).await;
        let s0 = StatementCounter::read();
        let window = Instant::now();
        let bar = self.bar(self.args.idle_duration.as_secs(), "idle relay (seconds)");
        while window.elapsed() < self.args.idle_duration {
            tokio::time::sleep(Duration::from_millis(200)).await;
            bar.set_position(window.elapsed().as_secs());
        }
        let s1 = StatementCounter::read();
        let seconds = window.elapsed().as_secs_f64();
        bar.finish_and_clear();
        handle.shutdown().await?;
        let lifetime = started.elapsed().as_secs_f64();
        self.db.retire(pool).await?;
        let after = self.db.pg_counters(&table).await?;
        self.db.drop_outbox(&table).await?;
        let statements = s1.0 - s0.0;
        let per_second = statements as f64 / seconds;
        let (scans, commits) = match (counters, after) {
            // PostgreSQL counts over the relay's whole life (its counters are flushed at exit).
            (Some(b), Some(a)) => (
                Some((a.scans - b.scans) as f64 / lifetime),
                Some((a.db_commits - b.db_commits) as f64 / lifetime),
            ),
            _ => (None, None),
        };
        Ok(Idle {
            seconds,
            poll_interval_ms: poll.as_millis() as u64,
            statements,
            statements_per_second: per_second,
            statements_per_poll_interval: per_second * poll.as_secs_f64(),
            table_scans_per_second: scans,
            db_commits_per_second_all_clients: commits,
            load: loadavg(),
        })
    }
}
