//! The `pipeline` scenario of `outbox bench`: the whole path, end to end. `--producers`
//! producers commit business transactions, each with `--messages-per-transaction` outbox
//! messages (default 1), through the store; one
//! [`Relay`] publishes them to the broker; one consumer runner (the production
//! [`outbox::consumer::source::consume`], `--consumer-lanes` lanes, `--consumer-fetch` per
//! fetch, `runner.inbox_batch = --inbox-batch`) applies each through an inbox, its handler
//! inserting one business row in the inbox transaction.
//!
//! Two runs of `--latency-duration` each (the warm-up left out):
//! 1. the producers at their maximum: the **end-to-end rate**, messages committed after the
//!    warm-up over the time from the end of the warm-up to the last of them applied, which the
//!    slowest stage bounds;
//! 2. the producers paced at half that rate (open loop): the **commit → effect latency** a user
//!    would see at a sustainable load, from the database clock before `COMMIT` to the
//!    consumer's acknowledgement, which the runner sends only after the inbox transaction
//!    that applied the message committed.
//!
//! With one message per transaction on a small machine the producers' commit rate bounds the
//! first figure; more messages per transaction show how far the relay and the consumer go.
//!
//! Each run checks that every committed message was applied exactly once (one business row per
//! message).

use super::consume::{self, Apply, How};
use super::report::PipelineRun;
use super::*;

impl Bench {
    /// The `pipeline` scenario (see the module docs): the run at the producers' maximum, then
    /// the run paced at half its end-to-end rate.
    pub(super) async fn pipeline_runs(&self, business: &str) -> anyhow::Result<Vec<PipelineRun>> {
        let max = self.pipeline_run(business, None).await?;
        let paced = (max.end_to_end_rate / 2.0).round().max(1.0);
        let half = self.pipeline_run(business, Some(paced)).await?;
        Ok(vec![max, half])
    }

    /// One run of the pipeline at `offered` messages/s in total (`offered` over
    /// `--messages-per-transaction` transactions/s), or at the producers' maximum.
    async fn pipeline_run(
        &self,
        business: &str,
        offered: Option<f64>,
    ) -> anyhow::Result<PipelineRun> {
        let label = match offered {
            Some(r) => format!("pipeline_{}", r as u64),
            None => "pipeline_max".to_owned(),
        };
        let table = self.db.table(&label);
        let outbox = self.db.migrate(&table).await?;
        self.broker.reset().await?;

        // The consumer first, so that it has joined before the first message.
        let effects = self.db.table(&format!("{label}_effects"));
        self.db.create_business_table(&effects).await?;
        let inbox_table = self.db.table(&format!("{label}_inbox"));
        let lanes = self.args.consumer_lanes;
        let consumer_pool = self
            .db
            .pool("pipeline-consumer", false, lanes as u32 + 2)
            .await?;
        let group = format!("bench-{}-{label}", self.run_id);
        let effect = consume::effect(self.db.dialect, &effects);
        let applied = Arc::new(Receipts::default());
        let apply = Apply {
            how: How::inbox(&consumer_pool.pool, &inbox_table, &group, effect).await?,
            stamp: Some(applied.clone()),
        };
        let (metrics, cancel, consumer) = self
            .start_consumer(&group, apply, self.args.inbox_batch)
            .await?;

        let acks = Arc::new(Receipts::default());
        let (pool, store, relay) = self
            .stamped_relay("pipeline-relay", &table, &acks, &label)
            .await?;
        let handle = relay.spawn();

        let (warm_us, txs) = self
            .produce(
                &outbox,
                &store,
                business,
                Wakeup::Embedded,
                offered.map(|r| r / self.args.messages_per_transaction as f64),
                self.args.messages_per_transaction,
                &label.replace('_', " "),
                || format!("{} applied", applied.count()),
            )
            .await?;
        let total: u64 = txs.iter().map(|t| t.message_ids.len() as u64).sum();
        // Until every committed message was applied, or no progress for `STALL`.
        let mut last = (applied.count(), Instant::now());
        while applied.count() < total {
            let now = applied.count();
            if now != last.0 {
                last = (now, Instant::now());
            } else if last.1.elapsed() > STALL {
                bail!("{label}: no message applied for {STALL:?} at {now} of {total}");
            }
            tokio::time::sleep(TICK).await;
        }
        handle.shutdown().await?;
        cancel.cancel();
        consumer.await.context("consumer task panicked")??;
        let rows = self.db.count(&effects).await?;
        let first = applied.first_by_id();
        if rows != total || first.len() as u64 != total {
            bail!(
                "{label}: {total} messages committed, {} acknowledged by the consumer, {rows} \
                 business rows",
                first.len()
            );
        }
        self.db.drop_table(&effects).await?;
        self.db.retire(consumer_pool).await?;
        self.db.retire(pool).await?;
        self.db.drop_outbox(&table).await?;

        let acked = acks.first_by_id();
        let offset = self.clock.offset_us;
        let measured: Vec<&TxTimes> = txs.iter().filter(|t| t.committed_us >= warm_us).collect();
        // (message id, database clock before its transaction's COMMIT), of every measured message.
        let ids = || {
            measured
                .iter()
                .flat_map(|t| t.message_ids.iter().map(move |id| (id, t.db_clock_us)))
        };
        let from_commit = |at: &std::collections::HashMap<Uuid, i64>| {
            Percentiles::of_micros(ids().filter_map(|(id, db_clock)| {
                at.get(id)
                    .map(|to| (to - (db_clock - offset)).max(0) as u64)
            }))
        };
        let last_commit = measured.iter().map(|t| t.committed_us).max();
        let last_effect = ids().filter_map(|(id, _)| first.get(id)).max();
        let seconds = |end: Option<i64>| (end.unwrap_or(warm_us) - warm_us) as f64 / 1e6;
        let messages = ids().count() as u64;
        Ok(PipelineRun {
            offered_rate: offered,
            producers: self.args.producers,
            messages_per_transaction: self.args.messages_per_transaction,
            messages,
            seconds: seconds(last_commit),
            commit_rate: messages as f64 / seconds(last_commit).max(1e-3),
            end_to_end_rate: messages as f64 / seconds(last_effect.copied()).max(1e-3),
            commit_to_ack: from_commit(&acked),
            commit_to_effect: from_commit(&first),
            inbox_batches: metrics.inbox_batches.load(Ordering::Relaxed),
            load: loadavg(),
        })
    }
}
