//! `outbox bench`: measures [`outbox::Relay`] through its public API on the machine's real
//! services, with the baselines it is judged against run in the same process, and prints a table
//! and writes a JSON file (see `docs/benchmarks.md` for the method behind every figure).
//!
//! Scenarios (`--only`), in the order they run:
//! - `broker`: the raw broker publish rate with acknowledgements: the same [`Transport`] the
//!   relay uses, batches of `--batch-size` with `--broker-window` messages in flight, no
//!   database;
//! - `baseline`: the naive and the tuned raw-SQL relay loops ([`raw`]) on copies of the backlog;
//! - `drain`: one relay drains the backlog (`--messages` of `--payload-bytes`): rate, rate per
//!   tenth, database cost per message, dead tuples and index size before/after (PostgreSQL);
//! - `scaling`: `--relays` instances (in-process, distinct names, one pool each) drain the same
//!   backlog size;
//! - `latency`: producers commit business transactions (a business row and an outbox row) at
//!   `--rate` and at their maximum while one relay publishes: commit → ack percentiles, with the
//!   in-process wake-up (`embedded`) and without it (`external`: NOTIFY on PostgreSQL);
//! - `enqueue`: the business transaction's latency with and without the outbox insert;
//! - `idle`: statements per second of a relay with nothing to do.
//!
//! Brokers (`--transport`, see [`broker`]): NATS JetStream, Redis Streams, RabbitMQ, Kafka (any
//! Kafka-protocol broker) or an in-process sink, each through the library's own transport.
//!
//! Everything the run creates (a schema or `bench_<run>_*` tables, a JetStream stream, a Redis
//! stream key, a RabbitMQ queue) is removed at the end unless `--keep`; a Kafka topic is left
//! on the broker (the library has no topic deletion).

mod broker;
mod db;
mod raw;
mod report;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context, bail};
use futures::StreamExt;
use indicatif::{ProgressBar, ProgressStyle};
use outbox::{
    Message, NewMessage, Outgoing, Relay, RelayConfig, RelayMetrics, Router, Status, Transport,
};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::field::{Field, Visit};
use tracing_subscriber::Layer;
use uuid::Uuid;

use broker::{Broker, Receipts, Stamped};
use db::{Db, Dialect, Outbox, TxMode, TxTimes};
use report::{
    ClockOffset, Cost, Drain, Enqueue, EnqueueVariant, Idle, LatencyRun, Percentiles, Report,
    Table, TableGrowth, fmt_count, fmt_load, fmt_mib, fmt_ms, fmt_ratio, loadavg,
};

/// Topic of every message the bench enqueues.
const TOPIC: &str = "bench";
/// How often a drain's progress is sampled (the rate per tenth interpolates between samples).
const TICK: Duration = Duration::from_millis(10);
/// A drain that makes no progress for this long is abandoned with an error.
const STALL: Duration = Duration::from_secs(120);
/// Longest wait, after the producers stopped, for their last messages to be acknowledged.
const SETTLE: Duration = Duration::from_secs(60);

/// A scenario of `--only`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, clap::ValueEnum)]
pub enum Scenario {
    /// Raw broker publish rate, no database.
    Broker,
    /// The naive and tuned raw-SQL relay loops.
    Baseline,
    /// One relay drains the backlog.
    Drain,
    /// 1, 2, 4 (`--relays`) relays drain the same backlog size.
    Scaling,
    /// Commit → ack latency at a fixed rate and at the producers' maximum.
    Latency,
    /// Business transaction latency with and without the outbox insert.
    Enqueue,
    /// Statements of an idle relay.
    Idle,
}

/// Options of `outbox bench`.
#[derive(Debug, Clone, clap::Args)]
pub struct BenchArgs {
    /// Database under test: `postgres://…`, `mysql://…` (`mariadb://…`) or `sqlite://FILE`.
    /// The run works in a fresh schema (PostgreSQL) or `bench_<run>_*` tables, dropped at the end.
    #[arg(long, env = "OUTBOX_DATABASE_URL")]
    pub database: String,

    /// Broker under test: `nats://host:port` (JetStream; a stream `BENCH_<RUN>` is created and
    /// deleted), `redis://host:port` (Redis Streams; stream key `bench:<run>`, deleted),
    /// `amqp://user:password@host:port/vhost` (RabbitMQ; a durable queue `bench.<run>` through
    /// the default exchange, deleted), `kafka://host:port` (topic `bench-<run>`, created and
    /// left on the broker; not counted) or `memory` (an in-process sink that acknowledges at
    /// once).
    #[arg(long, default_value = "nats://127.0.0.1:4222")]
    pub transport: String,

    /// Scenarios to run, comma-separated.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "broker,baseline,drain,scaling,latency,enqueue,idle"
    )]
    pub only: Vec<Scenario>,

    /// Backlog size of the drains, the baselines, the scaling runs and the broker run.
    #[arg(long, default_value_t = 1_000_000)]
    pub messages: u64,

    /// Payload size of every message, bytes.
    #[arg(long, default_value_t = 256)]
    pub payload_bytes: usize,

    /// Rows per claim, for the relay and the raw-SQL loops (the relay's default: 500).
    #[arg(long, default_value_t = 500)]
    pub batch_size: u32,

    /// Batches the relay publishes concurrently (default: the relay's default, 2).
    #[arg(long)]
    pub in_flight: Option<usize>,

    /// Messages in flight in the raw broker run.
    #[arg(long, default_value_t = 20_000)]
    pub broker_window: usize,

    /// Relay instance counts of the scaling scenario, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
    pub relays: Vec<usize>,

    /// Offered commit rate of the fixed-rate latency runs, transactions per second.
    #[arg(long, default_value_t = 1000.0)]
    pub rate: f64,

    /// Producer tasks of the latency and enqueue scenarios.
    #[arg(long, default_value_t = 8)]
    pub producers: usize,

    /// Length of each latency run (the first fifth, at most 1 s, is a warm-up left out).
    #[arg(long, default_value = "20s", value_parser = humantime::parse_duration)]
    pub latency_duration: Duration,

    /// Length of the enqueue scenario (both variants together).
    #[arg(long, default_value = "20s", value_parser = humantime::parse_duration)]
    pub enqueue_duration: Duration,

    /// How long the idle relay is watched.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    pub idle_duration: Duration,

    /// Where to write the JSON report.
    #[arg(long, default_value = "outbox-bench.json")]
    pub json: PathBuf,

    /// No progress bars.
    #[arg(long)]
    pub no_progress: bool,

    /// Keep the tables and the stream for inspection instead of dropping them.
    #[arg(long)]
    pub keep: bool,

    /// `TCP_NODELAY` on the database connections: `on` (default, what `PgStore::connect` and
    /// `MySqlStore::connect` do) or `off` (sqlx 0.9.0's default, to measure what Nagle's
    /// algorithm against delayed ACK costs the latency tail).
    #[arg(long, default_value = "on", value_parser = ["on", "off"])]
    pub tcp_nodelay: String,
}

impl BenchArgs {
    /// Check the options before anything is connected; the error names the option.
    ///
    /// # Errors
    /// The first bad option and the rule it breaks.
    pub fn validate(&self) -> Result<(), String> {
        if self.only.is_empty() {
            return Err("--only: name at least one scenario".into());
        }
        if self.messages < 10 {
            return Err("--messages must be at least 10 (the drain is reported per tenth)".into());
        }
        let max_payload = outbox::Limits::default().max_payload_bytes;
        if !(1..=max_payload).contains(&self.payload_bytes) {
            return Err(format!("--payload-bytes must be 1 to {max_payload}"));
        }
        if !(1..=10_000).contains(&self.batch_size) {
            return Err("--batch-size must be 1 to 10000".into());
        }
        if self.in_flight == Some(0) {
            return Err("--in-flight must be at least 1".into());
        }
        if self.broker_window == 0 {
            return Err("--broker-window must be at least 1".into());
        }
        if self.relays.is_empty() || self.relays.iter().any(|r| !(1..=64).contains(r)) {
            return Err("--relays: a list of instance counts, each 1 to 64".into());
        }
        if !(self.rate.is_finite() && self.rate > 0.0) {
            return Err("--rate must be a positive number of transactions per second".into());
        }
        if !(1..=1024).contains(&self.producers) {
            return Err("--producers must be 1 to 1024".into());
        }
        for (name, d) in [
            ("--latency-duration", self.latency_duration),
            ("--enqueue-duration", self.enqueue_duration),
            ("--idle-duration", self.idle_duration),
        ] {
            if d < Duration::from_secs(1) {
                return Err(format!("{name} must be at least 1s"));
            }
        }
        broker::Kind::parse(&self.transport).map_err(|e| format!("--transport: {e}"))?;
        Dialect::of_url(&self.database).map_err(|e| e.to_string())?;
        Ok(())
    }

    fn runs(&self, s: Scenario) -> bool {
        self.only.contains(&s)
    }

    fn in_flight(&self) -> usize {
        self.in_flight
            .unwrap_or_else(|| RelayConfig::default().in_flight_batches)
    }

    /// The first fifth of a latency run, at most one second, is left out of the figures.
    fn warmup(&self) -> Duration {
        (self.latency_duration / 5).min(Duration::from_secs(1))
    }
}

/// This process's clock in µs since the Unix epoch (the clock latencies end on).
pub(crate) fn now_us() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as i64)
        .unwrap_or(0)
}

static STATEMENTS: AtomicU64 = AtomicU64::new(0);
static ROWS_AFFECTED: AtomicU64 = AtomicU64::new(0);

/// A tracing layer counting sqlx's statement log events (target `sqlx::query`: one per query or
/// execute, `COMMIT` included, `BEGIN` not) and summing their `rows_affected`. Only the relays'
/// pools log statements (see [`db`]), so the counts are the relays' own.
pub struct StatementCounter;

impl StatementCounter {
    /// The layer, filtered to sqlx's statement events, for `main` to install.
    pub fn layer<S>() -> impl Layer<S>
    where
        S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
    {
        StatementCounter.with_filter(tracing_subscriber::filter::filter_fn(|m| {
            m.target() == "sqlx::query"
        }))
    }

    /// `(statements, rows affected)` so far.
    fn read() -> (u64, u64) {
        (
            STATEMENTS.load(Ordering::Relaxed),
            ROWS_AFFECTED.load(Ordering::Relaxed),
        )
    }
}

impl<S: tracing::Subscriber> Layer<S> for StatementCounter {
    fn on_event(
        &self,
        event: &tracing::Event<'_>,
        _ctx: tracing_subscriber::layer::Context<'_, S>,
    ) {
        struct Rows(u64);
        impl Visit for Rows {
            fn record_u64(&mut self, field: &Field, value: u64) {
                if field.name() == "rows_affected" {
                    self.0 = value;
                }
            }
            fn record_debug(&mut self, _: &Field, _: &dyn std::fmt::Debug) {}
        }
        let mut rows = Rows(0);
        event.record(&mut rows);
        STATEMENTS.fetch_add(1, Ordering::Relaxed);
        ROWS_AFFECTED.fetch_add(rows.0, Ordering::Relaxed);
    }
}

/// Wait until producer `i` of `producers` may start its transaction number `k` of a run from
/// `start` to `deadline`: open loop at `offered` transactions/s in total (a producer that falls
/// behind catches up without sleeping), or back to back (`None`). `false` once the run is over.
async fn pace(
    start: Instant,
    deadline: Instant,
    offered: Option<f64>,
    producers: usize,
    i: usize,
    k: u64,
) -> bool {
    match offered {
        Some(rate) => {
            let at =
                start + Duration::from_secs_f64((i as f64 + (k * producers as u64) as f64) / rate);
            if at >= deadline {
                return false;
            }
            tokio::time::sleep_until(at).await;
            true
        }
        None => Instant::now() < deadline,
    }
}

/// Which wake-up a latency run's relay gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Wakeup {
    /// Producers commit with `store.begin()` / `store.commit(tx)` and call `Store::wake` on the
    /// relay's store after each commit.
    Embedded,
    /// No in-process wake-up: producers commit with `store.begin()` / `store.commit(tx)`, whose
    /// post-commit NOTIFY wakes the relay on PostgreSQL; elsewhere the poll timer does.
    External,
    /// PostgreSQL only: producers commit with `pool.begin()` / `tx.commit()`, so the outbox
    /// trigger's NOTIFY inside each transaction wakes the relay (a plain-SQL producer's path).
    Trigger,
}

impl Wakeup {
    fn name(self) -> &'static str {
        match self {
            Wakeup::Embedded => "embedded",
            Wakeup::External => "external",
            Wakeup::Trigger => "trigger",
        }
    }

    fn tx_mode(self) -> TxMode {
        match self {
            Wakeup::Embedded | Wakeup::External => TxMode::Store,
            Wakeup::Trigger => TxMode::Plain,
        }
    }
}

/// A drain watched to its end: wall time and progress samples.
struct Watched {
    seconds: f64,
    samples: Vec<(f64, u64)>,
    at_decile: Vec<report::TableStats>,
}

struct Bench {
    args: BenchArgs,
    db: Arc<Db>,
    broker: Box<dyn Broker>,
    run_id: String,
    payload: Vec<u8>,
    report: Report,
    clock: ClockOffset,
}

/// Run the benchmark (see the module docs).
///
/// # Errors
/// Bad options, an unreachable service, or a scenario that failed (lost messages, a stalled
/// drain, a database error); the run's tables and stream are removed either way.
pub async fn run(args: BenchArgs) -> anyhow::Result<()> {
    args.validate().map_err(anyhow::Error::msg)?;
    let run_id = format!("{:08x}", rand::random::<u32>());
    let db = Arc::new(Db::open(&args.database, &run_id, args.tcp_nodelay == "on").await?);
    let broker = match broker::open(&args.transport, &run_id).await {
        Ok(b) => b,
        Err(e) => {
            if let Err(c) = db.cleanup().await {
                tracing::warn!(error = %c, "cleanup failed");
            }
            return Err(e);
        }
    };
    let payload: Vec<u8> = (0..args.payload_bytes)
        .map(|_| b'a' + rand::random::<u8>() % 26)
        .collect();
    let mut bench = Bench {
        report: Report {
            format: report::FORMAT,
            run_id: run_id.clone(),
            started_at: chrono::Utc::now().to_rfc3339(),
            ..Report::default()
        },
        args,
        db,
        broker,
        run_id,
        payload,
        clock: ClockOffset::default(),
    };
    let outcome = bench.scenarios().await;
    if let Err(e) = &outcome {
        bench.report.notes.push(format!("run aborted: {e:#}"));
    }
    let cleanup = if bench.args.keep {
        println!(
            "kept the run's tables ({}) and the broker's stream",
            bench.db.table("*")
        );
        Ok(())
    } else {
        let a = bench.db.cleanup().await;
        let b = bench.broker.cleanup().await;
        a.and(b)
    };
    bench.finish()?;
    outcome?;
    cleanup.context("cleanup after the run")
}

impl Bench {
    fn bar(&self, len: u64, prefix: &str) -> ProgressBar {
        if self.args.no_progress {
            return ProgressBar::hidden();
        }
        let b = ProgressBar::new(len).with_style(
            ProgressStyle::with_template(
                "{prefix:>28} [{bar:32.cyan/blue}] {human_pos:>9}/{human_len} {per_sec:1} [{elapsed}] {msg}",
            )
            .expect("valid template")
            .progress_chars("=> "),
        );
        b.set_prefix(prefix.to_owned());
        b
    }

    fn relay_config(&self, name: String) -> RelayConfig {
        RelayConfig {
            name,
            batch_size: self.args.batch_size,
            in_flight_batches: self.args.in_flight(),
            ..RelayConfig::default()
        }
    }

    fn router(&self, transport: Arc<dyn Transport>) -> Router {
        Router::new().route("*", transport, self.broker.destination())
    }

    async fn scenarios(&mut self) -> anyhow::Result<()> {
        let (version, settings) = self.db.server_info().await?;
        self.report.machine.cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
        self.report.machine.load_start = loadavg();
        self.report.database = report::DatabaseInfo {
            url: crate::redact(&self.args.database),
            backend: self.db.dialect.name().into(),
            version,
            settings,
        };
        self.report.transport = report::TransportInfo {
            url: self.args.transport.clone(),
            description: self.broker.describe(),
        };
        self.report.config = self.config_json();
        let mut samples = Vec::new();
        for _ in 0..20 {
            samples.push(self.db.clock_sample().await?);
        }
        self.clock = ClockOffset::estimate(&samples).expect("20 samples");
        self.report.clock = Some(self.clock);
        self.print_header();

        if self.args.runs(Scenario::Broker) {
            self.report.broker = Some(self.broker_run().await?);
        }
        if self.args.runs(Scenario::Baseline) || self.args.runs(Scenario::Drain) {
            self.baselines_and_drain().await?;
        }
        if self.args.runs(Scenario::Scaling) {
            for k in self.args.relays.clone() {
                let reuse = k == 1 && self.report.drain.is_some();
                let d = if reuse {
                    self.report.drain.clone().expect("checked")
                } else {
                    let table = self.db.table(&format!("scale{k}"));
                    self.backlog(&table).await?;
                    let d = self.relay_drain(&table, k).await?;
                    self.db.drop_outbox(&table).await?;
                    d
                };
                self.report.scaling.push(d);
            }
        }
        let business = self.db.table("orders");
        if self.args.runs(Scenario::Latency) || self.args.runs(Scenario::Enqueue) {
            self.db.create_business_table(&business).await?;
        }
        if self.args.runs(Scenario::Latency) {
            let mut runs = vec![
                (Wakeup::Embedded, Some(self.args.rate)),
                (Wakeup::Embedded, None),
                (Wakeup::External, Some(self.args.rate)),
                (Wakeup::External, None),
            ];
            if self.db.dialect == Dialect::Postgres {
                runs.extend([
                    (Wakeup::Trigger, Some(self.args.rate)),
                    (Wakeup::Trigger, None),
                ]);
            }
            for (wakeup, rate) in runs {
                let run = self.latency_run(&business, wakeup, rate).await?;
                self.report.latency.push(run);
            }
        }
        if self.args.runs(Scenario::Enqueue) {
            self.report.enqueue_fixed_rate =
                Some(self.enqueue_run(&business, Some(self.args.rate)).await?);
            self.report.enqueue = Some(self.enqueue_run(&business, None).await?);
        }
        if self.args.runs(Scenario::Idle) {
            self.report.idle = Some(self.idle_run().await?);
        }
        Ok(())
    }

    fn config_json(&self) -> BTreeMap<String, serde_json::Value> {
        let a = &self.args;
        let relay = RelayConfig::default();
        let mut m = BTreeMap::new();
        let mut put = |k: &str, v: serde_json::Value| {
            m.insert(k.to_owned(), v);
        };
        put(
            "scenarios",
            serde_json::json!(
                a.only
                    .iter()
                    .map(|s| format!("{s:?}").to_lowercase())
                    .collect::<Vec<_>>()
            ),
        );
        put("messages", a.messages.into());
        put("payload_bytes", a.payload_bytes.into());
        put("batch_size", a.batch_size.into());
        put("in_flight_batches", a.in_flight().into());
        put("broker_window", a.broker_window.into());
        put("relays", serde_json::json!(a.relays));
        put("rate", a.rate.into());
        put("producers", a.producers.into());
        put("latency_seconds", a.latency_duration.as_secs_f64().into());
        put("warmup_seconds", a.warmup().as_secs_f64().into());
        put("enqueue_seconds", a.enqueue_duration.as_secs_f64().into());
        put("idle_seconds", a.idle_duration.as_secs_f64().into());
        put(
            "relay_poll_interval_ms",
            (relay.poll_interval.as_millis() as u64).into(),
        );
        put("relay_lease_ms", (relay.lease.as_millis() as u64).into());
        put("tcp_nodelay", (a.tcp_nodelay == "on").into());
        m
    }

    fn print_header(&self) {
        let r = &self.report;
        let settings: Vec<String> = r
            .database
            .settings
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        println!(
            "outbox bench {}: {} {} ({})",
            self.run_id,
            r.database.backend,
            r.database.version,
            settings.join(", ")
        );
        println!("  broker: {}", r.transport.description);
        println!(
            "  {} messages of {} B, batch {}, {} batch(es) in flight, TCP_NODELAY {}; {} CPUs, load {}; clock offset {} µs ± {} µs",
            fmt_count(self.args.messages as f64),
            self.args.payload_bytes,
            self.args.batch_size,
            self.args.in_flight(),
            self.args.tcp_nodelay,
            r.machine.cpus,
            fmt_load(r.machine.load_start),
            self.clock.offset_us,
            self.clock.uncertainty_us
        );
    }

    /// Create outbox table `table` and fill it with `--messages` messages.
    async fn backlog(&self, table: &str) -> anyhow::Result<()> {
        self.db.migrate(table).await?;
        let bar = self.bar(self.args.messages, &format!("load {table}"));
        self.db
            .load(table, self.args.messages, &self.payload, TOPIC, &bar)
            .await?;
        bar.finish_and_clear();
        Ok(())
    }

    /// Sample `progress` every [`TICK`] until `work` ends; at each tenth of `n`, read the
    /// table's statistics (PostgreSQL).
    async fn watch(
        &self,
        bar: &ProgressBar,
        n: u64,
        table: Option<&str>,
        progress: impl Fn() -> u64,
        work: JoinHandle<anyhow::Result<()>>,
    ) -> anyhow::Result<Watched> {
        let start = Instant::now();
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
        result.context("drain task panicked")??;
        samples.push((seconds, progress()));
        bar.finish_and_clear();
        Ok(Watched {
            seconds,
            samples,
            at_decile,
        })
    }

    /// Check a drain of `table` left nothing behind and the broker holds every message.
    async fn verify(&self, name: &str, table: &str) -> anyhow::Result<Option<u64>> {
        let n = self.args.messages;
        let stats = Outbox::open(&self.db.control, table)?
            .store()
            .stats()
            .await?;
        let count = |s| stats.counts.get(&s).copied().unwrap_or(0);
        let left = count(Status::Pending) + count(Status::Sending);
        let failed = count(Status::Failed);
        if left > 0 || failed > 0 {
            bail!(
                "{name}: {left} message(s) still pending or sending and {failed} failed after the drain"
            );
        }
        let stored = self.broker.stored().await?;
        if let Some(s) = stored
            && s < n
        {
            bail!("{name}: the broker holds {s} of the {n} messages published");
        }
        Ok(stored)
    }

    /// The raw broker publish run: `--messages` through the transport, no database.
    async fn broker_run(&mut self) -> anyhow::Result<Drain> {
        let n = self.args.messages;
        self.broker.reset().await?;
        let load_start = loadavg();
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
        let bar = self.bar(n, "broker publish (no database)");
        let w = self
            .watch(&bar, n, None, || done.load(Ordering::Relaxed), work)
            .await?;
        let stored = self.broker.stored().await?;
        if let Some(s) = stored
            && s < n
        {
            bail!("raw broker run: the broker holds {s} of the {n} messages published");
        }
        Ok(self.drain_result("broker", 1, &w, load_start, stored, None, None))
    }

    #[allow(clippy::too_many_arguments)]
    fn drain_result(
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
            ..Drain::default()
        }
    }

    /// The backlog shared by the baselines and the drain: loaded once, copied for each loop.
    async fn baselines_and_drain(&mut self) -> anyhow::Result<()> {
        let table = self.db.table("drain");
        self.backlog(&table).await?;
        if self.args.runs(Scenario::Baseline) {
            for index in [raw::Index::Naive, raw::Index::Tuned] {
                let copy = self.db.table(&index.name().replace('-', "_"));
                if !raw::prepare(&self.db, &table, &copy, index).await? {
                    self.report.notes.push(format!(
                        "{}: not run on {} (no partial indexes)",
                        index.name(),
                        self.db.dialect.name()
                    ));
                    continue;
                }
                let d = self.raw_drain(&copy, index).await?;
                self.db.drop_table(&copy).await?;
                match index {
                    raw::Index::Naive => self.report.baseline_naive = Some(d),
                    raw::Index::Tuned => self.report.baseline_tuned = Some(d),
                }
            }
        }
        if self.args.runs(Scenario::Drain) {
            self.report.drain = Some(self.relay_drain(&table, 1).await?);
        }
        self.db.drop_outbox(&table).await
    }

    /// One raw-SQL loop drains `table`.
    async fn raw_drain(&self, table: &str, index: raw::Index) -> anyhow::Result<Drain> {
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
            let (transport, destination) = (
                self.broker.transport(),
                self.broker.destination().to_owned(),
            );
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
    async fn pg_cost(
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

    async fn growth(
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

    /// `relays` relay instances drain `table` (already loaded).
    async fn relay_drain(&self, table: &str, relays: usize) -> anyhow::Result<Drain> {
        let n = self.args.messages;
        self.db.settle(table).await?;
        self.broker.reset().await?;
        let before = self.db.table_stats(table).await?;
        let counters = self.db.pg_counters(table).await?;
        let load_start = loadavg();
        let mut pools = Vec::new();
        let mut instances = Vec::new();
        for i in 0..relays {
            let pool = self.db.pool(&format!("relay{i}"), true, 10).await?;
            let store = Outbox::open(&pool.pool, table)?.store();
            let relay = Relay::builder(store)
                .router(self.router(self.broker.transport()))
                .config(self.relay_config(format!("bench-{}-r{i}", self.run_id)))
                .build()?;
            pools.push(pool);
            instances.push(relay);
        }
        let metrics: Vec<Arc<RelayMetrics>> =
            instances.iter().map(|r| r.metrics().clone()).collect();
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
            .await?;
        let s1 = StatementCounter::read();
        for p in pools {
            self.db.retire(p).await?;
        }
        let stored = self.verify(&format!("relay x{relays}"), table).await?;
        let cost = self
            .pg_cost(table, counters, Some((s1.0 - s0.0, s1.1 - s0.1)))
            .await?;
        let growth = self.growth(table, before, &w).await?;
        Ok(self.drain_result("relay", relays, &w, load_start, stored, cost, growth))
    }

    /// Producers commit business transactions for `--latency-duration` while one relay
    /// publishes; commit → ack latencies of the messages committed after the warm-up.
    async fn latency_run(
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
        let pool = self.db.pool("latency-relay", true, 10).await?;
        let store = Outbox::open(&pool.pool, &table)?.store();
        let relay = Relay::builder(store.clone())
            .router(self.router(Arc::new(Stamped::new(
                self.broker.transport(),
                acks.clone(),
            ))))
            .config(self.relay_config(format!("bench-{}-latency", self.run_id)))
            .build()?;
        let s0 = StatementCounter::read();
        let handle = relay.spawn();

        let duration = self.args.latency_duration;
        let producers = self.args.producers;
        let start = Instant::now();
        let deadline = start + duration;
        let warm_us = now_us() + self.args.warmup().as_micros() as i64;
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
                    let msg = NewMessage::new(TOPIC, payload.clone());
                    let t = db
                        .business_tx(
                            &outbox,
                            &business,
                            &format!("customer-{i}"),
                            Some(msg),
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
        let bar = self.bar(duration.as_secs(), &format!("latency {label}"));
        let txs: Vec<TxTimes> = {
            let mut tick = tokio::time::interval(Duration::from_millis(200));
            let all = futures::future::try_join_all(tasks);
            tokio::pin!(all);
            let results = loop {
                tokio::select! {
                    r = &mut all => break r?,
                    _ = tick.tick() => {
                        bar.set_position(start.elapsed().as_secs().min(duration.as_secs()));
                        bar.set_message(format!("{} acked, load {}", acks.count(), fmt_load(loadavg())));
                    }
                }
            };
            let mut txs = Vec::new();
            for r in results {
                txs.extend(r?);
            }
            txs
        };
        bar.finish_and_clear();
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
        let id = |t: &TxTimes| t.message_id.expect("latency transactions enqueue");
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
        })
    }

    /// Alternating rounds of business transactions without and with the outbox insert (with
    /// `store.begin()` / `store.commit(tx)`; on PostgreSQL also with a plain transaction, whose
    /// trigger NOTIFY is sent inside it).
    /// At `offered` transactions/s in total (open loop), or at the producers' maximum.
    async fn enqueue_run(&self, business: &str, offered: Option<f64>) -> anyhow::Result<Enqueue> {
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
                            let msg = enqueue.then(|| NewMessage::new(TOPIC, payload.clone()));
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
    async fn idle_run(&self) -> anyhow::Result<Idle> {
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

    /// Fill ratios and targets, print the tables, write the JSON.
    fn finish(&mut self) -> anyhow::Result<()> {
        self.report.finished_at = chrono::Utc::now().to_rfc3339();
        self.report.machine.load_end = loadavg();
        report::fill_ratios(&mut self.report);
        self.report.targets = report::targets(&self.report);
        print!("{}", render(&self.report));
        let json = serde_json::to_string_pretty(&self.report)?;
        std::fs::write(&self.args.json, json + "\n")
            .with_context(|| format!("cannot write {}", self.args.json.display()))?;
        println!("JSON report written to {}", self.args.json.display());
        Ok(())
    }
}

/// The report as text tables (every figure with the 1-minute load beside it).
fn render(r: &Report) -> String {
    let mut out = String::new();
    let mut section = |title: &str, t: &Table| {
        if !t.is_empty() {
            out.push_str(&format!("\n{title}\n{}", t.render()));
        }
    };
    let label = |d: &Drain| match d.name.as_str() {
        "broker" => "broker publish, no database".to_owned(),
        "raw-naive" => "raw SQL loop, index (status, available_at)".to_owned(),
        "raw-tuned" => "raw SQL loop, partial index on pending".to_owned(),
        _ => format!("outbox::Relay x{}", d.relays),
    };
    let mut drains: Vec<&Drain> = [&r.broker, &r.baseline_naive, &r.baseline_tuned, &r.drain]
        .into_iter()
        .flatten()
        .collect();
    drains.extend(
        r.scaling
            .iter()
            .filter(|d| d.relays != 1 || r.drain.is_none()),
    );

    let mut t = Table::new([
        "throughput",
        "msg/s",
        "x naive",
        "x tuned",
        "x broker",
        "x 1 relay",
        "last/first 10%",
        "seconds",
        "load",
    ]);
    for d in &drains {
        t.row([
            label(d),
            fmt_count(d.rate),
            fmt_ratio(d.vs_naive),
            fmt_ratio(d.vs_tuned),
            fmt_ratio(d.vs_broker),
            fmt_ratio(d.vs_one_relay),
            d.flatness.map_or("-".into(), |f| format!("{f:.2}")),
            format!("{:.1}", d.seconds),
            fmt_load(d.load),
        ]);
    }
    section("Throughput (ratios against the baselines of this run)", &t);

    let mut t = Table::new(
        std::iter::once("rate per tenth (msg/s)".to_owned())
            .chain((1..=10).map(|k| format!("{}%", k * 10))),
    );
    for d in drains.iter().filter(|d| !d.deciles.is_empty()) {
        t.row(std::iter::once(label(d)).chain(d.deciles.iter().map(|v| fmt_count(*v))));
    }
    section("Rate in each tenth of the drain", &t);

    let mut t = Table::new([
        "database cost",
        "stmts/msg",
        "rows affected/msg",
        "pg rows written/msg",
        "ins/upd/del",
        "dead tuples before -> after",
        "index size before -> after",
        "load",
    ]);
    for d in drains
        .iter()
        .filter(|d| d.cost.is_some() || d.table.is_some())
    {
        let c = d.cost.as_ref();
        let pg = c.and_then(|c| c.pg.as_ref());
        let stmts = c.filter(|c| c.statements > 0);
        t.row([
            label(d),
            stmts.map_or("-".into(), |c| format!("{:.4}", c.statements_per_message)),
            stmts.map_or("-".into(), |c| {
                format!("{:.2}", c.rows_affected_per_message)
            }),
            pg.map_or("-".into(), |p| format!("{:.2}", p.rows_written_per_message)),
            pg.map_or("-".into(), |p| {
                format!("{}/{}/{}", p.inserted, p.updated, p.deleted)
            }),
            d.table.as_ref().map_or("-".into(), |g| {
                format!(
                    "{} -> {}",
                    fmt_count(g.before.dead_tuples as f64),
                    fmt_count(g.after.dead_tuples as f64)
                )
            }),
            d.table.as_ref().map_or("-".into(), |g| {
                format!(
                    "{} -> {}",
                    fmt_mib(g.before.index_bytes),
                    fmt_mib(g.after.index_bytes)
                )
            }),
            fmt_load(d.load),
        ]);
    }
    section("Database cost of the drains", &t);

    let mut t = Table::new([
        "commit -> ack (ms)",
        "offered/s",
        "commits/s",
        "p50",
        "p90",
        "p99",
        "max",
        "received p50",
        "received p99",
        "stmts/msg",
        "load",
    ]);
    for l in &r.latency {
        let p = l.commit_to_ack;
        let q = l.commit_to_received;
        t.row([
            format!("wake-up {}", l.wakeup),
            l.offered_rate.map_or("max".into(), fmt_count),
            fmt_count(l.commit_rate),
            fmt_ms(p.map(|p| p.p50_ms)),
            fmt_ms(p.map(|p| p.p90_ms)),
            fmt_ms(p.map(|p| p.p99_ms)),
            fmt_ms(p.map(|p| p.max_ms)),
            fmt_ms(q.map(|p| p.p50_ms)),
            fmt_ms(q.map(|p| p.p99_ms)),
            l.relay_statements_per_message
                .map_or("-".into(), |s| format!("{s:.3}")),
            fmt_load(l.load),
        ]);
    }
    section(
        "Steady state: database clock before COMMIT -> broker ack (relay) / received (subscriber)",
        &t,
    );

    for e in [&r.enqueue_fixed_rate, &r.enqueue].into_iter().flatten() {
        let mut t = Table::new([
            "business transaction",
            "tx/s",
            "tx p50 ms",
            "tx p99 ms",
            "commit p50 ms",
            "commit p99 ms",
            "load",
        ]);
        let mut variants = vec![
            ("without outbox", &e.without),
            ("with outbox (store.begin/commit)", &e.with_outbox),
        ];
        if let Some(w) = &e.with_outbox_trigger {
            variants.push(("with outbox (NOTIFY in the tx)", w));
        }
        for (name, v) in variants {
            t.row([
                name.to_owned(),
                fmt_count(v.rate),
                fmt_ms(v.transaction.map(|p| p.p50_ms)),
                fmt_ms(v.transaction.map(|p| p.p99_ms)),
                fmt_ms(v.commit.map(|p| p.p50_ms)),
                fmt_ms(v.commit.map(|p| p.p99_ms)),
                fmt_load(e.load),
            ]);
        }
        let pct = |o: Option<f64>| o.map_or("-".into(), |o| format!("{:+.1}%", o * 100.0));
        t.row([
            "overhead (store.begin/commit)".to_owned(),
            String::new(),
            pct(e.overhead_p50),
            pct(e.overhead_p99),
        ]);
        if e.with_outbox_trigger.is_some() {
            t.row([
                "overhead (NOTIFY in the tx)".to_owned(),
                String::new(),
                pct(e.overhead_trigger_p50),
                pct(e.overhead_trigger_p99),
            ]);
        }
        let title = match e.offered_rate {
            Some(r) => format!("Enqueue overhead at {} transactions/s", fmt_count(r)),
            None => "Enqueue overhead at the producers' maximum".to_owned(),
        };
        section(&title, &t);
    }

    if let Some(i) = &r.idle {
        let mut t = Table::new([
            "idle relay",
            "stmts/s",
            "stmts/poll interval",
            "table scans/s",
            "db commits/s (all clients)",
            "load",
        ]);
        t.row([
            format!(
                "poll interval {} ms, {:.0} s",
                i.poll_interval_ms, i.seconds
            ),
            format!("{:.2}", i.statements_per_second),
            format!("{:.2}", i.statements_per_poll_interval),
            i.table_scans_per_second
                .map_or("-".into(), |v| format!("{v:.2}")),
            i.db_commits_per_second_all_clients
                .map_or("-".into(), |v| format!("{v:.2}")),
            fmt_load(i.load),
        ]);
        section("Idle cost", &t);
    }

    let mut t = Table::new(["target (issue 6)", "goal", "measured", "met"]);
    for g in &r.targets {
        t.row([
            g.name.clone(),
            g.goal.clone(),
            g.value.map_or("-".into(), |v| format!("{v:.2}")),
            match g.met {
                Some(true) => "yes".into(),
                Some(false) => "NO".into(),
                None => "not measured".into(),
            },
        ]);
    }
    section("Targets", &t);
    for n in &r.notes {
        out.push_str(&format!("note: {n}\n"));
    }
    out
}

#[cfg(test)]
mod tests;
