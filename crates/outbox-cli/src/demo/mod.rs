//! `outbox demo`: the order → inventory story end to end, with faults injected, through the
//! whole state machine (docs/design/DESIGN.md §4, §9).
//!
//! Two services, each with its own database:
//! - the **order service** writes an order row (status `PLACED`) and an `order-created` outbox
//!   message in one local transaction ([`outbox::SqliteStore`], [`outbox::PgStore`] or
//!   [`outbox::MySqlStore`]), and
//!   serves a confirmation endpoint (an axum route, or a NATS subject it listens on);
//! - the **inventory service** receives the message (webhook or NATS JetStream) and, in one
//!   transaction with its [`outbox::Inbox`] row, deducts stock and appends to a deduction log, or
//!   refuses an order that asks for more than the stock holds
//!   ([`HandlerError::reject`]: nothing is deducted); it then confirms its verdict to the order
//!   service.
//!
//! The `order-created` route requires confirmation: a `processed` verdict moves the outbox row
//! SENT → CONFIRMED; a `rejected` one moves it to REJECTED and runs the order service's
//! rejection hook in the same producer transaction, which cancels the order and enqueues an
//! `order-cancelled` event through the outbox. A confirmation that is lost is recovered by the
//! relay's check-back: the message is published again, the inbox recognises the copy and sends
//! the recorded verdict again.
//!
//! Between them an embedded [`outbox::Relay`] publishes through a fault-injecting transport
//! (deliveries lost before the consumer, acknowledgements lost after it committed, duplicated
//! deliveries) and is killed and restarted without cleanup a few times; the consumer's
//! confirmations are dropped at a configurable rate. At the end the demo checks that every order
//! ended either deducted once and CONFIRMED or CANCELLED with nothing deducted, and prints a
//! report; a broken promise is an error (non-zero exit).
//!
//! `--two-phase` runs another story instead ([`two_phase`]): an order service whose orders are
//! in a different database from its outbox, using two-phase messages, a barrier and check-backs.

mod consumers;
mod delivery;
mod faults;
mod report;
mod scenario;
mod services;
mod two_phase;

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use anyhow::{Context, bail, ensure};
use outbox::consumer::ConsumerMetrics;
use outbox::{ConfirmPolicy, ConfirmationSender, Status};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use delivery::Delivery;
use faults::{FaultStats, Faults, LossyConfirmations, RelaySupervisor};
use report::{Bars, Report};
use scenario::{InventoryHandler, Timeline};
use services::{Services, each_db};

/// Topic of the message the order service publishes for each order (confirmation required).
const TOPIC: &str = "order-created";
/// Topic of the event the rejection hook enqueues when the inventory service refused an order.
const CANCELLED_TOPIC: &str = "order-cancelled";
/// Order status at placement.
const PLACED: &str = "PLACED";
/// Order status after the inventory service refused the order.
const CANCELLED: &str = "CANCELLED";
/// Consumer name of the inventory service, in the inbox and as the JetStream durable.
const CONSUMER: &str = "inventory";
/// Products on sale; order `n` buys `SKUS[n % SKUS.len()]`.
const SKUS: [&str; 8] = [
    "apple",
    "banana",
    "cherry",
    "date",
    "elderberry",
    "fig",
    "grape",
    "kiwi",
];
/// How often the monitor refreshes the progress bars and checks for the drain.
const TICK: Duration = Duration::from_millis(100);

/// Options of `outbox demo`.
#[derive(Debug, Clone, clap::Args)]
pub struct DemoArgs {
    /// Orders to place.
    #[arg(long, default_value_t = 10_000)]
    pub orders: usize,

    /// Concurrent clients placing orders.
    #[arg(long, default_value_t = 16)]
    pub clients: usize,

    /// Orders/s of the paced phase, which follows the burst of `--orders` once it drained: its
    /// commit-to-effect latency is what a user sees at a load the services sustain (the burst's
    /// is mostly queueing behind the burst). 0 skips the paced phase.
    #[arg(long, default_value_t = 100.0, value_parser = parse_rate)]
    pub rate: f64,

    /// Orders of the paced phase.
    #[arg(long, default_value_t = 500)]
    pub paced_orders: usize,

    /// Directory of the two SQLite databases (orders.db, inventory.db; with --two-phase
    /// outbox-2pc.db, orders-2pc.db and consumer-2pc.db); the demo's files in it are deleted at
    /// start.
    #[arg(long, default_value = "./demo-data")]
    pub data_dir: PathBuf,

    /// Run both services on this PostgreSQL (`postgres://user@host:port/db`) or MySQL/MariaDB
    /// (`mysql://user@host:3306/db`) database instead of SQLite files; the demo_* tables are
    /// dropped and recreated at start. With --two-phase: the outbox's database (tables
    /// demo_2pc_outbox*, dropped and recreated at start).
    #[arg(long, value_name = "URL")]
    pub database: Option<String>,

    /// Run the two-phase story instead: the order service keeps its orders in another database
    /// than its outbox, and places each order by prepare, business transaction with a barrier
    /// mark, commit, with crashing producers recovered by the relay's check-back (see
    /// `--orders-database`). The fault and relay-kill options do not apply to it.
    #[arg(long)]
    pub two_phase: bool,

    /// With --two-phase: the order service's business database, PostgreSQL or MySQL/MariaDB
    /// (tables demo_2pc_orders and demo_2pc_barrier, dropped and recreated at start); default
    /// the SQLite file orders-2pc.db in --data-dir.
    #[arg(long, value_name = "URL", requires = "two_phase")]
    pub orders_database: Option<String>,

    /// Deliver over NATS JetStream (`nats://host:port`; the DEMO_ORDERS stream is deleted and
    /// recreated at start), Redis Streams (`redis://host:port`; the demo:orders and
    /// demo:confirmations streams are reset), MQTT 5 (`mqtt://host:port`), RabbitMQ
    /// (`amqp://user:password@host:5672/%2f`; the demo.inventory and demo.confirmations queues are
    /// deleted and recreated at start), Kafka (`kafka://host:port`; fresh `demo-<run>.*` topics are
    /// created at start) or RocketMQ (`rocketmq://host:port`, with the `rocketmq` cargo feature:
    /// fresh topics per run) instead of webhooks.
    #[arg(long, value_name = "URL")]
    pub transport: Option<String>,

    /// Fraction of deliveries lost before they reach the consumer.
    #[arg(long, default_value_t = 0.10, value_parser = parse_fraction)]
    pub loss_before: f64,

    /// Fraction of acknowledgements lost after the consumer committed.
    #[arg(long, default_value_t = 0.10, value_parser = parse_fraction)]
    pub loss_after: f64,

    /// Fraction of deliveries sent twice.
    #[arg(long, default_value_t = 0.05, value_parser = parse_fraction)]
    pub duplicate: f64,

    /// Times the relay is killed (aborted without cleanup) and restarted during the run.
    #[arg(long, default_value_t = 3)]
    pub kills: usize,

    /// Fraction of orders asking for more than the stock holds; the inventory service rejects
    /// them and the order service cancels them.
    #[arg(long, default_value_t = 0.10, value_parser = parse_fraction)]
    pub oversized: f64,

    /// Fraction of the consumer's confirmations dropped on the way to the order service; the
    /// relay's check-back recovers them.
    #[arg(long, default_value_t = 0.10, value_parser = parse_fraction)]
    pub lost_confirmations: f64,

    /// How long the order service waits for a confirmation before checking the message back.
    #[arg(long, default_value = "4s", value_parser = humantime::parse_duration)]
    pub confirm_timeout: Duration,

    /// Check-backs of an unconfirmed message before it is dead-lettered as unconfirmed.
    #[arg(long, default_value_t = 5)]
    pub max_check_backs: u32,

    /// Most messages the inventory service applies in one inbox transaction: the broker
    /// consumers' `runner.inbox_batch`, and group commit of concurrent requests for the webhook
    /// receiver (`DeliveryPolicy::inbox_batch`). 1 applies each message in its own transaction.
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u16).range(1..=1000))]
    pub inbox_batch: u16,

    /// Longest time to wait for every order to take effect before giving up.
    #[arg(long, default_value = "5m", value_parser = humantime::parse_duration)]
    pub timeout: Duration,
}

fn parse_rate(s: &str) -> Result<f64, String> {
    let f: f64 = s
        .parse()
        .map_err(|e| format!("{s:?} is not a number: {e}"))?;
    if f.is_finite() && (0.0..=1_000_000.0).contains(&f) {
        Ok(f)
    } else {
        Err(format!("{f} is not a rate from 0 to 1000000 orders/s"))
    }
}

impl DemoArgs {
    /// Orders of the paced phase: `--paced-orders`, or 0 when `--rate` is 0.
    pub(crate) fn paced(&self) -> usize {
        if self.rate > 0.0 {
            self.paced_orders
        } else {
            0
        }
    }

    /// Orders of both phases: the burst's `--orders`, then the paced phase's.
    pub(crate) fn total_orders(&self) -> usize {
        self.orders + self.paced()
    }
}

fn parse_fraction(s: &str) -> Result<f64, String> {
    let f: f64 = s
        .parse()
        .map_err(|e| format!("{s:?} is not a number: {e}"))?;
    if (0.0..1.0).contains(&f) {
        Ok(f)
    } else {
        Err(format!("{f} is not a fraction in [0, 1)"))
    }
}

/// Run the demo; an invariant failure is an error (non-zero exit).
pub async fn run(args: DemoArgs) -> anyhow::Result<()> {
    if args.two_phase {
        return two_phase::run(&args).await;
    }
    ensure!(args.orders > 0, "--orders must be at least 1");
    ensure!(args.clients > 0, "--clients must be at least 1");
    ensure!(
        !args.confirm_timeout.is_zero(),
        "--confirm-timeout must be greater than zero"
    );
    let started = Instant::now();
    let services = Services::open(&args).await?;
    let delivery = Delivery::open(args.transport.as_deref()).await?;
    println!(
        "outbox demo: {} orders from {} clients at full speed{}; order and inventory services on \
         {}, delivery over {}",
        args.orders,
        args.clients,
        match args.paced() {
            0 => String::new(),
            n => format!(", then {n} at {} orders/s", args.rate),
        },
        services.describe(&args),
        delivery.describe()
    );
    println!(
        "faults: {:.0}% of deliveries lost before the consumer, {:.0}% of acknowledgements lost, \
         {:.0}% duplicated, {:.0}% of confirmations lost; relay killed {} times",
        args.loss_before * 100.0,
        args.loss_after * 100.0,
        args.duplicate * 100.0,
        args.lost_confirmations * 100.0,
        args.kills
    );
    println!(
        "business: {:.0}% of orders ask for more than the stock holds (rejected, then cancelled); \
         confirmations due within {}, checked back up to {} times",
        args.oversized * 100.0,
        humantime::format_duration(args.confirm_timeout),
        args.max_check_backs
    );

    let total = args.total_orders();
    let timeline = Arc::new(Timeline::new(total));
    let consumer_metrics = Arc::new(ConsumerMetrics::default());
    let fault_stats = Arc::new(FaultStats::default());
    let cancel = CancellationToken::new();

    // The order service's confirmation endpoint, then the inventory service, which confirms to it.
    let (reply_to, listener) = delivery
        .start_confirmation_listener(services.store(), &cancel)
        .await?;
    let confirmations: Arc<dyn ConfirmationSender> = Arc::new(LossyConfirmations {
        inner: delivery.confirmation_sender(),
        rate: args.lost_confirmations,
        stats: fault_stats.clone(),
    });
    let handler = Arc::new(InventoryHandler {
        tables: services.tables(),
        timeline: timeline.clone(),
    });
    let (endpoint, mut tasks) = each_db!(&services, inbox, |inbox| {
        delivery
            .start_consumer(
                inbox.clone(),
                handler,
                confirmations,
                consumer_metrics.clone(),
                usize::from(args.inbox_batch),
                &cancel,
            )
            .await?
    });
    tasks.push(listener);

    let faults = Faults {
        loss_before: args.loss_before,
        loss_after: args.loss_after,
        duplicate: args.duplicate,
    };
    let mut confirm = ConfirmPolicy::new(reply_to);
    confirm.timeout = args.confirm_timeout;
    // The relays' counters, the outbox backlog, the inventory consumer's counters and the
    // confirmations applied, served while the demo runs.
    let mut registry = prometheus_client::registry::Registry::default();
    registry.register_collector(Box::new(outbox::prometheus::BacklogCollector::spawn(
        services.store(),
        Duration::from_secs(1),
        cancel.clone(),
    )));
    outbox::prometheus::register_consumer(&mut registry, "inventory", consumer_metrics.clone());
    registry.register_collector(Box::new(outbox::prometheus::ConfirmationCollector));
    let registry = Arc::new(std::sync::Mutex::new(registry));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let metrics_addr = crate::admin::serve(
        listener,
        crate::admin::metrics_router(registry.clone()),
        cancel.clone(),
    )?;
    println!("metrics while it runs: http://{metrics_addr}/metrics");
    let mut relays = RelaySupervisor {
        store: services.store(),
        delivery: &delivery,
        endpoint: &endpoint,
        faults,
        fault_stats: fault_stats.clone(),
        confirm,
        max_check_backs: args.max_check_backs,
        current: None,
        metrics: Vec::new(),
        registry,
    };
    relays.start().await?;

    // The clients: each order is one local transaction (order row + outbox row). First the
    // burst of `--orders` at full speed; once it drained, the paced phase.
    let placed = Arc::new(AtomicUsize::new(0));
    let mut clients =
        scenario::spawn_clients(&args, &services, &timeline, &placed, 1..=args.orders, None);
    let mut burst: Option<Duration> = None;

    // Monitor: progress bars, scheduled relay kills (during the burst), and the drain checks.
    let bars = Bars::new(total);
    let deadline = started + args.timeout;
    let mut tick = tokio::time::interval(TICK);
    let mut kills_done = 0;
    let drained = loop {
        tick.tick().await;
        reap_clients(&mut clients, "an order client")?;
        let placed_now = placed.load(Ordering::Relaxed);
        // Effects are counted in the inventory database: a delivery whose HTTP exchange was cut
        // by a relay kill may have committed without the receiver counting it.
        let applied = services.orders_with_deduction().await?;
        let refused = consumer_metrics.rejected.load(Ordering::Relaxed);
        let stats = services.store().stats().await?;
        let count = |s| stats.counts.get(&s).copied().unwrap_or(0);
        let verdicts = count(Status::Confirmed) + count(Status::Rejected);
        bars.update(
            placed_now,
            applied + refused,
            verdicts,
            kills_done,
            args.kills,
        );
        // Kill k of n when (k / (n + 1)) of the burst's orders have been processed by the
        // consumer.
        if kills_done < args.kills
            && (applied + refused) as usize >= args.orders * (kills_done + 1) / (args.kills + 1)
        {
            relays.kill_and_restart().await?;
            kills_done += 1;
        }
        // Drained: every order placed, nothing left to publish (orders and cancellations), and no
        // order-created message still waiting for its consumer's verdict.
        let target = if burst.is_some() { total } else { args.orders };
        if placed_now == target
            && clients.is_empty()
            && count(Status::Pending) == 0
            && count(Status::Sending) == 0
            && stats.awaiting_confirmation == 0
            && verdicts >= target as u64
        {
            if burst.is_some() || args.paced() == 0 {
                burst.get_or_insert_with(|| started.elapsed());
                break true;
            }
            burst = Some(started.elapsed());
            clients = scenario::spawn_clients(
                &args,
                &services,
                &timeline,
                &placed,
                args.orders + 1..=total,
                Some(args.rate),
            );
        }
        if Instant::now() >= deadline {
            break false;
        }
    };
    bars.finish();
    let elapsed = started.elapsed();

    relays.shutdown().await?;
    stop_services(&cancel, tasks).await?;

    let report = Report::gather(
        &services,
        &timeline,
        &consumer_metrics,
        &fault_stats,
        &relays.metrics,
        kills_done,
        report::Phases {
            burst: args.orders,
            burst_elapsed: burst.unwrap_or(elapsed),
            rate: args.rate,
            paced: args.paced(),
            elapsed,
        },
    )
    .await?;
    report.print(&delivery);
    conclude(drained, args.timeout, "", || report.verdict())
}

/// Take the finished tasks of `clients`, each placing orders: the first that panicked (`<who>
/// panicked`) or failed (`placing an order failed`) is the error. The demo and the two-phase
/// demo call it on every tick.
fn reap_clients(
    clients: &mut tokio::task::JoinSet<anyhow::Result<()>>,
    who: &str,
) -> anyhow::Result<()> {
    while let Some(joined) = clients.try_join_next() {
        joined
            .with_context(|| format!("{who} panicked"))?
            .context("placing an order failed")?;
    }
    Ok(())
}

/// Stop the demo's services (`cancel`) and wait for their tasks: the first error of one.
async fn stop_services(
    cancel: &CancellationToken,
    tasks: Vec<delivery::ServiceTask>,
) -> anyhow::Result<()> {
    cancel.cancel();
    for t in tasks {
        t.await.context("service task panicked")??;
    }
    Ok(())
}

/// The end of a demo run whose report is printed: an error when it did not drain within
/// `timeout` (`note` after it), else the report's `verdict`.
fn conclude(
    drained: bool,
    timeout: Duration,
    note: &str,
    verdict: impl FnOnce() -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    if !drained {
        bail!(
            "the run did not drain within {}{note}",
            humantime::format_duration(timeout)
        );
    }
    verdict()
}
