//! The `consume` scenario of `outbox bench`: the consumer side. `--messages` messages are
//! published to the broker once; then, each as a consumer group of its own reading them all from
//! the first, with the same fetch size and lanes (on a queue, RabbitMQ's, which a consumer
//! empties, the backlog is published again before each):
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

/// How a consumer of the `consume` and `pipeline` scenarios applies what it receives, and
/// whether it stamps each acknowledgement.
pub struct Apply {
    /// Raw or through an inbox.
    pub how: How,
    /// When set, each acknowledged message's id is recorded here when its acknowledgement is
    /// sent: after its inbox transaction committed (the `pipeline` scenario's commit → effect).
    pub stamp: Option<Arc<Receipts>>,
}

/// Raw or through an inbox on one of the databases.
pub enum How {
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
    /// Drive `source` until `cancel` as [`Apply::how`] says: [`source::run`] with an
    /// acknowledging handler (raw), or the production runner [`source::consume`] with the
    /// inbox; through [`Stamping`], which records acknowledgements when [`Apply::stamp`] is set.
    pub async fn run<S: Source>(
        self,
        source: S,
        options: ConsumeOptions,
        metrics: Arc<ConsumerMetrics>,
        cancel: CancellationToken,
    ) -> anyhow::Result<()> {
        let source = Stamping {
            inner: source,
            receipts: self.stamp,
        };
        match self.how {
            How::Raw => {
                source::run(source, &AckAll(metrics), &options.run, &cancel).await?;
            }
            How::Pg(inbox, h) => {
                source::consume(source, inbox, h, options, metrics, cancel).await?
            }
            How::My(inbox, h) => {
                source::consume(source, inbox, h, options, metrics, cancel).await?
            }
            How::Lite(inbox, h) => {
                source::consume(source, inbox, h, options, metrics, cancel).await?
            }
        }
        Ok(())
    }
}

impl How {
    /// An inbox consumer group `group` on `pool`'s database (inbox table `table`, migrated
    /// here), applying `effect`.
    ///
    /// # Errors
    /// An invalid table name or a failed migration.
    pub async fn inbox(
        pool: &Pool,
        table: &str,
        group: &str,
        effect: Arc<Effect>,
    ) -> anyhow::Result<How> {
        Ok(match pool {
            Pool::Pg(p) => {
                let inbox = Inbox::new(p.clone(), table, group)?;
                inbox.migrate().await?;
                How::Pg(inbox, effect)
            }
            Pool::My(p) => {
                let inbox = Inbox::new(p.clone(), table, group)?;
                inbox.migrate().await?;
                How::My(inbox, effect)
            }
            Pool::Lite(p) => {
                let inbox = Inbox::new(p.clone(), table, group)?;
                inbox.migrate().await?;
                How::Lite(inbox, effect)
            }
        })
    }
}

/// A source that records, in `receipts` when set, the id (the `outbox-message-id` header) of
/// each message it acknowledges, when the acknowledgement is sent: the runner settles a batch
/// only after its inbox transaction committed.
pub struct Stamping<S> {
    inner: S,
    receipts: Option<Arc<Receipts>>,
}

#[async_trait::async_trait]
impl<S: Source> Source for Stamping<S> {
    type Token = S::Token;

    fn describe(&self) -> String {
        self.inner.describe()
    }

    async fn open(&mut self) -> Result<(), source::SourceError> {
        self.inner.open().await
    }

    async fn fetch(
        &mut self,
        max: usize,
    ) -> Result<Vec<source::Delivery<Self::Token>>, source::SourceError> {
        self.inner.fetch(max).await
    }

    async fn settle(
        &mut self,
        batch: Vec<(source::Delivery<Self::Token>, Settle)>,
    ) -> Result<(), source::SourceError> {
        if let Some(receipts) = &self.receipts {
            let at = now_us();
            for (d, settle) in &batch {
                let id = d
                    .envelope
                    .headers
                    .get(outbox::message::HEADER_MESSAGE_ID)
                    .and_then(|v| Uuid::parse_str(v).ok());
                if let (Settle::Ack, Some(id)) = (settle, id) {
                    receipts.record(id, at);
                }
            }
        }
        self.inner.settle(batch).await
    }

    async fn close(&mut self) {
        self.inner.close().await
    }
}

/// An effect inserting into business table `table` (`customer`, `amount`) of `dialect`.
pub fn effect(dialect: Dialect, table: &str) -> Arc<Effect> {
    let insert = match dialect {
        Dialect::Postgres => format!("INSERT INTO {table} (customer, amount) VALUES ($1, $2)"),
        _ => format!("INSERT INTO {table} (customer, amount) VALUES (?, ?)"),
    };
    Arc::new(Effect { insert })
}

/// What [`Broker::consume`](super::broker::Broker::consume) starts a consumer source with.
pub struct ConsumerRun {
    /// How the consumer applies what it receives.
    pub apply: Apply,
    /// The runner's lanes, inbox batch and deduplication window.
    pub runner: RunnerSettings,
    /// Messages per fetch.
    pub fetch: usize,
    /// The consumer's counters.
    pub metrics: Arc<ConsumerMetrics>,
    /// Ends the consumer's task.
    pub cancel: CancellationToken,
}

/// A consumer's task: ends at its cancellation or on an error.
pub type ConsumerTask = JoinHandle<anyhow::Result<()>>;

impl ConsumerRun {
    /// Drive `source`, read with `options`, as `apply` in a task.
    pub fn run<S: Source + 'static>(self, source: S, options: ConsumeOptions) -> ConsumerTask {
        tokio::spawn(self.apply.run(source, options, self.metrics, self.cancel))
    }

    /// Build the source of a broker's consumer `config` and drive it in a task (the brokers
    /// whose consumer is built from its config alone).
    ///
    /// # Errors
    /// The config's [`outbox::ConfigError`].
    pub fn spawn<C: source::SourceConfig + 'static>(
        self,
        config: C,
    ) -> anyhow::Result<ConsumerTask> {
        let options = config.options();
        let source = config.into_source(&self.metrics)?;
        Ok(self.run(source, options))
    }
}

/// A running consumer of the bench: its counters, what stops it, its task.
pub type Running = (Arc<ConsumerMetrics>, CancellationToken, ConsumerTask);

impl Bench {
    /// Start the broker's consumer as group `group`, applying through `apply`, with
    /// `--consumer-lanes` lanes, `--consumer-fetch` messages per fetch, `inbox_batch` messages
    /// at most per inbox transaction and no deduplication window.
    ///
    /// # Errors
    /// A broker without a consumer in the bench, or a failed set-up.
    pub(super) async fn start_consumer(
        &self,
        group: &str,
        apply: Apply,
        inbox_batch: usize,
    ) -> anyhow::Result<Running> {
        let runner = RunnerSettings {
            concurrency: self.args.consumer_lanes,
            inbox_batch,
            dedup_window: None,
            ..RunnerSettings::default()
        };
        let metrics = Arc::new(ConsumerMetrics::default());
        let cancel = CancellationToken::new();
        let run = ConsumerRun {
            apply,
            runner,
            fetch: self.args.consumer_fetch,
            metrics: metrics.clone(),
            cancel: cancel.clone(),
        };
        let consumer = self.broker.consume(group, run).await?;
        Ok((metrics, cancel, consumer))
    }

    /// The `consume` scenario (see the module docs).
    pub(super) async fn consume_run(&mut self) -> anyhow::Result<Vec<Drain>> {
        let n = self.args.messages;
        self.broker.reset().await?;
        self.publish_backlog("publish for the consumers").await?;
        let effects = self.db.table("consumer_effects");
        self.db.create_business_table(&effects).await?;
        let inbox_table = self.db.table("consumer_inbox");
        let effect = effect(self.db.dialect, &effects);
        // The consumers' pool: one connection per lane and one for the maintenance task.
        let lanes = self.args.consumer_lanes;
        let pool = self.db.pool("consumer", false, lanes as u32 + 2).await?;
        let mut out = Vec::new();
        for (k, (name, batch)) in [
            ("consume-raw", None),
            ("consume-inbox-1", Some(1)),
            ("consume-inbox-batch", Some(self.args.inbox_batch)),
        ]
        .into_iter()
        .enumerate()
        {
            if k > 0 && self.broker.consuming_removes() {
                // A queue: the consumer before took the backlog off it.
                self.broker.reset().await?;
                self.publish_backlog("publish again for the next consumer")
                    .await?;
            }
            let group = format!("bench-{}-{name}", self.run_id);
            let how = match batch {
                None => How::Raw,
                Some(_) => How::inbox(&pool.pool, &inbox_table, &group, effect.clone()).await?,
            };
            let apply = Apply { how, stamp: None };
            let load_start = loadavg();
            let (metrics, cancel, consumer) = self
                .start_consumer(&group, apply, batch.unwrap_or(1))
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
