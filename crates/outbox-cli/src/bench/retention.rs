//! The `retention` scenario (PostgreSQL): the same `--search-rows` rows (the `search`
//! scenario's fill: 100 hours of rows, 99.9 % finished) removed past a one-hour retention, once
//! row by row as the relay does on a plain table ([`outbox::Store::retire`], transactions of
//! 500 rows per state until a transaction is not full) and once by dropping day partitions as
//! it does on a partitioned table ([`outbox::Store::retire_partitions`] until a round drops
//! nothing). Both call the store methods the relay's maintenance calls, back to back, without
//! the maintenance interval between rounds.
//!
//! The partitioned table gets day partitions for the fill's five days (the relay creates only
//! today's and later ones, so the bench creates the past ones, as a table that has lived five
//! days would have them).

use std::time::Duration;

use anyhow::bail;
use outbox::StoreOptions;
use outbox::retention::{Finished, Retention, Rule};
use serde::Serialize;
use tokio::time::Instant;

use super::Bench;
use super::db::Pool;
use super::report::ratio;
use super::search::Fill;

/// One way of removing the rows.
#[derive(Debug, Clone, Serialize, Default)]
pub struct Removal {
    /// Rows removed from the outbox table.
    pub rows: u64,
    /// Wall time, seconds.
    pub seconds: f64,
    /// `rows / seconds`.
    pub rate: f64,
    /// Transactions (row-wise) or rounds (partitions) it took.
    pub steps: u64,
    /// Rows the partition rounds carried forward (rows that had to stay).
    pub carried: u64,
}

/// The `retention` scenario's figures.
#[derive(Debug, Clone, Serialize, Default)]
pub struct RetentionRun {
    /// Rows of each table before.
    pub rows: u64,
    /// Row by row.
    pub delete: Removal,
    /// Day partitions dropped.
    pub partitions: Removal,
    /// `partitions.rate / delete.rate`.
    pub ratio: Option<f64>,
}

/// Every finished state deleted after an hour.
fn one_hour() -> Retention {
    let rule = Rule::delete_after(Duration::from_secs(3600));
    Retention {
        sent: rule,
        confirmed: rule,
        rejected: rule,
        failed: rule,
        rolled_back: rule,
        archived: None,
    }
}

impl Bench {
    /// The `retention` scenario.
    pub(super) async fn retention_run(&self) -> anyhow::Result<RetentionRun> {
        let Pool::Pg(pool) = &self.db.control else {
            bail!(
                "the retention scenario compares PostgreSQL's partition drop: --database postgres://…"
            );
        };
        let rows = self.args.search_rows;
        let retention = one_hour();

        // Row by row.
        let table = self.db.table("retdelete");
        let store = self.db.migrate(&table).await?.store();
        Fill::new(self, rows, false)
            .await?
            .run(self, &table)
            .await?;
        self.db.settle(&table).await?;
        let mut delete = Removal::default();
        let started = Instant::now();
        for state in Finished::ALL {
            let rule = retention.rule(state);
            let Some(after) = rule.after else { continue };
            loop {
                let n = store.retire(state, after, rule.action, 500).await?;
                delete.rows += n;
                delete.steps += 1;
                if n < 500 {
                    break;
                }
            }
        }
        delete.seconds = started.elapsed().as_secs_f64();
        delete.rate = delete.rows as f64 / delete.seconds;
        self.db.drop_outbox(&table).await?;

        // Whole partitions.
        let table = self.db.table("retpart");
        let pg = outbox::PgStore::from_pool(pool.clone(), StoreOptions::table(&table))?;
        pg.migrate_partitioned().await?;
        let base = table.rsplit('.').next().unwrap_or(&table);
        let schema = table
            .split_once('.')
            .map(|(s, _)| format!("{s}."))
            .unwrap_or_default();
        self.db
            .exec(&format!(
                "DO $$ DECLARE d date; BEGIN \
                 FOR i IN 1..6 LOOP d := (now() AT TIME ZONE 'UTC')::date - i; \
                 EXECUTE format('CREATE TABLE IF NOT EXISTS {schema}{base}_p%s PARTITION OF {table} \
                 FOR VALUES FROM (%L) TO (%L)', to_char(d, 'YYYYMMDD'), \
                 d::timestamp AT TIME ZONE 'UTC', (d + 1)::timestamp AT TIME ZONE 'UTC'); \
                 END LOOP; END $$"
            ))
            .await?;
        Fill::new(self, rows, true).await?.run(self, &table).await?;
        self.db.settle(&table).await?;
        let mut partitions = Removal::default();
        let store: &dyn outbox::Store = &pg;
        let started = Instant::now();
        loop {
            let Some(round) = store.retire_partitions(&retention).await? else {
                bail!("{table} is not partitioned");
            };
            partitions.steps += 1;
            partitions.rows += round.deleted + round.archived;
            partitions.carried += round.carried;
            if round.dropped == 0 {
                break;
            }
        }
        partitions.seconds = started.elapsed().as_secs_f64();
        partitions.rate = partitions.rows as f64 / partitions.seconds;
        self.db.drop_outbox(&table).await?;
        Ok(RetentionRun {
            rows,
            ratio: ratio(Some(partitions.rate), Some(delete.rate)),
            delete,
            partitions,
        })
    }
}
