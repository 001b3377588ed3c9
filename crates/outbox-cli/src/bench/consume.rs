//! The `consume` scenario of `outbox bench`: the consumer side. `--messages` messages are
//! published to the broker once; then, each as a consumer group of its own reading them all from
//! the first, with the same fetch size and lanes:
//!
//! - `consume-raw`: the broker's consumer source acknowledging each message, no database (what
//!   the broker and its client allow);
//! - `consume-inbox-1`: the production runner ([`outbox::consumer::source::consume`]) applying
//!   each message in a transaction of its own (`runner.inbox_batch = 1`, the default): the inbox
//!   row and one business row;
//! - `consume-inbox-batch`: the same runner with `runner.inbox_batch = --inbox-batch`: one
//!   transaction per batch of a lane.
//!
//! Each is timed from the runner's start to the last message applied (or acknowledged); the
//! ratios batch / one-per-transaction and batch / raw come from the same run.

use outbox::consumer::source::{self, BatchHandler, ConsumeOptions, Envelope, Settle, Source};
use outbox::consumer::{ConsumerMetrics, RunnerSettings};
use outbox::{HandlerError, InboundMessage, Inbox};

use super::db::Pool;
use super::*;

/// How a consumer of the `consume` scenario applies what it receives.
pub enum Apply {
    /// Acknowledge each message, no database.
    Raw,
    /// Through an inbox on PostgreSQL, the handler inserting into the business table.
    Pg(Inbox<sqlx::Postgres>, Arc<Effect>),
    /// Through an inbox on MySQL/MariaDB.
    My(Inbox<sqlx::MySql>, Arc<Effect>),
    /// Through an inbox on SQLite.
    Lite(Inbox<sqlx::Sqlite>, Arc<Effect>),
}

/// The consumer's business effect: one row of the business table (`customer` = the message id,
/// `amount` = the payload's length), in the inbox transaction.
pub struct Effect {
    insert: String,
}

macro_rules! effect_on {
    ($db:ty) => {
        #[async_trait::async_trait]
        impl outbox::Handler<$db> for Effect {
            async fn handle(
                &self,
                conn: &mut <$db as sqlx::Database>::Connection,
                msg: &InboundMessage,
            ) -> Result<(), HandlerError> {
                sqlx::query(sqlx::AssertSqlSafe(self.insert.as_str()))
                    .bind(msg.message_id.to_string())
                    .bind(msg.payload.len() as i64)
                    .execute(&mut *conn)
                    .await
                    .map_err(HandlerError::transient)?;
                Ok(())
            }
        }
    };
}
effect_on!(sqlx::Postgres);
effect_on!(sqlx::MySql);
effect_on!(sqlx::Sqlite);

/// The raw consumer's batch handler: acknowledge everything, count it as applied.
struct AckAll(Arc<ConsumerMetrics>);

#[async_trait::async_trait]
impl BatchHandler for AckAll {
    async fn handle(&self, batch: &[&Envelope]) -> Vec<Settle> {
        self.0
            .applied
            .fetch_add(batch.len() as u64, Ordering::Relaxed);
        vec![Settle::Ack; batch.len()]
    }
}

impl Apply {
    /// Drive `source` until `cancel` as this variant: [`source::run`] with an acknowledging
    /// handler (raw), or the production runner [`source::consume`] with the inbox.
    pub async fn run<S: Source>(
        self,
        source: S,
        options: ConsumeOptions,
        metrics: Arc<ConsumerMetrics>,
        cancel: CancellationToken,
    ) -> anyhow::Result<()> {
        match self {
            Apply::Raw => {
                source::run(source, &AckAll(metrics), &options.run, &cancel).await?;
            }
            Apply::Pg(inbox, h) => {
                source::consume(source, inbox, h, options, metrics, cancel).await?
            }
            Apply::My(inbox, h) => {
                source::consume(source, inbox, h, options, metrics, cancel).await?
            }
            Apply::Lite(inbox, h) => {
                source::consume(source, inbox, h, options, metrics, cancel).await?
            }
        }
        Ok(())
    }
}

/// Build the source of a broker's consumer `config` and drive it as `apply` in a task (the
/// brokers whose consumer is built from its config alone).
///
/// # Errors
/// The config's [`outbox::ConfigError`].
pub fn spawn<C: source::SourceConfig + 'static>(
    config: C,
    apply: Apply,
    metrics: Arc<ConsumerMetrics>,
    cancel: CancellationToken,
) -> anyhow::Result<JoinHandle<anyhow::Result<()>>> {
    let options = config.options();
    let source = config.into_source(&metrics)?;
    Ok(tokio::spawn(apply.run(source, options, metrics, cancel)))
}

impl Bench {
    /// The `consume` scenario (see the module docs).
    pub(super) async fn consume_run(&mut self) -> anyhow::Result<Vec<Drain>> {
        let n = self.args.messages;
        self.broker.reset().await?;
        self.publish_backlog("publish for the consumers").await?;
        let effects = self.db.table("consumer_effects");
        self.db.create_business_table(&effects).await?;
        let inbox_table = self.db.table("consumer_inbox");
        let insert = match self.db.dialect {
            Dialect::Postgres => {
                format!("INSERT INTO {effects} (customer, amount) VALUES ($1, $2)")
            }
            _ => format!("INSERT INTO {effects} (customer, amount) VALUES (?, ?)"),
        };
        let effect = Arc::new(Effect { insert });
        // The consumers' pool: one connection per lane and one for the maintenance task.
        let lanes = self.args.consumer_lanes;
        let pool = self.db.pool("consumer", false, lanes as u32 + 2).await?;
        let mut out = Vec::new();
        for (name, batch) in [
            ("consume-raw", None),
            ("consume-inbox-1", Some(1)),
            ("consume-inbox-batch", Some(self.args.inbox_batch)),
        ] {
            let group = format!("bench-{}-{name}", self.run_id);
            let apply = match (batch, &pool.pool) {
                (None, _) => Apply::Raw,
                (Some(_), Pool::Pg(p)) => {
                    let inbox = Inbox::new(p.clone(), &inbox_table, &group)?;
                    inbox.migrate().await?;
                    Apply::Pg(inbox, effect.clone())
                }
                (Some(_), Pool::My(p)) => {
                    let inbox = Inbox::new(p.clone(), &inbox_table, &group)?;
                    inbox.migrate().await?;
                    Apply::My(inbox, effect.clone())
                }
                (Some(_), Pool::Lite(p)) => {
                    let inbox = Inbox::new(p.clone(), &inbox_table, &group)?;
                    inbox.migrate().await?;
                    Apply::Lite(inbox, effect.clone())
                }
            };
            let runner = RunnerSettings {
                concurrency: lanes,
                inbox_batch: batch.unwrap_or(1),
                dedup_window: None,
                ..RunnerSettings::default()
            };
            let metrics = Arc::new(ConsumerMetrics::default());
            let cancel = CancellationToken::new();
            let load_start = loadavg();
            let consumer = self
                .broker
                .consume(
                    &group,
                    apply,
                    runner,
                    self.args.consumer_fetch,
                    metrics.clone(),
                    cancel.clone(),
                )
                .await?;
            let work = {
                let metrics = metrics.clone();
                tokio::spawn(async move {
                    // Until every message was applied (or acknowledged) once.
                    let mut tick = tokio::time::interval(TICK);
                    let mut last = (0, Instant::now());
                    loop {
                        tick.tick().await;
                        let done = metrics.applied.load(Ordering::Relaxed);
                        if done >= n {
                            break;
                        }
                        if done != last.0 {
                            last = (done, Instant::now());
                        } else if last.1.elapsed() > STALL {
                            bail!("{name}: no progress for {STALL:?} at {done} of {n}");
                        }
                    }
                    Ok(())
                })
            };
            let bar = self.bar(n, name);
            let progress = || metrics.applied.load(Ordering::Relaxed);
            let w = self.watch(&bar, n, None, progress, work).await;
            cancel.cancel();
            consumer.await.context("consumer task panicked")??;
            let w = w?;
            let failures = metrics.failures.load(Ordering::Relaxed);
            if failures > 0 {
                self.report.notes.push(format!(
                    "{name}: {failures} handler or inbox failure(s), redelivered"
                ));
            }
            let mut d = self.drain_result(name, 1, &w, load_start, None, None, None);
            d.inbox_batches = Some(metrics.inbox_batches.load(Ordering::Relaxed));
            out.push(d);
        }
        let applied = self.db.count(&effects).await?;
        if applied != 2 * n {
            bail!("consume: {applied} business rows for 2 × {n} messages applied");
        }
        self.db.drop_table(&effects).await?;
        self.db.retire(pool).await?;
        Ok(out)
    }
}
