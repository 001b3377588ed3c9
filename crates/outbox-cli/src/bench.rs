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
//! - `idle`: statements per second of a relay with nothing to do;
//! - `search` (not run unless named): the admin search on a `--search-rows` table without and
//!   with the optional search indexes, and the indexes' cost to the producers and the relay
//!   ([`search`]);
//! - `retention` (not run unless named; PostgreSQL): `--search-rows` rows removed past their
//!   retention row by row and by dropping day partitions ([`retention`]);
//! - `databases` (not run unless named; needs `--databases`): one relay group drains
//!   `--messages` in each of 1, 2, 4, … databases at once, with the CPU each side spent
//!   ([`databases`]);
//! - `consume` (not run unless named): a raw consumer against the inbox runner with one
//!   transaction per message and with `--inbox-batch` per transaction ([`consume`]);
//! - `pipeline` (not run unless named): end to end, producers → relay → broker → batched inbox
//!   consumer, at the producers' maximum and paced at half the end-to-end rate ([`pipeline`]);
//! - `metrics`: the cost of the Prometheus metrics: one relay drains `--messages` four times,
//!   without and with its metrics exported ([`outbox::prometheus::register`], the backlog
//!   sampled every second, `/metrics` encoded every 100 ms), in the order off, on, on, off.
//!
//! Brokers (`--transport`, see [`broker`]): NATS JetStream, Redis Streams, RabbitMQ, Kafka (any
//! Kafka-protocol broker) or an in-process sink, each through the library's own transport.
//!
//! Everything the run creates (a schema or `bench_<run>_*` tables, a JetStream stream, a Redis
//! stream key, a RabbitMQ queue) is removed at the end unless `--keep`; the Kafka topics are left
//! on the broker (the library has no topic deletion).

mod broker;
mod consume;
mod databases;
mod db;
mod drain;
mod pipeline;
mod producers;
mod raw;
mod render;
mod report;
mod retention;
mod search;

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
use render::render;
use report::{
    ClockOffset, Cost, Drain, Enqueue, EnqueueVariant, Idle, LatencyRun, MetricsCost, Percentiles,
    Report, Table, TableGrowth, fmt_count, fmt_load, fmt_mib, fmt_ms, fmt_ratio, loadavg,
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
    /// One relay drains with its Prometheus metrics exported and scraped, against one without
    /// (in the order off, on, on, off).
    Metrics,
    /// The admin search on a large table without and with the search indexes, and their cost.
    Search,
    /// Retention of a large table row by row against dropping day partitions (PostgreSQL).
    Retention,
    /// The consumer side: a raw consumer (acknowledge, no database) against the inbox runner
    /// with one transaction per message and with `--inbox-batch` messages per transaction.
    Consume,
    /// End to end: producers → relay → broker → batched inbox consumer, at the producers'
    /// maximum and paced at half the end-to-end rate.
    Pipeline,
    /// One relay group (the daemon's `[[databases]]`) drains `--messages` in each of 1, 2, 4, …
    /// databases at once (`--database`, then each `--databases`), with the CPU each side spent.
    Databases,
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
    /// the default exchange, deleted), `kafka://host:port` (topics `bench-<run>-<k>`, one per
    /// scenario, created and left on the broker; not counted) or `memory` (an in-process sink that acknowledges at
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

    /// Rows of the `search` scenario's table and of each of the `retention` scenario's.
    #[arg(long, default_value_t = 10_000_000)]
    pub search_rows: u64,

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

    /// Lanes (by partition key) of the consumers of the `consume` and `pipeline` scenarios
    /// (`runner.concurrency`).
    #[arg(long, default_value_t = 4)]
    pub consumer_lanes: usize,

    /// Messages per fetch of the consumers of the `consume` and `pipeline` scenarios.
    #[arg(long, default_value_t = 500)]
    pub consumer_fetch: usize,

    /// Most messages per inbox transaction of the batched consumer of the `consume` and `pipeline` scenarios
    /// (`runner.inbox_batch`).
    #[arg(long, default_value_t = 100)]
    pub inbox_batch: usize,

    /// Outbox messages per business transaction of the `pipeline` scenario's producers (the
    /// latency and enqueue scenarios commit one). Above 1 it shows how far the rest of the
    /// pipeline goes when the producers' commit rate is not what bounds it.
    #[arg(long, default_value_t = 1)]
    pub messages_per_transaction: usize,

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

    /// More databases for the `databases` scenario, after `--database` (each `postgres://…`,
    /// `mysql://…` or `sqlite://FILE`; repeat the option or give several after it). A database
    /// may be listed twice: each gets its own schema or tables. `.ci/pg-fleet.sh up N` makes N
    /// PostgreSQL clusters on this machine and prints their URLs.
    #[arg(long, num_args = 1..)]
    pub databases: Vec<String>,

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
        if self.search_rows < 1_000 {
            return Err("--search-rows must be at least 1000".into());
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
        if !(1..=256).contains(&self.consumer_lanes) {
            return Err("--consumer-lanes must be 1 to 256".into());
        }
        if !(1..=10_000).contains(&self.consumer_fetch) {
            return Err("--consumer-fetch must be 1 to 10000".into());
        }
        if !(1..=10_000).contains(&self.inbox_batch) {
            return Err("--inbox-batch must be 1 to 10000".into());
        }
        if !(1..=1_000).contains(&self.messages_per_transaction) {
            return Err("--messages-per-transaction must be 1 to 1000".into());
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
        db::dialect_of(&self.database).map_err(|e| e.to_string())?;
        for url in &self.databases {
            db::dialect_of(url).map_err(|e| format!("--databases: {e}"))?;
        }
        if self.runs(Scenario::Databases) && self.databases.is_empty() {
            return Err(
                "--only databases needs --databases: the databases to drain beside --database"
                    .into(),
            );
        }
        if self.databases.len() > 63 {
            return Err("--databases: at most 63 (64 with --database)".into());
        }
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

/// A drain watched to its end: wall time, progress samples and the CPU seconds each side spent
/// meanwhile (`databases::cpu_now`).
struct Watched {
    seconds: f64,
    samples: Vec<(f64, u64)>,
    at_decile: Vec<report::TableStats>,
    cpu_seconds: BTreeMap<String, f64>,
}

impl Watched {
    /// The sides that worked for the drain, a tenth of a core or more, with their CPU seconds:
    /// a server on the machine that took no part would show a meaningless figure.
    fn working_sides(&self) -> impl Iterator<Item = (&str, f64)> {
        self.cpu_seconds
            .iter()
            .filter(|(_, s)| **s > 0.0 && **s >= 0.1 * self.seconds)
            .map(|(side, s)| (side.as_str(), *s))
    }
}

struct Bench {
    args: BenchArgs,
    db: Arc<Db>,
    /// `--databases`, opened (the `databases` scenario).
    extra: Vec<Arc<Db>>,
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
    let mut extra: Vec<Arc<Db>> = Vec::new();
    let mut opened = Ok(());
    for (i, url) in args.databases.iter().enumerate() {
        // A run id of its own: the same server may be listed twice.
        match Db::open(
            url,
            &format!("{run_id}d{}", i + 1),
            args.tcp_nodelay == "on",
        )
        .await
        {
            Ok(d) => extra.push(Arc::new(d)),
            Err(e) => {
                opened = Err(e);
                break;
            }
        }
    }
    let broker = match opened.and(broker::open(&args.transport, &run_id).await) {
        Ok(b) => b,
        Err(e) => {
            for d in std::iter::once(&db).chain(&extra) {
                if let Err(c) = d.cleanup().await {
                    tracing::warn!(error = %c, "cleanup failed");
                }
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
        extra,
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
        let mut a = bench.db.cleanup().await;
        for d in &bench.extra {
            a = a.and(d.cleanup().await);
        }
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
        if self.args.runs(Scenario::Latency)
            || self.args.runs(Scenario::Enqueue)
            || self.args.runs(Scenario::Pipeline)
        {
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
        if self.args.runs(Scenario::Metrics) {
            self.report.metrics_cost = Some(self.metrics_cost().await?);
        }
        if self.args.runs(Scenario::Search) {
            self.report.search = Some(self.search_run().await?);
        }
        if self.args.runs(Scenario::Retention) {
            self.report.retention = Some(self.retention_run().await?);
        }
        if self.args.runs(Scenario::Consume) {
            self.report.consume = self.consume_run().await?;
        }
        if self.args.runs(Scenario::Pipeline) {
            self.report.pipeline = self.pipeline_runs(&business).await?;
        }
        if self.args.runs(Scenario::Databases) {
            self.databases_run().await?;
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
        put(
            "databases",
            serde_json::json!(
                std::iter::once(&a.database)
                    .chain(&a.databases)
                    .map(|u| crate::redact(u))
                    .collect::<Vec<_>>()
            ),
        );
        put("payload_bytes", a.payload_bytes.into());
        put("batch_size", a.batch_size.into());
        put("in_flight_batches", a.in_flight().into());
        put("broker_window", a.broker_window.into());
        put("consumer_lanes", a.consumer_lanes.into());
        put("consumer_fetch", a.consumer_fetch.into());
        put("inbox_batch", a.inbox_batch.into());
        put(
            "messages_per_transaction",
            a.messages_per_transaction.into(),
        );
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

#[cfg(test)]
mod tests;
